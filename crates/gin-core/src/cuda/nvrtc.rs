//! Run-time compilation of kernels that include `gin/gin.cuh`: NVRTC is
//! gin-cuda's ([`gin_cuda::nvrtc`]); each crate that owns headers exports
//! them as data (`gin_device::HEADERS`, `gin_proxy::HEADERS`,
//! `gin_gdaki::HEADERS`), and this module only puts the three lists
//! together, as gin-cuda sits below the crates that own them. (The tests
//! that compile every kernel and header live in gin-selftest's
//! `tests/nvrtc.rs`, beside the kernels.)

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::LazyLock;

use crate::error::CoreError;

/// Whether NVRTC (`libnvrtc.so.13`) can be loaded here.
pub use gin_cuda::nvrtc::is_available;

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

/// What a user's kernel needs beyond gin's headers
/// ([`CudaComm::compile_with`](super::CudaComm::compile_with)).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CompileOptions {
    /// Folders searched by `#include` (`-I`), in order, after gin's
    /// headers (which are found by name first).
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

/// Compiles `source` as [`compile`] does, with `opts` and, where
/// installed, CCCL's headers ([`cccl_dir`]). A source including
/// `<cuda/...>` where CCCL is not found (and no include folder of `opts`
/// holds it) is refused before NVRTC with an error saying where CCCL was
/// looked for.
pub fn compile_with(
    source: &str,
    name: &str,
    cc: (i32, i32),
    opts: &CompileOptions,
) -> Result<gin_cuda::Cubin, CoreError> {
    compile_found(source, name, cc, opts, cccl_dir())
}

/// [`compile_with`], CCCL found at `cccl` (or not).
fn compile_found(
    source: &str,
    name: &str,
    cc: (i32, i32),
    opts: &CompileOptions,
    cccl: Option<PathBuf>,
) -> Result<gin_cuda::Cubin, CoreError> {
    let input = |why: String| {
        CoreError::CudaRuntime(gin_cuda::CudaError::CompileInput {
            name: name.into(),
            why,
        })
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
    Ok(gin_cuda::nvrtc::compile_with(
        source, name, cc, &HEADERS, &extra,
    )?)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

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
        let e = compile_found(src, "k.cu", (9, 0), &CompileOptions::default(), None)
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
        let e = compile_found("", "d.cu", (9, 0), &bad, None).expect_err("bad define");
        assert!(e.to_string().contains("not a macro name"), "{e}");
    }

    /// NVRTC finds a user's header through `include_dirs`, applies the
    /// defines, and (where CCCL is found) compiles `<cuda/atomic>` beside
    /// gin's headers. Skipped where NVRTC cannot be loaded, except under
    /// `GIN_REQUIRE_NVRTC=1` (.ci/nvcc-check).
    #[test]
    fn nvrtc_compiles_a_users_kernel_with_its_include_folder_and_cccl() {
        if !is_available() {
            assert!(
                std::env::var_os("GIN_REQUIRE_NVRTC").is_none(),
                "GIN_REQUIRE_NVRTC is set but libnvrtc cannot be loaded"
            );
            eprintln!(
                "skipped: libnvrtc.so.13 cannot be loaded (add its folder to LD_LIBRARY_PATH)"
            );
            return;
        }
        let root = std::env::temp_dir().join(format!("gin-user-inc-{}", std::process::id()));
        std::fs::create_dir_all(root.join("mine")).unwrap();
        std::fs::write(
            root.join("mine/op.cuh"),
            "#pragma once\n__device__ inline unsigned long long twice(unsigned long long v)              { return USER_K * v; }\n",
        )
        .unwrap();
        let cccl = cccl_dir();
        let src = format!(
            "#include \"gin/gin.cuh\"\n#include \"mine/op.cuh\"\n{}\n             extern \"C\" __global__ void k(gin::DevComm dc, unsigned long long* p) {{\n               p[0] = twice(dc.rank);\n{}\n}}\n",
            if cccl.is_some() {
                "#include <cuda/atomic>"
            } else {
                ""
            },
            if cccl.is_some() {
                "cuda::atomic_ref<unsigned long long, cuda::thread_scope_device> a(p[1]);                  a.fetch_add(1);"
            } else {
                ""
            }
        );
        let opts = CompileOptions {
            include_dirs: vec![root.clone()],
            defines: vec![("USER_K".into(), Some("2ull".into()))],
            extra_opts: vec!["-maxrregcount=64".into()],
        };
        let r = compile_with(&src, "user.cu", (9, 0), &opts);
        // Without the define, the header does not compile: it was applied.
        let without = compile_with(
            &src,
            "user.cu",
            (9, 0),
            &CompileOptions {
                defines: Vec::new(),
                ..opts.clone()
            },
        );
        std::fs::remove_dir_all(&root).unwrap();
        let cubin = r.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(&cubin.as_bytes()[..4], b"\x7fELF");
        let e = without.expect_err("USER_K undefined");
        assert!(e.to_string().contains("USER_K"), "{e}");
        if cccl.is_none() {
            eprintln!("note: CCCL not found; <cuda/atomic> was not tried");
        }
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
