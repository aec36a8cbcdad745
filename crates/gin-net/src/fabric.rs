//! One rank's view of the fabric: which transport reaches each peer, and
//! what every registered window looks like on every rank (the window
//! directory). Backends execute one-sided operations through [`Fabric`];
//! it checks each against the directory and dispatches it to the peer's
//! [`Transport`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use crate::NetError;
use crate::region::RegionTable;
use crate::shm::ShmTransport;
use crate::transport::{self, Alive, AtomicOp, Blame, Reach, Setup, Target, Transport};
use crate::window::{Addr, KeepAlive, MemDesc};

/// How a peer is reached: the transport the job chose for it.
#[derive(Debug, Clone)]
pub struct Path {
    transport: Arc<dyn Transport>,
}

impl Path {
    /// A path through `transport`.
    pub fn new(transport: Arc<dyn Transport>) -> Self {
        Self { transport }
    }

    /// The path to this rank itself: loads and stores on its own parts.
    pub fn local() -> Self {
        Self::new(Arc::new(ShmTransport::local()))
    }

    /// The transport's name (`local`, `shm`, `tcp`).
    pub fn name(&self) -> &'static str {
        self.transport.name()
    }

    /// How the transport addresses the peer's memory.
    pub fn reach(&self) -> Reach {
        self.transport.reach()
    }

    /// Whether the peer's parts are loaded and stored through mappings here
    /// (`local`, `shm`), rather than reached by requests the peer executes.
    pub fn is_mapped(&self) -> bool {
        self.reach() == Reach::Mapped
    }

    /// The transport itself.
    pub fn transport(&self) -> &Arc<dyn Transport> {
        &self.transport
    }
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
    timeout: Duration,
}

impl Fabric {
    /// Assembles a fabric from paths chosen elsewhere (`paths[rank]` is
    /// usually [`Path::local`]).
    pub fn new(rank: usize, paths: Vec<Path>, table: Arc<RegionTable>, timeout: Duration) -> Self {
        Self {
            rank,
            paths,
            table,
            windows: RwLock::new(HashMap::new()),
            generation: AtomicU64::new(0),
            timeout,
        }
    }

    /// Host memory for this rank's part of a window from the first peer
    /// transport that allocates its own ([`Transport::alloc_host`]), or
    /// `None`. For a part no peer maps.
    pub fn alloc_host(&self, bytes: usize) -> Option<Result<crate::HostMemory, NetError>> {
        self.transports()
            .into_iter()
            .find_map(|t| t.alloc_host(bytes))
    }

    /// A fabric of one rank and no peers (tests, benchmarks, loopbacks).
    pub fn local(table: Arc<RegionTable>, timeout: Duration) -> Self {
        Self::new(0, vec![Path::local()], table, timeout)
    }

