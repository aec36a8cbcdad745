//! One rank's view of the fabric: which path reaches each peer, and what
//! every registered window looks like on every rank (addresses and keys).
//! Backends execute one-sided operations through [`Fabric`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use crate::NetError;
use crate::region::RegionTable;
use crate::tcp::{Link, TcpTransport};

/// How a peer is reached.
#[derive(Debug, Clone)]
pub enum Path {
    /// This rank itself.
    Local,
    /// Same host: the peer's window parts are mapped here.
    Shm,
    /// Over the TCP transport.
    Tcp(Arc<Link>),
}

impl Path {
    pub fn name(&self) -> &'static str {
        match self {
            Self::Local => "local",
            Self::Shm => "shm",
            Self::Tcp(_) => "tcp",
        }
    }
}

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

/// A registered window as the fabric sees it.
#[derive(Debug, Clone)]
pub struct MemDesc {
    /// This rank's part.
    pub local_base: usize,
    /// Every rank's size.
    pub sizes: Vec<u64>,
    /// Each peer's part mapped here (0: not mapped).
    pub peer_bases: Vec<usize>,
    /// Each rank's key for its part (0: not served over TCP).
    pub keys: Vec<u32>,
    /// Each rank's address of its own part, in its own address space: what
    /// an RDMA work request names as the remote address (with the key).
    pub addrs: Vec<u64>,
    /// Each rank's revocation word mapped here (0: none; see
    /// [`crate::shm::HEADER`]): non-zero once its owner dropped or
    /// deregistered its part. The local and shm paths refuse an operation
    /// on a part whose word is set.
    pub states: Vec<usize>,
    /// What keeps `local_base` and `peer_bases` mapped (`None`: their owner
    /// outlives every user some other way).
    pub keep: Option<KeepAlive>,
}

/// A (window, offset) address on some rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Addr {
    pub window: u32,
    pub offset: u64,
}

/// The fabric of one rank.
#[derive(Debug)]
pub struct Fabric {
    rank: usize,
    paths: Vec<Path>,
    table: Arc<RegionTable>,
    windows: RwLock<HashMap<u32, Arc<MemDesc>>>,
    /// Bumped whenever a window is added or removed: caches of the directory
    /// (a NIC's) compare it to know they are stale.
    generation: AtomicU64,
    _tcp: Option<TcpTransport>,
    timeout: Duration,
}

impl Fabric {
    /// Assembles a fabric from the paths the host layer chose.
    pub fn new(
        rank: usize,
        paths: Vec<Path>,
        table: Arc<RegionTable>,
        tcp: Option<TcpTransport>,
        timeout: Duration,
    ) -> Self {
        Self {
            rank,
            paths,
            table,
            windows: RwLock::new(HashMap::new()),
            generation: AtomicU64::new(0),
            _tcp: tcp,
            timeout,
        }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn nranks(&self) -> usize {
        self.paths.len()
    }

    /// The path to `peer`.
    pub fn path(&self, peer: usize) -> Option<&Path> {
        self.paths.get(peer)
    }

    /// The region table this rank serves remote requests from.
    pub fn table(&self) -> &Arc<RegionTable> {
        &self.table
    }

    /// Makes a window known to the fabric.
    pub fn add_window(&self, id: u32, desc: MemDesc) {
        self.windows
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(id, Arc::new(desc));
        self.generation.fetch_add(1, Ordering::Release);
    }

    /// Changes whenever the window directory changes.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Forgets a window.
    pub fn remove_window(&self, id: u32) {
        self.windows
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&id);
        self.generation.fetch_add(1, Ordering::Release);
    }

    /// Every registered window.
    pub fn windows(&self) -> Vec<(u32, Arc<MemDesc>)> {
        self.windows
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .map(|(k, v)| (*k, v.clone()))
            .collect()
    }

