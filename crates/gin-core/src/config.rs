//! Settings from the environment: backend, transport, host identity, sizes.

use std::time::Duration;

use gin_cuda::Device;
use gin_device::HostBackend;
use gin_gdaki::GdakiBackend;
use gin_net::Fabric;
use gin_proxy::ProxyBackend;

use crate::error::CoreError;

/// `GIN_BACKEND`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    /// The fastest correct path: direct load/store for same-host peers,
    /// the proxy for the rest.
    Auto,
    /// Everything through the proxy (also same-host traffic).
    Proxy,
    /// GPU-initiated mlx5 work requests.
    Gdaki,
}

/// What a [`BackendKind`] selects, once: the rest of gin-core starts and
/// asks the backend through [`HostBackend`] and never matches on kinds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Selection {
    /// Peers whose memory is mapped here are reached by load/store
    /// (`auto`), as far as the rank's kind of memory allows; every other
    /// peer through [`Selection::queues`].
    pub(crate) load_store: bool,
    /// The backend serving the peers not reached by load/store.
    pub(crate) queues: &'static dyn HostBackend<Fabric, Device>,
    /// Its requests are executed by the NIC `GIN_NIC` names, which must
    /// exist here ([`Settings::check_nic`]).
    pub(crate) nic: bool,
}

impl BackendKind {
    /// The one table from kinds to backends: `auto` is load/store where
    /// mapped and the proxy elsewhere, `proxy` the proxy for every peer but
    /// this rank, `gdaki` GDAKI for every peer but this rank.
    pub(crate) fn selection(self) -> Selection {
        let (load_store, queues, nic): (bool, &'static dyn HostBackend<Fabric, Device>, bool) =
            match self {
                Self::Auto => (true, &ProxyBackend, false),
                Self::Proxy => (false, &ProxyBackend, false),
                Self::Gdaki => (false, &GdakiBackend, true),
            };
        Selection {
            load_store,
            queues,
            nic,
        }
    }

    /// The backend's name in messages, and the range of queue depths it
    /// accepts (`DevCommRequirements::queue_depth`), on CPU and CUDA ranks
    /// alike. `auto` queues through the proxy.
    pub fn queue_depths(self) -> (&'static str, std::ops::RangeInclusive<u32>) {
        let b = self.selection().queues;
        (b.name(), b.queue_depths())
    }

    /// log2 of the queue a requested `depth` becomes (rounded up to a power
    /// of two), or an error naming the depth, the backend and its limit.
    /// Never raised or lowered silently.
    pub fn queue_log2(self, depth: u32) -> Result<u32, CoreError> {
        let b = self.selection().queues;
        b.queue_log2(depth).ok_or_else(|| {
            let range = b.queue_depths();
            CoreError::QueueDepth {
                backend: b.name(),
                asked: depth,
                min: *range.start(),
                max: *range.end(),
            }
        })
    }
}

/// `GIN_TRANSPORT`: `auto`, or the name of a transport registered in
/// gin-net (`gin_net::transport::REGISTRY`; today `shm`, `tcp` and `ucx`),
/// so a new transport needs no change here.
///
/// Peers on other hosts may be given a transport of their own with
/// `GIN_TRANSPORT_REMOTE` (`gin_net::transport::REMOTE_ENV`), which gin-net
/// reads when the fabric starts (`gin_net::transport::select`) and which
/// overrides this choice across hosts only: `GIN_TRANSPORT=auto
/// GIN_TRANSPORT_REMOTE=ucx` is shared memory within a host and UCX across
/// hosts. Unset, empty or `auto`, it leaves this choice for every peer. A
/// host-only transport (`shm`) left to reach peers on other hosts (named
/// by `GIN_TRANSPORT` without `GIN_TRANSPORT_REMOTE`, or by
/// `GIN_TRANSPORT_REMOTE`) is an error naming the ranks it cannot reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TransportKind {
    /// Within a host the first host-scope transport (shared memory), across
    /// hosts the first any-scope one (TCP), unless `GIN_TRANSPORT_REMOTE`
    /// names another for peers on other hosts.
    Auto,
    /// Every peer through the transport of this name, except peers on
    /// other hosts where `GIN_TRANSPORT_REMOTE` names another.
    Named(&'static str),
}

impl TransportKind {
    /// Shared memory only (every rank on one host).
    pub const SHM: Self = Self::Named("shm");
    /// TCP for every peer, also on one host.
    pub const TCP: Self = Self::Named("tcp");

