//! The shape of a high-throughput buffer (windows, signal ids, message
//! layout) and the plan of one step: the count matrix every rank learns in
//! the notify exchange, who forwards for whom, and where each source's block
//! starts at each receiver.

use std::ops::Range;

use gin_core::{CounterId, Local, Remote};

use crate::buffer::{Buffer, Hosts};
use crate::config::Config;
use crate::error::EpError;
use crate::layout::Layout;

/// Window indices.
pub(crate) const NSEND: usize = 0;
pub(crate) const NRECV: usize = 1;
pub(crate) const XIN: usize = 2;
pub(crate) const MIN: usize = 3;
pub(crate) const RINGX: usize = 4;
pub(crate) const RINGM: usize = 5;
pub(crate) const RECVX: usize = 6;
pub(crate) const RECVM: usize = 7;
pub(crate) const CSEND: usize = 8;
pub(crate) const CSTAGE: usize = 9;
pub(crate) const CRDMA: usize = 10;
pub(crate) const CGET: usize = 11;

/// Messages one put into a ring carries at most (DeepEP's chunked sends:
/// the forwarder starts on a chunk while the next is on its way).
pub(crate) const CHUNK: usize = 16;
/// Messages or rows one put carries at most where no ring bounds it
/// (straight into final places, combine rows back to sources): fewer,
/// larger puts cost less per byte on a socket.
pub(crate) const RUN: usize = 64;
/// Combine rows each channel stages before reusing its staging (after a
/// flush).
pub(crate) const STAGE: usize = 4 * CHUNK;

/// The shape of a high-throughput buffer in a job.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    /// Ranks, hosts, ranks per host, max tokens per rank, top-k.
    pub(crate) r: usize,
    pub(crate) h: usize,
    pub(crate) l: usize,
    pub(crate) t: usize,
    pub(crate) k: usize,
    /// Payload bytes of one token (BF16 or FP8 with scales).
    pub(crate) p: usize,
    /// Metadata bytes of one token: source index, top-k ids and weights,
    /// its slot among the source's tokens for every host and every rank.
    pub(crate) mm: usize,
    /// Bytes of one combine row (BF16).
    pub(crate) h2: usize,
    /// Slots of each (channel, source) ring.
    pub(crate) ring: usize,
    /// Channels.
    pub(crate) chans: usize,
}

/// Word offsets in a token's metadata.
impl Shape {
    pub(crate) fn of(cfg: &Config, nranks: usize, l: usize) -> Self {
        let h = nranks / l.max(1);
        let words = 1 + 2 * cfg.topk + h + nranks;
        Self {
            r: nranks,
            h,
            l,
            t: cfg.max_tokens_per_rank,
            k: cfg.topk,
            p: cfg.payload_bytes(),
            mm: (4 * words).next_multiple_of(16),
            h2: 2 * cfg.hidden,
            ring: cfg.ring_slots,
            chans: cfg.channels,
        }
    }

    #[allow(clippy::unused_self)] // one family with the others
    pub(crate) fn w_ids(&self) -> usize {
        1
    }
    pub(crate) fn w_weights(&self) -> usize {
        1 + self.k
    }
    pub(crate) fn w_host_slot(&self, host: usize) -> usize {
        1 + 2 * self.k + host
    }
    pub(crate) fn w_rank_slot(&self, rank: usize) -> usize {
        1 + 2 * self.k + self.h + rank
    }

    /// Signal ids (the same in every context; one context per channel).
    /// Notify: `src`'s counts arrived (context 0).
    #[allow(clippy::unused_self)] // one family with the others
    pub(crate) fn notify(&self, src: usize) -> u32 {
        src as u32
    }
    /// At a forwarder: messages `src` put into its ring.
    pub(crate) fn tail(&self, src: usize) -> u32 {
        (self.r + src) as u32
    }
    /// At a forwarder: messages `src` put straight into its final place
    /// here (tokens this forwarder receives itself).
    pub(crate) fn dtail(&self, src: usize) -> u32 {
        (2 * self.r + src) as u32
    }
    /// At a sender: messages forwarder `fwd` consumed from its ring (the
    /// credits).
    pub(crate) fn head(&self, fwd: usize) -> u32 {
        (3 * self.r + fwd) as u32
    }
    /// At a receiver: tokens the forwarder of local index `local` delivered.
    pub(crate) fn fwd(&self, local: usize) -> u32 {
        (4 * self.r + local) as u32
    }
    /// At a forwarder: the combine rows of local rank `local` are ready
    /// (context 0).
    pub(crate) fn cready(&self, local: usize) -> u32 {
        (4 * self.r + self.l + local) as u32
    }
    /// At a source: combined rows `host`'s forwarder put back.
    pub(crate) fn ctail(&self, host: usize) -> u32 {
        (4 * self.r + 2 * self.l + host) as u32
    }
    pub(crate) fn signals(&self) -> u32 {
        (4 * self.r + 2 * self.l + self.h) as u32
    }

