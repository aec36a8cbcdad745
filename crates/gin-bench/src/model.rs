//! The LogGP model of the all-to-all, pure: fitting L, o, g, G (and what
//! sharing a CPU costs) from ping-pong, rate and one-CPU runs, resampling
//! them for intervals, and predicting the seed's all-to-all. `loggp` feeds
//! it measurements; the tests feed it synthetic data with known parameters.
//!
//! # Method
//!
//! - **o** (overhead): issue-side cost of one put + signal, the time inside
//!   the put calls of a window of puts, without the flush (from `rate`).
//! - **g** (gap): the interval between messages at the sustained put + signal
//!   rate, `1 / rate` (from `rate` with a window of puts in flight).
//! - **G** (gap per byte): the slope of the ping-pong half round trip versus
//!   size over the large sizes (least squares from `g_from` up).
//! - **L** (latency): the smallest ping-pong half round trip minus `2o` and
//!   its bytes times G: LogGP's `T(n) = L + 2o + n·G` solved for L.
//! - **s(k)** (a turn on a shared CPU): with k ranks of the all-to-all (8 B)
//!   on one CPU, the time per iteration divided by k: what one rank's turn
//!   costs when ranks take turns on a core. Also reported, not used: the
//!   8-byte ping-pong half round trip with both ranks on one CPU (one
//!   hand-off measured without the all-to-all).
//!
//! Medians over runs make each estimate; the intervals come from bootstrap
//! resampling of the runs of every measurement and refitting.
//!
//! # Prediction
//!
//! One iteration of the benchmark: each of P ranks puts n bytes with a
//! signal to every rank, itself included (P sends), waits for P signals and
//! flushes. A CPU rank issues its sends from one thread, one after another:
//! the direct path copies in the rank's thread, the proxy and soft NIC move
//! bytes in one helper thread per rank, and either way the sends of a rank
//! are serialised. With a core per rank (P ≤ C):
//!
//! `T_dedicated = L + 2o + (P − 1)·max(o, g) + P·n·G`
//!
//! (the seed's serial-proxy form `L + 2o + (P − 1)·n·G`, plus the gap between
//! serialised sends and the send to itself). With more ranks than cores,
//! each core runs k = ⌈P / C⌉ ranks in turn, and every rank needs a turn per
//! iteration:
//!
//! `T_shared = k · (s(k) + (P − k)·max(o, g) + P·n·G)`
//!
//! (s(k) was measured with k ranks sending k messages of 8 bytes; the rest is
//! the extra sends and bytes of P ranks). The prediction is the larger.

use serde::{Deserialize, Serialize};

use crate::stats::{Interval, Rng, line_fit, median};

/// What a fit takes: per-run samples, µs.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct FitInput {
    /// Ping-pong half round trips: (bytes, one median per run).
    pub pingpong: Vec<(u64, Vec<f64>)>,
    /// Issue-side µs per put, one per run.
    pub issue: Vec<f64>,
    /// µs per message at the sustained put + signal rate, one per run.
    pub gap: Vec<f64>,
    /// The 8-byte all-to-all with k ranks on one CPU: (k, µs per iteration
    /// per run).
    pub shared: Vec<(usize, Vec<f64>)>,
    /// Half round trip of an 8-byte ping-pong on one shared CPU, per run.
    pub handoff: Vec<f64>,
    /// G is fitted from this size up.
    pub g_from: u64,
}

/// LogGP parameters (µs; G in µs per byte) and the cost of sharing a CPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Params {
    pub l: f64,
    pub o: f64,
    pub g: f64,
    pub big_g: f64,
    /// (k, s(k)): one rank's turn with k ranks on a CPU, by k.
    pub turns: Vec<(usize, f64)>,
    /// The one-CPU ping-pong hand-off.
    pub handoff: f64,
}

