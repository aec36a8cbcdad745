//! Step tests of [`DevicePuts`] over gin-net's recording transport: no
//! threads, no clocks, no GPU (device addresses are made-up numbers that
//! nothing dereferences).

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::sync::Arc;
use std::time::Duration;

use gin_net::region::RegionTable;
use gin_net::testing::{KeyedOp, KeyedRecorder};
use gin_net::{Fabric, NetError, Path};

use super::*;

/// An executor's error, as text.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Why(String);

impl PutError for Why {
    /// The transport's words, which name the peer already.
    fn net(_: usize, e: NetError) -> Self {
        Self(e.to_string())
    }
    fn noted(self, note: &Note) -> Self {
        Self(format!("{} ({note})", self.0))
    }
}

const KEY: u32 = 0x77;
const SIG: u32 = 0x88;
/// Another region at the peer, never refused.
const OTHER: u32 = 0x99;
/// This rank's part of the source window.
const SRC: u64 = 0x10_0000;

/// Rank 0's puts to ranks 1 and 2 over one recorder, merged up to `max`.
fn rig(max: u64) -> (DevicePuts<Why>, Arc<KeyedRecorder>) {
    let keyed = Arc::new(KeyedRecorder::taking_device_memory());
    keyed.hold_device_puts();
    let fabric = Arc::new(Fabric::new(
        0,
        vec![
            Path::local(),
            Path::new(keyed.clone()),
            Path::new(keyed.clone()),
        ],
        Arc::new(RegionTable::default()),
        Duration::from_secs(1),
    ));
    (DevicePuts::new(fabric, max), keyed)
}

/// `len` bytes from `off` of the source window to `off` at the peer.
fn dput(off: u64, len: u64) -> DevicePut {
    DevicePut {
        key: KEY,
        offset: off,
        window: 1,
        src: SRC + off,
        len,
        keep: None,
    }
}

fn put(d: &mut DevicePuts<Why>, lane: usize, peer: usize, p: DevicePut) -> Ticket {
    // SAFETY: the recorder dereferences nothing.
    unsafe { d.put(lane, peer, p) }.unwrap()
}

fn held(v: u64) -> Held {
    Held {
        key: SIG,
        offset: 8,
        bytes: v.to_le_bytes(),
    }
}

/// The device puts the transport was handed: (peer, offset, src, len).
fn device_ops(k: &KeyedRecorder) -> Vec<(usize, u64, u64, u64)> {
    k.ops()
        .into_iter()
        .filter_map(|o| match o {
            KeyedOp::PutDevice {
                peer,
                offset,
                src,
                len,
                ..
            } => Some((peer, offset, src, len)),
            _ => None,
        })
        .collect()
}

/// The values put ordered: (peer, value).
fn values(k: &KeyedRecorder) -> Vec<(usize, u64)> {
    k.ops()
        .into_iter()
        .filter_map(|o| match o {
            KeyedOp::Put {
                peer,
                bytes,
                ordered: true,
                ..
            } => Some((peer, u64::from_le_bytes(bytes[..].try_into().unwrap()))),
            _ => None,
        })
        .collect()
}

fn span(offset: u64, src: u64, len: u64) -> Span {
    Span {
        key: KEY,
        window: 1,
        offset,
        src,
        len,
    }
}

/// Puts that continue one another in destination and source merge,
/// whatever order they came in; a gap, another key or window, a source
/// that does not continue, or the cap ends a chain; a put over the cap
/// goes alone; chains go in the order of their first put.
#[test]
fn the_plan_joins_what_continues_up_to_the_cap() {
    // Four slices of one message, posted out of order.
    let s = [
        span(256, 256, 128),
        span(0, 0, 128),
        span(384, 384, 128),
        span(128, 128, 128),
    ];
    assert_eq!(
        plan(&s, 1 << 20),
        vec![Chain {
            members: vec![0, 1, 2, 3],
            offset: 0,
            src: 0,
            len: 512
        }]
    );
    // The cap: two of 256 bytes.
    let c = plan(&s, 256);
    assert_eq!(
        c.iter().map(|c| (c.offset, c.len)).collect::<Vec<_>>(),
        [(256, 256), (0, 256)],
        "{c:?}"
    );
    // A gap, a source that does not continue, another key, another window.
    let s = [
        span(0, 0, 64),
        span(128, 128, 64),
        span(64, 999, 64),
        Span {
            key: 9,
            ..span(192, 192, 64)
        },
        Span {
            window: 2,
            ..span(192, 192, 64)
        },
    ];
    assert_eq!(plan(&s, 1 << 20).len(), 5);
    // A put over the cap goes alone, never split.
    let s = [span(0, 0, 64), span(64, 64, 4096), span(4160, 4160, 64)];
    assert_eq!(
        plan(&s, 128)
            .iter()
            .map(|c| c.members.clone())
            .collect::<Vec<_>>(),
        [vec![0], vec![1], vec![2]]
    );
}

