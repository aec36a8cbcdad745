//! Stalled streams: a diagnosis instead of a bare timeout.
//!
//! CUDA maps streams onto a limited number of hardware work queues
//! (`CUDA_DEVICE_MAX_CONNECTIONS`, 8 by default; under MPS the clients
//! share one pool, so each gets few). When an engine's stream shares a
//! queue with a user's stream, the engine's copy waits behind the user's
//! queued kernel — and when that kernel waits for the copy (a signal it
//! needs), neither ever runs: the kernels' waits end at the job's timeout
//! with no word of why (issue 21, measured on an H200 under MPS).
//!
//! An engine's executor tells a [`StallWatch`] when it hands a stream
//! work: each time, a *mark* — an 8-byte store of a sequence number into a
//! word of mapped pinned host memory ([`HostMarks`]) — is queued after the
//! work, in the same driver call as the pass's other stores. A mark the
//! stream has executed says everything queued before it has completed; a
//! mark not executed `threshold` after it was queued is a **stall**.
//! Reading the marks is a host load, so any thread checks
//! ([`StallWatch::check`]): the watch over running kernels (through the
//! engine's health), and a monitor thread ([`StallWatch::monitor`]) that
//! logs it where nobody watches.
//!
//! Staleness is measured from the oldest mark the stream has not executed,
//! so only while the stream has not finished what came before it: a long
//! healthy transfer, whose passes complete one after another, is never a
//! stall, however long it streams (every pass carries its own mark). The
//! oldest unexecuted mark was queued no earlier than the oldest incomplete
//! work, so a stall is never reported early.

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::batch::{Dma, StreamBatch};
use crate::driver::HostMem;
use crate::error::CudaError;

/// The longest a stream's work may stay incomplete before it is a stall.
/// A 4 MiB copy takes about 1 ms and a ring's whole backlog of large copies
/// tens of ms, so seconds are never normal; the kernels of the stall
/// measured in issue 21 would otherwise wait for the job's timeout (5 min
/// by default).
pub const STALL_AFTER: Duration = Duration::from_secs(2);

/// The stall threshold of a job whose waits time out after `timeout`: a
/// quarter of it, at most [`STALL_AFTER`] — so the stall is named well
/// before the kernels' own waits time out, even under a short
/// `GIN_TIMEOUT`.
pub fn stall_threshold(timeout: Duration) -> Duration {
    (timeout / 4).min(STALL_AFTER)
}

/// Marks waiting on one stream at most: beyond, the newest is replaced by
/// the next (a later mark still covers the work before it).
const MAX_PENDING: usize = 64;

/// CUDA's default number of hardware work queues per context.
const DEFAULT_CONNECTIONS: u32 = 8;

/// Streams the live [`StallWatch`]es of this process watch: gin's engine
/// streams.
static PROCESS_STREAMS: AtomicUsize = AtomicUsize::new(0);

/// CUDA streams the gin engines of this process use (every live
/// [`StallWatch`]'s), for the diagnosis and the start-up log.
pub fn process_streams() -> usize {
    PROCESS_STREAMS.load(Ordering::Relaxed)
}

/// Words streams store their marks into, one per stream, which the host
/// reads from any thread.
///
/// # Safety
/// Every address [`Marks::addr`] returns is 8 aligned bytes that the
/// watched streams may write with `cuStreamWriteValue64` for as long as
/// this value lives ([`StallWatch::mark`] queues stores there): memory the
/// implementation owns, mapped for the streams' GPU, that nothing else
/// uses. (A test's recording GPU, which executes no store, may return any
/// address.)
pub unsafe trait Marks: Send + Sync + fmt::Debug {
    /// The device address stream `i` stores its marks at (`None`: no such
    /// stream).
    fn addr(&self, i: usize) -> Option<u64>;
    /// The last mark stream `i` executed (0: none yet).
    fn read(&self, i: usize) -> u64;
}

/// Marks in mapped pinned host memory: streams store with
/// `cuStreamWriteValue64`, the host loads atomically.
#[derive(Debug)]
pub struct HostMarks {
    mem: HostMem,
    n: usize,
}

impl HostMarks {
    /// Words for `n` streams, zeroed, mapped for the current context's GPU.
    ///
    /// # Errors
    /// The driver's, allocating them.
    pub fn new(n: usize) -> Result<Self, CudaError> {
        Ok(Self {
            mem: HostMem::new(n.max(1) * 8)?,
            n,
        })
    }
}

