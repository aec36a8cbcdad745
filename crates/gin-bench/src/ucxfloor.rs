//! The raw UCX floor: `ucx_perftest` from the same UCX library the ranks
//! load, run as two local processes (a server beside rank 1, a client
//! beside rank 0, talking over rank 1's bootstrap address) with the ranks'
//! environment, so the same `UCX_TLS` and every other `UCX_*` setting.
//!
//! Why the tool and not the UCP calls driven here: gin-net's UCP bindings
//! are private to its `ucx` module, and `ucx_perftest` is the reference
//! every UCX user already trusts (the issue names `ucp_put_lat` /
//! `ucp_put_bw`). Each child inherits the spawning rank thread's CPU
//! binding, so the floor runs where the rank runs.
//!
//! The server's port is picked afresh for each run, just before the server
//! starts, and sent to rank 0 in the run's one collective. A server that
//! exits before listening (its port taken meanwhile by another process on a
//! shared machine: seen once as exit status 255) is started again on a
//! fresh port, up to [`SERVE_ATTEMPTS`] times; the error after the last
//! names every port tried and what each server printed, and reaches rank 0
//! too, which would otherwise wait for a server that never came.
//!
//! The children also get the tcp segment sizes gin-net's contexts set
//! (`gin_net::ucx::TCP_SEGMENTS`, unless the environment sets its own), so
//! the floor and the ranks run UCX's tcp with one configuration.
//!
//! What it measures, and why it is a lower bound of the gin-rs figure:
//! - `ucp_put_lat -s SIZE`: put ping-pong, each side polling the last byte
//!   of its buffer; the 50th percentile of half round trips. gin-rs sends
//!   a put and a signal per message (one active message up to
//!   `GIN_UCX_AM_MAX`, else a put, a fence and an atomic), so it does more.
//! - `ucp_put_bw -s SIZE -O WINDOW`: puts of one buffer with at most
//!   `WINDOW` outstanding (a sliding window, never drained between windows
//!   as gin-bench's per-window flush drains), timed at the sender until the
//!   last put completes, with no acknowledgement from the receiver; the
//!   overall time per put. It rewrites one buffer where gin-bench's window
//!   writes distinct slots (a smaller footprint, kinder to caches). Every
//!   difference makes the floor faster. A bidirectional point's floor is
//!   the one-way time for the same messages per direction.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use gin_core::Comm;
use gin_net::ucx::TCP_SEGMENTS;

/// A `ucx_perftest` test the floor runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Test {
    /// `ucp_put_lat`: half round trips.
    PutLat,
    /// `ucp_put_bw -O outstanding`.
    PutBw {
        /// Puts in flight (`-O`).
        outstanding: usize,
    },
}

/// How many fresh ports rank 1 tries before the floor fails.
pub const SERVE_ATTEMPTS: usize = 4;

/// Where `ucx_perftest` and its libraries are, and rank 1's address.
#[derive(Debug, Clone)]
pub struct UcxPerf {
    bin: PathBuf,
    libdir: Option<PathBuf>,
    /// Rank 1's bootstrap address (the client connects there).
    server_ip: String,
    timeout: Duration,
}

/// The tool: `GIN_UCX_BIN/ucx_perftest`, else `bin/ucx_perftest` beside the
/// `lib/` of `GIN_UCX_LIB`, else `ucx_perftest` on `PATH`; and the folder
/// of `GIN_UCX_LIB` for the child's `LD_LIBRARY_PATH`.
pub fn locate() -> Result<(PathBuf, Option<PathBuf>), String> {
    let lib = std::env::var_os("GIN_UCX_LIB").map(PathBuf::from);
    let libdir = lib.as_deref().and_then(Path::parent).map(Path::to_path_buf);
    let mut tried = Vec::new();
    if let Some(d) = std::env::var_os("GIN_UCX_BIN") {
        tried.push(PathBuf::from(d).join("ucx_perftest"));
    }
    if let Some(d) = &libdir {
        tried.push(d.join("..").join("bin").join("ucx_perftest"));
    }
    if let Some(p) = std::env::var_os("PATH") {
        tried.extend(std::env::split_paths(&p).map(|d| d.join("ucx_perftest")));
    }
    match tried.iter().find(|p| p.is_file()) {
        Some(p) => Ok((p.clone(), libdir)),
        None => Err(format!(
            "no ucx_perftest (set GIN_UCX_BIN; tried GIN_UCX_BIN, GIN_UCX_LIB/../bin and PATH: {})",
            tried
                .iter()
                .take(3)
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )),
    }
}

