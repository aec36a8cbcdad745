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
    FdJob::from_tokens(tag, [7; 32], timeout).with_pids(vec![Some(std::process::id()); 16])
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

/// The nonce fake exporters challenge with.
const NONCE: [u8; 16] = [0x5a; 16];

/// Accepts one connection on `l`'s socket.
fn accept_one(l: &FdListener) -> OwnedFd {
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
    unsafe { OwnedFd::from_raw_fd(c) }
}

/// A fake exporter on `job`'s socket for window 8 of rank 0: challenges
/// the first connection with [`NONCE`], answers its request with `answer`
/// (and `fd` attached, if given), and returns the request.
fn fake_exporter(job: &FdJob, answer: Vec<u8>, fd: Option<OwnedFd>) -> JoinHandle<Vec<u8>> {
    let l = FdListener::bind(job, 0, 8).unwrap();
    std::thread::spawn(move || {
        let conn = accept_one(&l);
        send_msg(conn.as_fd(), &challenge(8, 0, &NONCE), None).unwrap();
        let mut b = [0u8; 64];
        let (n, _, _) = recv_msg(conn.as_fd(), &mut b).unwrap();
        send_msg(conn.as_fd(), &answer, fd.as_ref().map(AsFd::as_fd)).unwrap();
        b[..n].to_vec()
    })
}

