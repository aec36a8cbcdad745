//! Checks the CUDA device API (gin/gin.cuh) across the ranks of a job on
//! GPUs, with data verified on the device. Spawns its own ranks (`--ranks N`,
//! default 2) or runs as one rank under a launcher. GIN_BACKEND=auto takes
//! the load/store path (CUDA IPC), GIN_BACKEND=proxy the CUDA proxy,
//! GIN_BACKEND=gdaki mlx5 queues and the soft NIC (whose bad input adds a
//! WQE with a bad key, which must come back as an error CQE).
//!
//! Scenarios: `all` (ring with thread, warp and block coops, signals,
//! all-to-all, get, rail, bad input), `ring`, `signals` (every rank signals
//! every rank, reads, resets and reuses the signal), `alltoall`, `get`,
//! `rail` (rail barriers with a full and a rail connection), `badinput`
//! (each bad call must
//! come back as an error naming it; the never-arriving signal needs a short
//! GIN_TIMEOUT), `die VICTIM` (the victim dies while the others wait in a
//! kernel: they must fail naming it, not hang), `dropped` (over TCP: the
//! last rank drops a window without freeing it, and rank 0's get from it
//! must fail with the target's refusal, not read freed memory),
//! `nccl-alltoall` (kernels/nccl_alltoall.cu, an all-to-all written in
//! NCCL's GIN device names through gin/nccl_compat.cuh, launched as NCCL's
//! example launches it: 16 blocks of 512 threads, one signal and one world
//! barrier per block; every byte received is checked on the host),
//! `parity` (kernels/parity.cu, each coop: weak signals, put_value of
//! 1/2/4/8 bytes, VA signals, per-call timeouts, flush_async/wait, barrier
//! fence levels, checked on the device; then the calls a copy-engine path
//! must refuse, each failing with the error that says why).
//!
//! `--hosts K` splits the ranks into K emulated hosts (consecutive ranks
//! share one, by host id), so peers on other "hosts" are reached over TCP
//! with staging; `GIN_TRANSPORT=tcp` does so for every peer.
//!
//! Where no GPU is usable it prints `SKIPPED: <reason>` and exits 0.

#![allow(clippy::many_single_char_names)] // c, k, f, w: comm, kernels, function, window

use std::process::ExitCode;
use std::time::Instant;

use gin_core::cuda::{self, Arg, CtxSharing, CudaComm, CudaDevComm, DevMem, Module};
use gin_core::launch::{Role, run_ranks};
use gin_core::{Comm, Connection, CoreError, DevCommRequirements};
use gin_device::abi::DEVCOMM_FLAG_LSA_ONLY;

type R = Result<(), String>;

fn s<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

fn main() -> ExitCode {
    gin_bootstrap::init_tracing_from_env();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = args.first().cloned().unwrap_or_else(|| "all".into());
    let n = args
        .iter()
        .position(|a| a == "--ranks")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let hosts: Option<usize> = args
        .iter()
        .position(|a| a == "--hosts")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .filter(|&k| k > 0);
    if let Some(why) = cuda::skip_reason() {
        println!("SKIPPED: {why}");
        return ExitCode::SUCCESS;
    }
    match run_ranks(n) {
        Ok(Role::Launched) => return ExitCode::SUCCESS,
        Ok(Role::Rank) => {}
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    }
    let t = Instant::now();
    let r = join(hosts).and_then(|comm| {
        let cuda = comm.cuda().map_err(s)?;
        let module = cuda
            .compile(gin_selftest::KERNELS, "selftest.cu")
            .map_err(s)?;
        let k = Kernels { m: &module };
        let r = match mode.as_str() {
            "all" => all(&cuda, &k),
            "ring" => ring(&cuda, &k),
            "alltoall" => alltoall(&cuda, &k),
            "get" => get(&cuda, &k),
            "signals" => signals(&cuda, &k),
            "rail" => rail(&cuda, &k),
            "badinput" => badinput(&cuda, &k),
            "queue-paths" => queue_paths(&cuda),
            "dropped" => dropped(&cuda, &k),
            "nccl-alltoall" => nccl_alltoall(&cuda),
            "parity" => parity(&cuda),
            "die" => die(
                &cuda,
                &k,
                args.get(1).and_then(|v| v.parse().ok()).unwrap_or(1),
            ),
            other => Err(format!("unknown scenario {other:?}")),
        };
        r.map(|()| {
            format!(
                "rank {} of {}: {mode} ok in {:.2}s on GPU {} ({})",
                comm.rank(),
                comm.nranks(),
                t.elapsed().as_secs_f64(),
                cuda.device().ordinal(),
                cuda.device().name()
            )
        })
    });
    match r {
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

/// Joins the job; with `hosts`, as one of that many emulated hosts.
fn join(hosts: Option<usize>) -> Result<Comm, String> {
    let b = gin_bootstrap::Bootstrap::from_env().map_err(s)?;
    let mut settings = gin_core::Settings::from_env().map_err(s)?;
    if let Some(k) = hosts {
        let host = b.rank() * k / b.nranks();
        settings.host_id = format!("gin-cuda-selftest-host-{host}");
    }
    Comm::with_settings(b, settings).map_err(s)
}

struct Kernels<'m> {
    m: &'m Module,
}

impl Kernels<'_> {
    fn f(&self, name: &str) -> Result<cuda::Function, String> {
        self.m.function(name).map_err(s)
    }
}

