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
    compile(gin_selftest::PARITY, "parity.cu", (9, 0)).unwrap_or_else(|e| panic!("{e}"));
    let err = compile(
        "#include \"gin/gin.cuh\"\n__global__ void k() { undefined(); }",
        "bad.cu",
        (9, 0),
    )
    .expect_err("a kernel calling an undefined function must not compile");
    assert!(err.to_string().contains("undefined"), "{err}");
}

/// NCCL's all-to-all kernel compiles as CUDA ranks compile it at run time
/// (`CudaComm::compile`: CCCL's include folder added where it is found, as
/// on a machine with the CUDA toolkit). On the H200 this failed once: with
/// CCCL reachable, `gin/nccl_compat.cuh`'s stand-in `int64_t` clashed with
/// the one `<cuda/atomic>` brings. Requires CCCL under
/// `GIN_REQUIRE_NVRTC=1` (`.ci/nvcc-check`: the nvcc wheel carries it).
#[test]
fn nvrtc_compiles_the_nccl_kernel_with_cccl_reachable() {
    if !gin_cuda::nvrtc::is_available() {
        assert!(
            std::env::var_os("GIN_REQUIRE_NVRTC").is_none(),
            "GIN_REQUIRE_NVRTC is set but libnvrtc cannot be loaded"
        );
        eprintln!("skipped: libnvrtc.so.13 cannot be loaded (add its folder to LD_LIBRARY_PATH)");
        return;
    }
    let Some(cccl) = gin_core::cuda::nvrtc::cccl_dir() else {
        assert!(
            std::env::var_os("GIN_REQUIRE_NVRTC").is_none(),
            "GIN_REQUIRE_NVRTC is set but CCCL was not found beside NVRTC"
        );
        eprintln!("skipped: CCCL's include folder was not found");
        return;
    };
    let opts = gin_core::cuda::nvrtc::CompileOptions::default();
    gin_core::cuda::nvrtc::compile_with(
        gin_selftest::NCCL_ALLTOALL,
        "nccl_alltoall.cu",
        (9, 0),
        &opts,
    )
    .unwrap_or_else(|e| panic!("with CCCL at {}: {e}", cccl.display()));
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
            "struct V { long a, b; }; g.putValue(t, 1, w, 0, V{1, 2});",
            "putValue takes a value of 1, 2, 4 or 8 bytes",
        ),
        ("g.put(t, 1, w, 0, w, 0, 8, 5u);", "not a remote action"),
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
    ] {
        let src = format!("{head}{body} (void)t; }}");
        let Err(err) = compile(&src, "refused.cu", (9, 0)) else {
            panic!("{body} must not compile");
        };
        assert!(err.to_string().contains(why), "{body}: {err}");
    }
}

/// NCCL's names that map onto the header-parity calls compile: VA signals
/// as actions and their read/wait/reset, weak signals, putValue of 1, 2, 4
/// and 8 bytes, flushAsync/wait, fence levels, a barrier with a timeout.
#[test]
fn nvrtc_compiles_nccl_names_of_the_parity_calls() {
    if !gin_cuda::nvrtc::is_available() {
        assert!(std::env::var_os("GIN_REQUIRE_NVRTC").is_none());
        return;
    }
    let src = "#include \"gin/nccl_compat.cuh\"\n\
        extern \"C\" __global__ void k(ncclWindow_t w, ncclDevComm c) {\n\
          ncclGin g{c, 0};\n\
          ncclTeam t = ncclTeamWorld(c);\n\
          g.put(t, 1, w, 0, w, 0, 8, ncclGin_WeakVASignalInc{w, 0});\n\
          g.put(t, 1, w, 0, w, 0, 8, ncclGin_StrongVASignalAdd{w, 8, 3});\n\
          g.signal(t, 1, ncclGin_VASignalInc{w, 0});\n\
          g.waitSignal(ncclCoopCta(), w, 0, 1);\n\
          g.waitSignal(ncclCoopWarp(), w, 0, 1, 32);\n\
          (void)g.readSignal(w, 0);\n\
          g.resetSignal(w, 0);\n\
          g.putValue(t, 1, w, 4, 7u);\n\
          g.putValue(t, 1, w, 2, (unsigned short)7);\n\
          g.putValue(t, 1, w, 1, (unsigned char)7, ncclGin_WeakSignalInc{0});\n\
          g.putValue(t, 1, w, 8, 7.0);\n\
          ncclGinRequest_t r;\n\
          g.flushAsync(t, 1, &r);\n\
          g.wait(r);\n\
          ncclGinBarrierSession<ncclCoopCta> b{ncclCoopCta(), g, ncclTeamTagWorld(), 0};\n\
          b.sync(ncclCoopCta(), cuda::memory_order_acquire, ncclGinFenceLevel::None);\n\
          if (b.sync(ncclCoopCta(), cuda::memory_order_acquire, ncclGinFenceLevel::Put, 10ull) \
              == ncclTimeout) return;\n\
          ncclGinBarrierSession<ncclCoopCta> a{ncclCoopCta(), ncclGinAllContexts(c), \
              ncclTeamTagWorld(), 0};\n\
          a.sync(ncclCoopCta(), cuda::memory_order_acquire);\n\
        }\n";
    compile(src, "parity_names.cu", (9, 0)).unwrap_or_else(|e| panic!("{e}"));
}

