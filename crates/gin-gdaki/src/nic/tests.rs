//! Step tests: the engine against the in-memory executor, one step at a
//! time, no threads, no sleeps, no clocks. Rank 0's NIC serves its QP to
//! rank 1 (queue 0) and the companion loopback QP (queue 1), which share
//! channel 0; producers post with the in-order protocol of `qp.rs`, as the
//! device side and `gdaki.cuh` do.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::*;
use crate::completion::{CQE_INVALID, CQE_REQ, CQE_REQ_ERR, Cqe, syndrome};
use crate::ids::{COUNTER_KEY, SINK_KEY, companion_qpn, main_qpn, window_key};
use crate::qp::{Cq, QW, Qp};
use crate::queue::{Sharing, has_space};
use crate::wqe::{CQ_UPDATE, FM_NONE, FM_STRONG_ORDERING, MemRef, Op, encode};

const N: usize = 2;
const DATA: u32 = 3;
const SIG: u32 = 4;
/// Each rank's own address of its parts (what WQEs carry).
const VA: [u64; 2] = [0x1000_0000, 0x2000_0000];
const SIG_VA: [u64; 2] = [0x3000_0000, 0x4000_0000];
const MAIN: usize = 0;
const COMP: usize = 1;

fn key(window: u32, rank: usize) -> u32 {
    window_key(window, rank, N).unwrap()
}

struct Rig {
    fake: Fake,
    engine: Engine<CqView>,
    qps: [Arc<Qp>; 2],
}

fn rig(collapsed: bool, log2: u32) -> Rig {
    let mut fake = Fake::new(0, 16 * 8, 64);
    for r in 0..N {
        fake.add_part(DATA, r, VA[r], 256);
        fake.add_part(SIG, r, SIG_VA[r], 64);
    }
    let src: Vec<u8> = (0..=255u8).collect();
    fake.fill(DATA, 0, 0, &src);
    let (m, c) = (main_qpn(0, 1, N).unwrap(), companion_qpn(0, 1, N).unwrap());
    let qp = |qpn: u32, peer: usize| {
        let cq_log2 = if collapsed { 0 } else { log2 };
        Arc::new(Qp::with_cq(qpn, peer, log2, Cq::new(qpn, cq_log2)))
    };
    let qps = [qp(m, 1), qp(c, 0)];
    let mode = if collapsed {
        CqMode::Collapsed
    } else {
        CqMode::Ring { log2 }
    };
    let specs = qps
        .iter()
        .map(|q| QueueSpec {
            qpn: q.qpn,
            cqn: q.cq.cqn,
            peer: q.peer,
            channel: 0,
            cq_mode: mode,
            sq: SqView::host(q),
            cq: CqView::host(q),
        })
        .collect();
    let (counters, sink) = fake.local_parts();
    let cfg = EngineConfig {
        rank: 0,
        nranks: N,
        counters,
        sink,
        batch: 64,
    };
    let engine = Engine::new(cfg, specs).unwrap();
    Rig { fake, engine, qps }
}

impl Rig {
    /// Reserves, fills and posts `ops` on queue `j`; the last index.
    fn post(&self, j: usize, ops: &[(Op, u8)]) -> u64 {
        let qp = &self.qps[j];
        let k = ops.len() as u64;
        let start = qp.idx.reserve(k);
        self.fill(j, start, ops);
        assert!(qp.try_post(start, start + k, Sharing::Thread, |_| false));
        start + k - 1
    }

    fn fill(&self, j: usize, start: u64, ops: &[(Op, u8)]) {
        let qp = &self.qps[j];
        for (i, (op, fm)) in ops.iter().enumerate() {
            let idx = start + i as u64;
            qp.write_wqe(
                idx,
                &encode(op, idx as u16, qp.qpn, fm | CQ_UPDATE).unwrap(),
            );
        }
    }

    fn step(&mut self) -> Progress {
        self.engine.step(&mut self.fake).unwrap()
    }

    /// The new CQEs of ring CQ `j`, reaped as the device side does.
    fn reap(&self, j: usize) -> Vec<Cqe> {
        reap_all(&self.qps[j])
    }

    /// Queue `j`'s collapsed CQE.
    fn collapsed(&self, j: usize) -> Cqe {
        collapsed(&self.qps[j])
    }

    fn data(&self, rank: usize) -> &[u8] {
        self.fake.bytes(DATA, rank)
    }

    fn writes(&self) -> usize {
        let w = |e: &&Event| matches!(e, Event::Write { .. } | Event::FetchAdd { .. });
        self.fake.log.iter().filter(w).count()
    }
}

/// A collapsed CQ's one CQE.
fn collapsed(qp: &Qp) -> Cqe {
    let e = &qp.cq.entries;
    let mut b = [0u8; 64];
    for q in 0..QW {
        b[q * 8..q * 8 + 8].copy_from_slice(&e[q].load(Ordering::Acquire).to_ne_bytes());
    }
    Cqe::decode(&b)
}

/// Polls a ring CQ as the device side does, advancing the queue's
/// completion index (its credit); returns every new CQE.
fn reap_all(qp: &Qp) -> Vec<Cqe> {
    let mut all = Vec::new();
    qp.cq.poll(|c| all.push(*c));
    for c in &all {
        let done = qp.idx.done.load(Ordering::Acquire);
        let idx = crate::queue::unwrap_counter(c.wqe_counter, done);
        qp.idx.done.fetch_max(idx + 1, Ordering::AcqRel);
    }
    all
}

fn write(off: u64, len: u32) -> Op {
    Op::Write {
        remote: MemRef {
            addr: VA[1] + off,
            key: key(DATA, 1),
        },
        local: MemRef {
            addr: VA[0] + off,
            key: key(DATA, 0),
        },
        len,
    }
}

fn sink(off: u64) -> MemRef {
    MemRef {
        addr: Fake::SINK + off,
        key: SINK_KEY,
    }
}

/// A fetch-add of `add` at byte `off` of rank 1's signal part.
fn signal(off: u64, add: u64) -> Op {
    Op::FetchAdd {
        remote: MemRef {
            addr: SIG_VA[1] + off,
            key: key(SIG, 1),
        },
        add,
        result: sink(0),
    }
}

