//! The GDAKI backend's device side for CPU ranks: what a kernel does, in
//! Rust. A put becomes RDMA writes (chunked at the transfer limit, inline
//! when the value is carried) and, for a signal, an atomic fetch-add on the
//! peer's signal slot; a counter becomes a WAIT on the main QP's completion
//! plus a fetch-add on the local counter, on the companion loopback QP.
//! WQEs are posted with the GPU's in-order protocol ([`crate::queue`]).
//! Every WQE asks for a CQE; flush polls for the CQE of the last reserved
//! WQE, and an error CQE is an error naming QP, WQE index and syndrome.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use gin_device::{
    Backend, Counters, Exchange, GetOp, GinError, Order, PutOp, Source, StartError, Ticket,
    TicketIssuer, Window,
};
use gin_net::Fabric;
use gin_net::sticky::StickyError;

use crate::completion::{Cqe, syndrome};
use crate::ids::{COUNTER_KEY, SINK_KEY, companion_qpn, main_qpn, window_key};
use crate::nic::{
    CqMode, CqView, DriverConfig, Engine, EngineConfig, FabricExecutor, Idle, QueueSpec, Sink,
    SoftNic, SqView, Waker,
};
use crate::qp::Qp;
use crate::queue::{Sharing, has_space, reached, wire_index};
use crate::wqe::{
    BuildError, CQ_UPDATE, FM_NONE, FM_STRONG_ORDERING, MAX_INLINE, MAX_TRANSFER, MemRef, Op,
    encode,
};

/// Settings of a GDAKI backend instance.
#[derive(Debug, Clone, Copy)]
pub struct GdakiConfig {
    /// log2 of basic blocks per send queue (and CQEs per CQ): from
    /// log2([`MIN_QUEUE_DEPTH`]) to [`MAX_SQ_LOG2`], else `start` fails.
    pub sq_log2: u32,
    /// How producers share a context's queues.
    pub sharing: Sharing,
    /// Ring the doorbell once this many WQEs are ready (1: every request),
    /// and always on flush, as NCCL's `AggregateRequests` and DeepEP's
    /// `kNumRequestInBatch` batch doorbells.
    pub batch: u64,
    /// How long any wait of the backend (queue credit, a turn to post, a
    /// read's answer) may take.
    pub timeout: Duration,
    /// How long the idle NIC polls before sleeping.
    pub spin: Duration,
}

impl Default for GdakiConfig {
    fn default() -> Self {
        Self {
            sq_log2: 8,
            sharing: Sharing::Gpu,
            batch: 1,
            timeout: Duration::from_secs(300),
            spin: Duration::from_micros(100),
        }
    }
}

/// A GDAKI backend instance with its soft NIC.
#[derive(Debug)]
pub struct Gdaki {
    rank: usize,
    nranks: usize,
    nctx: u32,
    main: Vec<Arc<Qp>>,
    companion: Vec<Arc<Qp>>,
    fabric: Arc<Fabric>,
    counters: Arc<Counters>,
    /// Where the NIC writes the old values of fetch-adds nobody reads (a
    /// signal's, a counter's). Shared with the NIC's executor, which may
    /// still write here after this backend is gone.
    sink: Arc<Sink>,
    error: StickyError,
    tickets: TicketIssuer,
    /// Some QP has ready WQEs whose doorbell batching held back.
    unrung: AtomicBool,
    waker: Waker,
    config: GdakiConfig,
    // Last, so it stops after nothing can post any more. Its thread may
    // outlive this backend (a stuck one is abandoned): what it writes it
    // owns (the counters' and the sink's `Arc`s in its executor, the QPs'
    // `Arc`s in its views, the windows' keep-alives), never borrows.
    nic: SoftNic,
}

/// Deepest send queue: WQE indices and WAIT targets are 16 bits wide and
/// must be unwrapped within half their range, with room to spare for a WAIT
/// that the NIC reaches a little after the main queue moved on.
pub const MAX_SQ_LOG2: u32 = 14;

/// The deepest queue (`queue_depth`) GDAKI accepts: `2^MAX_SQ_LOG2`.
pub const MAX_QUEUE_DEPTH: u32 = 1 << MAX_SQ_LOG2;

/// The shallowest queue (`queue_depth`) GDAKI accepts, on CPU and CUDA
/// ranks alike. An operation may take at most half a send queue, so that
/// producers keep streaming while the NIC completes the other half, and the
/// largest ordinary operation takes two WQEs on each queue: a put of up to
/// 1 GiB with a signal (an RDMA write, then a fetch-add) on the main QP,
/// and its counter (a WAIT, then a fetch-add) on the companion QP. Larger
/// puts take one more WQE per GiB and are refused, before anything is
/// posted, when they do not fit half the queue.
pub const MIN_QUEUE_DEPTH: u32 = 4;

/// WQEs the NIC takes from one QP before moving on to the next.
const NIC_BATCH: u64 = 64;

