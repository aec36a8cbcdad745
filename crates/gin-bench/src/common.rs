//! The flags every multi-rank benchmark shares, in one struct that each
//! subcommand flattens into its own (`#[command(flatten)]`).
//!
//! Defaults that differ per subcommand (sizes, iterations, rank counts) are
//! not set here: each subcommand sets them with `mut_arg(..., default_value)`,
//! so `--help` shows the real default and a subcommand that forgets one fails
//! to parse instead of silently inheriting another's.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};

/// Where ranks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    /// CPU ranks: the device API as ordinary Rust on host threads.
    Cpu,
    /// CUDA ranks, one GPU each: kernels that include `gin/gin.cuh`
    /// (`pingpong` and `bandwidth`; they run `gin-bench cuda`'s measurements).
    Cuda,
}

/// Who cooperates in one call on a GPU. CPU ranks run every kind as the
/// calling thread alone: accepted and recorded so that CPU and CUDA results
/// line up in reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Coop {
    Thread,
    Warp,
    Block,
}

/// Where rank threads run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Bind {
    /// Local rank i's thread on allowed CPU i mod count; helper threads
    /// (proxy, soft NIC) stay free.
    Spread,
    /// Every rank thread on the first allowed CPU, helpers free: what
    /// `loggp` uses to measure the cost of handing a core between ranks.
    Shared,
    /// Wherever the scheduler puts them.
    None,
}

/// `GIN_BACKEND` for the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    Auto,
    Proxy,
    Gdaki,
}

/// `GIN_TRANSPORT` for the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    Auto,
    Shm,
    Tcp,
    /// UCX's UCP API (`GIN_UCX_LIB`, `UCX_TLS`); the floor is
    /// `ucx_perftest` from the same library.
    Ucx,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Auto => "auto",
            Backend::Proxy => "proxy",
            Backend::Gdaki => "gdaki",
        }
    }
}

impl Transport {
    pub fn name(self) -> &'static str {
        match self {
            Transport::Auto => "auto",
            Transport::Shm => "shm",
            Transport::Tcp => "tcp",
            Transport::Ucx => "ucx",
        }
    }
}

/// Flags shared by `pingpong`, `bandwidth`, `rate`, `alltoall` and `loggp`.
#[derive(Debug, Clone, Args, Serialize, Deserialize)]
pub struct Common {
    /// Rank counts (comma separated; pingpong, bandwidth and rate take one).
    #[arg(long, value_delimiter = ',')]
    pub ranks: Vec<usize>,
    /// Backend for the ranks (sets GIN_BACKEND; default: the environment's, else auto).
    #[arg(long, value_enum)]
    pub backend: Option<Backend>,
    /// Transport for the ranks (sets GIN_TRANSPORT; default: the environment's, else auto).
    #[arg(long, value_enum)]
    pub transport: Option<Transport>,
    /// Where ranks run.
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    pub device: Device,
    /// Message sizes in bytes, comma separated (k / m suffixes allowed).
    #[arg(long, value_delimiter = ',', value_parser = parse_size)]
    pub sizes: Vec<u64>,
    /// Iterations per run at 64 KiB and below (fewer above, at least 50).
    #[arg(long)]
    pub iters: usize,
    /// Untimed iterations before each size (default: a tenth of --iters, at least 5).
    #[arg(long)]
    pub warmup: Option<usize>,
    /// Runs per point: every row reports the median and p10/p90/p99 over them.
    #[arg(long)]
    pub runs: usize,
    /// Who cooperates in one call (CUDA only; recorded for CPU ranks).
    #[arg(long, value_enum, default_value_t = Coop::Thread)]
    pub coop: Coop,
    /// Restrict every rank process to these CPUs (comma separated;
    /// overrides --bind). `loggp` uses one CPU to measure what
    /// time-sharing a core costs.
    #[arg(long, value_delimiter = ',')]
    pub cpus: Vec<usize>,
    /// Rank threads spread over the CPUs (so that two ranks never share a
    /// core while another idles: a waker's CPU is where Linux tends to put
    /// the woken), or left to the scheduler.
    #[arg(long, value_enum, default_value_t = Bind::Spread)]
    pub bind: Bind,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Also write the main table as CSV to this file.
    #[arg(long)]
    pub csv: Option<PathBuf>,
}

