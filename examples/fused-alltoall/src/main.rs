//! A user's fused kernel on CUDA ranks: an all-to-all of a buffer followed,
//! in the same kernel, by a reduction of what arrived
//! (`kernels/fused_alltoall.cu`, written against `gin/gin.cuh`), run the way
//! a CUDA application that owns its GPU work runs it:
//!
//! - the memory is the user's: cudarc `CudaSlice`s over `cuMemAlloc`
//!   allocations, registered as windows with
//!   [`CudaComm::register_window`] (the receive window starts 4 KiB into its
//!   allocation, so same-host peers' IPC mappings must add the offset);
//! - the kernel is compiled with the user's include folder and defines
//!   ([`CudaComm::compile_with`] / `nvrtc::compile_with`, with CCCL where it
//!   is installed), or taken from the cubin `build.rs` made with nvcc;
//! - it is launched on the user's cudarc stream, without blocking, with
//!   cudarc's launch builder (`--launcher cudarc`, the default) or with
//!   [`CudaDevComm::launch_on`] (`--launcher gin`), all rounds queued at
//!   once, while a [`Watcher`] watches the job; then the stream is
//!   synchronised, [`CudaDevComm::check`] reads the error word, and the
//!   host verifies every reduced value.
//!
//! With `--graph` the kernel's replayable form (`fused_alltoall_replay`) is
//! captured once into a CUDA graph on the same stream, after a memset of
//! the output, and the graph is launched `--iters` times, each replay
//! watched, checked and verified (see the `graph` module).
//!
//! With `--memory vmm` the two windows' buffers come from the user's own
//! VMM allocator instead (`cuMemCreate` requesting
//! `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`, mapped with `cuMemMap`; see
//! the `vmm` module): same-host peers import each part from its file
//! descriptor. `--memory vmm-no-fd` allocates them without that handle
//! type, which every rank must refuse, saying what to request.
//!
//! It also shows the refusal of memory same-host peers cannot map: a
//! stream-ordered pool allocation (cudarc's `alloc_zeros` on GPUs with
//! memory pools) must be refused on every rank, naming the rank and the
//! pointer.
//!
//! Usage: `fused-alltoall [--ranks N] [--rounds R] [--count C] [--launcher
//! cudarc|gin] [--nvrtc] [--cooperative] [--memory malloc|vmm|vmm-no-fd]
//! [--die V] [--graph [--iters K]
//! [--capture-mode global|thread-local|relaxed]]` (spawns N ranks,
//! default 2; or runs as one rank under a launcher; `--nvrtc` ignores the
//! build-time cubin, `--cooperative` launches with
//! `cuLaunchCooperativeKernel`, `--die V` kills rank V while the others
//! wait in the kernel: their watchers must abort it and name V; `--graph`
//! replays a captured graph K times, default 20, captured in the given
//! mode, default global). Prints one `rank r of n: ... verified` line per
//! rank.
//! Exit codes: 0 verified, or `SKIPPED: no GPU: <why>` where no GPU is
//! usable (after compiling the kernel with NVRTC where NVRTC is there); 1 the
//! ranks could not be launched; 3 `FAILED: <why>`.

use std::mem::ManuallyDrop;
use std::process::ExitCode;
use std::sync::Arc;

use gin_core::cuda::cudarc::driver::{self as cd, CudaSlice, CudaStream, PushKernelArg};
use gin_core::cuda::cudarc::nvrtc::Ptx;
use gin_core::cuda::{
    self, Arg, CompileOptions, CtxSharing, CudaComm, CudaDevComm, GpuWindow, LaunchConfig,
    StreamRef, nvrtc,
};
use gin_core::launch::{Role, run_ranks};
use gin_core::{Comm, DevCommRequirements};

mod graph;
mod vmm;

/// The kernel's source and the user header it includes.
const SOURCE: &str = include_str!("../kernels/fused_alltoall.cu");
const OP_HEADER: &str = include_str!("../kernels/include/fused/op.cuh");
/// `FUSED_SCALE`, as the kernel is compiled with.
const SCALE: f32 = 2.0;
/// Where the receive window starts in its allocation.
const RECV_OFFSET: usize = 4096;

