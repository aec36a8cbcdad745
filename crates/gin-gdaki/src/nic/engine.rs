//! The soft NIC's state machine: no threads, no sleeps, no clocks. Each
//! [`Engine::step`] takes up to a batch of WQEs from every queue, checks
//! and executes them through an [`Executor`], writes their completions,
//! and says what it did; a driver ([`crate::nic::SoftNic`]) or a test calls
//! it.
//!
//! Completions are in order. A write the executor reports in flight
//! ([`WriteStatus::Pending`]: a write from GPU memory the transport still
//! reads) does not hold the queue: later WQEs execute, but their
//! completions (and errors, and flushes) wait behind it, in order, until
//! the executor says it completed ([`Executor::write_done`], polled every
//! step, never waited for); a WAIT on the queue's CQ sees only what was
//! completed. A read in flight holds the queue at its WQE.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use super::exec::{Channel, CqStore, ExecError, Executor, Part, ReadTicket, Region, WriteTicket};
use super::fault::{Cause, FaultLog, QpFault};
use super::mem::SqView;
use crate::completion::{CQE_BYTES, CQE_REQ, CQE_REQ_ERR, Cqe, syndrome};
use crate::ids::MAX_QPN;
use crate::queue::{producer_index, wire_index};
use crate::wqe::{BB, CQ_UPDATE};

/// How a queue reports completions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CqMode {
    /// A ring of `2^log2` CQEs with owner bits, one per completed WQE that
    /// asked for one, error CQEs for every WQE flushed after a failure (CPU
    /// ranks; what rdma-core creates).
    Ring {
        /// log2 of the ring's CQEs: at least the send queue's, so that the
        /// ring cannot overflow.
        log2: u32,
    },
    /// One CQE, overwritten: the newest completion of each pass, or the
    /// first error, which stays (CUDA ranks; NVSHMEM's IBGDA CQs).
    Collapsed,
}

/// One send queue the engine serves, with its attributes.
#[derive(Debug)]
pub struct QueueSpec<C> {
    /// The QP number WQEs must carry (24 bits).
    pub qpn: u32,
    /// The number WAITs name this queue's CQ by.
    pub cqn: u32,
    /// The rank its remote operations reach (this rank for a loopback QP).
    pub peer: usize,
    /// The executor's ordering domain for its work and completions; a WAIT
    /// may only name a CQ of the same channel.
    pub channel: Channel,
    /// How it reports completions.
    pub cq_mode: CqMode,
    /// The send queue and doorbell record.
    pub sq: SqView,
    /// The completion queue, as the executor writes it.
    pub cq: C,
}

/// What the engine serves and how it names local memory.
#[derive(Debug, Clone, Copy)]
pub struct EngineConfig {
    /// This rank.
    pub rank: usize,
    /// Ranks in the job (what window keys are decoded with).
    pub nranks: usize,
    /// Where WQEs name the counter array ([`crate::ids::COUNTER_KEY`]).
    pub counters: Part,
    /// Where WQEs name the atomic result sink ([`crate::ids::SINK_KEY`]).
    pub sink: Part,
    /// WQEs taken from one queue per step before moving to the next.
    pub batch: u64,
}

/// Why an engine cannot be built, or stopped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// A QP number that does not fit the 24 bits WQEs carry.
    #[error("rank {rank}: QP number {qpn:#x} does not fit 24 bits")]
    Qpn {
        /// This rank.
        rank: usize,
        /// The number.
        qpn: u32,
    },
    /// Two queues with the same CQ number.
    #[error("rank {rank}: two queues complete into CQ {cqn:#x}")]
    DuplicateCq {
        /// This rank.
        rank: usize,
        /// The number.
        cqn: u32,
    },
    /// A queue reaching a rank outside the job.
    #[error("rank {rank}: QP {qpn:#x} reaches rank {peer}, but the job has {nranks} ranks")]
    BadPeer {
        /// This rank.
        rank: usize,
        /// The queue.
        qpn: u32,
        /// The rank it names.
        peer: usize,
        /// Ranks in the job.
        nranks: usize,
    },
    /// A ring CQ smaller than its send queue, which could overflow.
    #[error("rank {rank}: QP {qpn:#x} has a CQ of 2^{cq_log2} entries for 2^{sq_log2} WQEs")]
    CqTooSmall {
        /// This rank.
        rank: usize,
        /// The queue.
        qpn: u32,
        /// log2 of the CQ's entries.
        cq_log2: u32,
        /// log2 of the send queue's entries.
        sq_log2: u32,
    },
    /// The executor failed while publishing a completion or ending a pass:
    /// the engine cannot report completions any more.
    #[error("rank {rank}: QP {qpn:#x}: {source}")]
    Executor {
        /// This rank.
        rank: usize,
        /// The queue being served.
        qpn: u32,
        /// What failed.
        source: ExecError,
    },
}

