//! Step tests of the engine driving the CUDA executor, with a GPU whose
//! streams record what the driver would be handed (no CUDA needed): the
//! same engine and executor code the GPU path runs, down to the batching
//! of driver calls. Device addresses are made-up numbers that nothing
//! dereferences.
//!
//! Rank 0 of 3 serves context 0's QP pair to rank 1 (mapped here, channel
//! 0: queues 0 and 1) and to rank 2 (over a keyed transport, channel 1:
//! queues 2 and 3). Producers post with the in-order protocol of `qp.rs`,
//! as `gdaki.cuh` does.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::cell::Cell;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use gin_cuda::batch::stall::{StallWatch, WorkQueues};
use gin_cuda::puts::MERGE_MAX;
use gin_cuda::testing::{Call, Log, MARKS_AT, RecordingGpu as FakeGpu};
use gin_net::region::RegionTable;
use gin_net::testing::{KeyedOp, KeyedRecorder as Keyed};
use gin_net::{MemDesc, MemParts, Memory, Path};

use super::*;
use crate::completion::{CQE_REQ, CQE_REQ_ERR, syndrome};
use crate::nic::{CqStore, ExecError, Executor, Loc, Payload, Progress, Region};
use crate::qp::{Cq, Qp};
use crate::queue::Sharing;
use crate::wqe::{
    CQ_UPDATE, FM_NONE, FM_STRONG_ORDERING, MemRef, OP_ATOMIC_FA as OP_FETCH_ADD, OP_NOP,
    OP_RDMA_READ, OP_RDMA_WRITE as OP_WRITE, Op, encode,
};

const N: usize = 3;
const DATA: u32 = 3;
const SIG: u32 = 4;
const HOST: u32 = 5;
/// Each rank's own address of its parts (what WQEs carry).
const VA: [u64; N] = [0x1000_0000, 0x2000_0000, 0x3000_0000];
const SIG_VA: [u64; N] = [0x4000_0000, 0x5000_0000, 0x6000_0000];
/// Device addresses here: rank 0's own parts, rank 1's mapped through IPC;
/// rank 2 is over tcp.
const DATA_AT: [usize; N] = [0x10_0000, 0x20_0000, 0];
const SIG_AT: [usize; N] = [0x30_0000, 0x40_0000, 0];
/// Keys rank 2 serves its parts under.
const DATA_KEY: u32 = 0x77;
const SIG_KEY: u32 = 0x88;
const COUNTERS: u64 = 0x50_0000;
const COUNTER_SLOTS: u64 = 4;
/// The collapsed CQE of each queue.
const CQ: [u64; 4] = [0x60_0000, 0x60_0040, 0x60_0080, 0x60_00c0];
const LOG2: u32 = 4;
const MAIN: usize = 0;
const COMP: usize = 1;
const TCP: usize = 2;

struct Rig {
    engine: Engine<DevCq>,
    exec: CudaExecutor<FakeGpu>,
    qps: [Arc<Qp>; 4],
    log: Log,
    /// The executor's GPU (shared): its marks, which a test may have a
    /// stream execute.
    gpu: FakeGpu,
    keyed: Arc<Keyed>,
    fabric: Arc<Fabric>,
    sink: Arc<Sink>,
    /// A host window's memory.
    host: Box<[u64]>,
}

fn device(va: [u64; N], at: [usize; N], key: u32, size: u64) -> MemDesc {
    let parts = MemParts {
        memory: Memory::Device,
        local_base: at[0],
        sizes: vec![size; N],
        peer_bases: at.to_vec(),
        keys: vec![0, 0, key],
        addrs: va.to_vec(),
        states: vec![0; N],
        keep: None,
    };
    // SAFETY: made-up device addresses that nothing dereferences: the fake
    // streams only record what they are handed.
    unsafe { MemDesc::new(parts) }
}

thread_local! {
    /// The merge cap the rigs made on this thread give their executors.
    static MERGE: Cell<u64> = const { Cell::new(0) };
}

/// Runs `test` with writes from GPU memory not merged, then merged up to
/// [`MERGE_MAX`] (as the NIC runs by default): the rigs it makes follow.
/// A failure's output names the setting it failed under.
fn both_ways(test: impl Fn()) {
    for merge in [0, MERGE_MAX] {
        eprintln!("merge_max = {merge}");
        MERGE.set(merge);
        test();
    }
    MERGE.set(0);
}

fn rig() -> Rig {
    rig_over(Keyed::default())
}

/// The rig with rank 2 reached over `keyed`.
fn rig_over(keyed: Keyed) -> Rig {
    let keyed = Arc::new(keyed);
    let fabric = Arc::new(Fabric::new(
        0,
        vec![Path::local(), Path::local(), Path::new(keyed.clone())],
        Arc::new(RegionTable::default()),
        Duration::from_secs(1),
    ));
    fabric.add_window(DATA, device(VA, DATA_AT, DATA_KEY, 256));
    fabric.add_window(SIG, device(SIG_VA, SIG_AT, SIG_KEY, 8 * N as u64 * 4));
    let mut host = vec![0u64; 8].into_boxed_slice();
    let base = host.as_mut_ptr() as usize;
    let parts = MemParts {
        local_base: base,
        sizes: vec![64; N],
        peer_bases: vec![base, 0, 0],
        keys: vec![0; N],
        addrs: vec![base as u64; N],
        states: vec![0; N],
        ..MemParts::default()
    };
    // SAFETY: `host` (64 bytes) lives in the rig, longer than the fabric's
    // users; the CUDA executor must refuse it anyway.
    fabric.add_window(HOST, unsafe { MemDesc::new(parts) });
    let qp = |ctx_peer: usize, companion: bool| {
        let qpn = if companion {
            companion_qpn(0, ctx_peer, N)
        } else {
            main_qpn(0, ctx_peer, N)
        }
        .unwrap();
        let peer = if companion { 0 } else { ctx_peer };
        Arc::new(Qp::with_cq(qpn, peer, LOG2, Cq::new(qpn, 0)))
    };
    let qps = [qp(1, false), qp(1, true), qp(2, false), qp(2, true)];
    let specs = qps
        .iter()
        .enumerate()
        .map(|(i, q)| QueueSpec {
            qpn: q.qpn,
            cqn: q.qpn,
            peer: q.peer,
            channel: i / 2,
            cq_mode: CqMode::Collapsed,
            sq: SqView::host(q),
            cq: DevCq(CQ[i]),
        })
        .collect();
    let sink = Arc::new(Sink::default());
    let cfg = EngineConfig {
        rank: 0,
        nranks: N,
        counters: Part {
            base: COUNTERS,
            size: COUNTER_SLOTS * 16,
        },
        sink: Part {
            base: sink.addr(),
            size: (SINK_QWORDS * 8) as u64,
        },
        batch: pass_len(LOG2),
    };
    let gpu = FakeGpu::default();
    let log = gpu.log.clone();
    let layout = Layout {
        channels: 2,
        signal_window: SIG,
        counters: COUNTERS,
        counter_slots: COUNTER_SLOTS,
    };
    // SAFETY: the fake GPU's streams touch no memory.
    let mut exec = unsafe {
        CudaExecutor::new(
            gpu.clone(),
            fabric.clone(),
            layout,
            sink.clone(),
            None,
            Box::new(()),
        )
    };
    exec.merge_puts(MERGE.get());
    exec.enter().unwrap();
    Rig {
        engine: Engine::new(cfg, specs).unwrap(),
        exec,
        qps,
        log,
        gpu,
        keyed,
        fabric,
        sink,
        host,
    }
}

fn key(id: u32, p: usize) -> u32 {
    window_key(id, p, N).unwrap()
}

