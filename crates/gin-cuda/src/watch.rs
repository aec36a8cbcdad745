//! Watching a job while kernels run: kernels wait on peers (signals,
//! credits, barriers) and cannot learn on their own that a peer died or an
//! engine failed, so a host thread looks at the job's health and, on the
//! first failure, raises an abort flag the kernels poll, so their waits
//! give up with an error.
//!
//! What "health" means is the caller's (a callback returning the cause
//! kernels should give up for); this module owns the flag, its sharing
//! between watches, and the two ways of watching: a thread beside kernels
//! the user launched ([`Watcher`]), and the calling thread while one stream
//! runs ([`wait_watching`]).
//!
//! [`Sentinel`] is the callback's policy over what the caller reports
//! ([`JobHealth`]: gin-core's bootstrap and fabric; [`EngineHealth`]: the
//! backend's engine): a dead peer is a cause at once, a lost link only once
//! a grace has passed without a dead peer named (a lost link is often the
//! echo of a death), then the engine's first error.
//!
//! One flag serves every kernel of a communicator, and so every watch of
//! it at once: [`Abort`] counts the watches that raised it and lowers it
//! when the last of them lets go, so a watch that ends does not lower the
//! flag under kernels another watch still aborts.
//!
//! A [`Watcher`] owns what it touches, so it may outlive whoever started
//! it (a library type keeps one beside the device communicator it owns):
//! the flag (an `Arc` of the [`Abort`]), and the health it asks, which for
//! a [`Sentinel`] is a weak reference ([`Sentinel::watch_health`]): once
//! the sentinel is gone (its device communicator dropped), the watcher
//! asks nothing more and holds nothing of the job or the engine. Each
//! watcher carries its [`Owner`], so a check refuses a watcher some other
//! communicator started ([`Watcher::finish_for`]).
//!
//! [`Supervisor`] puts the pieces together for a communicator's kernels:
//! the flag, the error word kernels record their first error in, and the
//! stream kernels run on when the caller names none; it launches, watches
//! and reads the error word, and leaves what the word and the cause mean to
//! its caller (the device API's encoding is not this crate's).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::driver::{DevMem, Device, Function, Stream};
use crate::error::CudaError;
use crate::launch::{LaunchConfig, Param, StreamRef};

/// How often a watch looks at the job's health.
const LOOK_EVERY: Duration = Duration::from_millis(1);

/// How long [`wait_watching`] polls a stream back to back before it pauses
/// between polls. A pause of 20 µs sleeps longer (Linux's default timer
/// slack is 50 µs), which every waited launch paid once it ended: on an
/// H200 a high-throughput dispatch's notify kernel ended about 70 µs
/// before the host queued the dispatch kernel after it, for about 10 µs of
/// host work.
/// The kernels gin-ep and the selftests wait for mostly end within it;
/// longer ones cost a core for this long, then little.
pub const WAIT_SPIN: Duration = Duration::from_millis(2);

/// Where the abort flag lives and how it is raised and lowered.
pub trait Flag: Send + Sync + 'static {
    /// Queues the raise: kernels see the flag set soon after.
    ///
    /// # Errors
    /// The driver's, when the raise cannot be queued.
    fn raise(&self) -> Result<(), CudaError>;
    /// Lowers the flag once every raise queued before has landed (the
    /// kernels it aborted have finished).
    ///
    /// # Errors
    /// The driver's, when the flag cannot be reset.
    fn lower(&self) -> Result<(), CudaError>;
}

/// The abort flag in device memory: kernels poll it, and a kernel that
/// reads host memory, even one thread per block once every 100 us, starves
/// the copies the CUDA proxy queues (measured with
/// `xtask/gpu/probe/ce_probe.cu`). The host raises it with a stream write
/// on the flag's own stream, which runs beside the kernels'.
#[derive(Debug)]
pub struct DeviceFlag {
    mem: DevMem,
    stream: Stream,
    /// Last: the context must outlive the memory and the stream.
    dev: Arc<Device>,
}

impl DeviceFlag {
    /// A lowered flag in `dev`'s memory (64 bytes: a line of its own).
    pub fn new(dev: Arc<Device>) -> Result<Self, CudaError> {
        dev.make_current()?;
        Ok(Self {
            mem: DevMem::new(64)?,
            stream: Stream::new()?,
            dev,
        })
    }

    /// The flag's device address, which kernels poll (a nonzero `u64`:
    /// give up).
    pub fn ptr(&self) -> u64 {
        self.mem.ptr()
    }
}

/// The last holder of a flag may be a watcher dropped on any thread (it
/// outlives its communicator): its memory and stream are freed in the
/// flag's context, made current here first.
impl Drop for DeviceFlag {
    fn drop(&mut self) {
        let _ = self.dev.make_current();
    }
}

impl Flag for DeviceFlag {
    fn raise(&self) -> Result<(), CudaError> {
        // From any thread (a watcher's).
        self.dev.make_current()?;
        // SAFETY: the flag is 64 bytes of device memory this value owns,
        // and the stream is waited for (`lower`) before the flag is reset
        // or freed.
        unsafe { self.stream.write_u64(self.mem.ptr(), 1) }
    }

