//! The proxy backend of CPU ranks: the producer side of the rings (reserve,
//! wait for credit, write, wake) behind gin-device's [`Backend`], and a
//! [`Driver`] running the [`Engine`] over a [`FabricExecutor`].

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use gin_device::{Backend, Counters, GetOp, GinError, PutOp, Source, Ticket, TicketIssuer};
use gin_net::Fabric;

use crate::descriptor::{Desc, Op, Sig};
use crate::driver::{Driver, IdlePolicy, Shared, Turn};
use crate::engine::{Engine, EngineConfig, RingSpec, check_counter, resolve_put};
use crate::error::{FirstError, ProxyError, Why};
use crate::executor::{Executor, Site};
use crate::fabric::FabricExecutor;
use crate::ring::{Ring, RingMem, passed};

/// Descriptors taken from one ring before moving to the next: batches, not
/// one per peer per pass, yet no ring starves the others.
const BATCH: u64 = 64;

/// The shallowest ring (`queue_depth`) the proxy accepts, on CPU and CUDA
/// ranks alike. Every operation is one descriptor, so any ring works; two
/// is the smallest the CUDA rings were ever built with, and lets a producer
/// write one descriptor while the proxy executes the other.
pub const MIN_QUEUE_DEPTH: u32 = 2;

/// The deepest ring the proxy accepts (`queue_depth`; 4 MiB of descriptors
/// per context and peer).
pub const MAX_QUEUE_DEPTH: u32 = 1 << 16;

/// Settings of a proxy.
#[derive(Debug, Clone, Copy)]
pub struct ProxyConfig {
    /// log2 of descriptors per ring: the ring holds [`MIN_QUEUE_DEPTH`] to
    /// [`MAX_QUEUE_DEPTH`] descriptors, else `start` fails.
    pub ring_log2: u32,
    /// How long a producer waits for ring credit before failing.
    pub timeout: Duration,
    /// How long an idle proxy keeps polling (yielding) before it sleeps
    /// until a producer wakes it.
    pub spin: Duration,
    /// CPU ranks only (`auto`): a put to a peer reached over TCP whose ring
    /// is empty is sent by the calling thread instead of the proxy thread.
    /// Ordering holds because an empty ring means everything queued before
    /// was already written to the same ordered link. A put the transport
    /// would lend its source to (large puts over ucx) still goes through
    /// the ring, but the calling thread runs the engine on that ring
    /// itself when the proxy thread is not running it, and so does a
    /// waiter on its flush: the put is issued, and lands, on the rank's
    /// own thread, tracked by the ring. Off for pure-proxy runs.
    pub inline_tcp: bool,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            ring_log2: 8,
            timeout: Duration::from_secs(300),
            spin: Duration::from_micros(100),
            inline_tcp: false,
        }
    }
}

/// A proxy backend instance: rings for every (context, peer) and the thread
/// that drains them. Dropping it stops the thread.
#[derive(Debug)]
pub struct Proxy {
    rank: usize,
    nranks: usize,
    nctx: u32,
    config: ProxyConfig,
    counter_slots: u64,
    rings: Arc<[Arc<Ring>]>,
    /// The producers' copy, for sends without the ring and confirmations.
    exec: FabricExecutor,
    error: Arc<FirstError>,
    tickets: TicketIssuer,
    /// Producers' turns on the engine ([`ProxyConfig::inline_tcp`]).
    shared: Shared<FabricExecutor>,
    driver: Driver,
}

impl Proxy {
    /// Starts a proxy for `nctx` contexts over `fabric`.
    pub fn start(
        fabric: Arc<Fabric>,
        counters: Arc<Counters>,
        nctx: u32,
        config: ProxyConfig,
    ) -> Result<Self, GinError> {
        let rank = fabric.rank();
        Self::assemble(fabric, counters, nctx, config, |engine, exec, error| {
            Driver::start_shared(
                format!("gin-proxy-{rank}"),
                rank,
                (engine, exec),
                IdlePolicy::cpu(config.spin),
                error,
                // Its sends end within the timeout (gin-net's deadlines).
                config.timeout,
            )
            .map_err(|e| GinError::Spawn {
                rank,
                what: "proxy thread",
                why: e.to_string(),
            })
        })
    }

