//! The CUDA half of a GPU window: this rank's part in device memory,
//! exported for same-host peers (CUDA IPC, or a VMM allocation's file
//! descriptor handed over a Unix socket, [`crate::fdpass`]) and served to
//! TCP peers from the region table, the record it tells the other ranks,
//! and the peers' parts as reached here (mapped through CUDA IPC or
//! imported from a VMM descriptor, or named by region key over TCP).
//!
//! Ranks exchange offers ([`exchange`]), and a window's parts are listed
//! in the fabric's window directory as `Memory::Device` while they live
//! ([`Listed`]), which the CUDA engines resolve requests against. What a
//! window means to the device API (ids, NIC keys, the arrays a kernel
//! indexes) is gin-core's: it assembles the window from a [`LocalPart`]
//! and [`PeerParts`].

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use gin_bootstrap::record::{Reader, Writer};
use gin_net::region::{RegionTable, Removal};
use gin_net::{Fabric, KeepAlive, MemDesc, MemParts, Memory};

use crate::driver::{DevMem, Device, IpcMem, PoolMem};
use crate::error::CudaError;
use crate::fdpass::{FdJob, FdListener, FdServer};
use crate::pointer::{PointerFacts, ipc_handle_of, unmeasured};
use crate::staging::{GpuRegion, Server};
use crate::vmm::VmmMapping;

/// What a rank tells the others about its part of a GPU window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartRecord {
    /// The part's size in bytes.
    pub size: u64,
    /// Its device address on the sending rank (what WQEs name).
    pub addr: u64,
    /// Its CUDA IPC handle, for same-host peers.
    pub ipc: [u8; 64],
    /// Its region key for TCP peers (0: not served over TCP).
    pub key: u32,
    /// Its offset in the allocation the IPC handle exports, or in the VMM
    /// mapping (0 for memory gin allocated; a registered range may start
    /// inside an allocation).
    pub offset: u64,
    /// `Some(size)`: a VMM allocation same-host peers import from its file
    /// descriptor (fetched from the sending rank, [`crate::fdpass`]) and
    /// map, `size` bytes, instead of opening `ipc`.
    pub vmm: Option<u64>,
}

impl PartRecord {
    /// Encoded length: size, address (u64 LE each), the IPC handle, the
    /// key (u32 LE), the offset, the VMM mapping's size (u64 LE each, 0:
    /// not VMM).
    pub const LEN: usize = 100;

    /// The bytes ranks exchange.
    pub fn encode(&self) -> Vec<u8> {
        Writer::new()
            .u64(self.size)
            .u64(self.addr)
            .bytes(&self.ipc)
            .u32(self.key)
            .u64(self.offset)
            .u64(self.vmm.unwrap_or(0))
            .finish()
    }

    /// Decodes what rank `rank` sent for GPU window `window`.
    pub fn decode(rank: usize, window: u32, b: &[u8]) -> Result<Self, CudaError> {
        let what = format!("GPU window {window} record");
        let mut r = Reader::exact(rank, &what, b, Self::LEN)?;
        Ok(Self {
            size: r.u64()?,
            addr: r.u64()?,
            ipc: r.array()?,
            key: r.u32()?,
            offset: r.u64()?,
            vmm: Some(r.u64()?).filter(|&s| s != 0),
        })
    }
}

/// What a rank contributes to a GPU window being created: its part's
/// record, or why it has none (its memory could not be allocated or
/// registered). Every rank learns every offer, so all fail alike when one
/// refuses instead of some waiting for a rank that gave up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Offer {
    /// The part's record.
    Part(PartRecord),
    /// Why this rank has no part.
    Refused(String),
}

impl Offer {
    /// A tag byte (0: part, 1: refusal), then the record or the text.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Self::Part(r) => [&[0u8][..], &r.encode()].concat(),
            Self::Refused(why) => [&[1u8][..], why.as_bytes()].concat(),
        }
    }

    /// Decodes what rank `rank` offered for GPU window `window`.
    pub fn decode(rank: usize, window: u32, b: &[u8]) -> Result<Self, CudaError> {
        match b.split_first() {
            Some((0, rec)) => Ok(Self::Part(PartRecord::decode(rank, window, rec)?)),
            Some((1, why)) => Ok(Self::Refused(String::from_utf8_lossy(why).into_owned())),
            _ => Err(gin_bootstrap::record::Malformed {
                rank,
                what: format!("GPU window {window} offer"),
                got: b.len(),
                expected: PartRecord::LEN + 1,
            }
            .into()),
        }
    }

    /// Every rank's record, by rank; the first refusal (its rank and
    /// account) if any rank refused. `rank` is this rank (for the error).
    pub fn gather(
        rank: usize,
        window: u32,
        offers: &[Vec<u8>],
    ) -> Result<Vec<PartRecord>, CudaError> {
        let offers = offers
            .iter()
            .enumerate()
            .map(|(p, b)| Self::decode(p, window, b))
            .collect::<Result<Vec<_>, _>>()?;
        offers
            .into_iter()
            .enumerate()
            .map(|(peer, o)| match o {
                Self::Part(r) => Ok(r),
                Self::Refused(why) => Err(CudaError::WindowRefused {
                    rank,
                    window,
                    peer,
                    why,
                }),
            })
            .collect()
    }
}

