//! CUDA ranks: windows in GPU memory, device communicators whose
//! [`DevCommAbi`](gin_device::abi::DevCommAbi) kernels receive, and
//! run-time compilation, on gin-cuda's host runtime. The engine serving
//! the peers not reached by load/store is the selected backend's (the CUDA
//! proxy of `gin_proxy::cuda`, the soft NIC of `gin_gdaki::cuda`), started
//! per device communicator through gin-device's `HostBackend::start_cuda`
//! and kept as an opaque `CudaEngine`.
//!
//! # Design
//!
//! - **Nothing CUDA is needed to build.** gin-cuda loads the driver and
//!   NVRTC at run time through cudarc; [`available`] says why CUDA cannot
//!   be used instead of panicking. Its memory types, streams and kernels
//!   are re-exported here ([`DevMem`], [`HostMem`], [`Stream`],
//!   [`Function`], ...): what takes a raw address or launches a kernel is
//!   `unsafe`, [`CudaDevComm::run`] and [`CudaDevComm::launch_on`]
//!   included.
//! - **Windows** ([`CudaComm::alloc_window`]) are `cuMemAlloc` memory; same-host
//!   peers open each other's parts through CUDA IPC, so a kernel reaches a
//!   peer's part by load/store over NVLink (or PCIe), and the proxy's copy
//!   engine reaches it with `cuMemcpyAsync`. The parts, their records and
//!   the IPC mappings are gin-cuda's (`gin_cuda::window`); gin-core gives
//!   each window its id, NIC keys and the arrays kernels index, and
//!   registers it in the fabric's window directory as `Memory::Device`,
//!   which the proxy and the soft NIC resolve descriptors and keys against.
//! - **Signals** are `nranks` sub-slots each (`DEVCOMM_FLAG_SENDER_SLOTS`) in
//!   a GPU signal window, summed: the proxy, the only writer of its rank's
//!   sub-slot at the peers it serves, stores running totals with
//!   `cuStreamWriteValue64` in the stream after the data; a GPU reaching the
//!   peer by load/store adds to the peer's own sub-slot with a system-scope
//!   atomic, so where every peer is (`DEVCOMM_FLAG_LSA_ONLY`) a wait reads one
//!   word. Counters have two sub-slots: the proxy's running total and the
//!   GPU's atomic adds.
//! - **Proxy rings** (set up by gin-proxy) live in mapped pinned host memory
//!   (not write-combined: the proxy thread polls them); producer and
//!   completion indices live in device memory, so a kernel never needs an
//!   atomic across PCIe. gin-core keeps an opaque handle: the ring table's
//!   address, the first error, stop.
//! - **Errors**: kernels record the first error in an error word; the host
//!   reads it after the kernel and names rank, peer, context and id. While a
//!   kernel runs, [`CudaDevComm::run`] watches the job's health and the
//!   proxy or the soft NIC, and raises the abort flag so device waits give
//!   up.
//! - **A library for CUDA applications**: the user's kernels run on the
//!   user's streams ([`CudaDevComm::launch_on`], returning at once, with a
//!   [`Watcher`] thread raising the abort flag and [`CudaDevComm::check`]
//!   turning the error word into the error `run` gives; `run` is the three
//!   composed, its watch on the calling thread), with cudarc's launch builder
//!   too ([`DevCommParam`], [`WindowParam`]); the user's device memory
//!   becomes a window ([`CudaComm::register_window`], exported by its IPC
//!   handle or VMM descriptor and offset, refused on every rank where it
//!   cannot be shared); NVRTC takes the user's include folders, defines and
//!   CCCL ([`CudaComm::compile_with`]). Everything runs in the GPU's primary
//!   context, cudarc's too ([`CudaComm::context_info`]).
//!
//! - **GDAKI** (`GIN_BACKEND=gdaki`): kernels build mlx5 WQEs into send
//!   queues in mapped pinned host memory, mark them ready in order and write
//!   the doorbell record and doorbell; gin-gdaki's soft NIC (the engine CPU
//!   ranks run, on CUDA streams) executes them with the copy engine and
//!   stores each pass's CQE into a collapsed CQ in device memory, which
//!   flush and credit poll. gin-gdaki sets the queues up; gin-core keeps an
//!   opaque handle: the queue table's address, the first error, stop.
//!   Window parts carry gin-gdaki's NIC keys ([`window_key`]); addresses
//!   are each rank's own device addresses.
//!
//! - **TCP staging** (`gin_cuda::staging`): a peer the fabric reaches over
//!   TCP (another host, or `GIN_TRANSPORT=tcp`) has no IPC mapping. Window
//!   parts are served to it from the region table through the copy engine,
//!   and the proxy (or soft NIC) stages what it sends and fetches through
//!   pinned host memory. `auto` reaches such peers through the proxy.
mod devcomm;
pub mod nvrtc;

