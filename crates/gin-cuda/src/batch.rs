//! Stream work queued together: the CUDA proxy and the soft NIC spend about
//! 3 µs of driver time per `cuMemcpyAsync`, which bounds their bandwidth
//! when many blocks send slices at once, and a driver call per 8-byte store
//! (an inline put's value, its signal, the completion that follows) is on
//! every small put's critical path. Consecutive copies of one queue that
//! touch disjoint memory go to the driver as one batch, and consecutive
//! stores as another (`cuStreamBatchMemOp`, in their order). A copy that
//! overlaps one already pending flushes the copies first; a store flushes
//! pending copies, and a copy pending stores, so the outcome is that of
//! issuing everything one by one. The owner flushes at the end of each pass
//! over its queues, before anything waits for the work.
//!
//! Pending copies that continue one another in the same region (the same
//! pair of windows or memory keys) reach the driver as one: a message that
//! many blocks send in slices (a slice a descriptor or WQE) costs one copy
//! per pass, not one per slice. Copies are merged only within a region, so a
//! merged copy never spans two allocations that happen to be adjacent.
//!
//! [`TotalOrder`] keeps the running totals that several streams store into
//! one counter slot landing in the order they were assigned: a total that
//! goes to another stream than the slot's previous one waits, on the GPU,
//! for an event recorded after that one ([`follow`]).
//!
//! [`stall`] watches the streams an engine hands its batches to: a mark
//! after each batch, so that work a stream has not completed for seconds
//! (it waits behind a user's kernel on a shared hardware work queue) is
//! diagnosed instead of ending in the kernels' bare timeouts.

pub mod stall;

use std::sync::Arc;

use crate::driver::{Device, Event, MAX_WRITES, Stream};
use crate::error::CudaError;

/// What an engine's CUDA executor needs of a GPU: its context made current
/// on the engine's thread, streams, and events to order one stream's work
/// after another's ([`TotalOrder`]). A [`Device`] in production; step
/// tests use [`crate::testing::RecordingGpu`].
pub trait Gpu {
    /// A stream: copies and 8-byte stores, executed in queue order.
    type Stream: Dma;
    /// An event a stream records and another waits for.
    type Event;
    /// Makes the GPU's context current on the calling thread, an engine's
    /// own, and sets that thread's stream-capture mode to relaxed for good
    /// ([`crate::RelaxedCapture`]): its calls must go on while a user's
    /// thread captures a stream in global mode.
    ///
    /// # Errors
    /// The driver's, when the context cannot be made current.
    fn enter(&self) -> Result<(), CudaError>;
    /// A new stream.
    ///
    /// # Errors
    /// The driver's, when no stream can be created.
    fn stream(&self) -> Result<Self::Stream, CudaError>;
    /// A new event (made once and recorded over and over: see
    /// [`Gpu::record`]).
    ///
    /// # Errors
    /// The driver's, when no event can be created.
    fn event(&self) -> Result<Self::Event, CudaError>;
    /// Records `e` after the work handed to `s` so far. Recording again
    /// replaces what `e` stands for, for waits queued later only.
    ///
    /// # Errors
    /// The driver's.
    fn record(&self, s: &Self::Stream, e: &Self::Event) -> Result<(), CudaError>;
    /// Makes the work handed to `s` from now on wait, on the GPU, until the
    /// work `e` was last recorded after has executed.
    ///
    /// # Errors
    /// The driver's.
    fn wait(&self, s: &Self::Stream, e: &Self::Event) -> Result<(), CudaError>;
}

impl Gpu for Arc<Device> {
    type Stream = Stream;
    type Event = Event;
    fn enter(&self) -> Result<(), CudaError> {
        self.make_current()?;
        // An engine thread's copies, queries and waits must not be refused
        // (nor invalidate it) while a user's thread captures a stream in
        // global mode.
        crate::RelaxedCapture::for_this_thread()
    }
    fn stream(&self) -> Result<Stream, CudaError> {
        Stream::new()
    }
    fn event(&self) -> Result<Event, CudaError> {
        Event::new()
    }
    fn record(&self, s: &Stream, e: &Event) -> Result<(), CudaError> {
        s.record(e)
    }
    fn wait(&self, s: &Stream, e: &Event) -> Result<(), CudaError> {
        s.wait(e)
    }
}