/// How this rank's part of a registered window is shared with the ranks of
/// its host that map it.
#[derive(Debug, Clone)]
pub struct SameHost {
    /// The window's id.
    pub window: u32,
    /// The same-host peers that map the part (through CUDA IPC, or a VMM
    /// allocation's descriptor); empty: none does.
    pub peers: Vec<usize>,
    /// What names and authenticates the descriptor sockets, and the job's
    /// timeout.
    pub job: FdJob,
}

impl SameHost {
    /// Window `window`'s sharing with `peers`, in the job `bootstrap`
    /// belongs to, whose waits last `timeout`; `liveness` gives the
    /// same-host peers' pids, which the descriptor sockets check.
    pub fn new(
        bootstrap: &gin_bootstrap::Bootstrap,
        liveness: &gin_bootstrap::liveness::Liveness,
        window: u32,
        peers: impl IntoIterator<Item = usize>,
        timeout: std::time::Duration,
    ) -> Self {
        Self {
            window,
            peers: peers.into_iter().collect(),
            job: FdJob::new(bootstrap, liveness, timeout),
        }
    }
}

/// A registered part's sharing, as [`PeerParts::open`] needs it to fetch
/// same-host peers' VMM descriptors.
#[derive(Debug)]
struct Sharing {
    host: SameHost,
    /// The GPU peers' VMM allocations are mapped for.
    ordinal: usize,
}

/// A VMM part's file descriptor on its way to the same-host peers: bound
/// (before the offers go out, so peers can connect as soon as they learn
/// of it), then served ([`LocalPart::serve_descriptor`]) until every peer
/// has it or the part drops.
#[derive(Debug)]
enum FdExport {
    Bound(FdListener, OwnedFd, Vec<usize>),
    Serving {
        /// Held for its drop, which stops the server.
        _server: FdServer,
    },
}

/// This rank's part of a GPU window: device memory, its IPC handle, and
/// (where some peer is reached over TCP) its registration in the region
/// table, removed again when the part drops, before the memory is freed
/// (gin's allocation: returned to the device's pool, see
/// [`LocalPart::new`]).
#[derive(Debug)]
pub struct LocalPart {
    /// First: removed from the region table before `mem` is freed.
    served: Option<(Arc<RegionTable>, u32)>,
    /// The part's bytes (never freed through this: gin's allocation is
    /// `block`'s, the user's memory is the user's).
    mem: DevMem,
    /// The IPC handle of the allocation `mem` lies in (zeros: not
    /// exported, no same-host peer maps it).
    ipc: [u8; 64],
    /// `mem`'s offset in that allocation.
    offset: u64,
    /// A VMM part: the mapping's size (see [`PartRecord::vmm`]).
    vmm: Option<u64>,
    /// A VMM part's descriptor, handed to same-host peers.
    fds: Option<FdExport>,
    /// A registered part's sharing (`None`: gin's allocation).
    share: Option<Sharing>,
    /// Last: gin's allocation, returned to the device's pool where
    /// `cuMemFree` used to free it (after the region's removal); `None`
    /// for the user's memory. Shared with the window's description
    /// (`MemParts::keep`): a put a transport still reads it for holds it.
    block: Option<Arc<PoolMem>>,
}

impl LocalPart {
    /// Allocates `bytes` of zeroed device memory on `dev` and, with
    /// `serve`, registers it in the region table, served by the staging
    /// server.
    ///
    /// The memory comes from `dev`'s pool: a freed part's allocation of the
    /// same size class (`bytes` rounded up to a multiple of 2 MiB) is
    /// reused, zeroed, with its IPC handle, so a peer's UCX never meets a
    /// new allocation at an address whose IPC mapping it cached (see
    /// docs/ucx.md, "CUDA ranks"). Only `bytes` are exposed ([`Self::mem`],
    /// the record's size). Dropping the part returns the allocation to the
    /// pool, which keeps at most 1 GiB idle and frees the rest, and frees
    /// all of it when the last holder of `dev` drops it.
    pub fn new(
        dev: &Device,
        bytes: u64,
        serve: Option<(&Arc<RegionTable>, &Arc<Server>)>,
    ) -> Result<Self, CudaError> {
        let block = dev.window_mem(bytes as usize)?;
        let ipc = block.ipc_handle()?;
        Self::serve(
            Self {
                served: None,
                mem: block.view(),
                ipc,
                offset: 0,
                vmm: None,
                fds: None,
                share: None,
                block: Some(Arc::new(block)),
            },
            bytes,
            serve,
        )
    }

