//! An in-memory [`Executor`] for deterministic step tests of the engine
//! (quinn-proto's `Pair` style: no threads, no sleeps, no clocks).
//!
//! [`Fake`] holds every rank's part of every window as bytes, applies puts,
//! signals (adds), gets and counters to them, and records each call the
//! engine makes ([`Fake::calls`]) and each effect applied ([`Fake::log`]).
//! It can behave like either kind of real executor:
//!
//! - **synchronous** (the default, like the fabric): every effect applies
//!   during the call;
//! - **queued** ([`Fake::set_queued`], like a CUDA stream per ring): effects
//!   and publications wait in a per-ring queue until the test runs them
//!   ([`Fake::run`]), so completion can be made arbitrarily slow.
//!
//! Faults to inject: a peer that dies now or after some operations
//! ([`Fake::kill`], [`Fake::kill_after`]), a target that refuses puts to a
//! window ([`Fake::refuse`]), gets whose answers come late
//! ([`Fake::set_late_gets`], [`Fake::land`]), puts that stay in flight
//! until the test completes them, in any order, or fails them
//! ([`Fake::set_late_puts`], [`Fake::complete_put`], [`Fake::fail_put`]:
//! a put from GPU memory over ucx, its signal held back until it
//! completed, as `GIN_UCX_GPU_ORDER=wait` has it), and a failing
//! publication ([`Fake::set_fail_publish`]).

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;

use crate::error::ExecError;
use crate::executor::{Executor, Get, Issued, Put, Site, Source};
use crate::ring::Ring;

/// An effect on memory, as queued and as applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Bytes written to `peer`'s part of `window` at `offset`.
    Data {
        /// Target rank.
        peer: usize,
        /// Window id.
        window: u32,
        /// Offset.
        offset: u64,
        /// The bytes (read from the source when the put was handed over).
        bytes: Vec<u8>,
    },
    /// A signal add at `peer`.
    Signal {
        /// Target rank.
        peer: usize,
        /// Signal window id.
        window: u32,
        /// Offset of the slot.
        offset: u64,
        /// Amount added.
        add: u64,
        /// The engine's running total after it.
        total: u64,
    },
    /// A counter bump.
    Count {
        /// Slot.
        slot: u32,
        /// The engine's running total after it.
        total: u64,
    },
    /// A get's data landing in this rank's part.
    Got {
        /// Source rank.
        peer: usize,
        /// Source window and offset.
        remote: (u32, u64),
        /// Destination window and offset in this rank's part.
        local: (u32, u64),
        /// Length.
        bytes: u64,
    },
    /// A ring's completion index.
    Publish {
        /// Ring index.
        ring: usize,
        /// Everything before it is complete.
        upto: u64,
    },
}

/// A call the engine made, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    /// [`Executor::put`]: destination offset (if data moved) and the
    /// signal's running total (if one was carried).
    Put {
        /// The ring.
        site: Site,
        /// Destination offset of the data.
        dst: Option<u64>,
        /// The signal's total.
        signal: Option<u64>,
    },
    /// [`Executor::get`]: the remote offset.
    Get {
        /// The ring.
        site: Site,
        /// Remote offset.
        remote: u64,
    },
    /// [`Executor::count`].
    Count {
        /// The ring.
        site: Site,
        /// Slot.
        slot: u32,
        /// Running total.
        total: u64,
    },
    /// [`Executor::publish`].
    Publish {
        /// The ring.
        site: Site,
        /// Completion index.
        upto: u64,
    },
    /// [`Executor::flush`].
    Flush {
        /// The ring.
        site: Site,
    },
}

/// The fake's handle for an operation in flight ([`Executor::InFlight`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Token {
    /// A late get ([`Fake::land`] takes its number).
    Get(usize),
    /// A late put ([`Fake::complete_put`] takes its number).
    Put(usize),
}

/// A put in flight ([`Fake::set_late_puts`]).
#[derive(Debug)]
struct LatePut {
    ring: usize,
    /// The test completed it.
    done: bool,
    /// The test failed it.
    failed: Option<ExecError>,
    /// Its signal, held until it completed and the engine saw that.
    signal: Option<Event>,
}

/// Which operations stay in flight until the test lands them.
#[derive(Debug, Default, Clone, Copy)]
struct Late {
    gets: bool,
    puts: bool,
}

