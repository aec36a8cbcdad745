//! CPU ranks over gin-net's ucx transport, as real processes started by
//! the launcher users use, on two of UCX's transports (shared memory with
//! cma, and tcp): every selftest scenario, the paths chosen, a dead peer,
//! a stopped peer, a window dropped under a peer's put, deregistration with
//! puts in flight, refused data, and a missing library.
//!
//! UCX is loaded at run time (`GIN_UCX_LIB`, which `cargo xtask test`
//! sets to the pinned wheel's `libucp.so.0`). Without it these tests print
//! that they were skipped and why; with `GIN_REQUIRE_UCX=1` (CI sets it
//! through `cargo xtask test`) or `CI` set they fail instead.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod common;

use std::time::Duration;

use gin_bootstrap::{LaunchReport, LaunchSpec, Output, launch};

const BIN: &str = env!("CARGO_BIN_EXE_gin-selftest");

/// UCX's transports the tests run on (`UCX_TLS`).
const TLS: [(&str, &str); 2] = [("shared memory", "posix,cma,self"), ("tcp", "tcp,self")];

/// The library to load, or `None` after printing why the tests are skipped.
fn ucx() -> Option<String> {
    common::ucx("the UCX tests")
}

fn run(n: usize, args: &[&str], tls: &str, env: &[(&str, &str)], timeout: &str) -> LaunchReport {
    let mut spec = LaunchSpec::new(n, BIN, args.iter().copied())
        .env("GIN_TIMEOUT", timeout)
        .env("GIN_TRANSPORT", "ucx")
        .env("UCX_TLS", tls);
    for (k, v) in env {
        spec = spec.env(k, v);
    }
    spec.output = Output::Capture;
    spec.grace = Duration::from_secs(20);
    spec.limit = Some(Duration::from_secs(180));
    launch(&spec).unwrap()
}

fn assert_ok(report: &LaunchReport, what: &str) {
    for r in &report.ranks {
        assert!(
            r.success() && r.stdout.contains(" ok in "),
            "{what}, rank {}: {:?}\n{}{}",
            r.rank,
            r.status,
            r.stdout,
            r.stderr
        );
    }
}

/// Every scenario of `gin-selftest all` (put, put with signal and its
/// ordering, get, counters, flush, barriers, bad inputs, window reuse)
/// through gin-core's public API, on each backend that reaches keyed peers.
#[test]
fn every_scenario_passes_over_ucx_shared_memory_and_tcp() {
    if ucx().is_none() {
        return;
    }
    for (name, tls) in TLS {
        for backend in ["auto", "gdaki"] {
            for n in [2, 3] {
                let report = run(n, &["all"], tls, &[("GIN_BACKEND", backend)], "30");
                assert_ok(&report, &format!("ucx over {name}, {backend}, {n} ranks"));
                assert!(
                    report.ranks[0].stdout.contains(r#"paths ["local", "ucx""#),
                    "{}",
                    report.ranks[0].stdout
                );
            }
        }
    }
}

/// A window dropped without deregistering: the owner revokes the rkey it
/// handed out, and the peer's later put fails naming rank and window
/// instead of writing unmapped memory.
#[test]
fn a_put_to_a_dropped_window_is_refused_naming_the_owner() {
    if ucx().is_none() {
        return;
    }
    for (name, tls) in TLS {
        let report = run(2, &["dropped"], tls, &[], "20");
        // The selftest expects tcp's or shm's wording; the ucx refusal is
        // the shm one ("dropped or deregistered").
        let out = &report.ranks[0].stdout;
        assert!(
            out.contains("dropped or deregistered"),
            "{name}: {out}{}",
            report.ranks[0].stderr
        );
    }
}

#[test]
fn a_signal_is_never_applied_for_refused_data_over_ucx() {
    if ucx().is_none() {
        return;
    }
    for (name, tls) in TLS {
        let report = run(2, &["refused"], tls, &[], "20");
        assert_ok(&report, name);
        assert!(
            report.ranks[0].stdout.contains("refused as expected"),
            "{name}: {}",
            report.ranks[0].stdout
        );
    }
}

#[test]
fn deregistration_waits_for_puts_still_in_flight_over_ucx() {
    if ucx().is_none() {
        return;
    }
    for (name, tls) in TLS {
        let report = run(2, &["dereg"], tls, &[], "60");
        assert_ok(&report, name);
    }
}

#[test]
fn a_peer_killed_mid_run_fails_the_survivors_promptly_over_ucx() {
    if ucx().is_none() {
        return;
    }
    for (name, tls) in TLS {
        let report = run(3, &["die", "2"], tls, &[], "60");
        assert!(
            report.elapsed < Duration::from_secs(30),
            "{name}: took {:?}",
            report.elapsed
        );
        for r in report.ranks.iter().filter(|r| r.rank != 2) {
            assert_eq!(
                r.status.and_then(|s| s.code()),
                Some(3),
                "{name}, rank {}: {}{}",
                r.rank,
                r.stdout,
                r.stderr
            );
            assert!(
                r.stdout.contains("rank 2 died"),
                "{name}, rank {}: {}",
                r.rank,
                r.stdout
            );
            assert!(
                !r.stopped,
                "{name}: rank {} hung until the launcher stopped it",
                r.rank
            );
        }
    }
}

/// A peer stopped with SIGSTOP while a rank streams 1 MiB puts at it over
/// UCX's tcp: the sender fails naming it within the timeout, and teardown
/// returns. (Over shared memory with cma, as over gin's shm path, the
/// writes land in the stopped process's memory and complete: nothing
/// blocks.)
#[test]
fn a_stopped_peer_fails_a_ucx_tcp_sender_within_the_timeout() {
    if ucx().is_none() {
        return;
    }
    for (name, tls) in &TLS[1..] {
        let mut spec = LaunchSpec::new(2, BIN, ["stop", "1"])
            .env("GIN_TIMEOUT", "2")
            .env("GIN_TRANSPORT", "ucx")
            .env("UCX_TLS", tls);
        spec.output = Output::Capture;
        spec.grace = Duration::from_secs(1);
        spec.limit = Some(Duration::from_secs(60));
        let report = launch(&spec).unwrap();
        let out = &report.ranks[0].stdout;
        assert_eq!(
            report.ranks[0].status.and_then(|s| s.code()),
            Some(3),
            "{name}: {out}{}",
            report.ranks[0].stderr
        );
        assert!(
            out.contains("rank 1"),
            "{name}: the error does not name the stopped rank: {out}"
        );
        assert!(out.contains("noticed after"), "{name}: {out}");
    }
}

/// Without a loadable libucp, every rank fails naming what it tried and
/// the alternatives (runs with or without UCX installed).
#[test]
fn a_missing_library_fails_every_rank_naming_it_and_the_alternatives() {
    let report = run(
        2,
        &["ring"],
        "tcp,self",
        &[("GIN_UCX_LIB", "/nonexistent/libucp.so.0")],
        "20",
    );
    for r in &report.ranks {
        assert!(!r.success(), "rank {}: {}", r.rank, r.stdout);
        assert!(
            r.stdout.contains("GIN_TRANSPORT=ucx is not available")
                && r.stdout.contains("/nonexistent/libucp.so.0")
                && r.stdout.contains("GIN_TRANSPORT=tcp"),
            "rank {}: {}",
            r.rank,
            r.stdout
        );
    }
}
