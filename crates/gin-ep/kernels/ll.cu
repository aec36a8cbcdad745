// gin-ep's low-latency mode on CUDA ranks: dispatch, the identity expert,
// combine, and the same-job floor, on gin/gin.cuh's put, signal, wait and
// flush. The protocol and buffer layout are the CPU ranks' (ll.rs,
// docs/ep.md): per-(local expert, source) slots sized for the maximum, one
// cumulative signal per (expert, source) carrying count + 1 after the data
// (id le * r + src), and in the combine one signal per (expert, source)
// (id experts + e) after the expert's outputs were put back to their
// (token, top-k slot) places, or, where the source reads the expert rank's
// combine slots in place (load/store peers, agreed at creation: pull), with
// no puts before it.
//
// Windows (this rank's part): send (tokens x m: the staged messages; a
// direct dispatch, below, stages only their metadata), recv
// (l x r x t x m), csend (l x r x t x 2h), crecv (t x k x 2h). A message is
// the payload (BF16, 2h bytes; or FP8: h bytes of E4M3, then one f32 scale
// per 128 elements), then u32 source token, i32 expert ids[k], f32
// weights[k], padded to 16 bytes. With FP8 the host stages the metadata and
// the BF16 tokens (xin), and the dispatch kernel quantises each token into
// its message before sending anything: bit for bit what gin-ep's num.rs
// computes (the ep::fp8 functions below compile as host C++ too, and
// tests/fp8_host.rs checks them against num.rs).
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
// nvcc (.ci/nvcc-check). As host C++ (no __CUDACC__) only the number
// formats below are visible.
#include "gin/gin.cuh"

// ht.cu, compiled after this file in one source (or alone by nvcc, which
// then includes it), knows it is here by this.
#define GIN_EP_LL_CU 1

using namespace gin;

// The number formats tokens travel in, for the kernels and (compiled as host
// C++) for the cross-check against gin-ep's num.rs. Every operation rounds
// as Rust's f32 arithmetic does: to nearest even, denormals kept (NVRTC and
// nvcc flush none without fast-math, and the explicit _rn intrinsics never
// contract into an FMA).
#if defined(__CUDACC__)
#define EP_FN __device__ __forceinline__
#else
#define EP_FN inline
#endif

