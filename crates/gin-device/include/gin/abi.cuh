// gin-rs device ABI: the structs a kernel receives, byte for byte the
// #[repr(C)] structs of gin-device's abi.rs (both sides assert the layout).
// Compiles with nvcc, NVRTC (no system headers needed) and as host C++.
#pragma once

#if defined(__CUDACC__)
#define GIN_HD __host__ __device__ __forceinline__
#define GIN_DEV __device__ __forceinline__
#else
#define GIN_HD inline
#endif

// Field offsets are asserted where the compiler takes __builtin_offsetof in a
// constant expression (g++, nvcc); NVRTC does not, and compiles the same
// text that those two have checked.
#if defined(__CUDACC_RTC__)
#define GIN_ASSERT_OFFSET(T, f, off, msg) static_assert(true, msg)
#else
#define GIN_ASSERT_OFFSET(T, f, off, msg) static_assert(__builtin_offsetof(T, f) == off, msg)
#endif

namespace gin {

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

static_assert(sizeof(u8) == 1 && sizeof(u16) == 2 && sizeof(u32) == 4 && sizeof(u64) == 8,
              "gin: fixed-width types");

// Who cooperates in one call: the calling thread, its whole warp, or its
// whole block (every member calls with the same arguments).
enum Coop : u32 { THREAD = 0, WARP = 1, CTA = 2 };

// DevCommAbi::flags
constexpr u32 FLAG_STRONG_SIGNALS = 1u << 0;
constexpr u32 FLAG_VA_SIGNALS = 1u << 1;
// Each context is used by one thread: queue reservations need no atomics.
constexpr u32 FLAG_EXCLUSIVE_CTX = 1u << 2;
// Signals are nranks sub-slots whose sum is the signal (CUDA ranks; see
// signal_slot in gin.cuh for who writes which).
constexpr u32 FLAG_SENDER_SLOTS = 1u << 3;
// Each context is used by one block: reservations use block-scope atomics.
constexpr u32 FLAG_CTA_CTX = 1u << 4;
// Every rank reaches every rank by load/store (CUDA ranks): every signal to
// this rank lands in its own sub-slot, so a wait reads one word.
constexpr u32 FLAG_LSA_ONLY = 1u << 5;
// The engine behind the queue paths (proxy or NIC) applies atomics to any
// window word and stores inline data of 1, 2 or 4 bytes: VA signals and
// sub-word put_value may take those paths. Clear on CUDA ranks today, whose
// engines execute with the copy engine (no atomics, 8-byte stores only):
// there such calls fail with COPY_ENGINE before anything is posted.
constexpr u32 FLAG_QUEUE_ATOMICS = 1u << 6;

// What a barrier guarantees about earlier puts (gin-device's ops::Fence).
enum Fence : u32 {
  FENCE_NONE = 0,         // synchronisation only; earlier puts may be in flight
  FENCE_CONTEXT = 1,      // earlier puts of the barrier's context are visible
  FENCE_ALL_CONTEXTS = 2, // earlier puts of every context are visible
};

// A per-call timeout (nanoseconds) that never expires.
constexpr u64 NO_TIMEOUT = ~0ull;

// DevComm::backend_kind
constexpr u32 BACKEND_NONE = 0;
constexpr u32 BACKEND_PROXY = 1;
constexpr u32 BACKEND_GDAKI = 2;

// The queue paths a kernel is compiled with: a mask of GIN_QUEUE_PROXY and
// GIN_QUEUE_GDAKI (both by default); the load/store path is always built.
// A kernel that only ever reaches load/store peers (one host's NVLink
// domain) may be compiled with -DGIN_QUEUE_PATHS=0: every call then carries
// the load/store path alone, with fewer registers and instructions (what
// NCCL's GIN calls its backend mask). A call that meets a peer reached
// through a queue path compiled out fails with PATH_NOT_BUILT, naming the
// peer and the backend, before anything is posted; so do a barrier with
// such a peer among its members (before any arrival is sent) and a flush
// or wait on a communicator with any such peer, even if this kernel never
// posted to it (another kernel may have). Define it the same in every
// translation unit linked together.
#define GIN_QUEUE_PROXY 1
#define GIN_QUEUE_GDAKI 2
#ifndef GIN_QUEUE_PATHS
#define GIN_QUEUE_PATHS (GIN_QUEUE_PROXY | GIN_QUEUE_GDAKI)
#endif
static_assert((GIN_QUEUE_PATHS & ~(GIN_QUEUE_PROXY | GIN_QUEUE_GDAKI)) == 0,
              "gin: GIN_QUEUE_PATHS is a mask of GIN_QUEUE_PROXY and GIN_QUEUE_GDAKI");

// Error kinds of the error word: [63:56] kind, [55:48] context (255: none),
// [47:32] peer (0xffff: none), [31:0] id or last value seen.
enum ErrorKind : u32 {
  OK = 0,
  SIGNAL_TIMEOUT = 1,
  COUNTER_TIMEOUT = 2,
  FLUSH_TIMEOUT = 3,
  QUEUE_TIMEOUT = 4,
  ABORTED = 5,
  BAD_PEER = 6,
  OUT_OF_WINDOW = 7,
  BAD_SIGNAL = 8,
  BAD_COUNTER = 9,
  BAD_CONTEXT = 10,
  UNSUPPORTED = 11,
  BARRIER_TIMEOUT = 12,
  MISALIGNED = 13,
  WQE_ERROR = 14, // value: syndrome << 16 | WQE index
  // The path's engine is the copy engine, which has no atomics (a VA
  // signal) and stores 8 aligned bytes at a time (a 1/2/4-byte put_value);
  // value: the window id. Refused before anything is posted.
  COPY_ENGINE = 15,
  // The peer is reached through a queue path this kernel was compiled
  // without (GIN_QUEUE_PATHS); value: the backend (BACKEND_PROXY or
  // BACKEND_GDAKI). Refused before anything is posted.
  PATH_NOT_BUILT = 16,
};

GIN_HD u64 error_word(u32 kind, u32 ctx, u32 peer, u32 value) {
  u64 c = ctx > 255 ? 255 : ctx;
  u64 p = peer > 0xfffe ? 0xffff : peer;
  return ((u64)kind << 56) | (c << 48) | (p << 32) | (u64)value;
}
constexpr u32 NO_PEER = 0xffffffffu;

struct DevComm {
  u32 rank;
  u32 nranks;
  u32 nctx;
  u32 nsignals;    // user signals per context
  u32 ncounters;   // counters per context
  u32 flags;
  u64 signal_base; // first signal slot of this communicator
  u64 signals;     // local signal window (u64 slots; x nranks with FLAG_SENDER_SLOTS)
  u64 counter_base;
  u64 counters;    // local counters (2 u64 sub-slots each on CUDA ranks)
  u64 abort_flag;  // u32 the host sets to make waits give up
  u64 error_word;  // u64, first error wins
  u64 timeout_ticks; // wait timeout in %globaltimer nanoseconds (0: none)
  // Read by puts, signals and waits: here, in the by-value kernel argument
  // (constant memory), not behind one more pointer, because a wait's
  // system-scope acquire empties L1 and each pointer chased after it costs
  // an L2 round trip.
  u64 rings;        // ProxyRingAbi or GdakiQpAbi [nctx * nranks], context-major (0: none)
  u32 backend_kind; // BACKEND_*
  u32 sig_per_ctx;  // user signals, then one slot per world barrier
  u64 lsa;          // reach table: u8[nranks] (0 queues, 1 load/store, 2 not
                    // connected; +4 on a load/store peer on this GPU); at
                    // the next multiple of 4, the rail team:
                    // u32 rail barriers, u32 members, u32 ranks[members]
  u64 signal_peers; // u64[nranks]: signal windows mapped here (0: none)
  u32 world_barriers;
  u32 signal_window; // the signal window's id, for descriptors
};
static_assert(sizeof(DevComm) == 120, "DevComm ABI");
GIN_ASSERT_OFFSET(DevComm, signal_base, 24, "DevComm ABI");
GIN_ASSERT_OFFSET(DevComm, signals, 32, "DevComm ABI");
GIN_ASSERT_OFFSET(DevComm, counters, 48, "DevComm ABI");
GIN_ASSERT_OFFSET(DevComm, rings, 80, "DevComm ABI");
GIN_ASSERT_OFFSET(DevComm, backend_kind, 88, "DevComm ABI");
GIN_ASSERT_OFFSET(DevComm, lsa, 96, "DevComm ABI");
GIN_ASSERT_OFFSET(DevComm, signal_peers, 104, "DevComm ABI");
GIN_ASSERT_OFFSET(DevComm, signal_window, 116, "DevComm ABI");

struct Window {
  u32 id;
  u32 flags;
  u64 local_base;
  u64 local_size;
  u64 sizes;      // u64[nranks]
  u64 peer_bases; // u64[nranks]: peer parts mapped here (0: no load/store path)
  u64 keys;       // u32[nranks]
  u64 addrs;      // u64[nranks]
};
static_assert(sizeof(Window) == 56, "Window ABI");
GIN_ASSERT_OFFSET(Window, local_base, 8, "Window ABI");
GIN_ASSERT_OFFSET(Window, peer_bases, 32, "Window ABI");
GIN_ASSERT_OFFSET(Window, keys, 40, "Window ABI");
GIN_ASSERT_OFFSET(Window, addrs, 48, "Window ABI");

struct ProxyRingAbi {
  u64 slots; // 2^log2 64-byte descriptors, mapped pinned host memory
  u64 head;  // u64 producer index, device memory
  u64 done;  // u64 completion index, device memory, stored by the proxy
  u32 log2;
  u32 reserved;
};
static_assert(sizeof(ProxyRingAbi) == 32, "ProxyRingAbi ABI");
GIN_ASSERT_OFFSET(ProxyRingAbi, done, 16, "ProxyRingAbi ABI");
GIN_ASSERT_OFFSET(ProxyRingAbi, log2, 24, "ProxyRingAbi ABI");

// One mlx5 send queue (GDAKI on CUDA ranks): WQEs, doorbell record and
// doorbell in mapped host memory; indices and the collapsed CQE in device
// memory (gin-device's abi.rs says why).
struct GdakiSqAbi {
  u64 wqes;     // 2^log2 64-byte WQEs
  u64 indices;  // u64[2]: reservation, ready
  u64 dbrec;    // big-endian u32 producer index
  u64 doorbell; // u64 doorbell register
  u64 cqe;      // the collapsed 64-byte CQE
  u32 qpn;
  u32 log2;
};
static_assert(sizeof(GdakiSqAbi) == 48, "GdakiSqAbi ABI");
GIN_ASSERT_OFFSET(GdakiSqAbi, cqe, 32, "GdakiSqAbi ABI");
GIN_ASSERT_OFFSET(GdakiSqAbi, qpn, 40, "GdakiSqAbi ABI");

struct GdakiQpAbi {
  GdakiSqAbi main;      // RC QP to the peer
  GdakiSqAbi companion; // loopback QP for counters
  u64 sig_addr;         // the peer's signal window, its own address
  u32 sig_key;
  u32 counter_key;
  u64 sink;             // atomic results land here (never read)
  u32 sink_key;
  u32 main_cqn;
};
static_assert(sizeof(GdakiQpAbi) == 128, "GdakiQpAbi ABI");
GIN_ASSERT_OFFSET(GdakiQpAbi, companion, 48, "GdakiQpAbi ABI");
GIN_ASSERT_OFFSET(GdakiQpAbi, sig_addr, 96, "GdakiQpAbi ABI");
GIN_ASSERT_OFFSET(GdakiQpAbi, sink, 112, "GdakiQpAbi ABI");
GIN_ASSERT_OFFSET(GdakiQpAbi, main_cqn, 124, "GdakiQpAbi ABI");

// Rolling comparisons (as gin-device's wait.rs): 64-bit signals, 56-bit counters.
constexpr u64 COUNTER_MASK = (1ull << 56) - 1;
GIN_HD bool signal_reached(u64 value, u64 target) { return (i64)(value - target) >= 0; }
GIN_HD bool counter_reached(u64 value, u64 target) {
  return ((value - target) & COUNTER_MASK) < (1ull << 55);
}

} // namespace gin