impl Gdaki {
    /// Creates one main QP per (context, peer) and one companion loopback QP
    /// for each, and starts the soft NIC that serves them.
    pub fn start(
        fabric: Arc<Fabric>,
        counters: Arc<Counters>,
        nctx: u32,
        config: GdakiConfig,
    ) -> Result<Self, GinError> {
        let rank = fabric.rank();
        let n = fabric.nranks();
        check_depth(rank, config.sq_log2)?;
        let (main, companion) = make_qps(rank, n, nctx, config.sq_log2)?;
        let sink = Arc::new(Sink::default());
        let exec = FabricExecutor::new(
            fabric.clone(),
            counters.clone(),
            sink.clone(),
            config.timeout,
        );
        let (counter_part, sink_part) = exec.local_parts();
        let ring = CqMode::Ring {
            log2: config.sq_log2,
        };
        // Main QPs, then companions; a QP and its companion share a channel.
        let specs = main
            .iter()
            .chain(&companion)
            .enumerate()
            .map(|(i, q)| QueueSpec {
                qpn: q.qpn,
                cqn: q.cq.cqn,
                peer: q.peer,
                channel: i % main.len().max(1),
                cq_mode: ring,
                sq: SqView::host(q),
                cq: CqView::host(q),
            })
            .collect();
        let cfg = EngineConfig {
            rank,
            nranks: n,
            counters: counter_part,
            sink: sink_part,
            batch: NIC_BATCH,
        };
        let unsupported = |why: String| GinError::Unsupported {
            rank,
            what: "GDAKI queues",
            why,
        };
        let engine = Engine::new(cfg, specs).map_err(|e| unsupported(e.to_string()))?;
        let driver = DriverConfig {
            name: format!("gin-softnic-{rank}"),
            idle: Idle::cpu(config.spin),
            drain_on_stop: false,
            join_within: config.timeout,
        };
        let nic = SoftNic::start(engine, exec, driver).map_err(|e| GinError::Spawn {
            rank,
            what: "soft NIC thread",
            why: e.to_string(),
        })?;
        Ok(Self {
            rank,
            nranks: n,
            nctx,
            waker: nic.waker(),
            main,
            companion,
            fabric,
            counters,
            sink,
            error: StickyError::default(),
            tickets: TicketIssuer::new(),
            unrung: AtomicBool::new(false),
            config,
            nic,
        })
    }

    /// QP numbers of the main QPs, (context, peer) order: exchanged with
    /// the peers so each QP knows the one it is connected to.
    pub fn qpns(&self) -> Vec<u32> {
        self.main.iter().map(|q| q.qpn).collect()
    }

    /// Records each main QP's remote end: `tables[p]` is rank `p`'s
    /// [`Gdaki::qpns`]. Fails when a table has the wrong shape.
    pub fn connect(&self, tables: &[Vec<u32>]) -> Result<(), GinError> {
        for c in 0..self.nctx as usize {
            for p in 0..self.nranks {
                let remote = tables
                    .get(p)
                    .and_then(|t| t.get(c * self.nranks + self.rank))
                    .copied()
                    .ok_or_else(|| {
                        self.failed(
                            c as u32,
                            "QP exchange".into(),
                            format!("rank {p} sent a short QP table"),
                        )
                    })?;
                self.main[c * self.nranks + p]
                    .remote_qpn
                    .store(remote, Ordering::Release);
            }
        }
        Ok(())
    }

    /// Exchanges QP numbers through `exchange` (collective), as a real
    /// NIC's connection set-up needs them, and records each main QP's
    /// remote end ([`Gdaki::connect`]).
    pub fn exchange_qpns(&self, exchange: &dyn Exchange) -> Result<(), StartError> {
        let mine: Vec<u8> = self.qpns().iter().flat_map(|q| q.to_le_bytes()).collect();
        let tables: Vec<Vec<u32>> = exchange
            .allgather(&mine)
            .map_err(StartError::Host)?
            .iter()
            .map(|t| {
                t.chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect()
            })
            .collect();
        Ok(self.connect(&tables)?)
    }

    /// WQEs the soft NIC executed so far.
    pub fn executed(&self) -> u64 {
        self.nic.executed()
    }

    fn main_qp(&self, ctx: u32, peer: usize) -> &Arc<Qp> {
        &self.main[ctx as usize * self.nranks + peer]
    }

    fn companion_qp(&self, ctx: u32, peer: usize) -> &Arc<Qp> {
        &self.companion[ctx as usize * self.nranks + peer]
    }

    /// Whether `qp` is a companion loopback QP.
    fn is_companion(&self, qp: &Qp) -> bool {
        qp.peer == self.rank && qp.qpn & 1 == 1
    }

    fn failed(&self, ctx: u32, what: String, why: String) -> GinError {
        GinError::Failed {
            rank: self.rank,
            ctx,
            what,
            why,
        }
    }

