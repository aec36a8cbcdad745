//! The soft mlx5 NIC for CUDA ranks: a thread that executes the WQEs kernels
//! write into send queues in mapped pinned host memory, with the copy
//! engine, and reports completions through collapsed CQs in device memory.
//!
//! It reads the very bytes gin-gdaki's encoders (and the CUDA header's
//! builders) produce, decoded by `gin_gdaki::wqe`, and checks every key,
//! range, opcode and index, as the CPU ranks' soft NIC does. Per
//! (context, peer) the main QP and its companion share one stream, so a
//! counter's fetch-add (companion) lands after the data it counts (main),
//! and every CQE lands after the work it reports.
//!
//! What it cannot do that hardware can: atomics on arbitrary GPU memory. The
//! copy engine has no fetch-add, so the NIC executes fetch-adds only where it
//! is the sole writer, keeping running totals: this rank's sub-slot of a
//! signal at the peer, and its counters' NIC sub-slot. Anything else
//! completes with a remote operation error, and inline writes carry 8
//! aligned bytes (all the header emits).
//!
//! A peer reached over TCP has no mapping here: its parts are named by
//! their region keys, writes are staged through pinned host memory and
//! sent on the link, reads come back the same way, and a signal's
//! fetch-add becomes an 8-byte put of the running total after the data
//! (see `gin_cuda::staging`). A transport failure completes with a
//! retry-exceeded error.
//!
//! Every address the NIC hands a stream is checked first: a WQE's memory
//! against the window its key names (a window leaves the table before its
//! memory is freed), a fetch-add against this rank's signal sub-slots and
//! counters, a CQE store against its queue's CQE.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use gin_gdaki::completion::{CQE_REQ, CQE_REQ_ERR, Cqe, syndrome};
use gin_gdaki::queue::{BadProducerIndex, producer_index, unwrap_counter};
use gin_gdaki::wqe::{BB, CQ_UPDATE, MemRef, Op, decode};
use gin_net::tcp::Link;

use gin_cuda::batch::{BatchStats, Dma, StreamBatch, pass_len, region};
use gin_cuda::staging::{STAGE, Stage};
use gin_cuda::worker::{FirstError, Worker, set_first};
use gin_cuda::{CudaError, Device, Stream};

use super::{COUNTER_KEY, SINK_KEY, SignalInfo, fits, window, window_of_key};
use crate::error::CoreError;

/// One send queue as the host set it up.
#[derive(Debug)]
pub(crate) struct SqSpec {
    pub qpn: u32,
    pub log2: u32,
    /// Host address of the `2^log2` WQEs (mapped pinned memory).
    pub wqes: *mut u8,
    /// Host address of the doorbell record (big-endian u32); the doorbell
    /// register (u64) follows 8 bytes on.
    pub ctl: *mut u8,
    /// Device address of the collapsed CQE.
    pub cqe: u64,
}

// SAFETY: `wqes` and `ctl` point into mapped host memory owned by the
// device communicator, which stops the NIC before freeing it.
unsafe impl Send for SqSpec {}

/// The main QP to a peer and its companion loopback QP, for one context.
#[derive(Debug)]
pub(crate) struct PairSpec {
    pub ctx: u32,
    pub peer: usize,
    pub main: SqSpec,
    pub companion: SqSpec,
}

#[derive(Debug)]
pub(crate) struct NicSpec {
    pub rank: usize,
    pub nranks: usize,
    pub pairs: Vec<PairSpec>,
    /// The window directory (its GPU windows).
    pub windows: Arc<gin_net::Fabric>,
    pub signal: SignalInfo,
    /// Device address of the counter array (16 bytes a slot, the NIC's
    /// running total first).
    pub counters: u64,
    pub counter_slots: u64,
    /// The atomic result sink, mapped host memory.
    pub sink: u64,
    pub sink_host: *mut u8,
    pub sink_len: u64,
    pub spin: Duration,
    /// The TCP link to each peer reached over TCP.
    pub links: Vec<Option<Arc<Link>>>,
    /// Staging for TCP peers (`None`: there are none).
    pub stage: Option<Stage>,
    /// How long a staged read waits for its answer.
    pub timeout: Duration,
}

// SAFETY: `sink_host` points into mapped host memory owned by the device
// communicator, which stops the NIC before freeing it.
unsafe impl Send for NicSpec {}

/// A running NIC thread.
#[derive(Debug)]
pub(crate) struct CudaNic(Worker);

impl CudaNic {
    pub fn start(dev: Arc<Device>, spec: NicSpec) -> Result<Self, CoreError> {
        let name = format!("gin-cuda-nic-{}", spec.rank);
        Ok(Worker::start(name, "CUDA soft NIC", move |stop, error| {
            dev.make_current()?;
            Nic::new(spec, error.clone(), Stream::new)?.run(stop)
        })
        .map(Self)?)
    }

    /// The first error CQE's description, or why the NIC stopped.
    pub fn error(&self) -> Option<String> {
        self.0.error()
    }

    /// Stops the thread once it has drained its queues; reports the first
    /// error it met.
    pub fn stop(self) -> Result<(), CoreError> {
        Ok(self.0.stop("the soft NIC reported")?)
    }
}

/// The NIC's state of one send queue.
struct Sq {
    spec: SqSpec,
    /// Next WQE index to execute.
    ci: u64,
    /// CQEs produced (index of the last completed WQE + 1).
    produced: u64,
    failed: bool,
}

impl Sq {
    fn new(spec: SqSpec) -> Self {
        Self {
            spec,
            ci: 0,
            produced: 0,
            failed: false,
        }
    }

    fn size(&self) -> u64 {
        1 << self.spec.log2
    }

