//! Test doubles for engines' CUDA executors: a GPU whose streams record what
//! the driver would be handed, in order, and touch nothing. Step tests of
//! gin-proxy's and gin-gdaki's CUDA executors drive the same engine and
//! executor code the GPU path runs against it, down to the batching of
//! driver calls, with made-up device addresses that nothing dereferences.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use crate::batch::{Dma, Gpu};
use crate::error::CudaError;

/// One call a recording stream was handed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    /// A copy: destination, source, bytes.
    Copy(u64, u64, usize),
    /// Copies in one driver call: (destination, source, bytes) each.
    Copies(Vec<(u64, u64, usize)>),
    /// An 8-byte store: address, value.
    Store(u64, u64),
    /// Stores in one driver call: (address, value) each.
    Stores(Vec<(u64, u64)>),
    /// A wait for everything queued.
    Sync,
}

/// Every call, in order, with the number of the stream it went to (streams
/// are numbered in the order they were made).
pub type Log = Rc<RefCell<Vec<(usize, Call)>>>;

/// A stream that records and executes nothing.
#[derive(Debug)]
pub struct RecordingStream {
    id: usize,
    log: Log,
}

impl RecordingStream {
    fn record(&self, c: Call) {
        self.log.borrow_mut().push((self.id, c));
    }
}

/// Records, touches nothing: no contract of `Dma` is needed for it.
impl Dma for RecordingStream {
    unsafe fn copy(&self, dst: u64, src: u64, n: usize) -> Result<(), CudaError> {
        self.record(Call::Copy(dst, src, n));
        Ok(())
    }
    unsafe fn write_u64(&self, addr: u64, v: u64) -> Result<(), CudaError> {
        self.record(Call::Store(addr, v));
        Ok(())
    }
    fn sync(&self) -> Result<(), CudaError> {
        self.record(Call::Sync);
        Ok(())
    }
    unsafe fn write_many(&self, writes: &[(u64, u64)]) -> Result<(), CudaError> {
        self.record(Call::Stores(writes.to_vec()));
        Ok(())
    }
    unsafe fn copy_many(
        &self,
        dst: &mut [u64],
        src: &mut [u64],
        len: &mut [usize],
    ) -> Result<(), CudaError> {
        let c = (0..dst.len()).map(|i| (dst[i], src[i], len[i])).collect();
        self.record(Call::Copies(c));
        Ok(())
    }
}

/// A GPU whose streams record into one shared [`Log`].
#[derive(Debug, Default)]
pub struct RecordingGpu {
    /// What every stream was handed.
    pub log: Log,
    streams: Cell<usize>,
    entered: Cell<bool>,
}

impl RecordingGpu {
    /// Whether [`Gpu::enter`] was called.
    pub fn entered(&self) -> bool {
        self.entered.get()
    }

    /// Streams made so far.
    pub fn streams(&self) -> usize {
        self.streams.get()
    }
}

impl Gpu for RecordingGpu {
    type Stream = RecordingStream;
    fn enter(&self) -> Result<(), CudaError> {
        self.entered.set(true);
        Ok(())
    }
    fn stream(&self) -> Result<RecordingStream, CudaError> {
        let id = self.streams.get();
        self.streams.set(id + 1);
        Ok(RecordingStream {
            id,
            log: self.log.clone(),
        })
    }
}
