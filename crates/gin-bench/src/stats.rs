//! Summaries of repeated measurements: median and spread, never one run;
//! result rows with a floor from the same run; least squares and bootstrap
//! resampling for fits (the LogGP parameters).
//!
//! Everything here is pure: values in, values out, so that it is tested on
//! known data.

use serde::{Deserialize, Serialize};

/// Median and percentiles of a set of samples (same unit as the samples).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct Summary {
    pub n: usize,
    pub median: f64,
    pub p10: f64,
    pub p90: f64,
    pub p99: f64,
    pub min: f64,
    pub max: f64,
}

/// Nearest-rank percentile of sorted, non-empty samples.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// The median of unsorted samples (NaN for none).
pub fn median(samples: &[f64]) -> f64 {
    let mut s = samples.to_vec();
    s.sort_by(f64::total_cmp);
    percentile(&s, 50.0)
}

impl Summary {
    /// Summarises samples; `None` for an empty set or one with a NaN.
    pub fn of(samples: &[f64]) -> Option<Self> {
        if samples.is_empty() || samples.iter().any(|v| v.is_nan()) {
            return None;
        }
        let mut s = samples.to_vec();
        s.sort_by(f64::total_cmp);
        Some(Self {
            n: s.len(),
            median: percentile(&s, 50.0),
            p10: percentile(&s, 10.0),
            p90: percentile(&s, 90.0),
            p99: percentile(&s, 99.0),
            min: s[0],
            max: s[s.len() - 1],
        })
    }
}

/// One result row: a time per operation measured over repeated runs, the
/// bandwidth it implies, and a floor measured in the same job.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Row {
    /// Bytes one operation moves (what the bandwidth divides).
    pub bytes: f64,
    /// µs per operation, over runs.
    pub us: Summary,
    /// `bytes / median`, GB/s.
    pub gbps: f64,
    /// The floor's µs per operation, over runs.
    pub floor_us: Summary,
    /// `median / floor median`: how many floors one operation costs.
    pub ratio: f64,
    /// One sample per run (µs per operation), kept so that fits can be
    /// redone and resampled from the JSON.
    pub runs: Vec<f64>,
    pub floor_runs: Vec<f64>,
}

impl Row {
    /// A row from per-run samples; `None` when either set is empty.
    pub fn new(bytes: f64, runs: Vec<f64>, floor_runs: Vec<f64>) -> Option<Self> {
        let us = Summary::of(&runs)?;
        let floor_us = Summary::of(&floor_runs)?;
        Some(Self {
            bytes,
            gbps: gbps(bytes, us.median),
            ratio: us.median / floor_us.median.max(1e-12),
            us,
            floor_us,
            runs,
            floor_runs,
        })
    }

    /// Operations per second at the median.
    pub fn ops_per_s(&self) -> f64 {
        1e6 / self.us.median.max(1e-12)
    }

    /// The floor's operations per second at its median.
    pub fn floor_ops_per_s(&self) -> f64 {
        1e6 / self.floor_us.median.max(1e-12)
    }
}

/// Bytes moved in `us` microseconds, as GB/s (10^9 bytes per second).
pub fn gbps(bytes: f64, us: f64) -> f64 {
    if us > 0.0 { bytes / (us * 1e3) } else { 0.0 }
}

/// An ordinary least-squares line `y = intercept + slope · x` with the
/// standard errors of both coefficients.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LineFit {
    pub slope: f64,
    pub intercept: f64,
    pub slope_se: f64,
    pub intercept_se: f64,
    /// Coefficient of determination (1 for a perfect line).
    pub r2: f64,
}

