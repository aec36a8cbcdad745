//! One rank of gin-ep's multi-process tests: runs a scenario under the
//! launcher's environment (GIN_BACKEND, GIN_TRANSPORT, GIN_HOSTID...) and
//! prints `rank R: SCENARIO ok in ...` or fails with the first difference.
//!
//! `gin-ep-selftest SCENARIO [key=value ...]`; scenarios `ll`, `ht`, `bad`,
//! `refuse`, `refuse-unended`, `kill`, `mask`; keys `tokens`, `hidden`, `experts` (per rank), `topk`,
//! `fp8`, `repeats`, `victim`, `ht`, `ring`, `channels`, `threads`, `hook`,
//! and with `device=cuda` `inputs`, `expert`, `bad`, `blocks`, `hosts`. Without launcher variables it starts `ranks=N`
//! local ranks of itself (default 2).
//!
//! `device=cuda` runs `ll` on CUDA ranks (gin-ep's `CudaBuffer`: the
//! kernels of `kernels/ll.cu`) with the same oracle, and `ht` (the
//! high-throughput mode, `kernels/ht.cu`, host inputs; `ring`, `channels`
//! and `fp8` as on CPU ranks) likewise, printing the same combine digest as
//! CPU ranks' `ht` with the same arguments; `hosts=K` splits the
//! ranks into K emulated hosts (consecutive ranks, by host id), so peers on
//! other hosts are reached over TCP. Without a usable GPU it fails at once
//! with "device=cuda needs a GPU: `<why>`".
//!
//! With `device=cuda`, `inputs=device` keeps each rank's inputs and the
//! combine's output in GPU memory (`CudaBuffer::ll_dispatch_device`,
//! `ll_combine_device`: no host copy in the step), and `inputs=stream`
//! queues the step on a stream of the test's own
//! (`ll_dispatch_on`, `ll_echo_on`, `ll_combine_on`), synchronised after
//! the expert (the received tokens are read back before the combine, as
//! they must be) and after the combine; both are checked with the same
//! oracle and print the same digests as `inputs=host` (the default).
//! `inputs=queued` queues all `repeats` steps back to back, each with
//! inputs of its own, and synchronises once: each step's combine is checked
//! against its own inputs, and step 0's digest is the other modes'. With either, `expert=tensor` moves the
//! identity expert's outputs into a tensor of the rank's own and combines
//! from there (`ll_combine_from_device`, `ll_combine_from_on`: DeepEP's
//! `low_latency_combine(x, ...)`). `bad=1` first gives rank `victim`
//! (default 1) an expert id out of range (its token 1, top-k slot 1): the
//! victim must name that entry, every other rank `PeerRefused` naming the
//! victim, within half the job timeout; then the steps after it verify
//! with the oracle on every rank, with the digests of a run without the
//! refusal. With host inputs (the default) the id lies in the host's
//! slices (refused by the host's checks, its counts poisoned by its
//! kernel); with `inputs=device` in GPU memory (found by the dispatch
//! kernel; `ll_dispatch_device` returns the refusal); with `inputs=stream`
//! the refused step is queued (the expert queued after the dispatch ran
//! must go ahead, `check` reports the refusal, then the step's combine is
//! queued and checks clean); with `inputs=queued` it is the middle one of
//! three steps queued back to back (every call goes ahead, one `check`
//! reports it, and the other two steps verify). `bad=tokens` (inputs in
//! GPU memory) gives the victim's dispatch one token more than the
//! buffer's maximum instead, refused by the host's check before anything
//! is launched: the victim must name its token count (`TooManyTokens`, from
//! the dispatch call itself, queued or not: a queued one queued the refused
//! step to its end, and its `check` is clean), every other rank the victim,
//! within half the job timeout, and the steps after it verify as with
//! `bad=1`. `inputs=mixed` makes even ranks `inputs=device` (waited calls)
//! and odd ranks `inputs=stream` (queued calls) in one job.
//! `ht device=cuda inputs=device` runs the high-throughput step from GPU
//! memory (`ht_dispatch_device`, `ht_echo_device`, `ht_combine_device`)
//! with the same oracle and digests as host inputs. `ht device=cuda bad=1`
//! (host inputs or `inputs=device`) first gives rank `victim` (default 1)
//! an expert id out of range: it must be refused by name, every other rank
//! with `PeerRefused` naming it, at once, then the steps after it
//! verify on every rank.
//! `bad=combine-out` and `bad=combine-in` (`ll device=cuda`, after a
//! dispatch from host memory or with `inputs=device`, `stream`, `queued`
//! or `mixed`) refuse a combine's tensor on rank `victim` instead, one
//! element short: its output (the combine must still run, every other
//! rank's result verified by the oracle) or its expert outputs
//! (`ll_combine_from_*`: every other rank must be told, naming the
//! victim, its output untouched); the victim's call returns `Shape` naming
//! the tensor, within half the job timeout, and the steps after it verify.
//! `ht device=cuda inputs=device bad=combine-out` does the first with
//! `ht_combine_device`. Each refused tensor is filled with a NaN pattern
//! and must be left untouched, and a second combine call on the victim
//! must be refused as out of order (the refused call ended the step).
//! With either, `victims=1,2` makes several ranks refuse in the same step
//! (every other rank names the lowest); with `bad=combine-in`,
//! `then=entry` refuses the lowest victim's dispatch (`bad=1`'s entry) in
//! the step after the refused combine. A `bad=` value the scenario does
//! not take (`ht ... bad=combine-in`, `bad=` on CPU ranks) is an error.
//! `kill device=cuda` queues steps on the test's stream and kills rank
//! `victim` between two: the survivors' queued waits must give up at once,
//! their error naming it.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use gin_core::Comm;
use gin_core::launch::{Role, run_ranks};
use gin_ep::oracle::{self, RankInput};
use gin_ep::{Buffer, Config, EpError, Mode, OnPeerLoss};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Bootstrap tag of the `kill` scenario's "past the barrier" messages.
const PAST_BARRIER: u32 = 0x6b11;

fn main() -> std::process::ExitCode {
    gin_bootstrap::init_tracing_from_env();
    gin_bootstrap::exit_code(run())
}

struct Args {
    scenario: String,
    kv: HashMap<String, String>,
}

impl Args {
    fn get(&self, k: &str, default: usize) -> usize {
        self.kv
            .get(k)
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    }
}

fn run() -> Res<()> {
    let mut argv = std::env::args().skip(1);
    let scenario = argv.next().unwrap_or_else(|| "ll".into());
    let kv = argv
        .filter_map(|a| a.split_once('=').map(|(k, v)| (k.to_owned(), v.to_owned())))
        .collect();
    let args = Args { scenario, kv };
    let cuda = match args.kv.get("device").map(String::as_str) {
        None | Some("cpu") => false,
        Some("cuda") => true,
        Some(other) => return Err(format!("unknown device={other:?} (cpu or cuda)").into()),
    };
    if cuda {
        gin_ep::cuda::gpu_available().map_err(|why| format!("device=cuda needs a GPU: {why}"))?;
        if !["ll", "ht", "kill"].contains(&args.scenario.as_str()) {
            return Err(format!(
                "device=cuda runs the ll, ht and kill scenarios only, not {:?}",
                args.scenario
            )
            .into());
        }
    }
    if !cuda && ["ll", "ht"].contains(&args.scenario.as_str()) && Bad::of(&args)?.is_some() {
        return Err(format!(
            "{} on CPU ranks takes no bad= (device=cuda does; CPU ranks' refusals are the bad and refuse scenarios)",
            args.scenario
        )
        .into());
    }
    if let Role::Launched = run_ranks(args.get("ranks", 2))? {
        return Ok(());
    }
    let comm = join(&args)?;
    let t = Instant::now();
    let what = match args.scenario.as_str() {
        "ll" if cuda => cuda_oracle_run(&comm, &args)?,
        "ll" => oracle_run(&comm, &args, Mode::LowLatency)?,
        "ht" if cuda => cuda_ht_run(&comm, &args)?,
        "ht" => oracle_run(&comm, &args, Mode::HighThroughput)?,
        "bad" => bad_inputs(&comm, &args)?,
        "refuse" => refuse(&comm, &args)?,
        "refuse-unended" => refuse_unended(&comm, &args)?,
        "kill" if cuda => cuda_kill(&comm, &args)?,
        "kill" => kill(&comm, &args)?,
        "mask" => masked(&comm, &args)?,
        other => return Err(format!("unknown scenario {other:?}").into()),
    };
    println!(
        "rank {} of {}: {} ok in {:.0} ms ({what}; paths {:?})",
        comm.rank(),
        comm.nranks(),
        args.scenario,
        t.elapsed().as_secs_f64() * 1e3,
        comm.path_names()
    );
    Ok(())
}

/// Joins the job; with `hosts=K`, as one of K emulated hosts.
fn join(args: &Args) -> Res<Comm> {
    let Some(k) = args.kv.get("hosts").and_then(|v| v.parse::<usize>().ok()) else {
        return Ok(Comm::from_env()?);
    };
    let b = gin_bootstrap::Bootstrap::from_env()?;
    let mut settings = gin_core::Settings::from_env()?;
    let host = b.rank() * k.max(1) / b.nranks();
    settings.host_id = format!("gin-ep-selftest-host-{host}");
    Ok(Comm::with_settings(b, settings)?)
}

/// Where a CUDA step's inputs and output live (`inputs=`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Inputs {
    /// Host slices, staged by gin-ep (`ll_dispatch`, `ll_combine`).
    Host,
    /// GPU memory, steps on gin's stream (`ll_dispatch_device`...).
    Device,
    /// GPU memory, steps queued on the test's stream (`ll_dispatch_on`...).
    Stream,
    /// GPU memory, every repeat queued on the test's stream, synchronised
    /// once ([`queued_steps`]).
    Queued,
}

impl Inputs {
    /// This rank's kind (`inputs=mixed`: even ranks `device`, odd ranks
    /// `stream`: waited and queued calls in one job).
    fn of(args: &Args, rank: usize) -> Res<Self> {
        match args.kv.get("inputs").map(String::as_str) {
            None | Some("host") => Ok(Self::Host),
            Some("mixed") if rank.is_multiple_of(2) => Ok(Self::Device),
            Some("device") => Ok(Self::Device),
            Some("stream" | "mixed") => Ok(Self::Stream),
            Some("queued") => Ok(Self::Queued),
            Some(o) => {
                Err(format!("unknown inputs={o:?} (host, device, stream, queued or mixed)").into())
            }
        }
    }
}

/// What `bad=` refuses on rank `victim` in `ll device=cuda`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bad {
    /// `bad=1`: an expert id out of range at token 1, top-k slot 1 (the
    /// host's checks find it in host inputs, the dispatch kernel in GPU
    /// memory).
    Entry,
    /// `bad=tokens`: inputs in GPU memory whose token count is one above
    /// the buffer's maximum, refused by the host's check before anything
    /// is launched, as a step every rank ends.
    Tokens,
    /// `bad=combine-out`: the victim's combine output tensor one element
    /// short, refused by the host's check: its combine still runs in full
    /// (into the buffer's own memory), every other rank's gives its normal
    /// result ([`ll_combine_bad`]).
    CombineOut,
    /// `bad=combine-in`: the victim's expert-output tensor one element
    /// short (`ll_combine_from_*`): the combine is refused collectively,
    /// every other rank told, its output untouched ([`ll_combine_bad`]).
    CombineIn,
}