/// The example's result: an error in words.
type R<T = ()> = Result<T, String>;

/// An error in words.
fn s<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// The command line.
#[derive(Debug, Clone)]
struct Opts {
    ranks: usize,
    rounds: u32,
    count: usize,
    cudarc_launcher: bool,
    force_nvrtc: bool,
    cooperative: bool,
    /// `--die V`: rank V dies while the others wait in the kernel.
    die: Option<usize>,
    /// `--graph`: capture once, replay.
    graph: Option<graph::GraphOpts>,
    /// `--memory`: how the windows' buffers are allocated.
    memory: Memory,
}

/// How the user allocates the windows' buffers (`--memory`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Memory {
    /// `cuMemAlloc` (legacy CUDA IPC).
    Malloc,
    /// The user's VMM allocator; `posix_fd`: with the POSIX file
    /// descriptor handle type requested.
    Vmm { posix_fd: bool },
}

impl Memory {
    fn parse(v: &str) -> R<Self> {
        match v {
            "malloc" => Ok(Self::Malloc),
            "vmm" => Ok(Self::Vmm { posix_fd: true }),
            "vmm-no-fd" => Ok(Self::Vmm { posix_fd: false }),
            _ => Err(format!("--memory {v}: malloc, vmm or vmm-no-fd")),
        }
    }

    /// In words, for the result line.
    fn describe(self) -> &'static str {
        match self {
            Self::Malloc => "cuMemAlloc memory",
            Self::Vmm { posix_fd: true } => {
                "VMM memory (cuMemCreate with the POSIX file descriptor handle type)"
            }
            Self::Vmm { posix_fd: false } => "VMM memory without a shareable handle type",
        }
    }
}

fn opts() -> R<Opts> {
    parse(&std::env::args().skip(1).collect::<Vec<_>>())
}

/// The command line's words (without the program's name).
fn parse(a: &[String]) -> R<Opts> {
    let val = |k: &str| a.iter().position(|x| x == k).and_then(|i| a.get(i + 1));
    let num = |k: &str, d: usize| {
        val(k).map_or(Ok(d), |v| {
            v.parse::<usize>()
                .map_err(|_| format!("{k} {v}: not a number"))
        })
    };
    let launcher = val("--launcher").map_or("cudarc", String::as_str);
    if !matches!(launcher, "cudarc" | "gin") {
        return Err(format!("--launcher {launcher}: cudarc or gin"));
    }
    let graph = a.iter().any(|x| x == "--graph");
    let die = val("--die")
        .map(|v| v.parse().map_err(|_| format!("--die {v}: not a rank")))
        .transpose()?;
    if graph && die.is_some() {
        return Err("--graph and --die: one at a time".into());
    }
    if !graph && (val("--iters").is_some() || val("--capture-mode").is_some()) {
        return Err("--iters and --capture-mode need --graph".into());
    }
    let graph = if graph {
        let iters =
            u32::try_from(num("--iters", 20)?).map_err(|_| "--iters: too many".to_string())?;
        if iters == 0 {
            return Err("--iters 0: at least one replay".into());
        }
        Some(graph::GraphOpts {
            iters,
            capture_mode: val("--capture-mode").map_or(Ok(graph::CaptureMode::Global), |m| {
                graph::CaptureMode::parse(m)
            })?,
        })
    } else {
        None
    };
    Ok(Opts {
        ranks: num("--ranks", 2)?,
        rounds: num("--rounds", 4)? as u32,
        count: num("--count", 4096)?.max(1),
        cudarc_launcher: launcher == "cudarc",
        force_nvrtc: a.iter().any(|x| x == "--nvrtc"),
        cooperative: a.iter().any(|x| x == "--cooperative"),
        die,
        graph,
        memory: val("--memory").map_or(Ok(Memory::Malloc), |m| Memory::parse(m))?,
    })
}

