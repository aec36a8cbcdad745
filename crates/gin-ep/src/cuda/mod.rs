//! CUDA ranks: the low-latency mode as kernels (`kernels/ll.cu`, which
//! includes `gin/gin.cuh`), launched through gin-core's public CUDA API
//! ([`gin_core::cuda`]): windows from [`CudaComm::alloc_window`], kernels
//! compiled by NVRTC ([`CudaComm::compile`]) and run on a
//! [`CudaDevComm`].
//!
//! The windows, message format, slot and signal numbering and the
//! cumulative-signal protocol are the CPU ranks' ([`crate::ll`]); inputs
//! are checked on the host with the same code before this rank sends a
//! token (bad input still takes part in the step, without tokens, so that
//! every peer ends it naming this rank; below). A step is three launches:
//! dispatch (send and receive halves in one kernel), the expert (here the
//! identity, [`CudaBuffer::ll_echo`]), combine (send and reduce in one
//! kernel). Every device wait is bounded by the job timeout and a failure
//! names the peer waited for ([`EpError::Kernel`]).
//!
//! The combine reads the expert outputs of every rank reached by
//! load/store in place, in that rank's combine window, as CPU ranks do;
//! only other peers put them back ([`CudaBuffer::combine_reads_in_place`],
//! agreed at creation). The next dispatch's counts are the readers'
//! credits: an expert rewrites its slots only after it received them
//! (docs/ep.md).
//!
//! With FP8 the dispatch kernel quantises the BF16 tokens into the
//! messages, bit for bit as [`crate::num::quantize_fp8`]
//! (`tests/fp8_host.rs` compiles the kernel's number functions as host C++
//! and compares); the combine stays BF16.
//!
//! # Inputs and outputs in GPU memory
//!
//! [`CudaBuffer::ll_dispatch`] and [`CudaBuffer::ll_combine`] take host
//! slices: the host checks and stages the messages and reads the counts,
//! metadata and combined tokens back. [`CudaBuffer::ll_dispatch_device`]
//! takes `x`, `topk_idx` and `topk_weights` in GPU memory
//! ([`DeviceInputs`], typed [`DevMem`]; a framework's tensor is lent with
//! the `unsafe` [`DevMem::from_raw_parts`]): the dispatch kernel stages
//! the messages itself and checks every top-k entry, and what it received
//! stays in GPU memory ([`CudaBuffer::recv_tokens`],
//! [`CudaBuffer::recv_counts`], [`CudaBuffer::recv_meta`], laid out as
//! [`LlDeviceLayout`] says) for the caller's expert kernel, which writes
//! [`CudaBuffer::combine_slots`] (or its own tensor of that layout, for
//! [`CudaBuffer::ll_combine_from_device`], which copies it in first);
//! [`CudaBuffer::ll_combine_device`] writes the combined tokens into the
//! caller's [`DevMem`]. Those run on gin's
//! stream and return when their kernel has finished; the `unsafe`
//! `*_on` calls ([`CudaBuffer::ll_dispatch_on`],
//! [`CudaBuffer::ll_echo_on`], [`CudaBuffer::ll_combine_on`]) queue the
//! same kernels on the caller's stream ([`CudaDevComm::launch_on`]) and
//! return at once, with [`CudaBuffer::check`] after the caller synchronised
//! it. While they run, a watcher the buffer started before the first of
//! them ([`gin_core::cuda::Watcher`], a thread) raises the abort flag on a
//! peer's death or a failed transport or engine, so their waits give up at
//! once; `check` hands it to gin-core's check, which names the cause. No
//! step copies tokens, routing, counts or outputs between host and
//! GPU: the counters the host used to write (the combine's target) are
//! advanced by the kernels, and only the waiting calls reset their launch
//! clock (16 bytes, for [`CudaBuffer::last_kernels`]). Nothing
//! step-dependent is baked into a launch's arguments (the signals'
//! accounted values, the combine targets, the dispatch's grid barrier and
//! its input check's word live in device memory), so the `*_on` calls may
//! be captured into a CUDA graph whose every replay is a step. After one
//! failed wait or put, every later queued dispatch or combine returns at
//! once (gin's error word, sticky until checked), rather than waiting a job
//! timeout for peers that stopped with it. The received
//! tokens are valid until this rank's combine is launched: a peer it
//! signals may then dispatch its next step into them.
//!
//! What the host checked on read-back, the kernels check and record
//! (`ep::record`: device memory, mirrored to pinned host memory the host
//! polls without waiting): a count above the maximum, a token index out of
//! range or a message that does not name its expert is the source's
//! [`EpError::Protocol`], naming it and the expert; such a pair counts 0
//! tokens, so an expert kernel reading the counts stays within the slots.
//! The record keeps the first broken protocol apart from a refusal
//! recorded before it (`dev::Record`), so that a refusal in one queued
//! step never hides a broken protocol in a later one.
//! Bad inputs make the rank send no token but a refused count (`POISON`)
//! to every expert's rank, so every rank finishes the step and reports it:
//! the rank its entry ([`EpError::ExpertOutOfRange`],
//! [`EpError::DuplicateExpert`], [`EpError::BadWeight`], ...), the others
//! [`EpError::PeerRefused`] naming the rank. Entries in GPU memory are found bad by
//! the dispatch kernel; host inputs, and the token count, sizes and
//! alignment of inputs in GPU memory, by the host's checks, after which
//! the call still launches the dispatch kernel, with no token and in its
//! refusing form, so that it poisons the counts alike (a queued call
//! queues the refused step's combine too, and returns the error). In the
//! waited calls ([`CudaBuffer::ll_dispatch`],
//! [`CudaBuffer::ll_dispatch_device`]) every rank then ends the step with a
//! combine launch that carries no data (its signals only, as CPU ranks'
//! `ll_end_refused`), so that no rank waits for another and every signal
//! and counter advances as in a full step. Queued steps
//! ([`CudaBuffer::ll_dispatch_on`]) run to their end as queued, their
//! expert and combine included: a refused source's pairs count 0 tokens,
//! and the calls queued meanwhile go ahead; [`CudaBuffer::check`] reports
//! the refusal. Either way every buffer stays usable and the next step
//! runs normally, whatever each rank's call kind; only a refused step that
//! fails midway (a wait timed out, a peer was lost) leaves the buffer
//! refusing further steps, as a peer's broken protocol does.
//!
//! A combine is never refused locally either (every peer's combine waits
//! for this rank's signals): an output tensor the host's checks refuse
//! ([`CudaBuffer::ll_combine_device`] and the other `ll_combine_*` calls,
//! [`CudaBuffer::ht_combine_device`]) runs the combine in full, its
//! reduction into the buffer's own memory, and the call then returns the
//! error, every peer's result normal; expert outputs they refuse
//! ([`CudaBuffer::ll_combine_from_device`]) cannot be sent, so the combine
//! kernel runs in its refusing form, as a refused dispatch does: no data,
//! each of its combine signals carrying `POISON` beside the step's 1.
//! Each source's combine kernel then reduces nothing (its output is left
//! untouched), records the refusal naming the expert's rank
//! ([`EpError::PeerRefusedCombine`], from a waited call or `check`) and
//! accounts the poison (the next dispatch adds it to the combine target),
//! so the next step counts alike on every rank.
//!
//! **An `Err` from a combine call whose own tensor was refused ends the
//! step**: the combine ran (or was queued) all the same, so the buffer is
//! idle and a retry of the combine is refused (`EpError::Phase`); for a
//! refused `out` the reduction went to the buffer's own memory and is not
//! returned. Where both tensors are refused, the error names the combine
//! output (its check runs first) and the combine is refused collectively
//! all the same.
//!
//! High-throughput mode (`ht.rs`, `kernels/ht.cu`): a buffer created with
//! [`Config::high_throughput`] runs [`CudaBuffer::ht_dispatch`],
//! [`CudaBuffer::ht_echo`] and [`CudaBuffer::ht_combine`] from host inputs,
//! or [`CudaBuffer::ht_dispatch_device`], [`CudaBuffer::ht_echo_device`] and
//! [`CudaBuffer::ht_combine_device`] from inputs in GPU memory (the routing
//! read back and checked on the host for the plan, the tokens never
//! through it); the low-latency calls are refused on it, and the reverse.
//! Its creation refuses a job whose channel blocks cannot all be resident
//! on the GPUs the ranks share ([`resident`]).
//!
//! What this version leaves out: high-throughput steps queued on a
//! caller's stream, and the active-rank mask under a peer's loss (a lost
//! peer fails the step, naming it).

use std::sync::atomic::Ordering;

use gin_core::cuda::{
    Arg, CtxSharing, CudaComm, CudaDevComm, DevMem, Function, GpuWindow, HostMem, LaunchConfig,
    Module, StreamRef, Watcher,
};
use gin_core::{CoreError, DevCommRequirements};

mod dev;
mod ht;
pub mod resident;
mod steps;

use dev::{CombineCall, Record, RecordMemory, combine_call};
use steps::{Look, Recorded, Verdict};

pub use ht::{CudaHtDispatch, CudaHtStep, HT_KERNELS, HtDeviceLayout, HtReceived};

pub use dev::{
    DeviceInputs, LlDeviceLayout, Span, check_device_inputs, check_device_output, check_entries,
    check_expert_outputs, decode_error,
};

use crate::config::{Config, Mode};
use crate::error::EpError;
use crate::ll::{Combined, write_messages, write_metadata};
use crate::num::Bf16;

/// The kernels of CUDA ranks (CUDA C++ including `gin/gin.cuh`), for
/// [`CudaComm::compile`].
pub const LL_KERNELS: &str = include_str!("../../kernels/ll.cu");

const SEND: usize = 0;
const RECV: usize = 1;
const CSEND: usize = 2;
const CRECV: usize = 3;

/// Threads per block of every kernel.
const THREADS: u32 = 512;
/// Default blocks per launch: few enough that every rank's grid is resident
/// at once when ranks share one GPU under MPS (a block waits only after it
/// sent everything it sends, but it must be running to send).
const BLOCKS: u32 = 32;

/// Whether CUDA ranks can run here; the error says why not (no driver, no
/// GPU), in words a user can act on.
pub fn gpu_available() -> Result<(), String> {
    gin_core::cuda::skip_reason().map_or(Ok(()), Err)
}

/// The kernel error of `kernel`, naming the peer gin-core's error word
/// names.
fn kernel_error(rank: usize, kernel: &'static str, e: CoreError) -> EpError {
    let peer = match &e {
        CoreError::Kernel { peer, .. } => *peer,
        _ => None,
    };
    EpError::Kernel {
        rank,
        kernel,
        peer,
        source: Box::new(e),
    }
}

/// Where a launch goes: gin's stream, waited for ([`CudaDevComm::run`],
/// which watches the job meanwhile and reads the error word), or the
/// caller's, queued ([`CudaDevComm::launch_on`]).
#[derive(Debug, Clone, Copy)]
enum On<'s> {
    Wait,
    Queue(StreamRef<'s>),
}

impl PartialEq for On<'_> {
    fn eq(&self, other: &Self) -> bool {
        matches!((self, other), (On::Wait, On::Wait))
            || matches!((self, other), (On::Queue(a), On::Queue(b)) if a.raw() == b.raw())
    }
}

/// Where the dispatch kernel finds this step's messages: device addresses
/// of the BF16 tokens (`xin`), the top-k ids (`idx`, i64) and weights
/// (`wts`, f32), 0 for what the host staged in the send window; or none,
/// this rank's inputs refused by the host's checks (`refused`: the kernel
/// sends no token and poisons every count, [`Source::REFUSED`]).
#[derive(Debug, Clone, Copy)]
struct Source {
    xin: u64,
    idx: u64,
    wts: u64,
    refused: bool,
}

impl Source {
    /// What the host staged in the send window (BF16 payloads and
    /// metadata), or with FP8 the metadata and the BF16 tokens at `xin`.
    const fn staged(xin: u64) -> Self {
        Self {
            xin,
            idx: 0,
            wts: 0,
            refused: false,
        }
    }

    /// The host refused this rank's inputs: no message (launched with 0
    /// tokens), the kernel in its refusing form.
    const REFUSED: Self = Self {
        xin: 0,
        idx: 0,
        wts: 0,
        refused: true,
    };
}

