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

use super::driver::{MAX_WRITES, Stream};
use crate::error::CoreError;

/// What the proxy and the NIC need of a CUDA stream: copies and 8-byte
/// stores that execute in the order they were queued. Tests use host
/// memory instead.
pub(crate) trait Dma {
    fn copy(&self, dst: u64, src: u64, n: usize) -> Result<(), CoreError>;
    fn write_u64(&self, addr: u64, v: u64) -> Result<(), CoreError>;
    fn sync(&self) -> Result<(), CoreError>;
    /// 8-byte stores in their order, after earlier work (at most
    /// [`MAX_WRITES`]).
    fn write_many(&self, writes: &[(u64, u64)]) -> Result<(), CoreError> {
        for &(a, v) in writes {
            self.write_u64(a, v)?;
        }
        Ok(())
    }
    /// Copies that may run in any order among themselves, after earlier
    /// work and before later work.
    fn copy_many(
        &self,
        dst: &mut [u64],
        src: &mut [u64],
        len: &mut [usize],
    ) -> Result<(), CoreError> {
        for i in 0..dst.len() {
            self.copy(dst[i], src[i], len[i])?;
        }
        Ok(())
    }
}

impl Dma for Stream {
    fn copy(&self, dst: u64, src: u64, n: usize) -> Result<(), CoreError> {
        Stream::copy(self, dst, src, n)
    }
    fn write_u64(&self, addr: u64, v: u64) -> Result<(), CoreError> {
        Stream::write_u64(self, addr, v)
    }
    fn sync(&self) -> Result<(), CoreError> {
        Stream::sync(self)
    }
    fn write_many(&self, writes: &[(u64, u64)]) -> Result<(), CoreError> {
        Stream::write_many(self, writes)
    }
    fn copy_many(
        &self,
        dst: &mut [u64],
        src: &mut [u64],
        len: &mut [usize],
    ) -> Result<(), CoreError> {
        Stream::copy_many(self, dst, src, len)
    }
}

/// Pending work of one stream: copies, or stores, never both.
#[derive(Debug, Default)]
pub(crate) struct StreamBatch {
    dst: Vec<u64>,
    src: Vec<u64>,
    len: Vec<usize>,
    writes: Vec<(u64, u64)>,
}

/// Whether `[a, a + m)` and `[b, b + n)` share a byte.
fn overlaps(a: u64, m: usize, b: u64, n: usize) -> bool {
    m > 0 && n > 0 && a < b.saturating_add(n as u64) && b < a.saturating_add(m as u64)
}

impl StreamBatch {
    /// Queues a copy, flushing first if it reads or writes memory that a
    /// pending copy writes, or writes memory a pending copy reads.
    pub fn push(&mut self, q: &impl Dma, dst: u64, src: u64, n: usize) -> Result<(), CoreError> {
        if n == 0 {
            return Ok(());
        }
        self.flush_writes(q)?;
        let conflict = (0..self.dst.len()).any(|i| {
            let (pd, ps, pl) = (self.dst[i], self.src[i], self.len[i]);
            overlaps(dst, n, pd, pl) || overlaps(dst, n, ps, pl) || overlaps(src, n, pd, pl)
        });
        if conflict {
            self.flush(q)?;
        }
        self.dst.push(dst);
        self.src.push(src);
        self.len.push(n);
        Ok(())
    }

    /// Queues an 8-byte store of `v` at `addr`, after every copy and store
    /// queued before it.
    pub fn write(&mut self, q: &impl Dma, addr: u64, v: u64) -> Result<(), CoreError> {
        self.flush_copies(q)?;
        if self.writes.len() == MAX_WRITES {
            self.flush_writes(q)?;
        }
        self.writes.push((addr, v));
        Ok(())
    }

    /// Hands everything pending to the stream.
    pub fn flush(&mut self, q: &impl Dma) -> Result<(), CoreError> {
        self.flush_copies(q)?;
        self.flush_writes(q)
    }

    fn flush_writes(&mut self, q: &impl Dma) -> Result<(), CoreError> {
        let r = match self.writes.as_slice() {
            [] => Ok(()),
            &[(a, v)] => q.write_u64(a, v),
            w => q.write_many(w),
        };
        self.writes.clear();
        r
    }