/// The in-memory executor (see the module documentation).
#[derive(Debug, Default)]
pub struct Fake {
    rank: usize,
    windows: BTreeMap<u32, Vec<u64>>,
    mem: HashMap<(usize, u32), Vec<u8>>,
    counters: Vec<u64>,
    rings: HashMap<usize, Arc<Ring>>,
    published: HashMap<usize, u64>,
    queued: bool,
    queues: BTreeMap<usize, VecDeque<Event>>,
    log: Vec<Event>,
    calls: Vec<Call>,
    dead: HashSet<usize>,
    lives: HashMap<usize, u64>,
    refused: HashSet<(usize, u32)>,
    late: Late,
    /// Gets in flight: the event to log and the bytes the peer served.
    gets: Vec<Option<(Event, Vec<u8>)>>,
    /// Puts in flight, by number (`None`: the engine saw it land).
    puts: Vec<Option<LatePut>>,
    fail_publish: bool,
}

impl Fake {
    /// A fake for `rank` with `counters` counter slots and no windows.
    pub fn new(rank: usize, counters: usize) -> Self {
        Self {
            rank,
            counters: vec![0; counters],
            ..Self::default()
        }
    }

    /// Registers window `id` with a zeroed part of `sizes[r]` bytes on each
    /// rank `r`.
    pub fn add_window(&mut self, id: u32, sizes: &[u64]) {
        for (r, &n) in sizes.iter().enumerate() {
            self.mem.insert((r, id), vec![0; n as usize]);
        }
        self.windows.insert(id, sizes.to_vec());
    }

    /// Publishes ring `ring`'s completion index into `r` as well, so that
    /// producers writing to `r` get credit back when (and only when) a
    /// publication is applied.
    pub fn attach(&mut self, ring: usize, r: Arc<Ring>) {
        self.rings.insert(ring, r);
    }

    /// Queued mode: effects wait in a per-ring queue until [`Fake::run`].
    pub fn set_queued(&mut self, queued: bool) {
        self.queued = queued;
    }

    /// Gets stay in flight until [`Fake::land`] (the peer serves them when
    /// they are issued; their data lands later).
    pub fn set_late_gets(&mut self, late: bool) {
        self.late.gets = late;
    }

    /// Puts stay in flight until [`Fake::complete_put`] (or
    /// [`Fake::land_all`]): their data moves when they are issued, their
    /// signal only when the engine, polling, finds them complete.
    pub fn set_late_puts(&mut self, late: bool) {
        self.late.puts = late;
    }

    /// Completes the put in flight numbered `n` (0 for the first one
    /// issued in flight); the engine sees it when it polls it.
    pub fn complete_put(&mut self, n: usize) {
        if let Some(Some(p)) = self.puts.get_mut(n) {
            p.done = true;
        }
    }

    /// Fails the put in flight numbered `n`, as a transport whose put
    /// failed after it was issued: the engine's poll reports `e`.
    pub fn fail_put(&mut self, n: usize, e: ExecError) {
        if let Some(Some(p)) = self.puts.get_mut(n) {
            p.failed = Some(e);
        }
    }

    /// Puts in flight that the engine has not seen land.
    pub fn puts_in_flight(&self) -> usize {
        self.puts.iter().filter(|p| p.is_some()).count()
    }

    /// Publication fails from now on.
    pub fn set_fail_publish(&mut self, fail: bool) {
        self.fail_publish = fail;
    }

    /// `peer` is dead: every later put or get to it fails.
    pub fn kill(&mut self, peer: usize) {
        self.dead.insert(peer);
    }

    /// `peer` dies after `ops` more puts or gets to it succeed.
    pub fn kill_after(&mut self, peer: usize, ops: u64) {
        self.lives.insert(peer, ops);
    }

    /// `peer` refuses puts (data or signal) to its part of `window`.
    pub fn refuse(&mut self, peer: usize, window: u32) {
        self.refused.insert((peer, window));
    }

    /// Writes `bytes` into `owner`'s part of `window` (test set-up).
    pub fn write(&mut self, owner: usize, window: u32, offset: u64, bytes: &[u8]) {
        let o = offset as usize;
        if let Some(m) = self
            .mem
            .get_mut(&(owner, window))
            .and_then(|m| m.get_mut(o..o + bytes.len()))
        {
            m.copy_from_slice(bytes);
        }
    }

    /// `len` bytes of `owner`'s part of `window` (empty if out of range).
    pub fn read(&self, owner: usize, window: u32, offset: u64, len: usize) -> &[u8] {
        let o = offset as usize;
        self.mem
            .get(&(owner, window))
            .and_then(|m| m.get(o..o + len))
            .unwrap_or(&[])
    }

