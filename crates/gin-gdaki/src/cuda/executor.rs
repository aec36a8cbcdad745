//! The soft NIC's executor on CUDA ranks: one CUDA stream per channel (a
//! context's QP to a peer and its companion), asynchronous and in order.
//!
//! Every call only queues work on the channel's stream, through a
//! [`StreamBatch`]: a write's data as a copy, an 8-byte value (an inline
//! write, a running total) as a store (`cuStreamWriteValue64`), a read as a
//! copy the other way; [`Executor::publish`] queues the CQE's stores after
//! them, and [`Executor::end_pass`] hands the batch to the driver, so a
//! kernel that sees a CQE sees the work before it. The copy engine has no
//! atomics: the executor declares [`Atomics::RunningTotals`], and the
//! engine hands over running totals of this rank's signal sub-slots and
//! counters as 8-byte writes. An atomic's old value goes to the sink, in
//! process memory that nothing on the GPU reads.
//!
//! A counter's totals land in the order the engine assigned them. One
//! counter slot serves every channel of its context (one per peer: their
//! companions count it), each with its own stream, and a stream may still
//! be busy with a long copy when another stores the counter's next total:
//! the earlier total would land last and take the counter back, and a
//! kernel waiting for the later one would time out. So a total that goes
//! to another channel's stream than the counter's previous total is
//! queued behind a wait for an event recorded on that stream after it
//! (`cuEventRecord`, `cuStreamWaitEvent`; one event per stream, made on
//! first use and recorded again at each hand-over), both streams' pending
//! work handed over first (this stream's need not wait); a total on the
//! same stream as the previous one costs nothing more (see
//! [`TotalOrder`]). The wait may also cover work the other stream was
//! handed after the previous total (the event is recorded at the
//! hand-over): later, never wrong. A signal's sub-slot needs none of this:
//! each context has its own signal slots (`signal_slot(ctx, id)` in
//! gin.cuh), and this rank's sub-slot of a slot at a peer is written only
//! through the one QP pair of that context to that peer, so its totals
//! are in one stream's order already.
//!
//! Peers reached over a keyed transport (tcp, ucx) go through the fabric.
//! Where the transport takes GPU memory ([`Fabric::takes_device_memory`]:
//! ucx with its CUDA transports), a write's source goes to it directly and
//! a read lands directly ([`Fabric::read_device_key`]), each after the
//! channel's stream has executed everything queued before it (flushed and
//! waited for, unless no copy or window store was queued since the last
//! wait: CQE and counter stores write no window). Writes are pipelined and
//! never waited for on the NIC's thread: each is started
//! ([`Transport::start_put_device`], numbered per peer) and returned
//! [`WriteStatus::Pending`]; [`Executor::write_done`] polls
//! [`Transport::device_puts_completed`], so the engine publishes the CQE
//! that covers a write (and a WAIT on it passes) only once the transport is
//! done with its source. An 8-byte value (an inline write, a running total)
//! is put ordered after them ([`Transport::put_ordered`]) at once where the
//! transport orders it without waiting (`GIN_UCX_GPU_ORDER=fence`); where
//! it would wait ([`Transport::ordered_waits_for_device_puts`], ucx's
//! default) and writes to the peer are in flight, it is held, in a queue
//! per peer that keeps the peer's values in issue order, and sent
//! ([`Transport::put_ordered_after`]) once the writes before it completed,
//! and only then counted released. A failure there, or of the writes
//! (the transport names the write that failed where it can:
//! [`Transport::device_put_failed`]), is the peer's from its queue's front
//! on: every entry not yet released fails with it. A counter's total is
//! stored at once: the engine runs a companion's counter only after its
//! WAIT on the main queue passed, which it passes only once the CQE of
//! the writes it waits for was published, i.e. once they completed. A read completes the peer's writes
//! first ([`Transport::complete_device`]: they may read what it
//! overwrites) and sends what was held for them; [`Executor::quiesce`]
//! (and the executor's drop) complete every write still in flight.
//! The queue per peer, and the merging of writes that continue one
//! another, are gin-cuda's [`DevicePuts`]: where merging is on (the
//! engine's set-up: `GIN_PUT_MERGE_MAX`, 4 MiB by default), a write from
//! GPU memory starts only at the end of the pass ([`Executor::end_pass`], or before
//! anything that must follow it), merged with the pass's writes to the
//! peer whose destinations and sources it continues, and each original
//! still completes (and fails, named) on its own; a write refused at start
//! bars its peer at once: nothing after it is started or sent there.
//! Otherwise a
//! write's source is staged through pinned host memory on the channel's
//! stream (waited for) and sent with [`Fabric::put_key`], and a read's
//! answer comes with [`Fabric::read_key`] into the pinned buffer and is
//! copied to the GPU (waited for). An 8-byte value (an inline write, a
//! running total) is sent as is, ordered after every earlier request to
//! the peer ([`Fabric::put_key_ordered`]), so a signal's total never
//! overtakes the data it counts. A transport failure is
//! [`ExecError::Transport`].
//!
//! Windows come from the fabric's directory, GPU windows
//! ([`Memory::Device`]) only; every address handed to a stream is checked
//! here again against the window's sizes, the counter array or the CQE,
//! right where it is used.
//!
//! With a [`StallWatch`] ([`CudaExecutor::watch_stalls`], as the NIC runs),
//! every batch handed to a channel's stream ends with the channel's next
//! mark, so that work a stream has not completed for seconds is diagnosed
//! as a stall (see `gin_cuda::batch::stall`).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use gin_cuda::CudaError;
use gin_cuda::batch::stall::StallWatch;
use gin_cuda::batch::{BatchStats, Dma, Gpu, StreamBatch, TotalOrder, follow, region};
use gin_cuda::puts::{DevicePut, DevicePuts, Held, Note, PutError, Ticket};
use gin_cuda::staging::{STAGE, Stage};
use gin_net::{Fabric, MemDesc, Memory, NetError, Reach};

