//! Summaries of repeated measurements: median and spread, never one run.

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

/// Nearest-rank percentile of sorted samples.
fn pct(sorted: &[f64], p: f64) -> f64 {
    let i = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

impl Summary {
    /// Summarises samples; `None` for an empty set.
    pub fn of(samples: &[f64]) -> Option<Self> {
        if samples.is_empty() {
            return None;
        }
        let mut s = samples.to_vec();
        s.sort_by(f64::total_cmp);
        Some(Self {
            n: s.len(),
            median: pct(&s, 50.0),
            p10: pct(&s, 10.0),
            p90: pct(&s, 90.0),
            p99: pct(&s, 99.0),
            min: s[0],
            max: s[s.len() - 1],
        })
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
    }
}
