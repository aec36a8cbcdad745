// Kernels of gin-cuda-selftest and the CUDA benchmarks: every operation of
// gin/gin.cuh, with data checked on the device. Compiled at run time by NVRTC
// (gin-core's cuda module passes the headers in memory) and in CI by nvcc.
#include "gin/gin.cuh"

using namespace gin;

// A deterministic byte pattern: what `rank` writes at `i` in round `round`.
__device__ __forceinline__ u8 pattern(u32 rank, u64 i, u32 round) {
  return (u8)((i * 131u) ^ (rank * 29u + 7u) ^ (round * 53u));
}

__device__ __forceinline__ void fill(u8* p, u64 n, u32 rank, u32 round) {
  const u64 stride = (u64)blockDim.x * gridDim.x;
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += stride)
    p[i] = pattern(rank, i, round);
}

// Counts bytes that differ from `rank`'s pattern into out[1].
__device__ __forceinline__ void verify(const u8* p, u64 n, u32 rank, u32 round, u64* out) {
  const u64 stride = (u64)blockDim.x * gridDim.x;
  u64 bad = 0;
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += stride)
    bad += p[i] != pattern(rank, i, round);
  if (bad) atomicAdd((unsigned long long*)&out[1], (unsigned long long)bad);
}

// Ring exchange (one block): each round, put `bytes` of this rank's pattern
// to the next rank with a signal; wait for the previous rank's; check it.
// out[0]: 0 or the first error kind; out[1]: bytes that differ.
// (Bounded at 512 threads a block, as every kernel here: on sm_80 ptxas
// would otherwise take 164 registers a thread and a 512-thread block could
// not launch; .ci/nvcc-check checks every kernel against it.)
extern "C" __global__ void __launch_bounds__(512)
    gin_ring(DevComm dc, Window send, Window recv, u64 bytes, u32 rounds, u32 coop, u64* out) {
  const u32 next = (dc.rank + 1) % dc.nranks, prev = (dc.rank + dc.nranks - 1) % dc.nranks;
  for (u32 r = 0; r < rounds; ++r) {
    fill((u8*)send.local_base, bytes, dc.rank, r);
    __syncthreads();
    int e = put(dc, 0, next, recv, 0, send, 0, bytes, signal_inc(0), counter_inc(0), (Coop)coop);
    if (!e) e = wait_signal(dc, 0, 0, r + 1, (Coop)coop);
    if (!e) e = wait_counter(dc, 0, 0, r + 1, (Coop)coop);
    if (e) {
      if (threadIdx.x == 0) out[0] = e;
      return;
    }
    __syncthreads();
    verify((const u8*)recv.local_base, bytes, prev, r, out);
    // Nobody overwrites `recv` before its owner has checked it.
    e = barrier(dc, 0, 0, (Coop)coop);
    if (e) {
      if (threadIdx.x == 0) out[0] = e;
      return;
    }
  }
}

// All-to-all, round `r` (one block per peer): block p puts `bytes` to peer p
// at offset rank * bytes with signal 0, waits until nranks * (r + 1) have
// arrived, flushes, and checks the block from peer p. The host separates
// rounds with a barrier. out as gin_ring.
extern "C" __global__ void gin_alltoall(DevComm dc, Window send, Window recv, u64 bytes, u32 r,
                                        u64* out) {
  const u32 p = blockIdx.x;
  u8* s = (u8*)send.local_base + (u64)p * bytes;
  for (u64 i = threadIdx.x; i < bytes; i += blockDim.x) s[i] = pattern(dc.rank * 1000 + p, i, r);
  __syncthreads();
  int e = put(dc, 0, p, recv, (u64)dc.rank * bytes, send, (u64)p * bytes, bytes, signal_inc(0),
              no_counter(), CTA);
  if (!e) e = wait_signal(dc, 0, 0, (u64)dc.nranks * (r + 1), CTA);
  if (!e) e = flush(dc, 0, CTA);
  if (e) {
    if (threadIdx.x == 0) out[0] = e;
    return;
  }
  const u8* got = (const u8*)recv.local_base + (u64)p * bytes;
  u64 bad = 0;
  for (u64 i = threadIdx.x; i < bytes; i += blockDim.x)
    bad += got[i] != pattern(p * 1000 + dc.rank, i, r);
  if (bad) atomicAdd((unsigned long long*)&out[1], (unsigned long long)bad);
}