    /// The user's `bytes` of device memory at `ptr` as rank `rank`'s part
    /// on `dev`: checked with the driver (this GPU's device memory, inside
    /// one allocation, and, where same-host peers map it (`host.peers`),
    /// exportable), exported by its allocation's IPC handle and its offset
    /// there, or, for VMM memory, by its allocation's POSIX file
    /// descriptor (whose socket is bound here and served from
    /// [`exchange`] on) and its offset in the mapping; and with `serve`
    /// registered in the region table. Dropping the part leaves the memory
    /// alone.
    ///
    /// # Safety
    /// `ptr` must be the start of `bytes` bytes of `dev`'s device memory
    /// that stay allocated until the part has dropped (and, once a window
    /// holds the part, until the window has been freed on every rank: peers
    /// write it until then).
    pub unsafe fn register(
        rank: usize,
        dev: &Device,
        ptr: u64,
        bytes: u64,
        host: SameHost,
        serve: Option<(&Arc<RegionTable>, &Arc<Server>)>,
    ) -> Result<Self, CudaError> {
        dev.make_current()?;
        let ipc = !host.peers.is_empty();
        let refuse = |why: String| CudaError::NotRegistrable {
            rank,
            ptr,
            bytes,
            why,
        };
        let facts = PointerFacts::query(ptr, ipc).map_err(|e| match unmeasured(&e) {
            Some(why) => refuse(why),
            None => e,
        })?;
        let export = facts
            .export(ptr, bytes, dev.ordinal(), ipc)
            .map_err(refuse)?;
        let (handle, fds) = match (ipc, export.vmm) {
            (false, _) => ([0; 64], None),
            (true, None) => (
                ipc_handle_of(export.base).map_err(|e| refuse(e.to_string()))?,
                None,
            ),
            (true, Some(_)) => {
                let fd = crate::vmm::export_fd(export.base).map_err(|e| refuse(e.to_string()))?;
                let l = FdListener::bind(&host.job, rank, host.window)?;
                ([0; 64], Some(FdExport::Bound(l, fd, host.peers.clone())))
            }
        };
        let len = usize::try_from(bytes).map_err(|_| refuse("too large".into()))?;
        // SAFETY: the caller's contract: `bytes` bytes of this GPU's device
        // memory (checked against the driver's account above) that outlive
        // the part.
        let mem = unsafe { DevMem::from_raw_parts(ptr, len) };
        Self::serve(
            Self {
                served: None,
                mem,
                ipc: handle,
                offset: export.offset,
                vmm: export.vmm,
                fds,
                share: Some(Sharing {
                    host,
                    ordinal: dev.ordinal(),
                }),
                block: None,
            },
            bytes,
            serve,
        )
    }

    /// `part`, registered in the region table with `serve`.
    fn serve(
        mut part: Self,
        bytes: u64,
        serve: Option<(&Arc<RegionTable>, &Arc<Server>)>,
    ) -> Result<Self, CudaError> {
        if let Some((table, server)) = serve {
            let ptr = part.mem.ptr();
            // SAFETY: `mem` holds `bytes` bytes of device memory, and the
            // region is removed from the table before `mem` is freed: by
            // this part's drop, which runs before its fields drop.
            let region = unsafe { GpuRegion::new(ptr, bytes, server.clone()) };
            let key = table.insert_backed(ptr, bytes, Arc::new(region))?;
            part.served = Some((table.clone(), key));
        }
        Ok(part)
    }

    /// The device memory.
    pub fn mem(&self) -> &DevMem {
        &self.mem
    }

    /// What keeps gin's allocation alive (`None` for the user's memory):
    /// the window's description hands it to transports that read the
    /// memory after the call that started the read returned (ucx's
    /// pipelined puts), so a wait that gives up on them leaves them
    /// holding it rather than the memory going back to the pool.
    pub fn keeper(&self) -> Option<KeepAlive> {
        self.block
            .as_ref()
            .map(|b| KeepAlive(b.clone() as Arc<dyn std::any::Any + Send + Sync>))
    }

    /// The record the other ranks learn this part by.
    pub fn record(&self) -> PartRecord {
        PartRecord {
            size: self.mem.len() as u64,
            addr: self.mem.ptr(),
            ipc: self.ipc,
            key: self.served.as_ref().map_or(0, |s| s.1),
            offset: self.offset,
            vmm: self.vmm,
        }
    }

    /// Starts handing a VMM part's descriptor to the same-host peers (a
    /// thread, until each has it, the job's timeout passes, or the part
    /// drops); nothing for other parts. Called once the offers are out.
    fn serve_descriptor(&mut self) -> Result<(), CudaError> {
        self.fds = match self.fds.take() {
            Some(FdExport::Bound(l, fd, peers)) => Some(FdExport::Serving {
                _server: FdServer::start(l, fd, peers)?,
            }),
            other => other,
        };
        Ok(())
    }

    /// Fetches rank `peer`'s VMM descriptor for window `window` (this
    /// part's) and maps its allocation here, whole (`rec.vmm` bytes, from
    /// its start); this is rank `rank`. The record's part must lie inside
    /// the mapping, checked before anything is fetched.
    fn import_vmm(
        &self,
        rank: usize,
        peer: usize,
        window: u32,
        rec: &PartRecord,
        mapped: u64,
    ) -> Result<VmmMapping, CudaError> {
        let open = |why: String| CudaError::VmmOpen {
            rank,
            peer,
            window,
            source: Box::new(CudaError::Unavailable { why }),
        };
        let Some(s) = &self.share else {
            return Err(open(
                "this rank's part is memory gin allocated, not registered memory: the ranks \
                 disagree on what kind of window this is"
                    .into(),
            ));
        };
        if s.host.window != window {
            return Err(open(format!(
                "this rank's part was registered for GPU window {}, not {window} (a bug)",
                s.host.window
            )));
        }
        if rec.size == 0
            || rec
                .offset
                .checked_add(rec.size)
                .is_none_or(|end| end > mapped)
        {
            return Err(open(format!(
                "its record puts {} bytes at offset {} of a {mapped}-byte VMM mapping, which \
                 does not hold them (ranks of different builds, or a corrupted record)",
                rec.size, rec.offset
            )));
        }
        let fd = crate::fdpass::fetch(&s.host.job, rank, window, peer)?;
        // The descriptor closes after the import, which holds the
        // allocation.
        VmmMapping::open(fd.as_fd(), mapped, s.ordinal).map_err(|e| CudaError::VmmOpen {
            rank,
            peer,
            window,
            source: Box::new(e),
        })
    }
}

