//! High-throughput mode: DeepEP's two-stage scheme over hosts of `L` ranks
//! (rank = host × L + local index).
//!
//! Dispatch:
//! 1. **Notify**: every rank puts its per-rank and per-host token counts to
//!    every rank (one signal each), so every rank knows the whole count
//!    matrix: receivers place each source's block, forwarders know what to
//!    expect.
//! 2. **Between hosts**: a rank sends each token once per destination host,
//!    and only to the rank of that host with its own local index (the
//!    forwarder), into a ring of `ring_slots` messages per source host. The
//!    tail is a signal at the forwarder carrying the cumulative count; the
//!    head is a signal back at the sender carrying the cumulative count
//!    consumed: the sender's credits.
//! 3. **Within a host**: the forwarder puts each message (over load/store
//!    where the peer is mapped) straight into the final place at every
//!    local rank that holds one of its experts, returns credits once those
//!    puts no longer read the ring, and signals each receiver with the count
//!    forwarded. A receiver's per-source blocks are contiguous and in the
//!    source's token order (the slot index travels in the message).
//!
//! Combine is the reverse: each receiver puts one row per received token to
//! the forwarder that brought it; the forwarder sums the rows of each token
//! over its host's ranks and puts one row per token back to the source; the
//! source reduces each token as soon as every host it went to has
//! delivered (DeepEP's `send_rdma_head` / `send_nvl_head` bookkeeping, kept
//! here as `host_slot` and the forwarded tokens' rank masks).
//!
//! One rank thread plays DeepEP's roles in turn (sender, forwarder,
//! receiver, coordinator), in one loop that makes progress on each until the
//! step is done; every stall is bounded by the timeout and names the peer.
//! All ranks must be active in this mode (the mask is a low-latency
//! feature for now).

use std::time::Instant;

use gin_core::{Local, Remote};

use crate::buffer::{Buffer, Hosts, Phase};
use crate::config::Config;
use crate::error::EpError;
use crate::layout::{Layout, NONE, prefix};
use crate::ll::{Combined, SenderSide};
use crate::num::{Bf16, bf16_bytes, dequantize_fp8, quantize_fp8};

const NSEND: usize = 0;
const NRECV: usize = 1;
const SEND: usize = 2;
const RING: usize = 3;
const RECV: usize = 4;
const CSEND: usize = 5;
const CNVL: usize = 6;
const CSTAGE: usize = 7;
const CRDMA: usize = 8;

/// The shape of a high-throughput buffer in a job.
#[derive(Debug, Clone, Copy)]
struct Shape {
    r: usize,
    h: usize,
    l: usize,
    t: usize,
    /// Message bytes: payload, token index, top-k ids and weights, host
    /// slot, one rank slot per local rank.
    m: usize,
    ring: usize,
}

impl Shape {
    fn of(cfg: &Config, nranks: usize, l: usize) -> Self {
        let m = (cfg.payload_bytes() + 4 + 8 * cfg.topk + 4 + 4 * l).next_multiple_of(16);
        Self {
            r: nranks,
            h: nranks / l,
            l,
            t: cfg.max_tokens_per_rank,
            m,
            ring: cfg.ring_slots,
        }
    }

    /// Signal ids.
    #[allow(clippy::unused_self)] // one family with the others
    fn notify(&self, src: usize) -> u32 {
        src as u32
    }
    fn tail(&self, src_host: usize) -> u32 {
        (self.r + src_host) as u32
    }
    fn head(&self, dst_host: usize) -> u32 {
        (self.r + self.h + dst_host) as u32
    }
    fn fwd(&self, fwd_local: usize) -> u32 {
        (self.r + 2 * self.h + fwd_local) as u32
    }
    fn cnvl(&self, local: usize) -> u32 {
        (self.r + 2 * self.h + self.l + local) as u32
    }
    fn crdma(&self, host: usize) -> u32 {
        (self.r + 2 * self.h + 2 * self.l + host) as u32
    }
    fn signals(&self) -> u32 {
        (self.r + 3 * self.h + 2 * self.l) as u32
    }
}