    fn lower(&self) -> Result<(), CudaError> {
        self.dev.make_current()?;
        // On the stream that raised it, waited for: a `cuMemsetD8` on the
        // legacy stream could land after the next kernel (on a
        // non-blocking stream) started and abort it, or wipe a newer raise.
        // SAFETY: as in `raise`; the store is waited for right here.
        unsafe { self.stream.write_u64(self.mem.ptr(), 0) }?;
        self.stream.sync()
    }
}

/// An abort flag shared by every watch of one communicator (hold it in an
/// `Arc`): raised while at least one watch that raised it has not let go.
#[derive(Debug)]
pub struct Abort<F = DeviceFlag> {
    flag: F,
    /// Watches holding the flag raised. Raising and lowering happen under
    /// this lock, so a raise never lands between a lower's wait and reset.
    holds: Mutex<usize>,
}

impl<F: Flag> Abort<F> {
    /// A lowered flag that no watch holds.
    pub fn new(flag: F) -> Self {
        Self {
            flag,
            holds: Mutex::new(0),
        }
    }

    /// The flag.
    pub fn flag(&self) -> &F {
        &self.flag
    }

    fn holds(&self) -> MutexGuard<'_, usize> {
        self.holds.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Raises the flag for one more watch, which must [`Abort::release`]
    /// it once the kernels it aborts have finished.
    ///
    /// # Errors
    /// The flag's, when the raise cannot be queued (then nothing is held).
    pub fn raise(&self) -> Result<(), CudaError> {
        let mut holds = self.holds();
        self.flag.raise()?;
        *holds += 1;
        Ok(())
    }

    /// Lets go of one watch's raise; the flag is lowered when no watch
    /// holds it any more.
    ///
    /// # Errors
    /// The flag's, when it cannot be lowered.
    pub fn release(&self) -> Result<(), CudaError> {
        let mut holds = self.holds();
        *holds = holds.saturating_sub(1);
        if *holds == 0 {
            self.flag.lower()?;
        }
        Ok(())
    }

    /// How many watches hold the flag raised.
    pub fn held(&self) -> usize {
        *self.holds()
    }
}

/// One watch's state: the cause, once found. A watch looks until it finds
/// one and raises the flag once.
#[derive(Debug, Default)]
pub struct Watch {
    cause: Option<String>,
}

impl Watch {
    /// Asks `health` for a cause unless one was found already; true when
    /// one was found just now (raise the flag).
    pub fn look(&mut self, health: impl FnOnce() -> Option<String>) -> bool {
        if self.cause.is_some() {
            return false;
        }
        self.cause = health();
        self.cause.is_some()
    }

    /// The cause found, if any.
    pub fn cause(&self) -> Option<&str> {
        self.cause.as_deref()
    }

    /// The cause found, if any, taken out.
    pub fn into_cause(self) -> Option<String> {
        self.cause
    }
}

/// Waits for `stream` on this thread, looking at `health` each millisecond
/// and raising `abort` once it names a cause; returns that cause, the
/// flag let go again once the stream has finished. For the first
/// [`WAIT_SPIN`] it polls the stream back to back (yielding the core
/// between polls), then with a short sleep between polls.
///
/// # Errors
/// The driver's, querying the stream or raising and lowering the flag.
pub fn wait_watching<F: Flag>(
    stream: StreamRef<'_>,
    abort: &Abort<F>,
    mut health: impl FnMut() -> Option<String>,
) -> Result<Option<String>, CudaError> {
    let mut watch = Watch::default();
    let mut raised = false;
    let mut next = Instant::now();
    let spin = Instant::now();
    let waited = loop {
        match stream.idle() {
            Ok(true) => break Ok(()),
            Ok(false) => {}
            Err(e) => break Err(e),
        }
        if Instant::now() >= next {
            next = Instant::now() + LOOK_EVERY;
            if watch.look(&mut health) {
                if let Err(e) = abort.raise() {
                    break Err(e);
                }
                raised = true;
            }
        }
        // Watching a running kernel, not synchronising: the driver has no
        // wait that also wakes on a peer's death, so poll the stream (and,
        // each millisecond, the job's health): back to back at first,
        // then with a short pause.
        if spin.elapsed() < WAIT_SPIN {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(20));
        }
    };
    let released = if raised { abort.release() } else { Ok(()) };
    waited?;
    released?;
    Ok(watch.into_cause())
}

/// Who started a watcher (a device communicator's [`Sentinel`]): a number
/// unique in the process, so a check can refuse a watcher another one
/// started ([`Watcher::finish_for`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Owner(u64);

impl Owner {
    /// A number no other owner of this process has.
    pub fn new() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Self(NEXT.fetch_add(1, Ordering::Relaxed))
    }

    /// The number (in messages: "device communicator 3").
    pub fn id(self) -> u64 {
        self.0
    }
}

