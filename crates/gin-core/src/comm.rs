//! The communicator: who is where, how each peer is reached, windows, and
//! device communicators.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gin_bootstrap::Bootstrap;
use gin_bootstrap::liveness::Liveness;
use gin_bootstrap::topology::Topology;
use gin_device::{
    Backend, Counters, CpuStart, DevComm, DevCommParts, Exchange, Health, HostError, Window,
    WindowParts,
};
use gin_net::host_window::{HostWindow, HostWindows};
use gin_net::region::RegionTable;
use gin_net::transport::{Scope, Setup};
use gin_net::{Fabric, NetError, Reach};
use tracing::info;

use crate::config::Settings;
use crate::error::CoreError;
use crate::requirements::{self, overflow};
use crate::space::{Ranges, Spaces};

/// What a device communicator needs; every rank passes the same values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DevCommRequirements {
    /// User signals per context.
    pub signals: u32,
    /// Counters per context.
    pub counters: u32,
    /// Contexts (independent ordering domains); no fixed maximum.
    pub contexts: u32,
    /// Barriers over all ranks.
    pub world_barriers: u32,
    /// Barriers over this rank's rail (same local rank on every host).
    pub rail_barriers: u32,
    /// Descriptors (or WQEs) each (context, peer) queue holds; rounded up to
    /// a power of two. Outside the backend's range
    /// ([`crate::BackendKind::queue_depths`]) creation fails.
    pub queue_depth: u32,
    /// Which peers it connects to.
    pub connection: Connection,
    /// Each context is used by one thread only.
    pub exclusive_contexts: bool,
    /// Signals that order all earlier puts of their context.
    pub strong_signals: bool,
    /// Signals addressed by (window, offset).
    pub va_signals: bool,
}

impl Default for DevCommRequirements {
    fn default() -> Self {
        Self {
            signals: 16,
            counters: 16,
            contexts: 1,
            world_barriers: 1,
            rail_barriers: 0,
            queue_depth: 256,
            connection: Connection::Full,
            exclusive_contexts: false,
            strong_signals: true,
            va_signals: true,
        }
    }
}

/// Which peers a device communicator connects to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Connection {
    /// Every rank.
    Full,
    /// Only the ranks of this rank's rail (and itself).
    Rail,
}

#[derive(Debug)]
struct BootstrapHealth(Arc<Bootstrap>, Liveness);

impl Health for BootstrapHealth {
    fn check(&self) -> Result<(), String> {
        // A departure is named only once no death explains it.
        (self.0)
            .health_settled(gin_device::CAUSE_GRACE)
            .map_err(|e| e.to_string())
    }

    fn check_peer(&self, peer: usize) -> Result<(), String> {
        self.0.peer_health(peer).map_err(|e| e.to_string())
    }

    fn diagnose(&self) -> Option<String> {
        self.1.diagnose()
    }

    fn report_stopped(&self, peer: Option<usize>) {
        self.1.report_stopped(&self.0, peer);
    }
}

/// The bootstrap as the collective exchange a backend's start needs.
struct BootstrapExchange<'a>(&'a Bootstrap);

impl Exchange for BootstrapExchange<'_> {
    fn allgather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, HostError> {
        Ok(self.0.allgather(mine)?)
    }
}

/// The host communicator of one rank.
#[derive(Debug)]
pub struct Comm {
    bootstrap: Arc<Bootstrap>,
    settings: Settings,
    /// Distinguishes this communicator's windows from another's.
    id: u64,
    /// Host index of every rank (ranks with equal indices share a host).
    hosts: Vec<usize>,
    local_rank: usize,
    rail: Vec<usize>,
    fabric: Arc<Fabric>,
    table: Arc<RegionTable>,
    next_window: Mutex<u32>,
    spaces: Spaces,
    signal_window: Window,
    counters: Arc<Counters>,
    /// Host windows' segments, exchange and directory entries.
    windows: HostWindows,
    /// Same-host peers' processes, looked at after a timeout.
    pub(crate) liveness: Liveness,
}

