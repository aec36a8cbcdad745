//! The combine lane of one channel: the dispatch run backwards.
//!
//! - **forwarder**: for each token it forwarded from another host's source,
//!   the rows of this host's receivers are read in place (load/store where
//!   mapped, else fetched by `get`), summed once, and put back to the source
//!   in runs, each run's signal counting the rows delivered (a token that
//!   only this rank received goes straight from its combine row, no copy);
//! - **source**: this lane's tokens are reduced in token order, each as
//!   soon as every host it went to has delivered (DeepEP's `send_rdma_head`:
//!   the token's slot among those sent to the host, against the host's
//!   signal), with this host's receivers' rows read in place.

use std::ops::Range;

use gin_core::Remote;

use super::lane::{FwdBlock, Lane, Shared, Xfer, complete};
use super::plan::{CGET, CHUNK, CRDMA, CSEND, CSTAGE, RUN, STAGE};
use crate::error::EpError;
use crate::layout::{Layout, NONE};
use crate::num::sum_bf16_rows;

/// Rows for one put: `n` rows from `src_off` of window `win` here to
/// `dst_off` of CRDMA at `to`.
#[derive(Debug, Clone, Copy)]
struct Run {
    to: usize,
    win: usize,
    src_off: usize,
    dst_off: usize,
    n: usize,
}

/// The combine lane of one channel.
#[derive(Debug)]
pub(crate) struct CombineLane<'a> {
    sh: &'a Shared<'a>,
    ch: usize,
    seen: &'a mut [u64],
    issued: &'a mut u64,
    blocks: &'a [FwdBlock],
    blk: usize,
    pos: u32,
    /// Staging rows used since the last flush.
    staged: usize,
    run: Option<Run>,
    lay: &'a Layout,
    range: Range<usize>,
    next: usize,
    out: &'a mut [u8],
    /// Per host: rows arrived in this channel this step.
    got: Vec<u64>,
    closed: bool,
    acc: Vec<f32>,
}

impl<'a> CombineLane<'a> {
    pub(crate) fn new(
        sh: &'a Shared<'a>,
        ch: usize,
        seen: &'a mut [u64],
        issued: &'a mut u64,
        blocks: &'a [FwdBlock],
        lay: &'a Layout,
        out: &'a mut [u8],
    ) -> Self {
        let range = sh.s.chan_range(lay.tokens, ch);
        Self {
            sh,
            ch,
            seen,
            issued,
            blocks,
            blk: 0,
            pos: 0,
            staged: 0,
            run: None,
            lay,
            next: range.start,
            range,
            out,
            got: vec![0; sh.s.h],
            closed: false,
            acc: Vec::new(),
        }
    }

