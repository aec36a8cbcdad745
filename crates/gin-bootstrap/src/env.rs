//! Reading a rank's identity from the launcher's environment, and the
//! bootstrap's own settings. Pure functions over a variable getter, so every
//! launcher's shape is unit-tested without touching the process environment.

use std::net::SocketAddr;
use std::time::Duration;

use crate::error::BootstrapError;
use crate::frame::DEFAULT_MAX_PAYLOAD;
use crate::id::{UniqueId, resolve};

/// Settings every bootstrap call honours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// How long any blocking call waits before failing with a timeout error
    /// that names the ranks that never answered (`GIN_TIMEOUT`).
    pub timeout: Duration,
    /// Largest frame payload accepted from a peer; larger claims are errors.
    pub max_frame: usize,
    /// How long a new connection may take to answer its challenge before it
    /// is dropped as a stranger (`GIN_AUTH_TIMEOUT`). A real rank answers
    /// within microseconds; the limit bounds what a silent stranger costs.
    pub auth_timeout: Duration,
}

/// Generous by default: a slow rank start (a cold GPU context, a busy node)
/// should not fail a job, but a lost rank must fail it eventually.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_mins(5);

/// Default [`Config::auth_timeout`].
pub const DEFAULT_AUTH_TIMEOUT: Duration = Duration::from_secs(2);

impl Default for Config {
    fn default() -> Self {
        Self {
            timeout: DEFAULT_TIMEOUT,
            max_frame: DEFAULT_MAX_PAYLOAD,
            auth_timeout: DEFAULT_AUTH_TIMEOUT,
        }
    }
}

impl Config {
    /// Defaults, with `GIN_TIMEOUT` and `GIN_AUTH_TIMEOUT` applied when set.
    pub fn from_env() -> Result<Self, BootstrapError> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// Like [`Config::from_env`] over any variable source.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self, BootstrapError> {
        let mut c = Self::default();
        if let Some(t) = get("GIN_TIMEOUT") {
            c.timeout = parse_duration(&t)
                .map_err(|why| BootstrapError::Env(format!("GIN_TIMEOUT={t:?}: {why}")))?;
        }
        if let Some(t) = get("GIN_AUTH_TIMEOUT") {
            c.auth_timeout = parse_duration(&t)
                .map_err(|why| BootstrapError::Env(format!("GIN_AUTH_TIMEOUT={t:?}: {why}")))?;
        }
        Ok(c)
    }
}