impl Default for Owner {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Display for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Watches the job while kernels run without blocking the thread that
/// launched them: a thread that, each millisecond while the watcher lives,
/// asks the health callback and, on the first cause, raises the abort flag
/// and records the cause. [`Watcher::finish`] (or dropping it) stops the
/// thread and lets go of the flag: do so only once the kernels it watched
/// have finished.
///
/// It is `'static` and `Send`: it owns the flag (an `Arc`), and the
/// health callback is its own (a [`Sentinel`]'s holds the sentinel
/// weakly), so it may outlive the communicator that started it, which
/// then only stops being asked about.
#[derive(Debug)]
pub struct Watcher<F: Flag = DeviceFlag> {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
    abort: Arc<Abort<F>>,
    owner: Owner,
    name: String,
}

/// What a watcher shares with its thread.
#[derive(Debug, Default)]
struct Shared {
    stop: AtomicBool,
    /// The cause, once found; the thread's own error if it failed.
    found: Mutex<Found>,
}

#[derive(Debug, Default)]
struct Found {
    cause: Option<String>,
    /// Whether this watch holds the abort flag raised.
    raised: bool,
    /// The thread's own failure (raising the flag).
    failed: Option<String>,
}

impl Shared {
    fn found(&self) -> MutexGuard<'_, Found> {
        self.found.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<F: Flag> Watcher<F> {
    /// Starts a thread named `name`, on behalf of `owner`, that watches
    /// `health` and raises `abort`.
    ///
    /// # Errors
    /// [`CudaError::Spawn`] when the thread cannot be started.
    pub fn start(
        name: String,
        owner: Owner,
        abort: Arc<Abort<F>>,
        mut health: impl FnMut() -> Option<String> + Send + 'static,
    ) -> Result<Self, CudaError> {
        let shared = Arc::new(Shared::default());
        let thread = {
            let (shared, abort) = (shared.clone(), abort.clone());
            std::thread::Builder::new()
                .name(name.clone())
                .spawn(move || watch_loop(&shared, &abort, &mut health))
                .map_err(|source| CudaError::Spawn {
                    what: "CUDA watcher",
                    source,
                })?
        };
        Ok(Self {
            shared,
            thread: Some(thread),
            abort,
            owner,
            name,
        })
    }

    /// Who started it.
    pub fn owner(&self) -> Owner {
        self.owner
    }

    /// Its thread's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The cause found so far, if any: the abort flag is raised then.
    pub fn cause(&self) -> Option<String> {
        self.shared.found().cause.clone()
    }

    /// Stops the thread and lets go of the flag; returns the cause.
    ///
    /// # Errors
    /// [`CudaError::Worker`] when the thread could not raise the flag, the
    /// flag's error when it could not be lowered.
    pub fn finish(mut self) -> Result<Option<String>, CudaError> {
        self.stop()
    }

    /// [`Watcher::finish`] for the check of `owner`'s kernels on `abort`'s
    /// flag: a watcher another owner started, or one raising another flag,
    /// is refused (and stopped, letting go of its own flag), so its cause
    /// is never taken for these kernels'.
    ///
    /// # Errors
    /// [`CudaError::ForeignWatcher`] for such a watcher; those of
    /// [`Watcher::finish`].
    pub fn finish_for(
        self,
        owner: Owner,
        abort: &Arc<Abort<F>>,
    ) -> Result<Option<String>, CudaError> {
        if self.owner != owner || !Arc::ptr_eq(&self.abort, abort) {
            return Err(CudaError::ForeignWatcher {
                watcher: self.name.clone(),
                started_by: self.owner.id(),
                checked_by: owner.id(),
            });
        }
        self.finish()
    }

    fn stop(&mut self) -> Result<Option<String>, CudaError> {
        let Some(t) = self.thread.take() else {
            return Ok(None);
        };
        self.shared.stop.store(true, Ordering::Release);
        t.thread().unpark();
        let _ = t.join();
        let found = std::mem::take(&mut *self.shared.found());
        if found.raised {
            self.abort.release()?;
        }
        if let Some(why) = found.failed {
            return Err(CudaError::Worker {
                context: "the CUDA watcher failed".into(),
                error: why,
            });
        }
        Ok(found.cause)
    }
}

impl<F: Flag> Drop for Watcher<F> {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// What a [`Sentinel`] asks about the job each look, implemented by its
/// caller (gin-core asks its bootstrap and its fabric): whether a peer
/// died, and whether the transport lost a link.
pub trait JobHealth: Send + Sync + 'static {
    /// The account of a dead peer, if one died (the bootstrap's): a cause
    /// at once.
    fn dead_peer(&self) -> Option<String>;
    /// The account of a lost link, if the transport lost one: often the
    /// echo of a dead peer, so a cause only when no dead peer is named
    /// within the sentinel's grace.
    fn lost_link(&self) -> Option<String>;
}

/// The engine serving a device communicator, as a [`Sentinel`] watches it
/// (gin-core's is gin-device's `CudaEngine`).
pub trait EngineHealth: Send + 'static {
    /// The first error, once the engine failed (kernels waiting on it
    /// should be aborted).
    fn error(&self) -> Option<String>;
    /// A stall while it lasts (kernels waiting on it should be aborted; a
    /// run that ended well did not fail for it, so [`Sentinel::late_cause`]
    /// leaves it out). `None` by default.
    fn stall(&self) -> Option<String> {
        None
    }
    /// How a failure of this engine is introduced in messages (`"the CUDA
    /// proxy failed"`).
    fn failure(&self) -> &'static str;
    /// Whether kernels see this engine's errors themselves (error
    /// completions) and may end before a watch saw its account: then
    /// [`Sentinel::late_cause`] looks once more after the kernels.
    fn kernel_sees_errors(&self) -> bool;
}

/// What tells a watch that kernels should give up — the health callback's
/// policy: a dead peer at once; a lost link once `grace` has passed
/// without a dead peer named (a lost link is often one's echo); the
/// engine's first error. Owns the engine (taken out when stopped) and is
/// shared with watcher threads in an `Arc`.
#[derive(Debug)]
pub struct Sentinel<J, E> {
    job: J,
    engine: Mutex<Option<E>>,
    grace: Duration,
    owner: Owner,
}

/// A lost link's account and when a look first saw it.
type LostLink = Option<(Instant, String)>;

impl<J: JobHealth, E: EngineHealth> Sentinel<J, E> {
    /// Watches `job` and `engine` (if any), giving the job `grace` to name
    /// a dead peer behind a lost link (gin-core: `gin_device::CAUSE_GRACE`).
    pub fn new(job: J, engine: Option<E>, grace: Duration) -> Self {
        Self {
            job,
            engine: Mutex::new(engine),
            grace,
            owner: Owner::new(),
        }
    }

