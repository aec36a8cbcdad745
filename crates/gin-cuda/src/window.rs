//! The CUDA half of a GPU window: this rank's part in device memory,
//! exported for CUDA IPC and served to TCP peers from the region table,
//! the record it tells the other ranks, and the peers' parts as reached
//! here (mapped through CUDA IPC, or named by region key over TCP).
//!
//! Ranks exchange offers ([`exchange`]), and a window's parts are listed
//! in the fabric's window directory as `Memory::Device` while they live
//! ([`Listed`]), which the CUDA engines resolve requests against. What a
//! window means to the device API (ids, NIC keys, the arrays a kernel
//! indexes) is gin-core's: it assembles the window from a [`LocalPart`]
//! and [`PeerParts`].

use std::sync::Arc;

use gin_bootstrap::record::{Reader, Writer};
use gin_net::region::{RegionTable, Removal};
use gin_net::{Fabric, KeepAlive, MemDesc, MemParts, Memory};

use crate::driver::{DevMem, Device, IpcMem, PoolMem};
use crate::error::CudaError;
use crate::pointer::{PointerFacts, ipc_handle_of};
use crate::staging::{GpuRegion, Server};

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
    /// Its offset in the allocation the IPC handle exports (0 for memory
    /// gin allocated; a registered range may start inside an allocation).
    pub offset: u64,
}

impl PartRecord {
    /// Encoded length: size, address (u64 LE each), the IPC handle, the
    /// key (u32 LE), the offset (u64 LE).
    pub const LEN: usize = 92;

    /// The bytes ranks exchange.
    pub fn encode(&self) -> Vec<u8> {
        Writer::new()
            .u64(self.size)
            .u64(self.addr)
            .bytes(&self.ipc)
            .u32(self.key)
            .u64(self.offset)
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
                block: Some(Arc::new(block)),
            },
            bytes,
            serve,
        )
    }

    /// The user's `bytes` of device memory at `ptr` as rank `rank`'s part
    /// on `dev`: checked with the driver (this GPU's device memory, inside
    /// one allocation, and exportable through CUDA IPC where `ipc`: a
    /// same-host peer maps it), exported by its allocation's IPC handle and
    /// its offset there, and with `serve` registered in the region table.
    /// Dropping the part leaves the memory alone.
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
        ipc: bool,
        serve: Option<(&Arc<RegionTable>, &Arc<Server>)>,
    ) -> Result<Self, CudaError> {
        dev.make_current()?;
        let refuse = |why: String| CudaError::NotRegistrable {
            rank,
            ptr,
            bytes,
            why,
        };
        let facts = PointerFacts::query(ptr)?;
        let export = facts
            .export(ptr, bytes, dev.ordinal(), ipc)
            .map_err(refuse)?;
        let handle = if ipc {
            ipc_handle_of(export.base).map_err(|e| refuse(e.to_string()))?
        } else {
            [0; 64]
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
        }
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
    /// The IPC mappings, unmapped when this drops.
    pub opened: Vec<IpcMem>,
}

impl PeerParts {
    /// Reaches each part of window `window` from every rank's record
    /// ([`Offer::gather`]): this rank's own (`local`), a peer `over_tcp` by
    /// its region key, any other by mapping it through CUDA IPC (the
    /// allocation, plus the part's offset in it).
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
                let m = IpcMem::open(&rec.ipc).map_err(|e| CudaError::IpcOpen {
                    rank,
                    peer,
                    window,
                    source: Box::new(e),
                })?;
                parts.bases.push(m.ptr() + rec.offset);
                parts.opened.push(m);
            }
        }
        Ok(parts)
    }
}

/// Tells every rank what this rank contributes to window `window` (its
/// part, or why it has none: `local`'s error) through `allgather`, and
/// reaches every rank's part ([`PeerParts::open`]). Where any rank has no
/// part, every rank fails naming it (this rank with its own error first).
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
    let local = local?;
    let records = records?;
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
    _peers: Vec<IpcMem>,
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
        // non-zero peer base a CUDA IPC mapping of that peer's part (its
        // size), both held here until the description is removed from the
        // directory (drop). Nothing on the host dereferences them
        // (`Memory::Device`); the CUDA engines that copy them are stopped,
        // or told to flush, before a window is freed.
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
        };
        let b = r.encode();
        // The layout older builds sent by hand: size, address, handle, key;
        // then the offset of a registered range in its allocation.
        assert_eq!(b[..8], r.size.to_le_bytes());
        assert_eq!(b[8..16], r.addr.to_le_bytes());
        assert_eq!(b[16..80], r.ipc);
        assert_eq!(b[80..84], r.key.to_le_bytes());
        assert_eq!(b[84..], r.offset.to_le_bytes());
        assert_eq!(PartRecord::decode(3, 9, &b).unwrap(), r);
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
                    expected: 92,
                    ..
                })
            ),
            "{e}"
        );
        assert_eq!(
            e.to_string(),
            "rank 3 sent a malformed GPU window 9 record (80 bytes, expected 92)"
        );
        assert!(PartRecord::decode(0, 0, &[0u8; 93]).is_err());
        // The record of a build without offsets (84 bytes) is refused too.
        assert!(PartRecord::decode(0, 0, &[0u8; 84]).is_err());
    }

    fn record(offset: u64) -> PartRecord {
        PartRecord {
            size: 4096,
            addr: 0x7f00_0000_0000 + offset,
            ipc: [7; 64],
            key: 0,
            offset,
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
}
