//! `gin-bench cuda`: CUDA ranks on two GPUs (one process each), against
//! floors measured in the same job and the peer figures we measured for
//! NVSHMEM 3.4 and NCCL 2.28 on 2x H200 (docs/bench/cuda.md).
//!
//! - ping-pong: put-with-signal round trip, one kernel per GPU, for the
//!   load/store path and the proxy, with thread / warp / block coops; the
//!   load/store floor is a raw copy plus release-store flag over the same
//!   CUDA IPC mapping, the proxy floor a raw CPU-proxied copy plus flag
//!   (a host thread forwarding with cuMemcpyAsync + cuStreamWriteValue64).
//! - bandwidth: one-way, 4 MiB messages split over N blocks.
//!
//! Times are measured on the GPU (%globaltimer) over many round trips per
//! launch; each figure is the median over `--runs` launches, with min and
//! max.

#![allow(clippy::many_single_char_names)] // c, m, f: CUDA comm, module, kernel

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use anyhow::{Context, Result, bail};
use clap::Args;
use gin_core::cuda::{self, Arg, CtxSharing, CudaComm, DevMem, Function, HostMem, Module, Stream};
use gin_core::launch::{Role, run_ranks};
use gin_core::{BackendKind, Comm, DevCommRequirements};
use serde::Serialize;

use crate::pingpong::parse_size;

