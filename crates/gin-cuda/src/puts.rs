//! Puts from GPU memory to peers over a transport that takes GPU memory
//! (ucx with its CUDA transports): the queue the CUDA executors of the
//! proxy and of the soft NIC keep per peer, and the merging of puts that
//! continue one another before they reach the transport.
//!
//! **The queue** ([`DevicePuts`]). A put is started with
//! [`Transport::start_put_device`] (numbered per peer by the transport) and
//! its engine polls it without waiting ([`DevicePuts::landed`]): it is
//! released once [`Transport::device_puts_completed`] covers its number.
//! An 8-byte value that must follow the puts to the peer (a signal's
//! running total, the soft NIC's inline write) goes at once, ordered after
//! them ([`DevicePuts::send_ordered`], [`Fabric::put_key_ordered`]), where
//! the transport orders it without waiting (`GIN_UCX_GPU_ORDER=fence`);
//! where it would wait ([`Transport::ordered_waits_for_device_puts`], ucx's
//! default) and puts to the peer are not yet released, it is held in the
//! peer's queue, which keeps every entry in issue order, and sent
//! ([`Transport::put_ordered_after`]) once the puts before it completed; an
//! entry is released only once what it held was sent. A failure (of the
//! puts, where the transport names the failed put with
//! [`Transport::device_put_failed`] the entries before it are released
//! first; of a held value's sending; of a put's start) is the peer's from
//! that entry on: every entry not yet released fails with it, sticky. A
//! put refused at start is the peer's at once: nothing handed over after
//! it is started to that peer, in that pass or any later one, even while
//! puts before it are still in flight, and no value is sent after it.
//!
//! **Merging.** UCX spends about 6 µs on a put from GPU memory over
//! cuda_ipc whatever its size, so a message that many blocks put in
//! slices costs one such operation per slice. A put handed over here is
//! not started at once but waits until its engine's pass over the queue it
//! came from ends ([`DevicePuts::issue`]: the executors call it when the
//! engine hands the pass's work over, and before anything that must come
//! after the puts: a get, a value sent ordered, a poll); then the waiting
//! puts whose destinations (same key) and sources (same window) continue
//! one another, whatever order they came in, are started as one
//! transport put of at most `merge_max` bytes ([`MERGE_MAX`] unless
//! [`MERGE_VAR`] says otherwise; `0`: no merging, every put started as it
//! comes). Only what is already queued is merged: a lone put waits for
//! nothing but the end of its pass. A put whose destination overlaps a
//! waiting one, or one to another peer or from another queue, starts the
//! waiting ones first, so overlapping puts reach the transport in their
//! order. Every original put keeps its entry: a merged put's completion
//! releases each of them (a held value behind one of them is sent only
//! once the merged put, and every put before it, completed), and its
//! failure fails each, the error naming the original's bytes and offset
//! and the merged put that carried them ([`Note`]). The note also says
//! when an original's own put is not what failed (the transport named
//! another put, a value held behind the puts could not be sent, a put
//! before it was refused at start) and when it was never started.

use std::collections::VecDeque;
use std::sync::Arc;

use gin_net::{Fabric, KeepAlive, NetError, Transport};

/// The largest put merged from puts that continue one another, by
/// default: a put of 4 MiB takes UCX about 6 µs of overhead plus the copy,
/// so merging beyond it gains little and delays the first completion (and
/// the signal held behind it) by more.
pub const MERGE_MAX: u64 = 4 << 20;

/// The environment variable that sets the largest merged put in bytes
/// (`0` turns merging off; `k`, `m` suffixes for KiB and MiB).
pub const MERGE_VAR: &str = "GIN_PUT_MERGE_MAX";