/// Keeps the running totals that several streams store into one slot
/// landing in the order they were assigned.
///
/// An engine assigns a counter's running totals in its processing order,
/// but the executor stores each on the stream of the ring or channel that
/// carried the counted operation, after its data; one counter slot is
/// shared by all of a context's rings (one per peer), each with its own
/// stream. Stream A may still be busy with a long copy when stream B
/// stores the later total, and A's earlier total would then land last and
/// take the counter back: a kernel waiting for the later value would wait
/// until its timeout (and the later total, which counts the earlier
/// operation too, would claim it complete while its copy still ran). So a total that goes to another stream than the
/// slot's previous one is queued behind a wait for an event the previous
/// stream recorded after that total (each stream has one event, made on
/// first use and recorded again at each such hand-over: a wait keeps the
/// record it saw). A total on the same stream as the previous one is in
/// stream order already and costs nothing more; totals of different slots
/// never wait on each other.
///
/// This keeps, per slot, the stream that stored its last total; the
/// executor does the rest ([`TotalOrder::before`], then
/// [`TotalOrder::stored`] once the total is queued).
#[derive(Debug, Default)]
pub struct TotalOrder {
    /// Per slot: the stream that stored its last total, if any did.
    last: Vec<Option<usize>>,
}

impl TotalOrder {
    /// Slots `0..slots`, none stored yet.
    pub fn new(slots: usize) -> Self {
        Self {
            last: vec![None; slots],
        }
    }

    /// The stream that stored `slot`'s last total, if another than
    /// `stream`, which is about to store the next one: `stream` must wait
    /// for that stream's work so far first. `None` for the same stream, a
    /// first total, and a slot out of range (the caller refuses it).
    pub fn before(&self, slot: usize, stream: usize) -> Option<usize> {
        self.last
            .get(slot)
            .copied()
            .flatten()
            .filter(|&s| s != stream)
    }

    /// Notes that `stream` queued `slot`'s latest total.
    pub fn stored(&mut self, slot: usize, stream: usize) {
        if let Some(l) = self.last.get_mut(slot) {
            *l = Some(stream);
        }
    }
}

/// What the proxy and the NIC need of a CUDA stream: copies and 8-byte
/// stores that execute in the order they were queued. Tests use host
/// memory instead.
///
/// The methods that queue work on addresses are `unsafe`: an implementor
/// may touch (or have the GPU touch) any address it is given.
pub trait Dma {
    /// Queues a copy of `n` bytes from `src` to `dst`.
    ///
    /// # Safety
    /// As [`Stream::copy`]: `src` readable and `dst` writable for `n`
    /// bytes, in memory this executor reaches, until it has executed the
    /// copy.
    unsafe fn copy(&self, dst: u64, src: u64, n: usize) -> Result<(), CudaError>;
    /// Queues an 8-byte store of `v` at `addr`.
    ///
    /// # Safety
    /// As [`Stream::write_u64`]: `addr` 8-byte aligned and writable until
    /// the executor has executed the store.
    unsafe fn write_u64(&self, addr: u64, v: u64) -> Result<(), CudaError>;
    /// Waits until everything queued has executed.
    fn sync(&self) -> Result<(), CudaError>;
    /// 8-byte stores in their order, after earlier work (at most
    /// [`MAX_WRITES`]).
    ///
    /// # Safety
    /// Every store as for [`Dma::write_u64`].
    unsafe fn write_many(&self, writes: &[(u64, u64)]) -> Result<(), CudaError> {
        for &(a, v) in writes {
            // SAFETY: the caller's contract, store by store.
            unsafe { self.write_u64(a, v)? };
        }
        Ok(())
    }
    /// Copies that may run in any order among themselves, after earlier
    /// work and before later work.
    ///
    /// # Safety
    /// Every copy as for [`Dma::copy`], and none writing bytes another of
    /// the batch reads or writes.
    unsafe fn copy_many(
        &self,
        dst: &mut [u64],
        src: &mut [u64],
        len: &mut [usize],
    ) -> Result<(), CudaError> {
        for i in 0..dst.len() {
            // SAFETY: the caller's contract, copy by copy.
            unsafe { self.copy(dst[i], src[i], len[i])? };
        }
        Ok(())
    }
}

