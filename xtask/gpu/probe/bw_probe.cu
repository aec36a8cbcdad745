// bw_probe: how the copy loop of gin.cuh's load/store put should look to
// reach NVLink's bandwidth with few blocks. Not part of gin-rs.
// Build: nvcc -O3 -arch=sm_90 -o bw_probe bw_probe.cu; run: ./bw_probe
//
// GPU 0's blocks copy a 4 MiB message, split into one slice per block, from
// GPU 0's memory into GPU 1's through peer access, 50 times back to back.
// Variants: threads per block, 16-byte vectors in flight per thread, and
// the load flavour (plain, or the non-coherent path without L1 allocation).
// GB/s from CUDA events around the launch, median of 5 launches.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>

typedef unsigned long long u64;
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
  printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)

template <int NC>
__device__ __forceinline__ uint4 ld(const uint4* p) {
  if (NC) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
  }
  return *p;
}

template <int U, int NC>
__global__ void copy(uint8_t* dst, const uint8_t* src, u64 bytes, int iters) {
  const u64 slice = (bytes / gridDim.x + 15) & ~15ull;
  const u64 off = slice * blockIdx.x;
  const u64 n = off >= bytes ? 0 : (bytes - off < slice ? bytes - off : slice);
  const u64 vecs = n / 16;
  const unsigned r = threadIdx.x, m = blockDim.x;
  uint4* d = (uint4*)(dst + off);
  const uint4* s = (const uint4*)(src + off);
  for (int it = 0; it < iters; ++it) {
    u64 i = r;
    for (; i + (U - 1) * (u64)m < vecs; i += U * (u64)m) {
      uint4 v[U];
#pragma unroll
      for (int k = 0; k < U; ++k) v[k] = ld<NC>(s + i + k * m);
#pragma unroll
      for (int k = 0; k < U; ++k) d[i + k * m] = v[k];
    }
    for (; i < vecs; i += m) d[i] = ld<NC>(s + i);
    __syncthreads();
  }
}

template <int U, int NC>
// GB/s, or -1 where the kernel cannot launch with `threads` threads.
double run(uint8_t* dst, const uint8_t* src, u64 bytes, int blocks, int threads) {
  const int iters = 50;
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  copy<U, NC><<<blocks, threads>>>(dst, src, bytes, 2);  // warm-up
  // Too many registers for the block size: no figure.
  if (cudaGetLastError() != cudaSuccess) return -1;
  CK(cudaDeviceSynchronize());
  std::vector<double> gbs;
  for (int rep = 0; rep < 5; ++rep) {
    CK(cudaEventRecord(a));
    copy<U, NC><<<blocks, threads>>>(dst, src, bytes, iters);
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    gbs.push_back((double)bytes * iters / (ms * 1e-3) / 1e9);
  }
  std::sort(gbs.begin(), gbs.end());
  return gbs[2];
}

int main() {
  int n = 0;
  CK(cudaGetDeviceCount(&n));
  if (n < 2) { printf("needs 2 GPUs\n"); return 1; }
  const u64 bytes = 4ull << 20;
  uint8_t *src, *dst;
  CK(cudaSetDevice(1));
  CK(cudaMalloc(&dst, bytes));
  CK(cudaSetDevice(0));
  CK(cudaDeviceEnablePeerAccess(1, 0));
  CK(cudaMalloc(&src, bytes));
  CK(cudaMemset(src, 7, bytes));
  printf("%-7s %-8s %-3s %-6s %10s\n", "blocks", "threads", "U", "load", "GB/s");
  for (int blocks : {16, 32, 66, 132}) {
    for (int threads : {512, 1024}) {
      printf("%-7d %-8d %-3d %-6s %10.1f\n", blocks, threads, 4, "plain", run<4, 0>(dst, src, bytes, blocks, threads));
      printf("%-7d %-8d %-3d %-6s %10.1f\n", blocks, threads, 8, "plain", run<8, 0>(dst, src, bytes, blocks, threads));
      printf("%-7d %-8d %-3d %-6s %10.1f\n", blocks, threads, 16, "plain", run<16, 0>(dst, src, bytes, blocks, threads));
      printf("%-7d %-8d %-3d %-6s %10.1f\n", blocks, threads, 8, "nc", run<8, 1>(dst, src, bytes, blocks, threads));
      printf("%-7d %-8d %-3d %-6s %10.1f\n", blocks, threads, 16, "nc", run<16, 1>(dst, src, bytes, blocks, threads));
    }
  }
  return 0;
}
