//! Host API errors.

/// Everything the host API can fail with.
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    #[error("{what} is not available: {why} (available: {available})")]
    Unavailable {
        what: String,
        why: String,
        available: String,
    },
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Space(#[from] crate::space::SpaceError),
    #[error(transparent)]
    Bootstrap(#[from] gin_bootstrap::BootstrapError),
    #[error(transparent)]
    Net(#[from] gin_net::NetError),
    #[error(transparent)]
    Device(#[from] gin_device::GinError),
}
