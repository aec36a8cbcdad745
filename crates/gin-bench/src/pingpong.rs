//! `gin-bench pingpong`: put-with-signal ping-pong between ranks 0 and 1.
//!
//! Rank 0 puts `size` bytes into rank 1's window with a signal increment;
//! rank 1 waits for the signal and puts the same back; each round trip is
//! timed on rank 0, and half of it is one latency. A run is `iters` round
//! trips and its median is one sample; rows report the median and spread
//! over runs, and the tail (p99) over every round trip. In the same job, a
//! floor is measured the same way without gin-rs: for same-host paths two raw
//! processes copy `size` bytes into a shared segment and bump a flag (at 8
//! bytes this is a cache-line ping-pong); for tcp, a raw TCP ping-pong of
//! `size` bytes. Every round trip's data is checked on rank 0 after each run.

use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use gin_core::{Comm, DevCommRequirements, Fence, Local, Remote, Team};
use serde::{Deserialize, Serialize};

use crate::common::{Common, human_size};
use crate::floor::{self, FloorKind, ShmPair};
use crate::progress::Progress;
use crate::ranks;
use crate::report::{Report, Table};
use crate::stats::{Row, Summary, median};

#[derive(Debug, Clone, Args, Serialize, Deserialize)]
#[command(
    mut_arg("ranks", |a| a.default_value("2").required(false)),
    mut_arg("sizes", |a| a.default_value("8,64,512,4k,32k,64k,256k,1m,4m").required(false)),
    mut_arg("iters", |a| a.default_value("1000").required(false)),
    mut_arg("runs", |a| a.default_value("5").required(false)),
)]
pub struct PingPongArgs {
    #[command(flatten)]
    #[serde(flatten)]
    pub common: Common,
}

