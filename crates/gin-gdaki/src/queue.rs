//! Send-queue bookkeeping: reserve, fill, post in order; and the arithmetic
//! that maps 64-bit indices onto the 16-bit WQE counters the NIC uses.
//!
//! Indices are u64 and only grow: `resv` (next WQE to hand out), `ready`
//! (every WQE before it is filled and posted, in reservation order),
//! `posted` (the producer index last written to the doorbell record) and
//! `done` (every WQE before it has completed, from CQ polling). The queue
//! holds `size` basic blocks; a reservation may proceed when
//! `start + n - done <= size`.
//!
//! **The post protocol is the GPU's** (`gdaki.cuh`'s `submit`), so CI runs
//! what kernels run: a producer reserves with a fetch-add, waits for
//! credit, fills its slots, then waits until every earlier range is posted
//! (`ready == start`), writes the doorbell record and rings, and hands over
//! with `ready = end`. Records are written in reservation order, so the
//! record never moves backwards and never covers an unfilled WQE, with no
//! lock. [`Sharing`] says who may hold a turn: with [`Sharing::Thread`] one
//! thread owns the queue and posts without waiting.

use std::sync::atomic::{AtomicU64, Ordering};

/// Who may touch a queue concurrently: whether a producer must wait for
/// its turn to post.
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
pub(crate) fn slot(idx: u64, mask: u64) -> usize {
    (idx & mask) as usize
}

/// Whether `n` blocks starting at `start` fit: nothing older than
/// `start + n - size` is still outstanding.
pub fn has_space(start: u64, n: u64, done: u64, size: u64) -> bool {
    start.wrapping_add(n).wrapping_sub(done) <= size
}

/// The 16-bit WQE index the control segment and CQEs carry.
pub(crate) fn wire_index(idx: u64) -> u16 {
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
    /// The next WQE index to hand out.
    pub resv: AtomicU64,
    /// Every WQE before it is filled and posted (or held back by doorbell
    /// batching), in reservation order: the turn to post.
    pub ready: AtomicU64,
    /// The producer index the doorbell record last received.
    pub posted: AtomicU64,
    /// Every WQE before it has completed (the device side's CQ polling).
    pub done: AtomicU64,
}

impl SqIndices {
    /// Takes `n` consecutive WQE indices.
    pub fn reserve(&self, n: u64) -> u64 {
        self.resv.fetch_add(n, Ordering::AcqRel)
    }

    /// Posts the filled range `[start, end)` in reservation order: once
    /// every earlier range is posted (`ready == start`; at once for
    /// [`Sharing::Thread`]), calls `publish` (write the doorbell record and
    /// ring, or hold the doorbell back) and hands the turn over
    /// (`ready = end`, release). Returns false, changing nothing, while an
    /// earlier range is not posted yet; the caller tries again.
    pub fn try_post(&self, start: u64, end: u64, mode: Sharing, publish: impl FnOnce()) -> bool {
        if mode != Sharing::Thread && self.ready.load(Ordering::Acquire) != start {
            return false;
        }
        publish();
        self.ready.store(end, Ordering::Release);
        true
    }

    /// Records that the doorbell record now names `pi` (never moving
    /// `posted` backwards, in the rolling order of [`reached`]).
    pub fn mark_posted(&self, pi: u64) {
        let mut cur = self.posted.load(Ordering::Acquire);
        while !reached(cur, pi) {
            match self
                .posted
                .compare_exchange_weak(cur, pi, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return,
                Err(now) => cur = now,
            }
        }
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

    /// Many threads reserve ranges, fill them after random delays, and post
    /// them with the in-order protocol; the producer index a post publishes
    /// must never cover a WQE that is not filled, must only grow, and must
    /// end at the total.
    #[test]
    fn in_order_posts_publish_only_filled_prefixes_and_never_move_back() {
        use std::sync::Arc;
        use std::sync::atomic::AtomicU8;
        let q = Arc::new(SqIndices::default());
        let total = 4 * 2000u64;
        let filled: Arc<Vec<AtomicU8>> =
            Arc::new((0..total + 8).map(|_| AtomicU8::new(0)).collect());
        let record = Arc::new(AtomicU64::new(0));
        let hs: Vec<_> = (0..4u64)
            .map(|t| {
                let (q, filled, record) = (q.clone(), filled.clone(), record.clone());
                std::thread::spawn(move || {
                    let mut x = 0x2545_f491_4f6c_dd1d ^ (t + 1);
                    let mut mine = 0;
                    while mine < 2000 {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let n = (x % 3 + 1).min(2000 - mine);
                        let from = q.reserve(n);
                        let end = from + n;
                        if x % 5 == 0 {
                            std::thread::yield_now();
                        }
                        for i in from..end {
                            filled[i as usize].store(1, Ordering::Release);
                        }
                        // Yield, not spin: on two cores the predecessor we
                        // wait for may be descheduled.
                        while !q.try_post(from, end, Sharing::Gpu, || {
                            // Everything below the new producer index is
                            // filled, and the record only grows.
                            let seen = record.load(Ordering::Relaxed);
                            assert!(end > seen, "the record moved from {seen} to {end}");
                            for i in seen..end {
                                assert_eq!(
                                    filled[i as usize].load(Ordering::Acquire),
                                    1,
                                    "WQE {i} posted before it was filled"
                                );
                            }
                            record.store(end, Ordering::Relaxed);
                            q.mark_posted(end);
                        }) {
                            std::thread::yield_now();
                        }
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
        assert_eq!(record.load(Ordering::Acquire), total);
    }

    /// Out of turn, a post changes nothing; in turn, it publishes and hands
    /// over; one thread (`Sharing::Thread`) never waits.
    #[test]
    fn a_post_out_of_turn_changes_nothing() {
        let q = SqIndices::default();
        let (a, b) = (q.reserve(2), q.reserve(3));
        let mut published = Vec::new();
        assert!(!q.try_post(b, b + 3, Sharing::Cta, || published.push(b + 3)));
        assert_eq!(q.ready.load(Ordering::Acquire), 0);
        assert!(q.try_post(a, a + 2, Sharing::Cta, || published.push(a + 2)));
        assert!(q.try_post(b, b + 3, Sharing::Cta, || published.push(b + 3)));
        assert_eq!(published, vec![2, 5]);
        assert_eq!(q.ready.load(Ordering::Acquire), 5);
        let t = SqIndices::default();
        assert!(t.try_post(0, 1, Sharing::Thread, || ()));
        q.mark_posted(5);
        q.mark_posted(3);
        assert_eq!(
            q.posted.load(Ordering::Acquire),
            5,
            "posted never moves back"
        );
    }
}
