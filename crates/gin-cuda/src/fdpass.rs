//! Handing a file descriptor to the same host's ranks. The exporting rank
//! listens on a Unix domain socket in the abstract namespace, under a name
//! unique to the job, the window and the exporting rank (nothing on the
//! file system to clean up; the name goes when the listener closes). Each
//! same-host peer connects and receives the descriptor as `SCM_RIGHTS`
//! ancillary data. `SOCK_SEQPACKET` keeps message boundaries, so a short
//! or long message is seen as such.
//!
//! Abstract socket names are visible host-wide (`/proc/net/unix`), and
//! where the job's secret is derived from public values (a launcher's
//! environment) anyone on the host can compute them: a name proves
//! nothing. Each side therefore asks the kernel who is at the other end
//! (`SO_PEERCRED`, the credentials of the process that connected, or that
//! listened) before anything else: a process of this user (the effective
//! uid) and, where the job knows the rank's pid (gin-bootstrap's process
//! records, for ranks on this kernel and in this pid namespace), that very
//! process. The exporter drops any other connection at once, the fetcher
//! refuses to talk to any other listener (a squatter that bound the name
//! first, or during teardown). Then the exporter sends a random nonce and
//! the fetcher answers with a keyed hash of it, the window and both ranks
//! under the job's token: a squatter learns nothing it could replay.
//!
//! This is how a VMM allocation's POSIX file descriptor
//! (`cuMemExportToShareableHandle`) reaches the peers that map it; nothing
//! here knows CUDA, and the tests pass a memfd. (`pidfd_getfd` is not used:
//! it needs ptrace permission, often denied between sibling processes.)
//!
//! Every wait has a deadline, the job's timeout. A fetch whose exporter has
//! gone fails at once (nobody listens, or the connection closes), one whose
//! exporter never answers fails at the deadline, naming it. A server
//! ([`FdServer`]) polls its pending connections together (a silent one
//! holds nobody up, and is dropped after [`REQUEST_WAIT`]); it stops once
//! every expected peer has the descriptor, when its owner drops it, or at
//! its deadline, naming the peers that never came.

use std::collections::BTreeSet;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use gin_bootstrap::Bootstrap;
use gin_bootstrap::liveness::Liveness;

/// The first four bytes of a request or a reply.
const MAGIC: [u8; 4] = *b"GINF";
/// The first four bytes of a challenge.
const CHALLENGE_MAGIC: [u8; 4] = *b"GINC";
/// A challenge, the exporter's first message: magic `GINC`, window,
/// exporter (u32 LE each), a 16-byte random nonce.
pub const CHALLENGE_LEN: usize = 28;
/// A request: magic, window (u32 LE), exporter (u32 LE), requester (u32
/// LE), the 32-byte answer to the challenge (a keyed hash of its nonce and
/// the three numbers under the job's token).
pub const REQUEST_LEN: usize = 48;
/// A reply: magic, window, exporter, status (u32 LE each); the descriptor
/// rides along when the status is 0. A refusal may come in place of the
/// challenge (a connecting process that is not a peer's).
pub const REPLY_LEN: usize = 16;
/// How long a server keeps a connection it accepted waiting for its
/// request (peers send theirs at once; one that sends nothing is dropped,
/// holding up nobody meanwhile).
pub const REQUEST_WAIT: Duration = Duration::from_secs(2);
/// The most connections a server keeps waiting for their request at once
/// (more are dropped as they come).
const MAX_PENDING: usize = 64;
/// Instead of a deadline beyond what [`Instant`] can hold: a century.
const FAR: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// What a server answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    /// The descriptor is attached.
    Granted = 0,
    /// The requester is not one of the peers this descriptor is for.
    NotAPeer = 1,
    /// The answer to the challenge is not this job's.
    Unauthenticated = 2,
    /// The request names another window or exporter.
    WrongWindow = 3,
    /// The connecting process is not the rank's (another user's, or
    /// another pid than the rank's).
    WrongProcess = 4,
}

impl Status {
    fn why(code: u32) -> String {
        match code {
            1 => {
                "it does not hand this descriptor to this rank (not a same-host peer there)".into()
            }
            2 => {
                "the request's authenticator (the answer to its challenge) is not this job's".into()
            }
            3 => "the request named another window or exporting rank".into(),
            4 => "the connecting process is not the one that rank runs as (another user's, or \
                  another pid than the job's records give)"
                .into(),
            code => format!("an unknown refusal (status {code}; a newer build?)"),
        }
    }
}

/// What names a job's descriptor sockets and authenticates requests, the
/// job's timeout, and the pids of its ranks where known. Every rank of a
/// job derives the same from its bootstrap ([`FdJob::new`]).
#[derive(Clone)]
pub struct FdJob {
    tag: [u8; 8],
    auth: [u8; 32],
    timeout: Duration,
    /// Each rank's pid, by rank, where it names the rank here (`None`:
    /// unknown, only the uid is checked).
    pids: Arc<[Option<u32>]>,
}

impl std::fmt::Debug for FdJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FdJob")
            .field("tag", &hex(&self.tag))
            .field("timeout", &self.timeout)
            .field("pids", &self.pids)
            .finish_non_exhaustive()
    }
}

