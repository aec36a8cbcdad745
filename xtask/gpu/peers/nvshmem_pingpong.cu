// A peer measured in the same job as gin-rs (issue 22): NVSHMEM's
// put-with-signal ping-pong per coop and size, and its put bandwidth, between
// two PEs, written as JSON that `gin-bench cuda --peer-json FILE` reads.
//
// Two processes, one per PE, bootstrapped without MPI through NVSHMEM's
// unique-id bootstrap: PE 0 writes the id to --uid-file (whole, by rename),
// PE 1 reads it from there. On one GPU both PEs share it (run them under one
// MPS daemon); on several, PE r takes GPU r.
//
//   nvshmem_pingpong --pe 0 --uid-file F --json OUT [options] &
//   nvshmem_pingpong --pe 1 --uid-file F [options]
//
// The two PEs must be given the same options. What is measured mirrors
// gin-bench cuda (crates/gin-selftest/kernels/selftest.cu):
// - pingpong: PE 0 puts `bytes` with a signal (NVSHMEM_SIGNAL_ADD, as
//   gin-rs's signal_inc; --signal-op set writes the count instead) and waits
//   for PE 1's echo of the same buffer; one
//   block of 1 (thread), 32 (warp) or each of --block-threads (block,
//   default 1024, NVSHMEM's block figures) threads, a row per count; the
//   round trip in µs is the %globaltimer time of --iters round trips after
//   --warmup ones, on PE 0, divided by --iters; one figure per launch.
// - bandwidth: PE 0 puts one --bw-bytes message 50 times, split over N
//   (--blocks) blocks of --threads threads; each block signals PE 1 with its last
//   put ("signal last"); PE 1 answers once all have arrived. GB/s =
//   bytes * 50 / ns until the answer, on PE 0. PE 1 checks every byte.
// Each row's value is the median, p10, p90, p99, min and max over --runs
// launches (nearest rank, as gin-bench's Summary).

#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

typedef unsigned long long u64;

[[noreturn]] void die(const std::string& why) {
  std::fprintf(stderr, "nvshmem_pingpong: %s\n", why.c_str());
  std::exit(1);
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) die(std::string(what) + ": " + cudaGetErrorString(e));
}

enum Coop { THREAD = 0, WARP = 1, BLOCK = 2 };

const char* coop_name(int c) { return c == THREAD ? "thread" : c == WARP ? "warp" : "block"; }

__device__ __forceinline__ u64 globaltimer() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Every thread of the coop puts; the signal goes with the data.
template <int C>
__device__ __forceinline__ void put_signal(void* buf, u64 bytes, uint64_t* sig, u64 value, int op,
                                           int pe) {
  if (C == THREAD) {
    nvshmem_putmem_signal_nbi(buf, buf, bytes, sig, value, op, pe);
  } else if (C == WARP) {
    nvshmemx_putmem_signal_nbi_warp(buf, buf, bytes, sig, value, op, pe);
  } else {
    nvshmemx_putmem_signal_nbi_block(buf, buf, bytes, sig, value, op, pe);
  }
}

// NVSHMEM's waits are per thread: one waits, the coop follows it.
template <int C>
__device__ __forceinline__ void wait_coop(uint64_t* sig, u64 want) {
  if (threadIdx.x == 0) nvshmem_signal_wait_until(sig, NVSHMEM_CMP_GE, want);
  if (C == WARP) __syncwarp();
  if (C == BLOCK) __syncthreads();
}

// `base`: the signal's value before this launch (the host counts: every
// round trip adds one on each side). out[0]: ns of `iters` round trips on PE
// 0.
template <int C>
__device__ __forceinline__ void pingpong(void* buf, uint64_t* sig, u64 bytes, unsigned iters,
                                         unsigned warmup, u64 base, int op, u64* out) {
  const int me = nvshmem_my_pe();
  const int peer = me ^ 1;
  u64 t0 = 0;
  for (unsigned i = 0; i < warmup + iters; ++i) {
    if (i == warmup) t0 = globaltimer();
    // Either way the peer's signal reaches base + i + 1: ADD adds one,
    // SET writes the count.
    const u64 value = op == NVSHMEM_SIGNAL_SET ? base + i + 1 : 1;
    if (me == 0) {
      put_signal<C>(buf, bytes, sig, value, op, peer);
      wait_coop<C>(sig, base + i + 1);
    } else {
      wait_coop<C>(sig, base + i + 1);
      put_signal<C>(buf, bytes, sig, value, op, peer);
    }
  }
  // (Timed as gin-rs's ping-pong: to the last echo, before the quiet.)
  if (me == 0 && threadIdx.x == 0) out[0] = globaltimer() - t0;
  nvshmem_quiet();
}