impl Bad {
    fn of(args: &Args) -> Res<Option<Self>> {
        match args.kv.get("bad").map(String::as_str) {
            None | Some("0") => Ok(None),
            Some("1") => Ok(Some(Self::Entry)),
            Some("tokens") => Ok(Some(Self::Tokens)),
            Some("combine-out") => Ok(Some(Self::CombineOut)),
            Some("combine-in") => Ok(Some(Self::CombineIn)),
            Some(o) => {
                Err(format!("unknown bad={o:?} (0, 1, tokens, combine-out or combine-in)").into())
            }
        }
    }

    /// A combine's refusal (not the dispatch's).
    fn combine(self) -> bool {
        matches!(self, Self::CombineOut | Self::CombineIn)
    }

    /// The tensor a combine's refusal refuses, as the host's error names it.
    fn tensor(self) -> &'static str {
        if self == Self::CombineIn {
            "expert outputs"
        } else {
            "combine output"
        }
    }

    /// The ranks that refuse (`victim=V`, default 1; or, for a combine's
    /// refusal, `victims=V,W,...`: several ranks refusing their tensor in
    /// the same step), ascending, each below `n`.
    fn victims(self, args: &Args, n: usize) -> Res<Vec<usize>> {
        let Some(list) = args.kv.get("victims") else {
            return Ok(vec![args.get("victim", 1) % n]);
        };
        if !self.combine() {
            return Err(format!(
                "victims={list} takes bad=combine-out or bad=combine-in (bad={self:?}: victim=)"
            )
            .into());
        }
        let mut v = list
            .split(',')
            .map(|r| match r.parse::<usize>() {
                Ok(r) if r < n => Ok(r),
                _ => Err(format!("victims={list}: {r:?} is not a rank below {n}")),
            })
            .collect::<Result<Vec<_>, _>>()?;
        v.sort_unstable();
        v.dedup();
        Ok(v)
    }

    /// `then=entry` (a combine's refusal only): the step after the refused
    /// combine refuses the lowest victim's dispatch (`bad=1`'s entry).
    fn then_entry(self, args: &Args) -> Res<bool> {
        match args.kv.get("then").map(String::as_str) {
            None => Ok(false),
            Some("entry") if self.combine() => Ok(true),
            Some(o) => Err(format!(
                "then={o} (then=entry, after bad=combine-out or bad=combine-in) with bad={self:?}"
            )
            .into()),
        }
    }
}

/// The refusing ranks in words: `rank 1`, or `ranks 1,2`.
fn who(victims: &[usize]) -> String {
    let list: Vec<String> = victims.iter().map(usize::to_string).collect();
    match victims {
        [_] => format!("rank {}", list.join(",")),
        _ => format!("ranks {}", list.join(",")),
    }
}

/// This rank's inputs and combine output in GPU memory, as a framework's
/// tensors would be, and the stream of `inputs=stream`.
struct DevTensors {
    x: gin_core::cuda::DevMem,
    idx: gin_core::cuda::DevMem,
    w: gin_core::cuda::DevMem,
    out: gin_core::cuda::DevMem,
    tokens: usize,
    stream: Option<gin_core::cuda::Stream>,
    /// `expert=tensor`: the expert outputs' own tensor.
    eout: Option<gin_core::cuda::DevMem>,
}

impl DevTensors {
    /// Uploads `me` (once, before the steps: the inputs a framework would
    /// already hold on the GPU).
    fn upload(
        cuda: &gin_core::cuda::CudaComm<'_>,
        me: &RankInput,
        h: usize,
        stream: bool,
        eout_bytes: Option<usize>,
    ) -> Res<Self> {
        use gin_core::cuda::DevMem;
        cuda.device().make_current()?;
        let mem = |bytes: usize| DevMem::new(bytes.max(16));
        let (x, idx, w) = (
            mem(2 * me.x.len())?,
            mem(8 * me.topk_idx.len())?,
            mem(4 * me.weights.len())?,
        );
        if me.tokens > 0 {
            x.write(0, &me.x)?;
            idx.write(0, &me.topk_idx)?;
            w.write(0, &me.weights)?;
        }
        Ok(Self {
            x,
            idx,
            w,
            out: mem(2 * me.tokens * h)?,
            tokens: me.tokens,
            stream: if stream {
                Some(gin_core::cuda::Stream::new()?)
            } else {
                None
            },
            eout: eout_bytes.map(mem).transpose()?,
        })
    }

    fn inputs(&self) -> gin_ep::cuda::DeviceInputs<'_> {
        gin_ep::cuda::DeviceInputs {
            x: &self.x,
            topk_idx: &self.idx,
            topk_weights: &self.w,
            tokens: self.tokens,
        }
    }
}

/// Runs `f` (launches queued on `st`), then synchronises `st`, error or
/// not, before anything the launches use can be dropped, and checks them.
fn on_stream<T>(
    buf: &mut gin_ep::cuda::CudaBuffer<'_, '_>,
    st: &gin_core::cuda::Stream,
    f: impl FnOnce(
        &mut gin_ep::cuda::CudaBuffer<'_, '_>,
        gin_core::cuda::StreamRef<'_>,
    ) -> Result<T, EpError>,
) -> Res<T> {
    let r = f(buf, st.into());
    st.sync()?;
    let v = r?;
    buf.check()?;
    Ok(v)
}

/// `expert=tensor`: the identity expert's outputs moved from the combine
/// slots into the rank's own expert-output tensor, and the slots zeroed,
/// so that the combine can only find them in the tensor
/// (`ll_combine_from_*`). Host copies: the test's, not the step's.
fn move_outputs(buf: &gin_ep::cuda::CudaBuffer<'_, '_>, eout: &gin_core::cuda::DevMem) -> Res<()> {
    let n = buf.device_layout().combine_bytes();
    let mut v = vec![0u8; n];
    buf.combine_slots().read(0, &mut v)?;
    eout.write(0, &v)?;
    buf.combine_slots().zero_wait(0, n)?;
    Ok(())
}

/// One device-resident step (dispatch, identity expert, combine into the
/// rank's output buffer); what it received is copied back for the checks
/// between the dispatch and the combine (the received tokens are valid only
/// until the combine is launched: a peer's next dispatch may overwrite them
/// after it), what it combined after the step. With `inputs=stream` the
/// dispatch and the expert are queued, synchronised and checked, then the
/// combine; the copies are the test's, not the step's.
fn device_step(
    buf: &mut gin_ep::cuda::CudaBuffer<'_, '_>,
    dt: &DevTensors,
) -> Res<(gin_ep::cuda::LlReceived, Vec<gin_ep::Bf16>)> {
    let inp = dt.inputs();
    let (s, got) = if let Some(st) = &dt.stream {
        // SAFETY: one stream, in order; dt's buffers and the stream
        // outlive the step, synchronised by on_stream before anything is
        // dropped or written, error or not.
        let s = on_stream(buf, st, |buf, on| unsafe {
            let s = buf.ll_dispatch_on(on, &inp)?;
            buf.ll_echo_on(on, &s)?;
            Ok(s)
        })?;
        let d = buf.ll_read_back(&s)?;
        let got = buf.ll_received(&d)?;
        if let Some(eout) = &dt.eout {
            move_outputs(buf, eout)?;
            // SAFETY: as above; eout outlives the step too.
            on_stream(buf, st, |buf, on| unsafe {
                buf.ll_combine_from_on(on, &s, eout, &dt.out)
            })?;
        } else {
            // SAFETY: as above.
            on_stream(buf, st, |buf, on| unsafe {
                buf.ll_combine_on(on, &s, &dt.out)
            })?;
        }
        (s, got)
    } else {
        let s = buf.ll_dispatch_device(&inp)?;
        let d = buf.ll_read_back(&s)?;
        let got = buf.ll_received(&d)?;
        buf.ll_echo_device(&s)?;
        if let Some(eout) = &dt.eout {
            move_outputs(buf, eout)?;
            buf.ll_combine_from_device(&s, eout, &dt.out)?;
        } else {
            buf.ll_combine_device(&s, &dt.out)?;
        }
        (s, got)
    };
    // Counts and metadata are this rank's own memory: still readable.
    buf.ll_read_back(&s)?;
    let h = buf.config().hidden;
    let mut raw = vec![0u16; dt.tokens * h];
    if !raw.is_empty() {
        dt.out.read(0, &mut raw)?;
    }
    Ok((got, raw.into_iter().map(gin_ep::Bf16).collect()))
}

/// `count` steps' inputs for a rank (seeds `seed..`, unequal token counts
/// by step), each uploaded to GPU memory.
fn queued_inputs(
    cuda: &gin_core::cuda::CudaComm<'_>,
    cfg: &Config,
    rank: usize,
    n: usize,
    seed: u64,
    count: usize,
) -> Res<(Vec<RankInput>, Vec<DevTensors>)> {
    let steps: Vec<RankInput> = (0..count)
        .map(|i| {
            oracle::rank_input(
                seed + i as u64,
                rank,
                n,
                oracle::tokens_for_rank(cfg.max_tokens_per_rank, rank + i),
                cfg.hidden,
                cfg.num_experts,
                cfg.topk,
            )
        })
        .collect();
    let tensors = steps
        .iter()
        .map(|me| DevTensors::upload(cuda, me, cfg.hidden, false, None))
        .collect::<Res<Vec<_>>>()?;
    Ok((steps, tensors))
}

/// `inputs=queued`: `repeats` steps queued on the test's stream back to
/// back (dispatch, identity expert, combine), each with inputs of its own
/// (another seed, and another token count) and its own output tensor, then
/// one synchronisation and one check for all of them: the device-side state
/// (each signal's accounted value, the combine targets, the grid barrier,
/// the input check's word) carries the steps with no host between them.
/// Each step's combine is checked by the oracle against that step's inputs,
/// so a step that met another step's tokens fails. Step 0's inputs are the
/// other modes': its combine digest is returned, theirs too.
fn queued_steps(
    buf: &mut gin_ep::cuda::CudaBuffer<'_, '_>,
    cuda: &gin_core::cuda::CudaComm<'_>,
    repeats: usize,
) -> Res<u64> {
    let cfg = *buf.config();
    let (rank, n, h) = (buf.rank(), buf.nranks(), cfg.hidden);
    let (steps, tensors) = queued_inputs(cuda, &cfg, rank, n, 20, repeats)?;
    let st = gin_core::cuda::Stream::new()?;
    on_stream(buf, &st, |buf, on| {
        for dt in &tensors {
            let inp = dt.inputs();
            // SAFETY: one stream, in order; every step's tensors and the
            // stream outlive the launches: on_stream synchronises before
            // anything is dropped or read, error or not.
            unsafe {
                let s = buf.ll_dispatch_on(on, &inp)?;
                buf.ll_echo_on(on, &s)?;
                buf.ll_combine_on(on, &s, &dt.out)?;
            }
        }
        Ok(())
    })?;
    let active = buf.active().to_vec();
    let l = cfg.local_experts(n);
    let mut first = 0;
    for (i, (me, dt)) in steps.iter().zip(&tensors).enumerate() {
        let mut raw = vec![0u16; dt.tokens * h];
        if !raw.is_empty() {
            dt.out.read(0, &mut raw)?;
        }
        let combined: Vec<gin_ep::Bf16> = raw.into_iter().map(gin_ep::Bf16).collect();
        oracle::check_combine(rank, &combined, me, h, cfg.topk, cfg.fp8, |e| active[e / l])
            .map_err(|e| format!("queued step {i} of {repeats}: {e}"))?;
        if i == 0 {
            first = oracle::bf16_digest(&combined);
        }
    }
    Ok(first)
}