/// A fetch-add of 1 at byte `off` of this rank's counters.
fn bump(off: u64) -> Op {
    Op::FetchAdd {
        remote: MemRef {
            addr: Fake::COUNTERS + off,
            key: COUNTER_KEY,
        },
        add: 1,
        result: sink(8),
    }
}

fn wait_main(r: &Rig, idx: u64) -> Op {
    Op::Wait {
        max_index: u32::from(idx as u16),
        cqn: r.qps[MAIN].cq.cqn,
    }
}

/// Whether a fault's cause is the expected one.
type Check = fn(&Cause) -> bool;

fn ok(c: &Cqe) -> (u8, u16, u8) {
    (c.opcode, c.wqe_counter, c.syndrome)
}

#[test]
fn a_put_with_a_signal_moves_data_then_completes_in_order() {
    let mut r = rig(false, 3);
    r.post(
        MAIN,
        &[(write(16, 64), FM_NONE), (signal(8, 5), FM_STRONG_ORDERING)],
    );
    let p = r.step();
    assert_eq!((p.consumed, p.faults.len()), (2, 0));
    assert_eq!(r.data(1)[16..80], r.data(0)[16..80]);
    assert!(r.data(1)[..16].iter().all(|&b| b == 0));
    assert_eq!(r.fake.qword(Region::Window(SIG), 1, 8), 5);
    let cqes = r.reap(MAIN);
    let got: Vec<_> = cqes.iter().map(|c| (ok(c), c.byte_cnt)).collect();
    assert_eq!(got, [((CQE_REQ, 0, 0), 64), ((CQE_REQ, 1, 0), 8)]);
    // Each completion after its work: write, CQE, fetch-add, its result,
    // CQE.
    let kinds: Vec<&str> = r
        .fake
        .log
        .iter()
        .map(|e| match e {
            Event::Write { .. } => "write",
            Event::FetchAdd { .. } => "fetch-add",
            Event::Publish { .. } => "cqe",
            _ => "other",
        })
        .collect();
    assert_eq!(kinds, ["write", "cqe", "fetch-add", "write", "cqe"]);
    // A second signal: the old value lands in the sink, big-endian.
    r.post(MAIN, &[(signal(8, 3), FM_NONE)]);
    r.step();
    assert_eq!(r.fake.qword(Region::Window(SIG), 1, 8), 8);
    assert_eq!(u64::from_be(r.fake.qword(Region::Sink, 0, 0)), 5);
    assert!(!r.engine.has_work());
}

/// 70,000 WQEs through a 4-entry queue: the producer waits for credit
/// against the completions it reaps, WQE indices and CQE counters wrap at
/// 2^16, and a companion WAIT naming a main index past the wrap (16-bit 1)
/// bumps its counter only once that main WQE has completed.
#[test]
fn credit_and_16_bit_wqe_counters_wrap_at_2_16_with_a_wait_across_the_wrap() {
    let mut r = rig(false, 2);
    let total = 70_000u64;
    let awaited = 0x1_0001u64;
    let mut seen = 0u64;
    let mut main_done = 0u64;
    for i in 0..total {
        let start = loop {
            let qp = &r.qps[MAIN];
            if has_space(qp.idx.resv.load(Ordering::Acquire), 1, main_done, qp.size()) {
                break qp.idx.reserve(1);
            }
            r.step();
            for c in reap_all(&r.qps[MAIN]) {
                assert_eq!(ok(&c), (CQE_REQ, seen as u16, 0), "CQE {seen}");
                seen += 1;
            }
            main_done = r.qps[MAIN].idx.done.load(Ordering::Acquire);
            let bumped = r.fake.qword(Region::Counters, 0, 3 * 8);
            assert!(
                bumped == 0 || main_done > awaited,
                "counter bumped at main completion {main_done}"
            );
        };
        assert_eq!(start, i);
        r.fill(MAIN, start, &[(write(8 * (i % 16), 8), FM_NONE)]);
        assert!(r.qps[MAIN].try_post(start, start + 1, Sharing::Thread, |_| false));
        if i == awaited - 20 {
            let w = wait_main(&r, awaited);
            r.post(COMP, &[(w, FM_NONE), (bump(3 * 8), FM_NONE)]);
        }
    }
    while seen < total {
        r.step();
        for c in reap_all(&r.qps[MAIN]) {
            assert_eq!(ok(&c), (CQE_REQ, seen as u16, 0));
            seen += 1;
        }
    }
    assert_eq!(r.engine.consumer_index(MAIN), Some(total));
    assert_eq!(r.fake.qword(Region::Counters, 0, 3 * 8), 1);
    let comp: Vec<_> = reap_all(&r.qps[COMP]).iter().map(ok).collect();
    assert_eq!(comp, [(CQE_REQ, 0, 0), (CQE_REQ, 1, 0)]);
}

