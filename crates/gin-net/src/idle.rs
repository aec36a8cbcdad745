//! How a worker thread (a proxy, a NIC) sleeps when idle and producers wake
//! it, without ever missing work: the sleeper announces itself, then looks
//! for work once more; the producer publishes work, then looks for a
//! sleeper. The SeqCst fence on each side makes sure at least one of them
//! sees the other.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering, fence};
use std::thread::Thread;
use std::time::Duration;

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
