//! Transport conformance: the same assertions, through the [`Transport`]
//! trait and the fabric, for every registered transport (shm and tcp), with
//! ranks as separate processes (the test binary launches itself through the
//! launcher users use):
//!
//! - a put's signal is seen only after its data, round after round, for
//!   small puts and for a put of several chunks, and for a signal alone;
//! - gets (completion counter and blocking read) return what was put;
//! - fetch-add and compare-swap from both ranks at once on one word;
//! - refusals before anything moves (out of range, misaligned) leave the
//!   path healthy; a put to a part its owner withdrew is refused, its
//!   signal is never applied, and the error names window, offset and rank;
//! - with the peer dead, every operation returns within the timeout, and
//!   an error names the peer (a keyed transport must report the loss).

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test
#![allow(clippy::many_single_char_names)] // b, w, t, e, r: bootstrap, window, transport, error, result

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use gin_bootstrap::{Bootstrap, LaunchSpec, Output, launch};
use gin_net::region::Access;
use gin_net::shm::Segment;
use gin_net::transport::{AtomicOp, Setup};
use gin_net::{Addr, Fabric, KeepAlive, MemDesc, MemParts, Reach, Target, Transport};

/// Set in the rank processes: `<case>:<transport>`.
const CHILD: &str = "GIN_NET_CONFORMANCE";
/// The job's timeout in the rank processes.
const TIMEOUT: Duration = Duration::from_secs(10);

// Window layout (every rank's part alike).
const SIG: u64 = 0; // the data signal word
const WORD: u64 = 8; // fetch-add target (rank 0's)
const CAS: u64 = 16; // compare-swap target (rank 1's)
const ROUNDS: u64 = 32;
const SLOT: u64 = 8192;
const AREA: u64 = 64; // round k's data at AREA + k * SLOT
const BIG: u64 = AREA + ROUNDS * SLOT; // one put of several 1 MiB chunks
const BIG_LEN: usize = (3 << 20) + 40;
const LEN: usize = BIG as usize + BIG_LEN;

/// One window over a shared-memory segment per rank: served to keyed
/// peers under a key, mapped by mapped peers, registered with the fabric
/// (what gin-core's window registration does, in miniature).
struct Win {
    id: u32,
    desc: Arc<MemDesc>,
    own: Arc<Vec<Segment>>,
    key: u32,
}

impl Win {
    fn register(b: &Bootstrap, fabric: &Fabric, id: u32) -> Self {
        let (rank, n) = (b.rank(), b.nranks());
        let name = format!("gin-conf-{}-r{rank}-w{id}", std::process::id());
        let mut seg = Segment::create(&name, LEN).unwrap();
        // SAFETY: the segment outlives the key: `Win`'s drop (or
        // `withdraw`) removes the key, and the segment lives in `own`,
        // which the window's description also holds.
        let key = unsafe { fabric.table().insert(seg.as_ptr(), LEN as u64, Access::ALL) }.unwrap();
        let mut rec = key.to_le_bytes().to_vec();
        rec.extend_from_slice(&(seg.as_ptr() as u64).to_le_bytes());
        rec.extend_from_slice(seg.path().to_str().unwrap().as_bytes());
        let all = b.allgather(&rec).unwrap();
        let mut segs = Vec::new();
        let (mut bases, mut states) = (vec![0usize; n], vec![0usize; n]);
        for (p, r) in all.iter().enumerate() {
            if p != rank && fabric.reach(p) == Some(Reach::Mapped) {
                let path = std::str::from_utf8(&r[12..]).unwrap();
                let s = Segment::open(std::path::Path::new(path), LEN).unwrap();
                bases[p] = s.as_ptr() as usize;
                states[p] = std::ptr::from_ref(s.state()) as usize;
                segs.push(s);
            }
        }
        b.barrier().unwrap();
        seg.unlink();
        bases[rank] = seg.as_ptr() as usize;
        states[rank] = std::ptr::from_ref(seg.state()) as usize;
        let local = seg.as_ptr() as usize;
        segs.insert(0, seg);
        let own = Arc::new(segs);
        let parts = MemParts {
            local_base: local,
            sizes: vec![LEN as u64; n],
            peer_bases: bases,
            keys: all
                .iter()
                .map(|r| u32::from_le_bytes(r[..4].try_into().unwrap()))
                .collect(),
            addrs: all
                .iter()
                .map(|r| u64::from_le_bytes(r[4..12].try_into().unwrap()))
                .collect(),
            states,
            keep: Some(KeepAlive(own.clone())),
            ..MemParts::default()
        };
        // SAFETY: every base and state is a segment (LEN data bytes after
        // its header page) that `own`, held by the description, keeps
        // mapped; shared memory is only reached through raw pointers and
        // atomics.
        fabric.add_window(id, unsafe { MemDesc::new(parts) });
        Self {
            id,
            desc: fabric.window(id).unwrap(),
            own,
            key,
        }
    }

