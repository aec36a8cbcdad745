//! The window directory's entries: what one registered window looks like
//! on every rank, for CPU ranks (host memory) and CUDA ranks (GPU memory)
//! alike.
//!
//! A [`MemDesc`] is made only through [`MemDesc::new`], which is `unsafe`:
//! its caller vouches that the addresses in it are what they claim to be.
//! From then on the description is immutable (it dereferences to its
//! [`MemParts`] for reading), so a safe fabric operation that takes one
//! never touches memory nobody registered.

use std::sync::Arc;

/// Keeps a window's memory mapped while anything holds its description:
/// an operation that looked the window up before its owner dropped it
/// finishes on memory that is still there.
#[derive(Clone)]
pub struct KeepAlive(pub Arc<dyn std::any::Any + Send + Sync>);

impl std::fmt::Debug for KeepAlive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeepAlive")
    }
}

/// What kind of memory a window's parts are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Memory {
    /// Host memory: the fabric loads and stores mapped parts itself.
    #[default]
    Host,
    /// GPU memory: bases are device addresses, meaningless to the host.
    /// The fabric never loads or stores them; it reaches such parts only
    /// over keyed transports (whose targets copy them with the GPU), and
    /// the GPU's engines use the mapped bases themselves.
    Device,
}

/// A window's description as plain data: every rank's part, indexed by
/// rank. Zeros mean "none" (not mapped here, not served, no revocation
/// word).
#[derive(Debug, Clone, Default)]
pub struct MemParts {
    /// Host or GPU memory.
    pub memory: Memory,
    /// This rank's part, in this process (a device address for GPU
    /// memory).
    pub local_base: usize,
    /// Every rank's size.
    pub sizes: Vec<u64>,
    /// Each peer's part mapped here (0: not mapped; device addresses for
    /// GPU memory).
    pub peer_bases: Vec<usize>,
    /// Each rank's key for its part (0: not served over keyed transports).
    pub keys: Vec<u32>,
    /// Each rank's address of its own part, in its own address space: what
    /// an RDMA work request names as the remote address (with the key).
    pub addrs: Vec<u64>,
    /// Each rank's revocation word mapped here (0: none; see
    /// [`crate::shm::HEADER`]): non-zero once its owner dropped or
    /// deregistered its part. The shm and local paths refuse an operation
    /// on a part whose word is set.
    pub states: Vec<usize>,
    /// What keeps `local_base`, `peer_bases` and `states` mapped (`None`:
    /// their owner outlives every user of the description some other way).
    pub keep: Option<KeepAlive>,
}

/// A registered window as the fabric sees it: [`MemParts`] whose addresses
/// someone vouched for. Read its fields through `Deref`; it cannot be
/// changed once made.
#[derive(Debug, Clone)]
pub struct MemDesc {
    parts: MemParts,
    /// `parts.keep` owns this rank's part ([`MemDesc::keeping_local`]).
    keeps_local: bool,
}

impl MemDesc {
    /// Vouches for `parts`.
    ///
    /// # Safety
    /// For as long as this description or any clone of it exists:
    /// - where `parts.memory` is [`Memory::Host`], `local_base` (when
    ///   non-zero) points to this rank's part and each non-zero
    ///   `peer_bases[p]` to a mapping of rank `p`'s part, each valid for
    ///   reads, writes and 8-byte atomics of that part's size
    ///   (`sizes[rank]`, `sizes[p]`), and memory that other processes or
    ///   threads write concurrently is never also borrowed as `&[u8]` or
    ///   `&mut [u8]`;
    /// - where it is [`Memory::Device`], the same holds for device memory
    ///   (the fabric never dereferences these bases, but the GPU engines
    ///   that read them from the directory copy to and from them);
    /// - each non-zero `states[p]` points to an 8-byte aligned word that is
    ///   only ever accessed atomically.
    ///
    /// `keep`, when set, is what keeps all of them alive.
    pub unsafe fn new(parts: MemParts) -> Self {
        Self {
            parts,
            keeps_local: false,
        }
    }

    /// Says that `keep` owns this rank's part itself, not only the
    /// mappings around it: while any clone of `keep` lives, the part stays
    /// valid for reads whatever its owner does (a segment gin-net created,
    /// not a caller's buffer it registered). Only then may a put lend the
    /// part to a transport that reads it after the put returned
    /// ([`crate::Fabric::start_put_in`]): such a put can outlive its
    /// failed wait holding only `keep`.
    ///
    /// # Safety
    /// `parts.keep` is set and keeps `local_base`'s `sizes[rank]` bytes
    /// valid for reads for as long as any clone of it exists, even after
    /// every other handle of the window dropped.
    #[must_use]
    pub unsafe fn keeping_local(mut self) -> Self {
        self.keeps_local = true;
        self
    }

    /// Whether `keep` owns this rank's part ([`MemDesc::keeping_local`]):
    /// a put may lend it to the transport rather than copy it.
    pub fn keeps_local(&self) -> bool {
        self.keeps_local && self.parts.keep.is_some()
    }

    /// The plain parts.
    pub fn parts(&self) -> &MemParts {
        &self.parts
    }

    /// Rank `p`'s size (0 for a rank the window does not know).
    pub fn size_of(&self, p: usize) -> u64 {
        self.parts.sizes.get(p).copied().unwrap_or(0)
    }

    /// Rank `p`'s key (0: not served).
    pub fn key_of(&self, p: usize) -> u32 {
        self.parts.keys.get(p).copied().unwrap_or(0)
    }

    /// Rank `p`'s part mapped here (0: not mapped), as an address.
    pub fn peer_addr(&self, p: usize) -> u64 {
        self.parts.peer_bases.get(p).copied().unwrap_or(0) as u64
    }

    /// This rank's part, as an address.
    pub fn local_addr(&self) -> u64 {
        self.parts.local_base as u64
    }
}

impl std::ops::Deref for MemDesc {
    type Target = MemParts;
    fn deref(&self) -> &MemParts {
        &self.parts
    }
}

/// A (window, offset) address on some rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Addr {
    /// The window id.
    pub window: u32,
    /// Offset in the rank's part.
    pub offset: u64,
}

/// Memory a transport allocated for this rank's part of a host window
/// ([`crate::Transport::alloc_host`]): zeroed, 8-byte aligned, valid for
/// reads and writes of its length until it drops, which frees it. Its
/// pointer stays private; gin-net's host windows register it as they
/// register a segment.
pub struct HostMemory {
    ptr: *mut u8,
    len: usize,
    /// Frees the memory when dropped (the transport's handle).
    _owner: Box<dyn std::any::Any + Send + Sync>,
}

// SAFETY: the memory is plain host memory reached through raw pointers and
// atomics only; the owner is `Send + Sync`.
unsafe impl Send for HostMemory {}
// SAFETY: as above.
unsafe impl Sync for HostMemory {}

impl HostMemory {
    /// Memory at `ptr` of `len` bytes, freed when `owner` drops.
    ///
    /// # Safety
    /// `ptr` must be 8-byte aligned, zeroed and valid for reads and writes
    /// of `len` bytes by this process (and by whoever the transport lets
    /// write it) until `owner` drops, and nothing else may free it.
    pub unsafe fn new(
        ptr: *mut u8,
        len: usize,
        owner: Box<dyn std::any::Any + Send + Sync>,
    ) -> Self {
        Self {
            ptr,
            len,
            _owner: owner,
        }
    }

    /// Its address.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl std::fmt::Debug for HostMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostMemory")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}
