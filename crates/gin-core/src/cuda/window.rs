//! GPU windows: gin-cuda's window parts ([`gin_cuda::window`]: this rank's
//! part in device memory, its peers' parts mapped through CUDA IPC or
//! named by region keys over TCP) assembled into what the device API sees:
//! the window id, NIC keys, the arrays kernels index by rank and the
//! fabric's directory entry.

use std::sync::Arc;

use gin_cuda::staging::Server;
use gin_cuda::window::{LocalPart, Offer, PeerParts};
use gin_cuda::{DevMem, Device, IpcMem};
use gin_device::abi::WindowAbi;
use gin_net::{Fabric, MemDesc, MemParts, Memory};

use super::{COUNTER_KEY, CudaComm, WINDOW_KEY_BASE, cudarc, window_key};
use crate::comm::Comm;
use crate::error::CoreError;

/// A window in GPU memory, registered in the fabric's window directory as
/// `Memory::Device`. Dropping it removes it from the directory, so the
/// proxy and the soft NIC refuse requests naming it, and then frees its
/// memory; [`CudaComm::free_window`] does so on every rank at once.
#[derive(Debug)]
pub struct GpuWindow {
    abi: WindowAbi,
    bases: Vec<u64>,
    /// The directory it is registered in.
    fabric: Arc<Fabric>,
    /// The CUDA communicator that made it.
    home: Arc<()>,
    /// This rank's part (served to TCP peers until it drops).
    local: LocalPart,
    _arrays: DevMem,
    _peers: Vec<IpcMem>,
    /// Last: the context must outlive the memory above.
    _dev: Arc<Device>,
}

/// A window's ABI as one kernel parameter (a `gin::Window` by value), for
/// cudarc's launch builder: `builder.arg(&window.param())`.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowParam(pub WindowAbi);

// SAFETY: plain `#[repr(C)]` integers (gin-device asserts its layout),
// passed by value as the header's `gin::Window`.
unsafe impl cudarc::driver::DeviceRepr for WindowParam {}

impl GpuWindow {
    /// What a kernel receives (pass by value).
    pub fn abi(&self) -> &WindowAbi {
        &self.abi
    }

    /// [`GpuWindow::abi`] as a kernel parameter for cudarc's launch
    /// builder.
    pub fn param(&self) -> WindowParam {
        WindowParam(self.abi)
    }

    /// The window's id, the same on every rank.
    pub fn id(&self) -> u32 {
        self.abi.id
    }

    /// This rank's part, in device memory.
    pub fn local(&self) -> &DevMem {
        self.local.mem()
    }

    /// Rank `p`'s part as mapped here (device address), if it exists.
    pub fn peer_base(&self, p: usize) -> Option<u64> {
        self.bases.get(p).copied()
    }

    /// Whether the CUDA communicator named `home` made this window.
    pub(super) fn belongs_to(&self, home: &Arc<()>) -> bool {
        Arc::ptr_eq(&self.home, home)
    }
}

impl Drop for GpuWindow {
    fn drop(&mut self) {
        // Before the memory goes: a request naming the window from now on is
        // refused ("unknown window"), not executed on freed memory.
        // (Then `local`'s drop removes the part from the region table, so
        // TCP peers' requests are refused, before its memory is freed.)
        self.fabric.remove_window(self.abi.id);
    }
}

