//! The ucx transport's unit tests. Those that need UCX load it from
//! `GIN_UCX_LIB` (`cargo xtask test` sets it to the pinned wheel's
//! library) and run ranks as threads of this process; without it they
//! print that they were skipped and why, and with `GIN_REQUIRE_UCX=1` or
//! `CI` set they fail instead.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::sync::atomic::AtomicI8;

use gin_bootstrap::{Config, run_threads};

use super::*;
use crate::region::Removal;
use crate::window::{Addr, MemDesc, MemParts};

thread_local! {
    /// Whether this thread is inside a request's completion callback
    /// (`op_done`).
    pub(super) static IN_CALLBACK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Window memory UCX allocated that was unmapped inside a completion
/// callback (which must never happen: see `Lent::Kept`).
pub(super) static UNMAPPED_IN_CALLBACK: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// `GIN_UCX_*` settings of the transports this thread starts (a test's
    /// rank thread), read before the environment ([`super::setting`]):
    /// `None` reads as unset.
    pub(super) static SETTINGS: std::cell::RefCell<std::collections::BTreeMap<&'static str, Option<String>>> =
        const { std::cell::RefCell::new(std::collections::BTreeMap::new()) };
}

/// Failures the tests inject into a transport.
#[derive(Default)]
pub(super) struct Hooks {
    /// Non-zero: every `ucp_mem_map` fails with this status instead.
    map_fails: AtomicI8,
    /// Revocation acknowledgements are held back (a slow peer) ...
    hold: AtomicBool,
    /// ... here, until `release_acks`.
    held: Mutex<Vec<(usize, u32)>>,
    /// Every mapping attempted: the region's base and the thread's name.
    mapped: Mutex<Vec<(usize, String)>>,
    /// Regions behind a backing are mapped as host memory (their base is
    /// host memory in these tests: CUDA ranks' windows imitated).
    pub(super) backed_as_host: AtomicBool,
    /// Issue calls block while set, holding the peer's lock (a UCX call
    /// held in the CUDA driver, which holds UCX's worker) ...
    block_issue: AtomicBool,
    /// ... and set this once one does.
    blocked: AtomicBool,
    /// The progress thread makes no progress while set (a stopped rank).
    pub(super) stopped: AtomicBool,
    /// Bases of the revoked regions unmapped.
    pub(super) unmapped: Mutex<Vec<usize>>,
    /// A put from lent memory, once numbered, blocks before it is passed
    /// to `ucp_put_nbx` while set (holding the peer's lock) ...
    block_numbered: AtomicBool,
    /// ... and sets this once one does.
    numbered_blocked: AtomicBool,
    /// Waits for puts from lent memory begun ([`Inner::settle`]).
    settling: AtomicU64,
    /// The progress thread's turns: at the worker ...
    pub(super) turns: AtomicU64,
    /// ... and standing back while another thread issued.
    pub(super) stood_back: AtomicU64,
}

impl Hooks {
    pub(super) fn map_fails(&self) -> Option<i8> {
        match self.map_fails.load(Ordering::Acquire) {
            0 => None,
            st => Some(st),
        }
    }

    pub(super) fn mapping_on_this_thread(&self, base: usize) {
        let name = std::thread::current().name().unwrap_or("?").to_owned();
        lock(&self.mapped).push((base, name));
    }

    /// Blocks an issue call while `block_issue` is set.
    pub(super) fn issuing(&self) {
        if self.block_issue.load(Ordering::Acquire) {
            self.blocked.store(true, Ordering::Release);
            while self.block_issue.load(Ordering::Acquire) {
                std::thread::yield_now();
            }
        }
    }

    /// Blocks a numbered put from lent memory while `block_numbered` is
    /// set.
    pub(super) fn numbered(&self) {
        if self.block_numbered.load(Ordering::Acquire) {
            self.numbered_blocked.store(true, Ordering::Release);
            while self.block_numbered.load(Ordering::Acquire) {
                std::thread::yield_now();
            }
        }
    }

    /// Counts a wait for puts from lent memory begun.
    pub(super) fn settling(&self) {
        self.settling.fetch_add(1, Ordering::AcqRel);
    }

    /// Whether the acknowledgement of `key` to `owner` is held back.
    pub(super) fn hold_ack(&self, owner: usize, key: u32) -> bool {
        let mut held = lock(&self.held);
        if self.hold.load(Ordering::Acquire) {
            held.push((owner, key));
            return true;
        }
        false
    }
}

impl UcxTransport {
    fn release_acks(&self) {
        let held = {
            let mut h = lock(&self.inner.test.held);
            self.inner.test.hold.store(false, Ordering::Release);
            std::mem::take(&mut *h)
        };
        for (owner, key) in held {
            self.inner.queue(Work::Acknowledge { owner, key });
        }
    }
}

/// Whether UCX can be loaded; `false` after printing why the test is
/// skipped (panicking instead where UCX is required).
fn ucx_here() -> bool {
    let found = std::env::var("GIN_UCX_LIB")
        .ok()
        .is_some_and(|p| std::path::Path::new(&p).exists());
    if !found {
        let why = "GIN_UCX_LIB does not name an existing libucp.so.0 (`cargo xtask test` installs the pinned UCX wheel and sets it)";
        let required = std::env::var("GIN_REQUIRE_UCX").is_ok_and(|v| v == "1")
            || std::env::var_os("CI").is_some();
        assert!(
            !required,
            "UCX is required here (GIN_REQUIRE_UCX=1 or CI) but {why}"
        );
        println!("SKIPPED: this test needs UCX: {why}");
    }
    found
}

/// Two ranks as threads, each with its own region table and ucx
/// transport to the other.
fn two_ranks<T: Send + 'static>(
    timeout: Duration,
    f: impl Fn(&gin_bootstrap::Bootstrap, Arc<RegionTable>) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let cfg = Config {
        timeout: Duration::from_secs(60),
        ..Config::default()
    };
    run_threads(2, cfg, move |b| {
        let _ = timeout;
        f(&b, Arc::new(RegionTable::default()))
    })
    .unwrap()
}

fn start(
    b: &gin_bootstrap::Bootstrap,
    table: &Arc<RegionTable>,
    timeout: Duration,
) -> UcxTransport {
    let peers = [b.rank() == 1, b.rank() == 0];
    UcxTransport::start(b, table.clone(), &peers, timeout).unwrap()
}

/// Registers `mem` (kept alive by the caller until it is removed).
fn register(table: &RegionTable, mem: &mut [u64]) -> u32 {
    // SAFETY: the callers keep `mem` alive, unmoved, until the region is
    // removed or the test ends (after the transport is dropped).
    unsafe { table.insert(mem.as_mut_ptr().cast(), (mem.len() * 8) as u64, Access::ALL) }.unwrap()
}

fn key_of(b: &gin_bootstrap::Bootstrap, key: u32, rank: usize) -> u32 {
    let keys = b.allgather(&key.to_le_bytes()).unwrap();
    u32::from_le_bytes(keys[rank][..4].try_into().unwrap())
}

/// A window description with the owner's key only (no bases: nothing is
/// mapped here).
fn window_of(key: u32) -> MemDesc {
    // SAFETY: no base and no state word: nothing to vouch for.
    unsafe {
        MemDesc::new(MemParts {
            sizes: vec![4096, 4096],
            keys: vec![0, key],
            addrs: vec![0, 0],
            ..Default::default()
        })
    }
}

/// An owner whose `ucp_mem_map` fails answers the request for the rkey
/// with UCX's status, at once: for a region mapped at registration (the
/// failure kept) and one mapped when first asked for (registered before
/// the transport started). The initiator's error names the window and
/// offset, the key, the failed call and UCX's text for the status.
#[test]
fn an_owner_that_cannot_map_a_region_answers_with_the_ucx_status_promptly() {
    if !ucx_here() {
        return;
    }
    let timeout = Duration::from_secs(30);
    let out = two_ranks(timeout, move |b, table| {
        let mut early = vec![0u64; 512];
        let mut late = vec![0u64; 512];
        let early_key = if b.rank() == 1 {
            register(&table, &mut early)
        } else {
            0
        };
        let t = start(b, &table, timeout);
        let late_key = if b.rank() == 1 {
            t.inner
                .test
                .map_fails
                .store(sys::UCS_ERR_IO_ERROR, Ordering::Release);
            register(&table, &mut late)
        } else {
            0
        };
        let (early_key, late_key) = (key_of(b, early_key, 1), key_of(b, late_key, 1));
        let mut errors = Vec::new();
        if b.rank() == 0 {
            for key in [late_key, early_key] {
                let w = window_of(key);
                let at = Target::Window(
                    &w,
                    Addr {
                        window: 7,
                        offset: 64,
                    },
                );
                let began = Instant::now();
                let e = t.put(1, at, &[1; 8], None).unwrap_err();
                errors.push((key, began.elapsed(), e.to_string()));
            }
        }
        b.barrier().unwrap();
        drop(t);
        errors
    });
    let text = {
        let lib = load::open().unwrap();
        load::status_text(&lib, sys::UCS_ERR_IO_ERROR)
    };
    assert_eq!(out[0].len(), 2);
    for (key, took, e) in &out[0] {
        assert!(
            *took < Duration::from_secs(5),
            "{took:?} for the refusal: {e}"
        );
        for part in [
            "ucp_mem_map failed",
            text.as_str(),
            &format!("{key:#010x}"),
            "window 7",
            "offset 64",
        ] {
            assert!(e.contains(part), "{e:?} lacks {part:?}");
        }
    }
}

/// An owner unmaps a revoked region only after every peer that held its
/// rkey acknowledged (a peer slower than any fixed bound), not after a
/// fixed wait; then the memory is released to its owner.
#[test]
fn an_owner_unmaps_only_after_every_holder_acknowledged() {
    if !ucx_here() {
        return;
    }
    let timeout = Duration::from_secs(30);
    let released = Arc::new(AtomicBool::new(false));
    let out = two_ranks(timeout, move |b, table| {
        let released = released.clone();
        let t = start(b, &table, timeout);
        let mut mem = vec![0u64; 512];
        let key = if b.rank() == 1 {
            register(&table, &mut mem)
        } else {
            0
        };
        let key = key_of(b, key, 1);
        let mut seen = None;
        if b.rank() == 0 {
            t.put(1, Target::Key { key, offset: 0 }, &[5; 8], None)
                .unwrap();
            t.fence(1, timeout).unwrap();
            t.inner.test.hold.store(true, Ordering::Release);
        }
        b.barrier().unwrap();
        if b.rank() == 1 {
            let verdict = table.remove(key);
            let base = mem.as_ptr() as usize;
            let unmapped = lock(&t.inner.test.unmapped).contains(&base);
            seen = Some((released.load(Ordering::Acquire), verdict, unmapped));
        } else {
            let began = Instant::now();
            while lock(&t.inner.test.held).is_empty() {
                assert!(began.elapsed() < timeout, "no revocation arrived");
                std::thread::yield_now();
            }
            // Slower than the 2 s an owner used to wait at most.
            std::thread::sleep(Duration::from_secs(3));
            released.store(true, Ordering::Release);
            t.release_acks();
        }
        b.barrier().unwrap();
        drop(t);
        seen
    });
    let (acked, verdict, unmapped) = out[1].unwrap();
    assert!(acked, "the owner unmapped before the peer acknowledged");
    assert_eq!(verdict, Removal::Released);
    assert!(unmapped, "the acknowledged region was not unmapped");
}

