//! Regions behind a [`Backing`] (GPU memory on CUDA ranks) served over TCP:
//! puts and gets of any size go through the backing, chunk by chunk at the
//! right offsets; atomics and signals into such a region are refused with
//! an error that says why, and touch nothing.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gin_bootstrap::{Config, run_threads};
use gin_net::region::{Backing, RegionTable};
use gin_net::tcp::TcpTransport;

/// Keeps its bytes inverted and counts calls: a put that bypassed it would
/// show up as uninverted bytes.
#[derive(Default)]
struct Inverted {
    mem: Mutex<Vec<u8>>,
    calls: AtomicU64,
}

impl Backing for Inverted {
    fn write(&self, offset: u64, data: &[u8]) -> Result<(), String> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let mut m = self.mem.lock().unwrap();
        for (d, s) in m[offset as usize..][..data.len()].iter_mut().zip(data) {
            *d = !s;
        }
        Ok(())
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), String> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let m = self.mem.lock().unwrap();
        for (o, s) in out.iter_mut().zip(&m[offset as usize..]) {
            *o = !s;
        }
        Ok(())
    }
}

const LEN: usize = (3 << 20) + 5; // several of the server's 1 MiB chunks

fn pattern(rank: usize) -> Vec<u8> {
    (0..LEN).map(|i| (i * 7 + rank * 13) as u8).collect()
}

#[test]
fn puts_and_gets_of_backed_regions_go_through_the_backing() {
    let cfg = Config {
        timeout: Duration::from_secs(30),
        ..Config::default()
    };
    let out = run_threads(2, cfg, |b| {
        let table = Arc::new(RegionTable::default());
        let mem = Arc::new(Inverted {
            mem: Mutex::new(vec![0xff; LEN + 3]),
            calls: AtomicU64::new(0),
        });
        let key = table
            .insert_backed(
                0x1_0000_0000 + b.rank() as u64,
                (LEN + 3) as u64,
                mem.clone(),
            )
            .unwrap();
        let t = TcpTransport::start(&b, table.clone(), &[b.rank() == 1, b.rank() == 0]).unwrap();
        let keys = b.allgather(&key.to_le_bytes()).unwrap();
        let peer = 1 - b.rank();
        let pk = u32::from_le_bytes(keys[peer][..4].try_into().unwrap());
        let link = t.link(peer).unwrap();
        let to = Duration::from_secs(10);
        // A put at offset 3, then read it back with a get.
        let data = pattern(b.rank());
        link.put(pk, 3, &data, None).unwrap();
        link.fence(to).unwrap();
        let mut back = vec![0u8; LEN];
        let done = Arc::new(AtomicU64::new(1));
        // SAFETY: `back` lives until `done` drops to 0, awaited below.
        unsafe { link.get(pk, 3, LEN as u64, back.as_mut_ptr(), done.clone(), None) }.unwrap();
        let start = Instant::now();
        while done.load(Ordering::Acquire) != 0 {
            assert!(start.elapsed() < to, "get not answered");
            std::thread::yield_now();
        }
        link.check().unwrap();
        assert!(back == data, "rank {}: get returned other bytes", b.rank());
        b.barrier().unwrap();
        // What the peer put here went through the backing.
        let theirs = pattern(peer);
        let m = mem.mem.lock().unwrap().clone();
        assert!(m[..3].iter().all(|&x| x == 0xff));
        assert!(m[3..].iter().zip(&theirs).all(|(a, b)| *a == !b));
        assert!(mem.calls.load(Ordering::Relaxed) >= 8, "chunked copies");
        b.barrier().unwrap();
        // Atomics, and signals carried by a put, are refused.
        let e = if b.rank() == 0 {
            link.fetch_add(pk, 8, 1, to).unwrap_err().to_string()
        } else {
            link.put(pk, 0, &[1; 8], Some((pk, 16, 1))).unwrap();
            link.fence(to).unwrap_err().to_string()
        };
        b.barrier().unwrap();
        let after = mem.mem.lock().unwrap()[..24].to_vec();
        drop(t);
        (e, after, m[..24].to_vec())
    })
    .unwrap();
    for (r, (e, after, before)) in out.into_iter().enumerate() {
        assert!(
            e.contains("GPU memory") && e.contains("no atomics"),
            "rank {r}: {e}"
        );
        assert_eq!(after, before, "rank {r}: a refused request touched memory");
    }
}

/// A backing whose reads wait until the test opens the gate: a get stays in
/// flight as long as the test needs.
#[derive(Default)]
struct Gated {
    open: Mutex<bool>,
    cv: std::sync::Condvar,
}

impl Backing for Gated {
    fn write(&self, _: u64, _: &[u8]) -> Result<(), String> {
        Ok(())
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), String> {
        let g = self.open.lock().unwrap();
        let (_g, t) = self
            .cv
            .wait_timeout_while(g, Duration::from_secs(20), |open| !*open)
            .unwrap();
        if t.timed_out() {
            return Err("the test never opened the gate".into());
        }
        for (i, o) in out.iter_mut().enumerate() {
            *o = (offset as usize + i) as u8 ^ 0x5a;
        }
        Ok(())
    }
}

/// A get's destination, standing in for a window's memory: when the last
/// holder drops it, it records what it held.
struct Dest {
    buf: std::cell::UnsafeCell<Vec<u8>>,
    seen: Arc<Mutex<Option<Vec<u8>>>>,
}

