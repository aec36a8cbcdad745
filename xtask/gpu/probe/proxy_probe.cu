// proxy_probe: what does a CPU-proxied put with signal cost, hop by hop,
// for each way the host can queue it? Not part of gin-rs; it tells which
// stream operations the CUDA proxy and the soft NIC should issue
// (docs/cuda.md).
// Build: nvcc -O3 -arch=sm_90 -o proxy_probe proxy_probe.cu -lcuda
//
// Two GPUs ping-pong as gin-bench's proxy floor does: a kernel on each GPU
// writes a host-mapped word, a forwarder thread per GPU sees it and queues
// the hop (data to the other GPU, then its flag in that GPU's memory), and
// the other kernel polls the flag and answers. Round trips are timed on
// GPU 0 with %globaltimer. The forwarder's hop, by variant:
//   copy+write     cuMemcpyAsync, cuStreamWriteValue64 (flag)      (the floor)
//   copy+batch1    cuMemcpyAsync, cuStreamBatchMemOp [flag]
//   copy+batch2    cuMemcpyAsync, cuStreamBatchMemOp [flag, local done]
//   copy+write2    cuMemcpyAsync, cuStreamWriteValue64 flag, then local done
//   copy+b1+write  cuMemcpyAsync, BatchMemOp [flag], WriteValue64 local done
//   memops         cuStreamBatchMemOp [the data as 8-byte values, flag]
//   htod+write     cuMemcpyAsync from pinned host memory, flag
//   flag           cuStreamWriteValue64 (flag) only, no data
// and for one 8-byte value carried in the request (an inline put):
//   in:b3          BatchMemOp [value, flag, local done]
//   in:b2+write    BatchMemOp [value, flag], WriteValue64 local done
//   in:write3      WriteValue64 value, flag, local done: three calls
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
  printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)