/// What one [`Engine::step`] did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Progress {
    /// WQEs consumed (executed, or flushed in error).
    pub consumed: u64,
    /// Completions (or errors, or flushes) of WQEs behind writes in flight
    /// that were reported now, writes in flight included.
    pub landed: u64,
    /// Error completions written, in order (at most one per queue: later
    /// WQEs of a failed queue are flushed, not reported again).
    pub faults: Vec<QpFault>,
}

/// A WQE that could not be executed: its syndrome and why.
#[derive(Debug)]
pub(super) struct Fail {
    syndrome: u8,
    cause: Cause,
}

impl Fail {
    pub(super) fn new(syndrome: u8, cause: Cause) -> Self {
        Self { syndrome, cause }
    }

    pub(super) fn exec(e: ExecError) -> Self {
        let syndrome = match &e {
            ExecError::Transport { .. } => syndrome::TRANSPORT_RETRY_EXC_ERR,
            ExecError::Refused { .. } => syndrome::REMOTE_ACCESS_ERR,
            ExecError::Unsupported { .. } => syndrome::REMOTE_OP_ERR,
            ExecError::Malformed { .. } | ExecError::Driver { .. } => syndrome::LOCAL_QP_OP_ERR,
        };
        Self::new(syndrome, Cause::Exec(e))
    }
}

/// How executing one WQE went.
pub(super) enum Outcome {
    /// Done; `byte_cnt` for its CQE.
    Done(u32),
    /// A WAIT whose condition does not hold yet: try again next step.
    Blocked,
    /// A read whose data is on its way.
    Pending(ReadTicket, u32),
    /// A write in flight (`byte_cnt` for its CQE once it completed).
    InFlight(WriteTicket, u32),
}

/// What a WQE behind a write in flight does once everything before it
/// completed.
#[derive(Debug)]
enum Then {
    /// Completes well: its CQE, if it asked for one.
    Complete {
        send_opcode: u8,
        byte_cnt: u32,
        cq_update: bool,
    },
    /// Fails: the queue's error CQE.
    Fail { send_opcode: u8, fail: Fail },
    /// Flushed in error (the queue failed before it).
    Flush,
}

/// A WQE whose completion waits: for its own write in flight (`ticket`),
/// or for those before it.
#[derive(Debug)]
struct Flight {
    index: u64,
    ticket: Option<WriteTicket>,
    then: Then,
}

/// A read the queue waits for before anything after it.
#[derive(Debug, Clone, Copy)]
struct PendingRead {
    index: u64,
    ticket: ReadTicket,
    send_opcode: u8,
    byte_cnt: u32,
    cq_update: bool,
}

/// The engine's state of one queue.
#[derive(Debug)]
pub(super) struct Queue<C> {
    pub(super) spec: QueueSpec<C>,
    /// The next WQE to execute.
    ci: u64,
    /// One past the WQE index of the newest completion handed to the
    /// executor (what a WAIT on this CQ compares with).
    pub(super) published: u64,
    /// CQEs written to a ring CQ (its producer index).
    cqes: u64,
    pub(super) failed: bool,
    /// A failure waits behind writes in flight: nothing more executes.
    failing: bool,
    pending: Option<PendingRead>,
    /// WQEs whose completions wait behind writes in flight, in order.
    flights: VecDeque<Flight>,
    /// Collapsed CQ: the newest success of this pass, published at its end.
    newest: Option<(u64, Cqe)>,
}

/// The soft mlx5 NIC as a state machine over queues whose completions
/// land in `C` (an [`Executor::Cq`]).
#[derive(Debug)]
pub struct Engine<C> {
    pub(super) cfg: EngineConfig,
    pub(super) queues: Vec<Queue<C>>,
    pub(super) by_cqn: HashMap<u32, usize>,
    /// Running totals by target, for executors without atomics.
    pub(super) totals: HashMap<(usize, Region, u64), u64>,
    faults: Arc<FaultLog>,
}