impl CudaComm<'_> {
    /// A window of `bytes` of device memory gin allocates (collective).
    pub(super) fn make_window(
        comm: &Comm,
        dev: &Arc<Device>,
        home: &Arc<()>,
        server: Option<&Arc<Server>>,
        bytes: u64,
    ) -> Result<GpuWindow, CoreError> {
        let id = comm.take_window_id();
        // Served to TCP peers from the region table (removed again when
        // `local` drops, on an error path below or after the window's drop).
        let local = LocalPart::new(dev, bytes, server.map(|s| (comm.region_table(), s)));
        Self::assemble(comm, dev, home, id, local)
    }

    /// A window whose part here is the user's `bytes` at `ptr`
    /// (collective): see [`CudaComm::register_window`].
    ///
    /// # Safety
    /// As [`CudaComm::register_window`].
    pub(super) unsafe fn adopt_window(&self, ptr: u64, bytes: u64) -> Result<GpuWindow, CoreError> {
        let comm = self.comm;
        let id = comm.take_window_id();
        let (rank, n) = (comm.rank(), comm.nranks());
        // Only a same-host peer needs the part exported through CUDA IPC.
        let ipc = (0..n).any(|p| p != rank && !comm.reaches_keyed(p));
        let serve = self.server.as_ref().map(|s| (comm.region_table(), s));
        // SAFETY: the caller's contract.
        let local = unsafe { LocalPart::register(rank, &self.dev, ptr, bytes, ipc, serve) };
        Self::assemble(comm, &self.dev, &self.home, id, local)
    }

    /// Tells every rank what this rank contributes to window `id` (its
    /// part, or why it has none), reaches the others' parts and registers
    /// the window in the fabric's directory. Where any rank has no part,
    /// every rank fails naming it.
    fn assemble(
        comm: &Comm,
        dev: &Arc<Device>,
        home: &Arc<()>,
        id: u32,
        local: Result<LocalPart, gin_cuda::CudaError>,
    ) -> Result<GpuWindow, CoreError> {
        let (rank, n) = (comm.rank(), comm.nranks());
        let offer = match &local {
            Ok(part) => Offer::Part(part.record()),
            Err(e) => Offer::Refused(e.to_string()),
        };
        let all = comm.bootstrap().allgather(&offer.encode())?;
        let records = Offer::gather(rank, id, &all);
        // This rank's own error where it refused, else the first refusal.
        let local = local?;
        let records = records?;
        let bytes = local.record().size;
        let parts = PeerParts::open(rank, id, &local, &records, |p| comm.reaches_keyed(p))?;
        let keys = (0..n)
            .map(|p| window_key(id, p, n))
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| CoreError::Limit {
                rank,
                what: "GPU window id".into(),
                asked: id.into(),
                limit: ((COUNTER_KEY - WINDOW_KEY_BASE) as usize / n.max(1)).saturating_sub(1)
                    as u64,
                hint: format!("no NIC key is left for more windows with {n} ranks"),
            })?;
        // sizes u64[n], peer bases u64[n], addresses u64[n], keys u32[n]:
        // every array aligned for its loads.
        let arrays = DevMem::new(n * 28)?;
        arrays.write(0, &parts.sizes)?;
        arrays.write(n * 8, &parts.bases)?;
        arrays.write(n * 16, &parts.addrs)?;
        arrays.write(n * 24, &keys)?;
        let abi = WindowAbi {
            id,
            flags: 0,
            local_base: local.mem().ptr(),
            local_size: bytes,
            sizes: arrays.ptr(),
            peer_bases: arrays.ptr() + n as u64 * 8,
            keys: arrays.ptr() + n as u64 * 24,
            addrs: arrays.ptr() + n as u64 * 16,
        };
        comm.bootstrap().barrier()?;
        // Registered last: an error above leaves no description of memory
        // that is freed on the way out.
        let desc = MemParts {
            memory: Memory::Device,
            local_base: local.mem().ptr() as usize,
            sizes: parts.sizes,
            peer_bases: parts.bases.iter().map(|&b| b as usize).collect(),
            keys: parts.tcp_keys,
            addrs: parts.addrs,
            states: vec![0; n],
            keep: None,
        };
        // SAFETY: device memory: `local` is this rank's part (`bytes`
        // bytes) and each non-zero peer base a CUDA IPC mapping of that
        // peer's part (its size), both held by the window, which removes
        // the description from the directory (its drop) before they are
        // freed. Nothing on the host dereferences them (`Memory::Device`);
        // the CUDA engines that copy them are stopped, or told to flush,
        // before a window is freed.
        comm.fabric().add_window(id, unsafe { MemDesc::new(desc) });
        Ok(GpuWindow {
            abi,
            bases: parts.bases,
            fabric: comm.fabric().clone(),
            home: home.clone(),
            local,
            _arrays: arrays,
            _peers: parts.opened,
            _dev: dev.clone(),
        })
    }
}
