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
//! - **The host-side seam** ([`GdakiBackend`]): gin-device's `HostBackend`,
//!   through which gin-core starts GDAKI for CPU ranks (with the QP-number
//!   exchange) or CUDA ranks with one call, and learns its queue depths.
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

use std::ops::RangeInclusive;
use std::sync::Arc;

use gin_cuda::Device;
use gin_device::{Backend, CpuStart, CudaEngine, CudaEngineSpec, HostBackend, StartError};
use gin_net::Fabric;

/// GDAKI as the host layer starts it: [`Gdaki`] and its soft NIC on CPU
/// ranks (QP numbers exchanged through the host's bootstrap), the queues
/// kernels post to and [`cuda::CudaNic`] on CUDA ranks.
#[derive(Debug, Clone, Copy, Default)]
pub struct GdakiBackend;

impl HostBackend<Fabric, Device> for GdakiBackend {
    fn name(&self) -> &'static str {
        "gdaki"
    }

    fn queue_depths(&self) -> RangeInclusive<u32> {
        MIN_QUEUE_DEPTH..=MAX_QUEUE_DEPTH
    }

    fn start_cpu(&self, s: &CpuStart<'_, Fabric>) -> Result<Arc<dyn Backend>, StartError> {
        let config = GdakiConfig {
            sq_log2: s.queue_log2,
            sharing: if s.exclusive_contexts {
                queue::Sharing::Thread
            } else {
                queue::Sharing::Gpu
            },
            batch: s.batch,
            timeout: s.timeout,
            spin: s.spin,
        };
        let g = Gdaki::start(s.fabric.clone(), s.counters.clone(), s.nctx, config)?;
        g.exchange_qpns(s.exchange)?;
        Ok(Arc::new(g))
    }

    unsafe fn start_cuda(
        &self,
        spec: CudaEngineSpec<Fabric, Device>,
    ) -> Result<Box<dyn CudaEngine>, StartError> {
        // SAFETY: the caller's contract, which is `CudaNic::start`'s.
        Ok(Box::new(unsafe { cuda::CudaNic::start(spec) }?))
    }
}

/// This crate's CUDA headers, by the name kernels include them with
/// (`#include "gin/…"`): the data NVRTC is handed at run time, so that no
/// crate reads another crate's files to assemble the tree.
pub const HEADERS: &[(&str, &str)] = &[("gin/gdaki.cuh", include_str!("../include/gin/gdaki.cuh"))];