/// Lower-case hex of `b`.
fn hex(b: &[u8]) -> String {
    use std::fmt::Write;
    b.iter().fold(String::new(), |mut s, x| {
        let _ = write!(s, "{x:02x}");
        s
    })
}

/// `timeout` from now, or a century where that is past what [`Instant`]
/// holds.
fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout)
        .or_else(|| now.checked_add(FAR))
        .unwrap_or(now)
}

impl FdJob {
    /// The job's names and authenticator, from its bootstrap's job tokens;
    /// the ranks' pids from `liveness` (this process's own, and each peer's
    /// that runs on this kernel and in this pid namespace); waits last
    /// `timeout` (the job's).
    pub fn new(bootstrap: &Bootstrap, liveness: &Liveness, timeout: Duration) -> Self {
        let name = bootstrap.job_token("gin-cuda fd socket names");
        let mut tag = [0u8; 8];
        tag.copy_from_slice(&name[..8]);
        let me = bootstrap.rank();
        let pids = (0..bootstrap.nranks())
            .map(|r| {
                if r == me {
                    Some(std::process::id())
                } else {
                    liveness.pid(r)
                }
            })
            .collect();
        Self::from_tokens(tag, bootstrap.job_token("gin-cuda fd requests"), timeout).with_pids(pids)
    }

    /// From explicit tokens (tests, or a job with its own secrets), no
    /// rank's pid known (see [`FdJob::with_pids`]).
    pub fn from_tokens(tag: [u8; 8], auth: [u8; 32], timeout: Duration) -> Self {
        Self {
            tag,
            auth,
            timeout,
            pids: Arc::new([]),
        }
    }

    /// With each rank's pid, by rank (`None`, or a rank past the end:
    /// unknown, so only a connecting or listening process's uid is
    /// checked for it).
    #[must_use]
    pub fn with_pids(mut self, pids: Vec<Option<u32>>) -> Self {
        self.pids = pids.into();
        self
    }

    /// Rank `rank`'s pid, where the job knows it.
    pub fn pid(&self, rank: usize) -> Option<u32> {
        self.pids.get(rank).copied().flatten()
    }

    /// How long a fetch waits, and a server waits for its peers.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The abstract socket name (without its leading NUL) on which rank
    /// `exporter` hands out window `window`'s descriptor.
    pub fn socket_name(&self, window: u32, exporter: usize) -> String {
        format!("gin-rs/fd/{}/w{window}/r{exporter}", hex(&self.tag))
    }

    /// The answer to a challenge's `nonce` for a request of window
    /// `window` of `exporter` by `requester`.
    fn answer(&self, nonce: &[u8; 16], window: u32, exporter: u32, requester: u32) -> [u8; 32] {
        let mut h = blake3::Hasher::new_keyed(&self.auth);
        h.update(b"gin-rs fd request v1");
        h.update(nonce);
        h.update(&window.to_le_bytes());
        h.update(&exporter.to_le_bytes());
        h.update(&requester.to_le_bytes());
        *h.finalize().as_bytes()
    }
}

/// The process at the other end of a Unix socket (`SO_PEERCRED`: the
/// process that connected, or that listened), as this process's pid and
/// user namespaces see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    /// Its pid (0 where it runs in a pid namespace this one cannot see).
    pub pid: u32,
    /// Its effective uid.
    pub uid: u32,
}

impl std::fmt::Display for PeerCred {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pid {} (uid {})", self.pid, self.uid)
    }
}

impl PeerCred {
    /// Why this is not rank `rank`'s process: not of user `uid` (this
    /// process's effective uid), or not `pid` where the rank's pid is
    /// known; `None` when it may be.
    fn mismatch(self, rank: usize, uid: u32, pid: Option<u32>) -> Option<String> {
        if self.uid != uid {
            return Some(format!(
                "{self} belongs to another user than this process's (uid {uid})"
            ));
        }
        match pid {
            Some(p) if p != self.pid => Some(format!(
                "{self} is not rank {rank}'s process (pid {p}, as the job's records give it)"
            )),
            _ => None,
        }
    }
}

/// `SO_PEERCRED` of `sock`.
fn peer_cred(sock: BorrowedFd<'_>) -> io::Result<PeerCred> {
    let mut c = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: a ucred of the size passed, and its length.
    cvt(unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut c).cast(),
            &raw mut len,
        )
    })?;
    Ok(PeerCred {
        pid: u32::try_from(c.pid).unwrap_or(0),
        uid: c.uid,
    })
}

/// This process's effective uid.
fn euid() -> u32 {
    // SAFETY: always succeeds.
    unsafe { libc::geteuid() }
}

