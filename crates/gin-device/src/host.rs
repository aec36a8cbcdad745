//! The host-side backend seam: how the host layer (gin-core) starts a
//! backend for CPU ranks or an engine for CUDA ranks with one call each,
//! whatever the backend.
//!
//! Each backend crate (gin-proxy, gin-gdaki) provides one type implementing
//! [`HostBackend`]: its name, the queue depths it accepts, [`HostBackend::
//! start_cpu`] (a [`Backend`] for CPU ranks) and [`HostBackend::start_cuda`]
//! (a [`CudaEngine`] serving the queues kernels write). [`Direct`] is the
//! backend that is always there: it queues nothing, so it serves only peers
//! reached by load/store. The host layer picks one of them once (from
//! `GIN_BACKEND`) and never matches on backend kinds again.
//!
//! # Why here, and why generic
//!
//! The seam has to be seen by both backend crates and by gin-core without
//! a dependency cycle. gin-device is below all three, but knows nothing
//! about transports or the CUDA driver (its invariant), and gin-cuda, which
//! knows the driver and the fabric, knows nothing about the device API. So
//! the seam lives here and takes the fabric (`F`, gin-net's `Fabric`) and
//! the GPU (`D`, gin-cuda's `Device`) as type parameters it only passes
//! along: gin-device stays free of both, and no crate gains a dependency.
//! Errors of those layers travel unchanged inside [`StartError::Host`].

use std::error::Error;
use std::fmt::Debug;
use std::ops::RangeInclusive;
use std::sync::Arc;
use std::time::Duration;

use crate::abi::BACKEND_NONE;
use crate::comm::{Backend, Counters, GetOp, PutOp, Ticket, TicketIssuer};
use crate::error::GinError;

/// An error of a layer below the host API (the CUDA driver, the fabric,
/// the bootstrap's exchange), passed on unchanged.
pub type HostError = Box<dyn Error + Send + Sync>;

/// Why a backend could not be started.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// The backend refused its settings, or its thread could not start.
    #[error(transparent)]
    Gin(#[from] GinError),
    /// A layer below failed (allocating CUDA memory, the fabric's window
    /// directory, the exchange of queue numbers): its own error, which the
    /// host layer may downcast.
    #[error(transparent)]
    Host(HostError),
}

/// A collective exchange among all ranks (the host layer's bootstrap), for
/// what a backend's connection set-up needs (GDAKI's QP numbers).
pub trait Exchange {
    /// Every rank's `mine`, by rank (collective).
    fn allgather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, HostError>;
}

/// What starting a backend for CPU ranks takes (collective: every rank
/// starts its own with the same values).
#[derive(Clone, Copy)]
pub struct CpuStart<'a, F> {
    /// This rank.
    pub rank: usize,
    /// Ranks in the job.
    pub nranks: usize,
    /// The rank's fabric.
    pub fabric: &'a Arc<F>,
    /// The rank's counter array, which the backend bumps.
    pub counters: &'a Arc<Counters>,
    /// Contexts of the device communicator.
    pub nctx: u32,
    /// log2 of each queue's depth, within [`HostBackend::queue_depths`].
    pub queue_log2: u32,
    /// Each context is used by one thread only.
    pub exclusive_contexts: bool,
    /// A caller may send to a peer itself when nothing is queued to it
    /// (`auto`); off, every operation goes through the backend's thread.
    pub inline: bool,
    /// Ring a doorbell once this many requests are ready (GDAKI).
    pub batch: u64,
    /// How long any wait of the backend may take.
    pub timeout: Duration,
    /// How long an idle backend thread polls before it sleeps.
    pub spin: Duration,
    /// The job's collective exchange.
    pub exchange: &'a dyn Exchange,
}

impl<F> Debug for CpuStart<'_, F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuStart")
            .field("rank", &self.rank)
            .field("nranks", &self.nranks)
            .field("nctx", &self.nctx)
            .field("queue_log2", &self.queue_log2)
            .field("exclusive_contexts", &self.exclusive_contexts)
            .field("inline", &self.inline)
            .field("batch", &self.batch)
            .field("timeout", &self.timeout)
            .field("spin", &self.spin)
            .finish_non_exhaustive()
    }
}