impl Rig {
    /// Reserves, fills and posts `ops` on queue `j`, in order; the last
    /// index.
    fn post(&self, j: usize, ops: &[(Op, u8)]) -> u64 {
        let qp = &self.qps[j];
        let k = ops.len() as u64;
        let start = qp.idx.reserve(k);
        for (i, (op, fm)) in ops.iter().enumerate() {
            let idx = start + i as u64;
            let b = encode(op, idx as u16, qp.qpn, fm | CQ_UPDATE).unwrap();
            qp.write_wqe(idx, &b);
        }
        assert!(qp.try_post(start, start + k, Sharing::Thread, |_| false));
        start + k - 1
    }

    fn step(&mut self) -> Progress {
        self.engine.step(&mut self.exec).unwrap()
    }

    fn calls(&self) -> Vec<(usize, Call)> {
        self.log.borrow_mut().drain(..).collect()
    }

    /// Queue `j`'s first fault, as the NIC reports it.
    fn fault(&self, j: usize) -> String {
        self.engine.fault_log().get(j).unwrap().to_string()
    }
}

/// The store of a collapsed CQE's last qword reporting success of WQE
/// `idx` of queue `j`.
fn done(j: usize, idx: u64, op: u8) -> (u64, u64) {
    let qpn = [0x102, 0x103, 0x104, 0x105][j];
    let cqe = crate::completion::Cqe {
        opcode: CQE_REQ,
        wqe_counter: idx as u16,
        qpn,
        send_opcode: op,
        byte_cnt: 0,
        syndrome: 0,
        vendor_syndrome: 0,
    }
    .encode(idx, LOG2);
    (
        CQ[j] + 56,
        u64::from_le_bytes(cqe[56..].try_into().unwrap()),
    )
}

/// (opcode, WQE counter) of a CQE's last qword, and the syndrome of its
/// qword 6.
fn decode(q7: u64) -> (u8, u16) {
    let t = q7.to_le_bytes();
    (t[7] >> 4, u16::from_be_bytes([t[4], t[5]]))
}

/// The two stores of an error CQE on queue `j`'s stream: (opcode, WQE
/// counter, syndrome). Panics unless `calls` is exactly that.
fn error_cqe(calls: &[(usize, Call)], j: usize) -> (u8, u16, u8) {
    let [(ch, Call::Stores(s))] = calls else {
        panic!("not one batch of stores: {calls:?}");
    };
    assert_eq!(*ch, j / 2);
    let [(a6, q6), (a7, q7)] = s.as_slice() else {
        panic!("not an error CQE: {s:?}");
    };
    assert_eq!((*a6, *a7), (CQ[j] + 48, CQ[j] + 56), "syndrome first");
    let (op, idx) = decode(*q7);
    (op, idx, q6.to_le_bytes()[7])
}

fn data(rank: usize, off: u64) -> u64 {
    DATA_AT[rank] as u64 + off
}

fn write(peer: usize, off: u64, len: u32) -> Op {
    Op::Write {
        remote: MemRef {
            addr: VA[peer] + off,
            key: key(DATA, peer),
        },
        local: MemRef {
            addr: VA[0] + off,
            key: key(DATA, 0),
        },
        len,
    }
}

fn inline(peer: usize, off: u64, v: u64) -> Op {
    Op::WriteInline {
        remote: MemRef {
            addr: VA[peer] + off,
            key: key(DATA, peer),
        },
        data: v.to_le_bytes().to_vec(),
    }
}

/// This rank's (0) sub-slot of signal slot `slot` at `peer`.
fn signal(peer: usize, slot: u64, add: u64, result: u64) -> Op {
    Op::FetchAdd {
        remote: MemRef {
            addr: SIG_VA[peer] + slot * N as u64 * 8,
            key: key(SIG, peer),
        },
        add,
        result: MemRef {
            addr: result,
            key: SINK_KEY,
        },
    }
}

fn counter(slot: u64, result: u64) -> Op {
    Op::FetchAdd {
        remote: MemRef {
            addr: COUNTERS + slot * 16,
            key: COUNTER_KEY,
        },
        add: 1,
        result: MemRef {
            addr: result,
            key: SINK_KEY,
        },
    }
}

/// A put with a signal to a peer mapped here: one copy, then the signal's
/// running total into this rank's sub-slot at the peer and the one CQE of
/// the pass, in one driver call after the copy, on the pair's stream; the
/// old value lands in the sink.
#[test]
fn a_put_with_signal_is_a_copy_then_the_total_then_one_cqe() {
    both_ways(|| {
        let mut r = rig();
        let sink = r.sink.addr();
        r.post(
            MAIN,
            &[
                (write(1, 16, 64), FM_NONE),
                (signal(1, 2, 5, sink), FM_STRONG_ORDERING),
            ],
        );
        assert_eq!(r.step().consumed, 2);
        assert_eq!(
            r.calls(),
            vec![
                (0, Call::Copy(data(1, 16), data(0, 16), 64)),
                (
                    0,
                    Call::Stores(vec![
                        (SIG_AT[1] as u64 + 48, 5),
                        done(MAIN, 1, OP_FETCH_ADD)
                    ])
                ),
            ]
        );
        // A second signal: the running total, and the old value (big-endian)
        // in the sink.
        r.post(MAIN, &[(signal(1, 2, 3, sink), FM_NONE)]);
        assert_eq!(r.step().consumed, 1);
        assert_eq!(
            r.calls(),
            vec![(
                0,
                Call::Stores(vec![
                    (SIG_AT[1] as u64 + 48, 8),
                    done(MAIN, 2, OP_FETCH_ADD)
                ])
            )]
        );
        assert_eq!(u64::from_be(r.sink.qword(0).unwrap()), 5);
        assert!(r.engine.fault_log().get(MAIN).is_none());
    });
}

/// The companion's WAIT holds its counter until the main queue's CQE was
/// handed to the shared stream; the counter's total is then stored after
/// the data and the main CQE, on the same stream.
#[test]
fn a_counter_lands_after_the_data_on_the_shared_stream() {
    both_ways(|| {
        let mut r = rig();
        let sink = r.sink.addr();
        let wait = |idx: u32| Op::Wait {
            max_index: idx,
            cqn: 0x102,
        };
        // The WAIT names main WQE 0, which is not posted yet.
        r.post(COMP, &[(wait(0), FM_NONE), (counter(3, sink + 8), FM_NONE)]);
        assert_eq!(r.step().consumed, 0);
        assert!(r.calls().is_empty());
        r.post(MAIN, &[(write(1, 0, 8), FM_NONE)]);
        assert_eq!(r.step().consumed, 3);
        assert_eq!(
            r.calls(),
            vec![
                (0, Call::Copy(data(1, 0), data(0, 0), 8)),
                (
                    0,
                    Call::Store(done(MAIN, 0, OP_WRITE).0, done(MAIN, 0, OP_WRITE).1)
                ),
                (
                    0,
                    Call::Stores(vec![(COUNTERS + 3 * 16, 1), done(COMP, 1, OP_FETCH_ADD)])
                ),
            ]
        );
        // Running totals per counter.
        r.post(
            COMP,
            &[(counter(3, sink + 8), FM_NONE), (counter(0, sink), FM_NONE)],
        );
        r.step();
        assert_eq!(
            r.calls(),
            vec![(
                0,
                Call::Stores(vec![
                    (COUNTERS + 3 * 16, 2),
                    (COUNTERS, 1),
                    done(COMP, 3, OP_FETCH_ADD)
                ])
            )]
        );
    });
}

