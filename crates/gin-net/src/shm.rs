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

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use memmap2::{MmapMut, MmapOptions};

use crate::NetError;

/// A mapped segment (this rank's own, or a peer's).
#[derive(Debug)]
pub struct Segment {
    map: Option<MmapMut>,
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

/// Reserves the pages of `file`'s first `len` bytes (and sizes it), so
/// later touches cannot fail for lack of space.
fn reserve(file: &File, len: usize, path: &Path) -> Result<(), NetError> {
    use std::os::fd::AsRawFd;
    let Ok(n) = libc::off_t::try_from(len) else {
        return Err(NetError::Invalid(format!(
            "a shared-memory segment of {len} bytes is larger than a file can be"
        )));
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
                return file.set_len(len as u64).map_err(io(format!(
                    "sizing shared memory {} to {len} bytes",
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
                        "reserving {len} bytes ({:.1} MiB) of shared memory in {} ({free}; set GIN_SHM_DIR to a larger directory or enlarge this one, e.g. docker run --shm-size)",
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
    /// Creates and maps a zeroed segment of `len` bytes named `name`,
    /// owner-only, its pages reserved.
    pub fn create(name: &str, len: usize) -> Result<Self, NetError> {
        let path = shm_dir().join(name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(io(format!("creating shared memory {}", path.display())))?;
        let r = if len == 0 {
            Ok(())
        } else {
            reserve(&file, len, &path)
        };
        match r.and_then(|()| Self::map(&file, path.clone(), len, true)) {
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
        if have < len as u64 {
            return Err(NetError::Invalid(format!(
                "peer's shared memory {} has {have} bytes, expected {len}",
                path.display()
            )));
        }
        Self::map(&file, path.to_owned(), len, false)
    }

    fn map(file: &File, path: PathBuf, len: usize, owner: bool) -> Result<Self, NetError> {
        let map = if len == 0 {
            None
        } else {
            // SAFETY: the file is a shared-memory segment of this job; other
            // processes write it concurrently by design, and every access goes
            // through raw pointers or atomics, never through `&[u8]` borrows
            // held across such writes.
            Some(
                unsafe { MmapOptions::new().len(len).map_mut(file) }
                    .map_err(io(format!("mapping {}", path.display())))?,
            )
        };
        Ok(Self {
            map,
            len,
            path,
            owner,
        })
    }

    /// Start of the mapping (a dangling, aligned pointer when empty).
    pub fn as_ptr(&self) -> *mut u8 {
        self.map
            .as_ref()
            .map_or(std::ptr::NonNull::<u64>::dangling().as_ptr().cast(), |m| {
                m.as_ptr().cast_mut()
            })
    }

    pub fn len(&self) -> usize {
        self.len
    }

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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn segments_are_created_owner_only() {
        let name = format!("gin-test-mode-{}", std::process::id());
        let mut seg = Segment::create(&name, 4096).unwrap();
        let mode = std::fs::metadata(seg.path()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "mode {mode:o}");
        seg.unlink();
    }
}