__global__ void pp_thread(void* b, uint64_t* s, u64 n, unsigned it, unsigned w, u64 base, int op,
                          u64* out) {
  pingpong<THREAD>(b, s, n, it, w, base, op, out);
}
__global__ void pp_warp(void* b, uint64_t* s, u64 n, unsigned it, unsigned w, u64 base, int op,
                        u64* out) {
  pingpong<WARP>(b, s, n, it, w, base, op, out);
}
__global__ void __launch_bounds__(1024)
    pp_block(void* b, uint64_t* s, u64 n, unsigned it, unsigned w, u64 base, int op, u64* out) {
  pingpong<BLOCK>(b, s, n, it, w, base, op, out);
}

// One-way bandwidth (see the top). `base`: data signal before this launch;
// `run`: the answer signal before it. out[0]: ns on PE 0.
__global__ void __launch_bounds__(1024)
    put_bw(char* dst, const char* src, uint64_t* data_sig, uint64_t* ack_sig, u64 bytes,
           unsigned iters, u64 base, u64 run, u64* out) {
  const int me = nvshmem_my_pe();
  const u64 slice = (bytes / gridDim.x + 15) & ~15ull;
  const u64 off = slice * blockIdx.x;
  const u64 n = off >= bytes ? 0 : (bytes - off < slice ? bytes - off : slice);
  __syncthreads();
  if (me == 0) {
    const u64 t0 = globaltimer();
    for (unsigned i = 0; i + 1 < iters; ++i) nvshmemx_putmem_nbi_block(dst + off, src + off, n, 1);
    nvshmemx_putmem_signal_nbi_block(dst + off, src + off, n, data_sig, 1, NVSHMEM_SIGNAL_ADD, 1);
    if (blockIdx.x == 0) {
      if (threadIdx.x == 0) {
        nvshmem_signal_wait_until(ack_sig, NVSHMEM_CMP_GE, run + 1);
        out[0] = globaltimer() - t0;
      }
      __syncthreads();
    }
    nvshmem_quiet();
  } else if (blockIdx.x == 0 && threadIdx.x == 0) {
    nvshmem_signal_wait_until(data_sig, NVSHMEM_CMP_GE, base + gridDim.x);
    nvshmemx_signal_op(ack_sig, 1, NVSHMEM_SIGNAL_ADD, 0);
    nvshmem_quiet();
  }
}

__global__ void fill(char* p, u64 n) {
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
    p[i] = (char)((i * 131) ^ (i >> 11));
}

struct Opts {
  int pe = -1;
  std::string uid_file, json;
  std::vector<u64> sizes{8, 1024, 64 << 10, 1 << 20};
  std::vector<int> coops{THREAD, WARP, BLOCK};
  unsigned iters = 2000;
  long warmup = -1;  // a tenth of the timed round trips
  int runs = 5;
  std::vector<unsigned> block_threads{1024};
  std::vector<u64> bw_bytes{4 << 20};
  std::vector<u64> bw_blocks{16, 32, 66, 132};
  unsigned bw_threads = 512;
  bool pingpong = true, bandwidth = true;
  int op = NVSHMEM_SIGNAL_ADD;
  int timeout_s = 120;
};

u64 parse_size(const std::string& s) {
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(s.c_str(), &end, 10);
  if (errno || end == s.c_str()) die("bad size '" + s + "'");
  std::string suf(end);
  if (suf.empty() || suf == "b" || suf == "B") return v;
  if (suf == "k" || suf == "K") return v << 10;
  if (suf == "m" || suf == "M") return v << 20;
  die("bad size suffix in '" + s + "' (k or m)");
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at <= s.size()) {
    size_t c = s.find(',', at);
    if (c == std::string::npos) c = s.size();
    if (c > at) out.push_back(s.substr(at, c - at));
    at = c + 1;
  }
  return out;
}

unsigned parse_uint(const std::string& s, const char* flag) {
  char* end = nullptr;
  const unsigned long v = std::strtoul(s.c_str(), &end, 10);
  if (end == s.c_str() || *end || v > 0xffffffffUL) die(std::string(flag) + ": bad number '" + s + "'");
  return (unsigned)v;
}

