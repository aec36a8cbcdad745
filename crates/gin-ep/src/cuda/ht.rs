//! High-throughput mode on CUDA ranks (`kernels/ht.cu`, compiled after
//! `kernels/ll.cu` in one NVRTC source): the CPU ranks' protocol
//! ([`crate::ht`]: windows, signal ids, metadata, rings and credits,
//! forwarding, the combine's order of sums) with each channel run by one
//! block of the dispatch and combine kernels.
//!
//! A step from host memory ([`CudaBuffer::ht_dispatch`],
//! [`CudaBuffer::ht_combine`], DeepEP's normal mode with its CPU sync after
//! the counts): the host checks the inputs with the CPU ranks' code (refused
//! inputs still take part in the count exchange, with a refused row, so
//! that every peer ends the step at once naming this rank; nothing else is
//! sent), stages this rank's notify row, queues the metadata's staging on
//! a stream of the buffer's own (`ep_ht_stage_meta` writes every token's
//! metadata words from the top-k ids and weights and the layout's slots,
//! staged in pinned host memory), and the notify kernel exchanges the rows
//! (gin puts and one signal each) while a second thread uploads the tokens
//! (one copy from the caller's slice; FP8 is then quantised on the GPU by
//! `ep_ht_quantize`, bit for bit [`crate::num::quantize_fp8`]); the host
//! reads the rows back and builds the step's plan with the CPU ranks' code
//! ([`crate::ht`]'s `Plan`), uploads it as one table, and the dispatch
//! kernel moves runs of tokens by it.
//! The received tokens' metadata is read back (source index, weights) as
//! the CPU ranks' receive reads it.
//!
//! From GPU memory ([`CudaBuffer::ht_dispatch_device`],
//! [`CudaBuffer::ht_combine_device`]): the top-k ids and weights are
//! checked and laid out where they are by `ep_ht_layout`, queued on gin's
//! stream right before the notify kernel, which writes this rank's notify
//! row (or the refused row, the first bad entry left for the host to name)
//! and the tokens' metadata: nothing of the routing goes to the host before
//! the count exchange, whose rows the host reads for the plan. BF16 tokens
//! are read in place by the dispatch kernel, whose puts to load/store peers
//! copy straight from the caller's `x` (a put to a queued peer, proxy or
//! GDAKI, reads a window: where another active rank is reached through a
//! queue the tokens are copied into XIN beside the notify kernel), FP8 ones
//! quantised from `x` into XIN beside it; what was received stays on the
//! GPU for the caller's expert ([`HtDeviceLayout`]).

use gin_core::CoreError;
use gin_core::cuda::{Arg, DevMem, Device, Function, HostMem, Module, Stream, StreamRef};

use super::{
    CudaBuffer, DeviceInputs, On, check_device_inputs, check_device_output, go, kernel_error,
    read_clock,
};
use crate::config::Mode;
use crate::error::EpError;
use crate::ht::plan::{self, Plan, Shape, TableAt};
use crate::layout::Layout;
use crate::ll::Combined;
use crate::num::{Bf16, bf16_bytes};
use crate::oracle::HtView;

/// The kernels of CUDA ranks in high-throughput mode: `kernels/ll.cu` then
/// `kernels/ht.cu`, one source for [`gin_core::cuda::CudaComm::compile`].
pub const HT_KERNELS: &str = concat!(
    include_str!("../../kernels/ll.cu"),
    "\n",
    include_str!("../../kernels/ht.cu")
);

/// The high-throughput kernels of a loaded module.
#[derive(Debug)]
pub(crate) struct HtFunctions {
    pub(crate) notify: Function,
    pub(crate) dispatch: Function,
    pub(crate) echo: Function,
    pub(crate) combine: Function,
    pub(crate) quantize: Function,
    pub(crate) stage_meta: Function,
    pub(crate) layout: Function,
}

impl HtFunctions {
    pub(crate) fn of(m: &Module) -> Result<Self, CoreError> {
        Ok(Self {
            notify: m.function("ep_ht_notify")?,
            dispatch: m.function("ep_ht_dispatch")?,
            echo: m.function("ep_ht_echo")?,
            combine: m.function("ep_ht_combine")?,
            quantize: m.function("ep_ht_quantize")?,
            stage_meta: m.function("ep_ht_stage_meta")?,
            layout: m.function("ep_ht_layout")?,
        })
    }
}

/// Where each value lies among the shape words the kernels read (ht.cu's
/// `SW_*`, compared with it by a test).
pub(crate) const SHAPE_WORDS: [(&str, usize); 15] = [
    ("SW_R", 0),
    ("SW_H", 1),
    ("SW_L", 2),
    ("SW_T", 3),
    ("SW_K", 4),
    ("SW_P", 5),
    ("SW_MM", 6),
    ("SW_H2", 7),
    ("SW_RING", 8),
    ("SW_CHANS", 9),
    ("SW_RANK", 10),
    ("SW_HIDDEN", 11),
    ("SW_LEXP", 12),
    ("SW_FP8", 13),
    ("SW_NSIG", 14),
];

/// The shape words of rank `rank`'s buffer (see [`SHAPE_WORDS`]): every
/// value fits a u32 (`Config::validate` bounds them).
pub(crate) fn shape_words(
    s: &Shape,
    rank: usize,
    hidden: usize,
    lexp: usize,
    fp8: bool,
) -> Vec<u32> {
    let u = CudaBuffer::u32_of;
    vec![
        u(s.r),
        u(s.h),
        u(s.l),
        u(s.t),
        u(s.k),
        u(s.p),
        u(s.mm),
        u(s.h2),
        u(s.ring),
        u(s.chans),
        u(rank),
        u(hidden),
        u(lexp),
        u32::from(fp8),
        s.signals(),
    ]
}

/// Words of the kernels' scratch per channel (ht.cu's `lane_words`; in
/// shared memory up to ht.cu's `LANE_SMEM`, else in [`HtState`]'s `lane`).
pub(crate) fn lane_words(s: &Shape) -> usize {
    2 * s.h + 2 * s.r + 3 * s.l + 16
}

/// Rows per channel of window CGET (combine rows of same-host peers not
/// mapped here, fetched by `get`) that [`cget_bytes`] sizes at least
/// (ht.cu's `FETCH_ROWS`): the combine fetches the rows of up to this many
/// tokens' places with one get per run of consecutive places and one flush,
/// where a get and a flush per token were the proxy combine's cost.
pub(crate) const FETCH_ROWS: usize = 64;

/// Rows per channel of CGET for hosts of `l` ranks (ht.cu's
/// `cget_rows_for`): at least one per local rank (a forwarder's sum fetches
/// one row of each), and [`FETCH_ROWS`].
pub(crate) fn cget_rows(l: usize) -> usize {
    l.max(FETCH_ROWS)
}

/// The bytes of window CGET on CUDA ranks: [`cget_rows`] rows of
/// `2 × hidden` bytes per channel where a same-host peer's combine rows are
/// not mapped here (`unmapped`: fetched by get), none otherwise (every row
/// is then read in place and CGET is never touched; the CPU ranks'
/// `plan::cget_bytes` likewise). The kernels take the rows per channel from
/// the window's size (ht.cu's `cget_rows`), so a smaller window with at
/// least `l` rows a channel works too, one token's fetches per flush
/// ([`check_cget`]). `CudaBuffer::new` sizes CGET with it.
pub(crate) fn cget_bytes(cfg: &crate::Config, l: usize, unmapped: bool) -> usize {
    if unmapped {
        cfg.channels * cget_rows(l) * 2 * cfg.hidden
    } else {
        0
    }
}

/// Whether a same-host peer's combine rows are fetched by get (not read in
/// place): `direct[p]` false for a rank `p` of this rank's host (hosts of
/// `l` ranks).
pub(crate) fn fetches_rows(rank: usize, l: usize, direct: &[bool]) -> bool {
    let host = rank / l;
    direct.iter().enumerate().any(|(p, &d)| !d && p / l == host)
}

/// Checks that CGET (`bytes` here) holds at least `l` rows per channel
/// where rows are fetched by get ([`fetches_rows`]): ht.cu's forwarder
/// fetches up to one row of each local rank into its channel's rows `0 ..
/// l` and a token's reduction up to `l` rows, so fewer would write into the
/// next channel's rows or never let a token's fetches through (the step
/// would stall until the timeout, naming an unrelated peer). The kernel
/// refuses such a window too (`cget_short`, as an out-of-window get naming
/// CGET).
pub(crate) fn check_cget(
    cfg: &crate::Config,
    rank: usize,
    l: usize,
    bytes: usize,
    direct: &[bool],
) -> Result<(), EpError> {
    let rows = bytes / (cfg.channels * 2 * cfg.hidden).max(1);
    if fetches_rows(rank, l, direct) && rows < l {
        return Err(EpError::Config {
            rank,
            field: "CGET rows per channel",
            value: rows,
            why: "at least one per rank of the host where a same-host peer's combine rows \
                  are fetched by get",
        });
    }
    Ok(())
}

/// Checks that NSEND (`nsend` bytes here) holds this rank's notify row and
/// NRECV (`nrecv` bytes) both halves' rows of every rank (`2 × r` rows): the
/// notify kernel alternates between the halves and copies this round's into
/// the pinned rows the host reads, and `ep_ht_layout` writes the row into
/// NSEND. `ht::resources` sizes them so; a shorter window would leave the
/// host an earlier round's rows. The kernels refuse such windows too (the
/// notify kernel as an out-of-window failure naming NRECV before anything is
/// sent; `ep_ht_layout` by writing no row and a refusal naming no entry).
pub(crate) fn check_notify_windows(
    s: &Shape,
    rank: usize,
    nsend: usize,
    nrecv: usize,
) -> Result<(), EpError> {
    let width = 4 * s.row_words();
    if nsend < width {
        return Err(EpError::Config {
            rank,
            field: "NSEND bytes",
            value: nsend,
            why: "at least one notify row (4 × row words)",
        });
    }
    if nrecv < 2 * s.r * width {
        return Err(EpError::Config {
            rank,
            field: "NRECV bytes",
            value: nrecv,
            why: "at least two notify rows (4 × row words) per rank: the count exchange's two halves",
        });
    }
    Ok(())
}

/// Row pointers one batch of ht.cu's combine holds (`MAX_ROWS`): a
/// forwarder's sum of a token reads one row per rank of its host and one
/// per host, so a job with more than this many of them together could never
/// fit one token's rows in a batch, and is refused at `CudaBuffer::new`.
pub(crate) const MAX_ROWS: usize = 320;

