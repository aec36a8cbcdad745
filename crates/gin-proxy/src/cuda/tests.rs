//! Step tests of the engine driving the CUDA executor, with a GPU whose
//! streams record what the driver would be handed (no CUDA needed): the
//! same engine and executor code the GPU path runs, down to the batching
//! of driver calls. Device addresses are made-up numbers that nothing
//! dereferences.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::cell::Cell;
use std::sync::Arc;
use std::time::Instant;

use gin_net::region::RegionTable;
use gin_net::{MemDesc, MemParts, Memory, Path};

use gin_cuda::batch::stall::{StallWatch, WorkQueues};
use gin_cuda::puts::MERGE_MAX;
use gin_cuda::testing::{Call, Log, MARKS_AT, RecordingGpu as FakeGpu};
use gin_net::testing::{KeyedOp, KeyedRecorder as Keyed};

use super::executor::{CudaExecutor, Layout};
use super::*;
use crate::descriptor::{Desc, Op, Sig};
use crate::engine::Progress;
use crate::error::{Invalid, Why};
use crate::executor::Executor;
use crate::ring::Ring;

const N: usize = 3;
/// Window 1: data; 2: signals (3 sub-slots a signal); 3: a host window.
const DATA: u32 = 1;
const SIGNALS: u32 = 2;
const HOST: u32 = 3;
/// Device addresses: rank 0's own data part, rank 1's mapped here.
const DATA_AT: [usize; N] = [0x10_0000, 0x20_0000, 0];
const SIG_AT: [usize; N] = [0x30_0000, 0x40_0000, 0];
/// Keys rank 2 (over the keyed transport) serves its parts under.
const DATA_KEY: u32 = 0x77;
const SIG_KEY: u32 = 0x88;
const COUNTERS: u64 = 0x50_0000;
/// Completion indices of ring 0 (peer 1) and ring 1 (peer 2).
const DONE: [u64; 2] = [0x60_0008, 0x60_0018];
const LOG2: u32 = 6;

struct Rig {
    engine: Engine<CudaExecutor<FakeGpu>>,
    exec: CudaExecutor<FakeGpu>,
    rings: [Arc<Ring>; 2],
    log: Log,
    /// The executor's GPU (shared): its marks, which a test may have a
    /// stream execute.
    gpu: FakeGpu,
    keyed: Arc<Keyed>,
    _host: Box<[u64]>,
}

