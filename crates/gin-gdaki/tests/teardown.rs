//! Dropping a GDAKI backend while its soft NIC still executes work: the NIC
//! thread must never write memory the backend already freed (the atomic
//! result sink, the counters). A freed block here is not returned to the
//! system allocator at once: it is poisoned and held in a quarantine, and
//! checked when it leaves, so a write after free is seen deterministically
//! instead of as a rare heap corruption (`malloc_consolidate(): unaligned
//! fastbin chunk detected`) in a rank process much later.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use gin_device::{Backend, Counters, Order, PutOp, SignalUpdate, Source};
use gin_gdaki::loopback::Loopback;
use gin_gdaki::{Gdaki, GdakiConfig};

const POISON: u8 = 0xa5;
/// Blocks of at most this size are quarantined (the sink is 64 bytes).
const SMALL: usize = 256;
const SLOTS: usize = 1 << 14;

/// A system allocator whose small frees wait, poisoned, in a ring of
/// `SLOTS` blocks; a block whose poison changed was written after its free.
struct Quarantine {
    lock: AtomicBool,
    ring: [AtomicUsize; SLOTS],
    sizes: [AtomicUsize; SLOTS],
    aligns: [AtomicUsize; SLOTS],
    next: AtomicUsize,
    /// Blocks found written after their free.
    corrupted: AtomicUsize,
}

impl Quarantine {
    fn lock(&self) {
        while self
            .lock
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            std::hint::spin_loop();
        }
    }

    fn unlock(&self) {
        self.lock.store(false, Ordering::Release);
    }

    /// Counts a block whose poison was overwritten.
    fn check(&self, p: usize, size: usize) {
        // SAFETY: a quarantined block: still allocated from System, `size` bytes.
        let bytes = unsafe { std::slice::from_raw_parts(p as *const u8, size) };
        if bytes.iter().any(|&b| b != POISON) {
            self.corrupted.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Checks every block in quarantine; returns how many were written
    /// after their free, so far.
    fn scan(&self) -> usize {
        self.lock();
        for i in 0..SLOTS {
            let p = self.ring[i].load(Ordering::Relaxed);
            if p != 0 {
                self.check(p, self.sizes[i].load(Ordering::Relaxed));
            }
        }
        self.unlock();
        self.corrupted.load(Ordering::SeqCst)
    }
}

// SAFETY: delegates to System; a quarantined block is freed later with the
// layout it was allocated with.
unsafe impl GlobalAlloc for Quarantine {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if layout.size() > SMALL || layout.size() == 0 || layout.align() > 16 {
            // SAFETY: forwarded.
            unsafe { System.dealloc(ptr, layout) };
            return;
        }
        // SAFETY: the block is ours until it leaves the quarantine.
        unsafe { std::ptr::write_bytes(ptr, POISON, layout.size()) };
        self.lock();
        let i = self.next.load(Ordering::Relaxed) % SLOTS;
        self.next.store(i + 1, Ordering::Relaxed);
        let old = self.ring[i].swap(ptr as usize, Ordering::Relaxed);
        let old_size = self.sizes[i].swap(layout.size(), Ordering::Relaxed);
        let old_align = self.aligns[i].swap(layout.align(), Ordering::Relaxed);
        if old != 0 {
            self.check(old, old_size);
            // SAFETY: allocated by System with this layout.
            unsafe {
                System.dealloc(
                    old as *mut u8,
                    Layout::from_size_align_unchecked(old_size, old_align),
                );
            };
        }
        self.unlock();
    }
}

#[global_allocator]
static ALLOC: Quarantine = Quarantine {
    lock: AtomicBool::new(false),
    ring: [const { AtomicUsize::new(0) }; SLOTS],
    sizes: [const { AtomicUsize::new(0) }; SLOTS],
    aligns: [const { AtomicUsize::new(0) }; SLOTS],
    next: AtomicUsize::new(0),
    corrupted: AtomicUsize::new(0),
};

#[test]
fn dropping_a_busy_backend_never_lets_its_nic_write_freed_memory() {
    let lb = Loopback::new(1 << 16, Duration::from_secs(5));
    let counters = Arc::new(Counters::new(4));
    for _ in 0..50 {
        let g = Gdaki::start(
            lb.fabric.clone(),
            counters.clone(),
            1,
            GdakiConfig {
                sq_log2: 12,
                timeout: Duration::from_secs(5),
                ..GdakiConfig::default()
            },
        )
        .unwrap();
        // Keep the NIC busy with puts whose signal and counter fetch-adds
        // write their old values into the backend's result sink.
        for i in 0..900u64 {
            g.put(&PutOp {
                ctx: 0,
                peer: 0,
                dst: &lb.window,
                dst_off: 8 * (i % 64),
                src: Source::Inline(i),
                bytes: 8,
                signal: Some(SignalUpdate {
                    window: &lb.window,
                    offset: 4096,
                    add: 0x0102_0304_0506_0709,
                    order: Order::Weak,
                }),
                counter: Some(1),
            })
            .unwrap();
        }
        drop(g);
    }
    assert_eq!(
        ALLOC.scan(),
        0,
        "the soft NIC wrote into memory freed when its backend was dropped"
    );
}
