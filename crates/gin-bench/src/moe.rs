//! `gin-bench moe`: gin-ep's MoE dispatch and combine, low-latency (`--mode
//! ll`) or high-throughput (`--mode ht`), beside a floor measured in the
//! same job.
//!
//! Inputs come from gin-ep's oracle (traceable values, top-k of |randn| + 1
//! with some empty slots), and the first step is checked as the oracle
//! checks it before anything is timed. One run is `--iters` steps; a step's
//! dispatch and combine are timed separately, and a run's figure is the
//! slowest rank's mean (the collective is done when the last rank is).
//!
//! Bytes follow DeepEP's accounting: low-latency dispatch counts one
//! message per selected expert (BF16 `2·hidden`, FP8
//! `hidden + hidden/128·4 + 16`), combine `2·hidden` per selection;
//! high-throughput counts one token per (token, destination rank) both ways. The floor moves the same
//! bytes between the same ranks with the plainest code: one put per peer
//! of the whole block, one signal each, wait for every peer, flush.
//!
//! `--device cuda` runs either mode on CUDA ranks (gin-ep's
//! `CudaBuffer`, kernels including `gin/gin.cuh`; ranks share a GPU where
//! there are fewer GPUs than ranks) beside a floor kernel (`ep_floor`: the
//! same bytes to each peer in equal parts over as many blocks as the
//! phases' kernels use, one put and one signal per part; a single block per
//! peer, as before 2026-11-25, copied too slowly to bound anything). Each
//! phase is timed on the GPU (`%globaltimer`, from the kernel's first block
//! start to its last block end) after a bootstrap barrier; a run's figure
//! is the slowest rank's mean, as on CPU ranks. `--inputs device` keeps the
//! tokens, routing and combined output in GPU memory (gin-ep's
//! `ll_dispatch_device`, `ll_combine_device`): the dispatch kernel then
//! stages the messages itself, inside the timed kernel, and no step copies
//! anything to or from the host. With `--mode ht`, `--inputs device` runs
//! `ht_dispatch_device` and `ht_combine_device`: the tokens stay on the
//! GPU (copied into the send window beside the notify kernel) and the
//! routing is read back and checked before the notify kernel, outside the
//! dispatch's GPU clock as host inputs' check is; so CUDA ranks also report
//! a "dispatch call" row: the host's wall time of the whole dispatch call
//! (read-back, checks, plan, kernels and waits), the slowest rank's mean.

use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use gin_core::{Comm, DevCommRequirements, Local, Remote, Settings};
use gin_ep::oracle::{self, RankInput};
use gin_ep::{Buffer, Config, Mode};
use serde::{Deserialize, Serialize};

use crate::common::{Common, Device};
use crate::progress::Progress;
use crate::ranks;
use crate::report::{Report, Table};
use crate::stats::Row;

/// Where `--device cuda`'s inputs and output live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MoeInputs {
    /// Host slices, staged into GPU memory by gin-ep each step.
    #[default]
    Host,
    /// GPU memory: the dispatch kernel stages the messages itself.
    Device,
}

/// The two schemes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
pub enum MoeMode {
    /// Low-latency: straight to the experts' ranks, slots sized for the maximum.
    Ll,
    /// High-throughput: counts first, two stages through credit rings.
    Ht,
}

