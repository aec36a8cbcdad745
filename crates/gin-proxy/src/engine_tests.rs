//! Step tests of the engine against the fake executor: no threads, no
//! sleeps, no clocks; every test drives the engine and the fake by hand.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use proptest::prelude::*;

use super::*;
use crate::descriptor::{DESC_QWORDS, DecodeError, Sig};
use crate::error::{ExecError, RingMemError};
use crate::ring::Ring;
use crate::testing::{Call, Event, Fake};

const RANK: usize = 0;
const NRANKS: usize = 3;
/// Window 1: data on every rank; 2: signals; 3: where gets land.
const DATA: u32 = 1;
const SIGNALS: u32 = 2;
const LANDING: u32 = 3;

/// An engine and a fake executor, stepped by hand (quinn-proto's `Pair`).
struct Pair {
    engine: Engine<Fake>,
    fake: Fake,
    rings: Vec<Arc<Ring>>,
}

/// Rings (context 0) to `peers`, of `2^log2` descriptors starting at
/// sequence `first`, drained `batch` at a time.
fn pair(peers: &[usize], log2: u32, first: u64, batch: u64) -> Pair {
    let mut fake = Fake::new(RANK, 4);
    fake.add_window(DATA, &[4096; NRANKS]);
    fake.add_window(SIGNALS, &[64; NRANKS]);
    fake.add_window(LANDING, &[4096; NRANKS]);
    let pattern: Vec<u8> = (0..4096).map(|i| (i * 7 + 3) as u8).collect();
    fake.write(RANK, DATA, 0, &pattern);
    for p in 1..NRANKS {
        let theirs: Vec<u8> = (0..4096).map(|i| (i * 13 + p * 5) as u8).collect();
        fake.write(p, DATA, 0, &theirs);
    }
    let rings: Vec<Arc<Ring>> = peers
        .iter()
        .map(|_| Arc::new(Ring::starting_at(log2, first)))
        .collect();
    for (i, r) in rings.iter().enumerate() {
        fake.attach(i, r.clone());
    }
    let specs = peers
        .iter()
        .zip(&rings)
        .map(|(&peer, r)| RingSpec {
            ctx: 0,
            peer,
            mem: RingMem::owned(r.clone()),
            first,
        })
        .collect();
    let config = EngineConfig {
        rank: RANK,
        batch,
        counter_slots: 4,
    };
    Pair {
        engine: Engine::new(config, specs),
        fake,
        rings,
    }
}

impl Pair {
    fn step(&mut self) -> Progress {
        self.engine.step(&mut self.fake)
    }

    /// Whether a producer of ring `i` has credit for its next descriptor.
    fn credit(&self, i: usize) -> bool {
        let r = &self.rings[i];
        r.can_write(r.head())
    }

    /// Writes `d` into ring `i`, which must have credit; returns its seq.
    fn push(&self, i: usize, d: &Desc) -> u64 {
        assert!(self.credit(i), "ring {i} has no credit");
        let seq = self.rings[i].reserve();
        self.rings[i].write(seq, d);
        seq
    }

    /// Steps (and runs the fake's queues) until nothing moves.
    fn settle(&mut self) {
        loop {
            self.fake.run_all();
            if !self.step().did_work() && (0..self.rings.len()).all(|i| self.fake.queued(i) == 0) {
                break;
            }
        }
    }

    fn puts(&self) -> Vec<(usize, Option<u64>)> {
        self.fake
            .calls()
            .iter()
            .filter_map(|c| match c {
                Call::Put { site, dst, .. } => Some((site.ring, *dst)),
                _ => None,
            })
            .collect()
    }
}

fn put(off: u64, bytes: u64) -> Desc {
    Desc {
        op: Op::Put,
        bytes,
        dst_window: DATA,
        dst_offset: off,
        src_window: DATA,
        src_offset: off,
        inline: None,
        signal: None,
        counter: None,
    }
}

fn signalled(mut d: Desc, offset: u64, add: u64, strong: bool) -> Desc {
    d.signal = Some(Sig {
        window: SIGNALS,
        offset,
        add,
        strong,
    });
    d
}

fn counted(mut d: Desc, slot: u32) -> Desc {
    d.counter = Some(slot);
    d
}