/// A fake exporter on `job`'s socket for window 8 of rank 0 that sends
/// `first` in place of a challenge, and what it received after (nothing,
/// the fetcher having closed the connection).
fn fake_challenger(job: &FdJob, first: Vec<u8>) -> JoinHandle<usize> {
    let l = FdListener::bind(job, 0, 8).unwrap();
    std::thread::spawn(move || {
        let conn = accept_one(&l);
        send_msg(conn.as_fd(), &first, None).unwrap();
        let mut b = [0u8; 64];
        recv_msg(conn.as_fd(), &mut b).unwrap().0
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
        assert_eq!(fake.join().unwrap(), request(&job, &NONCE, 8, 0, 1));
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

/// Connects to rank 0's socket for `window`, reads its challenge and
/// sends what `bytes` makes of its nonce; the reply (its length, 0: the
/// server closed the connection; the bytes; the descriptor).
fn raw_request(
    job: &FdJob,
    window: u32,
    bytes: impl Fn(&[u8; 16]) -> Vec<u8>,
) -> (usize, [u8; 64], Option<OwnedFd>) {
    let sock = seqpacket(false).unwrap();
    let (addr, len) = abstract_addr(&job.socket_name(window, 0)).unwrap();
    // SAFETY: a sockaddr_un of which `len` bytes are used.
    cvt(unsafe { libc::connect(sock.as_raw_fd(), (&raw const addr).cast(), len) }).unwrap();
    let mut b = [0u8; 64];
    let (n, _, _) = recv_msg(sock.as_fd(), &mut b).unwrap();
    assert_eq!((n, &b[..4]), (CHALLENGE_LEN, &CHALLENGE_MAGIC[..]));
    let nonce: [u8; 16] = b[12..CHALLENGE_LEN].try_into().unwrap();
    send_msg(sock.as_fd(), &bytes(&nonce), None).unwrap();
    let mut b = [0u8; 64];
    let (n, _, fd) = recv_msg(sock.as_fd(), &mut b).unwrap();
    (n, b, fd)
}

#[test]
fn a_malformed_request_gets_no_answer_and_the_server_goes_on_serving() {
    let job = job(LONG);
    let server = FdServer::start(FdListener::bind(&job, 0, 9).unwrap(), memfd(b"ok"), [1]).unwrap();
    // Short, long, and the right length with the wrong magic: the
    // connection is closed unanswered.
    let good = |n: &[u8; 16]| request(&job, n, 9, 0, 1);
    let short = |n: &[u8; 16]| good(n)[..5].to_vec();
    let long = |n: &[u8; 16]| [&good(n)[..], &[0]].concat();
    let wrong_magic = |n: &[u8; 16]| {
        let mut b = good(n);
        b[1] = 0;
        b.to_vec()
    };
    assert_eq!(raw_request(&job, 9, short).0, 0);
    assert_eq!(raw_request(&job, 9, long).0, 0);
    assert_eq!(raw_request(&job, 9, wrong_magic).0, 0);
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
        matches!(&e, FdPassError::Refused { rank: 1, peer: 0, window: 10, status: 2, why } if why.contains("authenticator")),
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
    let (n, b, fd) = raw_request(&job, 10, |n| request(&job, n, 11, 0, 1).to_vec());
    assert_eq!(n, REPLY_LEN);
    assert_eq!(u32_at(&b, 12), Status::WrongWindow as u32);
    assert!(fd.is_none());
    // The right key's answer to another nonce (a replay) is not this
    // job's.
    let (n, b, fd) = raw_request(&job, 10, |_| request(&job, &[0; 16], 10, 0, 1).to_vec());
    assert_eq!(n, REPLY_LEN);
    assert_eq!(u32_at(&b, 12), Status::Unauthenticated as u32);
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

#[test]
fn a_malformed_challenge_or_a_refusal_in_its_place_ends_the_fetch_unanswered() {
    let mut other_window = challenge(9, 0, &NONCE).to_vec();
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (
            challenge(8, 0, &NONCE)[..20].to_vec(),
            "20 bytes, expected a 28-byte challenge",
        ),
        (
            [&challenge(8, 0, &NONCE)[..], &[0]].concat(),
            "29 bytes, expected a 28-byte challenge",
        ),
        (
            [&challenge(8, 0, &NONCE)[..], &[0; 10]].concat(),
            "29 bytes or more, expected a 28-byte challenge",
        ),
        (std::mem::take(&mut other_window), "window 9 of rank 0"),
        (
            reply(8, 0, Status::Granted).to_vec(),
            "a grant before any request",
        ),
    ];
    for (first, want) in cases {
        let job = job(LONG);
        let fake = fake_challenger(&job, first);
        let e = fetch(&job, 1, 8, 0).unwrap_err();
        // Nothing was sent to it: the fetcher closed the connection.
        assert_eq!(fake.join().unwrap(), 0);
        assert!(
            matches!(&e, FdPassError::Malformed { rank: 1, peer: 0, window: 8, why } if why.contains(want)),
            "{want}: {e}"
        );
    }
    // A refusal in place of the challenge, with a status this build does
    // not know: said as such, the code kept.
    let job = job(LONG);
    let mut refusal = reply(8, 0, Status::Granted);
    refusal[12..].copy_from_slice(&77u32.to_le_bytes());
    let fake = fake_challenger(&job, refusal.to_vec());
    let e = fetch(&job, 1, 8, 0).unwrap_err();
    assert_eq!(fake.join().unwrap(), 0);
    assert!(
        matches!(&e, FdPassError::Refused { rank: 1, peer: 0, window: 8, status: 77, why } if why.contains("unknown refusal (status 77")),
        "{e}"
    );
    assert!(e.to_string().ends_with("(status 77)"), "{e}");
}

/// The job's records give rank `rank` the pid `pid` (every other rank
/// this process's).
fn with_pid(job: &FdJob, rank: usize, pid: u32) -> FdJob {
    let mut pids = vec![Some(std::process::id()); 16];
    pids[rank] = Some(pid);
    job.clone().with_pids(pids)
}

/// A pid that is not this process's (init's).
const NOT_OURS: u32 = 1;

#[test]
fn a_connection_from_a_process_that_is_no_peers_is_refused_at_once() {
    let job = job(LONG);
    // The server's records give its one peer, rank 1, another pid: this
    // process connecting is a stranger, refused before any challenge.
    let server = FdServer::start(
        FdListener::bind(&with_pid(&job, 1, NOT_OURS), 0, 14).unwrap(),
        memfd(b"x"),
        [1],
    )
    .unwrap();
    let e = fetch(&job, 1, 14, 0).unwrap_err();
    assert!(
        matches!(&e, FdPassError::Refused { rank: 1, peer: 0, window: 14, status: 4, why } if why.contains("not the one that rank runs as")),
        "{e}"
    );
    drop(server);
}

#[test]
fn a_request_claiming_another_ranks_identity_is_refused_and_that_rank_still_served() {
    let job = job(LONG);
    // Peers 1 and 2; the records give rank 2 another pid than this
    // process's. This process may be rank 1's, so it is challenged; its
    // claim to be rank 2 is refused.
    let server = FdServer::start(
        FdListener::bind(&with_pid(&job, 2, NOT_OURS), 0, 15).unwrap(),
        memfd(b"ok"),
        [1, 2],
    )
    .unwrap();
    let e = fetch(&job, 2, 15, 0).unwrap_err();
    assert!(
        matches!(
            &e,
            FdPassError::Refused {
                rank: 2,
                status: 4,
                ..
            }
        ),
        "{e}"
    );
    let fd = fetch(&job, 1, 15, 0).unwrap();
    assert_eq!(read_at(&fd, 0, 2), b"ok");
    drop(server);
}

#[test]
fn a_fetch_sends_nothing_to_a_listener_that_is_not_the_exporters_process() {
    let job = job(LONG);
    // A squatter's socket (here: bound by this process, whose pid the
    // fetcher's records do not give rank 0).
    let squatter = FdListener::bind(&job, 0, 16).unwrap();
    let e = fetch(&with_pid(&job, 0, NOT_OURS), 1, 16, 0).unwrap_err();
    assert!(
        matches!(&e, FdPassError::Impostor { rank: 1, peer: 0, window: 16, cred, why }
            if cred.pid == std::process::id() && why.contains("not rank 0's process (pid 1")),
        "{e}"
    );
    assert!(
        e.to_string().contains(
            "will not fetch the descriptor of GPU window 16 from the process on rank 0's socket"
        ),
        "{e}"
    );
    // The connection was made, then closed with nothing on it.
    let conn = accept_one(&squatter);
    let mut b = [0u8; 64];
    assert_eq!(recv_msg(conn.as_fd(), &mut b).unwrap().0, 0);
}

#[test]
fn credentials_of_another_user_or_another_pid_are_not_a_ranks() {
    let me = PeerCred { pid: 10, uid: 1000 };
    assert_eq!(me.mismatch(3, 1000, Some(10)), None);
    // Pid unknown (another pid namespace): the uid is all that is checked.
    assert_eq!(me.mismatch(3, 1000, None), None);
    let w = me.mismatch(3, 0, None).unwrap();
    assert!(
        w.contains("pid 10 (uid 1000) belongs to another user"),
        "{w}"
    );
    let w = me.mismatch(3, 1000, Some(11)).unwrap();
    assert!(w.contains("is not rank 3's process (pid 11"), "{w}");
}

#[test]
fn silent_connections_hold_up_no_peer() {
    // The job's timeout is shorter than the wait a silent connection is
    // allowed: a server that waited on them one at a time would time out
    // before the peer's turn.
    assert!(REQUEST_WAIT > Duration::from_secs(1));
    let job = job(Duration::from_secs(1));
    let server =
        FdServer::start(FdListener::bind(&job, 0, 17).unwrap(), memfd(b"ok"), [1]).unwrap();
    let silent: Vec<OwnedFd> = (0..3)
        .map(|_| {
            let sock = seqpacket(false).unwrap();
            let (addr, len) = abstract_addr(&job.socket_name(17, 0)).unwrap();
            // SAFETY: a sockaddr_un of which `len` bytes are used.
            cvt(unsafe { libc::connect(sock.as_raw_fd(), (&raw const addr).cast(), len) }).unwrap();
            // Challenged, and never answering.
            let mut b = [0u8; 64];
            assert_eq!(recv_msg(sock.as_fd(), &mut b).unwrap().0, CHALLENGE_LEN);
            sock
        })
        .collect();
    let fd = fetch(&job, 1, 17, 0).unwrap();
    assert_eq!(read_at(&fd, 0, 2), b"ok");
    server.wait().unwrap();
    drop(silent);
}

#[test]
fn a_timeout_too_large_for_a_deadline_waits_as_long_as_it_can_without_panicking() {
    let job = job(Duration::MAX);
    let server =
        FdServer::start(FdListener::bind(&job, 0, 18).unwrap(), memfd(b"ok"), [1]).unwrap();
    let fd = fetch(&job, 1, 18, 0).unwrap();
    assert_eq!(read_at(&fd, 0, 2), b"ok");
    server.wait().unwrap();
    let e = fetch(&job, 1, 19, 0).unwrap_err();
    assert!(matches!(e, FdPassError::Gone { .. }), "{e}");
}

#[test]
fn a_send_timeout_under_a_microsecond_is_a_microsecond_not_forever() {
    for t in [Duration::ZERO, Duration::from_nanos(999)] {
        let tv = timeval_of(t);
        assert_eq!((tv.tv_sec, tv.tv_usec), (0, 1));
    }
    let tv = timeval_of(Duration::from_millis(2500));
    assert_eq!((tv.tv_sec, tv.tv_usec), (2, 500_000));
    let tv = timeval_of(Duration::MAX);
    assert!(tv.tv_sec > 0);
}

#[test]
fn only_transient_accept_failures_are_retried() {
    let of = |errno| AcceptFailure::of(&io::Error::from_raw_os_error(errno));
    assert_eq!(of(libc::EINTR), AcceptFailure::Again);
    assert_eq!(of(libc::ECONNABORTED), AcceptFailure::Again);
    assert_eq!(of(libc::EAGAIN), AcceptFailure::Drained);
    for errno in [libc::EMFILE, libc::ENFILE, libc::ENOBUFS, libc::EBADF] {
        assert_eq!(of(errno), AcceptFailure::Fatal, "{errno}");
    }
}

#[test]
fn a_server_that_panicked_is_an_error_not_a_success() {
    let server = FdServer {
        rank: 2,
        window: 20,
        stop: None,
        thread: Some(std::thread::spawn(|| panic!("boom"))),
    };
    let e = server.wait().unwrap_err();
    assert!(
        matches!(&e, FdPassError::ServerPanicked { rank: 2, window: 20, why } if why == "boom"),
        "{e}"
    );
}

#[test]
fn a_fetchs_socket_failure_names_the_exporter() {
    let e = FdPassError::Fetch {
        rank: 1,
        peer: 4,
        window: 3,
        what: "waiting for the answer",
        source: io::Error::from_raw_os_error(libc::EBADF),
    };
    assert!(
        e.to_string().starts_with(
            "rank 1: waiting for the answer to fetch the descriptor of GPU window 3 from rank 4:"
        ),
        "{e}"
    );
}
