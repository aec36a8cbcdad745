//! gin-proxy: the proxy backend — device code writes fixed-size descriptors,
//! a host thread does the networking.
//!
//! # Design
//!
//! - **Descriptors** ([`descriptor`]) are 64 bytes, one cache line, with the
//!   ring lap's phase in bit 63 of every qword: a reader never acts on a
//!   half-written descriptor, producers need no fence between payload and
//!   flag, and slots never need clearing. The layout is documented there and
//!   in `docs/proxy.md`.
//! - **Rings** ([`ring`]): one per (context, peer), power-of-two sized;
//!   producers reserve by fetch-add on the head and wait for credit against
//!   the tail; the proxy consumes in order. Index arithmetic is pure and
//!   property-tested against a model.
//! - **The proxy thread** ([`Proxy`]) takes up to 64 descriptors from a ring
//!   before moving on (batches, yet fair), executes them through gin-net,
//!   applies each signal after its data, bumps counters when the source is
//!   reusable, advances the tail in order, and sleeps when idle until a
//!   producer wakes it, so ranks and proxies can share two cores.
//! - Failures (a refused write, a dead link, a corrupt descriptor) are sticky
//!   and surface in every later flush and wait.
//!
//! # What it does not know
//!
//! Window memory, keys and paths belong to gin-net's [`gin_net::Fabric`];
//! validation of user arguments to gin-device.

#![deny(unsafe_op_in_unsafe_fn)]

pub mod descriptor;
mod proxy;
pub mod ring;

pub use proxy::{MAX_QUEUE_DEPTH, MIN_QUEUE_DEPTH, Proxy, ProxyConfig};