/// Parses `30`, `30s`, `1.5s`, `250ms`, `100us`, `2m` or `1h` (bare numbers are seconds).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num.parse().map_err(|_| {
        format!("expected a number with an optional unit (us, ms, s, m, h), got {t:?}")
    })?;
    let secs = match unit.trim() {
        "" | "s" => v,
        "ms" => v / 1e3,
        "us" | "µs" => v / 1e6,
        "m" | "min" => v * 60.0,
        "h" => v * 3600.0,
        u => return Err(format!("unknown unit {u:?} (use us, ms, s, m or h)")),
    };
    if !secs.is_finite() || secs <= 0.0 || secs > 1e9 {
        return Err(format!("{t:?} is not a usable timeout"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// How this rank finds the job's rendezvous root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rendezvous {
    /// A full unique id (address and secret); someone else runs the root.
    Id(UniqueId),
    /// Only an address is known: rank 0 runs the root there, and the secret is
    /// derived from the launcher's job identity (see [`UniqueId::derived`]).
    RootAddr(UniqueId),
}

impl Rendezvous {
    /// The id every rank uses to connect.
    pub fn id(&self) -> UniqueId {
        match self {
            Self::Id(id) | Self::RootAddr(id) => *id,
        }
    }
}

/// A rank's identity as its launcher described it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// Which launcher's variables were used: `gin`, `torchrun`, `slurm` or `openmpi`.
    pub launcher: &'static str,
    /// This process's rank in the job.
    pub rank: usize,
    /// The job's rank count.
    pub nranks: usize,
    /// Rank among the processes on this host, when the launcher says.
    pub local_rank: Option<usize>,
    /// Processes on this host, when the launcher says.
    pub local_nranks: Option<usize>,
    /// How this rank finds the job's rendezvous root.
    pub rendezvous: Rendezvous,
}

/// The variables whose presence means "a launcher started this process".
pub const RANK_VARS: [&str; 4] = ["GIN_RANK", "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"];

impl LaunchEnv {
    /// True when any launcher's rank variable is set: the process is one rank
    /// of a job rather than a front end that should spawn ranks itself.
    pub fn present(get: impl Fn(&str) -> Option<String>) -> bool {
        RANK_VARS.iter().any(|v| get(v).is_some())
    }

    /// Reads the process environment.
    pub fn from_env() -> Result<Self, BootstrapError> {
        Self::detect(|k| std::env::var(k).ok())
    }

    /// Reads a rank's identity; precedence: `GIN_*`, torchrun, Slurm, Open MPI.
    pub fn detect(get: impl Fn(&str) -> Option<String>) -> Result<Self, BootstrapError> {
        let num = |var: &str| -> Result<Option<usize>, BootstrapError> {
            get(var)
                .map(|v| {
                    v.trim().parse::<usize>().map_err(|_| {
                        BootstrapError::Env(format!("{var}={v:?} is not a non-negative integer"))
                    })
                })
                .transpose()
        };
        let need = |launcher: &str, var: &str, have: &str| -> Result<usize, BootstrapError> {
            num(var)?.ok_or_else(|| {
                BootstrapError::Env(format!("{launcher}: {have} is set but {var} is missing"))
            })
        };
        let (launcher, rank, nranks, local_rank, local_nranks) = if num("GIN_RANK")?.is_some() {
            (
                "gin",
                need("gin", "GIN_RANK", "")?,
                need("gin", "GIN_NRANKS", "GIN_RANK")?,
                num("GIN_LOCAL_RANK")?,
                num("GIN_LOCAL_NRANKS")?,
            )
        } else if num("RANK")?.is_some() {
            (
                "torchrun",
                need("torchrun", "RANK", "")?,
                need("torchrun", "WORLD_SIZE", "RANK")?,
                num("LOCAL_RANK")?,
                num("LOCAL_WORLD_SIZE")?,
            )
        } else if num("SLURM_PROCID")?.is_some() {
            (
                "slurm",
                need("slurm", "SLURM_PROCID", "")?,
                need("slurm", "SLURM_NTASKS", "SLURM_PROCID")?,
                num("SLURM_LOCALID")?,
                num("SLURM_NTASKS_PER_NODE")
                    .ok()
                    .flatten()
                    .or(num("SLURM_TASKS_PER_NODE").ok().flatten()),
            )
        } else if num("OMPI_COMM_WORLD_RANK")?.is_some() {
            (
                "openmpi",
                need("openmpi", "OMPI_COMM_WORLD_RANK", "")?,
                need("openmpi", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")?,
                num("OMPI_COMM_WORLD_LOCAL_RANK")?,
                num("OMPI_COMM_WORLD_LOCAL_SIZE")?,
            )
        } else {
            return Err(BootstrapError::Env(
                "no launcher variables found: set GIN_RANK, GIN_NRANKS and GIN_UNIQUE_ID \
                 (or GIN_ROOT_ADDR), or start the process under torchrun, Slurm or Open MPI"
                    .into(),
            ));
        };
        if nranks == 0 || rank >= nranks {
            return Err(BootstrapError::BadRank { rank, nranks });
        }
        let rendezvous = rendezvous(launcher, nranks, &get)?;
        Ok(Self {
            launcher,
            rank,
            nranks,
            local_rank,
            local_nranks,
            rendezvous,
        })
    }
}

fn rendezvous(
    launcher: &str,
    nranks: usize,
    get: &impl Fn(&str) -> Option<String>,
) -> Result<Rendezvous, BootstrapError> {
    if let Some(text) = get("GIN_UNIQUE_ID") {
        return Ok(Rendezvous::Id(text.parse()?));
    }
    let addr: SocketAddr = if let Some(a) = get("GIN_ROOT_ADDR") {
        resolve(&a).map_err(|why| BootstrapError::Env(format!("GIN_ROOT_ADDR: {why}")))?
    } else if launcher == "torchrun" {
        let host = get("MASTER_ADDR").ok_or_else(|| {
            BootstrapError::Env(
                "torchrun: MASTER_ADDR is missing (or set GIN_UNIQUE_ID / GIN_ROOT_ADDR)".into(),
            )
        })?;
        let port: u16 = get("MASTER_PORT")
            .ok_or_else(|| BootstrapError::Env("torchrun: MASTER_PORT is missing".into()))?
            .trim()
            .parse()
            .map_err(|_| BootstrapError::Env("torchrun: MASTER_PORT is not a port".into()))?;
        // torch's own TCPStore may hold MASTER_PORT; the bootstrap root takes
        // the next port up.
        let port = port.checked_add(1).ok_or_else(|| {
            BootstrapError::Env("torchrun: MASTER_PORT is 65535, no room for the root".into())
        })?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let text = if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        resolve(&text).map_err(|why| BootstrapError::Env(format!("torchrun: {why}")))?
    } else {
        return Err(BootstrapError::Env(format!(
            "{launcher}: found the rank but no rendezvous: set GIN_UNIQUE_ID, or GIN_ROOT_ADDR \
             (an ip:port that rank 0 can listen on and every rank can reach)"
        )));
    };
    let job = get("GIN_JOB_SECRET")
        .or_else(|| get("TORCHELASTIC_RUN_ID"))
        .or_else(|| {
            get("SLURM_JOB_ID").map(|j| format!("{j}.{}", get("SLURM_STEP_ID").unwrap_or_default()))
        })
        .or_else(|| get("PMIX_NAMESPACE"))
        .or_else(|| get("OMPI_MCA_ess_base_jobid"))
        .unwrap_or_default();
    let key = format!("{launcher}/{job}/{addr}/{nranks}");
    Ok(Rendezvous::RootAddr(UniqueId::derived(addr, &key)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |k| m.get(k).cloned()
    }

    const ID: &str = "gin1:000102030405060708090a0b0c0d0e0f@127.0.0.1:4000";

    #[test]
    fn gin_variables() {
        let e = LaunchEnv::detect(vars(&[
            ("GIN_RANK", "2"),
            ("GIN_NRANKS", "4"),
            ("GIN_UNIQUE_ID", ID),
            ("GIN_LOCAL_RANK", "0"),
        ]))
        .unwrap();
        assert_eq!(
            (e.launcher, e.rank, e.nranks, e.local_rank),
            ("gin", 2, 4, Some(0))
        );
        assert_eq!(e.rendezvous, Rendezvous::Id(ID.parse().unwrap()));
    }

    #[test]
    fn torchrun_variables_use_master_port_plus_one() {
        let e = LaunchEnv::detect(vars(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_RUN_ID", "abc"),
        ]))
        .unwrap();
        assert_eq!((e.launcher, e.rank, e.nranks), ("torchrun", 1, 2));
        assert_eq!(e.rendezvous.id().addr, "127.0.0.1:29501".parse().unwrap());
        assert!(matches!(e.rendezvous, Rendezvous::RootAddr(_)));
    }

    #[test]
    fn derived_secret_is_shared_by_ranks_and_differs_between_jobs() {
        let job = |rank: &'static str, run: &'static str| {
            LaunchEnv::detect(vars(&[
                ("RANK", rank),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", "29500"),
                ("TORCHELASTIC_RUN_ID", run),
            ]))
            .unwrap()
            .rendezvous
            .id()
        };
        assert_eq!(job("0", "a"), job("1", "a"));
        assert_ne!(job("0", "a").secret, job("0", "b").secret);
    }

    #[test]
    fn slurm_and_openmpi_need_a_rendezvous() {
        let e =
            LaunchEnv::detect(vars(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")])).unwrap_err();
        assert!(e.to_string().contains("GIN_ROOT_ADDR"), "{e}");
        let e = LaunchEnv::detect(vars(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("GIN_ROOT_ADDR", "127.0.0.1:7000"),
        ]))
        .unwrap();
        assert_eq!(
            (e.launcher, e.rank, e.nranks, e.local_rank),
            ("slurm", 3, 4, Some(1))
        );
        let e = LaunchEnv::detect(vars(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "3"),
            ("GIN_UNIQUE_ID", ID),
        ]))
        .unwrap();
        assert_eq!((e.launcher, e.rank, e.nranks), ("openmpi", 1, 3));
    }

    #[test]
    fn missing_and_bad_variables_are_named() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[], "no launcher variables"),
            (&[("GIN_RANK", "0")], "GIN_NRANKS is missing"),
            (&[("GIN_RANK", "x")], "GIN_RANK=\"x\""),
            (&[("RANK", "0")], "WORLD_SIZE is missing"),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "2")],
                "MASTER_ADDR is missing",
            ),
            (
                &[
                    ("GIN_RANK", "4"),
                    ("GIN_NRANKS", "4"),
                    ("GIN_UNIQUE_ID", ID),
                ],
                "invalid rank 4",
            ),
            (
                &[
                    ("GIN_RANK", "0"),
                    ("GIN_NRANKS", "1"),
                    ("GIN_UNIQUE_ID", "x"),
                ],
                "invalid unique id",
            ),
            (
                &[("OMPI_COMM_WORLD_RANK", "0")],
                "OMPI_COMM_WORLD_SIZE is missing",
            ),
        ];
        for (pairs, want) in cases {
            let e = LaunchEnv::detect(vars(pairs)).unwrap_err().to_string();
            assert!(e.contains(want), "{pairs:?}: {e}");
        }
    }

    #[test]
    fn timeouts_parse_with_units() {
        assert_eq!(parse_duration("30").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("100us").unwrap(), Duration::from_micros(100));
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_mins(2));
        for bad in ["", "s", "-1", "0", "3 parsecs", "nan"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
        let e = Config::from_vars(vars(&[("GIN_TIMEOUT", "soon")])).unwrap_err();
        assert!(e.to_string().contains("GIN_TIMEOUT"), "{e}");
        let c = Config::from_vars(vars(&[("GIN_AUTH_TIMEOUT", "500ms")])).unwrap();
        assert_eq!(c.auth_timeout, Duration::from_millis(500));
        let e = Config::from_vars(vars(&[("GIN_AUTH_TIMEOUT", "0")])).unwrap_err();
        assert!(e.to_string().contains("GIN_AUTH_TIMEOUT"), "{e}");
    }
}
