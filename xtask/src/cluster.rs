//! `cargo xtask cluster`: one program (a gin-bench subcommand, a selftest,
//! an example) as a multi-host job through the launcher the cluster has —
//! Open MPI's `mpirun`, Slurm's `srun`, or one `ssh` per rank — with the
//! `GIN_*` rendezvous passed to every rank, every rank's output and JSON
//! collected into one report folder, and a failed or hung rank ending the
//! job with an error naming its rank and host (docs/cluster.md).
//!
//! Every rank runs under a small `sh` wrapper that says where it runs
//! (`GIN_CLUSTER_START host pid`), how it ended (`GIN_CLUSTER_EXIT code`)
//! and, for gin-bench, sends its JSON record back through its output, so
//! the report folder needs no filesystem shared between hosts. The
//! launcher's own line tags (`--tag-output`, `--label`; for ssh, one pipe
//! per rank) say which rank each line is from. Under ssh the wrapper also
//! puts the rank in a session of its own and watches its standard input:
//! when xtask closes it (a failure elsewhere, the timeout) or the ssh
//! connection drops, the rank's process group is killed on its host.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use gin_bootstrap::parse_duration;

pub const USAGE: &str = "usage: cargo xtask cluster [--launcher auto|mpirun|srun|ssh] \
[--hosts A,B | --hostfile FILE] [--per-host K] [--out DIR] [--timeout DURATION] [--grace DURATION] \
[--root-addr HOST:PORT] [--launcher-arg ARG]... [--dry-run] -- PROGRAM [ARGS...]";

/// Which program starts the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Launcher {
    Mpirun,
    Srun,
    Ssh,
}

impl Launcher {
    fn name(self) -> &'static str {
        match self {
            Self::Mpirun => "mpirun",
            Self::Srun => "srun",
            Self::Ssh => "ssh",
        }
    }
}

/// The command line, parsed.
#[derive(Debug)]
struct Opts {
    /// `None`: auto.
    launcher: Option<Launcher>,
    hosts: Option<Vec<String>>,
    hostfile: Option<PathBuf>,
    per_host: usize,
    out: Option<PathBuf>,
    timeout: Option<Duration>,
    grace: Duration,
    root_addr: Option<String>,
    launcher_args: Vec<String>,
    dry_run: bool,
    program: String,
    args: Vec<String>,
}

fn parse(args: &[String]) -> Result<Opts> {
    let split = args
        .iter()
        .position(|a| a == "--")
        .with_context(|| format!("missing `--` before the program\n{USAGE}"))?;
    let Some((program, rest)) = args[split + 1..].split_first() else {
        bail!("no program after `--`\n{USAGE}");
    };
    let mut o = Opts {
        launcher: None,
        hosts: None,
        hostfile: None,
        per_host: 1,
        out: None,
        timeout: None,
        grace: Duration::from_secs(5),
        root_addr: None,
        launcher_args: Vec::new(),
        dry_run: false,
        program: program.clone(),
        args: rest.to_vec(),
    };
    let mut it = args[..split].iter();
    while let Some(a) = it.next() {
        let mut val = || {
            it.next()
                .with_context(|| format!("{a} needs a value\n{USAGE}"))
        };
        match a.as_str() {
            "--launcher" => {
                o.launcher = match val()?.as_str() {
                    "auto" => None,
                    "mpirun" => Some(Launcher::Mpirun),
                    "srun" => Some(Launcher::Srun),
                    "ssh" => Some(Launcher::Ssh),
                    other => bail!("--launcher {other:?}: use auto, mpirun, srun or ssh"),
                }
            }
            "--hosts" => o.hosts = Some(host_list(val()?)),
            "--hostfile" => o.hostfile = Some(val()?.into()),
            "-N" | "--per-host" => {
                let v = val()?;
                o.per_host = v
                    .parse()
                    .ok()
                    .filter(|&k| k > 0)
                    .with_context(|| format!("--per-host {v:?} is not a positive count"))?;
            }
            "--out" => o.out = Some(val()?.into()),
            "--timeout" => o.timeout = Some(parse_duration(val()?).map_err(anyhow::Error::msg)?),
            "--grace" => o.grace = parse_duration(val()?).map_err(anyhow::Error::msg)?,
            "--root-addr" => o.root_addr = Some(val()?.clone()),
            "--launcher-arg" => o.launcher_args.push(val()?.clone()),
            "--dry-run" => o.dry_run = true,
            other => bail!("unknown option {other:?}\n{USAGE}"),
        }
    }
    if o.hosts.is_some() && o.hostfile.is_some() {
        bail!("give --hosts or --hostfile, not both");
    }
    if o.hosts.as_ref().is_some_and(Vec::is_empty) {
        bail!("--hosts names no host");
    }
    Ok(o)
}

