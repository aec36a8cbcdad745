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
//! Peers reached over a keyed transport (tcp, ucx) go through the fabric.
//! Where the transport takes GPU memory ([`Fabric::takes_device_memory`]:
//! ucx with its CUDA transports), a write's source goes to it directly and
//! a read lands directly ([`Fabric::read_device_key`]), each after the
//! channel's stream has executed everything queued before it (flushed and
//! waited for, unless nothing was queued since the last wait). Writes are
//! pipelined: each is started ([`Transport::start_put_device`]), many are
//! in flight, and a channel's are completed
//! ([`Transport::complete_device`]) before anything that says their source
//! may be reused or that the GPU may write it: the channel's CQE, a
//! counter's total, a read, [`Executor::quiesce`] (and the executor's
//! drop). An 8-byte value is put ordered after them
//! ([`Transport::put_ordered`]: ucx waits for them first unless
//! `GIN_UCX_GPU_ORDER=fence`). Otherwise a
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

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use gin_cuda::CudaError;
use gin_cuda::batch::stall::StallWatch;
use gin_cuda::batch::{BatchStats, Dma, Gpu, StreamBatch, region};
use gin_cuda::staging::{STAGE, Stage};
use gin_net::{Fabric, MemDesc, Memory, NetError, Reach, Transport};

use crate::nic::{
    Atomics, Channel, CqStore, ExecError, Executor, Loc, Part, Payload, ReadStatus, ReadTicket,
    Region, Sink, SoleWriter,
};

/// A collapsed CQ in device memory: the device address of its one 64-byte
/// CQE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DevCq(pub(crate) u64);

/// A channel's stream and the work queued for it but not yet handed over.
struct Lane<S> {
    stream: S,
    batch: StreamBatch,
    /// Nothing was queued since the stream was last waited for: GPU
    /// memory is as the earlier WQEs left it, without a wait.
    idle: bool,
    /// Peers with writes from GPU memory started on this channel and not
    /// yet completed ([`CudaExecutor::settle`]).
    started: Vec<usize>,
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
    /// Pinned staging for peers over keyed transports (`None`: none).
    stage: Option<Stage>,
    /// Watches the streams for stalls, stream `i` being channel `i`'s
    /// (kept until the streams were synchronised: they store its marks).
    stalls: Option<Arc<StallWatch>>,
    /// GPU window descriptions by id, as of directory `generation` (a few
    /// windows: a scan beats hashing on the per-WQE path).
    windows: Vec<(u32, Arc<MemDesc>)>,
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
        Self {
            gpu,
            rank: fabric.rank(),
            fabric,
            layout,
            sink,
            lanes: Vec::new(),
            stage,
            stalls: None,
            windows: Vec::new(),
            generation: u64::MAX,
            _keep: keep,
        }
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

