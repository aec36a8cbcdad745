//! Shared-memory segments: files under `GIN_SHM_DIR` (default `/dev/shm`)
//! that same-host peers map by name.
//!
//! - A segment is created owner-only (mode 0600): another local user cannot
//!   read or write a job's windows.
//! - Its pages are reserved at creation (`posix_fallocate`): a segment that
//!   does not fit the directory's free space is an error naming the size,
//!   the directory and the space left, not a SIGBUS when a page is first
//!   touched (a 64 MiB Docker /dev/shm under a 256 MiB window).
//! - The name lives only while peers need it to map the segment: the host
//!   layer removes it once every peer has mapped it, and survivors remove the
//!   names of a registration that failed (see gin-core's `alloc_window`).
//! - A segment starts with a [`HEADER`] page before its data: its first
//!   word is the owner's *revocation word*, 0 while the owner serves the
//!   segment and non-zero once it dropped or deregistered it. Peers keep
//!   their mapping (memory-safe) but check the words of a put's data part
//!   and signal part before anything moves, and refuse the operation when
//!   either is set (see [`ShmTransport`] and gin-device's direct path).
//!
//! [`ShmTransport`] is the transport over such mappings: `shm` for
//! same-host peers, `local` for this rank's own parts.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use memmap2::{MmapMut, MmapOptions};

use crate::NetError;
use crate::transport::{AtomicOp, Reach, Registration, Scope, Target, Transport};
use crate::window::{Addr, KeepAlive, MemDesc};

/// Bytes before a segment's data: the header, whose first 8 bytes are the
/// revocation word. A whole page, so the data stays page-aligned.
pub const HEADER: usize = 4096;

/// A mapped segment (this rank's own, or a peer's): the header, then `len`
/// bytes of data.
#[derive(Debug)]
pub struct Segment {
    map: MmapMut,
    len: usize,
    path: PathBuf,
    owner: bool,
}

/// The directory segments live in.
pub fn shm_dir() -> PathBuf {
    std::env::var_os("GIN_SHM_DIR").map_or_else(|| PathBuf::from("/dev/shm"), PathBuf::from)
}

fn io(what: String) -> impl FnOnce(std::io::Error) -> NetError {
    move |e| NetError::Io { what, source: e }
}

/// Bytes an unprivileged writer may still allocate in `dir`'s file system.
pub fn free_space(dir: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::other("a path with a NUL byte"))?;
    // SAFETY: `statvfs` is plain data; all-zero is a valid value to overwrite.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a valid out-pointer.
    if unsafe { libc::statvfs(c.as_ptr(), &raw mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    #[allow(clippy::unnecessary_cast, clippy::useless_conversion)] // widths differ by platform
    Ok(u64::from(st.f_bavail) * st.f_frsize as u64)
}

/// Reserves the pages of a segment of `len` data bytes (and its header)
/// and sizes the file, so later touches cannot fail for lack of space.
fn reserve(file: &File, len: usize, path: &Path) -> Result<(), NetError> {
    use std::os::fd::AsRawFd;
    let Some(n) = len
        .checked_add(HEADER)
        .and_then(|t| libc::off_t::try_from(t).ok())
    else {
        return Err(NetError::SegmentTooLarge { len });
    };
    loop {
        // SAFETY: the descriptor is open for writing for the whole call.
        let r = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, n) };
        match r {
            0 => return Ok(()),
            libc::EINTR => {}
            // The file system cannot reserve (not a tmpfs): size the file,
            // the pages come on first touch as before.
            libc::EOPNOTSUPP | libc::EINVAL => {
                tracing::debug!(path = %path.display(), "shared memory cannot be reserved here; sized only");
                return file.set_len(n as u64).map_err(io(format!(
                    "sizing shared memory {} to {n} bytes",
                    path.display()
                )));
            }
            e => {
                let dir = path.parent().unwrap_or(Path::new("/"));
                let free = free_space(dir).map_or_else(
                    |e| format!("unknown free space ({e})"),
                    |b| format!("{b} bytes ({:.1} MiB) free", b as f64 / 1_048_576.0),
                );
                return Err(NetError::Io {
                    what: format!(
                        "reserving {len} bytes ({:.1} MiB, and a {HEADER}-byte header) of shared memory in {} ({free}; set GIN_SHM_DIR to a larger directory or enlarge this one, e.g. docker run --shm-size)",
                        len as f64 / 1_048_576.0,
                        dir.display()
                    ),
                    source: std::io::Error::from_raw_os_error(e),
                });
            }
        }
    }
}

impl Segment {
    /// Creates and maps a zeroed segment of `len` bytes (after its header)
    /// named `name`, owner-only, its pages reserved.
    pub fn create(name: &str, len: usize) -> Result<Self, NetError> {
        let path = shm_dir().join(name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(io(format!("creating shared memory {}", path.display())))?;
        match reserve(&file, len, &path).and_then(|()| Self::map(&file, path.clone(), len, true)) {
            Ok(s) => Ok(s),
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                Err(e)
            }
        }
    }