impl Drop for LocalPart {
    fn drop(&mut self) {
        self.stop_serving();
        // The owner dropping the last hold frees at once what the pool lets
        // go of (a user freeing a window to make room expects the memory
        // back); a transport still holding it (a pipelined put) returns it
        // later, its frees left to an allocating thread.
        if let Some(block) = self.block.take()
            && let Ok(block) = Arc::try_unwrap(block)
        {
            block.release_now();
        }
    }
}

impl LocalPart {
    /// Stops serving the part over TCP and ucx; on a quarantined removal,
    /// marks gin's allocation to be leaked.
    fn stop_serving(&mut self) {
        // TCP peers' requests are refused ("unknown memory key") from now
        // on; the removal waits for a request being served.
        if let Some((t, key)) = &self.served
            && t.remove_region(*key, self.mem.ptr() as usize) == Removal::Quarantined
        {
            // A peer may still write the part (a ucx rkey whose revocation
            // was never acknowledged): gin's allocation is leaked, never
            // returned to the pool for another window; the user's memory is
            // the user's, who is told.
            if let Some(block) = &self.block {
                tracing::error!(
                    key,
                    "a peer may still write this GPU window part: its allocation is leaked, never reused"
                );
                block.quarantine();
            } else {
                tracing::error!(
                    key,
                    "a peer may still write this GPU window part, which is the caller's memory: do not reuse it before the job ends"
                );
            }
        }
    }
}

/// Every rank's part of a window as reached here, by rank.
#[derive(Debug)]
pub struct PeerParts {
    /// Each rank's size.
    pub sizes: Vec<u64>,
    /// Each rank's own device address of its part.
    pub addrs: Vec<u64>,
    /// Each part as reached here: mapped (device address), 0 over TCP.
    pub bases: Vec<u64>,
    /// Each rank's region key (0: not served over TCP).
    pub tcp_keys: Vec<u32>,
    /// The same-host peers' parts as mapped here, unmapped when this
    /// drops.
    pub opened: Vec<PeerMapping>,
}

/// A same-host peer's part mapped here, unmapped on drop.
#[derive(Debug)]
pub enum PeerMapping {
    /// Through legacy CUDA IPC (the peer's allocation's handle).
    Ipc(IpcMem),
    /// Imported from the peer's VMM allocation's file descriptor.
    Vmm(VmmMapping),
}

impl PeerMapping {
    /// The mapping's device address here (the peer's allocation's start).
    pub fn ptr(&self) -> u64 {
        match self {
            Self::Ipc(m) => m.ptr(),
            Self::Vmm(m) => m.ptr(),
        }
    }
}

impl PeerParts {
    /// Reaches each part of window `window` from every rank's record
    /// ([`Offer::gather`]): this rank's own (`local`), a peer `over_tcp` by
    /// its region key, any other by mapping its allocation (through CUDA
    /// IPC, or, for a VMM part, by importing the descriptor fetched from
    /// it), plus the part's offset in it.
    pub fn open(
        rank: usize,
        window: u32,
        local: &LocalPart,
        records: &[PartRecord],
        over_tcp: impl Fn(usize) -> bool,
    ) -> Result<Self, CudaError> {
        let n = records.len();
        let mut parts = Self {
            sizes: Vec::with_capacity(n),
            addrs: Vec::with_capacity(n),
            bases: Vec::with_capacity(n),
            tcp_keys: Vec::with_capacity(n),
            opened: Vec::new(),
        };
        for (peer, rec) in records.iter().enumerate() {
            parts.sizes.push(rec.size);
            parts.addrs.push(rec.addr);
            parts.tcp_keys.push(rec.key);
            if peer == rank {
                parts.bases.push(local.mem.ptr());
            } else if over_tcp(peer) {
                // Reached over TCP: no mapping; requests name `key`.
                if rec.key == 0 {
                    return Err(CudaError::NotServed { rank, peer, window });
                }
                parts.bases.push(0);
            } else {
                let (m, base) = Self::map(rank, window, peer, local, rec)?;
                parts.bases.push(base);
                parts.opened.push(m);
            }
        }
        Ok(parts)
    }
}