/// Launches `f` on `grid` blocks of [`THREADS`] threads where `on` says.
///
/// # Safety
/// As [`CudaDevComm::launch_on`] for `f` and `args`.
unsafe fn go(
    dc: &CudaDevComm<'_, '_>,
    f: Function,
    on: On<'_>,
    grid: u32,
    args: &[Arg<'_>],
) -> Result<(), CoreError> {
    // SAFETY: the caller's contract.
    unsafe {
        match on {
            On::Wait => dc.run(&f, grid, THREADS, args),
            On::Queue(s) => dc.launch_on(&f, &LaunchConfig::linear(grid, THREADS), s, args),
        }
    }
}

/// Device memory of a CUDA buffer beside its windows.
#[derive(Debug)]
struct State {
    /// `u32[nranks]`: 1 for an active rank.
    active: DevMem,
    /// `u64[experts]`: per dispatch signal, the value accounted for.
    seen: DevMem,
    /// `u32[experts]`: tokens per (local expert, source) pair.
    counts: DevMem,
    /// `u32[3 × experts × t]`: per received token, source token, top-k
    /// slot, weight bits.
    meta: DevMem,
    /// `u64[nranks]`: the combine signal each rank's experts must reach
    /// (the dispatch kernel adds 1 for each active rank).
    ctarget: DevMem,
    /// `u64[nranks]`: POISON where that rank refused the last combine
    /// (written by the combine kernel), which the next dispatch kernel
    /// adds to `ctarget` and clears.
    cpois: DevMem,
    /// `u16[t × hidden]`: the combined tokens (read back by the host-output
    /// calls), and the sink of a combine whose output tensor the host's
    /// checks refused (the step still runs in full: its reduction lands
    /// here, read by nobody).
    out: DevMem,
    /// `u64[2]`: earliest block start, latest block end of a launch.
    clock: DevMem,
    /// FP8: `u16[t × hidden]`, this step's tokens in BF16 staged by the
    /// host, which the dispatch kernel quantises into the messages.
    xin: Option<DevMem>,
    /// `u64`: the dispatch kernel's grid barrier (FP8 and device-resident
    /// inputs), an arrival counter in its low word whose bit 31 flips once
    /// per barrier (`ep::grid_sync`): its state lives on the device alone,
    /// so a CUDA graph replays the barrier.
    bar: DevMem,
    /// `u32[t × topk]`: per (token, top-k slot), the token's index among
    /// this rank's tokens for that expert (written by the dispatch kernel).
    eslot: DevMem,
    /// `u8[nranks × nranks]`: `[src × nranks + owner]` is 1 where `src`
    /// reads `owner`'s combine slots in place.
    pull: DevMem,
    /// `u64`: the first bad device-resident input entry of this step (the
    /// dispatch kernel's `bad_key`), `!0` for none; the combine kernel
    /// clears it. Only the kernels write it after creation (the host
    /// would race launches queued before its write).
    inbad: DevMem,
    /// `u64[8]`: what the kernels recorded (`ep::record`, [`Record`]: the
    /// first error, and the first broken protocol).
    err: DevMem,
    /// Its copy in pinned host memory, polled without waiting for a
    /// stream.
    errh: HostMem,
}

impl State {
    /// `ll`: with the low-latency mode's tables (the high-throughput mode
    /// uses the mask, the output, the clock and the error words only).
    fn new(cfg: &Config, n: usize, ll: bool) -> Result<Self, CoreError> {
        let (e, t) = if ll {
            (cfg.num_experts, cfg.max_tokens_per_rank)
        } else {
            (1, 1)
        };
        let zeroed = |bytes: usize| -> Result<DevMem, CoreError> {
            let m = DevMem::new(bytes.max(16))?;
            m.zero(0, m.len())?;
            Ok(m)
        };
        Ok(Self {
            active: zeroed(4 * n)?,
            seen: zeroed(8 * e)?,
            counts: zeroed(4 * e)?,
            meta: zeroed(12 * e * t)?,
            ctarget: zeroed(8 * n)?,
            cpois: zeroed(8 * n)?,
            out: zeroed(2 * cfg.max_tokens_per_rank * cfg.hidden)?,
            clock: zeroed(16)?,
            xin: if cfg.fp8 && ll {
                Some(zeroed(2 * t * cfg.hidden)?)
            } else {
                None
            },
            bar: zeroed(8)?,
            eslot: zeroed(4 * t * cfg.topk)?,
            pull: zeroed(n * n)?,
            inbad: {
                let m = DevMem::new(8)?;
                m.write(0, &[u64::MAX])?;
                m
            },
            err: zeroed(Record::BYTES)?,
            errh: HostMem::new(Record::BYTES)?,
        })
    }
}

/// The record's slot 0 (a refusal the host reported): the pinned mirror
/// through atomics, the kernels' word 0 by an 8-byte memset of device
/// memory, waited for ([`dev::forget_refusal`] orders them). A record
/// claims the slot by a CAS from 0, which fails until all 8 bytes are zero.
impl RecordMemory for State {
    fn clear_mirror_first(&self) {
        for i in 0..dev::WORDS {
            if let Ok(a) = self.errh.atomic_u64(8 * i) {
                a.store(0, Ordering::Release);
            }
        }
    }

    fn clear_kernel_first(&self) -> Result<(), EpError> {
        self.err.zero_wait(0, 8).map_err(CoreError::from)?;
        Ok(())
    }
}

/// The kernels, and the module that holds them (unloaded last).
#[derive(Debug)]
struct Kernels {
    dispatch: Function,
    echo: Function,
    take: Function,
    combine: Function,
    floor: Function,
    /// High-throughput mode's (`kernels/ht.cu`, compiled after `ll.cu`).
    ht: Option<ht::HtFunctions>,
    _module: Module,
}

impl Kernels {
    fn load(cuda: &CudaComm<'_>, mode: Mode) -> Result<Self, CoreError> {
        let m = match mode {
            Mode::LowLatency => cuda.compile(LL_KERNELS, "ll.cu")?,
            Mode::HighThroughput => cuda.compile(HT_KERNELS, "ht.cu")?,
        };
        Ok(Self {
            dispatch: m.function("ep_ll_dispatch")?,
            echo: m.function("ep_ll_echo")?,
            take: m.function("ep_ll_take_outputs")?,
            combine: m.function("ep_ll_combine")?,
            floor: m.function("ep_floor")?,
            ht: match mode {
                Mode::LowLatency => None,
                Mode::HighThroughput => Some(ht::HtFunctions::of(&m)?),
            },
            _module: m,
        })
    }
}

/// Compiles and loads the kernels on every rank (collective): a rank that
/// cannot (no NVRTC, a compile error) fails with its reason, and every
/// other rank with an error naming it, rather than waiting for it later.
fn load_agreed(cuda: &CudaComm<'_>, mode: Mode) -> Result<Kernels, EpError> {
    let comm = cuda.comm();
    let k = Kernels::load(cuda, mode);
    let all = comm.bootstrap().allgather(&[u8::from(k.is_ok())])?;
    let k = k?;
    match all.iter().position(|v| v.first() != Some(&1)) {
        Some(p) => Err(EpError::Mode {
            rank: comm.rank(),
            what: format!(
                "rank {p} could not compile gin-ep's CUDA kernels ({})",
                match mode {
                    Mode::LowLatency => "kernels/ll.cu",
                    Mode::HighThroughput => "kernels/ll.cu and kernels/ht.cu",
                }
            ),
        }),
        None => Ok(k),
    }
}

/// Collective, high-throughput mode: every rank's channel blocks fit its
/// GPU at once beside those of the ranks sharing it ([`resident::check`],
/// on the all-gathered seats, so every rank decides alike). Ranks sharing
/// a GPU without MPS are warned about (their kernels take turns), not
/// refused.
fn agree_resident(cuda: &CudaComm<'_>, cfg: &Config, f: &ht::HtFunctions) -> Result<(), EpError> {
    let comm = cuda.comm();
    let d = cuda.device();
    // A rank whose occupancy query fails says so with the driver's error:
    // every rank then refuses, naming that rank and the error.
    let per_sm = [f.dispatch, f.combine]
        .iter()
        .map(|k| k.blocks_per_sm(THREADS))
        .try_fold(u32::MAX, |least, n| n.map(|n| least.min(n)))
        .map_err(|e| e.to_string());
    let me = resident::Seat {
        gpu: d.uuid().map(str::to_owned),
        sms: d.sms(),
        blocks_per_sm: per_sm,
        mps: d.mps(),
    };
    let all = comm.bootstrap().allgather(&me.to_bytes())?;
    let seats: Vec<resident::Seat> = all.iter().map(|b| resident::Seat::from_bytes(b)).collect();
    for (gpu, ranks) in resident::time_sliced(&seats) {
        // Once per GPU: by its lowest rank.
        if ranks.first() == Some(&comm.rank()) {
            tracing::warn!(
                gpu = %gpu,
                ranks = ?ranks,
                "ranks {ranks:?} share GPU {gpu} without MPS: their high-throughput kernels take \
                 turns on it (time-sliced), and a channel waits for its peers' blocks to be \
                 scheduled; start the MPS daemon (nvidia-cuda-mps-control -d) for them to run \
                 side by side"
            );
        }
    }
    resident::check(comm.rank(), cfg.channels, &seats)
}

/// Resets a launch clock to {no start yet, no end yet}.
fn reset_clock(clock: &DevMem) -> Result<(), CoreError> {
    Ok(clock.write(0, &[u64::MAX, 0])?)
}

/// The earliest block start and the latest block end of the last launch
/// (%globaltimer ns).
fn read_clock(clock: &DevMem) -> Result<KernelClock, CoreError> {
    let mut c = [0u64; 2];
    clock.read(0, &mut c)?;
    Ok(KernelClock {
        start_ns: c[0],
        end_ns: c[1],
    })
}

/// When a launch ran on the GPU, by its `%globaltimer` (nanoseconds; one
/// clock for every process on a GPU, and kept close to the host's across
/// the GPUs of one machine): from the earliest block start to the latest
/// block end.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KernelClock {
    /// The earliest block start.
    pub start_ns: u64,
    /// The latest block end.
    pub end_ns: u64,
}

impl KernelClock {
    /// Microseconds from start to end.
    pub fn us(&self) -> f64 {
        self.end_ns.saturating_sub(self.start_ns) as f64 / 1e3
    }
}

/// A CUDA rank's expert-parallel buffer: the windows of [`crate::ll`] (or,
/// in high-throughput mode, of [`crate::ht`]) in GPU memory, a device
/// communicator, and the kernels.
/// Created collectively with the same [`Config`] on every rank; steps are
/// collective too.
#[derive(Debug)]
pub struct CudaBuffer<'a, 'c> {
    cuda: &'a CudaComm<'c>,
    dc: CudaDevComm<'a, 'c>,
    cfg: Config,
    rank: usize,
    nranks: usize,
    wins: Vec<GpuWindow>,
    state: State,
    kernels: Kernels,
    active: Vec<bool>,
    /// Where the steps stand, what is queued, whether one failed.
    st: steps::Steps,
    /// Watches the job while launches queued on a caller's stream run:
    /// started before the first of them after a check, handed to gin-core's
    /// check by [`CudaBuffer::check`].
    watcher: Option<Watcher>,
    blocks: u32,
    /// Host staging of the send window, reused between steps.
    staged: Vec<u8>,
    /// The last dispatch and combine launches (GPU clock).
    last: (KernelClock, KernelClock),
    /// The last dispatch kernel alone (in low-latency mode `last.0`).
    last_dispatch_kernel: KernelClock,
    /// `[owner]`: whether this rank reads `owner`'s combine slots in place.
    reads: Vec<bool>,
    /// High-throughput mode's device memory and staging.
    ht: Option<ht::HtState>,
}

/// What a CUDA rank received in one low-latency dispatch: per (local
/// expert, source) pair, the count and each token's metadata, read back
/// and checked; the payloads stay in GPU memory
/// ([`CudaBuffer::ll_received`] copies them back).
#[derive(Debug, Clone)]
pub struct CudaLlDispatch {
    step: u64,
    tokens: usize,
    nranks: usize,
    max: usize,
    /// `[le * nranks + src]`.
    counts: Vec<u32>,
    /// `[3 * ((le * nranks + src) * max + i)]`: token, top-k slot, weight.
    meta: Vec<u32>,
}

/// A low-latency step under way on CUDA ranks, its outputs in GPU memory
/// ([`CudaBuffer::ll_dispatch_device`], [`CudaBuffer::ll_dispatch_on`]):
/// hand it to the combine of the same step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaLlStep {
    step: u64,
    tokens: usize,
}

impl CudaLlStep {
    /// Tokens this rank dispatched (rows of the combine's output).
    pub fn tokens(&self) -> usize {
        self.tokens
    }
}

impl CudaLlDispatch {
    /// The step this dispatch belongs to, for the device-resident calls
    /// ([`CudaBuffer::ll_echo_device`], [`CudaBuffer::ll_combine_device`]).
    pub fn handle(&self) -> CudaLlStep {
        CudaLlStep {
            step: self.step,
            tokens: self.tokens,
        }
    }