fn host_list(text: &str) -> Vec<String> {
    text.split(',')
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Hosts of an Open MPI-style hostfile: the first word of each line
/// (`slots=` and the like are ignored: `--per-host` says how many ranks).
fn read_hostfile(path: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the hostfile {}", path.display()))?;
    let hosts: Vec<String> = text
        .lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect();
    if hosts.is_empty() {
        bail!("the hostfile {} names no host", path.display());
    }
    Ok(hosts)
}

/// Expands a Slurm node list (`node[01-03,7],gpu5`) into host names.
pub fn expand_nodelist(list: &str) -> Result<Vec<String>> {
    let mut out = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    let bytes = list.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        match b {
            b'[' => depth += 1,
            b']' => depth = depth.saturating_sub(1),
            b',' if depth == 0 => {
                expand_one(&list[start..i], &mut out)?;
                start = i + 1;
            }
            _ => {}
        }
    }
    expand_one(&list[start..], &mut out)?;
    Ok(out)
}

fn expand_one(item: &str, out: &mut Vec<String>) -> Result<()> {
    let item = item.trim();
    if item.is_empty() {
        return Ok(());
    }
    let Some(open) = item.find('[') else {
        out.push(item.to_owned());
        return Ok(());
    };
    let close = item[open..]
        .find(']')
        .map(|c| open + c)
        .with_context(|| format!("node list {item:?}: unclosed `[`"))?;
    let (prefix, ranges, suffix) = (&item[..open], &item[open + 1..close], &item[close + 1..]);
    for range in ranges.split(',') {
        let (lo, hi) = range.split_once('-').unwrap_or((range, range));
        let width = lo.len();
        let bad = || format!("node list {item:?}: {range:?} is not a number or range");
        let (a, b): (u64, u64) = (lo.parse().with_context(bad)?, hi.parse().with_context(bad)?);
        if b < a || b - a > 65_536 {
            bail!("node list {item:?}: range {range:?} runs backwards or is too long");
        }
        for n in a..=b {
            // The suffix may hold further brackets (`r[1-2]n[1-2]`).
            expand_one(&format!("{prefix}{n:0width$}{suffix}"), out)?;
        }
    }
    Ok(())
}

/// `NAME` on `PATH`, as a full path.
fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(name))
            .find(|f| f.is_file())
    })
}

fn in_slurm_allocation() -> bool {
    std::env::var_os("SLURM_JOB_ID").is_some() || std::env::var_os("SLURM_JOBID").is_some()
}

/// The `mpirun` to use: `GIN_MPIRUN` (what `cargo xtask wheels` prints), else `PATH`'s.
fn find_mpirun() -> Option<PathBuf> {
    std::env::var_os("GIN_MPIRUN")
        .map(PathBuf::from)
        .filter(|p| p.is_file())
        .or_else(|| which("mpirun"))
}

fn choose_launcher(asked: Option<Launcher>) -> Launcher {
    asked.unwrap_or(if in_slurm_allocation() {
        Launcher::Srun
    } else if find_mpirun().is_some() {
        Launcher::Mpirun
    } else {
        Launcher::Ssh
    })
}

fn hosts_for(o: &Opts, launcher: Launcher) -> Result<Vec<String>> {
    if let Some(h) = &o.hosts {
        return Ok(h.clone());
    }
    if let Some(f) = &o.hostfile {
        return read_hostfile(f);
    }
    if let Some(list) = std::env::var("SLURM_JOB_NODELIST")
        .or_else(|_| std::env::var("SLURM_NODELIST"))
        .ok()
        .filter(|_| in_slurm_allocation())
    {
        return expand_nodelist(&list);
    }
    match launcher {
        Launcher::Mpirun => Ok(vec!["localhost".to_owned()]),
        Launcher::Srun => {
            bail!("srun: no hosts: run inside a Slurm allocation (salloc, sbatch) or give --hosts")
        }
        Launcher::Ssh => bail!("ssh: give the hosts with --hosts A,B or --hostfile FILE"),
    }
}

fn own_hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap_or_default()
        .trim()
        .to_owned()
}

fn is_local(host: &str) -> bool {
    host == "localhost" || host.starts_with("127.") || host == "::1" || host == own_hostname()
}

/// The rendezvous every rank gets: the user's own `GIN_UNIQUE_ID` /
/// `GIN_ROOT_ADDR` as they are, else `--root-addr`, else the first host
/// (where rank 0 runs) with a port: a free one found here when that host is
/// this one, else one picked from 20000..60000 (`--root-addr` to choose).
fn root_addr(o: &Opts, hosts: &[String]) -> Result<Option<String>> {
    if std::env::var_os("GIN_UNIQUE_ID").is_some() || std::env::var_os("GIN_ROOT_ADDR").is_some() {
        return Ok(None);
    }
    if let Some(a) = &o.root_addr {
        return Ok(Some(a.clone()));
    }
    let first = &hosts[0];
    if is_local(first) {
        let l = std::net::TcpListener::bind(("0.0.0.0", 0)).context("finding a free port")?;
        let port = l.local_addr()?.port();
        let host = if hosts.iter().all(|h| is_local(h)) {
            "127.0.0.1".to_owned()
        } else {
            own_hostname()
        };
        return Ok(Some(join_host_port(&host, port)));
    }
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let port = 20_000 + (t ^ std::process::id()) % 40_000;
    Ok(Some(join_host_port(first, u16::try_from(port)?)))
}

fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// 128 random bits, hex: the job's secret (`GIN_JOB_SECRET`), from which
/// every rank derives the rendezvous key (docs/bootstrap.md).
fn job_secret() -> Result<String> {
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .context("reading /dev/urandom")?;
    Ok(b.iter().fold(String::new(), |mut s, x| {
        let _ = write!(s, "{x:02x}");
        s
    }))
}

/// Rank identity variables this command sets (ssh) or leaves to the
/// launcher (mpirun, srun: a stale `GIN_RANK` would take precedence over
/// theirs), and the front end's own: never forwarded.
const NOT_FORWARDED: &[&str] = &[
    "GIN_RANK",
    "GIN_NRANKS",
    "GIN_LOCAL_RANK",
    "GIN_LOCAL_NRANKS",
    "GIN_BENCH_ARGS",
    "GIN_JOB_SECRET",
    "GIN_CLUSTER_OUT",
];

/// The user's `GIN_*` and `UCX_*` variables, sorted.
fn forwarded_env() -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| {
            (k.starts_with("GIN_") || k.starts_with("UCX_")) && !NOT_FORWARDED.contains(&k.as_str())
        })
        .collect();
    v.sort();
    v
}

/// `PROGRAM` as the ranks run it: a bare name found under this workspace's
/// `target/release` or `target/debug` becomes that path; relative paths
/// become absolute (every host runs it from the same path).
fn resolve_program(program: &str) -> String {
    let p = Path::new(program);
    if !program.contains('/') {
        let ws = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        for profile in ["release", "debug"] {
            let f = ws.join("target").join(profile).join(program);
            if f.is_file() {
                return f.canonicalize().unwrap_or(f).display().to_string();
            }
        }
        return program.to_owned();
    }
    std::path::absolute(p).map_or_else(|_| program.to_owned(), |a| a.display().to_string())
}

/// gin-bench given a subcommand and no `--json`: each rank writes its
/// record (`{rank}` resolved by gin-bench) where the wrapper finds it.
fn with_json(program: &str, args: &[String], out: &Path) -> Vec<String> {
    let mut a = args.to_vec();
    let is_bench = Path::new(program)
        .file_name()
        .is_some_and(|n| n == "gin-bench");
    let has_sub = args.first().is_some_and(|s| !s.starts_with('-'));
    let has_json = args
        .iter()
        .any(|s| s == "--json" || s.starts_with("--json="));
    if is_bench && has_sub && !has_json {
        a.push("--json".into());
        a.push(out.join("rank-{rank}.json").display().to_string());
    }
    a
}

/// The wrapper every rank runs under mpirun and srun. `$1...` is the
/// rank's program; the rank's number comes from the launcher's variables.
const WRAP: &str = r#"r=${OMPI_COMM_WORLD_RANK:-${SLURM_PROCID:-${GIN_RANK:-0}}}
f="$GIN_CLUSTER_OUT/rank-$r.json"
[ -z "$GIN_CLUSTER_OUT" ] || { mkdir -p "$GIN_CLUSTER_OUT"; rm -f "$f"; }
echo "GIN_CLUSTER_START $(uname -n) $$"
"$@"; rc=$?
"#;

/// Under ssh: the secret comes on standard input, the rank runs in its own
/// session, and standard input closing (xtask's stop, a dropped
/// connection) kills that session's process group.
const WRAP_SSH: &str = r#"IFS= read -r GIN_JOB_SECRET; export GIN_JOB_SECRET
r=$GIN_RANK
f="$GIN_CLUSTER_OUT/rank-$r.json"
[ -z "$GIN_CLUSTER_OUT" ] || { mkdir -p "$GIN_CLUSTER_OUT"; rm -f "$f"; }
exec 3<&0
setsid "$@" </dev/null 3<&- &
p=$!
echo "GIN_CLUSTER_START $(uname -n) $p"
(cat <&3 >/dev/null; kill -TERM -$p; sleep 2; kill -KILL -$p) >/dev/null 2>&1 &
w=$!
exec 3<&-
wait $p; rc=$?
kill $w 2>/dev/null
"#;

/// Common tail: the rank's JSON record back through its output, then its
/// exit status.
const WRAP_END: &str = r#"if [ -n "$GIN_CLUSTER_OUT" ] && [ -f "$f" ]; then
  echo GIN_CLUSTER_JSON_BEGIN; cat "$f"; echo; echo GIN_CLUSTER_JSON_END
fi
echo "GIN_CLUSTER_EXIT $rc"
exit $rc"#;

/// What will run: the launcher's argv and environment, one per process
/// (one for mpirun and srun, one per rank for ssh).
#[derive(Debug)]
struct Proc {
    argv: Vec<String>,
    /// Variables set in the launcher's environment.
    env: Vec<(String, String)>,
    /// For ssh: the rank it starts (and its host).
    rank: Option<(usize, String)>,
}

