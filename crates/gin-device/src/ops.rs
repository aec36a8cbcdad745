//! What a put may do besides moving bytes: remote and local actions.

use crate::window::Window;

/// A signal id, local to a device communicator and context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SignalId(pub u32);

/// A counter id, local to a device communicator and context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CounterId(pub u32);

/// What a signal does to its slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignalOp {
    /// Add one.
    Inc,
    /// Add a value.
    Add(u64),
}

impl SignalOp {
    /// The amount added.
    pub fn amount(self) -> u64 {
        match self {
            Self::Inc => 1,
            Self::Add(v) => v,
        }
    }
}

/// How much a signal's arrival promises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Order {
    /// Every earlier put on the same context to the same peer is visible
    /// when the signal is.
    #[default]
    Strong,
    /// Only the signal's own put is visible when the signal is.
    Weak,
}

/// The remote action of a put.
#[derive(Debug, Clone, Copy, Default)]
pub enum Remote<'a> {
    /// Nothing beyond the data.
    #[default]
    None,
    /// Update signal `id` of the same context at the peer.
    Signal {
        /// The signal to update.
        id: SignalId,
        /// What to add to it.
        op: SignalOp,
        /// What its arrival promises about earlier puts.
        order: Order,
    },
    /// Update the 8-byte slot at `offset` in the peer's part of `window`
    /// (signals by window address).
    VaSignal {
        /// The window holding the slot.
        window: &'a Window,
        /// The slot's offset in the peer's part (8-byte aligned).
        offset: u64,
        /// What to add to it.
        op: SignalOp,
        /// What its arrival promises about earlier puts.
        order: Order,
    },
}

impl Remote<'_> {
    /// `Signal { id, op: Inc, order: Strong }`.
    pub fn signal_inc(id: u32) -> Self {
        Remote::Signal {
            id: SignalId(id),
            op: SignalOp::Inc,
            order: Order::Strong,
        }
    }

    /// `Signal { id, op: Add(v), order: Strong }`.
    pub fn signal_add(id: u32, v: u64) -> Self {
        Remote::Signal {
            id: SignalId(id),
            op: SignalOp::Add(v),
            order: Order::Strong,
        }
    }
}

/// The local action of a put: done when the source may be reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Local {
    /// Nothing: the caller learns of local completion by a flush.
    #[default]
    None,
    /// Add one to counter `id` of the same context.
    CounterInc(CounterId),
}

/// A group of ranks a barrier spans.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Team {
    /// Every rank.
    World,
    /// The ranks with this rank's local rank, one per host (NCCL's rail).
    Rail,
}

/// What a barrier guarantees about earlier puts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fence {
    /// Only synchronisation: earlier puts may still be in flight.
    None,
    /// Earlier puts of the barrier's context are visible at their targets
    /// once every rank has left the barrier.
    #[default]
    Context,
    /// Earlier puts of every context are visible (flushes all contexts).
    AllContexts,
}