/// Device memory of a high-throughput CUDA buffer beside its windows.
#[derive(Debug)]
pub(crate) struct HtState {
    pub(crate) s: Shape,
    /// The shape words (written once).
    shape: DevMem,
    /// The step's plan ([`Plan::tables`]), which the notify kernel builds
    /// from the rows, then one word: 1 where the rows refuse the step (the
    /// dispatch kernel then sends nothing).
    tables: DevMem,
    /// `u64[chans × signals]`: per context, the value of each signal
    /// accounted for (the kernels advance it).
    seen: DevMem,
    /// `u64[chans × lane_words]`: the kernels' per-channel scratch, where
    /// a block's shared memory cannot hold it (ht.cu's `lane_of`).
    lane: DevMem,
    /// `u32[r × t × l]`: where each forwarded token is held (dispatch to
    /// combine).
    contrib: DevMem,
    /// `u32[r]`: 1 where this rank reads that rank's combine rows in place.
    direct: DevMem,
    /// Count exchanges so far (their rows alternate between two halves).
    rounds: u64,
    /// Tokens this rank received in the latest dispatch, as read back and
    /// checked here: what `ht_echo` launches over, whatever handle it is
    /// given (a handle of another buffer must not size a kernel here).
    received: usize,
    /// `u64[6]`: the launch clocks of a step (`[earliest start, latest
    /// end]` of the notify kernel, of the dispatch kernel, then of
    /// `ep_ht_layout` where it ran), reset together before the exchange and
    /// read together after the dispatch kernel: no clock is copied between
    /// the two. The dispatch's clock runs from the exchange's start (the
    /// layout kernel's, where it ran) to the dispatch kernel's end; the
    /// pairs apart give `GIN_DEBUG=gin_ep=debug`'s GPU timeline of a step.
    clocks: DevMem,
    /// The rows of a count exchange (`r × row words` u32), then the notify
    /// kernel's verdict on them (the word after the plan in `tables`),
    /// copied by the notify kernel from NRECV into pinned host memory,
    /// which the host reads after the dispatch kernel without a copy of its
    /// own.
    rows: HostMem,
    /// FP8: the step's BF16 tokens (`t × hidden` u16), uploaded beside the
    /// notify kernel and quantised into XIN by `ep_ht_quantize`.
    xbf: Option<DevMem>,
    /// Pinned host staging ([`Pinned`]) of the routing of host inputs and
    /// of every step's slots, which `ep_ht_stage_meta` reads to write MIN.
    pinned: HostMem,
    /// A non-blocking stream of the buffer's own for what is staged beside
    /// the notify kernel on gin's stream ([`CudaBuffer::ht_stage`]: the
    /// metadata, and from GPU memory the tokens' copy into XIN where one is
    /// needed, or their FP8 quantisation); waited for after the notify.
    copy: Stream,
    /// The latest dispatch's plan (for [`CudaBuffer::ht_read_back`]).
    plan: Option<Plan>,
    /// `u64[2]`: `ep_ht_layout`'s smallest key of a bad entry (`!0`: none)
    /// and its finished blocks; the kernel's last block resets both. Only
    /// the kernel writes it after creation.
    lay_rec: DevMem,
    /// What `ep_ht_layout` leaves for the host ([`LayoutOut`]), in pinned
    /// host memory: read after the notify kernel, queued after it on the
    /// same stream, was waited for.
    lay_out: HostMem,
}

impl HtState {
    /// `direct[p]`: whether this rank reads `p`'s combine rows in place.
    pub(crate) fn new(
        s: Shape,
        rank: usize,
        cfg: &crate::Config,
        direct: &[bool],
    ) -> Result<Self, CoreError> {
        let zeroed = |bytes: usize| -> Result<DevMem, CoreError> {
            let m = DevMem::new(bytes.max(16))?;
            m.zero_wait(0, m.len())?;
            Ok(m)
        };
        let lexp = cfg.local_experts(s.r);
        let shape = zeroed(4 * plan_shape_len())?;
        shape.write(0, &shape_words(&s, rank, cfg.hidden, lexp, cfg.fp8))?;
        let d = zeroed(4 * s.r)?;
        let dw: Vec<u32> = direct.iter().map(|&b| u32::from(b)).collect();
        d.write(0, &dw)?;
        Ok(Self {
            shape,
            tables: zeroed(4 * (TableAt::of(s.r, s.h, s.chans).words + 1))?,
            seen: zeroed(8 * s.chans * s.signals() as usize)?,
            lane: zeroed(8 * s.chans * lane_words(&s))?,
            contrib: zeroed(4 * s.r * s.t * s.l)?,
            direct: d,
            rounds: 0,
            received: 0,
            clocks: zeroed(48)?,
            rows: HostMem::new(4 * (s.r * s.row_words() + 1))?,
            xbf: if cfg.fp8 {
                Some(zeroed(2 * s.t * cfg.hidden)?)
            } else {
                None
            },
            pinned: HostMem::new(Pinned::of(&s).bytes)?,
            copy: Stream::new()?,
            plan: None,
            lay_rec: {
                let m = DevMem::new(16)?;
                m.write(0, &[u64::MAX, 0])?;
                m
            },
            lay_out: HostMem::new(8 * LayoutOut::WORDS)?,
            s,
        })
    }
}

fn plan_shape_len() -> usize {
    SHAPE_WORDS.len()
}

/// Whether handle `s` is the step under way (`step` here; `here`: the
/// blocks by source its plan gave this rank and the tokens it dispatched,
/// `None` where no dispatch from GPU memory holds a plan, as after a
/// dispatch from host memory or a combine). A handle of another buffer at
/// the same step number, or of a step whose plan is gone, is refused
/// ([`EpError::Mode`]), naming the handle and what differs.
pub(crate) fn own_step(
    rank: usize,
    call: &'static str,
    s: &CudaHtStep,
    step: u64,
    here: Option<(&[u32], usize)>,
) -> Result<(), EpError> {
    let refuse = |why: String| EpError::Mode {
        rank,
        what: format!(
            "{call}: the handle of step {} ({} tokens dispatched, {} received) is not this \
             buffer's step: {why}",
            s.step,
            s.tokens,
            s.received()
        ),
    };
    let Some((prefix, tokens)) = here else {
        return Err(refuse(format!(
            "step {step} here holds no plan of a dispatch from GPU memory"
        )));
    };
    if s.recv_prefix != prefix {
        return Err(refuse(format!(
            "its blocks by source start at {:?}, this buffer's at {prefix:?}",
            s.recv_prefix
        )));
    }
    if s.tokens != tokens {
        return Err(refuse(format!("this buffer dispatched {tokens} tokens")));
    }
    Ok(())
}

/// What a CUDA rank received in one high-throughput dispatch: the blocks by
/// source, each token's index at its source and weight for this rank's
/// experts (read back from GPU memory and checked); the payloads stay there
/// ([`CudaBuffer::ht_received`] copies them back).
#[derive(Debug, Clone)]
pub struct CudaHtDispatch {
    step: u64,
    tokens: usize,
    nranks: usize,
    plan: Plan,
    recv_prefix: Vec<u32>,
    src_token: Vec<u32>,
    local_weight: Vec<f32>,
    expert_counts: Vec<u32>,
}

impl CudaHtDispatch {
    /// Tokens received from `src` (one contiguous block, in the source's
    /// token order).
    pub fn count(&self, src: usize) -> usize {
        (self.recv_prefix[src + 1] - self.recv_prefix[src]) as usize
    }
    /// Tokens received in all.
    pub fn received(&self) -> usize {
        self.src_token.len()
    }
    /// Where `src`'s block starts among the received tokens.
    pub fn block_start(&self, src: usize) -> usize {
        self.recv_prefix[src] as usize
    }
    /// The index at its source of received token `j`.
    pub fn src_token(&self, j: usize) -> usize {
        self.src_token[j] as usize
    }
    /// The sum of received token `j`'s weights for this rank's experts.
    pub fn local_weight(&self, j: usize) -> f32 {
        self.local_weight[j]
    }
    /// Received tokens that name local expert `le`.
    pub fn expert_count(&self, le: usize) -> usize {
        self.expert_counts[le] as usize
    }
    /// Tokens this rank dispatched.
    pub fn tokens(&self) -> usize {
        self.tokens
    }
    /// The job's count matrix: tokens from `src` to `dst`.
    pub fn tokens_between(&self, src: usize, dst: usize) -> usize {
        self.plan.count(src, dst) as usize
    }
    /// Ranks of the job.
    pub fn nranks(&self) -> usize {
        self.nranks
    }
}

/// A CUDA high-throughput dispatch with its payloads copied back, for the
/// oracle ([`crate::oracle::check_ht_view`]).
#[derive(Debug, Clone)]
pub struct HtReceived {
    d: CudaHtDispatch,
    payload: usize,
    data: Vec<u8>,
}

impl HtView for HtReceived {
    fn count(&self, src: usize) -> usize {
        self.d.count(src)
    }
    fn block_start(&self, src: usize) -> usize {
        self.d.block_start(src)
    }
    fn received(&self) -> usize {
        self.d.received()
    }
    fn src_token(&self, j: usize) -> usize {
        self.d.src_token(j)
    }
    fn local_weight(&self, j: usize) -> f32 {
        self.d.local_weight(j)
    }
    fn expert_count(&self, le: usize) -> usize {
        self.d.expert_count(le)
    }
    fn payload(&self, j: usize) -> Result<&[u8], String> {
        self.data
            .get(j * self.payload..(j + 1) * self.payload)
            .ok_or_else(|| format!("no received token {j} ({} received)", self.d.received()))
    }
}

/// What a count exchange brought ([`notify_rows`]).
#[derive(Debug)]
pub(crate) enum Rows {
    /// Every active rank's row, checked.
    Taken(Vec<Option<Vec<u32>>>),
    /// An active rank refused its own inputs this step (its row is
    /// [`plan::refused_row`]): that rank's [`EpError::PeerRefused`], naming
    /// it. Nothing moves on any rank: every rank's count exchange has
    /// completed, no plan is built and no token is sent, so every buffer
    /// stays usable for the next step.
    Refused(EpError),
}

