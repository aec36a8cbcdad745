//! Checks the bootstrap of a job: run it as every rank of a job (under
//! `cargo xtask launch`, torchrun, Slurm or Open MPI). Exits 0 when every
//! collective delivered every byte correctly.
//!
//! `gin-bootstrap-selftest [check [ROUNDS] | die VICTIM | stop VICTIM BYTES |
//! absent VICTIM | last-words]`: `die` makes rank VICTIM crash while the
//! others are in an allgather, `stop` makes it stop itself (SIGSTOP) before
//! an allgather of BYTES per rank, and `absent` makes it never join; the
//! survivors print the error they got and exit with status 3. `last-words`
//! (three ranks) has rank 2 send to rank 1 and crash, and checks that what
//! was sent before and after the others heard of the death is delivered, and
//! what never will be fails promptly. The process tests use these to prove
//! that failures are reported, not hung on, and that what was sent arrives.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use gin_bootstrap::{Bootstrap, BootstrapError, LaunchEnv, selftest};

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
        "last-words" => last_words(&b),
        other => Err(format!(
            "unknown mode {other:?} (check, die, stop, absent, last-words)"
        )),
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

/// Rank 2 sends its last words to rank 1 and crashes. Once ranks 0 and 1
/// know of the death: rank 1 still gets the last words; rank 0's message to
/// rank 1, sent after the death, is delivered; a message rank 2 never sent
/// fails at once, and one rank 1 never sends fails within seconds, both
/// naming rank 2.
fn last_words(b: &Bootstrap) -> Result<(), String> {
    const VICTIM: usize = 2;
    if b.nranks() != 3 {
        return Err("last-words runs on three ranks".into());
    }
    if b.rank() == VICTIM {
        b.send(1, 7, b"last words").map_err(|e| e.to_string())?;
        // A crash: no destructors, no goodbye.
        std::process::abort();
    }
    // There is no call that blocks until a death is known: poll for it, so
    // that every receive below starts after the news.
    let t = Instant::now();
    loop {
        match b.health() {
            Err(BootstrapError::PeerDied { peer: VICTIM, .. }) => break,
            Err(e) => return Err(format!("unexpected health: {e}")),
            Ok(()) if t.elapsed() > Duration::from_secs(30) => {
                return Err("rank 2's death was not heard of in 30 s".into());
            }
            Ok(()) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
    let names_victim =
        |e: &BootstrapError| matches!(e, BootstrapError::PeerDied { peer: VICTIM, .. });
    if b.rank() == 0 {
        b.send(1, 8, b"after the news")
            .map_err(|e| format!("send to a live rank after a death: {e}"))?;
        let t = Instant::now();
        match b.recv(1, 10) {
            Err(e) if names_victim(&e) && t.elapsed() < Duration::from_secs(10) => {
                println!("never sent: failed after {:.3?}: {e}", t.elapsed());
                Ok(())
            }
            other => Err(format!(
                "a message rank 1 never sends: {other:?} after {:?}",
                t.elapsed()
            )),
        }
    } else {
        let got = b
            .recv(VICTIM, 7)
            .map_err(|e| format!("the last words: {e}"))?;
        if got != b"last words" {
            return Err(format!("the last words arrived as {got:?}"));
        }
        let got = b
            .recv(0, 8)
            .map_err(|e| format!("rank 0's message after the news: {e}"))?;
        if got != b"after the news" {
            return Err(format!("rank 0's message arrived as {got:?}"));
        }
        let t = Instant::now();
        match b.recv(VICTIM, 9) {
            Err(e) if names_victim(&e) && t.elapsed() < Duration::from_secs(1) => {
                println!("never sent: failed after {:.3?}: {e}", t.elapsed());
            }
            other => {
                return Err(format!(
                    "a message rank 2 never sent: {other:?} after {:?}",
                    t.elapsed()
                ));
            }
        }
        // Stay until rank 0 leaves, so that its wait for a message from
        // this rank ends for want of the message, not because this rank left.
        let t = Instant::now();
        loop {
            match b.peer_health(0) {
                Ok(()) if t.elapsed() < Duration::from_secs(30) => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(BootstrapError::PeerExited { peer: 0, .. }) => return Ok(()),
                other => return Err(format!("waiting for rank 0 to leave: {other:?}")),
            }
        }
    }
}
