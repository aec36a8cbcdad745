//! Rolling comparisons and the polling loop every wait uses.
//!
//! Signals are 64-bit and counters 56-bit counters that only grow and may
//! wrap; "has it reached `target`" is answered by the sign of the wrapped
//! difference, so a wait stays correct across wraparound as long as the two
//! are within half the range of each other (as in NCCL's GIN).

use std::time::{Duration, Instant};

/// Counters are 56 bits wide.
pub const COUNTER_BITS: u32 = 56;
/// Mask of a counter's meaningful bits.
pub const COUNTER_MASK: u64 = (1 << COUNTER_BITS) - 1;

/// True when the 64-bit `value` has reached `target` in rolling order.
pub fn signal_reached(value: u64, target: u64) -> bool {
    (value.wrapping_sub(target) as i64) >= 0
}

/// True when the 56-bit `value` has reached `target` in rolling order (both
/// taken modulo 2^56).
pub fn counter_reached(value: u64, target: u64) -> bool {
    value.wrapping_sub(target) & COUNTER_MASK < 1 << (COUNTER_BITS - 1)
}

/// Why a poll loop stopped without its condition.
#[derive(Debug)]
pub(crate) enum Stop<E> {
    Timeout(Duration),
    Aborted,
    Failed(E),
}

/// Polls `ready` until it returns true, backing off from spinning to
/// yielding to short sleeps so that ranks and proxies can share few cores.
/// Every ~0.5 ms `health` is consulted and the abort flag read; when health
/// fails, `ready` is asked once more, so a wait the failed peer satisfied
/// before it went succeeds.
pub(crate) fn poll<E>(
    timeout: Duration,
    abort: &std::sync::atomic::AtomicU32,
    mut ready: impl FnMut() -> bool,
    mut health: impl FnMut() -> Result<(), E>,
) -> Result<(), Stop<E>> {
    // The common case on a fast path: the value is (nearly) there. Spin a
    // little before reading the clock, which costs as much as a short wait.
    for _ in 0..200 {
        if ready() {
            return Ok(());
        }
        std::hint::spin_loop();
    }
    let start = Instant::now();
    let mut next_check = start;
    loop {
        if ready() {
            return Ok(());
        }
        let now = Instant::now();
        if now >= next_check {
            next_check = now + Duration::from_micros(500);
            if abort.load(std::sync::atomic::Ordering::Relaxed) != 0 {
                return Err(Stop::Aborted);
            }
            if let Err(e) = health() {
                // A peer that wrote what we wait for and then left (or
                // died) did so before its departure was known here: the
                // condition holds, and the wait succeeds.
                return if ready() {
                    Ok(())
                } else {
                    Err(Stop::Failed(e))
                };
            }
            if now - start >= timeout {
                // One last look, so a value that arrived during the check counts.
                return if ready() {
                    Ok(())
                } else {
                    Err(Stop::Timeout(now - start))
                };
            }
        }
        let waited = now - start;
        if waited < Duration::from_micros(200) {
            std::thread::yield_now();
        } else {
            // Long waits sleep a little: on a machine with fewer cores than
            // busy threads, spinning starves the very thread being waited for.
            std::thread::sleep(Duration::from_micros(20).min(waited / 16));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Model: unbounded integers. A value `d` steps after the target has
        /// reached it; one `d` steps before has not (|d| < half the range).
        #[test]
        fn signal_rolling_compare_matches_model(target in any::<u64>(), d in 0u64..(1 << 63)) {
            prop_assert!(signal_reached(target.wrapping_add(d), target));
            if d > 0 {
                prop_assert!(!signal_reached(target.wrapping_sub(d), target));
            }
        }

        #[test]
        fn counter_rolling_compare_matches_model(target in 0u64..(1 << 56), d in 0u64..(1 << 55)) {
            prop_assert!(counter_reached(target.wrapping_add(d) & COUNTER_MASK, target));
            if d > 0 {
                prop_assert!(!counter_reached(target.wrapping_sub(d) & COUNTER_MASK, target));
            }
            // Bits above 56 never matter.
            prop_assert!(counter_reached((target + d) | (0xff << 56), target));
        }
    }

    /// A peer wrote the awaited value and then left: the health check that
    /// reports the departure must not fail a wait that is satisfied.
    #[test]
    fn a_wait_satisfied_before_a_peer_left_succeeds() {
        let abort = std::sync::atomic::AtomicU32::new(0);
        let written = std::cell::Cell::new(false);
        let r = poll(
            Duration::from_secs(60),
            &abort,
            || written.get(),
            || {
                // The value landed just before the news of the departure.
                written.set(true);
                Err("rank 1 exited")
            },
        );
        assert!(r.is_ok(), "{r:?}");
        let r = poll(
            Duration::from_secs(60),
            &abort,
            || false,
            || Err("rank 1 exited"),
        );
        assert!(matches!(r, Err(Stop::Failed("rank 1 exited"))), "{r:?}");
    }

    #[test]
    fn wraparound_edges() {
        assert!(signal_reached(0, u64::MAX));
        assert!(signal_reached(5, u64::MAX - 3));
        assert!(!signal_reached(u64::MAX, 0));
        assert!(counter_reached(0, COUNTER_MASK));
        assert!(!counter_reached(COUNTER_MASK, 0));
        assert!(counter_reached(3, COUNTER_MASK - 2));
    }
}