    /// The combine row of the token `j`th among `dst`'s received tokens:
    /// read in place where mapped, else fetched into this lane's row `slot`
    /// of CGET (the caller flushes before reading it: see `fetched`).
    fn row_of(&self, dst: usize, j: u32, slot: usize) -> Result<Option<&'a [u8]>, EpError> {
        let (sh, h2) = (self.sh, self.sh.s.h2);
        if sh.direct[dst] {
            return Ok(Some(sh.mem.bytes(CSEND, dst, j as usize * h2, h2)?));
        }
        let at = (self.ch * sh.s.l + slot) * h2;
        sh.dc.ctx(self.ch as u32)?.get(
            dst,
            &sh.mem.wins[CSEND],
            (j as usize * h2) as u64,
            &sh.mem.wins[CGET],
            at as u64,
            h2 as u64,
        )?;
        Ok(None)
    }

    /// The rows of `(dst, j)` pairs, fetching those not mapped here.
    fn rows(&self, pairs: &[(usize, u32)]) -> Result<Vec<&'a [u8]>, EpError> {
        let sh = self.sh;
        let h2 = sh.s.h2;
        let mut rows = Vec::with_capacity(pairs.len());
        let mut fetched = false;
        for (i, &(dst, j)) in pairs.iter().enumerate() {
            let r = self.row_of(dst, j, i)?;
            fetched |= r.is_none();
            rows.push(r);
        }
        if fetched {
            sh.dc.ctx(self.ch as u32)?.flush()?;
        }
        rows.into_iter()
            .enumerate()
            .map(|(i, r)| match r {
                Some(r) => Ok(r),
                None => sh.mem.bytes(CGET, sh.rank, (self.ch * sh.s.l + i) * h2, h2),
            })
            .collect()
    }

    /// Puts the pending run back to its source.
    fn issue(&mut self) -> Result<(), EpError> {
        let Some(run) = self.run.take() else {
            return Ok(());
        };
        let sh = self.sh;
        let x = Xfer {
            peer: run.to,
            dst: CRDMA,
            dst_off: run.dst_off,
            src: run.win,
            src_off: run.src_off,
            len: run.n * sh.s.h2,
        };
        let signal = Remote::signal_add(sh.s.ctail(sh.host()), run.n as u64);
        sh.put(self.ch, self.issued, x, signal)
    }

    /// Adds one row to the pending run, or issues it and starts another.
    fn append(
        &mut self,
        to: usize,
        win: usize,
        src_off: usize,
        dst_off: usize,
    ) -> Result<(), EpError> {
        let h2 = self.sh.s.h2;
        if let Some(r) = &mut self.run
            && r.to == to
            && r.win == win
            && r.src_off + r.n * h2 == src_off
            && r.dst_off + r.n * h2 == dst_off
            && r.n < RUN
        {
            r.n += 1;
            return Ok(());
        }
        self.issue()?;
        self.run = Some(Run {
            to,
            win,
            src_off,
            dst_off,
            n: 1,
        });
        Ok(())
    }

    /// Sums and sends back up to `budget` forwarded tokens; true if any.
    fn forward_rows(&mut self, budget: usize) -> Result<bool, EpError> {
        let sh = self.sh;
        let s = &sh.s;
        let mut done = 0;
        while self.blk < self.blocks.len() && done < budget {
            let b = &self.blocks[self.blk];
            if self.pos == b.n {
                self.blk += 1;
                self.pos = 0;
                continue;
            }
            let i = self.pos as usize;
            let pairs: Vec<(usize, u32)> = (0..s.l)
                .filter(|&dl| b.contrib[i * s.l + dl] != NONE)
                .map(|dl| (sh.host() * s.l + dl, b.contrib[i * s.l + dl]))
                .collect();
            let dst_off = (sh.host() * s.t + (b.hs_start + self.pos) as usize) * s.h2;
            if let [(dst, j)] = pairs[..]
                && dst == sh.rank
            {
                self.append(b.src, CSEND, j as usize * s.h2, dst_off)?;
            } else {
                if self.staged == STAGE {
                    // Every staging row is in use: complete the puts reading
                    // them before rewriting.
                    self.issue()?;
                    complete(sh.dc, self.ch as u32, *self.issued, sh.timeout, sh.rank)?;
                    self.staged = 0;
                }
                let g = (self.ch * STAGE + self.staged) * s.h2;
                self.staged += 1;
                let rows = self.rows(&pairs)?;
                // SAFETY: staging row `g` is this lane's (its channel's
                // block), nothing else references it, and no put reads it:
                // it was never used since the last flush of this context.
                let out = unsafe { sh.mem.own_mut(CSTAGE, g, s.h2)? };
                sum_bf16_rows(&rows, out, &mut self.acc);
                self.append(b.src, CSTAGE, g, dst_off)?;
            }
            self.pos += 1;
            done += 1;
        }
        self.issue()?;
        Ok(done > 0)
    }

    /// Rows arrived from `host` in this channel, re-read from its signal.
    fn refresh(&mut self, host: usize) -> Result<u64, EpError> {
        let sh = self.sh;
        let id = sh.s.ctail(host);
        let v = sh.dc.ctx(self.ch as u32)?.read_signal(id)?;
        let got = v.wrapping_sub(self.seen[id as usize]);
        let want = u64::from(sh.plan.host_chan(sh.rank, host, self.ch));
        if got > want {
            return Err(EpError::Protocol {
                rank: sh.rank,
                peer: sh.plan.forwarder(sh.rank, host).unwrap_or(host * sh.s.l),
                what: format!(
                    "{got} combined rows in channel {}, {want} expected",
                    self.ch
                ),
            });
        }
        self.got[host] = got;
        Ok(got)
    }

    /// Reduces up to `budget` of this lane's tokens, in order, while every
    /// host each went to has delivered; true if any.
    fn reduce(&mut self, budget: usize) -> Result<bool, EpError> {
        let sh = self.sh;
        let (s, me, lay) = (&sh.s, sh.rank, self.lay);
        let mut done = 0;
        while self.next < self.range.end && done < budget {
            let t = self.next;
            for host in (0..s.h).filter(|&h| h != sh.host() && lay.is_token_in_host[t * s.h + h]) {
                let need = u64::from(
                    lay.host_slot[t * s.h + host] - sh.plan.host_chan_start(me, host, self.ch),
                ) + 1;
                if self.got[host] < need && self.refresh(host)? < need {
                    return Ok(done > 0);
                }
            }
            let locals: Vec<(usize, u32)> = (0..s.l)
                .map(|dl| sh.host() * s.l + dl)
                .filter(|&dst| lay.is_token_in_rank[t * s.r + dst])
                .map(|dst| {
                    (
                        dst,
                        sh.plan.recv_start(dst, me) + lay.rank_slot[t * s.r + dst],
                    )
                })
                .collect();
            let mut rows = self.rows(&locals)?;
            for host in (0..s.h).filter(|&h| h != sh.host() && lay.is_token_in_host[t * s.h + h]) {
                let at = (host * s.t + lay.host_slot[t * s.h + host] as usize) * s.h2;
                rows.push(sh.mem.bytes(CRDMA, me, at, s.h2)?);
            }
            let i = t - self.range.start;
            sum_bf16_rows(
                &rows,
                &mut self.out[i * s.h2..(i + 1) * s.h2],
                &mut self.acc,
            );
            self.next += 1;
            done += 1;
        }
        Ok(done > 0)
    }
}