    /// Words of a notify row: the sender's active mask, then its tokens per
    /// (rank, channel) and per (host, channel).
    pub(crate) fn mask_words(&self) -> usize {
        self.r.div_ceil(32)
    }
    pub(crate) fn row_words(&self) -> usize {
        self.mask_words() + (self.r + self.h) * self.chans
    }

    /// Channel `c`'s share of `tokens` tokens (contiguous, in order).
    pub(crate) fn chan_range(&self, tokens: usize, c: usize) -> Range<usize> {
        tokens * c / self.chans..tokens * (c + 1) / self.chans
    }
}

/// Word `i` of token `t`'s metadata (shared by CPU and CUDA ranks): its
/// index, top-k ids (as i32) and weights, its slot among this rank's tokens
/// for every host and every rank ([`crate::layout::NONE`] where it does not
/// go), zero padding.
pub(crate) fn meta_word(
    s: &Shape,
    lay: &Layout,
    idx: &[i64],
    w: &[f32],
    t: usize,
    i: usize,
) -> u32 {
    let k = s.k;
    if i == 0 {
        t as u32
    } else if i < s.w_weights() {
        idx[t * k + i - s.w_ids()] as i32 as u32
    } else if i < s.w_host_slot(0) {
        w[t * k + i - s.w_weights()].to_bits()
    } else if i < s.w_rank_slot(0) {
        lay.host_slot[t * s.h + i - s.w_host_slot(0)]
    } else if i < s.w_rank_slot(s.r) {
        lay.rank_slot[t * s.r + i - s.w_rank_slot(0)]
    } else {
        0
    }
}

/// Signals (per context), contexts and window sizes of a high-throughput
/// buffer.
pub(crate) fn resources(
    cfg: &Config,
    rank: usize,
    hosts: &Hosts,
) -> Result<(u32, u32, Vec<usize>), EpError> {
    let Some(l) = hosts.ranks_per_host else {
        return Err(EpError::Mode {
            rank,
            what: format!(
                "high-throughput mode needs hosts of equal size with ranks numbered host by host; host of each rank: {:?}",
                hosts.host_of
            ),
        });
    };
    if l > 64 {
        return Err(EpError::Config {
            rank,
            field: "ranks per host",
            value: l,
            why: "high-throughput mode handles at most 64",
        });
    }
    let s = Shape::of(cfg, hosts.host_of.len(), l);
    let (c, rings) = (s.chans, s.chans * s.r * s.ring);
    let sizes = vec![
        4 * s.row_words(),
        2 * s.r * 4 * s.row_words(),
        s.t * s.p,
        s.t * s.mm,
        rings * s.p,
        rings * s.mm,
        s.r * s.t * s.p,
        s.r * s.t * s.mm,
        s.r * s.t * s.h2,
        c * STAGE * s.h2,
        s.h * s.t * s.h2,
        // Rows fetched by `get` from same-host peers not mapped here; sized
        // once the mapping is known (see `Buffer::new`).
        0,
    ];
    Ok((s.signals(), c as u32, sizes))
}

/// The bytes of window CGET: where some same-host peer's combine rows are not
/// mapped here, one row per (channel, local rank) to fetch them into.
pub(crate) fn cget_bytes(cfg: &Config, l: usize, unmapped_local_peer: bool) -> usize {
    if unmapped_local_peer {
        cfg.channels * l * 2 * cfg.hidden
    } else {
        0
    }
}