#[test]
fn an_error_cqe_moves_the_qp_to_the_error_state_and_flushes_every_later_wqe() {
    let mut r = rig(false, 3);
    let mut bad = write(0, 8);
    if let Op::Write { remote, .. } = &mut bad {
        remote.key = 0xdead_0001;
    }
    r.post(
        MAIN,
        &[
            (write(0, 8), FM_NONE),
            (bad, FM_NONE),
            (write(8, 8), FM_NONE),
            (write(16, 8), FM_NONE),
        ],
    );
    let p = r.step();
    assert_eq!(p.consumed, 4);
    assert_eq!(p.faults.len(), 1, "reported once");
    let f = &p.faults[0];
    assert_eq!((f.queue, f.index, f.syndrome), (MAIN, 1, 0x13));
    // Below the local keys, a key decodes to a window part: one not there.
    assert!(matches!(
        f.cause,
        Cause::NoWindow {
            key: 0xdead_0001,
            rank: 1,
            ..
        }
    ));
    let msg = f.to_string();
    assert!(
        msg.contains("QP 0x102 to rank 1")
            && msg.contains("WQE index 1")
            && msg.contains("syndrome 0x13 (remote access error)")
            && msg.contains("0xdead0001"),
        "{msg}"
    );
    let flush = syndrome::WR_FLUSH_ERR;
    let got: Vec<_> = r.reap(MAIN).iter().map(ok).collect();
    assert_eq!(
        got,
        [
            (CQE_REQ, 0, 0),
            (CQE_REQ_ERR, 1, syndrome::REMOTE_ACCESS_ERR),
            (CQE_REQ_ERR, 2, flush),
            (CQE_REQ_ERR, 3, flush)
        ]
    );
    assert!(r.engine.is_failed(MAIN));
    assert_eq!(
        r.engine.fault_log().get(MAIN),
        Some(f),
        "shared with pollers"
    );
    assert_eq!(r.engine.fault_log().get(COMP), None);
    assert_eq!(r.writes(), 1, "nothing after the error moved");
    // Later work is flushed too, without another report.
    r.post(MAIN, &[(write(32, 8), FM_NONE)]);
    let p = r.step();
    assert_eq!((p.consumed, p.faults.len()), (1, 0));
    assert_eq!(
        r.reap(MAIN).iter().map(ok).collect::<Vec<_>>(),
        [(CQE_REQ_ERR, 4, flush)]
    );
    assert_eq!(r.writes(), 1);
    // The companion waiting on the failed QP fails too; its counter stays.
    let w = wait_main(&r, 4);
    r.post(COMP, &[(w, FM_NONE), (bump(0), FM_NONE)]);
    let p = r.step();
    assert_eq!(p.faults.len(), 1);
    assert_eq!(p.faults[0].syndrome, flush);
    assert!(matches!(
        p.faults[0].cause,
        Cause::AwaitedFailed { qpn: 0x102 }
    ));
    assert_eq!(r.fake.qword(Region::Counters, 0, 0), 0);
}

/// In both CQ modes the companion's counter fetch-add is handed over only
/// after the main QP's completion of the awaited WQE.
#[test]
fn a_wait_on_the_companion_bumps_the_counter_only_after_the_main_completion() {
    for collapsed in [false, true] {
        let mut r = rig(collapsed, 3);
        // The WAIT names main WQE 0, which is not posted yet.
        let w = wait_main(&r, 0);
        r.post(COMP, &[(w, FM_NONE), (bump(16), FM_NONE)]);
        let p = r.step();
        assert_eq!(p.consumed, 0, "blocked");
        assert!(
            r.engine.has_work(),
            "a blocked WAIT is work to come back to"
        );
        assert!(r.fake.log.is_empty());
        r.post(MAIN, &[(write(0, 8), FM_NONE)]);
        let p = r.step();
        assert_eq!(p.consumed, 3);
        assert_eq!(r.fake.qword(Region::Counters, 0, 16), 1);
        let at = |pred: &dyn Fn(&Event) -> bool| r.fake.log.iter().position(pred).unwrap();
        let main_cqe = at(&|e| matches!(e, Event::Publish { .. }));
        let counter =
            at(&|e| matches!(e, Event::FetchAdd { at, .. } if at.region == Region::Counters));
        let data = at(&|e| matches!(e, Event::Write { .. }));
        assert!(data < main_cqe && main_cqe < counter, "{:?}", r.fake.log);
        if collapsed {
            assert_eq!(ok(&r.collapsed(COMP)), (CQE_REQ, 1, 0));
            assert_eq!(ok(&r.collapsed(MAIN)), (CQE_REQ, 0, 0));
        }
    }
}

#[test]
fn a_dead_peer_completes_with_transport_retry_exceeded() {
    let mut r = rig(false, 3);
    r.fake.kill(1);
    r.post(MAIN, &[(write(0, 8), FM_NONE), (write(8, 8), FM_NONE)]);
    let p = r.step();
    assert_eq!(p.faults.len(), 1);
    let f = &p.faults[0];
    assert_eq!(
        (f.index, f.syndrome),
        (0, syndrome::TRANSPORT_RETRY_EXC_ERR)
    );
    assert!(matches!(
        f.cause,
        Cause::Exec(ExecError::Transport { peer: 1, .. })
    ));
    let got: Vec<_> = r.reap(MAIN).iter().map(ok).collect();
    assert_eq!(
        got,
        [
            (CQE_REQ_ERR, 0, syndrome::TRANSPORT_RETRY_EXC_ERR),
            (CQE_REQ_ERR, 1, syndrome::WR_FLUSH_ERR)
        ]
    );
    assert!(r.fake.health().is_err());
    assert!(r.fake.confirm(1).is_err());
    // The loopback QP does not need the dead peer.
    let local = Op::Write {
        remote: MemRef {
            addr: VA[0] + 128,
            key: key(DATA, 0),
        },
        local: MemRef {
            addr: VA[0],
            key: key(DATA, 0),
        },
        len: 8,
    };
    r.post(COMP, &[(local, FM_NONE)]);
    assert!(r.step().faults.is_empty());
    assert_eq!(r.data(0)[128..136], r.data(0)[..8]);
}

#[test]
fn a_refused_write_is_a_remote_access_error() {
    let mut r = rig(false, 3);
    r.fake.refuse_writes(DATA, 1);
    r.post(MAIN, &[(write(0, 8), FM_NONE)]);
    let p = r.step();
    assert_eq!(p.faults[0].syndrome, syndrome::REMOTE_ACCESS_ERR);
    assert!(matches!(
        p.faults[0].cause,
        Cause::Exec(ExecError::Refused { peer: 1, .. })
    ));
}