impl Dma for Stream {
    unsafe fn copy(&self, dst: u64, src: u64, n: usize) -> Result<(), CudaError> {
        // SAFETY: the same contract.
        unsafe { Stream::copy(self, dst, src, n) }
    }
    unsafe fn write_u64(&self, addr: u64, v: u64) -> Result<(), CudaError> {
        // SAFETY: the same contract.
        unsafe { Stream::write_u64(self, addr, v) }
    }
    fn sync(&self) -> Result<(), CudaError> {
        Stream::sync(self)
    }
    unsafe fn write_many(&self, writes: &[(u64, u64)]) -> Result<(), CudaError> {
        // SAFETY: the same contract.
        unsafe { Stream::write_many(self, writes) }
    }
    unsafe fn copy_many(
        &self,
        dst: &mut [u64],
        src: &mut [u64],
        len: &mut [usize],
    ) -> Result<(), CudaError> {
        // SAFETY: the same contract.
        unsafe { Stream::copy_many(self, dst, src, len) }
    }
}

/// Makes the work handed to stream `to` from now on wait, on the GPU, for
/// the work handed to stream `from` so far, through `from`'s `event`
/// (made here on first use, recorded again each time). Hand both streams'
/// pending batches over first: `from`'s, so that the event follows them;
/// `to`'s, so that its earlier work does not wait too.
///
/// # Errors
/// The driver's, naming the call.
pub fn follow<G: Gpu>(
    gpu: &G,
    from: &G::Stream,
    event: &mut Option<G::Event>,
    to: &G::Stream,
) -> Result<(), CudaError> {
    let e = match event {
        Some(e) => e,
        None => event.insert(gpu.event()?),
    };
    gpu.record(from, e)?;
    gpu.wait(to, e)
}

/// What a copy's destination and source lie in, as the caller names them
/// (for instance a direction bit and two window ids): copies merge only
/// within one region.
pub type Region = u128;

/// The region of a copy that writes (`put`) or reads (`get`) the remote
/// memory named `remote` with the local memory named `local`.
pub fn region(put: bool, remote: u32, local: u32) -> Region {
    (u128::from(put) << 64) | (u128::from(remote) << 32) | u128::from(local)
}

/// How many entries the proxy or the NIC takes from a queue of `2^log2`
/// slots in one pass before it moves to the next queue and publishes its
/// progress: a quarter of the queue, at most 256. A longer pass merges more
/// slices of a message into one copy (so fewer driver calls when many blocks
/// stream at once) but makes the other queues wait longer and frees this
/// queue's slots later; a quarter leaves three quarters of the queue to the
/// kernel while the pass runs.
pub fn pass_len(log2: u32) -> u64 {
    (1u64 << log2.min(63) >> 2).clamp(1, 256)
}

/// For gin-core's benchmarks (`benches/batch.rs`), not an API: one pass's
/// `copies` (dst, src, bytes), in one region, queued and flushed to a stream
/// that drops them; returns the copies that stream was handed.
#[doc(hidden)]
pub fn bench_pass(copies: &[(u64, u64, usize)]) -> u64 {
    struct Sink;
    impl Dma for Sink {
        unsafe fn copy(&self, _: u64, _: u64, _: usize) -> Result<(), CudaError> {
            Ok(())
        }
        unsafe fn write_u64(&self, _: u64, _: u64) -> Result<(), CudaError> {
            Ok(())
        }
        fn sync(&self) -> Result<(), CudaError> {
            Ok(())
        }
        unsafe fn copy_many(
            &self,
            _: &mut [u64],
            _: &mut [u64],
            _: &mut [usize],
        ) -> Result<(), CudaError> {
            Ok(())
        }
    }
    let mut b = StreamBatch::default();
    let g = region(true, 1, 2);
    for &(d, s, n) in copies {
        // SAFETY: the sink touches no memory. It never fails either.
        let _ = unsafe { b.push(&Sink, d, s, n, g) };
    }
    let _ = b.flush(&Sink);
    b.stats.copies_issued
}

/// Pending work of one stream: copies, or stores, never both.
///
/// The batch holds addresses until it hands them to a stream, so queueing
/// ([`StreamBatch::push`], [`StreamBatch::write`]) is `unsafe`; handing
/// over ([`StreamBatch::flush`]) relies on what was promised then.
#[derive(Debug, Default)]
pub struct StreamBatch {
    dst: Vec<u64>,
    src: Vec<u64>,
    len: Vec<usize>,
    region: Vec<Region>,
    writes: Vec<(u64, u64)>,
    /// Scratch for the merge: (region, dst, src, len) of pending copies.
    runs: Vec<(Region, u64, u64, usize)>,
    /// The bytes pending copies write, and those they read: a new copy
    /// is checked against them in logarithmic time, where a pass may hold
    /// hundreds of copies.
    writes_to: Spans,
    reads_from: Spans,
    /// What reached the driver, for the owner's debug statistics.
    pub stats: BatchStats,
}

