//! Low-latency mode: each token goes straight to every rank holding one of
//! its experts, into per-(local expert, source rank) slots sized for the
//! maximum, and one signal per (expert, source) carries the count (plus
//! one, so that zero tokens is a signal too) after the data. Combine sends
//! each expert output back into a (token, top-k slot) place at its source
//! with one signal per (expert, source), and the source reduces with the
//! top-k weights. No count exchange, no host synchronisation: one message
//! round per phase. A rank whose inputs are refused sends no token but
//! 2^32 in its count signals (`POISON`); every rank then ends the step with the
//! combine's signals and no data, its peers with an error naming it.
//!
//! Windows (this rank's part): `send` (tokens × message), `recv` (local
//! experts × ranks × max tokens × message), `csend` (the same slots, one
//! BF16 token each: the combine input), `crecv` (tokens × top-k × BF16
//! token). Signals: `le * ranks + src` for dispatch, `experts + e` for
//! combine. Every signal is cumulative and never reset: a receiver waits
//! for it to move past the value it already accounted for.
//!
//! Reuse is safe without extra synchronisation: a source starts its next
//! dispatch only after its combine received every expert's signal, which
//! each expert sends after it has read the slots that source fills.

use gin_core::{Local, Remote};

use crate::buffer::{Buffer, Phase};
use crate::config::Config;
use crate::error::EpError;
use crate::layout::{Layout, NONE};
use crate::num::{Bf16, bf16_bytes, dequantize_fp8, quantize_fp8};

const SEND: usize = 0;
const RECV: usize = 1;
const CSEND: usize = 2;
const CRECV: usize = 3;

/// What a source adds to each of its dispatch signals when its inputs were
/// refused (a real count adds `count + 1`, at most 2^31): no tokens, and
/// the receivers know why (as CUDA ranks' `POISON` in `kernels/ll.cu`).
pub(crate) const POISON: u64 = 1 << 32;

// Every count signal a valid buffer sends is below the refusal mark.
const _: () = assert!((crate::config::MAX_TOKENS_PER_RANK as u64) + 1 < POISON);

/// Signals and window sizes of a low-latency buffer.
pub(crate) fn resources(cfg: &Config, nranks: usize) -> (u32, Vec<usize>) {
    let l = cfg.local_experts(nranks);
    let t = cfg.max_tokens_per_rank;
    let m = cfg.msg_bytes();
    let h2 = 2 * cfg.hidden;
    let sizes = vec![
        t * m,
        l * nranks * t * m,
        l * nranks * t * h2,
        t * cfg.topk * h2,
    ];
    ((2 * cfg.num_experts) as u32, sizes)
}

/// Which expert ranks each source reads in place in the combine: this
/// rank can where the device communicator maps the peer and the combine
/// window has a peer mapping (same-host shared memory); all-gathered so
/// that experts know whom not to put to.
pub(crate) fn pull_matrix(
    comm: &gin_core::Comm,
    dc: &gin_core::DevComm,
    wins: &[gin_core::Window],
) -> Result<Vec<bool>, EpError> {
    let (rank, n) = (comm.rank(), comm.nranks());
    let mine: Vec<u8> = (0..n)
        .map(|p| u8::from(p == rank || (dc.is_direct(p) && wins[CSEND].peer_ptr(p).is_some())))
        .collect();
    let all = comm.bootstrap().allgather(&mine)?;
    Ok(all
        .iter()
        .flat_map(|row| (0..n).map(move |p| row.get(p) == Some(&1)))
        .collect())
}

/// The weight rule of [`check_inputs`]: a live slot's weight must be
/// finite (checked before the top-k entries, for every token).
pub(crate) fn check_weights(
    rank: usize,
    topk: usize,
    topk_idx: &[i64],
    weights: &[f32],
) -> Result<(), EpError> {
    for (i, (&e, &w)) in topk_idx.iter().zip(weights).enumerate() {
        if e >= 0 && !w.is_finite() {
            return Err(EpError::BadWeight {
                rank,
                token: i / topk,
                slot: i % topk,
                weight: w,
            });
        }
    }
    Ok(())
}

