//! The `#[repr(C)]` structures a kernel receives, shared with the CUDA header.
//! Every field is a fixed-width integer or a 64-bit address, so the layout is
//! the same for nvcc, g++ and rustc; the assertions below pin it.

use std::mem::{offset_of, size_of};

/// A device communicator as the device sees it. Addresses are device (or, for
/// CPU ranks, host) virtual addresses; 0 means absent.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DevCommAbi {
    /// This rank.
    pub rank: u32,
    /// Ranks in the communicator.
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
    /// The per-(context, peer) queue table, context-major, on CUDA ranks
    /// with peers not reached by load/store: [`ProxyRingAbi`]`[nctx * nranks]`
    /// for the proxy, [`GdakiQpAbi`]`[nctx * nranks]` for GDAKI; 0 otherwise.
    ///
    /// This field and the ones below are what a put, signal or wait reads
    /// on every call, so they are here rather than behind one more pointer:
    /// a kernel receives this struct by value (constant memory), while each
    /// system-scope acquire of a wait empties the L1 cache, so every table
    /// reached through a pointer costs an L2 round trip per call (about
    /// 0.15 us each on H200, measured with `xtask/gpu/probe/lsa_probe.cu`).
    pub rings: u64,
    /// [`BACKEND_NONE`], [`BACKEND_PROXY`] or [`BACKEND_GDAKI`] (0 on CPU ranks).
    pub backend_kind: u32,
    /// Signal slots per context: user signals, then one per world barrier
    /// (CUDA ranks; 0 on CPU ranks).
    pub sig_per_ctx: u32,
    /// Address of the reach table (CUDA ranks; 0 on CPU ranks): `u8[nranks]`,
    /// how each rank is reached ([`REACH_QUEUE`], [`REACH_LSA`], plus
    /// [`REACH_SAME_GPU`] for a peer on this GPU, or [`REACH_NONE`]),
    /// then, at the next multiple of 4 bytes, the rail team: `u32`
    /// rail barriers, `u32` members, `u32` ranks in team order. The team is
    /// read by rail barriers only, so it lives here rather than in this
    /// struct, whose size and layout shape every kernel's code.
    pub lsa: u64,
    /// Address of `u64[nranks]`: each peer's signal window mapped here for
    /// load/store (0 where none), this rank's own at its index (CUDA ranks).
    pub signal_peers: u64,
    /// World barriers: signal slots `nsignals..nsignals + world_barriers` of
    /// each context (CUDA ranks).
    pub world_barriers: u32,
    /// Id of the signal window, as proxy descriptors name it (CUDA ranks).
    pub signal_window: u32,
}

/// The communicator supports strong signals (ordering all earlier puts).
pub const DEVCOMM_FLAG_STRONG_SIGNALS: u32 = 1 << 0;
/// The communicator supports signals addressed by window offset.
pub const DEVCOMM_FLAG_VA_SIGNALS: u32 = 1 << 1;
/// Each context is used by one thread only (no atomics on reservation).
pub const DEVCOMM_FLAG_EXCLUSIVE_CTX: u32 = 1 << 2;

const _: () = assert!(size_of::<DevCommAbi>() == 120);
const _: () = assert!(offset_of!(DevCommAbi, signal_base) == 24);
const _: () = assert!(offset_of!(DevCommAbi, signals) == 32);
const _: () = assert!(offset_of!(DevCommAbi, counters) == 48);
const _: () = assert!(offset_of!(DevCommAbi, rings) == 80);
const _: () = assert!(offset_of!(DevCommAbi, backend_kind) == 88);
const _: () = assert!(offset_of!(DevCommAbi, lsa) == 96);
const _: () = assert!(offset_of!(DevCommAbi, signal_peers) == 104);
const _: () = assert!(offset_of!(DevCommAbi, signal_window) == 116);

