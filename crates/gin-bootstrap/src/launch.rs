//! The local launcher: N rank processes on this host, one bootstrap root in
//! the launching process, output prefixed by rank, and a failed rank stopping
//! the others after a grace period.
//!
//! The root lives in the launcher rather than in rank 0, so the death of any
//! rank, rank 0 included, is seen and relayed to the survivors.
//!
//! Each rank is started in a process group of its own and stopped as a whole
//! group, as Slurm and torchrun stop a job step: a rank started through a
//! wrapper script (`sh -c 'prog; ...'`, a job script, `env`, `numactl`) is the
//! wrapper and everything it started. Stopping means SIGTERM to the group,
//! then SIGKILL to the group [`KILL_AFTER_TERM`] later (or after the grace,
//! if that is shorter). When a rank's first process exits, whatever it left
//! running in its group is killed with it, so a forgotten background child
//! cannot keep the rank's output, and so the launcher, open.
//!
//! Because the ranks are not in the launcher's process group, a Ctrl-C at the
//! terminal (or a SIGTERM or SIGHUP to the launcher) reaches only the
//! launcher. While [`launch()`] runs it catches those three signals (unless
//! they were ignored), stops every rank's group at once (SIGTERM, then
//! SIGKILL), waits for the ranks, restores the previous handlers and raises
//! the signal again, so the launching process ends as it would have.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::os::unix::process::CommandExt as _;
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
    /// Keep each rank's standard output in the report and copy its standard
    /// error to ours, prefixed: a front end that parses the ranks' results
    /// but passes their logs through.
    CaptureStdout,
    /// Leave the ranks' output attached to ours, unprefixed.
    Inherit,
}

/// How to launch a job.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    /// How many ranks (processes) to start.
    pub nranks: usize,
    /// The program every rank runs.
    pub program: OsString,
    /// Its arguments, the same for every rank.
    pub args: Vec<OsString>,
    /// Extra environment for every rank.
    pub env: Vec<(OsString, OsString)>,
    /// After the first rank fails, how long the others get to finish on their
    /// own before they are stopped (SIGTERM to each rank's process group, then
    /// SIGKILL [`KILL_AFTER_TERM`] later, or after `grace` if that is shorter).
    pub grace: Duration,
    /// Stop the whole job after this long (None: no limit).
    pub limit: Option<Duration>,
    /// What happens to the ranks' standard output and error.
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
    /// The rank that gets the fault.
    pub rank: usize,
    /// What is done to it.
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
    /// every other rank has ended.
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
    /// The rank this is about.
    pub rank: usize,
    /// None if it could not be waited for.
    pub status: Option<ExitStatus>,
    /// The launcher stopped it (after another rank failed or the limit passed).
    pub stopped: bool,
    /// Captured standard output (with [`Output::Capture`] and
    /// [`Output::CaptureStdout`]).
    pub stdout: String,
    /// Captured standard error (with [`Output::Capture`]; empty with
    /// [`Output::CaptureStdout`], which prints it as it comes).
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
    /// How each rank ended, indexed by rank.
    pub ranks: Vec<RankExit>,
    /// The first rank that failed, if any.
    pub first_failure: Option<usize>,
    /// How long the whole job took, from the launch until every rank had
    /// ended and its output had been gathered.
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

/// How long a stopped rank's process group has between SIGTERM and SIGKILL
/// (at most; a shorter grace shortens it too).
pub const KILL_AFTER_TERM: Duration = Duration::from_secs(2);

/// How long the launcher waits, once every rank has ended, for the ranks'
/// output to reach end of file. Only a process that left its rank's process
/// group (`setsid`) can hold it open that long; its output is then dropped.
const OUTPUT_DRAIN: Duration = Duration::from_secs(5);

struct Running {
    child: Child,
    /// The rank's process group: its first process's pid.
    pgid: u32,
    exit: Option<ExitStatus>,
    ended: Option<Duration>,
    /// The launcher stopped it.
    stopped: bool,
    /// Its status could not be read.
    lost: bool,
    /// When the group gets SIGKILL after the SIGTERM it was sent.
    kill_at: Option<Instant>,
}

