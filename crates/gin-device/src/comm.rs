//! The device communicator for CPU ranks: validation, the direct load/store
//! path, dispatch to a backend, waits and barriers.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use crate::abi::{
    DEVCOMM_FLAG_EXCLUSIVE_CTX, DEVCOMM_FLAG_STRONG_SIGNALS, DEVCOMM_FLAG_VA_SIGNALS, DevCommAbi,
};
use crate::error::GinError;
use crate::ops::{Fence, Local, Order, Remote, SignalOp, Team};
use crate::wait::{COUNTER_MASK, Stop, counter_reached, poll, signal_reached};
use crate::window::Window;

/// Where a put's bytes come from.
#[derive(Debug, Clone, Copy)]
pub enum Source<'a> {
    /// `bytes` bytes at `offset` of this rank's part of a window.
    Window {
        /// The window holding the bytes.
        window: &'a Window,
        /// Their offset in this rank's part.
        offset: u64,
    },
    /// An inline value of `bytes` (≤ 8) bytes, little-endian.
    Inline(u64),
    /// No data (a signal alone).
    Empty,
}

/// A signal update resolved to a slot: (window, offset) at the peer.
#[derive(Debug, Clone, Copy)]
pub struct SignalUpdate<'a> {
    /// The window holding the slot: the signal window, or a user window for
    /// a signal by window address.
    pub window: &'a Window,
    /// The slot's byte offset in the peer's part.
    pub offset: u64,
    /// The amount to add.
    pub add: u64,
    /// What the signal's arrival promises about earlier puts.
    pub order: Order,
}

/// A validated put, handed to a backend.
#[derive(Debug, Clone, Copy)]
pub struct PutOp<'a> {
    /// The context it was issued on.
    pub ctx: u32,
    /// The rank written to.
    pub peer: usize,
    /// The destination window.
    pub dst: &'a Window,
    /// The destination offset in the peer's part.
    pub dst_off: u64,
    /// Where the bytes come from.
    pub src: Source<'a>,
    /// Bytes to move.
    pub bytes: u64,
    /// The signal to update at the peer once the data has landed, if any.
    pub signal: Option<SignalUpdate<'a>>,
    /// Global counter slot to bump when the source may be reused.
    pub counter: Option<u64>,
}

/// A validated get, handed to a backend.
#[derive(Debug, Clone, Copy)]
pub struct GetOp<'a> {
    /// The context it was issued on.
    pub ctx: u32,
    /// The rank read from.
    pub peer: usize,
    /// The window read from.
    pub remote: &'a Window,
    /// The source offset in the peer's part.
    pub remote_off: u64,
    /// The window written to.
    pub local: &'a Window,
    /// The destination offset in this rank's part.
    pub local_off: u64,
    /// Bytes to move.
    pub bytes: u64,
}

/// How long a failure path waits for the news that explains a failure:
/// the job watch's account of a death or departure behind a backend's error
/// (a broken link is often the echo of a peer that quit because a third
/// rank died), or a backend's own error behind a stalled wait. One grace
/// for every such wait in the workspace, on CPU and CUDA ranks alike; it is
/// spent only on the way to an error.
pub const CAUSE_GRACE: Duration = Duration::from_millis(500);

/// Proof of issue, redeemed for local completion (see [`Ctx::flush_async`]).
///
/// Only a backend makes tickets, through its [`TicketIssuer`], and only the
/// backend instance that issued a ticket accepts it: the fields are private
/// and the ticket carries its issuer's identity. A ticket from another
/// device communicator is an error, never an index out of range or a wait
/// that returns at once.
///
/// ```compile_fail
/// // Not constructible outside a backend.
/// let t = gin_device::Ticket { ctx: 0, peer: None, marks: vec![] };
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ticket {
    issuer: u64,
    ctx: u32,
    peer: Option<usize>,
    /// Backend-defined progress marks to wait for.
    marks: Vec<u64>,
}

impl Ticket {
    /// The context whose operations it covers.
    pub fn ctx(&self) -> u32 {
        self.ctx
    }

    /// The peer it covers, or `None` for every peer.
    pub fn peer(&self) -> Option<usize> {
        self.peer
    }
}

/// A backend instance's ticket stamp: tickets it issues carry its identity,
/// unique in the process, and [`TicketIssuer::redeem`] accepts only those.
/// Each backend instance owns one and keeps it private.
#[derive(Debug)]
pub struct TicketIssuer {
    id: u64,
}

impl Default for TicketIssuer {
    fn default() -> Self {
        Self::new()
    }
}

impl TicketIssuer {
    /// A stamp no other issuer in this process shares.
    pub fn new() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Self {
            id: NEXT.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// A ticket for `ctx` (and `peer`, when given) carrying `marks`.
    pub fn issue(&self, ctx: u32, peer: Option<usize>, marks: Vec<u64>) -> Ticket {
        Ticket {
            issuer: self.id,
            ctx,
            peer,
            marks,
        }
    }

    /// The marks of a ticket this issuer made, or an error naming `rank`
    /// for one it did not make (another backend instance's, or one whose
    /// context, peer or marks do not fit this instance: `nctx` contexts,
    /// `nranks` ranks, `marks_per_peer` marks for each peer covered).
    pub fn redeem<'t>(
        &self,
        rank: usize,
        t: &'t Ticket,
        nctx: u32,
        nranks: usize,
        marks_per_peer: usize,
    ) -> Result<&'t [u64], GinError> {
        let peers = if t.peer.is_some() { 1 } else { nranks };
        let why = if t.issuer != self.id {
            Some("it was issued by another device communicator".to_string())
        } else if t.ctx >= nctx {
            Some(format!(
                "context {} is out of range ({nctx} contexts)",
                t.ctx
            ))
        } else if let Some(p) = t.peer.filter(|&p| p >= nranks) {
            Some(format!("peer {p} is out of range ({nranks} ranks)"))
        } else if t.marks.len() != peers * marks_per_peer {
            Some(format!(
                "it carries {} marks, {} expected",
                t.marks.len(),
                peers * marks_per_peer
            ))
        } else {
            None
        };
        match why {
            None => Ok(&t.marks),
            Some(why) => Err(GinError::Unsupported {
                rank,
                what: "ticket",
                why: format!(
                    "the ticket for context {}{} is refused: {why}",
                    t.ctx,
                    t.peer.map(|p| format!(", peer {p}")).unwrap_or_default()
                ),
            }),
        }
    }
}

