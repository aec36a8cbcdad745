//! The executor of CUDA ranks: one CUDA stream per ring, asynchronous and
//! in order.
//!
//! Every call only queues work on the ring's stream, through a
//! [`StreamBatch`]: a put's data as a copy (an inline value as an 8-byte
//! store), then its signal as the engine's running `total` stored into this
//! rank's own sub-slot of the signal at the peer (`cuStreamWriteValue64`:
//! the copy engine has no atomics, and this rank is the only writer of that
//! sub-slot), then a counter's running total into the proxy's sub-slot of
//! the counter (`counters + slot * 16`). [`Executor::publish`] queues the
//! store of the ring's completion index (in device memory) after them, and
//! [`Executor::flush`] hands the batch to the driver, so a kernel that sees
//! the index sees the data, signals and counters before it; nothing waits
//! for the GPU.
//!
//! A counter's totals land in the order the engine assigned them. One
//! counter slot serves every ring of its context (one per peer), each
//! with its own stream, and a stream may still be busy with a long copy
//! when another stores the slot's next total: the earlier total would land
//! last and take the counter back, and a kernel waiting for the later one
//! would time out. So a total that goes to another ring's stream than the
//! slot's previous total is queued behind a wait for an event recorded on
//! that stream after it (`cuEventRecord`, `cuStreamWaitEvent`; one event
//! per stream, made on first use and recorded again at each hand-over),
//! both streams' pending work handed over first (this stream's need not
//! wait); a total on the same stream as the previous one costs nothing
//! more (see [`TotalOrder`]). The wait may also cover work the other
//! stream was handed after the previous total (the event is recorded at
//! the hand-over): later, never wrong. A signal's sub-slot needs none of
//! this: each context has its own signal slots (`signal_slot(ctx, id)` in
//! gin.cuh), and this rank's sub-slot of a slot at a peer is written only
//! through the one ring of that context to that peer, so its totals are
//! in one stream's order already.
//!
//! Peers reached over a keyed transport (tcp, ucx) go through the fabric.
//! Where the transport takes GPU memory ([`Fabric::takes_device_memory`]:
//! ucx with its CUDA transports), a put's source goes to it directly and a
//! get lands directly ([`Fabric::read_device_key`]), each after the ring's
//! stream has executed every copy or window store queued before it
//! (flushed and waited for, unless none was queued since the last wait;
//! counter and completion-index stores write no window). Puts are
//! pipelined and never waited for on the engine's thread: each is started
//! ([`Transport::start_put_device`], numbered per peer) and returned
//! [`Issued::InFlight`]; [`Executor::landed`] polls
//! [`Transport::device_puts_completed`] and says it landed once the
//! transport is done with its source, so the engine counts its counter
//! and publishes the ring's completion index past it only then. A
//! signal's running total is put ordered after the data
//! ([`Transport::put_ordered`]) at once where the transport orders it
//! without waiting (`GIN_UCX_GPU_ORDER=fence`); where it would wait
//! ([`Transport::ordered_waits_for_device_puts`], ucx's default), the
//! total is held back, in a queue per peer that keeps every total to the
//! peer in issue order, until the puts before it completed, and sent then
//! ([`Transport::put_ordered_after`]) before its put is said to have
//! landed (an entry is released only once its total was sent). A failure
//! there, or of the puts (the transport names the put that failed where it
//! can: [`Transport::device_put_failed`]), is the peer's from its queue's
//! front on: every put not yet landed fails with it. A get into this
//! rank's memory completes every put to the peer
//! first ([`Transport::complete_device`]: they may read what it
//! overwrites) and sends the totals held for it; [`Executor::quiesce`]
//! (and the executor's drop) complete every put still in flight.
//! The queue per peer, and the merging of puts that continue one
//! another, are gin-cuda's [`DevicePuts`]: where merging is on (the
//! engine's set-up: `GIN_PUT_MERGE_MAX`, 4 MiB by default), a put from
//! GPU memory starts only at the end of the pass ([`Executor::flush`], or before
//! anything that must follow it), merged with the pass's puts to the
//! peer whose destinations and sources it continues, and each original
//! still completes (and fails, named) on its own; a put refused at start
//! bars its peer at once: nothing after it is started or sent there.
//! Otherwise a
//! put's source is staged through pinned host memory on the ring's stream
//! (waited for) and sent with [`Fabric::put_key`], and a get's answer is
//! read with [`Fabric::read_key`] into the pinned buffer and copied to the
//! GPU (waited for). Either way a put's signal follows as an 8-byte put of
//! the running total ordered after the data ([`Fabric::put_key_ordered`]),
//! and the counter's and completion index's stores are queued on the
//! stream only after the data left.
//!
//! Windows come from the fabric's directory, GPU windows
//! ([`Memory::Device`]) only; every address handed to a stream is checked
//! here again against the window's sizes, right where it is used.
//!
//! With a [`StallWatch`] ([`CudaExecutor::watch_stalls`], as the proxy
//! runs), every batch handed to a ring's stream ends with the ring's next
//! mark, so that work a stream has not completed for seconds is diagnosed
//! as a stall (see `gin_cuda::batch::stall`).

