//! What the selftest prints: with `GIN_DEBUG` it logs to stderr, without it
//! it stays quiet. (gin-core's `tests/logs.rs` checks the examples alike.)

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::path::PathBuf;
use std::process::{Command, Output};

const SELFTEST: &str = env!("CARGO_BIN_EXE_gin-selftest");

/// Runs `exe args` as a user would (it spawns its own ranks) with `GIN_DEBUG`
/// set to `debug` or unset.
fn run(exe: &PathBuf, args: &[&str], debug: Option<&str>) -> Output {
    let mut c = Command::new(exe);
    c.args(args).env("GIN_TIMEOUT", "30");
    for k in [
        "GIN_DEBUG",
        "GIN_RANK",
        "GIN_NRANKS",
        "GIN_UNIQUE_ID",
        "RUST_LOG",
    ] {
        c.env_remove(k);
    }
    if let Some(v) = debug {
        c.env("GIN_DEBUG", v);
    }
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{} {args:?}: {}\n{}",
        exe.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn check_logs(exe: &PathBuf, args: &[&str]) {
    let loud = run(exe, args, Some("debug"));
    let err = String::from_utf8_lossy(&loud.stderr);
    // The launcher's root logs each rank joining; each rank logs its
    // bootstrap and its windows.
    assert!(
        err.lines()
            .any(|l| l.contains("DEBUG") && l.contains("gin_bootstrap")),
        "no debug line on stderr with GIN_DEBUG=debug:\n{err}"
    );
    assert!(
        err.lines()
            .any(|l| l.starts_with("[rank 1]") && l.contains("DEBUG")),
        "no debug line from a rank process:\n{err}"
    );
    assert!(!err.contains('\x1b'), "colours on a pipe:\n{err:?}");
    let quiet = run(exe, args, None);
    let err = String::from_utf8_lossy(&quiet.stderr);
    assert!(
        !err.contains("DEBUG"),
        "debug lines without GIN_DEBUG:\n{err}"
    );
}

#[test]
fn gin_debug_turns_on_the_selftests_logs() {
    check_logs(&PathBuf::from(SELFTEST), &["ring", "--ranks", "2"]);
}
