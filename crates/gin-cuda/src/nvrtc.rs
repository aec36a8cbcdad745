//! Run-time compilation of kernels with NVRTC, the header tree passed in
//! memory (cudarc's safe wrapper passes no headers and returns PTX only, so
//! this uses its `sys` level and asks for a cubin: no PTX JIT by the
//! driver, no version skew between the two).
//!
//! The headers are the caller's: this crate knows no device API, so the
//! crates that own headers hand them over by the name kernels include
//! them with. What a user's kernel needs beyond them — include folders,
//! defines, further options ([`CompileOptions`]) and CCCL's headers, looked
//! for where a toolkit or the NVRTC wheel puts them ([`cccl_dir`]) — is
//! this module's too ([`compile_with_options`]).

use std::borrow::Cow;
use std::ffi::{CStr, CString, OsStr, c_char};
use std::path::{Path, PathBuf};

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

/// What a user's kernel needs beyond the headers handed over as data
/// ([`compile_with_options`]; gin-core's `CudaComm::compile_with`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CompileOptions {
    /// Folders searched by `#include` (`-I`), in order, after the headers
    /// given as data (which are found by name first).
    pub include_dirs: Vec<PathBuf>,
    /// Macros: `(NAME, None)` is `-D NAME`, `(NAME, Some(V))` `-D NAME=V`.
    pub defines: Vec<(String, Option<String>)>,
    /// Further NVRTC options, passed as given after the others (as
    /// `-maxrregcount=64` or `--use_fast_math`).
    pub extra_opts: Vec<String>,
}

/// Where `cuda/atomic` (libcu++, part of CCCL) is looked for: the
/// toolkit's `include/cccl` (CUDA 13) or `include` (CUDA 12) under each
/// root, where the roots are `CUDA_HOME`, `CUDA_PATH`, `/usr/local/cuda`,
/// and the parent of each `LD_LIBRARY_PATH` folder (the NVRTC wheel's
/// `nvidia/cu13/lib` sits beside its `include`).
pub fn cccl_candidates(
    cuda_home: Option<&OsStr>,
    cuda_path: Option<&OsStr>,
    ld_library_path: Option<&OsStr>,
) -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = [cuda_home, cuda_path]
        .into_iter()
        .flatten()
        .map(PathBuf::from)
        .collect();
    roots.push(PathBuf::from("/usr/local/cuda"));
    if let Some(l) = ld_library_path {
        roots.extend(
            std::env::split_paths(l)
                .filter_map(|d| d.parent().map(Path::to_path_buf))
                .filter(|d| !d.as_os_str().is_empty()),
        );
    }
    roots
        .iter()
        .flat_map(|r| [r.join("include/cccl"), r.join("include")])
        .collect()
}

/// The first of `candidates` holding `cuda/atomic`.
pub fn find_cccl(candidates: &[PathBuf]) -> Option<PathBuf> {
    candidates
        .iter()
        .find(|d| d.join("cuda/atomic").is_file())
        .cloned()
}

/// CCCL's include folder here, if it is installed ([`cccl_candidates`]).
pub fn cccl_dir() -> Option<PathBuf> {
    find_cccl(&cccl_candidates(
        std::env::var_os("CUDA_HOME").as_deref(),
        std::env::var_os("CUDA_PATH").as_deref(),
        std::env::var_os("LD_LIBRARY_PATH").as_deref(),
    ))
}

/// Whether `source` includes a CCCL header (`<cuda/...>`, as
/// `<cuda/atomic>` or `<cuda/std/...>`).
fn wants_cccl(source: &str) -> bool {
    source.lines().any(|l| {
        let l = l.trim_start();
        l.strip_prefix('#')
            .map(str::trim_start)
            .and_then(|l| l.strip_prefix("include"))
            .is_some_and(|l| l.trim_start().starts_with("<cuda/"))
    })
}

impl CompileOptions {
    /// The NVRTC options these make, `cccl` (CCCL's include folder, if
    /// found) searched after the user's folders. A folder that is not
    /// UTF-8, or a define whose name is empty or holds `=` or white space,
    /// is refused.
    pub fn nvrtc_options(&self, cccl: Option<&Path>) -> Result<Vec<String>, String> {
        let mut out = Vec::new();
        for d in self.include_dirs.iter().map(PathBuf::as_path).chain(cccl) {
            let s = d
                .to_str()
                .ok_or_else(|| format!("include folder {} is not UTF-8", d.display()))?;
            out.push(format!("-I{s}"));
        }
        for (name, value) in &self.defines {
            if name.is_empty() || name.contains(['=', ' ', '\t', '\n']) {
                return Err(format!("define {name:?} is not a macro name"));
            }
            out.push(match value {
                Some(v) => format!("-D{name}={v}"),
                None => format!("-D{name}"),
            });
        }
        out.extend(self.extra_opts.iter().cloned());
        Ok(out)
    }
}

/// Compiles `source` as [`compile`] does, with `headers`, `opts` and,
/// where installed, CCCL's headers ([`cccl_dir`]). A source including
/// `<cuda/...>` where CCCL is not found (and no include folder of `opts`
/// holds it) is refused before NVRTC with an error saying where CCCL was
/// looked for.
pub fn compile_with_options(
    source: &str,
    name: &str,
    cc: (i32, i32),
    headers: &[(&str, &str)],
    opts: &CompileOptions,
) -> Result<Cubin, CudaError> {
    compile_found(source, name, cc, headers, opts, cccl_dir())
}