/// The scenarios' requirements; `GIN_SELFTEST_QUEUE_DEPTH` runs them with
/// another queue depth (the backends' shallowest queues wrap constantly).
fn req() -> DevCommRequirements {
    let d = DevCommRequirements::default();
    DevCommRequirements {
        signals: 8,
        counters: 4,
        queue_depth: std::env::var("GIN_SELFTEST_QUEUE_DEPTH")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(d.queue_depth),
        ..d
    }
}

/// `out[0]` (first error kind) and `out[1]` (bytes that differ) must be zero.
fn check_out(out: &DevMem, what: &str) -> R {
    let mut o = [0u64; 3];
    out.read(0, &mut o).map_err(s)?;
    if o[0] != 0 {
        return Err(format!("{what}: kernel returned error kind {}", o[0]));
    }
    if o[1] != 0 {
        return Err(format!("{what}: {} bytes differ from what was sent", o[1]));
    }
    Ok(())
}

fn all(c: &CudaComm<'_>, k: &Kernels<'_>) -> R {
    ring(c, k)?;
    signals(c, k)?;
    alltoall(c, k)?;
    get(c, k)?;
    rail(c, k)?;
    badinput(c, k)
}

/// Rail barriers with a full and a rail connection, each coop: data put
/// before the barrier is there after it; with a rail connection a put to a
/// rank off the rail fails naming it, even with its destination or source
/// offset outside the window (the unreachable peer is the error to report).
fn rail(c: &CudaComm<'_>, k: &Kernels<'_>) -> R {
    let f = k.f("gin_rail")?;
    let (rank, n) = (c.comm().rank(), c.comm().nranks());
    let team = c.comm().rail().to_vec();
    for (connection, cname) in [(Connection::Full, "full"), (Connection::Rail, "rail")] {
        for (coop, block, name) in [(0u32, 1u32, "thread"), (1, 32, "warp"), (2, 256, "block")] {
            let mut r = req();
            r.rail_barriers = 1;
            r.connection = connection;
            if connection == Connection::Rail {
                // World barriers would need every rank connected.
                r.world_barriers = 0;
            }
            let dc = c.dev_comm(&r, CtxSharing::Gpu).map_err(s)?;
            let w = c.alloc_window(n as u64 * 8).map_err(s)?;
            let out = DevMem::new(24).map_err(s)?;
            let what = format!("rail barrier ({cname} connection, {name} coop)");
            let args = |rounds: u32, stranger: u32, bad_src: u32| {
                // SAFETY: gin_rail(DevComm, Window, u32 rounds, u32 coop, u32
                // stranger, u32 bad_src, u64* out) in selftest.cu takes these
                // arguments in this order; `w` and `dc` are alive, and `out`
                // holds the 24 bytes the kernel writes.
                unsafe {
                    dc.run(
                        &f,
                        1,
                        block,
                        &[
                            Arg::DevComm(dc.abi()),
                            Arg::Window(w.abi()),
                            Arg::U32(rounds),
                            Arg::U32(coop),
                            Arg::U32(stranger),
                            Arg::U32(bad_src),
                            Arg::Ptr(out.ptr()),
                        ],
                    )
                }
            };
            args(20, n as u32, 0).map_err(|e| format!("{what}: {e}"))?;
            check_out(&out, &what)?;
            let stranger = (0..n).find(|p| !team.contains(p));
            if let (Connection::Rail, Some(p)) = (connection, stranger) {
                for (bad_src, which) in [(0, "destination"), (1, "source")] {
                    match args(0, p as u32, bad_src) {
                        Err(e) if e.to_string().contains("not connected") => {
                            println!(
                                "rank {rank}: {what}: a put to rank {p}, off the rail, {which} outside the window, fails: {e}"
                            );
                        }
                        Err(e) => {
                            return Err(format!(
                                "{what}: put off the rail ({which} outside the window): wrong error: {e}"
                            ));
                        }
                        Ok(()) => {
                            return Err(format!(
                                "{what}: a put to rank {p} off the rail succeeded"
                            ));
                        }
                    }
                }
            }
            println!(
                "rank {rank}: {what} over ranks {team:?}, 20 rounds verified via {}",
                dc.backend_name()
            );
            dc.destroy().map_err(s)?;
            c.free_window(w).map_err(s)?;
        }
    }
    Ok(())
}

