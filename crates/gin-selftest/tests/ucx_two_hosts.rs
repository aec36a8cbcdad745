//! Two emulated hosts over UCX: four real rank processes, two per host
//! (`GIN_HOSTID`), `GIN_TRANSPORT=auto` with `GIN_TRANSPORT_REMOTE=ucx`:
//! each host's ranks reach each other over gin-rs's shared memory and the
//! other host's over UCX. Every `gin-selftest all` scenario on the direct
//! (auto) and soft-NIC (gdaki) backends, over UCX's tcp and its shared
//! memory (posix, cma: the emulated hosts share one kernel, so UCX's
//! shared-memory transports reach across them, as they would not across
//! real hosts), and the paths each rank chose.
//!
//! Skipped with a printed reason without `GIN_UCX_LIB`; required (a
//! failure instead) with `GIN_REQUIRE_UCX=1` or `CI`, as tests/ucx.rs.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod common;

use std::time::Duration;

use gin_bootstrap::{LaunchReport, LaunchSpec, Output, launch};

const BIN: &str = env!("CARGO_BIN_EXE_gin-selftest");

/// UCX's transports between the hosts (`UCX_TLS`).
const TLS: [(&str, &str); 2] = [("tcp", "tcp,self"), ("shared memory", "posix,cma,self")];

/// The library to load, or `None` after printing why the tests are skipped.
fn ucx() -> Option<String> {
    common::ucx("the UCX two-hosts tests")
}

/// Four ranks, ranks 0 and 1 on host `h0`, 2 and 3 on `h1`.
fn two_hosts(args: &str, tls: &str, backend: &str) -> LaunchReport {
    let script = format!("GIN_HOSTID=h$((GIN_RANK / 2)) exec {BIN} {args}");
    let mut spec = LaunchSpec::new(4, "sh", ["-c", script.as_str()])
        .env("GIN_TIMEOUT", "60")
        .env("GIN_TRANSPORT", "auto")
        .env("GIN_TRANSPORT_REMOTE", "ucx")
        .env("GIN_BACKEND", backend)
        .env("UCX_TLS", tls);
    spec.output = Output::Capture;
    spec.grace = Duration::from_secs(20);
    spec.limit = Some(Duration::from_secs(240));
    launch(&spec).unwrap()
}

/// What rank `r` of the two hosts must report as its paths.
fn paths(r: usize) -> &'static str {
    [
        r#"paths ["local", "shm", "ucx", "ucx"]"#,
        r#"paths ["shm", "local", "ucx", "ucx"]"#,
        r#"paths ["ucx", "ucx", "local", "shm"]"#,
        r#"paths ["ucx", "ucx", "shm", "local"]"#,
    ][r]
}

#[test]
fn every_scenario_passes_on_two_hosts_with_ucx_between_them() {
    if ucx().is_none() {
        return;
    }
    for (name, tls) in TLS {
        for backend in ["auto", "gdaki"] {
            let report = two_hosts("all", tls, backend);
            for r in &report.ranks {
                let what = format!("UCX over {name}, {backend}, rank {}", r.rank);
                assert!(
                    r.success() && r.stdout.contains(" ok in "),
                    "{what}: {:?}\n{}{}",
                    r.status,
                    r.stdout,
                    r.stderr
                );
                assert!(
                    r.stdout.contains(paths(r.rank)),
                    "{what}: wrong paths, want {}:\n{}",
                    paths(r.rank),
                    r.stdout
                );
            }
        }
    }
}

/// The all-to-all across both hosts (every rank writes every other),
/// verified by every rank.
#[test]
fn the_all_to_all_verifies_across_two_hosts_over_ucx() {
    if ucx().is_none() {
        return;
    }
    for (name, tls) in TLS {
        let report = two_hosts("alltoall", tls, "auto");
        for r in &report.ranks {
            assert!(
                r.success() && r.stdout.contains(paths(r.rank)),
                "UCX over {name}, rank {}: {:?}\n{}{}",
                r.rank,
                r.status,
                r.stdout,
                r.stderr
            );
        }
    }
}

/// A transport that reaches only one host, asked for between hosts, fails
/// every rank naming the ranks it cannot reach.
#[test]
fn a_host_only_remote_transport_fails_every_rank_naming_the_others() {
    let script = format!("GIN_HOSTID=h$((GIN_RANK / 2)) exec {BIN} ring");
    let mut spec = LaunchSpec::new(4, "sh", ["-c", script.as_str()])
        .env("GIN_TIMEOUT", "20")
        .env("GIN_TRANSPORT", "auto")
        .env("GIN_TRANSPORT_REMOTE", "shm");
    spec.output = Output::Capture;
    spec.grace = Duration::from_secs(5);
    spec.limit = Some(Duration::from_secs(60));
    let report = launch(&spec).unwrap();
    for r in &report.ranks {
        assert!(!r.success(), "rank {}: {}", r.rank, r.stdout);
        assert!(
            r.stdout.contains("reaches only this host"),
            "rank {}: {}{}",
            r.rank,
            r.stdout,
            r.stderr
        );
    }
}