/// Checks a step's inputs against `cfg` before anything moves (shared by
/// CPU and CUDA ranks); returns the layout.
pub(crate) fn check_inputs(
    rank: usize,
    cfg: &Config,
    active: &[bool],
    ranks_per_host: usize,
    x_len: usize,
    topk_idx: &[i64],
    weights: &[f32],
) -> Result<Layout, EpError> {
    let topk = cfg.topk;
    let shape = |what, len, expected, tokens, per_token| EpError::Shape {
        rank,
        what,
        len,
        expected,
        tokens,
        per_token,
    };
    if !topk_idx.len().is_multiple_of(topk) {
        let t = topk_idx.len() / topk;
        return Err(shape("topk_idx", topk_idx.len(), t * topk, t, topk));
    }
    let tokens = topk_idx.len() / topk;
    if tokens > cfg.max_tokens_per_rank {
        return Err(EpError::TooManyTokens {
            rank,
            tokens,
            max: cfg.max_tokens_per_rank,
        });
    }
    if x_len != tokens * cfg.hidden {
        return Err(shape("x", x_len, tokens * cfg.hidden, tokens, cfg.hidden));
    }
    if weights.len() != topk_idx.len() {
        return Err(shape(
            "topk_weights",
            weights.len(),
            topk_idx.len(),
            tokens,
            topk,
        ));
    }
    check_weights(rank, topk, topk_idx, weights)?;
    Layout::new(
        rank,
        topk_idx,
        topk,
        cfg.num_experts,
        active,
        ranks_per_host,
    )
}

/// Writes one message per token into `buf` (`tokens × msg_bytes`): the
/// payload (BF16, or FP8 with scales), then the source token index, the
/// top-k expert ids and the top-k weights (shared by CPU and CUDA ranks).
pub(crate) fn write_messages(
    cfg: &Config,
    x: &[Bf16],
    topk_idx: &[i64],
    weights: &[f32],
    buf: &mut [u8],
) {
    let (m, p, h) = (cfg.msg_bytes(), cfg.payload_bytes(), cfg.hidden);
    for (t, msg) in buf.chunks_exact_mut(m).enumerate() {
        let row = &x[t * h..(t + 1) * h];
        if cfg.fp8 {
            quantize_fp8(row, &mut msg[..p]);
        } else {
            msg[..p].copy_from_slice(bf16_bytes(row));
        }
    }
    write_metadata(cfg, topk_idx, weights, buf);
}

/// Writes the metadata part of every message in `buf` (`tokens ×
/// msg_bytes`), leaving the payloads as they are: the source token index,
/// the top-k expert ids and the top-k weights. CUDA ranks' FP8 dispatch
/// stages this and lets the kernel quantise the payloads.
pub(crate) fn write_metadata(cfg: &Config, topk_idx: &[i64], weights: &[f32], buf: &mut [u8]) {
    let (m, p, k) = (cfg.msg_bytes(), cfg.payload_bytes(), cfg.topk);
    for (t, msg) in buf.chunks_exact_mut(m).enumerate() {
        let meta = &mut msg[p..];
        meta[..4].copy_from_slice(&(t as u32).to_le_bytes());
        for j in 0..k {
            let id = topk_idx[t * k + j] as i32;
            meta[4 + 4 * j..8 + 4 * j].copy_from_slice(&id.to_le_bytes());
            let w = weights[t * k + j];
            meta[4 + 4 * (k + j)..8 + 4 * (k + j)].copy_from_slice(&w.to_le_bytes());
        }
    }
}

/// A dispatch sent and not yet received: hand it to
/// [`Buffer::ll_dispatch_recv`] (DeepEP's receive hook). Between the two,
/// the caller may compute; [`Buffer::ll_dispatch_ready`] polls.
#[derive(Debug)]
#[must_use = "a sent dispatch must be received"]
pub struct LlPending {
    step: u64,
    sender: SenderSide,
}

/// What the combine needs of this rank's own tokens.
#[derive(Debug, Clone)]
pub(crate) struct SenderSide {
    pub(crate) tokens: usize,
    pub(crate) topk_idx: Vec<i64>,
    pub(crate) weights: Vec<f32>,
    pub(crate) layout: Layout,
}