// Timed all-to-all, the seed's pattern (one block per peer): each iteration
// block p puts `bytes` to peer p at offset rank * bytes with signal 0, waits
// until every rank's put of this iteration has arrived, and flushes. `base`:
// signal 0 before this launch. out[0]: error; out[2]: ns of `iters`
// iterations after `warmup`, on block 0. Data is checked by gin_alltoall.
// gin-bench launches it with blocks of 512 threads: bounded so, or ptxas
// takes up to 142 registers a thread, more than a 512-thread block can hold.
extern "C" __global__ void __launch_bounds__(512)
    gin_alltoall_timed(DevComm dc, Window send, Window recv, u64 bytes, u32 iters, u32 warmup,
                       u64 base, u64* out) {
  const u32 p = blockIdx.x;
  u64 t0 = 0;
  for (u32 i = 0; i < warmup + iters; ++i) {
    if (i == warmup) t0 = proxy::globaltimer();
    int e = put(dc, 0, p, recv, (u64)dc.rank * bytes, send, (u64)p * bytes, bytes, signal_inc(0),
                no_counter(), CTA);
    if (!e) e = wait_signal(dc, 0, 0, base + (u64)dc.nranks * (i + 1), CTA);
    if (!e) e = flush(dc, 0, CTA);
    if (e) {
      if (threadIdx.x == 0) out[0] = e;
      return;
    }
  }
  if (p == 0 && threadIdx.x == 0) out[2] = proxy::globaltimer() - t0;
}

// Put-with-signal ping-pong between ranks 0 and 1, one kernel per rank: rank
// 0 puts `bytes` and waits for the echo; rank 1 echoes. `base`: signal 1's
// value before this launch (the host counts; reading it here would race with
// the peer's first put). out[0]: error,
// out[2]: elapsed ns of `iters` round trips after `warmup`, measured on the
// device. Signal 1 counts arrivals. The coop is a compile-time constant, as
// in a user's kernel: one kernel each, gin_pingpong_{thread,warp,block},
// launched with one block of 1, 32 and up to 512 threads (block_1024: up to
// 1024, with nvcc's register budget for that, 64).
template <Coop C>
__device__ __forceinline__ void pingpong(const DevComm& dc, const Window& buf, u64 bytes, u32 iters,
                                         u32 warmup, u64 base, u64* out) {
  if (dc.rank > 1) return;
  const u32 peer = dc.rank ^ 1;
  u64 t0 = 0;
  for (u32 i = 0; i < warmup + iters; ++i) {
    if (i == warmup) t0 = proxy::globaltimer();
    int e = OK;
    if (dc.rank == 0) {
      e = put(dc, 0, peer, buf, 0, buf, 0, bytes, signal_inc(1), no_counter(), C);
      if (!e) e = wait_signal(dc, 0, 1, base + i + 1, C);
    } else {
      e = wait_signal(dc, 0, 1, base + i + 1, C);
      if (!e) e = put(dc, 0, peer, buf, 0, buf, 0, bytes, signal_inc(1), no_counter(), C);
    }
    if (e) {
      if (threadIdx.x == 0) out[0] = e;
      return;
    }
  }
  if (threadIdx.x == 0) out[2] = proxy::globaltimer() - t0;
  flush(dc, 0, C);
}

#define GIN_PINGPONG(name, coop, bounds)                                                           \
  extern "C" __global__ void __launch_bounds__(bounds)                                            \
      name(DevComm dc, Window buf, u64 bytes, u32 iters, u32 warmup, u64 base, u64* out) {        \
    pingpong<coop>(dc, buf, bytes, iters, warmup, base, out);                                      \
  }
GIN_PINGPONG(gin_pingpong_thread, THREAD, 1)
GIN_PINGPONG(gin_pingpong_warp, WARP, 32)
GIN_PINGPONG(gin_pingpong_block, CTA, 512)
GIN_PINGPONG(gin_pingpong_block_1024, CTA, 1024)