use std::sync::Arc;
use std::time::Instant;

use gin_cuda::CudaError;
use gin_cuda::batch::stall::StallWatch;
use gin_cuda::batch::{BatchStats, Dma, Gpu, StreamBatch, TotalOrder, follow, region};
use gin_cuda::puts::{DevicePut, DevicePuts, Held, Note, PutError, Ticket};
use gin_cuda::staging::{STAGE, Stage};
use gin_net::{Fabric, MemDesc, Memory, NetError, Reach};

use crate::error::ExecError;
use crate::executor::{Data, Executor, Get, Issued, Put, Signal, Site, Source, Target};
use crate::fabric::net;

/// A ring's stream and the work queued for it but not yet handed over.
struct Queue<S> {
    stream: S,
    batch: StreamBatch,
    /// No copy and no store into a window was queued since the stream was
    /// last waited for: window memory is as the earlier descriptors left
    /// it, without a wait (counter and completion-index stores may be
    /// pending: the transport touches neither).
    idle: bool,
}

/// A put from GPU memory in flight, or one whose signal is held back
/// ([`Executor::InFlight`]): its entry in the peer's queue of
/// [`DevicePuts`].
pub(crate) type PutInFlight = Ticket;

/// Where the executor stores: what the device communicator laid out.
#[derive(Debug, Clone)]
pub(crate) struct Layout {
    /// The signal window's id: a signal names this rank's sub-slot of it.
    pub signal_window: u32,
    /// Device address of the counter array (16 bytes a slot, the proxy's
    /// running total first).
    pub counters: u64,
    /// Slots of the counter array.
    pub counter_slots: u64,
    /// Device address of each ring's completion index, by engine ring
    /// index.
    pub done: Vec<u64>,
}

/// CUDA streams as an [`Executor`] (see the module documentation).
pub(crate) struct CudaExecutor<G: Gpu> {
    gpu: G,
    fabric: Arc<Fabric>,
    layout: Layout,
    /// One per ring, made on the driver thread ([`Executor::enter`]).
    queues: Vec<Queue<G::Stream>>,
    /// Per ring, the event its stream records when a counter's next total
    /// goes to another ring's stream (made on first use).
    events: Vec<Option<G::Event>>,
    /// Per counter slot, the ring whose stream stored its last total.
    totals: TotalOrder,
    /// Pinned staging for peers over keyed transports (`None`: none).
    stage: Option<Stage>,
    /// Watches the streams for stalls, stream `i` being ring `i`'s (kept
    /// until the streams were synchronised: they store its marks).
    stalls: Option<Arc<StallWatch>>,
    /// Per peer reached with puts from GPU memory: those in flight and the
    /// totals held behind them, and the puts of the current pass waiting
    /// to be merged.
    puts: DevicePuts<ExecError>,
    /// What keeps the memory `layout` names alive while streams may still
    /// store into it (the index array).
    _keep: Box<dyn std::any::Any + Send>,
}

