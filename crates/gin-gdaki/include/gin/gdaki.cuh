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

} // namespace gdaki
} // namespace gin
