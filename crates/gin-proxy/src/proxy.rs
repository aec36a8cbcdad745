//! The proxy backend: device-side enqueue (for CPU ranks) and the proxy
//! thread that drains the rings through gin-net.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use gin_device::{Backend, Counters, GetOp, GinError, PutOp, Source, Ticket, TicketIssuer};
use gin_net::idle::Sleeper;
use gin_net::{Addr, Fabric};
use tracing::{debug, error};

use crate::descriptor::{Desc, Op, Sig, Slot};
use crate::ring::{Ring, passed};

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
    /// CPU ranks only: a put to a peer reached over TCP whose ring is empty
    /// is sent by the calling thread instead of the proxy thread. Ordering
    /// holds because an empty ring means everything queued before was
    /// already written to the same ordered link. Off for pure-proxy runs.
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

#[derive(Debug)]
struct Shared {
    rank: usize,
    nranks: usize,
    nctx: u32,
    rings: Vec<Ring>,
    fabric: Arc<Fabric>,
    counters: Arc<Counters>,
    error: gin_net::sticky::StickyError,
    stop: AtomicBool,
    sleeper: Sleeper,
    config: ProxyConfig,
    executed: AtomicU64,
}

/// A proxy backend instance: rings for every (context, peer) and the thread
/// that drains them. Dropping it stops the thread.
#[derive(Debug)]
pub struct Proxy {
    shared: Arc<Shared>,
    tickets: TicketIssuer,
    thread: Option<JoinHandle<()>>,
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
        let shared = Arc::new(Shared {
            rank,
            nranks,
            nctx,
            rings: (0..nctx as usize * nranks)
                .map(|_| Ring::new(config.ring_log2))
                .collect(),
            fabric,
            counters,
            error: gin_net::sticky::StickyError::default(),
            stop: AtomicBool::new(false),
            sleeper: Sleeper::default(),
            config,
            executed: AtomicU64::new(0),
        });
        let s = shared.clone();
        let handle = thread::Builder::new()
            .name(format!("gin-proxy-{rank}"))
            .spawn(move || run(&s))
            .map_err(|e| GinError::Spawn {
                rank,
                what: "proxy thread",
                why: e.to_string(),
            })?;
        shared.sleeper.set_thread(handle.thread().clone());
        Ok(Self {
            shared,
            tickets: TicketIssuer::new(),
            thread: Some(handle),
        })
    }

    /// Descriptors executed so far (for benchmarks and tests).
    pub fn executed(&self) -> u64 {
        self.shared.executed.load(Ordering::Relaxed)
    }

    fn ring(&self, ctx: u32, peer: usize) -> &Ring {
        &self.shared.rings[ctx as usize * self.shared.nranks + peer]
    }

    fn enqueue(&self, ctx: u32, peer: usize, d: &Desc) -> Result<(), GinError> {
        let s = &self.shared;
        d.validate().map_err(|e| GinError::Unsupported {
            rank: s.rank,
            what: "operation",
            why: e.to_string(),
        })?;
        self.health()?;
        let ring = self.ring(ctx, peer);
        let seq = ring.reserve();
        if !ring.can_write(seq) {
            let start = Instant::now();
            let mut spins = 0u32;
            while !ring.can_write(seq) {
                s.wake();
                spins += 1;
                if spins < 100 {
                    std::hint::spin_loop();
                    continue;
                }
                thread::yield_now();
                if spins.is_multiple_of(256) {
                    // Another producer may have failed the backend already.
                    self.health()?;
                }
                if start.elapsed() > s.config.timeout {
                    // The slot stays reserved: the ring cannot make progress
                    // past it, so the backend is broken from here on.
                    let why = format!(
                        "descriptor ring for context {ctx}, peer {peer} stayed full for {:.1?} (proxy stalled)",
                        s.config.timeout
                    );
                    s.fail(why.clone());
                    return Err(GinError::Failed {
                        rank: s.rank,
                        ctx,
                        what: format!("enqueue to rank {peer}"),
                        why,
                    });
                }
            }
        }
        ring.write(seq, d);
        s.wake();
        Ok(())
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.sleeper.unpark();
        if let Some(h) = self.thread.take() {
            // Its sends end within the timeout (gin-net's deadlines), so the
            // wait is bounded; a thread stuck anyway is abandoned, not joined
            // forever.
            gin_net::idle::join_within(h, self.shared.config.timeout, "proxy");
        }
    }
}

impl Shared {
    fn fail(&self, why: String) {
        if self.error.set(why.clone()) {
            error!(rank = self.rank, %why, "proxy backend failed");
        }
    }

