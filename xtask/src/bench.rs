//! `cargo xtask bench [smoke|quick|full] [--machine NAME] [--out DIR]`: runs a
//! suite of gin-bench subcommands with `--json`, then writes
//! `target/bench/<machine>/` (or `--out DIR`): the JSON, a README.md with a
//! table per benchmark, the exact command and the machine, and SVG plots.
//! The committed figures in `docs/bench/<machine>/` change only with an
//! explicit `--out`.
//!
//! gin-bench embeds its tables in its JSON, so this renders Markdown
//! without knowing each benchmark's fields; only the plots read results.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::plot;

/// One path the suites measure: a name for files and the flags that pick it.
struct PathSpec {
    name: &'static str,
    label: &'static str,
    flags: &'static [&'static str],
    /// Environment for gin-bench (and the ranks it spawns).
    env: &'static [(&'static str, &'static str)],
}

const PATHS: &[PathSpec] = &[
    PathSpec {
        name: "direct",
        label: "direct load/store (auto, same host)",
        flags: &[],
        env: &[],
    },
    PathSpec {
        name: "proxy-shm",
        label: "proxy over shared memory",
        flags: &["--backend", "proxy", "--transport", "shm"],
        env: &[],
    },
    PathSpec {
        name: "gdaki-shm",
        label: "GDAKI (soft-mlx5) over shared memory",
        flags: &["--backend", "gdaki", "--transport", "shm"],
        env: &[],
    },
    PathSpec {
        name: "tcp",
        label: "tcp (auto backend)",
        flags: &["--transport", "tcp"],
        env: &[],
    },
    PathSpec {
        name: UCX_PATH,
        label: "ucx over UCX's tcp (auto backend; floor: ucx_perftest)",
        flags: &["--transport", "ucx"],
        env: &[("UCX_TLS", "tcp,self")],
    },
];

/// The path that needs UCX: in a suite only when `GIN_UCX_LIB` names a
/// file (`cargo xtask wheels` installs one), else left out with a note.
const UCX_PATH: &str = "ucx-tcp";

/// One gin-bench invocation of a suite.
#[derive(Debug, Clone)]
pub struct Job {
    /// File stem: `<bench>-<path>`.
    pub name: String,
    pub bench: String,
    pub path_label: String,
    pub args: Vec<String>,
    /// Environment for this run.
    pub env: Vec<(String, String)>,
}

