//! NVRTC compiles the header tree and every kernel of this crate, and
//! refuses what gin cannot honour under NCCL's names (no GPU needed, only
//! libnvrtc: CI installs it with the nvcc wheels).

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use gin_core::cuda::nvrtc::compile;

/// NVRTC compiles the header tree and every kernel (no GPU needed, only
/// libnvrtc: CI installs it with the nvcc wheels). Skipped with a reason
/// where NVRTC cannot be loaded, except under `GIN_REQUIRE_NVRTC=1`.
#[test]
fn nvrtc_compiles_the_kernels_for_hopper() {
    if !gin_cuda::nvrtc::is_available() {
        assert!(
            std::env::var_os("GIN_REQUIRE_NVRTC").is_none(),
            "GIN_REQUIRE_NVRTC is set but libnvrtc cannot be loaded"
        );
        eprintln!("skipped: libnvrtc.so.13 cannot be loaded (add its folder to LD_LIBRARY_PATH)");
        return;
    }
    let cubin =
        compile(gin_selftest::KERNELS, "selftest.cu", (9, 0)).unwrap_or_else(|e| panic!("{e}"));
    // An ELF image.
    assert_eq!(&cubin.as_bytes()[..4], b"\x7fELF");
    compile(gin_selftest::NCCL_ALLTOALL, "nccl_alltoall.cu", (9, 0))
        .unwrap_or_else(|e| panic!("{e}"));
    let err = compile(
        "#include \"gin/gin.cuh\"\n__global__ void k() { undefined(); }",
        "bad.cu",
        (9, 0),
    )
    .expect_err("a kernel calling an undefined function must not compile");
    assert!(err.to_string().contains("undefined"), "{err}");
}

/// What gin cannot honour under NCCL's names fails to compile, with a
/// message that says why (gin/nccl_compat.cuh, docs/porting.md).
#[test]
fn nvrtc_compiles_no_nccl_name_gin_cannot_honour() {
    if !gin_cuda::nvrtc::is_available() {
        assert!(std::env::var_os("GIN_REQUIRE_NVRTC").is_none());
        return;
    }
    let head = "#include \"gin/nccl_compat.cuh\"\nextern \"C\" __global__ void k(ncclWindow_t w, \
                ncclDevComm c) { ncclGin g{c, 0}; ncclTeam t = ncclTeamWorld(c); ";
    for (body, why) in [
        (
            "g.put(t, 1, w, 0, w, 0, 8, ncclGin_WeakVASignalInc{w, 0});",
            "VA signals",
        ),
        ("g.waitSignal(ncclCoopCta(), w, 0, 1);", "VA signals"),
        ("g.putValue(t, 1, w, 0, 7u);", "putValue of 1, 2 or 4 bytes"),
        ("g.flush(ncclCoopLanes{3u});", "this coop is not supported"),
        ("g.flush(ncclCoopTile<4>());", "this coop is not supported"),
        ("g.getSignalShadowPtr(0u);", "signal shadows"),
        ("ncclTeamLsa(c);", "ncclTeamLsa"),
        ("ncclSymPtr<float> p;", "ncclSymPtr"),
        (
            "g.get(t, 1, w, 0, w, 0, 8, ncclCoopThread(), ncclGin_None{}, 0u, ncclGin_SegmentHostNuma{});",
            "host-memory segments",
        ),
        (
            "ncclGinBarrierSession<ncclCoopCta> b{ncclCoopCta(), g, t, ncclGinBarrierHandle{0}, 0};",
            "world and rail barriers only",
        ),
        (
            "ncclGinBarrierSession<ncclCoopCta> b{ncclCoopCta(), g, ncclTeamTagWorld(), 0}; \
             b.sync(ncclCoopCta(), cuda::memory_order_acquire, ncclGinFenceLevel::None, 10ull);",
            "per-call barrier timeouts",
        ),
    ] {
        let src = format!("{head}{body} (void)t; }}");
        let Err(err) = compile(&src, "refused.cu", (9, 0)) else {
            panic!("{body} must not compile");
        };
        assert!(err.to_string().contains(why), "{body}: {err}");
    }
}
