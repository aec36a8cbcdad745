//! Run-time compilation of kernels that include `gin/gin.cuh`: NVRTC, the
//! user's options and the CCCL lookup are gin-cuda's ([`gin_cuda::nvrtc`]);
//! each crate that owns headers exports them as data (`gin_device::HEADERS`,
//! `gin_proxy::HEADERS`, `gin_gdaki::HEADERS`), and this module only puts
//! the three lists together, as gin-cuda sits below the crates that own
//! them. (The tests that compile every kernel and header live in
//! gin-selftest's `tests/nvrtc.rs`, beside the kernels.)

use std::sync::LazyLock;

use crate::error::CoreError;

/// Whether NVRTC (`libnvrtc.so.13`) can be loaded here; what a user's
/// kernel needs beyond gin's headers; where CCCL is looked for.
pub use gin_cuda::nvrtc::{CompileOptions, cccl_candidates, cccl_dir, find_cccl, is_available};

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

/// Compiles `source` as [`compile`] does, with `opts` and, where
/// installed, CCCL's headers ([`cccl_dir`]); a source including
/// `<cuda/...>` where CCCL is not found is refused before NVRTC, saying
/// where CCCL was looked for (`gin_cuda::nvrtc::compile_with_options`).
pub fn compile_with(
    source: &str,
    name: &str,
    cc: (i32, i32),
    opts: &CompileOptions,
) -> Result<gin_cuda::Cubin, CoreError> {
    Ok(gin_cuda::nvrtc::compile_with_options(
        source, name, cc, &HEADERS, opts,
    )?)
}