/// The jobs of `suite`; `ucx`: whether the UCX path is measured.
fn jobs(suite: &str, ucx: bool) -> Result<Vec<Job>> {
    // (bench, arguments, which paths)
    let plan: Vec<(&str, &str, &[&str])> = match suite {
        // Seconds: what CI runs to prove the whole pipeline works.
        "smoke" => vec![
            (
                "pingpong",
                "--sizes 8,64k,256k --iters 100 --runs 2",
                &["direct", "tcp"],
            ),
            (
                "bandwidth",
                "--sizes 4k,64k --window 8 --dir uni --iters 50 --runs 2",
                &["direct"],
            ),
            ("rate", "--window 16 --iters 2000 --runs 2", &["direct"]),
            (
                "loggp",
                "--ranks 2,4 --sizes 8,4k --fit-sizes 8,64k,256k --iters 100 --runs 3 --resamples 50 --rate-messages 2000",
                &["direct"],
            ),
        ],
        "quick" => vec![
            (
                "pingpong",
                "--sizes 8,512,4k,64k,256k,1m --iters 300 --runs 3",
                &["direct", "proxy-shm", "gdaki-shm", "tcp", UCX_PATH],
            ),
            (
                "bandwidth",
                "--sizes 4k,64k,1m --window 16 --iters 200 --runs 3",
                &["direct", "proxy-shm", "gdaki-shm", "tcp", UCX_PATH],
            ),
            (
                "rate",
                "--window 1,64 --iters 10000 --runs 3",
                &["direct", "proxy-shm", "gdaki-shm", "tcp", UCX_PATH],
            ),
            (
                "alltoall",
                "--ranks 2,4,8 --sizes 8,4k,64k --iters 300 --runs 3",
                &["direct"],
            ),
            (
                "loggp",
                "--ranks 2,4,8 --sizes 8,4k,64k --iters 300 --runs 3 --resamples 200",
                &["direct", "proxy-shm"],
            ),
        ],
        "full" => vec![
            (
                "pingpong",
                "--sizes 8,64,512,4k,32k,64k,256k,1m,4m --iters 1000 --runs 7",
                &["direct", "proxy-shm", "gdaki-shm", "tcp", UCX_PATH],
            ),
            (
                "bandwidth",
                "--sizes 64,4k,64k,1m,4m --window 1,16,64 --runs 5",
                &["direct", "proxy-shm", "gdaki-shm", "tcp", UCX_PATH],
            ),
            (
                "rate",
                "--window 1,16,128 --runs 5",
                &["direct", "proxy-shm", "gdaki-shm", "tcp", UCX_PATH],
            ),
            (
                "alltoall",
                "--ranks 2,4,8,16 --sizes 8,4k,64k --runs 7",
                &["direct", "proxy-shm"],
            ),
            (
                "loggp",
                "--ranks 2,3,4,6,8,12,16 --sizes 8,4k,64k --runs 7",
                &["direct", "proxy-shm", "gdaki-shm", "tcp"],
            ),
        ],
        other => bail!("unknown suite {other:?}: smoke, quick or full"),
    };
    let mut out = Vec::new();
    for (bench, args, paths) in plan {
        for p in PATHS
            .iter()
            .filter(|p| paths.contains(&p.name) && (ucx || p.name != UCX_PATH))
        {
            let mut a = vec![bench.to_owned()];
            a.extend(args.split_whitespace().map(str::to_owned));
            a.extend(p.flags.iter().map(|s| (*s).to_owned()));
            out.push(Job {
                name: format!("{bench}-{}", p.name),
                bench: bench.to_owned(),
                path_label: p.label.to_owned(),
                args: a,
                env: p
                    .env
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            });
        }
    }
    Ok(out)
}

/// A short machine name: the CPU model and core count, e.g. `amd-epyc-2c`.
pub fn machine_name(cpu: &str, cores: usize) -> String {
    let noise = ["processor", "cpu", "with", "radeon", "graphics"];
    let cpu = cpu
        .to_ascii_lowercase()
        .replace("(r)", "")
        .replace("(tm)", "");
    let mut words = Vec::new();
    for w in cpu.split_whitespace() {
        if w.starts_with('@') || w.ends_with("ghz") || noise.contains(&w) {
            continue;
        }
        let w: String = w.chars().filter(char::is_ascii_alphanumeric).collect();
        if !w.is_empty() {
            words.push(w);
        }
    }
    let mut name = words.join("-");
    name.truncate(24);
    let name = name.trim_end_matches('-');
    if name.is_empty() {
        format!("machine-{cores}c")
    } else {
        format!("{name}-{cores}c")
    }
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map_or_else(
            || std::env::consts::ARCH.to_owned(),
            |(_, v)| v.trim().to_owned(),
        )
}

fn workspace_root() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.parent().map_or(here.clone(), Path::to_path_buf)
}

/// Cargo's target folder: `CARGO_TARGET_DIR` (relative to where cargo was
/// started, as cargo reads it) or the workspace's `target/`.
fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from)
}

/// Where a suite writes: `--out` when given, else `<target>/bench/<machine>/`.
///
/// Never `docs/` by default: the machine name of a small cloud VM (e.g.
/// `amd-epyc-2c`) can be the name of the committed reference figures, and a
/// suite run by someone following the README must not overwrite them.
/// Refreshing the committed figures takes an explicit `--out docs/bench/NAME`.
fn out_dir(out: Option<PathBuf>, target: &Path, machine: &str) -> PathBuf {
    out.unwrap_or_else(|| target.join("bench").join(machine))
}

