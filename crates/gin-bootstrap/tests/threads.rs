//! Ranks as threads of one process: every collective for 1..=16 ranks, and
//! the bad-input cases that need a hand on the sockets.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use gin_bootstrap::frame::{self, Frame};
use gin_bootstrap::{
    Bootstrap, BootstrapError, BootstrapRoot, Config, UniqueId, run_threads, selftest,
};

fn cfg(timeout_ms: u64) -> Config {
    Config {
        timeout: Duration::from_millis(timeout_ms),
        ..Config::default()
    }
}

fn localhost() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

#[test]
fn collectives_are_correct_for_1_to_16_thread_ranks() {
    for n in 1..=16 {
        let results = run_threads(n, cfg(30_000), |b| selftest::verify(&b, 2)).unwrap();
        for (rank, r) in results.into_iter().enumerate() {
            assert_eq!(r, Ok(()), "{n} ranks, rank {rank}");
        }
    }
}

#[test]
fn bad_peer_and_bad_arguments_are_errors() {
    let out = run_threads(3, cfg(10_000), |b| {
        let e1 = b.send(3, 0, b"x").unwrap_err().to_string();
        let e2 = b.recv(7, 0).unwrap_err().to_string();
        let e3 = b.alltoall(&[0; 5], 2).unwrap_err().to_string();
        let e4 = b.broadcast(9, b"").unwrap_err().to_string();
        let e5 = b.alltoallv(&[b"a"]).unwrap_err().to_string();
        (e1, e2, e3, e4, e5)
    })
    .unwrap();
    for (e1, e2, e3, e4, e5) in out {
        assert!(
            e1.contains("peer 3 does not exist in a job of 3 ranks"),
            "{e1}"
        );
        assert!(e2.contains("peer 7 does not exist"), "{e2}");
        assert!(e3.contains("not 3 blocks of 2 bytes"), "{e3}");
        assert!(e4.contains("peer 9"), "{e4}");
        assert!(e5.contains("1 blocks given for 3 ranks"), "{e5}");
    }
}

#[test]
fn allgather_equal_names_the_rank_with_another_size() {
    let out = run_threads(3, cfg(10_000), |b| {
        let mine = vec![0u8; if b.rank() == 1 { 5 } else { 4 }];
        b.allgather_equal(&mine).unwrap_err().to_string()
    })
    .unwrap();
    assert!(
        out[0].contains("rank 1 contributed 5 bytes, this rank 4"),
        "{}",
        out[0]
    );
}

#[test]
fn rank_out_of_range_is_refused_before_connecting() {
    let id: UniqueId = "gin1:000102030405060708090a0b0c0d0e0f@127.0.0.1:9"
        .parse()
        .unwrap();
    let e = Bootstrap::init_with(&id, 4, 4, cfg(1000)).unwrap_err();
    assert!(
        matches!(e, BootstrapError::BadRank { rank: 4, nranks: 4 }),
        "{e}"
    );
    let e = Bootstrap::init_with(&id, 0, 0, cfg(1000)).unwrap_err();
    assert!(matches!(e, BootstrapError::BadRank { .. }), "{e}");
}

#[test]
fn a_rank_that_never_arrives_is_named_in_the_timeout() {
    let root = BootstrapRoot::start(localhost(), Some(3), cfg(800)).unwrap();
    let id = root.id();
    let hs: Vec<_> = [0, 2]
        .into_iter()
        .map(|r| std::thread::spawn(move || Bootstrap::init_with(&id, r, 3, cfg(800)).unwrap_err()))
        .collect();
    for h in hs {
        let e = h.join().unwrap();
        let text = e.to_string();
        assert!(
            matches!(&e, BootstrapError::Aborted { missing, .. } if *missing == vec![1]),
            "{text}"
        );
        assert!(text.contains("ranks that never answered: [1]"), "{text}");
    }
    assert!(root.wait(Duration::from_secs(5)));
}

