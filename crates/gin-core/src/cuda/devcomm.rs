//! Device communicators for CUDA kernels: requirements agreed by every
//! rank, signal and counter ranges, how each peer is reached, the engine
//! serving the other peers (started through the selected backend's
//! `HostBackend::start_cuda` and kept as an opaque `CudaEngine`), and
//! running a kernel while watching the job.

use std::sync::Arc;

use gin_bootstrap::Bootstrap;
use gin_cuda::watch::{EngineHealth, JobHealth, Outcome};
use gin_cuda::{DevMem, Function, LaunchConfig, Param, StreamRef};
use gin_device::abi::{
    DEVCOMM_FLAG_CTA_CTX, DEVCOMM_FLAG_EXCLUSIVE_CTX, DEVCOMM_FLAG_LSA_ONLY,
    DEVCOMM_FLAG_SENDER_SLOTS, DEVCOMM_FLAG_STRONG_SIGNALS, DevCommAbi, REACH_LSA, REACH_NONE,
    REACH_QUEUE, WindowAbi, errword, kernel_reach,
};
use gin_device::{CudaEngine, CudaEngineSpec, HostBackend};
use gin_net::Fabric;

use super::{CtxSharing, CudaComm, cudarc};
use crate::config::{BackendKind, Selection};
use crate::error::CoreError;
use crate::requirements;
use crate::space::Ranges;
use crate::{Connection, DevCommRequirements};

/// How each peer is reached.
struct Reach {
    /// The header's `REACH_*` (gin-device's `abi::REACH_*`), by rank.
    lsa: Vec<u8>,
    /// The rail team's ranks.
    rail: Vec<u32>,
}

impl Reach {
    /// Not at all for ranks off the rail with a rail connection (as on CPU
    /// ranks); load/store for this rank, and where the selection reaches
    /// peers by load/store (`auto`) every peer mapped here (not those over
    /// TCP); queues for the others.
    fn of(cuda: &CudaComm<'_>, rail_only: bool, load_store: bool) -> Self {
        let comm = cuda.comm;
        let (rank, n) = (comm.rank(), comm.nranks());
        let tcp: Vec<bool> = (0..n).map(|p| comm.reaches_keyed(p)).collect();
        let rail: Vec<u32> = comm.rail().iter().map(|&r| r as u32).collect();
        let lsa = (0..n)
            .map(|p| {
                if p != rank && rail_only && !rail.contains(&(p as u32)) {
                    REACH_NONE
                } else if p == rank || (load_store && !tcp[p]) {
                    REACH_LSA
                } else {
                    REACH_QUEUE
                }
            })
            .collect();
        Self { lsa, rail }
    }
}

/// The reach table with the rail team, and each rank's signal window part
/// as mapped here.
struct ReachTables {
    lsa: DevMem,
    sig_peers: DevMem,
}

impl<'c> CudaComm<'c> {
    /// Creates a device communicator for kernels (collective; same
    /// requirements on every rank). `GIN_BACKEND=auto` reaches every peer
    /// it maps by load/store and the others (over TCP) through the proxy,
    /// `proxy` every peer but this rank through the proxy, and `gdaki` every
    /// peer but this rank through mlx5 queues and the soft NIC.
    pub fn dev_comm(
        &self,
        req: &DevCommRequirements,
        sharing: CtxSharing,
    ) -> Result<CudaDevComm<'_, 'c>, CoreError> {
        self.dev_comm_on(req, sharing, self.comm.settings().backend)
    }

