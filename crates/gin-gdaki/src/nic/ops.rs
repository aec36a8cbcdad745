//! The engine's execution of one WQE: decode, the checks (index, QP,
//! keys, bounds, access, alignment, WAIT conditions), and the work handed to
//! the executor.

use super::engine::{Engine, Fail, Outcome};
use super::exec::{
    Atomics, Channel, Executor, Loc, Payload, ReadStatus, Region, SoleWriter, WriteStatus,
};
use super::fault::{Access, Cause};
use crate::completion::syndrome;
use crate::ids::{COUNTER_KEY, SINK_KEY, window_of_key};
use crate::queue::{unwrap_counter, wire_index};
use crate::wqe::{BB, MemRef, Op, decode};

impl<C> Engine<C> {
    /// Checks and executes one WQE.
    pub(super) fn execute<E: Executor<Cq = C>>(
        &mut self,
        i: usize,
        idx: u64,
        bytes: &[u8; BB],
        ex: &mut E,
    ) -> Result<Outcome, Fail> {
        let local_err = syndrome::LOCAL_QP_OP_ERR;
        let w = decode(bytes).map_err(|e| Fail::new(local_err, Cause::Malformed(e)))?;
        let (qpn, peer, ch) = {
            let s = &self.queues[i].spec;
            (s.qpn, s.peer, s.channel)
        };
        if w.index != wire_index(idx) {
            let cause = Cause::WrongIndex {
                index: idx,
                carried: w.index,
            };
            return Err(Fail::new(local_err, cause));
        }
        if w.qpn != qpn {
            let cause = Cause::WrongQp {
                carried: w.qpn,
                qpn,
            };
            return Err(Fail::new(local_err, cause));
        }
        let me = self.cfg.rank;
        match &w.op {
            Op::Nop => Ok(Outcome::Done(0)),
            Op::Write { remote, local, len } => {
                let src = self.resolve(ex, me, *local, u64::from(*len), Access::LocalRead)?;
                let dst = self.resolve(ex, peer, *remote, u64::from(*len), Access::RemoteWrite)?;
                let w = ex.write(ch, dst, Payload::Local(src)).map_err(Fail::exec)?;
                Ok(written(w, *len))
            }
            Op::WriteInline { remote, data } => {
                let len = data.len() as u64;
                let dst = self.resolve(ex, peer, *remote, len, Access::RemoteWrite)?;
                let w = ex
                    .write(ch, dst, Payload::Bytes(data))
                    .map_err(Fail::exec)?;
                Ok(written(w, len as u32))
            }
            Op::Read { remote, local, len } => {
                let dst = self.resolve(ex, me, *local, u64::from(*len), Access::LocalWrite)?;
                let src = self.resolve(ex, peer, *remote, u64::from(*len), Access::RemoteRead)?;
                match ex.read(ch, src, dst).map_err(Fail::exec)? {
                    ReadStatus::Done => Ok(Outcome::Done(*len)),
                    ReadStatus::Pending(t) => Ok(Outcome::Pending(t, *len)),
                }
            }
            Op::FetchAdd {
                remote,
                add,
                result,
            } => self.atomic(ex, ch, peer, *remote, *result, AtomicOp::Add(*add)),
            Op::CompareSwap {
                remote,
                compare,
                swap,
                result,
            } => {
                let op = AtomicOp::Swap(*compare, *swap);
                self.atomic(ex, ch, peer, *remote, *result, op)
            }
            Op::Wait { max_index, cqn } => self.wait(ch, *max_index, *cqn),
        }
    }

    /// A WAIT: done once CQ `cqn`'s queue has published the completion of
    /// its WQE `max_index` (16 bits, unwrapped near what it published).
    fn wait(&self, ch: Channel, max_index: u32, cqn: u32) -> Result<Outcome, Fail> {
        let local_err = syndrome::LOCAL_QP_OP_ERR;
        let Some(&j) = self.by_cqn.get(&cqn) else {
            return Err(Fail::new(local_err, Cause::UnknownCq { cqn }));
        };
        let awaited = &self.queues[j];
        if awaited.spec.channel != ch {
            return Err(Fail::new(local_err, Cause::CqElsewhere { cqn }));
        }
        if awaited.failed {
            let cause = Cause::AwaitedFailed {
                qpn: awaited.spec.qpn,
            };
            return Err(Fail::new(syndrome::WR_FLUSH_ERR, cause));
        }
        let done = awaited.published;
        if done > unwrap_counter(max_index as u16, done) {
            Ok(Outcome::Done(0))
        } else {
            Ok(Outcome::Blocked)
        }
    }

