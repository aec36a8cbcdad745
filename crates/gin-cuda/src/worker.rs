//! The host thread behind the CUDA proxy and the CUDA soft NIC: started
//! with a body, asked to stop (the body drains and returns), joined on stop
//! or drop, and holding the first error it met for the thread that watches
//! kernels.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use crate::error::CudaError;

/// The first error a worker met (later ones are dropped).
pub type FirstError = Arc<Mutex<Option<String>>>;

/// Records `why` unless an error is recorded already.
pub fn set_first(e: &Mutex<Option<String>>, why: String) {
    let mut g = e.lock().unwrap_or_else(PoisonError::into_inner);
    if g.is_none() {
        *g = Some(why);
    }
}

/// A running worker thread; dropping it stops and joins the thread.
#[derive(Debug)]
pub struct Worker {
    stop: Arc<AtomicBool>,
    error: FirstError,
    thread: Option<JoinHandle<()>>,
}

impl Worker {
    /// Runs `body(stop, error)` on a thread named `name`; an `Err` it
    /// returns is logged and recorded as the first error. `what` names the
    /// worker in logs and errors ("CUDA proxy").
    pub fn start<E: std::fmt::Display>(
        name: String,
        what: &'static str,
        body: impl FnOnce(&AtomicBool, &FirstError) -> Result<(), E> + Send + 'static,
    ) -> Result<Self, CudaError> {
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
            .map_err(|source| CudaError::Spawn { what, source })?;
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
    pub fn stop(mut self, context: &str) -> Result<(), CudaError> {
        self.halt();
        match self.error() {
            Some(error) => Err(CudaError::Worker {
                context: context.into(),
                error,
            }),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The body's error is the first error, reported by `stop` under the
    /// context; a later one does not replace it.
    #[test]
    fn stop_reports_the_first_error() {
        let w = Worker::start("gin-test-worker".into(), "test worker", |_, e| {
            set_first(e, "first".into());
            Err::<(), _>("second")
        })
        .unwrap();
        // The body ends by itself; stop joins it before reading the error.
        let err = w.stop("the worker reported").unwrap_err();
        assert!(
            matches!(&err, CudaError::Worker { context, error }
                if context == "the worker reported" && error == "first"),
            "{err}"
        );
        assert_eq!(err.to_string(), "the worker reported: first");
    }

    /// A body that drains until asked to stop returns cleanly.
    #[test]
    fn a_stopped_worker_without_errors_stops_cleanly() {
        let w = Worker::start("gin-test-worker".into(), "test worker", |stop, _| {
            while !stop.load(Ordering::Acquire) {
                std::thread::yield_now();
            }
            Ok::<(), CudaError>(())
        })
        .unwrap();
        assert!(w.error().is_none());
        w.stop("unused").unwrap();
    }
}
