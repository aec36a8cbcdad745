//! gin-net: the fabric under every backend — NCCL's net/RMA plugin layer.
//!
//! Backends (the proxy, the soft NIC, CUDA ranks' engines) move bytes and
//! apply atomics on *windows* through one [`Fabric`] per rank; the fabric
//! reaches each peer through one [`Transport`], chosen per peer when the
//! job is set up.
//!
//! # Design
//!
//! - **One window directory** ([`MemDesc`]): what every registered window
//!   looks like on every rank: each part's size, its mapping here (if any),
//!   the key its owner serves it under (if any), its owner's address, its
//!   revocation word, and whether it is host or GPU memory. CPU ranks and
//!   CUDA ranks register their windows alike. A description can only be
//!   made through an `unsafe` constructor that vouches for its addresses,
//!   so no safe call makes the fabric touch memory nobody registered.
//! - **A transport seam** ([`Transport`], [`transport`]): put with an
//!   optional ordered signal, get, fetch-add, compare-swap, fence, confirm
//!   and health, for one peer; the fabric checks an operation against the
//!   directory, then dispatches to the peer's transport. Transports are
//!   registered in one table and chosen in one place, from `GIN_TRANSPORT`
//!   and the ranks' host ids: a new transport is one module and one line
//!   of registration.
//! - **Window parts in host memory** ([`part`]): the record a rank tells
//!   the others about its part (size, key, address, shared segment), the
//!   peers' parts as reached here (same-host segments mapped), and the
//!   registration whose drop revokes a part, removes it from the directory
//!   and stops serving it, before its memory goes; and a host window's
//!   whole set-up on one rank ([`host_window`]: segment, exchange, entry).
//! - **Regions** ([`region::RegionTable`]): memory remote peers may
//!   access, named by random 32-bit keys; every remote request is checked
//!   for key, rights, bounds and alignment at the target (defence in
//!   depth: the initiator checked too).
//! - **shm** ([`shm`]): same-host peers map each other's segments;
//!   one-sided operations are then plain copies and atomics on the mapping,
//!   with release ordering on the atomic that publishes data. Segments are
//!   owner-only, their pages reserved at creation (no SIGBUS on a full
//!   tmpfs), their names removed as soon as registration is over. A header
//!   page holds the owner's revocation word: a peer's mapping outlives the
//!   owner's interest, so the word, not the mapping, says whether the owner
//!   still serves the segment, and the shm transport refuses data and
//!   signals for a revoked one. The same code reaches this rank's own
//!   windows (the `local` path).
//! - **tcp** ([`tcp`]): any host. Each rank serves its regions; one
//!   ordered connection per pair of ranks makes "signal after data" hold by
//!   construction. Errors come back as answers, not silence, and are
//!   sticky on the link until reported. No send blocks past the job's
//!   timeout on a peer that stopped reading; the error names that peer.
//! - **ucx** ([`ucx`]): any host, through UCX's UCP API (`libucp.so.0`
//!   opened at run time; `GIN_TRANSPORT=ucx`). Regions are mapped with
//!   `ucp_mem_map` when they are registered (on the registering thread),
//!   their rkeys handed to a peer when it first asks, and revoked at every
//!   holder before their memory goes; a small put and its signal go as
//!   one active message the target applies, data first
//!   (`GIN_UCX_AM_MAX`), a larger put's signal follows a
//!   `ucp_worker_fence`. docs/ucx.md has the ordering per UCX transport.
//! - Endpoint addresses are exchanged through gin-bootstrap; transport
//!   connections authenticate with a token derived from the job secret.
//!
//! # What it does not know
//!
//! Signals, counters, contexts, queues and descriptor or WQE formats belong
//! to the layers above: gin-net knows windows only as byte ranges with
//! sizes, addresses and keys, and moves bytes and performs atomics on them.
//! It never dereferences GPU memory: CUDA ranks' engines copy it with the
//! GPU, and reach peers over keyed transports through the fabric's keyed
//! operations ([`Fabric::put_key`], [`Fabric::read_key`], [`Fabric::read`];
//! until they have moved, they also drive [`tcp::Link`]s directly). A
//! transport that takes GPU memory itself
//! ([`Transport::takes_device_memory`]: ucx, which maps GPU regions with
//! `UCS_MEMORY_TYPE_CUDA` and hands device addresses to UCX) gets it
//! directly ([`Fabric::put_device_key`], [`Fabric::read_device_key`]);
//! running totals follow the data through [`Fabric::put_key_ordered`].

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod fabric;
pub mod host_window;
pub mod idle;
pub mod part;
pub mod region;
pub mod shm;
pub mod sticky;
pub mod tcp;
pub mod testing;
pub mod transport;
pub mod ucx;
pub mod window;

