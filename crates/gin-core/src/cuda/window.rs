//! GPU windows: each rank's part in device memory, its peers' parts mapped
//! through CUDA IPC (same host) or named by region keys (over TCP), and the
//! arrays kernels index by rank.

use std::sync::Arc;

use gin_cuda::staging::{GpuRegion, Server};
use gin_cuda::{DevMem, Device, IpcMem};
use gin_device::abi::WindowAbi;
use gin_net::region::RegionTable;
use gin_net::{Fabric, MemDesc, MemParts, Memory};

use super::{COUNTER_KEY, CudaComm, WINDOW_KEY_BASE, window_key};
use crate::comm::Comm;
use crate::error::CoreError;
use crate::record::GpuWindowRecord;

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
    /// Where this part is served to TCP peers: the region table and key.
    served: Option<(Arc<RegionTable>, u32)>,
    local: DevMem,
    _arrays: DevMem,
    _peers: Vec<IpcMem>,
    /// Last: the context must outlive the memory above.
    _dev: Arc<Device>,
}

impl GpuWindow {
    /// What a kernel receives (pass by value).
    pub fn abi(&self) -> &WindowAbi {
        &self.abi
    }

    /// The window's id, the same on every rank.
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

    /// Whether the CUDA communicator named `home` made this window.
    pub(super) fn belongs_to(&self, home: &Arc<()>) -> bool {
        Arc::ptr_eq(&self.home, home)
    }
}

impl Drop for GpuWindow {
    fn drop(&mut self) {
        // Before the memory goes: a request naming the window from now on is
        // refused ("unknown window"), not executed on freed memory.
        self.fabric.remove_window(self.abi.id);
        // And TCP peers' requests are refused ("unknown memory key"); the
        // removal waits for a request being served.
        if let Some((t, key)) = &self.served {
            t.remove_region(*key, self.local.ptr() as usize);
        }
    }
}

/// A window part registered for TCP peers while its window is being made:
/// removed from the region table again if making it fails.
struct Served(Option<(Arc<RegionTable>, u32)>, u64);

impl Served {
    /// The window was made: it removes the region when dropped.
    fn keep(mut self) -> Option<(Arc<RegionTable>, u32)> {
        self.0.take()
    }

    /// The region key TCP peers name the part with.
    fn key(&self) -> Option<u32> {
        self.0.as_ref().map(|s| s.1)
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if let Some((t, key)) = self.0.take() {
            t.remove_region(key, self.1 as usize);
        }
    }
}

/// What every rank's record says about a window, by rank.
struct Parts {
    sizes: Vec<u64>,
    /// Each rank's own device address of its part.
    addrs: Vec<u64>,
    /// Each part as reached here: mapped (device address), 0 over TCP.
    bases: Vec<u64>,
    tcp_keys: Vec<u32>,
    opened: Vec<IpcMem>,
}

impl CudaComm<'_> {
    pub(super) fn make_window(
        comm: &Comm,
        dev: &Arc<Device>,
        home: &Arc<()>,
        server: Option<&Arc<Server>>,
        bytes: u64,
    ) -> Result<GpuWindow, CoreError> {
        dev.make_current()?;
        let id = comm.take_window_id();
        let n = comm.nranks();
        let local = DevMem::new(bytes as usize)?;
        let handle = local.ipc_handle()?;
        // Served to TCP peers from the region table (removed again by the
        // window's drop, or by `Served`'s on an error path below).
        let served = match server {
            Some(sv) => Some(serve(comm, &local, bytes, sv)?),
            None => None,
        };
        let mine = GpuWindowRecord {
            size: bytes,
            addr: local.ptr(),
            ipc: handle,
            key: served.as_ref().and_then(Served::key).unwrap_or(0),
        };
        let all = comm.bootstrap().allgather(&mine.encode())?;
        let parts = open_parts(comm, id, &local, &all)?;
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
        arrays.write(0, &parts.sizes)?;
        arrays.write(n * 8, &parts.bases)?;
        arrays.write(n * 16, &parts.addrs)?;
        arrays.write(n * 24, &keys)?;
        let abi = WindowAbi {
            id,
            flags: 0,
            local_base: local.ptr(),
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
            local_base: local.ptr() as usize,
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
            served: served.and_then(Served::keep),
            local,
            _arrays: arrays,
            _peers: parts.opened,
            _dev: dev.clone(),
        })
    }
}

/// Registers `local` in the rank's region table, served by `server`.
fn serve(
    comm: &Comm,
    local: &DevMem,
    bytes: u64,
    server: &Arc<Server>,
) -> Result<Served, CoreError> {
    let t = comm.region_table().clone();
    // SAFETY: `local` holds `bytes` bytes of device memory, and the region
    // is removed from the table before `local` is freed: by the window's
    // drop (which runs before its fields drop), or by `Served`'s drop on
    // the error paths of `make_window`, where `local` outlives it.
    let region = unsafe { GpuRegion::new(local.ptr(), bytes, server.clone()) };
    let key = t.insert_backed(local.ptr(), bytes, Arc::new(region))?;
    Ok(Served(Some((t, key)), local.ptr()))
}

/// Decodes every rank's record of window `id` and reaches each part: this
/// rank's own, a TCP peer's by its region key, a same-host peer's by
/// mapping it through CUDA IPC.
fn open_parts(comm: &Comm, id: u32, local: &DevMem, all: &[Vec<u8>]) -> Result<Parts, CoreError> {
    let (rank, n) = (comm.rank(), comm.nranks());
    let mut parts = Parts {
        sizes: Vec::with_capacity(n),
        addrs: Vec::with_capacity(n),
        bases: Vec::with_capacity(n),
        tcp_keys: Vec::with_capacity(n),
        opened: Vec::new(),
    };
    for (p, rec) in all.iter().enumerate() {
        let rec = GpuWindowRecord::decode(p, id, rec)?;
        parts.sizes.push(rec.size);
        parts.addrs.push(rec.addr);
        parts.tcp_keys.push(rec.key);
        if p == rank {
            parts.bases.push(local.ptr());
        } else if comm.reaches_keyed(p) {
            // Reached over TCP: no mapping; requests name `key`.
            if rec.key == 0 {
                return Err(CoreError::Invalid(format!(
                    "rank {p} does not serve GPU window {id} over TCP, but rank {rank} \
                     reaches it over TCP (GIN_TRANSPORT or host ids differ between ranks?)"
                )));
            }
            parts.bases.push(0);
        } else {
            let m = IpcMem::open(&rec.ipc).map_err(|e| {
                CoreError::Invalid(format!(
                    "rank {rank} cannot map GPU window {id} of rank {p} through CUDA IPC: {e}"
                ))
            })?;
            parts.bases.push(m.ptr());
            parts.opened.push(m);
        }
    }
    Ok(parts)
}
