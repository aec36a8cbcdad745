// NCCL's GIN device names (NCCL 2.28 to 2.32: ncclGin, teams, coops, remote
// and local actions, ncclGinBarrierSession) mapped onto gin-rs's device API
// (gin/gin.cuh), so a kernel written for NCCL's GIN compiles against gin-rs
// with its calls unchanged. Include it instead of nccl.h and nccl_device.h;
// the two cannot be mixed in one translation unit.
//
// What gin cannot honour is refused at compile time with a static_assert
// that says why (signal shadows, custom barrier teams, coops other than a
// thread, a warp or a block, putValue of other than 1, 2, 4 or 8 bytes,
// host-memory segments, symmetric pointers, the LSA team). VA signals and
// 1/2/4-byte putValue compile and work on the load/store path; on a queue
// path of CUDA ranks (the copy engine: no atomics, 8-byte stores) they are
// refused at run time with gin's COPY_ENGINE error.
// Refusals fire only where a kernel uses the name, so a kernel that does
// not use them compiles.
//
// The mapping, one call for one call (docs/porting.md has the table):
// - ncclDevComm is gin::DevComm byte for byte (pass CudaDevComm::abi() as
//   the kernel's ncclDevComm argument); its fields are gin's, and of NCCL's
//   only `rank` and `nRanks` exist.
// - ncclWindow_t is gin::Window passed by value (GpuWindow::abi()), not a
//   pointer.
// - NCCL's methods return void; gin's calls return an error kind and
//   record the first error in the communicator's error word, which the host
//   reports after the kernel (CudaDevComm::run names the rank, peer,
//   context and id), so a failure is never silent.
// - Errors NCCL leaves undefined (a bad peer, an offset outside a window, a
//   signal id out of range) are checked, as every gin call checks them.
#pragma once
#include "gin/gin.cuh"

#if defined(__CUDACC__)

// Fixed-width integers: the platform's where it has a stdint.h (nvcc, NVRTC
// with a system include path), else CCCL's (NVRTC given CCCL's include path:
// its <cuda/atomic> below declares them too, as long long, so a stand-in
// here would clash), else glibc's LP64 choices (NVRTC alone).
#if __has_include(<stdint.h>)
#include <stdint.h>
#elif __has_include(<cuda/std/cstdint>)
#include <cuda/std/cstdint>
#else
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long uint64_t;
#endif

// cuda::memory_order and cuda::thread_scope: CCCL's where it can be found
// (nvcc, or NVRTC given CCCL's include path), else stand-ins with the same
// names, which NCCL's signatures only pass around.
#if __has_include(<cuda/atomic>)
#include <cuda/atomic>
#else
namespace cuda {
enum memory_order {
  memory_order_relaxed,
  memory_order_consume,
  memory_order_acquire,
  memory_order_release,
  memory_order_acq_rel,
  memory_order_seq_cst
};
enum thread_scope {
  thread_scope_system,
  thread_scope_device,
  thread_scope_block,
  thread_scope_thread
};
} // namespace cuda
#endif

// NCCL's result codes (nccl.h), for the few device calls that return one.
typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
  ncclTimeout = 8,
  ncclNumResults = 9
} ncclResult_t;

namespace gin {
namespace nccl_compat {
// False, but only once a template is instantiated: refusals fire where a
// kernel uses a name, not where the header declares it.
template <class T>
struct never {
  static constexpr bool value = false;
};
} // namespace nccl_compat
} // namespace gin

// ------------------------------------------------------------- communicator

// The device communicator a kernel receives by value: gin::DevComm's bytes,
// with NCCL's names for its first two fields.
struct alignas(alignof(gin::DevComm)) ncclDevComm {
  int rank;   // gin::DevComm::rank
  int nRanks; // gin::DevComm::nranks
  unsigned char ginRest[sizeof(gin::DevComm) - 2 * sizeof(int)];
};
typedef ncclDevComm ncclDevComm_t;
static_assert(sizeof(ncclDevComm) == sizeof(gin::DevComm) &&
                  alignof(ncclDevComm) == alignof(gin::DevComm),
              "gin-rs nccl_compat: ncclDevComm must be gin::DevComm byte for byte");
GIN_ASSERT_OFFSET(gin::DevComm, nranks, 4, "gin-rs nccl_compat: nRanks is gin::DevComm::nranks");

// A window: gin::Window, by value (NCCL's is a pointer to a handle).
typedef gin::Window ncclWindow_t;

typedef uint32_t ncclGinSignal_t;
typedef uint32_t ncclGinCounter_t;
typedef struct {
  uint64_t opaque[2];
} ncclGinRequest_t;

namespace gin {
namespace nccl_compat {
// The gin view of an ncclDevComm (the same bytes, see the static_assert).
GIN_DEV const DevComm& dev(const ncclDevComm& c) { return *reinterpret_cast<const DevComm*>(&c); }
// Records `kind` in the error word (the host reports it after the kernel).
GIN_DEV void refuse(const DevComm& dc, u32 kind, u32 ctx, u32 value) {
  detail::fail(dc, kind, ctx, NO_PEER, value);
}
} // namespace nccl_compat
} // namespace gin