/// A network backend's device side for CPU ranks. Arguments arrive validated.
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// Short name for messages (`proxy`, `gdaki`).
    fn name(&self) -> &'static str;
    /// Issues a put; it completes locally later (see `ticket` / `done`).
    fn put(&self, op: &PutOp<'_>) -> Result<(), GinError>;
    /// Issues a get; the data has landed once a later ticket is done.
    fn get(&self, op: &GetOp<'_>) -> Result<(), GinError>;
    /// A ticket covering every operation issued so far on `ctx` (to `peer`
    /// only, when given).
    fn ticket(&self, ctx: u32, peer: Option<usize>) -> Result<Ticket, GinError>;
    /// Whether everything the ticket covers has completed locally. Completion
    /// errors (a refused write, a dead peer) are returned here, and so is a
    /// ticket this instance did not issue ([`TicketIssuer::redeem`]).
    fn done(&self, ticket: &Ticket) -> Result<bool, GinError>;
    /// Fails when the backend or the job is broken.
    fn health(&self) -> Result<(), GinError>;

    /// Pushes out anything issued but held back (doorbells a batching
    /// backend has not rung yet). Every wait calls it first: waiting for an
    /// answer to a put that was never sent would only time out.
    fn progress(&self) {}
}

/// The job-level liveness check waits consult (the bootstrap's death watch):
/// it fails once any rank has died, stopped responding or left, and its
/// message names that rank. Waits call it every ~0.5 ms, off the fast path.
pub trait Health: Send + Sync + std::fmt::Debug {
    /// `Err` with a message naming the rank once any rank has died, stopped
    /// responding or left.
    fn check(&self) -> Result<(), String>;

    /// `Err` with a message once `peer` has died, stopped responding or
    /// left, or the job's liveness watch itself is lost. A wait for
    /// operations to one peer consults this rather than [`Health::check`]:
    /// another rank's death does not stop them completing (what a job that
    /// masks lost ranks, as gin-ep does, relies on). The default is the
    /// job-level check.
    fn check_peer(&self, peer: usize) -> Result<(), String> {
        let _ = peer;
        self.check()
    }

    /// After a wait timed out: which peers look to blame (stopped, gone),
    /// as a sentence, or `None` when nothing is known. Failure path only.
    fn diagnose(&self) -> Option<String> {
        None
    }

    /// After a wait as long as the job's timeout timed out (on operations
    /// to `peer`, or on any peer): tells the job of the peers that are
    /// certainly stopped, so ranks waiting on this one, which is about to
    /// fail, name them rather than its departure. Failure path only; the
    /// default does nothing.
    fn report_stopped(&self, peer: Option<usize>) {
        let _ = peer;
    }
}

/// The local counter array, shared with the backend that bumps it.
#[derive(Debug)]
pub struct Counters {
    slots: Box<[AtomicU64]>,
}

impl Counters {
    /// `n` counters at zero.
    pub fn new(n: usize) -> Self {
        Self {
            slots: (0..n).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// The counter at a global slot.
    pub fn slot(&self, slot: u64) -> Option<&AtomicU64> {
        self.slots.get(usize::try_from(slot).ok()?)
    }

    /// Adds one to a counter: the source of the put it counts may be reused.
    pub fn bump(&self, slot: u64) {
        if let Some(c) = self.slot(slot) {
            c.fetch_add(1, Ordering::Release);
        }
    }

    fn base_ptr(&self) -> u64 {
        self.slots.as_ptr() as u64
    }

    /// The address of the array (a NIC registers it as local memory).
    pub fn as_ptr(&self) -> *const AtomicU64 {
        self.slots.as_ptr()
    }

    /// Counters in the array.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// True when the array has no counters.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
}

/// Everything the host layer decides when it creates a device communicator.
#[derive(Debug)]
pub struct DevCommParts {
    /// This rank.
    pub rank: usize,
    /// Ranks in the communicator.
    pub nranks: usize,
    /// Identifies the communicator (what its windows' `comm_id` must match).
    pub comm_id: u64,
    /// Contexts: independent ordering domains.
    pub nctx: u32,
    /// User signals per context.
    pub nsignals: u32,
    /// Counters per context.
    pub ncounters: u32,
    /// World barriers asked for.
    pub world_barriers: u32,
    /// Rail barriers asked for.
    pub rail_barriers: u32,
    /// The communicator-wide signal window (u64 slots).
    pub signal_window: Window,
    /// This device communicator's first slot in the signal window.
    pub signal_base: u64,
    /// Slots allocated from `signal_base` on.
    pub signal_slots: u64,
    /// The local counter array, shared with the backend.
    pub counters: Arc<Counters>,
    /// This device communicator's first slot in `counters`.
    pub counter_base: u64,
    /// Peers reached by direct load/store (same-host shared memory).
    pub lsa: Vec<bool>,
    /// Peers this communicator may address (a rail connection reaches only
    /// the rail).
    pub connected: Vec<bool>,
    /// The ranks of this rank's rail team, in team order.
    pub rail: Vec<usize>,
    /// Strong signals ([`Order::Strong`]) were asked for.
    pub strong_signals: bool,
    /// Signals by window address ([`Remote::VaSignal`]) were asked for.
    pub va_signals: bool,
    /// Each context is used by one thread only (a promise recorded in the
    /// ABI; device code may then reserve without atomics).
    pub exclusive_contexts: bool,
    /// Carries operations to peers not reached by load/store.
    pub backend: Arc<dyn Backend>,
    /// The job-level liveness check waits consult.
    pub health: Arc<dyn Health>,
    /// The default timeout of waits.
    pub timeout: Duration,
}

/// A device communicator, as CPU ranks use it. Shareable between threads;
/// each thread picks a context with [`DevComm::ctx`].
#[derive(Debug)]
pub struct DevComm {
    p: DevCommParts,
    abi: DevCommAbi,
    /// Signal slots per context: user signals, then world, then rail barriers.
    per_ctx: u32,
    abort: Arc<AtomicU32>,
    /// Per (ctx, peer): an operation went through the backend since the last
    /// check, so a direct-path strong signal must wait for it first.
    backend_used: Box<[AtomicBool]>,
    /// Per barrier (world then rail) and context: syncs completed.
    epochs: Box<[AtomicU64]>,
    error_word: Box<AtomicU64>,
}

/// Signal slots a device communicator needs per context: the user's
/// signals, then one slot per (barrier, sending rank). The host layer
/// allocates `contexts` times this many; None on overflow.
pub fn signal_slots_per_context(
    nsignals: u32,
    world_barriers: u32,
    rail_barriers: u32,
    nranks: usize,
) -> Option<u32> {
    let n = u32::try_from(nranks).ok()?;
    world_barriers
        .checked_add(rail_barriers)?
        .checked_mul(n)?
        .checked_add(nsignals)
}

impl DevComm {
    /// Assembles a device communicator from what the host layer set up.
    pub fn new(p: DevCommParts) -> Result<Self, GinError> {
        let per_ctx =
            signal_slots_per_context(p.nsignals, p.world_barriers, p.rail_barriers, p.nranks)
                .ok_or(GinError::Unsupported {
                    rank: p.rank,
                    what: "signal count",
                    why: "signals plus barrier slots overflow u32".into(),
                })?;
        let slots = u64::from(per_ctx) * u64::from(p.nctx);
        if slots > p.signal_slots {
            return Err(GinError::Unsupported {
                rank: p.rank,
                what: "signal range",
                why: format!(
                    "needs {slots} slots, the host layer allocated {}",
                    p.signal_slots
                ),
            });
        }
        let need = slots * 8;
        let have = p
            .signal_window
            .local_size()
            .saturating_sub(p.signal_base * 8);
        if need > have {
            return Err(GinError::Unsupported {
                rank: p.rank,
                what: "signal window",
                why: format!("needs {need} bytes past slot {}, has {have}", p.signal_base),
            });
        }
        if p.lsa.len() != p.nranks || p.connected.len() != p.nranks {
            return Err(GinError::Unsupported {
                rank: p.rank,
                what: "direct-path table",
                why: format!("{} entries for {} ranks", p.lsa.len(), p.nranks),
            });
        }
        let abort = Arc::new(AtomicU32::new(0));
        let error_word = Box::new(AtomicU64::new(0));
        let mut flags = 0;
        if p.strong_signals {
            flags |= DEVCOMM_FLAG_STRONG_SIGNALS;
        }
        if p.va_signals {
            flags |= DEVCOMM_FLAG_VA_SIGNALS;
        }
        if p.exclusive_contexts {
            flags |= DEVCOMM_FLAG_EXCLUSIVE_CTX;
        }
        let abi = DevCommAbi {
            rank: p.rank as u32,
            nranks: p.nranks as u32,
            nctx: p.nctx,
            nsignals: per_ctx,
            ncounters: p.ncounters,
            flags,
            signal_base: p.signal_base,
            signals: p.signal_window.as_ptr() as u64,
            counter_base: p.counter_base,
            counters: p.counters.base_ptr(),
            abort_flag: Arc::as_ptr(&abort) as u64,
            error_word: std::ptr::from_ref::<AtomicU64>(&error_word) as u64,
            timeout_ticks: 0,
            ..DevCommAbi::default()
        };
        let nbar = (p.world_barriers + p.rail_barriers) as usize * p.nctx as usize;
        Ok(Self {
            backend_used: (0..p.nctx as usize * p.nranks)
                .map(|_| AtomicBool::new(false))
                .collect(),
            epochs: (0..nbar).map(|_| AtomicU64::new(0)).collect(),
            per_ctx,
            abi,
            abort,
            error_word,
            p,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.p.rank
    }

    /// Ranks in the communicator.
    pub fn nranks(&self) -> usize {
        self.p.nranks
    }

    /// Contexts: independent ordering domains.
    pub fn nctx(&self) -> u32 {
        self.p.nctx
    }

    /// The backend's name.
    pub fn backend_name(&self) -> &'static str {
        self.p.backend.name()
    }

    /// Whether `peer` is reached by direct load/store.
    pub fn is_direct(&self, peer: usize) -> bool {
        self.p.lsa.get(peer).copied().unwrap_or(false)
    }

    /// The ABI view a kernel would receive.
    pub fn abi(&self) -> &DevCommAbi {
        &self.abi
    }

    /// Set to non-zero to make every wait on this communicator return
    /// [`GinError::Aborted`].
    pub fn abort_flag(&self) -> Arc<AtomicU32> {
        self.abort.clone()
    }

    /// The default timeout of waits.
    pub fn timeout(&self) -> Duration {
        self.p.timeout
    }

    /// The ranks of a team, in team order.
    pub fn team(&self, team: Team) -> Vec<usize> {
        match team {
            Team::World => (0..self.p.nranks).collect(),
            Team::Rail => self.p.rail.clone(),
        }
    }

    /// A handle on context `ctx`.
    pub fn ctx(&self, ctx: u32) -> Result<Ctx<'_>, GinError> {
        if ctx >= self.p.nctx {
            return Err(GinError::BadContext {
                rank: self.p.rank,
                ctx,
                nctx: self.p.nctx,
            });
        }
        Ok(Ctx { dc: self, ctx })
    }

    /// A barrier over `team`, using barrier `index` of that team.
    pub fn barrier(&self, team: Team, index: u32) -> Result<BarrierSession<'_>, GinError> {
        let (count, number) = match team {
            Team::World => (self.p.world_barriers, index),
            Team::Rail => (self.p.rail_barriers, self.p.world_barriers + index),
        };
        if index >= count {
            return Err(GinError::Unsupported {
                rank: self.p.rank,
                what: "barrier",
                why: format!(
                    "{team:?} barrier {index} requested, the requirements asked for {count}"
                ),
            });
        }
        Ok(BarrierSession {
            dc: self,
            team,
            members: self.team(team),
            // Each barrier owns one slot per sending rank, past the user ids.
            signal: self.p.nsignals + number * self.p.nranks as u32,
            epoch_index: number as usize,
        })
    }

    fn signal_offset(&self, ctx: u32, id: u32) -> u64 {
        (self.p.signal_base + u64::from(ctx) * u64::from(self.per_ctx) + u64::from(id)) * 8
    }

    fn counter_slot(&self, ctx: u32, id: u32) -> u64 {
        self.p.counter_base + u64::from(ctx) * u64::from(self.p.ncounters) + u64::from(id)
    }

    fn check_peer(&self, peer: usize) -> Result<(), GinError> {
        if peer >= self.p.nranks {
            return Err(GinError::BadPeer {
                rank: self.p.rank,
                peer,
                nranks: self.p.nranks,
            });
        }
        if !self.p.connected.get(peer).copied().unwrap_or(false) {
            return Err(GinError::Unsupported {
                rank: self.p.rank,
                what: "this peer",
                why: format!(
                    "rank {peer} is not connected (rail connection: only the rail's ranks are)"
                ),
            });
        }
        Ok(())
    }

    fn check_window(&self, w: &Window) -> Result<(), GinError> {
        if w.comm_id() != self.p.comm_id {
            return Err(GinError::ForeignWindow {
                rank: self.p.rank,
                window: w.id(),
            });
        }
        Ok(())
    }

    fn job_health(&self) -> Result<(), GinError> {
        self.p.health.check().map_err(|why| GinError::JobFailed {
            rank: self.p.rank,
            why,
        })
    }

    fn health(&self) -> Result<(), GinError> {
        self.job_health()?;
        match self.p.backend.health() {
            Ok(()) => Ok(()),
            Err(e) => Err(self.cause_of(e)),
        }
    }

    /// As [`DevComm::health`] for a wait on operations to `peer` only: that
    /// peer's liveness instead of the whole job's, and the backend's own.
    fn peer_health(&self, peer: usize) -> Result<(), GinError> {
        self.p
            .health
            .check_peer(peer)
            .map_err(|why| GinError::JobFailed {
                rank: self.p.rank,
                why,
            })?;
        match self.p.backend.health() {
            Ok(()) => Ok(()),
            Err(e) => Err(self.cause_of(e)),
        }
    }

    /// A backend's error (a broken link, a failed completion) is often the
    /// echo of a death or departure the job-level watch is about to report
    /// (a peer that quit because a third rank died): give it a moment, so
    /// the error names the cause, not the echo. Failure path only.
    fn cause_of(&self, e: GinError) -> GinError {
        let until = std::time::Instant::now() + CAUSE_GRACE;
        loop {
            if let Err(cause) = self.job_health() {
                return cause;
            }
            if std::time::Instant::now() >= until {
                return e;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Why a wait timed out, if something reports it within a short grace:
    /// the job's liveness watch (the whole job's, or `peer`'s alone for a
    /// wait on one peer) first, then the backend's own error. The two often
    /// arrive together: when a peer stops, every rank's waits time out at
    /// about the moment the job hears which peer it was, and a backend error
    /// seen then (a link to a rank that gave up and left) is the echo.
    fn timeout_cause(&self, peer: Option<usize>) -> Option<GinError> {
        let until = std::time::Instant::now() + CAUSE_GRACE;
        loop {
            let job = peer.map_or_else(|| self.p.health.check(), |p| self.p.health.check_peer(p));
            if let Err(why) = job {
                return Some(GinError::JobFailed {
                    rank: self.p.rank,
                    why,
                });
            }
            if let Err(e) = self.p.backend.health() {
                return Some(self.cause_of(e));
            }
            if std::time::Instant::now() >= until {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Polls `ready` with this communicator's timeout, abort flag and health
    /// (the job's, or `peer`'s alone when the wait covers one peer).
    fn wait(
        &self,
        ctx: u32,
        peer: Option<usize>,
        what: &dyn Fn() -> String,
        timeout: Duration,
        mut value: impl FnMut() -> Result<(u64, bool), GinError>,
        expected: u64,
    ) -> Result<(), GinError> {
        let mut last = 0;
        let mut err = None;
        let r = poll(
            timeout,
            &self.abort,
            || match value() {
                Ok((v, done)) => {
                    last = v;
                    done
                }
                Err(e) => {
                    err = Some(e);
                    true
                }
            },
            || peer.map_or_else(|| self.health(), |p| self.peer_health(p)),
        );
        if let Some(e) = err {
            return Err(self.cause_of(e));
        }
        match r {
            Ok(()) => Ok(()),
            Err(stop) => {
                let e = match stop {
                    // A timeout is often the echo of a backend thread blocked
                    // on the same stalled peer (a proxy or NIC sending to a
                    // rank that stopped reading), or of another rank's
                    // transport, which give up at about the same moment with
                    // an error naming that peer: give them a moment, so the
                    // error names the cause. Failure path only.
                    Stop::Timeout(waited) => self.timeout_cause(peer).unwrap_or_else(|| {
                        // A wait as long as the job's timeout on a peer
                        // that stopped: the job hears of it (a caller's
                        // shorter deadline judges nobody).
                        if timeout >= self.p.timeout {
                            self.p.health.report_stopped(peer);
                        }
                        GinError::Timeout {
                            rank: self.p.rank,
                            ctx,
                            peer,
                            what: what(),
                            last,
                            expected,
                            waited,
                            suspects: self.p.health.diagnose().unwrap_or_default(),
                        }
                    }),
                    Stop::Aborted => GinError::Aborted {
                        rank: self.p.rank,
                        ctx,
                        what: what(),
                        last,
                        expected,
                    },
                    Stop::Failed(e) => e,
                };
                self.error_word.store(1, Ordering::Relaxed);
                Err(e)
            }
        }
    }
}

/// `ptr::copy`, with the 8-byte case done in a register: a memmove call
/// costs as much as the rest of a small direct put.
///
/// # Safety
/// As for `ptr::copy`: `src` readable and `dst` writable for `n` bytes.
unsafe fn copy_bytes(src: *const u8, dst: *mut u8, n: usize) {
    // SAFETY: forwarded; unaligned reads and writes of 8 bytes in range, and
    // reading before writing tolerates overlap as `copy` does.
    unsafe {
        if n == 8 {
            dst.cast::<u64>()
                .write_unaligned(src.cast::<u64>().read_unaligned());
        } else {
            std::ptr::copy(src, dst, n);
        }
    }
}

/// One context of a device communicator: an ordering domain.
#[derive(Debug, Clone, Copy)]
pub struct Ctx<'a> {
    dc: &'a DevComm,
    ctx: u32,
}

impl<'a> Ctx<'a> {
    /// This context's index.
    pub fn index(&self) -> u32 {
        self.ctx
    }

    /// The device communicator it belongs to.
    pub fn comm(&self) -> &'a DevComm {
        self.dc
    }

    fn resolve_remote<'w>(
        &self,
        peer: usize,
        remote: Remote<'w>,
    ) -> Result<Option<SignalUpdate<'w>>, GinError>
    where
        'a: 'w,
    {
        let dc = self.dc;
        let rank = dc.p.rank;
        Ok(match remote {
            Remote::None => None,
            Remote::Signal { id, op, order } => {
                if id.0 >= dc.p.nsignals {
                    return Err(GinError::UnknownSignal {
                        rank,
                        id: id.0,
                        nsignals: dc.p.nsignals,
                    });
                }
                self.check_order(order)?;
                Some(self.slot_update(id.0, op, order))
            }
            Remote::VaSignal {
                window,
                offset,
                op,
                order,
            } => {
                if !dc.p.va_signals {
                    return Err(GinError::Unsupported {
                        rank,
                        what: "signal by window address",
                        why: "the requirements did not ask for VA signals".into(),
                    });
                }
                dc.check_window(window)?;
                window.check("signal", peer, offset, 8)?;
                if offset % 8 != 0 {
                    return Err(GinError::Misaligned {
                        rank,
                        what: "signal",
                        window: window.id(),
                        offset,
                        align: 8,
                    });
                }
                self.check_order(order)?;
                Some(SignalUpdate {
                    window,
                    offset,
                    add: op.amount(),
                    order,
                })
            }
        })
    }

    fn check_order(&self, order: Order) -> Result<(), GinError> {
        if order == Order::Strong && !self.dc.p.strong_signals {
            return Err(GinError::Unsupported {
                rank: self.dc.p.rank,
                what: "a strong signal",
                why: "the requirements did not ask for strong signals; use Order::Weak".into(),
            });
        }
        Ok(())
    }

    fn slot_update(&self, id: u32, op: SignalOp, order: Order) -> SignalUpdate<'a> {
        SignalUpdate {
            window: &self.dc.p.signal_window,
            offset: self.dc.signal_offset(self.ctx, id),
            add: op.amount(),
            order,
        }
    }

    fn resolve_local(&self, local: Local) -> Result<Option<u64>, GinError> {
        match local {
            Local::None => Ok(None),
            Local::CounterInc(id) => {
                if id.0 >= self.dc.p.ncounters {
                    return Err(GinError::UnknownCounter {
                        rank: self.dc.p.rank,
                        id: id.0,
                        ncounters: self.dc.p.ncounters,
                    });
                }
                Ok(Some(self.dc.counter_slot(self.ctx, id.0)))
            }
        }
    }

    /// Writes `bytes` bytes from this rank's part of `src` at `src_off` to
    /// `peer`'s part of `dst` at `dst_off`, then performs `remote` at the peer
    /// and `local` here. Everything is checked before anything moves.
    #[allow(clippy::too_many_arguments)]
    pub fn put(
        &self,
        peer: usize,
        dst: &Window,
        dst_off: u64,
        src: &Window,
        src_off: u64,
        bytes: u64,
        remote: Remote<'_>,
        local: Local,
    ) -> Result<(), GinError> {
        self.dc.check_window(src)?;
        src.check("put source", self.dc.p.rank, src_off, bytes)?;
        self.issue_put(
            peer,
            dst,
            dst_off,
            Source::Window {
                window: src,
                offset: src_off,
            },
            bytes,
            remote,
            local,
        )
    }

    /// Writes the 8-byte little-endian `value` to `peer`'s part of `dst`.
    pub fn put_value(
        &self,
        peer: usize,
        dst: &Window,
        dst_off: u64,
        value: u64,
        remote: Remote<'_>,
    ) -> Result<(), GinError> {
        self.issue_put(
            peer,
            dst,
            dst_off,
            Source::Inline(value),
            8,
            remote,
            Local::None,
        )
    }

    /// A signal with no data. Release semantics: with [`Order::Strong`],
    /// every earlier put of this context to `peer` is visible when it is.
    pub fn signal(&self, peer: usize, remote: Remote<'_>) -> Result<(), GinError> {
        if matches!(remote, Remote::None) {
            return Err(GinError::Unsupported {
                rank: self.dc.p.rank,
                what: "signal",
                why: "a signal needs a remote action".into(),
            });
        }
        self.issue_put(
            peer,
            &self.dc.p.signal_window,
            0,
            Source::Empty,
            0,
            remote,
            Local::None,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn issue_put(
        &self,
        peer: usize,
        dst: &Window,
        dst_off: u64,
        src: Source<'_>,
        bytes: u64,
        remote: Remote<'_>,
        local: Local,
    ) -> Result<(), GinError> {
        let dc = self.dc;
        dc.check_peer(peer)?;
        dc.check_window(dst)?;
        dst.check("put destination", peer, dst_off, bytes)?;
        let signal = self.resolve_remote(peer, remote)?;
        let counter = self.resolve_local(local)?;
        let op = PutOp {
            ctx: self.ctx,
            peer,
            dst,
            dst_off,
            src,
            bytes,
            signal,
            counter,
        };
        self.dispatch(&op)
    }

    /// Sends a validated put down the direct path when every part of it is
    /// mapped, otherwise to the backend.
    fn dispatch(&self, op: &PutOp<'_>) -> Result<(), GinError> {
        let dc = self.dc;
        if dc.is_direct(op.peer) && self.put_direct(op)? {
            return Ok(());
        }
        dc.backend_used[self.ctx as usize * dc.p.nranks + op.peer].store(true, Ordering::Relaxed);
        dc.p.backend.put(op)
    }

    /// The load/store path: copy into the peer's mapping, then update the
    /// signal with release ordering. Returns false when some part of the
    /// operation has no mapping (then the backend takes it whole). When the
    /// owner revoked the data's part or the signal's, the put is refused
    /// before anything moves (docs/device-api.md, "Refused operations").
    fn put_direct(&self, op: &PutOp<'_>) -> Result<bool, GinError> {
        let dst = if op.bytes > 0 {
            match op.dst.peer_ptr(op.peer) {
                Some(p) => Some(p),
                None => return Ok(false),
            }
        } else {
            None
        };
        let slot = match &op.signal {
            Some(s) => match s.window.peer_slot(op.peer, s.offset) {
                Some(slot) => Some((slot, s)),
                None => return Ok(false),
            },
            None => None,
        };
        // Earlier operations that went through the backend must land first
        // when this one promises ordering.
        if slot.is_some() {
            let used = &self.dc.backend_used[self.ctx as usize * self.dc.p.nranks + op.peer];
            // A plain load first: the swap is an atomic read-modify-write,
            // too dear for every direct put.
            if used.load(Ordering::Relaxed) && used.swap(false, Ordering::Relaxed) {
                let t = self.dc.p.backend.ticket(self.ctx, Some(op.peer))?;
                self.wait_ticket(&t, self.dc.p.timeout)?;
            }
        }
        // Both parts are checked before anything moves, as a tcp target
        // checks a put and its signal: a refusal is whole.
        // A part dropped under a put is usually the echo of its owner
        // leaving because another rank died: name the cause if it comes.
        op.dst
            .served("put", op.peer, op.dst_off, op.bytes)
            .map_err(|e| self.dc.cause_of(e))?;
        if let Some((_, s)) = &slot {
            s.window
                .served("signal", op.peer, s.offset, 8)
                .map_err(|e| self.dc.cause_of(e))?;
        }
        if let Some(dst) = dst {
            // SAFETY: `issue_put` checked the destination range against the
            // peer's size and the source range against ours; both mappings
            // live as long as the windows. `copy` tolerates overlap (a rank
            // putting to itself within one window).
            unsafe {
                let d = dst.add(op.dst_off as usize);
                match op.src {
                    Source::Window { window, offset } => {
                        copy_bytes(window.as_ptr().add(offset as usize), d, op.bytes as usize);
                    }
                    Source::Inline(v) => {
                        let b = v.to_le_bytes();
                        std::ptr::copy(b.as_ptr(), d, (op.bytes as usize).min(8));
                    }
                    Source::Empty => {}
                }
            }
        }
        if let Some((slot, s)) = slot {
            // Release: the data above is visible to whoever acquires the signal.
            slot.fetch_add(s.add, Ordering::Release);
        }
        if let Some(c) = op.counter {
            self.dc.p.counters.bump(c);
        }
        Ok(true)
    }

    /// Reads `bytes` bytes of `peer`'s part of `remote` at `remote_off` into
    /// this rank's part of `local` at `local_off`. The data has landed after
    /// the next [`Ctx::flush`].
    pub fn get(
        &self,
        peer: usize,
        remote: &Window,
        remote_off: u64,
        local: &Window,
        local_off: u64,
        bytes: u64,
    ) -> Result<(), GinError> {
        let dc = self.dc;
        dc.check_peer(peer)?;
        dc.check_window(remote)?;
        dc.check_window(local)?;
        remote.check("get source", peer, remote_off, bytes)?;
        local.check("get destination", dc.p.rank, local_off, bytes)?;
        if dc.is_direct(peer)
            && let Some(src) = remote.peer_ptr(peer)
        {
            remote
                .served("get", peer, remote_off, bytes)
                .map_err(|e| dc.cause_of(e))?;
            // SAFETY: ranges checked above; mappings live with the windows.
            unsafe {
                std::ptr::copy(
                    src.add(remote_off as usize),
                    local.as_ptr().add(local_off as usize),
                    bytes as usize,
                );
            }
            std::sync::atomic::fence(Ordering::Acquire);
            return Ok(());
        }
        dc.backend_used[self.ctx as usize * dc.p.nranks + peer].store(true, Ordering::Relaxed);
        dc.p.backend.get(&GetOp {
            ctx: self.ctx,
            peer,
            remote,
            remote_off,
            local,
            local_off,
            bytes,
        })
    }

    /// Waits until every operation issued on this context has completed
    /// locally: sources may be reused and gets have landed. Says nothing
    /// about remote visibility.
    pub fn flush(&self) -> Result<(), GinError> {
        let t = self.dc.p.backend.ticket(self.ctx, None)?;
        self.wait_ticket(&t, self.dc.p.timeout)
    }

    /// A request covering the operations issued so far to `peer`.
    pub fn flush_async(&self, peer: usize) -> Result<Ticket, GinError> {
        self.dc.check_peer(peer)?;
        self.dc.p.backend.ticket(self.ctx, Some(peer))
    }

    /// Waits for a request from [`Ctx::flush_async`].
    pub fn wait(&self, ticket: &Ticket) -> Result<(), GinError> {
        self.wait_ticket(ticket, self.dc.p.timeout)
    }

    fn wait_ticket(&self, t: &Ticket, timeout: Duration) -> Result<(), GinError> {
        let backend = &self.dc.p.backend;
        let what = || {
            format!(
                "local completion of {} operations{}",
                backend.name(),
                t.peer()
                    .map(|p| format!(" to rank {p}"))
                    .unwrap_or_default()
            )
        };
        self.dc.wait(
            self.ctx,
            t.peer(),
            &what,
            timeout,
            || Ok((0, backend.done(t)?)),
            1,
        )
    }

    fn signal_slot(&self, id: u32) -> Result<&AtomicU64, GinError> {
        if id >= self.dc.p.nsignals {
            return Err(GinError::UnknownSignal {
                rank: self.dc.p.rank,
                id,
                nsignals: self.dc.p.nsignals,
            });
        }
        self.raw_signal_slot(id)
    }

    fn raw_signal_slot(&self, id: u32) -> Result<&AtomicU64, GinError> {
        self.dc
            .p
            .signal_window
            .slot(self.dc.signal_offset(self.ctx, id))
    }

    /// The current value of signal `id`.
    pub fn read_signal(&self, id: u32) -> Result<u64, GinError> {
        Ok(self.signal_slot(id)?.load(Ordering::Acquire))
    }

    /// Waits until signal `id` reaches `target` (rolling compare), within the
    /// communicator's timeout. Returns the value seen.
    pub fn wait_signal(&self, id: u32, target: u64) -> Result<u64, GinError> {
        self.wait_signal_for(id, target, self.dc.p.timeout)
    }

    /// [`Ctx::wait_signal`] with an explicit timeout.
    pub fn wait_signal_for(
        &self,
        id: u32,
        target: u64,
        timeout: Duration,
    ) -> Result<u64, GinError> {
        let slot = self.signal_slot(id)?;
        self.wait_slot(slot, target, timeout, &|| format!("signal {id}"))
    }

    fn wait_slot(
        &self,
        slot: &AtomicU64,
        target: u64,
        timeout: Duration,
        what: &dyn Fn() -> String,
    ) -> Result<u64, GinError> {
        self.dc.p.backend.progress();
        let mut seen = 0;
        self.dc.wait(
            self.ctx,
            None,
            what,
            timeout,
            || {
                seen = slot.load(Ordering::Acquire);
                Ok((seen, signal_reached(seen, target)))
            },
            target,
        )?;
        Ok(seen)
    }

    /// Sets signal `id` to zero. Only safe when no update to it is in flight.
    pub fn reset_signal(&self, id: u32) -> Result<(), GinError> {
        self.signal_slot(id)?.store(0, Ordering::Release);
        Ok(())
    }

    /// Waits until the 8-byte slot at `offset` of this rank's part of
    /// `window` (a signal by window address) reaches `target`.
    pub fn wait_va_signal(
        &self,
        window: &Window,
        offset: u64,
        target: u64,
    ) -> Result<u64, GinError> {
        self.dc.check_window(window)?;
        let slot = window.slot(offset)?;
        let id = window.id();
        self.wait_slot(slot, target, self.dc.p.timeout, &|| {
            format!("signal at offset {offset} of window {id}")
        })
    }

    fn counter(&self, id: u32) -> Result<&AtomicU64, GinError> {
        if id >= self.dc.p.ncounters {
            return Err(GinError::UnknownCounter {
                rank: self.dc.p.rank,
                id,
                ncounters: self.dc.p.ncounters,
            });
        }
        self.dc
            .p
            .counters
            .slot(self.dc.counter_slot(self.ctx, id))
            .ok_or(GinError::UnknownCounter {
                rank: self.dc.p.rank,
                id,
                ncounters: self.dc.p.ncounters,
            })
    }

    /// The current value of counter `id` (56 bits).
    pub fn read_counter(&self, id: u32) -> Result<u64, GinError> {
        Ok(self.counter(id)?.load(Ordering::Acquire) & COUNTER_MASK)
    }

    /// Waits until counter `id` reaches `target` (56-bit rolling compare).
    pub fn wait_counter(&self, id: u32, target: u64) -> Result<u64, GinError> {
        let c = self.counter(id)?;
        self.dc.p.backend.progress();
        let mut seen = 0;
        self.dc.wait(
            self.ctx,
            None,
            &|| format!("counter {id}"),
            self.dc.p.timeout,
            || {
                // A failed completion is reported by the wait loop's periodic
                // health check (with its grace for naming the root cause).
                seen = c.load(Ordering::Acquire) & COUNTER_MASK;
                Ok((seen, counter_reached(seen, target)))
            },
            target & COUNTER_MASK,
        )?;
        Ok(seen)
    }

    /// Sets counter `id` to zero.
    pub fn reset_counter(&self, id: u32) -> Result<(), GinError> {
        self.counter(id)?.store(0, Ordering::Release);
        Ok(())
    }
}

/// A barrier over a team, built on signals: each member increments its own
/// slot at every other member, then waits until the slot of every other
/// member has reached this barrier's epoch.
///
/// One slot per sender, not one shared counter: with a shared counter a fast
/// member's signal for the next barrier could stand in for a slow member's
/// signal for this one (signals to different peers travel different
/// connections and may overtake each other).
#[derive(Debug)]
pub struct BarrierSession<'a> {
    dc: &'a DevComm,
    team: Team,
    members: Vec<usize>,
    signal: u32,
    epoch_index: usize,
}

impl BarrierSession<'_> {
    /// The team's ranks.
    pub fn members(&self) -> &[usize] {
        &self.members
    }

    /// Synchronises the team on context `ctx`. With [`Fence::Context`], puts
    /// issued earlier on `ctx` are visible everywhere when every member has
    /// returned; [`Fence::AllContexts`] extends that to every context.
    pub fn sync(&self, ctx: u32, fence: Fence) -> Result<(), GinError> {
        let c = self.dc.ctx(ctx)?;
        if fence == Fence::AllContexts {
            for other in 0..self.dc.p.nctx {
                if other != ctx {
                    self.dc.ctx(other)?.flush()?;
                }
            }
        }
        let order = if fence == Fence::None {
            Order::Weak
        } else {
            Order::Strong
        };
        let me = self.dc.p.rank;
        if fence != Fence::None {
            // Puts this rank queued to itself are ordered by no signal below:
            // complete them here (a no-op on the direct path).
            let t = self.dc.p.backend.ticket(ctx, Some(me))?;
            c.wait_ticket(&t, self.dc.p.timeout)?;
        }
        let update = c.slot_update(self.signal + me as u32, SignalOp::Inc, order);
        for &peer in self.members.iter().filter(|&&p| p != me) {
            c.issue_put_update(peer, update)?;
        }
        let epoch = &self.dc.epochs[self.epoch_index * self.dc.p.nctx as usize + ctx as usize];
        let target = epoch.load(Ordering::Relaxed) + 1;
        let team = self.team;
        for &peer in self.members.iter().filter(|&&p| p != me) {
            let slot = c.raw_signal_slot(self.signal + peer as u32)?;
            c.wait_slot(slot, target, self.dc.p.timeout, &|| {
                format!(
                    "{team:?} barrier {} (rank {peer}'s arrival)",
                    self.epoch_index
                )
            })?;
        }
        epoch.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

impl Ctx<'_> {
    /// A signal-only put to an already-resolved slot (barriers use ids past
    /// the user range).
    fn issue_put_update(&self, peer: usize, update: SignalUpdate<'_>) -> Result<(), GinError> {
        let dc = self.dc;
        dc.check_peer(peer)?;
        let op = PutOp {
            ctx: self.ctx,
            peer,
            dst: &dc.p.signal_window,
            dst_off: 0,
            src: Source::Empty,
            bytes: 0,
            signal: Some(update),
            counter: None,
        };
        self.dispatch(&op)
    }
}