// SAFETY: word `i` of `mem`, mapped pinned host memory this value owns
// (allocated with the device-map flag for the streams' GPU), used for
// nothing else.
unsafe impl Marks for HostMarks {
    fn addr(&self, i: usize) -> Option<u64> {
        (i < self.n).then(|| self.mem.dev() + i as u64 * 8)
    }

    fn read(&self, i: usize) -> u64 {
        self.mem
            .atomic_u64(i * 8)
            .map_or(0, |w| w.load(Ordering::Acquire))
    }
}

/// What this process's environment says about CUDA's hardware work
/// queues, read when an engine starts.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct WorkQueues {
    /// `CUDA_DEVICE_MAX_CONNECTIONS` as set (`None`: unset, CUDA's default
    /// of 8).
    pub max_connections: Option<String>,
    /// Whether `CUDA_MPS_PIPE_DIRECTORY` is set (MPS in use, whose clients
    /// share one pool of work queues). Unset says little: MPS may serve
    /// the process through its default pipe directory.
    pub mps: bool,
}

impl WorkQueues {
    /// The process's environment.
    pub fn from_env() -> Self {
        let var = |k| std::env::var_os(k).map(|v| v.to_string_lossy().into_owned());
        Self {
            max_connections: var("CUDA_DEVICE_MAX_CONNECTIONS"),
            mps: var("CUDA_MPS_PIPE_DIRECTORY").is_some(),
        }
    }

    /// `CUDA_DEVICE_MAX_CONNECTIONS`'s value, or `unset`.
    pub fn shown(&self) -> &str {
        self.max_connections.as_deref().unwrap_or("unset")
    }
}

impl fmt::Display for WorkQueues {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.max_connections {
            Some(v) => write!(f, "CUDA_DEVICE_MAX_CONNECTIONS={v}")?,
            None => write!(
                f,
                "CUDA_DEVICE_MAX_CONNECTIONS unset (CUDA's default: {DEFAULT_CONNECTIONS})"
            )?,
        }
        if self.mps {
            write!(
                f,
                "; MPS in use (CUDA_MPS_PIPE_DIRECTORY is set): its clients share one pool of work queues"
            )
        } else {
            write!(f, "; CUDA_MPS_PIPE_DIRECTORY unset")
        }
    }
}

/// One stream's marks: the last handed out, and those not yet executed,
/// oldest first, with when they were queued.
#[derive(Debug, Default)]
struct Lane {
    last: u64,
    pending: VecDeque<(u64, Instant)>,
    /// The mark whose stall was reported (logged) already.
    reported: u64,
}

impl Lane {
    /// Forgets the marks the stream has executed (`done`: its word).
    fn prune(&mut self, done: u64) {
        while self.pending.front().is_some_and(|&(s, _)| s <= done) {
            self.pending.pop_front();
        }
    }
}

/// The streams of one engine, watched for stalls (see the module
/// documentation). Shared (`Arc`) by the executor that marks them and by
/// whoever checks.
#[derive(Debug)]
pub struct StallWatch {
    rank: usize,
    engine: &'static str,
    names: Vec<String>,
    threshold: Duration,
    queues: WorkQueues,
    marks: Box<dyn Marks>,
    lanes: Vec<Mutex<Lane>>,
}

impl StallWatch {
    /// Watches `names.len()` streams of rank `rank`'s `engine` (`"CUDA
    /// proxy"`), stream `i` named `names[i]` (`"ring 1 (context 0, peer
    /// 2)"`) and marking `marks`' word `i`; work incomplete for longer than
    /// `threshold` ([`stall_threshold`]) is a stall, diagnosed with
    /// `queues`.
    pub fn new(
        rank: usize,
        engine: &'static str,
        names: Vec<String>,
        marks: Box<dyn Marks>,
        threshold: Duration,
        queues: WorkQueues,
    ) -> Self {
        PROCESS_STREAMS.fetch_add(names.len(), Ordering::Relaxed);
        Self {
            rank,
            engine,
            lanes: names.iter().map(|_| Mutex::default()).collect(),
            names,
            threshold,
            queues,
            marks,
        }
    }

    /// Streams watched.
    pub fn streams(&self) -> usize {
        self.names.len()
    }

    /// The stall threshold.
    pub fn threshold(&self) -> Duration {
        self.threshold
    }