// -------------------------------------------------------------------- teams

struct ncclTeam {
  int nRanks, rank, stride;
};
typedef ncclTeam ncclTeam_t;
struct ncclTeamTagWorld {};
struct ncclTeamTagLsa {};
struct ncclTeamTagRail {};

// Every rank.
GIN_HD ncclTeam ncclTeamWorld(const ncclDevComm& c) { return ncclTeam{c.nRanks, c.rank, 1}; }

// This rank's rail (the ranks with its local rank, one per host), as NCCL
// describes it: evenly strided. gin's rail is a list of ranks; where it is
// not evenly strided (hosts with different rank counts) the call records
// UNSUPPORTED and returns the team of this rank alone.
GIN_DEV ncclTeam ncclTeamRail(const ncclDevComm& c) {
  const gin::DevComm& dc = gin::nccl_compat::dev(c);
  const int n = (int)gin::rail_size(dc);
  const int first = n > 0 ? (int)gin::rail_rank(dc, 0) : c.rank;
  const int stride = n > 1 ? (int)gin::rail_rank(dc, 1) - first : 1;
  int me = -1;
  for (int i = 0; i < n; ++i) {
    const int r = (int)gin::rail_rank(dc, (gin::u32)i);
    if (r != first + i * stride) me = -2 - i;
    if (me == -1 && r == c.rank) me = i;
  }
  if (me < 0) {
    gin::nccl_compat::refuse(dc, gin::UNSUPPORTED, 0, (gin::u32)n);
    return ncclTeam{1, 0, 1};
  }
  return ncclTeam{n, me, stride};
}

// Team rank `rank` of `team` as a world rank.
GIN_HD int ncclTeamRankToWorld(const ncclDevComm& c, ncclTeam team, int rank) {
  return c.rank + (rank - team.rank) * team.stride;
}

// Refused: gin has no LSA team (a same-host peer is reached by load/store
// inside gin's own calls; see docs/porting.md).
template <class C>
GIN_DEV ncclTeam ncclTeamLsa(const C&) {
  static_assert(gin::nccl_compat::never<C>::value,
                "gin-rs nccl_compat: ncclTeamLsa is not supported: gin has no LSA team; put/signal "
                "to any world rank and gin takes the load/store path where it exists");
  return ncclTeam{0, 0, 0};
}

// ------------------------------------------------------------------- coops

template <int nThreadsPow2>
struct ncclCoopTile {
  static_assert(nThreadsPow2 > 0 && nThreadsPow2 <= 32 && (nThreadsPow2 & (nThreadsPow2 - 1)) == 0,
                "ncclCoopTile: a power of two from 1 to 32 threads");
  GIN_DEV int thread_rank() const { return (int)(gin::detail::lane() % nThreadsPow2); }
  GIN_DEV constexpr int size() const { return nThreadsPow2; }
  GIN_DEV constexpr int num_threads() const { return nThreadsPow2; }
  GIN_DEV unsigned laneMask() const {
    return (~0u >> (32 - nThreadsPow2)) << (gin::detail::lane() & ~(unsigned)(nThreadsPow2 - 1));
  }
  GIN_DEV void sync() {
    if (nThreadsPow2 > 1) __syncwarp(laneMask());
  }
};
typedef ncclCoopTile<1> ncclCoopThread;
typedef ncclCoopTile<32> ncclCoopWarp;

struct ncclCoopCta {
  GIN_DEV int thread_rank() const { return (int)threadIdx.x; }
  GIN_DEV int size() const { return (int)blockDim.x; }
  GIN_DEV int num_threads() const { return (int)blockDim.x; }
  GIN_DEV void sync() { __syncthreads(); }
};

// Some lanes of a warp; usable in a kernel's own code, refused by gin's calls.
struct ncclCoopLanes {
  uint32_t lmask;
  GIN_HD constexpr ncclCoopLanes(uint32_t m = ~0u) : lmask(m) {}
  GIN_DEV int thread_rank() const {
    return __popc(lmask & ((1u << gin::detail::lane()) - 1u));
  }
  GIN_DEV int size() const { return __popc(lmask); }
  GIN_DEV int num_threads() const { return __popc(lmask); }
  GIN_DEV void sync() { __syncwarp(lmask); }
};

namespace gin {
namespace nccl_compat {
// The gin coop of an NCCL coop type: a thread, a warp or a block.
template <class C>
struct coop_of {
  static_assert(never<C>::value,
                "gin-rs nccl_compat: this coop is not supported: gin's calls take ncclCoopThread, "
                "ncclCoopWarp or ncclCoopCta (a thread, a whole warp or a whole block)");
  static constexpr Coop value = THREAD;
};
template <>
struct coop_of<ncclCoopTile<1>> {
  static constexpr Coop value = THREAD;
};
template <>
struct coop_of<ncclCoopTile<32>> {
  static constexpr Coop value = WARP;
};
template <>
struct coop_of<ncclCoopCta> {
  static constexpr Coop value = CTA;
};
} // namespace nccl_compat
} // namespace gin

// ---------------------------------------------------------------- actions

struct ncclGin_None {};