/// Merging off: every put starts as it is handed over, one transport put
/// each, released as the transport completes them in order.
#[test]
fn without_merging_each_put_starts_at_once() {
    let (mut d, k) = rig(0);
    let t: Vec<Ticket> = (0..3)
        .map(|i| put(&mut d, 0, 1, dput(i * 64, 64)))
        .collect();
    assert_eq!(device_ops(&k).len(), 3);
    assert!(!d.landed(t[0]).unwrap());
    k.complete_device_puts(2);
    assert!(d.landed(t[0]).unwrap() && d.landed(t[1]).unwrap());
    assert!(!d.landed(t[2]).unwrap());
    assert_eq!(
        d.stats(),
        PutStats {
            puts: 3,
            started: 3,
            unstarted: 0
        }
    );
}

/// Adjacent puts wait for the end of the pass and start as one; each
/// original is released once that one completed, and only then.
#[test]
fn adjacent_puts_start_as_one_and_release_each_original() {
    let (mut d, k) = rig(MERGE_MAX);
    let t: Vec<Ticket> = [2u64, 0, 3, 1]
        .iter()
        .map(|&i| put(&mut d, 0, 1, dput(i * 4096, 4096)))
        .collect();
    assert!(k.ops().is_empty(), "nothing starts before the pass ends");
    assert!(d.pending(1));
    d.issue();
    assert_eq!(device_ops(&k), [(1, 0, SRC, 4 * 4096)]);
    for &t in &t {
        assert!(!d.landed(t).unwrap());
    }
    k.complete_device_puts(1);
    for &t in &t {
        assert!(d.landed(t).unwrap());
    }
    assert!(!d.pending(1));
    assert_eq!(
        d.stats(),
        PutStats {
            puts: 4,
            started: 1,
            unstarted: 0
        }
    );
}

/// Puts that do not continue one another, or go to another peer, or come
/// from another lane, are not merged; a put overlapping a waiting one
/// starts the waiting ones first, in their order.
#[test]
fn what_does_not_continue_or_overlaps_is_not_merged() {
    let (mut d, k) = rig(MERGE_MAX);
    put(&mut d, 0, 1, dput(0, 64));
    put(&mut d, 0, 1, dput(128, 64));
    d.issue();
    assert_eq!(device_ops(&k), [(1, 0, SRC, 64), (1, 128, SRC + 128, 64)]);
    // Another peer, then another lane: each starts what waited.
    let (mut d, k) = rig(MERGE_MAX);
    put(&mut d, 0, 1, dput(0, 64));
    put(&mut d, 0, 2, dput(64, 64));
    put(&mut d, 1, 2, dput(128, 64));
    assert_eq!(device_ops(&k), [(1, 0, SRC, 64), (2, 64, SRC + 64, 64)]);
    d.issue();
    assert_eq!(device_ops(&k).len(), 3);
    // Overlap: the second round of a sliced message starts the first.
    let (mut d, k) = rig(MERGE_MAX);
    for round in 0..2 {
        for i in 0..4 {
            put(&mut d, 0, 1, dput(i * 64, 64));
        }
        assert_eq!(device_ops(&k).len(), round, "round {round}");
    }
    d.issue();
    assert_eq!(device_ops(&k), [(1, 0, SRC, 256), (1, 0, SRC, 256)]);
}

/// Where the transport would wait before an ordered value, a signal of a
/// merged put is held until the merged put completed, then sent after it;
/// a value behind it keeps its place. Nothing is sent before the data.
#[test]
fn a_value_behind_a_merged_put_is_sent_once_it_completed() {
    let (mut d, k) = rig(MERGE_MAX);
    k.order_by_waiting();
    let first = put(&mut d, 0, 1, dput(0, 512));
    assert_eq!(
        d.send_ordered(1, held(1), Some(first)).unwrap(),
        Some(first)
    );
    let second = put(&mut d, 0, 1, dput(512, 512));
    let value = d.send_ordered(1, held(3), None).unwrap().unwrap();
    d.issue();
    assert_eq!(device_ops(&k), [(1, 0, SRC, 1024)]);
    for t in [first, second, value] {
        assert!(!d.landed(t).unwrap());
    }
    assert!(values(&k).is_empty(), "a signal never goes before its data");
    k.complete_device_puts(1);
    assert!(d.landed(value).unwrap());
    assert_eq!(values(&k), [(1, 1), (1, 3)]);
    assert!(d.landed(first).unwrap() && d.landed(second).unwrap());
    // Nothing pending: a value goes at once.
    assert_eq!(d.send_ordered(1, held(4), None).unwrap(), None);
    assert_eq!(values(&k), [(1, 1), (1, 3), (1, 4)]);
}

