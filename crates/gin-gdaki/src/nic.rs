//! soft-mlx5: a NIC in software. One thread serves every queue pair of a
//! backend instance: it reads each QP's doorbell record, parses the very WQE
//! bytes the device wrote, checks keys, bounds and access against its memory
//! table, executes through gin-net, and writes CQEs with correct owner bits.
//! A violation produces an error CQE carrying the mlx5 syndrome and moves the
//! QP to the error state; every later WQE on it completes as flushed in
//! error, as hardware does. It sleeps when idle until a doorbell wakes it.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use gin_net::idle::Sleeper;
use gin_net::{Addr, Fabric, KeepAlive, NetError};
use tracing::{debug, warn};

use crate::completion::{CQE_REQ, CQE_REQ_ERR, Cqe, syndrome};
use crate::qp::Qp;
use crate::queue::unwrap_counter;
use crate::wqe::{CQ_UPDATE, MemRef, Op, decode};

/// WQEs taken from one QP before moving on to the next.
const BATCH: u64 = 64;

/// Memory that only this rank's NIC touches (counters, the atomic sink).
#[derive(Debug, Clone)]
pub struct LocalMr {
    pub key: u32,
    pub base: u64,
    pub len: u64,
    /// Owns `[base, base + len)`: the NIC holds it as long as its thread
    /// may write there, which can be after the backend that registered the
    /// region was dropped (the thread finishes the WQEs in hand before it
    /// sees the stop, and a stuck thread is abandoned, not waited for).
    pub keep: KeepAlive,
}

/// What a key and address resolve to.
#[derive(Debug, Clone, Copy)]
enum Target {
    /// A window part on some rank, reached through the fabric: an entry of
    /// the engine's region cache and the offset in it.
    Window { entry: usize, offset: u64 },
    /// Memory in this process.
    Here(*mut u8),
}

/// A registered window part the NIC has seen a key for.
#[derive(Debug)]
struct Region {
    rank: usize,
    key: u32,
    window: u32,
    base: u64,
    size: u64,
    desc: Arc<gin_net::MemDesc>,
}

#[derive(Debug)]
struct Shared {
    rank: usize,
    qps: Vec<Arc<Qp>>,
    fabric: Arc<Fabric>,
    local: Vec<LocalMr>,
    stop: AtomicBool,
    sleeper: Sleeper,
    executed: AtomicU64,
    timeout: Duration,
    spin: Duration,
}

/// A running soft NIC. Dropping it stops the thread.
#[derive(Debug)]
pub struct SoftNic {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// Wakes a sleeping NIC (what a doorbell write does to hardware).
#[derive(Debug, Clone)]
pub struct Waker(Arc<Shared>);

impl Waker {
    pub fn wake(&self) {
        self.0.sleeper.wake();
    }
}

impl SoftNic {
    /// Starts a NIC serving `qps` for rank `rank` over `fabric`.
    pub fn start(
        rank: usize,
        qps: Vec<Arc<Qp>>,
        fabric: Arc<Fabric>,
        local: Vec<LocalMr>,
        timeout: Duration,
        spin: Duration,
    ) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            rank,
            qps,
            fabric,
            local,
            stop: AtomicBool::new(false),
            sleeper: Sleeper::default(),
            executed: AtomicU64::new(0),
            timeout,
            spin,
        });
        let s = shared.clone();
        let handle = thread::Builder::new()
            .name(format!("gin-softnic-{rank}"))
            .spawn(move || Engine::new(&s).run())?;
        shared.sleeper.set_thread(handle.thread().clone());
        Ok(Self {
            shared,
            thread: Some(handle),
        })
    }

    pub fn waker(&self) -> Waker {
        Waker(self.shared.clone())
    }

    /// WQEs executed so far (benchmarks).
    pub fn executed(&self) -> u64 {
        self.shared.executed.load(Ordering::Relaxed)
    }

    /// Whether the NIC thread is still running.
    pub fn alive(&self) -> bool {
        self.thread.as_ref().is_some_and(|h| !h.is_finished())
    }
}

