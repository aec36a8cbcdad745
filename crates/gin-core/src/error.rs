//! Host API errors.

/// Everything the host API can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CoreError {
    /// A feature, setting or backend that cannot be had here, with what can.
    #[error("{what} is not available: {why} (available: {available})")]
    Unavailable {
        /// What was asked for (for example `"GIN_NIC=mlx5"`, `"CUDA ranks"`).
        what: String,
        /// Why it cannot be had.
        why: String,
        /// What can be used instead.
        available: String,
    },
    /// A failure no variant below names (a backend's own error of a type
    /// gin-core does not know), described in words.
    #[error("{0}")]
    Invalid(String),
    /// Ranks gave different values where every rank must give the same
    /// (device communicator requirements): every rank fails alike.
    #[error("rank {rank}: ranks disagree on {what}: {detail}")]
    Mismatch {
        /// The rank reporting it.
        rank: usize,
        /// The value the ranks disagree on (for example
        /// `"DevCommRequirements::signals"`).
        what: String,
        /// How they differ.
        detail: String,
    },
    /// An environment setting that does not parse.
    #[error("{var}={value:?}: {why}")]
    Setting {
        /// The environment variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What is wrong with it.
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
        /// The backend's name.
        backend: &'static str,
        /// The depth asked for.
        asked: u32,
        /// The backend's smallest depth.
        min: u32,
        /// The backend's largest depth.
        max: u32,
    },
    /// A requirement that can never be met (zero contexts, counts whose sum
    /// overflows).
    #[error("rank {rank}: {what}")]
    Requirement {
        /// The rank that made the call.
        rank: usize,
        /// What cannot be met.
        what: String,
    },
    /// A window handed to a communicator that did not register it.
    #[error("rank {rank}: window {window} belongs to another communicator")]
    ForeignWindow {
        /// The rank that made the call.
        rank: usize,
        /// The window's id.
        window: u32,
    },
    /// Memory handed to gin-rs that is not aligned as it must be.
    #[error("rank {rank}: {what} at {addr:#x} is not {align}-byte aligned")]
    Misaligned {
        /// The rank that made the call.
        rank: usize,
        /// The memory (for example `"window memory"`).
        what: &'static str,
        /// Its address.
        addr: usize,
        /// The alignment required, in bytes.
        align: usize,
    },
    /// A window deregistered a second time.
    #[error("rank {rank}: window {window} is already deregistered")]
    Deregistered {
        /// The rank that made the call.
        rank: usize,
        /// The window's id.
        window: u32,
    },
    /// A requirement beyond what gin-rs supports.
    #[error("rank {rank}: {what} = {asked} exceeds the limit {limit} ({hint})")]
    Limit {
        /// The rank that made the call.
        rank: usize,
        /// The requirement (for example `"DevCommRequirements::contexts"`).
        what: String,
        /// The value asked for.
        asked: u64,
        /// The largest value supported.
        limit: u64,
        /// How to stay within it.
        hint: String,
    },
    /// The signal or counter id space has no room (or a range was freed
    /// twice).
    #[error(transparent)]
    Space(#[from] crate::space::SpaceError),
    /// The bootstrap failed (a peer died, a timeout, a rendezvous refused).
    #[error(transparent)]
    Bootstrap(gin_bootstrap::BootstrapError),
    /// The transport failed.
    #[error(transparent)]
    Net(gin_net::NetError),
    /// A device-API call failed.
    #[error(transparent)]
    Device(#[from] gin_device::GinError),
    /// A CUDA driver call failed.
    #[error("CUDA call {call} failed: {name} ({code}): {text}")]
    Cuda {
        /// The driver entry point, as `cuMemAlloc`.
        call: &'static str,
        /// The `CUresult` value.
        code: i32,
        /// The `CUresult` name, as `CUDA_ERROR_OUT_OF_MEMORY`.
        name: String,
        /// The driver's description of the result.
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
        /// The rank whose record it is.
        rank: usize,
        /// The record (and what is wrong with it).
        what: String,
        /// Its length in bytes.
        got: usize,
        /// The length expected (for a record whose length varies, that of
        /// its fixed head).
        expected: usize,
    },
    /// A CUDA kernel finished without a device-side error, but the job
    /// broke while it ran (a peer died; a transport, the proxy or the NIC
    /// failed): what it computed cannot be trusted.
    #[error("rank {rank}: kernel finished, but {cause}")]
    AfterKernel {
        /// The rank that ran the kernel.
        rank: usize,
        /// What the host saw.
        cause: String,
    },
    /// A CUDA kernel's device-side call failed: the error word it wrote,
    /// decoded (see [`gin_device::abi::errword`]).
    #[error(
        "rank {rank}: kernel error: {what}{}{} (id or value {value}){}",
        ctx.map(|c| format!(", context {c}")).unwrap_or_default(),
        peer.map(|p| format!(", peer {p}")).unwrap_or_default(),
        if cause.is_empty() { String::new() } else { format!("; cause: {cause}") }
    )]
    Kernel {
        /// The rank that ran the kernel.
        rank: usize,
        /// What went wrong, in words.
        what: &'static str,
        /// The context, if the word names one.
        ctx: Option<u32>,
        /// The peer, if the word names one.
        peer: Option<usize>,
        /// The kind's value: an id, a peer or the last value seen.
        value: u32,
        /// What the host saw while the kernel ran (a dead peer, a failed
        /// transport, proxy or NIC); empty when nothing.
        cause: String,
    },
}