/// Counts of what a [`StreamBatch`] handed to the driver.
#[derive(Debug, Default, Clone, Copy)]
pub struct BatchStats {
    /// Copies pushed.
    pub copies: u64,
    /// Driver calls that queued copies, a batch counting as one (a driver
    /// without `cuMemcpyBatchAsync` makes one call per copy of a batch).
    pub copy_calls: u64,
    /// Copies the driver saw, after merging.
    pub copies_issued: u64,
    /// Driver calls that queued stores.
    pub store_calls: u64,
}

impl std::ops::AddAssign for BatchStats {
    fn add_assign(&mut self, o: Self) {
        self.copies += o.copies;
        self.copy_calls += o.copy_calls;
        self.copies_issued += o.copies_issued;
        self.store_calls += o.store_calls;
    }
}

/// A union of byte ranges, kept as sorted, disjoint, non-touching
/// half-open spans.
#[derive(Debug, Default)]
struct Spans(Vec<(u64, u64)>);

impl Spans {
    /// Whether `[a, a + n)` shares a byte with the union.
    fn hits(&self, a: u64, n: usize) -> bool {
        let end = a.saturating_add(n as u64);
        // The last span starting before `end` has the greatest end of
        // those: the spans are sorted and disjoint.
        let i = self.0.partition_point(|&(s, _)| s < end);
        n > 0 && i > 0 && self.0[i - 1].1 > a
    }

    /// Adds `[a, a + n)` to the union, joining the spans it overlaps or
    /// touches.
    fn add(&mut self, a: u64, n: usize) {
        if n == 0 {
            return;
        }
        let end = a.saturating_add(n as u64);
        let lo = self.0.partition_point(|&(_, e)| e < a);
        let hi = self.0.partition_point(|&(s, _)| s <= end);
        if lo < hi {
            let joined = (a.min(self.0[lo].0), end.max(self.0[hi - 1].1));
            self.0.splice(lo..hi, [joined]);
        } else {
            self.0.insert(lo, (a, end));
        }
    }

    fn clear(&mut self) {
        self.0.clear();
    }
}

impl StreamBatch {
    /// Queues a copy within `region`, flushing first if it reads or writes
    /// memory that a pending copy writes, or writes memory a pending copy
    /// reads.
    ///
    /// # Safety
    /// As [`Dma::copy`] for `q` and for every executor this batch is later
    /// flushed to, until that executor has executed the copy. `region`
    /// must name the allocations `dst` and `src` lie in (copies of one
    /// region are merged where they continue one another).
    pub unsafe fn push(
        &mut self,
        q: &impl Dma,
        dst: u64,
        src: u64,
        n: usize,
        region: Region,
    ) -> Result<(), CudaError> {
        if n == 0 {
            return Ok(());
        }
        self.flush_writes(q)?;
        if self.writes_to.hits(dst, n)
            || self.reads_from.hits(dst, n)
            || self.writes_to.hits(src, n)
        {
            self.flush(q)?;
        }
        self.writes_to.add(dst, n);
        self.reads_from.add(src, n);
        self.dst.push(dst);
        self.src.push(src);
        self.len.push(n);
        self.region.push(region);
        self.stats.copies += 1;
        Ok(())
    }

    /// Queues an 8-byte store of `v` at `addr`, after every copy and store
    /// queued before it.
    ///
    /// # Safety
    /// As [`Dma::write_u64`] for `q` and for every executor this batch is
    /// later flushed to, until that executor has executed the store.
    pub unsafe fn write(&mut self, q: &impl Dma, addr: u64, v: u64) -> Result<(), CudaError> {
        self.flush_copies(q)?;
        if self.writes.len() == MAX_WRITES {
            self.flush_writes(q)?;
        }
        self.writes.push((addr, v));
        Ok(())
    }

    /// Hands everything pending to the stream.
    pub fn flush(&mut self, q: &impl Dma) -> Result<(), CudaError> {
        self.flush_copies(q)?;
        self.flush_writes(q)
    }

    fn flush_writes(&mut self, q: &impl Dma) -> Result<(), CudaError> {
        self.stats.store_calls += u64::from(!self.writes.is_empty());
        // `write` was promised these stores are valid for any executor the
        // batch is flushed to; at most MAX_WRITES are pending.
        let r = match self.writes.as_slice() {
            [] => Ok(()),
            // SAFETY: as above.
            &[(a, v)] => unsafe { q.write_u64(a, v) },
            // SAFETY: as above.
            w => unsafe { q.write_many(w) },
        };
        self.writes.clear();
        r
    }