/// What starting an engine for a CUDA rank's device communicator takes:
/// the same for every backend.
#[derive(Debug, Clone)]
pub struct CudaEngineSpec<F, D> {
    /// This rank's GPU (its context is made current on the engine's thread).
    pub dev: Arc<D>,
    /// The rank's fabric: its window directory holds the GPU windows
    /// requests name, and it reaches peers over keyed transports.
    pub fabric: Arc<F>,
    /// Contexts of the device communicator.
    pub nctx: usize,
    /// By rank: whether the engine serves that peer (queues per context).
    pub serve: Vec<bool>,
    /// log2 of each queue's depth, within [`HostBackend::queue_depths`].
    pub log2: u32,
    /// The signal window's id: each signal has one 8-byte sub-slot per
    /// rank, and this rank's engine is the only writer of its own.
    pub signal_window: u32,
    /// Device address of the counter array: 16 bytes a slot, the engine's
    /// running total first.
    pub counters: u64,
    /// Slots of the counter array.
    pub counter_slots: u64,
    /// How long an idle engine polls at least (never less than 5 ms).
    pub spin: Duration,
}

/// The engine serving a CUDA device communicator's queues, kept as an
/// opaque handle: what the ABI points at, the first error while a kernel
/// runs, and stop. Dropping it stops it, as [`CudaEngine::stop`] does.
pub trait CudaEngine: Send + Sync + Debug {
    /// Device address of the queue table `DevCommAbi::rings` points at
    /// (0: none).
    fn rings(&self) -> u64;

    /// `DevCommAbi::backend_kind`: the backend's `BACKEND_*` tag when it
    /// serves any queue, else [`BACKEND_NONE`].
    fn backend_kind(&self) -> u32;

    /// Whether the engine serves any queue (a thread runs).
    fn serves(&self) -> bool;

    /// How a device communicator served by this engine is described, with
    /// peers reached by load/store too (`load_store`) or not: `"proxy"`,
    /// `"load/store + proxy"`, `"load/store"` when it serves nothing.
    fn describe(&self, load_store: bool) -> &'static str;

    /// The first error, once the engine failed (a kernel waiting on it
    /// should be aborted).
    fn error(&self) -> Option<String>;

    /// A stall while it lasts: work the engine queued that has not run for
    /// far longer than it should (kernels waiting on it should be aborted
    /// by a watch, but a run that ended well did not fail for it). `None`
    /// by default.
    fn stall(&self) -> Option<String> {
        None
    }

    /// How a failure of this engine is introduced in messages (`"the CUDA
    /// proxy failed"`).
    fn failure(&self) -> &'static str;

    /// Whether kernels see this engine's errors themselves (error
    /// completions) and may end before the host saw its account: then a
    /// run looks at [`CudaEngine::error`] once more after the kernel.
    fn kernel_sees_errors(&self) -> bool;

    /// Stops the thread after it has executed what kernels queued (a
    /// kernel may end right after a signal a peer waits for) and waited for
    /// its streams; returns the first error.
    fn stop(self: Box<Self>) -> Result<(), String>;
}

/// One backend, as the host layer starts it. `F` is the fabric and `D`
/// the GPU (see the module documentation).
pub trait HostBackend<F, D>: Send + Sync + Debug {
    /// Short name for messages (`proxy`, `gdaki`, `direct`).
    fn name(&self) -> &'static str;

    /// The queue depths (`DevCommRequirements::queue_depth`) it accepts,
    /// on CPU and CUDA ranks alike; both bounds are powers of two.
    fn queue_depths(&self) -> RangeInclusive<u32>;

    /// log2 of the queue a requested `depth` becomes (rounded up to a
    /// power of two), or `None` outside [`HostBackend::queue_depths`].
    fn queue_log2(&self, depth: u32) -> Option<u32> {
        let range = self.queue_depths();
        // Both bounds are powers of two, so rounding stays within them.
        range
            .contains(&depth)
            .then(|| depth.next_power_of_two().trailing_zeros())
    }