#[derive(Debug, Clone, Args, Serialize, Deserialize)]
#[command(
    mut_arg("ranks", |a| a.default_value("2").required(false)),
    mut_arg("sizes", |a| a.default_value("8").required(false).help("Unused by moe (see --tokens, --hidden)")),
    mut_arg("iters", |a| a.default_value("20").required(false).help("Steps per run")),
    mut_arg("runs", |a| a.default_value("5").required(false)),
)]
pub struct MoeArgs {
    /// Low-latency or high-throughput.
    #[arg(long, value_enum, default_value_t = MoeMode::Ll)]
    pub mode: MoeMode,
    /// Tokens per rank (DeepEP's low-latency shape: 128; high-throughput: 4096).
    #[arg(long, default_value_t = 128)]
    pub tokens: usize,
    /// Elements per token.
    #[arg(long, default_value_t = 7168)]
    pub hidden: usize,
    /// Experts per token.
    #[arg(long, default_value_t = 8)]
    pub topk: usize,
    /// Experts in the job (default 32 per rank: DeepEP's 256 at 8 ranks).
    #[arg(long)]
    pub experts: Option<usize>,
    /// Dispatch as FP8 with per-128-element scales.
    #[arg(long)]
    pub fp8: bool,
    /// Emulated hosts (high-throughput mode; each rank's host id is set
    /// from its rank, so `auto` crosses hosts over tcp).
    #[arg(long, default_value_t = 1)]
    pub hosts: usize,
    /// High-throughput channels (each with its own context, rings and
    /// credits). Default: 2 on CPU ranks (lanes of a thread), on CUDA ranks
    /// `gin_ep::CUDA_HT_CHANNELS` bounded by the SMs of a rank's share of
    /// its GPU (a block each: `Config::with_cuda_channels`).
    #[arg(long)]
    pub channels: Option<usize>,
    /// High-throughput: threads per rank running the channels (1: the rank
    /// thread interleaves them).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Where a step's inputs and output live (`--device cuda`): `host`
    /// slices gin-ep stages, or `device` memory (no host copy in the step).
    #[arg(long, value_enum, default_value_t = MoeInputs::Host)]
    #[serde(default)]
    pub inputs: MoeInputs,
    #[command(flatten)]
    #[serde(flatten)]
    pub common: Common,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MoeResult {
    pub ranks: usize,
    pub mode: MoeMode,
    pub backend: String,
    pub paths: Vec<String>,
    pub tokens: usize,
    pub hidden: usize,
    pub topk: usize,
    pub experts: usize,
    pub fp8: bool,
    pub hosts: usize,
    #[serde(default)]
    pub channels: usize,
    #[serde(default)]
    pub threads: usize,
    /// Rank 0's bytes per step (DeepEP's accounting) over the slowest
    /// rank's time; floors move the same bytes by plain puts.
    pub dispatch: Row,
    pub combine: Row,
    pub total: Row,
    /// CUDA ranks: the wall time of the whole dispatch call on the host
    /// (`ht_dispatch_device`, `ht_dispatch`, ...: from the call to its
    /// return, so with the routing's read-back and check, the plan and
    /// the waits), the slowest rank's mean, beside the dispatch's GPU
    /// clock (`dispatch`, which starts at the notify kernel).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dispatch_call: Option<Row>,
    /// CUDA ranks, high-throughput mode: the dispatch kernel alone (GPU
    /// clock, its first block's start to its last block's end), the
    /// slowest rank's mean: `dispatch` less the notify kernel, the host's
    /// plan and the tokens' copy before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dispatch_kernel: Option<Row>,
    /// `cpu` or `cuda` ranks.
    #[serde(default)]
    pub device: String,
    /// Where the inputs and output lived (CUDA ranks).
    #[serde(default)]
    pub inputs: MoeInputs,
}

pub fn run(args: &MoeArgs) -> Result<()> {
    let c = &args.common;
    let cuda = c.device == Device::Cuda;
    if cuda {
        // What every subcommand checks, but for the device (moe runs CUDA
        // ranks itself).
        Common {
            device: Device::Cpu,
            ..c.clone()
        }
        .validate("moe")?;
        check_cuda_args(args)?;
    } else {
        c.validate("moe")?;
        check_cpu_args(args)?;
    }
    if args.tokens == 0 || args.hidden == 0 || args.topk == 0 || args.hosts == 0 {
        bail!("--tokens, --hidden, --topk and --hosts must be positive");
    }
    if ranks::is_rank() {
        crate::common::apply_affinity(&c.cpus)?;
        return if cuda {
            cuda_rank_main(args)
        } else {
            rank_main(args)
        };
    }
    let progress = Progress::new((c.ranks.len() * c.runs) as u64, "moe");
    let mut all = Vec::new();
    for &n in &c.ranks {
        if n % args.hosts != 0 {
            bail!("--ranks {n} does not split into --hosts {}", args.hosts);
        }
        progress.println(&format!(
            "moe {:?}: {n} ranks, {} tokens x {} hidden, top-{}, path {}...",
            args.mode,
            args.tokens,
            args.hidden,
            args.topk,
            c.path_label()
        ));
        let r: MoeResult = progress.job(c.runs as u64, |mut env| {
            env.extend(c.env());
            ranks::spawn_self(n, "moe", args, &env)
        })?;
        all.push(r);
    }
    progress.finish();
    let t = table(&all);
    Report::new("moe", args, vec![t], all)?.finish(c.json.as_deref(), c.csv.as_deref())
}

fn table(all: &[MoeResult]) -> Table {
    let title = all.first().map_or_else(String::new, |r| {
        format!(
            "MoE {} (gin-ep{}), {} tokens x hidden {}, top-{}, {}, backend {}, rank 0's paths {}",
            if r.mode == MoeMode::Ll {
                "low-latency"
            } else {
                "high-throughput"
            },
            match (r.device.as_str(), r.inputs) {
                ("cuda", MoeInputs::Device) => ", CUDA ranks, inputs and output in GPU memory",
                ("cuda", MoeInputs::Host) => ", CUDA ranks",
                _ => "",
            },
            r.tokens,
            r.hidden,
            r.topk,
            if r.fp8 { "FP8 dispatch" } else { "BF16" },
            r.backend,
            r.paths.join(",")
        )
    });
    let mut t = Table::new(
        "moe",
        title,
        &[
            "ranks",
            "experts",
            "hosts",
            "phase",
            "median µs",
            "p10",
            "p90",
            "GB/s",
            "floor µs",
            "vs floor",
        ],
    );
    for r in all {
        let call = r.dispatch_call.as_ref().map(|c| ("dispatch call", c));
        let kernel = r.dispatch_kernel.as_ref().map(|k| ("dispatch kernel", k));
        for (phase, row) in [
            ("dispatch", &r.dispatch),
            ("combine", &r.combine),
            ("both", &r.total),
        ]
        .into_iter()
        .chain(call)
        .chain(kernel)
        {
            t.row(vec![
                r.ranks.to_string(),
                r.experts.to_string(),
                r.hosts.to_string(),
                phase.to_owned(),
                format!("{:.1}", row.us.median),
                format!("{:.1}", row.us.p10),
                format!("{:.1}", row.us.p90),
                format!("{:.2}", row.gbps),
                format!("{:.1}", row.floor_us.median),
                format!("{:.2}x", row.ratio),
            ]);
        }
    }
    t.note(
        "per step: the slowest rank's mean over a run, median and p10/p90 over runs; GB/s = rank 0's bytes \
         (DeepEP's accounting) / median; floor = the same bytes by plain puts + one signal per part \
         (CPU ranks: one part per peer; CUDA ranks: each peer's bytes over the phases' grid); \
         CUDA ranks' phases are GPU clocks (the dispatch from the first kernel's start, after \
         the host's input checks), \"dispatch call\" the host's wall time of the whole dispatch \
         call (checks, read-backs, plan and waits included), \"dispatch kernel\" (high-throughput \
         mode) the dispatch kernel alone, without the notify kernel, plan and copies before it",
    );
    t
}

/// Bytes each rank sends each rank per step, for dispatch and combine, from
/// every rank's routing (`[src * n + dst]`).
fn traffic(cfg: &Config, inputs: &[RankInput]) -> (Vec<u64>, Vec<u64>) {
    let n = inputs.len();
    let l = cfg.local_experts(n);
    let (k, h2) = (cfg.topk, 2 * cfg.hidden as u64);
    let msg = if cfg.fp8 {
        (cfg.hidden + cfg.hidden / 128 * 4 + 16) as u64
    } else {
        h2
    };
    let (mut disp, mut comb) = (vec![0u64; n * n], vec![0u64; n * n]);
    for (src, inp) in inputs.iter().enumerate() {
        for t in 0..inp.tokens {
            let row = &inp.topk_idx[t * k..(t + 1) * k];
            for dst in 0..n {
                let sel = row
                    .iter()
                    .filter(|&&e| e >= 0 && e as usize / l == dst)
                    .count() as u64;
                let per = if cfg.mode == Mode::LowLatency {
                    sel
                } else {
                    u64::from(sel > 0)
                };
                disp[src * n + dst] += per * msg;
                comb[dst * n + src] += per * h2;
            }
        }
    }
    (disp, comb)
}

/// Joins the job, as one of `--hosts` emulated hosts.
fn join(args: &MoeArgs) -> Result<Comm> {
    let bootstrap = gin_bootstrap::Bootstrap::from_env()?;
    let mut settings = Settings::from_env()?;
    let (rank, n) = (bootstrap.rank(), bootstrap.nranks());
    if args.hosts > 1 {
        settings.host_id = format!("gin-bench-moe-host-{}", rank / (n / args.hosts));
    }
    Ok(Comm::with_settings(bootstrap, settings)?)
}

fn rank_main(args: &MoeArgs) -> Result<()> {
    let c = &args.common;
    let comm = join(args)?;
    let (rank, n) = (comm.rank(), comm.nranks());
    let experts = args.experts.unwrap_or(32 * n);
    let mut cfg = match args.mode {
        MoeMode::Ll => Config::low_latency(args.hidden, args.tokens, experts, args.topk),
        MoeMode::Ht => Config {
            channels: args.channels.unwrap_or(2),
            ..Config::high_throughput(args.hidden, args.tokens, experts, args.topk)
        },
    };
    cfg.fp8 = args.fp8;
    let mut buf = Buffer::new(&comm, cfg)?;
    buf.set_threads(args.threads);
    let mut out = vec![gin_ep::Bf16::ZERO; args.tokens * args.hidden];
    let inputs: Vec<RankInput> = (0..n)
        .map(|r| oracle::rank_input(42, r, n, args.tokens, args.hidden, experts, args.topk))
        .collect();
    let (disp, comb) = traffic(&cfg, &inputs);
    crate::common::bind_rank_thread(c, comm.local_rank())?;
    verify(&mut buf, &inputs)?;
    let floor = Floor::new(&comm, &disp, &comb)?;
    let (mut d_runs, mut c_runs, mut t_runs) = (Vec::new(), Vec::new(), Vec::new());
    let (mut fd_runs, mut fc_runs, mut ft_runs) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..c.warmup_for(c.iters) {
        step(&mut buf, &inputs[rank], &mut out)?;
        floor.step(true)?;
        floor.step(false)?;
    }
    for _ in 0..c.runs {
        comm.bootstrap().barrier()?;
        let (mut td, mut tc) = (0.0, 0.0);
        for _ in 0..c.iters {
            let (a, b) = step(&mut buf, &inputs[rank], &mut out)?;
            td += a;
            tc += b;
        }
        comm.bootstrap().barrier()?;
        let (mut fd, mut fc) = (0.0, 0.0);
        for _ in 0..c.iters {
            fd += floor.step(true)?;
            fc += floor.step(false)?;
        }
        let it = c.iters as f64;
        let slow = slowest(&comm, &[td / it, tc / it, fd / it, fc / it])?;
        d_runs.push(slow[0]);
        c_runs.push(slow[1]);
        t_runs.push(slow[0] + slow[1]);
        fd_runs.push(slow[2]);
        fc_runs.push(slow[3]);
        ft_runs.push(slow[2] + slow[3]);
        crate::progress::tick(rank);
    }
    let (db, cb) = (
        disp[rank * n..(rank + 1) * n].iter().sum::<u64>() as f64,
        (0..n).map(|s| comb[s * n + rank]).sum::<u64>() as f64,
    );
    if rank == 0 {
        ranks::emit(&MoeResult {
            ranks: n,
            mode: args.mode,
            backend: ranks::backend_label(&floor.dc),
            paths: comm.path_names().iter().map(|s| (*s).to_owned()).collect(),
            tokens: args.tokens,
            hidden: args.hidden,
            topk: args.topk,
            experts,
            fp8: args.fp8,
            hosts: args.hosts,
            channels: cfg.channels,
            threads: args.threads,
            dispatch: Row::new(db, d_runs, fd_runs).context("no samples")?,
            combine: Row::new(cb, c_runs, fc_runs).context("no samples")?,
            total: Row::new(db + cb, t_runs, ft_runs).context("no samples")?,
            dispatch_call: None,
            dispatch_kernel: None,
            device: "cpu".into(),
            inputs: MoeInputs::Host,
        })?;
    }
    floor.dc.destroy()?;
    buf.destroy()?;
    Ok(())
}

/// What CPU ranks refuse, before any rank starts.
fn check_cpu_args(args: &MoeArgs) -> Result<()> {
    if args.inputs == MoeInputs::Device {
        bail!("--inputs device is for --device cuda (CPU ranks' inputs are host memory)");
    }
    Ok(())
}

/// What `--device cuda` supports, checked before any rank starts; and that
/// a GPU is there (else an error saying it needs one, and why not).
fn check_cuda_args(args: &MoeArgs) -> Result<()> {
    if !args.common.cpus.is_empty() {
        bail!("--cpus has no meaning for --device cuda (the ranks' work runs on the GPUs)");
    }
    if let Some(why) = gin_core::cuda::skip_reason() {
        bail!("gin-bench moe --device cuda needs a GPU: {why}");
    }
    Ok(())
}

/// One rank of `--device cuda`: the step on CUDA ranks (low-latency or
/// high-throughput, from host or device inputs), checked once with the
/// oracle, then timed beside the floor kernel.
fn cuda_rank_main(args: &MoeArgs) -> Result<()> {
    use gin_ep::cuda::{CudaBuffer, CudaFloor};
    let c = &args.common;
    let comm = join(args)?;
    let (rank, n) = (comm.rank(), comm.nranks());
    let experts = args.experts.unwrap_or(32 * n);
    let cuda = comm.cuda()?;
    let mut cfg = match args.mode {
        MoeMode::Ll => Config::low_latency(args.hidden, args.tokens, experts, args.topk),
        MoeMode::Ht => {
            let ht = Config::high_throughput(args.hidden, args.tokens, experts, args.topk);
            if let Some(channels) = args.channels {
                Config { channels, ..ht }
            } else {
                // The SMs each rank may use: every rank of this job runs on
                // this machine, spread over its GPUs.
                let gpus = gin_core::cuda::available()?.max(1);
                let sms = cuda.device().sms() as usize / n.div_ceil(gpus);
                ht.with_cuda_channels(sms)
            }
        }
    };
    cfg.fp8 = args.fp8;
    let mut buf = CudaBuffer::new(&cuda, cfg)?;
    let inputs: Vec<RankInput> = (0..n)
        .map(|r| oracle::rank_input(42, r, n, args.tokens, args.hidden, experts, args.topk))
        .collect();
    let (disp, comb) = traffic(&cfg, &inputs);
    let me = &inputs[rank];
    let dev = match args.inputs {
        MoeInputs::Host => None,
        MoeInputs::Device => Some(DevInputs::upload(&cuda, me, args.hidden)?),
    };
    cuda_verify(&mut buf, &inputs, dev.as_ref())?;
    let mut floor = CudaFloor::new(
        &cuda,
        &disp[rank * n..(rank + 1) * n],
        &comb[rank * n..(rank + 1) * n],
    )?;
    // Per step: dispatch, combine, floor dispatch, floor combine (GPU
    // clocks), the dispatch call's wall time, the dispatch kernel alone (µs).
    let mut step = |timed: &mut [f64; 6]| -> Result<()> {
        comm.bootstrap().barrier()?;
        let call = cuda_phases(&comm, &mut buf, args.mode, me, dev.as_ref())?;
        let (kd, kc) = buf.last_kernels();
        let kernel = buf.last_dispatch_kernel().us();
        comm.bootstrap().barrier()?;
        let fd = floor.step(true)?;
        comm.bootstrap().barrier()?;
        let fc = floor.step(false)?;
        for (t, k) in timed
            .iter_mut()
            .zip([kd.us(), kc.us(), fd.us(), fc.us(), call, kernel])
        {
            *t += k;
        }
        Ok(())
    };
    for _ in 0..c.warmup_for(c.iters) {
        step(&mut [0.0; 6])?;
    }
    let mut samples: [Vec<f64>; 8] = Default::default();
    for _ in 0..c.runs {
        let mut sums = [0.0; 6];
        for _ in 0..c.iters {
            step(&mut sums)?;
        }
        let it = c.iters as f64;
        let slow = slowest(&comm, &sums.map(|v| v / it))?;
        for (i, v) in [
            slow[0],
            slow[1],
            slow[0] + slow[1],
            slow[2],
            slow[3],
            slow[2] + slow[3],
            slow[4],
            slow[5],
        ]
        .into_iter()
        .enumerate()
        {
            samples[i].push(v);
        }
        crate::progress::tick(rank);
    }
    let (db, cb) = (
        disp[rank * n..(rank + 1) * n].iter().sum::<u64>() as f64,
        (0..n).map(|s| comb[s * n + rank]).sum::<u64>() as f64,
    );
    if rank == 0 {
        let [d, cm, t, fd, fc, ft, call, kernel] = samples;
        ranks::emit(&MoeResult {
            ranks: n,
            mode: args.mode,
            backend: buf.backend_name().to_owned(),
            paths: vec![format!("GPU {}", cuda.device().name())],
            tokens: args.tokens,
            hidden: args.hidden,
            topk: args.topk,
            experts,
            fp8: args.fp8,
            hosts: args.hosts,
            channels: if args.mode == MoeMode::Ht {
                cfg.channels
            } else {
                0
            },
            threads: 0,
            dispatch: Row::new(db, d, fd.clone()).context("no samples")?,
            combine: Row::new(cb, cm, fc).context("no samples")?,
            total: Row::new(db + cb, t, ft).context("no samples")?,
            dispatch_call: Some(Row::new(db, call, fd.clone()).context("no samples")?),
            dispatch_kernel: match args.mode {
                MoeMode::Ht => Some(Row::new(db, kernel, fd).context("no samples")?),
                MoeMode::Ll => None,
            },
            device: "cuda".into(),
            inputs: args.inputs,
        })?;
    }
    floor.destroy()?;
    buf.destroy()?;
    Ok(())
}

/// A step's dispatch, identity expert and combine on CUDA ranks, a
/// bootstrap barrier before the combine (each phase's clock is read
/// after); the dispatch call's wall time on the host, µs.
fn cuda_phases(
    comm: &Comm,
    buf: &mut gin_ep::cuda::CudaBuffer<'_, '_>,
    mode: MoeMode,
    me: &RankInput,
    dev: Option<&DevInputs>,
) -> Result<f64> {
    let t0 = Instant::now();
    let call = |t0: Instant| t0.elapsed().as_secs_f64() * 1e6;
    let took;
    if let (MoeMode::Ht, Some(dv)) = (mode, dev) {
        // The routing is read back and checked before the notify kernel
        // (outside the GPU clock, as host inputs' check is, inside the
        // call's wall time); the tokens never leave the GPU.
        let s = buf.ht_dispatch_device(&dv.inputs())?;
        took = call(t0);
        buf.ht_echo_device(&s)?;
        comm.bootstrap().barrier()?;
        buf.ht_combine_device(&s, &dv.out)?;
    } else if mode == MoeMode::Ht {
        // The dispatch's clock runs from the notify kernel's start to the
        // dispatch kernel's end (the plan built on the host between).
        let d = buf.ht_dispatch(&me.x, &me.topk_idx, &me.weights)?;
        took = call(t0);
        buf.ht_echo(&d)?;
        comm.bootstrap().barrier()?;
        buf.ht_combine(&d)?;
    } else if let Some(dv) = dev {
        let s = buf.ll_dispatch_device(&dv.inputs())?;
        took = call(t0);
        buf.ll_echo_device(&s)?;
        comm.bootstrap().barrier()?;
        buf.ll_combine_device(&s, &dv.out)?;
    } else {
        let d = buf.ll_dispatch(&me.x, &me.topk_idx, &me.weights)?;
        took = call(t0);
        buf.ll_echo(&d)?;
        comm.bootstrap().barrier()?;
        buf.ll_combine(&d)?;
    }
    Ok(took)
}

/// A rank's inputs and output in GPU memory for `--inputs device`,
/// uploaded once before anything is timed (a framework's tensors).
struct DevInputs {
    x: gin_core::cuda::DevMem,
    idx: gin_core::cuda::DevMem,
    w: gin_core::cuda::DevMem,
    out: gin_core::cuda::DevMem,
    tokens: usize,
}

impl DevInputs {
    fn upload(cuda: &gin_core::cuda::CudaComm<'_>, me: &RankInput, hidden: usize) -> Result<Self> {
        use gin_core::cuda::DevMem;
        cuda.device().make_current()?;
        let mem = |bytes: usize| DevMem::new(bytes.max(16));
        let (x, idx, w) = (
            mem(2 * me.x.len())?,
            mem(8 * me.topk_idx.len())?,
            mem(4 * me.weights.len())?,
        );
        if me.tokens > 0 {
            x.write(0, &me.x)?;
            idx.write(0, &me.topk_idx)?;
            w.write(0, &me.weights)?;
        }
        Ok(Self {
            x,
            idx,
            w,
            out: mem(2 * me.tokens * hidden)?,
            tokens: me.tokens,
        })
    }

