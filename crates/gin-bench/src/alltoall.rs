//! `gin-bench alltoall`: the seed's all-to-all. Every rank puts `size` bytes
//! to every rank (itself included) with a signal increment, waits until it
//! has received a signal from every rank, then flushes.
//!
//! One run is `iters` iterations after a barrier; its time is the slowest
//! rank's mean per iteration (the collective is done when the last rank is).
//! Results are the median and p10/p90/p99 over runs. The floor, measured in the
//! same job, is copying the same bytes locally: `(n - 1) · size` per
//! iteration, the data movement no transport can avoid. The received data is
//! checked after every size.

use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use gin_core::{Comm, DevCommRequirements, Fence, Local, Remote, Team};
use serde::{Deserialize, Serialize};

use crate::common::{Common, human_size};
use crate::progress::Progress;
use crate::ranks;
use crate::report::{Report, Table};
use crate::stats::Row;

#[derive(Debug, Clone, Args, Serialize, Deserialize)]
#[command(
    mut_arg("ranks", |a| a.default_value("2,4,8").required(false)),
    mut_arg("sizes", |a| a
        .default_value("8,1k,64k")
        .required(false)
        .help("Bytes each rank sends to each rank, comma separated (k / m suffixes allowed)")),
    mut_arg("iters", |a| a
        .default_value("1000")
        .required(false)
        .help("Iterations per run at 64 KiB and below (fewer above, at least 50): \
               enough that the time after each run's barrier does not dominate")),
    mut_arg("runs", |a| a.default_value("7").required(false)),
)]
pub struct AlltoallArgs {
    #[command(flatten)]
    #[serde(flatten)]
    pub common: Common,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SizeResult {
    pub bytes: u64,
    /// Iterations per run.
    pub iters: usize,
    /// µs per iteration over runs; GB/s counts the `(ranks - 1) · size`
    /// bytes each rank sends to others; the floor is a local copy of them.
    pub row: Row,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RankCountResult {
    pub ranks: usize,
    pub backend: String,
    pub paths: Vec<String>,
    pub sizes: Vec<SizeResult>,
}

pub fn run(args: &AlltoallArgs) -> Result<()> {
    let c = &args.common;
    c.validate("alltoall")?;
    if ranks::is_rank() {
        crate::common::apply_affinity(&c.cpus)?;
        return rank_main(args);
    }
    let all = measure(args)?;
    let t = table(&all);
    Report::new("alltoall", args, vec![t], all)?.finish(c.json.as_deref(), c.csv.as_deref())
}

/// Runs one job per rank count and returns rank 0's results.
pub fn measure(args: &AlltoallArgs) -> Result<Vec<RankCountResult>> {
    let c = &args.common;
    let units = (c.ranks.len() * c.sizes.len() * c.runs) as u64;
    let progress = Progress::new(units, "alltoall");
    let mut all = Vec::new();
    for &n in &c.ranks {
        progress.println(&format!(
            "alltoall: {n} ranks, {} runs x {} iterations per size, path {}...",
            c.runs,
            c.iters,
            c.path_label()
        ));
        let r: RankCountResult = progress.job((c.sizes.len() * c.runs) as u64, |mut env| {
            env.extend(c.env());
            ranks::spawn_self(n, "alltoall", args, &env)
        })?;
        all.push(r);
    }
    progress.finish();
    Ok(all)
}

fn table(all: &[RankCountResult]) -> Table {
    let title = all.first().map_or_else(String::new, |r| {
        format!(
            "all-to-all (put + signal to every rank, wait, flush), backend {}, rank 0's paths {}",
            r.backend,
            r.paths.join(",")
        )
    });
    let mut t = Table::new(
        "alltoall",
        title,
        &[
            "ranks",
            "size",
            "median µs",
            "p10",
            "p90",
            "p99",
            "GB/s per rank",
            "floor µs",
            "vs floor",
        ],
    );
    for r in all {
        for s in &r.sizes {
            t.row(vec![
                r.ranks.to_string(),
                human_size(s.bytes),
                format!("{:.2}", s.row.us.median),
                format!("{:.2}", s.row.us.p10),
                format!("{:.2}", s.row.us.p90),
                format!("{:.2}", s.row.us.p99),
                format!("{:.3}", s.row.gbps),
                format!("{:.3}", s.row.floor_us.median),
                format!("{:.1}x", s.row.ratio),
            ]);
        }
    }
    t.note(
        "time per iteration = the slowest rank's mean over a run; median and p10/p90/p99 over runs; \
         GB/s per rank = (ranks - 1) x size / median; floor = a local copy of the same bytes",
    );
    t
}

/// The byte rank `src` sends to rank `dst` in the size-`size` exchange.
fn byte(src: usize, dst: usize, size: u64) -> u8 {
    (src * 31 + dst * 7 + size as usize % 251) as u8
}

fn rank_main(args: &AlltoallArgs) -> Result<()> {
    let c = &args.common;
    let sizes = &c.sizes;
    let comm = Comm::from_env()?;
    let (r, n) = (comm.rank(), comm.nranks());
    let max = sizes.iter().copied().max().unwrap_or(8);
    let send = comm.alloc_window(max * n as u64)?;
    let recv = comm.alloc_window(max * n as u64)?;
    let dc = comm.dev_comm(&DevCommRequirements::default())?;
    let ctx = dc.ctx(0)?;
    let barrier = dc.barrier(Team::World, 0)?;
    crate::common::bind_rank_thread(c, comm.local_rank())?;
    // Signals expected so far: exactly n per iteration. (Not the value seen,
    // which may already include a fast peer's signal for the next iteration.)
    let mut expected = 0u64;
    let mut results = Vec::new();
    for &size in sizes {
        for p in 0..n {
            send.write(p as u64 * size, &vec![byte(r, p, size); size as usize])?;
        }
        let one = |expected: &mut u64| -> Result<()> {
            for k in 0..n {
                let p = (r + k) % n;
                ctx.put(
                    p,
                    &recv,
                    r as u64 * size,
                    &send,
                    p as u64 * size,
                    size,
                    Remote::signal_inc(0),
                    Local::None,
                )?;
            }
            *expected += n as u64;
            ctx.wait_signal(0, *expected)?;
            ctx.flush()?;
            Ok(())
        };
        let iters = ranks::iters_for(c.iters, size);
        // Warm-up, then the timed runs.
        barrier.sync(0, Fence::None)?;
        for _ in 0..c.warmup_for(iters) {
            one(&mut expected)?;
        }
        let mut samples = Vec::with_capacity(c.runs);
        let mut floors = Vec::with_capacity(c.runs);
        let src = vec![1u8; (size as usize) * (n - 1).max(1)];
        let mut dst = vec![0u8; src.len()];
        for _ in 0..c.runs {
            barrier.sync(0, Fence::None)?;
            let t = Instant::now();
            for _ in 0..iters {
                one(&mut expected)?;
            }
            let mine = t.elapsed().as_secs_f64() * 1e6 / iters as f64;
            let all = comm.bootstrap().allgather(&mine.to_le_bytes())?;
            let mut slowest = 0.0f64;
            for b in &all {
                slowest = slowest.max(ranks::f64_le(b)?);
            }
            samples.push(slowest);
            let t = Instant::now();
            for _ in 0..iters {
                dst.copy_from_slice(std::hint::black_box(&src));
                std::hint::black_box(&dst);
            }
            floors.push(t.elapsed().as_secs_f64() * 1e6 / iters as f64);
            crate::progress::tick(r);
        }
        // Everything landed: check every byte received.
        barrier.sync(0, Fence::Context)?;
        for p in 0..n {
            let got = recv.read_vec(p as u64 * size, size as usize)?;
            if got.iter().any(|&b| b != byte(p, r, size)) {
                bail!("rank {r}: the {size}-byte block from rank {p} is wrong");
            }
        }
        results.push(SizeResult {
            bytes: size,
            iters,
            row: Row::new(((n - 1) as u64 * size) as f64, samples, floors).context("no samples")?,
        });
    }
    if r == 0 {
        ranks::emit(&RankCountResult {
            ranks: n,
            backend: ranks::backend_label(&dc),
            paths: comm.path_names().iter().map(|s| (*s).to_owned()).collect(),
            sizes: results,
        })?;
    }
    dc.destroy()?;
    Ok(())
}
