//! The number formats tokens travel in: BF16, and FP8 (E4M3) with one f32
//! scale per 128 elements, as DeepEP's FP8 path. Pure code.

/// A bfloat16: the top 16 bits of an f32. Conversions round to nearest even.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
#[repr(transparent)]
pub struct Bf16(pub u16);

impl Bf16 {
    /// Zero.
    pub const ZERO: Self = Self(0);

    /// Rounds `v` to the nearest bfloat16 (ties to even); NaN stays NaN.
    pub fn from_f32(v: f32) -> Self {
        let bits = v.to_bits();
        if v.is_nan() {
            return Self(((bits >> 16) as u16) | 0x40);
        }
        let lsb = (bits >> 16) & 1;
        Self((bits.wrapping_add(0x7fff + lsb) >> 16) as u16)
    }

    /// The exact f32 value.
    pub fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self.0) << 16)
    }
}

/// Views bfloat16s as bytes (little-endian, as they lie in memory here).
pub fn bf16_bytes(v: &[Bf16]) -> &[u8] {
    // SAFETY: Bf16 is a transparent u16: no padding, every byte initialised;
    // u8 has alignment 1 and the length covers exactly the same bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// Views bfloat16s as bytes, for writing.
pub fn bf16_bytes_mut(v: &mut [Bf16]) -> &mut [u8] {
    // SAFETY: as `bf16_bytes`; every bit pattern of u16 is a valid Bf16, so
    // any bytes written through the view leave valid values.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// [`Bf16::from_f32`] without branches, so that loops over rows vectorize.
#[inline]
fn round_bf16(v: f32) -> u16 {
    let bits = v.to_bits();
    let rounded = (bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16) as u16;
    let nan = ((bits >> 16) as u16) | 0x40;
    if v.is_nan() { nan } else { rounded }
}

#[inline]
fn widen(lo: u8, hi: u8) -> f32 {
    f32::from_bits(u32::from(u16::from_le_bytes([lo, hi])) << 16)
}

/// Sums BF16 rows (little-endian bytes, all `out.len()` long) in f32, in the
/// order given, and rounds once into `out`: no row is all zeros, one row is
/// copied (the same value), two are added in one pass. `acc` is scratch.
pub fn sum_bf16_rows(rows: &[&[u8]], out: &mut [u8], acc: &mut Vec<f32>) {
    match rows {
        [] => out.fill(0),
        [a] => out.copy_from_slice(&a[..out.len()]),
        [a, b] => {
            for ((o, x), y) in out
                .chunks_exact_mut(2)
                .zip(a.chunks_exact(2))
                .zip(b.chunks_exact(2))
            {
                let v = round_bf16(widen(x[0], x[1]) + widen(y[0], y[1]));
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        [first, rest @ ..] => {
            acc.clear();
            acc.extend(
                first
                    .chunks_exact(2)
                    .take(out.len() / 2)
                    .map(|c| widen(c[0], c[1])),
            );
            for row in rest {
                for (v, c) in acc.iter_mut().zip(row.chunks_exact(2)) {
                    *v += widen(c[0], c[1]);
                }
            }
            for (o, v) in out.chunks_exact_mut(2).zip(acc.iter()) {
                o.copy_from_slice(&round_bf16(*v).to_le_bytes());
            }
        }
    }
}

/// Elements covered by one FP8 scale.
pub const FP8_BLOCK: usize = 128;

/// The largest finite E4M3 value.
pub const FP8_MAX: f32 = 448.0;

/// Encodes `v` (already scaled into range) as FP8 E4M3 (bias 7, no
/// infinities, 0x7f/0xff are NaN), rounding to nearest even and saturating
/// at ±448.
pub fn f32_to_e4m3(v: f32) -> u8 {
    if v.is_nan() {
        return 0x7f;
    }
    let sign = if v.is_sign_negative() { 0x80 } else { 0 };
    let a = v.abs().min(FP8_MAX);
    // Subnormals step by 2^-9; the normal range starts at 2^-6.
    if a < 2f32.powi(-6) {
        let q = (a * 512.0).round_ties_even() as u8; // 0..=8; 8 is the smallest normal
        return sign | q;
    }
    let e = a.log2().floor() as i32;
    let e = e.clamp(-6, 8);
    let m = a / 2f32.powi(e) - 1.0; // [0, 1)
    let mut q = (m * 8.0).round_ties_even() as i32;
    let mut e = e;
    if q == 8 {
        q = 0;
        e += 1;
    }
    if e > 8 || (e == 8 && q > 6) {
        return sign | 0x7e; // 448
    }
    sign | (((e + 7) as u8) << 3) | q as u8
}

/// Decodes FP8 E4M3.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 == 0 { 1.0 } else { -1.0 };
    let e = i32::from((b >> 3) & 0xf);
    let m = f32::from(b & 7);
    if e == 0xf && b & 7 == 7 {
        return f32::NAN;
    }
    if e == 0 {
        sign * m * 2f32.powi(-9)
    } else {
        sign * (1.0 + m / 8.0) * 2f32.powi(e - 7)
    }
}

/// Quantizes one token (`x.len()` a multiple of 128) into `out`: the FP8
/// bytes, then one little-endian f32 scale per 128 elements (amax / 448;
/// 1 for an all-zero block).
pub fn quantize_fp8(x: &[Bf16], out: &mut [u8]) {
    let n = x.len();
    let (data, scales) = out.split_at_mut(n);
    for (b, block) in x.chunks(FP8_BLOCK).enumerate() {
        let amax = block.iter().map(|v| v.to_f32().abs()).fold(0f32, f32::max);
        let scale = if amax > 0.0 { amax / FP8_MAX } else { 1.0 };
        for (i, v) in block.iter().enumerate() {
            data[b * FP8_BLOCK + i] = f32_to_e4m3(v.to_f32() / scale);
        }
        scales[b * 4..b * 4 + 4].copy_from_slice(&scale.to_le_bytes());
    }
}

/// The inverse of [`quantize_fp8`] for a token of `hidden` elements.
pub fn dequantize_fp8(bytes: &[u8], hidden: usize, out: &mut [Bf16]) {
    let (data, scales) = bytes.split_at(hidden);
    for (i, o) in out.iter_mut().enumerate().take(hidden) {
        let b = i / FP8_BLOCK;
        let mut s = [0u8; 4];
        s.copy_from_slice(&scales[b * 4..b * 4 + 4]);
        *o = Bf16::from_f32(e4m3_to_f32(data[i]) * f32::from_le_bytes(s));
    }
}

#[cfg(test)]
#[allow(clippy::float_cmp)] // conversions are exact: equality is the point
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even_and_is_exact_on_small_integers() {
        for i in -256..=256 {
            assert_eq!(Bf16::from_f32(i as f32).to_f32(), i as f32);
        }
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1).
        assert_eq!(Bf16::from_f32(1.0 + 2f32.powi(-8)).to_f32(), 1.0);
        assert_eq!(
            Bf16::from_f32(1.0 + 3.0 * 2f32.powi(-8)).to_f32(),
            1.0 + 2.0 * 2f32.powi(-7)
        );
        assert!(Bf16::from_f32(f32::NAN).to_f32().is_nan());
    }

    #[test]
    fn row_sums_round_once_like_the_scalar_conversion() {
        let row = |vals: &[f32]| -> Vec<u8> {
            vals.iter()
                .flat_map(|&v| Bf16::from_f32(v).0.to_le_bytes())
                .collect()
        };
        let a = row(&[1.0, -2.5, 3.0e-3, f32::NAN, 1.0e30, 0.1]);
        let b = row(&[0.5, 2.5, 7.0, 1.0, 1.0e30, 0.2]);
        let c = row(&[0.25, 0.0, -7.0, 2.0, -1.0e30, 0.3]);
        let mut acc = Vec::new();
        let mut out = vec![0u8; a.len()];
        for rows in [
            vec![],
            vec![&a[..]],
            vec![&a[..], &b[..]],
            vec![&a[..], &b[..], &c[..]],
        ] {
            sum_bf16_rows(&rows, &mut out, &mut acc);
            for i in 0..a.len() / 2 {
                let mut want = 0f32;
                for r in &rows {
                    want += Bf16(u16::from_le_bytes([r[2 * i], r[2 * i + 1]])).to_f32();
                }
                let got = Bf16(u16::from_le_bytes([out[2 * i], out[2 * i + 1]]));
                let want = Bf16::from_f32(want);
                assert!(
                    got == want || (got.to_f32().is_nan() && want.to_f32().is_nan()),
                    "{} rows, element {i}: {got:?} vs {want:?}",
                    rows.len()
                );
            }
        }
    }

    #[test]
    fn e4m3_round_trips_every_finite_code() {
        for b in 0..=255u8 {
            let v = e4m3_to_f32(b);
            if v.is_nan() {
                continue;
            }
            let back = f32_to_e4m3(v);
            // +0 and -0 both decode to 0.
            assert_eq!(e4m3_to_f32(back), v, "code {b:#x}");
        }
        assert_eq!(e4m3_to_f32(f32_to_e4m3(1000.0)), 448.0);
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
    }

    #[test]
    fn fp8_blocks_keep_values_within_e4m3_precision() {
        let x: Vec<Bf16> = (0..256)
            .map(|i| Bf16::from_f32((i as f32 - 100.0) * 0.37))
            .collect();
        let mut q = vec![0u8; 256 + 8];
        quantize_fp8(&x, &mut q);
        let mut y = vec![Bf16::ZERO; 256];
        dequantize_fp8(&q, 256, &mut y);
        for (a, b) in x.iter().zip(&y) {
            let (a, b) = (a.to_f32(), b.to_f32());
            // 3 mantissa bits: relative error at most 2^-4, plus bf16's.
            assert!((a - b).abs() <= a.abs() / 14.0 + 0.01, "{a} vs {b}");
        }
    }
}
