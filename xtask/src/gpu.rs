//! `cargo xtask gpu-package [DIR]`: builds the release binaries the GPU
//! machine runs (it has CUDA but no Rust toolchain) and packs them with
//! `gpu/run.sh` into DIR (default `dist/gpu`, git-ignored), stripped, so the
//! folder stays far under the 64 MiB a device run may carry. The peers' sources
//! (`xtask/gpu/peers/`: programs run.sh builds there with the machine's nvcc
//! and runs beside gin-rs, issue 22) go to DIR/peers/.
//!
//! UCX for CUDA ranks over `GIN_TRANSPORT=ucx` (issue 24): the subset of the
//! pinned `libucx-cu13` wheel (installed by `cargo xtask wheels` under
//! `target/wheels/libucx-cu13`) that run.sh needs goes to DIR/ucx.tgz in the
//! wheel's own layout: the libraries (`libucp`, `libuct`, `libucs`,
//! `libucm`, `libucs_signal`), UCX's transport modules (`lib/ucx/*.so.0`:
//! cma, cuda with cuda_copy and cuda_ipc, ucm's CUDA hooks, ucx_perftest's
//! CUDA memory), the wheel's bundled libraries (`libucx_cu13.libs`),
//! `ucx_info`, `ucx_perftest` and `etc/`. run.sh unpacks it into a
//! temporary folder and points only its ucx steps at it.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

const BINARIES: [(&str, &str); 4] = [
    ("gin-selftest", "gin-cuda-selftest"),
    ("gin-ep", "gin-ep-selftest"),
    ("gin-bench", "gin-bench"),
    // The users' example of issue 21 (its build embeds an nvcc cubin where
    // nvcc is on PATH; otherwise it compiles its kernel with NVRTC there).
    ("fused-alltoall", "fused-alltoall"),
];

/// The peers' sources and their build-and-run script, copied to DIR/peers.
const PEERS: &str = "xtask/gpu/peers";

/// The pinned UCX wheel's root, as `cargo xtask wheels` unpacks it (under
/// the target directory).
const UCX_WHEEL: &str = "wheels/libucx-cu13";

/// Whether `rel` (a path inside the UCX wheel's root, `/`-separated) is part
/// of the GPU package's UCX subset: the versioned shared libraries and
/// modules UCX loads (by the `.so.0` name its own libucs was loaded as),
/// the bundled libraries, the two tools run.sh runs, and the configuration.
/// Static archives, libtool files, unversioned duplicates, headers and
/// Python files stay behind.
fn ucx_wanted(rel: &str) -> bool {
    let lib = |name: &str| {
        ["libucp", "libuct", "libucs", "libucm", "libucs_signal"]
            .iter()
            .any(|l| name == format!("{l}.so.0"))
    };
    match rel.split('/').collect::<Vec<_>>().as_slice() {
        ["libucx", "lib", name] => lib(name),
        ["libucx", "lib", "ucx", name] => name.ends_with(".so.0"),
        ["libucx", "bin", "ucx_info" | "ucx_perftest"]
        | ["libucx", "etc", ..]
        | ["libucx_cu13.libs", _] => true,
        _ => false,
    }
}

/// Every file under `root` (the UCX wheel) the package takes, as paths
/// relative to `root`, sorted; an error unless libucp and ucx_perftest are
/// among them.
fn ucx_subset(root: &Path) -> Result<Vec<String>> {
    let mut found = Vec::new();
    let mut todo = vec![PathBuf::new()];
    while let Some(rel) = todo.pop() {
        let dir = root.join(&rel);
        for e in std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
            let e = e?;
            let r = rel.join(e.file_name());
            let t = e.file_type()?;
            if t.is_dir() {
                todo.push(r);
            } else if let Some(s) = r.to_str().filter(|s| ucx_wanted(s)) {
                found.push(s.to_owned());
            }
        }
    }
    found.sort();
    for need in ["libucx/lib/libucp.so.0", "libucx/bin/ucx_perftest"] {
        if !found.iter().any(|f| f == need) {
            bail!(
                "{} has no {need}: run `cargo xtask wheels` (it installs the pinned UCX wheel)",
                root.display()
            );
        }
    }
    Ok(found)
}