namespace ep {
namespace fp8 {

#if defined(__CUDACC__)
EP_FN u32 bits_of(float v) { return __float_as_uint(v); }
EP_FN float float_of(u32 b) { return __uint_as_float(b); }
EP_FN float div_rn(float a, float b) { return __fdiv_rn(a, b); }
EP_FN float mul_rn(float a, float b) { return __fmul_rn(a, b); }
#else
EP_FN u32 bits_of(float v) {
  u32 b;
  __builtin_memcpy(&b, &v, 4);
  return b;
}
EP_FN float float_of(u32 b) {
  float v;
  __builtin_memcpy(&v, &b, 4);
  return v;
}
EP_FN float div_rn(float a, float b) { return a / b; }
EP_FN float mul_rn(float a, float b) { return a * b; }
#endif

// Round to nearest even, NaN kept a NaN: num.rs's Bf16::from_f32.
EP_FN u16 to_bf16(float v) {
  const u32 bits = bits_of(v);
  if (v != v) return (u16)((bits >> 16) | 0x40);
  return (u16)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
EP_FN float from_bf16(u16 b) { return float_of((u32)b << 16); }

// The largest finite E4M3 value, and elements per scale.
constexpr float MAX = 448.0f;
constexpr u32 BLOCK = 128;

// num.rs's f32_to_e4m3: FP8 E4M3 (bias 7, no infinities, 0x7f NaN),
// rounding to nearest even and saturating at +-448, by integer rounding of
// the f32 bits (exact; num.rs takes the exponent from log2 and gets the
// same codes, which the host cross-check pins).
EP_FN u8 e4m3_of(float v) {
  const u32 bits = bits_of(v);
  const u32 sign = (bits >> 24) & 0x80u, a = bits & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7f;            // NaN
  if (a >= 0x43e00000u) return (u8)(sign | 0x7eu); // 448 and above, infinity
  const u32 ef = a >> 23;                      // the biased f32 exponent
  if (ef < 121u) {
    // Below 2^-6: multiples of 2^-9, q = a * 2^9 rounded to even (8 is the
    // smallest normal, 2^-6). a = mant * 2^(ef - 150), so q = mant >> s.
    const u32 s = 141u - ef;
    if (s > 25u) return (u8)sign;              // below half of 2^-9
    const u32 mant = (a & 0x7fffffu) | 0x800000u;
    return (u8)(sign | ((mant + (1u << (s - 1)) - 1u + ((mant >> s) & 1u)) >> s));
  }
  // Normal: round the mantissa to 3 bits (a carry moves the exponent on),
  // then rebias from 127 to 7.
  const u32 r = (a + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
  return (u8)(sign | (r - (120u << 3)));
}

// num.rs's e4m3_to_f32 (exact in f32).
EP_FN float e4m3_value(u8 b) {
  if ((b & 0x7fu) == 0x7fu) return float_of(0x7fc00000u);
  const u32 e = (b >> 3) & 0xfu, m = b & 7u;
  const float mag = e == 0 ? float_of(0x3b000000u) * (float)m                  // m * 2^-9
                           : float_of((e + 120u) << 23) * (1.0f + (float)m / 8.0f); // 2^(e-7)
  return (b & 0x80u) ? -mag : mag;
}

// The running largest magnitude of a block: num.rs's fold with f32::max,
// which skips a NaN (quiet or signalling; fmax would turn a signalling NaN
// into a NaN on the host).
EP_FN float absmax(float acc, float x) {
  const float a = x < 0.0f ? -x : x;
  return a > acc ? a : acc;
}

// The scale of a block whose largest magnitude is `amax` (quantize_fp8:
// amax / 448, 1 for an all-zero block).
EP_FN float scale_of(float amax) { return amax > 0.0f ? div_rn(amax, MAX) : 1.0f; }

// One element of a block with scale `s`: quantize_fp8's f32_to_e4m3(x / s).
EP_FN u8 quantize(float x, float s) { return e4m3_of(div_rn(x, s)); }

// dequantize_fp8's Bf16::from_f32(e4m3_to_f32(b) * s). A NaN code is
// num.rs's f32::NAN times the scale: the quiet NaN x86 passes through
// (0x7fc0 in BF16), where a GPU would make its own NaN.
EP_FN u16 dequantize(u8 b, float s) {
  if ((b & 0x7fu) == 0x7fu) return 0x7fc0;
  return to_bf16(mul_rn(e4m3_value(b), s));
}

} // namespace fp8

// The errors the kernels record for the host (cuda/dev.rs's decode_error,
// and Record for the slots): each record is four words, word 0 the kind |
// the peer << 8 (0: none), words 1-3 what. err (device memory, claimed by
// CAS) and its mirror errh (pinned host memory, which the host polls) hold
// two slots of a record each:
// - slot 0 (words 0-3): the first error of any kind. A refusal
//   (ERR_PEER_BAD_INPUT and this rank's own bad entries, and
//   ERR_PEER_REFUSED_COMBINE: a step every rank ends alike) is cleared by
//   the host once it reported it (cuda/mod.rs: a waited dispatch or
//   combine, or check, which may run between a dispatch and its combine),
//   and the next record takes the slot again; anything else there is in
//   slot 1 too, and fails the buffer.
// - slot 1 (words 4-7): the first error that is not a refusal (a source's
//   broken protocol, a high-throughput error), claimed even when slot 0
//   already holds a refusal, so that a refusal recorded first can never
//   hide it; never cleared: the host fails the buffer on it, whatever slot
//   0 says.
constexpr u64 ERR_COUNT_OVER_MAX = 1;  // peer, expert, count
constexpr u64 ERR_PEER_BAD_INPUT = 2;  // peer, expert
constexpr u64 ERR_TOKEN_RANGE = 3;     // peer, expert, token index
constexpr u64 ERR_NOT_NAMED = 4;       // peer, expert, token index
constexpr u64 ERR_EXPERT_RANGE = 5;    // token, slot, expert (i64 bits)
constexpr u64 ERR_DUPLICATE = 6;       // token, second | first << 32, expert
constexpr u64 ERR_WEIGHT = 7;          // token, slot, weight bits
// (8 is high-throughput mode's ERR_HT, in ht.cu.)
constexpr u64 ERR_PEER_REFUSED_COMBINE = 9; // peer, expert, how far its signal moved
// What a source adds to a dispatch signal when its inputs were refused (on
// the GPU, or by its host's checks; a real count adds count + 1 <= 2^31):
// no tokens, and the receivers know why. An expert rank whose combine was
// refused (its expert outputs refused by its host's checks) adds it to each
// of its combine signals beside the step's 1: no outputs, and the sources
// know why.
constexpr u64 POISON = 1ull << 32;

// How errors are recorded (compiled as host C++ too: tests/record_host.rs
// runs the slots through refusals and broken protocols in every order).
namespace rec {

// Words per slot, and slots (above).
constexpr u32 WORDS = 4;
constexpr u32 SLOTS = 2;

// Whether word 0 of a record is a refusal (cuda/dev.rs's is_refusal).
EP_FN bool is_refusal(u64 w0) {
  const u64 k = w0 & 0xff;
  return k == ERR_PEER_BAD_INPUT || k == ERR_EXPERT_RANGE || k == ERR_DUPLICATE || k == ERR_WEIGHT ||
         k == ERR_PEER_REFUSED_COMBINE;
}

// Whether a record of word 0 `w0` claims slot `slot`: slot 0 any, slot 1
// all but refusals.
EP_FN bool claims(u32 slot, u64 w0) { return slot == 0 || !is_refusal(w0); }

// Records w[0..4] in every slot it claims that is still free: `cas(p)`
// claims word 0 of a slot (p, in err) from 0 to w[0] atomically and says
// whether it did; the winner writes words 1-3 to err, then to the mirror
// (if any) words 1-3, `fence()` (system scope), word 0, `fence()`, so that
// a host that sees word 0 of a slot in the mirror sees the rest. A slot
// once claimed changes only when the host clears it (its word 0 last in
// err: nothing else writes a slot's mirror while its word 0 is set in err).
template <class Cas, class Fence>
EP_FN void record(u64* err, volatile u64* errh, const u64 w[WORDS], Cas cas, Fence fence) {
  for (u32 s = 0; s < SLOTS; ++s) {
    if (!claims(s, w[0])) continue;
    u64* e = err + s * WORDS;
    if (!cas(e, w[0])) continue;
    for (u32 i = 1; i < WORDS; ++i) e[i] = w[i];
    if (!errh) continue;
    volatile u64* h = errh + s * WORDS;
    for (u32 i = 1; i < WORDS; ++i) h[i] = w[i];
    fence();
    h[0] = w[0];
    fence();
  }
}

// What a receiver records for a source's dispatch signal that moved by
// c + 1 in a step (t: slots per pair; own_refused: this rank's inputs were
// refused this step): exactly POISON is the source's refusal, which a
// refused rank does not record (it records its own entry, or its host
// names it); any other count above t is a broken protocol (a late signal
// taken with the next step's looks so), recorded on every rank; 0: none.
EP_FN u64 count_error(u64 c, u64 t, bool own_refused) {
  if (c + 1 == POISON) return own_refused ? 0 : ERR_PEER_BAD_INPUT;
  return c > t ? ERR_COUNT_OVER_MAX : 0;
}

// Whether an expert rank's combine signal that moved `d` past its target
// in a step (the step's 1 is in the target: d is 0 for a full combine) was
// refused: POISON came with the step's 1. The source then reduces nothing
// and accounts POISON (the next dispatch adds it to the target), so that
// the next step's wait counts from the poisoned value.
EP_FN bool combine_refused(u64 d) { return d >= POISON; }

// What a source records for such a signal: an expert rank's refused
// combine, unless this rank refused the combine itself (its host names its
// own tensor; a refusing rank records nothing); 0 for a full combine.
EP_FN u64 combine_error(u64 d, bool own_refused) {
  return combine_refused(d) && !own_refused ? ERR_PEER_REFUSED_COMBINE : 0;
}

} // namespace rec

// The checks of device-resident inputs (compiled as host C++ too:
// tests/input_host.rs compares them with the host path's checks).
namespace input {

// The order in which a bad input is reported, as the host checks: every
// weight first (a live slot's weight that is not finite), then the top-k
// entries (out of range, or an expert named twice), each by (token, slot).
// The smallest key of a step's entries is its first error.
EP_FN u64 key(u64 cls, u32 tok, u32 slot) { return cls << 62 | (u64)tok << 20 | slot; }

EP_FN bool finite(float w) { return (fp8::bits_of(w) & 0x7f800000u) != 0x7f800000u; }

// The key of entry j of token tok (ids and w: that token's top-k ids and
// weights), ~0 where it is fine: ll::check_inputs's weight rule, then
// layout::check_topk's.
EP_FN u64 entry_key(const long long* ids, const float* w, u32 tok, u32 j, u32 experts) {
  const long long e = ids[j];
  if (e >= 0 && !finite(w[j])) return key(0, tok, j);
  if (e == -1) return ~0ull;
  if (e < 0 || e >= (long long)experts) return key(1, tok, j);
  for (u32 i = 0; i < j; ++i)
    if (ids[i] == e) return key(1, tok, j);
  return ~0ull;
}

// The error words (ERR_*) of the entry with key `key` (not ~0), from the
// inputs (idx, wts: tokens x k), as the host reports it.
EP_FN void error_of(u64 key, const long long* idx, const float* wts, u32 k, u32 experts,
                    u64 out[4]) {
  const u32 tok = (u32)((key >> 20) & 0xffffffffull), j = (u32)(key & 0xfffffu);
  const long long* ids = idx + (u64)tok * k;
  const long long e = ids[j];
  out[1] = tok;
  if (key >> 62 == 0) {
    out[0] = ERR_WEIGHT;
    out[2] = j;
    out[3] = fp8::bits_of(wts[(u64)tok * k + j]);
    return;
  }
  if (e < 0 || e >= (long long)experts) {
    out[0] = ERR_EXPERT_RANGE;
    out[2] = j;
    out[3] = (u64)e;
    return;
  }
  u32 first = 0;
  while (first < j && ids[first] != e) ++first;
  out[0] = ERR_DUPLICATE;
  out[2] = (u64)j | (u64)first << 32;
  out[3] = (u64)e;
}

} // namespace input

// The dispatch's grid barrier (grid_sync below), cooperative groups'
// arrival counter, as pure functions (compiled as host C++ too:
// tests/barrier_host.rs checks them over many launches of varying grids in
// every order of arrival).
namespace barrier {

// What block `block` of a grid of `grid` blocks adds to the counter when it
// arrives: block 0 2^31 - (grid - 1), every other block 1, so that a
// launch's blocks add exactly 2^31 in all.
EP_FN u32 arrival(u32 block, u32 grid) { return block == 0 ? 0x80000000u - (grid - 1u) : 1u; }

// Whether the barrier a block joined when the counter read `old` (before its
// own add) has passed, the counter reading `now`: bit 31 has flipped.
EP_FN bool passed(u32 old, u32 now) { return ((old ^ now) & 0x80000000u) != 0; }

} // namespace barrier
} // namespace ep

#if defined(__CUDACC__)

// Threads per block of every launch (cuda.rs's THREADS): the heavy kernels
// promise it to ptxas, which then keeps them within the registers a block
// of that size may have (128 per thread) rather than fail at launch.
#define EP_THREADS 512

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

// Whether gin's error word holds a failure (a wait that ran out or was
// aborted, a refused put...) of this launch or of one queued before it since
// the host last checked: the word stays set until the host reads it (after
// each waiting call, or in CudaBuffer::check).
__device__ __forceinline__ bool gin_failed(const DevComm& dc) {
  return dc.error_word && *(volatile const u64*)dc.error_word != 0;
}

// Block-wide, at a kernel's entry: whether an earlier launch failed (gin's
// error word: sticky until the host checks it, and the host refuses further
// steps once it has seen one), so that this one returns at once instead of
// waiting, up to the job timeout, for peers that stopped with it. An error
// gin-ep recorded (ep::record: bad inputs, a peer's broken protocol) does not
// stop the kernels: a broken pair counts 0 tokens, so they stay within their
// slots, and running on lets every peer finish its steps rather than wait
// for this rank; the host reports it. The same answer on every thread.
__device__ __forceinline__ bool failed_before(const DevComm& dc) {
  return __syncthreads_or(threadIdx.x == 0 && gin_failed(dc));
}

// gin's poll (the job timeout, the abort flag) of `ready`, which also gives
// up, as ABORTED, once gin's error word is set: another block of this launch
// or an earlier launch failed, and the peer this wait is for may be waiting
// for this rank in turn. The word is read every 64th look, off the fast path.
template <class Ready>
__device__ u32 poll_unless_failed(const DevComm& dc, u32 timeout_kind, Ready ready) {
  u32 looks = 0;
  bool gave_up = false;
  const u32 k = detail::poll(dc, timeout_kind, [&] {
    if (ready()) return true;
    if ((++looks & 63u) == 0 && gin_failed(dc)) gave_up = true;
    return gave_up;
  });
  return k ? k : gave_up ? (u32)ABORTED : (u32)OK;
}

// Block-wide wait for signal `id` (context 0) to reach `target`, bounded by
// the job timeout and the abort flag, and given up once gin's error word
// holds a failure (poll_unless_failed); a failure is recorded in the error
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
      const u32 k = poll_unless_failed(dc, SIGNAL_TIMEOUT, [&] {
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
// the first failure is recorded in the error word naming the expert's rank,
// and every thread gives up once gin's error word is set. Returns the same
// status on every thread; what the signals announced is visible to the whole
// block afterwards. `refused` (the same on every thread): the lowest expert
// whose signal came with POISON (rec::combine_refused: its rank refused the
// combine), ~0 for none, and `moved` how far that expert's signal moved
// past its target (what rec::combine_error judges and the record holds);
// for each such expert's rank, `account` (where not null) takes POISON, for
// the next dispatch to add to its target.
__device__ int wait_experts(const DevComm& dc, u32 first, u32 count, u32 l, const u32* active,
                            const u64* targets, u32& refused, u64& moved, u64* account) {
  __shared__ int status;
  __shared__ u32 low;
  __shared__ u64 low_moved;
  if (threadIdx.x == 0) {
    status = OK;
    low = ~0u;
    low_moved = 0;
  }
  __syncthreads();
  // This thread's lowest refused expert and how far its signal moved (its
  // experts come in ascending order: the first one found).
  u32 mine = ~0u;
  u64 mine_moved = 0;
  for (u32 e = threadIdx.x; e < count; e += blockDim.x) {
    const u32 owner = e / l, id = first + e;
    if (!active[owner]) continue;
    int s = OK;
    if (id >= dc.nsignals) {
      s = detail::fail(dc, BAD_SIGNAL, 0, owner, id);
    } else {
      const u64 slot = detail::signal_slot(dc, 0, id);
      const u64 target = targets[owner];
      u64 v = 0;
      const u32 k = poll_unless_failed(dc, SIGNAL_TIMEOUT, [&] {
        v = detail::signal_sum_acquire(dc, slot);
        return signal_reached(v, target);
      });
      if (k) {
        s = detail::fail(dc, k, 0, owner, id);
      } else if (rec::combine_refused(v - target)) {
        // Every expert of the refusing rank comes with it: the same store.
        if (account) account[owner] = POISON;
        atomicMin(&low, e);
        if (mine == ~0u) {
          mine = e;
          mine_moved = v - target;
        }
      }
    }
    if (s) atomicCAS(&status, OK, s);
  }
  __syncthreads();
  // The one thread that found the lowest refused expert says how far it
  // moved.
  if (mine != ~0u && mine == low) low_moved = mine_moved;
  __syncthreads();
  const int s = status;
  refused = low;
  moved = low_moved;
  __syncthreads();
  return s;
}

__device__ __forceinline__ const u8* meta_of(const Window& send, u64 tok, u32 m, u32 p) {
  return (const u8*)send.local_base + tok * m + p;
}

// Block-wide: the tokens among [base, base + blockDim.x) for which
// names(tok) holds, in token order, into list[0..n); returns n on every
// thread. blockDim.x is a multiple of 32 (the host launches 512 threads).
template <class Names>
__device__ u32 hits_where(u32 base, u32 tokens, u32* list, Names names) {
  __shared__ u32 before[32];
  __shared__ u32 total;
  const u32 tok = base + threadIdx.x, lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  const bool hit = tok < tokens && names(tok);
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

// The staged tokens whose top-k (their messages' metadata) names expert e.
__device__ u32 hits_of(const Window& send, u32 base, u32 tokens, u32 m, u32 p, u32 k, u32 e,
                       u32* list) {
  return hits_where(base, tokens, list, [&](u32 tok) {
    const int* ids = (const int*)(meta_of(send, tok, m, p) + 4);
    bool hit = false;
    for (u32 j = 0; j < k; ++j) hit |= ids[j] == (int)e;
    return hit;
  });
}

using fp8::from_bf16;
using fp8::to_bf16;

// Where the combine finds the expert output for top-k slot j (expert e) of
// this rank's token tok: read in place in the expert rank's csend slot
// (((e mod l) * r + rank) * t + eslot) where this rank reads that rank in
// place (pull[rank * r + owner]: a load/store peer, or itself), else where
// the expert put it, crecv's place (tok * k + j). Null (after recording the
// error, naming the expert's rank and the window) where a read in place
// would leave the expert's part: the host agreed on `pull` from the
// mappings, so that is a broken invariant, not a peer's doing.
__device__ __forceinline__ const u8* combine_row(const DevComm& dc, const Window& csend,
                                                 const Window& crecv, const u8* pull,
                                                 const u32* eslot, u32 tok, u32 j, u32 e, u32 l,
                                                 u32 t, u32 k, u64 h2) {
  const u32 r = dc.nranks, owner = e / l;
  if (!pull[dc.rank * r + owner]) return (const u8*)crecv.local_base + ((u64)tok * k + j) * h2;
  const u32 i = eslot[(u64)tok * k + j];
  const u64 off = (((u64)(e % l) * r + dc.rank) * t + i) * h2;
  const u8* base = owner == dc.rank ? (const u8*)csend.local_base
                                    : (const u8*)((const u64*)csend.peer_bases)[owner];
  if (!base || i >= t || !detail::range_ok(off, h2, ((const u64*)csend.sizes)[owner])) {
    detail::fail(dc, OUT_OF_WINDOW, 0, owner, csend.id);
    return nullptr;
  }
  return base + off;
}

// Grid-wide barrier of one launch (every block of the grid is resident: the
// host keeps grids small), cooperative groups' arrival counter (barrier::):
// block 0 adds 2^31 - (grid - 1) to `bar` (the low word of the buffer's
// u64), every other block 1, so that a launch's blocks add exactly 2^31 in
// all: bit 31 flips once, when the last block arrives (never before: the low bits start at 0
// and the sum stays below 2^31 until then), and the low bits come back to 0.
// Each block waits for the flip from the value it found. The barrier's
// state lives on the device alone, nothing of it in the launch's arguments:
// a CUDA graph that captured the launch replays it, and a grid of any size
// may follow one of another. Bounded by the job timeout and the abort flag,
// and given up when gin's error word is set. Every store a block made
// before it is visible to every block after it (fences at both ends, as
// cooperative groups' grid sync). Returns the same status on every thread.
__device__ int grid_sync(const DevComm& dc, u32* bar) {
  __shared__ int status;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const u32 old = atomicAdd(bar, barrier::arrival(blockIdx.x, gridDim.x));
    const u32 k = poll_unless_failed(
        dc, BARRIER_TIMEOUT, [&] { return barrier::passed(old, *(volatile u32*)bar); });
    __threadfence();
    status = k ? detail::fail(dc, k, 0, dc.rank, 0) : OK;
  }
  __syncthreads();
  return status;
}

// FP8 dispatch: quantises this rank's staged tokens (BF16 rows of xin) into
// the payloads of their messages in the send window, one warp per block of
// 128 elements across the grid (4 elements per lane): the block's largest
// magnitude (a max, exact in any order), its scale, each element's code,
// as num.rs's quantize_fp8.
__device__ void quantize_tokens(const Window& send, const u16* xin, u32 tokens, u32 m, u32 h) {
  const u32 lane = threadIdx.x & 31u, warps = blockDim.x >> 5;
  const u32 blocks = h / fp8::BLOCK, items = tokens * blocks;
  for (u32 it = blockIdx.x * warps + (threadIdx.x >> 5); it < items; it += gridDim.x * warps) {
    const u32 tok = it / blocks, b = it % blocks;
    const uint2 raw = *(const uint2*)(xin + (u64)tok * h + b * fp8::BLOCK + 4 * lane);
    const float x[4] = {from_bf16((u16)raw.x), from_bf16((u16)(raw.x >> 16)),
                        from_bf16((u16)raw.y), from_bf16((u16)(raw.y >> 16))};
    float amax = 0.0f;
    for (u32 i = 0; i < 4; ++i) amax = fp8::absmax(amax, x[i]);
    for (u32 o = 16; o > 0; o >>= 1)
      amax = fp8::absmax(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float sc = fp8::scale_of(amax);
    u32 q = 0;
    for (u32 i = 0; i < 4; ++i) q |= (u32)fp8::quantize(x[i], sc) << (8 * i);
    u8* msg = (u8*)send.local_base + (u64)tok * m;
    *(u32*)(msg + b * fp8::BLOCK + 4 * lane) = q;
    if (lane == 0) *(float*)(msg + h + 4 * b) = sc;
  }
}

// Records an error (ep::rec::record: the first of any kind in slot 0, the
// first broken protocol in slot 1) in err (device memory, 8 words) and its
// mirror errh (pinned host memory the host polls without waiting for the
// stream; 8 words, or null).
__device__ void record(u64* err, u64* errh, u64 w0, u64 w1, u64 w2, u64 w3) {
  if (!err) return;
  const u64 w[rec::WORDS] = {w0, w1, w2, w3};
  rec::record(
      err, errh, w,
      [](u64* p, u64 v) { return atomicCAS((unsigned long long*)p, 0ull, (unsigned long long)v) == 0ull; },
      [] { __threadfence_system(); });
}

// Device-resident inputs: writes each token's metadata into its message in
// the send window (source token, top-k ids as i32, weights, zero padding to
// m: what ll.rs's write_metadata stages on the host), and with BF16
// (fp8 = 0) and `payload` copies its payload from x (16-byte aligned rows: the host
// checks the address; hidden is a multiple of 8). A warp per token across
// the grid. Checks every top-k entry as the host would (input::entry_key):
// the smallest key found goes to inbad (atomicMin; the combine kernel
// resets it to ~0 for the next step).
__device__ __noinline__ void stage_tokens(const Window& send, const u16* x, const long long* idx,
                                          const float* wts, u32 tokens, u32 m, u32 p, u32 k,
                                          u32 experts, u32 fp8, u64* inbad, bool payload) {
  const u32 lane = threadIdx.x & 31u, warps = blockDim.x >> 5;
  for (u32 tok = blockIdx.x * warps + (threadIdx.x >> 5); tok < tokens; tok += gridDim.x * warps) {
    u8* msg = (u8*)send.local_base + (u64)tok * m;
    // The payload with eight 16-byte loads in flight per lane (gin's
    // coop_copy): one load at a time left each warp's token waiting on
    // HBM's latency once per 512 bytes.
    if (!fp8 && payload) gin::detail::coop_copy(WARP, msg, (const u8*)(x + (u64)tok * (p / 2)), p);
    u8* md = msg + p;
    if (lane == 0) *(u32*)md = tok;
    u64 bad = ~0ull;
    const long long* ids = idx + (u64)tok * k;
    const float* w = wts + (u64)tok * k;
    for (u32 j = lane; j < k; j += 32) {
      ((int*)(md + 4))[j] = (int)ids[j];
      ((float*)(md + 4 + 4 * (u64)k))[j] = w[j];
      bad = min(bad, input::entry_key(ids, w, tok, j, experts));
    }
    for (u32 b = p + 4 + 8 * k + lane; b < m; b += 32) msg[b] = 0;
    if (bad != ~0ull) atomicMin((unsigned long long*)inbad, (unsigned long long)bad);
  }
}

// Whether every active rank is a load/store peer (or this rank): then a
// dispatch from inputs in GPU memory copies each token straight from the
// caller's x into its slot at the expert's rank (direct_token) and stages
// only the metadata, which no send reads, so no grid barrier comes before
// the sends.
__device__ bool all_load_store(const DevComm& dc, const u32* active) {
  for (u32 q = 0; q < dc.nranks; ++q)
    if (active[q] && !gin::detail::is_lsa(dc, q)) return false;
  return true;
}

// Block-wide: the smallest key (input::entry_key) over every entry of the
// inputs, on every thread: each block of a direct dispatch judges them all
// itself, so no block sends before every entry is known good.
__device__ u64 entries_key(const long long* idx, const float* wts, u32 tokens, u32 k, u32 experts) {
  __shared__ unsigned long long least;
  if (threadIdx.x == 0) least = ~0ull;
  __syncthreads();
  u64 bad = ~0ull;
  for (u32 e = threadIdx.x; e < tokens * k; e += blockDim.x) {
    const u32 tok = e / k, j = e % k;
    bad = min(bad, input::entry_key(idx + (u64)tok * k, wts + (u64)tok * k, tok, j, experts));
  }
  for (u32 o = 16; o > 0; o >>= 1) bad = min(bad, (u64)__shfl_xor_sync(0xffffffffu, bad, o));
  if ((threadIdx.x & 31u) == 0 && bad != ~0ull) atomicMin(&least, (unsigned long long)bad);
  __syncthreads();
  const u64 key = least;
  // Nobody rewrites `least` (the next call) before all read.
  __syncthreads();
  return key;
}

// hits_of from the caller's top-k ids (tokens x k i64) instead of the
// staged messages' metadata.
__device__ u32 hits_of_ids(const long long* idx, u32 base, u32 tokens, u32 k, u32 e, u32* list) {
  return hits_where(base, tokens, list, [&](u32 tok) {
    bool hit = false;
    for (u32 j = 0; j < k; ++j) hit |= idx[(u64)tok * k + j] == (long long)e;
    return hit;
  });
}

// Warp-wide: token tok's message (its BF16 payload from x, then the
// metadata stage_tokens writes: index, top-k ids as i32, weights, zeros
// to m) straight into byte off of dst's part of recv, mapped here. An
// offset outside that part is recorded as gin's put would (OUT_OF_WINDOW)
// and returned as its error.
__device__ int direct_token(const DevComm& dc, const Window& recv, u32 dst, u64 off, const u16* x,
                            const long long* idx, const float* wts, u32 tok, u32 m, u32 p,
                            u32 k) {
  u8* const base = (u8*)__ldg((const unsigned long long*)recv.peer_bases + dst);
  const u64 size = __ldg((const unsigned long long*)recv.sizes + dst);
  if (!base || off > size || m > size - off)
    return gin::detail::fail(dc, !base ? gin::UNSUPPORTED : gin::OUT_OF_WINDOW, 0, dst, recv.id);
  u8* const msg = base + off;
  gin::detail::coop_copy(WARP, msg, (const u8*)(x + (u64)tok * (p / 2)), p);
  u32* const md = (u32*)(msg + p);
  const u32 words = (m - p) / 4, lane = threadIdx.x & 31u;
  for (u32 w = lane; w < words; w += 32) {
    u32 v = 0;
    if (w == 0) v = tok;
    else if (w <= k) v = (u32)(int)idx[(u64)tok * k + w - 1];
    else if (w <= 2 * k) v = __float_as_uint(wts[(u64)tok * k + w - 1 - k]);
    md[w] = v;
  }
  return 0;
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
// counts[q] is the count, checked here: a source's refused inputs (POISON)
// are recorded as such, and a count above t, a token index at or above t
// or a message that does not name the expert is the source's protocol
// error, recorded in err/errh (ep::record; the host reports it); such a
// pair counts 0 tokens, so that what an expert kernel reads of counts
// stays within the slots.
// active[rank]: 0 for a masked rank (nothing sent to it or awaited from it).
// Block 0 first adds 1 to ctarget[p] for each active rank p: the combine
// signal each rank's experts reach in this step's combine; and cpois[p]
// (POISON where p refused the last step's combine: ep_ll_combine), which it
// clears.
//
// Where the messages come from:
// - staged by the host (xin and idx null): nothing to do;
// - FP8 (fp8 = 1, xin: tokens x h BF16): every block quantises its share of
//   the tokens into their messages;
// - device-resident inputs (idx and wts not null: tokens x k i64 and f32;
//   xin the BF16 tokens): every block also writes its tokens' metadata (and
//   with BF16 copies their payloads) and checks the inputs (stage_tokens);
// - device-resident BF16 inputs where every active rank is a load/store
//   peer (direct): the metadata only is staged (this rank's combine reads
//   it, a later launch); each warp copies its token from xin straight into
//   the expert rank's slot and writes the metadata there (direct_token),
//   each block finds its experts' tokens in idx (hits_of_ids) and judges
//   every entry itself (entries_key).
// Whenever blocks stage payloads, a grid barrier (grid_sync on bar, its
// state on the device alone) comes before any block sends; a direct
// dispatch needs none. Inputs found bad (inbad below ~0, by stage_tokens;
// entries_key's key on a direct dispatch; or refused = 1: the host's checks refused this
// rank's inputs, and it launches 0 tokens and no source) send no token:
// every expert's signal adds POISON instead, so every receiver records why
// its count is missing rather than waiting, and this rank records the first
// bad entry as the host would report it (device-resident inputs; the host
// reports its own). Every rank then ends the step with a combine: a
// waiting host launches one of 0 tokens and zeroed counts (cuda/mod.rs's
// end_refused: the combine's signals without data), a queued step runs the
// combine its caller queued (a refused pair counts 0 tokens), or, refused
// by the host's checks, one of 0 tokens the host queued right after this
// launch (cuda/mod.rs's ll_refuse_on). Either way
// every signal of the step is consumed within it: seen[q] takes the
// poisoned value, and the next step counts from there.
// eslot[token * k + j] (t x k u32): the token's index among this rank's
// tokens for the expert its top-k slot j names (the layout's expert slot),
// written as the token is sent, for the combine's reads in place.
extern "C" __global__ void __launch_bounds__(EP_THREADS) ep_ll_dispatch(DevComm dc, Window send, Window recv, u32 tokens,
                                          u32 l, u32 t, u32 m, u32 p, u32 k, const u32* active,
                                          u64* seen, u32* counts, u32* meta, u64* clock,
                                          const u16* xin, u32 h, u32* bar, u32* eslot,
                                          u32 fp8, const long long* idx, const float* wts,
                                          u64* inbad, u64* err, u64* errh, u64* ctarget,
                                          u32 refused, u64* cpois) {
  // After a failure (an earlier launch's, queued since the host checked):
  // return at once rather than wait for peers that stopped.
  if (ep::failed_before(dc)) return;
  ep::clock_start(clock);
  const u32 r = dc.nranks, experts = l * r;
  if (blockIdx.x == 0)
    for (u32 q = threadIdx.x; q < r; q += blockDim.x) {
      // A refused combine's POISON (the last combine's cpois) is accounted
      // here, beside this step's 1: the combine's blocks all read ctarget.
      ctarget[q] += (active[q] ? 1 : 0) + cpois[q];
      cpois[q] = 0;
    }
  // From GPU memory in BF16 to load/store peers only (direct): each token
  // goes straight from x into its slot at the expert's rank, so only the
  // metadata is staged (for this rank's combine, a later launch), and no
  // grid barrier comes before the sends: each block judges every entry
  // itself (entries_key) and finds its experts' tokens in idx.
  const bool direct = idx && xin && !fp8 && ep::all_load_store(dc, active);
  u64 direct_key = ~0ull;
  if (direct) {
    ep::stage_tokens(send, xin, idx, wts, tokens, m, p, k, experts, fp8, inbad, false);
    direct_key = ep::entries_key(idx, wts, tokens, k, experts);
  } else if (xin || idx) {
    if (idx) ep::stage_tokens(send, xin, idx, wts, tokens, m, p, k, experts, fp8, inbad, true);
    if (fp8) ep::quantize_tokens(send, xin, tokens, m, h);
    if (ep::grid_sync(dc, bar)) return;
  }
  // Refused inputs: found by stage_tokens above, or by every block itself
  // on a direct dispatch (device-resident inputs: this rank records the
  // first bad entry), or by the host's checks before
  // this launch (refused: host inputs, or the token count, sizes or
  // alignment of inputs in GPU memory; the host staged nothing, launched 0
  // tokens, and its own error names what it refused: nothing to record).
  // Past the buffer's creation only the kernels write inbad (the host
  // would race a launch queued before this one); nothing in this launch
  // writes it after this read (stage_tokens did, before the grid barrier;
  // a direct dispatch does not read it: stage_tokens writes it meanwhile,
  // the same key, for the combine kernel to reset).
  const u64 key = direct ? direct_key : *(volatile u64*)inbad;
  const bool bad = refused || key != ~0ull;
  if (bad && idx && blockIdx.x == 0 && threadIdx.x == 0) {
    u64 w[4];
    ep::input::error_of(key, idx, wts, k, experts, w);
    ep::record(err, errh, w[0], w[1], w[2], w[3]);
  }
  // Each warp puts its own tokens (warp-wide copies of a message, all the
  // block's warps at once; a direct dispatch copies from xin into the
  // peer's mapped slot); the expert's signal follows the block's puts.
  __shared__ u32 list[1024];
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  const u32 warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (u32 e = blockIdx.x; e < experts; e += gridDim.x) {
    const u32 dst = e / l, le = e % l;
    if (!active[dst]) continue;
    if (bad) {
      if (signal(dc, 0, dst, signal_add(le * r + dc.rank, ep::POISON), CTA)) return;
      continue;
    }
    u32 count = 0;
    for (u32 base = 0; base < tokens; base += blockDim.x) {
      const u32 n = direct ? ep::hits_of_ids(idx, base, tokens, k, e, list)
                           : ep::hits_of(send, base, tokens, m, p, k, e, list);
      for (u32 j = warp; j < n; j += warps) {
        const u64 off = ((u64)(le * r + dc.rank) * t + count + j) * m;
        // Where the token lies among e's slots, for the combine's reads in
        // place: eslot[token * k + the top-k slot naming e].
        // (A direct dispatch reads the ids where the caller left them: the
        // staged metadata of other blocks' tokens is not known written.)
        if ((threadIdx.x & 31u) == 0) {
          const int* ids = (const int*)(ep::meta_of(send, list[j], m, p) + 4);
          for (u32 kk = 0; kk < k; ++kk)
            if (direct ? idx[(u64)list[j] * k + kk] == (long long)e : ids[kk] == (int)e)
              eslot[(u64)list[j] * k + kk] = count + j;
        }
        const int sent =
            direct ? ep::direct_token(dc, recv, dst, off, xin, idx, wts, list[j], m, p, k)
                   : put(dc, 0, dst, recv, off, send, (u64)list[j] * m, m, no_signal(),
                         no_counter(), WARP);
        if (sent) {
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
    const int mine = (int)(dc.rank * l + le);
    u32 got = (u32)c;
    // A refused source (POISON) or a count above t: the pair counts 0
    // tokens. A source's refusal is recorded unless this rank's own inputs
    // were refused (it records its own entry, or its host names it); a
    // count above t, a broken protocol, on every rank (ep::rec::count_error).
    if (c > t) {
      got = 0;
      const u64 kind = ep::rec::count_error(c, t, bad);
      if (threadIdx.x == 0 && kind) ep::record(err, errh, kind | (u64)src << 8, (u64)mine, c, 0);
    }
    bool broken = false;
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
      const u32 tok = *(const u32*)md;
      out[0] = tok;
      out[1] = kk;
      out[2] = kk < k ? __float_as_uint(w[kk]) : 0u;
      if (tok >= t) {
        ep::record(err, errh, ep::ERR_TOKEN_RANGE | (u64)src << 8, (u64)mine, tok, 0);
        broken = true;
      } else if (kk >= k) {
        ep::record(err, errh, ep::ERR_NOT_NAMED | (u64)src << 8, (u64)mine, tok, 0);
        broken = true;
      }
    }
    // A pair with a broken message counts 0 tokens, as a count above t or a
    // refused source's does.
    if (__syncthreads_or(broken)) got = 0;
    if (threadIdx.x == 0) {
      seen[q] = v;
      counts[q] = got;
    }
  }
  ep::clock_end(clock);
}

// The identity expert: copies each received BF16 payload into its combine
// slot (csend, 2h bytes per slot, same slot index); with FP8 (fp8 = 1) it
// dequantises it (num.rs's dequantize_fp8), eight elements per thread.
extern "C" __global__ void ep_ll_echo(Window recv, Window csend, u32 pairs, u32 t, u32 m, u32 h2,
                                      const u32* counts, u32 fp8) {
  const u32 h = h2 / 2;
  for (u32 q = blockIdx.x; q < pairs; q += gridDim.x) {
    const u32 c = counts[q] > t ? t : counts[q];
    for (u32 i = 0; i < c; ++i) {
      const u8* msg = (const u8*)recv.local_base + ((u64)q * t + i) * m;
      uint4* d = (uint4*)((u8*)csend.local_base + ((u64)q * t + i) * h2);
      if (!fp8) {
        const uint4* s = (const uint4*)msg;
        for (u32 v = threadIdx.x; v < h2 / 16; v += blockDim.x) d[v] = s[v];
        continue;
      }
      const float* scales = (const float*)(msg + h);
      for (u32 v = threadIdx.x; v < h / 8; v += blockDim.x) {
        const uint2 codes = ((const uint2*)msg)[v];
        const float sc = scales[8 * v / ep::fp8::BLOCK];
        u32 o[4];
        for (u32 j = 0; j < 4; ++j) {
          const u32 w = j < 2 ? codes.x : codes.y;
          const u32 sh = 16 * (j & 1u);
          o[j] = (u32)ep::fp8::dequantize((u8)(w >> sh), sc) |
                 ((u32)ep::fp8::dequantize((u8)(w >> (sh + 8)), sc) << 16);
        }
        d[v] = make_uint4(o[0], o[1], o[2], o[3]);
      }
    }
  }
}

// The caller's expert outputs into the combine slots: src holds pairs x t
// slots of h2 bytes (the layout of csend: DeepEP's [l, r * t, h] expert
// output tensor, 16-byte aligned), of which the received ones (counts) are
// copied.
extern "C" __global__ void ep_ll_take_outputs(Window csend, const u8* src, u32 pairs, u32 t,
                                              u32 h2, const u32* counts) {
  for (u32 q = blockIdx.x; q < pairs; q += gridDim.x) {
    const u32 c = counts[q] > t ? t : counts[q];
    // Eight 16-byte loads in flight per thread (gin's coop_copy).
    gin::detail::coop_copy(CTA, (u8*)csend.local_base + (u64)q * t * h2, src + (u64)q * t * h2,
                           (u64)c * h2);
  }
}

namespace ep {

// Slots a warp of the combine's reduction holds row pointers for (a
// larger top-k takes the general path).
constexpr u32 RED_SLOTS = 32;
// Columns one lane reduces per pass (one 16-byte piece of each row).
constexpr u32 RED_COLS = 8;

// The combine's reduction (hidden a multiple of 8, top-k at most
// RED_SLOTS): work items (token, column segment) spread over every warp of
// the grid, so that all warps work even when tokens are few. A warp first
// finds its token's rows (lane j: slot j's row, or null for an empty slot,
// a masked rank's expert or an error combine_row recorded) and weights, in
// shared memory; then each lane reduces 8 columns a pass, with up to eight
// slots' 16-byte loads in flight before it adds them in slot order: the
// same __fmul_rn / __fadd_rn products and sums in the same order as the CPU
// ranks (bit for bit), without a dependent chain of metadata loads per
// slot and pass.
__device__ void reduce_tokens(const DevComm& dc, const Window& send, const Window& csend,
                              const Window& crecv, u32 tokens, u32 l, u32 t, u32 m, u32 p, u32 k,
                              u32 h, const u32* active, unsigned short* out, const u32* eslot,
                              const u8* pull) {
  constexpr u32 WARPS = EP_THREADS / 32;
  __shared__ const u8* rows[WARPS][RED_SLOTS];
  __shared__ float wts[WARPS][RED_SLOTS];
  const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  const u32 experts = l * dc.nranks;
  const u64 h2 = 2ull * h;
  const u64 all_warps = (u64)gridDim.x * (blockDim.x >> 5);
  // Pieces of 8 columns per token, split into segments so that the items
  // cover the grid's warps (at least 32 pieces, one pass of a warp, each).
  const u32 pieces = h / RED_COLS;
  u64 segs = tokens ? (all_warps + tokens - 1) / tokens : 1;
  const u64 most = (pieces + 31) / 32;
  if (segs > most) segs = most;
  if (segs == 0) segs = 1;
  const u32 per = (u32)((pieces + segs - 1) / segs);
  for (u64 item = (u64)blockIdx.x * (blockDim.x >> 5) + warp; item < (u64)tokens * segs;
       item += all_warps) {
    const u32 tok = (u32)(item / segs), seg = (u32)(item % segs);
    const u8* md = meta_of(send, tok, m, p);
    const int* ids = (const int*)(md + 4);
    const float* w = (const float*)(md + 4 + 4 * (u64)k);
    __syncwarp();
    if (lane < k) {
      const int e = ids[lane];
      const u8* row = nullptr;
      if (e >= 0 && (u32)e < experts && active[(u32)e / l])
        row = combine_row(dc, csend, crecv, pull, eslot, tok, lane, (u32)e, l, t, k, h2);
      rows[warp][lane] = row;
      wts[warp][lane] = w[lane];
    }
    __syncwarp();
    const u32 lo = seg * per, hi = lo + per < pieces ? lo + per : pieces;
    for (u32 piece = lo + lane; piece < hi; piece += 32) {
      const u64 col = (u64)piece * RED_COLS;
      float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
      for (u32 j0 = 0; j0 < k; j0 += 8) {
        uint4 v[8];
#pragma unroll
        for (u32 u = 0; u < 8; ++u) {
          const u8* row = j0 + u < k ? rows[warp][j0 + u] : nullptr;
          if (row) v[u] = *(const uint4*)(row + 2 * col);
        }
#pragma unroll
        for (u32 u = 0; u < 8; ++u) {
          const u8* row = j0 + u < k ? rows[warp][j0 + u] : nullptr;
          if (!row) continue;
          const float wj = wts[warp][j0 + u];
          const u32 words[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
          for (u32 c = 0; c < 8; ++c) {
            const unsigned short b = (unsigned short)(words[c / 2] >> (16 * (c % 2)));
            // No contraction into an FMA: the CPU ranks' reduction rounds
            // the product and the sum separately.
            acc[c] = __fadd_rn(acc[c], __fmul_rn(wj, from_bf16(b)));
          }
        }
      }
      u32 o[4];
#pragma unroll
      for (u32 c = 0; c < 4; ++c)
        o[c] = (u32)to_bf16(acc[2 * c]) | ((u32)to_bf16(acc[2 * c + 1]) << 16);
      *(uint4*)(out + (u64)tok * h + col) = make_uint4(o[0], o[1], o[2], o[3]);
    }
  }
}

} // namespace ep

// Low-latency combine (send and receive halves in one launch). Sends: for
// each pair q = le * r + src, each received token's combine slot goes back
// to src's crecv at (source token * k + top-k slot) * 2h, unless src reads
// this rank's slots in place (pull[src * r + rank]: a load/store peer, or
// this rank itself), then signal experts + e there adds 1 (after the puts;
// for a reader in place it says the slots hold this step's outputs: they
// were written by earlier launches). Receives: waits for every active
// expert's signal to reach ctarget[its rank] (the steps each rank took part
// in, counted by the dispatch kernel), then reduces each of this rank's tokens over its
// top-k slots with the weights (f32, in slot order, rounded once to BF16),
// reading each slot in place or from crecv (combine_row), leaving out empty
// slots and masked ranks' experts, into out (tokens x h BF16). Reading in
// place or from crecv, the same bytes meet the same products and sums in the
// same order: the results are bit-identical either way. out is the
// buffer's own device memory (read back by the host, or the sink of a
// combine whose output tensor the host refused) or the caller's.
// Block 0 clears inbad (the dispatch's input check) for the next step.
//
// A refused combine (refused = 1: the host's checks refused this rank's
// expert outputs, and it staged none) is still a step every rank ends:
// this rank puts nothing, and each of its signals adds 1 + POISON, so that
// every source sees why its outputs are missing rather than waits for them
// or reduces stale slots. A source that finds POISON on an expert's signal
// (ep::rec::combine_refused; every block finds the same, the signals moved
// once this step) reduces nothing, writing nothing of out, and block 0
// records the lowest such expert's rank (ERR_PEER_REFUSED_COMBINE, unless
// this rank refused the combine itself: its host names its tensor) and sets
// cpois[that rank] to POISON, which the next dispatch adds to ctarget (the
// signal's accounted value), so that the next step's wait counts from the
// poisoned value; no poison reaches it.
//
// An expert rank rewrites its csend slots (the next step's expert) only
// after its next dispatch received every active source's count, which each
// source sends after this launch ended, that is after its reads here: the
// next dispatch's count is the reader's credit (docs/ep.md).
extern "C" __global__ void __launch_bounds__(EP_THREADS) ep_ll_combine(DevComm dc, Window send, Window csend, Window crecv,
                                         u32 tokens, u32 l, u32 t, u32 m, u32 p, u32 k, u32 h,
                                         const u32* active, const u32* counts, const u32* meta,
                                         const u64* ctarget, unsigned short* out, u64* clock,
                                         const u32* eslot, const u8* pull, u64* inbad,
                                         u64* cpois, u64* err, u64* errh, u32 refused) {
  // After a failure (this step's dispatch, or an earlier launch's): return
  // at once, as the dispatch does.
  if (ep::failed_before(dc)) return;
  ep::clock_start(clock);
  const u32 r = dc.nranks, experts = l * r;
  const u64 h2 = 2ull * h;
  // The dispatch of this step has read it (an earlier launch); the next
  // dispatch finds it clear.
  if (blockIdx.x == 0 && threadIdx.x == 0) *inbad = ~0ull;
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  const u32 warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (u32 q = blockIdx.x; q < experts; q += gridDim.x) {
    const u32 le = q / r, src = q % r;
    if (!active[src]) continue;
    // A source reading in place needs only the signal; a refused combine
    // sends no output.
    const u32 c = refused || pull[src * r + dc.rank] ? 0 : counts[q] > t ? t : counts[q];
    // A warp per token, all the block's warps at once; the pair's signal
    // follows the block's puts.
    for (u32 i = warp; i < c; i += warps) {
      const u32* md = meta + 3 * ((u64)q * t + i);
      const u32 tok = md[0], kk = md[1];
      // The dispatch recorded it (the host reports EpError::Protocol).
      if (tok >= t || kk >= k) continue;
      if (put(dc, 0, src, crecv, ((u64)tok * k + kk) * h2, csend, ((u64)q * t + i) * h2, h2,
              no_signal(), no_counter(), WARP)) {
        if ((threadIdx.x & 31u) == 0) failed = 1;
        break;
      }
    }
    __syncthreads();
    if (failed) return;
    const u64 add = refused ? 1 + ep::POISON : 1;
    if (signal(dc, 0, src, signal_add(experts + dc.rank * l + le, add), CTA)) return;
  }
  // csend is rewritten by the next step's expert.
  if (flush(dc, 0, CTA)) return;
  u32 low;
  u64 moved;
  if (ep::wait_experts(dc, experts, experts, l, active, ctarget, low, moved,
                       blockIdx.x ? nullptr : cpois))
    return;
  if (refused || low != ~0u) {
    // A refused combine: no result on any rank, nothing of out written.
    // The record: the refusing rank, its lowest expert, how far that
    // expert's signal moved past its target (POISON).
    const u64 kind = low != ~0u ? ep::rec::combine_error(moved, refused != 0) : 0;
    if (blockIdx.x == 0 && threadIdx.x == 0 && kind)
      ep::record(err, errh, kind | (u64)(low / l) << 8, low, moved, 0);
    ep::clock_end(clock);
    return;
  }
  if ((h & 7u) == 0 && k <= ep::RED_SLOTS) {
    ep::reduce_tokens(dc, send, csend, crecv, tokens, l, t, m, p, k, h, active, out, eslot, pull);
    ep::clock_end(clock);
    return;
  }
  // Any other shape: a block per token, a thread per column.
  for (u32 tok = blockIdx.x; tok < tokens; tok += gridDim.x) {
    const u8* md = ep::meta_of(send, tok, m, p);
    const int* ids = (const int*)(md + 4);
    const float* w = (const float*)(md + 4 + 4 * (u64)k);
    for (u32 col = threadIdx.x; col < h; col += blockDim.x) {
      float acc = 0.0f;
      for (u32 j = 0; j < k; ++j) {
        const int e = ids[j];
        if (e < 0 || (u32)e >= experts || !active[(u32)e / l]) continue;
        const u8* row = ep::combine_row(dc, csend, crecv, pull, eslot, tok, j, (u32)e, l, t, k, h2);
        if (!row) continue;
        // No contraction into an FMA: the CPU ranks' reduction rounds the
        // product and the sum separately.
        acc = __fadd_rn(acc, __fmul_rn(w[j], ep::from_bf16(((const unsigned short*)row)[col])));
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

#endif // __CUDACC__