/// Which cost of a turn on a shared CPU a prediction uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharing {
    /// s(k) measured with k ranks of the all-to-all on one CPU.
    Measured,
    /// The one-CPU ping-pong hand-off for every k (no all-to-all input).
    Handoff,
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

    /// s(k): measured where k was, linear in k between measured points, the
    /// nearest measured point beyond them; the hand-off if none was.
    pub fn turn(&self, k: usize, sharing: Sharing) -> f64 {
        if sharing == Sharing::Handoff || self.turns.is_empty() {
            return self.handoff;
        }
        let k = k as f64;
        let mut t: Vec<(f64, f64)> = self.turns.iter().map(|&(k, s)| (k as f64, s)).collect();
        t.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (first, last) = (t[0], t[t.len() - 1]);
        if k <= first.0 {
            return first.1;
        }
        if k >= last.0 {
            return last.1;
        }
        for w in t.windows(2) {
            let ((k0, s0), (k1, s1)) = (w[0], w[1]);
            if k >= k0 && k <= k1 {
                return s0 + (s1 - s0) * (k - k0) / (k1 - k0);
            }
        }
        last.1
    }
}

/// Why a fit could not be made.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
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
    let handoff = nonempty(pick(&input.handoff), "hand-off")?;
    let mut turns = Vec::with_capacity(input.shared.len());
    for (k, runs) in &input.shared {
        turns.push((
            *k,
            nonempty(pick(runs), "one-CPU all-to-all")? / (*k).max(1) as f64,
        ));
    }
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
        turns,
        handoff,
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
    /// (k, interval of s(k)).
    pub turns: Vec<(usize, Interval)>,
    pub handoff: Interval,
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
    let iv = |value: f64, f: &dyn Fn(&Params) -> f64| {
        Interval::from_replicates(value, &reps.iter().map(f).collect::<Vec<_>>())
    };
    let turns = params
        .turns
        .iter()
        .enumerate()
        .map(|(i, &(k, s))| {
            (
                k,
                iv(s, &|p: &Params| p.turns.get(i).map_or(f64::NAN, |t| t.1)),
            )
        })
        .collect();
    Ok(Fitted {
        l: iv(params.l, &|p| p.l),
        o: iv(params.o, &|p| p.o),
        g: iv(params.g, &|p| p.g),
        big_g: iv(params.big_g, &|p| p.big_g),
        handoff: iv(params.handoff, &|p| p.handoff),
        turns,
        params,
        replicates: reps,
    })
}

/// Which regime a prediction fell in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Regime {
    /// A core per rank.
    Dedicated,
    /// More ranks than cores: they take turns.
    TimeShared,
}

/// A predicted all-to-all iteration, µs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    pub us: f64,
    pub dedicated_us: f64,
    /// 0 when the ranks fit the cores.
    pub shared_us: f64,
    /// Ranks per core on the busiest core, ⌈P / C⌉.
    pub per_core: usize,
    pub regime: Regime,
    /// The seed's formula as written, `L + 2o + (P − 1)·n·G`, for comparison.
    pub seed_us: f64,
}

