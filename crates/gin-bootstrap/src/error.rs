//! Errors: every variant names the rank that saw it and what it was waiting for.

use std::time::Duration;

use crate::frame::{FrameError, ReadError};

/// Everything that can go wrong in the bootstrap.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BootstrapError {
    /// A `GIN_UNIQUE_ID` (or other id text) that does not parse.
    #[error("invalid unique id {text:?}: {why}")]
    BadUniqueId {
        /// The text that was given.
        text: String,
        /// What is wrong with it.
        why: String,
    },

    /// The launcher environment is missing or contradicts itself.
    #[error("cannot tell this process's rank from the environment: {0}")]
    Env(String),

    /// A rank or rank count that cannot be.
    #[error("invalid rank {rank} for a job of {nranks} ranks (ranks are 0..{nranks})")]
    BadRank {
        /// The rank asked for.
        rank: usize,
        /// The rank count asked for.
        nranks: usize,
    },

    /// A peer argument outside the job.
    #[error("rank {rank}: peer {peer} does not exist in a job of {nranks} ranks")]
    BadPeer {
        /// The rank that made the call.
        rank: usize,
        /// The peer it named.
        peer: usize,
        /// The job's rank count.
        nranks: usize,
    },

    /// A collective's arguments differ from what it needs.
    #[error("rank {rank}: {op}: {why}")]
    BadArgument {
        /// The rank that made the call.
        rank: usize,
        /// The collective (for example `"alltoall"`).
        op: &'static str,
        /// What does not fit: sizes given and expected.
        why: String,
    },

    /// The root refused this rank (duplicate rank, rank count mismatch...).
    #[error("rank {rank}: the bootstrap root at {root} refused to admit it: {reason}")]
    Refused {
        /// The rank that asked to join.
        rank: usize,
        /// The root's address.
        root: String,
        /// The reason the root gave.
        reason: String,
    },

    /// The rendezvous was abandoned by the root.
    #[error(
        "rank {rank}: bootstrap rendezvous aborted by the root: {reason}{}",
        missing_text(missing)
    )]
    Aborted {
        /// The rank that was waiting for the rendezvous.
        rank: usize,
        /// Why the rendezvous was abandoned.
        reason: String,
        /// The ranks that never joined, when the root named them.
        missing: Vec<usize>,
    },

    /// A wait ran out of time.
    #[error(
        "rank {rank}: timed out after {waited:.1?} in {op} waiting for {what}{}",
        missing_text(missing)
    )]
    Timeout {
        /// The rank that waited.
        rank: usize,
        /// What the rank was doing (the operation).
        op: String,
        /// What it was waiting for.
        what: String,
        /// How long it waited.
        waited: Duration,
        /// The ranks that never answered, where the wait was on named ranks
        /// (empty otherwise).
        missing: Vec<usize>,
    },

    /// A peer vanished without an orderly goodbye.
    #[error("rank {rank}: {op} failed because rank {peer} died ({why})")]
    PeerDied {
        /// The rank that saw the failure.
        rank: usize,
        /// What the rank was doing (the operation).
        op: String,
        /// The peer that died.
        peer: usize,
        /// How its death showed (a closed connection, a failed send, the
        /// root's report).
        why: String,
    },

    /// A peer stopped draining its connections (a stopped or frozen process):
    /// a send to it could not complete within the timeout.
    #[error("rank {rank}: {op} failed because rank {peer} stopped responding ({why})")]
    PeerUnresponsive {
        /// The rank that saw the failure.
        rank: usize,
        /// What the rank was doing (the operation).
        op: String,
        /// The peer that stopped responding.
        peer: usize,
        /// How it showed (which send could not complete, and for how long).
        why: String,
    },

    /// A peer left the job in order (its bootstrap said goodbye) while this
    /// rank still depended on the job: data-path waits that were not already
    /// satisfied fail with this, naming it.
    #[error("rank {rank}: {op} failed because rank {peer} exited (it left the job in order)")]
    PeerExited {
        /// The rank that saw the failure.
        rank: usize,
        /// What the rank was doing (the operation).
        op: String,
        /// The peer that left.
        peer: usize,
    },

    /// A peer closed its bootstrap before sending what was awaited.
    #[error(
        "rank {rank}: {op}: rank {peer} closed its bootstrap before sending the awaited message"
    )]
    PeerClosed {
        /// The rank that was waiting.
        rank: usize,
        /// What the rank was doing (the operation).
        op: String,
        /// The peer whose message never came.
        peer: usize,
    },

    /// The connection to the root was lost after the rendezvous.
    #[error("rank {rank}: {op} failed: lost the bootstrap root ({why})")]
    RootLost {
        /// The rank that lost the root.
        rank: usize,
        /// What the rank was doing (the operation).
        op: String,
        /// How the connection was lost.
        why: String,
    },

    /// A malformed frame arrived.
    #[error("rank {}: malformed bootstrap frame from {from}: {source}", fmt_rank(*rank))]
    Frame {
        /// The rank that saw the frame, when known.
        rank: Option<usize>,
        /// Where the frame came from (or, for one this rank could not encode,
        /// where it was going).
        from: String,
        /// What is wrong with the frame.
        #[source]
        source: FrameError,
    },

    /// A socket (or another OS call) failed.
    #[error("rank {}: {context}: {source}", fmt_rank(*rank))]
    Io {
        /// The rank that saw the failure (`None` where no rank is involved:
        /// in the root, or while creating a [`UniqueId`](crate::UniqueId)).
        rank: Option<usize>,
        /// What was being done (for example `"setting a write timeout"`).
        context: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },

    /// Failures of the local launcher.
    #[error("launch: {0}")]
    Launch(String),

    /// A rank's record in a set-up exchange (its host record) has the
    /// wrong shape: the ranks run different builds, or memory was
    /// corrupted.
    #[error(transparent)]
    Record(#[from] crate::record::Malformed),
}

fn fmt_rank(r: Option<usize>) -> String {
    r.map_or_else(|| "?".to_owned(), |r| r.to_string())
}

fn missing_text(m: &[usize]) -> String {
    if m.is_empty() {
        String::new()
    } else {
        format!("; ranks that never answered: {m:?}")
    }
}

impl BootstrapError {
    pub(crate) fn from_read(rank: Option<usize>, from: &str, e: ReadError) -> Self {
        match e {
            ReadError::Io(source) => Self::Io {
                rank,
                context: format!("reading from {from}"),
                source,
            },
            ReadError::Frame(source) => Self::Frame {
                rank,
                from: from.to_owned(),
                source,
            },
        }
    }

    pub(crate) fn io(
        rank: Option<usize>,
        context: impl Into<String>,
        source: std::io::Error,
    ) -> Self {
        Self::Io {
            rank,
            context: context.into(),
            source,
        }
    }
}
