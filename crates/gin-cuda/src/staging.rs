//! GPU memory over TCP: how CUDA ranks reach a peer the fabric reaches over
//! TCP (another host, or `GIN_TRANSPORT=tcp`), where neither CUDA IPC nor
//! NVLink load/store can.
//!
//! - **Serving.** Each window part is registered in the rank's region table
//!   behind a [`GpuRegion`], so gin-net's TCP server checks key, bounds and
//!   rights as for host memory, then copies each chunk between a pinned
//!   buffer and the GPU with the copy engine and waits for it. A peer's
//!   signal is an 8-byte put of its running total into its own sub-slot,
//!   sent after the data on the same ordered connection: the copy engine
//!   has no atomics, and none are needed.
//! - **Sending.** The CUDA proxy and the soft NIC stage a put's source
//!   into their own pinned buffer on the queue's stream, wait, and hand the
//!   bytes to the fabric (`Fabric::put_key`); a read's answer lands in the
//!   buffer (`Fabric::read_key`) and is copied to the GPU ([`Stage::fetch`]).
//!
//! Every staged copy is waited for, so on these paths the proxy and the NIC
//! wait for the GPU's copy engine (not for kernels): correctness first, one
//! chunk in flight per queue.

use std::mem::ManuallyDrop;
use std::sync::{Arc, Mutex, PoisonError};

use gin_net::region::{Backing, ThreadContext};

use crate::batch::Dma;
use crate::driver::{Device, HostMem, Stream, span};
use crate::error::CudaError;

/// Bytes staged at a time (the TCP server's chunk, too).
pub const STAGE: usize = 1 << 20;

/// A pinned staging buffer of [`STAGE`] bytes, for one transfer at a time.
#[derive(Debug)]
pub struct Stage {
    mem: ManuallyDrop<HostMem>,
    /// A get timed out: the link may still write the buffer, so it is
    /// never freed.
    abandoned: bool,
}

impl Stage {
    /// Allocates the buffer (pinned, mapped for the current context).
    pub fn new() -> Result<Self, CudaError> {
        Ok(Self {
            mem: ManuallyDrop::new(HostMem::new(STAGE)?),
            abandoned: false,
        })
    }

    /// Copies `n` (at most [`STAGE`]) bytes at device address `src` into
    /// the buffer with `stream`, after its earlier work, and waits.
    ///
    /// # Safety
    /// `src` must be readable for `n.min(STAGE)` bytes by `stream` until
    /// this returns.
    pub unsafe fn pull(
        &mut self,
        stream: &impl Dma,
        src: u64,
        n: usize,
    ) -> Result<&[u8], CudaError> {
        let n = n.min(STAGE);
        // SAFETY: the buffer holds STAGE bytes and is ours while `self` is
        // borrowed; `src` is the caller's contract; waited for below.
        unsafe { stream.copy(self.mem.dev(), src, n)? };
        stream.sync()?;
        // SAFETY: the buffer holds STAGE bytes and the copy into it finished.
        Ok(unsafe { std::slice::from_raw_parts(self.mem.host_ptr(), n) })
    }

    /// Copies `data` (at most [`STAGE`] bytes) to device address `dst`
    /// with `stream` and waits: the buffer is free again on return.
    ///
    /// # Safety
    /// `dst` must be writable for `data.len().min(STAGE)` bytes by `stream`
    /// until this returns.
    pub unsafe fn push(
        &mut self,
        stream: &impl Dma,
        dst: u64,
        data: &[u8],
    ) -> Result<(), CudaError> {
        let n = data.len().min(STAGE);
        // SAFETY: the buffer holds STAGE bytes; nothing else uses it now.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.mem.host_ptr(), n) };
        // SAFETY: the caller's contract.
        unsafe { self.land(stream, dst, n) }
    }

    /// Copies the buffer's first `n` bytes to `dst` and waits.
    ///
    /// # Safety
    /// As for [`Stage::push`].
    unsafe fn land(&mut self, stream: &impl Dma, dst: u64, n: usize) -> Result<(), CudaError> {
        // SAFETY: the buffer holds STAGE >= n bytes; `dst` is the caller's
        // contract; waited for below.
        unsafe { stream.copy(dst, self.mem.dev(), n)? };
        stream.sync()
    }
}

impl Stage {
    /// Lets `read` fill the buffer's first `n` (at most [`STAGE`]) bytes —
    /// a blocking read that writes nothing once it has returned, such as
    /// `gin_net::Fabric::read_key` — then copies them to device address
    /// `dst` with `stream` and waits.
    ///
    /// # Safety
    /// `dst` must be writable for `n.min(STAGE)` bytes by `stream` until
    /// this returns.
    pub unsafe fn fetch(
        &mut self,
        n: usize,
        stream: &impl Dma,
        dst: u64,
        read: impl FnOnce(&mut [u8]) -> Result<(), gin_net::NetError>,
    ) -> Result<(), CudaError> {
        let n = n.min(STAGE);
        // SAFETY: the buffer holds STAGE >= n bytes, is ours while `self`
        // is borrowed mutably, and no copy touches it now (every copy
        // into or out of it was waited for).
        let buf = unsafe { std::slice::from_raw_parts_mut(self.mem.host_ptr(), n) };
        read(buf)?;
        // SAFETY: the caller's contract.
        unsafe { self.land(stream, dst, n) }
    }
}

