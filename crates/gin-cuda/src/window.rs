//! The CUDA half of a GPU window: this rank's part in device memory,
//! exported for CUDA IPC and served to TCP peers from the region table,
//! the record it tells the other ranks, and the peers' parts as reached
//! here (mapped through CUDA IPC, or named by region key over TCP).
//!
//! What a window means to the device API (ids, NIC keys, the arrays a
//! kernel indexes, the fabric's directory entry) is gin-core's: it
//! allgathers the records and assembles the window from a [`LocalPart`]
//! and [`PeerParts`].

use std::sync::Arc;

use gin_bootstrap::record::{Reader, Writer};
use gin_net::region::RegionTable;

use crate::driver::{DevMem, Device, IpcMem};
use crate::error::CudaError;
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
}

impl PartRecord {
    /// Encoded length: size, address (u64 LE each), the IPC handle, the
    /// key (u32 LE).
    pub const LEN: usize = 84;

    /// The bytes ranks exchange.
    pub fn encode(&self) -> Vec<u8> {
        Writer::new()
            .u64(self.size)
            .u64(self.addr)
            .bytes(&self.ipc)
            .u32(self.key)
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
        })
    }
}

/// This rank's part of a GPU window: device memory, its IPC handle, and
/// (where some peer is reached over TCP) its registration in the region
/// table, removed again when the part drops, before the memory is freed.
#[derive(Debug)]
pub struct LocalPart {
    /// First: removed from the region table before `mem` is freed.
    served: Option<(Arc<RegionTable>, u32)>,
    mem: DevMem,
    ipc: [u8; 64],
}

impl LocalPart {
    /// Allocates `bytes` of device memory on `dev` and, with `serve`,
    /// registers it in the region table, served by the staging server.
    pub fn new(
        dev: &Device,
        bytes: u64,
        serve: Option<(&Arc<RegionTable>, &Arc<Server>)>,
    ) -> Result<Self, CudaError> {
        dev.make_current()?;
        let mem = DevMem::new(bytes as usize)?;
        let ipc = mem.ipc_handle()?;
        let mut part = Self {
            served: None,
            mem,
            ipc,
        };
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

    /// The record the other ranks learn this part by.
    pub fn record(&self) -> PartRecord {
        PartRecord {
            size: self.mem.len() as u64,
            addr: self.mem.ptr(),
            ipc: self.ipc,
            key: self.served.as_ref().map_or(0, |s| s.1),
        }
    }
}

impl Drop for LocalPart {
    fn drop(&mut self) {
        // TCP peers' requests are refused ("unknown memory key") from now
        // on; the removal waits for a request being served.
        if let Some((t, key)) = &self.served {
            t.remove_region(*key, self.mem.ptr() as usize);
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
    /// Decodes every rank's record of window `window` and reaches each
    /// part: this rank's own (`local`), a peer `over_tcp` by its region
    /// key, any other by mapping it through CUDA IPC.
    pub fn open(
        rank: usize,
        window: u32,
        local: &LocalPart,
        records: &[Vec<u8>],
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
            let rec = PartRecord::decode(peer, window, rec)?;
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
                parts.bases.push(m.ptr());
                parts.opened.push(m);
            }
        }
        Ok(parts)
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
        };
        let b = r.encode();
        // The layout older builds sent by hand: size, address, handle, key.
        assert_eq!(b[..8], r.size.to_le_bytes());
        assert_eq!(b[8..16], r.addr.to_le_bytes());
        assert_eq!(b[16..80], r.ipc);
        assert_eq!(b[80..], r.key.to_le_bytes());
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
                    expected: 84,
                    ..
                })
            ),
            "{e}"
        );
        assert_eq!(
            e.to_string(),
            "rank 3 sent a malformed GPU window 9 record (80 bytes, expected 84)"
        );
        assert!(PartRecord::decode(0, 0, &[0u8; 85]).is_err());
    }
}
