//! Loads and stores on the buffer's windows: this rank's own parts, and the
//! parts of same-host peers that gin-core maps here (the load/store path the
//! high-throughput mode forwards over, as DeepEP forwards over NVLink).
//!
//! Every range is checked against the owner's size of the window first; an
//! offset out of range (which only a peer's bad slot index could produce) is
//! a protocol error naming the owner, never a stray access.

use gin_core::Window;

use crate::error::EpError;

/// This rank's view of the buffer's windows.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mem<'a> {
    pub(crate) wins: &'a [Window],
    pub(crate) rank: usize,
}

impl<'a> Mem<'a> {
    /// Whether `owner`'s part of window `w` is mapped here.
    pub(crate) fn mapped(&self, w: usize, owner: usize) -> bool {
        owner == self.rank || self.wins[w].peer_ptr(owner).is_some()
    }

    fn ptr(&self, w: usize, owner: usize, off: usize, len: usize) -> Result<*mut u8, EpError> {
        let win = &self.wins[w];
        let base = if owner == self.rank {
            Some(win.as_ptr())
        } else {
            win.peer_ptr(owner)
        };
        let size = win.size_of(owner).unwrap_or(0) as usize;
        match base {
            Some(b) if off.checked_add(len).is_some_and(|end| end <= size) => {
                // SAFETY: `off + len` is within the owner's part, which is
                // mapped at `b` while the window lives.
                Ok(unsafe { b.add(off) })
            }
            _ => Err(EpError::Protocol {
                rank: self.rank,
                peer: owner,
                what: format!(
                    "window {} bytes {off}..{} of rank {owner}: not mapped here or beyond its {size} bytes",
                    win.id(),
                    off.saturating_add(len)
                ),
            }),
        }
    }

    /// `len` bytes at `off` of `owner`'s part of window `w`, for reading.
    /// The protocol guarantees nobody writes the range while it is read: it
    /// was delivered before a signal already consumed, and is rewritten only
    /// after a later signal this rank has not sent yet.
    pub(crate) fn bytes(
        &self,
        w: usize,
        owner: usize,
        off: usize,
        len: usize,
    ) -> Result<&'a [u8], EpError> {
        let p = self.ptr(w, owner, off, len)?;
        // SAFETY: in range and mapped while the windows (borrowed for 'a)
        // live; no concurrent writer by the protocol (see above).
        Ok(unsafe { std::slice::from_raw_parts(p, len) })
    }

    /// Copies `src` to `off` of `owner`'s part of window `w`: a put over
    /// load/store, made visible to the owner by the next signal this rank
    /// sends it (signals release).
    pub(crate) fn write(
        &self,
        w: usize,
        owner: usize,
        off: usize,
        src: &[u8],
    ) -> Result<(), EpError> {
        let p = self.ptr(w, owner, off, src.len())?;
        // SAFETY: the destination is in range and mapped; the protocol gives
        // this rank the range alone until its signal (nobody reads or
        // writes it meanwhile), and `src` is a different range (a slot of
        // another window, or memory outside the windows).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), p, src.len()) };
        Ok(())
    }

    /// A mutable view of `len` bytes at `off` of this rank's own part of
    /// window `w`.
    ///
    /// # Safety
    /// No other reference to the range may live while the slice does, and no
    /// operation may read it (a put from it completed locally).
    pub(crate) unsafe fn own_mut(
        &self,
        w: usize,
        off: usize,
        len: usize,
    ) -> Result<&'a mut [u8], EpError> {
        let p = self.ptr(w, self.rank, off, len)?;
        // SAFETY: in range and mapped; exclusivity is the caller's promise.
        Ok(unsafe { std::slice::from_raw_parts_mut(p, len) })
    }
}
