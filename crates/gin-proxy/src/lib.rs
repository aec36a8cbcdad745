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
//!   the completion index; the engine consumes in order through a
//!   [`RingMem`] view, which reads a ring in Rust memory (CPU ranks) or in
//!   foreign memory (mapped pinned host memory a GPU writes) alike. Index
//!   arithmetic is pure and property-tested against a model.
//! - **One engine** ([`Engine`]) for CPU and CUDA ranks: a state machine
//!   with no threads, sleeps or clocks, generic over an [`Executor`] that
//!   moves the bytes. It owns ring order and batching (up to a batch per
//!   ring, then the next ring), validation against the window directory,
//!   signal and counter running totals, in-order completion (an operation
//!   in flight — a tcp get, a put from GPU memory over ucx — holds the
//!   completion index and later counters back, never the engine), and the
//!   failure policy:
//!   **fail-stop** — the first error is recorded, naming rank, context, peer
//!   and descriptor sequence, and nothing is executed after it.
//! - **Executors** ([`executor`]): gin-net's fabric for CPU ranks
//!   (`FabricExecutor`, synchronous), CUDA streams for CUDA ranks
//!   (`CudaExecutor` in [`cuda`]: asynchronous and in order; publication is
//!   an executor operation, so a stream can queue it after the data), and [`testing::Fake`], with which
//!   the engine is tested step by step, deterministically.
//! - **One driver thread** ([`Driver`]): start, stop after draining, the
//!   first error shared with producers and waiters, and the idle policy —
//!   spin, yield, then sleep until a producer wakes it — so ranks and
//!   proxies can share two cores. The engine sits behind a lock the thread
//!   takes for each step, so a CPU rank's producer can take a turn itself.
//! - **The CPU backend** ([`Proxy`]): gin-device's `Backend` for CPU ranks,
//!   the producer side of the rings (reserve, credit wait, write, wake) and
//!   tickets, with an engine on a driver thread behind it. Under `auto` the
//!   rank's thread sends small puts to tcp peers itself when the ring is
//!   empty, and runs the engine on a ring itself (when the driver thread is
//!   not) after writing a put the transport lends its source to and while a
//!   flush waits: a large put over ucx is issued and lands on the rank's
//!   thread, still tracked by the ring.
//! - **The host-side seam** ([`ProxyBackend`]): gin-device's
//!   `HostBackend`, through which gin-core starts the CPU backend or the
//!   CUDA engine with one call, and learns the queue depths the proxy
//!   accepts.
//! - **The CUDA backend** ([`cuda::CudaProxy`]): the rings kernels write
//!   (mapped pinned memory, indices in device memory, the `ProxyRingAbi`
//!   table) and the same engine on a driver thread, executing through one
//!   CUDA stream per ring (on gin-cuda's runtime).
//!
//! # What it does not know
//!
//! Window memory, keys and paths belong to gin-net's [`gin_net::Fabric`],
//! whose one directory holds CPU ranks' host windows and CUDA ranks' GPU
//! windows alike (each executor takes only its own kind); validation of user
//! arguments to gin-device; the CUDA driver to gin-cuda; threads and clocks
//! to the driver, not the engine.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod cuda;
pub mod descriptor;
mod driver;
mod engine;
pub mod error;
pub mod executor;
mod fabric;
mod proxy;
pub mod ring;
pub mod testing;

pub use driver::{Driver, IdlePolicy};
pub use engine::{Engine, EngineConfig, EngineStats, Progress, RingSpec};
pub use error::{ExecError, FirstError, Invalid, ProxyError, RingMemError, Why};
pub use executor::{Executor, Issued, Site};
pub use proxy::{MAX_QUEUE_DEPTH, MIN_QUEUE_DEPTH, Proxy, ProxyConfig};
pub use ring::RingMem;

use std::ops::RangeInclusive;
use std::sync::Arc;

use gin_cuda::Device;
use gin_device::{Backend, CpuStart, CudaEngine, CudaEngineSpec, HostBackend, StartError};
use gin_net::Fabric;

/// The proxy as the host layer starts it: [`Proxy`] on CPU ranks,
/// [`cuda::CudaProxy`] on CUDA ranks.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProxyBackend;

impl HostBackend<Fabric, Device> for ProxyBackend {
    fn name(&self) -> &'static str {
        "proxy"
    }

    fn queue_depths(&self) -> RangeInclusive<u32> {
        MIN_QUEUE_DEPTH..=MAX_QUEUE_DEPTH
    }

    fn start_cpu(&self, s: &CpuStart<'_, Fabric>) -> Result<Arc<dyn Backend>, StartError> {
        let config = ProxyConfig {
            ring_log2: s.queue_log2,
            timeout: s.timeout,
            spin: s.spin,
            inline_tcp: s.inline,
        };
        Ok(Arc::new(Proxy::start(
            s.fabric.clone(),
            s.counters.clone(),
            s.nctx,
            config,
        )?))
    }

    unsafe fn start_cuda(
        &self,
        spec: CudaEngineSpec<Fabric, Device>,
    ) -> Result<Box<dyn CudaEngine>, StartError> {
        // SAFETY: the caller's contract, which is `CudaProxy::start`'s.
        Ok(Box::new(unsafe { cuda::CudaProxy::start(spec) }?))
    }
}

/// This crate's CUDA headers, by the name kernels include them with
/// (`#include "gin/…"`): the data NVRTC is handed at run time, so that no
/// crate reads another crate's files to assemble the tree.
pub const HEADERS: &[(&str, &str)] = &[("gin/proxy.cuh", include_str!("../include/gin/proxy.cuh"))];
