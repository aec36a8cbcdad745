//! Why a WQE completed in error, as the engine reports it: the access an
//! operand needs, the cause, and the fault record pollers read.

use std::fmt;
use std::sync::OnceLock;

use super::exec::{ExecError, Region};
use crate::completion::syndrome;
use crate::queue::BadProducerIndex;
use crate::wqe::ParseError;

/// What a WQE's operand needs of its memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// The source of a write.
    LocalRead,
    /// The destination of a read, an atomic's result.
    LocalWrite,
    /// What a read reads.
    RemoteRead,
    /// What a write writes.
    RemoteWrite,
    /// The target of an atomic.
    RemoteAtomic,
}

impl Access {
    pub(super) fn is_local(self) -> bool {
        matches!(self, Self::LocalRead | Self::LocalWrite)
    }

    /// Whether `region` allows this access: window parts allow every
    /// access; the counter array only atomics (from the loopback QP); the
    /// sink only an atomic's result.
    pub fn allowed_on(self, region: Region) -> bool {
        match region {
            Region::Window(_) => true,
            Region::Counters => self == Self::RemoteAtomic,
            Region::Sink => self == Self::LocalWrite,
        }
    }
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::LocalRead => "local reads",
            Self::LocalWrite => "local writes",
            Self::RemoteRead => "remote reads",
            Self::RemoteWrite => "remote writes",
            Self::RemoteAtomic => "remote atomics",
        })
    }
}

/// Why a WQE completed in error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Cause {
    /// The doorbell record cannot be believed.
    #[error("{0}")]
    ProducerIndex(BadProducerIndex),
    /// The bytes are not a WQE this NIC executes.
    #[error("malformed WQE: {0}")]
    Malformed(ParseError),
    /// The control segment names another WQE index.
    #[error("the WQE at index {index} carries index {carried}")]
    WrongIndex {
        /// Where it was read.
        index: u64,
        /// What it says.
        carried: u16,
    },
    /// The control segment names another QP.
    #[error("a WQE for QP {carried:#x} was posted on QP {qpn:#x}")]
    WrongQp {
        /// What it says.
        carried: u32,
        /// Where it was posted.
        qpn: u32,
    },
    /// A WAIT on a CQ the engine does not serve.
    #[error("WAIT on unknown CQ {cqn:#x}")]
    UnknownCq {
        /// The CQ.
        cqn: u32,
    },
    /// A WAIT on a CQ of another channel, whose work is not ordered with
    /// this queue's.
    #[error("WAIT on CQ {cqn:#x}, whose queue's work is not ordered with this queue's")]
    CqElsewhere {
        /// The CQ.
        cqn: u32,
    },
    /// A WAIT behind a QP in the error state.
    #[error("the awaited QP {qpn:#x} is in the error state")]
    AwaitedFailed {
        /// The awaited QP.
        qpn: u32,
    },
    /// A key this NIC knows no memory for on that rank.
    #[error("key {key:#010x} is not registered on rank {rank}")]
    UnknownKey {
        /// The key.
        key: u32,
        /// The rank it was used for.
        rank: usize,
    },
    /// A window key of another rank's part.
    #[error("key {key:#010x} belongs to rank {owner}, not rank {rank}")]
    ForeignKey {
        /// The key.
        key: u32,
        /// Whose part it names.
        owner: usize,
        /// The rank it was used for.
        rank: usize,
    },
    /// A window key of a window that is not (or no longer) registered.
    #[error("key {key:#010x} names window {window}, which is not registered on rank {rank}")]
    NoWindow {
        /// The key.
        key: u32,
        /// The window.
        window: u32,
        /// The rank.
        rank: usize,
    },
    /// A range outside its region.
    #[error(
        "{len} bytes at {addr:#x} fall outside the region of key {key:#010x} ({size} bytes at {base:#x})"
    )]
    OutOfBounds {
        /// The key.
        key: u32,
        /// The range's start.
        addr: u64,
        /// Its bytes.
        len: u64,
        /// The region's start.
        base: u64,
        /// Its bytes.
        size: u64,
    },
    /// An access the region does not allow.
    #[error("{region} (key {key:#010x}) does not allow {access}")]
    Access {
        /// The key.
        key: u32,
        /// What it names.
        region: Region,
        /// What was asked.
        access: Access,
    },
    /// An atomic at an address that is not 8-byte aligned.
    #[error("atomic at unaligned address {addr:#x}")]
    Unaligned {
        /// The address.
        addr: u64,
    },
    /// Without atomics, a fetch-add where this NIC is not the only writer.
    #[error(
        "fetch-add at {addr:#x} of rank {rank}: without atomics this NIC adds only where it is \
         the only writer (this rank's signal sub-slots and its counters)"
    )]
    NotSoleWriter {
        /// The address.
        addr: u64,
        /// The rank.
        rank: usize,
    },
    /// A compare-and-swap on an executor without atomics.
    #[error("compare-and-swap at {addr:#x}: this NIC's executor has no atomics")]
    NoCompareSwap {
        /// The address.
        addr: u64,
    },
    /// The executor did not carry the work out.
    #[error(transparent)]
    Exec(ExecError),
}

/// An error completion the engine wrote: the WQE, its syndrome and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QpFault {
    /// The queue's position in the engine's list.
    pub queue: usize,
    /// Its QP number.
    pub qpn: u32,
    /// The rank it reaches.
    pub peer: usize,
    /// The WQE's (64-bit) index.
    pub index: u64,
    /// The mlx5 syndrome of the error CQE.
    pub syndrome: u8,
    /// Why.
    pub cause: Cause,
}

impl fmt::Display for QpFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "QP {:#x} to rank {}: WQE index {} completed with syndrome {:#04x} ({}): {}",
            self.qpn,
            self.peer,
            self.index,
            self.syndrome,
            syndrome::name(self.syndrome),
            self.cause
        )
    }
}

/// The first error completion of each queue, shared with other threads:
/// the engine records a fault here before it publishes the error CQE, so a
/// poller that sees the CQE finds the reason (hardware gives only the
/// syndrome).
#[derive(Debug)]
pub struct FaultLog(Vec<OnceLock<QpFault>>);

impl FaultLog {
    /// A log for `queues` queues.
    pub(super) fn new(queues: usize) -> Self {
        Self((0..queues).map(|_| OnceLock::new()).collect())
    }

    /// The first error completion of queue `queue` (the engine's order).
    pub fn get(&self, queue: usize) -> Option<&QpFault> {
        self.0.get(queue).and_then(OnceLock::get)
    }

    /// Some queue's first error completion, if any queue has one.
    pub fn any(&self) -> Option<&QpFault> {
        self.0.iter().find_map(OnceLock::get)
    }

    pub(super) fn record(&self, f: &QpFault) {
        if let Some(slot) = self.0.get(f.queue) {
            let _ = slot.set(f.clone());
        }
    }
}
