//! Host windows on one rank, from memory to directory entry: the shared
//! segment a window's part lives in (named per job, window and rank, its
//! name removed as soon as every same-host peer mapped it), the exchange of
//! [`PartRecord`]s between ranks, and the window's entry in the fabric's
//! directory, kept with what keeps its memory mapped ([`HostWindow`]).
//!
//! The collective steps (an allgather, a barrier) are the caller's, handed
//! in as closures, so its errors stay its own and it decides what the
//! collective is. The window's id, the communicator it belongs to and the
//! handle users hold are gin-core's. The steps [`HostWindows::alloc`] and
//! [`HostWindows::register`] compose ([`HostWindows::create`],
//! [`LocalPart::record`], [`HostWindows::open`], [`HostWindows::list`]) are
//! public too, so tests run several ranks in one thread.

use std::any::Any;
use std::fmt::Write as _;
use std::sync::Arc;

use tracing::debug;

use crate::part::{HostParts, PartRecord, Registration};
use crate::region::{Access, Removal};
use crate::shm::{Segment, shm_dir};
use crate::{Fabric, HostMemory, KeepAlive, MemDesc, MemParts, Memory, NetError, Reach};

/// What one rank needs to make host windows: the fabric whose directory
/// lists them (and whose region table serves them to keyed peers), every
/// rank's host, and the job's tag in segment names.
#[derive(Debug)]
pub struct HostWindows {
    fabric: Arc<Fabric>,
    /// Host index of every rank (ranks with equal indices share a host).
    hosts: Vec<usize>,
    /// Job-unique: names of different jobs' segments never collide.
    tag: String,
}

/// This rank's part of a window, served to keyed peers under its key,
/// before the exchange: the memory (a segment gin-net created, or the
/// caller's), its region key and the [`Registration`] that stops serving it.
#[derive(Debug)]
pub struct LocalPart {
    /// Declared before `segment`, so dropped before it: the part stops
    /// being served before its memory goes.
    registration: Registration,
    /// The segment the part lives in (`None`: user memory, or memory a
    /// transport allocated).
    segment: Option<Segment>,
    /// Memory a transport allocated for the part (no peer maps it).
    allocated: Option<HostMemory>,
    id: u32,
    base: usize,
    bytes: u64,
    key: u32,
}

impl LocalPart {
    /// The window's id.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// What this rank tells the others about its part.
    pub fn record(&self) -> Vec<u8> {
        let path = self
            .segment
            .as_ref()
            .map(|s| s.path().to_string_lossy().into_owned())
            .unwrap_or_default();
        PartRecord {
            size: self.bytes,
            key: self.key,
            addr: self.base as u64,
            shared: self.segment.is_some(),
            segment: &path,
        }
        .encode()
    }

    /// Removes the segment's name (peers that mapped it keep their
    /// mapping).
    fn unlink(&mut self) {
        if let Some(s) = &mut self.segment {
            s.unlink();
        }
    }
}

/// What keeps a window's memory alive. Fields drop in order: the
/// registration goes first, so peers stop being served before the memory
/// goes; the mappings themselves are shared with the fabric's description,
/// so an operation of this rank's proxy or NIC that looked the window up
/// before the drop finishes on mapped memory.
#[derive(Debug)]
struct WindowMemory {
    _registration: Registration,
    _mapped: Arc<Mapped>,
}

/// A window's mappings: this rank's segment (none for user memory) and the
/// same-host peers' segments mapped here.
#[derive(Debug)]
struct Mapped {
    _own: Option<Segment>,
    _allocated: Option<HostMemory>,
    _peers: Vec<Segment>,
}

/// A host window listed in the fabric's directory: its parts as the
/// directory describes them, and what keeps them. Dropping it (or the
/// keeper [`HostWindow::into_parts`] hands out) revokes this rank's part,
/// unlists the window and stops serving the part, then unmaps the memory
/// once no description of it is left.
#[derive(Debug)]
pub struct HostWindow {
    id: u32,
    parts: MemParts,
    memory: WindowMemory,
}