/// A peer that holds a region's rkey and neither acknowledges its
/// revocation nor is known to have failed is waited for up to the job's
/// timeout, whether it is silent (stopped: no answer to pings, once taken
/// for dead after 2 s) or answers pings: then the region stays mapped,
/// quarantined, and its owner is told not to reuse the memory. A silent
/// peer is reported to the job (`blame_to`), one answering pings is not.
#[test]
fn a_peer_that_never_acknowledges_leaves_the_region_quarantined_not_unmapped() {
    if !ucx_here() {
        return;
    }
    for stopped in [true, false] {
        let timeout = Duration::from_secs(3);
        let out = two_ranks(timeout, move |b, table| {
            let t = start(b, &table, timeout);
            let blamed = Arc::new(Mutex::new(Vec::new()));
            let to = blamed.clone();
            t.blame_to(Arc::new(move |peer, why: &str| {
                lock(&to).push((peer, why.to_owned()));
            }));
            let mut mem = vec![0u64; 512];
            let key = if b.rank() == 1 {
                register(&table, &mut mem)
            } else {
                0
            };
            let key = key_of(b, key, 1);
            if b.rank() == 0 {
                t.put(1, Target::Key { key, offset: 0 }, &[5; 8], None)
                    .unwrap();
                t.fence(1, timeout).unwrap();
                if stopped {
                    t.inner.test.stopped.store(true, Ordering::Release);
                } else {
                    t.inner.test.hold.store(true, Ordering::Release);
                }
            }
            b.barrier().unwrap();
            let mut seen = None;
            if b.rank() == 1 {
                let began = Instant::now();
                let verdict = table.remove(key);
                let took = began.elapsed();
                let base = mem.as_ptr() as usize;
                let unmapped = lock(&t.inner.test.unmapped).contains(&base);
                let kept = lock(&t.inner.quarantined).iter().any(|m| m.base() == base);
                let blamed = lock(&blamed).clone();
                seen = Some((verdict, took, unmapped, kept, blamed));
            }
            b.barrier().unwrap();
            t.inner.test.stopped.store(false, Ordering::Release);
            drop(t);
            seen
        });
        let (verdict, took, unmapped, kept, blamed) = out[1].clone().unwrap();
        if stopped {
            assert_eq!(blamed.len(), 1, "{blamed:?}");
            assert_eq!(blamed[0].0, 0);
            assert!(
                blamed[0].1.contains("rank 1 had no answer")
                    && blamed[0].1.contains("acknowledgement of the revocation"),
                "{blamed:?}"
            );
        } else {
            assert!(blamed.is_empty(), "{blamed:?}");
        }
        assert_eq!(verdict, Removal::Quarantined, "stopped: {stopped}");
        assert!(
            took >= Duration::from_secs(3),
            "stopped: {stopped}: ended after {took:?}, before the job's timeout"
        );
        assert!(took < Duration::from_secs(10), "{took:?}");
        assert!(!unmapped && kept, "stopped: {stopped}: unmapped");
    }
}

/// A holder whose path this rank gave up on (its own wait timed out, its
/// endpoint closed here) may still write: the region is quarantined, not
/// released (it was released, and its memory freed, before), and at once,
/// since no acknowledgement can be awaited. (A holder whose endpoint failed
/// from its side, one that left or died, releases it: normal teardown
/// must not leak.)
#[test]
fn a_holder_whose_path_failed_here_leaves_the_region_quarantined() {
    if !ucx_here() {
        return;
    }
    let timeout = Duration::from_secs(20);
    let out = two_ranks(timeout, move |b, table| {
        let t = start(b, &table, timeout);
        let mut mem = vec![0u64; 512];
        let key = if b.rank() == 1 {
            register(&table, &mut mem)
        } else {
            0
        };
        let key = key_of(b, key, 1);
        if b.rank() == 0 {
            t.put(1, Target::Key { key, offset: 0 }, &[5; 8], None)
                .unwrap();
            t.fence(1, timeout).unwrap();
            t.inner.test.hold.store(true, Ordering::Release);
        }
        b.barrier().unwrap();
        let mut seen = None;
        if b.rank() == 1 {
            // As a wait that timed out does (`Inner::settle`, `wait`).
            let p0 = t.inner.peer_opt(0).unwrap();
            p0.gave_up.store(true, Ordering::Release);
            p0.error.set("test: this rank gave up on rank 0".into());
            let began = Instant::now();
            let verdict = table.remove(key);
            let base = mem.as_ptr() as usize;
            let unmapped = lock(&t.inner.test.unmapped).contains(&base);
            seen = Some((verdict, began.elapsed(), unmapped));
        }
        b.barrier().unwrap();
        drop(t);
        seen
    });
    let (verdict, took, unmapped) = out[1].unwrap();
    assert_eq!(verdict, Removal::Quarantined);
    assert!(!unmapped, "the region was unmapped");
    assert!(took < Duration::from_secs(5), "the removal waited {took:?}");
}

/// A holder that left in order (its transport dropped, after its puts
/// were confirmed) writes nothing more: an owner removing the region after
/// the job heard of the departure releases it, and does not quarantine
/// (leak) it. Every region of a normal teardown used to be quarantined
/// once a rank had left (review of ea353aa).
#[test]
fn a_holder_that_left_in_order_releases_the_region() {
    if !ucx_here() {
        return;
    }
    let timeout = Duration::from_secs(20);
    let out = two_ranks(timeout, move |b, table| {
        let t = start(b, &table, timeout);
        // The job's health, as the fabric hands it: fails once rank 0 left.
        let left = Arc::new(AtomicBool::new(false));
        let seen = left.clone();
        t.watch(Arc::new(move || {
            if seen.load(Ordering::Acquire) {
                Err("rank 0 exited (it left the job in order)".into())
            } else {
                Ok(())
            }
        }));
        let mut mem = vec![0u64; 8192];
        let key = if b.rank() == 1 {
            register(&table, &mut mem)
        } else {
            0
        };
        let key = key_of(b, key, 1);
        if b.rank() == 0 {
            // Larger than a put message: by RMA, with the region's rkey.
            t.put(1, Target::Key { key, offset: 0 }, &vec![5; 32 << 10], None)
                .unwrap();
            t.confirm(1, timeout).unwrap();
            t.inner.test.hold.store(true, Ordering::Release);
            drop(t);
            b.barrier().unwrap();
            b.barrier().unwrap();
            return None;
        }
        b.barrier().unwrap();
        let held = lock(&t.inner.served)
            .get(&key)
            .is_some_and(|m| m.holders.contains(&0));
        assert!(
            held,
            "rank 0 never asked for the rkey: nothing would test the release"
        );
        left.store(true, Ordering::Release);
        let began = Instant::now();
        let verdict = table.remove(key);
        let took = began.elapsed();
        let unmapped = lock(&t.inner.test.unmapped).contains(&(mem.as_ptr() as usize));
        b.barrier().unwrap();
        drop(t);
        Some((verdict, took, unmapped))
    });
    let (verdict, took, unmapped) = out[1].unwrap();
    assert_eq!(verdict, Removal::Released);
    assert!(unmapped, "the released region was not unmapped");
    assert!(took < Duration::from_secs(5), "the removal waited {took:?}");
}

/// A removal waiting for a peer's acknowledgement ends when the
/// transport is dropped (closing), not at the job's timeout.
#[test]
fn dropping_the_transport_ends_a_wait_for_acknowledgements() {
    if !ucx_here() {
        return;
    }
    let timeout = Duration::from_secs(40);
    let out = two_ranks(timeout, move |b, table| {
        let t = start(b, &table, timeout);
        let mut mem = vec![0u64; 512];
        let key = if b.rank() == 1 {
            register(&table, &mut mem)
        } else {
            0
        };
        let key = key_of(b, key, 1);
        if b.rank() == 0 {
            t.put(1, Target::Key { key, offset: 0 }, &[5; 8], None)
                .unwrap();
            t.fence(1, timeout).unwrap();
            t.inner.test.hold.store(true, Ordering::Release);
        }
        b.barrier().unwrap();
        let mut took = None;
        if b.rank() == 1 {
            let began = Instant::now();
            let remover = {
                let table = table.clone();
                std::thread::spawn(move || table.remove(key))
            };
            // The removal is waiting once its revocation is outstanding.
            while lock(&t.inner.acks).is_empty() && !remover.is_finished() {
                std::thread::yield_now();
            }
            // The removal must really be waiting for rank 0's
            // acknowledgement (held back above) when the transport goes:
            // else this test would pass without a wait to end.
            assert!(
                !remover.is_finished() && !lock(&t.inner.acks).is_empty(),
                "the removal did not wait for the held acknowledgement"
            );
            drop(t);
            remover.join().unwrap();
            took = Some(began.elapsed());
            b.barrier().unwrap();
        } else {
            b.barrier().unwrap();
            drop(t);
        }
        took
    });
    let took = out[1].unwrap();
    assert!(
        took < Duration::from_secs(10),
        "the removal waited {took:?}"
    );
}

/// The progress thread sleeps only after polling `spin` since the last
/// event.
#[test]
fn the_progress_thread_polls_for_spin_after_the_last_event() {
    let t0 = Instant::now();
    let spin = Duration::from_micros(100);
    let mut idle = serve::Idle::new(spin, t0);
    assert!(!idle.may_sleep(t0));
    assert!(!idle.may_sleep(t0 + Duration::from_micros(99)));
    assert!(idle.may_sleep(t0 + spin));
    idle.busy(t0 + spin);
    assert!(!idle.may_sleep(t0 + spin + Duration::from_micros(50)));
    assert!(idle.may_sleep(t0 + spin * 2));
    // No spin: sleep whenever idle.
    assert!(serve::Idle::new(Duration::ZERO, t0).may_sleep(t0));
}

/// Events a little more than `spin` apart (1 MiB puts whose signals this
/// thread handles) keep it polling between them: it polls twice the
/// recent quiet time, up to `SPIN_REACH`, and forgets it as events come
/// closer, or once a quiet time is longer than that.
#[test]
fn the_progress_thread_polls_across_the_gaps_of_a_steady_stream() {
    let us = Duration::from_micros;
    let t0 = Instant::now();
    let mut idle = serve::Idle::new(us(100), t0);
    // A first event 250 µs after the start: 500 µs of polling after it.
    idle.event(t0 + us(250));
    assert_eq!(idle.window(), us(500));
    assert!(!idle.may_sleep(t0 + us(250) + us(499)));
    assert!(idle.may_sleep(t0 + us(250) + us(500)));
    // Something in flight is no event: the window stays.
    idle.busy(t0 + us(300));
    assert_eq!(idle.window(), us(500));
    // Events back to back: the quiet time is forgotten by quarters...
    let mut t = t0 + us(300);
    let mut windows = Vec::new();
    for _ in 0..4 {
        t += us(1);
        idle.event(t);
        windows.push(idle.window());
    }
    let ns = Duration::from_nanos;
    assert_eq!(windows, [us(375), ns(281_250), ns(210_936), ns(158_202)]);
    // ... down to `spin`.
    for _ in 0..10 {
        t += us(1);
        idle.event(t);
    }
    assert_eq!(idle.window(), us(100));
    // Long quiet times are polled for at most `SPIN_REACH` ...
    t += us(900);
    idle.event(t);
    assert_eq!(idle.window(), serve::SPIN_REACH);
    // ... and one longer than that makes the stream sparse: `spin` again.
    t += serve::SPIN_REACH + us(1);
    idle.event(t);
    assert_eq!(idle.window(), us(100));
    // `GIN_UCX_SPIN=0` sleeps whenever idle, stream or not.
    let mut none = serve::Idle::new(Duration::ZERO, t0);
    none.event(t0 + us(250));
    assert!(none.may_sleep(t0 + us(250)));
}

#[test]
fn gin_ucx_spin_is_a_duration_or_an_error_naming_it() {
    assert_eq!(spin_from_env(None).unwrap(), SPIN);
    assert_eq!(spin_from_env(Some("0")).unwrap(), Duration::ZERO);
    assert_eq!(
        spin_from_env(Some("250us")).unwrap(),
        Duration::from_micros(250)
    );
    let e = spin_from_env(Some("soon")).unwrap_err().to_string();
    assert!(e.contains("GIN_UCX_SPIN") && e.contains("soon"), "{e}");
}

/// A worker without `UCS_THREAD_MODE_MULTI` is refused, naming the mode.
#[test]
fn a_worker_without_multi_thread_mode_is_refused() {
    assert!(worker::thread_mode_ok(sys::UCS_THREAD_MODE_MULTI).is_ok());
    for (mode, name) in [
        (sys::UCS_THREAD_MODE_SINGLE, "UCS_THREAD_MODE_SINGLE"),
        (
            sys::UCS_THREAD_MODE_SERIALIZED,
            "UCS_THREAD_MODE_SERIALIZED",
        ),
    ] {
        let e = worker::thread_mode_ok(mode).unwrap_err().to_string();
        assert!(
            e.contains(name) && e.contains("UCS_THREAD_MODE_MULTI"),
            "{e}"
        );
    }
}

/// The pinned UCX gives the worker the multi-thread mode (checked at
/// every start; here through the query itself).
#[test]
fn the_pinned_ucx_gives_a_multi_thread_worker() {
    if !ucx_here() {
        return;
    }
    let ucp = Ucp::new(load::open().unwrap()).unwrap();
    assert_eq!(ucp.thread_mode().unwrap(), sys::UCS_THREAD_MODE_MULTI);
}

/// A request on GPU memory names the CUDA memory type and nothing
/// else (no callback: the caller waits for it).
#[test]
fn device_requests_name_the_cuda_memory_type() {
    let p = device_param();
    assert_eq!(p.op_attr_mask, sys::UCP_OP_ATTR_FIELD_MEMORY_TYPE);
    assert_eq!(p.memory_type, sys::UCS_MEMORY_TYPE_CUDA);
    assert!(p.user_data.is_null());
    // SAFETY: reading the union's variant a default block holds (none).
    assert!(unsafe { p.cb.send }.is_none());
}