pub use fabric::{Fabric, Path};
pub use transport::{Reach, Target, Transport};
pub use window::{Addr, HostMemory, KeepAlive, MemDesc, MemParts, Memory};

use std::time::Duration;

/// Fabric errors. Each variant names the rank, peer, window, key, offset,
/// size or transport involved; the ones a caller can act on (a bad range,
/// a refused request, a dead peer) are variants of their own.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NetError {
    /// A system call failed while setting something up or moving bytes.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// The peer is not a rank of this job.
    #[error("no path to rank {peer} (the job has {nranks} ranks)")]
    NoPath {
        /// The rank asked for.
        peer: usize,
        /// Ranks in the job.
        nranks: usize,
    },
    /// The window is not in the fabric's directory (never registered, or
    /// already deregistered here).
    #[error("window {window} is not registered with the fabric")]
    NotRegistered {
        /// The window id.
        window: u32,
    },
    /// The range does not fit the peer's part of the window: nothing moved.
    #[error("{len} bytes at offset {offset} exceed rank {peer}'s {size} bytes of window {window}")]
    OutOfBounds {
        /// The rank whose part was addressed.
        peer: usize,
        /// The window id.
        window: u32,
        /// Offset in the peer's part.
        offset: u64,
        /// Bytes asked for.
        len: u64,
        /// The peer's part's size.
        size: u64,
    },
    /// An atomic or a signal on an address that is not 8-byte aligned.
    #[error("{what} at offset {offset} of window {window} of rank {peer} is not aligned")]
    Misaligned {
        /// The rank whose part was addressed.
        peer: usize,
        /// The window id.
        window: u32,
        /// Offset in the peer's part.
        offset: u64,
        /// "atomic" or "signal".
        what: &'static str,
    },
    /// The path to the peer loads and stores, but the peer's part is not
    /// mapped here.
    #[error("window {window} of rank {peer} is not mapped here")]
    NotMapped {
        /// The rank whose part was addressed.
        peer: usize,
        /// The window id.
        window: u32,
    },
    /// The path to the peer names parts by key, but the peer's part has
    /// none (it is not served to this rank).
    #[error("rank {peer}'s part of window {window} is not served over {transport}")]
    NotServed {
        /// The rank whose part was addressed.
        peer: usize,
        /// The window id.
        window: u32,
        /// The transport's name.
        transport: &'static str,
    },
    /// The window is GPU memory and the path to the peer would load or
    /// store it from the host: the GPU's engines must move it instead.
    #[error(
        "window {window} of rank {peer} is GPU memory, which the {transport} path does not load or store (the GPU copies it)"
    )]
    DeviceMemory {
        /// The rank whose part was addressed.
        peer: usize,
        /// The window id.
        window: u32,
        /// The transport's name.
        transport: &'static str,
    },
    /// The transport does not offer this kind of operation.
    #[error("the {transport} transport does not offer {op}")]
    Unsupported {
        /// The transport's name.
        transport: &'static str,
        /// What was asked.
        op: &'static str,
    },
    /// The owner of the part dropped or deregistered it: refused before
    /// anything moved.
    #[error(
        "rank {peer}: {op} of {len} bytes at offset {offset} of window {window} refused: rank {peer} dropped or deregistered its part"
    )]
    Revoked {
        /// The owner.
        peer: usize,
        /// The window id.
        window: u32,
        /// Offset in the owner's part.
        offset: u64,
        /// Bytes of the refused operation.
        len: u64,
        /// "put", "signal", "get" or "atomic".
        op: &'static str,
    },
    /// The target refused a request (bad key, bounds, rights or alignment,
    /// or a region removed meanwhile). The connection is in its error state
    /// from then on, as an RDMA QP: everything after it is refused too.
    #[error("rank {peer}: {why}{}", window.map(|w| format!(" (window {w} of rank {peer})")).unwrap_or_default())]
    Refused {
        /// The target.
        peer: usize,
        /// The target's reason.
        why: String,
        /// The window the refused key belongs to, where this rank knows it.
        window: Option<u32>,
    },
    /// The path to the peer failed: the connection was lost (the peer
    /// exited, died or became unreachable), a send failed, or the peer
    /// broke the protocol. Sticky: every later operation reports it.
    #[error("rank {peer}: {why}")]
    Broken {
        /// The peer.
        peer: usize,
        /// What happened.
        why: String,
    },
    /// The peer did not answer or drain its connection in time.
    #[error("rank {peer}: timed out after {waited:.1?} waiting for {what}")]
    Timeout {
        /// The peer.
        peer: usize,
        /// What was awaited.
        what: String,
        /// How long.
        waited: Duration,
    },
    /// `GIN_TRANSPORT` (or a caller) named a transport nobody registered.
    #[error("no transport is called {name} (available: {available})")]
    UnknownTransport {
        /// The name asked for.
        name: String,
        /// The registered names.
        available: String,
    },
    /// A transport that reaches only this host was asked for where some
    /// ranks are on other hosts.
    #[error("ranks {others:?} are on other hosts; {transport} reaches only this host")]
    HostOnly {
        /// The transport's name.
        transport: &'static str,
        /// The ranks on other hosts.
        others: Vec<usize>,
    },
    /// A shared-memory segment (with its header) of this size cannot be
    /// made on this system.
    #[error("a shared-memory segment of {len} bytes is larger than this system can map")]
    SegmentTooLarge {
        /// Data bytes asked for.
        len: usize,
    },
    /// A peer's segment is smaller than its window part says.
    #[error(
        "peer's shared memory {path} has {have} bytes, expected {want} and a {header}-byte header"
    )]
    SegmentTooSmall {
        /// The segment's file.
        path: std::path::PathBuf,
        /// Bytes the file has.
        have: u64,
        /// Data bytes expected.
        want: usize,
        /// Header bytes expected before the data.
        header: usize,
    },
    /// A peer sent a set-up record this rank cannot use.
    #[error("rank {peer} sent a bad {what}")]
    BadRecord {
        /// The peer.
        peer: usize,
        /// What the record was.
        what: &'static str,
    },
    /// A transport that was asked for cannot run here (its library is
    /// missing or too old); says what is missing and the alternatives.
    #[error("GIN_TRANSPORT={transport} is not available: {why}; {alternatives}")]
    Unavailable {
        /// The transport's name.
        transport: &'static str,
        /// What is missing.
        why: String,
        /// What to do instead.
        alternatives: &'static str,
    },
    /// A job collective (address exchange, barrier) failed.
    #[error(transparent)]
    Bootstrap(#[from] gin_bootstrap::BootstrapError),
    /// A rank's allgathered record of a window part ([`part::PartRecord`])
    /// has the wrong shape: the ranks run different builds, or memory was
    /// corrupted.
    #[error(transparent)]
    Record(#[from] gin_bootstrap::record::Malformed),
}

impl NetError {
    /// The peer this error is about, when it names one.
    pub fn peer(&self) -> Option<usize> {
        match self {
            Self::NoPath { peer, .. }
            | Self::OutOfBounds { peer, .. }
            | Self::Misaligned { peer, .. }
            | Self::NotMapped { peer, .. }
            | Self::NotServed { peer, .. }
            | Self::DeviceMemory { peer, .. }
            | Self::Revoked { peer, .. }
            | Self::Refused { peer, .. }
            | Self::Broken { peer, .. }
            | Self::Timeout { peer, .. }
            | Self::BadRecord { peer, .. } => Some(*peer),
            Self::Record(m) => Some(m.rank),
            _ => None,
        }
    }

    /// Whether this rank refused the operation itself before anything
    /// moved (a bad range, an unmapped or unserved part, a revoked part):
    /// the path to the peer is still good.
    pub fn is_local_refusal(&self) -> bool {
        matches!(
            self,
            Self::NoPath { .. }
                | Self::NotRegistered { .. }
                | Self::OutOfBounds { .. }
                | Self::Misaligned { .. }
                | Self::NotMapped { .. }
                | Self::NotServed { .. }
                | Self::DeviceMemory { .. }
                | Self::Unsupported { .. }
                | Self::Revoked { .. }
        )
    }
}