impl PingPongArgs {
    /// The defaults, as if `pingpong` were given with no flags.
    pub fn default_args() -> Self {
        #[derive(clap::Parser)]
        struct P {
            #[command(flatten)]
            a: PingPongArgs,
        }
        <P as clap::Parser>::parse_from(["pingpong"]).a
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SizeResult {
    pub bytes: u64,
    /// Round trips per run.
    pub iters: usize,
    /// Half round trip (µs): per-run medians, their summary, GB/s, the
    /// floor's and the ratio.
    pub row: Row,
    /// Every half round trip of every run (µs): the latency tail.
    pub tail_us: Summary,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PingPongResult {
    pub ranks: usize,
    pub backend: String,
    pub path: String,
    pub floor: String,
    pub sizes: Vec<SizeResult>,
    /// Peak resident memory of each rank (VmHWM), KiB.
    pub peak_kib: Vec<u64>,
}

pub fn run(args: &PingPongArgs) -> Result<()> {
    let c = &args.common;
    c.validate("pingpong")?;
    let nranks = c.one_rank_count("pingpong")?;
    if ranks::is_rank() {
        crate::common::apply_affinity(&c.cpus)?;
        return rank_main(args);
    }
    let r = measure(args, nranks)?;
    let t = table(&r);
    Report::new("pingpong", args, vec![t], r)?.finish(c.json.as_deref(), c.csv.as_deref())
}

/// Runs the job and returns rank 0's result.
pub fn measure(args: &PingPongArgs, nranks: usize) -> Result<PingPongResult> {
    let c = &args.common;
    let units = (c.sizes.len() * c.runs) as u64;
    let progress = Progress::new(units, "pingpong");
    progress.println(&format!(
        "pingpong: {nranks} ranks, sizes {}..{} B, {} runs of up to {} round trips per size, path {}...",
        c.sizes.iter().min().unwrap_or(&0),
        c.sizes.iter().max().unwrap_or(&0),
        c.runs,
        c.iters,
        c.path_label()
    ));
    let r = progress.job(units, |mut env| {
        env.extend(c.env());
        ranks::spawn_self(nranks, "pingpong", args, &env)
    });
    progress.finish();
    r
}

fn table(r: &PingPongResult) -> Table {
    let mut t = Table::new(
        "pingpong",
        format!(
            "put-with-signal ping-pong, {} ranks, backend {}, path rank 0 -> 1: {}; floor: {}",
            r.ranks, r.backend, r.path, r.floor
        ),
        &[
            "size",
            "median µs",
            "p10",
            "p90",
            "p99",
            "tail p99",
            "GB/s",
            "floor µs",
            "vs floor",
        ],
    );
    for s in &r.sizes {
        t.row(vec![
            human_size(s.bytes),
            format!("{:.3}", s.row.us.median),
            format!("{:.3}", s.row.us.p10),
            format!("{:.3}", s.row.us.p90),
            format!("{:.3}", s.row.us.p99),
            format!("{:.3}", s.tail_us.p99),
            format!("{:.3}", s.row.gbps),
            format!("{:.3}", s.row.floor_us.median),
            format!("{:.2}x", s.row.ratio),
        ]);
    }
    let mem: Vec<String> = r
        .peak_kib
        .iter()
        .enumerate()
        .map(|(i, k)| format!("rank {i} {:.1} MiB", *k as f64 / 1024.0))
        .collect();
    t.note(format!(
        "half round trips; median and p10/p90/p99 over runs of each run's median; tail p99 over every \
         round trip; peak memory: {}",
        mem.join(", ")
    ));
    t
}

// A benchmark binary's driver (the library limit of 120 lines is for
// library code): its phases read in order here.
#[allow(clippy::too_many_lines)]
fn rank_main(args: &PingPongArgs) -> Result<()> {
    let c = &args.common;
    let comm = Comm::from_env()?;
    let (r, n) = (comm.rank(), comm.nranks());
    let max = c.sizes.iter().copied().max().unwrap_or(8);
    let win = comm.alloc_window(max)?;
    let src = comm.alloc_window(max)?;
    let dc = comm.dev_comm(&DevCommRequirements::default())?;
    let ctx = dc.ctx(0)?;
    let path = ranks::path_to_rank1(&comm)?;
    crate::common::bind_rank_thread(c, comm.local_rank())?;
    let floor_kind = FloorKind::for_path(&path);
    let ucx = match floor_kind {
        FloorKind::Ucx => Some(crate::ucxfloor::setup(&comm)?),
        _ => None,
    };
    let floor_name = match floor_kind {
        FloorKind::Tcp => "raw TCP ping-pong of the same size, the faster of polling and blocking",
        FloorKind::Shm => "raw shared-memory copy + flag ping-pong of the same size",
        FloorKind::Ucx => {
            "ucx_perftest ucp_put_lat of the same size, same library and UCX_TLS (two processes \
             beside ranks 0 and 1), median half round trip"
        }
    };
    let mut tcp = match floor_kind {
        FloorKind::Tcp => floor::tcp_pair(&comm)?,
        FloorKind::Shm | FloorKind::Ucx => None,
    };
    let shm = match floor_kind {
        FloorKind::Shm => ShmPair::new(&comm, max as usize)?,
        FloorKind::Tcp | FloorKind::Ucx => None,
    };
    let mut results = Vec::new();
    let mut signal_seen = 0u64;
    for (k, &size) in c.sizes.iter().enumerate() {
        let iters = ranks::iters_for(c.iters, size);
        let warm = c.warmup_for(iters);
        // Each size sends its own pattern, so a stale byte from the last
        // size cannot pass the check.
        let pattern = gin_bootstrap::selftest::pattern(k as u64 + 1, size as usize);
        src.write(0, &pattern)?;
        dc.barrier(Team::World, 0)?.sync(0, Fence::None)?;
        let mut runs = Vec::with_capacity(c.runs);
        let mut floors = Vec::with_capacity(c.runs);
        let mut all = Vec::new();
        for run in 0..c.runs {
            if let Some(pair) = &shm {
                floor::reset_incoming(pair);
            }
            comm.bootstrap().barrier()?;
            if r <= 1 {
                let peer = 1 - r;
                let put = || {
                    ctx.put(
                        peer,
                        &win,
                        0,
                        &src,
                        0,
                        size,
                        Remote::signal_inc(0),
                        Local::None,
                    )
                };
                let warm = if run == 0 { warm } else { 0 };
                let mut samples = Vec::with_capacity(iters);
                for i in 0..warm + iters {
                    let t = Instant::now();
                    if r == 0 {
                        put()?;
                        signal_seen = ctx.wait_signal(0, signal_seen + 1)?;
                    } else {
                        signal_seen = ctx.wait_signal(0, signal_seen + 1)?;
                        put()?;
                    }
                    if i >= warm {
                        samples.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
                    }
                }
                ctx.flush()?;
                // The last round trip's bytes have landed here (the signal
                // orders them): check them.
                if win.read_vec(0, size as usize)? != pattern {
                    bail!("rank {r}: the {size}-byte message from rank {peer} is wrong");
                }
                runs.push(median(&samples));
                all.extend(samples);
            }
            floors.push(match (&shm, &mut tcp, &ucx) {
                (Some(pair), _, _) => median(&floor::shm_pingpong(pair, &comm, size, warm, iters)?),
                (None, Some(s), _) => {
                    floor::tcp_pingpong_floor(s, r, size, (warm, iters), comm.timeout())?
                }
                (None, None, Some(perf)) => ucx_lat(perf, &comm, size, (warm, iters))?,
                (None, None, None) => f64::NAN,
            });
            crate::progress::tick(r);
        }
        if r == 0 {
            results.push(SizeResult {
                bytes: size,
                iters,
                row: Row::new(size as f64, runs, floors).context("no samples")?,
                tail_us: Summary::of(&all).context("no samples")?,
            });
        }
    }
    dc.barrier(Team::World, 0)?.sync(0, Fence::Context)?;
    let peaks = comm
        .bootstrap()
        .allgather(&ranks::peak_kib().to_le_bytes())?;
    if r == 0 {
        ranks::emit(&PingPongResult {
            ranks: n,
            backend: ranks::backend_label(&dc),
            path,
            floor: floor_name.to_owned(),
            sizes: results,
            peak_kib: peaks
                .iter()
                .map(|p| u64::from_le_bytes(p.as_slice().try_into().unwrap_or([0; 8])))
                .collect(),
        })?;
    }
    drop(shm);
    dc.destroy()?;
    Ok(())
}

/// Collective: one `ucp_put_lat` run between ranks 0 and 1 (the server
/// beside rank 1 listens before the run's collective, the client beside
/// rank 0 runs after it); rank 0 returns the median half round trip, µs.
fn ucx_lat(
    perf: &crate::ucxfloor::UcxPerf,
    comm: &Comm,
    size: u64,
    counts: (usize, usize),
) -> Result<f64> {
    perf.run(comm, crate::ucxfloor::Test::PutLat, size, counts)
}
