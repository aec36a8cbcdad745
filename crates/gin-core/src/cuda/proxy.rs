//! The CUDA proxy: a thread that reads the descriptors kernels write into
//! rings in mapped pinned host memory and executes them with the copy engine.
//!
//! Per ring (context, peer) it keeps one stream, so everything a ring asks
//! for happens in order: the data copy, then the signal's running total
//! (`cuStreamWriteValue64` into the peer's sub-slot for this rank), then the
//! counter's, then — once per batch — the ring's completion index, which the
//! kernel's flush and credit checks read. Nothing here waits for the GPU,
//! except for peers reached over TCP: there a put's source is staged
//! through pinned host memory and sent on the link, its signal follows as
//! an 8-byte put of the running total, and a get's answer is staged back,
//! each copy waited for (see `gin_cuda::staging`).
//!
//! Every address the proxy hands a stream is checked first: a window's
//! part against the window table's sizes (a window leaves the table before
//! its memory is freed), a signal against this rank's sub-slot, a counter
//! against the counter array, the completion index against its ring.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use gin_proxy::descriptor::{DESC_QWORDS, Desc, Op, Slot, decode};

use gin_net::tcp::Link;

use gin_cuda::batch::{BatchStats, Region, StreamBatch, pass_len, region};
use gin_cuda::staging::{STAGE, Stage};
use gin_cuda::worker::Worker;
use gin_cuda::{CudaError, Device, HostMem, Stream};

use super::WinTable;
use crate::error::CoreError;

/// Where the signal window is: its id and every rank's part mapped here.
#[derive(Debug, Clone)]
pub(crate) struct SignalInfo {
    pub window: u32,
    pub peers: Vec<u64>,
    pub sizes: Vec<u64>,
    /// Each rank's region key of its part, for TCP peers (0: not served).
    pub keys: Vec<u32>,
}

#[derive(Debug)]
pub(crate) struct RingSpec {
    pub ctx: u32,
    pub peer: usize,
    pub slots: HostMem,
    pub log2: u32,
    /// Device address of the completion index.
    pub done: u64,
}

#[derive(Debug)]
pub(crate) struct ProxySpec {
    pub dev: Arc<Device>,
    pub rank: usize,
    pub nranks: usize,
    pub rings: Vec<RingSpec>,
    pub windows: WinTable,
    pub signal: SignalInfo,
    pub counters: u64,
    pub counter_slots: u64,
    pub spin: Duration,
    /// The TCP link to each peer reached over TCP.
    pub links: Vec<Option<Arc<Link>>>,
    /// Staging for TCP peers (`None`: there are none).
    pub stage: Option<Stage>,
    /// How long a staged get waits for its answer.
    pub timeout: Duration,
}

#[derive(Debug)]
pub(crate) struct CudaProxy(Worker);

impl CudaProxy {
    pub fn start(spec: ProxySpec) -> Result<Self, CoreError> {
        let name = format!("gin-cuda-proxy-{}", spec.rank);
        Ok(Worker::start(name, "CUDA proxy", move |stop, _| run(spec, stop)).map(Self)?)
    }

    /// The error that stopped the proxy, if any.
    pub fn error(&self) -> Option<String> {
        self.0.error()
    }

    pub fn stop(self) -> Result<(), CoreError> {
        Ok(self.0.stop("the CUDA proxy failed")?)
    }
}

struct Ring {
    spec: RingSpec,
    tail: u64,
    stream: Stream,
    /// Copies and stores not yet handed to the stream (see `batch`).
    pending: StreamBatch,
    /// Running signal totals by byte offset in the peer's signal window.
    totals: HashMap<u64, u64>,
}

impl Ring {
    /// A copy, queued with the ones before it unless they overlap.
    ///
    /// # Safety
    /// As `StreamBatch::push`: `dst` and `src` inside the memory `region`
    /// names, checked against the window table.
    unsafe fn copy(
        &mut self,
        dst: u64,
        src: u64,
        n: usize,
        region: Region,
    ) -> Result<(), CudaError> {
        // SAFETY: the caller's contract.
        unsafe { self.pending.push(&self.stream, dst, src, n, region) }
    }

