//! Which same-host peers look to blame when a wait times out: the part of a
//! job's health that the bootstrap's death watch cannot see.
//!
//! A rank that was stopped (SIGSTOP, a debugger, a frozen cgroup) keeps its
//! sockets open and its shared memory mapped: nothing in the job's traffic
//! says it is gone, so a wait on it can only time out. Its process state
//! says so, though. Every rank learns at creation the pid, start time, boot
//! id and pid namespace of each peer; after a timeout it reads the state of
//! the peers that share its kernel and pid namespace from `/proc` and names
//! those that are stopped or gone. Peers on other hosts (or in another pid
//! namespace) are not looked at: a pid means nothing there.
//!
//! This runs on the failure path only, never while waiting. The records are
//! the caller's to exchange (gin-core sends [`ProcessId`] in the host record
//! it allgathers while building a communicator).

use std::fmt::Write as _;

use crate::Bootstrap;

/// What identifies a process to a peer on the same kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessId {
    pid: u32,
    /// Clock ticks since boot at which it started (`/proc/PID/stat` field
    /// 22): tells a recycled pid from the rank's.
    start: u64,
    /// The kernel's boot id and the pid namespace: a pid only means the same
    /// process where both agree.
    kernel: String,
}

impl ProcessId {
    /// This process (fields that cannot be read stay empty: such a record
    /// is not looked at).
    pub fn own() -> Self {
        let pid = std::process::id();
        let start = read_stat(pid).map_or(0, |s| s.start);
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
        let ns = std::fs::read_link("/proc/self/ns/pid")
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default();
        Self {
            pid,
            start,
            kernel: format!("{}/{ns}", boot.trim()),
        }
    }

    /// Wire form: pid, start time, then the kernel identity.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = self.pid.to_le_bytes().to_vec();
        out.extend_from_slice(&self.start.to_le_bytes());
        out.extend_from_slice(self.kernel.as_bytes());
        out
    }

    /// `None` for a record too short to be one.
    pub fn decode(b: &[u8]) -> Option<Self> {
        let pid = u32::from_le_bytes(b.get(..4)?.try_into().ok()?);
        let start = u64::from_le_bytes(b.get(4..12)?.try_into().ok()?);
        let kernel = String::from_utf8_lossy(b.get(12..)?).into_owned();
        Some(Self { pid, start, kernel })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether `other` runs on this record's kernel and pid namespace, so
    /// that its pid names the same process here (never for records whose
    /// fields could not be read).
    pub fn near(&self, other: &Self) -> bool {
        !self.kernel.is_empty() && self.kernel == other.kernel && other.start != 0
    }

    /// Whether the process is gone: no such pid, a zombie, or the pid now
    /// names a process started later. Meaningful only for a record
    /// [`ProcessId::near`] this process.
    pub fn gone(&self) -> bool {
        match read_stat(self.pid) {
            None => true,
            Some(s) => matches!(s.state, 'Z' | 'X' | 'x') || s.start != self.start,
        }
    }
}

/// The fields of `/proc/PID/stat` this module reads.
struct Stat {
    state: char,
    start: u64,
}