    fn at(&self, offset: u64) -> Addr {
        Addr {
            window: self.id,
            offset,
        }
    }

    fn target(&self, offset: u64) -> Target<'_> {
        Target::Window(&self.desc, self.at(offset))
    }

    /// This rank's own word at `offset`.
    fn word(&self, offset: u64) -> &AtomicU64 {
        // SAFETY: within this rank's segment, 8-byte aligned (the data is
        // page-aligned), only accessed atomically.
        unsafe {
            &*self.own[0]
                .as_ptr()
                .add(offset as usize)
                .cast::<AtomicU64>()
        }
    }

    /// `len` bytes of this rank's own part at `offset`, copied out.
    fn bytes(&self, offset: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        // SAFETY: within this rank's segment; a copy, no borrow held.
        unsafe {
            std::ptr::copy(
                self.own[0].as_ptr().add(offset as usize),
                v.as_mut_ptr(),
                len,
            );
        };
        v
    }

    /// Stops serving this rank's part to keyed peers (waits for a request
    /// being served).
    fn unserve(&self, fabric: &Fabric) {
        fabric.table().remove(self.key);
    }

    /// Stops serving this rank's part, as gin-core does when a window is
    /// dropped: the revocation word for mapped peers, the key for keyed
    /// ones.
    fn withdraw(&self, fabric: &Fabric) {
        self.own[0].state().store(1, Ordering::Release);
        fabric.table().remove(self.key);
    }
}

fn pattern(round: u64, from: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64 * 31 + round * 7 + from as u64 * 101) as u8)
        .collect()
}

/// Waits until `w` reaches `at_least`, within the timeout.
fn wait_for(w: &AtomicU64, at_least: u64, what: &str) -> u64 {
    let start = Instant::now();
    loop {
        let v = w.load(Ordering::Acquire);
        if v >= at_least {
            return v;
        }
        assert!(
            start.elapsed() < TIMEOUT * 2,
            "{what}: still {v} after {:?}, expected {at_least}",
            start.elapsed()
        );
        std::thread::yield_now();
    }
}

fn start(b: &Bootstrap, transport: &str) -> Fabric {
    let setup = Setup {
        bootstrap: b,
        table: Arc::default(),
        timeout: b.config().timeout,
    };
    // Every rank on one host: shm reaches them, and tcp is asked for.
    Fabric::start(&setup, &vec![0; b.nranks()], Some(transport)).unwrap()
}