/// Where this NIC is not the only writer, or the operation needs an
/// atomic, or an operand is out of bounds, the WQE is refused before
/// anything is queued: the error CQE is all the stream sees.
#[test]
fn refused_atomics_and_ranges_queue_nothing_but_the_error_cqe() {
    both_ways(|| {
        let shifted = |remote: u64, local: u64| Op::Write {
            remote: MemRef {
                addr: VA[1] + remote,
                key: key(DATA, 1),
            },
            local: MemRef {
                addr: VA[0] + local,
                key: key(DATA, 0),
            },
            len: 8,
        };
        let cases = |sink: u64| {
            [
                (shifted(250, 0), syndrome::REMOTE_ACCESS_ERR),
                (shifted(0, 250), syndrome::LOCAL_PROT_ERR),
                (
                    // Rank 1's own sub-slot: this NIC is not its only writer.
                    Op::FetchAdd {
                        remote: MemRef {
                            addr: SIG_VA[1] + 8,
                            key: key(SIG, 1),
                        },
                        add: 1,
                        result: MemRef {
                            addr: sink,
                            key: SINK_KEY,
                        },
                    },
                    syndrome::REMOTE_OP_ERR,
                ),
                (
                    // A fetch-add on data: not a signal sub-slot.
                    Op::FetchAdd {
                        remote: MemRef {
                            addr: VA[1],
                            key: key(DATA, 1),
                        },
                        add: 1,
                        result: MemRef {
                            addr: sink,
                            key: SINK_KEY,
                        },
                    },
                    syndrome::REMOTE_OP_ERR,
                ),
                (
                    Op::CompareSwap {
                        remote: MemRef {
                            addr: SIG_VA[1],
                            key: key(SIG, 1),
                        },
                        compare: 0,
                        swap: 1,
                        result: MemRef {
                            addr: sink,
                            key: SINK_KEY,
                        },
                    },
                    syndrome::REMOTE_OP_ERR,
                ),
                (signal(1, 0, 1, sink + 64), syndrome::LOCAL_PROT_ERR),
                // Unaligned inline data to GPU memory: a copy engine stores
                // aligned qwords.
                (inline(1, 4, 7), syndrome::LOCAL_QP_OP_ERR),
            ]
        };
        for i in 0..7 {
            let mut r = rig();
            let (op, syn) = cases(r.sink.addr())[i].clone();
            r.post(MAIN, &[(op.clone(), FM_NONE)]);
            assert_eq!(r.step().consumed, 1);
            assert_eq!(error_cqe(&r.calls(), MAIN), (CQE_REQ_ERR, 0, syn), "{op:?}");
        }
    });
}

/// The first error names QP, WQE index, syndrome and key; later WQEs are
/// flushed without moving data, and the first error stays visible.
#[test]
fn a_bad_key_is_an_error_cqe_and_the_queue_stays_in_error() {
    both_ways(|| {
        let mut r = rig();
        let mut bad = write(1, 0, 8);
        if let Op::Write { remote, .. } = &mut bad {
            remote.key = 0xdead_0001;
        }
        r.post(MAIN, &[(write(1, 0, 8), FM_NONE), (bad, FM_NONE)]);
        let p = r.step();
        assert_eq!((p.consumed, p.faults.len()), (2, 1));
        let calls = r.calls();
        assert_eq!(calls[0], (0, Call::Copy(data(1, 0), data(0, 0), 8)));
        assert_eq!(
            error_cqe(&calls[1..], MAIN),
            (CQE_REQ_ERR, 1, syndrome::REMOTE_ACCESS_ERR)
        );
        let e = r.fault(MAIN);
        for w in [
            "QP 0x102 to rank 1",
            "WQE index 1",
            "syndrome 0x13",
            "0xdead0001",
        ] {
            assert!(e.contains(w), "error {e:?} does not mention {w:?}");
        }
        r.post(MAIN, &[(write(1, 32, 8), FM_NONE)]);
        assert_eq!(r.step().consumed, 1);
        assert!(r.calls().is_empty());
        assert_eq!(r.fault(MAIN), e);
    });
}

/// A window removed from the directory (what dropping a GPU window does)
/// is refused, though the executor had it cached; so is a host window.
#[test]
fn freed_and_host_windows_are_refused() {
    both_ways(|| {
        let mut r = rig();
        r.post(MAIN, &[(write(1, 0, 8), FM_NONE)]);
        r.step();
        assert_eq!(r.calls()[0], (0, Call::Copy(data(1, 0), data(0, 0), 8)));
        r.fabric.remove_window(DATA);
        r.post(MAIN, &[(write(1, 8, 8), FM_NONE)]);
        r.step();
        assert_eq!(
            error_cqe(&r.calls(), MAIN),
            (CQE_REQ_ERR, 1, syndrome::LOCAL_PROT_ERR)
        );
        assert!(r.fault(MAIN).contains("which is not registered"));

        let mut r = rig();
        let host = Op::Write {
            remote: MemRef {
                addr: VA[1],
                key: key(DATA, 1),
            },
            local: MemRef {
                addr: r.host.as_ptr() as u64,
                key: key(HOST, 0),
            },
            len: 8,
        };
        r.post(MAIN, &[(host, FM_NONE)]);
        r.step();
        assert_eq!(
            error_cqe(&r.calls(), MAIN),
            (CQE_REQ_ERR, 0, syndrome::LOCAL_PROT_ERR)
        );
    });
}

#[test]
fn a_wqe_with_the_wrong_index_is_a_local_qp_error() {
    both_ways(|| {
        let mut r = rig();
        let qp = &r.qps[MAIN];
        // Written for index 5, posted at index 0.
        qp.write_wqe(0, &encode(&write(1, 0, 8), 5, qp.qpn, CQ_UPDATE).unwrap());
        qp.ring(1);
        r.step();
        assert_eq!(
            error_cqe(&r.calls(), MAIN),
            (CQE_REQ_ERR, 0, syndrome::LOCAL_QP_OP_ERR)
        );
        assert!(r.fault(MAIN).contains("carries index 5"));
    });
}

#[test]
fn a_doorbell_record_that_went_backwards_is_one_fatal_qp_error_and_nothing_runs() {
    both_ways(|| {
        let mut r = rig();
        r.post(
            MAIN,
            &[(write(1, 0, 8), FM_NONE), (write(1, 8, 8), FM_NONE)],
        );
        assert_eq!(r.step().consumed, 2);
        r.calls();
        // The record moves back by one: read as 0xffff WQEs ahead of the
        // consumer index (2) on a 16-entry queue. Producers post in reservation
        // order, so it never happens to a working queue.
        r.qps[MAIN].dbrec[1].store(1u32.to_be(), Ordering::Release);
        assert_eq!(r.step().consumed, 0);
        assert_eq!(
            error_cqe(&r.calls(), MAIN),
            (CQE_REQ_ERR, 2, syndrome::LOCAL_QP_OP_ERR)
        );
        let e = r.fault(MAIN);
        for w in [
            "QP 0x102 to rank 1",
            "producer index 1",
            "consumer index 2",
            "16-entry",
        ] {
            assert!(e.contains(w), "error {e:?} does not mention {w:?}");
        }
        // Reported once: later passes (and later posts) add nothing and move
        // no data; the first error stays where the kernel reads it.
        assert_eq!(r.step().consumed, 0);
        r.qps[MAIN].ring(2);
        r.post(MAIN, &[(write(1, 16, 8), FM_NONE)]);
        r.step();
        assert!(r.calls().is_empty());
        assert_eq!(r.fault(MAIN), e);
    });
}