#[derive(Debug)]
struct Plan {
    launcher: Launcher,
    hosts: Vec<String>,
    per_host: usize,
    nranks: usize,
    out: PathBuf,
    root: Option<String>,
    secret: String,
    program: Vec<String>,
    procs: Vec<Proc>,
}

fn plan(o: &Opts) -> Result<Plan> {
    let launcher = choose_launcher(o.launcher);
    let hosts = hosts_for(o, launcher)?;
    let nranks = hosts.len() * o.per_host;
    let out = o.out.clone().unwrap_or_else(|| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Path::new("target/cluster").join(format!("run-{t}"))
    });
    let out = std::path::absolute(&out)?;
    let root = root_addr(o, &hosts)?;
    let secret = std::env::var("GIN_JOB_SECRET").or_else(|_| job_secret())?;
    let program_path = resolve_program(&o.program);
    let mut program = vec![program_path.clone()];
    program.extend(with_json(&program_path, &o.args, &out));
    let mut env = forwarded_env();
    if let Some(r) = &root {
        env.push(("GIN_ROOT_ADDR".into(), r.clone()));
    }
    env.push(("GIN_CLUSTER_OUT".into(), out.display().to_string()));
    let cwd = std::env::current_dir()?.display().to_string();
    let procs = match launcher {
        Launcher::Mpirun => vec![mpirun_proc(
            o, &hosts, nranks, &cwd, env, &secret, &program,
        )?],
        Launcher::Srun => vec![srun_proc(o, &hosts, nranks, &cwd, env, &secret, &program)],
        Launcher::Ssh => ssh_procs(o, &hosts, nranks, &cwd, &env, &program),
    };
    Ok(Plan {
        launcher,
        hosts,
        per_host: o.per_host,
        nranks,
        out,
        root,
        secret,
        program,
        procs,
    })
}

fn wrapped(program: &[String], ssh: bool) -> Vec<String> {
    let script = format!("{}{WRAP_END}", if ssh { WRAP_SSH } else { WRAP });
    let mut v = vec!["sh".into(), "-c".into(), script, "gin-rank".into()];
    v.extend(program.iter().cloned());
    v
}

fn is_root_user() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find(|l| l.starts_with("Uid:"))
            .and_then(|l| l.split_whitespace().nth(2))
            == Some("0")
    })
}

fn mpirun_proc(
    o: &Opts,
    hosts: &[String],
    nranks: usize,
    cwd: &str,
    mut env: Vec<(String, String)>,
    secret: &str,
    program: &[String],
) -> Result<Proc> {
    let mpirun = if o.dry_run {
        find_mpirun().map_or_else(|| "mpirun".to_owned(), |p| p.display().to_string())
    } else {
        find_mpirun()
            .context("mpirun: not found (set GIN_MPIRUN, put it on PATH, or `cargo xtask wheels`)")?
            .display()
            .to_string()
    };
    env.push(("GIN_JOB_SECRET".into(), secret.to_owned()));
    let k = o.per_host;
    let mut argv = vec![
        mpirun,
        "-n".into(),
        nranks.to_string(),
        "-N".into(),
        k.to_string(),
    ];
    match &o.hostfile {
        Some(f) => argv.extend(["--hostfile".into(), f.display().to_string()]),
        None => argv.extend([
            "--host".into(),
            hosts
                .iter()
                .map(|h| format!("{h}:{k}"))
                .collect::<Vec<_>>()
                .join(","),
        ]),
    }
    if is_root_user() {
        argv.push("--allow-run-as-root".into());
    }
    argv.extend(["--bind-to".into(), "none".into(), "--tag-output".into()]);
    argv.extend(["--wdir".into(), cwd.to_owned()]);
    for (name, _) in &env {
        argv.extend(["-x".into(), name.clone()]);
    }
    argv.extend(o.launcher_args.iter().cloned());
    argv.extend(wrapped(program, false));
    Ok(Proc {
        argv,
        env,
        rank: None,
    })
}

fn srun_proc(
    o: &Opts,
    hosts: &[String],
    nranks: usize,
    cwd: &str,
    mut env: Vec<(String, String)>,
    secret: &str,
    program: &[String],
) -> Proc {
    env.push(("GIN_JOB_SECRET".into(), secret.to_owned()));
    let mut argv = vec![
        "srun".to_owned(),
        format!("--nodes={}", hosts.len()),
        format!("--ntasks={nranks}"),
        format!("--ntasks-per-node={}", o.per_host),
    ];
    if o.hosts.is_some() || o.hostfile.is_some() {
        argv.push(format!("--nodelist={}", hosts.join(",")));
    }
    argv.extend([
        "--kill-on-bad-exit=1".into(),
        "--label".into(),
        "--export=ALL".into(),
        format!("--chdir={cwd}"),
    ]);
    argv.extend(o.launcher_args.iter().cloned());
    argv.extend(wrapped(program, false));
    Proc {
        argv,
        env,
        rank: None,
    }
}