fn main() -> ExitCode {
    gin_bootstrap::init_tracing_from_env();
    let o = match opts() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(why) = cuda::skip_reason() {
        // The host side up to the GPU: the kernel compiles (where NVRTC is).
        match compile_offline() {
            Ok(line) => println!("{line}"),
            Err(e) => {
                println!("FAILED: {e}");
                return ExitCode::from(3);
            }
        }
        println!("SKIPPED: no GPU: {why}");
        return ExitCode::SUCCESS;
    }
    match run_ranks(o.ranks) {
        Ok(Role::Launched) => return ExitCode::SUCCESS,
        Ok(Role::Rank) => {}
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    }
    match rank(&o) {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("FAILED: {e}");
            ExitCode::from(3)
        }
    }
}

/// The user's include folder (the header written to a temporary folder,
/// so the binary runs anywhere) and defines.
fn compile_options() -> R<(CompileOptions, tempdir::TempDir)> {
    let dir = tempdir::TempDir::new()?;
    let inc = dir.path().join("fused");
    std::fs::create_dir_all(&inc).map_err(s)?;
    std::fs::write(inc.join("op.cuh"), OP_HEADER).map_err(s)?;
    let mut defines = vec![("FUSED_SCALE".to_string(), Some(format!("{SCALE}")))];
    if nvrtc::cccl_dir().is_some() {
        defines.push(("FUSED_USE_CCCL".into(), None));
    }
    Ok((
        CompileOptions {
            include_dirs: vec![dir.path().to_path_buf()],
            defines,
            extra_opts: Vec::new(),
        },
        dir,
    ))
}

/// Without a GPU: compile the kernel for Hopper with NVRTC, if NVRTC is
/// here.
fn compile_offline() -> R<String> {
    if !nvrtc::is_available() {
        return Ok("no NVRTC here: the kernel was not compiled".into());
    }
    let (opts, _dir) = compile_options()?;
    let cubin = nvrtc::compile_with(SOURCE, "fused_alltoall.cu", (9, 0), &opts).map_err(s)?;
    Ok(format!(
        "fused_alltoall.cu compiled with NVRTC for sm_90 ({} bytes{})",
        cubin.as_bytes().len(),
        if opts.defines.len() > 1 {
            ", with CCCL"
        } else {
            ""
        }
    ))
}

/// The user's device memory: a cudarc slice over a `cuMemAlloc`
/// allocation (cudarc's own `alloc` takes it from a stream-ordered pool on
/// most GPUs, which CUDA IPC cannot export), freed with `cuMemFree`; or
/// over the user's VMM allocation, unmapped and released.
struct UserMem<T = f32> {
    slice: ManuallyDrop<CudaSlice<T>>,
    ptr: u64,
    len: usize,
    /// `Some`: the VMM allocation the slice lies in.
    vmm: Option<vmm::VmmAlloc>,
}

impl<T: cd::DeviceRepr> UserMem<T> {
    fn new(stream: &Arc<CudaStream>, len: usize) -> R<Self> {
        Self::with(stream, len, Memory::Malloc)
    }

    /// `len` Ts allocated as `memory` says.
    fn with(stream: &Arc<CudaStream>, len: usize, memory: Memory) -> R<Self> {
        let bytes = len * size_of::<T>();
        let (ptr, vmm) = match memory {
            // SAFETY: a plain allocation; the bytes are written before use.
            Memory::Malloc => (unsafe { cd::result::malloc_sync(bytes) }.map_err(s)?, None),
            Memory::Vmm { posix_fd } => {
                stream.context().bind_to_thread().map_err(s)?;
                let a = vmm::VmmAlloc::new(stream.context().ordinal(), bytes, posix_fd)?;
                (a.ptr(), Some(a))
            }
        };
        // SAFETY: `ptr` holds `len` Ts, owned by the slice until `drop`
        // leaks it back.
        let slice = unsafe { stream.upgrade_device_ptr::<T>(ptr, len) };
        Ok(Self {
            slice: ManuallyDrop::new(slice),
            ptr,
            len,
            vmm,
        })
    }