/// Process groups: signalled as a whole, and a leader's exit seen without
/// reaping it (std can start a group, not signal or peek at one); and the
/// launcher's own termination signals, caught while a job runs.
#[allow(unsafe_code)]
mod group {
    use std::io;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicI32, Ordering};

    pub(super) use libc::{SIGKILL, SIGSTOP, SIGTERM};

    /// The signals that end a launcher and so must end its job.
    const FORWARDED: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

    /// The last forwarded signal caught (0: none).
    static CAUGHT: AtomicI32 = AtomicI32::new(0);

    /// How many launches run, and the handlers they replaced.
    static INSTALLED: Mutex<(usize, Vec<(libc::c_int, libc::sigaction)>)> =
        Mutex::new((0, Vec::new()));

    extern "C" fn on_signal(sig: libc::c_int) {
        // An atomic store is async-signal-safe.
        CAUGHT.store(sig, Ordering::Relaxed);
    }

    /// Catches the forwarded signals while it lives (shared by concurrent
    /// launches: the first installs, the last restores).
    pub(super) struct Catch(());

    impl Catch {
        pub(super) fn install() -> Self {
            let mut g = INSTALLED
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if g.0 == 0 {
                CAUGHT.store(0, Ordering::Relaxed);
                for sig in FORWARDED {
                    // SAFETY: sigaction is plain old data, valid when zeroed.
                    let mut new: libc::sigaction = unsafe { std::mem::zeroed() };
                    new.sa_sigaction =
                        on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
                    new.sa_flags = libc::SA_RESTART;
                    // SAFETY: zeroed is a valid sigaction to be overwritten.
                    let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
                    // SAFETY: both pointers are valid sigaction structs; the
                    // handler only stores to an atomic.
                    if unsafe { libc::sigaction(sig, &raw const new, &raw mut old) } != 0 {
                        continue;
                    }
                    if old.sa_sigaction == libc::SIG_IGN {
                        // Ignored (nohup, a background job): keep ignoring it.
                        // SAFETY: `old` was just returned by sigaction.
                        unsafe { libc::sigaction(sig, &raw const old, std::ptr::null_mut()) };
                    } else {
                        g.1.push((sig, old));
                    }
                }
            }
            g.0 += 1;
            Self(())
        }

        /// A forwarded signal caught since the first launch began.
        pub(super) fn caught() -> Option<libc::c_int> {
            match CAUGHT.load(Ordering::Relaxed) {
                0 => None,
                s => Some(s),
            }
        }
    }

    impl Drop for Catch {
        fn drop(&mut self) {
            let mut g = INSTALLED
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            g.0 -= 1;
            if g.0 > 0 {
                return;
            }
            for (sig, old) in g.1.drain(..) {
                // SAFETY: `old` is the action sigaction returned for `sig`.
                unsafe { libc::sigaction(sig, &raw const old, std::ptr::null_mut()) };
            }
            let sig = CAUGHT.swap(0, Ordering::Relaxed);
            if sig != 0 {
                // The launcher was asked to end: now that its job is stopped,
                // end as the previous disposition says (by default, die of
                // the signal). If that returns, launch() reports it.
                // SAFETY: raise sends a signal to this thread only.
                unsafe { libc::raise(sig) };
            }
        }
    }

    /// Sends `sig` to every process of the group `pgid`. An empty group
    /// (ESRCH) is not an error: everything in it has already gone.
    pub(super) fn signal(pgid: u32, sig: libc::c_int) {
        // SAFETY: killpg only sends a signal; it reads and writes no memory of
        // ours. Callers pass the pgid of a group whose leader they have not
        // reaped yet, so the id cannot have been recycled.
        let _ = unsafe { libc::killpg(pgid as libc::pid_t, sig) };
    }

    /// Whether our child `pid` has exited, without reaping it: until it is
    /// reaped its pid keeps naming its process group, so what it left in the
    /// group can still be signalled without hitting a recycled id.
    pub(super) fn exited_unreaped(pid: u32) -> io::Result<bool> {
        // SAFETY: siginfo_t is plain old data, valid when zeroed; a zero
        // si_pid is how WNOHANG reports "no change" portably.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: `info` is a valid, writable siginfo_t; WNOHANG | WNOWAIT
        // neither blocks nor reaps.
        let rc = unsafe {
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                &raw mut info,
                libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
            )
        };
        if rc != 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::Interrupted {
                Ok(false)
            } else {
                Err(e)
            };
        }
        // SAFETY: waitid succeeded, so `info` is initialised; si_pid is
        // meaningful for the CLD_* codes it reports and zero otherwise.
        Ok(unsafe { info.si_pid() } != 0)
    }
}