impl<G: Gpu> std::fmt::Debug for CudaExecutor<G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaExecutor")
            .field("rank", &self.fabric.rank())
            .field("layout", &self.layout)
            .field("queues", &self.queues.len())
            .field("staging", &self.stage.is_some())
            .finish_non_exhaustive()
    }
}

/// Hands everything queued for ring `i` to its stream `q`, after the
/// ring's next mark where `stalls` watches it.
fn hand<S: Dma>(
    q: &mut Queue<S>,
    i: usize,
    stalls: Option<&Arc<StallWatch>>,
) -> Result<(), ExecError> {
    if let Some(w) = stalls {
        // SAFETY: `q` is ring `i`'s stream, the watch's stream `i`; the
        // executor keeps the watch until its streams were synchronised.
        unsafe { w.mark(i, &mut q.batch, &q.stream, Instant::now()) }
            .map_err(cuda("cuStreamWriteValue64"))?;
    }
    q.batch.flush(&q.stream).map_err(cuda("queueing"))
}

/// A driver call's failure as an executor error.
fn cuda(what: &'static str) -> impl Fn(CudaError) -> ExecError {
    move |e| ExecError::Device {
        what,
        why: e.to_string(),
    }
}

fn invalid(why: String) -> ExecError {
    ExecError::Invalid { why }
}

impl<G: Gpu> CudaExecutor<G> {
    /// An executor on `gpu` over `fabric`'s GPU windows.
    ///
    /// # Safety
    /// `layout.counters` must be `layout.counter_slots * 16` bytes of
    /// device memory, and each `layout.done[i]` 8 aligned bytes of device
    /// memory, that the streams of `gpu` may write until the executor was
    /// quiesced and dropped (`keep` may hold them); the device windows in
    /// `fabric`'s directory must be what their descriptions say while
    /// streams may copy to and from them.
    pub(crate) unsafe fn new(
        gpu: G,
        fabric: Arc<Fabric>,
        layout: Layout,
        stage: Option<Stage>,
        keep: Box<dyn std::any::Any + Send>,
    ) -> Self {
        let slots = usize::try_from(layout.counter_slots).unwrap_or(usize::MAX);
        Self {
            gpu,
            puts: DevicePuts::new(fabric.clone(), 0),
            fabric,
            totals: TotalOrder::new(slots),
            layout,
            queues: Vec::new(),
            events: Vec::new(),
            stage,
            stalls: None,
            _keep: keep,
        }
    }

    /// Merges the puts from GPU memory that continue one another within
    /// a pass into transport puts of up to `max` bytes (0: none merged,
    /// each started as it comes, as a new executor does); before the first
    /// put (see `gin_cuda::puts`).
    pub(crate) fn merge_puts(&mut self, max: u64) {
        self.puts = DevicePuts::new(self.fabric.clone(), max);
    }

    /// Watches the rings' streams with `w` (its stream `i` is ring `i`'s):
    /// every batch handed to a stream carries a mark from then on.
    pub(crate) fn watch_stalls(&mut self, w: Arc<StallWatch>) {
        self.stalls = Some(w);
    }

    /// Whether `peer` is reached over a keyed transport (tcp): staged.
    fn keyed(&self, peer: usize) -> bool {
        self.fabric.reach(peer) == Some(Reach::Keyed)
    }

    fn queue(&mut self, site: Site) -> Result<&mut Queue<G::Stream>, ExecError> {
        let n = self.queues.len();
        self.queues.get_mut(site.ring).ok_or_else(|| {
            invalid(format!(
                "no stream for ring {} ({n} made: the executor was not entered)",
                site.ring
            ))
        })
    }

    /// Queues an 8-byte store on the ring's stream; `window`: into window
    /// memory (an inline put, a signal), which a later transport request
    /// must wait for (not a counter or the completion index).
    ///
    /// # Safety
    /// `addr` 8 aligned bytes of device memory the stream may write until
    /// it has executed the store.
    unsafe fn store(
        &mut self,
        site: Site,
        addr: u64,
        v: u64,
        window: bool,
    ) -> Result<(), ExecError> {
        let q = self.queue(site)?;
        q.idle &= !window;
        // SAFETY: the caller's contract.
        unsafe { q.batch.write(&q.stream, addr, v) }.map_err(cuda("cuStreamWriteValue64"))
    }

