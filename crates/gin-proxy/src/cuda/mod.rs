//! The proxy on CUDA ranks: the rings kernels write, and the one [`Engine`]
//! draining them on a [`Driver`] thread through CUDA streams.
//!
//! [`CudaProxy::start`] sets up, for every context and every peer the
//! proxy serves, a ring of `2^log2` descriptors in mapped pinned host
//! memory (not write-combined: the proxy polls it), read through
//! [`RingMem::foreign`]; the ring's producer and completion indices in
//! device memory (so a kernel never needs an atomic across PCIe); and the
//! `ProxyRingAbi[nctx * nranks]` table, context-major, that
//! `DevCommAbi::rings` points at ([`CudaProxy::rings`]). It then starts the
//! engine with a `CudaExecutor` (one stream per ring; see
//! `executor.rs`) on a driver thread whose idle policy suits a GPU rank
//! ([`IdlePolicy::gpu`]).
//!
//! The rings' streams are watched for stalls (a [`StallWatch`], and a
//! monitor thread that logs one): work a stream has not completed for
//! [`stall_threshold`] of the job's timeout is diagnosed — it waits behind
//! a kernel on a shared hardware work queue — and reported as the
//! engine's error while it lasts ([`CudaProxy::stall`]), so that the watch
//! over running kernels aborts them with that cause instead of their
//! waits timing out bare.
//!
//! What a device communicator keeps is the opaque [`CudaProxy`], as a
//! [`CudaEngine`] (gin-core starts it through [`crate::ProxyBackend`]): the
//! table address for the ABI, the first error (or a stall) while a kernel
//! runs, and `stop`.

mod executor;

use std::sync::Arc;
use std::time::{Duration, Instant};

use gin_cuda::batch::pass_len;
use gin_cuda::batch::stall::{HostMarks, Monitor, Stall, StallWatch, WorkQueues, stall_threshold};
use gin_cuda::staging::Stage;
use gin_cuda::{CudaError, DevMem, Device, HostMem};
use gin_device::abi::{BACKEND_NONE, BACKEND_PROXY, ProxyRingAbi};
use gin_device::{CudaEngine, CudaEngineSpec, GinError, StartError};
use gin_net::{Fabric, Reach};

use crate::driver::{Driver, IdlePolicy};
use crate::engine::{Engine, EngineConfig, RingSpec};
use crate::error::{FirstError, ProxyError, RingMemError};
use crate::ring::RingMem;

use executor::{CudaExecutor, Layout};

/// Bytes of one ring's indices in the index array: the producer index,
/// then the completion index.
const INDEX_BYTES: u64 = 16;

/// Why the CUDA proxy could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CudaProxyError {
    /// Allocating the rings, their indices or table, or the staging buffer
    /// failed (or CUDA is not usable).
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// A ring's memory cannot be viewed (a size out of range).
    #[error(transparent)]
    Ring(#[from] RingMemError),
    /// The driver thread could not be started.
    #[error("rank {rank}: could not start the CUDA proxy thread: {why}")]
    Spawn {
        /// This rank.
        rank: usize,
        /// The operating system's account.
        why: String,
    },
    /// A setting in the environment is not understood.
    #[error("rank {rank}: {why}")]
    Setting {
        /// This rank.
        rank: usize,
        /// The variable, its value and what it takes.
        why: String,
    },
}

/// The CUDA proxy of one device communicator (see the module
/// documentation): its rings' table, and the thread serving them, if any
/// peer is served. Dropping it stops the thread, as [`CudaProxy::stop`]
/// does.
#[derive(Debug)]
pub struct CudaProxy {
    /// First: stopped (and joined) before the memory below is freed.
    driver: Option<Driver>,
    /// The rings' streams, watched for stalls (with the thread that logs
    /// them), while a thread runs.
    stalls: Option<(Arc<StallWatch>, Monitor)>,
    table: DevMem,
    _indices: Arc<DevMem>,
}

/// A ring of the layout: its context, its peer, and its index `c * n + p`
/// in the table and the index array.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slot {
    ctx: usize,
    peer: usize,
    index: usize,
}

