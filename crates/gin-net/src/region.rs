//! The table of memory regions remote peers may access, by key.
//!
//! A region is host memory this process loads and stores, or memory behind
//! a [`Backing`] (GPU memory, which the host reaches only through the copy
//! engine): the transport checks both alike and then copies through the
//! backing.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};

use crate::NetError;

/// What a remote peer may do to a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Access {
    /// Puts.
    pub write: bool,
    /// Gets.
    pub read: bool,
    /// Fetch-add, compare-swap, and signals carried by puts.
    pub atomic: bool,
}

impl Access {
    /// Everything.
    pub const ALL: Self = Self {
        write: true,
        read: true,
        atomic: true,
    };

    /// Writes and reads, no atomics: what a [`Backing`] region allows.
    pub const COPY: Self = Self {
        write: true,
        read: true,
        atomic: false,
    };
}

/// Why the region table refused an access (sent to the initiator as text,
/// so the messages are what a remote peer reads).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegionError {
    /// No region has this key (never registered, or removed).
    #[error("unknown memory key {key:#010x}")]
    UnknownKey {
        /// The key asked for.
        key: u32,
    },
    /// The region is GPU memory behind a [`Backing`]: copies only.
    #[error(
        "key {key:#010x} names GPU memory, which this transport reaches by copies only: no atomics"
    )]
    CopyOnly {
        /// The region's key.
        key: u32,
    },
    /// The region does not allow this kind of access.
    #[error("key {key:#010x} does not allow {need:?}")]
    Denied {
        /// The region's key.
        key: u32,
        /// The access asked for.
        need: AccessKind,
    },
    /// The range does not fit the region.
    #[error("{len} bytes at offset {offset} exceed the {size} bytes of key {key:#010x}")]
    OutOfBounds {
        /// The region's key.
        key: u32,
        /// Offset asked for.
        offset: u64,
        /// Bytes asked for.
        len: u64,
        /// The region's size.
        size: u64,
    },
    /// An atomic on a word that is not 8-byte aligned.
    #[error("atomic at offset {offset} of key {key:#010x} is not 8-byte aligned")]
    Misaligned {
        /// The region's key.
        key: u32,
        /// Offset asked for.
        offset: u64,
    },
    /// The backing failed to copy.
    #[error("{why}")]
    Backing {
        /// The region's key.
        key: u32,
        /// The backing's reason.
        why: String,
    },
}

/// Memory a region's bytes are copied through instead of plain loads and
/// stores (GPU memory: staged through pinned host memory and the copy
/// engine). It offers no atomics; the table refuses them.
pub trait Backing: Send + Sync {
    /// Copies `data` to `offset`; the table checked the range. Returns once
    /// the bytes are where later writes and reads through this backing see
    /// them.
    fn write(&self, offset: u64, data: &[u8]) -> Result<(), String>;
    /// Copies the bytes at `offset` into `out`; the table checked the range.
    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), String>;

    /// What makes this memory's device context current on the calling
    /// thread (for GPU memory: the CUDA context that owns it), for a
    /// transport whose own threads hand the memory to a library that
    /// needs it current (the ucx transport's progress thread, where UCX
    /// maps a region registered before the transport started, executes
    /// peers' software-emulated writes into it and completes this rank's
    /// puts from GPU memory). `None` (the default): nothing to make
    /// current.
    ///
    /// A transport runs the hook on its own threads only, which run no
    /// user code and capture no CUDA graph, any number of times: the hook
    /// may set thread-wide state there for good. A GPU backing also sets
    /// the thread's stream-capture mode to relaxed, so that a user's
    /// global-mode graph capture does not refuse the CUDA calls the
    /// transport's library makes there (and is not invalidated by them).
    fn thread_context(&self) -> Option<ThreadContext> {
        None
    }
}

/// A hook that makes a device context current on the calling thread, a
/// transport's own (see [`Backing::thread_context`]).
pub type ThreadContext = Arc<dyn Fn() + Send + Sync>;

#[derive(Clone)]
struct Entry {
    base: usize,
    len: u64,
    access: Access,
    backing: Option<Arc<dyn Backing>>,
}