/// Launches the job and waits for every rank. An `Err` is a failure to
/// launch; ranks that fail are reported in the returned report.
pub fn launch(spec: &LaunchSpec) -> Result<LaunchReport, BootstrapError> {
    if spec.nranks == 0 {
        return Err(BootstrapError::Launch("cannot launch 0 ranks".into()));
    }
    let root = BootstrapRoot::start(spec.root_bind, Some(spec.nranks), spec.config)?;
    let id = root.id().to_string();
    let catch = group::Catch::install();
    let start = Instant::now();
    let (out_tx, out_rx) = mpsc::channel();
    let (mut ranks, pumps) = spawn_ranks(spec, &id, &out_tx)?;
    drop(out_tx);
    let sup = supervise(spec, start, &mut ranks);
    let outputs = gather_output(&out_rx, pumps, spec.nranks);
    // Restores the handlers; re-raises a caught signal if this was the last
    // launch running.
    drop(catch);
    if let Some(sig) = sup.interrupted {
        return Err(BootstrapError::Launch(format!(
            "interrupted by signal {sig}; every rank was stopped"
        )));
    }
    let ranks = ranks
        .into_iter()
        .zip(outputs)
        .enumerate()
        .map(|(rank, (r, (stdout, stderr)))| RankExit {
            rank,
            status: r.exit,
            stopped: r.stopped || r.lost,
            stdout,
            stderr,
            ended: r.ended,
        })
        .collect();
    Ok(LaunchReport {
        ranks,
        first_failure: sup.first_failure,
        elapsed: start.elapsed(),
        fault_at: sup.fault_at,
    })
}

/// A captured stream of one rank at end of file: (rank, is standard error,
/// what was kept).
type PumpDone = (usize, bool, String);

/// Starts every rank, each in a process group of its own, with the job's
/// `GIN_*` variables and its output pumped as `spec.output` says. Returns
/// the ranks and how many output pumps will report to `out_tx`. If a rank
/// cannot be started, those already started are killed and reaped.
fn spawn_ranks(
    spec: &LaunchSpec,
    id: &str,
    out_tx: &mpsc::Sender<PumpDone>,
) -> Result<(Vec<Running>, usize), BootstrapError> {
    let mut ranks: Vec<Running> = Vec::with_capacity(spec.nranks);
    let mut pumps = 0;
    for rank in 0..spec.nranks {
        let mut child = match rank_command(spec, id, rank).spawn() {
            Ok(c) => c,
            Err(e) => {
                for r in &mut ranks {
                    group::signal(r.pgid, group::SIGKILL);
                    let _ = r.child.wait();
                }
                return Err(BootstrapError::Launch(format!(
                    "starting rank {rank} ({}): {e}",
                    spec.program.to_string_lossy()
                )));
            }
        };
        let capture_out = matches!(spec.output, Output::Capture | Output::CaptureStdout);
        let capture_err = spec.output == Output::Capture;
        if let Some(s) = child.stdout.take() {
            pump(s, rank, capture_out, false, out_tx.clone());
            pumps += 1;
        }
        if let Some(s) = child.stderr.take() {
            pump(s, rank, capture_err, true, out_tx.clone());
            pumps += 1;
        }
        ranks.push(Running {
            pgid: child.id(),
            child,
            exit: None,
            ended: None,
            stopped: false,
            lost: false,
            kill_at: None,
        });
    }
    Ok((ranks, pumps))
}

