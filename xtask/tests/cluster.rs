//! `cargo xtask cluster` as a user runs it: the built binary, real ranks.
//!
//! - mpirun: Open MPI on localhost for real (`GIN_MPIRUN`, else `mpirun` on
//!   `PATH`; `cargo xtask test` installs the pinned wheel). Without one the
//!   tests say so and pass, unless `GIN_REQUIRE_MPI=1` (CI), then they fail.
//! - ssh: a stand-in `ssh` (`GIN_SSH`) that runs the remote command line on
//!   this machine: it checks the command xtask builds and the wrapper's stop
//!   path, not sshd.
//! - srun: no Slurm here; `--dry-run` checks the command only.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use serde_json::Value;

const XTASK: &str = env!("CARGO_BIN_EXE_xtask");

/// gin-bench, built once (same profile and target folder as xtask).
fn gin_bench() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let st = Command::new(cargo)
            .args(["build", "-q", "-p", "gin-bench"])
            .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
            .status()
            .unwrap();
        assert!(st.success(), "building gin-bench failed");
        let bin = Path::new(XTASK).parent().unwrap().join("gin-bench");
        assert!(bin.is_file(), "{} is missing", bin.display());
        bin
    })
}

/// Open MPI's `mpirun` with `OPAL_PREFIX` (the wheel's needs it), or `None`
/// after saying why the test is skipped; with `GIN_REQUIRE_MPI=1` a missing
/// mpirun fails the test.
fn mpirun() -> Option<(PathBuf, PathBuf)> {
    let found = std::env::var_os("GIN_MPIRUN")
        .map(PathBuf::from)
        .filter(|p| p.is_file())
        .or_else(|| {
            std::env::split_paths(&std::env::var_os("PATH")?)
                .map(|d| d.join("mpirun"))
                .find(|f| f.is_file())
        });
    let Some(bin) = found else {
        assert!(
            std::env::var("GIN_REQUIRE_MPI").as_deref() != Ok("1"),
            "GIN_REQUIRE_MPI=1 but no mpirun: set GIN_MPIRUN or run `cargo xtask test`"
        );
        eprintln!(
            "skipped: no mpirun (GIN_MPIRUN unset and none on PATH; `cargo xtask test` installs one)"
        );
        return None;
    };
    let prefix = std::env::var_os("OPAL_PREFIX").map_or_else(
        || bin.parent().unwrap().parent().unwrap().to_path_buf(),
        PathBuf::from,
    );
    Some((bin, prefix))
}

fn scratch(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("gin-cluster-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).unwrap();
    p
}

/// A stand-in for ssh: logs the host, runs the command line here.
fn fake_ssh(dir: &Path) -> PathBuf {
    let f = dir.join("fake-ssh");
    std::fs::write(
        &f,
        "#!/bin/sh\nhost=$1; shift\necho \"$host\" >> \"$FAKE_SSH_LOG\"\nexec sh -c \"$*\"\n",
    )
    .unwrap();
    let st = Command::new("chmod").arg("+x").arg(&f).status().unwrap();
    assert!(st.success());
    f
}

/// `cargo xtask cluster ARGS`, with the launcher variables of this test
/// process removed (a test run under a launcher must not leak them).
fn cluster(args: &[&str], env: &[(&str, &Path)]) -> Output {
    let mut c = Command::new(XTASK);
    c.arg("cluster").args(args);
    for v in [
        "SLURM_JOB_ID",
        "SLURM_JOBID",
        "SLURM_JOB_NODELIST",
        "GIN_UNIQUE_ID",
        "GIN_ROOT_ADDR",
        "GIN_RANK",
    ] {
        c.env_remove(v);
    }
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

fn index(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("index.json")).unwrap()).unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// No live process is left in `pid`'s process group (the rank's own group
/// under ssh) nor is `pid` itself alive.
fn gone(pid: u64) -> bool {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return true;
    };
    procs.flatten().all(|e| {
        std::fs::read_to_string(e.path().join("stat")).map_or(true, |s| {
            let Some((_, rest)) = s.rsplit_once(')') else {
                return true;
            };
            let f: Vec<&str> = rest.split_whitespace().collect();
            let dead = matches!(f.first(), Some(&("Z" | "X")));
            let this = e.file_name().to_str() == Some(&pid.to_string());
            let group = f.get(2) == Some(&pid.to_string().as_str());
            dead || !(this || group)
        })
    })
}

