//! `gin-bench cuda`: CUDA ranks on two GPUs (one process each), against
//! floors measured in the same job and, with `--peer-json`, peers (NVSHMEM)
//! run in the same job by `run.sh` ([`crate::peers`], docs/cuda.md).
//!
//! - ping-pong: put-with-signal round trip, one kernel per GPU, for the
//!   load/store path (thread / warp / block coops), the proxy and GDAKI
//!   (one thread); the load/store floor is a raw copy plus release-store
//!   flag over the same CUDA IPC mapping, the floor of the proxy and of
//!   GDAKI a raw CPU-proxied copy plus flag (a host thread forwarding with
//!   cuMemcpyAsync + cuStreamWriteValue64).
//! - bandwidth: one-way, one message (4 MiB by default) split over N blocks.
//!
//! Times are measured on the GPU (%globaltimer) over many round trips per
//! launch; each row is the median and p10/p90/p99 over `--runs` launches,
//! in the one report shape every gin-bench subcommand writes.
//! `pingpong --device cuda` and `bandwidth --device cuda` come here too
//! ([`CudaArgs::from_common`]).

#![allow(clippy::many_single_char_names)] // c, m, f: CUDA comm, module, kernel

use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use gin_core::cuda::{self, Arg, CtxSharing, CudaComm, DevMem, Function, HostMem, Module, Stream};
use gin_core::launch::{Role, run_ranks};
use gin_core::{BackendKind, Comm, DevCommRequirements};
use serde::{Deserialize, Serialize};

use crate::common::{Backend, Common, Coop, Transport, human_size, parse_size};
use crate::peers::{Peer, PeerCell};
use crate::report::{Report, Table};
use crate::stats::Summary;

/// Which measurements `gin-bench cuda` takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CudaTest {
    /// Put-with-signal round trip.
    Pingpong,
    /// One-way bandwidth, one message split over blocks.
    Bandwidth,
    /// The seed's all-to-all (one block per peer), against the LogGP
    /// prediction fitted from the ping-pong of the same run.
    Alltoall,
}

/// Which CUDA path carries the puts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CudaPath {
    /// Peer pointers over CUDA IPC (what `auto` picks for same-host GPUs).
    #[value(name = "loadstore")]
    #[serde(rename = "loadstore")]
    LoadStore,
    /// Descriptors to the CUDA proxy thread, which copies with the copy engine.
    Proxy,
    /// mlx5 WQEs to the soft NIC thread, which copies with the copy engine.
    Gdaki,
}

impl CudaPath {
    fn kind(self) -> BackendKind {
        match self {
            CudaPath::LoadStore => BackendKind::Auto,
            CudaPath::Proxy => BackendKind::Proxy,
            CudaPath::Gdaki => BackendKind::Gdaki,
        }
    }

    fn label(self) -> &'static str {
        match self {
            CudaPath::LoadStore => "load/store",
            CudaPath::Proxy => "proxy",
            CudaPath::Gdaki => "gdaki",
        }
    }
}

/// Which queue paths the benchmark's kernels are compiled with
/// (`GIN_QUEUE_PATHS` in gin/gin.cuh).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QueuePaths {
    /// The header's default: proxy and GDAKI beside load/store.
    All,
    /// The load/store path alone (`GIN_QUEUE_PATHS=0`), as a kernel that
    /// only reaches load/store peers may be built: `--paths loadstore`.
    None,
}

#[derive(Debug, Clone, Args, Serialize, Deserialize)]
pub struct CudaArgs {
    /// Ping-pong message sizes (k / m suffixes allowed).
    #[arg(long, value_delimiter = ',', value_parser = parse_size, default_value = "8,1k,64k,1m")]
    pub sizes: Vec<u64>,
    /// Coops of the load/store ping-pong (the proxy's is always one thread:
    /// its kernel share is one descriptor).
    #[arg(
        long,
        value_delimiter = ',',
        value_enum,
        default_value = "thread,warp,block"
    )]
    pub coops: Vec<Coop>,
    /// Round trips per launch (a tenth of it at 1 MiB and above, at least 50).
    #[arg(long, default_value_t = 2000)]
    pub iters: u32,
    /// Untimed round trips at the start of each launch (default: a tenth of
    /// the timed ones).
    #[arg(long)]
    pub warmup: Option<u32>,
    /// Launches per figure: rows give the median and p10/p90/p99 over them.
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// Block counts for the bandwidth test.
    #[arg(long, value_delimiter = ',', default_value = "16,32,66,132")]
    pub blocks: Vec<u32>,
    /// CUDA ranks, one GPU each: ranks 0 and 1 play the ping-pong and the
    /// bandwidth test (the others wait), every rank the all-to-all.
    #[arg(long, default_value_t = 2)]
    pub ranks: usize,
    /// Threads per block in the bandwidth test.
    #[arg(long, default_value_t = 512)]
    pub threads: u32,
    /// Threads of the block coop's one block in the ping-pong (NVSHMEM's
    /// block figures are for 1024).
    #[arg(long, default_value_t = 512)]
    pub block_threads: u32,
    /// Message sizes of the bandwidth test.
    #[arg(long, value_delimiter = ',', value_parser = parse_size, default_value = "4m")]
    pub bw_bytes: Vec<u64>,
    /// Which tests to run.
    #[arg(
        long,
        value_delimiter = ',',
        value_enum,
        default_value = "pingpong,bandwidth,alltoall"
    )]
    pub tests: Vec<CudaTest>,
    /// Which paths to measure.
    #[arg(
        long,
        value_delimiter = ',',
        value_enum,
        default_value = "loadstore,proxy,gdaki"
    )]
    pub paths: Vec<CudaPath>,
    /// The queue paths compiled into the kernels: `none` measures the
    /// load/store path as built for kernels that reach only load/store
    /// peers (`GIN_QUEUE_PATHS=0`).
    #[arg(long, value_enum, default_value = "all")]
    pub queue_paths: QueuePaths,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    /// Also write the table as CSV to this file.
    #[arg(long)]
    pub csv: Option<std::path::PathBuf>,
    /// A peer's results from the same job (repeatable): its figure for the
    /// same test, coop, size and threads is printed beside gin-rs's, with
    /// the ratio; where FILE is missing, the column says why, from the
    /// `.why` file beside it (`peer-nvshmem.json` -> `peer-nvshmem.why`).
    #[arg(long = "peer-json", value_name = "FILE")]
    pub peer_json: Vec<std::path::PathBuf>,
}