fn ring(c: &CudaComm<'_>, k: &Kernels<'_>) -> R {
    let f = k.f("gin_ring")?;
    // Every sharing mode is valid here: one block uses context 0, and only
    // a coop's leader posts. The queue reservations differ (device-scope
    // atomics, block-scope atomics, plain stores).
    // 8 B and 1 KiB take the load/store path's register fast paths (leader
    // alone; every member's share), 1000 B and 1 MiB the general copy.
    let cases = [8u64, 1000, 1024, 1 << 20]
        .map(|b| (b, CtxSharing::Gpu))
        .into_iter()
        .chain([(1000, CtxSharing::Cta), (1000, CtxSharing::Thread)]);
    for (coop, block, name) in [(0u32, 1u32, "thread"), (1, 32, "warp"), (2, 256, "block")] {
        for (bytes, sharing) in cases.clone() {
            let dc = c.dev_comm(&req(), sharing).map_err(s)?;
            let send = c.alloc_window(bytes).map_err(s)?;
            let recv = c.alloc_window(bytes).map_err(s)?;
            let out = DevMem::new(24).map_err(s)?;
            let rounds = 4u32;
            // SAFETY: gin_ring(DevComm, Window send, Window recv, u64 bytes,
            // u32 rounds, u32 coop, u64* out) in selftest.cu; both windows
            // hold `bytes`, and `out` the 24 bytes the kernel writes.
            unsafe {
                dc.run(
                    &f,
                    1,
                    block,
                    &[
                        Arg::DevComm(dc.abi()),
                        Arg::Window(send.abi()),
                        Arg::Window(recv.abi()),
                        Arg::U64(bytes),
                        Arg::U32(rounds),
                        Arg::U32(coop),
                        Arg::Ptr(out.ptr()),
                    ],
                )
            }
            .map_err(|e| format!("ring ({name} coop, {bytes} B, {sharing:?} sharing): {e}"))?;
            check_out(
                &out,
                &format!("ring ({name} coop, {bytes} B, {sharing:?} sharing)"),
            )?;
            println!(
                "rank {}: ring {name} coop {bytes} B x{rounds} ({sharing:?} sharing) verified via {}",
                c.comm().rank(),
                dc.backend_name()
            );
            dc.destroy().map_err(s)?;
            // Collectively, so the next round's windows start from a table
            // without these.
            c.free_window(send).map_err(s)?;
            c.free_window(recv).map_err(s)?;
        }
    }
    Ok(())
}

fn signals(c: &CudaComm<'_>, k: &Kernels<'_>) -> R {
    let f = k.f("gin_signals")?;
    let mut r = req();
    r.world_barriers = 2;
    for (coop, block, name) in [(0u32, 1u32, "thread"), (1, 32, "warp"), (2, 256, "block")] {
        let dc = c.dev_comm(&r, CtxSharing::Gpu).map_err(s)?;
        let lsa_only = dc.abi().flags & DEVCOMM_FLAG_LSA_ONLY != 0;
        if lsa_only != (dc.backend_name() == "load/store") {
            return Err(format!(
                "signals: DEVCOMM_FLAG_LSA_ONLY is {} with the {} backend",
                if lsa_only { "set" } else { "clear" },
                dc.backend_name()
            ));
        }
        let out = DevMem::new(24).map_err(s)?;
        // SAFETY: gin_signals(DevComm, u32 coop, u64* out) in selftest.cu;
        // `out` holds the 24 bytes the kernel writes.
        unsafe {
            dc.run(
                &f,
                1,
                block,
                &[Arg::DevComm(dc.abi()), Arg::U32(coop), Arg::Ptr(out.ptr())],
            )
        }
        .map_err(|e| format!("signals ({name} coop): {e}"))?;
        let mut o = [0u64; 3];
        out.read(0, &mut o).map_err(s)?;
        if o[0] != 0 {
            return Err(format!(
                "signals ({name} coop): kernel returned error kind {}",
                o[0]
            ));
        }
        if o[1] != 0 {
            return Err(format!(
                "signals ({name} coop): {} signal reads had the wrong value",
                o[1]
            ));
        }
        println!(
            "rank {}: signals {name} coop: add, read, reset, reuse from every rank verified via {}",
            c.comm().rank(),
            dc.backend_name()
        );
        dc.destroy().map_err(s)?;
    }
    Ok(())
}

