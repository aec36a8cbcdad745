//! The one thread that runs an [`Engine`], for CPU ranks and CUDA ranks: start, stop (after draining what is queued), the first
//! error, and the idle policy (spin, then yield, then sleep until a
//! producer wakes it).
//!
//! The engine and its executor sit behind a lock the thread takes for each
//! step. A CPU rank's producer may take it too ([`Shared::try_step_rings`],
//! gin-proxy's CPU backend under `auto`): it then executes the ring it
//! wrote to, or lands what its flush waits for, on its own thread, with
//! the same engine, instead of handing the work to the driver thread and
//! waiting for it to be scheduled. One step at a time, whoever runs it, so
//! every guarantee of the engine (ring order, in-order completion and
//! counters, fail-stop) holds whichever thread steps.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use gin_net::idle::{Sleeper, join_within};

use crate::engine::Engine;
use crate::error::{ExecError, FirstError, ProxyError};
use crate::executor::Executor;

/// How an idle driver waits for work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdlePolicy {
    /// Empty polls spent spinning before yielding.
    pub spins: u32,
    /// How long an idle driver keeps polling (yielding between polls)
    /// before it sleeps. While a get is in flight it never sleeps.
    pub yield_for: Duration,
    /// The longest sleep; a producer's [`Driver::wake`] ends it sooner.
    pub sleep: Duration,
}

impl IdlePolicy {
    /// CPU ranks: spin briefly, yield for `spin`, then sleep until a
    /// producer wakes the thread (or 2 ms pass). Yielding keeps the proxy
    /// responsive without starving ranks that share its core; a parked
    /// proxy costs a wake-up (µs).
    pub fn cpu(spin: Duration) -> Self {
        Self {
            spins: 64,
            yield_for: spin,
            sleep: Duration::from_millis(2),
        }
    }

    /// CUDA ranks: a kernel cannot wake a thread, and a GPU rank owns its
    /// CPU cores, so poll for at least 5 ms (a kernel in a ping-pong posts
    /// again within microseconds), then look every 50 µs.
    pub fn gpu(spin: Duration) -> Self {
        Self {
            spins: 64,
            yield_for: spin.max(Duration::from_millis(5)),
            sleep: Duration::from_micros(50),
        }
    }
}

#[derive(Debug, Default)]
struct Control {
    stop: AtomicBool,
    sleeper: Sleeper,
    executed: AtomicU64,
}

/// An engine and the executor it steps with: what the driver thread and
/// producers ([`Shared`]) take turns on.
struct Stepper<E: Executor> {
    engine: Engine<E>,
    exec: E,
}

/// The engine for what is not a step (starting, quiescing, asking whether
/// work is left): a panic inside a step poisons the lock, and the stepping
/// sites ([`step_lock`], [`Shared::try_step_rings`]) then fail the backend,
/// so only these look past it.
fn lock<E: Executor>(m: &Mutex<Stepper<E>>) -> MutexGuard<'_, Stepper<E>> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The error a stepping site records once a thread panicked inside a step
/// (the lock is poisoned): that step may have issued a put and counted its
/// signal without moving the ring past it, so stepping again could send
/// both twice; nothing more is executed (fail-stop).
fn poisoned(rank: usize) -> ProxyError {
    ProxyError::Executor {
        rank,
        what: "step its rings",
        why: ExecError::Invalid {
            why: "a thread panicked inside a step of the engine; what that step left half done \
                  is not run again"
                .into(),
        },
    }
}

/// The engine for a step, or `None` after recording [`poisoned`] where a
/// thread panicked inside an earlier one.
fn step_lock<'a, E: Executor>(
    m: &'a Mutex<Stepper<E>>,
    error: &FirstError,
    rank: usize,
) -> Option<MutexGuard<'a, Stepper<E>>> {
    let guard = m.lock().ok();
    if guard.is_none() {
        error.record(poisoned(rank));
    }
    guard
}

/// What [`Shared::try_step_rings`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Turn {
    /// Another thread (the driver, or another producer) was stepping the
    /// engine: nothing was done here; that thread, or the driver once
    /// woken, does it.
    Busy,
    /// The ring was stepped here (nothing, once the backend has failed);
    /// `more`: it still has work (an operation in flight, or descriptors
    /// past the batch), which the driver must be woken for unless the
    /// caller steps again.
    Stepped {
        /// The ring still has work.
        more: bool,
    },
}

/// A producer's handle on the engine a [`Driver`] runs
/// ([`Driver::start_shared`]): it steps one ring on the calling thread
/// when no other thread is stepping.
pub(crate) struct Shared<E: Executor> {
    rank: usize,
    parts: Arc<Mutex<Stepper<E>>>,
    error: Arc<FirstError>,
    control: Arc<Control>,
}