/// A registered window as the device sees it.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WindowAbi {
    /// Same on every rank: windows are registered collectively, in order.
    pub id: u32,
    /// Reserved for window flags: 0 (none is defined).
    pub flags: u32,
    /// This rank's part of the window.
    pub local_base: u64,
    /// Size of this rank's part in bytes.
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
    /// The calling thread alone.
    #[default]
    Thread = 0,
    /// The calling thread's whole warp.
    Warp = 1,
    /// The calling thread's whole block (CTA).
    Cta = 2,
}

/// Each context is used by the threads of one block (CUDA ranks): queue
/// reservations use block-scope atomics.
pub const DEVCOMM_FLAG_CTA_CTX: u32 = 1 << 4;

/// Signals are kept in sub-slots (CUDA ranks): signal slot `s` of a rank is
/// `nranks` u64 sub-slots, and its value is their sum. No agent ever needs an
/// atomic it cannot do: a proxy or NIC serving rank `r`, the only writer of
/// sub-slot `r` at the peers it serves, stores running totals with stream
/// memory operations ordered after the data they announce; a GPU reaching the
/// receiver by load/store adds to the receiver's own sub-slot with a
/// system-scope atomic over NVLink. A reset subtracts the sum from the
/// rank's own sub-slot, also with a system-scope atomic.
pub const DEVCOMM_FLAG_SENDER_SLOTS: u32 = 1 << 3;

/// Every rank of the communicator reaches every rank by load/store (CUDA
/// ranks). Load/store signals always add to the receiver's own sub-slot (a
/// system-scope atomic, which many senders may share), so with this flag no
/// other sub-slot of a signal is ever written and a wait reads one word: one
/// acquire load per poll instead of `nranks` of them, which an acquire
/// serialises.
pub const DEVCOMM_FLAG_LSA_ONLY: u32 = 1 << 5;

/// The engine behind the queue paths applies atomics to any window word and
/// stores inline data of 1, 2 or 4 bytes, so signals by window address and
/// sub-word `put_value` may take those paths (CUDA ranks). Clear while the
/// CUDA engines execute with the copy engine, which has neither: the header
/// then refuses such calls with [`errword::COPY_ENGINE`] before posting.
pub const DEVCOMM_FLAG_QUEUE_ATOMICS: u32 = 1 << 6;

/// `gin::Fence` of the CUDA header ([`crate::ops::Fence::None`]):
/// synchronisation only.
pub const FENCE_NONE: u32 = 0;
/// `gin::Fence` ([`crate::ops::Fence::Context`]): earlier puts of the
/// barrier's context are visible.
pub const FENCE_CONTEXT: u32 = 1;
/// `gin::Fence` ([`crate::ops::Fence::AllContexts`]): earlier puts of every
/// context are visible.
pub const FENCE_ALL_CONTEXTS: u32 = 2;

/// [`DevCommAbi::lsa`]: the peer is reached through the context's queues.
pub const REACH_QUEUE: u8 = 0;
/// [`DevCommAbi::lsa`]: the peer is reached by load/store.
pub const REACH_LSA: u8 = 1;
/// [`DevCommAbi::lsa`]: the peer is not reached (off a rail connection).
pub const REACH_NONE: u8 = 2;
/// [`DevCommAbi::lsa`], a bit beside [`REACH_LSA`]: the peer runs on this
/// rank's GPU (ranks sharing one GPU), so a signal's release to it needs
/// only GPU scope, which waits for the data to reach this GPU's L2 rather
/// than for the whole system.
pub const REACH_SAME_GPU: u8 = 4;

/// The reach table kernels read: `reach` (`REACH_*` by rank) with
/// [`REACH_SAME_GPU`] added to each load/store peer whose GPU id in `gpus`
/// (by rank, as all-gathered) is `me`; none where `me` is empty (a driver
/// that gives no GPU id: every release then has system scope).
pub fn kernel_reach(reach: &[u8], gpus: &[Vec<u8>], me: &[u8]) -> Vec<u8> {
    let near =
        |p: usize, l: u8| l == REACH_LSA && !me.is_empty() && gpus.get(p).is_some_and(|g| g == me);
    (reach.iter().enumerate())
        .map(|(p, &l)| l | (REACH_SAME_GPU * u8::from(near(p, l))))
        .collect()
}