    fn inputs(&self) -> gin_ep::cuda::DeviceInputs<'_> {
        gin_ep::cuda::DeviceInputs {
            x: &self.x,
            topk_idx: &self.idx,
            topk_weights: &self.w,
            tokens: self.tokens,
        }
    }
}

/// One CUDA step with the oracle's checks, before timing (high-throughput
/// from `dev` where given: the path the timed steps take).
fn cuda_verify(
    buf: &mut gin_ep::cuda::CudaBuffer<'_, '_>,
    inputs: &[RankInput],
    dev: Option<&DevInputs>,
) -> Result<()> {
    let cfg = *buf.config();
    let rank = buf.rank();
    let me = &inputs[rank];
    let tables: Vec<Vec<i64>> = inputs.iter().map(|i| i.topk_idx.clone()).collect();
    let combined = if let (Mode::HighThroughput, Some(dv)) = (cfg.mode, dev) {
        let s = buf.ht_dispatch_device(&dv.inputs())?;
        let d = buf.ht_read_back(&s)?;
        let got = buf.ht_received(&d)?;
        oracle::check_ht_view(rank, &cfg, buf.active(), &got, inputs, &tables)
            .map_err(anyhow::Error::msg)?;
        buf.ht_echo_device(&s)?;
        buf.ht_combine_device(&s, &dv.out)?;
        let mut raw = vec![0u16; s.tokens() * cfg.hidden];
        if !raw.is_empty() {
            dv.out.read(0, &mut raw)?;
        }
        gin_ep::Combined {
            x: raw.into_iter().map(gin_ep::Bf16).collect(),
            lost: Vec::new(),
        }
    } else if cfg.mode == Mode::HighThroughput {
        let d = buf.ht_dispatch(&me.x, &me.topk_idx, &me.weights)?;
        let got = buf.ht_received(&d)?;
        oracle::check_ht_view(rank, &cfg, buf.active(), &got, inputs, &tables)
            .map_err(anyhow::Error::msg)?;
        buf.ht_echo(&d)?;
        buf.ht_combine(&d)?
    } else {
        let d = buf.ll_dispatch(&me.x, &me.topk_idx, &me.weights)?;
        let got = buf.ll_received(&d)?;
        oracle::check_ll_view(rank, &cfg, buf.active(), &got, inputs, &tables)
            .map_err(anyhow::Error::msg)?;
        buf.ll_echo(&d)?;
        buf.ll_combine(&d)?
    };
    oracle::check_combine(rank, &combined.x, me, cfg.hidden, cfg.topk, cfg.fp8, |_| {
        true
    })
    .map_err(anyhow::Error::msg)?;
    Ok(())
}

