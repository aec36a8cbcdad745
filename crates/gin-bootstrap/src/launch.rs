//! The local launcher: N rank processes on this host, one bootstrap root in
//! the launching process, output prefixed by rank, and a failed rank stopping
//! the others after a grace period.
//!
//! The root lives in the launcher rather than in rank 0, so the death of any
//! rank, rank 0 included, is seen and relayed to the survivors.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use crate::env::Config;
use crate::error::BootstrapError;
use crate::root::BootstrapRoot;

/// What to do with the ranks' standard output and error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// Copy each line to ours, prefixed with `[rank i]`.
    Prefix,
    /// Keep each rank's output in the report, print nothing.
    Capture,
    /// Leave the ranks' output attached to ours, unprefixed.
    Inherit,
}

/// How to launch a job.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    pub nranks: usize,
    pub program: OsString,
    pub args: Vec<OsString>,
    /// Extra environment for every rank.
    pub env: Vec<(OsString, OsString)>,
    /// After the first rank fails, how long the others get to finish on their
    /// own before they are stopped.
    pub grace: Duration,
    /// Stop the whole job after this long (None: no limit).
    pub limit: Option<Duration>,
    pub output: Output,
    /// Settings for the launcher's root (its rendezvous timeout).
    pub config: Config,
    /// Where the root listens.
    pub root_bind: SocketAddr,
    /// A fault to inject into one rank (for failure tests and
    /// `cargo xtask faults`).
    pub fault: Option<Fault>,
}

/// A fault the launcher injects into one rank once the job has run for a
/// while, so that tests can check how its peers notice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    pub rank: usize,
    pub kind: FaultKind,
    /// How long after the launch.
    pub after: Duration,
}

/// What happens to the faulty rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// SIGKILL: the process dies at once, its sockets close.
    Kill,
    /// SIGSTOP: the process stays, its sockets stay open, it answers nothing
    /// (as a frozen host or a debugger would). The launcher kills it once
    /// the other ranks have ended (after the grace period).
    Stop,
}

impl LaunchSpec {
    /// `nranks` copies of `program args...` with default settings.
    pub fn new(
        nranks: usize,
        program: impl Into<OsString>,
        args: impl IntoIterator<Item = impl Into<OsString>>,
    ) -> Self {
        Self {
            nranks,
            program: program.into(),
            args: args.into_iter().map(Into::into).collect(),
            env: Vec::new(),
            grace: Duration::from_secs(5),
            limit: None,
            output: Output::Prefix,
            config: Config::default(),
            root_bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            fault: None,
        }
    }

    /// Adds an environment variable for every rank.
    #[must_use]
    pub fn env(mut self, k: impl Into<OsString>, v: impl Into<OsString>) -> Self {
        self.env.push((k.into(), v.into()));
        self
    }
}

/// How one rank ended.
#[derive(Debug, Clone)]
pub struct RankExit {
    pub rank: usize,
    /// None if it could not be waited for.
    pub status: Option<ExitStatus>,
    /// The launcher stopped it (after another rank failed or the limit passed).
    pub stopped: bool,
    /// Captured standard output (with [`Output::Capture`]).
    pub stdout: String,
    /// Captured standard error (with [`Output::Capture`]).
    pub stderr: String,
    /// When the launcher saw it end, from the launch.
    pub ended: Option<Duration>,
}

impl RankExit {
    /// Exited by itself with status 0.
    pub fn success(&self) -> bool {
        !self.stopped && self.status.is_some_and(|s| s.success())
    }
}

/// What happened to every rank.
#[derive(Debug, Clone)]
pub struct LaunchReport {
    pub ranks: Vec<RankExit>,
    /// The first rank that failed, if any.
    pub first_failure: Option<usize>,
    pub elapsed: Duration,
    /// When the fault was injected, from the launch (None: not injected,
    /// because none was asked for or its rank had already ended).
    pub fault_at: Option<Duration>,
}

impl LaunchReport {
    /// Every rank exited with status 0.
    pub fn success(&self) -> bool {
        self.ranks.iter().all(RankExit::success)
    }