    /// The transport's name, `None` for auto.
    pub fn name(self) -> Option<&'static str> {
        match self {
            Self::Auto => None,
            Self::Named(n) => Some(n),
        }
    }
}

/// Which NIC executes GDAKI work requests (`GIN_NIC`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NicKind {
    /// soft-mlx5: a thread executes the WQEs (CPU ranks: over gin-net; CUDA
    /// ranks: with the copy engine).
    #[default]
    Soft,
    /// A ConnectX through rdma-core, loaded at run time (not built beyond
    /// discovery: asking for it is an error that names what is missing).
    Mlx5,
}

/// Communicator settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// The network backend (`GIN_BACKEND`).
    pub backend: BackendKind,
    /// The transport between ranks (`GIN_TRANSPORT`; peers on other hosts
    /// may have `GIN_TRANSPORT_REMOTE`'s instead, see [`TransportKind`]).
    pub transport: TransportKind,
    /// Ranks with equal host ids share a host (`GIN_HOSTID`, else hostname
    /// and boot id).
    pub host_id: String,
    /// Timeout of every wait (`GIN_TIMEOUT`).
    pub timeout: Duration,
    /// Signal slots per rank (`GIN_SIGNAL_SLOTS`): the id space all device
    /// communicators share.
    pub signal_slots: u64,
    /// Counter slots per rank (`GIN_COUNTER_SLOTS`).
    pub counter_slots: u64,
    /// How long an idle proxy polls before sleeping (`GIN_PROXY_SPIN`,
    /// default 100 µs): latency against CPU left to the ranks.
    pub proxy_spin: Duration,
    /// GDAKI: ring the doorbell once this many WQEs are ready
    /// (`GIN_GDAKI_BATCH`, default 1: every request; flushes always ring).
    pub gdaki_batch: u64,
    /// The NIC behind `GIN_BACKEND=gdaki` (`GIN_NIC=soft|mlx5`).
    pub nic: NicKind,
}

impl Settings {
    /// Fails unless what `sel` needs exists here: the NIC, for a backend
    /// whose requests a NIC executes.
    pub(crate) fn check_usable(&self, sel: &Selection) -> Result<(), CoreError> {
        if sel.nic { self.check_nic() } else { Ok(()) }
    }

    /// Fails unless the NIC asked for exists here: `GIN_NIC=mlx5` probes
    /// rdma-core and reports what is missing (the library, a device, or the
    /// devx queue set-up, which is not built).
    pub fn check_nic(&self) -> Result<(), CoreError> {
        match self.nic {
            NicKind::Soft => Ok(()),
            NicKind::Mlx5 => match gin_gdaki::mlx5::open() {
                Ok(never) => match never {},
                Err(e) => Err(CoreError::Unavailable {
                    what: "GIN_NIC=mlx5".into(),
                    why: e.to_string(),
                    available: "GIN_NIC=soft (soft-mlx5 runs the same WQEs)".into(),
                }),
            },
        }
    }

