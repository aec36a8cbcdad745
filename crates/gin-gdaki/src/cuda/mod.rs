//! soft-mlx5 on CUDA ranks: the send queues kernels write, and the one
//! [`Engine`](crate::nic::Engine) executing them on a
//! [`SoftNic`] thread through CUDA streams.
//!
//! [`CudaNic::start`] sets up, for every context and every peer it serves,
//! an RC QP and its companion loopback QP (numbered as on CPU ranks:
//! [`crate::ids::main_qpn`], [`crate::ids::companion_qpn`]): each send queue
//! of `2^log2` WQEs in mapped pinned host memory (the NIC polls it, read
//! through [`SqView::foreign`]), its reservation and ready indices in device
//! memory (a kernel never needs an atomic across PCIe), its doorbell record
//! and doorbell in mapped pinned memory, and its collapsed CQE in device
//! memory, which kernels poll; and the `GdakiQpAbi[nctx * nranks]` table,
//! context-major, that `DevCommAbi::rings` points at ([`CudaNic::table`]).
//! It then starts the engine with a CUDA-stream executor (`executor.rs`;
//! one stream per context and peer, shared by the main QP and its
//! companion, so a counter lands after the data it counts) on a driver
//! thread with the GPU idle policy ([`Idle::gpu`]).
//!
//! The channels' streams are watched for stalls (a [`StallWatch`], and a
//! monitor thread that logs one): work a stream has not completed for
//! [`stall_threshold`] of the job's timeout is diagnosed — it waits behind
//! a kernel on a shared hardware work queue — and reported as the NIC's
//! error while it lasts ([`CudaNic::stall`]), so that the watch over
//! running kernels aborts them with that cause instead of their waits
//! timing out bare.
//!
//! What a device communicator keeps is the opaque [`CudaNic`], as a
//! [`CudaEngine`] (gin-core starts it through [`crate::GdakiBackend`]): the
//! table's address for the ABI, the first error (or a stall) while a
//! kernel runs, and `stop`.

mod executor;

use std::sync::Arc;
use std::time::{Duration, Instant};

use gin_cuda::batch::pass_len;
use gin_cuda::batch::stall::{HostMarks, Monitor, Stall, StallWatch, WorkQueues, stall_threshold};
use gin_cuda::staging::Stage;
use gin_cuda::{CudaError, DevMem, Device, HostMem};
use gin_device::abi::{BACKEND_GDAKI, BACKEND_NONE, GdakiQpAbi, GdakiSqAbi};
use gin_device::{CudaEngine, CudaEngineSpec, GinError, StartError};
use gin_net::{Fabric, KeepAlive, NetError, Reach};

use crate::completion::FRESH_OP_OWN;
use crate::ids::{COUNTER_KEY, SINK_KEY, companion_qpn, main_qpn, window_key};
use crate::nic::{
    CqMode, DriverConfig, DriverError, Engine, EngineConfig, EngineError, Idle, Part, QueueSpec,
    SINK_QWORDS, Sink, SoftNic, SqView, ViewError,
};

use executor::{CudaExecutor, DevCq, Layout};

/// Bytes of one send queue's entry in the index array (reservation and
/// ready index) and in the doorbell array (record, then register).
const SQ_CTL: u64 = 16;
/// Bytes of a collapsed CQE.
const CQE: u64 = 64;