/// Puts with signals: whoever sees signal k sees round k's data.
fn ordering(b: &Bootstrap, fabric: &Fabric, w: &Win, t: &dyn Transport) {
    let (rank, peer) = (b.rank(), 1 - b.rank());
    for k in 0..ROUNDS {
        let data = pattern(k, rank, SLOT as usize);
        t.put(
            peer,
            w.target(AREA + k * SLOT),
            &data,
            Some((w.target(SIG), 1)),
        )
        .unwrap();
    }
    // A signal alone, then one put of several chunks through the fabric.
    t.put(peer, w.target(AREA), &[], Some((w.target(SIG), 1)))
        .unwrap();
    let big = pattern(99, rank, BIG_LEN);
    fabric
        .put(peer, w.at(BIG), &big, Some((w.at(SIG), 1)))
        .unwrap();
    // The target side: round k's data is all there once the signal says k.
    let mut seen = 0;
    while seen < ROUNDS {
        let s = wait_for(w.word(SIG), seen + 1, "data signal").min(ROUNDS);
        for k in seen..s {
            let got = w.bytes(AREA + k * SLOT, SLOT as usize);
            assert!(
                got == pattern(k, peer, SLOT as usize),
                "round {k}'s data was not all visible with its signal"
            );
        }
        seen = s;
    }
    wait_for(w.word(SIG), ROUNDS + 2, "the last signal");
    assert!(
        w.bytes(BIG, BIG_LEN) == pattern(99, peer, BIG_LEN),
        "the chunked put was not all visible with its signal"
    );
    t.confirm(peer, TIMEOUT).unwrap();
    b.barrier().unwrap();
}

/// Gets return what this rank put at the peer; bare region keys work on
/// keyed transports and are refused, touching nothing, on mapped ones.
fn gets(b: &Bootstrap, fabric: &Fabric, w: &Win, t: &dyn Transport) {
    let (rank, peer) = (b.rank(), 1 - b.rank());
    let mut out = vec![0u8; BIG_LEN];
    let done = Arc::new(AtomicU64::new(1));
    // SAFETY: `out` outlives the wait for `done` below, and on a timeout
    // the test fails (the process ends) before `out` is dropped.
    unsafe {
        t.get(
            peer,
            w.target(BIG),
            out.as_mut_ptr(),
            BIG_LEN as u64,
            &done,
            None,
        )
    }
    .unwrap();
    wait_for_zero(&done);
    t.health(peer).unwrap();
    assert!(
        out == pattern(99, rank, BIG_LEN),
        "get returned other bytes"
    );
    let mut one = vec![0u8; SLOT as usize];
    t.read(peer, w.target(AREA + 5 * SLOT), &mut one, TIMEOUT)
        .unwrap();
    assert!(
        one == pattern(5, rank, SLOT as usize),
        "read returned other bytes"
    );
    let (key, at) = (w.desc.key_of(peer), AREA + 7 * SLOT);
    let data = pattern(7, rank + 10, 4096);
    let mut back = vec![0u8; 4096];
    let r = fabric
        .put_key(peer, key, at, &data)
        .and_then(|()| fabric.read_key(peer, key, at, &mut back));
    match t.reach() {
        Reach::Keyed => {
            r.unwrap();
            assert!(back == data, "a keyed read returned other bytes");
        }
        Reach::Mapped => {
            let e = r.unwrap_err();
            assert!(matches!(e, gin_net::NetError::Unsupported { .. }), "{e}");
        }
    }
    b.barrier().unwrap();
}

fn wait_for_zero(done: &AtomicU64) {
    let start = Instant::now();
    while done.load(Ordering::Acquire) != 0 {
        assert!(start.elapsed() < TIMEOUT * 2, "get not answered");
        std::thread::yield_now();
    }
}

/// Both ranks add to rank 0's word and swap on rank 1's at once.
fn atomics(b: &Bootstrap, fabric: &Fabric, w: &Win) {
    const K: u64 = 200;
    let path = |p: usize| fabric.path(p).unwrap().transport().clone();
    let (t0, t1) = (path(0), path(1));
    for _ in 0..K {
        t0.atomic(0, w.target(WORD), AtomicOp::FetchAdd(1), TIMEOUT)
            .unwrap();
    }
    let mut cur = 0;
    for _ in 0..K {
        loop {
            let op = AtomicOp::CompareSwap {
                expected: cur,
                desired: cur + 1,
            };
            let old = t1.atomic(1, w.target(CAS), op, TIMEOUT).unwrap();
            if old == cur {
                cur += 1;
                break;
            }
            cur = old;
        }
    }
    b.barrier().unwrap();
    assert_eq!(fabric.fetch_add(0, w.at(WORD), 0).unwrap(), 2 * K);
    assert_eq!(fabric.compare_swap(1, w.at(CAS), 0, 7).unwrap(), 2 * K);
    assert_eq!(
        fabric.fetch_add(1, w.at(CAS), 0).unwrap(),
        2 * K,
        "a failed swap stored"
    );
    b.barrier().unwrap();
}

