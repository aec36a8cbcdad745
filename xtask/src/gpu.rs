//! `cargo xtask gpu-package [DIR]`: builds the release binaries the GPU
//! machine runs (it has CUDA but no Rust toolchain) and packs them with
//! `gpu/run.sh` into DIR (default `dist/gpu`, git-ignored), stripped, so the
//! folder stays far under the 64 MiB a device run may carry. The peers' sources
//! (`xtask/gpu/peers/`: programs run.sh builds there with the machine's nvcc
//! and runs beside gin-rs, issue 22) go to DIR/peers/.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

const BINARIES: [(&str, &str); 3] = [
    ("gin-selftest", "gin-cuda-selftest"),
    ("gin-ep", "gin-ep-selftest"),
    ("gin-bench", "gin-bench"),
];

/// The peers' sources and their build-and-run script, copied to DIR/peers.
const PEERS: &str = "xtask/gpu/peers";

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
    if total > 60 << 20 {
        bail!("the package is {} MiB, over the 60 MiB budget", total >> 20);
    }
    println!(
        "packed {} ({:.1} MiB): run `{}/run.sh RESULTS_DIR [quick|full]` on the GPU machine",
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
}
