//! Device-resident steps on CUDA ranks, the parts that need no GPU: what
//! the inputs must look like ([`check_device_inputs`]), where the outputs
//! lie in the buffer's device memory ([`LlDeviceLayout`]), and the errors
//! the kernels record for the host ([`decode_error`], the codes of
//! `kernels/ll.cu`'s `ep::ERR_*`).

use gin_core::cuda::DevMem;

use crate::config::Config;
use crate::error::EpError;

/// The inputs of one low-latency dispatch, in GPU memory (DeepEP's `x`,
/// `topk_idx`, `topk_weights` tensors): `tokens` rows of BF16 (`x`,
/// `tokens × hidden` u16, 16-byte aligned), the top-k expert ids
/// (`topk_idx`, `tokens × topk` i64, -1 for an empty slot, 8-byte aligned)
/// and their weights (`topk_weights`, `tokens × topk` f32, 4-byte
/// aligned). Each buffer may be larger than that; only its first rows are
/// read. Memory a framework allocated is lent with the `unsafe`
/// [`DevMem::from_raw_parts`] (its contract: the memory stays allocated
/// while the `DevMem` lives). The inputs must be complete when a waiting
/// `*_device` call takes them (their producer's stream synchronised): those
/// calls run on gin's stream and the buffer's own, not ordered after the
/// caller's (the `_on` calls take the caller's stream instead).
#[derive(Debug, Clone, Copy)]
pub struct DeviceInputs<'m> {
    /// The tokens, BF16, `tokens × hidden`.
    pub x: &'m DevMem,
    /// The top-k expert ids, i64, `tokens × topk`.
    pub topk_idx: &'m DevMem,
    /// The top-k weights, f32, `tokens × topk`.
    pub topk_weights: &'m DevMem,
    /// Tokens this rank dispatches in this step (at most the buffer's
    /// `max_tokens_per_rank`).
    pub tokens: usize,
}

/// One device buffer's address and size, as [`check_device_inputs`] sees
/// it (a [`DevMem`]'s `ptr()` and `len()`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// The device address.
    pub addr: u64,
    /// Its size in bytes.
    pub bytes: usize,
}

impl From<&DevMem> for Span {
    fn from(m: &DevMem) -> Self {
        Self {
            addr: m.ptr(),
            bytes: m.len(),
        }
    }
}

/// Checks a device-resident dispatch's inputs where the host can, before
/// anything is launched: the token count against the buffer, each buffer's
/// size against it (in elements, as [`EpError::Shape`] counts) and each
/// address's alignment (the kernel reads `x` 16 bytes at a time). What lies
/// in the buffers (expert ids, weights) is checked by the dispatch kernel.
pub fn check_device_inputs(
    rank: usize,
    cfg: &Config,
    tokens: usize,
    x: Span,
    topk_idx: Span,
    topk_weights: Span,
) -> Result<(), EpError> {
    if tokens > cfg.max_tokens_per_rank {
        return Err(EpError::TooManyTokens {
            rank,
            tokens,
            max: cfg.max_tokens_per_rank,
        });
    }
    let k = cfg.topk;
    for (what, s, size, per_token) in [
        ("x", x, 2, cfg.hidden),
        ("topk_idx", topk_idx, 8, k),
        ("topk_weights", topk_weights, 4, k),
    ] {
        let expected = tokens * per_token;
        if s.bytes / size < expected {
            return Err(EpError::Shape {
                rank,
                what,
                len: s.bytes / size,
                expected,
                tokens,
                per_token,
            });
        }
        let align = if what == "x" { 16 } else { size as u64 };
        if !s.addr.is_multiple_of(align) {
            return Err(EpError::Misaligned {
                rank,
                what,
                addr: s.addr,
                align,
            });
        }
    }
    Ok(())
}

/// The first error the host path's checks find in a step's top-k ids and
/// weights (`tokens × topk` each; the weights of every live slot first,
/// then every entry in order): what the dispatch kernel reports for the
/// same inputs in GPU memory (`tests/input_host.rs` compares the kernel's
/// check, compiled as host C++, with this).
pub fn check_entries(
    rank: usize,
    cfg: &Config,
    topk_idx: &[i64],
    topk_weights: &[f32],
) -> Result<(), EpError> {
    crate::ll::check_weights(rank, cfg.topk, topk_idx, topk_weights)?;
    crate::layout::check_topk(rank, topk_idx, cfg.topk, cfg.num_experts)
}

/// Checks the caller's output buffer of a device-resident combine: room
/// for `tokens × hidden` BF16, 16-byte aligned (the kernel writes 16 bytes
/// at a time).
pub fn check_device_output(
    rank: usize,
    cfg: &Config,
    tokens: usize,
    out: Span,
) -> Result<(), EpError> {
    let expected = tokens * cfg.hidden;
    if out.bytes / 2 < expected {
        return Err(EpError::Shape {
            rank,
            what: "combine output",
            len: out.bytes / 2,
            expected,
            tokens,
            per_token: cfg.hidden,
        });
    }
    if !out.addr.is_multiple_of(16) {
        return Err(EpError::Misaligned {
            rank,
            what: "combine output",
            addr: out.addr,
            align: 16,
        });
    }
    Ok(())
}