impl<E: Executor> std::fmt::Debug for Shared<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").finish_non_exhaustive()
    }
}

impl<E: Executor> Shared<E> {
    /// Steps each ring of `rings` (indices as the engine's) once on the
    /// calling thread ([`Engine::step_ring`]) unless another thread is
    /// stepping the engine ([`Turn::Busy`]); never waits for it. Nothing
    /// is stepped once the backend has failed (fail-stop: a failure
    /// recorded by anyone stops execution); a failure of this step is
    /// recorded as the backend's.
    pub(crate) fn try_step_rings(&self, rings: impl IntoIterator<Item = usize>) -> Turn {
        let mut guard = match self.parts.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(_)) => {
                self.error.record(poisoned(self.rank));
                return Turn::Stepped { more: false };
            }
            Err(TryLockError::WouldBlock) => return Turn::Busy,
        };
        if self.error.get().is_some() {
            return Turn::Stepped { more: false };
        }
        let Stepper { engine, exec } = &mut *guard;
        let mut more = false;
        for ring in rings {
            let p = engine.step_ring(ring, exec);
            self.control
                .executed
                .fetch_add(p.executed, Ordering::Relaxed);
            if let Some(e) = engine.failure() {
                self.error.record(e.clone());
                return Turn::Stepped { more: false };
            }
            more |= engine.ring_has_work(ring);
        }
        Turn::Stepped { more }
    }
}

/// A thread stepping an engine (see the module documentation). Dropping it
/// stops the thread, as [`Driver::stop`] does.
#[derive(Debug)]
pub struct Driver {
    control: Arc<Control>,
    error: Arc<FirstError>,
    thread: Option<JoinHandle<()>>,
    join_limit: Duration,
    name: String,
}

impl Driver {
    /// Starts a thread named `name` that steps `engine` with `exec` (behind
    /// a lock, so that producers may take a turn: `Driver::start_shared`)
    /// until stopped, recording the first error in `error`
    /// (which producers share). Stopping waits for the thread at most
    /// `join_limit`: every blocking call of an executor honours the job's
    /// timeout, so a thread still busy after it is abandoned, not waited
    /// for forever.
    pub fn start<E>(
        name: String,
        rank: usize,
        parts: (Engine<E>, E),
        idle: IdlePolicy,
        error: Arc<FirstError>,
        join_limit: Duration,
    ) -> std::io::Result<Self>
    where
        E: Executor + Send + 'static,
        E::InFlight: Send,
    {
        Self::start_shared(name, rank, parts, idle, error, join_limit).map(|(d, _)| d)
    }

    /// [`Driver::start`], also returning a handle through which producers
    /// step the engine on their own threads ([`Shared::try_step_rings`]).
    pub(crate) fn start_shared<E>(
        name: String,
        rank: usize,
        (engine, exec): (Engine<E>, E),
        idle: IdlePolicy,
        error: Arc<FirstError>,
        join_limit: Duration,
    ) -> std::io::Result<(Self, Shared<E>)>
    where
        E: Executor + Send + 'static,
        E::InFlight: Send,
    {
        let parts = Arc::new(Mutex::new(Stepper { engine, exec }));
        let control = Arc::new(Control::default());
        let (c, e, p) = (control.clone(), error.clone(), parts.clone());
        let thread = thread::Builder::new()
            .name(name.clone())
            .spawn(move || run(&c, &e, rank, &p, idle))?;
        control.sleeper.set_thread(thread.thread().clone());
        let shared = Shared {
            rank,
            parts,
            error: error.clone(),
            control: control.clone(),
        };
        Ok((
            Self {
                control,
                error,
                thread: Some(thread),
                join_limit,
                name,
            },
            shared,
        ))
    }

    /// A driver with no thread (tests): only producers step its engine
    /// ([`Shared::try_step_rings`]), so what ran, ran on the caller's
    /// thread.
    #[cfg(test)]
    pub(crate) fn parked<E>(
        name: String,
        (engine, exec): (Engine<E>, E),
        error: Arc<FirstError>,
    ) -> (Self, Shared<E>)
    where
        E: Executor,
    {
        let parts = Arc::new(Mutex::new(Stepper { engine, exec }));
        let control = Arc::new(Control::default());
        let shared = Shared {
            // (No rank: tests name none.)
            rank: 0,
            parts,
            error: error.clone(),
            control: control.clone(),
        };
        let driver = Self {
            control,
            error,
            thread: None,
            join_limit: Duration::ZERO,
            name,
        };
        (driver, shared)
    }