    /// As [`CudaComm::dev_comm`] with the backend named here instead of by
    /// `GIN_BACKEND` (benchmarks compare both in one job).
    pub fn dev_comm_on(
        &self,
        req: &DevCommRequirements,
        sharing: CtxSharing,
        kind: BackendKind,
    ) -> Result<CudaDevComm<'_, 'c>, CoreError> {
        let comm = self.comm;
        let (rank, n) = (comm.rank(), comm.nranks());
        self.dev.make_current()?;
        let selected = kind.selection();
        let reach = Reach::of(
            self,
            req.connection == Connection::Rail,
            selected.load_store,
        );
        let (sig_per_ctx, ranges) = self.reserve(req, &selected)?;
        // Whether every rank reaches every rank by load/store
        // (`DEVCOMM_FLAG_LSA_ONLY`: a wait reads one word); unconnected
        // ranks never signal here.
        let lsa_only = reach.lsa.iter().all(|&l| l != REACH_QUEUE);
        let lsa_only = comm.bootstrap().first_refusal(lsa_only)?.is_none();
        let log2 = kind.queue_log2(req.queue_depth)?;
        let engine = self.start_engine(req.contexts as usize, &reach.lsa, selected.queues, log2)?;
        let tables = self.reach_tables(req, &reach)?;
        let timeout = comm.settings().timeout;
        let abi = DevCommAbi {
            rank: rank as u32,
            nranks: n as u32,
            nctx: req.contexts,
            nsignals: req.signals,
            ncounters: req.counters,
            flags: flags(lsa_only, sharing),
            signal_base: ranges.signals.0,
            signals: self.signal_window.local().ptr(),
            counter_base: ranges.counters.0,
            counters: self.counters.ptr(),
            abort_flag: self.kernels.abort_flag(),
            error_word: self.kernels.error_word(),
            timeout_ticks: u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX),
            rings: engine.rings(),
            backend_kind: engine.backend_kind(),
            sig_per_ctx,
            lsa: tables.lsa.ptr(),
            signal_peers: tables.sig_peers.ptr(),
            world_barriers: req.world_barriers,
            signal_window: self.signal_window.id(),
        };
        // Nobody signals into slots another rank has not zeroed yet.
        comm.bootstrap().barrier()?;
        Ok(CudaDevComm {
            cuda: self,
            abi,
            sentinel: Arc::new(Sentinel::new(
                Job {
                    bootstrap: comm.bootstrap_arc().clone(),
                    fabric: comm.fabric().clone(),
                },
                Some(Served(engine)),
                // How a lost TCP link waits for the bootstrap to name a
                // dead peer before the link's own account is taken as the
                // cause: the workspace's one grace.
                gin_device::CAUSE_GRACE,
            )),
            _mem: vec![tables.lsa, tables.sig_peers],
            ranges: Some(ranges),
            lsa: reach.lsa.iter().map(|&b| b == REACH_LSA).collect(),
        })
    }

    /// Checks `req` for the selected backend and that every rank asks
    /// alike, takes the signal and counter ranges from the id spaces (given
    /// back when they drop), zeroes their slots and checks that every rank
    /// placed them alike; returns the signals each context takes (its own,
    /// then one per barrier) and the ranges.
    fn reserve(
        &self,
        req: &DevCommRequirements,
        selected: &Selection,
    ) -> Result<(u32, Ranges<'_>), CoreError> {
        let comm = self.comm;
        let rank = comm.rank();
        let check = || {
            if req.connection == Connection::Rail && req.world_barriers != 0 {
                return Err(CoreError::Requirement {
                    rank,
                    what: format!(
                        "{} world barriers asked for with a rail connection, which reaches only \
                         the rail's ranks; use rail barriers or a full connection",
                        req.world_barriers
                    ),
                });
            }
            comm.settings().check_usable(selected)?;
            (req.signals.checked_add(req.world_barriers))
                .and_then(|v| v.checked_add(req.rail_barriers))
                .ok_or_else(|| requirements::overflow(rank))
        };
        let zero = |r: &Ranges<'_>| {
            let nn = comm.nranks() as u64;
            let ((sb, nsig), (cb, ncnt)) = (r.signals, r.counters);
            let signals = self.signal_window.local();
            signals.zero_wait((sb * nn * 8) as usize, (nsig * nn * 8) as usize)?;
            Ok(self
                .counters
                .zero_wait((cb * 16) as usize, (ncnt * 16) as usize)?)
        };
        // Every rank must agree on which peers are reached by load/store,
        // since signals land in different sub-slots for them: the backend
        // travels along with the requirements.
        let backend = (
            "GIN_BACKEND (load/store to peers or not)",
            u64::from(selected.load_store),
        );
        requirements::reserve(comm.bootstrap(), &self.spaces, req, &[backend], check, zero)
    }

    /// The queues of every context to every peer not reached by
    /// load/store, and the selected backend's engine serving them on CUDA
    /// streams (no thread when it serves none; the queue table is made
    /// anyway).
    fn start_engine(
        &self,
        nctx: usize,
        lsa: &[u8],
        backend: &dyn HostBackend<Fabric, gin_cuda::Device>,
        log2: u32,
    ) -> Result<Box<dyn CudaEngine>, CoreError> {
        let comm = self.comm;
        let spec = CudaEngineSpec {
            dev: self.dev.clone(),
            fabric: comm.fabric().clone(),
            nctx,
            serve: lsa.iter().map(|&l| l == REACH_QUEUE).collect(),
            // Within the backend's bounds (`BackendKind::queue_log2`).
            log2,
            signal_window: self.signal_window.id(),
            counters: self.counters.ptr(),
            counter_slots: comm.settings().counter_slots,
            spin: comm.settings().proxy_spin,
        };
        // SAFETY: the counter array holds `counter_slots * 16` bytes of
        // this GPU's memory and belongs to the CUDA communicator, which
        // outlives the device communicator that stops the engine (destroy
        // or drop). GPU windows leave the fabric's directory before their
        // memory is freed, and `free_window` asks that the contexts using
        // them were flushed first.
        Ok(unsafe { backend.start_cuda(spec) }?)
    }

    /// The reach table, then the rail team at the next multiple of 4; and
    /// each rank's signal window part as mapped here.
    fn reach_tables(
        &self,
        req: &DevCommRequirements,
        reach: &Reach,
    ) -> Result<ReachTables, CoreError> {
        let n = self.comm.nranks();
        let team_at = n.next_multiple_of(4);
        let team: Vec<u32> = [req.rail_barriers, reach.rail.len() as u32]
            .into_iter()
            .chain(reach.rail.iter().copied())
            .collect();
        // Load/store peers on this GPU (same UUID) get REACH_SAME_GPU.
        let me = self.dev.uuid().unwrap_or_default();
        let gpus = self.comm.bootstrap().allgather(me.as_bytes())?;
        let lsa = DevMem::new(team_at + team.len() * 4)?;
        lsa.write(0, &kernel_reach(&reach.lsa, &gpus, me.as_bytes()))?;
        lsa.write(team_at, &team)?;
        let sig_peers = DevMem::new(n * 8)?;
        let sig = self.comm.fabric().window(self.signal_window.id())?;
        let peers: Vec<u64> = sig.peer_bases.iter().map(|&b| b as u64).collect();
        sig_peers.write(0, &peers)?;
        Ok(ReachTables { lsa, sig_peers })
    }
}