/// NVRTC finds a user's header through `include_dirs`, applies the
/// defines, and (where CCCL is found) compiles `<cuda/atomic>` beside
/// gin's headers (`gin_core::cuda::nvrtc::compile_with`, what
/// `CudaComm::compile_with` compiles with). Skipped where NVRTC cannot be
/// loaded, except under `GIN_REQUIRE_NVRTC=1` (.ci/nvcc-check).
#[test]
fn nvrtc_compiles_a_users_kernel_with_its_include_folder_and_cccl() {
    use gin_core::cuda::nvrtc::{CompileOptions, cccl_dir, compile_with};
    if !gin_cuda::nvrtc::is_available() {
        assert!(
            std::env::var_os("GIN_REQUIRE_NVRTC").is_none(),
            "GIN_REQUIRE_NVRTC is set but libnvrtc cannot be loaded"
        );
        eprintln!("skipped: libnvrtc.so.13 cannot be loaded (add its folder to LD_LIBRARY_PATH)");
        return;
    }
    let root = std::env::temp_dir().join(format!("gin-user-inc-{}", std::process::id()));
    std::fs::create_dir_all(root.join("mine")).unwrap();
    std::fs::write(
        root.join("mine/op.cuh"),
        "#pragma once\n__device__ inline unsigned long long twice(unsigned long long v)              { return USER_K * v; }\n",
    )
    .unwrap();
    let cccl = cccl_dir();
    let src = format!(
        "#include \"gin/gin.cuh\"\n#include \"mine/op.cuh\"\n{}\n             extern \"C\" __global__ void k(gin::DevComm dc, unsigned long long* p) {{\n               p[0] = twice(dc.rank);\n{}\n}}\n",
        if cccl.is_some() {
            "#include <cuda/atomic>"
        } else {
            ""
        },
        if cccl.is_some() {
            "cuda::atomic_ref<unsigned long long, cuda::thread_scope_device> a(p[1]);                  a.fetch_add(1);"
        } else {
            ""
        }
    );
    let opts = CompileOptions {
        include_dirs: vec![root.clone()],
        defines: vec![("USER_K".into(), Some("2ull".into()))],
        extra_opts: vec!["-maxrregcount=64".into()],
    };
    let r = compile_with(&src, "user.cu", (9, 0), &opts);
    // Without the define, the header does not compile: it was applied.
    let without = compile_with(
        &src,
        "user.cu",
        (9, 0),
        &CompileOptions {
            defines: Vec::new(),
            ..opts.clone()
        },
    );
    std::fs::remove_dir_all(&root).unwrap();
    let cubin = r.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(&cubin.as_bytes()[..4], b"\x7fELF");
    let e = without.expect_err("USER_K undefined");
    assert!(e.to_string().contains("USER_K"), "{e}");
    if cccl.is_none() {
        eprintln!("note: CCCL not found; <cuda/atomic> was not tried");
    }
}

/// The kernels compile through NVRTC with fewer queue paths
/// (`GIN_QUEUE_PATHS`, gin/gin.cuh), as `gin-bench cuda --queue-paths none`
/// and the selftest's `queue-paths` scenario build them; a mask with other
/// bits is refused, naming the macro.
#[test]
fn nvrtc_compiles_the_kernels_with_each_queue_path_mask() {
    if !gin_cuda::nvrtc::is_available() {
        assert!(std::env::var_os("GIN_REQUIRE_NVRTC").is_none());
        return;
    }
    let with = |mask: &str| gin_core::cuda::nvrtc::CompileOptions {
        defines: vec![("GIN_QUEUE_PATHS".into(), Some(mask.into()))],
        ..Default::default()
    };
    for mask in ["0", "1", "2", "3"] {
        gin_core::cuda::nvrtc::compile_with(
            gin_selftest::KERNELS,
            "selftest.cu",
            (9, 0),
            &with(mask),
        )
        .unwrap_or_else(|e| panic!("GIN_QUEUE_PATHS={mask}: {e}"));
    }
    let e = gin_core::cuda::nvrtc::compile_with(
        gin_selftest::KERNELS,
        "selftest.cu",
        (9, 0),
        &with("4"),
    )
    .expect_err("an unknown queue path bit must not compile");
    assert!(e.to_string().contains("GIN_QUEUE_PATHS"), "{e}");
}