// Signals by id. Strong: when it arrives, every earlier put of the context
// to that peer is visible; weak: only its own put.
struct ncclGin_StrongSignalInc {
  ncclGinSignal_t signal;
};
struct ncclGin_WeakSignalInc {
  ncclGinSignal_t signal;
};
// NCCL 2.28's name: strong where the communicator has strong signals.
struct ncclGin_SignalInc {
  ncclGinSignal_t signal;
};
struct ncclGin_StrongSignalAdd {
  ncclGinSignal_t signal;
  uint64_t value;
};
struct ncclGin_WeakSignalAdd {
  ncclGinSignal_t signal;
  uint64_t value;
};
struct ncclGin_SignalAdd {
  ncclGinSignal_t signal;
  uint64_t value;
};

// Signals by window address: gin's va_signal_* (see gin.cuh for the paths
// that can apply them).
struct ncclGin_StrongVASignalInc {
  ncclWindow_t signalWindow;
  size_t signalOffset;
};
struct ncclGin_WeakVASignalInc {
  ncclWindow_t signalWindow;
  size_t signalOffset;
};
struct ncclGin_VASignalInc {
  ncclWindow_t signalWindow;
  size_t signalOffset;
};
struct ncclGin_StrongVASignalAdd {
  ncclWindow_t signalWindow;
  size_t signalOffset;
  uint64_t value;
};
struct ncclGin_WeakVASignalAdd {
  ncclWindow_t signalWindow;
  size_t signalOffset;
  uint64_t value;
};
struct ncclGin_VASignalAdd {
  ncclWindow_t signalWindow;
  size_t signalOffset;
  uint64_t value;
};

// Local actions: the counter counts the put once its source may be reused.
struct ncclGin_CounterInc {
  ncclGinCounter_t counter;
};
struct ncclGin_WeakCounterInc {
  ncclGinCounter_t counter;
};

// Descriptor space in shared memory: accepted and unused (gin builds its
// descriptors in registers).
struct ncclGinDescriptorSmem;
struct ncclGin_DescriptorSmem {
  ncclGinDescriptorSmem* descriptor;
};

// What backs a buffer: gin windows are device memory.
struct ncclGin_SegmentDevice {};
struct ncclGin_SegmentMixed {};
struct ncclGin_SegmentHostNuma {};

enum ncclGinOptFlags {
  ncclGinOptFlagsDefault = 0,
  ncclGinOptFlagsMaySkipCreditCheck = (1 << 0),
  ncclGinOptFlagsAggregateRequests = (1 << 1),
};

enum ncclGinResourceSharingMode : uint8_t {
  NCCL_GIN_RESOURCE_SHARING_GPU = 0,
  NCCL_GIN_RESOURCE_SHARING_CTA = 1,
  NCCL_GIN_RESOURCE_SHARING_THREAD = 2,
};

// Symmetric pointers: refused (address windows by (window, offset)).
template <typename T>
struct ncclSymPtr {
  static_assert(gin::nccl_compat::never<T>::value,
                "gin-rs nccl_compat: ncclSymPtr is not supported: pass (ncclWindow_t, offset) pairs");
};