/// Why the CUDA soft NIC could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CudaNicError {
    /// Allocating the queues, their indices, CQEs or table, or the staging
    /// buffer failed (or CUDA is not usable).
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// The signal window is not in the fabric's directory.
    #[error(transparent)]
    Net(#[from] NetError),
    /// A send queue's memory cannot be viewed (a depth out of range).
    #[error(transparent)]
    View(#[from] ViewError),
    /// The queues do not make an engine (a QP number out of range).
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The signal window's id runs into the NIC's local keys.
    #[error("rank {rank}: the signal window {window} has no NIC key for rank {peer}")]
    NoKey {
        /// This rank.
        rank: usize,
        /// The signal window.
        window: u32,
        /// The peer whose part has no key.
        peer: usize,
    },
    /// Context `ctx`'s QP to `peer` has no 24-bit QP number.
    #[error("rank {rank}: context {ctx}'s QP to rank {peer} has no QP number (too many contexts)")]
    Qpn {
        /// This rank.
        rank: usize,
        /// The context.
        ctx: usize,
        /// The peer.
        peer: usize,
    },
    /// The NIC's thread could not be started.
    #[error("rank {rank}: could not start the CUDA soft NIC thread: {why}")]
    Spawn {
        /// This rank.
        rank: usize,
        /// The operating system's account.
        why: String,
    },
    /// A setting in the environment is not understood.
    #[error("rank {rank}: {why}")]
    Setting {
        /// This rank.
        rank: usize,
        /// The variable, its value and what it takes.
        why: String,
    },
}

/// The soft NIC of one device communicator's GDAKI queues (see the module
/// documentation): the queue table, and the thread serving the queues, if
/// any peer is served. Dropping it stops the thread, as [`CudaNic::stop`]
/// does.
#[derive(Debug)]
pub struct CudaNic {
    /// First: stopped (and joined) before the memory below is freed.
    driver: Option<SoftNic>,
    /// The channels' streams, watched for stalls (with the thread that
    /// logs them), while a thread runs.
    stalls: Option<(Arc<StallWatch>, Monitor)>,
    table: DevMem,
    _mem: Arc<QueueMem>,
}

/// A QP pair of the layout: its context, its peer, its index `ctx * n +
/// peer` in the table (its send queues are `2 * index` and one above), and
/// the channel (stream) it gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slot {
    ctx: usize,
    peer: usize,
    index: usize,
    channel: usize,
}

/// The QP pairs of `nctx` contexts to the peers `serve` names,
/// context-major, one channel each.
fn layout(nctx: usize, serve: &[bool]) -> impl Iterator<Item = Slot> + '_ {
    let n = serve.len();
    (0..nctx)
        .flat_map(move |ctx| (0..n).filter(|&p| serve[p]).map(move |peer| (ctx, peer)))
        .enumerate()
        .map(move |(channel, (ctx, peer))| Slot {
            ctx,
            peer,
            index: ctx * n + peer,
            channel,
        })
}

/// How the stall watch names channel `ch`, context `ctx`'s QP pair to
/// `peer`.
fn channel_name(ch: usize, ctx: usize, peer: usize) -> String {
    format!("channel {ch} (context {ctx}'s QPs to peer {peer})")
}

/// Where the queues' shared arrays are, as kernels see them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Arrays {
    /// Device address of the index array (`SQ_CTL` bytes a queue).
    indices: u64,
    /// Device address of the doorbell array (`SQ_CTL` bytes a queue).
    ctl: u64,
    /// Device address of the CQE array (`CQE` bytes a queue).
    cqes: u64,
}

/// Send queue `k`'s entry of the table: its WQEs at `wqes`, its slots of
/// the shared arrays.
fn sq_abi(a: Arrays, k: usize, wqes: u64, qpn: u32, log2: u32) -> GdakiSqAbi {
    let k = k as u64;
    GdakiSqAbi {
        wqes,
        indices: a.indices + k * SQ_CTL,
        dbrec: a.ctl + k * SQ_CTL,
        doorbell: a.ctl + k * SQ_CTL + 8,
        cqe: a.cqes + k * CQE,
        qpn,
        log2,
    }
}

/// The memory of the queues, shared by the kernels, the NIC's views and
/// its streams: freed once all of them are done.
#[derive(Debug)]
struct QueueMem {
    indices: DevMem,
    cqes: DevMem,
    ctl: HostMem,
    /// The WQEs of send queue `2 * channel` (main) and one above
    /// (companion).
    wqes: Vec<HostMem>,
}