impl Drop for SoftNic {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.sleeper.unpark();
        if let Some(h) = self.thread.take() {
            // As the proxy: bounded by the timeout every blocking call of
            // the NIC thread honours; a thread stuck anyway is abandoned.
            gin_net::idle::join_within(h, self.shared.timeout, "soft NIC");
        }
    }
}

/// The NIC thread's own state.
struct Engine<'a> {
    s: &'a Shared,
    /// Next WQE index to execute, per QP.
    ci: Vec<u64>,
    /// QPs in the error state.
    failed: Vec<bool>,
    by_cqn: HashMap<u32, usize>,
    /// Regions by (rank, key), and the last one hit: consecutive WQEs
    /// usually name the same region.
    regions: Vec<Region>,
    by_key: HashMap<(usize, u32), usize>,
    last: usize,
    /// The fabric directory generation the cache was built from.
    generation: u64,
}

/// How executing one WQE went.
enum Step {
    Done {
        byte_cnt: u32,
    },
    /// A WAIT whose condition does not hold yet: try again later.
    Blocked,
    Failed {
        syndrome: u8,
        why: String,
    },
}

impl<'a> Engine<'a> {
    fn new(s: &'a Shared) -> Self {
        Self {
            s,
            ci: vec![0; s.qps.len()],
            failed: vec![false; s.qps.len()],
            by_cqn: s
                .qps
                .iter()
                .enumerate()
                .map(|(i, q)| (q.cq.cqn, i))
                .collect(),
            regions: Vec::new(),
            by_key: HashMap::new(),
            last: 0,
            generation: u64::MAX,
        }
    }

    fn run(&mut self) {
        let mut idle_since: Option<Instant> = None;
        let mut spins = 0u32;
        while !self.s.stop.load(Ordering::Relaxed) {
            let mut did = 0;
            for i in 0..self.s.qps.len() {
                did += self.serve(i);
            }
            if did > 0 {
                self.s.executed.fetch_add(did, Ordering::Relaxed);
                idle_since = None;
                spins = 0;
                continue;
            }
            let since = *idle_since.get_or_insert_with(Instant::now);
            spins = spins.saturating_add(1);
            if spins < 64 {
                std::hint::spin_loop();
            } else if since.elapsed() < self.s.spin {
                thread::yield_now();
            } else {
                let (qps, ci) = (&self.s.qps, &self.ci);
                self.s.sleeper.sleep(Duration::from_millis(2), || {
                    (0..qps.len()).any(|i| qps[i].producer_index(ci[i]).is_ok_and(|pi| pi != ci[i]))
                });
            }
        }
        debug!(rank = self.s.rank, "soft NIC stopped");
    }

    /// Executes what QP `i` has posted; returns the WQEs consumed.
    fn serve(&mut self, i: usize) -> u64 {
        let g = self.s.fabric.generation();
        if g != self.generation {
            // Windows came or went: a removed key must not resolve any more.
            self.regions.clear();
            self.by_key.clear();
            self.last = usize::MAX;
            self.generation = g;
        }
        let qp = self.s.qps[i].clone();
        let pi = match qp.producer_index(self.ci[i]) {
            Ok(pi) => pi,
            Err(bad) => {
                // Hardware's answer to a doorbell record it cannot believe:
                // the QP moves to the error state with one error CQE, and
                // nothing past the consumer index executes (executing the
                // phantom WQEs would also overrun the CQ and lose the very
                // completions that report the error).
                if !self.failed[i] {
                    let why = format!("QP {:#x}: {bad}", qp.qpn);
                    warn!(
                        rank = self.s.rank,
                        qpn = qp.qpn,
                        pi = bad.pi,
                        ci = bad.ci,
                        "{why}; QP moved to the error state"
                    );
                    let _ = qp.error_reason.set(why);
                    self.failed[i] = true;
                    Self::complete_error(&qp, bad.ci, 0, syndrome::LOCAL_QP_OP_ERR);
                }
                return 0;
            }
        };
        let mut n = 0;
        while self.ci[i] != pi && n < BATCH {
            let idx = self.ci[i];
            let bytes = qp.read_wqe(idx);
            if self.failed[i] {
                // Error state: everything left completes as flushed.
                Self::complete_error(&qp, idx, 0, syndrome::WR_FLUSH_ERR);
            } else {
                match self.execute(&qp, idx, &bytes) {
                    Step::Blocked => break,
                    Step::Done { byte_cnt } => {
                        if bytes[11] & CQ_UPDATE != 0 {
                            qp.cq.push(&Cqe {
                                opcode: CQE_REQ,
                                wqe_counter: idx as u16,
                                qpn: qp.qpn,
                                send_opcode: bytes[3],
                                byte_cnt,
                                syndrome: 0,
                                vendor_syndrome: 0,
                            });
                        }
                    }
                    Step::Failed { syndrome, why } => {
                        warn!(rank = self.s.rank, qpn = qp.qpn, wqe = idx, syndrome, %why, "QP moved to the error state");
                        let _ = qp.error_reason.set(why);
                        self.failed[i] = true;
                        Self::complete_error(&qp, idx, bytes[3], syndrome);
                    }
                }
            }
            self.ci[i] = idx + 1;
            n += 1;
        }
        n
    }

