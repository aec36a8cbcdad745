//! The proxy engine: one state machine for CPU and CUDA ranks, generic over
//! the [`Executor`] that moves the bytes.
//!
//! It has no threads, sleeps or clocks: [`Engine::step`] looks at every
//! ring once, in order, takes up to `batch` descriptors from each, checks
//! each against the window directory, hands it to the executor, and
//! publishes each ring's completion index through the executor; it returns
//! what it did. A driver ([`crate::Driver`]) calls it in a loop on a thread;
//! tests call it by hand against [`crate::testing::Fake`].
//!
//! What it owns, once for both kinds of rank:
//!
//! - **Ring order and batching.** Descriptors are read in sequence order
//!   through a [`RingMem`] view; a ring gives at most `batch` per step, then
//!   the next ring's turn comes, so batches amortise the executor's per-batch
//!   cost yet no ring starves the others.
//! - **Validation.** Windows, offsets, lengths and counter slots are checked
//!   against the executor's directory before anything moves
//!   ([`Invalid`]).
//! - **Running totals** of signals per (peer, window, offset) and of
//!   counters per slot, handed to the executor with every add (see
//!   [`crate::executor::Signal`]).
//! - **In-order completion.** A ring's completion index is published (by the
//!   executor) up to the first operation still in flight: a get whose
//!   answer has not landed, or a put whose source the transport still
//!   reads (a put from GPU memory, or a CPU rank's large put from a window
//!   gin-net allocated, lent to ucx), whichever order they complete
//!   in; a counter carried by such an operation is counted when it lands.
//!   Many operations are in flight at once: the engine issues the next
//!   ones while earlier ones complete, and never waits for one.
//! - **Fail-stop.** The first error — a corrupt descriptor, an invalid one,
//!   an executor error — is recorded as a [`ProxyError`] naming rank,
//!   context, peer and sequence. The ring's completion index is still
//!   published up to the failing descriptor (what came before completed),
//!   and then nothing more is executed, on any ring.

use std::collections::{HashMap, VecDeque};

use crate::descriptor::{Desc, Op, Slot};
use crate::error::{ExecError, Invalid, ProxyError, Why};
use crate::executor::{Data, Executor, Get, Issued, Put, Signal, Site, Source, Target};
use crate::ring::RingMem;

/// Settings of an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// This rank (a put's source and a get's destination are its parts).
    pub rank: usize,
    /// Descriptors taken from one ring per step (at least 1).
    pub batch: u64,
    /// Counter slots that exist: a descriptor naming another is invalid.
    pub counter_slots: u64,
}

/// One ring the engine drains.
#[derive(Debug)]
pub struct RingSpec {
    /// Its context.
    pub ctx: u32,
    /// Its peer: every descriptor in it goes to this rank.
    pub peer: usize,
    /// Its descriptor slots.
    pub mem: RingMem,
    /// The first sequence number producers use (0 for a new ring).
    pub first: u64,
}

/// What one [`Engine::step`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// Descriptors handed to the executor.
    pub executed: u64,
    /// Operations in flight (gets, puts) that landed.
    pub landed: u64,
    /// Rings whose completion index was published anew.
    pub published: u64,
}

impl Progress {
    /// Whether the step did anything (a driver keeps polling then).
    pub fn did_work(&self) -> bool {
        self.executed > 0 || self.landed > 0 || self.published > 0
    }
}

/// Counts kept for debug logs: where time goes when a path is slower than
/// its floor.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct EngineStats {
    /// Descriptors executed.
    pub descriptors: u64,
    /// Batches handed to the executor (ring passes that did something).
    pub batches: u64,
    /// Polls that found a ring's next slot not yet written.
    pub pending_polls: u64,
    /// Operations (gets, puts) that were in flight and landed.
    pub landed: u64,
}

/// An operation in flight: its descriptor's sequence number and operation,
/// the executor's handle (`None`: complete, but with a counter that waits
/// for the operations in flight before it), and the counter to count when
/// it lands.
struct Flight<P> {
    seq: u64,
    op: Op,
    token: Option<P>,
    counter: Option<u32>,
}

struct RingState<P> {
    ctx: u32,
    peer: usize,
    mem: RingMem,
    /// The next sequence number to read.
    next: u64,
    /// The completion index last published.
    published: u64,
    /// Operations in flight, in ring order.
    flights: VecDeque<Flight<P>>,
}

/// Running totals: signals per (peer, window, offset), counters per slot.
#[derive(Debug, Default)]
struct Totals {
    signals: HashMap<(usize, u32, u64), u64>,
    counters: HashMap<u32, u64>,
}

