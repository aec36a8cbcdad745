//! Run-time compilation of kernels that include `gin/gin.cuh`, with the
//! header tree passed to NVRTC in memory (cudarc's safe wrapper passes no
//! headers and returns PTX only, so this uses its `sys` level and asks for a
//! cubin: no PTX JIT by the driver, no version skew between the two).

use std::ffi::{CStr, CString, c_char};

use cudarc::nvrtc::sys as rtc;

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

fn check(call: &str, r: rtc::nvrtcResult) -> Result<(), String> {
    if r == rtc::nvrtcResult::NVRTC_SUCCESS {
        return Ok(());
    }
    // SAFETY: returns a static string.
    let s = unsafe { CStr::from_ptr(rtc::nvrtcGetErrorString(r)) };
    Err(format!("{call}: {}", s.to_string_lossy()))
}

/// The header texts, in [`HEADERS`]' order: the embedded ones, or, with
/// `GIN_CUDA_HEADERS=DIR`, those under `DIR` (`DIR/gin/gin.cuh`, ...). The
/// override exists to compare variants of the device code in one job on a
/// GPU machine (A/B runs) without rebuilding; the variants must keep the
/// ABI of the binary's `abi.rs`.
fn header_texts() -> Result<Vec<std::borrow::Cow<'static, str>>, String> {
    let Some(dir) = std::env::var_os("GIN_CUDA_HEADERS") else {
        return Ok(HEADERS.iter().map(|(_, t)| (*t).into()).collect());
    };
    let dir = std::path::PathBuf::from(dir);
    tracing::info!(dir = %dir.display(), "CUDA headers from GIN_CUDA_HEADERS");
    HEADERS
        .iter()
        .map(|(n, _)| {
            let p = dir.join(n);
            std::fs::read_to_string(&p)
                .map(Into::into)
                .map_err(|e| format!("GIN_CUDA_HEADERS: reading {}: {e}", p.display()))
        })
        .collect()
}

/// Compiles `source` (named `name` in diagnostics) for compute capability
/// `cc` into a cubin. The error carries NVRTC's log.
pub fn compile(source: &str, name: &str, cc: (i32, i32)) -> Result<Vec<u8>, CoreError> {
    let fail = |why: String| CoreError::Unavailable {
        what: format!("run-time compilation of {name}"),
        why,
        available: "CPU ranks".into(),
    };
    // SAFETY: only probes for the library with dlopen.
    if !unsafe { rtc::is_culib_present() } {
        return Err(fail(
            "no NVRTC library (libnvrtc.so.13) could be loaded; add its folder to LD_LIBRARY_PATH"
                .into(),
        ));
    }
    let nul = |s: &str| CString::new(s).map_err(|_| fail(format!("{s:?} contains a NUL")));
    let src = nul(source)?;
    let cname = nul(name)?;
    let texts = header_texts().map_err(fail)?;
    let hdr_text: Vec<CString> = texts.iter().map(|t| nul(t)).collect::<Result<_, _>>()?;
    let hdr_name: Vec<CString> = HEADERS
        .iter()
        .map(|(n, _)| nul(n))
        .collect::<Result<_, _>>()?;
    let texts: Vec<*const c_char> = hdr_text.iter().map(|c| c.as_ptr()).collect();
    let names: Vec<*const c_char> = hdr_name.iter().map(|c| c.as_ptr()).collect();
    let opts: Vec<CString> = [
        format!("--gpu-architecture=sm_{}{}", cc.0, cc.1),
        "--std=c++17".into(),
        "-default-device".into(),
        "-lineinfo".into(),
    ]
    .iter()
    .map(|o| nul(o))
    .collect::<Result<_, _>>()?;
    let optp: Vec<*const c_char> = opts.iter().map(|c| c.as_ptr()).collect();
    let mut prog: rtc::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer is a live NUL-terminated string for the calls
    // below; the program is destroyed before returning.
    unsafe {
        check(
            "nvrtcCreateProgram",
            rtc::nvrtcCreateProgram(
                &raw mut prog,
                src.as_ptr(),
                cname.as_ptr(),
                HEADERS.len() as i32,
                texts.as_ptr(),
                names.as_ptr(),
            ),
        )
        .map_err(fail)?;
        let compiled = check(
            "nvrtcCompileProgram",
            rtc::nvrtcCompileProgram(prog, optp.len() as i32, optp.as_ptr()),
        );
        let mut log_len = 0usize;
        rtc::nvrtcGetProgramLogSize(prog, &raw mut log_len);
        let mut log = vec![0u8; log_len.max(1)];
        rtc::nvrtcGetProgramLog(prog, log.as_mut_ptr().cast());
        let log = String::from_utf8_lossy(&log)
            .trim_end_matches('\0')
            .trim()
            .to_owned();
        let result = compiled.and_then(|()| {
            let mut n = 0usize;
            check(
                "nvrtcGetCUBINSize",
                rtc::nvrtcGetCUBINSize(prog, &raw mut n),
            )?;
            let mut cubin = vec![0u8; n];
            check(
                "nvrtcGetCUBIN",
                rtc::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast()),
            )?;
            Ok(cubin)
        });
        rtc::nvrtcDestroyProgram(&raw mut prog);
        result.map_err(|e| {
            fail(if log.is_empty() {
                e
            } else {
                format!("{e}\n{log}")
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NVRTC compiles the header tree and every kernel (no GPU needed, only
    /// libnvrtc: CI installs it with the nvcc wheels). Skipped with a reason
    /// where NVRTC cannot be loaded, except under `GIN_REQUIRE_NVRTC=1`.
    #[test]
    fn nvrtc_compiles_the_kernels_for_hopper() {
        // SAFETY: only probes for the library with dlopen.
        if !unsafe { rtc::is_culib_present() } {
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
        assert_eq!(&cubin[..4], b"\x7fELF");
        let err = compile(
            "#include \"gin/gin.cuh\"\n__global__ void k() { undefined(); }",
            "bad.cu",
            (9, 0),
        )
        .expect_err("a kernel calling an undefined function must not compile");
        assert!(err.to_string().contains("undefined"), "{err}");
    }
}