    /// Wakes the proxy thread if it went to sleep (no descriptor is left
    /// unseen: see [`Sleeper`]).
    fn wake(&self) {
        self.sleeper.wake();
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
                rank: self.shared.rank,
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
        if self.shared.config.inline_tcp
            && self.shared.fabric.reach(op.peer) == Some(gin_net::Reach::Keyed)
        {
            let ring = self.ring(op.ctx, op.peer);
            if ring.head() == ring.tail() {
                d.validate().map_err(|e| GinError::Unsupported {
                    rank: self.shared.rank,
                    what: "operation",
                    why: e.to_string(),
                })?;
                self.health()?;
                return execute_put(&self.shared, op.peer, &d).map_err(|why| {
                    let why = format!(
                        "put to rank {} on context {} failed: {why}",
                        op.peer, op.ctx
                    );
                    self.shared.fail(why.clone());
                    GinError::Failed {
                        rank: self.shared.rank,
                        ctx: op.ctx,
                        what: format!("put to rank {}", op.peer),
                        why,
                    }
                });
            }
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
        let s = &self.shared;
        if ctx >= s.nctx {
            return Err(GinError::BadContext {
                rank: s.rank,
                ctx,
                nctx: s.nctx,
            });
        }
        if let Some(p) = peer.filter(|&p| p >= s.nranks) {
            return Err(GinError::BadPeer {
                rank: s.rank,
                peer: p,
                nranks: s.nranks,
            });
        }
        let marks = match peer {
            Some(p) => vec![self.ring(ctx, p).head()],
            None => (0..s.nranks).map(|p| self.ring(ctx, p).head()).collect(),
        };
        Ok(self.tickets.issue(ctx, peer, marks))
    }

    fn done(&self, t: &Ticket) -> Result<bool, GinError> {
        let s = &self.shared;
        // One mark per peer: the ring's head when the ticket was issued.
        let marks = self.tickets.redeem(s.rank, t, s.nctx, s.nranks, 1)?;
        let peers: Vec<usize> = match t.peer() {
            Some(p) => vec![p],
            None => (0..s.nranks).collect(),
        };
        let mut complete = true;
        for (&p, mark) in peers.iter().zip(marks) {
            let ring = self.ring(t.ctx(), p);
            if !passed(ring.tail(), *mark) || ring.gets_in_flight.load(Ordering::Acquire) != 0 {
                complete = false;
                break;
            }
        }
        // Health after completion: a failure recorded before an operation was
        // released (a get whose link broke) is seen here, not missed.
        self.health()?;
        if !complete {
            s.wake();
            return Ok(false);
        }
        // Every put covered was written; over tcp, have the targets confirm
        // them, so a refused put (and its signal, never applied) is reported
        // by this completion, not by some later call.
        for p in peers {
            s.fabric.confirm(p).map_err(|e| {
                let why = format!("put to rank {p} on context {} refused: {e}", t.ctx());
                s.fail(why.clone());
                GinError::Failed {
                    rank: s.rank,
                    ctx: t.ctx(),
                    what: format!("completion of operations to rank {p}"),
                    why,
                }
            })?;
        }
        Ok(true)
    }

    fn health(&self) -> Result<(), GinError> {
        let s = &self.shared;
        if let Some(why) = s.error.get() {
            return Err(GinError::Failed {
                rank: s.rank,
                ctx: 0,
                what: "proxy backend".into(),
                why,
            });
        }
        s.fabric.health().map_err(|e| GinError::JobFailed {
            rank: s.rank,
            why: e.to_string(),
        })
    }
}

/// The proxy thread.
fn run(s: &Shared) {
    let mut cursors = vec![0u64; s.rings.len()];
    let mut idle = 0u32;
    let mut idle_since = Instant::now();
    while !s.stop.load(Ordering::Relaxed) {
        let mut did = 0u64;
        for (i, ring) in s.rings.iter().enumerate() {
            let start = cursors[i];
            let mut seq = start;
            while seq.wrapping_sub(start) < BATCH {
                match ring.peek(seq) {
                    Ok(Slot::Pending) => break,
                    Ok(Slot::Ready(d)) => {
                        execute(s, i, seq, &d, ring);
                        seq = seq.wrapping_add(1);
                    }
                    Err(e) => {
                        s.fail(format!("corrupt descriptor: {e}"));
                        seq = seq.wrapping_add(1);
                    }
                }
            }
            if seq != start {
                ring.advance(seq);
                cursors[i] = seq;
                did += seq.wrapping_sub(start);
            }
        }
        if did > 0 {
            s.executed.fetch_add(did, Ordering::Relaxed);
            idle = 0;
            continue;
        }
        if idle == 0 {
            idle_since = Instant::now();
        }
        idle = idle.saturating_add(1);
        if idle < 64 {
            std::hint::spin_loop();
        } else if idle_since.elapsed() < s.config.spin {
            // Yielding keeps the proxy responsive without starving ranks
            // that share its core; a parked proxy costs a wake-up (µs).
            thread::yield_now();
        } else {
            // Sleep until a producer wakes us (or 2 ms pass).
            s.sleeper.sleep(Duration::from_millis(2), || {
                s.rings
                    .iter()
                    .zip(&cursors)
                    .any(|(r, &c)| !matches!(r.peek(c), Ok(Slot::Pending)))
            });
        }
    }
    debug!(rank = s.rank, "proxy thread stopped");
}

fn execute(s: &Shared, ring_index: usize, seq: u64, d: &Desc, ring: &Ring) {
    let peer = ring_index % s.nranks;
    let ctx = ring_index / s.nranks;
    let r = match d.op {
        Op::Put => execute_put(s, peer, d),
        Op::Get => execute_get(s, peer, d, ring),
    };
    if let Err(why) = r {
        s.fail(format!(
            "{:?} #{seq} to rank {peer} on context {ctx} failed: {why}",
            d.op
        ));
    }
}

fn execute_put(s: &Shared, peer: usize, d: &Desc) -> Result<(), String> {
    let inline_bytes;
    // Held until the put is done: the description keeps the source mapped
    // even if its owner drops the window meanwhile.
    let w;
    let src: &[u8] = if let Some(v) = d.inline {
        inline_bytes = v.to_le_bytes();
        &inline_bytes[..(d.bytes as usize).min(8)]
    } else if d.bytes == 0 {
        &[]
    } else {
        w = s.fabric.window(d.src_window).map_err(|e| e.to_string())?;
        let size = w.sizes.get(s.rank).copied().unwrap_or(0);
        if d.src_offset.checked_add(d.bytes).is_none_or(|e| e > size) {
            return Err(format!(
                "source range {}+{} outside window {} ({size} bytes)",
                d.src_offset, d.bytes, d.src_window
            ));
        }
        // SAFETY: the range lies inside this rank's part of a registered
        // window, which stays mapped while `w` is held; the device API
        // checked it at issue time and it is re-checked above.
        unsafe {
            std::slice::from_raw_parts(
                (w.local_base + d.src_offset as usize) as *const u8,
                d.bytes as usize,
            )
        }
    };
    let sig = d.signal.map(|g| {
        (
            Addr {
                window: g.window,
                offset: g.offset,
            },
            g.add,
        )
    });
    s.fabric
        .put(
            peer,
            Addr {
                window: d.dst_window,
                offset: d.dst_offset,
            },
            src,
            sig,
        )
        .map_err(|e| e.to_string())?;
    if let Some(c) = d.counter {
        s.counters.bump(u64::from(c));
    }
    Ok(())
}

fn execute_get(s: &Shared, peer: usize, d: &Desc, ring: &Ring) -> Result<(), String> {
    let w = s.fabric.window(d.src_window).map_err(|e| e.to_string())?;
    let size = w.sizes.get(s.rank).copied().unwrap_or(0);
    if d.src_offset.checked_add(d.bytes).is_none_or(|e| e > size) {
        return Err(format!("get destination outside window {}", d.src_window));
    }
    ring.gets_in_flight.fetch_add(1, Ordering::AcqRel);
    // SAFETY: the destination lies inside this rank's registered part (checked
    // above). The transport holds the window's keep-alive until the answer
    // has landed, so a window its owner drops with the get in flight stays
    // mapped until then; a window without one (its owner keeps the memory)
    // outlives every context by construction.
    let r = unsafe {
        s.fabric.get(
            peer,
            Addr {
                window: d.dst_window,
                offset: d.dst_offset,
            },
            (w.local_base + d.src_offset as usize) as *mut u8,
            d.bytes,
            &ring.gets_in_flight,
            w.keep.clone(),
        )
    };
    r.map_err(|e| {
        ring.gets_in_flight.fetch_sub(1, Ordering::AcqRel);
        e.to_string()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use gin_device::{Window, WindowParts};
    use gin_net::region::{Access, RegionTable};
    use gin_net::{MemDesc, MemParts};

    /// One rank, window 0 over `len` bytes of memory it owns, and a proxy
    /// with `nctx` contexts and rings of `2^log2` descriptors. Fields drop in
    /// order: the proxy (and its thread) before the memory.
    struct Rig {
        proxy: Proxy,
        win: Window,
        counters: Arc<Counters>,
        _fabric: Arc<Fabric>,
        _mem: Box<[u64]>,
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
            _mem: mem,
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
}
