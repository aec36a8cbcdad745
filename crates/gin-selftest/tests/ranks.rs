//! Multi-process tests: the device API across rank processes started by the
//! launcher users use, under every backend and transport.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::time::Duration;

use gin_bootstrap::{LaunchReport, LaunchSpec, Output, launch};

const BIN: &str = env!("CARGO_BIN_EXE_gin-selftest");

/// (name, environment) of each way to run.
const MODES: [(&str, &[(&str, &str)]); 7] = [
    ("auto (direct load/store)", &[]),
    (
        "auto over tcp (ranks send when their ring is empty)",
        &[("GIN_TRANSPORT", "tcp")],
    ),
    ("proxy over shm", &[("GIN_BACKEND", "proxy")]),
    (
        "proxy over tcp",
        &[("GIN_BACKEND", "proxy"), ("GIN_TRANSPORT", "tcp")],
    ),
    ("gdaki (soft-mlx5) over shm", &[("GIN_BACKEND", "gdaki")]),
    (
        "gdaki (soft-mlx5) over tcp",
        &[("GIN_BACKEND", "gdaki"), ("GIN_TRANSPORT", "tcp")],
    ),
    (
        "gdaki with batched doorbells",
        &[("GIN_BACKEND", "gdaki"), ("GIN_GDAKI_BATCH", "8")],
    ),
];

fn run(n: usize, args: &[&str], env: &[(&str, &str)], timeout: &str) -> LaunchReport {
    let mut spec = LaunchSpec::new(n, BIN, args.iter().copied()).env("GIN_TIMEOUT", timeout);
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
            r.success(),
            "{what}, rank {}: {:?}\n{}{}",
            r.rank,
            r.status,
            r.stdout,
            r.stderr
        );
        assert!(
            r.stdout.contains(" ok in "),
            "{what}, rank {}: {}",
            r.rank,
            r.stdout
        );
    }
}

#[test]
fn every_scenario_passes_on_every_path_with_2_to_8_ranks() {
    for (name, env) in MODES {
        for n in [2, 3, 5, 8] {
            let report = run(n, &["all"], env, "60");
            assert_ok(&report, &format!("{name}, {n} ranks"));
        }
    }
}