/// Parses `4096`, `4k`, `1m`: positive byte counts.
pub fn parse_size(t: &str) -> Result<u64> {
    let t = t.trim().to_ascii_lowercase();
    let (num, shift) = match t.strip_suffix('k') {
        Some(n) => (n, 10),
        None => match t.strip_suffix('m') {
            Some(n) => (n, 20),
            None => (t.as_str(), 0),
        },
    };
    let v: u64 = num
        .parse()
        .with_context(|| format!("{t:?} is not a size"))?;
    if v == 0 {
        bail!("sizes must be positive");
    }
    v.checked_mul(1 << shift)
        .with_context(|| format!("{t:?} is too large"))
}

/// `4 KiB`, `1 MiB`, `12 B`: sizes as tables show them.
pub fn human_size(b: u64) -> String {
    if b >= 1 << 20 && b.is_multiple_of(1 << 20) {
        format!("{} MiB", b >> 20)
    } else if b >= 1 << 10 && b.is_multiple_of(1 << 10) {
        format!("{} KiB", b >> 10)
    } else {
        format!("{b} B")
    }
}

impl Common {
    /// Checks what every subcommand needs, before any rank starts.
    pub fn validate(&self, subcommand: &str) -> Result<()> {
        if self.device == Device::Cuda {
            bail!(
                "--device cuda: {subcommand} runs CPU ranks only; on GPUs, pingpong and bandwidth \
                 take --device cuda, and `gin-bench cuda` runs the ping-pong, bandwidth and all-to-all \
                 (with its LogGP prediction) with every coop and path"
            );
        }
        if self.iters == 0 || self.runs == 0 {
            bail!("--iters and --runs must be positive");
        }
        if self.sizes.is_empty() {
            bail!("--sizes needs at least one size");
        }
        if self.ranks.is_empty() || self.ranks.contains(&0) {
            bail!("--ranks needs positive rank counts");
        }
        let cores = std::thread::available_parallelism().map_or(usize::MAX, usize::from);
        if let Some(&c) = self.cpus.iter().find(|&&c| c >= cores.min(1024)) {
            bail!(
                "--cpus {c}: this machine has CPUs 0..{}",
                cores.saturating_sub(1)
            );
        }
        Ok(())
    }

    /// The single rank count of a point-to-point benchmark (ranks 0 and 1
    /// play; any others only join the collectives).
    pub fn one_rank_count(&self, subcommand: &str) -> Result<usize> {
        match self.ranks.as_slice() {
            [n] if *n >= 2 => Ok(*n),
            [n] => bail!("{subcommand} needs at least 2 ranks, got --ranks {n}"),
            _ => bail!(
                "{subcommand} takes one rank count, got --ranks {:?}",
                self.ranks
            ),
        }
    }

    /// Untimed iterations before a point of `iters` timed ones.
    pub fn warmup_for(&self, iters: usize) -> usize {
        self.warmup.unwrap_or((iters / 10).max(5))
    }

    /// The environment that selects backend and transport for the ranks.
    pub fn env(&self) -> Vec<(String, String)> {
        let mut env = Vec::new();
        if let Some(b) = self.backend {
            env.push(("GIN_BACKEND".to_owned(), b.name().to_owned()));
        }
        if let Some(t) = self.transport {
            env.push(("GIN_TRANSPORT".to_owned(), t.name().to_owned()));
        }
        env
    }

    /// `backend/transport` as the ranks will see it: the flag, else the
    /// environment, else `auto`.
    pub fn path_label(&self) -> String {
        let b = self.backend.map_or_else(
            || std::env::var("GIN_BACKEND").unwrap_or_else(|_| "auto".into()),
            |b| b.name().to_owned(),
        );
        let t = self.transport.map_or_else(
            || std::env::var("GIN_TRANSPORT").unwrap_or_else(|_| "auto".into()),
            |t| t.name().to_owned(),
        );
        format!("{b}/{t}")
    }
}

