//! CUDA ranks: the low-latency mode as kernels (`kernels/ll.cu`, which
//! includes `gin/gin.cuh`), launched through gin-core's public CUDA API
//! ([`gin_core::cuda`]): windows from [`CudaComm::alloc_window`], kernels
//! compiled by NVRTC ([`CudaComm::compile`]) and run on a
//! [`CudaDevComm`].
//!
//! The windows, message format, slot and signal numbering and the
//! cumulative-signal protocol are the CPU ranks' ([`crate::ll`]); inputs
//! are checked on the host with the same code before anything is sent
//! (bad input leaves every rank as it was). A step is three launches:
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
//! With FP8 the host stages the BF16 tokens and the dispatch kernel
//! quantises them into the messages, bit for bit as
//! [`crate::num::quantize_fp8`] (`tests/fp8_host.rs` compiles the kernel's
//! number functions as host C++ and compares); the combine stays BF16.
//!
//! What this version leaves out: high-throughput mode on CUDA ranks
//! (refused when the buffer is created), the active-rank mask
//! under a peer's loss (a lost peer fails the step, naming it), and inputs
//! that already live on the GPU (the host stages `x`, `topk_idx` and the
//! weights into the send window and reads the combined tokens back).

use gin_core::cuda::{Arg, CtxSharing, CudaComm, CudaDevComm, DevMem, Function, GpuWindow, Module};
use gin_core::{CoreError, DevCommRequirements};

use crate::config::{Config, Mode};
use crate::error::EpError;
use crate::ll::{Combined, write_messages, write_metadata};
use crate::num::Bf16;

/// The kernels of CUDA ranks (CUDA C++ including `gin/gin.cuh`), for
/// [`CudaComm::compile`].
pub const LL_KERNELS: &str = include_str!("../kernels/ll.cu");

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
    /// `u64[nranks]`: the combine signal each rank's experts must reach.
    ctarget: DevMem,
    /// `u16[t × hidden]`: the combined tokens.
    out: DevMem,
    /// `u64[2]`: earliest block start, latest block end of a launch.
    clock: DevMem,
    /// FP8: `u16[t × hidden]`, this step's tokens in BF16, which the
    /// dispatch kernel quantises into the staged messages.
    xin: Option<DevMem>,
    /// `u64`: the dispatch kernel's grid barrier (FP8), a count that only
    /// grows.
    bar: DevMem,
    /// `u32[t × topk]`: per (token, top-k slot), the token's index among
    /// this rank's tokens for that expert (written by the dispatch kernel).
    eslot: DevMem,
    /// `u8[nranks × nranks]`: `[src × nranks + owner]` is 1 where `src`
    /// reads `owner`'s combine slots in place.
    pull: DevMem,
}

impl State {
    fn new(cfg: &Config, n: usize) -> Result<Self, CoreError> {
        let (e, t) = (cfg.num_experts, cfg.max_tokens_per_rank);
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
            out: zeroed(2 * t * cfg.hidden)?,
            clock: zeroed(16)?,
            xin: if cfg.fp8 {
                Some(zeroed(2 * t * cfg.hidden)?)
            } else {
                None
            },
            bar: zeroed(8)?,
            eslot: zeroed(4 * t * cfg.topk)?,
            pull: zeroed(n * n)?,
        })
    }
}

/// The kernels, and the module that holds them (unloaded last).
#[derive(Debug)]
struct Kernels {
    dispatch: Function,
    echo: Function,
    combine: Function,
    floor: Function,
    _module: Module,
}

impl Kernels {
    fn load(cuda: &CudaComm<'_>) -> Result<Self, CoreError> {
        let m = cuda.compile(LL_KERNELS, "ll.cu")?;
        Ok(Self {
            dispatch: m.function("ep_ll_dispatch")?,
            echo: m.function("ep_ll_echo")?,
            combine: m.function("ep_ll_combine")?,
            floor: m.function("ep_floor")?,
            _module: m,
        })
    }
}

/// Compiles and loads the kernels on every rank (collective): a rank that
/// cannot (no NVRTC, a compile error) fails with its reason, and every
/// other rank with an error naming it, rather than waiting for it later.
fn load_agreed(cuda: &CudaComm<'_>) -> Result<Kernels, EpError> {
    let comm = cuda.comm();
    let k = Kernels::load(cuda);
    let all = comm.bootstrap().allgather(&[u8::from(k.is_ok())])?;
    let k = k?;
    match all.iter().position(|v| v.first() != Some(&1)) {
        Some(p) => Err(EpError::Mode {
            rank: comm.rank(),
            what: format!("rank {p} could not compile gin-ep's CUDA kernels (kernels/ll.cu)"),
        }),
        None => Ok(k),
    }
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

/// Where a CUDA buffer's step stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Idle,
    Dispatched,
}