impl<C> Engine<C> {
    /// An engine serving `queues`, in that order, every step.
    pub fn new(cfg: EngineConfig, queues: Vec<QueueSpec<C>>) -> Result<Self, EngineError> {
        let rank = cfg.rank;
        let mut by_cqn = HashMap::new();
        for (i, q) in queues.iter().enumerate() {
            if q.qpn > MAX_QPN {
                return Err(EngineError::Qpn { rank, qpn: q.qpn });
            }
            if q.peer >= cfg.nranks {
                return Err(EngineError::BadPeer {
                    rank,
                    qpn: q.qpn,
                    peer: q.peer,
                    nranks: cfg.nranks,
                });
            }
            if let CqMode::Ring { log2 } = q.cq_mode
                && log2 < q.sq.log2()
            {
                return Err(EngineError::CqTooSmall {
                    rank,
                    qpn: q.qpn,
                    cq_log2: log2,
                    sq_log2: q.sq.log2(),
                });
            }
            if by_cqn.insert(q.cqn, i).is_some() {
                return Err(EngineError::DuplicateCq { rank, cqn: q.cqn });
            }
        }
        let faults = Arc::new(FaultLog::new(queues.len()));
        let queues = queues
            .into_iter()
            .map(|spec| Queue {
                spec,
                ci: 0,
                published: 0,
                cqes: 0,
                failed: false,
                failing: false,
                pending: None,
                flights: VecDeque::new(),
                newest: None,
            })
            .collect();
        Ok(Self {
            cfg: EngineConfig {
                batch: cfg.batch.max(1),
                ..cfg
            },
            queues,
            by_cqn,
            totals: HashMap::new(),
            faults,
        })
    }

    /// The queues' first error completions, for other threads.
    pub fn fault_log(&self) -> Arc<FaultLog> {
        self.faults.clone()
    }

    /// Queues served.
    pub fn queues(&self) -> usize {
        self.queues.len()
    }

    /// Queue `i`'s spec.
    pub fn spec(&self, i: usize) -> Option<&QueueSpec<C>> {
        self.queues.get(i).map(|q| &q.spec)
    }

    /// Queue `i`'s consumer index: the next WQE it will execute.
    pub fn consumer_index(&self, i: usize) -> Option<u64> {
        self.queues.get(i).map(|q| q.ci)
    }

    /// Whether queue `i` is in the error state.
    pub fn is_failed(&self, i: usize) -> bool {
        self.queues.get(i).is_some_and(|q| q.failed)
    }

    /// Whether a step would find something to do: a read or write in
    /// flight, or a queue whose doorbell record names WQEs not consumed yet
    /// (a WAIT that is still blocked counts).
    pub fn has_work(&self) -> bool {
        self.queues.iter().any(|q| {
            q.pending.is_some()
                || !q.flights.is_empty()
                || producer_index(q.spec.sq.producer16(), q.ci, q.spec.sq.size())
                    .is_ok_and(|pi| pi != q.ci)
        })
    }

    /// WQEs whose completions wait behind writes in flight, over every
    /// queue (a driver asked to stop drains them first).
    pub fn in_flight(&self) -> usize {
        self.queues.iter().map(|q| q.flights.len()).sum()
    }

    /// Serves every queue once: up to [`EngineConfig::batch`] WQEs each.
    /// An `Err` means the executor can no longer publish completions; the
    /// engine should not be stepped again.
    pub fn step<E: Executor<Cq = C>>(&mut self, ex: &mut E) -> Result<Progress, EngineError> {
        let mut p = Progress::default();
        for i in 0..self.queues.len() {
            self.serve(i, ex, &mut p)?;
        }
        Ok(p)
    }

