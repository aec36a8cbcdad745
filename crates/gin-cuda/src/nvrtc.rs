//! Run-time compilation of kernels with NVRTC, the header tree passed in
//! memory (cudarc's safe wrapper passes no headers and returns PTX only, so
//! this uses its `sys` level and asks for a cubin: no PTX JIT by the
//! driver, no version skew between the two).
//!
//! The headers are the caller's: this crate knows no device API, so the
//! crates that own headers hand them over by the name kernels include
//! them with.

use std::borrow::Cow;
use std::ffi::{CStr, CString, c_char};

use cudarc::nvrtc::sys as rtc;

use crate::driver::Cubin;
use crate::error::CudaError;

/// Whether NVRTC (`libnvrtc.so.13`) can be loaded here.
pub fn is_available() -> bool {
    // SAFETY: only probes for the library with dlopen.
    unsafe { rtc::is_culib_present() }
}

/// The description of a failed NVRTC call.
fn check(r: rtc::nvrtcResult) -> Result<(), String> {
    if r == rtc::nvrtcResult::NVRTC_SUCCESS {
        return Ok(());
    }
    // SAFETY: returns a static string.
    let s = unsafe { CStr::from_ptr(rtc::nvrtcGetErrorString(r)) };
    Err(s.to_string_lossy().into_owned())
}

/// The header texts, in `headers`' order: the given ones, or, with
/// `GIN_CUDA_HEADERS=DIR`, those under `DIR` by the same names
/// (`DIR/gin/gin.cuh`, ...). The override exists to compare variants of
/// the device code in one job on a GPU machine (A/B runs) without
/// rebuilding; the variants must keep the ABI the binary was built with.
fn header_texts<'h>(headers: &[(&str, &'h str)]) -> Result<Vec<Cow<'h, str>>, String> {
    let Some(dir) = std::env::var_os("GIN_CUDA_HEADERS") else {
        return Ok(headers.iter().map(|(_, t)| (*t).into()).collect());
    };
    let dir = std::path::PathBuf::from(dir);
    tracing::info!(dir = %dir.display(), "CUDA headers from GIN_CUDA_HEADERS");
    headers
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
/// `cc` into a cubin, with `headers` (include name, text) available to its
/// `#include`s. A compilation error carries NVRTC's log.
pub fn compile(
    source: &str,
    name: &str,
    cc: (i32, i32),
    headers: &[(&str, &str)],
) -> Result<Cubin, CudaError> {
    compile_with(source, name, cc, headers, &[])
}

/// The options every compilation gets: the GPU's architecture, C++17,
/// device code by default, line information for profilers.
pub fn base_options(cc: (i32, i32)) -> Vec<String> {
    vec![
        format!("--gpu-architecture=sm_{}{}", cc.0, cc.1),
        "--std=c++17".into(),
        "-default-device".into(),
        "-lineinfo".into(),
    ]
}