fn get(remote: u64, local: u64, bytes: u64) -> Desc {
    Desc {
        op: Op::Get,
        bytes,
        dst_window: DATA,
        dst_offset: remote,
        src_window: LANDING,
        src_offset: local,
        inline: None,
        signal: None,
        counter: None,
    }
}

/// Pushes `n` signal-only puts through ring 0, stepping whenever credit
/// runs out; every signal total and every sequence number must come out
/// in order.
fn pump(p: &mut Pair, n: u64) {
    for _ in 0..n {
        while !p.credit(0) {
            assert!(p.step().did_work(), "no credit and no progress");
        }
        p.push(0, &signalled(put(0, 0), 8, 1, false));
    }
    p.settle();
}

#[test]
fn sequences_wrap_past_2_16_in_the_largest_and_the_smallest_ring() {
    let n = (1u64 << 16) + 100;
    for log2 in [16, 1] {
        let mut p = pair(&[1], log2, 0, 64);
        pump(&mut p, n);
        assert_eq!(p.engine.published(0), Some(n), "ring of 2^{log2}");
        assert_eq!(p.rings[0].tail(), n);
        // The signal's running total counts every put once, in order.
        let totals: Vec<u64> = p
            .fake
            .calls()
            .iter()
            .filter_map(|c| match c {
                Call::Put { signal, .. } => *signal,
                _ => None,
            })
            .collect();
        assert!(totals.iter().copied().eq(1..=n), "ring of 2^{log2}");
        assert_eq!(p.fake.read_u64(1, SIGNALS, 8), n);
        assert!(p.engine.failure().is_none());
    }
}

#[test]
fn sequences_cross_the_u32_u63_and_u64_boundaries() {
    for first in [(1u64 << 32) - 5, (1 << 63) - 5, u64::MAX - 5] {
        let mut p = pair(&[1], 2, first, 3);
        pump(&mut p, 20);
        assert_eq!(
            p.engine.published(0),
            Some(first.wrapping_add(20)),
            "from {first}"
        );
        assert_eq!(p.fake.read_u64(1, SIGNALS, 8), 20, "from {first}");
        assert!(p.engine.failure().is_none(), "from {first}");
    }
}

/// Credit is the *published* completion index: with an executor that
/// completes late (a CUDA stream), a consumed slot is not free until the
/// store of the index after its data has executed.
#[test]
fn credit_returns_only_when_completion_is_published() {
    let mut p = pair(&[1], 2, 0, 64);
    p.fake.set_queued(true);
    for i in 0..4 {
        p.push(0, &put(i * 8, 8));
    }
    assert!(!p.credit(0), "a ring of 4 holds 4");
    let did = p.step();
    assert_eq!(did.executed, 4);
    assert_eq!(p.engine.published(0), Some(4));
    // Handed over, not yet complete: still no credit.
    assert!(!p.credit(0));
    assert_eq!(p.fake.queued(0), 5, "four copies, then the publication");
    p.fake.run(0, 4);
    assert!(!p.credit(0), "the data landed, the index did not");
    p.fake.run(0, 1);
    assert!(p.credit(0));
    assert_eq!(p.rings[0].tail(), 4);
    // Nothing new: a step does nothing.
    assert!(!p.step().did_work());
}

#[test]
fn each_ring_gives_at_most_a_batch_per_step_and_all_take_turns() {
    let mut p = pair(&[0, 1, 2], 5, 0, 4);
    for i in 0..3 {
        for k in 0..10 {
            p.push(i, &put(k * 8, 8));
        }
    }
    let did = p.step();
    assert_eq!(did.executed, 12);
    assert_eq!(did.published, 3);
    let rings: Vec<usize> = p.puts().iter().map(|&(r, _)| r).collect();
    assert_eq!(rings, [[0; 4], [1; 4], [2; 4]].concat());
    // Each ring's batch ends with its publication and flush.
    let tail: Vec<Call> = p.fake.calls()[4..6].to_vec();
    assert!(
        matches!(
            tail[..],
            [Call::Publish { upto: 4, .. }, Call::Flush { .. }]
        ),
        "{tail:?}"
    );
    p.step();
    p.step();
    assert_eq!(p.puts().len(), 30);
    assert_eq!(
        (0..3).map(|i| p.engine.published(i)).collect::<Vec<_>>(),
        [Some(10); 3]
    );
    assert!(!p.step().did_work());
}