/// Refusals: before anything moves (the path stays good), and by the owner
/// of a withdrawn part (the put and its signal refused as a whole).
fn refusals(b: &Bootstrap, fabric: &Fabric, w: &Win, t: &dyn Transport) {
    let (rank, peer) = (b.rank(), 1 - b.rank());
    let e = t
        .put(
            peer,
            w.target(LEN as u64 - 4),
            &[1; 8],
            Some((w.target(SIG), 1)),
        )
        .unwrap_err();
    assert!(
        matches!(e, gin_net::NetError::OutOfBounds { peer: p, len: 8, .. } if p == peer),
        "{e}"
    );
    let e = t
        .atomic(peer, w.target(WORD + 4), AtomicOp::FetchAdd(1), TIMEOUT)
        .unwrap_err();
    assert!(matches!(e, gin_net::NetError::Misaligned { .. }), "{e}");
    assert!(e.is_local_refusal());
    t.confirm(peer, TIMEOUT).unwrap();
    t.health(peer).unwrap();
    b.barrier().unwrap();
    let sig_before = w.word(SIG).load(Ordering::Acquire);
    let data_before = w.bytes(AREA, 64);
    // Rank 1 withdraws its part; rank 0 then puts to it with a signal.
    if rank == 1 {
        w.withdraw(fabric);
    }
    b.barrier().unwrap();
    if rank == 0 {
        let e = fabric
            .put(peer, w.at(AREA), &[0xee; 64], Some((w.at(SIG), 1)))
            .and_then(|()| fabric.confirm(peer))
            .unwrap_err()
            .to_string();
        for want in [
            format!("window {}", w.id),
            "offset 64".into(),
            "rank 1".into(),
        ] {
            assert!(e.contains(&want), "the refusal does not name {want:?}: {e}");
        }
    }
    b.barrier().unwrap();
    if rank == 1 {
        assert_eq!(
            w.word(SIG).load(Ordering::Acquire),
            sig_before,
            "signal applied"
        );
        assert_eq!(w.bytes(AREA, 64), data_before, "refused data landed");
    }
    b.barrier().unwrap();
}

fn suite(transport: &str) {
    let b = Bootstrap::from_env().unwrap();
    let fabric = start(&b, transport);
    let peer = 1 - b.rank();
    let t = fabric.path(peer).unwrap().transport().clone();
    assert_eq!(t.name(), transport);
    let w = Win::register(&b, &fabric, 3);
    ordering(&b, &fabric, &w, &*t);
    gets(&b, &fabric, &w, &*t);
    atomics(&b, &fabric, &w);
    refusals(&b, &fabric, &w, &*t);
    w.unserve(&fabric);
    println!("rank {}: conformance ok over {transport}", b.rank());
}