    fn slice(&mut self) -> &mut CudaSlice<T> {
        &mut self.slice
    }
}

impl<T> Drop for UserMem<T> {
    fn drop(&mut self) {
        // SAFETY: taken once, here; the field is not used again.
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        let ptr = slice.leak();
        if let Some(vmm) = self.vmm.take() {
            // Unmapped and released (the windows over it were freed first).
            drop(vmm);
            return;
        }
        // SAFETY: `malloc_sync` allocated it; nothing uses it any more (the
        // windows over it were freed first).
        unsafe {
            let _ = cd::result::free_sync(ptr);
        }
    }
}

/// What rank `q` sends rank `p` at `i`.
fn value(q: usize, p: usize, i: usize) -> f32 {
    ((q + 1) * (p + 1) + i % 7) as f32
}

fn rank(o: &Opts) -> R<String> {
    let b = gin_bootstrap::Bootstrap::from_env().map_err(s)?;
    let comm = Comm::new(b).map_err(s)?;
    let cuda = comm.cuda().map_err(s)?;
    let (me, n) = (comm.rank(), comm.nranks());
    // cudarc on the same GPU: its primary context is gin's.
    let info = cuda.context_info();
    let ctx = cd::CudaContext::new(info.ordinal).map_err(s)?;
    if ctx.cu_ctx() != info.context {
        return Err("cudarc's context is not gin's".into());
    }
    if o.graph.is_some() {
        // SAFETY: everything here runs on one stream, so cudarc need not
        // order streams with events; and an event recorded while capturing
        // (cudarc records one per slice argument) could not be waited for
        // after the capture. Turned off before any slice is made.
        unsafe { ctx.disable_event_tracking() };
    }
    let stream = ctx.new_stream().map_err(s)?;
    let refusal = refuse_pool_memory(&cuda, &stream)?;

    let count = o.count;
    let mut send = UserMem::with(&stream, n * count, o.memory)?;
    let host: Vec<f32> = (0..n * count)
        .map(|j| value(me, j / count, j % count))
        .collect();
    stream.memcpy_htod(&host, send.slice()).map_err(s)?;
    let recv = UserMem::<f32>::with(&stream, RECV_OFFSET / 4 + 2 * n * count, o.memory)?;
    let rounds = if o.graph.is_some() {
        1
    } else {
        o.rounds as usize
    };
    let mut out = UserMem::new(&stream, rounds * count)?;
    stream.synchronize().map_err(s)?;
    // SAFETY: both ranges are this GPU's device memory (cuMemAlloc or VMM)
    // that outlives the windows: they are freed below, before `send` and
    // `recv` drop.
    let (sw, rw) = unsafe {
        (
            cuda.register_window(send.ptr, (send.len * 4) as u64)
                .map_err(s)?,
            cuda.register_window(recv.ptr + RECV_OFFSET as u64, (2 * n * count * 4) as u64)
                .map_err(s)?,
        )
    };
    let req = DevCommRequirements {
        // Both kernels have one signal per sender (see the kernel file).
        signals: n as u32,
        counters: 0,
        ..DevCommRequirements::default()
    };
    let dc = cuda.dev_comm(&req, CtxSharing::Gpu).map_err(s)?;
    if let Some(victim) = o.die {
        return die(o, victim, &cuda, &dc, &stream, (&sw, &rw), &mut out);
    }
    if let Some(g) = o.graph {
        let mut state = UserMem::<u64>::new(&stream, 2)?;
        stream.memcpy_htod(&[0u64; 2], state.slice()).map_err(s)?;
        let done = graph::replays(
            o,
            g,
            &cuda,
            &dc,
            &stream,
            (&sw, &rw),
            (&mut state, &mut out),
        )?;
        dc.destroy().map_err(s)?;
        cuda.free_window(rw).map_err(s)?;
        cuda.free_window(sw).map_err(s)?;
        return Ok(format!(
            "rank {me} of {n}: fused all-to-all + reduction in a CUDA graph verified: {done}, \
             on the user's cudarc stream, windows over the user's {}; {refusal}",
            o.memory.describe()
        ));
    }
    let how = launch_rounds(o, &cuda, &dc, &stream, (&sw, &rw), &mut out)?;
    let got = stream.clone_dtoh(out.slice()).map_err(s)?;
    let bad = verify(&got, me, n, count);
    dc.destroy().map_err(s)?;
    cuda.free_window(rw).map_err(s)?;
    cuda.free_window(sw).map_err(s)?;
    if let Some((at, want, seen)) = bad {
        return Err(format!(
            "rank {me}: reduced value {at} is {seen}, expected {want}"
        ));
    }
    Ok(format!(
        "rank {me} of {n}: fused all-to-all + reduction verified: {} rounds x {count} floats \
         from {n} ranks, {how}, on the user's cudarc stream, windows over the user's {} \
         (recv at offset {RECV_OFFSET}); {refusal}",
        o.rounds,
        o.memory.describe()
    ))
}