    /// A window's description.
    pub fn window(&self, id: u32) -> Result<Arc<MemDesc>, NetError> {
        self.windows
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&id)
            .cloned()
            .ok_or_else(|| {
                NetError::Invalid(format!("window {id} is not registered with the fabric"))
            })
    }

    /// Checks `len` bytes at `a` against `peer`'s part of `w`; the path to `peer`.
    fn check(&self, w: &MemDesc, peer: usize, a: Addr, len: u64) -> Result<&Path, NetError> {
        let path = self
            .paths
            .get(peer)
            .ok_or_else(|| NetError::Invalid(format!("no path to rank {peer}")))?;
        let size = w.sizes.get(peer).copied().unwrap_or(0);
        if a.offset.checked_add(len).is_none_or(|e| e > size) {
            return Err(NetError::Invalid(format!(
                "{len} bytes at offset {} exceed rank {peer}'s {size} bytes of window {}",
                a.offset, a.window
            )));
        }
        Ok(path)
    }

    /// The address of `(window, offset)` on `peer` in this process, for the
    /// local and shm paths.
    fn mapped(w: &MemDesc, peer: usize, path: &Path, a: Addr) -> Result<*mut u8, NetError> {
        let base = match path {
            Path::Local => w.local_base,
            Path::Shm => w.peer_bases.get(peer).copied().unwrap_or(0),
            Path::Tcp(_) => 0,
        };
        if base == 0 {
            return Err(NetError::Invalid(format!(
                "window {} of rank {peer} is not mapped here",
                a.window
            )));
        }
        Ok((base + a.offset as usize) as *mut u8)
    }

    /// Refuses `what` (`len` bytes at `a`) when `peer` revoked its part of
    /// `w`: one acquire load of a word that changes once, so it stays in
    /// this core's cache.
    fn served(w: &MemDesc, peer: usize, a: Addr, what: &str, len: u64) -> Result<(), NetError> {
        let state = w.states.get(peer).copied().unwrap_or(0);
        // SAFETY: a non-zero state is the revocation word of a segment that
        // `w.keep` keeps mapped, 8-byte aligned and only accessed atomically.
        if state != 0 && unsafe { &*(state as *const AtomicU64) }.load(Ordering::Acquire) != 0 {
            return Err(NetError::Remote {
                peer,
                why: format!(
                    "{what} of {len} bytes at offset {} of window {} refused: rank {peer} dropped or deregistered its part",
                    a.offset, a.window
                ),
            });
        }
        Ok(())
    }

    /// Writes `src` to `dst` on `peer`, then adds `sig.1` to the 8-byte slot
    /// `sig.0` on `peer` with release ordering (the data is visible first).
    /// Complete locally on return. On the local and shm paths, when the
    /// owner revoked the data's part or the signal's, the put is refused
    /// before anything moves: a signal is never applied for refused data.
    pub fn put(
        &self,
        peer: usize,
        dst: Addr,
        src: &[u8],
        sig: Option<(Addr, u64)>,
    ) -> Result<(), NetError> {
        let w = self.window(dst.window)?;
        let sw = match sig {
            Some((a, v)) => Some((self.window(a.window)?, a, v)),
            None => None,
        };
        self.put_in(
            peer,
            (&w, dst),
            src,
            sw.as_ref().map(|(d, a, v)| (&**d, *a, *v)),
        )
    }

    /// [`Fabric::put`] with the windows' descriptions already in hand (a
    /// NIC caches them; no directory lookup on the data path).
    pub fn put_in(
        &self,
        peer: usize,
        (w, dst): (&MemDesc, Addr),
        src: &[u8],
        sig: Option<(&MemDesc, Addr, u64)>,
    ) -> Result<(), NetError> {
        let path = self.check(w, peer, dst, src.len() as u64)?;
        if let Some((sw, a, _)) = sig {
            self.check(sw, peer, a, 8)?;
        }
        match path {
            Path::Local | Path::Shm => {
                // Both parts are checked before anything moves, as a tcp
                // target checks a put and its signal: a refusal is whole.
                Self::served(w, peer, dst, "put", src.len() as u64)?;
                if let Some((sw, a, _)) = sig {
                    Self::served(sw, peer, a, "signal", 8)?;
                }
                if !src.is_empty() {
                    let d = Self::mapped(w, peer, path, dst)?;
                    // SAFETY: `check` tested the range against the peer's
                    // size; the mapping lives while the window is registered.
                    unsafe { std::ptr::copy(src.as_ptr(), d, src.len()) };
                }
                if let Some((sw, a, v)) = sig {
                    let p = Self::mapped(sw, peer, path, a)?;
                    if !(p as usize).is_multiple_of(8) {
                        return Err(NetError::Invalid(format!(
                            "signal at offset {} is not aligned",
                            a.offset
                        )));
                    }
                    // SAFETY: in range, aligned; signal slots are only accessed atomically.
                    unsafe { (*p.cast::<AtomicU64>()).fetch_add(v, Ordering::Release) };
                }
                Ok(())
            }
            Path::Tcp(link) => {
                let key = w.keys.get(peer).copied().unwrap_or(0);
                let sig =
                    sig.map(|(sw, a, v)| (sw.keys.get(peer).copied().unwrap_or(0), a.offset, v));
                link.put(key, dst.offset, src, sig)
                    .map_err(|e| self.name_window(e))
            }
        }
    }

    /// Reads `len` bytes at `src` on `peer` into `dst`. `done` is decremented
    /// when the data has landed; the caller increments it first. `keep` (the
    /// destination window's [`MemDesc::keep`]) is held until the data has
    /// landed or the read has failed, so a read still in flight when its
    /// destination window is dropped lands in memory that is still mapped.
    ///
    /// # Safety
    /// `dst` must be valid for writes of `len` bytes until `done` drops, or,
    /// if the caller may stop waiting before that, for as long as `keep`
    /// lives.
    pub unsafe fn get(
        &self,
        peer: usize,
        src: Addr,
        dst: *mut u8,
        len: u64,
        done: &Arc<AtomicU64>,
        keep: Option<KeepAlive>,
    ) -> Result<(), NetError> {
        let w = self.window(src.window)?;
        // SAFETY: forwarded from the caller.
        unsafe { self.get_in(peer, (&w, src), dst, len, done, keep) }
    }

    /// [`Fabric::get`] with the window's description in hand.
    ///
    /// # Safety
    /// As for [`Fabric::get`].
    pub unsafe fn get_in(
        &self,
        peer: usize,
        (w, src): (&MemDesc, Addr),
        dst: *mut u8,
        len: u64,
        done: &Arc<AtomicU64>,
        keep: Option<KeepAlive>,
    ) -> Result<(), NetError> {
        let path = self.check(w, peer, src, len)?;
        match path {
            Path::Local | Path::Shm => {
                Self::served(w, peer, src, "get", len)?;
                let s = Self::mapped(w, peer, path, src)?;
                // SAFETY: source range checked; destination promised by the caller.
                unsafe { std::ptr::copy(s, dst, len as usize) };
                std::sync::atomic::fence(Ordering::Acquire);
                done.fetch_sub(1, Ordering::AcqRel);
                Ok(())
            }
            Path::Tcp(link) => {
                let key = w.keys.get(peer).copied().unwrap_or(0);
                // SAFETY: forwarded from the caller.
                unsafe { link.get(key, src.offset, len, dst, done.clone(), keep) }
            }
        }
    }

    /// Atomic fetch-add on `peer`; returns the old value.
    pub fn fetch_add(&self, peer: usize, at: Addr, v: u64) -> Result<u64, NetError> {
        let w = self.window(at.window)?;
        self.fetch_add_in(peer, (&w, at), v)
    }

    /// [`Fabric::fetch_add`] with the window's description in hand.
    pub fn fetch_add_in(
        &self,
        peer: usize,
        (w, at): (&MemDesc, Addr),
        v: u64,
    ) -> Result<u64, NetError> {
        self.atomic(
            peer,
            w,
            at,
            |a| a.fetch_add(v, Ordering::AcqRel),
            |l, k| l.fetch_add(k, at.offset, v, self.timeout),
        )
    }

    /// Atomic compare-and-swap on `peer`; returns the old value.
    pub fn compare_swap(
        &self,
        peer: usize,
        at: Addr,
        expected: u64,
        desired: u64,
    ) -> Result<u64, NetError> {
        let w = self.window(at.window)?;
        self.compare_swap_in(peer, (&w, at), expected, desired)
    }

    /// [`Fabric::compare_swap`] with the window's description in hand.
    pub fn compare_swap_in(
        &self,
        peer: usize,
        (w, at): (&MemDesc, Addr),
        expected: u64,
        desired: u64,
    ) -> Result<u64, NetError> {
        self.atomic(
            peer,
            w,
            at,
            |a| match a.compare_exchange(expected, desired, Ordering::AcqRel, Ordering::Acquire) {
                Ok(v) | Err(v) => v,
            },
            |l, k| l.compare_swap(k, at.offset, expected, desired, self.timeout),
        )
    }

    fn atomic(
        &self,
        peer: usize,
        w: &MemDesc,
        at: Addr,
        mem: impl FnOnce(&AtomicU64) -> u64,
        net: impl FnOnce(&Link, u32) -> Result<u64, NetError>,
    ) -> Result<u64, NetError> {
        let path = self.check(w, peer, at, 8)?;
        match path {
            Path::Local | Path::Shm => {
                Self::served(w, peer, at, "atomic", 8)?;
                let p = Self::mapped(w, peer, path, at)?;
                if !(p as usize).is_multiple_of(8) {
                    return Err(NetError::Invalid(format!(
                        "atomic at offset {} is not aligned",
                        at.offset
                    )));
                }
                // SAFETY: in range and aligned; atomics only.
                Ok(mem(unsafe { &*p.cast::<AtomicU64>() }))
            }
            Path::Tcp(link) => {
                net(link, w.keys.get(peer).copied().unwrap_or(0)).map_err(|e| self.name_window(e))
            }
        }
    }

    /// Returns once every request this rank sent over TCP has been executed
    /// by its target: after it (and a barrier), no request of this rank is
    /// still in flight to anyone's memory. Deregistration relies on it.
    pub fn fence_all(&self) -> Result<(), NetError> {
        self.fence_all_within(self.timeout)
    }

    /// [`Fabric::fence_all`] with one deadline, `limit` from now, for every
    /// link together (at most the fabric's timeout).
    pub fn fence_all_within(&self, limit: Duration) -> Result<(), NetError> {
        let until = std::time::Instant::now() + limit.min(self.timeout);
        for p in &self.paths {
            if let Path::Tcp(l) = p {
                l.fence(until.saturating_duration_since(std::time::Instant::now()))?;
            }
        }
        Ok(())
    }

    /// Returns once every put this rank wrote to `peer` over TCP was
    /// executed there, or with the first refusal (see [`Link::confirm`]);
    /// at once for other paths. Flushes call it, so a refused put is
    /// reported by the flush that covers it.
    pub fn confirm(&self, peer: usize) -> Result<(), NetError> {
        match self.paths.get(peer) {
            Some(Path::Tcp(l)) => l.confirm(self.timeout).map_err(|e| self.name_window(e)),
            _ => Ok(()),
        }
    }

    /// Adds the window a refusal's key belongs to (the target names only
    /// its key) to a transport error.
    fn name_window(&self, e: NetError) -> NetError {
        let NetError::Remote { peer, why } = e else {
            return e;
        };
        let hit = self.windows().into_iter().find(|(_, d)| {
            d.keys
                .get(peer)
                .is_some_and(|&k| k != 0 && why.contains(&format!("{k:#010x}")))
        });
        let why = match hit {
            Some((id, _)) => format!("{why} (window {id} of rank {peer})"),
            None => why,
        };
        NetError::Remote { peer, why }
    }

    /// Fails with the first error any TCP link saw.
    pub fn health(&self) -> Result<(), NetError> {
        for p in &self.paths {
            if let Path::Tcp(l) = p {
                l.check().map_err(|e| self.name_window(e))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

    use super::*;
    use crate::shm::Segment;

    /// A one-rank fabric with window 0 (data) and window 1 (signals), each
    /// a segment with its revocation word.
    fn rig(tag: &str) -> (Fabric, Segment, Segment) {
        let fabric = Fabric::new(
            0,
            vec![Path::Local],
            Arc::new(RegionTable::default()),
            None,
            Duration::from_secs(1),
        );
        let pid = std::process::id();
        let mut segs =
            [0, 1].map(|i| Segment::create(&format!("gin-test-{tag}-{pid}-{i}"), 64).unwrap());
        for (i, s) in segs.iter_mut().enumerate() {
            s.unlink();
            fabric.add_window(
                i as u32,
                MemDesc {
                    local_base: s.as_ptr() as usize,
                    sizes: vec![64],
                    peer_bases: vec![0],
                    keys: vec![0],
                    addrs: vec![s.as_ptr() as u64],
                    states: vec![std::ptr::from_ref(s.state()) as usize],
                    keep: None,
                },
            );
        }
        let [data, sig] = segs;
        (fabric, data, sig)
    }

    fn at(window: u32, offset: u64) -> Addr {
        Addr { window, offset }
    }

    fn word(s: &Segment, offset: usize) -> u64 {
        // SAFETY: in range of the 64-byte segment, aligned.
        unsafe { (*s.as_ptr().add(offset).cast::<AtomicU64>()).load(Ordering::Acquire) }
    }

    #[test]
    fn a_revoked_part_refuses_the_put_and_its_signal_before_anything_moves() {
        let (fabric, data, sig) = rig("revoked-data");
        fabric
            .put(0, at(0, 8), &[1; 8], Some((at(1, 0), 1)))
            .unwrap();
        assert_eq!((word(&data, 8), word(&sig, 0)), (0x0101_0101_0101_0101, 1));
        data.state().store(1, Ordering::Release);
        let e = fabric
            .put(0, at(0, 16), &[2; 8], Some((at(1, 0), 1)))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("offset 16 of window 0") && e.contains("rank 0 dropped or deregistered"),
            "{e}"
        );
        assert_eq!((word(&data, 16), word(&sig, 0)), (0, 1));
        assert!(fabric.fetch_add(0, at(0, 24), 1).is_err());
        assert_eq!(word(&data, 24), 0);
        let done = Arc::new(AtomicU64::new(1));
        let mut out = [0u8; 8];
        // SAFETY: `out` outlives the call, which completes synchronously.
        let r = unsafe { fabric.get(0, at(0, 8), out.as_mut_ptr(), 8, &done, None) };
        assert!(r.unwrap_err().to_string().contains("get of 8 bytes"));
    }

    #[test]
    fn a_revoked_signal_part_refuses_the_whole_put() {
        let (fabric, data, sig) = rig("revoked-signal");
        sig.state().store(1, Ordering::Release);
        let e = fabric
            .put(0, at(0, 8), &[3; 8], Some((at(1, 32), 5)))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("signal of 8 bytes at offset 32 of window 1"),
            "{e}"
        );
        // As over tcp, the put and its signal are refused as a whole.
        assert_eq!((word(&data, 8), word(&sig, 32)), (0, 0));
    }
}