    /// An 8-byte store after every copy and store queued so far; consecutive
    /// stores reach the driver as one call when the pass flushes.
    ///
    /// # Safety
    /// As `StreamBatch::write`: `addr` an 8-aligned word of a checked
    /// signal, counter, window or ring index.
    unsafe fn store(&mut self, addr: u64, v: u64) -> Result<(), CudaError> {
        // SAFETY: the caller's contract.
        unsafe { self.pending.write(&self.stream, addr, v) }
    }

    /// Sends `n` bytes at device address `src` to `(key, off)` over `link`,
    /// staged a chunk at a time after everything queued so far.
    ///
    /// # Safety
    /// `src` readable for `n` bytes (a checked window part).
    unsafe fn send(
        &mut self,
        stage: &mut Stage,
        link: &Link,
        (key, off): (u32, u64),
        src: u64,
        n: u64,
    ) -> Result<(), String> {
        self.pending
            .flush(&self.stream)
            .map_err(|e| e.to_string())?;
        let mut at = 0;
        while at < n {
            let c = (n - at).min(STAGE as u64);
            // SAFETY: inside the caller's `n` bytes at `src`.
            let bytes = unsafe { stage.pull(&self.stream, src + at, c as usize) }
                .map_err(|e| e.to_string())?;
            link.put(key, off + at, bytes, None)
                .map_err(|e| e.to_string())?;
            at += c;
        }
        Ok(())
    }

    /// Reads `n` bytes at `(key, off)` over `link` into device address
    /// `dst`, a chunk at a time.
    ///
    /// # Safety
    /// `dst` writable for `n` bytes (a checked window part).
    unsafe fn fetch(
        &mut self,
        stage: &mut Stage,
        link: &Link,
        (key, off): (u32, u64),
        dst: u64,
        n: u64,
        timeout: Duration,
    ) -> Result<(), String> {
        self.pending
            .flush(&self.stream)
            .map_err(|e| e.to_string())?;
        let mut at = 0;
        while at < n {
            let c = (n - at).min(STAGE as u64);
            // SAFETY: inside the caller's `n` bytes at `dst`.
            unsafe {
                stage.get(
                    link,
                    key,
                    off + at,
                    c as usize,
                    &self.stream,
                    dst + at,
                    timeout,
                )
            }
            .map_err(|e| e.to_string())?;
            at += c;
        }
        Ok(())
    }
}

/// What the proxy did, logged at debug level when it stops (`GIN_DEBUG=debug`):
/// where its time went when a path is slower than its floor.
#[derive(Debug, Default)]
struct Stats {
    descriptors: u64,
    batches: u64,
    /// Time inside the driver calls that queue copies and stores.
    queueing: Duration,
    /// The longest single descriptor's queueing.
    queueing_max: Duration,
    /// Polls that found the next slot not yet written.
    pending: u64,
    sleeps: u64,
}