impl HostWindow {
    /// The window's id.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// Every rank's part, as the directory lists it.
    pub fn parts(&self) -> &MemParts {
        &self.parts
    }

    /// The parts and what keeps them: their addresses stay valid while the
    /// keeper lives, and dropping it does what dropping the window does.
    pub fn into_parts(self) -> (MemParts, Box<dyn Any + Send + Sync>) {
        (self.parts, Box::new(self.memory))
    }
}

impl HostWindows {
    /// Host windows on `fabric`'s rank; `hosts` gives every rank's host
    /// index, `token` a job-unique token (its first six bytes tag segment
    /// names).
    pub fn new(fabric: Arc<Fabric>, hosts: Vec<usize>, token: &[u8]) -> Self {
        let tag = token.iter().take(6).fold(String::new(), |mut t, x| {
            let _ = write!(t, "{x:02x}");
            t
        });
        Self { fabric, hosts, tag }
    }

    fn rank(&self) -> usize {
        self.fabric.rank()
    }

    /// The name of `rank`'s segment for window `id`.
    pub fn segment_name(&self, rank: usize, id: u32) -> String {
        format!("gin-{}-r{rank}-w{id}", self.tag)
    }

    /// Removes every same-host rank's segment name for window `id`. Each
    /// creator removes its own once the registration is over, but a creator
    /// killed before that (SIGKILL runs no destructor) would leave its file
    /// in `GIN_SHM_DIR` for good: every survivor removes the names too,
    /// after the barrier (nobody needs them then) or when the registration
    /// failed (it cannot complete anywhere). Names are per job and window,
    /// so this never touches another job's or window's segment.
    pub fn remove_segment_names(&self, id: u32) {
        let dir = shm_dir();
        let rank = self.rank();
        let Some(&here) = self.hosts.get(rank) else {
            return;
        };
        for p in (0..self.hosts.len()).filter(|&p| p != rank && self.hosts[p] == here) {
            let _ = std::fs::remove_file(dir.join(self.segment_name(p, id)));
        }
    }

    /// Peers whose window parts this rank maps (same-host peers on the
    /// shm path).
    pub fn mapped_peers(&self) -> Vec<usize> {
        (0..self.fabric.nranks())
            .filter(|&p| p != self.rank() && self.fabric.reach(p) == Some(Reach::Mapped))
            .collect()
    }

    /// This rank's part of window `id`: `bytes` in a new shared segment
    /// same-host peers can map, served to keyed peers; where no peer maps
    /// it and a transport allocates host memory of its own
    /// ([`Fabric::alloc_host`]: ucx), in that memory instead.
    pub fn create(&self, id: u32, bytes: u64) -> Result<LocalPart, NetError> {
        if self.mapped_peers().is_empty()
            && let Ok(len) = usize::try_from(bytes)
            && let Some(mem) = self.fabric.alloc_host(len)
        {
            let mem = mem?;
            // SAFETY: the memory stays valid until `mem` drops, after the
            // registration on every path (the part's and the window's
            // fields drop in that order).
            let key = unsafe {
                self.fabric
                    .table()
                    .insert(mem.as_ptr(), bytes, Access::ALL)?
            };
            return Ok(LocalPart {
                registration: self.registration(id, key, mem.as_ptr()),
                segment: None,
                id,
                base: mem.as_ptr() as usize,
                bytes,
                key,
                allocated: Some(mem),
            });
        }
        let name = self.segment_name(self.rank(), id);
        let seg = Segment::create(&name, bytes as usize)?;
        // SAFETY: the segment stays mapped until the registration, dropped
        // before it on every path (the part's and the window's fields drop
        // in that order), has removed the key from the table.
        let key = unsafe {
            self.fabric
                .table()
                .insert(seg.as_ptr(), bytes, Access::ALL)?
        };
        let mut registration = self.registration(id, key, seg.as_ptr());
        // SAFETY: the segment's header, mapped until `seg` drops, after
        // `registration` on every path.
        unsafe { registration.set_state(seg.state()) };
        Ok(LocalPart {
            registration,
            id,
            base: seg.as_ptr() as usize,
            bytes,
            key,
            segment: Some(seg),
            allocated: None,
        })
    }

