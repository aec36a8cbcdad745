// gin-ep's low-latency mode on CUDA ranks: dispatch, the identity expert,
// combine, and the same-job floor, on gin/gin.cuh's put, signal, wait and
// flush. The protocol and buffer layout are the CPU ranks' (ll.rs,
// docs/ep.md): per-(local expert, source) slots sized for the maximum, one
// cumulative signal per (expert, source) carrying count + 1 after the data
// (id le * r + src), and in the combine one signal per (expert, source)
// (id experts + e) after the expert's outputs were put back to their
// (token, top-k slot) places.
//
// Windows (this rank's part): send (tokens x m: the staged messages), recv
// (l x r x t x m), csend (l x r x t x 2h), crecv (t x k x 2h). A message is
// the payload (BF16, 2h bytes), then u32 source token, i32 expert ids[k],
// f32 weights[k], padded to 16 bytes.
//
// Blocks loop over experts (dispatch sends, combine receives) and over
// (expert, source) pairs (dispatch receives, combine sends): every block
// sends everything it sends before it waits for anything, and the host keeps
// the grid small enough to be resident at once, so ranks sharing one GPU
// under MPS cannot starve each other's senders. A pair is owned by one block
// (pair q by block q mod grid), which alone reads and advances its signal's
// accounted value `seen[q]`.
//
// Compiled at run time by NVRTC (gin-core's CudaComm::compile) and in CI by
// nvcc (.ci/nvcc-check).
#include "gin/gin.cuh"

using namespace gin;