impl PeerParts {
    /// Maps same-host rank `peer`'s part of window `window` here (this is
    /// rank `rank`): the mapping, and the part's address in it.
    fn map(
        rank: usize,
        window: u32,
        peer: usize,
        local: &LocalPart,
        rec: &PartRecord,
    ) -> Result<(PeerMapping, u64), CudaError> {
        let m = match rec.vmm {
            Some(mapped) => PeerMapping::Vmm(local.import_vmm(rank, peer, window, rec, mapped)?),
            None => PeerMapping::Ipc(IpcMem::open(&rec.ipc).map_err(|e| CudaError::IpcOpen {
                rank,
                peer,
                window,
                source: Box::new(e),
            })?),
        };
        // The VMM record was checked against its mapping; an IPC record's
        // offset at least stays in the address space.
        let Some(base) = m.ptr().checked_add(rec.offset) else {
            let source = Box::new(CudaError::Unavailable {
                why: format!(
                    "its offset {} past the mapping at {:#x} is beyond the address space",
                    rec.offset,
                    m.ptr()
                ),
            });
            return Err(match m {
                PeerMapping::Vmm(_) => CudaError::VmmOpen {
                    rank,
                    peer,
                    window,
                    source,
                },
                PeerMapping::Ipc(_) => CudaError::IpcOpen {
                    rank,
                    peer,
                    window,
                    source,
                },
            });
        };
        Ok((m, base))
    }
}

/// Tells every rank what this rank contributes to window `window` (its
/// part, or why it has none: `local`'s error) through `allgather`, starts
/// handing a VMM part's descriptor to same-host peers, and reaches every
/// rank's part ([`PeerParts::open`]). Where any rank has no part, every
/// rank fails naming it (this rank with its own error first).
pub fn exchange<E: From<CudaError>>(
    rank: usize,
    window: u32,
    local: Result<LocalPart, CudaError>,
    allgather: impl FnOnce(&[u8]) -> Result<Vec<Vec<u8>>, E>,
    over_tcp: impl Fn(usize) -> bool,
) -> Result<(LocalPart, PeerParts), E> {
    let offer = match &local {
        Ok(part) => Offer::Part(part.record()),
        Err(e) => Offer::Refused(e.to_string()),
    };
    let all = allgather(&offer.encode())?;
    let records = Offer::gather(rank, window, &all);
    let mut local = local?;
    let records = records?;
    // Every rank serves before it fetches, so none waits on another's
    // fetch.
    local.serve_descriptor()?;
    let parts = PeerParts::open(rank, window, &local, &records, over_tcp)?;
    Ok((local, parts))
}

/// A GPU window's parts, listed in the fabric's window directory as
/// `Memory::Device` while this lives, with the memory the entry describes:
/// this rank's part and the peers' IPC mappings. Dropping it unlists the
/// window first, so the proxy and the soft NIC refuse requests naming it
/// ("unknown window") rather than execute them on freed memory; then the
/// part leaves the region table (TCP peers' requests are refused) and the
/// memory is freed and unmapped.
#[derive(Debug)]
pub struct Listed {
    fabric: Arc<Fabric>,
    id: u32,
    local: LocalPart,
    _peers: Vec<PeerMapping>,
}

impl Listed {
    /// Lists window `id`'s parts in `fabric`'s directory.
    ///
    /// # Safety
    /// `parts` must be what [`PeerParts::open`] (or [`exchange`]) made for
    /// `local`, unchanged: the directory entry describes its bases and
    /// sizes, which the CUDA engines copy to and from.
    pub unsafe fn new(fabric: &Arc<Fabric>, id: u32, local: LocalPart, parts: PeerParts) -> Self {
        let n = parts.sizes.len();
        let desc = MemParts {
            memory: Memory::Device,
            local_base: local.mem().ptr() as usize,
            sizes: parts.sizes,
            peer_bases: parts.bases.iter().map(|&b| b as usize).collect(),
            keys: parts.tcp_keys,
            addrs: parts.addrs,
            states: vec![0; n],
            keep: local.keeper(),
        };
        // SAFETY: device memory: `local` is this rank's part and each
        // non-zero peer base a mapping of that peer's part (CUDA IPC or
        // VMM; its size), both held here until the description is removed from the
        // directory (drop). Nothing on the host dereferences them
        // (`Memory::Device`); the CUDA engines that copy them are stopped,
        // or told to flush, before a window is freed: the peers' mappings
        // go after that (`cuIpcCloseMemHandle`, or `cuMemUnmap` for a VMM
        // import, both of which fault a copy still running on them).
        fabric.add_window(id, unsafe { MemDesc::new(desc) });
        Self {
            fabric: fabric.clone(),
            id,
            local,
            _peers: parts.opened,
        }
    }

    /// This rank's part.
    pub fn local(&self) -> &LocalPart {
        &self.local
    }
}