    /// Executes what queue `i` has posted.
    fn serve<E: Executor<Cq = C>>(
        &mut self,
        i: usize,
        ex: &mut E,
        p: &mut Progress,
    ) -> Result<(), EngineError> {
        let mut touched = self.land(i, ex, p)?;
        if let Some(r) = self.queues[i].pending {
            let then = match ex.read_done(r.ticket) {
                Ok(false) => return self.end_pass(i, touched, ex),
                Ok(true) => Then::Complete {
                    send_opcode: r.send_opcode,
                    byte_cnt: r.byte_cnt,
                    cq_update: r.cq_update,
                },
                Err(e) => Then::Fail {
                    send_opcode: r.send_opcode,
                    fail: Fail::exec(e),
                },
            };
            self.queues[i].pending = None;
            self.later(i, r.index, then, ex, p)?;
            touched = true;
        }
        let q = &self.queues[i];
        let pi = match producer_index(q.spec.sq.producer16(), q.ci, q.spec.sq.size()) {
            Ok(pi) => pi,
            Err(bad) => {
                // Hardware's answer to a doorbell record it cannot believe:
                // the QP moves to the error state with one error CQE, and
                // nothing past the consumer index executes (executing the
                // phantom WQEs would also overrun the CQ and lose the very
                // completions that report the error).
                if !q.failed && !q.failing {
                    let fail = Fail::new(syndrome::LOCAL_QP_OP_ERR, Cause::ProducerIndex(bad));
                    let then = Then::Fail {
                        send_opcode: 0,
                        fail,
                    };
                    self.later(i, bad.ci, then, ex, p)?;
                    touched = true;
                }
                return self.end_pass(i, touched, ex);
            }
        };
        let mut n = 0;
        while self.queues[i].ci != pi && n < self.cfg.batch {
            let idx = self.queues[i].ci;
            let bytes = self.queues[i].spec.sq.read_wqe(idx);
            let stop = self.consume(i, idx, &bytes, ex, p)?;
            if stop == Consumed::Blocked {
                break;
            }
            self.queues[i].ci = idx + 1;
            n += 1;
            if stop == Consumed::Held {
                break;
            }
        }
        p.consumed += n;
        // Writes that completed as they were issued report now.
        let landed = self.land(i, ex, p)?;
        self.end_pass(i, touched || n > 0 || landed, ex)
    }

    /// Executes (or, in the error state, flushes) the WQE at `idx` of
    /// queue `i`.
    fn consume<E: Executor<Cq = C>>(
        &mut self,
        i: usize,
        idx: u64,
        bytes: &[u8; BB],
        ex: &mut E,
        p: &mut Progress,
    ) -> Result<Consumed, EngineError> {
        let (send_opcode, cq_update) = (bytes[3], bytes[11] & CQ_UPDATE != 0);
        if self.queues[i].failed || self.queues[i].failing {
            // Error state: everything left completes as flushed (a
            // collapsed CQ keeps showing the first error).
            self.later(i, idx, Then::Flush, ex, p)?;
            return Ok(Consumed::Next);
        }
        match self.execute(i, idx, bytes, ex) {
            Ok(Outcome::Blocked) => Ok(Consumed::Blocked),
            Ok(Outcome::Done(byte_cnt)) => {
                let then = Then::Complete {
                    send_opcode,
                    byte_cnt,
                    cq_update,
                };
                self.later(i, idx, then, ex, p)?;
                Ok(Consumed::Next)
            }
            Ok(Outcome::InFlight(ticket, byte_cnt)) => {
                // Later WQEs execute; their completions wait behind it.
                self.queues[i].flights.push_back(Flight {
                    index: idx,
                    ticket: Some(ticket),
                    then: Then::Complete {
                        send_opcode,
                        byte_cnt,
                        cq_update,
                    },
                });
                Ok(Consumed::Next)
            }
            Ok(Outcome::Pending(ticket, byte_cnt)) => {
                // Later WQEs wait: completions stay in order.
                self.queues[i].pending = Some(PendingRead {
                    index: idx,
                    ticket,
                    send_opcode,
                    byte_cnt,
                    cq_update,
                });
                Ok(Consumed::Held)
            }
            Err(fail) => {
                self.later(i, idx, Then::Fail { send_opcode, fail }, ex, p)?;
                Ok(Consumed::Next)
            }
        }
    }