/// Checks the caller's expert outputs of a device-resident combine
/// ([`super::CudaBuffer::ll_combine_from_device`]): laid out as the combine
/// slots (`pairs × max_tokens` slots of `hidden` BF16: DeepEP's `[local
/// experts, ranks × max tokens, hidden]`), 16-byte aligned.
pub fn check_expert_outputs(
    rank: usize,
    layout: &LlDeviceLayout,
    outputs: Span,
) -> Result<(), EpError> {
    let expected = layout.combine_bytes() / 2;
    if outputs.bytes / 2 < expected {
        return Err(EpError::Shape {
            rank,
            what: "expert outputs",
            len: outputs.bytes / 2,
            expected,
            tokens: layout.pairs() * layout.max_tokens,
            per_token: layout.hidden,
        });
    }
    if !outputs.addr.is_multiple_of(16) {
        return Err(EpError::Misaligned {
            rank,
            what: "expert outputs",
            addr: outputs.addr,
            align: 16,
        });
    }
    Ok(())
}

/// How a combine runs once the host checked the caller's tensors: never
/// refused locally, since every peer's combine waits for this rank's
/// signals ([`combine_call`]).
#[derive(Debug)]
pub(crate) struct CombineCall {
    /// The reduction goes to the buffer's own memory (`State::out`), not
    /// the caller's output tensor: that tensor was refused, or the combine
    /// is refused and writes nothing.
    pub(crate) sink: bool,
    /// The combine kernel runs in its refusing form: this rank's expert
    /// outputs were refused, so it sends none, poisons each of its combine
    /// signals and reduces nothing; every source's combine reports the
    /// refusal, naming this rank.
    pub(crate) refusing: bool,
    /// What this rank's call returns once the combine ran (the first
    /// tensor refused, the output before the expert outputs, as before).
    pub(crate) err: Option<EpError>,
}

/// What the host makes of its checks of a combine's output tensor (`out`)
/// and, where the call takes one, its expert-output tensor (`expert_out`):
/// a bad output alone changes nothing for the peers (this rank's expert
/// outputs do not depend on it): the combine runs in full, its reduction
/// into the buffer's own memory, and the call then returns the error; bad
/// expert outputs cannot be sent, so the combine is refused collectively
/// (its refusing form) and the call returns the error. Before, either
/// error was returned at once with nothing launched, leaving every peer's
/// combine waiting for this rank's signals until the job timeout.
pub(crate) fn combine_call(
    out: Result<(), EpError>,
    expert_out: Result<(), EpError>,
) -> CombineCall {
    let refusing = expert_out.is_err();
    let sink = refusing || out.is_err();
    CombineCall {
        sink,
        refusing,
        err: out.and(expert_out).err(),
    }
}

/// Where a device-resident dispatch leaves what it received, and where the
/// expert's outputs go, in the buffer's device memory
/// ([`super::CudaBuffer::recv_tokens`], [`super::CudaBuffer::recv_counts`],
/// [`super::CudaBuffer::recv_meta`], [`super::CudaBuffer::combine_slots`]):
/// for an expert kernel that reads and writes them without the host.
///
/// Pair `q = le · r + src` (local expert `le`, source rank `src`) holds
/// `count(q)` tokens (`recv_counts`, u32 per pair; 0 where the source is
/// masked or broke the protocol), in the source's token order; its `i`th
/// is a message in slot `q · t + i` of `recv_tokens` (the payload first:
/// BF16 `2·hidden` bytes, or FP8 `hidden` E4M3 bytes then one f32 scale
/// per 128 elements), its metadata in `recv_meta` (three u32: the token's
/// index at its source, the top-k slot naming this expert, the weight's
/// bits), and the expert writes its output (BF16, `hidden`) into slot
/// `q · t + i` of `combine_slots`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LlDeviceLayout {
    /// Ranks.
    pub nranks: usize,
    /// Local experts per rank.
    pub local_experts: usize,
    /// Slots per pair (the buffer's `max_tokens_per_rank`).
    pub max_tokens: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Bytes of a received message (the row stride of `recv_tokens`).
    pub msg_bytes: usize,
    /// Bytes of its payload (at the start of the message).
    pub payload_bytes: usize,
    /// Whether payloads are FP8 (scales at byte `hidden` of the payload).
    pub fp8: bool,
}

impl LlDeviceLayout {
    /// The layout of a buffer of `cfg` in a job of `nranks` ranks.
    pub fn new(cfg: &Config, nranks: usize) -> Self {
        Self {
            nranks,
            local_experts: cfg.local_experts(nranks),
            max_tokens: cfg.max_tokens_per_rank,
            hidden: cfg.hidden,
            msg_bytes: cfg.msg_bytes(),
            payload_bytes: cfg.payload_bytes(),
            fp8: cfg.fp8,
        }
    }