/// What passing a descriptor fails with; every message names the rank
/// that saw it, the window and, where one is involved, the peer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FdPassError {
    /// A socket call of an exporting rank failed.
    #[error("rank {rank}: {what} for the descriptor of GPU window {window}: {source}")]
    Io {
        /// This rank.
        rank: usize,
        /// The window.
        window: u32,
        /// What was being done.
        what: &'static str,
        /// The system's error.
        source: io::Error,
    },
    /// A socket call of a fetching rank failed.
    #[error(
        "rank {rank}: {what} to fetch the descriptor of GPU window {window} from rank {peer}: \
         {source}"
    )]
    Fetch {
        /// This rank.
        rank: usize,
        /// The exporting rank.
        peer: usize,
        /// The window.
        window: u32,
        /// What was being done.
        what: &'static str,
        /// The system's error.
        source: io::Error,
    },
    /// The exporter's socket name is taken (or cannot be bound).
    #[error(
        "rank {rank} cannot listen on the abstract socket @{name} to hand out the descriptor of \
         GPU window {window}: {source}"
    )]
    Bind {
        /// This rank.
        rank: usize,
        /// The window.
        window: u32,
        /// The socket's name.
        name: String,
        /// The system's error.
        source: io::Error,
    },
    /// The process listening on the exporter's socket is not the
    /// exporter's: nothing was sent to it.
    #[error(
        "rank {rank} will not fetch the descriptor of GPU window {window} from the process on \
         rank {peer}'s socket: {why} (another process holds the socket's name)"
    )]
    Impostor {
        /// This rank.
        rank: usize,
        /// The exporting rank.
        peer: usize,
        /// The window.
        window: u32,
        /// The listening process.
        cred: PeerCred,
        /// How it differs from the exporter's.
        why: String,
    },
    /// The exporter is not there (nobody listens, or it closed the
    /// connection without an answer).
    #[error(
        "rank {rank} cannot fetch the descriptor of GPU window {window} from rank {peer}: {why} \
         (has rank {peer} exited?)"
    )]
    Gone {
        /// This rank.
        rank: usize,
        /// The exporting rank.
        peer: usize,
        /// The window.
        window: u32,
        /// What happened.
        why: String,
    },
    /// The exporter did not answer within the job's timeout.
    #[error(
        "rank {rank} waited {waited:?} for rank {peer} to hand over the descriptor of GPU window \
         {window}, in vain (GIN_TIMEOUT)"
    )]
    Timeout {
        /// This rank.
        rank: usize,
        /// The exporting rank.
        peer: usize,
        /// The window.
        window: u32,
        /// How long it waited.
        waited: Duration,
    },
    /// Peers that should have fetched the descriptor did not come within
    /// the job's timeout.
    #[error(
        "rank {rank} offered the descriptor of GPU window {window} for {waited:?}, but rank(s) \
         {peers:?} never fetched it (GIN_TIMEOUT)"
    )]
    NeverFetched {
        /// This (exporting) rank.
        rank: usize,
        /// The window.
        window: u32,
        /// The peers that never came.
        peers: Vec<usize>,
        /// How long it waited.
        waited: Duration,
    },
    /// The server thread panicked (a bug): whether the peers have the
    /// descriptor is unknown.
    #[error(
        "rank {rank}'s server of the descriptor of GPU window {window} panicked: {why} (a bug in \
         gin-cuda; whether every peer fetched the descriptor is unknown)"
    )]
    ServerPanicked {
        /// This (exporting) rank.
        rank: usize,
        /// The window.
        window: u32,
        /// The panic's message, where it has one.
        why: String,
    },
    /// The exporter's answer is not a reply of this protocol.
    #[error(
        "rank {rank} got a malformed answer from rank {peer} for the descriptor of GPU window \
         {window}: {why}"
    )]
    Malformed {
        /// This rank.
        rank: usize,
        /// The exporting rank.
        peer: usize,
        /// The window.
        window: u32,
        /// What is wrong with it.
        why: String,
    },
    /// The exporter refused.
    #[error(
        "rank {peer} refused rank {rank} the descriptor of GPU window {window}: {why} (status \
         {status})"
    )]
    Refused {
        /// This rank.
        rank: usize,
        /// The exporting rank.
        peer: usize,
        /// The window.
        window: u32,
        /// The status the exporter answered.
        status: u32,
        /// What it means.
        why: String,
    },
}

/// `r`, or the last OS error where it is negative.
fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// A new `AF_UNIX` `SOCK_SEQPACKET` socket (close-on-exec, and
/// non-blocking where asked).
fn seqpacket(nonblocking: bool) -> io::Result<OwnedFd> {
    let flags = libc::SOCK_SEQPACKET
        | libc::SOCK_CLOEXEC
        | if nonblocking { libc::SOCK_NONBLOCK } else { 0 };
    // SAFETY: plain socket creation; the result is checked.
    let fd = cvt(unsafe { libc::socket(libc::AF_UNIX, flags, 0) })?;
    // SAFETY: a new descriptor this function owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The abstract-namespace address `@name`, and its length.
fn abstract_addr(name: &str) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    // SAFETY: all-zero is a valid sockaddr_un.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let b = name.as_bytes();
    if b.len() + 1 > addr.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "socket name too long",
        ));
    }
    // sun_path[0] stays NUL: the abstract namespace.
    for (d, s) in addr.sun_path[1..].iter_mut().zip(b) {
        *d = *s as libc::c_char;
    }
    let len = std::mem::offset_of!(libc::sockaddr_un, sun_path) + 1 + b.len();
    Ok((addr, len as libc::socklen_t))
}