fn run(mut spec: ProxySpec, stop: &AtomicBool) -> Result<(), CoreError> {
    spec.dev.make_current()?;
    let mut rings: Vec<Ring> = Vec::with_capacity(spec.rings.len());
    for r in std::mem::take(&mut spec.rings) {
        rings.push(Ring {
            spec: r,
            tail: 0,
            stream: Stream::new()?,
            pending: StreamBatch::default(),
            totals: HashMap::new(),
        });
    }
    let mut counter_totals: HashMap<u64, u64> = HashMap::new();
    let mut stage = spec.stage.take();
    let mut idle_since: Option<Instant> = None;
    let mut stats = Stats::default();
    loop {
        // Asked to stop, the proxy still drains what is queued: a kernel
        // may end right after pushing a signal (a barrier's last step) and
        // the peer is waiting for it.
        let stopping = stop.load(Ordering::Acquire);
        let mut progressed = false;
        for ring in &mut rings {
            let start = ring.tail;
            for _ in 0..pass_len(ring.spec.log2) {
                let seq = ring.tail;
                let q = read_slot(ring, seq);
                let d = match decode(&q, seq, ring.spec.log2) {
                    Ok(Slot::Pending) => {
                        stats.pending += 1;
                        break;
                    }
                    Ok(Slot::Ready(d)) => d,
                    Err(e) => {
                        return Err(CoreError::Invalid(format!(
                            "rank {}: ring (context {}, peer {}): {e}",
                            spec.rank, ring.spec.ctx, ring.spec.peer
                        )));
                    }
                };
                let t = Instant::now();
                if let Err(e) = execute(&spec, &mut stage, ring, &mut counter_totals, &d) {
                    // What the descriptors before it queued still goes to
                    // the stream: their signals and counters were earned.
                    if let Err(f) = ring.pending.flush(&ring.stream) {
                        tracing::warn!("rank {}: flushing before the error: {f}", spec.rank);
                    }
                    return Err(CoreError::Invalid(format!(
                        "rank {}: descriptor {seq} of ring (context {}, peer {}): {e}",
                        spec.rank, ring.spec.ctx, ring.spec.peer
                    )));
                }
                let dt = t.elapsed();
                stats.queueing += dt;
                stats.queueing_max = stats.queueing_max.max(dt);
                stats.descriptors += 1;
                ring.tail += 1;
            }
            if ring.tail != start {
                let t = Instant::now();
                // SAFETY: the ring's completion index, 8 bytes of the
                // device communicator's index array, which outlives the
                // proxy.
                unsafe { ring.store(ring.spec.done, ring.tail)? };
                // The pass's signals, counters and this completion index
                // (and an inline put's value) go to the driver together.
                ring.pending.flush(&ring.stream)?;
                stats.queueing += t.elapsed();
                stats.batches += 1;
                progressed = true;
            }
        }
        if progressed {
            idle_since = None;
            continue;
        }
        if stopping {
            break;
        }
        // Back off when idle so the proxy shares the CPU with the ranks, but
        // spin first: a kernel in a ping-pong posts again within microseconds.
        // A GPU rank owns its CPU cores: spin at least 5 ms, so a kernel's
        // next descriptor never waits for a sleeping proxy.
        let since = *idle_since.get_or_insert_with(Instant::now);
        if since.elapsed() > spec.spin.max(Duration::from_millis(5)) {
            stats.sleeps += 1;
            std::thread::sleep(Duration::from_micros(50));
        } else {
            std::hint::spin_loop();
        }
    }
    let mut calls = BatchStats::default();
    for r in &rings {
        r.stream.sync()?;
        calls += r.pending.stats;
    }
    tracing::debug!(
        rank = spec.rank,
        descriptors = stats.descriptors,
        batches = stats.batches,
        copies = calls.copies,
        copy_calls = calls.copy_calls,
        copies_issued = calls.copies_issued,
        store_calls = calls.store_calls,
        queueing_ms = stats.queueing.as_secs_f64() * 1e3,
        queueing_max_us = stats.queueing_max.as_secs_f64() * 1e6,
        pending_polls = stats.pending,
        sleeps = stats.sleeps,
        "CUDA proxy stopped"
    );
    Ok(())
}

fn read_slot(ring: &Ring, seq: u64) -> [u64; DESC_QWORDS] {
    let idx = (seq & ((1u64 << ring.spec.log2) - 1)) as usize;
    // SAFETY: the slot lies inside the ring's mapped allocation (64 bytes a
    // slot, 2^log2 slots), which outlives the thread; the GPU writes it
    // concurrently, so it is read through atomics.
    let slot = unsafe {
        &*ring
            .spec
            .slots
            .host_ptr()
            .add(idx * 64)
            .cast::<[AtomicU64; DESC_QWORDS]>()
    };
    std::array::from_fn(|i| slot[i].load(Ordering::Acquire))
}