/// One bad operand per case, on a fresh NIC: the syndrome, the cause, and
/// no data moved.
#[test]
#[allow(clippy::too_many_lines)] // a table of cases, one bad operand each
fn bad_keys_bounds_and_access_are_refused_with_their_syndromes() {
    let at = |addr, key| MemRef { addr, key };
    let put = |remote, local| Op::Write {
        remote,
        local,
        len: 8,
    };
    let (good_l, good_r) = (at(VA[0], key(DATA, 0)), at(VA[1], key(DATA, 1)));
    let fa = |remote, result| Op::FetchAdd {
        remote,
        add: 1,
        result,
    };
    let remote = syndrome::REMOTE_ACCESS_ERR;
    let local = syndrome::LOCAL_PROT_ERR;
    let cases: Vec<(usize, Op, u8, Check)> = vec![
        (MAIN, put(at(VA[1], 0x42), good_l), remote, |c| {
            matches!(c, Cause::UnknownKey { key: 0x42, rank: 1 })
        }),
        (MAIN, put(at(VA[1], 0xdead_0001), good_l), remote, |c| {
            matches!(c, Cause::NoWindow { .. })
        }),
        (MAIN, put(at(VA[1], key(DATA, 0)), good_l), remote, |c| {
            matches!(
                c,
                Cause::ForeignKey {
                    owner: 0,
                    rank: 1,
                    ..
                }
            )
        }),
        (MAIN, put(at(VA[1], key(7, 1)), good_l), remote, |c| {
            matches!(c, Cause::NoWindow { window: 7, .. })
        }),
        (
            MAIN,
            put(at(VA[1] + 250, key(DATA, 1)), good_l),
            remote,
            |c| matches!(c, Cause::OutOfBounds { .. }),
        ),
        (
            MAIN,
            put(at(VA[1] - 8, key(DATA, 1)), good_l),
            remote,
            |c| matches!(c, Cause::OutOfBounds { .. }),
        ),
        (
            MAIN,
            put(good_r, at(VA[0] + 250, key(DATA, 0))),
            local,
            |c| matches!(c, Cause::OutOfBounds { .. }),
        ),
        // The counters are no source of a write, and take only atomics.
        (
            MAIN,
            put(good_r, at(Fake::COUNTERS, COUNTER_KEY)),
            local,
            |c| {
                matches!(
                    c,
                    Cause::Access {
                        region: Region::Counters,
                        access: Access::LocalRead,
                        ..
                    }
                )
            },
        ),
        (
            COMP,
            put(at(Fake::COUNTERS, COUNTER_KEY), good_l),
            remote,
            |c| {
                matches!(
                    c,
                    Cause::Access {
                        region: Region::Counters,
                        access: Access::RemoteWrite,
                        ..
                    }
                )
            },
        ),
        // Local keys do not exist on other ranks.
        (MAIN, put(at(Fake::SINK, SINK_KEY), good_l), remote, |c| {
            matches!(
                c,
                Cause::UnknownKey {
                    key: SINK_KEY,
                    rank: 1
                }
            )
        }),
        (
            MAIN,
            fa(at(SIG_VA[1] + 4, key(SIG, 1)), sink(0)),
            syndrome::REMOTE_INVAL_REQ_ERR,
            |c| matches!(c, Cause::Unaligned { .. }),
        ),
        (MAIN, fa(at(SIG_VA[1], key(SIG, 1)), sink(64)), local, |c| {
            matches!(c, Cause::OutOfBounds { .. })
        }),
        (
            MAIN,
            fa(at(SIG_VA[1], key(SIG, 1)), at(Fake::COUNTERS, COUNTER_KEY)),
            local,
            |c| {
                matches!(
                    c,
                    Cause::Access {
                        access: Access::LocalWrite,
                        ..
                    }
                )
            },
        ),
    ];
    for (j, op, syn, cause) in cases {
        let mut r = rig(false, 3);
        r.post(j, &[(op.clone(), FM_NONE)]);
        let p = r.step();
        assert_eq!(p.faults.len(), 1, "{op:?}");
        let f = &p.faults[0];
        assert_eq!(f.syndrome, syn, "{op:?}: {f}");
        assert!(cause(&f.cause), "{op:?}: {f}");
        assert_eq!(r.writes(), 0, "{op:?} moved data");
        assert_eq!(
            r.reap(j).iter().map(ok).collect::<Vec<_>>(),
            [(CQE_REQ_ERR, 0, syn)]
        );
    }
    // A window freed after a first write: later WQEs naming it are refused.
    let mut r = rig(false, 3);
    r.post(MAIN, &[(write(0, 8), FM_NONE)]);
    assert!(r.step().faults.is_empty());
    r.fake.remove_part(DATA, 0);
    r.post(MAIN, &[(write(8, 8), FM_NONE)]);
    let p = r.step();
    assert_eq!(p.faults[0].syndrome, local);
    assert!(matches!(
        p.faults[0].cause,
        Cause::NoWindow {
            window: DATA,
            rank: 0,
            ..
        }
    ));
}

#[test]
fn a_collapsed_cq_shows_the_newest_completion_then_the_first_error() {
    let mut r = rig(true, 3);
    assert_eq!(r.collapsed(MAIN).opcode, CQE_INVALID);
    r.post(
        MAIN,
        &[
            (write(0, 8), FM_NONE),
            (write(8, 8), FM_NONE),
            (write(16, 8), FM_NONE),
        ],
    );
    r.step();
    assert_eq!(ok(&r.collapsed(MAIN)), (CQE_REQ, 2, 0));
    let publishes = |r: &Rig| {
        r.fake
            .log
            .iter()
            .filter(|e| matches!(e, Event::Publish { .. }))
            .count()
    };
    assert_eq!(publishes(&r), 1, "one CQE store per pass");
    let mut bad = write(24, 8);
    if let Op::Write { local, .. } = &mut bad {
        local.addr = VA[0] + 4096;
    }
    r.post(
        MAIN,
        &[
            (write(24, 8), FM_NONE),
            (bad, FM_NONE),
            (write(32, 8), FM_NONE),
        ],
    );
    let p = r.step();
    assert_eq!(p.faults.len(), 1);
    // The error supersedes the pass's success; the flushed WQE after it
    // writes nothing, so the first error stays visible.
    assert_eq!(
        ok(&r.collapsed(MAIN)),
        (CQE_REQ_ERR, 4, syndrome::LOCAL_PROT_ERR)
    );
    assert_eq!(r.collapsed(MAIN).qpn, 0x102);
    r.post(MAIN, &[(write(40, 8), FM_NONE)]);
    r.step();
    assert_eq!(
        ok(&r.collapsed(MAIN)),
        (CQE_REQ_ERR, 4, syndrome::LOCAL_PROT_ERR)
    );
    assert_eq!(publishes(&r), 2);
}