    /// What happens to the WQE at `idx` of queue `i` once everything
    /// before it completed: now, or, behind writes in flight, when they
    /// have (a failure stops execution at once all the same).
    fn later<E: Executor<Cq = C>>(
        &mut self,
        i: usize,
        idx: u64,
        then: Then,
        ex: &mut E,
        p: &mut Progress,
    ) -> Result<(), EngineError> {
        let q = &mut self.queues[i];
        if q.flights.is_empty() {
            return self.act(i, idx, then, ex, p);
        }
        q.failing |= matches!(then, Then::Fail { .. });
        q.flights.push_back(Flight {
            index: idx,
            ticket: None,
            then,
        });
        Ok(())
    }

    /// Reports what the WQE at `idx` of queue `i` came to; in the error
    /// state, a completion or a later error is a flush.
    fn act<E: Executor<Cq = C>>(
        &mut self,
        i: usize,
        idx: u64,
        then: Then,
        ex: &mut E,
        p: &mut Progress,
    ) -> Result<(), EngineError> {
        match then {
            _ if self.queues[i].failed => self.flushed(i, idx, ex),
            Then::Complete {
                send_opcode,
                byte_cnt,
                cq_update,
            } => {
                if cq_update {
                    self.complete(i, idx, send_opcode, byte_cnt, ex)?;
                }
                Ok(())
            }
            Then::Fail { send_opcode, fail } => self.fail(i, idx, send_opcode, fail, ex, p),
            Then::Flush => self.flushed(i, idx, ex),
        }
    }

    /// Reports, in order, the WQEs of queue `i` whose completions waited
    /// behind writes in flight, up to the first write still in flight
    /// (asked without waiting); a write that failed fails the queue there,
    /// and what follows it is flushed. Whether anything was reported.
    fn land<E: Executor<Cq = C>>(
        &mut self,
        i: usize,
        ex: &mut E,
        p: &mut Progress,
    ) -> Result<bool, EngineError> {
        let mut touched = false;
        while let Some(f) = self.queues[i].flights.front() {
            // Once the queue failed, what is behind the failure is flushed
            // without asking whether its writes completed: the producer saw
            // the error CQE (a collapsed CQ shows only the newest, and a
            // flush reports no success), so it reuses no source on the
            // strength of these; the writes' sources stay lent to the
            // transport until the executor's quiesce (or drop) completes
            // every write still in flight, and windows stay alive until
            // then (their keep-alive goes with each write).
            let failed = match f.ticket {
                Some(t) if !self.queues[i].failed => match ex.write_done(t) {
                    Ok(false) => break,
                    Ok(true) => None,
                    Err(e) => Some(Fail::exec(e)),
                },
                _ => None,
            };
            let Some(f) = self.queues[i].flights.pop_front() else {
                break;
            };
            let then = match (failed, f.then) {
                (Some(fail), Then::Complete { send_opcode, .. }) => {
                    Then::Fail { send_opcode, fail }
                }
                (_, then) => then,
            };
            self.act(i, f.index, then, ex, p)?;
            p.landed += 1;
            touched = true;
        }
        Ok(touched)
    }

    /// Publishes a collapsed CQ's newest completion, then lets the
    /// executor hand over the pass's work.
    fn end_pass<E: Executor<Cq = C>>(
        &mut self,
        i: usize,
        touched: bool,
        ex: &mut E,
    ) -> Result<(), EngineError> {
        if let Some((idx, cqe)) = self.queues[i].newest.take() {
            // Only the newest CQE is visible, so one store per pass reports
            // them all, after the pass's work.
            let bytes = cqe.encode(idx, self.queues[i].spec.sq.log2());
            self.publish(i, &[store(&bytes, 7)], ex)?;
            self.queues[i].published = idx + 1;
        }
        if touched {
            let ch = self.queues[i].spec.channel;
            ex.end_pass(ch)
                .map_err(|source| self.exec_error(i, source))?;
        }
        Ok(())
    }

    fn exec_error(&self, i: usize, source: ExecError) -> EngineError {
        EngineError::Executor {
            rank: self.cfg.rank,
            qpn: self.queues[i].spec.qpn,
            source,
        }
    }

    fn publish<E: Executor<Cq = C>>(
        &self,
        i: usize,
        stores: &[CqStore],
        ex: &mut E,
    ) -> Result<(), EngineError> {
        let q = &self.queues[i];
        ex.publish(q.spec.channel, &q.spec.cq, stores)
            .map_err(|source| self.exec_error(i, source))
    }