impl QueueMem {
    /// Arrays for `nsq` send queues (every context and rank, served or
    /// not, as the table indexes them), every CQE fresh, and `served`
    /// send queues of `2^log2` WQEs.
    fn new(nsq: usize, served: usize, log2: u32) -> Result<Self, CudaError> {
        let indices = DevMem::new(nsq * SQ_CTL as usize)?;
        let cqes = DevMem::new(nsq * CQE as usize)?;
        // A fresh CQE is invalid (opcode 15, owner 0), as rdma-core sets it.
        let mut fresh = vec![0u8; nsq * CQE as usize];
        for c in fresh.chunks_mut(CQE as usize) {
            c[CQE as usize - 1] = FRESH_OP_OWN;
        }
        cqes.write(0, &fresh)?;
        let ctl = HostMem::new(nsq * SQ_CTL as usize)?;
        let wqes = (0..served)
            .map(|_| HostMem::new(64 << log2))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            indices,
            cqes,
            ctl,
            wqes,
        })
    }

    fn arrays(&self) -> Arrays {
        Arrays {
            indices: self.indices.ptr(),
            ctl: self.ctl.dev(),
            cqes: self.cqes.ptr(),
        }
    }
}

/// What the table and the engine get for one send queue.
struct Sq {
    abi: GdakiSqAbi,
    spec: QueueSpec<DevCq>,
}

/// Send queue `k` (QP `qpn`, reaching `peer`, on `channel`), whose WQEs
/// are `mem.wqes[w]`.
fn send_queue(
    mem: &Arc<QueueMem>,
    (k, w): (usize, usize),
    qpn: u32,
    peer: usize,
    channel: usize,
    log2: u32,
) -> Result<Sq, CudaNicError> {
    let wqes = &mem.wqes[w];
    let abi = sq_abi(mem.arrays(), k, wqes.dev(), qpn, log2);
    // SAFETY: `wqes` holds `64 << log2` bytes of mapped pinned memory and
    // `ctl` `SQ_CTL` bytes at `k * SQ_CTL` (k < nsq), zeroed, kept by the
    // view (through `mem`); kernels write them with naturally aligned
    // stores, the host only loads them atomically through the view.
    let sq = unsafe {
        SqView::foreign(
            wqes.host_ptr(),
            mem.ctl.host_ptr().add(k * SQ_CTL as usize),
            log2,
            Some(KeepAlive(mem.clone())),
        )
    }?;
    let spec = QueueSpec {
        qpn,
        cqn: qpn,
        peer,
        channel,
        cq_mode: CqMode::Collapsed,
        sq,
        cq: DevCq(abi.cqe),
    };
    Ok(Sq { abi, spec })
}