/// How long a departing rank waits for its TCP peers to confirm what it
/// sent: healthy links answer in well under a millisecond.
const DEPARTURE_FENCE: Duration = Duration::from_secs(2);

impl Drop for Comm {
    fn drop(&mut self) {
        // The bootstrap announces this rank's departure when its last
        // handle drops, right after this. Peers treat that as the end of
        // its traffic (see `Bootstrap::health`), so first let every request
        // it sent over TCP reach its target: a peer that hears "rank r
        // exited" has seen everything r completed. Same-host paths wrote
        // into peers' memory already. A broken job has nothing to protect,
        // and a peer that stopped answering must not hold this rank's exit
        // for a whole timeout on top of the one that failed it: the fence
        // gets a short deadline of its own.
        if self.bootstrap.health().is_ok()
            && let Err(e) = self.fabric.fence_all_within(DEPARTURE_FENCE)
        {
            tracing::debug!(rank = self.rank(), %e, "fence at departure failed");
        }
    }
}

impl Comm {
    /// Builds a communicator over an initialised bootstrap (collective),
    /// with settings from the environment.
    pub fn new(bootstrap: Bootstrap) -> Result<Self, CoreError> {
        Self::with_settings(bootstrap, Settings::from_env()?)
    }

    /// Joins the job the launcher describes and builds a communicator.
    pub fn from_env() -> Result<Self, CoreError> {
        Self::new(Bootstrap::from_env()?)
    }

    /// Builds a communicator with explicit settings (collective).
    pub fn with_settings(bootstrap: Bootstrap, settings: Settings) -> Result<Self, CoreError> {
        let b = Arc::new(bootstrap);
        let (rank, n) = (b.rank(), b.nranks());
        // Who shares a host (identical host ids), and each rank's process
        // (named after a timeout when it is found stopped or gone): one
        // exchange.
        let Topology {
            hosts,
            nhosts,
            local_rank,
            rail,
            liveness,
        } = b.topology(&settings.host_id)?;
        let table = Arc::new(RegionTable::default());
        let fabric = Arc::new(start_fabric(&b, &table, &hosts, &settings)?);
        // A job-unique tag for shared-memory names.
        let token = b.job_token("gin-core shm names");
        let windows = HostWindows::new(fabric.clone(), hosts.clone(), &token);
        let comm_id = u64::from_le_bytes(token[8..16].try_into().expect("8 bytes"));
        info!(
            rank,
            nranks = n,
            hosts = nhosts,
            local_rank,
            paths = ?fabric.path_names(),
            "communicator ready"
        );
        let mut comm = Self {
            bootstrap: b,
            id: comm_id,
            hosts,
            local_rank,
            rail,
            fabric,
            table,
            next_window: Mutex::new(0),
            spaces: Spaces::new(settings.signal_slots, settings.counter_slots),
            counters: Arc::new(Counters::new(settings.counter_slots as usize)),
            signal_window: Window::empty(),
            windows,
            liveness,
            settings,
        };
        comm.signal_window = comm.alloc_window(comm.settings.signal_slots * 8)?;
        Ok(comm)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.bootstrap.rank()
    }

    /// Ranks in the communicator.
    pub fn nranks(&self) -> usize {
        self.bootstrap.nranks()
    }

    /// The bootstrap, for host-side exchanges.
    pub fn bootstrap(&self) -> &Bootstrap {
        &self.bootstrap
    }

    /// The bootstrap, shared (a CUDA watcher thread checks its health).
    pub(crate) fn bootstrap_arc(&self) -> &Arc<Bootstrap> {
        &self.bootstrap
    }

    /// This rank's index among the ranks of its host.
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// Number of distinct hosts.
    pub fn nhosts(&self) -> usize {
        self.hosts.iter().max().map_or(0, |m| m + 1)
    }