    fn at(&self, le: usize, src: usize, i: usize) -> usize {
        3 * ((le * self.nranks + src) * self.max + i)
    }

    /// Tokens received from `src` for local expert `le`: one contiguous
    /// block, in the source's token order.
    pub fn count(&self, le: usize, src: usize) -> usize {
        self.counts[le * self.nranks + src] as usize
    }

    /// The index, at its source, of the `i`th token from `src` for `le`.
    pub fn src_token(&self, le: usize, src: usize, i: usize) -> usize {
        self.meta[self.at(le, src, i)] as usize
    }

    /// The top-k weight the source gave this expert for that token.
    pub fn weight(&self, le: usize, src: usize, i: usize) -> f32 {
        f32::from_bits(self.meta[self.at(le, src, i) + 2])
    }
}

/// A CUDA dispatch with its payloads copied back, for checks
/// ([`crate::oracle::LlView`]).
#[derive(Debug, Clone)]
pub struct LlReceived {
    d: CudaLlDispatch,
    payload: usize,
    msg: usize,
    /// Per pair, its received messages.
    msgs: Vec<Vec<u8>>,
}

impl crate::oracle::LlView for LlReceived {
    fn count(&self, le: usize, src: usize) -> usize {
        self.d.count(le, src)
    }
    fn src_token(&self, le: usize, src: usize, i: usize) -> usize {
        self.d.src_token(le, src, i)
    }
    fn weight(&self, le: usize, src: usize, i: usize) -> f32 {
        self.d.weight(le, src, i)
    }
    fn payload(&self, le: usize, src: usize, i: usize) -> Result<&[u8], String> {
        let q = le * self.d.nranks + src;
        self.msgs
            .get(q)
            .and_then(|m| m.get(i * self.msg..i * self.msg + self.payload))
            .ok_or_else(|| format!("no received token {i} from rank {src} for local expert {le}"))
    }
}

impl<'a, 'c> CudaBuffer<'a, 'c> {
    /// Creates the buffer collectively on CUDA ranks: checks `cfg` and that
    /// every rank passed the same one (before any window exists), then
    /// allocates the mode's windows in GPU memory (low-latency: a device
    /// communicator with one signal per (expert, source) for each phase;
    /// high-throughput: the CPU ranks' windows and signals, one context per
    /// channel, which needs hosts of equal size numbered host by host), and
    /// compiles the kernels with NVRTC.
    pub fn new(cuda: &'a CudaComm<'c>, cfg: Config) -> Result<Self, EpError> {
        let comm = cuda.comm();
        let (rank, n) = (comm.rank(), comm.nranks());
        crate::buffer::agree_config(comm, &cfg)?;
        let kernels = load_agreed(cuda, cfg.mode)?;
        if let Some(f) = &kernels.ht {
            agree_resident(cuda, &cfg, f)?;
        }
        // Every rank passed the same configuration and host map: all take
        // the same branch, and refuse alike.
        let (signals, contexts, mut sizes, hosts) = match cfg.mode {
            Mode::LowLatency => {
                let (signals, sizes) = crate::ll::resources(&cfg, n);
                (signals, 1, sizes, None)
            }
            Mode::HighThroughput => {
                let ids = comm
                    .bootstrap()
                    .allgather(comm.settings().host_id.as_bytes())?;
                let hosts = crate::Hosts::from_ids(&ids);
                let (signals, contexts, sizes) = crate::ht::resources(&cfg, rank, &hosts)?;
                (signals, contexts, sizes, hosts.ranks_per_host)
            }
        };
        let req = DevCommRequirements {
            signals,
            counters: 1,
            contexts,
            ..DevCommRequirements::default()
        };
        let dc = cuda.dev_comm(&req, CtxSharing::Gpu)?;
        // High-throughput mode: CGET (the last window) is allocated once
        // the others are mapped: its size depends on which same-host peers'
        // combine rows are read in place and which are fetched by get.
        // Low-latency mode allocates its windows at once.
        let first = match hosts {
            Some(_) => {
                debug_assert_eq!(crate::ht::CGET + 1, sizes.len());
                crate::ht::CGET
            }
            None => sizes.len(),
        };
        let mut wins = sizes[..first]
            .iter()
            .map(|&b| cuda.alloc_window(b.max(64) as u64))
            .collect::<Result<Vec<_>, _>>()?;
        let direct: Vec<bool> = hosts.map_or_else(Vec::new, |l| {
            (0..n)
                .map(|p| {
                    p == rank
                        || (p / l == rank / l
                            && dc.is_lsa(p)
                            && wins[crate::ht::plan::CSEND]
                                .peer_base(p)
                                .is_some_and(|b| b != 0))
                })
                .collect()
        });
        if let Some(l) = hosts {
            let fetch = ht::fetches_rows(rank, l, &direct);
            sizes[crate::ht::CGET] = ht::cget_bytes(&cfg, l, fetch);
            wins.push(cuda.alloc_window(sizes[crate::ht::CGET].max(64) as u64)?);
        }
        cuda.device().make_current().map_err(CoreError::from)?;
        let state = State::new(&cfg, n, cfg.mode == Mode::LowLatency)?;
        let ht = match hosts {
            Some(l) => {
                let s = crate::ht::plan::Shape::of(&cfg, n, l);
                if s.l + s.h > ht::MAX_ROWS {
                    return Err(EpError::Config {
                        rank,
                        field: "ranks per host + hosts",
                        value: s.l + s.h,
                        why: "at most 320 on CUDA ranks: the rows one combine batch of the \
                              high-throughput kernels holds",
                    });
                }
                // The kernels take CGET's rows from this size (local_size).
                let cget = wins[crate::ht::CGET].local().len();
                ht::check_cget(&cfg, rank, l, cget, &direct)?;
                // The notify kernel's rows (NRECV's two halves) and row.
                ht::check_notify_windows(
                    &s,
                    rank,
                    wins[crate::ht::plan::NSEND].local().len(),
                    wins[crate::ht::plan::NRECV].local().len(),
                )?;
                Some(ht::HtState::new(s, rank, &cfg, &direct)?)
            }
            None => None,
        };
        let mut me = Self {
            cuda,
            dc,
            cfg,
            rank,
            nranks: n,
            wins,
            state,
            kernels,
            active: vec![true; n],
            st: steps::Steps::new(rank),
            watcher: None,
            blocks: BLOCKS,
            staged: Vec::new(),
            last: (KernelClock::default(), KernelClock::default()),
            last_dispatch_kernel: KernelClock::default(),
            reads: Vec::new(),
            ht,
        };
        me.write_active()?;
        if cfg.mode == Mode::LowLatency {
            me.agree_pull()?;
        }
        Ok(me)
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks of the job.
    pub fn nranks(&self) -> usize {
        self.nranks
    }

    /// Which ranks take part (a masked rank's experts are empty slots).
    pub fn active(&self) -> &[bool] {
        &self.active
    }

    /// The backend the device communicator uses ("load/store", "proxy",
    /// "gdaki", "load/store + proxy").
    pub fn backend_name(&self) -> &'static str {
        self.dc.backend_name()
    }

    /// Masks or unmasks `peer` between steps (every rank must apply the
    /// same mask before the next step).
    pub fn set_active(&mut self, peer: usize, active: bool) -> Result<(), EpError> {
        if peer >= self.nranks {
            return Err(EpError::Gin(gin_core::GinError::BadPeer {
                rank: self.rank,
                peer,
                nranks: self.nranks,
            }));
        }
        self.st.for_set_active()?;
        self.active[peer] = active;
        self.write_active()
    }

    /// Blocks per launch (at least 1; default 32). Every rank's grid must
    /// be resident at once, which bounds it where ranks share a GPU.
    pub fn set_blocks(&mut self, blocks: u32) {
        self.blocks = blocks.max(1);
    }

    /// When the last dispatch and combine kernels ran on the GPU (in
    /// high-throughput mode the dispatch's clock runs from the count
    /// exchange's start, that is the notify kernel's for host inputs and
    /// `ep_ht_layout`'s, queued right before it, for inputs in GPU memory,
    /// to the dispatch kernel's end: the host's plan between them counts,
    /// as DeepEP's CPU sync does).
    pub fn last_kernels(&self) -> (KernelClock, KernelClock) {
        self.last
    }

    /// When the last dispatch kernel alone ran (its first block's start to
    /// its last block's end): in high-throughput mode without the notify
    /// kernel, the host's plan and the tokens' copy that
    /// [`CudaBuffer::last_kernels`]'s dispatch clock includes; in
    /// low-latency mode the same clock.
    pub fn last_dispatch_kernel(&self) -> KernelClock {
        self.last_dispatch_kernel
    }

    /// Makes this rank's GPU current on the calling thread.
    fn current(&self) -> Result<(), EpError> {
        self.cuda.device().make_current().map_err(CoreError::from)?;
        Ok(())
    }

    /// Which combine slots each source reads in place (collective, at
    /// creation): this rank reads its own, and those of every peer the
    /// device communicator reaches by load/store and whose combine window
    /// is mapped here, unless `GIN_EP_COMBINE=put` (every expert output is
    /// put back, as before reads in place existed: for comparisons). The
    /// matrix is all-gathered, so that an expert knows which sources to put
    /// to, and copied to the GPU.
    fn agree_pull(&mut self) -> Result<(), EpError> {
        let (rank, n) = (self.rank, self.nranks);
        let put_only = std::env::var("GIN_EP_COMBINE").is_ok_and(|v| v == "put");
        let mine: Vec<u8> = (0..n)
            .map(|p| {
                let mapped = self.wins[CSEND].peer_base(p).is_some_and(|b| b != 0);
                u8::from(!put_only && (p == rank || (self.dc.is_lsa(p) && mapped)))
            })
            .collect();
        let all = self.cuda.comm().bootstrap().allgather(&mine)?;
        let matrix: Vec<u8> = all
            .iter()
            .flat_map(|row| (0..n).map(move |p| u8::from(row.get(p) == Some(&1))))
            .collect();
        self.reads = matrix[rank * n..(rank + 1) * n]
            .iter()
            .map(|&v| v == 1)
            .collect();
        self.current()?;
        self.state.pull.write(0, &matrix).map_err(CoreError::from)?;
        Ok(())
    }

    /// `[owner]`: whether this rank's combine reads `owner`'s expert
    /// outputs in place (its own, and load/store peers'), rather than
    /// receiving them by put; agreed by every rank when the buffer was
    /// created.
    pub fn combine_reads_in_place(&self) -> &[bool] {
        &self.reads
    }

    fn write_active(&mut self) -> Result<(), EpError> {
        self.current()?;
        let a: Vec<u32> = self.active.iter().map(|&b| u32::from(b)).collect();
        self.state.active.write(0, &a).map_err(CoreError::from)?;
        Ok(())
    }

    /// A call that waits for its kernel on gin's stream cannot follow
    /// launches queued on the caller's stream before they were checked
    /// (gin's stream is not ordered after the caller's).
    fn expect_unqueued(&self, call: &'static str) -> Result<(), EpError> {
        self.st.unqueued(call)
    }

    /// What the kernels recorded (read from pinned host memory, without
    /// waiting for a stream): each slot's word 0 first (a record publishes
    /// its other words before it).
    fn recorded(&self) -> Record {
        let word = |i: usize| {
            self.state
                .errh
                .atomic_u64(8 * i)
                .map_or(0, |a| a.load(Ordering::Acquire))
        };
        let mut w = [0u64; 2 * dev::WORDS];
        for slot in 0..2 {
            let at = slot * dev::WORDS;
            w[at] = word(at);
            if w[at] != 0 {
                for i in 1..dev::WORDS {
                    w[at + i] = word(at + i);
                }
            }
        }
        Record::of(w)
    }

    /// Reports the error a kernel recorded (a peer's broken protocol, or a
    /// refusal no waited dispatch or `check` dealt with), before or after a
    /// call on gin's stream with nothing queued unchecked: the buffer
    /// refuses further steps ([`Look::Waited`]).
    fn poll(&mut self) -> Result<(), EpError> {
        self.look(Look::Waited)
    }