impl Lane for CombineLane<'_> {
    fn poll(&mut self) -> Result<bool, EpError> {
        let mut moved = self.forward_rows(RUN)?;
        moved |= self.reduce(CHUNK)?;
        if !self.closed && self.blk == self.blocks.len() && self.next == self.range.end {
            let sh = self.sh;
            for host in (0..sh.s.h).filter(|&h| h != sh.host()) {
                let id = sh.s.ctail(host) as usize;
                self.seen[id] += u64::from(sh.plan.host_chan(sh.rank, host, self.ch));
            }
            self.closed = true;
            moved = true;
        }
        Ok(moved)
    }

    fn done(&self) -> bool {
        self.closed
    }

    fn waiting(&self) -> (usize, String, u32, u64) {
        let sh = self.sh;
        let (s, lay) = (&sh.s, self.lay);
        let t = self.next.min(self.range.end.saturating_sub(1));
        let host = (0..s.h)
            .find(|&h| h != sh.host() && t < lay.tokens && lay.is_token_in_host[t * s.h + h])
            .unwrap_or(0);
        let id = s.ctail(host);
        let peer = sh.plan.forwarder(sh.rank, host).unwrap_or(host * s.l);
        (
            peer,
            "its combined rows".into(),
            id,
            self.seen[id as usize] + self.got[host] + 1,
        )
    }

    fn ctx(&self) -> u32 {
        self.ch as u32
    }
}
