//! `--graph`: the fused kernel captured once into a CUDA graph on the
//! user's cudarc stream and replayed `--iters` times, each replay verified.
//!
//! A replay reuses the captured arguments, so the kernel
//! (`fused_alltoall_replay`) takes no round from the host: it reads its
//! epoch (the replays finished so far) from device memory and advances it
//! itself, and each sender has its own signal. [`plan`] is that arithmetic,
//! [`expected`] what replay `k` must leave in the output, and the tests
//! check the protocol against a model of every interleaving of ranks.
//!
//! The graph: a memset of the output (so a replay that did not run leaves
//! zeros, never a plausible result), then the kernel, launched into the
//! capture with cudarc's launch builder or [`CudaDevComm::launch_on`].

use std::sync::Arc;

use gin_core::cuda::cudarc::driver::sys;
use gin_core::cuda::cudarc::driver::{CudaGraph, CudaStream, PushKernelArg};
use gin_core::cuda::cudarc::nvrtc::Ptx;
use gin_core::cuda::{self, Arg, CudaComm, CudaDevComm, GpuWindow, LaunchConfig, StreamRef};

use crate::{Opts, R, SCALE, UserMem, kernel_image, s, value};

/// How the stream is captured (`--capture-mode`), as
/// `cuStreamBeginCapture` takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaptureMode {
    /// `CU_STREAM_CAPTURE_MODE_GLOBAL` (cudarc's and PyTorch's default):
    /// while it captures, no thread of the process may make a potentially
    /// unsafe call (one that could synchronise with the capture).
    Global,
    /// `CU_STREAM_CAPTURE_MODE_THREAD_LOCAL`: only the capturing thread.
    ThreadLocal,
    /// `CU_STREAM_CAPTURE_MODE_RELAXED`: no thread.
    Relaxed,
}

impl CaptureMode {
    /// The command line's word for it.
    pub fn parse(w: &str) -> R<Self> {
        match w {
            "global" => Ok(Self::Global),
            "thread-local" => Ok(Self::ThreadLocal),
            "relaxed" => Ok(Self::Relaxed),
            _ => Err(format!(
                "--capture-mode {w}: global, thread-local or relaxed"
            )),
        }
    }

    fn raw(self) -> sys::CUstreamCaptureMode {
        match self {
            Self::Global => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
            Self::ThreadLocal => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            Self::Relaxed => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        }
    }
}

impl std::fmt::Display for CaptureMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Global => "global",
            Self::ThreadLocal => "thread-local",
            Self::Relaxed => "relaxed",
        })
    }
}

/// `--graph`'s options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GraphOpts {
    /// `--iters`: how many times the graph is launched (at least 1).
    pub iters: u32,
    /// `--capture-mode`.
    pub capture_mode: CaptureMode,
}

/// What the replayable kernel does in the replay it finds `epoch` in
/// device memory (`fused_alltoall_replay`, which computes the same).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    /// The receive half its data goes to (0 or 1).
    pub half: u64,
    /// What every sender's signal must reach.
    pub target: u64,
    /// What the kernel has added to each sent value by the end of the
    /// replay (one per replay, the epoch's included).
    pub added: u64,
}

/// The kernel's arithmetic for the replay that reads `epoch`.
pub fn plan(epoch: u64) -> Plan {
    Plan {
        half: epoch % 2,
        target: epoch + 1,
        added: epoch + 1,
    }
}

/// What rank `me` of `n` must find at `out[i]` after replay `replay`
/// (0-based: the kernel read epoch `replay`): `FUSED_SCALE` times the sum
/// over senders `q` of `value(q, me, i)` plus what the kernel added.
pub fn expected(me: usize, n: usize, i: usize, replay: u64) -> f32 {
    let added = plan(replay).added as f32;
    SCALE * (0..n).map(|q| value(q, me, i) + added).sum::<f32>()
}

/// The first value of replay `replay`'s output that differs: (index,
/// expected, got). Exact small integers: compared exactly.
#[allow(clippy::float_cmp)]
pub fn verify(got: &[f32], me: usize, n: usize, replay: u64) -> Option<(usize, f32, f32)> {
    got.iter().enumerate().find_map(|(i, &v)| {
        let want = expected(me, n, i, replay);
        (v != want).then_some((i, want, v))
    })
}