/// The largest merged put that `v`, the value of [`MERGE_VAR`], asks for:
/// [`MERGE_MAX`] when unset.
///
/// # Errors
/// A value that is not a byte count (digits, optionally followed by `k` or
/// `m`), naming the variable and the value.
pub fn merge_max_from(v: Option<&str>) -> Result<u64, String> {
    let Some(v) = v.map(str::trim) else {
        return Ok(MERGE_MAX);
    };
    let (digits, unit) = match v.as_bytes().last() {
        Some(b'k' | b'K') => (&v[..v.len() - 1], 1 << 10),
        Some(b'm' | b'M') => (&v[..v.len() - 1], 1 << 20),
        _ => (v, 1),
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(unit))
        .ok_or_else(|| {
            format!("{MERGE_VAR}={v:?} is not a byte count (e.g. 4m, 262144, or 0 for no merging)")
        })
}

/// What an executor's error must offer the queue: a transport's failure
/// about a peer, and a note on the put that failed with it.
pub trait PutError: Clone {
    /// `e`, which the transport reported about `peer`.
    fn net(peer: usize, e: NetError) -> Self;
    /// This error, told how the put it fails went ([`Note`]: a merged
    /// put that carried it, a put that was not its own, or none started).
    #[must_use]
    fn noted(self, note: &Note) -> Self;
}

/// An 8-byte value held until the puts before it completed: its key and
/// offset at the peer, and its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    /// The key the peer serves the region under.
    pub key: u32,
    /// Offset in the region.
    pub offset: u64,
    /// The value, as it lands.
    pub bytes: [u8; 8],
}

/// A put from GPU memory: `len` bytes at device address `src`, in this
/// rank's part of window `window`, to `offset` of the region `key` names
/// at the peer.
#[derive(Debug, Clone)]
pub struct DevicePut {
    /// The key the peer serves the destination under.
    pub key: u32,
    /// Offset in the destination region.
    pub offset: u64,
    /// The source's window (puts merge only within one window).
    pub window: u32,
    /// The source's device address.
    pub src: u64,
    /// Bytes.
    pub len: u64,
    /// What keeps the source alive while the transport reads it.
    pub keep: Option<KeepAlive>,
}

/// An entry of a peer's queue: the peer and the entry's number there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ticket {
    /// The peer.
    pub peer: usize,
    /// The entry's number among those made for the peer.
    pub n: u64,
}

/// How a put's failure reached it, as its [`Note`] tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    /// Its own put failed, or the transport did not say which put did.
    Failed,
    /// Its own put was refused at start.
    Refused,
    /// It was never started: a put to the peer before it had been refused
    /// at start, or had failed.
    NotStarted,
    /// Its own put is not what failed: the transport named another put, a
    /// value held behind the puts could not be sent, or a put before it
    /// was refused at start, before this one was released.
    Behind,
}

/// The merged put that carried an original.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Carrier {
    /// How many puts it carried.
    pub puts: usize,
    /// Its bytes.
    pub total: u64,
    /// Its destination offset.
    pub at: u64,
}

/// How an original put went, for its errors: where it went and why the
/// failure is its own, or not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Note {
    /// The original's bytes.
    pub bytes: u64,
    /// Its destination offset.
    pub offset: u64,
    /// The destination key.
    pub key: u32,
    /// The transport's number of the put that carried it (0: none was
    /// started).
    pub seq: u64,
    /// The merged put that carried it, if it was merged.
    pub merged: Option<Carrier>,
    /// How the failure reached it.
    pub fate: Fate,
}

impl std::fmt::Display for Note {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "this put's {} bytes at offset {} of key {:#010x} ",
            self.bytes, self.offset, self.key
        )?;
        let merged = |f: &mut std::fmt::Formatter<'_>| match self.merged {
            Some(m) => write!(
                f,
                ", {} bytes at offset {} merged from {} puts",
                m.total, m.at, m.puts
            ),
            None => Ok(()),
        };
        match self.fate {
            Fate::Failed => {
                write!(f, "went in the transport's put #{}", self.seq)?;
                merged(f)
            }
            Fate::Refused => {
                write!(f, "went in a put refused at start, never started")?;
                merged(f)
            }
            Fate::NotStarted => {
                write!(
                    f,
                    "was never started: a put to the peer before it had been refused at start, or had failed"
                )?;
                if self.merged.is_some() {
                    write!(f, " (it would have gone in a put")?;
                    merged(f)?;
                    write!(f, ")")?;
                }
                Ok(())
            }
            Fate::Behind => {
                write!(f, "went in the transport's put #{}", self.seq)?;
                merged(f)?;
                write!(
                    f,
                    ", which is not what failed: another put to the peer, or a value held behind the puts, failed before this one was released"
                )
            }
        }
    }
}

