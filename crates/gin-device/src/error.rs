//! Errors of the device API. Each names the rank that raised it and the peer,
//! context, id, window, offset or size involved.

use std::time::Duration;

/// Everything a device-API call can fail with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GinError {
    /// A peer outside the job (or outside the window's ranks).
    #[error("rank {rank}: peer {peer} does not exist in a job of {nranks} ranks")]
    BadPeer {
        /// The rank that made the call.
        rank: usize,
        /// The peer it named.
        peer: usize,
        /// The rank count the peer was checked against.
        nranks: usize,
    },
    /// A context index past the communicator's contexts.
    #[error("rank {rank}: context {ctx} does not exist (this communicator has {nctx})")]
    BadContext {
        /// The rank that made the call.
        rank: usize,
        /// The context it named.
        ctx: u32,
        /// The communicator's context count.
        nctx: u32,
    },
    /// A signal id past the signals each context has.
    #[error(
        "rank {rank}: unknown signal id {id} (this communicator has {nsignals} signals per context)"
    )]
    UnknownSignal {
        /// The rank that made the call.
        rank: usize,
        /// The signal id it named.
        id: u32,
        /// Signals per context.
        nsignals: u32,
    },
    /// A counter id past the counters each context has.
    #[error(
        "rank {rank}: unknown counter id {id} (this communicator has {ncounters} counters per context)"
    )]
    UnknownCounter {
        /// The rank that made the call.
        rank: usize,
        /// The counter id it named.
        id: u32,
        /// Counters per context.
        ncounters: u32,
    },
    /// A byte range that does not lie within its owner's part of a window.
    #[error(
        "rank {rank}: {what}: {bytes} bytes at offset {offset} do not fit in window {window} of rank {owner} ({size} bytes)"
    )]
    OutOfWindow {
        /// The rank that made the call.
        rank: usize,
        /// The access (for example `"put destination"`, `"read"`).
        what: &'static str,
        /// The window's id.
        window: u32,
        /// The rank whose part the range was checked against.
        owner: usize,
        /// The range's start within that part.
        offset: u64,
        /// The range's length in bytes.
        bytes: u64,
        /// The size of that part in bytes.
        size: u64,
    },
    /// An offset that an 8-byte slot access needs aligned.
    #[error("rank {rank}: {what}: offset {offset} in window {window} is not {align}-byte aligned")]
    Misaligned {
        /// The rank that made the call.
        rank: usize,
        /// The access (`"signal"` or `"slot"`).
        what: &'static str,
        /// The window's id.
        window: u32,
        /// The offending offset.
        offset: u64,
        /// The alignment required, in bytes.
        align: u64,
    },
    /// An operation on a window this rank has deregistered.
    #[error("rank {rank}: window {window} was deregistered")]
    Deregistered {
        /// The rank that made the call.
        rank: usize,
        /// The window's id.
        window: u32,
    },
    /// The owner of the target part (the data's or the signal's) dropped or
    /// deregistered it: nothing of the operation was written.
    #[error(
        "rank {rank}: {what} of {bytes} bytes at offset {offset} of window {window} refused: rank {owner} dropped or deregistered its part"
    )]
    Refused {
        /// The rank that made the call.
        rank: usize,
        /// The operation (for example `"put"`).
        what: &'static str,
        /// The window's id.
        window: u32,
        /// The rank that dropped or deregistered its part.
        owner: usize,
        /// The offset within that part.
        offset: u64,
        /// The bytes the operation would have written or read.
        bytes: u64,
    },
    /// A window registered with a different communicator than the one used.
    #[error("rank {rank}: window {window} belongs to another communicator")]
    ForeignWindow {
        /// The rank that made the call.
        rank: usize,
        /// The window's id.
        window: u32,
    },
    /// A backend's thread could not be started (the OS refused it).
    #[error(
        "rank {rank}: could not start the {what}: {why} (is the process or its cgroup at its thread or memory limit?)"
    )]
    Spawn {
        /// The rank starting the thread.
        rank: usize,
        /// The thread (for example `"proxy thread"`).
        what: &'static str,
        /// The OS error.
        why: String,
    },
    /// An operation this communicator, its requirements or its backend do
    /// not allow (a peer off the rail, a barrier not asked for, a VA signal
    /// not asked for...).
    #[error("rank {rank}: {what} is not supported here: {why}")]
    Unsupported {
        /// The rank that made the call.
        rank: usize,
        /// The feature or operation.
        what: &'static str,
        /// Why it is not available.
        why: String,
    },
    /// A wait ran past the communicator's timeout.
    #[error(
        "rank {rank}: timed out after {waited:.1?} waiting for {what} on context {ctx}{}: last value {last}, expected {expected}{}",
        peer.map(|p| format!(" (peer {p})")).unwrap_or_default(),
        if suspects.is_empty() { String::new() } else { format!("; {suspects}") }
    )]
    Timeout {
        /// The rank that waited.
        rank: usize,
        /// The context it waited on.
        ctx: u32,
        /// The peer the awaited operations went to, when one is known.
        peer: Option<usize>,
        /// What it waited for (a signal, a counter, a barrier arrival, a
        /// flush's local completion).
        what: String,
        /// The last value seen (0 for a flush).
        last: u64,
        /// The value waited for (1 for a flush).
        expected: u64,
        /// How long it waited.
        waited: Duration,
        /// Peers that look to blame, from [`crate::Health::diagnose`]
        /// (e.g. "rank 1 is stopped"); empty when none is known.
        suspects: String,
    },
    /// A wait gave up because the host set the abort flag.
    #[error(
        "rank {rank}: wait for {what} on context {ctx} aborted by the abort flag (last value {last}, expected {expected})"
    )]
    Aborted {
        /// The rank that waited.
        rank: usize,
        /// The context it waited on.
        ctx: u32,
        /// What it waited for.
        what: String,
        /// The last value seen.
        last: u64,
        /// The value waited for.
        expected: u64,
    },
    /// A backend failed to carry out operations (a failed completion, a
    /// broken link, a corrupt descriptor).
    #[error("rank {rank}: {what} on context {ctx} failed: {why}")]
    Failed {
        /// The rank whose operations failed.
        rank: usize,
        /// The context they were issued on.
        ctx: u32,
        /// What failed.
        what: String,
        /// The backend's account of the failure.
        why: String,
    },
    /// A peer failed.
    #[error("rank {rank}: peer {peer} failed: {why}")]
    PeerFailed {
        /// The rank that saw the failure.
        rank: usize,
        /// The peer that failed.
        peer: usize,
        /// How the failure showed.
        why: String,
    },
    /// The job-level liveness check failed: a rank died, stopped responding
    /// or left (see [`crate::Health`]).
    #[error("rank {rank}: the job is broken: {why}")]
    JobFailed {
        /// The rank that saw the failure.
        rank: usize,
        /// The liveness check's message, naming the rank at fault.
        why: String,
    },
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
