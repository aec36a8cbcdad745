//! The dispatch kernel's check of device-resident inputs (`kernels/ll.cu`'s
//! `ep::input`, compiled as host C++) finds the same first error as the
//! host path's checks (`gin_ep::cuda::check_entries`: the weights of live
//! slots first, then every top-k entry in order), and the error words it
//! records decode (`gin_ep::cuda::decode_error`) to the same error: on
//! valid routing tables, and on tables with experts out of range, below -1,
//! named twice, and weights that are NaN or infinite, alone and together.
//!
//! Needs a C++ compiler (`CXX`, else `c++`): skipped with a printed reason
//! where there is none, except in CI (`CI` set), where that is a failure.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::process::Command;

mod common;

use gin_ep::Config;
use gin_ep::cuda::{check_entries, decode_error};

/// One case: a routing table and its weights.
struct Case {
    tokens: usize,
    k: usize,
    experts: usize,
    idx: Vec<i64>,
    w: Vec<f32>,
}

/// xorshift64*.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn cases() -> Vec<Case> {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut out = Vec::new();
    for c in 0..400 {
        let (tokens, k, experts) = (1 + rng.below(9), 1 + rng.below(6), 8 + rng.below(9));
        let k = k.min(experts);
        let mut idx = Vec::with_capacity(tokens * k);
        for _ in 0..tokens {
            // Distinct experts, some slots empty.
            let mut row: Vec<i64> = Vec::new();
            while row.len() < k {
                let e = rng.below(experts) as i64;
                if !row.contains(&e) {
                    row.push(e);
                }
            }
            for e in &mut row {
                if rng.below(5) == 0 {
                    *e = -1;
                }
            }
            idx.extend(row);
        }
        let mut w: Vec<f32> = (0..tokens * k)
            .map(|_| (rng.below(1000) as f32) / 100.0)
            .collect();
        // A quarter valid; the rest with 1-3 faults of random kinds.
        let faults = if c % 4 == 0 { 0 } else { 1 + rng.below(3) };
        for _ in 0..faults {
            let at = rng.below(tokens * k);
            match rng.below(6) {
                0 => idx[at] = (experts + rng.below(4)) as i64,
                1 => idx[at] = -2 - rng.below(3) as i64,
                2 => {
                    // A duplicate of another slot of the same token.
                    let t = at / k;
                    if k > 1 {
                        let other = t * k + (at % k + 1 + rng.below(k - 1)) % k;
                        idx[at] = idx[other];
                    }
                }
                3 => w[at] = f32::NAN,
                4 => w[at] = f32::INFINITY,
                _ => {
                    // A bad weight on an empty slot is fine.
                    idx[at] = -1;
                    w[at] = f32::NEG_INFINITY;
                }
            }
        }
        out.push(Case {
            tokens,
            k,
            experts,
            idx,
            w,
        });
    }
    out
}

/// Compiles and runs input_host.cpp on `cases`; its four words per case, or
/// `None` (after saying why) when no compiler exists outside CI.
fn host_words(cases: &[Case]) -> Option<Vec<[u64; 4]>> {
    let tmp = std::env::temp_dir();
    let id = std::process::id();
    let (inp, outp) = (
        tmp.join(format!("gin-ep-input-host-{id}.in")),
        tmp.join(format!("gin-ep-input-host-{id}.out")),
    );
    let exe = common::compile("input_host", &[], "input-check cross-check")?;
    let mut bytes = Vec::new();
    bytes.extend(u32::try_from(cases.len()).unwrap().to_le_bytes());
    for c in cases {
        for v in [c.tokens, c.k, c.experts] {
            bytes.extend(u32::try_from(v).unwrap().to_le_bytes());
        }
        bytes.extend(c.idx.iter().flat_map(|v| v.to_le_bytes()));
        bytes.extend(c.w.iter().flat_map(|v| v.to_le_bytes()));
    }
    std::fs::write(&inp, &bytes).unwrap();
    let run = Command::new(&exe).arg(&inp).arg(&outp).status().unwrap();
    let _ = std::fs::remove_file(&exe);
    let _ = std::fs::remove_file(&inp);
    assert!(run.success(), "host program failed: {run}");
    let out = std::fs::read(&outp).unwrap();
    let _ = std::fs::remove_file(&outp);
    assert_eq!(out.len(), 32 * cases.len());
    Some(
        out.chunks_exact(32)
            .map(|c| {
                let mut w = [0u64; 4];
                for (i, v) in w.iter_mut().enumerate() {
                    *v = u64::from_le_bytes(c[8 * i..8 * i + 8].try_into().unwrap());
                }
                w
            })
            .collect(),
    )
}

#[test]
fn the_kernels_input_check_reports_what_the_host_check_reports() {
    let cases = cases();
    let Some(words) = host_words(&cases) else {
        return;
    };
    let mut faulty = 0;
    for (i, (c, w)) in cases.iter().zip(&words).enumerate() {
        let cfg = Config::low_latency(256, c.tokens, c.experts, c.k);
        let host = check_entries(3, &cfg, &c.idx, &c.w);
        let kernel = decode_error(3, &cfg, *w);
        match (&host, &kernel) {
            (Ok(()), None) => {}
            (Err(h), Some(k)) => {
                faulty += 1;
                // Display names the token, slot, expert or weight; NaN
                // weights print alike.
                assert_eq!(
                    h.to_string(),
                    k.to_string(),
                    "case {i}: {:?} {:?}",
                    c.idx,
                    c.w
                );
                assert_eq!(
                    std::mem::discriminant(h),
                    std::mem::discriminant(k),
                    "case {i}"
                );
            }
            _ => panic!(
                "case {i}: host {host:?}, kernel {kernel:?} (words {w:x?}) for {:?} {:?}",
                c.idx, c.w
            ),
        }
    }
    // The cases exercise both outcomes.
    assert!(
        faulty > 100 && faulty < cases.len(),
        "{faulty} faulty cases"
    );
}
