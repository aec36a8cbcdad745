//! gin-net: the fabric under both backends — NCCL's net/RMA plugin layer.
//!
//! # Design
//!
//! - **Regions** ([`region::RegionTable`]): memory remote peers may access,
//!   named by random 32-bit keys; every remote request is checked for key,
//!   rights, bounds and alignment at the target (defence in depth: the
//!   initiator checked too).
//! - **shm** ([`shm::Segment`]): same-host peers map each other's segments;
//!   one-sided operations are then plain copies and atomics on the mapping,
//!   with release ordering on the atomic that publishes data. Segments are
//!   owner-only, their pages reserved at creation (no SIGBUS on a full
//!   tmpfs), their names removed as soon as registration is over. A header
//!   page holds the owner's revocation word: a peer's mapping outlives the
//!   owner's interest, so the word, not the mapping, says whether the owner
//!   still serves the segment, and the shm paths refuse data and signals
//!   for a revoked one.
//! - **tcp** ([`tcp::TcpTransport`]): any host. Each rank serves its regions;
//!   one ordered connection per pair of ranks makes "signal after data"
//!   hold by construction. Errors come back as answers, not silence, and are
//!   sticky on the link until reported. No send blocks past the job's
//!   timeout on a peer that stopped reading; the error names that peer.
//! - Endpoint addresses are exchanged through gin-bootstrap; transport
//!   connections authenticate with a token derived from the job secret.
//!
//! # What it does not know
//!
//! Windows, signals, contexts and descriptor or WQE formats belong to the
//! layers above; gin-net moves bytes and performs atomics on keyed memory.

#![deny(unsafe_op_in_unsafe_fn)]

pub mod fabric;
pub mod idle;
pub mod region;
pub mod shm;
pub mod sticky;
pub mod tcp;

pub use fabric::{Addr, Fabric, KeepAlive, MemDesc, Path};

use std::time::Duration;

/// Fabric errors.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Invalid(String),
    #[error("rank {peer}: {why}")]
    Remote { peer: usize, why: String },
    #[error("rank {peer}: timed out after {waited:.1?} waiting for {what}")]
    Timeout {
        peer: usize,
        what: String,
        waited: Duration,
    },
    #[error(transparent)]
    Bootstrap(#[from] gin_bootstrap::BootstrapError),
}