/// Signals and window sizes of a high-throughput buffer.
pub(crate) fn resources(
    cfg: &Config,
    rank: usize,
    hosts: &Hosts,
) -> Result<(u32, Vec<usize>), EpError> {
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
    let n = hosts.host_of.len();
    let s = Shape::of(cfg, n, l);
    let h2 = 2 * cfg.hidden;
    let row = 4 * (s.r + s.h);
    let sizes = vec![
        row,
        s.r * row,
        s.h * s.t * s.m,
        s.h * s.ring * s.m,
        s.r * s.t * s.m,
        s.r * s.t * h2,
        s.h * s.t * s.l * h2,
        s.h * s.t * h2,
        s.h * s.t * h2,
    ];
    Ok((s.signals(), sizes))
}

/// The tokens this rank received in one high-throughput dispatch, and what
/// its combine needs (as a receiver, a forwarder and a source).
#[derive(Debug)]
pub struct HtDispatch {
    step: u64,
    sender: SenderSide,
    /// `[src * nranks + dst]`: tokens from `src` to `dst` (the whole job's).
    counts: Vec<u32>,
    /// `[src * nhosts + host]`: tokens from `src` to `host`.
    host_counts: Vec<u32>,
    /// Where each source's block starts here.
    recv_prefix: Vec<u32>,
    /// Per received token: its index at the source, and the sum of the
    /// weights of its slots whose experts are here.
    src_token: Vec<u32>,
    local_weight: Vec<f32>,
    /// Per received token: its index among the source's tokens to this host.
    host_slot: Vec<u32>,
    /// Received tokens per local expert.
    expert_counts: Vec<u32>,
    /// Per forwarded token (source host major, in arrival order): the
    /// token's index at its source and the mask of local ranks it went to.
    fwd: Vec<(u32, u64)>,
    /// Where each source host's forwarded tokens start in `fwd`.
    fwd_prefix: Vec<u32>,
}

impl HtDispatch {
    /// Tokens received from `src` (one contiguous block, in the source's
    /// token order).
    pub fn count(&self, src: usize) -> usize {
        (self.recv_prefix[src + 1] - self.recv_prefix[src]) as usize
    }

    /// Tokens received in all.
    pub fn received(&self) -> usize {
        self.src_token.len()
    }

    /// The index at its source of received token `j` (blocks by source, in
    /// source order).
    pub fn src_token(&self, j: usize) -> usize {
        self.src_token[j] as usize
    }

    /// Where `src`'s block starts among the received tokens.
    pub fn block_start(&self, src: usize) -> usize {
        self.recv_prefix[src] as usize
    }

    /// The sum of received token `j`'s weights for this rank's experts.
    pub fn local_weight(&self, j: usize) -> f32 {
        self.local_weight[j]
    }

    /// Tokens this rank dispatched.
    pub fn tokens(&self) -> usize {
        self.sender.tokens
    }

    /// Received tokens that name local expert `le` (DeepEP's
    /// `num_recv_tokens_per_expert_list`).
    pub fn expert_count(&self, le: usize) -> usize {
        self.expert_counts[le] as usize
    }

    /// The job's count matrix: tokens from `src` to `dst`.
    pub fn tokens_between(&self, src: usize, dst: usize) -> usize {
        let r = self.recv_prefix.len() - 1;
        self.counts[src * r + dst] as usize
    }
}

/// Sender and forwarder progress of one dispatch.
struct Progress {
    /// Per destination host: next token cursor, and messages sent this step.
    cursor: Vec<usize>,
    sent: Vec<usize>,
    /// Per source host: messages consumed this step, and expected.
    consumed: Vec<usize>,
    expect: Vec<usize>,
    /// Per local receiver: tokens forwarded to it this step.
    forwarded: Vec<u64>,
    last: Instant,
}