    /// Who its watchers were started by ([`Watcher::finish_for`]).
    pub fn owner(&self) -> Owner {
        self.owner
    }

    /// The engine, while it has not been taken out (to stop it).
    pub fn engine(&self) -> MutexGuard<'_, Option<E>> {
        self.engine.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Why kernels should give up at `now`, if they should: a dead peer, a
    /// lost link (seen first at the time kept in `lost`, after the grace),
    /// a failed engine.
    fn cause(&self, lost: &mut LostLink, now: Instant) -> Option<String> {
        if let Some(why) = self.job.dead_peer() {
            Some(why)
        } else if let Some((since, why)) = lost {
            (now.saturating_duration_since(*since) > self.grace).then(|| why.clone())
        } else if let Some(why) = self.job.lost_link() {
            *lost = Some((now, why));
            None
        } else {
            let engine = self.engine();
            let engine = engine.as_ref()?;
            engine
                .error()
                .or_else(|| engine.stall())
                .map(|e| format!("{}: {e}", engine.failure()))
        }
    }

    /// What a watch asks each millisecond ([`Watcher::start`],
    /// [`Supervisor::run`]): the cause, a lost link's account kept
    /// meanwhile while the job is given the grace to name a dead peer.
    pub fn health(self: &Arc<Self>) -> impl FnMut() -> Option<String> + Send + 'static {
        let (me, mut lost) = (self.clone(), None);
        move || me.cause(&mut lost, Instant::now())
    }

    /// [`Sentinel::health`] for a [`Watcher`] thread, which may outlive
    /// the sentinel: it holds it weakly, so it keeps neither the job nor
    /// the engine alive, and once the sentinel is gone it finds no cause
    /// (and touches nothing of either).
    pub fn watch_health(self: &Arc<Self>) -> impl FnMut() -> Option<String> + Send + 'static {
        let (me, mut lost) = (Arc::downgrade(self), None);
        move || me.upgrade()?.cause(&mut lost, Instant::now())
    }

    /// The engine's account of an error that kernels see themselves (error
    /// completions): a kernel that met one may end before a watch saw it.
    pub fn late_cause(&self) -> Option<String> {
        let engine = self.engine();
        let engine = engine.as_ref().filter(|e| e.kernel_sees_errors())?;
        engine.error().map(|e| format!("{}: {e}", engine.failure()))
    }
}

/// How kernels ended, as the host saw them: the error word they wrote
/// (zero: none; its encoding is the caller's) and the cause a watch found
/// (the abort flag was raised for it).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Outcome {
    /// The error word, read and cleared after the kernels.
    pub word: u64,
    /// Why the watch raised the abort flag, if it did.
    pub cause: Option<String>,
}

/// What a communicator's kernels share on one GPU: the abort flag, the
/// error word (8 bytes of device memory kernels record their first error
/// in) and the stream kernels run on when the caller names none. Every
/// launch and watch of the communicator goes through it.
#[derive(Debug)]
pub struct Supervisor {
    abort: Arc<Abort>,
    error: DevMem,
    stream: Stream,
    /// Last: the context must outlive the memory and the stream.
    dev: Arc<Device>,
}

impl Supervisor {
    /// A lowered flag, a clear error word and a stream on `dev`.
    ///
    /// # Errors
    /// The driver's, allocating them.
    pub fn new(dev: Arc<Device>) -> Result<Self, CudaError> {
        let abort = Arc::new(Abort::new(DeviceFlag::new(dev.clone())?));
        Ok(Self {
            abort,
            error: DevMem::new(8)?,
            stream: Stream::new()?,
            dev,
        })
    }

    /// The abort flag's device address (kernels poll it).
    pub fn abort_flag(&self) -> u64 {
        self.abort.flag().ptr()
    }

    /// The error word's device address (kernels record their first error).
    pub fn error_word(&self) -> u64 {
        self.error.ptr()
    }

    /// Which context and stream [`Supervisor::run`] launches on.
    pub fn context_info(&self) -> ContextInfo {
        ContextInfo {
            ordinal: self.dev.ordinal(),
            context: self.dev.raw_context(),
            primary: true,
            stream: self.stream.raw(),
        }
    }

