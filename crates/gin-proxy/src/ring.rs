//! Descriptor rings: one per (context, peer), power-of-two sized.
//!
//! Producers reserve a sequence number with a fetch-add on `head`, wait for
//! credit (the slot's previous occupant completed: `seq < tail + size`),
//! write the descriptor's eight qwords, and the phase bits publish it. The
//! single consumer (the proxy engine) reads in sequence order through a
//! [`RingMem`] view, and its executor publishes the completion index
//! (`tail`) in order, once everything before it is complete: a get whose
//! answer is still in flight holds it back.
//!
//! [`Ring`] is a ring in Rust memory (CPU ranks); [`RingMem`] is the
//! engine's read-only view of either such a ring or one in foreign memory
//! (mapped pinned host memory a GPU writes, whose completion index lives in
//! device memory and is published by the CUDA executor).
//!
//! Sequence numbers are u64 and never wrap in practice; the arithmetic below
//! is written with wrapping operations anyway and property-tested across
//! 2^64.

use std::any::Any;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::descriptor::{DESC_BYTES, DESC_QWORDS, DecodeError, Desc, Slot, decode};
use crate::error::RingMemError;
use crate::proxy::{MAX_QUEUE_DEPTH, MIN_QUEUE_DEPTH};

/// The slot a sequence number occupies.
pub(crate) fn slot_of(seq: u64, mask: u64) -> usize {
    (seq & mask) as usize
}

/// Whether the producer of `seq` may write: the slot's previous occupant
/// (`seq - size`) has completed, i.e. `seq - tail < size` in wrapping
/// arithmetic.
pub(crate) fn has_credit(seq: u64, tail: u64, size: u64) -> bool {
    seq.wrapping_sub(tail) < size
}

/// Whether every sequence number before `mark` has been passed by `progress`
/// (both advance monotonically; wrapping compare).
pub(crate) fn passed(progress: u64, mark: u64) -> bool {
    (progress.wrapping_sub(mark) as i64) >= 0
}

type Qwords = [AtomicU64; DESC_QWORDS];

#[repr(C, align(64))]
struct Line(Qwords);

#[repr(C, align(64))]
struct Padded(AtomicU64);

/// A ring of descriptors in Rust memory, with its producer index (`head`)
/// and completion index (`tail`).
pub struct Ring {
    slots: Box<[Line]>,
    log2: u32,
    mask: u64,
    head: Padded,
    tail: Padded,
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
        }
    }

    /// A ring whose first sequence number is `first` (tests of wraparound):
    /// every slot holds the phase of the lap before the one `first` starts,
    /// as if the ring had run from 0.
    #[cfg(test)]
    pub(crate) fn starting_at(log2: u32, first: u64) -> Self {
        let r = Self::new(log2);
        let size = r.size();
        for i in 0..size {
            // The first sequence number to occupy slot `i` from `first` on.
            let seq = first.wrapping_add(i.wrapping_sub(first) & r.mask);
            let stale = (crate::descriptor::phase_of(seq, log2) ^ 1) << 63;
            for q in &r.slots[slot_of(seq, r.mask)].0 {
                q.store(stale, Ordering::Relaxed);
            }
        }
        r.head.0.store(first, Ordering::Relaxed);
        r.tail.0.store(first, Ordering::Relaxed);
        r
    }

    /// Descriptors the ring holds.
    pub fn size(&self) -> u64 {
        self.mask + 1
    }

    /// log2 of [`Ring::size`].
    pub fn log2(&self) -> u32 {
        self.log2
    }

    /// Sequence numbers reserved so far.
    pub fn head(&self) -> u64 {
        self.head.0.load(Ordering::Acquire)
    }

    /// Sequence numbers completed so far (the published completion index).
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
        self.write_qwords(seq, &d.encode(seq, self.log2));
    }

    /// Writes raw qwords at `seq`'s slot (tests write corrupt descriptors).
    pub(crate) fn write_qwords(&self, seq: u64, q: &[u64; DESC_QWORDS]) {
        let line = &self.slots[slot_of(seq, self.mask)].0;
        for (cell, &v) in line.iter().zip(q) {
            cell.store(v, Ordering::Release);
        }
    }

    /// The consumer's view of `seq` (the next unconsumed sequence number).
    pub fn peek(&self, seq: u64) -> Result<Slot, DecodeError> {
        read(&self.slots[slot_of(seq, self.mask)].0, seq, self.log2)
    }

    /// Publishes the completion index: everything before `seq` is complete
    /// (the consumer's executor only).
    pub fn advance(&self, seq: u64) {
        self.tail.0.store(seq, Ordering::Release);
    }
}