mod window;

pub use gin_cuda::{
    Cubin, CudaError, DevMem, Device, Function, HostMem, IpcMem, LaunchConfig, Module,
    RelaxedCapture, Stream, StreamRef, cudarc,
};

pub use devcomm::{Arg, CudaDevComm, DevCommParam, Watcher};
/// Which CUDA context gin uses on a rank's GPU
/// ([`CudaComm::context_info`]); kernels a user launches with
/// [`CudaDevComm::launch_on`] may use any stream of it.
pub use gin_cuda::watch::ContextInfo;
pub use nvrtc::CompileOptions;
pub use window::{GpuWindow, WindowParam};

use std::sync::Arc;

use gin_cuda::watch::Supervisor;

use crate::comm::Comm;
use crate::error::CoreError;
use crate::space::Spaces;

/// Whether a CUDA driver with at least one GPU is usable here (how many
/// GPUs); the error says why not. Checked once per process.
pub fn available() -> Result<usize, CoreError> {
    Ok(gin_cuda::available()?)
}

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

pub(crate) use gin_gdaki::ids::{COUNTER_KEY, WINDOW_KEY_BASE};
/// The NIC key scheme of GPU window parts is gin-gdaki's: the key of rank
/// `p`'s part of window `id` in a job of `n` ranks is `0x1000 + id * n +
/// p`, so the soft NIC decodes a key without a table.
pub use gin_gdaki::ids::{window_key, window_of_key};