impl Drop for Listed {
    fn drop(&mut self) {
        // Before the memory goes (then `local`'s drop removes the part
        // from the region table, before its memory is freed).
        self.fabric.remove_window(self.id);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_part_record_round_trips_in_the_layout_ranks_exchange() {
        let r = PartRecord {
            size: 0x0102_0304_0506_0708,
            addr: 0x7f00_0000_1000,
            ipc: std::array::from_fn(|i| i as u8 ^ 0xa5),
            key: 0xfeed_beef,
            offset: 0x0000_0000_0040_1000,
            vmm: None,
        };
        let b = r.encode();
        // The layout older builds sent by hand: size, address, handle, key;
        // then the offset of a registered range in its allocation; then
        // the VMM mapping's size (0: the IPC handle is the export).
        assert_eq!(b[..8], r.size.to_le_bytes());
        assert_eq!(b[8..16], r.addr.to_le_bytes());
        assert_eq!(b[16..80], r.ipc);
        assert_eq!(b[80..84], r.key.to_le_bytes());
        assert_eq!(b[84..92], r.offset.to_le_bytes());
        assert_eq!(b[92..], [0; 8]);
        assert_eq!(PartRecord::decode(3, 9, &b).unwrap(), r);
        // A VMM part: its mapping's size, no IPC handle.
        let v = PartRecord {
            ipc: [0; 64],
            vmm: Some(4 << 20),
            ..r
        };
        let b = v.encode();
        assert_eq!(b[92..], (4u64 << 20).to_le_bytes());
        assert_eq!(PartRecord::decode(3, 9, &b).unwrap(), v);
    }

    #[test]
    fn a_malformed_part_record_names_the_rank_and_window() {
        let b = [0u8; 80];
        let e = PartRecord::decode(3, 9, &b).unwrap_err();
        assert!(
            matches!(
                &e,
                CudaError::Record(gin_bootstrap::record::Malformed {
                    rank: 3,
                    got: 80,
                    expected: 100,
                    ..
                })
            ),
            "{e}"
        );
        assert_eq!(
            e.to_string(),
            "rank 3 sent a malformed GPU window 9 record (80 bytes, expected 100)"
        );
        assert!(PartRecord::decode(0, 0, &[0u8; 101]).is_err());
        // The record of a build without offsets (84 bytes), or without VMM
        // exports (92), is refused too.
        assert!(PartRecord::decode(0, 0, &[0u8; 84]).is_err());
        assert!(PartRecord::decode(0, 0, &[0u8; 92]).is_err());
    }

    fn record(offset: u64) -> PartRecord {
        PartRecord {
            size: 4096,
            addr: 0x7f00_0000_0000 + offset,
            ipc: [7; 64],
            key: 0,
            offset,
            vmm: None,
        }
    }

    #[test]
    fn offers_round_trip_and_every_rank_learns_the_first_refusal() {
        let part = Offer::Part(record(0x100));
        let no = Offer::Refused("rank 1 cannot register 4096 bytes at 0x10: managed".into());
        for o in [&part, &no] {
            assert_eq!(&Offer::decode(0, 4, &o.encode()).unwrap(), o);
        }
        let all = vec![part.encode(), Offer::Part(record(0)).encode()];
        let recs = Offer::gather(0, 4, &all).unwrap();
        assert_eq!((recs[0].offset, recs[1].offset), (0x100, 0));
        // Rank 1 refused: ranks 0 and 2 both fail, naming it and its reason.
        let all = vec![
            part.encode(),
            no.encode(),
            Offer::Refused("later".into()).encode(),
        ];
        for me in [0, 2] {
            let e = Offer::gather(me, 4, &all).unwrap_err();
            assert!(
                matches!(&e, CudaError::WindowRefused { rank, window: 4, peer: 1, why }
                    if *rank == me && why.contains("managed")),
                "{e}"
            );
            assert!(e.to_string().contains(&format!(
                "GPU window 4 was not created on rank {me}: rank 1 refused"
            )));
        }
    }

    /// A rank without a part tells the others why, and fails with its own
    /// error rather than the refusal it reads back.
    #[test]
    fn a_rank_without_a_part_offers_its_refusal_and_fails_with_its_own_error() {
        let mut sent = None;
        let e = exchange(
            0,
            4,
            Err(CudaError::Unavailable {
                why: "no GPU".into(),
            }),
            |mine: &[u8]| -> Result<_, CudaError> {
                sent = Some(Offer::decode(0, 4, mine)?);
                Ok(vec![mine.to_vec(), Offer::Part(record(0)).encode()])
            },
            |_| true,
        )
        .unwrap_err();
        assert!(matches!(e, CudaError::Unavailable { .. }), "{e}");
        assert!(
            matches!(&sent, Some(Offer::Refused(why)) if why.contains("no GPU")),
            "{sent:?}"
        );
    }

    #[test]
    fn a_malformed_offer_names_the_rank_and_window() {
        for b in [&[][..], &[2u8, 0, 0][..], &[0u8; 10][..]] {
            let e = Offer::decode(5, 6, b).unwrap_err();
            assert!(e.to_string().contains("rank 5"), "{e}");
            assert!(e.to_string().contains("GPU window 6"), "{e}");
        }
    }

    /// A job of its own for each test (socket names are host-wide).
    fn job(timeout_ms: u64) -> FdJob {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let mut tag = [0xee; 8];
        tag[..4].copy_from_slice(&std::process::id().to_le_bytes());
        tag[4..6].copy_from_slice(
            &(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) as u16).to_le_bytes(),
        );
        FdJob::from_tokens(tag, [3; 32], std::time::Duration::from_millis(timeout_ms))
            .with_pids(vec![Some(std::process::id()); 4])
    }