/// The plan of one step, the same on every rank: built from every active
/// rank's notify row.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub(crate) r: usize,
    pub(crate) h: usize,
    pub(crate) l: usize,
    pub(crate) c: usize,
    pub(crate) active: Vec<bool>,
    /// `[(src * r + dst) * c + ch]`: tokens from `src` to `dst` in channel
    /// `ch`.
    rank_chan: Vec<u32>,
    /// `[(src * h + host) * c + ch]`.
    host_chan: Vec<u32>,
    /// `[dst * (r + 1) + src]`: where `src`'s block starts among `dst`'s
    /// received tokens (the last entry: the total).
    recv_pre: Vec<u32>,
    /// `[src * h + host]`: the rank forwarding `src`'s tokens on `host`.
    fwd_of: Vec<Option<usize>>,
}

impl Plan {
    /// From every rank's row (`None` for masked ranks).
    pub(crate) fn new(s: &Shape, active: Vec<bool>, rows: &[Option<Vec<u32>>]) -> Self {
        let (r, h, c, mw) = (s.r, s.h, s.chans, s.mask_words());
        let mut rank_chan = vec![0u32; r * r * c];
        let mut host_chan = vec![0u32; r * h * c];
        for (src, row) in rows.iter().enumerate() {
            let Some(row) = row else { continue };
            rank_chan[src * r * c..(src + 1) * r * c].copy_from_slice(&row[mw..mw + r * c]);
            host_chan[src * h * c..(src + 1) * h * c]
                .copy_from_slice(&row[mw + r * c..mw + (r + h) * c]);
        }
        let mut recv_pre = vec![0u32; r * (r + 1)];
        for dst in 0..r {
            for src in 0..r {
                let n: u32 = rank_chan[(src * r + dst) * c..(src * r + dst + 1) * c]
                    .iter()
                    .sum();
                recv_pre[dst * (r + 1) + src + 1] = recv_pre[dst * (r + 1) + src] + n;
            }
        }
        let fwd_of = (0..r * h)
            .map(|i| forwarder(&active, s.l, i / h, i % h))
            .collect();
        Self {
            r,
            h,
            l: s.l,
            c,
            active,
            rank_chan,
            host_chan,
            recv_pre,
            fwd_of,
        }
    }

    /// Tokens from `src` to `dst` in channel `ch`.
    pub(crate) fn rank_chan(&self, src: usize, dst: usize, ch: usize) -> u32 {
        self.rank_chan[(src * self.r + dst) * self.c + ch]
    }
    /// Tokens from `src` to `dst` in channels before `ch`.
    pub(crate) fn rank_chan_start(&self, src: usize, dst: usize, ch: usize) -> u32 {
        (0..ch).map(|c| self.rank_chan(src, dst, c)).sum()
    }
    /// Tokens from `src` to `dst`.
    pub(crate) fn count(&self, src: usize, dst: usize) -> u32 {
        self.rank_chan_start(src, dst, self.c)
    }
    /// Tokens from `src` to `host` in channel `ch`.
    pub(crate) fn host_chan(&self, src: usize, host: usize, ch: usize) -> u32 {
        self.host_chan[(src * self.h + host) * self.c + ch]
    }
    /// Tokens from `src` to `host` in channels before `ch`.
    pub(crate) fn host_chan_start(&self, src: usize, host: usize, ch: usize) -> u32 {
        (0..ch).map(|c| self.host_chan(src, host, c)).sum()
    }
    /// Where `src`'s block starts among `dst`'s received tokens.
    pub(crate) fn recv_start(&self, dst: usize, src: usize) -> u32 {
        self.recv_pre[dst * (self.r + 1) + src]
    }
    /// `dst`'s block starts, `r + 1` entries.
    pub(crate) fn recv_prefix(&self, dst: usize) -> &[u32] {
        &self.recv_pre[dst * (self.r + 1)..(dst + 1) * (self.r + 1)]
    }
    /// The rank forwarding `src`'s tokens on `host`.
    pub(crate) fn forwarder(&self, src: usize, host: usize) -> Option<usize> {
        self.fwd_of[src * self.h + host]
    }
    /// The plan as one table of `u32` words for the CUDA kernels
    /// ([`TableAt`] says where each part starts): the tokens per (source,
    /// destination, channel) and per (source, host, channel), each
    /// receiver's block starts, and the forwarder of every (source, host)
    /// ([`crate::layout::NONE`] for none). The notify kernel builds it on
    /// the GPU (`kernels/ht.cu`'s `plan_word`); this is the reference its
    /// tests hold it to.
    #[cfg(test)]
    pub(crate) fn tables(&self) -> Vec<u32> {
        let mut v = Vec::with_capacity(TableAt::of(self.r, self.h, self.c).words);
        v.extend_from_slice(&self.rank_chan);
        v.extend_from_slice(&self.host_chan);
        v.extend_from_slice(&self.recv_pre);
        v.extend(
            self.fwd_of
                .iter()
                .map(|f| f.map_or(crate::layout::NONE, |p| p as u32)),
        );
        v
    }

