//! Compiles the example's kernel into a cubin with nvcc at build time, where
//! nvcc is found (`NVCC`, else `CUDA_HOME/bin/nvcc`, else `nvcc` on `PATH`),
//! so the binary ships it (`include_bytes!`) and needs no NVRTC. Without
//! nvcc nothing is compiled and the example compiles its kernel with NVRTC
//! at run time: building never needs CUDA.
//!
//! `FUSED_CUBIN_ARCH` picks the architecture (default `sm_90`, Hopper); the
//! cubin is used only on a GPU of exactly that compute capability.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(fused_cubin)");
    println!("cargo::rerun-if-changed=kernels");
    println!("cargo::rerun-if-changed=../../crates/gin-device/include");
    println!("cargo::rerun-if-changed=../../crates/gin-proxy/include");
    println!("cargo::rerun-if-changed=../../crates/gin-gdaki/include");
    for v in ["NVCC", "CUDA_HOME", "FUSED_CUBIN_ARCH", "PATH"] {
        println!("cargo::rerun-if-env-changed={v}");
    }
    let Some(nvcc) = nvcc() else {
        return;
    };
    let here = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    let out = PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default());
    let arch = std::env::var("FUSED_CUBIN_ARCH").unwrap_or_else(|_| "sm_90".into());
    let cubin = out.join("fused_alltoall.cubin");
    let crates = here.join("../../crates");
    let status = Command::new(&nvcc)
        .args([
            "-std=c++17",
            "-cubin",
            "-lineinfo",
            "-DFUSED_SCALE=2",
            "-DFUSED_USE_CCCL",
        ])
        .arg(format!("-arch={arch}"))
        .arg("-I")
        .arg(crates.join("gin-device/include"))
        .arg("-I")
        .arg(crates.join("gin-proxy/include"))
        .arg("-I")
        .arg(crates.join("gin-gdaki/include"))
        .arg("-I")
        .arg(here.join("kernels/include"))
        .arg(here.join("kernels/fused_alltoall.cu"))
        .arg("-o")
        .arg(&cubin)
        .status();
    match status {
        Ok(s) if s.success() => {
            println!("cargo::rustc-cfg=fused_cubin");
            println!("cargo::rustc-env=FUSED_CUBIN={}", cubin.display());
            println!("cargo::rustc-env=FUSED_CUBIN_ARCH={arch}");
        }
        // A broken toolkit must not break the build: NVRTC remains.
        Ok(s) => println!("cargo::warning=nvcc failed ({s}); the kernel is compiled with NVRTC"),
        Err(e) => {
            println!("cargo::warning=nvcc did not run ({e}); the kernel is compiled with NVRTC");
        }
    }
}

/// nvcc, if this machine has one.
fn nvcc() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("NVCC") {
        return Some(p.into());
    }
    if let Some(home) = std::env::var_os("CUDA_HOME") {
        let p = Path::new(&home).join("bin/nvcc");
        if p.is_file() {
            return Some(p);
        }
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join("nvcc"))
        .find(|p| p.is_file())
}
