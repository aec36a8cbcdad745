//! Send-queue bookkeeping: reserve, mark ready, post; and the arithmetic
//! that maps 64-bit indices onto the 16-bit WQE counters the NIC uses.
//!
//! Indices are u64 and only grow: `resv` (next WQE to hand out), `ready`
//! (every WQE before it is filled), `posted` (the producer index last
//! written to the doorbell record) and `done` (every WQE before it has
//! completed, from CQ polling). The queue holds `size` basic blocks; a
//! reservation may proceed when `start + n - done <= size`.
//!
//! Sharing modes decide how `ready` advances, as in NCCL's GIN:
//! - `Thread`: one thread owns the queue; a plain store of `to + 1`.
//! - `Cta` / `Gpu`: several threads fill disjoint ranges in parallel; each
//!   marks its range ready with a compare-and-swap from `from` to `to + 1`,
//!   which succeeds only once every earlier range is ready, so `ready` only
//!   ever covers filled WQEs.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Who may touch a queue concurrently.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharing {
    /// One thread.
    Thread,
    /// The threads of one CTA (CPU ranks: threads of one process).
    Cta,
    /// Any thread of the GPU (CPU ranks: any thread).
    Gpu,
}

/// Where WQE `idx` sits in a queue of `mask + 1` basic blocks.
pub fn slot(idx: u64, mask: u64) -> usize {
    (idx & mask) as usize
}

/// Whether `n` blocks starting at `start` fit: nothing older than
/// `start + n - size` is still outstanding.
pub fn has_space(start: u64, n: u64, done: u64, size: u64) -> bool {
    start.wrapping_add(n).wrapping_sub(done) <= size
}

/// The 16-bit WQE index the control segment and CQEs carry.
pub fn wire_index(idx: u64) -> u16 {
    idx as u16
}

/// Turns a CQE's 16-bit WQE counter into the 64-bit index it names, given a
/// 64-bit index `near` that is known to be within 2^15 below or above it
/// (the oldest outstanding WQE).
pub fn unwrap_counter(counter: u16, near: u64) -> u64 {
    let delta = counter.wrapping_sub(near as u16) as i16;
    near.wrapping_add(i64::from(delta) as u64)
}

/// Is `progress` at or past `mark` (rolling compare).
pub fn reached(progress: u64, mark: u64) -> bool {
    (progress.wrapping_sub(mark) as i64) >= 0
}

/// The shared indices of one send queue.
#[derive(Debug, Default)]
pub struct SqIndices {
    pub resv: AtomicU64,
    pub ready: AtomicU64,
    pub posted: AtomicU64,
    pub done: AtomicU64,
    lock: AtomicBool,
}

impl SqIndices {
    /// Takes `n` consecutive WQE indices.
    pub fn reserve(&self, n: u64) -> u64 {
        self.resv.fetch_add(n, Ordering::AcqRel)
    }