    /// Starts the backend of a CPU rank's device communicator (collective).
    fn start_cpu(&self, start: &CpuStart<'_, F>) -> Result<Arc<dyn Backend>, StartError>;

    /// Sets up the queues of every context to every peer `spec.serve`
    /// names and starts the engine serving them (no thread when it serves
    /// none; the queue table is made anyway). The calling thread must have
    /// the GPU's context current.
    ///
    /// # Safety
    /// `spec.counters` must be `spec.counter_slots * 16` bytes of device
    /// memory of `spec.dev` that outlive the returned engine (stopping or
    /// dropping it joins its thread once its streams are drained), and
    /// every GPU window in `spec.fabric`'s directory must stay what its
    /// description says until it leaves the directory, and then until every
    /// stream of this engine has executed the work it queued on it (free a
    /// window only after the kernels that used it were flushed).
    unsafe fn start_cuda(
        &self,
        spec: CudaEngineSpec<F, D>,
    ) -> Result<Box<dyn CudaEngine>, StartError>;
}

/// The backend that is always available: it queues nothing, so it serves
/// peers reached by load/store only. Its CPU backend refuses operations to
/// any other peer and completes tickets at once (load/store completes
/// before the call returns); its CUDA engine has no queue table and tells
/// kernels [`BACKEND_NONE`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Direct;

/// The deepest "queue" [`Direct`] accepts: it has none, so any depth the
/// host layer can round to a power of two does.
const DIRECT_MAX_DEPTH: u32 = 1 << 31;

impl<F, D> HostBackend<F, D> for Direct {
    fn name(&self) -> &'static str {
        "direct"
    }

    fn queue_depths(&self) -> RangeInclusive<u32> {
        1..=DIRECT_MAX_DEPTH
    }

    fn start_cpu(&self, start: &CpuStart<'_, F>) -> Result<Arc<dyn Backend>, StartError> {
        Ok(Arc::new(DirectBackend {
            rank: start.rank,
            nranks: start.nranks,
            nctx: start.nctx,
            tickets: TicketIssuer::new(),
        }))
    }

    unsafe fn start_cuda(
        &self,
        spec: CudaEngineSpec<F, D>,
    ) -> Result<Box<dyn CudaEngine>, StartError> {
        let _ = spec;
        Ok(Box::new(DirectEngine))
    }
}

/// [`Direct`]'s backend for CPU ranks.
#[derive(Debug)]
struct DirectBackend {
    rank: usize,
    nranks: usize,
    nctx: u32,
    tickets: TicketIssuer,
}

impl DirectBackend {
    fn refuse(&self, what: &str, peer: usize) -> GinError {
        GinError::Unsupported {
            rank: self.rank,
            what: "operation",
            why: format!(
                "a {what} to rank {peer}, which is not reached by load/store: the direct \
                 backend queues nothing"
            ),
        }
    }
}

impl Backend for DirectBackend {
    fn name(&self) -> &'static str {
        "direct"
    }

    fn put(&self, op: &PutOp<'_>) -> Result<(), GinError> {
        Err(self.refuse("put", op.peer))
    }

    fn get(&self, op: &GetOp<'_>) -> Result<(), GinError> {
        Err(self.refuse("get", op.peer))
    }

    fn ticket(&self, ctx: u32, peer: Option<usize>) -> Result<Ticket, GinError> {
        if ctx >= self.nctx {
            return Err(GinError::BadContext {
                rank: self.rank,
                ctx,
                nctx: self.nctx,
            });
        }
        if let Some(p) = peer.filter(|&p| p >= self.nranks) {
            return Err(GinError::BadPeer {
                rank: self.rank,
                peer: p,
                nranks: self.nranks,
            });
        }
        Ok(self.tickets.issue(ctx, peer, Vec::new()))
    }

    fn done(&self, ticket: &Ticket) -> Result<bool, GinError> {
        // Nothing is ever queued: whatever a ticket covers has completed.
        self.tickets
            .redeem(self.rank, ticket, self.nctx, self.nranks, 0)?;
        Ok(true)
    }

    fn health(&self) -> Result<(), GinError> {
        Ok(())
    }
}

/// [`Direct`]'s engine for CUDA ranks: no queues, no thread.
#[derive(Debug)]
struct DirectEngine;

impl CudaEngine for DirectEngine {
    fn rings(&self) -> u64 {
        0
    }

    fn backend_kind(&self) -> u32 {
        BACKEND_NONE
    }

    fn serves(&self) -> bool {
        false
    }

