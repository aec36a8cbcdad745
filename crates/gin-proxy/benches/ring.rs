//! Descriptor enqueue and dequeue, beside a plain 64-byte copy into and out
//! of a ring of the same size (the floor of moving a descriptor).
//!
//! `cargo bench -p gin-proxy --bench ring`

#![allow(clippy::unwrap_used, clippy::many_single_char_names)] // bench set-up

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gin_proxy::descriptor::{Desc, Op, Sig, Slot};
use gin_proxy::ring::Ring;

fn desc(i: u64) -> Desc {
    Desc {
        op: Op::Put,
        bytes: 4096,
        dst_window: 3,
        dst_offset: i * 64,
        src_window: 2,
        src_offset: i * 64,
        inline: None,
        signal: Some(Sig {
            window: 1,
            offset: 8,
            add: 1,
            strong: true,
        }),
        counter: Some(4),
    }
}

fn ring(c: &mut Criterion) {
    let mut g = c.benchmark_group("descriptor_ring");
    g.throughput(Throughput::Elements(1));
    let r = Ring::new(8);
    let mut seq = 0u64;
    g.bench_function("enqueue_then_dequeue", |b| {
        b.iter(|| {
            let s = r.reserve();
            r.write(s, &desc(s));
            let Ok(Slot::Ready(d)) = r.peek(seq) else {
                panic!("not published")
            };
            seq += 1;
            r.advance(seq);
            black_box(d)
        });
    });
    let mut lines = vec![[0u64; 8]; 256];
    let mut i = 0usize;
    g.bench_function("baseline_copy_64_bytes_in_and_out", |b| {
        b.iter(|| {
            let q = desc(i as u64).encode(i as u64, 8);
            lines[i & 255] = q;
            let back = black_box(lines[i & 255]);
            i += 1;
            black_box(back)
        });
    });
    g.finish();
}

criterion_group!(benches, ring);
criterion_main!(benches);
