// Kernels of `gin-cuda-selftest parity`: the calls gin.cuh has in common with
// the Rust API beyond put/signal/get (issue 21's header parity): weak-signal
// helpers, put_value of 1/2/4/8 bytes, signals by window address (VA),
// per-call timeouts, flush_async/wait, barrier fence levels. Data and
// results are checked on the device. Compiled by NVRTC at run time and by
// nvcc in CI.
#include "gin/gin.cuh"

using namespace gin;

// What `rank` writes at byte `i` of its source window.
__device__ __forceinline__ u8 parity_byte(u32 rank, u64 i) {
  return (u8)((i * 37u) ^ (rank * 101u + 13u));
}

// Whether the path to `peer` applies atomics and sub-word stores: the
// load/store path, or queues behind an engine with atomics.
__device__ __forceinline__ bool parity_can(const DevComm& dc, u32 peer) {
  return !detail::is_queued(dc, peer) || (dc.flags & FLAG_QUEUE_ATOMICS) != 0;
}

// Steps reported in out[2].
constexpr u64 STEP_VALUE8 = 1, STEP_SUBWORD = 2, STEP_VA = 4, STEP_TIMEOUTS = 8, STEP_FLUSH_ASYNC = 16,
              STEP_FENCES = 32;
// The byte a rank's recv window is filled with before the kernel.
constexpr u8 FILL = 0x5a;
// The recv window (4096 bytes a rank): values at 0..16 (16..24 untouched),
// a VA-signalled put at 64..128, the fenced put at 512..1024, the get at
// 2048..4096. The sig window (64 bytes a rank, zero): VA signal words at 0
// and 8, an unused one at 16.
constexpr u64 VA_DATA = 64, FENCE_DATA = 512, FENCE_BYTES = 512, GET_AT = 2048, GET_BYTES = 2048;

__device__ __forceinline__ void bad(u64* out, u64 n = 1) {
  atomicAdd((unsigned long long*)&out[1], (unsigned long long)n);
}

// Counts bytes of `p[0..n)` that differ from `prev`'s source bytes at
// `from..from + n` into out[1] (the whole block).
__device__ __forceinline__ void check_bytes(const u8* p, u64 n, u32 prev, u64 from, u64* out) {
  u64 wrong = 0;
  for (u64 i = threadIdx.x; i < n; i += blockDim.x) wrong += p[i] != parity_byte(prev, from + i);
  if (wrong) bad(out, wrong);
}