    /// The pending copies: one copy as itself, several as one batch.
    fn flush_copies(&mut self, q: &impl Dma) -> Result<(), CoreError> {
        let r = match self.dst.len() {
            0 => Ok(()),
            1 => q.copy(self.dst[0], self.src[0], self.len[0]),
            _ => q.copy_many(&mut self.dst, &mut self.src, &mut self.len),
        };
        self.dst.clear();
        self.src.clear();
        self.len.clear();
        r
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
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
    }

    impl Dma for Fake {
        fn copy(&self, dst: u64, src: u64, n: usize) -> Result<(), CoreError> {
            self.mem
                .borrow_mut()
                .copy_within(src as usize..src as usize + n, dst as usize);
            Ok(())
        }
        fn write_u64(&self, a: u64, v: u64) -> Result<(), CoreError> {
            self.mem.borrow_mut()[a as usize..a as usize + 8].copy_from_slice(&v.to_le_bytes());
            Ok(())
        }
        fn write_many(&self, w: &[(u64, u64)]) -> Result<(), CoreError> {
            assert!(w.len() <= MAX_WRITES, "{} stores in one batch", w.len());
            self.store_batches.borrow_mut().push(w.len());
            for &(a, v) in w {
                self.write_u64(a, v)?;
            }
            Ok(())
        }
        fn sync(&self) -> Result<(), CoreError> {
            Ok(())
        }
        fn copy_many(
            &self,
            d: &mut [u64],
            s: &mut [u64],
            l: &mut [usize],
        ) -> Result<(), CoreError> {
            self.batches.borrow_mut().push(d.len());
            for i in (0..d.len()).rev() {
                self.copy(d[i], s[i], l[i])?;
            }
            Ok(())
        }
    }

    proptest! {
        /// Batched, whatever order each batch runs in, the memory ends as
        /// after issuing the copies one by one.
        #[test]
        fn batching_never_changes_the_outcome(
            copies in proptest::collection::vec((0u64..96, 0u64..96, 1usize..32), 1..40),
        ) {
            let init: Vec<u8> = (0..128u8).collect();
            let seq = Fake { mem: RefCell::new(init.clone()), ..Fake::default() };
            for &(d, s, n) in &copies {
                seq.copy(d, s, n).unwrap();
            }
            let fake = Fake { mem: RefCell::new(init), ..Fake::default() };
            let mut b = StreamBatch::default();
            for &(d, s, n) in &copies {
                b.push(&fake, d, s, n).unwrap();
            }
            b.flush(&fake).unwrap();
            prop_assert!(b.is_empty());
            prop_assert_eq!(fake.mem.into_inner(), seq.mem.into_inner());
        }
    }

    /// A copy or an 8-byte store, as the proxy and the NIC issue them.
    #[derive(Debug, Clone)]
    enum Work {
        Copy(u64, u64, usize),
        Store(u64, u64),
    }

    fn work() -> impl Strategy<Value = Work> {
        prop_oneof![
            (0u64..96, 0u64..96, 1usize..32).prop_map(|(d, s, n)| Work::Copy(d, s, n)),
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
                    Work::Copy(d, s, n) => {
                        seq.copy(d, s, n).unwrap();
                        b.push(&fake, d, s, n).unwrap();
                    }
                    Work::Store(a, v) => {
                        seq.write_u64(a, v).unwrap();
                        b.write(&fake, a, v).unwrap();
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
            b.write(&fake, i * 8, i).unwrap();
        }
        b.flush(&fake).unwrap();
        // 600 in a row: split at the driver's limit.
        for i in 0..600u64 {
            b.write(&fake, i * 8, i + 1).unwrap();
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
        b.write(&fake, 0, 7).unwrap();
        b.push(&fake, 8, 0, 8).unwrap();
        b.write(&fake, 0, 9).unwrap();
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
        for i in 0..4u64 {
            b.push(&fake, 128 + i * 16, i * 16, 16).unwrap();
        }
        // Overwrites the first destination: the four go first.
        b.push(&fake, 128, 64, 8).unwrap();
        b.flush(&fake).unwrap();
        assert_eq!(fake.batches.into_inner(), vec![4]);
    }
}