/// A CUDA rank's low-latency expert-parallel buffer: the windows of
/// [`crate::ll`] in GPU memory, a device communicator, and the kernels.
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
    /// Host copy of `State::ctarget`.
    ctarget: Vec<u64>,
    step: u64,
    phase: Phase,
    blocks: u32,
    /// Host staging of the send window, reused between steps.
    staged: Vec<u8>,
    /// The last dispatch and combine launches (GPU clock).
    last: (KernelClock, KernelClock),
    /// A kernel failed: no further step can run (destroy the buffer).
    failed: bool,
    /// What the FP8 dispatch's grid barrier counts up to this step.
    bar_target: u64,
    /// `[owner]`: whether this rank reads `owner`'s combine slots in place.
    reads: Vec<bool>,
}

/// What a CUDA rank received in one low-latency dispatch: per (local
/// expert, source) pair, the count and each token's metadata, read back
/// and checked; the payloads stay in GPU memory
/// ([`CudaBuffer::ll_received`] copies them back).
#[derive(Debug, Clone)]
pub struct CudaLlDispatch {
    step: u64,
    nranks: usize,
    max: usize,
    /// `[le * nranks + src]`.
    counts: Vec<u32>,
    /// `[3 * ((le * nranks + src) * max + i)]`: token, top-k slot, weight.
    meta: Vec<u32>,
}

