//! Id-space allocation and release, beside a bare BTreeMap insert and remove
//! (the data structure it keeps its free ranges in).
//!
//! `cargo bench -p gin-core --bench space`

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gin_core::space::IdSpace;

fn space(c: &mut Criterion) {
    let mut g = c.benchmark_group("id_space");
    g.throughput(Throughput::Elements(1));
    // A fragmented space: 64 live ranges with holes between them.
    let mut s = IdSpace::new(1 << 16);
    let live: Vec<u64> = (0..128).map(|_| s.alloc(16, "bench").unwrap()).collect();
    for (i, &start) in live.iter().enumerate() {
        if i % 2 == 0 {
            s.free(start, 16).unwrap();
        }
    }
    g.bench_function("alloc_free_fragmented", |b| {
        b.iter(|| {
            let a = s.alloc(black_box(24), "bench").unwrap();
            s.free(a, 24).unwrap();
        });
    });
    let mut m: BTreeMap<u64, u64> = (0..64u64).map(|i| (i * 32, 16)).collect();
    g.bench_function("baseline_btreemap_insert_remove", |b| {
        b.iter(|| {
            m.insert(black_box(5000), 24);
            black_box(m.remove(&5000));
        });
    });
    g.finish();
}

criterion_group!(benches, space);
criterion_main!(benches);