impl Totals {
    fn signal(&mut self, peer: usize, window: u32, offset: u64, add: u64) -> u64 {
        let t = self.signals.entry((peer, window, offset)).or_insert(0);
        *t = t.wrapping_add(add);
        *t
    }

    fn count<E: Executor>(&mut self, exec: &mut E, site: Site, slot: u32) -> Result<(), ExecError> {
        let t = self.counters.entry(slot).or_insert(0);
        *t = t.wrapping_add(1);
        exec.count(site, slot, *t)
    }
}

/// The proxy engine (see the module documentation).
pub struct Engine<E: Executor> {
    config: EngineConfig,
    rings: Vec<RingState<E::InFlight>>,
    totals: Totals,
    failure: Option<ProxyError>,
    stats: EngineStats,
}

impl<E: Executor> std::fmt::Debug for Engine<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("config", &self.config)
            .field("rings", &self.rings.len())
            .field("failure", &self.failure)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl<E: Executor> Engine<E> {
    /// An engine draining `rings`, in this order (the index of a ring here
    /// is its [`Site::ring`]).
    pub fn new(config: EngineConfig, rings: Vec<RingSpec>) -> Self {
        Self {
            config: EngineConfig {
                batch: config.batch.max(1),
                ..config
            },
            rings: rings
                .into_iter()
                .map(|r| RingState {
                    ctx: r.ctx,
                    peer: r.peer,
                    mem: r.mem,
                    next: r.first,
                    published: r.first,
                    flights: VecDeque::new(),
                })
                .collect(),
            totals: Totals::default(),
            failure: None,
            stats: EngineStats::default(),
        }
    }

    /// One pass over every ring: landed operations, up to `batch` new
    /// descriptors, operations that landed meanwhile (a put may complete
    /// as it is issued), publication. Does nothing once the engine has
    /// failed.
    pub fn step(&mut self, exec: &mut E) -> Progress {
        let mut p = Progress::default();
        if self.failure.is_some() {
            return p;
        }
        for i in 0..self.rings.len() {
            if let Err(e) = self.turn(i, exec, &mut p) {
                self.failure = Some(e);
                break;
            }
        }
        p
    }

    /// One ring's turn alone (ring `index`, as in [`Engine::step`]): what a
    /// producer that runs the engine on its own thread does for the ring it
    /// wrote to or waits on (gin-proxy's CPU backend under `auto`), where
    /// [`Engine::step`] would also take other rings' work. Does nothing once
    /// the engine has failed, or for a ring that does not exist; an error
    /// fails the engine as in [`Engine::step`].
    pub fn step_ring(&mut self, index: usize, exec: &mut E) -> Progress {
        let mut p = Progress::default();
        if self.failure.is_some() || index >= self.rings.len() {
            return p;
        }
        if let Err(e) = self.turn(index, exec, &mut p) {
            self.failure = Some(e);
        }
        p
    }

    /// One ring's turn: landed operations, new descriptors, landed ones
    /// again, publication. After an error the ring's completion is still
    /// published up to the failing descriptor (those before it were
    /// executed and are complete), or to the first operation still in
    /// flight before it.
    fn turn(
        &mut self,
        index: usize,
        exec: &mut E,
        progress: &mut Progress,
    ) -> Result<(), ProxyError> {
        let Self {
            config,
            rings,
            totals,
            stats,
            ..
        } = self;
        let ring = &mut rings[index];
        let site = Site {
            ring: index,
            ctx: ring.ctx,
            peer: ring.peer,
        };
        let before = *progress;
        let error = land(ring, site, totals, exec, progress, stats)
            .and_then(|()| take(config, ring, site, totals, exec, progress, stats))
            .and_then(|()| land(ring, site, totals, exec, progress, stats))
            .err()
            .map(|(seq, op, why)| ProxyError::Descriptor {
                rank: config.rank,
                ctx: site.ctx,
                peer: site.peer,
                seq,
                op,
                why,
            });
        let upto = ring.flights.front().map_or(ring.next, |f| f.seq);
        let publish = upto != ring.published;
        let handed = publish || *progress != before;
        let result = if publish {
            exec.publish(site, upto)
        } else {
            Ok(())
        }
        .and_then(|()| if handed { exec.flush(site) } else { Ok(()) });
        if handed {
            stats.batches += 1;
        }
        let unpublished = match result {
            Ok(()) => {
                if publish {
                    ring.published = upto;
                    progress.published += 1;
                }
                None
            }
            Err(why) => Some(ProxyError::Publish {
                rank: config.rank,
                ctx: site.ctx,
                peer: site.peer,
                upto,
                why,
            }),
        };
        error.or(unpublished).map_or(Ok(()), Err)
    }

    /// Whether a step could do something now: a ring's next slot is written
    /// (or corrupt), or an operation is in flight (it must be polled until
    /// it lands). A driver about to sleep asks this after announcing itself
    /// (see [`gin_net::idle::Sleeper`]).
    pub fn has_work(&self) -> bool {
        self.failure.is_none()
            && self
                .rings
                .iter()
                .any(|r| !r.flights.is_empty() || !matches!(r.mem.peek(r.next), Ok(Slot::Pending)))
    }

    /// Whether ring `index` alone has work: its next slot is written (or
    /// corrupt), or an operation of it is in flight ([`Engine::has_work`]).
    pub fn ring_has_work(&self, index: usize) -> bool {
        self.failure.is_none()
            && self.rings.get(index).is_some_and(|r| {
                !r.flights.is_empty() || !matches!(r.mem.peek(r.next), Ok(Slot::Pending))
            })
    }

    /// Operations (gets, puts) in flight, over every ring.
    pub fn in_flight(&self) -> usize {
        self.rings.iter().map(|r| r.flights.len()).sum()
    }

    /// The first error, once the engine has failed.
    pub fn failure(&self) -> Option<&ProxyError> {
        self.failure.as_ref()
    }

    /// The completion index last published for ring `ring`.
    pub fn published(&self, ring: usize) -> Option<u64> {
        self.rings.get(ring).map(|r| r.published)
    }

    /// The next sequence number the engine reads from ring `ring`.
    pub fn next(&self, ring: usize) -> Option<u64> {
        self.rings.get(ring).map(|r| r.next)
    }

    /// Rings drained.
    pub fn rings(&self) -> usize {
        self.rings.len()
    }

    /// Counts for debug logs.
    pub fn stats(&self) -> EngineStats {
        self.stats
    }
}