#[test]
fn gin_ucx_device_turns_direct_gpu_memory_off_only_when_asked() {
    assert!(device_from_env(None));
    assert!(device_from_env(Some("1")));
    for off in ["0", "no", "off", "false"] {
        assert!(!device_from_env(Some(off)), "{off}");
    }
}

/// The pinned UCX takes the endpoint-based fence every context is made
/// with (unless `UCX_FENCE_MODE` says otherwise), and refuses a value it
/// does not know (the fallback to UCX's own default then applies).
#[test]
fn the_endpoint_based_fence_is_accepted_and_a_bad_value_is_refused() {
    if !ucx_here() {
        return;
    }
    let lib = load::open().unwrap();
    let ctx = Ucp::init(&lib, Some(worker::EP_BASED_FENCE)).unwrap();
    // SAFETY: made just above, with no worker.
    unsafe { lib.ucp_cleanup(ctx) };
    assert!(Ucp::init(&lib, Some((c"FENCE_MODE", c"sometimes"))).is_err());
}

/// GPU memory in these tests: nothing behind it (UCX cannot map it with
/// the CUDA memory type here); its thread-context hook records the
/// threads it ran on.
#[derive(Default)]
struct FakeGpu {
    entered: Arc<Mutex<Vec<String>>>,
}

impl crate::region::Backing for FakeGpu {
    fn write(&self, _: u64, _: &[u8]) -> Result<(), String> {
        Err("not reached in this test".into())
    }
    fn read(&self, _: u64, _: &mut [u8]) -> Result<(), String> {
        Err("not reached in this test".into())
    }
    fn thread_context(&self) -> Option<crate::region::ThreadContext> {
        let entered = self.entered.clone();
        Some(Arc::new(move || {
            let name = std::thread::current().name().unwrap_or("?").to_owned();
            lock(&entered).push(name);
        }))
    }
}

/// A GPU region is mapped when it is registered, on the registering
/// thread (a CUDA rank's, where its context is current), never on the
/// progress thread; the region's thread-context hook is then run on the
/// progress thread, which executes peers' emulated writes, and on no
/// other thread (a GPU backing's hook sets thread-wide state for good); a
/// peer asking
/// for its rkey gets the owner's refusal with UCX's status at once.
#[test]
fn gpu_regions_are_mapped_on_the_registering_thread_and_the_progress_thread_enters_their_context() {
    if !ucx_here() {
        return;
    }
    let timeout = Duration::from_secs(30);
    let out = two_ranks(timeout, move |b, table| {
        let t = start(b, &table, timeout);
        let gpu = FakeGpu::default();
        let entered = gpu.entered.clone();
        let base = 0x7e00_0000_0000_u64 + b.rank() as u64 * 0x1000_0000;
        let key = if b.rank() == 1 {
            table.insert_backed(base, 1 << 20, Arc::new(gpu)).unwrap()
        } else {
            0
        };
        let key = key_of(b, key, 1);
        let mut seen = None;
        if b.rank() == 0 {
            let began = Instant::now();
            let e = t
                .put(1, Target::Key { key, offset: 0 }, &[1; 8], None)
                .unwrap_err();
            seen = Some((began.elapsed(), e.to_string()));
        } else {
            let began = Instant::now();
            while lock(&entered).is_empty() {
                assert!(began.elapsed() < timeout, "the hook never ran");
                std::thread::yield_now();
            }
        }
        b.barrier().unwrap();
        let mapped = lock(&t.inner.test.mapped).clone();
        let me = std::thread::current().name().unwrap_or("?").to_owned();
        drop(t);
        let entered = lock(&entered).clone();
        (seen, mapped, me, base as usize, entered)
    });
    let (mapped, me, base, entered) = (&out[1].1, &out[1].2, out[1].3, &out[1].4);
    let on: Vec<&String> = mapped
        .iter()
        .filter(|(b, _)| *b == base)
        .map(|(_, t)| t)
        .collect();
    assert_eq!(on, [me], "mapped on {on:?}, registered on {me:?}");
    assert!(
        !entered.is_empty() && entered.iter().all(|t| t == "gin-ucx-1"),
        "entered on {entered:?}"
    );
    let (took, e) = out[0].0.as_ref().unwrap();
    assert!(*took < Duration::from_secs(5), "{took:?}: {e}");
    assert!(
        e.contains("GPU memory") && e.contains("ucp_mem_map failed"),
        "{e}"
    );
}

/// A GPU region registered before the transport started: its hook runs on
/// the progress thread from the transport's start, before any peer asks for
/// the region (a rank that only sends from such memory would otherwise run
/// UCX's CUDA calls there in the thread's default capture mode), and on no
/// other thread.
#[test]
fn a_gpu_region_registered_before_the_transport_started_has_its_context_entered_by_the_progress_thread()
 {
    if !ucx_here() {
        return;
    }
    let timeout = Duration::from_secs(30);
    let out = two_ranks(timeout, move |b, table| {
        let gpu = FakeGpu::default();
        let entered = gpu.entered.clone();
        let base = 0x7e80_0000_0000_u64 + b.rank() as u64 * 0x1000_0000;
        table.insert_backed(base, 1 << 20, Arc::new(gpu)).unwrap();
        let t = start(b, &table, timeout);
        let began = Instant::now();
        while lock(&entered).is_empty() {
            assert!(began.elapsed() < timeout, "the hook never ran");
            std::thread::yield_now();
        }
        b.barrier().unwrap();
        drop(t);
        let entered = lock(&entered).clone();
        (b.rank(), entered)
    });
    for (rank, entered) in out {
        let me = format!("gin-ucx-{rank}");
        assert!(
            !entered.is_empty() && entered.iter().all(|t| *t == me),
            "rank {rank}: entered on {entered:?}"
        );
    }
}

/// An owner whose UCX worker is held by a blocked call on another of its
/// threads (on a GPU: UCX's cuda_ipc closing a stale mapping of a peer's
/// freed memory inside `ucp_put_nbx`, which the CUDA driver holds until
/// the rank's running kernel ends) answers no rkey request and no ping.
/// The initiator's timeout says so, naming the owner and the key, instead
/// of only that it timed out.
#[test]
fn an_rkey_request_to_an_owner_held_by_a_blocked_ucx_call_times_out_saying_so() {
    if !ucx_here() {
        return;
    }
    let timeout = Duration::from_secs(3);
    let out = two_ranks(timeout, move |b, table| {
        let t = start(b, &table, timeout);
        let mut mem = vec![0u64; 512];
        let mine = register(&table, &mut mem);
        let keys = b.allgather(&mine.to_le_bytes()).unwrap();
        let key = |r: usize| u32::from_le_bytes(keys[r][..4].try_into().unwrap());
        let mut seen = None;
        if b.rank() == 1 {
            t.inner.test.block_issue.store(true, Ordering::Release);
            std::thread::scope(|s| {
                // Gets rank 0's rkey, then blocks in the issue call.
                let put = s.spawn(|| {
                    t.put(
                        0,
                        Target::Key {
                            key: key(0),
                            offset: 0,
                        },
                        &[1; 8],
                        None,
                    )
                });
                while !t.inner.test.blocked.load(Ordering::Acquire) {
                    assert!(!put.is_finished(), "the put did not block");
                    std::thread::yield_now();
                }
                b.barrier().unwrap();
                // Rank 0 asked and gave up.
                b.barrier().unwrap();
                t.inner.test.block_issue.store(false, Ordering::Release);
                put.join().unwrap().unwrap();
            });
        } else {
            b.barrier().unwrap();
            let e = t
                .put(
                    1,
                    Target::Key {
                        key: key(1),
                        offset: 0,
                    },
                    &[2; 8],
                    None,
                )
                .unwrap_err();
            seen = Some((key(1), e.to_string()));
            b.barrier().unwrap();
        }
        b.barrier().unwrap();
        drop(t);
        table.remove(mine);
        seen
    });
    let (key, e) = out[0].as_ref().unwrap();
    for part in [
        "rank 1",
        &format!("the rkey of key {key:#010x}"),
        "answered no ping either",
        "UCX worker made no progress",
    ] {
        assert!(e.contains(part), "{e:?} lacks {part:?}");
    }
}

/// While a thread is inside an issue call (which holds UCX's worker, a spin
/// lock, for the whole call: a put with a signal over shared memory copies
/// the put inside it), the progress thread does not progress the worker:
/// it stands back, yielding, and takes its turns again once the call
/// returned. (Before, it spun on the worker's lock, taking the core the
/// copy needed.)
#[test]
fn the_progress_thread_stands_back_while_another_thread_issues() {
    if !ucx_here() {
        return;
    }
    let timeout = Duration::from_secs(10);
    let out = two_ranks(timeout, move |b, table| {
        let t = start(b, &table, timeout);
        let mut mem = vec![0u64; 512];
        let mine = register(&table, &mut mem);
        let keys = b.allgather(&mine.to_le_bytes()).unwrap();
        let key0 = u32::from_le_bytes(keys[0][..4].try_into().unwrap());
        let put = |t: &UcxTransport| {
            t.put(
                0,
                Target::Key {
                    key: key0,
                    offset: 0,
                },
                &[1; 8],
                None,
            )
        };
        let mut verdict = None;
        if b.rank() == 1 {
            // The rkey first, so the blocked call is the issue itself.
            put(&t).unwrap();
            let hooks = &t.inner.test;
            let deadline = Instant::now() + timeout;
            // Waits until `done`, or says what never happened by the
            // deadline (never panicking while the call is held).
            let until = |done: &dyn Fn() -> bool, what: &'static str| {
                while !done() {
                    if Instant::now() > deadline {
                        return Err(what);
                    }
                    std::thread::yield_now();
                }
                Ok(())
            };
            let back = || hooks.stood_back.load(Ordering::Acquire);
            let turns = || hooks.turns.load(Ordering::Acquire);
            hooks.block_issue.store(true, Ordering::Release);
            std::thread::scope(|s| {
                let blocked = s.spawn(|| put(&t));
                let during = until(
                    &|| hooks.blocked.load(Ordering::Acquire),
                    "the put did not block",
                )
                .and_then(|()| {
                    // It stands back (a turn it began before the call
                    // may still end) ...
                    let first = back();
                    until(&|| back() > first, "the progress thread never stood back")
                })
                .and_then(|()| {
                    // ... then again and again, with no turn between.
                    let (t0, b0) = (turns(), back());
                    until(
                        &|| back() >= b0 + 3,
                        "the progress thread stopped standing back",
                    )
                    .map(|()| turns() - t0)
                });
                hooks.block_issue.store(false, Ordering::Release);
                blocked.join().unwrap().unwrap();
                // Its turns come back once the call returned.
                let after = turns();
                let back_again = until(&|| turns() > after, "no turn after the call");
                verdict = Some(during.and_then(|d| back_again.map(|()| d)));
            });
        }
        b.barrier().unwrap();
        t.confirm(1 - b.rank(), timeout).unwrap();
        b.barrier().unwrap();
        drop(t);
        table.remove(mine);
        verdict
    });
    assert_eq!(
        out[1],
        Some(Ok(0)),
        "turns at the worker while a call issued"
    );
}

/// A window part's memory in these tests: host memory behind a backing,
/// mapped as host memory (`backed_as_host`), so UCX serves it here.
struct HostGpu;

impl crate::region::Backing for HostGpu {
    fn write(&self, _: u64, _: &[u8]) -> Result<(), String> {
        Err("not reached in this test: UCX writes the memory".into())
    }
    fn read(&self, _: u64, _: &mut [u8]) -> Result<(), String> {
        Err("not reached in this test: UCX reads the memory".into())
    }
    fn thread_context(&self) -> Option<crate::region::ThreadContext> {
        Some(Arc::new(|| {}))
    }
}

