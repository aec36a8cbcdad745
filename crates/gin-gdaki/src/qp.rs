//! The memory of one queue pair as both sides see it: the send queue's
//! basic blocks, the doorbell record and doorbell register the device writes,
//! and the completion queue the NIC writes. For CPU ranks it is ordinary
//! process memory shared with the soft NIC thread; on a GPU it would be
//! mapped host memory (rings the CPU reads) or device memory.
//!
//! Publication follows the hardware contract: WQE bytes, then the doorbell
//! record (release), then the doorbell; a CQE's first 56 bytes, then its last
//! qword holding `op_own` (release), so a poller that sees a valid owner bit
//! sees the whole CQE.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::completion::{CQE_BYTES, Cqe, FRESH_OP_OWN, is_valid};
use crate::queue::{BadProducerIndex, SqIndices, producer_index, slot, unwrap_counter};
use crate::wqe::{BB, doorbell};

/// Qwords in a basic block or a CQE.
const QW: usize = BB / 8;

/// A completion queue.
#[derive(Debug)]
pub struct Cq {
    pub cqn: u32,
    log2: u32,
    entries: Box<[AtomicU64]>,
    /// The poller's consumer index (the device side).
    ci: Mutex<u64>,
    /// CQ doorbell record: the consumer index, big-endian, 24 bits.
    pub dbrec: AtomicU32,
    /// CQEs written so far (the NIC side's producer count).
    pub produced: AtomicU64,
}

impl Cq {
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
            produced: AtomicU64::new(0),
        }
    }

    pub fn log2(&self) -> u32 {
        self.log2
    }

    /// NIC side: writes the next CQE.
    pub fn push(&self, cqe: &Cqe) {
        let n = self.produced.load(Ordering::Relaxed);
        let bytes = cqe.encode(n, self.log2);
        let base = slot(n, (1 << self.log2) - 1) * QW;
        for q in 0..QW - 1 {
            let v = u64::from_ne_bytes(bytes[q * 8..q * 8 + 8].try_into().expect("8 bytes"));
            self.entries[base + q].store(v, Ordering::Relaxed);
        }
        let last = u64::from_ne_bytes(bytes[CQE_BYTES - 8..].try_into().expect("8 bytes"));
        self.entries[base + QW - 1].store(last, Ordering::Release);
        self.produced.store(n + 1, Ordering::Release);
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

/// A send queue with its completion queue.
#[derive(Debug)]
pub struct Qp {
    pub qpn: u32,
    /// The rank this QP reaches (itself for a loopback QP).
    pub peer: usize,
    /// The peer's QP number this one is connected to (0 until connected).
    pub remote_qpn: AtomicU32,
    log2: u32,
    sq: Box<[AtomicU64]>,
    pub idx: SqIndices,
    /// Doorbell record: word 1 is the send producer index, big-endian, 16 bits.
    pub dbrec: [AtomicU32; 2],
    /// The doorbell register: the first 8 bytes of a control segment.
    pub doorbell: AtomicU64,
    pub cq: Cq,
    /// Why the soft NIC moved this QP to the error state, for the host's
    /// error message (hardware only gives the syndrome).
    pub error_reason: std::sync::OnceLock<String>,
}

impl Qp {
    /// A QP of `2^log2` basic blocks with a CQ of the same depth: every WQE
    /// asks for a CQE, so the CQ can never overflow.
    pub fn new(qpn: u32, cqn: u32, peer: usize, log2: u32) -> Self {
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
            error_reason: std::sync::OnceLock::new(),
            cq: Cq::new(cqn, log2),
        }
    }

    pub fn size(&self) -> u64 {
        1 << self.log2
    }

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

    /// NIC side: reads the WQE at index `idx`.
    pub fn read_wqe(&self, idx: u64) -> [u8; BB] {
        let base = slot(idx, self.mask()) * QW;
        let mut b = [0u8; BB];
        for q in 0..QW {
            b[q * 8..q * 8 + 8]
                .copy_from_slice(&self.sq[base + q].load(Ordering::Acquire).to_ne_bytes());
        }
        b
    }

    /// Device side: publishes the producer index `pi` (doorbell record, then
    /// doorbell), after the WQEs below it were marked ready.
    pub fn ring(&self, pi: u64) {
        self.dbrec[1].store(u32::from(pi as u16).to_be(), Ordering::Release);
        self.doorbell
            .store(doorbell(pi as u16, self.qpn), Ordering::Release);
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

    #[test]
    fn cq_push_poll_across_passes() {
        let cq = Cq::new(1, 2);
        let mut seen = Vec::new();
        for round in 0..3u16 {
            for i in 0..4u16 {
                cq.push(&Cqe {
                    opcode: CQE_REQ,
                    wqe_counter: round * 4 + i,
                    qpn: 7,
                    send_opcode: 8,
                    byte_cnt: 0,
                    syndrome: 0,
                    vendor_syndrome: 0,
                });
            }
            cq.poll(|c| seen.push(c.wqe_counter));
            // Nothing more until the next pass is written.
            cq.poll(|c| seen.push(c.wqe_counter + 1000));
        }
        assert_eq!(seen, (0..12).collect::<Vec<u16>>());
        assert_eq!(u32::from_be(cq.dbrec.load(Ordering::Acquire)), 12);
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
}
