//! Window handles: memory every rank registered collectively, addressed as
//! (window, offset) on any rank.

use std::any::Any;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::abi::WindowAbi;
use crate::error::GinError;

/// A registered window. Cheap to clone; the memory stays mapped while any
/// clone lives, and operations on a deregistered window fail.
#[derive(Clone)]
pub struct Window {
    inner: Arc<Inner>,
}

struct Inner {
    abi: WindowAbi,
    rank: usize,
    comm_id: u64,
    sizes: Box<[u64]>,
    peer_bases: Box<[u64]>,
    keys: Box<[u32]>,
    addrs: Box<[u64]>,
    /// Each rank's revocation word mapped here (0: none).
    states: Box<[usize]>,
    valid: AtomicBool,
    /// Whatever keeps the memory mapped (owned by the host layer).
    _owner: Box<dyn Any + Send + Sync>,
}

impl std::fmt::Debug for Window {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Window")
            .field("id", &self.inner.abi.id)
            .field("rank", &self.inner.rank)
            .field("sizes", &self.inner.sizes)
            .field("valid", &self.is_valid())
            .finish_non_exhaustive()
    }
}

/// Where a window's memory is, as the host layer describes it.
#[derive(Debug)]
pub struct WindowParts {
    /// The window's id, the same on every rank.
    pub id: u32,
    /// This rank (its index in the per-rank vectors below).
    pub rank: usize,
    /// Identifies the communicator the window belongs to.
    pub comm_id: u64,
    /// This rank's part.
    pub local_base: *mut u8,
    /// Every rank's size of the window (entry `rank` is this rank's).
    pub sizes: Vec<u64>,
    /// Each peer's part mapped into this process, or null.
    pub peer_bases: Vec<*mut u8>,
    /// Each rank's memory key for its part (0 where none).
    pub keys: Vec<u32>,
    /// Each rank's address of its own part, in its own address space.
    pub addrs: Vec<u64>,
    /// Each rank's revocation word mapped here, or null: 0 while its owner
    /// serves its part, non-zero once the owner dropped or deregistered it
    /// (the owner's own entry is stored by [`Window::mark_deregistered`]).
    /// Direct puts and gets check it before touching the peer's mapping.
    pub states: Vec<*const AtomicU64>,
}

impl Window {
    /// Wraps memory the host layer registered.
    ///
    /// # Safety
    /// `local_base` must be valid for reads and writes of `sizes[rank]` bytes,
    /// and each non-null `peer_bases[p]` for `sizes[p]` bytes, and each
    /// non-null `states[p]` for atomic access (8-byte aligned), as long as
    /// `owner` lives. The memory may be written concurrently by other
    /// processes; it is only ever accessed through raw pointers and atomics.
    /// Every 8-byte-aligned offset of a part must be 8-byte aligned in memory.
    pub unsafe fn from_parts(parts: WindowParts, owner: Box<dyn Any + Send + Sync>) -> Self {
        let sizes = parts.sizes.into_boxed_slice();
        let peer_bases: Box<[u64]> = parts.peer_bases.iter().map(|p| *p as u64).collect();
        let local_size = sizes.get(parts.rank).copied().unwrap_or(0);
        let mut inner = Inner {
            abi: WindowAbi {
                id: parts.id,
                flags: 0,
                local_base: parts.local_base as u64,
                local_size,
                sizes: 0,
                peer_bases: 0,
                keys: 0,
                addrs: 0,
            },
            rank: parts.rank,
            comm_id: parts.comm_id,
            sizes,
            peer_bases,
            keys: parts.keys.into_boxed_slice(),
            addrs: parts.addrs.into_boxed_slice(),
            states: parts.states.iter().map(|p| *p as usize).collect(),
            valid: AtomicBool::new(true),
            _owner: owner,
        };
        // Boxed slices do not move when the box moves: these addresses stay good.
        inner.abi.sizes = inner.sizes.as_ptr() as u64;
        inner.abi.peer_bases = inner.peer_bases.as_ptr() as u64;
        inner.abi.keys = inner.keys.as_ptr() as u64;
        inner.abi.addrs = inner.addrs.as_ptr() as u64;
        Self {
            inner: Arc::new(inner),
        }
    }