/// CUDA ranks' windows as gin-cuda-selftest's ring uses them, on the CPU:
/// each round every rank registers two fresh parts behind a backing (send
/// and receive, as `LocalPart` does before the key exchange), the ranks
/// exchange keys, each puts the round's bytes and then an ordered 8-byte
/// total into the other's receive part (asking for its rkey first), and
/// both free their parts collectively (revoking the rkeys the peer holds).
/// Rounds of 8, 1000, 1024 B and 1 MiB, twice: every rkey request is
/// answered and every revocation acknowledged at once, round after round.
/// (The third round's failure on the GPU needs UCX's cuda_ipc cache: see
/// docs/ucx.md.)
#[test]
fn window_parts_registered_and_freed_in_rounds_are_served_every_round() {
    if !ucx_here() {
        return;
    }
    let timeout = Duration::from_secs(30);
    let out = two_ranks(timeout, move |b, table| {
        let t = start(b, &table, timeout);
        t.inner.test.backed_as_host.store(true, Ordering::Release);
        let (me, peer) = (b.rank(), 1 - b.rank());
        let mut took = Vec::new();
        for (round, size) in [8usize, 1000, 1024, 1 << 20, 8, 1000, 1024]
            .into_iter()
            .enumerate()
        {
            let began = Instant::now();
            let send = vec![u8::try_from(round * 2 + me).unwrap(); size];
            let recv = vec![0u8; size + 8].into_boxed_slice();
            let send_key = table
                .insert_backed(send.as_ptr() as u64, size as u64, Arc::new(HostGpu))
                .unwrap();
            let recv_key = table
                .insert_backed(recv.as_ptr() as u64, size as u64 + 8, Arc::new(HostGpu))
                .unwrap();
            let theirs = key_of(b, recv_key, peer);
            t.put(
                peer,
                Target::Key {
                    key: theirs,
                    offset: 0,
                },
                &send,
                None,
            )
            .unwrap();
            let total = (round as u64 + 1).to_le_bytes();
            t.put_ordered(
                peer,
                Target::Key {
                    key: theirs,
                    offset: size as u64,
                },
                &total,
            )
            .unwrap();
            t.fence(peer, timeout).unwrap();
            b.barrier().unwrap();
            let want = u8::try_from(round * 2 + peer).unwrap();
            assert!(recv[..size].iter().all(|&x| x == want), "round {round}");
            assert_eq!(recv[size..], total, "round {round}");
            b.barrier().unwrap();
            table.remove(send_key);
            table.remove(recv_key);
            took.push((size, began.elapsed()));
        }
        b.barrier().unwrap();
        drop(t);
        took
    });
    for (rank, rounds) in out.iter().enumerate() {
        for (size, took) in rounds {
            assert!(
                *took < Duration::from_secs(5),
                "rank {rank}: the {size} B round took {took:?}"
            );
        }
    }
}

/// An owner asked for a key it does not serve (never registered, or
/// removed in an earlier round) answers at once, and the initiator's
/// error names the key and that the owner serves no such key.
#[test]
fn an_owner_asked_for_a_key_it_does_not_serve_answers_at_once() {
    if !ucx_here() {
        return;
    }
    let timeout = Duration::from_secs(30);
    let out = two_ranks(timeout, move |b, table| {
        let t = start(b, &table, timeout);
        let mut mem = vec![0u64; 512];
        let removed = if b.rank() == 1 {
            let k = register(&table, &mut mem);
            table.remove(k);
            k
        } else {
            0
        };
        let removed = key_of(b, removed, 1);
        let mut seen = Vec::new();
        if b.rank() == 0 {
            for key in [removed, removed ^ 0x5a5a_0000] {
                let began = Instant::now();
                let e = t
                    .put(1, Target::Key { key, offset: 0 }, &[1; 8], None)
                    .unwrap_err();
                seen.push((key, began.elapsed(), e.to_string()));
            }
        }
        b.barrier().unwrap();
        drop(t);
        seen
    });
    assert_eq!(out[0].len(), 2);
    for (key, took, e) in &out[0] {
        assert!(*took < Duration::from_secs(5), "{took:?}: {e}");
        for part in [
            format!("unknown memory key {key:#010x}"),
            "rank 1 serves no such key".into(),
        ] {
            assert!(e.contains(&part), "{e:?} lacks {part:?}");
        }
    }
}

/// Two ranks as threads whose UCX contexts use `tls` (`UCX_TLS`; `None`:
/// the environment's).
fn two_ranks_over<T: Send + 'static>(
    tls: Option<&'static std::ffi::CStr>,
    f: impl Fn(&gin_bootstrap::Bootstrap, Arc<RegionTable>) -> T + Send + Sync + 'static,
) -> Vec<T> {
    two_ranks(Duration::ZERO, move |b, table| {
        worker::TEST_TLS.with(|t| t.set(tls));
        f(b, table)
    })
}

/// The byte at `i` of the lent source in these tests.
fn lent_byte(i: usize) -> u8 {
    (i.wrapping_mul(131) ^ (i >> 11)) as u8
}

/// Puts from lent memory (host memory standing in for GPU memory: the
/// code is `start_put_device`'s with another memory type) are many in
/// flight, more than the per-peer bound, and one confirmation completes
/// them: every byte arrives, and a running total put ordered after them
/// is never seen before the data it counts, whether it waits for them
/// (`GIN_UCX_GPU_ORDER=wait`) or relies on UCX's fence (`fence`). Over
/// UCX's tcp (where puts stay pending until the socket takes them) and the
/// default transports.
#[test]
fn many_lent_puts_in_flight_then_one_confirm_deliver_every_byte_with_the_signal_last() {
    const CHUNK: usize = 128 << 10;
    const N: usize = 96;
    if !ucx_here() {
        return;
    }
    for (tls, wait) in [
        (Some(c"tcp,self"), true),
        (Some(c"tcp,self"), false),
        (None, true),
        (None, false),
    ] {
        let timeout = Duration::from_secs(30);
        let out = two_ranks_over(tls, move |b, table| {
            let mut t = start(b, &table, timeout);
            t.wait_lent = wait;
            let mut recv = vec![0u64; N * CHUNK / 8 + 1];
            let key = if b.rank() == 1 {
                register(&table, &mut recv)
            } else {
                0
            };
            let key = key_of(b, key, 1);
            let total = 0x5151_0000_0000_0042_u64;
            let mut most = 0;
            if b.rank() == 0 {
                let src: Vec<u8> = (0..N * CHUNK).map(lent_byte).collect();
                // Every other put carries a keeper, as a window's would.
                let keeper = Arc::new(());
                let p = t.inner.peer(1).unwrap();
                for i in 0..N {
                    let at = Target::Key {
                        key,
                        offset: (i * CHUNK) as u64,
                    };
                    // SAFETY: `src` is host memory nobody writes, alive
                    // until after the confirmation below.
                    unsafe {
                        t.put_lent(
                            1,
                            at,
                            src[i * CHUNK..].as_ptr(),
                            CHUNK as u64,
                            sys::UCS_MEMORY_TYPE_HOST,
                            (i % 2 == 0).then(|| KeepAlive(keeper.clone())),
                        )
                    }
                    .unwrap();
                    most = most.max(p.lent.load(Ordering::Acquire));
                }
                let sig = Target::Key {
                    key,
                    offset: (N * CHUNK) as u64,
                };
                t.put_ordered(1, sig, &total.to_le_bytes()).unwrap();
                t.confirm(1, timeout).unwrap();
                assert_eq!(p.lent.load(Ordering::Acquire), 0);
                assert_eq!(p.bare.load(Ordering::Acquire), 0);
                // Every keeper was released once its put completed (the
                // progress thread may be dropping the last ones).
                let began = Instant::now();
                while Arc::strong_count(&keeper) > 1 {
                    assert!(began.elapsed() < timeout, "a keeper was never released");
                    std::thread::yield_now();
                }
                assert!(most <= LENT_MAX, "{most} in flight");
                drop(src);
            } else {
                let began = Instant::now();
                // SAFETY: the last word of `recv`, written by UCX; read
                // atomically (an aligned u64).
                let word = unsafe { &*recv.as_ptr().add(N * CHUNK / 8).cast::<AtomicU64>() };
                while word.load(Ordering::Acquire) != total {
                    assert!(began.elapsed() < timeout, "the signal never came");
                    std::thread::yield_now();
                }
                // The signal is visible: every byte before it must be.
                let base = recv.as_ptr().cast::<u8>();
                for i in 0..N * CHUNK {
                    // SAFETY: inside `recv`; nothing writes it any more.
                    let got = unsafe { std::ptr::read_volatile(base.add(i)) };
                    assert_eq!(got, lent_byte(i), "byte {i} after the signal ({tls:?})");
                }
            }
            b.barrier().unwrap();
            drop(t);
            most
        });
        println!(
            "{tls:?}, wait {wait}: at most {} puts from lent memory in flight",
            out[0]
        );
        if tls.is_some() {
            // Over tcp a put stays pending until the socket took it.
            assert!(out[0] > 1, "never more than one put in flight");
        }
    }
}

/// A peer that stops making progress (its worker held: a stopped or dead
/// rank) while many puts from lent memory are in flight to it: the
/// confirmation fails naming it, as soon as the job says it failed or at
/// the timeout, without hanging, and no request is left reading the lent
/// memory when it returns.
#[test]
fn a_peer_failing_mid_pipeline_fails_the_confirm_naming_it_without_hanging() {
    const CHUNK: usize = 1 << 20;
    const N: usize = 48;
    if !ucx_here() {
        return;
    }
    for job_says in [true, false] {
        let timeout = if job_says {
            Duration::from_secs(60)
        } else {
            Duration::from_secs(2)
        };
        let out = two_ranks_over(Some(c"tcp,self"), move |b, table| {
            let t = start(b, &table, timeout);
            let died = Arc::new(AtomicBool::new(false));
            let seen = died.clone();
            t.watch(Arc::new(move || {
                if seen.load(Ordering::Acquire) {
                    Err("rank 1 died (the test says so)".into())
                } else {
                    Ok(())
                }
            }));
            let blamed = Arc::new(Mutex::new(Vec::new()));
            let to = blamed.clone();
            t.blame_to(Arc::new(move |peer, _: &str| lock(&to).push(peer)));
            let mut recv = vec![0u64; N * CHUNK / 8];
            let key = if b.rank() == 1 {
                register(&table, &mut recv)
            } else {
                0
            };
            let key = key_of(b, key, 1);
            let mut seen = None;
            if b.rank() == 0 {
                // The rkey and the connection first.
                t.put(1, Target::Key { key, offset: 0 }, &[1; 8], None)
                    .unwrap();
                t.fence(1, timeout).unwrap();
            }
            b.barrier().unwrap();
            if b.rank() == 1 {
                t.inner.test.stopped.store(true, Ordering::Release);
            }
            b.barrier().unwrap();
            if b.rank() == 0 {
                // Kept alive by the requests (a window's `KeepAlive`): a
                // put UCX cannot cancel holds it rather than the wait.
                let src: Arc<Vec<u8>> = Arc::new(vec![7u8; N * CHUNK]);
                let p = t.inner.peer(1).unwrap();
                for i in 0..N {
                    let at = Target::Key {
                        key,
                        offset: (i * CHUNK) as u64,
                    };
                    // SAFETY: `src` is kept alive by every request, and
                    // nobody writes it.
                    unsafe {
                        t.put_lent(
                            1,
                            at,
                            src[i * CHUNK..].as_ptr(),
                            CHUNK as u64,
                            sys::UCS_MEMORY_TYPE_HOST,
                            Some(KeepAlive(src.clone())),
                        )
                    }
                    .unwrap();
                }
                let pending = p.lent.load(Ordering::Acquire);
                died.store(job_says, Ordering::Release);
                let began = Instant::now();
                let e = t.confirm(1, timeout).unwrap_err();
                let took = began.elapsed();
                assert_eq!(p.bare.load(Ordering::Acquire), 0, "{e}");
                // Later waits fail at once, naming the cause.
                let again = t.confirm(1, timeout).unwrap_err().to_string();
                assert!(again.contains("rank 1"), "{again}");
                seen = Some((pending, took, e.to_string(), lock(&blamed).clone()));
            }
            b.barrier().unwrap();
            t.inner.test.stopped.store(false, Ordering::Release);
            drop(t);
            seen
        });
        let (pending, took, e, blamed) = out[0].clone().unwrap();
        assert!(pending > 1, "only {pending} put(s) were in flight: {e}");
        assert!(e.contains("rank 1"), "{e}");
        if job_says {
            assert!(e.contains("rank 1 died"), "{e}");
            assert!(took < Duration::from_secs(10), "{took:?}: {e}");
            assert!(blamed.is_empty(), "{blamed:?}");
        } else {
            assert!(e.contains("timed out") || e.contains("waited"), "{e}");
            assert!(took < Duration::from_secs(10), "{took:?}: {e}");
            // Silent for the whole timeout: the job hears of it.
            assert_eq!(blamed, [1], "{e}");
        }
    }
}