    /// The producer index from the doorbell record, unwrapped relative to
    /// `ci`, by the same rule as gin-gdaki's CPU soft NIC: one more than the
    /// queue's depth ahead (a record that moved backwards reads so) is an
    /// error. Producers post in reservation order, so the record only grows.
    fn producer_index(&self) -> Result<u64, BadProducerIndex> {
        // SAFETY: `ctl` is the 4-aligned doorbell record, as above.
        let rec = unsafe { &*self.spec.ctl.cast::<AtomicU32>() };
        let pi16 = u32::from_be(rec.load(Ordering::Acquire)) as u16;
        producer_index(pi16, self.ci, self.size())
    }

    fn read_wqe(&self, idx: u64) -> [u8; BB] {
        let slot = (idx & (self.size() - 1)) as usize;
        // SAFETY: the slot lies inside the queue's mapped allocation (64
        // bytes a WQE, 2^log2 WQEs); the GPU wrote it before the doorbell
        // record we acquired, and it is read through atomics.
        let q = unsafe { &*self.spec.wqes.add(slot * BB).cast::<[AtomicU64; BB / 8]>() };
        let mut b = [0u8; BB];
        for (i, w) in q.iter().enumerate() {
            b[i * 8..i * 8 + 8].copy_from_slice(&w.load(Ordering::Acquire).to_ne_bytes());
        }
        b
    }
}

struct Pair<D> {
    ctx: u32,
    peer: usize,
    main: Sq,
    companion: Sq,
    stream: D,
    /// Copies and stores not yet handed to the stream (see `batch`).
    pending: StreamBatch,
    /// Running signal totals by byte offset in the peer's signal window.
    totals: HashMap<u64, u64>,
}

impl<D: Dma> Pair<D> {
    /// An 8-byte store after every copy and store queued so far; consecutive
    /// stores reach the driver as one call when the pass flushes (`serve`).
    ///
    /// # Safety
    /// As `StreamBatch::write`: `addr` an 8-aligned word of a checked
    /// window part, signal sub-slot, counter or CQE.
    unsafe fn store(&mut self, addr: u64, v: u64) -> Result<(), CudaError> {
        // SAFETY: the caller's contract.
        unsafe { self.pending.write(&self.stream, addr, v) }
    }
}

/// How executing one WQE went.
enum Step {
    Done,
    /// A WAIT whose condition does not hold yet: try again later.
    Blocked,
    Failed {
        syndrome: u8,
        why: String,
    },
}

fn failed(syndrome: u8, why: impl Into<String>) -> Step {
    Step::Failed {
        syndrome,
        why: why.into(),
    }
}

struct Nic<D> {
    spec: NicSpec,
    stage: Option<Stage>,
    pairs: Vec<Pair<D>>,
    counter_totals: HashMap<u64, u64>,
    error: FirstError,
    executed: u64,
}

impl<D: Dma> Nic<D> {
    fn new(
        mut spec: NicSpec,
        error: FirstError,
        mut queue: impl FnMut() -> Result<D, CudaError>,
    ) -> Result<Self, CoreError> {
        let mut pairs = Vec::with_capacity(spec.pairs.len());
        for p in std::mem::take(&mut spec.pairs) {
            pairs.push(Pair {
                ctx: p.ctx,
                peer: p.peer,
                main: Sq::new(p.main),
                companion: Sq::new(p.companion),
                stream: queue()?,
                pending: StreamBatch::default(),
                totals: HashMap::new(),
            });
        }
        Ok(Self {
            stage: spec.stage.take(),
            spec,
            pairs,
            counter_totals: HashMap::new(),
            error,
            executed: 0,
        })
    }

    fn run(&mut self, stop: &AtomicBool) -> Result<(), CoreError> {
        let mut idle_since: Option<Instant> = None;
        loop {
            // Asked to stop, the NIC still drains what was posted: a kernel
            // may end right after a barrier's signal that a peer awaits.
            let stopping = stop.load(Ordering::Acquire);
            let mut did = 0;
            for i in 0..self.pairs.len() {
                did += self.serve(i, false)?;
                did += self.serve(i, true)?;
            }
            if did > 0 {
                self.executed += did;
                idle_since = None;
                continue;
            }
            if stopping {
                break;
            }
            // As the CUDA proxy: spin at least 5 ms, then nap. Kernels ring
            // by storing to mapped host memory, which raises no OS event a
            // thread could block on, so an idle NIC can only poll or sleep.
            let since = *idle_since.get_or_insert_with(Instant::now);
            if since.elapsed() > self.spec.spin.max(Duration::from_millis(5)) {
                std::thread::sleep(Duration::from_micros(50));
            } else {
                std::hint::spin_loop();
            }
        }
        let mut calls = BatchStats::default();
        for p in &self.pairs {
            p.stream.sync()?;
            calls += p.pending.stats;
        }
        tracing::debug!(
            rank = self.spec.rank,
            executed = self.executed,
            copies = calls.copies,
            copy_calls = calls.copy_calls,
            copies_issued = calls.copies_issued,
            store_calls = calls.store_calls,
            "CUDA soft NIC stopped"
        );
        Ok(())
    }

