//! The host thread behind the CUDA proxy and the CUDA soft NIC: started
//! with a body, asked to stop (the body drains and returns), joined on stop
//! or drop, and holding the first error it met for the thread that watches
//! kernels.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use crate::error::CoreError;

/// The first error a worker met (later ones are dropped).
pub(crate) type FirstError = Arc<Mutex<Option<String>>>;

/// Records `why` unless an error is recorded already.
pub(crate) fn set_first(e: &Mutex<Option<String>>, why: String) {
    let mut g = e.lock().unwrap_or_else(PoisonError::into_inner);
    if g.is_none() {
        *g = Some(why);
    }
}

#[derive(Debug)]
pub(crate) struct Worker {
    stop: Arc<AtomicBool>,
    error: FirstError,
    thread: Option<JoinHandle<()>>,
}

impl Worker {
    /// Runs `body(stop, error)` on a thread named `name`; an `Err` it
    /// returns is logged and recorded as the first error.
    pub fn start(
        name: String,
        what: &'static str,
        body: impl FnOnce(&AtomicBool, &FirstError) -> Result<(), CoreError> + Send + 'static,
    ) -> Result<Self, CoreError> {
        let stop = Arc::new(AtomicBool::new(false));
        let error = FirstError::default();
        let (s, e) = (stop.clone(), error.clone());
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                if let Err(err) = body(&s, &e) {
                    tracing::error!("{what} stopped: {err}");
                    set_first(&e, err.to_string());
                }
            })
            .map_err(|e| CoreError::Invalid(format!("cannot start the {what} thread: {e}")))?;
        Ok(Self {
            stop,
            error,
            thread: Some(thread),
        })
    }

    /// The first error recorded, if any.
    pub fn error(&self) -> Option<String> {
        self.error
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Stops the body (it drains first) and reports the first error it met,
    /// introduced by `context` ("the soft NIC reported").
    pub fn stop(mut self, context: &str) -> Result<(), CoreError> {
        self.halt();
        match self.error() {
            Some(e) => Err(CoreError::Invalid(format!("{context}: {e}"))),
            None => Ok(()),
        }
    }

    /// Asks the body to stop and waits for it.
    pub fn halt(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.halt();
    }
}
