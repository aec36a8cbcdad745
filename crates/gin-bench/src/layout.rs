//! Where each message of a stream lands: pure index arithmetic, checked by
//! property tests.
//!
//! A window of W puts of `size` bytes wants W distinct destinations, so that
//! no put overwrites another still in flight; large messages times large
//! windows would need gigabytes, so the buffer is capped and slots are
//! reused round-robin (a reused slot only ever receives identical bytes
//! within one run, so reuse cannot hide a lost or misplaced put from the
//! check after the run).

use serde::{Deserialize, Serialize};

/// Buffer cap for one direction of a stream.
pub const STREAM_BUFFER: u64 = 16 << 20;

/// `count` slots of `size` bytes, used round-robin.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Slots {
    pub size: u64,
    pub count: usize,
}

impl Slots {
    /// One slot per message of a window, as many as fit in `cap` bytes, at
    /// least one (a single message larger than `cap` gets its own slot).
    pub fn new(size: u64, window: usize, cap: u64) -> Self {
        let fit = (cap / size.max(1)).min(usize::MAX as u64) as usize;
        Self {
            size,
            count: fit.clamp(1, window.max(1)),
        }
    }

    /// Byte offset of message `m`.
    pub fn offset(&self, m: usize) -> u64 {
        (m % self.count) as u64 * self.size
    }

    /// Bytes the slots span.
    pub fn bytes(&self) -> u64 {
        self.count as u64 * self.size
    }

    /// How many distinct slots `messages` messages have written.
    pub fn written(&self, messages: usize) -> usize {
        messages.min(self.count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn examples() {
        let s = Slots::new(4 << 20, 64, STREAM_BUFFER);
        assert_eq!((s.count, s.bytes()), (4, 16 << 20));
        assert_eq!(s.offset(5), 4 << 20);
        let s = Slots::new(8, 128, STREAM_BUFFER);
        assert_eq!(s.count, 128);
        assert_eq!(Slots::new(64 << 20, 1, STREAM_BUFFER).count, 1);
        assert_eq!(Slots::new(8, 0, STREAM_BUFFER).count, 1);
    }

    proptest! {
        /// Every message lands inside the slots, on a slot boundary, and
        /// the slots fit the cap unless one message alone exceeds it.
        #[test]
        fn offsets_stay_in_bounds(size in 1u64..(1 << 30), window in 0usize..10_000,
                                  cap in 1u64..(1 << 34), m in any::<usize>()) {
            let s = Slots::new(size, window, cap);
            let off = s.offset(m);
            prop_assert!(off + size <= s.bytes());
            prop_assert_eq!(off % size, 0);
            prop_assert!(s.bytes() <= cap.max(size));
            prop_assert!(s.count >= 1 && s.count <= window.max(1));
        }

        /// Within any run of `count` consecutive messages no slot repeats:
        /// a window that fits the buffer never overwrites its own puts.
        #[test]
        fn consecutive_messages_use_distinct_slots(size in 1u64..(1 << 24), window in 1usize..512,
                                                   start in 0usize..(1 << 40)) {
            let s = Slots::new(size, window, STREAM_BUFFER);
            let mut seen = std::collections::BTreeSet::new();
            for m in start..start + s.count {
                prop_assert!(seen.insert(s.offset(m)));
            }
            prop_assert_eq!(s.written(start), start.min(s.count));
        }
    }
}
