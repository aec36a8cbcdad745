//! The `#[repr(C)]` structures a kernel receives, shared with the CUDA header.
//! Every field is a fixed-width integer or a 64-bit address, so the layout is
//! the same for nvcc, g++ and rustc; the assertions below pin it.

use std::mem::{offset_of, size_of};

/// A device communicator as the device sees it. Addresses are device (or, for
/// CPU ranks, host) virtual addresses; 0 means absent.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DevCommAbi {
    pub rank: u32,
    pub nranks: u32,
    /// Contexts: independent ordering domains.
    pub nctx: u32,
    /// Signals per context.
    pub nsignals: u32,
    /// Counters per context.
    pub ncounters: u32,
    /// [`DEVCOMM_FLAG_STRONG_SIGNALS`] and friends.
    pub flags: u32,
    /// First slot of this communicator's signals in the signal window;
    /// signal `id` of context `c` is slot `signal_base + c * nsignals + id`.
    pub signal_base: u64,
    /// Local base of the signal window (u64 slots).
    pub signals: u64,
    /// First slot of this communicator's counters; same indexing as signals.
    pub counter_base: u64,
    /// Local counter array (u64 slots, 56 bits used).
    pub counters: u64,
    /// Address of a u32 the host sets to ask every wait to give up.
    pub abort_flag: u64,
    /// Address of the error word a device wait writes before returning.
    pub error_word: u64,
    /// Timeout of device waits, in the device's clock ticks (0: none).
    pub timeout_ticks: u64,
    /// Backend-private state (ring or queue tables).
    pub backend: u64,
}

/// The communicator supports strong signals (ordering all earlier puts).
pub const DEVCOMM_FLAG_STRONG_SIGNALS: u32 = 1 << 0;
/// The communicator supports signals addressed by window offset.
pub const DEVCOMM_FLAG_VA_SIGNALS: u32 = 1 << 1;
/// Each context is used by one thread only (no atomics on reservation).
pub const DEVCOMM_FLAG_EXCLUSIVE_CTX: u32 = 1 << 2;

const _: () = assert!(size_of::<DevCommAbi>() == 88);
const _: () = assert!(offset_of!(DevCommAbi, signal_base) == 24);
const _: () = assert!(offset_of!(DevCommAbi, signals) == 32);
const _: () = assert!(offset_of!(DevCommAbi, counters) == 48);
const _: () = assert!(offset_of!(DevCommAbi, backend) == 80);

/// A registered window as the device sees it.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WindowAbi {
    /// Same on every rank: windows are registered collectively, in order.
    pub id: u32,
    pub flags: u32,
    /// This rank's part of the window.
    pub local_base: u64,
    pub local_size: u64,
    /// Address of `u64[nranks]`: every rank's size of this window.
    pub sizes: u64,
    /// Address of `u64[nranks]`: each peer's part mapped here for load/store,
    /// or 0 where no direct path exists.
    pub peer_bases: u64,
    /// Address of `u32[nranks]`: each rank's memory key for its part (what
    /// an RDMA work request names).
    pub keys: u64,
    /// Address of `u64[nranks]`: each rank's address of its own part.
    pub addrs: u64,
}

const _: () = assert!(size_of::<WindowAbi>() == 56);
const _: () = assert!(offset_of!(WindowAbi, local_base) == 8);
const _: () = assert!(offset_of!(WindowAbi, peer_bases) == 32);
const _: () = assert!(offset_of!(WindowAbi, keys) == 40);
const _: () = assert!(offset_of!(WindowAbi, addrs) == 48);

/// Who cooperates in one call (CUDA: one thread, a warp, a whole block). CPU
/// ranks run every coop as the calling thread alone.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Coop {
    #[default]
    Thread = 0,
    Warp = 1,
    Cta = 2,
}