impl From<gin_bootstrap::record::Malformed> for CoreError {
    fn from(e: gin_bootstrap::record::Malformed) -> Self {
        let gin_bootstrap::record::Malformed {
            rank,
            what,
            got,
            expected,
        } = e;
        CoreError::MalformedRecord {
            rank,
            what,
            got,
            expected,
        }
    }
}

impl From<gin_device::StartError> for CoreError {
    /// A backend's start failure: gin-device's errors as they are, and the
    /// errors of the layers below (bootstrap, CUDA, fabric) as gin-core
    /// reports them anywhere else.
    fn from(e: gin_device::StartError) -> Self {
        use gin_device::StartError;
        match e {
            StartError::Gin(e) => e.into(),
            StartError::Host(e) => {
                let e = match e.downcast::<gin_bootstrap::BootstrapError>() {
                    Ok(e) => return (*e).into(),
                    Err(e) => e,
                };
                let e = match e.downcast::<gin_cuda::CudaError>() {
                    Ok(e) => return (*e).into(),
                    Err(e) => e,
                };
                match e.downcast::<gin_net::NetError>() {
                    Ok(e) => (*e).into(),
                    Err(e) => CoreError::Invalid(e.to_string()),
                }
            }
            e => CoreError::Invalid(e.to_string()),
        }
    }
}

impl From<gin_bootstrap::BootstrapError> for CoreError {
    /// A malformed set-up record is [`CoreError::MalformedRecord`]; everything
    /// else is carried whole.
    fn from(e: gin_bootstrap::BootstrapError) -> Self {
        match e {
            gin_bootstrap::BootstrapError::Record(m) => m.into(),
            e => CoreError::Bootstrap(e),
        }
    }
}

impl From<gin_net::NetError> for CoreError {
    /// A malformed window record is [`CoreError::MalformedRecord`], whichever
    /// layer decoded it; everything else is carried whole.
    fn from(e: gin_net::NetError) -> Self {
        match e {
            gin_net::NetError::Record(m) => m.into(),
            e => CoreError::Net(e),
        }
    }
}

impl From<gin_cuda::CudaError> for CoreError {
    /// Keeps the variants callers matched before the runtime had its own
    /// crate: a missing driver or NVRTC is [`CoreError::Unavailable`] with
    /// CPU ranks as the alternative, a failing driver call
    /// [`CoreError::Cuda`], a malformed window record
    /// [`CoreError::MalformedRecord`]; everything else is carried whole.
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
            E::Record(m) => m.into(),
            other => CoreError::CudaRuntime(other),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A host window part's record is gin-net's (`gin_net::part`); a
    /// malformed one still reaches gin-core's callers as
    /// [`CoreError::MalformedRecord`], naming rank and window.
    #[test]
    fn a_malformed_window_record_is_a_malformed_record_naming_the_rank_and_window() {
        let e: CoreError = gin_net::part::PartRecord::decode(2, 9, &[0u8; 20])
            .unwrap_err()
            .into();
        assert!(
            matches!(
                &e,
                CoreError::MalformedRecord {
                    rank: 2,
                    got: 20,
                    expected: 21,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("window 9"), "{e}");
    }

    /// A GPU window part's record is gin-cuda's (`gin_cuda::window`); a
    /// malformed one still reaches gin-core's callers as
    /// [`CoreError::MalformedRecord`], naming rank and window.
    #[test]
    fn a_malformed_gpu_window_record_is_a_malformed_record_naming_the_rank_and_window() {
        let e: CoreError = gin_cuda::window::PartRecord::decode(3, 9, &[0u8; 80])
            .unwrap_err()
            .into();
        assert!(
            matches!(
                &e,
                CoreError::MalformedRecord {
                    rank: 3,
                    got: 80,
                    expected: 100,
                    ..
                }
            ),
            "{e}"
        );
        assert_eq!(
            e.to_string(),
            "rank 3 sent a malformed GPU window 9 record (80 bytes, expected 100)"
        );
    }

    /// A host record's, too (gin-bootstrap's `topology`).
    #[test]
    fn a_malformed_host_record_is_a_malformed_record_naming_the_rank() {
        let b = gin_bootstrap::topology::HostRecord::decode(3, &[0u8; 3]).unwrap_err();
        let e: CoreError = gin_bootstrap::BootstrapError::from(b).into();
        assert!(
            matches!(
                &e,
                CoreError::MalformedRecord {
                    rank: 3,
                    got: 3,
                    expected: 4,
                    ..
                }
            ),
            "{e}"
        );
    }
}
