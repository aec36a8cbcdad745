// gin-rs GDAKI backend, device side: mlx5 send WQEs, one 64-byte basic block
// each, big-endian (layouts in gin-gdaki's wqe.rs and docs/gdaki.md; facts
// from rdma-core's mlx5dv.h). Host/device code: a host C++ test checks the
// bytes against the Rust golden vectors.
#pragma once
#include "gin/abi.cuh"

namespace gin {
namespace gdaki {

constexpr u32 BB = 64;
constexpr u8 OP_NOP = 0x00;
constexpr u8 OP_RDMA_WRITE = 0x08;
constexpr u8 OP_WAIT = 0x0f;
constexpr u8 OP_RDMA_READ = 0x10;
constexpr u8 OP_ATOMIC_CS = 0x11;
constexpr u8 OP_ATOMIC_FA = 0x12;
constexpr u8 CQ_UPDATE = 2 << 2;
constexpr u8 FM_STRONG_ORDERING = 3 << 5;
constexpr u32 INLINE_SEG = 0x80000000u;
constexpr u32 MAX_INLINE = 28;

GIN_HD void put32(u8* b, u32 at, u32 v) {
  b[at] = (u8)(v >> 24);
  b[at + 1] = (u8)(v >> 16);
  b[at + 2] = (u8)(v >> 8);
  b[at + 3] = (u8)v;
}
GIN_HD void put64(u8* b, u32 at, u64 v) {
  put32(b, at, (u32)(v >> 32));
  put32(b, at + 4, (u32)v);
}
GIN_HD void clear(u8* b) {
  for (u32 i = 0; i < BB; ++i) b[i] = 0;
}
GIN_HD void ctrl(u8* b, u16 index, u8 opcode, u32 qpn, u8 ds, u8 fm_ce_se) {
  put32(b, 0, ((u32)index << 8) | opcode);
  put32(b, 4, (qpn << 8) | ds);
  b[11] = fm_ce_se;
}
GIN_HD void raddr(u8* b, u64 addr, u32 rkey) {
  put64(b, 16, addr);
  put32(b, 24, rkey);
}
GIN_HD void dseg(u8* b, u32 at, u64 addr, u32 lkey, u32 len) {
  put32(b, at, len & ~INLINE_SEG);
  put32(b, at + 4, lkey);
  put64(b, at + 8, addr);
}

// RDMA write (or read) of `len` bytes between local (laddr, lkey) and
// remote (raddr, rkey). `len` must not exceed 1 GiB (bit 31 is the inline flag).
GIN_HD void write(u8* b, u16 index, u32 qpn, u8 fm_ce_se, u64 ra, u32 rkey, u64 la, u32 lkey,
                  u32 len, bool read = false) {
  clear(b);
  raddr(b, ra, rkey);
  dseg(b, 32, la, lkey, len);
  ctrl(b, index, read ? OP_RDMA_READ : OP_RDMA_WRITE, qpn, 3, fm_ce_se);
}

// RDMA write of up to MAX_INLINE bytes carried in the WQE.
GIN_HD void write_inline(u8* b, u16 index, u32 qpn, u8 fm_ce_se, u64 ra, u32 rkey,
                         const u8* data, u32 n) {
  clear(b);
  raddr(b, ra, rkey);
  put32(b, 32, n | INLINE_SEG);
  for (u32 i = 0; i < n; ++i) b[36 + i] = data[i];
  ctrl(b, index, OP_RDMA_WRITE, qpn, (u8)(2 + (4 + n + 15) / 16), fm_ce_se);
}

// As write_inline with the data the low `n` (1 to 8) bytes of `value`,
// little-endian as in memory. No address is taken and every index is a
// constant, so the WQE being built stays in registers (a pointer to the
// value, or a loop over `n`, puts it on the stack); the bytes past `n` are
// zero, as write_inline leaves them.
GIN_HD void write_inline_value(u8* b, u16 index, u32 qpn, u8 fm_ce_se, u64 ra, u32 rkey,
                               u64 value, u32 n) {
  clear(b);
  raddr(b, ra, rkey);
  put32(b, 32, n | INLINE_SEG);
  if (n < 8) value &= (1ull << (8 * n)) - 1;
  for (u32 i = 0; i < 8; ++i) b[36 + i] = (u8)(value >> (8 * i));
  ctrl(b, index, OP_RDMA_WRITE, qpn, (u8)(2 + (4 + n + 15) / 16), fm_ce_se);
}

// 8-byte atomic fetch-add at (ra, rkey); the old value lands at (la, lkey).
GIN_HD void fetch_add(u8* b, u16 index, u32 qpn, u8 fm_ce_se, u64 ra, u32 rkey, u64 add, u64 la,
                      u32 lkey) {
  clear(b);
  raddr(b, ra, rkey);
  put64(b, 32, add);
  put64(b, 40, add);
  dseg(b, 48, la, lkey, 8);
  ctrl(b, index, OP_ATOMIC_FA, qpn, 4, fm_ce_se);
}

// 8-byte compare-and-swap at (ra, rkey).
GIN_HD void compare_swap(u8* b, u16 index, u32 qpn, u8 fm_ce_se, u64 ra, u32 rkey, u64 compare,
                         u64 swap, u64 la, u32 lkey) {
  clear(b);
  raddr(b, ra, rkey);
  put64(b, 32, swap);
  put64(b, 40, compare);
  dseg(b, 48, la, lkey, 8);
  ctrl(b, index, OP_ATOMIC_CS, qpn, 4, fm_ce_se);
}

// Stall the queue until CQ `cqn` has the CQE of WQE index `max_index`.
GIN_HD void wait(u8* b, u16 index, u32 qpn, u8 fm_ce_se, u32 max_index, u32 cqn) {
  clear(b);
  put32(b, 24, max_index);
  put32(b, 28, cqn);
  ctrl(b, index, OP_WAIT, qpn, 2, fm_ce_se);
}

GIN_HD void nop(u8* b, u16 index, u32 qpn, u8 fm_ce_se) {
  clear(b);
  ctrl(b, index, OP_NOP, qpn, 1, fm_ce_se);
}

// What the doorbell register receives: the first 8 bytes of a control
// segment naming the new producer index and the queue.
GIN_HD u64 doorbell(u16 pi, u32 qpn) {
  return ((u64)((u32)pi << 8) << 32) | (u64)(qpn << 8);
}

// The collapsed CQE's last qword (bytes 56..63 read as a little-endian
// u64): send opcode and QP number (BE32), WQE counter (BE16), signature,
// op_own (CQE opcode in bits 7:4). The syndrome is byte 55, the top byte of
// qword 6.
constexpr u32 CQE_REQ = 0;
constexpr u32 CQE_REQ_ERR = 13;
constexpr u32 CQE_INVALID = 15;
GIN_HD u32 cqe_opcode(u64 tail) { return (u32)(tail >> 60); }
GIN_HD u16 cqe_wqe_counter(u64 tail) {
  return (u16)((((tail >> 32) & 0xff) << 8) | ((tail >> 40) & 0xff));
}
// The 64-bit index a 16-bit WQE counter names, given an index `near` within
// 2^15 of it.
GIN_HD u64 unwrap16(u16 c, u64 near) {
  return near + (u64)(i64)(short)(u16)(c - (u16)near);
}

#if defined(__CUDACC__)
// How far a send queue has completed, as its collapsed CQE says.
struct Completion {
  u32 state;    // 0: WQE not completed yet, 1: completed, 2: error CQE
  u32 syndrome; // error CQEs
  u32 wqe;      // the CQE's WQE counter
};

GIN_DEV u64 ld_acquire_gpu64(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Whether WQE `idx` of `q` has completed. The NIC stores the CQE in stream
// order after the work it reports (data, signal, counter), so an acquire of
// it sees that work.
GIN_DEV Completion completed(const GdakiSqAbi& q, u64 idx) {
  const u64* cqe = (const u64*)q.cqe;
  const u64 tail = ld_acquire_gpu64(cqe + 7);
  const u32 op = cqe_opcode(tail);
  const u16 c = cqe_wqe_counter(tail);
  if (op == CQE_INVALID) return Completion{0, 0, 0};
  if (op != CQE_REQ) return Completion{2, (u32)(*(volatile const u64*)(cqe + 6) >> 56), c};
  return Completion{(i64)(unwrap16(c, idx) - idx) >= 0 ? 1u : 0u, 0, c};
}

GIN_DEV u32 bswap32(u32 v) { return __byte_perm(v, 0, 0x0123); }

// Producer of one send queue: reserve `k` WQE indices, wait for credit (the
// previous occupants of the slots completed), fill them with `build(i, b,
// index)`, then, in reservation order, post: doorbell record, doorbell, and
// the ready index for the next range. `flags` are the DevComm flags (sharing mode). Returns 0 and the
// last index, or 1 when `give_up` said so (timeout, abort), or 2 with `err`
// filled when the queue reported an error CQE.
template <class Build, class GiveUp>
GIN_DEV u32 submit(const GdakiSqAbi& q, u32 flags, u32 k, Build build, GiveUp give_up, u64* last,
                   Completion* err) {
  u64* resv = (u64*)q.indices;
  u64* ready = resv + 1;
  const bool excl = flags & FLAG_EXCLUSIVE_CTX;
  const bool cta = flags & FLAG_CTA_CTX;
  // The completion as it stands, read alongside the reservation: it only
  // grows, so an early reading is a safe lower bound for credit (the NIC
  // stores a CQE only after it has read the WQEs it reports).
  const u64 tail0 = *(volatile const u64*)(q.cqe + 56);
  // Likewise the ready index: if it already stands at our start, every
  // earlier range is posted and the wait below is skipped; the fence of
  // the doorbell record's release completes the acquire (a relaxed load
  // followed by a fence is an acquire pattern).
  const u64 ready0 = *(volatile const u64*)ready;
  u64 start;
  if (excl) {
    start = *(volatile u64*)resv;
    *(volatile u64*)resv = start + k;
  } else if (cta) {
    start = atomicAdd_block((unsigned long long*)resv, (unsigned long long)k);
  } else {
    start = atomicAdd((unsigned long long*)resv, (unsigned long long)k);
  }
  const u64 size = 1ull << q.log2;
  *last = start + k - 1;
  const u64 need = start + k - 1 - size;
  const bool early = cqe_opcode(tail0) == CQE_REQ &&
                     (i64)(unwrap16(cqe_wqe_counter(tail0), need) - need) >= 0;
  if (start + k > size && !early) {
    // Credit: the slot's previous occupant, WQE `last - size`, completed.
    u32 pause = 32;
    for (u32 spin = 0;; ++spin) {
      const Completion c = completed(q, need);
      if (c.state == 1) break;
      if (c.state == 2) {
        *err = c;
        return 2;
      }
      __nanosleep(pause);
      if (pause < 2048) pause *= 2;
      if ((spin & 15) == 15 && give_up()) return 1;
    }
  }
  for (u32 i = 0; i < k; ++i) {
    const u64 idx = start + i;
    __align__(16) u8 b[BB];
    build(i, b, (u16)idx);
    const u64* w = (const u64*)b;
    u64* slot = (u64*)(q.wqes + (idx & (size - 1)) * BB);
#pragma unroll
    for (int j = 0; j < 8; j += 2)
      asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(slot + j), "l"(w[j]),
                   "l"(w[j + 1])
                   : "memory");
  }
  // Mark ready and post, in reservation order: wait until every earlier
  // range is posted (`ready` reaches our start), store the doorbell record
  // with release at system scope (the NIC, having read it, sees our WQEs
  // and those of every producer posted before us), ring the doorbell, and
  // hand over to the next range with a GPU-scope release of `ready`.
  // Posting in order keeps the doorbell record monotone without a lock:
  // the next producer's store is ordered after ours.
  const u64 end = start + k;
  if (!excl && ready0 != start) {
    for (u32 spin = 0; ld_acquire_gpu64(ready) != start; ++spin) {
      // An earlier range is still being filled or posted.
      if ((spin & 255) == 255 && give_up()) return 1;
    }
  }
  const u32 rec = bswap32((u32)(end & 0xffff));
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(q.dbrec), "r"(rec) : "memory");
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(q.doorbell), "l"(doorbell((u16)end, q.qpn))
               : "memory");
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(ready), "l"(end) : "memory");
  return 0;
}
#endif

} // namespace gdaki
} // namespace gin
