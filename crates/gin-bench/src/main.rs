//! gin-bench: the gin-rs benchmark driver.
//!
//! Run with no launcher variables, each subcommand spawns `--ranks` local rank
//! processes of itself through gin-bootstrap's launcher and prints a table;
//! started by a launcher (`cargo xtask launch`, torchrun, Slurm, Open MPI), it
//! is one rank of the job.
//!
//! The default run (no subcommand) is the put-with-signal ping-pong between
//! two local ranks on the auto backend.

mod alltoall;
mod bootstrap;
mod cuda;
mod pingpong;
mod ranks;
mod stats;

use anyhow::Result;
use clap::{Parser, Subcommand};

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
    /// The seed's all-to-all (put + signal to every rank, wait, flush) versus rank count and size.
    Alltoall(alltoall::AlltoallArgs),
    /// CUDA ranks on two GPUs: ping-pong and bandwidth for the load/store and proxy paths, with floors.
    Cuda(cuda::CudaArgs),
    /// Host bootstrap collectives (allgather, all-to-all, barrier, broadcast) versus rank count.
    Bootstrap(bootstrap::BootstrapArgs),
}

fn main() -> Result<()> {
    init_tracing();
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let cli = Cli::parse();
    match cli.cmd {
        Some(Cmd::Bootstrap(a)) => bootstrap::run(&a, &argv),
        Some(Cmd::Pingpong(a)) => pingpong::run(&a, &argv),
        Some(Cmd::Alltoall(a)) => alltoall::run(&a, &argv),
        Some(Cmd::Cuda(a)) => cuda::run(&a),
        None => {
            let a = pingpong::PingPongArgs::default_args();
            let mut argv = argv;
            argv.insert(0, "pingpong".to_owned());
            pingpong::run(&a, &argv)
        }
    }
}

/// `GIN_DEBUG` sets the tracing filter (like `NCCL_DEBUG`); warnings by default.
fn init_tracing() {
    let filter = std::env::var("GIN_DEBUG").unwrap_or_else(|_| "warn".to_owned());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .try_init();
}