impl CudaNic {
    /// Sets up the QP pairs of every context to every peer `spec.serve`
    /// names, and starts the soft NIC serving them (no thread when it
    /// serves none; the table is made anyway). The calling thread must
    /// have the GPU's context current.
    ///
    /// # Safety
    /// `spec.counters` must be `spec.counter_slots * 16` bytes of device
    /// memory of `spec.dev` that outlive the returned NIC (stopping or
    /// dropping it joins its thread once its streams are drained), and
    /// every GPU window in `spec.fabric`'s directory must stay what its
    /// description says until it leaves the directory, and then until every
    /// stream of this NIC has executed the work it queued on it (free a
    /// window only after the kernels that used it were flushed).
    pub unsafe fn start(spec: CudaEngineSpec<Fabric, Device>) -> Result<Self, CudaNicError> {
        let (rank, n) = (spec.fabric.rank(), spec.fabric.nranks());
        // A bad setting is refused before anything is allocated.
        let merge = std::env::var(gin_cuda::puts::MERGE_VAR).ok();
        let merge = gin_cuda::puts::merge_max_from(merge.as_deref())
            .map_err(|why| CudaNicError::Setting { rank, why })?;
        let serve: Vec<bool> = (0..n)
            .map(|p| p != rank && spec.serve.get(p).copied().unwrap_or(false))
            .collect();
        let slots: Vec<Slot> = layout(spec.nctx, &serve).collect();
        let nsq = spec.nctx * n * 2;
        let mem = Arc::new(QueueMem::new(nsq, slots.len() * 2, spec.log2)?);
        let sink = Arc::new(Sink::default());
        let sig = spec.fabric.window(spec.signal_window)?;
        let mut table = vec![GdakiQpAbi::default(); spec.nctx * n];
        let mut queues = Vec::with_capacity(slots.len() * 2);
        for s in &slots {
            let qpn = |f: fn(usize, usize, usize) -> Option<u32>| {
                f(s.ctx, s.peer, n).ok_or(CudaNicError::Qpn {
                    rank,
                    ctx: s.ctx,
                    peer: s.peer,
                })
            };
            let (k, w) = (2 * s.index, 2 * s.channel);
            let main = send_queue(&mem, (k, w), qpn(main_qpn)?, s.peer, s.channel, spec.log2)?;
            let companion = send_queue(
                &mem,
                (k + 1, w + 1),
                qpn(companion_qpn)?,
                rank,
                s.channel,
                spec.log2,
            )?;
            let sig_key = window_key(spec.signal_window, s.peer, n).ok_or(CudaNicError::NoKey {
                rank,
                window: spec.signal_window,
                peer: s.peer,
            })?;
            table[s.index] = GdakiQpAbi {
                main: main.abi,
                companion: companion.abi,
                sig_addr: sig.addrs.get(s.peer).copied().unwrap_or(0),
                sig_key,
                counter_key: COUNTER_KEY,
                sink: sink.addr(),
                sink_key: SINK_KEY,
                main_cqn: main.abi.qpn,
            };
            queues.extend([main.spec, companion.spec]);
        }
        let tab = DevMem::new(table.len() * std::mem::size_of::<GdakiQpAbi>())?;
        tab.write(0, &table)?;
        if queues.is_empty() {
            return Ok(Self {
                driver: None,
                stalls: None,
                table: tab,
                _mem: mem,
            });
        }
        let stalls = Arc::new(StallWatch::new(
            rank,
            "CUDA soft NIC",
            slots
                .iter()
                .map(|s| channel_name(s.channel, s.ctx, s.peer))
                .collect(),
            Box::new(HostMarks::new(slots.len())?),
            stall_threshold(spec.fabric.timeout()),
            WorkQueues::from_env(),
        ));
        // SAFETY: the counters and windows are the caller's contract.
        let driver = unsafe { Self::serve(&spec, &serve, queues, sink, &mem, (&stalls, merge)) }?;
        let monitor = stalls.monitor(format!("gin-cuda-nic-stalls-{rank}"))?;
        Ok(Self {
            driver: Some(driver),
            stalls: Some((stalls, monitor)),
            table: tab,
            _mem: mem,
        })
    }

    /// Starts the engine over `queues` with a CUDA-stream executor whose
    /// streams `stalls` watches, merging puts from GPU memory up to
    /// `merge` bytes.
    ///
    /// # Safety
    /// As [`CudaNic::start`].
    unsafe fn serve(
        spec: &CudaEngineSpec<Fabric, Device>,
        serve: &[bool],
        queues: Vec<QueueSpec<DevCq>>,
        sink: Arc<Sink>,
        mem: &Arc<QueueMem>,
        (stalls, merge): (&Arc<StallWatch>, u64),
    ) -> Result<SoftNic, CudaNicError> {
        let (rank, n) = (spec.fabric.rank(), spec.fabric.nranks());
        let keyed = |p: usize| serve[p] && spec.fabric.reach(p) == Some(Reach::Keyed);
        let stage = (0..n).any(keyed).then(Stage::new).transpose()?;
        let cfg = EngineConfig {
            rank,
            nranks: n,
            counters: Part {
                base: spec.counters,
                size: spec.counter_slots * 16,
            },
            sink: Part {
                base: sink.addr(),
                size: (SINK_QWORDS * 8) as u64,
            },
            batch: pass_len(spec.log2),
        };
        let layout = Layout {
            channels: queues.len() / 2,
            signal_window: spec.signal_window,
            counters: spec.counters,
            counter_slots: spec.counter_slots,
        };
        let engine = Engine::new(cfg, queues)?;
        // SAFETY: the counters and windows are the caller's contract; the
        // CQEs the engine publishes into are in `mem`, which the executor
        // keeps.
        let mut exec = unsafe {
            CudaExecutor::new(
                spec.dev.clone(),
                spec.fabric.clone(),
                layout,
                sink,
                stage,
                Box::new(mem.clone()),
            )
        };
        exec.watch_stalls(stalls.clone());
        exec.merge_puts(merge);
        let driver = DriverConfig {
            name: format!("gin-cuda-nic-{rank}"),
            idle: Idle::gpu(spec.spin),
            // A kernel may end right after a signal a peer waits for.
            drain_on_stop: true,
            // Never abandoned: its streams write the caller's counters and
            // windows, which must not be freed under it.
            join_within: Duration::MAX,
        };
        SoftNic::start(engine, exec, driver).map_err(|e| CudaNicError::Spawn {
            rank,
            why: e.to_string(),
        })
    }

