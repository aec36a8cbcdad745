//! A shared-memory segment larger than its directory's free space is an
//! error at creation that names the size, the directory and the space left
//! (it used to succeed sparse, and the rank, or over tcp the target rank,
//! died of SIGBUS when a page past the free space was first touched).
//!
//! The test runs itself again inside a private mount namespace with a
//! 64 MiB tmpfs as `GIN_SHM_DIR` (Docker's default /dev/shm size). Needs
//! root and util-linux's `unshare`; skipped with a printed reason otherwise.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::process::Command;

use gin_net::shm::{Segment, shm_dir};

/// Set in the child that runs inside the namespace.
const CHILD: &str = "GIN_NET_TEST_SMALL_SHM_CHILD";

/// What the child checks, on the small tmpfs.
fn in_the_small_tmpfs() {
    let dir = shm_dir();
    // A fitting segment is fine, and its pages are really there.
    let mut small = Segment::create("gin-test-fits", 16 << 20).unwrap();
    // SAFETY: the segment is 16 MiB, mapped here only.
    unsafe { std::ptr::write_bytes(small.as_ptr(), 0xA5, 16 << 20) };
    small.unlink();
    drop(small);
    let e = match Segment::create("gin-test-too-big", 256 << 20) {
        Ok(mut s) => {
            s.unlink();
            panic!("a 256 MiB segment was created in a 64 MiB tmpfs (its pages were not reserved)");
        }
        Err(e) => e.to_string(),
    };
    assert!(e.contains("268435456 bytes"), "the size is not named: {e}");
    assert!(
        e.contains(&dir.display().to_string()),
        "the directory is not named: {e}"
    );
    assert!(e.contains("free"), "the free space is not named: {e}");
    let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
    assert!(left.is_empty(), "a refused segment left files: {left:?}");
    println!("child: refused as expected: {e}");
}

#[test]
fn a_segment_larger_than_the_free_shared_memory_is_refused_at_creation() {
    if std::env::var_os(CHILD).is_some() {
        in_the_small_tmpfs();
        return;
    }
    let dir = std::env::temp_dir().join(format!("gin-small-shm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let exe = std::env::current_exe().unwrap();
    let script = format!(
        "mount -t tmpfs -o size=64m gin-small-shm '{d}' || exit 77; exec '{exe}' --exact \
         a_segment_larger_than_the_free_shared_memory_is_refused_at_creation --nocapture",
        d = dir.display(),
        exe = exe.display()
    );
    let out = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", &script])
        .env(CHILD, "1")
        .env("GIN_SHM_DIR", &dir)
        .output();
    let _ = std::fs::remove_dir(&dir);
    let out = match out {
        Ok(o) => o,
        Err(e) => {
            println!("SKIPPED: cannot run unshare here ({e})");
            return;
        }
    };
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.code() == Some(77) || (!out.status.success() && text.contains("unshare failed")) {
        println!("SKIPPED: cannot mount a private tmpfs here (needs root): {text}");
        return;
    }
    assert!(
        out.status.success(),
        "the child failed: {:?}\n{text}",
        out.status
    );
    assert!(text.contains("refused as expected"), "{text}");
    println!("{text}");
}