    /// Acts on what a kernel recorded, as [`steps::Steps::judge`] rules for
    /// the place `look` names: nothing to report, or a refusal left for
    /// `check` (a queued call), goes on; a refusal found by a waited
    /// dispatch ends the step as every rank does ([`CudaBuffer::end_refused`])
    /// and is reported; one found by `check` is cleared and reported, the
    /// buffer staying usable where it stands; anything else fails the
    /// buffer and is reported.
    ///
    /// A broken protocol is reported whatever was recorded before it (a
    /// refusal recorded first cannot hide it: [`Record`]); a refusal
    /// recorded beside it is logged. A waited dispatch that finds both
    /// ends the refused step first (the other ranks are ending it, and
    /// would wait for this rank's signals until the job timeout), then
    /// fails.
    fn look(&mut self, look: Look) -> Result<(), EpError> {
        let rec = self.recorded();
        let Some(w) = rec.reported() else {
            return Ok(());
        };
        let Some(err) = decode_error(self.rank, &self.cfg, w) else {
            return Ok(());
        };
        let verdict = self.st.judge(Recorded::of(&rec), look);
        if rec.broken[0] != 0
            && rec.refused()
            && let Some(r) = decode_error(self.rank, &self.cfg, rec.first)
        {
            tracing::warn!(
                rank = self.rank,
                "recorded before the broken protocol reported ({err}): {r}"
            );
        }
        match verdict {
            Verdict::Go => Ok(()),
            Verdict::Fail => Err(err),
            Verdict::EndStep => {
                self.end_refused()?;
                Err(err)
            }
            Verdict::EndStepThenFail => {
                // The buffer failed already; the end's own error (a wait
                // timed out) says less than the broken protocol.
                if let Err(e) = self.end_refused() {
                    tracing::debug!(rank = self.rank, "ending the refused step: {e}");
                }
                Err(err)
            }
            Verdict::Report => {
                if let Err(e) = self.forget_refusal() {
                    self.st.fail();
                    return Err(e);
                }
                Err(err)
            }
        }
    }

    /// Forgets the refusal recorded in slot 0 once it was dealt with
    /// ([`dev::forget_refusal`]: exactly what the host read, even where a
    /// kernel still records); slot 1, a broken protocol, stays.
    fn forget_refusal(&self) -> Result<(), EpError> {
        self.current()?;
        dev::forget_refusal(&self.state)
    }

    /// A low-latency step's call: refused on a high-throughput buffer.
    fn ll_only(&self, call: &'static str) -> Result<(), EpError> {
        steps::expect_mode(self.rank, call, Mode::LowLatency, self.cfg.mode)
    }

    fn expect_idle(&self, call: &'static str) -> Result<(), EpError> {
        self.ll_only(call)?;
        self.st.idle(call)
    }

    fn expect_dispatch(&self, call: &'static str, step: u64) -> Result<(), EpError> {
        self.ll_only(call)?;
        self.st.dispatched(call, step)
    }

    fn grid(&self, items: usize) -> u32 {
        u32::try_from(items.max(1))
            .unwrap_or(u32::MAX)
            .min(self.blocks)
    }

    fn u32_of(v: usize) -> u32 {
        // Every size a kernel receives is a token count (at most
        // max_tokens_per_rank) or derived from the configuration, which
        // Config::validate bounds so that each fits a u32 (hidden ≤ 2^24,
        // topk ≤ 2^16, num_experts ≤ 2^24, max_tokens_per_rank < 2^31:
        // messages under 2^26 bytes): the saturation never happens.
        debug_assert!(u32::try_from(v).is_ok(), "{v} does not fit a u32");
        u32::try_from(v).unwrap_or(u32::MAX)
    }

    /// The launch clock of a launch: reset and timed on gin's stream (the
    /// host reads it after the wait), none on the caller's (the host would
    /// have to write it while earlier launches may still run).
    fn clock_for(&self, on: On<'_>) -> Result<u64, EpError> {
        match on {
            On::Wait => {
                reset_clock(&self.state.clock)?;
                Ok(self.state.clock.ptr())
            }
            On::Queue(_) => Ok(0),
        }
    }

    /// Before a launch on `on`: this rank's GPU current, and for one queued
    /// on the caller's stream a watcher running (started before the first
    /// such launch after a check, so that a dead peer, a failed transport
    /// or engine raises the abort flag and the queued kernels' waits give
    /// up at once rather than at the job timeout). A watcher that cannot
    /// start fails the call before anything is launched.
    ///
    /// A caller's stream of another context (another GPU, a context the
    /// caller created) is refused here, before the step's counters move or
    /// anything is launched, so the buffer stays usable.
    fn prepare_launch(&mut self, on: On<'_>) -> Result<(), EpError> {
        self.current()?;
        if let On::Queue(s) = on {
            s.check_context(self.cuda.device())
                .map_err(CoreError::from)?;
            self.watch()?;
        }
        Ok(())
    }

    /// After a launch: a failure fails the buffer (peers may be anywhere in
    /// the step); a launch queued on the caller's stream is to be checked.
    fn launched(
        &mut self,
        on: On<'_>,
        kernel: &'static str,
        r: Result<(), CoreError>,
    ) -> Result<(), EpError> {
        self.st.launched(matches!(on, On::Queue(_)), r.is_ok());
        r.map_err(|e| kernel_error(self.rank, kernel, e))
    }

    /// Launches the dispatch kernel for `tokens` tokens whose messages come
    /// from `src` (see [`Source`]), on `on`; the step begins.
    ///
    /// # Safety
    /// `src`'s non-zero addresses hold at least `tokens` rows each (`xin`:
    /// `tokens × hidden` u16, 16-byte aligned; `idx`, `wts`: `tokens ×
    /// topk` i64 and f32, aligned) and stay allocated and unwritten until
    /// the kernel has finished; `idx` and `wts` are both zero or both not.
    /// With [`On::Queue`], [`CudaDevComm::launch_on`]'s contract for the
    /// buffer's own memory: this buffer is not destroyed or dropped before
    /// the stream has executed the kernel.
    unsafe fn launch_dispatch(
        &mut self,
        on: On<'_>,
        tokens: usize,
        src: Source,
    ) -> Result<(), EpError> {
        let cfg = self.cfg;
        self.prepare_launch(on)?;
        let grid = self.grid(cfg.num_experts);
        // Before the step's counters move: a failure here launches nothing.
        let clock = self.clock_for(on)?;
        self.st.begin(tokens);
        let s = &self.state;
        let (l, t) = (cfg.local_experts(self.nranks), cfg.max_tokens_per_rank);
        let u = Self::u32_of;
        let args = [
            Arg::DevComm(self.dc.abi()),
            Arg::Window(self.wins[SEND].abi()),
            Arg::Window(self.wins[RECV].abi()),
            Arg::U32(u(tokens)),
            Arg::U32(u(l)),
            Arg::U32(u(t)),
            Arg::U32(u(cfg.msg_bytes())),
            Arg::U32(u(cfg.payload_bytes())),
            Arg::U32(u(cfg.topk)),
            Arg::Ptr(s.active.ptr()),
            Arg::Ptr(s.seen.ptr()),
            Arg::Ptr(s.counts.ptr()),
            Arg::Ptr(s.meta.ptr()),
            Arg::Ptr(clock),
            Arg::Ptr(src.xin),
            Arg::U32(u(cfg.hidden)),
            Arg::Ptr(s.bar.ptr()),
            Arg::Ptr(s.eslot.ptr()),
            Arg::U32(u32::from(cfg.fp8)),
            Arg::Ptr(src.idx),
            Arg::Ptr(src.wts),
            Arg::Ptr(s.inbad.ptr()),
            Arg::Ptr(s.err.ptr()),
            Arg::Ptr(s.errh.dev()),
            Arg::Ptr(s.ctarget.ptr()),
            Arg::U32(u32::from(src.refused)),
            Arg::Ptr(s.cpois.ptr()),
        ];
        // SAFETY: ep_ll_dispatch(DevComm, Window send, Window recv, u32
        // tokens, u32 l, u32 t, u32 m, u32 p, u32 k, const u32* active, u64*
        // seen, u32* counts, u32* meta, u64* clock, const u16* xin, u32 h,
        // u32* bar, u32* eslot, u32 fp8, const i64* idx,
        // const f32* wts, u64* inbad, u64* err, u64* errh, u64* ctarget,
        // u32 refused, u64* cpois) in
        // kernels/ll.cu takes these arguments in this order. The windows and
        // the device communicator are this buffer's, alive for the kernel
        // (the caller's contract where it is queued). The kernel reads and
        // writes `tokens` (≤ t) messages of the send window (t × m bytes),
        // indexes active and ctarget by rank (nranks entries), seen and
        // counts by pair (experts), cpois by rank (nranks u64), meta by
        // received slot (3 × experts × t
        // u32), eslot by (token, slot) (t × k u32), clock (2 u64, or null),
        // bar (the low u32 of a u64) and inbad (one u64 each), err (8 u64)
        // and errh (8 u64 of mapped pinned memory, Record::BYTES): the sizes
        // State::new allocated for this
        // configuration. It reads tokens × h u16 of xin and tokens × k of
        // idx and wts where they are not null: the caller's contract.
        let r = unsafe { go(&self.dc, self.kernels.dispatch, on, grid, &args) };
        self.launched(on, "dispatch", r)?;
        self.st.dispatched_now();
        if on == On::Wait {
            self.last.0 = read_clock(&self.state.clock)?;
            self.last_dispatch_kernel = self.last.0;
        }
        Ok(())
    }

    /// Low-latency dispatch on CUDA ranks from host memory: checks the
    /// inputs (no token is sent on an error: the kernel still runs, telling
    /// every peer that this rank's inputs were refused, every rank ends the
    /// step and this buffer stays usable; the error names the entry, each
    /// peer's [`EpError::PeerRefused`] this rank), stages each token's message in
    /// the send window, and runs the dispatch kernel, which puts every
    /// token into a slot of each rank holding one of its experts, signals
    /// every (expert, source) pair with its count, and waits (bounded) for
    /// every active source's count for every local expert. The counts and
    /// metadata are read back and checked.
    pub fn ll_dispatch(
        &mut self,
        x: &[Bf16],
        topk_idx: &[i64],
        topk_weights: &[f32],
    ) -> Result<CudaLlDispatch, EpError> {
        self.expect_idle("ll_dispatch")?;
        self.expect_unqueued("ll_dispatch")?;
        self.poll()?;
        let cfg = self.cfg;
        let layout = match crate::ll::check_inputs(
            self.rank,
            &cfg,
            &self.active,
            1,
            x.len(),
            topk_idx,
            topk_weights,
        ) {
            Ok(layout) => layout,
            Err(e) => return Err(self.ll_refuse(e)),
        };
        let tokens = layout.tokens;
        self.staged.resize(tokens * cfg.msg_bytes(), 0);
        if cfg.fp8 {
            // The kernel quantises the payloads from the BF16 tokens.
            write_metadata(&cfg, topk_idx, topk_weights, &mut self.staged);
        } else {
            write_messages(&cfg, x, topk_idx, topk_weights, &mut self.staged);
        }
        self.current()?;
        if !self.staged.is_empty() {
            self.wins[SEND]
                .local()
                .write(0, &self.staged)
                .map_err(CoreError::from)?;
        }
        let mut xin = 0;
        if let Some(m) = &self.state.xin {
            if !x.is_empty() {
                m.write(0, x).map_err(CoreError::from)?;
            }
            xin = m.ptr();
        }
        // SAFETY: gin's stream, waited for. With FP8, xin holds t × hidden
        // u16 (State::new), its first `tokens` rows written above; without,
        // it is null; the metadata is staged (no idx, wts).
        unsafe { self.launch_dispatch(On::Wait, tokens, Source::staged(xin))? };
        // A source's inputs were refused: the step ends on every rank.
        self.look(Look::AfterWaitedDispatch)?;
        let d = self.read_dispatch("ll_dispatch");
        // A sender broke the protocol: the step cannot be finished.
        if d.is_err() {
            self.st.fail();
        }
        d
    }

    /// This rank's inputs were refused by the host's checks (`err`, naming
    /// the entry, or the token count, a buffer's size or alignment of
    /// inputs in GPU memory), in a waited call: as with bad entries in GPU
    /// memory, the dispatch kernel runs, in its refusing form
    /// ([`Source::REFUSED`]: no token), so that it adds `POISON` to each of
    /// its (expert, source) signals and consumes every source's signal of
    /// the step; then this rank ends the step as every rank does
    /// ([`CudaBuffer::end_refused`]). Every peer's dispatch thus returns at
    /// once with [`EpError::PeerRefused`] naming this rank (a queued
    /// peer's `check`), and every buffer stays usable. Returns `err`, or
    /// where those launches failed, or a source broke the protocol in the
    /// same step, that error (the buffer then refuses further steps). The
    /// step is ended before a broken protocol is reported, so that no peer
    /// waits for this rank's signals until the job timeout.
    fn ll_refuse(&mut self, err: EpError) -> EpError {
        let r = (|| -> Result<(), EpError> {
            self.current()?;
            // SAFETY: gin's stream, waited for; 0 tokens and no source
            // (xin, idx and wts null): the kernel reads no input and
            // stages nothing.
            unsafe { self.launch_dispatch(On::Wait, 0, Source::REFUSED)? };
            let ended = self.end_refused();
            // This rank records no refusal of its own here (the host named
            // the entry) nor a source's (its kernel knows its own inputs
            // were refused): anything recorded is a source's broken
            // protocol, which fails the buffer, and says more than the
            // end's own error.
            self.poll()?;
            ended
        })();
        match r {
            Ok(()) => err,
            Err(e) => {
                self.st.fail();
                e
            }
        }
    }