    /// Remote sources whose tokens `fwd` forwards on its host, in rank
    /// order.
    pub(crate) fn forwarded_sources(&self, fwd: usize) -> Vec<usize> {
        let host = fwd / self.l;
        (0..self.r)
            .filter(|&src| src / self.l != host && self.forwarder(src, host) == Some(fwd))
            .collect()
    }
}

/// Where each part of [`Plan::tables`] starts (words), and its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TableAt {
    pub(crate) rank_chan: usize,
    pub(crate) host_chan: usize,
    pub(crate) recv_pre: usize,
    pub(crate) fwd_of: usize,
    pub(crate) words: usize,
}

impl TableAt {
    /// For `r` ranks, `h` hosts and `c` channels.
    pub(crate) fn of(r: usize, h: usize, c: usize) -> Self {
        let host_chan = r * r * c;
        let recv_pre = host_chan + r * h * c;
        let fwd_of = recv_pre + r * (r + 1);
        Self {
            rank_chan: 0,
            host_chan,
            recv_pre,
            fwd_of,
            words: fwd_of + r * h,
        }
    }
}

/// The rank that forwards `src`'s tokens on `host`: `src` itself on its own
/// host; elsewhere the rank with `src`'s local index, or where that rank is
/// masked the next active one in cyclic order (so that survivors reroute a
/// lost rank's forwarding role alike). `None`: no active rank there.
pub(crate) fn forwarder(active: &[bool], l: usize, src: usize, host: usize) -> Option<usize> {
    if host == src / l {
        return active[src].then_some(src);
    }
    (0..l)
        .map(|i| host * l + (src % l + i) % l)
        .find(|&cand| active[cand])
}

/// This rank's notify row: its active mask, then its tokens per (rank,
/// channel) and per (host, channel).
pub(crate) fn notify_row(s: &Shape, lay: &Layout, active: &[bool]) -> Vec<u32> {
    let (r, h, c) = (s.r, s.h, s.chans);
    let mw = s.mask_words();
    let mut row = vec![0u32; s.row_words()];
    for (p, _) in active.iter().enumerate().filter(|(_, a)| **a) {
        row[p / 32] |= 1 << (p % 32);
    }
    for ch in 0..c {
        for t in s.chan_range(lay.tokens, ch) {
            for dst in 0..r {
                if lay.is_token_in_rank[t * r + dst] {
                    row[mw + dst * c + ch] += 1;
                }
            }
            for host in 0..h {
                if lay.is_token_in_host[t * h + host] {
                    row[mw + (r + host) * c + ch] += 1;
                }
            }
        }
    }
    row
}

/// Every count word of a refused notify row ([`refused_row`]): above any
/// buffer's maximum, so that a reader that did not know the mark would
/// still refuse the row by [`check_row`].
pub(crate) const REFUSED: u32 = u32::MAX;

/// The notify row of a rank whose own inputs were refused this step:
/// its active mask as [`notify_row`] writes it, every count [`REFUSED`].
/// It still takes part in the count exchange with this row, so that its
/// peers (which wait for every active rank's row) learn at once that the
/// step ends with nothing sent, rather than waiting for the job timeout.
pub(crate) fn refused_row(s: &Shape, active: &[bool]) -> Vec<u32> {
    let mw = s.mask_words();
    let mut row = vec![REFUSED; s.row_words()];
    row[..mw].fill(0);
    for (p, _) in active.iter().enumerate().filter(|(_, a)| **a) {
        row[p / 32] |= 1 << (p % 32);
    }
    row
}

/// Whether `row` is a [`refused_row`] (its first count word is
/// [`REFUSED`]: no count of a real row reaches it, [`check_row`] bounding
/// them by the buffer's maximum).
pub(crate) fn is_refused(s: &Shape, row: &[u32]) -> bool {
    row.get(s.mask_words()) == Some(&REFUSED)
}

