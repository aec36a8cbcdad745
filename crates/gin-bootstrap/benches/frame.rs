//! Bootstrap frame encode and decode, beside copying the same bytes.
//!
//! `cargo bench -p gin-bootstrap --bench frame`

#![allow(clippy::unwrap_used)]

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use gin_bootstrap::frame::{DEFAULT_MAX_PAYLOAD, Frame, decode, encode};

fn frames(c: &mut Criterion) {
    let mut g = c.benchmark_group("frame_codec");
    for size in [8usize, 1024, 64 * 1024] {
        let f = Frame::Data {
            tag: 7,
            payload: vec![0xab; size],
        };
        let bytes = encode(&f).unwrap();
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_with_input(BenchmarkId::new("encode_decode", size), &f, |b, f| {
            b.iter(|| {
                let e = encode(black_box(f)).unwrap();
                black_box(decode(&e, DEFAULT_MAX_PAYLOAD).unwrap())
            });
        });
        g.bench_with_input(
            BenchmarkId::new("baseline_copy_twice", size),
            &bytes,
            |b, bytes| {
                b.iter(|| {
                    let a = black_box(bytes).clone();
                    black_box(a.clone())
                });
            },
        );
    }
    g.finish();
}

criterion_group!(benches, frames);
criterion_main!(benches);