    /// The ranks of this rank's rail.
    pub fn rail(&self) -> &[usize] {
        &self.rail
    }

    /// How each peer is reached (`local`, `shm`, `tcp`).
    pub fn path_names(&self) -> Vec<&'static str> {
        self.fabric.path_names()
    }

    /// The settings in force.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// Whether the fabric reaches `peer` over a keyed transport (tcp): no
    /// mapping, requests name region keys. CUDA ranks stage GPU memory for
    /// such peers through pinned host memory.
    pub(crate) fn reaches_keyed(&self, peer: usize) -> bool {
        self.fabric.reach(peer) == Some(gin_net::Reach::Keyed)
    }

    /// The regions this rank serves to TCP peers.
    pub(crate) fn region_table(&self) -> &Arc<RegionTable> {
        &self.table
    }

    /// The fabric (its TCP links' health and fences).
    pub(crate) fn fabric(&self) -> &Arc<Fabric> {
        &self.fabric
    }

    /// Allocates a window collectively: `bytes` of memory on this rank
    /// (ranks may ask for different sizes), shared with same-host peers so
    /// they can map it, served to remote ones over TCP.
    pub fn alloc_window(&self, bytes: u64) -> Result<Window, CoreError> {
        let id = self.take_window_id();
        let gather = |m: &[u8]| self.bootstrap.allgather(m).map_err(CoreError::from);
        let barrier = || self.bootstrap.barrier().map_err(CoreError::from);
        let w = self.windows.alloc(id, bytes, gather, barrier)?;
        Ok(self.make_window(w))
    }

    /// Registers user memory as a window (collective). Only peers reached
    /// over TCP (or this rank itself) can access it: same-host peers on the
    /// shm path cannot map private memory, so this fails when there are any.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `bytes` bytes, 8-byte
    /// aligned, and outlive the window; remote peers write it concurrently.
    pub unsafe fn register_window(&self, ptr: *mut u8, bytes: u64) -> Result<Window, CoreError> {
        let shm = self.windows.mapped_peers();
        // Every rank must agree, or some would wait in the collective forever.
        if let Some(r) = self.bootstrap.first_refusal(shm.is_empty())? {
            return Err(CoreError::Unavailable {
                what: "register_window of user memory".into(),
                why: format!(
                    "rank {r} reaches same-host peers over shared memory, which cannot map private memory"
                ),
                available: "alloc_window, or GIN_TRANSPORT=tcp".into(),
            });
        }
        if !(ptr as usize).is_multiple_of(8) {
            return Err(CoreError::Misaligned {
                rank: self.rank(),
                what: "window memory",
                addr: ptr as usize,
                align: 8,
            });
        }
        let id = self.take_window_id();
        let gather = |m: &[u8]| self.bootstrap.allgather(m).map_err(CoreError::from);
        let barrier = || self.bootstrap.barrier().map_err(CoreError::from);
        // SAFETY: forwarded from the caller's promise.
        let w = unsafe { self.windows.register(id, ptr, bytes, gather, barrier)? };
        Ok(self.make_window(w))
    }

    pub(crate) fn take_window_id(&self) -> u32 {
        let mut n = self
            .next_window
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let id = *n;
        *n += 1;
        id
    }

    /// What the device API sees of a host window: its parts, with the
    /// communicator's id, kept alive by the window.
    fn make_window(&self, w: HostWindow) -> Window {
        let id = w.id();
        let (p, keeper) = w.into_parts();
        // SAFETY: gin-net listed these parts: `local_base` is this rank's
        // part (sizes[rank] bytes), each non-null peer base a mapping of
        // that peer's part, each non-null state a segment's revocation word,
        // all kept alive by `keeper`.
        unsafe {
            Window::from_parts(
                WindowParts {
                    id,
                    rank: self.rank(),
                    comm_id: self.id,
                    local_base: p.local_base as *mut u8,
                    sizes: p.sizes,
                    peer_bases: p.peer_bases.iter().map(|&b| b as *mut u8).collect(),
                    keys: p.keys,
                    addrs: p.addrs,
                    states: p.states.iter().map(|&s| s as *const AtomicU64).collect(),
                },
                keeper,
            )
        }
    }

    /// Deregisters a window (collective): after every rank arrives, the
    /// window refuses new operations here and its memory is no longer served
    /// to peers. Flush contexts that used it first. Deregistering a window
    /// twice is an error ([`CoreError::Deregistered`]), not a no-op: it is a
    /// collective call, and a second one usually means two owners.
    pub fn deregister_window(&self, w: &Window) -> Result<(), CoreError> {
        if w.comm_id() != self.id {
            return Err(CoreError::ForeignWindow {
                rank: self.rank(),
                window: w.id(),
            });
        }
        // Every rank sees its own handle's state, and every rank deregisters
        // the same windows in the same order, so all refuse alike before the
        // collective part.
        if !w.is_valid() {
            return Err(CoreError::Deregistered {
                rank: self.rank(),
                window: w.id(),
            });
        }
        // Over TCP a flushed put may still sit in a socket: wait until every
        // request this rank sent was executed, then for every rank to get
        // there, before the memory stops being served.
        self.fabric.fence_all()?;
        self.bootstrap.barrier()?;
        w.mark_deregistered();
        self.windows
            .withdraw(w.id(), w.key_of(self.rank()), w.as_ptr() as usize);
        Ok(())
    }

    /// Creates a device communicator (collective; same requirements on every rank).
    pub fn dev_comm(&self, req: &DevCommRequirements) -> Result<DevCommHandle<'_>, CoreError> {
        let rank = self.rank();
        let n = self.nranks();
        let zero = |r: &Ranges<'_>| {
            // Fresh slots start at zero, on every rank, before anyone signals.
            for i in r.signals.0..r.signals.0 + r.signals.1 {
                if let Ok(slot) = self.signal_window.slot(i * 8) {
                    slot.store(0, Ordering::Release);
                }
            }
            for i in r.counters.0..r.counters.0 + r.counters.1 {
                if let Some(c) = self.counters.slot(i) {
                    c.store(0, Ordering::Release);
                }
            }
            Ok(())
        };
        let per_ctx = || {
            let (s, w, r) = (req.signals, req.world_barriers, req.rail_barriers);
            gin_device::signal_slots_per_context(s, w, r, n).ok_or_else(|| overflow(rank))
        };
        // Freed on every error exit below; kept by the handle on success.
        let (_, ranges) =
            requirements::reserve(&self.bootstrap, &self.spaces, req, &[], per_ctx, zero)?;
        let (signal_base, counter_base) = (ranges.signals.0, ranges.counters.0);
        let selected = self.settings.backend.selection();
        let log2 = self.settings.backend.queue_log2(req.queue_depth)?;
        self.settings.check_usable(&selected)?;
        let backend = selected.queues.start_cpu(&CpuStart {
            rank,
            nranks: n,
            fabric: &self.fabric,
            counters: &self.counters,
            nctx: req.contexts,
            queue_log2: log2,
            exclusive_contexts: req.exclusive_contexts,
            // `auto` lets a CPU rank send to tcp peers itself when nothing
            // is queued; otherwise every operation stays on the backend's
            // thread.
            inline: selected.load_store,
            batch: self.settings.gdaki_batch,
            timeout: self.settings.timeout,
            spin: self.settings.proxy_spin,
            exchange: &BootstrapExchange(&self.bootstrap),
        })?;
        let direct = selected.load_store;
        let connected: Vec<bool> = (0..n)
            .map(|p| req.connection == Connection::Full || p == rank || self.rail.contains(&p))
            .collect();
        let dc = DevComm::new(DevCommParts {
            rank,
            nranks: n,
            comm_id: self.id,
            nctx: req.contexts,
            nsignals: req.signals,
            ncounters: req.counters,
            world_barriers: req.world_barriers,
            rail_barriers: req.rail_barriers,
            signal_window: self.signal_window.clone(),
            signal_base,
            signal_slots: ranges.signals.1,
            counters: self.counters.clone(),
            counter_base,
            lsa: (0..n)
                .map(|p| direct && self.fabric.reach(p) == Some(Reach::Mapped))
                .collect(),
            connected,
            rail: self.rail.clone(),
            strong_signals: req.strong_signals,
            va_signals: req.va_signals,
            exclusive_contexts: req.exclusive_contexts,
            backend: backend.clone(),
            health: Arc::new(BootstrapHealth(
                self.bootstrap.clone(),
                self.liveness.clone(),
            )),
            timeout: self.settings.timeout,
        });
        let dc = dc?;
        // Nobody signals into slots another rank has not zeroed yet.
        self.bootstrap.barrier()?;
        Ok(DevCommHandle {
            comm: self,
            dc: Some(dc),
            _backend: backend,
            ranges,
            destroyed: false,
        })
    }

    /// The timeout of waits.
    pub fn timeout(&self) -> Duration {
        self.settings.timeout
    }
}