impl CudaLlDispatch {
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
    /// allocates the low-latency windows in GPU memory, a device
    /// communicator with one signal per (expert, source) for each phase,
    /// and compiles the kernels with NVRTC.
    pub fn new(cuda: &'a CudaComm<'c>, cfg: Config) -> Result<Self, EpError> {
        let comm = cuda.comm();
        let (rank, n) = (comm.rank(), comm.nranks());
        crate::buffer::agree_config(comm, &cfg)?;
        let kernels = load_agreed(cuda)?;
        // Every rank passed the same configuration: all refuse alike.
        if cfg.mode != Mode::LowLatency {
            return Err(EpError::Mode {
                rank,
                what: "CUDA ranks run the low-latency mode only \
                       (high-throughput mode on CUDA ranks is not built yet)"
                    .into(),
            });
        }
        let (signals, sizes) = crate::ll::resources(&cfg, n);
        let req = DevCommRequirements {
            signals,
            counters: 1,
            contexts: 1,
            ..DevCommRequirements::default()
        };
        let dc = cuda.dev_comm(&req, CtxSharing::Gpu)?;
        let wins = sizes
            .iter()
            .map(|&b| cuda.alloc_window(b.max(64) as u64))
            .collect::<Result<Vec<_>, _>>()?;
        cuda.device().make_current().map_err(CoreError::from)?;
        let state = State::new(&cfg, n)?;
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
            ctarget: vec![0; n],
            step: 0,
            phase: Phase::Idle,
            blocks: BLOCKS,
            staged: Vec::new(),
            last: (KernelClock::default(), KernelClock::default()),
            failed: false,
            bar_target: 0,
            reads: Vec::new(),
        };
        me.write_active()?;
        me.agree_pull()?;
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
        self.expect_idle("set_active")?;
        self.active[peer] = active;
        self.write_active()
    }

    /// Blocks per launch (at least 1; default 32). Every rank's grid must
    /// be resident at once, which bounds it where ranks share a GPU.
    pub fn set_blocks(&mut self, blocks: u32) {
        self.blocks = blocks.max(1);
    }

    /// When the last dispatch and combine kernels ran on the GPU.
    pub fn last_kernels(&self) -> (KernelClock, KernelClock) {
        self.last
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

    fn check_usable(&self, call: &'static str) -> Result<(), EpError> {
        if self.failed {
            return Err(EpError::Mode {
                rank: self.rank,
                what: format!("{call}: an earlier kernel of this buffer failed; destroy it"),
            });
        }
        Ok(())
    }

    fn expect_idle(&self, call: &'static str) -> Result<(), EpError> {
        self.check_usable(call)?;
        if self.phase == Phase::Idle {
            Ok(())
        } else {
            Err(EpError::Phase {
                rank: self.rank,
                call,
                phase: "holding a dispatch (combine next)",
            })
        }
    }

    fn expect_dispatch(&self, call: &'static str, d: &CudaLlDispatch) -> Result<(), EpError> {
        self.check_usable(call)?;
        if self.phase != Phase::Dispatched {
            return Err(EpError::Phase {
                rank: self.rank,
                call,
                phase: "idle",
            });
        }
        if d.step != self.step {
            return Err(EpError::StaleHandle {
                rank: self.rank,
                handle_step: d.step,
                step: self.step,
            });
        }
        Ok(())
    }

    fn grid(&self, items: usize) -> u32 {
        u32::try_from(items.max(1))
            .unwrap_or(u32::MAX)
            .min(self.blocks)
    }

    fn u32_of(v: usize) -> u32 {
        // Config::validate bounds every size a kernel receives far below.
        u32::try_from(v).unwrap_or(u32::MAX)
    }

    /// Low-latency dispatch on CUDA ranks: checks the inputs (nothing is
    /// sent on an error), stages each token's message in the send window,
    /// and runs the dispatch kernel, which puts every token into a slot of
    /// each rank holding one of its experts, signals every (expert, source)
    /// pair with its count, and waits (bounded) for every active source's
    /// count for every local expert. The counts and metadata are read back
    /// and checked.
    pub fn ll_dispatch(
        &mut self,
        x: &[Bf16],
        topk_idx: &[i64],
        topk_weights: &[f32],
    ) -> Result<CudaLlDispatch, EpError> {
        self.expect_idle("ll_dispatch")?;
        let cfg = self.cfg;
        let layout = crate::ll::check_inputs(
            self.rank,
            &cfg,
            &self.active,
            1,
            x.len(),
            topk_idx,
            topk_weights,
        )?;
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
        if let Some(xin) = &self.state.xin
            && !x.is_empty()
        {
            xin.write(0, x).map_err(CoreError::from)?;
        }
        let grid = self.grid(cfg.num_experts);
        self.step += 1;
        if cfg.fp8 {
            self.bar_target += u64::from(grid);
        }
        let s = &self.state;
        reset_clock(&s.clock)?;
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
            Arg::Ptr(s.clock.ptr()),
            Arg::Ptr(s.xin.as_ref().map_or(0, DevMem::ptr)),
            Arg::U32(u(cfg.hidden)),
            Arg::Ptr(s.bar.ptr()),
            Arg::U64(self.bar_target),
            Arg::Ptr(s.eslot.ptr()),
        ];
        // SAFETY: ep_ll_dispatch(DevComm, Window send, Window recv, u32
        // tokens, u32 l, u32 t, u32 m, u32 p, u32 k, const u32* active, u64*
        // seen, u32* counts, u32* meta, u64* clock, const u16* xin, u32 h,
        // u64* bar, u64 bar_target, u32* eslot) in kernels/ll.cu takes these
        // arguments in this order. The windows and the device communicator are this
        // buffer's, alive for the call; the kernel reads `tokens` staged
        // messages (written above) and indexes active by rank (nranks u32),
        // seen and counts by pair (experts), meta by received slot (3 ×
        // experts × t u32) and clock (2 u64): the sizes State::new allocated
        // for this configuration. With FP8 it reads tokens × h u16 of xin (t
        // × h allocated), writes the payloads of the `tokens` staged
        // messages (within the send window) and adds 1 per block to bar (one
        // u64); without, xin is null and neither is touched. It writes
        // eslot at (token × k + slot) for tokens < t and slots < k (t × k
        // u32 allocated).
        let run = unsafe { self.dc.run(&self.kernels.dispatch, grid, THREADS, &args) };
        if let Err(e) = run {
            // Peers may be anywhere in the step: the buffer cannot go on.
            self.failed = true;
            return Err(kernel_error(self.rank, "dispatch", e));
        }
        self.last.0 = read_clock(&s.clock)?;
        let d = self.read_dispatch();
        // A sender broke the protocol: the step cannot be finished.
        self.failed = d.is_err();
        self.phase = Phase::Dispatched;
        d
    }

    /// Reads the counts and metadata back and checks them as the CPU ranks'
    /// receive does: a count above the maximum, a token index out of range
    /// or a message that does not name the expert is the sender's
    /// protocol error.
    fn read_dispatch(&self) -> Result<CudaLlDispatch, EpError> {
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
            step: self.step,
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
                            "token index {tok} at or above the maximum {t}"
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

    /// Copies the received messages of `d` back from GPU memory, for
    /// checks ([`crate::oracle::check_ll_view`]).
    pub fn ll_received(&self, d: &CudaLlDispatch) -> Result<LlReceived, EpError> {
        self.expect_dispatch("ll_received", d)?;
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

    /// The identity expert on the GPU: copies every received token into its
    /// combine slot.
    pub fn ll_echo(&mut self, d: &CudaLlDispatch) -> Result<(), EpError> {
        self.expect_dispatch("ll_echo", d)?;
        self.current()?;
        let cfg = self.cfg;
        let u = Self::u32_of;
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
        // (ll::resources), both alive; counts holds `pairs` u32.
        let run = unsafe {
            self.dc.run(
                &self.kernels.echo,
                self.grid(cfg.num_experts),
                THREADS,
                &args,
            )
        };
        if let Err(e) = run {
            // Peers may be anywhere in the step: the buffer cannot go on.
            self.failed = true;
            return Err(kernel_error(self.rank, "echo", e));
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
    /// read back.
    pub fn ll_combine(&mut self, d: &CudaLlDispatch) -> Result<Combined, EpError> {
        self.expect_dispatch("ll_combine", d)?;
        self.current()?;
        let cfg = self.cfg;
        let tokens = self.staged.len() / cfg.msg_bytes();
        for (t, &a) in self.ctarget.iter_mut().zip(&self.active) {
            if a {
                *t += 1;
            }
        }
        let s = &self.state;
        s.ctarget.write(0, &self.ctarget).map_err(CoreError::from)?;
        reset_clock(&s.clock)?;
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
            Arg::Ptr(s.out.ptr()),
            Arg::Ptr(s.clock.ptr()),
            Arg::Ptr(s.eslot.ptr()),
            Arg::Ptr(s.pull.ptr()),
        ];
        // SAFETY: ep_ll_combine(DevComm, Window send, Window csend, Window
        // crecv, u32 tokens, u32 l, u32 t, u32 m, u32 p, u32 k, u32 h, const
        // u32* active, const u32* counts, const u32* meta, const u64*
        // ctarget, u16* out, u64* clock, const u32* eslot, const u8* pull)
        // takes these in this order. It reads the `tokens` messages staged
        // by this step's dispatch, slots of csend and crecv within their
        // sizes (ll::resources; metadata out of range is skipped), peers'
        // csend slots through their mappings only after checking the slot
        // against the peer part's size, and writes tokens × hidden u16 of
        // out (t × hidden allocated) and the 2 u64 of clock; active and
        // ctarget hold nranks entries, pull nranks × nranks, counts and meta
        // the dispatch's, eslot t × k.
        let run = unsafe {
            self.dc.run(
                &self.kernels.combine,
                self.grid(cfg.num_experts.max(tokens)),
                THREADS,
                &args,
            )
        };
        if let Err(e) = run {
            // Peers may be anywhere in the step: the buffer cannot go on.
            self.failed = true;
            return Err(kernel_error(self.rank, "combine", e));
        }
        self.last.1 = read_clock(&s.clock)?;
        let mut raw = vec![0u16; tokens * cfg.hidden];
        if !raw.is_empty() {
            s.out.read(0, &mut raw).map_err(CoreError::from)?;
        }
        self.phase = Phase::Idle;
        Ok(Combined {
            x: raw.into_iter().map(Bf16).collect(),
            lost: Vec::new(),
        })
    }

    /// Destroys the buffer collectively: stops the device communicator
    /// (every rank arrives), then frees the windows on every rank.
    pub fn destroy(self) -> Result<(), EpError> {
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
        let kernels = load_agreed(cuda)?;
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
        for cc in [(9, 0), (8, 0)] {
            match gin_core::cuda::nvrtc::compile(LL_KERNELS, "ll.cu", cc) {
                Ok(cubin) => assert_eq!(&cubin.as_bytes()[..4], b"\x7fELF", "{cc:?}"),
                Err(CoreError::Unavailable { why, .. }) => {
                    assert!(
                        std::env::var_os("GIN_REQUIRE_NVRTC").is_none(),
                        "GIN_REQUIRE_NVRTC is set but NVRTC cannot be used: {why}"
                    );
                    eprintln!("skipped: NVRTC cannot be loaded ({why})");
                    return;
                }
                Err(e) => panic!("ll.cu for {cc:?}: {e}"),
            }
        }
    }

    /// The kernels the host launches exist under the names it looks up
    /// (`extern "C" __global__ void`, launch bounds allowed before the
    /// name).
    #[test]
    fn every_launched_kernel_is_defined() {
        for name in ["ep_ll_dispatch", "ep_ll_echo", "ep_ll_combine", "ep_floor"] {
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
