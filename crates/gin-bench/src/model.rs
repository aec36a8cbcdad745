//! The LogGP model of the all-to-all, pure: fitting L, o, g, G (and the
//! time-sharing hand-off s) from ping-pong and rate samples, resampling them
//! for intervals, and predicting the seed's all-to-all. `loggp` feeds it
//! measurements; the tests feed it synthetic data with known parameters.
//!
//! # Method
//!
//! - **o** (overhead): issue-side cost of one put, the time inside the put
//!   calls of a window of puts, without the flush (from `rate`).
//! - **g** (gap): the interval between messages at the sustained put + signal
//!   rate, `1 / rate` (from `rate` with a window of puts in flight).
//! - **G** (gap per byte): the slope of the ping-pong half round trip versus
//!   size over the large sizes (least squares from `g_from` up).
//! - **L** (latency): the smallest ping-pong half round trip minus `2o` and
//!   its bytes times G: LogGP's `T(n) = L + 2o + n·G` solved for L.
//! - **s** (hand-off): the half round trip of an 8-byte ping-pong with both
//!   ranks on one CPU: what it costs the OS to hand a core from a waiting
//!   rank to the one it waits for. Only time-shared predictions use it.
//!
//! Medians over runs make each estimate; the intervals come from bootstrap
//! resampling of the runs of every measurement and refitting.
//!
//! # Prediction
//!
//! One iteration of the benchmark: each of P ranks puts n bytes with a
//! signal to every rank, itself included (P sends), waits for P signals and
//! flushes. A CPU rank issues its sends from one thread, one after another,
//! and one thread moves the bytes: the rank itself on the direct path, a
//! helper thread (the proxy, or the soft NIC) on offload paths. With every
//! thread on its own core:
//!
//! `T_dedicated = L + 2o + (P − 1)·max(o, g) + P·n·G`
//!
//! (the seed's serial-proxy form `L + 2o + (P − 1)·n·G`, plus the gap between
//! serialised sends and the send to itself). When the threads outnumber the
//! cores C, every thread must be switched in at least once per iteration
//! and do its share of the work on one of C cores:
//!
//! `T_shared = Σ over threads (s + work) / C`, with work `P·(o + n·G)` per
//! rank on the direct path, and `P·o` per rank plus `P·(g + n·G)` per
//! helper on offload paths. The prediction is `max(T_dedicated, T_shared)`.

use serde::{Deserialize, Serialize};

use crate::stats::{Interval, Rng, line_fit, median};

/// How a path moves bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PathKind {
    /// The rank's own thread copies the bytes (direct load/store).
    Direct,
    /// A helper thread per rank (the proxy, the soft NIC) moves the bytes;
    /// the rank only queues descriptors or work requests.
    Offload,
}

impl PathKind {
    /// Threads per rank that need a core in every iteration.
    pub fn threads_per_rank(self) -> usize {
        match self {
            PathKind::Direct => 1,
            PathKind::Offload => 2,
        }
    }
}

/// What a fit takes: per-run samples, µs.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct FitInput {
    /// Ping-pong half round trips: (bytes, one median per run).
    pub pingpong: Vec<(u64, Vec<f64>)>,
    /// Issue-side µs per put, one per run.
    pub issue: Vec<f64>,
    /// µs per message at the sustained put + signal rate, one per run.
    pub gap: Vec<f64>,
    /// Half round trip of an 8-byte ping-pong on one shared CPU, per run.
    pub handoff: Vec<f64>,
    /// G is fitted from this size up.
    pub g_from: u64,
}

/// LogGP parameters (µs; G in µs per byte) and the hand-off s.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Params {
    pub l: f64,
    pub o: f64,
    pub g: f64,
    pub big_g: f64,
    pub s: f64,
}

impl Params {
    /// `1 / G` as GB/s.
    pub fn g_gbps(&self) -> f64 {
        if self.big_g > 0.0 {
            1e-3 / self.big_g
        } else {
            f64::INFINITY
        }
    }
}

/// Why a fit could not be made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FitError {
    /// Fewer than two ping-pong sizes at or above `g_from`.
    TooFewLargeSizes { g_from: u64, have: usize },
    /// A measurement has no samples.
    Missing(&'static str),
}

impl std::fmt::Display for FitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FitError::TooFewLargeSizes { g_from, have } => write!(
                f,
                "G needs ping-pong at two or more sizes of at least {g_from} bytes, have {have}"
            ),
            FitError::Missing(what) => write!(f, "no samples of {what}"),
        }
    }
}

