//! `cargo xtask launch` as a user runs it: the built binary, real ranks.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const XTASK: &str = env!("CARGO_BIN_EXE_xtask");

/// Whether `pid` is still a live process (an unreaped zombie has exited).
fn alive(pid: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X']))
    })
}

fn scratch(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("gin-xtask-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).unwrap();
    p
}

#[test]
fn ctrl_c_to_the_launcher_stops_every_rank_and_what_it_started() {
    // Ranks live in process groups of their own, so a terminal's SIGINT
    // reaches only the launcher; it must pass the stop on.
    let dir = scratch("sigint");
    let script = r#"sleep 60 & echo $! > "$PIDS/$GIN_RANK.tmp" && mv "$PIDS/$GIN_RANK.tmp" "$PIDS/$GIN_RANK"; wait"#;
    let child = Command::new(XTASK)
        .args([
            "launch", "-n", "2", "--grace", "1s", "--", "sh", "-c", script,
        ])
        .env("PIDS", &dir)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !(dir.join("0").exists() && dir.join("1").exists()) {
        assert!(Instant::now() < deadline, "the ranks never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    let pids: Vec<String> = (0..2)
        .map(|r| {
            std::fs::read_to_string(dir.join(r.to_string()))
                .unwrap()
                .trim()
                .to_owned()
        })
        .collect();
    let t = Instant::now();
    let st = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    let out = child.wait_with_output().unwrap();
    let took = t.elapsed();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert!(!out.status.success());
    for p in &pids {
        assert!(!alive(p), "rank child {p} survived Ctrl-C of the launcher");
    }
}