/// Counts for the executors' debug logs.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PutStats {
    /// Puts handed over (those never started included).
    pub puts: u64,
    /// Puts the transport was asked to start and started (after merging).
    pub started: u64,
    /// Puts handed over that never reached the transport: refused at
    /// start, never started behind a refused or failed one, or dropped
    /// waiting when the executor stopped mid-pass.
    pub unstarted: u64,
}

/// Why a peer's queue failed: whose the failure is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cause {
    /// The transport's puts failed, naming none.
    Unnamed,
    /// The transport named its put with this number.
    Named(u64),
    /// A value held behind the puts could not be sent.
    Held,
    /// A put was refused at start.
    Refused,
}

/// How far an entry's puts must be complete before it is released.
#[derive(Debug, Clone)]
enum After<E> {
    /// The transport's puts numbered up to this.
    Seq(u64),
    /// The first this many puts of the waiting set, not started yet.
    Waiting(usize),
    /// A put it follows failed to start (or was never started after one
    /// that failed): the entry fails with this.
    Failed(E),
}

#[derive(Debug)]
struct Entry<E> {
    after: After<E>,
    held: Option<Held>,
    /// The put it is, if any (a value alone is none).
    put: Option<Note>,
}

impl<E> Entry<E> {
    /// The note on this entry's failure, under a queue that failed for
    /// `cause`: none for a put that failed, or was refused, as itself
    /// (its error names it) unless it was merged.
    fn note(&self, cause: Option<Cause>) -> Option<Note> {
        let mut n = self.put.clone()?;
        if let After::Seq(_) = self.after {
            n.fate = match cause {
                Some(Cause::Named(f)) if f != n.seq => Fate::Behind,
                Some(Cause::Held | Cause::Refused) => Fate::Behind,
                _ => Fate::Failed,
            };
        }
        let plain = matches!(n.fate, Fate::Failed | Fate::Refused);
        (n.merged.is_some() || !plain).then_some(n)
    }
}

/// The puts from GPU memory to one peer not yet seen complete, and the
/// values held behind them, in issue order.
#[derive(Debug)]
struct PeerPuts<E> {
    peer: usize,
    queue: VecDeque<Entry<E>>,
    /// Entries made, and released (the entry numbered `released` is the
    /// queue's front).
    made: u64,
    released: u64,
    /// The transport's number of the newest put started.
    last: u64,
    /// Puts were started since the last [`Transport::complete_device`].
    unsettled: bool,
    /// Why the queue's front (and so every entry after it) failed: the
    /// peer's puts, or the sending of the value held there; nothing is
    /// released any more.
    failed: Option<E>,
    /// Whose the failure is.
    cause: Option<Cause>,
    /// Why a put to the peer was refused at start: set as it is refused
    /// (the entries before it may still be in flight), so that nothing
    /// after it is started or sent.
    refused: Option<E>,
}

impl<E: Clone> PeerPuts<E> {
    fn entry(&mut self, n: u64) -> Option<&mut Entry<E>> {
        let i = n.checked_sub(self.released)?;
        self.queue.get_mut(usize::try_from(i).ok()?)
    }

    /// Why nothing more may start or be sent to the peer, if so: a put
    /// refused at start, or the peer's failure.
    fn broken(&self) -> Option<E> {
        self.refused.clone().or_else(|| self.failed.clone())
    }
}

/// Puts handed over in the current pass, not started yet: one peer's, from
/// one of the executor's queues (`lane`), with each one's entry number.
#[derive(Debug)]
struct Waiting {
    peer: usize,
    lane: usize,
    puts: Vec<(DevicePut, u64)>,
}