    /// Executes what one queue of pair `i` has posted; returns the WQEs
    /// consumed.
    fn serve(&mut self, i: usize, companion: bool) -> Result<u64, CoreError> {
        // The NIC polls the doorbell records, as gin-gdaki's CPU soft NIC
        // does; the doorbell register kernels also write is what hardware
        // would need, and a polling NIC does not.
        let sq = self.sq(i, companion);
        let pi = match sq.producer_index() {
            Ok(pi) => pi,
            Err(bad) => {
                // As hardware: the QP moves to the error state with one
                // error CQE, and nothing past the consumer index executes.
                if !sq.failed {
                    let why = bad.to_string();
                    self.fail_sq(i, companion, bad.ci, 0, syndrome::LOCAL_QP_OP_ERR, &why)?;
                    let p = &mut self.pairs[i];
                    p.pending.flush(&p.stream)?;
                }
                return Ok(0);
            }
        };
        if pi == sq.ci {
            return Ok(0);
        }
        let (ci, log2) = (sq.ci, sq.spec.log2);
        let mut n = 0;
        let mut last_ok: Option<(u64, u8)> = None;
        while self.sq(i, companion).ci != pi && n < pass_len(log2) {
            let idx = ci + n;
            let bytes = self.sq(i, companion).read_wqe(idx);
            if self.sq(i, companion).failed {
                // Error state: the rest is flushed in error; the first error
                // CQE stays where the kernel reads it.
                self.sq_mut(i, companion).ci = idx + 1;
                n += 1;
                continue;
            }
            match self.execute(i, companion, idx, &bytes) {
                Step::Blocked => break,
                Step::Done => {
                    if bytes[11] & CQ_UPDATE != 0 {
                        last_ok = Some((idx, bytes[3]));
                        self.sq_mut(i, companion).produced = idx + 1;
                    }
                }
                Step::Failed { syndrome: syn, why } => {
                    self.fail_sq(i, companion, idx, bytes[3], syn, &why)?;
                    last_ok = None;
                }
            }
            self.sq_mut(i, companion).ci = idx + 1;
            n += 1;
        }
        if let Some((idx, op)) = last_ok {
            let qpn = self.sq(i, companion).spec.qpn;
            // Collapsed CQ: only the newest CQE is visible, so one store
            // per batch reports them all, after the batch's work.
            let cqe = Cqe {
                opcode: CQE_REQ,
                wqe_counter: idx as u16,
                qpn,
                send_opcode: op,
                byte_cnt: 0,
                syndrome: 0,
                vendor_syndrome: 0,
            }
            .encode(idx, log2);
            let at = self.sq(i, companion).spec.cqe;
            // SAFETY: the last qword of the queue's 64-byte CQE, which the
            // device communicator owns and frees after stopping the NIC.
            unsafe { self.pairs[i].store(at + 56, qword(&cqe, 7))? };
        }
        // Nothing waits in the batch past a pass (a WQE without a CQE).
        let p = &mut self.pairs[i];
        p.pending.flush(&p.stream)?;
        Ok(n)
    }

    /// Moves a queue to the error state: the error (named by QP, WQE index
    /// and syndrome) becomes the NIC's first error, and the collapsed CQE
    /// reports it, after the work queued so far.
    fn fail_sq(
        &mut self,
        i: usize,
        companion: bool,
        idx: u64,
        send_opcode: u8,
        syn: u8,
        why: &str,
    ) -> Result<(), CoreError> {
        let (qpn, log2) = {
            let sq = self.sq(i, companion);
            (sq.spec.qpn, sq.spec.log2)
        };
        let p = &self.pairs[i];
        let what = if companion {
            format!("companion QP {qpn:#x} (context {})", p.ctx)
        } else {
            format!("QP {qpn:#x} to rank {} (context {})", p.peer, p.ctx)
        };
        let msg = format!(
            "rank {}: {what}: WQE index {idx} completed with syndrome {syn:#04x} ({}): {why}",
            self.spec.rank,
            syndrome::name(syn)
        );
        tracing::warn!("{msg}; the QP moved to the error state");
        set_first(&self.error, msg);
        let cqe = Cqe {
            opcode: CQE_REQ_ERR,
            wqe_counter: idx as u16,
            qpn,
            send_opcode,
            byte_cnt: 0,
            syndrome: syn,
            vendor_syndrome: 0,
        }
        .encode(idx, log2);
        let sq = self.sq_mut(i, companion);
        sq.failed = true;
        sq.produced = idx + 1;
        let at = sq.spec.cqe;
        let p = &mut self.pairs[i];
        // Syndrome first, then the qword the kernel polls.
        // SAFETY: two qwords of the queue's 64-byte CQE, as in `serve`.
        unsafe {
            p.store(at + 48, qword(&cqe, 6))?;
            p.store(at + 56, qword(&cqe, 7))?;
        }
        Ok(())
    }

    fn sq(&self, i: usize, companion: bool) -> &Sq {
        let p = &self.pairs[i];
        if companion { &p.companion } else { &p.main }
    }

    fn sq_mut(&mut self, i: usize, companion: bool) -> &mut Sq {
        let p = &mut self.pairs[i];
        if companion {
            &mut p.companion
        } else {
            &mut p.main
        }
    }