impl CudaArgs {
    /// `pingpong --device cuda` and `bandwidth --device cuda`: the common
    /// flags mapped onto this benchmark. `--sizes` are the ping-pong sizes or
    /// the bandwidth message sizes; `--backend` picks the path (none: both);
    /// `--coop` the load/store coop. What has no meaning on GPUs is refused.
    pub fn from_common(c: &Common, test: CudaTest) -> Result<Self> {
        if c.ranks.as_slice() != [2] {
            bail!(
                "--device cuda runs exactly 2 ranks (one per GPU), got --ranks {:?}",
                c.ranks
            );
        }
        if let Some(t @ (Transport::Tcp | Transport::Ucx)) = c.transport {
            let t = t.name();
            bail!(
                "--device cuda --transport {t}: run `GIN_TRANSPORT={t} gin-bench cuda` instead (CUDA ranks read the transport from the environment)"
            );
        }
        if !c.cpus.is_empty() {
            bail!("--cpus has no meaning for --device cuda (the ranks' work runs on the GPUs)");
        }
        let paths = match c.backend {
            None => vec![CudaPath::LoadStore, CudaPath::Proxy, CudaPath::Gdaki],
            Some(Backend::Auto) => vec![CudaPath::LoadStore],
            Some(Backend::Proxy) => vec![CudaPath::Proxy],
            Some(Backend::Gdaki) => vec![CudaPath::Gdaki],
        };
        if c.iters == 0 || c.runs == 0 || c.sizes.is_empty() {
            bail!("--iters and --runs must be positive and --sizes non-empty");
        }
        let iters = u32::try_from(c.iters).context("--iters is too large")?;
        let warmup = c
            .warmup
            .map(|w| u32::try_from(w).context("--warmup is too large"))
            .transpose()?;
        Ok(CudaArgs {
            sizes: c.sizes.clone(),
            coops: vec![c.coop],
            iters,
            warmup,
            runs: c.runs,
            blocks: vec![16, 32, 66, 132],
            ranks: 2,
            threads: 512,
            block_threads: 512,
            bw_bytes: if test == CudaTest::Bandwidth {
                c.sizes.clone()
            } else {
                vec![4 << 20]
            },
            tests: vec![test],
            paths,
            queue_paths: QueuePaths::All,
            json: c.json.clone(),
            csv: c.csv.clone(),
            peer_json: Vec::new(),
        })
    }

    fn validate(&self) -> Result<()> {
        if self.iters == 0 || self.runs == 0 {
            bail!("--iters and --runs must be positive");
        }
        if self.tests.contains(&CudaTest::Pingpong)
            && (self.sizes.is_empty() || self.coops.is_empty())
        {
            bail!("the ping-pong needs --sizes and --coops");
        }
        if self.tests.contains(&CudaTest::Bandwidth)
            && (self.bw_bytes.is_empty() || self.blocks.is_empty())
        {
            bail!("the bandwidth test needs --bw-bytes and --blocks");
        }
        if let Some(&b) = self.blocks.iter().find(|&&b| b == 0 || b > 1024) {
            bail!("--blocks {b}: between 1 and 1024 blocks");
        }
        if self.ranks < 2 {
            bail!("--ranks {}: at least 2", self.ranks);
        }
        if self.threads == 0 || self.threads > 1024 || !self.threads.is_multiple_of(32) {
            bail!("--threads {}: a multiple of 32 up to 1024", self.threads);
        }
        let bt = self.block_threads;
        if bt == 0 || bt > 1024 || !bt.is_multiple_of(32) {
            bail!("--block-threads {bt}: a multiple of 32 up to 1024");
        }
        if self.queue_paths == QueuePaths::None
            && let Some(p) = self.paths.iter().find(|&&p| p != CudaPath::LoadStore)
        {
            bail!(
                "--queue-paths none compiles the proxy and GDAKI paths out of the kernels: --paths {} cannot run with it (use --paths loadstore)",
                p.label()
            );
        }
        Ok(())
    }