    /// Reads the process environment.
    pub fn from_env() -> Result<Self, CoreError> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// Reads settings from any variable source.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self, CoreError> {
        let backend = match get("GIN_BACKEND").as_deref().map(str::trim) {
            None | Some("" | "auto") => BackendKind::Auto,
            Some("proxy") => BackendKind::Proxy,
            Some("gdaki") => BackendKind::Gdaki,
            Some(other) => {
                return Err(CoreError::Unavailable {
                    what: format!("GIN_BACKEND={other}"),
                    why: "unknown backend".into(),
                    available: "auto, proxy, gdaki".into(),
                });
            }
        };
        let transport = match get("GIN_TRANSPORT").as_deref().map(str::trim) {
            None | Some("" | "auto") => TransportKind::Auto,
            Some(other) => match gin_net::transport::find(other) {
                Ok(r) => TransportKind::Named(r.name),
                Err(_) => {
                    return Err(CoreError::Unavailable {
                        what: format!("GIN_TRANSPORT={other}"),
                        why: "unknown transport".into(),
                        available: std::iter::once("auto")
                            .chain(gin_net::transport::names())
                            .collect::<Vec<_>>()
                            .join(", "),
                    });
                }
            },
        };
        let nic = match get("GIN_NIC").as_deref().map(str::trim) {
            None | Some("" | "soft") => NicKind::Soft,
            Some("mlx5") => NicKind::Mlx5,
            Some(other) => {
                return Err(CoreError::Unavailable {
                    what: format!("GIN_NIC={other}"),
                    why: "unknown NIC".into(),
                    available: "soft, mlx5".into(),
                });
            }
        };
        // A NIC only executes GDAKI work requests: asking for one with
        // another backend would be silently ignored.
        if nic == NicKind::Mlx5 && backend != BackendKind::Gdaki {
            return Err(CoreError::Unavailable {
                what: "GIN_NIC=mlx5".into(),
                why: format!(
                    "the NIC executes GDAKI work requests only, and GIN_BACKEND is {}",
                    match backend {
                        BackendKind::Auto => "auto",
                        BackendKind::Proxy => "proxy",
                        BackendKind::Gdaki => "gdaki",
                    }
                ),
                available: "GIN_BACKEND=gdaki with GIN_NIC=mlx5, or GIN_NIC unset".into(),
            });
        }
        let host_id = get("GIN_HOSTID").unwrap_or_else(gin_bootstrap::topology::default_host_id);
        let timeout = gin_bootstrap::Config::from_vars(&get)?.timeout;
        let slots = |var: &'static str, default: u64| -> Result<u64, CoreError> {
            get(var).map_or(Ok(default), |v| {
                v.trim()
                    .parse::<u64>()
                    .ok()
                    .filter(|&n| n > 0 && n <= 1 << 31)
                    .ok_or_else(|| CoreError::Setting {
                        var,
                        value: v.clone(),
                        why: "not a slot count in 1..=2^31".into(),
                    })
            })
        };
        Ok(Self {
            backend,
            transport,
            host_id,
            timeout,
            signal_slots: slots("GIN_SIGNAL_SLOTS", 1 << 16)?,
            counter_slots: slots("GIN_COUNTER_SLOTS", 1 << 16)?,
            proxy_spin: match get("GIN_PROXY_SPIN") {
                Some(v) => gin_bootstrap::parse_duration(&v).map_err(|why| CoreError::Setting {
                    var: "GIN_PROXY_SPIN",
                    value: v.clone(),
                    why,
                })?,
                None => Duration::from_micros(100),
            },
            gdaki_batch: slots("GIN_GDAKI_BATCH", 1)?,
            nic,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| (*v).to_owned())
        }
    }

    #[test]
    fn each_kind_selects_one_backend_through_which_its_depths_are_known() {
        let table: Vec<_> = [BackendKind::Auto, BackendKind::Proxy, BackendKind::Gdaki]
            .into_iter()
            .map(|k| {
                let s = k.selection();
                (s.load_store, s.queues.name(), s.nic)
            })
            .collect();
        assert_eq!(
            table,
            [
                (true, "proxy", false),
                (false, "proxy", false),
                (false, "gdaki", true),
            ]
        );
        assert_eq!(
            BackendKind::Auto.queue_depths(),
            (
                "proxy",
                gin_proxy::MIN_QUEUE_DEPTH..=gin_proxy::MAX_QUEUE_DEPTH
            )
        );
        assert_eq!(
            BackendKind::Gdaki.queue_depths(),
            (
                "gdaki",
                gin_gdaki::MIN_QUEUE_DEPTH..=gin_gdaki::MAX_QUEUE_DEPTH
            )
        );
        // Only a NIC-executed backend needs the NIC: GIN_NIC=mlx5 fails
        // for gdaki here (no ConnectX), never for the proxy.
        let s =
            Settings::from_vars(vars(&[("GIN_NIC", "mlx5"), ("GIN_BACKEND", "gdaki")])).unwrap();
        s.check_usable(&BackendKind::Proxy.selection()).unwrap();
        assert!(s.check_usable(&BackendKind::Gdaki.selection()).is_err());
    }
}
