//! One rank's bootstrap endpoint: connections, mailboxes and failure tracking.
//!
//! Each rank listens on one socket and dials each peer at most once, lazily,
//! the first time it sends to it: rank `a` sends to `b` over the connection
//! `a` dialed, and receives from `b` over the connection `b` dialed. Every
//! accepted connection has a reader thread that files incoming messages into
//! a per-peer mailbox, so writers never wait on a reader and two ranks sending
//! large messages to each other at once cannot deadlock.

use std::collections::VecDeque;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use crate::env::{Config, LaunchEnv, Rendezvous};
use crate::error::BootstrapError;
use crate::frame;
use crate::frame::{Frame, Purpose, read_frame};
use crate::gate::Gate;
use crate::id::UniqueId;
use crate::net::{
    SEND_POLL, WriteStop, connect, handshake_dial, welcome, write_all_checked, write_frame,
};
use crate::root::BootstrapRoot;

/// Tags with this bit set belong to collectives; user tags never have it.
pub(crate) const COLLECTIVE_TAG: u64 = 1 << 63;

/// How long a rank waits for what is already on its way once something went
/// wrong: news of the cause of a failed connection (see
/// [`Shared::cause_of`]), and messages peers sent before a death became
/// known here (see [`Bootstrap::recv_tagged`]).
const CAUSE_GRACE: Duration = Duration::from_secs(2);

/// A rank's endpoint in the job's bootstrap network.
#[derive(Debug)]
pub struct Bootstrap {
    rank: usize,
    nranks: usize,
    config: Config,
    id: UniqueId,
    listen_addr: SocketAddr,
    addrs: Vec<SocketAddr>,
    shared: Arc<Shared>,
    /// Sending connections, dialed on first use.
    out: Vec<Mutex<Option<TcpStream>>>,
    root: Mutex<TcpStream>,
    /// Sequence number of the next collective: every rank calls collectives in
    /// the same order, so equal numbers match up.
    seq: AtomicU64,
    /// The root this rank hosts, when it is rank 0 of a root-address launch.
    hosted_root: Option<BootstrapRoot>,
}

#[derive(Debug)]
pub(crate) struct Shared {
    rank: usize,
    state: Mutex<State>,
    cv: Condvar,
}

#[derive(Debug, Default)]
struct State {
    mail: Vec<VecDeque<(u64, Vec<u8>)>>,
    /// A peer said goodbye on its sending connection.
    closed: Vec<bool>,
    /// The root says the peer left the job in order.
    left: Vec<bool>,
    /// The first peer that left: the one to name (others may have left
    /// because of it).
    first_left: Option<usize>,
    /// The peer's sending connection to this rank was admitted (recorded
    /// before its welcome, so before anything it sends on it).
    connected: Vec<bool>,
    /// The first failure of a peer this rank heard of.
    dead: Option<Failure>,
    /// When this rank heard of it.
    dead_at: Option<Instant>,
    /// Each peer's own failure, where it has one.
    failed: Vec<Option<Failure>>,
    /// The peer's sending connection to this rank has ended (goodbye, end
    /// of stream or error): everything it sent is in its mailbox.
    drained: Vec<bool>,
    root_lost: Option<String>,
    incoming: Vec<TcpStream>,
    closing: bool,
}

/// A peer that broke the job.
#[derive(Debug, Clone)]
struct Failure {
    peer: usize,
    how: How,
    why: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum How {
    /// It vanished without a goodbye.
    Died,
    /// It stopped draining its connections (stopped, frozen or hung).
    Stuck,
}

impl Failure {
    /// The frame that passes this news on.
    fn frame(&self) -> Frame {
        let (rank, reason) = (self.peer as u32, self.why.clone());
        match self.how {
            How::Died => Frame::PeerDied { rank, reason },
            How::Stuck => Frame::PeerStuck { rank, reason },
        }
    }
}

impl State {
    fn new(nranks: usize) -> Self {
        Self {
            mail: (0..nranks).map(|_| VecDeque::new()).collect(),
            closed: vec![false; nranks],
            left: vec![false; nranks],
            connected: vec![false; nranks],
            failed: vec![None; nranks],
            drained: vec![false; nranks],
            ..Self::default()
        }
    }

    /// Whether everything `peer` sent to this rank before it failed has
    /// arrived: its connection has ended, or it never made one.
    fn delivered(&self, peer: usize) -> bool {
        self.drained[peer] || !self.connected[peer]
    }