    /// Queues an 8-byte store on the channel's stream.
    ///
    /// # Safety
    /// `addr` 8 aligned bytes of device memory the stream may write until
    /// it has executed the store.
    unsafe fn store(&mut self, ch: Channel, addr: u64, v: u64) -> Result<(), ExecError> {
        let l = self.lane(ch)?;
        l.idle = false;
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

    /// An 8-byte value into this rank's counters (a running total) or sink
    /// (an atomic's old value).
    fn local_qword(&mut self, ch: Channel, dst: Loc, v: &[u8]) -> Result<(), ExecError> {
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
            return Ok(());
        }
        let v = qword(v)?;
        // A counter counts completed WQEs: their sources are free.
        self.settle(ch)?;
        if dst.offset + 8 > self.layout.counter_slots * 16 || !dst.offset.is_multiple_of(16) {
            return Err(malformed(format!(
                "offset {} is not the NIC's sub-slot of one of this rank's {} counters",
                dst.offset, self.layout.counter_slots
            )));
        }
        // SAFETY: the NIC's sub-slot of an existing counter (checked
        // above), which `new`'s caller keeps alive.
        unsafe { self.store(ch, self.layout.counters + dst.offset, v) }
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

    /// The transport that reaches `peer`.
    fn transport(&self, peer: usize) -> Result<&Arc<dyn Transport>, ExecError> {
        self.fabric
            .path(peer)
            .map(gin_net::Path::transport)
            .ok_or_else(|| {
                net(peer)(NetError::NoPath {
                    peer,
                    nranks: self.fabric.nranks(),
                })
            })
    }

    /// Completes the writes from GPU memory started on channel `ch`: the
    /// transport reads none of their sources any more, also when this
    /// fails (every peer's are completed; the first failure).
    fn settle(&mut self, ch: Channel) -> Result<(), ExecError> {
        let peers = std::mem::take(&mut self.lane(ch)?.started);
        let mut first = Ok(());
        for peer in peers {
            let done = self.transport(peer).and_then(|t| {
                t.complete_device(peer, self.fabric.timeout())
                    .map_err(net(peer))
            });
            first = first.and(done);
        }
        first
    }

    /// [`CudaExecutor::settle`] for every channel; the first failure.
    fn settle_all(&mut self) -> Result<(), ExecError> {
        let mut first = Ok(());
        for ch in 0..self.lanes.len() {
            first = first.and(self.settle(ch));
        }
        first
    }

    /// A window part's bytes to a peer over a keyed transport, after
    /// everything queued on the channel so far: handed to the transport
    /// directly where it takes GPU memory, else staged a chunk at a time.
    fn send(&mut self, ch: Channel, dst: Loc, at: (u32, u64), src: Loc) -> Result<(), ExecError> {
        let (_, from) = self.source(src, dst)?;
        if self.fabric.takes_device_memory(dst.rank) {
            let keep = self.window_of(src)?.1.keep.clone();
            self.drain(ch)?;
            let peer = dst.rank;
            let to = gin_net::Target::Key {
                key: at.0,
                offset: at.1,
            };
            // SAFETY: `dst.len` bytes of this rank's part at `from`
            // (checked above), GPU memory that no stream of this executor
            // writes (drained) until the write is settled: before the
            // channel's next CQE, counter, read or quiesce, whatever queues
            // a write after it; the kernel reuses it only after a CQE or
            // counter, and a window is freed only after a fence of every
            // peer (which completes the write) or once its kernels ended.
            unsafe {
                self.transport(peer)?
                    .start_put_device(peer, to, from, dst.len, keep)
            }
            .map_err(net(peer))?;
            let l = self.lane(ch)?;
            if !l.started.contains(&peer) {
                l.started.push(peer);
            }
            return Ok(());
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
        Ok(())
    }

    /// A peer's bytes over a keyed transport into this rank's part, after
    /// everything queued on the channel: read directly into GPU memory
    /// where the transport takes it, else a chunk at a time into pinned
    /// memory and copied to the GPU.
    fn fetch(&mut self, ch: Channel, src: Loc, dst: Loc) -> Result<(), ExecError> {
        let (key, off) = self.keyed_at(src)?;
        let (_, to) = self.mapped(dst)?;
        if self.fabric.takes_device_memory(src.rank) {
            // Earlier writes may read what this read overwrites.
            self.settle(ch)?;
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

    fn write(&mut self, ch: Channel, dst: Loc, src: Payload<'_>) -> Result<(), ExecError> {
        if let Region::Counters | Region::Sink = dst.region {
            let Payload::Bytes(b) = src else {
                return Err(malformed(format!("a copy into {}", dst.region)));
            };
            return self.local_qword(ch, dst, b);
        }
        if self.keyed(dst.rank) {
            let at = self.keyed_at(dst)?;
            return match src {
                Payload::Bytes(b) => {
                    qword(b)?;
                    self.fabric
                        .put_key_ordered(dst.rank, at.0, at.1, b)
                        .map_err(net(dst.rank))
                }
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
                // SAFETY: 8 aligned bytes inside a window part mapped here
                // (checked above).
                unsafe { self.store(ch, to, v) }
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
                    .map_err(cuda("cuMemcpyAsync"))
            }
        }
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

    /// Queues the CQE's stores after the channel's work, once its writes
    /// from GPU memory completed.
    fn publish(&mut self, ch: Channel, cq: &DevCq, stores: &[CqStore]) -> Result<(), ExecError> {
        self.settle(ch)?;
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
            // SAFETY: an aligned qword of the queue's 64-byte CQE (checked
            // above), which `new`'s caller keeps alive.
            unsafe { self.store(ch, cq.0 + s.offset as u64, u64::from_le_bytes(s.bytes))? };
        }
        Ok(())
    }

    /// The pass's copies and stores reach the driver (nothing waits in a
    /// batch past a pass), with the channel's mark after them where stalls
    /// are watched.
    fn end_pass(&mut self, ch: Channel) -> Result<(), ExecError> {
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
                started: Vec::new(),
            });
        }
        if let Some(w) = &self.stalls {
            w.log_start();
        }
        Ok(())
    }

    /// Waits for every stream; logs what reached the driver.
    fn quiesce(&mut self) -> Result<(), ExecError> {
        let mut calls = BatchStats::default();
        let mut first = self.settle_all();
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
            "CUDA soft NIC streams drained"
        );
        first
    }
}

impl<G: Gpu> Drop for CudaExecutor<G> {
    /// Writes from GPU memory still in flight (an executor dropped without
    /// quiescing) are completed first: the memory is lent until then.
    fn drop(&mut self) {
        if let Err(e) = self.settle_all() {
            tracing::warn!(rank = self.rank, %e, "writes from GPU memory failed while the soft NIC's CUDA executor was dropped");
        }
    }
}
