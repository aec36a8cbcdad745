//! What moves bytes and applies signals for the proxy [`Engine`]: the
//! [`Executor`] trait and the work items the engine hands it.
//!
//! The engine decides *what* happens and in which order (ring order,
//! batching, validation, running totals, completion); an executor decides
//! *how*: gin-net's fabric for CPU ranks (`FabricExecutor`, private to the crate), CUDA
//! streams for CUDA ranks, an in-memory fake for the step tests
//! ([`crate::testing::Fake`]).
//!
//! [`Engine`]: crate::Engine

use crate::error::ExecError;

/// Which ring a piece of work comes from: its index in the engine's ring
/// list (what [`Executor::publish`] and [`Executor::flush`] are keyed by),
/// its context and its peer (every operation of a ring goes to that peer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Site {
    /// Index of the ring in the engine's list.
    pub ring: usize,
    /// The ring's context.
    pub ctx: u32,
    /// The ring's peer.
    pub peer: usize,
}

/// A place in one rank's part of a window, already checked against the
/// directory: `offset` plus the operation's length fits the part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target<W> {
    /// The window as the executor's directory returned it.
    pub window: W,
    /// The window's id.
    pub id: u32,
    /// Byte offset in the part.
    pub offset: u64,
}

/// Where a put's bytes come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source<W> {
    /// This rank's part of a window.
    Window(Target<W>),
    /// One 8-byte little-endian word carried in the descriptor.
    Inline(u64),
}

/// A put's data: `bytes` bytes from `src` to `dst` in the peer's part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Data<W> {
    /// Destination in the peer's part.
    pub dst: Target<W>,
    /// Source.
    pub src: Source<W>,
    /// Length (8 for inline data).
    pub bytes: u64,
}

/// A put's signal: an 8-byte slot in the peer's part of the signal window.
///
/// Both representations of the update travel: `add`, for executors that
/// apply an atomic add at the target (the fabric: shm atomics, tcp), and
/// `total`, the running sum (wrapping) of every `add` this engine sent to
/// this (peer, window, offset), for executors that can only store (a CUDA
/// stream's `cuStreamWriteValue64` into this rank's own sub-slot of the
/// signal at the peer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Signal<W> {
    /// The slot.
    pub at: Target<W>,
    /// The amount to add.
    pub add: u64,
    /// The running total after this add.
    pub total: u64,
    /// A strong signal: every earlier put of the ring is visible first.
    pub strong: bool,
}

/// A put, with its optional signal. Either part may be absent (a signal
/// with no data, a zero-byte put that only counts).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Put<W> {
    /// The data, if any bytes move.
    pub data: Option<Data<W>>,
    /// The signal, applied after the data.
    pub signal: Option<Signal<W>>,
}

/// A get: `bytes` bytes from the peer's part at `remote` into this rank's
/// part at `local`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Get<W> {
    /// Source in the peer's part.
    pub remote: Target<W>,
    /// Destination in this rank's part.
    pub local: Target<W>,
    /// Length.
    pub bytes: u64,
}

/// How a get or a put was issued.
#[derive(Debug)]
pub enum Issued<P> {
    /// Complete, or ordered before everything the ring queues after it
    /// (so the next [`Executor::publish`] of the ring covers it).
    Ordered,
    /// In flight outside the ring's order (a tcp get whose answer comes
    /// when it comes; a put from GPU memory whose source the transport
    /// reads until it completes): the engine publishes nothing past it,
    /// and counts its counter, only once [`Executor::landed`] says it has
    /// landed. Meanwhile it goes on issuing what comes after it.
    InFlight(P),
}

