//! Shared-memory segments: files under `GIN_SHM_DIR` (default `/dev/shm`)
//! that same-host peers map by name. The creator removes the name once every
//! peer has mapped it, so nothing is left behind after a crash past set-up.

use std::fs::{File, OpenOptions};
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

impl Segment {
    /// Creates and maps a zeroed segment of `len` bytes named `name`.
    pub fn create(name: &str, len: usize) -> Result<Self, NetError> {
        let path = shm_dir().join(name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(io(format!("creating shared memory {}", path.display())))?;
        file.set_len(len as u64).map_err(io(format!(
            "sizing shared memory {} to {len} bytes",
            path.display()
        )))?;
        Self::map(&file, path, len, true)
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
