//! `gin-bench loggp`: fits LogGP parameters for one path (backend and
//! transport) from ping-pong and rate runs, predicts the all-to-all for each
//! rank count and size, and compares with the all-to-all measured in the
//! same invocation. The method and the model are in [`crate::model`] and
//! `docs/loggp.md`.
//!
//! Five jobs, each one of the other subcommands run with options built here:
//! 1. `pingpong` over `--fit-sizes`: L and G;
//! 2. `rate` of put + signal with `--window` puts in flight: o and g;
//! 3. `alltoall` at 8 B with k ranks on CPU 0, for every k = ⌈P / C⌉ ≥ 2 the
//!    predictions need: s(k), what a rank's turn on a shared core costs;
//! 4. `pingpong` at 8 B with both ranks on CPU 0: the plain hand-off,
//!    reported to show why s(k) is measured rather than taken from it;
//! 5. `alltoall` over `--ranks` and `--sizes`: what the model must predict.

use anyhow::{Context, Result, bail};
use clap::Args;
use serde::{Deserialize, Serialize};

use crate::alltoall::{AlltoallArgs, RankCountResult};
use crate::common::{Backend, Common, Transport, human_size, parse_size};
use crate::model::{self, FitInput, Fitted, Prediction, Regime, Sharing};
use crate::pingpong::{PingPongArgs, PingPongResult};
use crate::rate::{Op, RateArgs};
use crate::report::{Report, Table};
use crate::stats::{Interval, Summary};
use crate::stream::StreamResult;

#[derive(Debug, Clone, Args, Serialize, Deserialize)]
#[command(
    mut_arg("ranks", |a| a
        .default_value("2,3,4,6,8,12,16")
        .required(false)
        .help("All-to-all rank counts to predict and measure (comma separated)")),
    mut_arg("sizes", |a| a
        .default_value("8,4k,64k")
        .required(false)
        .help("All-to-all bytes per peer (comma separated; k / m suffixes allowed)")),
    mut_arg("iters", |a| a
        .default_value("500")
        .required(false)
        .help("Iterations per run of the ping-pongs and all-to-alls at 64 KiB and below")),
    mut_arg("runs", |a| a.default_value("5").required(false)),
)]
pub struct LoggpArgs {
    #[command(flatten)]
    #[serde(flatten)]
    pub common: Common,
    /// Ping-pong sizes the fit uses (L from the smallest, G from --g-from up).
    #[arg(long, value_delimiter = ',', value_parser = parse_size, default_value = "8,64,512,4k,64k,256k,1m")]
    pub fit_sizes: Vec<u64>,
    /// G is the slope of the half round trip versus size from this size up.
    #[arg(long, value_parser = parse_size, default_value = "64k")]
    pub g_from: u64,
    /// Puts in flight in the rate run that gives o and g.
    #[arg(long, default_value_t = 64)]
    pub window: usize,
    /// Messages per run of the rate job.
    #[arg(long, default_value_t = 20_000)]
    pub rate_messages: usize,
    /// Bootstrap replicates for the 95 % intervals.
    #[arg(long, default_value_t = 1000)]
    pub resamples: usize,
    /// Cores the time-sharing model assumes (default: the CPUs this process may use).
    #[arg(long)]
    pub cores: Option<usize>,
}

/// One row of the comparison.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PredRow {
    pub ranks: usize,
    pub bytes: u64,
    pub prediction: Prediction,
    /// 95 % interval of the prediction over the bootstrap replicates.
    pub interval: Interval,
    /// Measured µs per iteration over runs.
    pub measured: Summary,
    pub error_pct: f64,
    /// The same prediction with the ping-pong hand-off for every s(k).
    pub handoff_us: f64,
    pub handoff_error_pct: f64,
    pub seed_error_pct: f64,
    /// Bytes all ranks' send and receive buffers span: `2 · P² · n`.
    pub working_set: u64,
    /// Whether the model's assumptions hold: the working set is within
    /// what the ping-pong that gave G touched (`4 ·` its largest size: two
    /// ranks, each a source and a window), so G applies.
    pub assumptions_hold: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LoggpResult {
    /// `backend/transport` as asked.
    pub path: String,
    /// How rank 0 reached rank 1 in the ping-pong.
    pub backend: String,
    pub cores: usize,
    /// Largest working set G was measured on (see `PredRow`).
    pub cache_range: u64,
    /// The machine's last-level cache (sysfs), for reference; 0 if unknown.
    pub llc_bytes: u64,
    pub input: FitInput,
    pub fitted: Fitted,
    pub predictions: Vec<PredRow>,
    pub pingpong: PingPongResult,
    pub rate: StreamResult,
    pub shared: Vec<RankCountResult>,
    pub handoff: PingPongResult,
    pub alltoall: Vec<RankCountResult>,
}

