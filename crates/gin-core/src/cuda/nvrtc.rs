//! Run-time compilation of kernels that include `gin/gin.cuh`: NVRTC is
//! gin-cuda's ([`gin_cuda::nvrtc`]); each crate that owns headers exports
//! them as data (`gin_device::HEADERS`, `gin_proxy::HEADERS`,
//! `gin_gdaki::HEADERS`), and this module only puts the three lists
//! together, as gin-cuda sits below the crates that own them. (The tests
//! that compile every kernel and header live in gin-selftest's
//! `tests/nvrtc.rs`, beside the kernels.)

use std::sync::LazyLock;

use crate::error::CoreError;

/// The CUDA header tree, by the name kernels include it with: the device
/// API's headers, then each backend's.
pub static HEADERS: LazyLock<Vec<(&'static str, &'static str)>> =
    LazyLock::new(|| [gin_device::HEADERS, gin_proxy::HEADERS, gin_gdaki::HEADERS].concat());

/// Compiles `source` (named `name` in diagnostics) for compute capability
/// `cc` into a cubin, with [`HEADERS`] (or `GIN_CUDA_HEADERS=DIR`, see
/// `gin_cuda::nvrtc::compile`). The error carries NVRTC's log.
pub fn compile(source: &str, name: &str, cc: (i32, i32)) -> Result<gin_cuda::Cubin, CoreError> {
    Ok(gin_cuda::nvrtc::compile(source, name, cc, &HEADERS)?)
}
