//! Copies queued together: the CUDA proxy and the soft NIC spend about 3 µs
//! of driver time per `cuMemcpyAsync`, which bounds their bandwidth when
//! many blocks send slices at once. Consecutive copies of one queue that
//! touch disjoint memory go to the driver as one batch; a copy that
//! overlaps one already pending, and every store that must follow the
//! copies (a signal, a counter, a completion), flushes the batch first, so
//! the outcome is that of issuing them one by one.

use super::driver::Stream;
use crate::error::CoreError;

/// What the proxy and the NIC need of a CUDA stream: copies and 8-byte
/// stores that execute in the order they were queued. Tests use host
/// memory instead.
pub(crate) trait Dma {
    fn copy(&self, dst: u64, src: u64, n: usize) -> Result<(), CoreError>;
    fn write_u64(&self, addr: u64, v: u64) -> Result<(), CoreError>;
    fn sync(&self) -> Result<(), CoreError>;
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
    fn copy_many(
        &self,
        dst: &mut [u64],
        src: &mut [u64],
        len: &mut [usize],
    ) -> Result<(), CoreError> {
        Stream::copy_many(self, dst, src, len)
    }
}

/// Pending copies of one stream.
#[derive(Debug, Default)]
pub(crate) struct CopyBatch {
    dst: Vec<u64>,
    src: Vec<u64>,
    len: Vec<usize>,
}

/// Whether `[a, a + m)` and `[b, b + n)` share a byte.
fn overlaps(a: u64, m: usize, b: u64, n: usize) -> bool {
    m > 0 && n > 0 && a < b.saturating_add(n as u64) && b < a.saturating_add(m as u64)
}

impl CopyBatch {
    /// Queues a copy, flushing first if it reads or writes memory that a
    /// pending copy writes, or writes memory a pending copy reads.
    pub fn push(&mut self, q: &impl Dma, dst: u64, src: u64, n: usize) -> Result<(), CoreError> {
        if n == 0 {
            return Ok(());
        }
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

    /// Hands the pending copies to the stream: one copy as itself, several
    /// as one batch.
    pub fn flush(&mut self, q: &impl Dma) -> Result<(), CoreError> {
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
        self.dst.is_empty()
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
    }

    impl Dma for Fake {
        fn copy(&self, dst: u64, src: u64, n: usize) -> Result<(), CoreError> {
            self.mem
                .borrow_mut()
                .copy_within(src as usize..src as usize + n, dst as usize);
            Ok(())
        }
        fn write_u64(&self, _: u64, _: u64) -> Result<(), CoreError> {
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
            let mut b = CopyBatch::default();
            for &(d, s, n) in &copies {
                b.push(&fake, d, s, n).unwrap();
            }
            b.flush(&fake).unwrap();
            prop_assert!(b.is_empty());
            prop_assert_eq!(fake.mem.into_inner(), seq.mem.into_inner());
        }
    }

    #[test]
    fn disjoint_copies_go_as_one_batch() {
        let fake = Fake {
            mem: RefCell::new(vec![0; 256]),
            ..Fake::default()
        };
        let mut b = CopyBatch::default();
        for i in 0..4u64 {
            b.push(&fake, 128 + i * 16, i * 16, 16).unwrap();
        }
        // Overwrites the first destination: the four go first.
        b.push(&fake, 128, 64, 8).unwrap();
        b.flush(&fake).unwrap();
        assert_eq!(fake.batches.into_inner(), vec![4]);
    }
}