/// The largest CPU cache this machine reports (sysfs), bytes; 0 if unknown.
fn llc_bytes() -> u64 {
    let mut best = (0u32, 0u64);
    for i in 0..8 {
        let dir = format!("/sys/devices/system/cpu/cpu0/cache/index{i}");
        let read = |f: &str| std::fs::read_to_string(format!("{dir}/{f}")).ok();
        let (Some(level), Some(size)) = (read("level"), read("size")) else {
            continue;
        };
        let level: u32 = level.trim().parse().unwrap_or(0);
        let size = size.trim();
        let bytes = if let Some(k) = size.strip_suffix('K') {
            k.parse::<u64>().unwrap_or(0) << 10
        } else if let Some(m) = size.strip_suffix('M') {
            m.parse::<u64>().unwrap_or(0) << 20
        } else {
            size.parse().unwrap_or(0)
        };
        if level > best.0 {
            best = (level, bytes);
        }
    }
    best.1
}

/// Options for a sub-job: this invocation's, with what the job needs.
fn sub_common(c: &Common, ranks: Vec<usize>, sizes: Vec<u64>) -> Common {
    Common {
        ranks,
        sizes,
        json: None,
        csv: None,
        cpus: Vec::new(),
        ..c.clone()
    }
}

// A benchmark binary's driver (the library limit of 120 lines is for
// library code): its phases read in order here.
#[allow(clippy::too_many_lines)]
pub fn run(args: &LoggpArgs) -> Result<()> {
    let c = &args.common;
    c.validate("loggp")?;
    if crate::ranks::is_rank() {
        bail!("loggp starts its own jobs: run it without a launcher");
    }
    if args.fit_sizes.iter().filter(|&&n| n >= args.g_from).count() < 2 {
        bail!(
            "--fit-sizes needs two or more sizes of at least --g-from {} to fit G",
            human_size(args.g_from)
        );
    }
    if args.window == 0 || args.rate_messages == 0 {
        bail!("--window and --rate-messages must be positive");
    }
    let cores = args
        .cores
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from));
    eprintln!("loggp: path {}, {cores} cores", c.path_label());

    // 1. Ping-pong for L and G.
    let mut fit_sizes = args.fit_sizes.clone();
    fit_sizes.sort_unstable();
    fit_sizes.dedup();
    let cache_range = 4 * fit_sizes.last().copied().unwrap_or(0);
    let pp_args = PingPongArgs {
        common: sub_common(c, vec![2], fit_sizes),
    };
    let pingpong = crate::pingpong::measure(&pp_args, 2)?;
    // 2. The put + signal rate for o and g.
    let rate_args = RateArgs {
        common: Common {
            iters: args.rate_messages,
            ..sub_common(c, vec![2], vec![8])
        },
        window: vec![args.window],
        op: vec![Op::Signal],
    };
    let rate = crate::rate::measure(&rate_args, 2)?;
    // 3. s(k): k ranks of the 8-byte all-to-all on one CPU, helpers too.
    let mut per_core: Vec<usize> = c
        .ranks
        .iter()
        .map(|p| p.div_ceil(cores))
        .filter(|&k| k >= 2)
        .collect();
    per_core.sort_unstable();
    per_core.dedup();
    let shared = if per_core.is_empty() {
        Vec::new()
    } else {
        crate::alltoall::measure(&AlltoallArgs {
            common: Common {
                cpus: vec![0],
                ..sub_common(c, per_core, vec![8])
            },
        })?
    };
    // 4. The plain hand-off: the direct path, both ranks on CPU 0.
    let handoff = crate::pingpong::measure(
        &PingPongArgs {
            common: Common {
                backend: Some(Backend::Auto),
                transport: Some(Transport::Shm),
                cpus: vec![0],
                ..sub_common(c, vec![2], vec![8])
            },
        },
        2,
    )?;
    // 5. The all-to-all to predict.
    let alltoall = crate::alltoall::measure(&AlltoallArgs {
        common: sub_common(c, c.ranks.clone(), c.sizes.clone()),
    })?;

    let point = rate
        .points
        .first()
        .context("the rate job returned no point")?;
    let input = FitInput {
        pingpong: pingpong
            .sizes
            .iter()
            .map(|s| (s.bytes, s.row.runs.clone()))
            .collect(),
        issue: point.issue_runs.clone(),
        gap: point.row.runs.clone(),
        shared: shared
            .iter()
            .filter_map(|r| r.sizes.first().map(|s| (r.ranks, s.row.runs.clone())))
            .collect(),
        handoff: handoff
            .sizes
            .first()
            .map(|s| s.row.runs.clone())
            .unwrap_or_default(),
        g_from: args.g_from,
    };
    let fitted = model::fit_with_intervals(&input, args.resamples, 0x6c6f_6767)
        .map_err(|e| anyhow::anyhow!("fitting LogGP for {}: {e}", c.path_label()))?;
    let mut predictions = Vec::new();
    for r in &alltoall {
        for s in &r.sizes {
            let (prediction, interval) =
                model::predict_interval(&fitted, Sharing::Measured, r.ranks, s.bytes, cores);
            let plain = model::predict(&fitted.params, Sharing::Handoff, r.ranks, s.bytes, cores);
            let working_set = 2 * (r.ranks * r.ranks) as u64 * s.bytes;
            predictions.push(PredRow {
                ranks: r.ranks,
                bytes: s.bytes,
                error_pct: model::error_pct(prediction.us, s.row.us.median),
                handoff_us: plain.us,
                handoff_error_pct: model::error_pct(plain.us, s.row.us.median),
                seed_error_pct: model::error_pct(prediction.seed_us, s.row.us.median),
                prediction,
                interval,
                measured: s.row.us,
                working_set,
                assumptions_hold: working_set <= cache_range,
            });
        }
    }
    let result = LoggpResult {
        path: c.path_label(),
        backend: pingpong.backend.clone(),
        cores,
        cache_range,
        llc_bytes: llc_bytes(),
        input,
        fitted,
        predictions,
        pingpong,
        rate,
        shared,
        handoff,
        alltoall,
    };
    let tables = vec![prediction_table(&result), params_table(&result)];
    Report::new("loggp", args, tables, result)?.finish(c.json.as_deref(), c.csv.as_deref())
}