    fn reap(&self, ctx: u32, peer: usize, qp: &Qp) {
        let companion = self.is_companion(qp);
        qp.reap(|c: &Cqe| {
            let what = if companion {
                format!("companion QP {:#x}", c.qpn)
            } else {
                format!(
                    "QP {:#x} to rank {peer} (its QP {:#x})",
                    c.qpn,
                    qp.remote_qpn.load(Ordering::Acquire)
                )
            };
            // The NIC's queue order: main QPs, then companions.
            let k = ctx as usize * self.nranks + peer;
            let queue = if companion { self.main.len() + k } else { k };
            let why = self
                .nic
                .fault(queue)
                .map(|f| format!("; the soft NIC reported: {}", f.cause))
                .unwrap_or_default();
            self.error.set(format!(
                "{what}, context {ctx}: WQE index {} completed with syndrome {:#04x} ({}), vendor syndrome {:#04x}{why}",
                c.wqe_counter,
                c.syndrome,
                syndrome::name(c.syndrome),
                c.vendor_syndrome
            ));
        });
    }

    fn check(&self) -> Result<(), GinError> {
        if let Some(why) = self.error.get() {
            return Err(self.failed(0, "GDAKI completion".into(), why));
        }
        if !self.nic.alive() {
            let why = self.nic.first_error().map_or_else(
                || "the NIC thread stopped".to_string(),
                |e| format!("the NIC thread stopped: {e}"),
            );
            return Err(self.failed(0, "soft NIC".into(), why));
        }
        Ok(())
    }

    /// Refuses an operation that needs `k` WQEs on `qp`: more than half the
    /// queue. Checked for every queue an operation uses before any of it is
    /// posted, so a refused operation moves nothing.
    fn fits(&self, ctx: u32, peer: usize, qp: &Qp, k: u64) -> Result<(), GinError> {
        if k > qp.size() / 2 {
            return Err(GinError::Unsupported {
                rank: self.rank,
                what: "operation",
                why: format!(
                    "an operation to rank {peer} on context {ctx} needs {k} WQEs on QP {:#x}, \
                     more than half its {}-entry queue (queue_depth); nothing was posted",
                    qp.qpn,
                    qp.size()
                ),
            });
        }
        Ok(())
    }

    /// Reserves, fills and posts `ops` on `qp` (in reservation order,
    /// batching permitting); returns the index of the last WQE.
    fn submit(&self, ctx: u32, peer: usize, qp: &Qp, ops: &[(Op, u8)]) -> Result<u64, GinError> {
        let k = ops.len() as u64;
        self.fits(ctx, peer, qp, k)?;
        let start = qp.idx.reserve(k);
        let t0 = Instant::now();
        self.credit(ctx, peer, qp, start, k, t0)?;
        let failure = self.fill(qp, start, ops)?;
        self.post(ctx, peer, qp, start, start + k, t0)?;
        if let Some(e) = failure {
            return Err(GinError::Unsupported {
                rank: self.rank,
                what: "work request",
                why: e.to_string(),
            });
        }
        Ok(start + k - 1)
    }

    /// Waits until the `k` slots from `start` are free: their previous
    /// occupants completed.
    fn credit(
        &self,
        ctx: u32,
        peer: usize,
        qp: &Qp,
        start: u64,
        k: u64,
        t0: Instant,
    ) -> Result<(), GinError> {
        while !has_space(start, k, qp.idx.done.load(Ordering::Acquire), qp.size()) {
            self.reap(ctx, peer, qp);
            // The queue may be full of WQEs whose doorbell batching held back.
            qp.ring_held();
            self.waker.wake();
            let why = if let Err(e) = self.check() {
                Some(e.to_string())
            } else if t0.elapsed() > self.config.timeout {
                Some(format!(
                    "send queue of QP {:#x} stayed full for {:.1?} (last completion {})",
                    qp.qpn,
                    self.config.timeout,
                    qp.idx.done.load(Ordering::Acquire)
                ))
            } else {
                None
            };
            if let Some(why) = why {
                // Our slots are not free, so they cannot be filled: the QP is
                // broken from here on, and producers behind us learn it in
                // their own wait for a turn.
                self.error.set(why.clone());
                return Err(self.failed(ctx, format!("put to rank {peer}"), why));
            }
            std::thread::yield_now();
        }
        Ok(())
    }

    /// Fills the slots from `start` with `ops`. The slots are ours and
    /// free: every one is filled (NOPs after a WQE that cannot be built),
    /// so the turn to post can always move past them. Returns why a WQE
    /// could not be built, if one could not.
    fn fill(&self, qp: &Qp, start: u64, ops: &[(Op, u8)]) -> Result<Option<BuildError>, GinError> {
        let mut failure = None;
        for (i, (op, flags)) in ops.iter().enumerate() {
            let idx = start + i as u64;
            let built = if failure.is_none() {
                encode(op, wire_index(idx), qp.qpn, *flags | CQ_UPDATE)
                    .map_err(|e| failure = Some(e))
                    .ok()
            } else {
                None
            };
            let bytes = match built {
                Some(b) => b,
                None => encode(&Op::Nop, wire_index(idx), qp.qpn, CQ_UPDATE).map_err(|e| {
                    GinError::Unsupported {
                        rank: self.rank,
                        what: "work request",
                        why: e.to_string(),
                    }
                })?,
            };
            qp.write_wqe(idx, &bytes);
        }
        Ok(failure)
    }