    /// Orders counter `slot`'s next total, about to be queued on `ring`'s
    /// stream, after its previous one where another ring's stream stored
    /// that (see [`TotalOrder`]): that stream's work so far handed over
    /// and its event recorded after it, this stream's work so far handed
    /// over (it need not wait), then a wait for the event. Nothing for a
    /// total on the same stream as the previous one.
    fn order_total(&mut self, site: Site, slot: usize) -> Result<(), ExecError> {
        self.queue(site)?;
        let ring = site.ring;
        let Some(from) = self.totals.before(slot, ring) else {
            return Ok(());
        };
        let stalls = self.stalls.as_ref();
        hand(&mut self.queues[from], from, stalls)?;
        hand(&mut self.queues[ring], ring, stalls)?;
        let (queues, events) = (&self.queues, &mut self.events);
        follow(
            &self.gpu,
            &queues[from].stream,
            &mut events[from],
            &queues[ring].stream,
        )
        .map_err(cuda(
            "ordering a counter's totals (cuEventRecord, cuStreamWaitEvent)",
        ))
    }

    /// The device address of this rank's `bytes` at `t`, checked.
    fn local(&self, t: &Target<Arc<MemDesc>>, bytes: u64) -> Result<u64, ExecError> {
        let rank = self.fabric.rank();
        let size = t.window.size_of(rank);
        if t.window.local_base == 0 || t.offset.checked_add(bytes).is_none_or(|e| e > size) {
            return Err(invalid(format!(
                "{bytes} bytes at offset {} exceed rank {rank}'s {size} bytes of window {}",
                t.offset, t.id
            )));
        }
        Ok(t.window.local_addr() + t.offset)
    }

    /// The device address of `peer`'s `bytes` at `t`, mapped here, checked.
    fn mapped(peer: usize, t: &Target<Arc<MemDesc>>, bytes: u64) -> Result<u64, ExecError> {
        let (base, size) = (t.window.peer_addr(peer), t.window.size_of(peer));
        if base == 0 {
            return Err(invalid(format!(
                "rank {peer}'s part of window {} is not mapped here",
                t.id
            )));
        }
        if t.offset.checked_add(bytes).is_none_or(|e| e > size) {
            return Err(invalid(format!(
                "{bytes} bytes at offset {} exceed rank {peer}'s {size} bytes of window {}",
                t.offset, t.id
            )));
        }
        Ok(base + t.offset)
    }

    /// The key `peer` serves its part of `t`'s window under.
    fn key(peer: usize, t: &Target<Arc<MemDesc>>) -> Result<u32, ExecError> {
        match t.window.key_of(peer) {
            0 => Err(invalid(format!(
                "rank {peer}'s part of window {} is not served over tcp",
                t.id
            ))),
            k => Ok(k),
        }
    }

    /// A put's data to a peer mapped here: a copy, or an inline store.
    fn copy_data(&mut self, site: Site, d: &Data<Arc<MemDesc>>) -> Result<(), ExecError> {
        let dst = Self::mapped(site.peer, &d.dst, d.bytes)?;
        match &d.src {
            Source::Inline(v) => {
                if !dst.is_multiple_of(8) {
                    return Err(invalid(format!(
                        "inline put at offset {} of window {} is not 8-byte aligned",
                        d.dst.offset, d.dst.id
                    )));
                }
                // SAFETY: 8 aligned bytes inside the peer's part as mapped
                // here (checked above).
                unsafe { self.store(site, dst, *v, true) }
            }
            Source::Window(t) => {
                let src = self.local(t, d.bytes)?;
                let g = region(true, d.dst.id, t.id);
                let q = self.queue(site)?;
                q.idle = false;
                // SAFETY: the destination lies in the peer's part as mapped
                // here, the source in this rank's part (both checked), and
                // `g` names the two windows.
                unsafe { q.batch.push(&q.stream, dst, src, d.bytes as usize, g) }
                    .map_err(cuda("cuMemcpyAsync"))
            }
        }
    }

