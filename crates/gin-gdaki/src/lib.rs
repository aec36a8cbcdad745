//! gin-gdaki: the GPU-initiated backend. Device code builds mlx5 work-queue
//! entries itself, marks them ready in order, rings the doorbell, and polls
//! completion queues. NICs: soft-mlx5, a software NIC that executes the very
//! WQE bytes over gin-net (so CI runs the whole path), and mlx5 devx on a real
//! ConnectX, loaded at run time.
//!
//! Being built: the send-queue bookkeeping ([`queue`]) exists; the formats,
//! the CPU-rank backend and the NICs follow.

#![deny(unsafe_op_in_unsafe_fn)]

pub mod completion;
pub mod queue;
pub mod wqe;