/// `to` as seen from the folder `from` (both absolute), for links in the
/// page a suite writes wherever it lands.
fn relative_link(from: &Path, to: &Path) -> String {
    let f: Vec<_> = from.components().collect();
    let t: Vec<_> = to.components().collect();
    let common = f.iter().zip(&t).take_while(|(a, b)| a == b).count();
    let mut p = PathBuf::new();
    for _ in common..f.len() {
        p.push("..");
    }
    for c in &t[common..] {
        p.push(c);
    }
    p.to_string_lossy().into_owned()
}

pub const USAGE: &str =
    "usage: cargo xtask bench [smoke|quick|full] [--machine NAME] [--out DIR] [--render-only]";

pub fn run(args: &[String]) -> Result<()> {
    let mut suite = "quick".to_owned();
    let mut machine = None;
    let mut out = None;
    let mut render_only = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--machine" => machine = Some(it.next().context("--machine needs a name")?.clone()),
            "--out" => out = Some(PathBuf::from(it.next().context("--out needs a folder")?)),
            // Re-render the page and plots from the JSON already there.
            "--render-only" => render_only = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            s if !s.starts_with('-') => s.clone_into(&mut suite),
            other => bail!("unknown option {other:?}\n{USAGE}"),
        }
    }
    let ucx = std::env::var_os("GIN_UCX_LIB").is_some_and(|p| Path::new(&p).is_file());
    if !ucx {
        eprintln!(
            "xtask bench: GIN_UCX_LIB does not name a libucp.so.0: the ucx rows are left out (`cargo xtask wheels` prints it)"
        );
    }
    let jobs = jobs(&suite, ucx)?;
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let machine = machine.unwrap_or_else(|| machine_name(&cpu_model(), cores));
    if machine.is_empty() || machine.contains(['/', '\\']) || machine.starts_with('.') {
        bail!("--machine {machine:?}: a plain folder name, please");
    }
    let root = workspace_root();
    let out = out_dir(out, &target_dir(&root), &machine);
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    // gin-bench runs from the workspace root: hand it absolute paths.
    let out = out
        .canonicalize()
        .with_context(|| format!("resolving {}", out.display()))?;

    let reports = if render_only {
        let mut reports = Vec::new();
        for job in &jobs {
            let json = out.join(format!("{}.json", job.name));
            reports.push((job.clone(), read_json(&json)?));
        }
        reports
    } else {
        run_jobs(&root, &out, &jobs)?
    };
    let plots = plot::all(&out, &reports)?;
    let docs = root.canonicalize().unwrap_or(root).join("docs");
    let links = (
        relative_link(&out, &docs.join("bench/suite.md")),
        relative_link(&out, &docs.join("loggp.md")),
    );
    let md = render_markdown(&suite, &machine, &reports, &plots, &links);
    let readme = out.join("README.md");
    std::fs::write(&readme, md).with_context(|| format!("writing {}", readme.display()))?;
    eprintln!("xtask bench: wrote {}", out.display());
    Ok(())
}

fn read_json(path: &Path) -> Result<Value> {
    serde_json::from_str(
        &std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?,
    )
    .with_context(|| format!("parsing {}", path.display()))
}