    fn lane(&self, i: usize) -> Option<MutexGuard<'_, Lane>> {
        Some(
            self.lanes
                .get(i)?
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        )
    }

    /// Logs, at info, how many streams the engine made and what the
    /// environment says of hardware work queues (once, at start).
    pub fn log_start(&self) {
        let (streams, total) = (self.streams(), process_streams());
        tracing::info!(
            rank = self.rank,
            engine = self.engine,
            streams,
            process_streams = total,
            cuda_device_max_connections = self.queues.shown(),
            mps = self.queues.mps,
            "rank {}: the {} uses {streams} CUDA streams (this process's gin engines: {total}); {}",
            self.rank,
            self.engine,
            self.queues,
        );
    }

    /// Queues stream `i`'s next mark at the end of `batch`, if it holds
    /// work (the work that `batch.flush` then hands over), noting that it
    /// was queued at `now`. Call it right before flushing `batch` to `q`.
    ///
    /// # Errors
    /// The batch's, queueing the store.
    ///
    /// # Safety
    /// `q` is stream `i` of this watch, and executes the store before this
    /// watch is dropped (keep an `Arc` of it until the stream was
    /// synchronised); `q` may write the watch's marks (true of
    /// [`HostMarks`] and streams of their GPU; `testing::MarkWords` only
    /// with a GPU that executes no store).
    pub unsafe fn mark(
        &self,
        i: usize,
        batch: &mut StreamBatch,
        q: &impl Dma,
        now: Instant,
    ) -> Result<(), CudaError> {
        if batch.is_empty() {
            return Ok(());
        }
        let (Some(addr), Some(mut lane)) = (self.marks.addr(i), self.lane(i)) else {
            return Ok(());
        };
        lane.prune(self.marks.read(i));
        lane.last += 1;
        let seq = lane.last;
        if lane.pending.len() == MAX_PENDING {
            // A later mark covers what the newest one did, and is younger:
            // never an earlier stall.
            lane.pending.pop_back();
        }
        lane.pending.push_back((seq, now));
        drop(lane);
        // SAFETY: word `i` of the marks this watch owns (8 aligned bytes of
        // memory the stream may write), alive until the stream executed
        // the store (the caller's contract).
        unsafe { batch.write(q, addr, seq) }
    }

    /// The worst stall at `now`, if any stream has work that has not
    /// completed for longer than the threshold. The first check to see a
    /// stall logs it at warn (once per stall: a stream that progresses and
    /// stalls again is a new one).
    pub fn check(&self, now: Instant) -> Option<Stall> {
        let mut worst: Option<(usize, Duration)> = None;
        let mut stalled = 0;
        let mut fresh = false;
        for i in 0..self.lanes.len() {
            let Some(mut lane) = self.lane(i) else {
                continue;
            };
            lane.prune(self.marks.read(i));
            let Some(&(seq, at)) = lane.pending.front() else {
                continue;
            };
            let age = now.saturating_duration_since(at);
            if age <= self.threshold {
                continue;
            }
            stalled += 1;
            if lane.reported != seq {
                lane.reported = seq;
                fresh = true;
            }
            if worst.is_none_or(|(_, w)| age > w) {
                worst = Some((i, age));
            }
        }
        let (i, age) = worst?;
        let stall = Stall {
            rank: self.rank,
            engine: self.engine,
            stream: self.names[i].clone(),
            stalled_for: age,
            threshold: self.threshold,
            others: stalled - 1,
            engine_streams: self.streams(),
            process_streams: process_streams().max(self.streams()),
            queues: self.queues.clone(),
            first: fresh,
        };
        if fresh {
            tracing::warn!(
                rank = self.rank,
                engine = self.engine,
                stream = %stall.stream,
                stalled_ms = age.as_millis(),
                process_streams = stall.process_streams,
                cuda_device_max_connections = self.queues.shown(),
                mps = self.queues.mps,
                "{stall}"
            );
        }
        Some(stall)
    }

    /// Starts a thread named `name` that checks every quarter threshold
    /// (so a stall is logged even where no watch asks the engine), until
    /// the returned monitor is dropped.
    ///
    /// # Errors
    /// [`CudaError::Spawn`] when the thread cannot be started.
    pub fn monitor(self: &Arc<Self>, name: String) -> Result<Monitor, CudaError> {
        let stop = Arc::new(AtomicBool::new(false));
        let every = (self.threshold / 4).max(Duration::from_millis(1));
        let (me, halt) = (self.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                while !halt.load(Ordering::Acquire) {
                    me.check(Instant::now());
                    std::thread::park_timeout(every);
                }
            })
            .map_err(|source| CudaError::Spawn {
                what: "stall monitor",
                source,
            })?;
        Ok(Monitor {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for StallWatch {
    fn drop(&mut self) {
        PROCESS_STREAMS.fetch_sub(self.names.len(), Ordering::Relaxed);
    }
}

/// The thread [`StallWatch::monitor`] started; dropping it stops it.
#[derive(Debug)]
pub struct Monitor {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Monitor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

/// An engine's stream whose work has not completed for longer than the
/// threshold (see the module documentation); its `Display` is the
/// diagnosis, with the remedy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stall {
    /// This rank.
    pub rank: usize,
    /// The engine (`"CUDA proxy"`, `"CUDA soft NIC"`).
    pub engine: &'static str,
    /// The stream, by what it serves (`"ring 1 (context 0, peer 2)"`).
    pub stream: String,
    /// How long its oldest incomplete work has waited, at least.
    pub stalled_for: Duration,
    /// The threshold it passed.
    pub threshold: Duration,
    /// Other streams of the engine stalled too.
    pub others: usize,
    /// Streams the engine uses.
    pub engine_streams: usize,
    /// Streams this process's gin engines use.
    pub process_streams: usize,
    /// What the environment says of hardware work queues.
    pub queues: WorkQueues,
    /// Whether this check was the first to see it (and logged it).
    pub first: bool,
}

impl fmt::Display for Stall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rank {}: the {} stalled: work it queued on the CUDA stream of {} has not completed for {:.1} s (threshold {:.1} s",
            self.rank,
            self.engine,
            self.stream,
            self.stalled_for.as_secs_f64(),
            self.threshold.as_secs_f64(),
        )?;
        if self.others > 0 {
            write!(f, "; {} more of its streams stalled", self.others)?;
        }
        write!(
            f,
            "): the stream likely shares a hardware work queue with a kernel queued ahead of it that waits for this work. \
             This process's gin engines use {} CUDA streams (this one {}); {}. \
             Remedy: set CUDA_DEVICE_MAX_CONNECTIONS to at least the number of CUDA streams the process uses \
             (gin's engines' plus the user's), or launch fewer kernels ahead of the engine's work",
            self.process_streams, self.engine_streams, self.queues,
        )
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test
    use super::*;
    use std::sync::atomic::AtomicU64;

    /// Marks the test executes itself; addresses `0x1000 + 8 i`.
    #[derive(Debug, Default)]
    struct Words([AtomicU64; 2]);

    // SAFETY: the fake GPU of these tests executes no store.
    unsafe impl Marks for Arc<Words> {
        fn addr(&self, i: usize) -> Option<u64> {
            (i < 2).then_some(0x1000 + i as u64 * 8)
        }
        fn read(&self, i: usize) -> u64 {
            self.0[i].load(Ordering::Acquire)
        }
    }

    /// Records the stores it is handed.
    #[derive(Debug, Default)]
    struct Sink(std::cell::RefCell<Vec<(u64, u64)>>);

    impl Dma for Sink {
        unsafe fn copy(&self, _: u64, _: u64, _: usize) -> Result<(), CudaError> {
            Ok(())
        }
        unsafe fn write_u64(&self, a: u64, v: u64) -> Result<(), CudaError> {
            self.0.borrow_mut().push((a, v));
            Ok(())
        }
        fn sync(&self) -> Result<(), CudaError> {
            Ok(())
        }
    }

    fn watch(words: &Arc<Words>, queues: WorkQueues) -> StallWatch {
        let names = vec![
            "ring 0 (context 0, peer 1)".into(),
            "ring 1 (context 0, peer 2)".into(),
        ];
        StallWatch::new(
            3,
            "CUDA proxy",
            names,
            Box::new(words.clone()),
            Duration::from_secs(2),
            queues,
        )
    }

    /// Queues a copy on stream `i` and hands it over with its mark at `t`.
    fn pass(w: &StallWatch, i: usize, q: &Sink, at: Instant) {
        let mut batch = StreamBatch::default();
        // SAFETY: the sink touches no memory.
        unsafe {
            batch.push(q, 0x10, 0x20, 8, 0).unwrap();
            w.mark(i, &mut batch, q, at).unwrap();
        }
        batch.flush(q).unwrap();
    }

    /// A stream that never completes is a stall after the threshold,
    /// strictly, not before, named by its stream and the environment; it
    /// is reported first once. Time is the test's.
    #[test]
    fn a_stream_that_never_completes_stalls_after_the_threshold() {
        let words = Arc::new(Words::default());
        let w = watch(&words, WorkQueues::default());
        let (q, t0) = (Sink::default(), Instant::now());
        // An empty batch hands nothing over: no mark.
        // SAFETY: as in `pass`.
        unsafe { w.mark(1, &mut StreamBatch::default(), &q, t0) }.unwrap();
        assert!(q.0.borrow().is_empty());
        pass(&w, 1, &q, t0);
        assert_eq!(*q.0.borrow(), vec![(0x1008, 1)]);
        let thr = w.threshold();
        assert_eq!(w.check(t0), None);
        assert_eq!(w.check(t0 + thr), None, "at the threshold: not yet");
        let s = w.check(t0 + thr + Duration::from_millis(1)).unwrap();
        assert!(s.first);
        assert_eq!(s.stream, "ring 1 (context 0, peer 2)");
        let m = s.to_string();
        for want in [
            "rank 3",
            "CUDA proxy stalled",
            "ring 1 (context 0, peer 2)",
            "2.0 s",
            "CUDA_DEVICE_MAX_CONNECTIONS unset (CUDA's default: 8)",
            "CUDA_MPS_PIPE_DIRECTORY unset",
            "set CUDA_DEVICE_MAX_CONNECTIONS to at least",
            "launch fewer kernels",
        ] {
            assert!(m.contains(want), "{want:?} missing from {m}");
        }
        // Still stalled, no longer news (logged once).
        let again = w.check(t0 + thr * 3).unwrap();
        assert!(!again.first);
        assert_eq!(again.stalled_for, thr * 3);
        // The environment, as read at start, is named.
        let w = watch(
            &words,
            WorkQueues {
                max_connections: Some("4".into()),
                mps: true,
            },
        );
        pass(&w, 0, &q, t0);
        let m = w.check(t0 + thr * 2).unwrap().to_string();
        assert!(m.contains("CUDA_DEVICE_MAX_CONNECTIONS=4"), "{m}");
        assert!(m.contains("MPS in use"), "{m}");
    }

    /// A stream that completes late, but before the threshold, is no
    /// stall, then or after; one that progresses and stalls again is a new
    /// stall, timed from its own oldest incomplete pass.
    #[test]
    fn work_completed_before_the_threshold_is_no_stall() {
        let words = Arc::new(Words::default());
        let w = watch(&words, WorkQueues::default());
        let (q, t0, thr) = (Sink::default(), Instant::now(), Duration::from_secs(2));
        pass(&w, 0, &q, t0);
        assert_eq!(w.check(t0 + thr / 2), None);
        // The stream executes its mark (late: 1.9 s).
        words.0[0].store(1, Ordering::Release);
        assert_eq!(w.check(t0 + thr * 10), None);
        // A long healthy transfer: a pass every second, each completed a
        // second later; the stream is never idle, yet never stalled.
        let mut t = t0 + thr * 10;
        for k in 2..20u64 {
            pass(&w, 0, &q, t);
            t += Duration::from_secs(1);
            words.0[0].store(k - 1, Ordering::Release);
            assert_eq!(w.check(t), None, "pass {k}");
        }
        // The last pass never completes: a stall, from its own queueing.
        let s = w.check(t + thr).unwrap();
        assert!(s.first);
        assert_eq!(s.stalled_for, thr + Duration::from_secs(1));
        // It completes: no stall; a new pass that stalls is news again.
        words.0[0].store(19, Ordering::Release);
        assert_eq!(w.check(t + thr * 5), None);
        pass(&w, 0, &q, t + thr * 5);
        assert!(w.check(t + thr * 8).unwrap().first);
    }

    /// The threshold is a quarter of the job's timeout, at most 2 s.
    #[test]
    fn the_threshold_is_well_below_the_timeout() {
        assert_eq!(stall_threshold(Duration::from_mins(5)), STALL_AFTER);
        assert_eq!(
            stall_threshold(Duration::from_secs(4)),
            Duration::from_secs(1)
        );
    }
}