use crate::nic::{
    Atomics, Channel, CqStore, ExecError, Executor, Loc, Part, Payload, ReadStatus, ReadTicket,
    Region, Sink, SoleWriter, WriteStatus, WriteTicket,
};

/// A collapsed CQ in device memory: the device address of its one 64-byte
/// CQE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DevCq(pub(crate) u64);

/// A channel's stream and the work queued for it but not yet handed over.
struct Lane<S> {
    stream: S,
    batch: StreamBatch,
    /// No copy and no store into a window was queued since the stream was
    /// last waited for: window memory is as the earlier WQEs left it,
    /// without a wait (CQE and counter stores may be pending: the
    /// transport touches neither).
    idle: bool,
}

/// Where the executor stores, besides windows: what the set-up laid out.
#[derive(Debug, Clone)]
pub(crate) struct Layout {
    /// Channels (streams) to make.
    pub channels: usize,
    /// The signal window's id: its sub-slots are where this rank's NIC is
    /// the only writer.
    pub signal_window: u32,
    /// Device address of the counter array: 16 bytes a slot, the NIC's
    /// running total first.
    pub counters: u64,
    /// Slots of the counter array.
    pub counter_slots: u64,
}

/// CUDA streams as the soft NIC's [`Executor`] (see the module
/// documentation).
pub(crate) struct CudaExecutor<G: Gpu> {
    gpu: G,
    fabric: Arc<Fabric>,
    rank: usize,
    layout: Layout,
    sink: Arc<Sink>,
    /// One per channel, made on the driver thread ([`Executor::enter`]).
    lanes: Vec<Lane<G::Stream>>,
    /// Per channel, the event its stream records when a counter's next
    /// total goes to another channel's stream (made on first use).
    events: Vec<Option<G::Event>>,
    /// Per counter slot, the channel whose stream stored its last total.
    totals: TotalOrder,
    /// Pinned staging for peers over keyed transports (`None`: none).
    stage: Option<Stage>,
    /// Watches the streams for stalls, stream `i` being channel `i`'s
    /// (kept until the streams were synchronised: they store its marks).
    stalls: Option<Arc<StallWatch>>,
    /// GPU window descriptions by id, as of directory `generation` (a few
    /// windows: a scan beats hashing on the per-WQE path).
    windows: Vec<(u32, Arc<MemDesc>)>,
    /// Per peer written from GPU memory: writes in flight and what is held
    /// behind them, and the writes of the current pass waiting to be
    /// merged.
    puts: DevicePuts<ExecError>,
    /// Writes in flight and held values, by ticket: their entries.
    tickets: HashMap<u64, Ticket>,
    next_ticket: u64,
    generation: u64,
    /// What keeps the memory the streams store into alive (the CQEs).
    _keep: Box<dyn std::any::Any + Send>,
}