impl Buffer<'_> {
    /// The notify exchange: every active rank puts its row to every active
    /// rank. A rank found lost meanwhile (under [`crate::OnPeerLoss::Mask`])
    /// is masked, and so is any rank another row masks; the exchange then
    /// runs again with the layout recomputed, until one round in which
    /// every row carries the same mask. Returns the step's plan; `lay` is
    /// the layout under the final mask.
    pub(crate) fn ht_notify(
        &mut self,
        s: &Shape,
        lay: &mut Layout,
        topk_idx: &[i64],
    ) -> Result<Plan, EpError> {
        loop {
            let before = self.active.clone();
            // A round that failed midway (a peer's row not in by the
            // timeout, a failed put) leaves its late rows to be taken for
            // the next step's: the buffer refuses further steps.
            let rows = match self.ht_notify_round(s, &notify_row(s, lay, &self.active)) {
                Ok(rows) => rows,
                Err(e) => {
                    self.phase = crate::buffer::Phase::Broken;
                    return Err(e);
                }
            };
            // A refused row first: this step ends on every rank after this
            // one round (every rank takes it), with nothing sent.
            let refused = rows
                .iter()
                .enumerate()
                .find(|(_, row)| row.as_deref().is_some_and(|row| is_refused(s, row)));
            if let Some((src, _)) = refused {
                return Err(refused_by(self.rank, src));
            }
            for (src, row) in rows.iter().enumerate() {
                if let Some(row) = row {
                    check_row(s, self.rank, src, row)?;
                }
            }
            let mut merged = self.active.clone();
            let mut agree = true;
            for row in rows.iter().flatten() {
                for (p, m) in merged.iter_mut().enumerate() {
                    let bit = row[p / 32] >> (p % 32) & 1 == 1;
                    agree &= bit == before[p];
                    *m &= bit;
                }
            }
            if !merged[self.rank] {
                return Err(EpError::Mode {
                    rank: self.rank,
                    what: "another rank masked this rank as lost during the count exchange".into(),
                });
            }
            for (p, _) in merged.iter().enumerate().filter(|(_, m)| !**m) {
                self.mask_lost(p);
            }
            if agree && self.active == before {
                let rows = rows
                    .into_iter()
                    .enumerate()
                    .map(|(p, row)| row.filter(|_| self.active[p]))
                    .collect::<Vec<_>>();
                return Ok(Plan::new(s, self.active.clone(), &rows));
            }
            let rph = self.hosts.ranks_per_host.unwrap_or(1);
            *lay = Layout::new(
                self.rank,
                topk_idx,
                s.k,
                self.cfg.num_experts,
                &self.active,
                rph,
            )?;
        }
    }

    /// One round of the notify exchange with `row` as this rank's row;
    /// every active rank's row as received, unchecked (`None` for ranks
    /// masked before or during the round).
    pub(crate) fn ht_notify_round(
        &mut self,
        s: &Shape,
        row: &[u32],
    ) -> Result<Vec<Option<Vec<u32>>>, EpError> {
        let width = 4 * row.len();
        let parity = (self.ht_rounds % 2) as usize;
        self.ht_rounds += 1;
        // The previous round's puts read this row: complete them first.
        self.settle()?;
        let bytes: Vec<u8> = row.iter().flat_map(|w| w.to_le_bytes()).collect();
        self.bytes_mut(NSEND, 0, width).copy_from_slice(&bytes);
        self.unflushed = true;
        let at = ((parity * s.r + self.rank) * width) as u64;
        for peer in 0..s.r {
            if !self.active[peer] {
                continue;
            }
            let put = self.dc.ctx(0)?.put(
                peer,
                &self.wins[NRECV],
                at,
                &self.wins[NSEND],
                0,
                width as u64,
                Remote::signal_add(s.notify(self.rank), 1),
                Local::CounterInc(CounterId(0)),
            );
            if put.is_ok() {
                self.issued[0] += 1;
            }
            self.sent(put, peer)?;
        }
        let step = self.step;
        for src in 0..s.r {
            if !self.active[src] {
                continue;
            }
            let what = || format!("its token counts (step {step})");
            let id = s.notify(src) as usize;
            let base = self.seen[id];
            // Exactly one round: a faster rank may be a round ahead already.
            if self.wait_signal(id as u32, src, &what)?.is_some() {
                self.seen[id] = base.wrapping_add(1);
            }
        }
        let mut rows = vec![None; s.r];
        for (src, slot) in rows.iter_mut().enumerate() {
            if !self.active[src] {
                continue;
            }
            let b = self.bytes(NRECV, (parity * s.r + src) * width, width);
            *slot = Some(
                b.chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            );
        }
        Ok(rows)
    }
}