Opts parse(int argc, char** argv) {
  Opts o;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (i + 1 >= argc) die(k + " needs a value");
    const std::string v = argv[++i];
    if (k == "--pe") {
      o.pe = (int)parse_uint(v, "--pe");
    } else if (k == "--uid-file") {
      o.uid_file = v;
    } else if (k == "--json") {
      o.json = v;
    } else if (k == "--sizes") {
      o.sizes.clear();
      for (auto& s : split(v)) o.sizes.push_back(parse_size(s));
    } else if (k == "--coops") {
      o.coops.clear();
      for (auto& s : split(v)) {
        if (s == "thread") o.coops.push_back(THREAD);
        else if (s == "warp") o.coops.push_back(WARP);
        else if (s == "block") o.coops.push_back(BLOCK);
        else die("--coops: thread, warp or block, not '" + s + "'");
      }
    } else if (k == "--iters") {
      o.iters = parse_uint(v, "--iters");
    } else if (k == "--warmup") {
      o.warmup = parse_uint(v, "--warmup");
    } else if (k == "--runs") {
      o.runs = (int)parse_uint(v, "--runs");
    } else if (k == "--block-threads") {
      o.block_threads.clear();
      for (auto& s : split(v)) o.block_threads.push_back(parse_uint(s, "--block-threads"));
    } else if (k == "--bw-bytes") {
      o.bw_bytes.clear();
      for (auto& s : split(v)) o.bw_bytes.push_back(parse_size(s));
    } else if (k == "--blocks") {
      o.bw_blocks.clear();
      for (auto& s : split(v)) o.bw_blocks.push_back(parse_uint(s, "--blocks"));
    } else if (k == "--threads") {
      o.bw_threads = parse_uint(v, "--threads");
    } else if (k == "--tests") {
      o.pingpong = o.bandwidth = false;
      for (auto& s : split(v)) {
        if (s == "pingpong") o.pingpong = true;
        else if (s == "bandwidth") o.bandwidth = true;
        else die("--tests: pingpong or bandwidth, not '" + s + "'");
      }
    } else if (k == "--signal-op") {
      if (v == "add") o.op = NVSHMEM_SIGNAL_ADD;
      else if (v == "set") o.op = NVSHMEM_SIGNAL_SET;
      else die("--signal-op: add or set");
    } else if (k == "--timeout") {
      o.timeout_s = (int)parse_uint(v, "--timeout");
    } else {
      die("unknown option " + k);
    }
  }
  if (o.pe != 0 && o.pe != 1) die("--pe 0 or --pe 1");
  if (o.uid_file.empty()) die("--uid-file FILE is required");
  if (o.pe == 0 && o.json.empty()) die("PE 0 needs --json FILE");
  if (o.iters == 0 || o.runs <= 0) die("--iters and --runs must be positive");
  for (unsigned bt : o.block_threads)
    if (bt == 0 || bt > 1024 || bt % 32) die("--block-threads: multiples of 32 up to 1024");
  if (o.block_threads.empty()) die("--block-threads: at least one");
  const unsigned tt = o.bw_threads;
  if (tt == 0 || tt > 1024 || tt % 32) die("--threads: a multiple of 32 up to 1024");
  for (u64 b : o.bw_blocks)
    if (b == 0 || b > 1024) die("--blocks: between 1 and 1024");
  return o;
}