/// As [`compile`], with `extra` NVRTC options after [`base_options`]
/// (include folders as `-I DIR`, defines, ...).
pub fn compile_with(
    source: &str,
    name: &str,
    cc: (i32, i32),
    headers: &[(&str, &str)],
    extra: &[String],
) -> Result<Cubin, CudaError> {
    if !is_available() {
        return Err(CudaError::NvrtcUnavailable {
            name: name.into(),
            why: "no NVRTC library (libnvrtc.so.13) could be loaded; add its folder to \
                  LD_LIBRARY_PATH"
                .into(),
        });
    }
    let input = |why: String| CudaError::CompileInput {
        name: name.into(),
        why,
    };
    let nul = |s: &str| CString::new(s).map_err(|_| input(format!("{s:?} contains a NUL")));
    let src = nul(source)?;
    let cname = nul(name)?;
    let texts = header_texts(headers).map_err(input)?;
    let hdr_text: Vec<CString> = texts.iter().map(|t| nul(t)).collect::<Result<_, _>>()?;
    let hdr_name: Vec<CString> = headers
        .iter()
        .map(|(n, _)| nul(n))
        .collect::<Result<_, _>>()?;
    let opts: Vec<CString> = base_options(cc)
        .iter()
        .chain(extra)
        .map(|o| nul(o))
        .collect::<Result<_, _>>()?;
    let texts: Vec<*const c_char> = hdr_text.iter().map(|c| c.as_ptr()).collect();
    let names: Vec<*const c_char> = hdr_name.iter().map(|c| c.as_ptr()).collect();
    let optp: Vec<*const c_char> = opts.iter().map(|c| c.as_ptr()).collect();
    let fail = |call: &'static str, result: String, log: String| CudaError::Compile {
        name: name.into(),
        call,
        result,
        log,
    };
    let mut prog: rtc::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer is a live NUL-terminated string for the calls
    // below; the program is destroyed before returning.
    unsafe {
        check(rtc::nvrtcCreateProgram(
            &raw mut prog,
            src.as_ptr(),
            cname.as_ptr(),
            headers.len() as i32,
            texts.as_ptr(),
            names.as_ptr(),
        ))
        .map_err(|e| fail("nvrtcCreateProgram", e, String::new()))?;
        let compiled = check(rtc::nvrtcCompileProgram(
            prog,
            optp.len() as i32,
            optp.as_ptr(),
        ))
        .map_err(|e| ("nvrtcCompileProgram", e));
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
            check(rtc::nvrtcGetCUBINSize(prog, &raw mut n))
                .map_err(|e| ("nvrtcGetCUBINSize", e))?;
            let mut cubin = vec![0u8; n];
            check(rtc::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast()))
                .map_err(|e| ("nvrtcGetCUBIN", e))?;
            Ok(cubin)
        });
        rtc::nvrtcDestroyProgram(&raw mut prog);
        result
            .map(Cubin)
            .map_err(|(call, result)| fail(call, result, log))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Skips (printing why) where NVRTC cannot be loaded.
    fn nvrtc_here() -> bool {
        if !is_available() {
            eprintln!(
                "skipped: libnvrtc.so.13 cannot be loaded (add its folder to LD_LIBRARY_PATH)"
            );
        }
        is_available()
    }

    /// The headers given are what `#include` finds, and a compilation
    /// error carries NVRTC's log and the source's name.
    #[test]
    fn headers_come_from_memory_and_errors_carry_the_log() {
        if !nvrtc_here() {
            return;
        }
        let headers = [("k/x.cuh", "#define GIN_X 7\n")];
        let cubin = compile(
            "#include \"k/x.cuh\"\nextern \"C\" __global__ void k(int *p) { *p = GIN_X; }",
            "ok.cu",
            (9, 0),
            &headers,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(&cubin.as_bytes()[..4], b"\x7fELF");
        let err = compile(
            "#include \"k/x.cuh\"\n__global__ void k() { undefined_fn(); }",
            "bad.cu",
            (9, 0),
            &headers,
        )
        .expect_err("a kernel calling an undefined function must not compile");
        match &err {
            CudaError::Compile {
                name, call, log, ..
            } => {
                assert_eq!((name.as_str(), *call), ("bad.cu", "nvrtcCompileProgram"));
                assert!(log.contains("undefined_fn"), "{log}");
            }
            other => panic!("wrong error: {other}"),
        }
    }

    /// Without NVRTC, compiling is an availability error naming the
    /// source, not a panic.
    #[test]
    fn without_nvrtc_compiling_is_unavailable() {
        if is_available() {
            eprintln!("skipped: libnvrtc can be loaded here");
            return;
        }
        let e = compile("", "x.cu", (9, 0), &[]).expect_err("no NVRTC");
        assert!(
            matches!(&e, CudaError::NvrtcUnavailable { name, .. } if name == "x.cu"),
            "{e}"
        );
    }

    /// A NUL in the source is refused before NVRTC sees it.
    #[test]
    fn a_nul_in_the_source_is_refused() {
        if !nvrtc_here() {
            return;
        }
        let e = compile("a\0b", "nul.cu", (9, 0), &[]).expect_err("a NUL");
        assert!(matches!(e, CudaError::CompileInput { .. }), "{e}");
    }
}