    /// Hands everything queued on the ring's stream to the driver and
    /// waits for it: GPU memory the transport reads or writes next is as
    /// the descriptors before this one left it.
    fn drain(&mut self, site: Site) -> Result<(), ExecError> {
        if self.queue(site)?.idle {
            return Ok(());
        }
        let q = &mut self.queues[site.ring];
        hand(q, site.ring, self.stalls.as_ref())?;
        q.stream.sync().map_err(cuda("cuStreamSynchronize"))?;
        q.idle = true;
        Ok(())
    }

    /// A put's signal to a peer over a keyed transport: its running total
    /// put ordered after the data now, or held back behind the puts from
    /// GPU memory to the peer (this one's, `started`, and earlier ones)
    /// where the transport would wait for them; then in flight.
    fn send_signal(
        &mut self,
        peer: usize,
        s: &Signal<Arc<MemDesc>>,
        key: u32,
        started: Option<PutInFlight>,
    ) -> Result<Option<PutInFlight>, ExecError> {
        let held = Held {
            key,
            offset: s.at.offset,
            bytes: s.total.to_le_bytes(),
        };
        self.puts.send_ordered(peer, held, started)
    }

    /// A put's data to a peer over a keyed transport: an inline value
    /// sent as is (after the puts from GPU memory waiting to start; never
    /// where a put to the peer was refused at start: then it is in flight
    /// and fails with that), a
    /// window's bytes handed to the transport directly where it takes GPU
    /// memory (in flight: its entry returned; started at the end of the
    /// pass, merged with the puts it continues), else staged a chunk at a
    /// time, after everything queued so far.
    fn send_data(
        &mut self,
        site: Site,
        d: &Data<Arc<MemDesc>>,
    ) -> Result<Option<PutInFlight>, ExecError> {
        let peer = site.peer;
        let key = Self::key(peer, &d.dst)?;
        let (src, window) = match &d.src {
            Source::Inline(v) => {
                // Nothing goes to a peer barred by a put refused at start
                // (or failed): the value fails in its place, unsent.
                if let Some(t) = self.puts.barred(peer) {
                    return Ok(Some(t));
                }
                self.puts.issue();
                return self
                    .fabric
                    .put_key(peer, key, d.dst.offset, &v.to_le_bytes())
                    .map(|()| None)
                    .map_err(|e| net(peer, e));
            }
            Source::Window(t) => (self.local(t, d.bytes)?, t.id),
        };
        if self.fabric.takes_device_memory(peer) {
            self.drain(site)?;
            let put = DevicePut {
                key,
                offset: d.dst.offset,
                window,
                src,
                len: d.bytes,
                keep: t_keep(d),
            };
            // SAFETY: `d.bytes` of this rank's part at `src` (checked
            // above), GPU memory that no stream of this executor writes
            // (drained; only a get writes this rank's windows, and one to
            // this peer starts and completes the put first) until the put
            // is complete: the kernel handed it over with the descriptor
            // and reuses it only once the completion index or a counter
            // covers it, which the engine publishes or counts only once
            // `landed` found the put complete; a window is freed only after
            // a fence of every peer (which completes the put) or once its
            // kernels ended (published: complete).
            return unsafe { self.puts.put(site.ring, peer, put) }.map(Some);
        }
        self.queue(site)?;
        let Self {
            queues,
            stage,
            fabric,
            stalls,
            ..
        } = self;
        let q = &mut queues[site.ring];
        let stage = stage.as_mut().ok_or_else(no_stage(peer))?;
        hand(q, site.ring, stalls.as_ref())?;
        let mut at = 0;
        while at < d.bytes {
            let c = (d.bytes - at).min(STAGE as u64);
            // SAFETY: inside this rank's part at `src` (checked above).
            let bytes = unsafe { stage.pull(&q.stream, src + at, c as usize) }
                .map_err(cuda("staging a put"))?;
            fabric
                .put_key(peer, key, d.dst.offset + at, bytes)
                .map_err(|e| net(peer, e))?;
            at += c;
        }
        Ok(None)
    }