/// Fits a line through `(x, y)` points; `None` with fewer than two distinct
/// x values.
pub fn line_fit(points: &[(f64, f64)]) -> Option<LineFit> {
    let n = points.len() as f64;
    if points.len() < 2 {
        return None;
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let syy: f64 = points.iter().map(|p| (p.1 - my).powi(2)).sum();
    if sxx <= 0.0 || !sxx.is_finite() {
        return None;
    }
    let slope = sxy / sxx;
    let intercept = my - slope * mx;
    let rss: f64 = points
        .iter()
        .map(|p| (p.1 - intercept - slope * p.0).powi(2))
        .sum();
    // With two points the line is exact and the residual variance unknown.
    let s2 = if points.len() > 2 {
        rss / (n - 2.0)
    } else {
        0.0
    };
    Some(LineFit {
        slope,
        intercept,
        slope_se: (s2 / sxx).sqrt(),
        intercept_se: (s2 * (1.0 / n + mx * mx / sxx)).sqrt(),
        r2: if syy > 0.0 { 1.0 - rss / syy } else { 1.0 },
    })
}

/// SplitMix64: a small deterministic generator for resampling, so that a
/// report's intervals are reproducible from its JSON (no `rand` needed).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`), by multiply-shift: no modulo bias worth
    /// measuring for the sample counts used here.
    pub fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }

    /// A bootstrap resample: `samples.len()` draws with replacement.
    pub fn resample(&mut self, samples: &[f64]) -> Vec<f64> {
        if samples.is_empty() {
            return Vec::new();
        }
        (0..samples.len())
            .map(|_| samples[self.below(samples.len())])
            .collect()
    }
}

/// A central interval of a bootstrap distribution.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Interval {
    /// The estimate from the data as measured (not a bootstrap mean).
    pub value: f64,
    /// 2.5th and 97.5th percentiles of the replicates.
    pub lo: f64,
    pub hi: f64,
}

impl Interval {
    /// `value` with the 95 % interval of `replicates` (NaNs ignored).
    pub fn from_replicates(value: f64, replicates: &[f64]) -> Self {
        let mut r: Vec<f64> = replicates.iter().copied().filter(|v| !v.is_nan()).collect();
        r.sort_by(f64::total_cmp);
        if r.is_empty() {
            return Self {
                value,
                lo: value,
                hi: value,
            };
        }
        Self {
            value,
            lo: percentile(&r, 2.5),
            hi: percentile(&r, 97.5),
        }
    }