/// The rows of a count exchange (`parity`'s half of NRECV, `width` bytes
/// each) as the plan takes them: every active rank's, checked (its counts
/// fit the buffer; its active mask is this rank's: a mask applied
/// differently is refused naming the rank). A refused row (the lowest
/// such rank's) comes first: [`Rows::Refused`].
pub(crate) fn notify_rows(
    s: &Shape,
    rank: usize,
    active: &[bool],
    raw: &[u8],
) -> Result<Rows, EpError> {
    let width = 4 * s.row_words();
    let row_of = |src: usize| -> Vec<u32> {
        raw.get(src * width..(src + 1) * width)
            .unwrap_or(&[])
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    if let Some(src) = (0..s.r).find(|&p| active[p] && plan::is_refused(s, &row_of(p))) {
        return Ok(Rows::Refused(plan::refused_by(rank, src)));
    }
    let mut rows = vec![None; s.r];
    for (src, slot) in rows.iter_mut().enumerate() {
        if !active[src] {
            continue;
        }
        let words = row_of(src);
        plan::check_row(s, rank, src, &words)?;
        for (p, &a) in active.iter().enumerate() {
            if (words[p / 32] >> (p % 32) & 1 == 1) != a {
                return Err(EpError::Protocol {
                    rank,
                    peer: src,
                    what: format!(
                        "its active mask says rank {p} is {}, here it is {} (set_active must be applied alike on every rank)",
                        if a { "masked" } else { "active" },
                        if a { "active" } else { "masked" }
                    ),
                });
            }
        }
        *slot = Some(words);
    }
    Ok(Rows::Taken(rows))
}

/// Where the pinned staging (`HtState`'s `pinned`, host memory mapped for
/// the GPU) holds each part, in bytes, for up to `t` tokens: the top-k ids
/// (i64, `t × k`) and weights (f32, `t × k`) of host inputs, then every
/// step's host and rank slots (u32, `t × h` and `t × r`: the layout's
/// [`Layout::host_slot`] and [`Layout::rank_slot`]), which
/// `ep_ht_stage_meta` reads to write the metadata into MIN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pinned {
    pub(crate) idx: usize,
    pub(crate) weights: usize,
    pub(crate) host_slot: usize,
    pub(crate) rank_slot: usize,
    pub(crate) bytes: usize,
}

impl Pinned {
    pub(crate) fn of(s: &Shape) -> Self {
        let weights = 8 * s.t * s.k;
        let host_slot = weights + 4 * s.t * s.k;
        let rank_slot = host_slot + 4 * s.t * s.h;
        Self {
            idx: 0,
            weights,
            host_slot,
            rank_slot,
            bytes: rank_slot + 4 * s.t * s.r,
        }
    }
}

/// What `ep_ht_layout` leaves in pinned host memory for the host (u64
/// words; ht.cu's `LO_*`): whether this rank's notify row went out refused,
/// the first bad entry's key (`!0`: none) and its four error words, as
/// [`super::decode_error`] reads them (the host checks' error, naming the
/// entry).
pub(crate) struct LayoutOut;

impl LayoutOut {
    pub(crate) const REFUSED: usize = 0;
    pub(crate) const KEY: usize = 1;
    pub(crate) const ERR: usize = 2;
    pub(crate) const WORDS: usize = 6;

    /// This rank's own error where the words `w` say its row went out
    /// refused (`None`: it did not): the first bad entry, named as the
    /// host's checks name it; a refusal naming none (sizes beyond the
    /// buffer's, which the host checked before the launch) says so.
    pub(crate) fn refusal(rank: usize, cfg: &crate::Config, w: &[u64]) -> Option<EpError> {
        if w.get(Self::REFUSED).copied().unwrap_or(0) == 0 {
            return None;
        }
        let mut e = [0u64; 4];
        for (i, v) in e.iter_mut().enumerate() {
            *v = w.get(Self::ERR + i).copied().unwrap_or(0);
        }
        Some(
            super::decode_error(rank, cfg, e).unwrap_or_else(|| EpError::Mode {
                rank,
                what: format!(
                    "ep_ht_layout refused this rank's inputs without naming an entry (key {:#x}): \
                     its sizes and the buffer's differ",
                    w.get(Self::KEY).copied().unwrap_or(0)
                ),
            }),
        )
    }
}

/// Copies `data` into the pinned staging `m` at byte `off`; refused
/// (naming `what`) where it would not fit. `&mut` keeps every other host
/// access out; the caller keeps the GPU's out (the stream that reads it
/// waited for first: [`CudaBuffer::ht_stage`]).
fn to_pinned<T: Copy>(
    rank: usize,
    m: &mut HostMem,
    what: &str,
    off: usize,
    data: &[T],
) -> Result<(), EpError> {
    let n = std::mem::size_of_val(data);
    if off.checked_add(n).is_none_or(|end| end > m.len()) {
        return Err(EpError::Mode {
            rank,
            what: format!(
                "high-throughput staging: {what} ({n} bytes at {off}) exceeds the pinned staging's {} bytes",
                m.len()
            ),
        });
    }
    // SAFETY: `off + n` bytes lie within the allocation (checked above);
    // `data` is valid for `n` bytes and is not in it (a caller's slice or
    // the layout's vectors); no other host access (`&mut`), and no GPU
    // work reads the allocation until it is queued after this write.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr().cast::<u8>(), m.host_ptr().add(off), n) };
    Ok(())
}

/// The first `n` bytes of the pinned memory `m` (refused where it holds
/// fewer), which a launch that has finished wrote (the notify kernel's
/// rows); `&HostMem` with no GPU work writing it: the caller waited for the
/// launch, and the next one that writes it is queued by this thread later.
fn from_pinned(rank: usize, m: &HostMem, n: usize) -> Result<Vec<u8>, EpError> {
    if n > m.len() {
        return Err(EpError::Mode {
            rank,
            what: format!(
                "high-throughput rows: {n} bytes exceed the pinned rows' {} bytes",
                m.len()
            ),
        });
    }
    let mut v = vec![0u8; n];
    // SAFETY: `n` bytes lie within the allocation (checked above) and `v`
    // holds `n`; no GPU work writes the allocation meanwhile (the launch
    // that wrote it has finished, the next is not queued yet), so a plain
    // copy reads what it wrote.
    unsafe { std::ptr::copy_nonoverlapping(m.host_ptr(), v.as_mut_ptr(), n) };
    Ok(v)
}

/// How a step's count exchange ended for this rank.
enum Notified {
    /// Every active rank's row was taken: the step's plan.
    Plan(Plan),
    /// A peer refused its inputs ([`Rows::Refused`]): its error. Nothing
    /// moved; the buffer stays usable.
    Refused(EpError),
}

/// Where a step's inputs come from.
#[derive(Clone, Copy)]
pub(crate) enum Tokens<'a> {
    /// The caller's host slices: the tokens (`tokens × hidden`), uploaded
    /// in one copy beside the notify kernel ([`HostUpload`]); the top-k ids
    /// and weights, staged in pinned memory for `ep_ht_stage_meta`; and
    /// their layout, computed and checked on the host (the notify row, the
    /// slots staged beside the ids).
    Host(&'a [Bf16], &'a [i64], &'a [f32], &'a Layout),
    /// The caller's device memory (sizes and alignments checked by
    /// [`check_device_inputs`]): BF16 payloads are read in place by the
    /// dispatch kernel (or copied into XIN where a destination may be
    /// queued), FP8 ones quantised from it by `ep_ht_quantize`; the top-k
    /// ids and weights are checked and laid out where they are by
    /// `ep_ht_layout`, which writes the notify row and the metadata.
    Device(&'a DeviceInputs<'a>),
}

/// Where this rank's notify row comes from.
#[derive(Clone, Copy)]
enum Row<'a> {
    /// Computed on the host (host inputs' layout, or a refused row),
    /// written into NSEND before the notify kernel.
    Host(&'a [u32]),
    /// Written by `ep_ht_layout` from the caller's routing in GPU memory,
    /// queued right before the notify kernel on gin's stream.
    Device(&'a DeviceInputs<'a>),
}

/// The upload of host inputs' tokens, on a thread of its own while the
/// notify kernel exchanges the counts: one copy from the caller's slice
/// (the tokens are not copied on the host first) into XIN, or with FP8 the
/// BF16 staging `ep_ht_quantize` reads.
pub(crate) struct HostUpload<'a> {
    pub(crate) x: &'a [Bf16],
    pub(crate) dst: &'a DevMem,
}

impl HostUpload<'_> {
    /// Uploads the tokens with `dev` current on this thread.
    pub(crate) fn upload(&self, dev: &Device) -> Result<(), CoreError> {
        let t0 = std::time::Instant::now();
        dev.make_current()?;
        let r = self.dst.write(0, bf16_bytes(self.x));
        tracing::debug!(
            bytes = 2 * self.x.len(),
            written_us = t0.elapsed().as_secs_f64() * 1e6,
            "high-throughput upload of host tokens beside the notify kernel, from its thread's start"
        );
        Ok(r?)
    }
}

/// Where the dispatch kernel reads this step's payloads: XIN, or the
/// caller's BF16 tokens in place (`ep_ht_dispatch`'s `x`, `xbytes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Payloads {
    /// Staged in XIN (host inputs, FP8, or a peer that may be queued).
    Xin,
    /// In place: `bytes` bytes at device address `ptr`.
    InPlace { ptr: u64, bytes: u64 },
}

/// Whether a dispatch from rank `me` may put its payloads to a peer that
/// is not reached by load/store (`lsa[p]`): any other active rank (which of
/// them receive or forward this rank's tokens, the layout on the GPU and
/// the plan say, neither known on the host before the copy is queued
/// beside the count exchange). Such a put (proxy, GDAKI) reads XIN as a
/// window, so the tokens must be there; puts to load/store peers read them
/// in place.
pub(crate) fn queued_destination(
    s: &Shape,
    me: usize,
    active: &[bool],
    lsa: impl Fn(usize) -> bool,
) -> bool {
    (0..s.r).any(|p| p != me && active[p] && !lsa(p))
}

impl CudaBuffer<'_, '_> {
    fn ht_state(&self, call: &'static str) -> Result<&HtState, EpError> {
        super::steps::expect_mode(self.rank, call, Mode::HighThroughput, self.cfg.mode)?;
        self.ht.as_ref().ok_or(EpError::Mode {
            rank: self.rank,
            what: format!("{call}: the buffer holds no high-throughput state"),
        })
    }

    fn ht_functions(&self) -> Result<&HtFunctions, EpError> {
        self.kernels.ht.as_ref().ok_or(EpError::Mode {
            rank: self.rank,
            what: "the high-throughput kernels are not loaded".into(),
        })
    }