#[test]
fn paths_follow_the_transport_choice() {
    let report = run(2, &["ring"], &[("GIN_TRANSPORT", "tcp")], "60");
    assert_ok(&report, "tcp");
    assert!(
        report.ranks[0].stdout.contains(r#"paths ["local", "tcp"]"#),
        "{}",
        report.ranks[0].stdout
    );
    let report = run(2, &["ring"], &[], "60");
    assert!(
        report.ranks[1].stdout.contains(r#"paths ["shm", "local"]"#),
        "{}",
        report.ranks[1].stdout
    );
    // Two hosts by identity: auto must cross them over tcp.
    let mut spec = LaunchSpec::new(
        2,
        "sh",
        ["-c", &format!("GIN_HOSTID=host$GIN_RANK exec {BIN} ring")],
    );
    spec.output = Output::Capture;
    let report = launch(&spec).unwrap();
    assert_ok(&report, "two host ids");
    assert!(
        report.ranks[0].stdout.contains(r#"paths ["local", "tcp"]"#),
        "{}",
        report.ranks[0].stdout
    );
}

/// A window dropped without deregistering stops being served before its
/// memory goes: a peer's later put over tcp gets an error naming the key,
/// over shm one saying the owner dropped it, and the owner lives (it used to die of SIGSEGV writing the unmapped
/// segment, as a rank whose communicator dropped its signal window under a
/// late signal did in CI).
#[test]
fn a_window_dropped_without_deregistering_is_no_longer_served() {
    for (name, env) in MODES {
        let report = run(2, &["dropped"], env, "60");
        assert_ok(&report, name);
        let want = if env.contains(&("GIN_TRANSPORT", "tcp")) {
            "unknown memory key"
        } else {
            "dropped or deregistered its part"
        };
        assert!(
            report.ranks[0].stdout.contains(want),
            "{name}: {}",
            report.ranks[0].stdout
        );
    }
}

#[test]
fn a_peer_killed_mid_run_fails_the_survivors_promptly() {
    for (name, env) in MODES {
        // A long timeout: a prompt failure proves death detection.
        let report = run(4, &["die", "2"], env, "60");
        assert!(
            report.elapsed < Duration::from_secs(30),
            "{name}: took {:?}",
            report.elapsed
        );
        for r in report.ranks.iter().filter(|r| r.rank != 2) {
            assert_eq!(
                r.status.and_then(|s| s.code()),
                Some(3),
                "{name}, rank {} ({:?}, stopped by the launcher: {}, after {:?}): {}{}",
                r.rank,
                r.status,
                r.stopped,
                report.elapsed,
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

/// The seconds in `"... {what} S s"` of a line of `text`.
fn seconds_after(text: &str, what: &str) -> f64 {
    let at = text
        .find(what)
        .unwrap_or_else(|| panic!("no {what:?} in {text}"))
        + what.len();
    text[at..]
        .split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no seconds after {what:?} in {text}"))
}

/// A peer that stops draining its connection (SIGSTOP) while a rank streams
/// 1 MiB puts at it over tcp: the sender's blocked write (on the rank
/// thread, the proxy thread or the soft NIC thread) used to wait forever,
/// and dropping the proxy or NIC joined that thread forever.
#[test]
fn a_stopped_peer_fails_a_tcp_sender_within_the_timeout_and_teardown_returns() {
    let timeout = 2.0;
    for (name, env) in MODES
        .iter()
        .filter(|(_, env)| env.contains(&("GIN_TRANSPORT", "tcp")))
    {
        let mut spec = LaunchSpec::new(2, BIN, ["stop", "1"]).env("GIN_TIMEOUT", "2");
        for (k, v) in *env {
            spec = spec.env(k, v);
        }
        spec.output = Output::Capture;
        // The stopped victim is killed this long after the sender fails.
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
        let noticed = seconds_after(out, "noticed after");
        let teardown = seconds_after(out, "torn down in");
        assert!(
            noticed < 2.0 * timeout,
            "{name}: noticed after {noticed} s: {out}"
        );
        assert!(
            teardown < 2.0 * timeout,
            "{name}: torn down in {teardown} s: {out}"
        );
    }
}

/// A rank that stops (SIGSTOP) is noticed by a witness: the rank streaming
/// at it over tcp, whose transport waited the whole timeout, or a rank whose
/// wait on it timed out (any path; its kernel shows the victim stopped). The
/// witness then fails and leaves. Ranks waiting on the witness used to
/// report "rank 0 exited (it left the job in order)" (`cargo xtask faults`,
/// alltoall on 4 ranks: gdaki over tcp, 2 runs in 5; proxy over shm): the
/// witness now tells the job which peer stopped, so every bystander names
/// it, promptly.
#[test]
fn bystanders_name_the_stopped_rank_not_the_witness_that_left_because_of_it() {
    let tcp = |env: &[(&str, &str)]| env.contains(&("GIN_TRANSPORT", "tcp"));
    let streams = MODES
        .iter()
        .filter(|(_, env)| tcp(env))
        .map(|m| (*m, "stream"));
    let waits = MODES
        .iter()
        .filter(|(_, env)| !tcp(env))
        .map(|m| (*m, "wait"));
    for ((name, env), how) in streams.chain(waits) {
        bystander_names_the_stopped_rank(name, env, how);
    }
}

fn bystander_names_the_stopped_rank(name: &str, env: &[(&str, &str)], how: &str) {
    let timeout = 2.0;
    let name = format!("{name}, witness {how}s");
    {
        let mut spec =
            LaunchSpec::new(3, BIN, ["stop-bystander", "1", how]).env("GIN_TIMEOUT", "2");
        for (k, v) in env {
            spec = spec.env(k, v);
        }
        spec.output = Output::Capture;
        // The stopped victim is killed this long after the witness fails.
        spec.grace = Duration::from_secs(3);
        spec.limit = Some(Duration::from_secs(60));
        let report = launch(&spec).unwrap();
        let witness = &report.ranks[0].stdout;
        assert!(
            witness.contains("witness failed") && witness.contains("rank 1"),
            "{name}: the witness did not fail naming rank 1: {witness}{}",
            report.ranks[0].stderr
        );
        let by = &report.ranks[2];
        assert!(
            by.stdout.contains("bystander failed"),
            "{name}: the bystander did not fail by itself: {}{}",
            by.stdout,
            by.stderr
        );
        assert!(
            by.stdout.contains("rank 1 stopped responding") && !by.stdout.contains("rank 0 exited"),
            "{name}: the bystander does not name the stopped rank: {}",
            by.stdout
        );
        let at = seconds_after(&by.stdout, "bystander failed after");
        assert!(
            at < 3.0 * timeout,
            "{name}: the bystander failed {at} s after the stop: {}",
            by.stdout
        );
    }
}

/// A rank killed during registration, after creating its segment, used to
/// leave the file in /dev/shm (5 of 5 kills): survivors now remove the
/// job's names for that window.
#[test]
fn a_rank_killed_during_registration_leaves_no_shared_memory_behind() {
    for round in 0..3 {
        let dir = std::env::temp_dir().join(format!("gin-killreg-{}-{round}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut spec = LaunchSpec::new(2, BIN, ["killreg"])
            .env("GIN_TIMEOUT", "20")
            .env("GIN_SHM_DIR", dir.to_str().unwrap());
        spec.output = Output::Capture;
        spec.limit = Some(Duration::from_secs(60));
        let report = launch(&spec).unwrap();
        let left: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        let _ = std::fs::remove_dir_all(&dir);
        let out = &report.ranks[0].stdout;
        assert!(
            out.contains("registration failed") && out.contains("rank 1"),
            "round {round}: {out}{}",
            report.ranks[0].stderr
        );
        assert!(left.is_empty(), "round {round}: left {left:?} ({out})");
    }
}

/// A put with a signal to a window its owner dropped: the signal is never
/// applied, and the initiator's flush reports the refusal naming window,
/// offset and rank (gdaki over tcp applied the signal; proxy over tcp
/// reported the refusal only on a later call; shm wrote into the orphaned
/// mapping and returned Ok).
#[test]
fn a_signal_is_never_applied_for_refused_data_and_the_flush_reports_it() {
    for (name, env) in MODES {
        let report = run(2, &["refused"], env, "20");
        assert_ok(&report, name);
        assert!(
            report.ranks[0].stdout.contains("refused as expected"),
            "{name}: {}",
            report.ranks[0].stdout
        );
    }
}

/// The seconds a failed wait took, from the selftest's "(after X.XXs)".
fn seconds_waited(stdout: &str) -> Option<f64> {
    let (_, tail) = stdout.rsplit_once("(after ")?;
    tail.split_once("s)")?.0.parse().ok()
}

#[test]
fn a_rank_that_returns_from_main_is_named_as_exited_within_seconds() {
    for (name, env) in MODES {
        // A long timeout: a prompt failure proves the departure was noticed.
        let report = run(3, &["leave", "1"], env, "60");
        assert!(
            report.ranks[1].success(),
            "{name}: {}",
            report.ranks[1].stdout
        );
        for r in report.ranks.iter().filter(|r| r.rank != 1) {
            assert_eq!(
                r.status.and_then(|s| s.code()),
                Some(3),
                "{name}, rank {} (stopped by the launcher: {}): {}{}",
                r.rank,
                r.stopped,
                r.stdout,
                r.stderr
            );
            assert!(
                r.stdout.contains("rank 1 exited"),
                "{name}, rank {}: {}",
                r.rank,
                r.stdout
            );
            let took = seconds_waited(&r.stdout)
                .unwrap_or_else(|| panic!("{name}, rank {}: {}", r.rank, r.stdout));
            assert!(
                took < 3.0,
                "{name}, rank {}: after {took}s: {}",
                r.rank,
                r.stdout
            );
        }
    }
}

#[test]
fn a_rank_that_signals_and_leaves_at_once_does_not_fail_the_waits_it_satisfied() {
    for (name, env) in MODES {
        for round in 0..3 {
            let report = run(3, &["signal-leave", "1"], env, "60");
            assert_ok(&report, &format!("{name}, round {round}"));
        }
    }
}

/// A put refused because its target left after a third rank died names the
/// death (the cause), not the dropped part (its echo). `cargo xtask faults`
/// found the echo on the direct path (alltoall, 4 ranks, SIGKILL).
#[test]
fn a_put_refused_by_a_rank_that_left_after_a_death_names_the_death() {
    for (name, env) in MODES {
        let report = run(3, &["echo"], env, "60");
        for r in report.ranks.iter().filter(|r| r.rank != 1) {
            assert!(
                r.success(),
                "{name}, rank {}: {:?}\n{}{}",
                r.rank,
                r.status,
                r.stdout,
                r.stderr
            );
        }
        assert!(
            report.ranks[0].stdout.contains("echo named"),
            "{name}: {}",
            report.ranks[0].stdout
        );
    }
}

#[test]
fn unavailable_choices_are_clear_errors_listing_the_alternatives() {
    let report = run(2, &["ring"], &[("GIN_BACKEND", "ibgda")], "20");
    for r in &report.ranks {
        assert!(
            r.stdout.contains("GIN_BACKEND=ibgda is not available")
                && r.stdout.contains("available: auto, proxy, gdaki"),
            "{}",
            r.stdout
        );
    }
    // The mlx5 hardware path on a host without a ConnectX: every rank says
    // what is missing and how to get the soft NIC instead.
    let report = run(
        2,
        &["ring"],
        &[("GIN_BACKEND", "gdaki"), ("GIN_NIC", "mlx5")],
        "20",
    );
    for r in &report.ranks {
        assert!(
            r.stdout.contains("GIN_NIC=mlx5 is not available")
                && r.stdout.contains("GIN_NIC=soft")
                && (r.stdout.contains("libmlx5.so.1") || r.stdout.contains("RDMA")),
            "{}",
            r.stdout
        );
    }
    let report = run(1, &["ring"], &[("GIN_TRANSPORT", "infiniband")], "20");
    assert!(
        report.ranks[0].stdout.contains("available: auto, shm, tcp"),
        "{}",
        report.ranks[0].stdout
    );
    let mut spec = LaunchSpec::new(
        2,
        "sh",
        [
            "-c",
            &format!("GIN_TRANSPORT=shm GIN_HOSTID=h$GIN_RANK exec {BIN} ring"),
        ],
    );
    spec.output = Output::Capture;
    let report = launch(&spec).unwrap();
    assert!(
        report.ranks[0]
            .stdout
            .contains("shm reaches only this host"),
        "{}",
        report.ranks[0].stdout
    );
}

#[test]
fn deregistration_waits_for_puts_still_in_flight() {
    for (name, env) in [
        (
            "proxy over tcp",
            &[("GIN_BACKEND", "proxy"), ("GIN_TRANSPORT", "tcp")][..],
        ),
        ("auto over tcp", &[("GIN_TRANSPORT", "tcp")][..]),
        (
            "gdaki over tcp",
            &[("GIN_BACKEND", "gdaki"), ("GIN_TRANSPORT", "tcp")][..],
        ),
        ("auto", &[][..]),
    ] {
        let report = run(2, &["dereg"], env, "60");
        assert_ok(&report, name);
    }
}

/// Requirements that differ between ranks, or exceed a limit, fail every
/// rank with an error naming the field (and who gave what) or the limit,
/// before anything is placed; the process lives on and a well-formed
/// communicator works afterwards. A second deregistration is an error.
#[test]
fn mismatched_or_absurd_requirements_fail_every_rank_alike() {
    for (name, env) in [MODES[0], MODES[2], MODES[5]] {
        let report = run(3, &["requirements"], env, "30");
        assert_ok(&report, name);
        for r in &report.ranks {
            assert!(
                r.stdout
                    .contains("ranks disagree on DevCommRequirements::signals")
                    && r.stdout.contains("rank 0 gave 4; ranks 1, 2 gave 64"),
                "{name}, rank {}: {}",
                r.rank,
                r.stdout
            );
        }
    }
}
