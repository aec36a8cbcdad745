//! The GIN paper's ring exchange: each rank's block travels around the ring,
//! every rank forwarding the block it received last, until every rank holds
//! every block.
//!
//! `cargo run --release -p gin-core --example ring -- [RANKS] [BYTES]`
//! (spawns RANKS local ranks, default 4; under a launcher it is one rank).

use gin_core::launch::{Role, run_ranks};
use gin_core::{Comm, DevCommRequirements, Local, Remote};

fn main() -> std::process::ExitCode {
    // GIN_DEBUG=debug (or gin_core=debug, ...) logs to stderr; errors print
    // as one line of Display, not Debug.
    gin_bootstrap::init_tracing_from_env();
    gin_bootstrap::exit_code(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let n: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(4);
    let bytes: u64 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(1 << 16);
    if let Role::Launched = run_ranks(n)? {
        return Ok(());
    }
    let comm = Comm::from_env()?;
    let (rank, n) = (comm.rank(), comm.nranks());
    let buf = comm.alloc_window(bytes * n as u64)?;
    buf.write(rank as u64 * bytes, &vec![rank as u8 + 1; bytes as usize])?;
    let dc = comm.dev_comm(&DevCommRequirements::default())?;
    let ctx = dc.ctx(0)?;
    let next = (rank + 1) % n;
    for step in 0..n as u64 - 1 {
        // Forward the block received in the previous step (our own first).
        let block = (rank as u64 + n as u64 - step) % n as u64;
        let off = block * bytes;
        ctx.put(
            next,
            &buf,
            off,
            &buf,
            off,
            bytes,
            Remote::signal_inc(0),
            Local::None,
        )?;
        ctx.wait_signal(0, step + 1)?;
    }
    ctx.flush()?;
    for p in 0..n {
        let got = buf.read_vec(p as u64 * bytes, bytes as usize)?;
        if got.iter().any(|&b| b != p as u8 + 1) {
            return Err(format!("rank {rank}: block of rank {p} is wrong").into());
        }
    }
    println!(
        "rank {rank}: ring exchange of {n} blocks of {bytes} B verified (paths {:?})",
        comm.path_names()
    );
    dc.destroy()?;
    Ok(())
}