    /// Maps a peer's segment of `len` bytes.
    pub fn open(path: &Path, len: usize) -> Result<Self, NetError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(io(format!(
                "opening a peer's shared memory {}",
                path.display()
            )))?;
        let have = file
            .metadata()
            .map_err(io(format!("inspecting {}", path.display())))?
            .len();
        if have < (len as u64).saturating_add(HEADER as u64) {
            return Err(NetError::SegmentTooSmall {
                path: path.to_owned(),
                have,
                want: len,
                header: HEADER,
            });
        }
        Self::map(&file, path.to_owned(), len, false)
    }

    fn map(file: &File, path: PathBuf, len: usize, owner: bool) -> Result<Self, NetError> {
        let total = len
            .checked_add(HEADER)
            .ok_or(NetError::SegmentTooLarge { len })?;
        // SAFETY: the file is a shared-memory segment of this job; other
        // processes write it concurrently by design, and every access goes
        // through raw pointers or atomics, never through `&[u8]` borrows
        // held across such writes.
        let map = unsafe { MmapOptions::new().len(total).map_mut(file) }
            .map_err(io(format!("mapping {}", path.display())))?;
        Ok(Self {
            map,
            len,
            path,
            owner,
        })
    }

    /// Start of the data (page-aligned, after the header).
    pub fn as_ptr(&self) -> *mut u8 {
        // SAFETY: the mapping is `HEADER + len` bytes long.
        unsafe { self.map.as_ptr().cast_mut().add(HEADER) }
    }

    /// The owner's revocation word, shared by every process that mapped the
    /// segment: 0 while the owner serves it, non-zero once it dropped or
    /// deregistered it (the host layer stores it).
    pub fn state(&self) -> &AtomicU64 {
        // SAFETY: the header's first 8 bytes, page-aligned, mapped while
        // `self` lives and only ever accessed atomically.
        unsafe { &*self.map.as_ptr().cast::<AtomicU64>() }
    }

    /// Data bytes (after the header).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the segment has no data bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where peers find it.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Removes the name (peers that mapped it keep their mapping).
    pub fn unlink(&mut self) {
        if self.owner {
            let _ = std::fs::remove_file(&self.path);
            self.owner = false;
        }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        self.unlink();
    }
}

/// The transport over mapped memory: `shm` reaches same-host peers through
/// their segments mapped here ([`MemParts::peer_bases`](crate::MemParts::peer_bases)), `local` this
/// rank's own parts ([`MemParts::local_base`](crate::MemParts::local_base)). Operations are copies and
/// atomics on the mapping, complete on return; a part whose owner set its
/// revocation word is refused before anything moves, and GPU memory is
/// never touched.
#[derive(Debug)]
pub struct ShmTransport {
    name: &'static str,
    own: bool,
}

/// How the fabric finds and starts the shm transport.
pub const REGISTRATION: Registration = Registration {
    name: "shm",
    scope: Scope::Host,
    start: |_, _| Ok(Arc::new(ShmTransport::peers())),
};

impl ShmTransport {
    /// The `shm` transport, for same-host peers.
    pub fn peers() -> Self {
        Self {
            name: "shm",
            own: false,
        }
    }

    /// The `local` transport, for this rank itself.
    pub fn local() -> Self {
        Self {
            name: "local",
            own: true,
        }
    }

    /// The address of `len` bytes at `t` on `peer` in this process, after
    /// every check: in range, host memory, mapped, not revoked.
    fn resolve(
        &self,
        peer: usize,
        t: Target<'_>,
        op: &'static str,
        len: u64,
    ) -> Result<*mut u8, NetError> {
        let (d, a) = t.window(self.name)?;
        t.check_range(peer, len)?;
        t.host(peer, self.name)?;
        served(d, peer, a, op, len)?;
        let base = if self.own {
            d.local_base
        } else {
            d.peer_bases.get(peer).copied().unwrap_or(0)
        };
        if base == 0 {
            return Err(NetError::NotMapped {
                peer,
                window: a.window,
            });
        }
        Ok((base + a.offset as usize) as *mut u8)
    }

    /// [`ShmTransport::resolve`] for an 8-byte word that must be aligned.
    fn word(&self, peer: usize, t: Target<'_>, what: &'static str) -> Result<&AtomicU64, NetError> {
        let p = self.resolve(peer, t, what, 8)?;
        if !(p as usize).is_multiple_of(8) {
            let (_, a) = t.window(self.name)?;
            return Err(NetError::Misaligned {
                peer,
                window: a.window,
                offset: a.offset,
                what,
            });
        }
        // SAFETY: resolved within a mapped part (the description's
        // contract), 8-byte aligned; such words are only accessed
        // atomically.
        Ok(unsafe { &*p.cast::<AtomicU64>() })
    }
}