    /// A fetch-add or compare-swap: checks, executes, and writes the old
    /// value (big-endian) at `result`.
    fn atomic<E: Executor<Cq = C>>(
        &mut self,
        ex: &mut E,
        ch: Channel,
        peer: usize,
        remote: MemRef,
        result: MemRef,
        op: AtomicOp,
    ) -> Result<Outcome, Fail> {
        if !remote.addr.is_multiple_of(8) {
            let cause = Cause::Unaligned { addr: remote.addr };
            return Err(Fail::new(syndrome::REMOTE_INVAL_REQ_ERR, cause));
        }
        let res = self.resolve(ex, self.cfg.rank, result, 8, Access::LocalWrite)?;
        let at = self.resolve(ex, peer, remote, 8, Access::RemoteAtomic)?;
        let old = match (ex.atomics(), op) {
            (Atomics::Native, AtomicOp::Add(add)) => ex.fetch_add(ch, at, add),
            (Atomics::Native, AtomicOp::Swap(c, s)) => ex.compare_swap(ch, at, c, s),
            (Atomics::RunningTotals(sw), AtomicOp::Add(add)) => {
                return self.total_add(ex, ch, sw, at, remote.addr, add, res);
            }
            (Atomics::RunningTotals(_), AtomicOp::Swap(..)) => {
                let cause = Cause::NoCompareSwap { addr: remote.addr };
                return Err(Fail::new(syndrome::REMOTE_OP_ERR, cause));
            }
        }
        .map_err(Fail::exec)?;
        sink_write(ex, ch, res, old)?;
        Ok(Outcome::Done(8))
    }

    /// A fetch-add without atomics: where this NIC is the only writer, the
    /// running total, written after the work before it on the channel.
    #[allow(clippy::too_many_arguments)] // one fetch-add, spelled out
    fn total_add<E: Executor<Cq = C>>(
        &mut self,
        ex: &mut E,
        ch: Channel,
        sw: SoleWriter,
        at: Loc,
        addr: u64,
        add: u64,
        res: Loc,
    ) -> Result<Outcome, Fail> {
        let sole = match at.region {
            Region::Counters => at.offset.is_multiple_of(sw.counter_stride.max(8)),
            Region::Window(w) => {
                w == sw.signal_window
                    && (at.offset / 8) % self.cfg.nranks as u64 == self.cfg.rank as u64
            }
            Region::Sink => false,
        };
        if !sole {
            let cause = Cause::NotSoleWriter {
                addr,
                rank: at.rank,
            };
            return Err(Fail::new(syndrome::REMOTE_OP_ERR, cause));
        }
        let key = (at.rank, at.region, at.offset);
        let old = self.totals.get(&key).copied().unwrap_or(0);
        let new = old.wrapping_add(add);
        // The old value first: a total handed over may be held in flight
        // (sent later whatever happens to this WQE), so nothing may fail
        // after it.
        sink_write(ex, ch, res, old)?;
        let w = ex
            .write(ch, at, Payload::Bytes(&new.to_le_bytes()))
            .map_err(Fail::exec)?;
        self.totals.insert(key, new);
        Ok(written(w, 8))
    }

    /// Resolves `(key, addr)` of `len` bytes on `rank` for `access`: the
    /// key's region, the access it allows, and the bounds. Local operands
    /// fail with a local protection error, remote ones with a remote access
    /// error.
    fn resolve<E: Executor<Cq = C>>(
        &self,
        ex: &mut E,
        rank: usize,
        m: MemRef,
        len: u64,
        access: Access,
    ) -> Result<Loc, Fail> {
        let syn = if access.is_local() {
            syndrome::LOCAL_PROT_ERR
        } else {
            syndrome::REMOTE_ACCESS_ERR
        };
        let fail = |cause| Fail::new(syn, cause);
        let here = rank == self.cfg.rank;
        let (region, part) = match m.key {
            COUNTER_KEY if here => (Region::Counters, self.cfg.counters),
            SINK_KEY if here => (Region::Sink, self.cfg.sink),
            key => {
                let (window, owner) = window_of_key(key, self.cfg.nranks)
                    .ok_or_else(|| fail(Cause::UnknownKey { key, rank }))?;
                if owner != rank {
                    return Err(fail(Cause::ForeignKey { key, owner, rank }));
                }
                let part = ex
                    .part(window, rank)
                    .ok_or_else(|| fail(Cause::NoWindow { key, window, rank }))?;
                (Region::Window(window), part)
            }
        };
        if !access.allowed_on(region) {
            return Err(fail(Cause::Access {
                key: m.key,
                region,
                access,
            }));
        }
        let offset = m.addr.wrapping_sub(part.base);
        if m.addr < part.base || offset.checked_add(len).is_none_or(|e| e > part.size) {
            return Err(fail(Cause::OutOfBounds {
                key: m.key,
                addr: m.addr,
                len,
                base: part.base,
                size: part.size,
            }));
        }
        Ok(Loc {
            rank,
            region,
            offset,
            len,
        })
    }
}

/// A write's outcome, `byte_cnt` for its CQE.
fn written(w: WriteStatus, byte_cnt: u32) -> Outcome {
    match w {
        WriteStatus::Done => Outcome::Done(byte_cnt),
        WriteStatus::Pending(t) => Outcome::InFlight(t, byte_cnt),
    }
}

/// An atomic's old value (big-endian) into this rank's memory at `res`:
/// never in flight (the executor's contract).
fn sink_write<E: Executor>(ex: &mut E, ch: Channel, res: Loc, old: u64) -> Result<(), Fail> {
    match ex
        .write(ch, res, Payload::Bytes(&old.to_be_bytes()))
        .map_err(Fail::exec)?
    {
        WriteStatus::Done => Ok(()),
        WriteStatus::Pending(t) => Err(Fail::exec(super::exec::ExecError::Malformed {
            why: format!(
                "the write of an atomic's old value to {} is in flight (ticket {}): this NIC needs it done",
                res.region, t.0
            ),
        })),
    }
}

#[derive(Debug, Clone, Copy)]
enum AtomicOp {
    Add(u64),
    Swap(u64, u64),
}
