//! `gin-bench pingpong`: put-with-signal ping-pong between ranks 0 and 1.
//!
//! Rank 0 puts `size` bytes into rank 1's window with a signal increment;
//! rank 1 waits for the signal and puts the same back; each round trip is
//! timed on rank 0, and half of it is one sample. In the same job, a floor
//! is measured the same way without gin-rs: for same-host paths two raw
//! processes copy `size` bytes into a shared segment and bump a flag (at 8
//! bytes this is a cache-line ping-pong); for tcp, a raw TCP ping-pong of
//! `size` bytes.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use gin_core::{Comm, DevCommRequirements, Fence, Local, Remote, Team};
use gin_net::shm::Segment;
use serde::{Deserialize, Serialize};

use crate::ranks;
use crate::stats::Summary;

#[derive(Debug, Clone, Args)]
pub struct PingPongArgs {
    /// Ranks to start (ranks 0 and 1 play; others only join).
    #[arg(long, default_value_t = 2)]
    pub ranks: usize,
    /// auto | proxy (sets GIN_BACKEND for the ranks).
    #[arg(long)]
    pub backend: Option<String>,
    /// auto | shm | tcp (sets GIN_TRANSPORT for the ranks).
    #[arg(long)]
    pub transport: Option<String>,
    /// Message sizes in bytes (k / m suffixes allowed).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "8,64,512,4k,32k,64k,256k,1m,4m"
    )]
    pub sizes: Vec<String>,
    /// Round trips per size at 64 KiB and below (fewer above, at least 50).
    #[arg(long, default_value_t = 2000)]
    pub iters: usize,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

impl PingPongArgs {
    /// The defaults, as if `pingpong` were given with no flags.
    pub fn default_args() -> Self {
        #[derive(clap::Parser)]
        struct P {
            #[command(flatten)]
            a: PingPongArgs,
        }
        <P as clap::Parser>::parse_from(["pingpong"]).a
    }
}

