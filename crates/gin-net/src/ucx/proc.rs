//! Whether a peer's process is gone, for peers on this kernel (same boot
//! id and pid namespace): an owner waiting for a revocation's
//! acknowledgement takes a peer whose process died or exited for failed,
//! since it cannot write any more, even where the job's health is no
//! longer there to say so (a rank tearing down after a failure may have
//! dropped its job before its windows). A peer on another kernel is never
//! judged this way. A pid reused by another process is told apart by its
//! start time.

/// A process as `/proc` names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ProcId {
    /// The kernel's boot id and this process's pid namespace.
    kernel: String,
    pid: u32,
    /// Start time in clock ticks since boot (`/proc/PID/stat` field 22).
    start: u64,
}

impl ProcId {
    /// This process, if `/proc` says who it is.
    pub(super) fn mine() -> Option<Self> {
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
        let ns = std::fs::read_link("/proc/self/ns/pid").ok()?;
        let pid = std::process::id();
        let start = stat(pid)?.1;
        Some(Self {
            kernel: format!("{}/{}", boot.trim(), ns.display()),
            pid,
            start,
        })
    }

    /// As exchanged between ranks (empty: unknown).
    pub(super) fn encode(me: Option<&Self>) -> Vec<u8> {
        me.map_or_else(Vec::new, |m| {
            format!("{} {} {}", m.kernel, m.pid, m.start).into_bytes()
        })
    }

    /// A peer's record, if it is one.
    pub(super) fn decode(b: &[u8]) -> Option<Self> {
        let s = std::str::from_utf8(b).ok()?;
        let mut f = s.split(' ');
        let kernel = f.next()?.to_owned();
        let pid = f.next()?.parse().ok()?;
        let start = f.next()?.parse().ok()?;
        f.next().is_none().then_some(Self { kernel, pid, start })
    }

    /// The process id.
    pub(super) fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether `self` and `other` run on the same kernel and pid namespace
    /// (so `other`'s pid means the same here).
    pub(super) fn near(&self, other: &Self) -> bool {
        self.kernel == other.kernel
    }

    /// Whether the process is gone: no such pid, a zombie, or the pid now
    /// names a process started later.
    pub(super) fn gone(&self) -> bool {
        match stat(self.pid) {
            None => true,
            Some((state, start)) => matches!(state, 'Z' | 'X' | 'x') || start != self.start,
        }
    }
}

/// The state letter and start time of process `pid`.
fn stat(pid: u32) -> Option<(char, u64)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: fields resume
    // after the last ')'.
    let rest = &s[s.rfind(')')? + 1..];
    let mut f = rest.split_whitespace();
    let state = f.next()?.chars().next()?;
    // Fields 4..=21 lie between the state (3) and the start time (22).
    let start = f.nth(18)?.parse().ok()?;
    Some((state, start))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn this_process_is_alive_a_reaped_child_is_gone_and_records_round_trip() {
        let me = ProcId::mine().unwrap();
        assert!(!me.gone());
        assert_eq!(ProcId::decode(&ProcId::encode(Some(&me))), Some(me.clone()));
        assert!(ProcId::decode(b"").is_none());
        assert!(ProcId::decode(b"k 12").is_none());
        // A pid reused by a later process is another process.
        let later = ProcId {
            start: me.start + 1,
            ..me.clone()
        };
        assert!(later.gone());
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let start = stat(pid).map_or(0, |s| s.1);
        child.wait().unwrap();
        let it = ProcId {
            pid,
            start,
            ..me.clone()
        };
        assert!(it.gone(), "a reaped child");
        assert!(me.near(&it));
    }
}