fn device(at: [usize; N], key: u32, size: u64) -> MemDesc {
    let parts = MemParts {
        memory: Memory::Device,
        local_base: at[0],
        sizes: vec![size; N],
        peer_bases: at.to_vec(),
        keys: vec![0, 0, key],
        addrs: at.iter().map(|&a| a as u64).collect(),
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

/// Runs `test` with puts from GPU memory not merged, then merged up to
/// [`MERGE_MAX`] (as the proxy runs by default): the rigs it makes
/// follow. A failure's output names the setting it failed under.
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
    rig_with(keyed, false)
}

/// Where rank 2's parts are mapped here in [`rig_mapped`].
const DATA_AT_2: usize = 0x70_0000;
const SIG_AT_2: usize = 0x80_0000;

/// The rig with rank 2 mapped here too: both rings' peers take copies on
/// their rings' streams.
fn rig_mapped() -> Rig {
    rig_with(Keyed::default(), true)
}

/// The rig with rank 2 mapped here (`mapped`) or reached over `keyed`.
fn rig_with(keyed: Keyed, mapped: bool) -> Rig {
    let keyed = Arc::new(keyed);
    let two = if mapped {
        Path::local()
    } else {
        Path::new(keyed.clone())
    };
    let fabric = Arc::new(Fabric::new(
        0,
        vec![Path::local(), Path::local(), two],
        Arc::new(RegionTable::default()),
        Duration::from_secs(1),
    ));
    let (mut data_at, mut sig_at) = (DATA_AT, SIG_AT);
    if mapped {
        (data_at[2], sig_at[2]) = (DATA_AT_2, SIG_AT_2);
    }
    fabric.add_window(DATA, device(data_at, DATA_KEY, 4096));
    fabric.add_window(SIGNALS, device(sig_at, SIG_KEY, 8 * N as u64 * 4));
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
    let gpu = FakeGpu::default();
    let log = gpu.log.clone();
    let layout = Layout {
        signal_window: SIGNALS,
        counters: COUNTERS,
        counter_slots: 4,
        done: DONE.to_vec(),
    };
    // SAFETY: the fake GPU's streams touch no memory.
    let mut exec = unsafe { CudaExecutor::new(gpu.clone(), fabric, layout, None, Box::new(())) };
    exec.merge_puts(MERGE.get());
    exec.enter().unwrap();
    let rings = [Arc::new(Ring::new(LOG2)), Arc::new(Ring::new(LOG2))];
    let specs = rings
        .iter()
        .zip([1, 2])
        .map(|(r, peer)| RingSpec {
            ctx: 0,
            peer,
            mem: RingMem::owned(r.clone()),
            first: 0,
        })
        .collect();
    let config = EngineConfig {
        rank: 0,
        batch: pass_len(LOG2),
        counter_slots: 4,
    };
    Rig {
        engine: Engine::new(config, specs),
        exec,
        rings,
        log,
        gpu,
        keyed,
        _host: host,
    }
}

impl Rig {
    fn post(&self, ring: usize, d: &Desc) {
        let r = &self.rings[ring];
        let seq = r.reserve();
        r.write(seq, d);
    }

    fn step(&mut self) -> Progress {
        self.engine.step(&mut self.exec)
    }

    fn calls(&self) -> Vec<(usize, Call)> {
        self.log.borrow_mut().drain(..).collect()
    }
}

fn put(bytes: u64, dst_offset: u64, src_offset: u64) -> Desc {
    Desc {
        op: Op::Put,
        bytes,
        dst_window: DATA,
        dst_offset,
        src_window: DATA,
        src_offset,
        inline: None,
        signal: None,
        counter: None,
    }
}

fn signal(offset: u64, add: u64) -> Sig {
    Sig {
        window: SIGNALS,
        offset,
        add,
        strong: false,
    }
}

fn data(rank: usize, off: u64) -> u64 {
    DATA_AT[rank] as u64 + off
}

/// A put with a signal and a counter to a peer mapped here: one copy, then
/// the signal's running total into this rank's sub-slot at the peer, the
/// counter's total into the proxy's sub-slot, and the completion index —
/// the three stores in one driver call at the end of the batch, all on the
/// ring's stream. Totals are kept per slot.
#[test]
fn a_put_is_a_copy_then_signal_counter_and_completion_stores() {
    both_ways(|| {
        let mut rig = rig();
        rig.post(
            0,
            &Desc {
                signal: Some(signal(24, 3)),
                counter: Some(2),
                ..put(256, 64, 128)
            },
        );
        let p = rig.step();
        assert_eq!((p.executed, p.published), (1, 1));
        assert_eq!(
            rig.calls(),
            vec![
                (0, Call::Copy(data(1, 64), data(0, 128), 256)),
                (
                    0,
                    Call::Stores(vec![
                        (SIG_AT[1] as u64 + 24, 3),
                        (COUNTERS + 2 * 16, 1),
                        (DONE[0], 1)
                    ])
                ),
            ]
        );
        // Two more to the same slot and counter in one batch: running totals.
        for add in [4, 5] {
            rig.post(
                0,
                &Desc {
                    signal: Some(signal(24, add)),
                    counter: Some(2),
                    ..put(0, 0, 0)
                },
            );
        }
        rig.step();
        assert_eq!(
            rig.calls(),
            vec![(
                0,
                Call::Stores(vec![
                    (SIG_AT[1] as u64 + 24, 7),
                    (COUNTERS + 32, 2),
                    (SIG_AT[1] as u64 + 24, 12),
                    (COUNTERS + 32, 3),
                    (DONE[0], 3)
                ])
            )]
        );
    });
}

/// Slices of one message in one batch reach the driver as one copy; an
/// inline put is a store; a get is a copy the other way.
#[test]
fn slices_merge_inline_puts_store_and_gets_copy_back() {
    both_ways(|| {
        let mut rig = rig();
        for i in 0..4 {
            rig.post(0, &put(64, 1024 + i * 64, i * 64));
        }
        rig.post(
            0,
            &Desc {
                inline: Some(0xfeed),
                ..put(8, 8, 0)
            },
        );
        rig.post(
            0,
            &Desc {
                op: Op::Get,
                ..put(32, 512, 2048)
            },
        );
        rig.step();
        assert_eq!(
            rig.calls(),
            vec![
                (0, Call::Copy(data(1, 1024), data(0, 0), 256)),
                (0, Call::Store(data(1, 8), 0xfeed)),
                (0, Call::Copy(data(0, 2048), data(1, 512), 32)),
                (0, Call::Store(DONE[0], 6)),
            ]
        );
    });
}

/// A peer over a keyed transport: the inline value and then the signal's
/// running total go through the fabric as puts to its keys, in order; the
/// completion index is still a store on the ring's stream.
#[test]
fn a_keyed_peer_gets_puts_of_values_and_totals_through_the_fabric() {
    both_ways(|| {
        let mut rig = rig();
        rig.post(
            1,
            &Desc {
                inline: Some(0x1234),
                signal: Some(signal(48, 9)),
                counter: Some(0),
                ..put(8, 16, 0)
            },
        );
        rig.step();
        assert_eq!(
            rig.keyed.puts(),
            vec![
                (2, DATA_KEY, 16, 0x1234u64.to_le_bytes().to_vec()),
                (2, SIG_KEY, 48, 9u64.to_le_bytes().to_vec()),
            ]
        );
        assert_eq!(
            rig.calls(),
            vec![(1, Call::Stores(vec![(COUNTERS, 1), (DONE[1], 1)]))]
        );
        // The total is ordered after the data it counts.
        assert!(matches!(
            rig.keyed.ops().as_slice(),
            [
                KeyedOp::Put { ordered: false, .. },
                KeyedOp::Put { ordered: true, .. }
            ]
        ));
        // A transport that does not take GPU memory gets a window's bytes
        // staged, which needs the pinned buffer only a GPU rank with keyed
        // peers has: refused, nothing sent.
        rig.post(1, &put(64, 0, 0));
        rig.step();
        let e = rig.engine.failure().unwrap().to_string();
        assert!(e.contains("no staging buffer"), "{e}");
        assert_eq!(rig.keyed.puts().len(), 2);
        assert_eq!(rig.keyed.ops().len(), 2);
    });
}

/// A transport that takes GPU memory (ucx with its CUDA transports) gets
/// a put's source and a get's destination as device addresses: no
/// staging (the rig has no staging buffer), the ring's stream drained
/// first, the signal's running total put after the data, ordered, and
/// the counter and completion index stored only after both.
#[test]
fn a_transport_taking_gpu_memory_gets_it_directly_and_the_total_after_it() {
    both_ways(|| {
        let mut rig = rig_over(Keyed::taking_device_memory());
        rig.post(
            1,
            &Desc {
                signal: Some(signal(48, 9)),
                counter: Some(1),
                ..put(4096, 0, 0)
            },
        );
        rig.post(
            1,
            &Desc {
                op: Op::Get,
                ..put(32, 512, 2048)
            },
        );
        let p = rig.step();
        assert_eq!(
            (p.executed, p.published),
            (2, 1),
            "{:?}",
            rig.engine.failure()
        );
        assert_eq!(
            rig.keyed.ops(),
            vec![
                KeyedOp::PutDevice {
                    peer: 2,
                    key: DATA_KEY,
                    offset: 0,
                    src: data(0, 0),
                    len: 4096
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
                    offset: 512,
                    dst: data(0, 2048),
                    len: 32
                },
            ]
        );
        // The get completed the put first (it may read what the get
        // overwrites): the completion came before the read.
        assert_eq!(rig.keyed.completions(), vec![(2, 2)]);
        // The stream is drained before the put reads its source; the
        // counter's store is queued once the put landed (it completed at
        // once), with the completion index; nothing queued since writes a
        // window, so the get needs no second wait.
        assert_eq!(
            rig.calls(),
            vec![
                (1, Call::Sync),
                (1, Call::Stores(vec![(COUNTERS + 16, 1), (DONE[1], 2)])),
            ]
        );
    });
}

/// Puts from GPU memory are pipelined: a batch of them is started one
/// after another (the stream drained once, before the first: nothing that
/// writes a window is queued between them), their signal's total put
/// ordered after them without waiting (`GIN_UCX_GPU_ORDER=fence`), and
/// nothing waits for them: the completion index advances as the transport
/// reports them complete, in order, up to the oldest one still in flight,
/// and a counter counts only once its put (and every one before it)
/// completed.
#[test]
fn puts_from_gpu_memory_are_many_in_flight_and_published_as_they_complete() {
    both_ways(|| {
        let mut rig = rig_over(Keyed::taking_device_memory());
        rig.keyed.hold_device_puts();
        // Gaps between them: none continues another (none merges).
        for i in 0..5 {
            rig.post(1, &put(512, i * 640, i * 640));
        }
        rig.post(
            1,
            &Desc {
                signal: Some(signal(48, 1)),
                ..put(512, 3200, 3200)
            },
        );
        let p = rig.step();
        assert_eq!((p.executed, p.published), (6, 0));
        let ops = rig.keyed.ops();
        assert_eq!(ops.len(), 7);
        assert!(
            ops[..6]
                .iter()
                .all(|o| matches!(o, KeyedOp::PutDevice { len: 512, .. }))
        );
        assert!(matches!(ops[6], KeyedOp::Put { ordered: true, .. }));
        assert_eq!(rig.keyed.in_flight(), 6);
        assert_eq!(rig.engine.in_flight(), 6);
        assert!(rig.engine.has_work(), "puts in flight: poll, never sleep");
        // Nothing waited for them, and nothing was published.
        assert!(rig.keyed.completions().is_empty());
        assert_eq!(rig.calls(), vec![(1, Call::Sync)]);
        // Polling changes nothing until the transport reports progress.
        assert!(!rig.step().did_work());
        // Three complete: published up to the fourth, still in flight.
        rig.keyed.complete_device_puts(3);
        let p = rig.step();
        assert_eq!((p.landed, p.published), (3, 1));
        assert_eq!(rig.calls(), vec![(1, Call::Store(DONE[1], 3))]);
        assert_eq!(rig.engine.published(1), Some(3));
        // A counted put behind the ones in flight: counted when it lands, in
        // order, never before.
        rig.post(
            1,
            &Desc {
                counter: Some(1),
                ..put(64, 0, 0)
            },
        );
        rig.step();
        assert_eq!(rig.calls(), vec![]);
        rig.keyed.complete_device_puts(6);
        let p = rig.step();
        assert_eq!((p.landed, p.published), (3, 1));
        assert_eq!(rig.calls(), vec![(1, Call::Store(DONE[1], 6))]);
        rig.keyed.complete_device_puts(7);
        rig.step();
        assert_eq!(
            rig.calls(),
            vec![(1, Call::Stores(vec![(COUNTERS + 16, 1), (DONE[1], 7)]))]
        );
        assert!(rig.keyed.completions().is_empty(), "never waited");
        assert_eq!(rig.engine.in_flight(), 0);
        assert!(!rig.engine.has_work());
    });
}

/// Where the transport would wait for puts from GPU memory before a
/// running total ordered after them (ucx's `GIN_UCX_GPU_ORDER=wait`), the
/// total is held back instead of blocking the engine, and sent once the
/// puts before it completed, before its put is published; totals to the
/// peer keep their order (a signal without data, or with inline data,
/// behind a held one is held too), and a put with no signal after a held
/// one is published only after it. (The recorder refuses any ordered put
/// that would have to wait: the engine would fail.)
#[test]
fn a_total_behind_puts_in_flight_is_held_until_they_complete_not_waited_for() {
    both_ways(|| {
        let mut rig = rig_over(Keyed::taking_device_memory());
        rig.keyed.hold_device_puts();
        rig.keyed.order_by_waiting();
        rig.post(
            1,
            &Desc {
                signal: Some(signal(48, 1)),
                ..put(512, 0, 0)
            },
        );
        rig.post(
            1,
            &Desc {
                signal: Some(signal(48, 2)),
                ..put(512, 1024, 1024)
            },
        );
        rig.post(
            1,
            &Desc {
                signal: Some(signal(48, 4)),
                ..put(0, 0, 0)
            },
        );
        rig.post(
            1,
            &Desc {
                inline: Some(0xbeef),
                signal: Some(signal(48, 8)),
                ..put(8, 2048, 0)
            },
        );
        let p = rig.step();
        assert_eq!(p.executed, 4, "{:?}", rig.engine.failure());
        assert!(rig.engine.failure().is_none());
        assert_eq!(rig.engine.in_flight(), 4);
        let totals = |rig: &Rig| -> Vec<u64> {
            rig.keyed
                .ops()
                .iter()
                .filter_map(|o| match o {
                    KeyedOp::Put {
                        key: SIG_KEY,
                        bytes,
                        ordered: true,
                        ..
                    } => Some(u64::from_le_bytes(bytes[..].try_into().unwrap())),
                    _ => None,
                })
                .collect()
        };
        // The data moved (two puts from GPU memory, the inline value), no
        // total did.
        assert!(totals(&rig).is_empty());
        assert_eq!(rig.keyed.ops().len(), 3);
        // The first put completes: its total goes, it is published; the rest
        // wait behind the second.
        rig.keyed.complete_device_puts(1);
        let p = rig.step();
        assert_eq!((p.landed, p.published), (1, 1));
        assert_eq!(totals(&rig), [1]);
        assert_eq!(rig.engine.published(1), Some(1));
        rig.keyed.complete_device_puts(2);
        let p = rig.step();
        assert_eq!((p.landed, p.published), (3, 1));
        assert_eq!(totals(&rig), [1, 3, 7, 15]);
        assert_eq!(rig.engine.published(1), Some(4));
        // Nothing queued: a total goes at once, ordered after the puts (none
        // in flight: the transport need not wait).
        rig.post(
            1,
            &Desc {
                signal: Some(signal(48, 16)),
                ..put(0, 0, 0)
            },
        );
        let p = rig.step();
        assert_eq!((p.executed, p.published), (1, 1));
        assert_eq!(totals(&rig), [1, 3, 7, 15, 31]);
        assert!(rig.engine.failure().is_none());
        assert!(rig.keyed.completions().is_empty(), "never waited");
    });
}

/// A failure of the puts from GPU memory in flight that the transport
/// reports when polled without naming the put (its path failed) fails the
/// engine at the oldest descriptor still in flight, naming the peer; what
/// was published before stays so, nothing after it is (here puts 1 and 2
/// completed before the failure was seen, but nothing says the failure
/// was not theirs: they are blamed with the rest). Where the transport
/// names the failed put, that one is blamed: see
/// `the_put_the_transport_names_failed_is_blamed_and_those_before_published`.
#[test]
fn a_put_failing_in_flight_fails_the_engine_at_its_sequence() {
    both_ways(|| {
        let mut rig = rig_over(Keyed::taking_device_memory());
        rig.keyed.hold_device_puts();
        for i in 0..4 {
            rig.post(1, &put(512, i * 640, i * 640));
        }
        rig.step();
        rig.keyed.complete_device_puts(2);
        rig.keyed
            .fail_device_puts("put from GPU memory to rank 2 failed: Connection reset");
        rig.step();
        let e = rig.engine.failure().unwrap();
        assert_eq!((e.peer(), e.seq()), (Some(2), Some(0)));
        let words = e.to_string();
        assert!(
            words.contains("put #0 to rank 2") && words.contains("Connection reset"),
            "{words}"
        );
        assert_eq!(rig.engine.published(1), Some(0));
        // Stepping again does nothing; quiescing completes what is in flight.
        assert!(!rig.step().did_work());
        rig.exec.quiesce().unwrap();
        assert_eq!(rig.keyed.in_flight(), 0);
        assert_eq!(rig.keyed.completions(), vec![(2, 4)]);
    });
}

/// Where the transport names the put from GPU memory that failed, the
/// puts before it are published and the engine fails at its descriptor,
/// not at the oldest one in flight.
#[test]
fn the_put_the_transport_names_failed_is_blamed_and_those_before_published() {
    both_ways(|| {
        let mut rig = rig_over(Keyed::taking_device_memory());
        rig.keyed.hold_device_puts();
        for i in 0..4 {
            rig.post(1, &put(512, i * 640, i * 640));
        }
        rig.step();
        rig.calls();
        rig.keyed.fail_device_put(
            2,
            3,
            "put from GPU memory to rank 2 failed: Connection reset",
        );
        rig.keyed.complete_device_puts(2);
        rig.step();
        let e = rig.engine.failure().unwrap();
        assert_eq!((e.peer(), e.seq()), (Some(2), Some(2)));
        let words = e.to_string();
        assert!(
            words.contains("put #2 to rank 2") && words.contains("Connection reset"),
            "{words}"
        );
        assert_eq!(rig.engine.published(1), Some(2));
        assert_eq!(rig.calls(), vec![(1, Call::Store(DONE[1], 2))]);
    });
}

/// A total held behind puts in flight whose sending fails fails its own
/// descriptor: the put before it completed and is published, not blamed
/// for the total's failure (an entry is released only once its total was
/// sent).
#[test]
fn a_held_total_that_cannot_be_sent_fails_its_own_descriptor() {
    both_ways(|| {
        let mut rig = rig_over(Keyed::taking_device_memory());
        rig.keyed.hold_device_puts();
        rig.keyed.order_by_waiting();
        rig.post(1, &put(512, 0, 0));
        rig.post(
            1,
            &Desc {
                signal: Some(signal(48, 1)),
                ..put(0, 0, 0)
            },
        );
        assert_eq!(rig.step().executed, 2);
        rig.keyed.refuse(SIG_KEY);
        rig.keyed.complete_device_puts(1);
        rig.step();
        let e = rig.engine.failure().unwrap();
        assert_eq!((e.peer(), e.seq()), (Some(2), Some(1)));
        assert!(e.to_string().contains("0x00000088"), "{e}");
        assert_eq!(rig.engine.published(1), Some(1));
    });
}

/// A get from a peer with puts from GPU memory in flight completes them
/// first (they may read what it overwrites), sends the totals held behind
/// them in their order, then reads; the puts land at the engine's next
/// poll. Quiescing completes puts still in flight.
#[test]
fn a_get_behind_puts_in_flight_completes_them_and_their_totals_first() {
    both_ways(|| {
        let mut rig = rig_over(Keyed::taking_device_memory());
        rig.keyed.hold_device_puts();
        rig.keyed.order_by_waiting();
        rig.post(
            1,
            &Desc {
                signal: Some(signal(48, 5)),
                ..put(512, 0, 0)
            },
        );
        rig.post(
            1,
            &Desc {
                op: Op::Get,
                ..put(32, 512, 2048)
            },
        );
        let p = rig.step();
        assert_eq!(
            (p.executed, p.published),
            (2, 1),
            "{:?}",
            rig.engine.failure()
        );
        let ops = rig.keyed.ops();
        assert!(
            matches!(
                ops[..],
                [
                    KeyedOp::PutDevice { .. },
                    KeyedOp::Put { ordered: true, .. },
                    KeyedOp::ReadDevice { .. }
                ]
            ),
            "{ops:?}"
        );
        assert_eq!(rig.keyed.completions(), vec![(2, 1)]);
        assert_eq!(rig.engine.published(1), Some(2));
        // Quiescing with a put still in flight completes it.
        rig.post(1, &put(512, 0, 0));
        rig.step();
        assert_eq!(rig.keyed.in_flight(), 1);
        rig.exec.quiesce().unwrap();
        assert_eq!(rig.keyed.in_flight(), 0);
        assert_eq!(rig.keyed.completions(), vec![(2, 1), (2, 4)]);
    });
}

/// A put the transport refuses fails its descriptor as over tcp: its
/// signal is never sent and its counter never counts; the proxy stops.
#[test]
fn a_refused_gpu_memory_put_fails_its_descriptor_without_its_signal() {
    both_ways(|| {
        let mut rig = rig_over(Keyed::taking_device_memory());
        rig.keyed.refuse(DATA_KEY);
        rig.post(
            1,
            &Desc {
                signal: Some(signal(48, 9)),
                counter: Some(1),
                ..put(64, 0, 0)
            },
        );
        rig.step();
        let e = rig.engine.failure().unwrap();
        assert_eq!(e.seq(), Some(0));
        let e = e.to_string();
        assert!(e.contains("rank 2") && e.contains("0x00000077"), "{e}");
        assert!(rig.keyed.ops().is_empty());
        assert_eq!(rig.calls(), vec![(1, Call::Sync)]);
    });
}

/// Fail-stop: a signal that is not this rank's sub-slot is refused before
/// any of its put is queued; what came before it in the batch is still
/// published, and nothing runs afterwards, on any ring.
#[test]
fn a_refused_put_never_half_happens_and_stops_the_proxy() {
    both_ways(|| {
        let mut rig = rig();
        rig.post(0, &put(8, 0, 0));
        rig.post(
            0,
            &Desc {
                signal: Some(signal(8, 1)),
                ..put(8, 64, 0)
            },
        );
        rig.post(1, &put(8, 0, 0));
        rig.step();
        let e = rig.engine.failure().unwrap();
        assert_eq!(e.seq(), Some(1));
        assert!(e.to_string().contains("not this rank's sub-slot"), "{e}");
        assert_eq!(
            rig.calls(),
            vec![
                (0, Call::Copy(data(1, 0), data(0, 0), 8)),
                (0, Call::Store(DONE[0], 1)),
            ]
        );
        assert_eq!(rig.step(), Progress::default());
        // Waiting for the streams drops nothing that was handed over.
        rig.exec.quiesce().unwrap();
        assert_eq!(rig.calls(), vec![(0, Call::Sync), (1, Call::Sync)]);
    });
}

/// A host window (a CPU rank's, in the same directory) is not a GPU
/// window: refused as unknown, before anything is queued.
#[test]
fn host_windows_are_unknown_to_the_cuda_executor() {
    both_ways(|| {
        let mut rig = rig();
        rig.post(
            0,
            &Desc {
                src_window: HOST,
                ..put(8, 0, 0)
            },
        );
        rig.step();
        let e = rig.engine.failure().unwrap();
        assert!(
            matches!(
                e,
                ProxyError::Descriptor {
                    why: Why::Invalid(Invalid::UnknownWindow { window: HOST }),
                    ..
                }
            ),
            "{e}"
        );
        assert!(rig.calls().is_empty());
    });
}

/// The ring layout: context-major, one ring per served peer, each entry
/// naming its slots and its producer and completion indices at `16 * i`
/// and `16 * i + 8` of the index array, as the device code reads
/// `ProxyRingAbi`.
#[test]
fn the_ring_table_matches_the_abi() {
    let rings: Vec<Slot> = layout(2, &[false, true, true]).collect();
    let at = |ctx, peer| Slot {
        ctx,
        peer,
        index: ctx * 3 + peer,
    };
    assert_eq!(rings, vec![at(0, 1), at(0, 2), at(1, 1), at(1, 2)]);
    let e = ring_abi(0x9000, 5, 0xab_0000, 7);
    assert_eq!(
        e,
        ProxyRingAbi {
            slots: 0xab_0000,
            head: 0x9000 + 80,
            done: 0x9000 + 88,
            log2: 7,
            reserved: 0
        }
    );
    assert!(layout(3, &[false; 4]).next().is_none());
}

/// Watched for stalls, every batch handed to a ring's stream ends with the
/// ring's next mark, in the same driver call as its stores. A stream that
/// never executes it is a stall once the threshold has passed (strictly)
/// since the batch was handed over, not before, naming its ring and
/// CUDA_DEVICE_MAX_CONNECTIONS; a stream that completes late, but before
/// the threshold, is none. Time is the test's: the batch was handed over
/// between `before` and `after`.
#[test]
fn a_ring_stream_that_never_completes_is_a_stall_naming_the_ring() {
    both_ways(|| {
        let mut rig = rig();
        let thr = Duration::from_secs(2);
        let w = Arc::new(StallWatch::new(
            0,
            "CUDA proxy",
            vec![ring_name(0, 0, 1), ring_name(1, 0, 2)],
            rig.gpu.marks(2),
            thr,
            WorkQueues::default(),
        ));
        rig.exec.watch_stalls(w.clone());
        rig.post(
            0,
            &Desc {
                counter: Some(2),
                ..put(256, 64, 128)
            },
        );
        let before = Instant::now();
        rig.step();
        let after = Instant::now();
        assert_eq!(
            rig.calls(),
            vec![
                (0, Call::Copy(data(1, 64), data(0, 128), 256)),
                (
                    0,
                    Call::Stores(vec![(COUNTERS + 32, 1), (DONE[0], 1), (MARKS_AT, 1)])
                ),
            ]
        );
        assert_eq!(w.check(before + thr), None, "not before the threshold");
        let s = w.check(after + thr + Duration::from_millis(1)).unwrap();
        let m = s.to_string();
        for want in [
            "rank 0",
            "ring 0 (context 0, peer 1)",
            "CUDA_DEVICE_MAX_CONNECTIONS unset",
            "set CUDA_DEVICE_MAX_CONNECTIONS to at least",
        ] {
            assert!(m.contains(want), "{want:?} missing from {m}");
        }
        assert_eq!((s.first, s.others, s.engine_streams), (true, 0, 2));
        // The stream completes at last: no stall any more.
        rig.gpu.complete(0);
        assert_eq!(w.check(after + thr * 10), None);

        // Late, but before the threshold: never a stall. Ring 1's stream
        // (a keyed peer: the counter and completion on the stream) too.
        rig.post(0, &put(8, 0, 0));
        rig.post(
            1,
            &Desc {
                inline: Some(7),
                counter: Some(0),
                ..put(8, 16, 0)
            },
        );
        let before = Instant::now();
        rig.step();
        let after = Instant::now();
        assert_eq!(
            rig.calls(),
            vec![
                (0, Call::Copy(data(1, 0), data(0, 0), 8)),
                (0, Call::Stores(vec![(DONE[0], 2), (MARKS_AT, 2)])),
                (
                    1,
                    Call::Stores(vec![(COUNTERS, 1), (DONE[1], 1), (MARKS_AT + 8, 1)])
                ),
            ]
        );
        assert_eq!(w.check(before + thr / 2), None);
        rig.gpu.complete(0);
        // Ring 0's stream completed; ring 1's never does.
        let s = w.check(after + thr * 10).unwrap();
        assert_eq!(s.stream, "ring 1 (context 0, peer 2)");
        assert_eq!(s.others, 0);
        rig.gpu.complete(1);
        assert_eq!(w.check(after + thr * 20), None);
    });
}

/// Watched for stalls, work handed to a stream before it is drained (a
/// transport taking GPU memory reads what the stream wrote) carries the
/// ring's mark too, so that work the stream never completes there (the
/// drain would never return) is diagnosed; a drain of an empty batch
/// queues none. (The recording streams execute nothing, syncs included.)
#[test]
fn work_drained_for_a_transport_carries_its_mark() {
    both_ways(|| {
        let mut rig = rig_over(Keyed::taking_device_memory());
        let w = Arc::new(StallWatch::new(
            0,
            "CUDA proxy",
            vec![ring_name(0, 0, 1), ring_name(1, 0, 2)],
            rig.gpu.marks(2),
            Duration::from_secs(2),
            WorkQueues::default(),
        ));
        rig.exec.watch_stalls(w.clone());
        rig.post(
            1,
            &Desc {
                counter: Some(1),
                ..put(64, 0, 0)
            },
        );
        rig.post(
            1,
            &Desc {
                op: Op::Get,
                ..put(32, 512, 2048)
            },
        );
        let t = Instant::now();
        rig.step();
        assert_eq!(
            rig.calls(),
            vec![
                (1, Call::Sync),
                (
                    1,
                    Call::Stores(vec![(COUNTERS + 16, 1), (DONE[1], 2), (MARKS_AT + 8, 1)])
                ),
            ]
        );
        let s = w.check(t + Duration::from_secs(3)).unwrap();
        assert_eq!(s.stream, "ring 1 (context 0, peer 2)");
    });
}

/// A counted put to peer 1 on ring 0.
fn counted(slot: u32, bytes: u64) -> Desc {
    Desc {
        counter: Some(slot),
        ..put(bytes, 64, 128)
    }
}

/// One counter slot shared by the rings to two peers (as an all-to-all
/// counting its puts' local completions does), each ring with its own
/// stream: a total that goes to another stream than the slot's previous
/// one is queued behind a wait for an event recorded after that one, so
/// that the earlier total (behind a long copy, say) never lands after the
/// later one and takes the counter back. The other stream's pending copy
/// is handed over before the wait (it need not wait); a total on the same
/// stream as the previous one needs nothing; each stream has one event,
/// made once and recorded again at each hand-over.
#[test]
fn a_counter_shared_by_two_rings_stores_its_totals_in_order() {
    both_ways(|| {
        let mut rig = rig_mapped();
        let at = COUNTERS + 3 * 16;
        let (copy0, copy1) = (
            Call::Copy(data(1, 64), data(0, 128), 8),
            Call::Copy(DATA_AT_2 as u64 + 64, data(0, 128), 8),
        );
        rig.post(0, &counted(3, 4096 - 128));
        rig.post(1, &counted(3, 8));
        rig.step();
        assert_eq!(
            rig.calls(),
            vec![
                (0, Call::Copy(data(1, 64), data(0, 128), 4096 - 128)),
                (0, Call::Stores(vec![(at, 1), (DONE[0], 1)])),
                // Ring 1: its copy handed over first, free to run beside ring
                // 0's; then its total waits for ring 0's.
                (1, copy1.clone()),
                (0, Call::Record(0)),
                (1, Call::Wait(0)),
                (1, Call::Stores(vec![(at, 2), (DONE[1], 1)])),
            ]
        );
        // Ring 0 again: its first total behind ring 1's, with ring 1's own
        // event; the next two on ring 0 need nothing more.
        for _ in 0..3 {
            rig.post(0, &counted(3, 8));
        }
        rig.step();
        assert_eq!(
            rig.calls(),
            vec![
                (0, copy0.clone()),
                (1, Call::Record(1)),
                (0, Call::Wait(1)),
                (0, Call::Store(at, 3)),
                (0, copy0.clone()),
                (0, Call::Store(at, 4)),
                (0, copy0.clone()),
                (0, Call::Stores(vec![(at, 5), (DONE[0], 4)])),
            ]
        );
        // Back to ring 1: ring 0's event is recorded again, none is made.
        rig.post(1, &counted(3, 8));
        rig.step();
        assert_eq!(
            rig.calls(),
            vec![
                (1, copy1),
                (0, Call::Record(0)),
                (1, Call::Wait(0)),
                (1, Call::Stores(vec![(at, 6), (DONE[1], 2)])),
            ]
        );
        assert_eq!(rig.gpu.events(), 2);
    });
}

/// Totals of different counter slots never wait for one another, whatever
/// rings store them: each slot keeps its own order.
#[test]
fn totals_of_different_counters_do_not_wait_for_each_other() {
    both_ways(|| {
        let mut rig = rig_mapped();
        rig.post(0, &counted(0, 8));
        rig.post(1, &counted(1, 8));
        rig.post(0, &counted(0, 8));
        rig.post(1, &counted(1, 8));
        rig.step();
        rig.post(0, &counted(0, 8));
        rig.post(1, &counted(1, 8));
        rig.step();
        let calls = rig.calls();
        assert!(
            !calls
                .iter()
                .any(|c| matches!(c.1, Call::Record(_) | Call::Wait(_))),
            "{calls:?}"
        );
        assert_eq!(rig.gpu.events(), 0);
        let stores: Vec<_> = calls
            .iter()
            .flat_map(|(q, c)| match c {
                Call::Store(a, v) => vec![(*q, *a, *v)],
                Call::Stores(w) => w.iter().map(|&(a, v)| (*q, a, v)).collect(),
                _ => vec![],
            })
            .filter(|&(_, a, _)| a < COUNTERS + 4 * 16)
            .collect();
        assert_eq!(
            stores,
            vec![
                (0, COUNTERS, 1),
                (0, COUNTERS, 2),
                (1, COUNTERS + 16, 1),
                (1, COUNTERS + 16, 2),
                (0, COUNTERS, 3),
                (1, COUNTERS + 16, 3),
            ]
        );
    });
}

/// The rig over a transport taking GPU memory, its puts held in flight,
/// with puts from GPU memory merged as the proxy runs.
fn rig_merging() -> Rig {
    let mut rig = rig_over(Keyed::taking_device_memory());
    rig.keyed.hold_device_puts();
    rig.exec.merge_puts(MERGE_MAX);
    rig
}

/// The puts from GPU memory the transport was handed: (offset, src, len).
fn device_puts(rig: &Rig) -> Vec<(u64, u64, u64)> {
    rig.keyed
        .ops()
        .into_iter()
        .filter_map(|o| match o {
            KeyedOp::PutDevice {
                offset, src, len, ..
            } => Some((offset, src, len)),
            _ => None,
        })
        .collect()
}

/// Slices of one message in one pass, in any order, reach the transport
/// as one put; every original stays in flight until it completed, then
/// each lands and counts (the counter's total is the number of
/// originals), and the completion index covers them all.
#[test]
fn adjacent_puts_in_a_pass_go_as_one_transport_put_and_each_counts() {
    let mut rig = rig_merging();
    for i in [2u64, 0, 3, 1] {
        rig.post(
            1,
            &Desc {
                counter: Some(1),
                ..put(512, i * 512, i * 512)
            },
        );
    }
    let p = rig.step();
    assert_eq!((p.executed, p.published), (4, 0));
    assert_eq!(device_puts(&rig), [(0, data(0, 0), 2048)]);
    assert_eq!(rig.engine.in_flight(), 4);
    assert_eq!(rig.calls(), vec![(1, Call::Sync)]);
    assert!(!rig.step().did_work());
    rig.keyed.complete_device_puts(1);
    let p = rig.step();
    assert_eq!((p.landed, p.published), (4, 1));
    let c = COUNTERS + 16;
    assert_eq!(
        rig.calls(),
        vec![(
            1,
            Call::Stores(vec![(c, 1), (c, 2), (c, 3), (c, 4), (DONE[1], 4)])
        )]
    );
}

/// Not merged: puts with a gap between, puts to another window (another
/// key at the peer), and puts on either side of a get (which completes
/// the puts before it first); a put that overlaps a waiting one starts
/// after it, not with it.
#[test]
fn puts_that_do_not_continue_or_have_a_get_between_are_not_merged() {
    let mut rig = rig_merging();
    rig.post(1, &put(512, 0, 0));
    rig.post(1, &put(512, 1024, 1024));
    rig.post(
        1,
        &Desc {
            dst_window: SIGNALS,
            ..put(8, 0, 1536)
        },
    );
    rig.step();
    assert_eq!(
        device_puts(&rig),
        [
            (0, data(0, 0), 512),
            (1024, data(0, 1024), 512),
            (0, data(0, 1536), 8)
        ]
    );
    let mut rig = rig_merging();
    rig.post(1, &put(512, 0, 0));
    rig.post(
        1,
        &Desc {
            op: Op::Get,
            ..put(32, 3072, 3072)
        },
    );
    rig.post(1, &put(512, 512, 512));
    rig.post(1, &put(512, 768, 768));
    let p = rig.step();
    assert_eq!(p.executed, 4, "{:?}", rig.engine.failure());
    assert!(matches!(
        &rig.keyed.ops()[..],
        [
            KeyedOp::PutDevice { len: 512, .. },
            KeyedOp::ReadDevice { .. },
            KeyedOp::PutDevice {
                offset: 512,
                len: 512,
                ..
            },
            KeyedOp::PutDevice {
                offset: 768,
                len: 512,
                ..
            },
        ]
    ));
    assert_eq!(rig.keyed.completions(), vec![(2, 1)]);
    // Overlap: P1 writes what P2 overwrites, and P2 continues P0. P2
    // starts the waiting P0 and P1 first (apart: they do not continue one
    // another), then goes alone: merged with P0 it would start before P1
    // and land under it.
    let mut rig = rig_merging();
    rig.post(1, &put(64, 64, 64));
    rig.post(1, &put(64, 0, 2048));
    rig.post(1, &put(64, 0, 0));
    assert_eq!(rig.step().executed, 3, "{:?}", rig.engine.failure());
    assert_eq!(
        device_puts(&rig),
        [
            (64, data(0, 64), 64),
            (0, data(0, 2048), 64),
            (0, data(0, 0), 64)
        ]
    );
}

/// Where the transport would wait before a running total (ucx's
/// default), every slice carrying a signal: the slices go as one put, and
/// no total leaves before it completed; then every total goes, in order,
/// and every put is published.
#[test]
fn signals_of_a_merged_put_go_only_once_it_completed() {
    let mut rig = rig_merging();
    rig.keyed.order_by_waiting();
    for i in 0..3u64 {
        rig.post(
            1,
            &Desc {
                signal: Some(signal(48, 1 << i)),
                ..put(1024, i * 1024, i * 1024)
            },
        );
    }
    let p = rig.step();
    assert_eq!(p.executed, 3, "{:?}", rig.engine.failure());
    assert_eq!(device_puts(&rig), [(0, data(0, 0), 3072)]);
    assert_eq!(rig.keyed.ops().len(), 1, "no total before the data");
    rig.keyed.complete_device_puts(1);
    let p = rig.step();
    assert_eq!((p.landed, p.published), (3, 1));
    let totals: Vec<u64> = rig
        .keyed
        .ops()
        .iter()
        .filter_map(|o| match o {
            KeyedOp::Put { bytes, .. } => Some(u64::from_le_bytes(bytes[..].try_into().unwrap())),
            _ => None,
        })
        .collect();
    assert_eq!(totals, [1, 3, 7]);
    assert_eq!(rig.engine.published(1), Some(3));
}

/// A merged put that fails fails the engine at its first original,
/// naming that original's bytes and offset and the merged put; every
/// other original it carried fails too, each named.
#[test]
fn a_failed_merged_put_fails_each_original_naming_it() {
    let mut rig = rig_merging();
    for i in 0..3u64 {
        rig.post(1, &put(512, i * 512, i * 512));
    }
    rig.step();
    rig.keyed.fail_device_put(
        2,
        1,
        "put from GPU memory to rank 2 failed: Connection reset",
    );
    rig.step();
    let e = rig.engine.failure().unwrap();
    assert_eq!((e.peer(), e.seq()), (Some(2), Some(0)));
    let words = e.to_string();
    assert!(
        words.contains("Connection reset")
            && words.contains("this put's 512 bytes at offset 0 of key 0x00000077")
            && words.contains("put #1, 1536 bytes at offset 0 merged from 3 puts"),
        "{words}"
    );
    let site = crate::executor::Site {
        ring: 1,
        ctx: 0,
        peer: 2,
    };
    for n in 1..3u64 {
        let mut t = gin_cuda::puts::Ticket { peer: 2, n };
        let why = rig.exec.landed(site, &mut t).unwrap_err().to_string();
        let own = format!("this put's 512 bytes at offset {}", n * 512);
        assert!(
            why.contains(&own) && why.contains("Connection reset"),
            "{why}"
        );
    }
    assert_eq!(rig.engine.published(1), Some(0));
}

/// The totals sent ordered (`Put { ordered: true }`) to the signals' key.
fn totals(rig: &Rig) -> Vec<u64> {
    rig.keyed
        .ops()
        .iter()
        .filter_map(|o| match o {
            KeyedOp::Put {
                key: SIG_KEY,
                bytes,
                ordered: true,
                ..
            } => Some(u64::from_le_bytes(bytes[..].try_into().unwrap())),
            _ => None,
        })
        .collect()
}

/// Where the transport orders a total after the puts without waiting
/// (`GIN_UCX_GPU_ORDER=fence`), a signal ends the run of puts that merge:
/// those before it start as one, then its total, then the put after it
/// alone; all are published once both puts completed.
#[test]
fn a_fenced_signal_ends_a_merged_run_and_follows_it() {
    let mut rig = rig_merging();
    rig.post(1, &put(512, 0, 0));
    rig.post(
        1,
        &Desc {
            signal: Some(signal(48, 1)),
            ..put(512, 512, 512)
        },
    );
    rig.post(1, &put(512, 1024, 1024));
    assert_eq!(rig.step().executed, 3, "{:?}", rig.engine.failure());
    let ops = rig.keyed.ops();
    assert!(
        matches!(
            ops[..],
            [
                KeyedOp::PutDevice {
                    offset: 0,
                    len: 1024,
                    ..
                },
                KeyedOp::Put { ordered: true, .. },
                KeyedOp::PutDevice {
                    offset: 1024,
                    len: 512,
                    ..
                },
            ]
        ),
        "{ops:?}"
    );
    assert_eq!(totals(&rig), [1]);
    rig.keyed.complete_device_puts(1);
    let p = rig.step();
    assert_eq!((p.landed, p.published), (2, 1));
    assert_eq!(rig.engine.published(1), Some(2));
    rig.keyed.complete_device_puts(2);
    rig.step();
    assert_eq!(rig.engine.published(1), Some(3));
}

/// A get behind merged puts whose totals are held (ucx's default): the
/// puts start as one, are completed before the read, and their totals
/// go in order, before the read; every descriptor is published.
#[test]
fn a_get_behind_merged_puts_sends_their_held_totals_first() {
    let mut rig = rig_merging();
    rig.keyed.order_by_waiting();
    for i in 0..2u64 {
        rig.post(
            1,
            &Desc {
                signal: Some(signal(48, 1 << i)),
                ..put(512, i * 512, i * 512)
            },
        );
    }
    rig.post(
        1,
        &Desc {
            op: Op::Get,
            ..put(32, 3072, 2048)
        },
    );
    let p = rig.step();
    assert_eq!(
        (p.executed, p.published),
        (3, 1),
        "{:?}",
        rig.engine.failure()
    );
    let ops = rig.keyed.ops();
    assert!(
        matches!(
            ops[..],
            [
                KeyedOp::PutDevice {
                    offset: 0,
                    len: 1024,
                    ..
                },
                KeyedOp::Put { ordered: true, .. },
                KeyedOp::Put { ordered: true, .. },
                KeyedOp::ReadDevice { .. }
            ]
        ),
        "{ops:?}"
    );
    assert_eq!(totals(&rig), [1, 3]);
    assert_eq!(rig.keyed.completions(), vec![(2, 1)]);
    assert_eq!(rig.engine.published(1), Some(3));
}

/// A total held behind a merged put that completed, which cannot be sent,
/// fails its own descriptor, noted that its put is not what failed; the
/// other original of the merged put is published.
#[test]
fn a_held_total_behind_a_merged_put_that_cannot_be_sent_fails_its_own_descriptor() {
    let mut rig = rig_merging();
    rig.keyed.order_by_waiting();
    rig.post(1, &put(512, 0, 0));
    rig.post(
        1,
        &Desc {
            signal: Some(signal(48, 1)),
            ..put(512, 512, 512)
        },
    );
    assert_eq!(rig.step().executed, 2);
    assert_eq!(device_puts(&rig), [(0, data(0, 0), 1024)]);
    rig.keyed.refuse(SIG_KEY);
    rig.keyed.complete_device_puts(1);
    rig.step();
    let e = rig.engine.failure().unwrap();
    assert_eq!((e.peer(), e.seq()), (Some(2), Some(1)));
    let words = e.to_string();
    assert!(
        words.contains("0x00000088")
            && words.contains(
                "put #1, 1024 bytes at offset 0 merged from 2 puts, which is not what failed"
            ),
        "{words}"
    );
    assert_eq!(rig.engine.published(1), Some(1));
}

/// Merged puts of two passes, the transport naming the second failed: the
/// first's originals are published, the engine fails at the second's
/// first original, named as its own put, and the second's other original
/// fails too.
#[test]
fn the_merged_put_the_transport_names_failed_is_blamed_across_passes() {
    let mut rig = rig_merging();
    for pass in 0..2u64 {
        rig.post(1, &put(512, pass * 2048, 0));
        rig.post(1, &put(512, pass * 2048 + 512, 512));
        rig.step();
    }
    assert_eq!(
        device_puts(&rig),
        [(0, data(0, 0), 1024), (2048, data(0, 0), 1024)]
    );
    rig.keyed.fail_device_put(
        2,
        2,
        "put from GPU memory to rank 2 failed: Connection reset",
    );
    rig.keyed.complete_device_puts(1);
    rig.step();
    let e = rig.engine.failure().unwrap();
    assert_eq!((e.peer(), e.seq()), (Some(2), Some(2)));
    let words = e.to_string();
    assert!(
        words.contains("Connection reset")
            && words.contains("this put's 512 bytes at offset 2048 of key 0x00000077")
            && words.contains("put #2, 1024 bytes at offset 2048 merged from 2 puts")
            && !words.contains("not what failed"),
        "{words}"
    );
    assert_eq!(rig.engine.published(1), Some(2));
    let site = crate::executor::Site {
        ring: 1,
        ctx: 0,
        peer: 2,
    };
    let mut t = gin_cuda::puts::Ticket { peer: 2, n: 3 };
    let why = rig.exec.landed(site, &mut t).unwrap_err().to_string();
    assert!(
        why.contains("this put's 512 bytes at offset 2560") && why.contains("put #2"),
        "{why}"
    );
}

/// A put refused at start while the put before it is in flight: the put
/// of the next pass (to a region the peer still serves) is never handed
/// to the transport, as with merging off (where the refusal stops the
/// proxy at once); the engine fails at the refused descriptor once the
/// put before it landed.
#[test]
fn a_put_refused_at_start_stops_the_next_pass_while_one_flies() {
    let mut rig = rig_merging();
    rig.post(1, &put(512, 0, 0));
    rig.step();
    rig.keyed.refuse(DATA_KEY);
    rig.post(1, &put(512, 1024, 1024));
    rig.step();
    rig.post(
        1,
        &Desc {
            dst_window: SIGNALS,
            ..put(8, 0, 1536)
        },
    );
    rig.step();
    assert_eq!(device_puts(&rig), [(0, data(0, 0), 512)]);
    rig.keyed.complete_device_puts(1);
    rig.step();
    let e = rig.engine.failure().unwrap();
    assert_eq!((e.peer(), e.seq()), (Some(2), Some(1)));
    assert!(e.to_string().contains("0x00000077"), "{e}");
    assert_eq!(rig.engine.published(1), Some(1));
    assert_eq!(device_puts(&rig).len(), 1);
}