/// Which of `fds` are readable (or hung up), by index, waiting until
/// `until` for one to be; all `false` at the deadline.
fn poll_ready(fds: &[BorrowedFd<'_>], until: Instant) -> io::Result<Vec<bool>> {
    let mut p: Vec<libc::pollfd> = fds
        .iter()
        .map(|f| libc::pollfd {
            fd: f.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    loop {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(vec![false; fds.len()]);
        }
        // Rounded up, so the deadline is not missed by a partial millisecond.
        let ms = left.as_millis().saturating_add(1).min(i32::MAX as u128) as libc::c_int;
        // SAFETY: `p` holds `p.len()` initialised pollfds.
        let r = unsafe { libc::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, ms) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if r > 0 {
            return Ok(p.iter().map(|x| x.revents != 0).collect());
        }
    }
}

/// Which of `fds` is readable (or hung up) first, waiting until `until`;
/// `None` at the deadline.
fn poll_in(fds: &[BorrowedFd<'_>], until: Instant) -> io::Result<Option<usize>> {
    Ok(poll_ready(fds, until)?.iter().position(|&r| r))
}

/// Sends `bytes` as one message on `sock`, with `fd` as `SCM_RIGHTS`
/// ancillary data if given.
fn send_msg(sock: BorrowedFd<'_>, bytes: &[u8], fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr().cast_mut().cast(),
        iov_len: bytes.len(),
    };
    // Room for one descriptor, aligned as cmsghdr needs.
    let mut cbuf = [0u64; 8];
    // SAFETY: all-zero is a valid msghdr.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &raw mut iov;
    msg.msg_iovlen = 1;
    if let Some(fd) = fd {
        let raw = fd.as_raw_fd();
        // SAFETY: CMSG_SPACE of one int fits `cbuf` (24 of 64 bytes);
        // CMSG_FIRSTHDR of a control buffer that large is non-null and
        // within it, and CMSG_DATA points at room for the int.
        unsafe {
            msg.msg_control = cbuf.as_mut_ptr().cast();
            msg.msg_controllen = libc::CMSG_SPACE(size_of::<libc::c_int>() as u32) as _;
            let c = libc::CMSG_FIRSTHDR(&raw const msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(size_of::<libc::c_int>() as u32) as _;
            libc::CMSG_DATA(c)
                .cast::<libc::c_int>()
                .write_unaligned(raw);
        }
    }
    loop {
        // SAFETY: `msg` points at `iov` (valid for `bytes.len()` bytes) and
        // at `cbuf` where set; both outlive the call.
        let r = unsafe { libc::sendmsg(sock.as_raw_fd(), &raw const msg, libc::MSG_NOSIGNAL) };
        if r >= 0 {
            return if r as usize == bytes.len() {
                Ok(())
            } else {
                Err(io::Error::new(io::ErrorKind::WriteZero, "short send"))
            };
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// One message received on `sock` into `buf`: its length (0 at the end of
/// the connection), whether it was longer than `buf`, and the descriptor
/// it carried (the first, if several: the rest are closed).
fn recv_msg(sock: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<(usize, bool, Option<OwnedFd>)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut cbuf = [0u64; 16];
    // SAFETY: all-zero is a valid msghdr.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &raw mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = size_of_val(&cbuf) as _;
    let n = loop {
        // SAFETY: `msg` points at `iov` (valid for `buf.len()` bytes) and at
        // `cbuf` (`msg_controllen` bytes); both outlive the call.
        let r = unsafe { libc::recvmsg(sock.as_raw_fd(), &raw mut msg, libc::MSG_CMSG_CLOEXEC) };
        if r >= 0 {
            break r as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    let mut fds = Vec::new();
    // SAFETY: the kernel filled `msg_controllen` bytes of `cbuf` with
    // well-formed cmsghdrs; CMSG_FIRSTHDR / CMSG_NXTHDR stay within them
    // and return null past the last. Each SCM_RIGHTS payload holds
    // (cmsg_len - CMSG_LEN(0)) / 4 descriptors this process now owns.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&raw const msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<libc::c_int>();
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize)
                    / size_of::<libc::c_int>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            c = libc::CMSG_NXTHDR(&raw const msg, c);
        }
    }
    let truncated = msg.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0;
    // Extra descriptors close as `fds` drops.
    let first = if fds.is_empty() {
        None
    } else {
        Some(fds.swap_remove(0))
    };
    Ok((n, truncated, first))
}

/// `t` as a `timeval`, at least a microsecond: `SO_SNDTIMEO` takes a zero
/// one as "wait forever".
fn timeval_of(t: Duration) -> libc::timeval {
    let t = t.max(Duration::from_micros(1));
    libc::timeval {
        tv_sec: t.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_usec: libc::suseconds_t::from(t.subsec_micros()),
    }
}

/// Sets `SO_SNDTIMEO` on `sock` (what a blocking `connect` to a full
/// backlog waits).
fn send_timeout(sock: BorrowedFd<'_>, t: Duration) -> io::Result<()> {
    let tv = timeval_of(t);
    // SAFETY: a timeval of the size passed.
    cvt(unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDTIMEO,
            (&raw const tv).cast(),
            size_of::<libc::timeval>() as libc::socklen_t,
        )
    })
    .map(drop)
}

/// Little-endian u32 at `at` of `b` (which holds it).
fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(w)
}

/// A challenge about window `window` of `exporter`.
fn challenge(window: u32, exporter: usize, nonce: &[u8; 16]) -> [u8; CHALLENGE_LEN] {
    let mut b = [0u8; CHALLENGE_LEN];
    b[..4].copy_from_slice(&CHALLENGE_MAGIC);
    b[4..8].copy_from_slice(&window.to_le_bytes());
    b[8..12].copy_from_slice(&(exporter as u32).to_le_bytes());
    b[12..].copy_from_slice(nonce);
    b
}

/// A request for window `window` of `exporter` by `requester`, answering
/// the challenge `nonce`.
fn request(
    job: &FdJob,
    nonce: &[u8; 16],
    window: u32,
    exporter: usize,
    requester: usize,
) -> [u8; REQUEST_LEN] {
    let (exporter, requester) = (exporter as u32, requester as u32);
    let mut b = [0u8; REQUEST_LEN];
    b[..4].copy_from_slice(&MAGIC);
    b[4..8].copy_from_slice(&window.to_le_bytes());
    b[8..12].copy_from_slice(&exporter.to_le_bytes());
    b[12..16].copy_from_slice(&requester.to_le_bytes());
    b[16..].copy_from_slice(&job.answer(nonce, window, exporter, requester));
    b
}

/// A reply about window `window` of `exporter`.
fn reply(window: u32, exporter: usize, status: Status) -> [u8; REPLY_LEN] {
    let mut b = [0u8; REPLY_LEN];
    b[..4].copy_from_slice(&MAGIC);
    b[4..8].copy_from_slice(&window.to_le_bytes());
    b[8..12].copy_from_slice(&(exporter as u32).to_le_bytes());
    b[12..].copy_from_slice(&(status as u32).to_le_bytes());
    b
}

/// The listening socket of an exporting rank, bound (so peers that learn
/// of the export can connect at once) but not yet serving: connections
/// wait in its backlog until [`FdServer::start`].
#[derive(Debug)]
pub struct FdListener {
    sock: OwnedFd,
    job: FdJob,
    rank: usize,
    window: u32,
}

impl FdListener {
    /// Binds rank `rank`'s socket for window `window`'s descriptor.
    pub fn bind(job: &FdJob, rank: usize, window: u32) -> Result<Self, FdPassError> {
        let io = |what, source| FdPassError::Io {
            rank,
            window,
            what,
            source,
        };
        let name = job.socket_name(window, rank);
        let sock = seqpacket(true).map_err(|e| io("creating a Unix socket", e))?;
        let (addr, len) = abstract_addr(&name).map_err(|e| io("naming the socket", e))?;
        // SAFETY: `addr` is a sockaddr_un of which `len` bytes are used.
        cvt(unsafe { libc::bind(sock.as_raw_fd(), (&raw const addr).cast(), len) }).map_err(
            |source| FdPassError::Bind {
                rank,
                window,
                name: name.clone(),
                source,
            },
        )?;
        // SAFETY: a bound socket.
        cvt(unsafe { libc::listen(sock.as_raw_fd(), 128) })
            .map_err(|e| io("listening on the socket", e))?;
        Ok(Self {
            sock,
            job: job.clone(),
            rank,
            window,
        })
    }
}

/// A thread handing one descriptor to a set of same-host peers: it ends
/// when every one of them has it, at the job's timeout (counted from
/// [`FdServer::start`]), or when this is dropped (which waits for it).
#[derive(Debug)]
pub struct FdServer {
    rank: usize,
    window: u32,
    /// The write end of a pipe the thread polls: closing it stops the
    /// thread.
    stop: Option<OwnedFd>,
    thread: Option<JoinHandle<Result<(), FdPassError>>>,
}

impl FdServer {
    /// Serves `fd` on `listener` to each of `peers` that connects from its
    /// own process (its uid, and its pid where the job knows it) and
    /// answers the challenge with the job's token. The descriptor is
    /// closed when the server ends.
    pub fn start(
        listener: FdListener,
        fd: OwnedFd,
        peers: impl IntoIterator<Item = usize>,
    ) -> Result<Self, FdPassError> {
        let (rank, window) = (listener.rank, listener.window);
        let io = |what, source| FdPassError::Io {
            rank,
            window,
            what,
            source,
        };
        let mut p = [0 as libc::c_int; 2];
        // SAFETY: `p` has room for the two descriptors.
        cvt(unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) })
            .map_err(|e| io("creating the stop pipe", e))?;
        // SAFETY: two new descriptors this function owns.
        let (rd, wr) = unsafe { (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])) };
        let peers: BTreeSet<usize> = peers.into_iter().filter(|&q| q != rank).collect();
        let deadline = deadline_after(listener.job.timeout);
        let thread = std::thread::Builder::new()
            .name(format!("gin-fd-r{rank}-w{window}"))
            .spawn(move || {
                let r = Server {
                    l: &listener,
                    fd: &fd,
                    peers,
                    pending: Vec::new(),
                    uid: euid(),
                }
                .run(&rd, deadline);
                if let Err(e) = &r {
                    tracing::warn!("{e}");
                }
                r
            })
            .map_err(|e| io("starting the server thread", e))?;
        Ok(Self {
            rank,
            window,
            stop: Some(wr),
            thread: Some(thread),
        })
    }

    /// Waits for the server to end: `Ok` once every peer had the
    /// descriptor, else the error naming those that never came.
    pub fn wait(mut self) -> Result<(), FdPassError> {
        let Some(t) = self.thread.take() else {
            return Ok(());
        };
        t.join().unwrap_or_else(|p| {
            let why = p
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "no message".into());
            Err(FdPassError::ServerPanicked {
                rank: self.rank,
                window: self.window,
                why,
            })
        })
    }
}