    /// [`CudaBuffer::ll_refuse`] for a dispatch queued on `stream`, whose
    /// inputs in GPU memory the host's checks refused (`err`: the token
    /// count, a buffer's size or alignment): the refused step is queued to
    /// its end on this rank, as its peers run it, without the host
    /// touching anything a launch queued before may use: the dispatch
    /// kernel in its refusing form ([`Source::REFUSED`]: no token, every
    /// count poisoned, every source's signal of the step consumed), then a
    /// combine of 0 tokens into the buffer's own output (its signals; it
    /// puts the combine slots of what it received back unread: a refused
    /// step has no result on any rank). Returns `err`, the buffer idle and
    /// the step spent: queue nothing more for it. A stream of another
    /// context launches nothing and returns its own error (no peer learns
    /// of the refusal, as for any call refused before it launches); a
    /// launch that fails fails the buffer and returns its error.
    ///
    /// # Safety
    /// As [`CudaBuffer::ll_dispatch_on`] for the buffer and the stream.
    unsafe fn ll_refuse_on(&mut self, stream: StreamRef<'_>, err: EpError) -> EpError {
        let on = On::Queue(stream);
        // SAFETY: the caller's contract for the buffer and the stream; 0
        // tokens and no source: the kernel reads no input.
        if let Err(e) = unsafe { self.launch_dispatch(on, 0, Source::REFUSED) } {
            return e;
        }
        let out = self.state.out.ptr();
        // SAFETY: queued after the dispatch on the same stream (the
        // caller's contract); 0 tokens: the kernel writes nothing of `out`
        // (State::out, from cuMemAlloc).
        match unsafe { self.launch_combine(on, out, false) } {
            Ok(()) => err,
            Err(e) => {
                self.st.fail();
                e
            }
        }
    }

    /// Ends a refused step as every rank does (CPU ranks'
    /// `Buffer::ll_end_refused`), after its dispatch consumed every
    /// source's signal: no rank reads the step's tokens; the combine
    /// kernel, launched with 0 tokens and the counts zeroed, puts nothing
    /// and reduces nothing but sends its signals (each expert rank telling
    /// every source it is done with the step), waits for every expert's,
    /// and clears `inbad`. A source thus starts its next dispatch only
    /// after every expert rank consumed this step's signals (the reuse
    /// argument of a full step), and every counter advanced as in a full
    /// step. The recorded refusal is then cleared and the buffer takes the
    /// next step, whatever this rank's call was (host inputs, or inputs in
    /// GPU memory). Where that combine fails (a wait timed out, a peer was
    /// lost) the step failed midway: the buffer refuses further steps, so
    /// that no late signal of it is taken for the next step's.
    fn end_refused(&mut self) -> Result<(), EpError> {
        let r = (|| -> Result<(), EpError> {
            self.current()?;
            let n = self.state.counts.len();
            self.state.counts.zero_wait(0, n).map_err(CoreError::from)?;
            self.st.tokens = 0;
            let out = self.state.out.ptr();
            // SAFETY: gin's stream, waited for; 0 tokens: the kernel writes
            // nothing of `out` (State::out, from cuMemAlloc) and, the
            // counts zeroed, reads no slot.
            unsafe { self.launch_combine(On::Wait, out, false)? };
            self.forget_refusal()
        })();
        self.st.refused(r.is_ok());
        r
    }

    /// What a device-resident dispatch requires of the buffer before it
    /// launches (`look`: [`Look::Waited`] on gin's stream, [`Look::Queued`]
    /// on the caller's): a call out of order, or a failed buffer, is
    /// refused here, locally (no step starts).
    fn prepare_device(&mut self, call: &'static str, look: Look) -> Result<(), EpError> {
        self.expect_idle(call)?;
        self.look(look)
    }

    /// Where the dispatch kernel finds inputs in GPU memory, once the host
    /// checked their token count, sizes and alignment
    /// ([`check_device_inputs`]); an error here is a refusal of this
    /// rank's inputs, which the caller makes collective.
    fn device_source(&self, inp: &DeviceInputs<'_>) -> Result<Source, EpError> {
        check_device_inputs(
            self.rank,
            &self.cfg,
            inp.tokens,
            inp.x.into(),
            inp.topk_idx.into(),
            inp.topk_weights.into(),
        )?;
        Ok(Source {
            xin: inp.x.ptr(),
            idx: inp.topk_idx.ptr(),
            wts: inp.topk_weights.ptr(),
            refused: false,
        })
    }

    /// Low-latency dispatch from device-resident inputs (DeepEP's
    /// `low_latency_dispatch` on tensors in GPU memory): no host copy. The
    /// dispatch kernel stages each token's message itself (copying the BF16
    /// row, or quantising it to FP8 bit for bit as
    /// [`crate::num::quantize_fp8`]), checks every top-k entry as the host
    /// path does, sends, and receives; runs on gin's stream and returns
    /// when it has finished. The received tokens, counts and metadata stay
    /// in GPU memory ([`CudaBuffer::recv_tokens`],
    /// [`CudaBuffer::recv_counts`], [`CudaBuffer::recv_meta`], laid out as
    /// [`CudaBuffer::device_layout`] says), for the caller's expert kernel;
    /// [`CudaBuffer::ll_read_back`] copies them to the host for checks.
    ///
    /// The token count, the buffers' sizes and their alignment are checked
    /// on the host ([`EpError::TooManyTokens`], [`EpError::Shape`],
    /// [`EpError::Misaligned`]); an expert id out of range, an expert named
    /// twice in a token or a live slot's weight that is not finite is found
    /// by the kernel. Either way the refusal is collective, as for host
    /// inputs: this rank sends no token (the host refused: the kernel runs
    /// in its refusing form) and every receiver learns that its inputs
    /// were refused; this rank reports what it refused (the host's error,
    /// or the first bad entry as the host path would:
    /// [`EpError::ExpertOutOfRange`], [`EpError::DuplicateExpert`],
    /// [`EpError::BadWeight`]), the others a [`EpError::PeerRefused`]
    /// naming it; every rank ends the step (no rank waits for another), and
    /// every buffer takes the next step, whatever its call (host inputs,
    /// GPU memory, queued). Where this rank's end of the refused step fails
    /// (a wait timed out, a peer was lost), that error is returned instead
    /// and the buffer refuses further steps. A call out of order is refused
    /// locally, before any step starts.
    pub fn ll_dispatch_device(&mut self, inp: &DeviceInputs<'_>) -> Result<CudaLlStep, EpError> {
        self.expect_unqueued("ll_dispatch_device")?;
        self.prepare_device("ll_dispatch_device", Look::Waited)?;
        let src = match self.device_source(inp) {
            Ok(src) => src,
            Err(e) => return Err(self.ll_refuse(e)),
        };
        // SAFETY: gin's stream, waited for while `inp` borrows the buffers,
        // whose sizes and alignment device_source checked.
        unsafe { self.launch_dispatch(On::Wait, inp.tokens, src)? };
        // Refused inputs (this rank's, or a source's): the step ends on
        // every rank, so that no peer waits for it, and the buffer takes the
        // next step; a broken protocol fails it.
        self.look(Look::AfterWaitedDispatch)?;
        Ok(CudaLlStep {
            step: self.st.step,
            tokens: inp.tokens,
        })
    }

    /// [`CudaBuffer::ll_dispatch_device`] queued on the caller's `stream`
    /// (a stream of the GPU's primary context: PyTorch's current stream, a
    /// cudarc stream, one being captured into a CUDA graph), returning at
    /// once: no host synchronisation. A peer's broken protocol a kernel
    /// records is reported by the next call on this buffer that finds it,
    /// or by [`CudaBuffer::check`] once the stream has been synchronised
    /// (the buffer then refuses further steps). Refused inputs (this
    /// rank's, found by the dispatch kernel, or a source's) are reported by
    /// [`CudaBuffer::check`] alone, and leave the buffer usable: the queued
    /// calls go ahead (every peer's do too, its host not knowing yet), the
    /// refused step runs to its end on every rank (a refused source sends
    /// no token, every receiver counts 0 tokens from it), and nothing of it
    /// is taken for the next step (docs/ep.md, "Bad input"). Inputs the
    /// host's checks refuse (the token count, a buffer's size or
    /// alignment: [`EpError::TooManyTokens`], [`EpError::Shape`],
    /// [`EpError::Misaligned`]) are refused collectively too, and at once:
    /// this call queues the refused step to its end on `stream` (the
    /// dispatch kernel in its refusing form, sending no token but telling
    /// every peer, then a combine of 0 tokens, whose signals every peer's
    /// combine waits for) and returns the error, the buffer idle: queue no
    /// expert or combine for that step, and go on with the next one. Every
    /// peer's `check` reports [`EpError::PeerRefused`] naming this rank.
    /// The kernels'
    /// waits stay bounded by the job timeout, and give up at once when a
    /// peer dies or a transport or engine fails: the first launch queued
    /// after a check starts a watcher thread (one per checked span, not per
    /// launch), which [`CudaBuffer::check`] stops; a failed wait is
    /// reported there, naming the peer and the cause. After a failure, the launches queued
    /// behind it return at once. A stream of another context is refused
    /// before anything moves (nothing is launched, and no peer learns of
    /// it), as is a call out of order.
    ///
    /// Captured into a CUDA graph, each replay is a step: the kernels'
    /// arguments hold nothing step-dependent. Capture whole steps
    /// (dispatch, expert, combine); a replay reads the captured tensors (and
    /// token count). Call [`CudaBuffer::watch`] before replaying, and
    /// [`CudaBuffer::check`] after synchronising.
    ///
    /// # Safety
    /// The launches of one buffer must execute in the order they were
    /// queued, each after the previous one finished (queue them on one
    /// stream, or order the streams). `inp`'s buffers must stay allocated,
    /// and unwritten, until the stream has executed the dispatch; this
    /// buffer must not be destroyed or dropped before the stream has
    /// executed everything queued for it (synchronise it, then call
    /// [`CudaBuffer::check`]). `stream` must stay alive until then.
    pub unsafe fn ll_dispatch_on(
        &mut self,
        stream: StreamRef<'_>,
        inp: &DeviceInputs<'_>,
    ) -> Result<CudaLlStep, EpError> {
        self.prepare_device("ll_dispatch_on", Look::Queued)?;
        let src = match self.device_source(inp) {
            Ok(src) => src,
            // SAFETY: the caller's contract.
            Err(e) => return Err(unsafe { self.ll_refuse_on(stream, e) }),
        };
        // SAFETY: the caller's contract; sizes and alignment checked.
        unsafe { self.launch_dispatch(On::Queue(stream), inp.tokens, src)? };
        Ok(CudaLlStep {
            step: self.st.step,
            tokens: inp.tokens,
        })
    }

    /// Reads the counts and metadata back and checks them as the CPU ranks'
    /// receive does: a count above the maximum, a token index out of range
    /// or a message that does not name the expert is the sender's
    /// protocol error (recorded by the kernel, and checked again here).
    fn read_dispatch(&mut self, call: &'static str) -> Result<CudaLlDispatch, EpError> {
        self.expect_unqueued(call)?;
        self.poll()?;
        let (r, cfg) = (self.nranks, self.cfg);
        let (l, t) = (cfg.local_experts(r), cfg.max_tokens_per_rank);
        let mut counts = vec![0u32; l * r];
        self.state
            .counts
            .read(0, &mut counts)
            .map_err(CoreError::from)?;
        let mut meta = vec![0u32; 3 * l * r * t];
        self.state
            .meta
            .read(0, &mut meta)
            .map_err(CoreError::from)?;
        let d = CudaLlDispatch {
            step: self.st.step,
            tokens: self.st.tokens,
            nranks: r,
            max: t,
            counts,
            meta,
        };
        for le in 0..l {
            let e = self.rank * l + le;
            for src in 0..r {
                let bad = |what: String| EpError::Protocol {
                    rank: self.rank,
                    peer: src,
                    what,
                };
                let c = d.count(le, src);
                if c > t {
                    return Err(bad(format!(
                        "count {c} for expert {e}, above the maximum {t}"
                    )));
                }
                for i in 0..c {
                    let tok = d.src_token(le, src, i);
                    if tok >= t {
                        return Err(bad(format!(
                            "token index {tok} at or above the maximum {t} in expert {e}'s slots"
                        )));
                    }
                    if d.meta[d.at(le, src, i) + 1] as usize >= cfg.topk {
                        return Err(bad(format!(
                            "token {tok} in expert {e}'s slots does not name it"
                        )));
                    }
                }
            }
        }
        Ok(d)
    }