    /// Wakes the thread if it sleeps (a producer, after publishing work:
    /// no descriptor is left unseen, see [`Sleeper`]).
    pub fn wake(&self) {
        self.control.sleeper.wake();
    }

    /// Descriptors executed so far.
    pub fn executed(&self) -> u64 {
        self.control.executed.load(Ordering::Relaxed)
    }

    /// The first error, if any.
    pub fn error(&self) -> Option<&ProxyError> {
        self.error.get()
    }

    /// Stops the thread, after it has executed what is already queued
    /// (a kernel may end right after pushing a signal that a peer waits
    /// for), and returns the first error.
    pub fn stop(mut self) -> Result<(), ProxyError> {
        self.halt();
        self.error.get().map_or(Ok(()), |e| Err(e.clone()))
    }

    fn halt(&mut self) {
        self.control.stop.store(true, Ordering::Release);
        self.control.sleeper.unpark();
        if let Some(h) = self.thread.take() {
            join_within(h, self.join_limit, &self.name);
        }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        self.halt();
    }
}

fn run<E: Executor>(
    c: &Control,
    error: &FirstError,
    rank: usize,
    parts: &Mutex<Stepper<E>>,
    idle: IdlePolicy,
) {
    if let Err(why) = lock(parts).exec.enter() {
        error.record(ProxyError::Executor {
            rank,
            what: "start",
            why,
        });
    }
    let mut polls = 0u32;
    let mut idle_since: Option<Instant> = None;
    loop {
        let stopping = c.stop.load(Ordering::Acquire);
        if error.get().is_some() {
            // Fail-stop: whoever failed first (this engine, a producer, a
            // waiter's confirmation), nothing more is executed.
            if stopping {
                break;
            }
            c.sleeper
                .sleep(idle.sleep, || c.stop.load(Ordering::Acquire));
            continue;
        }
        let (p, in_flight) = {
            let Some(mut guard) = step_lock(parts, error, rank) else {
                continue;
            };
            let Stepper { engine, exec } = &mut *guard;
            let p = engine.step(exec);
            if let Some(e) = engine.failure() {
                error.record(e.clone());
                continue;
            }
            (p, engine.in_flight())
        };
        if p.did_work() {
            c.executed.fetch_add(p.executed, Ordering::Relaxed);
            polls = 0;
            idle_since = None;
            continue;
        }
        // Asked to stop, the driver has drained what was queued, and
        // everything in flight landed (a held signal was sent): an
        // operation that never lands fails the engine in time instead.
        if stopping && in_flight == 0 {
            break;
        }
        polls = polls.saturating_add(1);
        let since = *idle_since.get_or_insert_with(Instant::now);
        if polls < idle.spins {
            std::hint::spin_loop();
        } else if in_flight > 0 || since.elapsed() < idle.yield_for {
            thread::yield_now();
        } else {
            c.sleeper
                .sleep(idle.sleep, || lock(parts).engine.has_work());
        }
    }
    let mut guard = lock(parts);
    if let Err(why) = guard.exec.quiesce() {
        error.record(ProxyError::Executor {
            rank,
            what: "finish its queued work",
            why,
        });
    }
    let s = guard.engine.stats();
    tracing::debug!(
        rank,
        descriptors = s.descriptors,
        batches = s.batches,
        pending_polls = s.pending_polls,
        landed = s.landed,
        "proxy driver stopped"
    );
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

    use super::*;
    use crate::descriptor::{Desc, Op};
    use crate::engine::{EngineConfig, RingSpec};
    use crate::ring::{Ring, RingMem};
    use crate::testing::Fake;

    /// An engine over one ring (context 0, peer 1) and a fake executor
    /// with window 1 of 64 bytes on each of two ranks.
    fn engine(ring: &Arc<Ring>) -> (Engine<Fake>, Fake) {
        let mut fake = Fake::new(0, 1);
        fake.add_window(1, &[64, 64]);
        fake.attach(0, ring.clone());
        let spec = RingSpec {
            ctx: 0,
            peer: 1,
            mem: RingMem::owned(ring.clone()),
            first: 0,
        };
        let config = EngineConfig {
            rank: 0,
            batch: 4,
            counter_slots: 1,
        };
        (Engine::new(config, vec![spec]), fake)
    }

    fn started(ring: &Arc<Ring>) -> Driver {
        Driver::start(
            "gin-proxy-test".into(),
            0,
            engine(ring),
            IdlePolicy::cpu(Duration::from_micros(100)),
            Arc::default(),
            Duration::from_secs(10),
        )
        .unwrap()
    }

    /// A driver with no thread over `engine(ring)`: only the test's
    /// `try_step_rings` calls step it. Returns the backend's first error
    /// too.
    fn parked(ring: &Arc<Ring>) -> (Driver, Shared<Fake>, Arc<FirstError>) {
        let error = Arc::new(FirstError::default());
        let (driver, shared) = Driver::parked("gin-proxy-test".into(), engine(ring), error.clone());
        (driver, shared, error)
    }

    fn put(i: u64) -> Desc {
        Desc {
            op: Op::Put,
            bytes: 8,
            dst_window: 1,
            dst_offset: (i % 8) * 8,
            src_window: 1,
            src_offset: 0,
            inline: None,
            signal: None,
            counter: None,
        }
    }

    /// Everything written before the stop is executed before the thread
    /// ends (a kernel may end right after pushing the signal a peer waits
    /// for).
    #[test]
    fn stopping_drains_what_is_queued() {
        let ring = Arc::new(Ring::new(5));
        let driver = started(&ring);
        for i in 0..20 {
            let seq = ring.reserve();
            ring.write(seq, &put(i));
        }
        driver.stop().unwrap();
        assert_eq!(ring.tail(), 20);
    }

    /// A producer's turn is taken only when no other thread is stepping
    /// the engine: it never waits for one, and then executes nothing; once
    /// the engine is free it executes its ring. After a failure nothing is
    /// executed, whoever steps.
    #[test]
    fn a_producer_steps_only_a_free_engine_and_nothing_after_a_failure() {
        let ring = Arc::new(Ring::new(3));
        let (driver, shared, error) = parked(&ring);
        let seq = ring.reserve();
        ring.write(seq, &put(0));
        {
            // Another thread's step, as the driver's would be.
            let _busy = lock(&shared.parts);
            assert_eq!(shared.try_step_rings([0]), Turn::Busy);
        }
        assert_eq!(ring.tail(), 0, "a busy engine was stepped");
        assert_eq!(shared.try_step_rings([0]), Turn::Stepped { more: false });
        assert_eq!(ring.tail(), 1);
        assert_eq!(driver.executed(), 1);
        // An invalid descriptor fails the engine on the producer's thread:
        // recorded as the backend's failure; nothing after it runs.
        for d in [
            Desc {
                dst_window: 9,
                ..put(1)
            },
            put(2),
        ] {
            let seq = ring.reserve();
            ring.write(seq, &d);
        }
        assert_eq!(shared.try_step_rings([0]), Turn::Stepped { more: false });
        let e = error.get().unwrap();
        assert_eq!(e.seq(), Some(1));
        assert!(e.to_string().contains("window 9 is not registered"), "{e}");
        assert_eq!(shared.try_step_rings([0]), Turn::Stepped { more: false });
        assert_eq!(ring.tail(), 1);
        assert_eq!(driver.executed(), 1);
    }

    /// A thread that panicked inside a step (the engine's lock poisoned)
    /// may have issued a put and counted its signal without moving the ring
    /// past it: the next step, on whichever thread, fails the backend
    /// instead of running that descriptor again (which would send the put
    /// and its signal twice).
    #[test]
    fn a_panic_inside_a_step_fails_the_backend_and_nothing_runs_again() {
        let ring = Arc::new(Ring::new(3));
        let (driver, shared, error) = parked(&ring);
        let seq = ring.reserve();
        ring.write(seq, &put(0));
        let parts = &shared.parts;
        let panicked = thread::scope(|s| {
            s.spawn(|| {
                let _step = parts.lock().unwrap();
                panic!("a step panics (a test)");
            })
            .join()
        });
        assert!(panicked.is_err());
        assert_eq!(shared.try_step_rings([0]), Turn::Stepped { more: false });
        let e = error.get().unwrap();
        assert!(e.to_string().contains("panicked inside a step"), "{e}");
        assert_eq!(ring.tail(), 0, "a descriptor ran after a step panicked");
        assert_eq!(driver.executed(), 0);
        assert_eq!(shared.try_step_rings([0]), Turn::Stepped { more: false });
        assert_eq!(ring.tail(), 0);
    }

    #[test]
    fn stop_reports_the_first_error() {
        let ring = Arc::new(Ring::new(5));
        let driver = started(&ring);
        for i in 0..3 {
            let seq = ring.reserve();
            ring.write(seq, &put(i));
        }
        let seq = ring.reserve();
        ring.write(
            seq,
            &Desc {
                dst_window: 9,
                ..put(0)
            },
        );
        let e = driver.stop().unwrap_err();
        assert_eq!(e.seq(), Some(3));
        assert!(e.to_string().contains("window 9 is not registered"), "{e}");
        assert_eq!(ring.tail(), 3);
    }
}