/// The puts from GPU memory of one executor, per peer (see the module
/// documentation).
#[derive(Debug)]
pub struct DevicePuts<E> {
    fabric: Arc<Fabric>,
    merge_max: u64,
    /// A few peers: a scan.
    peers: Vec<PeerPuts<E>>,
    waiting: Option<Waiting>,
    stats: PutStats,
}

impl<E: PutError> DevicePuts<E> {
    /// The puts of an executor over `fabric`, merged up to `merge_max`
    /// bytes (0: never merged, each started as it is handed over).
    pub fn new(fabric: Arc<Fabric>, merge_max: u64) -> Self {
        Self {
            fabric,
            merge_max,
            peers: Vec::new(),
            waiting: None,
            stats: PutStats::default(),
        }
    }

    /// What was handed over and started so far.
    pub fn stats(&self) -> PutStats {
        self.stats
    }

    /// The transport that reaches `peer`.
    ///
    /// # Errors
    /// `peer` has no path.
    pub fn transport(&self, peer: usize) -> Result<Arc<dyn Transport>, E> {
        self.fabric
            .path(peer)
            .map(|p| p.transport().clone())
            .ok_or_else(|| {
                E::net(
                    peer,
                    NetError::NoPath {
                        peer,
                        nranks: self.fabric.nranks(),
                    },
                )
            })
    }

    /// `peer`'s queue, made on first use.
    fn peer(&mut self, peer: usize) -> &mut PeerPuts<E> {
        let i = self
            .peers
            .iter()
            .position(|p| p.peer == peer)
            .unwrap_or_else(|| {
                self.peers.push(PeerPuts {
                    peer,
                    queue: VecDeque::new(),
                    made: 0,
                    released: 0,
                    last: 0,
                    unsettled: false,
                    failed: None,
                    cause: None,
                    refused: None,
                });
                self.peers.len() - 1
            });
        &mut self.peers[i]
    }

    /// Whether `peer` has puts, or values held, not yet released (waiting
    /// ones included).
    pub fn pending(&self, peer: usize) -> bool {
        self.peers
            .iter()
            .any(|p| p.peer == peer && !p.queue.is_empty())
    }

    /// Adds an entry to `peer`'s queue.
    fn enqueue(
        &mut self,
        peer: usize,
        after: After<E>,
        held: Option<Held>,
        put: Option<Note>,
    ) -> Ticket {
        let p = self.peer(peer);
        p.queue.push_back(Entry { after, held, put });
        p.made += 1;
        Ticket {
            peer,
            n: p.made - 1,
        }
    }

    /// Hands over a put from GPU memory to `peer`, coming from the
    /// executor's queue `lane` (a ring, a channel): started at once where
    /// merging is off, else waiting until [`DevicePuts::issue`] (the
    /// puts waiting for another peer or lane, or one whose destination
    /// this one overlaps, are started first). Its entry's ticket, for
    /// [`DevicePuts::landed`].
    ///
    /// # Errors
    /// Merging off: the transport's refusal to start it (counted
    /// [`PutStats::unstarted`]). Merging on, a put that cannot start fails
    /// its entry instead ([`DevicePuts::landed`] reports it), and so does
    /// every put to the peer after it.
    ///
    /// # Safety
    /// As [`Transport::start_put_device`] for `p.src` and `p.len` (with
    /// `p.keep`), from now until the entry is released, or until
    /// [`DevicePuts::settle`] or [`DevicePuts::settle_all`] for the peer
    /// returned; the caller has made sure that nothing it queued before
    /// writes the source.
    pub unsafe fn put(&mut self, lane: usize, peer: usize, p: DevicePut) -> Result<Ticket, E> {
        self.stats.puts += 1;
        let note = Note {
            bytes: p.len,
            offset: p.offset,
            key: p.key,
            seq: 0,
            merged: None,
            fate: Fate::Failed,
        };
        if self.merge_max == 0 {
            let to = gin_net::Target::Key {
                key: p.key,
                offset: p.offset,
            };
            let seq = self.transport(peer).and_then(|t| {
                // SAFETY: the caller's contract.
                unsafe { t.start_put_device(peer, to, p.src, p.len, p.keep) }
                    .map_err(|e| E::net(peer, e))
            });
            let seq = seq.inspect_err(|_| self.stats.unstarted += 1)?;
            self.stats.started += 1;
            self.started(peer, seq);
            let note = Note { seq, ..note };
            return Ok(self.enqueue(peer, After::Seq(seq), None, Some(note)));
        }
        let clash = self.waiting.as_ref().is_some_and(|w| {
            w.peer != peer
                || w.lane != lane
                || w.puts.iter().any(|(q, _)| {
                    q.key == p.key
                        && q.offset < p.offset.saturating_add(p.len)
                        && p.offset < q.offset.saturating_add(q.len)
                })
        });
        if clash {
            self.issue();
        }
        let w = self.waiting.get_or_insert_with(|| Waiting {
            peer,
            lane,
            puts: Vec::new(),
        });
        let k = w.puts.len() + 1;
        let t = self.enqueue(peer, After::Waiting(k), None, Some(note));
        if let Some(w) = &mut self.waiting {
            w.puts.push((p, t.n));
        }
        Ok(t)
    }