    /// Copies what a device-resident dispatch received (counts and
    /// metadata) to the host and checks it as [`CudaBuffer::ll_dispatch`]
    /// does: for tests and inspection, not the data path. The counts and
    /// metadata are this rank's own memory, rewritten only by its next
    /// dispatch: readable after the step's combine too (the received
    /// tokens are not: [`CudaBuffer::ll_received`]). After launches queued
    /// on a stream, synchronise it and call [`CudaBuffer::check`] first.
    pub fn ll_read_back(&mut self, s: &CudaLlStep) -> Result<CudaLlDispatch, EpError> {
        self.ll_only("ll_read_back")?;
        self.st.for_read_back("ll_read_back", s.step)?;
        let d = self.read_dispatch("ll_read_back");
        if d.is_err() {
            self.st.fail();
        }
        d
    }

    /// Copies the received messages of `d` back from GPU memory, for
    /// checks ([`crate::oracle::check_ll_view`]): only between the
    /// dispatch and the launch of the step's combine (refused after it).
    /// Once this rank's combine has signalled a peer, that peer may finish
    /// its own combine and dispatch its next step into this rank's receive
    /// slots. After launches queued on a stream, synchronise it and call
    /// [`CudaBuffer::check`] first.
    pub fn ll_received(&self, d: &CudaLlDispatch) -> Result<LlReceived, EpError> {
        self.ll_only("ll_received")?;
        self.st.for_received("ll_received", d.step)?;
        self.current()?;
        let (m, t) = (self.cfg.msg_bytes(), self.cfg.max_tokens_per_rank);
        let recv = self.wins[RECV].local();
        let msgs = d
            .counts
            .iter()
            .enumerate()
            .map(|(q, &c)| {
                let mut v = vec![0u8; c as usize * m];
                if !v.is_empty() {
                    recv.read(q * t * m, &mut v)?;
                }
                Ok(v)
            })
            .collect::<Result<Vec<_>, gin_core::cuda::CudaError>>()
            .map_err(CoreError::from)?;
        Ok(LlReceived {
            d: d.clone(),
            payload: self.cfg.payload_bytes(),
            msg: m,
            msgs,
        })
    }

    /// Where the device-resident outputs lie ([`LlDeviceLayout`]).
    pub fn device_layout(&self) -> LlDeviceLayout {
        LlDeviceLayout::new(&self.cfg, self.nranks)
    }

    /// The received messages in GPU memory (this rank's part of the
    /// receive window), laid out as [`CudaBuffer::device_layout`] says;
    /// valid from the end of the dispatch until this rank's combine is
    /// launched (queue the expert kernel that reads them before the
    /// combine): once the combine has signalled a peer, that peer may
    /// finish its own combine and dispatch its next step into these slots.
    pub fn recv_tokens(&self) -> &DevMem {
        self.wins[RECV].local()
    }

    /// The tokens received per (local expert, source) pair, `u32` each, in
    /// GPU memory.
    pub fn recv_counts(&self) -> &DevMem {
        &self.state.counts
    }

    /// Per received token, its index at its source, the top-k slot naming
    /// this rank's expert and the weight's bits (three `u32`), in GPU
    /// memory.
    pub fn recv_meta(&self) -> &DevMem {
        &self.state.meta
    }

    /// The expert outputs' slots in GPU memory (this rank's part of the
    /// combine window, BF16 `hidden` per slot, laid out as
    /// [`CudaBuffer::device_layout`] says): the caller's expert kernel
    /// writes slot `q · t + i` for the `i`th token of pair `q` between the
    /// dispatch and the combine, after the dispatch finished, and must have
    /// finished before the combine starts (queue the combine on the same
    /// stream with [`CudaBuffer::ll_combine_on`], or synchronise it before
    /// [`CudaBuffer::ll_combine_device`]): peers that read these slots in
    /// place rely on the combine's signal coming after them.
    pub fn combine_slots(&self) -> &DevMem {
        self.wins[CSEND].local()
    }

    /// Launches the identity expert.
    ///
    /// # Safety
    /// With [`On::Queue`], as [`CudaBuffer::ll_dispatch_on`].
    unsafe fn launch_echo(&mut self, on: On<'_>) -> Result<(), EpError> {
        self.prepare_launch(on)?;
        let cfg = self.cfg;
        let u = Self::u32_of;
        let grid = self.grid(cfg.num_experts);
        let args = [
            Arg::Window(self.wins[RECV].abi()),
            Arg::Window(self.wins[CSEND].abi()),
            Arg::U32(u(cfg.num_experts)),
            Arg::U32(u(cfg.max_tokens_per_rank)),
            Arg::U32(u(cfg.msg_bytes())),
            Arg::U32(u(2 * cfg.hidden)),
            Arg::Ptr(self.state.counts.ptr()),
            Arg::U32(u32::from(cfg.fp8)),
        ];
        // SAFETY: ep_ll_echo(Window recv, Window csend, u32 pairs, u32 t,
        // u32 m, u32 h2, const u32* counts, u32 fp8) takes these in this
        // order; it reads at most t slots per pair of recv (pairs × t × m
        // bytes; with FP8 the payload of h bytes and h / 128 scales, within
        // m) and writes as many of csend (pairs × t × h2): the windows' sizes
        // (ll::resources), both alive (the caller's contract where queued);
        // counts holds `pairs` u32.
        let r = unsafe { go(&self.dc, self.kernels.echo, on, grid, &args) };
        self.launched(on, "echo", r)
    }

    /// The identity expert on the GPU: copies every received token into its
    /// combine slot.
    pub fn ll_echo(&mut self, d: &CudaLlDispatch) -> Result<(), EpError> {
        self.ll_echo_device(&d.handle())
    }

    /// The identity expert of a device-resident step, on gin's stream.
    pub fn ll_echo_device(&mut self, s: &CudaLlStep) -> Result<(), EpError> {
        self.expect_dispatch("ll_echo", s.step)?;
        self.expect_unqueued("ll_echo")?;
        self.poll()?;
        // SAFETY: gin's stream, waited for.
        unsafe { self.launch_echo(On::Wait) }
    }

    /// The identity expert queued on the caller's `stream`.
    ///
    /// # Safety
    /// As [`CudaBuffer::ll_dispatch_on`].
    pub unsafe fn ll_echo_on(
        &mut self,
        stream: StreamRef<'_>,
        s: &CudaLlStep,
    ) -> Result<(), EpError> {
        self.expect_dispatch("ll_echo_on", s.step)?;
        self.look(Look::Queued)?;
        // SAFETY: the caller's contract.
        unsafe { self.launch_echo(On::Queue(stream)) }
    }

    /// Launches the copy of the caller's expert outputs (device address
    /// `src`, laid out as the combine slots) into the combine slots.
    ///
    /// # Safety
    /// `src` holds [`LlDeviceLayout::combine_bytes`] bytes, 16-byte
    /// aligned, readable until the kernel has finished; with
    /// [`On::Queue`], as [`CudaBuffer::ll_dispatch_on`].
    unsafe fn launch_take(&mut self, on: On<'_>, src: u64) -> Result<(), EpError> {
        self.prepare_launch(on)?;
        let cfg = self.cfg;
        let u = Self::u32_of;
        let grid = self.grid(cfg.num_experts);
        let args = [
            Arg::Window(self.wins[CSEND].abi()),
            Arg::Ptr(src),
            Arg::U32(u(cfg.num_experts)),
            Arg::U32(u(cfg.max_tokens_per_rank)),
            Arg::U32(u(2 * cfg.hidden)),
            Arg::Ptr(self.state.counts.ptr()),
        ];
        // SAFETY: ep_ll_take_outputs(Window csend, const u8* src, u32
        // pairs, u32 t, u32 h2, const u32* counts) takes these in this
        // order; it copies at most t slots of h2 bytes per pair from src
        // (pairs × t × h2 bytes: the caller's contract) to the same place
        // of csend (its size, ll::resources; alive, the caller's contract
        // where queued); counts holds `pairs` u32.
        let r = unsafe { go(&self.dc, self.kernels.take, on, grid, &args) };
        self.launched(on, "take_outputs", r)
    }

    /// What a combine from the caller's expert outputs checks first
    /// (`look` as for [`CudaBuffer::prepare_device`]): a call out of order
    /// is refused locally (no step is under way for it); the tensors'
    /// checks decide how the combine runs ([`combine_call`]), never whether.
    fn prepare_from(
        &mut self,
        call: &'static str,
        s: &CudaLlStep,
        expert_out: &DevMem,
        out: &DevMem,
        look: Look,
    ) -> Result<CombineCall, EpError> {
        self.expect_dispatch(call, s.step)?;
        self.look(look)?;
        Ok(combine_call(
            check_device_output(self.rank, &self.cfg, self.st.tokens, out.into()),
            check_expert_outputs(self.rank, &self.device_layout(), expert_out.into()),
        ))
    }

    /// [`CudaBuffer::ll_combine_device`] with the expert outputs in the
    /// caller's device memory (DeepEP's `low_latency_combine(x, ...)`, `x`
    /// of shape `[local experts, ranks × max tokens, hidden]`: the layout of
    /// [`CudaBuffer::combine_slots`], [`LlDeviceLayout::combine_offset`]):
    /// a kernel copies the received tokens' outputs into the combine slots
    /// (peers read those in place, so they must be in the buffer's window),
    /// then the combine runs; both on gin's stream, returning when done.
    ///
    /// An `out` the host's checks refuse is handled as by
    /// [`CudaBuffer::ll_combine_device`]. Expert outputs they refuse
    /// ([`EpError::Shape`], [`EpError::Misaligned`], naming "expert
    /// outputs") cannot be sent, so the combine is refused collectively,
    /// as a dispatch's inputs are: its kernel runs in its refusing form
    /// (nothing copied, nothing sent, each of this rank's combine signals
    /// marked refused), every source's combine writes nothing of its
    /// output and returns [`EpError::PeerRefusedCombine`] naming this rank
    /// (a queued one's [`CudaBuffer::check`]), this call returns the
    /// error, and every buffer takes the next step. Where the refused
    /// combine's own part fails (a wait timed out, a peer was lost), that
    /// error is returned instead and the buffer refuses further steps.
    ///
    /// The error ends the step: the combine ran, so a retry is refused
    /// ([`EpError::Phase`]); for a refused `out` the reduction went to the
    /// buffer's own memory and is not returned. Where both tensors are
    /// refused, the error names "combine output" (checked first), and the
    /// combine is still refused collectively (the expert outputs were not
    /// sent).
    pub fn ll_combine_from_device(
        &mut self,
        s: &CudaLlStep,
        expert_out: &DevMem,
        out: &DevMem,
    ) -> Result<(), EpError> {
        self.expect_unqueued("ll_combine_from_device")?;
        let call = self.prepare_from("ll_combine_from_device", s, expert_out, out, Look::Waited)?;
        // SAFETY: gin's stream, waited for while both are borrowed; their
        // sizes and alignment were checked, and a refused one is not
        // passed (combine_from).
        unsafe { self.combine_from(On::Wait, &call, expert_out.ptr(), out.ptr())? };
        self.after_waited_combine(call.err)
    }

