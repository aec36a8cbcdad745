//! The pool of window memory gin allocates: a freed window's allocation is
//! kept for the next window of its size class instead of going back to the
//! driver, as pure policy over any allocation handle (the driver's
//! [`DevMem`](crate::DevMem) in [`Device`](crate::Device), a fake in tests).
//!
//! Why: a peer's UCX (its cuda_ipc transport) caches the IPC mapping of a
//! GPU window by the owner's address. A new allocation at a freed one's
//! address has a new buffer id, so the peer's next put finds the cached
//! mapping stale and closes it (`cuIpcCloseMemHandle`) inside
//! `ucp_put_nbx`, which blocks while that rank's own kernel spins, holding
//! its UCX worker (docs/ucx.md, "CUDA ranks"). A reused allocation keeps
//! its IPC handle and buffer id: the cached mapping stays valid.
//!
//! Size classes: the request rounded up to a whole number of 2 MiB, the
//! page size of device memory on the GPUs gin runs on. A block of whole
//! pages is one allocation of its own: the driver never carves a smaller
//! allocation (a kernel's output buffer) out of the pages a window lay in,
//! where a peer's UCX would meet it at a cached address. Waste is under
//! 2 MiB per window (power-of-two classes would waste up to half of a
//! large window), and windows of one size — the usual pattern, a scenario
//! or benchmark recreating its windows — always share a class.
//!
//! Bound: at most [`IDLE_LIMIT`] bytes stay idle; returning a block beyond
//! that frees the oldest idle blocks first (a block larger than the limit
//! is freed at once). What is freed can again meet a peer's stale cache
//! entry; the limit keeps that to memory a job no longer reuses.

use std::collections::VecDeque;

/// The size-class granule: 2 MiB, device memory's page size.
pub const GRANULE: usize = 2 << 20;

/// The most bytes a device's pool keeps idle (1 GiB).
pub const IDLE_LIMIT: usize = 1 << 30;

/// The size class of a request of `len` bytes: `len` rounded up to a
/// multiple of [`GRANULE`], at least one granule; `None` where that
/// overflows.
pub fn size_class(len: usize) -> Option<usize> {
    let pages = len.max(1).div_ceil(GRANULE);
    pages.checked_mul(GRANULE)
}

/// Idle blocks by size class, oldest returned first, within a byte limit.
#[derive(Debug)]
pub struct Pool<B> {
    /// (class, block), in the order they were returned.
    idle: VecDeque<(usize, B)>,
    /// Sum of the idle blocks' classes.
    idle_bytes: usize,
    /// The most bytes kept idle.
    limit: usize,
    /// Closed: nothing is kept any more (the device is going).
    closed: bool,
    /// Blocks let go of ([`Pool::give`]) but not freed yet: freeing GPU
    /// memory waits for the device, and the last holder of a window's
    /// block may be a thread a running kernel waits on (a transport's
    /// progress thread completing a put). They are freed by the next
    /// thread that takes a block ([`Pool::reap`]) or closes the pool.
    doomed: Vec<B>,
}

impl<B> Pool<B> {
    /// An empty pool keeping at most `limit` bytes idle.
    pub fn new(limit: usize) -> Self {
        Self {
            idle: VecDeque::new(),
            idle_bytes: 0,
            limit,
            closed: false,
            doomed: Vec::new(),
        }
    }

    /// Returns a block of `class` as [`Pool::give`] does, keeping what that
    /// lets go of for a later [`Pool::reap`] instead of handing it back.
    pub fn give_later(&mut self, class: usize, b: B) {
        let free = self.give(class, b);
        self.doomed.extend(free);
    }

    /// The blocks let go of by [`Pool::give_later`] since the last reap,
    /// for the caller to free (a thread that allocates: it may wait).
    pub fn reap(&mut self) -> Vec<B> {
        std::mem::take(&mut self.doomed)
    }

    /// An idle block of `class` (the most recently returned), if any.
    pub fn take(&mut self, class: usize) -> Option<B> {
        let i = self.idle.iter().rposition(|(c, _)| *c == class)?;
        let (c, b) = self.idle.remove(i)?;
        self.idle_bytes -= c;
        Some(b)
    }

    /// Returns a block of `class`; what the caller must free: the oldest
    /// idle blocks beyond the limit, or `b` itself where it alone exceeds
    /// the limit or the pool is closed.
    pub fn give(&mut self, class: usize, b: B) -> Vec<B> {
        if self.closed || class > self.limit {
            return vec![b];
        }
        let mut free = Vec::new();
        while self.idle_bytes + class > self.limit {
            let Some((c, old)) = self.idle.pop_front() else {
                break;
            };
            self.idle_bytes -= c;
            free.push(old);
        }
        self.idle.push_back((class, b));
        self.idle_bytes += class;
        free
    }

