//! What the examples print: with `GIN_DEBUG` they log to stderr, without it
//! they stay quiet, and their errors read as Display, never Debug. (The
//! selftest's logs are checked in gin-selftest's `tests/logs.rs`.)

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::path::PathBuf;
use std::process::{Command, Output};

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
fn gin_debug_turns_on_the_examples_logs() {
    // `cargo test` builds the examples beside the test binaries; a run of
    // this test alone (`--test logs`) may not have.
    let dir = std::env::current_exe().unwrap();
    let examples = dir.parent().unwrap().parent().unwrap().join("examples");
    for (name, args) in [
        ("ring", &["2", "64"][..]),
        ("alltoall", &["2", "64"]),
        ("pingpong", &["10", "8"]),
    ] {
        let exe = examples.join(name);
        if !exe.exists() {
            println!(
                "SKIPPED {name}: {} is not built (run `cargo test -p gin-core` or `cargo build -p gin-core --examples`)",
                exe.display()
            );
            continue;
        }
        check_logs(&exe, args);
    }
}

#[test]
fn the_all_to_all_example_names_what_each_peer_uses() {
    let exe = std::env::current_exe().unwrap();
    let exe = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples/alltoall");
    if !exe.exists() {
        println!(
            "SKIPPED: {} is not built (run `cargo test -p gin-core`)",
            exe.display()
        );
        return;
    }
    // Same host, auto backend: every peer is reached by load/store, whatever
    // backend serves the others.
    let out = run(&exe, &["3", "64"], None);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("[rank 0] rank 0: all-to-all of 64 B blocks with 3 ranks verified (peers 1: load/store over shm, 2: load/store over shm)"),
        "{stdout}"
    );
    assert!(!stdout.contains("proxy"), "{stdout}");
}

#[test]
fn an_example_prints_a_bad_backend_as_a_sentence_not_debug() {
    let exe = std::env::current_exe().unwrap();
    let exe = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples/ring");
    if !exe.exists() {
        println!(
            "SKIPPED: {} is not built (run `cargo test -p gin-core`)",
            exe.display()
        );
        return;
    }
    let out = Command::new(&exe)
        .args(["2", "64"])
        .env("GIN_BACKEND", "bogus")
        .env("GIN_TIMEOUT", "30")
        .env_remove("GIN_DEBUG")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("[rank 0] ring: GIN_BACKEND=bogus is not available: unknown backend"),
        "{err}"
    );
    assert!(
        !err.contains("Unavailable {") && !err.contains("Error: "),
        "{err}"
    );
}