/// Refuses a run whose values would not be exact in `f32` (every partial
/// sum of the reduction must stay within 2^24): `n` ranks, `iters`
/// replays.
pub fn check_exact(n: usize, iters: u64) -> R {
    // The largest value sent: value(n - 1, n - 1, 6) plus the additions.
    let n = n as u64;
    match n
        .checked_mul(n)
        .and_then(|v| v.checked_add(6)?.checked_add(iters))
        .and_then(|top| top.checked_mul(n))
        .and_then(|v| v.checked_mul(SCALE as u64))
    {
        Some(v) if v <= 1 << 24 => Ok(()),
        _ => Err(format!(
            "--iters {iters} with {n} ranks: the reduced values would exceed 2^24, \
             where f32 stops being exact"
        )),
    }
}

/// The loaded kernel, by launcher. Each keeps its module loaded while the
/// graph lives (its kernel node refers to the function): cudarc's function
/// holds its module, gin's is kept beside it.
enum Kernel {
    Cudarc(gin_core::cuda::cudarc::driver::CudaFunction),
    Gin {
        _module: cuda::Module,
        f: cuda::Function,
    },
}

/// Captures, checks that capturing ran nothing, replays `g.iters` times
/// (watch, launch, synchronise, check, verify each), and says what it did.
pub fn replays(
    o: &Opts,
    g: GraphOpts,
    cuda: &CudaComm<'_>,
    dc: &CudaDevComm<'_, '_>,
    stream: &Arc<CudaStream>,
    (sw, rw): (&GpuWindow, &GpuWindow),
    (state, out): (&mut UserMem<u64>, &mut UserMem<f32>),
) -> R<String> {
    let (me, n) = (cuda.comm().rank(), cuda.comm().nranks());
    check_exact(n, u64::from(g.iters))?;
    let (image, from) = kernel_image(o, cuda)?;
    // Loaded before the capture: a module load is no stream work.
    let kernel = if o.cudarc_launcher {
        let module = stream
            .context()
            .load_module(Ptx::from_binary(image))
            .map_err(s)?;
        Kernel::Cudarc(module.load_function("fused_alltoall_replay").map_err(s)?)
    } else {
        // SAFETY: a complete cubin (NVRTC's, or nvcc's from build.rs).
        let module = unsafe { cuda::Module::load_image(&image) }.map_err(s)?;
        let f = module.function("fused_alltoall_replay").map_err(s)?;
        Kernel::Gin { _module: module, f }
    };
    let cfg = LaunchConfig {
        grid: ((n as u32).max(8), 1, 1),
        block: (256, 1, 1),
        shared_mem_bytes: 0,
        cooperative: o.cooperative,
    };
    let graph = capture(stream, g.capture_mode, || {
        stream.memset_zeros(out.slice()).map_err(s)?;
        launch(
            &kernel,
            &cfg,
            dc,
            stream,
            (sw, rw),
            o.count as u64,
            (&mut *state, &mut *out),
        )
    })?;
    let nodes = node_types(&graph)?;
    let st = stream.clone_dtoh(state.slice()).map_err(s)?;
    if st != [0, 0] {
        return Err(format!(
            "rank {me}: capturing ran the kernel (its state is {st:?}, not [0, 0])"
        ));
    }
    for k in 0..u64::from(g.iters) {
        let watcher = dc.watch().map_err(s)?;
        graph
            .launch()
            .map_err(|e| format!("replay {k}: cuGraphLaunch: {e}"))?;
        stream.synchronize().map_err(s)?;
        dc.check(Some(watcher))
            .map_err(|e| format!("replay {k}: {e}"))?;
        let got = stream.clone_dtoh(out.slice()).map_err(s)?;
        if let Some((at, want, seen)) = verify(&got, me, n, k) {
            return Err(format!(
                "rank {me}: replay {k}: reduced value {at} is {seen}, expected {want}"
            ));
        }
        let st = stream.clone_dtoh(state.slice()).map_err(s)?;
        if st != [k + 1, 0] {
            return Err(format!(
                "rank {me}: after replay {k} the kernel's state is {st:?}, expected [{}, 0]",
                k + 1
            ));
        }
    }
    // The graph is gone before the windows and the device communicator.
    drop(graph);
    let probe = check_while_capturing(stream, g.capture_mode, dc);
    Ok(format!(
        "captured once ({} capture, nodes: {}), kernel from {from}, launched into the \
         capture{} with {}; replayed {} times, each replay's {} floats verified, \
         epoch {} in device memory; {probe}",
        g.capture_mode,
        nodes.join(", "),
        if o.cooperative { " cooperatively" } else { "" },
        if o.cudarc_launcher {
            "cudarc's launch builder"
        } else {
            "CudaDevComm::launch_on"
        },
        g.iters,
        o.count,
        g.iters
    ))
}