fn alltoall(c: &CudaComm<'_>, k: &Kernels<'_>) -> R {
    let f = k.f("gin_alltoall")?;
    let n = c.comm().nranks() as u64;
    let dc = c.dev_comm(&req(), CtxSharing::Gpu).map_err(s)?;
    let mut rounds = 0u32;
    for bytes in [8u64, 4096, 256 << 10] {
        let send = c.alloc_window(bytes * n).map_err(s)?;
        let recv = c.alloc_window(bytes * n).map_err(s)?;
        let out = DevMem::new(24).map_err(s)?;
        // Signal 0 accumulates across sizes: keep counting rounds.
        for r in 0..3u32 {
            // SAFETY: gin_alltoall(DevComm, Window send, Window recv, u64
            // bytes, u32 r, u64* out) in selftest.cu; each window holds a
            // block of `bytes` per rank, and `out` the 24 bytes written.
            unsafe {
                dc.run(
                    &f,
                    n as u32,
                    256,
                    &[
                        Arg::DevComm(dc.abi()),
                        Arg::Window(send.abi()),
                        Arg::Window(recv.abi()),
                        Arg::U64(bytes),
                        Arg::U32(rounds + r),
                        Arg::Ptr(out.ptr()),
                    ],
                )
            }
            .map_err(|e| format!("alltoall {bytes} B round {r}: {e}"))?;
            c.comm().bootstrap().barrier().map_err(s)?;
        }
        rounds += 3;
        check_out(&out, &format!("alltoall {bytes} B"))?;
        println!(
            "rank {}: alltoall {bytes} B per peer x3 verified via {}",
            c.comm().rank(),
            dc.backend_name()
        );
    }
    dc.destroy().map_err(s)
}

fn get(c: &CudaComm<'_>, k: &Kernels<'_>) -> R {
    let bytes = 300_000u64;
    let dc = c.dev_comm(&req(), CtxSharing::Gpu).map_err(s)?;
    let src = c.alloc_window(bytes).map_err(s)?;
    let dst = c.alloc_window(bytes).map_err(s)?;
    let out = DevMem::new(24).map_err(s)?;
    // SAFETY: gin_fill(Window, u64 bytes, u32 rank, u32 round) in
    // selftest.cu fills `bytes` of the window's local part, which holds
    // that many.
    unsafe {
        dc.run(
            &k.f("gin_fill")?,
            64,
            256,
            &[
                Arg::Window(src.abi()),
                Arg::U64(bytes),
                Arg::U32(c.comm().rank() as u32),
                Arg::U32(99),
            ],
        )
    }
    .map_err(s)?;
    c.comm().bootstrap().barrier().map_err(s)?;
    // SAFETY: gin_get(DevComm, Window src, Window dst, u64 bytes, u64*
    // out) in selftest.cu; both windows hold `bytes`, and `out` the 24
    // bytes the kernel writes.
    unsafe {
        dc.run(
            &k.f("gin_get")?,
            1,
            256,
            &[
                Arg::DevComm(dc.abi()),
                Arg::Window(src.abi()),
                Arg::Window(dst.abi()),
                Arg::U64(bytes),
                Arg::Ptr(out.ptr()),
            ],
        )
    }
    .map_err(|e| format!("get: {e}"))?;
    check_out(&out, "get")?;
    println!(
        "rank {}: get {bytes} B verified via {}",
        c.comm().rank(),
        dc.backend_name()
    );
    c.comm().bootstrap().barrier().map_err(s)?;
    dc.destroy().map_err(s)
}

/// Each bad call must fail with the matching error kind and a message that
/// names it; the wait for a signal that never comes ends with a timeout.
fn badinput(c: &CudaComm<'_>, k: &Kernels<'_>) -> R {
    let f = k.f("gin_badinput")?;
    let dc = c.dev_comm(&req(), CtxSharing::Gpu).map_err(s)?;
    let w = c.alloc_window(4096).map_err(s)?;
    let out = DevMem::new(24).map_err(s)?;
    let cases: &[(u32, &str)] = &[
        (1, "peer does not exist"),
        (2, "access outside a window"),
        (3, "unknown signal id"),
        (4, "unknown counter id"),
        (5, "timed out waiting for a signal"),
    ];
    let short = c.comm().timeout() <= std::time::Duration::from_secs(10);
    for &(which, want) in cases {
        if which == 5 && !short {
            println!(
                "rank {}: badinput 5 skipped: set GIN_TIMEOUT=2s to run it",
                c.comm().rank()
            );
            continue;
        }
        let t = Instant::now();
        let r = run_bad(&dc, f, &w, which, &out);
        match r {
            Err(e) if e.to_string().contains(want) => println!(
                "rank {}: badinput {which} -> error after {:.3}s: {e}",
                c.comm().rank(),
                t.elapsed().as_secs_f64()
            ),
            Err(e) => return Err(format!("badinput {which}: wrong error: {e}")),
            Ok(()) => return Err(format!("badinput {which}: the bad call succeeded")),
        }
    }
    if dc.backend_name() == "gdaki" {
        // Last: the error CQE leaves the QP in the error state, as hardware.
        let t = Instant::now();
        match run_bad(&dc, f, &w, 6, &out) {
            Err(e)
                if e.to_string().contains("completed in error")
                    && e.to_string().contains("syndrome") =>
            {
                println!(
                    "rank {}: badinput 6 -> error after {:.3}s: {e}",
                    c.comm().rank(),
                    t.elapsed().as_secs_f64()
                );
            }
            Err(e) => return Err(format!("badinput 6: wrong error: {e}")),
            Ok(()) => return Err("badinput 6: a WQE with a bad key succeeded".into()),
        }
        c.comm().bootstrap().barrier().map_err(s)?;
        return match dc.destroy() {
            Err(e) if e.to_string().contains("remote access error") => Ok(()),
            Err(e) => Err(format!("badinput 6: destroy reported the wrong error: {e}")),
            Ok(()) => Err("badinput 6: the NIC did not report the error CQE".into()),
        };
    }
    c.comm().bootstrap().barrier().map_err(s)?;
    dc.destroy().map_err(s)
}