/// Parses `4096`, `4k`, `1m`.
pub fn parse_size(t: &str) -> Result<u64> {
    let t = t.trim().to_ascii_lowercase();
    let (num, mul) = match t.strip_suffix('k') {
        Some(n) => (n, 1 << 10),
        None => match t.strip_suffix('m') {
            Some(n) => (n, 1 << 20),
            None => (t.as_str(), 1),
        },
    };
    let v: u64 = num
        .parse()
        .with_context(|| format!("{t:?} is not a size"))?;
    if v == 0 {
        bail!("sizes must be positive");
    }
    Ok(v * mul)
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SizeResult {
    pub bytes: u64,
    pub iters: usize,
    /// Half round trip, µs.
    pub half_rtt_us: Summary,
    /// bytes / median half round trip, GB/s.
    pub gbps: f64,
    /// The raw floor's half round trip, µs.
    pub floor_us: Summary,
    /// median / floor median.
    pub ratio: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PingPongResult {
    pub ranks: usize,
    pub backend: String,
    pub path: String,
    pub floor: String,
    pub sizes: Vec<SizeResult>,
    /// Peak resident memory of each rank (VmHWM), KiB.
    pub peak_kib: Vec<u64>,
}

pub fn run(args: &PingPongArgs, argv: &[String]) -> Result<()> {
    if args.ranks < 2 {
        bail!("pingpong needs at least 2 ranks");
    }
    let sizes: Vec<u64> = args
        .sizes
        .iter()
        .map(|s| parse_size(s))
        .collect::<Result<_>>()?;
    if ranks::is_rank() {
        return rank_main(args, &sizes);
    }
    let env = ranks::choice_env(args.backend.as_ref(), args.transport.as_ref());
    eprintln!(
        "pingpong: {} ranks, sizes {}..{} B, up to {} round trips per size...",
        args.ranks,
        sizes.iter().min().unwrap_or(&0),
        sizes.iter().max().unwrap_or(&0),
        args.iters
    );
    let r: PingPongResult = ranks::spawn_self(args.ranks, argv, &env)?;
    print_table(&r);
    ranks::write_json(args.json.as_ref(), &r)
}

fn human(b: u64) -> String {
    if b >= 1 << 20 && b.is_multiple_of(1 << 20) {
        format!("{} MiB", b >> 20)
    } else if b >= 1 << 10 && b.is_multiple_of(1 << 10) {
        format!("{} KiB", b >> 10)
    } else {
        format!("{b} B")
    }
}

fn print_table(r: &PingPongResult) {
    println!(
        "put-with-signal ping-pong, {} ranks, backend {}, path rank 0 -> 1: {}; floor: {}",
        r.ranks, r.backend, r.path, r.floor
    );
    println!(
        "{:>8}  {:>11} {:>10} {:>9}  {:>11}  {:>8}",
        "size", "median µs", "p99 µs", "GB/s", "floor µs", "vs floor"
    );
    for s in &r.sizes {
        println!(
            "{:>8}  {:>11.3} {:>10.3} {:>9.3}  {:>11.3}  {:>7.2}x",
            human(s.bytes),
            s.half_rtt_us.median,
            s.half_rtt_us.p99,
            s.gbps,
            s.floor_us.median,
            s.ratio
        );
    }
    let mem: Vec<String> = r
        .peak_kib
        .iter()
        .enumerate()
        .map(|(i, k)| format!("rank {i} {:.1} MiB", *k as f64 / 1024.0))
        .collect();
    println!(
        "(half round trips; medians and p99 over every round trip) peak memory: {}",
        mem.join(", ")
    );
}

fn peak_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

fn rank_main(args: &PingPongArgs, sizes: &[u64]) -> Result<()> {
    let comm = Comm::from_env()?;
    let (r, n) = (comm.rank(), comm.nranks());
    let max = sizes.iter().copied().max().unwrap_or(8);
    let win = comm.alloc_window(max)?;
    let src = comm.alloc_window(max)?;
    src.write(0, &vec![r as u8; max as usize])?;
    let dc = comm.dev_comm(&DevCommRequirements::default())?;
    let ctx = dc.ctx(0)?;
    // Rank 0's view of its path to rank 1 decides, for every rank.
    let mine = if r == 0 { comm.path_names()[1] } else { "" };
    let path = String::from_utf8(comm.bootstrap().broadcast(0, mine.as_bytes())?)?;
    let direct = r == 0 && dc.is_direct(1);
    let tcp_floor = path == "tcp";
    let floor_name = if tcp_floor {
        "raw TCP ping-pong of the same size"
    } else {
        "raw shared-memory copy + flag ping-pong of the same size"
    };
    let mut results = Vec::new();
    let mut signal_seen = 0u64;
    for &size in sizes {
        let iters = ranks::iters_for(args.iters, size);
        let warm = (iters / 10).max(5);
        dc.barrier(Team::World, 0)?.sync(0, Fence::None)?;
        let mut samples = Vec::with_capacity(iters);
        if r <= 1 {
            let peer = 1 - r;
            let put = || {
                ctx.put(
                    peer,
                    &win,
                    0,
                    &src,
                    0,
                    size,
                    Remote::signal_inc(0),
                    Local::None,
                )
            };
            for i in 0..warm + iters {
                let t = Instant::now();
                if r == 0 {
                    put()?;
                    signal_seen = ctx.wait_signal(0, signal_seen + 1)?;
                } else {
                    signal_seen = ctx.wait_signal(0, signal_seen + 1)?;
                    put()?;
                }
                if i >= warm {
                    samples.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
                }
            }
            ctx.flush()?;
        }
        let floor = if r <= 1 {
            if tcp_floor {
                tcp_floor_run(&comm, size, warm, iters)?
            } else {
                shm_floor_run(&comm, size, warm, iters)?
            }
        } else {
            // Spectators take part in the floor's exchanges only.
            if tcp_floor {
                comm.bootstrap().allgather(&[])?;
            } else {
                comm.bootstrap().allgather(&[])?;
                comm.bootstrap().barrier()?;
            }
            Vec::new()
        };
        if r == 0 {
            let h = Summary::of(&samples).context("no samples")?;
            let f = Summary::of(&floor).context("no floor samples")?;
            results.push(SizeResult {
                bytes: size,
                iters,
                gbps: size as f64 / (h.median * 1e3),
                ratio: h.median / f.median,
                half_rtt_us: h,
                floor_us: f,
            });
        }
    }
    dc.barrier(Team::World, 0)?.sync(0, Fence::Context)?;
    let peaks = comm.bootstrap().allgather(&peak_kib().to_le_bytes())?;
    if r == 0 {
        let backend = if direct {
            "auto (direct load/store)".to_owned()
        } else {
            format!(
                "{} ({})",
                dc.backend_name(),
                std::env::var("GIN_BACKEND").unwrap_or_else(|_| "auto".into())
            )
        };
        ranks::emit(&PingPongResult {
            ranks: n,
            backend,
            path,
            floor: floor_name.to_owned(),
            sizes: results,
            peak_kib: peaks
                .iter()
                .map(|p| u64::from_le_bytes(p.as_slice().try_into().unwrap_or([0; 8])))
                .collect(),
        })?;
    }
    dc.destroy()?;
    Ok(())
}

/// Two raw processes: copy `size` bytes into the other's half of a shared
/// segment, then bump its flag; wait for the answer. Half round trips, µs.
fn shm_floor_run(comm: &Comm, size: u64, warm: usize, iters: usize) -> Result<Vec<f64>> {
    let r = comm.rank();
    let len = 256 + 2 * size as usize;
    let name = format!("gin-floor-{}-{}-{size}", std::process::id(), r);
    let own = if r == 0 {
        Some(Segment::create(&name, len)?)
    } else {
        None
    };
    let path = own
        .as_ref()
        .map(|s| s.path().to_string_lossy().into_owned())
        .unwrap_or_default();
    let all = comm.bootstrap().allgather(path.as_bytes())?;
    let seg = match own {
        Some(s) => s,
        None => Segment::open(std::path::Path::new(std::str::from_utf8(&all[0])?), len)?,
    };
    comm.bootstrap().barrier()?;
    let base = seg.as_ptr();
    // SAFETY: the segment is `len` bytes: flags at 0 and 128 (aligned), data
    // halves at 256 and 256 + size. Flags are only touched atomically.
    let (flag_to, flag_from, dst) = unsafe {
        let f0 = &*base.cast::<AtomicU64>();
        let f1 = &*base.add(128).cast::<AtomicU64>();
        let d0 = base.add(256);
        let d1 = base.add(256 + size as usize);
        if r == 0 { (f1, f0, d1) } else { (f0, f1, d0) }
    };
    let src = vec![r as u8; size as usize];
    let mut out = Vec::with_capacity(iters);
    for i in 1..=(warm + iters) as u64 {
        let t = Instant::now();
        if r == 1 {
            while flag_from.load(Ordering::Acquire) != i {
                std::hint::spin_loop();
            }
        }
        // SAFETY: `dst` has `size` bytes of the peer's half.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, size as usize) };
        flag_to.store(i, Ordering::Release);
        if r == 0 {
            while flag_from.load(Ordering::Acquire) != i {
                std::hint::spin_loop();
            }
        }
        if i as usize > warm {
            out.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
        }
    }
    Ok(out)
}

/// A raw TCP ping-pong of `size` bytes between ranks 0 and 1.
fn tcp_floor_run(comm: &Comm, size: u64, warm: usize, iters: usize) -> Result<Vec<f64>> {
    let r = comm.rank();
    let ip = comm.bootstrap().listen_addr().ip();
    let listener = if r == 1 {
        Some(TcpListener::bind((ip, 0))?)
    } else {
        None
    };
    let addr = listener
        .as_ref()
        .map(|l| l.local_addr().map(|a| a.to_string()))
        .transpose()?
        .unwrap_or_default();
    let all = comm.bootstrap().allgather(addr.as_bytes())?;
    let mut s = match listener {
        Some(l) => l.accept()?.0,
        None => TcpStream::connect(std::str::from_utf8(&all[1])?)?,
    };
    s.set_nodelay(true)?;
    let mut buf = vec![r as u8; size as usize];
    let mut out = Vec::with_capacity(iters);
    for i in 0..warm + iters {
        let t = Instant::now();
        if r == 0 {
            s.write_all(&buf)?;
            s.read_exact(&mut buf)?;
        } else {
            s.read_exact(&mut buf)?;
            s.write_all(&buf)?;
        }
        if i >= warm {
            out.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("8").unwrap(), 8);
        assert_eq!(parse_size("4k").unwrap(), 4096);
        assert_eq!(parse_size("4M").unwrap(), 4 << 20);
        assert!(parse_size("0").is_err());
        assert!(parse_size("lots").is_err());
    }
}