#[test]
fn duplicate_rank_is_refused_and_named() {
    let root = BootstrapRoot::start(localhost(), Some(2), cfg(1500)).unwrap();
    let id = root.id();
    let first = std::thread::spawn(move || Bootstrap::init_with(&id, 0, 2, cfg(1500)));
    // Let the first rank 0 be admitted before the duplicate arrives; the
    // outcome is checked either way round below.
    let second = std::thread::spawn(move || Bootstrap::init_with(&id, 0, 2, cfg(1500)));
    let (a, b) = (first.join().unwrap(), second.join().unwrap());
    let errs: Vec<String> = [a, b]
        .into_iter()
        .map(|r| r.unwrap_err().to_string())
        .collect();
    // One of them was refused as a duplicate; the other timed out waiting for rank 1.
    assert!(
        errs.iter().any(|e| e.contains("duplicate rank")),
        "{errs:?}"
    );
    assert!(
        errs.iter().any(|e| e.contains("never answered: [1]")),
        "{errs:?}"
    );
}

#[test]
fn wrong_rank_count_is_refused() {
    let root = BootstrapRoot::start(localhost(), Some(2), cfg(1000)).unwrap();
    let e = Bootstrap::init_with(&root.id(), 0, 3, cfg(1000))
        .unwrap_err()
        .to_string();
    assert!(e.contains("claims a job of 3 ranks, this job has 2"), "{e}");
}

/// A connection that speaks the protocol with the wrong secret.
fn stranger_hello(to: SocketAddr) -> Option<Frame> {
    let mut s = TcpStream::connect(to).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let Some(Frame::Challenge { .. }) = frame::read_frame(&mut s, 1 << 16).unwrap() else {
        panic!("expected a challenge");
    };
    let hello = Frame::Hello(frame::Hello {
        purpose: frame::Purpose::Peer,
        rank: 0,
        nranks: 2,
        listen_addr: String::new(),
        mac: [0; 32],
    });
    s.write_all(&frame::encode(&hello).unwrap()).unwrap();
    frame::read_frame(&mut s, 1 << 16).ok().flatten()
}

/// Raw bytes: garbage, a truncated frame, an absurd length.
fn stranger_bytes(to: SocketAddr, bytes: &[u8]) {
    let mut s = TcpStream::connect(to).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = s.write_all(bytes);
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut sink = Vec::new();
    let _ = s.read_to_end(&mut sink);
}

#[test]
fn strangers_are_refused_and_the_job_goes_on() {
    let root = BootstrapRoot::start(localhost(), Some(2), cfg(20_000)).unwrap();
    let id = root.id();
    // A stranger at the root before the ranks arrive.
    assert!(
        matches!(stranger_hello(id.addr), Some(Frame::Refuse { reason }) if reason.contains("wrong job secret"))
    );
    let mut absurd = frame::encode(&Frame::Goodbye).unwrap();
    absurd[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
    stranger_bytes(id.addr, &absurd);
    stranger_bytes(id.addr, b"GET / HTTP/1.1\r\n\r\n");
    let ranks: Vec<_> = (0..2)
        .map(|r| {
            let absurd = absurd.clone();
            std::thread::spawn(move || {
                let b = Bootstrap::init_with(&id, r, 2, cfg(20_000)).unwrap();
                b.barrier().unwrap();
                // Strangers at each rank's own listener, mid-job.
                let peer = b.peer_addrs()[1 - r];
                assert!(matches!(stranger_hello(peer), Some(Frame::Refuse { .. })));
                let truncated = &frame::encode(&Frame::Welcome).unwrap()[..7];
                stranger_bytes(peer, truncated);
                stranger_bytes(peer, &absurd);
                b.barrier().unwrap();
                selftest::verify(&b, 1)
            })
        })
        .collect();
    for h in ranks {
        assert_eq!(h.join().unwrap(), Ok(()));
    }
}

/// Connects, takes the challenge, says nothing: how long until the acceptor
/// hangs up.
fn silent_stranger_dropped_after(to: SocketAddr) -> Duration {
    let mut s = TcpStream::connect(to).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let t = Instant::now();
    let Some(Frame::Challenge { .. }) = frame::read_frame(&mut s, 1 << 16).unwrap() else {
        panic!("expected a challenge");
    };
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    assert!(rest.is_empty(), "{rest:?}");
    t.elapsed()
}

#[test]
fn a_silent_stranger_is_dropped_at_the_authentication_deadline() {
    let config = Config {
        auth_timeout: Duration::from_millis(300),
        ..cfg(20_000)
    };
    let root = BootstrapRoot::start(localhost(), Some(2), config).unwrap();
    let id = root.id();
    let at_root = silent_stranger_dropped_after(id.addr);
    let out = run_threads_at(id, config, |b| {
        b.barrier().unwrap();
        let at_rank = (b.rank() == 0).then(|| silent_stranger_dropped_after(b.peer_addrs()[1]));
        b.barrier().unwrap();
        at_rank
    });
    for (what, took) in [("the root", at_root), ("rank 1", out[0].unwrap())] {
        assert!(
            took >= Duration::from_millis(250) && took < Duration::from_secs(3),
            "{what} dropped a silent stranger after {took:?}, its deadline is 300ms"
        );
    }
}

/// Two ranks as threads of a job whose root is already running.
fn run_threads_at<T: Send + 'static>(
    id: UniqueId,
    config: Config,
    f: impl Fn(&Bootstrap) -> T + Send + Sync + Copy + 'static,
) -> Vec<T> {
    let ranks: Vec<_> = (0..2)
        .map(|r| std::thread::spawn(move || f(&Bootstrap::init_with(&id, r, 2, config).unwrap())))
        .collect();
    ranks.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn a_peer_that_leaves_early_fails_the_receiver_promptly() {
    let t0 = Instant::now();
    let out = run_threads(2, cfg(30_000), |b| {
        if b.rank() == 1 {
            b.barrier().unwrap();
            return None; // dropped: says goodbye
        }
        b.barrier().unwrap();
        Some(b.recv(1, 5).unwrap_err().to_string())
    })
    .unwrap();
    let e = out[0].as_ref().unwrap();
    assert!(e.contains("rank 1 closed its bootstrap"), "{e}");
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t0.elapsed()
    );
}