/// Per value, the largest over ranks.
fn slowest(comm: &Comm, mine: &[f64]) -> Result<Vec<f64>> {
    let bytes: Vec<u8> = mine.iter().flat_map(|v| v.to_le_bytes()).collect();
    let all = comm.bootstrap().allgather(&bytes)?;
    let mut out = vec![0f64; mine.len()];
    for b in &all {
        for (i, o) in out.iter_mut().enumerate() {
            *o = o.max(ranks::f64_le(
                b.get(8 * i..8 * i + 8).context("short sample")?,
            )?);
        }
    }
    Ok(out)
}

/// One step with the oracle's checks, before timing.
fn verify(buf: &mut Buffer<'_>, inputs: &[RankInput]) -> Result<()> {
    let cfg = *buf.config();
    let me = &inputs[buf.rank()];
    let tables: Vec<Vec<i64>> = inputs.iter().map(|i| i.topk_idx.clone()).collect();
    let combined = if cfg.mode == Mode::LowLatency {
        let d = buf.ll_dispatch(&me.x, &me.topk_idx, &me.weights)?;
        oracle::check_ll_dispatch(buf, &d, inputs, &tables).map_err(anyhow::Error::msg)?;
        buf.ll_echo(&d)?;
        buf.ll_combine(&d)?
    } else {
        let d = buf.ht_dispatch(&me.x, &me.topk_idx, &me.weights)?;
        oracle::check_ht_dispatch(buf, &d, inputs, &tables).map_err(anyhow::Error::msg)?;
        buf.ht_echo(&d)?;
        buf.ht_combine(&d)?
    };
    oracle::check_combine(
        buf.rank(),
        &combined.x,
        me,
        cfg.hidden,
        cfg.topk,
        cfg.fp8,
        |_| true,
    )
    .map_err(anyhow::Error::msg)?;
    Ok(())
}

