//! The rendezvous root: admits ranks, hands out the address table, then stays
//! on as the job's death watch.
//!
//! Every rank keeps its root connection open for the life of its bootstrap.
//! A rank that closes it after a `Goodbye` has left in order; one that drops
//! it without one has died, and the root tells every other rank so, which
//! makes their pending and later calls fail at once instead of timing out.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::thread;
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use crate::env::Config;
use crate::error::BootstrapError;
use crate::frame::{Frame, Purpose, read_frame};
use crate::gate::Gate;
use crate::id::UniqueId;
use crate::net::{welcome, write_frame};

/// A running rendezvous root. Dropping it does not stop it: the root thread
/// lives until every rank has left (or the rendezvous failed); use
/// [`BootstrapRoot::wait`] to wait for that.
#[derive(Debug)]
pub struct BootstrapRoot {
    id: UniqueId,
    done: std::sync::Mutex<mpsc::Receiver<()>>,
}

enum Event {
    Joined {
        rank: usize,
        nranks: usize,
        listen_addr: String,
        stream: TcpStream,
    },
    Left {
        rank: usize,
        orderly: bool,
        why: String,
        generation: u64,
    },
    /// A member could not send to `rank` for the whole timeout.
    Stuck { by: usize, rank: usize, why: String },
}

/// How long the root's writes to a member may block: its frames are small,
/// so only a member that stopped reading altogether fills the socket, and it
/// must not hold up the news to the others.
const MEMBER_WRITE_LIMIT: Duration = Duration::from_secs(1);

impl BootstrapRoot {
    /// Starts a root listening on `bind` (port 0 picks a free port) with a
    /// fresh secret. `nranks`, when known, lets the root refuse ranks of the
    /// wrong job size outright.
    pub fn start(
        bind: SocketAddr,
        nranks: Option<usize>,
        config: Config,
    ) -> Result<Self, BootstrapError> {
        Self::start_with_id(UniqueId::new(bind)?, nranks, config)
    }

    /// Starts a root for a given id (its address is bound as is; port 0 picks
    /// one and the returned [`BootstrapRoot::id`] carries the real port).
    pub fn start_with_id(
        id: UniqueId,
        nranks: Option<usize>,
        config: Config,
    ) -> Result<Self, BootstrapError> {
        let listener = TcpListener::bind(id.addr).map_err(|e| {
            BootstrapError::io(
                None,
                format!("binding the bootstrap root to {}", id.addr),
                e,
            )
        })?;
        let addr = listener
            .local_addr()
            .map_err(|e| BootstrapError::io(None, "reading the root's address", e))?;
        let id = UniqueId { addr, ..id };
        let (tx, rx) = mpsc::channel();
        let (done_tx, done) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        {
            let stop = stop.clone();
            let tx = tx.clone();
            thread::Builder::new()
                .name("gin-root-accept".into())
                .spawn(move || accept_loop(&listener, id, nranks, config, &tx, &stop))
                .map_err(|e| BootstrapError::io(None, "spawning the root acceptor", e))?;
        }
        thread::Builder::new()
            .name("gin-root".into())
            .spawn(move || {
                run(&rx, &tx, nranks, config);
                stop.store(true, Ordering::SeqCst);
                // Wake the acceptor so it sees the stop flag.
                let _ = TcpStream::connect(addr);
                let _ = done_tx.send(());
            })
            .map_err(|e| BootstrapError::io(None, "spawning the root", e))?;
        info!(%addr, "bootstrap root listening");
        Ok(Self {
            id,
            done: std::sync::Mutex::new(done),
        })
    }

    /// The id ranks use to join (pass it as `GIN_UNIQUE_ID`).
    pub fn id(&self) -> UniqueId {
        self.id
    }

    /// Waits until every rank has left or the rendezvous failed; false if
    /// `limit` passed first.
    pub fn wait(&self, limit: Duration) -> bool {
        let done = self
            .done
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        !matches!(done.recv_timeout(limit), Err(RecvTimeoutError::Timeout))
    }
}

fn accept_loop(
    listener: &TcpListener,
    id: UniqueId,
    nranks: Option<usize>,
    config: Config,
    tx: &Sender<Event>,
    stop: &AtomicBool,
) {
    // One thread for every handshake: a silent stranger costs a socket for
    // the authentication deadline, never a thread (see `gate`).
    let gate = Gate {
        id,
        expect: Purpose::Root,
        nranks: nranks.map(|n| n as u32),
        auth_timeout: config.auth_timeout,
        who: "the bootstrap root".into(),
    };
    gate.run(
        listener,
        &|| stop.load(Ordering::SeqCst),
        &mut |h, mut stream| {
            if let Err(e) = welcome(&mut stream) {
                warn!(rank = h.rank, %e, "could not welcome a rank");
                return;
            }
            let _ = tx.send(Event::Joined {
                rank: h.rank as usize,
                nranks: h.nranks as usize,
                listen_addr: h.listen_addr,
                stream,
            });
        },
    );
}

