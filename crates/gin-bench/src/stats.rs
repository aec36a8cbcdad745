//! Summaries of repeated measurements: median and spread, never one run;
//! result rows with a floor from the same run.
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

    proptest::proptest! {
        /// Percentiles are ordered and lie within the samples.
        #[test]
        fn summary_is_ordered(v in proptest::collection::vec(-1e9f64..1e9, 1..200)) {
            let s = Summary::of(&v).unwrap();
            proptest::prop_assert!(s.min <= s.p10 && s.p10 <= s.median && s.median <= s.p90);
            proptest::prop_assert!(s.p90 <= s.p99 && s.p99 <= s.max);
            proptest::prop_assert_eq!(s.n, v.len());
        }

    }
}
