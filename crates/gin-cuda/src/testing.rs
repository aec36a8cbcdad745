//! Test doubles for engines' CUDA executors: a GPU whose streams record what
//! the driver would be handed, in order, and touch nothing. Step tests of
//! gin-proxy's and gin-gdaki's CUDA executors drive the same engine and
//! executor code the GPU path runs against it, down to the batching of
//! driver calls, with made-up device addresses that nothing dereferences.
//! And an abort flag in host memory ([`HostFlag`]), for the watchers'
//! tests.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use crate::batch::{Dma, Gpu};
use crate::error::CudaError;
use crate::watch::Flag;

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

/// An abort flag in host memory: its value, and how often it was asked to
/// rise, for tests to wait on.
#[derive(Debug, Default)]
pub struct HostFlag {
    state: Mutex<FlagState>,
    raised: Condvar,
}

#[derive(Debug, Default)]
struct FlagState {
    value: u64,
    raises: usize,
    fail: bool,
}

impl HostFlag {
    fn state(&self) -> MutexGuard<'_, FlagState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The flag's value (1: raised).
    pub fn value(&self) -> u64 {
        self.state().value
    }

    /// Makes later raises fail (or succeed again).
    pub fn fail_raises(&self, fail: bool) {
        self.state().fail = fail;
    }

    /// Waits until at least `n` raises were asked for (failed ones too),
    /// at most `limit`; whether they were.
    pub fn wait_raises(&self, n: usize, limit: Duration) -> bool {
        let s = self.state();
        let (s, _) = self
            .raised
            .wait_timeout_while(s, limit, |s| s.raises < n)
            .unwrap_or_else(PoisonError::into_inner);
        s.raises >= n
    }
}

impl Flag for HostFlag {
    fn raise(&self) -> Result<(), CudaError> {
        let mut s = self.state();
        s.raises += 1;
        self.raised.notify_all();
        if s.fail {
            return Err(CudaError::Unavailable {
                why: "the test fails raises".into(),
            });
        }
        s.value = 1;
        Ok(())
    }

    fn lower(&self) -> Result<(), CudaError> {
        self.state().value = 0;
        Ok(())
    }
}