/// One timed step: (dispatch µs, combine µs); the identity expert between
/// them is not timed. High-throughput combine writes into `out`, reused
/// between steps as an inference engine reuses its tensors.
fn step(buf: &mut Buffer<'_>, me: &RankInput, out: &mut [gin_ep::Bf16]) -> Result<(f64, f64)> {
    let t0 = Instant::now();
    if buf.config().mode == Mode::LowLatency {
        let d = buf.ll_dispatch(&me.x, &me.topk_idx, &me.weights)?;
        let td = t0.elapsed().as_secs_f64() * 1e6;
        buf.ll_echo(&d)?;
        let t1 = Instant::now();
        buf.ll_combine(&d)?;
        Ok((td, t1.elapsed().as_secs_f64() * 1e6))
    } else {
        let d = buf.ht_dispatch(&me.x, &me.topk_idx, &me.weights)?;
        let td = t0.elapsed().as_secs_f64() * 1e6;
        buf.ht_echo(&d)?;
        let t1 = Instant::now();
        buf.ht_combine_into(&d, out)?;
        Ok((td, t1.elapsed().as_secs_f64() * 1e6))
    }
}

/// The same-job floor: the step's bytes moved by one put per peer and one
/// signal each.
struct Floor<'c> {
    dc: gin_core::DevCommHandle<'c>,
    send: gin_core::Window,
    recv: gin_core::Window,
    /// Bytes to each peer, dispatch and combine.
    disp: Vec<u64>,
    comb: Vec<u64>,
    block: u64,
    expected: std::cell::Cell<u64>,
    rank: usize,
}