    /// Pairs (entries of `recv_counts`).
    pub fn pairs(&self) -> usize {
        self.local_experts * self.nranks
    }

    /// The pair of (local expert, source): its index in `recv_counts`.
    pub fn pair(&self, le: usize, src: usize) -> usize {
        le * self.nranks + src
    }

    /// The slot of the `i`th token of a pair.
    pub fn slot(&self, le: usize, src: usize, i: usize) -> usize {
        self.pair(le, src) * self.max_tokens + i
    }

    /// Byte offset of that token's message in `recv_tokens`.
    pub fn recv_offset(&self, le: usize, src: usize, i: usize) -> usize {
        self.slot(le, src, i) * self.msg_bytes
    }

    /// Index (in u32) of that token's metadata in `recv_meta`.
    pub fn meta_index(&self, le: usize, src: usize, i: usize) -> usize {
        3 * self.slot(le, src, i)
    }

    /// Byte offset of that token's output slot in `combine_slots`.
    pub fn combine_offset(&self, le: usize, src: usize, i: usize) -> usize {
        self.slot(le, src, i) * 2 * self.hidden
    }

    /// Bytes of `recv_tokens` the slots span.
    pub fn recv_bytes(&self) -> usize {
        self.pairs() * self.max_tokens * self.msg_bytes
    }

    /// Bytes of `combine_slots` the slots span.
    pub fn combine_bytes(&self) -> usize {
        self.pairs() * self.max_tokens * 2 * self.hidden
    }
}

/// Error codes of `kernels/ll.cu` (`ep::ERR_*`).
pub(crate) mod code {
    pub const COUNT_OVER_MAX: u64 = 1;
    pub const PEER_BAD_INPUT: u64 = 2;
    pub const TOKEN_RANGE: u64 = 3;
    pub const NOT_NAMED: u64 = 4;
    pub const EXPERT_RANGE: u64 = 5;
    pub const DUPLICATE: u64 = 6;
    pub const WEIGHT: u64 = 7;
    /// High-throughput mode (`kernels/ht.cu`'s `ep::ERR_HT`): word 1 is
    /// what ([`ht`]) | the channel << 32.
    pub const HT: u64 = 8;
    /// An expert rank (the peer) refused the low-latency combine (its
    /// expert outputs refused by its host's checks): its combine signals
    /// came with `POISON`, no output; word 1 its (lowest) expert, word 2
    /// how far that expert's signal moved past its target (`POISON`).
    pub const PEER_REFUSED_COMBINE: u64 = 9;

    /// What an `HT` error says (`ep::ht::HT_*`).
    pub mod ht {
        pub const STREAM_AHEAD: u64 = 1;
        pub const TOKEN_OUTSIDE: u64 = 2;
        pub const RANK_SLOT: u64 = 3;
        pub const WRONG_PLACE: u64 = 4;
        pub const RING_FOR_SELF: u64 = 5;
        pub const DELIVERED: u64 = 6;
        pub const ROWS_AHEAD: u64 = 7;
    }
}

/// The words of a high-throughput protocol error (`ep::ht::protocol`:
/// word 1 what | the channel << 32, words 2-3 the values), in words.
fn ht_protocol_what(w: [u64; 4]) -> String {
    let (what, ch, a, b) = (w[1] & 0xffff_ffff, w[1] >> 32, w[2], w[3]);
    match what {
        code::ht::STREAM_AHEAD => {
            format!("stream signal {a} runs ahead of the {b} messages expected (channel {ch})")
        }
        code::ht::TOKEN_OUTSIDE => format!(
            "token {a} with host slot {b}, outside channel {ch}'s range of its tokens for this host"
        ),
        code::ht::RANK_SLOT => {
            format!("rank slot {a} for rank {b}, beyond the tokens it expects (channel {ch})")
        }
        code::ht::WRONG_PLACE => {
            format!("a token landed in place {a}, its slot says {b} (channel {ch})")
        }
        code::ht::RING_FOR_SELF => {
            format!("token {a} for this forwarder came through the ring (channel {ch})")
        }
        code::ht::DELIVERED => format!(
            "this host's forwarders delivered {a} tokens in channel {ch}, the counts say {b}"
        ),
        code::ht::ROWS_AHEAD => {
            format!("{a} combined rows in channel {ch}, {b} expected")
        }
        other => format!("an unknown high-throughput error {other} (words {w:x?})"),
    }
}

/// Words of one record (`ep::rec::WORDS`): word 0 the kind | the peer
/// << 8, words 1-3 what.
pub(crate) const WORDS: usize = 4;

