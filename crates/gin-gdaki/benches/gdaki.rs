//! WQE build rate and the soft NIC's execution rate, each beside a baseline
//! measured in the same group (a 64-byte copy; an 8-byte store loop), so the
//! results read as ratios.
//!
//! `cargo bench -p gin-gdaki`

#![allow(clippy::unwrap_used)] // a benchmark's set-up either works or aborts

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gin_device::{Backend, Counters, PutOp, Source};

use gin_gdaki::completion::Cqe;
use gin_gdaki::loopback::Loopback;
use gin_gdaki::nic::{
    CqMode, CqView, DriverConfig, Engine, EngineConfig, FabricExecutor, Idle, QueueSpec, Sink,
    SoftNic, SqView,
};
use gin_gdaki::qp::{Cq, Qp};
use gin_gdaki::queue::Sharing;
use gin_gdaki::wqe::{CQ_UPDATE, MemRef, Op, encode};
use gin_gdaki::{Gdaki, GdakiConfig};

fn wqe_build(c: &mut Criterion) {
    let mut g = c.benchmark_group("wqe_build");
    g.throughput(Throughput::Elements(1));
    let op = Op::Write {
        remote: MemRef {
            addr: 0x7f00_0000_1000,
            key: 0x1234,
        },
        local: MemRef {
            addr: 0x7f00_0000_2000,
            key: 0x5678,
        },
        len: 8,
    };
    let mut idx = 0u16;
    g.bench_function("rdma_write", |b| {
        b.iter(|| {
            idx = idx.wrapping_add(1);
            black_box(encode(black_box(&op), idx, 0x100, CQ_UPDATE).unwrap())
        });
    });
    let block = [0x5au8; 64];
    g.bench_function("baseline_copy_64_bytes", |b| {
        b.iter(|| black_box(*black_box(&block)));
    });
    g.finish();
}

/// One rank, one window, a GDAKI backend and its soft NIC (dropped first).
fn rig() -> (Gdaki, Loopback) {
    let lb = Loopback::new(1 << 16, Duration::from_secs(30));
    let config = GdakiConfig {
        sq_log2: 10,
        ..GdakiConfig::default()
    };
    let g = Gdaki::start(lb.fabric.clone(), Arc::new(Counters::new(4)), 1, config).unwrap();
    (g, lb)
}

fn nic_execution(c: &mut Criterion) {
    let (g, lb) = rig();
    let win = lb.window.clone();
    let burst = 256u64;
    let mut grp = c.benchmark_group("softnic_8_byte_writes");
    grp.throughput(Throughput::Elements(burst));
    grp.bench_function("issue_and_complete", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                for i in 0..burst {
                    g.put(&PutOp {
                        ctx: 0,
                        peer: 0,
                        dst: &win,
                        dst_off: 4096 + 8 * (i % 256),
                        src: Source::Window {
                            window: &win,
                            offset: 0,
                        },
                        bytes: 8,
                        signal: None,
                        counter: None,
                    })
                    .unwrap();
                }
                let t = g.ticket(0, None).unwrap();
                while !g.done(&t).unwrap() {
                    std::hint::spin_loop();
                }
            }
            start.elapsed()
        });
    });
    let mut mem = vec![0u64; 512];
    grp.bench_function("baseline_8_byte_stores", |b| {
        b.iter(|| {
            for (i, m) in mem.iter_mut().take(burst as usize).enumerate() {
                *m = black_box(i as u64);
            }
            black_box(&mem);
        });
    });
    grp.finish();
    eprintln!("soft NIC executed {} WQEs in this run", g.executed());
}

/// The NIC alone: a queue pre-filled with 8-byte RDMA writes (not timed),
/// one doorbell, then the time until the last CQE is polled.
fn nic_alone(c: &mut Criterion) {
    let lb = Loopback::new(1 << 16, Duration::from_secs(30));
    let (key, base) = (lb.nic_key, lb.addr(0));
    let log2 = 12;
    let qp = Arc::new(Qp::new(0x100, 0x100, 0, log2));
    let exec = FabricExecutor::new(
        lb.fabric.clone(),
        Arc::new(Counters::new(4)),
        Arc::new(Sink::default()),
        Duration::from_secs(30),
    );
    let (counters, sink) = exec.local_parts();
    let spec = QueueSpec {
        qpn: qp.qpn,
        cqn: qp.cq.cqn,
        peer: 0,
        channel: 0,
        cq_mode: CqMode::Ring { log2 },
        sq: SqView::host(&qp),
        cq: CqView::host(&qp),
    };
    let cfg = EngineConfig {
        rank: 0,
        nranks: 1,
        counters,
        sink,
        batch: 64,
    };
    let driver = DriverConfig {
        name: "bench-softnic".into(),
        idle: Idle::cpu(Duration::from_millis(1)),
        drain_on_stop: false,
        join_within: Duration::from_secs(30),
    };
    let nic = SoftNic::start(Engine::new(cfg, vec![spec]).unwrap(), exec, driver).unwrap();
    let waker = nic.waker();
    let burst = 1u64 << (log2 - 1);
    let mut grp = c.benchmark_group("softnic_alone_8_byte_writes");
    grp.throughput(Throughput::Elements(burst));
    grp.bench_function("execute", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let start_idx = qp.idx.reserve(burst);
                let before = qp.cq.polled();
                for i in 0..burst {
                    let op = Op::Write {
                        remote: MemRef {
                            addr: base + 4096 + 8 * (i % 256),
                            key,
                        },
                        local: MemRef { addr: base, key },
                        len: 8,
                    };
                    let idx = start_idx + i;
                    qp.write_wqe(idx, &encode(&op, idx as u16, qp.qpn, CQ_UPDATE).unwrap());
                }
                let t = Instant::now();
                assert!(qp.try_post(start_idx, start_idx + burst, Sharing::Gpu, |_| false));
                waker.wake();
                let mut seen = 0;
                while seen < burst {
                    qp.reap(|c| panic!("error CQE {c:?}"));
                    seen = qp.cq.polled() - before;
                    std::hint::spin_loop();
                }
                total += t.elapsed();
            }
            total
        });
    });
    grp.finish();
    drop(nic);
    drop(lb);
}

/// Polling CQEs (owner-bit check, decode, consumer index), beside reading
/// the same number of 64-byte entries.
fn cq_poll(c: &mut Criterion) {
    let cq = Cq::new(1, 10);
    let n = 512u64;
    let cqe = Cqe {
        opcode: 0,
        wqe_counter: 0,
        qpn: 0x100,
        send_opcode: 8,
        byte_cnt: 8,
        syndrome: 0,
        vendor_syndrome: 0,
    };
    let mut written = 0u64;
    let mut g = c.benchmark_group("cq_poll");
    g.throughput(Throughput::Elements(n));
    g.bench_function("push_then_poll", |b| {
        b.iter(|| {
            for _ in 0..n {
                cq.write(written, &cqe);
                written += 1;
            }
            let mut got = 0u64;
            cq.poll(|c| got += u64::from(c.byte_cnt));
            black_box(got)
        });
    });
    let entries = vec![[0u8; 64]; n as usize];
    g.bench_function("baseline_read_64_byte_entries", |b| {
        b.iter(|| {
            let mut x = 0u64;
            for e in black_box(&entries) {
                x += u64::from(e[63]) + u64::from(e[47]);
            }
            black_box(x)
        });
    });
    g.finish();
}

criterion_group!(benches, wqe_build, cq_poll, nic_alone, nic_execution);
criterion_main!(benches);