    /// Posts `[start, end)` once every earlier range of `qp` is posted:
    /// the doorbell record and doorbell, unless batching holds them back.
    fn post(
        &self,
        ctx: u32,
        peer: usize,
        qp: &Qp,
        start: u64,
        end: u64,
        t0: Instant,
    ) -> Result<(), GinError> {
        // The companion QP is never batched: its WAIT names a 16-bit index of
        // the main queue and must reach the NIC while that index is recent.
        let batch = if self.is_companion(qp) {
            1
        } else {
            self.config.batch.max(1)
        };
        let mut held = false;
        let mut spins = 0u32;
        while !qp.try_post(start, end, self.config.sharing, |unrung| {
            held = unrung < batch;
            held
        }) {
            // An earlier range is still being filled or posted by another
            // thread, which may need this core, or failed (then the QP is
            // broken).
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
                continue;
            }
            std::thread::yield_now();
            if spins.is_multiple_of(256) {
                self.check()?;
                if t0.elapsed() > self.config.timeout {
                    let why = format!(
                        "WQEs before index {start} of QP {:#x} were never posted within {:.1?}",
                        qp.qpn, self.config.timeout
                    );
                    self.error.set(why.clone());
                    return Err(self.failed(ctx, format!("put to rank {peer}"), why));
                }
            }
        }
        if held {
            self.unrung.store(true, Ordering::Release);
        } else {
            self.waker.wake();
        }
        Ok(())
    }

    /// Posts a put's WQEs on the main QP and, for a counter, a WAIT on
    /// their completion and `bump` on the companion QP. Both queues are
    /// checked first: an operation either fits or moves nothing.
    fn post_put(
        &self,
        ctx: u32,
        peer: usize,
        ops: &[(Op, u8)],
        bump: Option<Op>,
    ) -> Result<(), GinError> {
        let qp = self.main_qp(ctx, peer);
        let cq = self.companion_qp(ctx, peer);
        self.fits(ctx, peer, qp, ops.len() as u64)?;
        if bump.is_some() {
            self.fits(ctx, peer, cq, 2)?;
        }
        let last = self.submit(ctx, peer, qp, ops)?;
        if let Some(bump) = bump {
            let wait = Op::Wait {
                max_index: u32::from(wire_index(last)),
                cqn: qp.cq.cqn,
            };
            self.submit(ctx, peer, cq, &[(wait, FM_NONE), (bump, FM_NONE)])?;
        }
        Ok(())
    }

    /// `(address, key)` of `offset` in `rank`'s part of `w`: the address
    /// from the window handle, as a kernel takes it, and the key from the
    /// NIC key scheme ([`window_key`]).
    fn mref(&self, w: &Window, rank: usize, offset: u64) -> Result<MemRef, GinError> {
        let key = window_key(w.id(), rank, self.nranks).ok_or_else(|| GinError::Unsupported {
            rank: self.rank,
            what: "window",
            why: format!(
                "window {} has no NIC key in a job of {} ranks (window ids run into the local keys)",
                w.id(),
                self.nranks
            ),
        })?;
        Ok(MemRef {
            addr: w.addr_of(rank) + offset,
            key,
        })
    }

    /// Where a fetch-add nobody reads leaves its old value: qword `i` of
    /// the sink.
    fn sink_ref(&self, i: u64) -> MemRef {
        MemRef {
            addr: self.sink.addr() + 8 * i,
            key: SINK_KEY,
        }
    }
}

/// Refuses a queue depth outside `[MIN_QUEUE_DEPTH, MAX_QUEUE_DEPTH]`.
fn check_depth(rank: usize, log2: u32) -> Result<(), GinError> {
    if log2 > MAX_SQ_LOG2 {
        return Err(GinError::Unsupported {
            rank,
            what: "queue depth",
            why: format!(
                "2^{log2} entries; at most 2^{MAX_SQ_LOG2}, so that 16-bit WQE indices stay unambiguous"
            ),
        });
    }
    if 1u32 << log2 < MIN_QUEUE_DEPTH {
        return Err(GinError::Unsupported {
            rank,
            what: "queue depth",
            why: format!(
                "queue depth {} is below the gdaki backend's minimum {MIN_QUEUE_DEPTH} \
                 (a put with a signal and a counter takes two WQEs of at most half of each queue)",
                1u32 << log2
            ),
        });
    }
    Ok(())
}

/// The main QP of each (context, peer) and its companion loopback QP,
/// numbered by the scheme CUDA ranks use ([`main_qpn`]).
type Qps = (Vec<Arc<Qp>>, Vec<Arc<Qp>>);

fn make_qps(rank: usize, n: usize, nctx: u32, log2: u32) -> Result<Qps, GinError> {
    let mut main = Vec::new();
    let mut companion = Vec::new();
    for c in 0..nctx as usize {
        for p in 0..n {
            let (Some(q), Some(cq)) = (main_qpn(c, p, n), companion_qpn(c, p, n)) else {
                return Err(GinError::Unsupported {
                    rank,
                    what: "contexts",
                    why: format!("{nctx} contexts of {n} QPs each need QP numbers beyond 24 bits"),
                });
            };
            main.push(Arc::new(Qp::new(q, q, p, log2)));
            companion.push(Arc::new(Qp::new(cq, cq, rank, log2)));
        }
    }
    Ok((main, companion))
}

