//! The signal / counter id space: first-fit allocation of contiguous ranges
//! with coalescing on free (as NCCL's ncclSpace). Pure: every rank runs the
//! same sequence of calls and so gets the same ranges. [`IdSpace`] is the
//! allocator; a communicator's pair of spaces (signals, counters), taken
//! from together and given back on drop, is `Spaces`, the same for CPU and
//! CUDA ranks.

use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};

/// A space of `capacity` slots handed out in contiguous ranges.
#[derive(Debug, Clone)]
pub struct IdSpace {
    capacity: u64,
    /// Free ranges: start → length, never adjacent (coalesced).
    free: BTreeMap<u64, u64>,
}

/// Why a range could not be had.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SpaceError {
    /// No free range is long enough.
    #[error(
        "{what} space exhausted: {want} contiguous slots requested, largest free range is {largest} of {capacity}"
    )]
    Exhausted {
        /// The space (for example `"signal"`).
        what: &'static str,
        /// The slots requested.
        want: u64,
        /// The longest free range.
        largest: u64,
        /// The space's capacity.
        capacity: u64,
    },
    /// A range freed that was not (wholly) allocated.
    #[error("freeing {len} slots at {start}, which were not allocated")]
    NotAllocated {
        /// The range's first slot.
        start: u64,
        /// The range's length.
        len: u64,
    },
}

impl IdSpace {
    /// A space of `capacity` slots, all free.
    pub fn new(capacity: u64) -> Self {
        let mut free = BTreeMap::new();
        if capacity > 0 {
            free.insert(0, capacity);
        }
        Self { capacity, free }
    }

    /// Slots in the space, free or not.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Slots currently free.
    pub fn free_slots(&self) -> u64 {
        self.free.values().sum()
    }

    /// The first free range of `len` slots (lowest start). `len == 0` yields
    /// an empty range at 0 and takes nothing.
    pub fn alloc(&mut self, len: u64, what: &'static str) -> Result<u64, SpaceError> {
        if len == 0 {
            return Ok(0);
        }
        let Some((&start, &have)) = self.free.iter().find(|&(_, &l)| l >= len) else {
            return Err(SpaceError::Exhausted {
                what,
                want: len,
                largest: self.free.values().copied().max().unwrap_or(0),
                capacity: self.capacity,
            });
        };
        self.free.remove(&start);
        if have > len {
            self.free.insert(start + len, have - len);
        }
        Ok(start)
    }

    /// Returns a range, merging it with free neighbours.
    pub fn free(&mut self, start: u64, len: u64) -> Result<(), SpaceError> {
        if len == 0 {
            return Ok(());
        }
        let end = start
            .checked_add(len)
            .filter(|&e| e <= self.capacity)
            .ok_or(SpaceError::NotAllocated { start, len })?;
        // Must not overlap any free range.
        let prev = self.free.range(..=start).next_back().map(|(&s, &l)| (s, l));
        let next = self.free.range(start..).next().map(|(&s, &l)| (s, l));
        if prev.is_some_and(|(s, l)| s + l > start) || next.is_some_and(|(s, _)| s < end) {
            return Err(SpaceError::NotAllocated { start, len });
        }
        let (mut s, mut e) = (start, end);
        if let Some((ps, pl)) = prev
            && ps + pl == start
        {
            self.free.remove(&ps);
            s = ps;
        }
        if let Some((ns, nl)) = next
            && ns == end
        {
            self.free.remove(&ns);
            e = ns + nl;
        }
        self.free.insert(s, e - s);
        Ok(())
    }
}

/// A communicator's signal and counter id spaces (CPU and CUDA ranks each
/// have theirs): a device communicator takes one range of each, both or
/// neither, and gives them back when the [`Ranges`] drop.
#[derive(Debug)]
pub(crate) struct Spaces(Mutex<(IdSpace, IdSpace)>);

impl Spaces {
    /// `signals` signal slots and `counters` counter slots.
    pub(crate) fn new(signals: u64, counters: u64) -> Self {
        Self(Mutex::new((IdSpace::new(signals), IdSpace::new(counters))))
    }

    /// Takes `nsig` signals and `ncnt` counters: both, or (on an error)
    /// neither.
    pub(crate) fn take(&self, nsig: u64, ncnt: u64) -> Result<Ranges<'_>, SpaceError> {
        let mut s = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let sb = s.0.alloc(nsig, "signal")?;
        let cb = match s.1.alloc(ncnt, "counter") {
            Ok(cb) => cb,
            Err(e) => {
                let _ = s.0.free(sb, nsig);
                return Err(e);
            }
        };
        Ok(Ranges {
            spaces: self,
            signals: (sb, nsig),
            counters: (cb, ncnt),
            release: true,
        })
    }
}