    fn execute(&mut self, i: usize, companion: bool, idx: u64, bytes: &[u8; BB]) -> Step {
        let w = match decode(bytes) {
            Ok(w) => w,
            Err(e) => return failed(syndrome::LOCAL_QP_OP_ERR, format!("malformed WQE: {e}")),
        };
        let qpn = self.sq(i, companion).spec.qpn;
        if w.index != idx as u16 {
            return failed(
                syndrome::LOCAL_QP_OP_ERR,
                format!("the WQE at index {idx} carries index {}", w.index),
            );
        }
        if w.qpn != qpn {
            return failed(
                syndrome::LOCAL_QP_OP_ERR,
                format!("a WQE for QP {:#x} was posted on QP {qpn:#x}", w.qpn),
            );
        }
        // The companion QP is a loopback QP: its remote is this rank.
        let peer = if companion {
            self.spec.rank
        } else {
            self.pairs[i].peer
        };
        let r = match &w.op {
            Op::Nop => Ok(Step::Done),
            Op::Write { remote, local, len } => self.copy(i, peer, *remote, *local, *len, true),
            Op::Read { remote, local, len } => self.copy(i, peer, *remote, *local, *len, false),
            Op::WriteInline { remote, data } => self.inline(i, peer, *remote, data),
            Op::FetchAdd {
                remote,
                add,
                result,
            } => self.fetch_add(i, peer, *remote, *add, *result),
            Op::CompareSwap { .. } => Ok(failed(
                syndrome::REMOTE_OP_ERR,
                "compare-and-swap on GPU memory: the copy engine has no atomics",
            )),
            Op::Wait { max_index, cqn } => {
                let main = &self.pairs[i].main;
                if !companion || *cqn != main.spec.qpn {
                    return failed(
                        syndrome::LOCAL_QP_OP_ERR,
                        format!("WAIT on CQ {cqn:#x}, which is not this QP pair's main CQ"),
                    );
                }
                if main.failed {
                    return failed(
                        syndrome::WR_FLUSH_ERR,
                        format!("the awaited QP {:#x} is in the error state", main.spec.qpn),
                    );
                }
                let awaited = unwrap_counter(*max_index as u16, main.produced);
                Ok(if main.produced > awaited {
                    Step::Done
                } else {
                    Step::Blocked
                })
            }
        };
        r.unwrap_or_else(|e| {
            // The call may have been queueing deferred work of earlier WQEs
            // of this pass (a batch is flushed when this WQE's work cannot
            // join it): the error is reported here, the first WQE that saw it.
            failed(
                syndrome::LOCAL_QP_OP_ERR,
                format!(
                    "driver call failed while queueing this WQE's work (or deferred work of earlier WQEs of this pass): {e}"
                ),
            )
        })
    }

    /// Resolves `(key, addr)` of `len` bytes on `rank` to a device address
    /// mapped here; `Err` names what was wrong.
    fn resolve(&self, rank: usize, m: MemRef, len: u64) -> Result<u64, String> {
        let (w, id, off) = self.locate(rank, m, len)?;
        let mapped = if rank == self.spec.rank {
            w.local_addr()
        } else {
            w.peer_addr(rank)
        };
        if mapped == 0 {
            return Err(format!(
                "rank {rank}'s part of window {id} is not mapped here"
            ));
        }
        Ok(mapped + off)
    }

    /// The window `(key, addr)` names on `rank`, its id, and the offset of
    /// `len` bytes there; `Err` names what was wrong.
    fn locate(
        &self,
        rank: usize,
        m: MemRef,
        len: u64,
    ) -> Result<(Arc<gin_net::MemDesc>, u32, u64), String> {
        let (id, owner) = window_of_key(m.key, self.spec.nranks)
            .ok_or_else(|| format!("key {:#010x} is not a window key", m.key))?;
        if owner != rank {
            return Err(format!(
                "key {:#010x} belongs to rank {owner}, not rank {rank}",
                m.key
            ));
        }
        let w = window(&self.spec.windows, id)
            .map_err(|_| format!("key {:#010x} names no registered window", m.key))?;
        let (base, size) = (w.addrs[rank], w.sizes[rank]);
        let off = m.addr.wrapping_sub(base);
        if m.addr < base || !fits(off, len, size) {
            return Err(format!(
                "{len} bytes at {:#x} fall outside rank {rank}'s part of window {id} ({size} bytes at {base:#x})",
                m.addr
            ));
        }
        Ok((w, id, off))
    }

    /// The link to `peer`, where it is reached over TCP.
    fn link(&self, peer: usize) -> Option<Arc<Link>> {
        self.spec.links.get(peer).and_then(Clone::clone)
    }

    /// Resolves `(key, addr)` of `len` bytes on `rank`, reached over TCP,
    /// to its region key and offset there.
    fn resolve_tcp(&self, rank: usize, m: MemRef, len: u64) -> Result<(u32, u64), String> {
        let (w, id, off) = self.locate(rank, m, len)?;
        match w.keys[rank] {
            0 => Err(format!(
                "rank {rank}'s part of window {id} is not served over TCP"
            )),
            key => Ok((key, off)),
        }
    }

    /// A write or read with a peer over TCP, staged a chunk at a time.
    #[allow(clippy::too_many_arguments)] // one staged transfer, spelled out
    fn copy_tcp(
        &mut self,
        i: usize,
        link: &Link,
        (key, off): (u32, u64),
        l: u64,
        len: u64,
        write: bool,
    ) -> Result<Step, CoreError> {
        let Some(stage) = self.stage.as_mut() else {
            return Ok(failed(
                syndrome::LOCAL_QP_OP_ERR,
                "a peer over TCP, but no staging buffer was set up",
            ));
        };
        let pair = &mut self.pairs[i];
        pair.pending.flush(&pair.stream)?;
        let mut at = 0;
        while at < len {
            let chunk = (len - at).min(STAGE as u64) as usize;
            let sent = if write {
                // SAFETY: inside the local part `l` of `len` bytes
                // (resolved against its window by the caller).
                let bytes = unsafe { stage.pull(&pair.stream, l + at, chunk)? };
                link.put(key, off + at, bytes, None)
                    .map_err(|e| e.to_string())
            } else {
                let t = self.spec.timeout;
                // SAFETY: as above.
                unsafe { stage.get(link, key, off + at, chunk, &pair.stream, l + at, t) }
                    .map_err(|e| e.to_string())
            };
            if let Err(why) = sent {
                return Ok(failed(syndrome::TRANSPORT_RETRY_EXC_ERR, why));
            }
            at += chunk as u64;
        }
        Ok(Step::Done)
    }

