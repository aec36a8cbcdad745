//! The queue memory the engine reads and the CQs host executors write,
//! whoever owns it: a [`Qp`] in this process (CPU ranks, tests), or memory
//! a GPU writes, mapped here (CUDA ranks). Either way it is reached only
//! through atomics, because another agent writes it concurrently; the one
//! `unsafe` step is building a view of foreign memory, whose constructor
//! states what the caller promises.

use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use gin_net::KeepAlive;

use super::exec::CqStore;
use crate::device::MAX_SQ_LOG2;
use crate::qp::{QW, Qp};
use crate::wqe::BB;

/// Why a view of foreign memory cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ViewError {
    /// A null or misaligned address.
    #[error("the {what} at {addr:#x} is null or not {align}-byte aligned")]
    Misaligned {
        /// Which memory.
        what: &'static str,
        /// Its address.
        addr: usize,
        /// The alignment it needs.
        align: usize,
    },
    /// A queue deeper than 16-bit WQE indices allow.
    #[error("a send queue of 2^{log2} WQEs; at most 2^{MAX_SQ_LOG2}")]
    TooDeep {
        /// log2 of the depth asked for.
        log2: u32,
    },
    /// A CQ of no entries.
    #[error("a completion queue of no entries")]
    Empty,
}

/// A send queue as the NIC reads it: `2^log2` WQEs of 64 bytes and the
/// doorbell record (a big-endian u32 whose low 16 bits are the producer
/// index).
#[derive(Debug)]
pub struct SqView {
    wqes: NonNull<AtomicU64>,
    dbrec: NonNull<AtomicU32>,
    log2: u32,
    _keep: Option<KeepAlive>,
}

// SAFETY: the view only reads through atomics, and the memory lives as long
// as the view: `host` holds the `Qp`'s `Arc`; `foreign`'s caller promised it.
unsafe impl Send for SqView {}
// SAFETY: as above; nothing is written through a shared view.
unsafe impl Sync for SqView {}

impl SqView {
    /// The send queue of a QP in this process.
    pub fn host(qp: &Arc<Qp>) -> Self {
        Self {
            wqes: NonNull::from(&qp.sq[0]),
            dbrec: NonNull::from(&qp.dbrec[1]),
            log2: qp.log2(),
            _keep: Some(KeepAlive(qp.clone())),
        }
    }

    /// A send queue in memory this process did not allocate as Rust
    /// objects (mapped pinned memory a GPU writes).
    ///
    /// # Safety
    /// `wqes` must be valid for reads of `64 << log2` bytes and `dbrec` of
    /// 4 bytes, for as long as the view lives (or `keep` holds them), and
    /// whoever else touches them must do so only with atomic accesses or
    /// from another device (a GPU's stores through a mapping).
    pub unsafe fn foreign(
        wqes: *mut u8,
        dbrec: *mut u8,
        log2: u32,
        keep: Option<KeepAlive>,
    ) -> Result<Self, ViewError> {
        if log2 > MAX_SQ_LOG2 {
            return Err(ViewError::TooDeep { log2 });
        }
        let aligned = |p: *mut u8, what, align| {
            NonNull::new(p)
                .filter(|p| (p.as_ptr() as usize).is_multiple_of(align))
                .ok_or(ViewError::Misaligned {
                    what,
                    addr: p as usize,
                    align,
                })
        };
        Ok(Self {
            wqes: aligned(wqes, "send queue", 8)?.cast(),
            dbrec: aligned(dbrec, "doorbell record", 4)?.cast(),
            log2,
            _keep: keep,
        })
    }

    /// log2 of the queue's depth.
    pub fn log2(&self) -> u32 {
        self.log2
    }

    /// WQEs the queue holds.
    pub fn size(&self) -> u64 {
        1 << self.log2
    }

    /// The WQE at index `idx` (its slot, `idx mod size`).
    pub fn read_wqe(&self, idx: u64) -> [u8; BB] {
        let slot = (idx & (self.size() - 1)) as usize;
        let mut b = [0u8; BB];
        for q in 0..QW {
            // SAFETY: slot * QW + q < QW << log2: inside the queue, which
            // the constructor's caller (or the Qp's Arc) keeps alive.
            let w = unsafe { self.wqes.add(slot * QW + q).as_ref() };
            b[q * 8..q * 8 + 8].copy_from_slice(&w.load(Ordering::Acquire).to_ne_bytes());
        }
        b
    }

    /// The 16-bit producer index the doorbell record holds.
    pub fn producer16(&self) -> u16 {
        // SAFETY: as in `read_wqe`: a live, 4-aligned record.
        let rec = unsafe { self.dbrec.as_ref() };
        u32::from_be(rec.load(Ordering::Acquire)) as u16
    }
}

/// A completion queue in host memory, as a host executor writes it: a
/// ring of 64-byte CQEs, or one CQE for a collapsed CQ.
#[derive(Debug)]
pub struct CqView {
    base: NonNull<AtomicU64>,
    /// Bytes of CQ memory.
    len: usize,
    _keep: Option<KeepAlive>,
}

// SAFETY: stores go through atomics only; the memory lives as long as the
// view (`host`: the `Qp`'s `Arc`; `foreign`: the caller's promise).
unsafe impl Send for CqView {}
// SAFETY: as above.
unsafe impl Sync for CqView {}

impl CqView {
    /// The CQ of a QP in this process.
    pub fn host(qp: &Arc<Qp>) -> Self {
        Self {
            base: NonNull::from(&qp.cq.entries[0]),
            len: qp.cq.entries.len() * 8,
            _keep: Some(KeepAlive(qp.clone())),
        }
    }

    /// A CQ of `entries` CQEs in memory this process did not allocate as
    /// Rust objects (mapped pinned memory a GPU polls).
    ///
    /// # Safety
    /// `base` must be valid for writes of `64 * entries` bytes for as long
    /// as the view lives (or `keep` holds it), and whoever else touches it
    /// must do so only with atomic accesses or from another device.
    pub unsafe fn foreign(
        base: *mut u8,
        entries: usize,
        keep: Option<KeepAlive>,
    ) -> Result<Self, ViewError> {
        if entries == 0 {
            return Err(ViewError::Empty);
        }
        let base = NonNull::new(base)
            .filter(|p| (p.as_ptr() as usize).is_multiple_of(8))
            .ok_or(ViewError::Misaligned {
                what: "completion queue",
                addr: base as usize,
                align: 8,
            })?;
        Ok(Self {
            base: base.cast(),
            len: entries * BB,
            _keep: keep,
        })
    }

    /// CQEs the memory holds.
    pub fn entries(&self) -> usize {
        self.len / BB
    }

    /// Applies `stores` in order, each with release ordering (a poller that
    /// acquires the last sees the others). Returns false, storing nothing,
    /// when one lies outside the CQ or is misaligned.
    pub fn store(&self, stores: &[CqStore]) -> bool {
        if stores
            .iter()
            .any(|s| !s.offset.is_multiple_of(8) || s.offset + 8 > self.len)
        {
            return false;
        }
        for s in stores {
            // SAFETY: checked above: an aligned qword inside the CQ, which
            // the Qp's Arc or the constructor's caller keeps alive.
            let q = unsafe { self.base.add(s.offset / 8).as_ref() };
            q.store(u64::from_ne_bytes(s.bytes), Ordering::Release);
        }
        true
    }
}
