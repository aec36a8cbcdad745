//! An executor in memory, for deterministic step tests of the engine (and
//! of anything built on it): window parts, the counter array and the sink
//! are byte vectors, everything handed over is logged in order, and faults
//! are injected: a dead peer, a refused write, late reads, writes that stay
//! in flight until the test completes (or fails) them in any order, a
//! failing completion path, no atomics.

use std::collections::{BTreeMap, HashMap, HashSet};

use super::exec::{
    Atomics, Channel, CqStore, ExecError, Executor, Loc, Part, Payload, ReadStatus, ReadTicket,
    Region, WriteStatus, WriteTicket,
};
use super::mem::CqView;

/// What a [`Fake`] was handed, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A write and the bytes it wrote.
    Write {
        /// The channel.
        ch: Channel,
        /// Where.
        dst: Loc,
        /// What.
        bytes: Vec<u8>,
    },
    /// A read was issued.
    Read {
        /// The channel.
        ch: Channel,
        /// From where.
        src: Loc,
        /// To where.
        dst: Loc,
    },
    /// A late read's data landed.
    Landed {
        /// Its ticket.
        ticket: ReadTicket,
    },
    /// A fetch-add and the old value it returned.
    FetchAdd {
        /// The channel.
        ch: Channel,
        /// Where.
        at: Loc,
        /// What was added.
        add: u64,
        /// The old value.
        old: u64,
    },
    /// A compare-and-swap and the old value it returned.
    CompareSwap {
        /// The channel.
        ch: Channel,
        /// Where.
        at: Loc,
        /// The old value.
        old: u64,
    },
    /// A completion was published.
    Publish {
        /// The channel.
        ch: Channel,
        /// The stores, in order.
        stores: Vec<CqStore>,
    },
}

#[derive(Debug)]
struct FakePart {
    base: u64,
    bytes: Vec<u8>,
}

#[derive(Debug, Clone, Copy)]
struct FakeRead {
    src: Loc,
    dst: Loc,
    /// Polls left before the data lands.
    left: u32,
}

/// The executor in memory. Addresses are numbers it was given
/// ([`Fake::add_part`], [`Fake::COUNTERS`], [`Fake::SINK`]); nothing points
/// anywhere.
#[derive(Debug)]
pub struct Fake {
    rank: usize,
    parts: HashMap<(u32, usize), FakePart>,
    counters: Vec<u8>,
    sink: Vec<u8>,
    /// Everything handed over, in order.
    pub log: Vec<Event>,
    /// Passes the engine ended.
    pub passes: u64,
    dead: HashSet<usize>,
    refused: HashSet<(u32, usize)>,
    read_delay: u32,
    reads: HashMap<u64, FakeRead>,
    next_read: u64,
    late_writes: bool,
    /// Writes in flight by ticket: `Ok(done)`, or how they failed.
    writes: BTreeMap<u64, Result<bool, ExecError>>,
    next_write: u64,
    atomics: Atomics,
    publish_fails: bool,
    enter_fails: bool,
}

impl Fake {
    /// Where WQEs name the counter array.
    pub const COUNTERS: u64 = 0xc000_0000;
    /// Where WQEs name the atomic result sink.
    pub const SINK: u64 = 0xd000_0000;

    /// Rank `rank`'s executor with a counter array of `counters` bytes and
    /// a sink of `sink` bytes, native atomics, and no faults.
    pub fn new(rank: usize, counters: usize, sink: usize) -> Self {
        Self {
            rank,
            parts: HashMap::new(),
            counters: vec![0; counters],
            sink: vec![0; sink],
            log: Vec::new(),
            passes: 0,
            dead: HashSet::new(),
            refused: HashSet::new(),
            read_delay: 0,
            reads: HashMap::new(),
            next_read: 0,
            late_writes: false,
            writes: BTreeMap::new(),
            next_write: 0,
            atomics: Atomics::Native,
            publish_fails: false,
            enter_fails: false,
        }
    }

    /// Where WQEs name the counter array and the sink, for the engine's
    /// configuration.
    pub fn local_parts(&self) -> (Part, Part) {
        (
            Part {
                base: Self::COUNTERS,
                size: self.counters.len() as u64,
            },
            Part {
                base: Self::SINK,
                size: self.sink.len() as u64,
            },
        )
    }

    /// Registers `rank`'s part of window `window`: `size` zero bytes that
    /// WQEs name from address `base`.
    pub fn add_part(&mut self, window: u32, rank: usize, base: u64, size: usize) {
        let bytes = vec![0; size];
        self.parts.insert((window, rank), FakePart { base, bytes });
    }

    /// Forgets a part (its window was freed).
    pub fn remove_part(&mut self, window: u32, rank: usize) {
        self.parts.remove(&(window, rank));
    }

    /// The bytes of a part.
    pub fn bytes(&self, window: u32, rank: usize) -> &[u8] {
        self.parts.get(&(window, rank)).map_or(&[], |p| &p.bytes)
    }