/// What `CudaDevComm::check` does inside a capture on this thread (no
/// kernel running: the error word is clean), in words: whether it worked
/// and what the capture's status was after it. Not a failure either way:
/// it tells which of gin's host calls a user may make while capturing.
fn check_while_capturing(
    stream: &Arc<CudaStream>,
    mode: CaptureMode,
    dc: &CudaDevComm<'_, '_>,
) -> String {
    if let Err(e) = stream.begin_capture(mode.raw()) {
        return format!("probe: cuStreamBeginCapture failed: {e}");
    }
    let checked = dc.check(None);
    let status = match stream.capture_status() {
        Ok(st) => format!("{st:?}"),
        Err(e) => format!("unknown ({e})"),
    };
    let ended = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    format!(
        "probe: check() inside a {mode} capture {}, the capture then {status}, ending it {}",
        match checked {
            Ok(()) => "returned Ok".to_string(),
            Err(e) => format!("failed: {e}"),
        },
        match ended {
            Ok(Some(_)) => "gave a graph".to_string(),
            Ok(None) => "gave no graph".to_string(),
            Err(e) => format!("failed: {e}"),
        }
    )
}

/// Queues the replayable kernel on `stream` (which is capturing).
fn launch(
    kernel: &Kernel,
    cfg: &LaunchConfig,
    dc: &CudaDevComm<'_, '_>,
    stream: &Arc<CudaStream>,
    (sw, rw): (&GpuWindow, &GpuWindow),
    count: u64,
    (state, out): (&mut UserMem<u64>, &mut UserMem<f32>),
) -> R {
    match kernel {
        Kernel::Cudarc(f) => {
            let (dcp, sp, rp) = (dc.param(), sw.param(), rw.param());
            let mut b = stream.launch_builder(f);
            b.arg(&dcp).arg(&sp).arg(&rp).arg(&count);
            b.arg(state.slice()).arg(out.slice());
            let lc = gin_core::cuda::cudarc::driver::LaunchConfig {
                grid_dim: cfg.grid,
                block_dim: cfg.block,
                shared_mem_bytes: 0,
            };
            // SAFETY: the arguments match the kernel's parameters (DevComm,
            // Window, Window by value, u64, u64*, float*); `state` holds 2
            // u64s and `out` `count` floats; the windows, the device
            // communicator and both allocations outlive every replay (the
            // graph is dropped before they go).
            unsafe {
                if cfg.cooperative {
                    b.launch_cooperative(lc)
                } else {
                    b.launch(lc)
                }
            }
            .map(drop)
            .map_err(|e| format!("cudarc's launch: {e}"))
        }
        Kernel::Gin { f, .. } => {
            let args = [
                Arg::DevComm(dc.abi()),
                Arg::Window(sw.abi()),
                Arg::Window(rw.abi()),
                Arg::U64(count),
                Arg::Ptr(state.ptr),
                Arg::Ptr(out.ptr),
            ];
            // SAFETY: as for cudarc's launch above.
            unsafe { dc.launch_on(f, cfg, StreamRef::from(&**stream), &args) }
                .map_err(|e| format!("CudaDevComm::launch_on: {e}"))
        }
    }
}

/// Runs `body` while `stream` is captured in `mode`; the instantiated
/// graph, or what went wrong, naming the step and the capture's status.
fn capture(stream: &Arc<CudaStream>, mode: CaptureMode, body: impl FnOnce() -> R) -> R<CudaGraph> {
    stream
        .begin_capture(mode.raw())
        .map_err(|e| format!("cuStreamBeginCapture ({mode}): {e}"))?;
    let queued = body();
    let status = match stream.capture_status() {
        Ok(st) => format!("{st:?}"),
        Err(e) => format!("unknown ({e})"),
    };
    // Always ended, so the stream leaves capture whatever happened.
    let ended = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    queued.map_err(|e| {
        format!("while capturing ({mode} mode): {e}; the capture's status then: {status}")
    })?;
    match ended {
        Ok(Some(g)) => Ok(g),
        Ok(None) => Err("cuStreamEndCapture gave no graph".into()),
        Err(e) => Err(format!(
            "cuStreamEndCapture / cuGraphInstantiate ({mode} mode): {e}; the capture's status \
             before: {status}"
        )),
    }
}