/// A peer over tcp: inline data and then the signal's running total go
/// through the fabric as puts to its keys, in order; the CQE is still a
/// store on the pair's stream. Once the peer is dead, the next WQE
/// completes with "transport retry counter exceeded" (0x15).
#[test]
fn a_tcp_peer_gets_puts_through_the_fabric_and_a_dead_one_is_0x15() {
    both_ways(|| {
        let mut r = rig();
        let sink = r.sink.addr();
        r.post(
            TCP,
            &[
                (inline(2, 16, 0x1234), FM_NONE),
                (signal(2, 2, 9, sink), FM_NONE),
            ],
        );
        assert_eq!(r.step().consumed, 2);
        assert_eq!(
            r.keyed.puts(),
            vec![
                (2, DATA_KEY, 16, 0x1234u64.to_le_bytes().to_vec()),
                (2, SIG_KEY, 48, 9u64.to_le_bytes().to_vec()),
            ]
        );
        assert_eq!(
            r.calls(),
            vec![(
                1,
                Call::Store(done(TCP, 1, OP_FETCH_ADD).0, done(TCP, 1, OP_FETCH_ADD).1)
            )]
        );
        // Staging a window's bytes needs the pinned buffer, which only a GPU
        // rank with tcp peers has: refused, nothing sent.
        r.post(TCP, &[(write(2, 0, 64), FM_NONE)]);
        r.step();
        assert_eq!(
            error_cqe(&r.calls(), TCP),
            (CQE_REQ_ERR, 2, syndrome::LOCAL_QP_OP_ERR)
        );
        assert!(r.fault(TCP).contains("no staging buffer"));
        assert_eq!(r.keyed.puts().len(), 2);
        // Every 8-byte value is ordered after what came before it.
        assert!(matches!(
            r.keyed.ops().as_slice(),
            [
                KeyedOp::Put { ordered: true, .. },
                KeyedOp::Put { ordered: true, .. }
            ]
        ));

        let mut r = rig();
        r.keyed.kill();
        r.post(TCP, &[(inline(2, 0, 1), FM_NONE)]);
        r.step();
        assert_eq!(
            error_cqe(&r.calls(), TCP),
            (CQE_REQ_ERR, 0, syndrome::TRANSPORT_RETRY_EXC_ERR)
        );
        let e = r.fault(TCP);
        assert!(e.contains("rank 2 is unreachable"), "{e}");
        // The mapped peer's pair is not affected.
        r.post(MAIN, &[(inline(1, 0, 7), FM_NONE)]);
        r.step();
        assert_eq!(
            r.calls(),
            vec![(
                0,
                Call::Stores(vec![(data(1, 0), 7), done(MAIN, 0, OP_WRITE)])
            )]
        );
    });
}

/// A transport that takes GPU memory (ucx with its CUDA transports) gets
/// a write's source and a read's destination as device addresses: no
/// staging (the rig has no staging buffer), the pair's stream drained
/// first (once: nothing is queued between), the signal's running total put
/// after the data, ordered, the write completed before the read, and the
/// CQE stored after all of it.
#[test]
fn a_transport_taking_gpu_memory_gets_it_directly_and_the_total_after_it() {
    both_ways(|| {
        let mut r = rig_over(Keyed::taking_device_memory());
        let sink = r.sink.addr();
        let read = Op::Read {
            remote: MemRef {
                addr: VA[2] + 128,
                key: key(DATA, 2),
            },
            local: MemRef {
                addr: VA[0] + 32,
                key: key(DATA, 0),
            },
            len: 16,
        };
        r.post(
            TCP,
            &[
                (write(2, 0, 64), FM_NONE),
                (signal(2, 2, 9, sink), FM_STRONG_ORDERING),
                (read, FM_NONE),
            ],
        );
        assert_eq!(r.step().consumed, 3);
        assert_eq!(
            r.keyed.ops(),
            vec![
                KeyedOp::PutDevice {
                    peer: 2,
                    key: DATA_KEY,
                    offset: 0,
                    src: data(0, 0),
                    len: 64
                },
                KeyedOp::Put {
                    peer: 2,
                    key: SIG_KEY,
                    offset: 48,
                    bytes: 9u64.to_le_bytes().to_vec(),
                    ordered: true
                },
                KeyedOp::ReadDevice {
                    peer: 2,
                    key: DATA_KEY,
                    offset: 128,
                    dst: data(0, 32),
                    len: 16
                },
            ]
        );
        // The write is completed before the read may overwrite its source
        // (after the write and its total were handed over, before the read);
        // the stream, drained before the write and given nothing since, is
        // not waited for again.
        assert_eq!(r.keyed.completions(), vec![(2, 2)]);
        assert_eq!(r.keyed.in_flight(), 0);
        let (a, v) = done(TCP, 2, OP_RDMA_READ);
        assert_eq!(r.calls(), vec![(1, Call::Sync), (1, Call::Store(a, v))]);
    });
}

/// Writes from GPU memory are pipelined: a pass's writes are all started
/// (the stream drained once, before the first), nothing waits for them,
/// and the collapsed CQE reports, in order, the newest WQE before the
/// oldest write still in flight, as the transport reports them complete.
#[test]
fn writes_from_gpu_memory_are_many_in_flight_and_reported_as_they_complete() {
    both_ways(|| {
        let mut r = rig_over(Keyed::taking_device_memory());
        r.keyed.hold_device_puts();
        // Gaps between them: none continues another (none merges).
        let writes: Vec<(Op, u8)> = (0..4).map(|i| (write(2, i * 64, 32), FM_NONE)).collect();
        r.post(TCP, &writes);
        let p = r.step();
        assert_eq!((p.consumed, p.landed), (4, 0));
        let ops = r.keyed.ops();
        assert_eq!(ops.len(), 4);
        assert!(
            ops.iter()
                .all(|o| matches!(o, KeyedOp::PutDevice { len: 32, .. }))
        );
        assert_eq!(r.keyed.in_flight(), 4);
        assert_eq!(r.engine.in_flight(), 4);
        assert!(r.engine.has_work(), "writes in flight: poll, never sleep");
        assert_eq!(r.calls(), vec![(1, Call::Sync)], "no CQE yet");
        assert_eq!(r.step(), Progress::default());
        r.keyed.complete_device_puts(2);
        assert_eq!(r.step().landed, 2);
        let (a, v) = done(TCP, 1, OP_WRITE);
        assert_eq!(r.calls(), vec![(1, Call::Store(a, v))]);
        r.keyed.complete_device_puts(4);
        assert_eq!(r.step().landed, 2);
        let (a, v) = done(TCP, 3, OP_WRITE);
        assert_eq!(r.calls(), vec![(1, Call::Store(a, v))]);
        assert!(r.keyed.completions().is_empty(), "never waited");
        assert!(!r.engine.has_work());
    });
}

/// Where the transport would wait for writes from GPU memory before an
/// 8-byte value ordered after them (ucx's `GIN_UCX_GPU_ORDER=wait`), a
/// running total behind writes in flight is held, not waited for, and sent
/// once they completed; the companion's WAIT on the main queue passes only
/// then, and its counter's total follows. (The recorder refuses an ordered
/// put that would have to wait.)
#[test]
fn a_total_behind_writes_in_flight_is_held_and_the_companion_waits_for_them() {
    both_ways(|| {
        let mut r = rig_over(Keyed::taking_device_memory());
        r.keyed.hold_device_puts();
        r.keyed.order_by_waiting();
        let sink = r.sink.addr();
        r.post(
            TCP,
            &[
                (write(2, 0, 64), FM_NONE),
                (write(2, 128, 64), FM_NONE),
                (signal(2, 2, 9, sink), FM_STRONG_ORDERING),
            ],
        );
        r.post(
            TCP + 1,
            &[
                (
                    Op::Wait {
                        max_index: 2,
                        cqn: 0x104,
                    },
                    FM_NONE,
                ),
                (counter(1, sink + 8), FM_NONE),
            ],
        );
        let p = r.step();
        assert_eq!(p.consumed, 3, "the WAIT blocks");
        assert!(r.engine.fault_log().get(TCP).is_none());
        let totals = |r: &Rig| -> Vec<u64> {
            r.keyed
                .ops()
                .iter()
                .filter_map(|o| match o {
                    KeyedOp::Put {
                        key: SIG_KEY,
                        bytes,
                        ..
                    } => Some(u64::from_le_bytes(bytes[..].try_into().unwrap())),
                    _ => None,
                })
                .collect()
        };
        assert!(totals(&r).is_empty(), "held behind the writes");
        assert_eq!(r.calls(), vec![(1, Call::Sync)]);
        r.keyed.complete_device_puts(1);
        assert_eq!(r.step().consumed, 0, "the second write is still in flight");
        assert!(totals(&r).is_empty());
        let (a, v) = done(TCP, 0, OP_WRITE);
        assert_eq!(r.calls(), vec![(1, Call::Store(a, v))]);
        r.keyed.complete_device_puts(2);
        let p = r.step();
        assert_eq!(p.consumed, 2, "the WAIT passed, then the counter");
        assert_eq!(totals(&r), [9]);
        let (a, v) = done(TCP, 2, OP_FETCH_ADD);
        assert_eq!(
            r.calls(),
            vec![
                (1, Call::Store(a, v)),
                (
                    1,
                    Call::Stores(vec![(COUNTERS + 16, 1), done(TCP + 1, 1, OP_FETCH_ADD)])
                ),
            ]
        );
        assert!(r.keyed.completions().is_empty(), "never waited");
    });
}