    /// Every idle block, for the caller to free (the pool stays usable).
    pub fn drain(&mut self) -> Vec<B> {
        self.idle_bytes = 0;
        self.idle.drain(..).map(|(_, b)| b).collect()
    }

    /// Every idle block, and from now on every block given back is the
    /// caller's to free.
    pub fn close(&mut self) -> Vec<B> {
        self.closed = true;
        let mut all = self.drain();
        all.append(&mut self.doomed);
        all
    }

    /// Whether the pool was closed (its device has gone).
    pub fn closed(&self) -> bool {
        self.closed
    }

    /// Blocks let go of and not reaped yet.
    #[cfg(test)]
    pub fn doomed_blocks(&self) -> usize {
        self.doomed.len()
    }

    /// Bytes idle.
    pub fn idle_bytes(&self) -> usize {
        self.idle_bytes
    }

    /// Blocks idle.
    #[cfg(test)]
    pub fn idle_blocks(&self) -> usize {
        self.idle.len()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use proptest::prelude::*;

    const M: usize = 1 << 20;

    /// What a block's last holder lets go of is not freed on its thread:
    /// it waits for the next taker (or the close), which frees it.
    #[test]
    fn blocks_let_go_of_later_are_freed_by_the_next_taker_or_the_close() {
        let mut p = Pool::new(4 * GRANULE);
        // Beyond the limit: the oldest idle block is let go of.
        for b in 0..5 {
            p.give_later(GRANULE, b);
        }
        assert_eq!((p.idle_blocks(), p.doomed_blocks()), (4, 1));
        // A block larger than the limit is let go of at once, later too.
        p.give_later(8 * GRANULE, 9);
        assert_eq!(p.reap(), vec![0, 9]);
        assert!(p.reap().is_empty());
        p.give_later(8 * GRANULE, 10);
        let mut all = p.close();
        all.sort_unstable();
        assert_eq!(all, vec![1, 2, 3, 4, 10]);
        // Closed: a block given back is let go of, for the next reap.
        p.give_later(GRANULE, 11);
        assert_eq!(p.reap(), vec![11]);
    }

    proptest! {
        #[test]
        fn a_class_holds_the_request_in_whole_granules_wasting_under_one(len in 0usize..(1 << 44)) {
            let c = size_class(len).unwrap();
            prop_assert!(c >= len.max(1));
            prop_assert_eq!(c % GRANULE, 0);
            prop_assert!(c - len.max(1) < GRANULE);
            // Monotone: a larger request never gets a smaller class.
            prop_assert!(size_class(len + 1).unwrap() >= c);
        }
    }

    #[test]
    fn class_edges() {
        assert_eq!(size_class(0), Some(2 * M));
        assert_eq!(size_class(1), Some(2 * M));
        // The selftest's 1000 B and 1024 B parts share a class.
        assert_eq!(size_class(1000), size_class(1024));
        assert_eq!(size_class(2 * M), Some(2 * M));
        assert_eq!(size_class(2 * M + 1), Some(4 * M));
        // The largest class, and past it none.
        let top = usize::MAX - GRANULE + 1;
        assert_eq!(size_class(top - 1), Some(top));
        assert_eq!(size_class(top), Some(top));
        assert_eq!(size_class(top + 1), None);
        assert_eq!(size_class(usize::MAX), None);
    }

    /// A fake allocator: blocks are numbers, and every one is either idle,
    /// in use or freed, exactly once.
    #[derive(Default)]
    struct Fake {
        next: u32,
        freed: Vec<u32>,
    }

    impl Fake {
        fn take(&mut self, p: &mut Pool<u32>, class: usize) -> u32 {
            p.take(class).unwrap_or_else(|| {
                self.next += 1;
                self.next
            })
        }
        fn give(&mut self, p: &mut Pool<u32>, class: usize, b: u32) {
            self.freed.extend(p.give(class, b));
        }
    }

    #[test]
    fn a_freed_block_serves_the_next_request_of_its_class_only() {
        let (mut a, mut p) = (Fake::default(), Pool::new(IDLE_LIMIT));
        let x = a.take(&mut p, 2 * M);
        let y = a.take(&mut p, 4 * M);
        a.give(&mut p, 2 * M, x);
        a.give(&mut p, 4 * M, y);
        assert_eq!((p.idle_bytes(), p.idle_blocks()), (6 * M, 2));
        // Another class allocates afresh; the same class reuses.
        let fresh = a.take(&mut p, 8 * M);
        assert!(fresh != x && fresh != y);
        assert_eq!(a.take(&mut p, 4 * M), y);
        assert_eq!(a.take(&mut p, 2 * M), x);
        assert_eq!(p.idle_bytes(), 0);
        assert!(a.freed.is_empty());
    }

    #[test]
    fn the_most_recently_returned_block_of_a_class_is_taken_first() {
        let (mut a, mut p) = (Fake::default(), Pool::new(IDLE_LIMIT));
        let (x, y) = (a.take(&mut p, 2 * M), a.take(&mut p, 2 * M));
        a.give(&mut p, 2 * M, x);
        a.give(&mut p, 2 * M, y);
        assert_eq!(p.take(2 * M), Some(y));
        assert_eq!(p.take(2 * M), Some(x));
        assert_eq!(p.take(2 * M), None);
    }

    #[test]
    fn idle_bytes_stay_within_the_limit_freeing_the_oldest() {
        let (mut a, mut p) = (Fake::default(), Pool::new(6 * M));
        let b: Vec<u32> = (0..4).map(|_| a.take(&mut p, 2 * M)).collect();
        for &x in &b {
            a.give(&mut p, 2 * M, x);
            assert!(p.idle_bytes() <= 6 * M);
        }
        // The fourth return pushed out the first.
        assert_eq!(a.freed, vec![b[0]]);
        assert_eq!(p.idle_blocks(), 3);
        // A 4 MiB return pushes out the two oldest 2 MiB blocks.
        let big = a.take(&mut p, 4 * M);
        a.give(&mut p, 4 * M, big);
        assert_eq!(a.freed, vec![b[0], b[1], b[2]]);
        assert_eq!(p.idle_bytes(), 6 * M);
        // A block over the limit is freed at once, the idle ones kept.
        let huge = a.take(&mut p, 8 * M);
        a.give(&mut p, 8 * M, huge);
        assert_eq!(a.freed.last(), Some(&huge));
        assert_eq!(p.idle_bytes(), 6 * M);
    }

    #[test]
    fn a_closed_pool_hands_back_everything() {
        let (mut a, mut p) = (Fake::default(), Pool::new(IDLE_LIMIT));
        let (x, y) = (a.take(&mut p, 2 * M), a.take(&mut p, 2 * M));
        a.give(&mut p, 2 * M, x);
        assert_eq!(p.close(), vec![x]);
        // A block in use when the device went is freed on return.
        a.give(&mut p, 2 * M, y);
        assert_eq!(a.freed, vec![y]);
        assert_eq!((p.idle_bytes(), p.idle_blocks()), (0, 0));
    }

    #[test]
    fn draining_frees_every_idle_block_and_keeps_the_pool() {
        let (mut a, mut p) = (Fake::default(), Pool::new(IDLE_LIMIT));
        let x = a.take(&mut p, 2 * M);
        a.give(&mut p, 2 * M, x);
        assert_eq!(p.drain(), vec![x]);
        assert_eq!(p.idle_bytes(), 0);
        a.give(&mut p, 2 * M, x);
        assert_eq!(p.take(2 * M), Some(x));
    }

    proptest! {
        /// Any sequence of takes and returns: every block is idle, in use or
        /// freed, exactly once; idle bytes never exceed the limit and equal
        /// the idle blocks' classes.
        #[test]
        fn blocks_are_conserved_and_idle_bytes_bounded(
            ops in proptest::collection::vec((any::<bool>(), 1usize..5), 1..200)
        ) {
            let limit = 8 * M;
            let (mut a, mut p) = (Fake::default(), Pool::new(limit));
            let mut used: Vec<(usize, u32)> = Vec::new();
            for (take, pages) in ops {
                let class = pages * GRANULE;
                if take || used.is_empty() {
                    let b = a.take(&mut p, class);
                    prop_assert!(!a.freed.contains(&b));
                    prop_assert!(used.iter().all(|&(_, u)| u != b));
                    used.push((class, b));
                } else {
                    let (c, b) = used.remove(pages % used.len());
                    a.give(&mut p, c, b);
                }
                prop_assert!(p.idle_bytes() <= limit);
            }
            let idle = p.drain();
            let mut all: Vec<u32> = idle.into_iter()
                .chain(used.iter().map(|&(_, b)| b))
                .chain(a.freed.iter().copied())
                .collect();
            all.sort_unstable();
            prop_assert_eq!(all, (1..=a.next).collect::<Vec<_>>());
        }
    }
}
