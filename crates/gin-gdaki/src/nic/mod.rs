//! soft-mlx5: a NIC in software, once, for CPU and CUDA ranks.
//!
//! - **The engine** ([`Engine`]) is a state machine: each step reads every
//!   queue's doorbell record, parses the very WQE bytes the producer wrote,
//!   checks keys, bounds and access, executes through an [`Executor`], and
//!   writes CQEs. A violation produces an error CQE carrying the mlx5
//!   syndrome and moves the QP to the error state; every later WQE on it
//!   completes as flushed in error, as hardware does. It owns WAIT on the
//!   companion queue, 16-bit WQE counters, the two CQ models ([`CqMode`]),
//!   in-order completion behind writes in flight ([`WriteStatus::Pending`]:
//!   later WQEs execute, their CQEs wait), and the running totals an
//!   executor without atomics needs.
//! - **Executors** move bytes: gin-net's fabric on CPU ranks
//!   ([`FabricExecutor`]), CUDA streams on CUDA ranks ([`crate::cuda`]), and an in-memory
//!   [`Fake`] with injectable faults, which the step tests drive the engine
//!   with, deterministically.
//! - **Queue memory** is read through views ([`SqView`], [`CqView`]) that
//!   cover a QP in this process and memory a GPU writes alike.
//! - **The driver** ([`SoftNic`]) is one thread stepping an engine: start,
//!   stop, the first error, and the idle policy (spin, then yield, then
//!   sleep until a doorbell wakes it or the nap ends).

mod engine;
mod exec;
mod fabric;
mod fake;
mod fault;
mod mem;
mod ops;
#[cfg(test)]
mod tests;

pub use engine::{CqMode, Engine, EngineConfig, EngineError, Progress, QueueSpec};
pub use exec::{
    Atomics, Channel, CqStore, ExecError, Executor, Loc, Part, Payload, ReadStatus, ReadTicket,
    Region, SoleWriter, WriteStatus, WriteTicket,
};
pub use fabric::{FabricExecutor, SINK_QWORDS, Sink};
pub use fake::{Event, Fake};
pub use fault::{Access, Cause, FaultLog, QpFault};
pub use mem::{CqView, SqView, ViewError};

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use gin_net::idle::{Sleeper, join_within};

/// How an idle driver waits for work: spin a few times, then yield the
/// core for a while, then sleep (a doorbell's [`Waker::wake`] ends a sleep
/// early).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Idle {
    /// Empty steps spent spinning.
    pub spins: u32,
    /// How long after the last work the driver yields rather than sleeps.
    pub yield_for: Duration,
    /// The longest sleep.
    pub nap: Duration,
}

impl Idle {
    /// CPU ranks: 64 spins, yield for `spin`, then sleep up to 2 ms or
    /// until a doorbell.
    pub fn cpu(spin: Duration) -> Self {
        Self {
            spins: 64,
            yield_for: spin,
            nap: Duration::from_millis(2),
        }
    }

    /// CUDA ranks: a kernel rings by storing to mapped host memory, which
    /// wakes no thread, and a GPU rank owns its CPU cores, so poll for at
    /// least 5 ms (a kernel in a ping-pong posts again within microseconds),
    /// then look every 50 µs.
    pub fn gpu(spin: Duration) -> Self {
        Self {
            spins: 64,
            yield_for: spin.max(Duration::from_millis(5)),
            nap: Duration::from_micros(50),
        }
    }
}

/// How a driver runs.
#[derive(Debug, Clone)]
pub struct DriverConfig {
    /// The thread's name, and the NIC's in errors.
    pub name: String,
    /// The idle policy.
    pub idle: Idle,
    /// Whether a stop first executes everything posted (a kernel may end
    /// right after a signal a peer waits for), or stops at once.
    pub drain_on_stop: bool,
    /// How long a stop waits for the thread; a thread still busy then is
    /// abandoned (it owns what it touches through `Arc`s).
    pub join_within: Duration,
}

/// Why a driver reports failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DriverError {
    /// A QP completed a WQE in error (the first such error).
    #[error("{nic}: {fault}")]
    Fault {
        /// The NIC.
        nic: String,
        /// The error completion.
        fault: QpFault,
    },
    /// The engine stopped (its executor cannot publish completions).
    #[error("{nic} stopped: {source}")]
    Stopped {
        /// The NIC.
        nic: String,
        /// Why.
        source: EngineError,
    },
    /// The executor could not start on the driver thread, or could not
    /// wait for its work at the end ([`Executor::enter`],
    /// [`Executor::quiesce`]).
    #[error("{nic}: {source}")]
    Executor {
        /// The NIC.
        nic: String,
        /// Why.
        source: ExecError,
    },
}

#[derive(Debug)]
struct Shared {
    name: String,
    stop: AtomicBool,
    sleeper: Sleeper,
    executed: AtomicU64,
    /// The first error completion of each queue.
    faults: Arc<FaultLog>,
    first: Mutex<Option<DriverError>>,
}

impl Shared {
    fn record(&self, e: DriverError) {
        let mut g = self.first.lock().unwrap_or_else(PoisonError::into_inner);
        if g.is_none() {
            *g = Some(e);
        }
    }

    fn faults(&self, p: Progress) {
        for f in p.faults {
            tracing::warn!(nic = %self.name, "{f}; the QP moved to the error state");
            self.record(DriverError::Fault {
                nic: self.name.clone(),
                fault: f,
            });
        }
    }
}

/// Wakes a sleeping NIC (what a doorbell write does to hardware).
#[derive(Debug, Clone)]
pub struct Waker(Arc<Shared>);

