//! The executor of CPU ranks: gin-net's fabric (shared memory or TCP to
//! the peer), and this rank's counters and atomic result sink in process
//! memory. Every call finishes before it returns, except reads over TCP,
//! whose answers the engine waits for without blocking the other queues.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use gin_device::Counters;
use gin_net::{Addr, Fabric, KeepAlive, MemDesc, Memory, NetError};

use super::exec::{
    Channel, CqStore, ExecError, Executor, Loc, Part, Payload, ReadStatus, ReadTicket, Region,
    WriteStatus,
};
use super::mem::CqView;

/// Qwords in the atomic result sink.
pub const SINK_QWORDS: usize = 8;

/// Where the NIC writes the old values of fetch-adds nobody reads (a
/// signal's, a counter's): [`SINK_QWORDS`] qwords of process memory, kept
/// by the executor (through an `Arc`) for as long as it may write there.
#[derive(Debug, Default)]
pub struct Sink([AtomicU64; SINK_QWORDS]);

impl Sink {
    /// The address WQEs name the sink's first byte by.
    pub fn addr(&self) -> u64 {
        self.0.as_ptr() as u64
    }

    /// Qword `i` (what the NIC last wrote there, big-endian).
    pub fn qword(&self, i: usize) -> Option<u64> {
        self.0.get(i).map(|q| q.load(Ordering::Acquire))
    }

    /// Qword `i`, for an executor to store an atomic's old value into.
    pub(crate) fn slot(&self, i: usize) -> Option<&AtomicU64> {
        self.0.get(i)
    }
}

/// A read over TCP whose answer has not come yet.
#[derive(Debug)]
struct InFlight {
    done: Arc<AtomicU64>,
    since: Instant,
    peer: usize,
}

/// Executes the engine's work through gin-net's [`Fabric`].
#[derive(Debug)]
pub struct FabricExecutor {
    fabric: Arc<Fabric>,
    rank: usize,
    counters: Arc<Counters>,
    sink: Arc<Sink>,
    timeout: Duration,
    /// Window descriptions by id, as of fabric directory `generation`
    /// (a few windows: a scan beats hashing on the per-WQE path).
    windows: Vec<(u32, Arc<MemDesc>)>,
    generation: u64,
    reads: HashMap<u64, InFlight>,
    next_read: u64,
}

fn transport(peer: usize) -> impl Fn(NetError) -> ExecError {
    move |e| ExecError::Transport {
        peer,
        why: e.to_string(),
    }
}

impl FabricExecutor {
    /// An executor over `fabric` writing `counters` and `sink`; a read
    /// whose answer takes longer than `timeout` fails.
    pub fn new(
        fabric: Arc<Fabric>,
        counters: Arc<Counters>,
        sink: Arc<Sink>,
        timeout: Duration,
    ) -> Self {
        Self {
            rank: fabric.rank(),
            fabric,
            counters,
            sink,
            timeout,
            windows: Vec::new(),
            generation: u64::MAX,
            reads: HashMap::new(),
            next_read: 0,
        }
    }

    /// Where WQEs name the counter array and the sink (the engine's
    /// [`super::EngineConfig::counters`] and [`super::EngineConfig::sink`]).
    pub fn local_parts(&self) -> (Part, Part) {
        (
            Part {
                base: self.counters.as_ptr() as u64,
                size: self.counters.len() as u64 * 8,
            },
            Part {
                base: self.sink.addr(),
                size: (SINK_QWORDS * 8) as u64,
            },
        )
    }

    /// Window `id`'s description, from the cache unless the directory
    /// changed (a removed window must not resolve any more).
    fn desc(&mut self, id: u32) -> Option<Arc<MemDesc>> {
        let g = self.fabric.generation();
        if g != self.generation {
            self.windows.clear();
            self.generation = g;
        }
        if let Some((_, d)) = self.windows.iter().find(|(w, _)| *w == id) {
            return Some(d.clone());
        }
        let d = self.fabric.window(id).ok()?;
        self.windows.push((id, d.clone()));
        Some(d)
    }

    /// Window `l`'s description, refused unless this rank's part is host
    /// memory (a GPU window's bases are device addresses, never
    /// dereferenced here).
    fn host_window_of(&mut self, l: Loc) -> Result<(Arc<MemDesc>, Addr), ExecError> {
        let (d, a) = self.window_of(l)?;
        if d.memory != Memory::Host {
            return Err(ExecError::Unsupported {
                why: format!(
                    "window {} is GPU memory, which a CPU rank's NIC does not load or store",
                    a.window
                ),
            });
        }
        Ok((d, a))
    }