/// [`DevCommAbi::backend_kind`]: no queues; every peer is reached by load/store.
pub const BACKEND_NONE: u32 = 0;
/// [`DevCommAbi::backend_kind`]: descriptor rings read by a proxy thread.
pub const BACKEND_PROXY: u32 = 1;
/// [`DevCommAbi::backend_kind`]: mlx5 queues executed by a NIC.
pub const BACKEND_GDAKI: u32 = 2;

/// One (context, peer) descriptor ring as a kernel sees it.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProxyRingAbi {
    /// `2^log2` 64-byte descriptors in mapped pinned host memory.
    pub slots: u64,
    /// Producer index (u64, device memory): producers reserve with a
    /// fetch-add.
    pub head: u64,
    /// Completion index (u64, device memory): the proxy stores `seq + 1`
    /// once descriptor `seq`'s data has left the source (the copy engine
    /// finished), after its signal. Credit and flush are both judged by it.
    pub done: u64,
    /// Log2 of the ring's slot count.
    pub log2: u32,
    /// Padding to a multiple of 8 bytes; 0.
    pub reserved: u32,
}

const _: () = assert!(size_of::<ProxyRingAbi>() == 32);
const _: () = assert!(offset_of!(ProxyRingAbi, done) == 16);
const _: () = assert!(offset_of!(ProxyRingAbi, log2) == 24);

/// One mlx5 send queue as a kernel sees it (CUDA ranks, GDAKI).
///
/// The WQEs, the doorbell record and the doorbell register live in mapped
/// pinned host memory, which the soft NIC thread reads; the reservation and
/// ready indices and the completion queue live in device memory, because a
/// kernel that reads host memory starves the copies the NIC queues
/// (`xtask/gpu/probe/ce_probe.cu`). The CQ is collapsed (mlx5 `cc` and `oi`,
/// as NVSHMEM's IBGDA sets them): one 64-byte CQE that every completion
/// overwrites, whose WQE counter says how far the queue has completed.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GdakiSqAbi {
    /// `2^log2` 64-byte WQEs (basic blocks).
    pub wqes: u64,
    /// `u64[2]` in device memory: the reservation index (producers take
    /// WQE indices with a fetch-add) and the ready index (advanced in order,
    /// by CAS, once a range is filled).
    pub indices: u64,
    /// The doorbell record: big-endian u32 whose low 16 bits are the
    /// producer index.
    pub dbrec: u64,
    /// The doorbell register: the first 8 bytes of the last posted control
    /// segment (what a UAR write carries).
    pub doorbell: u64,
    /// The collapsed CQE (64 bytes, device memory).
    pub cqe: u64,
    /// The QP number (what the WQEs' control segments carry).
    pub qpn: u32,
    /// Log2 of the queue's WQE count.
    pub log2: u32,
}

const _: () = assert!(size_of::<GdakiSqAbi>() == 48);
const _: () = assert!(offset_of!(GdakiSqAbi, cqe) == 32);
const _: () = assert!(offset_of!(GdakiSqAbi, qpn) == 40);

/// The queues and keys a kernel needs to reach one peer from one context
/// over GDAKI: the RC QP to the peer and its companion loopback QP, which
/// bumps counters (a WAIT on the main QP's completion, then a fetch-add).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GdakiQpAbi {
    /// The send queue of the RC QP to the peer (data, signals, gets).
    pub main: GdakiSqAbi,
    /// The send queue of the companion loopback QP (counter bumps).
    pub companion: GdakiSqAbi,
    /// The peer's part of the signal window, at the peer's own address.
    pub sig_addr: u64,
    /// The key of that part.
    pub sig_key: u32,
    /// Key of this rank's counter array (local to the NIC).
    pub counter_key: u32,
    /// Where atomics return their old value (8 bytes per QP, never read).
    pub sink: u64,
    /// Key of the sink.
    pub sink_key: u32,
    /// CQ number of the main QP (what the companion's WAIT names).
    pub main_cqn: u32,
}

