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
//!   bytes to the link; a get lands in the buffer and is copied to the GPU.
//!
//! Every staged copy is waited for, so on these paths the proxy and the NIC
//! wait for the GPU's copy engine (not for kernels): correctness first, one
//! chunk in flight per queue.

use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use gin_net::region::Backing;
use gin_net::tcp::Link;

use super::batch::Dma;
use super::driver::{Device, HostMem, Stream};
use crate::error::CoreError;

/// Bytes staged at a time (the TCP server's chunk, too).
pub(crate) const STAGE: usize = 1 << 20;

/// A pinned staging buffer of [`STAGE`] bytes.
#[derive(Debug)]
pub(crate) struct Stage {
    mem: ManuallyDrop<HostMem>,
    /// A get timed out: the link may still write the buffer, so it is
    /// never freed.
    abandoned: bool,
}

impl Stage {
    pub fn new() -> Result<Self, CoreError> {
        Ok(Self {
            mem: ManuallyDrop::new(HostMem::new(STAGE)?),
            abandoned: false,
        })
    }

    /// Copies `n` (at most [`STAGE`]) bytes at device address `src` into
    /// the buffer with `stream`, after its earlier work, and waits.
    pub fn pull(&mut self, stream: &impl Dma, src: u64, n: usize) -> Result<&[u8], CoreError> {
        let n = n.min(STAGE);
        stream.copy(self.mem.dev, src, n)?;
        stream.sync()?;
        // SAFETY: the buffer holds STAGE bytes and the copy into it finished.
        Ok(unsafe { std::slice::from_raw_parts(self.mem.host, n) })
    }

    /// Copies `data` (at most [`STAGE`] bytes) to device address `dst`
    /// with `stream` and waits: the buffer is free again on return.
    pub fn push(&mut self, stream: &impl Dma, dst: u64, data: &[u8]) -> Result<(), CoreError> {
        let n = data.len().min(STAGE);
        // SAFETY: the buffer holds STAGE bytes; nothing else uses it now.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.mem.host, n) };
        self.land(stream, dst, n)
    }

    fn land(&mut self, stream: &impl Dma, dst: u64, n: usize) -> Result<(), CoreError> {
        stream.copy(dst, self.mem.dev, n)?;
        stream.sync()
    }

    /// Reads `n` (at most [`STAGE`]) bytes at `(key, off)` of `link`'s peer
    /// into the buffer, waiting up to `timeout`, then copies them to device
    /// address `dst` with `stream` and waits.
    #[allow(clippy::too_many_arguments)] // one staged get, spelled out
    pub fn get(
        &mut self,
        link: &Link,
        key: u32,
        off: u64,
        n: usize,
        stream: &impl Dma,
        dst: u64,
        timeout: Duration,
    ) -> Result<(), String> {
        let n = n.min(STAGE);
        let done = Arc::new(AtomicU64::new(1));
        // SAFETY: the buffer holds STAGE bytes and stays valid until `done`
        // drops: every return below but the timeout's comes after that, and
        // after a timeout the buffer is never freed (`abandoned`).
        unsafe { link.get(key, off, n as u64, self.mem.host, done.clone(), None) }
            .map_err(|e| e.to_string())?;
        let start = Instant::now();
        while done.load(Ordering::Acquire) != 0 {
            if start.elapsed() > timeout {
                self.abandoned = true;
                return Err(format!(
                    "rank {} did not answer a get of {n} bytes within {timeout:?}",
                    link.peer()
                ));
            }
            std::thread::yield_now();
        }
        // A refused or failed read also releases `done`.
        link.check().map_err(|e| e.to_string())?;
        self.land(stream, dst, n).map_err(|e| e.to_string())
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
pub(crate) struct Server {
    io: Mutex<(Stage, Stream)>,
    /// Last: the context must outlive the buffer and stream.
    dev: Arc<Device>,
}

impl Server {
    pub fn new(dev: Arc<Device>) -> Result<Self, CoreError> {
        dev.make_current()?;
        Ok(Self {
            io: Mutex::new((Stage::new()?, Stream::new()?)),
            dev,
        })
    }
}

/// One GPU window part as a region of the rank's region table: gin-net's
/// TCP server checks every request against the region, then calls here.
#[derive(Debug)]
pub(crate) struct GpuRegion {
    pub ptr: u64,
    pub server: Arc<Server>,
}

impl GpuRegion {
    fn io<T>(
        &self,
        f: impl FnOnce(&mut Stage, &Stream) -> Result<T, CoreError>,
    ) -> Result<T, String> {
        let mut g = self
            .server
            .io
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let (stage, stream) = &mut *g;
        self.server
            .dev
            .make_current()
            .and_then(|()| f(stage, stream))
            .map_err(|e| format!("staging GPU memory: {e}"))
    }
}

impl Backing for GpuRegion {
    fn write(&self, offset: u64, data: &[u8]) -> Result<(), String> {
        self.io(|stage, stream| {
            for (i, c) in data.chunks(STAGE).enumerate() {
                stage.push(stream, self.ptr + offset + (i * STAGE) as u64, c)?;
            }
            Ok(())
        })
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), String> {
        self.io(|stage, stream| {
            for (i, c) in out.chunks_mut(STAGE).enumerate() {
                let src = stage.pull(stream, self.ptr + offset + (i * STAGE) as u64, c.len())?;
                c.copy_from_slice(src);
            }
            Ok(())
        })
    }
}