/// Where a descriptor failed: its sequence, operation (if it decoded) and
/// why.
type Failed = (u64, Option<Op>, Why);

/// Operations of `ring` in flight that landed, in ring order (polling
/// stops at the first that has not: completion is published in order,
/// whatever order they complete in), each one's counter after it.
fn land<E: Executor>(
    ring: &mut RingState<E::InFlight>,
    site: Site,
    totals: &mut Totals,
    exec: &mut E,
    progress: &mut Progress,
    stats: &mut EngineStats,
) -> Result<(), Failed> {
    while let Some(f) = ring.flights.front_mut() {
        let (seq, op) = (f.seq, f.op);
        let landed = match &mut f.token {
            Some(t) => exec
                .landed(site, t)
                .map_err(|e| (seq, Some(op), e.into()))?,
            None => true,
        };
        if !landed {
            break;
        }
        progress.landed += 1;
        stats.landed += 1;
        if let Some(c) = ring.flights.pop_front().and_then(|f| f.counter) {
            totals
                .count(exec, site, c)
                .map_err(|e| (seq, Some(op), e.into()))?;
        }
    }
    Ok(())
}

/// Up to a batch of new descriptors from `ring`, executed in order.
fn take<E: Executor>(
    config: &EngineConfig,
    ring: &mut RingState<E::InFlight>,
    site: Site,
    totals: &mut Totals,
    exec: &mut E,
    progress: &mut Progress,
    stats: &mut EngineStats,
) -> Result<(), Failed> {
    let start = ring.next;
    while ring.next.wrapping_sub(start) < config.batch {
        let seq = ring.next;
        let desc = match ring.mem.peek(seq) {
            Ok(Slot::Pending) => {
                stats.pending_polls += 1;
                break;
            }
            Ok(Slot::Ready(desc)) => desc,
            Err(e) => return Err((seq, None, e.into())),
        };
        let fail = |why| (seq, Some(desc.op), why);
        let issued = execute(config, totals, exec, site, &desc).map_err(fail)?;
        // A counter counts once its operation and every one before it in
        // the ring completed.
        match (issued, desc.counter) {
            (Issued::InFlight(t), counter) => ring.flights.push_back(Flight {
                seq,
                op: desc.op,
                token: Some(t),
                counter,
            }),
            (Issued::Ordered, Some(c)) if !ring.flights.is_empty() => {
                ring.flights.push_back(Flight {
                    seq,
                    op: desc.op,
                    token: None,
                    counter: Some(c),
                });
            }
            (Issued::Ordered, Some(c)) => {
                totals.count(exec, site, c).map_err(|e| fail(e.into()))?;
            }
            (Issued::Ordered, None) => {}
        }
        ring.next = seq.wrapping_add(1);
        progress.executed += 1;
        stats.descriptors += 1;
    }
    Ok(())
}