    /// Launches `f` on this supervisor's stream and waits for it, raising
    /// the abort flag once `health` names a cause; then reads and clears
    /// the error word.
    ///
    /// # Errors
    /// The driver's, launching, waiting or reading the word.
    ///
    /// # Safety
    /// As [`Function::launch_params`].
    pub unsafe fn run(
        &self,
        f: &Function,
        cfg: &LaunchConfig,
        params: &[Param<'_>],
        health: impl FnMut() -> Option<String>,
    ) -> Result<Outcome, CudaError> {
        self.dev.make_current()?;
        // This supervisor's own stream: no context to check (as
        // `launch_on` does).
        let stream = StreamRef::from(&self.stream);
        // SAFETY: the caller's contract.
        unsafe { f.launch_params(cfg, stream, params)? };
        let cause = wait_watching(stream, &self.abort, health)?;
        Ok(Outcome {
            word: self.take_word()?,
            cause,
        })
    }

    /// Queues `f` on `stream`, which must belong to the GPU's primary
    /// context (checked), and returns at once.
    ///
    /// # Errors
    /// [`CudaError::ForeignStream`] for a stream of another context; the
    /// driver's, launching.
    ///
    /// # Safety
    /// As [`Function::launch_params`].
    pub unsafe fn launch_on(
        &self,
        f: &Function,
        cfg: &LaunchConfig,
        stream: StreamRef<'_>,
        params: &[Param<'_>],
    ) -> Result<(), CudaError> {
        stream.check_context(&self.dev)?;
        // SAFETY: the caller's contract.
        unsafe { f.launch_params(cfg, stream, params) }
    }

    /// Starts a watcher thread named `name` on `health`, on behalf of
    /// `owner` (see [`Watcher`]).
    ///
    /// # Errors
    /// [`CudaError::Spawn`] when the thread cannot be started.
    pub fn watch(
        &self,
        name: String,
        owner: Owner,
        health: impl FnMut() -> Option<String> + Send + 'static,
    ) -> Result<Watcher, CudaError> {
        Watcher::start(name, owner, self.abort.clone(), health)
    }

    /// Once the kernels launched since the last check have finished, stops
    /// `watcher` (if any: one `owner` started on this supervisor's flag)
    /// and reads and clears the error word. From any thread.
    ///
    /// # Errors
    /// [`CudaError::ForeignWatcher`] for a watcher someone else started
    /// (the error word is left for the next check); the watcher's, and the
    /// driver's, reading the word.
    pub fn check(&self, watcher: Option<Watcher>, owner: Owner) -> Result<Outcome, CudaError> {
        self.dev.make_current()?;
        let cause = match watcher {
            Some(w) => w.finish_for(owner, &self.abort)?,
            None => None,
        };
        Ok(Outcome {
            word: self.take_word()?,
            cause,
        })
    }

    /// Reads the error word, and clears it where it is set.
    fn take_word(&self) -> Result<u64, CudaError> {
        let mut w = [0u64];
        self.error.read(0, &mut w)?;
        if w[0] != 0 {
            // On this supervisor's stream (idle: its kernels ended), waited
            // for, so the next kernel on any stream finds the word clear
            // and no late clear erases an error it records.
            // SAFETY: the 8 bytes of the error word this supervisor owns.
            unsafe { self.stream.write_u64(self.error.ptr(), 0) }?;
            self.stream.sync()?;
        }
        Ok(w[0])
    }
}

/// Which CUDA context kernels run in on a GPU
/// ([`Supervisor::context_info`], gin-core's `CudaComm::context_info`): the
/// device's **primary context**, which cudarc's `CudaContext::new(ordinal)`
/// (and the CUDA runtime, so PyTorch) retain too. Memory, streams and
/// modules of one are valid in the others; kernels a user launches with
/// [`Supervisor::launch_on`] may use any stream of this context. Each
/// engine (the CUDA proxy, the soft NIC) creates its own streams in it.
#[derive(Debug, Clone, Copy)]
pub struct ContextInfo {
    /// The GPU's ordinal (after `CUDA_VISIBLE_DEVICES`).
    pub ordinal: usize,
    /// The context, as a raw `CUcontext`.
    pub context: cudarc::driver::sys::CUcontext,
    /// Whether it is the device's primary context (always, today).
    pub primary: bool,
    /// The stream [`Supervisor::run`] launches on (a non-blocking stream
    /// of that context).
    pub stream: cudarc::driver::sys::CUstream,
}

/// A watcher thread's loop: look each millisecond until told to stop.
fn watch_loop<F: Flag>(
    shared: &Shared,
    abort: &Abort<F>,
    health: &mut impl FnMut() -> Option<String>,
) {
    let mut watch = Watch::default();
    while !shared.stop.load(Ordering::Acquire) {
        if watch.look(&mut *health) {
            // The cause is recorded before the flag goes up, under the
            // lock: whoever sees the flag raised finds the cause.
            let mut found = shared.found();
            found.cause = watch.cause().map(str::to_owned);
            let raised = abort.raise();
            match raised {
                Ok(()) => found.raised = true,
                Err(e) => found.failed = Some(e.to_string()),
            }
        }
        std::thread::park_timeout(LOOK_EVERY);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test
    use super::*;
    use crate::testing::HostFlag;

    /// A watch asks for a cause until it finds one, and reports it once.
    #[test]
    fn a_watch_finds_a_cause_once() {
        let mut w = Watch::default();
        assert!(!w.look(|| None));
        assert_eq!(w.cause(), None);
        assert!(w.look(|| Some("boom".into())));
        assert_eq!(w.cause(), Some("boom"));
        // Found once: the health is not asked again.
        assert!(!w.look(|| panic!("asked again")));
        assert_eq!(w.into_cause().as_deref(), Some("boom"));
    }

    /// The flag stays raised while any watch holding it has not let go,
    /// and is lowered by the last.
    #[test]
    fn the_flag_is_lowered_by_the_last_watch_that_raised_it() {
        let abort = Abort::new(HostFlag::default());
        abort.raise().unwrap();
        abort.raise().unwrap();
        assert_eq!((abort.held(), abort.flag().value()), (2, 1));
        abort.release().unwrap();
        assert_eq!((abort.held(), abort.flag().value()), (1, 1));
        abort.release().unwrap();
        assert_eq!((abort.held(), abort.flag().value()), (0, 0));
        // A raise that cannot be queued holds nothing.
        abort.flag().fail_raises(true);
        assert!(abort.raise().is_err());
        assert_eq!((abort.held(), abort.flag().value()), (0, 0));
    }

    /// Two watchers of one communicator share its flag: the first to stop
    /// leaves it raised for the kernels the other still aborts (it used to
    /// lower it), and the second lowers it.
    #[test]
    fn a_watcher_that_stops_leaves_the_flag_raised_for_another() {
        let abort = Arc::new(Abort::new(HostFlag::default()));
        let start = |why: &'static str| {
            Watcher::start(
                "test-watch".into(),
                Owner::new(),
                abort.clone(),
                move || Some(why.into()),
            )
            .unwrap()
        };
        let (a, b) = (start("peer 1 died"), start("the engine failed"));
        // The raises are the synchronisation: wait for both (bounded).
        assert!(abort.flag().wait_raises(2, Duration::from_secs(30)));
        assert_eq!(a.finish().unwrap().as_deref(), Some("peer 1 died"));
        assert_eq!(abort.flag().value(), 1, "lowered under b's kernels");
        assert_eq!(b.finish().unwrap().as_deref(), Some("the engine failed"));
        assert_eq!((abort.held(), abort.flag().value()), (0, 0));
    }

    /// A watcher that cannot raise the flag records the cause and reports
    /// its failure when finished; it holds nothing.
    #[test]
    fn a_watcher_that_cannot_raise_reports_it() {
        let abort = Arc::new(Abort::new(HostFlag::default()));
        abort.flag().fail_raises(true);
        let w = Watcher::start("test-watch".into(), Owner::new(), abort.clone(), || {
            Some("boom".into())
        })
        .unwrap();
        assert!(abort.flag().wait_raises(1, Duration::from_secs(30)));
        let e = w.finish().expect_err("the raise failed");
        assert!(e.to_string().contains("the CUDA watcher failed"), "{e}");
        assert_eq!((abort.held(), abort.flag().value()), (0, 0));
    }

    /// A job whose dead peer and lost link the test sets.
    #[derive(Debug, Default)]
    struct FakeJob {
        dead_peer: Mutex<Option<String>>,
        lost_link: Mutex<Option<String>>,
    }

    impl JobHealth for Arc<FakeJob> {
        fn dead_peer(&self) -> Option<String> {
            self.dead_peer.lock().unwrap().clone()
        }
        fn lost_link(&self) -> Option<String> {
            self.lost_link.lock().unwrap().clone()
        }
    }

    /// An engine whose error the test sets.
    #[derive(Debug, Default)]
    struct FakeEngine {
        error: Arc<Mutex<Option<String>>>,
        stall: Arc<Mutex<Option<String>>>,
        sees: bool,
        /// Held while the engine lives (tests count its holders).
        _alive: Arc<()>,
    }

    impl EngineHealth for FakeEngine {
        fn error(&self) -> Option<String> {
            self.error.lock().unwrap().clone()
        }
        fn stall(&self) -> Option<String> {
            self.stall.lock().unwrap().clone()
        }
        fn failure(&self) -> &'static str {
            "the fake engine failed"
        }
        fn kernel_sees_errors(&self) -> bool {
            self.sees
        }
    }

    type FakeSentinel = Sentinel<Arc<FakeJob>, FakeEngine>;

    /// A healthy job's sentinel with a fake engine (its error slot
    /// returned), giving the job `grace`; the job is returned too.
    fn sentinel(
        sees: bool,
        grace: Duration,
    ) -> (Arc<FakeSentinel>, Arc<Mutex<Option<String>>>, Arc<FakeJob>) {
        let (job, error) = (Arc::new(FakeJob::default()), Arc::new(Mutex::new(None)));
        let engine = FakeEngine {
            error: error.clone(),
            stall: Arc::default(),
            sees,
            _alive: Arc::default(),
        };
        let s = Arc::new(Sentinel::new(job.clone(), Some(engine), grace));
        (s, error, job)
    }

    /// A healthy job gives no cause; an engine's error does, once, in the
    /// words the run's error carries.
    #[test]
    fn a_watch_finds_an_engines_failure_once() {
        let (s, error, _) = sentinel(false, Duration::from_millis(500));
        let (mut w, mut health) = (Watch::default(), s.health());
        assert!(!w.look(&mut health));
        assert_eq!(w.cause(), None);
        *error.lock().unwrap() = Some("boom".into());
        assert!(w.look(&mut health));
        assert_eq!(w.cause(), Some("the fake engine failed: boom"));
        // Raised once: a second look finds nothing new.
        assert!(!w.look(&mut health));
        // Errors kernels do not see themselves are not looked at late.
        assert_eq!(s.late_cause(), None);

        let (s, error, _) = sentinel(true, Duration::from_millis(500));
        assert_eq!(s.late_cause(), None);
        *error.lock().unwrap() = Some("bad CQE".into());
        assert_eq!(
            s.late_cause().as_deref(),
            Some("the fake engine failed: bad CQE")
        );
        // Once the engine is stopped (taken), nothing is reported.
        s.engine().take();
        assert_eq!(s.late_cause(), None);
    }

    /// A stall is a cause a watch aborts kernels for, but not a late cause:
    /// a run whose kernels ended well did not fail for a stall that passed
    /// meanwhile (the engine is not fail-stop for it).
    #[test]
    fn a_stall_aborts_waiting_kernels_but_never_fails_a_finished_run() {
        let (job, error, stall) = (
            Arc::new(FakeJob::default()),
            Arc::new(Mutex::new(None)),
            Arc::new(Mutex::new(Some("stalled: ring 1".to_string()))),
        );
        let engine = FakeEngine {
            error: error.clone(),
            stall,
            sees: true,
            _alive: Arc::default(),
        };
        let s = Arc::new(Sentinel::new(job, Some(engine), Duration::from_millis(500)));
        let (mut w, mut health) = (Watch::default(), s.health());
        assert!(w.look(&mut health));
        assert_eq!(w.cause(), Some("the fake engine failed: stalled: ring 1"));
        assert_eq!(s.late_cause(), None);
        // An error still wins over the stall, late as well.
        *error.lock().unwrap() = Some("bad CQE".into());
        assert_eq!(
            s.late_cause().as_deref(),
            Some("the fake engine failed: bad CQE")
        );
    }

    /// The watcher's thread raises the flag when the engine fails, records
    /// the cause (and a failure to raise), and stops when told.
    #[test]
    fn a_watcher_thread_raises_the_abort_flag_and_records_the_cause() {
        let (s, error, _) = sentinel(false, Duration::from_millis(500));
        let abort = Arc::new(Abort::new(HostFlag::default()));
        let w =
            Watcher::start("test-watch".into(), Owner::new(), abort.clone(), s.health()).unwrap();
        *error.lock().unwrap() = Some("boom".into());
        // The raise is the synchronisation: wait for it (bounded).
        assert!(abort.flag().wait_raises(1, Duration::from_secs(30)));
        assert_eq!(abort.flag().value(), 1);
        let cause = w.finish().unwrap();
        assert_eq!(cause.as_deref(), Some("the fake engine failed: boom"));
        // Lowered once the watch ends; raised once only.
        assert_eq!((abort.flag().value(), abort.held()), (0, 0));
        assert!(!abort.flag().wait_raises(2, Duration::ZERO));
        // A failure to raise is the watch's error.
        abort.flag().fail_raises(true);
        let w =
            Watcher::start("test-watch".into(), Owner::new(), abort.clone(), s.health()).unwrap();
        assert!(abort.flag().wait_raises(2, Duration::from_secs(30)));
        let e = w.finish().expect_err("the raise failed");
        assert!(e.to_string().contains("the test fails raises"), "{e}");
    }

    /// A lost link is the cause only once the grace has passed (strictly)
    /// since a look first saw it, and hides the engine meanwhile; a dead
    /// peer named within the grace is the cause instead (death beats its
    /// echo). Time is the test's: no sleeps.
    #[test]
    fn a_lost_link_waits_the_grace_for_a_dead_peer() {
        let grace = Duration::from_millis(500);
        let (s, error, job) = sentinel(false, grace);
        let t0 = Instant::now();
        let mut lost = None;
        assert_eq!(s.cause(&mut lost, t0), None);
        *job.lost_link.lock().unwrap() = Some("link to rank 2 lost".into());
        *error.lock().unwrap() = Some("send failed".into());
        assert_eq!(s.cause(&mut lost, t0), None, "seen, not yet a cause");
        assert_eq!(s.cause(&mut lost, t0 + grace), None, "within the grace");
        let ms = Duration::from_millis(1);
        assert_eq!(
            s.cause(&mut lost, t0 + grace + ms).as_deref(),
            Some("link to rank 2 lost")
        );
        // The grace runs from the first look that saw the link lost.
        let mut lost = None;
        assert_eq!(s.cause(&mut lost, t0 + grace), None);
        assert_eq!(s.cause(&mut lost, t0 + grace * 2), None);
        // A dead peer named within the grace wins, and at once.
        *job.dead_peer.lock().unwrap() = Some("rank 1 died".into());
        assert_eq!(
            s.cause(&mut lost, t0 + grace + ms).as_deref(),
            Some("rank 1 died")
        );
        assert_eq!(
            s.cause(&mut None, t0).as_deref(),
            Some("rank 1 died"),
            "no grace for a dead peer"
        );
    }

    /// A sentinel over a healthy job and an engine whose liveness the test
    /// sees (the `Arc` the engine holds), as a device communicator's.
    fn owned_sentinel() -> (Arc<FakeSentinel>, Arc<FakeJob>, Arc<()>) {
        let (job, alive) = (Arc::new(FakeJob::default()), Arc::new(()));
        let engine = FakeEngine {
            _alive: alive.clone(),
            ..FakeEngine::default()
        };
        let s = Sentinel::new(job.clone(), Some(engine), Duration::from_millis(500));
        (Arc::new(s), job, alive)
    }

    /// A watcher's health ([`Sentinel::watch_health`]) holds its sentinel
    /// weakly: it finds the job's dead peer while the sentinel lives, keeps
    /// neither the job nor the engine alive, and once the sentinel is gone
    /// (the device communicator dropped) asks nothing: no cause, though
    /// the job would still give one. Steps, no thread.
    #[test]
    fn a_watchers_health_lets_its_sentinel_go() {
        let (s, job, alive) = owned_sentinel();
        let mut health = s.watch_health();
        assert_eq!(health(), None);
        *job.dead_peer.lock().unwrap() = Some("rank 1 died".into());
        assert_eq!(health().as_deref(), Some("rank 1 died"));
        assert_eq!((Arc::strong_count(&job), Arc::strong_count(&alive)), (2, 2));
        drop(s);
        // The job and the engine went with the sentinel.
        assert_eq!((Arc::strong_count(&job), Arc::strong_count(&alive)), (1, 1));
        assert_eq!(health(), None, "asked a dropped sentinel");
    }

    /// An owned watcher (its flag an `Arc`, its health weak) raises the
    /// flag on a dead peer, and outlives both the sentinel and the
    /// supervisor's hold on the flag: finishing it afterwards still
    /// reports the cause and lowers the flag it owns, and the engine was
    /// dropped with the sentinel, not kept by the watcher.
    #[test]
    fn an_owned_watcher_outlives_its_device_communicator() {
        let (s, job, alive) = owned_sentinel();
        let flag = Arc::new(HostFlag::default());
        let abort = Arc::new(Abort::new(flag.clone()));
        let w = Watcher::start(
            "test-watch".into(),
            s.owner(),
            abort.clone(),
            s.watch_health(),
        )
        .unwrap();
        *job.dead_peer.lock().unwrap() = Some("rank 1 died".into());
        // The raise is the synchronisation (bounded): the watch found its
        // cause and asks no more, so it holds no strong reference now.
        assert!(flag.wait_raises(1, Duration::from_secs(30)));
        assert_eq!(w.cause().as_deref(), Some("rank 1 died"));
        drop((s, abort));
        assert_eq!(
            Arc::strong_count(&alive),
            1,
            "the engine outlived its sentinel"
        );
        assert_eq!(Arc::strong_count(&job), 1, "the job outlived its sentinel");
        assert_eq!(flag.value(), 1, "lowered under the watched kernels");
        assert_eq!(w.finish().unwrap().as_deref(), Some("rank 1 died"));
        assert_eq!(flag.value(), 0);
    }

    /// A check refuses a watcher another owner started, or one on another
    /// flag, with an error naming the watcher and both owners; the refused
    /// watcher is stopped and lets go of its own flag. Its own owner's
    /// check on its flag takes its cause.
    #[test]
    fn a_check_refuses_a_foreign_watcher() {
        let (mine, theirs) = (owned_sentinel().0, owned_sentinel().0);
        assert_ne!(mine.owner(), theirs.owner());
        let abort = Arc::new(Abort::new(HostFlag::default()));
        let other = Arc::new(Abort::new(HostFlag::default()));
        let start = |n: usize| {
            let name = format!("gin-watch-r0-d{}", theirs.owner());
            let w = Watcher::start(name, theirs.owner(), abort.clone(), || Some("boom".into()));
            let w = w.unwrap();
            assert!(abort.flag().wait_raises(n, Duration::from_secs(30)));
            w
        };
        let e = start(1).finish_for(mine.owner(), &abort).unwrap_err();
        let CudaError::ForeignWatcher {
            watcher,
            started_by,
            checked_by,
        } = &e
        else {
            panic!("{e}")
        };
        assert_eq!(watcher, &format!("gin-watch-r0-d{}", theirs.owner()));
        assert_eq!(
            (*started_by, *checked_by),
            (theirs.owner().id(), mine.owner().id())
        );
        let text = e.to_string();
        assert!(
            text.contains(&format!("device communicator {}", mine.owner())),
            "{text}"
        );
        assert_eq!((abort.held(), abort.flag().value()), (0, 0));
        // Its owner, but another flag (another CUDA communicator's).
        let e = start(2).finish_for(theirs.owner(), &other).unwrap_err();
        assert!(matches!(e, CudaError::ForeignWatcher { .. }), "{e}");
        assert_eq!((abort.held(), abort.flag().value()), (0, 0));
        let cause = start(3).finish_for(theirs.owner(), &abort).unwrap();
        assert_eq!(cause.as_deref(), Some("boom"));
        assert_eq!((abort.held(), abort.flag().value()), (0, 0));
    }
}