/// One step on CUDA ranks: dispatch, check (first time), the identity
/// expert on the GPU, combine, check; the digests of what was received and
/// combined. With `dev`, the step's inputs and output live in GPU memory.
fn cuda_step(
    buf: &mut gin_ep::cuda::CudaBuffer<'_, '_>,
    all: &[RankInput],
    tables: &[Vec<i64>],
    check: bool,
    dev: Option<&DevTensors>,
) -> Res<(u64, u64)> {
    let cfg = *buf.config();
    let (rank, n) = (buf.rank(), buf.nranks());
    let me = &all[rank];
    let (got, combined) = if let Some(dt) = dev {
        device_step(buf, dt)?
    } else {
        let d = buf.ll_dispatch(&me.x, &me.topk_idx, &me.weights)?;
        let got = buf.ll_received(&d)?;
        buf.ll_echo(&d)?;
        (got, buf.ll_combine(&d)?.x)
    };
    if check {
        oracle::check_ll_view(rank, &cfg, buf.active(), &got, all, tables)?;
        if cfg.fp8 {
            fp8_bit_exact(rank, &cfg, &got, all)?;
        }
    }
    let dig = oracle::ll_view_digest(&cfg, n, &got);
    if check {
        let active = buf.active().to_vec();
        let l = cfg.local_experts(n);
        oracle::check_combine(rank, &combined, me, cfg.hidden, cfg.topk, cfg.fp8, |e| {
            active[e / l]
        })?;
    }
    Ok((dig, oracle::bf16_digest(&combined)))
}

/// FP8 on CUDA ranks: every received payload, quantised by the dispatch
/// kernel, is byte for byte what CPU ranks' `quantize_fp8` makes of the
/// source token (beyond the oracle's tolerance: the same bits).
fn fp8_bit_exact(
    rank: usize,
    cfg: &Config,
    got: &gin_ep::cuda::LlReceived,
    all: &[RankInput],
) -> Res<()> {
    use gin_ep::oracle::LlView;
    let (h, n) = (cfg.hidden, all.len());
    let mut want = vec![0u8; cfg.payload_bytes()];
    for le in 0..cfg.local_experts(n) {
        for (src, input) in all.iter().enumerate() {
            for i in 0..got.count(le, src) {
                let tok = got.src_token(le, src, i);
                let row = input
                    .x
                    .get(tok * h..(tok + 1) * h)
                    .ok_or_else(|| format!("rank {rank}: no token {tok} at rank {src}"))?;
                gin_ep::num::quantize_fp8(row, &mut want);
                let p = got.payload(le, src, i)?;
                if let Some(b) = p.iter().zip(&want).position(|(a, b)| a != b) {
                    return Err(format!(
                        "rank {rank}: FP8 payload of token {tok} from rank {src} for local expert {le} \
                         differs from num.rs at byte {b}: kernel {:#04x}, num.rs {:#04x}",
                        p[b], want[b]
                    )
                    .into());
                }
            }
        }
    }
    Ok(())
}

/// The `ll` oracle on CUDA ranks: the first step checked, `repeats` steps
/// bit-identical.
fn cuda_oracle_run(comm: &Comm, args: &Args) -> Res<String> {
    let cfg = config(comm, args, Mode::LowLatency);
    let cuda = comm.cuda()?;
    let mut buf = gin_ep::cuda::CudaBuffer::new(&cuda, cfg)?;
    if let Some(b) = args.kv.get("blocks").and_then(|v| v.parse().ok()) {
        buf.set_blocks(b);
    }
    let (all, tables) = inputs(comm, &cfg)?;
    let kind = Inputs::of(args, comm.rank())?;
    let tensor = args.kv.get("expert").map(String::as_str) == Some("tensor");
    let repeats = args.get("repeats", 20);
    let dev = match kind {
        Inputs::Host | Inputs::Queued => None,
        _ => Some(DevTensors::upload(
            &cuda,
            &all[comm.rank()],
            cfg.hidden,
            kind == Inputs::Stream,
            tensor.then(|| buf.device_layout().combine_bytes()),
        )?),
    };
    let mut bad = String::new();
    if let Some(what) = Bad::of(args)? {
        let victims = what.victims(args, comm.nranks())?;
        let then = what.then_entry(args)?;
        let victim = victims[0];
        let me = &all[comm.rank()];
        let refuse = |buf: &mut gin_ep::cuda::CudaBuffer<'_, '_>, what: Bad| -> Res<String> {
            Ok(match (kind, dev.as_ref()) {
                (Inputs::Queued, _) if what.combine() => {
                    ll_queued_combine_bad(&cuda, buf, &victims, what)?
                }
                (_, dt) if what.combine() => ll_combine_bad(&cuda, buf, me, dt, &victims, what)?,
                (Inputs::Queued, _) => ll_queued_bad(&cuda, buf, victim, what)?,
                (_, Some(dt)) => ll_device_bad(&cuda, buf, me, dt, victim, what)?,
                (_, None) if what == Bad::Entry => ll_host_bad(&cuda, buf, me, victim)?,
                (_, None) => {
                    return Err(
                        "bad=tokens takes inputs in GPU memory (inputs=device, stream, queued or mixed)"
                            .into(),
                    );
                }
            })
        };
        bad = refuse(&mut buf, what)?;
        if then {
            // The next step refuses the lowest victim's dispatch: the
            // refused combine's poison, accounted by this dispatch, must
            // not disturb it.
            let next = refuse(&mut buf, Bad::Entry)?;
            bad = format!(
                "{}, then in the next step{next}",
                bad.trim_end_matches(", then the buffer's steps verified")
            );
        }
    }
    let (first, steps) = if kind == Inputs::Queued {
        if tensor {
            return Err("inputs=queued takes the identity expert only (no expert=tensor)".into());
        }
        let d = queued_steps(&mut buf, &cuda, repeats.max(1))?;
        (
            (0, d),
            format!(
                "{} steps queued back to back with inputs of their own, synchronised once, each combine checked",
                repeats.max(1)
            ),
        )
    } else {
        let first = cuda_step(&mut buf, &all, &tables, true, dev.as_ref())?;
        for i in 1..repeats {
            let again = cuda_step(&mut buf, &all, &tables, false, dev.as_ref())?;
            if again != first {
                return Err(format!(
                    "rank {}: repeat {i} on CUDA ranks differs from the first (digests {again:x?} vs {first:x?})",
                    comm.rank()
                )
                .into());
            }
        }
        (first, format!("{repeats} repeats bit-identical"))
    };
    let backend = buf.backend_name();
    let reads: Vec<usize> = (0..comm.nranks())
        .filter(|&p| buf.combine_reads_in_place()[p])
        .collect();
    buf.destroy()?;
    Ok(format!(
        "CUDA ranks ({backend}, GPU {}; combine reads ranks {reads:?} in place; inputs {kind:?}{}{bad}): {} tokens, hidden {}, {} experts, top-{}{}, {steps}, combine digest {:016x}",
        cuda.device().name(),
        if dev.as_ref().is_some_and(|d| d.eout.is_some()) {
            ", expert outputs in a tensor of the rank's"
        } else {
            ""
        },
        all[comm.rank()].tokens,
        cfg.hidden,
        cfg.num_experts,
        cfg.topk,
        if cfg.fp8 {
            ", FP8 dispatch (payloads bit-identical to num.rs)"
        } else {
            ""
        },
        first.1,
    ))
}

/// What a refusal gave this rank, in words: a victim's own refusal of its
/// expert `bad` at token 1 slot 1, or, on any other rank, `PeerRefused`
/// naming the lowest victim; within half the job timeout.
fn judge_refusal(
    rank: usize,
    victims: &[usize],
    bad: i64,
    got: &Result<(), EpError>,
    took: Duration,
    timeout: Duration,
) -> Res<String> {
    let own = |e: &EpError| match e {
        EpError::ExpertOutOfRange {
            rank: r,
            token: 1,
            slot: 1,
            expert,
            ..
        } if *r == rank && *expert == bad => {
            Some(format!("refused its expert {bad} at token 1 slot 1"))
        }
        _ => None,
    };
    judge_refusal_by(rank, victims, "a bad expert id", &own, got, took, timeout)
}

/// A `Bad` step's outcome on this rank, judged by [`judge_refusal`] (an
/// entry: `bad` is it) or [`judge_token_refusal`] (the victim's token
/// count above `max`); what was refused, and the verdict.
fn judge_bad(
    what: Bad,
    rank: usize,
    victim: usize,
    (bad, max): (i64, usize),
    got: &Result<(), EpError>,
    took: Duration,
    timeout: Duration,
) -> Res<(&'static str, String)> {
    Ok(match what {
        Bad::Entry => (
            "bad expert id",
            judge_refusal(rank, &[victim], bad, got, took, timeout)?,
        ),
        Bad::Tokens => (
            "token count above the maximum",
            judge_token_refusal(rank, victim, max, got, took, timeout)?,
        ),
        Bad::CombineOut | Bad::CombineIn => {
            return Err(format!("rank {rank}: bad={what:?} is a combine's refusal").into());
        }
    })
}

/// A victim's refusal of its token count, one above the buffer's
/// maximum `max` (`bad=tokens`), as [`judge_refusal`] judges an entry's.
fn judge_token_refusal(
    rank: usize,
    victim: usize,
    max: usize,
    got: &Result<(), EpError>,
    took: Duration,
    timeout: Duration,
) -> Res<String> {
    let own = |e: &EpError| match e {
        EpError::TooManyTokens {
            rank: r,
            tokens,
            max: m,
        } if *r == rank && *tokens == max + 1 && *m == max => {
            Some(format!("refused its {tokens} tokens (at most {max})"))
        }
        _ => None,
    };
    judge_refusal_by(
        rank,
        &[victim],
        "a token count above the maximum",
        &own,
        got,
        took,
        timeout,
    )
}

/// What a refusal (`cause`, in words) gave this rank: on a victim what
/// `own` makes of its error (`None`: not its refusal), on any other rank
/// `PeerRefused` naming the lowest victim; within half the job timeout.
fn judge_refusal_by(
    rank: usize,
    victims: &[usize],
    cause: &str,
    own: &dyn Fn(&EpError) -> Option<String>,
    got: &Result<(), EpError>,
    took: Duration,
    timeout: Duration,
) -> Res<String> {
    let lowest = victims.iter().copied().min().unwrap_or(0);
    let what = match (got, victims.contains(&rank)) {
        (Err(e), true) if own(e).is_some() => own(e).unwrap_or_default(),
        (Err(EpError::PeerRefused { rank: r, peer }), false) if *r == rank && *peer == lowest => {
            format!("told that rank {lowest}'s inputs were refused")
        }
        _ => {
            return Err(format!(
                "rank {rank}: {cause} at ranks {victims:?} gave {got:?} after {took:?}"
            )
            .into());
        }
    };
    if took * 2 >= timeout {
        return Err(format!(
            "rank {rank}: the refused step ended only after {took:?} (GIN_TIMEOUT {timeout:?})"
        )
        .into());
    }
    Ok(what)
}

/// This rank's top-k ids of `me`, with an expert out of range (returned
/// beside them) at token 1, top-k slot 1 where this rank is `victim`.
fn bad_ids(cfg: &Config, rank: usize, me: &RankInput, victim: usize) -> Res<(Vec<i64>, i64)> {
    if me.tokens < 2 || cfg.topk < 2 {
        return Err(format!("rank {rank}: bad=1 needs 2 tokens and top-2 or more").into());
    }
    let bad = i64::try_from(cfg.num_experts + 3)?;
    let mut idx = me.topk_idx.clone();
    if rank == victim {
        idx[cfg.topk + 1] = bad;
    }
    Ok((idx, bad))
}