/// A failure of the writes from GPU memory in flight that the transport
/// reports when polled without naming the write (its path failed) is an
/// error CQE at the oldest write in flight, whatever ran after it; what
/// was reported complete before stays so, nothing after it is. (Where the
/// transport names the failed write, that one is blamed: see
/// `the_write_the_transport_names_failed_is_blamed_and_those_before_reported`.)
#[test]
fn a_write_failing_in_flight_is_an_error_cqe_at_its_wqe() {
    both_ways(|| {
        let mut r = rig_over(Keyed::taking_device_memory());
        r.keyed.hold_device_puts();
        // Gaps between them: none continues another (none merges).
        let writes: Vec<(Op, u8)> = (0..3).map(|i| (write(2, i * 64, 32), FM_NONE)).collect();
        r.post(TCP, &writes);
        r.step();
        r.calls();
        r.keyed.complete_device_puts(1);
        r.step();
        let (a, v) = done(TCP, 0, OP_WRITE);
        assert_eq!(r.calls(), vec![(1, Call::Store(a, v))]);
        r.keyed
            .fail_device_puts("put from GPU memory to rank 2 failed: Connection reset");
        r.step();
        let calls = r.calls();
        let (op, idx, syn) = error_cqe(&calls, TCP);
        assert_eq!((op, idx), (CQE_REQ_ERR, 1));
        assert_eq!(syn, syndrome::TRANSPORT_RETRY_EXC_ERR);
        let e = r.fault(TCP);
        assert!(e.contains("Connection reset"), "{e}");
        assert!(r.engine.is_failed(TCP));
        assert_eq!(r.engine.in_flight(), 0);
        // Quiescing completes what is still in flight.
        r.exec.quiesce().unwrap();
        assert_eq!(r.keyed.in_flight(), 0);
    });
}

/// The counter stores of a pass, in the order handed to the driver:
/// (channel, value stored at counter `slot`'s NIC sub-slot).
fn counter_stores(calls: &[(usize, Call)], slot: u64) -> Vec<(usize, u64)> {
    let at = COUNTERS + slot * 16;
    let mut out = Vec::new();
    for (ch, c) in calls {
        match c {
            Call::Store(a, v) if *a == at => out.push((*ch, *v)),
            Call::Stores(s) => {
                out.extend(s.iter().filter(|(a, _)| *a == at).map(|(_, v)| (*ch, *v)));
            }
            _ => {}
        }
    }
    out
}

/// One counter counted by two companions (the pair to rank 2, with a
/// write from GPU memory still in flight, and the pair to rank 1): each
/// total is stored at once, in the order counted, and nothing is stored
/// later once the write completes: the counter never goes back (a total
/// held behind an unrelated write in flight would be stored after the
/// other companion's later one).
#[test]
fn companions_sharing_a_counter_store_its_totals_in_order() {
    both_ways(|| {
        let mut r = rig_over(Keyed::taking_device_memory());
        r.keyed.hold_device_puts();
        let sink = r.sink.addr();
        r.post(TCP, &[(write(2, 0, 64), FM_NONE)]);
        r.post(TCP + 1, &[(counter(1, sink + 8), FM_NONE)]);
        assert_eq!(r.step().consumed, 2);
        let mut calls = r.calls();
        r.post(COMP, &[(counter(1, sink + 16), FM_NONE)]);
        assert_eq!(r.step().consumed, 1);
        calls.extend(r.calls());
        assert_eq!(r.keyed.in_flight(), 1, "the write is in flight");
        r.keyed.complete_device_puts(1);
        r.step();
        calls.extend(r.calls());
        assert_eq!(counter_stores(&calls, 1), vec![(1, 1), (0, 2)]);
        assert!(!r.engine.has_work());
    });
}

/// One counter counted by the companions of two channels, each with its
/// own stream: a total that goes to another stream than the counter's
/// previous one is queued behind a wait for an event recorded after that
/// one, so that the earlier total (behind a long copy, say) never lands
/// after the later one and takes the counter back. The channel's pending
/// work is handed over before the wait (it need not wait); a total on the
/// same stream as the previous one needs nothing; each stream has one
/// event, made once and recorded again at each hand-over; totals of
/// different counters never wait for one another.
#[test]
fn a_counter_shared_by_two_channels_stores_its_totals_in_order() {
    both_ways(|| {
        let mut r = rig();
        let sink = r.sink.addr();
        let at = COUNTERS + 16;
        r.post(TCP + 1, &[(counter(1, sink + 8), FM_NONE)]);
        r.step();
        assert_eq!(
            r.calls(),
            vec![(
                1,
                Call::Stores(vec![(at, 1), done(TCP + 1, 0, OP_FETCH_ADD)])
            )]
        );
        // Channel 0: the write and its CQE handed over first, then the wait,
        // then the total; twice more on channel 0: nothing more.
        r.post(MAIN, &[(write(1, 0, 8), FM_NONE)]);
        r.post(COMP, &[(counter(1, sink + 16), FM_NONE)]);
        r.post(COMP, &[(counter(1, sink + 16), FM_NONE)]);
        r.step();
        let (w, c) = (done(MAIN, 0, OP_WRITE), done(COMP, 1, OP_FETCH_ADD));
        assert_eq!(
            r.calls(),
            vec![
                (0, Call::Copy(data(1, 0), data(0, 0), 8)),
                (0, Call::Store(w.0, w.1)),
                (1, Call::Record(0)),
                (0, Call::Wait(0)),
                (0, Call::Stores(vec![(at, 2), (at, 3), c])),
            ]
        );
        // Back to channel 1, behind channel 0's total with channel 0's own
        // event; then channel 1's event is recorded again, none is made.
        r.post(TCP + 1, &[(counter(1, sink + 8), FM_NONE)]);
        r.step();
        r.post(COMP, &[(counter(1, sink + 16), FM_NONE)]);
        r.step();
        assert_eq!(
            r.calls(),
            vec![
                (0, Call::Record(1)),
                (1, Call::Wait(1)),
                (
                    1,
                    Call::Stores(vec![(at, 4), done(TCP + 1, 1, OP_FETCH_ADD)])
                ),
                (1, Call::Record(0)),
                (0, Call::Wait(0)),
                (0, Call::Stores(vec![(at, 5), done(COMP, 2, OP_FETCH_ADD)])),
            ]
        );
        assert_eq!(r.gpu.events(), 2);
        // Other counters, one on each channel: no waits.
        r.post(TCP + 1, &[(counter(2, sink + 8), FM_NONE)]);
        r.post(COMP, &[(counter(3, sink + 16), FM_NONE)]);
        r.step();
        let calls = r.calls();
        assert!(
            !calls
                .iter()
                .any(|c| matches!(c.1, Call::Record(_) | Call::Wait(_))),
            "{calls:?}"
        );
        assert_eq!(counter_stores(&calls, 2), vec![(1, 1)]);
        assert_eq!(counter_stores(&calls, 3), vec![(0, 1)]);
    });
}