    fn complete_error(qp: &Qp, idx: u64, send_opcode: u8, syndrome: u8) {
        qp.cq.push(&Cqe {
            opcode: CQE_REQ_ERR,
            wqe_counter: idx as u16,
            qpn: qp.qpn,
            send_opcode,
            byte_cnt: 0,
            syndrome,
            vendor_syndrome: 0,
        });
    }

    fn execute(&mut self, qp: &Qp, idx: u64, bytes: &[u8; 64]) -> Step {
        let fail = |syndrome, why: String| Step::Failed { syndrome, why };
        let w = match decode(bytes) {
            Ok(w) => w,
            Err(e) => return fail(syndrome::LOCAL_QP_OP_ERR, format!("malformed WQE: {e}")),
        };
        if w.index != idx as u16 {
            return fail(
                syndrome::LOCAL_QP_OP_ERR,
                format!("WQE at index {idx} carries index {}", w.index),
            );
        }
        if w.qpn != qp.qpn {
            return fail(
                syndrome::LOCAL_QP_OP_ERR,
                format!("WQE for QP {:#x} posted on QP {:#x}", w.qpn, qp.qpn),
            );
        }
        let peer = qp.peer;
        match &w.op {
            Op::Nop => Step::Done { byte_cnt: 0 },
            Op::Write { remote, local, len } => {
                let src = match self.local(*local, u64::from(*len)) {
                    Ok(p) => p,
                    Err(why) => return fail(syndrome::LOCAL_PROT_ERR, why),
                };
                // SAFETY: `local` checked the range against a registered region.
                let data = unsafe { std::slice::from_raw_parts(src.cast_const(), *len as usize) };
                self.write(peer, *remote, data)
            }
            Op::WriteInline { remote, data } => self.write(peer, *remote, data),
            Op::Read { remote, local, len } => {
                let (dst, keep) = match self.local_kept(*local, u64::from(*len)) {
                    Ok(p) => p,
                    Err(why) => return fail(syndrome::LOCAL_PROT_ERR, why),
                };
                match self.remote(peer, *remote, u64::from(*len)) {
                    Ok(Target::Window { entry, offset }) => {
                        let done = Arc::new(AtomicU64::new(1));
                        let reg = &self.regions[entry];
                        let a = Addr {
                            window: reg.window,
                            offset,
                        };
                        // SAFETY: `dst` is a checked local range. We wait for
                        // `done` below; if that times out, the transport still
                        // holds the destination window's keep-alive until the
                        // answer lands, so it never writes freed memory.
                        let r = unsafe {
                            self.s.fabric.get_in(
                                peer,
                                (&reg.desc, a),
                                dst,
                                u64::from(*len),
                                &done,
                                keep,
                            )
                        };
                        if let Err(e) = r {
                            return transport(e);
                        }
                        let start = Instant::now();
                        while done.load(Ordering::Acquire) != 0 {
                            if start.elapsed() > self.s.timeout {
                                return fail(
                                    syndrome::TRANSPORT_RETRY_EXC_ERR,
                                    "read response never came".into(),
                                );
                            }
                            thread::yield_now();
                        }
                        if let Err(e) = self.s.fabric.health() {
                            return transport(e);
                        }
                        Step::Done { byte_cnt: *len }
                    }
                    Ok(Target::Here(p)) => {
                        // SAFETY: both ranges checked.
                        unsafe { std::ptr::copy(p, dst, *len as usize) };
                        Step::Done { byte_cnt: *len }
                    }
                    Err(why) => fail(syndrome::REMOTE_ACCESS_ERR, why),
                }
            }
            Op::FetchAdd {
                remote,
                add,
                result,
            } => self.atomic(
                peer,
                *remote,
                *result,
                |f, a| f.fetch_add_in(peer, a, *add),
                |x| x.fetch_add(*add, Ordering::AcqRel),
            ),
            Op::CompareSwap {
                remote,
                compare,
                swap,
                result,
            } => self.atomic(
                peer,
                *remote,
                *result,
                |f, a| f.compare_swap_in(peer, a, *compare, *swap),
                |x| match x.compare_exchange(*compare, *swap, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(v) | Err(v) => v,
                },
            ),
            Op::Wait { max_index, cqn } => {
                let Some(&j) = self.by_cqn.get(cqn) else {
                    return fail(
                        syndrome::LOCAL_QP_OP_ERR,
                        format!("WAIT on unknown CQ {cqn:#x}"),
                    );
                };
                if self.failed[j] {
                    return fail(
                        syndrome::WR_FLUSH_ERR,
                        format!(
                            "the awaited QP {:#x} is in the error state",
                            self.s.qps[j].qpn
                        ),
                    );
                }
                let cq = &self.s.qps[j].cq;
                let produced = cq.produced.load(Ordering::Acquire);
                let awaited = unwrap_counter(*max_index as u16, produced);
                if produced > awaited {
                    Step::Done { byte_cnt: 0 }
                } else {
                    Step::Blocked
                }
            }
        }
    }