impl std::error::Error for FitError {}

/// Fits the parameters from per-measurement medians.
pub fn fit(input: &FitInput) -> Result<Params, FitError> {
    fit_with(input, &mut |v| v.to_vec())
}

/// `fit` where `pick` chooses the samples of each measurement (identity
/// for the fit itself, a resample for bootstrap replicates).
fn fit_with(
    input: &FitInput,
    pick: &mut dyn FnMut(&[f64]) -> Vec<f64>,
) -> Result<Params, FitError> {
    let nonempty = |v: Vec<f64>, what| {
        if v.is_empty() {
            Err(FitError::Missing(what))
        } else {
            Ok(median(&v))
        }
    };
    let o = nonempty(pick(&input.issue), "issue cost")?;
    let g = nonempty(pick(&input.gap), "message gap")?;
    let s = nonempty(pick(&input.handoff), "hand-off")?;
    let mut points = Vec::with_capacity(input.pingpong.len());
    for (n, runs) in &input.pingpong {
        points.push((*n, nonempty(pick(runs), "ping-pong")?));
    }
    points.sort_by_key(|p| p.0);
    let large: Vec<(f64, f64)> = points
        .iter()
        .filter(|p| p.0 >= input.g_from)
        .map(|p| (p.0 as f64, p.1))
        .collect();
    let line = line_fit(&large).ok_or(FitError::TooFewLargeSizes {
        g_from: input.g_from,
        have: large.len(),
    })?;
    let big_g = line.slope.max(0.0);
    let &(n0, h0) = points.first().ok_or(FitError::Missing("ping-pong"))?;
    Ok(Params {
        l: h0 - 2.0 * o - n0 as f64 * big_g,
        o,
        g,
        big_g,
        s,
    })
}

/// Parameters with 95 % bootstrap intervals.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Fitted {
    pub params: Params,
    pub l: Interval,
    pub o: Interval,
    pub g: Interval,
    pub big_g: Interval,
    pub s: Interval,
    /// Every replicate, for prediction intervals.
    #[serde(skip)]
    pub replicates: Vec<Params>,
}

/// Fits, then refits `resamples` bootstrap replicates (each measurement's
/// runs drawn with replacement) for the intervals. Deterministic in `seed`.
pub fn fit_with_intervals(
    input: &FitInput,
    resamples: usize,
    seed: u64,
) -> Result<Fitted, FitError> {
    let params = fit(input)?;
    let mut rng = Rng::new(seed);
    let mut reps = Vec::with_capacity(resamples);
    for _ in 0..resamples {
        reps.push(fit_with(input, &mut |v| rng.resample(v))?);
    }
    let iv = |value: f64, f: fn(&Params) -> f64| {
        Interval::from_replicates(value, &reps.iter().map(f).collect::<Vec<_>>())
    };
    Ok(Fitted {
        l: iv(params.l, |p| p.l),
        o: iv(params.o, |p| p.o),
        g: iv(params.g, |p| p.g),
        big_g: iv(params.big_g, |p| p.big_g),
        s: iv(params.s, |p| p.s),
        params,
        replicates: reps,
    })
}

/// Which regime a prediction fell in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Regime {
    /// Every thread has its own core.
    Dedicated,
    /// Threads outnumber cores: they time-share.
    TimeShared,
}

/// A predicted all-to-all iteration, µs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    pub us: f64,
    pub dedicated_us: f64,
    /// 0 when the threads fit the cores.
    pub shared_us: f64,
    pub regime: Regime,
    /// The seed's formula as written, `L + 2o + (P − 1)·n·G`, for comparison.
    pub seed_us: f64,
}

/// Predicts one iteration of the all-to-all for `ranks` ranks sending `n`
/// bytes to each rank on `cores` cores.
pub fn predict(p: &Params, kind: PathKind, ranks: usize, n: u64, cores: usize) -> Prediction {
    let pr = ranks as f64;
    let n = n as f64;
    let l = p.l.max(0.0);
    let dedicated = l + 2.0 * p.o + (pr - 1.0) * p.o.max(p.g) + pr * n * p.big_g;
    let seed = l + 2.0 * p.o + (pr - 1.0) * n * p.big_g;
    let threads = ranks * kind.threads_per_rank();
    let shared = if threads > cores.max(1) {
        let work = match kind {
            PathKind::Direct => pr * (p.s + pr * (p.o + n * p.big_g)),
            PathKind::Offload => pr * (p.s + pr * p.o) + pr * (p.s + pr * (p.g + n * p.big_g)),
        };
        work / cores.max(1) as f64
    } else {
        0.0
    };
    Prediction {
        us: dedicated.max(shared),
        dedicated_us: dedicated,
        shared_us: shared,
        regime: if shared > 0.0 {
            Regime::TimeShared
        } else {
            Regime::Dedicated
        },
        seed_us: seed,
    }
}