impl<G: Gpu> std::fmt::Debug for CudaExecutor<G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaExecutor")
            .field("rank", &self.rank)
            .field("layout", &self.layout)
            .field("lanes", &self.lanes.len())
            .field("staging", &self.stage.is_some())
            .finish_non_exhaustive()
    }
}

/// Hands everything queued for channel `ch` to its stream (`l`'s), after
/// the channel's next mark where `stalls` watches it.
fn hand<S: Dma>(
    l: &mut Lane<S>,
    ch: Channel,
    stalls: Option<&Arc<StallWatch>>,
) -> Result<(), ExecError> {
    if let Some(w) = stalls {
        // SAFETY: `l` is channel `ch`'s stream, the watch's stream `ch`;
        // the executor keeps the watch until its streams were synchronised.
        unsafe { w.mark(ch, &mut l.batch, &l.stream, Instant::now()) }
            .map_err(cuda("cuStreamWriteValue64"))?;
    }
    l.batch.flush(&l.stream).map_err(cuda("queueing"))
}

/// A driver call's failure.
fn cuda(what: &'static str) -> impl Fn(CudaError) -> ExecError {
    move |e| ExecError::Driver {
        why: format!("{what}: {e}"),
    }
}

fn net(peer: usize) -> impl Fn(NetError) -> ExecError {
    move |e| ExecError::Transport {
        peer,
        why: e.to_string(),
    }
}

fn malformed(why: String) -> ExecError {
    ExecError::Malformed { why }
}

/// An 8-byte value of a payload: inline data and totals reach GPU memory
/// as one aligned store.
fn qword(b: &[u8]) -> Result<u64, ExecError> {
    let v: [u8; 8] = b.try_into().map_err(|_| {
        malformed(format!(
            "inline write of {} bytes: this NIC writes inline data to GPU memory 8 aligned bytes at a time",
            b.len()
        ))
    })?;
    Ok(u64::from_le_bytes(v))
}