    /// This rank's part of window `id`: the caller's `bytes` at `ptr`,
    /// served to keyed peers (same-host peers cannot map it).
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `bytes` bytes, 8-byte
    /// aligned, and outlive the window; remote peers write it concurrently.
    pub unsafe fn adopt(&self, id: u32, ptr: *mut u8, bytes: u64) -> Result<LocalPart, NetError> {
        // SAFETY: forwarded from the caller's promise.
        let key = unsafe { self.fabric.table().insert(ptr, bytes, Access::ALL)? };
        Ok(LocalPart {
            registration: self.registration(id, key, ptr),
            segment: None,
            allocated: None,
            id,
            base: ptr as usize,
            bytes,
            key,
        })
    }

    fn registration(&self, id: u32, key: u32, base: *mut u8) -> Registration {
        Registration::new(
            self.fabric.table().clone(),
            self.fabric.clone(),
            id,
            key,
            base as usize,
        )
    }

    /// Every rank's part of `local`'s window from every rank's record
    /// (indexed by rank), the same-host peers' segments mapped here.
    pub fn open(&self, local: &LocalPart, records: &[Vec<u8>]) -> Result<HostParts, NetError> {
        HostParts::open(self.rank(), local.id, records, |p| {
            self.fabric.reach(p) == Some(Reach::Mapped)
        })
    }

    /// Lists `local`'s window in the fabric's directory with the `peers`'
    /// parts, and keeps both.
    ///
    /// # Safety
    /// `peers` must be what [`HostWindows::open`] made for `local`,
    /// unchanged: the directory entry describes its mappings, which the
    /// fabric and the backends write.
    pub unsafe fn list(&self, local: LocalPart, peers: HostParts) -> HostWindow {
        let LocalPart {
            registration,
            segment,
            allocated,
            id,
            base,
            bytes,
            ..
        } = local;
        let rank = self.rank();
        let HostParts { parts, segments } = peers;
        // A segment gin-net created is owned by the keeper; a caller's
        // registered buffer is not (the caller may free it once the window
        // dropped, even after a failed wait left a put using it).
        let owned = segment.is_some() || allocated.is_some();
        let mapped = Arc::new(Mapped {
            _own: segment,
            _allocated: allocated,
            _peers: segments,
        });
        let at_rank = |p: usize, mine: usize, theirs: usize| if p == rank { mine } else { theirs };
        let parts = MemParts {
            memory: Memory::Host,
            local_base: base,
            // This rank's size is the one it allocated, whatever the records
            // said.
            sizes: (parts.iter().enumerate())
                .map(|(p, e)| if p == rank { bytes } else { e.size })
                .collect(),
            peer_bases: (parts.iter().enumerate())
                .map(|(p, e)| at_rank(p, base, e.mapped))
                .collect(),
            keys: parts.iter().map(|p| p.key).collect(),
            addrs: parts.iter().map(|p| p.addr).collect(),
            states: (parts.iter().enumerate())
                .map(|(p, e)| at_rank(p, registration.state(), e.state))
                .collect(),
            keep: Some(KeepAlive(mapped.clone())),
        };
        // SAFETY: `base` is this rank's part (sizes[rank] bytes), each non-null peer base a mapping of that peer's
        // part (sizes[p] bytes) and each non-zero state a segment's
        // revocation word, all kept mapped by `mapped`, which the
        // description holds; shared memory is only reached through raw
        // pointers and atomics.
        let desc = unsafe { MemDesc::new(parts.clone()) };
        // SAFETY: where the part is a segment or memory a transport
        // allocated, `mapped` (the keeper) owns it: it unmaps only when the
        // last clone of the keeper drops.
        let desc = if owned {
            // SAFETY: as above: the keeper owns the part.
            unsafe { desc.keeping_local() }
        } else {
            desc
        };
        self.fabric.add_window(id, desc);
        let mut registration = registration;
        registration.hold(KeepAlive(mapped.clone()));
        HostWindow {
            id,
            parts,
            memory: WindowMemory {
                _registration: registration,
                _mapped: mapped,
            },
        }
    }