proptest::proptest! {
    /// In-order completion against a model: whatever order numbered puts
    /// complete in, the answer is the longest run from 1 that completed,
    /// and it never goes back.
    #[test]
    fn completion_is_counted_in_order_whatever_order_puts_complete_in(
        keys in proptest::collection::vec(proptest::prelude::any::<u32>(), 1..200),
    ) {
        let mut order: Vec<u64> = (1..=keys.len() as u64).collect();
        order.sort_by_key(|&n| keys[n as usize - 1]);
        let mut prefix = Prefix::default();
        let mut done = std::collections::HashSet::new();
        let mut last = 0;
        for n in order {
            done.insert(n);
            let upto = prefix.complete(n);
            let mut model = 0;
            while done.contains(&(model + 1)) {
                model += 1;
            }
            proptest::prop_assert_eq!(upto, model);
            proptest::prop_assert!(upto >= last);
            last = upto;
        }
        proptest::prop_assert_eq!(last, keys.len() as u64);
        proptest::prop_assert!(prefix.early.is_empty());
    }
}

/// A failed put is named only once every put before it is complete, and
/// the lowest failed one is named whatever order failures come in: the
/// puts before it completed successfully.
#[test]
fn the_lowest_failed_put_is_named_once_those_before_it_are_complete() {
    let mut p = Prefix::default();
    p.fail(3);
    assert_eq!(p.complete(3), 0);
    assert_eq!(p.failure(), None, "puts 1 and 2 may still succeed");
    assert_eq!(p.complete(1), 1);
    assert_eq!(p.failure(), None);
    assert_eq!(p.complete(2), 3);
    assert_eq!(p.failure(), Some(3), "puts 1 and 2 succeeded");
    let mut p = Prefix::default();
    p.fail(4);
    assert_eq!(p.complete(4), 0);
    p.fail(2);
    assert_eq!(p.complete(2), 0);
    assert_eq!(p.complete(1), 2);
    assert_eq!(p.failure(), Some(2), "the lower failure, whatever order");
    assert_eq!(p.complete(3), 4);
    assert_eq!(p.failure(), Some(2));
}

/// Puts from lent memory are numbered in issue order, and
/// `device_puts_completed` reports, without waiting, how far they are
/// complete in that order: it only grows, never passes the newest, and
/// once it covers a put its memory is released (the put is no longer
/// counted in flight, its keeper dropped). A running total put after
/// the puts up to the middle one (`put_ordered_after`) waits, under
/// `GIN_UCX_GPU_ORDER=wait`, for those only, and is still executed at the
/// target after every put issued before it. Over UCX's tcp and the
/// default transports, in both orders.
#[test]
fn lent_puts_are_numbered_and_their_completion_is_polled_in_order() {
    const CHUNK: usize = 128 << 10;
    const N: usize = 80;
    if !ucx_here() {
        return;
    }
    for (tls, wait) in [
        (Some(c"tcp,self"), true),
        (Some(c"tcp,self"), false),
        (None, true),
        (None, false),
    ] {
        let timeout = Duration::from_secs(30);
        two_ranks_over(tls, move |b, table| {
            let mut t = start(b, &table, timeout);
            t.wait_lent = wait;
            assert_eq!(t.ordered_waits_for_device_puts(), t.device && wait);
            let mut recv = vec![0u64; N * CHUNK / 8 + 1];
            let key = if b.rank() == 1 {
                register(&table, &mut recv)
            } else {
                0
            };
            let key = key_of(b, key, 1);
            let total = 0x7171_0000_0000_0017_u64;
            if b.rank() == 0 {
                let src: Vec<u8> = (0..N * CHUNK).map(lent_byte).collect();
                let keeper = Arc::new(());
                let p = t.inner.peer(1).unwrap();
                let mut seqs = Vec::new();
                for i in 0..N {
                    let at = Target::Key {
                        key,
                        offset: (i * CHUNK) as u64,
                    };
                    // SAFETY: `src` is host memory nobody writes, alive
                    // until every put is complete (polled below).
                    let seq = unsafe {
                        t.put_lent(
                            1,
                            at,
                            src[i * CHUNK..].as_ptr(),
                            CHUNK as u64,
                            sys::UCS_MEMORY_TYPE_HOST,
                            Some(KeepAlive(keeper.clone())),
                        )
                    }
                    .unwrap();
                    seqs.push(seq);
                }
                assert_eq!(seqs, (1..=N as u64).collect::<Vec<_>>());
                let half = N as u64 / 2;
                let sig = Target::Key {
                    key,
                    offset: (N * CHUNK) as u64,
                };
                t.put_ordered_after(1, sig, &total.to_le_bytes(), half)
                    .unwrap();
                if wait {
                    // It waited for the puts up to `half`.
                    assert!(t.device_puts_completed(1).unwrap() >= half);
                }
                let began = Instant::now();
                let mut last = 0;
                loop {
                    let upto = t.device_puts_completed(1).unwrap();
                    assert!(upto >= last && upto <= N as u64, "{last} then {upto}");
                    last = upto;
                    if upto == N as u64 {
                        break;
                    }
                    assert!(began.elapsed() < timeout, "complete up to {upto} only");
                    std::thread::yield_now();
                }
                assert_eq!(p.lent.load(Ordering::Acquire), 0);
                // Every keeper was released once its put completed (the
                // progress thread may be dropping the last ones).
                while Arc::strong_count(&keeper) > 1 {
                    assert!(began.elapsed() < timeout, "a keeper was never released");
                    t.device_puts_completed(1).unwrap();
                    std::thread::yield_now();
                }
                t.confirm(1, timeout).unwrap();
                drop(src);
            } else {
                let began = Instant::now();
                // SAFETY: the last word of `recv`, written by UCX; read
                // atomically (an aligned u64).
                let word = unsafe { &*recv.as_ptr().add(N * CHUNK / 8).cast::<AtomicU64>() };
                while word.load(Ordering::Acquire) != total {
                    assert!(began.elapsed() < timeout, "the signal never came");
                    std::thread::yield_now();
                }
                // Ordered after every put issued before it: all of them.
                let base = recv.as_ptr().cast::<u8>();
                for i in 0..N * CHUNK {
                    // SAFETY: inside `recv`; nothing writes it any more.
                    let got = unsafe { std::ptr::read_volatile(base.add(i)) };
                    assert_eq!(got, lent_byte(i), "byte {i} after the signal ({tls:?})");
                }
            }
            b.barrier().unwrap();
            drop(t);
        });
    }
}

/// A peer that stops making progress while puts from lent memory are in
/// flight to it: polling their completion never blocks, and fails naming
/// the peer, as soon as the job says it failed or once nothing completed
/// for the job's whole timeout (then blaming it); the wait that follows
/// still returns with the puts finished or given up on, as the confirm
/// after a failed pipeline does.
#[test]
fn polling_lent_puts_to_a_stopped_peer_fails_naming_it_without_blocking() {
    const CHUNK: usize = 1 << 20;
    const N: usize = 48;
    if !ucx_here() {
        return;
    }
    for job_says in [true, false] {
        let timeout = if job_says {
            Duration::from_secs(60)
        } else {
            Duration::from_secs(2)
        };
        let out = two_ranks_over(Some(c"tcp,self"), move |b, table| {
            let t = start(b, &table, timeout);
            let died = Arc::new(AtomicBool::new(false));
            let seen = died.clone();
            t.watch(Arc::new(move || {
                if seen.load(Ordering::Acquire) {
                    Err("rank 1 died (the test says so)".into())
                } else {
                    Ok(())
                }
            }));
            let blamed = Arc::new(Mutex::new(Vec::new()));
            let to = blamed.clone();
            t.blame_to(Arc::new(move |peer, _: &str| lock(&to).push(peer)));
            let mut recv = vec![0u64; N * CHUNK / 8];
            let key = if b.rank() == 1 {
                register(&table, &mut recv)
            } else {
                0
            };
            let key = key_of(b, key, 1);
            let mut seen = None;
            if b.rank() == 0 {
                t.put(1, Target::Key { key, offset: 0 }, &[1; 8], None)
                    .unwrap();
                t.fence(1, timeout).unwrap();
            }
            b.barrier().unwrap();
            if b.rank() == 1 {
                t.inner.test.stopped.store(true, Ordering::Release);
            }
            b.barrier().unwrap();
            if b.rank() == 0 {
                let src: Arc<Vec<u8>> = Arc::new(vec![7u8; N * CHUNK]);
                for i in 0..N {
                    let at = Target::Key {
                        key,
                        offset: (i * CHUNK) as u64,
                    };
                    // SAFETY: `src` is kept alive by every request, and
                    // nobody writes it.
                    unsafe {
                        t.put_lent(
                            1,
                            at,
                            src[i * CHUNK..].as_ptr(),
                            CHUNK as u64,
                            sys::UCS_MEMORY_TYPE_HOST,
                            Some(KeepAlive(src.clone())),
                        )
                    }
                    .unwrap();
                }
                let first = t.device_puts_completed(1).unwrap();
                died.store(job_says, Ordering::Release);
                let began = Instant::now();
                let mut longest = Duration::ZERO;
                let e = loop {
                    let call = Instant::now();
                    let r = t.device_puts_completed(1);
                    longest = longest.max(call.elapsed());
                    match r {
                        Ok(upto) => assert!(upto < N as u64, "all complete at a stopped peer"),
                        Err(e) => break e,
                    }
                    assert!(began.elapsed() < Duration::from_secs(20), "never failed");
                    std::thread::yield_now();
                };
                let took = began.elapsed();
                // The puts not finished are still waited for (or given
                // up on, holding their keeper): the wait returns.
                let after = t.complete_device(1, timeout).unwrap_err().to_string();
                let p = t.inner.peer(1).unwrap();
                assert_eq!(p.bare.load(Ordering::Acquire), 0, "{e}");
                seen = Some((
                    first,
                    took,
                    longest,
                    e.to_string(),
                    after,
                    lock(&blamed).clone(),
                ));
            }
            b.barrier().unwrap();
            t.inner.test.stopped.store(false, Ordering::Release);
            drop(t);
            seen
        });
        let (first, took, longest, e, after, blamed) = out[0].clone().unwrap();
        assert!(first < N as u64, "{first} complete at once: {e}");
        assert!(e.contains("rank 1"), "{e}");
        assert!(after.contains("rank 1"), "{after}");
        // No poll waited: each returned long before the timeout.
        assert!(
            longest < Duration::from_millis(500),
            "a poll took {longest:?}: {e}"
        );
        if job_says {
            assert!(e.contains("rank 1 died"), "{e}");
            assert!(took < Duration::from_secs(10), "{took:?}: {e}");
            assert!(blamed.is_empty(), "{blamed:?}");
        } else {
            assert!(e.contains("timed out") || e.contains("waited"), "{e}");
            assert!(took < Duration::from_secs(10), "{took:?}: {e}");
            assert_eq!(blamed, [1], "{e}");
        }
    }
}

#[test]
fn gin_ucx_gpu_order_is_wait_or_fence() {
    assert!(wait_lent_from_env(None).unwrap());
    assert!(wait_lent_from_env(Some("wait")).unwrap());
    assert!(!wait_lent_from_env(Some("fence")).unwrap());
    let e = wait_lent_from_env(Some("maybe")).unwrap_err().to_string();
    assert!(
        e.contains("GIN_UCX_GPU_ORDER") && e.contains("maybe"),
        "{e}"
    );
}

#[test]
fn gin_ucx_am_max_is_a_size_or_an_error_naming_it() {
    // Unset (or empty): each peer gets its transport's default.
    assert_eq!(am::am_max_setting(None).unwrap(), None);
    assert_eq!(am::am_max_setting(Some(" ")).unwrap(), None);
    assert_eq!(am::am_max_setting(Some("0")).unwrap(), Some(0));
    assert_eq!(am::am_max_setting(Some(" 256 ")).unwrap(), Some(256));
    let e = am::am_max_setting(Some("4k")).unwrap_err().to_string();
    assert!(e.contains("GIN_UCX_AM_MAX") && e.contains("4k"), "{e}");
}

/// The 8-byte word at `i` of `mem`, read atomically.
fn word(mem: &[u64], i: usize) -> u64 {
    // SAFETY: inside `mem`, aligned; written by peers through the region
    // table or UCX, read atomically here.
    unsafe { &*mem.as_ptr().add(i).cast::<AtomicU64>() }.load(Ordering::Acquire)
}