impl Backend for Gdaki {
    fn name(&self) -> &'static str {
        "gdaki"
    }

    fn put(&self, op: &PutOp<'_>) -> Result<(), GinError> {
        self.check()?;
        let mut ops: Vec<(Op, u8)> = Vec::new();
        match op.src {
            Source::Inline(v) => ops.push((
                Op::WriteInline {
                    remote: self.mref(op.dst, op.peer, op.dst_off)?,
                    data: v.to_le_bytes()[..(op.bytes as usize).min(MAX_INLINE).min(8)].to_vec(),
                },
                FM_NONE,
            )),
            Source::Window { window, offset } => {
                let mut done = 0;
                while done < op.bytes {
                    let len = (op.bytes - done).min(MAX_TRANSFER);
                    ops.push((
                        Op::Write {
                            remote: self.mref(op.dst, op.peer, op.dst_off + done)?,
                            local: self.mref(window, self.rank, offset + done)?,
                            len: len as u32,
                        },
                        FM_NONE,
                    ));
                    done += len;
                }
            }
            Source::Empty => {}
        }
        if let Some(s) = &op.signal {
            // Strong: ordered after every earlier WQE of this QP. The soft NIC
            // executes a QP in order anyway; hardware honours the fence mode.
            let fence = if s.order == Order::Strong {
                FM_STRONG_ORDERING
            } else {
                FM_NONE
            };
            ops.push((
                Op::FetchAdd {
                    remote: self.mref(s.window, op.peer, s.offset)?,
                    add: s.add,
                    result: self.sink_ref(0),
                },
                fence,
            ));
        }
        if ops.is_empty() {
            ops.push((Op::Nop, FM_NONE));
        }
        // The counter: the companion QP waits for the main QP's completion
        // of the last WQE, then bumps the counter (the source is reusable).
        let bump = op.counter.map(|slot| Op::FetchAdd {
            remote: MemRef {
                addr: self.counters.as_ptr() as u64 + slot * 8,
                key: COUNTER_KEY,
            },
            add: 1,
            result: self.sink_ref(1),
        });
        self.post_put(op.ctx, op.peer, &ops, bump)
    }

    fn get(&self, op: &GetOp<'_>) -> Result<(), GinError> {
        self.check()?;
        let mut ops = Vec::new();
        let mut done = 0;
        while done < op.bytes {
            let len = (op.bytes - done).min(MAX_TRANSFER);
            ops.push((
                Op::Read {
                    remote: self.mref(op.remote, op.peer, op.remote_off + done)?,
                    local: self.mref(op.local, self.rank, op.local_off + done)?,
                    len: len as u32,
                },
                FM_NONE,
            ));
            done += len;
        }
        if ops.is_empty() {
            return Ok(());
        }
        self.submit(op.ctx, op.peer, self.main_qp(op.ctx, op.peer), &ops)
            .map(drop)
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
        let peers: Vec<usize> = peer.map_or_else(|| (0..self.nranks).collect(), |p| vec![p]);
        let mut marks = Vec::with_capacity(peers.len() * 2);
        for &p in &peers {
            for qp in [self.main_qp(ctx, p), self.companion_qp(ctx, p)] {
                // Flush rings whatever batching held back.
                qp.ring_held();
                marks.push(qp.idx.resv.load(Ordering::Acquire));
            }
        }
        self.waker.wake();
        Ok(self.tickets.issue(ctx, peer, marks))
    }

    fn done(&self, t: &Ticket) -> Result<bool, GinError> {
        // Two marks per peer: the main and companion QPs' reservation
        // indices when the ticket was issued.
        let marks = self
            .tickets
            .redeem(self.rank, t, self.nctx, self.nranks, 2)?;
        let ctx = t.ctx();
        let peers: Vec<usize> = t
            .peer()
            .map_or_else(|| (0..self.nranks).collect(), |p| vec![p]);
        let mut all = true;
        for (&p, pair) in peers.iter().zip(marks.chunks_exact(2)) {
            for (qp, &mark) in [self.main_qp(ctx, p), self.companion_qp(ctx, p)]
                .into_iter()
                .zip(pair)
            {
                self.reap(ctx, p, qp);
                if !reached(qp.idx.done.load(Ordering::Acquire), mark) {
                    all = false;
                    // WQEs another thread posted after the ticket, held
                    // back by batching, are covered too.
                    qp.ring_held();
                }
            }
        }
        self.check()?;
        if !all {
            self.waker.wake();
            return Ok(false);
        }
        // Over tcp a write's CQE means "sent": have the targets confirm, so
        // a refused write is reported by this completion (as a hardware
        // CQE comes after the remote ACK).
        for &p in &peers {
            self.fabric.confirm(p).map_err(|e| GinError::Failed {
                rank: self.rank,
                ctx,
                what: format!("completion of operations to rank {p}"),
                why: e.to_string(),
            })?;
        }
        Ok(true)
    }

    fn progress(&self) {
        if self.unrung.swap(false, Ordering::AcqRel) {
            for qp in self.main.iter().chain(&self.companion) {
                qp.ring_held();
            }
            self.waker.wake();
        }
    }

    fn health(&self) -> Result<(), GinError> {
        // Completions are reaped here too, so a wait on a signal or counter
        // learns of an error CQE without a flush.
        for c in 0..self.nctx {
            for p in 0..self.nranks {
                self.reap(c, p, self.main_qp(c, p));
                self.reap(c, p, self.companion_qp(c, p));
            }
        }
        self.check()?;
        self.fabric.health().map_err(|e| GinError::JobFailed {
            rank: self.rank,
            why: e.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loopback::Loopback;
    use gin_device::{Local, PutOp, SignalUpdate};

    /// One rank, one window of `len` bytes, and a GDAKI backend with a
    /// queue of `2^log2` entries. Fields drop in order: the backend (and its
    /// NIC) before the memory.
    struct Rig {
        g: Gdaki,
        win: Window,
        counters: Arc<Counters>,
        _lb: Loopback,
    }

    fn rig(len: usize, log2: u32) -> Rig {
        rig_with(len, log2, 1)
    }

    fn rig_with(len: usize, log2: u32, nctx: u32) -> Rig {
        let lb = Loopback::new(len, Duration::from_secs(5));
        let counters = Arc::new(Counters::new(4));
        let config = GdakiConfig {
            sq_log2: log2,
            timeout: Duration::from_secs(5),
            ..GdakiConfig::default()
        };
        let g = Gdaki::start(lb.fabric.clone(), counters.clone(), nctx, config).unwrap();
        Rig {
            g,
            win: lb.window.clone(),
            counters,
            _lb: lb,
        }
    }

    fn flush(g: &Gdaki) -> Result<(), GinError> {
        let t = g.ticket(0, None)?;
        let start = Instant::now();
        while !g.done(&t)? {
            assert!(start.elapsed() < Duration::from_secs(5), "flush hung");
            std::thread::yield_now();
        }
        Ok(())
    }

    #[test]
    fn writes_signals_and_counters_land_across_cq_wraparound() {
        let r = rig(4096, 2); // 4-entry queues: many laps of the owner bit
        for i in 0..50u64 {
            r.win.write(0, &i.to_le_bytes()).unwrap();
            r.g.put(&PutOp {
                ctx: 0,
                peer: 0,
                dst: &r.win,
                dst_off: 64 + 8 * (i % 8),
                src: Source::Window {
                    window: &r.win,
                    offset: 0,
                },
                bytes: 8,
                signal: Some(SignalUpdate {
                    window: &r.win,
                    offset: 1024,
                    add: 3,
                    order: Order::Strong,
                }),
                counter: Some(2),
            })
            .unwrap();
            flush(&r.g).unwrap();
            let got = u64::from_le_bytes(
                r.win
                    .read_vec(64 + 8 * (i % 8), 8)
                    .unwrap()
                    .try_into()
                    .unwrap(),
            );
            assert_eq!(got, i);
        }
        assert_eq!(r.win.slot(1024).unwrap().load(Ordering::Acquire), 150);
        assert_eq!(r.counters.slot(2).unwrap().load(Ordering::Acquire), 50);
        let _ = Local::None;
    }

    fn expect_error(r: &Rig, want: &[&str]) {
        let e = flush(&r.g).unwrap_err().to_string();
        for w in want {
            assert!(e.contains(w), "error {e:?} does not mention {w:?}");
        }
        // The QP is in the error state: later work fails too, never hangs.
        let e2 = r.g.put(&PutOp {
            ctx: 0,
            peer: 0,
            dst: &r.win,
            dst_off: 0,
            src: Source::Inline(1),
            bytes: 8,
            signal: None,
            counter: None,
        });
        assert!(e2.is_err() || flush(&r.g).is_err());
    }

    #[test]
    fn a_bad_rkey_is_a_remote_access_error_naming_qp_and_wqe() {
        let r = rig(4096, 4);
        let good = r.g.mref(&r.win, 0, 0).unwrap();
        let bad = MemRef {
            addr: good.addr,
            key: good.key ^ 0x5a5a,
        };
        r.g.submit(
            0,
            0,
            r.g.main_qp(0, 0),
            &[(
                Op::Write {
                    remote: bad,
                    local: good,
                    len: 8,
                },
                FM_NONE,
            )],
        )
        .unwrap();
        expect_error(
            &r,
            &[
                "QP 0x100 to rank 0",
                "WQE index 0",
                "syndrome 0x13",
                "remote access error",
            ],
        );
    }

    #[test]
    fn an_out_of_bounds_remote_address_is_refused() {
        let r = rig(4096, 4);
        let good = r.g.mref(&r.win, 0, 0).unwrap();
        let past = MemRef {
            addr: good.addr + 4090,
            key: good.key,
        };
        // A valid first WQE, then the bad one: the error names index 1.
        r.g.submit(
            0,
            0,
            r.g.main_qp(0, 0),
            &[
                (Op::Nop, FM_NONE),
                (
                    Op::Write {
                        remote: past,
                        local: good,
                        len: 8,
                    },
                    FM_NONE,
                ),
            ],
        )
        .unwrap();
        expect_error(&r, &["WQE index 1", "syndrome 0x13"]);
        assert!(
            r.win.read_vec(0, 4096).unwrap().iter().all(|&b| b == 0),
            "a refused write moved data"
        );
    }

    #[test]
    fn a_corrupted_wqe_is_a_local_qp_operation_error() {
        let r = rig(4096, 4);
        let qp = r.g.main_qp(0, 0);
        let idx = qp.idx.reserve(1);
        qp.write_wqe(idx, &[0xff; 64]);
        assert!(qp.try_post(idx, idx + 1, Sharing::Gpu, |_| false));
        r.g.waker.wake();
        expect_error(
            &r,
            &["WQE index 0", "syndrome 0x02", "local QP operation error"],
        );
    }

    #[test]
    fn a_counter_behind_a_failed_put_fails_too() {
        let r = rig(4096, 4);
        let good = r.g.mref(&r.win, 0, 0).unwrap();
        let bad = MemRef {
            addr: good.addr,
            key: good.key ^ 1,
        };
        let last =
            r.g.submit(
                0,
                0,
                r.g.main_qp(0, 0),
                &[(
                    Op::Write {
                        remote: bad,
                        local: good,
                        len: 8,
                    },
                    FM_NONE,
                )],
            )
            .unwrap();
        let wait = Op::Wait {
            max_index: u32::from(wire_index(last)),
            cqn: r.g.main_qp(0, 0).cq.cqn,
        };
        r.g.submit(0, 0, r.g.companion_qp(0, 0), &[(wait, FM_NONE)])
            .unwrap();
        let e = flush(&r.g).unwrap_err().to_string();
        assert!(e.contains("syndrome"), "{e}");
        assert_eq!(r.counters.slot(0).unwrap().load(Ordering::Acquire), 0);
    }

    #[test]
    fn a_ticket_from_another_communicator_is_an_error_not_a_panic() {
        let a = rig(4096, 4);
        let b = rig_with(4096, 4, 3);
        // A context this instance does not have.
        let t = b.g.ticket(2, None).unwrap();
        let e = a.g.done(&t).unwrap_err().to_string();
        assert!(e.contains("ticket") && e.contains("another"), "{e}");
        // The same shape as one of ours, but not ours.
        let t = b.g.ticket(0, Some(0)).unwrap();
        let e = a.g.done(&t).unwrap_err().to_string();
        assert!(e.contains("ticket") && e.contains("another"), "{e}");
        // Ours is fine.
        let t = a.g.ticket(0, Some(0)).unwrap();
        assert_eq!(a.g.done(&t), Ok(true));
        assert!(matches!(
            a.g.ticket(0, Some(1)),
            Err(GinError::BadPeer { peer: 1, .. })
        ));
    }

    #[test]
    fn a_doorbell_record_that_moved_backwards_is_one_fatal_qp_error_and_nothing_runs() {
        let r = rig(4096, 2);
        for i in 0..2u64 {
            r.g.put(&PutOp {
                ctx: 0,
                peer: 0,
                dst: &r.win,
                dst_off: 8 * i,
                src: Source::Inline(0x1111 * (i + 1)),
                bytes: 8,
                signal: None,
                counter: None,
            })
            .unwrap();
        }
        flush(&r.g).unwrap();
        let qp = r.g.main_qp(0, 0);
        // Every CQE the NIC wrote so far was reaped by the flush.
        let cqes = qp.cq.polled();
        let executed = r.g.executed();
        let before = r.win.read_vec(0, 4096).unwrap();
        // The record moves back by one: read as 0xffff WQEs ahead of the
        // NIC's consumer index (2) on a 4-entry queue.
        qp.ring(1);
        // Every wait reaps completions through `health`; poll it until the
        // NIC has looked at the record.
        let start = Instant::now();
        let e = loop {
            r.g.waker.wake();
            if let Err(e) = r.g.health() {
                break e.to_string();
            }
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "no error reported"
            );
            std::thread::yield_now();
        };
        assert!(flush(&r.g).is_err(), "the error is sticky");
        for w in [
            "QP 0x100",
            "producer index 1",
            "consumer index 2",
            "4-entry",
        ] {
            assert!(e.contains(w), "error {e:?} does not mention {w:?}");
        }
        // Reported once, nothing executed, however often the NIC looks.
        for _ in 0..200 {
            r.g.waker.wake();
            std::thread::yield_now();
        }
        assert!(r.g.health().is_err(), "reaps whatever the NIC wrote since");
        assert_eq!(qp.cq.polled(), cqes + 1);
        assert_eq!(r.g.executed(), executed);
        assert_eq!(r.win.read_vec(0, 4096).unwrap(), before);
    }

    #[test]
    fn a_queue_shallower_than_the_minimum_is_refused_at_start() {
        let lb = Loopback::new(64, Duration::from_secs(5));
        let counters = Arc::new(Counters::new(1));
        for log2 in [0, 1] {
            let config = GdakiConfig {
                sq_log2: log2,
                ..GdakiConfig::default()
            };
            let e = Gdaki::start(lb.fabric.clone(), counters.clone(), 1, config)
                .unwrap_err()
                .to_string();
            let want = format!(
                "queue depth {} is below the gdaki backend's minimum 4",
                1 << log2
            );
            assert!(e.contains(&want), "{e}");
        }
    }

    /// An exchange that answers with what it was given, or fails.
    struct Echo(Option<&'static str>);
    impl Exchange for Echo {
        fn allgather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, gin_device::HostError> {
            match self.0 {
                Some(why) => Err(why.into()),
                None => Ok(vec![mine.to_vec()]),
            }
        }
    }

    #[test]
    fn the_host_backend_starts_gdaki_with_its_depths_and_exchanges_qp_numbers() {
        use gin_device::{CpuStart, HostBackend};
        let b: &dyn HostBackend<Fabric, gin_cuda::Device> = &crate::GdakiBackend;
        assert_eq!(b.name(), "gdaki");
        assert_eq!(b.queue_depths(), MIN_QUEUE_DEPTH..=MAX_QUEUE_DEPTH);
        assert_eq!(b.queue_log2(3), None);
        assert_eq!(b.queue_log2(5), Some(3));
        assert_eq!(b.queue_log2(MAX_QUEUE_DEPTH), Some(MAX_SQ_LOG2));
        assert_eq!(b.queue_log2(MAX_QUEUE_DEPTH + 1), None);
        let lb = Loopback::new(64, Duration::from_secs(5));
        let counters = Arc::new(Counters::new(1));
        let mut start = CpuStart {
            rank: 0,
            nranks: 1,
            fabric: &lb.fabric,
            counters: &counters,
            nctx: 2,
            queue_log2: 2,
            exclusive_contexts: true,
            inline: false,
            batch: 1,
            timeout: Duration::from_secs(5),
            spin: Duration::from_micros(100),
            exchange: &Echo(None),
        };
        let g = b.start_cpu(&start).unwrap();
        assert_eq!(g.name(), "gdaki");
        drop(g);
        // The exchange's own error comes back unchanged.
        start.exchange = &Echo(Some("rank 1 died"));
        match b.start_cpu(&start) {
            Err(StartError::Host(e)) => assert_eq!(e.to_string(), "rank 1 died"),
            other => panic!("{other:?}"),
        }
        // The QP numbers land where connect puts them.
        let config = GdakiConfig {
            sq_log2: 2,
            ..GdakiConfig::default()
        };
        let g = Gdaki::start(lb.fabric.clone(), counters.clone(), 2, config).unwrap();
        g.exchange_qpns(&Echo(None)).unwrap();
        for (c, q) in g.main.iter().enumerate() {
            assert_eq!(q.remote_qpn.load(Ordering::Acquire), g.qpns()[c]);
        }
    }

    /// 8-byte writes from offset 0 to `dst_off..`, one WQE each.
    fn writes(r: &Rig, dst_off: u64, n: u64) -> Vec<(Op, u8)> {
        (0..n)
            .map(|i| {
                (
                    Op::Write {
                        remote: r.g.mref(&r.win, 0, dst_off + 8 * i).unwrap(),
                        local: r.g.mref(&r.win, 0, 0).unwrap(),
                        len: 8,
                    },
                    FM_NONE,
                )
            })
            .collect()
    }

    #[test]
    fn an_operation_too_large_for_a_queue_is_refused_before_anything_is_posted() {
        let r = rig(4096, 2); // the minimum: 4 entries, 2 per operation
        r.win.write(0, &[7u8; 8]).unwrap();
        let bump = || Op::FetchAdd {
            remote: MemRef {
                addr: r.counters.as_ptr() as u64 + 8,
                key: COUNTER_KEY,
            },
            add: 1,
            result: r.g.sink_ref(1),
        };
        // Three WQEs (a put of more than 2 GiB with a signal, in small):
        // more than half the main queue.
        let e =
            r.g.post_put(0, 0, &writes(&r, 64, 3), Some(bump()))
                .unwrap_err();
        let e = e.to_string();
        assert!(
            e.contains("needs 3 WQEs") && e.contains("nothing was posted"),
            "{e}"
        );
        // Nothing was reserved, so nothing can land, and the queue is
        // still usable: the largest operation at the minimum depth works.
        assert_eq!(r.g.main_qp(0, 0).idx.resv.load(Ordering::Acquire), 0);
        assert_eq!(r.g.companion_qp(0, 0).idx.resv.load(Ordering::Acquire), 0);
        r.g.post_put(0, 0, &writes(&r, 128, 2), Some(bump()))
            .unwrap();
        flush(&r.g).unwrap();
        assert_eq!(
            r.win.read_vec(64, 24).unwrap(),
            vec![0u8; 24],
            "refused data landed"
        );
        assert_eq!(r.win.read_vec(128, 16).unwrap(), vec![7u8; 16]);
        assert_eq!(r.counters.slot(1).unwrap().load(Ordering::Acquire), 1);
    }
}