    /// Notes that the transport started `peer`'s put number `seq`.
    fn started(&mut self, peer: usize, seq: u64) {
        let p = self.peer(peer);
        p.unsettled = true;
        p.last = p.last.max(seq);
    }

    /// The number of puts to `peer` waiting, if they are `peer`'s.
    fn waiting_for(&self, peer: usize) -> Option<usize> {
        self.waiting
            .as_ref()
            .filter(|w| w.peer == peer)
            .map(|w| w.puts.len())
    }

    /// Sends `h` to `peer` ordered after every put to it so far: the
    /// waiting ones are started first, then the value goes at once
    /// ([`Fabric::put_key_ordered`]); but where the transport would wait
    /// for the puts and some are not released, it is held instead, in the
    /// entry `with` (the put it is the signal of) or a new one behind
    /// everything so far. Returns the entry it is in, if any: held there,
    /// or never sent because a put it follows failed to start (that entry
    /// then fails; `with`'s own, or a new one).
    ///
    /// # Errors
    /// The path's, or the transport's refusal of the value.
    pub fn send_ordered(
        &mut self,
        peer: usize,
        h: Held,
        with: Option<Ticket>,
    ) -> Result<Option<Ticket>, E> {
        let t = self.transport(peer)?;
        if t.ordered_waits_for_device_puts() && (with.is_some() || self.pending(peer)) {
            if let Some(w) = with
                && let Some(e) = self.peer(peer).entry(w.n)
            {
                e.held = Some(h);
                return Ok(with);
            }
            let after = match self.waiting_for(peer) {
                Some(k) => After::Waiting(k),
                None => After::Seq(self.peer(peer).last),
            };
            return Ok(Some(self.enqueue(peer, after, Some(h), None)));
        }
        if self.waiting_for(peer).is_some() {
            self.issue();
        }
        if let Some(e) = self.peer(peer).broken() {
            return Ok(Some(with.unwrap_or_else(|| {
                self.enqueue(peer, After::Failed(e), None, None)
            })));
        }
        self.fabric
            .put_key_ordered(peer, h.key, h.offset, &h.bytes)
            .map_err(|e| E::net(peer, e))?;
        Ok(with)
    }

    /// Where nothing more may go to `peer` (a put to it was refused at
    /// start, or its puts failed): after starting what waits for it, an
    /// entry failed with that, for what the caller was about to send
    /// otherwise (an inline value), to report in its place. `None`: send.
    pub fn barred(&mut self, peer: usize) -> Option<Ticket> {
        if self.waiting_for(peer).is_some() {
            self.issue();
        }
        let e = self.peers.iter().find(|p| p.peer == peer)?.broken()?;
        Some(self.enqueue(peer, After::Failed(e), None, None))
    }