/// The device communicator flags for `sharing`, with
/// `DEVCOMM_FLAG_LSA_ONLY` where every rank reaches every rank by
/// load/store.
fn flags(lsa_only: bool, sharing: CtxSharing) -> u32 {
    let mut flags = DEVCOMM_FLAG_SENDER_SLOTS | DEVCOMM_FLAG_STRONG_SIGNALS;
    if lsa_only {
        flags |= DEVCOMM_FLAG_LSA_ONLY;
    }
    flags
        | match sharing {
            CtxSharing::Gpu => 0,
            CtxSharing::Cta => DEVCOMM_FLAG_CTA_CTX,
            CtxSharing::Thread => DEVCOMM_FLAG_EXCLUSIVE_CTX,
        }
}

/// A device communicator for CUDA kernels.
#[derive(Debug)]
pub struct CudaDevComm<'a, 'c> {
    cuda: &'a CudaComm<'c>,
    abi: DevCommAbi,
    /// What watchers check: the job's health and the engine (its queue
    /// table and thread, taken when stopped).
    sentinel: Arc<Sentinel>,
    _mem: Vec<DevMem>,
    ranges: Option<Ranges<'a>>,
    lsa: Vec<bool>,
}

/// What tells a watch that kernels should give up (gin-cuda's policy over
/// the job and the engine, its grace the workspace's one). Owned (`Arc`s),
/// so a watcher thread may hold it.
type Sentinel = gin_cuda::watch::Sentinel<Job, Served>;

/// The job's health as a sentinel asks it: the bootstrap (a dead peer),
/// the fabric (a failed TCP transport).
#[derive(Debug)]
struct Job {
    bootstrap: Arc<Bootstrap>,
    fabric: Arc<Fabric>,
}

impl JobHealth for Job {
    fn dead_peer(&self) -> Option<String> {
        self.bootstrap.health().err().map(|e| e.to_string())
    }

    fn lost_link(&self) -> Option<String> {
        let e = self.fabric.health().err()?;
        Some(format!("the TCP transport failed: {e}"))
    }
}

/// The engine, shared with watcher threads (taken out when stopped).
#[derive(Debug)]
struct Served(Box<dyn CudaEngine>);

impl EngineHealth for Served {
    fn error(&self) -> Option<String> {
        self.0.error()
    }

    fn stall(&self) -> Option<String> {
        self.0.stall()
    }

    fn failure(&self) -> &'static str {
        self.0.failure()
    }

    fn kernel_sees_errors(&self) -> bool {
        self.0.kernel_sees_errors()
    }
}

/// A device communicator as one kernel parameter (a `gin::DevComm` by
/// value), for cudarc's launch builder: `builder.arg(&dev_comm.param())`.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DevCommParam(pub DevCommAbi);

// SAFETY: plain `#[repr(C)]` integers (gin-device asserts its layout),
// passed by value as the header's `gin::DevComm`.
unsafe impl cudarc::driver::DeviceRepr for DevCommParam {}

