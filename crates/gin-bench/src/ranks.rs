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

/// Prints a rank's result for the front end to collect.
pub fn emit<T: serde::Serialize>(value: &T) -> Result<()> {
    println!("{RESULT_PREFIX}{}", serde_json::to_string(value)?);
    Ok(())
}

/// Runs this same executable as `nranks` local ranks with the same arguments
/// and returns rank 0's result.
pub fn spawn_self<T: DeserializeOwned>(
    nranks: usize,
    args: &[String],
    env: &[(String, String)],
) -> Result<T> {
    let exe = std::env::current_exe().context("finding the gin-bench executable")?;
    let mut spec = LaunchSpec::new(nranks, exe, args.iter().cloned());
    for (k, v) in env {
        spec = spec.env(k, v);
    }
    spec.output = Output::Capture;
    spec.grace = Duration::from_secs(10);
    spec.config = gin_bootstrap::Config::from_env()?;
    let report = launch(&spec)?;
    if !report.success() {
        let mut msg = format!("{nranks}-rank run failed: {}\n", report.describe_failures());
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

/// The environment that selects a backend and transport for the ranks.
pub fn choice_env(backend: Option<&String>, transport: Option<&String>) -> Vec<(String, String)> {
    let mut env = Vec::new();
    if let Some(b) = backend {
        env.push(("GIN_BACKEND".to_owned(), b.clone()));
    }
    if let Some(t) = transport {
        env.push(("GIN_TRANSPORT".to_owned(), t.clone()));
    }
    env
}

/// Writes `value` as pretty JSON to `path` when one was given (`--json`).
pub fn write_json<T: serde::Serialize>(path: Option<&std::path::PathBuf>, value: &T) -> Result<()> {
    if let Some(path) = path {
        std::fs::write(path, serde_json::to_string_pretty(value)?)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}