namespace gin {
namespace nccl_compat {
// The gin remote action of an NCCL one.
template <class A>
GIN_DEV Remote remote(const DevComm&, A) {
  static_assert(never<A>::value,
                "gin-rs nccl_compat: not a remote action: use ncclGin_None, "
                "ncclGin_{Strong,Weak,}Signal{Inc,Add} or ncclGin_{Strong,Weak,}VASignal{Inc,Add}");
  return no_signal();
}
// VA signals keep the address of the action's window: the action must
// outlive the call, as it does when passed to it.
GIN_DEV Remote remote(const DevComm&, const ncclGin_StrongVASignalInc& a) {
  return va_signal_inc(a.signalWindow, a.signalOffset);
}
GIN_DEV Remote remote(const DevComm&, const ncclGin_WeakVASignalInc& a) {
  return va_signal_inc_weak(a.signalWindow, a.signalOffset);
}
GIN_DEV Remote remote(const DevComm& dc, const ncclGin_VASignalInc& a) {
  return (dc.flags & FLAG_STRONG_SIGNALS) ? va_signal_inc(a.signalWindow, a.signalOffset)
                                          : va_signal_inc_weak(a.signalWindow, a.signalOffset);
}
GIN_DEV Remote remote(const DevComm&, const ncclGin_StrongVASignalAdd& a) {
  return va_signal_add(a.signalWindow, a.signalOffset, a.value);
}
GIN_DEV Remote remote(const DevComm&, const ncclGin_WeakVASignalAdd& a) {
  return va_signal_add_weak(a.signalWindow, a.signalOffset, a.value);
}
GIN_DEV Remote remote(const DevComm& dc, const ncclGin_VASignalAdd& a) {
  return (dc.flags & FLAG_STRONG_SIGNALS)
             ? va_signal_add(a.signalWindow, a.signalOffset, a.value)
             : va_signal_add_weak(a.signalWindow, a.signalOffset, a.value);
}
GIN_DEV Remote remote(const DevComm&, ncclGin_None) { return no_signal(); }
GIN_DEV Remote remote(const DevComm&, ncclGin_StrongSignalInc a) { return signal_inc(a.signal); }
GIN_DEV Remote remote(const DevComm&, ncclGin_WeakSignalInc a) { return signal_inc_weak(a.signal); }
GIN_DEV Remote remote(const DevComm& dc, ncclGin_SignalInc a) {
  return (dc.flags & FLAG_STRONG_SIGNALS) ? signal_inc(a.signal) : signal_inc_weak(a.signal);
}
GIN_DEV Remote remote(const DevComm&, ncclGin_StrongSignalAdd a) {
  return signal_add(a.signal, a.value);
}
GIN_DEV Remote remote(const DevComm&, ncclGin_WeakSignalAdd a) {
  return signal_add_weak(a.signal, a.value);
}
GIN_DEV Remote remote(const DevComm& dc, ncclGin_SignalAdd a) {
  return (dc.flags & FLAG_STRONG_SIGNALS) ? signal_add(a.signal, a.value)
                                          : signal_add_weak(a.signal, a.value);
}

// The gin local action of an NCCL one.
template <class A>
GIN_DEV LocalAction local(A) {
  static_assert(never<A>::value,
                "gin-rs nccl_compat: not a local action: use ncclGin_None or "
                "ncclGin_{Weak,}CounterInc");
  return no_counter();
}
GIN_DEV LocalAction local(ncclGin_None) { return no_counter(); }
GIN_DEV LocalAction local(ncclGin_CounterInc a) { return counter_inc(a.counter); }
GIN_DEV LocalAction local(ncclGin_WeakCounterInc a) { return counter_inc(a.counter); }

template <class D>
struct descriptor_ok {
  static_assert(never<D>::value,
                "gin-rs nccl_compat: the descriptor argument takes ncclGin_None or "
                "ncclGin_DescriptorSmem");
};
template <>
struct descriptor_ok<ncclGin_None> {};
template <>
struct descriptor_ok<ncclGin_DescriptorSmem> {};

template <class S>
struct segment_ok {
  static_assert(never<S>::value,
                "gin-rs nccl_compat: host-memory segments (ncclGin_SegmentMixed/HostNuma) are not "
                "supported: gin windows are device memory");
};
template <>
struct segment_ok<ncclGin_SegmentDevice> {};

// The mask of the low `bits` bits (1 to 64).
GIN_DEV u64 low_bits(int bits) { return ~0ull >> (64 - bits); }

// The full-width target that makes a wait for `least` on the low `bits`
// bits (NCCL's rolling compare) a wait in gin's own width, given the
// current full value `now` (signals and counters only grow between resets).
// Returns false when `least` is already reached.
GIN_DEV bool widen(u64 now, u64 least, int bits, u64* target) {
  const u64 m = low_bits(bits);
  if (((now - least) & m) <= (m >> 1)) return false;
  *target = now + ((least - now) & m);
  return true;
}
} // namespace nccl_compat
} // namespace gin

// -------------------------------------------------------------------- ncclGin

// One GIN context of a device communicator, as NCCL's ncclGin. Every call is
// gin's call of the same name on context `contextId`.
struct ncclGin {
  const ncclDevComm& comm;
  uint32_t contextId;
  ncclGinResourceSharingMode resourceSharingMode;

  // The context's sharing is the host's choice (CtxSharing when the device
  // communicator is created). Asking here for more sharing than the host
  // set up (e.g. GPU-wide use of a context made for one block) is recorded
  // as UNSUPPORTED: its queues would be reserved without the atomics that
  // use needs.
  GIN_DEV ncclGin(const ncclDevComm& c, int contextIndex,
                  ncclGinResourceSharingMode mode = NCCL_GIN_RESOURCE_SHARING_GPU)
      : comm(c), contextId((uint32_t)contextIndex), resourceSharingMode(mode) {
    const gin::DevComm& d = dc();
    const bool host_thread = (d.flags & gin::FLAG_EXCLUSIVE_CTX) != 0;
    const bool host_cta = (d.flags & gin::FLAG_CTA_CTX) != 0;
    const bool too_wide = (mode == NCCL_GIN_RESOURCE_SHARING_GPU && (host_thread || host_cta)) ||
                          (mode == NCCL_GIN_RESOURCE_SHARING_CTA && host_thread);
    if (too_wide) gin::nccl_compat::refuse(d, gin::UNSUPPORTED, contextId, (gin::u32)mode);
  }

  GIN_DEV const gin::DevComm& dc() const { return gin::nccl_compat::dev(comm); }
  // Whether signal or counter `id` (of `count`) of this context may be
  // read (gin's reads do not check; its waits do); records the error if not.
  GIN_DEV bool readable(gin::u32 id, gin::u32 count, gin::u32 bad_id) const {
    if (contextId >= dc().nctx) {
      gin::nccl_compat::refuse(dc(), gin::BAD_CONTEXT, contextId, contextId);
      return false;
    }
    if (id >= count) {
      gin::nccl_compat::refuse(dc(), bad_id, contextId, id);
      return false;
    }
    return true;
  }
  GIN_DEV gin::u32 world(ncclTeam team, int peer) const {
    return (gin::u32)ncclTeamRankToWorld(comm, team, peer);
  }

