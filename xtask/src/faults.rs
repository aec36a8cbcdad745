//! `cargo xtask faults`: the reliability campaign. Runs gin-bench jobs on
//! every backend and transport, kills (SIGKILL) or freezes (SIGSTOP) one
//! rank in the middle, and checks that every other rank ends by itself,
//! with an error naming the faulty rank, within twice the job's timeout.
//! Prints a Markdown table with the times (docs/reliability.md quotes it).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use gin_bootstrap::{Fault, FaultKind, LaunchSpec, Output, launch, parse_duration};

/// The rank that is killed or stopped (ranks stay below 10, so "rank 1"
/// never prefixes another rank's number).
const VICTIM: usize = 1;

/// (name, ranks, gin-bench arguments): long enough that the fault lands in
/// the middle of the run.
fn workloads(quick: bool) -> Vec<(&'static str, usize, Vec<&'static str>)> {
    let alltoall = vec![
        "alltoall",
        "--sizes",
        "4k",
        "--iters",
        "100000000",
        "--runs",
        "1",
    ];
    let pingpong = vec![
        "pingpong",
        "--sizes",
        "64k",
        "--iters",
        "100000000",
        "--runs",
        "1",
    ];
    let bandwidth = vec![
        "bandwidth",
        "--sizes",
        "1m",
        "--window",
        "64",
        "--iters",
        "10000000",
        "--runs",
        "1",
    ];
    if quick {
        return vec![("alltoall", 4, alltoall), ("pingpong", 2, pingpong)];
    }
    vec![
        ("alltoall", 2, alltoall.clone()),
        ("alltoall", 4, alltoall.clone()),
        ("alltoall", 8, alltoall),
        ("pingpong", 2, pingpong),
        ("bandwidth", 2, bandwidth),
    ]
}

const BACKENDS: [&str; 3] = ["auto", "proxy", "gdaki"];
const TRANSPORTS: [&str; 2] = ["shm", "tcp"];

/// One scenario's outcome.
struct Outcome {
    /// Seconds from the fault to the last survivor's exit (None: it hung
    /// and the launcher had to stop it, or the fault was never injected).
    slowest: Option<f64>,
    named: bool,
    ok: bool,
    note: String,
}

pub fn run(args: &[String]) -> Result<()> {
    let mut timeout = Duration::from_secs(5);
    let mut quick = false;
    let mut out: Option<PathBuf> = None;
    let mut only: Option<String> = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--timeout" => timeout = parse_duration(val()?).map_err(anyhow::Error::msg)?,
            "--quick" => quick = true,
            "--out" => out = Some(PathBuf::from(val()?)),
            "--only" => only = Some(val()?.clone()),
            other => bail!(
                "unknown option {other:?}\nusage: cargo xtask faults [--quick] [--timeout 5s] [--only TEXT] [--out FILE.md]"
            ),
        }
    }
    let st = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["build", "--release", "--quiet", "-p", "gin-bench"])
        .status()
        .context("building gin-bench")?;
    if !st.success() {
        bail!("building gin-bench failed");
    }
    let bin = target_dir().join("release/gin-bench");
    let mut table = String::from(
        "| workload | ranks | backend | transport | fault | slowest survivor (s after the fault) | culprit named | verdict | message (first survivor) |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    let mut failures = 0;
    for (name, n, wargs) in workloads(quick) {
        for backend in BACKENDS {
            for transport in TRANSPORTS {
                for kind in [FaultKind::Kill, FaultKind::Stop] {
                    let fault = match kind {
                        FaultKind::Kill => "SIGKILL",
                        FaultKind::Stop => "SIGSTOP",
                    };
                    let label = format!("{name} {n} {backend} {transport} {fault}");
                    if only.as_ref().is_some_and(|o| !label.contains(o.as_str())) {
                        continue;
                    }
                    let o = scenario(&bin, n, &wargs, backend, transport, kind, timeout)?;
                    if !o.ok {
                        failures += 1;
                    }
                    let row = format!(
                        "| {name} | {n} | {backend} | {transport} | {fault} | {} | {} | {} | {} |\n",
                        o.slowest.map_or("hung".into(), |s| format!("{s:.2}")),
                        if o.named { "yes" } else { "no" },
                        if o.ok { "ok" } else { "FAIL" },
                        o.note.replace('|', "\\|"),
                    );
                    eprint!("{row}");
                    table.push_str(&row);
                }
            }
        }
    }
    println!("{table}");
    if let Some(path) = out {
        let mut doc = String::new();
        let _ = writeln!(
            doc,
            "GIN_TIMEOUT={}s, rank {VICTIM} faulted 2 s after the launch, verdict ok when every survivor exits by itself with an error naming rank {VICTIM} within {}s.\n",
            timeout.as_secs_f64(),
            2.0 * timeout.as_secs_f64()
        );
        doc.push_str(&table);
        std::fs::write(&path, doc).with_context(|| format!("writing {}", path.display()))?;
    }
    if failures > 0 {
        bail!("{failures} scenario(s) failed");
    }
    Ok(())
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| PathBuf::from("target"), PathBuf::from)
}