/// Collective over every rank: finds the tool on ranks 0 and 1 and rank
/// 1's address. Fails on every rank, saying why, when rank 0 or 1 lacks
/// the tool: a ucx figure without its floor is not reported.
pub fn setup(comm: &Comm) -> Result<UcxPerf> {
    let r = comm.rank();
    let found = if r <= 1 { locate() } else { Err(String::new()) };
    let ip = comm.bootstrap().listen_addr().ip().to_string();
    let mine = match (&found, r) {
        (Ok(_), 0 | 1) => format!("ok {ip}"),
        (Err(why), 0 | 1) => format!("rank {r}: {why}"),
        _ => String::new(),
    };
    let all = comm.bootstrap().allgather(mine.as_bytes())?;
    let text = |i: usize| String::from_utf8_lossy(all.get(i).map_or(&[][..], |v| v)).into_owned();
    let (t0, t1) = (text(0), text(1));
    if let Some(why) = [&t0, &t1].into_iter().find(|t| !t.starts_with("ok ")) {
        bail!("the ucx floor needs ucx_perftest from the same UCX: {why}");
    }
    let mut f = t1.split_whitespace().skip(1);
    let server_ip = f.next().context("rank 1 sent no address")?.to_owned();
    let (bin, libdir) = match found {
        Ok(f) => f,
        // Ranks past 1 never run the tool.
        Err(_) => (PathBuf::new(), None),
    };
    Ok(UcxPerf {
        bin,
        libdir,
        server_ip,
        timeout: comm.timeout(),
    })
}

