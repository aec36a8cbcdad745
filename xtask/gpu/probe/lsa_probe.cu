// lsa_probe: which release/acquire scheme makes the fastest correct
// put-with-signal round trip over NVLink between two GPUs of one process.
// Not part of gin-rs; it chose the scheme gin.cuh's load/store path uses
// (docs/cuda.md). Build: nvcc -O3 -arch=sm_90 -o lsa_probe lsa_probe.cu
//
// Each variant is a ping-pong: rank 0 copies `bytes` to rank 1 with the
// coop, then signals; rank 1 waits, checks nothing, answers the same way.
// Round trip in us from %globaltimer on rank 0, median of 5 launches.
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <algorithm>
#include <vector>
#include <cuda_runtime.h>

typedef unsigned long long u64;
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
  printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)

__device__ __forceinline__ u64 gtimer() { u64 t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
__device__ __forceinline__ u64 ld_acq(const u64* p) { u64 v; asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ u64 ld_rlx(const u64* p) { u64 v; asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ u64 ld_vol(const u64* p) { u64 v; asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory"); return v; }

// Signal schemes (after the coop's copy and barrier; leader only).
//  0 fence.sc.sys + st.release.sys   (old floor)
//  1 st.release.sys
//  2 fence.sc.sys + red.relaxed.sys  (old gin.cuh)
//  3 red.release.sys
//  4 fence.acq_rel.sys + red.relaxed.sys
//  5 st.volatile, no fence           (incorrect: a lower bound only)
//  6 fence.acq_rel.sys + red.relaxed.sys
//  7 red.relaxed.sys, no fence       (incorrect: a lower bound only)
__device__ __forceinline__ void sig(int v, u64* p, u64 val) {
  switch (v) {
    case 0: __threadfence_system(); asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(val) : "memory"); break;
    case 1: asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(val) : "memory"); break;
    case 2: __threadfence_system(); asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(1ull) : "memory"); break;
    case 3: asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(1ull) : "memory"); break;
    case 4: asm volatile("fence.acq_rel.sys;" ::: "memory"); asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(1ull) : "memory"); break;
    case 6: asm volatile("fence.acq_rel.sys;" ::: "memory"); asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(1ull) : "memory"); break;
    case 7: asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(1ull) : "memory"); break;
    default: asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(p), "l"(val) : "memory"); break;
  }
}
// Wait schemes: 0 ld.acquire.sys poll; 1 ld.relaxed.sys poll then
// fence.acq_rel.sys; 2 ld.volatile poll then fence.acq_rel.sys; 3 as 0 over
// two sub-slots (the sum); 4 as 1 over two sub-slots.
__device__ __forceinline__ void wait(int w, const u64* p, u64 target) {
  switch (w) {
    case 0: while (ld_acq(p) < target) {} break;
    case 1: while (ld_rlx(p) < target) {} asm volatile("fence.acq_rel.sys;" ::: "memory"); break;
    case 2: while (ld_vol(p) < target) {} asm volatile("fence.acq_rel.sys;" ::: "memory"); break;
    case 3: while (ld_acq(p) + ld_acq(p + 1) < target) {} break;
    default: while (ld_rlx(p) + ld_rlx(p + 1) < target) {} asm volatile("fence.acq_rel.sys;" ::: "memory"); break;
  }
}

__device__ __forceinline__ void copy(unsigned r, unsigned n, uint8_t* d, const uint8_t* s, u64 bytes) {
  const u64 vecs = bytes / 16;
  uint4* dv = (uint4*)d; const uint4* sv = (const uint4*)s;
  u64 i = r;
  for (; i + 3 * n < vecs; i += 4 * n) {
    uint4 a = sv[i], b = sv[i + n], c = sv[i + 2 * n], e = sv[i + 3 * n];
    dv[i] = a; dv[i + n] = b; dv[i + 2 * n] = c; dv[i + 3 * n] = e;
  }
  for (; i < vecs; i += n) dv[i] = sv[i];
  for (u64 j = vecs * 16 + r; j < bytes; j += n) d[j] = s[j];
}

