//! CUDA ranks: windows in GPU memory, device communicators whose
//! [`DevCommAbi`] kernels receive, the CUDA proxy, and run-time compilation.
//!
//! # Design
//!
//! - **Nothing CUDA is needed to build.** The driver and NVRTC are loaded at
//!   run time through cudarc; [`available`] says why CUDA cannot be used
//!   instead of panicking.
//! - **Windows** ([`CudaComm::alloc_window`]) are `cuMemAlloc` memory; same-host
//!   peers open each other's parts through CUDA IPC, so a kernel reaches a
//!   peer's part by load/store over NVLink (or PCIe), and the proxy's copy
//!   engine reaches it with `cuMemcpyAsync`.
//! - **Signals** are `nranks` sub-slots each (`DEVCOMM_FLAG_SENDER_SLOTS`) in
//!   a GPU signal window, summed: the proxy, the only writer of its rank's
//!   sub-slot at the peers it serves, stores running totals with
//!   `cuStreamWriteValue64` in the stream after the data; a GPU reaching the
//!   peer by load/store adds to the peer's own sub-slot with a system-scope
//!   atomic, so where every peer is (`DEVCOMM_FLAG_LSA_ONLY`) a wait reads one
//!   word. Counters have two sub-slots: the proxy's running total and the
//!   GPU's atomic adds.
//! - **Proxy rings** live in mapped pinned host memory (not write-combined:
//!   the proxy thread polls them); producer and completion indices live in
//!   device memory, so a kernel never needs an atomic across PCIe.
//! - **Errors**: kernels record the first error in an error word; the host
//!   reads it after the kernel and names rank, peer, context and id. While a
//!   kernel runs, [`CudaDevComm::run`] watches the job's health and the
//!   proxy, and raises the abort flag so device waits give up.
//!
//! - **GDAKI** (`GIN_BACKEND=gdaki`): kernels build mlx5 WQEs into send
//!   queues in mapped pinned host memory, mark them ready in order and write
//!   the doorbell record and doorbell; the soft NIC ([`nic`]) executes them
//!   with the copy engine and stores each batch's CQE into a collapsed CQ in
//!   device memory, which flush and credit poll. Window parts carry NIC keys
//!   ([`window_key`]); addresses are each rank's own device addresses.
//!
//! - **TCP staging** ([`staging`]): a peer the fabric reaches over TCP
//!   (another host, or `GIN_TRANSPORT=tcp`) has no IPC mapping. Window parts
//!   are served to it from the region table through the copy engine, and
//!   the proxy (or soft NIC) stages what it sends and fetches through pinned
//!   host memory. `auto` reaches such peers through the proxy.

mod batch;
#[doc(hidden)]
pub use batch::bench_pass;
mod driver;
mod nic;
pub mod nvrtc;
mod proxy;
mod staging;
mod worker;

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use gin_device::abi::{
    BACKEND_GDAKI, BACKEND_NONE, BACKEND_PROXY, DEVCOMM_FLAG_CTA_CTX, DEVCOMM_FLAG_EXCLUSIVE_CTX,
    DEVCOMM_FLAG_LSA_ONLY, DEVCOMM_FLAG_SENDER_SLOTS, DEVCOMM_FLAG_STRONG_SIGNALS, DevCommAbi,
    GdakiQpAbi, GdakiSqAbi, ProxyRingAbi, WindowAbi, errword,
};

pub use driver::{DevMem, Device, Function, HostMem, Module, Stream, available};

use gin_net::region::RegionTable;

use crate::comm::Comm;
use crate::config::BackendKind;
use crate::error::CoreError;
use crate::requirements;
use crate::space::IdSpace;
use crate::{Connection, DevCommRequirements};

/// How a context is shared by the threads of a kernel (what ring
/// reservations must be atomic against).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CtxSharing {
    /// Any thread of the grid (device-scope atomics).
    #[default]
    Gpu,
    /// The threads of one block (block-scope atomics).
    Cta,
    /// One thread (no atomics).
    Thread,
}

/// What a window's memory is, for the proxy.
#[derive(Debug, Clone)]
pub(crate) struct WinInfo {
    pub local: u64,
    pub local_size: u64,
    pub sizes: Vec<u64>,
    /// Each peer's part mapped here (0: not mapped).
    pub peers: Vec<u64>,
    /// Each rank's own device address of its part (what WQEs name).
    pub addrs: Vec<u64>,
    /// Each rank's region key for its part, where TCP peers may reach it
    /// (0: not served).
    pub keys: Vec<u32>,
}

/// How a device communicator reaches a peer (`DevComm::lsa`, the header's
/// `REACH_*`).
const REACH_QUEUE: u8 = 0;
const REACH_LSA: u8 = 1;
const REACH_NONE: u8 = 2;

/// First NIC key of GPU windows.
const WINDOW_KEY_BASE: u32 = 0x1000;
/// Local NIC keys of the counter array and the atomic result sink, above
/// every window key.
pub(crate) const COUNTER_KEY: u32 = 0xfeed_0000;
pub(crate) const SINK_KEY: u32 = 0xfeed_0001;