  // Puts `bytes` from this rank's part of `srcWnd` to `peer`'s part of
  // `dstWnd`, then the remote action at the peer and the local one here.
  // Scopes and option flags are accepted: gin's puts release everything the
  // calling coop wrote or observed, at system scope.
  template <typename RemoteAction = ncclGin_None, typename LocalAction = ncclGin_None,
            typename Coop = ncclCoopThread, typename DescriptorSmem = ncclGin_None,
            typename SegmentType = ncclGin_SegmentDevice>
  GIN_DEV void put(ncclTeam team, int peer, const ncclWindow_t& dstWnd, size_t dstOffset,
                   const ncclWindow_t& srcWnd, size_t srcOffset, size_t bytes,
                   RemoteAction remoteAction = ncclGin_None{}, LocalAction localAction = ncclGin_None{},
                   Coop = ncclCoopThread{}, DescriptorSmem = ncclGin_None{},
                   cuda::thread_scope = cuda::thread_scope_thread,
                   cuda::thread_scope = cuda::thread_scope_device,
                   uint32_t = ncclGinOptFlagsDefault, SegmentType = ncclGin_SegmentDevice{}) const {
    (void)gin::nccl_compat::descriptor_ok<DescriptorSmem>{};
    (void)gin::nccl_compat::segment_ok<SegmentType>{};
    gin::put(dc(), contextId, world(team, peer), dstWnd, dstOffset, srcWnd, srcOffset, bytes,
             gin::nccl_compat::remote(dc(), remoteAction), gin::nccl_compat::local(localAction),
             gin::nccl_compat::coop_of<Coop>::value);
  }

  // Puts `value` (its 1, 2, 4 or 8 bytes) at `dstOffset` (a multiple of its
  // size): gin's put_value_of. Sizes below 8 on a queue path of CUDA ranks
  // fail at run time with COPY_ENGINE (the copy engine stores 8 bytes).
  template <typename T, typename RemoteAction = ncclGin_None, typename Coop = ncclCoopThread,
            typename DescriptorSmem = ncclGin_None>
  GIN_DEV void putValue(ncclTeam team, int peer, const ncclWindow_t& dstWnd, size_t dstOffset,
                        T value, RemoteAction remoteAction = ncclGin_None{}, Coop = ncclCoopThread{},
                        DescriptorSmem = ncclGin_None{},
                        cuda::thread_scope = cuda::thread_scope_thread,
                        cuda::thread_scope = cuda::thread_scope_device,
                        uint32_t = ncclGinOptFlagsDefault) const {
    static_assert(sizeof(T) == 1 || sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8,
                  "gin-rs nccl_compat: putValue takes a value of 1, 2, 4 or 8 bytes; put a "
                  "larger one from a window");
    (void)gin::nccl_compat::descriptor_ok<DescriptorSmem>{};
    gin::put_value_of(dc(), contextId, world(team, peer), dstWnd, dstOffset, value,
                      gin::nccl_compat::remote(dc(), remoteAction),
                      gin::nccl_compat::coop_of<Coop>::value);
  }

  // The remote action alone, ordered after earlier puts of the context to
  // `peer` as the action's strength says.
  template <typename RemoteAction, typename Coop = ncclCoopThread,
            typename DescriptorSmem = ncclGin_None>
  GIN_DEV void signal(ncclTeam team, int peer, RemoteAction remoteAction, Coop = ncclCoopThread(),
                      DescriptorSmem = ncclGin_None{},
                      cuda::thread_scope = cuda::thread_scope_thread,
                      cuda::thread_scope = cuda::thread_scope_device,
                      uint32_t = ncclGinOptFlagsDefault) const {
    (void)gin::nccl_compat::descriptor_ok<DescriptorSmem>{};
    gin::signal(dc(), contextId, world(team, peer), gin::nccl_compat::remote(dc(), remoteAction),
                gin::nccl_compat::coop_of<Coop>::value);
  }

  // Reads `bytes` from `peer`'s part of `remoteWnd` into this rank's part of
  // `localWnd`; landed after the next flush.
  template <typename Coop = ncclCoopThread, typename DescriptorSmem = ncclGin_None,
            typename SegmentType = ncclGin_SegmentDevice>
  GIN_DEV void get(ncclTeam team, int peer, const ncclWindow_t& remoteWnd, size_t remoteOffset,
                   const ncclWindow_t& localWnd, size_t localOffset, size_t bytes,
                   Coop = ncclCoopThread{}, DescriptorSmem = ncclGin_None{},
                   uint32_t = ncclGinOptFlagsDefault,
                   SegmentType = ncclGin_SegmentDevice{}) const {
    (void)gin::nccl_compat::descriptor_ok<DescriptorSmem>{};
    (void)gin::nccl_compat::segment_ok<SegmentType>{};
    gin::get(dc(), contextId, world(team, peer), remoteWnd, remoteOffset, localWnd, localOffset,
             bytes, gin::nccl_compat::coop_of<Coop>::value);
  }