/// [`compile_with_options`], CCCL found at `cccl` (or not).
fn compile_found(
    source: &str,
    name: &str,
    cc: (i32, i32),
    headers: &[(&str, &str)],
    opts: &CompileOptions,
    cccl: Option<PathBuf>,
) -> Result<Cubin, CudaError> {
    let input = |why: String| CudaError::CompileInput {
        name: name.into(),
        why,
    };
    if wants_cccl(source) && cccl.is_none() && find_cccl(&opts.include_dirs).is_none() {
        return Err(input(
            "it includes a CCCL header (<cuda/...>), but CCCL was not found: set CUDA_HOME to a \
             CUDA toolkit (CCCL under include/cccl), put the NVRTC wheel's lib folder on \
             LD_LIBRARY_PATH, or add CCCL's include folder to CompileOptions::include_dirs"
                .into(),
        ));
    }
    let extra = opts.nvrtc_options(cccl.as_deref()).map_err(input)?;
    compile_with(source, name, cc, headers, &extra)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test
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

    #[test]
    fn options_list_includes_then_cccl_then_defines_then_extras() {
        let o = CompileOptions {
            include_dirs: vec!["/opt/mine/include".into(), "rel/inc".into()],
            defines: vec![("N".into(), Some("4".into())), ("FUSED".into(), None)],
            extra_opts: vec!["-maxrregcount=64".into()],
        };
        assert_eq!(
            o.nvrtc_options(Some(Path::new("/cuda/include/cccl")))
                .unwrap(),
            [
                "-I/opt/mine/include",
                "-Irel/inc",
                "-I/cuda/include/cccl",
                "-DN=4",
                "-DFUSED",
                "-maxrregcount=64"
            ]
        );
        assert!(
            CompileOptions::default()
                .nvrtc_options(None)
                .unwrap()
                .is_empty()
        );
        for bad in ["", "A=B", "A B"] {
            let o = CompileOptions {
                defines: vec![(bad.into(), None)],
                ..CompileOptions::default()
            };
            assert!(o.nvrtc_options(None).unwrap_err().contains("macro name"));
        }
    }

    #[test]
    fn cccl_is_looked_for_under_the_toolkit_and_beside_nvrtc() {
        let c = cccl_candidates(
            Some(OsStr::new("/opt/cuda")),
            None,
            Some(OsStr::new("/venv/nvidia/cu13/lib:/usr/lib")),
        );
        let c: Vec<&str> = c.iter().map(|p| p.to_str().unwrap()).collect();
        assert_eq!(
            c,
            [
                "/opt/cuda/include/cccl",
                "/opt/cuda/include",
                "/usr/local/cuda/include/cccl",
                "/usr/local/cuda/include",
                "/venv/nvidia/cu13/include/cccl",
                "/venv/nvidia/cu13/include",
                "/usr/include/cccl",
                "/usr/include",
            ]
        );
        // The first folder that holds cuda/atomic wins.
        let root = std::env::temp_dir().join(format!("gin-cccl-{}", std::process::id()));
        let inc = root.join("include/cccl");
        std::fs::create_dir_all(inc.join("cuda")).unwrap();
        std::fs::write(inc.join("cuda/atomic"), "").unwrap();
        let found = find_cccl(&cccl_candidates(Some(root.as_os_str()), None, None));
        std::fs::remove_dir_all(&root).unwrap();
        assert_eq!(found, Some(inc));
        assert_eq!(find_cccl(&[root.join("nothing")]), None);
    }

    /// A source including CCCL is refused before NVRTC (none is needed
    /// here) when CCCL is neither found nor in the include folders.
    #[test]
    fn a_cccl_include_without_cccl_is_refused_with_where_it_was_looked_for() {
        let src = "#include <cuda/atomic>\n__global__ void k() {}";
        let e = compile_found(src, "k.cu", (9, 0), &[], &CompileOptions::default(), None)
            .expect_err("no CCCL");
        let m = e.to_string();
        assert!(m.contains("run-time compilation of k.cu"), "{m}");
        assert!(m.contains("CCCL was not found"), "{m}");
        assert!(m.contains("CUDA_HOME"), "{m}");
        // A bad define is refused before NVRTC too.
        let bad = CompileOptions {
            defines: vec![("A B".into(), None)],
            ..CompileOptions::default()
        };
        let e = compile_found("", "d.cu", (9, 0), &[], &bad, None).expect_err("bad define");
        assert!(e.to_string().contains("not a macro name"), "{e}");
    }

    #[test]
    fn a_cccl_include_is_recognised() {
        assert!(wants_cccl("#include <cuda/atomic>\n"));
        assert!(wants_cccl("  #  include   <cuda/std/cstdint>"));
        assert!(!wants_cccl(
            "#include \"cuda/atomic\"\n#include <gin/gin.cuh>"
        ));
        assert!(!wants_cccl("// #include <cuda/atomic>"));
    }
}