pub(super) fn window(windows: &WinTable, id: u32) -> Result<Arc<super::WinInfo>, String> {
    windows
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get(&id)
        .cloned()
        .ok_or_else(|| format!("unknown window {id}"))
}

pub(super) fn fits(off: u64, bytes: u64, size: u64) -> bool {
    off <= size && bytes <= size - off
}

/// Where a peer's memory is reached: mapped here, or over TCP.
enum Reach<'a> {
    Mapped,
    Tcp(&'a Link, &'a mut Stage),
}

fn execute(
    spec: &ProxySpec,
    stage: &mut Option<Stage>,
    ring: &mut Ring,
    counters: &mut HashMap<u64, u64>,
    d: &Desc,
) -> Result<(), String> {
    let peer = ring.spec.peer;
    let err = |e: CudaError| e.to_string();
    let timeout = spec.timeout;
    let mut reach = match (spec.links.get(peer).and_then(Option::as_ref), stage) {
        (Some(l), Some(s)) => Reach::Tcp(l, s),
        (Some(_), None) => {
            return Err(format!(
                "rank {peer} is reached over TCP, but no staging buffer was set up"
            ));
        }
        (None, _) => Reach::Mapped,
    };
    match d.op {
        Op::Put => {
            if d.bytes > 0 || d.inline.is_some() {
                let dst = window(&spec.windows, d.dst_window)?;
                if let Reach::Tcp(link, stage) = &mut reach {
                    let key = dst.keys[peer];
                    if key == 0 || !fits(d.dst_offset, d.bytes, dst.sizes[peer]) {
                        return Err(format!(
                            "put of {} bytes at {} outside window {} of rank {peer} ({} bytes)",
                            d.bytes, d.dst_offset, d.dst_window, dst.sizes[peer]
                        ));
                    }
                    if let Some(v) = d.inline {
                        if d.bytes != 8 {
                            return Err("inline puts carry 8 bytes".into());
                        }
                        link.put(key, d.dst_offset, &v.to_le_bytes(), None)
                            .map_err(|e| e.to_string())?;
                    } else {
                        let src = put_source(spec, d)?;
                        // SAFETY: `put_source` checked the source against
                        // its window.
                        unsafe { ring.send(stage, link, (key, d.dst_offset), src, d.bytes)? };
                    }
                    put_signal(spec, ring, &mut reach, d)?;
                    return count(spec, ring, counters, d);
                }
                let base = dst.peers[peer];
                if base == 0 || !fits(d.dst_offset, d.bytes, dst.sizes[peer]) {
                    return Err(format!(
                        "put of {} bytes at {} outside window {} of rank {peer} ({} bytes)",
                        d.bytes, d.dst_offset, d.dst_window, dst.sizes[peer]
                    ));
                }
                if let Some(v) = d.inline {
                    if d.bytes != 8 || !d.dst_offset.is_multiple_of(8) {
                        return Err("inline puts carry 8 aligned bytes".into());
                    }
                    // SAFETY: 8 aligned bytes inside the peer's part as
                    // mapped here (checked above).
                    unsafe { ring.store(base + d.dst_offset, v) }.map_err(err)?;
                } else {
                    let src = put_source(spec, d)?;
                    let g = region(true, d.dst_window, d.src_window);
                    // SAFETY: the destination lies in the peer's part as
                    // mapped here, the source in this rank's part (both
                    // checked), and `g` names the two windows.
                    unsafe { ring.copy(base + d.dst_offset, src, d.bytes as usize, g) }
                        .map_err(err)?;
                }
            }
            put_signal(spec, ring, &mut reach, d)?;
        }
        Op::Get => {
            let remote = window(&spec.windows, d.dst_window)?;
            let local = window(&spec.windows, d.src_window)?;
            let base = match &reach {
                Reach::Mapped => remote.peers[peer],
                Reach::Tcp(..) => u64::from(remote.keys[peer]),
            };
            if base == 0
                || !fits(d.dst_offset, d.bytes, remote.sizes[peer])
                || !fits(d.src_offset, d.bytes, local.local_size)
            {
                return Err(format!(
                    "get of {} bytes from {} of window {} (rank {peer}) into {} of window {} is out of bounds",
                    d.bytes, d.dst_offset, d.dst_window, d.src_offset, d.src_window
                ));
            }
            if let Reach::Tcp(link, stage) = &mut reach {
                // SAFETY: the destination lies in this rank's part
                // (checked above).
                unsafe {
                    ring.fetch(
                        stage,
                        link,
                        (remote.keys[peer], d.dst_offset),
                        local.local + d.src_offset,
                        d.bytes,
                        timeout,
                    )?;
                }
            } else {
                // SAFETY: the destination lies in this rank's part, the
                // source in the peer's part as mapped here (both checked),
                // and the region names the two windows.
                unsafe {
                    ring.copy(
                        local.local + d.src_offset,
                        base + d.dst_offset,
                        d.bytes as usize,
                        region(false, d.dst_window, d.src_window),
                    )
                }
                .map_err(err)?;
            }
        }
    }
    count(spec, ring, counters, d)
}

