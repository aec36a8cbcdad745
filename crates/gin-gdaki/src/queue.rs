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

/// A doorbell record naming a producer index more than a queue's depth
/// ahead of the NIC's consumer index: the record moved backwards or jumped
/// past WQEs the producer had no credit for. Hardware moves the QP to the
/// error state; nothing past the consumer index may execute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BadProducerIndex {
    /// The 16-bit producer index the record holds.
    pub pi: u16,
    /// The NIC's consumer index (the next WQE it would execute).
    pub ci: u64,
    /// WQEs the record claims are posted: `pi - ci` modulo 2^16.
    pub ahead: u16,
    /// The queue's depth.
    pub size: u64,
}

impl std::fmt::Display for BadProducerIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the doorbell record's producer index {} is {} WQEs ahead of consumer index {} \
             (16-bit {}), more than the {}-entry queue holds: it moved backwards or jumped",
            self.pi, self.ahead, self.ci, self.ci as u16, self.size
        )
    }
}

/// The 64-bit producer index a doorbell record's 16-bit `pi` names, for a
/// NIC whose consumer index is `ci` on a queue of `size` WQEs: `ci` plus
/// `pi - ci` (16-bit wrapping), provided that is at most `size` (a producer
/// never posts WQEs it has no credit for). Anything further ahead, which is
/// also what a record that moved backwards reads as, is an error.
pub fn producer_index(pi: u16, ci: u64, size: u64) -> Result<u64, BadProducerIndex> {
    let ahead = pi.wrapping_sub(ci as u16);
    if u64::from(ahead) > size {
        return Err(BadProducerIndex {
            pi,
            ci,
            ahead,
            size,
        });
    }
    Ok(ci.wrapping_add(u64::from(ahead)))
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

        /// A doorbell record is accepted exactly when the producer it names
        /// is 0..=size WQEs past the consumer; a record that moved backwards
        /// or jumped is refused, across 2^16 (and 2^64) wraparound.
        #[test]
        fn producer_indices_more_than_a_queue_ahead_are_refused(
            ci in prop_oneof![Just(0u64), Just((1 << 16) - 3), Just((1 << 32) - 2), Just(u64::MAX - 4), any::<u64>()],
            log2 in 0u32..=14,
            delta in any::<u16>(),
        ) {
            let size = 1u64 << log2;
            // The model: the producer is `delta` WQEs past the consumer
            // (modulo 2^16, all the record carries); a real producer is at
            // most `size` ahead.
            let producer = ci.wrapping_add(u64::from(delta));
            let got = producer_index(wire_index(producer), ci, size);
            if u64::from(delta) <= size {
                prop_assert_eq!(got, Ok(producer));
            } else {
                let e = got.unwrap_err();
                prop_assert_eq!((e.pi, e.ci, e.ahead, e.size), (producer as u16, ci, delta, size));
            }
            // A record that moved back by `b` (1..2^16 - size) is refused.
            let back = u64::from(delta).clamp(1, (1 << 16) - size - 1);
            prop_assert!(producer_index(wire_index(ci.wrapping_sub(back)), ci, size).is_err());
        }

        #[test]
        fn slots_cycle(idx in any::<u64>(), log2 in 0u32..17) {
            let mask = (1u64 << log2) - 1;
            prop_assert_eq!(slot(idx, mask), slot(idx.wrapping_add(1 << log2), mask));
            prop_assert!((slot(idx, mask) as u64) <= mask);
        }
    }

    #[test]
    fn producer_index_edges() {
        // Full queue at the 2^16 boundary: accepted.
        assert_eq!(producer_index(4, 0xfffc, 8), Ok(0x1_0004));
        // One past a full queue, and one step backwards: refused.
        assert!(producer_index(10, 1, 8).is_err());
        let e = producer_index(1, 2, 4).unwrap_err();
        assert_eq!(e.ahead, 0xffff);
        assert!(e.to_string().contains("producer index 1"), "{e}");
        // Nothing new.
        assert_eq!(producer_index(7, 0x3_0007, 1), Ok(0x3_0007));
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