/// The NIC key of rank `p`'s part of window `id` in a job of `n` ranks:
/// `0x1000 + id * n + p`, so the soft NIC decodes a key without a table.
/// `None` once window ids run into the local keys.
pub fn window_key(id: u32, p: usize, n: usize) -> Option<u32> {
    let k = u64::from(id) * n as u64 + p as u64 + u64::from(WINDOW_KEY_BASE);
    u32::try_from(k).ok().filter(|&k| k < COUNTER_KEY)
}

/// The window id and rank a key names (the inverse of [`window_key`]).
pub fn window_of_key(key: u32, n: usize) -> Option<(u32, usize)> {
    let k = key.checked_sub(WINDOW_KEY_BASE)?;
    if key >= COUNTER_KEY || n == 0 {
        return None;
    }
    Some((k / n as u32, (k % n as u32) as usize))
}

type WinTable = Arc<RwLock<HashMap<u32, Arc<WinInfo>>>>;

/// A window in GPU memory. Dropping it frees its memory and removes it from
/// this rank's window table, so the proxy and the soft NIC refuse requests
/// naming it; [`CudaComm::free_window`] does so on every rank at once.
#[derive(Debug)]
pub struct GpuWindow {
    abi: WindowAbi,
    bases: Vec<u64>,
    table: WinTable,
    /// Where this part is served to TCP peers: the region table and key.
    served: Option<(Arc<RegionTable>, u32)>,
    local: DevMem,
    _arrays: DevMem,
    _peers: Vec<driver::IpcMem>,
    /// Last: the context must outlive the memory above.
    _dev: Arc<Device>,
}

impl GpuWindow {
    /// What a kernel receives (pass by value).
    pub fn abi(&self) -> &WindowAbi {
        &self.abi
    }

    pub fn id(&self) -> u32 {
        self.abi.id
    }

    /// This rank's part, in device memory.
    pub fn local(&self) -> &DevMem {
        &self.local
    }

    /// Rank `p`'s part as mapped here (device address), if it exists.
    pub fn peer_base(&self, p: usize) -> Option<u64> {
        self.bases.get(p).copied()
    }
}

impl Drop for GpuWindow {
    fn drop(&mut self) {
        // Before the memory goes: a request naming the window from now on is
        // refused ("unknown window"), not executed on freed memory.
        self.table
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&self.abi.id);
        // And TCP peers' requests are refused ("unknown memory key"); the
        // removal waits for a request being served.
        if let Some((t, key)) = &self.served {
            t.remove_region(*key, self.local.ptr as usize);
        }
    }
}

/// A window part registered for TCP peers while its window is being made:
/// removed from the region table again if making it fails.
struct Served(Option<(Arc<RegionTable>, u32)>, u64);

impl Served {
    /// The window was made: it removes the region when dropped.
    fn keep(mut self) -> (Arc<RegionTable>, u32) {
        self.0.take().expect("taken once")
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if let Some((t, key)) = self.0.take() {
            t.remove_region(key, self.1 as usize);
        }
    }
}

#[derive(Debug)]
struct Spaces {
    signals: IdSpace,
    counters: IdSpace,
}

/// The CUDA side of a communicator: this rank's GPU, its windows, and the
/// memory every device communicator shares (signals, counters, abort flag,
/// error word). All ranks of the communicator must call its collectives.
#[derive(Debug)]
pub struct CudaComm<'c> {
    comm: &'c Comm,
    windows: WinTable,
    signal_window: GpuWindow,
    counters: DevMem,
    /// The abort flag, in device memory: kernels poll it, and a kernel that
    /// reads host memory, even one thread per block once every 100 us,
    /// starves the copies the CUDA proxy queues (measured with
    /// `xtask/gpu/probe/ce_probe.cu`). The host raises it with a stream
    /// write on `abort_stream`.
    abort: DevMem,
    abort_stream: Stream,
    error: DevMem,
    spaces: Mutex<Spaces>,
    stream: Stream,
    /// Serves window parts to TCP peers (`None`: no peer is reached over TCP).
    server: Option<Arc<staging::Server>>,
    /// Last: the context must outlive every allocation above.
    dev: Arc<Device>,
}

impl Comm {
    /// Opens this rank's GPU (`GIN_CUDA_DEVICE`, else local rank modulo the
    /// GPUs of the host) and sets up CUDA ranks (collective).
    pub fn cuda(&self) -> Result<CudaComm<'_>, CoreError> {
        CudaComm::new(self)
    }
}