    /// A memfd standing in for a VMM allocation's descriptor.
    fn memfd(bytes: &[u8]) -> OwnedFd {
        use std::io::Write;
        use std::os::fd::FromRawFd;
        // SAFETY: a NUL-terminated name; the result is checked.
        let fd = unsafe { libc::memfd_create(c"gin-window-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a new descriptor owned here.
        let mut f = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        f.write_all(bytes).unwrap();
        f.into()
    }

    /// Rank `rank`'s registered VMM part of window `window`, shared with
    /// `peers`, its descriptor (a memfd) bound but not served yet. Its
    /// memory is never touched: nothing here calls the driver, and drop
    /// leaves it alone.
    fn vmm_part(rank: usize, window: u32, peers: Vec<usize>, job: &FdJob) -> LocalPart {
        LocalPart {
            served: None,
            // SAFETY: never dereferenced (see above).
            mem: unsafe { DevMem::from_raw_parts(0x7e00_0000_1000, 4096) },
            ipc: [0; 64],
            offset: 0x1000,
            vmm: Some(2 << 20),
            fds: Some(FdExport::Bound(
                FdListener::bind(job, rank, window).unwrap(),
                memfd(b"vmm"),
                peers.clone(),
            )),
            share: Some(Sharing {
                host: SameHost {
                    window,
                    peers,
                    job: job.clone(),
                },
                ordinal: 0,
            }),
            block: None,
        }
    }

    #[test]
    fn a_vmm_part_records_its_mapping_and_serves_its_descriptor_once_the_offers_are_out() {
        let job = job(60_000);
        let mut part = vmm_part(0, 3, vec![1], &job);
        let r = part.record();
        assert_eq!((r.vmm, r.offset, r.ipc), (Some(2 << 20), 0x1000, [0; 64]));
        // Bound, not served: a fetch now would wait in the backlog.
        assert!(matches!(part.fds, Some(FdExport::Bound(..))));
        part.serve_descriptor().unwrap();
        assert!(matches!(part.fds, Some(FdExport::Serving { .. })));
        // Serving twice changes nothing.
        part.serve_descriptor().unwrap();
        let fd = crate::fdpass::fetch(&job, 1, 3, 0).unwrap();
        let mut b = [0u8; 3];
        std::os::unix::fs::FileExt::read_exact_at(&std::fs::File::from(fd), &mut b, 0).unwrap();
        assert_eq!(&b, b"vmm");
    }

    /// Whether `e` is what importing a memfd as a VMM allocation fails
    /// with: CUDA's absence here, or, with a GPU, the driver refusing it.
    fn import_refused(e: &CudaError) -> bool {
        match e {
            CudaError::Unavailable { why } => {
                crate::available().is_err_and(|a| a.to_string().ends_with(why.as_str()))
            }
            CudaError::Driver(d) => d.call == "cuMemImportFromShareableHandle",
            _ => false,
        }
    }

    /// A same-host peer's VMM record makes this rank fetch its descriptor
    /// (from the peer's socket: the server sees its one peer served), then
    /// try the import, which a memfd fails, naming rank, peer and window.
    #[test]
    fn a_peers_vmm_record_is_fetched_from_its_socket_before_the_import_is_tried() {
        let job = job(60_000);
        let server =
            FdServer::start(FdListener::bind(&job, 0, 5).unwrap(), memfd(b"x"), [1]).unwrap();
        let local = vmm_part(1, 5, vec![0], &job);
        let peer = PartRecord {
            vmm: Some(2 << 20),
            ipc: [0; 64],
            ..record(0x2000)
        };
        let e = PeerParts::open(1, 5, &local, &[peer, local.record()], |_| false).unwrap_err();
        assert!(
            matches!(
                &e,
                CudaError::VmmOpen {
                    rank: 1,
                    peer: 0,
                    window: 5,
                    source,
                } if import_refused(source)
            ),
            "{e}"
        );
        assert!(
            e.to_string()
                .starts_with("rank 1 cannot map GPU window 5 of rank 0 from its VMM export"),
            "{e}"
        );
        // The fetch came first: the server's one peer has the descriptor.
        server.wait().unwrap();
        // A peer over TCP is reached by its key: nothing is fetched.
        let tcp = PartRecord { key: 9, ..peer };
        let parts = PeerParts::open(1, 5, &local, &[tcp, local.record()], |p| p == 0).unwrap();
        assert_eq!((parts.bases[0], parts.opened.len()), (0, 0));
    }

    /// A VMM record whose part does not lie inside the mapping it names
    /// (engines would write past it) is refused before anything is
    /// fetched (no server listens here: a fetch would fail otherwise).
    #[test]
    fn a_vmm_record_whose_part_lies_outside_its_mapping_is_refused() {
        let job = job(60_000);
        let local = vmm_part(1, 21, vec![0], &job);
        let bad = [
            (4096, (2 << 20) - 4095),
            (2 << 20, 1),
            (4096, u64::MAX - 100),
            (0, 0),
        ];
        for (size, offset) in bad {
            let peer = PartRecord {
                vmm: Some(2 << 20),
                size,
                offset,
                ..record(0)
            };
            let e = PeerParts::open(1, 21, &local, &[peer, local.record()], |_| false).unwrap_err();
            assert!(
                matches!(
                    &e,
                    CudaError::VmmOpen {
                        rank: 1,
                        peer: 0,
                        window: 21,
                        ..
                    }
                ),
                "{size} at {offset}: {e}"
            );
            assert!(
                e.to_string().contains(&format!(
                    "its record puts {size} bytes at offset {offset} of a 2097152-byte VMM \
                     mapping, which does not hold them"
                )),
                "{e}"
            );
        }
        // The last byte of the mapping is fine: the fetch is tried (and
        // fails, nobody serving).
        let edge = PartRecord {
            vmm: Some(2 << 20),
            size: 4096,
            offset: (2 << 20) - 4096,
            ..record(0)
        };
        let e = PeerParts::open(1, 21, &local, &[edge, local.record()], |_| false).unwrap_err();
        assert!(matches!(&e, CudaError::FdPass(_)), "{e}");
    }

    /// Ranks that disagree on the window's id are told so, under the id
    /// being created (not a placeholder).
    #[test]
    fn a_part_registered_for_another_window_is_refused_under_the_real_id() {
        let job = job(60_000);
        let local = vmm_part(1, 22, vec![0], &job);
        let peer = PartRecord {
            vmm: Some(2 << 20),
            ..record(0)
        };
        let e = PeerParts::open(1, 23, &local, &[peer, local.record()], |_| false).unwrap_err();
        assert!(
            matches!(
                &e,
                CudaError::VmmOpen {
                    rank: 1,
                    peer: 0,
                    window: 23,
                    ..
                }
            ) && e
                .to_string()
                .contains("registered for GPU window 22, not 23"),
            "{e}"
        );
    }

    /// Two ranks as threads, each with a VMM part (a memfd), run the whole
    /// exchange: each serves its descriptor before it fetches the other's,
    /// so both fetches succeed at once and both fail at the import (of a
    /// memfd), well before the job's timeout. Fetching first would
    /// deadlock the two until it.
    #[test]
    fn every_rank_serves_its_descriptor_before_it_fetches_a_peers() {
        use std::sync::{Barrier, Mutex};
        let job = job(120_000);
        let slots = Mutex::new(vec![Vec::new(); 2]);
        let barrier = Barrier::new(2);
        let started = std::time::Instant::now();
        let results: Vec<_> = std::thread::scope(|s| {
            let ranks: Vec<_> = (0..2)
                .map(|rank| {
                    let (job, slots, barrier) = (&job, &slots, &barrier);
                    s.spawn(move || {
                        let part = vmm_part(rank, 24, vec![1 - rank], job);
                        let allgather = |mine: &[u8]| -> Result<_, CudaError> {
                            slots.lock().unwrap()[rank] = mine.to_vec();
                            barrier.wait();
                            let all = slots.lock().unwrap().clone();
                            Ok(all)
                        };
                        exchange(rank, 24, Ok(part), allgather, |_| false).map(drop)
                    })
                })
                .collect();
            ranks.into_iter().map(|t| t.join().unwrap()).collect()
        });
        // A rank whose import failed returns at once and drops its part,
        // which stops its server: a peer still fetching from it then
        // finds it gone (its own registration fails either way). At least
        // the first to fetch got the descriptor and failed at the import.
        let mut imported = 0;
        for (rank, r) in results.iter().enumerate() {
            let e = r.as_ref().unwrap_err();
            let at_import = matches!(e, CudaError::VmmOpen { rank: r, peer, window: 24, source }
                    if *r == rank && *peer == 1 - rank && import_refused(source));
            let peer_gone = matches!(e, CudaError::FdPass(crate::fdpass::FdPassError::Gone { rank: r, peer, window: 24, .. })
                    if *r == rank && *peer == 1 - rank);
            assert!(at_import || peer_gone, "rank {rank}: {e}");
            imported += usize::from(at_import);
        }
        assert!(
            imported >= 1,
            "neither rank fetched a descriptor: {results:?}"
        );
        assert!(started.elapsed() < job.timeout() / 4);
    }

    #[test]
    fn a_vmm_peer_that_does_not_serve_its_descriptor_is_named() {
        let job = job(60_000);
        let local = vmm_part(1, 6, vec![0], &job);
        let peer = PartRecord {
            vmm: Some(2 << 20),
            ..record(0)
        };
        let e = PeerParts::open(1, 6, &local, &[peer, local.record()], |_| false).unwrap_err();
        assert!(
            matches!(
                &e,
                CudaError::FdPass(crate::fdpass::FdPassError::Gone {
                    rank: 1,
                    peer: 0,
                    window: 6,
                    ..
                })
            ),
            "{e}"
        );
    }

    /// A window of gin's memory has no VMM parts: a peer's VMM record there
    /// means the ranks disagree, said as such.
    #[test]
    fn a_vmm_record_beside_gins_own_memory_is_an_error() {
        let mut local = vmm_part(1, 7, vec![0], &job(60_000));
        local.share = None;
        let peer = PartRecord {
            vmm: Some(2 << 20),
            ..record(0)
        };
        let e = PeerParts::open(1, 7, &local, &[peer, local.record()], |_| false).unwrap_err();
        assert!(
            matches!(
                &e,
                CudaError::VmmOpen {
                    rank: 1,
                    peer: 0,
                    ..
                }
            ) && e.to_string().contains("the ranks disagree"),
            "{e}"
        );
    }
}
