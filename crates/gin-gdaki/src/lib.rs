//! gin-gdaki: the GPU-initiated backend. Device code builds mlx5 work-queue
//! entries itself, posts them in order, rings the doorbell, and polls
//! completion queues. NICs: soft-mlx5, a software NIC that executes the very
//! WQE bytes (so CI runs the whole path), and a real ConnectX through
//! rdma-core loaded at run time ([`mlx5`]: discovery only so far).
//!
//! # Design
//!
//! - **Formats** ([`wqe`], [`completion`]) are pure encode/decode of the mlx5
//!   segments and CQE64, with golden vectors reviewed against rdma-core's
//!   `mlx5dv.h` and NCCL's DOCA headers.
//! - **Names** ([`ids`]): QP numbers and memory keys follow one scheme on
//!   CPU and CUDA ranks, so the NIC decodes them without a table.
//! - **Send queues** ([`queue`], [`qp`]): reserve with a fetch-add, wait
//!   for credit, fill in parallel, then post in reservation order (doorbell
//!   record, big-endian, then doorbell): the protocol `gdaki.cuh` runs on
//!   GPUs, so CI runs what kernels run. Pure index arithmetic,
//!   property-tested across 16-, 32- and 64-bit wraparound.
//! - **Queue pairs**: one RC QP per (context, peer) and a companion
//!   loopback QP for counters (WAIT on the main QP's completion, then a
//!   fetch-add on the local counter), as NCCL does.
//! - **The device side for CPU ranks** ([`Gdaki`]) implements
//!   `gin_device::Backend`: what a kernel does, in Rust.
//! - **soft-mlx5** ([`nic`]) is one engine, a deterministic state machine
//!   generic over an executor: gin-net's fabric on CPU ranks, CUDA streams
//!   on CUDA ranks ([`cuda`], which also sets up the queues kernels post
//!   to), an in-memory fake in its step tests. It checks keys,
//!   bounds and access, and answers violations with error CQEs and the QP
//!   error state; an error CQE becomes an error naming QP, WQE index and
//!   syndrome in the next flush or wait, never a hang (NCCL issue 2383's
//!   failure). Its CQs are owner-bit rings (CPU ranks) or collapsed single
//!   CQEs (CUDA ranks), a queue attribute.
//!
//! # What it does not know
//!
//! Users' arguments are checked by gin-device before they get here; window
//! memory, the window directory and transports belong to gin-net.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod completion;
pub mod cuda;
mod device;
pub mod ids;
pub mod loopback;
pub mod mlx5;
pub mod nic;
pub mod qp;
pub mod queue;
pub mod wqe;

pub use device::{Gdaki, GdakiConfig, MAX_QUEUE_DEPTH, MAX_SQ_LOG2, MIN_QUEUE_DEPTH};