/// In a rank: restricts this process to `cpus` (`--cpus`; nothing when
/// empty). A free function, not a method of [`Common`], so that the options
/// stay plain data (serde-derived types carry no unsafe code).
pub fn apply_affinity(cpus: &[usize]) -> Result<()> {
    if cpus.is_empty() {
        return Ok(());
    }
    if let Some(&c) = cpus.iter().find(|&&c| c >= libc::CPU_SETSIZE as usize) {
        bail!("--cpus {c} is beyond what sched_setaffinity accepts");
    }
    // SAFETY: cpu_set_t is plain data and zeroed is the empty set; CPU_SET
    // writes within it (every index is below CPU_SETSIZE, checked above);
    // sched_setaffinity reads size_of::<cpu_set_t>() bytes of it.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &raw const set)
    };
    if rc != 0 {
        bail!(
            "sched_setaffinity({:?}): {}",
            cpus,
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

/// CPUs this thread may run on now.
fn allowed_cpus() -> Result<Vec<usize>> {
    // SAFETY: cpu_set_t is plain data; sched_getaffinity writes at most
    // size_of::<cpu_set_t>() bytes into it; CPU_ISSET reads within it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &raw mut set) != 0 {
            bail!("sched_getaffinity: {}", std::io::Error::last_os_error());
        }
        Ok((0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect())
    }
}

/// In a rank, after its communicator and helper threads exist: binds the
/// calling (rank) thread per `--bind`, unless `--cpus` already pinned the
/// whole process. Only this thread moves: Linux applies affinity per
/// thread, so the helpers started before keep every CPU.
pub fn bind_rank_thread(c: &Common, local_rank: usize) -> Result<()> {
    if !c.cpus.is_empty() || c.bind == Bind::None {
        return Ok(());
    }
    let allowed = allowed_cpus()?;
    if allowed.is_empty() {
        return Ok(());
    }
    let set_thread = |cpu: usize| -> Result<()> {
        // SAFETY: as in apply_affinity; `cpu` comes from the allowed set,
        // so it is below CPU_SETSIZE. Thread id 0 is the calling thread.
        let rc = unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &raw const set)
        };
        if rc != 0 {
            bail!(
                "binding rank {local_rank} to CPU {cpu}: {}",
                std::io::Error::last_os_error()
            );
        }
        Ok(())
    };
    match c.bind {
        Bind::Shared => set_thread(allowed[0]),
        _ => set_thread(allowed[spread_cpu(local_rank, allowed.len())]),
    }
}

/// Index of the CPU local rank `r` gets among `n` allowed ones.
pub fn spread_cpu(r: usize, n: usize) -> usize {
    r % n.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("8").unwrap(), 8);
        assert_eq!(parse_size(" 4k").unwrap(), 4096);
        assert_eq!(parse_size("4M").unwrap(), 4 << 20);
        assert!(parse_size("0").is_err());
        assert!(parse_size("lots").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("k").is_err());
        assert!(parse_size("18446744073709551615m").is_err());
    }

    #[test]
    fn sizes_print() {
        assert_eq!(human_size(8), "8 B");
        assert_eq!(human_size(4096), "4 KiB");
        assert_eq!(human_size(4 << 20), "4 MiB");
        assert_eq!(human_size(1500), "1500 B");
        assert_eq!(human_size((1 << 20) + 1024), "1025 KiB");
    }

    #[test]
    fn spread_is_round_robin() {
        assert_eq!(
            (0..5).map(|r| spread_cpu(r, 2)).collect::<Vec<_>>(),
            [0, 1, 0, 1, 0]
        );
        assert_eq!(spread_cpu(3, 0), 0);
    }

    proptest::proptest! {
        /// Spreading keeps every rank on an allowed CPU and balances them:
        /// no two CPUs differ by more than one rank.
        #[test]
        fn spread_balances(ranks in 1usize..300, n in 1usize..64) {
            let mut load = vec![0usize; n];
            for r in 0..ranks {
                let c = spread_cpu(r, n);
                proptest::prop_assert!(c < n);
                load[c] += 1;
            }
            let (lo, hi) = (load.iter().min().unwrap(), load.iter().max().unwrap());
            proptest::prop_assert!(hi - lo <= 1);
        }

        /// Printing then parsing gives the size back (for sizes the table
        /// prints as B, KiB or MiB).
        #[test]
        fn human_size_round_trips(v in 1u64..(1 << 40)) {
            let h = human_size(v);
            let t = h.replace(" MiB", "m").replace(" KiB", "k").replace(" B", "");
            proptest::prop_assert_eq!(parse_size(&t).unwrap(), v);
        }
    }
}