// PE 0: a fresh id, written whole (temporary file, then rename). PE 1: waits
// up to the timeout for the file.
nvshmemx_uniqueid_t exchange_uid(const Opts& o) {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  if (o.pe == 0) {
    if (nvshmemx_get_uniqueid(&id) != 0) die("nvshmemx_get_uniqueid failed");
    const std::string tmp = o.uid_file + ".tmp";
    FILE* f = std::fopen(tmp.c_str(), "wb");
    if (!f) die("cannot write " + tmp + ": " + std::strerror(errno));
    const bool ok = std::fwrite(&id, sizeof id, 1, f) == 1;
    if (std::fclose(f) != 0 || !ok) die("cannot write " + tmp);
    if (std::rename(tmp.c_str(), o.uid_file.c_str()) != 0)
      die("cannot rename " + tmp + " to " + o.uid_file + ": " + std::strerror(errno));
    return id;
  }
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(o.timeout_s);
  for (;;) {
    if (FILE* f = std::fopen(o.uid_file.c_str(), "rb")) {
      const bool ok = std::fread(&id, sizeof id, 1, f) == 1;
      std::fclose(f);
      if (!ok) die(o.uid_file + " holds no whole unique id");
      return id;
    }
    if (std::chrono::steady_clock::now() > end)
      die("PE 0 wrote no unique id to " + o.uid_file + " within " + std::to_string(o.timeout_s) +
          " s");
    // Another process writes it; a file has no wake-up to wait on.
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

struct Summary {
  double median, p10, p90, p99, min, max;
  size_t n;
};

// Nearest rank, as gin-bench's stats::percentile.
Summary summarize(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  auto pct = [&](double p) {
    size_t i = (size_t)(p / 100.0 * (double)(v.size() - 1) + 0.5);
    return v[std::min(i, v.size() - 1)];
  };
  return Summary{pct(50), pct(10), pct(90), pct(99), v.front(), v.back(), v.size()};
}

std::string json_row(const char* test, const std::string& coop, unsigned threads, u64 blocks,
                     u64 bytes, const Summary& s) {
  char b[640];
  std::snprintf(b, sizeof b,
                "    {\"test\": \"%s\", \"path\": \"nvshmem\", \"coop\": \"%s\", \"threads\": %u, "
                "\"blocks\": %llu, \"bytes\": %llu, \"value\": {\"n\": %zu, \"median\": %.6g, "
                "\"p10\": %.6g, \"p90\": %.6g, \"p99\": %.6g, \"min\": %.6g, \"max\": %.6g}}",
                test, coop.c_str(), threads, blocks, bytes, s.n, s.median, s.p10, s.p90, s.p99,
                s.min, s.max);
  return b;
}

void launch(const void* f, unsigned blocks, unsigned threads, void** args, cudaStream_t st) {
  check(cudaLaunchKernel(f, dim3(blocks), dim3(threads), args, 0, st), "cudaLaunchKernel");
  check(cudaStreamSynchronize(st), "kernel");
}

}  // namespace

int main(int argc, char** argv) {
  const Opts o = parse(argc, argv);
  int ngpu = 0;
  check(cudaGetDeviceCount(&ngpu), "cudaGetDeviceCount");
  if (ngpu == 0) die("no GPU");
  // One GPU: both PEs on it (MPS). Several: one PE each.
  check(cudaSetDevice(o.pe % ngpu), "cudaSetDevice");
  nvshmemx_uniqueid_t id = exchange_uid(o);
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  if (nvshmemx_set_attr_uniqueid_args(o.pe, 2, &id, &attr) != 0)
    die("nvshmemx_set_attr_uniqueid_args failed");
  if (nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr) != 0) die("nvshmemx_init_attr failed");
  if (nvshmem_n_pes() != 2) die("expected 2 PEs, got " + std::to_string(nvshmem_n_pes()));
  int major = 0, minor = 0, patch = 0;
  nvshmemx_vendor_get_version_info(&major, &minor, &patch);
  cudaDeviceProp prop;
  check(cudaGetDeviceProperties(&prop, o.pe % ngpu), "cudaGetDeviceProperties");

  u64 max = 8;
  for (u64 s : o.sizes) max = std::max(max, s);
  for (u64 s : o.bw_bytes) max = std::max(max, s);
  char* buf = (char*)nvshmem_malloc(max);
  char* dst = (char*)nvshmem_malloc(max);
  uint64_t* sigs = (uint64_t*)nvshmem_calloc(4, sizeof(uint64_t));
  if (!buf || !dst || !sigs) die("nvshmem_malloc of " + std::to_string(max) + " bytes failed");
  u64* out = nullptr;
  check(cudaMalloc(&out, sizeof(u64)), "cudaMalloc");
  cudaStream_t st;
  check(cudaStreamCreate(&st), "cudaStreamCreate");
  fill<<<64, 256, 0, st>>>(buf, max);
  check(cudaStreamSynchronize(st), "fill");
  nvshmem_barrier_all();

  std::vector<std::string> rows;
  // Signal 0: the ping-pong's, signal 1: bandwidth data, 2: its answer.
  u64 pp_base = 0;
  // (coop, threads): the block coop once per --block-threads.
  std::vector<std::pair<int, unsigned>> shapes;
  for (int c : (o.pingpong ? o.coops : std::vector<int>{})) {
    if (c == BLOCK)
      for (unsigned bt : o.block_threads) shapes.push_back({c, bt});
    else
      shapes.push_back({c, c == THREAD ? 1u : 32u});
  }
  for (const auto& [c, threads] : shapes) {
    const void* f = c == THREAD ? (const void*)pp_thread
                    : c == WARP ? (const void*)pp_warp
                                : (const void*)pp_block;
    for (u64 bytes : o.sizes) {
      unsigned iters = bytes >= (1u << 20) ? std::max(o.iters / 10, 50u) : o.iters;
      unsigned warmup = o.warmup >= 0 ? (unsigned)o.warmup : iters / 10;
      std::vector<double> us;
      for (int r = 0; r < o.runs; ++r) {
        check(cudaMemset(out, 0, sizeof(u64)), "cudaMemset");
        nvshmem_barrier_all();
        uint64_t* sig = sigs;
        void* b = buf;
        u64 n = bytes, base = pp_base;
        int op = o.op;
        void* args[] = {&b, &sig, &n, &iters, &warmup, &base, &op, &out};
        launch(f, 1, threads, args, st);
        pp_base += warmup + iters;
        u64 ns = 0;
        check(cudaMemcpy(&ns, out, sizeof ns, cudaMemcpyDeviceToHost), "cudaMemcpy");
        if (o.pe == 0 && ns == 0) die("the ping-pong kernel measured no time");
        us.push_back((double)ns / iters / 1000.0);
      }
      nvshmem_barrier_all();
      if (o.pe == 0) {
        const Summary s = summarize(us);
        rows.push_back(json_row("pingpong", coop_name(c), threads, 1, bytes, s));
        std::printf("pingpong %-6s %4u threads %8llu B: %.2f us (median of %d)\n", coop_name(c),
                    threads, bytes, s.median, o.runs);
      }
    }
  }
  u64 data_base = 0, ack_base = 0;
  const unsigned bw_iters = 50;
  for (u64 bytes : (o.bandwidth ? o.bw_bytes : std::vector<u64>{})) {
    for (u64 blocks : o.bw_blocks) {
      std::vector<double> gbps;
      for (int r = 0; r < o.runs; ++r) {
        check(cudaMemset(out, 0, sizeof(u64)), "cudaMemset");
        if (o.pe == 1) check(cudaMemset(dst, 0, bytes), "cudaMemset");
        check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
        nvshmem_barrier_all();
        char* d = dst;
        const char* s = buf;
        uint64_t *ds = sigs + 1, *as = sigs + 2;
        u64 n = bytes, base = data_base, run = ack_base;
        unsigned it = bw_iters;
        void* args[] = {&d, &s, &ds, &as, &n, &it, &base, &run, &out};
        launch((const void*)put_bw, (unsigned)blocks, o.bw_threads, args, st);
        data_base += blocks;
        ack_base += 1;
        u64 ns = 0;
        check(cudaMemcpy(&ns, out, sizeof ns, cudaMemcpyDeviceToHost), "cudaMemcpy");
        if (o.pe == 0 && ns == 0) die("the bandwidth kernel measured no time");
        gbps.push_back(o.pe == 0 ? (double)(bytes * bw_iters) / (double)ns : 0.0);
        nvshmem_barrier_all();
        if (o.pe == 1 && r + 1 == o.runs) {
          // Every byte arrived: PE 0's pattern (fill) in PE 1's dst.
          std::vector<char> got(bytes), want(bytes);
          check(cudaMemcpy(got.data(), dst, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
          check(cudaMemcpy(want.data(), buf, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
          if (got != want)
            die("bandwidth with " + std::to_string(blocks) + " blocks: the data arrived wrong");
        }
      }
      if (o.pe == 0) {
        const Summary s = summarize(gbps);
        const std::string coop = std::to_string(blocks) + "x" + std::to_string(o.bw_threads) +
                                 " threads, signal last";
        rows.push_back(json_row("bandwidth", coop, o.bw_threads, blocks, bytes, s));
        std::printf("bandwidth %s %llu B: %.2f GB/s (median of %d)\n", coop.c_str(), bytes,
                    s.median, o.runs);
      }
    }
  }
  nvshmem_barrier_all();
  if (o.pe == 0) {
    const std::string tmp = o.json + ".tmp";
    FILE* f = std::fopen(tmp.c_str(), "w");
    if (!f) die("cannot write " + tmp + ": " + std::strerror(errno));
    std::fprintf(f,
                 "{\n  \"bench\": \"peer\",\n  \"peer\": \"NVSHMEM %d.%d.%d\",\n  \"path\": "
                 "\"nvshmem\",\n  \"like\": \"load/store\",\n  \"gpu\": \"%s\",\n  \"gpus\": %d,\n  \"runs\": %d,\n"
                 "  \"results\": [\n",
                 major, minor, patch, prop.name, ngpu, o.runs);
    for (size_t i = 0; i < rows.size(); ++i)
      std::fprintf(f, "%s%s\n", rows[i].c_str(), i + 1 < rows.size() ? "," : "");
    std::fprintf(f, "  ]\n}\n");
    if (std::fclose(f) != 0) die("cannot write " + tmp);
    if (std::rename(tmp.c_str(), o.json.c_str()) != 0) die("cannot rename " + tmp);
    std::printf("wrote %s\n", o.json.c_str());
  }
  nvshmem_free(sigs);
  nvshmem_free(dst);
  nvshmem_free(buf);
  nvshmem_finalize();
  return 0;
}