impl Drop for FdServer {
    fn drop(&mut self) {
        // Closing the write end wakes the thread's poll.
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A connection accepted from a process that may be a peer's, waiting for
/// its request.
struct Pending {
    conn: OwnedFd,
    /// Who connected.
    cred: PeerCred,
    /// The challenge it was sent.
    nonce: [u8; 16],
    /// When it is dropped if no request came.
    until: Instant,
}

/// What a failed `accept4` means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AcceptFailure {
    /// Try again at once (interrupted, or the connection went before it
    /// was accepted).
    Again,
    /// Nothing left to accept now: the poll says when there is.
    Drained,
    /// Anything else (out of descriptors, ...): the server gives up
    /// rather than spin on it.
    Fatal,
}

impl AcceptFailure {
    fn of(e: &io::Error) -> Self {
        match e.raw_os_error() {
            Some(libc::EINTR | libc::ECONNABORTED) => Self::Again,
            Some(libc::EAGAIN) => Self::Drained,
            _ => Self::Fatal,
        }
    }
}

/// A server thread's state.
struct Server<'a> {
    l: &'a FdListener,
    fd: &'a OwnedFd,
    /// The peers that do not have the descriptor yet.
    peers: BTreeSet<usize>,
    pending: Vec<Pending>,
    /// This process's effective uid.
    uid: u32,
}