struct Member {
    stream: TcpStream,
    listen_addr: String,
    generation: u64,
}

/// The root's state machine: rendezvous, then watch.
fn run(rx: &mpsc::Receiver<Event>, tx: &Sender<Event>, fixed_n: Option<usize>, config: Config) {
    let start = Instant::now();
    let Some(mut members) = rendezvous(rx, tx, fixed_n, config, start + config.timeout) else {
        return;
    };
    send_table(&mut members, start);
    watch_members(rx, members);
}

/// Writes `frame` to every member still present (a member that cannot take
/// it is left to its own watcher to report).
fn tell_all(members: &mut [Option<Member>], frame: &Frame) {
    for m in members.iter_mut().flatten() {
        let _ = write_frame(&mut m.stream, frame);
    }
}

/// The rendezvous phase: who has joined so far.
struct Rendezvous<'a> {
    tx: &'a Sender<Event>,
    /// The job size, fixed up front or by the first rank to join.
    n: Option<usize>,
    members: Vec<Option<Member>>,
    generation: u64,
}

/// Waits for every rank until `deadline`; returns the members once all have
/// joined, or None when the rendezvous failed (the members were told why) or
/// the event channel closed.
fn rendezvous(
    rx: &mpsc::Receiver<Event>,
    tx: &Sender<Event>,
    fixed_n: Option<usize>,
    config: Config,
    deadline: Instant,
) -> Option<Vec<Option<Member>>> {
    let mut rv = Rendezvous {
        tx,
        n: fixed_n,
        members: Vec::new(),
        generation: 0,
    };
    loop {
        if rv.complete() {
            return Some(rv.members);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(Event::Joined {
                rank,
                nranks,
                listen_addr,
                stream,
            }) => rv.join(rank, nranks, listen_addr, stream),
            Ok(Event::Left {
                rank,
                generation: g,
                ..
            }) => rv.leave(rank, g),
            Err(RecvTimeoutError::Timeout) => {
                rv.abort(config);
                return None;
            }
            Ok(Event::Stuck { .. }) => {}
            Err(RecvTimeoutError::Disconnected) => return None,
        }
    }
}

impl Rendezvous<'_> {
    /// Every rank of a known job size has joined.
    fn complete(&self) -> bool {
        self.n
            .is_some_and(|n| self.members.len() == n && self.members.iter().all(Option::is_some))
    }

    /// Admits `rank`, or refuses it (wrong job size, duplicate, unusable
    /// address).
    fn join(&mut self, rank: usize, nranks: usize, listen_addr: String, mut stream: TcpStream) {
        let job_n = *self.n.get_or_insert(nranks);
        if self.members.len() < job_n {
            self.members.resize_with(job_n, || None);
        }
        let refusal = if nranks != job_n {
            Some(format!(
                "rank {rank} says the job has {nranks} ranks, but it has {job_n}"
            ))
        } else if let Some(m) = &self.members[rank] {
            Some(format!(
                "rank {rank} has already joined (listening at {}); duplicate rank",
                m.listen_addr
            ))
        } else if listen_addr.parse::<SocketAddr>().is_err() {
            Some(format!(
                "rank {rank} gave an unusable address {listen_addr:?}"
            ))
        } else {
            None
        };
        if let Some(reason) = refusal {
            warn!(rank, %reason, "bootstrap root refused a rank");
            let _ = write_frame(&mut stream, &Frame::Refuse { reason });
            return;
        }
        debug!(rank, %listen_addr, "rank joined");
        let _ = stream.set_write_timeout(Some(MEMBER_WRITE_LIMIT));
        self.generation += 1;
        watch(&stream, rank, self.generation, self.tx.clone());
        self.members[rank] = Some(Member {
            stream,
            listen_addr,
            generation: self.generation,
        });
    }

    /// A rank that leaves before the table is out may rejoin: forget it
    /// (unless a newer connection of the same rank has replaced it).
    fn leave(&mut self, rank: usize, generation: u64) {
        if self
            .members
            .get(rank)
            .and_then(Option::as_ref)
            .is_some_and(|m| m.generation == generation)
        {
            warn!(rank, "rank left before the rendezvous completed");
            self.members[rank] = None;
        }
    }

    /// The deadline passed: tells every member which ranks are missing.
    fn abort(&mut self, config: Config) {
        let n = self.n;
        let missing: Vec<u32> = (0..n.unwrap_or(0))
            .filter(|&r| self.members.get(r).is_none_or(Option::is_none))
            .map(|r| r as u32)
            .collect();
        let reason = if n.is_some() {
            format!("rendezvous timed out after {:.1?}", config.timeout)
        } else {
            format!(
                "rendezvous timed out after {:.1?}: no rank arrived",
                config.timeout
            )
        };
        warn!(?missing, %reason, "bootstrap rendezvous failed");
        tell_all(&mut self.members, &Frame::Abort { reason, missing });
    }
}