fn ssh_procs(
    o: &Opts,
    hosts: &[String],
    nranks: usize,
    cwd: &str,
    env: &[(String, String)],
    program: &[String],
) -> Vec<Proc> {
    let ssh = std::env::var("GIN_SSH").unwrap_or_else(|_| "ssh".into());
    let ssh: Vec<String> = ssh.split_whitespace().map(str::to_owned).collect();
    let mut procs = Vec::new();
    for (h, host) in hosts.iter().enumerate() {
        for local in 0..o.per_host {
            let rank = h * o.per_host + local;
            let mut remote = vec!["cd".to_owned(), cwd.to_owned(), "&&".into(), "exec".into()];
            remote.push("env".into());
            for (k, v) in [
                ("GIN_RANK", rank.to_string()),
                ("GIN_NRANKS", nranks.to_string()),
                ("GIN_LOCAL_RANK", local.to_string()),
                ("GIN_LOCAL_NRANKS", o.per_host.to_string()),
            ]
            .into_iter()
            .chain(env.iter().map(|(k, v)| (k.as_str(), v.clone())))
            {
                remote.push(format!("{k}={v}"));
            }
            let words = wrapped(program, true);
            // `cd`, `&&` and `exec` are shell words; the rest are quoted.
            let line: Vec<String> = remote
                .iter()
                .enumerate()
                .map(|(i, w)| {
                    if i == 2 || i == 3 {
                        w.clone()
                    } else {
                        quote(w)
                    }
                })
                .chain(words.iter().map(|w| quote(w)))
                .collect();
            let mut argv = ssh.clone();
            argv.extend(o.launcher_args.iter().cloned());
            argv.push(host.clone());
            argv.push(line.join(" "));
            procs.push(Proc {
                argv,
                env: Vec::new(),
                rank: Some((rank, host.clone())),
            });
        }
    }
    procs
}

/// Quotes a word for a POSIX shell when it needs it (braces always: bash
/// would expand `a{b,c}`).
fn quote(w: &str) -> String {
    let plain = !w.is_empty()
        && w.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:=,+@%".contains(c));
    if plain {
        w.to_owned()
    } else {
        format!("'{}'", w.replace('\'', r"'\''"))
    }
}

/// The command as a shell line: the environment the launcher gets, then its
/// argv (the job secret shown as `<secret>`).
fn shell_line(p: &Proc) -> String {
    let env = p.env.iter().map(|(k, v)| {
        if k == "GIN_JOB_SECRET" {
            format!("{k}=<secret>")
        } else {
            format!("{k}={}", quote(v))
        }
    });
    env.chain(p.argv.iter().map(|a| quote(a)))
        .collect::<Vec<_>>()
        .join(" ")
}

pub fn run(args: &[String]) -> Result<ExitCode> {
    let o = parse(args)?;
    let plan = plan(&o)?;
    for p in &plan.procs {
        match &p.rank {
            Some((r, _)) => println!("xtask cluster: rank {r}: {}", shell_line(p)),
            None => println!("xtask cluster: {}", shell_line(p)),
        }
    }
    if plan.launcher == Launcher::Ssh {
        println!("xtask cluster: (each ssh gets the job secret on its standard input)");
    }
    if o.dry_run {
        return Ok(ExitCode::SUCCESS);
    }
    std::fs::create_dir_all(&plan.out)
        .with_context(|| format!("creating {}", plan.out.display()))?;
    for r in 0..plan.nranks {
        let _ = std::fs::remove_file(plan.out.join(format!("rank-{r}.json")));
    }
    let job = Job::start(&plan)?;
    let outcome = job.watch(&plan, o.timeout, o.grace);
    let ok = outcome.write(&plan, &o)?;
    if ok {
        println!(
            "xtask cluster: {} ranks finished; report in {}",
            plan.nranks,
            plan.out.display()
        );
        return Ok(ExitCode::SUCCESS);
    }
    eprintln!(
        "xtask cluster: {}; report in {}",
        outcome.why.as_deref().unwrap_or("the launcher failed"),
        plan.out.display()
    );
    Ok(ExitCode::FAILURE)
}

/// One line of a rank's (or the launcher's) output.
enum Event {
    Line {
        rank: Option<usize>,
        err: bool,
        text: String,
    },
}

/// The rank a tagged line is from, and the line: `[1,3]<stdout>: text`
/// (Open MPI) or `  3: text` (srun --label).
fn untag(launcher: Launcher, line: &str) -> Option<(usize, String)> {
    match launcher {
        Launcher::Mpirun => {
            let rest = line.strip_prefix('[')?;
            let (ids, rest) = rest.split_once(']')?;
            let rank = ids.rsplit(',').next()?.parse().ok()?;
            let (_, text) = rest.split_once(">: ").or_else(|| rest.split_once(">:"))?;
            Some((rank, text.to_owned()))
        }
        Launcher::Srun => {
            let (n, text) = line.trim_start().split_once(": ")?;
            Some((n.parse().ok()?, text.to_owned()))
        }
        Launcher::Ssh => None,
    }
}

