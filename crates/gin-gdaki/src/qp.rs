//! The memory of one queue pair as both sides see it on CPU ranks: the
//! send queue's basic blocks, the doorbell record and doorbell register the
//! producer writes, and the completion queue the NIC writes. It is ordinary
//! process memory shared with the soft NIC thread, which reads it through
//! [`crate::nic::SqView`] and [`crate::nic::CqView`], the views it reads a
//! GPU's mapped queues through as well.
//!
//! Publication follows the hardware contract: WQE bytes, then the doorbell
//! record (release), then the doorbell; a CQE's first 56 bytes, then its last
//! qword holding `op_own` (release), so a poller that sees a valid owner bit
//! sees the whole CQE.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::completion::{CQE_BYTES, Cqe, FRESH_OP_OWN, is_valid};
use crate::queue::{
    BadProducerIndex, Sharing, SqIndices, producer_index, slot, unwrap_counter, wire_index,
};
use crate::wqe::{BB, doorbell};

/// Qwords in a basic block or a CQE.
pub(crate) const QW: usize = BB / 8;

/// A completion queue: `2^log2` CQEs of 64 bytes.
#[derive(Debug)]
pub struct Cq {
    /// The CQ number (what a WAIT names).
    pub cqn: u32,
    log2: u32,
    pub(crate) entries: Box<[AtomicU64]>,
    /// The poller's consumer index (the device side).
    ci: Mutex<u64>,
    /// CQ doorbell record: the consumer index, big-endian, 24 bits.
    pub dbrec: AtomicU32,
    /// CQEs the device side has taken so far.
    polled: AtomicU64,
}

impl Cq {
    /// A CQ of `2^log2` fresh (invalid, owner 0) entries.
    pub fn new(cqn: u32, log2: u32) -> Self {
        let n = 1usize << log2;
        let entries: Box<[AtomicU64]> = (0..n * QW).map(|_| AtomicU64::new(0)).collect();
        for i in 0..n {
            // op_own sits in the last byte of the last qword.
            entries[i * QW + QW - 1].store(
                u64::from_ne_bytes(last_qword(FRESH_OP_OWN)),
                Ordering::Relaxed,
            );
        }
        Self {
            cqn,
            log2,
            entries,
            ci: Mutex::new(0),
            dbrec: AtomicU32::new(0),
            polled: AtomicU64::new(0),
        }
    }

    /// log2 of the CQ's entries.
    pub fn log2(&self) -> u32 {
        self.log2
    }

    /// CQEs the device side has taken so far.
    pub fn polled(&self) -> u64 {
        self.polled.load(Ordering::Acquire)
    }

    /// NIC side: writes `cqe` as the CQE at consumer index `n` (first 56
    /// bytes, then the `op_own` qword with release). The soft NIC writes
    /// through [`crate::nic::CqView`]; this is for tests and benchmarks.
    pub fn write(&self, n: u64, cqe: &Cqe) {
        let bytes = cqe.encode(n, self.log2);
        let base = slot(n, (1 << self.log2) - 1) * QW;
        for q in 0..QW {
            let v = u64::from_ne_bytes(bytes[q * 8..q * 8 + 8].try_into().expect("8 bytes"));
            let order = if q == QW - 1 {
                Ordering::Release
            } else {
                Ordering::Relaxed
            };
            self.entries[base + q].store(v, order);
        }
    }

    /// Device side: takes every new CQE, in order, handing each to `f`.
    pub fn poll(&self, mut f: impl FnMut(&Cqe)) {
        let mut ci = self
            .ci
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let start = *ci;
        loop {
            let base = slot(*ci, (1 << self.log2) - 1) * QW;
            let last = self.entries[base + QW - 1]
                .load(Ordering::Acquire)
                .to_ne_bytes();
            if !is_valid(last[7], *ci, self.log2) {
                break;
            }
            let mut bytes = [0u8; CQE_BYTES];
            for q in 0..QW {
                let v = self.entries[base + q].load(Ordering::Acquire);
                bytes[q * 8..q * 8 + 8].copy_from_slice(&v.to_ne_bytes());
            }
            f(&Cqe::decode(&bytes));
            *ci += 1;
        }
        if *ci != start {
            self.polled.fetch_add(*ci - start, Ordering::AcqRel);
            self.dbrec
                .store(((*ci & 0x00ff_ffff) as u32).to_be(), Ordering::Release);
        }
    }
}

fn last_qword(op_own: u8) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[7] = op_own;
    b
}

/// A send queue with its completion queue, in process memory.
#[derive(Debug)]
pub struct Qp {
    /// The QP number ([`crate::ids::main_qpn`]).
    pub qpn: u32,
    /// The rank this QP reaches (itself for a loopback QP).
    pub peer: usize,
    /// The peer's QP number this one is connected to (0 until connected).
    pub remote_qpn: AtomicU32,
    log2: u32,
    pub(crate) sq: Box<[AtomicU64]>,
    /// The producer side's indices.
    pub idx: SqIndices,
    /// Doorbell record: word 1 is the send producer index, big-endian, 16 bits.
    pub dbrec: [AtomicU32; 2],
    /// The doorbell register: the first 8 bytes of a control segment.
    pub doorbell: AtomicU64,
    /// The completion queue, of the send queue's depth.
    pub cq: Cq,
}