    fn write(&mut self, peer: usize, remote: MemRef, data: &[u8]) -> Step {
        match self.remote(peer, remote, data.len() as u64) {
            Ok(Target::Window { entry, offset }) => {
                let reg = &self.regions[entry];
                let a = Addr {
                    window: reg.window,
                    offset,
                };
                match self.s.fabric.put_in(peer, (&reg.desc, a), data, None) {
                    Ok(()) => Step::Done {
                        byte_cnt: data.len() as u32,
                    },
                    Err(e) => transport(e),
                }
            }
            Ok(Target::Here(p)) => {
                // SAFETY: checked local range.
                unsafe { std::ptr::copy(data.as_ptr(), p, data.len()) };
                Step::Done {
                    byte_cnt: data.len() as u32,
                }
            }
            Err(why) => Step::Failed {
                syndrome: syndrome::REMOTE_ACCESS_ERR,
                why,
            },
        }
    }

    fn atomic(
        &mut self,
        peer: usize,
        remote: MemRef,
        result: MemRef,
        net: impl FnOnce(&Fabric, (&gin_net::MemDesc, Addr)) -> Result<u64, NetError>,
        here: impl FnOnce(&AtomicU64) -> u64,
    ) -> Step {
        if !remote.addr.is_multiple_of(8) {
            return Step::Failed {
                syndrome: syndrome::REMOTE_INVAL_REQ_ERR,
                why: format!("atomic at unaligned address {:#x}", remote.addr),
            };
        }
        let out = match self.local(result, 8) {
            Ok(p) => p,
            Err(why) => {
                return Step::Failed {
                    syndrome: syndrome::LOCAL_PROT_ERR,
                    why,
                };
            }
        };
        let old = match self.remote(peer, remote, 8) {
            Ok(Target::Window { entry, offset }) => {
                let reg = &self.regions[entry];
                let a = Addr {
                    window: reg.window,
                    offset,
                };
                match net(&self.s.fabric, (&reg.desc, a)) {
                    Ok(v) => v,
                    Err(e) => return transport(e),
                }
            }
            // SAFETY: checked, 8-byte aligned local range.
            Ok(Target::Here(p)) => here(unsafe { &*p.cast::<AtomicU64>() }),
            Err(why) => {
                return Step::Failed {
                    syndrome: syndrome::REMOTE_ACCESS_ERR,
                    why,
                };
            }
        };
        // SAFETY: checked local range of 8 bytes.
        unsafe { out.cast::<u64>().write_unaligned(old.to_be()) };
        Step::Done { byte_cnt: 8 }
    }