fn read(line: &Qwords, seq: u64, log2: u32) -> Result<Slot, DecodeError> {
    let q: [u64; DESC_QWORDS] = std::array::from_fn(|i| line[i].load(Ordering::Acquire));
    decode(&q, seq, log2)
}

/// The proxy engine's read-only view of a ring's descriptor slots, wherever
/// they live: a [`Ring`] in Rust memory, or `2^log2` 64-byte slots in
/// foreign memory (mapped pinned host memory a GPU writes). The view never
/// writes; the completion index is published by the executor.
pub struct RingMem {
    slots: Slots,
    log2: u32,
}

enum Slots {
    Owned(Arc<Ring>),
    Foreign {
        base: NonNull<Qwords>,
        _owner: Box<dyn Any + Send>,
    },
}

// SAFETY: the view only ever loads the slots atomically, through shared
// references, and never touches `_owner`; a foreign view's constructor
// promised the memory stays valid (and atomically accessed) as long as the
// view lives, whichever thread holds it.
unsafe impl Send for RingMem {}
// SAFETY: as above: every access through `&RingMem` is an atomic load.
unsafe impl Sync for RingMem {}

impl std::fmt::Debug for RingMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.slots {
            Slots::Owned(_) => "owned",
            Slots::Foreign { .. } => "foreign",
        };
        f.debug_struct("RingMem")
            .field("memory", &kind)
            .field("size", &self.size())
            .finish_non_exhaustive()
    }
}

impl RingMem {
    /// A view of a ring in Rust memory.
    pub fn owned(ring: Arc<Ring>) -> Self {
        let log2 = ring.log2;
        Self {
            slots: Slots::Owned(ring),
            log2,
        }
    }

    /// A view of `2^log2` descriptor slots of 64 bytes at `base`, in memory
    /// this process does not own as Rust values (mapped pinned host memory
    /// that a GPU writes). `owner` is kept with the view and dropped with
    /// it: pass what keeps the memory mapped, if anything.
    ///
    /// # Safety
    ///
    /// For as long as the returned view lives, `base` must point to
    /// `64 << log2` bytes that stay mapped and readable, and that nobody
    /// accesses except through atomic (or, from a device, naturally aligned
    /// 8-byte or wider) loads and stores. The view only loads.
    pub unsafe fn foreign(
        base: *const u8,
        log2: u32,
        owner: Box<dyn Any + Send>,
    ) -> Result<Self, RingMemError> {
        let (min, max) = (MIN_QUEUE_DEPTH.ilog2(), MAX_QUEUE_DEPTH.ilog2());
        if !(min..=max).contains(&log2) {
            return Err(RingMemError::Size { log2, min, max });
        }
        let addr = base as usize;
        let base = NonNull::new(base.cast_mut().cast::<Qwords>())
            .filter(|_| addr.is_multiple_of(8))
            .ok_or(RingMemError::Misaligned { addr })?;
        Ok(Self {
            slots: Slots::Foreign {
                base,
                _owner: owner,
            },
            log2,
        })
    }

    /// Descriptors the ring holds.
    pub fn size(&self) -> u64 {
        1 << self.log2
    }

    /// log2 of [`RingMem::size`].
    pub fn log2(&self) -> u32 {
        self.log2
    }

    /// What the consumer finds at `seq`.
    pub fn peek(&self, seq: u64) -> Result<Slot, DecodeError> {
        match &self.slots {
            Slots::Owned(r) => r.peek(seq),
            Slots::Foreign { base, .. } => {
                let i = slot_of(seq, self.size() - 1);
                // SAFETY: `i` is below the ring's size, so the slot lies in
                // the `64 << log2` bytes the constructor's caller promised
                // valid and only atomically accessed while the view lives;
                // `base` is 8-byte aligned, as `AtomicU64` needs.
                let line = unsafe { &*base.as_ptr().byte_add(i * DESC_BYTES) };
                read(line, seq, self.log2)
            }
        }
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