impl Waker {
    /// Wakes the driver if it sleeps.
    pub fn wake(&self) {
        self.0.sleeper.wake();
    }
}

/// A running soft NIC: one thread stepping an [`Engine`] over an
/// [`Executor`]. Dropping it stops the thread.
#[derive(Debug)]
pub struct SoftNic {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    join_within: Duration,
}

impl SoftNic {
    /// Starts a thread stepping `engine` over `exec`.
    pub fn start<E>(engine: Engine<E::Cq>, exec: E, cfg: DriverConfig) -> std::io::Result<Self>
    where
        E: Executor + Send + 'static,
        E::Cq: Send + 'static,
    {
        let shared = Arc::new(Shared {
            name: cfg.name.clone(),
            stop: AtomicBool::new(false),
            sleeper: Sleeper::default(),
            executed: AtomicU64::new(0),
            faults: engine.fault_log(),
            first: Mutex::new(None),
        });
        let s = shared.clone();
        let (idle, drain) = (cfg.idle, cfg.drain_on_stop);
        let handle = thread::Builder::new()
            .name(cfg.name.clone())
            .spawn(move || run(&s, engine, exec, idle, drain))?;
        shared.sleeper.set_thread(handle.thread().clone());
        Ok(Self {
            shared,
            thread: Some(handle),
            join_within: cfg.join_within,
        })
    }

    /// What producers call after ringing a doorbell.
    pub fn waker(&self) -> Waker {
        Waker(self.shared.clone())
    }

    /// WQEs consumed so far.
    pub fn executed(&self) -> u64 {
        self.shared.executed.load(Ordering::Relaxed)
    }

    /// Whether the thread is still running.
    pub fn alive(&self) -> bool {
        self.thread.as_ref().is_some_and(|h| !h.is_finished())
    }

    /// The first error completion of queue `queue` (the engine's order).
    pub fn fault(&self, queue: usize) -> Option<QpFault> {
        self.shared.faults.get(queue).cloned()
    }

    /// The first error this NIC met: an error completion, or why it stopped.
    ///
    /// An error completion is logged per queue before its CQE is published
    /// and reported here from that log too, so whoever saw the CQE (a
    /// kernel that ended on it) finds the reason even before the thread
    /// has finished its pass and recorded the fault as its first error.
    pub fn first_error(&self) -> Option<DriverError> {
        let first = self
            .shared
            .first
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        first.or_else(|| {
            self.shared.faults.any().map(|f| DriverError::Fault {
                nic: self.shared.name.clone(),
                fault: f.clone(),
            })
        })
    }

    /// Stops the thread (draining first if so configured) and reports the
    /// first error it met.
    pub fn stop(mut self) -> Result<(), DriverError> {
        self.halt();
        self.first_error().map_or(Ok(()), Err)
    }

    fn halt(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.sleeper.unpark();
        if let Some(h) = self.thread.take() {
            // Bounded by the timeout every blocking call of an executor
            // honours; a thread stuck anyway is abandoned.
            join_within(h, self.join_within, &self.shared.name);
        }
    }
}

impl Drop for SoftNic {
    fn drop(&mut self) {
        self.halt();
    }
}

/// The driver thread: enter, step (and wait when there is nothing to
/// do), then quiesce.
fn run<E: Executor>(s: &Shared, mut engine: Engine<E::Cq>, mut exec: E, idle: Idle, drain: bool) {
    let executor_failed = |source: ExecError| {
        tracing::error!(nic = %s.name, "{source}");
        s.record(DriverError::Executor {
            nic: s.name.clone(),
            source,
        });
    };
    if let Err(e) = exec.enter() {
        executor_failed(e);
        return;
    }
    serve(s, &mut engine, &mut exec, idle, drain);
    if let Err(e) = exec.quiesce() {
        executor_failed(e);
    }
    tracing::debug!(nic = %s.name, executed = s.executed.load(Ordering::Relaxed), "soft NIC stopped");
}

/// Steps `engine` until asked to stop (after draining, if so configured)
/// or until it cannot go on.
fn serve<E: Executor>(
    s: &Shared,
    engine: &mut Engine<E::Cq>,
    exec: &mut E,
    idle: Idle,
    drain: bool,
) {
    let mut idle_since: Option<Instant> = None;
    let mut spins = 0u32;
    loop {
        let stopping = s.stop.load(Ordering::Acquire);
        if stopping && !drain {
            break;
        }
        let p = match engine.step(exec) {
            Ok(p) => p,
            Err(source) => {
                tracing::error!(nic = %s.name, "{source}");
                s.record(DriverError::Stopped {
                    nic: s.name.clone(),
                    source,
                });
                break;
            }
        };
        // WQEs consumed: one that waited behind a write in flight was
        // consumed once, and landing later is progress, not a second WQE.
        let did = p.consumed + p.landed;
        s.executed.fetch_add(p.consumed, Ordering::Relaxed);
        s.faults(p);
        if did > 0 {
            idle_since = None;
            spins = 0;
            continue;
        }
        if stopping && engine.in_flight() == 0 {
            // Drained: a pass found nothing to execute, and nothing waits
            // behind a write in flight.
            break;
        }
        let since = *idle_since.get_or_insert_with(Instant::now);
        spins = spins.saturating_add(1);
        if spins < idle.spins {
            std::hint::spin_loop();
        } else if since.elapsed() < idle.yield_for || engine.has_work() {
            // Recently busy, or a WAIT, a read or a write in flight to poll.
            thread::yield_now();
        } else {
            s.sleeper.sleep(idle.nap, || engine.has_work());
        }
    }
}
