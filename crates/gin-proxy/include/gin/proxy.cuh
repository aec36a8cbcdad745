// gin-rs proxy backend, device side: the 64-byte descriptor (layout in
// gin-proxy's descriptor.rs and docs/proxy.md) and the producer half of a
// descriptor ring. The encoder is host/device code so a host C++ test checks
// it against the Rust golden vectors.
#pragma once
#include "gin/abi.cuh"

namespace gin {
namespace proxy {

constexpr u64 PHASE = 1ull << 63;
constexpr u64 LOW63 = PHASE - 1;
constexpr u64 MAX_ID = (1ull << 31) - 1;
constexpr u64 MAX_BYTES = (1ull << 48) - 1;

constexpr u32 OP_PUT = 1;
constexpr u32 OP_GET = 2;

constexpr u64 F_SIGNAL = 0x01;
constexpr u64 F_STRONG = 0x02;
constexpr u64 F_COUNTER = 0x04;
constexpr u64 F_INLINE = 0x08;
constexpr u64 F_INLINE_TOP = 0x10;
constexpr u64 F_SIGNAL_TOP = 0x20; // bit 63 of the signal amount (signals are 64-bit)

struct Desc {
  u32 op;
  u32 dst_window; // put: destination window at the peer; get: remote window
  u32 src_window; // put: source window here; get: local destination window
  u32 counter;    // counter slot (with has_counter)
  u64 bytes;
  u64 dst_offset;
  u64 src_offset;
  u64 inline_value;
  u64 sig_offset;
  u64 sig_add;
  u32 sig_window;
  u8 has_inline;
  u8 has_signal;
  u8 sig_strong;
  u8 has_counter;
};

// The phase bit ring position `seq` carries in a ring of 2^log2 slots: 1 on
// the first lap, so zeroed memory never reads as a descriptor.
GIN_HD u64 phase_of(u64 seq, u32 log2) { return ((seq >> log2) & 1) ^ 1; }

// The eight qwords of `d` at ring position `seq` (phase bits included).
GIN_HD void encode(const Desc& d, u64 seq, u32 log2, u64 q[8]) {
  u64 flags = 0;
  u64 q3 = d.src_offset & LOW63;
  if (d.has_inline) {
    flags |= F_INLINE;
    if (d.inline_value & PHASE) flags |= F_INLINE_TOP;
    q3 = d.inline_value & LOW63;
  }
  u64 q4 = 0, q5 = 0, q6 = 0;
  if (d.has_signal) {
    flags |= F_SIGNAL;
    if (d.sig_strong) flags |= F_STRONG;
    q4 |= (u64)d.sig_window & MAX_ID;
    q5 = d.sig_offset & LOW63;
    if (d.sig_add & PHASE) flags |= F_SIGNAL_TOP;
    q6 = d.sig_add & LOW63;
  }
  if (d.has_counter) {
    flags |= F_COUNTER;
    q4 |= ((u64)d.counter & MAX_ID) << 31;
  }
  u64 p = phase_of(seq, log2) << 63;
  q[0] = ((u64)d.op << 59) | (flags << 48) | (d.bytes & MAX_BYTES) | p;
  q[1] = (((u64)d.src_window & MAX_ID) << 31) | ((u64)d.dst_window & MAX_ID) | p;
  q[2] = (d.dst_offset & LOW63) | p;
  q[3] = q3 | p;
  q[4] = q4 | p;
  q[5] = q5 | p;
  q[6] = q6 | p;
  q[7] = (seq & LOW63) | p;
}

// Credit: the producer of `seq` may write once the slot's previous occupant
// is done (`seq - done < size`, wrapping).
GIN_HD bool has_credit(u64 seq, u64 done, u64 size) { return seq - done < size; }

#if defined(__CUDACC__)
GIN_DEV u64 globaltimer() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

GIN_DEV u64 ld_acquire_gpu(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Reserves a ring position: a fetch-add on the producer index (plain for an
// exclusive context, block scope for a block's context, device scope else).
GIN_DEV u64 reserve(const ProxyRingAbi& r, u32 flags) {
  u64* head = (u64*)r.head;
  if (flags & FLAG_EXCLUSIVE_CTX) {
    u64 s = *(volatile u64*)head;
    *(volatile u64*)head = s + 1;
    return s;
  }
  if (flags & FLAG_CTA_CTX) return atomicAdd_block((unsigned long long*)head, 1ull);
  return atomicAdd((unsigned long long*)head, 1ull);
}

// The completion index as last stored, with no ordering: credit only says
// the proxy has finished reading a slot (it stores the index after), and
// nothing the proxy wrote is read on the strength of it.
GIN_DEV u64 ld_relaxed_gpu(const u64* p) {
  u64 v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Writes descriptor `d` at position `seq` once there is credit. `done_seen`
// is any earlier reading of the completion index (it only grows), so the
// caller can read it alongside its reservation rather than after it.
// Returns false when `give_up` says so (timeout or abort) before credit came.
template <class GiveUp>
GIN_DEV bool publish(const ProxyRingAbi& r, u64 seq, u64 done_seen, const Desc& d, GiveUp give_up) {
  const u64 size = 1ull << r.log2;
  if (!has_credit(seq, done_seen, size)) {
    // Back off: when the ring is full, every producing block of the GPU
    // would otherwise hammer the one line that holds the completion index.
    const u64* done = (const u64*)r.done;
    u32 pause = 32;
    for (u32 spin = 0; !has_credit(seq, ld_relaxed_gpu(done), size); ++spin) {
      __nanosleep(pause);
      if (pause < 2048) pause *= 2;
      if ((spin & 15) == 15 && give_up()) return false;
    }
  }
  u64 q[8];
  encode(d, seq, r.log2, q);
  // Every qword carries the phase bit, so the order in which these stores
  // reach host memory does not matter: the proxy reads a slot only once all
  // eight show this lap's phase.
  // Four 16-byte stores rather than eight: fewer PCIe writes (the host may
  // see each torn into qwords, which the phase bits allow).
  u64* slot = (u64*)(r.slots + (seq & (size - 1)) * 64);
#pragma unroll
  for (int i = 0; i < 8; i += 2)
    asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(slot + i), "l"(q[i]), "l"(q[i + 1])
                 : "memory");
  return true;
}
#endif

} // namespace proxy
} // namespace gin