    /// Starts the waiting puts, those that continue one another merged
    /// (see the module documentation); a put that cannot start fails its
    /// entry, and so do the entries after it: the puts after it are not
    /// started, in this pass or any later one (the refusal is the peer's
    /// at once, sticky), and neither is anything after a failure of the
    /// peer's puts.
    pub fn issue(&mut self) {
        let Some(w) = self.waiting.take() else {
            return;
        };
        let peer = w.peer;
        let spans: Vec<Span> = w.puts.iter().map(|(p, _)| Span::of(p)).collect();
        let chains = plan(&spans, self.merge_max);
        let seq_of = self.start_chains(&w, &chains);
        // What the first k waiting puts need: prefix[k - 1].
        let mut prefix: Vec<Result<u64, E>> = Vec::with_capacity(spans.len());
        let mut acc: Result<u64, E> = Ok(0);
        for s in &seq_of {
            acc = match (acc, s) {
                (Err(e), _) => Err(e),
                (Ok(_), Err((e, _))) => Err(e.clone()),
                (Ok(a), Ok(b)) => Ok(a.max(*b)),
            };
            prefix.push(acc.clone());
        }
        let p = self.peer(peer);
        for c in &chains {
            let merged = (c.members.len() > 1).then_some(Carrier {
                puts: c.members.len(),
                total: c.len,
                at: c.offset,
            });
            for &m in &c.members {
                let (_, n) = &w.puts[m];
                let Some(note) = p.entry(*n).and_then(|e| e.put.as_mut()) else {
                    continue;
                };
                note.merged = merged;
                (note.seq, note.fate) = match (&seq_of[m], &prefix[m]) {
                    (Ok(s), Ok(_)) => (*s, Fate::Failed),
                    (Ok(s), Err(_)) => (*s, Fate::Behind),
                    (Err((_, fate)), _) => (0, *fate),
                };
            }
        }
        for e in &mut p.queue {
            if let After::Waiting(k) = e.after {
                e.after = match prefix.get(k.saturating_sub(1)) {
                    Some(Ok(s)) => After::Seq(*s),
                    Some(Err(f)) => After::Failed(f.clone()),
                    None => After::Seq(p.last),
                };
            }
        }
    }

    /// [`DevicePuts::issue`]'s starts: per waiting put of `w`, the
    /// transport's number of the put that carries it (`chains`, started
    /// in order), or why it did not start and whether it was refused
    /// itself ([`Fate::Refused`]) or never tried ([`Fate::NotStarted`]:
    /// the peer refused a put before it, in this pass or an earlier one,
    /// or failed). The first refusal is recorded as the peer's.
    #[allow(clippy::type_complexity)] // a private helper's one result
    fn start_chains(&mut self, w: &Waiting, chains: &[Chain]) -> Vec<Result<u64, (E, Fate)>> {
        let peer = w.peer;
        let link = self.transport(peer);
        let mut broken = match &link {
            Ok(_) => self.peer(peer).broken(),
            Err(e) => Some(e.clone()),
        };
        let mut seq_of: Vec<Result<u64, (E, Fate)>> = vec![Ok(0); w.puts.len()];
        for c in chains {
            let r = match (&broken, &link) {
                (Some(e), _) | (None, Err(e)) => Err((e.clone(), Fate::NotStarted)),
                (None, Ok(t)) => {
                    let first = &w.puts[c.members[0]].0;
                    let to = gin_net::Target::Key {
                        key: first.key,
                        offset: c.offset,
                    };
                    // SAFETY: every member was handed over under `put`'s
                    // contract, and the chain's bytes are exactly theirs:
                    // they continue one another in one window's part and in
                    // one region of the peer.
                    let r =
                        unsafe { t.start_put_device(peer, to, c.src, c.len, first.keep.clone()) };
                    r.map_err(|e| (E::net(peer, e), Fate::Refused))
                }
            };
            match &r {
                Ok(seq) => {
                    self.stats.started += 1;
                    self.started(peer, *seq);
                }
                Err((e, fate)) => {
                    self.stats.unstarted += c.members.len() as u64;
                    if *fate == Fate::Refused {
                        self.peer(peer).refused.get_or_insert_with(|| e.clone());
                        broken = Some(e.clone());
                    }
                }
            }
            for &m in &c.members {
                seq_of[m].clone_from(&r);
            }
        }
        seq_of
    }

