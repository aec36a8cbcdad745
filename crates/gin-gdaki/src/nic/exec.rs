//! What the engine asks of whatever moves bytes: the [`Executor`] trait and
//! the checked locations it is handed.

use std::fmt;

/// An ordering domain of an executor: work handed over on one channel
/// executes in the order it was handed over (a CUDA stream; the fabric,
/// which completes everything before returning, has one order for all).
/// The engine gives each queue a channel; a QP and the companion that waits
/// on it share one.
pub type Channel = usize;

/// A memory region the NIC knows a key for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Region {
    /// A window part ([`crate::ids::window_key`]); which rank's is the
    /// [`Loc::rank`].
    Window(u32),
    /// This rank's counter array ([`crate::ids::COUNTER_KEY`]).
    Counters,
    /// This rank's atomic result sink ([`crate::ids::SINK_KEY`]).
    Sink,
}

impl fmt::Display for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Window(id) => write!(f, "window {id}"),
            Self::Counters => f.write_str("the counter array"),
            Self::Sink => f.write_str("the atomic result sink"),
        }
    }
}

/// `len` bytes at `offset` of `rank`'s part of `region`: what a WQE's
/// (key, address) names once the engine checked key, bounds and access.
/// Executors check again what they rely on for memory safety: a `Loc` is
/// a request, not a proof.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Loc {
    /// The rank whose memory it is.
    pub rank: usize,
    /// The region.
    pub region: Region,
    /// Byte offset in the rank's part of the region.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// Where a window part is, as WQEs name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    /// The address WQEs name the part's first byte by (its owner's own
    /// address of it).
    pub base: u64,
    /// Bytes in the part.
    pub size: u64,
}

/// What a write carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Payload<'a> {
    /// Bytes of this rank's memory.
    Local(Loc),
    /// Bytes carried in the request (an inline WQE, a running total, an
    /// atomic's old value).
    Bytes(&'a [u8]),
}

/// How a read went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadStatus {
    /// The data is where it belongs, or queued ahead of everything handed
    /// over later on the channel.
    Done,
    /// The data is on its way: ask [`Executor::read_done`] with this
    /// ticket. The engine holds the queue at this WQE until then.
    Pending(ReadTicket),
}

/// An executor's name for a read in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ReadTicket(pub u64);

/// How a write went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteStatus {
    /// Done, or queued ahead of everything handed over later on the
    /// channel.
    Done,
    /// In flight (a write from GPU memory the transport still reads, or a
    /// value the executor holds back behind such writes until they
    /// completed): ask [`Executor::write_done`] with this ticket. Later
    /// WQEs still execute; the completions of this one and of every later
    /// one on its queue wait until it completed.
    Pending(WriteTicket),
}

/// An executor's name for a write in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WriteTicket(pub u64);

/// One 8-byte store of a CQE: `bytes` at byte `offset` of the CQ's
/// memory. The engine hands a CQE's stores in the order they must become
/// visible, the one a poller checks last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CqStore {
    /// Byte offset in the CQ (a multiple of 8).
    pub offset: usize,
    /// The CQE's bytes there.
    pub bytes: [u8; 8],
}

/// How an executor does atomics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Atomics {
    /// Fetch-add and compare-swap happen at the target ([`Executor::fetch_add`],
    /// [`Executor::compare_swap`]).
    Native,
    /// The executor has no atomics (a copy engine). The engine executes a
    /// fetch-add only where this NIC is the only writer, keeping the running
    /// total itself and handing over an 8-byte write of it; anything else
    /// completes with a remote operation error.
    RunningTotals(SoleWriter),
}

/// Where a NIC without atomics is the only writer: the layout of CUDA
/// ranks' signal and counter sub-slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SoleWriter {
    /// The signal window: each slot has one 8-byte sub-slot per rank, and
    /// this rank's NIC is the only writer of its own sub-slot at any peer.
    pub signal_window: u32,
    /// Bytes per counter slot; the NIC's sub-slot is the first 8.
    pub counter_stride: u64,
}

/// Why an executor did not carry out a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ExecError {
    /// The peer cannot be reached or did not answer in time (a dead peer,
    /// a broken link, a read whose answer never came): the engine completes
    /// the WQE with "transport retry counter exceeded".
    #[error("rank {peer} is unreachable: {why}")]
    Transport {
        /// The rank.
        peer: usize,
        /// What the transport said.
        why: String,
    },
    /// The target refused the access (its part was revoked, its own checks
    /// failed): "remote access error".
    #[error("rank {peer} refused the access: {why}")]
    Refused {
        /// The rank.
        peer: usize,
        /// What it said.
        why: String,
    },
    /// The target memory cannot do this operation here (an atomic on memory
    /// only a copy engine reaches): "remote operation error".
    #[error("the operation is not supported there: {why}")]
    Unsupported {
        /// Why.
        why: String,
    },
    /// The request has a shape this executor cannot carry out (an inline
    /// write a copy engine cannot store): "local QP operation error".
    #[error("this executor cannot carry out the request as posted: {why}")]
    Malformed {
        /// Why.
        why: String,
    },
    /// The executor's own machinery failed (a driver call). On the data
    /// path it fails the WQE ("local QP operation error"); while publishing
    /// a completion it stops the engine.
    #[error("the executor failed: {why}")]
    Driver {
        /// What failed.
        why: String,
    },
}