/// The command that starts `rank`.
fn rank_command(spec: &LaunchSpec, id: &str, rank: usize) -> Command {
    let mut cmd = Command::new(&spec.program);
    cmd.args(&spec.args)
        // Our variables take precedence over any other launcher's.
        .env("GIN_RANK", rank.to_string())
        .env("GIN_NRANKS", spec.nranks.to_string())
        .env("GIN_LOCAL_RANK", rank.to_string())
        .env("GIN_LOCAL_NRANKS", spec.nranks.to_string())
        .env("GIN_UNIQUE_ID", id)
        .stdin(Stdio::null())
        // A group of its own, so the rank can be stopped with everything
        // it started (and a Ctrl-C meant for the launcher reaches the
        // ranks through the launcher's stop, not all at once).
        .process_group(0);
    for (k, v) in &spec.env {
        cmd.env(k, v);
    }
    if spec.output != Output::Inherit {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    }
    cmd
}

/// The supervision loop's state: the fault still to inject, what has
/// happened, and when the ranks are to be stopped.
struct Supervisor<'a> {
    spec: &'a LaunchSpec,
    start: Instant,
    first_failure: Option<usize>,
    /// When every rank still running gets stopped.
    stop_at: Option<Instant>,
    /// The fault, until it is injected (or found moot).
    fault: Option<Fault>,
    fault_at: Option<Duration>,
    /// The rank the fault stopped (SIGSTOP), if it did.
    stopped_rank: Option<usize>,
    /// The launcher's own termination signal, once caught.
    interrupted: Option<libc::c_int>,
}

/// Watches the ranks until every one has ended: injects the fault when it is
/// due, reaps ranks as they end, and stops the rest after a failure (once the
/// grace has passed), at the limit, or when the launcher is interrupted.
fn supervise<'a>(spec: &'a LaunchSpec, start: Instant, ranks: &mut [Running]) -> Supervisor<'a> {
    let mut sup = Supervisor {
        spec,
        start,
        first_failure: None,
        stop_at: None,
        fault: spec.fault,
        fault_at: None,
        stopped_rank: None,
        interrupted: None,
    };
    let poll = Duration::from_millis(5);
    loop {
        sup.inject_due_fault(ranks);
        let running = sup.reap(ranks);
        if running == 0 {
            break;
        }
        let now = Instant::now();
        sup.update_stop_time(ranks, running, now);
        sup.signal_due(ranks, now);
        // Polling child status is the supervision loop itself, not a stand-in
        // for synchronisation: std offers no wait-for-any-child.
        thread::sleep(poll);
    }
    sup
}

impl Supervisor<'_> {
    /// Injects the fault once it is due, if its rank is still running.
    fn inject_due_fault(&mut self, ranks: &mut [Running]) {
        let start = self.start;
        if let Some(f) = self.fault.filter(|f| start.elapsed() >= f.after) {
            self.fault = None;
            if let Some(r) = ranks.get_mut(f.rank).filter(|r| r.exit.is_none()) {
                inject(r.pgid, f.kind);
                self.fault_at = Some(start.elapsed());
                if f.kind == FaultKind::Stop {
                    self.stopped_rank = Some(f.rank);
                }
            }
        }
    }

    /// Reaps every rank that has ended (killing what it left in its group),
    /// notes the first failure, and returns how many are still running.
    fn reap(&mut self, ranks: &mut [Running]) -> usize {
        let mut running = 0;
        for (rank, r) in ranks.iter_mut().enumerate() {
            if r.exit.is_some() || r.lost {
                continue;
            }
            match group::exited_unreaped(r.child.id()) {
                Ok(false) => {
                    running += 1;
                    continue;
                }
                Ok(true) => {
                    // The rank is over: what it left in its group goes too.
                    // Its pid still names the group until the reap below.
                    group::signal(r.pgid, group::SIGKILL);
                }
                Err(_) => {}
            }
            match r.child.try_wait() {
                Ok(Some(st)) => {
                    r.exit = Some(st);
                    r.ended = Some(self.start.elapsed());
                    if !st.success() && self.first_failure.is_none() {
                        self.first_failure = Some(rank);
                        self.stop_at = Some(Instant::now() + self.spec.grace);
                        tracing::warn!(rank, status = %describe_status(st), "rank failed; stopping the others after the grace period");
                    }
                }
                Ok(None) => running += 1,
                Err(_) => r.lost = true,
            }
        }
        running
    }

    /// Brings the stop forward to `now` when a stopped rank is all that is
    /// left, the limit has passed, or the launcher was interrupted.
    fn update_stop_time(&mut self, ranks: &[Running], running: usize, now: Instant) {
        // A stopped rank with nobody left to wait for it serves nothing:
        // end it now rather than after the grace period.
        if running == 1
            && self
                .stopped_rank
                .is_some_and(|v| ranks.get(v).is_some_and(|r| r.exit.is_none()))
        {
            self.stop_at = Some(self.stop_at.map_or(now, |t| t.min(now)));
        }
        let over_limit = self.spec.limit.is_some_and(|l| now >= self.start + l);
        if over_limit && self.stop_at.is_none() {
            self.stop_at = Some(now);
        }
        if let Some(sig) = group::Catch::caught() {
            if self.interrupted.is_none() {
                tracing::warn!(signal = sig, "launcher interrupted; stopping every rank");
                self.interrupted = Some(sig);
            }
            self.stop_at = Some(self.stop_at.map_or(now, |t| t.min(now)));
        }
    }

    /// Once the stop is due, sends SIGTERM to every running rank's group;
    /// sends SIGKILL to each group whose time after SIGTERM is up.
    fn signal_due(&self, ranks: &mut [Running], now: Instant) {
        if self.stop_at.is_some_and(|t| now >= t) {
            for r in ranks
                .iter_mut()
                .filter(|r| r.exit.is_none() && !r.lost && !r.stopped)
            {
                r.stopped = true;
                group::signal(r.pgid, group::SIGTERM);
                r.kill_at = Some(now + KILL_AFTER_TERM.min(self.spec.grace));
            }
        }
        for r in ranks.iter_mut().filter(|r| r.exit.is_none() && !r.lost) {
            if r.kill_at.is_some_and(|t| now >= t) {
                group::signal(r.pgid, group::SIGKILL);
                r.kill_at = None;
            }
        }
    }
}

