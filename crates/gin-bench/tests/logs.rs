//! `GIN_DEBUG` through gin-bench's front end: the ranks it spawns log too.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::process::{Command, Output};

const BENCH: &str = env!("CARGO_BIN_EXE_gin-bench");

fn bootstrap_run(debug: Option<&str>) -> Output {
    let mut c = Command::new(BENCH);
    c.args(["bootstrap", "--ranks", "2", "--iters", "2", "--runs", "1"])
        .env("GIN_TIMEOUT", "30");
    for k in ["GIN_DEBUG", "GIN_RANK", "GIN_NRANKS", "GIN_UNIQUE_ID"] {
        c.env_remove(k);
    }
    if let Some(v) = debug {
        c.env("GIN_DEBUG", v);
    }
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

#[test]
fn gin_debug_passes_the_ranks_logs_through_the_front_end() {
    let out = bootstrap_run(Some("gin_bootstrap=debug"));
    let err = String::from_utf8_lossy(&out.stderr);
    for rank in 0..2 {
        assert!(
            err.lines()
                .any(|l| l.starts_with(&format!("[rank {rank}]")) && l.contains("DEBUG")),
            "no debug line from rank {rank}:\n{err}"
        );
    }
    let out = bootstrap_run(None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("DEBUG"), "{err}");
}