    /// [`CudaBuffer::ll_combine_from_device`] queued on the caller's
    /// `stream`, returning at once. A tensor the host's checks refuse is
    /// handled as by [`CudaBuffer::ll_combine_from_device`], queued: the
    /// combine is queued all the same (in full into the buffer's own
    /// memory for a refused `out`, in its refusing form for refused expert
    /// outputs), and this call returns the error, the step ended (queue
    /// nothing more for it: a retry is refused, [`EpError::Phase`]); the
    /// peers' `check` reports a refused combine
    /// ([`EpError::PeerRefusedCombine`]), naming this rank. Only refused
    /// expert outputs reach the peers: a refused `out` alone is this
    /// rank's own (every peer's combine gives its normal result, and its
    /// `check` is clean). This rank's own `check` reports nothing of its
    /// refusal (the call returned it).
    ///
    /// In a CUDA graph: the refusal is decided at capture, so a graph
    /// captured from a call whose expert outputs were refused replays the
    /// combine in its refusing form on every replay (every replay is a
    /// refused combine, each peer's `check` reporting it), and one captured
    /// from a call whose `out` was refused replays the combine into the
    /// buffer's own memory, without an error; recapture with good
    /// tensors.
    ///
    /// # Safety
    /// As [`CudaBuffer::ll_combine_on`]; `expert_out` must stay allocated,
    /// and unwritten, until the stream has executed the combine.
    pub unsafe fn ll_combine_from_on(
        &mut self,
        stream: StreamRef<'_>,
        s: &CudaLlStep,
        expert_out: &DevMem,
        out: &DevMem,
    ) -> Result<(), EpError> {
        let call = self.prepare_from("ll_combine_from_on", s, expert_out, out, Look::Queued)?;
        // SAFETY: the caller's contract; sizes and alignment checked, and
        // a refused tensor is not passed (combine_from).
        unsafe { self.combine_from(On::Queue(stream), &call, expert_out.ptr(), out.ptr())? };
        call.err.map_or(Ok(()), Err)
    }

    /// The copy of the caller's expert outputs (device address
    /// `expert_out`) into the combine slots, unless the combine is refused,
    /// then the combine as `call` says ([`CudaBuffer::launch_combine_as`]).
    ///
    /// # Safety
    /// As [`CudaBuffer::launch_take`] for `expert_out` unless
    /// `call.refusing`, and [`CudaBuffer::launch_combine_as`] for `out`.
    unsafe fn combine_from(
        &mut self,
        on: On<'_>,
        call: &CombineCall,
        expert_out: u64,
        out: u64,
    ) -> Result<(), EpError> {
        // SAFETY: the caller's contract.
        unsafe {
            if !call.refusing {
                self.launch_take(on, expert_out)?;
            }
            self.launch_combine_as(on, call, out)
        }
    }

    /// Launches the combine as `call` says: into `out`, or into the
    /// buffer's own memory (`State::out`, t × hidden u16, allocated once
    /// with the buffer) where the caller's output was refused or the
    /// combine is; in its refusing form where the expert outputs were
    /// refused.
    ///
    /// Queued on a caller's stream, the sink is written by a launch on
    /// that stream and read by nobody; the buffer's other uses of it are
    /// ordered after it: a later queued launch of this buffer runs after
    /// it (the `_on` calls' contract: one buffer's launches execute in the
    /// order queued), and the calls on gin's stream that write it and read
    /// it back ([`CudaBuffer::ll_combine`]) are refused until the caller
    /// synchronised the stream and called [`CudaBuffer::check`]. The host
    /// never writes it.
    ///
    /// # Safety
    /// Unless `call.sink`, as [`CudaBuffer::launch_combine`] for `out`;
    /// with [`On::Queue`], as [`CudaBuffer::ll_dispatch_on`].
    unsafe fn launch_combine_as(
        &mut self,
        on: On<'_>,
        call: &CombineCall,
        out: u64,
    ) -> Result<(), EpError> {
        let out = if call.sink { self.state.out.ptr() } else { out };
        // SAFETY: the caller's contract for `out`; State::out holds t ×
        // hidden u16 (tokens ≤ t), from cuMemAlloc (aligned).
        unsafe { self.launch_combine(on, out, call.refusing) }
    }

    /// After a waited combine's kernel finished: what the kernels recorded
    /// ([`Look::AfterWaitedCombine`]: an expert rank's refused combine is
    /// reported and cleared, the buffer usable; a broken protocol fails
    /// it), then this rank's own refused tensor (`own`), which wins over a
    /// peer's refusal recorded beside it (logged) but not over a failure.
    fn after_waited_combine(&mut self, own: Option<EpError>) -> Result<(), EpError> {
        match (self.look(Look::AfterWaitedCombine), own) {
            (Ok(()), None) => Ok(()),
            (Ok(()), Some(e)) | (Err(e), None) => Err(e),
            (Err(e), Some(own)) if self.st.failed => {
                tracing::warn!(
                    rank = self.rank,
                    "beside this rank's refused tensor ({own})"
                );
                Err(e)
            }
            (Err(e), Some(own)) => {
                tracing::warn!(rank = self.rank, "beside this rank's refused tensor: {e}");
                Err(own)
            }
        }
    }

    /// Launches the combine kernel of the step under way, writing the
    /// combined tokens to `out` (device address); the step ends.
    /// `refusing`: this rank's expert outputs were refused (the kernel
    /// sends none, marks each of its combine signals refused and writes
    /// nothing of `out`).
    ///
    /// # Safety
    /// `out` holds `tokens × hidden` u16, 16-byte aligned, writable and
    /// otherwise untouched until the kernel has finished; with
    /// [`On::Queue`], as [`CudaBuffer::ll_dispatch_on`].
    unsafe fn launch_combine(
        &mut self,
        on: On<'_>,
        out: u64,
        refusing: bool,
    ) -> Result<(), EpError> {
        self.prepare_launch(on)?;
        let cfg = self.cfg;
        let tokens = self.st.tokens;
        let clock = self.clock_for(on)?;
        let grid = self.grid(cfg.num_experts.max(tokens));
        let s = &self.state;
        let u = Self::u32_of;
        let args = [
            Arg::DevComm(self.dc.abi()),
            Arg::Window(self.wins[SEND].abi()),
            Arg::Window(self.wins[CSEND].abi()),
            Arg::Window(self.wins[CRECV].abi()),
            Arg::U32(u(tokens)),
            Arg::U32(u(cfg.local_experts(self.nranks))),
            Arg::U32(u(cfg.max_tokens_per_rank)),
            Arg::U32(u(cfg.msg_bytes())),
            Arg::U32(u(cfg.payload_bytes())),
            Arg::U32(u(cfg.topk)),
            Arg::U32(u(cfg.hidden)),
            Arg::Ptr(s.active.ptr()),
            Arg::Ptr(s.counts.ptr()),
            Arg::Ptr(s.meta.ptr()),
            Arg::Ptr(s.ctarget.ptr()),
            Arg::Ptr(out),
            Arg::Ptr(clock),
            Arg::Ptr(s.eslot.ptr()),
            Arg::Ptr(s.pull.ptr()),
            Arg::Ptr(s.inbad.ptr()),
            Arg::Ptr(s.cpois.ptr()),
            Arg::Ptr(s.err.ptr()),
            Arg::Ptr(s.errh.dev()),
            Arg::U32(u32::from(refusing)),
        ];
        // SAFETY: ep_ll_combine(DevComm, Window send, Window csend, Window
        // crecv, u32 tokens, u32 l, u32 t, u32 m, u32 p, u32 k, u32 h, const
        // u32* active, const u32* counts, const u32* meta, const u64*
        // ctarget, u16* out, u64* clock, const u32* eslot, const u8* pull,
        // u64* inbad, u64* cpois, u64* err, u64* errh, u32 refused) takes
        // these in this order. It reads
        // the `tokens` messages this step's dispatch staged, slots of csend
        // and crecv within their sizes (ll::resources; metadata out of range
        // is skipped), peers' csend slots through their mappings only after
        // checking the slot against the peer part's size, and writes tokens
        // × hidden u16 of out (the caller's contract), the 2 u64 of clock
        // (or none: null) and the u64 of inbad; active, ctarget and cpois
        // hold nranks entries, pull nranks × nranks, counts and meta the
        // dispatch's, eslot t × k, err and errh (mapped pinned memory)
        // Record::BYTES.
        let r = unsafe { go(&self.dc, self.kernels.combine, on, grid, &args) };
        self.launched(on, "combine", r)?;
        self.st.combined();
        if on == On::Wait {
            self.last.1 = read_clock(&self.state.clock)?;
        }
        Ok(())
    }

    /// Low-latency combine on CUDA ranks: the combine kernel puts each
    /// combine slot back to its source's (token, top-k slot) place, except
    /// to sources that read this rank's slots in place
    /// ([`CudaBuffer::combine_reads_in_place`]), with one signal per
    /// (expert, source); waits (bounded) for every active expert's signal,
    /// and reduces each token over its top-k slots with the weights (read
    /// in place where it can, else from where the expert put them), leaving
    /// out empty slots and masked ranks' experts. The combined tokens are
    /// read back. Where an expert rank refused the combine (its expert
    /// outputs refused by its host: [`CudaBuffer::ll_combine_from_device`])
    /// the step has no result: this returns [`EpError::PeerRefusedCombine`]
    /// naming it, and the buffer takes the next step.
    pub fn ll_combine(&mut self, d: &CudaLlDispatch) -> Result<Combined, EpError> {
        self.expect_dispatch("ll_combine", d.step)?;
        self.expect_unqueued("ll_combine")?;
        self.poll()?;
        let out = self.state.out.ptr();
        // SAFETY: gin's stream, waited for; State::out holds t × hidden u16
        // (tokens ≤ t), from cuMemAlloc (aligned).
        unsafe { self.launch_combine(On::Wait, out, false)? };
        // A refused combine wrote nothing: never read back a stale output.
        self.after_waited_combine(None)?;
        self.read_combined()
    }

    /// The step's combined tokens, read back from `State::out` (LL and HT
    /// combines on CUDA ranks write them there).
    fn read_combined(&self) -> Result<Combined, EpError> {
        let mut raw = vec![0u16; self.st.tokens * self.cfg.hidden];
        if !raw.is_empty() {
            self.state.out.read(0, &mut raw).map_err(CoreError::from)?;
        }
        Ok(Combined {
            x: raw.into_iter().map(Bf16).collect(),
            lost: Vec::new(),
        })
    }

    /// The combine of a device-resident step (DeepEP's
    /// `low_latency_combine`): reads the expert outputs from
    /// [`CudaBuffer::combine_slots`] (written by the caller's expert kernel
    /// after the dispatch) and writes the combined tokens, `tokens × hidden`
    /// BF16, into `out`, the caller's device memory (size and alignment
    /// checked); on gin's stream, returning when it has finished. Bit for
    /// bit what [`CudaBuffer::ll_combine`] returns.
    ///
    /// An `out` the host's checks refuse ([`EpError::Shape`],
    /// [`EpError::Misaligned`], naming "combine output") is no reason to
    /// stop the step: every peer's combine waits for this rank's signals,
    /// and this rank's expert outputs do not depend on `out`. The combine
    /// runs in full, its reduction written into the buffer's own memory
    /// (allocated with the buffer) and `out` left untouched; then this
    /// returns the error. Every peer's combine gives its normal result, and
    /// every buffer takes the next step. Where an expert rank refused the
    /// combine, this returns [`EpError::PeerRefusedCombine`] naming it and
    /// `out` is untouched: the step has no result. A call out of order is
    /// refused locally.
    ///
    /// An error for a refused `out` ends the step: the combine ran, so a
    /// retry is refused ([`EpError::Phase`]), and the reduction, written
    /// into the buffer's own memory, is not returned.
    pub fn ll_combine_device(&mut self, s: &CudaLlStep, out: &DevMem) -> Result<(), EpError> {
        self.expect_dispatch("ll_combine_device", s.step)?;
        self.expect_unqueued("ll_combine_device")?;
        self.poll()?;
        let call = combine_call(
            check_device_output(self.rank, &self.cfg, self.st.tokens, out.into()),
            Ok(()),
        );
        // SAFETY: gin's stream, waited for while `out` is borrowed; its size
        // and alignment were checked (refused: not passed).
        unsafe { self.launch_combine_as(On::Wait, &call, out.ptr())? };
        self.after_waited_combine(call.err)
    }

    /// [`CudaBuffer::ll_combine_device`] queued on the caller's `stream`,
    /// returning at once. A refused `out` is handled as there, queued: the
    /// combine is queued in full into the buffer's own memory, and this
    /// returns the error, the step ended (queue nothing more for it: a
    /// retry is refused, [`EpError::Phase`]). An expert rank's refused
    /// combine is reported by [`CudaBuffer::check`]
    /// ([`EpError::PeerRefusedCombine`]), `out` untouched.
    ///
    /// # Safety
    /// As [`CudaBuffer::ll_dispatch_on`]; `out` must stay allocated, and
    /// untouched, until the stream has executed the combine.
    pub unsafe fn ll_combine_on(
        &mut self,
        stream: StreamRef<'_>,
        s: &CudaLlStep,
        out: &DevMem,
    ) -> Result<(), EpError> {
        self.expect_dispatch("ll_combine_on", s.step)?;
        self.look(Look::Queued)?;
        let call = combine_call(
            check_device_output(self.rank, &self.cfg, self.st.tokens, out.into()),
            Ok(()),
        );
        // SAFETY: the caller's contract; size and alignment checked
        // (refused: not passed).
        unsafe { self.launch_combine_as(On::Queue(stream), &call, out.ptr())? };
        call.err.map_or(Ok(()), Err)
    }