impl<'c> CudaComm<'c> {
    fn new(comm: &'c Comm) -> Result<Self, CoreError> {
        // Every rank must learn whether every other has CUDA, or some would
        // wait in the collectives below forever.
        let local = available().and_then(|n| {
            let ordinal = match std::env::var("GIN_CUDA_DEVICE") {
                Ok(v) => v.trim().parse::<usize>().map_err(|_| {
                    CoreError::Invalid(format!("GIN_CUDA_DEVICE={v:?} is not a GPU index"))
                })?,
                Err(_) => comm.local_rank() % n,
            };
            Device::open(ordinal)
        });
        let ok = comm
            .bootstrap()
            .allgather(&[u8::from(local.is_ok())])?
            .iter()
            .position(|v| v.first() != Some(&1));
        let dev = match (local, ok) {
            (Err(e), _) => return Err(e),
            (Ok(_), Some(r)) => {
                return Err(CoreError::Unavailable {
                    what: "CUDA ranks".into(),
                    why: format!("rank {r} could not open a GPU"),
                    available: "CPU ranks".into(),
                });
            }
            (Ok(d), None) => Arc::new(d),
        };
        let n = comm.nranks() as u64;
        let s = comm.settings();
        let windows: WinTable = Arc::default();
        let server = if (0..comm.nranks()).any(|p| comm.tcp_link(p).is_some()) {
            Some(Arc::new(staging::Server::new(dev.clone())?))
        } else {
            None
        };
        let signal_window = Self::make_window(
            comm,
            &dev,
            &windows,
            server.as_ref(),
            s.signal_slots * n * 8,
        )?;
        let me = Self {
            comm,
            windows,
            signal_window,
            counters: DevMem::new(s.counter_slots as usize * 16)?,
            abort: DevMem::new(64)?,
            abort_stream: Stream::new()?,
            error: DevMem::new(8)?,
            spaces: Mutex::new(Spaces {
                signals: IdSpace::new(s.signal_slots),
                counters: IdSpace::new(s.counter_slots),
            }),
            stream: Stream::new()?,
            server,
            dev,
        };
        tracing::info!(
            rank = comm.rank(),
            gpu = me.dev.ordinal,
            name = %me.dev.name,
            cc = ?me.dev.cc,
            "CUDA rank ready"
        );
        Ok(me)
    }

    /// This rank's GPU.
    pub fn device(&self) -> &Device {
        &self.dev
    }

    pub fn comm(&self) -> &Comm {
        self.comm
    }

    /// Whether `peer` is reached over TCP (staged through host memory)
    /// rather than through CUDA IPC.
    pub fn reaches_over_tcp(&self, peer: usize) -> bool {
        self.comm.tcp_link(peer).is_some()
    }

    /// Allocates a window of `bytes` of GPU memory on this rank (collective;
    /// sizes may differ per rank); same-host peers map it through CUDA IPC.
    pub fn alloc_window(&self, bytes: u64) -> Result<GpuWindow, CoreError> {
        Self::make_window(
            self.comm,
            &self.dev,
            &self.windows,
            self.server.as_ref(),
            bytes,
        )
    }

    /// Frees a window on every rank (collective): once every rank has
    /// arrived (flush the contexts that used it first), each removes it from
    /// its window table, so its proxy and soft NIC refuse requests naming
    /// it, then unmaps its peers' parts and frees its own.
    pub fn free_window(&self, w: GpuWindow) -> Result<(), CoreError> {
        let id = w.id();
        let ours = Arc::ptr_eq(&w.table, &self.windows) && id != self.signal_window.id();
        if !ours {
            return Err(CoreError::Invalid(format!(
                "window {id} is not a window of this CUDA communicator"
            )));
        }
        // Every request this rank sent over TCP has been executed before
        // anyone frees.
        self.comm.fabric().fence_all()?;
        self.comm.bootstrap().barrier()?;
        self.dev.make_current()?;
        drop(w);
        Ok(())
    }