namespace ep {

// The earliest block start and the latest block end of a launch, in
// %globaltimer nanoseconds: the host sets clock = {~0, 0} before a launch.
__device__ __forceinline__ void clock_start(u64* clock) {
  if (clock && threadIdx.x == 0) atomicMin((unsigned long long*)&clock[0], proxy::globaltimer());
}
__device__ __forceinline__ void clock_end(u64* clock) {
  __syncthreads();
  if (clock && threadIdx.x == 0) atomicMax((unsigned long long*)&clock[1], proxy::globaltimer());
}

// Block-wide wait for signal `id` (context 0) to reach `target`, bounded by
// the job timeout and the abort flag; a failure is recorded in the error
// word naming `peer`, the rank that sends the signal, and the id. Returns
// the same status on every thread; what the signal announced is visible to
// the whole block afterwards.
__device__ int wait_from(const DevComm& dc, u32 id, u64 target, u32 peer) {
  __shared__ int status;
  if (threadIdx.x == 0) {
    int s = OK;
    if (id >= dc.nsignals) {
      s = detail::fail(dc, BAD_SIGNAL, 0, peer, id);
    } else {
      const u64 slot = detail::signal_slot(dc, 0, id);
      const u32 k = detail::poll(dc, SIGNAL_TIMEOUT, [&] {
        return signal_reached(detail::signal_sum_acquire(dc, slot), target);
      });
      if (k) s = detail::fail(dc, k, 0, peer, id);
    }
    status = s;
  }
  __syncthreads();
  const int s = status;
  // Nobody rewrites `status` (the next wait) before everyone has read it.
  __syncthreads();
  return s;
}

// Block-wide wait for the combine signals of every active expert: signal
// first + e must reach targets[e / l] (e < count). The block's threads poll
// different experts at once, each bounded by the job timeout and the abort
// flag (a serial wait per expert costs a round trip and two barriers each);
// the first failure is recorded in the error word naming the expert's rank.
// Returns the same status on every thread; what the signals announced is
// visible to the whole block afterwards.
__device__ int wait_experts(const DevComm& dc, u32 first, u32 count, u32 l, const u32* active,
                            const u64* targets) {
  __shared__ int status;
  if (threadIdx.x == 0) status = OK;
  __syncthreads();
  for (u32 e = threadIdx.x; e < count; e += blockDim.x) {
    const u32 owner = e / l, id = first + e;
    if (!active[owner]) continue;
    int s = OK;
    if (id >= dc.nsignals) {
      s = detail::fail(dc, BAD_SIGNAL, 0, owner, id);
    } else {
      const u64 slot = detail::signal_slot(dc, 0, id);
      const u64 target = targets[owner];
      const u32 k = detail::poll(dc, SIGNAL_TIMEOUT, [&] {
        return signal_reached(detail::signal_sum_acquire(dc, slot), target);
      });
      if (k) s = detail::fail(dc, k, 0, owner, id);
    }
    if (s) atomicCAS(&status, OK, s);
  }
  __syncthreads();
  const int s = status;
  __syncthreads();
  return s;
}

__device__ __forceinline__ const u8* meta_of(const Window& send, u64 tok, u32 m, u32 p) {
  return (const u8*)send.local_base + tok * m + p;
}

// Block-wide: the staged tokens among [base, base + blockDim.x) whose top-k
// names expert e, in token order, into list[0..n); returns n on every
// thread. blockDim.x is a multiple of 32 (the host launches 512 threads).
__device__ u32 hits_of(const Window& send, u32 base, u32 tokens, u32 m, u32 p, u32 k, u32 e,
                       u32* list) {
  __shared__ u32 before[32];
  __shared__ u32 total;
  const u32 tok = base + threadIdx.x, lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  bool hit = false;
  if (tok < tokens) {
    const int* ids = (const int*)(meta_of(send, tok, m, p) + 4);
    for (u32 j = 0; j < k; ++j) hit |= ids[j] == (int)e;
  }
  const u32 ballot = __ballot_sync(0xffffffffu, hit);
  if (lane == 0) before[warp] = __popc(ballot);
  __syncthreads();
  if (threadIdx.x == 0) {
    u32 sum = 0;
    for (u32 w = 0; w < blockDim.x / 32u; ++w) {
      const u32 c = before[w];
      before[w] = sum;
      sum += c;
    }
    total = sum;
  }
  __syncthreads();
  if (hit) list[before[warp] + __popc(ballot & ((1u << lane) - 1u))] = tok;
  __syncthreads();
  const u32 n = total;
  // Nobody rewrites `before` or `total` (the next call) before all read.
  __syncthreads();
  return n;
}

// Round to nearest even, NaN kept a NaN: gin-ep's Bf16::from_f32.
__device__ __forceinline__ unsigned short to_bf16(float v) {
  const u32 bits = __float_as_uint(v);
  if (v != v) return (unsigned short)((bits >> 16) | 0x40);
  return (unsigned short)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ float from_bf16(unsigned short b) {
  return __uint_as_float((u32)b << 16);
}

} // namespace ep

// Low-latency dispatch (send and receive halves in one launch). Sends: for
// each expert e (a block per expert, looping), every staged token naming e
// in its top-k goes, in token order, into slot ((le * r + rank) * t + i) *
// m of recv at e's rank (i: its index among this rank's tokens for e); then
// signal le * r + rank there adds count + 1. Receives: for each pair q = le
// * r + src, wait for signal q to pass seen[q], take the count from how far
// it moved, and read each token's metadata: meta[3 * (q * t + i)] = source
// token, top-k slot naming this rank's expert (~0 if none), weight bits.
// counts[q] is the count as signalled (the host checks it against t).
// active[rank]: 0 for a masked rank (nothing sent to it or awaited from it).
extern "C" __global__ void ep_ll_dispatch(DevComm dc, Window send, Window recv, u32 tokens,
                                          u32 l, u32 t, u32 m, u32 p, u32 k, const u32* active,
                                          u64* seen, u32* counts, u32* meta, u64* clock) {
  ep::clock_start(clock);
  const u32 r = dc.nranks, experts = l * r;
  // Each warp puts its own tokens (warp-wide copies of a message, all the
  // block's warps at once); the expert's signal follows the block's puts.
  __shared__ u32 list[1024];
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  const u32 warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (u32 e = blockIdx.x; e < experts; e += gridDim.x) {
    const u32 dst = e / l, le = e % l;
    if (!active[dst]) continue;
    u32 count = 0;
    for (u32 base = 0; base < tokens; base += blockDim.x) {
      const u32 n = ep::hits_of(send, base, tokens, m, p, k, e, list);
      for (u32 j = warp; j < n; j += warps) {
        const u64 off = ((u64)(le * r + dc.rank) * t + count + j) * m;
        if (put(dc, 0, dst, recv, off, send, (u64)list[j] * m, m, no_signal(), no_counter(),
                WARP)) {
          if ((threadIdx.x & 31u) == 0) failed = 1;
          break;
        }
      }
      count += n;
      __syncthreads();
      if (failed) return;
    }
    if (signal(dc, 0, dst, signal_add(le * r + dc.rank, (u64)count + 1), CTA)) return;
  }
  // The send window is rewritten by the host before the next step.
  if (flush(dc, 0, CTA)) return;
  for (u32 q = blockIdx.x; q < experts; q += gridDim.x) {
    const u32 le = q / r, src = q % r;
    if (!active[src]) {
      if (threadIdx.x == 0) counts[q] = 0;
      continue;
    }
    const u64 base = seen[q];
    if (ep::wait_from(dc, q, base + 1, src)) return;
    const u64 v = read_signal(dc, 0, q);
    const u64 c = v - base - 1;
    const u32 got = c > t ? t : (u32)c;
    const int mine = (int)(dc.rank * l + le);
    for (u32 i = threadIdx.x; i < got; i += blockDim.x) {
      const u8* md = (const u8*)recv.local_base + ((u64)q * t + i) * m + p;
      const int* ids = (const int*)(md + 4);
      const float* w = (const float*)(md + 4 + 4 * (u64)k);
      u32 kk = ~0u;
      for (u32 j = 0; j < k; ++j)
        if (ids[j] == mine) {
          kk = j;
          break;
        }
      u32* out = meta + 3 * ((u64)q * t + i);
      out[0] = *(const u32*)md;
      out[1] = kk;
      out[2] = kk < k ? __float_as_uint(w[kk]) : 0u;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      seen[q] = v;
      counts[q] = c > 0xffffffffull ? 0xffffffffu : (u32)c;
    }
  }
  ep::clock_end(clock);
}

// The identity expert: copies each received BF16 payload into its combine
// slot (csend, 2h bytes per slot, same slot index).
extern "C" __global__ void ep_ll_echo(Window recv, Window csend, u32 pairs, u32 t, u32 m, u32 h2,
                                      const u32* counts) {
  for (u32 q = blockIdx.x; q < pairs; q += gridDim.x) {
    const u32 c = counts[q] > t ? t : counts[q];
    for (u32 i = 0; i < c; ++i) {
      const uint4* s = (const uint4*)((const u8*)recv.local_base + ((u64)q * t + i) * m);
      uint4* d = (uint4*)((u8*)csend.local_base + ((u64)q * t + i) * h2);
      for (u32 v = threadIdx.x; v < h2 / 16; v += blockDim.x) d[v] = s[v];
    }
  }
}

// Low-latency combine (send and receive halves in one launch). Sends: for
// each pair q = le * r + src, each received token's combine slot goes back
// to src's crecv at (source token * k + top-k slot) * 2h, then signal
// experts + e there adds 1. Receives: waits for every active expert's
// signal to reach ctarget[its rank] (the host counts the steps each rank
// took part in), then reduces each of this rank's tokens over its top-k
// slots with the weights (f32, in slot order, rounded once to BF16), leaving
// out empty slots and masked ranks' experts, into out (tokens x h BF16).
extern "C" __global__ void ep_ll_combine(DevComm dc, Window send, Window csend, Window crecv,
                                         u32 tokens, u32 l, u32 t, u32 m, u32 p, u32 k, u32 h,
                                         const u32* active, const u32* counts, const u32* meta,
                                         const u64* ctarget, unsigned short* out, u64* clock) {
  ep::clock_start(clock);
  const u32 r = dc.nranks, experts = l * r;
  const u64 h2 = 2ull * h;
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  const u32 warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (u32 q = blockIdx.x; q < experts; q += gridDim.x) {
    const u32 le = q / r, src = q % r;
    if (!active[src]) continue;
    const u32 c = counts[q] > t ? t : counts[q];
    // A warp per token, all the block's warps at once; the pair's signal
    // follows the block's puts.
    for (u32 i = warp; i < c; i += warps) {
      const u32* md = meta + 3 * ((u64)q * t + i);
      const u32 tok = md[0], kk = md[1];
      // The host refuses the step before combining (EpError::Protocol).
      if (tok >= t || kk >= k) continue;
      if (put(dc, 0, src, crecv, ((u64)tok * k + kk) * h2, csend, ((u64)q * t + i) * h2, h2,
              no_signal(), no_counter(), WARP)) {
        if ((threadIdx.x & 31u) == 0) failed = 1;
        break;
      }
    }
    __syncthreads();
    if (failed) return;
    if (signal(dc, 0, src, signal_add(experts + dc.rank * l + le, 1), CTA)) return;
  }
  // csend is rewritten by the next step's expert.
  if (flush(dc, 0, CTA)) return;
  if (ep::wait_experts(dc, experts, experts, l, active, ctarget)) return;
  for (u32 tok = blockIdx.x; tok < tokens; tok += gridDim.x) {
    const u8* md = ep::meta_of(send, tok, m, p);
    const int* ids = (const int*)(md + 4);
    const float* w = (const float*)(md + 4 + 4 * (u64)k);
    const u8* rows = (const u8*)crecv.local_base + (u64)tok * k * h2;
    if ((h & 7u) == 0) {
      // Eight columns per thread, one 16-byte load per slot: the same
      // products and sums, in the same order, as the column loop below.
      for (u32 col = 8 * threadIdx.x; col < h; col += 8 * blockDim.x) {
        float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        for (u32 j = 0; j < k; ++j) {
          const int e = ids[j];
          if (e < 0 || (u32)e >= experts || !active[(u32)e / l]) continue;
          const uint4 v = *(const uint4*)(rows + j * h2 + 2ull * col);
          const u32 words[4] = {v.x, v.y, v.z, v.w};
          for (u32 c = 0; c < 8; ++c) {
            const unsigned short b = (unsigned short)(words[c / 2] >> (16 * (c % 2)));
            acc[c] = __fadd_rn(acc[c], __fmul_rn(w[j], ep::from_bf16(b)));
          }
        }
        u32 o[4];
        for (u32 c = 0; c < 4; ++c)
          o[c] = (u32)ep::to_bf16(acc[2 * c]) | ((u32)ep::to_bf16(acc[2 * c + 1]) << 16);
        *(uint4*)(out + (u64)tok * h + col) = make_uint4(o[0], o[1], o[2], o[3]);
      }
      continue;
    }
    for (u32 col = threadIdx.x; col < h; col += blockDim.x) {
      float acc = 0.0f;
      for (u32 j = 0; j < k; ++j) {
        const int e = ids[j];
        if (e < 0 || (u32)e >= experts || !active[(u32)e / l]) continue;
        const unsigned short* row = (const unsigned short*)(rows + j * h2);
        // No contraction into an FMA: the CPU ranks' reduction rounds the
        // product and the sum separately.
        acc = __fadd_rn(acc, __fmul_rn(w[j], ep::from_bf16(row[col])));
      }
      out[(u64)tok * h + col] = ep::to_bf16(acc);
    }
  }
  ep::clock_end(clock);
}

// The same-job floor: the same bytes as a phase, by plain puts spread over
// the grid the phase's kernels use. The host launches nranks x parts
// blocks; block b puts part b / nranks of bytes[peer] (peer = rank + b, mod
// nranks; parts of 16-byte multiples) of send to the peer's recv at rank *
// block with one signal each (signal 0), then every block waits until
// signal 0 reaches target (the host counts nranks x parts per exchange) and
// flushes.
extern "C" __global__ void ep_floor(DevComm dc, Window send, Window recv, u64 block,
                                    const u64* bytes, u64 target, u64* clock) {
  ep::clock_start(clock);
  const u32 n = dc.nranks, parts = gridDim.x / n;
  const u32 peer = (dc.rank + blockIdx.x) % n, part = blockIdx.x / n;
  const u64 total = bytes[peer];
  const u64 chunk = ((total + parts - 1) / parts + 15) & ~15ull;
  const u64 lo = min(total, (u64)part * chunk), hi = min(total, lo + chunk);
  if (put(dc, 0, peer, recv, (u64)dc.rank * block + lo, send, lo, hi - lo, signal_inc(0),
          no_counter(), CTA))
    return;
  if (ep::wait_from(dc, 0, target, NO_PEER)) return;
  if (flush(dc, 0, CTA)) return;
  ep::clock_end(clock);
}