/// The device address of a put's source, checked against its window.
fn put_source(spec: &ProxySpec, d: &Desc) -> Result<u64, String> {
    let src = window(&spec.windows, d.src_window)?;
    if !fits(d.src_offset, d.bytes, src.local_size) {
        return Err(format!(
            "put source of {} bytes at {} outside window {} ({} bytes)",
            d.bytes, d.src_offset, d.src_window, src.local_size
        ));
    }
    Ok(src.local + d.src_offset)
}

/// A put's signal: this rank's running total of the signal, stored into
/// its sub-slot at the peer after the data.
fn put_signal(
    spec: &ProxySpec,
    ring: &mut Ring,
    reach: &mut Reach<'_>,
    d: &Desc,
) -> Result<(), String> {
    let Some(s) = &d.signal else {
        return Ok(());
    };
    let peer = ring.spec.peer;
    let n = spec.nranks as u64;
    if s.window != spec.signal.window
        || !s.offset.is_multiple_of(8)
        || (s.offset / 8) % n != spec.rank as u64
        || !fits(s.offset, 8, spec.signal.sizes[peer])
    {
        return Err(format!(
            "signal at offset {} of window {} is not this rank's sub-slot of a signal",
            s.offset, s.window
        ));
    }
    let total = ring.totals.entry(s.offset).or_insert(0);
    *total = total.wrapping_add(s.add);
    let v = *total;
    match reach {
        // The same ordered connection as the data: applied after it.
        Reach::Tcp(link, _) => link
            .put(spec.signal.keys[peer], s.offset, &v.to_le_bytes(), None)
            .map_err(|e| e.to_string()),
        Reach::Mapped => {
            let at = spec.signal.peers[peer] + s.offset;
            // SAFETY: this rank's 8-aligned sub-slot inside the peer's
            // signal window part as mapped here (checked above).
            unsafe { ring.store(at, v) }.map_err(|e| e.to_string())
        }
    }
}

/// A descriptor's counter: the proxy's running total, after its work.
fn count(
    spec: &ProxySpec,
    ring: &mut Ring,
    counters: &mut HashMap<u64, u64>,
    d: &Desc,
) -> Result<(), String> {
    if let Some(c) = d.counter {
        let c = u64::from(c);
        if c >= spec.counter_slots {
            return Err(format!("counter slot {c} does not exist"));
        }
        let t = counters.entry(c).or_insert(0);
        *t = t.wrapping_add(1);
        // SAFETY: the proxy's sub-slot of an existing counter (checked
        // above) in the counter array, which outlives the proxy.
        unsafe { ring.store(spec.counters + c * 16, *t) }.map_err(|e| e.to_string())?;
    }
    Ok(())
}