// One-way bandwidth: rank 0's `gridDim.x` blocks each put their slice of
// `bytes` to rank 1, `iters` times; with `sig_each` every put carries signal
// 2, otherwise only each block's last (puts in a stream, then one signal, as
// NVSHMEM's put_bw issues puts then quiet). Rank 1 waits for all of them and
// answers with signal 3. out[2]: ns on rank 0 from the first put to the
// answer. base2, base3: signals 2 and 3 before this launch.
extern "C" __global__ void __launch_bounds__(512)
    gin_bandwidth(DevComm dc, Window src, Window dst, u64 bytes, u32 iters, u32 sig_each,
                  u64 base2, u64 base3, u64* out) {
  if (dc.rank > 1) return;
  const u64 slice = (bytes / gridDim.x + 15) & ~15ull;
  const u64 off = slice * blockIdx.x;
  const u64 n = off >= bytes ? 0 : (bytes - off < slice ? bytes - off : slice);
  __syncthreads();
  if (dc.rank == 0) {
    const u64 t0 = proxy::globaltimer();
    for (u32 i = 0; i < iters; ++i) {
      const Remote rem = (sig_each || i + 1 == iters) ? signal_inc(2) : no_signal();
      int e = put(dc, 0, 1, dst, off, src, off, n, rem, no_counter(), CTA);
      if (e) {
        if (threadIdx.x == 0) out[0] = e;
        return;
      }
    }
    if (blockIdx.x == 0) {
      int e = wait_signal(dc, 0, 3, base3 + 1, CTA);
      if (e && threadIdx.x == 0) out[0] = e;
      if (threadIdx.x == 0) out[2] = proxy::globaltimer() - t0;
    }
    flush(dc, 0, CTA);
  } else if (blockIdx.x == 0) {
    const u64 per_block = sig_each ? iters : 1;
    int e = wait_signal(dc, 0, 2, base2 + per_block * gridDim.x, CTA);
    if (!e) e = signal(dc, 0, 0, signal_inc(3), CTA);
    if (!e) e = flush(dc, 0, CTA);
    if (e && threadIdx.x == 0) out[0] = e;
  }
}

// Bad input: which = 1 bad peer, 2 out-of-window offset, 3 unknown signal,
// 4 unknown counter, 5 wait for a signal that never comes (timeout or abort),
// 6 a WQE with a bad key (GDAKI).
// out[0]: the kind returned.
extern "C" __global__ void gin_badinput(DevComm dc, Window w, u32 which, u64* out) {
  int e = OK;
  switch (which) {
    case 1: e = put(dc, 0, dc.nranks + 3, w, 0, w, 0, 8); break;
    case 2: e = put(dc, 0, (dc.rank + 1) % dc.nranks, w, w.local_size - 4, w, 0, 8); break;
    case 3: e = put(dc, 0, (dc.rank + 1) % dc.nranks, w, 0, w, 0, 8, signal_inc(dc.nsignals + 5)); break;
    case 4: e = wait_counter(dc, 0, dc.ncounters, 1); break;
    case 5: e = wait_signal(dc, 0, 0, 1ull << 40); break;
    case 6: {
      // GDAKI only: a well-formed RDMA write whose remote key is no
      // window's. The NIC must answer with an error CQE, which flush turns
      // into WQE_ERROR naming the WQE and the syndrome.
      if (dc.backend_kind != BACKEND_GDAKI) {
        e = UNSUPPORTED;
        break;
      }
      const u32 p = (dc.rank + 1) % dc.nranks;
      const detail::GdakiData g{1, 0xdead0001u, ((const u32*)w.keys)[dc.rank],
                                ((const u64*)w.addrs)[p], w.local_base, 8, 0};
      e = detail::gdaki_post(dc, 0, p, detail::gqp(dc, 0, p), g, no_signal(), no_counter());
      if (!e) e = flush(dc, 0);
      break;
    }
    default: e = UNSUPPORTED;
  }
  out[0] = e;
}

