//! How a worker thread (a proxy, a NIC) sleeps when idle and producers wake
//! it, without ever missing work: the sleeper announces itself, then looks
//! for work once more; the producer publishes work, then looks for a
//! sleeper. The SeqCst fence on each side makes sure at least one of them
//! sees the other.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering, fence};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

/// An idle worker's sleep, and the producers' way to end it (see the
/// module documentation for the protocol).
#[derive(Debug, Default)]
pub struct Sleeper {
    sleeping: AtomicBool,
    thread: OnceLock<Thread>,
}

impl Sleeper {
    /// Records the worker thread (once, before any `wake` matters).
    pub fn set_thread(&self, t: Thread) {
        let _ = self.thread.set(t);
    }

    /// Producer side, after publishing work: wakes the worker if it sleeps.
    pub fn wake(&self) {
        fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::SeqCst) {
            self.sleeping.store(false, Ordering::SeqCst);
            self.unpark();
        }
    }

    /// Wakes the worker unconditionally (shutdown).
    pub fn unpark(&self) {
        if let Some(t) = self.thread.get() {
            t.unpark();
        }
    }

    /// Worker side: sleeps up to `limit` unless `pending()` finds work after
    /// the worker announced it is going to sleep.
    pub fn sleep(&self, limit: Duration, pending: impl FnOnce() -> bool) {
        self.sleeping.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if !pending() {
            std::thread::park_timeout(limit);
        }
        self.sleeping.store(false, Ordering::SeqCst);
    }
}

/// Joins a worker thread that was told to stop, waiting at most `limit`:
/// every blocking call of a worker honours the job's timeout, so it should
/// be done by then; one that is not (blocked somewhere it should not be) is
/// abandoned with a warning, never waited for forever. The worker owns what
/// it touches through `Arc`s, so an abandoned worker stays memory-safe.
/// Returns whether the thread was joined.
pub fn join_within(h: JoinHandle<()>, limit: Duration, what: &str) -> bool {
    let start = Instant::now();
    let mut pause = Duration::from_micros(50);
    // std has no join with a timeout: poll, backing off to 10 ms.
    while !h.is_finished() {
        if start.elapsed() >= limit {
            tracing::warn!(
                thread = what,
                waited = ?start.elapsed(),
                "a stopped worker thread did not exit in time; abandoning it"
            );
            return false;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(10));
    }
    let _ = h.join();
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_that_never_exits_is_abandoned_after_the_limit() {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        // Blocks until the test ends (the sender is dropped then).
        let h = std::thread::spawn(move || {
            let _ = rx.recv();
        });
        let start = Instant::now();
        assert!(!join_within(h, Duration::from_millis(200), "test worker"));
        assert!(start.elapsed() < Duration::from_secs(2));
        drop(tx);
        let h = std::thread::spawn(|| {});
        assert!(join_within(h, Duration::from_secs(5), "test worker"));
    }
}