#[derive(Debug, Clone, Args)]
pub struct CudaArgs {
    /// Ping-pong message sizes.
    #[arg(long, value_delimiter = ',', default_value = "8,1k,64k,1m")]
    pub sizes: Vec<String>,
    /// Coops: thread, warp, block.
    #[arg(long, value_delimiter = ',', default_value = "thread,warp,block")]
    pub coops: Vec<String>,
    /// Round trips per launch (a tenth of it at 1 MiB and above).
    #[arg(long, default_value_t = 2000)]
    pub iters: u32,
    /// Launches per figure (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// Block counts for the bandwidth test.
    #[arg(long, value_delimiter = ',', default_value = "16,32,66,132")]
    pub blocks: Vec<u32>,
    /// Message size of the bandwidth test.
    #[arg(long, default_value = "4m")]
    pub bw_bytes: String,
    /// Write the results as JSON here.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

#[derive(Debug, Serialize)]
struct Row {
    test: &'static str,
    path: &'static str,
    coop: String,
    bytes: u64,
    /// Median over runs: round-trip µs (ping-pong) or GB/s (bandwidth).
    median: f64,
    min: f64,
    max: f64,
    floor: Option<f64>,
    peer: Option<(&'static str, f64)>,
}

fn coop_of(name: &str) -> Result<(u32, u32)> {
    Ok(match name {
        "thread" => (0, 1),
        "warp" => (1, 32),
        "block" => (2, 512),
        other => bail!("unknown coop {other:?} (thread, warp, block)"),
    })
}

/// NVSHMEM 3.4 put-with-signal round trip over NVLink on 2x H200 (µs), as
/// measured for the issue that asked for this benchmark.
fn nvshmem_rtt(bytes: u64) -> Option<f64> {
    match bytes {
        8 => Some(4.0),
        1024 => Some(4.4),
        65536 => Some(7.3),
        1_048_576 => Some(50.8),
        _ => None,
    }
}

/// Raw CPU-proxied copy plus flag (µs), same measurement campaign.
fn proxy_peer(bytes: u64) -> Option<f64> {
    match bytes {
        8 => Some(7.7),
        1_048_576 => Some(11.2),
        _ => None,
    }
}

fn median(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    let m = v[v.len() / 2];
    (m, v[0], v[v.len() - 1])
}

pub fn run(a: &CudaArgs) -> Result<()> {
    if let Some(why) = cuda::skip_reason() {
        bail!("gin-bench cuda needs a GPU: {why}");
    }
    match run_ranks(2).map_err(anyhow::Error::msg)? {
        Role::Launched => return Ok(()),
        Role::Rank => {}
    }
    let comm = Comm::from_env()?;
    if comm.nranks() != 2 {
        bail!("gin-bench cuda runs on exactly 2 ranks");
    }
    let c = comm.cuda()?;
    let m = c.compile(cuda::SELFTEST_KERNELS, "selftest.cu")?;
    let sizes: Vec<u64> = a
        .sizes
        .iter()
        .map(|s| parse_size(s))
        .collect::<Result<_>>()?;
    let max = sizes
        .iter()
        .copied()
        .max()
        .unwrap_or(8)
        .max(parse_size(&a.bw_bytes)?);
    let mut rows = Vec::new();
    if comm.rank() == 0 {
        println!(
            "gin-bench cuda: 2 ranks, GPU {} ({}) and its peer; {} launches per figure",
            c.device().ordinal,
            c.device().name,
            a.runs
        );
    }
    let src = c.alloc_window(max)?;
    let dst = c.alloc_window(max)?;
    let flags = c.alloc_window(64)?;
    let out = DevMem::new(24)?;
    let stream = Stream::new()?;
    for coop_name in &a.coops {
        let (coop, block) = coop_of(coop_name)?;
        for &bytes in &sizes {
            let iters = if bytes >= 1 << 20 {
                (a.iters / 10).max(50)
            } else {
                a.iters
            };
            let floor = lsa_floor(
                &c, &m, &stream, &src, &dst, &flags, &out, bytes, iters, coop, block, a.runs,
            )?;
            let gin = gin_pingpong(
                &c,
                &m,
                BackendKind::Auto,
                &src,
                &out,
                bytes,
                iters,
                coop,
                block,
                a.runs,
            )?;
            rows.push(Row {
                test: "pingpong",
                path: "load/store",
                coop: coop_name.clone(),
                bytes,
                median: gin.0,
                min: gin.1,
                max: gin.2,
                floor: Some(floor.0),
                peer: nvshmem_rtt(bytes).map(|v| ("NVSHMEM 3.4", v)),
            });
        }
    }
    // The proxy path: the coop does not change what the proxy does; block
    // only (the kernel's share is a descriptor).
    for &bytes in &sizes {
        let iters = (a.iters / 4).max(50);
        let floor = proxy_floor(
            &c, &m, &stream, &src, &dst, &flags, &out, bytes, iters, a.runs,
        )?;
        let gin = gin_pingpong(
            &c,
            &m,
            BackendKind::Proxy,
            &src,
            &out,
            bytes,
            iters,
            0,
            1,
            a.runs,
        )?;
        rows.push(Row {
            test: "pingpong",
            path: "proxy",
            coop: "thread".into(),
            bytes,
            median: gin.0,
            min: gin.1,
            max: gin.2,
            floor: Some(floor.0),
            peer: proxy_peer(bytes).map(|v| ("raw CPU proxy (peer run)", v)),
        });
    }
    let bw = parse_size(&a.bw_bytes)?;
    for (kind, path) in [
        (BackendKind::Auto, "load/store"),
        (BackendKind::Proxy, "proxy"),
    ] {
        for &blocks in &a.blocks {
            let r = bandwidth(&c, &m, kind, &src, &dst, &out, bw, blocks, a.runs)?;
            rows.push(Row {
                test: "bandwidth",
                path,
                coop: format!("{blocks} blocks"),
                bytes: bw,
                median: r.0,
                min: r.1,
                max: r.2,
                floor: None,
                peer: (kind == BackendKind::Auto).then_some(("NVSHMEM 3.4 (GB/s)", 345.0)),
            });
        }
    }
    if comm.rank() == 0 {
        print_rows(&rows);
        crate::ranks::write_json(a.json.as_ref(), &rows)?;
    }
    comm.bootstrap().barrier()?;
    Ok(())
}

fn print_rows(rows: &[Row]) {
    println!(
        "{:<10} {:<11} {:<10} {:>8} {:>10} {:>17} {:>9} {:>7}  peer",
        "test", "path", "coop", "bytes", "median", "min..max", "floor", "ratio"
    );
    for r in rows {
        let unit = if r.test == "pingpong" { "us" } else { "GB/s" };
        let ratio = r
            .floor
            .map_or(String::from("-"), |f| format!("{:.2}", r.median / f));
        println!(
            "{:<10} {:<11} {:<10} {:>8} {:>7.2} {unit:<2} {:>8.2}..{:<8.2} {:>9} {:>7}  {}",
            r.test,
            r.path,
            r.coop,
            r.bytes,
            r.median,
            r.min,
            r.max,
            r.floor.map_or(String::from("-"), |f| format!("{f:.2}")),
            ratio,
            r.peer.map_or(String::new(), |(n, v)| format!(
                "{n}: {v} ({:.2}x)",
                r.median / v
            )),
        );
    }
}

fn read_ns(out: &DevMem) -> Result<u64> {
    let mut o = [0u64; 3];
    out.read(0, &mut o)?;
    if o[0] != 0 {
        bail!("kernel returned error kind {}", o[0]);
    }
    Ok(o[2])
}

#[allow(clippy::too_many_arguments)]
fn gin_pingpong(
    c: &CudaComm<'_>,
    m: &Module,
    kind: BackendKind,
    buf: &cuda::GpuWindow,
    out: &DevMem,
    bytes: u64,
    iters: u32,
    coop: u32,
    block: u32,
    runs: usize,
) -> Result<(f64, f64, f64)> {
    let f = m.function("gin_pingpong")?;
    let req = DevCommRequirements {
        signals: 4,
        counters: 1,
        ..DevCommRequirements::default()
    };
    let dc = c.dev_comm_on(&req, CtxSharing::Gpu, kind)?;
    let mut v = Vec::with_capacity(runs);
    for run in 0..runs {
        c.comm().bootstrap().barrier()?;
        out.zero(0, 24)?;
        let base = run as u64 * u64::from(iters + iters / 10);
        dc.run(
            &f,
            1,
            block,
            &[
                Arg::DevComm(dc.abi()),
                Arg::Window(buf.abi()),
                Arg::U64(bytes),
                Arg::U32(iters),
                Arg::U32(iters / 10),
                Arg::U32(coop),
                Arg::U64(base),
                Arg::Ptr(out.ptr),
            ],
        )
        .with_context(|| format!("gin ping-pong {bytes} B"))?;
        v.push(read_ns(out)? as f64 / f64::from(iters) / 1000.0);
    }
    c.comm().bootstrap().barrier()?;
    dc.destroy()?;
    Ok(median(v))
}

#[allow(clippy::too_many_arguments)]
fn lsa_floor(
    c: &CudaComm<'_>,
    m: &Module,
    stream: &Stream,
    src: &cuda::GpuWindow,
    dst: &cuda::GpuWindow,
    flags: &cuda::GpuWindow,
    out: &DevMem,
    bytes: u64,
    iters: u32,
    coop: u32,
    block: u32,
    runs: usize,
) -> Result<(f64, f64, f64)> {
    let f = m.function("gin_floor_lsa")?;
    let (rank, peer) = (c.comm().rank(), c.comm().rank() ^ 1);
    let mut v = Vec::with_capacity(runs);
    for _ in 0..runs {
        flags.local().zero(0, 8)?;
        out.zero(0, 24)?;
        c.comm().bootstrap().barrier()?;
        launch_sync(
            &f,
            stream,
            block,
            &mut [
                rank as u64,
                dst.peer_base(peer).unwrap_or(0),
                src.local().ptr,
                flags.peer_base(peer).unwrap_or(0),
                flags.local().ptr,
                bytes,
                u64::from(iters),
                u64::from(iters / 10),
                u64::from(coop),
                out.ptr,
            ],
            &[4, 8, 8, 8, 8, 8, 4, 4, 4, 8],
        )?;
        v.push(read_ns(out)? as f64 / f64::from(iters) / 1000.0);
    }
    Ok(median(v))
}

/// Launches with raw values (`sizes[i]` bytes each, little-endian) and waits.
fn launch_sync(
    f: &Function,
    stream: &Stream,
    block: u32,
    vals: &mut [u64],
    sizes: &[usize],
) -> Result<()> {
    let mut u32s: Vec<u32> = vals.iter().map(|&v| v as u32).collect();
    let mut params: Vec<*mut std::ffi::c_void> = Vec::with_capacity(vals.len());
    for (i, &s) in sizes.iter().enumerate() {
        params.push(if s == 4 {
            (&raw mut u32s[i]).cast()
        } else {
            (&raw mut vals[i]).cast()
        });
    }
    // SAFETY: the values match the floor kernels' parameter lists in
    // selftest.cu (sizes given per parameter) and outlive the launch.
    unsafe { f.launch(stream, 1, block, &mut params)? };
    stream.sync()?;
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn proxy_floor(
    c: &CudaComm<'_>,
    m: &Module,
    stream: &Stream,
    src: &cuda::GpuWindow,
    dst: &cuda::GpuWindow,
    flags: &cuda::GpuWindow,
    out: &DevMem,
    bytes: u64,
    iters: u32,
    runs: usize,
) -> Result<(f64, f64, f64)> {
    let f = m.function("gin_floor_proxy")?;
    let (rank, peer) = (c.comm().rank(), c.comm().rank() ^ 1);
    let host = HostMem::new(64)?;
    let copy = Stream::new()?;
    let mut v = Vec::with_capacity(runs);
    for _ in 0..runs {
        flags.local().zero(0, 8)?;
        out.zero(0, 24)?;
        // SAFETY: the mapped allocation is 64 bytes, 8-aligned, and outlives
        // this loop; the kernel writes it, the forwarder reads it.
        let hf = unsafe { &*host.host.cast::<AtomicU64>() };
        hf.store(0, Ordering::Release);
        c.comm().bootstrap().barrier()?;
        let total = u64::from(iters + iters / 10);
        let stop = AtomicBool::new(false);
        let peer_buf = dst.peer_base(peer).unwrap_or(0);
        let peer_flag = flags.peer_base(peer).unwrap_or(0);
        std::thread::scope(|s| -> Result<()> {
            let fwd = s.spawn(|| -> Result<()> {
                c.device().make_current()?;
                let mut last = 0;
                while last < total && !stop.load(Ordering::Relaxed) {
                    let now = hf.load(Ordering::Acquire);
                    if now == last {
                        std::hint::spin_loop();
                    } else {
                        copy.copy(peer_buf, src.local().ptr, bytes as usize)?;
                        copy.write_u64(peer_flag, now)?;
                        last = now;
                    }
                }
                Ok(())
            });
            let r = launch_sync(
                &f,
                stream,
                1,
                &mut [
                    rank as u64,
                    host.dev,
                    flags.local().ptr,
                    u64::from(iters),
                    u64::from(iters / 10),
                    out.ptr,
                ],
                &[4, 8, 8, 4, 4, 8],
            );
            if r.is_err() {
                stop.store(true, Ordering::Relaxed);
            }
            fwd.join()
                .map_err(|_| anyhow::anyhow!("forwarder panicked"))??;
            r
        })?;
        copy.sync()?;
        v.push(read_ns(out)? as f64 / f64::from(iters) / 1000.0);
    }
    Ok(median(v))
}

#[allow(clippy::too_many_arguments)]
fn bandwidth(
    c: &CudaComm<'_>,
    m: &Module,
    kind: BackendKind,
    src: &cuda::GpuWindow,
    dst: &cuda::GpuWindow,
    out: &DevMem,
    bytes: u64,
    blocks: u32,
    runs: usize,
) -> Result<(f64, f64, f64)> {
    let f = m.function("gin_bandwidth")?;
    let req = DevCommRequirements {
        signals: 4,
        counters: 1,
        queue_depth: 1024,
        ..DevCommRequirements::default()
    };
    let dc = c.dev_comm_on(&req, CtxSharing::Gpu, kind)?;
    let iters = 50u32;
    let mut v = Vec::with_capacity(runs);
    for run in 0..runs as u64 {
        c.comm().bootstrap().barrier()?;
        out.zero(0, 24)?;
        dc.run(
            &f,
            blocks,
            512,
            &[
                Arg::DevComm(dc.abi()),
                Arg::Window(src.abi()),
                Arg::Window(dst.abi()),
                Arg::U64(bytes),
                Arg::U32(iters),
                Arg::U64(run * u64::from(iters) * u64::from(blocks)),
                Arg::U64(run),
                Arg::Ptr(out.ptr),
            ],
        )
        .with_context(|| format!("bandwidth with {blocks} blocks"))?;
        let mut o = [0u64; 3];
        out.read(0, &mut o)?;
        if o[0] != 0 {
            bail!("bandwidth kernel returned error kind {}", o[0]);
        }
        if c.comm().rank() == 0 {
            v.push((bytes * u64::from(iters)) as f64 / o[2] as f64);
        } else {
            v.push(0.0);
        }
    }
    c.comm().bootstrap().barrier()?;
    dc.destroy()?;
    Ok(median(v))
}