    /// The pending copies: one copy as itself, several merged where they
    /// continue one another, then as one batch.
    fn flush_copies(&mut self, q: &impl Dma) -> Result<(), CudaError> {
        if self.dst.len() > 1 {
            self.merge();
        }
        self.stats.copy_calls += u64::from(!self.dst.is_empty());
        self.stats.copies_issued += self.dst.len() as u64;
        // `push` was promised these copies are valid for any executor the
        // batch is flushed to, and it flushed before queueing a copy that
        // overlaps what a pending one writes (merging keeps the bytes each
        // writes).
        let r = match self.dst.len() {
            0 => Ok(()),
            // SAFETY: as above.
            1 => unsafe { q.copy(self.dst[0], self.src[0], self.len[0]) },
            // SAFETY: as above.
            _ => unsafe { q.copy_many(&mut self.dst, &mut self.src, &mut self.len) },
        };
        self.dst.clear();
        self.src.clear();
        self.len.clear();
        self.region.clear();
        self.writes_to.clear();
        self.reads_from.clear();
        r
    }

    /// Merges pending copies of one region whose destination and source
    /// both start where another's end. Pending copies never overlap what
    /// another writes, so the merged ones write the same bytes.
    fn merge(&mut self) {
        let runs = &mut self.runs;
        runs.clear();
        runs.extend(
            (0..self.dst.len()).map(|i| (self.region[i], self.dst[i], self.src[i], self.len[i])),
        );
        runs.sort_unstable_by_key(|&(g, d, _, _)| (g, d));
        self.dst.clear();
        self.src.clear();
        self.len.clear();
        self.region.clear();
        for &(g, d, s, l) in runs.iter() {
            if let (Some(&pg), Some(&pd), Some(&ps), Some(pl)) = (
                self.region.last(),
                self.dst.last(),
                self.src.last(),
                self.len.last_mut(),
            ) && pg == g
                && pd + *pl as u64 == d
                && ps + *pl as u64 == s
            {
                *pl += l;
                continue;
            }
            self.dst.push(d);
            self.src.push(s);
            self.len.push(l);
            self.region.push(g);
        }
    }

