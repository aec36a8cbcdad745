//! The dispatch kernel's grid barrier (`kernels/ll.cu`'s `ep::barrier`,
//! compiled as host C++): its state lives on the device alone, so the
//! barrier must hold launch after launch on one counter nothing resets (a
//! CUDA graph replayed many times), with grids of varying sizes and blocks
//! arriving in any order: no block passes before the last arrives, all pass
//! once it has, and the counter's low bits return to 0
//! (`tests/barrier_host.cpp` runs 20,000 launches).
//!
//! Needs a C++ compiler (`CXX`, else `c++`): skipped with a printed reason
//! where there is none, except in CI (`CI` set), where that is a failure.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::process::Command;

mod common;

#[test]
fn the_grid_barrier_holds_across_launches_without_a_reset() {
    let Some(exe) = common::compile("barrier_host", &[], "grid barrier check") else {
        return;
    };
    let out = Command::new(&exe).output().unwrap();
    let _ = std::fs::remove_file(&exe);
    assert!(
        out.status.success(),
        "the grid barrier failed: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}