#[test]
fn a_peer_that_leaves_without_ever_sending_is_noticed_at_once() {
    // Rank 1 never dials rank 0, so only the root can tell rank 0 it left.
    let out = run_threads(2, cfg(30_000), |b| {
        if b.rank() == 1 {
            return None;
        }
        let t = Instant::now();
        let recv = b.recv(1, 5).unwrap_err().to_string();
        let took = t.elapsed();
        Some((recv, took, b.health().unwrap_err().to_string()))
    })
    .unwrap();
    let (recv, took, health) = out[0].clone().unwrap();
    assert!(recv.contains("rank 1 closed its bootstrap"), "{recv}");
    assert!(took < Duration::from_secs(5), "took {took:?}: {recv}");
    assert!(health.contains("rank 1 exited"), "{health}");
}

#[test]
fn ranks_that_leave_right_after_a_barrier_do_not_fail_it_for_the_others() {
    // The last barrier message from a rank and the root's news of its
    // departure travel on different connections; the message must win.
    for round in 0..20 {
        let out = run_threads(4, cfg(30_000), |b| {
            b.barrier().map_err(|e| e.to_string())?;
            b.barrier().map_err(|e| e.to_string())
        })
        .unwrap();
        for (rank, r) in out.into_iter().enumerate() {
            assert_eq!(r, Ok(()), "round {round}, rank {rank}");
        }
    }
}

#[test]
fn a_silent_peer_times_out_naming_it() {
    let root = BootstrapRoot::start(localhost(), Some(2), cfg(10_000)).unwrap();
    let id = root.id();
    // Rank 1 stays connected but silent until rank 0 has timed out, then answers.
    let quiet = std::thread::spawn(move || {
        let b = Bootstrap::init_with(&id, 1, 2, cfg(10_000)).unwrap();
        b.recv(0, 2).unwrap()
    });
    let b = Bootstrap::init_with(&id, 0, 2, cfg(300)).unwrap();
    let e = b.recv(1, 1).unwrap_err().to_string();
    b.send(1, 2, b"done").unwrap();
    assert_eq!(quiet.join().unwrap(), b"done");
    assert!(
        e.contains("timed out") && e.contains("a message from rank 1") && e.contains("[1]"),
        "{e}"
    );
}