    /// Where a put's signal goes, checked before any of the put is
    /// queued: this rank's own sub-slot of the signal at the peer, mapped
    /// here or named by the peer's key.
    fn signal_at(&self, peer: usize, s: &Signal<Arc<MemDesc>>) -> Result<SignalAt, ExecError> {
        let (rank, n) = (self.fabric.rank() as u64, self.fabric.nranks() as u64);
        if s.at.id != self.layout.signal_window
            || !s.at.offset.is_multiple_of(8)
            || (s.at.offset / 8) % n.max(1) != rank
        {
            return Err(invalid(format!(
                "signal at offset {} of window {} is not this rank's sub-slot of a signal",
                s.at.offset, s.at.id
            )));
        }
        if self.keyed(peer) {
            Ok(SignalAt::Key(Self::key(peer, &s.at)?))
        } else {
            Ok(SignalAt::Mapped(Self::mapped(peer, &s.at, 8)?))
        }
    }

    /// A put's signal: this rank's running total, stored after the data
    /// (mapped), or put ordered after the data (keyed: see
    /// [`CudaExecutor::send_signal`]); `started`: the entry of the put's
    /// data, if it is in flight. The put is in flight while
    /// its data is or its total is held.
    ///
    /// Unlike a counter's ([`CudaExecutor::order_total`]), a signal's
    /// totals need no ordering across streams: each context has its own
    /// signal slots, so this rank's sub-slot of a slot at the peer is
    /// stored only through this ring (the context's one ring to the peer),
    /// on its stream, in the order the engine assigned the totals.
    fn signal(
        &mut self,
        site: Site,
        s: &Signal<Arc<MemDesc>>,
        at: SignalAt,
        started: Option<PutInFlight>,
    ) -> Result<Option<PutInFlight>, ExecError> {
        match at {
            SignalAt::Key(key) => self.send_signal(site.peer, s, key, started),
            SignalAt::Mapped(addr) => {
                // SAFETY: this rank's 8-aligned sub-slot inside the peer's
                // part of the signal window as mapped here (checked by
                // `signal_at`).
                unsafe { self.store(site, addr, s.total, true) }?;
                Ok(None)
            }
        }
    }

    /// A get from a peer over a keyed transport, after everything queued:
    /// read directly into GPU memory where the transport takes it, else a
    /// chunk at a time into pinned memory and copied to the GPU.
    fn fetch(&mut self, site: Site, get: &Get<Arc<MemDesc>>) -> Result<(), ExecError> {
        let peer = site.peer;
        let key = Self::key(peer, &get.remote)?;
        let dst = self.local(&get.local, get.bytes)?;
        if self.fabric.takes_device_memory(peer) {
            // Earlier puts may read what this read overwrites (and the
            // totals held behind them go first, as they were issued).
            self.puts.settle(peer)?;
            self.drain(site)?;
            // SAFETY: `get.bytes` of this rank's part at `dst` (checked
            // above), GPU memory no stream of this executor touches until
            // the read returned (drained; nothing is queued meanwhile).
            return unsafe {
                self.fabric
                    .read_device_key(peer, key, get.remote.offset, dst, get.bytes)
            }
            .map_err(|e| net(peer, e));
        }
        self.queue(site)?;
        let Self {
            queues,
            stage,
            fabric,
            stalls,
            ..
        } = self;
        let q = &mut queues[site.ring];
        let stage = stage.as_mut().ok_or_else(no_stage(peer))?;
        hand(q, site.ring, stalls.as_ref())?;
        let mut at = 0;
        while at < get.bytes {
            let c = (get.bytes - at).min(STAGE as u64);
            let off = get.remote.offset + at;
            // SAFETY: inside this rank's part at `dst` (checked above).
            unsafe {
                stage.fetch(c as usize, &q.stream, dst + at, |buf| {
                    fabric.read_key(peer, key, off, buf)
                })
            }
            .map_err(|e| match e {
                CudaError::Net(e) => net(peer, e),
                e => cuda("staging a get")(e),
            })?;
            at += c;
        }
        Ok(())
    }
}