  // Every operation of the context has completed locally: sources may be
  // reused, gets have landed. Not remote completion.
  template <typename Coop, typename DescriptorSmem = ncclGin_None>
  GIN_DEV void flush(Coop, cuda::memory_order = cuda::memory_order_acquire,
                     DescriptorSmem = ncclGin_None{}) const {
    (void)gin::nccl_compat::descriptor_ok<DescriptorSmem>{};
    gin::flush(dc(), contextId, gin::nccl_compat::coop_of<Coop>::value);
  }

  // NCCL 2.30's split flush: gin's flush_async and wait. The request holds
  // gin::Request's marks: opaque[0] the main one, opaque[1] the companion
  // queue's (low 48 bits; GDAKI compares only its low 16) and the peer + 1
  // in its top 16 bits (0: nothing to wait for).
  template <typename Coop = ncclCoopThread, typename DescriptorSmem = ncclGin_None>
  GIN_DEV void flushAsync(ncclTeam team, uint32_t peer, ncclGinRequest_t* outRequest,
                          Coop = ncclCoopThread{}, uint32_t = ncclGinOptFlagsDefault,
                          DescriptorSmem = ncclGin_None{}) const {
    (void)gin::nccl_compat::descriptor_ok<DescriptorSmem>{};
    gin::Request r;
    gin::flush_async(dc(), contextId, world(team, (int)peer), &r,
                     gin::nccl_compat::coop_of<Coop>::value);
    const gin::u64 tag = r.peer == gin::NO_PEER ? 0 : (gin::u64)(r.peer + 1) << 48;
    outRequest->opaque[0] = r.main;
    outRequest->opaque[1] = (r.aux & ((1ull << 48) - 1)) | tag;
  }
  template <typename Coop = ncclCoopThread, typename DescriptorSmem = ncclGin_None>
  GIN_DEV void wait(ncclGinRequest_t& request, Coop = ncclCoopThread{},
                    DescriptorSmem = ncclGin_None{},
                    cuda::memory_order = cuda::memory_order_acquire) const {
    (void)gin::nccl_compat::descriptor_ok<DescriptorSmem>{};
    const gin::u64 tag = request.opaque[1] >> 48;
    const gin::Request r{request.opaque[0], request.opaque[1] & ((1ull << 48) - 1),
                         tag ? (gin::u32)(tag - 1) : gin::NO_PEER, contextId};
    gin::wait(dc(), contextId, r, gin::nccl_compat::coop_of<Coop>::value);
  }

  // Counters: 56 bits in gin as in NCCL; `bits` narrows the compare.
  GIN_DEV uint64_t readCounter(ncclGinCounter_t counter, int bits = 56,
                               cuda::memory_order ord = cuda::memory_order_acquire) const {
    if (bits < 1 || bits > 56) {
      gin::nccl_compat::refuse(dc(), gin::UNSUPPORTED, contextId, (gin::u32)bits);
      bits = 56;
    }
    if (!readable(counter, dc().ncounters, gin::BAD_COUNTER)) return 0;
    const gin::u64 v = gin::read_counter(dc(), contextId, counter);
    if (ord != cuda::memory_order_relaxed) __threadfence_system();
    return v & gin::nccl_compat::low_bits(bits);
  }
  template <typename Coop>
  GIN_DEV void waitCounter(Coop, ncclGinCounter_t counter, uint64_t least, int bits = 56,
                           cuda::memory_order = cuda::memory_order_acquire) const {
    constexpr gin::Coop c = gin::nccl_compat::coop_of<Coop>::value;
    if (bits < 1 || bits > 56) {
      gin::nccl_compat::refuse(dc(), gin::UNSUPPORTED, contextId, (gin::u32)bits);
      return;
    }
    gin::u64 target = least;
    if (bits < 56 && readable(counter, dc().ncounters, gin::BAD_COUNTER)) {
      const gin::u64 now = gin::read_counter(dc(), contextId, counter);
      if (!gin::nccl_compat::widen(now, least, bits, &target)) target = now;
    }
    gin::wait_counter(dc(), contextId, counter, target, c);
  }

  // Signals: 64 bits; `bits` narrows the value read and the compare.
  GIN_DEV uint64_t readSignal(ncclGinSignal_t signal, int bits = 64,
                              cuda::memory_order ord = cuda::memory_order_acquire) const {
    if (bits < 1 || bits > 64) {
      gin::nccl_compat::refuse(dc(), gin::UNSUPPORTED, contextId, (gin::u32)bits);
      bits = 64;
    }
    if (!readable(signal, dc().nsignals, gin::BAD_SIGNAL)) return 0;
    const gin::u64 v = gin::read_signal(dc(), contextId, signal);
    // A relaxed read followed by a fence: what the signal announced is
    // visible afterwards, as NCCL's acquire read promises.
    if (ord != cuda::memory_order_relaxed) __threadfence_system();
    return v & gin::nccl_compat::low_bits(bits);
  }
  template <typename Coop>
  GIN_DEV void waitSignal(Coop, ncclGinSignal_t signal, uint64_t least, int bits = 64,
                          cuda::memory_order = cuda::memory_order_acquire) const {
    constexpr gin::Coop c = gin::nccl_compat::coop_of<Coop>::value;
    if (bits < 1 || bits > 64) {
      gin::nccl_compat::refuse(dc(), gin::UNSUPPORTED, contextId, (gin::u32)bits);
      return;
    }
    gin::u64 target = least;
    if (bits < 64 && readable(signal, dc().nsignals, gin::BAD_SIGNAL)) {
      const gin::u64 now = gin::read_signal(dc(), contextId, signal);
      if (!gin::nccl_compat::widen(now, least, bits, &target)) target = now;
    }
    gin::wait_signal(dc(), contextId, signal, target, c);
  }