// Get: reads the previous rank's pattern (written by itself before a host
// barrier) into `dst` and checks it. out as gin_ring.
extern "C" __global__ void gin_get(DevComm dc, Window src, Window dst, u64 bytes, u64* out) {
  const u32 prev = (dc.rank + dc.nranks - 1) % dc.nranks;
  int e = get(dc, 0, prev, src, 0, dst, 0, bytes, CTA);
  if (!e) e = flush(dc, 0, CTA);
  if (e) {
    if (threadIdx.x == 0) out[0] = e;
    return;
  }
  __syncthreads();
  verify((const u8*)dst.local_base, bytes, prev, 99, out);
}

// Signals from every rank to every rank (itself included), read, reset and
// reused: each rank adds 1 + rank to signal 2 at every rank, waits for the
// sum, reads it, resets it once every rank has seen it, reads zero, then
// every rank adds 1 and each waits for nranks from zero. Load/store senders
// share the receiver's sub-slot, queued ones use their own: the sums must
// come out alike. out as gin_ring (out[1]: wrong values read).
extern "C" __global__ void gin_signals(DevComm dc, u32 coop, u64* out) {
  const u64 n = dc.nranks;
  const u64 sum = n + n * (n - 1) / 2;
  int e = OK;
  u64 bad = 0;
  for (u32 p = 0; p < dc.nranks && !e; ++p)
    e = signal(dc, 0, p, signal_add(2, 1 + dc.rank), (Coop)coop);
  if (!e) e = wait_signal(dc, 0, 2, sum, (Coop)coop);
  if (!e) bad += read_signal(dc, 0, 2) != sum;
  // This rank has seen the whole sum, so no signal to its slot 2 is in
  // flight; the barrier keeps the reads above before the reset.
  if (!e) e = barrier(dc, 0, 0, (Coop)coop);
  __shared__ int reset_e;
  if (threadIdx.x == 0) reset_e = e ? e : reset_signal(dc, 0, 2);
  __syncthreads();
  e = reset_e;
  if (!e) bad += read_signal(dc, 0, 2) != 0;
  // Nobody signals again before every rank has reset.
  if (!e) e = barrier(dc, 0, 1, (Coop)coop);
  for (u32 p = 0; p < dc.nranks && !e; ++p) e = signal(dc, 0, p, signal_inc(2), (Coop)coop);
  if (!e) e = wait_signal(dc, 0, 2, n, (Coop)coop);
  if (!e) bad += read_signal(dc, 0, 2) != n;
  if (!e) e = flush(dc, 0, (Coop)coop);
  if (e && threadIdx.x == 0) out[0] = e;
  // Every member's reads count, as in verify().
  if (bad) atomicAdd((unsigned long long*)&out[1], (unsigned long long)bad);
}

// Rail barriers: each round every rank stores the round number in its own
// u64 slot of `w` and puts it to the same slot at every other member of its
// rail, then enters rail barrier 0. Afterwards each member's slot here must
// hold that round (puts before a barrier are visible after it) or the next
// (a member may have left the barrier and sent again). Then, if `stranger`
// names a rank, a put to it, which a rail connection does not reach, with
// its destination (or, with `bad_src`, its source) offset outside the window
// as well: the host expects the peer to be named, not the offset. out as
// gin_ring (out[1]: wrong slots seen).
extern "C" __global__ void gin_rail(DevComm dc, Window w, u32 rounds, u32 coop, u32 stranger,
                                    u32 bad_src, u64* out) {
  const Coop c = (Coop)coop;
  volatile u64* slots = (volatile u64*)w.local_base;
  const u64 mine = dc.rank * 8ull;
  int e = OK;
  u64 bad = 0;
  for (u32 k = 1; k <= rounds && !e; ++k) {
    if (threadIdx.x == 0) slots[dc.rank] = k;
    for (u32 i = 0; i < rail_size(dc) && !e; ++i)
      if (rail_rank(dc, i) != dc.rank)
        e = put(dc, 0, rail_rank(dc, i), w, mine, w, mine, 8, no_signal(), no_counter(), c);
    if (!e) e = rail_barrier(dc, 0, 0, c);
    if (!e && threadIdx.x == 0)
      for (u32 i = 0; i < rail_size(dc); ++i) {
        const u64 v = slots[rail_rank(dc, i)];
        bad += v < k || v > k + 1;
      }
  }
  if (!e && stranger < dc.nranks) {
    const u64 past = w.local_size;
    e = put(dc, 0, stranger, w, bad_src ? 0 : past, w, bad_src ? past : 0, 8, no_signal(),
            no_counter(), c);
  }
  if (e && threadIdx.x == 0) out[0] = e;
  if (bad) atomicAdd((unsigned long long*)&out[1], (unsigned long long)bad);
}