impl Server<'_> {
    fn io(&self, what: &'static str, source: io::Error) -> FdPassError {
        FdPassError::Io {
            rank: self.l.rank,
            window: self.l.window,
            what,
            source,
        }
    }

    /// Accepts, answers, until every one of the peers has the descriptor,
    /// `stop` hangs up, or `deadline`. The pending connections are polled
    /// together with the listener: none holds up another.
    fn run(mut self, stop: &OwnedFd, deadline: Instant) -> Result<(), FdPassError> {
        let started = Instant::now();
        while !self.peers.is_empty() {
            let wake = self
                .pending
                .iter()
                .map(|p| p.until)
                .fold(deadline, Instant::min);
            let ready = {
                let mut fds = vec![stop.as_fd(), self.l.sock.as_fd()];
                fds.extend(self.pending.iter().map(|p| p.conn.as_fd()));
                poll_ready(&fds, wake).map_err(|e| self.io("waiting for peers", e))?
            };
            if ready[0] {
                return Ok(());
            }
            // Descending, so that `swap_remove` moves only entries already
            // looked at.
            for i in (0..self.pending.len()).rev() {
                if ready[i + 2] {
                    let p = self.pending.swap_remove(i);
                    self.answer(&p);
                }
            }
            let now = Instant::now();
            self.pending.retain(|p| {
                let keep = p.until > now;
                if !keep {
                    drop_warning(self.l, p.cred, "no request arrived on the connection");
                }
                keep
            });
            if ready[1] {
                self.accept_all()?;
            }
            if !self.peers.is_empty() && Instant::now() >= deadline {
                return Err(FdPassError::NeverFetched {
                    rank: self.l.rank,
                    window: self.l.window,
                    peers: self.peers.into_iter().collect(),
                    waited: started.elapsed(),
                });
            }
        }
        Ok(())
    }

    /// Accepts every connection waiting in the backlog: one from a process
    /// that cannot be a peer's is refused and closed at once, one that may
    /// be is sent a challenge and kept pending.
    fn accept_all(&mut self) -> Result<(), FdPassError> {
        loop {
            // SAFETY: a listening socket; no address is asked for.
            let c = unsafe {
                libc::accept4(
                    self.l.sock.as_raw_fd(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                )
            };
            if c < 0 {
                let e = io::Error::last_os_error();
                match AcceptFailure::of(&e) {
                    AcceptFailure::Again => continue,
                    AcceptFailure::Drained => return Ok(()),
                    AcceptFailure::Fatal => return Err(self.io("accepting a connection", e)),
                }
            }
            // SAFETY: a new descriptor this function owns.
            let conn = unsafe { OwnedFd::from_raw_fd(c) };
            let cred = match peer_cred(conn.as_fd()) {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(
                        rank = self.l.rank,
                        window = self.l.window,
                        "a connection for the descriptor of GPU window {} was dropped: its \
                         credentials cannot be read: {e}",
                        self.l.window
                    );
                    continue;
                }
            };
            if let Some(why) = self.stranger(cred) {
                // Told why (nothing it could use), then closed.
                let _ = send_msg(
                    conn.as_fd(),
                    &reply(self.l.window, self.l.rank, Status::WrongProcess),
                    None,
                );
                drop_warning(self.l, cred, &why);
                continue;
            }
            if self.pending.len() >= MAX_PENDING {
                drop_warning(self.l, cred, "too many connections wait for their request");
                continue;
            }
            let mut nonce = [0u8; 16];
            getrandom::fill(&mut nonce)
                .map_err(|e| self.io("drawing a challenge", io::Error::other(e.to_string())))?;
            let sent = send_msg(
                conn.as_fd(),
                &challenge(self.l.window, self.l.rank, &nonce),
                None,
            );
            if let Err(e) = sent {
                drop_warning(self.l, cred, &format!("sending the challenge: {e}"));
                continue;
            }
            self.pending.push(Pending {
                conn,
                cred,
                nonce,
                until: deadline_after(REQUEST_WAIT),
            });
        }
    }

    /// Why `cred` cannot be the process of any peer still to be served:
    /// another user's, or a pid none of theirs is (where each is known).
    fn stranger(&self, cred: PeerCred) -> Option<String> {
        let mut why = None;
        for &q in &self.peers {
            match cred.mismatch(q, self.uid, self.l.job.pid(q)) {
                None => return None,
                Some(w) => why = why.or(Some(w)),
            }
        }
        Some(why.map_or_else(
            || "no peer is left to serve".into(),
            |w| format!("{w}, nor any other peer's still to be served"),
        ))
    }

    /// Reads `p`'s request and answers it; a request that is not one of
    /// this protocol's gets no answer (the connection closes). Either way
    /// the connection closes after.
    fn answer(&mut self, p: &Pending) {
        match self.status_of(p) {
            Ok((status, requester)) => {
                let attach = (status == Status::Granted).then(|| self.fd.as_fd());
                match send_msg(
                    p.conn.as_fd(),
                    &reply(self.l.window, self.l.rank, status),
                    attach,
                ) {
                    Ok(()) if status == Status::Granted => {
                        self.peers.remove(&requester);
                    }
                    Ok(()) => {}
                    Err(e) => drop_warning(self.l, p.cred, &format!("answering it: {e}")),
                }
            }
            Err(why) => drop_warning(self.l, p.cred, &why),
        }
    }

    /// What `p`'s request gets, and the rank it claims to be; `Err`: no
    /// answer, and why.
    fn status_of(&self, p: &Pending) -> Result<(Status, usize), String> {
        let mut b = [0u8; REQUEST_LEN + 1];
        let (n, long, _) = recv_msg(p.conn.as_fd(), &mut b).map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("the connection closed without a request".into());
        }
        if n != REQUEST_LEN || long || b[..4] != MAGIC {
            return Err(format!(
                "a malformed request ({n} bytes, expected {REQUEST_LEN} starting with GINF)"
            ));
        }
        let (window, exporter, requester) = (u32_at(&b, 4), u32_at(&b, 8), u32_at(&b, 12));
        let claimed = requester as usize;
        // Not a constant-time comparison: the nonce is used once, so no
        // guess at one answer helps with the next.
        let status =
            if b[16..REQUEST_LEN] != self.l.job.answer(&p.nonce, window, exporter, requester) {
                Status::Unauthenticated
            } else if window != self.l.window || exporter as usize != self.l.rank {
                Status::WrongWindow
            } else if !self.peers.contains(&claimed) {
                Status::NotAPeer
            } else if p
                .cred
                .mismatch(claimed, self.uid, self.l.job.pid(claimed))
                .is_some()
            {
                Status::WrongProcess
            } else {
                Status::Granted
            };
        Ok((status, claimed))
    }
}

