//! `cargo xtask`'s command line, run as a user runs it.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::process::Command;

const XTASK: &str = env!("CARGO_BIN_EXE_xtask");

fn run(args: &[&str]) -> std::process::Output {
    // Away from the repository: a subcommand that mistook --help for a
    // folder or a file would act there, not on the project.
    Command::new(XTASK)
        .args(args)
        .current_dir(std::env::temp_dir())
        .output()
        .unwrap()
}

#[test]
fn help_prints_usage_and_succeeds() {
    for args in [
        &["--help"][..],
        &["-h"],
        &["help"],
        &["launch", "--help"],
        &["launch", "-n", "2", "--help"],
        &["bench", "--help"],
        &["loggp-summary", "--help"],
        &["gpu-package", "--help"],
        &["rdma-bindings", "-h"],
        &["ci", "--help"],
    ] {
        let out = run(args);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "xtask {args:?}: {}\n{stdout}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains("usage: cargo xtask"),
            "xtask {args:?}: {stdout}"
        );
    }
}

#[test]
fn the_top_level_help_names_every_subcommand() {
    let out = run(&["--help"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    for cmd in [
        "launch",
        "bench",
        "loggp-summary",
        "ci",
        "gpu-package",
        "rdma-bindings",
    ] {
        assert!(stdout.contains(cmd), "{cmd} missing from:\n{stdout}");
    }
}

#[test]
fn help_after_the_double_dash_belongs_to_the_ranks_program() {
    // `launch -n 1 -- sh --help` must run `sh --help`... as a rank, not
    // print xtask's usage; `true --help` exits 0 without output.
    let out = run(&["launch", "-n", "1", "--", "true", "--help"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!String::from_utf8_lossy(&out.stdout).contains("usage: cargo xtask"));
}

#[test]
fn a_missing_or_unknown_subcommand_fails_with_the_usage() {
    for args in [
        &[][..],
        &["frobnicate"],
        &["launch", "--bogus", "--", "true"],
    ] {
        let out = run(args);
        assert!(!out.status.success(), "xtask {args:?} succeeded");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("usage: cargo xtask"),
            "xtask {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