/// `--die V`: rank V dies once the others are inside their kernel (one
/// round: their puts reach V before it dies, and no later round puts to
/// it); the others' watchers must raise the abort flag, so that their waits
/// for V's data give up, and `check` must name V. The survivors report
/// `FAILED: ...` with the error and how long it took (exit code 3, as
/// gin-cuda-selftest's `die`); the victim aborts.
fn die(
    o: &Opts,
    victim: usize,
    cuda: &CudaComm<'_>,
    dc: &CudaDevComm<'_, '_>,
    stream: &Arc<CudaStream>,
    windows: (&GpuWindow, &GpuWindow),
    out: &mut UserMem,
) -> R<String> {
    cuda.comm().bootstrap().barrier().map_err(s)?;
    if cuda.comm().rank() == victim {
        // Die once the others are inside their kernels.
        std::thread::sleep(std::time::Duration::from_millis(300));
        std::process::abort();
    }
    let t = std::time::Instant::now();
    let one = Opts {
        rounds: 1,
        ..o.clone()
    };
    match launch_rounds(&one, cuda, dc, stream, windows, out) {
        Ok(_) => Err(format!("rank {victim} died, but the kernel succeeded")),
        Err(e) => Err(format!("{e} (after {:.2}s)", t.elapsed().as_secs_f64())),
    }
}

/// The first reduced value that differs: (index, expected, got). The
/// values are sums of small integers, exact in `f32`: compared exactly.
#[allow(clippy::float_cmp)]
fn verify(got: &[f32], me: usize, n: usize, count: usize) -> Option<(usize, f32, f32)> {
    got.iter().enumerate().find_map(|(j, &v)| {
        let i = j % count;
        let want = SCALE * (0..n).map(|q| value(q, me, i)).sum::<f32>();
        (v != want).then_some((j, want, v))
    })
}

/// Registering a stream-ordered pool allocation must fail on every rank
/// where same-host peers would map it; returns what happened, in words.
fn refuse_pool_memory(cuda: &CudaComm<'_>, stream: &Arc<CudaStream>) -> R<String> {
    let pool: CudaSlice<f32> = stream.alloc_zeros(1024).map_err(s)?;
    let (ptr, _sync) = cd::DevicePtr::device_ptr(&pool, stream);
    // SAFETY: the slice's 4096 bytes outlive the attempt (and the window,
    // if the GPU has no pools and the memory is accepted: freed below).
    match unsafe { cuda.register_window(ptr, 4096) } {
        Err(e) => Ok(format!("a pool allocation was refused as expected: {e}")),
        Ok(w) => {
            cuda.free_window(w).map_err(s)?;
            Ok("a cudarc allocation was accepted (no memory pools, or no same-host peer)".into())
        }
    }
}