/// Packs the UCX subset of the wheel at `root` into `to` (gzip'd tar, the
/// wheel's layout, files' modes kept); its size.
fn pack_ucx(root: &Path, to: &Path) -> Result<u64> {
    let files = ucx_subset(root)?;
    let st = Command::new("tar")
        .arg("czf")
        .arg(to)
        .arg("-C")
        .arg(root)
        .args(&files)
        .status()
        .context("running tar")?;
    if !st.success() {
        bail!("tar failed packing {}", to.display());
    }
    Ok(std::fs::metadata(to)?.len())
}

/// Every file in `dir` (the peers' sources: `.cu` programs and `peers.sh`),
/// sorted; an error if there are none, as run.sh needs them.
fn peer_sources(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for e in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let e = e?;
        if e.file_type()?.is_file() {
            files.push(e.path());
        }
    }
    files.sort();
    if files.is_empty() {
        bail!("{} holds no peer sources", dir.display());
    }
    Ok(files)
}

pub fn package(args: &[String]) -> Result<()> {
    let dir = PathBuf::from(args.first().map_or("dist/gpu", String::as_str));
    let mut build = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    build.args(["build", "--release", "--locked"]);
    for (pkg, bin) in BINARIES {
        build.args(["-p", pkg, "--bin", bin]);
    }
    let st = build.status().context("running cargo build")?;
    if !st.success() {
        bail!("cargo build failed");
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let target = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into());
    let mut total = 0;
    for (_, bin) in BINARIES {
        let from = Path::new(&target).join("release").join(bin);
        let to = dir.join(bin);
        std::fs::copy(&from, &to).with_context(|| format!("copying {}", from.display()))?;
        // Line tables help nobody there; stripping keeps the folder small.
        let _ = Command::new("strip").arg(&to).status();
        total += std::fs::metadata(&to)?.len();
    }
    let script = dir.join("run.sh");
    std::fs::copy("xtask/gpu/run.sh", &script).context("copying xtask/gpu/run.sh")?;
    total += std::fs::metadata(&script)?.len();
    let peers = dir.join("peers");
    std::fs::create_dir_all(&peers).with_context(|| format!("creating {}", peers.display()))?;
    for from in peer_sources(Path::new(PEERS))? {
        let to = peers.join(from.file_name().context("a peer source without a name")?);
        std::fs::copy(&from, &to).with_context(|| format!("copying {}", from.display()))?;
        total += std::fs::metadata(&to)?.len();
    }
    let ucx = pack_ucx(&Path::new(&target).join(UCX_WHEEL), &dir.join("ucx.tgz"))?;
    println!("UCX subset: ucx.tgz, {:.1} MiB", ucx as f64 / 1_048_576.0);
    total += ucx;
    if total > 60 << 20 {
        bail!("the package is {} MiB, over the 60 MiB budget", total >> 20);
    }
    println!(
        "packed {} ({:.1} MiB): run `{}/run.sh RESULTS_DIR [quick|check|bench|full]` on the GPU machine",
        dir.display(),
        total as f64 / 1_048_576.0,
        dir.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_package_carries_the_peers_run_sh_builds() {
        // (cargo runs tests in the crate's directory: xtask/.)
        let files = peer_sources(Path::new("gpu/peers")).unwrap();
        let names: Vec<_> = files
            .iter()
            .map(|f| f.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert!(
            names.contains(&"nvshmem_pingpong.cu".to_owned()),
            "{names:?}"
        );
        assert!(names.contains(&"peers.sh".to_owned()), "{names:?}");
        // run.sh runs them from where the package puts them, and hands
        // their results to gin-bench.
        let run = std::fs::read_to_string("gpu/run.sh").unwrap();
        assert!(run.contains(r#""$here/peers/peers.sh" "$out""#));
        assert!(run.contains(r#"--peer-json "$out/peer-nvshmem.json""#));
        let script = std::fs::read_to_string("gpu/peers/peers.sh").unwrap();
        assert!(script.contains(r#"json="$out/peer-nvshmem.json""#));
        assert!(script.contains(r#"why="$out/peer-nvshmem.why""#));
        assert!(peer_sources(Path::new("gpu/no-such-dir")).is_err());
    }

    /// The UCX subset: what UCX loads by the names it loads them, the two
    /// tools and the configuration, nothing else (a made-up wheel tree).
    #[test]
    fn the_package_carries_the_ucx_subset_run_sh_needs() {
        let root = std::env::temp_dir().join(format!("gin-xtask-ucx-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let files = [
            "libucx/lib/libucp.so.0",
            "libucx/lib/libucp.so",
            "libucx/lib/libucp.a",
            "libucx/lib/libucp.la",
            "libucx/lib/libuct.so.0",
            "libucx/lib/libucs.so.0",
            "libucx/lib/libucm.so.0",
            "libucx/lib/libucs_signal.so.0",
            "libucx/lib/libucs_signal.so.0.0.0",
            "libucx/lib/ucx/libuct_cuda.so.0",
            "libucx/lib/ucx/libuct_cuda.so",
            "libucx/lib/ucx/libuct_cuda.a",
            "libucx/lib/ucx/libucm_cuda.so.0",
            "libucx/lib/ucx/libuct_cma.so.0",
            "libucx/lib/ucx/libucx_perftest_cuda.so.0",
            "libucx/lib/pkgconfig/ucx.pc",
            "libucx/bin/ucx_info",
            "libucx/bin/ucx_perftest",
            "libucx/bin/io_demo",
            "libucx/etc/ucx/ucx.conf",
            "libucx/include/ucp/api/ucp.h",
            "libucx/load.py",
            "libucx_cu13.libs/libcudart-9f92e4c3.so.13.3.29",
            "libucx_cu13.libs/libgomp-855c301a.so.1.0.0",
            "libucx_cu13-1.22.0.dist-info/RECORD",
        ];
        for f in files {
            let p = root.join(f);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, f).unwrap();
        }
        let got = ucx_subset(&root).unwrap();
        assert_eq!(
            got,
            [
                "libucx/bin/ucx_info",
                "libucx/bin/ucx_perftest",
                "libucx/etc/ucx/ucx.conf",
                "libucx/lib/libucm.so.0",
                "libucx/lib/libucp.so.0",
                "libucx/lib/libucs.so.0",
                "libucx/lib/libucs_signal.so.0",
                "libucx/lib/libuct.so.0",
                "libucx/lib/ucx/libucm_cuda.so.0",
                "libucx/lib/ucx/libuct_cma.so.0",
                "libucx/lib/ucx/libuct_cuda.so.0",
                "libucx/lib/ucx/libucx_perftest_cuda.so.0",
                "libucx_cu13.libs/libcudart-9f92e4c3.so.13.3.29",
                "libucx_cu13.libs/libgomp-855c301a.so.1.0.0",
            ]
        );
        let tgz = root.join("ucx.tgz");
        assert!(pack_ucx(&root, &tgz).unwrap() > 0);
        std::fs::remove_file(root.join("libucx/lib/libucp.so.0")).unwrap();
        let e = ucx_subset(&root).unwrap_err().to_string();
        assert!(
            e.contains("libucp.so.0") && e.contains("cargo xtask wheels"),
            "{e}"
        );
        std::fs::remove_dir_all(&root).unwrap();
        // run.sh unpacks it and runs the ucx steps against it, only them.
        let run = std::fs::read_to_string("gpu/run.sh").unwrap();
        assert!(run.contains(r#"tar xzf "$here/ucx.tgz""#));
        assert!(run.contains("GIN_UCX_LIB="));
        assert!(run.contains("ucx_perftest"));
        assert!(run.contains("GIN_TRANSPORT=ucx"));
    }
}