/// Three producers reserve ranges A, B, C of one queue and fill them out
/// of order (C, then B, then A). Each may post only in its turn, so the
/// NIC sees A, then B, then C, and never a WQE that is not filled.
#[test]
fn producers_marking_out_of_order_are_executed_in_reservation_order() {
    let mut r = rig(false, 3);
    let qp = r.qps[MAIN].clone();
    let a = (qp.idx.reserve(2), 2);
    let b = (qp.idx.reserve(1), 1);
    let c = (qp.idx.reserve(3), 3);
    let ops = |(s, k): (u64, u64)| -> Vec<(Op, u8)> {
        (s..s + k).map(|i| (write(8 * i, 8), FM_NONE)).collect()
    };
    let post = |(s, k): (u64, u64), hold: bool| qp.try_post(s, s + k, Sharing::Gpu, |_| hold);
    r.fill(MAIN, c.0, &ops(c));
    assert!(!post(c, false), "not C's turn");
    r.fill(MAIN, b.0, &ops(b));
    assert!(!post(b, false), "not B's turn");
    assert_eq!((r.step().consumed, qp.producer_index(0)), (0, Ok(0)));
    r.fill(MAIN, a.0, &ops(a));
    // A's turn; batching holds its doorbell back: still nothing to run.
    assert!(post(a, true));
    assert_eq!(r.step().consumed, 0);
    assert!(qp.ring_held(), "a flush rings what was held back");
    assert_eq!(r.step().consumed, 2);
    assert!(post(b, false));
    assert!(post(c, false));
    assert_eq!(r.step().consumed, 4);
    let order: Vec<u64> = r
        .fake
        .log
        .iter()
        .filter_map(|e| match e {
            Event::Write { dst, .. } => Some(dst.offset / 8),
            _ => None,
        })
        .collect();
    assert_eq!(order, [0, 1, 2, 3, 4, 5]);
    assert_eq!(r.data(1)[..48], r.data(0)[..48]);
}

/// Writes in flight (a write from GPU memory the transport still reads)
/// do not hold their queue: later WQEs execute at once. Their CQEs, and
/// every later one, wait in order behind the oldest write in flight,
/// whatever order the writes complete in; credit comes back with them.
#[test]
fn writes_in_flight_hold_completions_in_order_not_execution() {
    let mut r = rig(false, 3);
    r.fake.late_writes();
    r.post(
        MAIN,
        &[
            (write(0, 8), FM_NONE),
            (write(8, 8), FM_NONE),
            (Op::Nop, FM_NONE),
            (write(16, 8), FM_NONE),
        ],
    );
    let p = r.step();
    assert_eq!((p.consumed, p.landed), (4, 0));
    assert_eq!(r.data(1)[..24], r.data(0)[..24], "every write was issued");
    assert!(r.reap(MAIN).is_empty());
    assert_eq!(r.engine.in_flight(), 4);
    assert!(r.engine.has_work(), "in flight: poll, never sleep");
    // The last write and the second complete first: nothing reported.
    r.fake.complete_write(2);
    r.fake.complete_write(1);
    assert_eq!(r.step(), Progress::default());
    assert!(r.reap(MAIN).is_empty());
    // The first: it, the second and the NOP behind it report.
    r.fake.complete_write(0);
    assert_eq!(r.step().landed, 4);
    let got: Vec<_> = r.reap(MAIN).iter().map(ok).collect();
    assert_eq!(
        got,
        [
            (CQE_REQ, 0, 0),
            (CQE_REQ, 1, 0),
            (CQE_REQ, 2, 0),
            (CQE_REQ, 3, 0)
        ]
    );
    assert_eq!(r.engine.in_flight(), 0);
    assert!(!r.engine.has_work());
    assert_eq!(r.fake.writes_in_flight(), 0);
}

/// A WAIT on a queue with writes in flight passes only once the write it
/// names completed (its CQE reported), so the companion's counter counts
/// completed writes; a collapsed CQ shows the newest completion before
/// the oldest write in flight.
#[test]
fn a_wait_on_writes_in_flight_passes_only_once_they_completed() {
    let mut r = rig(true, 3);
    r.fake.late_writes();
    r.post(MAIN, &[(write(0, 8), FM_NONE), (write(8, 8), FM_NONE)]);
    let w = wait_main(&r, 1);
    r.post(COMP, &[(w, FM_NONE), (bump(0), FM_NONE)]);
    assert_eq!(r.step().consumed, 2, "the WAIT blocks");
    assert_eq!(r.fake.qword(Region::Counters, 0, 0), 0);
    assert_eq!(r.collapsed(MAIN).opcode, CQE_INVALID);
    r.fake.complete_write(0);
    assert_eq!(r.step().consumed, 0, "WQE 1 is still in flight");
    assert_eq!(ok(&r.collapsed(MAIN)), (CQE_REQ, 0, 0));
    assert_eq!(r.fake.qword(Region::Counters, 0, 0), 0);
    r.fake.complete_write(1);
    assert_eq!(r.step().consumed, 2, "the WAIT, then the counter");
    assert_eq!(ok(&r.collapsed(MAIN)), (CQE_REQ, 1, 0));
    assert_eq!(ok(&r.collapsed(COMP)), (CQE_REQ, 1, 0));
    assert_eq!(r.fake.qword(Region::Counters, 0, 0), 1);
}