    /// A window of no bytes on one rank, with id `u32::MAX`, belonging to
    /// no communicator (`comm_id` 0): every access to it is out of bounds.
    /// A placeholder where a window must exist before the real one can be
    /// made.
    pub fn empty() -> Self {
        // SAFETY: an empty window: its sizes are 0, so no byte is ever
        // accessed through it; the base is dangling but aligned, and there
        // is no peer base or revocation word.
        unsafe {
            Self::from_parts(
                WindowParts {
                    id: u32::MAX,
                    rank: 0,
                    comm_id: 0,
                    local_base: std::ptr::NonNull::<u64>::dangling().as_ptr().cast(),
                    sizes: vec![0],
                    peer_bases: vec![std::ptr::null_mut()],
                    keys: vec![0],
                    addrs: vec![0],
                    states: vec![std::ptr::null()],
                },
                Box::new(()),
            )
        }
    }

    /// Same on every rank.
    pub fn id(&self) -> u32 {
        self.inner.abi.id
    }

    /// The communicator this window belongs to.
    pub fn comm_id(&self) -> u64 {
        self.inner.comm_id
    }

    /// This rank's size of the window.
    pub fn local_size(&self) -> u64 {
        self.inner.abi.local_size
    }

    /// `rank`'s size of the window (None for a rank outside the job).
    pub fn size_of(&self, rank: usize) -> Option<u64> {
        self.inner.sizes.get(rank).copied()
    }

    /// Every rank's size.
    pub fn sizes(&self) -> &[u64] {
        &self.inner.sizes
    }

    /// The start of this rank's part.
    pub fn as_ptr(&self) -> *mut u8 {
        self.inner.abi.local_base as *mut u8
    }

    /// The peer's part, mapped here for loads and stores, when a direct
    /// path exists (same-host shared memory).
    pub fn peer_ptr(&self, peer: usize) -> Option<*mut u8> {
        self.inner
            .peer_bases
            .get(peer)
            .copied()
            .filter(|&p| p != 0)
            .map(|p| p as *mut u8)
    }

    /// `rank`'s memory key for its part (0 where none).
    pub fn key_of(&self, rank: usize) -> u32 {
        self.inner.keys.get(rank).copied().unwrap_or(0)
    }

    /// `rank`'s address of its own part (what a work request names).
    pub fn addr_of(&self, rank: usize) -> u64 {
        self.inner.addrs.get(rank).copied().unwrap_or(0)
    }

    /// The ABI view a kernel receives.
    pub fn abi(&self) -> &WindowAbi {
        &self.inner.abi
    }

    /// False once the window was deregistered.
    pub fn is_valid(&self) -> bool {
        self.inner.valid.load(Ordering::Acquire)
    }

    /// Marks the window deregistered: later operations on it fail, and so
    /// do peers' direct operations on this rank's part (its revocation word
    /// is set). Called by the host layer once every rank has stopped using
    /// it.
    pub fn mark_deregistered(&self) {
        self.inner.valid.store(false, Ordering::Release);
        if let Some(s) = self.state(self.inner.rank) {
            s.store(1, Ordering::Release);
        }
    }

    /// `owner`'s revocation word, where it is mapped here.
    fn state(&self, owner: usize) -> Option<&AtomicU64> {
        let p = self.inner.states.get(owner).copied().filter(|&p| p != 0)?;
        // SAFETY: `from_parts` promises a non-null state is valid for atomic
        // access while `self` lives.
        Some(unsafe { &*(p as *const AtomicU64) })
    }

    /// Refuses `what` (`bytes` at `offset` of `owner`'s part) when the owner
    /// dropped or deregistered its part: one acquire load of a word that
    /// changes once, so it stays cached.
    #[inline]
    pub(crate) fn served(
        &self,
        what: &'static str,
        owner: usize,
        offset: u64,
        bytes: u64,
    ) -> Result<(), GinError> {
        match self.state(owner) {
            Some(s) if s.load(Ordering::Acquire) != 0 => {
                Err(self.refused(what, owner, offset, bytes))
            }
            _ => Ok(()),
        }
    }