    /// A proxy with no thread (tests): only callers step its engine
    /// ([`ProxyConfig::inline_tcp`]), so whatever ran, ran on the calling
    /// thread, and nothing runs between two calls.
    #[cfg(test)]
    fn parked(
        fabric: Arc<Fabric>,
        counters: Arc<Counters>,
        nctx: u32,
        config: ProxyConfig,
    ) -> Result<Self, GinError> {
        Self::assemble(fabric, counters, nctx, config, |engine, exec, error| {
            Ok(Driver::parked(
                "gin-proxy-parked".into(),
                (engine, exec),
                error,
            ))
        })
    }

    /// The rings, engine and executor of a proxy, its driver made by
    /// `drive`.
    fn assemble(
        fabric: Arc<Fabric>,
        counters: Arc<Counters>,
        nctx: u32,
        config: ProxyConfig,
        drive: impl FnOnce(
            Engine<FabricExecutor>,
            FabricExecutor,
            Arc<FirstError>,
        ) -> Result<(Driver, Shared<FabricExecutor>), GinError>,
    ) -> Result<Self, GinError> {
        let rank = fabric.rank();
        let nranks = fabric.nranks();
        let depth = 1u64.checked_shl(config.ring_log2).unwrap_or(u64::MAX);
        if !(u64::from(MIN_QUEUE_DEPTH)..=u64::from(MAX_QUEUE_DEPTH)).contains(&depth) {
            return Err(GinError::Unsupported {
                rank,
                what: "queue depth",
                why: format!(
                    "queue depth 2^{} is outside the proxy backend's range: minimum \
                     {MIN_QUEUE_DEPTH}, maximum {MAX_QUEUE_DEPTH}",
                    config.ring_log2
                ),
            });
        }
        let rings: Arc<[Arc<Ring>]> = (0..nctx as usize * nranks)
            .map(|_| Arc::new(Ring::new(config.ring_log2)))
            .collect();
        let specs = rings
            .iter()
            .enumerate()
            .map(|(i, r)| RingSpec {
                ctx: (i / nranks) as u32,
                peer: i % nranks,
                mem: RingMem::owned(r.clone()),
                first: 0,
            })
            .collect();
        let counter_slots = counters.len() as u64;
        let engine = Engine::new(
            EngineConfig {
                rank,
                batch: BATCH,
                counter_slots,
            },
            specs,
        );
        let exec = FabricExecutor::new(fabric, counters, rings.clone());
        let error = Arc::new(FirstError::default());
        let (driver, shared) = drive(engine, exec.clone(), error.clone())?;
        Ok(Self {
            rank,
            nranks,
            nctx,
            config,
            counter_slots,
            rings,
            exec,
            error,
            tickets: TicketIssuer::new(),
            shared,
            driver,
        })
    }

    /// Descriptors executed so far (for benchmarks and tests).
    pub fn executed(&self) -> u64 {
        self.driver.executed()
    }

    fn ring(&self, ctx: u32, peer: usize) -> &Ring {
        &self.rings[ctx as usize * self.nranks + peer]
    }

    fn unsupported(&self, e: impl std::fmt::Display) -> GinError {
        GinError::Unsupported {
            rank: self.rank,
            what: "operation",
            why: e.to_string(),
        }
    }

    /// Records `e` as the proxy's failure (unless one came first) and
    /// returns it as the caller's error.
    fn fail(&self, e: ProxyError) -> GinError {
        let out = failed(&e);
        self.error.record(e);
        out
    }

    fn enqueue(&self, ctx: u32, peer: usize, d: &Desc) -> Result<(), GinError> {
        self.write(ctx, peer, d)?;
        self.driver.wake();
        Ok(())
    }

    /// Writes `d` into its ring (waiting for credit), without waking the
    /// proxy thread.
    fn write(&self, ctx: u32, peer: usize, d: &Desc) -> Result<(), GinError> {
        d.validate().map_err(|e| self.unsupported(e))?;
        self.health()?;
        let ring = self.ring(ctx, peer);
        let seq = ring.reserve();
        if !ring.can_write(seq) {
            self.wait_for_credit(ring, ctx, peer, seq)?;
        }
        ring.write(seq, d);
        Ok(())
    }

