//! A first-error-wins cell: once a link or backend fails it stays failed, and
//! every later check reports the first cause. Checking is one atomic load
//! while nothing has failed, so hot paths can check on every call.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// The first error recorded, kept for every later check (a `String` unless
/// the owner keeps something richer).
#[derive(Debug)]
pub struct StickyError<T = String> {
    failed: AtomicBool,
    why: Mutex<Option<T>>,
}

impl<T> Default for StickyError<T> {
    fn default() -> Self {
        Self {
            failed: AtomicBool::new(false),
            why: Mutex::new(None),
        }
    }
}

impl<T: Clone> StickyError<T> {
    /// Records `why` unless an error is already recorded; true if it was
    /// the first.
    pub fn set(&self, why: T) -> bool {
        let mut w = self
            .why
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if w.is_some() {
            return false;
        }
        *w = Some(why);
        self.failed.store(true, Ordering::Release);
        true
    }

    /// The first error, if any.
    pub fn get(&self) -> Option<T> {
        if !self.failed.load(Ordering::Acquire) {
            return None;
        }
        self.why
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_error_wins() {
        let s = StickyError::default();
        assert_eq!(s.get(), None);
        assert!(s.set("first".to_string()));
        assert!(!s.set("second".into()));
        assert_eq!(s.get().as_deref(), Some("first"));
    }
}