/// What moves bytes for the soft NIC's [`crate::nic::Engine`]: the fabric
/// on CPU ranks ([`crate::nic::FabricExecutor`]), CUDA streams on CUDA
/// ranks, an in-memory [`crate::nic::Fake`] in tests.
///
/// The engine decodes and checks every WQE first (keys, bounds, access,
/// alignment, WAIT conditions, the error state), then hands the executor
/// [`Loc`]s. The contract:
///
/// - **Order.** Work handed over on one [`Channel`] takes effect in the
///   order it was handed over, and a completion published with
///   [`Executor::publish`] becomes visible only after all work handed over
///   before it on its channel. A synchronous executor (the fabric) meets
///   this by finishing each call before returning.
/// - **Reads** may finish later: [`ReadStatus::Pending`] holds the queue
///   at that WQE until [`Executor::read_done`] says the data landed.
/// - **Writes** may finish later: [`WriteStatus::Pending`] lets later WQEs
///   execute, but holds the queue's completions at that WQE until
///   [`Executor::write_done`] says it completed (its source may be reused).
///   A write to this rank's sink is never pending.
/// - **Atomics** return the old value at once ([`Atomics::Native`]), or the
///   executor declares it has none ([`Atomics::RunningTotals`]).
/// - **Errors** name the rank and what failed; the engine turns them into
///   error CQEs with the matching mlx5 syndrome and moves the QP to the
///   error state.
///
/// # An asynchronous, in-order executor (CUDA streams)
///
/// A CUDA executor queues work on one stream per channel (per context and
/// peer) and returns before it runs. It satisfies the contract as follows:
/// [`Executor::write`] and [`Executor::read`] queue a copy between mapped
/// device addresses (`cuMemcpyAsync`, batched) and return
/// [`ReadStatus::Done`]: "done" means "ordered before everything later on
/// the stream", which is all the engine relies on. An 8-byte
/// [`Payload::Bytes`] write to device memory is a stream store
/// (`cuStreamWriteValue64`). [`Executor::publish`] queues the CQE's stores
/// on the same stream, so the GPU sees a completion only after the data it
/// reports; a WAIT on the companion queue is satisfied once the main queue's
/// completion was *handed over*, and the companion's counter store queued
/// behind it on the same stream lands after the data. It declares
/// [`Atomics::RunningTotals`]: the copy engine has no fetch-add, so the
/// engine keeps this rank's signal sub-slot and counter totals and hands
/// over stores. [`Executor::end_pass`] hands batched copies and stores to
/// the driver. A peer reached over TCP is written by staging through
/// pinned memory and the fabric, waiting for the copy: slower, same
/// contract. [`Executor::enter`] creates the streams on the driver thread
/// and [`Executor::quiesce`] waits for them before it ends. This executor
/// is [`crate::cuda`]'s.
pub trait Executor {
    /// Where a queue's completion queue lives, as this executor writes it
    /// (a host memory view, a device address).
    type Cq;

    /// Where `rank`'s part of window `window` is, or `None` when there is
    /// no such window (never registered, or freed).
    fn part(&mut self, window: u32, rank: usize) -> Option<Part>;

    /// Writes `src` to `dst` (`dst.len` bytes) on channel `ch`: done, or
    /// in flight.
    fn write(&mut self, ch: Channel, dst: Loc, src: Payload<'_>) -> Result<WriteStatus, ExecError>;

    /// Reads `src` (remote) into `dst` (this rank's) on channel `ch`.
    fn read(&mut self, ch: Channel, src: Loc, dst: Loc) -> Result<ReadStatus, ExecError>;

    /// Whether the read `t` has landed; an error when it failed or its
    /// answer will not come (the executor keeps the clock).
    fn read_done(&mut self, t: ReadTicket) -> Result<bool, ExecError>;

    /// Whether the write `t` in flight has completed; an error when it
    /// failed or will not complete (the executor keeps the clock). Must not
    /// block. The default has no writes in flight.
    fn write_done(&mut self, t: WriteTicket) -> Result<bool, ExecError> {
        Err(ExecError::Malformed {
            why: format!("no write in flight has ticket {}", t.0),
        })
    }

    /// Adds `add` to the 8 bytes at `at`; returns the old value.
    fn fetch_add(&mut self, ch: Channel, at: Loc, add: u64) -> Result<u64, ExecError>;

    /// Swaps the 8 bytes at `at` to `swap` if they equal `compare`;
    /// returns the old value.
    fn compare_swap(
        &mut self,
        ch: Channel,
        at: Loc,
        compare: u64,
        swap: u64,
    ) -> Result<u64, ExecError>;

    /// Publishes a completion: `stores`, in order, into `cq`, after all
    /// work handed over before on `ch`. An error here stops the engine.
    fn publish(&mut self, ch: Channel, cq: &Self::Cq, stores: &[CqStore]) -> Result<(), ExecError>;

    /// The engine finished a pass over a queue of channel `ch`: hand over
    /// whatever was batched. An error here stops the engine.
    fn end_pass(&mut self, ch: Channel) -> Result<(), ExecError> {
        let _ = ch;
        Ok(())
    }

    /// Returns once every write handed over for `peer` so far was executed
    /// there, or with the first refusal. The engine does not call it (a
    /// write's CQE means "sent", as over a transport without remote
    /// acknowledgements); the host side's flush does, so a refused write is
    /// reported by the flush that covers it.
    fn confirm(&self, peer: usize) -> Result<(), ExecError>;

    /// The first failure seen outside any one operation (a link that died).
    fn health(&self) -> Result<(), ExecError>;

    /// How this executor does atomics.
    fn atomics(&self) -> Atomics {
        Atomics::Native
    }

    /// Called once on the driver's thread before the first step (a CUDA
    /// executor makes its context current there and creates its streams).
    /// An error stops the driver before it serves anything.
    fn enter(&mut self) -> Result<(), ExecError> {
        Ok(())
    }

    /// Called once on the driver's thread after the last step: returns once
    /// everything handed over has executed (a CUDA executor waits for its
    /// streams), so the memory it touches may be freed afterwards.
    fn quiesce(&mut self) -> Result<(), ExecError> {
        Ok(())
    }
}
