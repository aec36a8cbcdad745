//! The descriptor passing between real sockets, ranks as threads: a memfd
//! stands in for a VMM allocation's descriptor.

#![allow(clippy::unwrap_used)]

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU32, Ordering};

use super::*;

/// A job of its own for each test (the socket names are host-wide): this
/// process's id and a counter.
fn job(timeout: Duration) -> FdJob {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let mut tag = [0u8; 8];
    tag[..4].copy_from_slice(&std::process::id().to_le_bytes());
    tag[4..].copy_from_slice(&NEXT.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    FdJob::from_tokens(tag, [7; 32], timeout)
}

/// A memfd holding `bytes`.
fn memfd(bytes: &[u8]) -> OwnedFd {
    // SAFETY: a NUL-terminated name; the result is checked.
    let fd = unsafe { libc::memfd_create(c"gin-fdpass-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "{}", io::Error::last_os_error());
    // SAFETY: a new descriptor owned here.
    let mut f = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    f.write_all(bytes).unwrap();
    f.into()
}

/// What `fd`'s file holds at `offset`, `len` bytes.
fn read_at(fd: &OwnedFd, offset: u64, len: usize) -> Vec<u8> {
    let f = File::from(fd.try_clone().unwrap());
    let mut b = vec![0u8; len];
    f.read_exact_at(&mut b, offset).unwrap();
    b
}

const LONG: Duration = Duration::from_secs(60);

#[test]
fn same_host_peers_fetch_the_descriptor_and_reach_the_same_bytes_through_it() {
    let job = job(LONG);
    let fd = memfd(b"the exporter's bytes");
    let mine = fd.try_clone().unwrap();
    let server = FdServer::start(FdListener::bind(&job, 0, 4).unwrap(), fd, [1, 2]).unwrap();
    let fetched: Vec<OwnedFd> = std::thread::scope(|s| {
        let peers: Vec<_> = [1, 2]
            .map(|r| {
                let job = &job;
                s.spawn(move || fetch(job, r, 4, 0))
            })
            .into_iter()
            .collect();
        peers
            .into_iter()
            .map(|t| t.join().unwrap().unwrap())
            .collect()
    });
    // Both peers had theirs: the server ended by itself.
    server.wait().unwrap();
    for fd in &fetched {
        assert_eq!(read_at(fd, 0, 20), b"the exporter's bytes");
    }
    // One file, not a copy: what a peer writes, the exporter reads.
    File::from(fetched[0].try_clone().unwrap())
        .write_all_at(b"PEER", 4)
        .unwrap();
    assert_eq!(read_at(&mine, 0, 20), b"the PEERrter's bytes");
    assert_eq!(read_at(&fetched[1], 4, 4), b"PEER");
}

#[test]
fn a_peer_that_never_fetches_is_named_when_the_server_gives_up() {
    let job = job(Duration::from_millis(300));
    let server = FdServer::start(
        FdListener::bind(&job, 0, 5).unwrap(),
        memfd(b"x"),
        [1, 2, 3],
    )
    .unwrap();
    fetch(&job, 1, 5, 0).unwrap();
    fetch(&job, 3, 5, 0).unwrap();
    let e = server.wait().unwrap_err();
    assert!(
        matches!(&e, FdPassError::NeverFetched { rank: 0, window: 5, peers, .. } if peers == &[2]),
        "{e}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("rank 0 offered the descriptor of GPU window 5")
            && msg.contains("rank(s) [2] never fetched it"),
        "{msg}"
    );
}

#[test]
fn a_fetch_from_an_exporter_that_never_answers_times_out_naming_it() {
    let job = job(Duration::from_millis(300));
    // Bound, so the connection is accepted into the backlog, but nobody
    // serves it.
    let _listener = FdListener::bind(&job, 2, 6).unwrap();
    let e = fetch(&job, 0, 6, 2).unwrap_err();
    assert!(
        matches!(e, FdPassError::Timeout { rank: 0, peer: 2, window: 6, waited } if waited >= Duration::from_millis(300)),
        "{e}"
    );
    assert!(
        e.to_string().contains("rank 0 waited")
            && e.to_string()
                .contains("for rank 2 to hand over the descriptor of GPU window 6"),
        "{e}"
    );
}

#[test]
fn a_fetch_from_a_rank_that_does_not_listen_fails_at_once_naming_it() {
    // The job's timeout is long: failing at once is the point.
    let job = job(LONG);
    let t = Instant::now();
    let e = fetch(&job, 1, 7, 3).unwrap_err();
    assert!(t.elapsed() < LONG);
    assert!(
        matches!(&e, FdPassError::Gone { rank: 1, peer: 3, window: 7, why } if why.contains("nobody listens")),
        "{e}"
    );
    assert!(e.to_string().contains("has rank 3 exited?"), "{e}");
}

/// A fake exporter on `job`'s socket for window 8 of rank 0: answers the
/// first request with `answer` (and `fd` attached, if given).
fn fake_exporter(job: &FdJob, answer: Vec<u8>, fd: Option<OwnedFd>) -> JoinHandle<Vec<u8>> {
    let l = FdListener::bind(job, 0, 8).unwrap();
    std::thread::spawn(move || {
        assert!(
            poll_in(&[l.sock.as_fd()], Instant::now() + LONG)
                .unwrap()
                .is_some()
        );
        // SAFETY: a listening socket.
        let c = unsafe {
            libc::accept4(
                l.sock.as_raw_fd(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                libc::SOCK_CLOEXEC,
            )
        };
        assert!(c >= 0);
        // SAFETY: a new descriptor owned here.
        let conn = unsafe { OwnedFd::from_raw_fd(c) };
        let mut b = [0u8; 64];
        let (n, _, _) = recv_msg(conn.as_fd(), &mut b).unwrap();
        send_msg(conn.as_fd(), &answer, fd.as_ref().map(AsFd::as_fd)).unwrap();
        b[..n].to_vec()
    })
}

#[test]
fn a_malformed_answer_is_an_error_naming_the_exporter_and_window() {
    let good = reply(8, 0, Status::Granted).to_vec();
    let mut wrong_magic = good.clone();
    wrong_magic[0] = b'X';
    let cases: Vec<(Vec<u8>, Option<OwnedFd>, &str)> = vec![
        (
            good[..5].to_vec(),
            Some(memfd(b"x")),
            "5 bytes, expected 16",
        ),
        (
            [&good[..], &[0u8; 4]].concat(),
            Some(memfd(b"x")),
            "or more, expected 16",
        ),
        (
            wrong_magic,
            Some(memfd(b"x")),
            "expected 16 starting with GINF",
        ),
        (good.clone(), None, "no descriptor came with it"),
        (
            reply(9, 0, Status::Granted).to_vec(),
            Some(memfd(b"x")),
            "window 9 of rank 0",
        ),
    ];
    for (answer, fd, want) in cases {
        let job = job(LONG);
        let fake = fake_exporter(&job, answer, fd);
        let e = fetch(&job, 1, 8, 0).unwrap_err();
        // The request the fake saw is the protocol's.
        assert_eq!(fake.join().unwrap(), request(&job, 8, 0, 1));
        assert!(
            matches!(&e, FdPassError::Malformed { rank: 1, peer: 0, window: 8, why } if why.contains(want)),
            "{want}: {e}"
        );
        assert!(
            e.to_string().starts_with(
                "rank 1 got a malformed answer from rank 0 for the descriptor of GPU window 8"
            ),
            "{e}"
        );
    }
}

/// Connects to rank 0's socket for `window` and sends `bytes`; what comes
/// back (length; 0: the server closed the connection).
fn raw_request(job: &FdJob, window: u32, bytes: &[u8]) -> usize {
    let sock = seqpacket(false).unwrap();
    let (addr, len) = abstract_addr(&job.socket_name(window, 0)).unwrap();
    // SAFETY: a sockaddr_un of which `len` bytes are used.
    cvt(unsafe { libc::connect(sock.as_raw_fd(), (&raw const addr).cast(), len) }).unwrap();
    send_msg(sock.as_fd(), bytes, None).unwrap();
    let mut b = [0u8; 64];
    recv_msg(sock.as_fd(), &mut b).unwrap().0
}

#[test]
fn a_malformed_request_gets_no_answer_and_the_server_goes_on_serving() {
    let job = job(LONG);
    let server = FdServer::start(FdListener::bind(&job, 0, 9).unwrap(), memfd(b"ok"), [1]).unwrap();
    // Short, long, and the right length with the wrong magic: the
    // connection is closed unanswered.
    let good = request(&job, 9, 0, 1);
    let mut wrong_magic = good;
    wrong_magic[1] = 0;
    for bad in [
        &good[..5],
        &[&good[..], &[0]].concat()[..],
        &wrong_magic[..],
    ] {
        assert_eq!(raw_request(&job, 9, bad), 0);
    }
    let fd = fetch(&job, 1, 9, 0).unwrap();
    assert_eq!(read_at(&fd, 0, 2), b"ok");
    server.wait().unwrap();
}

#[test]
fn strangers_other_jobs_and_other_windows_are_refused_and_the_peer_still_served() {
    let job = job(LONG);
    let server =
        FdServer::start(FdListener::bind(&job, 0, 10).unwrap(), memfd(b"ok"), [1]).unwrap();
    // Another job's authenticator on this job's socket name.
    let impostor = FdJob {
        auth: [8; 32],
        ..job.clone()
    };
    let e = fetch(&impostor, 1, 10, 0).unwrap_err();
    assert!(
        matches!(&e, FdPassError::Refused { rank: 1, peer: 0, window: 10, why } if why.contains("authenticator")),
        "{e}"
    );
    // A rank the descriptor is not for.
    let e = fetch(&job, 5, 10, 0).unwrap_err();
    assert!(
        matches!(&e, FdPassError::Refused { rank: 5, .. })
            && e.to_string().contains("not a same-host peer"),
        "{e}"
    );
    // A request naming another window, sent to this one's socket.
    let sock = seqpacket(false).unwrap();
    let (addr, len) = abstract_addr(&job.socket_name(10, 0)).unwrap();
    // SAFETY: a sockaddr_un of which `len` bytes are used.
    cvt(unsafe { libc::connect(sock.as_raw_fd(), (&raw const addr).cast(), len) }).unwrap();
    send_msg(sock.as_fd(), &request(&job, 11, 0, 1), None).unwrap();
    let mut b = [0u8; 32];
    let (n, _, fd) = recv_msg(sock.as_fd(), &mut b).unwrap();
    assert_eq!(n, REPLY_LEN);
    assert_eq!(u32_at(&b, 12), Status::WrongWindow as u32);
    assert!(fd.is_none());
    // The peer it is for still gets it.
    fetch(&job, 1, 10, 0).unwrap();
    server.wait().unwrap();
}

#[test]
fn dropping_the_server_stops_it_and_closes_the_socket() {
    let job = job(LONG);
    let server = FdServer::start(FdListener::bind(&job, 0, 12).unwrap(), memfd(b"x"), [1]).unwrap();
    let t = Instant::now();
    drop(server);
    // Not at the job's timeout: the stop pipe woke it.
    assert!(t.elapsed() < LONG);
    let e = fetch(&job, 1, 12, 0).unwrap_err();
    assert!(matches!(e, FdPassError::Gone { peer: 0, .. }), "{e}");
}

#[test]
fn a_taken_socket_name_is_an_error_naming_it() {
    let job = job(LONG);
    let _first = FdListener::bind(&job, 3, 13).unwrap();
    let e = FdListener::bind(&job, 3, 13).unwrap_err();
    let name = job.socket_name(13, 3);
    assert!(
        matches!(&e, FdPassError::Bind { rank: 3, window: 13, name: n, .. } if *n == name),
        "{e}"
    );
    assert!(e.to_string().contains(&format!("@{name}")), "{e}");
    assert!(
        name.starts_with("gin-rs/fd/") && name.ends_with("/w13/r3"),
        "{name}"
    );
}

#[test]
fn the_job_debug_form_leaves_the_authenticator_out() {
    let j = FdJob::from_tokens([0xab; 8], [0xcd; 32], LONG);
    let d = format!("{j:?}");
    assert!(d.contains("abababababababab"), "{d}");
    assert!(!d.contains("cd, ") && !d.contains("205"), "{d}");
}