    /// A one-paragraph account of the failures, for error messages.
    pub fn describe_failures(&self) -> String {
        let mut s = String::new();
        for r in self.ranks.iter().filter(|r| !r.success()) {
            let how = match (r.stopped, r.status) {
                (true, _) => "stopped by the launcher".to_owned(),
                (false, Some(st)) => describe_status(st),
                (false, None) => "could not be waited for".to_owned(),
            };
            let _ = write!(s, "rank {}: {how}; ", r.rank);
        }
        if let Some(f) = self.first_failure {
            let _ = write!(s, "rank {f} failed first");
        }
        s
    }
}

fn describe_status(st: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (st.code(), st.signal()) {
        (Some(c), _) => format!("exited with status {c}"),
        (None, Some(sig)) => format!("killed by signal {sig}"),
        _ => st.to_string(),
    }
}

struct Running {
    child: Child,
    exit: Option<ExitStatus>,
    ended: Option<Duration>,
    stopped: bool,
    out: Option<thread::JoinHandle<String>>,
    err: Option<thread::JoinHandle<String>>,
}

/// Launches the job and waits for every rank. An `Err` is a failure to
/// launch; ranks that fail are reported in the returned report.
pub fn launch(spec: &LaunchSpec) -> Result<LaunchReport, BootstrapError> {
    if spec.nranks == 0 {
        return Err(BootstrapError::Launch("cannot launch 0 ranks".into()));
    }
    let root = BootstrapRoot::start(spec.root_bind, Some(spec.nranks), spec.config)?;
    let id = root.id().to_string();
    let start = Instant::now();
    let mut ranks: Vec<Running> = Vec::with_capacity(spec.nranks);
    for rank in 0..spec.nranks {
        let mut cmd = Command::new(&spec.program);
        cmd.args(&spec.args)
            // Our variables take precedence over any other launcher's.
            .env("GIN_RANK", rank.to_string())
            .env("GIN_NRANKS", spec.nranks.to_string())
            .env("GIN_LOCAL_RANK", rank.to_string())
            .env("GIN_LOCAL_NRANKS", spec.nranks.to_string())
            .env("GIN_UNIQUE_ID", &id)
            .stdin(Stdio::null());
        for (k, v) in &spec.env {
            cmd.env(k, v);
        }
        if spec.output != Output::Inherit {
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                for r in &mut ranks {
                    let _ = r.child.kill();
                    let _ = r.child.wait();
                }
                return Err(BootstrapError::Launch(format!(
                    "starting rank {rank} ({}): {e}",
                    spec.program.to_string_lossy()
                )));
            }
        };
        let capture = spec.output == Output::Capture;
        let out = child.stdout.take().map(|s| pump(s, rank, capture, false));
        let err = child.stderr.take().map(|s| pump(s, rank, capture, true));
        ranks.push(Running {
            child,
            exit: None,
            ended: None,
            stopped: false,
            out,
            err,
        });
    }

    let mut first_failure = None;
    let mut stop_at: Option<Instant> = None;
    let mut fault = spec.fault;
    let mut fault_at = None;
    let poll = Duration::from_millis(5);
    loop {
        if let Some(f) = fault.filter(|f| start.elapsed() >= f.after) {
            fault = None;
            if let Some(r) = ranks.get_mut(f.rank).filter(|r| r.exit.is_none()) {
                inject(&mut r.child, f.kind)?;
                fault_at = Some(start.elapsed());
            }
        }
        let mut running = 0;
        for (rank, r) in ranks.iter_mut().enumerate() {
            if r.exit.is_some() {
                continue;
            }
            match r.child.try_wait() {
                Ok(Some(st)) => {
                    r.exit = Some(st);
                    r.ended = Some(start.elapsed());
                    if !st.success() && first_failure.is_none() {
                        first_failure = Some(rank);
                        stop_at = Some(Instant::now() + spec.grace);
                        tracing::warn!(rank, status = %describe_status(st), "rank failed; stopping the others after the grace period");
                    }
                }
                Ok(None) => running += 1,
                Err(_) => {
                    r.exit = None;
                    r.stopped = true;
                }
            }
        }
        if running == 0 {
            break;
        }
        let now = Instant::now();
        let over_limit = spec.limit.is_some_and(|l| now >= start + l);
        if over_limit && stop_at.is_none() {
            stop_at = Some(now);
        }
        if stop_at.is_some_and(|t| now >= t) {
            for r in ranks.iter_mut().filter(|r| r.exit.is_none() && !r.stopped) {
                r.stopped = true;
                let _ = r.child.kill();
            }
        }
        // Polling child status is the supervision loop itself, not a stand-in
        // for synchronisation: std offers no wait-for-any-child.
        thread::sleep(poll);
    }
    let ranks = ranks
        .into_iter()
        .enumerate()
        .map(|(rank, r)| RankExit {
            rank,
            status: r.exit,
            stopped: r.stopped,
            stdout: r.out.and_then(|h| h.join().ok()).unwrap_or_default(),
            stderr: r.err.and_then(|h| h.join().ok()).unwrap_or_default(),
            ended: r.ended,
        })
        .collect();
    Ok(LaunchReport {
        ranks,
        first_failure,
        elapsed: start.elapsed(),
        fault_at,
    })
}