// SAFETY: the buffer is written only by the link's reply reader, through
// the raw pointer the get was given, and read only in `drop`, when no one
// else holds it.
unsafe impl Sync for Dest {}

impl Drop for Dest {
    fn drop(&mut self) {
        *self.seen.lock().unwrap() = Some(self.buf.get_mut().clone());
    }
}

/// A get whose issuer stops waiting (a timeout) and drops the destination
/// window: the link holds the destination's keep-alive until the answer has
/// landed, so the bytes land in memory that is still there, and lets go of
/// it right after.
#[test]
fn a_get_in_flight_keeps_its_destination_alive_until_the_answer_lands() {
    const N: usize = 4096;
    let gate = Arc::new(Gated::default());
    let g = gate.clone();
    let out = run_threads(2, Config::default(), move |b| {
        let table = Arc::new(RegionTable::default());
        let key = table
            .insert_backed(0x2_0000_0000, N as u64 + 64, g.clone())
            .unwrap();
        let t = TcpTransport::start(&b, table.clone(), &[b.rank() == 1, b.rank() == 0]).unwrap();
        let keys = b.allgather(&key.to_le_bytes()).unwrap();
        let mut result = None;
        if b.rank() == 0 {
            let pk = u32::from_le_bytes(keys[1][..4].try_into().unwrap());
            let seen = Arc::new(Mutex::new(None));
            let dest = Arc::new(Dest {
                buf: std::cell::UnsafeCell::new(vec![0u8; N]),
                seen: seen.clone(),
            });
            // SAFETY: nothing else touches the buffer yet.
            let ptr = unsafe { (*dest.buf.get()).as_mut_ptr() };
            let weak = Arc::downgrade(&dest);
            let done = Arc::new(AtomicU64::new(1));
            let keep = gin_net::KeepAlive(dest);
            // SAFETY: `dest` lives while the link holds `keep`.
            unsafe {
                t.link(1)
                    .unwrap()
                    .get(pk, 64, N as u64, ptr, done.clone(), Some(keep))
            }
            .unwrap();
            // The issuer gives up and drops the destination: only the link
            // holds it now, and the answer has not come.
            let held = weak.strong_count();
            let pending = done.load(Ordering::Acquire);
            g.open.lock().unwrap().clone_from(&true);
            g.cv.notify_all();
            // Dropped by the link once the answer has landed (the strong
            // count falls before `drop` has run: wait for what it records).
            let start = Instant::now();
            let landed = loop {
                if let Some(v) = seen.lock().unwrap().take() {
                    break v;
                }
                assert!(start.elapsed() < Duration::from_secs(20), "still held");
                std::thread::yield_now();
            };
            result = Some((held, pending, done.load(Ordering::Acquire), landed));
        }
        b.barrier().unwrap();
        drop(t);
        result
    })
    .unwrap();
    let (held, pending, done, landed) = out[0].clone().unwrap();
    assert_eq!(
        held, 1,
        "the link holds the destination while the get is in flight"
    );
    assert_eq!(pending, 1, "the gate kept the answer back");
    assert_eq!(done, 0, "the get completed");
    let want: Vec<u8> = (0..N).map(|i| (64 + i) as u8 ^ 0x5a).collect();
    assert!(landed == want, "the answer landed in the kept destination");
}

/// A blocking read that gives up (its timeout) returns, and its
/// destination is never written afterwards: the late answer is dropped and
/// the link stays good.
#[test]
fn a_read_that_timed_out_never_writes_its_destination() {
    const N: usize = 4096;
    let gate = Arc::new(Gated::default());
    let g = gate.clone();
    let out = run_threads(2, Config::default(), move |b| {
        let table = Arc::new(RegionTable::default());
        let key = table
            .insert_backed(0x3_0000_0000, N as u64, g.clone())
            .unwrap();
        let t = TcpTransport::start(&b, table.clone(), &[b.rank() == 1, b.rank() == 0]).unwrap();
        let keys = b.allgather(&key.to_le_bytes()).unwrap();
        let mut result = None;
        if b.rank() == 0 {
            let pk = u32::from_le_bytes(keys[1][..4].try_into().unwrap());
            let link = t.link(1).unwrap();
            let mut dest = vec![0x11u8; N];
            let e = link
                .read(pk, 0, &mut dest, Duration::from_millis(200))
                .unwrap_err();
            g.open.lock().unwrap().clone_from(&true);
            g.cv.notify_all();
            // Answers come in order: once the fence is answered, the late
            // answer to the read has been handled.
            link.fence(Duration::from_secs(10)).unwrap();
            link.check().unwrap();
            let mut again = vec![0u8; N];
            link.read(pk, 0, &mut again, Duration::from_secs(10))
                .unwrap();
            result = Some((e.to_string(), dest, again));
        }
        b.barrier().unwrap();
        drop(t);
        result
    })
    .unwrap();
    let (e, dest, again) = out[0].clone().unwrap();
    assert!(e.contains("rank 1") && e.contains("timed out"), "{e}");
    assert!(
        dest.iter().all(|&x| x == 0x11),
        "the late answer was written"
    );
    let want: Vec<u8> = (0..N).map(|i| i as u8 ^ 0x5a).collect();
    assert!(again == want, "a later read returned other bytes");
}
