//! GPU windows: gin-cuda's window parts ([`gin_cuda::window`]: this rank's
//! part in device memory, its peers' parts mapped (CUDA IPC, VMM) or
//! named by region keys over TCP) assembled into what the device API sees:
//! the window id, NIC keys and the arrays kernels index by rank (gin-cuda
//! lists the parts in the fabric's directory: `gin_cuda::window::Listed`).

use std::sync::Arc;

use gin_cuda::staging::Server;
use gin_cuda::window::{Listed, LocalPart, SameHost};
use gin_cuda::{DevMem, Device};
use gin_device::abi::WindowAbi;

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
    /// The CUDA communicator that made it.
    home: Arc<()>,
    /// Every part, listed in the fabric's directory (this rank's served
    /// to TCP peers) until it drops.
    parts: Listed,
    _arrays: DevMem,
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
        self.parts.local().mem()
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
        // Only same-host peers map the part (CUDA IPC, or a VMM descriptor).
        let peers = (0..n).filter(|&p| p != rank && !comm.reaches_keyed(p));
        let host = SameHost::new(comm.bootstrap(), &comm.liveness, id, peers, comm.timeout());
        let serve = self.server.as_ref().map(|s| (comm.region_table(), s));
        // SAFETY: the caller's contract.
        let local = unsafe { LocalPart::register(rank, &self.dev, ptr, bytes, host, serve) };
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
        let allgather = |b: &[u8]| -> Result<_, CoreError> { Ok(comm.bootstrap().allgather(b)?) };
        let (local, parts) =
            gin_cuda::window::exchange(rank, id, local, allgather, |p| comm.reaches_keyed(p))?;
        let bytes = local.record().size;
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
        let bases = parts.bases.clone();
        // Listed last: an error above leaves no description of memory that
        // is freed on the way out.
        // SAFETY: `exchange` opened `parts` for `local`.
        let parts = unsafe { Listed::new(comm.fabric(), id, local, parts) };
        Ok(GpuWindow {
            abi,
            bases,
            home: home.clone(),
            parts,
            _arrays: arrays,
            _dev: dev.clone(),
        })
    }
}