// A chain of `n` dependent loads through `tab` (tab[i] holds &tab[i+8]),
// as the header's checks read its ABI tables: plain ld.global (L1, which
// an acquire invalidates) or ld.global.nc (the read-only path).
__device__ __forceinline__ u64 chase(int kind, const u64* tab, int n) {
  const u64* p = tab;
  for (int i = 0; i < n; ++i) {
    u64 v;
    if (kind == 1) asm volatile("ld.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    else asm volatile("ld.global.nc.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    p = (const u64*)v;
  }
  return (u64)p;
}

__global__ void chased(int rank, int kind, int n, uint8_t* peer_buf, const uint8_t* buf, u64* peer_flag,
                       const u64* my_flag, const u64* tab, unsigned iters, unsigned warm, u64* out) {
  u64 t0 = 0, acc = 0;
  for (unsigned i = 0; i < warm + iters; ++i) {
    if (i == warm) t0 = gtimer();
    if (rank == 1) { if (threadIdx.x == 0) wait(0, my_flag, i + 1); __syncthreads(); }
    if (threadIdx.x == 0 && kind) acc += chase(kind, tab, n);
    copy(threadIdx.x, blockDim.x, peer_buf, buf, 8);
    __syncthreads();
    if (threadIdx.x == 0) sig(1, peer_flag, i + 1);
    if (rank == 0) { if (threadIdx.x == 0) wait(0, my_flag, i + 1); __syncthreads(); }
  }
  if (threadIdx.x == 0 && rank == 0) { out[0] = gtimer() - t0; out[1] = acc; }
}

// coop: 0 thread, 1 warp, 2 block (all of blockDim).
__global__ void pingpong(int rank, int sv, int wv, int coop, uint8_t* peer_buf, const uint8_t* buf,
                         u64* peer_flag, const u64* my_flag, u64 bytes, unsigned iters, unsigned warm,
                         u64* out) {
  const unsigned r = coop == 2 ? threadIdx.x : coop == 1 ? (threadIdx.x & 31) : 0;
  const unsigned n = coop == 2 ? blockDim.x : coop == 1 ? 32 : 1;
  if (coop == 0 && threadIdx.x != 0) return;
  if (coop == 1 && threadIdx.x >= 32) return;
  auto sync = [&] { if (coop == 2) __syncthreads(); else if (coop == 1) __syncwarp(); };
  u64 t0 = 0;
  // Wait targets: a signal counts arrivals (adds) or carries the round (stores).
  const bool sub2 = wv >= 3;
  for (unsigned i = 0; i < warm + iters; ++i) {
    if (i == warm) t0 = gtimer();
    if (rank == 1) { if (r == 0) wait(wv, my_flag, i + 1); sync(); }
    copy(r, n, peer_buf, buf, bytes);
    sync();
    if (r == 0) sig(sv, peer_flag + (sub2 ? rank : 0), i + 1);
    if (rank == 0) { if (r == 0) wait(wv, my_flag, i + 1); sync(); }
  }
  if (threadIdx.x == 0 && rank == 0) out[0] = gtimer() - t0;
}

int main(int argc, char** argv) {
  int ng = 0; CK(cudaGetDeviceCount(&ng));
  if (ng < 2) { printf("needs 2 GPUs, found %d\n", ng); return 1; }
  const u64 max = 1 << 20;
  uint8_t* buf[2]; u64* flag[2]; u64* out[2]; cudaStream_t st[2];
  for (int g = 0; g < 2; ++g) {
    CK(cudaSetDevice(g));
    CK(cudaDeviceEnablePeerAccess(g ^ 1, 0));
    CK(cudaMalloc(&buf[g], max)); CK(cudaMemset(buf[g], g + 1, max));
    CK(cudaMalloc(&flag[g], 64)); CK(cudaMalloc(&out[g], 64));
    CK(cudaStreamCreateWithFlags(&st[g], cudaStreamNonBlocking));
  }
  const u64 sizes[] = {8, 1024, 65536, 1 << 20};
  struct V { int s, w; const char* name; } vs[] = {
    {0, 0, "fence.sc.sys+st.release / ld.acquire (old floor)"},
    {1, 0, "st.release.sys / ld.acquire"},
    {1, 1, "st.release.sys / ld.relaxed+fence.acq_rel"},
    {1, 2, "st.release.sys / ld.volatile+fence.acq_rel"},
    {2, 3, "fence.sc.sys+red.relaxed / 2 x ld.acquire (old gin.cuh)"},
    {3, 3, "red.release.sys / 2 x ld.acquire"},
    {3, 4, "red.release.sys / 2 x ld.relaxed+fence.acq_rel"},
    {4, 4, "fence.acq_rel.sys+red.relaxed / 2 x ld.relaxed+fence"},
    {6, 3, "fence.acq_rel.sys+red.relaxed / 2 x ld.acquire"},
    {7, 3, "red.relaxed, no fence / 2 x ld.acquire (incorrect)"},
    {5, 2, "st.volatile, no fence (incorrect; lower bound)"},
  };
  {
    // Load chains after an acquire: what the header's ABI reads cost.
    u64* tab[2];
    for (int g = 0; g < 2; ++g) {
      CK(cudaSetDevice(g));
      CK(cudaMalloc(&tab[g], 64 * 64 * 8));
      std::vector<u64> h(64 * 64);
      for (int i = 0; i < 64 * 63; ++i) h[i] = (u64)(tab[g] + i + 64);
      CK(cudaMemcpy(tab[g], h.data(), h.size() * 8, cudaMemcpyHostToDevice));
    }
    const char* kinds[] = {"none", "ld.global", "ld.global.nc"};
    for (int kind = 0; kind < 3; ++kind) {
      for (int n : {1, 3, 6}) {
        if (kind == 0 && n > 1) continue;
        std::vector<double> runs;
        for (int run = 0; run < 5; ++run) {
          for (int g = 0; g < 2; ++g) { CK(cudaSetDevice(g)); CK(cudaMemset(flag[g], 0, 64)); CK(cudaDeviceSynchronize()); }
          for (int g = 0; g < 2; ++g) {
            CK(cudaSetDevice(g));
            chased<<<1, 512, 0, st[g]>>>(g, kind, n, buf[g ^ 1], buf[g], flag[g ^ 1], flag[g], tab[g], 2000, 200, out[g]);
            CK(cudaGetLastError());
          }
          for (int g = 0; g < 2; ++g) { CK(cudaSetDevice(g)); CK(cudaStreamSynchronize(st[g])); }
          u64 ns; CK(cudaSetDevice(0)); CK(cudaMemcpy(&ns, out[0], 8, cudaMemcpyDeviceToHost));
          runs.push_back(ns / 1000.0 / 2000);
        }
        std::sort(runs.begin(), runs.end());
        printf("8 B block round trip with a chain of %d %s loads per hop: %.2f us\n", kind ? n : 0, kinds[kind], runs[2]);
      }
    }
    if (argc > 2) return 0;
  }
  const char* coops[] = {"thread", "warp", "block"};
  int only_coop = argc > 1 ? atoi(argv[1]) : -1;
  printf("%-58s %-6s %8s %8s %8s %8s\n", "signal / wait", "coop", "8 B", "1 KiB", "64 KiB", "1 MiB");
  for (int c = 0; c < 3; ++c) {
    if (only_coop >= 0 && c != only_coop) continue;
    for (auto& v : vs) {
      printf("%-58s %-6s", v.name, coops[c]);
      for (u64 bytes : sizes) {
        if (c == 0 && bytes > 1024) { printf(" %8s", "-"); continue; }
        unsigned iters = bytes >= (1 << 20) ? 200 : 2000;
        std::vector<double> runs;
        for (int run = 0; run < 5; ++run) {
          for (int g = 0; g < 2; ++g) { CK(cudaSetDevice(g)); CK(cudaMemset(flag[g], 0, 64)); CK(cudaDeviceSynchronize()); }
          for (int g = 0; g < 2; ++g) {
            CK(cudaSetDevice(g));
            pingpong<<<1, 512, 0, st[g]>>>(g, v.s, v.w, c, buf[g ^ 1], buf[g], flag[g ^ 1], flag[g], bytes,
                                           iters, iters / 10, out[g]);
            CK(cudaGetLastError());
          }
          for (int g = 0; g < 2; ++g) { CK(cudaSetDevice(g)); CK(cudaStreamSynchronize(st[g])); }
          u64 ns; CK(cudaSetDevice(0)); CK(cudaMemcpy(&ns, out[0], 8, cudaMemcpyDeviceToHost));
          runs.push_back(ns / 1000.0 / iters);
        }
        std::sort(runs.begin(), runs.end());
        printf(" %8.2f", runs[2]);
      }
      printf("\n");
    }
  }
  return 0;
}