    fn copy(
        &mut self,
        i: usize,
        peer: usize,
        remote: MemRef,
        local: MemRef,
        len: u32,
        write: bool,
    ) -> Result<Step, CoreError> {
        let l = match self.resolve(self.spec.rank, local, u64::from(len)) {
            Ok(a) => a,
            Err(why) => return Ok(failed(syndrome::LOCAL_PROT_ERR, why)),
        };
        if let Some(link) = self.link(peer) {
            return match self.resolve_tcp(peer, remote, u64::from(len)) {
                Ok(at) => self.copy_tcp(i, &link, at, l, u64::from(len), write),
                Err(why) => Ok(failed(syndrome::REMOTE_ACCESS_ERR, why)),
            };
        }
        let r = match self.resolve(peer, remote, u64::from(len)) {
            Ok(a) => a,
            Err(why) => return Ok(failed(syndrome::REMOTE_ACCESS_ERR, why)),
        };
        if len > 0 {
            let (dst, src) = if write { (r, l) } else { (l, r) };
            let p = &mut self.pairs[i];
            let keys = region(write, remote.key, local.key);
            // SAFETY: both ends resolved against the windows their keys
            // name, which `keys` names as the copy's region.
            unsafe { p.pending.push(&p.stream, dst, src, len as usize, keys)? };
        }
        Ok(Step::Done)
    }

    fn inline(
        &mut self,
        i: usize,
        peer: usize,
        remote: MemRef,
        data: &[u8],
    ) -> Result<Step, CoreError> {
        let Ok(v) = <[u8; 8]>::try_from(data) else {
            return Ok(failed(
                syndrome::LOCAL_QP_OP_ERR,
                format!(
                    "inline write of {} bytes: this NIC writes inline data to GPU memory 8 aligned bytes at a time",
                    data.len()
                ),
            ));
        };
        if let Some(link) = self.link(peer) {
            let (key, off) = match self.resolve_tcp(peer, remote, 8) {
                Ok(at) => at,
                Err(why) => return Ok(failed(syndrome::REMOTE_ACCESS_ERR, why)),
            };
            return Ok(match link.put(key, off, &v, None) {
                Ok(()) => Step::Done,
                Err(e) => failed(syndrome::TRANSPORT_RETRY_EXC_ERR, e.to_string()),
            });
        }
        let r = match self.resolve(peer, remote, 8) {
            Ok(a) => a,
            Err(why) => return Ok(failed(syndrome::REMOTE_ACCESS_ERR, why)),
        };
        if !r.is_multiple_of(8) {
            return Ok(failed(
                syndrome::LOCAL_QP_OP_ERR,
                format!("inline write to unaligned address {:#x}", remote.addr),
            ));
        }
        // SAFETY: 8 aligned bytes of a window part mapped here (resolved
        // and checked above).
        unsafe { self.pairs[i].store(r, u64::from_le_bytes(v))? };
        Ok(Step::Done)
    }

    fn fetch_add(
        &mut self,
        i: usize,
        peer: usize,
        remote: MemRef,
        add: u64,
        result: MemRef,
    ) -> Result<Step, CoreError> {
        // The result goes to the sink, host memory the NIC writes directly.
        let sink_off = result.addr.wrapping_sub(self.spec.sink);
        if result.key != SINK_KEY
            || result.addr < self.spec.sink
            || !fits(sink_off, 8, self.spec.sink_len)
        {
            return Ok(failed(
                syndrome::LOCAL_PROT_ERR,
                format!(
                    "atomic result at {:#x} (key {:#010x}) is not in the sink",
                    result.addr, result.key
                ),
            ));
        }
        if !remote.addr.is_multiple_of(8) {
            return Ok(failed(
                syndrome::REMOTE_INVAL_REQ_ERR,
                format!("atomic at unaligned address {:#x}", remote.addr),
            ));
        }
        let (target, old) = if remote.key == COUNTER_KEY && peer == self.spec.rank {
            let off = remote.addr.wrapping_sub(self.spec.counters);
            if remote.addr < self.spec.counters
                || !fits(off, 8, self.spec.counter_slots * 16)
                || !off.is_multiple_of(16)
            {
                return Ok(failed(
                    syndrome::REMOTE_ACCESS_ERR,
                    format!(
                        "{:#x} is not the NIC sub-slot of a counter of this rank",
                        remote.addr
                    ),
                ));
            }
            let t = self.counter_totals.entry(off / 16).or_insert(0);
            let old = *t;
            *t = t.wrapping_add(add);
            (remote.addr, old)
        } else {
            let link = self.link(peer);
            // Where the target is: mapped here, or a region key at the peer.
            let (at, off) = if link.is_some() {
                match self.resolve_tcp(peer, remote, 8) {
                    Ok((_, off)) => (0, off),
                    Err(why) => return Ok(failed(syndrome::REMOTE_ACCESS_ERR, why)),
                }
            } else {
                match self.resolve(peer, remote, 8) {
                    Ok(a) => (a, a.wrapping_sub(self.spec.signal.peers[peer])),
                    Err(why) => return Ok(failed(syndrome::REMOTE_ACCESS_ERR, why)),
                }
            };
            let sig = &self.spec.signal;
            let n = self.spec.nranks as u64;
            let mine = window_of_key(remote.key, self.spec.nranks)
                .is_some_and(|(id, _)| id == sig.window)
                && (off / 8) % n == self.spec.rank as u64;
            if !mine {
                return Ok(failed(
                    syndrome::REMOTE_OP_ERR,
                    format!(
                        "fetch-add at {:#x} of rank {peer}: on GPU memory this NIC adds only to this rank's signal sub-slots and its counters, where it is the only writer",
                        remote.addr
                    ),
                ));
            }
            let t = self.pairs[i].totals.entry(off).or_insert(0);
            let old = *t;
            *t = t.wrapping_add(add);
            if let Some(link) = link {
                // After the data on the same ordered connection.
                let new = old.wrapping_add(add);
                if let Err(e) = link.put(sig.keys[peer], off, &new.to_le_bytes(), None) {
                    return Ok(failed(syndrome::TRANSPORT_RETRY_EXC_ERR, e.to_string()));
                }
                self.write_sink(sink_off, old);
                return Ok(Step::Done);
            }
            (at, old)
        };
        // SAFETY: an 8-aligned word checked above: this rank's sub-slot of
        // a signal in the peer's part as mapped here, or the NIC's
        // sub-slot of one of this rank's counters.
        unsafe { self.pairs[i].store(target, old.wrapping_add(add))? };
        self.write_sink(sink_off, old);
        Ok(Step::Done)
    }