fn with_interval(iv: &Interval, scale: f64, digits: usize) -> String {
    format!(
        "{:.d$} [{:.d$}, {:.d$}]",
        iv.value * scale,
        iv.lo * scale,
        iv.hi * scale,
        d = digits
    )
}

fn params_table(r: &LoggpResult) -> Table {
    let f = &r.fitted;
    let mut t = Table::new(
        "params",
        format!(
            "LogGP parameters, path {} ({}), value [95 % bootstrap interval]",
            r.path, r.backend
        ),
        &[
            "path",
            "L µs",
            "o µs",
            "g µs",
            "G ns/KiB",
            "1/G GB/s",
            "s(k) µs",
            "hand-off µs",
        ],
    );
    let turns: Vec<String> = f
        .turns
        .iter()
        .map(|(k, iv)| format!("k={k}: {}", with_interval(iv, 1.0, 2)))
        .collect();
    t.row(vec![
        r.path.clone(),
        with_interval(&f.l, 1.0, 3),
        with_interval(&f.o, 1.0, 4),
        with_interval(&f.g, 1.0, 4),
        with_interval(&f.big_g, 1024.0 * 1e3, 2),
        format!("{:.2}", f.params.g_gbps()),
        if turns.is_empty() {
            "-".to_owned()
        } else {
            turns.join("; ")
        },
        with_interval(&f.handoff, 1.0, 2),
    ]);
    t.note(
        "o: issue cost per put + signal; g: 1 / sustained put + signal rate; G: slope of the \
         ping-pong half round trip over the large sizes; L: smallest half round trip - 2o - n·G; \
         s(k): per-rank turn of the 8-byte all-to-all with k ranks on one CPU; hand-off: 8-byte \
         ping-pong half round trip with both ranks on one CPU (direct path)",
    );
    t
}

fn prediction_table(r: &LoggpResult) -> Table {
    let mut t = Table::new(
        "predictions",
        format!(
            "all-to-all: LogGP prediction versus measurement, path {} ({}), {} cores",
            r.path, r.backend, r.cores
        ),
        &[
            "ranks",
            "size",
            "ranks/core",
            "predicted µs",
            "measured µs",
            "p10–p90",
            "error",
            "hand-off s",
            "seed form µs",
            "seed error",
            "assumptions",
        ],
    );
    for p in &r.predictions {
        t.row(vec![
            p.ranks.to_string(),
            human_size(p.bytes),
            match p.prediction.regime {
                Regime::Dedicated => "1 (dedicated)".to_owned(),
                Regime::TimeShared => p.prediction.per_core.to_string(),
            },
            format!(
                "{:.2} [{:.2}, {:.2}]",
                p.prediction.us, p.interval.lo, p.interval.hi
            ),
            format!("{:.2}", p.measured.median),
            format!("{:.2}–{:.2}", p.measured.p10, p.measured.p90),
            format!("{:+.0}%", p.error_pct),
            format!("{:.2} ({:+.0}%)", p.handoff_us, p.handoff_error_pct),
            format!("{:.2}", p.prediction.seed_us),
            format!("{:+.0}%", p.seed_error_pct),
            if p.assumptions_hold {
                "hold".to_owned()
            } else {
                format!(
                    "working set {} > {}",
                    human_size(p.working_set),
                    human_size(r.cache_range)
                )
            },
        ]);
    }
    let held: Vec<&PredRow> = r
        .predictions
        .iter()
        .filter(|p| p.assumptions_hold)
        .collect();
    let within = held.iter().filter(|p| p.error_pct.abs() <= 25.0).count();
    t.note(format!(
        "{within} of {} rows where the assumptions hold are within ±25 %; median |error| there {:.0} %",
        held.len(),
        crate::stats::median(&held.iter().map(|p| p.error_pct.abs()).collect::<Vec<_>>())
    ));
    t.note(
        "predicted = max(dedicated, time-shared) with its 95 % bootstrap interval; hand-off s = the \
         same with the one-CPU ping-pong hand-off in place of s(k); seed form = L + 2o + (P-1)·n·G as \
         the seed writes it; working set = 2·P²·n, compared with what the G fit touched",
    );
    t
}