/// Warns that a connection from `cred` to `l`'s socket was dropped, and
/// why.
fn drop_warning(l: &FdListener, cred: PeerCred, why: &str) {
    tracing::warn!(
        rank = l.rank,
        window = l.window,
        "a connection for the descriptor of GPU window {}, from {cred}, was dropped: {why}",
        l.window
    );
}

/// Fetches window `window`'s descriptor from rank `exporter` (this is rank
/// `rank`), waiting at most the job's timeout. The listening process must
/// be the exporter's (this user's, and the exporter's pid where the job
/// knows it) before anything is sent to it.
pub fn fetch(
    job: &FdJob,
    rank: usize,
    window: u32,
    exporter: usize,
) -> Result<OwnedFd, FdPassError> {
    let started = Instant::now();
    let deadline = deadline_after(job.timeout);
    let io = |what, source| FdPassError::Fetch {
        rank,
        peer: exporter,
        window,
        what,
        source,
    };
    let gone = |why: String| FdPassError::Gone {
        rank,
        peer: exporter,
        window,
        why,
    };
    let timeout = || FdPassError::Timeout {
        rank,
        peer: exporter,
        window,
        waited: started.elapsed(),
    };
    let name = job.socket_name(window, exporter);
    let sock = seqpacket(false).map_err(|e| io("creating a Unix socket", e))?;
    send_timeout(sock.as_fd(), job.timeout).map_err(|e| io("setting the send timeout", e))?;
    let (addr, len) = abstract_addr(&name).map_err(|e| io("naming the socket", e))?;
    // SAFETY: `addr` is a sockaddr_un of which `len` bytes are used.
    if let Err(e) = cvt(unsafe { libc::connect(sock.as_raw_fd(), (&raw const addr).cast(), len) }) {
        return Err(match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => timeout(),
            // (Abstract sockets are per network namespace: a same-host
            // peer in another one cannot be reached this way.)
            _ => gone(format!(
                "nobody listens on @{name} ({e}; a rank in another network namespace cannot be \
                 reached either)"
            )),
        });
    }
    let cred = peer_cred(sock.as_fd()).map_err(|e| io("reading the listener's credentials", e))?;
    if let Some(why) = cred.mismatch(exporter, euid(), job.pid(exporter)) {
        return Err(FdPassError::Impostor {
            rank,
            peer: exporter,
            window,
            cred,
            why,
        });
    }
    let exchange = Exchange {
        sock: sock.as_fd(),
        exporter,
        window,
        deadline,
    };
    let nonce = exchange
        .challenge()
        .map_err(|e| e.into_error(rank, exporter, window, started))?;
    send_msg(
        sock.as_fd(),
        &request(job, &nonce, window, exporter, rank),
        None,
    )
    .map_err(|e| gone(format!("sending the request: {e}")))?;
    exchange
        .grant()
        .map_err(|e| e.into_error(rank, exporter, window, started))
}