    /// An atomic's old value, big-endian, at `sink_off` of the sink
    /// (checked by the caller).
    fn write_sink(&self, sink_off: u64, old: u64) {
        // SAFETY: the sink range was checked by the caller; it is mapped
        // host memory that outlives the thread and that nobody reads.
        unsafe {
            self.spec
                .sink_host
                .add(sink_off as usize)
                .cast::<u64>()
                .write_unaligned(old.to_be());
        }
    }
}

fn qword(cqe: &[u8; 64], q: usize) -> u64 {
    u64::from_le_bytes(cqe[q * 8..q * 8 + 8].try_into().expect("8 bytes"))
}

#[cfg(test)]
mod tests {
    //! The NIC's decoding, checks, execution and completions, run on host
    //! memory: addresses are host pointers and a "stream" executes at once.
    //! Rank 0's NIC serves its QP pair to rank 1.

    use super::*;
    use crate::cuda::window_key;
    use gin_gdaki::completion::CQE_INVALID;
    use gin_gdaki::wqe::{FM_NONE, FM_STRONG_ORDERING, encode};
    use gin_net::{Fabric, MemDesc, MemParts, Memory};

    struct HostDma;

    impl Dma for HostDma {
        unsafe fn copy(&self, dst: u64, src: u64, n: usize) -> Result<(), CudaError> {
            // SAFETY: the caller's contract: the NIC resolved both against
            // the rig's windows, live host buffers.
            unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, n) };
            Ok(())
        }
        unsafe fn write_u64(&self, addr: u64, v: u64) -> Result<(), CudaError> {
            // SAFETY: as above, 8-aligned.
            unsafe { (*(addr as *const AtomicU64)).store(v, Ordering::Release) };
            Ok(())
        }
        fn sync(&self) -> Result<(), CudaError> {
            Ok(())
        }
    }

    const N: usize = 2;
    const DATA: u32 = 3;
    const SIG: u32 = 4;
    /// Each rank's own address of its parts (what WQEs carry).
    const VA: [u64; 2] = [0x1000_0000, 0x2000_0000];
    const SIG_VA: [u64; 2] = [0x3000_0000, 0x4000_0000];
    const LOG2: u32 = 3;

    fn buf(qwords: usize) -> Box<[u64]> {
        vec![0u64; qwords].into_boxed_slice()
    }
    fn addr(b: &[u64]) -> u64 {
        b.as_ptr() as u64
    }

    struct Rig {
        _sig_own: Box<[u64]>,
        src: Box<[u64]>,
        dst: Box<[u64]>,
        sig_peer: Box<[u64]>,
        counters: Box<[u64]>,
        sink: Box<[u64]>,
        wqes: [Box<[u64]>; 2],
        ctl: [Box<[u64]>; 2],
        cqe: [Box<[u64]>; 2],
        nic: Nic<HostDma>,
    }

    fn rig() -> Rig {
        let src: Box<[u64]> = (0..32u64).map(|i| i * 0x0101_0101).collect();
        let dst = buf(32);
        let sig_own = buf(8);
        let sig_peer = buf(8);
        let counters = buf(16);
        let sink = buf(8);
        let wqes = [buf(8 << LOG2), buf(8 << LOG2)];
        let ctl = [buf(2), buf(2)];
        let mut cqe = [buf(8), buf(8)];
        for c in &mut cqe {
            c[7] = u64::from(CQE_INVALID << 4) << 56;
        }
        let windows = Arc::new(Fabric::local(Arc::default(), Duration::from_secs(5)));
        let part = |size: u64, peers: [u64; 2], addrs: [u64; 2]| {
            let parts = MemParts {
                memory: Memory::Device,
                local_base: peers[0] as usize,
                sizes: vec![size; 2],
                peer_bases: peers.iter().map(|&p| p as usize).collect(),
                keys: vec![0; 2],
                addrs: addrs.to_vec(),
                states: vec![0; 2],
                keep: None,
            };
            // SAFETY: the rig's host buffers stand for device memory (the
            // test's "stream" copies host memory) and outlive the NIC.
            unsafe { MemDesc::new(parts) }
        };
        windows.add_window(DATA, part(256, [addr(&src), addr(&dst)], VA));
        windows.add_window(SIG, part(64, [addr(&sig_own), addr(&sig_peer)], SIG_VA));
        let sq = |j: usize| SqSpec {
            qpn: 0x102 + j as u32,
            log2: LOG2,
            wqes: wqes[j].as_ptr() as *mut u8,
            ctl: ctl[j].as_ptr() as *mut u8,
            cqe: addr(&cqe[j]),
        };
        let spec = NicSpec {
            rank: 0,
            nranks: N,
            pairs: vec![PairSpec {
                ctx: 0,
                peer: 1,
                main: sq(0),
                companion: sq(1),
            }],
            windows,
            signal: SignalInfo {
                window: SIG,
                peers: vec![addr(&sig_own), addr(&sig_peer)],
                keys: vec![0; 2],
            },
            counters: addr(&counters),
            counter_slots: 8,
            sink: addr(&sink),
            sink_host: sink.as_ptr() as *mut u8,
            sink_len: 64,
            spin: Duration::ZERO,
            links: vec![None; N],
            stage: None,
            timeout: Duration::from_secs(5),
        };
        let nic = Nic::new(spec, Arc::default(), || Ok(HostDma)).unwrap();
        Rig {
            _sig_own: sig_own,
            src,
            dst,
            sig_peer,
            counters,
            sink,
            wqes,
            ctl,
            cqe,
            nic,
        }
    }

    fn key(id: u32, p: usize) -> u32 {
        window_key(id, p, N).unwrap()
    }

    impl Rig {
        /// Writes `ops` at indices `from..` of queue `j` and posts them.
        fn post(&mut self, j: usize, from: u64, ops: &[(Op, u8)]) {
            let qpn = 0x102 + j as u32;
            for (i, (op, fm)) in ops.iter().enumerate() {
                let idx = from + i as u64;
                let b = encode(op, idx as u16, qpn, fm | CQ_UPDATE).unwrap();
                let at = (idx as usize & ((1 << LOG2) - 1)) * 8;
                for q in 0..8 {
                    self.wqes[j][at + q] =
                        u64::from_ne_bytes(b[q * 8..q * 8 + 8].try_into().unwrap());
                }
            }
            self.dbrec(j, from + ops.len() as u64);
        }
        fn dbrec(&mut self, j: usize, pi: u64) {
            self.ctl[j][0] = u64::from(u32::from(pi as u16).to_be());
        }
        fn serve(&mut self) -> u64 {
            self.nic.serve(0, false).unwrap() + self.nic.serve(0, true).unwrap()
        }
        /// (opcode, WQE counter, syndrome) of queue `j`'s collapsed CQE.
        fn cqe(&self, j: usize) -> (u8, u16, u8) {
            let t = self.cqe[j][7].to_le_bytes();
            let s = self.cqe[j][6].to_le_bytes();
            (t[7] >> 4, u16::from_be_bytes([t[4], t[5]]), s[7])
        }
        fn error(&self) -> Option<String> {
            self.nic.error.lock().unwrap().clone()
        }
    }

    fn write(off: u64, len: u32) -> Op {
        Op::Write {
            remote: MemRef {
                addr: VA[1] + off,
                key: key(DATA, 1),
            },
            local: MemRef {
                addr: VA[0] + off,
                key: key(DATA, 0),
            },
            len,
        }
    }

    /// This rank's (0) sub-slot of signal slot `slot` at the peer.
    fn signal(slot: u64, add: u64, sink: u64) -> Op {
        Op::FetchAdd {
            remote: MemRef {
                addr: SIG_VA[1] + slot * N as u64 * 8,
                key: key(SIG, 1),
            },
            add,
            result: MemRef {
                addr: sink,
                key: SINK_KEY,
            },
        }
    }

    #[test]
    fn put_with_signal_moves_data_then_reports_one_cqe() {
        let mut r = rig();
        let sink = addr(&r.sink);
        r.post(
            0,
            0,
            &[
                (write(16, 64), FM_NONE),
                (signal(2, 5, sink), FM_STRONG_ORDERING),
            ],
        );
        assert_eq!(r.serve(), 2);
        assert_eq!(r.dst[2..10], r.src[2..10]);
        assert_eq!(r.dst[0..2], [0, 0]);
        assert_eq!(r.sig_peer[4], 5, "rank 0's sub-slot of slot 2");
        assert_eq!(r.cqe(0), (CQE_REQ, 1, 0));
        // A second signal: the running total, and the old value (big-endian)
        // in the sink.
        r.post(0, 2, &[(signal(2, 3, sink), FM_NONE)]);
        assert_eq!(r.serve(), 1);
        assert_eq!(r.sig_peer[4], 8);
        assert_eq!(u64::from_be(r.sink[0]), 5);
        assert_eq!(r.cqe(0), (CQE_REQ, 2, 0));
        assert_eq!(r.error(), None);
    }

    #[test]
    fn counter_waits_for_the_main_queue() {
        let mut r = rig();
        let bump = |r: &Rig| Op::FetchAdd {
            remote: MemRef {
                addr: addr(&r.counters) + 3 * 16,
                key: COUNTER_KEY,
            },
            add: 1,
            result: MemRef {
                addr: addr(&r.sink) + 8,
                key: SINK_KEY,
            },
        };
        let wait = |idx: u32| Op::Wait {
            max_index: idx,
            cqn: 0x102,
        };
        // The companion's WAIT names main WQE 0, which is not posted yet.
        let b = bump(&r);
        r.post(1, 0, &[(wait(0), FM_NONE), (b, FM_NONE)]);
        assert_eq!(r.serve(), 0);
        assert_eq!(r.counters[6], 0);
        r.post(0, 0, &[(write(0, 8), FM_NONE)]);
        assert_eq!(r.serve(), 3);
        assert_eq!(r.counters[6], 1, "counter 3's NIC sub-slot");
        assert_eq!(r.cqe(1), (CQE_REQ, 1, 0));
    }

    #[test]
    fn bad_key_is_an_error_cqe_and_the_queue_stays_in_error() {
        let mut r = rig();
        let mut bad = write(0, 8);
        if let Op::Write { remote, .. } = &mut bad {
            remote.key = 0xdead_0001;
        }
        r.post(0, 0, &[(write(0, 8), FM_NONE), (bad, FM_NONE)]);
        assert_eq!(r.serve(), 2);
        assert_eq!(r.cqe(0), (CQE_REQ_ERR, 1, syndrome::REMOTE_ACCESS_ERR));
        let e = r.error().unwrap();
        assert!(
            e.contains("QP 0x102 to rank 1")
                && e.contains("WQE index 1")
                && e.contains("syndrome 0x13")
                && e.contains("0xdead0001"),
            "{e}"
        );
        // Later WQEs are flushed; the first error stays visible.
        r.dst[4] = 0;
        r.post(0, 2, &[(write(32, 8), FM_NONE)]);
        assert_eq!(r.serve(), 1);
        assert_eq!(r.dst[4], 0);
        assert_eq!(r.cqe(0), (CQE_REQ_ERR, 1, syndrome::REMOTE_ACCESS_ERR));
    }

    #[test]
    fn out_of_range_and_foreign_sub_slots_are_refused() {
        let shifted = |remote: u64, local: u64| Op::Write {
            remote: MemRef {
                addr: VA[1] + remote,
                key: key(DATA, 1),
            },
            local: MemRef {
                addr: VA[0] + local,
                key: key(DATA, 0),
            },
            len: 8,
        };
        let cases = |sink: u64| {
            [
                (shifted(250, 0), syndrome::REMOTE_ACCESS_ERR),
                (shifted(0, 250), syndrome::LOCAL_PROT_ERR),
                (
                    // Rank 1's own sub-slot: this NIC is not its only writer.
                    Op::FetchAdd {
                        remote: MemRef {
                            addr: SIG_VA[1] + 8,
                            key: key(SIG, 1),
                        },
                        add: 1,
                        result: MemRef {
                            addr: sink,
                            key: SINK_KEY,
                        },
                    },
                    syndrome::REMOTE_OP_ERR,
                ),
                (
                    Op::CompareSwap {
                        remote: MemRef {
                            addr: SIG_VA[1],
                            key: key(SIG, 1),
                        },
                        compare: 0,
                        swap: 1,
                        result: MemRef {
                            addr: sink,
                            key: SINK_KEY,
                        },
                    },
                    syndrome::REMOTE_OP_ERR,
                ),
                (signal(0, 1, sink + 64), syndrome::LOCAL_PROT_ERR),
            ]
        };
        for i in 0..5 {
            let mut r = rig();
            let (op, syn) = cases(addr(&r.sink))[i].clone();
            r.post(0, 0, &[(op.clone(), FM_NONE)]);
            assert_eq!(r.serve(), 1);
            assert_eq!(r.cqe(0), (CQE_REQ_ERR, 0, syn), "{op:?}");
            assert!(r.sig_peer.iter().all(|&v| v == 0));
            assert!(r.dst.iter().all(|&v| v == 0));
        }
    }

    #[test]
    fn a_freed_window_is_refused() {
        let mut r = rig();
        r.post(0, 0, &[(write(0, 8), FM_NONE)]);
        assert_eq!(r.serve(), 1);
        // What dropping a GpuWindow does to the directory.
        r.nic.spec.windows.remove_window(DATA);
        r.post(0, 1, &[(write(8, 8), FM_NONE)]);
        assert_eq!(r.serve(), 1);
        assert_eq!(r.cqe(0), (CQE_REQ_ERR, 1, syndrome::LOCAL_PROT_ERR));
        assert!(r.error().unwrap().contains("names no registered window"));
        assert_eq!(r.dst[1], 0);
    }

    #[test]
    fn a_wqe_with_the_wrong_index_is_a_local_qp_error() {
        let mut r = rig();
        // Written for index 5, posted at index 0.
        let b = encode(&write(0, 8), 5, 0x102, CQ_UPDATE).unwrap();
        for q in 0..8 {
            r.wqes[0][q] = u64::from_ne_bytes(b[q * 8..q * 8 + 8].try_into().unwrap());
        }
        r.dbrec(0, 1);
        r.serve();
        assert_eq!(r.cqe(0), (CQE_REQ_ERR, 0, syndrome::LOCAL_QP_OP_ERR));
        assert!(r.error().unwrap().contains("carries index 5"));
    }

    #[test]
    fn a_doorbell_record_that_went_backwards_is_one_fatal_qp_error_and_nothing_runs() {
        let mut r = rig();
        r.post(0, 0, &[(write(0, 8), FM_NONE), (write(8, 8), FM_NONE)]);
        assert_eq!(r.serve(), 2);
        let dst = r.dst.clone();
        // The record moves back by one: read as 0xffff WQEs ahead of the
        // consumer index (2) on an 8-entry queue, as the CPU soft NIC reads
        // it. Producers post in reservation order, so it never happens to a
        // working queue.
        r.dbrec(0, 1);
        assert_eq!(r.serve(), 0);
        assert_eq!(r.cqe(0), (CQE_REQ_ERR, 2, syndrome::LOCAL_QP_OP_ERR));
        let e = r.error().unwrap();
        for w in [
            "QP 0x102 to rank 1",
            "producer index 1",
            "consumer index 2",
            "8-entry",
        ] {
            assert!(e.contains(w), "error {e:?} does not mention {w:?}");
        }
        assert_eq!(r.dst, dst, "nothing executed");
        // Reported once: later passes (and later posts) add nothing and
        // move no data; the first error stays where the kernel reads it.
        assert_eq!(r.serve(), 0);
        r.post(0, 2, &[(write(16, 8), FM_NONE)]);
        r.serve();
        assert_eq!(r.dst, dst);
        assert_eq!(r.cqe(0), (CQE_REQ_ERR, 2, syndrome::LOCAL_QP_OP_ERR));
        assert_eq!(r.error().unwrap(), e);
    }
}