    fn make_window(
        comm: &Comm,
        dev: &Arc<Device>,
        table: &WinTable,
        server: Option<&Arc<staging::Server>>,
        bytes: u64,
    ) -> Result<GpuWindow, CoreError> {
        dev.make_current()?;
        let id = comm.take_window_id();
        let (rank, n) = (comm.rank(), comm.nranks());
        let local = DevMem::new(bytes as usize)?;
        let handle = local.ipc_handle()?;
        // Served to TCP peers from the region table (removed again by the
        // window's drop, or by `Served`'s on an error path below).
        let served = match server {
            Some(sv) => {
                let t = comm.region_table().clone();
                let key = t.insert_backed(
                    local.ptr,
                    bytes,
                    Arc::new(staging::GpuRegion {
                        ptr: local.ptr,
                        server: sv.clone(),
                    }),
                )?;
                Some(Served(Some((t, key)), local.ptr))
            }
            None => None,
        };
        let my_key = served
            .as_ref()
            .and_then(|s| s.0.as_ref())
            .map_or(0, |s| s.1);
        let mut mine = Vec::with_capacity(84);
        mine.extend_from_slice(&bytes.to_le_bytes());
        mine.extend_from_slice(&local.ptr.to_le_bytes());
        mine.extend_from_slice(&handle);
        mine.extend_from_slice(&my_key.to_le_bytes());
        let all = comm.bootstrap().allgather(&mine)?;
        let mut sizes = Vec::with_capacity(n);
        let mut addrs = Vec::with_capacity(n);
        let mut bases = Vec::with_capacity(n);
        let mut tcp_keys = Vec::with_capacity(n);
        let mut opened = Vec::new();
        for (p, rec) in all.iter().enumerate() {
            if rec.len() != 84 {
                return Err(CoreError::Invalid(format!(
                    "rank {p} sent a malformed GPU window {id} record ({} bytes)",
                    rec.len()
                )));
            }
            let size = u64::from_le_bytes(rec[..8].try_into().expect("8 bytes"));
            let addr = u64::from_le_bytes(rec[8..16].try_into().expect("8 bytes"));
            let key = u32::from_le_bytes(rec[80..84].try_into().expect("4 bytes"));
            sizes.push(size);
            addrs.push(addr);
            tcp_keys.push(key);
            if p == rank {
                bases.push(local.ptr);
            } else if comm.tcp_link(p).is_some() {
                // Reached over TCP: no mapping; requests name `key`.
                if key == 0 {
                    return Err(CoreError::Invalid(format!(
                        "rank {p} does not serve GPU window {id} over TCP, but rank {rank} \
                         reaches it over TCP (GIN_TRANSPORT or host ids differ between ranks?)"
                    )));
                }
                bases.push(0);
            } else {
                let h: [u8; 64] = rec[16..80].try_into().expect("64 bytes");
                let m = driver::IpcMem::open(&h).map_err(|e| {
                    CoreError::Invalid(format!(
                        "rank {rank} cannot map GPU window {id} of rank {p} through CUDA IPC: {e}"
                    ))
                })?;
                bases.push(m.ptr);
                opened.push(m);
            }
        }
        let keys = (0..n)
            .map(|p| window_key(id, p, n))
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| {
                CoreError::Invalid(format!(
                    "window id {id} of {n} ranks has no NIC key left (ids below {} only)",
                    (COUNTER_KEY - WINDOW_KEY_BASE) as usize / n.max(1)
                ))
            })?;
        // sizes u64[n], peer bases u64[n], addresses u64[n], keys u32[n]:
        // every array aligned for its loads.
        let arrays = DevMem::new(n * 28)?;
        arrays.write(0, &sizes)?;
        arrays.write(n * 8, &bases)?;
        arrays.write(n * 16, &addrs)?;
        arrays.write(n * 24, &keys)?;
        let abi = WindowAbi {
            id,
            flags: 0,
            local_base: local.ptr,
            local_size: bytes,
            sizes: arrays.ptr,
            peer_bases: arrays.ptr + n as u64 * 8,
            keys: arrays.ptr + n as u64 * 24,
            addrs: arrays.ptr + n as u64 * 16,
        };
        table
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(
                id,
                Arc::new(WinInfo {
                    local: local.ptr,
                    local_size: bytes,
                    sizes,
                    peers: bases.clone(),
                    addrs,
                    keys: tcp_keys,
                }),
            );
        comm.bootstrap().barrier()?;
        Ok(GpuWindow {
            abi,
            bases,
            table: table.clone(),
            served: served.map(Served::keep),
            local,
            _arrays: arrays,
            _peers: opened,
            _dev: dev.clone(),
        })
    }

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
        // Every rank must agree on which peers are reached by load/store,
        // since signals land in different sub-slots for them: the backend
        // travels along with the requirements.
        requirements::agree(
            comm.bootstrap(),
            req,
            &[(
                "GIN_BACKEND (load/store to peers or not)",
                u64::from(kind == BackendKind::Auto),
            )],
        )?;
        requirements::check_bounds(rank, n, req)?;
        let rail_only = req.connection == Connection::Rail;
        if rail_only && req.world_barriers != 0 {
            return Err(CoreError::Invalid(format!(
                "{} world barriers asked for with a rail connection, which reaches only the \
                 rail's ranks; use rail barriers or a full connection",
                req.world_barriers
            )));
        }
        if kind == BackendKind::Gdaki {
            comm.settings().check_nic()?;
        }
        let sig_per_ctx = req
            .signals
            .checked_add(req.world_barriers)
            .and_then(|v| v.checked_add(req.rail_barriers))
            .ok_or_else(|| CoreError::Invalid("signal and barrier counts overflow".into()))?;
        let nsig = u64::from(sig_per_ctx) * u64::from(req.contexts);
        let ncnt = u64::from(req.counters) * u64::from(req.contexts);
        let (sb, cb) = {
            let mut s = self
                .spaces
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let sb = s.signals.alloc(nsig, "signal")?;
            match s.counters.alloc(ncnt, "counter") {
                Ok(cb) => (sb, cb),
                Err(e) => {
                    let _ = s.signals.free(sb, nsig);
                    return Err(e.into());
                }
            }
        };
        let ranges = Ranges {
            cuda: self,
            signals: (sb, nsig),
            counters: (cb, ncnt),
        };
        let nn = n as u64;
        self.signal_window
            .local
            .zero((sb * nn * 8) as usize, (nsig * nn * 8) as usize)?;
        self.counters
            .zero((cb * 16) as usize, (ncnt * 16) as usize)?;
        // How each peer is reached (the header's REACH_*): not at all for
        // ranks off the rail with a rail connection (as on CPU ranks);
        // load/store for this rank, and with `auto` every peer mapped here
        // (not those over TCP); queues for the others.
        let tcp: Vec<bool> = (0..n).map(|p| comm.tcp_link(p).is_some()).collect();
        let rail: Vec<u32> = comm.rail().iter().map(|&r| r as u32).collect();
        let lsa: Vec<u8> = (0..n)
            .map(|p| {
                if p != rank && rail_only && !rail.contains(&(p as u32)) {
                    REACH_NONE
                } else if p == rank || (kind == BackendKind::Auto && !tcp[p]) {
                    REACH_LSA
                } else {
                    REACH_QUEUE
                }
            })
            .collect();
        // A wait reads one word only where every rank reaches every rank by
        // load/store (DEVCOMM_FLAG_LSA_ONLY). Unconnected ranks never signal
        // here.
        let all_lsa = u8::from(lsa.iter().all(|&l| l != REACH_QUEUE));
        let rec = [&sb.to_le_bytes()[..], &cb.to_le_bytes(), &[all_lsa]].concat();
        let all = comm.bootstrap().allgather_equal(&rec)?;
        if all.chunks(rec.len()).any(|c| c[..16] != rec[..16]) {
            return Err(CoreError::Invalid(
                "ranks disagree on signal/counter placement: CUDA device communicators were \
                 created in different orders or with different requirements"
                    .into(),
            ));
        }
        let lsa_only = all.chunks(rec.len()).all(|c| c[16] == 1);
        let log2 = kind.queue_log2(req.queue_depth)?;
        // Rings for the peers the proxy serves, context-major.
        let mut rings_abi = vec![ProxyRingAbi::default(); req.contexts as usize * n];
        let mut host_rings = Vec::new();
        let indices = DevMem::new(req.contexts as usize * n * 16)?;
        for c in 0..req.contexts as usize {
            for p in (0..n).filter(|&p| lsa[p] == REACH_QUEUE && kind != BackendKind::Gdaki) {
                let i = c * n + p;
                let slots = HostMem::new(64 << log2)?;
                rings_abi[i] = ProxyRingAbi {
                    slots: slots.dev,
                    head: indices.ptr + i as u64 * 16,
                    done: indices.ptr + i as u64 * 16 + 8,
                    log2,
                    reserved: 0,
                };
                host_rings.push(proxy::RingSpec {
                    ctx: c as u32,
                    peer: p,
                    slots,
                    log2,
                    done: indices.ptr + i as u64 * 16 + 8,
                });
            }
        }
        let any_proxy = !host_rings.is_empty();
        let rings = DevMem::new(rings_abi.len() * std::mem::size_of::<ProxyRingAbi>())?;
        rings.write(0, &rings_abi)?;
        let gdaki = if kind == BackendKind::Gdaki && lsa.contains(&REACH_QUEUE) {
            Some(self.gdaki_queues(req.contexts as usize, &lsa, log2)?)
        } else {
            None
        };
        // The reach table, then the rail team at the next multiple of 4.
        let team_at = n.next_multiple_of(4);
        let team: Vec<u32> = [req.rail_barriers, rail.len() as u32]
            .into_iter()
            .chain(rail.iter().copied())
            .collect();
        let lsa_mem = DevMem::new(team_at + team.len() * 4)?;
        lsa_mem.write(0, &lsa)?;
        lsa_mem.write(team_at, &team)?;
        let sig_peers = DevMem::new(n * 8)?;
        let sig_info = self.signal_info();
        sig_peers.write(0, &sig_info.peers)?;
        let mut flags = DEVCOMM_FLAG_SENDER_SLOTS | DEVCOMM_FLAG_STRONG_SIGNALS;
        if lsa_only {
            flags |= DEVCOMM_FLAG_LSA_ONLY;
        }
        flags |= match sharing {
            CtxSharing::Gpu => 0,
            CtxSharing::Cta => DEVCOMM_FLAG_CTA_CTX,
            CtxSharing::Thread => DEVCOMM_FLAG_EXCLUSIVE_CTX,
        };
        let timeout = comm.settings().timeout;
        // A staging buffer for the proxy or the NIC, where some peer is over TCP.
        let new_stage = || -> Result<Option<staging::Stage>, CoreError> {
            tcp.contains(&true).then(staging::Stage::new).transpose()
        };
        let abi = DevCommAbi {
            rank: rank as u32,
            nranks: n as u32,
            nctx: req.contexts,
            nsignals: req.signals,
            ncounters: req.counters,
            flags,
            signal_base: sb,
            signals: self.signal_window.local.ptr,
            counter_base: cb,
            counters: self.counters.ptr,
            abort_flag: self.abort.ptr,
            error_word: self.error.ptr,
            timeout_ticks: u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX),
            rings: gdaki.as_ref().map_or(rings.ptr, |g| g.table.ptr),
            backend_kind: if any_proxy {
                BACKEND_PROXY
            } else if gdaki.is_some() {
                BACKEND_GDAKI
            } else {
                BACKEND_NONE
            },
            sig_per_ctx,
            lsa: lsa_mem.ptr,
            signal_peers: sig_peers.ptr,
            world_barriers: req.world_barriers,
            signal_window: self.signal_window.id(),
        };
        let proxy = if any_proxy {
            Some(proxy::CudaProxy::start(proxy::ProxySpec {
                dev: self.dev.clone(),
                rank,
                nranks: n,
                rings: host_rings,
                windows: self.windows.clone(),
                signal: sig_info,
                counters: self.counters.ptr,
                counter_slots: self.comm.settings().counter_slots,
                spin: comm.settings().proxy_spin,
                links: (0..n).map(|p| comm.tcp_link(p)).collect(),
                stage: new_stage()?,
                timeout,
            })?)
        } else {
            None
        };
        let mut mem = vec![indices, rings, lsa_mem, sig_peers];
        let mut host = Vec::new();
        let nic = match gdaki {
            Some(g) => {
                mem.push(g.table);
                mem.extend(g.dev);
                let nic = nic::CudaNic::start(
                    self.dev.clone(),
                    nic::NicSpec {
                        rank,
                        nranks: n,
                        pairs: g.pairs,
                        windows: self.windows.clone(),
                        signal: self.signal_info(),
                        counters: self.counters.ptr,
                        counter_slots: self.comm.settings().counter_slots,
                        sink: g.sink.dev,
                        sink_host: g.sink.host,
                        sink_len: 64,
                        spin: comm.settings().proxy_spin,
                        links: (0..n).map(|p| comm.tcp_link(p)).collect(),
                        stage: new_stage()?,
                        timeout,
                    },
                )?;
                host.extend(g.host);
                host.push(g.sink);
                Some(nic)
            }
            None => None,
        };
        // Nobody signals into slots another rank has not zeroed yet.
        comm.bootstrap().barrier()?;
        Ok(CudaDevComm {
            cuda: self,
            abi,
            proxy,
            nic,
            _mem: mem,
            _host: host,
            ranges: Some(ranges),
            lsa: lsa.iter().map(|&b| b == REACH_LSA).collect(),
        })
    }

    /// The GDAKI queues of a device communicator: for each context and each
    /// peer not reached by load/store, an RC QP and its companion loopback
    /// QP (QP numbers as the CPU ranks' GDAKI: `0x100 + 2 * (c * n + p)`,
    /// companion one above; each CQ takes its QP's number).
    fn gdaki_queues(&self, nctx: usize, lsa: &[u8], log2: u32) -> Result<GdakiQueues, CoreError> {
        let n = self.comm.nranks();
        // `log2` is within gin-gdaki's bounds (`BackendKind::queue_log2`):
        // 16-bit WQE indices stay unambiguous, and a put with a signal and
        // a counter takes two WQEs of at most half of each queue.
        let nsq = nctx * n * 2;
        let indices = DevMem::new(nsq * 16)?;
        indices.zero(0, nsq * 16)?;
        let cqes = DevMem::new(nsq * 64)?;
        // A fresh CQE is invalid (opcode 15, owner 0), as rdma-core sets it.
        let mut fresh = vec![0u8; nsq * 64];
        for c in fresh.chunks_mut(64) {
            c[63] = gin_gdaki::completion::FRESH_OP_OWN;
        }
        cqes.write(0, &fresh)?;
        let ctl = HostMem::new(nsq * 16)?;
        let sink = HostMem::new(64)?;
        let (sig_id, sig_addrs) = {
            let t = self
                .windows
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let id = self.signal_window.id();
            (id, t[&id].addrs.clone())
        };
        let mut table = vec![GdakiQpAbi::default(); nctx * n];
        let mut pairs = Vec::new();
        let mut host = Vec::new();
        for c in 0..nctx {
            for p in (0..n).filter(|&p| lsa[p] == REACH_QUEUE) {
                let i = c * n + p;
                let mut sqs = Vec::with_capacity(2);
                let mut specs = Vec::with_capacity(2);
                for j in 0..2 {
                    let k = 2 * i + j;
                    let qpn = 0x100 + k as u32;
                    let wqes = HostMem::new(64 << log2)?;
                    sqs.push(GdakiSqAbi {
                        wqes: wqes.dev,
                        indices: indices.ptr + k as u64 * 16,
                        dbrec: ctl.dev + k as u64 * 16,
                        doorbell: ctl.dev + k as u64 * 16 + 8,
                        cqe: cqes.ptr + k as u64 * 64,
                        qpn,
                        log2,
                    });
                    specs.push(nic::SqSpec {
                        qpn,
                        log2,
                        wqes: wqes.host,
                        // SAFETY: inside the `nsq * 16`-byte allocation.
                        ctl: unsafe { ctl.host.add(k * 16) },
                        cqe: cqes.ptr + k as u64 * 64,
                    });
                    host.push(wqes);
                }
                let key = window_key(sig_id, p, n).ok_or_else(|| {
                    CoreError::Invalid(format!("the signal window {sig_id} has no NIC key"))
                })?;
                table[i] = GdakiQpAbi {
                    main: sqs[0],
                    companion: sqs[1],
                    sig_addr: sig_addrs[p],
                    sig_key: key,
                    counter_key: COUNTER_KEY,
                    sink: sink.dev,
                    sink_key: SINK_KEY,
                    main_cqn: sqs[0].qpn,
                };
                let companion = specs.pop().expect("two queues");
                let main = specs.pop().expect("two queues");
                pairs.push(nic::PairSpec {
                    ctx: c as u32,
                    peer: p,
                    main,
                    companion,
                });
            }
        }
        let tab = DevMem::new(table.len() * std::mem::size_of::<GdakiQpAbi>())?;
        tab.write(0, &table)?;
        host.push(ctl);
        Ok(GdakiQueues {
            table: tab,
            pairs,
            dev: vec![indices, cqes],
            host,
            sink,
        })
    }

    fn signal_info(&self) -> proxy::SignalInfo {
        let t = self
            .windows
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let w = &t[&self.signal_window.id()];
        proxy::SignalInfo {
            window: self.signal_window.id(),
            peers: w.peers.clone(),
            sizes: w.sizes.clone(),
            keys: w.keys.clone(),
        }
    }

    /// Compiles `source` (which includes `gin/gin.cuh`) for this GPU with
    /// NVRTC and loads it.
    pub fn compile(&self, source: &str, name: &str) -> Result<Module, CoreError> {
        self.dev.make_current()?;
        let cubin = nvrtc::compile(source, name, self.dev.cc)?;
        Module::load(&cubin)
    }
}

