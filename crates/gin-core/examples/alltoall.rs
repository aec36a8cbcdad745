//! The all-to-all of the seed: every rank puts a block to every peer with a
//! signal increment, waits for a signal from every peer, then flushes.
//!
//! `cargo run --release -p gin-core --example alltoall -- [RANKS] [BYTES]`
//! (spawns RANKS local ranks, default 4; under a launcher it is one rank).

use gin_core::launch::{Role, run_ranks};
use gin_core::{Comm, DevCommRequirements, Fence, Local, Remote, Team};

fn main() -> std::process::ExitCode {
    // GIN_DEBUG=debug (or gin_core=debug, ...) logs to stderr; errors print
    // as one line of Display, not Debug.
    gin_bootstrap::init_tracing_from_env();
    gin_bootstrap::exit_code(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let n: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(4);
    let bytes: u64 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(4096);
    if let Role::Launched = run_ranks(n)? {
        return Ok(());
    }
    let comm = Comm::from_env()?;
    let (rank, n) = (comm.rank(), comm.nranks());
    let send = comm.alloc_window(bytes * n as u64)?;
    let recv = comm.alloc_window(bytes * n as u64)?;
    // Block for peer p: bytes of (rank * 16 + p).
    for p in 0..n {
        send.write(
            p as u64 * bytes,
            &vec![(rank * 16 + p) as u8; bytes as usize],
        )?;
    }
    let dc = comm.dev_comm(&DevCommRequirements::default())?;
    let ctx = dc.ctx(0)?;
    dc.barrier(Team::World, 0)?.sync(0, Fence::None)?;
    for k in 0..n {
        let p = (rank + k) % n;
        let off = p as u64 * bytes;
        let dst = rank as u64 * bytes;
        ctx.put(
            p,
            &recv,
            dst,
            &send,
            off,
            bytes,
            Remote::signal_inc(0),
            Local::None,
        )?;
    }
    ctx.wait_signal(0, n as u64)?;
    ctx.flush()?;
    for p in 0..n {
        let got = recv.read_vec(p as u64 * bytes, bytes as usize)?;
        let want = (p * 16 + rank) as u8;
        if got.iter().any(|&b| b != want) {
            return Err(format!("rank {rank}: block from rank {p} is wrong").into());
        }
    }
    // What each peer really uses: load/store where the device communicator
    // maps the peer's windows, else the backend, over the path to it.
    let paths = comm.path_names();
    let peers: Vec<String> = (0..n)
        .filter(|&p| p != rank)
        .map(|p| {
            let how = if dc.is_direct(p) {
                "load/store"
            } else {
                dc.backend_name()
            };
            format!("{p}: {how} over {}", paths[p])
        })
        .collect();
    println!(
        "rank {rank}: all-to-all of {bytes} B blocks with {n} ranks verified (peers {})",
        peers.join(", ")
    );
    dc.destroy()?;
    Ok(())
}