/// `predict` with a 95 % interval over the fit's bootstrap replicates.
pub fn predict_interval(
    f: &Fitted,
    kind: PathKind,
    ranks: usize,
    n: u64,
    cores: usize,
) -> (Prediction, Interval) {
    let p = predict(&f.params, kind, ranks, n, cores);
    let reps: Vec<f64> = f
        .replicates
        .iter()
        .map(|r| predict(r, kind, ranks, n, cores).us)
        .collect();
    (p, Interval::from_replicates(p.us, &reps))
}

/// Signed error of a prediction, percent of the measurement.
pub fn error_pct(predicted: f64, measured: f64) -> f64 {
    (predicted - measured) / measured * 100.0
}

#[cfg(test)]
mod tests {
    use super::*;

    const TRUE: Params = Params {
        l: 1.5,
        o: 0.2,
        g: 0.35,
        big_g: 1.0 / 8000.0, // 8 GB/s
        s: 9.0,
    };

    /// Samples of a measurement around `v`, with ±`noise` relative spread
    /// (deterministic: a symmetric pattern, so the median is `v`).
    fn around(v: f64, noise: f64, runs: usize, rng: &mut Rng) -> Vec<f64> {
        (0..runs)
            .map(|i| {
                let k = (i % 5) as f64 - 2.0; // -2..2, median 0
                let jitter = (rng.below(1000) as f64 / 1000.0 - 0.5) * noise * 0.1;
                v * (1.0 + noise * k / 2.0 + jitter)
            })
            .collect()
    }

    fn synthetic(p: &Params, noise: f64, runs: usize) -> FitInput {
        let mut rng = Rng::new(42);
        let sizes = [8u64, 64, 512, 4096, 65_536, 262_144, 1 << 20];
        FitInput {
            pingpong: sizes
                .iter()
                .map(|&n| {
                    let h = p.l + 2.0 * p.o + n as f64 * p.big_g;
                    (n, around(h, noise, runs, &mut rng))
                })
                .collect(),
            issue: around(p.o, noise, runs, &mut rng),
            gap: around(p.g, noise, runs, &mut rng),
            handoff: around(p.s, noise, runs, &mut rng),
            g_from: 65_536,
        }
    }

    fn close(a: f64, b: f64, rel: f64) -> bool {
        (a - b).abs() <= rel * b.abs()
    }

    #[test]
    fn recovers_known_parameters_exactly_without_noise() {
        let f = fit(&synthetic(&TRUE, 0.0, 5)).unwrap();
        assert!(close(f.l, TRUE.l, 1e-9), "{f:?}");
        assert!(close(f.o, TRUE.o, 1e-12));
        assert!(close(f.g, TRUE.g, 1e-12));
        assert!(close(f.big_g, TRUE.big_g, 1e-9));
        assert!(close(f.s, TRUE.s, 1e-12));
        assert!(close(f.g_gbps(), 8.0, 1e-9));
    }

    #[test]
    fn recovers_known_parameters_within_noise_and_intervals_cover_them() {
        let input = synthetic(&TRUE, 0.05, 9);
        let f = fit_with_intervals(&input, 500, 7).unwrap();
        let p = f.params;
        assert!(
            close(p.o, TRUE.o, 0.05) && close(p.g, TRUE.g, 0.05),
            "{p:?}"
        );
        assert!(
            close(p.big_g, TRUE.big_g, 0.05) && close(p.s, TRUE.s, 0.05),
            "{p:?}"
        );
        assert!(close(p.l, TRUE.l, 0.10), "{p:?}");
        for (iv, truth) in [
            (f.o, TRUE.o),
            (f.g, TRUE.g),
            (f.big_g, TRUE.big_g),
            (f.s, TRUE.s),
            (f.l, TRUE.l),
        ] {
            assert!(
                iv.lo <= truth * 1.02 && iv.hi >= truth * 0.98,
                "{iv:?} vs {truth}"
            );
            assert!(iv.lo <= iv.value && iv.value <= iv.hi, "{iv:?}");
            assert!(iv.half_width() > 0.0, "noise must show as width: {iv:?}");
        }
        assert_eq!(f.replicates.len(), 500);
        // Same seed, same intervals.
        let again = fit_with_intervals(&input, 500, 7).unwrap();
        assert_eq!(again.l, f.l);
    }