    /// Starts watching the job until the next [`CudaBuffer::check`], if no
    /// watch is running: the `_on` calls do so themselves; call it before
    /// replaying a CUDA graph captured from them (a replay queues nothing
    /// through this buffer), then synchronise and check as after the `_on`
    /// calls.
    ///
    /// # Errors
    /// gin-core's, when the watcher thread cannot be started.
    pub fn watch(&mut self) -> Result<(), EpError> {
        if self.watcher.is_none() {
            self.watcher = Some(self.dc.watch()?);
        }
        Ok(())
    }

    /// Once the stream that launches were queued on has been synchronised:
    /// stops the watcher that ran while they did, and reports a kernel's
    /// failure (a wait that ran out or was aborted, naming the peer, with
    /// the watcher's cause: a dead peer, a failed transport or engine) as
    /// [`EpError::Kernel`], and an error a kernel recorded as the waiting
    /// calls do. Checking while a kernel still runs misses what it does
    /// later, and lowers the abort flag under it.
    ///
    /// **Between a dispatch and its combine, an `Err` that leaves the
    /// buffer usable (a refusal, below) still leaves the step under way:
    /// queue its combine as usual, or every peer's combine waits for this
    /// rank's signals until the job timeout, and then fails.** (After any
    /// other error the buffer refuses further steps, its combine included:
    /// destroy it on every rank.)
    ///
    /// After a kernel's failure or a peer's broken protocol the buffer
    /// refuses further steps (a refused step that failed midway too: its
    /// late signals would be taken for the next step's). A broken protocol
    /// is reported whatever was recorded before it: a refusal recorded in
    /// an earlier step of the span does not hide it. Refused inputs in a
    /// step queued since the last check are reported here (the first one
    /// recorded: on the refused rank its entry,
    /// [`EpError::ExpertOutOfRange`], [`EpError::DuplicateExpert`] or
    /// [`EpError::BadWeight`]; on every other rank [`EpError::PeerRefused`]
    /// naming that rank; a refusal by the host's checks on a queued
    /// dispatch was returned by that call, and its peers' checks name it)
    /// and cleared, and so is a combine queued since the last check that
    /// an expert rank refused (its expert outputs refused by its host:
    /// [`EpError::PeerRefusedCombine`] naming it, the refusing rank's own
    /// `ll_combine_from_on` having returned its error, its `check` clean;
    /// a refused `out` is reported by the call alone, never to the peers);
    /// the buffer stays usable where it stands: idle, or,
    /// checked between a dispatch and its combine, holding that step, whose
    /// combine is queued next as usual (above). Every step dispatched
    /// since the last check runs to its end on every rank as queued: one
    /// refused nowhere gives its normal results, the refused step none on
    /// any rank (its combined tokens are not its tokens' combine), but the
    /// error cannot say which step it was, nor whether another was refused
    /// too: discard the results of every step whose dispatch was queued
    /// since the last check, or check once per step.
    pub fn check(&mut self) -> Result<(), EpError> {
        self.current()?;
        let r = self.dc.check(self.watcher.take());
        self.st.checked(r.is_ok());
        r.map_err(|e| kernel_error(self.rank, "queued", e))?;
        self.look(Look::Check)
    }

    /// Destroys the buffer collectively: stops the device communicator
    /// (every rank arrives), then frees the windows on every rank.
    ///
    /// # Errors
    /// Refused while launches queued on a caller's stream are unchecked
    /// (synchronise the stream, then call [`CudaBuffer::check`]): nothing
    /// tells the host they have finished (gin-core offers no CUDA event),
    /// and they use the buffer's memory, windows and device communicator.
    /// A refused buffer is leaked, not freed under kernels that may still
    /// run (its GPU memory stays allocated, its engine serving), and its
    /// peers' destroy fails at the bootstrap's timeout. Otherwise gin-core's
    /// errors.
    pub fn destroy(mut self) -> Result<(), EpError> {
        if let Err(e) = self.st.for_destroy() {
            std::mem::forget(self);
            return Err(e);
        }
        // A watch started for a graph's replays (`watch`) and never checked.
        drop(self.watcher.take());
        self.dc.destroy()?;
        for w in self.wins {
            self.cuda.free_window(w)?;
        }
        Ok(())
    }
}

/// The same-job floor of `gin-bench moe --device cuda`: a phase's bytes to
/// each peer by plain puts spread over as many blocks as the phase's
/// kernels run (`ep_floor`: each peer's bytes in equal parts, one put and
/// one signal per part), on its own device communicator and windows.
#[derive(Debug)]
pub struct CudaFloor<'a, 'c> {
    cuda: &'a CudaComm<'c>,
    dc: CudaDevComm<'a, 'c>,
    send: GpuWindow,
    recv: GpuWindow,
    block: u64,
    /// `u64[nranks]` each: bytes to each peer, dispatch and combine.
    disp: DevMem,
    comb: DevMem,
    clock: DevMem,
    target: u64,
    /// Blocks per peer.
    parts: u32,
    kernels: Kernels,
}

impl<'a, 'c> CudaFloor<'a, 'c> {
    /// Sets the floor up collectively; `disp[p]` and `comb[p]` are the bytes
    /// this rank sends peer `p` in each phase.
    pub fn new(cuda: &'a CudaComm<'c>, disp: &[u64], comb: &[u64]) -> Result<Self, EpError> {
        let n = cuda.comm().nranks();
        if disp.len() != n || comb.len() != n {
            return Err(EpError::Mode {
                rank: cuda.comm().rank(),
                what: format!(
                    "floor byte counts for {} and {} peers in a job of {n} ranks",
                    disp.len(),
                    comb.len()
                ),
            });
        }
        let kernels = load_agreed(cuda, Mode::LowLatency)?;
        // Every rank lays its peers' slots out alike: the largest message
        // any rank sends, agreed on by all (unequal token counts make
        // ranks' own maxima differ).
        let mine = disp.iter().chain(comb).copied().max().unwrap_or(8).max(8);
        let block = cuda
            .comm()
            .bootstrap()
            .allgather(&mine.to_le_bytes())?
            .iter()
            .filter_map(|b| Some(u64::from_le_bytes(b.as_slice().try_into().ok()?)))
            .max()
            .unwrap_or(mine)
            .max(mine);
        let req = DevCommRequirements {
            signals: 1,
            counters: 1,
            contexts: 1,
            ..DevCommRequirements::default()
        };
        let dc = cuda.dev_comm(&req, CtxSharing::Gpu)?;
        let send = cuda.alloc_window(block)?;
        let recv = cuda.alloc_window(block * n as u64)?;
        cuda.device().make_current().map_err(CoreError::from)?;
        let mem = |v: &[u64]| -> Result<DevMem, CoreError> {
            let m = DevMem::new(8 * v.len().max(2))?;
            m.write(0, v)?;
            Ok(m)
        };
        Ok(Self {
            disp: mem(disp)?,
            comb: mem(comb)?,
            clock: mem(&[0, 0])?,
            kernels,
            cuda,
            dc,
            send,
            recv,
            block,
            target: 0,
            parts: (BLOCKS / u32::try_from(n).unwrap_or(u32::MAX)).max(1),
        })
    }

    /// Spreads each peer's bytes over `blocks` blocks in all (at least one
    /// per peer), as [`CudaBuffer::set_blocks`] sets the phases' grid; the
    /// same on every rank.
    pub fn set_blocks(&mut self, blocks: u32) {
        let n = u32::try_from(self.cuda.comm().nranks()).unwrap_or(u32::MAX);
        self.parts = (blocks / n).max(1);
    }

    /// One exchange (the dispatch's bytes or the combine's); returns when
    /// its kernel ran on the GPU.
    pub fn step(&mut self, dispatch: bool) -> Result<KernelClock, EpError> {
        let n = self.cuda.comm().nranks();
        self.cuda.device().make_current().map_err(CoreError::from)?;
        let grid = Self::ranks_u32(n).saturating_mul(self.parts);
        self.target += u64::from(grid);
        reset_clock(&self.clock)?;
        let bytes = if dispatch { &self.disp } else { &self.comb };
        let args = [
            Arg::DevComm(self.dc.abi()),
            Arg::Window(self.send.abi()),
            Arg::Window(self.recv.abi()),
            Arg::U64(self.block),
            Arg::Ptr(bytes.ptr()),
            Arg::U64(self.target),
            Arg::Ptr(self.clock.ptr()),
        ];
        let rank = self.cuda.comm().rank();
        // SAFETY: ep_floor(DevComm, Window send, Window recv, u64 block,
        // const u64* bytes, u64 target, u64* clock) takes these in this
        // order; the blocks for a peer put parts of bytes[peer] ≤ block
        // bytes of send (block bytes) to the peer's recv at rank × block
        // (nranks × block bytes), nranks × parts blocks in all; bytes holds
        // nranks u64, clock 2.
        unsafe {
            self.dc
                .run(&self.kernels.floor, grid, THREADS, &args)
                .map_err(|e| kernel_error(rank, "floor", e))?;
        }
        Ok(read_clock(&self.clock)?)
    }

    fn ranks_u32(n: usize) -> u32 {
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    /// The backend of the floor's device communicator.
    pub fn backend_name(&self) -> &'static str {
        self.dc.backend_name()
    }

    /// Tears the floor down collectively.
    pub fn destroy(self) -> Result<(), EpError> {
        self.dc.destroy()?;
        self.cuda.free_window(self.send)?;
        self.cuda.free_window(self.recv)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NVRTC compiles the CUDA-rank kernels with gin-core's header tree, as
    /// [`CudaBuffer::new`] does at run time (no GPU needed, only libnvrtc:
    /// `.ci/nvcc-check` installs it). Skipped with a reason where NVRTC
    /// cannot be loaded, except under `GIN_REQUIRE_NVRTC=1`.
    #[test]
    fn nvrtc_compiles_the_ll_kernels_for_hopper_and_ampere() {
        assert_nvrtc_compiles(LL_KERNELS, "ll.cu");
    }

    /// NVRTC compiles `src` for Hopper and Ampere; skipped with a reason
    /// where NVRTC cannot be loaded, except under `GIN_REQUIRE_NVRTC=1`.
    pub(crate) fn assert_nvrtc_compiles(src: &str, name: &str) {
        for cc in [(9, 0), (8, 0)] {
            match gin_core::cuda::nvrtc::compile(src, name, cc) {
                Ok(cubin) => assert_eq!(&cubin.as_bytes()[..4], b"\x7fELF", "{cc:?}"),
                Err(CoreError::Unavailable { why, .. }) => {
                    assert!(
                        std::env::var_os("GIN_REQUIRE_NVRTC").is_none(),
                        "GIN_REQUIRE_NVRTC is set but NVRTC cannot be used: {why}"
                    );
                    eprintln!("skipped: NVRTC cannot be loaded ({why})");
                    return;
                }
                Err(e) => panic!("{name} for {cc:?}: {e}"),
            }
        }
    }

    /// The kernels the host launches exist under the names it looks up
    /// (`extern "C" __global__ void`, launch bounds allowed before the
    /// name).
    #[test]
    fn every_launched_kernel_is_defined() {
        for name in [
            "ep_ll_dispatch",
            "ep_ll_echo",
            "ep_ll_take_outputs",
            "ep_ll_combine",
            "ep_floor",
        ] {
            let defined = LL_KERNELS.lines().any(|l| {
                l.strip_prefix("extern \"C\" __global__ void ")
                    .is_some_and(|rest| {
                        rest.trim_start_matches("__launch_bounds__(EP_THREADS) ")
                            .starts_with(&format!("{name}("))
                    })
            });
            assert!(defined, "{name}");
        }
    }

    /// The watcher a buffer keeps beside the device communicator it owns
    /// (across its `&mut self` calls, until `check`) is gin-core's owned
    /// one: no borrow of the device communicator, movable with the buffer
    /// to another thread. (Compile-time: the test is that this builds.)
    #[test]
    fn the_buffers_watcher_is_owned() {
        fn owned<T: Send + 'static>() {}
        owned::<Watcher>();
        owned::<Option<Watcher>>();
    }

    /// The launch bounds the kernels promise ptxas are the block size the
    /// host launches.
    #[test]
    fn kernels_are_bounded_for_the_block_size_launched() {
        assert!(
            LL_KERNELS.contains(&format!("#define EP_THREADS {THREADS}\n")),
            "ll.cu's EP_THREADS is not cuda.rs's THREADS ({THREADS})"
        );
    }
}