/// What the kernels recorded (`ep::record`, `kernels/ll.cu`'s `ep::rec`),
/// as the host reads it from the pinned mirror: two slots of [`WORDS`]
/// words. Slot 0 holds the first error of any kind; a refusal there is
/// cleared once the host reported it ([`forget_refusal`]), and the next
/// record takes the slot again. Slot 1 holds the first error that is not a
/// refusal (a source's broken protocol, a high-throughput error), recorded
/// even when slot 0 already holds a refusal, and never cleared: a refusal
/// recorded first (one of the steps queued since the last check) cannot
/// hide a broken protocol recorded after it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Record {
    /// Slot 0: the first error of any kind.
    pub(crate) first: [u64; WORDS],
    /// Slot 1: the first broken protocol.
    pub(crate) broken: [u64; WORDS],
}

impl Record {
    /// Bytes of the record in device memory and in its mirror.
    pub(crate) const BYTES: usize = 2 * WORDS * 8;

    /// The record of the kernels' words (slot 0, then slot 1).
    pub(crate) fn of(w: [u64; 2 * WORDS]) -> Self {
        let mut r = Self::default();
        r.first.copy_from_slice(&w[..WORDS]);
        r.broken.copy_from_slice(&w[WORDS..]);
        r
    }

    /// Whether slot 0 holds a refusal.
    pub(crate) fn refused(&self) -> bool {
        is_refusal(self.first[0])
    }

    /// The words the host reports: a broken protocol (slot 1) before
    /// anything else, whatever slot 0 holds; else slot 0; `None` when
    /// nothing was recorded.
    pub(crate) fn reported(&self) -> Option<[u64; WORDS]> {
        if self.broken[0] != 0 {
            Some(self.broken)
        } else if self.first[0] != 0 {
            Some(self.first)
        } else {
            None
        }
    }
}

/// Where a buffer's record lives, for [`forget_refusal`].
pub(crate) trait RecordMemory {
    /// Zeroes slot 0 of the mirror the host reads (pinned host memory).
    fn clear_mirror_first(&self);
    /// Zeroes word 0 of slot 0 in the kernels' memory (device memory, where
    /// a record claims the slot by a CAS from 0).
    fn clear_kernel_first(&self) -> Result<(), EpError>;
}

/// Forgets a refusal the host has reported (slot 0 of the record): the
/// mirror first, while the kernels' word 0 still holds the refusal, so
/// that no record writes the mirror meanwhile (only a slot's claimant
/// writes its mirror); then the kernels' word 0, after which the next
/// record claims the slot and publishes itself whole. What is cleared is
/// therefore exactly what the host read, even where a kernel still runs
/// (a check while a queued kernel runs: misuse, but no record is lost to
/// it): in the other order a record claimed between the two clears would
/// have its mirror erased, its slot taken on the GPU and empty for the
/// host, and every later refusal dropped unseen. Slot 1 (a broken
/// protocol) is never cleared: the buffer fails on it.
pub(crate) fn forget_refusal(m: &impl RecordMemory) -> Result<(), EpError> {
    m.clear_mirror_first();
    m.clear_kernel_first()
}

/// Whether a recorded error (word 0 of `ep::record`) is a refusal: this
/// rank's inputs found bad on the GPU, a source's refused (its counts
/// poisoned), or an expert rank's refused combine (its combine signals
/// poisoned). Every rank then ends the step alike (no rank broke the
/// protocol, every signal of the step was consumed); anything else is a
/// broken protocol, and the step cannot be finished.
pub(crate) fn is_refusal(w0: u64) -> bool {
    matches!(
        w0 & 0xff,
        code::PEER_BAD_INPUT
            | code::EXPERT_RANGE
            | code::DUPLICATE
            | code::WEIGHT
            | code::PEER_REFUSED_COMBINE
    )
}

