// gin-rs device API for CUDA kernels: the operations CPU ranks call through
// gin-device's Ctx (put, put_value, signal, get, flush, waits, resets,
// barriers), for a thread, a warp or a block.
//
// Paths, chosen per peer by the host (DevComm::lsa):
// - load/store (NCCL's LSA, DeepEP's NVLink kernels): the peer's window is
//   mapped here through CUDA IPC; a put is a copy by the cooperating threads,
//   a signal a system-scope atomic add on the peer's sub-slot.
// - proxy: a descriptor in a ring in mapped host memory; a CPU thread moves
//   the data with the copy engine and stores the signal after it.
// - gdaki: mlx5 WQEs in a send queue in mapped host memory, a doorbell
//   record and a doorbell; the soft NIC executes them with the copy engine
//   and reports through a collapsed CQ in device memory.
//
// Every call checks its arguments (context, peer, window range, ids) and
// every wait has a timeout (%globaltimer) and honours the abort flag. A
// failure returns its ErrorKind and records the first error in the error
// word, which the host turns into an error naming rank, peer, context and id.
//
// Include as "gin/gin.cuh"; as host C++ only the ABI and the encoders are
// visible.
#pragma once
#include "gin/abi.cuh"
#include "gin/gdaki.cuh"
#include "gin/proxy.cuh"

