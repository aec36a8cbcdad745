//! `gin-bench bandwidth`: streams of puts from rank 0 to rank 1 (uni) and
//! both ways at once (bi), for message size x window (puts in flight before
//! each flush). The last put of each window carries a signal; the receiver
//! waits for the run's last one, acknowledges, and checks what it received.
//! GB/s is bytes delivered per second (both directions added for bi). The
//! floor is the same traffic without gin-rs, in the same job: a raw copy into
//! a segment shared by the two processes (shm and direct paths) or a raw TCP
//! stream (tcp).

use anyhow::Result;
use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};

use crate::common::{Common, human_size};
use crate::progress::Progress;
use crate::ranks;
use crate::report::{Report, Table};
use crate::stream::{Completion, Point, StreamResult};

/// Direction of a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dir {
    /// Rank 0 -> rank 1.
    Uni,
    /// Both ways at once.
    Bi,
}

#[derive(Debug, Clone, Args, Serialize, Deserialize)]
#[command(
    mut_arg("ranks", |a| a.default_value("2").required(false)),
    mut_arg("sizes", |a| a.default_value("64,4k,64k,1m,4m").required(false)),
    mut_arg("iters", |a| a
        .default_value("1000")
        .required(false)
        .help("Windows per run while a window is at most 64 KiB (fewer above, at least 2)")),
    mut_arg("runs", |a| a.default_value("5").required(false)),
)]
pub struct BandwidthArgs {
    #[command(flatten)]
    #[serde(flatten)]
    pub common: Common,
    /// Puts in flight before each flush (comma separated).
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    pub window: Vec<usize>,
    /// Directions (comma separated).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "uni,bi")]
    pub dir: Vec<Dir>,
    /// Bytes the destination (and source) slots of one direction span
    /// (k / m suffixes allowed): a window's puts land in distinct slots
    /// while they fit, else slots are reused round-robin. `--footprint` of
    /// one message size makes every put rewrite one buffer, as
    /// `ucx_perftest` does (an equal-footprint comparison with its floor).
    #[arg(long, value_parser = crate::common::parse_size, default_value = "16m")]
    #[serde(default = "default_footprint")]
    pub footprint: u64,
}

fn default_footprint() -> u64 {
    crate::layout::STREAM_BUFFER
}

impl BandwidthArgs {
    fn points(&self) -> Vec<Point> {
        let c = &self.common;
        let mut out = Vec::new();
        for &dir in &self.dir {
            for &window in &self.window {
                for &size in &c.sizes {
                    let windows = ranks::windows_for(c.iters, size * window as u64);
                    out.push(Point {
                        size,
                        window,
                        windows,
                        bidir: dir == Dir::Bi,
                        completion: Completion::PerWindow,
                        warmup_windows: c.warmup_for(windows),
                        runs: c.runs,
                        footprint: self.footprint,
                    });
                }
            }
        }
        out
    }
}

pub fn run(args: &BandwidthArgs) -> Result<()> {
    let c = &args.common;
    c.validate("bandwidth")?;
    let nranks = c.one_rank_count("bandwidth")?;
    if args.window.contains(&0) || args.window.is_empty() || args.dir.is_empty() {
        anyhow::bail!("--window needs positive puts in flight and --dir at least one direction");
    }
    if ranks::is_rank() {
        crate::common::apply_affinity(&c.cpus)?;
        return crate::stream::rank_main(c, &args.points());
    }
    let r = measure(args, nranks)?;
    let table = table(&r);
    Report::new("bandwidth", args, vec![table], r)?.finish(c.json.as_deref(), c.csv.as_deref())
}

/// Runs the job and returns rank 0's result.
pub fn measure(args: &BandwidthArgs, nranks: usize) -> Result<StreamResult> {
    let points = args.points();
    let units = (points.len() * args.common.runs) as u64;
    let progress = Progress::new(units, "bandwidth");
    progress.println(&format!(
        "bandwidth: {nranks} ranks, {} points x {} runs, path {}...",
        points.len(),
        args.common.runs,
        args.common.path_label()
    ));
    let r = progress.job(units, |mut env| {
        env.extend(args.common.env());
        ranks::spawn_self(nranks, "bandwidth", args, &env)
    });
    progress.finish();
    r
}

fn table(r: &StreamResult) -> Table {
    let mut t = Table::new(
        "bandwidth",
        format!(
            "put bandwidth, {} ranks, backend {}, path rank 0 -> 1: {}; floor: {}",
            r.ranks, r.backend, r.path, r.floor
        ),
        &[
            "dir",
            "size",
            "window",
            "GB/s",
            "µs/msg",
            "p10",
            "p90",
            "p99",
            "floor GB/s",
            "vs floor",
        ],
    );
    for p in &r.points {
        let row = &p.row;
        let bw = |us: f64| crate::stats::gbps(row.bytes, us);
        t.row(vec![
            if p.bidir { "bi" } else { "uni" }.to_owned(),
            human_size(p.bytes),
            p.window.to_string(),
            format!("{:.3}", row.gbps),
            format!("{:.3}", row.us.median),
            format!("{:.3}", row.us.p10),
            format!("{:.3}", row.us.p90),
            format!("{:.3}", row.us.p99),
            format!("{:.3}", bw(row.floor_us.median)),
            format!("{:.2}x", row.gbps / bw(row.floor_us.median).max(1e-12)),
        ]);
    }
    t.note(format!(
        "GB/s at the median over runs; µs per message with p10/p90/p99 over runs; bi adds both directions; \
         vs floor = GB/s / floor GB/s; peak memory per rank {} MiB",
        r.peak_kib
            .iter()
            .map(|k| format!("{:.1}", *k as f64 / 1024.0))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    t
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

    use clap::Parser;

    use super::*;
    use crate::layout::{STREAM_BUFFER, Slots};

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        bw: BandwidthArgs,
    }

    fn points(args: &[&str]) -> Vec<Point> {
        let argv = std::iter::once("bandwidth").chain(args.iter().copied());
        Cli::try_parse_from(argv).unwrap().bw.points()
    }

    /// By default a window's puts land in distinct slots within 16 MiB;
    /// `--footprint` of one message makes them all rewrite one buffer, as
    /// `ucx_perftest`'s do; a footprint that is not a size is refused.
    #[test]
    fn footprint_caps_the_slots_a_window_spans() {
        let slots = |p: &Point| Slots::new(p.size, p.window, p.footprint);
        let by_default = points(&["--sizes", "1m", "--window", "16"]);
        assert_eq!(by_default[0].footprint, STREAM_BUFFER);
        assert_eq!(slots(&by_default[0]).count, 16);
        let one = points(&["--sizes", "1m", "--window", "16", "--footprint", "1m"]);
        assert_eq!(one[0].footprint, 1 << 20);
        assert_eq!(slots(&one[0]).count, 1);
        let argv = ["bandwidth", "--footprint", "lots"];
        assert!(Cli::try_parse_from(argv).is_err());
    }
}
