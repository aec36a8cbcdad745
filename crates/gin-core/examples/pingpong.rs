//! Put-with-signal ping-pong between ranks 0 and 1, the smallest useful
//! program: what `gin-bench pingpong` measures, without the measuring.
//!
//! `cargo run --release -p gin-core --example pingpong -- [ROUNDS] [BYTES]`
//! (spawns 2 local ranks; under a launcher it is one rank).

use std::time::Instant;

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
    let rounds: u64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(10_000);
    let bytes: u64 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(8);
    if let Role::Launched = run_ranks(2)? {
        return Ok(());
    }
    let comm = Comm::from_env()?;
    let rank = comm.rank();
    if rank > 1 {
        return Ok(());
    }
    let peer = 1 - rank;
    let src = comm.alloc_window(bytes)?;
    let dst = comm.alloc_window(bytes)?;
    let dc = comm.dev_comm(&DevCommRequirements::default())?;
    let ctx = dc.ctx(0)?;
    let t = Instant::now();
    let check = |i: u64| -> Result<(), Box<dyn std::error::Error>> {
        // Read right after the signal: the peer writes again only after our
        // next put.
        let got = dst.read_vec(0, 1)?[0];
        if got == i as u8 {
            Ok(())
        } else {
            Err(format!(
                "rank {rank}: round {i} carried payload {got} instead of {}",
                i as u8
            )
            .into())
        }
    };
    for i in 1..=rounds {
        if rank == 1 {
            ctx.wait_signal(0, i)?;
            check(i)?;
        }
        // The source may be rewritten only once the previous put completed
        // locally: a proxy reads it after `put` returns. Flushing an idle
        // context costs next to nothing.
        ctx.flush()?;
        src.write(0, &[i as u8])?;
        ctx.put(
            peer,
            &dst,
            0,
            &src,
            0,
            bytes,
            Remote::signal_inc(0),
            Local::None,
        )?;
        if rank == 0 {
            ctx.wait_signal(0, i)?;
            check(i)?;
        }
    }
    let half_rtt = t.elapsed().as_secs_f64() * 1e6 / rounds as f64 / 2.0;
    if rank == 0 {
        println!(
            "{rounds} round trips of {bytes} B: {half_rtt:.3} µs per half round trip (paths {:?})",
            comm.path_names()
        );
    }
    dc.destroy()?;
    Ok(())
}