#define CU(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { \
  printf("%s:%d %s: error %d\n", __FILE__, __LINE__, #x, (int)r_); exit(1); } } while (0)

typedef unsigned long long u64;

__device__ u64 gtime() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ u64 ld_acquire_sys(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__global__ void pingpong(int rank, volatile u64* host_flag, const u64* dev_flag, int iters,
                         int warmup, u64* out) {
  u64 t0 = 0;
  for (int i = 0; i < warmup + iters; ++i) {
    if (i == warmup) t0 = gtime();
    if (rank == 0) {
      __threadfence();
      *host_flag = i + 1;
      while (ld_acquire_sys(dev_flag) < (u64)i + 1) {
      }
    } else {
      while (ld_acquire_sys(dev_flag) < (u64)i + 1) {
      }
      __threadfence();
      *host_flag = i + 1;
    }
  }
  *out = gtime() - t0;
}

enum Variant {
  COPY_WRITE, COPY_BATCH1, COPY_BATCH2, COPY_WRITE2, COPY_B1_WRITE, MEMOPS, HTOD_WRITE, FLAG,
  IN_B3, IN_B2_WRITE, IN_WRITE3, NVAR
};
const char* names[] = {"copy+write", "copy+batch1", "copy+batch2", "copy+write2", "copy+b1+write",
                       "memops", "htod+write", "flag", "in:b3", "in:b2+write", "in:write3"};

struct Side {
  u64* buf;        // device memory, 1 MiB
  u64* flag;       // device memory: the flag the peer's forwarder writes
  u64* done;       // device memory: a local "completion index"
  u64* host_flag;  // pinned, mapped: the kernel writes, the forwarder reads
  u64* host_flag_dev;
  u64* host_src;   // pinned: source of htod copies
  u64* out;
  cudaStream_t ks, fs;
};

void write1(cudaStream_t s, u64* a, u64 v) { CU(cuStreamWriteValue64(s, (CUdeviceptr)a, v, 0)); }

void batch(cudaStream_t s, const std::vector<std::pair<u64*, u64>>& w) {
  std::vector<CUstreamBatchMemOpParams> ops(w.size());
  for (size_t i = 0; i < w.size(); ++i) {
    memset(&ops[i], 0, sizeof ops[i]);
    ops[i].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
    ops[i].writeValue.address = (CUdeviceptr)w[i].first;
    ops[i].writeValue.value64 = w[i].second;
  }
  CU(cuStreamBatchMemOp(s, (unsigned)ops.size(), ops.data(), 0));
}

void hop(Variant v, Side& me, Side& peer, size_t bytes, u64 n) {
  switch (v) {
    case COPY_WRITE:
      CK(cudaMemcpyAsync(peer.buf, me.buf, bytes, cudaMemcpyDefault, me.fs));
      write1(me.fs, peer.flag, n);
      break;
    case COPY_BATCH1:
      CK(cudaMemcpyAsync(peer.buf, me.buf, bytes, cudaMemcpyDefault, me.fs));
      batch(me.fs, {{peer.flag, n}});
      break;
    case COPY_BATCH2:
      CK(cudaMemcpyAsync(peer.buf, me.buf, bytes, cudaMemcpyDefault, me.fs));
      batch(me.fs, {{peer.flag, n}, {me.done, n}});
      break;
    case COPY_WRITE2:
      CK(cudaMemcpyAsync(peer.buf, me.buf, bytes, cudaMemcpyDefault, me.fs));
      write1(me.fs, peer.flag, n);
      write1(me.fs, me.done, n);
      break;
    case COPY_B1_WRITE:
      CK(cudaMemcpyAsync(peer.buf, me.buf, bytes, cudaMemcpyDefault, me.fs));
      batch(me.fs, {{peer.flag, n}});
      write1(me.fs, me.done, n);
      break;
    case IN_B3:
      batch(me.fs, {{peer.buf, n}, {peer.flag, n}, {me.done, n}});
      break;
    case IN_B2_WRITE:
      batch(me.fs, {{peer.buf, n}, {peer.flag, n}});
      write1(me.fs, me.done, n);
      break;
    case IN_WRITE3:
      write1(me.fs, peer.buf, n);
      write1(me.fs, peer.flag, n);
      write1(me.fs, me.done, n);
      break;
    case MEMOPS: {
      std::vector<std::pair<u64*, u64>> w;
      for (size_t i = 0; i < bytes / 8; ++i) w.push_back({peer.buf + i, me.host_src[i] + n});
      w.push_back({peer.flag, n});
      batch(me.fs, w);
      break;
    }
    case HTOD_WRITE:
      CK(cudaMemcpyAsync(peer.buf, me.host_src, bytes, cudaMemcpyDefault, me.fs));
      write1(me.fs, peer.flag, n);
      break;
    case FLAG:
      write1(me.fs, peer.flag, n);
      break;
    default:
      break;
  }
}

int main(int argc, char** argv) {
  // Optional: the variants to run, by name (all by default).
  auto wanted = [&](int v) {
    if (argc < 2) return true;
    for (int a = 1; a < argc; ++a)
      if (strcmp(argv[a], names[v]) == 0) return true;
    return false;
  };
  const size_t max = 1 << 20;
  Side s[2];
  for (int g = 0; g < 2; ++g) {
    CK(cudaSetDevice(g));
    CK(cudaDeviceEnablePeerAccess(1 - g, 0));
    CK(cudaMalloc(&s[g].buf, max));
    CK(cudaMalloc(&s[g].flag, 64));
    CK(cudaMalloc(&s[g].done, 64));
    CK(cudaMalloc(&s[g].out, 64));
    CK(cudaHostAlloc((void**)&s[g].host_flag, 64, cudaHostAllocMapped | cudaHostAllocPortable));
    CK(cudaHostGetDevicePointer((void**)&s[g].host_flag_dev, s[g].host_flag, 0));
    CK(cudaHostAlloc((void**)&s[g].host_src, max, cudaHostAllocPortable));
    for (size_t i = 0; i < max / 8; ++i) s[g].host_src[i] = i;
    CK(cudaStreamCreateWithFlags(&s[g].ks, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&s[g].fs, cudaStreamNonBlocking));
  }
  const int iters = 2000, warmup = 200, runs = 5;
  printf("%-12s %8s %10s %10s %10s   (round trip us over %d iterations, %d runs)\n", "variant",
         "bytes", "median", "min", "max", iters, runs);
  for (int v = 0; v < NVAR; ++v) {
    if (!wanted(v)) continue;
    for (size_t bytes : {(size_t)8, (size_t)1024, (size_t)65536, (size_t)1048576}) {
      if (v == MEMOPS && bytes > 2032) continue;
      if ((v == FLAG || v >= IN_B3) && bytes != 8) continue;
      if (v != COPY_WRITE && bytes > 65536) continue;
      std::vector<double> rt;
      for (int r = 0; r < runs; ++r) {
        for (int g = 0; g < 2; ++g) {
          CK(cudaSetDevice(g));
          CK(cudaMemset(s[g].flag, 0, 64));
          CK(cudaMemset(s[g].done, 0, 64));
          CK(cudaDeviceSynchronize());
          *(volatile u64*)s[g].host_flag = 0;
        }
        std::atomic<bool> stop{false};
        std::vector<std::thread> fwd;
        for (int g = 0; g < 2; ++g) {
          fwd.emplace_back([&, g] {
            CK(cudaSetDevice(g));
            u64 last = 0;
            const u64 total = iters + warmup;
            while (last < total && !stop.load(std::memory_order_relaxed)) {
              u64 now = __atomic_load_n(s[g].host_flag, __ATOMIC_ACQUIRE);
              if (now == last) continue;
              hop((Variant)v, s[g], s[1 - g], bytes, now);
              last = now;
            }
          });
        }
        for (int g = 0; g < 2; ++g) {
          CK(cudaSetDevice(g));
          pingpong<<<1, 1, 0, s[g].ks>>>(g, s[g].host_flag_dev, s[g].flag, iters, warmup, s[g].out);
          CK(cudaGetLastError());
        }
        for (int g = 0; g < 2; ++g) {
          CK(cudaSetDevice(g));
          CK(cudaStreamSynchronize(s[g].ks));
        }
        stop = true;
        for (auto& t : fwd) t.join();
        for (int g = 0; g < 2; ++g) {
          CK(cudaSetDevice(g));
          CK(cudaStreamSynchronize(s[g].fs));
        }
        u64 ns;
        CK(cudaSetDevice(0));
        CK(cudaMemcpy(&ns, s[0].out, 8, cudaMemcpyDeviceToHost));
        rt.push_back(ns / 1000.0 / iters);
      }
      std::sort(rt.begin(), rt.end());
      printf("%-12s %8zu %10.2f %10.2f %10.2f\n", names[v], bytes, rt[runs / 2], rt[0], rt[runs - 1]);
      fflush(stdout);
    }
  }
  return 0;
}
