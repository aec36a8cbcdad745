//! `cargo xtask gpu-package [DIR]`: builds the release binaries the GPU
//! machine runs (it has CUDA but no Rust toolchain) and packs them with
//! `gpu/run.sh` into DIR (default `dist/gpu`, git-ignored), stripped, so the
//! folder stays far under the 64 MiB a device run may carry.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

const BINARIES: [(&str, &str); 3] = [
    ("gin-core", "gin-cuda-selftest"),
    ("gin-ep", "gin-ep-selftest"),
    ("gin-bench", "gin-bench"),
];

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
