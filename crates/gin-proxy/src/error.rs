//! Errors of the proxy engine, its executors and its ring views, and the
//! first-error cell every producer and waiter reads.
//!
//! The engine is fail-stop: the first error (a corrupt descriptor, a
//! descriptor naming memory that does not exist, an executor that fails)
//! is recorded once, as a [`ProxyError`] naming rank, context, peer and
//! descriptor sequence, and nothing is executed after it.

use std::sync::OnceLock;
use std::time::Duration;

use crate::descriptor::{DecodeError, Op};

/// Why an executor could not carry out an operation. Executors map their
/// transport's or driver's errors onto these, keeping the transport's own
/// words in `why`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ExecError {
    /// The peer is dead, or the link to it broke.
    #[error("rank {peer} is unreachable: {why}")]
    Unreachable {
        /// The peer.
        peer: usize,
        /// The transport's account.
        why: String,
    },
    /// The target refused the operation (its owner dropped or deregistered
    /// the memory, or a key or bound check failed there): nothing of the
    /// operation was applied.
    #[error("rank {peer}: {why}")]
    Refused {
        /// The peer that refused.
        peer: usize,
        /// The target's account, naming window and offset.
        why: String,
    },
    /// A transfer or its answer did not come in time.
    #[error("rank {peer}: timed out after {waited:.1?} waiting for {what}")]
    Timeout {
        /// The peer waited for.
        peer: usize,
        /// What was awaited.
        what: String,
        /// How long.
        waited: Duration,
    },
    /// The operation cannot be carried out by this executor (an address it
    /// cannot reach, a layout it does not serve).
    #[error("{why}")]
    Invalid {
        /// What is wrong, naming window, offset or slot.
        why: String,
    },
    /// The transport failed, with no one peer to blame (a lost link found
    /// by a health check names its peer in `why`).
    #[error("{why}")]
    Transport {
        /// The transport's account.
        why: String,
    },
    /// The device or driver behind the executor failed (a CUDA call).
    #[error("{what} failed: {why}")]
    Device {
        /// The call.
        what: &'static str,
        /// The driver's account.
        why: String,
    },
}

/// Why a descriptor that decoded is not executable: it names memory or a
/// counter this rank does not have, checked against the window directory
/// before anything moves.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Invalid {
    /// No window with this id is registered.
    #[error("window {window} is not registered")]
    UnknownWindow {
        /// The window id.
        window: u32,
    },
    /// A range does not fit a rank's part of a window.
    #[error(
        "{what}: {bytes} bytes at offset {offset} exceed rank {owner}'s {size} bytes of window {window}"
    )]
    OutOfWindow {
        /// Which range ("put source", "get destination", "signal").
        what: &'static str,
        /// The window id.
        window: u32,
        /// The rank whose part it is.
        owner: usize,
        /// The offset.
        offset: u64,
        /// The length.
        bytes: u64,
        /// The part's size.
        size: u64,
    },
    /// A signal slot that is not 8-byte aligned.
    #[error("signal at offset {offset} of window {window} is not 8-byte aligned")]
    MisalignedSignal {
        /// The signal window.
        window: u32,
        /// The offset.
        offset: u64,
    },
    /// Inline data is one 8-byte word.
    #[error("an inline put carries 8 bytes, not {bytes}")]
    InlineSize {
        /// The byte count the descriptor gave.
        bytes: u64,
    },
    /// A counter slot beyond the counter array.
    #[error("counter slot {slot} does not exist ({slots} slots)")]
    NoCounter {
        /// The slot.
        slot: u32,
        /// Slots in the array.
        slots: u64,
    },
    /// A get carrying a signal or inline data: only puts do.
    #[error("a get cannot carry {what}")]
    GetWith {
        /// "a signal" or "inline data".
        what: &'static str,
    },
}