/// Where a signal goes (see [`CudaExecutor::signal_at`]).
#[derive(Debug, Clone, Copy)]
enum SignalAt {
    /// The device address of the sub-slot, mapped here.
    Mapped(u64),
    /// The key the peer serves its signal part under.
    Key(u32),
}

fn no_stage(peer: usize) -> impl Fn() -> ExecError {
    move || {
        invalid(format!(
            "rank {peer} is reached over tcp, but no staging buffer was set up"
        ))
    }
}

impl<G: Gpu> Executor for CudaExecutor<G> {
    type Window = Arc<MemDesc>;
    type InFlight = PutInFlight;

    /// GPU windows only: a host window has no device address to copy.
    fn window(&self, id: u32) -> Option<Arc<MemDesc>> {
        self.fabric
            .window(id)
            .ok()
            .filter(|w| w.memory == Memory::Device)
    }

    fn part_size(&self, window: &Arc<MemDesc>, owner: usize) -> u64 {
        window.size_of(owner)
    }

    /// Makes the context current and one stream per ring.
    fn enter(&mut self) -> Result<(), ExecError> {
        self.gpu
            .enter()
            .map_err(cuda("making the context current"))?;
        while self.queues.len() < self.layout.done.len() {
            let stream = self.gpu.stream().map_err(cuda("cuStreamCreate"))?;
            self.queues.push(Queue {
                stream,
                batch: StreamBatch::default(),
                // Unknown until first waited for.
                idle: false,
            });
            self.events.push(None);
        }
        if let Some(w) = &self.stalls {
            w.log_start();
        }
        Ok(())
    }

    /// Every address of the put is checked before any of it is queued, so
    /// a put this executor refuses never half-happens. In flight while its
    /// data (from GPU memory, handed to the transport) is, or its signal's
    /// total is held back behind puts to the peer.
    fn put(
        &mut self,
        site: Site,
        put: &Put<Arc<MemDesc>>,
    ) -> Result<Issued<PutInFlight>, ExecError> {
        let sig = match &put.signal {
            Some(s) => Some((s, self.signal_at(site.peer, s)?)),
            None => None,
        };
        let mut started = None;
        if let Some(d) = &put.data {
            if self.keyed(site.peer) {
                started = self.send_data(site, d)?;
            } else {
                self.copy_data(site, d)?;
            }
        }
        let flight = match sig {
            Some((s, at)) => self.signal(site, s, at, started)?,
            None => started,
        };
        Ok(flight.map_or(Issued::Ordered, Issued::InFlight))
    }

    /// A copy on the ring's stream (mapped), or staged and waited for
    /// (keyed): ordered either way.
    fn get(
        &mut self,
        site: Site,
        get: &Get<Arc<MemDesc>>,
    ) -> Result<Issued<PutInFlight>, ExecError> {
        if self.keyed(site.peer) {
            self.fetch(site, get)?;
            return Ok(Issued::Ordered);
        }
        let src = Self::mapped(site.peer, &get.remote, get.bytes)?;
        let dst = self.local(&get.local, get.bytes)?;
        let g = region(false, get.remote.id, get.local.id);
        let q = self.queue(site)?;
        q.idle = false;
        // SAFETY: the destination lies in this rank's part, the source in
        // the peer's part as mapped here (both checked), and `g` names the
        // two windows.
        unsafe { q.batch.push(&q.stream, dst, src, get.bytes as usize, g) }
            .map_err(cuda("cuMemcpyAsync"))?;
        Ok(Issued::Ordered)
    }

    /// Whether the put's entry was released: the transport's puts to the
    /// peer up to it completed (asked without waiting) and a total held
    /// behind them was sent. An entry released before a failure landed;
    /// any other fails with the peer's failure.
    fn landed(&mut self, _: Site, op: &mut PutInFlight) -> Result<bool, ExecError> {
        self.puts.landed(*op)
    }