/// Rank 1 dies once the window is registered; rank 0 hears of it, then
/// every operation returns within the timeout.
fn dead_peer(transport: &str) {
    let b = Bootstrap::from_env().unwrap();
    let fabric = start(&b, transport);
    let w = Win::register(&b, &fabric, 4);
    // Rank 1 must not die before rank 0 has left the registration's
    // collectives (a death can overtake the last message before it).
    if b.rank() == 0 {
        b.send(1, 76, b"go").unwrap();
    } else {
        b.recv(0, 76).unwrap();
        // SAFETY: plain system calls; this process ends here, as under a
        // launcher's fault injection.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
    // Returns once the launcher's root relayed the death.
    let e = b.recv(1, 77).unwrap_err().to_string();
    assert!(e.contains("rank 1"), "{e}");
    let t = fabric.path(1).unwrap().transport().clone();
    let keyed = t.reach() == Reach::Keyed;
    let mut out = [0u8; 64];
    let check = |what: &str, op: &mut dyn FnMut() -> Result<(), gin_net::NetError>| {
        let start = Instant::now();
        let r = op();
        let took = start.elapsed();
        assert!(
            took < TIMEOUT + Duration::from_secs(2),
            "{what} took {took:?}"
        );
        match r {
            Err(e) => assert!(e.to_string().contains("rank 1"), "{what}: {e}"),
            Ok(()) => assert!(!keyed, "{what} over {transport} succeeded on a dead peer"),
        }
    };
    check("put", &mut || {
        t.put(1, w.target(AREA), &[1; 64], Some((w.target(SIG), 1)))
            .and_then(|()| t.confirm(1, TIMEOUT))
    });
    check("read", &mut || t.read(1, w.target(AREA), &mut out, TIMEOUT));
    check("atomic", &mut || {
        t.atomic(1, w.target(WORD), AtomicOp::FetchAdd(1), TIMEOUT)
            .map(drop)
    });
    check("fence", &mut || t.fence(1, TIMEOUT));
    check("fabric fence", &mut || fabric.fence_all());
    check("health", &mut || fabric.health());
    w.unserve(&fabric);
    println!("rank 0: dead peer ok over {transport}");
}

fn run_child() -> bool {
    let Ok(role) = std::env::var(CHILD) else {
        return false;
    };
    let (case, transport) = role.split_once(':').unwrap();
    match case {
        "suite" => suite(transport),
        "dead" => dead_peer(transport),
        other => panic!("unknown case {other}"),
    }
    true
}

/// Runs `case` over `transport` as two rank processes of this test.
fn job(test: &str, case: &str, transport: &str) -> gin_bootstrap::LaunchReport {
    let exe = std::env::current_exe().unwrap();
    let mut spec = LaunchSpec::new(
        2,
        exe,
        ["--exact", test, "--nocapture", "--test-threads", "1"],
    )
    .env(CHILD, format!("{case}:{transport}"))
    .env("GIN_TIMEOUT", format!("{}s", TIMEOUT.as_secs()));
    spec.output = Output::Capture;
    spec.grace = Duration::from_secs(20);
    spec.limit = Some(Duration::from_secs(120));
    launch(&spec).unwrap()
}

fn conformance(test: &str, transport: &str) {
    if run_child() {
        return;
    }
    let report = job(test, "suite", transport);
    for r in &report.ranks {
        assert!(
            r.success() && r.stdout.contains("conformance ok"),
            "rank {} over {transport}: {}\n{}\n{}",
            r.rank,
            report.describe_failures(),
            r.stdout,
            r.stderr
        );
    }
}

fn dead(test: &str, transport: &str) {
    if run_child() {
        return;
    }
    let start = Instant::now();
    let report = job(test, "dead", transport);
    let r0 = &report.ranks[0];
    assert!(
        r0.success() && r0.stdout.contains("dead peer ok"),
        "over {transport}: {}\n{}\n{}",
        report.describe_failures(),
        r0.stdout,
        r0.stderr
    );
    assert!(!report.ranks[1].success(), "rank 1 was to die");
    assert!(
        start.elapsed() < Duration::from_secs(60),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn shm_conforms() {
    conformance("shm_conforms", "shm");
}

#[test]
fn tcp_conforms() {
    conformance("tcp_conforms", "tcp");
}

#[test]
fn shm_survives_a_dead_peer() {
    dead("shm_survives_a_dead_peer", "shm");
}

#[test]
fn tcp_reports_a_dead_peer_within_the_timeout() {
    dead("tcp_reports_a_dead_peer_within_the_timeout", "tcp");
}