    /// Writes a ring CQ's next CQE.
    fn push<E: Executor<Cq = C>>(
        &mut self,
        i: usize,
        log2: u32,
        cqe: &Cqe,
        ex: &mut E,
    ) -> Result<(), EngineError> {
        let n = self.queues[i].cqes;
        let bytes = cqe.encode(n, log2);
        let at = (n & ((1 << log2) - 1)) as usize * CQE_BYTES;
        let stores: [CqStore; 8] = std::array::from_fn(|q| CqStore {
            offset: at + q * 8,
            ..store(&bytes, q)
        });
        self.publish(i, &stores, ex)?;
        self.queues[i].cqes = n + 1;
        Ok(())
    }

    /// The WQE at `idx` completed well.
    fn complete<E: Executor<Cq = C>>(
        &mut self,
        i: usize,
        idx: u64,
        send_opcode: u8,
        byte_cnt: u32,
        ex: &mut E,
    ) -> Result<(), EngineError> {
        let cqe = Cqe {
            opcode: CQE_REQ,
            wqe_counter: wire_index(idx),
            qpn: self.queues[i].spec.qpn,
            send_opcode,
            byte_cnt,
            syndrome: 0,
            vendor_syndrome: 0,
        };
        match self.queues[i].spec.cq_mode {
            CqMode::Ring { log2 } => {
                self.push(i, log2, &cqe, ex)?;
                self.queues[i].published = idx + 1;
            }
            CqMode::Collapsed => self.queues[i].newest = Some((idx, cqe)),
        }
        Ok(())
    }

    /// A WQE after the QP entered the error state: flushed in error.
    fn flushed<E: Executor<Cq = C>>(
        &mut self,
        i: usize,
        idx: u64,
        ex: &mut E,
    ) -> Result<(), EngineError> {
        if let CqMode::Ring { log2 } = self.queues[i].spec.cq_mode {
            let cqe = error_cqe(idx, self.queues[i].spec.qpn, 0, syndrome::WR_FLUSH_ERR);
            self.push(i, log2, &cqe, ex)?;
            self.queues[i].published = idx + 1;
        }
        Ok(())
    }

    /// Moves queue `i` to the error state with an error CQE for `idx`.
    fn fail<E: Executor<Cq = C>>(
        &mut self,
        i: usize,
        idx: u64,
        send_opcode: u8,
        fail: Fail,
        ex: &mut E,
        p: &mut Progress,
    ) -> Result<(), EngineError> {
        let q = &mut self.queues[i];
        q.failed = true;
        // The error supersedes this pass's successes on a collapsed CQ.
        q.newest = None;
        q.published = idx + 1;
        let fault = QpFault {
            queue: i,
            qpn: q.spec.qpn,
            peer: q.spec.peer,
            index: idx,
            syndrome: fail.syndrome,
            cause: fail.cause,
        };
        // Before the CQE: whoever sees it finds the reason.
        self.faults.record(&fault);
        let cqe = error_cqe(idx, q.spec.qpn, send_opcode, fault.syndrome);
        match q.spec.cq_mode {
            CqMode::Ring { log2 } => self.push(i, log2, &cqe, ex)?,
            CqMode::Collapsed => {
                // Syndrome first, then the qword the poller checks.
                let bytes = cqe.encode(idx, q.spec.sq.log2());
                self.publish(i, &[store(&bytes, 6), store(&bytes, 7)], ex)?;
            }
        }
        p.faults.push(fault);
        Ok(())
    }
}

/// How consuming a WQE went, for the pass over its queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Consumed {
    /// Consumed; go on.
    Next,
    /// Consumed, but later WQEs wait (a read in flight).
    Held,
    /// Not consumed (a blocked WAIT).
    Blocked,
}

/// Qword `q` of a CQE, as the store at its offset in a one-entry CQ.
fn store(bytes: &[u8; CQE_BYTES], q: usize) -> CqStore {
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[q * 8..q * 8 + 8]);
    CqStore {
        offset: q * 8,
        bytes: b,
    }
}

fn error_cqe(idx: u64, qpn: u32, send_opcode: u8, syn: u8) -> Cqe {
    Cqe {
        opcode: CQE_REQ_ERR,
        wqe_counter: wire_index(idx),
        qpn,
        send_opcode,
        byte_cnt: 0,
        syndrome: syn,
        vendor_syndrome: 0,
    }
}
