//! Run-time compilation of kernels that include `gin/gin.cuh`: gin-cuda's
//! NVRTC wrapper, given the device API's header tree.
//!
//! The tree is assembled here from the crates that own the headers
//! (gin-device, gin-proxy, gin-gdaki) until each exports its own as data.

use crate::error::CoreError;

/// The CUDA header tree, by the name kernels include it with.
pub const HEADERS: [(&str, &str); 4] = [
    (
        "gin/abi.cuh",
        include_str!("../../../gin-device/include/gin/abi.cuh"),
    ),
    (
        "gin/gin.cuh",
        include_str!("../../../gin-device/include/gin/gin.cuh"),
    ),
    (
        "gin/proxy.cuh",
        include_str!("../../../gin-proxy/include/gin/proxy.cuh"),
    ),
    (
        "gin/gdaki.cuh",
        include_str!("../../../gin-gdaki/include/gin/gdaki.cuh"),
    ),
];

/// Compiles `source` (named `name` in diagnostics) for compute capability
/// `cc` into a cubin, with [`HEADERS`] (or `GIN_CUDA_HEADERS=DIR`, see
/// `gin_cuda::nvrtc::compile`). The error carries NVRTC's log.
pub fn compile(source: &str, name: &str, cc: (i32, i32)) -> Result<gin_cuda::Cubin, CoreError> {
    Ok(gin_cuda::nvrtc::compile(source, name, cc, &HEADERS)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NVRTC compiles the header tree and every kernel (no GPU needed, only
    /// libnvrtc: CI installs it with the nvcc wheels). Skipped with a reason
    /// where NVRTC cannot be loaded, except under `GIN_REQUIRE_NVRTC=1`.
    #[test]
    fn nvrtc_compiles_the_kernels_for_hopper() {
        if !gin_cuda::nvrtc::is_available() {
            assert!(
                std::env::var_os("GIN_REQUIRE_NVRTC").is_none(),
                "GIN_REQUIRE_NVRTC is set but libnvrtc cannot be loaded"
            );
            eprintln!(
                "skipped: libnvrtc.so.13 cannot be loaded (add its folder to LD_LIBRARY_PATH)"
            );
            return;
        }
        let cubin = compile(super::super::SELFTEST_KERNELS, "selftest.cu", (9, 0))
            .unwrap_or_else(|e| panic!("{e}"));
        // An ELF image.
        assert_eq!(&cubin.as_bytes()[..4], b"\x7fELF");
        let err = compile(
            "#include \"gin/gin.cuh\"\n__global__ void k() { undefined(); }",
            "bad.cu",
            (9, 0),
        )
        .expect_err("a kernel calling an undefined function must not compile");
        assert!(err.to_string().contains("undefined"), "{err}");
    }
}