/// Many small puts with a signal each go as one active message each (none
/// by RMA), and execute in issue order with each signal after its data:
/// whenever the target sees the count reach `c`, the payload of put `c`
/// is there (or a later one's in the same slot), and after the confirm
/// every byte is the last put's. Over UCX's tcp and the default
/// transports (shared memory).
#[test]
fn many_put_messages_deliver_their_bytes_with_each_signal_after_its_data() {
    const N: u64 = 3000;
    const SLOTS: u64 = 16;
    const WORDS: usize = 32; // 256 bytes a put
    if !ucx_here() {
        return;
    }
    for tls in [Some(c"tcp,self"), None] {
        let timeout = Duration::from_secs(30);
        two_ranks_over(tls, move |b, table| {
            let mut t = start(b, &table, timeout);
            t.am_max.fill(4096);
            let mut recv = vec![0u64; SLOTS as usize * WORDS + 1];
            let key = if b.rank() == 1 {
                register(&table, &mut recv)
            } else {
                0
            };
            let key = key_of(b, key, 1);
            let count_at = SLOTS * WORDS as u64 * 8;
            if b.rank() == 0 {
                for i in 1..=N {
                    let payload: Vec<u8> = (0..WORDS as u64)
                        .flat_map(|w| (i << 8 | w).to_le_bytes())
                        .collect();
                    let at = Target::Key {
                        key,
                        offset: (i % SLOTS) * WORDS as u64 * 8,
                    };
                    let sig = Target::Key {
                        key,
                        offset: count_at,
                    };
                    t.put(1, at, &payload, Some((sig, 1))).unwrap();
                }
                t.confirm(1, timeout).unwrap();
                let p = t.inner.peer(1).unwrap();
                assert_eq!(p.am_sent.load(Ordering::Acquire), N);
                assert_eq!(p.rma_issued.load(Ordering::Acquire), 0);
            } else {
                let began = Instant::now();
                let mut seen = 0;
                while seen < N {
                    let c = word(&recv, SLOTS as usize * WORDS);
                    assert!(began.elapsed() < timeout, "the signal stopped at {c}");
                    if c == seen {
                        std::thread::yield_now();
                        continue;
                    }
                    seen = c;
                    // Put `c`'s data, or a later put's to the same slot.
                    let slot = (c % SLOTS) as usize * WORDS;
                    for w in 0..WORDS {
                        let v = word(&recv, slot + w);
                        assert!(
                            v >> 8 >= c && (v >> 8) % SLOTS == c % SLOTS && v & 0xff == w as u64,
                            "signal {c} seen before its data: word {w} of its slot is {v:#x} ({tls:?})"
                        );
                    }
                }
            }
            b.barrier().unwrap();
            if b.rank() == 1 {
                for s in 0..SLOTS {
                    // The last put to slot `s`.
                    let last = N - (N + SLOTS - s) % SLOTS;
                    for w in 0..WORDS {
                        let v = word(&recv, s as usize * WORDS + w);
                        assert_eq!(v, last << 8 | w as u64, "slot {s} word {w} ({tls:?})");
                    }
                }
            }
            b.barrier().unwrap();
            drop(t);
        });
    }
}

/// With no `GIN_UCX_AM_MAX`, a peer reached over UCX's tcp alone gets
/// 64 KiB put messages (the context's tcp segments make them one zero-copy
/// message), any other (the default transports here: shared memory) 16 KiB;
/// a 64 KiB put with a signal then goes as one message over tcp and by RMA
/// otherwise, and either way each signal is seen only after its data.
#[test]
fn a_64_kib_put_goes_as_one_message_over_tcp_alone_with_its_signal_after_its_data() {
    const N: u64 = 200;
    const SLOTS: u64 = 2;
    const WORDS: usize = 8192; // 64 KiB a put
    if !ucx_here() {
        return;
    }
    for tls in [Some(c"tcp,self"), None] {
        let timeout = Duration::from_secs(30);
        two_ranks_over(tls, move |b, table| {
            let t = start(b, &table, timeout);
            let tcp = tls == Some(c"tcp,self");
            let want = if tcp && t.inner.ucp.tcp_segments {
                am::AM_MAX_TCP
            } else {
                am::AM_MAX
            };
            let peer = 1 - b.rank();
            assert_eq!(t.am_max[peer], want, "{tls:?}");
            if tcp {
                // The pinned UCX takes the settings when the environment
                // has none of its own.
                let own = am::TCP_SEGMENTS
                    .iter()
                    .any(|(n, _)| std::env::var_os(format!("UCX_{n}")).is_some());
                assert_eq!(t.inner.ucp.tcp_segments, !own);
            }
            let mut recv = vec![0u64; SLOTS as usize * WORDS + 1];
            let key = if b.rank() == 1 {
                register(&table, &mut recv)
            } else {
                0
            };
            let key = key_of(b, key, 1);
            let count_at = SLOTS * WORDS as u64 * 8;
            if b.rank() == 0 {
                for i in 1..=N {
                    let payload: Vec<u8> = (0..WORDS as u64)
                        .flat_map(|w| (i << 16 | w).to_le_bytes())
                        .collect();
                    let at = Target::Key {
                        key,
                        offset: (i % SLOTS) * WORDS as u64 * 8,
                    };
                    let sig = Target::Key {
                        key,
                        offset: count_at,
                    };
                    t.put(1, at, &payload, Some((sig, 1))).unwrap();
                }
                t.confirm(1, timeout).unwrap();
                let p = t.inner.peer(1).unwrap();
                let (messages, rma) = if want >= WORDS * 8 { (N, 0) } else { (0, N) };
                assert_eq!(p.am_sent.load(Ordering::Acquire), messages, "{tls:?}");
                assert_eq!(p.rma_issued.load(Ordering::Acquire), rma, "{tls:?}");
            } else {
                let began = Instant::now();
                let mut seen = 0;
                while seen < N {
                    let c = word(&recv, SLOTS as usize * WORDS);
                    assert!(began.elapsed() < timeout, "the signal stopped at {c}");
                    if c == seen {
                        std::thread::yield_now();
                        continue;
                    }
                    seen = c;
                    let slot = (c % SLOTS) as usize * WORDS;
                    for w in 0..WORDS {
                        let v = word(&recv, slot + w);
                        assert!(
                            v >> 16 >= c
                                && (v >> 16) % SLOTS == c % SLOTS
                                && v & 0xffff == w as u64,
                            "signal {c} seen before its data: word {w} of its slot is {v:#x} ({tls:?})"
                        );
                    }
                }
                for s in 0..SLOTS {
                    let last = N - (N + SLOTS - s) % SLOTS;
                    for w in 0..WORDS {
                        let v = word(&recv, s as usize * WORDS + w);
                        assert_eq!(v, last << 16 | w as u64, "slot {s} word {w} ({tls:?})");
                    }
                }
            }
            b.barrier().unwrap();
            drop(t);
        });
    }
}

/// A put message the target refuses (its range exceeds the region: the
/// target's own check, the initiator's bypassed) is never applied, nor is
/// its signal, nor anything after it (the stream is in its error state,
/// as an RDMA QP); the next confirm fails as a refusal naming the target,
/// the key and the offset, and so does every later request to that peer.
#[test]
fn a_refused_put_message_fails_the_confirm_by_name_without_applying_the_signal() {
    if !ucx_here() {
        return;
    }
    for tls in [Some(c"tcp,self"), None] {
        let timeout = Duration::from_secs(30);
        let out = two_ranks_over(tls, move |b, table| {
            let t = start(b, &table, timeout);
            let mut recv = vec![0u64; 512];
            let key = if b.rank() == 1 {
                register(&table, &mut recv)
            } else {
                0
            };
            let key = key_of(b, key, 1);
            let mut got = None;
            if b.rank() == 0 {
                let p = t.inner.peer(1).unwrap();
                // A good one first: it lands.
                t.put(
                    1,
                    Target::Key { key, offset: 0 },
                    &[9; 8],
                    Some((Target::Key { key, offset: 8 }, 1)),
                )
                .unwrap();
                t.confirm(1, timeout).unwrap();
                p.dirty.store(true, Ordering::Release);
                t.with_ep(p, "test", |ep, _| {
                    // 16 bytes at offset 4088 of a 4096-byte region.
                    t.am_issue(p, ep, key, 4088, Some((key, 16, 1)), &[7; 16])?;
                    // A good one after it: refused too.
                    t.am_issue(p, ep, key, 24, Some((key, 16, 1)), &[7; 8])
                })
                .unwrap();
                // An atomic message behind them is refused, not applied.
                let atomic = t
                    .atomic(
                        1,
                        Target::Key { key, offset: 16 },
                        AtomicOp::FetchAdd(1),
                        timeout,
                    )
                    .unwrap_err();
                assert!(
                    matches!(atomic, NetError::Refused { peer: 1, .. }),
                    "{atomic}"
                );
                let e = t.confirm(1, timeout).unwrap_err();
                let again = t.health(1).unwrap_err();
                let later = t
                    .put(1, Target::Key { key, offset: 0 }, &vec![1; 64 << 10], None)
                    .unwrap_err();
                got = Some((e, again, later));
            }
            b.barrier().unwrap();
            if b.rank() == 1 {
                assert_eq!(word(&recv, 0), u64::from_le_bytes([9; 8]));
                assert_eq!(word(&recv, 1), 1, "the good signal");
                assert_eq!(word(&recv, 2), 0, "a refused put's signal was applied");
                assert_eq!(word(&recv, 3), 0, "a put after a refusal was applied");
                assert_eq!(word(&recv, 511), 0, "refused data was applied");
            }
            b.barrier().unwrap();
            drop(t);
            got.map(|g| (g, key))
        });
        let ((e, again, later), key) = out.into_iter().next().flatten().unwrap();
        let text = e.to_string();
        assert!(matches!(e, NetError::Refused { peer: 1, .. }), "{text}");
        assert!(
            text.contains("rank 1")
                && text.contains("offset 4088")
                && text.contains(&format!("{key:#010x}")),
            "{text}"
        );
        assert!(
            matches!(again, NetError::Refused { peer: 1, .. }),
            "{again}"
        );
        assert!(
            matches!(later, NetError::Refused { peer: 1, .. }),
            "{later}"
        );
    }
}

/// Puts to one peer that alternate between active messages (small) and
/// RMA (large) execute in issue order: a small put, a large one over the
/// same bytes, a small one with a signal, some rounds fenced between
/// (so the next small put goes as a message again). The target sees the
/// first word only grow, and when the signal says round `r` is done, the
/// word is at least that round's last value; the last write wins.
#[test]
fn a_mix_of_put_messages_and_rma_puts_to_one_peer_keeps_issue_order() {
    const ROUNDS: u64 = 400;
    const BIG: usize = 8 << 10;
    if !ucx_here() {
        return;
    }
    for tls in [Some(c"tcp,self"), None] {
        let timeout = Duration::from_secs(30);
        two_ranks_over(tls, move |b, table| {
            let mut t = start(b, &table, timeout);
            t.am_max.fill(64);
            let mut recv = vec![0u64; BIG / 8 + 1];
            let key = if b.rank() == 1 {
                register(&table, &mut recv)
            } else {
                0
            };
            let key = key_of(b, key, 1);
            let at = Target::Key { key, offset: 0 };
            let sig = Target::Key {
                key,
                offset: BIG as u64,
            };
            if b.rank() == 0 {
                let mut big = vec![0u8; BIG];
                for r in 0..ROUNDS {
                    t.put(1, at, &(3 * r + 1).to_le_bytes(), None).unwrap();
                    big[..8].copy_from_slice(&(3 * r + 2).to_le_bytes());
                    t.put(1, at, &big, None).unwrap();
                    if r % 2 == 0 {
                        t.fence(1, timeout).unwrap();
                    }
                    t.put(1, at, &(3 * r + 3).to_le_bytes(), Some((sig, 1)))
                        .unwrap();
                }
                t.confirm(1, timeout).unwrap();
                let p = t.inner.peer(1).unwrap();
                let am = p.am_sent.load(Ordering::Acquire);
                let rma = p.rma_issued.load(Ordering::Acquire);
                assert!(
                    am >= ROUNDS && rma >= ROUNDS,
                    "{am} messages, {rma} RMA puts"
                );
            } else {
                let began = Instant::now();
                let mut last = 0;
                loop {
                    let done = word(&recv, BIG / 8);
                    let v = word(&recv, 0);
                    assert!(v >= last, "word 0 went back from {last} to {v} ({tls:?})");
                    last = v;
                    assert!(
                        v >= 3 * done,
                        "round {done} signalled but word 0 is {v} ({tls:?})"
                    );
                    if done == ROUNDS {
                        break;
                    }
                    assert!(began.elapsed() < timeout, "the signal stopped at {done}");
                    std::thread::yield_now();
                }
            }
            b.barrier().unwrap();
            if b.rank() == 1 {
                assert_eq!(word(&recv, 0), 3 * ROUNDS);
            }
            b.barrier().unwrap();
            drop(t);
        });
    }
}

