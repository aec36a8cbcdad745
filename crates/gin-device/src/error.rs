//! Errors of the device API. Each names the rank that raised it and the peer,
//! context, id, window, offset or size involved.

use std::time::Duration;

/// Everything a device-API call can fail with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GinError {
    #[error("rank {rank}: peer {peer} does not exist in a job of {nranks} ranks")]
    BadPeer {
        rank: usize,
        peer: usize,
        nranks: usize,
    },
    #[error("rank {rank}: context {ctx} does not exist (this communicator has {nctx})")]
    BadContext { rank: usize, ctx: u32, nctx: u32 },
    #[error(
        "rank {rank}: unknown signal id {id} (this communicator has {nsignals} signals per context)"
    )]
    UnknownSignal { rank: usize, id: u32, nsignals: u32 },
    #[error(
        "rank {rank}: unknown counter id {id} (this communicator has {ncounters} counters per context)"
    )]
    UnknownCounter {
        rank: usize,
        id: u32,
        ncounters: u32,
    },
    #[error(
        "rank {rank}: {what}: {bytes} bytes at offset {offset} do not fit in window {window} of rank {owner} ({size} bytes)"
    )]
    OutOfWindow {
        rank: usize,
        what: &'static str,
        window: u32,
        owner: usize,
        offset: u64,
        bytes: u64,
        size: u64,
    },
    #[error("rank {rank}: {what}: offset {offset} in window {window} is not {align}-byte aligned")]
    Misaligned {
        rank: usize,
        what: &'static str,
        window: u32,
        offset: u64,
        align: u64,
    },
    #[error("rank {rank}: window {window} was deregistered")]
    Deregistered { rank: usize, window: u32 },
    /// The owner of the target part (the data's or the signal's) dropped or
    /// deregistered it: nothing of the operation was written.
    #[error(
        "rank {rank}: {what} of {bytes} bytes at offset {offset} of window {window} refused: rank {owner} dropped or deregistered its part"
    )]
    Refused {
        rank: usize,
        what: &'static str,
        window: u32,
        owner: usize,
        offset: u64,
        bytes: u64,
    },
    #[error("rank {rank}: window {window} belongs to another communicator")]
    ForeignWindow { rank: usize, window: u32 },
    /// A backend's thread could not be started (the OS refused it).
    #[error(
        "rank {rank}: could not start the {what}: {why} (is the process or its cgroup at its thread or memory limit?)"
    )]
    Spawn {
        rank: usize,
        what: &'static str,
        why: String,
    },
    #[error("rank {rank}: {what} is not supported here: {why}")]
    Unsupported {
        rank: usize,
        what: &'static str,
        why: String,
    },
    #[error(
        "rank {rank}: timed out after {waited:.1?} waiting for {what} on context {ctx}{}: last value {last}, expected {expected}{}",
        peer.map(|p| format!(" (peer {p})")).unwrap_or_default(),
        if suspects.is_empty() { String::new() } else { format!("; {suspects}") }
    )]
    Timeout {
        rank: usize,
        ctx: u32,
        peer: Option<usize>,
        what: String,
        last: u64,
        expected: u64,
        waited: Duration,
        /// Peers that look to blame, from [`crate::Health::diagnose`]
        /// (e.g. "rank 1 is stopped"); empty when none is known.
        suspects: String,
    },
    #[error(
        "rank {rank}: wait for {what} on context {ctx} aborted by the abort flag (last value {last}, expected {expected})"
    )]
    Aborted {
        rank: usize,
        ctx: u32,
        what: String,
        last: u64,
        expected: u64,
    },
    #[error("rank {rank}: {what} on context {ctx} failed: {why}")]
    Failed {
        rank: usize,
        ctx: u32,
        what: String,
        why: String,
    },
    #[error("rank {rank}: peer {peer} failed: {why}")]
    PeerFailed {
        rank: usize,
        peer: usize,
        why: String,
    },
    #[error("rank {rank}: the job is broken: {why}")]
    JobFailed { rank: usize, why: String },
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A thread the OS refused is named as such, with the likely cause, not
    /// as a feature "not supported here". (Provoking the refusal needs a
    /// thread limit that root, which CI runs as, does not obey.)
    #[test]
    fn a_refused_thread_reads_as_a_limit_not_as_unsupported() {
        let e = GinError::Spawn {
            rank: 3,
            what: "proxy thread",
            why: std::io::Error::from_raw_os_error(11).to_string(),
        }
        .to_string();
        assert!(
            e.starts_with(
                "rank 3: could not start the proxy thread: Resource temporarily unavailable"
            ) && e.contains("thread or memory limit")
                && !e.contains("not supported"),
            "{e}"
        );
    }
}