    /// Untimed round trips before `iters` timed ones.
    fn warmup_for(&self, iters: u32) -> u32 {
        self.warmup.unwrap_or(iters / 10)
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct CudaRow {
    pub test: CudaTest,
    pub path: String,
    /// `thread` / `warp` / `block`, or `N blocks` for bandwidth.
    pub coop: String,
    pub bytes: u64,
    /// Over launches: round-trip µs (ping-pong) or GB/s (bandwidth).
    pub value: Summary,
    /// The floor measured in the same job, same unit, where there is one.
    pub floor: Option<Summary>,
    /// The all-to-all's LogGP prediction from this run's ping-pong.
    pub peer: Option<(String, f64)>,
    /// Threads of each block that ran it.
    pub threads: u32,
    /// The `--peer-json` peers' figures for the same test, coop, size and
    /// threads, measured in the same job, or why there are none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub peers: Vec<PeerCell>,
}

/// Threads of the one block that runs `c`'s ping-pong kernel.
fn coop_threads(c: Coop, block_threads: u32) -> u32 {
    match c {
        Coop::Thread => 1,
        Coop::Warp => 32,
        Coop::Block => block_threads,
    }
}

/// The kernel of `base` for `coop` run by one block of `threads`: the block
/// kernels are built for up to 512 threads (registers to spare) and, as
/// `_block_1024`, for up to 1024 (64 registers a thread).
fn kernel_name(base: &str, coop: Coop, threads: u32) -> String {
    let wide = coop == Coop::Block && threads > 512;
    format!(
        "{base}_{}{}",
        coop_name(coop),
        if wide { "_1024" } else { "" }
    )
}

fn coop_name(c: Coop) -> &'static str {
    match c {
        Coop::Thread => "thread",
        Coop::Warp => "warp",
        Coop::Block => "block",
    }
}

fn summary(v: &[f64]) -> Result<Summary> {
    Summary::of(v).context("no launches were measured")
}

// A benchmark binary's driver (the library limit of 120 lines is for
// library code): its phases read in order here.
#[allow(clippy::too_many_lines)]
pub fn run(a: &CudaArgs) -> Result<()> {
    a.validate()?;
    if let Some(why) = cuda::skip_reason() {
        bail!("gin-bench cuda needs a GPU: {why}");
    }
    match run_ranks(a.ranks).map_err(anyhow::Error::msg)? {
        Role::Launched => return Ok(()),
        Role::Rank => {}
    }
    let comm = Comm::from_env()?;
    if comm.nranks() < 2 {
        bail!("gin-bench cuda needs at least 2 ranks");
    }
    let c = comm.cuda()?;
    // Over TCP (other hosts, or GIN_TRANSPORT=tcp) GPU memory is staged
    // through host memory: there is no load/store path, and the floors,
    // which need the peer's memory mapped here, are not measured.
    let tcp = c.reaches_over_tcp(usize::from(comm.rank() == 0));
    let paths: Vec<CudaPath> = a
        .paths
        .iter()
        .copied()
        .filter(|&p| !(tcp && p == CudaPath::LoadStore))
        .collect();
    if tcp && comm.rank() == 0 {
        // The transport the fabric gave rank 1 ("tcp", or "ucx", which
        // hands GPU memory to UCX directly where it can).
        let over = comm.path_names().get(1).copied().unwrap_or("tcp");
        let how = if over == "tcp" {
            "GPU memory staged through host memory"
        } else {
            "not mapped here"
        };
        println!("rank 0 reaches rank 1 over {over} ({how}): no load/store path, no floors");
    }
    let m = match a.queue_paths {
        QueuePaths::All => c.compile(gin_selftest::KERNELS, "selftest.cu")?,
        QueuePaths::None => {
            let opts = cuda::CompileOptions {
                defines: vec![("GIN_QUEUE_PATHS".into(), Some("0".into()))],
                ..Default::default()
            };
            c.compile_with(gin_selftest::KERNELS, "selftest.cu", &opts)?
        }
    };
    let want = |t: CudaTest| a.tests.contains(&t);
    let mut max = 8u64;
    if want(CudaTest::Pingpong) {
        max = max.max(a.sizes.iter().copied().max().unwrap_or(8));
    }
    if want(CudaTest::Alltoall) {
        // Every rank's block of each size, side by side.
        max = max.max(a.sizes.iter().copied().max().unwrap_or(8) * comm.nranks() as u64);
    }
    if want(CudaTest::Bandwidth) {
        max = max.max(a.bw_bytes.iter().copied().max().unwrap_or(8));
    }
    let mut rows = Vec::new();
    let mut skipped: Vec<String> = Vec::new();
    let shared = shared_gpu(&comm, &c)?;
    if comm.rank() == 0 {
        println!(
            "gin-bench cuda: {} ranks, rank 0 on GPU {} ({}, UUID {}); {} launches per figure",
            comm.nranks(),
            c.device().ordinal(),
            c.device().name(),
            c.device().uuid().unwrap_or("unknown"),
            a.runs
        );
        if let Some(g) = &shared {
            println!("{}: {}", if g.void { "WARNING" } else { "NOTE" }, g.why);
        }
        if a.queue_paths == QueuePaths::None {
            println!(
                "kernels compiled with the load/store path alone (GIN_QUEUE_PATHS=0, --queue-paths none)"
            );
        }
    }
    let src = c.alloc_window(max)?;
    let dst = c.alloc_window(max)?;
    let flags = c.alloc_window(64)?;
    let out = DevMem::new(24)?;
    let stream = Stream::new()?;
    let pp = want(CudaTest::Pingpong);
    if pp && paths.contains(&CudaPath::LoadStore) {
        for &coop in &a.coops {
            let block = coop_threads(coop, a.block_threads);
            for &bytes in &a.sizes {
                let iters = if bytes >= 1 << 20 {
                    (a.iters / 10).max(50)
                } else {
                    a.iters
                };
                let shape = Shape {
                    bytes,
                    iters,
                    warmup: a.warmup_for(iters),
                    coop,
                    block,
                    runs: a.runs,
                };
                let floor = lsa_floor(
                    &c,
                    &m,
                    &stream,
                    &dst,
                    &flags,
                    &out,
                    &shape,
                    shared.is_some(),
                )?;
                let gin = gin_pingpong(&c, &m, BackendKind::Auto, &src, &out, &shape)?;
                rows.push(CudaRow {
                    test: CudaTest::Pingpong,
                    path: CudaPath::LoadStore.label().into(),
                    coop: coop_name(coop).into(),
                    bytes,
                    value: summary(&gin)?,
                    floor: Some(summary(&floor)?),
                    // Peers (NVSHMEM) come from --peer-json, measured in
                    // the same job; no figure from another run stands in.
                    peer: None,
                    threads: block,
                    peers: Vec::new(),
                });
            }
        }
    }
    // The proxy and GDAKI paths: the coop does not change what the CPU
    // thread does; one thread (the kernel's share is a descriptor or two
    // WQEs). Both are held against the same raw CPU-proxied floor.
    let queued: Vec<CudaPath> = [CudaPath::Proxy, CudaPath::Gdaki]
        .into_iter()
        .filter(|p| paths.contains(p))
        .collect();
    if pp && !queued.is_empty() {
        for &bytes in &a.sizes {
            let iters = (a.iters / 4).max(50);
            let shape = Shape {
                bytes,
                iters,
                warmup: a.warmup_for(iters),
                coop: Coop::Thread,
                block: 1,
                runs: a.runs,
            };
            let floor = if tcp {
                None
            } else {
                Some(summary(&proxy_floor(
                    &c, &m, &stream, &src, &dst, &flags, &out, &shape,
                )?)?)
            };
            for &path in &queued {
                let gin = gin_pingpong(&c, &m, path.kind(), &src, &out, &shape)?;
                rows.push(CudaRow {
                    test: CudaTest::Pingpong,
                    path: path.label().into(),
                    coop: "thread".into(),
                    bytes,
                    value: summary(&gin)?,
                    floor,
                    peer: None,
                    threads: 1,
                    peers: Vec::new(),
                });
            }
        }
    }
    if want(CudaTest::Bandwidth) {
        if comm.rank() == 0 {
            let bw_max = a.bw_bytes.iter().copied().max().unwrap_or(8) as usize;
            let pat: Vec<u8> = (0..bw_max).map(pattern).collect();
            src.local().write(0, &pat)?;
        }
        dst.local().zero(0, max as usize)?;
        comm.bootstrap().barrier()?;
        // Rank 0's occupancy, on every rank (see starves_copies).
        let per_sm = m.function("gin_bandwidth")?.blocks_per_sm(a.threads)?;
        let per_sm = comm.bootstrap().allgather(&per_sm.to_le_bytes())?[0]
            .as_slice()
            .try_into()
            .map_or(0, u32::from_le_bytes);
        for &path in &paths {
            for &bw in &a.bw_bytes {
                for &blocks in &a.blocks {
                    if let Some(why) = starves_copies(shared.as_ref(), path, blocks, per_sm) {
                        if comm.rank() == 0 {
                            println!(
                                "bandwidth {} with {blocks} blocks skipped: {why}",
                                path.label()
                            );
                        }
                        skipped.push(format!("{} with {blocks} blocks: {why}", path.label()));
                        continue;
                    }
                    for sig_each in [false, true] {
                        let r = bandwidth(
                            &c,
                            &m,
                            path.kind(),
                            &src,
                            &dst,
                            &out,
                            bw,
                            (blocks, a.threads),
                            sig_each,
                            a.runs,
                        )?;
                        rows.push(CudaRow {
                            test: CudaTest::Bandwidth,
                            path: path.label().into(),
                            coop: format!(
                                "{blocks}x{} threads, {}",
                                a.threads,
                                if sig_each {
                                    "signal each"
                                } else {
                                    "signal last"
                                }
                            ),
                            bytes: bw,
                            value: summary(&r)?,
                            floor: None,
                            peer: None,
                            threads: a.threads,
                            peers: Vec::new(),
                        });
                    }
                }
            }
        }
    }
    if want(CudaTest::Alltoall) {
        if a.sizes.is_empty() {
            bail!("the all-to-all needs --sizes");
        }
        for &path in &paths {
            let fit = loggp_fit(&rows, path);
            for &bytes in &a.sizes {
                let iters = if bytes >= 1 << 20 {
                    (a.iters / 10).max(50)
                } else {
                    a.iters
                };
                let shape = Shape {
                    bytes,
                    iters,
                    warmup: a.warmup_for(iters),
                    coop: Coop::Block,
                    block: 512,
                    runs: a.runs,
                };
                let v = gin_alltoall(&c, &m, path.kind(), &src, &dst, &out, &shape)?;
                let p = comm.nranks() as f64;
                rows.push(CudaRow {
                    test: CudaTest::Alltoall,
                    path: path.label().into(),
                    coop: format!("{} ranks", comm.nranks()),
                    bytes,
                    value: summary(&v)?,
                    floor: None,
                    peer: fit.map(|f| {
                        (
                            "LogGP L+2o+(P-1)nG".into(),
                            f.intercept + (p - 1.0) * bytes as f64 * f.slope,
                        )
                    }),
                    threads: shape.block,
                    peers: Vec::new(),
                });
            }
        }
    }
    if comm.rank() == 0 {
        let peers: Vec<Peer> = a.peer_json.iter().map(|f| Peer::load(f)).collect();
        add_peers(&mut rows, &peers);
        let mut t = table(&rows, a.runs, &peers);
        if let Some(g) = &shared {
            t.note(format!(
                "{}: {}",
                if g.void { "WARNING" } else { "NOTE" },
                g.why
            ));
        }
        for why in &skipped {
            t.note(format!("bandwidth skipped, {why}"));
        }
        Report::new("cuda", a, vec![t], rows)?.finish(a.json.as_deref(), a.csv.as_deref())?;
    }
    comm.bootstrap().barrier()?;
    Ok(())
}

/// Ranks 0 and 1 drive the same GPU (a machine with one GPU, or
/// `GIN_CUDA_DEVICE` set alike).
struct SharedGpu {
    /// What to print.
    why: String,
    /// Without MPS the GPU time-slices the two processes' kernels, so a
    /// ping-pong waits for the other process's time slice (milliseconds) and
    /// bandwidth is that of the slices: the figures mean nothing. Under MPS
    /// the kernels run side by side, but the "peer" is this GPU's own memory.
    void: bool,
    /// The GPU's SMs.
    sms: u32,
}

/// Whether ranks 0 and 1 share a GPU. Collective: every rank says which GPU
/// it drives (its UUID: two MIG instances of one GPU differ), whether MPS
/// is on and how many SMs it has, and every rank decides from ranks 0 and
/// 1's answers, so all decide alike. A rank whose driver gives no UUID says
/// nothing, and then nothing is claimed.
fn shared_gpu(comm: &Comm, c: &CudaComm<'_>) -> Result<Option<SharedGpu>> {
    let d = c.device();
    let me = format!(
        "{} {} {}",
        d.uuid().unwrap_or("-"),
        u8::from(d.mps()),
        d.sms()
    );
    let all = comm.bootstrap().allgather(me.as_bytes())?;
    let said = |r: usize| String::from_utf8_lossy(&all[r]).into_owned();
    let (first, second) = (said(0), said(1));
    let mut f = first.split(' ');
    let (gpu, mps, sms) = (
        f.next().unwrap_or("-"),
        f.next() == Some("1"),
        f.next().and_then(|v| v.parse().ok()).unwrap_or(0),
    );
    if gpu == "-" || second.split(' ').next() != Some(gpu) {
        return Ok(None);
    }
    Ok(Some(if mps {
        SharedGpu {
            why: format!(
                "ranks 0 and 1 share one GPU (UUID {gpu}) through MPS: their kernels run side by side, but every transfer stays in this GPU's memory, so the figures are not those of a link between GPUs"
            ),
            void: false,
            sms,
        }
    } else {
        SharedGpu {
            why: format!(
                "ranks 0 and 1 share one GPU (UUID {gpu}) without MPS: it time-slices their kernels, so these figures measure time slicing, not gin-rs; give each rank its own GPU, or start MPS (nvidia-cuda-mps-control -d)"
            ),
            void: true,
            sms,
        }
    }))
}

/// Why a queue-path bandwidth run cannot work where ranks 0 and 1 share a
/// GPU through MPS and its blocks, with rank 1's one, would leave no SM
/// free: the proxy's (or soft NIC's) work on this GPU then never runs while
/// every SM spins, and rank 1's wait times out (on one H200: 130 blocks of
/// 512 threads passed, 131 and 132 stalled). Load/store needs no SM but
/// its own. `per_sm` is rank 0's, as `shared` is, so every rank decides
/// alike (the run is collective).
fn starves_copies(
    shared: Option<&SharedGpu>,
    path: CudaPath,
    blocks: u32,
    per_sm: u32,
) -> Option<String> {
    let g = shared.filter(|g| !g.void)?;
    if path == CudaPath::LoadStore || per_sm == 0 {
        return None;
    }
    spinning_sms(blocks, per_sm, g.sms).map(|busy| {
        format!(
            "on one GPU shared through MPS it would hold {busy} of its {} SMs with spinning blocks (rank 1's included), leaving none for the copies they wait for",
            g.sms
        )
    })
}

/// The SMs `blocks` spinning blocks (at most `per_sm` to an SM) and rank
/// 1's one hold, if that leaves none of `sms` free.
fn spinning_sms(blocks: u32, per_sm: u32, sms: u32) -> Option<u32> {
    let busy = blocks.div_ceil(per_sm.max(1)) + 1;
    (busy >= sms).then_some(busy)
}

/// LogGP from this run's ping-pong of `path` (block coop on load/store, as
/// the all-to-all's blocks): half round trip = (L + 2o) + n G, least squares
/// over the sizes. `None` without at least two sizes.
fn loggp_fit(rows: &[CudaRow], path: CudaPath) -> Option<crate::stats::LineFit> {
    let coop = match path {
        CudaPath::LoadStore => "block",
        CudaPath::Proxy | CudaPath::Gdaki => "thread",
    };
    let pts: Vec<(f64, f64)> = rows
        .iter()
        .filter(|r| r.test == CudaTest::Pingpong && r.path == path.label() && r.coop == coop)
        .map(|r| (r.bytes as f64, r.value.median / 2.0))
        .collect();
    crate::stats::line_fit(&pts)
}

/// The seed's all-to-all, timed on the GPU: µs per iteration, per launch.
fn gin_alltoall(
    c: &CudaComm<'_>,
    m: &Module,
    kind: BackendKind,
    send: &cuda::GpuWindow,
    recv: &cuda::GpuWindow,
    out: &DevMem,
    sh: &Shape,
) -> Result<Vec<f64>> {
    let f = m.function("gin_alltoall_timed")?;
    let n = c.comm().nranks() as u32;
    let req = DevCommRequirements {
        signals: 1,
        counters: 1,
        ..DevCommRequirements::default()
    };
    let dc = c.dev_comm_on(&req, CtxSharing::Gpu, kind)?;
    let mut v = Vec::with_capacity(sh.runs);
    for run in 0..sh.runs as u64 {
        c.comm().bootstrap().barrier()?;
        out.zero(0, 24)?;
        let base = run * u64::from(n) * u64::from(sh.iters + sh.warmup);
        // SAFETY: gin_alltoall_timed(DevComm, Window send, Window recv, u64
        // bytes, u32 iters, u32 warmup, u64 base, u64* out) in selftest.cu;
        // both windows hold a block of `bytes` per rank (`max` in `run`),
        // and `out` the 24 bytes the kernel writes.
        unsafe {
            dc.run(
                &f,
                n,
                sh.block,
                &[
                    Arg::DevComm(dc.abi()),
                    Arg::Window(send.abi()),
                    Arg::Window(recv.abi()),
                    Arg::U64(sh.bytes),
                    Arg::U32(sh.iters),
                    Arg::U32(sh.warmup),
                    Arg::U64(base),
                    Arg::Ptr(out.ptr()),
                ],
            )
        }
        .with_context(|| format!("all-to-all of {} B", sh.bytes))?;
        v.push(read_ns(out)? as f64 / f64::from(sh.iters) / 1000.0);
    }
    c.comm().bootstrap().barrier()?;
    dc.destroy()?;
    Ok(v)
}

/// One ping-pong point: size, round trips, coop.
#[derive(Clone, Copy)]
struct Shape {
    bytes: u64,
    iters: u32,
    warmup: u32,
    coop: Coop,
    block: u32,
    runs: usize,
}

/// Each peer's figure for every ping-pong and bandwidth row (the
/// all-to-all has none: its `peer` is the LogGP prediction).
fn add_peers(rows: &mut [CudaRow], peers: &[Peer]) {
    for r in rows.iter_mut().filter(|r| r.test != CudaTest::Alltoall) {
        r.peers = peers
            .iter()
            .map(|p| p.cell(r.test, &r.path, &r.coop, r.bytes, r.threads, r.value.median))
            .collect();
    }
}

fn table(rows: &[CudaRow], runs: usize, peers: &[Peer]) -> Table {
    let mut columns = vec![
        "test", "path", "coop", "size", "median", "p10", "p90", "p99", "floor", "ratio", "peer",
    ];
    columns.extend(peers.iter().map(Peer::name));
    let mut t = Table::new(
        "cuda",
        format!(
            "CUDA ranks, one GPU each: round trip (us) or one-way bandwidth (GB/s) between ranks 0 and 1, all-to-all (us) over all ranks; {runs} launches"
        ),
        &columns,
    );
    for r in rows {
        let f = |v: f64| format!("{v:.2}");
        let mut cells = vec![
            format!("{:?}", r.test).to_lowercase(),
            r.path.clone(),
            r.coop.clone(),
            human_size(r.bytes),
            f(r.value.median),
            f(r.value.p10),
            f(r.value.p90),
            f(r.value.p99),
            r.floor.as_ref().map_or("-".into(), |fl| f(fl.median)),
            r.floor.as_ref().map_or("-".into(), |fl| {
                format!("{:.2}", r.value.median / fl.median)
            }),
            r.peer.as_ref().map_or(String::new(), |(n, v)| {
                format!("{n}: {v:.2} ({:.2}x)", r.value.median / v)
            }),
        ];
        cells.extend(
            peers
                .iter()
                .enumerate()
                .map(|(i, _)| r.peers.get(i).map_or_else(String::new, PeerCell::text)),
        );
        t.row(cells);
    }
    for p in peers {
        t.note(match p {
            Peer::Found { name, file, .. } => format!(
                "{name}: its median for the same test, coop, size and threads, measured in this job ({}); (x) = gin-rs / {name}: a round trip at or below 1.00 is as fast or faster, a bandwidth at or above 1.00 as fast or faster",
                file.display()
            ),
            Peer::Missing { name, why } => format!("{name}: no figures: {why}"),
        });
    }
    t.note("ping-pong: round trip in us timed on the GPU (%globaltimer); floor = the same traffic without gin-rs, in the same job; ratio = median / floor");
    t.note("alltoall: us per iteration (put + signal to every rank, wait for all, flush), one block per peer; peer = the LogGP prediction from this run's ping-pong (half round trip = L + 2o + nG, least squares), with measured / predicted");
    t.note("bandwidth: GB/s seen by rank 0, one message split over the blocks, 50 times; signal last: each block signals after its last put (as NVSHMEM's put_bw quiets once), signal each: every put carries a signal; rank 1 checks every byte");
    t
}

fn read_ns(out: &DevMem) -> Result<u64> {
    let mut o = [0u64; 3];
    out.read(0, &mut o)?;
    if o[0] != 0 {
        bail!("kernel returned error kind {}", o[0]);
    }
    Ok(o[2])
}

#[allow(clippy::too_many_arguments)]
fn gin_pingpong(
    c: &CudaComm<'_>,
    m: &Module,
    kind: BackendKind,
    buf: &cuda::GpuWindow,
    out: &DevMem,
    sh: &Shape,
) -> Result<Vec<f64>> {
    let Shape {
        bytes,
        iters,
        warmup,
        coop,
        block,
        runs,
    } = *sh;
    // One kernel per coop: the coop is a compile-time constant there, as in
    // a user's kernel.
    let f = m.function(&kernel_name("gin_pingpong", coop, block))?;
    let req = DevCommRequirements {
        signals: 4,
        counters: 1,
        ..DevCommRequirements::default()
    };
    let dc = c.dev_comm_on(&req, CtxSharing::Gpu, kind)?;
    let mut v = Vec::with_capacity(runs);
    for run in 0..runs {
        c.comm().bootstrap().barrier()?;
        out.zero(0, 24)?;
        let base = run as u64 * u64::from(iters + warmup);
        // SAFETY: gin_pingpong_<coop>(DevComm, Window buf, u64 bytes, u32
        // iters, u32 warmup, u64 base, u64* out) in selftest.cu; `buf`
        // holds `bytes` (`max` in `run`), and `out` the 24 bytes written.
        unsafe {
            dc.run(
                &f,
                1,
                block,
                &[
                    Arg::DevComm(dc.abi()),
                    Arg::Window(buf.abi()),
                    Arg::U64(bytes),
                    Arg::U32(iters),
                    Arg::U32(warmup),
                    Arg::U64(base),
                    Arg::Ptr(out.ptr()),
                ],
            )
        }
        .with_context(|| format!("gin ping-pong {bytes} B"))?;
        v.push(read_ns(out)? as f64 / f64::from(iters) / 1000.0);
    }
    c.comm().bootstrap().barrier()?;
    dc.destroy()?;
    Ok(v)
}

#[allow(clippy::too_many_arguments)]
fn lsa_floor(
    c: &CudaComm<'_>,
    m: &Module,
    stream: &Stream,
    dst: &cuda::GpuWindow,
    flags: &cuda::GpuWindow,
    out: &DevMem,
    sh: &Shape,
    same_gpu: bool,
) -> Result<Vec<f64>> {
    let Shape {
        bytes,
        iters,
        warmup,
        coop,
        block,
        runs,
    } = *sh;
    let f = m.function(&kernel_name("gin_floor_lsa", coop, block))?;
    let (rank, peer) = (c.comm().rank(), c.comm().rank() ^ 1);
    let mut v = Vec::with_capacity(runs);
    for _ in 0..runs {
        flags.local().zero(0, 8)?;
        out.zero(0, 24)?;
        c.comm().bootstrap().barrier()?;
        if rank > 1 {
            // Ranks 0 and 1 play; the others only keep the barriers.
            v.push(0.0);
            continue;
        }
        launch_sync(
            &f,
            stream,
            block,
            &mut [
                rank as u64,
                dst.peer_base(peer).unwrap_or(0),
                // Echo what arrived, as the gin ping-pong does (its one
                // window is both source and target): the bytes a rank
                // sends are the ones the peer's NVLink stores just wrote.
                dst.local().ptr(),
                flags.peer_base(peer).unwrap_or(0),
                flags.local().ptr(),
                bytes,
                u64::from(iters),
                u64::from(warmup),
                out.ptr(),
                // The signal's release has GPU scope where ranks 0 and 1
                // share this GPU, as gin-rs's has (REACH_SAME_GPU).
                u64::from(same_gpu),
            ],
            &[4, 8, 8, 8, 8, 8, 4, 4, 8, 4],
        )?;
        v.push(read_ns(out)? as f64 / f64::from(iters) / 1000.0);
    }
    Ok(v)
}

/// Launches with raw values (`sizes[i]` bytes each, little-endian) and waits.
fn launch_sync(
    f: &Function,
    stream: &Stream,
    block: u32,
    vals: &mut [u64],
    sizes: &[usize],
) -> Result<()> {
    let mut u32s: Vec<u32> = vals.iter().map(|&v| v as u32).collect();
    let mut params: Vec<*mut std::ffi::c_void> = Vec::with_capacity(vals.len());
    for (i, &s) in sizes.iter().enumerate() {
        params.push(if s == 4 {
            (&raw mut u32s[i]).cast()
        } else {
            (&raw mut vals[i]).cast()
        });
    }
    // SAFETY: the values match the floor kernels' parameter lists in
    // selftest.cu (sizes given per parameter) and outlive the launch.
    unsafe { f.launch(stream, 1, block, &mut params)? };
    stream.sync()?;
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn proxy_floor(
    c: &CudaComm<'_>,
    m: &Module,
    stream: &Stream,
    src: &cuda::GpuWindow,
    dst: &cuda::GpuWindow,
    flags: &cuda::GpuWindow,
    out: &DevMem,
    sh: &Shape,
) -> Result<Vec<f64>> {
    let Shape {
        bytes,
        iters,
        warmup,
        runs,
        ..
    } = *sh;
    let f = m.function("gin_floor_proxy")?;
    let (rank, peer) = (c.comm().rank(), c.comm().rank() ^ 1);
    let host = HostMem::new(64)?;
    let copy = Stream::new()?;
    let mut v = Vec::with_capacity(runs);
    for _ in 0..runs {
        flags.local().zero(0, 8)?;
        out.zero(0, 24)?;
        // The kernel writes it, the forwarder reads it.
        let hf = host.atomic_u64(0)?;
        hf.store(0, Ordering::Release);
        c.comm().bootstrap().barrier()?;
        if rank > 1 {
            v.push(0.0);
            continue;
        }
        let total = u64::from(iters + warmup);
        let stop = AtomicBool::new(false);
        let peer_buf = dst.peer_base(peer).unwrap_or(0);
        let peer_flag = flags.peer_base(peer).unwrap_or(0);
        std::thread::scope(|s| -> Result<()> {
            let fwd = s.spawn(|| -> Result<()> {
                c.device().make_current()?;
                let mut last = 0;
                while last < total && !stop.load(Ordering::Relaxed) {
                    let now = hf.load(Ordering::Acquire);
                    if now == last {
                        std::hint::spin_loop();
                    } else {
                        // SAFETY: `peer_buf` is the peer's part of `dst`
                        // and `peer_flag` of `flags`, mapped here through
                        // CUDA IPC (the floor runs only without TCP), each
                        // at least `bytes` resp. 8 bytes, like the source;
                        // all stay alive until `copy.sync()` below.
                        unsafe {
                            copy.copy(peer_buf, src.local().ptr(), bytes as usize)?;
                            copy.write_u64(peer_flag, now)?;
                        }
                        last = now;
                    }
                }
                Ok(())
            });
            let r = launch_sync(
                &f,
                stream,
                1,
                &mut [
                    rank as u64,
                    host.dev(),
                    flags.local().ptr(),
                    u64::from(iters),
                    u64::from(warmup),
                    out.ptr(),
                ],
                &[4, 8, 8, 4, 4, 8],
            );
            if r.is_err() {
                stop.store(true, Ordering::Relaxed);
            }
            fwd.join()
                .map_err(|_| anyhow::anyhow!("forwarder panicked"))??;
            r
        })?;
        copy.sync()?;
        v.push(read_ns(out)? as f64 / f64::from(iters) / 1000.0);
    }
    Ok(v)
}

#[allow(clippy::too_many_arguments)]
fn bandwidth(
    c: &CudaComm<'_>,
    m: &Module,
    kind: BackendKind,
    src: &cuda::GpuWindow,
    dst: &cuda::GpuWindow,
    out: &DevMem,
    bytes: u64,
    (blocks, threads): (u32, u32),
    sig_each: bool,
    runs: usize,
) -> Result<Vec<f64>> {
    let f = m.function("gin_bandwidth")?;
    let iters = 50u32;
    let per_block = if sig_each { u64::from(iters) } else { 1 };
    let req = DevCommRequirements {
        signals: 4,
        counters: 1,
        queue_depth: 1024,
        ..DevCommRequirements::default()
    };
    let dc = c.dev_comm_on(&req, CtxSharing::Gpu, kind)?;
    let mut v = Vec::with_capacity(runs);
    for run in 0..runs as u64 {
        c.comm().bootstrap().barrier()?;
        out.zero(0, 24)?;
        // SAFETY: gin_bandwidth(DevComm, Window src, Window dst, u64 bytes,
        // u32 iters, u32 sig_each, u64 base2, u64 base3, u64* out) in
        // selftest.cu; both windows hold `bytes` (`max` in `run`), and
        // `out` the 24 bytes the kernel writes.
        unsafe {
            dc.run(
                &f,
                blocks,
                threads,
                &[
                    Arg::DevComm(dc.abi()),
                    Arg::Window(src.abi()),
                    Arg::Window(dst.abi()),
                    Arg::U64(bytes),
                    Arg::U32(iters),
                    Arg::U32(u32::from(sig_each)),
                    Arg::U64(run * per_block * u64::from(blocks)),
                    Arg::U64(run),
                    Arg::Ptr(out.ptr()),
                ],
            )
        }
        .with_context(|| format!("bandwidth with {blocks} blocks"))?;
        let mut o = [0u64; 3];
        out.read(0, &mut o)?;
        if o[0] != 0 {
            bail!("bandwidth kernel returned error kind {}", o[0]);
        }
        if c.comm().rank() == 0 {
            v.push((bytes * u64::from(iters)) as f64 / o[2] as f64);
        } else {
            v.push(0.0);
        }
    }
    c.comm().bootstrap().barrier()?;
    dc.destroy()?;
    if c.comm().rank() == 1 {
        // Every byte of the message arrived: rank 0's pattern, then cleared
        // so that the next configuration proves its own delivery.
        let mut got = vec![0u8; bytes as usize];
        dst.local().read(0, &mut got)?;
        if let Some(i) = (0..got.len()).find(|&i| got[i] != pattern(i)) {
            bail!(
                "bandwidth with {blocks} blocks: byte {i} of {bytes} is {:#x}, expected {:#x}",
                got[i],
                pattern(i)
            );
        }
        dst.local().zero(0, bytes as usize)?;
    }
    c.comm().bootstrap().barrier()?;
    Ok(v)
}

/// The bytes rank 0 sends in the bandwidth test.
fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(131) ^ (i >> 11)) as u8
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bandwidth::BandwidthArgs;
    use crate::pingpong::PingPongArgs;

