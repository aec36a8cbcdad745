//! High-throughput mode: DeepEP's two-stage (internode) scheme over hosts
//! of `L` ranks (rank = host × L + local index).
//!
//! Dispatch:
//! 1. **Notify**: every rank puts its token counts per (rank, channel) and
//!    per (host, channel), and its active mask, to every active rank (one
//!    signal each): every rank knows the whole count matrix, so receivers
//!    place each source's block and forwarders know what to expect. A rank
//!    lost meanwhile is masked and the exchange repeated (see `plan.rs`).
//!    A rank whose inputs were refused sends a refused row instead
//!    (`plan::refused_row`) and nothing else: every rank ends the step
//!    after that round, its peers with an error naming it.
//! 2. **Between hosts**: a rank sends each token once per other host, and
//!    only to that host's rank with its own local index (the forwarder; a
//!    masked one is replaced by the next active local index): straight into
//!    the token's final place when the forwarder receives it itself, else
//!    into the forwarder's ring for (channel, source), within credits (the
//!    tail signal at the forwarder counts messages in, the head signal back
//!    at the sender counts messages consumed).
//! 3. **Within a host**: a rank writes its own tokens, and forwards the
//!    other hosts' tokens it received, into their final place at every
//!    local rank that holds one of their experts, over load/store where the
//!    peer is mapped (puts otherwise), then tells each local rank how many
//!    it delivered there.
//!
//! Tokens are split into channels by contiguous ranges of each source's
//! tokens, each channel with its own context, rings, credits and signals;
//! the channels run as lanes on one thread or several (`lane.rs`).
//!
//! Combine runs backwards (`combine.rs`): each receiver writes one row per
//! received token (its experts' outputs, weighted and summed); each
//! forwarder reads its host's rows of every token it forwarded in place,
//! sums them once and puts one row per token back to the source; each
//! source reduces a token as soon as every host it went to has delivered,
//! reading its own host's rows in place.
//!
//! Windows: the notify row and rows, the staged payloads and metadata of
//! this rank's tokens (`XIN`, `MIN`), the rings, the final places
//! (`RECVX`, `RECVM`, sized for the maximum), the combine rows (`CSEND`),
//! the forwarder's summed rows (`CSTAGE`, reused after a flush), the rows
//! coming back (`CRDMA`, by host and slot), and `CGET` for rows fetched
//! where a same-host peer is not mapped.

mod combine;
mod lane;
mod mem;
pub(crate) mod plan;

use gin_core::Remote;

pub(crate) use lane::complete;
pub(crate) use plan::{CGET, cget_bytes, resources};

use self::combine::CombineLane;
use self::lane::{DispatchIn, DispatchLane, DispatchState, FwdBlock, Lane, Shared};
use self::mem::Mem;
use self::plan::{CSEND, Plan, RECVM, RECVX, Shape};
use crate::buffer::{Buffer, Phase};
use crate::error::EpError;
use crate::ll::{Combined, SenderSide};
use crate::num::{Bf16, bf16_bytes, bf16_bytes_mut, dequantize_fp8};

/// The tokens this rank received in one high-throughput dispatch, and what
/// its combine needs (as a receiver, a forwarder and a source).
#[derive(Debug)]
pub struct HtDispatch {
    step: u64,
    sender: SenderSide,
    plan: Plan,
    /// Where each source's block starts here.
    recv_prefix: Vec<u32>,
    /// Per received token: its index at the source, and the sum of the
    /// weights of its slots whose experts are here.
    src_token: Vec<u32>,
    local_weight: Vec<f32>,
    /// Received tokens per local expert.
    expert_counts: Vec<u32>,
    /// Per channel: the tokens this rank forwarded, by source.
    blocks: Vec<Vec<FwdBlock>>,
    lost: Vec<usize>,
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
        self.plan.count(src, dst) as usize
    }

    /// Top-k slots this rank's dispatch left empty because their expert's
    /// rank was masked.
    pub fn masked_slots(&self) -> usize {
        self.sender.layout.masked_slots
    }

    /// Ranks masked during this dispatch because they were lost
    /// ([`crate::OnPeerLoss::Mask`]).
    pub fn lost(&self) -> &[usize] {
        &self.lost
    }
}

/// From a received token's metadata (at least its first `1 + 2k` words):
/// its index at the source, and the sum, in top-k order, of its weights
/// for the experts in `mine` (this rank's), each of which it counts in
/// `expert_counts` (by local expert). Shared by CPU and CUDA ranks.
pub(crate) fn read_meta(
    s: &Shape,
    mine: std::ops::Range<usize>,
    meta: &[u8],
    expert_counts: &mut [u32],
) -> (u32, f32) {
    let word = |i: usize| {
        u32::from_le_bytes([
            meta[4 * i],
            meta[4 * i + 1],
            meta[4 * i + 2],
            meta[4 * i + 3],
        ])
    };
    let mut w = 0f32;
    for i in 0..s.k {
        let e = word(s.w_ids() + i) as i32;
        if e >= 0 && mine.contains(&(e as usize)) {
            w += f32::from_bits(word(s.w_weights() + i));
            expert_counts[e as usize - mine.start] += 1;
        }
    }
    (word(0), w)
}