    /// Whether `t`'s entry was released: the puts to its peer up to it
    /// completed (asked without waiting; waiting puts to the peer are
    /// started first) and a value held there was sent. An entry released
    /// before a failure landed.
    ///
    /// # Errors
    /// The peer's failure, for every entry not released; an entry failed
    /// at issue (refused at start, or behind a refusal) at once, with
    /// that refusal. Noted ([`Note`]) where its put was merged, is not
    /// what failed, or was never started.
    pub fn landed(&mut self, t: Ticket) -> Result<bool, E> {
        if self.waiting_for(t.peer).is_some() {
            self.issue();
        }
        let released = self.release(t.peer);
        let queue = self.peer(t.peer);
        if queue.released > t.n {
            return Ok(true);
        }
        let cause = queue.cause;
        let (own, note) = match queue.entry(t.n) {
            Some(entry) => (
                match &entry.after {
                    After::Failed(f) => Some(f.clone()),
                    _ => None,
                },
                entry.note(cause),
            ),
            None => (None, None),
        };
        // An entry failed at issue (a put refused at start, or after one)
        // fails at once, with that, even where puts before it are still in
        // flight or the queue's front failed otherwise.
        own.map_or(released, Err)
            .map(|()| false)
            .map_err(|e| note.map_or_else(|| e.clone(), |n| e.clone().noted(&n)))
    }

    /// Releases the entries of `peer`'s queue whose puts completed, in
    /// order, sending the values held behind them, without waiting. A
    /// failure is the peer's from then on, returned here and for every
    /// entry not yet released.
    fn release(&mut self, peer: usize) -> Result<(), E> {
        let p = self.peer(peer);
        if let Some(e) = &p.failed {
            return Err(e.clone());
        }
        if p.queue.is_empty() {
            return Ok(());
        }
        self.release_done(peer).map_err(|(e, cause)| {
            let p = self.peer(peer);
            p.failed = Some(e.clone());
            p.cause = Some(cause);
            e
        })
    }

    /// [`DevicePuts::release`]'s work: an entry is popped (and counted
    /// released) only once its value was sent. Where the transport names
    /// the put that failed, the entries before it are released first: the
    /// failure is that put's, not the oldest one's.
    fn release_done(&mut self, peer: usize) -> Result<(), (E, Cause)> {
        let t = self.transport(peer).map_err(|e| (e, Cause::Unnamed))?;
        let (done, failure) = match t.device_puts_completed(peer) {
            Ok(done) => (done, None),
            Err(e) => {
                let named = t.device_put_failed(peer);
                let before = named.map_or(0, |f| f.saturating_sub(1));
                let cause = named.map_or(Cause::Unnamed, Cause::Named);
                (before, Some((E::net(peer, e), cause)))
            }
        };
        let p = self.peer(peer);
        while let Some(e) = p.queue.front() {
            match &e.after {
                After::Failed(f) => return Err((f.clone(), Cause::Refused)),
                After::Seq(s) if *s <= done => {}
                After::Seq(_) | After::Waiting(_) => break,
            }
            if let Some(h) = e.held {
                let at = gin_net::Target::Key {
                    key: h.key,
                    offset: h.offset,
                };
                let after = match e.after {
                    After::Seq(s) => s,
                    _ => 0,
                };
                t.put_ordered_after(peer, at, &h.bytes, after)
                    .map_err(|e| (E::net(peer, e), Cause::Held))?;
            }
            p.queue.pop_front();
            p.released += 1;
        }
        failure.map_or(Ok(()), Err)
    }