// One block; `coop` the gin::Coop of every call (a block of 1, 32 or more
// threads). out[0]: 0 or the first error kind; out[1]: checks that failed;
// out[2]: the STEP_* that ran; out[3]: 1 where the path to the next rank
// refuses VA signals and sub-word values (copy engine); out[4]: how long
// the 2 ms wait_signal_for waited (ns).
extern "C" __global__ void gin_parity(DevComm dc, Window recv, Window src, Window sig, u32 coop,
                                      u64* out) {
  const Coop c = (Coop)coop;
  const u32 me = dc.rank, n = dc.nranks;
  const u32 next = (me + 1) % n, prev = (me + n - 1) % n;
  const bool lead = threadIdx.x == 0;
  u8* const mine = (u8*)recv.local_base;
  for (u64 i = threadIdx.x; i < src.local_size; i += blockDim.x)
    ((u8*)src.local_base)[i] = parity_byte(me, i);
  __syncthreads();
  u64 steps = 0;
  int e = OK;
#define GIN_TRY(call)                                                                              \
  do {                                                                                             \
    if (!e) e = (call);                                                                            \
  } while (0)

  // 1. put_value: 8 bytes everywhere, 1/2/4 bytes where the path stores
  // sub-words; a weak signal with the 8-byte one, a strong one after all.
  const bool sub_out = parity_can(dc, next), sub_in = parity_can(dc, prev);
  GIN_TRY(put_value_of<u64>(dc, 0, next, recv, 8, 0x1122334455667700ull | me,
                            signal_add_weak(1, 3), c));
  if (sub_out) {
    GIN_TRY(put_value_of<u8>(dc, 0, next, recv, 0, (u8)(0xa0 + me), no_signal(), c));
    GIN_TRY(put_value_of<u16>(dc, 0, next, recv, 2, (u16)(0xb000 + me), no_signal(), c));
    GIN_TRY(put_value_of<u32>(dc, 0, next, recv, 4, 0xc0000000u + me, no_signal(), c));
  }
  GIN_TRY(signal(dc, 0, next, signal_inc(0), c));
  GIN_TRY(wait_signal(dc, 0, 0, 1, c));
  GIN_TRY(wait_signal(dc, 0, 1, 3, c));
  if (!e && lead) {
    if (*(volatile u64*)(mine + 8) != (0x1122334455667700ull | prev)) bad(out);
    if (sub_in) {
      if (mine[0] != (u8)(0xa0 + prev) || mine[1] != FILL) bad(out);
      if (*(volatile u16*)(mine + 2) != (u16)(0xb000 + prev)) bad(out);
      if (*(volatile u32*)(mine + 4) != 0xc0000000u + prev) bad(out);
    } else {
      for (int i = 0; i < 8; ++i)
        if (mine[i] != FILL) bad(out);
    }
    for (int i = 16; i < 24; ++i)
      if (mine[i] != FILL) bad(out);
    if (read_signal(dc, 0, 1) != 3) bad(out);
  }
  steps |= STEP_VALUE8 | (sub_out && sub_in ? STEP_SUBWORD : 0);

  // 2. VA signals: a put announced by a strong VA increment, a weak VA add
  // with no data; read, wait, reset.
  if (!e && sub_out && sub_in) {
    GIN_TRY(put(dc, 0, next, recv, VA_DATA, src, VA_DATA, 64, va_signal_inc(sig, 0), no_counter(),
                c));
    GIN_TRY(signal(dc, 0, next, va_signal_add_weak(sig, 8, 5), c));
    GIN_TRY(wait_va_signal(dc, 0, sig, 0, 1, c));
    GIN_TRY(wait_va_signal(dc, 0, sig, 8, 5, c));
    if (!e) {
      check_bytes(mine + VA_DATA, 64, prev, VA_DATA, out);
      if (lead && (read_va_signal(dc, 0, sig, 0) != 1 || read_va_signal(dc, 0, sig, 8) != 5))
        bad(out);
      __syncthreads();
      // From one thread; a failure is counted (the coop's `e` stays shared).
      if (lead) {
        if (reset_va_signal(dc, 0, sig, 0) || reset_va_signal(dc, 0, sig, 8)) bad(out);
        if (read_va_signal(dc, 0, sig, 0) != 0 || read_va_signal(dc, 0, sig, 8) != 0) bad(out);
      }
      __syncthreads();
    }
    steps |= STEP_VA;
  }

  // 3. Per-call timeouts: nothing ever signals signal 2, counter 3 or the VA
  // word at 16, so each wait runs out and says so without touching the
  // error word; waits already satisfied return OK even with no time left.
  if (!e) {
    const u64 t0 = proxy::globaltimer();
    const int k1 = wait_signal_for(dc, 0, 2, 1, 2000000, c);
    const u64 waited = proxy::globaltimer() - t0;
    const int k2 = wait_counter_for(dc, 0, 3, 1, 1000000, c);
    const int k3 = wait_va_signal_for(dc, 0, sig, 16, 1, 1000000, c);
    const int k4 = wait_signal_for(dc, 0, 0, 1, 0, c);
    const int k5 = wait_signal_for(dc, 0, 1, 3, NO_TIMEOUT, c);
    if (lead) {
      if (k1 != SIGNAL_TIMEOUT || waited < 2000000) bad(out);
      if (k2 != COUNTER_TIMEOUT || k3 != SIGNAL_TIMEOUT || k4 != OK || k5 != OK) bad(out);
      if (*(volatile u64*)dc.error_word != 0) bad(out);
      out[4] = waited;
    }
    steps |= STEP_TIMEOUTS;
  }

  // 4. flush_async/wait: every rank's source is filled (the barrier), a get
  // of the previous rank's has landed once its request completed.
  GIN_TRY(barrier(dc, 0, 0, c));
  if (!e) {
    Request req;
    GIN_TRY(get(dc, 0, prev, src, GET_AT, recv, GET_AT, GET_BYTES, c));
    GIN_TRY(flush_async(dc, 0, prev, &req, c));
    GIN_TRY(wait(dc, 0, req, c));
    if (!e) check_bytes(mine + GET_AT, GET_BYTES, prev, GET_AT, out);
    steps |= STEP_FLUSH_ASYNC;
  }

  // 5. Fences: a put on context 1 is visible after a barrier on context 0
  // with FENCE_ALL_CONTEXTS; FENCE_NONE synchronises; barrier_for with time
  // to spare returns OK (and keeps everyone here until all have checked).
  GIN_TRY(put(dc, 1, next, recv, FENCE_DATA, src, FENCE_DATA, FENCE_BYTES, no_signal(),
              no_counter(), c));
  GIN_TRY(barrier(dc, 0, 1, c, FENCE_ALL_CONTEXTS));
  if (!e) check_bytes(mine + FENCE_DATA, FENCE_BYTES, prev, FENCE_DATA, out);
  GIN_TRY(barrier(dc, 0, 0, c, FENCE_NONE));
  GIN_TRY(barrier_for(dc, 0, 1, 10000000000ull, c));
  if (!e) steps |= STEP_FENCES;
#undef GIN_TRY

  if (lead) {
    if (e) out[0] = (u64)e;
    out[2] = steps;
    out[3] = parity_can(dc, next) ? 0 : 1;
  }
}

// One call that must fail (one thread): 1 a 4-byte put_value, 2 a bare VA
// signal, 3 a put with a VA signal (copy engine paths: COPY_ENGINE; the
// load/store path: they succeed), 4 a VA signal at a misaligned offset
// (MISALIGNED everywhere), 5 a put_value of 3 bytes (UNSUPPORTED).
extern "C" __global__ void gin_parity_refuse(DevComm dc, Window recv, Window sig, u32 which) {
  const u32 next = (dc.rank + 1) % dc.nranks;
  switch (which) {
  case 1: put_value_of<u32>(dc, 0, next, recv, 4, 7u); break;
  case 2: signal(dc, 0, next, va_signal_inc(sig, 0)); break;
  case 3: put(dc, 0, next, recv, 0, recv, 0, 8, va_signal_inc(sig, 0)); break;
  case 4: signal(dc, 0, next, va_signal_inc(sig, 4)); break;
  case 5: put_value_sized(dc, 0, next, recv, 0, 7, 3); break;
  default: break;
  }
}