    fn window_of(&mut self, l: Loc) -> Result<(Arc<MemDesc>, Addr), ExecError> {
        let Region::Window(id) = l.region else {
            return Err(malformed(format!("{} is not a window", l.region)));
        };
        let d = self.desc(id).ok_or_else(|| ExecError::Refused {
            peer: l.rank,
            why: format!("window {id} is not registered"),
        })?;
        Ok((
            d,
            Addr {
                window: id,
                offset: l.offset,
            },
        ))
    }

    /// This rank's qword at `l` in the counters or the sink.
    fn local_qword(&self, l: Loc) -> Result<&AtomicU64, ExecError> {
        if l.rank != self.rank || !l.offset.is_multiple_of(8) || l.len != 8 {
            return Err(malformed(format!(
                "{} bytes at offset {} of rank {}'s {}: the NIC's own memory takes aligned qwords of this rank",
                l.len, l.offset, l.rank, l.region
            )));
        }
        let i = (l.offset / 8) as usize;
        let q = match l.region {
            Region::Counters => self.counters.slot(i as u64),
            Region::Sink => self.sink.0.get(i),
            Region::Window(_) => None,
        };
        q.ok_or_else(|| malformed(format!("offset {} is outside {}", l.offset, l.region)))
    }

    /// Calls `f` with the bytes of this rank's memory at `l`.
    fn with_local<T>(
        &mut self,
        l: Loc,
        f: impl FnOnce(&mut Self, &[u8]) -> Result<T, ExecError>,
    ) -> Result<T, ExecError> {
        if let Region::Window(id) = l.region {
            let (d, _) = self.host_window_of(l)?;
            let size = d.sizes.get(self.rank).copied().unwrap_or(0);
            if l.rank != self.rank || l.offset.checked_add(l.len).is_none_or(|e| e > size) {
                return Err(malformed(format!(
                    "{} bytes at offset {} of rank {}'s part of window {id} are not this rank's memory",
                    l.len, l.offset, l.rank
                )));
            }
            // SAFETY: the range lies in this rank's host-memory part of a
            // registered window, which its description (`MemDesc::new`'s
            // contract) keeps valid while `d` lives. Others may write it
            // concurrently, as a NIC reads memory the CPU writes; the bytes
            // are handed to the transport at once. (A fabric put from one
            // window part to another would avoid the borrow.)
            let data = unsafe {
                std::slice::from_raw_parts(
                    (d.local_base + l.offset as usize) as *const u8,
                    l.len as usize,
                )
            };
            return f(self, data);
        }
        let v = self.local_qword(l)?.load(Ordering::Acquire);
        f(self, &v.to_ne_bytes())
    }
}

fn malformed(why: String) -> ExecError {
    ExecError::Malformed { why }
}

impl Executor for FabricExecutor {
    type Cq = CqView;

    fn part(&mut self, window: u32, rank: usize) -> Option<Part> {
        let d = self.desc(window)?;
        Some(Part {
            base: *d.addrs.get(rank)?,
            size: *d.sizes.get(rank)?,
        })
    }

    /// Complete on return (the fabric's writes are).
    fn write(&mut self, _: Channel, dst: Loc, src: Payload<'_>) -> Result<WriteStatus, ExecError> {
        let put = |me: &mut Self, data: &[u8]| -> Result<(), ExecError> {
            if data.len() as u64 != dst.len {
                return Err(malformed(format!(
                    "{} bytes for a {}-byte destination",
                    data.len(),
                    dst.len
                )));
            }
            if let Region::Window(_) = dst.region {
                let (d, a) = me.window_of(dst)?;
                return me
                    .fabric
                    .put_in(dst.rank, (&d, a), data, None)
                    .map_err(transport(dst.rank));
            }
            let v = u64::from_ne_bytes(data.try_into().map_err(|_| {
                malformed(format!(
                    "{} bytes for a qword of {}",
                    data.len(),
                    dst.region
                ))
            })?);
            me.local_qword(dst)?.store(v, Ordering::Release);
            Ok(())
        };
        match src {
            Payload::Bytes(b) => put(self, b),
            Payload::Local(l) => self.with_local(l, put),
        }
        .map(|()| WriteStatus::Done)
    }