/// Kernels compiled with the load/store path alone (`GIN_QUEUE_PATHS=0`,
/// gin/gin.cuh): where every peer is reached by load/store they pass the
/// ring and signals scenarios as the default build does; where the peers
/// are reached through the proxy or GDAKI, a ring's first put fails before
/// anything is posted, naming the peer and the path compiled out, on every
/// rank (none waits for a put that never left).
fn queue_paths(c: &CudaComm<'_>) -> R {
    let opts = cuda::CompileOptions {
        defines: vec![("GIN_QUEUE_PATHS".into(), Some("0".into()))],
        ..Default::default()
    };
    let m = c
        .compile_with(gin_selftest::KERNELS, "selftest.cu", &opts)
        .map_err(s)?;
    let k = Kernels { m: &m };
    let rank = c.comm().rank();
    let dc = c.dev_comm(&req(), CtxSharing::Gpu).map_err(s)?;
    let (lsa, backend) = (
        dc.abi().flags & DEVCOMM_FLAG_LSA_ONLY != 0,
        dc.backend_name(),
    );
    dc.destroy().map_err(s)?;
    if lsa {
        ring(c, &k)?;
        signals(c, &k)?;
        println!("rank {rank}: queue-paths: kernels with the load/store path alone verified");
        return Ok(());
    }
    // With some peers load/store and others queued, a rank whose ring
    // neighbour is load/store would wait for a rank that was refused.
    if c.comm().nranks() != 2 {
        return Err(format!(
            "queue-paths: with {} ranks not all reached by load/store ({backend}), the refusal half needs every peer reached alike: run it with --ranks 2",
            c.comm().nranks()
        ));
    }
    let f = k.f("gin_ring")?;
    let dc = c.dev_comm(&req(), CtxSharing::Gpu).map_err(s)?;
    let send = c.alloc_window(1024).map_err(s)?;
    let recv = c.alloc_window(1024).map_err(s)?;
    let out = DevMem::new(24).map_err(s)?;
    let t = Instant::now();
    // SAFETY: gin_ring as in `ring`: both windows hold 1024 bytes, `out`
    // the 24 bytes the kernel writes.
    let r = unsafe {
        dc.run(
            &f,
            1,
            32,
            &[
                Arg::DevComm(dc.abi()),
                Arg::Window(send.abi()),
                Arg::Window(recv.abi()),
                Arg::U64(1024),
                Arg::U32(1),
                Arg::U32(1),
                Arg::Ptr(out.ptr()),
            ],
        )
    };
    let next = (rank + 1) % c.comm().nranks();
    let r = match r {
        Err(e)
            if e.to_string().contains("compiled without the queue path")
                && e.to_string().contains(&format!(", peer {next} (")) =>
        {
            println!(
                "rank {rank}: queue-paths: a put to rank {next} over {backend} from a kernel with the load/store path alone -> error after {:.3}s: {e}",
                t.elapsed().as_secs_f64()
            );
            Ok(())
        }
        Err(e) => Err(format!("queue-paths ({backend}): wrong error: {e}")),
        Ok(()) => Err(format!(
            "queue-paths ({backend}): a put through a queue path compiled out succeeded"
        )),
    };
    c.comm().bootstrap().barrier().map_err(s)?;
    dc.destroy().map_err(s)?;
    c.free_window(send).map_err(s)?;
    c.free_window(recv).map_err(s)?;
    r
}

fn run_bad(
    dc: &CudaDevComm<'_, '_>,
    f: cuda::Function,
    w: &cuda::GpuWindow,
    which: u32,
    out: &DevMem,
) -> Result<(), CoreError> {
    // SAFETY: gin_badinput(DevComm, Window, u32 which, u64* out) in
    // selftest.cu; its bad calls go through the device API, which checks
    // them, and `out` holds the 24 bytes it writes.
    unsafe {
        dc.run(
            &f,
            1,
            1,
            &[
                Arg::DevComm(dc.abi()),
                Arg::Window(w.abi()),
                Arg::U32(which),
                Arg::Ptr(out.ptr()),
            ],
        )
    }
}