/// A value held behind writes in flight whose sending fails fails its own
/// WQE: the write before it completed and is reported done, not blamed
/// for the value's failure (an entry is released only once what it held
/// was sent).
#[test]
fn a_held_total_that_cannot_be_sent_fails_its_own_wqe() {
    both_ways(|| {
        let mut r = rig_over(Keyed::taking_device_memory());
        r.keyed.hold_device_puts();
        r.keyed.order_by_waiting();
        let sink = r.sink.addr();
        r.post(
            TCP,
            &[
                (write(2, 0, 64), FM_NONE),
                (signal(2, 2, 9, sink), FM_STRONG_ORDERING),
            ],
        );
        assert_eq!(r.step().consumed, 2);
        r.calls();
        r.keyed.refuse(SIG_KEY);
        r.keyed.complete_device_puts(1);
        r.step();
        let (op, idx, syn) = error_cqe(&r.calls(), TCP);
        assert_eq!(
            (op, idx),
            (CQE_REQ_ERR, 1),
            "the signal's WQE, not the write's"
        );
        assert_eq!(syn, syndrome::TRANSPORT_RETRY_EXC_ERR);
        let e = r.fault(TCP);
        assert!(e.contains("0x00000088"), "{e}");
        assert_eq!(r.engine.in_flight(), 0);
    });
}

/// Where the transport names the write from GPU memory that failed, the
/// writes before it are reported done and the error CQE is at its WQE,
/// not at the oldest write in flight.
#[test]
fn the_write_the_transport_names_failed_is_blamed_and_those_before_reported() {
    both_ways(|| {
        let mut r = rig_over(Keyed::taking_device_memory());
        r.keyed.hold_device_puts();
        // Gaps between them: none continues another (none merges).
        let writes: Vec<(Op, u8)> = (0..3).map(|i| (write(2, i * 64, 32), FM_NONE)).collect();
        r.post(TCP, &writes);
        r.step();
        r.calls();
        r.keyed.fail_device_put(
            2,
            3,
            "put from GPU memory to rank 2 failed: Connection reset",
        );
        r.keyed.complete_device_puts(1);
        r.step();
        let (a, v) = done(TCP, 0, OP_WRITE);
        assert_eq!(r.calls(), vec![(1, Call::Store(a, v))]);
        // Put 2 completed: put 3's failure is due, and WQE 1 is not blamed.
        r.keyed.complete_device_puts(2);
        r.step();
        let (op, idx, syn) = error_cqe(&r.calls(), TCP);
        assert_eq!(
            (op, idx, syn),
            (CQE_REQ_ERR, 2, syndrome::TRANSPORT_RETRY_EXC_ERR)
        );
        assert!(r.fault(TCP).contains("Connection reset"));
        assert_eq!(r.engine.in_flight(), 0);
    });
}

/// A write the transport refuses completes with an error CQE as over tcp;
/// the signal after it is never sent.
#[test]
fn a_refused_gpu_memory_write_is_an_error_cqe_without_its_signal() {
    both_ways(|| {
        let mut r = rig_over(Keyed::taking_device_memory());
        let sink = r.sink.addr();
        r.keyed.refuse(DATA_KEY);
        r.post(
            TCP,
            &[
                (write(2, 0, 64), FM_NONE),
                (signal(2, 2, 9, sink), FM_STRONG_ORDERING),
            ],
        );
        r.step();
        let calls = r.calls();
        assert_eq!(calls.first(), Some(&(1, Call::Sync)));
        let (op, idx, _) = error_cqe(&calls[1..], TCP);
        assert_eq!((op, idx), (CQE_REQ_ERR, 0));
        let e = r.fault(TCP);
        assert!(e.contains("0x00000077"), "{e}");
        assert!(r.keyed.ops().is_empty());
    });
}

/// Reads from a mapped peer are copies the other way on the pair's
/// stream; waiting for the streams drops nothing handed over.
#[test]
fn a_read_is_a_copy_back_and_quiesce_waits_for_every_stream() {
    both_ways(|| {
        let mut r = rig();
        let read = Op::Read {
            remote: MemRef {
                addr: VA[1] + 128,
                key: key(DATA, 1),
            },
            local: MemRef {
                addr: VA[0] + 32,
                key: key(DATA, 0),
            },
            len: 16,
        };
        r.post(MAIN, &[(read, FM_NONE)]);
        r.step();
        let (a, v) = done(MAIN, 0, OP_RDMA_READ);
        assert_eq!(
            r.calls(),
            vec![
                (0, Call::Copy(data(0, 32), data(1, 128), 16)),
                (0, Call::Store(a, v)),
            ]
        );
        r.exec.quiesce().unwrap();
        assert_eq!(r.calls(), vec![(0, Call::Sync), (1, Call::Sync)]);
    });
}

/// 16-bit WQE counters wrap: past 2^16 WQEs, every pass still reports its
/// newest WQE in the collapsed CQE after its work, and a companion WAIT
/// naming a wrapped index waits for exactly that WQE.
#[test]
fn wqe_counters_wrap_past_2_16_with_a_collapsed_cq() {
    both_ways(|| {
        let mut r = rig();
        let per = pass_len(LOG2);
        let total = (1u64 << 16) + 3 * per;
        let mut idx = 0;
        while idx < total {
            let ops: Vec<(Op, u8)> = (0..per)
                .map(|i| {
                    if i + 1 == per {
                        (inline(1, 8 * (idx % 8), idx), FM_NONE)
                    } else {
                        (Op::Nop, FM_NONE)
                    }
                })
                .collect();
            let last = r.post(MAIN, &ops);
            assert_eq!(r.step().consumed, per);
            let (a, v) = done(MAIN, last, OP_WRITE);
            assert_eq!(decode(v).1, last as u16);
            assert_eq!(
                r.calls(),
                vec![(0, Call::Stores(vec![(data(1, 8 * (idx % 8)), idx), (a, v)]))],
                "pass ending at WQE {last}"
            );
            idx = last + 1;
        }
        assert!(idx > 1 << 16);
        // The WAIT names the next main WQE by its 16-bit index.
        let next = idx;
        r.post(
            COMP,
            &[
                (
                    Op::Wait {
                        max_index: u32::from(next as u16),
                        cqn: 0x102,
                    },
                    FM_NONE,
                ),
                (counter(1, r.sink.addr()), FM_NONE),
            ],
        );
        assert_eq!(r.step().consumed, 0, "WQE {next} is not posted yet");
        r.post(MAIN, &[(Op::Nop, FM_NONE)]);
        assert_eq!(r.step().consumed, 3);
        let calls = r.calls();
        assert_eq!(calls.len(), 2, "{calls:?}");
        assert_eq!(
            calls[0],
            (
                0,
                Call::Store(done(MAIN, next, OP_NOP).0, done(MAIN, next, OP_NOP).1)
            )
        );
        assert_eq!(
            calls[1],
            (
                0,
                Call::Stores(vec![(COUNTERS + 16, 1), done(COMP, 1, OP_FETCH_ADD)])
            )
        );
    });
}

/// The table layout: context-major, one QP pair per served peer, each on
/// its own channel, and each send queue's slots of the shared arrays at
/// `16 * k` and `64 * k`, as the device code reads `GdakiSqAbi`.
#[test]
fn the_queue_table_matches_the_abi() {
    let slots: Vec<Slot> = layout(2, &[false, true, true]).collect();
    let at = |ctx, peer, channel| Slot {
        ctx,
        peer,
        index: ctx * 3 + peer,
        channel,
    };
    assert_eq!(
        slots,
        vec![at(0, 1, 0), at(0, 2, 1), at(1, 1, 2), at(1, 2, 3)]
    );
    let a = Arrays {
        indices: 0x1000,
        ctl: 0x2000,
        cqes: 0x3000,
    };
    assert_eq!(
        sq_abi(a, 5, 0xab_0000, 0x10a, 7),
        GdakiSqAbi {
            wqes: 0xab_0000,
            indices: 0x1000 + 80,
            dbrec: 0x2000 + 80,
            doorbell: 0x2000 + 88,
            cqe: 0x3000 + 320,
            qpn: 0x10a,
            log2: 7,
        }
    );
    assert!(layout(3, &[false; 4]).next().is_none());
}