    /// Whether `peer` can send nothing more: it said goodbye on its
    /// connection, or it left the job without ever connecting to this rank.
    /// A peer that connected and left is done only once its goodbye arrives
    /// on that connection, behind everything it sent.
    fn finished(&self, peer: usize) -> bool {
        self.closed[peer] || (self.left[peer] && !self.connected[peer])
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock means a reader thread panicked; the state it guards
        // is plain data that stays consistent, so keep going.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn nranks(&self) -> usize {
        self.lock().closed.len()
    }

    fn mark_dead(&self, peer: usize, why: String) {
        self.mark_failed(peer, How::Died, why);
    }

    fn mark_failed(&self, peer: usize, how: How, why: String) {
        let mut st = self.lock();
        if !st.closing {
            let f = Failure { peer, how, why };
            if st.failed[peer].is_none() {
                st.failed[peer] = Some(f.clone());
            }
            if st.dead.is_none() {
                match how {
                    How::Died => warn!(rank = self.rank, peer, why = %f.why, "peer died"),
                    How::Stuck => {
                        warn!(rank = self.rank, peer, why = %f.why, "peer stopped responding");
                    }
                }
                st.dead = Some(f);
                st.dead_at = Some(Instant::now());
            }
        }
        drop(st);
        self.cv.notify_all();
    }

    /// The error for `f`, seen by this rank in `op`.
    fn failure_error(&self, f: &Failure, op: &str) -> BootstrapError {
        let (rank, op, peer, why) = (self.rank, op.to_owned(), f.peer, f.why.clone());
        match f.how {
            How::Died => BootstrapError::PeerDied {
                rank,
                op,
                peer,
                why,
            },
            How::Stuck => BootstrapError::PeerUnresponsive {
                rank,
                op,
                peer,
                why,
            },
        }
    }

    /// Fails if `peer` itself died or stopped, or the root was lost: what a
    /// send to `peer` cannot go on without. Another rank's death does not
    /// stop it: `peer` still drains its connections, and may need the
    /// message to finish what the dead rank completed.
    fn check_peer_alive(&self, st: &State, peer: usize, op: &str) -> Result<(), BootstrapError> {
        if let Some(f) = &st.failed[peer] {
            return Err(self.failure_error(f, op));
        }
        self.check_root(st, op)
    }

    fn check_root(&self, st: &State, op: &str) -> Result<(), BootstrapError> {
        if let Some(why) = &st.root_lost {
            return Err(BootstrapError::RootLost {
                rank: self.rank,
                op: op.to_owned(),
                why: why.clone(),
            });
        }
        Ok(())
    }

    /// Fails if the job is already broken: a dead peer or a lost root.
    fn check_alive(&self, st: &State, op: &str) -> Result<(), BootstrapError> {
        if let Some(f) = &st.dead {
            return Err(self.failure_error(f, op));
        }
        self.check_root(st, op)
    }

