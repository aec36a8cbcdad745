//! Checks the bootstrap of a job: run it as every rank of a job (under
//! `cargo xtask launch`, torchrun, Slurm or Open MPI). Exits 0 when every
//! collective delivered every byte correctly.
//!
//! `gin-bootstrap-selftest [check [ROUNDS] | die VICTIM | stop VICTIM BYTES |
//! absent VICTIM]`: `die` makes rank VICTIM crash while the others are in an
//! allgather, `stop` makes it stop itself (SIGSTOP) before an allgather of
//! BYTES per rank, and `absent` makes it never join; the survivors print the
//! error they got and exit with status 3. The process tests use these to prove that failures are
//! reported, not hung on.

use std::process::ExitCode;
use std::time::Instant;

use gin_bootstrap::{Bootstrap, LaunchEnv, selftest};

fn main() -> ExitCode {
    gin_bootstrap::init_tracing_from_env();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = args.first().map_or("check", String::as_str);
    let arg = |i: usize, default: usize| -> usize {
        args.get(i).and_then(|a| a.parse().ok()).unwrap_or(default)
    };
    let env = match LaunchEnv::from_env() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    if mode == "absent" && env.rank == arg(1, 0) {
        println!("rank {} stays away on purpose", env.rank);
        return ExitCode::SUCCESS;
    }
    let start = Instant::now();
    let b = match Bootstrap::from_env() {
        Ok(b) => b,
        Err(e) => {
            println!("FAILED after {:.3}s: {e}", start.elapsed().as_secs_f64());
            return ExitCode::from(3);
        }
    };
    let result = match mode {
        "check" => selftest::verify(&b, arg(1, 2)),
        "die" => {
            let victim = arg(1, 0);
            b.barrier().map_err(|e| e.to_string()).and_then(|()| {
                if b.rank() == victim {
                    // A crash: no destructors, no goodbye.
                    std::process::abort();
                }
                let t = Instant::now();
                b.allgather(&[1; 64]).map(|_| ()).map_err(|e| {
                    format!("{e} (after {:.3}s in allgather)", t.elapsed().as_secs_f64())
                })
            })
        }
        "stop" => {
            let victim = arg(1, 0);
            let bytes = arg(2, 64 << 20);
            b.barrier().map_err(|e| e.to_string()).and_then(|()| {
                if b.rank() == victim {
                    // Frozen, not dead: its sockets stay open and undrained.
                    // The launcher kills it once the others have failed.
                    let pid = std::process::id().to_string();
                    let _ = std::process::Command::new("kill")
                        .args(["-STOP", &pid])
                        .status();
                }
                let t = Instant::now();
                b.allgather(&vec![7; bytes]).map(|_| ()).map_err(|e| {
                    format!("{e} (after {:.3}s in allgather)", t.elapsed().as_secs_f64())
                })
            })
        }
        other => Err(format!("unknown mode {other:?} (check, die, stop, absent)")),
    };
    match result {
        Ok(()) => {
            println!("rank {} of {}: ok", b.rank(), b.nranks());
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("FAILED: {e}");
            ExitCode::from(3)
        }
    }
}