const _: () = assert!(size_of::<GdakiQpAbi>() == 128);
const _: () = assert!(offset_of!(GdakiQpAbi, companion) == 48);
const _: () = assert!(offset_of!(GdakiQpAbi, sig_addr) == 96);
const _: () = assert!(offset_of!(GdakiQpAbi, sink) == 112);
const _: () = assert!(offset_of!(GdakiQpAbi, main_cqn) == 124);

/// The error word a CUDA wait or operation writes (first error wins):
/// `[63:56]` kind, `[55:48]` context (255: none or larger), `[47:32]` peer
/// (0xffff: none), `[31:0]` id or the last value seen (low 32 bits).
pub mod errword {
    /// A signal wait timed out; the value is the signal id.
    pub const SIGNAL_TIMEOUT: u8 = 1;
    /// A counter wait timed out; the value is the counter id.
    pub const COUNTER_TIMEOUT: u8 = 2;
    /// A flush timed out waiting for the backend.
    pub const FLUSH_TIMEOUT: u8 = 3;
    /// A wait for a free queue slot (ring or send queue credit) timed out.
    pub const QUEUE_TIMEOUT: u8 = 4;
    /// A wait gave up because the host set the abort flag.
    pub const ABORTED: u8 = 5;
    /// The peer does not exist or is not connected; the value is the peer.
    pub const BAD_PEER: u8 = 6;
    /// An access outside a window; the value is the window id.
    pub const OUT_OF_WINDOW: u8 = 7;
    /// An unknown signal id (or barrier index); the value is the id.
    pub const BAD_SIGNAL: u8 = 8;
    /// An unknown counter id; the value is the id.
    pub const BAD_COUNTER: u8 = 9;
    /// An unknown context; the value is the context.
    pub const BAD_CONTEXT: u8 = 10;
    /// An operation this backend does not support on CUDA ranks.
    pub const UNSUPPORTED: u8 = 11;
    /// A barrier timed out.
    pub const BARRIER_TIMEOUT: u8 = 12;
    /// A misaligned offset (an 8-byte value put); the value is the window
    /// id.
    pub const MISALIGNED: u8 = 13;
    /// A WQE completed in error; the value is `syndrome << 16 | WQE index`.
    pub const WQE_ERROR: u8 = 14;
    /// The path's engine is the copy engine (CUDA ranks' proxy and soft
    /// NIC), which has no atomics (a signal by window address) and stores 8
    /// aligned bytes at a time (a 1, 2 or 4-byte `put_value`); the value is
    /// the window id. Refused before anything was posted.
    pub const COPY_ENGINE: u8 = 15;
    /// The peer is reached through a queue path (proxy or GDAKI) that the
    /// kernel was compiled without (`GIN_QUEUE_PATHS`); the value is the
    /// backend (1 proxy, 2 GDAKI). Refused before anything was posted.
    pub const PATH_NOT_BUILT: u8 = 16;