#[test]
fn a_strong_signal_lands_after_its_data_and_carries_the_running_total() {
    let mut p = pair(&[1], 3, 0, 64);
    p.fake.set_queued(true);
    p.push(0, &signalled(put(64, 16), 8, 3, true));
    p.push(0, &signalled(put(128, 8), 8, 4, true));
    p.step();
    let sent = &p.fake.read(RANK, DATA, 64, 16).to_vec();
    assert_eq!(
        p.fake.queued(0),
        5,
        "data, signal, data, signal, publication"
    );
    p.fake.run(0, 1);
    assert_eq!(p.fake.read(1, DATA, 64, 16), &sent[..]);
    assert_eq!(p.fake.read_u64(1, SIGNALS, 8), 0, "data first");
    p.fake.run(0, 1);
    assert_eq!(p.fake.read_u64(1, SIGNALS, 8), 3);
    assert_eq!(p.fake.published(0), None);
    p.fake.run(0, 3);
    assert_eq!(p.fake.read_u64(1, SIGNALS, 8), 7);
    let totals: Vec<u64> = p
        .fake
        .log()
        .iter()
        .filter_map(|e| match e {
            Event::Signal { total, .. } => Some(*total),
            _ => None,
        })
        .collect();
    assert_eq!(totals, [3, 7]);
    assert_eq!(p.fake.published(0), Some(2));
}

#[test]
fn a_counter_is_bumped_after_its_operation_completes_locally() {
    let mut p = pair(&[1], 3, 0, 64);
    p.fake.set_queued(true);
    p.push(0, &counted(put(0, 8), 2));
    p.step();
    assert_eq!(p.fake.counter(2), 0);
    p.fake.run(0, 1);
    assert_eq!(p.fake.counter(2), 0, "the data first");
    p.fake.run(0, 1);
    assert_eq!(p.fake.counter(2), 1);
    // A get in flight counts only when it lands.
    p.fake.set_queued(false);
    p.fake.set_late_gets(true);
    p.push(0, &counted(get(0, 0, 8), 2));
    p.step();
    assert_eq!(p.fake.counter(2), 1);
    p.fake.land_all();
    assert_eq!(p.fake.counter(2), 1, "landed, not yet seen by the engine");
    p.step();
    assert_eq!(p.fake.counter(2), 2);
    let last: Vec<&Event> = p.fake.log().iter().rev().take(3).collect();
    assert!(
        matches!(
            last[..],
            [
                Event::Publish { upto: 2, .. },
                Event::Count { slot: 2, total: 2 },
                Event::Got { .. }
            ]
        ),
        "{last:?}"
    );
}

#[test]
fn a_late_get_holds_the_completion_index_back_until_it_lands() {
    let mut p = pair(&[2], 3, 0, 64);
    p.fake.set_late_gets(true);
    p.push(0, &put(0, 8));
    p.push(0, &get(256, 512, 32));
    p.push(0, &put(8, 8));
    let did = p.step();
    assert_eq!(did.executed, 3, "the put after the get is executed too");
    assert_eq!(p.engine.published(0), Some(1), "not past the get");
    assert_eq!(p.rings[0].tail(), 1);
    assert_eq!(p.engine.in_flight(), 1);
    assert!(p.engine.has_work());
    // Polling it changes nothing until it lands.
    assert!(!p.step().did_work());
    assert_eq!(p.rings[0].tail(), 1);
    p.fake.land_all();
    let did = p.step();
    assert_eq!((did.landed, did.published), (1, 1));
    assert_eq!(p.rings[0].tail(), 3);
    assert_eq!(
        p.fake.read(RANK, LANDING, 512, 32),
        p.fake.read(2, DATA, 256, 32)
    );
    assert!(!p.engine.has_work());
}