/// Signal and counter ranges (start, length) taken from [`Spaces`], given
/// back when dropped unless [kept reserved](Ranges::keep_reserved).
#[derive(Debug)]
pub(crate) struct Ranges<'s> {
    spaces: &'s Spaces,
    pub(crate) signals: (u64, u64),
    pub(crate) counters: (u64, u64),
    release: bool,
}

impl Ranges<'_> {
    /// Keeps the ranges out of reuse for good: a device communicator
    /// dropped without being destroyed may still have a signal in flight
    /// to them, which could otherwise land in a newer one.
    pub(crate) fn keep_reserved(&mut self) {
        self.release = false;
    }
}

impl Drop for Ranges<'_> {
    fn drop(&mut self) {
        if !self.release {
            return;
        }
        let mut s = self.spaces.0.lock().unwrap_or_else(PoisonError::into_inner);
        let _ = s.0.free(self.signals.0, self.signals.1);
        let _ = s.1.free(self.counters.0, self.counters.1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The model: a bitmap of used slots, first fit by linear scan.
    fn model_alloc(used: &mut [bool], len: usize) -> Option<usize> {
        (0..=used.len().checked_sub(len)?)
            .find(|&s| used[s..s + len].iter().all(|u| !u))
            .inspect(|&s| {
                used[s..s + len].iter_mut().for_each(|u| *u = true);
            })
    }

    proptest! {
        #[test]
        fn matches_a_bitmap_model(cap in 1u64..200, ops in proptest::collection::vec((any::<bool>(), 1u64..40, any::<prop::sample::Index>()), 1..200)) {
            let mut space = IdSpace::new(cap);
            let mut used = vec![false; cap as usize];
            let mut live: Vec<(u64, u64)> = Vec::new();
            for (alloc, len, pick) in ops {
                if alloc || live.is_empty() {
                    let got = space.alloc(len, "test");
                    let want = model_alloc(&mut used, len as usize);
                    match (got, want) {
                        (Ok(s), Some(m)) => { prop_assert_eq!(s, m as u64); live.push((s, len)); }
                        (Err(SpaceError::Exhausted { .. }), None) => {}
                        (g, w) => prop_assert!(false, "space {:?} vs model {:?}", g, w),
                    }
                } else {
                    let (s, l) = live.swap_remove(pick.index(live.len()));
                    space.free(s, l).unwrap();
                    used[s as usize..(s + l) as usize].iter_mut().for_each(|u| *u = false);
                }
                prop_assert_eq!(space.free_slots(), used.iter().filter(|u| !**u).count() as u64);
                // Coalesced: no two free ranges touch.
                let ranges: Vec<_> = space.free.iter().collect();
                for w in ranges.windows(2) {
                    prop_assert!(w[0].0 + w[0].1 < *w[1].0);
                }
            }
        }
    }

    #[test]
    fn freed_ids_are_reused_and_double_free_is_refused() {
        let mut s = IdSpace::new(10);
        let a = s.alloc(4, "signal").unwrap();
        let b = s.alloc(4, "signal").unwrap();
        assert_eq!((a, b), (0, 4));
        let e = s.alloc(4, "signal").unwrap_err();
        assert_eq!(
            e.to_string(),
            "signal space exhausted: 4 contiguous slots requested, largest free range is 2 of 10"
        );
        s.free(a, 4).unwrap();
        assert_eq!(s.alloc(3, "signal").unwrap(), 0);
        assert!(s.free(4, 4).is_ok());
        assert_eq!(
            s.free(4, 4),
            Err(SpaceError::NotAllocated { start: 4, len: 4 })
        );
        assert!(s.free(9, 5).is_err());
    }

    /// Signals and counters are taken both or neither; dropped ranges come
    /// back, kept ones never do (the id-range rollback CPU and CUDA ranks
    /// share).
    #[test]
    fn ranges_are_taken_both_or_neither_and_given_back_unless_kept() {
        let s = Spaces::new(8, 4);
        let e = s.take(8, 5).unwrap_err();
        assert!(e.to_string().contains("counter space exhausted"), "{e}");
        let mut r = s.take(8, 4).unwrap();
        assert_eq!((r.signals, r.counters), ((0, 8), (0, 4)));
        assert!(s.take(1, 0).is_err());
        drop(r);
        r = s.take(8, 4).unwrap();
        r.keep_reserved();
        drop(r);
        assert!(s.take(1, 0).is_err());
    }
}