impl<G: Gpu> CudaExecutor<G> {
    /// An executor on `gpu` over `fabric`'s GPU windows, writing atomics'
    /// old values to `sink`.
    ///
    /// # Safety
    /// `layout.counters` must be `layout.counter_slots * 16` bytes of
    /// device memory that the streams of `gpu` may write until the executor
    /// was quiesced and dropped, and so must every CQ the engine hands to
    /// [`Executor::publish`] (64 bytes at its address; `keep` may hold
    /// them); the device windows in `fabric`'s directory must be what their
    /// descriptions say while streams may copy to and from them.
    pub(crate) unsafe fn new(
        gpu: G,
        fabric: Arc<Fabric>,
        layout: Layout,
        sink: Arc<Sink>,
        stage: Option<Stage>,
        keep: Box<dyn std::any::Any + Send>,
    ) -> Self {
        let slots = usize::try_from(layout.counter_slots).unwrap_or(usize::MAX);
        Self {
            gpu,
            rank: fabric.rank(),
            puts: DevicePuts::new(fabric.clone(), 0),
            fabric,
            totals: TotalOrder::new(slots),
            layout,
            sink,
            lanes: Vec::new(),
            events: Vec::new(),
            stage,
            stalls: None,
            windows: Vec::new(),
            generation: u64::MAX,
            tickets: HashMap::new(),
            next_ticket: 0,
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

    /// Watches the channels' streams with `w` (its stream `i` is channel
    /// `i`'s): every batch handed to a stream carries a mark from then on.
    pub(crate) fn watch_stalls(&mut self, w: Arc<StallWatch>) {
        self.stalls = Some(w);
    }

    /// Whether `peer` is reached over a keyed transport (tcp): staged.
    fn keyed(&self, peer: usize) -> bool {
        peer != self.rank && self.fabric.reach(peer) == Some(Reach::Keyed)
    }

    fn lane(&mut self, ch: Channel) -> Result<&mut Lane<G::Stream>, ExecError> {
        let n = self.lanes.len();
        self.lanes.get_mut(ch).ok_or_else(|| {
            malformed(format!(
                "no stream for channel {ch} ({n} made: the executor was not entered)"
            ))
        })
    }

    /// Queues an 8-byte store on the channel's stream; `window`: into
    /// window memory (an inline write), which a later transport request
    /// must wait for (not a counter or a CQE).
    ///
    /// # Safety
    /// `addr` 8 aligned bytes of device memory the stream may write until
    /// it has executed the store.
    unsafe fn store(
        &mut self,
        ch: Channel,
        addr: u64,
        v: u64,
        window: bool,
    ) -> Result<(), ExecError> {
        let l = self.lane(ch)?;
        l.idle &= !window;
        // SAFETY: the caller's contract.
        unsafe { l.batch.write(&l.stream, addr, v) }.map_err(cuda("cuStreamWriteValue64"))
    }

    /// GPU window `id`'s description, from the cache unless the directory
    /// changed (a removed window must not resolve any more).
    fn desc(&mut self, id: u32) -> Option<Arc<MemDesc>> {
        let g = self.fabric.generation();
        if g != self.generation {
            self.windows.clear();
            self.generation = g;
        }
        if let Some((_, d)) = self.windows.iter().find(|(w, _)| *w == id) {
            return Some(d.clone());
        }
        let d = self
            .fabric
            .window(id)
            .ok()
            .filter(|d| d.memory == Memory::Device)?;
        self.windows.push((id, d.clone()));
        Some(d)
    }

    /// The window `l` lies in, with its bounds checked.
    fn window_of(&mut self, l: Loc) -> Result<(u32, Arc<MemDesc>), ExecError> {
        let Region::Window(id) = l.region else {
            return Err(malformed(format!("{} is not a window", l.region)));
        };
        let d = self.desc(id).ok_or_else(|| ExecError::Refused {
            peer: l.rank,
            why: format!("window {id} is not a registered GPU window"),
        })?;
        let size = d.size_of(l.rank);
        if l.offset.checked_add(l.len).is_none_or(|e| e > size) {
            return Err(ExecError::Refused {
                peer: l.rank,
                why: format!(
                    "{} bytes at offset {} exceed rank {}'s {size} bytes of window {id}",
                    l.len, l.offset, l.rank
                ),
            });
        }
        Ok((id, d))
    }

    /// The device address of `l`, a window part mapped here (this rank's
    /// own, or a peer's through CUDA IPC), checked.
    fn mapped(&mut self, l: Loc) -> Result<(u32, u64), ExecError> {
        let (id, d) = self.window_of(l)?;
        let base = if l.rank == self.rank {
            d.local_addr()
        } else {
            d.peer_addr(l.rank)
        };
        if base == 0 {
            return Err(ExecError::Refused {
                peer: l.rank,
                why: format!("rank {}'s part of window {id} is not mapped here", l.rank),
            });
        }
        Ok((id, base + l.offset))
    }

    /// The window and device address of a write's source `src`: as many
    /// bytes of this rank's window part as `dst` takes, checked.
    fn source(&mut self, src: Loc, dst: Loc) -> Result<(u32, u64), ExecError> {
        if src.rank != self.rank || src.len != dst.len {
            return Err(malformed(format!(
                "a write of {} bytes from rank {}'s memory into {} bytes",
                src.len, src.rank, dst.len
            )));
        }
        self.mapped(src)
    }

    /// The key and offset `l` has at its rank, reached over tcp, checked.
    fn keyed_at(&mut self, l: Loc) -> Result<(u32, u64), ExecError> {
        let (id, d) = self.window_of(l)?;
        match d.key_of(l.rank) {
            0 => Err(ExecError::Refused {
                peer: l.rank,
                why: format!(
                    "rank {}'s part of window {id} is not served over tcp",
                    l.rank
                ),
            }),
            k => Ok((k, l.offset)),
        }
    }

    /// An 8-byte value into this rank's counters (a running total) or
    /// sink (an atomic's old value), stored at once.
    fn local_qword(&mut self, ch: Channel, dst: Loc, v: &[u8]) -> Result<WriteStatus, ExecError> {
        if dst.rank != self.rank || !dst.offset.is_multiple_of(8) || dst.len != 8 {
            return Err(malformed(format!(
                "{} bytes at offset {} of rank {}'s {}: the NIC's own memory takes aligned qwords of this rank",
                dst.len, dst.offset, dst.rank, dst.region
            )));
        }
        if dst.region == Region::Sink {
            let slot = self.sink.slot((dst.offset / 8) as usize).ok_or_else(|| {
                malformed(format!("offset {} is outside {}", dst.offset, dst.region))
            })?;
            // The old value, big-endian as the engine hands it; nobody
            // reads it, so it needs no ordering with the stream.
            let b: [u8; 8] = v
                .try_into()
                .map_err(|_| malformed(format!("{} bytes for a qword", v.len())))?;
            slot.store(u64::from_ne_bytes(b), Ordering::Release);
            return Ok(WriteStatus::Done);
        }
        let v = qword(v)?;
        if dst.offset + 8 > self.layout.counter_slots * 16 || !dst.offset.is_multiple_of(16) {
            return Err(malformed(format!(
                "offset {} is not the NIC's sub-slot of one of this rank's {} counters",
                dst.offset, self.layout.counter_slots
            )));
        }
        let addr = self.layout.counters + dst.offset;
        // A counter counts completed WQEs, whose sources are free: the
        // fetch-add of a counter runs on a companion queue after a WAIT on
        // its main queue, which passes only once the CQE covering the
        // writes it waits for was published, and the engine publishes that
        // only once `write_done` found them complete. Writes to the peer
        // still in flight now are later ones the counter does not count;
        // holding the total behind them would let another channel's later
        // total for the same counter (one counter, many companions) be
        // stored first and this one after it, taking the counter back.
        // For the same reason a total that goes to another channel's stream
        // than the counter's previous one waits for that one first
        // (`order_total`).
        let slot = (dst.offset / 16) as usize;
        self.order_total(ch, slot)?;
        // SAFETY: the NIC's sub-slot of an existing counter (checked
        // above), which `new`'s caller keeps alive.
        unsafe { self.store(ch, addr, v, false) }?;
        self.totals.stored(slot, ch);
        Ok(WriteStatus::Done)
    }

    /// Orders counter `slot`'s next total, about to be queued on channel
    /// `ch`'s stream, after its previous one where another channel's
    /// stream stored that (see [`TotalOrder`]): that stream's work so far
    /// handed over and its event recorded after it, this stream's work so
    /// far handed over (it need not wait), then a wait for the event.
    /// Nothing for a total on the same stream as the previous one.
    fn order_total(&mut self, ch: Channel, slot: usize) -> Result<(), ExecError> {
        self.lane(ch)?;
        let Some(from) = self.totals.before(slot, ch) else {
            return Ok(());
        };
        let stalls = self.stalls.as_ref();
        hand(&mut self.lanes[from], from, stalls)?;
        hand(&mut self.lanes[ch], ch, stalls)?;
        let (lanes, events) = (&self.lanes, &mut self.events);
        follow(
            &self.gpu,
            &lanes[from].stream,
            &mut events[from],
            &lanes[ch].stream,
        )
        .map_err(cuda(
            "ordering a counter's totals (cuEventRecord, cuStreamWaitEvent)",
        ))
    }

    /// Hands everything queued on the channel's stream to the driver and
    /// waits for it: GPU memory the transport reads or writes next is as
    /// the WQEs before this one left it.
    fn drain(&mut self, ch: Channel) -> Result<(), ExecError> {
        if self.lane(ch)?.idle {
            return Ok(());
        }
        let l = &mut self.lanes[ch];
        hand(l, ch, self.stalls.as_ref())?;
        l.stream.sync().map_err(cuda("cuStreamSynchronize"))?;
        l.idle = true;
        Ok(())
    }

    /// A ticket for `t`'s entry, for the engine to poll.
    fn ticket(&mut self, t: Ticket) -> WriteTicket {
        let n = self.next_ticket;
        self.next_ticket += 1;
        self.tickets.insert(n, t);
        WriteTicket(n)
    }

    /// An 8-byte value to `peer` over a keyed transport, at `(key,
    /// offset)`: put ordered after every earlier request now (after the
    /// writes waiting to start), or held behind the writes from GPU memory
    /// to the peer where the transport would wait for them.
    fn send_value(
        &mut self,
        peer: usize,
        (key, offset): (u32, u64),
        b: &[u8],
    ) -> Result<WriteStatus, ExecError> {
        let bytes = qword(b)?.to_le_bytes();
        let held = Held { key, offset, bytes };
        Ok(match self.puts.send_ordered(peer, held, None)? {
            Some(t) => WriteStatus::Pending(self.ticket(t)),
            None => WriteStatus::Done,
        })
    }

    /// A window part's bytes to a peer over a keyed transport, after
    /// everything queued on the channel so far: handed to the transport
    /// directly where it takes GPU memory (in flight), else staged a chunk
    /// at a time.
    fn send(
        &mut self,
        ch: Channel,
        dst: Loc,
        at: (u32, u64),
        src: Loc,
    ) -> Result<WriteStatus, ExecError> {
        let (_, from) = self.source(src, dst)?;
        if self.fabric.takes_device_memory(dst.rank) {
            let (window, d) = self.window_of(src)?;
            self.drain(ch)?;
            let put = DevicePut {
                key: at.0,
                offset: at.1,
                window,
                src: from,
                len: dst.len,
                keep: d.keep.clone(),
            };
            // SAFETY: `dst.len` bytes of this rank's part at `from`
            // (checked above), GPU memory that no stream of this executor
            // writes (drained; only a read writes this rank's windows, and
            // one from this peer starts and completes the write first)
            // until the write is complete: the kernel reuses it only after
            // a CQE or counter covers it, which the engine publishes only
            // once `write_done` found it complete; a window is freed only
            // after a fence of every peer (which completes the write) or
            // once its kernels ended.
            let t = unsafe { self.puts.put(ch, dst.rank, put) }?;
            return Ok(WriteStatus::Pending(self.ticket(t)));
        }
        self.lane(ch)?;
        let Self {
            lanes,
            stage,
            fabric,
            stalls,
            ..
        } = self;
        let l = &mut lanes[ch];
        let stage = stage.as_mut().ok_or_else(no_stage(dst.rank))?;
        hand(l, ch, stalls.as_ref())?;
        let mut done = 0;
        while done < dst.len {
            let c = (dst.len - done).min(STAGE as u64);
            // SAFETY: inside this rank's part at `from` (checked above).
            let bytes = unsafe { stage.pull(&l.stream, from + done, c as usize) }
                .map_err(cuda("staging a write"))?;
            fabric
                .put_key(dst.rank, at.0, at.1 + done, bytes)
                .map_err(net(dst.rank))?;
            done += c;
        }
        Ok(WriteStatus::Done)
    }

    /// A peer's bytes over a keyed transport into this rank's part, after
    /// everything queued on the channel: read directly into GPU memory
    /// where the transport takes it, else a chunk at a time into pinned
    /// memory and copied to the GPU.
    fn fetch(&mut self, ch: Channel, src: Loc, dst: Loc) -> Result<(), ExecError> {
        let (key, off) = self.keyed_at(src)?;
        let (_, to) = self.mapped(dst)?;
        if self.fabric.takes_device_memory(src.rank) {
            // Earlier writes may read what this read overwrites (and what
            // was held behind them goes first, as it was issued).
            self.puts.settle(src.rank)?;
            self.drain(ch)?;
            // SAFETY: `src.len` (= `dst.len`, checked by the caller) bytes
            // of this rank's part at `to` (checked above), GPU memory no
            // stream of this executor touches until the read returned.
            return unsafe { self.fabric.read_device_key(src.rank, key, off, to, src.len) }
                .map_err(net(src.rank));
        }
        self.lane(ch)?;
        let Self {
            lanes,
            stage,
            fabric,
            stalls,
            ..
        } = self;
        let l = &mut lanes[ch];
        let peer = src.rank;
        let stage = stage.as_mut().ok_or_else(no_stage(peer))?;
        hand(l, ch, stalls.as_ref())?;
        let mut done = 0;
        while done < src.len {
            let c = (src.len - done).min(STAGE as u64);
            let at = off + done;
            // SAFETY: inside this rank's part at `to` (checked above).
            unsafe {
                stage.fetch(c as usize, &l.stream, to + done, |buf| {
                    fabric.read_key(peer, key, at, buf)
                })
            }
            .map_err(|e| match e {
                CudaError::Net(e) => net(peer)(e),
                e => cuda("staging a read")(e),
            })?;
            done += c;
        }
        Ok(())
    }
}

/// The soft NIC's executor errors in the queue of writes from GPU memory.
impl PutError for ExecError {
    fn net(peer: usize, e: NetError) -> Self {
        net(peer)(e)
    }

    /// The note follows the account.
    fn noted(self, note: &Note) -> Self {
        let add = |w: String| format!("{w} ({note})");
        match self {
            Self::Transport { peer, why } => Self::Transport {
                peer,
                why: add(why),
            },
            Self::Refused { peer, why } => Self::Refused {
                peer,
                why: add(why),
            },
            Self::Unsupported { why } => Self::Unsupported { why: add(why) },
            Self::Malformed { why } => Self::Malformed { why: add(why) },
            Self::Driver { why } => Self::Driver { why: add(why) },
        }
    }
}

fn no_stage(peer: usize) -> impl Fn() -> ExecError {
    move || {
        malformed(format!(
            "rank {peer} is reached over tcp, but no staging buffer was set up"
        ))
    }
}

impl<G: Gpu> Executor for CudaExecutor<G> {
    type Cq = DevCq;

    /// GPU windows only: a host window has no device address to copy.
    fn part(&mut self, window: u32, rank: usize) -> Option<Part> {
        let d = self.desc(window)?;
        Some(Part {
            base: *d.addrs.get(rank)?,
            size: *d.sizes.get(rank)?,
        })
    }

    fn write(&mut self, ch: Channel, dst: Loc, src: Payload<'_>) -> Result<WriteStatus, ExecError> {
        if let Region::Counters | Region::Sink = dst.region {
            let Payload::Bytes(b) = src else {
                return Err(malformed(format!("a copy into {}", dst.region)));
            };
            return self.local_qword(ch, dst, b);
        }
        if self.keyed(dst.rank) {
            let at = self.keyed_at(dst)?;
            return match src {
                Payload::Bytes(b) => self.send_value(dst.rank, at, b),
                Payload::Local(l) => self.send(ch, dst, at, l),
            };
        }
        let (id, to) = self.mapped(dst)?;
        match src {
            Payload::Bytes(b) => {
                let v = qword(b)?;
                if !to.is_multiple_of(8) {
                    return Err(malformed(format!(
                        "inline write to unaligned address {to:#x} (offset {} of window {id})",
                        dst.offset
                    )));
                }
                // An inline write or a signal's running total. Unlike a
                // counter's (`order_total`), a signal's totals need no
                // ordering across streams: each context has its own signal
                // slots, so this rank's sub-slot of a slot at the peer is
                // stored only through this channel (the context's one QP
                // pair to the peer), on its stream, in the engine's order.
                // SAFETY: 8 aligned bytes inside a window part mapped here
                // (checked above).
                unsafe { self.store(ch, to, v, true) }?;
                Ok(WriteStatus::Done)
            }
            Payload::Local(l) => {
                let (sid, from) = self.source(l, dst)?;
                let g = region(true, id, sid);
                let lane = self.lane(ch)?;
                lane.idle = false;
                // SAFETY: the destination lies in a window part mapped here,
                // the source in this rank's part (both checked), and `g`
                // names the two windows.
                unsafe { lane.batch.push(&lane.stream, to, from, dst.len as usize, g) }
                    .map_err(cuda("cuMemcpyAsync"))?;
                Ok(WriteStatus::Done)
            }
        }
    }

    /// Whether the write (or held value) `t` was released: the transport's
    /// writes to its peer up to it completed (asked without waiting), and
    /// what was held was sent. An entry released before a failure is done;
    /// any other fails with the peer's failure. The ticket is forgotten
    /// once answered done or failed.
    fn write_done(&mut self, t: WriteTicket) -> Result<bool, ExecError> {
        let Some(&e) = self.tickets.get(&t.0) else {
            return Err(malformed(format!("no write in flight has ticket {}", t.0)));
        };
        let r = self.puts.landed(e);
        if !matches!(r, Ok(false)) {
            self.tickets.remove(&t.0);
        }
        r
    }

    /// A copy on the channel's stream (mapped), or staged and waited for
    /// (keyed): ordered before later work either way.
    fn read(&mut self, ch: Channel, src: Loc, dst: Loc) -> Result<ReadStatus, ExecError> {
        if dst.rank != self.rank || src.len != dst.len || !matches!(dst.region, Region::Window(_)) {
            return Err(malformed(format!(
                "a read of {} bytes into {} bytes of rank {}'s {}: this NIC reads into this rank's window parts",
                src.len, dst.len, dst.rank, dst.region
            )));
        }
        if self.keyed(src.rank) {
            self.fetch(ch, src, dst)?;
            return Ok(ReadStatus::Done);
        }
        let (sid, from) = self.mapped(src)?;
        let (did, to) = self.mapped(dst)?;
        let g = region(false, sid, did);
        let lane = self.lane(ch)?;
        lane.idle = false;
        // SAFETY: the destination lies in this rank's part, the source in a
        // part mapped here (both checked), and `g` names the two windows.
        unsafe { lane.batch.push(&lane.stream, to, from, dst.len as usize, g) }
            .map_err(cuda("cuMemcpyAsync"))?;
        Ok(ReadStatus::Done)
    }

    fn read_done(&mut self, t: ReadTicket) -> Result<bool, ExecError> {
        Err(malformed(format!(
            "no read in flight has ticket {}: this executor's reads are ordered",
            t.0
        )))
    }

    fn fetch_add(&mut self, _: Channel, at: Loc, _: u64) -> Result<u64, ExecError> {
        Err(ExecError::Unsupported {
            why: format!(
                "fetch-add at offset {} of rank {}'s {}: the copy engine has no atomics",
                at.offset, at.rank, at.region
            ),
        })
    }

    fn compare_swap(&mut self, _: Channel, at: Loc, _: u64, _: u64) -> Result<u64, ExecError> {
        Err(ExecError::Unsupported {
            why: format!(
                "compare-and-swap at offset {} of rank {}'s {}: the copy engine has no atomics",
                at.offset, at.rank, at.region
            ),
        })
    }

    /// Queues the CQE's stores after the channel's work (the engine
    /// publishes a CQE past a write from GPU memory once it completed).
    fn publish(&mut self, ch: Channel, cq: &DevCq, stores: &[CqStore]) -> Result<(), ExecError> {
        if let Some(s) = stores
            .iter()
            .find(|s| !s.offset.is_multiple_of(8) || s.offset + 8 > 64)
        {
            return Err(ExecError::Driver {
                why: format!(
                    "a CQE store at offset {} outside the 64-byte collapsed CQE",
                    s.offset
                ),
            });
        }
        for s in stores {
            // An aligned qword of the queue's 64-byte CQE (checked above),
            // which `new`'s caller keeps alive.
            let (addr, v) = (cq.0 + s.offset as u64, u64::from_le_bytes(s.bytes));
            // SAFETY: that qword.
            unsafe { self.store(ch, addr, v, false) }?;
        }
        Ok(())
    }

    /// The pass's copies and stores reach the driver (nothing waits in a
    /// batch past a pass), with the channel's mark after them where stalls
    /// are watched.
    fn end_pass(&mut self, ch: Channel) -> Result<(), ExecError> {
        self.puts.issue();
        self.lane(ch)?;
        hand(&mut self.lanes[ch], ch, self.stalls.as_ref())
    }

    fn confirm(&self, peer: usize) -> Result<(), ExecError> {
        self.fabric.confirm(peer).map_err(net(peer))
    }

    fn health(&self) -> Result<(), ExecError> {
        self.fabric.health().map_err(net(self.rank))
    }

    fn atomics(&self) -> Atomics {
        Atomics::RunningTotals(SoleWriter {
            signal_window: self.layout.signal_window,
            counter_stride: 16,
        })
    }

    /// Makes the context current and one stream per channel.
    fn enter(&mut self) -> Result<(), ExecError> {
        self.gpu
            .enter()
            .map_err(cuda("making the context current"))?;
        while self.lanes.len() < self.layout.channels {
            let stream = self.gpu.stream().map_err(cuda("cuStreamCreate"))?;
            self.lanes.push(Lane {
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

    /// Waits for every stream; logs what reached the driver.
    fn quiesce(&mut self) -> Result<(), ExecError> {
        let mut calls = BatchStats::default();
        let mut first = self.puts.settle_all();
        for l in &self.lanes {
            first = first.and(l.stream.sync().map_err(cuda("cuStreamSynchronize")));
            calls += l.batch.stats;
        }
        tracing::debug!(
            rank = self.rank,
            copies = calls.copies,
            copy_calls = calls.copy_calls,
            copies_issued = calls.copies_issued,
            store_calls = calls.store_calls,
            gpu_writes = self.puts.stats().puts,
            gpu_writes_started = self.puts.stats().started,
            gpu_writes_unstarted = self.puts.stats().unstarted,
            "CUDA soft NIC streams drained"
        );
        first
    }
}

impl<G: Gpu> Drop for CudaExecutor<G> {
    /// Writes from GPU memory still in flight (an executor dropped without
    /// quiescing) are completed first: the memory is lent until then.
    fn drop(&mut self) {
        if let Err(e) = self.puts.settle_all() {
            tracing::warn!(rank = self.rank, %e, "writes from GPU memory failed while the soft NIC's CUDA executor was dropped");
        }
    }
}