impl UcxPerf {
    fn command(&self) -> Command {
        let mut c = Command::new(&self.bin);
        // The ranks' UCX contexts set UCX's tcp segment sizes unless the
        // environment sets them (gin-net's `ucx::TCP_SEGMENTS`): the
        // floor runs with the same, so it measures the same UCX transport.
        let own = TCP_SEGMENTS
            .iter()
            .any(|(n, _)| std::env::var_os(format!("UCX_{n}")).is_some());
        if !own {
            for (n, v) in TCP_SEGMENTS {
                c.env(format!("UCX_{n}"), v);
            }
        }
        if let Some(d) = &self.libdir {
            let mut paths = vec![d.clone()];
            if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
                paths.extend(std::env::split_paths(&old));
            }
            if let Ok(joined) = std::env::join_paths(paths) {
                c.env("LD_LIBRARY_PATH", joined);
            }
        }
        c
    }

    /// Collective over every rank: one run of `test` between rank 0 and
    /// rank 1. The server beside rank 1 listens before the run's collective
    /// (an allgather carrying its port, or why it could not start), the
    /// client beside rank 0 runs after it. Rank 0 returns the client's µs
    /// per half round trip (latency) or per put (bandwidth); other ranks
    /// NaN. A server that could not start fails ranks 0 and 1 alike.
    pub fn run(
        &self,
        comm: &Comm,
        test: Test,
        size: u64,
        (warm, iters): (usize, usize),
    ) -> Result<f64> {
        let r = comm.rank();
        let (mut server, mine) = match r {
            1 => match self.serve() {
                Ok(s) => {
                    let port = s.port;
                    (Some(s), format!("ok {port}"))
                }
                Err(e) => (None, format!("{e:#}")),
            },
            _ => (None, String::new()),
        };
        let all = comm.bootstrap().allgather(mine.as_bytes())?;
        let t1 = String::from_utf8_lossy(all.get(1).map_or(&[][..], |v| v)).into_owned();
        let port = match t1.strip_prefix("ok ").map(str::parse::<u16>) {
            Some(Ok(p)) => p,
            _ if r <= 1 => bail!("the ucx floor could not run: {t1}"),
            _ => return Ok(f64::NAN),
        };
        let us = if r == 0 {
            self.client(port, test, size, warm, iters)?
        } else {
            f64::NAN
        };
        if let Some(s) = &mut server {
            let (status, _, err) = s.finish()?;
            if !status.success() {
                bail!(
                    "rank 1: the ucx_perftest server failed ({status}): {}",
                    err.trim()
                );
            }
        }
        Ok(us)
    }

    /// Rank 1: starts the server on a fresh port and returns once it
    /// listens, trying [`SERVE_ATTEMPTS`] fresh ports while servers exit
    /// before listening.
    fn serve(&self) -> Result<Server> {
        let fresh = || -> Result<u16> {
            // A free port now; the server binds it (SO_REUSEADDR) at once.
            Ok(std::net::TcpListener::bind(("0.0.0.0", 0))?
                .local_addr()?
                .port())
        };
        on_fresh_ports(SERVE_ATTEMPTS, fresh, |port| self.serve_on(port))
    }

    /// One attempt: the server on `port`, listening, or how it exited
    /// before it listened.
    fn serve_on(&self, port: u16) -> Result<Started<Server>> {
        let child = self
            .command()
            .args(["-p", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {}", self.bin.display()))?;
        let mut server = Server {
            child: Some(child),
            limit: self.timeout + Duration::from_secs(600),
            port,
        };
        let start = Instant::now();
        while !listening(port) {
            if server.try_exit()?.is_some() {
                let (status, _, err) = server.finish()?;
                return Ok(Started::Exited(format!("{status}: {}", err.trim())));
            }
            if start.elapsed() > self.timeout {
                bail!(
                    "rank 1: the ucx_perftest server did not listen on port {port} within {:?}",
                    self.timeout
                );
            }
            // Polling a child that has no readiness signal but its socket.
            std::thread::sleep(Duration::from_millis(2));
        }
        Ok(Started::Listening(server))
    }

    /// Rank 0: runs the client; µs per half round trip (latency) or per put
    /// (bandwidth).
    fn client(&self, port: u16, test: Test, size: u64, warm: usize, iters: usize) -> Result<f64> {
        let mut c = self.command();
        c.args([
            self.server_ip.as_str(),
            "-p",
            &port.to_string(),
            "-s",
            &size.to_string(),
            "-n",
            &iters.max(1).to_string(),
            "-w",
            &warm.to_string(),
            "-f",
        ]);
        match test {
            Test::PutLat => c.args(["-t", "ucp_put_lat"]),
            Test::PutBw { outstanding } => {
                c.args(["-t", "ucp_put_bw", "-O", &outstanding.max(1).to_string()])
            }
        };
        let child = c
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {}", self.bin.display()))?;
        let mut run = Server {
            child: Some(child),
            limit: self.timeout + Duration::from_secs(600),
            port,
        };
        let (status, out, err) = run.finish()?;
        if !status.success() {
            bail!(
                "rank 0: ucx_perftest {test:?} at {size} B failed ({status}): {}",
                err.trim()
            );
        }
        parse(&out, test).with_context(|| {
            format!("rank 0: ucx_perftest {test:?} at {size} B printed no result: {out}{err}")
        })
    }
}

/// How one attempt to start a server ended.
#[derive(Debug)]
enum Started<S> {
    /// It listens.
    Listening(S),
    /// It exited before listening: its status and what it printed.
    Exited(String),
}

/// Starts a server on a fresh port from `fresh` until one listens, at most
/// `attempts` times (another process may take a port between its choice
/// and the server's bind). Fails at once on an error of `fresh` or
/// `start`; after `attempts` early exits, names every port and how its
/// server exited.
fn on_fresh_ports<S>(
    attempts: usize,
    mut fresh: impl FnMut() -> Result<u16>,
    mut start: impl FnMut(u16) -> Result<Started<S>>,
) -> Result<S> {
    let mut exits = Vec::new();
    for _ in 0..attempts.max(1) {
        let port = fresh().context("rank 1: choosing a port for the ucx_perftest server")?;
        match start(port)? {
            Started::Listening(s) => return Ok(s),
            Started::Exited(why) => exits.push(format!("port {port}: {why}")),
        }
    }
    bail!(
        "rank 1: the ucx_perftest server exited before listening on each of {} fresh ports ({})",
        exits.len(),
        exits.join("; ")
    )
}

/// Whether something listens on TCP `port` here (`/proc/net/tcp{,6}`).
fn listening(port: u16) -> bool {
    let want = format!(":{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|f| {
        std::fs::read_to_string(f).is_ok_and(|t| {
            t.lines().skip(1).any(|l| {
                let mut c = l.split_whitespace();
                let local = c.nth(1).unwrap_or("");
                let state = c.nth(1).unwrap_or("");
                local.ends_with(&want) && state == "0A"
            })
        })
    })
}

/// The figure from `ucx_perftest -f`'s result line: iterations, then
/// latency (or overhead) 50th percentile, average and overall µs, then
/// bandwidth and message rate. Latency tests give the median half round
/// trip; bandwidth tests the overall µs per put.
pub fn parse(out: &str, test: Test) -> Option<f64> {
    let nums: Vec<f64> = out.lines().rev().find_map(|l| {
        let v: Vec<f64> = l
            .split_whitespace()
            .filter(|w| *w != "Final:")
            .map(str::parse)
            .collect::<Result<_, _>>()
            .ok()?;
        (v.len() >= 8).then_some(v)
    })?;
    let v = match test {
        Test::PutLat => nums[1],
        Test::PutBw { .. } => nums[3],
    };
    (v.is_finite() && v > 0.0).then_some(v)
}

