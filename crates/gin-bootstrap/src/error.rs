//! Errors: every variant names the rank that saw it and what it was waiting for.

use std::time::Duration;

use crate::frame::{FrameError, ReadError};

/// Everything that can go wrong in the bootstrap.
#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    /// A `GIN_UNIQUE_ID` (or other id text) that does not parse.
    #[error("invalid unique id {text:?}: {why}")]
    BadUniqueId { text: String, why: String },

    /// The launcher environment is missing or contradicts itself.
    #[error("cannot tell this process's rank from the environment: {0}")]
    Env(String),

    /// A rank or rank count that cannot be.
    #[error("invalid rank {rank} for a job of {nranks} ranks (ranks are 0..{nranks})")]
    BadRank { rank: usize, nranks: usize },

    /// A peer argument outside the job.
    #[error("rank {rank}: peer {peer} does not exist in a job of {nranks} ranks")]
    BadPeer {
        rank: usize,
        peer: usize,
        nranks: usize,
    },

    /// A collective's arguments differ from what it needs.
    #[error("rank {rank}: {op}: {why}")]
    BadArgument {
        rank: usize,
        op: &'static str,
        why: String,
    },

    /// The root refused this rank (duplicate rank, rank count mismatch...).
    #[error("rank {rank}: the bootstrap root at {root} refused to admit it: {reason}")]
    Refused {
        rank: usize,
        root: String,
        reason: String,
    },

    /// The rendezvous was abandoned by the root.
    #[error(
        "rank {rank}: bootstrap rendezvous aborted by the root: {reason}{}",
        missing_text(missing)
    )]
    Aborted {
        rank: usize,
        reason: String,
        missing: Vec<usize>,
    },

    /// A wait ran out of time.
    #[error(
        "rank {rank}: timed out after {waited:.1?} in {op} waiting for {what}{}",
        missing_text(missing)
    )]
    Timeout {
        rank: usize,
        op: String,
        what: String,
        waited: Duration,
        missing: Vec<usize>,
    },

    /// A peer vanished without an orderly goodbye.
    #[error("rank {rank}: {op} failed because rank {peer} died ({why})")]
    PeerDied {
        rank: usize,
        op: String,
        peer: usize,
        why: String,
    },

    /// A peer stopped draining its connections (a stopped or frozen process):
    /// a send to it could not complete within the timeout.
    #[error("rank {rank}: {op} failed because rank {peer} stopped responding ({why})")]
    PeerUnresponsive {
        rank: usize,
        op: String,
        peer: usize,
        why: String,
    },

    /// A peer left the job in order (its bootstrap said goodbye) while this
    /// rank still depended on the job: data-path waits that were not already
    /// satisfied fail with this, naming it.
    #[error("rank {rank}: {op} failed because rank {peer} exited (it left the job in order)")]
    PeerExited {
        rank: usize,
        op: String,
        peer: usize,
    },

    /// A peer closed its bootstrap before sending what was awaited.
    #[error(
        "rank {rank}: {op}: rank {peer} closed its bootstrap before sending the awaited message"
    )]
    PeerClosed {
        rank: usize,
        op: String,
        peer: usize,
    },

    /// The connection to the root was lost after the rendezvous.
    #[error("rank {rank}: {op} failed: lost the bootstrap root ({why})")]
    RootLost {
        rank: usize,
        op: String,
        why: String,
    },

    /// A malformed frame arrived.
    #[error("rank {}: malformed bootstrap frame from {from}: {source}", fmt_rank(*rank))]
    Frame {
        rank: Option<usize>,
        from: String,
        #[source]
        source: FrameError,
    },

    /// A socket failed.
    #[error("rank {}: {context}: {source}", fmt_rank(*rank))]
    Io {
        rank: Option<usize>,
        context: String,
        #[source]
        source: std::io::Error,
    },

    /// Failures of the local launcher.
    #[error("launch: {0}")]
    Launch(String),
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