/// Where the transport orders a value after the puts without waiting
/// (fence), the waiting puts start first, merged, then the value.
#[test]
fn a_fenced_value_starts_the_waiting_puts_first() {
    let (mut d, k) = rig(MERGE_MAX);
    put(&mut d, 0, 1, dput(64, 64));
    let t = put(&mut d, 0, 1, dput(0, 64));
    assert_eq!(d.send_ordered(1, held(1), Some(t)).unwrap(), Some(t));
    assert!(matches!(
        &k.ops()[..],
        [
            KeyedOp::PutDevice { len: 128, .. },
            KeyedOp::Put { ordered: true, .. }
        ]
    ));
}

/// A merged put that fails fails every put it carried, each error naming
/// the original's bytes and offset and the merged put; the put before it
/// is released.
#[test]
fn a_failed_merged_put_fails_each_original_by_name() {
    let (mut d, k) = rig(MERGE_MAX);
    let first = put(&mut d, 0, 1, dput(4096, 64));
    d.issue();
    let t: Vec<Ticket> = (0..3)
        .map(|i| put(&mut d, 0, 1, dput(i * 512, 512)))
        .collect();
    d.issue();
    assert_eq!(device_ops(&k)[1], (1, 0, SRC, 1536));
    k.fail_device_put(1, 2, "Connection reset");
    k.complete_device_puts(1);
    assert!(d.landed(first).unwrap());
    for (i, &t) in t.iter().enumerate() {
        let e = d.landed(t).unwrap_err().0;
        let own = format!(
            "this put's 512 bytes at offset {} of key 0x00000077",
            i * 512
        );
        assert!(
            e.contains("Connection reset")
                && e.contains(&own)
                && e.contains("put #2, 1536 bytes at offset 0 merged from 3 puts"),
            "{e}"
        );
    }
}

/// A merged put the transport refuses to start fails its originals and
/// every entry after them: nothing after it starts (a later put to a
/// region the peer still serves included), and a fenced value behind it
/// is never sent.
#[test]
fn a_merged_put_refused_at_start_fails_what_follows_it() {
    let (mut d, k) = rig(MERGE_MAX);
    let first = put(&mut d, 0, 1, dput(0, 64));
    let second = put(&mut d, 0, 1, dput(64, 64));
    k.refuse(KEY);
    assert_eq!(
        d.send_ordered(1, held(1), Some(second)).unwrap(),
        Some(second)
    );
    assert!(k.ops().is_empty(), "{:?}", k.ops());
    for t in [first, second] {
        let why = d.landed(t).unwrap_err().0;
        assert!(
            why.contains("0x00000077") && why.contains("never started"),
            "{why}"
        );
    }
    let later = put(
        &mut d,
        0,
        1,
        DevicePut {
            key: OTHER,
            ..dput(1024, 64)
        },
    );
    let why = d.landed(later).unwrap_err().0;
    assert!(
        why.contains("0x00000077")
            && why
                .contains("this put's 64 bytes at offset 1024 of key 0x00000099 was never started"),
        "{why}"
    );
    assert!(k.ops().is_empty(), "{:?}", k.ops());
    assert_eq!(
        d.stats(),
        PutStats {
            puts: 3,
            started: 0,
            unstarted: 3
        }
    );
}

/// A put refused at start while a put before it is still in flight bars
/// the peer at once: a put of a later pass (to a region the peer still
/// serves) is never started, a fenced value and an inline one are never
/// sent, and each fails saying so; the put before the refusal lands once
/// it completed, the refused one fails with its own refusal.
#[test]
fn a_put_refused_at_start_stops_later_passes_while_earlier_ones_fly() {
    let (mut d, k) = rig(MERGE_MAX);
    let other = |off| DevicePut {
        key: OTHER,
        ..dput(off, 64)
    };
    let before = put(&mut d, 0, 1, other(0));
    d.issue();
    assert_eq!(d.barred(1), None, "nothing refused yet");
    k.refuse(KEY);
    let refused = put(&mut d, 0, 1, dput(0, 64));
    d.issue();
    let after = put(&mut d, 0, 1, other(4096));
    d.issue();
    assert_eq!(device_ops(&k), [(1, 0, SRC, 64)], "only the put before");
    let value = d.send_ordered(1, held(1), None).unwrap().unwrap();
    let inline = d.barred(1).unwrap();
    assert!(values(&k).is_empty());
    assert!(!d.landed(before).unwrap(), "still in flight");
    let why = d.landed(after).unwrap_err().0;
    assert!(
        why.contains("0x00000077")
            && why
                .contains("this put's 64 bytes at offset 4096 of key 0x00000099 was never started"),
        "{why}"
    );
    k.complete_device_puts(1);
    assert!(d.landed(before).unwrap());
    let why = d.landed(refused).unwrap_err().0;
    assert!(
        why.contains("0x00000077") && !why.contains("this put's"),
        "its own refusal, no note: {why}"
    );
    for t in [after, value, inline] {
        assert!(d.landed(t).unwrap_err().0.contains("0x00000077"));
    }
    assert_eq!(
        d.stats(),
        PutStats {
            puts: 3,
            started: 1,
            unstarted: 2
        }
    );
}