/// A write that fails in flight is its WQE's error CQE, in order: the
/// WQEs before it completed, the ones after it (already executed, or not)
/// are flushed, and nothing executes on the queue any more. An error of a
/// later WQE behind writes in flight waits for them as well.
#[test]
fn a_write_failing_in_flight_is_an_error_cqe_in_order() {
    let mut r = rig(false, 3);
    r.fake.late_writes();
    r.post(
        MAIN,
        &[
            (write(0, 8), FM_NONE),
            (write(8, 8), FM_NONE),
            (write(16, 8), FM_NONE),
        ],
    );
    r.step();
    r.fake.complete_write(0);
    r.fake.complete_write(2);
    r.fake.fail_write(
        1,
        ExecError::Transport {
            peer: 1,
            why: "the write from GPU memory failed".into(),
        },
    );
    r.post(MAIN, &[(write(24, 8), FM_NONE)]);
    let p = r.step();
    assert_eq!(p.faults.len(), 1);
    assert_eq!(
        (p.faults[0].index, p.faults[0].syndrome),
        (1, syndrome::TRANSPORT_RETRY_EXC_ERR)
    );
    let got: Vec<_> = r.reap(MAIN).iter().map(ok).collect();
    let flush = syndrome::WR_FLUSH_ERR;
    assert_eq!(
        got,
        [
            (CQE_REQ, 0, 0),
            (CQE_REQ_ERR, 1, syndrome::TRANSPORT_RETRY_EXC_ERR),
            (CQE_REQ_ERR, 2, flush),
            (CQE_REQ_ERR, 3, flush)
        ]
    );
    assert_eq!(r.data(1)[24..32], [0; 8], "not executed after the error");
    assert!(r.engine.is_failed(MAIN));
    assert_eq!(r.engine.in_flight(), 0);
    // An invalid WQE behind a write in flight: its error waits, in order.
    let mut r = rig(false, 3);
    r.fake.late_writes();
    let bad = Op::Write {
        remote: MemRef {
            addr: VA[1] + 250,
            key: key(DATA, 1),
        },
        local: MemRef {
            addr: VA[0],
            key: key(DATA, 0),
        },
        len: 8,
    };
    r.post(
        MAIN,
        &[
            (write(0, 8), FM_NONE),
            (bad, FM_NONE),
            (write(8, 8), FM_NONE),
        ],
    );
    let p = r.step();
    assert!(p.faults.is_empty(), "behind the write in flight");
    assert!(r.reap(MAIN).is_empty());
    assert_eq!(r.data(1)[8..16], [0; 8], "nothing executes after it");
    r.fake.complete_write(0);
    let p = r.step();
    assert_eq!(p.faults.len(), 1);
    let got: Vec<_> = r.reap(MAIN).iter().map(ok).collect();
    assert_eq!(
        got,
        [
            (CQE_REQ, 0, 0),
            (CQE_REQ_ERR, 1, syndrome::REMOTE_ACCESS_ERR),
            (CQE_REQ_ERR, 2, flush)
        ]
    );
}

/// 16-bit WQE counters and credit wrap with writes in flight: 70,000
/// writes through a 4-entry queue, completed only when the producer runs
/// out of credit, report every CQE in order.
#[test]
fn writes_in_flight_wrap_past_2_16() {
    let mut r = rig(false, 2);
    r.fake.late_writes();
    let total = 70_000u64;
    let (mut seen, mut main_done, mut completed) = (0u64, 0u64, 0u64);
    for i in 0..total {
        let start = loop {
            let qp = &r.qps[MAIN];
            if has_space(qp.idx.resv.load(Ordering::Acquire), 1, main_done, qp.size()) {
                break qp.idx.reserve(1);
            }
            // Out of credit: the writes issued so far complete.
            while completed < i {
                r.fake.complete_write(completed);
                completed += 1;
            }
            r.step();
            for c in reap_all(&r.qps[MAIN]) {
                assert_eq!(ok(&c), (CQE_REQ, seen as u16, 0), "CQE {seen}");
                seen += 1;
            }
            main_done = r.qps[MAIN].idx.done.load(Ordering::Acquire);
        };
        assert_eq!(start, i);
        r.fill(MAIN, start, &[(write(8 * (i % 16), 8), FM_NONE)]);
        assert!(r.qps[MAIN].try_post(start, start + 1, Sharing::Thread, |_| false));
        r.step();
    }
    while completed < total {
        r.fake.complete_write(completed);
        completed += 1;
    }
    r.step();
    for c in reap_all(&r.qps[MAIN]) {
        assert_eq!(ok(&c), (CQE_REQ, seen as u16, 0));
        seen += 1;
    }
    assert_eq!(seen, total);
    assert_eq!(r.engine.in_flight(), 0);
    assert_eq!(r.fake.writes_in_flight(), 0);
    assert!(r.engine.fault_log().get(MAIN).is_none());
}

#[test]
fn a_late_read_holds_its_queue_but_not_the_others() {
    let mut r = rig(false, 3);
    r.fake.delay_reads(3);
    let read = Op::Read {
        remote: MemRef {
            addr: VA[1],
            key: key(DATA, 1),
        },
        local: MemRef {
            addr: VA[0] + 200,
            key: key(DATA, 0),
        },
        len: 8,
    };
    r.fake.fill(DATA, 1, 0, &[7; 8]);
    r.post(MAIN, &[(read.clone(), FM_NONE), (write(0, 8), FM_NONE)]);
    let selfwrite = Op::Write {
        remote: MemRef {
            addr: VA[0] + 128,
            key: key(DATA, 0),
        },
        local: MemRef {
            addr: VA[0],
            key: key(DATA, 0),
        },
        len: 8,
    };
    r.post(COMP, &[(selfwrite, FM_NONE)]);
    assert_eq!(
        r.step().consumed,
        2,
        "the read, and the other queue's write"
    );
    assert!(r.reap(MAIN).is_empty());
    assert_eq!(r.reap(COMP).len(), 1);
    for _ in 0..2 {
        assert_eq!(r.step().consumed, 0);
        assert!(r.engine.has_work());
    }
    assert_eq!(r.step().consumed, 1, "landed: the write behind it runs");
    assert_eq!(r.data(0)[200..208], [7; 8]);
    let got: Vec<_> = r.reap(MAIN).iter().map(|c| (ok(c), c.byte_cnt)).collect();
    assert_eq!(got, [((CQE_REQ, 0, 0), 8), ((CQE_REQ, 1, 0), 8)]);
    // A read whose peer dies before it lands fails at the read.
    r.post(MAIN, &[(read, FM_NONE)]);
    assert_eq!(r.step().consumed, 1);
    r.fake.kill(1);
    let p = r.step();
    assert_eq!(p.faults.len(), 1);
    assert_eq!(
        (p.faults[0].index, p.faults[0].syndrome),
        (2, syndrome::TRANSPORT_RETRY_EXC_ERR)
    );
}