/// Over TCP only: the last rank drops a window without `free_window`, then
/// rank 0 gets from it. The target must refuse ("unknown memory key"), the
/// proxy or NIC report it, and rank 0's kernel end with that cause.
fn dropped(c: &CudaComm<'_>, k: &Kernels<'_>) -> R {
    let f = k.f("gin_get")?;
    let (rank, n) = (c.comm().rank(), c.comm().nranks());
    let victim = n - 1;
    let dc = c.dev_comm(&req(), CtxSharing::Gpu).map_err(s)?;
    let mut src = Some(c.alloc_window(4096).map_err(s)?);
    let src_abi = *src.as_ref().expect("allocated").abi();
    let dst = c.alloc_window(4096).map_err(s)?;
    let b = c.comm().bootstrap();
    if !c.reaches_over_tcp(victim) && rank == 0 || n < 2 {
        println!(
            "rank {rank}: dropped skipped: rank 0 does not reach rank {victim} over TCP (use --hosts or GIN_TRANSPORT=tcp)"
        );
    }
    let tcp = n >= 2
        && b.allgather(&[u8::from(rank == 0 && c.reaches_over_tcp(victim))])
            .map_err(s)?[0][0]
            == 1;
    if !tcp {
        b.barrier().map_err(s)?;
        return dc.destroy().map_err(s);
    }
    if rank == victim {
        drop(src.take());
    }
    b.barrier().map_err(s)?;
    let r = if rank == 0 {
        let out = DevMem::new(24).map_err(s)?;
        let t = Instant::now();
        // SAFETY: gin_get as in `get`, 64 bytes of 4096-byte windows. The
        // victim's part of `src_abi` is gone, but rank 0 reaches it over TCP
        // only (checked above), through the proxy or NIC, and the victim
        // refuses the freed part's key; rank 0's own parts of both windows
        // are alive.
        let e = unsafe {
            dc.run(
                &f,
                1,
                64,
                &[
                    Arg::DevComm(dc.abi()),
                    Arg::Window(&src_abi),
                    Arg::Window(dst.abi()),
                    Arg::U64(64),
                    Arg::Ptr(out.ptr()),
                ],
            )
        };
        match e {
            Err(e) if e.to_string().contains("unknown memory key") => {
                println!(
                    "rank 0: dropped -> error after {:.3}s: {e}",
                    t.elapsed().as_secs_f64()
                );
                Ok(())
            }
            Err(e) => Err(format!("dropped: wrong error: {e}")),
            Ok(()) => Err("dropped: a get from a dropped window succeeded".into()),
        }
    } else {
        Ok(())
    };
    b.barrier().map_err(s)?;
    // Not destroy: rank 0's link to the victim is in its error state.
    drop(dc);
    drop((src, dst));
    r
}

/// The victim dies while every other rank waits in a kernel for a signal
/// that only the victim would send: they must fail naming it.
fn die(c: &CudaComm<'_>, k: &Kernels<'_>, victim: usize) -> R {
    let f = k.f("gin_badinput")?;
    let dc = c.dev_comm(&req(), CtxSharing::Gpu).map_err(s)?;
    let w = c.alloc_window(4096).map_err(s)?;
    let out = DevMem::new(24).map_err(s)?;
    c.comm().bootstrap().barrier().map_err(s)?;
    if c.comm().rank() == victim {
        // Die once the others are inside their kernels.
        std::thread::sleep(std::time::Duration::from_millis(300));
        std::process::abort();
    }
    let t = Instant::now();
    match run_bad(&dc, f, &w, 5, &out) {
        Ok(()) => Err("the wait succeeded without the victim's signal".into()),
        Err(e) => Err(format!("{e} (after {:.2}s)", t.elapsed().as_secs_f64())),
    }
}

/// The NCCL example's launch shape: one signal and one world barrier per block.
const NCCL_BLOCKS: u32 = 16;
const NCCL_THREADS: u32 = 512;

/// The 4-byte word `src` sends to `dst` at element `i` (distinct per source,
/// destination and element, so a block landing in the wrong place shows).
fn nccl_word(src: usize, dst: usize, i: usize) -> u32 {
    let x = (src as u32).wrapping_mul(0x9e37_79b9) ^ (dst as u32).wrapping_mul(0x85eb_ca6b);
    x ^ (i as u32).wrapping_mul(0xc2b2_ae35) ^ 0x5bd1_e995
}