/// What a rank whose peer `src` sent a [`refused_row`] returns: `src`'s
/// inputs were refused, so the step ended on every rank after its count
/// exchange, with nothing sent.
pub(crate) fn refused_by(rank: usize, src: usize) -> EpError {
    EpError::PeerRefused { rank, peer: src }
}

/// A notify row from `src`, received at `rank`: its counts must fit the
/// buffer (shared by CPU and CUDA ranks).
pub(crate) fn check_row(s: &Shape, rank: usize, src: usize, row: &[u32]) -> Result<(), EpError> {
    let mw = s.mask_words();
    if row.len() != s.row_words() {
        return Err(EpError::Protocol {
            rank,
            peer: src,
            what: format!(
                "notify row of {} words, {} expected",
                row.len(),
                s.row_words()
            ),
        });
    }
    let mine: u64 = (0..s.chans)
        .map(|c| u64::from(row[mw + rank * s.chans + c]))
        .sum();
    let most = (0..s.r)
        .map(|d| {
            (0..s.chans)
                .map(|c| u64::from(row[mw + d * s.chans + c]))
                .sum::<u64>()
        })
        .chain((0..s.h).map(|host| {
            (0..s.chans)
                .map(|c| u64::from(row[mw + (s.r + host) * s.chans + c]))
                .sum()
        }))
        .max()
        .unwrap_or(0);
    if mine > s.t as u64 || most > s.t as u64 {
        return Err(EpError::Protocol {
            rank,
            peer: src,
            what: format!("count {} above the maximum {}", mine.max(most), s.t),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forwarders_reroute_around_masked_ranks_alike() {
        // 2 hosts of 3.
        let mut active = vec![true; 6];
        assert_eq!(forwarder(&active, 3, 1, 1), Some(4));
        assert_eq!(forwarder(&active, 3, 4, 1), Some(4));
        active[4] = false;
        assert_eq!(forwarder(&active, 3, 1, 1), Some(5));
        assert_eq!(forwarder(&active, 3, 4, 1), None);
        active[5] = false;
        assert_eq!(forwarder(&active, 3, 1, 1), Some(3));
        active[3] = false;
        assert_eq!(forwarder(&active, 3, 1, 1), None);
    }

    #[test]
    fn a_refused_row_is_never_taken_for_a_real_one() {
        // 2 hosts of 2, 10 tokens at most, 2 local experts per rank, rank 1
        // masked.
        let cfg = Config::high_throughput(128, 10, 8, 2);
        let s = Shape::of(&cfg, 4, 2);
        let active = [true, false, true, true];
        let row = refused_row(&s, &active);
        assert_eq!(row.len(), s.row_words());
        assert_eq!(row[0], 0b1101, "the active mask, as a real row's");
        assert!(is_refused(&s, &row));
        // A reader that did not look for the mark still refuses it.
        assert!(matches!(
            check_row(&s, 0, 2, &row),
            Err(EpError::Protocol {
                rank: 0,
                peer: 2,
                ..
            })
        ));
        // Real rows, empty or at the maximum (every token to ranks 0 and 3,
        // both hosts), are not refused rows, and pass.
        for tokens in [0, 10] {
            let idx: Vec<i64> = (0..tokens).flat_map(|_| [0, 6]).collect();
            let lay = Layout::new(2, &idx, 2, 8, &active, 2).unwrap();
            let real = notify_row(&s, &lay, &active);
            assert!(!is_refused(&s, &real), "{tokens} tokens");
            check_row(&s, 0, 2, &real).unwrap();
        }
        let e = refused_by(0, 2);
        assert!(
            matches!(&e, EpError::PeerRefused { rank: 0, peer: 2 }),
            "{e}"
        );
    }

    #[test]
    fn channels_split_tokens_into_contiguous_ranges() {
        let cfg = Config {
            channels: 3,
            ..Config::high_throughput(128, 10, 4, 2)
        };
        let s = Shape::of(&cfg, 4, 2);
        let all: Vec<usize> = (0..3).flat_map(|c| s.chan_range(10, c)).collect();
        assert_eq!(all, (0..10).collect::<Vec<_>>());
        assert!(s.chan_range(0, 1).is_empty());
    }
}
