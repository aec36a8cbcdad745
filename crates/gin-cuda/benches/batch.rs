//! One pass of the CUDA proxy's stream batching (gin-cuda's `batch.rs`): 256
//! slices of one message, posted out of order as blocks win their ring
//! reservations, checked for overlap, merged and flushed to a stream that
//! drops them. The baseline is the pairwise overlap scan the batch did
//! before it kept its pending bytes as sorted spans, on the same slices.
//!
//! `cargo bench -p gin-cuda --bench batch`

#![allow(clippy::unwrap_used)]

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gin_cuda::batch::bench_pass;

/// 256 slices of 32 KiB, in a scrambled order (97 is coprime with 256).
fn slices() -> Vec<(u64, u64, usize)> {
    (0..256u64)
        .map(|i| {
            let j = (i * 97) % 256;
            ((1 << 40) + j * 32768, (1 << 30) + j * 32768, 32768)
        })
        .collect()
}

/// Each slice checked against every one before it (dst against their dst
/// and src, src against their dst): what a pass cost before.
fn pairwise(c: &[(u64, u64, usize)]) -> bool {
    let hit = |a: u64, m: usize, b: u64, n: usize| a < b + n as u64 && b < a + m as u64;
    (0..c.len()).any(|i| {
        let (d, s, n) = c[i];
        c[..i]
            .iter()
            .any(|&(pd, ps, pl)| hit(d, n, pd, pl) || hit(d, n, ps, pl) || hit(s, n, pd, pl))
    })
}

fn batch(c: &mut Criterion) {
    let s = slices();
    assert_eq!(bench_pass(&s), 1, "the 256 slices merge into one copy");
    assert!(!pairwise(&s));
    let mut g = c.benchmark_group("stream_batch");
    g.throughput(Throughput::Elements(s.len() as u64));
    g.bench_function("pass_256_slices", |b| b.iter(|| bench_pass(black_box(&s))));
    g.bench_function("baseline_pairwise_scan_256", |b| {
        b.iter(|| pairwise(black_box(&s)));
    });
    g.finish();
}

criterion_group!(benches, batch);
criterion_main!(benches);
