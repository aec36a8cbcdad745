//! gin-ep: expert parallelism on gin-rs. MoE dispatch sends each token to
//! the ranks that hold its top-k experts; combine brings the experts'
//! outputs back and reduces them with the top-k weights.
//!
//! # Design
//!
//! - A downstream consumer of gin-core's **public API only**, as DeepEP is of
//!   NCCL's: a [`Buffer`] owns a device communicator (one exclusive
//!   context), windows from [`gin_core::Comm::alloc_window`] and signal ids;
//!   every byte moves by `put`, every notification is a `signal` whose value
//!   carries a count. Whatever backend and transport the communicator uses
//!   (direct load/store, proxy, GDAKI; shm, tcp), gin-ep runs on it.
//! - [`layout::Layout`] is pure: per-rank, per-expert and per-host counts,
//!   `is_token_in_rank` and the prefix sums that place every token, from
//!   `topk_idx` alone. Input errors (an expert out of range, too many
//!   tokens, a shape that does not fit, a configuration or replicated table
//!   that differs between ranks) are found before this rank sends a token;
//!   a refused rank still takes part in the step (its peers return
//!   [`EpError::PeerRefused`] naming it; on CUDA ranks a combine whose
//!   expert outputs are refused still runs too, its peers returning
//!   [`EpError::PeerRefusedCombine`]), docs/ep.md "Bad input".
//! - **Low-latency mode** ([`ll`]): per-(local expert, source) slots sized
//!   for the maximum, one count-carrying signal per (expert, source), and a
//!   split into send and receive halves (DeepEP's receive hook).
//! - **High-throughput mode** ([`ht`]): counts first, then two stages:
//!   between hosts only to the rank with the same local index (straight into
//!   the final place when that rank receives the token, else through its
//!   ring under head/tail credits), within a host forwarded over load/store.
//!   Channels (contiguous token ranges, each with its own context) run as
//!   non-blocking lanes on one thread or several. Combine runs backwards,
//!   rows read in place, each token reduced once all its hosts delivered.
//! - **Faults**: every wait is bounded by the job timeout and names the peer;
//!   an active-rank mask lets survivors finish a step with a lost rank's
//!   experts masked ([`OnPeerLoss::Mask`]), reported in the output, in both
//!   modes (in high-throughput mode the lost rank's forwarding role passes
//!   to the next rank of its host).
//! - [`oracle`] builds traceable inputs and checks outputs as DeepEP's tests
//!   do; tests and `gin-bench moe` share it.
//!
//! # What it does not know
//!
//! Descriptor, WQE and wire formats, transports, and how a backend moves
//! bytes.
//!
//! # CUDA ranks
//!
//! [`cuda::CudaBuffer`] runs the low-latency mode on CUDA ranks: the same
//! windows (in GPU memory), message format, signal numbering and
//! cumulative-signal protocol, with the put and wait loops as kernels
//! (`kernels/ll.cu`, including `gin/gin.cuh`) compiled by NVRTC and
//! launched through gin-core's public CUDA API. Inputs are checked on the
//! host by the CPU ranks' code, and [`oracle`] checks both alike
//! ([`oracle::LlView`]). FP8 dispatch is quantised by the dispatch kernel,
//! bit for bit as [`num::quantize_fp8`] (cross-checked as host C++). The
//! combine reads load/store peers' expert outputs in place, as on CPU
//! ranks. Inputs and outputs may live in GPU memory
//! ([`cuda::DeviceInputs`]), with steps on gin's stream or queued on the
//! caller's: no host copy or synchronisation in the step, the checks the
//! host made on read-back done and recorded by the kernels.
//! High-throughput mode runs on CUDA ranks too, from host inputs
//! (`kernels/ht.cu`: the CPU ranks' plan, built on the host and uploaded;
//! a block per channel runs the lanes' protocol, bit for bit the CPU
//! ranks' combine). Masking a lost peer is CPU-rank only so far.

#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]
// Index arithmetic uses the notation of docs/ep.md: r ranks, l local experts,
// t max tokens per rank, m message bytes, k top-k, h hidden.
#![allow(clippy::many_single_char_names)]

mod buffer;
pub mod config;
pub mod cuda;
mod error;
pub mod ht;
pub mod layout;
pub mod ll;
pub mod num;
pub mod oracle;

pub use buffer::{Buffer, Hosts, OnPeerLoss, fingerprint};
pub use config::{CUDA_HT_CHANNELS, Config, MAX_EXPERTS, MAX_HIDDEN, MAX_TOPK, Mode};
pub use error::EpError;
pub use ht::{HtDispatch, HtPending};
pub use ll::{Combined, LlCombinePending, LlDispatch, LlPending};
pub use num::Bf16;