/// `ll device=cuda bad=1` (host inputs): rank `victim` (default 1) names
/// an expert out of range (its token 1, top-k slot 1) and must be refused
/// by name, every other rank with `PeerRefused` naming the victim (its
/// counts poisoned by its dispatch kernel, which sends no token), at once:
/// within half the job timeout; then every buffer takes the steps that
/// follow (with good inputs), which verify with the oracle on every rank.
fn ll_host_bad(
    cuda: &gin_core::cuda::CudaComm<'_>,
    buf: &mut gin_ep::cuda::CudaBuffer<'_, '_>,
    me: &RankInput,
    victim: usize,
) -> Res<String> {
    let cfg = *buf.config();
    let rank = buf.rank();
    let (idx, bad) = bad_ids(&cfg, rank, me, victim)?;
    let t = Instant::now();
    let got = buf.ll_dispatch(&me.x, &idx, &me.weights).map(|_| ());
    let took = t.elapsed();
    let timeout = cuda.comm().settings().timeout;
    let what = judge_refusal(rank, &[victim], bad, &got, took, timeout)?;
    Ok(format!(
        "; rank {victim}'s bad expert id in host memory: {what} in {:.0} ms, then the buffer's steps verified",
        took.as_secs_f64() * 1e3
    ))
}

/// `ll device=cuda bad=1` with `inputs=device` or `inputs=stream`: rank
/// `victim`'s expert id out of range (its token 1, top-k slot 1) lies in
/// GPU memory, found by its dispatch kernel. `inputs=device`: the waited
/// dispatch returns the refusal on every rank, the step ended
/// ([`stream_refusal`] for `inputs=stream`). The victim must name its
/// entry, every other rank the victim, within half the job timeout; then
/// every buffer takes the steps that follow, which verify with the oracle.
/// `bad=tokens`: the victim's dispatch passes one token more than the
/// buffer's maximum instead, refused by the host's check before anything
/// is launched, as a step every rank ends (the waited dispatch, and the
/// queued one, returns the error at once; every other rank names the
/// victim).
fn ll_device_bad(
    cuda: &gin_core::cuda::CudaComm<'_>,
    buf: &mut gin_ep::cuda::CudaBuffer<'_, '_>,
    me: &RankInput,
    dt: &DevTensors,
    victim: usize,
    what: Bad,
) -> Res<String> {
    let cfg = *buf.config();
    let rank = buf.rank();
    let max = cfg.max_tokens_per_rank;
    cuda.device().make_current()?;
    let (idx, bad) = match what {
        Bad::Entry => bad_ids(&cfg, rank, me, victim)?,
        _ => (me.topk_idx.clone(), 0),
    };
    let bad_idx = gin_core::cuda::DevMem::new(8 * idx.len().max(1))?;
    if !idx.is_empty() {
        bad_idx.write(0, &idx)?;
    }
    let inp = gin_ep::cuda::DeviceInputs {
        topk_idx: &bad_idx,
        tokens: if what == Bad::Tokens && rank == victim {
            max + 1
        } else {
            dt.tokens
        },
        ..dt.inputs()
    };
    let (got, took, how) = match &dt.stream {
        None => {
            let t = Instant::now();
            let got = buf.ll_dispatch_device(&inp).map(|_| ());
            (got, t.elapsed(), "in GPU memory")
        }
        Some(st) => {
            let (got, took) = stream_refusal(buf, st, &inp, dt)?;
            (got, took, "in GPU memory, its step queued on a stream")
        }
    };
    let timeout = cuda.comm().settings().timeout;
    let (subject, judged) = judge_bad(what, rank, victim, (bad, max), &got, took, timeout)?;
    Ok(format!(
        "; rank {victim}'s {subject} {how}: {judged} in {:.0} ms, then the buffer's steps verified",
        took.as_secs_f64() * 1e3
    ))
}

/// `inputs=stream bad=1`'s refused step, queued on `st`: the dispatch,
/// then (the stream synchronised: the dispatch kernel has recorded the
/// refusal) the identity expert, which must be queued all the same (a
/// refusal is `check`'s to report: a queued call that stopped would leave
/// its peers waiting); then `check`, whose result is returned with the time
/// it took from the dispatch; then the step's combine, queued as usual
/// (its result is void), synchronised and checked clean. A dispatch the
/// host's checks refuse (`bad=tokens` on the victim) returns the error
/// itself, having queued the refused step to its end: nothing more is
/// queued for it, and `check` must be clean.
fn stream_refusal(
    buf: &mut gin_ep::cuda::CudaBuffer<'_, '_>,
    st: &gin_core::cuda::Stream,
    inp: &gin_ep::cuda::DeviceInputs<'_>,
    dt: &DevTensors,
) -> Res<(Result<(), EpError>, Duration)> {
    let rank = buf.rank();
    let t = Instant::now();
    // SAFETY: one stream, in order; the inputs, dt's buffers and the stream
    // outlive the step: every launch is synchronised below before anything
    // is dropped or read, error or not.
    let s = unsafe { buf.ll_dispatch_on(st.into(), inp) };
    st.sync()?;
    let s = match s {
        Ok(s) => s,
        Err(e) => {
            let took = t.elapsed();
            buf.check().map_err(|c| {
                format!("rank {rank}: check after a dispatch refused by its host ({e}): {c}")
            })?;
            return Ok((Err(e), took));
        }
    };
    // SAFETY: as above.
    let r = unsafe { buf.ll_echo_on(st.into(), &s) };
    st.sync()?;
    r.map_err(|e| {
        format!(
            "rank {rank}: the expert queued after a refused dispatch had run was refused ({e}): \
             its peers would wait for this rank's combine"
        )
    })?;
    let got = buf.check();
    let took = t.elapsed();
    // SAFETY: as above (eout, with expert=tensor, outlives the step too).
    let r = unsafe {
        match &dt.eout {
            Some(eout) => buf.ll_combine_from_on(st.into(), &s, eout, &dt.out),
            None => buf.ll_combine_on(st.into(), &s, &dt.out),
        }
    };
    st.sync()?;
    r.map_err(|e| format!("rank {rank}: the refused step's combine was refused: {e}"))?;
    buf.check()
        .map_err(|e| format!("rank {rank}: the refused step's combine: {e}"))?;
    Ok((got, took))
}

/// `ll device=cuda inputs=queued bad=1`: three steps queued back to back on
/// a stream of the test's, each with inputs of its own (seeds 40 to 42),
/// the middle one's on rank `victim` with an expert id out of range at
/// token 1, top-k slot 1, in GPU memory. Every call must go ahead (the
/// refusal is recorded while they are queued: `check`'s to report); after
/// one synchronisation, `check` names the victim's entry on the victim and
/// the victim on every other rank, within half the job timeout; the other
/// two steps, refused nowhere, ran normally: their combines verify with the
/// oracle on every rank. ([`queued_steps`] then runs the verified steps.)
/// `bad=tokens`: the victim's middle dispatch passes one token more than
/// the buffer's maximum instead: that call returns the error at once,
/// having queued the refused step to its end (the victim queues nothing
/// more for it and goes on with the third step), its `check` is clean, and
/// every other rank's `check` names it.
fn ll_queued_bad(
    cuda: &gin_core::cuda::CudaComm<'_>,
    buf: &mut gin_ep::cuda::CudaBuffer<'_, '_>,
    victim: usize,
    what: Bad,
) -> Res<String> {
    let cfg = *buf.config();
    let (rank, n, h) = (buf.rank(), buf.nranks(), cfg.hidden);
    let max = cfg.max_tokens_per_rank;
    let (steps, tensors) = queued_inputs(cuda, &cfg, rank, n, 40, 3)?;
    let mut bad = 0;
    if what == Bad::Entry {
        let (idx, b) = bad_ids(&cfg, rank, &steps[1], victim)?;
        tensors[1].idx.write(0, &idx)?;
        bad = b;
    }
    // The victim's middle dispatch with bad=tokens: refused by its host.
    let refused_here = |i: usize| what == Bad::Tokens && rank == victim && i == 1;
    let st = gin_core::cuda::Stream::new()?;
    let start = Instant::now();
    let mut own: Result<(), EpError> = Ok(());
    let queued = (|| -> Result<(), EpError> {
        for (i, dt) in tensors.iter().enumerate() {
            let inp = gin_ep::cuda::DeviceInputs {
                tokens: if refused_here(i) { max + 1 } else { dt.tokens },
                ..dt.inputs()
            };
            // SAFETY: one stream, in order; every step's tensors and the
            // stream outlive the launches: synchronised below before
            // anything is dropped or read, error or not.
            unsafe {
                let s = match buf.ll_dispatch_on((&st).into(), &inp) {
                    Err(e) if refused_here(i) => {
                        own = Err(e);
                        continue;
                    }
                    r => r?,
                };
                buf.ll_echo_on((&st).into(), &s)?;
                buf.ll_combine_on((&st).into(), &s, &dt.out)?;
            }
        }
        Ok(())
    })();
    st.sync()?;
    queued
        .map_err(|e| format!("rank {rank}: a call queued with a refused step was refused: {e}"))?;
    let checked = buf.check();
    let got = if what == Bad::Tokens && rank == victim {
        checked
            .map_err(|e| format!("rank {rank}: check after a dispatch refused by its host: {e}"))?;
        own
    } else {
        checked
    };
    let took = start.elapsed();
    let timeout = cuda.comm().settings().timeout;
    let (subject, judged) = judge_bad(what, rank, victim, (bad, max), &got, took, timeout)?;
    let active = buf.active().to_vec();
    let local = cfg.local_experts(n);
    for i in [0, 2] {
        let dt = &tensors[i];
        let mut raw = vec![0u16; dt.tokens * h];
        if !raw.is_empty() {
            dt.out.read(0, &mut raw)?;
        }
        let combined: Vec<gin_ep::Bf16> = raw.into_iter().map(gin_ep::Bf16).collect();
        oracle::check_combine(rank, &combined, &steps[i], h, cfg.topk, cfg.fp8, |e| {
            active[e / local]
        })
        .map_err(|e| format!("step {i} of 3 queued with the refused step 1: {e}"))?;
    }
    Ok(format!(
        "; rank {victim}'s {subject} in GPU memory, step 1 of 3 queued back to back: {judged} in {:.0} ms, steps 0 and 2 verified, then the buffer's steps verified",
        took.as_secs_f64() * 1e3
    ))
}

/// What a combine's output tensor holds before a refused combine: a NaN
/// pattern no combine writes, so that an untouched tensor is told from a
/// written one.
const SENTINEL: u16 = 0x7fc1;

/// Fills `out` (BF16) with [`SENTINEL`].
fn fill_sentinel(out: &gin_core::cuda::DevMem) -> Res<()> {
    let v = vec![SENTINEL; out.len() / 2];
    if !v.is_empty() {
        out.write(0, &v)?;
    }
    Ok(())
}

/// Whether `out`'s first `n` BF16 still hold [`SENTINEL`].
fn untouched(out: &gin_core::cuda::DevMem, n: usize) -> Res<bool> {
    let mut v = vec![0u16; n];
    if !v.is_empty() {
        out.read(0, &mut v)?;
    }
    Ok(v.iter().all(|&w| w == SENTINEL))
}

/// Whether all of `t` still holds [`SENTINEL`].
fn untouched_all(t: &gin_core::cuda::DevMem) -> Res<bool> {
    untouched(t, t.len() / 2)
}