    /// Tells every rank about `local` (`allgather`), maps the same-host
    /// peers' parts and waits for every rank to have done so (`barrier`).
    fn exchange<E: From<NetError>>(
        &self,
        local: &LocalPart,
        allgather: impl FnOnce(&[u8]) -> Result<Vec<Vec<u8>>, E>,
        barrier: impl FnOnce() -> Result<(), E>,
    ) -> Result<HostParts, E> {
        let all = allgather(&local.record())?;
        let parts = self.open(local, &all)?;
        barrier()?;
        debug!(rank = self.rank(), id = local.id, "window registered");
        Ok(parts)
    }

    /// Allocates window `id` collectively (`allgather` and `barrier` are
    /// the job's): `bytes` of shared memory on this rank (ranks may ask for
    /// different sizes) that same-host peers map, served to keyed peers,
    /// listed in the fabric's directory.
    pub fn alloc<E: From<NetError>>(
        &self,
        id: u32,
        bytes: u64,
        allgather: impl FnOnce(&[u8]) -> Result<Vec<Vec<u8>>, E>,
        barrier: impl FnOnce() -> Result<(), E>,
    ) -> Result<HostWindow, E> {
        let mut local = self.create(id, bytes)?;
        let r = self.exchange(&local, allgather, barrier);
        // Every peer has mapped it (the exchange ends with a barrier), or
        // the registration failed: either way no name is needed any more.
        local.unlink();
        self.remove_segment_names(id);
        let peers = r?;
        // SAFETY: `open` made `peers` for `local`.
        Ok(unsafe { self.list(local, peers) })
    }

    /// Registers the caller's `bytes` at `ptr` as this rank's part of
    /// window `id` (collective, as [`HostWindows::alloc`]); only keyed
    /// peers reach it.
    ///
    /// # Safety
    /// As [`HostWindows::adopt`].
    pub unsafe fn register<E: From<NetError>>(
        &self,
        id: u32,
        ptr: *mut u8,
        bytes: u64,
        allgather: impl FnOnce(&[u8]) -> Result<Vec<Vec<u8>>, E>,
        barrier: impl FnOnce() -> Result<(), E>,
    ) -> Result<HostWindow, E> {
        // SAFETY: the caller's promise.
        let local = unsafe { self.adopt(id, ptr, bytes)? };
        let peers = self.exchange(&local, allgather, barrier)?;
        // SAFETY: `open` made `peers` for `local`.
        Ok(unsafe { self.list(local, peers) })
    }