/// Builds gin-bench, then runs every job; stops at the first failure.
fn run_jobs(root: &Path, out: &Path, jobs: &[Job]) -> Result<Vec<(Job, Value)>> {
    eprintln!("xtask bench: building gin-bench (release)...");
    let st = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["build", "--release", "-p", "gin-bench"])
        .current_dir(root)
        .status()
        .context("running cargo build")?;
    if !st.success() {
        bail!("building gin-bench failed");
    }
    let exe = target_dir(root).join("release/gin-bench");
    if !exe.exists() {
        bail!("{} is missing after the build", exe.display());
    }

    let mut reports = Vec::new();
    for (i, job) in jobs.iter().enumerate() {
        let json = out.join(format!("{}.json", job.name));
        eprintln!(
            "xtask bench [{}/{}]: gin-bench {}",
            i + 1,
            jobs.len(),
            job.args.join(" ")
        );
        let st = Command::new(&exe)
            .args(&job.args)
            .envs(job.env.iter().map(|(k, v)| (k, v)))
            .arg("--json")
            .arg(&json)
            .current_dir(root)
            .status()
            .with_context(|| format!("running gin-bench {}", job.args.join(" ")))?;
        if !st.success() {
            bail!(
                "gin-bench {} failed ({st}); nothing was written for the suite",
                job.args.join(" ")
            );
        }
        reports.push((job.clone(), read_json(&json)?));
    }
    Ok(reports)
}

/// Renders a Markdown table from gin-bench's embedded table.
fn table_md(t: &Value) -> String {
    let cells = |v: &Value| -> Vec<String> {
        v.as_array()
            .map(|a| {
                a.iter()
                    .map(|c| c.as_str().unwrap_or("").replace('|', "\\|"))
                    .collect()
            })
            .unwrap_or_default()
    };
    let cols = cells(&t["columns"]);
    let mut s = String::new();
    let _ = writeln!(s, "| {} |", cols.join(" | "));
    let _ = writeln!(s, "|{}", " --- |".repeat(cols.len()));
    for r in t["rows"].as_array().into_iter().flatten() {
        let _ = writeln!(s, "| {} |", cells(r).join(" | "));
    }
    for n in t["notes"].as_array().into_iter().flatten() {
        let _ = writeln!(s, "\n{}", n.as_str().unwrap_or(""));
    }
    s
}