/// What [`CudaComm::gdaki_queues`] sets up.
struct GdakiQueues {
    /// `GdakiQpAbi[nctx * nranks]`, what `DevComm::rings` points at.
    table: DevMem,
    pairs: Vec<nic::PairSpec>,
    dev: Vec<DevMem>,
    host: Vec<HostMem>,
    sink: HostMem,
}

/// Signal and counter ranges taken from the CUDA id spaces.
#[derive(Debug)]
struct Ranges<'a, 'c> {
    cuda: &'a CudaComm<'c>,
    signals: (u64, u64),
    counters: (u64, u64),
}

impl Drop for Ranges<'_, '_> {
    fn drop(&mut self) {
        let mut s = self
            .cuda
            .spaces
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let _ = s.signals.free(self.signals.0, self.signals.1);
        let _ = s.counters.free(self.counters.0, self.counters.1);
    }
}

/// A device communicator for CUDA kernels.
#[derive(Debug)]
pub struct CudaDevComm<'a, 'c> {
    cuda: &'a CudaComm<'c>,
    abi: DevCommAbi,
    proxy: Option<proxy::CudaProxy>,
    nic: Option<nic::CudaNic>,
    _mem: Vec<DevMem>,
    /// Queues the NIC reads: freed only after it stopped (see Drop).
    _host: Vec<HostMem>,
    ranges: Option<Ranges<'a, 'c>>,
    lsa: Vec<bool>,
}

