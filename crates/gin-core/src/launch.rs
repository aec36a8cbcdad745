//! Run a program as every rank of a local job without a launcher: when no
//! launcher variables are set, the program starts `n` copies of itself
//! through gin-bootstrap's launcher; each copy (or a process started by a
//! real launcher) is one rank.

use std::time::Duration;

use gin_bootstrap::{LaunchEnv, LaunchSpec, Output, launch};

/// The outcome of [`run_ranks`] in the process that called it.
#[derive(Debug)]
pub enum Role {
    /// This process is a rank: run the job.
    Rank,
    /// This process launched the ranks; they all succeeded.
    Launched,
}

/// If a launcher started this process, returns [`Role::Rank`]. Otherwise
/// starts `n` ranks of this executable with the same arguments (output
/// prefixed by rank), waits, and returns [`Role::Launched`], or an error
/// describing which ranks failed.
pub fn run_ranks(n: usize) -> Result<Role, String> {
    if LaunchEnv::present(|k| std::env::var(k).ok()) {
        return Ok(Role::Rank);
    }
    let exe = std::env::current_exe().map_err(|e| format!("finding this executable: {e}"))?;
    let mut spec = LaunchSpec::new(n, exe, std::env::args_os().skip(1));
    spec.output = Output::Prefix;
    spec.grace = Duration::from_secs(5);
    let report = launch(&spec).map_err(|e| e.to_string())?;
    if report.success() {
        Ok(Role::Launched)
    } else {
        Err(report.describe_failures())
    }
}
