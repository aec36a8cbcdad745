//! Handing a file descriptor to the same host's ranks. The exporting rank
//! listens on a Unix domain socket in the abstract namespace, under a name
//! unique to the job, the window and the exporting rank (nothing on the
//! file system to clean up; the name goes when the listener closes). Each
//! same-host peer connects, presents the job's authenticator and receives
//! the descriptor as `SCM_RIGHTS` ancillary data. `SOCK_SEQPACKET` keeps
//! message boundaries, so a short or long message is seen as such.
//!
//! This is how a VMM allocation's POSIX file descriptor
//! (`cuMemExportToShareableHandle`) reaches the peers that map it; nothing
//! here knows CUDA, and the tests pass a memfd. (`pidfd_getfd` is not used:
//! it needs ptrace permission, often denied between sibling processes.)
//!
//! Every wait has a deadline, the job's timeout. A fetch whose exporter has
//! gone fails at once (nobody listens, or the connection closes), one whose
//! exporter never answers fails at the deadline, naming it. A server
//! ([`FdServer`]) stops once every expected peer has the descriptor, when
//! its owner drops it, or at its deadline, naming the peers that never came.

use std::collections::BTreeSet;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use gin_bootstrap::Bootstrap;

/// The first four bytes of every message.
const MAGIC: [u8; 4] = *b"GINF";
/// A request: magic, window (u32 LE), exporter (u32 LE), requester (u32
/// LE), the job's 32-byte authenticator.
pub const REQUEST_LEN: usize = 48;
/// A reply: magic, window, exporter, status (u32 LE each); the descriptor
/// rides along when the status is 0.
pub const REPLY_LEN: usize = 16;
/// How long a server waits for a request on a connection it accepted
/// (peers send theirs at once; a stranger that sends nothing is dropped).
const REQUEST_WAIT: Duration = Duration::from_secs(2);

/// What a server answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    /// The descriptor is attached.
    Granted = 0,
    /// The requester is not one of the peers this descriptor is for.
    NotAPeer = 1,
    /// The authenticator is not this job's.
    Unauthenticated = 2,
    /// The request names another window or exporter.
    WrongWindow = 3,
}

impl Status {
    fn why(code: u32) -> &'static str {
        match code {
            1 => "it does not hand this descriptor to this rank (not a same-host peer there)",
            2 => "the request's authenticator is not this job's",
            3 => "the request named another window or exporting rank",
            _ => "an unknown refusal",
        }
    }
}

/// What names a job's descriptor sockets and authenticates requests, and
/// the job's timeout. Every rank of a job derives the same from its
/// bootstrap ([`FdJob::new`]); other users of the host see the socket
/// names (`/proc/net/unix`) but cannot derive the authenticator.
#[derive(Clone)]
pub struct FdJob {
    tag: [u8; 8],
    auth: [u8; 32],
    timeout: Duration,
}

impl std::fmt::Debug for FdJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FdJob")
            .field("tag", &hex(&self.tag))
            .field("timeout", &self.timeout)
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

impl FdJob {
    /// The job's names and authenticator, from its bootstrap's job tokens;
    /// waits last `timeout` (the job's).
    pub fn new(bootstrap: &Bootstrap, timeout: Duration) -> Self {
        let name = bootstrap.job_token("gin-cuda fd socket names");
        let mut tag = [0u8; 8];
        tag.copy_from_slice(&name[..8]);
        Self::from_tokens(tag, bootstrap.job_token("gin-cuda fd requests"), timeout)
    }