/// What moves bytes and applies signals for the engine.
///
/// # Contract
///
/// The engine calls the operations of one ring in ring order, from one
/// thread. An executor must make their *effects* take place in that order
/// per ring: a put's data before its signal; a descriptor's counter after
/// its data has left the source; a publication after every effect queued
/// before it on the ring. How it does so is its business:
///
/// - **Synchronous** (gin-net's fabric, CPU ranks): every call completes
///   before it returns (a tcp put is written to the ordered link, and a
///   flush asks the peer to [`confirm`](Executor::confirm) it); a tcp get is
///   [`Issued::InFlight`] until its answer lands; `publish` is a release
///   store of the ring's consumer index.
/// - **In flight** (a CUDA rank's put from GPU memory to a transport that
///   takes it, ucx): the put is started and [`Issued::InFlight`]; its
///   signal is sent ordered after the data by the transport, or, where
///   the transport would block for that, held back by the executor and
///   sent when [`Executor::landed`] finds the put complete. The engine
///   publishes and counts it only then, so the kernel reuses the source
///   only once the transport is done with it.
/// - **Asynchronous, in order** (CUDA streams, one per ring): every call
///   only *queues* work on the ring's stream — a copy, then the signal's
///   running `total` as an 8-byte stream store (`cuStreamWriteValue64`),
///   then the counter's — and returns. `publish` queues the store of the
///   completion index in device memory after them, so a kernel that reads
///   the index sees the data, signals and counters before it; nothing
///   waits for the GPU. Gets are copies on the same stream, hence
///   [`Issued::Ordered`]. `flush` hands a batch of queued stores and copies
///   to the driver in one call at the end of each ring's batch. A peer
///   reached over tcp is served by staging through pinned memory and
///   waiting for the copy, which is synchronous and ordered too.
/// - **The fake** ([`crate::testing::Fake`]) does either, and can be told
///   to lose a peer, refuse a put, or hold completions back.
///
/// Publication is an executor operation, not a store the engine makes,
/// precisely so that an asynchronous executor can order it after the data.
///
/// An error from any call is final: the engine records it as the proxy's
/// first error and executes nothing more (fail-stop).
pub trait Executor {
    /// A window as the executor's directory describes it (the fabric's
    /// `Arc<MemDesc>`; for CUDA, the window's device addresses), handed
    /// back in [`Target`]s so the executor need not look it up again.
    type Window: Clone;
    /// A get or put in flight ([`Issued::InFlight`]).
    type InFlight;

    /// Looks a window up in the directory (`None`: not registered).
    fn window(&self, id: u32) -> Option<Self::Window>;
    /// The size of `owner`'s part of `window` (0 if it has none).
    fn part_size(&self, window: &Self::Window, owner: usize) -> u64;

    /// Called once on the driver thread before the first step (a CUDA
    /// executor makes its device's context current here).
    fn enter(&mut self) -> Result<(), ExecError> {
        Ok(())
    }

    /// A put to `site.peer`, with its signal after the data: done or
    /// ordered, or in flight until [`Executor::landed`] says it completed
    /// (its signal may be held back until then, never sent before its
    /// data).
    fn put(
        &mut self,
        site: Site,
        put: &Put<Self::Window>,
    ) -> Result<Issued<Self::InFlight>, ExecError>;

    /// A get from `site.peer`.
    fn get(
        &mut self,
        site: Site,
        get: &Get<Self::Window>,
    ) -> Result<Issued<Self::InFlight>, ExecError>;

    /// Whether a get or put in flight has landed (polled in ring order,
    /// the oldest first, never one behind an operation that has not; once
    /// it returns true the engine drops the handle). It must not block:
    /// an operation that will never land (a stopped peer) fails here in
    /// time, naming the peer.
    fn landed(&mut self, site: Site, op: &mut Self::InFlight) -> Result<bool, ExecError>;

    /// Counts one completed operation in counter `slot`, whose running total
    /// is then `total` (an executor that adds bumps by one; one that stores
    /// writes `total`). Called after the operation it counts.
    fn count(&mut self, site: Site, slot: u32, total: u64) -> Result<(), ExecError>;

    /// Publishes the ring's completion (consumer) index: every descriptor
    /// before `upto` is complete once the store lands, and their slots may
    /// be written again. Ordered after every effect issued before it on the
    /// ring.
    fn publish(&mut self, site: Site, upto: u64) -> Result<(), ExecError>;

    /// The end of the ring's batch: hands anything queued for the ring to
    /// the device (a CUDA executor's batched stream operations).
    fn flush(&mut self, site: Site) -> Result<(), ExecError> {
        let _ = site;
        Ok(())
    }

    /// Called once on the driver thread after the last step: waits for
    /// everything queued (a CUDA executor synchronizes its streams).
    fn quiesce(&mut self) -> Result<(), ExecError> {
        Ok(())
    }

    /// Returns once every put issued to `peer` has been accepted by the
    /// target, or with its refusal (tcp). Called by waiters, on any thread,
    /// after the completion index covers what they wait for.
    fn confirm(&self, peer: usize) -> Result<(), ExecError> {
        let _ = peer;
        Ok(())
    }

    /// Fails when the executor's transport or device is broken (a lost
    /// link). Waiters consult it besides the proxy's first error; the
    /// engine does not poll it: an operation that needs a lost peer fails
    /// by itself.
    fn health(&self) -> Result<(), ExecError> {
        Ok(())
    }
}