/// Predicts one iteration of the all-to-all for `ranks` ranks sending `n`
/// bytes to each rank on `cores` cores.
pub fn predict(p: &Params, sharing: Sharing, ranks: usize, n: u64, cores: usize) -> Prediction {
    let pr = ranks as f64;
    let n = n as f64;
    let l = p.l.max(0.0);
    let gap = p.o.max(p.g);
    let dedicated = l + 2.0 * p.o + (pr - 1.0) * gap + pr * n * p.big_g;
    let seed = l + 2.0 * p.o + (pr - 1.0) * n * p.big_g;
    let k = ranks.div_ceil(cores.max(1));
    let shared = if k >= 2 {
        let kf = k as f64;
        kf * (p.turn(k, sharing) + (pr - kf) * gap + pr * n * p.big_g)
    } else {
        0.0
    };
    Prediction {
        us: dedicated.max(shared),
        dedicated_us: dedicated,
        shared_us: shared,
        per_core: k,
        regime: if k >= 2 {
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
    sharing: Sharing,
    ranks: usize,
    n: u64,
    cores: usize,
) -> (Prediction, Interval) {
    let p = predict(&f.params, sharing, ranks, n, cores);
    let reps: Vec<f64> = f
        .replicates
        .iter()
        .map(|r| predict(r, sharing, ranks, n, cores).us)
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

    fn truth() -> Params {
        Params {
            l: 1.5,
            o: 0.2,
            g: 0.35,
            big_g: 1.0 / 8000.0, // 8 GB/s
            turns: vec![(2, 5.0), (4, 8.0), (8, 10.0)],
            handoff: 9.0,
        }
    }

    /// Samples of a measurement around `v`, with ±`noise` relative spread
    /// (a symmetric pattern plus a little jitter, so the median is `v`).
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
            shared: p
                .turns
                .iter()
                .map(|&(k, s)| (k, around(s * k as f64, noise, runs, &mut rng)))
                .collect(),
            handoff: around(p.handoff, noise, runs, &mut rng),
            g_from: 65_536,
        }
    }

    fn close(a: f64, b: f64, rel: f64) -> bool {
        (a - b).abs() <= rel * b.abs()
    }

    #[test]
    fn recovers_known_parameters_exactly_without_noise() {
        let t = truth();
        let f = fit(&synthetic(&t, 0.0, 5)).unwrap();
        assert!(close(f.l, t.l, 1e-9), "{f:?}");
        assert!(close(f.o, t.o, 1e-12));
        assert!(close(f.g, t.g, 1e-12));
        assert!(close(f.big_g, t.big_g, 1e-9));
        assert!(close(f.handoff, t.handoff, 1e-12));
        for (a, b) in f.turns.iter().zip(&t.turns) {
            assert_eq!(a.0, b.0);
            assert!(close(a.1, b.1, 1e-12), "{a:?} {b:?}");
        }
        assert!(close(f.g_gbps(), 8.0, 1e-9));
    }

    #[test]
    fn recovers_known_parameters_within_noise_and_intervals_cover_them() {
        let t = truth();
        let input = synthetic(&t, 0.05, 9);
        let f = fit_with_intervals(&input, 500, 7).unwrap();
        let p = &f.params;
        assert!(close(p.o, t.o, 0.05) && close(p.g, t.g, 0.05), "{p:?}");
        assert!(close(p.big_g, t.big_g, 0.05) && close(p.handoff, t.handoff, 0.05));
        assert!(close(p.l, t.l, 0.10), "{p:?}");
        let mut checks = vec![
            (f.o, t.o),
            (f.g, t.g),
            (f.big_g, t.big_g),
            (f.handoff, t.handoff),
            (f.l, t.l),
        ];
        checks.extend(f.turns.iter().zip(&t.turns).map(|(a, b)| (a.1, b.1)));
        for (iv, truth) in checks {
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
    fn fit_needs_two_large_sizes_and_every_measurement() {
        let mut input = synthetic(&truth(), 0.0, 3);
        input.g_from = 1 << 20;
        assert_eq!(
            fit(&input),
            Err(FitError::TooFewLargeSizes {
                g_from: 1 << 20,
                have: 1
            })
        );
        let mut input = synthetic(&truth(), 0.0, 3);
        input.gap.clear();
        assert_eq!(fit(&input), Err(FitError::Missing("message gap")));
        assert!(FitError::Missing("x").to_string().contains("no samples"));
    }

    #[test]
    fn turns_interpolate_between_measured_ranks_per_core() {
        let t = truth();
        assert!(close(t.turn(2, Sharing::Measured), 5.0, 1e-12));
        assert!(close(t.turn(3, Sharing::Measured), 6.5, 1e-12));
        assert!(close(t.turn(6, Sharing::Measured), 9.0, 1e-12));
        assert!(close(t.turn(1, Sharing::Measured), 5.0, 1e-12));
        assert!(close(t.turn(16, Sharing::Measured), 10.0, 1e-12));
        assert!(close(t.turn(4, Sharing::Handoff), 9.0, 1e-12));
        let none = Params { turns: vec![], ..t };
        assert!(close(none.turn(4, Sharing::Measured), 9.0, 1e-12));
    }

    #[test]
    fn dedicated_prediction_matches_the_formula() {
        // 2 ranks on 2 cores: L + 2o + (P-1)·max(o,g) + P·n·G.
        let p = predict(&truth(), Sharing::Measured, 2, 65_536, 2);
        let want = 1.5 + 0.4 + 0.35 + 2.0 * 65_536.0 / 8000.0;
        assert!(close(p.us, want, 1e-12), "{p:?}");
        assert_eq!((p.regime, p.per_core), (Regime::Dedicated, 1));
        assert!(close(p.seed_us, 1.5 + 0.4 + 65_536.0 / 8000.0, 1e-12));
    }

    #[test]
    fn time_sharing_takes_over_when_ranks_outnumber_cores() {
        // 8 ranks on 2 cores: k = 4 per core, 4 · (s(4) + 4·max(o,g) + 8·n·G).
        let p = predict(&truth(), Sharing::Measured, 8, 8, 2);
        let want = 4.0 * (8.0 + 4.0 * 0.35 + 8.0 * 8.0 / 8000.0);
        assert!(close(p.shared_us, want, 1e-12), "{p:?}");
        assert_eq!((p.regime, p.per_core), (Regime::TimeShared, 4));
        assert!(close(p.us, want, 1e-12));
        // 3 ranks on 2 cores: the busier core has 2.
        let q = predict(&truth(), Sharing::Measured, 3, 8, 2);
        assert_eq!(q.per_core, 2);
        assert!(close(
            q.shared_us,
            2.0 * (5.0 + 0.35 + 3.0 * 8.0 / 8000.0),
            1e-12
        ));
        // The hand-off variant uses the ping-pong's figure.
        let h = predict(&truth(), Sharing::Handoff, 8, 8, 2);
        assert!(close(
            h.shared_us,
            4.0 * (9.0 + 4.0 * 0.35 + 8.0 * 8.0 / 8000.0),
            1e-12
        ));
        // Plenty of cores: dedicated again.
        assert_eq!(
            predict(&truth(), Sharing::Measured, 8, 8, 8).regime,
            Regime::Dedicated
        );
    }

    #[test]
    fn a_negative_latency_is_reported_but_not_predicted_with() {
        let a = predict(&Params { l: -0.5, ..truth() }, Sharing::Measured, 2, 8, 2);
        let b = predict(&Params { l: 0.0, ..truth() }, Sharing::Measured, 2, 8, 2);
        assert!(close(a.us, b.us, 1e-12));
    }

    #[test]
    fn prediction_intervals_come_from_replicates() {
        let f = fit_with_intervals(&synthetic(&truth(), 0.05, 9), 200, 3).unwrap();
        let (p, iv) = predict_interval(&f, Sharing::Measured, 4, 4096, 2);
        assert!(iv.lo <= p.us && p.us <= iv.hi, "{p:?} {iv:?}");
        assert!(close(error_pct(110.0, 100.0), 10.0, 1e-12));
        assert!(close(error_pct(75.0, 100.0), -25.0, 1e-12));
    }

    proptest::proptest! {
        /// Predictions grow with the bytes per peer, never fall below the
        /// dedicated-core time, and the busiest core holds ⌈P / C⌉ ranks.
        #[test]
        fn predictions_are_monotone_in_size(ranks in 1usize..64, n in 1u64..(1 << 22),
                                            cores in 1usize..8, handoff in proptest::bool::ANY) {
            let sharing = if handoff { Sharing::Handoff } else { Sharing::Measured };
            let a = predict(&truth(), sharing, ranks, n, cores);
            let b = predict(&truth(), sharing, ranks, n * 2, cores);
            proptest::prop_assert!(b.us >= a.us);
            proptest::prop_assert!(a.us >= a.dedicated_us);
            proptest::prop_assert!(a.per_core * cores >= ranks && (a.per_core - 1) * cores < ranks);
        }
    }
}