/// The tokens this rank received in one low-latency dispatch, and what its
/// combine needs. The token data stays in the buffer: read it with
/// [`Buffer::ll_token`].
#[derive(Debug)]
pub struct LlDispatch {
    step: u64,
    sender: SenderSide,
    nranks: usize,
    max: usize,
    /// `[le * nranks + src]`.
    counts: Vec<u32>,
    /// `[(le * nranks + src) * max + i]`.
    src_token: Vec<u32>,
    slot_k: Vec<u16>,
    weight: Vec<f32>,
    lost: Vec<usize>,
}

impl LlDispatch {
    /// Tokens received from `src` for local expert `le`: one contiguous
    /// block, in the source's token order.
    pub fn count(&self, le: usize, src: usize) -> usize {
        self.counts[le * self.nranks + src] as usize
    }

    /// Tokens received for local expert `le` from every source.
    pub fn expert_count(&self, le: usize) -> usize {
        (0..self.nranks).map(|s| self.count(le, s)).sum()
    }

    /// The index, at its source, of the `i`th token from `src` for `le`.
    pub fn src_token(&self, le: usize, src: usize, i: usize) -> usize {
        self.src_token[(le * self.nranks + src) * self.max + i] as usize
    }

    /// The top-k weight the source gave this expert for that token.
    pub fn weight(&self, le: usize, src: usize, i: usize) -> f32 {
        self.weight[(le * self.nranks + src) * self.max + i]
    }