/// How a step of a fetch failed, before the names are added.
enum Step {
    Timeout,
    Gone(String),
    Malformed(String),
    Refused(u32),
    Io(&'static str, io::Error),
}

impl Step {
    fn into_error(self, rank: usize, peer: usize, window: u32, started: Instant) -> FdPassError {
        match self {
            Self::Timeout => FdPassError::Timeout {
                rank,
                peer,
                window,
                waited: started.elapsed(),
            },
            Self::Gone(why) => FdPassError::Gone {
                rank,
                peer,
                window,
                why,
            },
            Self::Malformed(why) => FdPassError::Malformed {
                rank,
                peer,
                window,
                why,
            },
            Self::Refused(status) => FdPassError::Refused {
                rank,
                peer,
                window,
                status,
                why: Status::why(status),
            },
            Self::Io(what, source) => FdPassError::Fetch {
                rank,
                peer,
                window,
                what,
                source,
            },
        }
    }
}

/// A fetch's connection to its exporter, checked.
struct Exchange<'a> {
    sock: BorrowedFd<'a>,
    exporter: usize,
    window: u32,
    deadline: Instant,
}

impl Exchange<'_> {
    /// The next message, into `b`: its length, whether it was longer, the
    /// descriptor it carried.
    fn next(&self, b: &mut [u8]) -> Result<(usize, bool, Option<OwnedFd>), Step> {
        if poll_in(&[self.sock], self.deadline)
            .map_err(|e| Step::Io("waiting for the answer", e))?
            .is_none()
        {
            return Err(Step::Timeout);
        }
        let r =
            recv_msg(self.sock, b).map_err(|e| Step::Gone(format!("reading the answer: {e}")))?;
        if r.0 == 0 {
            return Err(Step::Gone(
                "it closed the connection without an answer".into(),
            ));
        }
        Ok(r)
    }

    /// Whether `b` names this window and exporter.
    fn names_this(&self, b: &[u8]) -> Result<(), Step> {
        if u32_at(b, 4) != self.window || u32_at(b, 8) as usize != self.exporter {
            return Err(Step::Malformed(format!(
                "it answered for window {} of rank {}",
                u32_at(b, 4),
                u32_at(b, 8)
            )));
        }
        Ok(())
    }

    /// The exporter's challenge's nonce (or its refusal).
    fn challenge(&self) -> Result<[u8; 16], Step> {
        let mut b = [0u8; CHALLENGE_LEN + 1];
        let (n, long, _) = self.next(&mut b)?;
        if n == REPLY_LEN && !long && b[..4] == MAGIC {
            self.names_this(&b)?;
            return Err(match u32_at(&b, 12) {
                0 => Step::Malformed("a grant before any request".into()),
                code => Step::Refused(code),
            });
        }
        if n != CHALLENGE_LEN || long || b[..4] != CHALLENGE_MAGIC {
            return Err(Step::Malformed(format!(
                "{n} bytes{}, expected a {CHALLENGE_LEN}-byte challenge starting with GINC",
                if long { " or more" } else { "" }
            )));
        }
        self.names_this(&b)?;
        let mut nonce = [0u8; 16];
        nonce.copy_from_slice(&b[12..CHALLENGE_LEN]);
        Ok(nonce)
    }

    /// The exporter's reply to the request: the descriptor, or why not.
    fn grant(&self) -> Result<OwnedFd, Step> {
        let mut b = [0u8; REPLY_LEN + 1];
        let (n, long, fd) = self.next(&mut b)?;
        if n != REPLY_LEN || long || b[..4] != MAGIC {
            return Err(Step::Malformed(format!(
                "{n} bytes{}, expected {REPLY_LEN} starting with GINF",
                if long { " or more" } else { "" }
            )));
        }
        self.names_this(&b)?;
        match (u32_at(&b, 12), fd) {
            (0, Some(fd)) => Ok(fd),
            (0, None) => Err(Step::Malformed("no descriptor came with it".into())),
            (code, _) => Err(Step::Refused(code)),
        }
    }
}

#[cfg(test)]
#[path = "fdpass_tests.rs"]
mod tests;