    /// The 8-byte little-endian word at `offset` (0 if out of range).
    pub fn read_u64(&self, owner: usize, window: u32, offset: u64) -> u64 {
        self.read(owner, window, offset, 8)
            .try_into()
            .map_or(0, u64::from_le_bytes)
    }

    /// A counter's value (0 if it does not exist).
    pub fn counter(&self, slot: u32) -> u64 {
        self.counters.get(slot as usize).copied().unwrap_or(0)
    }

    /// The completion index last applied for `ring`.
    pub fn published(&self, ring: usize) -> Option<u64> {
        self.published.get(&ring).copied()
    }

    /// Effects applied so far, in order.
    pub fn log(&self) -> &[Event] {
        &self.log
    }

    /// Calls the engine made so far, in order.
    pub fn calls(&self) -> &[Call] {
        &self.calls
    }

    /// Effects queued for `ring` and not yet applied.
    pub fn queued(&self, ring: usize) -> usize {
        self.queues.get(&ring).map_or(0, VecDeque::len)
    }

    /// Applies up to `n` queued effects of `ring`, in order; returns how
    /// many were applied.
    pub fn run(&mut self, ring: usize, n: usize) -> usize {
        let mut done = 0;
        while done < n {
            let Some(e) = self.queues.get_mut(&ring).and_then(VecDeque::pop_front) else {
                break;
            };
            self.apply(e);
            done += 1;
        }
        done
    }

    /// Applies every queued effect of every ring.
    pub fn run_all(&mut self) {
        let rings: Vec<usize> = self.queues.keys().copied().collect();
        for r in rings {
            self.run(r, usize::MAX);
        }
    }

    /// Lands the get with handle `token`: the bytes the peer served when
    /// the get was issued (a tcp target answers in link order) are written
    /// now.
    pub fn land(&mut self, token: usize) {
        if let Some((e, bytes)) = self.gets.get_mut(token).and_then(Option::take) {
            if let Event::Got { local, .. } = &e {
                self.write(self.rank, local.0, local.1, &bytes);
            }
            self.log.push(e);
        }
    }

    /// Lands every get in flight and completes every put in flight.
    pub fn land_all(&mut self) {
        for t in 0..self.gets.len() {
            self.land(t);
        }
        for n in 0..self.puts.len() {
            self.complete_put(n);
        }
    }

    /// Gets in flight.
    pub fn gets_in_flight(&self) -> usize {
        self.gets.iter().filter(|g| g.is_some()).count()
    }

    fn effect(&mut self, ring: usize, e: Event) {
        if self.queued {
            self.queues.entry(ring).or_default().push_back(e);
        } else {
            self.apply(e);
        }
    }

    fn apply(&mut self, e: Event) {
        match &e {
            Event::Data {
                peer,
                window,
                offset,
                bytes,
            } => self.write(*peer, *window, *offset, bytes),
            Event::Signal {
                peer,
                window,
                offset,
                add,
                ..
            } => {
                let v = self.read_u64(*peer, *window, *offset).wrapping_add(*add);
                self.write(*peer, *window, *offset, &v.to_le_bytes());
            }
            Event::Count { slot, .. } => {
                if let Some(c) = self.counters.get_mut(*slot as usize) {
                    *c += 1;
                }
            }
            Event::Got {
                peer,
                remote,
                local,
                bytes,
            } => {
                let data = self
                    .read(*peer, remote.0, remote.1, *bytes as usize)
                    .to_vec();
                self.write(self.rank, local.0, local.1, &data);
            }
            Event::Publish { ring, upto } => {
                self.published.insert(*ring, *upto);
                if let Some(r) = self.rings.get(ring) {
                    r.advance(*upto);
                }
            }
        }
        self.log.push(e);
    }

    /// A put or get to `peer`: fails if it is dead, or dies now.
    fn reach(&mut self, peer: usize) -> Result<(), ExecError> {
        if let Some(left) = self.lives.get_mut(&peer) {
            if *left == 0 {
                self.dead.insert(peer);
            } else {
                *left -= 1;
            }
        }
        if self.dead.contains(&peer) {
            return Err(ExecError::Unreachable {
                peer,
                why: "the fake lost it".into(),
            });
        }
        Ok(())
    }
}

impl Executor for Fake {
    type Window = u32;
    type InFlight = Token;