    /// A decoded error word.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Decoded {
        /// What went wrong: one of this module's constants.
        pub kind: u8,
        /// The context, if the word names one below 255.
        pub ctx: Option<u32>,
        /// The peer, if the word names one.
        pub peer: Option<usize>,
        /// The kind's value (an id, a peer, the last value seen...; low
        /// 32 bits).
        pub value: u32,
    }

    /// Packs an error word (what the CUDA header's `gin::detail::fail` does).
    pub fn encode(kind: u8, ctx: u32, peer: Option<usize>, value: u32) -> u64 {
        let c = u64::from(ctx.min(255));
        let p = peer.map_or(0xffff, |p| (p as u64).min(0xfffe));
        (u64::from(kind) << 56) | (c << 48) | (p << 32) | u64::from(value)
    }

    /// Unpacks an error word; `None` for 0 (no error).
    pub fn decode(w: u64) -> Option<Decoded> {
        if w == 0 {
            return None;
        }
        let ctx = ((w >> 48) & 0xff) as u32;
        let peer = ((w >> 32) & 0xffff) as usize;
        Some(Decoded {
            kind: (w >> 56) as u8,
            ctx: (ctx != 255).then_some(ctx),
            peer: (peer != 0xffff).then_some(peer),
            value: w as u32,
        })
    }

    /// What went wrong, in words.
    pub fn describe(kind: u8) -> &'static str {
        match kind {
            SIGNAL_TIMEOUT => "timed out waiting for a signal",
            COUNTER_TIMEOUT => "timed out waiting for a counter",
            FLUSH_TIMEOUT => "timed out in flush waiting for the backend",
            QUEUE_TIMEOUT => "timed out waiting for a free queue slot",
            ABORTED => "a wait was aborted by the abort flag",
            BAD_PEER => "peer does not exist or is not connected",
            OUT_OF_WINDOW => "access outside a window",
            BAD_SIGNAL => "unknown signal id",
            BAD_COUNTER => "unknown counter id",
            BAD_CONTEXT => "unknown context",
            UNSUPPORTED => "operation not supported by this backend on CUDA ranks",
            BARRIER_TIMEOUT => "timed out in a barrier",
            MISALIGNED => "misaligned offset",
            WQE_ERROR => "a work request completed in error (value: syndrome << 16 | WQE index)",
            COPY_ENGINE => {
                "refused: this path's engine is the copy engine, which has no atomics (a signal \
                 by window address) and stores 8 aligned bytes at a time (a 1, 2 or 4-byte \
                 put_value); use the load/store path, a signal id or an 8-byte value (value: \
                 the window id)"
            }
            PATH_NOT_BUILT => {
                "refused: this kernel was compiled without the queue path that reaches this \
                 peer (GIN_QUEUE_PATHS leaves it out; value: the backend, 1 proxy, 2 GDAKI), \
                 so it can neither post to the peer nor flush, wait for or barrier with it; \
                 compile it with the default GIN_QUEUE_PATHS, or use it on a communicator \
                 whose peers are all reached by load/store"
            }
            _ => "unknown error kind",
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn error_words_round_trip() {
            let w = encode(OUT_OF_WINDOW, 3, Some(7), 0xdead_beef);
            assert_eq!(w, 0x0703_0007_dead_beef);
            assert_eq!(
                decode(w),
                Some(Decoded {
                    kind: OUT_OF_WINDOW,
                    ctx: Some(3),
                    peer: Some(7),
                    value: 0xdead_beef
                })
            );
            let w = encode(ABORTED, 1000, None, 1);
            let d = decode(w).unwrap();
            assert_eq!((d.ctx, d.peer), (None, None));
            assert_eq!(decode(0), None);
        }
    }
}

#[cfg(test)]
mod reach_tests {
    use super::*;

    #[test]
    fn only_load_store_peers_on_this_gpu_get_the_same_gpu_bit() {
        let reach = [REACH_LSA, REACH_LSA, REACH_QUEUE, REACH_NONE, REACH_LSA];
        let gpus: Vec<Vec<u8>> = ["a", "a", "a", "a", "b"]
            .iter()
            .map(|g| g.as_bytes().to_vec())
            .collect();
        assert_eq!(
            kernel_reach(&reach, &gpus, b"a"),
            [5, 5, REACH_QUEUE, REACH_NONE, REACH_LSA]
        );
        // Without a GPU id nothing is claimed, even where the ids agree.
        let none: Vec<Vec<u8>> = vec![Vec::new(); 5];
        assert_eq!(kernel_reach(&reach, &none, b""), reach);
        // A short gather claims nothing for the ranks it lacks.
        assert_eq!(kernel_reach(&reach, &gpus[..1], b"a"), [5, 1, 0, 2, 1]);
    }
}
