//! The FP8 and BF16 functions of `kernels/ll.cu` (the ones the dispatch
//! kernel quantises with and the identity expert dequantises with), compiled
//! as host C++, give the same bytes as gin-ep's `num.rs` on every BF16 value
//! under a dozen scales, on f32 values across the whole range and around
//! every rounding midpoint, on every code, and on whole tokens: CUDA ranks'
//! FP8 dispatch is bit-identical to CPU ranks'.
//!
//! Needs a C++ compiler (`CXX`, else `c++`): skipped with a printed reason
//! where there is none, except in CI (`CI` set), where that is a failure.

use std::process::Command;

mod common;

use gin_ep::num::{Bf16, FP8_MAX, e4m3_to_f32, f32_to_e4m3, quantize_fp8};

/// Compiles and runs fp8_host.cpp; its output, or `None` (after saying why)
/// when no compiler exists outside CI.
fn host_output() -> Option<Vec<u8>> {
    let data = std::env::temp_dir().join(format!("gin-ep-fp8-host-{}.bin", std::process::id()));
    // Rust never contracts a product and a sum into an FMA.
    let exe = common::compile("fp8_host", &["-ffp-contract=off"], "FP8 cross-check")?;
    let run = Command::new(&exe)
        .arg(&data)
        .status()
        .expect("run the host program");
    let _ = std::fs::remove_file(&exe);
    assert!(run.success(), "host program failed");
    let bytes = std::fs::read(&data).expect("the host program's output");
    let _ = std::fs::remove_file(&data);
    Some(bytes)
}

/// fp8_host.cpp's AMAX.
const AMAX: [u32; 12] = [
    0x0000_0000,
    0x3f80_0000,
    0x43e0_0000,
    0x4040_0000,
    0x3dcc_cccd,
    0x0d00_0000,
    0x7200_0000,
    0x40f0_0000,
    0x42f6_cccd,
    0x0001_0000,
    0x7f7f_0000,
    0x3ebd_70a4,
];

/// The host program's xorshift64*.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// num.rs's scale of a block (inside `quantize_fp8`).
fn scale_of(amax: f32) -> f32 {
    if amax > 0.0 { amax / FP8_MAX } else { 1.0 }
}

/// What num.rs makes of each case, in fp8_host.cpp's order, with a name per
/// section for the failure message.
fn expected() -> Vec<(&'static str, Vec<u8>)> {
    let scales: Vec<f32> = AMAX.iter().map(|&a| scale_of(f32::from_bits(a))).collect();
    let mut secs = Vec::new();
    secs.push((
        "scales",
        scales
            .iter()
            .flat_map(|s| s.to_bits().to_le_bytes())
            .collect(),
    ));
    let mut v = Vec::new();
    for &s in &scales {
        for b in 0..=u16::MAX {
            v.push(f32_to_e4m3(Bf16(b).to_f32() / s));
        }
    }
    secs.push(("every BF16 value quantised with every scale", v));
    let mut v = Vec::new();
    for hi in 0..=0xffffu32 {
        for lo in [
            0x0000u32, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff, 0x1234, 0xabcd,
        ] {
            v.push(f32_to_e4m3(f32::from_bits(hi << 16 | lo)));
        }
    }
    secs.push(("f32 values", v));
    let mut v = Vec::new();
    for c in 0..0x7eu8 {
        let mid = f32::midpoint(e4m3_to_f32(c), e4m3_to_f32(c + 1));
        for d in -2i32..=2 {
            let m = mid.to_bits().wrapping_add_signed(d);
            v.push(f32_to_e4m3(f32::from_bits(m)));
            v.push(f32_to_e4m3(f32::from_bits(m | 0x8000_0000)));
        }
    }
    secs.push(("around the midpoints", v));
    let mut v = Vec::new();
    for c in 0..=255u8 {
        let x = e4m3_to_f32(c);
        // num.rs's NaN is f32::NAN.
        v.extend(x.to_bits().to_le_bytes());
    }
    secs.push(("every code decoded", v));
    let mut v = Vec::new();
    for &s in &scales {
        for c in 0..=255u8 {
            v.extend(Bf16::from_f32(e4m3_to_f32(c) * s).0.to_le_bytes());
        }
    }
    secs.push(("every code dequantised with every scale", v));
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut v = Vec::new();
    for t in 0..64 {
        let x: Vec<Bf16> = (0..512)
            .map(|_| {
                let r = rng.next();
                Bf16(if t % 8 == 7 {
                    (r & 0x8000) as u16
                } else if r.is_multiple_of(16) {
                    (r >> 16) as u16
                } else {
                    ((r >> 63) << 15 | (100 + (r >> 8) % 40) << 7 | (r >> 20 & 0x7f)) as u16
                })
            })
            .collect();
        let mut q = vec![0u8; 512 + 16];
        quantize_fp8(&x, &mut q);
        v.extend(q);
    }
    secs.push(("whole tokens", v));
    secs
}

#[test]
fn ll_cu_fp8_matches_num_rs_bit_for_bit() {
    let Some(got) = host_output() else { return };
    let want = expected();
    let total: usize = want.iter().map(|(_, v)| v.len()).sum();
    assert_eq!(got.len(), total, "host program wrote {} bytes", got.len());
    let mut at = 0;
    for (name, w) in want {
        let g = &got[at..at + w.len()];
        if let Some(i) = g.iter().zip(&w).position(|(a, b)| a != b) {
            panic!(
                "{name}: byte {i} differs: ll.cu {:#04x}, num.rs {:#04x}",
                g[i], w[i]
            );
        }
        at += w.len();
    }
}