/// Refuses `op` (`len` bytes at `a`) when `peer` revoked its part of `w`:
/// one acquire load of a word that changes once, so it stays in this
/// core's cache.
fn served(w: &MemDesc, peer: usize, a: Addr, op: &'static str, len: u64) -> Result<(), NetError> {
    let state = w.states.get(peer).copied().unwrap_or(0);
    // SAFETY: a non-zero state is a revocation word the description vouches
    // for: mapped, 8-byte aligned and only accessed atomically.
    if state != 0 && unsafe { &*(state as *const AtomicU64) }.load(Ordering::Acquire) != 0 {
        return Err(NetError::Revoked {
            peer,
            window: a.window,
            offset: a.offset,
            len,
            op,
        });
    }
    Ok(())
}

impl Transport for ShmTransport {
    fn name(&self) -> &'static str {
        self.name
    }

    fn reach(&self) -> Reach {
        Reach::Mapped
    }

    fn put(
        &self,
        peer: usize,
        dst: Target<'_>,
        src: &[u8],
        sig: Option<(Target<'_>, u64)>,
    ) -> Result<(), NetError> {
        // Both parts are resolved and checked before anything moves, as a
        // tcp target checks a put and its signal: a refusal is whole.
        // A signal-only put needs its data part served, not mapped.
        let d = if src.is_empty() {
            let (w, a) = dst.window(self.name)?;
            dst.check_range(peer, 0)?;
            served(w, peer, a, "put", 0)?;
            None
        } else {
            Some(self.resolve(peer, dst, "put", src.len() as u64)?)
        };
        let s = match sig {
            Some((t, v)) => Some((self.word(peer, t, "signal")?, v)),
            None => None,
        };
        if let Some(d) = d {
            // SAFETY: `d` starts `src.len()` bytes within a mapped part.
            unsafe { std::ptr::copy(src.as_ptr(), d, src.len()) };
        }
        if let Some((w, v)) = s {
            w.fetch_add(v, Ordering::Release);
        }
        Ok(())
    }

    unsafe fn get(
        &self,
        peer: usize,
        src: Target<'_>,
        dst: *mut u8,
        len: u64,
        done: &Arc<AtomicU64>,
        _keep: Option<KeepAlive>,
    ) -> Result<(), NetError> {
        let s = self.resolve(peer, src, "get", len)?;
        // SAFETY: the source range is within a mapped part; the caller
        // promised the destination.
        unsafe { std::ptr::copy(s, dst, len as usize) };
        std::sync::atomic::fence(Ordering::Acquire);
        done.fetch_sub(1, Ordering::AcqRel);
        Ok(())
    }

    fn read(
        &self,
        peer: usize,
        src: Target<'_>,
        out: &mut [u8],
        _timeout: Duration,
    ) -> Result<(), NetError> {
        let s = self.resolve(peer, src, "get", out.len() as u64)?;
        // SAFETY: the source range is within a mapped part; `out` is ours.
        unsafe { std::ptr::copy(s, out.as_mut_ptr(), out.len()) };
        std::sync::atomic::fence(Ordering::Acquire);
        Ok(())
    }

    fn atomic(
        &self,
        peer: usize,
        at: Target<'_>,
        op: AtomicOp,
        _timeout: Duration,
    ) -> Result<u64, NetError> {
        let w = self.word(peer, at, "atomic")?;
        Ok(match op {
            AtomicOp::FetchAdd(v) => w.fetch_add(v, Ordering::AcqRel),
            AtomicOp::CompareSwap { expected, desired } => {
                match w.compare_exchange(expected, desired, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(v) | Err(v) => v,
                }
            }
        })
    }

    fn fence(&self, _peer: usize, _timeout: Duration) -> Result<(), NetError> {
        Ok(())
    }

    fn confirm(&self, _peer: usize, _timeout: Duration) -> Result<(), NetError> {
        Ok(())
    }

    fn health(&self, _peer: usize) -> Result<(), NetError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;
    use std::sync::atomic::Ordering;

    #[test]
    fn a_revocation_is_seen_through_every_mapping_and_the_data_follows_the_header() {
        let name = format!("gin-test-revoke-{}", std::process::id());
        let mut own = Segment::create(&name, 64).unwrap();
        let peer = Segment::open(own.path(), 64).unwrap();
        own.unlink();
        assert!((own.as_ptr() as usize).is_multiple_of(HEADER));
        assert_eq!(peer.state().load(Ordering::Acquire), 0);
        // SAFETY: 64 data bytes, mapped here.
        unsafe { own.as_ptr().add(63).write(7) };
        own.state().store(1, Ordering::Release);
        assert_eq!(peer.state().load(Ordering::Acquire), 1);
        // SAFETY: as above, through the other mapping.
        assert_eq!(unsafe { peer.as_ptr().add(63).read() }, 7);
        // An empty segment still has its word.
        let mut empty = Segment::create(&format!("{name}-empty"), 0).unwrap();
        empty.unlink();
        assert_eq!(empty.state().load(Ordering::Acquire), 0);
    }

    #[test]
    fn segments_are_created_owner_only() {
        let name = format!("gin-test-mode-{}", std::process::id());
        let mut seg = Segment::create(&name, 4096).unwrap();
        let mode = std::fs::metadata(seg.path()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "mode {mode:o}");
        seg.unlink();
    }
}