    /// Steps the rings of `ctx` to `peers` on the calling thread when the
    /// proxy thread is not stepping the engine ([`Shared::try_step_rings`]);
    /// wakes the proxy thread where work is left to it (the engine was
    /// busy, or something is still in flight: a counter must count, and
    /// the ring publish, without the caller calling again).
    fn run_here(&self, ctx: u32, peers: impl IntoIterator<Item = usize>) {
        let base = ctx as usize * self.nranks;
        let rings = peers.into_iter().map(|p| base + p);
        if self.shared.try_step_rings(rings) != (Turn::Stepped { more: false }) {
            self.driver.wake();
        }
    }

    /// Whether the calling thread runs the engine on the ring of a put it
    /// queues ([`ProxyConfig::inline_tcp`]): a put the transport would
    /// lend its source to, to a keyed peer, which [`Proxy::direct`] keeps
    /// on the ring.
    fn runs_here(&self, peer: usize, d: &Desc) -> bool {
        let fabric = self.exec.fabric();
        self.config.inline_tcp
            && fabric.reach(peer) == Some(gin_net::Reach::Keyed)
            && d.inline.is_none()
            && d.bytes > 0
            && fabric.lends_puts(peer, d.bytes)
    }

    fn wait_for_credit(
        &self,
        ring: &Ring,
        ctx: u32,
        peer: usize,
        seq: u64,
    ) -> Result<(), GinError> {
        let start = Instant::now();
        let mut spins = 0u32;
        while !ring.can_write(seq) {
            if self.config.inline_tcp {
                // The engine frees the slot: run it here when it is free.
                self.run_here(ctx, [peer]);
            } else {
                self.driver.wake();
            }
            spins += 1;
            if spins < 100 {
                std::hint::spin_loop();
                continue;
            }
            thread::yield_now();
            if spins.is_multiple_of(256) {
                // The engine (or another producer) may have failed already.
                self.health()?;
            }
            if start.elapsed() > self.config.timeout {
                // The slot stays reserved: the ring cannot make progress
                // past it, so the backend is broken from here on.
                return Err(self.fail(ProxyError::Stalled {
                    rank: self.rank,
                    ctx,
                    peer,
                    seq,
                    waited: self.config.timeout,
                }));
            }
        }
        Ok(())
    }

    /// Whether a put may skip the ring (`auto` on CPU ranks): the peer is
    /// reached over tcp and its ring is empty, so everything queued before
    /// it has completed on the same ordered link. Not a put from a window
    /// the transport would lend rather than copy ([`Fabric::lends_puts`]):
    /// only the ring tracks its completion (counter, ticket) until the
    /// transport is done with the source.
    fn direct(&self, ctx: u32, peer: usize, d: &Desc) -> bool {
        let fabric = self.exec.fabric();
        if !self.config.inline_tcp
            || fabric.reach(peer) != Some(gin_net::Reach::Keyed)
            || (d.inline.is_none() && d.bytes > 0 && fabric.lends_puts(peer, d.bytes))
        {
            return false;
        }
        let ring = self.ring(ctx, peer);
        ring.head() == ring.tail()
    }

    /// Executes a put on the calling thread, with the engine's checks and
    /// the same executor; a failure is the proxy's failure.
    fn put_directly(&self, ctx: u32, peer: usize, d: &Desc) -> Result<(), GinError> {
        d.validate().map_err(|e| self.unsupported(e))?;
        self.health()?;
        let fail = |why: Why| {
            self.fail(ProxyError::Direct {
                rank: self.rank,
                ctx,
                peer,
                what: "put",
                why,
            })
        };
        check_counter(d, self.counter_slots).map_err(|e| fail(e.into()))?;
        let put = resolve_put(&self.exec, self.rank, peer, d).map_err(|e| fail(e.into()))?;
        let site = Site {
            ring: ctx as usize * self.nranks + peer,
            ctx,
            peer,
        };
        let mut exec = self.exec.clone();
        // The fabric applies the signal's `add`; the running total is the
        // engine's and this put bypasses it, so it stays 0 here.
        // Complete on return: `direct` keeps puts the transport would lend
        // on the ring.
        exec.put(site, &put)
            .and_then(|_| d.counter.map_or(Ok(()), |c| exec.count(site, c, 0)))
            .map_err(|e| fail(e.into()))
    }
}

