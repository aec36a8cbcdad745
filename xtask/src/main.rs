//! Project automation (`cargo xtask <command>`), kept light on dependencies.
//!
//! - `launch -n N [--grace SECS] [--timeout SECS] -- CMD ARGS...`: start N local
//!   ranks of CMD with the `GIN_*` variables set, output prefixed by rank; if a
//!   rank fails, the others are stopped after the grace period and the exit
//!   status is non-zero.
//! - `cluster [--launcher mpirun|srun|ssh] [--hosts A,B] -- CMD ARGS...`: CMD
//!   as a multi-host job through mpirun, srun or ssh (docs/cluster.md).
//! - `bench [smoke|quick|full] [--machine NAME] [--out DIR]`: a suite of gin-bench
//!   runs, written to `target/bench/<machine>/` (or `--out DIR`) as JSON,
//!   Markdown and SVG plots.
//! - `faults [--quick] [--timeout 5s] [--only TEXT] [--out FILE.md]`: the
//!   reliability campaign: one rank of gin-bench jobs on every backend and
//!   transport is killed or stopped, and every survivor must end with an
//!   error naming it within twice the timeout (docs/reliability.md).
//! - `loggp-summary FILE...`: medians over several `gin-bench loggp --json`
//!   reports of one path, as Markdown (what docs/loggp.md quotes).
//! - `test [ARGS]`: the README's test command: installs the pinned wheels
//!   (`.ci/wheels.txt`: UCX, Open MPI) under `target/wheels` and runs
//!   `cargo test --workspace ARGS` pointed at them (see `wheels.rs`).
//! - `wheels`: only installs them, printing the variables that name them.
//! - `ci`: what CI runs (`.ci/run`).
//! - `gpu-package [DIR]`: release binaries and a run script for a GPU
//!   machine without Rust (see docs/cuda.md).
//! - `rdma-bindings [INCLUDE_DIR]`: regenerate gin-gdaki's rdma-core
//!   bindings with bindgen (needs rdma-core's headers and libclang).
//! - `ucx-bindings [INCLUDE_DIR]`: regenerate gin-net's UCP bindings with
//!   bindgen (needs UCX's headers, e.g. the pinned wheel's, and libclang).
//!
//! Dependencies stay few: plotters (SVG only) for the plots, serde_json
//! to read gin-bench's reports, and bindgen (libclang loaded at run time)
//! for the rdma-core bindings.

mod bench;
mod cluster;
mod faults;
mod gpu;
mod plot;
mod rdma;
mod summary;
mod ucx;
mod wheels;

use std::process::{Command, ExitCode};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use gin_bootstrap::{LaunchSpec, launch, parse_duration};

fn main() -> ExitCode {
    gin_bootstrap::init_tracing_from_env();
    match run() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("xtask: {e:#}");
            ExitCode::FAILURE
        }
    }
}

const LAUNCH_USAGE: &str =
    "usage: cargo xtask launch -n N [--grace DURATION] [--timeout DURATION] -- CMD [ARGS...]";

/// Each subcommand's usage line, in the order `--help` lists them.
const USAGES: &[(&str, &str)] = &[
    ("launch", LAUNCH_USAGE),
    ("cluster", cluster::USAGE),
    ("bench", bench::USAGE),
    (
        "faults",
        "usage: cargo xtask faults [--quick] [--timeout 5s] [--only TEXT] [--out FILE.md]",
    ),
    ("loggp-summary", "usage: cargo xtask loggp-summary FILE..."),
    ("test", wheels::TEST_USAGE),
    ("wheels", wheels::WHEELS_USAGE),
    ("ci", "usage: cargo xtask ci"),
    ("gpu-package", "usage: cargo xtask gpu-package [DIR]"),
    (
        "rdma-bindings",
        "usage: cargo xtask rdma-bindings [INCLUDE_DIR]",
    ),
    ("ucx-bindings", ucx::USAGE),
];

/// Every usage line, aligned under the first.
fn usage() -> String {
    let lines: Vec<&str> = USAGES
        .iter()
        .map(|(_, u)| u.trim_start_matches("usage: "))
        .collect();
    format!("usage: {}", lines.join("\n       "))
}

