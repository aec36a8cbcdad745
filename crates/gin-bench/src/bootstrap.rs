//! `gin-bench bootstrap`: latency of the host collectives versus rank count.
//!
//! Each rank runs every collective `iters` times per run, for `runs` runs,
//! with a barrier between runs; rank 0's per-operation mean of each run is
//! one sample. The floor, measured in the same job, is a tagged point-to-point
//! ping-pong between ranks 0 and 1: the cost of one hop. A ring allgather needs
//! n − 1 dependent hops, so `allgather / ((n − 1) · hop)` says how close the
//! collective comes to its data dependencies.

use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use gin_bootstrap::Bootstrap;
use serde::{Deserialize, Serialize};

use crate::ranks;
use crate::report::{Report, Table};
use crate::stats::Summary;

#[derive(Debug, Clone, Args, Serialize, Deserialize)]
pub struct BootstrapArgs {
    /// Rank counts to measure (comma separated).
    #[arg(long, value_delimiter = ',', default_value = "2,4,8")]
    pub ranks: Vec<usize>,
    /// Iterations of each collective per run.
    #[arg(long, default_value_t = 200)]
    pub iters: usize,
    /// Runs (each one sample of the per-iteration mean).
    #[arg(long, default_value_t = 7)]
    pub runs: usize,
    /// Bytes each rank contributes to allgather / sends to each peer in all-to-all.
    #[arg(long, default_value_t = 8)]
    pub bytes: usize,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    /// Also write the table as CSV to this file.
    #[arg(long)]
    pub csv: Option<std::path::PathBuf>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OpResult {
    pub op: String,
    /// Microseconds per operation.
    pub us: Summary,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RankCountResult {
    pub ranks: usize,
    pub bytes: usize,
    pub ops: Vec<OpResult>,
    /// Half round trip of a tagged send/recv between ranks 0 and 1 (µs); None for 1 rank.
    pub hop_us: Option<Summary>,
}

/// Entry point for both roles.
pub fn run(args: &BootstrapArgs) -> Result<()> {
    if ranks::is_rank() {
        return rank_main(args);
    }
    let mut results = Vec::new();
    for &n in &args.ranks {
        eprintln!(
            "bootstrap: measuring {n} ranks ({} runs x {} iterations)...",
            args.runs, args.iters
        );
        let r: RankCountResult = ranks::spawn_self(n, "bootstrap", args, &[])?;
        results.push(r);
    }
    let t = table(&results);
    Report::new("bootstrap", args, vec![t], results)?
        .finish(args.json.as_deref(), args.csv.as_deref())
}

fn table(results: &[RankCountResult]) -> Table {
    let mut t = Table::new(
        "bootstrap",
        "host bootstrap collectives",
        &["ranks", "op", "median µs", "p10", "p90", "vs hop floor"],
    );
    for r in results {
        if let Some(h) = r.hop_us {
            t.row(vec![
                r.ranks.to_string(),
                "p2p hop".to_owned(),
                format!("{:.2}", h.median),
                format!("{:.2}", h.p10),
                format!("{:.2}", h.p90),
                "1.00x".to_owned(),
            ]);
        }
        for op in &r.ops {
            // The dependent hops each collective needs at best.
            let hops = match op.op.as_str() {
                "allgather" | "alltoall" => (r.ranks - 1) as f64,
                _ => (r.ranks as f64).log2().ceil(),
            };
            let ratio = match r.hop_us {
                Some(h) if hops > 0.0 => format!("{:.2}x", op.us.median / (hops * h.median)),
                _ => "-".to_owned(),
            };
            t.row(vec![
                r.ranks.to_string(),
                op.op.clone(),
                format!("{:.2}", op.us.median),
                format!("{:.2}", op.us.p10),
                format!("{:.2}", op.us.p90),
                ratio,
            ]);
        }
    }
    t.note(
        "ratio: median / (dependent hops x median p2p hop); hops = n-1 for allgather/alltoall, \
         ceil(log2 n) for barrier/broadcast",
    );
    t
}

type Op<'a> = (
    &'a str,
    Box<dyn Fn() -> Result<(), gin_bootstrap::BootstrapError> + 'a>,
);

fn rank_main(args: &BootstrapArgs) -> Result<()> {
    let b = Bootstrap::from_env()?;
    let (n, r) = (b.nranks(), b.rank());
    let mine = vec![r as u8; args.bytes];
    let a2a = vec![r as u8; args.bytes * n];
    let iters = args.iters.max(1);
    let ops: Vec<Op<'_>> = vec![
        ("barrier", Box::new(|| b.barrier())),
        ("allgather", Box::new(|| b.allgather(&mine).map(drop))),
        (
            "alltoall",
            Box::new(|| b.alltoall(&a2a, args.bytes).map(drop)),
        ),
        ("broadcast", Box::new(|| b.broadcast(0, &mine).map(drop))),
    ];
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); ops.len()];
    let mut hop = Vec::new();
    // Warm-up: connections are dialed on first use.
    for (_, f) in &ops {
        f()?;
    }
    for _run in 0..args.runs.max(1) {
        for (i, (_, f)) in ops.iter().enumerate() {
            b.barrier()?;
            let t = Instant::now();
            for _ in 0..iters {
                f()?;
            }
            samples[i].push(t.elapsed().as_secs_f64() * 1e6 / iters as f64);
        }
        if n > 1 {
            b.barrier()?;
            if r <= 1 {
                let peer = 1 - r;
                let t = Instant::now();
                for _ in 0..iters {
                    if r == 0 {
                        b.send(peer, 1, &mine)?;
                        b.recv(peer, 1)?;
                    } else {
                        b.recv(peer, 1)?;
                        b.send(peer, 1, &mine)?;
                    }
                }
                hop.push(t.elapsed().as_secs_f64() * 1e6 / iters as f64 / 2.0);
            }
        }
    }
    b.barrier()?;
    if r == 0 {
        let result = RankCountResult {
            ranks: n,
            bytes: args.bytes,
            ops: ops
                .iter()
                .zip(&samples)
                .map(|((name, _), s)| {
                    Ok(OpResult {
                        op: (*name).to_owned(),
                        us: Summary::of(s).context("no runs")?,
                    })
                })
                .collect::<Result<_>>()?,
            hop_us: Summary::of(&hop),
        };
        ranks::emit(&result)?;
    }
    Ok(())
}