/// The rings of `nctx` contexts to the peers `serve` names, context-major.
fn layout(nctx: usize, serve: &[bool]) -> impl Iterator<Item = Slot> + '_ {
    let n = serve.len();
    (0..nctx).flat_map(move |ctx| {
        (0..n).filter(|&p| serve[p]).map(move |peer| Slot {
            ctx,
            peer,
            index: ctx * n + peer,
        })
    })
}

/// How the stall watch names engine ring `i`, of context `ctx` to `peer`.
fn ring_name(i: usize, ctx: u32, peer: usize) -> String {
    format!("ring {i} (context {ctx}, peer {peer})")
}

/// Ring `index`'s entry of the table: its slots, and its producer and
/// completion indices in the index array at `indices`.
fn ring_abi(indices: u64, index: usize, slots: u64, log2: u32) -> ProxyRingAbi {
    let at = indices + index as u64 * INDEX_BYTES;
    ProxyRingAbi {
        slots,
        head: at,
        done: at + 8,
        log2,
        reserved: 0,
    }
}

impl CudaProxy {
    /// Sets up the rings of every context to every peer `spec.serve`
    /// names, and starts the engine serving them (no thread when it serves
    /// none; the table is made anyway). The calling thread must have the
    /// GPU's context current.
    ///
    /// # Safety
    /// `spec.counters` must be `spec.counter_slots * 16` bytes of device
    /// memory of `spec.dev` that outlive the returned proxy (stopping or
    /// dropping it joins its thread once its streams are drained), and
    /// every GPU window in
    /// `spec.fabric`'s directory must stay what its description says
    /// until it leaves the directory, and then until every stream of this
    /// proxy has executed the work it queued on it (free a window only
    /// after the kernels that used it were flushed).
    pub unsafe fn start(spec: CudaEngineSpec<Fabric, Device>) -> Result<Self, CudaProxyError> {
        let (rank, n) = (spec.fabric.rank(), spec.fabric.nranks());
        // A bad setting is refused before anything is allocated.
        let merge = std::env::var(gin_cuda::puts::MERGE_VAR).ok();
        let merge = gin_cuda::puts::merge_max_from(merge.as_deref())
            .map_err(|why| CudaProxyError::Setting { rank, why })?;
        let serve: Vec<bool> = (0..n)
            .map(|p| spec.serve.get(p).copied().unwrap_or(false))
            .collect();
        let indices = Arc::new(DevMem::new(spec.nctx * n * INDEX_BYTES as usize)?);
        let mut abi = vec![ProxyRingAbi::default(); spec.nctx * n];
        let mut rings = Vec::new();
        let mut done = Vec::new();
        for s in layout(spec.nctx, &serve) {
            let slots = HostMem::new(64 << spec.log2)?;
            abi[s.index] = ring_abi(indices.ptr(), s.index, slots.dev(), spec.log2);
            let base = slots.host_ptr().cast_const();
            // SAFETY: `slots` holds `64 << log2` bytes of mapped pinned
            // memory, zeroed, kept by the view itself (its owner); the host
            // only ever loads it atomically through the view, and kernels
            // store descriptors with naturally aligned 8-byte stores.
            let mem = unsafe { RingMem::foreign(base, spec.log2, Box::new(slots)) }?;
            rings.push(RingSpec {
                ctx: s.ctx as u32,
                peer: s.peer,
                mem,
                first: 0,
            });
            done.push(abi[s.index].done);
        }
        let table = DevMem::new(abi.len() * std::mem::size_of::<ProxyRingAbi>())?;
        table.write(0, &abi)?;
        if rings.is_empty() {
            return Ok(Self {
                driver: None,
                stalls: None,
                table,
                _indices: indices,
            });
        }
        let stalls = Arc::new(StallWatch::new(
            rank,
            "CUDA proxy",
            rings
                .iter()
                .enumerate()
                .map(|(i, r)| ring_name(i, r.ctx, r.peer))
                .collect(),
            Box::new(HostMarks::new(rings.len())?),
            stall_threshold(spec.fabric.timeout()),
            WorkQueues::from_env(),
        ));
        let keyed = |p: usize| serve[p] && spec.fabric.reach(p) == Some(Reach::Keyed);
        let stage = (0..n).any(keyed).then(Stage::new).transpose()?;
        let layout = Layout {
            signal_window: spec.signal_window,
            counters: spec.counters,
            counter_slots: spec.counter_slots,
            done,
        };
        // SAFETY: the counters are the caller's contract; each `done` is
        // 8 aligned bytes of `indices`, which the executor keeps; the
        // windows are the caller's contract.
        let mut exec = unsafe {
            CudaExecutor::new(
                spec.dev.clone(),
                spec.fabric.clone(),
                layout,
                stage,
                Box::new(indices.clone()),
            )
        };
        exec.watch_stalls(stalls.clone());
        exec.merge_puts(merge);
        let config = EngineConfig {
            rank,
            batch: pass_len(spec.log2),
            counter_slots: spec.counter_slots,
        };
        let driver = Driver::start(
            format!("gin-cuda-proxy-{rank}"),
            rank,
            (Engine::new(config, rings), exec),
            IdlePolicy::gpu(spec.spin),
            Arc::new(FirstError::default()),
            // Never abandoned: its streams write the counters and windows
            // of the caller, which must not be freed under it.
            Duration::MAX,
        )
        .map_err(|e| CudaProxyError::Spawn {
            rank,
            why: e.to_string(),
        })?;
        let monitor = stalls.monitor(format!("gin-cuda-proxy-stalls-{rank}"))?;
        Ok(Self {
            driver: Some(driver),
            stalls: Some((stalls, monitor)),
            table,
            _indices: indices,
        })
    }

