//! The [`Buffer`]: windows, signals and bookkeeping shared by both modes,
//! the agreement checks made when it is created, and the bounded waits every
//! step uses.

use std::time::{Duration, Instant};

use gin_bootstrap::BootstrapError;
use gin_core::{Comm, DevCommHandle, DevCommRequirements, Window};

use crate::config::{Config, Mode};
use crate::error::EpError;

/// What a step does when a peer it waits for is lost (died, left, or
/// stopped answering) or does not deliver within the job timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnPeerLoss {
    /// Fail the step with an error naming the peer.
    #[default]
    Fail,
    /// Mask the peer (as if [`Buffer::set_active`] had cleared it), finish
    /// the step without it, and report it in the step's output: its tokens
    /// are not received, its experts' contributions are left out of the
    /// combine.
    Mask,
}

/// Where the step stands (calls must come in order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    Idle,
    DispatchSent,
    Dispatched,
    CombineSent,
    /// A step that failed midway and cannot be ended (a refused step whose
    /// exchange failed, or a high-throughput count exchange that failed
    /// midway): every further step is refused.
    Broken,
}

impl Phase {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Idle => "idle",
            Self::DispatchSent => "waiting to receive a dispatch",
            Self::Dispatched => "holding a dispatch (combine next)",
            Self::CombineSent => "waiting to receive a combine",
            Self::Broken => {
                "broken by a step that failed midway (its late signals would be taken for the \
                 next step's; create a new buffer)"
            }
        }
    }
}

/// Which ranks share a host, as gin-core sees it (`GIN_HOSTID`, else
/// hostname and boot id).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hosts {
    /// Host index of every rank (in order of first appearance).
    pub host_of: Vec<usize>,
    /// Ranks per host when every host has the same number and ranks are
    /// numbered host by host (`rank = host * ranks_per_host + local`), as
    /// the high-throughput mode needs; `None` otherwise.
    pub ranks_per_host: Option<usize>,
}

impl Hosts {
    /// Derives the host map from every rank's host id.
    pub fn from_ids(ids: &[Vec<u8>]) -> Self {
        let mut seen: Vec<&[u8]> = Vec::new();
        let host_of: Vec<usize> = ids
            .iter()
            .map(|id| {
                if let Some(h) = seen.iter().position(|s| *s == id.as_slice()) {
                    h
                } else {
                    seen.push(id);
                    seen.len() - 1
                }
            })
            .collect();
        let n = host_of.len();
        let nh = seen.len();
        let per = n / nh.max(1);
        let regular =
            nh > 0 && per * nh == n && host_of.iter().enumerate().all(|(r, &h)| h == r / per);
        Self {
            host_of,
            ranks_per_host: regular.then_some(per),
        }
    }
}

/// One rank's expert-parallel buffer: its windows, signals and the
/// bookkeeping of the step in progress. Created collectively with the same
/// [`Config`] on every rank; steps are collective too.
#[derive(Debug)]
pub struct Buffer<'c> {
    pub(crate) comm: &'c Comm,
    pub(crate) dc: DevCommHandle<'c>,
    pub(crate) cfg: Config,
    pub(crate) rank: usize,
    pub(crate) nranks: usize,
    pub(crate) hosts: Hosts,
    pub(crate) active: Vec<bool>,
    pub(crate) policy: OnPeerLoss,
    /// Peers masked by [`OnPeerLoss::Mask`] during the current step.
    pub(crate) lost: Vec<usize>,
    pub(crate) step: u64,
    pub(crate) phase: Phase,
    /// Per (context, signal id), the value already accounted for.
    pub(crate) seen: Vec<u64>,
    /// Contexts of the device communicator (high-throughput: one per
    /// channel).
    pub(crate) contexts: u32,
    /// High-throughput mode: per context, the puts counted for local
    /// completion so far (see `settle`).
    pub(crate) issued: Vec<u64>,
    /// High-throughput mode: threads the channels run on.
    pub(crate) threads: usize,
    /// High-throughput mode: notify rounds so far (their parity picks the
    /// half of the notify window a round uses).
    pub(crate) ht_rounds: u64,
    pub(crate) wins: Vec<Window>,
    /// Operations may still read the send windows: flush before rewriting.
    pub(crate) unflushed: bool,
    pub(crate) timeout: Duration,
    /// Low-latency combine, `[src * nranks + expert_rank]`: the source reads
    /// the expert rank's combine slots in place over load/store (both agree
    /// at creation), instead of the expert putting them.
    pub(crate) pull: Vec<bool>,
}

