// tma_probe: can the Hopper bulk-copy engine (TMA, cp.async.bulk) push more
// bytes over NVLink per SM than the SM's own 16-byte stores? Not part of
// gin-rs. Build: nvcc -O3 -arch=sm_90 -o tma_probe tma_probe.cu; run:
// ./tma_probe
//
// As bw_probe: GPU 0's blocks copy a 4 MiB message, one slice per block,
// from GPU 0's memory into GPU 1's through peer access, 50 times per launch;
// GB/s from CUDA events, median of 5 launches. Variants:
// - stores: 512 threads, eight 16-byte loads in flight per thread, then
//   the stores (gin.cuh's coop_copy);
// - tma: one thread per block moves its slice in CHUNK-byte pieces through
//   NBUF shared-memory buffers: a bulk load (global -> shared, completion
//   on an mbarrier), then a bulk store (shared -> the peer's global), with
//   up to NBUF - 1 stores still reading shared memory while the next
//   piece loads.
// The copy is checked byte for byte after each variant.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>

typedef unsigned long long u64;
typedef unsigned int u32;
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
  printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)

__device__ __forceinline__ void slice_of(u64 bytes, u64& off, u64& n) {
  const u64 slice = (bytes / gridDim.x + 15) & ~15ull;
  off = slice * blockIdx.x;
  n = off >= bytes ? 0 : (bytes - off < slice ? bytes - off : slice);
}

__global__ void stores(uint8_t* dst, const uint8_t* src, u64 bytes, int iters) {
  u64 off, n;
  slice_of(bytes, off, n);
  const u64 vecs = n / 16;
  const u32 r = threadIdx.x, m = blockDim.x;
  uint4* d = (uint4*)(dst + off);
  const uint4* s = (const uint4*)(src + off);
  for (int it = 0; it < iters; ++it) {
    u64 i = r;
    for (; i + 7 * (u64)m < vecs; i += 8 * (u64)m) {
      uint4 v[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = s[i + k * m];
#pragma unroll
      for (int k = 0; k < 8; ++k) d[i + k * m] = v[k];
    }
    for (; i < vecs; i += m) d[i] = s[i];
    __syncthreads();
  }
}

__device__ __forceinline__ u32 smem(const void* p) { return (u32)__cvta_generic_to_shared(p); }

template <int N>
__device__ __forceinline__ void wait_reads() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

template <u32 CHUNK, int NBUF>
__global__ void tma(uint8_t* dst, const uint8_t* src, u64 bytes, int iters) {
  extern __shared__ __align__(128) uint8_t buf[];
  __shared__ __align__(8) u64 bar[NBUF];
  u64 off, n;
  slice_of(bytes, off, n);
  if (threadIdx.x == 0) {
    for (int b = 0; b < NBUF; ++b)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem(&bar[b])) : "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  u32 parity = 0;  // bit b: the phase buffer b's barrier completes next
  u64 piece = 0;   // pieces issued so far, over all iterations
  for (int it = 0; it < iters; ++it) {
    for (u64 at = 0; at < n; at += CHUNK, ++piece) {
      const int b = (int)(piece % NBUF);
      const u32 len = (u32)(n - at < CHUNK ? n - at : CHUNK);
      uint8_t* sb = buf + (u64)b * CHUNK;
      // The store that last read buffer b (NBUF pieces ago) is done reading.
      wait_reads<NBUF - 1>();
      const u32 mb = smem(&bar[b]);
      u64 state;
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 %0, [%1], %2;"
                   : "=l"(state) : "r"(mb), "r"(len) : "memory");
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
          ::"r"(smem(sb)), "l"(src + off + at), "r"(len), "r"(mb) : "memory");
      const u32 ph = (parity >> b) & 1;
      u32 done = 0;
      while (!done) {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
            : "=r"(done) : "r"(mb), "r"(ph) : "memory");
      }
      parity ^= 1u << b;
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                   ::"l"(dst + off + at), "r"(smem(sb)), "r"(len) : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

template <class Launch>
double measure(Launch launch, u64 bytes, int iters) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  launch(2);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  std::vector<double> gbs;
  for (int rep = 0; rep < 5; ++rep) {
    CK(cudaEventRecord(a));
    launch(iters);
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    gbs.push_back((double)bytes * iters / (ms * 1e-3) / 1e9);
  }
  CK(cudaGetLastError());
  std::sort(gbs.begin(), gbs.end());
  return gbs[2];
}

// Bytes of dst (on GPU 1) that differ from src's pattern.
u64 check(uint8_t* dst, u64 bytes) {
  std::vector<uint8_t> h(bytes);
  CK(cudaMemcpy(h.data(), dst, bytes, cudaMemcpyDefault));
  u64 bad = 0;
  for (u64 i = 0; i < bytes; ++i) bad += h[i] != (uint8_t)(i * 131 + 7);
  return bad;
}

template <u32 CHUNK, int NBUF>
void row_tma(uint8_t* dst, const uint8_t* src, u64 bytes, int blocks) {
  const int sm = (int)(CHUNK * NBUF);
  CK(cudaFuncSetAttribute(tma<CHUNK, NBUF>, cudaFuncAttributeMaxDynamicSharedMemorySize, sm));
  CK(cudaMemset(dst, 0, bytes));
  const double g = measure(
      [&](int it) { tma<CHUNK, NBUF><<<blocks, 32, sm>>>(dst, src, bytes, it); }, bytes, 50);
  char name[32];
  snprintf(name, sizeof name, "tma chunk %uK x%d", CHUNK / 1024, NBUF);
  printf("%-7d %-24s %10.1f %8llu\n", blocks, name, g, check(dst, bytes));
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
  {
    std::vector<uint8_t> h(bytes);
    for (u64 i = 0; i < bytes; ++i) h[i] = (uint8_t)(i * 131 + 7);
    CK(cudaMemcpy(src, h.data(), bytes, cudaMemcpyDefault));
  }
  printf("%-7s %-24s %10s %8s\n", "blocks", "variant", "GB/s", "bad");
  for (int blocks : {8, 16, 32, 66, 132}) {
    CK(cudaMemset(dst, 0, bytes));
    const double g =
        measure([&](int it) { stores<<<blocks, 512>>>(dst, src, bytes, it); }, bytes, 50);
    printf("%-7d %-24s %10.1f %8llu\n", blocks, "stores 512 threads U=8", g, check(dst, bytes));
    row_tma<4096, 4>(dst, src, bytes, blocks);
    row_tma<8192, 4>(dst, src, bytes, blocks);
    row_tma<16384, 4>(dst, src, bytes, blocks);
    row_tma<32768, 4>(dst, src, bytes, blocks);
  }
  return 0;
}