/// Checks every rank's record and the index of a gin-bench job.
fn check_bench_report(dir: &Path, n: u64, launcher: &str, bench: &str) {
    let idx = index(dir);
    assert_eq!(idx["ok"], true, "{idx:#}");
    assert_eq!(idx["nranks"], n);
    for r in 0..n {
        let rank = &idx["ranks"][r as usize];
        assert_eq!(rank["exit_code"], 0, "{idx:#}");
        assert_eq!(rank["json"], format!("rank-{r}.json"));
        let text = std::fs::read_to_string(dir.join(format!("rank-{r}.json"))).unwrap();
        let rec: Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("rank-{r}.json: {e}: {text:?}"));
        assert_eq!(rec["rank"], r);
        assert_eq!(rec["nranks"], n);
        assert_eq!(rec["launcher"], launcher);
        assert_eq!(rec["bench"], bench);
        assert!(rec["error"].is_null(), "{rec:#}");
        // Rank 0 carries the job's result; the others print none.
        assert_eq!(rec["result"].is_null(), r != 0, "{rec:#}");
    }
}

#[test]
fn mpirun_runs_a_gin_bench_job_and_collects_every_ranks_json() {
    let Some((mpirun, prefix)) = mpirun() else {
        return;
    };
    let dir = scratch("mpi-ok");
    let out = cluster(
        &[
            "--launcher",
            "mpirun",
            "--per-host",
            "3",
            "--out",
            dir.to_str().unwrap(),
            "--timeout",
            "120s",
            "--",
            gin_bench().to_str().unwrap(),
            "alltoall",
            "--ranks",
            "3",
            "--sizes",
            "8,4k",
            "--iters",
            "20",
            "--runs",
            "1",
        ],
        &[("GIN_MPIRUN", &mpirun), ("OPAL_PREFIX", &prefix)],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    check_bench_report(&dir, 3, "openmpi", "alltoall");
    let rec: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("rank-0.json")).unwrap()).unwrap();
    assert_eq!(rec["result"]["ranks"], 3);
    let sizes: Vec<u64> = rec["result"]["sizes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["bytes"].as_u64().unwrap())
        .collect();
    assert_eq!(sizes, [8, 4096]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("-x GIN_ROOT_ADDR"), "{stdout}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn mpirun_a_failing_rank_fails_the_job_naming_it() {
    let Some((mpirun, prefix)) = mpirun() else {
        return;
    };
    let dir = scratch("mpi-fail");
    let out = cluster(
        &[
            "--launcher",
            "mpirun",
            "--per-host",
            "3",
            "--out",
            dir.to_str().unwrap(),
            "--timeout",
            "60s",
            "--",
            "sh",
            "-c",
            "if [ \"$OMPI_COMM_WORLD_RANK\" = 1 ]; then exit 3; fi; sleep 60",
        ],
        &[("GIN_MPIRUN", &mpirun), ("OPAL_PREFIX", &prefix)],
    );
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("rank 1 on ") && err.contains("exit status 3"),
        "{err}"
    );
    let idx = index(&dir);
    assert_eq!(idx["first_failure"], 1, "{idx:#}");
    assert_eq!(idx["ranks"][1]["exit_code"], 3);
    assert_eq!(
        idx["timed_out"], false,
        "mpirun's own abort, not the timeout"
    );
    for r in idx["ranks"].as_array().unwrap() {
        let pid = r["pid"].as_u64().unwrap();
        assert!(gone(pid), "rank {} (pid {pid}) outlived the job", r["rank"]);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn mpirun_a_hung_rank_is_named_at_the_timeout_and_stopped() {
    let Some((mpirun, prefix)) = mpirun() else {
        return;
    };
    let dir = scratch("mpi-hang");
    let out = cluster(
        &[
            "--launcher",
            "mpirun",
            "--per-host",
            "2",
            "--out",
            dir.to_str().unwrap(),
            "--timeout",
            "3s",
            "--",
            "sh",
            "-c",
            "if [ \"$OMPI_COMM_WORLD_RANK\" = 1 ]; then sleep 60; fi",
        ],
        &[("GIN_MPIRUN", &mpirun), ("OPAL_PREFIX", &prefix)],
    );
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("timed out after 3s: rank 1 on "), "{err}");
    let idx = index(&dir);
    assert_eq!(idx["ranks"][0]["exit_code"], 0);
    assert_eq!(idx["ranks"][1]["stopped"], true);
    let pid = idx["ranks"][1]["pid"].as_u64().unwrap();
    assert!(gone(pid), "the hung rank (pid {pid}) outlived the job");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn ssh_runs_one_rank_per_host_slot_and_collects_the_json() {
    let dir = scratch("ssh-ok");
    let ssh = fake_ssh(&dir);
    let log = dir.join("hosts.log");
    let report = dir.join("report");
    let out = cluster(
        &[
            "--launcher",
            "ssh",
            "--hosts",
            "localhost,127.0.0.1",
            "--out",
            report.to_str().unwrap(),
            "--timeout",
            "120s",
            "--",
            gin_bench().to_str().unwrap(),
            "pingpong",
            "--sizes",
            "8,4k",
            "--iters",
            "20",
            "--runs",
            "1",
        ],
        &[("GIN_SSH", &ssh), ("FAKE_SSH_LOG", &log)],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    check_bench_report(&report, 2, "gin", "pingpong");
    let mut hosts: Vec<String> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    hosts.sort();
    assert_eq!(hosts, ["127.0.0.1", "localhost"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("GIN_RANK=1 GIN_NRANKS=2 GIN_LOCAL_RANK=0 GIN_LOCAL_NRANKS=1"),
        "{stdout}"
    );
    // The secret travels on standard input, never on a command line.
    assert!(!stdout.contains("GIN_JOB_SECRET="), "{stdout}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn ssh_a_failing_rank_stops_the_others_and_their_process_groups() {
    let dir = scratch("ssh-fail");
    let ssh = fake_ssh(&dir);
    let log = dir.join("hosts.log");
    let report = dir.join("report");
    let out = cluster(
        &[
            "--launcher",
            "ssh",
            "--hosts",
            "localhost,127.0.0.1",
            "--per-host",
            "2",
            "--out",
            report.to_str().unwrap(),
            "--timeout",
            "60s",
            "--grace",
            "1s",
            "--",
            "sh",
            "-c",
            // A child in the rank's group, to check the group goes too.
            "if [ \"$GIN_RANK\" = 2 ]; then exit 7; fi; sleep 60 & wait",
        ],
        &[("GIN_SSH", &ssh), ("FAKE_SSH_LOG", &log)],
    );
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("rank 2 on ") && err.contains("exit status 7"),
        "{err}"
    );
    let idx = index(&report);
    assert_eq!(idx["first_failure"], 2, "{idx:#}");
    assert_eq!(idx["timed_out"], false);
    for r in idx["ranks"].as_array().unwrap() {
        let pid = r["pid"].as_u64().unwrap();
        assert!(
            gone(pid),
            "rank {} (group {pid}) outlived the job",
            r["rank"]
        );
        if r["rank"] != 2 {
            assert_eq!(r["stopped"], true, "{idx:#}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn ssh_a_hung_rank_is_named_at_the_timeout_and_its_group_killed() {
    let dir = scratch("ssh-hang");
    let ssh = fake_ssh(&dir);
    let log = dir.join("hosts.log");
    let report = dir.join("report");
    let out = cluster(
        &[
            "--launcher",
            "ssh",
            "--hosts",
            "localhost",
            "--per-host",
            "2",
            "--out",
            report.to_str().unwrap(),
            "--timeout",
            "2s",
            "--",
            "sh",
            "-c",
            // Ignores SIGTERM: only the wrapper's SIGKILL ends it.
            "if [ \"$GIN_RANK\" = 1 ]; then trap '' TERM; sleep 60 & wait; fi",
        ],
        &[("GIN_SSH", &ssh), ("FAKE_SSH_LOG", &log)],
    );
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("timed out after 2s: rank 1 on "), "{err}");
    let idx = index(&report);
    let pid = idx["ranks"][1]["pid"].as_u64().unwrap();
    assert!(gone(pid), "the hung rank's group {pid} outlived the job");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn srun_inside_an_allocation_dry_run_prints_the_step() {
    let dir = scratch("srun");
    let mut c = Command::new(XTASK);
    c.args([
        "cluster",
        "--per-host",
        "4",
        "--out",
        dir.to_str().unwrap(),
        "--dry-run",
        "--",
        "/opt/gin/gin-bench",
        "alltoall",
    ])
    .env("SLURM_JOB_ID", "42")
    .env("SLURM_JOB_NODELIST", "gpu[07-08]")
    .env("UCX_TLS", "rc_x,cuda_copy")
    .env("GIN_TRANSPORT", "ucx")
    .env("GIN_RANK", "5")
    .env_remove("GIN_ROOT_ADDR")
    .env_remove("GIN_UNIQUE_ID");
    let out = c.output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let s = String::from_utf8_lossy(&out.stdout);
    for want in [
        "srun --nodes=2 --ntasks=8 --ntasks-per-node=4 --kill-on-bad-exit=1 --label --export=ALL",
        "GIN_ROOT_ADDR=gpu07:",
        "GIN_TRANSPORT=ucx",
        "UCX_TLS=rc_x,cuda_copy",
        "GIN_JOB_SECRET=<secret>",
        // Quoted: braces are left to no shell's brace expansion.
        &format!("--json '{}/rank-{{rank}}.json'", dir.display()),
    ] {
        assert!(s.contains(want), "missing {want:?} in\n{s}");
    }
    assert!(
        !s.contains("GIN_RANK=5"),
        "a stale GIN_RANK must not reach the ranks:\n{s}"
    );
    assert!(!dir.join("index.json").exists(), "--dry-run ran something");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn mpirun_dry_run_places_ranks_per_host_and_forwards_variables() {
    let out = Command::new(XTASK)
        .args([
            "cluster",
            "--launcher",
            "mpirun",
            "--hosts",
            "a,b",
            "-N",
            "2",
            "--root-addr",
            "10.0.0.1:29500",
            "--launcher-arg",
            "--mca",
            "--launcher-arg",
            "btl_tcp_if_include",
            "--launcher-arg",
            "ib0",
            "--dry-run",
            "--",
            "/opt/gin/gin-selftest",
            "all",
        ])
        .env("UCX_NET_DEVICES", "mlx5_0:1")
        .env_remove("SLURM_JOB_ID")
        .env_remove("GIN_ROOT_ADDR")
        .env_remove("GIN_UNIQUE_ID")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let s = String::from_utf8_lossy(&out.stdout);
    for want in [
        "GIN_ROOT_ADDR=10.0.0.1:29500",
        "-n 4 -N 2 --host a:2,b:2",
        "-x GIN_ROOT_ADDR",
        "-x UCX_NET_DEVICES",
        "-x GIN_JOB_SECRET",
        "--mca btl_tcp_if_include ib0 sh -c",
        "gin-rank /opt/gin/gin-selftest all",
    ] {
        assert!(s.contains(want), "missing {want:?} in\n{s}");
    }
    // Not gin-bench: no --json is added.
    assert!(!s.contains("--json"), "{s}");
}