impl<'c> Buffer<'c> {
    /// Creates the buffer collectively: checks `cfg` and that every rank
    /// passed the same one (an error naming the first rank that differs,
    /// on every rank, before any window exists), learns the host map, and
    /// allocates the windows and signals of `cfg.mode`.
    pub fn new(comm: &'c Comm, cfg: Config) -> Result<Self, EpError> {
        let (rank, nranks) = (comm.rank(), comm.nranks());
        agree_config(comm, &cfg)?;
        let ids = comm
            .bootstrap()
            .allgather(comm.settings().host_id.as_bytes())?;
        let hosts = Hosts::from_ids(&ids);
        let (signals, contexts, mut sizes) = match cfg.mode {
            Mode::LowLatency => {
                let (signals, sizes) = crate::ll::resources(&cfg, nranks);
                (signals, 1, sizes)
            }
            Mode::HighThroughput => crate::ht::resources(&cfg, rank, &hosts)?,
        };
        let dc = comm.dev_comm(&DevCommRequirements {
            signals,
            counters: 1,
            contexts,
            exclusive_contexts: true,
            ..DevCommRequirements::default()
        })?;
        if let (Mode::HighThroughput, Some(l)) = (cfg.mode, hosts.ranks_per_host) {
            let unmapped = (0..nranks).any(|p| p != rank && p / l == rank / l && !dc.is_direct(p));
            sizes[crate::ht::CGET] = crate::ht::cget_bytes(&cfg, l, unmapped);
        }
        let wins = sizes
            .iter()
            .map(|&b| comm.alloc_window(b.max(64) as u64))
            .collect::<Result<Vec<_>, _>>()?;
        let pull = if cfg.mode == Mode::LowLatency {
            crate::ll::pull_matrix(comm, &dc, &wins)?
        } else {
            Vec::new()
        };
        Ok(Self {
            pull,
            comm,
            dc,
            cfg,
            rank,
            nranks,
            hosts,
            active: vec![true; nranks],
            policy: OnPeerLoss::Fail,
            lost: Vec::new(),
            step: 0,
            phase: Phase::Idle,
            seen: vec![0; signals as usize * contexts as usize],
            contexts,
            issued: vec![0; contexts as usize],
            threads: 1,
            ht_rounds: 0,
            wins,
            unflushed: false,
            timeout: comm.timeout(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks of the job.
    pub fn nranks(&self) -> usize {
        self.nranks
    }

    /// The host map.
    pub fn hosts(&self) -> &Hosts {
        &self.hosts
    }

    /// Steps started so far.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Which ranks take part: a masked rank's experts are treated as empty
    /// top-k slots, nothing is sent to it and nothing awaited from it.
    pub fn active(&self) -> &[bool] {
        &self.active
    }

    /// Masks or unmasks `peer` (between steps; every surviving rank must
    /// apply the same mask before the next step). In high-throughput mode
    /// the count exchange reconciles differing masks (a rank masked
    /// anywhere is masked everywhere), and a rank masked for some steps
    /// cannot rejoin the same buffer: its count-exchange rounds fell out of
    /// step with the others' (create a new buffer for it).
    pub fn set_active(&mut self, peer: usize, active: bool) -> Result<(), EpError> {
        if peer >= self.nranks {
            return Err(EpError::Gin(gin_core::GinError::BadPeer {
                rank: self.rank,
                peer,
                nranks: self.nranks,
            }));
        }
        if self.phase != Phase::Idle {
            return Err(self.phase_error("set_active"));
        }
        self.active[peer] = active;
        Ok(())
    }

    /// What a step does when a peer is lost.
    pub fn set_on_peer_loss(&mut self, policy: OnPeerLoss) {
        self.policy = policy;
    }

    /// High-throughput mode: how many threads run the buffer's channels
    /// (the calling thread included; at most one per channel). One thread
    /// interleaves the channels; more let the channels' roles run in
    /// parallel where cores allow. Default 1.
    pub fn set_threads(&mut self, threads: usize) {
        self.threads = threads.max(1);
    }

    /// The bound on every wait (the job timeout, `GIN_TIMEOUT`, by default).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Checks that `table` (a routing table every rank must hold alike, such
    /// as an all-gathered `topk_idx`) is the same on every rank: collective,
    /// an error on every rank naming the first rank that differs.
    pub fn check_same_everywhere(&self, what: &'static str, table: &[i64]) -> Result<(), EpError> {
        let mine = fingerprint(table);
        let all = self.comm.bootstrap().allgather(&mine.to_le_bytes())?;
        for (peer, t) in all.iter().enumerate() {
            let theirs = read_u64(t, 0);
            if theirs != mine {
                return Err(EpError::RoutingMismatch {
                    rank: self.rank,
                    peer,
                    what,
                    mine,
                    theirs,
                });
            }
        }
        Ok(())
    }

    /// Destroys the buffer collectively: flushes, waits for every rank, and
    /// gives the windows and ids back.
    pub fn destroy(self) -> Result<(), EpError> {
        self.dc.destroy()?;
        for w in &self.wins {
            self.comm.deregister_window(w)?;
        }
        Ok(())
    }

    pub(crate) fn phase_error(&self, call: &'static str) -> EpError {
        EpError::Phase {
            rank: self.rank,
            call,
            phase: self.phase.name(),
        }
    }

    pub(crate) fn expect_phase(&self, call: &'static str, want: Phase) -> Result<(), EpError> {
        if self.phase == want {
            Ok(())
        } else {
            Err(self.phase_error(call))
        }
    }

    pub(crate) fn check_step(&self, handle_step: u64) -> Result<(), EpError> {
        if handle_step == self.step {
            Ok(())
        } else {
            Err(EpError::StaleHandle {
                rank: self.rank,
                handle_step,
                step: self.step,
            })
        }
    }

    /// Waits until operations issued earlier no longer read the send
    /// windows (local completion only).
    pub(crate) fn settle(&mut self) -> Result<(), EpError> {
        if self.unflushed {
            for c in 0..self.contexts {
                if self.cfg.mode == Mode::HighThroughput {
                    let issued = self.issued[c as usize];
                    crate::ht::complete(&self.dc, c, issued, self.timeout, self.rank)?;
                } else {
                    self.settle_low_latency(c)?;
                }
            }
            self.unflushed = false;
        }
        Ok(())
    }

    /// Low-latency mode's local completion on context `c`: one wait per
    /// active peer, each judged by that peer's liveness, so a rank lost in
    /// the meantime fails (or, masking, is masked) by itself and never
    /// fails the waits for the survivors (a wait for every peer at once
    /// fails on any death in the job).
    fn settle_low_latency(&mut self, c: u32) -> Result<(), EpError> {
        let mut lost = Vec::new();
        {
            let ctx = self.dc.ctx(c)?;
            for peer in (0..self.nranks).filter(|&p| self.active[p]) {
                let t = ctx.flush_async(peer)?;
                match ctx.wait(&t) {
                    Ok(()) => {}
                    Err(_) if self.policy == OnPeerLoss::Mask && self.bootstrap_lost(peer) => {
                        lost.push(peer);
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        }
        for peer in lost {
            self.mask_lost(peer);
        }
        Ok(())
    }

    /// Waits until signal `id` moves past the value already accounted for,
    /// bounded by the timeout; `peer` is the rank that sends it. Returns
    /// the amount it moved by, or `None` when the peer was lost and the
    /// policy masked it.
    pub(crate) fn wait_signal(
        &mut self,
        id: u32,
        peer: usize,
        what: &dyn Fn() -> String,
    ) -> Result<Option<u64>, EpError> {
        let ctx = self.dc.ctx(0)?;
        let base = self.seen[id as usize];
        let target = base.wrapping_add(1);
        let mut v = ctx.read_signal(id)?;
        if !reached(v, target) {
            // Rings doorbells a batching backend holds back (the target is
            // already reached: it returns at once).
            ctx.wait_signal_for(id, v, Duration::from_secs(1))?;
            match self.poll(id, target, peer, what)? {
                Some(seen) => v = seen,
                None => return Ok(None),
            }
        }
        self.seen[id as usize] = v;
        Ok(Some(v.wrapping_sub(base)))
    }

    fn poll(
        &mut self,
        id: u32,
        target: u64,
        peer: usize,
        what: &dyn Fn() -> String,
    ) -> Result<Option<u64>, EpError> {
        let ctx = self.dc.ctx(0)?;
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let v = ctx.read_signal(id)?;
            if reached(v, target) {
                return Ok(Some(v));
            }
            spins = spins.wrapping_add(1);
            if spins < 128 {
                std::hint::spin_loop();
                continue;
            }
            // Ranks share cores with their peers and backend threads.
            std::thread::yield_now();
            if !spins.is_multiple_of(64) {
                continue;
            }
            // This peer's own health: a second rank lost after a first is
            // seen too.
            let lost = match self.comm.bootstrap().peer_health(peer) {
                Err(
                    BootstrapError::PeerDied { ref why, .. }
                    | BootstrapError::PeerUnresponsive { ref why, .. },
                ) => Some(why.clone()),
                Err(BootstrapError::PeerExited { .. }) => Some("it left the job".to_owned()),
                // The job's death watch is gone: no peer can be judged.
                Err(e @ BootstrapError::RootLost { .. }) => return Err(e.into()),
                _ => None,
            };
            let waited = start.elapsed();
            let timed_out = waited >= self.timeout;
            if lost.is_none() && !timed_out {
                continue;
            }
            // Once more after the news: a peer that signalled and then left
            // (or died) did so before its departure was known here, and its
            // signal satisfies the wait (CI saw an HT step fail naming a
            // survivor that had signalled, finished and exited between this
            // loop's read and its health check).
            let v = ctx.read_signal(id)?;
            if reached(v, target) {
                return Ok(Some(v));
            }
            if self.policy == OnPeerLoss::Mask {
                self.mask_lost(peer);
                return Ok(None);
            }
            return Err(match lost {
                Some(why) => EpError::PeerLost {
                    rank: self.rank,
                    peer,
                    what: what(),
                    why,
                },
                None => EpError::Timeout {
                    rank: self.rank,
                    peer,
                    what: what(),
                    last: v,
                    expected: target,
                    waited,
                },
            });
        }
    }

    /// Whether the bootstrap reports `peer` dead, unresponsive or gone.
    pub(crate) fn bootstrap_lost(&self, peer: usize) -> bool {
        matches!(
            self.comm.bootstrap().peer_health(peer),
            Err(BootstrapError::PeerDied { .. }
                | BootstrapError::PeerUnresponsive { .. }
                | BootstrapError::PeerExited { .. })
        )
    }

    pub(crate) fn mask_lost(&mut self, peer: usize) {
        if self.active[peer] {
            self.active[peer] = false;
            self.lost.push(peer);
        }
    }

    /// This rank's part of window `w` at `off`, `len` bytes, for reading.
    pub(crate) fn bytes(&self, w: usize, off: usize, len: usize) -> &[u8] {
        let win = &self.wins[w];
        assert!(
            off + len <= win.local_size() as usize,
            "window view in range"
        );
        // SAFETY: in range of this rank's part, mapped while `self.wins`
        // lives (the borrow of `self` outlives the slice). The protocol
        // guarantees no peer writes this range while it is read: the data
        // came with a signal already consumed, and the next write to it
        // needs a step that takes `&mut self`.
        unsafe { std::slice::from_raw_parts(win.as_ptr().add(off), len) }
    }

    /// As [`Buffer::bytes`], for writing ranges only this rank writes.
    pub(crate) fn bytes_mut(&mut self, w: usize, off: usize, len: usize) -> &mut [u8] {
        let win = &self.wins[w];
        assert!(
            off + len <= win.local_size() as usize,
            "window view in range"
        );
        // SAFETY: in range, mapped while `self.wins` lives; the ranges given
        // out mutably are send-side staging that only this rank writes and
        // that no operation reads (`settle` ran), borrowed from `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(win.as_ptr().add(off), len) }
    }
}

/// Checks `cfg` and that every rank passed the same one (collective): an
/// error naming the first rank and field that differ, on every rank.
pub(crate) fn agree_config(comm: &Comm, cfg: &Config) -> Result<(), EpError> {
    let (rank, nranks) = (comm.rank(), comm.nranks());
    let valid = cfg.validate(rank, nranks);
    // Agreement first, even when this rank's own check failed, so that
    // no rank is left waiting in a collective the others skipped.
    let mut mine = Vec::with_capacity(64);
    mine.push(u8::from(valid.is_ok()));
    for (_, v) in cfg.fields() {
        mine.extend_from_slice(&v.to_le_bytes());
    }
    let all = comm.bootstrap().allgather(&mine)?;
    valid?;
    if let Some(p) = all.iter().position(|a| a.first() != Some(&1)) {
        return Err(EpError::Mode {
            rank,
            what: format!("rank {p} refused the buffer configuration"),
        });
    }
    for (peer, theirs) in all.iter().enumerate() {
        for (i, (field, v)) in cfg.fields().into_iter().enumerate() {
            let t = read_u64(theirs, 1 + 8 * i);
            if t != v {
                return Err(EpError::ConfigMismatch {
                    rank,
                    peer,
                    field,
                    mine: v,
                    theirs: t,
                });
            }
        }
    }
    Ok(())
}

/// Rolling compare of a 64-bit signal (as gin-device's).
pub(crate) fn reached(value: u64, target: u64) -> bool {
    value.wrapping_sub(target) < (1 << 63)
}

pub(crate) fn read_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    if let Some(s) = b.get(at..at + 8) {
        a.copy_from_slice(s);
    }
    u64::from_le_bytes(a)
}

/// FNV-1a over the table's little-endian bytes.
pub fn fingerprint(table: &[i64]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for v in table {
        for b in v.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x100_0000_01b3);
        }
    }
    h ^ table.len() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_maps_from_ids() {
        let ids = |v: &[&str]| v.iter().map(|s| s.as_bytes().to_vec()).collect::<Vec<_>>();
        let h = Hosts::from_ids(&ids(&["a", "a", "b", "b"]));
        assert_eq!(h.host_of, [0, 0, 1, 1]);
        assert_eq!(h.ranks_per_host, Some(2));
        assert_eq!(
            Hosts::from_ids(&ids(&["a", "b", "a", "b"])).ranks_per_host,
            None
        );
        assert_eq!(Hosts::from_ids(&ids(&["a", "a", "b"])).ranks_per_host, None);
        assert_eq!(Hosts::from_ids(&ids(&["a"; 3])).ranks_per_host, Some(3));
    }

    #[test]
    fn rolling_compare_wraps() {
        assert!(reached(5, 5) && reached(6, 5) && !reached(4, 5));
        assert!(reached(2, u64::MAX));
    }
}