/// Whether a second call of a combine whose tensor was refused was
/// refused as out of order: the refused call ended the step.
fn ended(retry: Result<(), EpError>) -> bool {
    matches!(retry, Err(EpError::Phase { .. }))
}

/// The refused tensor of a combine, on a victim (`None` elsewhere: a rank
/// with few tokens allocates nothing): `bad=combine-out` an output one
/// element short, `bad=combine-in` expert outputs one element short,
/// allocated on this rank's GPU and filled with [`SENTINEL`], so that
/// a write into it is seen ([`untouched_all`]).
fn refused_tensor(
    buf: &gin_ep::cuda::CudaBuffer<'_, '_>,
    what: Bad,
    tokens: usize,
    victims: &[usize],
) -> Res<Option<gin_core::cuda::DevMem>> {
    let rank = buf.rank();
    if !victims.contains(&rank) {
        return Ok(None);
    }
    let bytes = match what {
        Bad::CombineIn => buf.device_layout().combine_bytes(),
        _ => 2 * tokens * buf.config().hidden,
    };
    if bytes < 18 {
        return Err(format!(
            "rank {rank}: bad={what:?} needs a tensor of 18 bytes or more to shorten, not {bytes} \
             (a victim with tokens)"
        )
        .into());
    }
    let t = gin_core::cuda::DevMem::new(bytes - 2)?;
    fill_sentinel(&t)?;
    Ok(Some(t))
}

/// A combine's refusal on this rank, in words, judged: a victim's call
/// must return `Shape` naming its refused tensor, having ended the step
/// (`ended`: a second call was refused as out of order); with
/// `bad=combine-out` every other rank's combine succeeds (`verified`: its
/// result passed the oracle); with `bad=combine-in` every other rank's
/// returns (or its `check` reports) `PeerRefusedCombine` naming the lowest
/// victim, its output untouched. `kept`: on a victim, its refused tensor
/// untouched (and, with `bad=combine-in`, the output its refused combine
/// must not write); on any other rank its output. Within half the job
/// timeout.
#[allow(clippy::too_many_arguments)]
fn judge_combine_bad(
    rank: usize,
    victims: &[usize],
    what: Bad,
    got: &Result<(), EpError>,
    verified: bool,
    kept: bool,
    ended: bool,
    took: Duration,
    timeout: Duration,
) -> Res<String> {
    let tensor = what.tensor();
    let lowest = victims.first().copied().unwrap_or(0);
    let whom = who(victims);
    let said = match (got, victims.contains(&rank), what) {
        (
            Err(EpError::Shape {
                rank: r, what: w, ..
            }),
            true,
            _,
        ) if *r == rank && *w == tensor && kept && ended => {
            format!("refused its {tensor}")
        }
        (Ok(()), false, Bad::CombineOut) if verified => {
            format!("combined normally beside {whom}'s refused output")
        }
        (Err(EpError::PeerRefusedCombine { rank: r, peer }), false, Bad::CombineIn)
            if *r == rank && *peer == lowest && kept =>
        {
            format!("told that rank {lowest} refused the combine, its output untouched")
        }
        _ => {
            return Err(format!(
                "rank {rank}: {whom}'s refused {tensor} gave {got:?} after {took:?} \
                 (verified {verified}, tensors untouched {kept}, step ended {ended})"
            )
            .into());
        }
    };
    if took * 2 >= timeout {
        return Err(format!(
            "rank {rank}: the refused combine ended only after {took:?} (GIN_TIMEOUT {timeout:?})"
        )
        .into());
    }
    Ok(said)
}

/// `ll device=cuda bad=combine-out` or `bad=combine-in`, after a dispatch
/// from host memory (no `inputs`), or in GPU memory on gin's stream
/// (`inputs=device`) or queued on a stream (`inputs=stream`; `mixed`):
/// one step whose dispatch and expert are normal, then each victim
/// (default rank 1; `victims=`: several in the same step) passes its
/// combine a refused tensor ([`refused_tensor`], filled with [`SENTINEL`]):
/// an output one element short (`ll_combine_device`, `ll_combine_on`), or
/// expert outputs one element short (`ll_combine_from_device`,
/// `ll_combine_from_on`). Its call must return `Shape` naming the tensor
/// (a queued one's `check` clean), its refused tensor untouched, and end
/// the step (a second call is refused as out of order); every other
/// rank's combine must end at once: with a refused output, normally (its
/// result verified by the oracle: the victims' expert outputs were sent
/// all the same); with refused expert outputs, refused
/// (`PeerRefusedCombine` naming the lowest victim, from the waited call
/// or `check`), its output untouched. Then every buffer takes the steps
/// that follow, which verify.
fn ll_combine_bad(
    cuda: &gin_core::cuda::CudaComm<'_>,
    buf: &mut gin_ep::cuda::CudaBuffer<'_, '_>,
    me: &RankInput,
    dt: Option<&DevTensors>,
    victims: &[usize],
    what: Bad,
) -> Res<String> {
    let cfg = *buf.config();
    let (rank, n, h) = (buf.rank(), buf.nranks(), cfg.hidden);
    let tokens = me.tokens;
    cuda.device().make_current()?;
    let refused = refused_tensor(buf, what, tokens, victims)?;
    let out = gin_core::cuda::DevMem::new((2 * tokens * h).max(16))?;
    fill_sentinel(&out)?;
    // The step's dispatch and expert, normal on every rank.
    let (step, disp, how) = match dt {
        None => {
            let d = buf.ll_dispatch(&me.x, &me.topk_idx, &me.weights)?;
            buf.ll_echo(&d)?;
            (d.handle(), Some(d), "after a dispatch from host memory")
        }
        Some(dt) => match &dt.stream {
            None => {
                let s = buf.ll_dispatch_device(&dt.inputs())?;
                buf.ll_echo_device(&s)?;
                (s, None, "in GPU memory")
            }
            Some(st) => {
                let inp = dt.inputs();
                // SAFETY: one stream, in order; dt's buffers and the stream
                // outlive the step, synchronised by on_stream.
                let s = on_stream(buf, st, |buf, on| unsafe {
                    let s = buf.ll_dispatch_on(on, &inp)?;
                    buf.ll_echo_on(on, &s)?;
                    Ok(s)
                })?;
                (s, None, "in GPU memory, its step queued on a stream")
            }
        },
    };
    let stream = dt.and_then(|d| d.stream.as_ref());
    let start = Instant::now();
    // The combine: a victim's with its refused tensor; the others' as
    // usual (from host inputs, ll_combine, whose result is read back).
    let mut host_result = None;
    let mut retry = Ok(());
    let got = if let Some(refused) = &refused {
        let (eout, dst) = match what {
            Bad::CombineIn => (Some(refused), &out),
            _ => (None, refused),
        };
        if let Some(st) = stream {
            // SAFETY: one stream, in order; the tensors and the stream
            // outlive the combine: synchronised below, error or not. The
            // second call (the step ended) is refused before queuing
            // anything.
            unsafe {
                let r = match eout {
                    Some(e) => buf.ll_combine_from_on(st.into(), &step, e, dst),
                    None => buf.ll_combine_on(st.into(), &step, dst),
                };
                st.sync()?;
                buf.check().map_err(|e| {
                    format!("rank {rank}: check after a combine refused by its host: {e}")
                })?;
                retry = buf.ll_combine_on(st.into(), &step, &out);
                st.sync()?;
                r
            }
        } else {
            let r = match eout {
                Some(e) => buf.ll_combine_from_device(&step, e, dst),
                None => buf.ll_combine_device(&step, dst),
            };
            retry = buf.ll_combine_device(&step, &out);
            r
        }
    } else if let Some(d) = &disp {
        buf.ll_combine(d).map(|c| host_result = Some(c.x))
    } else if let Some(st) = stream {
        // SAFETY: as above.
        let r = unsafe { buf.ll_combine_on(st.into(), &step, &out) };
        st.sync()?;
        r.map_err(|e| format!("rank {rank}: a peer's queued combine was refused: {e}"))?;
        buf.check()
    } else {
        buf.ll_combine_device(&step, &out)
    };
    let took = start.elapsed();
    // What this rank's combine gave: the result (CombineOut's peers), or
    // its output untouched (CombineIn's peers).
    let combined = match host_result {
        Some(x) => Some(x),
        None if got.is_ok() && refused.is_none() => {
            let mut raw = vec![0u16; tokens * h];
            if !raw.is_empty() {
                out.read(0, &mut raw)?;
            }
            Some(raw.into_iter().map(gin_ep::Bf16).collect())
        }
        None => None,
    };
    let verified = match &combined {
        Some(x) => {
            let active = buf.active().to_vec();
            let l = cfg.local_experts(n);
            oracle::check_combine(rank, x, me, h, cfg.topk, cfg.fp8, |e| active[e / l])?;
            true
        }
        None => false,
    };
    // A victim: its refused tensor, and with refused expert outputs the
    // output its refused combine must not write. Any other rank: its
    // output (a peer's ll_combine, after a dispatch from host memory, has
    // no output tensor).
    let kept = match &refused {
        Some(t) => untouched_all(t)? && (what != Bad::CombineIn || untouched(&out, tokens * h)?),
        None => disp.is_some() || untouched(&out, tokens * h)?,
    };
    let timeout = cuda.comm().settings().timeout;
    let said = judge_combine_bad(
        rank,
        victims,
        what,
        &got,
        verified,
        kept,
        ended(retry),
        took,
        timeout,
    )?;
    Ok(format!(
        "; {}'s {} {how}: {said} in {:.0} ms, then the buffer's steps verified",
        who(victims),
        what.tensor(),
        took.as_secs_f64() * 1e3
    ))
}