/// An atomic right after put messages (a soft NIC's signal after its
/// write) goes as a message in their sequence and sees their data: a
/// fetch-add on the word a put message just wrote returns that put's
/// value, a compare-swap too; nothing went by RMA.
#[test]
fn an_atomic_after_put_messages_executes_after_them() {
    const N: u64 = 500;
    if !ucx_here() {
        return;
    }
    for tls in [Some(c"tcp,self"), None] {
        let timeout = Duration::from_secs(30);
        two_ranks_over(tls, move |b, table| {
            let t = start(b, &table, timeout);
            let mut recv = vec![0u64; 16];
            let key = if b.rank() == 1 {
                register(&table, &mut recv)
            } else {
                0
            };
            let key = key_of(b, key, 1);
            if b.rank() == 0 {
                let w = Target::Key { key, offset: 8 };
                for i in 1..=N {
                    t.put(1, w, &(i << 20).to_le_bytes(), None).unwrap();
                    let old = t.atomic(1, w, AtomicOp::FetchAdd(1), timeout).unwrap();
                    assert_eq!(old, i << 20, "{tls:?}");
                    t.put(1, w, &(i << 21).to_le_bytes(), None).unwrap();
                    let old = t
                        .atomic(
                            1,
                            w,
                            AtomicOp::CompareSwap {
                                expected: i << 21,
                                desired: 7,
                            },
                            timeout,
                        )
                        .unwrap();
                    assert_eq!(old, i << 21, "{tls:?}");
                }
                t.confirm(1, timeout).unwrap();
                let p = t.inner.peer(1).unwrap();
                assert_eq!(p.am_sent.load(Ordering::Acquire), 4 * N);
                assert_eq!(p.rma_issued.load(Ordering::Acquire), 0);
            }
            b.barrier().unwrap();
            if b.rank() == 1 {
                assert_eq!(word(&recv, 1), 7);
            }
            b.barrier().unwrap();
            drop(t);
        });
    }
}

/// Host puts larger than the largest put message are lent, not copied
/// ([`Transport::start_put`]): each returns its number among the puts from
/// lent memory (smaller ones are copied and complete on return: 0), with
/// its signal ordered after its data by UCX's fence alone (no wait for the
/// put: host memory's puts are not GPU memory's), so whenever the target
/// sees the count reach `c`, put `c`'s bytes are there. One confirmation
/// completes them all and lets every keeper go. Over UCX's tcp and the
/// default transports (shared memory).
#[test]
fn large_host_puts_are_lent_with_each_signal_after_its_data() {
    const N: u64 = 48;
    const SLOTS: u64 = 8;
    const WORDS: usize = 16 << 10; // 128 KiB a put
    const SMALL: usize = 128; // 1 KiB: copied
    if !ucx_here() {
        return;
    }
    for tls in [Some(c"tcp,self"), None] {
        let timeout = Duration::from_secs(30);
        two_ranks_over(tls, move |b, table| {
            let t = start(b, &table, timeout);
            let mut recv = vec![0u64; SLOTS as usize * WORDS + 1];
            let key = if b.rank() == 1 {
                register(&table, &mut recv)
            } else {
                0
            };
            let key = key_of(b, key, 1);
            let count_at = SLOTS * WORDS as u64 * 8;
            if b.rank() == 0 {
                assert!(t.lends_puts(1, (WORDS * 8) as u64));
                assert!(!t.lends_puts(1, (SMALL * 8) as u64));
                // Put `i`'s payload at words (i - 1) * WORDS..: each source
                // is written once, before its put, and never again.
                let src: Arc<Vec<u64>> = Arc::new(
                    (1..=N)
                        .flat_map(|i| (0..WORDS as u64).map(move |w| i << 20 | w))
                        .collect(),
                );
                let sig = Target::Key {
                    key,
                    offset: count_at,
                };
                let mut lent = 0;
                for i in 1..=N {
                    let at = Target::Key {
                        key,
                        offset: (i % SLOTS) * WORDS as u64 * 8,
                    };
                    let small = i.is_multiple_of(8);
                    let len = if small { SMALL } else { WORDS } * 8;
                    let from = src[(i as usize - 1) * WORDS..].as_ptr().cast::<u8>();
                    // SAFETY: `src` is host memory nobody writes, kept alive
                    // by the keeper each put holds.
                    let seq = unsafe {
                        t.start_put(
                            1,
                            at,
                            from,
                            len as u64,
                            Some((sig, 1)),
                            Some(KeepAlive(src.clone())),
                        )
                    }
                    .unwrap();
                    if small {
                        assert_eq!(seq, 0, "a small put was lent");
                    } else {
                        lent += 1;
                        assert_eq!(seq, lent, "put {i} was not lent in order");
                    }
                }
                t.confirm(1, timeout).unwrap();
                let p = t.inner.peer(1).unwrap();
                assert_eq!(p.lent.load(Ordering::Acquire), 0);
                assert_eq!(p.lent_seq.load(Ordering::Acquire), lent);
                assert_eq!(p.lent_device_seq.load(Ordering::Acquire), 0);
                assert_eq!(t.lent_puts_completed(1).unwrap(), lent);
                let began = Instant::now();
                while Arc::strong_count(&src) > 1 {
                    assert!(began.elapsed() < timeout, "a keeper was never released");
                    std::thread::yield_now();
                }
            } else {
                let began = Instant::now();
                let mut seen = 0;
                while seen < N {
                    let c = word(&recv, SLOTS as usize * WORDS);
                    assert!(began.elapsed() < timeout, "the signal stopped at {c}");
                    if c == seen {
                        std::thread::yield_now();
                        continue;
                    }
                    seen = c;
                    // Put `c`'s data, or a later put's to the same slot.
                    let slot = (c % SLOTS) as usize * WORDS;
                    let words = if c.is_multiple_of(8) { SMALL } else { WORDS };
                    for w in (0..words).step_by(61) {
                        let v = word(&recv, slot + w);
                        assert!(
                            v >> 20 >= c
                                && (v >> 20) % SLOTS == c % SLOTS
                                && v & 0xf_ffff == w as u64,
                            "signal {c} seen before its data: word {w} of its slot is {v:#x} ({tls:?})"
                        );
                    }
                }
            }
            b.barrier().unwrap();
            drop(t);
        });
    }
}

/// A confirmation waits for the puts from lent memory started before it,
/// not for those another thread keeps starting meanwhile (a proxy thread
/// streaming a window's puts while the rank thread confirms): each of
/// several confirmations returns, well within its timeout, with every put
/// numbered before it complete, while a second thread lends puts without
/// pause. Over UCX's tcp, where puts stay pending until the socket took
/// them.
#[test]
fn a_confirm_returns_while_another_thread_keeps_lending_puts() {
    const CHUNK: usize = 128 << 10;
    const SLOTS: usize = 4;
    if !ucx_here() {
        return;
    }
    let timeout = Duration::from_secs(20);
    two_ranks_over(Some(c"tcp,self"), move |b, table| {
        let t = start(b, &table, timeout);
        let mut recv = vec![0u64; SLOTS * CHUNK / 8];
        let key = if b.rank() == 1 {
            register(&table, &mut recv)
        } else {
            0
        };
        let key = key_of(b, key, 1);
        if b.rank() == 0 {
            let src: Arc<Vec<u8>> = Arc::new((0..CHUNK).map(lent_byte).collect());
            let p = t.inner.peer(1).unwrap();
            let stop = AtomicBool::new(false);
            std::thread::scope(|s| {
                let lender = s.spawn(|| {
                    let mut i = 0;
                    while !stop.load(Ordering::Acquire) {
                        let at = Target::Key {
                            key,
                            offset: ((i % SLOTS) * CHUNK) as u64,
                        };
                        // SAFETY: `src` is host memory nobody writes, kept
                        // alive by the keeper each put holds.
                        let seq = unsafe {
                            t.start_put(
                                1,
                                at,
                                src.as_ptr(),
                                CHUNK as u64,
                                None,
                                Some(KeepAlive(src.clone())),
                            )
                        }
                        .unwrap();
                        assert!(seq > 0, "a 128 KiB put was not lent");
                        i += 1;
                    }
                    i
                });
                let began = Instant::now();
                while p.lent_seq.load(Ordering::Acquire) < 4 {
                    assert!(began.elapsed() < timeout, "the lender never started");
                    std::thread::yield_now();
                }
                for round in 0..3 {
                    let before = p.lent_seq.load(Ordering::Acquire);
                    let began = Instant::now();
                    t.confirm(1, timeout)
                        .unwrap_or_else(|e| panic!("confirmation {round} failed: {e}"));
                    assert!(
                        began.elapsed() < timeout,
                        "confirmation {round} held to its deadline"
                    );
                    let done = t.lent_puts_completed(1).unwrap();
                    assert!(
                        done >= before,
                        "confirmation {round} returned with put {before} started before it incomplete ({done})"
                    );
                }
                assert!(!lender.is_finished(), "the lender stopped by itself");
                stop.store(true, Ordering::Release);
                let n = lender.join().unwrap();
                assert!(n >= 4, "{n}");
            });
            t.confirm(1, timeout).unwrap();
            assert_eq!(p.lent.load(Ordering::Acquire), 0);
        }
        b.barrier().unwrap();
        drop(t);
    });
}

/// A confirmation covers every put from lent memory numbered before it,
/// also one numbered but not yet passed to `ucp_put_nbx` (its thread held
/// between the two, holding the peer's lock): the confirmation, begun
/// then, waits in `settle` for it, and returns only once it completed,
/// with its bytes at the target.
#[test]
fn a_confirm_covers_a_put_numbered_but_not_yet_issued() {
    const LEN: usize = 128 << 10;
    if !ucx_here() {
        return;
    }
    let timeout = Duration::from_secs(20);
    two_ranks_over(Some(c"tcp,self"), move |b, table| {
        let t = start(b, &table, timeout);
        let mut recv = vec![0u64; LEN / 8];
        let key = if b.rank() == 1 {
            register(&table, &mut recv)
        } else {
            0
        };
        let key = key_of(b, key, 1);
        if b.rank() == 0 {
            let src: Arc<Vec<u8>> = Arc::new((0..LEN).map(lent_byte).collect());
            let p = t.inner.peer(1).unwrap();
            let hooks = &t.inner.test;
            hooks.block_numbered.store(true, Ordering::Release);
            std::thread::scope(|s| {
                let put = s.spawn(|| {
                    let at = Target::Key { key, offset: 0 };
                    // SAFETY: `src` is host memory nobody writes, kept alive
                    // by the keeper the put holds.
                    unsafe {
                        t.start_put(
                            1,
                            at,
                            src.as_ptr(),
                            LEN as u64,
                            None,
                            Some(KeepAlive(src.clone())),
                        )
                    }
                });
                let began = Instant::now();
                while !hooks.numbered_blocked.load(Ordering::Acquire) {
                    assert!(began.elapsed() < timeout, "the put never got numbered");
                    std::thread::yield_now();
                }
                assert_eq!(p.lent_seq.load(Ordering::Acquire), 1);
                let settling = hooks.settling.load(Ordering::Acquire);
                let confirm = s.spawn(|| {
                    let r = t.confirm(1, timeout);
                    (r, t.lent_puts_completed(1))
                });
                while hooks.settling.load(Ordering::Acquire) == settling {
                    assert!(began.elapsed() < timeout, "the confirmation never waited");
                    std::thread::yield_now();
                }
                // The confirmation waits for the put, not yet issued.
                assert_eq!(p.lent_upto.load(Ordering::Acquire), 0);
                assert!(!confirm.is_finished());
                hooks.block_numbered.store(false, Ordering::Release);
                assert_eq!(put.join().unwrap().unwrap(), 1);
                let (r, done) = confirm.join().unwrap();
                r.unwrap();
                assert_eq!(done.unwrap(), 1, "the confirmation returned before the put");
            });
        }
        b.barrier().unwrap();
        if b.rank() == 1 {
            let base = recv.as_ptr().cast::<u8>();
            for i in 0..LEN {
                // SAFETY: inside `recv`; rank 0's confirmed put wrote it
                // before the barrier, and nothing writes it any more.
                let got = unsafe { std::ptr::read_volatile(base.add(i)) };
                assert_eq!(got, lent_byte(i), "byte {i} after the confirmation");
            }
        }
        b.barrier().unwrap();
        drop(t);
    });
}