    /// Writes `data` at `offset` of a part (a test's set-up).
    pub fn fill(&mut self, window: u32, rank: usize, offset: usize, data: &[u8]) {
        if let Some(p) = self.parts.get_mut(&(window, rank)) {
            p.bytes[offset..offset + data.len()].copy_from_slice(data);
        }
    }

    /// The qword at `offset` of a part, of the counters, or of the sink,
    /// as a native-endian u64 (as an `AtomicU64` there would read).
    pub fn qword(&self, region: Region, rank: usize, offset: usize) -> u64 {
        let b = match region {
            Region::Window(w) => self.bytes(w, rank),
            Region::Counters => &self.counters,
            Region::Sink => &self.sink,
        };
        b.get(offset..offset + 8)
            .map_or(0, |q| u64::from_ne_bytes(q.try_into().unwrap_or([0; 8])))
    }

    /// Every operation on `peer` fails from now on, as a dead peer's.
    pub fn kill(&mut self, peer: usize) {
        self.dead.insert(peer);
    }

    /// Writes to `rank`'s part of `window` are refused by the target.
    pub fn refuse_writes(&mut self, window: u32, rank: usize) {
        self.refused.insert((window, rank));
    }

    /// Reads land only on the `polls`-th [`Executor::read_done`] after
    /// they were issued (0: at once).
    pub fn delay_reads(&mut self, polls: u32) {
        self.read_delay = polls;
    }

    /// From now on writes of window bytes to another rank stay in flight
    /// (their data moves at once) until [`Fake::complete_write`], numbered
    /// from 0 in issue order.
    pub fn late_writes(&mut self) {
        self.late_writes = true;
    }

    /// Completes the write in flight numbered `t`.
    pub fn complete_write(&mut self, t: u64) {
        if let Some(w) = self.writes.get_mut(&t) {
            *w = Ok(true);
        }
    }

    /// Fails the write in flight numbered `t` with `e`.
    pub fn fail_write(&mut self, t: u64, e: ExecError) {
        if let Some(w) = self.writes.get_mut(&t) {
            *w = Err(e);
        }
    }

    /// Writes in flight the engine has not seen complete.
    pub fn writes_in_flight(&self) -> usize {
        self.writes.len()
    }

    /// How this executor does atomics from now on.
    pub fn set_atomics(&mut self, a: Atomics) {
        self.atomics = a;
    }

    /// Publishing completions fails from now on (a driver failure).
    pub fn fail_publish(&mut self) {
        self.publish_fails = true;
    }

    /// [`Executor::enter`] fails (a GPU context that cannot be made
    /// current).
    pub fn fail_enter(&mut self) {
        self.enter_fails = true;
    }

    fn alive(&self, peer: usize) -> Result<(), ExecError> {
        if self.dead.contains(&peer) {
            return Err(ExecError::Transport {
                peer,
                why: "the peer is dead (injected)".into(),
            });
        }
        Ok(())
    }

    /// The bytes at `l`.
    fn mem(&mut self, l: Loc) -> Result<&mut [u8], ExecError> {
        let me = self.rank;
        let (bytes, what) = match l.region {
            Region::Window(w) => (
                self.parts.get_mut(&(w, l.rank)).map(|p| &mut p.bytes),
                "window part",
            ),
            Region::Counters if l.rank == me => (Some(&mut self.counters), "counters"),
            Region::Sink if l.rank == me => (Some(&mut self.sink), "sink"),
            _ => (None, "local memory of another rank"),
        };
        let Some(bytes) = bytes else {
            return Err(ExecError::Refused {
                peer: l.rank,
                why: format!("no {what} for {:?}", l.region),
            });
        };
        let (at, len) = (l.offset as usize, l.len as usize);
        bytes
            .get_mut(at..at + len)
            .ok_or_else(|| ExecError::Malformed {
                why: format!("{len} bytes at offset {at} are outside the {what}"),
            })
    }

    fn land(&mut self, src: Loc, dst: Loc) -> Result<(), ExecError> {
        let data = self.mem(src)?.to_vec();
        self.mem(dst)?.copy_from_slice(&data);
        Ok(())
    }

    fn qword_at(&mut self, at: Loc) -> Result<(&mut [u8], u64), ExecError> {
        let m = self.mem(at)?;
        let old = u64::from_ne_bytes((&*m).try_into().map_err(|_| ExecError::Malformed {
            why: format!("an atomic on {} bytes", at.len),
        })?);
        Ok((m, old))
    }
}

impl Executor for Fake {
    type Cq = CqView;

    fn part(&mut self, window: u32, rank: usize) -> Option<Part> {
        self.parts.get(&(window, rank)).map(|p| Part {
            base: p.base,
            size: p.bytes.len() as u64,
        })
    }