/// One kernel parameter, passed by value.
#[derive(Debug)]
pub enum Arg<'p> {
    DevComm(&'p DevCommAbi),
    Window(&'p WindowAbi),
    U64(u64),
    U32(u32),
    Ptr(u64),
}

impl CudaDevComm<'_, '_> {
    /// What a kernel receives (pass by value as `gin::DevComm`).
    pub fn abi(&self) -> &DevCommAbi {
        &self.abi
    }

    /// Whether `peer` is reached by load/store.
    pub fn is_lsa(&self, peer: usize) -> bool {
        self.lsa.get(peer).copied().unwrap_or(false)
    }

    /// The backend serving peers not reached by load/store (with `auto`
    /// and peers over TCP: "load/store + proxy").
    pub fn backend_name(&self) -> &'static str {
        let mixed = self.lsa.iter().filter(|&&l| l).count() > 1;
        if self.proxy.is_some() && mixed {
            "load/store + proxy"
        } else if self.proxy.is_some() {
            "proxy"
        } else if self.nic.is_some() {
            "gdaki"
        } else {
            "load/store"
        }
    }

    /// Launches `f` on `grid` blocks of `block` threads and waits for it,
    /// raising the abort flag if a peer dies or the proxy fails meanwhile.
    /// Afterwards the error word is read: a device-side error becomes an
    /// error naming this rank, the peer, the context and the id.
    pub fn run(
        &self,
        f: &Function,
        grid: u32,
        block: u32,
        args: &[Arg<'_>],
    ) -> Result<(), CoreError> {
        let cuda = self.cuda;
        cuda.dev.make_current()?;
        let mut vals: Vec<u64> = args
            .iter()
            .map(|a| match a {
                Arg::U64(v) | Arg::Ptr(v) => *v,
                Arg::U32(v) => u64::from(*v),
                Arg::DevComm(_) | Arg::Window(_) => 0,
            })
            .collect();
        let mut u32s: Vec<u32> = args
            .iter()
            .map(|a| if let Arg::U32(v) = a { *v } else { 0 })
            .collect();
        let mut params: Vec<*mut c_void> = Vec::with_capacity(args.len());
        for (i, a) in args.iter().enumerate() {
            params.push(match a {
                Arg::DevComm(d) => std::ptr::from_ref::<DevCommAbi>(d).cast_mut().cast(),
                Arg::Window(w) => std::ptr::from_ref::<WindowAbi>(w).cast_mut().cast(),
                Arg::U32(_) => (&raw mut u32s[i]).cast(),
                Arg::U64(_) | Arg::Ptr(_) => (&raw mut vals[i]).cast(),
            });
        }
        // SAFETY: the parameter pointers stay valid for the call; the caller
        // matches the kernel's signature (the kernels are ours, see
        // kernels/*.cu).
        unsafe { f.launch(&cuda.stream, grid, block, &mut params)? };
        let mut cause: Option<String> = None;
        let mut next = Instant::now();
        // A lost TCP link is often a dead peer that the bootstrap names a
        // moment later: give it that moment before settling for the link's
        // account.
        let mut tcp_failed: Option<(Instant, String)> = None;
        while !cuda.stream.idle()? {
            if Instant::now() >= next {
                next = Instant::now() + Duration::from_millis(1);
                if cause.is_none() {
                    if let Err(e) = cuda.comm.bootstrap().health() {
                        cause = Some(e.to_string());
                    } else if let Some((since, why)) = &tcp_failed {
                        if since.elapsed() > Duration::from_millis(500) {
                            cause = Some(why.clone());
                        }
                    } else if let Err(e) = cuda.comm.fabric().health() {
                        tcp_failed =
                            Some((Instant::now(), format!("the TCP transport failed: {e}")));
                    } else if let Some(e) = self.proxy.as_ref().and_then(proxy::CudaProxy::error) {
                        cause = Some(format!("the CUDA proxy failed: {e}"));
                    } else if let Some(e) = self.nic.as_ref().and_then(nic::CudaNic::error) {
                        cause = Some(format!("the soft NIC reported: {e}"));
                    }
                    if cause.is_some() {
                        // Queued on its own stream, which runs beside the
                        // kernel's; the kernel's waits read the flag.
                        cuda.abort_stream.write_u64(cuda.abort.ptr, 1)?;
                    }
                }
            }
            std::thread::sleep(Duration::from_micros(20));
        }
        if cause.is_some() {
            cuda.abort_stream.sync()?;
            cuda.abort.zero(0, 8)?;
        } else if let Some(e) = self.nic.as_ref().and_then(nic::CudaNic::error) {
            // A kernel that met an error CQE may end before the watch
            // above saw the NIC's account of it.
            cause = Some(format!("the soft NIC reported: {e}"));
        }
        let mut w = [0u64];
        cuda.error.read(0, &mut w)?;
        if w[0] != 0 {
            cuda.error.zero(0, 8)?;
        }
        if let Some(d) = errword::decode(w[0]) {
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
            return Err(CoreError::Invalid(format!(
                "rank {}: kernel finished, but {c}",
                cuda.comm.rank()
            )));
        }
        Ok(())
    }

    /// Stops the proxy after checking that every rank got here, and gives
    /// the ids back (collective).
    pub fn destroy(mut self) -> Result<(), CoreError> {
        if let Some(p) = self.proxy.take() {
            p.stop()?;
        }
        if let Some(n) = self.nic.take() {
            n.stop()?;
        }
        // What the proxy or NIC sent over TCP has been executed before any
        // rank reuses the slots.
        self.cuda.comm.fabric().fence_all()?;
        self.cuda.comm.bootstrap().barrier()?;
        self.ranges.take();
        Ok(())
    }
}

impl Drop for CudaDevComm<'_, '_> {
    fn drop(&mut self) {
        if let Some(p) = self.proxy.take() {
            let _ = p.stop();
        }
        if let Some(n) = self.nic.take() {
            let _ = n.stop();
        }
        // Without destroy, a signal may still be in flight to these slots:
        // keep them out of reuse.
        if let Some(r) = self.ranges.take() {
            std::mem::forget(r);
        }
    }
}

/// Used by tests and benchmarks to tell a CUDA-less machine apart.
pub fn skip_reason() -> Option<String> {
    available().err().map(|e| e.to_string())
}

/// The kernels of `gin-cuda-selftest` and the CUDA benchmarks (CUDA C++ that
/// includes `gin/gin.cuh`), for [`CudaComm::compile`].
pub const SELFTEST_KERNELS: &str = include_str!("../../kernels/selftest.cu");