/// `ll device=cuda inputs=queued bad=combine-out` or `bad=combine-in`:
/// three steps queued back to back (seeds 40 to 42), the middle one's
/// combine on each victim (`victims=`: several) given a refused tensor
/// ([`refused_tensor`]); that call returns `Shape` naming it, having
/// queued its combine all the same (a second call is refused as out of
/// order), and the victim goes on with the third step. Every other call
/// goes ahead; after one synchronisation a victim's `check` is clean, its
/// refused tensor untouched, and every other rank's reports
/// `PeerRefusedCombine` naming the lowest victim (`bad=combine-in`: the
/// middle step's output untouched on every rank) or nothing
/// (`bad=combine-out`: the middle step verifies on every other rank);
/// steps 0 and 2 verify on every rank.
fn ll_queued_combine_bad(
    cuda: &gin_core::cuda::CudaComm<'_>,
    buf: &mut gin_ep::cuda::CudaBuffer<'_, '_>,
    victims: &[usize],
    what: Bad,
) -> Res<String> {
    let cfg = *buf.config();
    let (rank, n, h) = (buf.rank(), buf.nranks(), cfg.hidden);
    let (steps, tensors) = queued_inputs(cuda, &cfg, rank, n, 40, 3)?;
    let refused = refused_tensor(buf, what, steps[1].tokens, victims)?;
    for dt in &tensors {
        fill_sentinel(&dt.out)?;
    }
    let victim = victims.contains(&rank);
    let here = |i: usize| victim && i == 1;
    let st = gin_core::cuda::Stream::new()?;
    let start = Instant::now();
    let mut own: Result<(), EpError> = Ok(());
    let mut retry = Ok(());
    let queued = (|| -> Result<(), EpError> {
        for (i, dt) in tensors.iter().enumerate() {
            // SAFETY: one stream, in order; every step's tensors, the
            // refused one and the stream outlive the launches: synchronised
            // below before anything is dropped or read, error or not. The
            // second call (the step ended) is refused before queuing
            // anything.
            unsafe {
                let step = buf.ll_dispatch_on((&st).into(), &dt.inputs())?;
                buf.ll_echo_on((&st).into(), &step)?;
                let res = match (refused.as_ref().filter(|_| here(i)), what) {
                    (Some(r), Bad::CombineIn) => {
                        buf.ll_combine_from_on((&st).into(), &step, r, &dt.out)
                    }
                    (Some(r), _) => buf.ll_combine_on((&st).into(), &step, r),
                    (None, _) => buf.ll_combine_on((&st).into(), &step, &dt.out),
                };
                match res {
                    Err(e) if here(i) => {
                        own = Err(e);
                        retry = buf.ll_combine_on((&st).into(), &step, &dt.out);
                    }
                    other => other?,
                }
            }
        }
        Ok(())
    })();
    st.sync()?;
    queued.map_err(|e| {
        format!("rank {rank}: a call queued with a refused combine was refused: {e}")
    })?;
    let checked = buf.check();
    let got = if victim {
        checked
            .map_err(|e| format!("rank {rank}: check after a combine refused by its host: {e}"))?;
        own
    } else {
        checked
    };
    let took = start.elapsed();
    let active = buf.active().to_vec();
    let local = cfg.local_experts(n);
    let mut verified = false;
    // A victim's refused tensor, untouched.
    let mut kept = match &refused {
        Some(t) => untouched_all(t)?,
        None => true,
    };
    for (i, dt) in tensors.iter().enumerate() {
        let mut raw = vec![0u16; dt.tokens * h];
        if !raw.is_empty() {
            dt.out.read(0, &mut raw)?;
        }
        let refused_step = i == 1 && (what == Bad::CombineIn || victim);
        if refused_step {
            kept &= raw.iter().all(|&w| w == SENTINEL);
            continue;
        }
        let combined: Vec<gin_ep::Bf16> = raw.into_iter().map(gin_ep::Bf16).collect();
        oracle::check_combine(rank, &combined, &steps[i], h, cfg.topk, cfg.fp8, |e| {
            active[e / local]
        })
        .map_err(|e| format!("step {i} of 3 queued with the refused combine of step 1: {e}"))?;
        verified |= i == 1;
    }
    let timeout = cuda.comm().settings().timeout;
    let said = judge_combine_bad(
        rank,
        victims,
        what,
        &got,
        verified,
        kept,
        ended(retry),
        took,
        timeout,
    )?;
    Ok(format!(
        "; {}'s {} in GPU memory, step 1 of 3 queued back to back: {said} in {:.0} ms, steps 0 and 2 verified, then the buffer's steps verified",
        who(victims),
        what.tensor(),
        took.as_secs_f64() * 1e3
    ))
}

/// One high-throughput step on CUDA ranks: dispatch, check (first time),
/// the identity expert on the GPU, combine, check; the digests of what was
/// received and combined (those of CPU ranks' `ht` with the same inputs).
/// With `dev` (`inputs=device`), the inputs and the combine's output live
/// in GPU memory (`ht_dispatch_device`, `ht_echo_device`,
/// `ht_combine_device`); what was received is copied back for the checks
/// between the dispatch and the combine, what was combined after it (the
/// test's copies, not the step's).
fn cuda_ht_step(
    buf: &mut gin_ep::cuda::CudaBuffer<'_, '_>,
    all: &[RankInput],
    tables: &[Vec<i64>],
    check: bool,
    dev: Option<&DevTensors>,
) -> Res<(u64, u64)> {
    let cfg = *buf.config();
    let rank = buf.rank();
    let me = &all[rank];
    let (got, combined) = if let Some(dt) = dev {
        let s = buf.ht_dispatch_device(&dt.inputs())?;
        // The handle's blocks by source against the all-gathered routing
        // tables (the read-back's are checked by check_ht_view below).
        let want = oracle::ht_counts(rank, &cfg, buf.active(), tables);
        let start = |p: usize| want[..p].iter().sum::<usize>();
        if (0..buf.nranks()).any(|p| s.count(p) != want[p] || s.block_start(p) != start(p))
            || s.received() != want.iter().sum::<usize>()
        {
            let got: Vec<usize> = (0..buf.nranks()).map(|p| s.count(p)).collect();
            return Err(format!(
                "rank {rank}: the step's handle counts {got:?} tokens by source, the all-gathered \
                 tables {want:?}"
            )
            .into());
        }
        let d = buf.ht_read_back(&s)?;
        let got = buf.ht_received(&d)?;
        buf.ht_echo_device(&s)?;
        buf.ht_combine_device(&s, &dt.out)?;
        let mut raw = vec![0u16; s.tokens() * cfg.hidden];
        if !raw.is_empty() {
            dt.out.read(0, &mut raw)?;
        }
        let x = raw.into_iter().map(gin_ep::Bf16).collect();
        (
            got,
            gin_ep::Combined {
                x,
                lost: Vec::new(),
            },
        )
    } else {
        let d = buf.ht_dispatch(&me.x, &me.topk_idx, &me.weights)?;
        let got = buf.ht_received(&d)?;
        buf.ht_echo(&d)?;
        (got, buf.ht_combine(&d)?)
    };
    if check {
        oracle::check_ht_view(rank, &cfg, buf.active(), &got, all, tables)?;
    }
    let dig = oracle::ht_view_digest(&got);
    if check {
        let active = buf.active().to_vec();
        let l = cfg.local_experts(buf.nranks());
        oracle::check_combine(rank, &combined.x, me, cfg.hidden, cfg.topk, cfg.fp8, |e| {
            active[e / l]
        })?;
    }
    Ok((dig, oracle::bf16_digest(&combined.x)))
}

/// The `ht` oracle on CUDA ranks: the first step checked, `repeats` steps
/// bit-identical.
fn cuda_ht_run(comm: &Comm, args: &Args) -> Res<String> {
    let cfg = config(comm, args, Mode::HighThroughput);
    let cuda = comm.cuda()?;
    let mut buf = gin_ep::cuda::CudaBuffer::new(&cuda, cfg)?;
    let (all, tables) = inputs(comm, &cfg)?;
    let kind = Inputs::of(args, comm.rank())?;
    let dt = match kind {
        Inputs::Host => None,
        Inputs::Device => Some(DevTensors::upload(
            &cuda,
            &all[comm.rank()],
            cfg.hidden,
            false,
            None,
        )?),
        other => {
            return Err(
                format!("ht on CUDA ranks takes inputs=host or device, not {other:?}").into(),
            );
        }
    };
    let mut bad = String::new();
    // What high-throughput mode refuses: an entry (bad=1) and the combine's
    // output (bad=combine-out); anything else is refused here, never
    // ignored (bad=tokens: the low-latency test's; bad=combine-in: no
    // expert-output tensor in this mode).
    match Bad::of(args)? {
        None => {}
        Some(what @ (Bad::Entry | Bad::CombineOut)) if args.kv.contains_key("then") => {
            return Err(format!("ht device=cuda bad={what:?} takes no then=").into());
        }
        Some(Bad::CombineOut) => {
            let victims = Bad::CombineOut.victims(args, comm.nranks())?;
            let dt = dt
                .as_ref()
                .ok_or("ht bad=combine-out takes inputs=device (ht_combine_device)")?;
            bad = ht_combine_bad(&cuda, &mut buf, &all[comm.rank()], dt, &victims)?;
        }
        Some(Bad::Entry) => {
            let victim = Bad::Entry.victims(args, comm.nranks())?[0];
            bad = ht_bad(&cuda, &mut buf, &all[comm.rank()], dt.as_ref(), victim)?;
        }
        Some(other) => {
            return Err(format!(
                "ht device=cuda takes bad=1 or bad=combine-out, not bad={other:?}"
            )
            .into());
        }
    }
    let repeats = args.get("repeats", 20);
    let first = cuda_ht_step(&mut buf, &all, &tables, true, dt.as_ref())?;
    for i in 1..repeats {
        let again = cuda_ht_step(&mut buf, &all, &tables, false, dt.as_ref())?;
        if again != first {
            return Err(format!(
                "rank {}: high-throughput repeat {i} on CUDA ranks differs from the first (digests {again:x?} vs {first:x?})",
                comm.rank()
            )
            .into());
        }
    }
    let backend = buf.backend_name();
    buf.destroy()?;
    Ok(format!(
        "CUDA ranks ({backend}, GPU {}; inputs {kind:?}{bad}): {} tokens, hidden {}, {} experts, top-{}{}, {} channels, rings of {}, {repeats} repeats bit-identical, dispatch digest {:016x}, combine digest {:016x}",
        cuda.device().name(),
        all[comm.rank()].tokens,
        cfg.hidden,
        cfg.num_experts,
        cfg.topk,
        if cfg.fp8 { ", fp8" } else { "" },
        cfg.channels,
        cfg.ring_slots,
        first.0,
        first.1,
    ))
}

/// `ht device=cuda bad=1` (host inputs or `inputs=device`): rank `victim`
/// (default 1) names an expert out of range (its token 1, top-k slot 1; in
/// GPU memory with `inputs=device`) and must be refused by name, every
/// other rank with `PeerRefused` naming the victim (told by the
/// victim's refused notify row, at once: within half the job timeout), no
/// rank sending anything; then every buffer takes the steps that follow
/// (with good inputs), which verify on every rank.
fn ht_bad(
    cuda: &gin_core::cuda::CudaComm<'_>,
    buf: &mut gin_ep::cuda::CudaBuffer<'_, '_>,
    me: &RankInput,
    dt: Option<&DevTensors>,
    victim: usize,
) -> Res<String> {
    let cfg = *buf.config();
    let rank = buf.rank();
    if me.tokens < 2 || cfg.topk < 2 {
        return Err(format!("rank {rank}: bad=1 needs 2 tokens and top-2 or more").into());
    }
    let bad = i64::try_from(cfg.num_experts + 3)?;
    let mut idx = me.topk_idx.clone();
    if rank == victim {
        idx[cfg.topk + 1] = bad;
    }
    let t = Instant::now();
    let got = match dt {
        Some(good) => {
            cuda.device().make_current()?;
            let bad_idx = gin_core::cuda::DevMem::new(8 * idx.len())?;
            bad_idx.write(0, &idx)?;
            let inp = gin_ep::cuda::DeviceInputs {
                topk_idx: &bad_idx,
                ..good.inputs()
            };
            buf.ht_dispatch_device(&inp).map(|_| ())
        }
        None => buf.ht_dispatch(&me.x, &idx, &me.weights).map(|_| ()),
    };
    let took = t.elapsed();
    let timeout = cuda.comm().settings().timeout;
    let what = judge_refusal(rank, &[victim], bad, &got, took, timeout)?;
    Ok(format!(
        "; rank {victim}'s bad expert id{}: {what} in {:.0} ms, then the buffer's steps verified",
        if dt.is_some() { " in GPU memory" } else { "" },
        took.as_secs_f64() * 1e3
    ))
}

