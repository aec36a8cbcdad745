//! The table of memory regions remote peers may access, by key.

use std::collections::HashMap;
use std::sync::RwLock;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::NetError;

/// What a remote peer may do to a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Access {
    pub write: bool,
    pub read: bool,
    pub atomic: bool,
}

impl Access {
    pub const ALL: Self = Self {
        write: true,
        read: true,
        atomic: true,
    };
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    base: usize,
    len: u64,
    access: Access,
}

/// Registered regions by key. Lookups check bounds and rights, so a remote
/// request can never touch memory outside what was registered.
#[derive(Debug, Default)]
pub struct RegionTable {
    map: RwLock<HashMap<u32, Entry>>,
}

/// A checked, resolved address inside a region.
#[derive(Debug, Clone, Copy)]
pub struct Resolved(usize);

impl Resolved {
    pub fn ptr(self) -> *mut u8 {
        self.0 as *mut u8
    }
}

impl RegionTable {
    /// Registers `len` bytes at `base` under a fresh random key.
    ///
    /// # Safety
    /// The memory must stay valid for reads and writes of `len` bytes until
    /// [`RegionTable::remove`] is called with the returned key; remote peers
    /// write it concurrently with local use.
    pub unsafe fn insert(&self, base: *mut u8, len: u64, access: Access) -> Result<u32, NetError> {
        let mut map = self
            .map
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        loop {
            let mut k = [0u8; 4];
            getrandom::fill(&mut k)
                .map_err(|e| NetError::Invalid(format!("drawing a key: {e}")))?;
            let key = u32::from_le_bytes(k);
            if key != 0 && !map.contains_key(&key) {
                map.insert(
                    key,
                    Entry {
                        base: base as usize,
                        len,
                        access,
                    },
                );
                return Ok(key);
            }
        }
    }

    /// Forgets a key; later requests with it are refused.
    pub fn remove(&self, key: u32) {
        self.map
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&key);
    }

    /// The key of the region that starts at `base`, if any.
    pub fn key_of(&self, base: *mut u8) -> Option<u32> {
        self.map
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .find(|(_, e)| e.base == base as usize)
            .map(|(k, _)| *k)
    }

    /// Checks key, rights and bounds; `align` applies to atomics.
    pub fn resolve(
        &self,
        key: u32,
        offset: u64,
        len: u64,
        need: AccessKind,
    ) -> Result<Resolved, String> {
        let map = self
            .map
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let e = map
            .get(&key)
            .ok_or_else(|| format!("unknown memory key {key:#010x}"))?;
        let allowed = match need {
            AccessKind::Write => e.access.write,
            AccessKind::Read => e.access.read,
            AccessKind::Atomic => e.access.atomic,
        };
        if !allowed {
            return Err(format!("key {key:#010x} does not allow {need:?}"));
        }
        if offset.checked_add(len).is_none_or(|end| end > e.len) {
            return Err(format!(
                "{len} bytes at offset {offset} exceed the {} bytes of key {key:#010x}",
                e.len
            ));
        }
        let addr = e.base + offset as usize;
        if need == AccessKind::Atomic && !addr.is_multiple_of(8) {
            return Err(format!(
                "atomic at offset {offset} of key {key:#010x} is not 8-byte aligned"
            ));
        }
        Ok(Resolved(addr))
    }
}

/// The kind of access a request needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AccessKind {
    Write,
    Read,
    Atomic,
}

/// Atomic fetch-add on resolved, aligned memory; release so that data
/// written before it is visible to whoever acquires the new value.
///
/// # Safety
/// `at` must come from [`RegionTable::resolve`] with [`AccessKind::Atomic`]
/// while the region is registered.
pub unsafe fn fetch_add(at: Resolved, v: u64) -> u64 {
    // SAFETY: resolved, in bounds, 8-byte aligned, registered memory.
    unsafe { (*at.ptr().cast::<AtomicU64>()).fetch_add(v, Ordering::AcqRel) }
}

/// Atomic compare-and-swap on resolved memory; returns the old value.
///
/// # Safety
/// As for [`fetch_add`].
pub unsafe fn compare_swap(at: Resolved, expected: u64, desired: u64) -> u64 {
    // SAFETY: as in `fetch_add`.
    let a = unsafe { &*at.ptr().cast::<AtomicU64>() };
    match a.compare_exchange(expected, desired, Ordering::AcqRel, Ordering::Acquire) {
        Ok(v) | Err(v) => v,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolve_checks_key_bounds_rights_and_alignment() {
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
        assert!(t.resolve(key, 0, 32, AccessKind::Write).is_ok());
        assert!(
            t.resolve(key, 8, 25, AccessKind::Write)
                .unwrap_err()
                .contains("exceed the 32 bytes")
        );
        assert!(t.resolve(key, u64::MAX, 2, AccessKind::Write).is_err());
        assert!(
            t.resolve(key, 0, 8, AccessKind::Read)
                .unwrap_err()
                .contains("does not allow Read")
        );
        assert!(
            t.resolve(key, 4, 8, AccessKind::Atomic)
                .unwrap_err()
                .contains("aligned")
        );
        assert!(
            t.resolve(key ^ 1, 0, 8, AccessKind::Write)
                .unwrap_err()
                .contains("unknown memory key")
        );
        let at = t.resolve(key, 8, 8, AccessKind::Atomic).unwrap();
        // SAFETY: resolved just above.
        assert_eq!(unsafe { fetch_add(at, 5) }, 0);
        // SAFETY: resolved just above.
        assert_eq!(unsafe { compare_swap(at, 5, 9) }, 5);
        assert_eq!(mem[1], 9);
        t.remove(key);
        assert!(t.resolve(key, 0, 8, AccessKind::Write).is_err());
    }
}