impl<'c> Floor<'c> {
    fn new(comm: &'c Comm, disp: &[u64], comb: &[u64]) -> Result<Self> {
        let (rank, n) = (comm.rank(), comm.nranks());
        let block = disp.iter().chain(comb).copied().max().unwrap_or(8).max(8);
        Ok(Self {
            dc: comm.dev_comm(&DevCommRequirements::default())?,
            send: comm.alloc_window(block)?,
            recv: comm.alloc_window(block * n as u64)?,
            disp: disp[rank * n..(rank + 1) * n].to_vec(),
            comb: comb[rank * n..(rank + 1) * n].to_vec(),
            block,
            expected: std::cell::Cell::new(0),
            rank,
        })
    }

    /// One exchange; returns its µs.
    fn step(&self, dispatch: bool) -> Result<f64> {
        let ctx = self.dc.ctx(0)?;
        let bytes = if dispatch { &self.disp } else { &self.comb };
        let n = bytes.len();
        let t = Instant::now();
        for k in 0..n {
            let p = (self.rank + k) % n;
            ctx.put(
                p,
                &self.recv,
                self.rank as u64 * self.block,
                &self.send,
                0,
                bytes[p],
                Remote::signal_inc(0),
                Local::None,
            )?;
        }
        self.expected.set(self.expected.get() + n as u64);
        ctx.wait_signal(0, self.expected.get())?;
        ctx.flush()?;
        Ok(t.elapsed().as_secs_f64() * 1e6)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(topk_idx: Vec<i64>) -> RankInput {
        RankInput {
            tokens: topk_idx.len() / 2,
            x: Vec::new(),
            weights: vec![1.0; topk_idx.len()],
            topk_idx,
        }
    }

    /// DeepEP's accounting: low-latency counts selections, high-throughput
    /// counts (token, rank) pairs; FP8 messages are hidden + scales + 16.
    #[test]
    fn traffic_follows_deepeps_byte_accounting() {
        // 2 ranks, 4 experts (2 per rank), top-2; rank 0's token picks
        // experts 2 and 3 (both on rank 1), rank 1's picks 0 and -1.
        let inputs = [input(vec![2, 3]), input(vec![0, -1])];
        let ll = Config::low_latency(256, 4, 4, 2);
        let (d, c) = traffic(&ll, &inputs);
        assert_eq!(d, [0, 2 * 512, 512, 0]);
        assert_eq!(c, [0, 512, 2 * 512, 0]);
        let ht = Config::high_throughput(256, 4, 4, 2);
        assert_eq!(traffic(&ht, &inputs).0, [0, 512, 512, 0]);
        let fp8 = Config { fp8: true, ..ll };
        assert_eq!(traffic(&fp8, &inputs).0[1], 2 * (256 + 8 + 16));
    }

    fn result(dispatch_call: Option<Row>) -> MoeResult {
        let row = |us: f64| Row::new(1e6, vec![us; 3], vec![10.0; 3]).unwrap();
        MoeResult {
            ranks: 2,
            mode: MoeMode::Ht,
            backend: "load/store".into(),
            paths: Vec::new(),
            tokens: 4096,
            hidden: 7168,
            topk: 8,
            experts: 64,
            fp8: false,
            hosts: 1,
            channels: 16,
            threads: 0,
            dispatch: row(100.0),
            combine: row(50.0),
            total: row(150.0),
            dispatch_call,
            dispatch_kernel: None,
            device: "cuda".into(),
            inputs: MoeInputs::Device,
        }
    }

    /// CUDA ranks report the dispatch call's wall time beside the phases'
    /// GPU clocks (a "dispatch call" row, in the JSON as `dispatch_call`);
    /// CPU ranks' results, and JSON written before it, have none.
    #[test]
    fn the_dispatch_calls_wall_time_is_a_row_of_its_own() {
        let call = Row::new(1e6, vec![900.0; 3], vec![10.0; 3]).unwrap();
        let t = table(&[result(Some(call))]);
        let phases: Vec<&str> = t.rows.iter().map(|r| r[3].as_str()).collect();
        assert_eq!(phases, ["dispatch", "combine", "both", "dispatch call"]);
        assert_eq!(t.rows[3][4], "900.0");
        assert!(
            t.notes
                .iter()
                .any(|n| n.contains("\"dispatch call\" the host's wall time"))
        );
        let mut with_kernel = result(None);
        with_kernel.dispatch_kernel = Some(Row::new(1e6, vec![300.0; 3], vec![10.0; 3]).unwrap());
        let t = table(&[with_kernel]);
        let phases: Vec<&str> = t.rows.iter().map(|r| r[3].as_str()).collect();
        assert_eq!(phases, ["dispatch", "combine", "both", "dispatch kernel"]);
        assert_eq!(t.rows[3][4], "300.0");
        let t = table(&[result(None)]);
        assert_eq!(t.rows.len(), 3);
        let mut json = serde_json::to_value(result(None)).unwrap();
        assert!(json.get("dispatch_call").is_none());
        assert!(json.get("dispatch_kernel").is_none());
        json.as_object_mut().unwrap().remove("inputs");
        let back: MoeResult = serde_json::from_value(json).unwrap();
        assert!(back.dispatch_call.is_none());
    }
}

#[cfg(test)]
mod cuda_tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        moe: MoeArgs,
    }

    fn parse(args: &[&str]) -> MoeArgs {
        let argv = std::iter::once("moe").chain(args.iter().copied());
        match Cli::try_parse_from(argv) {
            Ok(c) => c.moe,
            Err(e) => panic!("{e}"),
        }
    }

    /// `--device cuda` without a usable GPU is an error saying it needs one
    /// and why, before any rank starts; `--fp8`, `--mode ht` and `--mode ht
    /// --inputs device` are accepted (all run on CUDA ranks).
    #[test]
    fn device_cuda_needs_a_gpu_and_takes_what_it_runs() {
        let r = check_cuda_args(&parse(&["--device", "cuda"]));
        match gin_core::cuda::skip_reason() {
            Some(why) => {
                let e = r.expect_err("no GPU here").to_string();
                assert_eq!(e, format!("gin-bench moe --device cuda needs a GPU: {why}"));
            }
            None => assert!(r.is_ok(), "{r:?}"),
        }
        // High-throughput mode runs on CUDA ranks from host or device
        // inputs.
        for accepted in [
            &["--device", "cuda", "--fp8"][..],
            &["--device", "cuda", "--mode", "ht", "--tokens", "4096"][..],
            &["--device", "cuda", "--mode", "ht", "--inputs", "device"][..],
        ] {
            let r = check_cuda_args(&parse(accepted));
            match gin_core::cuda::skip_reason() {
                Some(why) => {
                    let e = r.expect_err("no GPU here").to_string();
                    assert_eq!(e, format!("gin-bench moe --device cuda needs a GPU: {why}"));
                }
                None => assert!(r.is_ok(), "{accepted:?}: {r:?}"),
            }
        }
    }

    /// `--inputs device` selects device-resident inputs on CUDA ranks and
    /// is refused on CPU ranks; host inputs are the default.
    #[test]
    fn inputs_device_is_for_cuda_ranks() {
        assert_eq!(parse(&[]).inputs, MoeInputs::Host);
        let dev = parse(&["--device", "cuda", "--inputs", "device"]);
        assert_eq!(dev.inputs, MoeInputs::Device);
        let e = check_cpu_args(&parse(&["--inputs", "device"]))
            .expect_err("device inputs on CPU ranks")
            .to_string();
        assert!(e.contains("--inputs device is for --device cuda"), "{e}");
        assert!(check_cpu_args(&parse(&[])).is_ok());
    }
}