/// `ht device=cuda inputs=device bad=combine-out`: one step dispatched
/// from GPU memory, then each victim (default rank 1; `victims=`: several)
/// passes `ht_combine_device` an output one element short, filled with
/// [`SENTINEL`]: its call must return `Shape` naming the combine output
/// (its combine ran in full into the buffer's own memory, the refused
/// tensor untouched) and end the step (a second call is refused as out of
/// order), and every other rank's combine must give its normal result,
/// verified by the oracle, at once; then every buffer takes the steps
/// that follow, which verify.
fn ht_combine_bad(
    cuda: &gin_core::cuda::CudaComm<'_>,
    buf: &mut gin_ep::cuda::CudaBuffer<'_, '_>,
    me: &RankInput,
    dt: &DevTensors,
    victims: &[usize],
) -> Res<String> {
    let cfg = *buf.config();
    let (rank, h) = (buf.rank(), cfg.hidden);
    cuda.device().make_current()?;
    let refused = refused_tensor(buf, Bad::CombineOut, me.tokens, victims)?;
    fill_sentinel(&dt.out)?;
    let step = buf.ht_dispatch_device(&dt.inputs())?;
    buf.ht_echo_device(&step)?;
    let start = Instant::now();
    let mut retry = Ok(());
    let got = if let Some(refused) = &refused {
        let r = buf.ht_combine_device(&step, refused);
        retry = buf.ht_combine_device(&step, &dt.out);
        r
    } else {
        buf.ht_combine_device(&step, &dt.out)
    };
    let took = start.elapsed();
    let mut verified = false;
    if got.is_ok() {
        let mut raw = vec![0u16; me.tokens * h];
        if !raw.is_empty() {
            dt.out.read(0, &mut raw)?;
        }
        let combined: Vec<gin_ep::Bf16> = raw.into_iter().map(gin_ep::Bf16).collect();
        let active = buf.active().to_vec();
        let l = cfg.local_experts(buf.nranks());
        oracle::check_combine(rank, &combined, me, h, cfg.topk, cfg.fp8, |e| active[e / l])?;
        verified = true;
    }
    // A victim's refused tensor (its own output, never passed, stays as
    // filled: the retry was refused).
    let kept = match &refused {
        Some(t) => untouched_all(t)? && untouched(&dt.out, me.tokens * h)?,
        None => true,
    };
    let timeout = cuda.comm().settings().timeout;
    let said = judge_combine_bad(
        rank,
        victims,
        Bad::CombineOut,
        &got,
        verified,
        kept,
        ended(retry),
        took,
        timeout,
    )?;
    Ok(format!(
        "; {}'s combine output in GPU memory: {said} in {:.0} ms, then the buffer's steps verified",
        who(victims),
        took.as_secs_f64() * 1e3
    ))
}

/// `kill device=cuda`: one verified step with every rank, its launches
/// queued on the test's stream (as `inputs=stream`); then rank `victim`
/// (default the last) dies once every survivor is past a barrier, and the
/// survivors queue the next step. The watcher the buffer started with the
/// queued launches must abort their waits at once: each survivor fails
/// with the step's error, which names the dead rank (run.sh greps it), or,
/// where the waits lasted half the job timeout or more, with an error
/// saying no watcher aborted them.
fn cuda_kill(comm: &Comm, args: &Args) -> Res<String> {
    let cfg = config(comm, args, Mode::LowLatency);
    let cuda = comm.cuda()?;
    let mut buf = gin_ep::cuda::CudaBuffer::new(&cuda, cfg)?;
    let (all, tables) = inputs(comm, &cfg)?;
    let dt = DevTensors::upload(&cuda, &all[comm.rank()], cfg.hidden, true, None)?;
    cuda_step(&mut buf, &all, &tables, true, Some(&dt))?;
    let (rank, victim) = (comm.rank(), args.get("victim", comm.nranks() - 1));
    comm.bootstrap().barrier()?;
    if rank == victim {
        for p in (0..comm.nranks()).filter(|&p| p != victim) {
            comm.bootstrap().recv(p, PAST_BARRIER)?;
        }
        std::process::abort();
    }
    comm.bootstrap().send(victim, PAST_BARRIER, b"past")?;
    let t = Instant::now();
    let r = device_step(&mut buf, &dt);
    let (took, timeout) = (t.elapsed(), comm.settings().timeout);
    match r {
        Ok(_) => Err(format!("rank {rank}: the step after rank {victim} died succeeded").into()),
        Err(e) if took * 2 >= timeout => {
            eprintln!("rank {rank}: the step's error: {e}");
            Err(format!(
                "rank {rank}: the queued step's waits ended only after {took:?} (GIN_TIMEOUT \
                 {timeout:?}): no watcher aborted them"
            )
            .into())
        }
        // No collective destroy: the job has lost a rank.
        Err(e) => Err(format!("{e} (after {took:?}, GIN_TIMEOUT {timeout:?})").into()),
    }
}

fn config(comm: &Comm, args: &Args, mode: Mode) -> Config {
    let n = comm.nranks();
    let experts = args.get("experts", 3) * n;
    let mut cfg = match mode {
        Mode::LowLatency => Config::low_latency(
            args.get("hidden", 256),
            args.get("tokens", 24),
            experts,
            args.get("topk", 4).min(experts),
        ),
        Mode::HighThroughput => Config::high_throughput(
            args.get("hidden", 256),
            args.get("tokens", 24),
            experts,
            args.get("topk", 4).min(experts),
        ),
    };
    cfg.fp8 = args.get("fp8", 0) == 1;
    if let Some(s) = args.kv.get("ring").and_then(|v| v.parse().ok()) {
        cfg.ring_slots = s;
    }
    if let Some(c) = args.kv.get("channels").and_then(|v| v.parse().ok()) {
        cfg.channels = c;
    }
    cfg
}

/// The buffer of a scenario, with `threads=N` applied.
fn buffer<'c>(comm: &'c Comm, args: &Args, cfg: Config) -> Res<Buffer<'c>> {
    let mut buf = Buffer::new(comm, cfg)?;
    buf.set_threads(args.get("threads", 1));
    Ok(buf)
}

/// Every rank's inputs (each rank can rebuild any rank's), and the routing
/// table all-gathered through the bootstrap.
fn inputs(comm: &Comm, cfg: &Config) -> Res<(Vec<RankInput>, Vec<Vec<i64>>)> {
    let n = comm.nranks();
    let all: Vec<RankInput> = (0..n)
        .map(|r| {
            oracle::rank_input(
                20,
                r,
                n,
                oracle::tokens_for_rank(cfg.max_tokens_per_rank, r),
                cfg.hidden,
                cfg.num_experts,
                cfg.topk,
            )
        })
        .collect();
    let mine: Vec<u8> = all[comm.rank()]
        .topk_idx
        .iter()
        .flat_map(|e| e.to_le_bytes())
        .collect();
    let tables: Vec<Vec<i64>> = comm
        .bootstrap()
        .allgather(&mine)?
        .iter()
        .map(|b| {
            b.chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect()
        })
        .collect();
    Ok((all, tables))
}

/// A high-throughput dispatch through the receive hook: send, then compute
/// (a checksum of the tokens) between polls until the poll reports this
/// rank's part done, then receive. Returns the polls it took.
fn hooked_dispatch(buf: &mut Buffer<'_>, me: &RankInput) -> Res<(gin_ep::HtDispatch, u64)> {
    let mut p = buf.ht_dispatch_send(&me.x, &me.topk_idx, &me.weights)?;
    let (mut polls, mut sum) = (0u64, 0u64);
    while !buf.ht_dispatch_poll(&mut p)? {
        polls += 1;
        sum =
            me.x.iter()
                .fold(sum, |a, v| a.wrapping_mul(31).wrapping_add(u64::from(v.0)));
    }
    std::hint::black_box(sum);
    Ok((buf.ht_dispatch_recv(p)?, polls))
}

/// One step: dispatch, check (first time), identity expert, combine, check;
/// returns the digests of what was received and combined. `hook`: the
/// high-throughput dispatch goes through the receive hook.
fn step(
    buf: &mut Buffer<'_>,
    all: &[RankInput],
    tables: &[Vec<i64>],
    check: bool,
) -> Res<(u64, u64)> {
    step_with(buf, all, tables, check, false)
}

fn step_with(
    buf: &mut Buffer<'_>,
    all: &[RankInput],
    tables: &[Vec<i64>],
    check: bool,
    hook: bool,
) -> Res<(u64, u64)> {
    let cfg = *buf.config();
    let me = &all[buf.rank()];
    let (dig, combined) = match cfg.mode {
        Mode::LowLatency => {
            let d = buf.ll_dispatch(&me.x, &me.topk_idx, &me.weights)?;
            if check {
                oracle::check_ll_dispatch(buf, &d, all, tables)?;
            }
            let dig = oracle::ll_digest(buf, &d);
            buf.ll_echo(&d)?;
            (dig, buf.ll_combine(&d)?)
        }
        Mode::HighThroughput => {
            let d = if hook {
                hooked_dispatch(buf, me)?.0
            } else {
                buf.ht_dispatch(&me.x, &me.topk_idx, &me.weights)?
            };
            if check {
                oracle::check_ht_dispatch(buf, &d, all, tables)?;
            }
            let dig = oracle::ht_digest(buf, &d);
            buf.ht_echo(&d)?;
            (dig, buf.ht_combine(&d)?)
        }
    };
    if check {
        let active = buf.active().to_vec();
        let l = cfg.local_experts(buf.nranks());
        oracle::check_combine(
            buf.rank(),
            &combined.x,
            me,
            cfg.hidden,
            cfg.topk,
            cfg.fp8,
            |e| active[e / l],
        )?;
    }
    Ok((dig, oracle::bf16_digest(&combined.x)))
}

fn oracle_run(comm: &Comm, args: &Args, mode: Mode) -> Res<String> {
    let cfg = config(comm, args, mode);
    let mut buf = buffer(comm, args, cfg)?;
    let (all, tables) = inputs(comm, &cfg)?;
    let repeats = args.get("repeats", 20);
    let hook = args.get("hook", 0) == 1;
    let first = step_with(&mut buf, &all, &tables, true, hook)?;
    for i in 1..repeats {
        let again = step_with(&mut buf, &all, &tables, false, hook)?;
        if again != first {
            return Err(format!(
                "rank {}: repeat {i} differs from the first (digests {again:x?} vs {first:x?})",
                comm.rank()
            )
            .into());
        }
    }
    buf.destroy()?;
    Ok(format!(
        "{} tokens, hidden {}, {} experts, top-{}{}, {repeats} repeats bit-identical, dispatch digest {:016x}, combine digest {:016x}",
        all[comm.rank()].tokens,
        cfg.hidden,
        cfg.num_experts,
        cfg.topk,
        if cfg.fp8 { ", fp8" } else { "" },
        first.0,
        first.1,
    ))
}