extern "C" __global__ void gin_fill(Window w, u64 bytes, u32 rank, u32 round) {
  fill((u8*)w.local_base, bytes, rank, round);
}

// Floor of the proxy path, without gin-rs: a raw CPU-proxied copy plus flag.
// Rank 0 stores i+1 into its mapped host flag and waits for its device flag;
// the host thread of each rank copies `bytes` to the peer with the copy
// engine and stores the value into the peer's device flag; rank 1 echoes.
// out[2]: ns for `iters` round trips after `warmup`.
extern "C" __global__ void gin_floor_proxy(u32 rank, u64 host_flag, u64 dev_flag, u32 iters,
                                           u32 warmup, u64* out) {
  volatile u64* hf = (volatile u64*)host_flag;
  const u64* df = (const u64*)dev_flag;
  u64 t0 = 0;
  for (u32 i = 0; i < warmup + iters; ++i) {
    if (i == warmup) t0 = proxy::globaltimer();
    if (rank == 0) {
      __threadfence();
      *hf = i + 1;
      while (detail::ld_acquire_sys(df) < i + 1) {
      }
    } else {
      while (detail::ld_acquire_sys(df) < i + 1) {
      }
      __threadfence();
      *hf = i + 1;
    }
  }
  out[2] = proxy::globaltimer() - t0;
}

// Floor of the load/store path, without gin-rs: a raw copy over the peer
// mapping by the coop, then a release store of a flag (GPU scope where the
// ranks share this GPU, as gin-rs's signal then has). out[2] as above. One
// kernel per coop, as gin_pingpong_*.
template <Coop C>
__device__ __forceinline__ void floor_lsa(u32 rank, u64 peer_buf, u64 local_buf, u64 peer_flag,
                                          u64 my_flag, u64 bytes, u32 iters, u32 warmup,
                                          u64* out, u32 same_gpu) {
  u64 t0 = 0;
  for (u32 i = 0; i < warmup + iters; ++i) {
    if (i == warmup) t0 = proxy::globaltimer();
    if (rank == 1) {
      if (detail::coop_rank(C) == 0)
        while (detail::ld_acquire_sys((const u64*)my_flag) < i + 1) {
        }
      detail::coop_sync(C);
    }
    detail::coop_copy(C, (u8*)peer_buf, (const u8*)local_buf, bytes);
    detail::coop_sync(C);
    if (detail::coop_rank(C) == 0) {
      if (same_gpu)
        asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(peer_flag), "l"((u64)i + 1) : "memory");
      else
        asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(peer_flag), "l"((u64)i + 1) : "memory");
    }
    if (rank == 0) {
      if (detail::coop_rank(C) == 0)
        while (detail::ld_acquire_sys((const u64*)my_flag) < i + 1) {
        }
      detail::coop_sync(C);
    }
  }
  if (detail::coop_rank(C) == 0) out[2] = proxy::globaltimer() - t0;
}

#define GIN_FLOOR_LSA(name, coop, bounds)                                                          \
  extern "C" __global__ void __launch_bounds__(bounds)                                            \
      name(u32 rank, u64 peer_buf, u64 local_buf, u64 peer_flag, u64 my_flag, u64 bytes,          \
           u32 iters, u32 warmup, u64* out, u32 same_gpu) {                                        \
    floor_lsa<coop>(rank, peer_buf, local_buf, peer_flag, my_flag, bytes, iters, warmup, out,     \
                    same_gpu);                                                                     \
  }
GIN_FLOOR_LSA(gin_floor_lsa_thread, THREAD, 1)
GIN_FLOOR_LSA(gin_floor_lsa_warp, WARP, 32)
GIN_FLOOR_LSA(gin_floor_lsa_block, CTA, 512)
GIN_FLOOR_LSA(gin_floor_lsa_block_1024, CTA, 1024)