    /// Half the interval's width.
    #[cfg(test)]
    pub fn half_width(&self) -> f64 {
        (self.hi - self.lo) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::float_cmp)] // exact sample values are picked, not computed
    fn percentiles_of_known_samples() {
        let v: Vec<f64> = (1..=101).map(f64::from).collect();
        let s = Summary::of(&v).unwrap();
        assert_eq!(
            (s.median, s.p10, s.p90, s.p99, s.min, s.max),
            (51.0, 11.0, 91.0, 100.0, 1.0, 101.0)
        );
        assert_eq!(Summary::of(&[3.0]).unwrap().median, 3.0);
        assert!(Summary::of(&[]).is_none());
        assert!(Summary::of(&[1.0, f64::NAN]).is_none());
        // Order does not matter.
        let mut rev = v.clone();
        rev.reverse();
        assert_eq!(Summary::of(&rev).unwrap(), s);
        assert_eq!(median(&[5.0, 1.0, 3.0]), 3.0);
        assert!(median(&[]).is_nan());
    }

    #[test]
    #[allow(clippy::float_cmp)]
    fn row_bandwidth_and_ratio() {
        // 4096 bytes in 2 µs is 2.048 GB/s; the floor at 1 µs makes it 2x.
        let r = Row::new(4096.0, vec![2.0, 1.5, 3.0], vec![1.0, 1.0, 0.9]).unwrap();
        assert_eq!(r.us.median, 2.0);
        assert!((r.gbps - 2.048).abs() < 1e-12);
        assert_eq!(r.ratio, 2.0);
        assert!((r.ops_per_s() - 500_000.0).abs() < 1e-6);
        assert!((r.floor_ops_per_s() - 1_000_000.0).abs() < 1e-6);
        assert!(Row::new(8.0, vec![], vec![1.0]).is_none());
        assert!(Row::new(8.0, vec![1.0], vec![]).is_none());
        assert_eq!(gbps(1e3, 0.0), 0.0);
    }

    #[test]
    fn line_fit_recovers_an_exact_line() {
        let pts: Vec<(f64, f64)> = (0..10)
            .map(|i| (f64::from(i), 3.0 + 0.5 * f64::from(i)))
            .collect();
        let f = line_fit(&pts).unwrap();
        assert!((f.slope - 0.5).abs() < 1e-12);
        assert!((f.intercept - 3.0).abs() < 1e-12);
        assert!(f.slope_se < 1e-9 && f.intercept_se < 1e-9);
        assert!((f.r2 - 1.0).abs() < 1e-12);
        assert!(line_fit(&[(1.0, 2.0)]).is_none());
        assert!(line_fit(&[(1.0, 2.0), (1.0, 3.0)]).is_none());
    }

    #[test]
    fn line_fit_standard_error_matches_textbook() {
        // x = 1..5, y = 2x + noise (+1, -1, 0, +1, -1): Sxy = 18 and
        // Sxx = 10 give slope 1.8; se(slope) = sqrt(RSS / (n - 2) / Sxx).
        let ys = [3.0, 3.0, 6.0, 9.0, 9.0];
        let pts: Vec<(f64, f64)> = ys
            .iter()
            .enumerate()
            .map(|(i, &y)| ((i + 1) as f64, y))
            .collect();
        let f = line_fit(&pts).unwrap();
        assert!((f.slope - 1.8).abs() < 1e-12, "{f:?}");
        let rss: f64 = pts
            .iter()
            .map(|p| (p.1 - f.intercept - f.slope * p.0).powi(2))
            .sum();
        assert!((f.slope_se - (rss / 3.0 / 10.0).sqrt()).abs() < 1e-12);
    }

    #[test]
    fn rng_is_deterministic_and_in_range() {
        let mut a = Rng::new(7);
        let mut b = Rng::new(7);
        for _ in 0..1000 {
            let (x, y) = (a.below(13), b.below(13));
            assert_eq!(x, y);
            assert!(x < 13);
        }
        // Every value of a small range shows up.
        let mut seen = [false; 5];
        for _ in 0..200 {
            seen[a.below(5)] = true;
        }
        assert!(seen.iter().all(|&s| s));
        let s = a.resample(&[1.0, 2.0, 3.0]);
        assert_eq!(s.len(), 3);
        assert!(s.iter().all(|v| [1.0, 2.0, 3.0].contains(v)));
        assert!(a.resample(&[]).is_empty());
    }

    #[test]
    fn bootstrap_interval_covers_the_median_of_a_known_distribution() {
        // 1..=99: the median is 50; a bootstrap of the median should put a
        // 95 % interval of roughly ±10 around it.
        let v: Vec<f64> = (1..=99).map(f64::from).collect();
        let mut rng = Rng::new(1);
        let reps: Vec<f64> = (0..2000).map(|_| median(&rng.resample(&v))).collect();
        let i = Interval::from_replicates(median(&v), &reps);
        assert!(i.lo < 50.0 && i.hi > 50.0, "{i:?}");
        assert!(i.half_width() > 3.0 && i.half_width() < 20.0, "{i:?}");
        let none = Interval::from_replicates(1.0, &[f64::NAN]);
        assert!((none.half_width()).abs() < 1e-12);
    }

    proptest::proptest! {
        /// Percentiles are ordered and lie within the samples.
        #[test]
        fn summary_is_ordered(v in proptest::collection::vec(-1e9f64..1e9, 1..200)) {
            let s = Summary::of(&v).unwrap();
            proptest::prop_assert!(s.min <= s.p10 && s.p10 <= s.median && s.median <= s.p90);
            proptest::prop_assert!(s.p90 <= s.p99 && s.p99 <= s.max);
            proptest::prop_assert_eq!(s.n, v.len());
        }

        /// `below(n)` never reaches n.
        #[test]
        fn below_is_in_range(seed in proptest::prelude::any::<u64>(), n in 1usize..1_000_000) {
            let mut r = Rng::new(seed);
            for _ in 0..16 {
                proptest::prop_assert!(r.below(n) < n);
            }
        }
    }
}