    /// Resolves a local (lkey, address) range to a pointer.
    fn local(&mut self, m: MemRef, len: u64) -> Result<*mut u8, String> {
        self.local_kept(m, len).map(|(p, _)| p)
    }

    /// [`Self::local`], with what keeps the range mapped (`None` for the
    /// NIC's own regions, which [`LocalMr::keep`] keeps for as long as the
    /// NIC lives).
    fn local_kept(
        &mut self,
        m: MemRef,
        len: u64,
    ) -> Result<(*mut u8, Option<gin_net::KeepAlive>), String> {
        match self.resolve(self.s.rank, m, len)? {
            Target::Here(p) => Ok((p, None)),
            Target::Window { entry, offset } => {
                let d = &self.regions[entry].desc;
                Ok(((d.local_base + offset as usize) as *mut u8, d.keep.clone()))
            }
        }
    }

    /// Resolves a remote (rkey, address) range on the QP's peer.
    fn remote(&mut self, peer: usize, m: MemRef, len: u64) -> Result<Target, String> {
        self.resolve(peer, m, len)
    }

    fn resolve(&mut self, rank: usize, m: MemRef, len: u64) -> Result<Target, String> {
        if rank == self.s.rank
            && let Some(r) = self.s.local.iter().find(|r| r.key == m.key)
        {
            return in_range(m, len, r.base, r.len)
                .map(|off| Target::Here((r.base + off) as *mut u8));
        }
        let hit = self
            .regions
            .get(self.last)
            .is_some_and(|r| r.rank == rank && r.key == m.key);
        if !hit {
            if !self.by_key.contains_key(&(rank, m.key)) {
                self.refresh();
            }
            self.last = *self
                .by_key
                .get(&(rank, m.key))
                .ok_or_else(|| format!("key {:#010x} is not registered on rank {rank}", m.key))?;
        }
        let r = &self.regions[self.last];
        let offset = in_range(m, len, r.base, r.size)?;
        Ok(Target::Window {
            entry: self.last,
            offset,
        })
    }

    /// Re-reads the fabric's windows (some were registered since).
    fn refresh(&mut self) {
        self.regions.clear();
        self.by_key.clear();
        for (window, desc) in self.s.fabric.windows() {
            for (rank, (&key, &base)) in desc.keys.iter().zip(&desc.addrs).enumerate() {
                self.by_key.insert((rank, key), self.regions.len());
                self.regions.push(Region {
                    rank,
                    key,
                    window,
                    base,
                    size: desc.sizes.get(rank).copied().unwrap_or(0),
                    desc: desc.clone(),
                });
            }
        }
        self.last = 0;
    }
}

fn in_range(m: MemRef, len: u64, base: u64, size: u64) -> Result<u64, String> {
    let off = m.addr.wrapping_sub(base);
    if m.addr < base || off.checked_add(len).is_none_or(|e| e > size) {
        return Err(format!(
            "{len} bytes at {:#x} fall outside the region of key {:#010x} ({size} bytes at {base:#x})",
            m.addr, m.key
        ));
    }
    Ok(off)
}

fn transport(e: NetError) -> Step {
    Step::Failed {
        syndrome: syndrome::TRANSPORT_RETRY_EXC_ERR,
        why: e.to_string(),
    }
}