/// Sends every member the address table: the rendezvous is complete.
fn send_table(members: &mut [Option<Member>], start: Instant) {
    let addrs: Vec<String> = members
        .iter()
        .map(|m| {
            m.as_ref()
                .map(|m| m.listen_addr.clone())
                .unwrap_or_default()
        })
        .collect();
    let nranks = addrs.len();
    tell_all(members, &Frame::Table { addrs });
    info!(nranks, elapsed = ?start.elapsed(), "bootstrap rendezvous complete");
}

/// The watch phase: relays deaths, departures and stuck ranks to the others
/// until everyone has left.
fn watch_members(rx: &mpsc::Receiver<Event>, mut members: Vec<Option<Member>>) {
    let mut live = members.len();
    let mut stuck = vec![false; members.len()];
    while live > 0 {
        match rx.recv() {
            Ok(Event::Stuck { by, rank, why }) => {
                if stuck.get(rank).is_none_or(|s| *s) {
                    continue;
                }
                stuck[rank] = true;
                warn!(rank, by, %why, "rank stopped responding; telling the others");
                let frame = Frame::PeerStuck {
                    rank: rank as u32,
                    reason: why,
                };
                tell_all(&mut members, &frame);
            }
            Ok(Event::Left {
                rank,
                orderly,
                why,
                generation,
            }) => {
                if relay_leaving(&mut members, rank, orderly, why, generation) {
                    live -= 1;
                }
            }
            Ok(Event::Joined {
                rank, mut stream, ..
            }) => {
                let reason = format!("the job has already formed; rank {rank} cannot join now");
                warn!(rank, "late join refused");
                let _ = write_frame(&mut stream, &Frame::Refuse { reason });
            }
            Err(_) => return,
        }
    }
}

/// A member's root connection ended: forgets it and tells the others whether
/// it left in order or died. False when the event is about a connection no
/// longer current (an unknown rank or an older generation).
fn relay_leaving(
    members: &mut [Option<Member>],
    rank: usize,
    orderly: bool,
    why: String,
    generation: u64,
) -> bool {
    let Some(m) = members.get_mut(rank) else {
        return false;
    };
    if m.as_ref().is_none_or(|m| m.generation != generation) {
        return false;
    }
    *m = None;
    if orderly {
        // Peers on the same host have no connection of their own
        // to notice this by: tell them.
        debug!(rank, "rank left; telling the others");
        tell_all(members, &Frame::PeerLeft { rank: rank as u32 });
        return true;
    }
    warn!(rank, %why, "rank died; telling the others");
    let frame = Frame::PeerDied {
        rank: rank as u32,
        reason: why,
    };
    tell_all(members, &frame);
    true
}

/// Reads a member's root connection until it ends, then reports how.
fn watch(stream: &TcpStream, rank: usize, generation: u64, tx: Sender<Event>) {
    let Ok(mut s) = stream.try_clone() else {
        let _ = tx.send(Event::Left {
            rank,
            orderly: false,
            why: "could not watch its root connection".into(),
            generation,
        });
        return;
    };
    let _ = thread::Builder::new()
        .name("gin-root-watch".into())
        .spawn(move || {
            let (orderly, why) = loop {
                match read_frame(&mut s, 1 << 16) {
                    Ok(Some(Frame::Goodbye)) => break (true, String::new()),
                    Ok(Some(Frame::PeerStuck {
                        rank: stuck,
                        reason,
                    })) => {
                        let _ = tx.send(Event::Stuck {
                            by: rank,
                            rank: stuck as usize,
                            why: reason,
                        });
                    }
                    Ok(Some(_)) => {}
                    Ok(None) => {
                        break (false, "its root connection closed without a goodbye".into());
                    }
                    Err(e) => break (false, format!("its root connection failed: {e}")),
                }
            };
            let _ = tx.send(Event::Left {
                rank,
                orderly,
                why,
                generation,
            });
        });
}