fn pump(
    r: impl Read + Send + 'static,
    rank: Option<usize>,
    err: bool,
    tx: mpsc::Sender<Event>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(r).lines() {
            let Ok(text) = line else { break };
            if tx.send(Event::Line { rank, err, text }).is_err() {
                break;
            }
        }
    })
}

struct Running {
    child: Child,
    rank: Option<usize>,
    /// ssh only: the rank's lifeline (closing it stops the rank).
    stdin: Option<std::process::ChildStdin>,
    status: Option<std::process::ExitStatus>,
}

struct Job {
    procs: Vec<Running>,
    rx: mpsc::Receiver<Event>,
    pumps: Vec<std::thread::JoinHandle<()>>,
    started: Instant,
}

impl Job {
    fn start(plan: &Plan) -> Result<Self> {
        let (tx, rx) = mpsc::channel();
        let mut procs = Vec::new();
        let mut pumps = Vec::new();
        for p in &plan.procs {
            let mut cmd = Command::new(&p.argv[0]);
            cmd.args(&p.argv[1..])
                .envs(p.env.iter().map(|(k, v)| (k, v)))
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .process_group(0);
            let mut child = cmd
                .spawn()
                .with_context(|| format!("starting {}", p.argv[0]))?;
            let rank = p.rank.as_ref().map(|(r, _)| *r);
            let mut stdin = child.stdin.take();
            if rank.is_some()
                && let Some(s) = stdin.as_mut()
            {
                // The secret, then the lifeline stays open.
                let _ = writeln!(s, "{}", plan.secret);
            } else {
                stdin = None; // mpirun/srun: no input for the ranks
            }
            if let Some(o) = child.stdout.take() {
                pumps.push(pump(o, rank, false, tx.clone()));
            }
            if let Some(e) = child.stderr.take() {
                pumps.push(pump(e, rank, true, tx.clone()));
            }
            procs.push(Running {
                child,
                rank,
                stdin,
                status: None,
            });
        }
        Ok(Self {
            procs,
            rx,
            pumps,
            started: Instant::now(),
        })
    }
}

/// What each rank said and how the job ended.
#[derive(Default)]
struct Outcome {
    ranks: BTreeMap<usize, RankState>,
    launcher_log: String,
    launcher_status: Option<i32>,
    first_failure: Option<usize>,
    timed_out: bool,
    /// Ranks that had not finished when the job was stopped.
    stopped: Vec<usize>,
    why: Option<String>,
    elapsed: Duration,
}

#[derive(Default)]
struct RankState {
    host: Option<String>,
    pid: Option<u32>,
    exit: Option<i32>,
    log: String,
    json: Option<String>,
    in_json: bool,
}

impl Outcome {
    fn line(&mut self, launcher: Launcher, rank: Option<usize>, err: bool, text: String) {
        let (rank, err, text) = match rank {
            Some(r) => (Some(r), err, text),
            None => match untag(launcher, &text) {
                // Open MPI says which stream a line was on.
                Some((r, t)) => (Some(r), err || text.contains("]<stderr>:"), t),
                None => (None, err, text),
            },
        };
        let Some(r) = rank else {
            eprintln!("{text}");
            self.launcher_log.push_str(&text);
            self.launcher_log.push('\n');
            return;
        };
        let st = self.ranks.entry(r).or_default();
        // The wrapper's lines are on standard output; standard error
        // arrives through another pipe, in no set order with them.
        if st.in_json && !err {
            if text == "GIN_CLUSTER_JSON_END" {
                st.in_json = false;
            } else if let Some(j) = st.json.as_mut() {
                j.push_str(&text);
                j.push('\n');
            }
            return;
        }
        if let Some(rest) = text.strip_prefix("GIN_CLUSTER_START ").filter(|_| !err) {
            let mut w = rest.split_whitespace();
            st.host = w.next().map(str::to_owned);
            st.pid = w.next().and_then(|p| p.parse().ok());
        } else if let Some(code) = text.strip_prefix("GIN_CLUSTER_EXIT ").filter(|_| !err) {
            let code = code.trim().parse().unwrap_or(-1);
            st.exit = Some(code);
            if code != 0 && self.first_failure.is_none() {
                self.first_failure = Some(r);
            }
        } else if !err && text == "GIN_CLUSTER_JSON_BEGIN" {
            st.in_json = true;
            st.json = Some(String::new());
        } else {
            if err {
                eprintln!("[{r}] {text}");
            } else {
                println!("[{r}] {text}");
            }
            st.log.push_str(&text);
            st.log.push('\n');
        }
    }

    fn where_is(&self, r: usize, plan: &Plan) -> String {
        let host = self
            .ranks
            .get(&r)
            .and_then(|s| s.host.clone())
            .unwrap_or_else(|| plan.hosts[r / plan.per_host].clone());
        format!("rank {r} on {host}")
    }
}