impl std::fmt::Debug for Entry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Entry")
            .field("base", &self.base)
            .field("len", &self.len)
            .field("access", &self.access)
            .field("backed", &self.backing.is_some())
            .finish()
    }
}

/// Where a checked access goes.
enum Target<'a> {
    Host(*mut u8),
    Backed(&'a dyn Backing, u64),
}

/// Told when a region stops being served, before the call that removed it
/// returns (so before its owner frees the memory): a transport that handed
/// peers a capability for it (the ucx transport's rkeys) revokes and
/// unmaps it here. Called without the table's lock held.
///
/// Also told when a region is registered, on the registering thread,
/// before the call that registered it returns: a transport that must
/// prepare memory on a thread with the right state (the ucx transport maps
/// GPU memory where the rank's CUDA context is current) does it there.
pub trait RegionObserver: Send + Sync {
    /// `key` (the region at `base`) was removed; whether its memory may be
    /// reused ([`Removal`]).
    fn removed(&self, key: u32, base: usize) -> Removal;

    /// `key` (the region at `base`) was registered. The default does
    /// nothing.
    fn inserted(&self, key: u32, base: usize) {
        let _ = (key, base);
    }
}

/// What became of a removed region's memory, as the observers say
/// ([`RegionTable::remove`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Removal {
    /// Nothing reaches it any more: its owner may free or reuse it.
    Released,
    /// A peer may still write it: it held a capability for the region (a
    /// ucx rkey), never acknowledged its revocation within the job's
    /// timeout, and nothing says it failed. The transport keeps its own
    /// mapping (quarantined, logged); the owner should leak the memory
    /// rather than reuse it.
    Quarantined,
}

/// A region as [`RegionTable::with_region`] shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionInfo {
    /// Its address in this process (an identity only for backed regions).
    pub base: usize,
    /// Its size.
    pub len: u64,
    /// What peers may do.
    pub access: Access,
    /// Whether it is reached through a [`Backing`] (GPU memory), not
    /// plain loads and stores.
    pub backed: bool,
}

/// Registered regions by key. Lookups check bounds and rights, so a remote
/// request can never touch memory outside what was registered.
#[derive(Default)]
pub struct RegionTable {
    map: RwLock<HashMap<u32, Entry>>,
    observers: Mutex<Vec<Weak<dyn RegionObserver>>>,
    /// (key, base) of every region whose removal was quarantined: a later
    /// [`RegionTable::remove_region`] of it (the owner's drop after a
    /// deregistration removed it) says so again.
    quarantined: Mutex<std::collections::HashSet<(u32, usize)>>,
}

impl std::fmt::Debug for RegionTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegionTable")
            .field("map", &self.map)
            .finish_non_exhaustive()
    }
}

impl RegionTable {
    /// Registers `len` bytes at `base` under a fresh random key.
    ///
    /// # Safety
    /// The memory must stay valid for reads and writes of `len` bytes until
    /// [`RegionTable::remove`] is called with the returned key; remote peers
    /// write it concurrently with local use. Observers are told
    /// ([`RegionObserver::inserted`]) before this returns.
    pub unsafe fn insert(&self, base: *mut u8, len: u64, access: Access) -> Result<u32, NetError> {
        self.insert_entry(Entry {
            base: base as usize,
            len,
            access,
            backing: None,
        })
    }

    /// Registers `len` bytes reached through `backing` under a fresh random
    /// key; `base` only identifies the region for
    /// [`RegionTable::remove_region`] (a GPU address). Writes and reads
    /// only: atomics on it are refused. Observers are told
    /// ([`RegionObserver::inserted`]) before this returns.
    pub fn insert_backed(
        &self,
        base: u64,
        len: u64,
        backing: Arc<dyn Backing>,
    ) -> Result<u32, NetError> {
        // Only an identity for `remove_region`; never dereferenced.
        let base = base as usize;
        self.insert_entry(Entry {
            base,
            len,
            access: Access::COPY,
            backing: Some(backing),
        })
    }