    /// Tokens this rank dispatched.
    pub fn tokens(&self) -> usize {
        self.sender.tokens
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

/// A combine sent and not yet received.
#[derive(Debug)]
#[must_use = "a sent combine must be received"]
pub struct LlCombinePending {
    step: u64,
}

/// The combined tokens: `tokens × hidden`, in this rank's token order.
#[derive(Debug, Clone)]
pub struct Combined {
    /// The reduced tokens.
    pub x: Vec<Bf16>,
    /// Ranks masked during this step because they were lost (their
    /// experts' contributions are left out).
    pub lost: Vec<usize>,
}

impl Buffer<'_> {
    /// Checks a step's inputs against the buffer before anything moves;
    /// returns the layout.
    pub(crate) fn check_inputs(
        &self,
        x_len: usize,
        topk_idx: &[i64],
        weights: &[f32],
    ) -> Result<Layout, EpError> {
        let rph = self.hosts.ranks_per_host.unwrap_or(1);
        check_inputs(
            self.rank,
            &self.cfg,
            &self.active,
            rph,
            x_len,
            topk_idx,
            weights,
        )
    }

    fn check_mode(&self, call: &'static str, want: crate::Mode) -> Result<(), EpError> {
        if self.cfg.mode == want {
            Ok(())
        } else {
            Err(EpError::Mode {
                rank: self.rank,
                what: format!("{call} on a buffer sized for {:?} mode", self.cfg.mode),
            })
        }
    }

    /// Low-latency dispatch, sending half: checks the inputs, stages each
    /// token once, puts it into a slot of every rank holding one of its
    /// experts, then signals every (expert, source) pair with its count.
    /// `x` is `tokens × hidden`, `topk_idx` and `topk_weights` are `tokens ×
    /// topk` (-1: empty slot).
    ///
    /// Inputs refused by the checks (the error names the entry) send no
    /// token: this rank still signals every (expert, source) pair, with
    /// 2^32 (`POISON`) instead of a count, so that every peer's
    /// [`Buffer::ll_dispatch_recv`] ends the step at once with
    /// [`EpError::PeerRefused`] naming this rank; this call then waits for
    /// the step's signals from every rank (as the receiving half would) and
    /// returns the input error, every buffer usable for the next step.
    /// Where that wait fails (a timeout, a lost peer under
    /// [`OnPeerLoss::Fail`](crate::OnPeerLoss::Fail), a peer's broken
    /// protocol) its error is returned instead and the buffer refuses
    /// further steps: the refused step's late signals would otherwise be
    /// taken for the next step's.
    pub fn ll_dispatch_send(
        &mut self,
        x: &[Bf16],
        topk_idx: &[i64],
        topk_weights: &[f32],
    ) -> Result<LlPending, EpError> {
        self.check_mode("ll_dispatch_send", crate::Mode::LowLatency)?;
        self.expect_phase("ll_dispatch_send", Phase::Idle)?;
        let layout = match self.check_inputs(x.len(), topk_idx, topk_weights) {
            Ok(layout) => layout,
            Err(e) => return Err(self.ll_refuse(e)),
        };
        self.settle()?;
        self.lost.clear();
        self.step += 1;
        self.stage(x, topk_idx, topk_weights, layout.tokens);
        let (r, cfg) = (self.nranks, self.cfg);
        let (l, t, m) = (
            cfg.local_experts(r),
            cfg.max_tokens_per_rank,
            cfg.msg_bytes(),
        );
        self.unflushed = true;
        for tok in 0..layout.tokens {
            for k in 0..cfg.topk {
                let slot = layout.expert_slot[tok * cfg.topk + k];
                if slot == NONE {
                    continue;
                }
                let e = topk_idx[tok * cfg.topk + k] as usize;
                let (dst, le) = (e / l, e % l);
                if !self.active[dst] {
                    continue;
                }
                let off = ((le * r + self.rank) * t + slot as usize) * m;
                let put = self.dc.ctx(0)?.put(
                    dst,
                    &self.wins[RECV],
                    off as u64,
                    &self.wins[SEND],
                    (tok * m) as u64,
                    m as u64,
                    Remote::None,
                    Local::None,
                );
                self.sent(put, dst)?;
            }
        }
        for dst in 0..r {
            for le in 0..l {
                if !self.active[dst] {
                    break;
                }
                let count = u64::from(layout.tokens_per_expert[dst * l + le]);
                let id = (le * r + self.rank) as u32;
                let s = self
                    .dc
                    .ctx(0)?
                    .signal(dst, Remote::signal_add(id, count + 1));
                self.sent(s, dst)?;
            }
        }
        self.phase = Phase::DispatchSent;
        Ok(LlPending {
            step: self.step,
            sender: SenderSide {
                tokens: layout.tokens,
                topk_idx: topk_idx.to_vec(),
                weights: topk_weights.to_vec(),
                layout,
            },
        })
    }

    /// An operation's outcome: under [`crate::OnPeerLoss::Mask`] a failure
    /// masks the peer when the bootstrap reports that peer lost, otherwise
    /// it is the step's error (a fail-stop backend refuses operations to
    /// every peer once one link broke: that is not the target's fault).
    pub(crate) fn sent(
        &mut self,
        r: Result<(), gin_core::GinError>,
        peer: usize,
    ) -> Result<(), EpError> {
        match r {
            Ok(()) => Ok(()),
            Err(_)
                if self.policy == crate::OnPeerLoss::Mask
                    && peer != self.rank
                    && self.bootstrap_lost(peer) =>
            {
                self.mask_lost(peer);
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Writes every token's message into the send window.
    fn stage(&mut self, x: &[Bf16], topk_idx: &[i64], weights: &[f32], tokens: usize) {
        let cfg = self.cfg;
        let buf = self.bytes_mut(SEND, 0, tokens * cfg.msg_bytes());
        write_messages(&cfg, x, topk_idx, weights, buf);
    }

    /// Whether [`Buffer::ll_dispatch_recv`] would return without waiting.
    pub fn ll_dispatch_ready(&self, pending: &LlPending) -> Result<bool, EpError> {
        self.check_step(pending.step)?;
        let (r, l) = (self.nranks, self.cfg.local_experts(self.nranks));
        let ctx = self.dc.ctx(0)?;
        for le in 0..l {
            for src in (0..r).filter(|&s| self.active[s]) {
                let id = le * r + src;
                let v = ctx.read_signal(id as u32)?;
                if !crate::buffer::reached(v, self.seen[id].wrapping_add(1)) {
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }

    /// Low-latency dispatch, receiving half: waits (bounded) for every
    /// active source's count for every local expert, then reads the
    /// received tokens' metadata. Where a source's inputs were refused this
    /// step (its counts say so), it ends the step with every rank instead,
    /// reading no token, and returns [`EpError::PeerRefused`] naming the
    /// lowest such source; the buffer is then idle and usable.
    pub fn ll_dispatch_recv(&mut self, pending: LlPending) -> Result<LlDispatch, EpError> {
        self.expect_phase("ll_dispatch_recv", Phase::DispatchSent)?;
        self.check_step(pending.step)?;
        let (r, cfg) = (self.nranks, self.cfg);
        let (l, t) = (cfg.local_experts(r), cfg.max_tokens_per_rank);
        let (counts, refused) = self.ll_counts()?;
        if let Some(src) = refused {
            // Nobody reads this step's tokens: end it as every rank does.
            self.ll_end_refused()?;
            self.phase = Phase::Idle;
            return Err(EpError::PeerRefused {
                rank: self.rank,
                peer: src,
            });
        }
        let mut d = LlDispatch {
            step: self.step,
            sender: pending.sender,
            nranks: r,
            max: t,
            src_token: vec![0; l * r * t],
            slot_k: vec![0; l * r * t],
            weight: vec![0.0; l * r * t],
            counts,
            lost: Vec::new(),
        };
        self.read_metadata(&mut d)?;
        d.lost.clone_from(&self.lost);
        self.phase = Phase::Dispatched;
        Ok(d)
    }

    /// Waits (bounded) for every active source's dispatch signal for every
    /// local expert: the counts `[le * nranks + src]`, and the lowest
    /// source whose inputs were refused this step ([`POISON`]), if any (its
    /// counts stay 0). Every signal of the step is consumed either way.
    fn ll_counts(&mut self) -> Result<(Vec<u32>, Option<usize>), EpError> {
        let (r, cfg) = (self.nranks, self.cfg);
        let (l, t) = (cfg.local_experts(r), cfg.max_tokens_per_rank);
        let mut counts = vec![0u32; l * r];
        let mut refused: Option<usize> = None;
        for le in 0..l {
            for src in 0..r {
                if !self.active[src] {
                    continue;
                }
                let e = self.rank * l + le;
                let step = self.step;
                let what = || format!("the dispatch count of expert {e} (step {step})");
                let Some(delta) = self.wait_signal((le * r + src) as u32, src, &what)? else {
                    continue;
                };
                if delta >= POISON {
                    refused = Some(refused.map_or(src, |p| p.min(src)));
                    continue;
                }
                let count = delta.wrapping_sub(1);
                if count > t as u64 {
                    return Err(EpError::Protocol {
                        rank: self.rank,
                        peer: src,
                        what: format!("count {count} for expert {e}, above the maximum {t}"),
                    });
                }
                counts[le * r + src] = count as u32;
            }
        }
        Ok((counts, refused))
    }

    /// This rank's inputs were refused (`err`): it sends no token but
    /// signals every (expert, source) pair with [`POISON`], so that every
    /// peer's receiving half ends the step at once naming this rank; then
    /// it consumes the step's dispatch signals and ends the step as every
    /// rank does ([`Buffer::ll_end_refused`]). Returns `err`, or where that
    /// exchange itself failed its error, the buffer then broken (as a
    /// failed receiving half leaves it mid-step, never idle).
    fn ll_refuse(&mut self, err: EpError) -> EpError {
        self.phase = Phase::Broken;
        let r = (|| {
            self.lost.clear();
            self.step += 1;
            let (r, l) = (self.nranks, self.cfg.local_experts(self.nranks));
            for dst in 0..r {
                for le in 0..l {
                    if !self.active[dst] {
                        break;
                    }
                    let id = (le * r + self.rank) as u32;
                    let s = self.dc.ctx(0)?.signal(dst, Remote::signal_add(id, POISON));
                    self.sent(s, dst)?;
                }
            }
            self.ll_counts()?;
            self.ll_end_refused()
        })();
        match r {
            Ok(()) => {
                self.phase = Phase::Idle;
                err
            }
            Err(e) => e,
        }
    }

    /// Ends a step some rank's refused inputs stopped (every rank calls it,
    /// after consuming the step's dispatch signals): the combine's signals
    /// without its data, each expert rank telling every source that it is
    /// done with the step, and each source waiting for every expert's. A
    /// source thus starts its next dispatch only after every expert rank
    /// consumed this step's signals (the reuse argument of a full step).
    fn ll_end_refused(&mut self) -> Result<(), EpError> {
        let (r, cfg) = (self.nranks, self.cfg);
        let l = cfg.local_experts(r);
        for le in 0..l {
            let id = (cfg.num_experts + self.rank * l + le) as u32;
            for src in 0..r {
                if !self.active[src] {
                    continue;
                }
                let s = self.dc.ctx(0)?.signal(src, Remote::signal_add(id, 1));
                self.sent(s, src)?;
            }
        }
        for e in 0..cfg.num_experts {
            let owner = e / l;
            if !self.active[owner] {
                continue;
            }
            let step = self.step;
            let what = || format!("the end of refused step {step} at expert {e}");
            self.wait_signal((cfg.num_experts + e) as u32, owner, &what)?;
        }
        Ok(())
    }

    fn read_metadata(&self, d: &mut LlDispatch) -> Result<(), EpError> {
        let (r, cfg) = (self.nranks, self.cfg);
        let (l, t, m, p, k) = (
            cfg.local_experts(r),
            cfg.max_tokens_per_rank,
            cfg.msg_bytes(),
            cfg.payload_bytes(),
            cfg.topk,
        );
        for le in 0..l {
            let e = (self.rank * l + le) as i32;
            for src in 0..r {
                for i in 0..d.counts[le * r + src] as usize {
                    let slot = (le * r + src) * t + i;
                    let meta = self.bytes(RECV, slot * m + p, 4 + 8 * k);
                    let word = |j: usize| {
                        let mut b = [0u8; 4];
                        b.copy_from_slice(&meta[4 * j..4 * j + 4]);
                        b
                    };
                    let tok = u32::from_le_bytes(word(0));
                    let kk = (0..k).find(|&j| i32::from_le_bytes(word(1 + j)) == e);
                    let bad = |what: String| EpError::Protocol {
                        rank: self.rank,
                        peer: src,
                        what,
                    };
                    if tok as usize >= t {
                        return Err(bad(format!(
                            "token index {tok} at or above the maximum {t}"
                        )));
                    }
                    let Some(kk) = kk else {
                        return Err(bad(format!(
                            "token {tok} in expert {e}'s slots does not name it"
                        )));
                    };
                    d.src_token[slot] = tok;
                    d.slot_k[slot] = kk as u16;
                    d.weight[slot] = f32::from_le_bytes(word(1 + k + kk));
                }
            }
        }
        Ok(())
    }

    /// Send and receive in one call.
    pub fn ll_dispatch(
        &mut self,
        x: &[Bf16],
        topk_idx: &[i64],
        topk_weights: &[f32],
    ) -> Result<LlDispatch, EpError> {
        let p = self.ll_dispatch_send(x, topk_idx, topk_weights)?;
        self.ll_dispatch_recv(p)
    }

    /// The payload of the `i`th token from `src` for local expert `le`:
    /// `2 × hidden` bytes of BF16, or with FP8 `hidden` bytes of E4M3 then
    /// one f32 scale per 128 elements.
    pub fn ll_token(
        &self,
        d: &LlDispatch,
        le: usize,
        src: usize,
        i: usize,
    ) -> Result<&[u8], EpError> {
        self.check_step(d.step)?;
        let cfg = self.cfg;
        if le >= cfg.local_experts(self.nranks) || src >= self.nranks || i >= d.count(le, src) {
            return Err(EpError::Mode {
                rank: self.rank,
                what: format!("no received token {i} from rank {src} for local expert {le}"),
            });
        }
        let slot = (le * self.nranks + src) * cfg.max_tokens_per_rank + i;
        Ok(self.bytes(RECV, slot * cfg.msg_bytes(), cfg.payload_bytes()))
    }

    /// The combine input for that token (`hidden` BF16 elements): write the
    /// expert's output here before [`Buffer::ll_combine_send`].
    pub fn ll_combine_slot(
        &mut self,
        d: &LlDispatch,
        le: usize,
        src: usize,
        i: usize,
    ) -> Result<&mut [u8], EpError> {
        self.ll_token(d, le, src, i)?;
        self.settle()?;
        let (h2, t) = (2 * self.cfg.hidden, self.cfg.max_tokens_per_rank);
        let slot = (le * self.nranks + src) * t + i;
        Ok(self.bytes_mut(CSEND, slot * h2, h2))
    }

    /// The identity expert: copies every received token (dequantized from
    /// FP8 when it travelled so) into its combine slot.
    pub fn ll_echo(&mut self, d: &LlDispatch) -> Result<(), EpError> {
        let (r, cfg) = (self.nranks, self.cfg);
        let mut tmp = vec![Bf16::ZERO; cfg.hidden];
        for le in 0..cfg.local_experts(r) {
            for src in 0..r {
                for i in 0..d.count(le, src) {
                    let src_bytes = self.ll_token(d, le, src, i)?;
                    if cfg.fp8 {
                        dequantize_fp8(src_bytes, cfg.hidden, &mut tmp);
                    } else {
                        for (o, c) in tmp.iter_mut().zip(src_bytes.chunks_exact(2)) {
                            *o = Bf16(u16::from_le_bytes([c[0], c[1]]));
                        }
                    }
                    self.ll_combine_slot(d, le, src, i)?
                        .copy_from_slice(bf16_bytes(&tmp));
                }
            }
        }
        Ok(())
    }

    /// Low-latency combine, sending half: puts each combine slot back to its
    /// source's (token, top-k slot) place, then one signal per (expert,
    /// source).
    pub fn ll_combine_send(&mut self, d: &LlDispatch) -> Result<LlCombinePending, EpError> {
        self.expect_phase("ll_combine_send", Phase::Dispatched)?;
        self.check_step(d.step)?;
        let (r, cfg) = (self.nranks, self.cfg);
        let (l, t, h2, k) = (
            cfg.local_experts(r),
            cfg.max_tokens_per_rank,
            2 * cfg.hidden,
            cfg.topk,
        );
        self.unflushed = true;
        for le in 0..l {
            let e = self.rank * l + le;
            for src in 0..r {
                if !self.active[src] {
                    continue;
                }
                // A source that reads this rank's slots in place needs only
                // the signal (release: the slots' stores are visible first).
                let puts = if self.pull[src * r + self.rank] {
                    0
                } else {
                    d.count(le, src)
                };
                for i in 0..puts {
                    let slot = (le * r + src) * t + i;
                    let dst_off = (d.src_token[slot] as usize * k + d.slot_k[slot] as usize) * h2;
                    let put = self.dc.ctx(0)?.put(
                        src,
                        &self.wins[CRECV],
                        dst_off as u64,
                        &self.wins[CSEND],
                        (slot * h2) as u64,
                        h2 as u64,
                        Remote::None,
                        Local::None,
                    );
                    self.sent(put, src)?;
                }
                if self.active[src] {
                    let id = (cfg.num_experts + e) as u32;
                    let s = self.dc.ctx(0)?.signal(src, Remote::signal_add(id, 1));
                    self.sent(s, src)?;
                }
            }
        }
        self.phase = Phase::CombineSent;
        Ok(LlCombinePending { step: self.step })
    }

    /// Low-latency combine, receiving half: waits (bounded) for every
    /// active expert's signal, then reduces each token over its top-k slots
    /// with the weights, leaving out empty slots and masked ranks' experts.
    pub fn ll_combine_recv(
        &mut self,
        pending: LlCombinePending,
        d: &LlDispatch,
    ) -> Result<Combined, EpError> {
        self.expect_phase("ll_combine_recv", Phase::CombineSent)?;
        self.check_step(pending.step)?;
        self.check_step(d.step)?;
        let (r, cfg) = (self.nranks, self.cfg);
        let l = cfg.local_experts(r);
        for e in 0..cfg.num_experts {
            let owner = e / l;
            if !self.active[owner] {
                continue;
            }
            let step = self.step;
            let what = || format!("the combine of expert {e} (step {step})");
            self.wait_signal((cfg.num_experts + e) as u32, owner, &what)?;
        }
        let x = self.reduce(&d.sender, CRECV);
        self.phase = Phase::Idle;
        Ok(Combined {
            x,
            lost: self.lost.clone(),
        })
    }

    /// Σ over live top-k slots of weight × the slot's token, from the
    /// (token, slot) places of window `w`.
    pub(crate) fn reduce(&self, s: &SenderSide, w: usize) -> Vec<Bf16> {
        let (h, k) = (self.cfg.hidden, self.cfg.topk);
        let l = self.cfg.local_experts(self.nranks);
        let mut out = vec![Bf16::ZERO; s.tokens * h];
        let mut acc = vec![0f32; h];
        for t in 0..s.tokens {
            acc.fill(0.0);
            for j in 0..k {
                let e = s.topk_idx[t * k + j];
                if e < 0 || s.layout.expert_slot[t * k + j] == NONE || !self.active[e as usize / l]
                {
                    continue;
                }
                let w8 = s.weights[t * k + j];
                let bytes = self.combine_input(s, t, j, w);
                for (a, c) in acc.iter_mut().zip(bytes.chunks_exact(2)) {
                    *a += w8 * Bf16(u16::from_le_bytes([c[0], c[1]])).to_f32();
                }
            }
            for (o, a) in out[t * h..(t + 1) * h].iter_mut().zip(&acc) {
                *o = Bf16::from_f32(*a);
            }
        }
        out
    }

    /// Where the expert output for top-k slot `j` of token `t` is: in the
    /// expert rank's combine slot, read in place where it is mapped here,
    /// else where the expert put it (window `w`, place `(t, j)`).
    fn combine_input(&self, s: &SenderSide, t: usize, j: usize, w: usize) -> &[u8] {
        let (r, cfg) = (self.nranks, &self.cfg);
        let (k, h2, l) = (cfg.topk, 2 * cfg.hidden, cfg.local_experts(r));
        let e = s.topk_idx[t * k + j] as usize;
        let owner = e / l;
        if !self.pull[self.rank * r + owner] {
            return self.bytes(w, (t * k + j) * h2, h2);
        }
        let slot = ((e % l) * r + self.rank) * cfg.max_tokens_per_rank
            + s.layout.expert_slot[t * k + j] as usize;
        let win = &self.wins[CSEND];
        let off = slot * h2;
        if owner == self.rank {
            return self.bytes(CSEND, off, h2);
        }
        // Mapped since creation (that is what `pull` records).
        let base = win
            .peer_ptr(owner)
            .filter(|_| (off + h2) as u64 <= win.size_of(owner).unwrap_or(0));
        let Some(base) = base else {
            return self.bytes(w, (t * k + j) * h2, h2);
        };
        // SAFETY: in range of the owner's part (checked above), mapped here
        // while the window lives (borrowed with `self`). The owner wrote the
        // slot before its combine signal, which this rank acquired; it
        // rewrites the slot only after this rank's next dispatch, which needs
        // `&mut self`.
        unsafe { std::slice::from_raw_parts(base.add(off), h2) }
    }

    /// Send and receive in one call.
    pub fn ll_combine(&mut self, d: &LlDispatch) -> Result<Combined, EpError> {
        let p = self.ll_combine_send(d)?;
        self.ll_combine_recv(p, d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poison_is_above_every_count_signal_a_buffer_allows() {
        // The largest buffer `Config::validate` accepts is the one the
        // compile-time check next to `POISON` bounds.
        let t = crate::config::MAX_TOKENS_PER_RANK;
        let mut cfg = Config::low_latency(128, t, 2, 1);
        assert!(cfg.validate(0, 1).is_ok());
        cfg.max_tokens_per_rank = t + 1;
        assert!(cfg.validate(0, 1).is_err());
    }
}
