//! `gin-bench alltoall`: the seed's all-to-all. Every rank puts `size` bytes
//! to every rank (itself included) with a signal increment, waits until it
//! has received a signal from every rank, then flushes.
//!
//! One run is `iters` iterations after a barrier; its time is the slowest
//! rank's mean per iteration (the collective is done when the last rank is).
//! Results are the median and spread over runs. The floor, measured in the
//! same job, is copying the same bytes locally: `(n - 1) · size` per
//! iteration, the data movement no transport can avoid. The received data is
//! checked after every size.

use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use gin_core::{Comm, DevCommRequirements, Fence, Local, Remote, Team};
use serde::{Deserialize, Serialize};

use crate::pingpong::parse_size;
use crate::ranks;
use crate::stats::Summary;

#[derive(Debug, Clone, Args)]
pub struct AlltoallArgs {
    /// Rank counts to measure (comma separated).
    #[arg(long, value_delimiter = ',', default_value = "2,4,8")]
    pub ranks: Vec<usize>,
    /// Bytes each rank sends to each rank (k / m suffixes allowed).
    #[arg(long, value_delimiter = ',', default_value = "8,1k,64k")]
    pub sizes: Vec<String>,
    /// Iterations per run at 64 KiB and below (fewer above, at least 50):
    /// enough that the time after each run's barrier does not dominate.
    #[arg(long, default_value_t = 1000)]
    pub iters: usize,
    /// Runs per size.
    #[arg(long, default_value_t = 7)]
    pub runs: usize,
    /// auto | proxy | gdaki (sets GIN_BACKEND for the ranks).
    #[arg(long)]
    pub backend: Option<String>,
    /// auto | shm | tcp (sets GIN_TRANSPORT for the ranks).
    #[arg(long)]
    pub transport: Option<String>,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SizeResult {
    pub bytes: u64,
    /// Per iteration, µs, over runs.
    pub us: Summary,
    /// Bytes each rank sent to others per second, GB/s (at the median).
    pub gbps_per_rank: f64,
    /// Local copy of the same bytes, µs per iteration.
    pub floor_us: Summary,
    pub ratio: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RankCountResult {
    pub ranks: usize,
    pub backend: String,
    pub paths: Vec<String>,
    pub sizes: Vec<SizeResult>,
}

pub fn run(args: &AlltoallArgs, argv: &[String]) -> Result<()> {
    let sizes: Vec<u64> = args
        .sizes
        .iter()
        .map(|s| parse_size(s))
        .collect::<Result<_>>()?;
    if args.iters == 0 || args.runs == 0 {
        bail!("--iters and --runs must be positive");
    }
    if ranks::is_rank() {
        return rank_main(args, &sizes);
    }
    let env = ranks::choice_env(args.backend.as_ref(), args.transport.as_ref());
    let mut all = Vec::new();
    for &n in &args.ranks {
        eprintln!(
            "alltoall: {n} ranks, {} runs x {} iterations per size...",
            args.runs, args.iters
        );
        let r: RankCountResult = ranks::spawn_self(n, argv, &env)?;
        all.push(r);
    }
    print_table(&all);
    ranks::write_json(args.json.as_ref(), &all)
}

fn print_table(all: &[RankCountResult]) {
    println!(
        "{:>5}  {:>8}  {:>10} {:>9} {:>9}  {:>12}  {:>9}  {:>8}",
        "ranks", "size", "median µs", "p10 µs", "p90 µs", "GB/s per rank", "floor µs", "vs floor"
    );
    for r in all {
        for s in &r.sizes {
            println!(
                "{:>5}  {:>8}  {:>10.2} {:>9.2} {:>9.2}  {:>12.3}  {:>9.3}  {:>7.1}x",
                r.ranks,
                s.bytes,
                s.us.median,
                s.us.p10,
                s.us.p90,
                s.gbps_per_rank,
                s.floor_us.median,
                s.ratio
            );
        }
    }
    if let Some(r) = all.first() {
        println!(
            "(backend {}; rank 0's paths {:?}; time = slowest rank's mean per iteration, median over runs)",
            r.backend, r.paths
        );
    }
}

/// The byte rank `src` sends to rank `dst` in the size-`size` exchange.
fn byte(src: usize, dst: usize, size: u64) -> u8 {
    (src * 31 + dst * 7 + size as usize % 251) as u8
}

fn rank_main(args: &AlltoallArgs, sizes: &[u64]) -> Result<()> {
    let comm = Comm::from_env()?;
    let (r, n) = (comm.rank(), comm.nranks());
    let max = sizes.iter().copied().max().unwrap_or(8);
    let send = comm.alloc_window(max * n as u64)?;
    let recv = comm.alloc_window(max * n as u64)?;
    let dc = comm.dev_comm(&DevCommRequirements::default())?;
    let ctx = dc.ctx(0)?;
    let barrier = dc.barrier(Team::World, 0)?;
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
        let iters = ranks::iters_for(args.iters, size);
        // Warm-up, then the timed runs.
        barrier.sync(0, Fence::None)?;
        for _ in 0..(iters / 10).max(2) {
            one(&mut expected)?;
        }
        let mut samples = Vec::with_capacity(args.runs);
        let mut floors = Vec::with_capacity(args.runs);
        let src = vec![1u8; (size as usize) * (n - 1).max(1)];
        let mut dst = vec![0u8; src.len()];
        for _ in 0..args.runs {
            barrier.sync(0, Fence::None)?;
            let t = Instant::now();
            for _ in 0..iters {
                one(&mut expected)?;
            }
            let mine = t.elapsed().as_secs_f64() * 1e6 / iters as f64;
            let all = comm.bootstrap().allgather(&mine.to_le_bytes())?;
            let slowest = all
                .iter()
                .map(|b| f64::from_le_bytes(b.as_slice().try_into().unwrap_or([0; 8])))
                .fold(0.0, f64::max);
            samples.push(slowest);
            let t = Instant::now();
            for _ in 0..iters {
                dst.copy_from_slice(std::hint::black_box(&src));
                std::hint::black_box(&dst);
            }
            floors.push(t.elapsed().as_secs_f64() * 1e6 / iters as f64);
        }
        // Everything landed: check every byte received.
        barrier.sync(0, Fence::Context)?;
        for p in 0..n {
            let got = recv.read_vec(p as u64 * size, size as usize)?;
            if got.iter().any(|&b| b != byte(p, r, size)) {
                bail!("rank {r}: the {size}-byte block from rank {p} is wrong");
            }
        }
        let us = Summary::of(&samples).context("no samples")?;
        let floor = Summary::of(&floors).context("no floor samples")?;
        results.push(SizeResult {
            bytes: size,
            gbps_per_rank: ((n - 1) as u64 * size) as f64 / (us.median * 1e3),
            ratio: us.median / floor.median.max(1e-9),
            us,
            floor_us: floor,
        });
    }
    if r == 0 {
        ranks::emit(&RankCountResult {
            ranks: n,
            backend: if dc.is_direct((r + 1) % n) && n > 1 {
                "auto (direct load/store)".into()
            } else {
                dc.backend_name().into()
            },
            paths: comm.path_names().iter().map(|s| (*s).to_owned()).collect(),
            sizes: results,
        })?;
    }
    dc.destroy()?;
    Ok(())
}