/// Puts reported in flight (a put from GPU memory over ucx) hold the
/// completion index at the oldest one, whatever order they complete in:
/// later descriptors are still issued, and the index moves in ring order
/// as the oldest ones land; credit comes back only with it.
#[test]
fn puts_in_flight_hold_the_index_at_the_oldest_and_publish_in_order() {
    let mut p = pair(&[1], 3, 0, 64);
    p.fake.set_late_puts(true);
    for k in 0..4 {
        p.push(0, &put(k * 8, 8));
    }
    let did = p.step();
    assert_eq!((did.executed, did.published), (4, 0));
    assert_eq!(p.engine.in_flight(), 4);
    assert!(p.engine.has_work(), "in flight: poll, never sleep");
    assert_eq!(p.rings[0].tail(), 0);
    // The last two complete first: nothing moves.
    p.fake.complete_put(3);
    p.fake.complete_put(2);
    assert!(!p.step().did_work());
    assert_eq!(p.rings[0].tail(), 0);
    // The oldest completes: it alone lands (the next is still in flight).
    p.fake.complete_put(0);
    let did = p.step();
    assert_eq!((did.landed, did.published), (1, 1));
    assert_eq!(p.rings[0].tail(), 1);
    // The second: it and the two behind it land together.
    p.fake.complete_put(1);
    let did = p.step();
    assert_eq!((did.landed, did.published), (3, 1));
    assert_eq!(p.rings[0].tail(), 4);
    assert_eq!(p.engine.in_flight(), 0);
    assert!(!p.engine.has_work());
    let published: Vec<u64> = p
        .fake
        .log()
        .iter()
        .filter_map(|e| match e {
            Event::Publish { upto, .. } => Some(*upto),
            _ => None,
        })
        .collect();
    assert_eq!(published, [1, 4]);
}

/// A signal behind a put in flight is held (the executor applies it when
/// it finds the put complete, as `GIN_UCX_GPU_ORDER=wait` needs), and so
/// are the completion index and counters: a counter counts only completed
/// operations, in ring order, even one carried by a descriptor that is
/// itself complete at once (a get behind the put).
#[test]
fn a_signal_and_a_counter_behind_a_put_in_flight_wait_for_it() {
    let mut p = pair(&[1], 3, 0, 64);
    p.fake.set_late_puts(true);
    p.push(0, &counted(signalled(put(64, 16), 8, 3, true), 1));
    // A get is complete at once (the fake's gets are not late here).
    p.push(0, &counted(get(0, 0, 8), 1));
    p.step();
    assert_eq!(
        p.fake.read(1, DATA, 64, 16),
        p.fake.read(RANK, DATA, 64, 16)
    );
    assert_eq!(p.fake.read_u64(1, SIGNALS, 8), 0, "held behind its put");
    assert_eq!(p.fake.counter(1), 0, "neither counted yet");
    assert_eq!(p.engine.published(0), Some(0));
    p.fake.complete_put(0);
    let did = p.step();
    assert_eq!((did.landed, did.published), (2, 1));
    assert_eq!(p.fake.read_u64(1, SIGNALS, 8), 3);
    assert_eq!(p.fake.counter(1), 2);
    let tail: Vec<&Event> = p.fake.log().iter().rev().take(4).collect();
    assert!(
        matches!(
            tail[..],
            [
                Event::Publish { upto: 2, .. },
                Event::Count { slot: 1, total: 2 },
                Event::Count { slot: 1, total: 1 },
                Event::Signal { total: 3, .. },
            ]
        ),
        "{tail:?}"
    );
}