/// The error a kernel recorded (`ep::record`: word 0 the kind | the peer
/// << 8, words 1-3 what), as the host reports it: the source's protocol
/// errors as [`EpError::Protocol`] naming it and this rank's expert, a
/// source's refused inputs as [`EpError::PeerRefused`] naming it, an
/// expert rank's refused combine as [`EpError::PeerRefusedCombine`] naming
/// it, this rank's bad inputs as the host's own input checks name them.
/// `None` for no error (word 0 zero).
pub fn decode_error(rank: usize, cfg: &Config, w: [u64; 4]) -> Option<EpError> {
    if w[0] == 0 {
        return None;
    }
    let (kind, peer) = (
        w[0] & 0xff,
        usize::try_from(w[0] >> 8).unwrap_or(usize::MAX),
    );
    let t = cfg.max_tokens_per_rank;
    let proto = |what: String| EpError::Protocol { rank, peer, what };
    // Narrowing a recorded u64 the kernel wrote from a u32 or an index.
    let us = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
    Some(match kind {
        code::COUNT_OVER_MAX => proto(format!(
            "count {} for expert {}, above the maximum {t}",
            w[2], w[1]
        )),
        code::PEER_BAD_INPUT => EpError::PeerRefused { rank, peer },
        code::PEER_REFUSED_COMBINE => EpError::PeerRefusedCombine { rank, peer },
        code::TOKEN_RANGE => proto(format!(
            "token index {} at or above the maximum {t} in expert {}'s slots",
            w[2], w[1]
        )),
        code::NOT_NAMED => proto(format!(
            "token {} in expert {}'s slots does not name it",
            w[2], w[1]
        )),
        code::EXPERT_RANGE => EpError::ExpertOutOfRange {
            rank,
            token: us(w[1]),
            slot: us(w[2]),
            expert: w[3].cast_signed(),
            experts: cfg.num_experts,
        },
        code::DUPLICATE => EpError::DuplicateExpert {
            rank,
            token: us(w[1]),
            expert: w[3].cast_signed(),
            first: us(w[2] >> 32),
            second: us(w[2] & 0xffff_ffff),
        },
        code::WEIGHT => EpError::BadWeight {
            rank,
            token: us(w[1]),
            slot: us(w[2]),
            weight: f32::from_bits(u32::try_from(w[3] & 0xffff_ffff).unwrap_or(0)),
        },
        code::HT => proto(ht_protocol_what(w)),
        other => EpError::Mode {
            rank,
            what: format!(
                "a kernel recorded an unknown error {other} (words {w:x?}): gin-ep's kernels and host code differ"
            ),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cfg() -> Config {
        Config::low_latency(256, 16, 8, 4)
    }

    fn span(addr: u64, bytes: usize) -> Span {
        Span { addr, bytes }
    }

    #[test]
    fn device_inputs_are_checked_for_size_and_alignment() {
        let c = cfg();
        let ok = |t: usize| {
            check_device_inputs(
                3,
                &c,
                t,
                span(0x1000, 2 * 256 * t),
                span(0x2000, 8 * 4 * t),
                span(0x3000, 4 * 4 * t),
            )
        };
        assert!(ok(0).is_ok());
        assert!(ok(16).is_ok());
        assert!(matches!(
            ok(17),
            Err(EpError::TooManyTokens {
                rank: 3,
                tokens: 17,
                max: 16
            })
        ));
        // Larger buffers are fine (a framework's storage), smaller are not.
        let big = check_device_inputs(
            0,
            &c,
            2,
            span(0x1000, 1 << 20),
            span(0x2000, 1 << 20),
            span(0x3000, 1 << 20),
        );
        assert!(big.is_ok());
        let small = check_device_inputs(
            0,
            &c,
            2,
            span(0x1000, 2 * 256 * 2),
            span(0x2000, 8 * 4 * 2 - 1),
            span(0x3000, 4 * 4 * 2),
        );
        assert!(
            matches!(
                small,
                Err(EpError::Shape {
                    what: "topk_idx",
                    len: 7,
                    expected: 8,
                    tokens: 2,
                    per_token: 4,
                    ..
                })
            ),
            "{small:?}"
        );
        let x_off = check_device_inputs(
            1,
            &c,
            1,
            span(0x1008, 512),
            span(0x2000, 32),
            span(0x3000, 16),
        );
        assert!(matches!(
            x_off,
            Err(EpError::Misaligned {
                rank: 1,
                what: "x",
                addr: 0x1008,
                align: 16
            })
        ));
        let idx_off = check_device_inputs(
            1,
            &c,
            1,
            span(0x1000, 512),
            span(0x2004, 32),
            span(0x3000, 16),
        );
        assert!(matches!(
            idx_off,
            Err(EpError::Misaligned {
                what: "topk_idx",
                align: 8,
                ..
            })
        ));
        let out = check_device_output(2, &c, 3, span(0x10, 2 * 256 * 3 - 2));
        assert!(matches!(
            out,
            Err(EpError::Shape {
                what: "combine output",
                expected: 768,
                ..
            })
        ));
        assert!(check_device_output(2, &c, 3, span(0x10, 2 * 256 * 3)).is_ok());
        // Expert outputs: every slot of every pair (8 experts on 2 ranks: 4
        // local, 2 sources, 16 slots each).
        let lay = LlDeviceLayout::new(&c, 2);
        let need = 4 * 2 * 16 * 2 * 256;
        assert_eq!(lay.combine_bytes(), need);
        assert!(check_expert_outputs(0, &lay, span(0x100, need)).is_ok());
        assert!(matches!(
            check_expert_outputs(0, &lay, span(0x100, need - 2)),
            Err(EpError::Shape {
                what: "expert outputs",
                tokens: 128,
                per_token: 256,
                ..
            })
        ));
        assert!(matches!(
            check_expert_outputs(0, &lay, span(0x108, need)),
            Err(EpError::Misaligned {
                what: "expert outputs",
                ..
            })
        ));
        assert!(matches!(
            check_device_output(2, &c, 3, span(0x18, 4096)),
            Err(EpError::Misaligned { align: 16, .. })
        ));
    }

    /// A combine's tensors refused by the host's checks: a bad output
    /// runs the combine in full into the buffer's own memory, bad expert
    /// outputs refuse it collectively; either way the call's error names
    /// the first tensor refused, and nothing is refused locally.
    #[test]
    fn a_refused_combine_tensor_still_runs_the_combine() {
        let c = cfg();
        let lay = LlDeviceLayout::new(&c, 2);
        let out = |bytes| check_device_output(1, &c, 3, span(0x100, bytes));
        let eout = |addr| check_expert_outputs(1, &lay, span(addr, lay.combine_bytes()));
        let good = combine_call(out(2 * 256 * 3), eout(0x1000));
        assert!(!good.sink && !good.refusing && good.err.is_none());
        let small = combine_call(out(2 * 256 * 3 - 2), eout(0x1000));
        assert!(small.sink && !small.refusing, "{small:?}");
        assert!(matches!(
            small.err,
            Some(EpError::Shape {
                rank: 1,
                what: "combine output",
                ..
            })
        ));
        let unaligned = combine_call(out(2 * 256 * 3), eout(0x1008));
        assert!(unaligned.sink && unaligned.refusing, "{unaligned:?}");
        assert!(matches!(
            unaligned.err,
            Some(EpError::Misaligned {
                rank: 1,
                what: "expert outputs",
                ..
            })
        ));
        // Both: refused collectively (the expert outputs cannot be sent),
        // the output's error first, as the checks ran before.
        let both = combine_call(out(0), eout(0x1008));
        assert!(both.sink && both.refusing);
        assert!(matches!(
            both.err,
            Some(EpError::Shape {
                what: "combine output",
                ..
            })
        ));
        // A call without expert outputs (ll_combine_device, ht_combine_device).
        let plain = combine_call(out(8), Ok(()));
        assert!(plain.sink && !plain.refusing && plain.err.is_some());
    }

    #[test]
    fn recorded_errors_name_the_rank_the_peer_and_the_expert() {
        let c = cfg();
        assert!(decode_error(0, &c, [0, 5, 6, 7]).is_none());
        let e = decode_error(1, &c, [code::COUNT_OVER_MAX | 3 << 8, 5, 99, 0]).unwrap();
        assert!(matches!(
            e,
            EpError::Protocol {
                rank: 1,
                peer: 3,
                ..
            }
        ));
        assert_eq!(
            e.to_string(),
            "rank 1: rank 3 broke the protocol: count 99 for expert 5, above the maximum 16"
        );
        let e = decode_error(0, &c, [code::NOT_NAMED | 2 << 8, 4, 11, 0]).unwrap();
        assert_eq!(
            e.to_string(),
            "rank 0: rank 2 broke the protocol: token 11 in expert 4's slots does not name it"
        );
        let e = decode_error(0, &c, [code::TOKEN_RANGE | 1 << 8, 6, 40, 0]).unwrap();
        assert!(
            e.to_string()
                .contains("token index 40 at or above the maximum 16")
        );
        assert!(e.to_string().contains("expert 6"));
        let e = decode_error(2, &c, [code::PEER_BAD_INPUT | 1 << 8, 7, 0, 0]).unwrap();
        assert!(matches!(e, EpError::PeerRefused { rank: 2, peer: 1 }));
        assert!(e.to_string().contains("inputs were refused"), "{e}");
        let e = decode_error(1, &c, [code::EXPERT_RANGE, 3, 2, (-5i64).cast_unsigned()]).unwrap();
        assert!(matches!(
            e,
            EpError::ExpertOutOfRange {
                rank: 1,
                token: 3,
                slot: 2,
                expert: -5,
                experts: 8
            }
        ));
        let e = decode_error(1, &c, [code::DUPLICATE, 4, 3 | 1 << 32, 6]).unwrap();
        assert!(matches!(
            e,
            EpError::DuplicateExpert {
                rank: 1,
                token: 4,
                expert: 6,
                first: 1,
                second: 3
            }
        ));
        let e = decode_error(0, &c, [code::WEIGHT, 9, 1, u64::from(f32::NAN.to_bits())]).unwrap();
        assert!(
            matches!(e, EpError::BadWeight { token: 9, slot: 1, weight, .. } if weight.is_nan())
        );
        // An expert rank's refused combine (code 9, ll.cu's
        // ERR_PEER_REFUSED_COMBINE, as the combine kernel records it:
        // expert 5, moved POISON), naming that rank, its message about
        // the combine (the expert outputs missing, this rank's output not
        // written), not the dispatch's ("inputs were refused ... sent no
        // token"): before, PeerRefused.
        let e = decode_error(3, &c, [9 | 2 << 8, 5, 1 << 32, 0]).unwrap();
        assert!(
            matches!(e, EpError::PeerRefusedCombine { rank: 3, peer: 2 }),
            "{e:?}"
        );
        let msg = e.to_string();
        assert!(
            msg.contains("rank 2 refused this step's combine")
                && msg.contains("expert outputs")
                && msg.contains("combine output was not written"),
            "{msg}"
        );
        assert!(
            !msg.contains("inputs were refused") && !msg.contains("sent no token"),
            "{msg}"
        );
        // Its kind is a refusal (the step ended on every rank), whatever
        // the peer byte: judged as a source's refused inputs are.
        assert!(is_refusal(9 | 2 << 8) && is_refusal(code::PEER_REFUSED_COMBINE));
        let e = decode_error(0, &c, [200, 0, 0, 0]).unwrap();
        assert!(e.to_string().contains("unknown error 200"));
    }

    /// A refusal (a rank's inputs, on the host or the GPU, or an expert
    /// rank's refused combine) ends the step on every rank; a broken protocol (or an HT error) does not, and an
    /// empty word is no error at all. The peer byte does not matter.
    #[test]
    fn refusals_are_told_from_broken_protocols() {
        for k in [
            code::PEER_BAD_INPUT,
            code::EXPERT_RANGE,
            code::DUPLICATE,
            code::WEIGHT,
            // An expert rank's refused combine (before: a broken protocol).
            9,
        ] {
            assert!(is_refusal(k), "{k}");
            assert!(is_refusal(k | 5 << 8), "{k}");
        }
        for k in [
            0,
            code::COUNT_OVER_MAX,
            code::TOKEN_RANGE,
            code::NOT_NAMED,
            code::HT,
        ] {
            assert!(!is_refusal(k | 2 << 8), "{k}");
        }
    }

    fn words(first: [u64; WORDS], broken: [u64; WORDS]) -> Record {
        let mut w = [0u64; 2 * WORDS];
        w[..WORDS].copy_from_slice(&first);
        w[WORDS..].copy_from_slice(&broken);
        Record::of(w)
    }

    /// Steps queued between two checks: a peer's refusal recorded in one
    /// (slot 0), a source's count above the maximum in a later one (slot 1,
    /// `ep::rec`): the host reports the broken protocol, naming its source,
    /// whatever slot 0 holds; a refusal alone is reported as such.
    #[test]
    fn a_broken_protocol_is_reported_before_a_refusal_recorded_first() {
        let c = cfg();
        let refused = [code::PEER_BAD_INPUT | 2 << 8, 5, (1 << 32) - 1, 0];
        let over = [code::COUNT_OVER_MAX | 3 << 8, 5, 40, 0];
        let r = words(refused, over);
        assert!(r.refused());
        assert_eq!(r.reported(), Some(over));
        assert!(matches!(
            decode_error(1, &c, over),
            Some(EpError::Protocol {
                rank: 1,
                peer: 3,
                ..
            })
        ));
        let alone = words(refused, [0; WORDS]);
        assert_eq!((alone.refused(), alone.reported()), (true, Some(refused)));
        // A broken protocol first holds both slots.
        let first = words(over, over);
        assert_eq!((first.refused(), first.reported()), (false, Some(over)));
        assert_eq!(Record::default().reported(), None);
        assert_eq!(Record::BYTES, 64);
    }

    /// The kernels' slot 0 and its mirror, with a record (`ep::rec`'s
    /// claim: a CAS of word 0 from 0, then the mirror) made by a kernel
    /// still running after the host's `inject_after`th clear.
    struct Slot {
        kernel: std::cell::Cell<[u64; WORDS]>,
        mirror: std::cell::Cell<[u64; WORDS]>,
        clears: std::cell::Cell<usize>,
        inject_after: usize,
        late: [u64; WORDS],
    }

    impl Slot {
        fn claim(&self, w: [u64; WORDS]) {
            if self.kernel.get()[0] == 0 {
                self.kernel.set(w);
                self.mirror.set(w);
            }
        }
        fn cleared(&self) {
            self.clears.set(self.clears.get() + 1);
            if self.clears.get() == self.inject_after {
                self.claim(self.late);
            }
        }
        /// Whatever holds the kernels' slot, the host sees it.
        fn seen(&self) -> bool {
            let k = self.kernel.get()[0];
            k == 0 || self.mirror.get()[0] == k
        }
    }

    impl RecordMemory for Slot {
        fn clear_mirror_first(&self) {
            self.mirror.set([0; WORDS]);
            self.cleared();
        }
        fn clear_kernel_first(&self) -> Result<(), EpError> {
            let mut k = self.kernel.get();
            k[0] = 0;
            self.kernel.set(k);
            self.cleared();
            Ok(())
        }
    }

    /// Forgetting a reported refusal while a kernel still records (a check
    /// while a queued kernel runs) never leaves a record the host cannot
    /// see: the mirror is cleared first. The other order (the kernels' word
    /// first, as before) loses a record made between the two clears.
    #[test]
    fn forgetting_a_refusal_never_hides_a_record_made_meanwhile() {
        let reported = [code::PEER_BAD_INPUT | 1 << 8, 2, (1 << 32) - 1, 0];
        let late = [code::PEER_BAD_INPUT | 3 << 8, 4, (1 << 32) - 1, 0];
        let slot = |inject_after| Slot {
            kernel: std::cell::Cell::new(reported),
            mirror: std::cell::Cell::new(reported),
            clears: std::cell::Cell::new(0),
            inject_after,
            late,
        };
        for inject_after in 1..=2 {
            let s = slot(inject_after);
            forget_refusal(&s).unwrap();
            assert!(s.seen(), "a record after clear {inject_after} is lost");
            if inject_after == 2 {
                assert_eq!(s.mirror.get(), late);
            }
        }
        let s = slot(1);
        s.clear_kernel_first().unwrap();
        s.clear_mirror_first();
        assert!(!s.seen(), "the old order loses the record made between");
    }

    /// The kernels' codes are the host's (`ep::ERR_*` in ll.cu).
    #[test]
    fn error_codes_match_the_kernels() {
        let src = super::super::LL_KERNELS;
        for (name, v) in [
            ("ERR_COUNT_OVER_MAX", code::COUNT_OVER_MAX),
            ("ERR_PEER_BAD_INPUT", code::PEER_BAD_INPUT),
            ("ERR_TOKEN_RANGE", code::TOKEN_RANGE),
            ("ERR_NOT_NAMED", code::NOT_NAMED),
            ("ERR_EXPERT_RANGE", code::EXPERT_RANGE),
            ("ERR_DUPLICATE", code::DUPLICATE),
            ("ERR_WEIGHT", code::WEIGHT),
            ("ERR_PEER_REFUSED_COMBINE", code::PEER_REFUSED_COMBINE),
        ] {
            let decl = format!("constexpr u64 {name} = {v};");
            assert!(src.contains(&decl), "ll.cu lacks {decl:?}");
        }
    }

    /// High-throughput mode's codes are ht.cu's (`ep::ERR_HT`,
    /// `ep::ht::HT_*`), and each decodes to a protocol error naming the
    /// peer and the channel.
    #[test]
    fn ht_error_codes_match_the_kernels_and_decode() {
        let src = super::super::HT_KERNELS;
        assert!(src.contains(&format!("constexpr u64 ERR_HT = {};", code::HT)));
        for (name, v) in [
            ("HT_STREAM_AHEAD", code::ht::STREAM_AHEAD),
            ("HT_TOKEN_OUTSIDE", code::ht::TOKEN_OUTSIDE),
            ("HT_RANK_SLOT", code::ht::RANK_SLOT),
            ("HT_WRONG_PLACE", code::ht::WRONG_PLACE),
            ("HT_RING_FOR_SELF", code::ht::RING_FOR_SELF),
            ("HT_DELIVERED", code::ht::DELIVERED),
            ("HT_ROWS_AHEAD", code::ht::ROWS_AHEAD),
        ] {
            let decl = format!("constexpr u64 {name} = {v};");
            assert!(src.contains(&decl), "ht.cu lacks {decl:?}");
            let cfg = Config::high_throughput(256, 16, 8, 4);
            let e = decode_error(2, &cfg, [code::HT | 5 << 8, v | 3 << 32, 7, 9]);
            match e {
                Some(EpError::Protocol {
                    rank: 2,
                    peer: 5,
                    what,
                }) => {
                    assert!(what.contains("channel 3"), "{name}: {what}");
                    assert!(!what.contains("unknown"), "{name}: {what}");
                }
                other => panic!("{name}: {other:?}"),
            }
        }
    }

    proptest! {
        /// The device layout is the CPU ranks' slot numbering
        /// (`((le · r + src) · t + i)`), every slot inside the windows
        /// `ll::resources` sizes, and no two slots overlap.
        #[test]
        fn device_layout_slots_fit_the_windows(
            r in 1usize..6, l in 1usize..5, t in 1usize..9, h8 in 1usize..40, fp8 in any::<bool>(), k in 1usize..4,
        ) {
            let mut c = Config::low_latency(if fp8 { 128 * h8.div_ceil(16) } else { 8 * h8 }, t, l * r, k.min(l * r));
            c.fp8 = fp8;
            let d = LlDeviceLayout::new(&c, r);
            let (_, sizes) = crate::ll::resources(&c, r);
            prop_assert_eq!(d.recv_bytes(), sizes[1]);
            prop_assert_eq!(d.combine_bytes(), sizes[2]);
            let mut seen = std::collections::HashSet::new();
            for le in 0..l {
                for src in 0..r {
                    for i in 0..t {
                        prop_assert_eq!(d.slot(le, src, i), (le * r + src) * t + i);
                        prop_assert!(seen.insert(d.slot(le, src, i)));
                        prop_assert!(d.recv_offset(le, src, i) + d.msg_bytes <= sizes[1]);
                        prop_assert!(d.combine_offset(le, src, i) + 2 * c.hidden <= sizes[2]);
                        prop_assert!(d.meta_index(le, src, i) + 3 <= 3 * l * r * t);
                        prop_assert!(d.payload_bytes <= d.msg_bytes);
                    }
                }
            }
        }
    }
}