/// The executor checks again what it hands a stream (a `Loc` is a request,
/// not a proof): out-of-bounds parts, a source of another length or rank,
/// a counter that is not the NIC's sub-slot, a CQE store outside the CQE,
/// and a read into the sink are refused with nothing queued.
#[test]
fn the_executor_refuses_locations_it_cannot_vouch_for() {
    both_ways(|| {
        let mut r = rig();
        let loc = |rank, region, offset, len| Loc {
            rank,
            region,
            offset,
            len,
        };
        let data = Region::Window(DATA);
        let src = Payload::Local(loc(0, data, 0, 8));
        let cases: Vec<(Result<(), ExecError>, &str)> = vec![
            (
                r.exec.write(0, loc(1, data, 252, 8), src).map(|_| ()),
                "exceed rank 1's 256 bytes",
            ),
            (
                r.exec.write(0, loc(1, data, 0, 16), src).map(|_| ()),
                "a write of 8 bytes from rank 0's memory into 16 bytes",
            ),
            (
                r.exec
                    .write(0, loc(1, data, 0, 8), Payload::Local(loc(1, data, 0, 8)))
                    .map(|_| ()),
                "from rank 1's memory",
            ),
            (
                r.exec
                    .write(0, loc(0, Region::Counters, 8, 8), Payload::Bytes(&[0; 8]))
                    .map(|_| ()),
                "not the NIC's sub-slot",
            ),
            (
                r.exec
                    .write(
                        0,
                        loc(0, Region::Counters, COUNTER_SLOTS * 16, 8),
                        Payload::Bytes(&[0; 8]),
                    )
                    .map(|_| ()),
                "not the NIC's sub-slot",
            ),
            (
                r.exec
                    .write(0, loc(0, Region::Sink, 64, 8), Payload::Bytes(&[0; 8]))
                    .map(|_| ()),
                "outside the atomic result sink",
            ),
            (
                r.exec.publish(
                    0,
                    &DevCq(CQ[0]),
                    &[CqStore {
                        offset: 64,
                        bytes: [0; 8],
                    }],
                ),
                "outside the 64-byte collapsed CQE",
            ),
            (
                r.exec
                    .read(0, loc(1, data, 0, 8), loc(0, Region::Sink, 0, 8))
                    .map(|_| ()),
                "reads into this rank's window parts",
            ),
        ];
        for (i, (res, want)) in cases.into_iter().enumerate() {
            let e = res.unwrap_err().to_string();
            assert!(e.contains(want), "case {i}: {e:?} does not say {want:?}");
        }
        r.exec.end_pass(0).unwrap();
        assert!(r.calls().is_empty());
    });
}

/// Watched for stalls, every pass handed to a channel's stream ends with
/// the channel's next mark, after the pass's CQE in the same driver call.
/// A stream that never executes it is a stall once the threshold has
/// passed (strictly) since the pass was handed over, not before, naming
/// its channel (context and peer) and CUDA_DEVICE_MAX_CONNECTIONS; one that
/// completes late, but before the threshold, is none. Time is the test's:
/// the pass was handed over between `before` and `after`.
#[test]
fn a_channel_stream_that_never_completes_is_a_stall_naming_the_peer() {
    both_ways(|| {
        let mut r = rig();
        let thr = Duration::from_secs(2);
        let w = Arc::new(StallWatch::new(
            0,
            "CUDA soft NIC",
            vec![channel_name(0, 0, 1), channel_name(1, 0, 2)],
            r.gpu.marks(2),
            thr,
            WorkQueues {
                max_connections: Some("2".into()),
                mps: true,
            },
        ));
        r.exec.watch_stalls(w.clone());
        r.post(MAIN, &[(write(1, 16, 64), FM_NONE)]);
        let before = Instant::now();
        assert_eq!(r.step().consumed, 1);
        let after = Instant::now();
        assert_eq!(
            r.calls(),
            vec![
                (0, Call::Copy(data(1, 16), data(0, 16), 64)),
                (
                    0,
                    Call::Stores(vec![done(MAIN, 0, OP_WRITE), (MARKS_AT, 1)])
                ),
            ]
        );
        assert_eq!(w.check(before + thr), None, "not before the threshold");
        let s = w.check(after + thr + Duration::from_millis(1)).unwrap();
        let m = s.to_string();
        for want in [
            "the CUDA soft NIC stalled",
            "channel 0 (context 0's QPs to peer 1)",
            "CUDA_DEVICE_MAX_CONNECTIONS=2",
            "MPS in use",
        ] {
            assert!(m.contains(want), "{want:?} missing from {m}");
        }
        assert!(s.first);
        assert!(!w.check(after + thr * 2).unwrap().first, "reported once");
        r.gpu.complete(0);
        assert_eq!(w.check(after + thr * 10), None);

        // Late, but before the threshold: never a stall.
        r.post(MAIN, &[(write(1, 0, 8), FM_NONE)]);
        let before = Instant::now();
        r.step();
        assert_eq!(r.calls().len(), 2, "the copy, then the CQE and mark 2");
        assert_eq!(w.check(before + thr / 2), None);
        r.gpu.complete(0);
        assert_eq!(w.check(before + thr * 10), None);
    });
}

/// The rig over a transport taking GPU memory, its writes held in flight,
/// with writes from GPU memory merged as the NIC runs.
fn rig_merging() -> Rig {
    let mut r = rig_over(Keyed::taking_device_memory());
    r.keyed.hold_device_puts();
    r.exec.merge_puts(MERGE_MAX);
    r
}

/// Writes from GPU memory in one pass that continue one another, in any
/// order, reach the transport as one put; the CQE covers them only once
/// it completed; a signal's total held behind them goes only then, after
/// the data.
#[test]
fn adjacent_writes_in_a_pass_go_as_one_transport_put() {
    let mut r = rig_merging();
    r.keyed.order_by_waiting();
    let sink = r.sink.addr();
    // A pass takes four WQEs here (a quarter of the queue).
    let mut wqes: Vec<(Op, u8)> = [2u64, 0, 1]
        .iter()
        .map(|&i| (write(2, i * 64, 64), FM_NONE))
        .collect();
    wqes.push((signal(2, 2, 9, sink), FM_STRONG_ORDERING));
    r.post(TCP, &wqes);
    assert_eq!(r.step().consumed, 4);
    let ops = r.keyed.ops();
    assert_eq!(
        ops,
        vec![KeyedOp::PutDevice {
            peer: 2,
            key: DATA_KEY,
            offset: 0,
            src: data(0, 0),
            len: 192
        }],
        "one put, and no total before it completed"
    );
    assert_eq!(r.calls(), vec![(1, Call::Sync)], "no CQE yet");
    assert_eq!(r.step(), Progress::default());
    r.keyed.complete_device_puts(1);
    assert_eq!(r.step().landed, 4);
    assert!(matches!(
        r.keyed.ops()[1],
        KeyedOp::Put {
            key: SIG_KEY,
            ordered: true,
            ..
        }
    ));
    let (a, v) = done(TCP, 3, OP_FETCH_ADD);
    assert_eq!(r.calls(), vec![(1, Call::Store(a, v))]);
}

