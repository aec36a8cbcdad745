//! Device communicators' signal and counter ranges are placed alike on
//! every rank, or every rank fails alike: CPU and CUDA ranks share that
//! step (`requirements::reserve`), checked here on CPU ranks through the
//! host API. Ranks are threads of this process.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use gin_bootstrap::{Config, run_threads};
use gin_core::{Comm, CoreError, DevCommRequirements, Settings};

#[test]
fn ranks_that_destroyed_in_different_orders_fail_alike_and_recover_once_they_agree() {
    let out = run_threads(2, Config::default(), |b| {
        let comm = Comm::with_settings(b, Settings::from_vars(|_| None).unwrap()).unwrap();
        let req = DevCommRequirements::default();
        let (first, second) = (comm.dev_comm(&req).unwrap(), comm.dev_comm(&req).unwrap());
        // Each rank destroys a different one: their free ranges differ.
        let (gone, kept) = if comm.rank() == 0 {
            (first, second)
        } else {
            (second, first)
        };
        gone.destroy().unwrap();
        let e = comm.dev_comm(&req).unwrap_err();
        assert!(
            matches!(&e, CoreError::Mismatch { what, .. } if what == "signal placement"),
            "{e}"
        );
        assert!(e.to_string().contains("different orders"), "{e}");
        // The failed creation gave its ranges back: once both ranks hold
        // nothing, they place alike again.
        kept.destroy().unwrap();
        comm.dev_comm(&req).unwrap().destroy().unwrap();
    });
    out.unwrap();
}