    /// Chooses a transport for every peer ([`transport::select`]: the ranks'
    /// host indices and the transport asked for, `None` for auto), starts
    /// each transport any rank chose (collective: every rank calls this
    /// with the same `hosts` and `wanted`), and assembles the fabric.
    pub fn start(
        setup: &Setup<'_>,
        hosts: &[usize],
        wanted: Option<&str>,
    ) -> Result<Self, NetError> {
        let rank = setup.bootstrap.rank();
        let all = (0..hosts.len())
            .map(|r| transport::select(r, hosts, wanted))
            .collect::<Result<Vec<_>, _>>()?;
        let mine = all.get(rank).ok_or(NetError::NoPath {
            peer: rank,
            nranks: hosts.len(),
        })?;
        let chose =
            |sel: Option<&transport::Registration>, name: &str| sel.is_some_and(|r| r.name == name);
        let mut started: Vec<(&'static str, Arc<dyn Transport>)> = Vec::new();
        // In registry order on every rank: starts are collectives.
        for reg in transport::REGISTRY {
            if all.iter().flatten().any(|s| chose(*s, reg.name)) {
                let peers: Vec<bool> = mine.iter().map(|s| chose(*s, reg.name)).collect();
                started.push((reg.name, (reg.start)(setup, &peers)?));
            }
        }
        let paths = mine
            .iter()
            .map(|s| match s {
                None => Path::local(),
                Some(r) => started
                    .iter()
                    .find(|(n, _)| *n == r.name)
                    .map_or_else(Path::local, |(_, t)| Path::new(t.clone())),
            })
            .collect();
        Ok(Self::new(rank, paths, setup.table.clone(), setup.timeout))
    }

    /// Hands every transport the job's health ([`gin_bootstrap::Bootstrap::health`]) as
    /// the check its blocked operations consult, so a send blocked on a
    /// peer that stopped draining also ends when the job hears of a death.
    /// The check holds the bootstrap weakly: the transports do not keep it
    /// alive past its owner.
    pub fn watch_job(&self, bootstrap: &Arc<gin_bootstrap::Bootstrap>) {
        let weak = Arc::downgrade(bootstrap);
        let alive: Alive = Arc::new(move || {
            weak.upgrade()
                .map_or(Ok(()), |b| b.health().map_err(|e| e.to_string()))
        });
        self.watch(&alive);
        let weak = Arc::downgrade(bootstrap);
        let blame: Blame = Arc::new(move |peer, why| {
            if let Some(b) = weak.upgrade() {
                b.report_unresponsive(peer, why);
            }
        });
        self.blame_to(&blame);
    }

    /// Hands every transport the job-health check its blocked operations
    /// consult (see [`Transport::watch`]).
    pub fn watch(&self, alive: &Alive) {
        for t in self.transports() {
            t.watch(alive.clone());
        }
    }

    /// Hands every transport where to report a peer that did not answer
    /// for the job's whole timeout (see [`Transport::blame_to`]).
    pub fn blame_to(&self, blame: &Blame) {
        for t in self.transports() {
            t.blame_to(blame.clone());
        }
    }

    /// Each transport this fabric's paths use, once.
    fn transports(&self) -> Vec<&Arc<dyn Transport>> {
        let mut seen: Vec<&Arc<dyn Transport>> = Vec::new();
        for p in &self.paths {
            if !seen.iter().any(|t| Arc::ptr_eq(t, &p.transport)) {
                seen.push(&p.transport);
            }
        }
        seen
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the job.
    pub fn nranks(&self) -> usize {
        self.paths.len()
    }

    /// The path to `peer`.
    pub fn path(&self, peer: usize) -> Option<&Path> {
        self.paths.get(peer)
    }

    /// Each rank's path name (`local`, `shm`, `tcp`), by rank.
    pub fn path_names(&self) -> Vec<&'static str> {
        self.paths.iter().map(Path::name).collect()
    }

    /// How `peer` is reached, if it is a rank of the job.
    pub fn reach(&self, peer: usize) -> Option<Reach> {
        self.paths.get(peer).map(Path::reach)
    }

    fn path_to(&self, peer: usize) -> Result<&Path, NetError> {
        self.paths.get(peer).ok_or(NetError::NoPath {
            peer,
            nranks: self.paths.len(),
        })
    }

    /// The region table this rank serves remote requests from.
    pub fn table(&self) -> &Arc<RegionTable> {
        &self.table
    }

    /// The fabric's timeout (answers, drains, fences).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Makes a window known to the fabric (replacing any window of that
    /// id). Safe: a [`MemDesc`] is only made by a caller that vouched for
    /// its addresses ([`MemDesc::new`]).
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
            .ok_or(NetError::NotRegistered { window: id })
    }