fn read_stat(pid: u32) -> Option<Stat> {
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// The command name (field 2) may hold spaces and parentheses: the fields
/// after it start past its last `)`.
fn parse_stat(text: &str) -> Option<Stat> {
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    // After the state (field 3), the start time is field 22: 18 further on.
    let start = fields.nth(18)?.parse().ok()?;
    Some(Stat { state, start })
}

/// The peers whose process state can be read after a timeout: those on this
/// kernel and pid namespace.
#[derive(Debug, Clone)]
pub struct Liveness {
    /// (rank, process) of every other rank on this kernel and pid namespace.
    peers: Vec<(usize, ProcessId)>,
}

impl Liveness {
    /// From every rank's record (`None`: unreadable), as this rank sees them.
    pub fn new(rank: usize, all: &[Option<ProcessId>]) -> Self {
        let own = ProcessId::own();
        let peers = all
            .iter()
            .enumerate()
            .filter(|&(r, _)| r != rank)
            .filter_map(|(r, p)| Some((r, p.clone()?)))
            .filter(|(_, p)| own.near(p))
            .collect();
        Self { peers }
    }

    /// The pid of rank `rank` where it runs on this kernel and in this pid
    /// namespace (so that the pid names it here); `None` otherwise.
    pub fn pid(&self, rank: usize) -> Option<u32> {
        self.peers
            .iter()
            .find(|(r, _)| *r == rank)
            .map(|(_, p)| p.pid)
    }

    /// "rank 1 is stopped (SIGSTOP or a debugger); rank 3 exited", or
    /// `None` when every peer looked at is running.
    pub fn diagnose(&self) -> Option<String> {
        let mut out = String::new();
        for (rank, state) in self.look() {
            let _ = write!(
                out,
                "{}rank {rank} {state}",
                if out.is_empty() { "" } else { "; " },
            );
        }
        (!out.is_empty()).then_some(out)
    }

    /// Tells the job of each peer (`peer`, or every one looked at) that is
    /// stopped by a signal ([`Bootstrap::report_unresponsive`]): the
    /// caller's wait, as long as the job's timeout, timed out and it is
    /// about to fail, and the ranks waiting on it would otherwise name its
    /// departure, a symptom, rather than the stopped peer (`cargo xtask
    /// faults`, all-to-all over shm). Only a job-control stop (`T`, not a
    /// tracer's `t`: a debugger stepping a rank is not a dead rank) seen
    /// twice, 20 ms apart, counts. Failure path only (it sleeps).
    pub fn report_stopped(&self, bootstrap: &Bootstrap, peer: Option<usize>) {
        let first = self.stopped_now(peer);
        if first.is_empty() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
        for (p, state) in self.stopped_now(peer) {
            if first.iter().any(|(q, _)| *q == p) {
                bootstrap.report_unresponsive(
                    p,
                    &format!(
                        "rank {} found it stopped after a wait timed out: rank {p} {state}",
                        bootstrap.rank()
                    ),
                );
            }
        }
    }

    /// The peers (`peer`, or all) stopped by a signal now.
    fn stopped_now(&self, peer: Option<usize>) -> Vec<(usize, String)> {
        self.look()
            .into_iter()
            .filter(|(r, s)| s.signal_stop && peer.is_none_or(|p| p == *r))
            .map(|(r, s)| (r, s.to_string()))
            .collect()
    }

    /// The peers whose process is stopped, each with what its state says
    /// ("is stopped (SIGSTOP, a debugger or a frozen cgroup) (pid N)"). A
    /// stopped process answers nobody, so the caller may tell the whole job
    /// (`Bootstrap::report_unresponsive`); exits need no telling, the
    /// bootstrap's death watch sees them.
    pub fn stopped(&self) -> Vec<(usize, String)> {
        self.look()
            .into_iter()
            .filter(|(_, s)| s.stopped)
            .map(|(rank, s)| (rank, s.to_string()))
            .collect()
    }

    /// Every peer looked at that is not running, with its state.
    fn look(&self) -> Vec<(usize, PeerState)> {
        self.peers
            .iter()
            .filter_map(|(rank, p)| {
                let (stopped, signal_stop) = match read_stat(p.pid) {
                    Some(s) if s.start != p.start => (false, false),
                    None => (false, false),
                    Some(s) => match s.state {
                        'T' => (true, true),
                        't' => (true, false),
                        'Z' | 'X' | 'x' => (false, false),
                        _ => return None,
                    },
                };
                Some((
                    *rank,
                    PeerState {
                        stopped,
                        signal_stop,
                        pid: p.pid,
                    },
                ))
            })
            .collect()
    }
}

/// A peer process that is not running: stopped, or gone.
struct PeerState {
    stopped: bool,
    /// Stopped by a signal (`T`), not by a tracer (`t`).
    signal_stop: bool,
    pid: u32,
}

impl std::fmt::Display for PeerState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.stopped {
            write!(
                f,
                "is stopped (SIGSTOP, a debugger or a frozen cgroup) (pid {})",
                self.pid
            )
        } else {
            write!(f, "exited (pid {})", self.pid)
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::process::Command;

    #[test]
    fn stat_lines_with_odd_command_names_parse() {
        let line = "1234 (a) b (c)) T 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 987654 20 21";
        let s = parse_stat(line).unwrap();
        assert_eq!((s.state, s.start), ('T', 987_654));
        assert!(parse_stat("garbage").is_none());
    }

    #[test]
    fn records_survive_the_wire() {
        let own = ProcessId::own();
        assert!(own.start > 0 && !own.kernel.is_empty(), "{own:?}");
        assert_eq!(ProcessId::decode(&own.encode()), Some(own));
        assert_eq!(ProcessId::decode(&[1, 2, 3]), None);
    }

    /// A peer's pid is known where its record names this kernel and pid
    /// namespace, and not otherwise (nor for this rank, nor one unknown).
    #[test]
    fn a_near_peers_pid_is_known_and_a_far_ones_is_not() {
        let own = ProcessId::own();
        let near = ProcessId {
            pid: 4242,
            ..own.clone()
        };
        let far = ProcessId {
            pid: 4343,
            kernel: "another-boot/pid:[1]".into(),
            ..own.clone()
        };
        let live = Liveness::new(0, &[Some(own.clone()), Some(near), Some(far), None]);
        let pids: Vec<_> = (0..5).map(|r| live.pid(r)).collect();
        assert_eq!(pids, [None, Some(4242), None, None, None]);
    }

    /// A real child stands in for a peer: running, it is not named; stopped,
    /// it is; killed and reaped, it has exited.
    #[test]
    fn a_stopped_or_gone_peer_is_named_and_a_running_one_is_not() {
        let mut child = Command::new("sleep").arg("60").spawn().unwrap();
        let pid = child.id();
        let start = read_stat(pid).unwrap().start;
        let own = ProcessId::own();
        let peer = ProcessId {
            pid,
            start,
            kernel: own.kernel.clone(),
        };
        assert!(own.near(&peer) && !peer.gone());
        let live = Liveness::new(0, &[Some(own), Some(peer.clone())]);
        assert_eq!(live.diagnose(), None);
        assert!(live.stopped().is_empty());
        let stop = |sig: &str| {
            assert!(
                Command::new("kill")
                    .args([sig, &pid.to_string()])
                    .status()
                    .unwrap()
                    .success()
            );
        };
        stop("-STOP");
        // The state changes asynchronously to kill(2) returning; it is
        // visible once the kernel has delivered the signal.
        let mut said = None;
        for _ in 0..1000 {
            said = live.diagnose();
            if said.is_some() {
                break;
            }
            std::thread::yield_now();
        }
        let said = said.unwrap();
        assert!(said.contains("rank 1 is stopped"), "{said}");
        let stopped = live.stopped();
        assert_eq!(stopped.len(), 1, "{stopped:?}");
        assert_eq!(stopped[0].0, 1);
        assert!(
            stopped[0].1.contains(&format!("(pid {pid})")),
            "{stopped:?}"
        );
        child.kill().unwrap();
        child.wait().unwrap();
        let said = live.diagnose().unwrap();
        assert!(said.contains("rank 1 exited"), "{said}");
        // A gone peer is the death watch's news, not a stopped one.
        assert!(live.stopped().is_empty());
        assert!(peer.gone(), "a reaped child");
        // A pid reused by a later process is another process.
        let me = ProcessId::own();
        assert!(!me.gone());
        let later = ProcessId {
            start: me.start + 1,
            ..me.clone()
        };
        assert!(later.gone());
        assert_eq!(ProcessId::decode(&me.encode()), Some(me));
    }
}