#[test]
fn without_atomics_fetch_adds_keep_running_totals_where_the_nic_is_the_only_writer() {
    let mut r = rig(false, 3);
    r.fake.set_atomics(Atomics::RunningTotals(SoleWriter {
        signal_window: SIG,
        counter_stride: 16,
    }));
    // Slot 2's sub-slot of rank 0 at rank 1: (2 * N + 0) * 8.
    let mine = 2 * N as u64 * 8;
    r.post(
        MAIN,
        &[(signal(mine, 5), FM_NONE), (signal(mine, 3), FM_NONE)],
    );
    assert!(r.step().faults.is_empty());
    assert_eq!(r.fake.qword(Region::Window(SIG), 1, mine as usize), 8);
    assert_eq!(u64::from_be(r.fake.qword(Region::Sink, 0, 0)), 5);
    assert!(
        !r.fake
            .log
            .iter()
            .any(|e| matches!(e, Event::FetchAdd { .. })),
        "stores of the running total, no atomics"
    );
    let w = wait_main(&r, 1);
    r.post(COMP, &[(w, FM_NONE), (bump(3 * 16), FM_NONE)]);
    assert!(r.step().faults.is_empty());
    assert_eq!(r.fake.qword(Region::Counters, 0, 3 * 16), 1);
    // Rank 1's own sub-slot, a counter's other half, a compare-and-swap.
    let cas = Op::CompareSwap {
        remote: MemRef {
            addr: SIG_VA[1],
            key: key(SIG, 1),
        },
        compare: 0,
        swap: 1,
        result: sink(0),
    };
    for (j, op, cause) in [
        (MAIN, signal(8, 1), "NotSoleWriter"),
        (COMP, bump(8), "NotSoleWriter"),
        (MAIN, cas, "NoCompareSwap"),
    ] {
        let mut r = rig(false, 3);
        r.fake.set_atomics(Atomics::RunningTotals(SoleWriter {
            signal_window: SIG,
            counter_stride: 16,
        }));
        r.post(j, &[(op, FM_NONE)]);
        let p = r.step();
        assert_eq!(p.faults[0].syndrome, syndrome::REMOTE_OP_ERR);
        assert!(format!("{:?}", p.faults[0].cause).starts_with(cause));
        assert_eq!(r.writes(), 0);
    }
}

#[test]
fn a_doorbell_record_that_moved_backwards_is_one_error_and_nothing_runs() {
    let mut r = rig(false, 2);
    r.post(MAIN, &[(write(0, 8), FM_NONE), (write(8, 8), FM_NONE)]);
    r.step();
    let writes = r.writes();
    r.qps[MAIN].ring(1);
    let p = r.step();
    assert_eq!(p.faults.len(), 1);
    let f = &p.faults[0];
    assert_eq!((f.index, f.syndrome), (2, syndrome::LOCAL_QP_OP_ERR));
    let msg = f.to_string();
    for w in ["producer index 1", "consumer index 2", "4-entry"] {
        assert!(msg.contains(w), "{msg}");
    }
    for _ in 0..3 {
        assert_eq!(r.step(), Progress::default(), "reported once");
    }
    assert!(!r.engine.has_work());
    assert_eq!(r.writes(), writes);
}

#[test]
fn malformed_misplaced_and_misdirected_wqes_are_local_qp_errors() {
    const QPN: u32 = 0x102;
    type Corrupt = Box<dyn Fn(&Rig)>;
    let cases: Vec<(Corrupt, Check)> = vec![
        (
            Box::new(|r: &Rig| r.qps[MAIN].write_wqe(0, &[0xff; 64])),
            |c| matches!(c, Cause::Malformed(_)),
        ),
        (
            Box::new(|r: &Rig| {
                r.qps[MAIN].write_wqe(0, &encode(&write(0, 8), 5, QPN, CQ_UPDATE).unwrap());
            }),
            |c| {
                matches!(
                    c,
                    Cause::WrongIndex {
                        index: 0,
                        carried: 5
                    }
                )
            },
        ),
        (
            Box::new(|r: &Rig| {
                r.qps[MAIN].write_wqe(0, &encode(&write(0, 8), 0, 0x104, CQ_UPDATE).unwrap());
            }),
            |c| {
                matches!(
                    c,
                    Cause::WrongQp {
                        carried: 0x104,
                        qpn: 0x102
                    }
                )
            },
        ),
        (
            Box::new(|r: &Rig| {
                let w = Op::Wait {
                    max_index: 0,
                    cqn: 0x999,
                };
                r.qps[MAIN].write_wqe(0, &encode(&w, 0, QPN, CQ_UPDATE).unwrap());
            }),
            |c| matches!(c, Cause::UnknownCq { cqn: 0x999 }),
        ),
    ];
    for (write_it, cause) in cases {
        let mut r = rig(false, 3);
        write_it(&r);
        let qp = &r.qps[MAIN];
        let s = qp.idx.reserve(1);
        assert!(qp.try_post(s, s + 1, Sharing::Thread, |_| false));
        let p = r.step();
        assert_eq!(p.faults[0].syndrome, syndrome::LOCAL_QP_OP_ERR);
        assert!(cause(&p.faults[0].cause), "{}", p.faults[0]);
    }
}

