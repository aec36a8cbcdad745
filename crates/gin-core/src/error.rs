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
    /// An environment setting that does not parse.
    #[error("{var}={value:?}: {why}")]
    Setting {
        var: &'static str,
        value: String,
        why: String,
    },
    /// A queue depth outside the chosen backend's range
    /// (`DevCommRequirements::queue_depth`).
    #[error(
        "queue depth {asked} {} (DevCommRequirements::queue_depth)",
        if asked < min {
            format!("is below the {backend} backend's minimum {min}")
        } else {
            format!("exceeds the {backend} backend's maximum {max}")
        }
    )]
    QueueDepth {
        backend: &'static str,
        asked: u32,
        min: u32,
        max: u32,
    },
    /// A requirement that can never be met (zero contexts, counts whose sum
    /// overflows).
    #[error("rank {rank}: {what}")]
    Requirement { rank: usize, what: String },
    /// A window handed to a communicator that did not register it.
    #[error("rank {rank}: window {window} belongs to another communicator")]
    ForeignWindow { rank: usize, window: u32 },
    /// Memory handed to gin-rs that is not aligned as it must be.
    #[error("rank {rank}: {what} at {addr:#x} is not {align}-byte aligned")]
    Misaligned {
        rank: usize,
        what: &'static str,
        addr: usize,
        align: usize,
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
    /// What the CUDA host runtime failed with, where no variant above says
    /// it (a driver call failing alone is [`CoreError::Cuda`], CUDA or
    /// NVRTC missing [`CoreError::Unavailable`]).
    #[error(transparent)]
    CudaRuntime(gin_cuda::CudaError),
    /// A rank's allgathered record (of a GPU window, ...) has the wrong
    /// shape: the ranks run different builds, or memory was corrupted.
    #[error("rank {rank} sent a malformed {what} ({got} bytes, expected {expected})")]
    MalformedRecord {
        rank: usize,
        what: String,
        got: usize,
        expected: usize,
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

impl From<gin_cuda::CudaError> for CoreError {
    /// Keeps the variants callers matched before the runtime had its own
    /// crate: a missing driver or NVRTC is [`CoreError::Unavailable`] with
    /// CPU ranks as the alternative, a failing driver call
    /// [`CoreError::Cuda`]; everything else is carried whole.
    fn from(e: gin_cuda::CudaError) -> Self {
        use gin_cuda::CudaError as E;
        match e {
            E::Unavailable { why } => CoreError::Unavailable {
                what: "CUDA".into(),
                why,
                available: "CPU ranks".into(),
            },
            E::NvrtcUnavailable { name, why } => CoreError::Unavailable {
                what: format!("run-time compilation of {name}"),
                why,
                available: "CPU ranks".into(),
            },
            E::Driver(d) => CoreError::Cuda {
                call: d.call,
                code: d.code,
                name: d.name,
                text: d.text,
            },
            other => CoreError::CudaRuntime(other),
        }
    }
}