fn render_markdown(
    suite: &str,
    machine: &str,
    reports: &[(Job, Value)],
    plots: &[(String, String)],
    (suite_md, loggp_md): &(String, String),
) -> String {
    let mut s = String::new();
    let host = reports.first().map(|r| &r.1["host"]);
    let date = reports
        .first()
        .and_then(|r| r.1["date"].as_str())
        .unwrap_or("?");
    let _ = writeln!(s, "# Benchmarks: {machine}\n");
    let _ = writeln!(
        s,
        "Suite `{suite}`, produced by `cargo xtask bench {suite}` on {date}; every figure below comes from that run (the JSON files beside this page hold every sample)."
    );
    if let Some(h) = host {
        let _ = writeln!(
            s,
            "Machine: {} ({} CPUs available, {} GiB), Linux {}, hostname `{}`.",
            h["cpu"].as_str().unwrap_or("?"),
            h["cores"],
            h["memory_gib"],
            h["kernel"].as_str().unwrap_or("?"),
            h["hostname"].as_str().unwrap_or("?")
        );
        if h["cores"].as_u64().is_some_and(|c| c <= 2) {
            let _ = writeln!(
                s,
                "This machine has only {} CPUs: ranks, proxies and the soft NIC share them, so figures vary from run to run, and with more threads than CPUs they measure the scheduler as much as the transport.",
                h["cores"]
            );
        }
    }
    let _ = writeln!(
        s,
        "Each row gives the median over runs with p10/p90/p99 and a floor measured in the same job (see [docs/bench/suite.md]({suite_md}) and [docs/loggp.md]({loggp_md}))."
    );
    if !plots.is_empty() {
        let _ = writeln!(s, "\n## Plots\n");
        for (file, caption) in plots {
            let _ = writeln!(s, "![{caption}]({file})\n");
        }
    }
    let mut last_bench = String::new();
    for (job, v) in reports {
        if job.bench != last_bench {
            let _ = writeln!(s, "## {}\n", job.bench);
            last_bench.clone_from(&job.bench);
        }
        let _ = writeln!(s, "### {}\n", job.path_label);
        let _ = writeln!(
            s,
            "`cargo run --release -p gin-bench -- {}` ([JSON]({}.json))\n",
            job.args.join(" "),
            job.name
        );
        for t in v["tables"].as_array().into_iter().flatten() {
            let _ = writeln!(s, "{}\n", t["title"].as_str().unwrap_or(""));
            s.push_str(&table_md(t));
            s.push('\n');
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn machine_names_are_short_and_plain() {
        assert_eq!(machine_name("AMD EPYC", 2), "amd-epyc-2c");
        assert_eq!(
            machine_name("Intel(R) Xeon(R) Platinum 8480+ CPU @ 2.00GHz", 224),
            "intel-xeon-platinum-8480-224c"
        );
        assert_eq!(machine_name("", 4), "machine-4c");
        assert!(machine_name("AMD Ryzen 9 7950X 16-Core Processor", 32).len() <= 28);
    }

    #[test]
    fn reports_go_to_the_target_folder_unless_out_is_given() {
        let root = Path::new("/ws");
        let target = Path::new("/ws/target");
        // The development machine's own name must not reach the committed
        // reference figures by default.
        let d = out_dir(None, target, "amd-epyc-2c");
        assert_eq!(d, Path::new("/ws/target/bench/amd-epyc-2c"));
        assert!(!d.starts_with(root.join("docs")), "{}", d.display());
        // A relocated target folder (CARGO_TARGET_DIR) is followed.
        assert_eq!(
            out_dir(None, Path::new("/tmp/t"), "m-4c"),
            Path::new("/tmp/t/bench/m-4c")
        );
        // Writing into docs/ takes an explicit --out.
        assert_eq!(
            out_dir(Some("docs/bench/amd-epyc-2c".into()), target, "x"),
            Path::new("docs/bench/amd-epyc-2c")
        );
    }

    #[test]
    fn links_from_the_report_reach_the_docs_wherever_it_lands() {
        let docs = Path::new("/ws/docs");
        assert_eq!(
            relative_link(Path::new("/ws/docs/bench/m-2c"), &docs.join("loggp.md")),
            "../../loggp.md"
        );
        assert_eq!(
            relative_link(
                Path::new("/ws/target/bench/m-2c"),
                &docs.join("bench/suite.md")
            ),
            "../../../docs/bench/suite.md"
        );
    }

    #[test]
    fn suites_expand_to_jobs_per_path() {
        let q = jobs("quick", false).unwrap();
        assert!(q.iter().any(|j| j.name == "pingpong-direct"));
        assert!(q.iter().any(|j| j.name == "loggp-proxy-shm"));
        assert!(!q.iter().any(|j| j.name.ends_with(UCX_PATH)));
        let f = jobs("full", false).unwrap();
        assert!(f.iter().any(|j| j.name == "loggp-tcp"));
        assert!(f.iter().all(|j| j.args[0] == j.bench));
        assert!(jobs("nope", false).is_err());
        let u = jobs("full", true).unwrap();
        let p = u.iter().find(|j| j.name == "pingpong-ucx-tcp").unwrap();
        assert!(p.args.windows(2).any(|w| w == ["--transport", "ucx"]));
        assert_eq!(p.env, [("UCX_TLS".to_owned(), "tcp,self".to_owned())]);
        assert!(u.iter().any(|j| j.name == "bandwidth-ucx-tcp"));
        assert!(u.iter().any(|j| j.name == "rate-ucx-tcp"));
    }

    #[test]
    fn tables_render_as_markdown() {
        let t = serde_json::json!({
            "columns": ["size", "µs"],
            "rows": [["8 B", "0.1"], ["a|b", "2"]],
            "notes": ["median over runs"]
        });
        assert_eq!(
            table_md(&t),
            "| size | µs |\n| --- | --- |\n| 8 B | 0.1 |\n| a\\|b | 2 |\n\nmedian over runs\n"
        );
    }
}