    /// Stops serving this rank's part of window `id` (at `base`, under
    /// `key`) and removes the window from the directory: a deregistration,
    /// before the window's keeper drops. Where the removal is quarantined
    /// (a peer may still write the part), the keeper's drop leaks the
    /// memory: the region table remembers the verdict
    /// ([`RegionTable::remove_region`]).
    pub fn withdraw(&self, id: u32, key: u32, base: usize) -> Removal {
        self.fabric.remove_window(id);
        self.fabric.table().remove_region(key, base)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

    use std::time::Duration;

    use super::*;
    use crate::Addr;
    use crate::fabric::Path;
    use crate::region::RegionTable;
    use crate::shm::ShmTransport;

    /// A job token no other test (or test process) shares.
    fn token(test: u8) -> Vec<u8> {
        let mut t = std::process::id().to_le_bytes().to_vec();
        t.extend([test, 0x9e]);
        t
    }

    /// Rank `rank` of two ranks on one host, each reaching the other over
    /// shm.
    fn rank_of_two(rank: usize, test: u8) -> HostWindows {
        let paths = (0..2)
            .map(|p| {
                if p == rank {
                    Path::local()
                } else {
                    Path::new(Arc::new(ShmTransport::peers()))
                }
            })
            .collect();
        let table = Arc::new(RegionTable::default());
        let fabric = Fabric::new(rank, paths, table, Duration::from_secs(1));
        HostWindows::new(Arc::new(fabric), vec![0, 0], &token(test))
    }

    /// The only rank of a job.
    fn alone(test: u8) -> HostWindows {
        let table = Arc::new(RegionTable::default());
        let fabric = Fabric::local(table, Duration::from_secs(1));
        HostWindows::new(Arc::new(fabric), vec![0], &token(test))
    }

    /// Window `id` on both ranks of `r`, of 64 and 128 bytes, through the
    /// steps `alloc` takes (one thread plays both ranks).
    fn listed_pair(r: &[HostWindows; 2], id: u32) -> [HostWindow; 2] {
        let [l0, l1] = [r[0].create(id, 64).unwrap(), r[1].create(id, 128).unwrap()];
        let records = vec![l0.record(), l1.record()];
        let [p0, p1] = [
            r[0].open(&l0, &records).unwrap(),
            r[1].open(&l1, &records).unwrap(),
        ];
        // SAFETY: `open` made each rank's peers for its own part.
        unsafe { [r[0].list(l0, p0), r[1].list(l1, p1)] }
    }

    #[test]
    fn segment_names_carry_the_job_the_rank_and_the_window() {
        let r = rank_of_two(0, 1);
        let pid = std::process::id().swap_bytes();
        let tag = format!("{pid:08x}019e");
        assert_eq!(r.segment_name(1, 5), format!("gin-{tag}-r1-w5"));
        assert_eq!(r.mapped_peers(), [1]);
        assert!(alone(1).mapped_peers().is_empty());
    }

    #[test]
    fn same_host_ranks_map_each_others_parts_and_write_through_the_directory() {
        let r = [rank_of_two(0, 2), rank_of_two(1, 2)];
        let w = listed_pair(&r, 7);
        for (rank, w) in w.iter().enumerate() {
            let p = w.parts();
            assert_eq!(
                (w.id(), p.memory, &p.sizes[..]),
                (7, Memory::Host, &[64, 128][..])
            );
            assert_eq!(p.peer_bases[rank], p.local_base);
            assert!(p.peer_bases.iter().all(|&b| b != 0), "{p:?}");
            assert!(p.states.iter().all(|&s| s != 0), "{p:?}");
            assert!(p.keys.iter().all(|&k| k != 0), "{p:?}");
            assert_eq!(r[rank].fabric.window(7).unwrap().sizes, [64, 128]);
        }
        // Rank 1 writes into rank 0's part through its mapping; rank 0 reads
        // it in its own.
        let at = Addr {
            window: 7,
            offset: 8,
        };
        r[1].fabric.put(0, at, b"hello gin", None).unwrap();
        let mut out = [0u8; 9];
        r[0].fabric.read(0, at, &mut out).unwrap();
        assert_eq!(&out, b"hello gin");
    }

    #[test]
    fn dropping_a_window_revokes_its_part_at_the_peers_and_unlists_and_unserves_it() {
        let r = [rank_of_two(0, 3), rank_of_two(1, 3)];
        let [w0, _w1] = listed_pair(&r, 2);
        let key = w0.parts().keys[0];
        let (parts, keeper) = w0.into_parts();
        assert_eq!(parts.keys[0], key);
        drop(keeper);
        assert!(matches!(
            r[0].fabric.window(2),
            Err(NetError::NotRegistered { window: 2 })
        ));
        assert!(r[0].fabric.table().with_region(key, |i| i.is_none()));
        // Rank 1 still maps the part, but its revocation word refuses it.
        let e = r[1]
            .fabric
            .put(
                0,
                Addr {
                    window: 2,
                    offset: 0,
                },
                b"late",
                None,
            )
            .unwrap_err();
        assert!(matches!(e, NetError::Revoked { .. }), "{e}");
    }

    #[test]
    fn alloc_lists_the_window_and_leaves_no_segment_name() {
        let r = alone(4);
        let w = r
            .alloc(
                0,
                32,
                |mine| Ok::<_, NetError>(vec![mine.to_vec()]),
                || Ok(()),
            )
            .unwrap();
        assert!(!shm_dir().join(r.segment_name(0, 0)).exists());
        let p = w.parts();
        assert_eq!((&p.sizes[..], p.peer_bases[0]), (&[32][..], p.local_base));
        assert_ne!(p.states[0], 0);
        assert!(r.fabric.table().with_region(p.keys[0], |i| i.is_some()));
        assert_eq!(r.fabric.window(0).unwrap().sizes, [32]);
    }

    /// Only a window whose keeper owns this rank's part may lend it to a
    /// transport that reads it after the put returned: a segment gin-net
    /// allocated is owned; a caller's registered buffer (larger than the
    /// transports' lending threshold here) is not, since its owner may
    /// free it once the window dropped, even with a put left in flight
    /// by a failed wait.
    #[test]
    fn only_an_allocated_window_says_its_keeper_owns_the_local_part() {
        let r = alone(6);
        let gather = |mine: &[u8]| Ok::<_, NetError>(vec![mine.to_vec()]);
        let w = r.alloc(0, 32 << 10, gather, || Ok(())).unwrap();
        assert!(r.fabric.window(0).unwrap().keeps_local());
        let mut buf = vec![0u64; 4096].into_boxed_slice();
        // SAFETY: `buf` (32 KiB, 8-byte aligned) outlives the window,
        // dropped first below.
        let reg = unsafe {
            r.register(1, buf.as_mut_ptr().cast(), 32 << 10, gather, || Ok(()))
                .unwrap()
        };
        let desc = r.fabric.window(1).unwrap();
        assert_eq!(desc.sizes, [32 << 10]);
        assert!(desc.keep.is_some());
        assert!(!desc.keeps_local(), "a registered buffer would be lent");
        drop((desc, reg, w));
        drop(buf);
    }

    #[test]
    fn a_failed_exchange_removes_every_same_host_segment_name() {
        let r = rank_of_two(0, 5);
        // What a peer killed right after creating its segment leaves.
        let left = shm_dir().join(r.segment_name(1, 3));
        std::fs::write(&left, b"").unwrap();
        let e = r
            .alloc(
                3,
                64,
                |_| {
                    Err(NetError::Io {
                        what: "the allgather".into(),
                        source: std::io::Error::other("a peer died"),
                    })
                },
                || Ok(()),
            )
            .unwrap_err();
        assert!(e.to_string().contains("a peer died"), "{e}");
        assert!(!left.exists());
        assert!(!shm_dir().join(r.segment_name(0, 3)).exists());
        assert!(r.fabric.window(3).is_err());
    }

    #[test]
    fn a_registered_user_part_is_served_unshared_and_withdrawn() {
        let mut user = vec![0u64; 8];
        let r = alone(6);
        let ptr = user.as_mut_ptr().cast::<u8>();
        // SAFETY: `user` (64 bytes, 8-byte aligned) outlives the window.
        let w = unsafe {
            r.register(
                1,
                ptr,
                64,
                |m| Ok::<_, NetError>(vec![m.to_vec()]),
                || Ok(()),
            )
        }
        .unwrap();
        let p = w.parts();
        assert_eq!(
            (p.local_base, p.states[0], &p.sizes[..]),
            (ptr as usize, 0, &[64][..])
        );
        let key = p.keys[0];
        assert!(r.fabric.table().with_region(key, |i| i.is_some()));
        r.withdraw(1, key, ptr as usize);
        assert!(r.fabric.table().with_region(key, |i| i.is_none()));
        assert!(r.fabric.window(1).is_err());
        drop(w);
        drop(user);
    }

    #[test]
    fn a_record_claiming_a_larger_part_here_does_not_grow_it() {
        let r = alone(7);
        let local = r.create(4, 64).unwrap();
        let forged = PartRecord {
            size: 1 << 20,
            key: 1,
            addr: 0,
            shared: false,
            segment: "",
        }
        .encode();
        let peers = r.open(&local, &[forged]).unwrap();
        // SAFETY: `open` made `peers` for `local`.
        let w = unsafe { r.list(local, peers) };
        assert_eq!(w.parts().sizes, [64]);
        assert_eq!(r.fabric.window(4).unwrap().size_of(0), 64);
    }
}