fn scenario(
    bin: &std::path::Path,
    n: usize,
    args: &[&str],
    backend: &str,
    transport: &str,
    kind: FaultKind,
    timeout: Duration,
) -> Result<Outcome> {
    let after = Duration::from_secs(2);
    let mut spec = LaunchSpec::new(n, bin.as_os_str(), args.iter().copied())
        .env("GIN_BACKEND", backend)
        .env("GIN_TRANSPORT", transport)
        .env("GIN_TIMEOUT", format!("{}s", timeout.as_secs_f64()));
    spec.output = Output::Capture;
    // Survivors get every chance to end on their own; past the limit they
    // are stopped and the scenario counts as a hang.
    spec.grace = 4 * timeout;
    spec.limit = Some(after + 4 * timeout);
    spec.fault = Some(Fault {
        rank: VICTIM,
        kind,
        after,
    });
    let report = launch(&spec)?;
    let Some(fault_at) = report.fault_at else {
        return Ok(Outcome {
            slowest: None,
            named: false,
            ok: false,
            note: "the job ended before the fault".into(),
        });
    };
    let mut slowest = Some(0.0f64);
    let mut named = true;
    let mut ok = true;
    let mut note = String::new();
    for r in report.ranks.iter().filter(|r| r.rank != VICTIM) {
        let text = format!("{}{}", r.stdout, r.stderr);
        let failed_alone = !r.stopped && r.status.is_some_and(|s| !s.success());
        if let (false, Some(t)) = (r.stopped, r.ended) {
            let s = t.saturating_sub(fault_at).as_secs_f64();
            slowest = slowest.map(|m| m.max(s));
            ok &= s <= 2.0 * timeout.as_secs_f64();
        } else {
            slowest = None;
            ok = false;
        }
        ok &= failed_alone;
        let names = names_victim(&text);
        if !names {
            let tail: Vec<&str> = text.lines().rev().take(6).collect();
            eprintln!(
                "rank {} does not name rank {VICTIM}; its last lines:\n  {}",
                r.rank,
                tail.into_iter().rev().collect::<Vec<_>>().join("\n  ")
            );
        }
        named &= names;
        if note.is_empty() {
            note = first_error(&text).unwrap_or_else(|| {
                if r.stopped {
                    "(stopped by the launcher)".into()
                } else {
                    "(no error printed)".into()
                }
            });
        }
    }
    Ok(Outcome {
        slowest,
        named,
        ok: ok && named,
        note,
    })
}

/// Whether the text names the victim as a rank or peer ("rank 1", "peer 1",
/// "ranks [1]"), not as a prefix of another number.
fn names_victim(text: &str) -> bool {
    let v = VICTIM.to_string();
    ["rank ", "peer ", "ranks [", "rank(s) "].iter().any(|p| {
        let pat = format!("{p}{v}");
        text.match_indices(&pat).any(|(i, _)| {
            !text[i + pat.len()..]
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_digit())
        })
    })
}

/// The first line that reads like an error, shortened for the table.
fn first_error(text: &str) -> Option<String> {
    let line = text.lines().find(|l| {
        l.starts_with("gin-bench:")
            || l.contains("Error")
            || l.contains("error")
            || l.contains("FAILED")
    })?;
    let line = line.trim();
    Some(if line.chars().count() > 160 {
        format!("{}…", line.chars().take(160).collect::<String>())
    } else {
        line.to_owned()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_victim_is_named_only_as_itself() {
        assert!(names_victim("Error: rank 0: rank 1 died"));
        assert!(names_victim("timed out waiting for peer 1,"));
        assert!(!names_victim("rank 10 died"));
        assert!(!names_victim("rank 0: timed out"));
    }
}