/// Compiles (or takes the build-time cubin), queues every round on the
/// user's stream at once under a watcher, waits and checks.
fn launch_rounds(
    o: &Opts,
    cuda: &CudaComm<'_>,
    dc: &CudaDevComm<'_, '_>,
    stream: &Arc<CudaStream>,
    (sw, rw): (&GpuWindow, &GpuWindow),
    out: &mut UserMem,
) -> R<String> {
    let n = cuda.comm().nranks() as u32;
    let (image, from) = kernel_image(o, cuda)?;
    let cfg = LaunchConfig {
        grid: (n.max(8), 1, 1),
        block: (256, 1, 1),
        shared_mem_bytes: 0,
        cooperative: o.cooperative,
    };
    let count = o.count as u64;
    let watcher = dc.watch().map_err(s)?;
    if o.cudarc_launcher {
        let module = stream
            .context()
            .load_module(Ptx::from_binary(image))
            .map_err(s)?;
        let f = module.load_function("fused_alltoall").map_err(s)?;
        let (dcp, sp, rp) = (dc.param(), sw.param(), rw.param());
        let lc = cd::LaunchConfig {
            grid_dim: cfg.grid,
            block_dim: cfg.block,
            shared_mem_bytes: 0,
        };
        for round in 0..o.rounds {
            let mut b = stream.launch_builder(&f);
            b.arg(&dcp).arg(&sp).arg(&rp).arg(&count).arg(&round);
            b.arg(out.slice());
            // SAFETY: the arguments match the kernel's parameters (DevComm,
            // Window, Window by value, u64, u32, float*); the windows and
            // the device communicator outlive the kernels (the stream is
            // synchronised before they are freed), and `out` holds
            // rounds * count floats.
            unsafe {
                if o.cooperative {
                    b.launch_cooperative(lc)
                } else {
                    b.launch(lc)
                }
            }
            .map_err(s)?;
        }
    } else {
        // SAFETY: a complete cubin (NVRTC's, or nvcc's from build.rs).
        let module = unsafe { cuda::Module::load_image(&image) }.map_err(s)?;
        let f = module.function("fused_alltoall").map_err(s)?;
        for round in 0..o.rounds {
            let args = [
                Arg::DevComm(dc.abi()),
                Arg::Window(sw.abi()),
                Arg::Window(rw.abi()),
                Arg::U64(count),
                Arg::U32(round),
                Arg::Ptr(out.ptr),
            ];
            // SAFETY: as for cudarc's launch above.
            unsafe { dc.launch_on(&f, &cfg, StreamRef::from(&**stream), &args) }.map_err(s)?;
        }
    }
    // Not blocked until here: the rounds run while this thread could work.
    stream.synchronize().map_err(s)?;
    dc.check(Some(watcher)).map_err(s)?;
    Ok(format!(
        "kernel from {from}, launched{} with {}",
        if o.cooperative { " cooperatively" } else { "" },
        if o.cudarc_launcher {
            "cudarc's launch builder"
        } else {
            "CudaDevComm::launch_on"
        }
    ))
}

/// The kernel's cubin: build.rs's (nvcc) where it matches this GPU, else
/// NVRTC's with the user's include folder and defines.
fn kernel_image(o: &Opts, cuda: &CudaComm<'_>) -> R<(Vec<u8>, &'static str)> {
    #[cfg(fused_cubin)]
    {
        let arch = env!("FUSED_CUBIN_ARCH");
        let (ma, mi) = cuda.device().cc();
        if !o.force_nvrtc && arch == format!("sm_{ma}{mi}") {
            return Ok((
                include_bytes!(env!("FUSED_CUBIN")).to_vec(),
                "the build-time nvcc cubin",
            ));
        }
    }
    let _ = o.force_nvrtc;
    let (opts, _dir) = compile_options()?;
    let cubin =
        nvrtc::compile_with(SOURCE, "fused_alltoall.cu", cuda.device().cc(), &opts).map_err(s)?;
    Ok((
        cubin.as_bytes().to_vec(),
        if opts.defines.len() > 1 {
            "NVRTC (user include folder, defines, CCCL)"
        } else {
            "NVRTC (user include folder, defines)"
        },
    ))
}

/// A temporary folder removed on drop (no dependency for so little).
mod tempdir {
    use std::path::{Path, PathBuf};

    pub struct TempDir(PathBuf);