/// Bad inputs on every rank alike: a clear error naming the entry (no rank
/// sends a token; each ends the refused step with the others), and the step
/// that follows works on every rank (nothing was corrupted).
fn bad_inputs(comm: &Comm, args: &Args) -> Res<String> {
    let mode = if args.get("ht", 0) == 1 {
        Mode::HighThroughput
    } else {
        Mode::LowLatency
    };
    let cfg = config(comm, args, mode);
    let rank = comm.rank();
    // A configuration that differs on one rank fails on every rank.
    let mut odd = cfg;
    if rank == comm.nranks() - 1 {
        odd.hidden += 8;
    }
    match Buffer::new(comm, odd) {
        Err(EpError::ConfigMismatch {
            field: "hidden", ..
        }) => {}
        other => return Err(format!("rank {rank}: mismatched hidden gave {other:?}").into()),
    }
    let mut buf = Buffer::new(comm, cfg)?;
    let (all, tables) = inputs(comm, &cfg)?;
    let me = &all[rank];
    let (k, h) = (cfg.topk, cfg.hidden);
    let mut idx = me.topk_idx.clone();
    idx[k + 1] = cfg.num_experts as i64;
    let too_many = vec![-1i64; (cfg.max_tokens_per_rank + 1) * k];
    let cases: Vec<(&str, Result<(), EpError>)> = vec![
        (
            "expert out of range",
            try_dispatch(&mut buf, &me.x, &idx, &me.weights),
        ),
        (
            "too many tokens",
            try_dispatch(
                &mut buf,
                &vec![gin_ep::Bf16::ZERO; too_many.len() / k * h],
                &too_many,
                &vec![0.0; too_many.len()],
            ),
        ),
        (
            "hidden mismatch",
            try_dispatch(&mut buf, &me.x[..me.x.len() - 1], &me.topk_idx, &me.weights),
        ),
    ];
    for (name, r) in cases {
        let ok = matches!(
            (name, &r),
            (
                "expert out of range",
                Err(EpError::ExpertOutOfRange { token: 1, .. })
            ) | ("too many tokens", Err(EpError::TooManyTokens { .. }))
                | ("hidden mismatch", Err(EpError::Shape { what: "x", .. }))
        );
        if !ok {
            return Err(format!("rank {rank}: {name}: got {r:?}").into());
        }
    }
    // A replicated table that differs on one rank.
    let mut global: Vec<i64> = tables.concat();
    if rank == 0 {
        global[0] = -1 - global[0].max(0);
    }
    match buf.check_same_everywhere("all-gathered routing table", &global) {
        Err(EpError::RoutingMismatch { .. }) => {}
        other => return Err(format!("rank {rank}: differing table gave {other:?}").into()),
    }
    // No token was sent and every refused step ended on every rank: a full
    // step still verifies on every rank.
    step(&mut buf, &all, &tables, true)?;
    buf.destroy()?;
    Ok("out-of-range expert, too many tokens, mismatched hidden, differing config and table refused; next step verified".into())
}

/// Bad inputs on one rank only, on CPU ranks (`ht=1`: high-throughput
/// mode): after a verified step, rank `victim` (default 1) names an expert
/// out of range (its token 1, top-k slot 1) and must be refused by name,
/// every other rank with `PeerRefused` naming the victim, at once
/// (within half the job timeout); then the victim and the next rank both
/// do, every other rank naming the lower of the two; then `repeats` steps
/// (default 3) verify with the oracle on every rank, bit-identical to the
/// first: nothing was corrupted, every buffer stayed usable.
fn refuse(comm: &Comm, args: &Args) -> Res<String> {
    let mode = if args.get("ht", 0) == 1 {
        Mode::HighThroughput
    } else {
        Mode::LowLatency
    };
    let cfg = config(comm, args, mode);
    let (rank, n) = (comm.rank(), comm.nranks());
    let mut buf = buffer(comm, args, cfg)?;
    let (all, tables) = inputs(comm, &cfg)?;
    let victim = args.get("victim", 1) % n;
    let first = step(&mut buf, &all, &tables, true)?;
    let mut told = Vec::new();
    for victims in [vec![victim], vec![victim, (victim + 1) % n]] {
        told.push(refused_step(comm, &mut buf, &all[rank], &victims)?);
    }
    for i in 0..args.get("repeats", 3) {
        let again = step(&mut buf, &all, &tables, true)?;
        if again != first {
            return Err(format!(
                "rank {rank}: step {i} after the refused ones differs from the first (digests {again:x?} vs {first:x?})"
            )
            .into());
        }
    }
    buf.destroy()?;
    Ok(format!(
        "rank {victim}'s bad expert id: {}; then with rank {}'s too: {}; the steps after them verified, bit-identical",
        told[0],
        (victim + 1) % n,
        told[1]
    ))
}

/// A refused step that cannot be ended (CPU ranks; `ht=1`:
/// high-throughput mode, else low-latency): rank
/// `victim` (default 1) names an expert out of range while no other rank
/// takes part in the step, so the victim's wait for their signals runs out
/// (its own timeout, `wait_ms`, default 300). The victim must report that
/// timeout and then refuse its next dispatch ([`EpError::Phase`]): taking
/// it would read the refused step's late signals as the next step's.
fn refuse_unended(comm: &Comm, args: &Args) -> Res<String> {
    let mode = if args.get("ht", 0) == 1 {
        Mode::HighThroughput
    } else {
        Mode::LowLatency
    };
    let cfg = config(comm, args, mode);
    let rank = comm.rank();
    let mut buf = buffer(comm, args, cfg)?;
    let (all, _) = inputs(comm, &cfg)?;
    let me = &all[rank];
    let victim = args.get("victim", 1) % comm.nranks();
    let what = if rank == victim {
        buf.set_timeout(Duration::from_millis(args.get("wait_ms", 300) as u64));
        // `good=1`: good inputs, a step nobody else takes part in either.
        let mut idx = me.topk_idx.clone();
        if args.get("good", 0) == 0 {
            idx[0] = i64::try_from(cfg.num_experts)?;
        }
        match try_dispatch(&mut buf, &me.x, &idx, &me.weights) {
            Err(EpError::Timeout { rank: r, .. }) if r == rank => {}
            other => {
                return Err(format!("rank {rank}: a step nobody ended gave {other:?}").into());
            }
        }
        match try_dispatch(&mut buf, &me.x, &me.topk_idx, &me.weights) {
            Err(EpError::Phase {
                call: "ll_dispatch_send" | "ht_dispatch",
                ..
            }) => "its unended step timed out and the next dispatch was refused".to_owned(),
            other => {
                return Err(format!(
                    "rank {rank}: a dispatch after an unended refused step gave {other:?}"
                )
                .into());
            }
        }
    } else {
        format!("sat out rank {victim}'s refused step")
    };
    comm.bootstrap().barrier()?;
    buf.destroy()?;
    Ok(what)
}

/// One step in which every rank of `victims` names an expert out of range
/// at token 1, top-k slot 1: each must report that entry, every other rank
/// [`EpError::PeerRefused`] naming the lowest victim, within half the
/// timeout.
fn refused_step(
    comm: &Comm,
    buf: &mut Buffer<'_>,
    me: &RankInput,
    victims: &[usize],
) -> Res<String> {
    let cfg = *buf.config();
    let rank = buf.rank();
    if me.tokens < 2 || cfg.topk < 2 {
        return Err(format!("rank {rank}: refuse needs 2 tokens and top-2 or more").into());
    }
    let bad = i64::try_from(cfg.num_experts + 3)?;
    let mut idx = me.topk_idx.clone();
    let refused = victims.contains(&rank);
    if refused {
        idx[cfg.topk + 1] = bad;
    }
    let t = Instant::now();
    let got = match cfg.mode {
        Mode::LowLatency => buf
            .ll_dispatch_send(&me.x, &idx, &me.weights)
            .and_then(|p| buf.ll_dispatch_recv(p))
            .map(drop),
        Mode::HighThroughput => buf.ht_dispatch(&me.x, &idx, &me.weights).map(drop),
    };
    let (took, timeout) = (t.elapsed(), comm.settings().timeout);
    let what = judge_refusal(rank, victims, bad, &got, took, timeout)?;
    Ok(format!("{what} in {:.0} ms", took.as_secs_f64() * 1e3))
}

fn try_dispatch(
    buf: &mut Buffer<'_>,
    x: &[gin_ep::Bf16],
    idx: &[i64],
    w: &[f32],
) -> Result<(), EpError> {
    match buf.config().mode {
        Mode::LowLatency => buf.ll_dispatch_send(x, idx, w).map(drop),
        Mode::HighThroughput => buf.ht_dispatch(x, idx, w).map(drop),
    }
}

/// Step 1 with every rank; then rank `victim` dies; the survivors finish
/// step 2 with its experts masked (and report it), and step 3 with the mask
/// set from the start. `ht=1`: in high-throughput mode, where the victim is
/// also a forwarder and its role passes to another rank of its host.
fn kill(comm: &Comm, args: &Args) -> Res<String> {
    let mode = if args.get("ht", 0) == 1 {
        Mode::HighThroughput
    } else {
        Mode::LowLatency
    };
    let cfg = config(comm, args, mode);
    let victim = args.get("victim", comm.nranks() - 1);
    let mut buf = buffer(comm, args, cfg)?;
    buf.set_on_peer_loss(OnPeerLoss::Mask);
    let (all, tables) = inputs(comm, &cfg)?;
    step(&mut buf, &all, &tables, true)?;
    comm.bootstrap().barrier()?;
    // The victim dies once every survivor is past the barrier (a death
    // inside it would fail the barrier, not the step under test).
    if comm.rank() == victim {
        for p in (0..comm.nranks()).filter(|&p| p != victim) {
            comm.bootstrap().recv(p, PAST_BARRIER)?;
        }
        std::process::abort();
    }
    comm.bootstrap().send(victim, PAST_BARRIER, b"past")?;
    let me = &all[comm.rank()];
    let c = if mode == Mode::LowLatency {
        let d = buf.ll_dispatch(&me.x, &me.topk_idx, &me.weights)?;
        buf.ll_echo(&d)?;
        buf.ll_combine(&d)?
    } else {
        let d = buf.ht_dispatch(&me.x, &me.topk_idx, &me.weights)?;
        if d.lost() != [victim] {
            return Err(format!(
                "rank {}: dispatch reported lost ranks {:?}, expected [{victim}]",
                comm.rank(),
                d.lost()
            )
            .into());
        }
        oracle::check_ht_dispatch(&buf, &d, &all, &tables)?;
        buf.ht_echo(&d)?;
        buf.ht_combine(&d)?
    };
    if c.lost != [victim] {
        return Err(format!(
            "rank {}: lost ranks reported {:?}, expected [{victim}]",
            comm.rank(),
            c.lost
        )
        .into());
    }
    let l = cfg.local_experts(comm.nranks());
    oracle::check_combine(comm.rank(), &c.x, me, cfg.hidden, cfg.topk, cfg.fp8, |e| {
        e / l != victim
    })?;
    // The mask holds: the next step runs without waiting for the dead rank.
    step(&mut buf, &all, &tables, true)?;
    // No collective destroy: the job has lost a rank.
    Ok(format!(
        "rank {victim} lost in step 2 and masked; steps 2 and 3 verified without it"
    ))
}

/// Every rank masks rank `victim` before the first step, as survivors do
/// after losing a rank; the others run `repeats` steps without it (its
/// experts masked, in high-throughput mode its forwarding role passed to
/// the next rank of its host) and verify them, bit-identical across
/// repeats. The masked rank, alive, only takes part in setting up and
/// tearing down.
fn masked(comm: &Comm, args: &Args) -> Res<String> {
    let mode = if args.get("ht", 0) == 1 {
        Mode::HighThroughput
    } else {
        Mode::LowLatency
    };
    let cfg = config(comm, args, mode);
    let victim = args.get("victim", comm.nranks() - 1);
    let mut buf = buffer(comm, args, cfg)?;
    let (all, tables) = inputs(comm, &cfg)?;
    buf.set_active(victim, false)?;
    let repeats = args.get("repeats", 5);
    if comm.rank() != victim {
        let first = step(&mut buf, &all, &tables, true)?;
        for i in 1..repeats {
            let again = step(&mut buf, &all, &tables, false)?;
            if again != first {
                return Err(format!(
                    "rank {}: repeat {i} differs from the first (digests {again:x?} vs {first:x?})",
                    comm.rank()
                )
                .into());
            }
        }
    }
    buf.destroy()?;
    Ok(format!(
        "rank {victim} masked; {repeats} steps verified without it, bit-identical"
    ))
}