#[test]
fn a_failing_completion_path_stops_the_engine() {
    let mut r = rig(false, 3);
    r.fake.fail_publish();
    r.post(MAIN, &[(write(0, 8), FM_NONE)]);
    let e = r.engine.step(&mut r.fake).unwrap_err();
    assert!(
        matches!(
            e,
            EngineError::Executor {
                rank: 0,
                qpn: 0x102,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn queues_that_cannot_work_are_refused_at_creation() {
    let q = Arc::new(Qp::new(0x100, 0x100, 0, 3));
    let spec = |qpn, cqn, peer, mode| QueueSpec {
        qpn,
        cqn,
        peer,
        channel: 0,
        cq_mode: mode,
        sq: SqView::host(&q),
        cq: CqView::host(&q),
    };
    let ring = CqMode::Ring { log2: 3 };
    let cfg = EngineConfig {
        rank: 0,
        nranks: 2,
        counters: Part { base: 0, size: 0 },
        sink: Part { base: 0, size: 0 },
        batch: 0,
    };
    let e = |specs| Engine::new(cfg, specs).unwrap_err();
    assert!(matches!(
        e(vec![spec(1, 1, 0, ring), spec(2, 1, 0, ring)]),
        EngineError::DuplicateCq { cqn: 1, .. }
    ));
    assert!(matches!(
        e(vec![spec(1, 1, 2, ring)]),
        EngineError::BadPeer { peer: 2, .. }
    ));
    assert!(matches!(
        e(vec![spec(1 << 24, 1, 0, ring)]),
        EngineError::Qpn { .. }
    ));
    assert!(matches!(
        e(vec![spec(1, 1, 0, CqMode::Ring { log2: 2 })]),
        EngineError::CqTooSmall {
            cq_log2: 2,
            sq_log2: 3,
            ..
        }
    ));
}

/// The driver lets the executor enter before the first step; one that
/// cannot is the NIC's first error, and nothing posted is executed.
#[test]
fn a_driver_whose_executor_cannot_enter_reports_it_and_executes_nothing() {
    let r = rig(true, 3);
    r.post(MAIN, &[(write(0, 8), FM_NONE)]);
    let Rig {
        mut fake,
        engine,
        qps,
    } = r;
    fake.fail_enter();
    let cfg = DriverConfig {
        name: "nic-under-test".into(),
        idle: Idle::cpu(std::time::Duration::ZERO),
        drain_on_stop: true,
        join_within: std::time::Duration::MAX,
    };
    let nic = SoftNic::start(engine, fake, cfg).unwrap();
    // Stopping joins the thread; entering comes before any step.
    let e = nic.stop().unwrap_err();
    assert!(
        matches!(&e, DriverError::Executor { nic, source: ExecError::Driver { .. } } if nic == "nic-under-test"),
        "{e}"
    );
    assert!(e.to_string().contains("entering failed"), "{e}");
    assert_eq!(collapsed(&qps[MAIN]).opcode, CQE_INVALID);
}

/// An executor that stops in the middle of the pass that publishes the
/// first completion, until the test lets it go: what a kernel sees while
/// the NIC's thread has not finished that pass.
struct Gate {
    inner: Fake,
    published: std::sync::mpsc::Sender<()>,
    release: std::sync::mpsc::Receiver<()>,
    held: bool,
}

impl Executor for Gate {
    type Cq = CqView;

    fn part(&mut self, window: u32, rank: usize) -> Option<Part> {
        self.inner.part(window, rank)
    }
    fn write(&mut self, ch: Channel, dst: Loc, src: Payload<'_>) -> Result<WriteStatus, ExecError> {
        self.inner.write(ch, dst, src)
    }
    fn write_done(&mut self, t: WriteTicket) -> Result<bool, ExecError> {
        self.inner.write_done(t)
    }
    fn read(&mut self, ch: Channel, src: Loc, dst: Loc) -> Result<ReadStatus, ExecError> {
        self.inner.read(ch, src, dst)
    }
    fn read_done(&mut self, t: ReadTicket) -> Result<bool, ExecError> {
        self.inner.read_done(t)
    }
    fn fetch_add(&mut self, ch: Channel, at: Loc, add: u64) -> Result<u64, ExecError> {
        self.inner.fetch_add(ch, at, add)
    }
    fn compare_swap(&mut self, ch: Channel, at: Loc, c: u64, s: u64) -> Result<u64, ExecError> {
        self.inner.compare_swap(ch, at, c, s)
    }
    fn publish(&mut self, ch: Channel, cq: &CqView, stores: &[CqStore]) -> Result<(), ExecError> {
        self.inner.publish(ch, cq, stores)?;
        if !self.held {
            self.held = true;
            let _ = self.published.send(());
            // Until the test lets go (or has gone).
            let _ = self.release.recv();
        }
        Ok(())
    }
    fn confirm(&self, peer: usize) -> Result<(), ExecError> {
        self.inner.confirm(peer)
    }
    fn health(&self) -> Result<(), ExecError> {
        self.inner.health()
    }
}

/// A kernel that ends on an error CQE asks the NIC why at once (CUDA
/// ranks' watch does): the reason must be known as soon as the CQE is
/// visible, not only once the NIC's thread has finished that pass. On the
/// H200 the watch once asked in between and reported the bare syndrome.
#[test]
fn the_reason_for_an_error_cqe_is_known_as_soon_as_the_cqe_is_visible() {
    let mut r = rig(true, 3);
    r.fake.refuse_writes(DATA, 1);
    r.post(MAIN, &[(write(0, 8), FM_NONE)]);
    let Rig { fake, engine, qps } = r;
    let (published, seen) = std::sync::mpsc::channel();
    let (release, held) = std::sync::mpsc::channel();
    let gate = Gate {
        inner: fake,
        published,
        release: held,
        held: false,
    };
    let cfg = DriverConfig {
        name: "nic-under-test".into(),
        idle: Idle::cpu(std::time::Duration::ZERO),
        drain_on_stop: true,
        join_within: std::time::Duration::MAX,
    };
    let nic = SoftNic::start(engine, gate, cfg).unwrap();
    // Dropped before `nic` (whose drop joins the held thread) if an
    // assertion below fails.
    let release = release;
    // (A bound against a hang only: the pass publishes at once.)
    seen.recv_timeout(std::time::Duration::from_secs(30))
        .expect("the NIC published the error CQE");
    // The thread is inside that pass now, and stays there.
    assert_eq!(collapsed(&qps[MAIN]).opcode, CQE_REQ_ERR);
    let e = nic
        .first_error()
        .expect("the reason is known while the pass is still running");
    assert!(
        matches!(&e, DriverError::Fault { nic, fault } if nic == "nic-under-test"
            && fault.syndrome == syndrome::REMOTE_ACCESS_ERR),
        "{e}"
    );
    release.send(()).unwrap();
    assert!(matches!(nic.stop(), Err(DriverError::Fault { .. })));
}