    /// Device address of the `ProxyRingAbi[nctx * nranks]` table
    /// (`DevCommAbi::rings`); entries of peers not served are zero.
    pub fn rings(&self) -> u64 {
        self.table.ptr()
    }

    /// Whether the proxy serves any ring (a thread runs).
    pub fn serves(&self) -> bool {
        self.driver.is_some()
    }

    /// The first error, once the proxy has failed: a kernel waiting on
    /// it should be aborted.
    pub fn error(&self) -> Option<&ProxyError> {
        self.driver.as_ref().and_then(Driver::error)
    }

    /// A stall of the proxy's streams, while there is one: work queued on
    /// a ring's stream has not completed for longer than the threshold
    /// (logged at warn the first time it is seen).
    pub fn stall(&self) -> Option<Stall> {
        self.stalls.as_ref()?.0.check(Instant::now())
    }

    /// Stops the thread after it has executed what kernels queued (a
    /// kernel may end right after pushing a signal a peer waits for) and
    /// waited for its streams; returns the first error.
    pub fn stop(mut self) -> Result<(), ProxyError> {
        self.driver.take().map_or(Ok(()), Driver::stop)
    }
}

impl From<CudaProxyError> for StartError {
    /// The thread's failure as gin-device's `Spawn`; the CUDA runtime's
    /// error, and any other, passed on unchanged for the host layer.
    fn from(e: CudaProxyError) -> Self {
        match e {
            CudaProxyError::Spawn { rank, why } => StartError::Gin(GinError::Spawn {
                rank,
                what: "CUDA proxy thread",
                why,
            }),
            CudaProxyError::Cuda(e) => StartError::Host(Box::new(e)),
            e => StartError::Host(Box::new(e)),
        }
    }
}

impl CudaEngine for CudaProxy {
    fn rings(&self) -> u64 {
        CudaProxy::rings(self)
    }

    fn backend_kind(&self) -> u32 {
        if self.serves() {
            BACKEND_PROXY
        } else {
            BACKEND_NONE
        }
    }

    fn serves(&self) -> bool {
        CudaProxy::serves(self)
    }

    fn describe(&self, load_store: bool) -> &'static str {
        match (self.serves(), load_store) {
            (true, true) => "load/store + proxy",
            (true, false) => "proxy",
            (false, _) => "load/store",
        }
    }

    fn error(&self) -> Option<String> {
        CudaProxy::error(self).map(ToString::to_string)
    }

    /// A stall while it lasts (the kernels waiting on the stalled work are
    /// what it waits for).
    fn stall(&self) -> Option<String> {
        CudaProxy::stall(self).map(|s| s.to_string())
    }

    fn failure(&self) -> &'static str {
        "the CUDA proxy failed"
    }

    /// Kernels see a failed proxy only as progress that stops, which the
    /// watch over a running kernel notices.
    fn kernel_sees_errors(&self) -> bool {
        false
    }

    fn stop(self: Box<Self>) -> Result<(), String> {
        CudaProxy::stop(*self).map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests;