#if defined(__CUDACC__)
namespace gin {

// The remote action of a put (gin-device's ops::Remote).
struct Remote {
  u32 kind; // 0: none, 1: signal `id`, 2: signal by window address (VA)
  u32 id;
  u64 add;
  u32 weak;          // 1: order only the signal's own put (Order::Weak)
  const Window* win; // kind 2: the window holding the signal word
  u64 off;           // kind 2: the word's offset in the peer's part (8-aligned)
};
GIN_HD Remote no_signal() { return Remote{0, 0, 0, 0, nullptr, 0}; }
// Signal `id` of the put's context: strong (every earlier put of the
// context to that peer is visible when it is) or weak (only its own put).
GIN_HD Remote signal_inc(u32 id) { return Remote{1, id, 1, 0, nullptr, 0}; }
GIN_HD Remote signal_add(u32 id, u64 v) { return Remote{1, id, v, 0, nullptr, 0}; }
GIN_HD Remote signal_inc_weak(u32 id) { return Remote{1, id, 1, 1, nullptr, 0}; }
GIN_HD Remote signal_add_weak(u32 id, u64 v) { return Remote{1, id, v, 1, nullptr, 0}; }
// A signal by window address (Remote::VaSignal): adds to the 8-byte word at
// `off` of the peer's part of `w`, which a wait_va_signal there watches.
// The load/store path adds with a system-scope atomic; the queue paths need
// an engine with atomics (FLAG_QUEUE_ATOMICS), else the call fails with
// COPY_ENGINE. `w` must outlive the call (the Remote keeps its address).
GIN_HD Remote va_signal_inc(const Window& w, u64 off) { return Remote{2, 0, 1, 0, &w, off}; }
GIN_HD Remote va_signal_add(const Window& w, u64 off, u64 v) { return Remote{2, 0, v, 0, &w, off}; }
GIN_HD Remote va_signal_inc_weak(const Window& w, u64 off) { return Remote{2, 0, 1, 1, &w, off}; }
GIN_HD Remote va_signal_add_weak(const Window& w, u64 off, u64 v) {
  return Remote{2, 0, v, 1, &w, off};
}

// A pending local completion from flush_async: what `wait` waits for (the
// queue marks of one (context, peer) when it was taken).
struct Request {
  u64 main; // proxy: the ring's producer index; GDAKI: the main SQ's reservation
  u64 aux;  // GDAKI: the companion SQ's reservation (0 otherwise)
  u32 peer; // NO_PEER: nothing to wait for (a load/store peer)
  u32 ctx;
};

// The local action of a put: counter `id` counts it once the source may be
// reused.
struct LocalAction {
  u32 kind; // 0: none, 1: counter increment
  u32 id;
};
GIN_HD LocalAction no_counter() { return LocalAction{0, 0}; }
GIN_HD LocalAction counter_inc(u32 id) { return LocalAction{1, id}; }

namespace detail {

GIN_DEV u32 lane() {
  u32 l;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(l));
  return l;
}
GIN_DEV u32 coop_rank(Coop c) {
  if (c == THREAD) return 0;
  if (c == WARP) return lane();
  return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}
GIN_DEV u32 coop_size(Coop c) {
  if (c == THREAD) return 1;
  if (c == WARP) return 32;
  return blockDim.x * blockDim.y * blockDim.z;
}
GIN_DEV void coop_sync(Coop c) {
  if (c == WARP) __syncwarp();
  if (c == CTA) __syncthreads();
}
// The leader's status (0: OK), for every member; a barrier too, so what
// the leader observed (an acquire) is visible to every member afterwards.
GIN_DEV int coop_bcast(Coop c, int v) {
  if (c == THREAD) return v;
  if (c == WARP) {
    __syncwarp();
    return __shfl_sync(0xffffffffu, v, 0);
  }
  // One barrier when the leader is OK, the common case; two more to pass
  // the leader's error code on when it is not.
  const bool leader = coop_rank(c) == 0;
  if (!__syncthreads_or(leader && v != 0)) return 0;
  __shared__ int slot;
  if (leader) slot = v;
  __syncthreads();
  const int r = slot;
  __syncthreads();
  return r;
}

GIN_DEV int fail(const DevComm& dc, u32 kind, u32 ctx, u32 peer, u32 value) {
  atomicCAS((unsigned long long*)dc.error_word, 0ull,
            (unsigned long long)error_word(kind, ctx, peer, value));
  return (int)kind;
}

GIN_DEV u64 ld_acquire_sys(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
// Two adjacent words (`p` 16-byte aligned), each an acquire load, in one
// instruction: one L2 round trip where two scalar acquires serialise.
GIN_DEV u64 ld_acquire_sys_pair_sum(const u64* p) {
  u64 a, b;
  asm volatile("ld.acquire.sys.global.v2.u64 {%0, %1}, [%2];"
               : "=l"(a), "=l"(b)
               : "l"(p)
               : "memory");
  return a + b;
}
GIN_DEV u64 ld_relaxed_sys(const u64* p) {
  u64 v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
// Adds `v` at `p` after every store this thread has made or observed
// (including the coop's, through its barrier) is visible to the reader:
// system-wide, or, where `p` and the reader are on this GPU (`same_gpu`),
// GPU-wide. A GPU-scope release waits only for the stores to reach this
// GPU's L2, about 0.25 us less on an H200 than a system-scope one, and is
// enough there: the reader's threads are in its scope.
GIN_DEV void red_add_release(u64* p, u64 v, bool same_gpu) {
  if (same_gpu)
    asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
  else
    asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Polls `ready` with a timeout and the abort flag; returns OK, `timeout_kind`
// or ABORTED (the error word is written by the caller). Before giving up it
// looks once more: the host raises the abort flag when a peer leaves, and a
// value that peer wrote before it left still satisfies the wait.
// `limit` is the timeout in %globaltimer nanoseconds (NO_TIMEOUT: none; 0:
// one look).
template <class Ready>
GIN_DEV u32 poll_for(const DevComm& dc, u64 limit, u32 timeout_kind, Ready ready) {
  if (ready()) return OK;
  if (limit == 0) return timeout_kind;
  const u64 start = proxy::globaltimer();
  for (u32 spin = 1;; ++spin) {
    if (ready()) return OK;
    if ((spin & 1023) == 0) {
      if (dc.abort_flag && *(volatile u32*)dc.abort_flag != 0) return ready() ? OK : ABORTED;
      if (limit != NO_TIMEOUT && proxy::globaltimer() - start > limit)
        return ready() ? OK : timeout_kind;
    }
  }
}
// The communicator's timeout as a poll limit.
GIN_DEV u64 comm_limit(const DevComm& dc) { return dc.timeout_ticks ? dc.timeout_ticks : NO_TIMEOUT; }
template <class Ready>
GIN_DEV u32 poll(const DevComm& dc, u32 timeout_kind, Ready ready) {
  return poll_for(dc, comm_limit(dc), timeout_kind, ready);
}

// `poll` for a whole warp: every lane reads (the same words, one
// transaction) and lane 0's reading decides, so the warp never diverges
// while it waits. Returns the same code on every lane.
template <class Ready>
GIN_DEV u32 poll_warp(const DevComm& dc, u64 limit, u32 timeout_kind, Ready ready) {
  constexpr u32 NOT_YET = ~0u;
  u64 start = 0;
  for (u32 spin = 0;; ++spin) {
    u32 k = ready() ? OK : NOT_YET;
    if (k == NOT_YET && limit == 0) k = timeout_kind;
    if (k == NOT_YET && (spin & 1023) == 1) {
      const u64 now = proxy::globaltimer();
      // The first check starts the clock (the timer is never 0), once: the
      // spin count may wrap in a long wait, the clock must not restart.
      if (start == 0) start = now;
      // One last look before giving up, as in `poll`.
      if (dc.abort_flag && *(volatile u32*)dc.abort_flag != 0) k = ready() ? OK : ABORTED;
      else if (limit != NO_TIMEOUT && now - start > limit) k = ready() ? OK : timeout_kind;
    }
    k = __shfl_sync(0xffffffffu, k, 0);
    if (k != NOT_YET) return k;
  }
}

// How a peer is reached, from DevComm::lsa: 1 load/store, 0 through the
// context's queues (proxy ring or GDAKI QP), 2 not at all (a rail
// connection reaches only the rail); bit 2 (REACH_SAME_GPU) beside 1: the
// peer runs on this GPU (ranks sharing one GPU), so releases to it need
// only GPU scope.
constexpr u8 REACH_QUEUE = 0, REACH_LSA = 1, REACH_NONE = 2, REACH_SAME_GPU = 4;
GIN_DEV u8 reach_byte(const DevComm& dc, u32 peer) {
  return __ldg((const unsigned char*)dc.lsa + peer);
}
GIN_DEV u8 reach(const DevComm& dc, u32 peer) { return reach_byte(dc, peer) & 3; }
GIN_DEV bool same_gpu(const DevComm& dc, u32 peer) {
  return (reach_byte(dc, peer) & REACH_SAME_GPU) != 0;
}
GIN_DEV bool is_lsa(const DevComm& dc, u32 peer) { return reach(dc, peer) == REACH_LSA; }
GIN_DEV bool is_queued(const DevComm& dc, u32 peer) { return reach(dc, peer) == REACH_QUEUE; }
// The backend's queue path, where this kernel was compiled with it
// (GIN_QUEUE_PATHS): a path compiled out is a constant false, so its code
// is not generated at all.
GIN_DEV bool proxy_path(const DevComm& dc) {
  return (GIN_QUEUE_PATHS & GIN_QUEUE_PROXY) != 0 && dc.backend_kind == BACKEND_PROXY;
}
GIN_DEV bool gdaki_path(const DevComm& dc) {
  return (GIN_QUEUE_PATHS & GIN_QUEUE_GDAKI) != 0 && dc.backend_kind == BACKEND_GDAKI;
}
// The backend has queues but this kernel was compiled without them.
GIN_DEV bool path_not_built(const DevComm& dc) {
  return (dc.backend_kind == BACKEND_PROXY && (GIN_QUEUE_PATHS & GIN_QUEUE_PROXY) == 0) ||
         (dc.backend_kind == BACKEND_GDAKI && (GIN_QUEUE_PATHS & GIN_QUEUE_GDAKI) == 0);
}
// The rail team after the reach table: rail barriers, members, ranks.
GIN_DEV const u32* rail_team(const DevComm& dc) {
  return (const u32*)((const u8*)dc.lsa + ((dc.nranks + 3u) & ~3u));
}
GIN_DEV const ProxyRingAbi& ring(const DevComm& dc, u32 ctx, u32 peer) {
  return ((const ProxyRingAbi*)dc.rings)[ctx * dc.nranks + peer];
}
// Global slot index of signal `id` (or barrier slot) of context `ctx`.
// A signal slot is `nranks` u64 sub-slots whose sum is its value: sub-slot
// `r` at a peer is written only by the proxy or NIC serving rank `r`
// (running totals); a GPU reaching the peer by load/store adds to the
// peer's own sub-slot instead (system-scope atomics), so with
// FLAG_LSA_ONLY that sub-slot is the whole value. World barriers use
// per-sender sub-slots throughout (each counts its sender's arrivals).
GIN_DEV u64 signal_slot(const DevComm& dc, u32 ctx, u32 id) {
  return dc.signal_base + (u64)ctx * dc.sig_per_ctx + id;
}
// Byte offset of this rank's sub-slot of `slot` in any rank's signal window.
GIN_DEV u64 sender_offset(const DevComm& dc, u64 slot) {
  return (slot * dc.nranks + dc.rank) * 8;
}
// Byte offset of `peer`'s own sub-slot of `slot` in its signal window.
GIN_DEV u64 receiver_offset(const DevComm& dc, u64 slot, u32 peer) {
  return (slot * dc.nranks + peer) * 8;
}
GIN_DEV u64* counter_subslots(const DevComm& dc, u32 ctx, u32 id) {
  return (u64*)dc.counters + 2 * (dc.counter_base + (u64)ctx * dc.ncounters + id);
}

GIN_DEV bool range_ok(u64 off, u64 bytes, u64 size) { return off <= size && bytes <= size - off; }

// Copies `bytes` from `src` to `dst` with the coop's threads, 16 bytes at a
// time where both are aligned.
GIN_DEV void coop_copy(Coop c, u8* dst, const u8* src, u64 bytes) {
  const u32 r = coop_rank(c), n = coop_size(c);
  u64 head = 0;
  if ((((u64)dst | (u64)src) & 15) == 0) {
    const u64 vecs = bytes / 16;
    uint4* d = (uint4*)dst;
    const uint4* s = (const uint4*)src;
    u64 i = r;
    // Eight 16-byte loads in flight per thread before the stores: a lone
    // thread or a warp is bound by load latency, not by the link.
#pragma unroll 1
    for (; i + 7 * n < vecs; i += 8 * n) {
      uint4 v[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = s[i + k * n];
#pragma unroll
      for (int k = 0; k < 8; ++k) d[i + k * n] = v[k];
    }
    // The rest, fewer than eight vectors for this thread: two predicated
    // rounds of four loads in flight. A loop of one load at a time left
    // every copy of fewer than eight vectors per thread (64 KiB for a
    // 512-thread block: each block's share of a 4 MiB put over 66 or more
    // blocks) waiting on one load at a time; one predicated round of eight
    // made 1024-thread blocks, capped at 64 registers, spill in this loop.
#pragma unroll 1
    for (int round = 0; round < 2 && i < vecs; ++round, i += 4 * n) {
      uint4 v[4];
#pragma unroll
      for (int k = 0; k < 4; ++k)
        if (i + k * n < vecs) v[k] = s[i + k * n];
#pragma unroll
      for (int k = 0; k < 4; ++k)
        if (i + k * n < vecs) d[i + k * n] = v[k];
    }
    head = vecs * 16;
  }
#pragma unroll 1
  for (u64 i = head + r; i < bytes; i += n) dst[i] = src[i];
}

// Says when a producer waiting for ring credit should give up; the clock
// starts at its first call, so a push with credit never reads it.
struct Giver {
  const DevComm& dc;
  u64 start;
  u32 kind;
  GIN_DEV bool operator()() {
    if (dc.abort_flag && *(volatile u32*)dc.abort_flag != 0) {
      kind = ABORTED;
      return true;
    }
    const u64 now = proxy::globaltimer();
    if (start == 0) start = now;
    if (dc.timeout_ticks && now - start > dc.timeout_ticks) {
      kind = QUEUE_TIMEOUT;
      return true;
    }
    return false;
  }
};

// Leader only: queues `d` on ring `r`, the one of (ctx, peer).
GIN_DEV int push_on(const DevComm& dc, const ProxyRingAbi& r, u32 ctx, u32 peer,
                    const proxy::Desc& d) {
  // The source bytes this block wrote must be visible to the copy engine
  // before the proxy can read the descriptor. The copy engine reads this
  // GPU's memory through its L2, so a GPU-scope fence is enough; a
  // system-scope one would also wait for earlier writes to host memory
  // (0.3 to 1 us less per round trip on 2x H200, measured).
  __threadfence();
  // The completion index and the reservation travel together: one L2
  // round trip, not two.
  const u64 done_seen = proxy::ld_relaxed_gpu((const u64*)r.done);
  const u64 seq = proxy::reserve(r, dc.flags);
  Giver g{dc, 0, OK};
  if (!proxy::publish(r, seq, done_seen, d, g)) return fail(dc, g.kind, ctx, peer, (u32)seq);
  return OK;
}
GIN_DEV int push(const DevComm& dc, u32 ctx, u32 peer, const proxy::Desc& d) {
  const ProxyRingAbi r = ring(dc, ctx, peer);
  return push_on(dc, r, ctx, peer, d);
}

GIN_DEV int check_ctx(const DevComm& dc, u32 ctx) {
  return ctx < dc.nctx ? OK : fail(dc, BAD_CONTEXT, ctx, NO_PEER, ctx);
}

GIN_DEV bool has_queues(const DevComm& dc);
GIN_DEV bool is_queued(const DevComm& dc, u32 peer);
// A VA signal's word: inside the peer's part, 8-byte aligned, and on a
// queue path only with an engine that has atomics.
GIN_DEV int check_va(const DevComm& dc, u32 ctx, u32 peer, Remote rem) {
  const Window& w = *rem.win;
  if (!range_ok(rem.off, 8, ((const u64*)w.sizes)[peer]))
    return fail(dc, OUT_OF_WINDOW, ctx, peer, w.id);
  if (rem.off & 7) return fail(dc, MISALIGNED, ctx, peer, w.id);
  if (has_queues(dc) && is_queued(dc, peer) && !(dc.flags & FLAG_QUEUE_ATOMICS))
    return fail(dc, COPY_ENGINE, ctx, peer, w.id);
  return OK;
}

GIN_DEV int check_actions(const DevComm& dc, u32 ctx, u32 peer, Remote rem, LocalAction loc) {
  if (rem.kind == 1 && rem.id >= dc.nsignals) return fail(dc, BAD_SIGNAL, ctx, peer, rem.id);
  if (rem.kind == 2) {
    const int e = check_va(dc, ctx, peer, rem);
    if (e) return e;
  }
  if (rem.kind > 2) return fail(dc, UNSUPPORTED, ctx, peer, rem.kind);
  if (loc.kind == 1 && loc.id >= dc.ncounters) return fail(dc, BAD_COUNTER, ctx, peer, loc.id);
  if (loc.kind > 1) return fail(dc, UNSUPPORTED, ctx, peer, loc.kind);
  return OK;
}

GIN_DEV bool has_queues(const DevComm& dc) { return proxy_path(dc) || gdaki_path(dc); }

// The error for a peer reached neither by load/store nor by a queue path:
// not connected (off a rail connection), its backend's queue path compiled
// out of this kernel, or a backend that has no queues.
GIN_DEV int fail_not_queued(const DevComm& dc, u32 ctx, u32 peer) {
  return fail(dc, path_not_built(dc) ? PATH_NOT_BUILT : UNSUPPORTED, ctx, peer, dc.backend_kind);
}
GIN_DEV int fail_unreachable(const DevComm& dc, u32 ctx, u32 peer) {
  if (reach(dc, peer) == REACH_NONE) return fail(dc, BAD_PEER, ctx, peer, peer);
  return fail_not_queued(dc, ctx, peer);
}

GIN_DEV int check_peer(const DevComm& dc, u32 ctx, u32 peer) {
  if (peer >= dc.nranks) return fail(dc, BAD_PEER, ctx, peer, peer);
  const u8 how = reach(dc, peer);
  if (how == REACH_NONE) return fail(dc, BAD_PEER, ctx, peer, peer);
  if (how != REACH_LSA && !has_queues(dc)) return fail_not_queued(dc, ctx, peer);
  return OK;
}

// ------------------------------------------------------------------ GDAKI

GIN_DEV const GdakiQpAbi& gqp(const DevComm& dc, u32 ctx, u32 peer) {
  return ((const GdakiQpAbi*)dc.rings)[ctx * dc.nranks + peer];
}

// The data part of a GDAKI request.
struct GdakiData {
  u32 kind; // 0: none, 1: RDMA write, 2: inline 8-byte write, 3: RDMA read
  u32 rkey;
  u32 lkey;
  u64 raddr;
  u64 laddr;
  u64 bytes;
  u64 value;
};

// Leader only: posts a request to `peer` over GDAKI: its data WQEs (writes or
// reads of at most 1 GiB each), then the signal's fetch-add on this rank's
// sub-slot at the peer (strong: ordered after every earlier WQE of the QP),
// a NOP when there is neither; then, for a counter, a WAIT on the main QP's
// completion of the last WQE and a fetch-add on the counter, on the
// companion QP. Every WQE asks for a completion.
GIN_DEV int gdaki_post(const DevComm& dc, u32 ctx, u32 peer, const GdakiQpAbi& q,
                       const GdakiData& d, Remote rem, LocalAction loc) {
  constexpr u64 CHUNK = 1ull << 30;
  const u32 nchunks =
      d.kind == 2 ? 1u : (d.kind == 1 || d.kind == 3) ? (u32)((d.bytes + CHUNK - 1) / CHUNK) : 0u;
  const u32 nsig = rem.kind ? 1u : 0u;
  const u32 k = nchunks + nsig > 0 ? nchunks + nsig : 1u;
  if (k > (1u << q.main.log2) / 2) return fail(dc, UNSUPPORTED, ctx, peer, k);
  // The signal's word: this rank's sub-slot of signal `id` at the peer, or
  // a VA signal's word in the peer's part of its window.
  u64 sig_ra = 0;
  u32 sig_rk = 0;
  if (rem.kind == 1) {
    sig_ra = q.sig_addr + sender_offset(dc, signal_slot(dc, ctx, rem.id));
    sig_rk = q.sig_key;
  } else if (rem.kind == 2) {
    sig_ra = ((const u64*)rem.win->addrs)[peer] + rem.off;
    sig_rk = ((const u32*)rem.win->keys)[peer];
  }
  const u32 qpn = q.main.qpn;
  Giver g{dc, 0, OK};
  u64 last = 0;
  gdaki::Completion ce{};
  u32 r = gdaki::submit(
      q.main, dc.flags, k,
      [&](u32 i, u8* b, u16 idx) {
        if (i < nchunks) {
          if (d.kind == 2) {
            // The value's low `bytes` bytes, little-endian as in memory.
            gdaki::write_inline_value(b, idx, qpn, gdaki::CQ_UPDATE, d.raddr, d.rkey, d.value,
                                      (u32)d.bytes);
          } else {
            const u64 off = (u64)i * CHUNK;
            const u64 len = d.bytes - off < CHUNK ? d.bytes - off : CHUNK;
            gdaki::write(b, idx, qpn, gdaki::CQ_UPDATE, d.raddr + off, d.rkey, d.laddr + off,
                         d.lkey, (u32)len, d.kind == 3);
          }
        } else if (nsig) {
          const u8 fm = rem.weak ? 0 : gdaki::FM_STRONG_ORDERING;
          gdaki::fetch_add(b, idx, qpn, gdaki::CQ_UPDATE | fm, sig_ra, sig_rk, rem.add, q.sink,
                           q.sink_key);
        } else {
          gdaki::nop(b, idx, qpn, gdaki::CQ_UPDATE);
        }
      },
      g, &last, &ce);
  if (r == 1) return fail(dc, g.kind, ctx, peer, (u32)last);
  if (r == 2) return fail(dc, WQE_ERROR, ctx, peer, (ce.syndrome << 16) | ce.wqe);
  if (loc.kind == 1) {
    const u64 counter = dc.counters + 16 * (dc.counter_base + (u64)ctx * dc.ncounters + loc.id);
    const u32 cqpn = q.companion.qpn;
    u64 l2 = 0;
    r = gdaki::submit(
        q.companion, dc.flags, 2,
        [&](u32 i, u8* b, u16 idx) {
          if (i == 0)
            gdaki::wait(b, idx, cqpn, gdaki::CQ_UPDATE, (u32)(last & 0xffff), q.main_cqn);
          else
            gdaki::fetch_add(b, idx, cqpn, gdaki::CQ_UPDATE, counter, q.counter_key, 1, q.sink + 8,
                             q.sink_key);
        },
        g, &l2, &ce);
    if (r == 1) return fail(dc, g.kind, ctx, peer, (u32)l2);
    if (r == 2) return fail(dc, WQE_ERROR, ctx, peer, (ce.syndrome << 16) | ce.wqe);
  }
  return OK;
}

// Leader only: waits until every WQE reserved so far on the QPs to `peer`
// has completed; an error CQE is an error naming the WQE and syndrome.
GIN_DEV int gdaki_flush(const DevComm& dc, u32 ctx, u32 peer) {
  const GdakiQpAbi& q = gqp(dc, ctx, peer);
  for (int j = 0; j < 2; ++j) {
    const GdakiSqAbi& sq = j ? q.companion : q.main;
    const u64 mark = *(volatile const u64*)sq.indices;
    if (mark == 0) continue;
    gdaki::Completion c{};
    const u32 k = poll(dc, FLUSH_TIMEOUT, [&] {
      c = gdaki::completed(sq, mark - 1);
      return c.state != 0;
    });
    if (k) return fail(dc, k, ctx, peer, (u32)mark);
    if (c.state == 2) return fail(dc, WQE_ERROR, ctx, peer, (c.syndrome << 16) | c.wqe);
  }
  return OK;
}

// Leader only: the signal and counter of a put (or a bare signal) to `peer`
// whose data the coop has already stored (load/store path).
// `sig_base` is the peer's signal window as mapped here (read by the caller
// together with its other per-peer loads).
GIN_DEV void lsa_actions(const DevComm& dc, u32 ctx, u32 peer, u64* sig_base, Remote rem,
                         LocalAction loc, bool near) {
  if (rem.kind == 1) {
    // A release (system scope, or GPU scope to a peer on this GPU): the
    // coop's stores (ordered before this thread by the coop's barrier) are
    // visible at the peer before the signal. The add goes to the peer's own
    // sub-slot (see signal_slot).
    red_add_release(
        (u64*)((u8*)sig_base + receiver_offset(dc, signal_slot(dc, ctx, rem.id), peer)), rem.add,
        near);
  } else if (rem.kind == 2) {
    // A VA signal: the word itself, in the peer's part as mapped here.
    red_add_release((u64*)((u8*)sig_base + rem.off), rem.add, near);
  }
  if (loc.kind == 1) atomicAdd((unsigned long long*)(counter_subslots(dc, ctx, loc.id) + 1), 1ull);
}
GIN_DEV u64* signal_peer(const DevComm& dc, u32 peer) {
  return (u64*)__ldg((const unsigned long long*)dc.signal_peers + peer);
}
// The base lsa_actions adds `rem`'s signal relative to, as mapped here (null
// where unmapped or there is no signal): the peer's signal window for a
// signal id, the peer's part of the window for a VA signal.
GIN_DEV u64* lsa_signal_base(const DevComm& dc, u32 peer, Remote rem) {
  if (rem.kind == 1) return signal_peer(dc, peer);
  if (rem.kind == 2) return (u64*)((const u64*)rem.win->peer_bases)[peer];
  return nullptr;
}

GIN_DEV void proxy_actions(const DevComm& dc, u32 ctx, Remote rem, LocalAction loc,
                           proxy::Desc& d) {
  if (rem.kind == 1 || rem.kind == 2) {
    d.has_signal = 1;
    d.sig_strong = rem.weak ? 0 : 1;
    d.sig_window = rem.kind == 1 ? dc.signal_window : rem.win->id;
    d.sig_offset = rem.kind == 1 ? sender_offset(dc, signal_slot(dc, ctx, rem.id)) : rem.off;
    d.sig_add = rem.add;
  }
  if (loc.kind == 1) {
    d.has_counter = 1;
    d.counter = (u32)(dc.counter_base + (u64)ctx * dc.ncounters + loc.id);
  }
}

GIN_DEV proxy::Desc empty_desc(u32 op) {
  proxy::Desc d;
  d.op = op;
  d.dst_window = d.src_window = d.counter = 0;
  d.bytes = d.dst_offset = d.src_offset = d.inline_value = d.sig_offset = d.sig_add = 0;
  d.sig_window = 0;
  d.has_inline = d.has_signal = d.sig_strong = d.has_counter = 0;
  return d;
}

GIN_DEV u64 signal_sum(const DevComm& dc, u64 slot) {
  const u64* s = (const u64*)dc.signals + slot * dc.nranks;
  if (dc.flags & FLAG_LSA_ONLY) return ld_relaxed_sys(s + dc.rank);
  u64 sum = 0;
  for (u32 r = 0; r < dc.nranks; ++r) sum += ld_relaxed_sys(s + r);
  return sum;
}
// As signal_sum, with acquire loads: what each sender released before its
// signal is visible to this thread once the sum is seen. Acquires are
// serialised, so reading one sub-slot (FLAG_LSA_ONLY) saves an L2 round
// trip per other rank, and otherwise aligned pairs of sub-slots are read
// with one vector acquire (each element an acquire load).
GIN_DEV u64 signal_sum_acquire(const DevComm& dc, u64 slot) {
  const u64* s = (const u64*)dc.signals + slot * dc.nranks;
  if (dc.flags & FLAG_LSA_ONLY) return ld_acquire_sys(s + dc.rank);
  u64 sum = 0;
  // With an even number of ranks every slot starts 16-byte aligned where
  // the signal array does (cuMemAlloc's is; checked, as a window could
  // someday come from elsewhere).
  // Not unrolled: each acquire waits for its load before the next issues
  // (it invalidates L1 after it), so unrolling bought nothing but code and
  // registers, which a 1024-thread kernel (64 registers) paid in spills.
  if ((dc.nranks & 1) == 0 && (dc.signals & 15) == 0) {
#pragma unroll 1
    for (u32 r = 0; r < dc.nranks; r += 2) sum += ld_acquire_sys_pair_sum(s + r);
  } else {
#pragma unroll 1
    for (u32 r = 0; r < dc.nranks; ++r) sum += ld_acquire_sys(s + r);
  }
  return sum;
}

} // namespace detail

// ---------------------------------------------------------------- operations

// Puts `bytes` from `src` (this rank's part, at `src_off`) to `peer`'s part
// of `dst` at `dst_off`, then performs `rem` at the peer and `loc` here.
GIN_DEV int put(const DevComm& dc, u32 ctx, u32 peer, const Window& dst, u64 dst_off,
                const Window& src, u64 src_off, u64 bytes, Remote rem = no_signal(),
                LocalAction loc = no_counter(), Coop coop = THREAD) {
  using namespace detail;
  int e = check_ctx(dc, ctx);
  if (!e && peer >= dc.nranks) e = fail(dc, BAD_PEER, ctx, peer, peer);
  if (!e) e = check_actions(dc, ctx, peer, rem, loc);
  if (e) return e;
  // The source is checked from the arguments alone, so a small aligned
  // put's source can be loaded into registers while the per-peer tables are
  // on their way: one dependent L2 round trip per call instead of two.
  if (!range_ok(src_off, bytes, src.local_size)) {
    // (Cold.) A peer this connection does not reach is the error to report.
    if (!is_lsa(dc, peer) && (!has_queues(dc) || reach(dc, peer) == REACH_NONE))
      return fail_unreachable(dc, ctx, peer);
    return fail(dc, OUT_OF_WINDOW, ctx, peer, src.id);
  }
  const u32 me = coop_rank(coop), members = coop_size(coop);
  // Every member's stores to the source precede every member's loads of it
  // (and, on the queue paths, the leader's post), as with NVSHMEM's _block
  // and _warp calls.
  coop_sync(coop);
  // Up to 16 bytes: the leader alone. Up to two 16-byte vectors per member:
  // every member its share. Both from registers, loaded now.
  const bool tiny = bytes <= 16 && ((src_off | dst_off | bytes) & 7) == 0;
  const u8* const s = (const u8*)src.local_base + src_off;
  const bool vecs =
      !tiny && bytes <= 32ull * members && (((u64)s | dst_off | bytes) & 15) == 0;
  u64 v0 = 0, v1 = 0;
  uint4 w0{}, w1{};
  if (tiny && me == 0) {
    if (bytes >= 8) v0 = ((const u64*)s)[0];
    if (bytes == 16) v1 = ((const u64*)s)[1];
  }
  if (vecs) {
    const u64 n = bytes / 16;
    if (me < n) w0 = ((const uint4*)s)[me];
    if (me + members < n) w1 = ((const uint4*)s)[me + members];
  }
  // Every per-peer table read at once: one L2 round trip, not one each.
  const u8 how = reach_byte(dc, peer);
  const bool lsa = (how & 3) == REACH_LSA, near = (how & REACH_SAME_GPU) != 0;
  const u64 dst_size = __ldg((const unsigned long long*)dst.sizes + peer);
  u8* const d = (u8*)__ldg((const unsigned long long*)dst.peer_bases + peer);
  u64* const sig = lsa_signal_base(dc, peer, rem);
  // The ring too, where there are rings (unused for a load/store peer).
  ProxyRingAbi rg{};
  if (proxy_path(dc)) rg = ring(dc, ctx, peer);
  // A peer that is neither load/store nor queued is either off a rail
  // connection or unreachable with this backend, which is said before any
  // complaint about the offset. The load/store path's branches stay those
  // of a world connection.
  if (!lsa && (!has_queues(dc) || reach(dc, peer) == REACH_NONE))
    return fail_unreachable(dc, ctx, peer);
  if (!range_ok(dst_off, bytes, dst_size)) return fail(dc, OUT_OF_WINDOW, ctx, peer, dst.id);
  if (lsa) {
    if (!d || (rem.kind != 0 && !sig)) return fail(dc, UNSUPPORTED, ctx, peer, dst.id);
    u8* const dp = d + dst_off;
    if (tiny) {
      // The leader stores and signals: its own stores precede its release.
      if (me == 0) {
        if (bytes >= 8) ((u64*)dp)[0] = v0;
        if (bytes == 16) ((u64*)dp)[1] = v1;
        lsa_actions(dc, ctx, peer, sig, rem, loc, near);
      }
      // No member may reuse the source before the leader has read it.
      coop_sync(coop);
      return OK;
    }
    if (vecs) {
      const u64 n = bytes / 16;
      if (me < n) ((uint4*)dp)[me] = w0;
      if (me + members < n) ((uint4*)dp)[me + members] = w1;
    } else {
      coop_copy(coop, dp, s, bytes);
    }
    // Every member's loads of the source and stores precede the signal; no
    // member reads the source after this barrier.
    coop_sync(coop);
    if (me == 0) lsa_actions(dc, ctx, peer, sig, rem, loc, near);
    return OK;
  }
  // One aligned 8-byte word travels inline, in the WQE or the descriptor,
  // from the register the leader loaded it into: the NIC or proxy then
  // stores it, with no copy-engine copy (as mlx5 inline sends, and NCCL's
  // put_value). The source is free again when put returns, as on the
  // load/store path.
  const bool word = tiny && bytes == 8;
  int r = OK;
  if (coop_rank(coop) == 0 && gdaki_path(dc)) {
    const GdakiData g{word ? 2u : bytes ? 1u : 0u,
                      ((const u32*)dst.keys)[peer],
                      ((const u32*)src.keys)[dc.rank],
                      ((const u64*)dst.addrs)[peer] + dst_off,
                      src.local_base + src_off,
                      bytes,
                      v0};
    r = gdaki_post(dc, ctx, peer, gqp(dc, ctx, peer), g, rem, loc);
  } else if (coop_rank(coop) == 0 && proxy_path(dc)) {
    proxy::Desc d = empty_desc(proxy::OP_PUT);
    d.bytes = bytes;
    d.dst_window = dst.id;
    d.dst_offset = dst_off;
    d.src_window = src.id;
    d.src_offset = src_off;
    d.has_inline = word;
    d.inline_value = v0;
    proxy_actions(dc, ctx, rem, loc, d);
    r = push_on(dc, rg, ctx, peer, d);
  }
  return coop_bcast(coop, r);
}

// Puts the low `size` bytes (1, 2, 4 or 8) of `value` at `dst_off` (a
// multiple of `size`) in `peer`'s part of `dst`, then performs `rem`, as one
// store: bytes beside it are left alone. Called by the leader's value for a
// coop. On the load/store path every size is a plain store; on the queue
// paths the value travels inline (descriptor or WQE), and a size below 8
// needs an engine that stores sub-words (FLAG_QUEUE_ATOMICS), else it fails
// with COPY_ENGINE: the copy engine stores 8 aligned bytes at a time.
GIN_DEV int put_value_sized(const DevComm& dc, u32 ctx, u32 peer, const Window& dst, u64 dst_off,
                            u64 value, u32 size, Remote rem = no_signal(), Coop coop = THREAD) {
  using namespace detail;
  int e = check_ctx(dc, ctx);
  if (!e) e = check_peer(dc, ctx, peer);
  if (!e && size != 1 && size != 2 && size != 4 && size != 8)
    e = fail(dc, UNSUPPORTED, ctx, peer, size);
  if (!e) e = check_actions(dc, ctx, peer, rem, no_counter());
  if (!e && !range_ok(dst_off, size, ((const u64*)dst.sizes)[peer]))
    e = fail(dc, OUT_OF_WINDOW, ctx, peer, dst.id);
  if (!e && (dst_off & (size - 1))) e = fail(dc, MISALIGNED, ctx, peer, dst.id);
  if (!e && size < 8 && is_queued(dc, peer) && !(dc.flags & FLAG_QUEUE_ATOMICS))
    e = fail(dc, COPY_ENGINE, ctx, peer, dst.id);
  if (e) return e;
  if (size < 8) value &= (1ull << (8 * size)) - 1;
  coop_sync(coop);
  int r = OK;
  if (coop_rank(coop) == 0) {
    if (is_lsa(dc, peer)) {
      u8* d = (u8*)((const u64*)dst.peer_bases)[peer];
      u64* sig = lsa_signal_base(dc, peer, rem);
      if (!d || (rem.kind != 0 && !sig)) {
        r = fail(dc, UNSUPPORTED, ctx, peer, dst.id);
      } else {
        u8* const p = d + dst_off;
        if (size == 8) *(volatile u64*)p = value;
        else if (size == 4) *(volatile u32*)p = (u32)value;
        else if (size == 2) *(volatile u16*)p = (u16)value;
        else *(volatile u8*)p = (u8)value;
        lsa_actions(dc, ctx, peer, sig, rem, no_counter(), same_gpu(dc, peer));
      }
    } else if (gdaki_path(dc)) {
      const GdakiData g{2, ((const u32*)dst.keys)[peer], 0, ((const u64*)dst.addrs)[peer] + dst_off,
                        0, size, value};
      r = gdaki_post(dc, ctx, peer, gqp(dc, ctx, peer), g, rem, no_counter());
    } else if (proxy_path(dc)) {
      proxy::Desc d = empty_desc(proxy::OP_PUT);
      d.bytes = size;
      d.dst_window = dst.id;
      d.dst_offset = dst_off;
      d.has_inline = 1;
      d.inline_value = value;
      proxy_actions(dc, ctx, rem, no_counter(), d);
      r = push(dc, ctx, peer, d);
    } else {
      r = fail_unreachable(dc, ctx, peer);
    }
  }
  return coop_bcast(coop, r);
}

// Puts the 8-byte `value` at `dst_off` (8-byte aligned) in `peer`'s part of
// `dst`, then performs `rem`. Called by the leader's value for a coop.
GIN_DEV int put_value(const DevComm& dc, u32 ctx, u32 peer, const Window& dst, u64 dst_off,
                      u64 value, Remote rem = no_signal(), Coop coop = THREAD) {
  return put_value_sized(dc, ctx, peer, dst, dst_off, value, 8, rem, coop);
}

// put_value_sized of a value of type T (1, 2, 4 or 8 bytes): its bytes, as
// they lie in memory.
template <class T>
GIN_DEV int put_value_of(const DevComm& dc, u32 ctx, u32 peer, const Window& dst, u64 dst_off,
                         T value, Remote rem = no_signal(), Coop coop = THREAD) {
  static_assert(sizeof(T) == 1 || sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8,
                "gin: put_value_of takes a value of 1, 2, 4 or 8 bytes");
  const u8* b = reinterpret_cast<const u8*>(&value);
  u64 v = 0;
#pragma unroll
  for (u32 i = 0; i < sizeof(T); ++i) v |= (u64)b[i] << (8 * i);
  return put_value_sized(dc, ctx, peer, dst, dst_off, v, (u32)sizeof(T), rem, coop);
}

// Performs `rem` at `peer` with no data (ordered after earlier puts of the
// context to that peer).
GIN_DEV int signal(const DevComm& dc, u32 ctx, u32 peer, Remote rem, Coop coop = THREAD) {
  using namespace detail;
  int e = check_ctx(dc, ctx);
  if (!e) e = check_peer(dc, ctx, peer);
  if (!e) e = check_actions(dc, ctx, peer, rem, no_counter());
  if (e) return e;
  coop_sync(coop);
  int r = OK;
  if (coop_rank(coop) == 0) {
    if (is_lsa(dc, peer)) {
      u64* sig = lsa_signal_base(dc, peer, rem);
      if (sig || rem.kind == 0)
        lsa_actions(dc, ctx, peer, sig, rem, no_counter(), same_gpu(dc, peer));
      else r = fail(dc, UNSUPPORTED, ctx, peer, 0);
    } else if (gdaki_path(dc)) {
      r = gdaki_post(dc, ctx, peer, gqp(dc, ctx, peer), GdakiData{}, rem, no_counter());
    } else if (proxy_path(dc)) {
      proxy::Desc d = empty_desc(proxy::OP_PUT);
      proxy_actions(dc, ctx, rem, no_counter(), d);
      r = push(dc, ctx, peer, d);
    } else {
      r = fail_unreachable(dc, ctx, peer);
    }
  }
  return coop_bcast(coop, r);
}

// Reads `bytes` from `peer`'s part of `remote` at `remote_off` into this
// rank's part of `local` at `local_off`; complete after flush.
GIN_DEV int get(const DevComm& dc, u32 ctx, u32 peer, const Window& remote, u64 remote_off,
                const Window& local, u64 local_off, u64 bytes, Coop coop = THREAD) {
  using namespace detail;
  int e = check_ctx(dc, ctx);
  if (!e) e = check_peer(dc, ctx, peer);
  if (!e && !range_ok(remote_off, bytes, ((const u64*)remote.sizes)[peer]))
    e = fail(dc, OUT_OF_WINDOW, ctx, peer, remote.id);
  if (!e && !range_ok(local_off, bytes, local.local_size))
    e = fail(dc, OUT_OF_WINDOW, ctx, peer, local.id);
  if (e) return e;
  if (is_lsa(dc, peer)) {
    const u8* s = (const u8*)((const u64*)remote.peer_bases)[peer];
    if (!s) return fail(dc, UNSUPPORTED, ctx, peer, remote.id);
    // No member overwrites `local` while another still reads it from
    // before the call.
    coop_sync(coop);
    coop_copy(coop, (u8*)local.local_base + local_off, s + remote_off, bytes);
    coop_sync(coop);
    return OK;
  }
  coop_sync(coop);
  int r = OK;
  if (coop_rank(coop) == 0 && gdaki_path(dc)) {
    const GdakiData g{bytes ? 3u : 0u,
                      ((const u32*)remote.keys)[peer],
                      ((const u32*)local.keys)[dc.rank],
                      ((const u64*)remote.addrs)[peer] + remote_off,
                      local.local_base + local_off,
                      bytes,
                      0};
    if (bytes) r = gdaki_post(dc, ctx, peer, gqp(dc, ctx, peer), g, no_signal(), no_counter());
  } else if (coop_rank(coop) == 0 && proxy_path(dc)) {
    proxy::Desc d = empty_desc(proxy::OP_GET);
    d.bytes = bytes;
    d.dst_window = remote.id;
    d.dst_offset = remote_off;
    d.src_window = local.id;
    d.src_offset = local_off;
    r = push(dc, ctx, peer, d);
  }
  return coop_bcast(coop, r);
}

// Waits until every operation this context issued has completed locally:
// sources may be reused, gets have landed, and puts will be visible at their
// targets.
GIN_DEV int flush(const DevComm& dc, u32 ctx, Coop coop = THREAD) {
  using namespace detail;
  int e = check_ctx(dc, ctx);
  if (e) return e;
  coop_sync(coop);
  int r = OK;
  if (coop_rank(coop) == 0) {
    __threadfence_system();
    if (proxy_path(dc)) {
      for (u32 p = 0; p < dc.nranks && r == OK; ++p) {
        if (!is_queued(dc, p)) continue;
        const ProxyRingAbi& rg = ring(dc, ctx, p);
        const u64 mark = *(volatile const u64*)rg.head;
        const u64* done = (const u64*)rg.done;
        u32 k = poll(dc, FLUSH_TIMEOUT,
                     [&] { return signal_reached(proxy::ld_acquire_gpu(done), mark); });
        if (k) r = fail(dc, k, ctx, p, (u32)mark);
      }
    } else if (gdaki_path(dc)) {
      for (u32 p = 0; p < dc.nranks && r == OK; ++p)
        if (is_queued(dc, p)) r = gdaki_flush(dc, ctx, p);
    } else if (path_not_built(dc)) {
      // Another kernel, compiled with the queue path, may have queued
      // operations on this context that this one cannot wait for.
      for (u32 p = 0; p < dc.nranks && r == OK; ++p)
        if (is_queued(dc, p)) r = fail(dc, PATH_NOT_BUILT, ctx, p, dc.backend_kind);
    }
  }
  r = coop_bcast(coop, r);
  return r;
}

// Takes a request covering the operations this context has issued so far
// to `peer` (Ctx::flush_async): `wait` then waits until they have completed
// locally, as flush does for all peers, while the caller does other work.
// Every member of the coop takes its own; the leader's is the one `wait`
// uses. A load/store peer's operations are complete when issued: its
// request has nothing to wait for.
GIN_DEV int flush_async(const DevComm& dc, u32 ctx, u32 peer, Request* req, Coop coop = THREAD) {
  using namespace detail;
  *req = Request{0, 0, NO_PEER, ctx};
  int e = check_ctx(dc, ctx);
  if (!e) e = check_peer(dc, ctx, peer);
  if (e) return e;
  if (is_queued(dc, peer)) {
    if (proxy_path(dc)) {
      *req = Request{*(volatile const u64*)ring(dc, ctx, peer).head, 0, peer, ctx};
    } else if (gdaki_path(dc)) {
      const GdakiQpAbi& q = gqp(dc, ctx, peer);
      *req = Request{*(volatile const u64*)q.main.indices, *(volatile const u64*)q.companion.indices,
                     peer, ctx};
    }
  }
  coop_sync(coop);
  return OK;
}

// Waits for a request of flush_async (Ctx::wait): the operations it covers
// have completed locally (sources reusable, gets landed).
GIN_DEV int wait(const DevComm& dc, u32 ctx, const Request& req, Coop coop = THREAD) {
  using namespace detail;
  int e = check_ctx(dc, ctx);
  if (!e && req.peer != NO_PEER && (req.ctx != ctx || req.peer >= dc.nranks))
    e = fail(dc, BAD_CONTEXT, ctx, req.peer, req.ctx);
  if (e) return e;
  coop_sync(coop);
  int r = OK;
  if (coop_rank(coop) == 0 && req.peer != NO_PEER) {
    const u32 p = req.peer;
    if (proxy_path(dc)) {
      const u64* done = (const u64*)ring(dc, ctx, p).done;
      const u32 k = poll(dc, FLUSH_TIMEOUT,
                         [&] { return signal_reached(proxy::ld_acquire_gpu(done), req.main); });
      if (k) r = fail(dc, k, ctx, p, (u32)req.main);
    } else if (gdaki_path(dc)) {
      const GdakiQpAbi& q = gqp(dc, ctx, p);
      for (int j = 0; j < 2 && r == OK; ++j) {
        const GdakiSqAbi& sq = j ? q.companion : q.main;
        const u64 mark = j ? req.aux : req.main;
        if (mark == 0) continue;
        gdaki::Completion c{};
        const u32 k = poll(dc, FLUSH_TIMEOUT, [&] {
          c = gdaki::completed(sq, mark - 1);
          return c.state != 0;
        });
        if (k) r = fail(dc, k, ctx, p, (u32)mark);
        else if (c.state == 2) r = fail(dc, WQE_ERROR, ctx, p, (c.syndrome << 16) | c.wqe);
      }
    } else if (path_not_built(dc)) {
      r = fail(dc, PATH_NOT_BUILT, ctx, p, dc.backend_kind);
    }
  }
  return coop_bcast(coop, r);
}

// The current value of signal `id` of context `ctx`.
GIN_DEV u64 read_signal(const DevComm& dc, u32 ctx, u32 id) {
  return detail::signal_sum(dc, detail::signal_slot(dc, ctx, id));
}

namespace detail {
// Polls `ready` for the coop within `limit`; a failure is recorded in the
// error word unless it is `kind` and `quiet` (a per-call timeout is the
// caller's to handle, as Ctx::wait_signal_for's Err is). Data the leader
// acquired is visible to the whole coop afterwards.
template <class Ready>
GIN_DEV int wait_coop(const DevComm& dc, u32 ctx, u32 value, u64 limit, bool quiet, u32 kind,
                      Coop coop, Ready ready) {
  if (coop == WARP) {
    const u32 k = poll_warp(dc, limit, kind, ready);
    if (k && !(quiet && k == kind) && lane() == 0) fail(dc, k, ctx, NO_PEER, value);
    __syncwarp();
    return (int)k;
  }
  int r = OK;
  if (coop_rank(coop) == 0) {
    const u32 k = poll_for(dc, limit, kind, ready);
    if (k && !(quiet && k == kind)) fail(dc, k, ctx, NO_PEER, value);
    r = (int)k;
  }
  // The leader's acquire, then the coop's barrier, make the announced data
  // visible to every member.
  return coop_bcast(coop, r);
}

GIN_DEV int wait_signal_within(const DevComm& dc, u32 ctx, u32 id, u64 target, u64 limit,
                               bool quiet, Coop coop) {
  int e = check_ctx(dc, ctx);
  if (!e && id >= dc.nsignals) e = fail(dc, BAD_SIGNAL, ctx, NO_PEER, id);
  if (e) return e;
  const u64 slot = signal_slot(dc, ctx, id);
  return wait_coop(dc, ctx, id, limit, quiet, SIGNAL_TIMEOUT, coop,
                   [&] { return signal_reached(signal_sum_acquire(dc, slot), target); });
}

// The word of a VA signal in this rank's part of `w`, checked: OK and the
// word in `*p`, or the error kind (recorded).
GIN_DEV int va_word(const DevComm& dc, u32 ctx, const Window& w, u64 off, u64** p) {
  *p = nullptr;
  if (check_ctx(dc, ctx)) return BAD_CONTEXT;
  if (!range_ok(off, 8, w.local_size)) return fail(dc, OUT_OF_WINDOW, ctx, NO_PEER, w.id);
  if (off & 7) return fail(dc, MISALIGNED, ctx, NO_PEER, w.id);
  *p = (u64*)(w.local_base + off);
  return OK;
}
} // namespace detail

// Waits until signal `id` reaches `target` (rolling compare), within the
// communicator's timeout. Data announced by the signal is visible to the
// whole coop afterwards.
GIN_DEV int wait_signal(const DevComm& dc, u32 ctx, u32 id, u64 target, Coop coop = THREAD) {
  return detail::wait_signal_within(dc, ctx, id, target, detail::comm_limit(dc), false, coop);
}

// wait_signal with its own timeout (Ctx::wait_signal_for): `timeout_ns`
// nanoseconds (NO_TIMEOUT: none; 0: one look). Running out returns
// SIGNAL_TIMEOUT without recording it in the error word (the caller may
// carry on); an abort or a bad argument is recorded as usual.
GIN_DEV int wait_signal_for(const DevComm& dc, u32 ctx, u32 id, u64 target, u64 timeout_ns,
                            Coop coop = THREAD) {
  return detail::wait_signal_within(dc, ctx, id, target, timeout_ns, true, coop);
}

// The current value of the VA signal at `off` of this rank's part of `w`
// (0 after recording an error for a bad offset).
GIN_DEV u64 read_va_signal(const DevComm& dc, u32 ctx, const Window& w, u64 off) {
  u64* p;
  return detail::va_word(dc, ctx, w, off, &p) ? 0 : detail::ld_relaxed_sys(p);
}

// Waits until the VA signal at `off` of this rank's part of `w` reaches
// `target` (Ctx::wait_va_signal). Errors name the window id.
GIN_DEV int wait_va_signal(const DevComm& dc, u32 ctx, const Window& w, u64 off, u64 target,
                           Coop coop = THREAD) {
  u64* p;
  const int e = detail::va_word(dc, ctx, w, off, &p);
  if (e) return e;
  return detail::wait_coop(dc, ctx, w.id, detail::comm_limit(dc), false, SIGNAL_TIMEOUT, coop,
                           [&] { return signal_reached(detail::ld_acquire_sys(p), target); });
}

// wait_va_signal with its own timeout, as wait_signal_for.
GIN_DEV int wait_va_signal_for(const DevComm& dc, u32 ctx, const Window& w, u64 off, u64 target,
                               u64 timeout_ns, Coop coop = THREAD) {
  u64* p;
  const int e = detail::va_word(dc, ctx, w, off, &p);
  if (e) return e;
  return detail::wait_coop(dc, ctx, w.id, timeout_ns, true, SIGNAL_TIMEOUT, coop,
                           [&] { return signal_reached(detail::ld_acquire_sys(p), target); });
}

// Sets the VA signal at `off` of this rank's part of `w` back to zero (no
// signal to it may be in flight); from one thread, as reset_signal.
GIN_DEV int reset_va_signal(const DevComm& dc, u32 ctx, const Window& w, u64 off) {
  u64* p;
  const int e = detail::va_word(dc, ctx, w, off, &p);
  if (e) return e;
  // System scope: peers add to this word over NVLink.
  atomicAdd_system((unsigned long long*)p, (unsigned long long)(0 - detail::ld_relaxed_sys(p)));
  return OK;
}

// Sets signal `id` back to zero (no signal to it may be in flight). Call it
// from one thread: every caller subtracts the value it reads.
GIN_DEV int reset_signal(const DevComm& dc, u32 ctx, u32 id) {
  using namespace detail;
  int e = check_ctx(dc, ctx);
  if (!e && id >= dc.nsignals) e = fail(dc, BAD_SIGNAL, ctx, NO_PEER, id);
  if (e) return e;
  const u64 slot = signal_slot(dc, ctx, id);
  // System scope: peers add to this sub-slot over NVLink.
  atomicAdd_system((unsigned long long*)((u64*)dc.signals + slot * dc.nranks + dc.rank),
                   (unsigned long long)(0 - signal_sum(dc, slot)));
  return OK;
}

GIN_DEV u64 read_counter(const DevComm& dc, u32 ctx, u32 id) {
  const u64* c = detail::counter_subslots(dc, ctx, id);
  return (detail::ld_relaxed_sys(c) + detail::ld_relaxed_sys(c + 1)) & COUNTER_MASK;
}

namespace detail {
GIN_DEV int wait_counter_within(const DevComm& dc, u32 ctx, u32 id, u64 target, u64 limit,
                                bool quiet, Coop coop) {
  int e = check_ctx(dc, ctx);
  if (!e && id >= dc.ncounters) e = fail(dc, BAD_COUNTER, ctx, NO_PEER, id);
  if (e) return e;
  int r = OK;
  if (coop_rank(coop) == 0) {
    const u32 k = poll_for(dc, limit, COUNTER_TIMEOUT,
                           [&] { return counter_reached(read_counter(dc, ctx, id), target); });
    if (k && !(quiet && k == COUNTER_TIMEOUT)) fail(dc, k, ctx, NO_PEER, id);
    r = (int)k;
  }
  return coop_bcast(coop, r);
}
} // namespace detail

// Waits until counter `id` reaches `target` (56-bit rolling compare).
GIN_DEV int wait_counter(const DevComm& dc, u32 ctx, u32 id, u64 target, Coop coop = THREAD) {
  return detail::wait_counter_within(dc, ctx, id, target, detail::comm_limit(dc), false, coop);
}

// wait_counter with its own timeout, as wait_signal_for (COUNTER_TIMEOUT).
GIN_DEV int wait_counter_for(const DevComm& dc, u32 ctx, u32 id, u64 target, u64 timeout_ns,
                             Coop coop = THREAD) {
  return detail::wait_counter_within(dc, ctx, id, target, timeout_ns, true, coop);
}

// Sets counter `id` back to zero; from one thread, as reset_signal.
GIN_DEV int reset_counter(const DevComm& dc, u32 ctx, u32 id) {
  using namespace detail;
  int e = check_ctx(dc, ctx);
  if (!e && id >= dc.ncounters) e = fail(dc, BAD_COUNTER, ctx, NO_PEER, id);
  if (e) return e;
  atomicAdd((unsigned long long*)(counter_subslots(dc, ctx, id) + 1),
            (unsigned long long)(0 - read_counter(dc, ctx, id)));
  return OK;
}

namespace detail {
// A barrier over `count` ranks (`members[i]`, or rank i where `members` is
// null) on signal slot `id` of context `ctx`: completes what `fence` asks
// (flushes the context, or every context), signals every member (strong
// signals, weak ones with FENCE_NONE), and waits until every member has
// arrived as often as this rank, within `limit` (a timeout is recorded
// unless `quiet`). Each member's arrivals count in its own sub-slot.
GIN_DEV int team_barrier(const DevComm& dc, u32 ctx, u32 id, const u32* members, u32 count,
                         Coop coop, u32 fence, u64 limit, bool quiet) {
  if (fence > FENCE_ALL_CONTEXTS) return fail(dc, UNSUPPORTED, ctx, NO_PEER, fence);
  // A member behind a queue path this kernel was built without: refused
  // before any arrival is sent (the load/store members would count a
  // barrier this rank never completes). Nothing at all in a default build.
  if (path_not_built(dc)) {
    for (u32 i = 0; i < count; ++i) {
      const u32 p = members ? members[i] : i;
      if (is_queued(dc, p)) return fail(dc, PATH_NOT_BUILT, ctx, p, dc.backend_kind);
    }
  }
  int r = OK;
  if (fence == FENCE_ALL_CONTEXTS) {
    for (u32 k = 0; k < dc.nctx && r == OK; ++k) r = flush(dc, k, coop);
  } else if (fence == FENCE_CONTEXT) {
    r = flush(dc, ctx, coop);
  }
  if (r) return r;
  const u32 weak = fence == FENCE_NONE ? 1u : 0u;
  if (coop_rank(coop) == 0) {
    const u64 slot = signal_slot(dc, ctx, id);
    const u64 off = sender_offset(dc, slot);
    for (u32 i = 0; i < count && r == OK; ++i) {
      const u32 p = members ? members[i] : i;
      if (is_lsa(dc, p)) {
        red_add_release((u64*)((u8*)signal_peer(dc, p) + off), 1, same_gpu(dc, p));
      } else if (!is_queued(dc, p)) {
        r = fail(dc, BAD_PEER, ctx, p, p);
      } else if (gdaki_path(dc)) {
        r = gdaki_post(dc, ctx, p, gqp(dc, ctx, p), GdakiData{},
                       weak ? signal_inc_weak(id) : signal_inc(id), no_counter());
      } else if (proxy_path(dc)) {
        proxy::Desc d = empty_desc(proxy::OP_PUT);
        d.has_signal = 1;
        d.sig_strong = weak ? 0 : 1;
        d.sig_window = dc.signal_window;
        d.sig_offset = off;
        d.sig_add = 1;
        r = push(dc, ctx, p, d);
      } else {
        r = fail_not_queued(dc, ctx, p);
      }
    }
    if (r == OK) {
      const u64* s = (const u64*)dc.signals + slot * dc.nranks;
      // This rank's own sub-slot here counts the barriers it entered.
      const u64 epoch = ld_acquire_sys(s + dc.rank);
      for (u32 i = 0; i < count && r == OK; ++i) {
        const u32 p = members ? members[i] : i;
        const u32 k = poll_for(dc, limit, BARRIER_TIMEOUT,
                               [&] { return signal_reached(ld_acquire_sys(s + p), epoch); });
        if (k && !(quiet && k == BARRIER_TIMEOUT)) fail(dc, k, ctx, p, (u32)epoch);
        r = (int)k;
      }
      __threadfence_system();
    }
  }
  return coop_bcast(coop, r);
}

GIN_DEV int world_barrier(const DevComm& dc, u32 ctx, u32 index, Coop coop, u32 fence, u64 limit,
                          bool quiet) {
  int e = check_ctx(dc, ctx);
  if (!e && index >= dc.world_barriers) e = fail(dc, BAD_SIGNAL, ctx, NO_PEER, index);
  if (e) return e;
  return team_barrier(dc, ctx, dc.nsignals + index, nullptr, dc.nranks, coop, fence, limit, quiet);
}

GIN_DEV int rail_team_barrier(const DevComm& dc, u32 ctx, u32 index, Coop coop, u32 fence,
                              u64 limit, bool quiet) {
  int e = check_ctx(dc, ctx);
  const u32* team = rail_team(dc);
  if (!e && index >= team[0]) e = fail(dc, BAD_SIGNAL, ctx, NO_PEER, index);
  if (e) return e;
  return team_barrier(dc, ctx, dc.nsignals + dc.world_barriers + index, team + 2, team[1], coop,
                      fence, limit, quiet);
}
} // namespace detail

// World barrier `index` on context `ctx` (a BarrierSession's sync): signals
// every rank and waits until every rank has arrived as often as this one.
// `fence` (ops::Fence): FENCE_CONTEXT (the default) flushes the context
// first, so puts issued before it are visible at their targets when it
// returns; FENCE_ALL_CONTEXTS flushes every context; FENCE_NONE only
// synchronises (weak signals, no flush).
GIN_DEV int barrier(const DevComm& dc, u32 ctx, u32 index, Coop coop = THREAD,
                    Fence fence = FENCE_CONTEXT) {
  return detail::world_barrier(dc, ctx, index, coop, fence, detail::comm_limit(dc), false);
}

// barrier with its own timeout (nanoseconds; NO_TIMEOUT: none). Running out
// returns BARRIER_TIMEOUT without recording it; this rank has then arrived
// without leaving, so the barrier's slot is out of step: do not use it
// again in this run.
GIN_DEV int barrier_for(const DevComm& dc, u32 ctx, u32 index, u64 timeout_ns, Coop coop = THREAD,
                        Fence fence = FENCE_CONTEXT) {
  return detail::world_barrier(dc, ctx, index, coop, fence, timeout_ns, true);
}

// Rail barrier `index` on context `ctx`: as `barrier`, over this rank's
// rail (the ranks with its local rank, one per host, NCCL's rail team).
GIN_DEV int rail_barrier(const DevComm& dc, u32 ctx, u32 index, Coop coop = THREAD,
                         Fence fence = FENCE_CONTEXT) {
  return detail::rail_team_barrier(dc, ctx, index, coop, fence, detail::comm_limit(dc), false);
}

// rail_barrier with its own timeout, as barrier_for.
GIN_DEV int rail_barrier_for(const DevComm& dc, u32 ctx, u32 index, u64 timeout_ns,
                             Coop coop = THREAD, Fence fence = FENCE_CONTEXT) {
  return detail::rail_team_barrier(dc, ctx, index, coop, fence, timeout_ns, true);
}

// The number of ranks in this rank's rail, and the `i`-th of them.
GIN_DEV u32 rail_size(const DevComm& dc) { return detail::rail_team(dc)[1]; }
GIN_DEV u32 rail_rank(const DevComm& dc, u32 i) { return detail::rail_team(dc)[2 + i]; }

} // namespace gin
#endif // __CUDACC__