    fn read(&mut self, _: Channel, src: Loc, dst: Loc) -> Result<ReadStatus, ExecError> {
        let (ptr, keep) = match dst.region {
            Region::Window(_) => {
                let (d, _) = self.host_window_of(dst)?;
                let size = d.sizes.get(self.rank).copied().unwrap_or(0);
                if dst.rank != self.rank
                    || src.len != dst.len
                    || dst.offset.checked_add(dst.len).is_none_or(|e| e > size)
                {
                    return Err(malformed(format!(
                        "a read into {} bytes at offset {} of rank {}'s part",
                        dst.len, dst.offset, dst.rank
                    )));
                }
                (
                    (d.local_base + dst.offset as usize) as *mut u8,
                    d.keep.clone(),
                )
            }
            region => {
                // The NIC's own memory: one qword at a time.
                let q = self.local_qword(dst)?;
                if src.len != 8 {
                    return Err(malformed(format!("a {}-byte read into a qword", src.len)));
                }
                let keep = if region == Region::Counters {
                    KeepAlive(self.counters.clone())
                } else {
                    KeepAlive(self.sink.clone())
                };
                (q.as_ptr().cast::<u8>(), Some(keep))
            }
        };
        let (d, a) = self.window_of(src)?;
        let done = Arc::new(AtomicU64::new(1));
        // SAFETY: `ptr` is checked to hold `len` bytes of this rank's
        // memory (a window part, or a qword of the counters or the sink).
        // If the answer is abandoned (`read_done` times out), the transport
        // still holds `keep`, the destination's keep-alive, until it lands,
        // so it never writes freed memory. Counter and sink qwords live in
        // `Arc`s this executor holds for as long as it may run.
        unsafe {
            self.fabric
                .get_in(src.rank, (&d, a), ptr, src.len, &done, keep)
                .map_err(transport(src.rank))?;
        }
        if done.load(Ordering::Acquire) == 0 {
            self.fabric.health().map_err(transport(src.rank))?;
            return Ok(ReadStatus::Done);
        }
        let t = self.next_read;
        self.next_read += 1;
        self.reads.insert(
            t,
            InFlight {
                done,
                since: Instant::now(),
                peer: src.rank,
            },
        );
        Ok(ReadStatus::Pending(ReadTicket(t)))
    }

    fn read_done(&mut self, t: ReadTicket) -> Result<bool, ExecError> {
        let Some(r) = self.reads.get(&t.0) else {
            return Err(malformed(format!("no read in flight has ticket {}", t.0)));
        };
        if r.done.load(Ordering::Acquire) == 0 {
            let peer = r.peer;
            self.reads.remove(&t.0);
            // A refused or failed read also releases `done`.
            self.fabric.health().map_err(transport(peer))?;
            return Ok(true);
        }
        if r.since.elapsed() > self.timeout {
            let peer = r.peer;
            self.reads.remove(&t.0);
            return Err(ExecError::Transport {
                peer,
                why: format!("the read response never came within {:?}", self.timeout),
            });
        }
        Ok(false)
    }

    fn fetch_add(&mut self, _: Channel, at: Loc, add: u64) -> Result<u64, ExecError> {
        if let Region::Window(_) = at.region {
            let (d, a) = self.window_of(at)?;
            return self
                .fabric
                .fetch_add_in(at.rank, (&d, a), add)
                .map_err(transport(at.rank));
        }
        Ok(self.local_qword(at)?.fetch_add(add, Ordering::AcqRel))
    }

    fn compare_swap(
        &mut self,
        _: Channel,
        at: Loc,
        compare: u64,
        swap: u64,
    ) -> Result<u64, ExecError> {
        if let Region::Window(_) = at.region {
            let (d, a) = self.window_of(at)?;
            return self
                .fabric
                .compare_swap_in(at.rank, (&d, a), compare, swap)
                .map_err(transport(at.rank));
        }
        let q = self.local_qword(at)?;
        Ok(
            match q.compare_exchange(compare, swap, Ordering::AcqRel, Ordering::Acquire) {
                Ok(v) | Err(v) => v,
            },
        )
    }

    fn publish(&mut self, _: Channel, cq: &CqView, stores: &[CqStore]) -> Result<(), ExecError> {
        if cq.store(stores) {
            Ok(())
        } else {
            Err(ExecError::Driver {
                why: format!("a CQE store outside the {}-entry CQ", cq.entries()),
            })
        }
    }

    fn confirm(&self, peer: usize) -> Result<(), ExecError> {
        self.fabric.confirm(peer).map_err(transport(peer))
    }

    fn health(&self) -> Result<(), ExecError> {
        self.fabric.health().map_err(|e| ExecError::Transport {
            peer: self.rank,
            why: e.to_string(),
        })
    }
}