/// A proxy failure as gin-device's error.
fn failed(e: &ProxyError) -> GinError {
    GinError::Failed {
        rank: e.rank(),
        ctx: e.ctx().unwrap_or(0),
        what: e.what(),
        why: e.cause(),
    }
}

impl Backend for Proxy {
    fn name(&self) -> &'static str {
        "proxy"
    }

    fn put(&self, op: &PutOp<'_>) -> Result<(), GinError> {
        let (src_window, src_offset, inline) = match op.src {
            Source::Window { window, offset } => (window.id(), offset, None),
            Source::Inline(v) => (0, 0, Some(v)),
            Source::Empty => (0, 0, None),
        };
        let counter = match op.counter {
            Some(c) => Some(u32::try_from(c).map_err(|_| GinError::Unsupported {
                rank: self.rank,
                what: "counter slot",
                why: format!("{c} does not fit a descriptor"),
            })?),
            None => None,
        };
        let d = Desc {
            op: Op::Put,
            bytes: op.bytes,
            dst_window: op.dst.id(),
            dst_offset: op.dst_off,
            src_window,
            src_offset,
            inline,
            signal: op.signal.map(|s| Sig {
                window: s.window.id(),
                offset: s.offset,
                add: s.add,
                strong: s.order == gin_device::Order::Strong,
            }),
            counter,
        };
        if self.direct(op.ctx, op.peer, &d) {
            return self.put_directly(op.ctx, op.peer, &d);
        }
        if self.runs_here(op.peer, &d) {
            // Issued on this thread (unless the proxy thread is stepping
            // the engine right now), still tracked by the ring: its counter
            // counts, and the ring publishes past it, once the transport is
            // done with the source. A failure of this turn is this call's.
            self.write(op.ctx, op.peer, &d)?;
            self.run_here(op.ctx, [op.peer]);
            return self.health();
        }
        self.enqueue(op.ctx, op.peer, &d)
    }

    fn get(&self, op: &GetOp<'_>) -> Result<(), GinError> {
        let d = Desc {
            op: Op::Get,
            bytes: op.bytes,
            dst_window: op.remote.id(),
            dst_offset: op.remote_off,
            src_window: op.local.id(),
            src_offset: op.local_off,
            inline: None,
            signal: None,
            counter: None,
        };
        self.enqueue(op.ctx, op.peer, &d)
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
        let marks = match peer {
            Some(p) => vec![self.ring(ctx, p).head()],
            None => (0..self.nranks).map(|p| self.ring(ctx, p).head()).collect(),
        };
        Ok(self.tickets.issue(ctx, peer, marks))
    }

    fn done(&self, t: &Ticket) -> Result<bool, GinError> {
        // One mark per peer: the ring's head when the ticket was issued.
        let marks = self
            .tickets
            .redeem(self.rank, t, self.nctx, self.nranks, 1)?;
        let peers: Vec<usize> = match t.peer() {
            Some(p) => vec![p],
            None => (0..self.nranks).collect(),
        };
        // The completion index covers a get only once its data landed.
        let behind = || {
            peers
                .iter()
                .zip(marks)
                .filter(|&(&p, mark)| !passed(self.ring(t.ctx(), p).tail(), *mark))
                .map(|(&p, _)| p)
        };
        let mut complete = behind().next().is_none();
        if !complete && self.config.inline_tcp {
            // `auto`: land (and issue) what the ticket waits for here, not
            // on the proxy thread, when that is not stepping the engine.
            self.run_here(t.ctx(), behind().collect::<Vec<_>>());
            complete = behind().next().is_none();
        }
        // Health after completion: a failure recorded before an operation was
        // released (a get whose link broke) is seen here, not missed.
        self.health()?;
        if !complete {
            self.driver.wake();
            return Ok(false);
        }
        // Every put covered was written; over tcp, have the targets confirm
        // them, so a refused put (and its signal, never applied) is reported
        // by this completion, not by some later call.
        for p in peers {
            self.exec.confirm(p).map_err(|why| {
                self.fail(ProxyError::Direct {
                    rank: self.rank,
                    ctx: t.ctx(),
                    peer: p,
                    what: "completion of operations",
                    why: why.into(),
                })
            })?;
        }
        Ok(true)
    }

    fn health(&self) -> Result<(), GinError> {
        if let Some(e) = self.error.get() {
            return Err(failed(e));
        }
        self.exec.health().map_err(|e| GinError::JobFailed {
            rank: self.rank,
            why: e.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gin_device::{Window, WindowParts};
    use gin_net::region::{Access, RegionTable};
    use gin_net::{MemDesc, MemParts};
    use std::sync::atomic::Ordering;

    /// One rank, window 0 over `len` bytes of memory it owns, and a proxy
    /// with `nctx` contexts and rings of `2^log2` descriptors. Fields drop in
    /// order: the proxy (and its thread) before the memory.
    struct Rig {
        proxy: Proxy,
        win: Window,
        counters: Arc<Counters>,
        _fabric: Arc<Fabric>,
        mem: Box<[u64]>,
    }

    fn rig(len: usize, nctx: u32, log2: u32) -> Rig {
        let table = Arc::new(RegionTable::default());
        let timeout = Duration::from_secs(5);
        let fabric = Arc::new(Fabric::local(table.clone(), timeout));
        let mut mem = vec![0u64; len / 8].into_boxed_slice();
        let len = mem.len() * 8;
        let base = mem.as_mut_ptr().cast::<u8>();
        // SAFETY: `mem` lives in the rig, which drops the proxy and the
        // fabric (and with it the key) before it.
        let key = unsafe { table.insert(base, len as u64, Access::ALL) }.unwrap();
        let parts = MemParts {
            local_base: base as usize,
            sizes: vec![len as u64],
            peer_bases: vec![base as usize],
            keys: vec![key],
            addrs: vec![base as u64],
            states: vec![0],
            ..MemParts::default()
        };
        // SAFETY: `mem` (`len` bytes) lives in the rig, which drops the
        // proxy and the fabric before it.
        fabric.add_window(0, unsafe { MemDesc::new(parts) });
        // SAFETY: as above.
        let win = unsafe {
            Window::from_parts(
                WindowParts {
                    id: 0,
                    rank: 0,
                    comm_id: 1,
                    local_base: base,
                    sizes: vec![len as u64],
                    peer_bases: vec![base],
                    keys: vec![key],
                    addrs: vec![base as u64],
                    states: vec![std::ptr::null()],
                },
                Box::new(()),
            )
        };
        let counters = Arc::new(Counters::new(4));
        let config = ProxyConfig {
            ring_log2: log2,
            timeout,
            ..ProxyConfig::default()
        };
        let proxy = Proxy::start(fabric.clone(), counters.clone(), nctx, config).unwrap();
        Rig {
            proxy,
            win,
            counters,
            _fabric: fabric,
            mem,
        }
    }

    fn flush(p: &Proxy) -> Result<(), GinError> {
        let t = p.ticket(0, None)?;
        let start = Instant::now();
        while !p.done(&t)? {
            assert!(start.elapsed() < Duration::from_secs(5), "flush hung");
            thread::yield_now();
        }
        Ok(())
    }

    #[test]
    fn a_ticket_from_another_communicator_is_refused() {
        let a = rig(64, 1, 2);
        let b = rig(64, 3, 2);
        let t = b.proxy.ticket(2, None).unwrap();
        let e = a.proxy.done(&t).unwrap_err().to_string();
        assert!(e.contains("ticket") && e.contains("another"), "{e}");
        // The same shape as one of ours, but not ours.
        let t = b.proxy.ticket(0, Some(0)).unwrap();
        let e = a.proxy.done(&t).unwrap_err().to_string();
        assert!(e.contains("ticket") && e.contains("another"), "{e}");
        let t = a.proxy.ticket(0, Some(0)).unwrap();
        assert_eq!(a.proxy.done(&t), Ok(true));
        flush(&a.proxy).unwrap();
        // Asking for a ticket to a peer that does not exist is an error too.
        assert!(matches!(
            a.proxy.ticket(0, Some(1)),
            Err(GinError::BadPeer { peer: 1, .. })
        ));
        let _ = (&a.win, &a.counters);
    }

    /// With `auto`'s sends from the calling thread (`inline_tcp`), a put to
    /// a keyed peer whose ring is empty goes on the caller's thread, unless
    /// the transport would lend it its source (a large put over ucx): that
    /// one goes through the ring, whose engine tracks its completion and
    /// counts its counter only then. A flush covers both.
    #[test]
    fn a_put_the_transport_would_lend_goes_through_the_ring() {
        use gin_net::testing::KeyedOp;

        let r = lending_rig(Steps::ProxyThread);
        r.put(0, 64).unwrap();
        assert_eq!(r.proxy.ring(0, 1).head(), 0, "a small put went direct");
        assert_eq!(r.counted(), 1);
        r.put(0, 8 << 10).unwrap();
        assert_eq!(r.proxy.ring(0, 1).head(), 1, "a lent put took the ring");
        flush(&r.proxy).unwrap();
        assert_eq!(r.counted(), 2);
        let ops = r.keyed.ops();
        assert!(matches!(ops[0], KeyedOp::Put { .. }), "{ops:?}");
        assert!(
            matches!(ops[1], KeyedOp::PutLent { src, len: 8192, .. } if src == r.base as u64),
            "{ops:?}"
        );
    }

    /// Rank 0 of two, rank 1 keyed through a recorder that lends host puts
    /// of 4 KiB and more; window 0 over memory its keeper owns (as a window
    /// gin-net allocated, whose puts are lent). The proxy runs as `auto`
    /// does (`inline_tcp`), stepped as [`Steps`] says. Fields drop in
    /// order: the proxy (and its thread) before the fabric and the memory.
    struct Lending {
        proxy: Proxy,
        win: Window,
        counters: Arc<Counters>,
        keyed: Arc<gin_net::testing::KeyedRecorder>,
        base: *mut u8,
        _fabric: Arc<Fabric>,
        _mem: Arc<Box<[u64]>>,
    }

    /// Who steps a [`Lending`] rig's proxy.
    enum Steps {
        /// The proxy's own thread; the recorder completes lent puts at once.
        ProxyThread,
        /// No thread: whatever runs, runs on the test's thread, within the
        /// call; the recorder holds lent puts in flight until the test
        /// completes them.
        Caller,
    }

    fn lending() -> Lending {
        lending_rig(Steps::Caller)
    }

    fn lending_rig(steps: Steps) -> Lending {
        use gin_net::Path;
        use gin_net::testing::KeyedRecorder;

        let keyed = Arc::new(KeyedRecorder::default().lending_host_puts(4096));
        if matches!(steps, Steps::Caller) {
            keyed.hold_device_puts();
        }
        let timeout = Duration::from_secs(5);
        let fabric = Arc::new(Fabric::new(
            0,
            vec![Path::local(), Path::new(keyed.clone())],
            Arc::new(RegionTable::default()),
            timeout,
        ));
        let mem = Arc::new(vec![0u64; 2048].into_boxed_slice());
        let len = (mem.len() * 8) as u64;
        let base = mem.as_ptr().cast::<u8>().cast_mut();
        let parts = MemParts {
            local_base: base as usize,
            sizes: vec![len, len],
            peer_bases: vec![base as usize, 0],
            keys: vec![0, 0x77],
            addrs: vec![base as u64, 0x1000],
            states: vec![0, 0],
            // The keep-alive owns the memory (as a window gin-net
            // allocated): only then is a put from it lent.
            keep: Some(gin_net::KeepAlive(mem.clone())),
            ..MemParts::default()
        };
        // SAFETY: the keep-alive owns the memory, and the rig holds it too.
        fabric.add_window(0, unsafe { MemDesc::new(parts).keeping_local() });
        // SAFETY: as above.
        let win = unsafe {
            Window::from_parts(
                WindowParts {
                    id: 0,
                    rank: 0,
                    comm_id: 1,
                    local_base: base,
                    sizes: vec![len, len],
                    peer_bases: vec![base, std::ptr::null_mut()],
                    keys: vec![0, 0x77],
                    addrs: vec![base as u64, 0x1000],
                    states: vec![std::ptr::null(), std::ptr::null()],
                },
                Box::new(()),
            )
        };
        let counters = Arc::new(Counters::new(1));
        let config = ProxyConfig {
            ring_log2: 2,
            timeout,
            inline_tcp: true,
            ..ProxyConfig::default()
        };
        let proxy = match steps {
            Steps::ProxyThread => Proxy::start(fabric.clone(), counters.clone(), 1, config),
            Steps::Caller => Proxy::parked(fabric.clone(), counters.clone(), 1, config),
        }
        .unwrap();
        Lending {
            proxy,
            win,
            counters,
            keyed,
            base,
            _fabric: fabric,
            _mem: mem,
        }
    }

    impl Lending {
        fn put(&self, dst_off: u64, bytes: u64) -> Result<(), GinError> {
            self.proxy.put(&PutOp {
                ctx: 0,
                peer: 1,
                dst: &self.win,
                dst_off,
                src: Source::Window {
                    window: &self.win,
                    offset: 0,
                },
                bytes,
                signal: None,
                counter: Some(0),
            })
        }

        fn counted(&self) -> u64 {
            self.counters.slot(0).unwrap().load(Ordering::Acquire)
        }
    }

    /// Under `auto`, a put the transport lends its source to is issued by
    /// the calling thread (the proxy thread's turn on the engine taken
    /// there), still through the ring: its counter counts, and the ring
    /// publishes past it, only once the transport is done with the source,
    /// and a waiter's flush lands it on its own thread. A put queued behind
    /// it keeps its place: executed after it, counted only after it.
    /// (Before, the put waited in the ring for the proxy thread: with none,
    /// nothing was issued.)
    #[test]
    fn under_auto_a_lent_put_is_issued_and_landed_by_the_calling_thread_in_ring_order() {
        use gin_net::testing::KeyedOp;

        let r = lending();
        r.put(0, 8 << 10).unwrap();
        let ops = r.keyed.ops();
        assert!(
            matches!(ops[..], [KeyedOp::PutLent { src, len: 8192, .. }] if src == r.base as u64),
            "{ops:?}"
        );
        let ring = r.proxy.ring(0, 1);
        assert_eq!(
            (ring.head(), ring.tail()),
            (1, 0),
            "published past a lent put"
        );
        assert_eq!(r.counted(), 0, "counted before the transport was done");
        assert_eq!(r.keyed.lent_keepers(), 1);
        // A small put behind it: the ring is not empty, so it queues.
        r.put(64, 64).unwrap();
        assert_eq!(r.keyed.ops().len(), 1, "a copied put ran before the waiter");
        let t = r.proxy.ticket(0, None).unwrap();
        assert_eq!(r.proxy.done(&t), Ok(false));
        let ops = r.keyed.ops();
        assert!(
            matches!(
                ops[..],
                [KeyedOp::PutLent { .. }, KeyedOp::Put { offset: 64, .. }]
            ),
            "{ops:?}"
        );
        assert_eq!(r.counted(), 0, "the put behind the lent one counted first");
        assert_eq!(r.proxy.ring(0, 1).tail(), 0);
        r.keyed.complete_device_puts(1);
        assert_eq!(r.proxy.done(&t), Ok(true));
        assert_eq!(r.counted(), 2);
        assert_eq!(r.proxy.ring(0, 1).tail(), 2);
        assert_eq!(r.keyed.lent_keepers(), 0);
        assert_eq!(r.proxy.executed(), 2);
    }

    /// A lent put the engine refuses on the calling thread fails that
    /// call, naming the descriptor, and stops the proxy: nothing is
    /// issued, and every later call reports the same error.
    #[test]
    fn under_auto_a_refused_lent_put_fails_its_own_call_and_stops_the_proxy() {
        let r = lending();
        let e = r.put(16 << 10, 8 << 10).unwrap_err().to_string();
        assert!(
            e.contains("put #0 to rank 1 on context 0 failed")
                && e.contains("8192 bytes at offset 16384 exceed rank 1's 16384 bytes of window 0"),
            "{e}"
        );
        assert_eq!(r.put(0, 8 << 10).unwrap_err().to_string(), e);
        let t = r.proxy.ticket(0, None).unwrap();
        assert_eq!(r.proxy.done(&t).unwrap_err().to_string(), e);
        assert!(r.keyed.ops().is_empty(), "{:?}", r.keyed.ops());
        assert_eq!(r.counted(), 0);
    }

    /// Fail-stop on CPU ranks: a descriptor the engine refuses stops it;
    /// nothing issued after it is executed, and every later call reports
    /// the first error, naming the descriptor.
    #[test]
    fn after_an_invalid_descriptor_the_proxy_executes_nothing_more() {
        let r = rig(64, 1, 2);
        let bad = PutOp {
            ctx: 0,
            peer: 0,
            dst: &r.win,
            dst_off: 64,
            src: Source::Inline(7),
            bytes: 8,
            signal: None,
            counter: None,
        };
        r.proxy.put(&bad).unwrap();
        let good = PutOp {
            dst_off: 0,
            src: Source::Inline(42),
            ..bad
        };
        // Refused at once if the engine already failed; never run if not.
        let _ = r.proxy.put(&good);
        let e = flush(&r.proxy).unwrap_err().to_string();
        assert!(
            e.contains("put #0 to rank 0 on context 0 failed")
                && e.contains("8 bytes at offset 64 exceed rank 0's 64 bytes of window 0"),
            "{e}"
        );
        assert_eq!(r.mem[0], 0, "the put after the failure was executed");
        assert_eq!(r.proxy.health().unwrap_err().to_string(), e);
        let _ = &r.counters;
    }

    #[test]
    fn a_ring_outside_the_proxys_range_is_refused_at_start() {
        let fabric = Arc::new(Fabric::local(
            Arc::new(RegionTable::default()),
            Duration::from_secs(5),
        ));
        let counters = Arc::new(Counters::new(1));
        for log2 in [0, 17, 64] {
            let config = ProxyConfig {
                ring_log2: log2,
                ..ProxyConfig::default()
            };
            let e = Proxy::start(fabric.clone(), counters.clone(), 1, config)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!("queue depth 2^{log2}")) && e.contains("minimum 2"),
                "{e}"
            );
        }
        // The minimum works (see also gin-core's tests/backends.rs).
        let r = rig(64, 1, 1);
        flush(&r.proxy).unwrap();
    }

    #[test]
    fn the_host_backend_names_the_proxys_depths_and_starts_it() {
        use gin_device::{CpuStart, Exchange, HostBackend, HostError};
        struct Alone;
        impl Exchange for Alone {
            fn allgather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, HostError> {
                Ok(vec![mine.to_vec()])
            }
        }
        let b: &dyn HostBackend<Fabric, gin_cuda::Device> = &crate::ProxyBackend;
        assert_eq!(b.name(), "proxy");
        assert_eq!(b.queue_depths(), MIN_QUEUE_DEPTH..=MAX_QUEUE_DEPTH);
        assert_eq!(b.queue_log2(MIN_QUEUE_DEPTH - 1), None);
        assert_eq!(b.queue_log2(3), Some(2));
        assert_eq!(b.queue_log2(MAX_QUEUE_DEPTH), Some(16));
        assert_eq!(b.queue_log2(MAX_QUEUE_DEPTH + 1), None);
        let fabric = Arc::new(Fabric::local(
            Arc::new(RegionTable::default()),
            Duration::from_secs(5),
        ));
        let counters = Arc::new(Counters::new(1));
        let mut start = CpuStart {
            rank: 0,
            nranks: 1,
            fabric: &fabric,
            counters: &counters,
            nctx: 2,
            queue_log2: 1,
            exclusive_contexts: false,
            inline: false,
            batch: 1,
            timeout: Duration::from_secs(5),
            spin: Duration::from_micros(100),
            exchange: &Alone,
        };
        let p = b.start_cpu(&start).unwrap();
        assert_eq!(p.name(), "proxy");
        assert!(p.done(&p.ticket(1, None).unwrap()).unwrap());
        // Its own range is checked again at start.
        start.queue_log2 = 17;
        let e = b.start_cpu(&start).unwrap_err().to_string();
        assert!(e.contains("queue depth 2^17"), "{e}");
    }
}