    /// Writes `src` to `dst` on `peer`, then adds `sig.1` to the 8-byte slot
    /// `sig.0` on `peer` with release ordering (the data is visible first).
    /// Complete locally on return. A put whose data or signal is refused
    /// (out of range; on mapped paths also a revoked or unmapped part) is
    /// refused before anything moves: a signal is never applied for
    /// refused data.
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
        let path = self.path_to(peer)?;
        let t = Target::Window(w, dst);
        t.check_range(peer, src.len() as u64)?;
        let sig = sig.map(|(sw, a, v)| (Target::Window(sw, a), v));
        if let Some((s, _)) = sig {
            s.check_range(peer, 8)?;
        }
        path.transport
            .put(peer, t, src, sig)
            .map_err(|e| self.name_window(e))
    }

    /// Whether a put of `len` bytes to `peer` by [`Fabric::start_put_in`]
    /// may return with its source still lent ([`Transport::lends_puts`]).
    pub fn lends_puts(&self, peer: usize, len: u64) -> bool {
        self.path_to(peer)
            .is_ok_and(|p| p.transport.lends_puts(peer, len))
    }

    /// [`Fabric::put_in`] from `len` bytes of this process's host memory
    /// at `src`, which the transport may read after this returns
    /// ([`Transport::start_put`]): returns the put's number among the puts
    /// from lent memory to `peer`, complete locally once
    /// [`Fabric::lent_puts_completed`] covers it or a later
    /// [`Fabric::confirm`] (or fence) to `peer` returned; 0 where it was
    /// complete on return. Checked as [`Fabric::put_in`] first.
    ///
    /// # Safety
    /// As for [`Transport::start_put`].
    pub unsafe fn start_put_in(
        &self,
        peer: usize,
        (w, dst): (&MemDesc, Addr),
        src: *const u8,
        len: u64,
        sig: Option<(&MemDesc, Addr, u64)>,
        keep: Option<KeepAlive>,
    ) -> Result<u64, NetError> {
        let path = self.path_to(peer)?;
        let t = Target::Window(w, dst);
        t.check_range(peer, len)?;
        let sig = sig.map(|(sw, a, v)| (Target::Window(sw, a), v));
        if let Some((s, _)) = sig {
            s.check_range(peer, 8)?;
        }
        // SAFETY: forwarded from the caller.
        unsafe { path.transport.start_put(peer, t, src, len, sig, keep) }
            .map_err(|e| self.name_window(e))
    }

    /// Without blocking: how far the puts from lent memory to `peer` are
    /// complete locally, in order ([`Transport::lent_puts_completed`]).
    pub fn lent_puts_completed(&self, peer: usize) -> Result<u64, NetError> {
        self.path_to(peer)?
            .transport
            .lent_puts_completed(peer)
            .map_err(|e| self.name_window(e))
    }

    /// Writes `src` at `offset` of the region `peer` serves under `key`
    /// (keyed paths only: the peer checks the range). Complete locally on
    /// return; [`Fabric::confirm`] reports a refusal.
    pub fn put_key(&self, peer: usize, key: u32, offset: u64, src: &[u8]) -> Result<(), NetError> {
        self.path_to(peer)?
            .transport
            .put(peer, Target::Key { key, offset }, src, None)
            .map_err(|e| self.name_window(e))
    }

    /// [`Fabric::put_key`], executed at `peer` after every earlier request
    /// to it ([`Transport::put_ordered`]): a running total after the data
    /// it counts.
    pub fn put_key_ordered(
        &self,
        peer: usize,
        key: u32,
        offset: u64,
        src: &[u8],
    ) -> Result<(), NetError> {
        self.path_to(peer)?
            .transport
            .put_ordered(peer, Target::Key { key, offset }, src)
            .map_err(|e| self.name_window(e))
    }

    /// Whether the transport to `peer` moves GPU memory of this process
    /// directly ([`Transport::takes_device_memory`]): then
    /// [`Fabric::put_device_key`] and [`Fabric::read_device_key`] replace
    /// staging through host memory.
    pub fn takes_device_memory(&self, peer: usize) -> bool {
        self.path_to(peer)
            .is_ok_and(|p| p.transport.takes_device_memory())
    }

    /// Writes `len` bytes of GPU memory at device address `src` to `offset`
    /// of the region `peer` serves under `key` ([`Transport::put_device`]).
    /// Complete locally on return.
    ///
    /// # Safety
    /// As for [`Transport::put_device`].
    pub unsafe fn put_device_key(
        &self,
        peer: usize,
        key: u32,
        offset: u64,
        src: u64,
        len: u64,
    ) -> Result<(), NetError> {
        let path = self.path_to(peer)?;
        // SAFETY: forwarded from the caller.
        unsafe {
            path.transport
                .put_device(peer, Target::Key { key, offset }, src, len)
        }
        .map_err(|e| self.name_window(e))
    }

    /// Reads `len` bytes at `offset` of the region `peer` serves under
    /// `key` into GPU memory at device address `dst`
    /// ([`Transport::read_device`]); returns once they landed, or with an
    /// error within the fabric's timeout.
    ///
    /// # Safety
    /// As for [`Transport::read_device`].
    pub unsafe fn read_device_key(
        &self,
        peer: usize,
        key: u32,
        offset: u64,
        dst: u64,
        len: u64,
    ) -> Result<(), NetError> {
        let path = self.path_to(peer)?;
        // SAFETY: forwarded from the caller.
        unsafe {
            path.transport
                .read_device(peer, Target::Key { key, offset }, dst, len, self.timeout)
        }
        .map_err(|e| self.name_window(e))
    }

    /// Reads `len` bytes at `src` on `peer` into `dst`. `done` is decremented
    /// when the data has landed; the caller increments it first. `keep` (the
    /// destination window's [`MemParts::keep`](crate::MemParts::keep)) is held until the data has
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
        let path = self.path_to(peer)?;
        let t = Target::Window(w, src);
        t.check_range(peer, len)?;
        // SAFETY: forwarded from the caller.
        unsafe { path.transport.get(peer, t, dst, len, done, keep) }
            .map_err(|e| self.name_window(e))
    }

    /// Reads `out.len()` bytes at `src` on `peer` into `out` and returns
    /// once they landed, or with an error within the fabric's timeout;
    /// nothing writes `out` afterwards. (CUDA ranks stage GPU memory
    /// through it.)
    pub fn read(&self, peer: usize, src: Addr, out: &mut [u8]) -> Result<(), NetError> {
        let w = self.window(src.window)?;
        self.read_in(peer, (&w, src), out)
    }

    /// [`Fabric::read`] with the window's description in hand.
    pub fn read_in(
        &self,
        peer: usize,
        (w, src): (&MemDesc, Addr),
        out: &mut [u8],
    ) -> Result<(), NetError> {
        let path = self.path_to(peer)?;
        let t = Target::Window(w, src);
        t.check_range(peer, out.len() as u64)?;
        path.transport
            .read(peer, t, out, self.timeout)
            .map_err(|e| self.name_window(e))
    }

    /// [`Fabric::read`] from `offset` of the region `peer` serves under
    /// `key` (keyed paths only: the peer checks the range).
    pub fn read_key(
        &self,
        peer: usize,
        key: u32,
        offset: u64,
        out: &mut [u8],
    ) -> Result<(), NetError> {
        self.path_to(peer)?
            .transport
            .read(peer, Target::Key { key, offset }, out, self.timeout)
            .map_err(|e| self.name_window(e))
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
        self.atomic(peer, w, at, AtomicOp::FetchAdd(v))
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
        self.atomic(peer, w, at, AtomicOp::CompareSwap { expected, desired })
    }

    fn atomic(&self, peer: usize, w: &MemDesc, at: Addr, op: AtomicOp) -> Result<u64, NetError> {
        let path = self.path_to(peer)?;
        let t = Target::Window(w, at);
        t.check_range(peer, 8)?;
        path.transport
            .atomic(peer, t, op, self.timeout)
            .map_err(|e| self.name_window(e))
    }

    /// Returns once every request this rank sent has been executed by its
    /// target: after it (and a barrier), no request of this rank is still
    /// in flight to anyone's memory. Deregistration relies on it.
    pub fn fence_all(&self) -> Result<(), NetError> {
        self.fence_all_within(self.timeout)
    }

    /// [`Fabric::fence_all`] with one deadline, `limit` from now, for every
    /// peer together (at most the fabric's timeout).
    pub fn fence_all_within(&self, limit: Duration) -> Result<(), NetError> {
        let until = Instant::now() + limit.min(self.timeout);
        for (peer, p) in self.paths.iter().enumerate() {
            p.transport
                .fence(peer, until.saturating_duration_since(Instant::now()))?;
        }
        Ok(())
    }

    /// Returns once every put this rank wrote to `peer` was executed there,
    /// or with the first refusal (see [`Transport::confirm`]); at once on
    /// mapped paths, whose puts are complete on return. Flushes call it,
    /// so a refused put is reported by the flush that covers it.
    pub fn confirm(&self, peer: usize) -> Result<(), NetError> {
        self.path_to(peer)?
            .transport
            .confirm(peer, self.timeout)
            .map_err(|e| self.name_window(e))
    }

    /// Fails with the first error the path to `peer` saw.
    pub fn peer_health(&self, peer: usize) -> Result<(), NetError> {
        self.path_to(peer)?
            .transport
            .health(peer)
            .map_err(|e| self.name_window(e))
    }

    /// Fails with the first error any path saw.
    pub fn health(&self) -> Result<(), NetError> {
        (0..self.paths.len()).try_for_each(|p| self.peer_health(p))
    }

    /// Adds the window a refusal's key belongs to (the target names only
    /// its key) to a transport's refusal.
    fn name_window(&self, e: NetError) -> NetError {
        let NetError::Refused {
            peer,
            why,
            window: None,
        } = e
        else {
            return e;
        };
        let window = self
            .windows()
            .into_iter()
            .find(|(_, d)| {
                let k = d.key_of(peer);
                k != 0 && why.contains(&format!("{k:#010x}"))
            })
            .map(|(id, _)| id);
        NetError::Refused { peer, why, window }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

    use super::*;
    use crate::shm::Segment;
    use crate::window::MemParts;

    /// A one-rank fabric with window 0 (data) and window 1 (signals), each
    /// a segment with its revocation word.
    fn rig(tag: &str) -> (Fabric, Segment, Segment) {
        let fabric = Fabric::local(Arc::new(RegionTable::default()), Duration::from_secs(1));
        let pid = std::process::id();
        let mut segs =
            [0, 1].map(|i| Segment::create(&format!("gin-test-{tag}-{pid}-{i}"), 64).unwrap());
        for (i, s) in segs.iter_mut().enumerate() {
            s.unlink();
            let parts = MemParts {
                local_base: s.as_ptr() as usize,
                sizes: vec![64],
                peer_bases: vec![0],
                keys: vec![0],
                addrs: vec![s.as_ptr() as u64],
                states: vec![std::ptr::from_ref(s.state()) as usize],
                ..MemParts::default()
            };
            // SAFETY: the segments (64 bytes each, their revocation words in
            // their headers) outlive every operation of the tests below.
            fabric.add_window(i as u32, unsafe { MemDesc::new(parts) });
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

    #[test]
    fn gpu_memory_is_never_loaded_or_stored_on_a_mapped_path() {
        let fabric = Fabric::local(Arc::new(RegionTable::default()), Duration::from_secs(1));
        let parts = MemParts {
            memory: crate::Memory::Device,
            local_base: 0x7f00_dead_0000,
            sizes: vec![64],
            peer_bases: vec![0x7f00_dead_0000],
            keys: vec![0],
            addrs: vec![0x7f00_dead_0000],
            states: vec![0],
            keep: None,
        };
        // SAFETY: a device window the fabric refuses to touch, which no GPU
        // engine reads in this test (the address is never dereferenced).
        fabric.add_window(7, unsafe { MemDesc::new(parts) });
        let device = |e: NetError| {
            assert!(
                matches!(
                    e,
                    NetError::DeviceMemory {
                        peer: 0,
                        window: 7,
                        transport: "local"
                    }
                ),
                "{e}"
            );
            assert!(e.to_string().contains("GPU memory"), "{e}");
        };
        device(fabric.put(0, at(7, 0), &[1; 8], None).unwrap_err());
        device(fabric.fetch_add(0, at(7, 8), 1).unwrap_err());
        device(fabric.read(0, at(7, 0), &mut [0; 8]).unwrap_err());
        let done = Arc::new(AtomicU64::new(1));
        let mut out = [0u8; 8];
        // SAFETY: `out` outlives the call, which fails before anything moves.
        device(unsafe { fabric.get(0, at(7, 0), out.as_mut_ptr(), 8, &done, None) }.unwrap_err());
        // Ranges are checked first, for every kind of memory.
        let e = fabric.put(0, at(7, 60), &[1; 8], None).unwrap_err();
        assert!(matches!(e, NetError::OutOfBounds { size: 64, .. }), "{e}");
        assert!(fabric.put(1, at(7, 0), &[1], None).unwrap_err().peer() == Some(1));
        let e = fabric.put_key(0, 5, 0, &[1]).unwrap_err();
        assert!(
            matches!(
                e,
                NetError::Unsupported {
                    transport: "local",
                    ..
                }
            ),
            "{e}"
        );
    }
}