/// Where the transport names the failed put, an original carried by a
/// later merged put (started, unreleased) fails with the peer, its note
/// saying that its own put is not what failed; those of the failed one
/// are named as its own.
#[test]
fn an_original_behind_the_failed_put_says_its_own_did_not_fail() {
    let (mut d, k) = rig(MERGE_MAX);
    let mut t = Vec::new();
    for pass in 0..3u64 {
        t.push(put(&mut d, 0, 1, dput(pass * 1024, 64)));
        t.push(put(&mut d, 0, 1, dput(pass * 1024 + 64, 64)));
        d.issue();
    }
    assert_eq!(device_ops(&k).len(), 3);
    k.fail_device_put(1, 2, "Connection reset");
    k.complete_device_puts(1);
    assert!(d.landed(t[0]).unwrap() && d.landed(t[1]).unwrap());
    let own = d.landed(t[2]).unwrap_err().0;
    assert!(
        own.contains("Connection reset")
            && own.contains("put #2, 128 bytes at offset 1024 merged from 2 puts")
            && !own.contains("not what failed"),
        "{own}"
    );
    let behind = d.landed(t[5]).unwrap_err().0;
    assert!(
        behind.contains("Connection reset")
            && behind.contains("this put's 64 bytes at offset 2112 of key 0x00000077")
            && behind.contains(
                "put #3, 128 bytes at offset 2048 merged from 2 puts, which is not what failed"
            ),
        "{behind}"
    );
}

/// A merged put that completed, whose signal held behind it cannot be
/// sent: each original fails with the value's failure, noted that its
/// put is not what failed.
#[test]
fn a_merged_put_failed_by_its_held_value_says_its_own_did_not_fail() {
    let (mut d, k) = rig(MERGE_MAX);
    k.order_by_waiting();
    let first = put(&mut d, 0, 1, dput(0, 64));
    let second = put(&mut d, 0, 1, dput(64, 64));
    d.send_ordered(1, held(1), Some(second)).unwrap();
    d.issue();
    k.refuse(SIG);
    k.complete_device_puts(1);
    assert!(d.landed(first).unwrap(), "released before the value");
    let why = d.landed(second).unwrap_err().0;
    assert!(
        why.contains("0x00000088")
            && why.contains(
                "put #1, 128 bytes at offset 0 merged from 2 puts, which is not what failed"
            ),
        "{why}"
    );
}

/// A settle starts what waits, completes it and sends what was held;
/// settling everything drops puts still waiting (their engine stopped
/// mid-pass) and completes those started.
#[test]
fn settling_starts_completes_and_releases() {
    let (mut d, k) = rig(MERGE_MAX);
    k.order_by_waiting();
    let a = put(&mut d, 0, 1, dput(0, 64));
    d.send_ordered(1, held(7), Some(a)).unwrap();
    d.settle(1).unwrap();
    assert_eq!(device_ops(&k).len(), 1);
    assert_eq!(k.completions(), [(1, 1)]);
    assert_eq!(values(&k), [(1, 7)]);
    assert!(d.landed(a).unwrap());
    put(&mut d, 0, 2, dput(0, 64));
    d.issue();
    put(&mut d, 0, 2, dput(64, 64));
    d.settle_all().unwrap();
    assert_eq!(device_ops(&k).len(), 2, "the waiting put never started");
    assert_eq!(k.completions(), [(1, 1), (2, 3)]);
}

#[test]
fn the_merge_cap_is_read_from_its_variable() {
    assert_eq!(merge_max_from(None), Ok(MERGE_MAX));
    assert_eq!(merge_max_from(Some("0")), Ok(0));
    assert_eq!(merge_max_from(Some("262144")), Ok(262_144));
    assert_eq!(merge_max_from(Some("512k")), Ok(512 << 10));
    assert_eq!(merge_max_from(Some(" 8M ")), Ok(8 << 20));
    for bad in ["", "m", "4g", "-1", "99999999999999999999m"] {
        let e = merge_max_from(Some(bad)).unwrap_err();
        assert!(e.contains(MERGE_VAR), "{e}");
    }
}