    fn window(&self, id: u32) -> Option<u32> {
        self.windows.contains_key(&id).then_some(id)
    }

    fn part_size(&self, window: &u32, owner: usize) -> u64 {
        self.windows
            .get(window)
            .and_then(|s| s.get(owner))
            .copied()
            .unwrap_or(0)
    }

    fn put(&mut self, site: Site, put: &Put<u32>) -> Result<Issued<Token>, ExecError> {
        self.calls.push(Call::Put {
            site,
            dst: put.data.as_ref().map(|d| d.dst.offset),
            signal: put.signal.as_ref().map(|s| s.total),
        });
        self.reach(site.peer)?;
        let windows = put.data.iter().map(|d| d.dst.id);
        if let Some(w) = windows
            .chain(put.signal.iter().map(|s| s.at.id))
            .find(|&w| self.refused.contains(&(site.peer, w)))
        {
            return Err(ExecError::Refused {
                peer: site.peer,
                why: format!("put to window {w} refused by the fake"),
            });
        }
        if let Some(d) = &put.data {
            let bytes = match &d.src {
                Source::Inline(v) => v.to_le_bytes().to_vec(),
                Source::Window(t) => self
                    .read(self.rank, t.id, t.offset, d.bytes as usize)
                    .to_vec(),
            };
            let e = Event::Data {
                peer: site.peer,
                window: d.dst.id,
                offset: d.dst.offset,
                bytes,
            };
            self.effect(site.ring, e);
        }
        let signal = put.signal.as_ref().map(|s| Event::Signal {
            peer: site.peer,
            window: s.at.id,
            offset: s.at.offset,
            add: s.add,
            total: s.total,
        });
        if self.late.puts {
            self.puts.push(Some(LatePut {
                ring: site.ring,
                done: false,
                failed: None,
                signal,
            }));
            return Ok(Issued::InFlight(Token::Put(self.puts.len() - 1)));
        }
        if let Some(e) = signal {
            self.effect(site.ring, e);
        }
        Ok(Issued::Ordered)
    }

    fn get(&mut self, site: Site, get: &Get<u32>) -> Result<Issued<Token>, ExecError> {
        self.calls.push(Call::Get {
            site,
            remote: get.remote.offset,
        });
        self.reach(site.peer)?;
        let e = Event::Got {
            peer: site.peer,
            remote: (get.remote.id, get.remote.offset),
            local: (get.local.id, get.local.offset),
            bytes: get.bytes,
        };
        if self.late.gets {
            let bytes = self
                .read(
                    site.peer,
                    get.remote.id,
                    get.remote.offset,
                    get.bytes as usize,
                )
                .to_vec();
            self.gets.push(Some((e, bytes)));
            return Ok(Issued::InFlight(Token::Get(self.gets.len() - 1)));
        }
        self.effect(site.ring, e);
        Ok(Issued::Ordered)
    }

    /// A late put's held signal takes effect when the engine finds it
    /// complete.
    fn landed(&mut self, _: Site, op: &mut Token) -> Result<bool, ExecError> {
        match *op {
            Token::Get(n) => Ok(self.gets.get(n).is_some_and(Option::is_none)),
            Token::Put(n) => {
                let Some(Some(p)) = self.puts.get_mut(n) else {
                    return Ok(true);
                };
                if let Some(e) = &p.failed {
                    return Err(e.clone());
                }
                if !p.done {
                    return Ok(false);
                }
                let (ring, signal) = (p.ring, p.signal.take());
                self.puts[n] = None;
                if let Some(e) = signal {
                    self.effect(ring, e);
                }
                Ok(true)
            }
        }
    }

    fn count(&mut self, site: Site, slot: u32, total: u64) -> Result<(), ExecError> {
        self.calls.push(Call::Count { site, slot, total });
        self.effect(site.ring, Event::Count { slot, total });
        Ok(())
    }

    fn publish(&mut self, site: Site, upto: u64) -> Result<(), ExecError> {
        self.calls.push(Call::Publish { site, upto });
        if self.fail_publish {
            return Err(ExecError::Device {
                what: "publication",
                why: "the fake failed it".into(),
            });
        }
        self.effect(
            site.ring,
            Event::Publish {
                ring: site.ring,
                upto,
            },
        );
        Ok(())
    }

    fn flush(&mut self, site: Site) -> Result<(), ExecError> {
        self.calls.push(Call::Flush { site });
        Ok(())
    }
}
