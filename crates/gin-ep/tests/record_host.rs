//! The kernels' error records (`kernels/ll.cu`'s `ep::rec`, compiled as
//! host C++): the first error of any kind in slot 0, the first that is not
//! a refusal in slot 1 whatever came before it, so that a refusal recorded
//! first (a peer's refused inputs, in one of several steps queued between
//! two checks) never hides a broken protocol recorded after it (a count
//! above the maximum, a token index out of range); a rank whose own inputs
//! were refused still records a source's count above the maximum
//! (`tests/record_host.cpp`). `cuda::dev`'s unit tests read such words as
//! the host does.
//!
//! Needs a C++ compiler (`CXX`, else `c++`): skipped with a printed reason
//! where there is none, except in CI (`CI` set), where that is a failure.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::process::Command;

mod common;

#[test]
fn a_refusal_recorded_first_never_hides_a_broken_protocol() {
    let Some(exe) = common::compile("record_host", &[], "error record check") else {
        return;
    };
    let out = Command::new(&exe).output().unwrap();
    let _ = std::fs::remove_file(&exe);
    assert!(
        out.status.success(),
        "the kernels' error records failed: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}