/// A high-throughput dispatch sent and not yet received: counts exchanged,
/// every channel started. Hand it to [`Buffer::ht_dispatch_poll`] while
/// computing and to [`Buffer::ht_dispatch_recv`] to finish (the receive
/// hook); it borrows the tokens being sent.
#[derive(Debug)]
#[must_use = "a sent dispatch must be received"]
pub struct HtPending<'x> {
    step: u64,
    x: &'x [Bf16],
    sender: SenderSide,
    plan: Plan,
    states: Vec<DispatchState>,
}

impl Buffer<'_> {
    fn ht_shape(&self) -> Shape {
        Shape::of(
            &self.cfg,
            self.nranks,
            self.hosts.ranks_per_host.unwrap_or(self.nranks),
        )
    }

    /// Per rank: whether this rank reaches its windows by load/store.
    fn ht_direct(&self, s: &Shape) -> Vec<bool> {
        let mem = Mem {
            wins: &self.wins,
            rank: self.rank,
        };
        (0..s.r)
            .map(|p| {
                p == self.rank
                    || (p / s.l == self.rank / s.l
                        && self.dc.is_direct(p)
                        && [RECVX, RECVM, CSEND].iter().all(|&w| mem.mapped(w, p)))
            })
            .collect()
    }

    /// High-throughput dispatch: [`Buffer::ht_dispatch_send`] then
    /// [`Buffer::ht_dispatch_recv`].
    pub fn ht_dispatch(
        &mut self,
        x: &[Bf16],
        topk_idx: &[i64],
        topk_weights: &[f32],
    ) -> Result<HtDispatch, EpError> {
        let p = self.ht_dispatch_send(x, topk_idx, topk_weights)?;
        self.ht_dispatch_recv(p)
    }

    /// High-throughput dispatch, sending half: checks the inputs, exchanges
    /// counts, and starts every channel. Inputs refused by the checks (the
    /// error names the entry) send no token: this rank still takes part in
    /// the count exchange, with a row marked refused, so that every peer's
    /// dispatch returns at once with [`EpError::Protocol`] naming this rank;
    /// no rank sends a token, and every buffer stays usable for the next
    /// step.
    /// Under [`crate::OnPeerLoss::Mask`], a rank found lost during the count
    /// exchange is masked (its experts count as empty slots, its forwarding
    /// role passes to the next local index) and reported in
    /// [`HtDispatch::lost`]; a rank lost after tokens started moving fails
    /// the step with [`EpError::PeerLost`].
    ///
    /// The receive hook: between this and [`Buffer::ht_dispatch_recv`] the
    /// caller may compute. This rank also forwards its peers' tokens, so
    /// call [`Buffer::ht_dispatch_poll`] now and then meanwhile: each call
    /// moves whatever can move without waiting.
    pub fn ht_dispatch_send<'x>(
        &mut self,
        x: &'x [Bf16],
        topk_idx: &[i64],
        topk_weights: &[f32],
    ) -> Result<HtPending<'x>, EpError> {
        if self.cfg.mode != crate::Mode::HighThroughput {
            return Err(EpError::Mode {
                rank: self.rank,
                what: "ht_dispatch on a buffer sized for low-latency mode".into(),
            });
        }
        self.expect_phase("ht_dispatch", Phase::Idle)?;
        if !self.active[self.rank] {
            return Err(EpError::Mode {
                rank: self.rank,
                what: "this rank is masked: it takes no part in steps".into(),
            });
        }
        let mut layout = match self.check_inputs(x.len(), topk_idx, topk_weights) {
            Ok(layout) => layout,
            Err(e) => return Err(self.ht_refuse(e)),
        };
        self.settle()?;
        self.lost.clear();
        self.step += 1;
        let s = self.ht_shape();
        let plan = self.ht_notify(&s, &mut layout, topk_idx)?;
        let mut p = HtPending {
            step: self.step,
            x,
            states: Vec::new(),
            sender: SenderSide {
                tokens: layout.tokens,
                topk_idx: topk_idx.to_vec(),
                weights: topk_weights.to_vec(),
                layout,
            },
            plan,
        };
        self.phase = Phase::DispatchSent;
        self.ht_dispatch_lanes(&s, &mut p, false)?;
        Ok(p)
    }

    /// This rank's inputs were refused (`err`): it still takes part in the
    /// step's count exchange, with [`plan::refused_row`], so that each peer
    /// ends the step at once with an error naming this rank (every peer
    /// waits for every active rank's row, and a refused row ends the step
    /// after that one round on every rank); nothing else is sent, and every
    /// buffer stays usable. Returns `err`, or where the exchange itself
    /// failed its error, the buffer then broken (a late row of this step
    /// would otherwise be taken for the next step's).
    fn ht_refuse(&mut self, err: EpError) -> EpError {
        self.phase = Phase::Broken;
        let r = (|| {
            self.settle()?;
            self.lost.clear();
            self.step += 1;
            let s = self.ht_shape();
            let row = plan::refused_row(&s, &self.active);
            self.ht_notify_round(&s, &row).map(drop)
        })();
        match r {
            Ok(()) => {
                self.phase = Phase::Idle;
                err
            }
            Err(e) => e,
        }
    }

    /// Moves whatever the pending dispatch can move without waiting (sends
    /// within credits, forwarding what arrived, writes within the host);
    /// true once this rank's part is done, so that
    /// [`Buffer::ht_dispatch_recv`] returns without waiting.
    pub fn ht_dispatch_poll(&mut self, pending: &mut HtPending<'_>) -> Result<bool, EpError> {
        self.expect_phase("ht_dispatch_poll", Phase::DispatchSent)?;
        self.check_step(pending.step)?;
        let s = self.ht_shape();
        self.ht_dispatch_lanes(&s, pending, false)
    }

    /// High-throughput dispatch, receiving half: drives every channel to
    /// the end (on [`Buffer::set_threads`] threads), then reads the
    /// received tokens' metadata.
    pub fn ht_dispatch_recv(&mut self, mut pending: HtPending<'_>) -> Result<HtDispatch, EpError> {
        self.expect_phase("ht_dispatch_recv", Phase::DispatchSent)?;
        self.check_step(pending.step)?;
        let s = self.ht_shape();
        self.ht_dispatch_lanes(&s, &mut pending, true)?;
        let HtPending {
            sender,
            plan,
            states,
            ..
        } = pending;
        let mut d = HtDispatch {
            step: self.step,
            sender,
            recv_prefix: plan.recv_prefix(self.rank).to_vec(),
            plan,
            src_token: Vec::new(),
            local_weight: Vec::new(),
            expert_counts: vec![0; self.cfg.local_experts(s.r)],
            blocks: states.into_iter().map(DispatchState::into_blocks).collect(),
            lost: self.lost.clone(),
        };
        self.ht_receive(&s, &mut d);
        self.phase = Phase::Dispatched;
        Ok(d)
    }

    /// Polls the dispatch lanes once each on this thread (`to_end` false;
    /// true when all are done), or runs them to the end on the buffer's
    /// threads.
    fn ht_dispatch_lanes(
        &mut self,
        s: &Shape,
        p: &mut HtPending<'_>,
        to_end: bool,
    ) -> Result<bool, EpError> {
        let direct = self.ht_direct(s);
        self.unflushed = true;
        let sh = Shared {
            s: *s,
            fp8: self.cfg.fp8,
            hidden: self.cfg.hidden,
            rank: self.rank,
            step: self.step,
            comm: self.comm,
            dc: &self.dc,
            mem: Mem {
                wins: &self.wins,
                rank: self.rank,
            },
            plan: &p.plan,
            timeout: self.timeout,
            direct,
        };
        if p.states.is_empty() {
            p.states = (0..s.chans)
                .map(|ch| DispatchState::new(&sh, p.sender.tokens, ch))
                .collect();
        }
        let inp = DispatchIn {
            lay: &p.sender.layout,
            x: p.x,
            idx: &p.sender.topk_idx,
            w: &p.sender.weights,
        };
        let nsig = s.signals() as usize;
        let mut lanes: Vec<DispatchLane<'_>> = self
            .seen
            .chunks_mut(nsig)
            .zip(self.issued.iter_mut())
            .zip(p.states.iter_mut())
            .map(|((seen, issued), st)| DispatchLane::new(&sh, &inp, st, seen, issued))
            .collect();
        if to_end {
            lane::run(&sh, lanes, self.threads)?;
            return Ok(true);
        }
        let mut all = true;
        for l in &mut lanes {
            if !l.done() {
                l.poll()?;
                lane::kick(sh.dc, l.ctx())?;
            }
            all &= l.done();
        }
        Ok(all)
    }

    /// Reads the received tokens' metadata.
    fn ht_receive(&self, s: &Shape, d: &mut HtDispatch) {
        let lo = self.rank * self.cfg.local_experts(s.r);
        let hi = lo + self.cfg.local_experts(s.r);
        let total = d.recv_prefix[s.r] as usize;
        d.src_token.reserve(total);
        d.local_weight.reserve(total);
        for j in 0..total {
            let meta = self.bytes(RECVM, j * s.mm, 4 * (1 + 2 * s.k));
            let (tok, w) = read_meta(s, lo..hi, meta, &mut d.expert_counts);
            d.src_token.push(tok);
            d.local_weight.push(w);
        }
    }

    /// The payload of received token `j` (blocks by source, in source
    /// order): BF16 or FP8 with scales, as in low-latency mode. Valid until
    /// the combine starts.
    pub fn ht_token(&self, d: &HtDispatch, j: usize) -> Result<&[u8], EpError> {
        self.check_step(d.step)?;
        self.expect_phase("ht_token", Phase::Dispatched)?;
        if j >= d.received() {
            return Err(EpError::Mode {
                rank: self.rank,
                what: format!("no received token {j} ({} received)", d.received()),
            });
        }
        let p = self.cfg.payload_bytes();
        Ok(self.bytes(RECVX, j * p, p))
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

    /// High-throughput combine: forwarders sum their host's rows of each
    /// token and send them to the sources; each source reduces a token as
    /// soon as every host it went to has delivered.
    pub fn ht_combine(&mut self, d: &HtDispatch) -> Result<Combined, EpError> {
        let mut x = vec![Bf16::ZERO; d.tokens() * self.cfg.hidden];
        let lost = self.ht_combine_into(d, &mut x)?;
        Ok(Combined { x, lost })
    }

    /// [`Buffer::ht_combine`] into `out` (`tokens × hidden`), so that a
    /// caller can reuse one output between steps; returns the ranks lost
    /// during the step.
    pub fn ht_combine_into(
        &mut self,
        d: &HtDispatch,
        out: &mut [Bf16],
    ) -> Result<Vec<usize>, EpError> {
        self.expect_phase("ht_combine", Phase::Dispatched)?;
        self.check_step(d.step)?;
        let want = d.tokens() * self.cfg.hidden;
        if out.len() != want {
            return Err(EpError::Shape {
                rank: self.rank,
                what: "combine output",
                len: out.len(),
                expected: want,
                tokens: d.tokens(),
                per_token: self.cfg.hidden,
            });
        }
        let s = self.ht_shape();
        self.phase = Phase::CombineSent;
        self.ht_rows_ready(&s, &d.plan)?;
        self.ht_lanes_combine(&s, d, bf16_bytes_mut(out))?;
        self.phase = Phase::Idle;
        Ok(d.lost.clone())
    }

    /// Tells every active rank of this host that this rank's combine rows
    /// are written, and waits for the same from each of them: forwarders
    /// and sources then read them in place.
    fn ht_rows_ready(&mut self, s: &Shape, plan: &Plan) -> Result<(), EpError> {
        let (host, local) = (self.rank / s.l, self.rank % s.l);
        let locals: Vec<usize> = (0..s.l)
            .map(|dl| host * s.l + dl)
            .filter(|&p| plan.active[p])
            .collect();
        for &p in &locals {
            self.dc
                .ctx(0)?
                .signal(p, Remote::signal_add(s.cready(local), 1))?;
        }
        let step = self.step;
        for &p in &locals {
            let what = || format!("its combine rows (step {step})");
            if self.wait_signal(s.cready(p % s.l), p, &what)?.is_none() {
                return Err(EpError::PeerLost {
                    rank: self.rank,
                    peer: p,
                    what: what(),
                    why: "lost during the combine".into(),
                });
            }
        }
        Ok(())
    }

    fn ht_lanes_combine(
        &mut self,
        s: &Shape,
        d: &HtDispatch,
        out: &mut [u8],
    ) -> Result<(), EpError> {
        let direct = self.ht_direct(s);
        self.unflushed = true;
        let sh = Shared {
            s: *s,
            fp8: self.cfg.fp8,
            hidden: self.cfg.hidden,
            rank: self.rank,
            step: self.step,
            comm: self.comm,
            dc: &self.dc,
            mem: Mem {
                wins: &self.wins,
                rank: self.rank,
            },
            plan: &d.plan,
            timeout: self.timeout,
            direct,
        };
        let lay = &d.sender.layout;
        let nsig = s.signals() as usize;
        let mut outs = Vec::with_capacity(s.chans);
        let mut rest = out;
        for ch in 0..s.chans {
            let n = s.chan_range(lay.tokens, ch).len() * s.h2;
            let (head, tail) = rest.split_at_mut(n);
            outs.push(head);
            rest = tail;
        }
        let lanes: Vec<CombineLane<'_>> = self
            .seen
            .chunks_mut(nsig)
            .zip(self.issued.iter_mut())
            .zip(outs)
            .enumerate()
            .map(|(ch, ((seen, issued), out))| {
                CombineLane::new(&sh, ch, seen, issued, &d.blocks[ch], lay, out)
            })
            .collect();
        lane::run(&sh, lanes, self.threads)?;
        Ok(())
    }
}
