//! Test doubles for engines' CUDA executors: a GPU whose streams record what
//! the driver would be handed, in order (events recorded and waited for
//! too), and touch nothing. Step tests of gin-proxy's and gin-gdaki's CUDA
//! executors drive the same engine and executor code the GPU path runs
//! against it, down to the batching of driver calls, with made-up device
//! addresses that nothing dereferences.
//! And an abort flag in host memory ([`HostFlag`]), for the watchers'
//! tests.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use crate::batch::stall::Marks;
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
    /// An event recorded after everything handed over so far: the event's
    /// number (events are numbered in the order they were made).
    Record(usize),
    /// Work handed over from now on waits for the event's last record.
    Wait(usize),
}

/// Every call, in order, with the number of the stream it went to (streams
/// are numbered in the order they were made).
pub type Log = Rc<RefCell<Vec<(usize, Call)>>>;

/// Every store any stream was handed: (stream, address, value), kept for
/// [`RecordingGpu::complete`] (tests drain the [`Log`]).
type Stores = Rc<RefCell<Vec<(usize, u64, u64)>>>;

/// A stream that records and executes nothing.
#[derive(Debug)]
pub struct RecordingStream {
    id: usize,
    log: Log,
    stores: Stores,
}

impl RecordingStream {
    fn record(&self, c: Call) {
        let mut stores = self.stores.borrow_mut();
        match &c {
            Call::Store(a, v) => stores.push((self.id, *a, *v)),
            Call::Stores(w) => stores.extend(w.iter().map(|&(a, v)| (self.id, a, v))),
            _ => {}
        }
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

/// A GPU whose streams record into one shared [`Log`]. Clones share
/// everything (the log, the streams made, the marks), so a test keeps one
/// while an executor owns another.
#[derive(Debug, Default, Clone)]
pub struct RecordingGpu {
    /// What every stream was handed.
    pub log: Log,
    stores: Stores,
    streams: Rc<Cell<usize>>,
    events: Rc<Cell<usize>>,
    entered: Rc<Cell<bool>>,
    marks: Rc<RefCell<Vec<Arc<MarkWords>>>>,
}

/// Mark words at made-up addresses ([`RecordingGpu::marks`]).
#[derive(Debug)]
pub struct MarkWords {
    base: u64,
    words: Vec<AtomicU64>,
}

impl MarkWords {
    /// The word at device address `a`, if it is one of these.
    fn word(&self, a: u64) -> Option<&AtomicU64> {
        let i = usize::try_from(a.checked_sub(self.base)? / 8).ok()?;
        self.words.get(i).filter(|_| a.is_multiple_of(8))
    }
}

// SAFETY: `RecordingGpu` records stores and executes none, so the made-up
// addresses are never written.
unsafe impl Marks for Arc<MarkWords> {
    fn addr(&self, i: usize) -> Option<u64> {
        (i < self.words.len()).then(|| self.base + i as u64 * 8)
    }

    fn read(&self, i: usize) -> u64 {
        self.words.get(i).map_or(0, |w| w.load(Ordering::Acquire))
    }
}

/// Where the first set of mark words lies (made up; the next set 64 KiB
/// above).
pub const MARKS_AT: u64 = 0x7a00_0000;

impl RecordingGpu {
    /// Mark words for `n` streams, at [`MARKS_AT`] for the first set (the
    /// next 64 KiB above), which the streams execute only when a test says
    /// so ([`RecordingGpu::complete`]).
    pub fn marks(&self, n: usize) -> Box<dyn Marks> {
        let mut all = self.marks.borrow_mut();
        let m = Arc::new(MarkWords {
            base: MARKS_AT + all.len() as u64 * 0x1_0000,
            words: (0..n).map(|_| AtomicU64::new(0)).collect(),
        });
        all.push(m.clone());
        Box::new(m)
    }

    /// Stream `stream` executes what it was handed so far, as far as
    /// anything reads it: its stores into mark words.
    pub fn complete(&self, stream: usize) {
        let marks = self.marks.borrow();
        for &(_, a, v) in self.stores.borrow().iter().filter(|x| x.0 == stream) {
            if let Some(w) = marks.iter().find_map(|m| m.word(a)) {
                w.store(v, Ordering::Release);
            }
        }
    }

    /// Whether [`Gpu::enter`] was called.
    pub fn entered(&self) -> bool {
        self.entered.get()
    }

    /// Streams made so far.
    pub fn streams(&self) -> usize {
        self.streams.get()
    }

    /// Events made so far.
    pub fn events(&self) -> usize {
        self.events.get()
    }
}

/// An event of a [`RecordingGpu`]: its number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordingEvent(pub usize);

impl Gpu for RecordingGpu {
    type Stream = RecordingStream;
    type Event = RecordingEvent;
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
            stores: self.stores.clone(),
        })
    }
    fn event(&self) -> Result<RecordingEvent, CudaError> {
        let id = self.events.get();
        self.events.set(id + 1);
        Ok(RecordingEvent(id))
    }
    fn record(&self, s: &RecordingStream, e: &RecordingEvent) -> Result<(), CudaError> {
        s.record(Call::Record(e.0));
        Ok(())
    }
    fn wait(&self, s: &RecordingStream, e: &RecordingEvent) -> Result<(), CudaError> {
        s.record(Call::Wait(e.0));
        Ok(())
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

/// A flag the test keeps a hold of too, to look at it after every other
/// holder (the watcher's `Abort`) let go.
impl Flag for Arc<HostFlag> {
    fn raise(&self) -> Result<(), CudaError> {
        HostFlag::raise(self)
    }

    fn lower(&self) -> Result<(), CudaError> {
        HostFlag::lower(self)
    }
}