    /// The twelve windows, as every high-throughput kernel takes them.
    fn ht_windows(&self) -> Vec<Arg<'_>> {
        self.wins.iter().map(|w| Arg::Window(w.abi())).collect()
    }

    /// High-throughput dispatch on CUDA ranks from host memory: checks the
    /// inputs, exchanges the counts (the notify kernel), builds the step's
    /// plan from every rank's row, stages the tokens and runs the dispatch
    /// kernel: between hosts each token goes only to the rank with this
    /// rank's local index (into its final place there or through the
    /// channel's ring, within credits), within a host tokens are forwarded
    /// over load/store where mapped. Every wait is bounded by the job
    /// timeout and names the peer; the received tokens' metadata is read
    /// back and checked.
    ///
    /// Inputs refused by the checks (their error names the entry) still
    /// take part in the count exchange with a refused row, so that every
    /// peer's dispatch returns at once with [`EpError::PeerRefused`] naming
    /// this rank; no rank sends a token, and every buffer stays usable for
    /// the next step ([`CudaBuffer::ht_dispatch_device`] alike). Like every
    /// step, the dispatch is collective: every active rank calls it.
    pub fn ht_dispatch(
        &mut self,
        x: &[Bf16],
        topk_idx: &[i64],
        topk_weights: &[f32],
    ) -> Result<CudaHtDispatch, EpError> {
        const CALL: &str = "ht_dispatch";
        self.ht_state(CALL)?;
        self.st.idle(CALL)?;
        self.expect_unqueued(CALL)?;
        self.poll()?;
        let cfg = self.cfg;
        let s = self.ht_state(CALL)?.s;
        self.ht_forget_plan();
        let lay = crate::ll::check_inputs(
            self.rank,
            &cfg,
            &self.active,
            s.l,
            x.len(),
            topk_idx,
            topk_weights,
        )
        .and_then(|lay| self.current().map(|()| lay));
        let lay = match lay {
            Ok(lay) => lay,
            Err(e) => return Err(self.ht_refuse(&s, e)),
        };
        self.st.begin(lay.tokens);
        let x = Tokens::Host(x, topk_idx, topk_weights, &lay);
        match self.ht_dispatch_steps(&s, lay.tokens, x) {
            Ok(Notified::Plan(plan)) => {
                let r = self.ht_read_dispatch(&s, plan);
                if r.is_err() {
                    self.st.fail();
                }
                r
            }
            Ok(Notified::Refused(e)) => Err(e),
            Err(e) => {
                self.st.fail();
                Err(e)
            }
        }
    }

    /// High-throughput dispatch from inputs in GPU memory (DeepEP's
    /// normal-mode `dispatch` on tensors on the GPU; [`DeviceInputs`], as
    /// [`CudaBuffer::ll_dispatch_device`] takes them): the tokens are read
    /// from the caller's `x` on the GPU, never through the host: BF16 ones
    /// in place by the dispatch kernel's puts to load/store peers (copied
    /// into the send window beside the count exchange only where a peer may
    /// be reached through a queue: proxy, GDAKI), FP8 ones quantised from
    /// it by `ep_ht_quantize` beside the count exchange. The inputs must be
    /// complete when it is called, and unchanged until it returns: their
    /// producer's stream synchronised (the kernels run on gin's and the
    /// buffer's own streams, not ordered after the caller's).
    ///
    /// The routing does not go through the host before the count exchange:
    /// `ep_ht_layout`, queued on gin's stream right before the notify
    /// kernel, checks every top-k entry where it is as the host path does
    /// (an expert out of range or named twice, a live slot's weight that is
    /// not finite; a masked rank's slots count as empty), writes this
    /// rank's notify row and every token's metadata with its slots (the
    /// host path's layout, bit for bit). A bad entry sends the refused
    /// row instead, so that every peer's dispatch returns at once with
    /// [`EpError::PeerRefused`] naming this rank, and this rank returns the
    /// error the host's checks would name (the first bad entry); a size or
    /// alignment the buffer refuses is found on the host first and ends the
    /// step alike. No rank then sends a token, and every buffer stays usable
    /// for the next step. Otherwise the notify kernel builds the step's
    /// plan from every rank's row on the GPU and the dispatch kernel,
    /// queued right after it, follows it (no host step between the count
    /// exchange and the dispatch, where DeepEP's notify step synchronises
    /// with the host for the counts); the host reads the rows back after
    /// the dispatch kernel and builds the same plan. The step runs as
    /// [`CudaBuffer::ht_dispatch`]'s, bit for bit, and what was received
    /// stays in GPU memory ([`CudaBuffer::ht_recv_tokens`],
    /// [`CudaBuffer::ht_recv_meta`], laid out as [`HtDeviceLayout`] says)
    /// for the caller's expert kernel, which writes
    /// [`CudaBuffer::ht_combine_rows`]; [`CudaBuffer::ht_read_back`] copies
    /// the metadata to the host for checks. On gin's stream, returning when
    /// the dispatch kernel has finished.
    pub fn ht_dispatch_device(&mut self, inp: &DeviceInputs<'_>) -> Result<CudaHtStep, EpError> {
        const CALL: &str = "ht_dispatch_device";
        self.ht_state(CALL)?;
        self.st.idle(CALL)?;
        self.expect_unqueued(CALL)?;
        self.poll()?;
        let s = self.ht_state(CALL)?.s;
        self.ht_forget_plan();
        let (cfg, rank) = (self.cfg, self.rank);
        let checked = check_device_inputs(
            rank,
            &cfg,
            inp.tokens,
            inp.x.into(),
            inp.topk_idx.into(),
            inp.topk_weights.into(),
        )
        .and_then(|()| self.current());
        match checked {
            Ok(()) => self.ht_device_steps(&s, inp),
            Err(e) => Err(self.ht_refuse(&s, e)),
        }
    }

    /// [`CudaBuffer::ht_dispatch_device`] after the host's checks of the
    /// inputs' sizes: the step.
    fn ht_device_steps(
        &mut self,
        s: &Shape,
        inp: &DeviceInputs<'_>,
    ) -> Result<CudaHtStep, EpError> {
        self.st.begin(inp.tokens);
        let plan = match self.ht_dispatch_steps(s, inp.tokens, Tokens::Device(inp)) {
            Ok(Notified::Plan(p)) => p,
            Ok(Notified::Refused(e)) => return Err(e),
            Err(e) => {
                self.st.fail();
                return Err(e);
            }
        };
        let recv_prefix = plan.recv_prefix(self.rank).to_vec();
        let received = recv_prefix[s.r] as usize;
        if let Some(h) = self.ht.as_mut() {
            h.received = received;
            h.plan = Some(plan);
        }
        Ok(CudaHtStep {
            step: self.st.step,
            tokens: inp.tokens,
            recv_prefix,
        })
    }

    /// A dispatch starts: no plan of an earlier step is left for a stale
    /// or foreign handle to read ([`CudaBuffer::ht_read_back`]).
    fn ht_forget_plan(&mut self) {
        if let Some(h) = self.ht.as_mut() {
            h.plan = None;
        }
    }

    /// This rank's inputs were refused (`err`): it still takes part in the
    /// step's count exchange, with [`plan::refused_row`], so that each peer
    /// ends the step at once with an error naming this rank (every peer
    /// waits for every active rank's row); nothing else is sent, and the
    /// buffer stays usable. Returns `err`, or where the exchange itself
    /// failed its error (the buffer then refuses further steps).
    fn ht_refuse(&mut self, s: &Shape, err: EpError) -> EpError {
        self.st.begin(0);
        let row = plan::refused_row(s, &self.active);
        let r = self
            .current()
            .and_then(|()| self.ht_exchange(s, Row::Host(&row), None, On::Wait));
        match r {
            Ok(()) => {
                self.ht_exchanged();
                err
            }
            Err(e) => {
                self.st.fail();
                e
            }
        }
    }

    /// The count exchange (with this step's staging beside it), FP8 host
    /// tokens' quantisation and the dispatch kernel, queued one after the
    /// other on gin's stream with no host step between them: the notify
    /// kernel builds the step's plan on the GPU from every rank's row and
    /// the dispatch kernel follows it, or sends nothing where the rows
    /// refuse the step. Then the host reads the rows and builds the same
    /// plan with the CPU ranks' code: the step's plan, or a refusal (a
    /// peer's, or of this rank's inputs on the GPU).
    fn ht_dispatch_steps(
        &mut self,
        s: &Shape,
        tokens: usize,
        x: Tokens<'_>,
    ) -> Result<Notified, EpError> {
        let t0 = std::time::Instant::now();
        let queued = self.ht_queue_and_dispatch(s, tokens, x);
        if queued.is_err() {
            // The notify kernel may still be queued or running (it reads
            // and writes only this buffer's memory, and its waits are
            // bounded by the job timeout): it ends before the error is
            // returned, so that nothing of the step runs on once the
            // caller learns of it (the buffer then refuses further steps).
            // Its own error, if any, is the one already in hand.
            let _ = self.gin_stream().sync();
        }
        let (notified, quantised, payloads) = queued?;
        let dispatched = t0.elapsed();
        // The exchange has completed (the dispatch kernel follows it on
        // gin's stream and was waited for without an error).
        self.ht_exchanged();
        let notified_rows = self.ht_rows(s, x)?;
        let us = |d: std::time::Duration| d.as_secs_f64() * 1e6;
        tracing::debug!(
            rank = self.rank,
            queued_us = us(notified),
            quantised_us = us(quantised),
            dispatched_us = us(dispatched),
            planned_us = us(t0.elapsed()),
            in_place = matches!(payloads, Payloads::InPlace { .. }),
            on_gpu = matches!(x, Tokens::Device(_)),
            "high-throughput dispatch on the host, from the staging's start: the exchange queued, the dispatch kernel's end, the host's plan"
        );
        if let Notified::Plan(_) = notified_rows {
            self.st.dispatched_now();
        }
        Ok(notified_rows)
    }

    /// [`CudaBuffer::ht_dispatch_steps`]' launches: the count exchange
    /// queued, FP8 host tokens' quantisation queued after it, the dispatch
    /// kernel waited for; how long the first two took from `t0`, and where
    /// the payloads were read.
    fn ht_queue_and_dispatch(
        &mut self,
        s: &Shape,
        tokens: usize,
        x: Tokens<'_>,
    ) -> Result<(std::time::Duration, std::time::Duration, Payloads), EpError> {
        let t0 = std::time::Instant::now();
        let payloads = self.ht_notify(s, tokens, x)?;
        let notified = t0.elapsed();
        if let (true, Tokens::Host(..)) = (self.cfg.fp8, x) {
            let xbf = self.ht_state("ht_dispatch")?.xbf.as_ref().map(DevMem::ptr);
            let xbf = xbf.ok_or(EpError::Mode {
                rank: self.rank,
                what: "an FP8 buffer without its BF16 staging".into(),
            })?;
            // SAFETY: HtState::xbf holds t × hidden u16 (tokens ≤ t),
            // uploaded beside the notify kernel (the upload was waited for,
            // the notify kernel is queued before this launch); the launch is
            // queued on gin's stream before the dispatch kernel, which is
            // waited for before the staging is written again.
            unsafe { self.ht_quantize(s, tokens, xbf, On::Queue(self.gin_stream()))? };
        }
        let quantised = t0.elapsed();
        self.ht_launch_dispatch(s, tokens, payloads)?;
        Ok((notified, quantised, payloads))
    }

    /// The count exchange: this rank's row to every active rank (the notify
    /// kernel, queued on gin's stream where every active peer is reached
    /// by load/store, else waited for; from GPU memory written by
    /// `ep_ht_layout` just before it there), which builds the step's plan
    /// on the GPU; returns where the dispatch kernel reads the payloads.
    /// This step's staging is queued on the copy stream first
    /// ([`CudaBuffer::ht_stage`]) and runs beside the notify kernel, as
    /// does the upload of host inputs' tokens (a thread of its own:
    /// [`HostUpload`]); both are waited for before this returns, whatever
    /// happened (they read the caller's inputs, borrowed only for the
    /// call). The notify kernel is not waited for: the dispatch kernel,
    /// queued after it, is.
    fn ht_notify(&mut self, s: &Shape, tokens: usize, x: Tokens<'_>) -> Result<Payloads, EpError> {
        use crate::ht::plan::XIN;
        let host_row = match x {
            Tokens::Host(.., lay) => Some(plan::notify_row(s, lay, &self.active)),
            Tokens::Device(_) => None,
        };
        let row = match (&host_row, x) {
            (Some(row), _) => Row::Host(row),
            (None, Tokens::Device(inp)) => Row::Device(inp),
            (None, Tokens::Host(..)) => {
                return Err(EpError::Mode {
                    rank: self.rank,
                    what: "ht_dispatch: host inputs without their notify row".into(),
                });
            }
        };
        let t0 = std::time::Instant::now();
        let staged = self.ht_stage(s, tokens, x);
        let issued = t0.elapsed();
        let exchanged = match &staged {
            Ok(_) => {
                let st = self.ht_state("ht_dispatch")?;
                let up = match x {
                    Tokens::Host(xs, ..) if !xs.is_empty() => Some(HostUpload {
                        x: xs,
                        dst: st.xbf.as_ref().unwrap_or(self.wins[XIN].local()),
                    }),
                    _ => None,
                };
                // Queued, with the dispatch kernel queued behind it, only
                // where every active peer is reached by load/store. A peer
                // reached through a queue (the CUDA proxy, GDAKI) is served
                // by an engine's own CUDA streams, and under MPS (or with
                // few hardware work queues) the engine's copies can sit in
                // a hardware queue behind the dispatch kernel queued after
                // the notify kernel they serve: neither then ends until the
                // job timeout (seen on one H200: every 2-host CUDA step).
                // There the notify kernel is waited for, as before, and the
                // dispatch kernel launched after it.
                let on = if queued_destination(s, self.rank, &self.active, |p| self.dc.is_lsa(p)) {
                    On::Wait
                } else {
                    On::Queue(self.gin_stream())
                };
                Some(self.ht_exchange(s, row, up.as_ref(), on))
            }
            // Not run: the staging's error is returned below.
            Err(_) => None,
        };
        let notified = t0.elapsed();
        let synced = self.ht_state("ht_dispatch")?.copy.sync();
        tracing::debug!(
            rank = self.rank,
            issued_us = issued.as_secs_f64() * 1e6,
            notified_us = notified.as_secs_f64() * 1e6,
            synced_us = t0.elapsed().as_secs_f64() * 1e6,
            "high-throughput staging queued, the count exchange queued (and the upload's end), the staging's end, from the staging's start"
        );
        let payloads = staged?;
        let Some(exchanged) = exchanged else {
            return Err(EpError::Mode {
                rank: self.rank,
                what: "ht_dispatch: staged without a count exchange".into(),
            });
        };
        exchanged?;
        synced.map_err(CoreError::from)?;
        Ok(payloads)
    }

    /// After the dispatch kernel (which followed the count exchange): this
    /// rank's own refusal where `ep_ht_layout` refused its inputs from GPU
    /// memory, else every rank's row read back from the pinned rows and
    /// the step's plan built from them with the CPU ranks' code (or a
    /// peer's refusal, or a broken row's error). The notify kernel judged
    /// the same rows for the dispatch kernel; where its verdict differs
    /// from the host's, the step fails (`Protocol`): one of the two
    /// checks is wrong, and the tokens went by the GPU's.
    fn ht_rows(&self, s: &Shape, x: Tokens<'_>) -> Result<Notified, EpError> {
        let width = 4 * s.row_words();
        let raw = from_pinned(
            self.rank,
            &self.ht_state("ht_dispatch")?.rows,
            s.r * width + 4,
        )?;
        let gpu_refused = raw[s.r * width..] != [0u8; 4];
        let host_refused = |refused: bool| -> Result<(), EpError> {
            if refused == gpu_refused {
                return Ok(());
            }
            Err(EpError::Protocol {
                rank: self.rank,
                peer: self.rank,
                what: format!(
                    "the notify kernel {} the step's rows and the host {} them",
                    if gpu_refused { "refused" } else { "took" },
                    if refused { "refuses" } else { "takes" }
                ),
            })
        };
        if let Tokens::Device(_) = x
            && let Some(e) = self.ht_laid_out()?
        {
            // This rank's own row went out refused: its peers end the step
            // naming it, and it reports the entry, as ht_refuse does.
            host_refused(true)?;
            return Ok(Notified::Refused(e));
        }
        match notify_rows(s, self.rank, &self.active, &raw[..s.r * width]) {
            Ok(Rows::Taken(rows)) => {
                host_refused(false)?;
                Ok(Notified::Plan(Plan::new(s, self.active.clone(), &rows)))
            }
            Ok(Rows::Refused(e)) => {
                host_refused(true)?;
                Ok(Notified::Refused(e))
            }
            Err(e) => {
                host_refused(true)?;
                Err(e)
            }
        }
    }

    /// After a count exchange whose row `ep_ht_layout` wrote: this rank's
    /// own error where the kernel refused its inputs (its row went out
    /// refused), the first bad entry named as the host's checks name it;
    /// `None` where the row was real. The kernel ran before the notify
    /// kernel on gin's stream, which was waited for.
    fn ht_laid_out(&self) -> Result<Option<EpError>, EpError> {
        let st = self.ht_state("ht_dispatch_device")?;
        let mut w = [0u64; LayoutOut::WORDS];
        for (i, v) in w.iter_mut().enumerate() {
            *v = st
                .lay_out
                .atomic_u64(8 * i)
                .map_err(CoreError::from)?
                .load(std::sync::atomic::Ordering::Acquire);
        }
        Ok(LayoutOut::refusal(self.rank, &self.cfg, &w))
    }

    /// Queues on the buffer's copy stream what the dispatch kernel reads of
    /// this step's inputs beside what the count exchange writes, to run
    /// beside the notify kernel: for host inputs the metadata
    /// (`ep_ht_stage_meta` into MIN, from the top-k ids and weights and the
    /// layout's slots, staged in pinned memory); from GPU memory (whose
    /// metadata `ep_ht_layout` writes on gin's stream) the payloads: BF16
    /// read in place by the dispatch kernel unless a peer may be reached
    /// through a queue ([`queued_destination`]: then copied into XIN, which
    /// such a put reads as a window), FP8 quantised into XIN. Returns where
    /// the dispatch kernel reads the payloads. The caller waits for the
    /// copy stream before the dispatch kernel, and before it returns.
    fn ht_stage(&mut self, s: &Shape, tokens: usize, x: Tokens<'_>) -> Result<Payloads, EpError> {
        use crate::ht::plan::XIN;
        let rank = self.rank;
        let st = self.ht.as_mut().ok_or(EpError::Mode {
            rank,
            what: "ht_dispatch: the buffer holds no high-throughput state".into(),
        })?;
        // The previous step's staging has read the pinned memory and the
        // caller's inputs (every step waits for it; this is in case one did
        // not get there).
        st.copy.sync().map_err(CoreError::from)?;
        if tokens == 0 {
            return Ok(Payloads::Xin);
        }
        let inp = match x {
            Tokens::Host(_, idx, w, lay) => {
                self.ht_stage_host(s, tokens, idx, w, lay)?;
                return Ok(Payloads::Xin);
            }
            Tokens::Device(inp) => inp,
        };
        let st = self.ht_state("ht_dispatch_device")?;
        let copy = On::Queue(StreamRef::from(&st.copy));
        if self.cfg.fp8 {
            // SAFETY: the caller's x holds tokens × hidden u16
            // (check_device_inputs), borrowed until the copy stream is
            // waited for.
            unsafe { self.ht_quantize(s, tokens, inp.x.ptr(), copy)? };
            return Ok(Payloads::Xin);
        }
        let n = tokens * s.p;
        if queued_destination(s, rank, &self.active, |p| self.dc.is_lsa(p)) {
            // SAFETY: XIN holds t × p bytes (ht::resources) and x at least
            // tokens × hidden BF16 = tokens × p bytes (check_device_inputs;
            // tokens ≤ t); no kernel reads or writes XIN until the dispatch
            // kernel, launched after the copy stream was waited for; the
            // caller's x is borrowed until then.
            unsafe { st.copy.copy(self.wins[XIN].local().ptr(), inp.x.ptr(), n) }
                .map_err(CoreError::from)?;
            return Ok(Payloads::Xin);
        }
        Ok(Payloads::InPlace {
            ptr: inp.x.ptr(),
            bytes: n as u64,
        })
    }

    /// [`CudaBuffer::ht_stage`] for host inputs: their routing and the
    /// layout's slots into the pinned staging, and `ep_ht_stage_meta`
    /// queued on the copy stream (waited for by the caller).
    fn ht_stage_host(
        &mut self,
        s: &Shape,
        tokens: usize,
        idx: &[i64],
        w: &[f32],
        lay: &Layout,
    ) -> Result<(), EpError> {
        use crate::ht::plan::MIN;
        let rank = self.rank;
        let f = self.ht_functions()?.stage_meta;
        let grid = self.grid((tokens * s.mm / 4).div_ceil(super::THREADS as usize));
        let at = Pinned::of(s);
        let st = self.ht.as_mut().ok_or(EpError::Mode {
            rank,
            what: "ht_dispatch: the buffer holds no high-throughput state".into(),
        })?;
        to_pinned(
            rank,
            &mut st.pinned,
            "host slots",
            at.host_slot,
            &lay.host_slot,
        )?;
        to_pinned(
            rank,
            &mut st.pinned,
            "rank slots",
            at.rank_slot,
            &lay.rank_slot,
        )?;
        to_pinned(rank, &mut st.pinned, "top-k ids", at.idx, idx)?;
        to_pinned(rank, &mut st.pinned, "top-k weights", at.weights, w)?;
        let pinned = st.pinned.dev();
        let st = self.ht_state("ht_dispatch")?;
        let args = [
            Arg::Window(self.wins[MIN].abi()),
            Arg::Ptr(pinned + at.idx as u64),
            Arg::Ptr(pinned + at.weights as u64),
            Arg::Ptr(pinned + at.host_slot as u64),
            Arg::Ptr(pinned + at.rank_slot as u64),
            Arg::U32(Self::u32_of(tokens)),
            Arg::Ptr(st.shape.ptr()),
        ];
        let copy = On::Queue(StreamRef::from(&st.copy));
        // SAFETY: ep_ht_stage_meta(Window min, const i64* idx, const u32*
        // wbits, const u32* host_slot, const u32* rank_slot, u32 tokens,
        // const u32* shape) takes these in this order. It reads tokens × k
        // i64 and u32 of the routing and tokens × h and tokens × r u32 of
        // the slots in the pinned staging (Pinned::of's parts for t ≥
        // tokens tokens), the shape words, and writes tokens × mm bytes of
        // MIN (t × mm: ht::resources; the kernel checks it against MIN's
        // size). The pinned memory is not written again before the stream
        // is waited for (next step).
        unsafe { go(&self.dc, f, copy, grid, &args) }
            .map_err(|e| kernel_error(rank, "ht_stage_meta", e))
    }

    /// Queues `ep_ht_layout` on gin's stream (the notify kernel is launched
    /// right after it there): from the caller's top-k ids and weights in
    /// GPU memory, this rank's notify row into NSEND (refused where an
    /// entry is bad) and the tokens' metadata into MIN; what the host reads
    /// afterwards into [`HtState`]'s `lay_out`. `clock`: the layout
    /// kernel's own pair of the step's launch clocks, reset.
    fn ht_queue_layout(
        &self,
        s: &Shape,
        inp: &DeviceInputs<'_>,
        clock: u64,
    ) -> Result<(), EpError> {
        use crate::ht::plan::{MIN, NSEND};
        let st = self.ht_state("ht_dispatch_device")?;
        let f = self.ht_functions()?.layout;
        let args = [
            Arg::Window(self.wins[NSEND].abi()),
            Arg::Window(self.wins[MIN].abi()),
            Arg::Ptr(inp.topk_idx.ptr()),
            Arg::Ptr(inp.topk_weights.ptr()),
            Arg::U32(Self::u32_of(inp.tokens)),
            Arg::Ptr(st.shape.ptr()),
            Arg::Ptr(self.state.active.ptr()),
            Arg::Ptr(st.lay_rec.ptr()),
            Arg::Ptr(st.lay_out.dev()),
            Arg::Ptr(clock),
        ];
        // A block per destination (rank or host) lays out its tokens; the
        // blocks past the destinations write the metadata and check the
        // entries meanwhile (where there are none, every block does both):
        // a block per 64 tokens, up to the launch's limit (`blocks`, 32 by
        // default).
        let grid = self.grid((s.r + s.h).max(inp.tokens.div_ceil(64)));
        let gin = self.gin_stream();
        // SAFETY: ep_ht_layout(Window nsend, Window min, const i64* idx,
        // const u32* wbits, u32 tokens, const u32* shape, const u32*
        // active, u64* rec, u64* out, u64* clock) takes these in this
        // order. It reads tokens × k i64 and u32 of the caller's routing
        // (sizes checked by check_device_inputs, borrowed until this call's
        // caller has waited for gin's stream), the shape words and r u32 of
        // active, writes one notify row into NSEND (4 × row words: its size,
        // ht::resources) and tokens × mm bytes of MIN (t × mm; tokens ≤ t
        // checked; the kernel checks both sizes too), the two u64 of
        // lay_rec and LayoutOut::WORDS u64 of lay_out (pinned, mapped,
        // read by the host only after the wait), clock 2 u64. Nothing else
        // touches NSEND or MIN until the notify and dispatch kernels,
        // queued after it on gin's stream.
        unsafe { go(&self.dc, f, On::Queue(gin), grid, &args) }
            .map_err(|e| kernel_error(self.rank, "ht_layout", e))
    }

    /// Runs the notify kernel with this rank's notify row (`row`: written
    /// by the host, or by `ep_ht_layout` queued right before it) and,
    /// where given, the upload of host inputs' tokens beside it (a thread
    /// of its own); every rank's row is then in [`HtState`]'s pinned
    /// `rows`, followed by the notify kernel's verdict on them, and the
    /// step's plan in `tables`. The step's six launch clocks are reset
    /// first (the notify kernel's, the dispatch kernel's and the layout
    /// kernel's pairs, read after the dispatch kernel). `on`: waited for
    /// (a refused step, which launches nothing after it), or queued on
    /// gin's stream for the dispatch kernel to follow. Once it has run,
    /// the caller calls [`CudaBuffer::ht_exchanged`].
    fn ht_exchange(
        &self,
        s: &Shape,
        row: Row<'_>,
        up: Option<&HostUpload<'_>>,
        on: On<'_>,
    ) -> Result<(), EpError> {
        use crate::ht::plan::NSEND;
        let width = 4 * s.row_words();
        let st = self.ht_state("ht_dispatch")?;
        let parity = (st.rounds % 2) as usize;
        let (shape, seen, rows) = (st.shape.ptr(), st.seen.ptr(), st.rows.dev());
        let tables = st.tables.ptr();
        st.clocks
            .write(0, &[u64::MAX, 0, u64::MAX, 0, u64::MAX, 0])
            .map_err(CoreError::from)?;
        let clock = st.clocks.ptr();
        match row {
            Row::Host(row) => {
                let bytes: Vec<u8> = row.iter().flat_map(|v| v.to_le_bytes()).collect();
                self.wins[NSEND]
                    .local()
                    .write(0, &bytes)
                    .map_err(CoreError::from)?;
            }
            // The layout kernel's own pair (the last of the six).
            Row::Device(inp) => self.ht_queue_layout(s, inp, clock + 32)?,
        }
        let mut args = vec![Arg::DevComm(self.dc.abi())];
        args.extend(self.ht_windows());
        args.extend([
            Arg::U32(Self::u32_of(width)),
            Arg::U32(Self::u32_of(parity)),
            Arg::Ptr(shape),
            Arg::Ptr(self.state.active.ptr()),
            Arg::Ptr(seen),
            Arg::Ptr(clock),
            Arg::Ptr(rows),
            Arg::Ptr(tables),
        ]);
        let f = self.ht_functions()?.notify;
        let dev = self.cuda.device();
        // Beside the notify kernel the upload writes XIN (or the FP8
        // staging) on the legacy stream and waits for it: no kernel reads
        // them before the dispatch (or quantise) kernel, launched after.
        let t0 = std::time::Instant::now();
        let mut kernel_us = 0.0;
        let (r, helper) = std::thread::scope(|sc| {
            let helper = up.map(|up| {
                std::thread::Builder::new()
                    .name("gin-ep-upload".into())
                    .spawn_scoped(sc, move || {
                        // Its synchronous upload must not be refused while a
                        // user's thread captures a stream in global mode.
                        gin_core::cuda::RelaxedCapture::for_this_thread()?;
                        up.upload(dev)
                    })
            });
            // SAFETY: ep_ht_notify(DevComm, 12 Windows, u32 width, u32 parity,
            // const u32* shape, const u32* active, u64* seen, u64* clock, u32*
            // rows, u32* tables) takes these in this order. It puts `width`
            // bytes of NSEND (its size: ht::resources, 4 × row words) to each
            // active rank's NRECV at (parity × r + rank) × width (2 × r × width
            // bytes), reads shape (SHAPE_WORDS u32), active (r u32) and the
            // notify entries of seen (context 0: r u64 of chans × signals),
            // writes clock (the first 2 u64 of HtState's clocks), r × width + 4
            // bytes of rows (HtState's pinned rows, that size, not read by the
            // host until a launch after this one on gin's stream was waited
            // for) and TableAt's words + 1 u32 of tables (that size): the
            // sizes HtState::new and State::new allocated. gin's stream (with
            // ep_ht_layout before it there, where queued), waited for, or
            // queued there before the dispatch kernel, which reads tables and
            // is waited for; nothing else touches them in between.
            let r = unsafe { go(&self.dc, f, on, 1, &args) };
            kernel_us = t0.elapsed().as_secs_f64() * 1e6;
            (
                r,
                helper.map(|h| h.map(std::thread::ScopedJoinHandle::join)),
            )
        });
        r.map_err(|e| kernel_error(self.rank, "ht_notify", e))?;
        match (helper, up) {
            (Some(Ok(joined)), _) => joined.unwrap_or_else(|p| std::panic::resume_unwind(p))?,
            // No thread to be had: the upload after the exchange instead.
            (Some(Err(_)), Some(up)) => up.upload(dev)?,
            _ => {}
        }
        tracing::debug!(
            rank = self.rank,
            notify_us = kernel_us,
            with_upload_us = t0.elapsed().as_secs_f64() * 1e6,
            laid_out_on_gpu = matches!(row, Row::Device(_)),
            waited = matches!(on, On::Wait),
            "high-throughput count exchange: the launch of the notify kernel (and of ep_ht_layout before it, from GPU memory) to its end where waited (else to its launch), and to the upload's end"
        );
        Ok(())
    }

    /// After a failed launch on gin's stream: whether the notify kernel
    /// queued before it there did not reach its end (its end clock, reset
    /// with the step's clocks, is still 0). A clock that cannot be read
    /// says no.
    fn ht_notify_unfinished(&self) -> bool {
        let mut c = [0u64; 2];
        self.ht_state("ht_dispatch")
            .is_ok_and(|st| st.clocks.read(0, &mut c).is_ok() && c[1] == 0)
    }

    /// A count exchange ended (whatever its rows said): the next one's rows
    /// go into the other half.
    fn ht_exchanged(&mut self) {
        if let Some(h) = self.ht.as_mut() {
            h.rounds += 1;
        }
    }

    /// Gin's stream, where [`go`] with [`On::Wait`] launches: work queued
    /// on it runs before the next waited launch.
    fn gin_stream(&self) -> StreamRef<'static> {
        // SAFETY: the stream gin's `run` launches on (context_info), alive
        // as long as this buffer's communicator; the result is used only
        // for launches within a call on this buffer, whose communicator
        // outlives it.
        unsafe { StreamRef::from_raw(self.cuda.context_info().stream) }
    }

    /// FP8: quantises the BF16 tokens at `xbf` (the uploaded staging, or
    /// the caller's device memory) into XIN's payloads (`ep_ht_quantize`,
    /// bit for bit as [`crate::num::quantize_fp8`]), on `on` (queued on
    /// gin's stream before the dispatch kernel, or on the copy stream).
    ///
    /// # Safety
    /// `xbf` holds `tokens × hidden` u16, readable until the launch has
    /// finished (until the caller waits for the stream it is queued on).
    unsafe fn ht_quantize(
        &self,
        s: &Shape,
        tokens: usize,
        xbf: u64,
        on: On<'_>,
    ) -> Result<(), EpError> {
        use crate::ht::plan::XIN;
        if tokens == 0 {
            return Ok(());
        }
        let hidden = s.h2 / 2;
        let args = [
            Arg::Window(self.wins[XIN].abi()),
            Arg::Ptr(xbf),
            Arg::U32(Self::u32_of(tokens)),
            Arg::U32(Self::u32_of(s.p)),
            Arg::U32(Self::u32_of(hidden)),
        ];
        let f = self.ht_functions()?.quantize;
        let warps = (super::THREADS / 32) as usize;
        let grid = self.grid((tokens * (hidden / crate::num::FP8_BLOCK)).div_ceil(warps));
        // SAFETY: ep_ht_quantize(Window xin, const u16* xbf, u32 tokens,
        // u32 p, u32 h) takes these in this order. It reads tokens × hidden
        // u16 of xbf (the caller's contract) and writes tokens × p bytes of XIN (t × p:
        // ht::resources), 4-byte aligned (p and hidden are multiples of 4:
        // Config::validate). Nothing else touches XIN until the dispatch
        // kernel, after `on` is waited for.
        let r = unsafe { go(&self.dc, f, on, grid, &args) };
        r.map_err(|e| kernel_error(self.rank, "ht_quantize", e))
    }

    fn ht_launch_dispatch(
        &mut self,
        s: &Shape,
        tokens: usize,
        payloads: Payloads,
    ) -> Result<(), EpError> {
        let st = self.ht_state("ht_dispatch")?;
        let ptrs = [
            st.shape.ptr(),
            st.tables.ptr(),
            self.state.active.ptr(),
            st.seen.ptr(),
            st.lane.ptr(),
            st.contrib.ptr(),
        ];
        let (x, xbytes) = match payloads {
            Payloads::Xin => (0, 0),
            Payloads::InPlace { ptr, bytes } => (ptr, bytes),
        };
        // The dispatch kernel's pair of the step's clocks (reset with the
        // exchange's).
        let clocks = st.clocks.ptr();
        let clock = clocks + 16;
        let mut args = vec![Arg::DevComm(self.dc.abi())];
        args.extend(self.ht_windows());
        args.push(Arg::U32(Self::u32_of(tokens)));
        args.extend(ptrs.map(Arg::Ptr));
        args.extend([
            Arg::Ptr(self.state.err.ptr()),
            Arg::Ptr(self.state.errh.dev()),
            Arg::Ptr(clock),
            Arg::Ptr(x),
            Arg::U64(xbytes),
        ]);
        let f = self.ht_functions()?.dispatch;
        let grid = Self::u32_of(s.chans);
        // SAFETY: ep_ht_dispatch(DevComm, 12 Windows, u32 tokens, const u32*
        // shape, const u32* tables, const u32* active, u64* seen, u64* lane,
        // u32* contrib, u64* err, u64* errh, u64* clock, const u8* x, u64
        // xbytes) takes these in this order, one block per channel. It reads
        // `tokens` (≤ t) staged tokens of MIN and their payloads from XIN or,
        // where `payloads` is in place, from the caller's x (xbytes =
        // tokens × p bytes, checked by check_device_inputs, borrowed for
        // this call; every read range-checked against xbytes), writes rings
        // and final places within their sizes
        // (ht::resources: every place comes from the plan, whose
        // counts check_row bounded by t) and contrib entries (src, host
        // slot < t, local rank: r × t × l u32), and the chans × signals
        // entries of seen and chans × lane_words of lane that HtState::new
        // allocated; err and errh hold Record::BYTES (8 u64: the record's two
        // slots of 4), clock 2 (the second pair of HtState's 6 clocks). gin's
        // stream (after the notify kernel, which wrote tables, queued there),
        // waited for.
        let r = unsafe { go(&self.dc, f, On::Wait, grid, &args) };
        // The notify kernel ran first on the same stream: where a kernel
        // failed (not a launch: the notify kernel may still be running
        // then) and the notify kernel did not finish (its end clock still
        // reset), the error is its own.
        let kernel = if matches!(r, Err(CoreError::Kernel { .. })) && self.ht_notify_unfinished() {
            "ht_notify"
        } else {
            "ht_dispatch"
        };
        self.launched(On::Wait, kernel, r)?;
        let mut c = [0u64; 6];
        self.ht_state("ht_dispatch")?
            .clocks
            .read(0, &mut c)
            .map_err(CoreError::from)?;
        self.last_dispatch_kernel = super::KernelClock {
            start_ns: c[2],
            end_ns: c[3],
        };
        // The layout kernel's start where it ran (its pair stays reset,
        // u64::MAX, for host inputs).
        self.last.0 = super::KernelClock {
            start_ns: c[0].min(c[4]),
            end_ns: c[3],
        };
        let us = |a: u64, b: u64| b.saturating_sub(a) as f64 / 1e3;
        let laid_out = c[4] != u64::MAX;
        tracing::debug!(
            rank = self.rank,
            layout_us = if laid_out { us(c[4], c[5]) } else { 0.0 },
            notify_us = us(c[0], c[1]),
            notify_after_layout_us = if laid_out { us(c[5], c[0]) } else { 0.0 },
            gap_to_dispatch_us = us(c[1], c[2]),
            dispatch_kernel_us = us(c[2], c[3]),
            "high-throughput dispatch on the GPU: each kernel's first start to last end, and the gaps between them"
        );
        self.poll()
    }

    /// Reads the received tokens' metadata back and checks it.
    fn ht_read_dispatch(&mut self, s: &Shape, plan: Plan) -> Result<CudaHtDispatch, EpError> {
        use crate::ht::plan::RECVM;
        let me = self.rank;
        let prefix = plan.recv_prefix(me).to_vec();
        let total = prefix[s.r] as usize;
        let mut raw = vec![0u8; total * s.mm];
        if total > 0 {
            self.wins[RECVM]
                .local()
                .read(0, &mut raw)
                .map_err(CoreError::from)?;
        }
        if let Some(h) = self.ht.as_mut() {
            h.received = total;
        }
        let lexp = self.cfg.local_experts(s.r);
        let mut d = CudaHtDispatch {
            step: self.st.step,
            tokens: self.st.tokens,
            nranks: s.r,
            plan,
            recv_prefix: prefix,
            src_token: Vec::with_capacity(total),
            local_weight: Vec::with_capacity(total),
            expert_counts: vec![0; lexp],
        };
        for j in 0..total {
            let (tok, w) = crate::ht::read_meta(
                s,
                me * lexp..(me + 1) * lexp,
                &raw[j * s.mm..(j + 1) * s.mm],
                &mut d.expert_counts,
            );
            if tok as usize >= s.t {
                let src = d.recv_prefix.partition_point(|&p| p as usize <= j) - 1;
                return Err(EpError::Protocol {
                    rank: me,
                    peer: src,
                    what: format!(
                        "received token {j} names token {tok} at or above the maximum {}",
                        s.t
                    ),
                });
            }
            d.src_token.push(tok);
            d.local_weight.push(w);
        }
        Ok(d)
    }

    /// Copies the received payloads of `d` back from GPU memory, for checks
    /// ([`crate::oracle::check_ht_view`]): only between the dispatch and
    /// the combine.
    pub fn ht_received(&self, d: &CudaHtDispatch) -> Result<HtReceived, EpError> {
        use crate::ht::plan::RECVX;
        self.ht_state("ht_received")?;
        self.st.for_received("ht_received", d.step)?;
        self.current()?;
        let p = self.cfg.payload_bytes();
        let mut data = vec![0u8; d.received() * p];
        if !data.is_empty() {
            self.wins[RECVX]
                .local()
                .read(0, &mut data)
                .map_err(CoreError::from)?;
        }
        Ok(HtReceived {
            d: d.clone(),
            payload: p,
            data,
        })
    }

    /// The identity expert on the GPU: each received token times the sum of
    /// its weights for this rank's experts, as its combine row (the CPU
    /// ranks' [`crate::Buffer::ht_echo`], bit for bit).
    pub fn ht_echo(&mut self, d: &CudaHtDispatch) -> Result<(), EpError> {
        self.launch_ht_echo("ht_echo", d.step, d.received())
    }

    /// [`CudaBuffer::ht_echo`] for a step dispatched from GPU memory.
    pub fn ht_echo_device(&mut self, s: &CudaHtStep) -> Result<(), EpError> {
        const CALL: &str = "ht_echo_device";
        self.ht_state(CALL)?;
        self.st.dispatched(CALL, s.step)?;
        self.ht_own_step(CALL, s)?;
        self.launch_ht_echo(CALL, s.step, s.received())
    }

    /// `s` is this buffer's step under way, dispatched from GPU memory
    /// ([`own_step`] on this buffer's plan).
    fn ht_own_step(&self, call: &'static str, s: &CudaHtStep) -> Result<(), EpError> {
        let plan = self.ht.as_ref().and_then(|h| h.plan.as_ref());
        let here = plan.map(|p| (p.recv_prefix(self.rank), self.st.tokens));
        own_step(self.rank, call, s, self.st.step, here)
    }

    fn launch_ht_echo(
        &mut self,
        call: &'static str,
        step: u64,
        handle_received: usize,
    ) -> Result<(), EpError> {
        let st = self.ht_state(call)?;
        let (shape, received) = (st.shape.ptr(), st.received);
        self.st.dispatched(call, step)?;
        if handle_received != received {
            // A handle of another buffer at the same step number.
            return Err(EpError::Mode {
                rank: self.rank,
                what: format!(
                    "{call}: the handle received {handle_received} tokens, this buffer's step \
                     {step} received {received}: it belongs to another buffer"
                ),
            });
        }
        self.expect_unqueued(call)?;
        self.poll()?;
        self.current()?;
        let mut args = self.ht_windows();
        args.extend([Arg::U32(Self::u32_of(received)), Arg::Ptr(shape)]);
        let f = self.ht_functions()?.echo;
        let grid = self.grid(received);
        // SAFETY: ep_ht_echo(12 Windows, u32 received, const u32* shape)
        // takes these in this order; it reads `received` tokens of RECVX
        // and RECVM and writes as many rows of CSEND, all within their sizes
        // (r × t slots each: ht::resources; `received` is this buffer's own
        // count from its latest dispatch, ≤ r × t by the plan's checked
        // counts, never the caller's handle's). gin's stream, waited for.
        let r = unsafe { go(&self.dc, f, On::Wait, grid, &args) };
        self.launched(On::Wait, "ht_echo", r)
    }

    /// High-throughput combine on CUDA ranks: forwarders sum their host's
    /// rows of each token they forwarded and put them back to the source;
    /// each source reduces a token once every host it went to has
    /// delivered, its own host's rows read in place (the CPU ranks'
    /// reduction order: the result is theirs bit for bit). The combined
    /// tokens are read back.
    pub fn ht_combine(&mut self, d: &CudaHtDispatch) -> Result<Combined, EpError> {
        self.ht_state("ht_combine")?;
        self.st.dispatched("ht_combine", d.step)?;
        self.expect_unqueued("ht_combine")?;
        self.poll()?;
        self.current()?;
        let out = self.state.out.ptr();
        // SAFETY: State::out holds t × hidden u16 (tokens ≤ t), from
        // cuMemAlloc (aligned); the launch is waited for.
        unsafe { self.launch_ht_combine(out)? };
        self.read_combined()
    }

    /// The combine of a step dispatched from GPU memory (DeepEP's
    /// normal-mode `combine`): reads the expert's rows from
    /// [`CudaBuffer::ht_combine_rows`] (written by the caller's expert
    /// kernel after the dispatch, or by [`CudaBuffer::ht_echo_device`]) and
    /// writes the combined tokens, `tokens × hidden` BF16, into `out`, the
    /// caller's device memory (size and alignment checked); nothing goes
    /// through the host. On gin's stream, returning when it has finished;
    /// bit for bit what [`CudaBuffer::ht_combine`] returns.
    ///
    /// An `out` the host's checks refuse ([`EpError::Shape`],
    /// [`EpError::Misaligned`]) does not stop the step (every peer's
    /// combine waits for this rank's rows and signals, which do not depend
    /// on `out`): the combine runs in full, its reduction written into the
    /// buffer's own memory (`State::out`, allocated with the buffer), `out`
    /// untouched; then this returns the error, and every buffer takes the
    /// next step. (Before, it returned at once, launching nothing, and
    /// every peer's combine failed at the job timeout.) The error ends the
    /// step: the combine ran, so a retry is refused ([`EpError::Phase`]),
    /// and the reduction, in the buffer's own memory, is not returned.
    pub fn ht_combine_device(&mut self, s: &CudaHtStep, out: &DevMem) -> Result<(), EpError> {
        const CALL: &str = "ht_combine_device";
        self.ht_state(CALL)?;
        self.st.dispatched(CALL, s.step)?;
        self.ht_own_step(CALL, s)?;
        self.expect_unqueued(CALL)?;
        self.poll()?;
        let bad = check_device_output(self.rank, &self.cfg, self.st.tokens, out.into()).err();
        let out = if bad.is_some() {
            self.state.out.ptr()
        } else {
            out.ptr()
        };
        self.current()?;
        // SAFETY: `out` holds tokens × hidden u16, 16-byte aligned (checked
        // above), borrowed until the launch, which is waited for, ends; or,
        // refused, State::out (t × hidden u16, tokens ≤ t, from cuMemAlloc).
        unsafe { self.launch_ht_combine(out)? };
        self.poll()?;
        bad.map_or(Ok(()), Err)
    }

    /// Launches the combine kernel of the step under way into `out`; the
    /// step ends.
    ///
    /// # Safety
    /// `out` holds `tokens × hidden` u16 (this step's tokens), 16-byte
    /// aligned, writable until this call returns.
    unsafe fn launch_ht_combine(&mut self, out: u64) -> Result<(), EpError> {
        let tokens = self.st.tokens;
        let st = self.ht_state("ht_combine")?;
        let grid = Self::u32_of(st.s.chans);
        let ptrs = [
            st.shape.ptr(),
            st.tables.ptr(),
            self.state.active.ptr(),
            st.direct.ptr(),
            st.seen.ptr(),
            st.lane.ptr(),
            st.contrib.ptr(),
            out,
            self.state.err.ptr(),
            self.state.errh.dev(),
        ];
        let clock = self.clock_for(On::Wait)?;
        let mut args = vec![Arg::DevComm(self.dc.abi())];
        args.extend(self.ht_windows());
        args.push(Arg::U32(Self::u32_of(tokens)));
        args.extend(ptrs.map(Arg::Ptr));
        args.push(Arg::Ptr(clock));
        let f = self.ht_functions()?.combine;
        // SAFETY: ep_ht_combine(DevComm, 12 Windows, u32 tokens, const u32*
        // shape, const u32* tables, const u32* active, const u32* direct,
        // u64* seen, u64* lane, u32* contrib, u16* out, u64* err, u64* errh,
        // u64* clock) takes these in this order, one block per channel. It
        // reads this step's staged metadata (MIN), combine rows of CSEND
        // here and of this host's ranks (through their mappings after a
        // range check, or by get into CGET: its rows per channel taken from
        // its size, at least l where any is fetched, check_cget and the
        // kernel's cget_short), CRDMA rows (h × t), contrib as the dispatch
        // wrote it, writes CSTAGE rows (chans × STAGE), tokens × hidden u16
        // of out (the caller's contract), seen and lane as the dispatch;
        // err and errh hold Record::BYTES (8 u64: two slots of 4), clock 2. gin's stream,
        // waited for.
        let r = unsafe { go(&self.dc, f, On::Wait, grid, &args) };
        self.launched(On::Wait, "ht_combine", r)?;
        self.st.combined();
        self.ht_forget_plan();
        self.last.1 = read_clock(&self.state.clock)?;
        self.poll()
    }

    /// Copies what a dispatch from GPU memory received (the metadata of
    /// every received token) to the host and checks it as
    /// [`CudaBuffer::ht_dispatch`] does: for tests and inspection, not the
    /// data path; between the dispatch and the combine only (once this
    /// rank's combine has told its peers, they may dispatch their next
    /// step into these places). [`CudaBuffer::ht_received`] then copies the
    /// payloads too.
    pub fn ht_read_back(&mut self, s: &CudaHtStep) -> Result<CudaHtDispatch, EpError> {
        const CALL: &str = "ht_read_back";
        self.ht_state(CALL)?;
        self.st.for_received(CALL, s.step)?;
        self.ht_own_step(CALL, s)?;
        self.current()?;
        let plan = self.ht.as_ref().and_then(|h| h.plan.clone());
        let plan = plan.ok_or(EpError::Mode {
            rank: self.rank,
            what: format!("{CALL}: no dispatch from GPU memory holds a plan here"),
        })?;
        let shape = self.ht_state(CALL)?.s;
        let d = self.ht_read_dispatch(&shape, plan);
        if d.is_err() {
            self.st.fail();
        }
        d
    }

    /// The received tokens' payloads in GPU memory (this rank's part of
    /// RECVX): received token `j` (blocks by source, in each source's
    /// token order; [`CudaHtStep::block_start`]) at byte
    /// `j · payload_bytes` ([`HtDeviceLayout`]). Valid from the end of the
    /// dispatch until this rank's combine is launched. Refused
    /// ([`EpError::Mode`]) on a buffer sized for low-latency mode.
    pub fn ht_recv_tokens(&self) -> Result<&DevMem, EpError> {
        self.ht_window("ht_recv_tokens", crate::ht::plan::RECVX)
    }

    /// The received tokens' metadata in GPU memory (RECVM): token `j`'s
    /// `meta_bytes` at byte `j · meta_bytes`, as [`HtDeviceLayout`] says
    /// (its index at its source, top-k expert ids as i32, weights as f32).
    /// Refused on a buffer sized for low-latency mode.
    pub fn ht_recv_meta(&self) -> Result<&DevMem, EpError> {
        self.ht_window("ht_recv_meta", crate::ht::plan::RECVM)
    }

    /// The combine rows in GPU memory (CSEND): the expert writes received
    /// token `j`'s row, BF16 `hidden` (its experts' outputs, weighted and
    /// summed, as DeepEP's normal-mode combine takes them) at byte `j · 2 ·
    /// hidden`, between the dispatch and the combine, finished before the
    /// combine starts (peers read these rows in place). Refused on a
    /// buffer sized for low-latency mode.
    pub fn ht_combine_rows(&self) -> Result<&DevMem, EpError> {
        self.ht_window("ht_combine_rows", crate::ht::plan::CSEND)
    }

    /// This rank's part of high-throughput window `w`, for `call`.
    fn ht_window(&self, call: &'static str, w: usize) -> Result<&DevMem, EpError> {
        self.ht_state(call)?;
        self.wins
            .get(w)
            .map(gin_core::cuda::GpuWindow::local)
            .ok_or(EpError::Mode {
                rank: self.rank,
                what: format!(
                    "{call}: the buffer holds {} windows, not high-throughput window {w}",
                    self.wins.len()
                ),
            })
    }

    /// Where the high-throughput device-resident outputs lie. Refused on a
    /// buffer sized for low-latency mode.
    pub fn ht_device_layout(&self) -> Result<HtDeviceLayout, EpError> {
        let s = self.ht_state("ht_device_layout")?.s;
        Ok(HtDeviceLayout {
            payload_bytes: self.cfg.payload_bytes(),
            meta_bytes: s.mm,
            row_bytes: 2 * self.cfg.hidden,
            ids_word: 1,
            weights_word: 1 + s.k,
            topk: s.k,
            fp8: self.cfg.fp8,
        })
    }
}