/// What went wrong with one descriptor.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Why {
    /// It did not decode (wrong sequence, opcode or flags).
    #[error("corrupt descriptor: {0}")]
    Corrupt(#[from] DecodeError),
    /// It names memory or a counter that does not exist.
    #[error(transparent)]
    Invalid(#[from] Invalid),
    /// The executor failed to carry it out (or to publish its completion).
    #[error(transparent)]
    Executor(#[from] ExecError),
}

/// The first error of a proxy: what every later wait and flush reports.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProxyError {
    /// The engine met a descriptor it could not execute.
    #[error("rank {rank}: {} on context {ctx} failed: {why}", self.what())]
    Descriptor {
        /// This rank.
        rank: usize,
        /// The ring's context.
        ctx: u32,
        /// The ring's peer.
        peer: usize,
        /// The descriptor's sequence number in its ring.
        seq: u64,
        /// Its operation, when it decoded.
        op: Option<Op>,
        /// Why.
        why: Why,
    },
    /// An operation a producer carried out itself (a put sent without the
    /// ring, or the confirmation a flush asks of a peer) failed.
    #[error("rank {rank}: {} on context {ctx} failed: {why}", self.what())]
    Direct {
        /// This rank.
        rank: usize,
        /// The context.
        ctx: u32,
        /// The peer.
        peer: usize,
        /// "put", or "completion of operations".
        what: &'static str,
        /// Why.
        why: Why,
    },
    /// A producer waited for ring credit past the timeout: the engine made
    /// no progress on this ring, and the reserved slot blocks it for good.
    #[error("rank {rank}: {} on context {ctx} failed: {}", self.what(), self.cause())]
    Stalled {
        /// This rank.
        rank: usize,
        /// The ring's context.
        ctx: u32,
        /// The ring's peer.
        peer: usize,
        /// The sequence number the producer reserved.
        seq: u64,
        /// How long it waited.
        waited: Duration,
    },
    /// The executor failed to publish a ring's completion index, or to hand
    /// the ring's batch to the device.
    #[error("rank {rank}: {} on context {ctx} failed: {why}", self.what())]
    Publish {
        /// This rank.
        rank: usize,
        /// The ring's context.
        ctx: u32,
        /// The ring's peer.
        peer: usize,
        /// The completion index being published.
        upto: u64,
        /// The executor's account.
        why: ExecError,
    },
    /// The executor failed outside any descriptor (setting up on the driver
    /// thread, or waiting for its queued work at the end).
    #[error("rank {rank}: the proxy's executor failed to {what}: {why}")]
    Executor {
        /// This rank.
        rank: usize,
        /// "start", "finish its queued work".
        what: &'static str,
        /// The executor's account.
        why: ExecError,
    },
}

impl ProxyError {
    /// The rank that recorded the error.
    pub fn rank(&self) -> usize {
        match self {
            Self::Descriptor { rank, .. }
            | Self::Direct { rank, .. }
            | Self::Stalled { rank, .. }
            | Self::Publish { rank, .. }
            | Self::Executor { rank, .. } => *rank,
        }
    }

    /// The context of the ring involved, if one was.
    pub fn ctx(&self) -> Option<u32> {
        match self {
            Self::Descriptor { ctx, .. }
            | Self::Direct { ctx, .. }
            | Self::Stalled { ctx, .. }
            | Self::Publish { ctx, .. } => Some(*ctx),
            Self::Executor { .. } => None,
        }
    }

    /// The peer involved, if one was.
    pub fn peer(&self) -> Option<usize> {
        match self {
            Self::Descriptor { peer, .. }
            | Self::Direct { peer, .. }
            | Self::Stalled { peer, .. }
            | Self::Publish { peer, .. } => Some(*peer),
            Self::Executor { .. } => None,
        }
    }

    /// The descriptor sequence number involved, if one was.
    pub fn seq(&self) -> Option<u64> {
        match self {
            Self::Descriptor { seq, .. } | Self::Stalled { seq, .. } => Some(*seq),
            Self::Direct { .. } | Self::Publish { .. } | Self::Executor { .. } => None,
        }
    }

    /// What failed, without rank and context ("put #3 to rank 1").
    pub fn what(&self) -> String {
        match self {
            Self::Descriptor { peer, seq, op, .. } => match op {
                Some(op) => format!("{op} #{seq} to rank {peer}"),
                None => format!("descriptor #{seq} to rank {peer}"),
            },
            Self::Direct { peer, what, .. } => format!("{what} to rank {peer}"),
            Self::Stalled { peer, seq, .. } => format!("enqueue #{seq} to rank {peer}"),
            Self::Publish { peer, upto, .. } => {
                format!("completion index {upto} of the ring to rank {peer}")
            }
            Self::Executor { what, .. } => format!("the proxy's executor ({what})"),
        }
    }

    /// Why it failed, without rank and context.
    pub fn cause(&self) -> String {
        match self {
            Self::Descriptor { why, .. } | Self::Direct { why, .. } => why.to_string(),
            Self::Publish { why, .. } | Self::Executor { why, .. } => why.to_string(),
            Self::Stalled {
                ctx, peer, waited, ..
            } => format!(
                "descriptor ring for context {ctx}, peer {peer} stayed full for {waited:.1?} (proxy stalled)"
            ),
        }
    }
}

/// The first [`ProxyError`] of a proxy, shared by the driver thread, the
/// producers and the waiters. Reading it is one atomic load while nothing
/// has failed, so every enqueue and wait may check it.
#[derive(Debug, Default)]
pub struct FirstError(OnceLock<ProxyError>);

impl FirstError {
    /// Records `e` unless an error is recorded already; true if it was the
    /// first (and was logged).
    pub fn record(&self, e: ProxyError) -> bool {
        let mut first = false;
        self.0.get_or_init(|| {
            first = true;
            tracing::error!(rank = e.rank(), error = %e, "proxy failed");
            e
        });
        first
    }

    /// The first error, if any.
    pub fn get(&self) -> Option<&ProxyError> {
        self.0.get()
    }
}

/// Why a ring-memory view cannot be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RingMemError {
    /// The base address is null or not 8-byte aligned.
    #[error("ring memory at {addr:#x} is not 8-byte aligned")]
    Misaligned {
        /// The base address.
        addr: usize,
    },
    /// The ring size is outside the proxy's range.
    #[error("a ring of 2^{log2} descriptors is outside 2^{min}..=2^{max}")]
    Size {
        /// log2 of the size asked for.
        log2: u32,
        /// log2 of the smallest ring.
        min: u32,
        /// log2 of the largest ring.
        max: u32,
    },
}