  // Back to zero; no update to it may be in flight (as NCCL requires).
  // Call from one thread.
  GIN_DEV void resetCounter(ncclGinCounter_t counter) const {
    gin::reset_counter(dc(), contextId, counter);
  }
  GIN_DEV void resetSignal(ncclGinSignal_t signal) const {
    gin::reset_signal(dc(), contextId, signal);
  }

  // ---- refused

  // VA signals: the 8-byte word at `signalOffset` of this rank's part of
  // `signalWindow` (gin's read_va_signal, wait_va_signal, reset_va_signal).
  GIN_DEV uint64_t readSignal(const ncclWindow_t& signalWindow, size_t signalOffset, int bits = 64,
                              cuda::memory_order ord = cuda::memory_order_acquire) const {
    if (bits < 1 || bits > 64) {
      gin::nccl_compat::refuse(dc(), gin::UNSUPPORTED, contextId, (gin::u32)bits);
      bits = 64;
    }
    const gin::u64 v = gin::read_va_signal(dc(), contextId, signalWindow, signalOffset);
    if (ord != cuda::memory_order_relaxed) __threadfence_system();
    return v & gin::nccl_compat::low_bits(bits);
  }
  template <typename Coop>
  GIN_DEV void waitSignal(Coop, const ncclWindow_t& signalWindow, size_t signalOffset,
                          uint64_t least, int bits = 64,
                          cuda::memory_order = cuda::memory_order_acquire) const {
    constexpr gin::Coop c = gin::nccl_compat::coop_of<Coop>::value;
    if (bits < 1 || bits > 64) {
      gin::nccl_compat::refuse(dc(), gin::UNSUPPORTED, contextId, (gin::u32)bits);
      return;
    }
    gin::u64 target = least;
    if (bits < 64) {
      const gin::u64 now = gin::read_va_signal(dc(), contextId, signalWindow, signalOffset);
      if (!gin::nccl_compat::widen(now, least, bits, &target)) target = now;
    }
    gin::wait_va_signal(dc(), contextId, signalWindow, signalOffset, target, c);
  }
  GIN_DEV void resetSignal(const ncclWindow_t& signalWindow, size_t signalOffset) const {
    gin::reset_va_signal(dc(), contextId, signalWindow, signalOffset);
  }

  // ---- refused

  template <typename S>
  GIN_DEV uint64_t* getSignalShadowPtr(S) const {
    static_assert(gin::nccl_compat::never<S>::value,
                  "gin-rs nccl_compat: signal shadows are not supported: keep the value you expect "
                  "in your own memory and pass it to waitSignal");
    return nullptr;
  }
  template <typename S, typename D>
  GIN_DEV void increaseSignalShadow(S, D) const {
    static_assert(gin::nccl_compat::never<S>::value,
                  "gin-rs nccl_compat: signal shadows are not supported: keep the value you expect "
                  "in your own memory and pass it to waitSignal");
  }
  template <typename Coop, typename... Rest>
  GIN_DEV void waitSignalMeetShadow(Coop, Rest...) const {
    static_assert(gin::nccl_compat::never<Coop>::value,
                  "gin-rs nccl_compat: signal shadows are not supported: keep the value you expect "
                  "in your own memory and pass it to waitSignal");
  }
  template <typename Coop, typename... Rest>
  GIN_DEV void waitSignalFollowShadow(Coop, Rest...) const {
    static_assert(gin::nccl_compat::never<Coop>::value,
                  "gin-rs nccl_compat: signal shadows are not supported: keep the value you expect "
                  "in your own memory and pass it to waitSignal");
  }
};

// This rank's part of `w`, at `offset`.
GIN_DEV void* ncclGetLocalPointer(const ncclWindow_t& w, size_t offset) {
  return (void*)(w.local_base + offset);
}

// ---------------------------------------------------------------- barriers

enum class ncclGinFenceLevel : uint32_t {
  None = 0,
  Put = 1u << 0,
  Get = 1u << 1,
  Relaxed = 0,
};
GIN_HD constexpr ncclGinFenceLevel operator|(ncclGinFenceLevel a, ncclGinFenceLevel b) {
  return (ncclGinFenceLevel)((uint32_t)a | (uint32_t)b);
}
GIN_HD constexpr ncclGinFenceLevel operator&(ncclGinFenceLevel a, ncclGinFenceLevel b) {
  return (ncclGinFenceLevel)((uint32_t)a & (uint32_t)b);
}