impl Job {
    /// Runs the job to its end: all processes done, or a failure (after the
    /// grace period) or the timeout, which stops what is left.
    fn watch(mut self, plan: &Plan, timeout: Option<Duration>, grace: Duration) -> Outcome {
        let mut out = Outcome::default();
        let deadline = timeout.map(|t| self.started + t);
        let mut stop_at: Option<Instant> = None;
        let mut stopping: Option<Instant> = None;
        loop {
            while let Ok(Event::Line { rank, err, text }) = self.rx.try_recv() {
                out.line(plan.launcher, rank, err, text);
            }
            self.reap(plan, &mut out);
            if self.procs.iter().all(|p| p.status.is_some()) {
                break;
            }
            let now = Instant::now();
            if stopping.is_none() {
                if out.first_failure.is_some() && stop_at.is_none() {
                    stop_at = Some(now + grace);
                }
                if deadline.is_some_and(|d| now >= d) {
                    out.timed_out = true;
                }
                if out.timed_out || stop_at.is_some_and(|s| now >= s) {
                    out.stopped = (0..plan.nranks)
                        .filter(|r| out.ranks.get(r).and_then(|s| s.exit).is_none())
                        .collect();
                    self.stop(plan.launcher);
                    stopping = Some(now);
                }
            } else if stopping.is_some_and(|s| now >= s + grace + Duration::from_secs(3)) {
                self.kill_groups();
            }
            if let Ok(Event::Line { rank, err, text }) =
                self.rx.recv_timeout(Duration::from_millis(50))
            {
                out.line(plan.launcher, rank, err, text);
            }
        }
        for p in &mut self.procs {
            p.stdin = None;
        }
        // Output still in the pipes (the processes are gone).
        for h in self.pumps.drain(..) {
            let _ = h.join();
        }
        for ev in self.rx.try_iter() {
            let Event::Line { rank, err, text } = ev;
            out.line(plan.launcher, rank, err, text);
        }
        out.elapsed = self.started.elapsed();
        out.launcher_status = self
            .procs
            .iter()
            .filter(|p| p.rank.is_none())
            .find_map(|p| p.status.and_then(|s| s.code()));
        out.why = describe(&out, plan, timeout);
        out
    }

    fn reap(&mut self, plan: &Plan, out: &mut Outcome) {
        for p in &mut self.procs {
            if p.status.is_none()
                && let Ok(Some(st)) = p.child.try_wait()
            {
                p.status = Some(st);
                p.stdin = None;
                if let Some(r) = p.rank {
                    // ssh: its status is the rank's when the wrapper said
                    // nothing (255: ssh itself failed).
                    let s = out.ranks.entry(r).or_default();
                    if s.exit.is_none() && !st.success() {
                        s.exit = Some(st.code().unwrap_or(-1));
                        if out.first_failure.is_none() {
                            out.first_failure = Some(r);
                        }
                    }
                } else if !st.success() && out.first_failure.is_none() {
                    // The launcher failed; blame the first rank that did,
                    // else none (the launcher's own message says why).
                    out.first_failure = (0..plan.nranks).find(|r| {
                        out.ranks
                            .get(r)
                            .and_then(|s| s.exit)
                            .is_some_and(|c| c != 0)
                    });
                }
            }
        }
    }

    /// Asks the job to end: mpirun and srun abort their job on SIGTERM;
    /// for ssh, closing a rank's standard input kills its process group on
    /// its host (see the wrapper).
    fn stop(&mut self, launcher: Launcher) {
        for p in &mut self.procs {
            p.stdin = None;
            if p.status.is_none() && launcher != Launcher::Ssh {
                signal(&format!("{}", p.child.id()), "TERM");
            }
        }
    }

    /// Last resort: SIGKILL each launcher process group here.
    fn kill_groups(&mut self) {
        for p in &mut self.procs {
            if p.status.is_none() {
                signal(&format!("-{}", p.child.id()), "KILL");
            }
        }
    }
}

fn signal(target: &str, sig: &str) {
    let _ = Command::new("kill")
        .args([format!("-{sig}").as_str(), "--", target])
        .stderr(Stdio::null())
        .status();
}

/// Why the job failed, naming the rank and host; `None` when it did not.
fn describe(out: &Outcome, plan: &Plan, timeout: Option<Duration>) -> Option<String> {
    if out.timed_out {
        let hung: Vec<String> = out.stopped.iter().map(|&r| out.where_is(r, plan)).collect();
        return Some(format!(
            "timed out after {:?}: {} had not finished; the job was stopped",
            timeout.unwrap_or_default(),
            if hung.is_empty() {
                "no rank".to_owned()
            } else {
                hung.join(", ")
            }
        ));
    }
    if let Some(r) = out.first_failure {
        let code = out.ranks.get(&r).and_then(|s| s.exit).unwrap_or(-1);
        return Some(format!(
            "{} failed with exit status {code}",
            out.where_is(r, plan)
        ));
    }
    let missing: Vec<String> = (0..plan.nranks)
        .filter(|r| out.ranks.get(r).and_then(|s| s.exit) != Some(0))
        .map(|r| out.where_is(r, plan))
        .collect();
    if !missing.is_empty() {
        return Some(format!(
            "{} never reported an exit status",
            missing.join(", ")
        ));
    }
    match out.launcher_status {
        Some(0) | None => None,
        Some(c) => Some(format!("{} exited with status {c}", plan.launcher.name())),
    }
}