/// NCCL's GIN all-to-all through the compatibility header: every rank sends
/// `count` floats to every rank, twice per size (the signals keep counting
/// across runs, as NCCL's do); each rank checks every received byte.
fn nccl_alltoall(c: &CudaComm<'_>) -> R {
    let module = c
        .compile(gin_selftest::NCCL_ALLTOALL, "nccl_alltoall.cu")
        .map_err(s)?;
    let f = module.function("nccl_alltoall").map_err(s)?;
    let (me, n) = (c.comm().rank(), c.comm().nranks());
    let dc = c
        .dev_comm(
            &DevCommRequirements {
                signals: NCCL_BLOCKS,
                world_barriers: NCCL_BLOCKS,
                ..req()
            },
            CtxSharing::Gpu,
        )
        .map_err(s)?;
    // 4 B, NCCL's 4 KiB, and 256 KiB per peer: one thread puts each block,
    // NCCL's idiom, which is slow on the load/store path (docs/porting.md).
    for count in [1usize, 1024, 65536] {
        let bytes = (count * 4 * n) as u64;
        let send = c.alloc_window(bytes).map_err(s)?;
        let recv = c.alloc_window(bytes).map_err(s)?;
        let words: Vec<u32> = (0..n * count)
            .map(|k| nccl_word(me, k / count, k % count))
            .collect();
        send.local().write(0, &words).map_err(s)?;
        for round in 0..2 {
            recv.local().write(0, &vec![0u32; n * count]).map_err(s)?;
            c.comm().bootstrap().barrier().map_err(s)?;
            let t = Instant::now();
            // SAFETY: nccl_alltoall(ncclWindow_t send, size_t, ncclWindow_t
            // recv, size_t, size_t count, ncclDevComm) in nccl_alltoall.cu:
            // ncclWindow_t is gin::Window and ncclDevComm is gin::DevComm
            // byte for byte (static_asserts in gin/nccl_compat.cuh), size_t
            // is 8 bytes; both windows hold `count` floats per rank on every
            // rank, and the kernel touches nothing else. The communicator
            // has NCCL_BLOCKS signals and world barriers, one per block.
            unsafe {
                dc.run(
                    &f,
                    NCCL_BLOCKS,
                    NCCL_THREADS,
                    &[
                        Arg::Window(send.abi()),
                        Arg::U64(0),
                        Arg::Window(recv.abi()),
                        Arg::U64(0),
                        Arg::U64(count as u64),
                        Arg::DevComm(dc.abi()),
                    ],
                )
            }
            .map_err(|e| format!("nccl-alltoall {count} floats round {round}: {e}"))?;
            let took = t.elapsed();
            let mut got = vec![0u32; n * count];
            recv.local().read(0, &mut got).map_err(s)?;
            if let Some(k) = (0..n * count).find(|&k| got[k] != nccl_word(k / count, me, k % count))
            {
                return Err(format!(
                    "nccl-alltoall {count} floats round {round}: element {} from rank {} is \
                     {:#010x}, expected {:#010x}",
                    k % count,
                    k / count,
                    got[k],
                    nccl_word(k / count, me, k % count)
                ));
            }
            println!(
                "rank {me}: nccl-alltoall {} B per peer round {round} verified via {} in {:.3} ms",
                count * 4,
                dc.backend_name(),
                took.as_secs_f64() * 1e3
            );
        }
        c.comm().bootstrap().barrier().map_err(s)?;
    }
    dc.destroy().map_err(s)
}

/// `gin_parity`'s steps (out[2]), as parity.cu numbers them.
const PARITY_STEPS: [(u64, &str); 6] = [
    (1, "put_value 8 B + weak signal"),
    (2, "put_value 1/2/4 B (neighbours untouched)"),
    (
        4,
        "VA signals (strong inc with a put, weak add; read, wait, reset)",
    ),
    (
        8,
        "per-call timeouts (signal 2 ms, counter 1 ms, VA 1 ms, satisfied 0 and none)",
    ),
    (16, "flush_async/wait of a 2 KiB get"),
    (
        32,
        "fences (ctx 1 put seen after an all-contexts barrier; none; barrier_for)",
    ),
];

