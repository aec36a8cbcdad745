// ce_probe: do peer copies queued from the host slow down while a kernel
// occupies the GPU's SMs? Not part of gin-rs; it explains the CUDA proxy's
// bandwidth with many blocks (docs/cuda.md).
// Build: nvcc -O3 -arch=sm_90 -o ce_probe ce_probe.cu
//
// A "busy" kernel of N blocks waits on a host-mapped flag; meanwhile the host
// queues `count` async copies of `bytes` from GPU 0 to GPU 1 (peer access
// on) plus a stream write after each, on another stream, and times them
// until the stream is done. Modes: "all" (every thread reads the host flag
// in a loop), "lead1us" (one thread per block reads it every microsecond,
// the rest wait at a barrier), "lead" (one thread per block, no pause),
// "clock20ms" (every thread spins on %globaltimer for 20 ms, touching no
// memory: the control), "lead100us" (as lead1us, every 100 us).
#include <cuda.h>
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
  printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)

__device__ unsigned long long gtime() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void busy(volatile int* stop, int mode) {
  if (mode == 3) {
    // No memory at all: spin on the clock for 20 ms.
    const unsigned long long t0 = gtime();
    while (gtime() - t0 < 20000000ull) {
    }
    return;
  }
  if (mode == 0) {
    while (*stop == 0) {
    }
    return;
  }
  if (threadIdx.x == 0)
    while (*stop == 0)
      if (mode == 1) __nanosleep(1000);
      else if (mode == 4) __nanosleep(100000);
  __syncthreads();
}

int main() {
  const size_t max = 4 << 20;
  void *src, *dst, *flag_dev;
  CK(cudaSetDevice(1));
  CK(cudaMalloc(&dst, max));
  CK(cudaSetDevice(0));
  CK(cudaDeviceEnablePeerAccess(1, 0));
  CK(cudaMalloc(&src, max));
  CK(cudaMalloc(&flag_dev, 64));
  int* stop;
  CK(cudaHostAlloc((void**)&stop, 64, cudaHostAllocMapped));
  int* stop_dev;
  CK(cudaHostGetDevicePointer((void**)&stop_dev, stop, 0));
  cudaStream_t ks, cs;
  CK(cudaStreamCreateWithFlags(&ks, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
  printf("%-7s %-8s %8s %6s %12s %10s\n", "blocks", "mode", "bytes", "count", "us per copy", "GB/s");
  const char* modes[] = {"all", "lead1us", "lead", "clock20ms", "lead100us"};
  for (int mode = 0; mode < 5; ++mode) {
    for (int blocks : {0, 16, 66, 132}) {
      for (size_t bytes : {(size_t)262144}) {
        const int count = 200;
        *stop = 0;
        if (blocks) busy<<<blocks, 512, 0, ks>>>(stop_dev, mode);
        CK(cudaGetLastError());
        // Let the busy kernel start.
        auto w = std::chrono::steady_clock::now();
        while (std::chrono::steady_clock::now() - w < std::chrono::milliseconds(5)) {}
        auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < count; ++i) {
          CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, cs));
          if (cuStreamWriteValue64(cs, (CUdeviceptr)flag_dev, i + 1, 0) != CUDA_SUCCESS) {
            printf("cuStreamWriteValue64 failed\n");
            return 1;
          }
        }
        CK(cudaStreamSynchronize(cs));
        double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
        *stop = 1;
        CK(cudaStreamSynchronize(ks));
        printf("%-7d %-8s %8zu %6d %12.2f %10.2f\n", blocks, modes[mode], bytes, count,
               us / count, bytes * (double)count / us / 1e3);
      }
    }
  }
  return 0;
}