    impl TempDir {
        pub fn new() -> Result<Self, String> {
            let p = std::env::temp_dir().join(format!(
                "gin-fused-{}-{:?}",
                std::process::id(),
                std::thread::current().id()
            ));
            std::fs::create_dir_all(&p).map_err(|e| format!("{}: {e}", p.display()))?;
            Ok(Self(p))
        }

        pub fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host's expectation: rank `me` receives value(q, me, i) from
    /// every q, and the kernel scales the sum.
    #[test]
    #[allow(clippy::float_cmp)] // exact small integers
    fn the_expected_reduction_is_the_scaled_sum_of_what_each_rank_sends() {
        let (n, count) = (3, 10);
        let good: Vec<f32> = (0..2 * count)
            .map(|j| SCALE * (0..n).map(|q| value(q, 1, j % count)).sum::<f32>())
            .collect();
        assert_eq!(verify(&good, 1, n, count), None);
        // 2 * ((1+2+3) * 2 + 3 * (4 % 7)) at index 4.
        assert_eq!(good[4], 2.0 * (12.0 + 12.0));
        let mut bad = good.clone();
        bad[13] += 1.0;
        assert_eq!(
            verify(&bad, 1, n, count),
            Some((13, good[13], good[13] + 1.0))
        );
    }

    fn args(line: &str) -> Vec<String> {
        line.split_whitespace().map(String::from).collect()
    }

    /// `--graph` and its options: defaults, and what is refused before any
    /// rank starts.
    #[test]
    fn graph_options_parse_and_refuse_what_does_not_combine() {
        let o = parse(&args("--graph")).unwrap_or_else(|e| panic!("{e}"));
        assert!(o.cudarc_launcher);
        let want = graph::GraphOpts {
            iters: 20,
            capture_mode: graph::CaptureMode::Global,
        };
        assert_eq!(o.graph, Some(want));
        let o = parse(&args(
            "--graph --iters 5 --capture-mode thread-local --launcher gin",
        ))
        .unwrap_or_else(|e| panic!("{e}"));
        let want = graph::GraphOpts {
            iters: 5,
            capture_mode: graph::CaptureMode::ThreadLocal,
        };
        assert_eq!(o.graph, Some(want));
        assert!(!o.cudarc_launcher);
        let o = parse(&args("--ranks 3")).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(o.graph, None);
        for (line, want) in [
            ("--iters 5", "need --graph"),
            ("--capture-mode relaxed", "need --graph"),
            ("--graph --die 1", "one at a time"),
            ("--graph --iters 0", "at least one replay"),
            ("--graph --iters x", "--iters x: not a number"),
            ("--graph --iters 4294967296", "--iters: too many"),
            (
                "--graph --capture-mode local",
                "global, thread-local or relaxed",
            ),
        ] {
            let e = parse(&args(line)).unwrap_err();
            assert!(e.contains(want), "{line}: {e}");
        }
    }

    /// `--memory`: the default, both VMM kinds, and a word it refuses.
    #[test]
    fn memory_options_parse() {
        let o = parse(&args("--ranks 2")).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(o.memory, Memory::Malloc);
        let o = parse(&args("--memory vmm --graph")).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(o.memory, Memory::Vmm { posix_fd: true });
        assert!(o.memory.describe().contains("POSIX file descriptor"));
        let o = parse(&args("--memory vmm-no-fd")).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(o.memory, Memory::Vmm { posix_fd: false });
        let e = parse(&args("--memory managed")).unwrap_err();
        assert!(e.contains("malloc, vmm or vmm-no-fd"), "{e}");
    }

    /// The user's header is written where the include folder points.
    #[test]
    fn the_include_folder_holds_the_users_header() {
        let (o, dir) = compile_options().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(o.include_dirs, [dir.path().to_path_buf()]);
        assert!(dir.path().join("fused/op.cuh").is_file());
        assert_eq!(o.defines[0], ("FUSED_SCALE".into(), Some("2".into())));
        let p = dir.path().to_path_buf();
        drop(dir);
        assert!(!p.exists());
    }
}