/// Kills or stops a rank. SIGSTOP goes through kill(1): this crate has no
/// unsafe code and std can only send SIGKILL.
fn inject(child: &mut Child, kind: FaultKind) -> Result<(), BootstrapError> {
    match kind {
        FaultKind::Kill => child
            .kill()
            .map_err(|e| BootstrapError::Launch(format!("killing a rank: {e}"))),
        FaultKind::Stop => {
            let st = Command::new("kill")
                .args(["-STOP", &child.id().to_string()])
                .status()
                .map_err(|e| BootstrapError::Launch(format!("running kill -STOP: {e}")))?;
            if st.success() {
                Ok(())
            } else {
                Err(BootstrapError::Launch(format!("kill -STOP failed: {st}")))
            }
        }
    }
}

/// Copies a rank's stream line by line, prefixed, or captures it.
fn pump<R: Read + Send + 'static>(
    stream: R,
    rank: usize,
    capture: bool,
    is_err: bool,
) -> thread::JoinHandle<String> {
    thread::spawn(move || {
        let mut kept = String::new();
        let mut rd = BufReader::new(stream);
        let mut line = Vec::new();
        loop {
            line.clear();
            match rd.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            let text = String::from_utf8_lossy(&line);
            if capture {
                kept.push_str(&text);
                continue;
            }
            let text = text.trim_end_matches('\n');
            if is_err {
                let _ = writeln!(std::io::stderr().lock(), "[rank {rank}] {text}");
            } else {
                let _ = writeln!(std::io::stdout().lock(), "[rank {rank}] {text}");
            }
        }
        kept
    })
}

/// Runs `f` in `n` threads, each with its own [`crate::Bootstrap`] of one job
/// whose root runs in this process. For tests and for users who want ranks as
/// threads.
pub fn run_threads<T: Send + 'static>(
    n: usize,
    config: Config,
    f: impl Fn(crate::Bootstrap) -> T + Send + Sync + 'static,
) -> Result<Vec<T>, BootstrapError> {
    let root = BootstrapRoot::start(SocketAddr::from(([127, 0, 0, 1], 0)), Some(n), config)?;
    let id = root.id();
    let f = std::sync::Arc::new(f);
    let (tx, rx) = mpsc::channel();
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let f = f.clone();
            let tx = tx.clone();
            thread::spawn(move || {
                let r = crate::Bootstrap::init_with(&id, rank, n, config).map(|b| f(b));
                let _ = tx.send((rank, r));
            })
        })
        .collect();
    drop(tx);
    let mut out: Vec<Option<T>> = (0..n).map(|_| None).collect();
    let mut first_err = None;
    for (rank, r) in rx {
        match r {
            Ok(v) => out[rank] = Some(v),
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    for h in handles {
        if h.join().is_err() {
            first_err.get_or_insert(BootstrapError::Launch("a rank thread panicked".into()));
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    Ok(out
        .into_iter()
        .map(|v| v.expect("every rank reported"))
        .collect())
}
