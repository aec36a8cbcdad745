//! What every backend must agree on, checked on each through the host API:
//! the queue depths they accept, and what a put with a signal and a counter
//! does at the smallest of them. Ranks are threads of this process (the
//! bootstrap's `run_threads`), so each case costs milliseconds.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::time::Duration;

use gin_bootstrap::{Config, run_threads};
use gin_core::{Comm, CounterId, DevCommRequirements, Local, Remote, Settings};

/// (`GIN_BACKEND`, `GIN_TRANSPORT`) of each backend, over shared memory.
const BACKENDS: [&str; 3] = ["auto", "proxy", "gdaki"];

/// Runs `f` on each rank of an `n`-rank job whose communicators use
/// `backend`; returns each rank's result.
fn job<T: Send + 'static>(
    n: usize,
    backend: &'static str,
    f: impl Fn(&Comm) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let cfg = Config {
        timeout: Duration::from_secs(20),
        ..Config::default()
    };
    run_threads(n, cfg, move |b| {
        let settings = Settings::from_vars(|k| match k {
            "GIN_BACKEND" => Some(backend.to_owned()),
            "GIN_TIMEOUT" => Some("20s".to_owned()),
            _ => None,
        })
        .unwrap();
        let comm = Comm::with_settings(b, settings).unwrap();
        f(&comm)
    })
    .unwrap()
}

/// The smallest queue depth each backend states.
fn minimum(backend: &str) -> u32 {
    if backend == "gdaki" {
        gin_gdaki::MIN_QUEUE_DEPTH
    } else {
        gin_proxy::MIN_QUEUE_DEPTH
    }
}

#[test]
fn creation_below_a_backends_minimum_queue_depth_fails_naming_it() {
    for backend in BACKENDS {
        let min = minimum(backend);
        for depth in [0, min - 1] {
            let errors = job(2, backend, move |comm| {
                let req = DevCommRequirements {
                    queue_depth: depth,
                    ..DevCommRequirements::default()
                };
                comm.dev_comm(&req).map(drop).unwrap_err().to_string()
            });
            let name = if backend == "gdaki" { "gdaki" } else { "proxy" };
            for e in errors {
                for w in [
                    format!("queue depth {depth}"),
                    format!("{name} backend"),
                    format!("minimum {min}"),
                ] {
                    assert!(
                        e.contains(&w),
                        "{backend}: error {e:?} does not mention {w:?}"
                    );
                }
            }
        }
    }
}

#[test]
fn a_put_with_signal_and_counter_works_at_each_backends_minimum_depth() {
    for backend in BACKENDS {
        let out = job(2, backend, move |comm| {
            let req = DevCommRequirements {
                queue_depth: minimum(backend),
                ..DevCommRequirements::default()
            };
            let dc = comm.dev_comm(&req).unwrap();
            let win = comm.alloc_window(4096).unwrap();
            let rank = comm.rank();
            let ctx = dc.ctx(0).unwrap();
            let me = [rank as u8 + 1; 64];
            win.write(0, &me).unwrap();
            comm.bootstrap().barrier().unwrap();
            let peer = 1 - rank;
            // Several rounds: the queues wrap many times.
            let rounds = 20;
            for i in 0..rounds {
                ctx.put(
                    peer,
                    &win,
                    1024 + 64 * (i % 8),
                    &win,
                    0,
                    64,
                    Remote::signal_add(0, 3),
                    Local::CounterInc(CounterId(1)),
                )
                .unwrap();
            }
            ctx.wait_counter(1, rounds).unwrap();
            ctx.flush().unwrap();
            ctx.wait_signal(0, 3 * rounds).unwrap();
            let got = win.read_vec(1024, 512).unwrap();
            dc.destroy().unwrap();
            comm.bootstrap().barrier().unwrap();
            (got, peer as u8 + 1)
        });
        for (got, from) in out {
            assert!(got.iter().all(|&b| b == from), "{backend}: {got:?}");
        }
    }
}