impl Qp {
    /// A QP of `2^log2` basic blocks with a CQ of the same depth: every WQE
    /// asks for a CQE, so the CQ can never overflow.
    pub fn new(qpn: u32, cqn: u32, peer: usize, log2: u32) -> Self {
        Self::with_cq(qpn, peer, log2, Cq::new(cqn, log2))
    }

    /// A QP of `2^log2` basic blocks completing into `cq` (a collapsed CQ
    /// is a CQ of one entry).
    pub fn with_cq(qpn: u32, peer: usize, log2: u32, cq: Cq) -> Self {
        Self {
            qpn,
            peer,
            remote_qpn: AtomicU32::new(0),
            log2,
            sq: (0..(1usize << log2) * QW)
                .map(|_| AtomicU64::new(0))
                .collect(),
            idx: SqIndices::default(),
            dbrec: [AtomicU32::new(0), AtomicU32::new(0)],
            doorbell: AtomicU64::new(0),
            cq,
        }
    }

    /// Basic blocks in the send queue.
    pub fn size(&self) -> u64 {
        1 << self.log2
    }

    /// log2 of [`Qp::size`].
    pub fn log2(&self) -> u32 {
        self.log2
    }

    /// `size - 1`.
    pub fn mask(&self) -> u64 {
        self.size() - 1
    }

    /// Device side: writes a WQE's bytes at index `idx`.
    pub fn write_wqe(&self, idx: u64, bytes: &[u8; BB]) {
        let base = slot(idx, self.mask()) * QW;
        for q in 0..QW {
            let v = u64::from_ne_bytes(bytes[q * 8..q * 8 + 8].try_into().expect("8 bytes"));
            self.sq[base + q].store(v, Ordering::Relaxed);
        }
    }

    /// Reads the WQE at index `idx` (what the NIC sees there).
    pub fn read_wqe(&self, idx: u64) -> [u8; BB] {
        let base = slot(idx, self.mask()) * QW;
        let mut b = [0u8; BB];
        for q in 0..QW {
            b[q * 8..q * 8 + 8]
                .copy_from_slice(&self.sq[base + q].load(Ordering::Acquire).to_ne_bytes());
        }
        b
    }

    /// Device side: publishes the producer index `pi` (doorbell record,
    /// release, then doorbell). Only the producer whose turn it is calls
    /// it ([`Qp::try_post`]), so the record never moves backwards.
    pub fn ring(&self, pi: u64) {
        self.dbrec[1].store(u32::from(wire_index(pi)).to_be(), Ordering::Release);
        self.doorbell
            .store(doorbell(wire_index(pi), self.qpn), Ordering::Release);
        self.idx.mark_posted(pi);
    }

    /// Device side: posts the filled range `[start, end)` in reservation
    /// order ([`SqIndices::try_post`]), ringing unless `hold(unrung)` says
    /// doorbell batching holds it back (`unrung`: WQEs ready but not in the
    /// record, these included). Returns false while it is not this range's
    /// turn.
    pub fn try_post(
        &self,
        start: u64,
        end: u64,
        mode: Sharing,
        hold: impl FnOnce(u64) -> bool,
    ) -> bool {
        self.idx.try_post(start, end, mode, || {
            let unrung = end.wrapping_sub(self.idx.posted.load(Ordering::Acquire));
            if !hold(unrung) {
                self.ring(end);
            }
        })
    }

    /// Device side: rings what doorbell batching held back, from any
    /// thread, without a turn: a compare-and-swap of the doorbell record
    /// from what it holds to the ready index, when that is ahead of it by
    /// at most a queue. A producer posting meanwhile either makes the swap
    /// fail or writes a larger index after it (its range starts at or past
    /// the ready index read here), so the record still never moves back;
    /// a record ahead of the ready index (a producer between its record and
    /// its hand-over) is left alone. Returns whether it rang.
    pub fn ring_held(&self) -> bool {
        let rec = self.dbrec[1].load(Ordering::Acquire);
        let ready = self.idx.ready.load(Ordering::Acquire);
        let ahead = wire_index(ready).wrapping_sub(u32::from_be(rec) as u16);
        if ahead == 0 || u64::from(ahead) > self.size() {
            return false;
        }
        let new = u32::from(wire_index(ready)).to_be();
        if self.dbrec[1]
            .compare_exchange(rec, new, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return false;
        }
        self.doorbell
            .store(doorbell(wire_index(ready), self.qpn), Ordering::Release);
        self.idx.mark_posted(ready);
        true
    }

