//! Host API errors.

/// Everything the host API can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CoreError {
    #[error("{what} is not available: {why} (available: {available})")]
    Unavailable {
        what: String,
        why: String,
        available: String,
    },
    #[error("{0}")]
    Invalid(String),
    /// Ranks gave different values where every rank must give the same
    /// (device communicator requirements): every rank fails alike.
    #[error("rank {rank}: ranks disagree on {what}: {detail}")]
    Mismatch {
        rank: usize,
        what: String,
        detail: String,
    },
    /// A window deregistered a second time.
    #[error("rank {rank}: window {window} is already deregistered")]
    Deregistered { rank: usize, window: u32 },
    /// A requirement beyond what gin-rs supports.
    #[error("rank {rank}: {what} = {asked} exceeds the limit {limit} ({hint})")]
    Limit {
        rank: usize,
        what: String,
        asked: u64,
        limit: u64,
        hint: String,
    },
    #[error(transparent)]
    Space(#[from] crate::space::SpaceError),
    #[error(transparent)]
    Bootstrap(#[from] gin_bootstrap::BootstrapError),
    #[error(transparent)]
    Net(#[from] gin_net::NetError),
    #[error(transparent)]
    Device(#[from] gin_device::GinError),
    #[error("CUDA call {call} failed: {name} ({code}): {text}")]
    Cuda {
        call: &'static str,
        code: i32,
        name: String,
        text: String,
    },
    #[error(
        "rank {rank}: kernel error: {what}{}{} (id or value {value}){}",
        ctx.map(|c| format!(", context {c}")).unwrap_or_default(),
        peer.map(|p| format!(", peer {p}")).unwrap_or_default(),
        if cause.is_empty() { String::new() } else { format!("; cause: {cause}") }
    )]
    Kernel {
        rank: usize,
        what: &'static str,
        ctx: Option<u32>,
        peer: Option<usize>,
        value: u32,
        cause: String,
    },
}