    /// Stores the running total into the proxy's sub-slot of the counter
    /// (the engine counts an operation in flight once it landed).
    fn count(&mut self, site: Site, slot: u32, total: u64) -> Result<(), ExecError> {
        let slots = self.layout.counter_slots;
        if u64::from(slot) >= slots {
            return Err(invalid(format!(
                "counter slot {slot} does not exist ({slots} slots)"
            )));
        }
        let at = self.layout.counters + u64::from(slot) * 16;
        let slot = slot as usize;
        self.order_total(site, slot)?;
        // SAFETY: the proxy's sub-slot of an existing counter (checked
        // above) of the counter array, which `new`'s caller keeps alive.
        unsafe { self.store(site, at, total, false) }?;
        self.totals.stored(slot, site.ring);
        Ok(())
    }

    /// Queues the store of the ring's completion index after its work (the
    /// engine publishes past a put from GPU memory once it landed).
    fn publish(&mut self, site: Site, upto: u64) -> Result<(), ExecError> {
        let at = *self
            .layout
            .done
            .get(site.ring)
            .ok_or_else(|| invalid(format!("no ring {} to publish into", site.ring)))?;
        // SAFETY: the ring's completion index, which `new`'s caller keeps
        // alive.
        unsafe { self.store(site, at, upto, false) }
    }

    /// The batch's signals, counters and completion index (and an inline
    /// put's value) reach the driver together, with the ring's mark after
    /// them where stalls are watched.
    fn flush(&mut self, site: Site) -> Result<(), ExecError> {
        self.puts.issue();
        self.queue(site)?;
        hand(&mut self.queues[site.ring], site.ring, self.stalls.as_ref())
    }

    /// Waits for every stream; logs what reached the driver. Whatever is
    /// still pending in a batch belongs to a descriptor that failed (the
    /// engine flushes every batch it hands over) and is dropped.
    fn quiesce(&mut self) -> Result<(), ExecError> {
        let mut calls = BatchStats::default();
        let mut first = self.puts.settle_all();
        for q in &self.queues {
            first = first.and(q.stream.sync().map_err(cuda("cuStreamSynchronize")));
            calls += q.batch.stats;
        }
        tracing::debug!(
            rank = self.fabric.rank(),
            copies = calls.copies,
            copy_calls = calls.copy_calls,
            copies_issued = calls.copies_issued,
            store_calls = calls.store_calls,
            gpu_puts = self.puts.stats().puts,
            gpu_puts_started = self.puts.stats().started,
            gpu_puts_unstarted = self.puts.stats().unstarted,
            "CUDA proxy streams drained"
        );
        first
    }
}

impl<G: Gpu> Drop for CudaExecutor<G> {
    /// Puts from GPU memory still in flight (an executor dropped without
    /// quiescing) are completed first: the memory is lent until then.
    fn drop(&mut self) {
        if let Err(e) = self.puts.settle_all() {
            tracing::warn!(rank = self.fabric.rank(), %e, "puts from GPU memory failed while the CUDA proxy's executor was dropped");
        }
    }
}

/// The proxy's executor errors in the queue of puts from GPU memory.
impl PutError for ExecError {
    fn net(peer: usize, e: NetError) -> Self {
        net(peer, e)
    }

    /// The note follows the account (`why`, or what was waited for).
    fn noted(self, note: &Note) -> Self {
        let add = |w: String| format!("{w} ({note})");
        match self {
            Self::Unreachable { peer, why } => Self::Unreachable {
                peer,
                why: add(why),
            },
            Self::Refused { peer, why } => Self::Refused {
                peer,
                why: add(why),
            },
            Self::Timeout { peer, what, waited } => Self::Timeout {
                peer,
                what: add(what),
                waited,
            },
            Self::Invalid { why } => Self::Invalid { why: add(why) },
            Self::Transport { why } => Self::Transport { why: add(why) },
            Self::Device { what, why } => Self::Device {
                what,
                why: add(why),
            },
        }
    }
}

/// What keeps the source of a put from GPU memory alive while the
/// transport reads it: the window's, where its description holds one.
fn t_keep(d: &Data<Arc<MemDesc>>) -> Option<gin_net::KeepAlive> {
    match &d.src {
        Source::Window(t) => t.window.keep.clone(),
        Source::Inline(_) => None,
    }
}
