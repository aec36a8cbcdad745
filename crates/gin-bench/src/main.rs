//! gin-bench: the gin-rs benchmark driver.
//!
//! Run with no launcher variables, each subcommand spawns `--ranks` local rank
//! processes of itself through gin-bootstrap's launcher (passing its parsed
//! options as JSON) and prints a table; started by a launcher (`cargo xtask
//! launch`, torchrun, Slurm, Open MPI), it is one rank of the job.
//!
//! The default run (no subcommand) is the put-with-signal ping-pong between
//! two local ranks on the auto backend.
//!
//! Every figure comes with a floor measured in the same job and the ratio to
//! it; every benchmark checks the data it moved and exits non-zero when a
//! check or a rank fails.

mod alltoall;
mod bandwidth;
mod bootstrap;
mod common;
mod cuda;
mod floor;
mod layout;
mod loggp;
mod model;
mod moe;
mod peers;
mod pingpong;
mod progress;
mod ranks;
mod rate;
mod report;
mod stats;
mod stream;
mod ucxfloor;

use anyhow::Result;
use clap::{Parser, Subcommand};
use common::Device;

#[derive(Debug, Parser)]
#[command(name = "gin-bench", version, about = "gin-rs benchmarks")]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Put-with-signal ping-pong between ranks 0 and 1, 8 B to 4 MiB (the default).
    Pingpong(pingpong::PingPongArgs),
    /// One-way and bidirectional put bandwidth versus size and puts in flight.
    Bandwidth(bandwidth::BandwidthArgs),
    /// Small-message rate of puts and put + signal versus puts in flight.
    Rate(rate::RateArgs),
    /// The seed's all-to-all (put + signal to every rank, wait, flush) versus rank count and size.
    Alltoall(alltoall::AlltoallArgs),
    /// Fits LogGP (L, o, g, G) for one path and predicts the all-to-all, against measurement.
    Loggp(loggp::LoggpArgs),
    /// CUDA ranks on two GPUs: ping-pong and bandwidth for the load/store and proxy paths, with floors.
    Cuda(cuda::CudaArgs),
    /// MoE dispatch and combine (gin-ep, --mode ll|ht) with DeepEP's byte accounting, beside a plain-put floor.
    Moe(moe::MoeArgs),
    /// Host bootstrap collectives (allgather, all-to-all, barrier, broadcast) versus rank count.
    Bootstrap(bootstrap::BootstrapArgs),
}

fn main() -> std::process::ExitCode {
    // GIN_DEBUG sets the log filter (like NCCL_DEBUG), warnings by default;
    // errors print as one line of Display with their causes.
    gin_bootstrap::init_tracing_from_env();
    let cli = Cli::parse();
    // A rank of a launched job writes its own record with --json (the
    // front end, which writes the full report, is not there).
    let record = ranks::is_rank()
        .then(|| cli.cmd.as_ref().and_then(Cmd::json))
        .flatten();
    let outcome = run(cli);
    let outcome = match record {
        Some((bench, path)) => {
            let error = outcome.as_ref().err().map(|e| format!("{e:#}"));
            let wrote = report::write_rank_record(&path, bench, error, ranks::emitted().cloned());
            outcome.and(wrote)
        }
        None => outcome,
    };
    match outcome {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gin-bench: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

impl Cmd {
    /// The subcommand's name and its `--json` path, when given.
    fn json(&self) -> Option<(&'static str, std::path::PathBuf)> {
        let (name, path) = match self {
            Cmd::Pingpong(a) => ("pingpong", &a.common.json),
            Cmd::Bandwidth(a) => ("bandwidth", &a.common.json),
            Cmd::Rate(a) => ("rate", &a.common.json),
            Cmd::Alltoall(a) => ("alltoall", &a.common.json),
            Cmd::Loggp(a) => ("loggp", &a.common.json),
            Cmd::Cuda(a) => ("cuda", &a.json),
            Cmd::Moe(a) => ("moe", &a.common.json),
            Cmd::Bootstrap(a) => ("bootstrap", &a.json),
        };
        path.clone().map(|p| (name, p))
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Some(Cmd::Bootstrap(a)) => bootstrap::run(&ranks::rank_args(a)?),
        Some(Cmd::Pingpong(a)) if a.common.device == Device::Cuda => cuda::run(
            &cuda::CudaArgs::from_common(&a.common, cuda::CudaTest::Pingpong)?,
        ),
        Some(Cmd::Bandwidth(a)) if a.common.device == Device::Cuda => {
            eprintln!(
                "note: --device cuda measures one way only, one message split over \
                 16, 32, 66 and 132 blocks (--dir and --window are CPU-rank flags; \
                 `gin-bench cuda --blocks` sets the blocks)"
            );
            cuda::run(&cuda::CudaArgs::from_common(
                &a.common,
                cuda::CudaTest::Bandwidth,
            )?)
        }
        Some(Cmd::Pingpong(a)) => pingpong::run(&ranks::rank_args(a)?),
        Some(Cmd::Bandwidth(a)) => bandwidth::run(&ranks::rank_args(a)?),
        Some(Cmd::Rate(a)) => rate::run(&ranks::rank_args(a)?),
        Some(Cmd::Alltoall(a)) => alltoall::run(&ranks::rank_args(a)?),
        Some(Cmd::Moe(a)) => moe::run(&ranks::rank_args(a)?),
        Some(Cmd::Loggp(a)) => loggp::run(&a),
        Some(Cmd::Cuda(a)) => cuda::run(&a),
        None => pingpong::run(&pingpong::PingPongArgs::default_args()),
    }
}