/// Chooses every peer's transport (`GIN_TRANSPORT` and the host ids),
/// starts them (collective) and assembles the fabric.
fn start_fabric(
    b: &Arc<Bootstrap>,
    table: &Arc<RegionTable>,
    hosts: &[usize],
    settings: &Settings,
) -> Result<Fabric, CoreError> {
    let wanted = settings.transport.name();
    let setup = Setup {
        bootstrap: b,
        table: table.clone(),
        timeout: settings.timeout,
    };
    let fabric = Fabric::start(&setup, hosts, wanted).map_err(|e| match e {
        NetError::HostOnly { transport, others } => CoreError::Unavailable {
            what: format!("GIN_TRANSPORT={transport}"),
            why: format!("ranks {others:?} are on other hosts; {transport} reaches only this host"),
            available: std::iter::once("auto")
                .chain(
                    gin_net::transport::REGISTRY
                        .iter()
                        .filter(|r| r.scope == Scope::Any)
                        .map(|r| r.name),
                )
                .collect::<Vec<_>>()
                .join(", "),
        },
        e => e.into(),
    })?;
    // A send blocked on a peer that stopped draining also ends when the job
    // hears of a death.
    fabric.watch_job(b);
    Ok(fabric)
}

/// A device communicator and what it holds; dereferences to [`DevComm`].
/// Destroy it collectively with [`DevCommHandle::destroy`] to get its ids
/// back. One dropped without `destroy` keeps its ids out of reuse: a signal
/// still in flight to it could otherwise land in a newer communicator.
#[derive(Debug)]
pub struct DevCommHandle<'c> {
    comm: &'c Comm,
    dc: Option<DevComm>,
    _backend: Arc<dyn Backend>,
    ranges: Ranges<'c>,
    destroyed: bool,
}

impl std::ops::Deref for DevCommHandle<'_> {
    type Target = DevComm;
    fn deref(&self) -> &DevComm {
        self.dc.as_ref().expect("present until drop")
    }
}

impl DevCommHandle<'_> {
    /// Flushes every context, waits until every request this rank sent has
    /// been executed and for every rank to get there, then frees the ids.
    pub fn destroy(mut self) -> Result<(), CoreError> {
        for c in 0..self.nctx() {
            self.ctx(c)?.flush()?;
        }
        self.comm.fabric.fence_all()?;
        self.comm.bootstrap.barrier()?;
        self.destroyed = true;
        Ok(())
    }
}

impl Drop for DevCommHandle<'_> {
    fn drop(&mut self) {
        self.dc.take();
        if !self.destroyed {
            self.ranges.keep_reserved();
            tracing::debug!(
                rank = self.comm.rank(),
                "device communicator dropped without destroy(): its signal and counter ids stay reserved"
            );
        }
    }
}