    fn insert_entry(&self, entry: Entry) -> Result<u32, NetError> {
        let base = entry.base;
        let key = self.draw_and_insert(entry)?;
        for o in self.live_observers() {
            o.inserted(key, base);
        }
        Ok(key)
    }

    fn draw_and_insert(&self, entry: Entry) -> Result<u32, NetError> {
        let mut map = self
            .map
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        loop {
            let mut k = [0u8; 4];
            getrandom::fill(&mut k).map_err(|e| NetError::Io {
                what: "drawing a region key".into(),
                source: std::io::Error::other(e.to_string()),
            })?;
            let key = u32::from_le_bytes(k);
            if key != 0 && !map.contains_key(&key) {
                map.insert(key, entry);
                return Ok(key);
            }
        }
    }

    /// Forgets a key; later requests with it are refused. Waits for the
    /// requests being served under it, then tells the observers, and says
    /// whether the memory may be reused.
    pub fn remove(&self, key: u32) -> Removal {
        let gone = self
            .map
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&key);
        match gone {
            Some(e) => self.tell_removed(key, e.base),
            None => Removal::Released,
        }
    }

    /// Registers `o` to be told of every later removal (held weakly: it
    /// stops being told when dropped).
    pub fn observe(&self, o: Weak<dyn RegionObserver>) {
        let mut v = self
            .observers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        v.retain(|w| w.strong_count() > 0);
        v.push(o);
    }

    fn live_observers(&self) -> Vec<Arc<dyn RegionObserver>> {
        self.observers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .filter_map(Weak::upgrade)
            .collect()
    }

    fn tell_removed(&self, key: u32, base: usize) -> Removal {
        let mut r = Removal::Released;
        for o in self.live_observers() {
            if o.removed(key, base) == Removal::Quarantined {
                r = Removal::Quarantined;
            }
        }
        if r == Removal::Quarantined {
            self.quarantined
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert((key, base));
        }
        r
    }

    /// Runs `f` on the region `key` names (or `None`) while holding the
    /// table's read guard: the region is not removed, so its memory stays
    /// valid, until `f` returns. `f` must not remove regions.
    pub fn with_region<T>(&self, key: u32, f: impl FnOnce(Option<RegionInfo>) -> T) -> T {
        let map = self
            .map
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        f(map.get(&key).map(|e| RegionInfo {
            base: e.base,
            len: e.len,
            access: e.access,
            backed: e.backing.is_some(),
        }))
    }

    /// The thread-context hook of any region already in the table that has
    /// one (for a transport starting after regions were registered).
    pub fn any_thread_context(&self) -> Option<ThreadContext> {
        let map = self
            .map
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        map.values()
            .find_map(|e| e.backing.as_ref()?.thread_context())
    }

    /// The thread-context hook of the backing behind `key`, if any
    /// ([`Backing::thread_context`]).
    pub fn thread_context(&self, key: u32) -> Option<ThreadContext> {
        let map = self
            .map
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        map.get(&key)?.backing.as_ref()?.thread_context()
    }

    /// Forgets `key` if it still names the region at `base` (keys of removed
    /// regions may be drawn again); as [`RegionTable::remove`] otherwise.
    /// Where the region was already removed, says again whether that
    /// removal was quarantined: a window's owner drops its memory after a
    /// deregistration removed the region, and must still leak it then.
    pub fn remove_region(&self, key: u32, base: usize) -> Removal {
        let gone = {
            let mut map = self
                .map
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if map.get(&key).is_some_and(|e| e.base == base) {
                map.remove(&key)
            } else {
                None
            }
        };
        if gone.is_some() {
            self.tell_removed(key, base)
        } else if self
            .quarantined
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(&(key, base))
        {
            Removal::Quarantined
        } else {
            Removal::Released
        }
    }

    /// Runs `f` on the checked target of `[offset, offset + len)` while
    /// holding the table's read guard: [`RegionTable::remove`] waits for it,
    /// so memory is never touched after its key was removed.
    fn with<T>(
        &self,
        key: u32,
        offset: u64,
        len: u64,
        need: AccessKind,
        f: impl FnOnce(Target<'_>) -> Result<T, RegionError>,
    ) -> Result<T, RegionError> {
        let map = self
            .map
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let e = map.get(&key).ok_or(RegionError::UnknownKey { key })?;
        let allowed = match need {
            AccessKind::Write => e.access.write,
            AccessKind::Read => e.access.read,
            AccessKind::Atomic => e.access.atomic,
        };
        if !allowed {
            return Err(if e.backing.is_some() && need == AccessKind::Atomic {
                RegionError::CopyOnly { key }
            } else {
                RegionError::Denied { key, need }
            });
        }
        if offset.checked_add(len).is_none_or(|end| end > e.len) {
            return Err(RegionError::OutOfBounds {
                key,
                offset,
                len,
                size: e.len,
            });
        }
        if let Some(b) = &e.backing {
            return f(Target::Backed(&**b, offset)).map_err(|e| match e {
                RegionError::Backing { why, .. } => RegionError::Backing { key, why },
                e => e,
            });
        }
        let addr = e.base + offset as usize;
        if need == AccessKind::Atomic && !addr.is_multiple_of(8) {
            return Err(RegionError::Misaligned { key, offset });
        }
        f(Target::Host(addr as *mut u8))
    }

    /// Checks key, rights, bounds (and alignment for atomics) without
    /// touching memory.
    pub fn check(
        &self,
        key: u32,
        offset: u64,
        len: u64,
        need: AccessKind,
    ) -> Result<(), RegionError> {
        self.with(key, offset, len, need, |_| Ok(()))
    }

    /// Copies `data` into the region at `offset`.
    pub fn write(&self, key: u32, offset: u64, data: &[u8]) -> Result<(), RegionError> {
        self.with(key, offset, data.len() as u64, AccessKind::Write, |t| {
            match t {
                // SAFETY: checked range of a registered region (the insert
                // contract), accessed under the read guard.
                Target::Host(p) => unsafe {
                    std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len());
                },
                Target::Backed(b, off) => b.write(off, data).map_err(backing)?,
            }
            Ok(())
        })
    }

    /// Copies bytes of the region at `offset` into `out`.
    pub fn read(&self, key: u32, offset: u64, out: &mut [u8]) -> Result<(), RegionError> {
        self.with(key, offset, out.len() as u64, AccessKind::Read, |t| {
            match t {
                // SAFETY: as in `write`.
                Target::Host(p) => unsafe {
                    std::ptr::copy_nonoverlapping(p, out.as_mut_ptr(), out.len());
                },
                Target::Backed(b, off) => b.read(off, out).map_err(backing)?,
            }
            Ok(())
        })
    }

    /// Atomic fetch-add on the aligned 8 bytes at `offset`, acquire-release:
    /// data written before it is visible to whoever acquires the new value.
    pub fn fetch_add(&self, key: u32, offset: u64, v: u64) -> Result<u64, RegionError> {
        self.with(key, offset, 8, AccessKind::Atomic, |t| {
            let p = host_only(t)?;
            // SAFETY: checked, 8-byte aligned; these slots are only accessed atomically.
            Ok(unsafe { (*p.cast::<AtomicU64>()).fetch_add(v, Ordering::AcqRel) })
        })
    }

    /// Atomic compare-and-swap at `offset`; returns the old value.
    pub fn compare_swap(
        &self,
        key: u32,
        offset: u64,
        expected: u64,
        desired: u64,
    ) -> Result<u64, RegionError> {
        self.with(key, offset, 8, AccessKind::Atomic, |t| {
            let p = host_only(t)?;
            // SAFETY: as in `fetch_add`.
            let a = unsafe { &*p.cast::<AtomicU64>() };
            Ok(
                match a.compare_exchange(expected, desired, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(v) | Err(v) => v,
                },
            )
        })
    }
}