/// A `ucx_perftest` process this rank started; killed if dropped running.
#[derive(Debug)]
pub struct Server {
    child: Option<Child>,
    limit: Duration,
    /// The port it was started with.
    port: u16,
}

impl Server {
    fn try_exit(&mut self) -> Result<Option<std::process::ExitStatus>> {
        match &mut self.child {
            Some(c) => Ok(c.try_wait()?),
            None => bail!("ucx_perftest was already waited for"),
        }
    }

    /// Waits for the process (at most the limit, then kills it): status,
    /// stdout, stderr.
    pub fn finish(&mut self) -> Result<(std::process::ExitStatus, String, String)> {
        let start = Instant::now();
        let mut child = self
            .child
            .take()
            .context("ucx_perftest was already waited for")?;
        let status = loop {
            if let Some(st) = child.try_wait()? {
                break st;
            }
            if start.elapsed() > self.limit {
                let _ = child.kill();
                let _ = child.wait();
                bail!("ucx_perftest ran past {:?} and was killed", self.limit);
            }
            // std has no wait with a deadline for a child: poll its status.
            std::thread::sleep(Duration::from_millis(1));
        };
        let mut out = String::new();
        let mut err = String::new();
        if let Some(mut s) = child.stdout.take() {
            s.read_to_string(&mut out)?;
        }
        if let Some(mut s) = child.stderr.take() {
            s.read_to_string(&mut err)?;
        }
        Ok((status, out, err))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OUT: &str = "+----+\n|  Test | # iterations |\n+----+\n                        2000      6.001   169.863   303.626        0.04       0.03        5887        3294\n";

    #[test]
    fn the_result_line_gives_the_median_or_the_overall_time() {
        assert_eq!(parse(OUT, Test::PutLat), Some(6.001));
        assert_eq!(parse(OUT, Test::PutBw { outstanding: 16 }), Some(303.626));
        let fin = "Final:                 10000      6.005    61.212    79.066        0.12       0.10       16337       12648\n";
        assert_eq!(parse(fin, Test::PutLat), Some(6.005));
        assert_eq!(parse("+---+\n| x |\n", Test::PutLat), None);
        assert_eq!(parse("", Test::PutLat), None);
    }

    /// A server that exits before listening (its port taken meanwhile) is
    /// started again on a fresh port; the first to listen is kept.
    #[test]
    fn a_server_that_exits_before_listening_is_retried_on_a_fresh_port() {
        let mut ports = 40000..;
        let mut tried = Vec::new();
        let got = on_fresh_ports(
            SERVE_ATTEMPTS,
            || Ok(ports.next().unwrap()),
            |port| {
                tried.push(port);
                Ok(if port < 40002 {
                    Started::Exited("exit status: 255: bind failed".into())
                } else {
                    Started::Listening(port)
                })
            },
        )
        .unwrap();
        assert_eq!(got, 40002);
        assert_eq!(tried, [40000, 40001, 40002]);
    }

    /// After as many early exits as attempts, the error names each port
    /// and how its server exited; nothing more is started.
    #[test]
    fn servers_exiting_on_every_port_fail_naming_each() {
        let mut ports = 50000..;
        let mut started = 0;
        let e = on_fresh_ports(
            3,
            || Ok(ports.next().unwrap()),
            |port| {
                started += 1;
                Ok(Started::<()>::Exited(format!(
                    "exit status: 255: no {port}"
                )))
            },
        )
        .unwrap_err()
        .to_string();
        assert_eq!(started, 3);
        assert_eq!(
            e,
            "rank 1: the ucx_perftest server exited before listening on each of 3 fresh ports \
             (port 50000: exit status: 255: no 50000; port 50001: exit status: 255: no 50001; \
             port 50002: exit status: 255: no 50002)"
        );
    }

    /// An error that is not an early exit (the tool cannot be started) is
    /// not retried.
    #[test]
    fn an_error_starting_the_server_is_not_retried() {
        let mut started = 0;
        let e = on_fresh_ports(
            3,
            || Ok(1),
            |_| -> Result<Started<()>> {
                started += 1;
                bail!("starting ucx_perftest: no such file")
            },
        )
        .unwrap_err();
        assert_eq!(started, 1);
        assert!(e.to_string().contains("no such file"), "{e}");
    }
}
