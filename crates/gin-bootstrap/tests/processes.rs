//! Ranks as separate processes, started by the same launcher users use.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::time::Duration;

use gin_bootstrap::{Config, LaunchSpec, Output, launch};

const BIN: &str = env!("CARGO_BIN_EXE_gin-bootstrap-selftest");

fn spec(n: usize, args: &[&str], timeout: &str) -> LaunchSpec {
    let mut s = LaunchSpec::new(n, BIN, args.iter().copied()).env("GIN_TIMEOUT", timeout);
    s.output = Output::Capture;
    s.grace = Duration::from_secs(20);
    s.limit = Some(Duration::from_secs(120));
    s.config = Config {
        timeout: Duration::from_secs(60),
        ..Config::default()
    };
    s
}

#[test]
fn collectives_are_correct_for_1_to_16_process_ranks() {
    for n in 1..=16 {
        let report = launch(&spec(n, &["check", "2"], "60")).unwrap();
        for r in &report.ranks {
            assert!(
                r.success(),
                "{n} ranks, rank {}: {:?}\n{}{}",
                r.rank,
                r.status,
                r.stdout,
                r.stderr
            );
            assert!(
                r.stdout.contains(&format!("rank {} of {n}: ok", r.rank)),
                "{}",
                r.stdout
            );
        }
    }
}

#[test]
fn a_rank_killed_mid_allgather_fails_the_others_promptly() {
    // The timeout is long, so a prompt failure proves death detection, not a timeout.
    let report = launch(&spec(6, &["die", "2"], "60")).unwrap();
    assert!(!report.success());
    assert!(
        report.elapsed < Duration::from_secs(30),
        "took {:?}",
        report.elapsed
    );
    assert!(!report.ranks[2].success());
    for r in report.ranks.iter().filter(|r| r.rank != 2) {
        assert_eq!(
            r.status.and_then(|s| s.code()),
            Some(3),
            "rank {}: {}{}",
            r.rank,
            r.stdout,
            r.stderr
        );
        assert!(
            r.stdout.contains("rank 2 died"),
            "rank {}: {}",
            r.rank,
            r.stdout
        );
        assert!(
            !r.stopped,
            "rank {} had to be stopped instead of failing by itself",
            r.rank
        );
    }
}

#[test]
fn a_rank_that_never_joins_is_named_by_every_other() {
    let mut s = spec(4, &["absent", "3"], "2");
    s.config.timeout = Duration::from_secs(2);
    let report = launch(&s).unwrap();
    for r in report.ranks.iter().filter(|r| r.rank != 3) {
        assert_eq!(
            r.status.and_then(|s| s.code()),
            Some(3),
            "rank {}: {}",
            r.rank,
            r.stdout
        );
        assert!(
            r.stdout.contains("never answered: [3]"),
            "rank {}: {}",
            r.rank,
            r.stdout
        );
    }
}

#[test]
fn the_launcher_stops_survivors_after_the_grace_period() {
    // `sh -c` ranks: rank 0 fails at once, the others would sleep for a minute.
    let mut s = LaunchSpec::new(
        3,
        "sh",
        [
            "-c",
            r#"if [ "$GIN_RANK" = 0 ]; then echo bye; exit 4; fi; exec sleep 60"#,
        ],
    );
    s.output = Output::Capture;
    s.grace = Duration::from_millis(300);
    let report = launch(&s).unwrap();
    assert_eq!(report.first_failure, Some(0));
    assert_eq!(report.ranks[0].status.and_then(|s| s.code()), Some(4));
    assert_eq!(report.ranks[0].stdout, "bye\n");
    assert!(report.ranks[1].stopped && report.ranks[2].stopped);
    assert!(
        report.elapsed < Duration::from_secs(20),
        "took {:?}",
        report.elapsed
    );
    let d = report.describe_failures();
    assert!(
        d.contains("rank 0: exited with status 4") && d.contains("rank 0 failed first"),
        "{d}"
    );
}

#[test]
fn launch_reports_a_program_that_cannot_start() {
    let e = launch(&LaunchSpec::new(
        2,
        "/nonexistent/gin-rank",
        Vec::<String>::new(),
    ))
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("starting rank 0 (/nonexistent/gin-rank)"),
        "{e}"
    );
}