    fn write(&mut self, ch: Channel, dst: Loc, src: Payload<'_>) -> Result<WriteStatus, ExecError> {
        self.alive(dst.rank)?;
        if let Region::Window(w) = dst.region
            && self.refused.contains(&(w, dst.rank))
        {
            return Err(ExecError::Refused {
                peer: dst.rank,
                why: format!("writes to window {w} are refused (injected)"),
            });
        }
        let bytes = match src {
            Payload::Bytes(b) => b.to_vec(),
            Payload::Local(l) => self.mem(l)?.to_vec(),
        };
        let m = self.mem(dst)?;
        if m.len() != bytes.len() {
            return Err(ExecError::Malformed {
                why: format!("{} bytes for a {}-byte destination", bytes.len(), m.len()),
            });
        }
        m.copy_from_slice(&bytes);
        self.log.push(Event::Write { ch, dst, bytes });
        if self.late_writes && matches!(src, Payload::Local(_)) && dst.rank != self.rank {
            let t = self.next_write;
            self.next_write += 1;
            self.writes.insert(t, Ok(false));
            return Ok(WriteStatus::Pending(WriteTicket(t)));
        }
        Ok(WriteStatus::Done)
    }

    fn write_done(&mut self, t: WriteTicket) -> Result<bool, ExecError> {
        match self.writes.get(&t.0) {
            None => Err(ExecError::Malformed {
                why: format!("no write in flight has ticket {}", t.0),
            }),
            Some(Ok(false)) => Ok(false),
            Some(_) => self.writes.remove(&t.0).unwrap_or(Ok(true)),
        }
    }

    fn read(&mut self, ch: Channel, src: Loc, dst: Loc) -> Result<ReadStatus, ExecError> {
        self.alive(src.rank)?;
        self.log.push(Event::Read { ch, src, dst });
        if self.read_delay == 0 {
            self.land(src, dst)?;
            return Ok(ReadStatus::Done);
        }
        let t = self.next_read;
        self.next_read += 1;
        let left = self.read_delay;
        self.reads.insert(t, FakeRead { src, dst, left });
        Ok(ReadStatus::Pending(ReadTicket(t)))
    }

    fn read_done(&mut self, t: ReadTicket) -> Result<bool, ExecError> {
        let Some(r) = self.reads.get_mut(&t.0) else {
            return Err(ExecError::Malformed {
                why: format!("no read in flight has ticket {}", t.0),
            });
        };
        let peer = r.src.rank;
        if let Err(e) = self.alive(peer) {
            // A dead peer's answer never comes.
            self.reads.remove(&t.0);
            return Err(e);
        }
        let Some(r) = self.reads.get_mut(&t.0) else {
            return Ok(false);
        };
        r.left = r.left.saturating_sub(1);
        if r.left > 0 {
            return Ok(false);
        }
        let r = *r;
        self.reads.remove(&t.0);
        self.land(r.src, r.dst)?;
        self.log.push(Event::Landed { ticket: t });
        Ok(true)
    }

    fn fetch_add(&mut self, ch: Channel, at: Loc, add: u64) -> Result<u64, ExecError> {
        self.alive(at.rank)?;
        let (m, old) = self.qword_at(at)?;
        m.copy_from_slice(&old.wrapping_add(add).to_ne_bytes());
        self.log.push(Event::FetchAdd { ch, at, add, old });
        Ok(old)
    }

    fn compare_swap(
        &mut self,
        ch: Channel,
        at: Loc,
        compare: u64,
        swap: u64,
    ) -> Result<u64, ExecError> {
        self.alive(at.rank)?;
        let (m, old) = self.qword_at(at)?;
        if old == compare {
            m.copy_from_slice(&swap.to_ne_bytes());
        }
        self.log.push(Event::CompareSwap { ch, at, old });
        Ok(old)
    }

    fn publish(&mut self, ch: Channel, cq: &CqView, stores: &[CqStore]) -> Result<(), ExecError> {
        if self.publish_fails || !cq.store(stores) {
            return Err(ExecError::Driver {
                why: "publishing a completion failed (injected, or outside the CQ)".into(),
            });
        }
        self.log.push(Event::Publish {
            ch,
            stores: stores.to_vec(),
        });
        Ok(())
    }

    fn end_pass(&mut self, _: Channel) -> Result<(), ExecError> {
        self.passes += 1;
        Ok(())
    }

    fn confirm(&self, peer: usize) -> Result<(), ExecError> {
        self.alive(peer)
    }

    fn health(&self) -> Result<(), ExecError> {
        match self.dead.iter().min() {
            Some(&p) => self.alive(p),
            None => Ok(()),
        }
    }

    fn atomics(&self) -> Atomics {
        self.atomics
    }

    fn enter(&mut self) -> Result<(), ExecError> {
        if self.enter_fails {
            return Err(ExecError::Driver {
                why: "entering failed (injected)".into(),
            });
        }
        Ok(())
    }
}