impl Buffer<'_> {
    fn ht_shape(&self) -> Shape {
        Shape::of(
            &self.cfg,
            self.nranks,
            self.hosts.ranks_per_host.unwrap_or(self.nranks),
        )
    }

    /// High-throughput dispatch: checks the inputs (nothing is sent on an
    /// error), exchanges counts, then moves tokens through the two stages.
    pub fn ht_dispatch(
        &mut self,
        x: &[Bf16],
        topk_idx: &[i64],
        topk_weights: &[f32],
    ) -> Result<HtDispatch, EpError> {
        if self.cfg.mode != crate::Mode::HighThroughput {
            return Err(EpError::Mode {
                rank: self.rank,
                what: "ht_dispatch on a buffer sized for low-latency mode".into(),
            });
        }
        self.expect_phase("ht_dispatch", Phase::Idle)?;
        if let Some(p) = self.active.iter().position(|a| !a) {
            return Err(EpError::Mode {
                rank: self.rank,
                what: format!("rank {p} is masked; high-throughput mode needs every rank"),
            });
        }
        let layout = self.check_inputs(x.len(), topk_idx, topk_weights)?;
        self.settle()?;
        self.step += 1;
        let s = self.ht_shape();
        self.ht_stage(&s, x, topk_idx, topk_weights, &layout);
        let (counts, host_counts) = self.ht_notify(&s, &layout)?;
        let me = self.rank;
        let column: Vec<u32> = (0..s.r).map(|src| counts[src * s.r + me]).collect();
        let recv_prefix = prefix(&column);
        let mut d = HtDispatch {
            step: self.step,
            sender: SenderSide {
                tokens: layout.tokens,
                topk_idx: topk_idx.to_vec(),
                weights: topk_weights.to_vec(),
                layout,
            },
            counts,
            host_counts,
            recv_prefix,
            src_token: Vec::new(),
            local_weight: Vec::new(),
            host_slot: Vec::new(),
            expert_counts: vec![0; self.cfg.local_experts(s.r)],
            fwd: Vec::new(),
            fwd_prefix: Vec::new(),
        };
        self.ht_move(&s, &mut d)?;
        self.ht_receive(&s, &mut d)?;
        self.phase = Phase::Dispatched;
        Ok(d)
    }

    /// Writes one message per (token, destination host) into the send
    /// window.
    fn ht_stage(&mut self, s: &Shape, x: &[Bf16], idx: &[i64], w: &[f32], lay: &Layout) {
        let cfg = self.cfg;
        let (p, hd, k) = (cfg.payload_bytes(), cfg.hidden, cfg.topk);
        let (m, t_max, l) = (s.m, s.t, s.l);
        let nh = s.h;
        let buf = self.bytes_mut(SEND, 0, nh * t_max * m);
        for t in 0..lay.tokens {
            for host in 0..nh {
                let hs = lay.host_slot[t * nh + host];
                if hs == NONE {
                    continue;
                }
                let msg = &mut buf[(host * t_max + t) * m..(host * t_max + t + 1) * m];
                let row = &x[t * hd..(t + 1) * hd];
                if cfg.fp8 {
                    quantize_fp8(row, &mut msg[..p]);
                } else {
                    msg[..p].copy_from_slice(bf16_bytes(row));
                }
                let mut words = Vec::with_capacity(2 + 2 * k + l);
                words.push(t as u32);
                words.extend((0..k).map(|j| idx[t * k + j] as i32 as u32));
                words.extend((0..k).map(|j| w[t * k + j].to_bits()));
                words.push(hs);
                words.extend((0..l).map(|dl| lay.rank_slot[t * s.r + host * l + dl]));
                for (i, v) in words.iter().enumerate() {
                    msg[p + 4 * i..p + 4 * i + 4].copy_from_slice(&v.to_le_bytes());
                }
            }
        }
    }

    /// Puts this rank's counts to every rank and gathers everyone's.
    fn ht_notify(&mut self, s: &Shape, lay: &Layout) -> Result<(Vec<u32>, Vec<u32>), EpError> {
        let row: Vec<u8> = lay
            .tokens_per_rank
            .iter()
            .chain(&lay.tokens_per_host)
            .flat_map(|c| c.to_le_bytes())
            .collect();
        let width = row.len();
        self.bytes_mut(NSEND, 0, width).copy_from_slice(&row);
        self.unflushed = true;
        for peer in 0..s.r {
            self.dc.ctx(0)?.put(
                peer,
                &self.wins[NRECV],
                (self.rank * width) as u64,
                &self.wins[NSEND],
                0,
                width as u64,
                Remote::signal_add(s.notify(self.rank), 1),
                Local::None,
            )?;
        }
        let step = self.step;
        for src in 0..s.r {
            let what = || format!("its token counts (step {step})");
            self.wait_signal(s.notify(src), src, &what)?;
        }
        let all = self.bytes(NRECV, 0, s.r * width);
        let word = |i: usize| {
            u32::from_le_bytes([all[4 * i], all[4 * i + 1], all[4 * i + 2], all[4 * i + 3]])
        };
        let per = s.r + s.h;
        let counts = (0..s.r * s.r)
            .map(|i| word((i / s.r) * per + i % s.r))
            .collect();
        let host_counts = (0..s.r * s.h)
            .map(|i| word((i / s.h) * per + s.r + i % s.h))
            .collect();
        for (src, c) in (0..s.r).map(|src| (src, word(src * per + self.rank))) {
            if c as usize > s.t {
                return Err(EpError::Protocol {
                    rank: self.rank,
                    peer: src,
                    what: format!("count {c} above the maximum {}", s.t),
                });
            }
        }
        Ok((counts, host_counts))
    }

    /// The sender and forwarder loop: runs until every token of this rank
    /// has left for its forwarders and every message of this rank's rings
    /// has been forwarded.
    fn ht_move(&mut self, s: &Shape, d: &mut HtDispatch) -> Result<(), EpError> {
        let (my_host, my_local) = (self.rank / s.l, self.rank % s.l);
        let expect: Vec<usize> = (0..s.h)
            .map(|hs| d.host_counts[(hs * s.l + my_local) * s.h + my_host] as usize)
            .collect();
        d.fwd_prefix = prefix(&expect.iter().map(|&e| e as u32).collect::<Vec<_>>());
        d.fwd = vec![(0, 0); *d.fwd_prefix.last().unwrap_or(&0) as usize];
        let mut pr = Progress {
            cursor: vec![0; s.h],
            sent: vec![0; s.h],
            consumed: vec![0; s.h],
            expect,
            forwarded: vec![0; s.l],
            last: Instant::now(),
        };
        loop {
            let sent = self.ht_send(s, d, &mut pr)?;
            let fwd = self.ht_forward(s, d, &mut pr)?;
            let done_send =
                (0..s.h).all(|h| pr.sent[h] == d.sender.layout.tokens_per_host[h] as usize);
            let done_fwd = (0..s.h).all(|h| pr.consumed[h] == pr.expect[h]);
            if done_send && done_fwd {
                break;
            }
            if sent || fwd {
                pr.last = Instant::now();
            } else {
                self.ht_stalled(s, d, &pr, done_send)?;
                std::thread::yield_now();
            }
        }
        // Tell each local receiver how many tokens this forwarder brought.
        for dl in 0..s.l {
            let dst = my_host * s.l + dl;
            let n = pr.forwarded[dl];
            self.dc
                .ctx(0)?
                .signal(dst, Remote::signal_add(s.fwd(my_local), n + 1))?;
        }
        Ok(())
    }

    /// Bounds a loop that makes no progress: names the forwarder whose
    /// credits, or the source whose tail, have not moved.
    fn ht_stalled(
        &self,
        s: &Shape,
        d: &HtDispatch,
        pr: &Progress,
        done_send: bool,
    ) -> Result<(), EpError> {
        let waited = pr.last.elapsed();
        if waited < self.timeout {
            return Ok(());
        }
        let my_local = self.rank % s.l;
        let (peer, what, id, expected) = if done_send {
            let hs = (0..s.h)
                .find(|&h| pr.consumed[h] < pr.expect[h])
                .unwrap_or(0);
            (
                hs * s.l + my_local,
                "tokens in its ring here (tail)",
                s.tail(hs),
                pr.expect[hs],
            )
        } else {
            let h = (0..s.h)
                .find(|&h| pr.sent[h] < d.sender.layout.tokens_per_host[h] as usize)
                .unwrap_or(0);
            (
                h * s.l + my_local,
                "credits of its ring (head)",
                s.head(h),
                pr.sent[h],
            )
        };
        let last = self.dc.ctx(0)?.read_signal(id)?;
        Err(EpError::Timeout {
            rank: self.rank,
            peer,
            what: format!("{what}, step {}", self.step),
            last,
            expected: expected as u64,
            waited,
        })
    }

    /// Sends as many messages as credits allow; true if any left.
    fn ht_send(&mut self, s: &Shape, d: &HtDispatch, pr: &mut Progress) -> Result<bool, EpError> {
        let (my_host, my_local) = (self.rank / s.l, self.rank % s.l);
        let lay = &d.sender.layout;
        let mut any = false;
        for host in 0..s.h {
            let total = lay.tokens_per_host[host] as usize;
            if pr.sent[host] == total {
                continue;
            }
            let fwd = host * s.l + my_local;
            // Cumulative across steps: the ledger holds what earlier steps
            // sent; the head signal what the forwarder ever consumed.
            let sent_total = self.seen[s.head(host) as usize] as usize + pr.sent[host];
            let head = self.dc.ctx(0)?.read_signal(s.head(host))? as usize;
            let credits = s.ring.saturating_sub(sent_total.saturating_sub(head));
            let n = credits.min(total - pr.sent[host]);
            if n == 0 {
                continue;
            }
            for _ in 0..n {
                let mut t = pr.cursor[host];
                while lay.host_slot[t * s.h + host] == NONE {
                    t += 1;
                }
                pr.cursor[host] = t + 1;
                let seq = self.seen[s.head(host) as usize] as usize + pr.sent[host];
                let dst_off = ((my_host * s.ring) + seq % s.ring) * s.m;
                self.dc.ctx(0)?.put(
                    fwd,
                    &self.wins[RING],
                    dst_off as u64,
                    &self.wins[SEND],
                    ((host * s.t + t) * s.m) as u64,
                    s.m as u64,
                    Remote::None,
                    Local::None,
                )?;
                pr.sent[host] += 1;
            }
            self.unflushed = true;
            self.dc
                .ctx(0)?
                .signal(fwd, Remote::signal_add(s.tail(my_host), n as u64))?;
            any = true;
        }
        Ok(any)
    }

    /// Forwards what arrived in this rank's rings; true if anything did.
    fn ht_forward(
        &mut self,
        s: &Shape,
        d: &mut HtDispatch,
        pr: &mut Progress,
    ) -> Result<bool, EpError> {
        let (my_host, my_local) = (self.rank / s.l, self.rank % s.l);
        let cfg = self.cfg;
        let p = cfg.payload_bytes();
        let k = cfg.topk;
        let mut any = false;
        for hs in 0..s.h {
            if pr.consumed[hs] == pr.expect[hs] {
                continue;
            }
            let before = self.seen[s.tail(hs) as usize] as usize;
            let tail = self.dc.ctx(0)?.read_signal(s.tail(hs))? as usize;
            let avail = tail.wrapping_sub(before + pr.consumed[hs]);
            let src = hs * s.l + my_local;
            if avail > s.ring.min(pr.expect[hs] - pr.consumed[hs]) {
                return Err(EpError::Protocol {
                    rank: self.rank,
                    peer: src,
                    what: format!(
                        "ring tail {tail} runs {avail} messages ahead of the {} expected",
                        pr.expect[hs] - pr.consumed[hs]
                    ),
                });
            }
            if avail == 0 {
                continue;
            }
            for _ in 0..avail {
                let seq = before + pr.consumed[hs];
                let off = (hs * s.ring + seq % s.ring) * s.m;
                let meta = self.bytes(RING, off + p, 4 * (2 + 2 * k + s.l)).to_vec();
                let word = |i: usize| {
                    u32::from_le_bytes([
                        meta[4 * i],
                        meta[4 * i + 1],
                        meta[4 * i + 2],
                        meta[4 * i + 3],
                    ])
                };
                let (tok, hslot) = (word(0), word(1 + 2 * k));
                if tok as usize >= s.t || hslot as usize >= pr.expect[hs] {
                    return Err(EpError::Protocol {
                        rank: self.rank,
                        peer: src,
                        what: format!(
                            "token {tok} with host slot {hslot} (expected {} tokens)",
                            pr.expect[hs]
                        ),
                    });
                }
                let mut mask = 0u64;
                for dl in 0..s.l {
                    let slot = word(2 + 2 * k + dl);
                    if slot == NONE {
                        continue;
                    }
                    let dst = my_host * s.l + dl;
                    let count = d.counts[src * s.r + dst];
                    if slot >= count {
                        return Err(EpError::Protocol {
                            rank: self.rank,
                            peer: src,
                            what: format!("rank slot {slot} for rank {dst}, which expects {count}"),
                        });
                    }
                    let pre: u32 = (0..src).map(|s2| d.counts[s2 * s.r + dst]).sum();
                    self.dc.ctx(0)?.put(
                        dst,
                        &self.wins[RECV],
                        (((pre + slot) as usize) * s.m) as u64,
                        &self.wins[RING],
                        off as u64,
                        s.m as u64,
                        Remote::None,
                        Local::None,
                    )?;
                    pr.forwarded[dl] += 1;
                    mask |= 1 << dl;
                }
                d.fwd[d.fwd_prefix[hs] as usize + hslot as usize] = (tok, mask);
                pr.consumed[hs] += 1;
            }
            // Credits go back once the forwarding puts no longer read the
            // ring (at once on the load/store path).
            self.dc.ctx(0)?.flush()?;
            self.dc
                .ctx(0)?
                .signal(src, Remote::signal_add(s.head(my_host), avail as u64))?;
            any = true;
        }
        Ok(any)
    }

    /// Waits for every local forwarder's count, then reads the received
    /// tokens' metadata and closes the step's ledgers.
    fn ht_receive(&mut self, s: &Shape, d: &mut HtDispatch) -> Result<(), EpError> {
        let my_host = self.rank / s.l;
        let step = self.step;
        for fl in 0..s.l {
            let f = my_host * s.l + fl;
            let what = || format!("its forwarded-token count (step {step})");
            let got = self.wait_signal(s.fwd(fl), f, &what)?.unwrap_or(0);
            let want: u32 = (0..s.h)
                .map(|hs| d.counts[(hs * s.l + fl) * s.r + self.rank])
                .sum();
            if got != u64::from(want) + 1 {
                return Err(EpError::Protocol {
                    rank: self.rank,
                    peer: f,
                    what: format!(
                        "forwarded {} tokens, the counts say {want}",
                        got.wrapping_sub(1)
                    ),
                });
            }
        }
        let cfg = self.cfg;
        let (p, k) = (cfg.payload_bytes(), cfg.topk);
        let lo = self.rank * cfg.local_experts(s.r);
        let hi = lo + cfg.local_experts(s.r);
        let total = d.recv_prefix[s.r] as usize;
        for j in 0..total {
            let meta = self.bytes(RECV, j * s.m + p, 4 * (2 + 2 * k));
            let word = |i: usize| {
                u32::from_le_bytes([
                    meta[4 * i],
                    meta[4 * i + 1],
                    meta[4 * i + 2],
                    meta[4 * i + 3],
                ])
            };
            d.src_token.push(word(0));
            let w: f32 = (0..k)
                .filter(|&i| {
                    let e = word(1 + i) as i32;
                    e >= 0 && (lo..hi).contains(&(e as usize))
                })
                .map(|i| f32::from_bits(word(1 + k + i)))
                .sum();
            d.local_weight.push(w);
            for i in 0..k {
                let e = word(1 + i) as i32;
                if e >= 0 && (lo..hi).contains(&(e as usize)) {
                    d.expert_counts[e as usize - lo] += 1;
                }
            }
            d.host_slot.push(word(1 + 2 * k));
        }
        // Close the ledgers: what was sent to each forwarder this step will
        // all be consumed, and this rank's rings consumed what they expected.
        for host in 0..s.h {
            let n = d.sender.layout.tokens_per_host[host];
            self.seen[s.head(host) as usize] += u64::from(n);
        }
        let my_local = self.rank % s.l;
        for hs in 0..s.h {
            self.seen[s.tail(hs) as usize] +=
                u64::from(d.host_counts[(hs * s.l + my_local) * s.h + my_host]);
        }
        Ok(())
    }

    /// The payload of received token `j` (blocks by source, in source
    /// order): BF16 or FP8 with scales, as in low-latency mode.
    pub fn ht_token(&self, d: &HtDispatch, j: usize) -> Result<&[u8], EpError> {
        self.check_step(d.step)?;
        if j >= d.received() {
            return Err(EpError::Mode {
                rank: self.rank,
                what: format!("no received token {j} ({} received)", d.received()),
            });
        }
        let s = self.ht_shape();
        Ok(self.bytes(RECV, j * s.m, self.cfg.payload_bytes()))
    }

    /// The combine input row of received token `j` (`hidden` BF16): the
    /// expert outputs for that token, already weighted and summed over this
    /// rank's experts (as DeepEP's high-throughput combine takes them).
    pub fn ht_combine_row(&mut self, d: &HtDispatch, j: usize) -> Result<&mut [u8], EpError> {
        self.ht_token(d, j)?;
        self.settle()?;
        let h2 = 2 * self.cfg.hidden;
        Ok(self.bytes_mut(CSEND, j * h2, h2))
    }

    /// The identity expert: each received token times the sum of its
    /// weights for this rank's experts, as its combine row.
    pub fn ht_echo(&mut self, d: &HtDispatch) -> Result<(), EpError> {
        let cfg = self.cfg;
        let mut tmp = vec![Bf16::ZERO; cfg.hidden];
        for j in 0..d.received() {
            let src = self.ht_token(d, j)?;
            if cfg.fp8 {
                dequantize_fp8(src, cfg.hidden, &mut tmp);
            } else {
                for (o, c) in tmp.iter_mut().zip(src.chunks_exact(2)) {
                    *o = Bf16(u16::from_le_bytes([c[0], c[1]]));
                }
            }
            let w = d.local_weight(j);
            for v in &mut tmp {
                *v = Bf16::from_f32(v.to_f32() * w);
            }
            self.ht_combine_row(d, j)?.copy_from_slice(bf16_bytes(&tmp));
        }
        Ok(())
    }

    /// High-throughput combine: receivers to forwarders, forwarders sum per
    /// token and send to sources, sources reduce each token as soon as every
    /// host it went to has delivered.
    pub fn ht_combine(&mut self, d: &HtDispatch) -> Result<Combined, EpError> {
        self.expect_phase("ht_combine", Phase::Dispatched)?;
        self.check_step(d.step)?;
        let s = self.ht_shape();
        self.phase = Phase::CombineSent;
        self.ht_combine_to_forwarders(&s, d)?;
        self.ht_combine_forward(&s, d)?;
        let x = self.ht_combine_reduce(&s, d)?;
        self.phase = Phase::Idle;
        Ok(Combined {
            x,
            lost: Vec::new(),
        })
    }

    fn ht_combine_to_forwarders(&mut self, s: &Shape, d: &HtDispatch) -> Result<(), EpError> {
        let (my_host, my_local) = (self.rank / s.l, self.rank % s.l);
        let h2 = 2 * self.cfg.hidden;
        self.unflushed = true;
        for src in 0..s.r {
            let (hs, ls) = (src / s.l, src % s.l);
            let f = my_host * s.l + ls;
            // Where source host hs's tokens start among f's forwarded ones.
            let fpre: u32 = (0..hs)
                .map(|h| d.host_counts[(h * s.l + ls) * s.h + my_host])
                .sum();
            for j in d.block_start(src)..d.block_start(src) + d.count(src) {
                let q = (fpre + d.host_slot[j]) as usize;
                self.dc.ctx(0)?.put(
                    f,
                    &self.wins[CNVL],
                    ((q * s.l + my_local) * h2) as u64,
                    &self.wins[CSEND],
                    (j * h2) as u64,
                    h2 as u64,
                    Remote::None,
                    Local::None,
                )?;
            }
        }
        for fl in 0..s.l {
            let f = my_host * s.l + fl;
            self.dc
                .ctx(0)?
                .signal(f, Remote::signal_add(s.cnvl(my_local), 1))?;
        }
        Ok(())
    }

    fn ht_combine_forward(&mut self, s: &Shape, d: &HtDispatch) -> Result<(), EpError> {
        let (my_host, my_local) = (self.rank / s.l, self.rank % s.l);
        let (hd, h2) = (self.cfg.hidden, 2 * self.cfg.hidden);
        let step = self.step;
        for dl in 0..s.l {
            let what = || format!("its combine rows for forwarding (step {step})");
            self.wait_signal(s.cnvl(dl), my_host * s.l + dl, &what)?;
        }
        self.settle()?;
        let mut acc = vec![0f32; hd];
        let mut row = vec![Bf16::ZERO; hd];
        for hs in 0..s.h {
            let src = hs * s.l + my_local;
            let (a, b) = (d.fwd_prefix[hs] as usize, d.fwd_prefix[hs + 1] as usize);
            for q in a..b {
                let (tok, mask) = d.fwd[q];
                acc.fill(0.0);
                for dl in (0..s.l).filter(|dl| mask & (1 << dl) != 0) {
                    let bytes = self.bytes(CNVL, (q * s.l + dl) * h2, h2);
                    for (v, c) in acc.iter_mut().zip(bytes.chunks_exact(2)) {
                        *v += Bf16(u16::from_le_bytes([c[0], c[1]])).to_f32();
                    }
                }
                for (o, v) in row.iter_mut().zip(&acc) {
                    *o = Bf16::from_f32(*v);
                }
                self.bytes_mut(CSTAGE, q * h2, h2)
                    .copy_from_slice(bf16_bytes(&row));
                self.dc.ctx(0)?.put(
                    src,
                    &self.wins[CRDMA],
                    ((my_host * s.t + tok as usize) * h2) as u64,
                    &self.wins[CSTAGE],
                    (q * h2) as u64,
                    h2 as u64,
                    Remote::None,
                    Local::None,
                )?;
            }
            self.unflushed = true;
            self.dc
                .ctx(0)?
                .signal(src, Remote::signal_add(s.crdma(my_host), 1))?;
        }
        Ok(())
    }

    /// Polls the hosts' combine signals and reduces each token once every
    /// host it went to has delivered.
    fn ht_combine_reduce(&mut self, s: &Shape, d: &HtDispatch) -> Result<Vec<Bf16>, EpError> {
        let lay = &d.sender.layout;
        let (hd, h2) = (self.cfg.hidden, 2 * self.cfg.hidden);
        let tokens = lay.tokens;
        let mut missing: Vec<usize> = (0..tokens)
            .map(|t| {
                (0..s.h)
                    .filter(|&h| lay.is_token_in_host[t * s.h + h])
                    .count()
            })
            .collect();
        let mut out = vec![Bf16::ZERO; tokens * hd];
        let mut arrived = vec![false; s.h];
        let my_local = self.rank % s.l;
        let step = self.step;
        while arrived.iter().any(|a| !a) {
            // Take the next host to deliver, in any order.
            let mut got = None;
            for h in (0..s.h).filter(|&h| !arrived[h]) {
                let id = s.crdma(h);
                let v = self.dc.ctx(0)?.read_signal(id)?;
                if crate::buffer::reached(v, self.seen[id as usize] + 1) {
                    got = Some(h);
                    break;
                }
            }
            let h = if let Some(h) = got {
                self.seen[s.crdma(h) as usize] += 1;
                h
            } else {
                // Block (bounded) on the first host still missing.
                let h = (0..s.h).find(|&h| !arrived[h]).unwrap_or(0);
                let what = || format!("its combined tokens (step {step})");
                self.wait_signal(s.crdma(h), h * s.l + my_local, &what)?;
                h
            };
            arrived[h] = true;
            for t in (0..tokens).filter(|&t| lay.is_token_in_host[t * s.h + h]) {
                missing[t] -= 1;
                if missing[t] == 0 {
                    self.ht_reduce_token(s, lay, t, &mut out[t * hd..(t + 1) * hd], h2);
                }
            }
        }
        Ok(out)
    }

    fn ht_reduce_token(&self, s: &Shape, lay: &Layout, t: usize, out: &mut [Bf16], h2: usize) {
        let mut acc = vec![0f32; out.len()];
        for h in (0..s.h).filter(|&h| lay.is_token_in_host[t * s.h + h]) {
            let bytes = self.bytes(CRDMA, (h * s.t + t) * h2, h2);
            for (v, c) in acc.iter_mut().zip(bytes.chunks_exact(2)) {
                *v += Bf16(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        for (o, v) in out.iter_mut().zip(&acc) {
            *o = Bf16::from_f32(*v);
        }
    }
}
