//! Every gin-bench subcommand runs as one rank when a launcher started it,
//! and otherwise spawns its own local ranks through gin-bootstrap's launcher.

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use gin_bootstrap::{LaunchEnv, LaunchSpec, Output, launch};
use serde::de::DeserializeOwned;

/// Marks the one line of a rank's output that carries its result.
pub const RESULT_PREFIX: &str = "GIN_BENCH_RESULT ";

/// True when this process is one rank of a launched job.
pub fn is_rank() -> bool {
    LaunchEnv::present(|k| std::env::var(k).ok())
}

/// The result this rank emitted, for its `--json` record (see
/// [`crate::report::write_rank_record`]).
static EMITTED: std::sync::OnceLock<serde_json::Value> = std::sync::OnceLock::new();

/// Prints a rank's result for the front end to collect.
pub fn emit<T: serde::Serialize>(value: &T) -> Result<()> {
    let json = serde_json::to_value(value)?;
    println!("{RESULT_PREFIX}{json}");
    let _ = EMITTED.set(json);
    Ok(())
}

/// What [`emit`] printed in this process, if anything.
pub fn emitted() -> Option<&'static serde_json::Value> {
    EMITTED.get()
}

/// Carries a subcommand's parsed options to its ranks as JSON, so that a
/// front end (or `loggp`, which runs other subcommands) can hand ranks
/// options it built itself rather than a command line.
pub const ARGS_ENV: &str = "GIN_BENCH_ARGS";

/// In a rank: the options the front end passed, else the ones parsed from
/// this process's own command line (a rank started by an outside launcher).
pub fn rank_args<T: DeserializeOwned>(parsed: T) -> Result<T> {
    match std::env::var(ARGS_ENV) {
        Ok(json) => serde_json::from_str(&json).context("parsing the options the front end passed"),
        Err(_) => Ok(parsed),
    }
}

/// Runs this same executable as `nranks` local ranks of `subcommand` with
/// `args` and returns rank 0's result.
pub fn spawn_self<T: DeserializeOwned>(
    nranks: usize,
    subcommand: &str,
    args: &impl serde::Serialize,
    env: &[(String, String)],
) -> Result<T> {
    let exe = std::env::current_exe().context("finding the gin-bench executable")?;
    let mut spec = LaunchSpec::new(nranks, exe, [subcommand]);
    spec = spec.env(ARGS_ENV, serde_json::to_string(args)?);
    for (k, v) in env {
        spec = spec.env(k, v);
    }
    // Results come on the ranks' stdout. Their stderr is kept for the error
    // report, unless GIN_DEBUG asks for logs: then it is passed through as it
    // comes, prefixed by rank, like the front end's own.
    spec.output = if gin_bootstrap::tracing_requested() {
        Output::CaptureStdout
    } else {
        Output::Capture
    };
    spec.grace = Duration::from_secs(10);
    spec.config = gin_bootstrap::Config::from_env()?;
    let report = launch(&spec)?;
    if !report.success() {
        let mut msg = format!(
            "{subcommand}: {nranks}-rank run failed: {}\n",
            report.describe_failures()
        );
        for r in &report.ranks {
            for line in r.stdout.lines().chain(r.stderr.lines()) {
                let _ = writeln!(msg, "[rank {}] {line}", r.rank);
            }
        }
        bail!(msg);
    }
    let out = &report.ranks[0].stdout;
    let line = out
        .lines()
        .find_map(|l| l.strip_prefix(RESULT_PREFIX))
        .with_context(|| format!("rank 0 printed no result; its output was:\n{out}"))?;
    serde_json::from_str(line).context("parsing rank 0's result")
}

/// Iterations for messages of `size` bytes: `base` up to 64 KiB, then fewer
/// in proportion (at least 50, or `base` if smaller), so every size costs
/// about the same time.
pub fn iters_for(base: usize, size: u64) -> usize {
    let scaled = (base as u64 * (64 << 10) / size.max(64 << 10)) as usize;
    scaled.clamp(50.min(base), base.max(1))
}

/// Windows per run for `bytes_per_window`: `base` while a window is at most
/// 64 KiB, then fewer in proportion (at least 2, or `base` if smaller), so
/// that every point moves about the same bytes.
pub fn windows_for(base: usize, bytes_per_window: u64) -> usize {
    let scaled = (base as u64).saturating_mul(64 << 10) / bytes_per_window.max(64 << 10);
    (scaled.min(usize::MAX as u64) as usize).clamp(2.min(base), base.max(1))
}

/// Collective: rank 0's path to rank 1 (`direct`... as gin-core names it),
/// so that every rank picks the same floor.
pub fn path_to_rank1(comm: &gin_core::Comm) -> Result<String> {
    let names = comm.path_names();
    let mine = if comm.rank() == 0 {
        names.get(1).copied().unwrap_or("")
    } else {
        ""
    };
    Ok(String::from_utf8(
        comm.bootstrap().broadcast(0, mine.as_bytes())?,
    )?)
}

/// How rank 0 reaches rank 1, for tables: the direct load/store path or the
/// backend, with the `GIN_BACKEND` asked for.
pub fn backend_label(dc: &gin_core::DevComm) -> String {
    if dc.nranks() > 1 && dc.rank() == 0 && dc.is_direct(1) {
        "auto (direct load/store)".to_owned()
    } else {
        format!(
            "{} ({})",
            dc.backend_name(),
            std::env::var("GIN_BACKEND").unwrap_or_else(|_| "auto".into())
        )
    }
}

/// Peak resident memory of this process (VmHWM), KiB; 0 where unknown.
pub fn peak_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

/// Decodes a little-endian f64 that a rank contributed to an allgather.
pub fn f64_le(b: &[u8]) -> Result<f64> {
    Ok(f64::from_le_bytes(
        b.try_into().context("a rank sent a malformed sample")?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iterations_scale_down_above_64k() {
        assert_eq!(iters_for(1000, 8), 1000);
        assert_eq!(iters_for(1000, 64 << 10), 1000);
        assert_eq!(iters_for(1000, 256 << 10), 250);
        assert_eq!(iters_for(1000, 64 << 20), 50);
        assert_eq!(iters_for(20, 64 << 20), 20);
    }

    #[test]
    fn windows_scale_down_with_window_bytes() {
        assert_eq!(windows_for(1000, 8), 1000);
        assert_eq!(windows_for(1000, 64 << 10), 1000);
        assert_eq!(windows_for(1000, 1 << 20), 62);
        assert_eq!(windows_for(1000, 1 << 30), 2);
        assert_eq!(windows_for(1, 1 << 30), 1);
    }
}