/// The captured graph's nodes, by type, in the driver's order.
fn node_types(g: &CudaGraph) -> R<Vec<String>> {
    let mut len = 0usize;
    // SAFETY: a live graph (owned by `g`); a null array asks for the count.
    let r = unsafe { sys::cuGraphGetNodes(g.cu_graph(), std::ptr::null_mut(), &raw mut len) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(format!("cuGraphGetNodes: {r:?}"));
    }
    let mut nodes = vec![std::ptr::null_mut(); len];
    // SAFETY: room for `len` nodes.
    let r = unsafe { sys::cuGraphGetNodes(g.cu_graph(), nodes.as_mut_ptr(), &raw mut len) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(format!("cuGraphGetNodes: {r:?}"));
    }
    nodes
        .iter()
        .take(len)
        .map(|&node| {
            let mut t = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
            // SAFETY: a node of the live graph; a valid out-pointer.
            let r = unsafe { sys::cuGraphNodeGetType(node, &raw mut t) };
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(format!("cuGraphNodeGetType: {r:?}"));
            }
            Ok(match t {
                sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL => "kernel".into(),
                sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMSET => "memset".into(),
                sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMCPY => "memcpy".into(),
                other => format!("{other:?}"),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Consecutive replays use the two halves in turn, each sender's
        /// signal target grows by one per replay, and every replay's output
        /// differs from the one before at every index (a stale output never
        /// passes).
        #[test]
        fn replays_alternate_halves_and_never_repeat_an_output(
            epoch in 0u64..1_000_000, n in 1usize..9, me in 0usize..8, i in 0usize..64,
        ) {
            let (a, b) = (plan(epoch), plan(epoch + 1));
            prop_assert_ne!(a.half, b.half);
            prop_assert!(a.half < 2);
            prop_assert_eq!(b.target, a.target + 1);
            prop_assert_eq!(b.added, a.added + 1);
            let me = me % n;
            if epoch < 1000 && check_exact(n, epoch + 2).is_ok() {
                prop_assert!(expected(me, n, i, epoch + 1) > expected(me, n, i, epoch));
            }
        }

        /// Whatever order the ranks' puts land in and the ranks finish in,
        /// a rank reduces replay e only once every sender's replay-e data
        /// is in the half it reads, and no rank ever waits forever.
        #[test]
        fn the_protocol_is_correct_under_every_interleaving(
            n in 1usize..5, replays in 1u64..6, choices in proptest::collection::vec(any::<u16>(), 400),
        ) {
            prop_assert_eq!(run_model(n, replays, &choices, Signals::PerSender), Ok(()));
        }
    }

    #[test]
    fn exactness_is_refused_past_two_to_the_24() {
        assert!(check_exact(2, 20).is_ok());
        assert!(check_exact(8, 1000).is_ok());
        // 2 * 8 * (64 + 6 + k) <= 2^24 up to k = 1_048_506.
        assert!(check_exact(8, 1_048_506).is_ok());
        let e = check_exact(8, 1_048_507).unwrap_err();
        assert!(e.contains("--iters 1048507 with 8 ranks"), "{e}");
        assert!(check_exact(usize::MAX, 1).is_err());
        assert!(check_exact(1, u64::MAX).is_err());
    }

    #[test]
    #[allow(clippy::float_cmp)] // exact small integers
    fn replay_outputs_are_checked_against_their_own_replay() {
        let (n, me) = (3, 1);
        let good: Vec<f32> = (0..10).map(|i| expected(me, n, i, 4)).collect();
        // 2 * sum over q of ((q + 1) * 2 + i % 7 + 5), at i = 3.
        assert_eq!(good[3], 2.0 * ((2.0 + 4.0 + 6.0) + 3.0 * 3.0 + 15.0));
        assert_eq!(verify(&good, me, n, 4), None);
        // The previous replay's output, or the memset's zeros, fail.
        assert_eq!(verify(&good, me, n, 5).map(|b| b.0), Some(0));
        assert_eq!(verify(&[0.0; 10], me, n, 4), Some((0, good[0], 0.0)));
    }

    #[test]
    fn capture_modes_parse() {
        for m in [
            CaptureMode::Global,
            CaptureMode::ThreadLocal,
            CaptureMode::Relaxed,
        ] {
            assert_eq!(CaptureMode::parse(&m.to_string()), Ok(m));
        }
        assert!(
            CaptureMode::parse("local")
                .unwrap_err()
                .contains("thread-local")
        );
    }

    /// One signal per sender (the replayable kernel), or one counting every
    /// arrival (the rounds kernel's form).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Signals {
        PerSender,
        Shared,
    }

    /// A model of `fused_alltoall_replay` on `n` ranks for `replays`
    /// replays, the scheduler's choices taken from `choices` (then the
    /// first enabled step). A rank's step is one of: land one of its
    /// current replay's puts (any order: the blocks and queues are
    /// independent), reduce once its wait is satisfied (checking that each
    /// sender's chunk in the half it reads is that sender's data of this
    /// replay), or end the replay once it reduced and its puts landed (the
    /// flush) and start the next. Err names the first wrong read or a
    /// deadlock.
    fn run_model(n: usize, replays: u64, choices: &[u16], sig: Signals) -> Result<(), String> {
        #[derive(Clone)]
        struct Rank {
            epoch: u64,
            landed: Vec<bool>,
            reduced: bool,
            /// recv[half][sender]: the (sender, epoch) whose data is there.
            recv: [Vec<Option<(usize, u64)>>; 2],
            /// signal[sender] (per-sender) or signal[0] (shared).
            signal: Vec<u64>,
        }
        let mut ranks = vec![
            Rank {
                epoch: 0,
                landed: vec![false; n],
                reduced: false,
                recv: [vec![None; n], vec![None; n]],
                signal: vec![0; n],
            };
            n
        ];
        let mut picks = choices.iter();
        loop {
            let mut steps = Vec::new();
            for (me, rank) in ranks.iter().enumerate() {
                if rank.epoch == replays {
                    continue;
                }
                for (to, &landed) in rank.landed.iter().enumerate() {
                    if !landed {
                        steps.push((me, Some(to)));
                    }
                }
                let target = plan(rank.epoch).target;
                let ready = match sig {
                    Signals::PerSender => rank.signal.iter().all(|&v| v >= target),
                    Signals::Shared => rank.signal[0] >= n as u64 * target,
                };
                let flushed = rank.landed.iter().all(|&l| l);
                if (!rank.reduced && ready) || (rank.reduced && flushed) {
                    steps.push((me, None));
                }
            }
            if steps.is_empty() {
                return if ranks.iter().all(|x| x.epoch == replays) {
                    Ok(())
                } else {
                    Err("deadlock".into())
                };
            }
            let pick = picks.next().map_or(0, |&x| usize::from(x) % steps.len());
            let (me, put) = steps[pick];
            let epoch = ranks[me].epoch;
            let half = plan(epoch).half as usize;
            match put {
                Some(to) => {
                    ranks[me].landed[to] = true;
                    ranks[to].recv[half][me] = Some((me, epoch));
                    ranks[to].signal[if sig == Signals::PerSender { me } else { 0 }] += 1;
                }
                None if !ranks[me].reduced => {
                    for (q, &seen) in ranks[me].recv[half].iter().enumerate() {
                        if seen != Some((q, epoch)) {
                            return Err(format!(
                                "rank {me} reduced replay {epoch} with {seen:?} from rank {q}"
                            ));
                        }
                    }
                    ranks[me].reduced = true;
                }
                None => {
                    let rank = &mut ranks[me];
                    rank.epoch += 1;
                    rank.reduced = false;
                    rank.landed = vec![false; n];
                }
            }
        }
    }

    /// The model catches the hazard the per-sender signals avoid: with one
    /// signal counting every arrival, rank 1 finishes replay 0 and its
    /// replay-1 put to rank 0 stands in for rank 0's own replay-0 put, not
    /// yet landed.
    #[test]
    fn one_shared_signal_lets_a_fast_peer_stand_in_for_a_slow_one() {
        // Each choice picks among the enabled steps, listed by rank: its
        // puts, then its reduce or end. Index 1 every time: land 0->1,
        // land 1->0, land 1->1; rank 1 reduces (its signal is 2) and ends
        // replay 0 (its puts all landed); its replay-1 put to rank 0 lands:
        // rank 0's signal is 2 = n * 1 while its own replay-0 put (0->0)
        // has not landed, and rank 0 reduces.
        let choices = [1; 7];
        let err = run_model(2, 2, &choices, Signals::Shared).unwrap_err();
        assert!(
            err.contains("rank 0 reduced replay 0 with None from rank 0"),
            "{err}"
        );
        assert_eq!(run_model(2, 2, &choices, Signals::PerSender), Ok(()));
    }
}
