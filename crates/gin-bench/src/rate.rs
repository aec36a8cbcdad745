//! `gin-bench rate`: small-message rate from rank 0 to rank 1, messages per
//! second, for plain puts (one signal after the run's last flush) and for
//! put + signal (every put signals), with a window of puts in flight before
//! each flush. Also reports the issue-side cost per put (time inside the put
//! calls, without the flush): LogGP's `o`, where `1 / rate` is its `g`.
//! The floor is the same traffic without gin-rs, in the same job: 8-byte
//! stores into a segment shared by the two processes (plus an atomic add per
//! message for put + signal), or one raw TCP write per message for tcp.

use anyhow::Result;
use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};

use crate::common::{Common, human_size};
use crate::progress::Progress;
use crate::ranks;
use crate::report::{Report, Table};
use crate::stream::{Completion, Point, StreamResult};

/// Which operation a rate run issues.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    /// Plain puts.
    Put,
    /// Put with a signal increment at the target.
    Signal,
}

#[derive(Debug, Clone, Args, Serialize, Deserialize)]
#[command(
    mut_arg("ranks", |a| a.default_value("2").required(false)),
    mut_arg("sizes", |a| a.default_value("8").required(false)),
    mut_arg("iters", |a| a
        .default_value("20000")
        .required(false)
        .help("Messages per run (rounded up to whole windows)")),
    mut_arg("runs", |a| a.default_value("5").required(false)),
)]
pub struct RateArgs {
    #[command(flatten)]
    #[serde(flatten)]
    pub common: Common,
    /// Puts in flight before each flush (comma separated).
    #[arg(long, value_delimiter = ',', default_value = "1,16,128")]
    pub window: Vec<usize>,
    /// Operations (comma separated): put, signal (put + signal).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "put,signal")]
    pub op: Vec<Op>,
}

impl RateArgs {
    fn points(&self) -> Vec<Point> {
        let c = &self.common;
        let mut out = Vec::new();
        for &op in &self.op {
            for &window in &self.window {
                for &size in &c.sizes {
                    let windows = c.iters.div_ceil(window).max(1);
                    out.push(Point {
                        size,
                        window,
                        windows,
                        bidir: false,
                        completion: match op {
                            Op::Put => Completion::AtEnd,
                            Op::Signal => Completion::PerMessage,
                        },
                        warmup_windows: c.warmup_for(windows),
                        runs: c.runs,
                        footprint: crate::layout::STREAM_BUFFER,
                    });
                }
            }
        }
        out
    }
}

pub fn run(args: &RateArgs) -> Result<()> {
    let c = &args.common;
    c.validate("rate")?;
    let nranks = c.one_rank_count("rate")?;
    if args.window.contains(&0) || args.window.is_empty() || args.op.is_empty() {
        anyhow::bail!("--window needs positive puts in flight and --op at least one operation");
    }
    if ranks::is_rank() {
        crate::common::apply_affinity(&c.cpus)?;
        return crate::stream::rank_main(c, &args.points());
    }
    let r = measure(args, nranks)?;
    let table = table(&r);
    Report::new("rate", args, vec![table], r)?.finish(c.json.as_deref(), c.csv.as_deref())
}

/// Runs the job and returns rank 0's result.
pub fn measure(args: &RateArgs, nranks: usize) -> Result<StreamResult> {
    let points = args.points();
    let units = (points.len() * args.common.runs) as u64;
    let progress = Progress::new(units, "rate");
    progress.println(&format!(
        "rate: {nranks} ranks, {} points x {} runs of {} messages, path {}...",
        points.len(),
        args.common.runs,
        args.common.iters,
        args.common.path_label()
    ));
    let r = progress.job(units, |mut env| {
        env.extend(args.common.env());
        ranks::spawn_self(nranks, "rate", args, &env)
    });
    progress.finish();
    r
}

fn table(r: &StreamResult) -> Table {
    let mut t = Table::new(
        "rate",
        format!(
            "message rate, {} ranks, backend {}, path rank 0 -> 1: {}; floor: {}",
            r.ranks, r.backend, r.path, r.floor
        ),
        &[
            "op",
            "size",
            "window",
            "Mmsg/s",
            "µs/msg",
            "p10",
            "p90",
            "p99",
            "issue µs/put",
            "floor Mmsg/s",
            "vs floor",
        ],
    );
    for p in &r.points {
        let row = &p.row;
        t.row(vec![
            match p.completion {
                Completion::PerMessage => "put+signal",
                _ => "put",
            }
            .to_owned(),
            human_size(p.bytes),
            p.window.to_string(),
            format!("{:.3}", row.ops_per_s() / 1e6),
            format!("{:.4}", row.us.median),
            format!("{:.4}", row.us.p10),
            format!("{:.4}", row.us.p90),
            format!("{:.4}", row.us.p99),
            p.issue_us
                .map_or_else(|| "-".to_owned(), |s| format!("{:.4}", s.median)),
            format!("{:.3}", row.floor_ops_per_s() / 1e6),
            format!("{:.2}x", row.ops_per_s() / row.floor_ops_per_s().max(1e-12)),
        ]);
    }
    t.note(
        "rate at the median over runs; µs per message with p10/p90/p99 over runs; issue = time inside \
         put calls per put, windows of 8 or more only; vs floor = rate / floor rate",
    );
    t
}