// In place of an ncclGin: the barrier signals on context 0 and first
// completes every context's operations.
struct ncclGinAllContexts {
  const ncclDevComm& comm;
  GIN_HD constexpr ncclGinAllContexts(const ncclDevComm& c) : comm(c) {}
};

// A handle of a barrier over a custom team: refused when used.
struct ncclGinBarrierHandle {
  uint32_t opaque;
};
typedef ncclGinBarrierHandle ncclGinBarrierHandle_t;

// A world or rail barrier, gin's barrier(index) or rail_barrier(index).
// The fence level maps onto gin's fences: None (or Relaxed) is FENCE_NONE
// (synchronisation only), Put and/or Get is FENCE_CONTEXT (the context's
// operations complete, strong signals), or FENCE_ALL_CONTEXTS with
// ncclGinAllContexts. Every memory order is honoured (gin's barrier
// releases before and acquires after). The timeout overload of sync is
// gin's barrier_for, with NCCL's cycles read as nanoseconds (the SM clock
// runs at 1 to 2 GHz: at least the wait asked for, at most twice it).
template <typename Coop>
struct ncclGinBarrierSession {
  const ncclDevComm& comm;
  uint32_t ctx;
  uint32_t index;
  bool rail;
  bool allContexts;

  GIN_DEV ncclGinBarrierSession(Coop, ncclGin net, ncclTeamTagWorld, uint32_t i)
      : comm(net.comm), ctx(net.contextId), index(i), rail(false), allContexts(false) {}
  GIN_DEV ncclGinBarrierSession(Coop, ncclGin net, ncclTeamTagRail, uint32_t i)
      : comm(net.comm), ctx(net.contextId), index(i), rail(true), allContexts(false) {}
  GIN_DEV ncclGinBarrierSession(Coop, ncclGinAllContexts a, ncclTeamTagWorld, uint32_t i)
      : comm(a.comm), ctx(0), index(i), rail(false), allContexts(true) {}
  GIN_DEV ncclGinBarrierSession(Coop, ncclGinAllContexts a, ncclTeamTagRail, uint32_t i)
      : comm(a.comm), ctx(0), index(i), rail(true), allContexts(true) {}
  // Refused: gin's barriers are over the world or the rail only.
  template <typename Net, typename Handle>
  GIN_DEV ncclGinBarrierSession(Coop, Net net, ncclTeam, Handle, uint32_t i)
      : comm(net.comm), ctx(0), index(i), rail(false), allContexts(false) {
    static_assert(gin::nccl_compat::never<Handle>::value,
                  "gin-rs nccl_compat: barriers over a team and handle are not supported: gin has "
                  "world and rail barriers only; pass ncclTeamTagWorld() or ncclTeamTagRail() and "
                  "an index below the world_barriers / rail_barriers the host requested");
  }
  ncclGinBarrierSession(const ncclGinBarrierSession&) = delete;

  GIN_DEV gin::Fence fence_of(ncclGinFenceLevel f) const {
    if (f == ncclGinFenceLevel::None) return gin::FENCE_NONE;
    return allContexts ? gin::FENCE_ALL_CONTEXTS : gin::FENCE_CONTEXT;
  }
  GIN_DEV void sync(Coop, cuda::memory_order,
                    ncclGinFenceLevel fence = ncclGinFenceLevel::Put | ncclGinFenceLevel::Get) {
    constexpr gin::Coop c = gin::nccl_compat::coop_of<Coop>::value;
    const gin::DevComm& d = gin::nccl_compat::dev(comm);
    if (rail) gin::rail_barrier(d, ctx, index, c, fence_of(fence));
    else gin::barrier(d, ctx, index, c, fence_of(fence));
  }
  // With a timeout: ncclTimeout when it ran out (not recorded as an error:
  // the barrier's slot is then out of step, do not use it again), another
  // error for other failures (recorded), else ncclSuccess.
  GIN_DEV ncclResult_t sync(Coop, cuda::memory_order, ncclGinFenceLevel fence,
                            uint64_t timeoutCycles) {
    constexpr gin::Coop c = gin::nccl_compat::coop_of<Coop>::value;
    const gin::DevComm& d = gin::nccl_compat::dev(comm);
    const int e = rail ? gin::rail_barrier_for(d, ctx, index, timeoutCycles, c, fence_of(fence))
                       : gin::barrier_for(d, ctx, index, timeoutCycles, c, fence_of(fence));
    if (e == gin::BARRIER_TIMEOUT) return ncclTimeout;
    return e ? ncclInvalidUsage : ncclSuccess;
  }
};

// One barrier, without a session object (NCCL 2.30).
template <typename Coop, typename Net, typename Tag>
GIN_DEV void ncclGinBarrier(Coop coop, Net net, Tag tag, uint32_t index,
                            cuda::memory_order ord = cuda::memory_order_acq_rel,
                            ncclGinFenceLevel fence = ncclGinFenceLevel::Put |
                                                      ncclGinFenceLevel::Get) {
  ncclGinBarrierSession<Coop> bar{coop, net, tag, index};
  bar.sync(coop, ord, fence);
}

#endif // __CUDACC__