/// The host address of an atomic's target (backed regions never allow
/// atomics, so `with` refused them before this).
fn host_only(t: Target<'_>) -> Result<*mut u8, RegionError> {
    match t {
        Target::Host(p) => Ok(p),
        // The key is filled in by `with`.
        Target::Backed(..) => Err(RegionError::CopyOnly { key: 0 }),
    }
}

/// A backing's failure (the key is filled in by `with`).
fn backing(why: String) -> RegionError {
    RegionError::Backing { key: 0, why }
}

/// The kind of access a request needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AccessKind {
    /// A put.
    Write,
    /// A get.
    Read,
    /// An atomic, or a signal carried by a put.
    Atomic,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accesses_check_key_bounds_rights_and_alignment() {
        let t = RegionTable::default();
        let mut mem = vec![0u64; 4];
        // SAFETY: `mem` outlives every use below.
        let key = unsafe {
            t.insert(
                mem.as_mut_ptr().cast(),
                32,
                Access {
                    write: true,
                    read: false,
                    atomic: true,
                },
            )
        }
        .unwrap();
        assert!(t.check(key, 0, 32, AccessKind::Write).is_ok());
        assert!(
            t.check(key, 8, 25, AccessKind::Write)
                .unwrap_err()
                .to_string()
                .contains("exceed the 32 bytes")
        );
        assert!(t.check(key, u64::MAX, 2, AccessKind::Write).is_err());
        assert!(
            t.read(key, 0, &mut [0; 8])
                .unwrap_err()
                .to_string()
                .contains("does not allow Read")
        );
        assert!(
            t.fetch_add(key, 4, 1)
                .unwrap_err()
                .to_string()
                .contains("aligned")
        );
        assert!(
            t.write(key ^ 1, 0, &[1])
                .unwrap_err()
                .to_string()
                .contains("unknown memory key")
        );
        assert_eq!(t.fetch_add(key, 8, 5).unwrap(), 0);
        assert_eq!(t.compare_swap(key, 8, 5, 9).unwrap(), 5);
        t.write(key, 16, &7u64.to_ne_bytes()).unwrap();
        assert_eq!((mem[1], mem[2]), (9, 7));
        t.remove(key);
        assert!(t.write(key, 0, &[1]).is_err());
        assert_eq!(mem[0], 0);
    }

    /// A backing that keeps its bytes inverted, so a test sees that every
    /// access went through it and not through a pointer.
    #[derive(Default)]
    struct Inverted(std::sync::Mutex<Vec<u8>>);

    impl Backing for Inverted {
        fn write(&self, offset: u64, data: &[u8]) -> Result<(), String> {
            let mut m = self.0.lock().unwrap();
            for (i, b) in data.iter().enumerate() {
                m[offset as usize + i] = !b;
            }
            Ok(())
        }
        fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), String> {
            let m = self.0.lock().unwrap();
            for (i, o) in out.iter_mut().enumerate() {
                *o = !m[offset as usize + i];
            }
            Ok(())
        }
    }

    #[test]
    fn backed_regions_copy_through_the_backing_and_refuse_atomics() {
        let t = RegionTable::default();
        let b = Arc::new(Inverted(std::sync::Mutex::new(vec![0xff; 32])));
        let key = t.insert_backed(0x7000_0000, 32, b.clone()).unwrap();
        t.write(key, 8, &[1, 2, 3]).unwrap();
        assert_eq!(&b.0.lock().unwrap()[8..11], &[!1, !2, !3]);
        let mut out = [9u8; 4];
        t.read(key, 7, &mut out).unwrap();
        assert_eq!(out, [0, 1, 2, 3]);
        // Bounds are the table's, checked before the backing is called.
        assert!(
            t.write(key, 30, &[0; 3])
                .unwrap_err()
                .to_string()
                .contains("exceed the 32 bytes")
        );
        let e = t.fetch_add(key, 0, 1).unwrap_err().to_string();
        assert!(e.contains("GPU memory") && e.contains("no atomics"), "{e}");
        assert!(t.compare_swap(key, 8, 0, 1).is_err());
        assert!(t.check(key, 0, 8, AccessKind::Atomic).is_err());
        // Only the region at that base is removed.
        t.remove_region(key, 0x7000_0008);
        assert!(t.check(key, 0, 8, AccessKind::Read).is_ok());
        t.remove_region(key, 0x7000_0000);
        assert!(
            t.read(key, 0, &mut out)
                .unwrap_err()
                .to_string()
                .contains("unknown memory key")
        );
    }
}
