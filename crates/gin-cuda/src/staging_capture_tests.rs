//! A peer's put staged into GPU memory while a user's thread captures a
//! stream in global mode, on a real GPU (GPU 0), opt-in: they run only with
//! `GIN_GPU_TESTS=1` (and say they skipped otherwise), as CI has no GPU.
//! Built here and run on the GPU machine:
//!
//! ```text
//! cargo test -p gin-cuda --lib --no-run      # prints target/debug/deps/gin_cuda-<hash>
//! GIN_GPU_TESTS=1 ./gin_cuda-<hash> capture_tests --test-threads=1 --nocapture
//! ```

#![allow(clippy::unwrap_used)]

use super::*;
use crate::driver::DevMem;
use cudarc::driver::sys as cu;

/// GPU 0, current on this thread, where `GIN_GPU_TESTS=1`.
fn gpu() -> Option<Arc<Device>> {
    if std::env::var("GIN_GPU_TESTS").as_deref() != Ok("1") {
        eprintln!("skipped: set GIN_GPU_TESTS=1 to run the capture tests on GPU 0");
        return None;
    }
    let d = Device::open(0).unwrap();
    d.make_current().unwrap();
    Some(Arc::new(d))
}

/// Runs `f` on another thread while this one captures `capturing` in global
/// mode; returns what `f` returned and whether the capture survived (ended
/// with a graph, not invalidated).
fn during_global_capture<T: Send>(
    dev: &Arc<Device>,
    capturing: &Stream,
    f: impl FnOnce() -> T + Send,
) -> (T, bool) {
    // SAFETY: a stream of this context, not capturing yet.
    let r = unsafe {
        cu::cuStreamBeginCapture_v2(
            capturing.raw(),
            cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
        )
    };
    assert_eq!(r, cu::CUresult::CUDA_SUCCESS, "cuStreamBeginCapture");
    let out = std::thread::scope(|s| {
        s.spawn(|| {
            dev.make_current().unwrap();
            f()
        })
        .join()
        .unwrap()
    });
    let mut graph = std::ptr::null_mut();
    // SAFETY: the capture begun above, on this thread.
    let ended = unsafe { cu::cuStreamEndCapture(capturing.raw(), &raw mut graph) };
    if !graph.is_null() {
        // SAFETY: the graph the capture made, destroyed once.
        unsafe { cu::cuGraphDestroy(graph) };
    }
    (out, ended == cu::CUresult::CUDA_SUCCESS)
}

#[test]
fn a_put_staged_into_gpu_memory_during_a_users_global_capture_lands_and_leaves_it_whole() {
    let Some(dev) = gpu() else { return };
    let capturing = Stream::new().unwrap();
    // The hazard itself: a thread in the default (global) mode that waits
    // on a stream of its own while another thread captures in global mode is
    // refused, and the capture invalidated. This is what a transport's
    // thread staging a peer's put met before its copies were relaxed (the
    // H200 run of `fused-graph-tcp-proxy`, 2026-11-26).
    let other = Stream::new().unwrap();
    let (strict, whole) = during_global_capture(&dev, &capturing, || {
        // SAFETY: a live stream of this context.
        unsafe { cu::cuStreamSynchronize(other.raw()) }
    });
    assert_eq!(strict, cu::CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    assert!(
        !whole,
        "the refused call should have invalidated the capture"
    );

    // A peer's put and get through the staging server, during a capture.
    let mem = DevMem::new(1 << 20).unwrap();
    let server = Arc::new(Server::new(Arc::clone(&dev)).unwrap());
    // SAFETY: `mem` is this GPU's memory and outlives `region`.
    let region = unsafe { GpuRegion::new(mem.ptr(), 1 << 20, server) };
    let data: Vec<u8> = (0..(300 << 10)).map(|i| (i * 7 + 3) as u8).collect();
    let (wrote, whole) = during_global_capture(&dev, &capturing, || region.write(4096, &data));
    assert_eq!(wrote, Ok(()));
    assert!(whole, "staging a put invalidated the user's capture");
    let mut back = vec![0u8; data.len()];
    let (read, whole) = during_global_capture(&dev, &capturing, || region.read(4096, &mut back));
    assert_eq!(read, Ok(()));
    assert!(whole, "staging a get invalidated the user's capture");
    assert!(
        back == data,
        "the bytes read back differ from those written"
    );
    // The staging thread's own mode comes back after the copy: a strict
    // call it makes next is refused again (the relaxation is scoped to the
    // copy, as a user's thread may stage too).
    let ((wrote, strict), _) = during_global_capture(&dev, &capturing, || {
        let wrote = region.write(0, &data[..4096]);
        // SAFETY: as above.
        (wrote, unsafe { cu::cuStreamSynchronize(other.raw()) })
    });
    assert_eq!(wrote, Ok(()));
    assert_eq!(strict, cu::CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
}

/// The hook a transport runs on its own thread to enter a GPU region's
/// context (UCX's progress thread) relaxes that thread's stream-capture
/// mode for good: the CUDA calls UCX makes there after it returned go on
/// during a user's global capture and leave it whole, where the same
/// thread's wait without the hook is refused.
#[test]
fn a_gpu_regions_context_hook_relaxes_the_transport_thread_it_runs_on_for_good() {
    let Some(dev) = gpu() else { return };
    let capturing = Stream::new().unwrap();
    let other = Stream::new().unwrap();
    let mem = DevMem::new(1 << 16).unwrap();
    let server = Arc::new(Server::new(Arc::clone(&dev)).unwrap());
    // SAFETY: `mem` is this GPU's memory and outlives `region`.
    let region = unsafe { GpuRegion::new(mem.ptr(), 1 << 16, server) };
    let hook = region.thread_context().unwrap();
    let wait = || {
        // SAFETY: a live stream of this context.
        unsafe { cu::cuStreamSynchronize(other.raw()) }
    };
    let (strict, whole) = during_global_capture(&dev, &capturing, wait);
    assert_eq!(strict, cu::CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    assert!(
        !whole,
        "the refused call should have invalidated the capture"
    );
    let (relaxed, whole) = during_global_capture(&dev, &capturing, || {
        hook();
        let first = wait();
        // Still relaxed at the next call: for good, not for one.
        (first, wait())
    });
    assert_eq!(
        relaxed,
        (cu::CUresult::CUDA_SUCCESS, cu::CUresult::CUDA_SUCCESS)
    );
    assert!(
        whole,
        "a transport thread's wait invalidated the user's capture"
    );
}
