// acquire_probe: what one poll of a signal costs a thread, by how it reads
// the signal's sub-slots. Not part of gin-rs; it measured whether reading
// two sub-slots with one vector acquire (`ld.acquire.sys.v2.u64`) instead
// of two scalar acquires, which serialise, shortens a wait's poll
// (docs/cuda.md). One GPU is enough: the cost is the load's, wherever the
// writer is.
// Build: nvcc -O3 -arch=sm_90 -o acquire_probe acquire_probe.cu
//
// One thread polls a 16-byte-aligned pair of words in device memory that
// nobody writes, `iters` times, each poll's loads depending on the sum of
// the previous one (as a wait's loop does), timed with %globaltimer:
//   relaxed x1   ld.relaxed.sys.u64                      (a plain poll)
//   acquire x1   ld.acquire.sys.u64                      (one sub-slot)
//   acquire x2   two ld.acquire.sys.u64 on the two words (gin before)
//   acquire v2   ld.acquire.sys.v2.u64 on the pair       (gin after)
//   acquire x4   four scalar acquires (4 ranks), and v2 x2: two pairs
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

typedef unsigned long long u64;
typedef unsigned int u32;

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
  printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)

__device__ __forceinline__ u64 gtime() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ u64 ld_relaxed(const u64* p) {
  u64 v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ u64 ld_acquire(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ u64 ld_acquire_v2(const u64* p) {
  u64 a, b;
  asm volatile("ld.acquire.sys.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p) : "memory");
  return a + b;
}

enum { RELAXED1, ACQUIRE1, ACQUIRE2, ACQUIRE_V2, ACQUIRE4, ACQUIRE_V2X2, NVAR };
const char* names[] = {"relaxed x1", "acquire x1", "acquire x2", "acquire v2", "acquire x4",
                       "v2 x2"};

// `w` holds zeros, so the sum is 0 and each poll reads the same words, but
// the compiler cannot know: the next address depends on the last sum.
template <int V>
__global__ void poll(const u64* w, u32 iters, u64* out) {
  u64 sum = 0;
  const u64 t0 = gtime();
  for (u32 i = 0; i < iters; ++i) {
    const u64* p = w + (sum & 1);  // always w: sum stays 0
    switch (V) {
      case RELAXED1: sum += ld_relaxed(p); break;
      case ACQUIRE1: sum += ld_acquire(p); break;
      case ACQUIRE2: sum += ld_acquire(p) + ld_acquire(p + 1); break;
      case ACQUIRE_V2: sum += ld_acquire_v2(p); break;
      case ACQUIRE4:
        sum += ld_acquire(p) + ld_acquire(p + 1) + ld_acquire(p + 2) + ld_acquire(p + 3);
        break;
      case ACQUIRE_V2X2: sum += ld_acquire_v2(p) + ld_acquire_v2(p + 2); break;
    }
  }
  out[0] = gtime() - t0;
  out[1] = sum;
}

int main() {
  u64 *w, *out;
  CK(cudaMalloc(&w, 64));
  CK(cudaMemset(w, 0, 64));
  CK(cudaMalloc(&out, 16));
  const u32 iters = 100000;
  const int runs = 7;
  printf("%-12s %10s %10s %10s   (ns per poll, %u polls, %d runs)\n", "variant", "median", "min",
         "max", iters, runs);
  for (int v = 0; v < NVAR; ++v) {
    std::vector<double> ns;
    for (int r = 0; r < runs; ++r) {
      switch (v) {
        case RELAXED1: poll<RELAXED1><<<1, 1>>>(w, iters, out); break;
        case ACQUIRE1: poll<ACQUIRE1><<<1, 1>>>(w, iters, out); break;
        case ACQUIRE2: poll<ACQUIRE2><<<1, 1>>>(w, iters, out); break;
        case ACQUIRE_V2: poll<ACQUIRE_V2><<<1, 1>>>(w, iters, out); break;
        case ACQUIRE4: poll<ACQUIRE4><<<1, 1>>>(w, iters, out); break;
        default: poll<ACQUIRE_V2X2><<<1, 1>>>(w, iters, out); break;
      }
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      u64 o[2];
      CK(cudaMemcpy(o, out, 16, cudaMemcpyDeviceToHost));
      if (o[1] != 0) { printf("bad sum\n"); return 1; }
      ns.push_back(double(o[0]) / iters);
    }
    std::sort(ns.begin(), ns.end());
    printf("%-12s %10.1f %10.1f %10.1f\n", names[v], ns[runs / 2], ns[0], ns[runs - 1]);
  }
  return 0;
}