/// A merged write that fails is an error CQE at its first WQE, whose
/// account names that write's bytes and offset and the merged put.
#[test]
fn a_failed_merged_write_is_an_error_cqe_naming_its_first_original() {
    let mut r = rig_merging();
    let wqes: Vec<(Op, u8)> = (0..3).map(|i| (write(2, i * 64, 64), FM_NONE)).collect();
    r.post(TCP, &wqes);
    r.step();
    r.calls();
    r.keyed.fail_device_put(
        2,
        1,
        "put from GPU memory to rank 2 failed: Connection reset",
    );
    r.step();
    let (op, idx, syn) = error_cqe(&r.calls(), TCP);
    assert_eq!(
        (op, idx, syn),
        (CQE_REQ_ERR, 0, syndrome::TRANSPORT_RETRY_EXC_ERR)
    );
    let e = r.fault(TCP);
    assert!(
        e.contains("Connection reset")
            && e.contains("this put's 64 bytes at offset 0 of key 0x00000077")
            && e.contains("put #1, 192 bytes at offset 0 merged from 3 puts"),
        "{e}"
    );
}

/// Where the transport orders a value after the writes without waiting
/// (`GIN_UCX_GPU_ORDER=fence`), a signal ends the run of writes that
/// merge: those before it start as one, then its total, then the write
/// after it alone; the CQE covers the pass once both completed.
#[test]
fn a_fenced_signal_ends_a_merged_run_and_follows_it() {
    let mut r = rig_merging();
    let sink = r.sink.addr();
    r.post(
        TCP,
        &[
            (write(2, 0, 64), FM_NONE),
            (write(2, 64, 64), FM_NONE),
            (signal(2, 2, 9, sink), FM_STRONG_ORDERING),
            (write(2, 128, 64), FM_NONE),
        ],
    );
    assert_eq!(r.step().consumed, 4);
    let ops = r.keyed.ops();
    assert!(
        matches!(
            ops[..],
            [
                KeyedOp::PutDevice {
                    offset: 0,
                    len: 128,
                    ..
                },
                KeyedOp::Put {
                    key: SIG_KEY,
                    ordered: true,
                    ..
                },
                KeyedOp::PutDevice {
                    offset: 128,
                    len: 64,
                    ..
                },
            ]
        ),
        "{ops:?}"
    );
    r.keyed.complete_device_puts(2);
    assert_eq!(r.step().landed, 4);
    let (a, v) = done(TCP, 3, OP_WRITE);
    assert_eq!(r.calls(), vec![(1, Call::Sync), (1, Call::Store(a, v))]);
}

/// A read behind merged writes whose signal's total is held (ucx's
/// default): the writes start as one and are completed before the read,
/// the total goes before it; the CQE covers the read.
#[test]
fn a_read_behind_merged_writes_sends_their_held_total_first() {
    let mut r = rig_merging();
    r.keyed.order_by_waiting();
    let sink = r.sink.addr();
    let read = Op::Read {
        remote: MemRef {
            addr: VA[2] + 192,
            key: key(DATA, 2),
        },
        local: MemRef {
            addr: VA[0] + 192,
            key: key(DATA, 0),
        },
        len: 16,
    };
    r.post(
        TCP,
        &[
            (write(2, 0, 64), FM_NONE),
            (write(2, 64, 64), FM_NONE),
            (signal(2, 2, 9, sink), FM_STRONG_ORDERING),
            (read, FM_NONE),
        ],
    );
    assert_eq!(r.step().consumed, 4);
    let ops = r.keyed.ops();
    assert!(
        matches!(
            ops[..],
            [
                KeyedOp::PutDevice {
                    offset: 0,
                    len: 128,
                    ..
                },
                KeyedOp::Put {
                    key: SIG_KEY,
                    ordered: true,
                    ..
                },
                KeyedOp::ReadDevice { .. },
            ]
        ),
        "{ops:?}"
    );
    assert_eq!(r.keyed.completions(), vec![(2, 1)]);
    r.step();
    assert!(r.engine.fault_log().get(TCP).is_none());
    let (a, v) = done(TCP, 3, OP_RDMA_READ);
    let calls = r.calls();
    assert_eq!(calls.last(), Some(&(1, Call::Store(a, v))), "{calls:?}");
    assert!(!r.engine.has_work());
}

/// A signal's total held behind a merged write that completed, which
/// cannot be sent, fails its own WQE, not the writes'.
#[test]
fn a_held_total_behind_a_merged_write_that_cannot_be_sent_fails_its_own_wqe() {
    let mut r = rig_merging();
    r.keyed.order_by_waiting();
    let sink = r.sink.addr();
    r.post(
        TCP,
        &[
            (write(2, 0, 64), FM_NONE),
            (write(2, 64, 64), FM_NONE),
            (signal(2, 2, 9, sink), FM_STRONG_ORDERING),
        ],
    );
    assert_eq!(r.step().consumed, 3);
    assert_eq!(r.keyed.ops().len(), 1, "one put, the total held");
    r.calls();
    r.keyed.refuse(SIG_KEY);
    r.keyed.complete_device_puts(1);
    r.step();
    let (op, idx, syn) = error_cqe(&r.calls(), TCP);
    assert_eq!(
        (op, idx, syn),
        (CQE_REQ_ERR, 2, syndrome::TRANSPORT_RETRY_EXC_ERR)
    );
    assert!(r.fault(TCP).contains("0x00000088"), "{}", r.fault(TCP));
}

/// Merged writes of two passes, the transport naming the second failed:
/// the first pass's writes are reported done once complete, then the
/// error CQE is at the second's first WQE, named as its own put.
#[test]
fn the_merged_write_the_transport_names_failed_is_blamed_across_passes() {
    let mut r = rig_merging();
    for pass in 0..2u64 {
        r.post(
            TCP,
            &[
                (write(2, pass * 128, 64), FM_NONE),
                (write(2, pass * 128 + 64, 64), FM_NONE),
            ],
        );
        r.step();
    }
    assert_eq!(r.keyed.ops().len(), 2);
    r.calls();
    r.keyed.complete_device_puts(1);
    r.step();
    let (a, v) = done(TCP, 1, OP_WRITE);
    assert_eq!(r.calls(), vec![(1, Call::Store(a, v))]);
    r.keyed.fail_device_put(
        2,
        2,
        "put from GPU memory to rank 2 failed: Connection reset",
    );
    r.step();
    let (op, idx, _) = error_cqe(&r.calls(), TCP);
    assert_eq!((op, idx), (CQE_REQ_ERR, 2));
    let e = r.fault(TCP);
    assert!(
        e.contains("Connection reset")
            && e.contains("this put's 64 bytes at offset 128 of key 0x00000077")
            && e.contains("put #2, 128 bytes at offset 128 merged from 2 puts")
            && !e.contains("not what failed"),
        "{e}"
    );
}

/// A write refused at start while the write before it is in flight: the
/// next pass's write (to a region the peer still serves) is never handed
/// to the transport, as with merging off (where the refusal puts the
/// queue in error at once); the error CQE is the refused WQE's once the
/// write before it completed.
#[test]
fn a_write_refused_at_start_stops_the_next_pass_while_one_flies() {
    let mut r = rig_merging();
    r.post(TCP, &[(write(2, 0, 64), FM_NONE)]);
    r.step();
    r.keyed.refuse(DATA_KEY);
    r.post(TCP, &[(write(2, 64, 64), FM_NONE)]);
    r.step();
    let to_signals = Op::Write {
        remote: MemRef {
            addr: SIG_VA[2],
            key: key(SIG, 2),
        },
        local: MemRef {
            addr: VA[0],
            key: key(DATA, 0),
        },
        len: 8,
    };
    r.post(TCP, &[(to_signals, FM_NONE)]);
    r.step();
    assert_eq!(r.keyed.ops().len(), 1, "{:?}", r.keyed.ops());
    r.calls();
    r.keyed.complete_device_puts(1);
    r.step();
    let (op, idx, _) = error_cqe(&r.calls(), TCP);
    assert_eq!(
        (op, idx),
        (CQE_REQ_ERR, 1),
        "the refused WQE's, the collapsed CQE's first error"
    );
    assert!(r.fault(TCP).contains("0x00000077"), "{}", r.fault(TCP));
    assert_eq!(r.keyed.ops().len(), 1);
}