    /// A connection to a peer that fails is often a symptom: the peer is
    /// leaving because it heard of a death (or lost the root) before this
    /// rank did. Waits up to `grace` for that news and returns the cause when
    /// it comes, else `symptom`. Once `peer` has said goodbye there is no
    /// news to wait for: a peer leaving because of a death passes it on ahead
    /// of its goodbye.
    fn cause_of(
        &self,
        op: &str,
        symptom: BootstrapError,
        grace: Duration,
        peer: Option<usize>,
    ) -> BootstrapError {
        let until = Instant::now() + grace;
        let mut st = self.lock();
        loop {
            if let Err(cause) = self.check_alive(&st, op) {
                return cause;
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() || peer.is_some_and(|p| p < st.closed.len() && st.finished(p)) {
                return symptom;
            }
            st = self
                .cv
                .wait_timeout(st, left)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }
}

impl Bootstrap {
    /// Joins the job described by `id` as `rank` of `nranks`, with settings
    /// from the environment (`GIN_TIMEOUT`).
    pub fn init(id: &UniqueId, rank: usize, nranks: usize) -> Result<Self, BootstrapError> {
        Self::init_with(id, rank, nranks, Config::from_env()?)
    }

    /// Joins the job the launcher's environment describes (see [`LaunchEnv`]).
    /// When only a root address is known, rank 0 hosts the root there.
    pub fn from_env() -> Result<Self, BootstrapError> {
        let env = LaunchEnv::from_env()?;
        Self::from_launch_env(&env, Config::from_env()?)
    }

    /// Like [`Bootstrap::from_env`] for an already-read environment.
    pub fn from_launch_env(env: &LaunchEnv, config: Config) -> Result<Self, BootstrapError> {
        let hosted_root = match &env.rendezvous {
            Rendezvous::RootAddr(id) if env.rank == 0 => {
                Some(BootstrapRoot::start_with_id(*id, Some(env.nranks), config)?)
            }
            _ => None,
        };
        let mut b = Self::init_with(&env.rendezvous.id(), env.rank, env.nranks, config)?;
        b.hosted_root = hosted_root;
        Ok(b)
    }

    /// Joins with explicit settings.
    pub fn init_with(
        id: &UniqueId,
        rank: usize,
        nranks: usize,
        config: Config,
    ) -> Result<Self, BootstrapError> {
        if nranks == 0 || rank >= nranks || u32::try_from(nranks).is_err() {
            return Err(BootstrapError::BadRank { rank, nranks });
        }
        let r = Some(rank);
        let deadline = Instant::now() + config.timeout;
        let Joined {
            mut root,
            listener,
            listen_addr,
            root_name,
        } = join_root(id, rank, nranks, config, deadline)?;
        let addrs = await_table(&mut root, id, rank, nranks, config, deadline, &root_name)?;

        let shared = Arc::new(Shared {
            rank,
            state: Mutex::new(State::new(nranks)),
            cv: Condvar::new(),
        });
        spawn_acceptor(listener, *id, nranks, config, shared.clone(), rank)?;
        spawn_root_reader(
            root.try_clone()
                .map_err(|e| BootstrapError::io(r, "cloning the root connection", e))?,
            shared.clone(),
        )?;
        debug!(rank, nranks, %listen_addr, "bootstrap ready");
        Ok(Self {
            rank,
            nranks,
            config,
            id: *id,
            listen_addr,
            addrs,
            shared,
            out: (0..nranks).map(|_| Mutex::new(None)).collect(),
            root: Mutex::new(root),
            seq: AtomicU64::new(0),
            hosted_root: None,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks in the job.
    pub fn nranks(&self) -> usize {
        self.nranks
    }

    /// The settings in force.
    pub fn config(&self) -> Config {
        self.config
    }

    /// Where this rank listens for its peers.
    pub fn listen_addr(&self) -> SocketAddr {
        self.listen_addr
    }

    /// Where each rank listens.
    pub fn peer_addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }

    pub(crate) fn check_peer(&self, peer: usize) -> Result<(), BootstrapError> {
        if peer >= self.nranks {
            return Err(BootstrapError::BadPeer {
                rank: self.rank,
                peer,
                nranks: self.nranks,
            });
        }
        Ok(())
    }

    pub(crate) fn next_collective_tag(&self) -> u64 {
        COLLECTIVE_TAG | self.seq.fetch_add(1, Ordering::Relaxed)
    }

    /// How long to wait for the cause of a failure (see [`Shared::cause_of`]).
    fn cause_grace(&self) -> Duration {
        CAUSE_GRACE.min(self.config.timeout)
    }

    pub(crate) fn deadline(&self) -> Instant {
        Instant::now() + self.config.timeout
    }

    /// Sends a message with a raw tag.
    pub(crate) fn send_tagged(
        &self,
        peer: usize,
        tag: u64,
        payload: &[u8],
        op: &str,
    ) -> Result<(), BootstrapError> {
        self.check_peer(peer)?;
        self.shared
            .check_peer_alive(&self.shared.lock(), peer, op)?;
        if peer == self.rank {
            self.shared.lock().mail[peer].push_back((tag, payload.to_vec()));
            self.shared.cv.notify_all();
            return Ok(());
        }
        let bytes = frame::encode(&Frame::Data {
            tag,
            payload: payload.to_vec(),
        })
        .map_err(|e| BootstrapError::Frame {
            rank: Some(self.rank),
            from: format!("this rank's {op} to rank {peer}"),
            source: e,
        })?;
        let mut slot = self.out[peer]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if slot.is_none() {
            match self.dial(peer, op) {
                Ok(s) => *slot = Some(s),
                // A timeout already waited long enough for any news: report
                // what arrived meanwhile, without waiting more.
                Err(e @ BootstrapError::Timeout { .. }) => {
                    return Err(self.shared.cause_of(op, e, Duration::ZERO, Some(peer)));
                }
                Err(e) => {
                    return Err(self.shared.cause_of(op, e, self.cause_grace(), Some(peer)));
                }
            }
        }
        let stream = slot.as_mut().expect("dialed above");
        let start = Instant::now();
        let deadline = start + self.config.timeout;
        // Every wait on a full socket ends at the deadline or at news that
        // `peer` failed, whichever comes first.
        let written = write_all_checked(stream, &bytes, |sent| {
            self.shared
                .check_peer_alive(&self.shared.lock(), peer, op)?;
            if Instant::now() >= deadline {
                return Err(BootstrapError::Timeout {
                    rank: self.rank,
                    op: op.to_owned(),
                    what: format!(
                        "rank {peer} to take a message of {} bytes ({sent} taken)",
                        bytes.len()
                    ),
                    waited: start.elapsed(),
                    missing: vec![peer],
                });
            }
            Ok(())
        });
        let e = match written {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        // The connection stops mid-frame: nothing more may be written on it,
        // not even a goodbye.
        if let Some(s) = slot.take() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        let e = match e {
            WriteStop::Stopped(e @ BootstrapError::Timeout { .. }) => {
                // A rank's reader threads drain its sockets whatever the rank
                // is doing, so a socket that stays full for the whole timeout
                // means its process has stopped: every rank must hear that,
                // or the ranks waiting on this one would blame it instead.
                let why = format!(
                    "rank {} could not send to it for {:.1?}",
                    self.rank, self.config.timeout
                );
                self.report_stuck(peer, &why);
                return Err(e);
            }
            WriteStop::Stopped(e) => return Err(e),
            WriteStop::Io(e) => e,
        };
        {
            let why = format!("sending to it failed: {e}");
            let symptom = BootstrapError::PeerDied {
                rank: self.rank,
                op: op.to_owned(),
                peer,
                why: why.clone(),
            };
            let err = self
                .shared
                .cause_of(op, symptom, self.cause_grace(), Some(peer));
            if matches!(&err, BootstrapError::PeerDied { peer: p, .. } if *p == peer) {
                self.shared.mark_dead(peer, why);
            }
            Err(err)
        }
    }

    /// Tells the job that `peer` stopped answering: a data path of this rank
    /// (a transport) waited the job's whole timeout for `peer` to take or
    /// answer a request, which a live process does in microseconds whatever
    /// its rank thread is doing. The root tells every rank, so ranks that
    /// were waiting on a third rank, one that gives up because of `peer` and
    /// leaves, name `peer` as the cause instead of that rank's departure.
    /// `why` says what went unanswered, for how long. Ignored for this rank
    /// itself, a rank outside the job, a peer already known to have failed,
    /// and while this rank closes. Writes one frame to the root and waits
    /// for no answer.
    pub fn report_unresponsive(&self, peer: usize, why: &str) {
        if peer == self.rank || peer >= self.nranks {
            return;
        }
        {
            let st = self.shared.lock();
            if st.closing || st.failed[peer].is_some() {
                return;
            }
        }
        self.report_stuck(peer, why);
    }

    /// Records that `peer` stopped draining its connections and tells the
    /// root, which tells every rank.
    fn report_stuck(&self, peer: usize, why: &str) {
        self.shared.mark_failed(peer, How::Stuck, why.to_owned());
        let mut root = self
            .root
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let _ = write_frame(
            &mut root,
            &Frame::PeerStuck {
                rank: peer as u32,
                reason: why.to_owned(),
            },
        );
    }

    fn dial(&self, peer: usize, op: &str) -> Result<TcpStream, BootstrapError> {
        let deadline = self.deadline();
        let what = format!("rank {peer} at {}", self.addrs[peer]);
        let mut s = match connect(Some(self.rank), self.addrs[peer], deadline, &what) {
            Ok(s) => s,
            Err(BootstrapError::Io { source, .. })
                if source.kind() == std::io::ErrorKind::TimedOut =>
            {
                return Err(BootstrapError::Timeout {
                    rank: self.rank,
                    op: op.to_owned(),
                    what: format!("a connection to {what}"),
                    waited: self.config.timeout,
                    missing: vec![peer],
                });
            }
            Err(e) => return Err(e),
        };
        let verdict = handshake_dial(
            &mut s,
            &self.id,
            (Purpose::Peer, self.rank as u32, self.nranks as u32, ""),
            deadline,
            self.config.max_frame,
            &what,
        )
        .map_err(|e| match e {
            BootstrapError::Timeout {
                rank, what, waited, ..
            } => BootstrapError::Timeout {
                rank,
                op: op.to_owned(),
                what: format!("{what} in the handshake with rank {peer}"),
                waited,
                missing: vec![peer],
            },
            e => e,
        })?;
        s.set_write_timeout(Some(SEND_POLL))
            .map_err(|e| BootstrapError::io(Some(self.rank), "setting a write timeout", e))?;
        match verdict {
            Ok(()) => Ok(s),
            Err(reason) => Err(BootstrapError::Refused {
                rank: self.rank,
                root: what,
                reason,
            }),
        }
    }

    /// Receives the first message from `peer` with a raw tag.
    ///
    /// What a peer sent is delivered even when a death is known: a message
    /// already filed, the messages a dead peer sent before it died (once its
    /// connection has drained), and, for [`CAUSE_GRACE`] after the death
    /// became known here, messages still on their way from live peers. So a
    /// rank that dies right after finishing a collective does not fail the
    /// peers still finishing it. After that the call fails naming the death.
    pub(crate) fn recv_tagged(
        &self,
        peer: usize,
        tag: u64,
        op: &str,
        deadline: Instant,
    ) -> Result<Vec<u8>, BootstrapError> {
        self.check_peer(peer)?;
        let start = Instant::now();
        let grace = self.cause_grace();
        let mut st = self.shared.lock();
        loop {
            if let Some(i) = st.mail[peer].iter().position(|(t, _)| *t == tag) {
                return Ok(st.mail[peer].remove(i).expect("index found above").1);
            }
            self.shared.check_root(&st, op)?;
            if let Some(f) = &st.failed[peer]
                && st.delivered(peer)
            {
                return Err(self.shared.failure_error(f, op));
            }
            if st.finished(peer) {
                self.shared.check_alive(&st, op)?;
                return Err(BootstrapError::PeerClosed {
                    rank: self.rank,
                    op: op.to_owned(),
                    peer,
                });
            }
            let mut wake = deadline;
            if let Some(at) = st.dead_at {
                let settled = at + grace;
                if Instant::now() >= settled {
                    self.shared.check_alive(&st, op)?;
                }
                wake = wake.min(settled);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let timeout = BootstrapError::Timeout {
                    rank: self.rank,
                    op: op.to_owned(),
                    what: format!("a message from rank {peer}"),
                    waited: start.elapsed(),
                    missing: vec![peer],
                };
                drop(st);
                // The peer may itself be waiting on a rank that stopped or
                // died: news of that is the better answer, and it is on
                // its way when the peer's own sends to that rank time out.
                return Err(self.shared.cause_of(op, timeout, grace, None));
            }
            let nap = wake.saturating_duration_since(Instant::now());
            st = self
                .shared
                .cv
                .wait_timeout(st, nap.max(Duration::from_millis(1)))
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }

    /// Fails if any rank of the job has died, stopped responding or left
    /// (exited in order), or the root was lost; never blocks. Data-path
    /// waits poll this so that a peer that is gone is an error there too,
    /// not a hang: a communicator is a collective object, so once a rank has
    /// left, waits on the job that are not already satisfied cannot be.
    /// Deaths take precedence over departures. (The bootstrap's own calls
    /// fail only on deaths: they go on between the ranks still present.)
    pub fn health(&self) -> Result<(), BootstrapError> {
        let st = self.shared.lock();
        self.shared.check_alive(&st, "health check")?;
        if let Some(peer) = st.first_left {
            return Err(BootstrapError::PeerExited {
                rank: self.rank,
                op: "health check".into(),
                peer,
            });
        }
        Ok(())
    }

    /// [`Bootstrap::health`], for a caller about to report a departure as
    /// the reason a wait failed: a rank that left in order often left
    /// because it heard of a death first (its error path drops its
    /// communicator), and the notice of its departure can overtake the
    /// root's notice of the death. So a departure is reported only after
    /// `grace` has passed without a death being heard of; a death is
    /// reported at once. Sleeps only on that failure path.
    pub fn health_settled(&self, grace: Duration) -> Result<(), BootstrapError> {
        let left = match self.health() {
            Err(left @ BootstrapError::PeerExited { .. }) => left,
            other => return other,
        };
        let until = Instant::now() + grace;
        while Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
            match self.health() {
                Err(BootstrapError::PeerExited { .. }) | Ok(()) => {}
                Err(cause) => return Err(cause),
            }
        }
        Err(left)
    }

    /// Fails if `peer` itself died, stopped responding or left the job, or
    /// the root was lost; never blocks. Unlike [`Bootstrap::health`], another
    /// rank's failure is not `peer`'s: a caller that masks lost peers (and
    /// goes on with the rest) asks this about the peer it waits on, so a
    /// second loss is seen even after a first.
    pub fn peer_health(&self, peer: usize) -> Result<(), BootstrapError> {
        self.check_peer(peer)?;
        let st = self.shared.lock();
        self.shared.check_peer_alive(&st, peer, "health check")?;
        if st.left[peer] {
            return Err(BootstrapError::PeerExited {
                rank: self.rank,
                op: "health check".into(),
                peer,
            });
        }
        Ok(())
    }

    /// A 32-byte token every rank of this job derives alike and strangers
    /// cannot: transports use it to authenticate their own connections.
    pub fn job_token(&self, purpose: &str) -> [u8; 32] {
        self.id.derive_token(purpose)
    }

    /// Sends `payload` to `peer` under a user `tag`. Messages to one peer with
    /// one tag arrive in the order sent.
    pub fn send(&self, peer: usize, tag: u32, payload: &[u8]) -> Result<(), BootstrapError> {
        self.send_tagged(peer, u64::from(tag), payload, "send")
    }

    /// Receives the next message from `peer` sent under `tag`, waiting at most
    /// the configured timeout.
    pub fn recv(&self, peer: usize, tag: u32) -> Result<Vec<u8>, BootstrapError> {
        self.recv_tagged(peer, u64::from(tag), "recv", self.deadline())
    }
}

impl Drop for Bootstrap {
    fn drop(&mut self) {
        let (incoming, dead) = {
            let mut st = self.shared.lock();
            st.closing = true;
            (std::mem::take(&mut st.incoming), st.dead.clone())
        };
        for slot in &self.out {
            let mut slot = slot
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some(s) = slot.as_mut() {
                // A rank leaving because of a death passes the news on ahead of
                // its goodbye, so its peers report the cause, not the symptom.
                if let Some(f) = &dead {
                    let _ = write_frame(s, &f.frame());
                }
                let _ = write_frame(s, &Frame::Goodbye);
                let _ = s.shutdown(std::net::Shutdown::Write);
            }
        }
        {
            let mut root = self
                .root
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let _ = write_frame(&mut root, &Frame::Goodbye);
            let _ = root.shutdown(std::net::Shutdown::Both);
        }
        for s in incoming {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        // Wake the acceptor so it notices it is closing.
        let _ = TcpStream::connect_timeout(&self.listen_addr, Duration::from_secs(1));
        if let Some(root) = &self.hosted_root {
            // Rank 0 hosts the root in this mode: stay until the others leave,
            // or they would lose their death watch.
            if !root.wait(self.config.timeout) {
                warn!("ranks still running when the hosted bootstrap root gave up waiting");
            }
        }
    }
}

/// A rank admitted by the root: its root connection and its own listener.
struct Joined {
    root: TcpStream,
    listener: TcpListener,
    listen_addr: SocketAddr,
    /// "the bootstrap root at ADDR", for messages.
    root_name: String,
}

/// Connects to the root, listens on the interface that reaches it and
/// introduces this rank (the first half of [`Bootstrap::init_with`]).
fn join_root(
    id: &UniqueId,
    rank: usize,
    nranks: usize,
    config: Config,
    deadline: Instant,
) -> Result<Joined, BootstrapError> {
    let r = Some(rank);
    let mut root = connect(r, id.addr, deadline, "the bootstrap root")?;
    // Listen on the interface that reaches the root: that is the one the
    // other ranks can reach too.
    let local_ip = root
        .local_addr()
        .map_err(|e| BootstrapError::io(r, "reading the local address", e))?
        .ip();
    let listener = TcpListener::bind((local_ip, 0))
        .map_err(|e| BootstrapError::io(r, format!("listening on {local_ip}"), e))?;
    let listen_addr = listener
        .local_addr()
        .map_err(|e| BootstrapError::io(r, "reading the listening address", e))?;
    let root_name = format!("the bootstrap root at {}", id.addr);
    if let Err(reason) = handshake_dial(
        &mut root,
        id,
        (
            Purpose::Root,
            rank as u32,
            nranks as u32,
            &listen_addr.to_string(),
        ),
        deadline,
        config.max_frame,
        &root_name,
    )? {
        return Err(BootstrapError::Refused {
            rank,
            root: id.addr.to_string(),
            reason,
        });
    }
    Ok(Joined {
        root,
        listener,
        listen_addr,
        root_name,
    })
}

/// Waits for the root's address table (or its verdict, or the deadline) and
/// checks it: one usable address for each of the `nranks` ranks.
fn await_table(
    root: &mut TcpStream,
    id: &UniqueId,
    rank: usize,
    nranks: usize,
    config: Config,
    deadline: Instant,
    root_name: &str,
) -> Result<Vec<SocketAddr>, BootstrapError> {
    let r = Some(rank);
    // Wait for the address table, the root's verdict, or our deadline.
    // The root's own deadline is the same length but started earlier, so
    // normally its Abort (which names the missing ranks) arrives first.
    let left = deadline.saturating_duration_since(Instant::now()) + Duration::from_secs(2);
    root.set_read_timeout(Some(left))
        .map_err(|e| BootstrapError::io(r, "setting a read timeout", e))?;
    let addrs = match read_frame(root, config.max_frame) {
        Ok(Some(Frame::Table { addrs })) => addrs,
        other => return Err(table_error(other, id, rank, config, root_name)),
    };
    root.set_read_timeout(None)
        .map_err(|e| BootstrapError::io(r, "clearing the read timeout", e))?;
    parse_table(&addrs, rank, nranks)
}

/// Why what the root sent instead of its address table ends the join.
fn table_error(
    got: Result<Option<Frame>, frame::ReadError>,
    id: &UniqueId,
    rank: usize,
    config: Config,
    root_name: &str,
) -> BootstrapError {
    match got {
        Ok(Some(Frame::Refuse { reason })) => BootstrapError::Refused {
            rank,
            root: id.addr.to_string(),
            reason,
        },
        Ok(Some(Frame::Abort { reason, missing })) => BootstrapError::Aborted {
            rank,
            reason,
            missing: missing.into_iter().map(|m| m as usize).collect(),
        },
        Ok(Some(other)) => BootstrapError::Aborted {
            rank,
            reason: format!("unexpected {other:?} from the root"),
            missing: vec![],
        },
        Ok(None) => BootstrapError::Aborted {
            rank,
            reason: "the root closed the connection before the rendezvous completed".into(),
            missing: vec![],
        },
        Err(frame::ReadError::Io(e))
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            BootstrapError::Timeout {
                rank,
                op: "bootstrap init".into(),
                what: format!("the address table from {root_name}"),
                waited: config.timeout,
                missing: vec![],
            }
        }
        Err(e) => BootstrapError::from_read(Some(rank), root_name, e),
    }
}

/// Parses the root's address table, which must name every one of `nranks`
/// ranks.
fn parse_table(
    addrs: &[String],
    rank: usize,
    nranks: usize,
) -> Result<Vec<SocketAddr>, BootstrapError> {
    if addrs.len() != nranks {
        return Err(BootstrapError::Aborted {
            rank,
            reason: format!(
                "the root's table has {} ranks, expected {nranks}",
                addrs.len()
            ),
            missing: vec![],
        });
    }
    addrs
        .iter()
        .enumerate()
        .map(|(i, a)| {
            a.parse().map_err(|_| BootstrapError::Aborted {
                rank,
                reason: format!("the root's table has a bad address {a:?} for rank {i}"),
                missing: vec![],
            })
        })
        .collect()
}

fn spawn_acceptor(
    listener: TcpListener,
    id: UniqueId,
    nranks: usize,
    config: Config,
    shared: Arc<Shared>,
    rank: usize,
) -> Result<(), BootstrapError> {
    thread::Builder::new()
        .name(format!("gin-bs-accept-{rank}"))
        .spawn(move || {
            // Strangers cost a socket for the authentication deadline, never
            // a thread: only admitted peers get a reader thread.
            let gate = Gate {
                id,
                expect: Purpose::Peer,
                nranks: Some(nranks as u32),
                auth_timeout: config.auth_timeout,
                who: format!("rank {rank}"),
            };
            gate.run(&listener, &|| shared.lock().closing, &mut |h, mut s| {
                let peer = h.rank as usize;
                shared.lock().connected[peer] = true;
                let shared = shared.clone();
                // The reader sends the welcome: a peer whose reader could not
                // start sees its handshake fail instead of sending into a
                // socket nobody drains.
                let spawned = thread::Builder::new()
                    .name(format!("gin-bs-read-{rank}"))
                    .spawn(move || match welcome(&mut s) {
                        Ok(()) => read_peer(&mut s, peer, &shared, config.max_frame),
                        Err(e) => warn!(rank, peer, %e, "could not welcome a peer"),
                    });
                if let Err(e) = spawned {
                    warn!(rank, peer, %e, "could not start a reader for a peer");
                }
            });
        })
        .map_err(|e| BootstrapError::io(Some(rank), "spawning the acceptor", e))?;
    Ok(())
}

/// Files a peer's messages into its mailbox until it says goodbye or
/// vanishes, then records that everything it sent has arrived.
fn read_peer(s: &mut TcpStream, peer: usize, shared: &Shared, max_frame: usize) {
    file_frames(s, peer, shared, max_frame);
    shared.lock().drained[peer] = true;
    shared.cv.notify_all();
}

fn file_frames(s: &mut TcpStream, peer: usize, shared: &Shared, max_frame: usize) {
    if let Ok(c) = s.try_clone() {
        shared.lock().incoming.push(c);
    }
    loop {
        match read_frame(s, max_frame) {
            Ok(Some(Frame::Data { tag, payload })) => {
                shared.lock().mail[peer].push_back((tag, payload));
                shared.cv.notify_all();
            }
            Ok(Some(Frame::PeerDied { rank: dead, reason }))
                if (dead as usize) < shared.nranks() =>
            {
                shared.mark_dead(dead as usize, format!("{reason}; reported by rank {peer}"));
            }
            Ok(Some(Frame::PeerStuck {
                rank: stuck,
                reason,
            })) if (stuck as usize) < shared.nranks() => {
                shared.mark_failed(
                    stuck as usize,
                    How::Stuck,
                    format!("{reason}; reported by rank {peer}"),
                );
            }
            Ok(Some(Frame::Goodbye)) => {
                shared.lock().closed[peer] = true;
                shared.cv.notify_all();
                return;
            }
            Ok(Some(other)) => {
                shared.mark_dead(peer, format!("it sent an unexpected {other:?} frame"));
                return;
            }
            Ok(None) => {
                shared.mark_dead(peer, "its connection closed without a goodbye".into());
                return;
            }
            Err(e) => {
                shared.mark_dead(peer, format!("its connection failed: {e}"));
                return;
            }
        }
    }
}

fn spawn_root_reader(mut root: TcpStream, shared: Arc<Shared>) -> Result<(), BootstrapError> {
    let rank = shared.rank;
    thread::Builder::new()
        .name(format!("gin-bs-root-{rank}"))
        .spawn(move || {
            let why = loop {
                match read_frame(&mut root, 1 << 20) {
                    Ok(Some(Frame::PeerDied { rank: dead, reason }))
                        if (dead as usize) < shared.nranks() =>
                    {
                        shared.mark_dead(dead as usize, reason);
                    }
                    Ok(Some(Frame::PeerStuck {
                        rank: stuck,
                        reason,
                    })) if (stuck as usize) < shared.nranks() => {
                        shared.mark_failed(stuck as usize, How::Stuck, reason);
                    }
                    Ok(Some(Frame::PeerLeft { rank: gone }))
                        if (gone as usize) < shared.nranks() =>
                    {
                        let mut st = shared.lock();
                        if !st.closing {
                            debug!(rank, peer = gone, "peer left the job");
                            st.left[gone as usize] = true;
                            st.first_left.get_or_insert(gone as usize);
                        }
                        drop(st);
                        shared.cv.notify_all();
                    }
                    Ok(Some(Frame::Abort { reason, .. })) => break reason,
                    Ok(Some(_)) => {}
                    Ok(None) => break "the root connection closed".to_owned(),
                    Err(e) => break format!("the root connection failed: {e}"),
                }
            };
            let mut st = shared.lock();
            if !st.closing && st.root_lost.is_none() {
                warn!(rank, %why, "lost the bootstrap root");
                st.root_lost = Some(why);
            }
            drop(st);
            shared.cv.notify_all();
        })
        .map_err(|e| BootstrapError::io(Some(rank), "spawning the root reader", e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

    use super::*;

    fn shared(nranks: usize) -> Arc<Shared> {
        Arc::new(Shared {
            rank: 1,
            state: Mutex::new(State::new(nranks)),
            cv: Condvar::new(),
        })
    }

    fn symptom() -> BootstrapError {
        BootstrapError::io(
            Some(1),
            "reading from rank 5",
            std::io::ErrorKind::ConnectionReset.into(),
        )
    }

    #[test]
    fn a_failed_connection_reports_the_death_heard_of_soon_after() {
        // The CI failure this guards against: rank 5 heard that rank 2 died,
        // left, and reset rank 1's connection before rank 1 heard the news.
        let sh = shared(6);
        let news = {
            let sh = sh.clone();
            thread::spawn(move || {
                thread::sleep(Duration::from_millis(50)); // the news travels
                sh.mark_dead(2, "its connection closed without a goodbye".into());
            })
        };
        let err = sh.cause_of("allgather", symptom(), Duration::from_secs(30), Some(5));
        news.join().unwrap();
        match err {
            BootstrapError::PeerDied { peer, op, .. } => {
                assert_eq!((peer, op.as_str()), (2, "allgather"));
            }
            other => panic!("expected the death of rank 2, got {other}"),
        }
    }

    #[test]
    fn a_failed_connection_with_no_news_is_reported_as_itself() {
        let sh = shared(6);
        let err = sh.cause_of("allgather", symptom(), Duration::from_millis(20), Some(5));
        assert!(err.to_string().contains("reading from rank 5"), "got {err}");
    }

    #[test]
    fn a_peer_that_said_goodbye_is_not_waited_for() {
        let sh = shared(6);
        sh.lock().closed[5] = true;
        let t = Instant::now();
        let err = sh.cause_of("allgather", symptom(), Duration::from_secs(30), Some(5));
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "waited {:?}",
            t.elapsed()
        );
        assert!(err.to_string().contains("reading from rank 5"), "got {err}");
    }

    #[test]
    fn a_lost_root_is_a_cause_too() {
        let sh = shared(3);
        sh.lock().root_lost = Some("the root connection closed".into());
        let err = sh.cause_of("barrier", symptom(), Duration::from_secs(30), None);
        assert!(matches!(err, BootstrapError::RootLost { .. }), "got {err}");
    }
}
