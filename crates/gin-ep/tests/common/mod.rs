//! Shared by the host C++ cross-checks: compiling one of `tests/*.cpp`
//! (which include `kernels/ll.cu`'s host-compilable parts) with the
//! workspace's CUDA headers on the include path.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Compiles `tests/{name}.cpp` with `CXX` (else `c++`), warnings as errors,
/// plus `extra` flags, into an executable in the temporary folder; returns
/// its path. `None` (after saying why) when no compiler exists, except in
/// CI (`CI` set), where that fails the test. `what` names the check in
/// messages.
pub fn compile(name: &str, extra: &[&str], what: &str) -> Option<PathBuf> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let exe = std::env::temp_dir().join(format!("gin-ep-{name}-{}", std::process::id()));
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut cmd = Command::new(&cxx);
    cmd.args(["-std=c++17", "-Wall", "-Wextra", "-Werror", "-O1"])
        .args(extra);
    for inc in ["gin-device", "gin-proxy", "gin-gdaki"] {
        cmd.arg("-I")
            .arg(root.join(format!("crates/{inc}/include")));
    }
    let status = cmd
        .arg(root.join(format!("crates/gin-ep/tests/{name}.cpp")))
        .arg("-o")
        .arg(&exe)
        .status();
    match status {
        Err(e) => {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI needs a C++ compiler for the {what}: {cxx}: {e}"
            );
            eprintln!("skipped: no C++ compiler ({cxx}: {e}); set CXX to run this test");
            None
        }
        Ok(s) => {
            assert!(
                s.success(),
                "{cxx} failed to compile the {what} as host C++"
            );
            Some(exe)
        }
    }
}
