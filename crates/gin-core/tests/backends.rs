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
    job_over(n, backend, "auto", f)
}

/// [`job`] over `GIN_TRANSPORT=transport`.
fn job_over<T: Send + 'static>(
    n: usize,
    backend: &'static str,
    transport: &'static str,
    f: impl Fn(&Comm) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let cfg = Config {
        timeout: Duration::from_secs(20),
        ..Config::default()
    };
    run_threads(n, cfg, move |b| {
        let settings = Settings::from_vars(|k| match k {
            "GIN_BACKEND" => Some(backend.to_owned()),
            "GIN_TRANSPORT" => Some(transport.to_owned()),
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

/// Signals are 64-bit, as NCCL's are: an add of any u64 amount, including
/// 2^63 and more, wraps modulo 2^64 and gives the same value on every
/// backend (direct load/store, proxy, GDAKI) and transport.
#[test]
fn a_signal_add_of_any_64_bit_amount_gives_the_same_result_on_every_backend() {
    const TOP: u64 = 1 << 63;
    // Per signal id, the amounts rank 0 adds and the value rank 1 expects.
    let cases: [(u32, &[u64], u64); 3] = [
        (0, &[TOP + 5], TOP + 5),
        (2, &[TOP + 5, u64::MAX], TOP + 4),
        (3, &[TOP + 5, u64::MAX, TOP - 3], 1),
    ];
    for (backend, transport) in BACKENDS.into_iter().flat_map(|b| [(b, "auto"), (b, "tcp")]) {
        let out = job_over(2, backend, transport, move |comm| {
            if transport == "tcp" {
                assert!(
                    comm.path_names().contains(&"tcp"),
                    "{:?}",
                    comm.path_names()
                );
            }
            let dc = comm.dev_comm(&DevCommRequirements::default()).unwrap();
            let ctx = dc.ctx(0).unwrap();
            let got = if comm.rank() == 0 {
                // Errors are collected, not returned: rank 1 waits for the
                // last signal either way.
                let mut errors = Vec::new();
                for (id, adds, _) in cases {
                    for &a in adds {
                        if let Err(e) = ctx.signal(1, Remote::signal_add(id, a)) {
                            errors.push(e.to_string());
                        }
                    }
                }
                // Strong: every earlier signal of this context is visible
                // once this one is.
                ctx.signal(1, Remote::signal_inc(1)).unwrap();
                ctx.flush().unwrap();
                Err(errors)
            } else {
                ctx.wait_signal(1, 1).unwrap();
                Ok(cases
                    .iter()
                    .map(|&(id, _, _)| ctx.read_signal(id).unwrap())
                    .collect::<Vec<u64>>())
            };
            comm.bootstrap().barrier().unwrap();
            dc.destroy().unwrap();
            got
        });
        let errors = out[0].clone().unwrap_err();
        assert!(errors.is_empty(), "{backend} over {transport}: {errors:?}");
        let got = out[1].clone().unwrap();
        let want: Vec<u64> = cases.iter().map(|c| c.2).collect();
        assert_eq!(got, want, "{backend} over {transport}");
    }
}

/// Tickets are redeemed only by the device communicator that issued them:
/// another one's ticket is an error on every backend, never a panic or a
/// wait that returns at once.
#[test]
fn a_ticket_from_another_device_communicator_is_refused_on_every_backend() {
    for backend in BACKENDS {
        let out = job(2, backend, move |comm| {
            let small = comm.dev_comm(&DevCommRequirements::default()).unwrap();
            let big = comm
                .dev_comm(&DevCommRequirements {
                    contexts: 4,
                    ..DevCommRequirements::default()
                })
                .unwrap();
            let peer = 1 - comm.rank();
            let foreign = [
                big.ctx(3).unwrap().flush_async(peer).unwrap(),
                big.ctx(0).unwrap().flush_async(peer).unwrap(),
            ];
            let errors: Vec<String> = foreign
                .iter()
                .map(|t| match small.ctx(0).unwrap().wait(t) {
                    Ok(()) => "accepted".to_owned(),
                    Err(e) => e.to_string(),
                })
                .collect();
            let own = small.ctx(0).unwrap().flush_async(peer).unwrap();
            small.ctx(0).unwrap().wait(&own).unwrap();
            big.destroy().unwrap();
            small.destroy().unwrap();
            errors
        });
        for e in out.into_iter().flatten() {
            assert!(
                e.contains("ticket") && e.contains("another device communicator"),
                "{backend}: {e}"
            );
        }
    }
}