/// A high-throughput step dispatched from GPU memory
/// ([`CudaBuffer::ht_dispatch_device`]): hand it to the expert and combine
/// of the same step. It holds what the host knows without reading the
/// received tokens back: how many came from each source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaHtStep {
    step: u64,
    tokens: usize,
    recv_prefix: Vec<u32>,
}

impl CudaHtStep {
    /// Tokens this rank dispatched (rows of the combine's output).
    pub fn tokens(&self) -> usize {
        self.tokens
    }
    /// Tokens received in all.
    pub fn received(&self) -> usize {
        self.recv_prefix.last().map_or(0, |&v| v as usize)
    }
    /// Where `src`'s block starts among the received tokens.
    pub fn block_start(&self, src: usize) -> usize {
        self.recv_prefix[src] as usize
    }
    /// Tokens received from `src` (one contiguous block, in its order).
    pub fn count(&self, src: usize) -> usize {
        (self.recv_prefix[src + 1] - self.recv_prefix[src]) as usize
    }
}

/// Where a high-throughput dispatch from GPU memory leaves what it
/// received, and where the expert writes ([`CudaBuffer::ht_recv_tokens`],
/// [`CudaBuffer::ht_recv_meta`], [`CudaBuffer::ht_combine_rows`]):
/// received token `j` has its payload at byte `j · payload_bytes` (BF16
/// `hidden`, or FP8 codes then one f32 scale per 128 elements), its
/// metadata at byte `j · meta_bytes` (u32 words: word 0 its index at its
/// source, words `ids_word..ids_word + topk` its top-k expert ids as i32,
/// -1 empty, words `weights_word..weights_word + topk` the weights' f32
/// bits; this rank's experts are `rank · local_experts ..`), and its combine
/// row at byte `j · row_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HtDeviceLayout {
    /// Bytes of a received payload.
    pub payload_bytes: usize,
    /// Bytes of a received token's metadata.
    pub meta_bytes: usize,
    /// Bytes of a combine row (BF16 `hidden`).
    pub row_bytes: usize,
    /// First word of the top-k ids in the metadata.
    pub ids_word: usize,
    /// First word of the top-k weights in the metadata.
    pub weights_word: usize,
    /// Top-k.
    pub topk: usize,
    /// Whether payloads are FP8.
    pub fp8: bool,
}

#[cfg(test)]
mod layout_tests;
#[cfg(test)]
mod plan_tests;
#[cfg(test)]
mod tests;
