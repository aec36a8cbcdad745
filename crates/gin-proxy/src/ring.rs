//! Descriptor rings: one per (context, peer), power-of-two sized.
//!
//! Producers reserve a sequence number with a fetch-add on `head`, wait for
//! credit (the slot's previous occupant consumed: `seq < tail + size`), write
//! the descriptor's eight qwords, and the phase bits publish it. The single
//! consumer (the proxy) reads in sequence order, executes, and advances
//! `tail`; `done` trails it for operations whose completion comes later
//! (none today: puts and shm gets complete on execution, TCP gets count in
//! `gets_in_flight`).
//!
//! Sequence numbers are u64 and never wrap in practice; the arithmetic below
//! is written with wrapping operations anyway and property-tested across
//! 2^64.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::descriptor::{DESC_QWORDS, DecodeError, Desc, Slot, decode};

/// The slot a sequence number occupies.
pub fn slot_of(seq: u64, mask: u64) -> usize {
    (seq & mask) as usize
}

/// Whether the producer of `seq` may write: the slot's previous occupant
/// (`seq - size`) has been consumed, i.e. `seq - tail < size` in wrapping
/// arithmetic.
pub fn has_credit(seq: u64, tail: u64, size: u64) -> bool {
    seq.wrapping_sub(tail) < size
}

/// Whether every sequence number before `mark` has been passed by `progress`
/// (both advance monotonically; wrapping compare).
pub fn passed(progress: u64, mark: u64) -> bool {
    (progress.wrapping_sub(mark) as i64) >= 0
}

#[repr(C, align(64))]
struct Line([AtomicU64; DESC_QWORDS]);

#[repr(C, align(64))]
struct Padded(AtomicU64);

/// A ring of descriptors.
pub struct Ring {
    slots: Box<[Line]>,
    log2: u32,
    mask: u64,
    head: Padded,
    tail: Padded,
    /// Gets issued from this ring whose data has not landed.
    pub gets_in_flight: std::sync::Arc<AtomicU64>,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring")
            .field("size", &self.slots.len())
            .field("head", &self.head())
            .field("tail", &self.tail())
            .finish_non_exhaustive()
    }
}

impl Ring {
    /// A ring of `2^log2` descriptors.
    pub fn new(log2: u32) -> Self {
        let n = 1usize << log2;
        Self {
            slots: (0..n)
                .map(|_| Line(std::array::from_fn(|_| AtomicU64::new(0))))
                .collect(),
            log2,
            mask: (n as u64) - 1,
            head: Padded(AtomicU64::new(0)),
            tail: Padded(AtomicU64::new(0)),
            gets_in_flight: std::sync::Arc::new(AtomicU64::new(0)),
        }
    }

    pub fn size(&self) -> u64 {
        self.mask + 1
    }

    /// Sequence numbers reserved so far.
    pub fn head(&self) -> u64 {
        self.head.0.load(Ordering::Acquire)
    }

    /// Sequence numbers consumed so far.
    pub fn tail(&self) -> u64 {
        self.tail.0.load(Ordering::Acquire)
    }

    /// Reserves the next sequence number (several producers may race).
    pub fn reserve(&self) -> u64 {
        self.head.0.fetch_add(1, Ordering::AcqRel)
    }

    /// Whether `seq`'s slot is free to write.
    pub fn can_write(&self, seq: u64) -> bool {
        has_credit(seq, self.tail(), self.size())
    }

    /// Writes the descriptor for `seq`; the caller has waited for credit.
    /// Each qword is stored with release ordering, so the consumer that sees
    /// all eight phases also sees the data the producer wrote before.
    pub fn write(&self, seq: u64, d: &Desc) {
        let q = d.encode(seq, self.log2);
        let line = &self.slots[slot_of(seq, self.mask)].0;
        for (cell, v) in line.iter().zip(q) {
            cell.store(v, Ordering::Release);
        }
    }

    /// The consumer's view of `seq` (the next unconsumed sequence number).
    pub fn peek(&self, seq: u64) -> Result<Slot, DecodeError> {
        let line = &self.slots[slot_of(seq, self.mask)].0;
        let q: [u64; DESC_QWORDS] = std::array::from_fn(|i| line[i].load(Ordering::Acquire));
        decode(&q, seq, self.log2)
    }

    /// Marks everything before `seq` consumed (the consumer only).
    pub fn advance(&self, seq: u64) {
        self.tail.0.store(seq, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::descriptor::Op;
    use proptest::prelude::*;
    use std::collections::VecDeque;

    proptest! {
        /// Credit against a model: a ring holds at most `size` unconsumed
        /// entries, wherever the counters sit in u64 space.
        #[test]
        fn credit_matches_a_model(start in any::<u64>(), log2 in 0u32..8, ops in proptest::collection::vec(any::<bool>(), 1..400)) {
            let size = 1u64 << log2;
            let (mut head, mut tail) = (start, start);
            let mut model: VecDeque<u64> = VecDeque::new();
            for produce in ops {
                if produce {
                    let ok = has_credit(head, tail, size);
                    prop_assert_eq!(ok, (model.len() as u64) < size);
                    if ok {
                        model.push_back(head);
                        head = head.wrapping_add(1);
                    }
                } else if let Some(seq) = model.pop_front() {
                    prop_assert_eq!(seq, tail);
                    tail = tail.wrapping_add(1);
                }
                prop_assert_eq!(head.wrapping_sub(tail), model.len() as u64);
                prop_assert!(passed(head, tail));
            }
        }

        #[test]
        fn slots_cycle_through_the_ring(seq in any::<u64>(), log2 in 0u32..16) {
            let mask = (1u64 << log2) - 1;
            let s = slot_of(seq, mask);
            prop_assert!((s as u64) <= mask);
            prop_assert_eq!(slot_of(seq.wrapping_add(1 << log2), mask), s);
        }

        #[test]
        fn passed_is_a_rolling_compare(mark in any::<u64>(), d in 0u64..(1 << 62)) {
            prop_assert!(passed(mark.wrapping_add(d), mark));
            if d > 0 {
                prop_assert!(!passed(mark.wrapping_sub(d), mark));
            }
        }
    }

    fn put(i: u64) -> Desc {
        Desc {
            op: Op::Put,
            bytes: i,
            dst_window: 1,
            dst_offset: i,
            src_window: 2,
            src_offset: 0,
            inline: None,
            signal: None,
            counter: None,
        }
    }

    /// Many producers, one consumer, random delays: every descriptor arrives
    /// exactly once, in sequence order, intact.
    #[test]
    fn concurrent_producers_publish_in_order() {
        use std::sync::Arc;
        let ring = Arc::new(Ring::new(3));
        let producers = 4;
        let per = 2000u64;
        let hs: Vec<_> = (0..producers)
            .map(|p| {
                let ring = ring.clone();
                std::thread::spawn(move || {
                    let mut x = 0x9e37_79b9u64 + p;
                    for _ in 0..per {
                        let seq = ring.reserve();
                        while !ring.can_write(seq) {
                            std::thread::yield_now();
                        }
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        if x.is_multiple_of(7) {
                            std::thread::yield_now();
                        }
                        ring.write(seq, &put(seq));
                    }
                })
            })
            .collect();
        let total = producers * per;
        let mut seq = 0;
        while seq < total {
            match ring.peek(seq).unwrap() {
                Slot::Pending => std::thread::yield_now(),
                Slot::Ready(d) => {
                    assert_eq!(d, put(seq));
                    seq += 1;
                    ring.advance(seq);
                }
            }
        }
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!(ring.head(), total);
    }
}