    /// The error of [`Window::served`], out of the put's way.
    #[cold]
    #[inline(never)]
    fn refused(&self, what: &'static str, owner: usize, offset: u64, bytes: u64) -> GinError {
        GinError::Refused {
            rank: self.inner.rank,
            what,
            window: self.id(),
            owner,
            offset,
            bytes,
        }
    }

    /// Checks that the window is usable and that `[offset, offset + bytes)`
    /// lies within `owner`'s part.
    pub fn check(
        &self,
        what: &'static str,
        owner: usize,
        offset: u64,
        bytes: u64,
    ) -> Result<(), GinError> {
        let rank = self.inner.rank;
        if !self.is_valid() {
            return Err(GinError::Deregistered {
                rank,
                window: self.id(),
            });
        }
        let size = self.size_of(owner).ok_or(GinError::BadPeer {
            rank,
            peer: owner,
            nranks: self.inner.sizes.len(),
        })?;
        if offset.checked_add(bytes).is_none_or(|end| end > size) {
            return Err(GinError::OutOfWindow {
                rank,
                what,
                window: self.id(),
                owner,
                offset,
                bytes,
                size,
            });
        }
        Ok(())
    }

    /// Copies `data` into this rank's part at `offset`.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), GinError> {
        self.check("write", self.inner.rank, offset, data.len() as u64)?;
        // SAFETY: the range was checked against this rank's part, which
        // `from_parts` promises is mapped while `self` lives. `copy` tolerates
        // a source that aliases the window.
        unsafe {
            std::ptr::copy(
                data.as_ptr(),
                self.as_ptr().add(offset as usize),
                data.len(),
            );
        };
        Ok(())
    }

    /// Copies bytes of this rank's part at `offset` into `out`.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), GinError> {
        self.check("read", self.inner.rank, offset, out.len() as u64)?;
        // SAFETY: as in `write`.
        unsafe {
            std::ptr::copy(
                self.as_ptr().add(offset as usize),
                out.as_mut_ptr(),
                out.len(),
            );
        };
        Ok(())
    }

    /// `len` bytes of this rank's part at `offset`.
    pub fn read_vec(&self, offset: u64, len: usize) -> Result<Vec<u8>, GinError> {
        let mut v = vec![0; len];
        self.read(offset, &mut v)?;
        Ok(v)
    }

    /// The 8-byte slot at `offset` of this rank's part, as an atomic (for
    /// signals addressed by window offset).
    pub fn slot(&self, offset: u64) -> Result<&AtomicU64, GinError> {
        self.check("slot", self.inner.rank, offset, 8)?;
        if !offset.is_multiple_of(8) || !(self.as_ptr() as u64 + offset).is_multiple_of(8) {
            return Err(GinError::Misaligned {
                rank: self.inner.rank,
                what: "slot",
                window: self.id(),
                offset,
                align: 8,
            });
        }
        // SAFETY: in range, aligned, mapped while `self` lives; every access to
        // signal slots is atomic.
        Ok(unsafe { &*(self.as_ptr().add(offset as usize).cast::<AtomicU64>()) })
    }

    /// The peer's 8-byte slot at `offset`, through the direct mapping.
    pub(crate) fn peer_slot(&self, peer: usize, offset: u64) -> Option<&AtomicU64> {
        let base = self.peer_ptr(peer)?;
        if !offset.is_multiple_of(8)
            || !(base as u64 + offset).is_multiple_of(8)
            || offset + 8 > self.size_of(peer)?
        {
            return None;
        }
        // SAFETY: as in `slot`, for the peer's mapped part.
        Some(unsafe { &*(base.add(offset as usize).cast::<AtomicU64>()) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_window_refuses_every_access() {
        let w = Window::empty();
        assert_eq!((w.id(), w.local_size(), w.comm_id()), (u32::MAX, 0, 0));
        assert!(w.write(0, &[1]).is_err());
        assert!(w.read(0, &mut [0; 1]).is_err());
        assert!(w.slot(0).is_err());
        assert_eq!(w.peer_ptr(1), None);
    }
}