/// A put that fails in flight fails the engine naming its sequence and
/// the peer; what completed before it is published, nothing after it,
/// and its signal is never applied.
#[test]
fn a_put_failing_in_flight_fails_the_engine_with_its_sequence() {
    let mut p = pair(&[1], 3, 0, 64);
    p.fake.set_late_puts(true);
    p.push(0, &put(0, 8));
    p.push(0, &signalled(put(8, 8), 8, 1, true));
    p.push(0, &put(16, 8));
    p.step();
    p.fake.complete_put(0);
    p.fake.complete_put(2);
    p.fake.fail_put(
        1,
        ExecError::Unreachable {
            peer: 1,
            why: "the put from GPU memory failed".into(),
        },
    );
    p.step();
    let e = p.engine.failure().cloned().unwrap();
    assert!(
        matches!(
            &e,
            ProxyError::Descriptor {
                peer: 1,
                seq: 1,
                op: Some(Op::Put),
                why: Why::Executor(ExecError::Unreachable { peer: 1, .. }),
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("put #1 to rank 1"), "{e}");
    assert_eq!(p.rings[0].tail(), 1);
    assert_eq!(p.fake.read_u64(1, SIGNALS, 8), 0);
    assert!(!p.step().did_work());
    assert!(!p.engine.has_work());
}

/// Credit and sequence arithmetic are unaffected by puts in flight: through
/// the smallest ring, past 2^16 and across u64::MAX, completing puts only
/// when a producer runs out of credit, every signal total comes out in
/// order and the index reaches the end.
#[test]
fn puts_in_flight_wrap_past_2_16_and_u64_max() {
    for (log2, first, n) in [(1, 0, (1u64 << 16) + 10), (2, u64::MAX - 5, 40)] {
        let mut p = pair(&[1], log2, first, 64);
        p.fake.set_late_puts(true);
        for _ in 0..n {
            while !p.credit(0) {
                p.fake.land_all();
                assert!(p.step().did_work(), "no credit and no progress");
            }
            p.push(0, &signalled(put(0, 8), 8, 1, false));
            p.step();
        }
        p.fake.land_all();
        p.settle();
        assert_eq!(p.engine.published(0), Some(first.wrapping_add(n)));
        assert_eq!(p.rings[0].tail(), first.wrapping_add(n));
        let totals: Vec<u64> = p
            .fake
            .log()
            .iter()
            .filter_map(|e| match e {
                Event::Signal { total, .. } => Some(*total),
                _ => None,
            })
            .collect();
        assert!(totals.iter().copied().eq(1..=n), "ring of 2^{log2}");
        assert_eq!(p.fake.puts_in_flight(), 0);
        assert!(p.engine.failure().is_none());
    }
}

/// Writes qwords at `seq` that decode to `WrongSequence`.
fn corrupt(p: &Pair, i: usize) -> u64 {
    let r = &p.rings[i];
    let seq = r.reserve();
    let mut q: [u64; DESC_QWORDS] = put(0, 8).encode(seq, r.log2());
    q[7] ^= 1;
    r.write_qwords(seq, &q);
    seq
}

#[test]
fn a_corrupt_descriptor_stops_everything_and_names_its_sequence() {
    let mut p = pair(&[1, 2], 4, 0, 64);
    let before = p.fake.read(1, DATA, 0, 72).to_vec();
    for k in 0..3 {
        p.push(0, &put(k * 8, 8));
    }
    let bad = corrupt(&p, 0);
    p.push(0, &put(64, 8));
    p.push(1, &put(0, 8));
    let did = p.step();
    assert_eq!(did.executed, 3);
    let e = p.engine.failure().cloned().unwrap();
    assert_eq!(
        e,
        ProxyError::Descriptor {
            rank: RANK,
            ctx: 0,
            peer: 1,
            seq: bad,
            op: None,
            why: Why::Corrupt(DecodeError::WrongSequence {
                seq: bad,
                found: bad ^ 1
            }),
        }
    );
    assert!(
        e.to_string()
            .starts_with("rank 0: descriptor #3 to rank 1 on context 0 failed: corrupt"),
        "{e}"
    );
    // What came before it completed, and was published.
    assert_eq!(p.rings[0].tail(), 3);
    // Nothing after it ran: not its successor, not the other ring.
    assert_eq!(p.puts(), [(0, Some(0)), (0, Some(8)), (0, Some(16))]);
    let calls = p.fake.calls().len();
    assert!(!p.step().did_work());
    assert!(!p.engine.has_work());
    assert_eq!(p.fake.calls().len(), calls);
    assert_eq!(p.fake.read(1, DATA, 24, 48), &before[24..]);
    assert_eq!(p.rings[1].tail(), 0);
}

#[test]
fn a_peer_dying_mid_batch_stops_the_engine_at_that_descriptor() {
    let mut p = pair(&[1, 2], 4, 0, 64);
    let before = p.fake.read(1, DATA, 0, 48).to_vec();
    for k in 0..6 {
        p.push(0, &put(k * 8, 8));
    }
    p.push(1, &put(0, 8));
    p.fake.kill_after(1, 3);
    let did = p.step();
    assert_eq!(did.executed, 3);
    let e = p.engine.failure().cloned().unwrap();
    assert!(
        matches!(
            &e,
            ProxyError::Descriptor {
                peer: 1,
                seq: 3,
                op: Some(Op::Put),
                why: Why::Executor(ExecError::Unreachable { peer: 1, .. }),
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(
        (e.rank(), e.ctx(), e.peer(), e.seq()),
        (0, Some(0), Some(1), Some(3))
    );
    assert!(
        e.to_string().contains("put #3 to rank 1 on context 0"),
        "{e}"
    );
    // The three before it landed; it and the ones after it did not.
    assert_ne!(p.fake.read(1, DATA, 0, 24), &before[..24]);
    assert_eq!(p.fake.read(1, DATA, 24, 24), &before[24..]);
    assert_eq!(p.rings[0].tail(), 3);
    // The other ring never ran.
    assert!(!p.step().did_work());
    assert_eq!(p.rings[1].tail(), 0);
    assert_eq!(p.puts().len(), 4, "three that worked, the one that failed");
}

#[test]
fn invalid_descriptors_are_refused_before_anything_moves() {
    let cases: [(Desc, Invalid); 6] = [
        (
            Desc {
                dst_window: 9,
                ..put(0, 8)
            },
            Invalid::UnknownWindow { window: 9 },
        ),
        (
            put(4090, 16),
            Invalid::OutOfWindow {
                what: "put source",
                window: DATA,
                owner: RANK,
                offset: 4090,
                bytes: 16,
                size: 4096,
            },
        ),
        (
            signalled(put(0, 0), 64, 1, false),
            Invalid::OutOfWindow {
                what: "signal",
                window: SIGNALS,
                owner: 1,
                offset: 64,
                bytes: 8,
                size: 64,
            },
        ),
        (
            signalled(put(0, 0), 4, 1, false),
            Invalid::MisalignedSignal {
                window: SIGNALS,
                offset: 4,
            },
        ),
        (
            counted(put(0, 8), 7),
            Invalid::NoCounter { slot: 7, slots: 4 },
        ),
        (
            Desc {
                inline: Some(5),
                ..put(0, 4)
            },
            Invalid::InlineSize { bytes: 4 },
        ),
    ];
    for (d, want) in cases {
        let mut p = pair(&[1], 2, 0, 64);
        p.push(0, &d);
        p.step();
        match p.engine.failure() {
            Some(ProxyError::Descriptor {
                seq: 0,
                why: Why::Invalid(got),
                ..
            }) => assert_eq!(got, &want),
            other => panic!("{d:?}: {other:?}"),
        }
        assert!(p.puts().is_empty(), "{d:?}");
        assert!(p.fake.log().is_empty(), "{d:?}");
    }
}

#[test]
fn a_refused_put_applies_neither_its_data_nor_its_signal() {
    let mut p = pair(&[1], 2, 0, 64);
    p.fake.refuse(1, DATA);
    let before = p.fake.read(1, DATA, 0, 8).to_vec();
    p.push(0, &signalled(put(0, 8), 8, 1, true));
    p.step();
    assert!(matches!(
        p.engine.failure(),
        Some(ProxyError::Descriptor {
            why: Why::Executor(ExecError::Refused { peer: 1, .. }),
            ..
        })
    ));
    assert_eq!(p.fake.read(1, DATA, 0, 8), &before[..]);
    assert_eq!(p.fake.read_u64(1, SIGNALS, 8), 0);
}

#[test]
fn a_failed_publication_is_the_first_error() {
    let mut p = pair(&[1], 2, 0, 64);
    p.fake.set_fail_publish(true);
    p.push(0, &put(0, 8));
    p.step();
    assert!(matches!(
        p.engine.failure(),
        Some(ProxyError::Publish {
            peer: 1,
            upto: 1,
            ..
        })
    ));
    assert_eq!(p.rings[0].tail(), 0);
}

/// A ring in memory the process does not own as a Rust value, written the
/// way a GPU writes it: qwords in any order, each with its phase.
#[test]
fn a_foreign_ring_reads_like_an_owned_one() {
    let slots: Arc<Vec<[AtomicU64; 8]>> = Arc::new(
        (0..4)
            .map(|_| std::array::from_fn(|_| AtomicU64::new(0)))
            .collect(),
    );
    // SAFETY: four 64-byte slots, kept alive by the view's owner, and only
    // accessed atomically (here and by the view).
    let mem =
        unsafe { RingMem::foreign(slots.as_ptr().cast(), 2, Box::new(slots.clone())) }.unwrap();
    let mut fake = Fake::new(RANK, 1);
    fake.add_window(DATA, &[64; NRANKS]);
    fake.add_window(SIGNALS, &[64; NRANKS]);
    let config = EngineConfig {
        rank: RANK,
        batch: 64,
        counter_slots: 1,
    };
    let spec = RingSpec {
        ctx: 1,
        peer: 2,
        mem,
        first: 0,
    };
    let mut engine = Engine::new(config, vec![spec]);
    for seq in 0..10u64 {
        let q = signalled(put(0, 0), 8, seq + 1, true).encode(seq, 2);
        let line = &slots[(seq & 3) as usize];
        for i in (0..8).rev() {
            assert!(!engine.has_work(), "seq {seq}, {} qwords written", 7 - i);
            line[i].store(q[i], Ordering::Release);
        }
        assert_eq!(engine.step(&mut fake).executed, 1);
    }
    assert_eq!(fake.published(0), Some(10));
    assert_eq!(fake.read_u64(2, SIGNALS, 8), 55);
    // SAFETY: never read: both are refused first.
    let misaligned =
        unsafe { RingMem::foreign(slots.as_ptr().cast::<u8>().add(4), 2, Box::new(())) };
    assert!(matches!(misaligned, Err(RingMemError::Misaligned { .. })));
    // SAFETY: as above.
    let huge = unsafe { RingMem::foreign(slots.as_ptr().cast(), 17, Box::new(())) };
    assert!(matches!(huge, Err(RingMemError::Size { log2: 17, .. })));
}

/// One operation of the model test.
#[derive(Debug, Clone)]
enum ModelOp {
    Put {
        src: u64,
        dst: u64,
        bytes: u64,
        signal: Option<(u64, u64)>,
        counter: Option<u32>,
    },
    Get {
        remote: u64,
        local: u64,
        bytes: u64,
    },
}

fn model_op() -> impl Strategy<Value = ModelOp> {
    prop_oneof![
        (
            0..64u64,
            0..64u64,
            0..=64u64,
            proptest::option::of((0..8u64, any::<u64>())),
            proptest::option::of(0..4u32)
        )
            .prop_map(|(s, d, bytes, signal, counter)| ModelOp::Put {
                src: s * 8,
                dst: d * 8,
                bytes,
                signal: signal.map(|(slot, add)| (slot * 8, add)),
                counter,
            }),
        (0..64u64, 0..32u64, 0..=64u64).prop_map(|(r, l, bytes)| ModelOp::Get {
            remote: r * 8,
            local: l * 8,
            bytes,
        }),
    ]
}

impl ModelOp {
    /// The descriptor for ring `ring` (whose gets land in their own half
    /// of the landing window, so rings never write the same local bytes).
    fn desc(&self, ring: usize) -> Desc {
        match *self {
            Self::Put {
                src,
                dst,
                bytes,
                signal,
                counter,
            } => {
                let mut d = Desc {
                    src_offset: src,
                    counter,
                    ..put(dst, bytes)
                };
                if let Some((offset, add)) = signal {
                    d = signalled(d, offset, add, true);
                }
                d
            }
            Self::Get {
                remote,
                local,
                bytes,
            } => get(remote, ring as u64 * 2048 + local, bytes),
        }
    }
}

proptest! {
    /// Random operations on two rings, random batch and ring sizes, random
    /// interleavings of producer, engine and executor, with a synchronous,
    /// a queued (slow), a late-get or a late-put executor: the outcome is
    /// that of applying each ring's operations one by one in order.
    #[test]
    fn the_engine_matches_a_sequential_model(
        ops in proptest::collection::vec((0..2usize, model_op()), 1..120),
        schedule in proptest::collection::vec(0..4u8, 1..400),
        log2 in 1u32..4,
        batch in 1u64..6,
        mode in 0..4u8,
    ) {
        let mut p = pair(&[1, 2], log2, 0, batch);
        p.fake.set_queued(mode == 1);
        p.fake.set_late_gets(mode == 2);
        p.fake.set_late_puts(mode == 3);
        // The model: memory as the fake starts, operations applied in order.
        let mut mem = std::collections::HashMap::<(usize, u32), Vec<u8>>::default();
        for r in 0..NRANKS {
            for (w, n) in [(DATA, 4096), (SIGNALS, 64), (LANDING, 4096)] {
                mem.insert((r, w), p.fake.read(r, w, 0, n).to_vec());
            }
        }
        let mut counters = [0u64; 4];
        let mut totals: Vec<u64> = Vec::new();
        let mut pushed = [0u64; 2];
        let mut actions = schedule.iter().cycle();
        for (ring, op) in &ops {
            let peer = ring + 1;
            match *op {
                ModelOp::Put { src, dst, bytes, signal, counter } => {
                    let data = mem[&(RANK, DATA)][src as usize..][..bytes as usize].to_vec();
                    mem.get_mut(&(peer, DATA)).unwrap()[dst as usize..][..bytes as usize]
                        .copy_from_slice(&data);
                    if let Some((off, add)) = signal {
                        let s = &mut mem.get_mut(&(peer, SIGNALS)).unwrap()[off as usize..][..8];
                        let v = u64::from_le_bytes(s.try_into().unwrap()).wrapping_add(add);
                        s.copy_from_slice(&v.to_le_bytes());
                        totals.push(v);
                    }
                    if let Some(c) = counter {
                        counters[c as usize] += 1;
                    }
                }
                ModelOp::Get { remote, local, bytes } => {
                    let data = mem[&(peer, DATA)][remote as usize..][..bytes as usize].to_vec();
                    let at = *ring * 2048 + local as usize;
                    mem.get_mut(&(RANK, LANDING)).unwrap()[at..][..bytes as usize]
                        .copy_from_slice(&data);
                }
            }
            let mut spins = 0;
            while !p.credit(*ring) {
                match actions.next().unwrap() {
                    0 => {
                        p.step();
                    }
                    1 => {
                        p.fake.run(*ring, 2);
                    }
                    2 => p.fake.land_all(),
                    _ => p.fake.run_all(),
                }
                spins += 1;
                if spins > 50 {
                    p.fake.run_all();
                    p.fake.land_all();
                    p.step();
                }
                prop_assert!(spins < 1000, "no credit on ring {}", ring);
            }
            p.push(*ring, &op.desc(*ring));
            pushed[*ring] += 1;
            if *actions.next().unwrap() == 0 {
                p.step();
            }
        }
        loop {
            p.settle();
            if p.engine.in_flight() == 0 {
                break;
            }
            p.fake.land_all();
        }
        prop_assert!(p.engine.failure().is_none(), "{:?}", p.engine.failure());
        for (ring, &n) in pushed.iter().enumerate() {
            prop_assert_eq!(p.rings[ring].tail(), n);
        }
        for ((r, w), want) in &mem {
            prop_assert_eq!(p.fake.read(*r, *w, 0, want.len()), &want[..], "rank {} window {}", r, w);
        }
        for (c, &n) in counters.iter().enumerate() {
            prop_assert_eq!(p.fake.counter(c as u32), n);
        }
        // Signal totals, per (peer, slot), as the model saw them, in each
        // slot's order.
        let mut seen: Vec<u64> = p.fake.log().iter().filter_map(|e| match e {
            Event::Signal { total, .. } => Some(*total),
            _ => None,
        }).collect();
        let mut want = totals.clone();
        seen.sort_unstable();
        want.sort_unstable();
        prop_assert_eq!(seen, want);
    }
}

/// A producer's turn ([`Engine::step_ring`]) takes only its own ring: a
/// descriptor in another ring waits for that ring's turn, and each ring's
/// work is reported apart.
#[test]
fn one_rings_turn_takes_that_ring_alone() {
    let mut p = pair(&[1, 2], 2, 0, 64);
    p.push(0, &counted(put(0, 8), 0));
    p.push(1, &put(8, 8));
    assert!(p.engine.ring_has_work(0) && p.engine.ring_has_work(1));
    let done = p.engine.step_ring(1, &mut p.fake);
    p.fake.run_all();
    assert_eq!(done.executed, 1);
    assert_eq!(p.puts(), vec![(1, Some(8))]);
    assert!(p.engine.ring_has_work(0) && !p.engine.ring_has_work(1));
    assert_eq!(
        p.engine.next(0),
        Some(0),
        "ring 0 was taken by ring 1's turn"
    );
    assert_eq!(p.engine.step_ring(0, &mut p.fake).executed, 1);
    p.fake.run_all();
    assert_eq!(p.puts(), vec![(1, Some(8)), (0, Some(0))]);
    assert!(!p.engine.ring_has_work(0));
    // A ring that does not exist is no turn at all.
    assert_eq!(p.engine.step_ring(2, &mut p.fake), Progress::default());
    assert!(!p.engine.ring_has_work(2));
}