/// The CUDA side of a communicator: this rank's GPU, its windows, and the
/// memory every device communicator shares (signals, counters, abort flag,
/// error word). All ranks of the communicator must call its collectives.
#[derive(Debug)]
pub struct CudaComm<'c> {
    comm: &'c Comm,
    /// Names this CUDA communicator: each of its windows holds a clone
    /// (windows themselves live in the fabric's directory, as
    /// `Memory::Device`).
    home: Arc<()>,
    signal_window: GpuWindow,
    counters: DevMem,
    /// The abort flag kernels poll (shared with watcher threads: every
    /// watch of this communicator raises the one flag, lowered when the
    /// last that raised it lets go), the error word and gin's stream.
    kernels: Supervisor,
    spaces: Spaces,
    /// Serves window parts to TCP peers (`None`: no peer is reached over TCP).
    server: Option<Arc<gin_cuda::staging::Server>>,
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
                Ok(v) => v.trim().parse::<usize>().map_err(|_| CoreError::Setting {
                    var: "GIN_CUDA_DEVICE",
                    value: v.clone(),
                    why: "not a GPU index".into(),
                })?,
                Err(_) => comm.local_rank() % n,
            };
            Ok(Device::open(ordinal)?)
        });
        let ok = comm.bootstrap().first_refusal(local.is_ok())?;
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
        let home = Arc::new(());
        let server = if (0..comm.nranks()).any(|p| comm.reaches_keyed(p)) {
            Some(Arc::new(gin_cuda::staging::Server::new(dev.clone())?))
        } else {
            None
        };
        let signal_window =
            Self::make_window(comm, &dev, &home, server.as_ref(), s.signal_slots * n * 8)?;
        let me = Self {
            comm,
            home,
            signal_window,
            counters: DevMem::new(s.counter_slots as usize * 16)?,
            kernels: Supervisor::new(dev.clone())?,
            spaces: Spaces::new(s.signal_slots, s.counter_slots),
            server,
            dev,
        };
        tracing::info!(
            rank = comm.rank(),
            gpu = me.dev.ordinal(),
            name = %me.dev.name(),
            cc = ?me.dev.cc(),
            "CUDA rank ready"
        );
        Ok(me)
    }

    /// This rank's GPU.
    pub fn device(&self) -> &Device {
        &self.dev
    }

    /// The communicator these CUDA ranks belong to.
    pub fn comm(&self) -> &Comm {
        self.comm
    }

    /// Whether `peer` is reached over TCP (staged through host memory)
    /// rather than through CUDA IPC.
    pub fn reaches_over_tcp(&self, peer: usize) -> bool {
        self.comm.reaches_keyed(peer)
    }

    /// Allocates a window of `bytes` of GPU memory on this rank (collective;
    /// sizes may differ per rank); same-host peers map it through CUDA IPC.
    pub fn alloc_window(&self, bytes: u64) -> Result<GpuWindow, CoreError> {
        Self::make_window(
            self.comm,
            &self.dev,
            &self.home,
            self.server.as_ref(),
            bytes,
        )
    }

    /// Frees a window on every rank (collective): once every rank has
    /// arrived (flush the contexts that used it first), each removes it from
    /// the fabric's window directory, so its proxy and soft NIC refuse
    /// requests naming it, then unmaps its peers' parts and frees its own.
    pub fn free_window(&self, w: GpuWindow) -> Result<(), CoreError> {
        let id = w.id();
        let ours = w.belongs_to(&self.home) && id != self.signal_window.id();
        if !ours {
            return Err(CoreError::ForeignWindow {
                rank: self.comm.rank(),
                window: id,
            });
        }
        // Every request this rank sent over TCP has been executed before
        // anyone frees.
        self.comm.fabric().fence_all()?;
        self.comm.bootstrap().barrier()?;
        self.dev.make_current()?;
        drop(w);
        Ok(())
    }

    /// Registers the user's `bytes` of device memory at `ptr` as this
    /// rank's part of a new window (collective; sizes may differ per rank,
    /// as with [`CudaComm::alloc_window`]). Same-host peers map its
    /// allocation (`cuMemAlloc`: CUDA IPC; VMM `cuMemCreate` with the POSIX
    /// fd handle type, mapped whole from offset 0: its fd over a Unix
    /// socket) plus its offset; peers over TCP reach it through the engines.
    /// Memory that cannot be a part — not this GPU's device memory, not
    /// inside one allocation (one VMM chunk), or, with a same-host peer,
    /// managed, a stream-ordered pool's (cudarc's `alloc` on most GPUs), VMM
    /// without that handle type — makes every rank fail, naming the rank,
    /// the pointer and why; [`CudaComm::free_window`] leaves the memory alone.
    ///
    /// # Safety
    /// `ptr` must be the start of `bytes` bytes of device memory of this
    /// rank's GPU ([`CudaComm::device`]) that stay allocated, and are not
    /// reused for anything else, until the window has been freed on every
    /// rank or dropped: peers and engines write it until then.
    pub unsafe fn register_window(&self, ptr: u64, bytes: u64) -> Result<GpuWindow, CoreError> {
        // SAFETY: the caller's contract.
        unsafe { self.adopt_window(ptr, bytes) }
    }

    /// Compiles `source` (which includes `gin/gin.cuh`) for this GPU with
    /// NVRTC and loads it.
    pub fn compile(&self, source: &str, name: &str) -> Result<Module, CoreError> {
        self.compile_with(source, name, &CompileOptions::default())
    }

    /// As [`CudaComm::compile`], with the user's include folders, defines
    /// and NVRTC options (and CCCL's headers where installed: see
    /// [`nvrtc::compile_with`]).
    pub fn compile_with(
        &self,
        source: &str,
        name: &str,
        opts: &CompileOptions,
    ) -> Result<Module, CoreError> {
        self.dev.make_current()?;
        let cubin = nvrtc::compile_with(source, name, self.dev.cc(), opts)?;
        Ok(Module::load(&cubin)?)
    }

    /// Which CUDA context and streams gin uses on this rank's GPU, to share
    /// them with another CUDA library (cudarc, PyTorch): the primary
    /// context, and the stream [`CudaDevComm::run`] launches on.
    pub fn context_info(&self) -> ContextInfo {
        self.kernels.context_info()
    }
}

/// Used by tests and benchmarks to tell a CUDA-less machine apart.
pub fn skip_reason() -> Option<String> {
    available().err().map(|e| e.to_string())
}