    fn describe(&self, _load_store: bool) -> &'static str {
        "load/store"
    }

    fn error(&self) -> Option<String> {
        None
    }

    fn failure(&self) -> &'static str {
        "the direct backend failed"
    }

    fn kernel_sees_errors(&self) -> bool {
        false
    }

    fn stop(self: Box<Self>) -> Result<(), String> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Stand-ins for the fabric and the GPU, which the seam only passes on.
    #[derive(Debug)]
    struct NoFabric;
    #[derive(Debug)]
    struct NoGpu;

    struct NoExchange;
    impl Exchange for NoExchange {
        fn allgather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, HostError> {
            Ok(vec![mine.to_vec()])
        }
    }

    fn direct() -> &'static dyn HostBackend<NoFabric, NoGpu> {
        &Direct
    }

    #[test]
    fn queue_depths_round_up_within_the_range_and_refuse_outside_it() {
        struct Bounded;
        impl std::fmt::Debug for Bounded {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("Bounded")
            }
        }
        impl HostBackend<NoFabric, NoGpu> for Bounded {
            fn name(&self) -> &'static str {
                "bounded"
            }
            fn queue_depths(&self) -> RangeInclusive<u32> {
                4..=16
            }
            fn start_cpu(
                &self,
                s: &CpuStart<'_, NoFabric>,
            ) -> Result<Arc<dyn Backend>, StartError> {
                direct().start_cpu(s)
            }
            unsafe fn start_cuda(
                &self,
                _: CudaEngineSpec<NoFabric, NoGpu>,
            ) -> Result<Box<dyn CudaEngine>, StartError> {
                Ok(Box::new(DirectEngine))
            }
        }
        let b: &dyn HostBackend<NoFabric, NoGpu> = &Bounded;
        assert_eq!(b.queue_log2(3), None);
        assert_eq!(b.queue_log2(4), Some(2));
        assert_eq!(b.queue_log2(5), Some(3));
        assert_eq!(b.queue_log2(16), Some(4));
        assert_eq!(b.queue_log2(17), None);
        assert_eq!(direct().queue_log2(1), Some(0));
        assert_eq!(direct().queue_log2(DIRECT_MAX_DEPTH), Some(31));
        assert_eq!(direct().queue_log2(DIRECT_MAX_DEPTH + 1), None);
        assert_eq!(direct().queue_log2(0), None);
    }

    #[test]
    fn the_direct_backend_refuses_queued_operations_and_completes_tickets_at_once() {
        let counters = Arc::new(Counters::new(1));
        let start = || {
            direct()
                .start_cpu(&CpuStart {
                    rank: 1,
                    nranks: 2,
                    fabric: &Arc::new(NoFabric),
                    counters: &counters,
                    nctx: 2,
                    queue_log2: 0,
                    exclusive_contexts: false,
                    inline: true,
                    batch: 1,
                    timeout: Duration::from_secs(1),
                    spin: Duration::ZERO,
                    exchange: &NoExchange,
                })
                .unwrap()
        };
        let b = start();
        assert_eq!(b.name(), "direct");
        let t = b.ticket(1, Some(0)).unwrap();
        assert!(b.done(&t).unwrap());
        assert!(b.done(&b.ticket(0, None).unwrap()).unwrap());
        let e = b.ticket(2, None).unwrap_err().to_string();
        assert!(e.contains("rank 1") && e.contains('2'), "{e}");
        let e = b.ticket(0, Some(2)).unwrap_err().to_string();
        assert!(e.contains("rank 1") && e.contains('2'), "{e}");
        // Another instance's ticket is refused, not taken as done.
        let other = start();
        let e = other.done(&t).unwrap_err().to_string();
        assert!(e.contains("another device communicator"), "{e}");
        b.health().unwrap();
    }

    #[test]
    fn the_direct_engine_has_no_queues_and_tells_kernels_so() {
        let spec = CudaEngineSpec {
            dev: Arc::new(NoGpu),
            fabric: Arc::new(NoFabric),
            nctx: 1,
            serve: vec![false, false],
            log2: 0,
            signal_window: 0,
            counters: 0,
            counter_slots: 0,
            spin: Duration::ZERO,
        };
        // SAFETY: the direct engine touches no memory.
        let e = unsafe { direct().start_cuda(spec) }.unwrap();
        assert_eq!(
            (e.rings(), e.backend_kind(), e.serves()),
            (0, BACKEND_NONE, false)
        );
        assert_eq!(e.describe(true), "load/store");
        assert!(e.error().is_none() && !e.kernel_sees_errors());
        e.stop().unwrap();
    }
}