/// Over UCX's shared memory a window part in memory ucx allocated
/// (`Transport::alloc_host`) takes a peer's atomics as the peer's own CPU
/// atomics: they complete while the owner's worker makes no progress (a
/// thread of the owner held inside an issue call, so its progress thread
/// stands back). Into memory gin-rs allocated they are emulated by the
/// owner's progress thread and would time out here (docs/ucx.md, "Signal
/// slots in memory UCX allocates").
#[test]
fn over_shared_memory_atomics_into_memory_ucx_allocated_need_no_progress_at_the_owner() {
    const N: u64 = 100;
    if !ucx_here() {
        return;
    }
    let timeout = Duration::from_secs(3);
    let out = two_ranks_over(Some(c"posix,cma,self"), move |b, table| {
        let t = start(b, &table, timeout);
        let mem = t
            .alloc_host(4096)
            .expect("ucx allocates window memory")
            .unwrap();
        assert_eq!(mem.as_ptr() as usize % 8, 0);
        // SAFETY: `mem` outlives the region (removed below, before it drops).
        let mine = unsafe { table.insert(mem.as_ptr(), 4096, Access::ALL) }.unwrap();
        let keys = b.allgather(&mine.to_le_bytes()).unwrap();
        let key = |r: usize| u32::from_le_bytes(keys[r][..4].try_into().unwrap());
        let at = |r: usize| Target::Key {
            key: key(r),
            offset: 64,
        };
        let mut value = None;
        if b.rank() == 1 {
            // The rkey, while rank 0 still answers.
            t.atomic(0, at(0), AtomicOp::FetchAdd(1), timeout).unwrap();
            b.barrier().unwrap();
            // Rank 0's worker is held now.
            b.barrier().unwrap();
            for i in 1..=N {
                let old = t.atomic(0, at(0), AtomicOp::FetchAdd(1), timeout).unwrap();
                assert_eq!(old, i);
            }
            b.barrier().unwrap();
        } else {
            b.barrier().unwrap();
            t.inner.test.block_issue.store(true, Ordering::Release);
            std::thread::scope(|s| {
                let put = s.spawn(|| t.put(1, at(1), &[1; 8], None));
                while !t.inner.test.blocked.load(Ordering::Acquire) {
                    assert!(!put.is_finished(), "the put did not block");
                    std::thread::yield_now();
                }
                b.barrier().unwrap();
                b.barrier().unwrap();
                t.inner.test.block_issue.store(false, Ordering::Release);
                put.join().unwrap().unwrap();
            });
            // SAFETY: 8-byte aligned within the 4096 bytes of `mem`.
            value = Some(unsafe { mem.as_ptr().add(64).cast::<u64>().read_volatile() });
        }
        b.barrier().unwrap();
        drop(t);
        table.remove(mine);
        drop(mem);
        value
    });
    assert_eq!(out[0], Some(N + 1));
}

/// A get into window memory UCX allocated, whose keeper is the last owner
/// of that memory when the get completes, does not unmap it inside UCX's
/// progress (the completion callback, where the worker is held): the
/// keeper goes to the list dropped outside it, and the memory is still
/// freed. Over tcp, where a get completes in its callback.
#[test]
fn a_get_keeping_the_last_owner_of_memory_ucx_allocated_frees_it_outside_ucx_progress() {
    if !ucx_here() {
        return;
    }
    let timeout = Duration::from_secs(30);
    let out = two_ranks_over(Some(c"tcp,self"), move |b, table| {
        let t = start(b, &table, timeout);
        let mut src = vec![7u64; 512];
        let key = register(&table, &mut src);
        let peer = 1 - b.rank();
        let theirs = key_of(b, key, peer);
        let dst = t
            .alloc_host(4096)
            .expect("ucx allocates window memory")
            .unwrap();
        let base = dst.as_ptr() as usize;
        assert!(lock(&t.inner.allocations).contains_key(&base));
        let done = Arc::new(AtomicU64::new(1));
        let ptr = dst.as_ptr();
        let keep = crate::KeepAlive(Arc::new(dst));
        // SAFETY: the keeper holds the destination until the get completes.
        unsafe {
            t.get(
                peer,
                Target::Key {
                    key: theirs,
                    offset: 0,
                },
                ptr,
                4096,
                &done,
                Some(keep),
            )
        }
        .unwrap();
        let began = Instant::now();
        while done.load(Ordering::Acquire) > 0 || lock(&t.inner.allocations).contains_key(&base) {
            assert!(
                began.elapsed() < timeout,
                "the get's memory was never freed"
            );
            std::thread::yield_now();
        }
        b.barrier().unwrap();
        drop(t);
        table.remove(key);
        UNMAPPED_IN_CALLBACK.load(Ordering::Acquire)
    });
    assert_eq!(
        out,
        [0, 0],
        "memory UCX allocated was unmapped inside a callback"
    );
}

/// Where one rank of [`a_window_created_the_way_cpu_ranks_do`] found its
/// part of the window.
#[derive(Debug)]
struct CreatedWindow {
    /// The part lives in memory this rank's ucx transport allocated.
    allocated: bool,
    /// The ucx transport serves the part from the handle that allocated
    /// it (`Some(false)`: from a mapping of memory gin-rs allocated).
    borrowed: Option<bool>,
    /// The part is a segment gin-net created (what `GIN_UCX_ALLOC=0`
    /// makes of a part no peer maps).
    segment: bool,
}

/// Whether this process maps the page at `base` from a file whose path
/// contains `name` (`/proc/self/maps`).
fn mapped_from(base: usize, name: &str) -> bool {
    let hex = |x: &str| usize::from_str_radix(x, 16).ok();
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .any(|l| {
            let mut f = l.split_whitespace();
            let range = f.next().and_then(|r| r.split_once('-'));
            range
                .and_then(|(a, b)| Some((hex(a)?, hex(b)?)))
                .is_some_and(|(a, b)| a <= base && base < b)
                && l.contains(name)
        })
}

/// Two ranks as threads of one host, whose fabrics start as CPU ranks'
/// do (`Fabric::start`, as `GIN_TRANSPORT=ucx` chooses: ucx to each
/// other, UCX over shared memory) with the `GIN_UCX_*` settings `env`
/// (`None`: unset, whatever the test process's environment says),
/// create window 1 as CPU ranks' windows are created
/// (`HostWindows::alloc`, as gin-core's `Comm`), and move data through
/// it: rank 1 puts rounds of data with a signal each into rank 0's part
/// (rank 0 sees each signal only after its data, then reads it back from
/// rank 1's side), each rank fetch-adds a word of the other's part, and
/// compare-swaps another. Returns what each rank saw of its own part.
fn a_window_created_the_way_cpu_ranks_do(
    env: &'static [(&'static str, Option<&'static str>)],
) -> Vec<CreatedWindow> {
    const ROUNDS: u64 = 16;
    const ADDS: u64 = 50;
    const SIG: u64 = 0;
    const WORD: u64 = 8;
    const CAS: u64 = 16;
    const AREA: u64 = 64;
    const LEN: usize = 256;
    let timeout = Duration::from_secs(20);
    two_ranks_over(Some(c"posix,cma,self"), move |b, table| {
        SETTINGS.with(|s| {
            let mut s = s.borrow_mut();
            for (k, v) in env {
                s.insert(k, v.map(str::to_owned));
            }
        });
        let (rank, peer) = (b.rank(), 1 - b.rank());
        let setup = crate::transport::Setup {
            bootstrap: b,
            table: table.clone(),
            timeout,
        };
        let fabric = Arc::new(crate::Fabric::start(&setup, &[0, 0], Some("ucx")).unwrap());
        assert_eq!(fabric.path_names()[peer], "ucx");
        let windows = crate::host_window::HostWindows::new(
            fabric.clone(),
            vec![0, 0],
            &b.job_token("ucx tests: a window created the way CPU ranks do"),
        );
        let size = AREA + ROUNDS * LEN as u64;
        let w = windows
            .alloc(
                1,
                size,
                |r| b.allgather(r).map_err(NetError::from),
                || b.barrier().map_err(NetError::from),
            )
            .unwrap();
        let (base, key) = (w.parts().local_base, w.parts().keys[rank]);
        let path = fabric.path(peer).unwrap();
        let ucx = (&**path.transport() as &dyn std::any::Any)
            .downcast_ref::<UcxTransport>()
            .expect("the path to the peer is the ucx transport");
        let seen = CreatedWindow {
            allocated: lock(&ucx.inner.allocations).contains_key(&base),
            borrowed: lock(&ucx.inner.served)
                .get(&key)
                .map(serve::Mapping::borrowed),
            segment: mapped_from(base, &windows.segment_name(rank, 1)),
        };
        let at = |offset| Addr { window: 1, offset };
        let data = |k: u64| -> Vec<u8> {
            (0..LEN)
                .map(|i| (i as u64 * 7 + k * 13 + 1) as u8)
                .collect()
        };
        let read_word = |p: usize, offset| {
            let mut v = [0u8; 8];
            fabric.read(p, at(offset), &mut v).unwrap();
            u64::from_le_bytes(v)
        };
        b.barrier().unwrap();
        if rank == 1 {
            for k in 0..ROUNDS {
                fabric
                    .put(0, at(AREA + k * LEN as u64), &data(k), Some((at(SIG), 1)))
                    .unwrap();
            }
            fabric.confirm(0).unwrap();
        } else {
            let began = Instant::now();
            let mut got = 0;
            while got < ROUNDS {
                let signalled = read_word(0, SIG);
                assert!(
                    signalled <= ROUNDS,
                    "signal {signalled} after {ROUNDS} puts"
                );
                for k in got..signalled {
                    let mut out = vec![0u8; LEN];
                    fabric.read(0, at(AREA + k * LEN as u64), &mut out).unwrap();
                    assert_eq!(out, data(k), "round {k}'s data after its signal");
                }
                got = signalled;
                assert!(
                    began.elapsed() < timeout,
                    "rank 0 saw {got} of {ROUNDS} signals"
                );
                std::thread::yield_now();
            }
        }
        b.barrier().unwrap();
        // Gets from the peer's part see the puts.
        let mut out = vec![0u8; LEN];
        fabric
            .read(0, at(AREA + (ROUNDS - 1) * LEN as u64), &mut out)
            .unwrap();
        assert_eq!(out, data(ROUNDS - 1));
        // Atomics on the peer's part (each rank on the other's, at once).
        for i in 0..ADDS {
            assert_eq!(fabric.fetch_add(peer, at(WORD), 1).unwrap(), i);
        }
        assert_eq!(fabric.compare_swap(peer, at(CAS), 0, 7).unwrap(), 0);
        assert_eq!(fabric.compare_swap(peer, at(CAS), 0, 9).unwrap(), 7);
        b.barrier().unwrap();
        assert_eq!(read_word(rank, WORD), ADDS);
        assert_eq!(read_word(rank, CAS), 7);
        assert_eq!(read_word(peer, WORD), ADDS);
        b.barrier().unwrap();
        drop(w);
        b.barrier().unwrap();
        drop(windows);
        drop(fabric);
        seen
    })
}

/// Over the ucx transport, a window part no peer maps, created the way
/// CPU ranks create windows, lives in memory UCX allocated
/// (`Fabric::alloc_host`, forwarded to the ucx transport's), and its rkey
/// is packed from the allocating handle: what makes peers' atomics on it
/// native over UCX's shared memory. Were the memory gin-rs's, every
/// operation would still work, only with atomics emulated by the owner's
/// progress thread, which this test is here to notice.
#[test]
fn over_ucx_a_window_part_no_peer_maps_lives_in_memory_ucx_allocated() {
    if !ucx_here() {
        return;
    }
    // The default, whatever GIN_UCX_ALLOC the tests run under.
    for (rank, seen) in a_window_created_the_way_cpu_ranks_do(&[("GIN_UCX_ALLOC", None)])
        .iter()
        .enumerate()
    {
        assert!(
            seen.allocated && seen.borrowed == Some(true) && !seen.segment,
            "rank {rank}'s part is not memory UCX allocated: {seen:?}"
        );
    }
}

/// `GIN_UCX_ALLOC=0` leaves the part to gin-rs (a segment, as for peers
/// that map it) and UCX only registers it; puts, signals, gets and atomics
/// on it work as on memory UCX allocated.
#[test]
fn gin_ucx_alloc_0_makes_window_parts_segments_ucx_only_registers() {
    if !ucx_here() {
        return;
    }
    for (rank, seen) in a_window_created_the_way_cpu_ranks_do(&[("GIN_UCX_ALLOC", Some("0"))])
        .iter()
        .enumerate()
    {
        assert!(
            !seen.allocated && seen.borrowed == Some(false) && seen.segment,
            "rank {rank}'s part is not a segment UCX registered: {seen:?}"
        );
    }
}