    /// Whether nothing is pending (queued, not yet handed to a stream).
    pub fn is_empty(&self) -> bool {
        self.dst.is_empty() && self.writes.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::cell::RefCell;

    /// Offsets into one buffer; a batch runs in reverse, the adversarial
    /// order a batch is allowed.
    #[derive(Default)]
    struct Fake {
        mem: RefCell<Vec<u8>>,
        batches: RefCell<Vec<usize>>,
        /// Sizes of the store batches handed over.
        store_batches: RefCell<Vec<usize>>,
        /// Every copy executed: (dst, src, len).
        copies: RefCell<Vec<(u64, u64, usize)>>,
    }

    impl Fake {
        /// A copy, at once (slice indexing checks the offsets).
        fn copy_now(&self, dst: u64, src: u64, n: usize) {
            self.copies.borrow_mut().push((dst, src, n));
            self.mem
                .borrow_mut()
                .copy_within(src as usize..src as usize + n, dst as usize);
        }
        /// A store, at once.
        fn store_now(&self, a: u64, v: u64) {
            self.mem.borrow_mut()[a as usize..a as usize + 8].copy_from_slice(&v.to_le_bytes());
        }
    }

    /// The fake's "addresses" are offsets into its own buffer, checked by
    /// slice indexing: no contract of `Dma` is needed for it.
    impl Dma for Fake {
        unsafe fn copy(&self, dst: u64, src: u64, n: usize) -> Result<(), CudaError> {
            self.copy_now(dst, src, n);
            Ok(())
        }
        unsafe fn write_u64(&self, a: u64, v: u64) -> Result<(), CudaError> {
            self.store_now(a, v);
            Ok(())
        }
        unsafe fn write_many(&self, w: &[(u64, u64)]) -> Result<(), CudaError> {
            assert!(w.len() <= MAX_WRITES, "{} stores in one batch", w.len());
            self.store_batches.borrow_mut().push(w.len());
            for &(a, v) in w {
                self.store_now(a, v);
            }
            Ok(())
        }
        fn sync(&self) -> Result<(), CudaError> {
            Ok(())
        }
        unsafe fn copy_many(
            &self,
            d: &mut [u64],
            s: &mut [u64],
            l: &mut [usize],
        ) -> Result<(), CudaError> {
            self.batches.borrow_mut().push(d.len());
            for i in (0..d.len()).rev() {
                self.copy_now(d[i], s[i], l[i]);
            }
            Ok(())
        }
    }

    /// A slot's next total waits only where it changes streams, for the
    /// stream of its previous total; slots are independent; out of range
    /// is nobody's.
    #[test]
    fn a_total_waits_only_where_its_slot_changes_streams() {
        let mut o = TotalOrder::new(3);
        assert_eq!(o.before(0, 4), None, "a first total");
        o.stored(0, 4);
        assert_eq!(o.before(0, 4), None, "the same stream");
        assert_eq!(o.before(0, 2), Some(4));
        assert_eq!(o.before(1, 2), None, "another slot");
        o.stored(0, 2);
        o.stored(1, 7);
        assert_eq!(o.before(0, 4), Some(2));
        assert_eq!(o.before(1, 2), Some(7));
        o.stored(9, 1);
        assert_eq!(o.before(9, 0), None);
    }

    /// `follow` makes the earlier stream's event once, records it there
    /// and has the later stream wait for it; again, the same event.
    #[test]
    fn follow_records_on_one_stream_and_waits_on_the_other() {
        use crate::testing::{Call, RecordingGpu};
        let gpu = RecordingGpu::default();
        let (a, b) = (gpu.stream().unwrap(), gpu.stream().unwrap());
        let mut ev = None;
        follow(&gpu, &a, &mut ev, &b).unwrap();
        follow(&gpu, &a, &mut ev, &b).unwrap();
        assert_eq!(gpu.events(), 1);
        assert_eq!(
            gpu.log.borrow().clone(),
            vec![
                (0, Call::Record(0)),
                (1, Call::Wait(0)),
                (0, Call::Record(0)),
                (1, Call::Wait(0))
            ]
        );
    }

    /// `b.push` on the fake.
    fn push(b: &mut StreamBatch, q: &Fake, dst: u64, src: u64, len: usize, g: Region) {
        // SAFETY: the fake checks its offsets itself (see its `Dma`).
        unsafe { b.push(q, dst, src, len, g) }.unwrap();
    }

    /// `b.write` on the fake.
    fn write(b: &mut StreamBatch, q: &Fake, a: u64, v: u64) {
        // SAFETY: as for `push`.
        unsafe { b.write(q, a, v) }.unwrap();
    }

    proptest! {
        /// Batched and merged, whatever order each batch runs in, the
        /// memory ends as after issuing the copies one by one; and no copy
        /// the driver sees spans two allocations.
        #[test]
        fn batching_never_changes_the_outcome(
            copies in proptest::collection::vec(alloc_copy(), 1..60),
        ) {
            let init: Vec<u8> = (0..128u8).collect();
            let seq = Fake { mem: RefCell::new(init.clone()), ..Fake::default() };
            for &(d, s, n, _) in &copies {
                seq.copy_now(d, s, n);
            }
            let fake = Fake { mem: RefCell::new(init), ..Fake::default() };
            let mut b = StreamBatch::default();
            for &(d, s, n, g) in &copies {
                push(&mut b, &fake, d, s, n, g);
            }
            b.flush(&fake).unwrap();
            prop_assert!(b.is_empty());
            for &(d, s, n) in fake.copies.borrow().iter() {
                prop_assert_eq!(d / ALLOC, (d + n as u64 - 1) / ALLOC, "dst spans allocations");
                prop_assert_eq!(s / ALLOC, (s + n as u64 - 1) / ALLOC, "src spans allocations");
            }
            prop_assert_eq!(fake.mem.into_inner(), seq.mem.into_inner());
        }
    }

    proptest! {
        /// A pass takes at least one entry, never more than 256 and never
        /// more than a quarter of a queue that has four slots or more.
        #[test]
        fn a_pass_is_a_quarter_of_the_queue(log2 in 0u32..64) {
            let p = pass_len(log2);
            prop_assert!((1..=256).contains(&p));
            if log2 >= 2 {
                prop_assert!(p * 4 <= 1u64 << log2);
            }
            if (2..=10).contains(&log2) {
                prop_assert_eq!(p * 4, 1u64 << log2);
            }
        }
    }

    proptest! {
        /// Spans answer as the ranges added would, one by one, and stay
        /// sorted, disjoint and apart (touching spans are joined).
        #[test]
        fn spans_are_the_union_of_what_was_added(
            added in proptest::collection::vec((0u64..200, 0usize..24), 0..40),
            asked in proptest::collection::vec((0u64..230, 0usize..24), 1..40),
        ) {
            let mut u = Spans::default();
            for &(a, n) in &added {
                u.add(a, n);
            }
            for w in u.0.windows(2) {
                prop_assert!(w[0].1 < w[1].0, "{:?}", u.0);
            }
            for &(s, e) in &u.0 {
                prop_assert!(s < e);
            }
            for &(a, n) in &asked {
                let brute = added.iter().any(|&(b, m)| {
                    n > 0 && m > 0 && a < b + m as u64 && b < a + n as u64
                });
                prop_assert_eq!(u.hits(a, n), brute, "[{}, +{}) against {:?}", a, n, u.0);
            }
        }
    }

    /// The fake's 128 bytes are four allocations of this many bytes.
    const ALLOC: u64 = 32;

    proptest! {
        /// Two messages, allocation 0 to 2 and allocation 1 to 3, cut into
        /// slices and posted interleaved in any order: the second continues
        /// the first in both source and destination, but they are different
        /// regions, so the driver sees exactly one copy per message.
        #[test]
        fn a_sliced_message_is_one_copy_and_never_joins_its_neighbour(
            cuts_a in proptest::collection::btree_set(1u64..ALLOC, 0..8),
            cuts_b in proptest::collection::btree_set(1u64..ALLOC, 0..8),
            keys in proptest::collection::vec(any::<u32>(), 18),
        ) {
            let slices = |cuts: &std::collections::BTreeSet<u64>, src: u64, dst: u64, g| {
                let mut at: Vec<u64> = std::iter::once(0).chain(cuts.iter().copied()).collect();
                at.push(ALLOC);
                at.windows(2)
                    .map(|w| (dst + w[0], src + w[0], (w[1] - w[0]) as usize, g))
                    .collect::<Vec<_>>()
            };
            let mut all = slices(&cuts_a, 0, 2 * ALLOC, region(true, 2, 0));
            all.extend(slices(&cuts_b, ALLOC, 3 * ALLOC, region(true, 3, 1)));
            let mut order: Vec<usize> = (0..all.len()).collect();
            order.sort_by_key(|&i| keys[i]);
            let init: Vec<u8> = (0..128u8).collect();
            let fake = Fake { mem: RefCell::new(init.clone()), ..Fake::default() };
            let mut b = StreamBatch::default();
            for &i in &order {
                let (d, s, n, g) = all[i];
                push(&mut b, &fake, d, s, n, g);
            }
            b.flush(&fake).unwrap();
            let mut c = fake.copies.take();
            c.sort_unstable();
            prop_assert_eq!(c, vec![(2 * ALLOC, 0, 32), (3 * ALLOC, ALLOC, 32)]);
            let m = fake.mem.into_inner();
            prop_assert_eq!(&m[64..], &init[..64]);
            prop_assert_eq!(b.stats.copies, all.len() as u64);
        }
    }

    /// A copy inside one destination and one source allocation, with its
    /// region (the pair of allocations), as the proxy and NIC push them.
    fn alloc_copy() -> impl Strategy<Value = (u64, u64, usize, Region)> {
        (0u64..4, 0u64..ALLOC, 0u64..4, 0u64..ALLOC, 1u64..ALLOC).prop_map(|(a, da, b, sa, n)| {
            let n = n.min(ALLOC - da).min(ALLOC - sa);
            (
                a * ALLOC + da,
                b * ALLOC + sa,
                n as usize,
                region(true, a as u32, b as u32),
            )
        })
    }

    /// A copy or an 8-byte store, as the proxy and the NIC issue them.
    #[derive(Debug, Clone)]
    enum Work {
        Copy(u64, u64, usize, Region),
        Store(u64, u64),
    }

    fn work() -> impl Strategy<Value = Work> {
        prop_oneof![
            alloc_copy().prop_map(|(d, s, n, g)| Work::Copy(d, s, n, g)),
            (0u64..15, any::<u64>()).prop_map(|(a, v)| Work::Store(a * 8, v)),
        ]
    }

    proptest! {
        /// Copies and stores mixed: batched (copies in any order within a
        /// batch, stores in theirs), the memory ends as after issuing them
        /// one by one, and nothing stays pending after the flush.
        #[test]
        fn stores_and_copies_batched_keep_their_order(
            items in proptest::collection::vec(work(), 1..300),
        ) {
            let init: Vec<u8> = (0..128u8).collect();
            let seq = Fake { mem: RefCell::new(init.clone()), ..Fake::default() };
            let fake = Fake { mem: RefCell::new(init), ..Fake::default() };
            let mut b = StreamBatch::default();
            for w in &items {
                match *w {
                    Work::Copy(d, s, n, g) => {
                        seq.copy_now(d, s, n);
                        push(&mut b, &fake, d, s, n, g);
                    }
                    Work::Store(a, v) => {
                        seq.store_now(a, v);
                        write(&mut b, &fake, a, v);
                    }
                }
            }
            b.flush(&fake).unwrap();
            prop_assert!(b.is_empty());
            prop_assert_eq!(fake.mem.into_inner(), seq.mem.into_inner());
        }
    }

    #[test]
    fn consecutive_stores_go_as_one_batch_up_to_the_driver_limit() {
        let fake = Fake {
            mem: RefCell::new(vec![0; 8 * 600]),
            ..Fake::default()
        };
        let mut b = StreamBatch::default();
        // A put's value, its signal, the completion: one call.
        for i in 0..3u64 {
            write(&mut b, &fake, i * 8, i);
        }
        b.flush(&fake).unwrap();
        // 600 in a row: split at the driver's limit.
        for i in 0..600u64 {
            write(&mut b, &fake, i * 8, i + 1);
        }
        b.flush(&fake).unwrap();
        assert_eq!(
            fake.store_batches.into_inner(),
            vec![3, MAX_WRITES, MAX_WRITES, 600 - 2 * MAX_WRITES]
        );
        // A store after a copy waits for the copy, and the reverse.
        let fake = Fake {
            mem: RefCell::new(vec![0; 64]),
            ..Fake::default()
        };
        write(&mut b, &fake, 0, 7);
        push(&mut b, &fake, 8, 0, 8, 0);
        write(&mut b, &fake, 0, 9);
        b.flush(&fake).unwrap();
        let m = fake.mem.into_inner();
        assert_eq!(m[0], 9);
        assert_eq!(m[8], 7);
    }

    #[test]
    fn disjoint_copies_go_as_one_batch() {
        let fake = Fake {
            mem: RefCell::new(vec![0; 256]),
            ..Fake::default()
        };
        let mut b = StreamBatch::default();
        // Disjoint, and not continuing one another (a gap between).
        for i in 0..4u64 {
            push(&mut b, &fake, 128 + i * 24, i * 16, 16, 0);
        }
        // Overwrites the first destination: the four go first.
        push(&mut b, &fake, 128, 64, 8, 0);
        b.flush(&fake).unwrap();
        assert_eq!(fake.batches.into_inner(), vec![4]);
    }

    #[test]
    fn slices_of_one_message_merge_into_one_copy_per_region() {
        let fake = Fake {
            mem: RefCell::new((0..=255u8).collect()),
            ..Fake::default()
        };
        let mut b = StreamBatch::default();
        // Sixteen 8-byte slices of one message, posted out of order (as
        // blocks win their reservations), within one region.
        for i in [3u64, 0, 15, 7, 1, 2, 14, 4, 5, 6, 13, 8, 9, 12, 10, 11] {
            push(&mut b, &fake, 128 + i * 8, i * 8, 8, region(true, 1, 2));
        }
        b.flush(&fake).unwrap();
        assert_eq!(fake.copies.take(), vec![(128, 0, 128)]);
        let s = b.stats;
        assert_eq!(
            (s.copies, s.copy_calls, s.copies_issued, s.store_calls),
            (16, 1, 1, 0)
        );
        let m = fake.mem.borrow().clone();
        assert_eq!(&m[128..], &m[..128]);
        // The same bytes in two regions (say two windows that happen to be
        // adjacent in the address space): one copy each, never one across.
        for i in 0..16u64 {
            let g = region(true, 1, if i < 8 { 2 } else { 3 });
            push(&mut b, &fake, 128 + i * 8, i * 8, 8, g);
        }
        b.flush(&fake).unwrap();
        // (The fake runs a batch backwards.)
        let mut c = fake.copies.take();
        c.sort_unstable();
        assert_eq!(c, vec![(128, 0, 64), (192, 64, 64)]);
        let s = b.stats;
        assert_eq!((s.copies, s.copy_calls, s.copies_issued), (32, 2, 3));
        // A slice whose source does not continue the run stays apart.
        push(&mut b, &fake, 128, 0, 8, 0);
        push(&mut b, &fake, 136, 16, 8, 0);
        b.flush(&fake).unwrap();
        let mut c = fake.copies.take();
        c.sort_unstable();
        assert_eq!(c, vec![(128, 0, 8), (136, 16, 8)]);
    }
}