impl Drop for Stage {
    fn drop(&mut self) {
        if !self.abandoned {
            // SAFETY: dropped once, here; nothing refers to it any more.
            unsafe { ManuallyDrop::drop(&mut self.mem) };
        }
    }
}

/// What every GPU window part a rank serves to TCP peers shares: one
/// staging buffer and stream, used by one request at a time.
#[derive(Debug)]
pub struct Server {
    io: Mutex<(Stage, Stream)>,
    /// Last: the context must outlive the buffer and stream.
    dev: Arc<Device>,
}

impl Server {
    /// Sets up the buffer and stream on `dev`.
    pub fn new(dev: Arc<Device>) -> Result<Self, CudaError> {
        dev.make_current()?;
        Ok(Self {
            io: Mutex::new((Stage::new()?, Stream::new()?)),
            dev,
        })
    }
}

/// One GPU window part as a region of the rank's region table: gin-net's
/// TCP server checks every request against the region, then calls here,
/// and the part's own bounds are checked again before any copy.
pub struct GpuRegion {
    ptr: u64,
    len: u64,
    server: Arc<Server>,
    /// Makes the GPU's context current on a transport's thread (one per
    /// region, so a transport can tell it has it already). It holds the
    /// device weakly: a transport keeping the hook does not keep the
    /// device, its context or its pooled memory alive.
    context: ThreadContext,
}

impl std::fmt::Debug for GpuRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuRegion")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl GpuRegion {
    /// Serves the `len` bytes of device memory at `ptr` through `server`.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be device memory of `server`'s GPU that stays
    /// allocated as long as this region can be called (remove it from the
    /// region table before freeing the memory), and that peers may read
    /// and write.
    pub unsafe fn new(ptr: u64, len: u64, server: Arc<Server>) -> Self {
        let dev = Arc::downgrade(&server.dev);
        let context: ThreadContext = Arc::new(move || {
            // A device already gone has no context to make current; the
            // region is then gone from the table too.
            let Some(dev) = dev.upgrade() else { return };
            if let Err(e) = dev.make_current() {
                tracing::warn!(error = %e, "making the GPU context current on a transport thread");
            }
            // A transport's own thread (UCX's progress thread: UCX's CUDA
            // calls there map GPU regions, execute peers' emulated writes
            // and complete this rank's puts from GPU memory) must not be
            // refused while a user's thread captures a stream in global
            // mode, nor invalidate that capture. Transports run this hook
            // on their own threads only, which make no capture of their
            // own (`Backing::thread_context`): relaxed for good, as the
            // engines' threads are.
            if let Err(e) = crate::RelaxedCapture::for_this_thread() {
                tracing::warn!(error = %e, "relaxing a transport thread's stream-capture mode");
            }
        });
        Self {
            ptr,
            len,
            server,
            context,
        }
    }

    /// The device address `offset` bytes in, where `bytes` fit from there.
    fn at(&self, op: &'static str, offset: u64, bytes: usize) -> Result<u64, CudaError> {
        span(op, "GPU window part", offset, bytes as u64, self.len)?;
        Ok(self.ptr + offset)
    }

    fn io<T>(
        &self,
        f: impl FnOnce(&mut Stage, &Stream) -> Result<T, CudaError>,
    ) -> Result<T, String> {
        let mut g = self
            .server
            .io
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let (stage, stream) = &mut *g;
        // A peer's put can arrive while a user's thread captures a stream
        // in global mode: the staging copy and its wait must not be refused
        // for it (which also invalidated the capture).
        self.server
            .dev
            .make_current()
            .and_then(|()| crate::RelaxedCapture::enter())
            .and_then(|_relaxed| f(stage, stream))
            .map_err(|e| format!("staging GPU memory: {e}"))
    }
}

impl Backing for GpuRegion {
    fn write(&self, offset: u64, data: &[u8]) -> Result<(), String> {
        let dst = self
            .at("write", offset, data.len())
            .map_err(|e| format!("staging GPU memory: {e}"))?;
        self.io(|stage, stream| {
            for (i, c) in data.chunks(STAGE).enumerate() {
                // SAFETY: inside the part (checked above), which stays
                // allocated while registered (`new`'s contract); the push
                // waits for its copy.
                unsafe { stage.push(stream, dst + (i * STAGE) as u64, c)? };
            }
            Ok(())
        })
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), String> {
        let src = self
            .at("read", offset, out.len())
            .map_err(|e| format!("staging GPU memory: {e}"))?;
        self.io(|stage, stream| {
            for (i, c) in out.chunks_mut(STAGE).enumerate() {
                // SAFETY: as for `write`; the pull waits for its copy.
                let bytes = unsafe { stage.pull(stream, src + (i * STAGE) as u64, c.len())? };
                c.copy_from_slice(bytes);
            }
            Ok(())
        })
    }

    /// The part's GPU context, made current on a transport's own thread
    /// (UCX's progress thread maps the part and executes peers' emulated
    /// writes into it), whose stream-capture mode it also relaxes for good
    /// (see [`Backing::thread_context`]): the same hook every time,
    /// holding the device weakly. A failure is logged, not raised: the call UCX makes
    /// next then fails with its own error, which the peer is answered
    /// with.
    fn thread_context(&self) -> Option<ThreadContext> {
        Some(Arc::clone(&self.context))
    }
}

#[cfg(test)]
#[path = "staging_capture_tests.rs"]
mod capture_tests;