/// Collects the `pumps` streams' captured output, (stdout, stderr) by rank.
/// Every group has been emptied, so the pipes reach end of file unless a
/// process escaped its group; this does not wait for that one for ever.
fn gather_output(
    out_rx: &mpsc::Receiver<PumpDone>,
    pumps: usize,
    nranks: usize,
) -> Vec<(String, String)> {
    let mut outputs: Vec<(String, String)> = vec![Default::default(); nranks];
    let drain_until = Instant::now() + OUTPUT_DRAIN;
    for _ in 0..pumps {
        let left = drain_until.saturating_duration_since(Instant::now());
        match out_rx.recv_timeout(left) {
            Ok((rank, is_err, text)) if is_err => outputs[rank].1 = text,
            Ok((rank, _, text)) => outputs[rank].0 = text,
            Err(_) => {
                tracing::warn!(
                    "a rank's output is still held open by a process that left its process group; not waiting for it"
                );
                break;
            }
        }
    }
    outputs
}

/// Kills or stops a rank's process group (wrapper scripts included).
fn inject(pgid: u32, kind: FaultKind) {
    group::signal(
        pgid,
        match kind {
            FaultKind::Kill => group::SIGKILL,
            FaultKind::Stop => group::SIGSTOP,
        },
    );
}

/// Copies a rank's stream line by line, prefixed, or captures it; at end of
/// file sends what it kept to `done`.
fn pump<R: Read + Send + 'static>(
    stream: R,
    rank: usize,
    capture: bool,
    is_err: bool,
    done: mpsc::Sender<PumpDone>,
) {
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
        let _ = done.send((rank, is_err, kept));
    });
}

/// The outcome of [`run_ranks`] in the process that called it.
#[derive(Debug)]
pub enum Role {
    /// This process is a rank: run the job.
    Rank,
    /// This process launched the ranks; they all succeeded.
    Launched,
}

/// Runs a program as every rank of a local job without a launcher: if a
/// launcher started this process (`GIN_*`, torchrun, Slurm or Open MPI
/// variables, see [`LaunchEnv`](crate::LaunchEnv)), returns
/// [`Role::Rank`]. Otherwise starts `n` ranks of this executable with the
/// same arguments through [`launch`] (output prefixed by rank), waits, and
/// returns [`Role::Launched`], or an error describing which ranks failed.
pub fn run_ranks(n: usize) -> Result<Role, String> {
    if crate::LaunchEnv::present(|k| std::env::var(k).ok()) {
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