/// The header-parity calls on every coop (kernels/parity.cu), then the
/// calls that must fail: on a copy-engine path VA signals and sub-word
/// values with the copy-engine refusal, everywhere a misaligned VA signal
/// and a 3-byte value.
fn parity(c: &CudaComm<'_>) -> R {
    let module = c.compile(gin_selftest::PARITY, "parity.cu").map_err(s)?;
    let f = module.function("gin_parity").map_err(s)?;
    let me = c.comm().rank();
    let r = DevCommRequirements {
        contexts: 2,
        world_barriers: 2,
        ..req()
    };
    let mut copy_engine = false;
    for (coop, block, name) in [(0u32, 1u32, "thread"), (1, 32, "warp"), (2, 256, "block")] {
        let dc = c.dev_comm(&r, CtxSharing::Gpu).map_err(s)?;
        let recv = c.alloc_window(4096).map_err(s)?;
        let src = c.alloc_window(4096).map_err(s)?;
        let sig = c.alloc_window(64).map_err(s)?;
        recv.local().write(0, &[0x5au8; 4096]).map_err(s)?;
        sig.local().write(0, &[0u64; 8]).map_err(s)?;
        let out = DevMem::new(40).map_err(s)?;
        out.write(0, &[0u64; 5]).map_err(s)?;
        c.comm().bootstrap().barrier().map_err(s)?;
        let what = format!("parity ({name} coop)");
        // SAFETY: gin_parity(DevComm, Window recv, Window src, Window sig,
        // u32 coop, u64* out) in parity.cu: recv and src hold 4096 bytes a
        // rank and sig 64, as the kernel's layout needs; `out` holds the 40
        // bytes it writes. The communicator has the 2 contexts and 2 world
        // barriers it uses.
        unsafe {
            dc.run(
                &f,
                1,
                block,
                &[
                    Arg::DevComm(dc.abi()),
                    Arg::Window(recv.abi()),
                    Arg::Window(src.abi()),
                    Arg::Window(sig.abi()),
                    Arg::U32(coop),
                    Arg::Ptr(out.ptr()),
                ],
            )
        }
        .map_err(|e| format!("{what}: {e}"))?;
        let mut o = [0u64; 5];
        out.read(0, &mut o).map_err(s)?;
        if o[0] != 0 {
            return Err(format!("{what}: kernel returned error kind {}", o[0]));
        }
        if o[1] != 0 {
            return Err(format!("{what}: {} checks failed", o[1]));
        }
        copy_engine = o[3] != 0;
        let need = if copy_engine { 1 | 8 | 16 | 32 } else { 63 };
        if o[2] & need != need {
            return Err(format!("{what}: steps {:#x} ran, {need:#x} expected", o[2]));
        }
        for (bit, step) in PARITY_STEPS {
            if o[2] & bit != 0 {
                println!(
                    "rank {me}: {what}: {step} verified via {}",
                    dc.backend_name()
                );
            } else {
                println!(
                    "rank {me}: {what}: {step} skipped: refused on this copy-engine path (below)"
                );
            }
        }
        println!(
            "rank {me}: {what}: wait_signal_for(2 ms) returned SIGNAL_TIMEOUT after {:.3} ms, error word clean",
            o[4] as f64 / 1e6
        );
        c.comm().bootstrap().barrier().map_err(s)?;
        dc.destroy().map_err(s)?;
        for w in [recv, src, sig] {
            c.free_window(w).map_err(s)?;
        }
    }
    parity_refusals(c, copy_engine)
}

/// Each refused call must fail with the error naming why; on the
/// load/store path the copy-engine cases succeed instead.
fn parity_refusals(c: &CudaComm<'_>, copy_engine: bool) -> R {
    let module = c.compile(gin_selftest::PARITY, "parity.cu").map_err(s)?;
    let f = module.function("gin_parity_refuse").map_err(s)?;
    let me = c.comm().rank();
    let dc = c.dev_comm(&req(), CtxSharing::Gpu).map_err(s)?;
    let recv = c.alloc_window(64).map_err(s)?;
    let sig = c.alloc_window(64).map_err(s)?;
    let ce = if copy_engine {
        Some("copy engine")
    } else {
        None
    };
    let cases: [(u32, &str, Option<&str>); 5] = [
        (1, "4-byte put_value", ce),
        (2, "bare VA signal", ce),
        (3, "put with a VA signal", ce),
        (4, "VA signal at offset 4", Some("misaligned")),
        (5, "3-byte put_value", Some("not supported")),
    ];
    for (which, what, want) in cases {
        // SAFETY: gin_parity_refuse(DevComm, Window recv, Window sig, u32
        // which) in parity.cu: one call through the device API, which
        // checks it; both windows hold the 64 bytes it may touch.
        let r = unsafe {
            dc.run(
                &f,
                1,
                1,
                &[
                    Arg::DevComm(dc.abi()),
                    Arg::Window(recv.abi()),
                    Arg::Window(sig.abi()),
                    Arg::U32(which),
                ],
            )
        };
        match (r, want) {
            (Err(e), Some(w)) if e.to_string().contains(w) => {
                println!("rank {me}: parity refusal {which} ({what}) -> {e}");
            }
            (Err(e), _) => {
                return Err(format!("parity refusal {which} ({what}): wrong error: {e}"));
            }
            (Ok(()), Some(w)) => {
                return Err(format!(
                    "parity refusal {which} ({what}) succeeded; expected an error with {w:?}"
                ));
            }
            (Ok(()), None) => {
                println!("rank {me}: parity {which} ({what}) accepted on the load/store path");
            }
        }
    }
    c.comm().bootstrap().barrier().map_err(s)?;
    dc.destroy().map_err(s)?;
    c.free_window(recv).map_err(s)?;
    c.free_window(sig).map_err(s)
}