/// `-h` or `--help` among a subcommand's own arguments (for `launch`, those
/// before `--`: the rest belongs to the ranks' program).
fn wants_help(args: &[String]) -> bool {
    args.iter()
        .take_while(|a| *a != "--")
        .any(|a| a == "-h" || a == "--help")
}

fn run() -> Result<ExitCode> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cmd = args.first().map(String::as_str);
    if matches!(cmd, Some("-h" | "--help" | "help")) {
        println!("{}", usage());
        return Ok(ExitCode::SUCCESS);
    }
    if let Some(&(_, u)) = USAGES.iter().find(|(c, _)| Some(*c) == cmd)
        && wants_help(&args[1..])
    {
        println!("{u}");
        return Ok(ExitCode::SUCCESS);
    }
    match cmd {
        Some("launch") => launch_cmd(&args[1..]),
        Some("cluster") => cluster::run(&args[1..]),
        Some("gpu-package") => gpu::package(&args[1..]).map(|()| ExitCode::SUCCESS),
        Some("bench") => bench::run(&args[1..]).map(|()| ExitCode::SUCCESS),
        Some("faults") => faults::run(&args[1..]).map(|()| ExitCode::SUCCESS),
        Some("loggp-summary") => summary::run(&args[1..]).map(|()| ExitCode::SUCCESS),
        Some("rdma-bindings") => rdma::run(&args[1..]).map(|()| ExitCode::SUCCESS),
        Some("ucx-bindings") => ucx::run(&args[1..]).map(|()| ExitCode::SUCCESS),
        Some("test") => wheels::test_cmd(&args[1..]),
        Some("wheels") => wheels::wheels_cmd(),
        Some("ci") => {
            let st = Command::new("bash")
                .arg(".ci/run")
                .status()
                .context("running .ci/run")?;
            Ok(if st.success() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        Some(other) => bail!("unknown command {other:?}\n{}", usage()),
        None => bail!("{}", usage()),
    }
}

fn launch_cmd(args: &[String]) -> Result<ExitCode> {
    let split = args
        .iter()
        .position(|a| a == "--")
        .with_context(|| format!("missing `--` before the command\n{LAUNCH_USAGE}"))?;
    let (opts, cmd) = (&args[..split], &args[split + 1..]);
    let Some((program, prog_args)) = cmd.split_first() else {
        bail!("no command after `--`\n{LAUNCH_USAGE}");
    };
    let mut n = None;
    let mut grace = Duration::from_secs(5);
    let mut limit = None;
    let mut it = opts.iter();
    while let Some(o) = it.next() {
        let mut val = || it.next().with_context(|| format!("{o} needs a value"));
        match o.as_str() {
            "-n" | "--ranks" => {
                let v = val()?;
                n = Some(
                    v.parse::<usize>()
                        .with_context(|| format!("-n {v:?} is not a rank count"))?,
                );
            }
            "--grace" => grace = parse_duration(val()?).map_err(anyhow::Error::msg)?,
            "--timeout" => limit = Some(parse_duration(val()?).map_err(anyhow::Error::msg)?),
            other => bail!("unknown option {other:?}\n{LAUNCH_USAGE}"),
        }
    }
    let n = n.with_context(|| format!("-n N is required\n{LAUNCH_USAGE}"))?;
    let mut spec = LaunchSpec::new(n, program, prog_args.iter());
    spec.grace = grace;
    spec.limit = limit;
    spec.config = gin_bootstrap::Config::from_env()?;
    let report = launch(&spec)?;
    if report.success() {
        return Ok(ExitCode::SUCCESS);
    }
    eprintln!("xtask launch: {}", report.describe_failures());
    // Mirror the first failed rank's exit code where there is one.
    let code = report
        .first_failure
        .and_then(|r| report.ranks[r].status)
        .and_then(|s| s.code())
        .and_then(|c| u8::try_from(c).ok())
        .filter(|&c| c != 0)
        .unwrap_or(1);
    Ok(ExitCode::from(code))
}