    /// From explicit tokens (tests, or a job with its own secrets).
    pub fn from_tokens(tag: [u8; 8], auth: [u8; 32], timeout: Duration) -> Self {
        Self { tag, auth, timeout }
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
}

/// What passing a descriptor fails with; every message names the rank
/// that saw it, the window and, where one is involved, the peer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FdPassError {
    /// A socket call failed.
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
    #[error("rank {peer} refused rank {rank} the descriptor of GPU window {window}: {why}")]
    Refused {
        /// This rank.
        rank: usize,
        /// The exporting rank.
        peer: usize,
        /// The window.
        window: u32,
        /// Why, as the exporter answered.
        why: &'static str,
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

/// Which of `fds` is readable (or hung up) first, waiting until `until`;
/// `None` at the deadline.
fn poll_in(fds: &[BorrowedFd<'_>], until: Instant) -> io::Result<Option<usize>> {
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
            return Ok(None);
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
        if let Some(i) = p.iter().position(|x| x.revents != 0) {
            return Ok(Some(i));
        }
        for x in &mut p {
            x.revents = 0;
        }
    }
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

/// Sets `SO_SNDTIMEO` on `sock` (what a blocking `connect` to a full
/// backlog waits).
fn send_timeout(sock: BorrowedFd<'_>, t: Duration) -> io::Result<()> {
    let tv = libc::timeval {
        tv_sec: t.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_usec: libc::suseconds_t::from(t.subsec_micros()),
    };
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

/// A request for window `window` of `exporter` by `requester`.
fn request(job: &FdJob, window: u32, exporter: usize, requester: usize) -> [u8; REQUEST_LEN] {
    let mut b = [0u8; REQUEST_LEN];
    b[..4].copy_from_slice(&MAGIC);
    b[4..8].copy_from_slice(&window.to_le_bytes());
    b[8..12].copy_from_slice(&(exporter as u32).to_le_bytes());
    b[12..16].copy_from_slice(&(requester as u32).to_le_bytes());
    b[16..].copy_from_slice(&job.auth);
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
    /// The write end of a pipe the thread polls: closing it stops the
    /// thread.
    stop: Option<OwnedFd>,
    thread: Option<JoinHandle<Result<(), FdPassError>>>,
}

impl FdServer {
    /// Serves `fd` on `listener` to each of `peers` that asks with the
    /// job's authenticator. The descriptor is closed when the server ends.
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
        let deadline = Instant::now() + listener.job.timeout;
        let thread = std::thread::Builder::new()
            .name(format!("gin-fd-r{rank}-w{window}"))
            .spawn(move || {
                let r = serve(&listener, &fd, peers, &rd, deadline);
                if let Err(e) = &r {
                    tracing::warn!("{e}");
                }
                r
            })
            .map_err(|e| io("starting the server thread", e))?;
        Ok(Self {
            stop: Some(wr),
            thread: Some(thread),
        })
    }

    /// Waits for the server to end: `Ok` once every peer had the
    /// descriptor, else the error naming those that never came.
    pub fn wait(mut self) -> Result<(), FdPassError> {
        let t = self.thread.take();
        t.map_or(Ok(()), |t| t.join().unwrap_or(Ok(())))
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

/// The server's loop: accepts, answers, until every one of `peers` has
/// `fd`, `stop` hangs up, or `deadline`.
fn serve(
    l: &FdListener,
    fd: &OwnedFd,
    mut peers: BTreeSet<usize>,
    stop: &OwnedFd,
    deadline: Instant,
) -> Result<(), FdPassError> {
    let started = Instant::now();
    let io = |what, source| FdPassError::Io {
        rank: l.rank,
        window: l.window,
        what,
        source,
    };
    while !peers.is_empty() {
        match poll_in(&[stop.as_fd(), l.sock.as_fd()], deadline)
            .map_err(|e| io("waiting for peers", e))?
        {
            Some(0) => return Ok(()),
            Some(_) => {}
            None => {
                return Err(FdPassError::NeverFetched {
                    rank: l.rank,
                    window: l.window,
                    peers: peers.into_iter().collect(),
                    waited: started.elapsed(),
                });
            }
        }
        // SAFETY: a listening socket; no address is asked for.
        let c = unsafe {
            libc::accept4(
                l.sock.as_raw_fd(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                libc::SOCK_CLOEXEC,
            )
        };
        if c < 0 {
            // The connection went before it was accepted, or a transient
            // failure: the poll says when there is another.
            continue;
        }
        // SAFETY: a new descriptor this function owns.
        let conn = unsafe { OwnedFd::from_raw_fd(c) };
        let until = deadline.min(Instant::now() + REQUEST_WAIT);
        match answer(l, fd, &peers, conn.as_fd(), stop.as_fd(), until) {
            Ok(Some(peer)) => {
                peers.remove(&peer);
            }
            Ok(None) => {}
            Err(why) => tracing::warn!(
                rank = l.rank,
                window = l.window,
                "a request for the descriptor of GPU window {} was dropped: {why}",
                l.window
            ),
        }
    }
    Ok(())
}

/// Reads one request on `conn` and answers it; the peer served, if any.
/// A request that is not one of this protocol's gets no answer (the
/// connection closes).
fn answer(
    l: &FdListener,
    fd: &OwnedFd,
    peers: &BTreeSet<usize>,
    conn: BorrowedFd<'_>,
    stop: BorrowedFd<'_>,
    until: Instant,
) -> Result<Option<usize>, String> {
    match poll_in(&[stop, conn], until).map_err(|e| e.to_string())? {
        Some(1) => {}
        Some(_) => return Ok(None),
        None => return Err("no request arrived on the connection".into()),
    }
    let mut b = [0u8; REQUEST_LEN + 1];
    let (n, long, _) = recv_msg(conn, &mut b).map_err(|e| e.to_string())?;
    if n != REQUEST_LEN || long || b[..4] != MAGIC {
        return Err(format!(
            "a malformed request ({n} bytes, expected {REQUEST_LEN} starting with GINF)"
        ));
    }
    let (window, exporter, requester) = (u32_at(&b, 4), u32_at(&b, 8), u32_at(&b, 12) as usize);
    // Not a constant-time comparison: the authenticator keeps strangers
    // out of a job's memory, and a guess per connection is no timing
    // oracle worth having.
    let status = if b[16..REQUEST_LEN] != l.job.auth {
        Status::Unauthenticated
    } else if window != l.window || exporter as usize != l.rank {
        Status::WrongWindow
    } else if !peers.contains(&requester) {
        Status::NotAPeer
    } else {
        Status::Granted
    };
    let attach = (status == Status::Granted).then(|| fd.as_fd());
    send_msg(conn, &reply(l.window, l.rank, status), attach).map_err(|e| e.to_string())?;
    Ok((status == Status::Granted).then_some(requester))
}

/// Fetches window `window`'s descriptor from rank `exporter` (this is rank
/// `rank`), waiting at most the job's timeout.
pub fn fetch(
    job: &FdJob,
    rank: usize,
    window: u32,
    exporter: usize,
) -> Result<OwnedFd, FdPassError> {
    let started = Instant::now();
    let deadline = started + job.timeout;
    let io = |what, source| FdPassError::Io {
        rank,
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
    send_msg(sock.as_fd(), &request(job, window, exporter, rank), None)
        .map_err(|e| gone(format!("sending the request: {e}")))?;
    if poll_in(&[sock.as_fd()], deadline)
        .map_err(|e| io("waiting for the answer", e))?
        .is_none()
    {
        return Err(timeout());
    }
    let mut b = [0u8; REPLY_LEN + 1];
    let (n, long, fd) =
        recv_msg(sock.as_fd(), &mut b).map_err(|e| gone(format!("reading the answer: {e}")))?;
    let malformed = |why: String| FdPassError::Malformed {
        rank,
        peer: exporter,
        window,
        why,
    };
    if n == 0 {
        return Err(gone("it closed the connection without an answer".into()));
    }
    if n != REPLY_LEN || long || b[..4] != MAGIC {
        return Err(malformed(format!(
            "{n} bytes{}, expected {REPLY_LEN} starting with GINF",
            if long { " or more" } else { "" }
        )));
    }
    if u32_at(&b, 4) != window || u32_at(&b, 8) as usize != exporter {
        return Err(malformed(format!(
            "it answered for window {} of rank {}",
            u32_at(&b, 4),
            u32_at(&b, 8)
        )));
    }
    match (u32_at(&b, 12), fd) {
        (0, Some(fd)) => Ok(fd),
        (0, None) => Err(malformed("no descriptor came with it".into())),
        (code, _) => Err(FdPassError::Refused {
            rank,
            peer: exporter,
            window,
            why: Status::why(code),
        }),
    }
}

#[cfg(test)]
#[path = "fdpass_tests.rs"]
mod tests;