/// Executes one descriptor (its counter is the caller's to count).
fn execute<E: Executor>(
    config: &EngineConfig,
    totals: &mut Totals,
    exec: &mut E,
    site: Site,
    d: &Desc,
) -> Result<Issued<E::InFlight>, Why> {
    check_counter(d, config.counter_slots)?;
    match d.op {
        Op::Put => {
            let mut put = resolve_put(exec, config.rank, site.peer, d)?;
            if let Some(s) = &mut put.signal {
                s.total = totals.signal(site.peer, s.at.id, s.at.offset, s.add);
            }
            Ok(exec.put(site, &put)?)
        }
        Op::Get => {
            let get = resolve_get(exec, config.rank, site.peer, d)?;
            Ok(exec.get(site, &get)?)
        }
    }
}

/// Checks a descriptor's counter slot against the `slots` that exist.
pub(crate) fn check_counter(d: &Desc, slots: u64) -> Result<(), Invalid> {
    match d.counter {
        Some(slot) if u64::from(slot) >= slots => Err(Invalid::NoCounter { slot, slots }),
        _ => Ok(()),
    }
}

/// `bytes` at `offset` of `owner`'s part of window `id`, checked.
fn target<E: Executor>(
    exec: &E,
    what: &'static str,
    (id, owner): (u32, usize),
    offset: u64,
    bytes: u64,
) -> Result<Target<E::Window>, Invalid> {
    let window = exec
        .window(id)
        .ok_or(Invalid::UnknownWindow { window: id })?;
    let size = exec.part_size(&window, owner);
    if offset.checked_add(bytes).is_none_or(|end| end > size) {
        return Err(Invalid::OutOfWindow {
            what,
            window: id,
            owner,
            offset,
            bytes,
            size,
        });
    }
    Ok(Target { window, id, offset })
}

/// A put descriptor checked against the directory. The signal's `total` is
/// left at 0 for the engine to fill in.
pub(crate) fn resolve_put<E: Executor>(
    exec: &E,
    rank: usize,
    peer: usize,
    d: &Desc,
) -> Result<Put<E::Window>, Invalid> {
    let data = if let Some(v) = d.inline {
        if d.bytes != 8 {
            return Err(Invalid::InlineSize { bytes: d.bytes });
        }
        Some(Data {
            dst: target(
                exec,
                "put destination",
                (d.dst_window, peer),
                d.dst_offset,
                8,
            )?,
            src: Source::Inline(v),
            bytes: 8,
        })
    } else if d.bytes == 0 {
        None
    } else {
        Some(Data {
            src: Source::Window(target(
                exec,
                "put source",
                (d.src_window, rank),
                d.src_offset,
                d.bytes,
            )?),
            dst: target(
                exec,
                "put destination",
                (d.dst_window, peer),
                d.dst_offset,
                d.bytes,
            )?,
            bytes: d.bytes,
        })
    };
    let signal = match d.signal {
        None => None,
        Some(s) if !s.offset.is_multiple_of(8) => {
            return Err(Invalid::MisalignedSignal {
                window: s.window,
                offset: s.offset,
            });
        }
        Some(s) => Some(Signal {
            at: target(exec, "signal", (s.window, peer), s.offset, 8)?,
            add: s.add,
            total: 0,
            strong: s.strong,
        }),
    };
    Ok(Put { data, signal })
}

/// A get descriptor checked against the directory.
pub(crate) fn resolve_get<E: Executor>(
    exec: &E,
    rank: usize,
    peer: usize,
    d: &Desc,
) -> Result<Get<E::Window>, Invalid> {
    if d.signal.is_some() {
        return Err(Invalid::GetWith { what: "a signal" });
    }
    if d.inline.is_some() {
        return Err(Invalid::GetWith {
            what: "inline data",
        });
    }
    Ok(Get {
        remote: target(
            exec,
            "get source",
            (d.dst_window, peer),
            d.dst_offset,
            d.bytes,
        )?,
        local: target(
            exec,
            "get destination",
            (d.src_window, rank),
            d.src_offset,
            d.bytes,
        )?,
        bytes: d.bytes,
    })
}

#[cfg(test)]
#[path = "engine_tests.rs"]
mod tests;