    /// Completes the puts started to `peer` (the waiting ones started
    /// first; none: at once), waiting: the transport reads none of their
    /// sources any more, also when this fails. Then sends the values held
    /// behind them.
    ///
    /// # Errors
    /// The transport's, or the peer's failure.
    pub fn settle(&mut self, peer: usize) -> Result<(), E> {
        if self.waiting_for(peer).is_some() {
            self.issue();
        }
        let p = self.peer(peer);
        if std::mem::replace(&mut p.unsettled, false) {
            self.transport(peer)?
                .complete_device(peer, self.fabric.timeout())
                .map_err(|e| E::net(peer, e))?;
        }
        self.release(peer)
    }

    /// Completes every put still in flight, to every peer even after a
    /// failure (values still held are not sent: the engine stopped, or
    /// failed, with them in flight); puts still waiting are dropped, never
    /// started (their engine stopped before the end of their pass). The
    /// first failure.
    ///
    /// # Errors
    /// The first transport's.
    pub fn settle_all(&mut self) -> Result<(), E> {
        if let Some(w) = self.waiting.take() {
            self.stats.unstarted += w.puts.len() as u64;
            tracing::debug!(
                rank = self.fabric.rank(),
                peer = w.peer,
                puts = w.puts.len(),
                "puts from GPU memory dropped before they started (the engine stopped mid-pass)"
            );
        }
        // Only what was started is completed: a put never started (dropped
        // above, or failed at issue) lends the transport nothing, and a
        // peer whose puts failed is still completed, so that its sources
        // are free once this returns. `unsettled` is cleared first: a
        // completion that fails is not retried (the transport reads none
        // of the sources after failing, as `complete_device` promises).
        let mut first = Ok(());
        for i in 0..self.peers.len() {
            let p = &mut self.peers[i];
            if !std::mem::replace(&mut p.unsettled, false) {
                continue;
            }
            let peer = p.peer;
            let done = self.transport(peer).and_then(|t| {
                t.complete_device(peer, self.fabric.timeout())
                    .map_err(|e| E::net(peer, e))
            });
            first = first.and(done);
        }
        first
    }
}

/// A waiting put as the merge sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Span {
    key: u32,
    window: u32,
    offset: u64,
    src: u64,
    len: u64,
}

impl Span {
    fn of(p: &DevicePut) -> Self {
        Self {
            key: p.key,
            window: p.window,
            offset: p.offset,
            src: p.src,
            len: p.len,
        }
    }
}

/// Puts started as one: the waiting puts it carries (their indices,
/// ascending), its destination offset, source and length.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Chain {
    members: Vec<usize>,
    offset: u64,
    src: u64,
    len: u64,
}

/// The transport puts that carry `spans`: those of one key and window
/// whose destination and source both start where another's end are
/// joined, up to `max` bytes a chain (a put longer than that alone), in
/// the order of their first member.
fn plan(spans: &[Span], max: u64) -> Vec<Chain> {
    let mut order: Vec<usize> = (0..spans.len()).collect();
    order.sort_by_key(|&i| (spans[i].key, spans[i].window, spans[i].offset, i));
    let mut chains: Vec<(Span, Chain)> = Vec::new();
    for i in order {
        let s = spans[i];
        if let Some((head, c)) = chains.last_mut()
            && head.key == s.key
            && head.window == s.window
            && c.offset.checked_add(c.len) == Some(s.offset)
            && c.src.checked_add(c.len) == Some(s.src)
            && c.len.checked_add(s.len).is_some_and(|l| l <= max)
        {
            c.len += s.len;
            c.members.push(i);
            continue;
        }
        chains.push((
            s,
            Chain {
                members: vec![i],
                offset: s.offset,
                src: s.src,
                len: s.len,
            },
        ));
    }
    let mut chains: Vec<Chain> = chains
        .into_iter()
        .map(|(_, mut c)| {
            c.members.sort_unstable();
            c
        })
        .collect();
    chains.sort_by_key(|c| c.members[0]);
    chains
}

#[cfg(test)]
#[path = "puts_tests.rs"]
mod tests;
