//! gin-bootstrap: how the ranks of a gin-rs job find each other and exchange
//! the small host-side messages the backends need before any one-sided traffic
//! can flow (window addresses, keys, queue numbers).
//!
//! # Design
//!
//! - **Rendezvous.** A job is named by a [`UniqueId`]: the root's socket address
//!   and a random 128-bit secret. Each rank dials the root, proves the secret by
//!   answering a challenge with a keyed hash (the secret never crosses the
//!   wire), and announces the address it listens on. When all ranks are in,
//!   the root sends everyone the address table.
//! - **Death watch.** Ranks keep their root connection for the life of the job.
//!   One that drops it without a goodbye has died; the root tells the others,
//!   so every pending and later call fails with an error naming that rank
//!   instead of hanging (NCCL's bootstrap can hang here; this one must not).
//!   A rank that stops draining its sockets (a stopped or frozen process) is
//!   found by a send that cannot finish within the timeout; the sender tells
//!   the root, which tells everyone, so all ranks name the frozen one.
//!   An orderly departure (a goodbye) is relayed too: the bootstrap's own
//!   calls go on between the ranks still present, but
//!   [`Bootstrap::health`], which data-path waits poll, then fails naming
//!   the rank that left, so same-host peers with no socket of their own to
//!   it notice within milliseconds.
//! - **Point to point.** Rank `a` sends to `b` over a connection `a` dials on
//!   first use; a reader thread per incoming connection files messages into
//!   per-peer mailboxes, matched by tag. Writers never wait for readers.
//! - **Collectives** are built on that: ring allgather (n − 1 steps), full-mesh
//!   all-to-all (fixed and variable sizes), binomial broadcast, dissemination
//!   barrier. Every blocking call honours [`Config::timeout`] (`GIN_TIMEOUT`),
//!   and its error names the ranks it was waiting for.
//! - **Topology** ([`topology`]): one exchange of host ids (`GIN_HOSTID`,
//!   else hostname and boot id) and process identities tells every rank
//!   which ranks share its host, its local index and its rail.
//! - **Liveness** ([`liveness`]): a rank that was stopped (SIGSTOP, a
//!   debugger, a frozen cgroup) keeps its sockets open, so the death watch
//!   cannot see it; after a timeout, the process state of same-host peers
//!   (from `/proc`, by pid, start time, boot id and pid namespace) names the
//!   stopped or gone ones.
//! - **Records** ([`record`]): the small codec for what ranks allgather
//!   (window parts, host ids, placements); decoding checks the shape and
//!   names the rank that sent a malformed record. [`Bootstrap::agree`]
//!   ([`agree`]) is the collective for values every rank must give alike:
//!   every rank fails with the same error naming the field and who gave
//!   what.
//! - **Frames** ([`frame`]) are length-prefixed and versioned; lengths are
//!   checked before allocation and payloads read in bounded chunks.
//! - **Launch.** [`launch()`] starts N local rank processes with the `GIN_*`
//!   variables set, hosts the root itself, prefixes output by rank and stops the
//!   job when a rank fails. Each rank is a process group, stopped as a whole
//!   (SIGTERM, then SIGKILL), so wrapper scripts and their children go too; the
//!   only `unsafe` in the crate is the few libc calls that needs. [`LaunchEnv`]
//!   reads a rank's identity from `GIN_*`, torchrun, Slurm or Open MPI
//!   variables; [`run_ranks`] lets a program be a rank under a launcher or
//!   start its own local ranks.
//! - **Programs.** [`init_tracing_from_env`] (`GIN_DEBUG`) and [`exit_code`]
//!   (errors as Display) are what every binary and example of the project
//!   calls; being the one crate they all reach, gin-bootstrap holds them. The
//!   libraries never install a subscriber themselves.
//!
//! # What it does not know
//!
//! Nothing about windows, GPUs, NICs or the device API: it moves opaque bytes
//! between ranks on the host. It is not a data path: gin-net carries the
//! one-sided traffic. It uses threads and blocking sockets on purpose: the
//! bootstrap runs a few hundred messages at set-up, where simplicity and
//! precise error reports matter more than an event loop. The one exception
//! is the handshake: a single gate thread per listener polls connections
//! that have not yet proved they know the secret, so a stranger costs a
//! socket for [`Config::auth_timeout`], never a thread.

#![deny(unsafe_code)]
#![warn(missing_docs)]
// No library function over ~120 lines (issue 19). The workspace allows this
// pedantic lint; its threshold is clippy.toml's `too-many-lines-threshold`
// (clippy's default, 100, until the workspace sets 120).
#![warn(clippy::too_many_lines)]

pub mod agree;
mod cli;
mod collectives;
mod comm;
mod env;
mod error;
pub mod frame;
mod gate;
mod id;
pub mod launch;
pub mod liveness;
mod net;
pub mod record;
mod root;
pub mod selftest;
pub mod topology;

pub use cli::{
    DEBUG_VAR, error_chain, exit_code, init_tracing_from_env, parse_filter, tracing_requested,
};
pub use comm::Bootstrap;
pub use env::{
    Config, DEFAULT_AUTH_TIMEOUT, DEFAULT_TIMEOUT, LaunchEnv, RANK_VARS, Rendezvous, parse_duration,
};
pub use error::BootstrapError;
pub use id::UniqueId;
pub use launch::{
    Fault, FaultKind, LaunchReport, LaunchSpec, Output, RankExit, Role, launch, run_ranks,
    run_threads,
};
pub use root::BootstrapRoot;