    /// NIC side: the producer index from the doorbell record, unwrapped
    /// relative to the NIC's own consumer index; an error when it is more
    /// than the queue's depth ahead (see [`producer_index`]).
    pub fn producer_index(&self, nic_ci: u64) -> Result<u64, BadProducerIndex> {
        let pi16 = u32::from_be(self.dbrec[1].load(Ordering::Acquire)) as u16;
        producer_index(pi16, nic_ci, self.size())
    }

    /// Device side: reaps completions, advancing `idx.done`; error CQEs are
    /// handed to `on_error`.
    pub fn reap(&self, mut on_error: impl FnMut(&Cqe)) {
        self.cq.poll(|c| {
            if c.is_error() {
                on_error(c);
            }
            let done = self.idx.done.load(Ordering::Acquire);
            let idx = unwrap_counter(c.wqe_counter, done);
            self.idx.done.fetch_max(idx + 1, Ordering::AcqRel);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::completion::CQE_REQ;
    use crate::queue::has_space;

    #[test]
    fn cq_push_poll_across_passes() {
        let cq = Cq::new(1, 2);
        let mut seen = Vec::new();
        for round in 0..3u16 {
            for i in 0..4u16 {
                cq.write(
                    u64::from(round * 4 + i),
                    &Cqe {
                        opcode: CQE_REQ,
                        wqe_counter: round * 4 + i,
                        qpn: 7,
                        send_opcode: 8,
                        byte_cnt: 0,
                        syndrome: 0,
                        vendor_syndrome: 0,
                    },
                );
            }
            cq.poll(|c| seen.push(c.wqe_counter));
            // Nothing more until the next pass is written.
            cq.poll(|c| seen.push(c.wqe_counter + 1000));
        }
        assert_eq!(seen, (0..12).collect::<Vec<u16>>());
        assert_eq!(u32::from_be(cq.dbrec.load(Ordering::Acquire)), 12);
        assert_eq!(cq.polled(), 12);
    }

    #[test]
    fn wqes_roundtrip_and_producer_index_unwraps() {
        let qp = Qp::new(3, 4, 0, 3);
        let b = [0x5a; BB];
        qp.write_wqe(9, &b);
        assert_eq!(qp.read_wqe(1), b);
        qp.ring(0x1_0002);
        assert_eq!(qp.producer_index(0xfffe), Ok(0x1_0002));
        assert_eq!(qp.doorbell.load(Ordering::Acquire), doorbell(2, 3));
    }

    /// Producers post in order while another thread keeps ringing what
    /// batching held back and a reader plays the NIC: the record it reads
    /// never moves backwards (16-bit, within a queue) and never names a WQE
    /// that was not filled.
    #[test]
    fn held_back_rings_never_move_the_record_back() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicBool, AtomicU8};
        let log2 = 4;
        let qp = Arc::new(Qp::new(0x100, 0x100, 0, log2));
        let total = 3 * 3000u64;
        let filled: Arc<Vec<AtomicU8>> = Arc::new((0..total).map(|_| AtomicU8::new(0)).collect());
        let stop = Arc::new(AtomicBool::new(false));
        // The NIC: follows the record and completes what it names.
        let nic = {
            let (qp, filled, stop) = (qp.clone(), filled.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut ci = 0u64;
                while ci < total && !stop.load(Ordering::Acquire) {
                    let pi = qp.producer_index(ci).expect("the record never moves back");
                    for i in ci..pi {
                        assert_eq!(filled[i as usize].load(Ordering::Acquire), 1, "WQE {i}");
                    }
                    ci = pi;
                    qp.idx.done.store(ci, Ordering::Release);
                    std::thread::yield_now();
                }
                ci
            })
        };
        let flusher = {
            let (qp, stop) = (qp.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Acquire) {
                    qp.ring_held();
                    std::thread::yield_now();
                }
            })
        };
        let producers: Vec<_> = (0..3u64)
            .map(|t| {
                let (qp, filled) = (qp.clone(), filled.clone());
                std::thread::spawn(move || {
                    for i in 0..3000u64 {
                        let start = qp.idx.reserve(1);
                        while !has_space(start, 1, qp.idx.done.load(Ordering::Acquire), qp.size()) {
                            qp.ring_held();
                            std::thread::yield_now();
                        }
                        filled[start as usize].store(1, Ordering::Release);
                        // Hold back about half the doorbells.
                        while !qp.try_post(start, start + 1, Sharing::Gpu, |_| (i + t) % 2 == 0) {
                            std::thread::yield_now();
                        }
                    }
                })
            })
            .collect();
        for p in producers {
            p.join().unwrap();
        }
        while qp.ring_held() || qp.idx.done.load(Ordering::Acquire) < total {
            std::thread::yield_now();
            qp.ring_held();
            if nic.is_finished() {
                break;
            }
        }
        let seen = nic.join().unwrap();
        stop.store(true, Ordering::Release);
        flusher.join().unwrap();
        assert_eq!(seen, total);
    }
}