    /// Device address of the `GdakiQpAbi[nctx * nranks]` table
    /// (`DevCommAbi::rings`); entries of peers not served are zero.
    pub fn table(&self) -> u64 {
        self.table.ptr()
    }

    /// Whether the NIC serves any queue (a thread runs).
    pub fn serves(&self) -> bool {
        self.driver.is_some()
    }

    /// The first error, once the NIC met one (an error completion names
    /// QP, WQE index and syndrome): a kernel waiting on it should be
    /// aborted.
    pub fn error(&self) -> Option<DriverError> {
        self.driver.as_ref().and_then(SoftNic::first_error)
    }

    /// A stall of the NIC's streams, while there is one: work queued on a
    /// channel's stream has not completed for longer than the threshold
    /// (logged at warn the first time it is seen).
    pub fn stall(&self) -> Option<Stall> {
        self.stalls.as_ref()?.0.check(Instant::now())
    }

    /// Stops the thread after it has executed what kernels posted (a
    /// kernel may end right after a signal a peer waits for) and waited for
    /// its streams; returns the first error.
    pub fn stop(mut self) -> Result<(), DriverError> {
        self.driver.take().map_or(Ok(()), SoftNic::stop)
    }
}

impl From<CudaNicError> for StartError {
    /// The thread's failure as gin-device's `Spawn`; the CUDA runtime's
    /// and the fabric's errors, and any other, passed on unchanged for the
    /// host layer.
    fn from(e: CudaNicError) -> Self {
        match e {
            CudaNicError::Spawn { rank, why } => StartError::Gin(GinError::Spawn {
                rank,
                what: "CUDA soft NIC thread",
                why,
            }),
            CudaNicError::Cuda(e) => StartError::Host(Box::new(e)),
            CudaNicError::Net(e) => StartError::Host(Box::new(e)),
            e => StartError::Host(Box::new(e)),
        }
    }
}

impl CudaEngine for CudaNic {
    fn rings(&self) -> u64 {
        self.table()
    }

    fn backend_kind(&self) -> u32 {
        if self.serves() {
            BACKEND_GDAKI
        } else {
            BACKEND_NONE
        }
    }

    fn serves(&self) -> bool {
        CudaNic::serves(self)
    }

    fn describe(&self, load_store: bool) -> &'static str {
        match (self.serves(), load_store) {
            (true, true) => "load/store + gdaki",
            (true, false) => "gdaki",
            (false, _) => "load/store",
        }
    }

    fn error(&self) -> Option<String> {
        CudaNic::error(self).map(|e| e.to_string())
    }

    /// A stall while it lasts (the kernels waiting on the stalled work are
    /// what it waits for).
    fn stall(&self) -> Option<String> {
        CudaNic::stall(self).map(|s| s.to_string())
    }

    fn failure(&self) -> &'static str {
        "the soft NIC reported"
    }

    /// A kernel that meets an error CQE ends on its own, perhaps before
    /// the watch saw the NIC's account of it.
    fn kernel_sees_errors(&self) -> bool {
        true
    }

    fn stop(self: Box<Self>) -> Result<(), String> {
        CudaNic::stop(*self).map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests;