    fn pingpong(args: &[&str]) -> Common {
        #[derive(clap::Parser)]
        struct P {
            #[command(flatten)]
            a: PingPongArgs,
        }
        let argv = std::iter::once("pingpong").chain(args.iter().copied());
        <P as clap::Parser>::parse_from(argv).a.common
    }

    #[test]
    fn pingpong_flags_map_onto_the_cuda_benchmark() {
        let c = pingpong(&[
            "--device",
            "cuda",
            "--backend",
            "proxy",
            "--coop",
            "warp",
            "--sizes",
            "8,1k",
        ]);
        let a = CudaArgs::from_common(&c, CudaTest::Pingpong).unwrap();
        assert_eq!(a.paths, [CudaPath::Proxy]);
        assert_eq!(a.coops, [Coop::Warp]);
        assert_eq!(a.sizes, [8, 1024]);
        assert_eq!(a.tests, [CudaTest::Pingpong]);
        let both =
            CudaArgs::from_common(&pingpong(&["--device", "cuda"]), CudaTest::Pingpong).unwrap();
        assert_eq!(
            both.paths,
            [CudaPath::LoadStore, CudaPath::Proxy, CudaPath::Gdaki]
        );
    }

    /// `--queue-paths none` builds the kernels with the load/store path
    /// alone: it measures `--paths loadstore` and refuses the queue paths,
    /// naming the path, before any rank starts.
    #[test]
    fn queue_paths_none_measures_load_store_only() {
        #[derive(clap::Parser)]
        struct P {
            #[command(flatten)]
            a: CudaArgs,
        }
        let parse = |args: &[&str]| {
            <P as clap::Parser>::parse_from(std::iter::once("cuda").chain(args.iter().copied())).a
        };
        assert_eq!(parse(&[]).queue_paths, QueuePaths::All);
        let lsa = parse(&["--queue-paths", "none", "--paths", "loadstore"]);
        assert_eq!(lsa.queue_paths, QueuePaths::None);
        lsa.validate().unwrap();
        let e = parse(&["--queue-paths", "none", "--paths", "loadstore,gdaki"])
            .validate()
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--paths gdaki") && e.contains("--queue-paths none"),
            "{e}"
        );
        assert!(parse(&["--queue-paths", "none"]).validate().is_err());
    }

    #[test]
    fn bandwidth_sizes_become_message_sizes() {
        #[derive(clap::Parser)]
        struct P {
            #[command(flatten)]
            a: BandwidthArgs,
        }
        let c =
            <P as clap::Parser>::parse_from(["bandwidth", "--device", "cuda", "--sizes", "1m,4m"])
                .a
                .common;
        let a = CudaArgs::from_common(&c, CudaTest::Bandwidth).unwrap();
        assert_eq!(a.bw_bytes, [1 << 20, 4 << 20]);
        assert_eq!(a.tests, [CudaTest::Bandwidth]);
        let g = <P as clap::Parser>::parse_from([
            "bandwidth",
            "--device",
            "cuda",
            "--backend",
            "gdaki",
        ])
        .a
        .common;
        let a = CudaArgs::from_common(&g, CudaTest::Bandwidth).unwrap();
        assert_eq!(a.paths, [CudaPath::Gdaki]);
    }

    #[test]
    fn each_coop_has_its_kernel_and_wide_blocks_the_1024_one() {
        for (base, coop, threads, want) in [
            ("gin_pingpong", Coop::Thread, 1, "gin_pingpong_thread"),
            ("gin_pingpong", Coop::Warp, 32, "gin_pingpong_warp"),
            ("gin_floor_lsa", Coop::Block, 512, "gin_floor_lsa_block"),
            ("gin_pingpong", Coop::Block, 544, "gin_pingpong_block_1024"),
        ] {
            assert_eq!(kernel_name(base, coop, threads), want);
        }
        // Every name the bench asks for is a kernel of gin-selftest's selftest.cu.
        for base in ["gin_pingpong", "gin_floor_lsa"] {
            for (coop, threads) in [
                (Coop::Thread, 1),
                (Coop::Warp, 32),
                (Coop::Block, 512),
                (Coop::Block, 1024),
            ] {
                let name = kernel_name(base, coop, threads);
                assert!(
                    gin_selftest::KERNELS.contains(&format!("({name},")),
                    "{name} is not defined in selftest.cu"
                );
            }
        }
    }

    #[test]
    fn spinning_blocks_must_leave_an_sm_free() {
        // One H200 (132 SMs) shared through MPS, 512-thread blocks one to
        // an SM: 130 blocks passed there, 131 and 132 stalled.
        assert_eq!(spinning_sms(130, 1, 132), None);
        assert_eq!(spinning_sms(131, 1, 132), Some(132));
        assert_eq!(spinning_sms(132, 1, 132), Some(133));
        // 256-thread blocks, three to an SM: 264 blocks passed.
        assert_eq!(spinning_sms(264, 3, 132), None);
        assert_eq!(spinning_sms(16, 0, 132), None);
    }

    #[test]
    fn peers_get_a_column_each_beside_the_rows_they_measured() {
        let row = |test, coop: &str, bytes, threads, median| CudaRow {
            test,
            path: "load/store".into(),
            coop: coop.into(),
            bytes,
            value: Summary::of(&[median]).unwrap(),
            floor: None,
            peer: None,
            threads,
            peers: Vec::new(),
        };
        let mut rows = vec![
            row(CudaTest::Pingpong, "block", 1024, 1024, 3.84),
            row(CudaTest::Pingpong, "block", 8, 512, 3.40),
            row(CudaTest::Alltoall, "2 ranks", 8, 512, 9.0),
        ];
        let stat = Summary::of(&[2.91]).unwrap();
        let peers = [
            Peer::Found {
                name: "NVSHMEM 3.4.5".into(),
                file: "peer-nvshmem.json".into(),
                like: None,
                rows: vec![crate::peers::PeerRow {
                    test: CudaTest::Pingpong,
                    path: "nvshmem".into(),
                    coop: "block".into(),
                    threads: Some(1024),
                    bytes: 1024,
                    value: stat,
                }],
            },
            Peer::Missing {
                name: "nccl".into(),
                why: "no nccl_device.h".into(),
            },
        ];
        add_peers(&mut rows, &peers);
        assert!(rows[2].peers.is_empty(), "the all-to-all has no peer");
        let t = table(&rows, 1, &peers);
        assert_eq!(&t.columns[10..], ["peer", "NVSHMEM 3.4.5", "nccl"]);
        assert_eq!(
            t.rows[0][11..],
            ["2.91 (1.32x)", "- (not run: no nccl_device.h)"]
        );
        assert_eq!(t.rows[1][11], "- (not measured by the peer)");
        assert_eq!(t.rows[2][11..], ["", ""]);
        assert!(
            t.notes
                .iter()
                .any(|n| n == "nccl: no figures: no nccl_device.h")
        );
        assert!(
            t.notes
                .iter()
                .any(|n| n.starts_with("NVSHMEM 3.4.5: its median")
                    && n.contains("peer-nvshmem.json"))
        );
        // The JSON rows carry the peers' figures.
        let j = serde_json::to_value(&rows[0]).unwrap();
        assert_eq!(j["peers"][0]["value"], 2.91);
        assert_eq!(j["peers"][1]["why"], "not run: no nccl_device.h");
        assert!(
            serde_json::to_value(&rows[2])
                .unwrap()
                .get("peers")
                .is_none()
        );
    }

    #[test]
    fn peer_json_is_repeatable() {
        #[derive(clap::Parser)]
        struct P {
            #[command(flatten)]
            a: CudaArgs,
        }
        let a = <P as clap::Parser>::parse_from([
            "cuda",
            "--peer-json",
            "a.json",
            "--peer-json",
            "b.json",
        ])
        .a;
        assert_eq!(
            a.peer_json,
            [std::path::PathBuf::from("a.json"), "b.json".into()]
        );
    }

    #[test]
    fn what_gpus_cannot_do_is_refused_by_name() {
        for (args, want) in [
            (&["--device", "cuda", "--ranks", "4"][..], "exactly 2 ranks"),
            (
                &["--device", "cuda", "--transport", "tcp"][..],
                "GIN_TRANSPORT=tcp gin-bench cuda",
            ),
            (&["--device", "cuda", "--cpus", "0"][..], "--cpus"),
        ] {
            let e = CudaArgs::from_common(&pingpong(args), CudaTest::Pingpong).unwrap_err();
            assert!(e.to_string().contains(want), "{args:?}: {e}");
        }
    }
}