    #[test]
    fn fit_needs_two_large_sizes() {
        let mut input = synthetic(&TRUE, 0.0, 3);
        input.g_from = 1 << 20;
        assert_eq!(
            fit(&input),
            Err(FitError::TooFewLargeSizes {
                g_from: 1 << 20,
                have: 1
            })
        );
        let mut input = synthetic(&TRUE, 0.0, 3);
        input.gap.clear();
        assert_eq!(fit(&input), Err(FitError::Missing("message gap")));
        assert!(FitError::Missing("x").to_string().contains("no samples"));
    }

    #[test]
    fn dedicated_prediction_matches_the_formula() {
        // 2 ranks on 2 cores, direct: L + 2o + (P-1)·max(o,g) + P·n·G.
        let p = predict(&TRUE, PathKind::Direct, 2, 65_536, 2);
        let want = 1.5 + 0.4 + 0.35 + 2.0 * 65_536.0 / 8000.0;
        assert!(close(p.us, want, 1e-12), "{p:?}");
        assert_eq!(p.regime, Regime::Dedicated);
        assert!(close(p.seed_us, 1.5 + 0.4 + 65_536.0 / 8000.0, 1e-12));
    }

    #[test]
    fn time_sharing_takes_over_when_threads_outnumber_cores() {
        // 8 direct ranks on 2 cores: 8 · (s + 8 · (o + n·G)) / 2.
        let p = predict(&TRUE, PathKind::Direct, 8, 8, 2);
        let want = 8.0 * (9.0 + 8.0 * (0.2 + 8.0 / 8000.0)) / 2.0;
        assert!(close(p.shared_us, want, 1e-12), "{p:?}");
        assert_eq!(p.regime, Regime::TimeShared);
        assert!(close(p.us, want, 1e-12));
        // Offload paths: two threads per rank, so 2 ranks already share 2 cores.
        let q = predict(&TRUE, PathKind::Offload, 2, 8, 2);
        assert_eq!(q.regime, Regime::TimeShared);
        // (2 ranks · (s + 2o) + 2 helpers · (s + 2·(g + n·G))) / 2 cores.
        let want = (9.0 + 2.0 * 0.2) + (9.0 + 2.0 * (0.35 + 8.0 / 8000.0));
        assert!(close(q.shared_us, want, 1e-12), "{q:?}");
        // Plenty of cores: dedicated again.
        assert_eq!(
            predict(&TRUE, PathKind::Offload, 2, 8, 4).regime,
            Regime::Dedicated
        );
    }

    #[test]
    fn a_negative_latency_is_reported_but_not_predicted_with() {
        let p = Params { l: -0.5, ..TRUE };
        let a = predict(&p, PathKind::Direct, 2, 8, 2);
        let b = predict(&Params { l: 0.0, ..TRUE }, PathKind::Direct, 2, 8, 2);
        assert!(close(a.us, b.us, 1e-12));
    }

    #[test]
    fn prediction_intervals_come_from_replicates() {
        let f = fit_with_intervals(&synthetic(&TRUE, 0.05, 9), 200, 3).unwrap();
        let (p, iv) = predict_interval(&f, PathKind::Direct, 4, 4096, 2);
        assert!(iv.lo <= p.us && p.us <= iv.hi, "{p:?} {iv:?}");
        assert!(close(error_pct(110.0, 100.0), 10.0, 1e-12));
        assert!(close(error_pct(75.0, 100.0), -25.0, 1e-12));
    }

    proptest::proptest! {
        /// Predictions grow with the bytes per peer and with the rank
        /// count, and never fall below the dedicated-core time.
        #[test]
        fn predictions_are_monotone(ranks in 2usize..32, n in 1u64..(1 << 22), cores in 1usize..8,
                                    offload in proptest::bool::ANY) {
            let kind = if offload { PathKind::Offload } else { PathKind::Direct };
            let a = predict(&TRUE, kind, ranks, n, cores);
            let b = predict(&TRUE, kind, ranks, n * 2, cores);
            let c = predict(&TRUE, kind, ranks + 1, n, cores);
            proptest::prop_assert!(b.us >= a.us && c.us >= a.us);
            proptest::prop_assert!(a.us >= a.dedicated_us);
        }
    }
}
