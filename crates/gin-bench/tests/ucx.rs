//! `gin-bench pingpong|bandwidth|rate --transport ucx`: the ranks reach each
//! other over UCX, and each row carries the same-job `ucx_perftest` floor
//! (`ucp_put_lat` / `ucp_put_bw`) from the same library.
//!
//! Skipped with a printed reason without `GIN_UCX_LIB`; required (a
//! failure instead) with `GIN_REQUIRE_UCX=1` or `CI`, as gin-selftest's
//! UCX tests.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::process::Command;

use serde_json::Value;

const BENCH: &str = env!("CARGO_BIN_EXE_gin-bench");

fn ucx() -> bool {
    let ok = std::env::var("GIN_UCX_LIB").is_ok_and(|p| std::path::Path::new(&p).exists());
    if !ok {
        let why = "GIN_UCX_LIB does not name an existing libucp.so.0 (`cargo xtask test` installs the pinned UCX wheel and sets it)";
        let required = std::env::var("GIN_REQUIRE_UCX").is_ok_and(|v| v == "1")
            || std::env::var_os("CI").is_some();
        assert!(
            !required,
            "UCX is required here (GIN_REQUIRE_UCX=1 or CI) but {why}"
        );
        println!("SKIPPED: gin-bench over UCX needs UCX: {why}");
    }
    ok
}

/// Runs one subcommand over UCX's tcp and returns its JSON results.
fn bench(args: &[&str]) -> Value {
    let dir =
        std::env::temp_dir().join(format!("gin-bench-ucx-{}-{}", std::process::id(), args[0]));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join(format!("{}.json", args[0]));
    let mut c = Command::new(BENCH);
    c.args(args)
        .args(["--transport", "ucx", "--runs", "2", "--json"])
        .arg(&json)
        .env("UCX_TLS", "tcp,self")
        .env("GIN_TIMEOUT", "60");
    for k in ["GIN_RANK", "GIN_NRANKS", "GIN_UNIQUE_ID", "GIN_TRANSPORT"] {
        c.env_remove(k);
    }
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    v["results"].clone()
}

/// Every row's floor is a positive time from ucx_perftest.
fn assert_floors(r: &Value, rows: &str, test: &str) {
    assert_eq!(r["path"], "ucx", "{r}");
    let floor = r["floor"].as_str().unwrap();
    assert!(
        floor.contains("ucx_perftest") && floor.contains(test),
        "{floor}"
    );
    let rows = r[rows].as_array().unwrap();
    assert!(!rows.is_empty());
    for row in rows {
        let f = row["row"]["floor_us"]["median"].as_f64().unwrap();
        let us = row["row"]["us"]["median"].as_f64().unwrap();
        assert!(f > 0.0 && us > 0.0, "{row}");
    }
}

#[test]
fn pingpong_over_ucx_reports_the_ucp_put_lat_floor() {
    if !ucx() {
        return;
    }
    let r = bench(&["pingpong", "--sizes", "8,64k", "--iters", "100"]);
    assert_floors(&r, "sizes", "ucp_put_lat");
}

#[test]
fn bandwidth_and_rate_over_ucx_report_the_ucp_put_bw_floor() {
    if !ucx() {
        return;
    }
    let r = bench(&[
        "bandwidth",
        "--sizes",
        "64k",
        "--window",
        "1,4",
        "--dir",
        "uni,bi",
        "--iters",
        "20",
    ]);
    assert_floors(&r, "points", "ucp_put_bw");
    let r = bench(&["rate", "--window", "8", "--iters", "400"]);
    assert_floors(&r, "points", "ucp_put_bw");
}