impl Outcome {
    /// Writes each rank's log and JSON and the index; true when every rank
    /// succeeded.
    fn write(&self, plan: &Plan, o: &Opts) -> Result<bool> {
        let dir = &plan.out;
        let mut ranks = Vec::new();
        for r in 0..plan.nranks {
            let st = self.ranks.get(&r);
            let log = format!("rank-{r}.log");
            std::fs::write(dir.join(&log), st.map_or("", |s| s.log.as_str()))?;
            let json_name = format!("rank-{r}.json");
            let json_file = dir.join(&json_name);
            if let Some(j) = st.and_then(|s| s.json.as_ref()) {
                std::fs::write(&json_file, j)?;
            }
            ranks.push(serde_json::json!({
                "rank": r,
                "host": st.and_then(|s| s.host.clone()),
                "listed_host": plan.hosts[r / plan.per_host],
                "pid": st.and_then(|s| s.pid),
                "exit_code": st.and_then(|s| s.exit),
                "stopped": self.stopped.contains(&r),
                "log": log,
                "json": json_file.is_file().then_some(json_name),
            }));
        }
        std::fs::write(dir.join("launcher.log"), &self.launcher_log)?;
        let ok = self.why.is_none();
        let program: Vec<&String> = std::iter::once(&o.program).chain(&o.args).collect();
        let commands: Vec<String> = plan.procs.iter().map(shell_line).collect();
        let index = serde_json::json!({
            "program": program,
            "ran": plan.program,
            "launcher": plan.launcher.name(),
            "launcher_commands": commands,
            "hosts": plan.hosts,
            "per_host": plan.per_host,
            "nranks": plan.nranks,
            "root_addr": plan.root,
            "elapsed_s": self.elapsed.as_secs_f64(),
            "timed_out": self.timed_out,
            "ok": ok,
            "error": self.why,
            "first_failure": self.first_failure,
            "launcher_exit_code": self.launcher_status,
            "ranks": ranks,
        });
        std::fs::write(
            dir.join("index.json"),
            serde_json::to_string_pretty(&index)?,
        )?;
        Ok(ok)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slurm_node_lists_expand() {
        assert_eq!(
            expand_nodelist("node[01-03,7],gpu5").unwrap(),
            ["node01", "node02", "node03", "node7", "gpu5"]
        );
        assert_eq!(
            expand_nodelist("r[1-2]n[1-2]").unwrap(),
            ["r1n1", "r1n2", "r2n1", "r2n2"]
        );
        assert!(expand_nodelist("node[1-").is_err());
        assert!(expand_nodelist("node[3-1]").is_err());
    }

    #[test]
    fn tagged_lines_name_their_rank() {
        assert_eq!(
            untag(Launcher::Mpirun, "[1,12]<stdout>: hello: world"),
            Some((12, "hello: world".into()))
        );
        assert_eq!(untag(Launcher::Srun, " 3: x"), Some((3, "x".into())));
        assert_eq!(untag(Launcher::Mpirun, "prterun detected"), None);
    }

    #[test]
    fn a_ranks_stderr_never_lands_in_its_json() {
        // Standard error comes through its own pipe, in any order with the
        // JSON block the wrapper prints on standard output.
        let mut o = Outcome::default();
        let l = Launcher::Mpirun;
        for (line, err) in [
            ("[1,1]<stdout>: GIN_CLUSTER_START node7 42", false),
            ("[1,1]<stdout>: GIN_CLUSTER_JSON_BEGIN", false),
            ("[1,1]<stdout>: {", false),
            ("[1,1]<stderr>: wrote rank-1.json", true),
            ("[1,1]<stdout>: \"rank\": 1", false),
            ("[1,1]<stdout>: }", false),
            ("[1,1]<stdout>: GIN_CLUSTER_JSON_END", false),
            ("[1,1]<stdout>: GIN_CLUSTER_EXIT 3", false),
            ("prterun detected that one or more processes exited", true),
        ] {
            o.line(l, None, err, line.to_owned());
        }
        let st = &o.ranks[&1];
        assert_eq!(st.json.as_deref(), Some("{\n\"rank\": 1\n}\n"));
        assert_eq!(
            (st.host.as_deref(), st.pid, st.exit),
            (Some("node7"), Some(42), Some(3))
        );
        assert_eq!(st.log, "wrote rank-1.json\n");
        assert_eq!(o.first_failure, Some(1));
        assert!(o.launcher_log.starts_with("prterun detected"));
    }

    #[test]
    fn words_are_quoted_for_the_remote_shell() {
        assert_eq!(quote("a/b-c.json"), "a/b-c.json");
        assert_eq!(quote("it's"), r"'it'\''s'");
        assert_eq!(quote(""), "''");
        assert_eq!(quote("a b"), "'a b'");
    }
}