    /// Marks `[from, to]` filled. Returns false (and changes nothing) while
    /// an earlier range is not ready yet in the CAS modes; the caller spins.
    pub fn try_mark_ready(&self, from: u64, to: u64, mode: Sharing) -> bool {
        match mode {
            Sharing::Thread => {
                self.ready.store(to.wrapping_add(1), Ordering::Release);
                true
            }
            Sharing::Cta | Sharing::Gpu => self
                .ready
                .compare_exchange(
                    from,
                    to.wrapping_add(1),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok(),
        }
    }

    /// Advances the producer index to what is ready, under the post lock,
    /// and calls `ring(pi)` with the new producer index if it moved (to
    /// write the doorbell record and the doorbell). Posting is a max: a
    /// thread that finds the index already past its WQEs has nothing to do.
    pub fn post(&self, ring: impl FnOnce(u64)) {
        while self
            .lock
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            std::hint::spin_loop();
        }
        let ready = self.ready.load(Ordering::Acquire);
        let posted = self.posted.load(Ordering::Relaxed);
        if !reached(posted, ready) {
            self.posted.store(ready, Ordering::Release);
            ring(ready);
        }
        self.lock.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::VecDeque;

    proptest! {
        /// Space against a model queue of outstanding WQEs, anywhere in u64
        /// space (wraparound at 2^16, 2^32 and 2^64 included by the start).
        #[test]
        fn space_matches_a_model(start in prop_oneof![Just(0u64), Just((1 << 16) - 5), Just((1 << 32) - 7), Just(u64::MAX - 9), any::<u64>()],
                                 log2 in 0u32..7,
                                 ops in proptest::collection::vec((any::<bool>(), 1u64..5), 1..300)) {
            let size = 1u64 << log2;
            let (mut resv, mut done) = (start, start);
            let mut model: VecDeque<u64> = VecDeque::new();
            for (reserve, n) in ops {
                if reserve {
                    let ok = has_space(resv, n, done, size);
                    prop_assert_eq!(ok, model.len() as u64 + n <= size);
                    if ok {
                        for k in 0..n {
                            model.push_back(resv.wrapping_add(k));
                        }
                        resv = resv.wrapping_add(n);
                    }
                } else if let Some(idx) = model.pop_front() {
                    prop_assert_eq!(idx, done);
                    done = done.wrapping_add(1);
                }
                prop_assert!(reached(resv, done));
            }
        }

        /// A 16-bit counter unwraps to the index it names from anywhere
        /// within half the counter range.
        #[test]
        fn counters_unwrap(idx in any::<u64>(), d in -(1i64 << 15)..(1i64 << 15)) {
            let near = idx.wrapping_add(d as u64);
            prop_assert_eq!(unwrap_counter(wire_index(idx), near), idx);
        }

        #[test]
        fn slots_cycle(idx in any::<u64>(), log2 in 0u32..17) {
            let mask = (1u64 << log2) - 1;
            prop_assert_eq!(slot(idx, mask), slot(idx.wrapping_add(1 << log2), mask));
            prop_assert!((slot(idx, mask) as u64) <= mask);
        }
    }

    #[test]
    fn counter_wraparound_edges() {
        assert_eq!(unwrap_counter(0, 0xffff), 0x1_0000);
        assert_eq!(unwrap_counter(0xffff, 0x1_0000), 0xffff);
        assert_eq!(unwrap_counter(5, (1 << 32) - 3), (1 << 32) + 5);
        assert_eq!(wire_index((1 << 32) + 7), 7);
    }

    /// Many threads reserve ranges, fill them after random delays, and mark
    /// them ready with the CAS protocol; `ready` must never cover a range
    /// that is not filled, and must end at the total.
    #[test]
    fn cas_ready_marks_only_filled_prefixes() {
        use std::sync::Arc;
        use std::sync::atomic::AtomicU8;
        let q = Arc::new(SqIndices::default());
        let total = 4 * 2000u64;
        let filled: Arc<Vec<AtomicU8>> =
            Arc::new((0..total + 8).map(|_| AtomicU8::new(0)).collect());
        let posted_seen = Arc::new(AtomicU64::new(0));
        let hs: Vec<_> = (0..4u64)
            .map(|t| {
                let (q, filled, posted_seen) = (q.clone(), filled.clone(), posted_seen.clone());
                std::thread::spawn(move || {
                    let mut x = 0x2545_f491_4f6c_dd1d ^ (t + 1);
                    let mut mine = 0;
                    while mine < 2000 {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let n = (x % 3 + 1).min(2000 - mine);
                        let from = q.reserve(n);
                        let to = from + n - 1;
                        if x % 5 == 0 {
                            std::thread::yield_now();
                        }
                        for i in from..=to {
                            filled[i as usize].store(1, Ordering::Release);
                        }
                        // Yield, not spin: on two cores the predecessor we
                        // wait for may be descheduled.
                        while !q.try_mark_ready(from, to, Sharing::Gpu) {
                            std::thread::yield_now();
                        }
                        q.post(|pi| {
                            // Everything below the producer index is filled.
                            let seen = posted_seen.load(Ordering::Relaxed);
                            for i in seen..pi {
                                assert_eq!(
                                    filled[i as usize].load(Ordering::Acquire),
                                    1,
                                    "WQE {i} posted before it was filled"
                                );
                            }
                            posted_seen.store(pi, Ordering::Relaxed);
                        });
                        mine += n;
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!(q.ready.load(Ordering::Acquire), total);
        assert_eq!(q.posted.load(Ordering::Acquire), total);
    }
}