/// A kernel parameter, passed by value.
#[derive(Debug)]
pub enum Arg<'p> {
    /// A `gin::DevComm` (the device communicator's [`CudaDevComm::abi`]).
    DevComm(&'p DevCommAbi),
    /// A `gin::Window` (a window's [`GpuWindow::abi`](super::GpuWindow::abi)).
    Window(&'p WindowAbi),
    /// An 8-byte integer.
    U64(u64),
    /// A 4-byte integer.
    U32(u32),
    /// A device address (8 bytes).
    Ptr(u64),
}

/// Watches the job while kernels run without blocking the thread that
/// launched them ([`CudaDevComm::watch`]): a thread that, each millisecond
/// while the watcher lives, checks the bootstrap (a dead peer), the TCP
/// transport and the engine, and on the first failure raises the abort
/// flag (the kernels' waits give up with an error) and records the cause.
/// Hand it to [`CudaDevComm::check`] once the kernels have finished;
/// dropping it stops the thread too (and lets go of the flag: drop it only
/// once the kernels it watched have finished). Watchers of one CUDA
/// communicator share its flag, which stays raised until the last watcher
/// that raised it lets go (gin-cuda's `watch::Watcher`, `watch::Abort`).
/// Owned (`'static`, `Send`: a type owning the device communicator keeps
/// one beside it); another device communicator's check refuses it.
#[derive(Debug)]
pub struct Watcher {
    inner: gin_cuda::watch::Watcher,
}

impl Watcher {
    /// The cause found so far (a dead peer, a failed transport or engine),
    /// if any: the abort flag is raised then.
    pub fn cause(&self) -> Option<String> {
        self.inner.cause()
    }
}

impl CudaDevComm<'_, '_> {
    /// What a kernel receives (pass by value as `gin::DevComm`).
    pub fn abi(&self) -> &DevCommAbi {
        &self.abi
    }

    /// [`CudaDevComm::abi`] as a kernel parameter for cudarc's launch
    /// builder (`builder.arg(&dc.param())`; that launch is `unsafe` in
    /// cudarc, with the promises of [`CudaDevComm::launch_on`]).
    pub fn param(&self) -> DevCommParam {
        DevCommParam(self.abi)
    }

    /// Whether `peer` is reached by load/store.
    pub fn is_lsa(&self, peer: usize) -> bool {
        self.lsa.get(peer).copied().unwrap_or(false)
    }

    /// The backend serving peers not reached by load/store (with `auto`
    /// and peers over TCP: "load/store + proxy").
    pub fn backend_name(&self) -> &'static str {
        let mixed = self.lsa.iter().filter(|&&l| l).count() > 1;
        self.sentinel
            .engine()
            .as_ref()
            .map_or("load/store", |e| e.0.describe(mixed))
    }

    /// Launches `f` on `grid` blocks of `block` threads and waits for it,
    /// raising the abort flag if a peer dies or the proxy fails meanwhile.
    /// Afterwards the error word is read: a device-side error becomes an
    /// error naming this rank, the peer, the context and the id. (This is
    /// [`CudaDevComm::launch_on`] gin's stream, a watch on this thread
    /// while the stream runs, and [`CudaDevComm::check`].)
    ///
    /// # Safety
    /// As [`CudaDevComm::launch_on`].
    pub unsafe fn run(
        &self,
        f: &Function,
        grid: u32,
        block: u32,
        args: &[Arg<'_>],
    ) -> Result<(), CoreError> {
        let cfg = LaunchConfig::linear(grid, block);
        let params = params(args);
        let health = self.sentinel.health();
        // SAFETY: the caller's contract.
        let out = unsafe { self.cuda.kernels.run(f, &cfg, &params, health)? };
        self.settle(out)
    }

    /// Queues `f` on `stream` as `cfg` says (any grid and block shape,
    /// dynamic shared memory, cooperative) with `args` by value, and
    /// returns at once. Watch the job meanwhile ([`CudaDevComm::watch`])
    /// and, once the kernel has finished (synchronise the stream), turn
    /// its error word into an error ([`CudaDevComm::check`]). The stream
    /// may be gin's, the user's (a cudarc `CudaStream`, or a raw one
    /// through `StreamRef::from_raw`), or one being captured into a CUDA
    /// graph; it must belong to the GPU's primary context (checked).
    ///
    /// # Safety
    /// `f` must take exactly `args`, in order: `Arg::DevComm` a
    /// `gin::DevComm` by value, `Arg::Window` a `gin::Window` by value,
    /// `Arg::U64` and `Arg::Ptr` 8 bytes, `Arg::U32` 4 bytes. What the
    /// kernel reaches through them must be memory it may access as it does
    /// until it has finished: `Arg::Ptr` addresses of live allocations
    /// large enough for what the kernel writes, `Arg::Window` and
    /// `Arg::DevComm` the ABIs of live windows and of this device
    /// communicator (the kernel follows their pointers; the device API
    /// checks offsets against a window's sizes, not that the window
    /// exists). The windows and this device communicator must outlive the
    /// kernel (do not free or destroy them before it has finished), and a
    /// graph captured with the launch must not run after that.
    pub unsafe fn launch_on(
        &self,
        f: &Function,
        cfg: &LaunchConfig,
        stream: StreamRef<'_>,
        args: &[Arg<'_>],
    ) -> Result<(), CoreError> {
        // SAFETY: the caller's contract.
        unsafe { Ok(self.cuda.kernels.launch_on(f, cfg, stream, &params(args))?) }
    }

    /// Starts watching the job while kernels run (see [`Watcher`]): from
    /// now until the watcher is handed to [`CudaDevComm::check`] or
    /// dropped, a peer's death, a failed transport or engine raises the
    /// abort flag, so the kernels' waits give up.
    pub fn watch(&self) -> Result<Watcher, CoreError> {
        let (s, rank) = (&self.sentinel, self.cuda.comm.rank());
        let name = format!("gin-watch-r{rank}-d{}", s.owner());
        let inner = (self.cuda.kernels).watch(name, s.owner(), s.watch_health())?;
        Ok(Watcher { inner })
    }

    /// Once the kernels launched since the last check have finished (their
    /// stream synchronised), reads and clears the error word: a device-side
    /// error becomes [`CoreError::Kernel`] naming this rank, the peer, the
    /// context and the id, with the watcher's cause; a cause without one
    /// [`CoreError::AfterKernel`]. The same errors as
    /// [`CudaDevComm::run`]. Checking while a kernel still runs misses what
    /// it records later. A watcher another device communicator started is
    /// refused (stopped; the word is left for the next check).
    pub fn check(&self, watcher: Option<Watcher>) -> Result<(), CoreError> {
        // Any thread may check: the error word is read in gin's context.
        let owner = self.sentinel.owner();
        let out = self.cuda.kernels.check(watcher.map(|w| w.inner), owner)?;
        self.settle(out)
    }

    /// Turns how the kernels ended into the run's error: a device-side
    /// error, else the watch's cause (else the engine's late one).
    fn settle(&self, out: Outcome) -> Result<(), CoreError> {
        let cuda = self.cuda;
        let cause = out.cause.or_else(|| self.sentinel.late_cause());
        if let Some(d) = errword::decode(out.word) {
            return Err(CoreError::Kernel {
                rank: cuda.comm.rank(),
                what: errword::describe(d.kind),
                ctx: d.ctx,
                peer: d.peer,
                value: d.value,
                cause: cause.unwrap_or_default(),
            });
        }
        if let Some(c) = cause {
            return Err(CoreError::AfterKernel {
                rank: cuda.comm.rank(),
                cause: c,
            });
        }
        Ok(())
    }

    /// Stops the engine after checking that every rank got here, and gives
    /// the ids back (collective).
    pub fn destroy(mut self) -> Result<(), CoreError> {
        if let Some(Served(engine)) = self.sentinel.engine().take() {
            let context = engine.failure();
            engine.stop().map_err(|error| {
                CoreError::CudaRuntime(gin_cuda::CudaError::Worker {
                    context: context.into(),
                    error,
                })
            })?;
        }
        // What the engine sent over TCP has been executed before any rank
        // reuses the slots.
        self.cuda.comm.fabric().fence_all()?;
        self.cuda.comm.bootstrap().barrier()?;
        self.ranges.take();
        Ok(())
    }
}

/// `args` as gin-cuda's kernel parameters (by value).
fn params<'p>(args: &[Arg<'p>]) -> Vec<Param<'p>> {
    args.iter()
        .map(|a| match *a {
            Arg::DevComm(d) => Param::value(d),
            Arg::Window(w) => Param::value(w),
            Arg::U64(v) | Arg::Ptr(v) => Param::U64(v),
            Arg::U32(v) => Param::U32(v),
        })
        .collect()
}

impl Drop for CudaDevComm<'_, '_> {
    fn drop(&mut self) {
        if let Some(Served(engine)) = self.sentinel.engine().take() {
            let _ = engine.stop();
        }
        // Without destroy, a signal may still be in flight to these slots:
        // keep them out of reuse.
        if let Some(r) = &mut self.ranges {
            r.keep_reserved();
        }
    }
}
