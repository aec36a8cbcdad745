//! Raw floors, measured in the same job as the gin-rs figures they bound:
//! the same traffic between ranks 0 and 1 without gin-rs. For same-host
//! paths (direct, and proxy or GDAKI over shared memory) the two processes
//! copy into a shared segment and bump a flag; for tcp, a raw TCP stream;
//! for ucx, `ucx_perftest` from the same library ([`crate::ucxfloor`]).
//!
//! Set-up is collective over every rank of the communicator (ranks past 1
//! only join the exchanges), so a benchmark with spectators stays in step.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use gin_core::Comm;
use gin_net::shm::Segment;

use crate::layout::Slots;
use crate::stream::Completion;

/// Which raw floor fits rank 0's path to rank 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FloorKind {
    Shm,
    Tcp,
    /// `ucx_perftest` from the same library ([`crate::ucxfloor`]).
    Ucx,
}

impl FloorKind {
    /// From rank 0's path name for rank 1 (`shm`, `tcp`, ...).
    pub fn for_path(path: &str) -> Self {
        match path {
            "tcp" => Self::Tcp,
            "ucx" => Self::Ucx,
            _ => Self::Shm,
        }
    }
}

/// Bytes before the data halves: eight flags, one per 128-byte line.
const FLAGS: usize = 1024;

/// A shared segment between ranks 0 and 1: flags and one data half per rank.
#[derive(Debug)]
pub struct ShmPair {
    seg: Segment,
    half: usize,
    rank: usize,
    /// How long a wait for the peer may take (`GIN_TIMEOUT`).
    timeout: Duration,
}

impl ShmPair {
    /// Collective: rank 0 creates a segment with two `half`-byte halves,
    /// rank 1 maps it; other ranks get `None`.
    pub fn new(comm: &Comm, half: usize) -> Result<Option<Self>> {
        let r = comm.rank();
        let len = FLAGS + 2 * half;
        let own = if r == 0 {
            static SEQ: AtomicU64 = AtomicU64::new(0);
            let name = format!(
                "gin-floor-{}-{}",
                std::process::id(),
                SEQ.fetch_add(1, Ordering::Relaxed)
            );
            Some(Segment::create(&name, len)?)
        } else {
            None
        };
        let path = own
            .as_ref()
            .map(|s| s.path().to_string_lossy().into_owned())
            .unwrap_or_default();
        let all = comm.bootstrap().allgather(path.as_bytes())?;
        let seg = match (own, r) {
            (Some(s), _) => Some(s),
            (None, 1) => Some(Segment::open(
                std::path::Path::new(std::str::from_utf8(&all[0])?),
                len,
            )?),
            (None, _) => None,
        };
        // Both have mapped it: the name can go.
        comm.bootstrap().barrier()?;
        Ok(seg.map(|mut seg| {
            seg.unlink();
            Self {
                seg,
                half,
                rank: r,
                timeout: comm.timeout(),
            }
        }))
    }

    /// Flag `i` (0..8, taken modulo 8), on its own cache line.
    pub fn flag(&self, i: usize) -> &AtomicU64 {
        let i = i % (FLAGS / 128);
        // SAFETY: the segment is at least FLAGS bytes, mapped for the life of
        // `self`, and page-aligned, so offset i * 128 is 8-byte aligned and in
        // range; the flags are only ever accessed atomically.
        unsafe { &*self.seg.as_ptr().add(i * 128).cast::<AtomicU64>() }
    }

    /// Start of rank `r`'s data half (`half` bytes).
    pub fn half_ptr(&self, r: usize) -> *mut u8 {
        // SAFETY: in range: FLAGS + 2 * half bytes are mapped, r is 0 or 1.
        unsafe { self.seg.as_ptr().add(FLAGS + (r & 1) * self.half) }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
}

/// The raw TCP floor's connection between ranks 0 and 1, as two handles
/// on one socket: what this rank writes and what it reads (a second thread
/// reads while the first writes in bidirectional streams). One connection
/// carries both directions: measured on the 2-core machine, a connection
/// per direction (as gin-rs's transport links a pair) made the 8-byte floor
/// about 1 µs slower and the 64 KiB one no faster.
#[derive(Debug)]
pub struct TcpPair {
    /// What this rank writes to the other.
    tx: TcpStream,
    /// What it reads from the other (the same socket).
    rx: TcpStream,
}

impl TcpPair {
    fn set_nonblocking(&self, on: bool) -> Result<()> {
        // One socket: its flags are shared by both handles.
        self.tx.set_nonblocking(on)?;
        Ok(())
    }
}

/// Collective: the floor's TCP connection between ranks 0 and 1 (no
/// Nagle); other ranks get `None`.
pub fn tcp_pair(comm: &Comm) -> Result<Option<TcpPair>> {
    let r = comm.rank();
    let ip = comm.bootstrap().listen_addr().ip();
    let listener = if r == 1 {
        Some(TcpListener::bind((ip, 0))?)
    } else {
        None
    };
    let addr = listener
        .as_ref()
        .map(|l| l.local_addr().map(|a| a.to_string()))
        .transpose()?
        .unwrap_or_default();
    let all = comm.bootstrap().allgather(addr.as_bytes())?;
    let s = match (listener, r) {
        (Some(l), _) => l.accept()?.0,
        (None, 0) => TcpStream::connect(std::str::from_utf8(&all[1])?)?,
        (None, _) => return Ok(None),
    };
    s.set_nodelay(true)?;
    // A peer that died or stopped fails the floor within the job's timeout
    // instead of blocking it forever.
    s.set_read_timeout(Some(comm.timeout()))?;
    s.set_write_timeout(Some(comm.timeout()))?;
    Ok(Some(TcpPair {
        rx: s.try_clone()?,
        tx: s,
    }))
}

/// Waits for `flag` to reach `target`: spins, then yields between looks.
/// Yielding matters on a machine with as many cores as spinning ranks: a
/// pure spinner that the scheduler preempts for another thread (a proxy
/// waking up, the launcher) stalls the stream for a whole time slice.
/// While yielding it watches the clock and the job: a peer that died or
/// stopped fails the floor within the job's timeout, naming the peer,
/// instead of spinning forever.
fn spin_until(
    flag: &AtomicU64,
    target: u64,
    pair: &ShmPair,
    comm: &Comm,
    what: &str,
) -> Result<()> {
    let mut spins = 0u32;
    let mut since: Option<Instant> = None;
    while flag.load(Ordering::Acquire) < target {
        if spins < 2000 {
            spins += 1;
            std::hint::spin_loop();
            continue;
        }
        std::thread::yield_now();
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(256) {
            let started = *since.get_or_insert_with(Instant::now);
            comm.bootstrap().health()?;
            if started.elapsed() > pair.timeout {
                bail!(
                    "rank {}: the shared-memory floor waited {:?} for rank {} ({what}: flag {} of {target})",
                    pair.rank,
                    pair.timeout,
                    1 - pair.rank,
                    flag.load(Ordering::Acquire)
                );
            }
        }
    }
    Ok(())
}

/// Shared-memory ping-pong between ranks 0 and 1: copy `size` bytes into the
/// other's half, then bump its flag; wait for the answer. At 8 bytes this is
/// a cache-line ping-pong. Returns one half round trip (µs) per timed
/// iteration. Call [`reset_incoming`] on both ranks, then synchronise,
/// before each call.
pub fn shm_pingpong(
    pair: &ShmPair,
    comm: &Comm,
    size: u64,
    warm: usize,
    iters: usize,
) -> Result<Vec<f64>> {
    let r = pair.rank();
    let (to, from) = (pair.flag(1 - r), pair.flag(r));
    let dst = pair.half_ptr(1 - r);
    let src = vec![r as u8; size as usize];
    let mut out = Vec::with_capacity(iters);
    for i in 1..=(warm + iters) as u64 {
        let t = Instant::now();
        if r == 1 {
            spin_until(from, i, pair, comm, "ping")?;
        }
        // SAFETY: `dst` is the peer's half, at least `size` bytes.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, size as usize) };
        to.store(i, Ordering::Release);
        if r == 0 {
            spin_until(from, i, pair, comm, "pong")?;
        }
        if i as usize > warm {
            out.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
        }
    }
    Ok(out)
}

/// Reads exactly `buf.len()` bytes from a non-blocking stream by polling,
/// as gin-rs's fastest TCP path polls (spins, then yields between looks):
/// a blocking `read` would add a sleep and a wake-up per message and make
/// the floor slower than the path it bounds. A peer that stops fails it
/// after `timeout`; a closed stream fails at once.
fn poll_read(s: &mut TcpStream, buf: &mut [u8], timeout: Duration) -> Result<()> {
    let blocking = !is_nonblocking(s);
    let mut got = 0;
    let mut idle = 0u32;
    let mut since: Option<Instant> = None;
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) => bail!("the floor's TCP peer closed the stream"),
            Ok(n) => {
                got += n;
                idle = 0;
                since = None;
            }
            Err(e)
                if blocking && matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) =>
            {
                bail!("the floor's TCP read waited {timeout:?} for its peer")
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                idle = back_off(idle, &mut since, timeout, "read")?;
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Writes all of `buf` to a non-blocking stream, polling while the socket's
/// buffer is full.
fn poll_write(s: &mut TcpStream, buf: &[u8], timeout: Duration) -> Result<()> {
    let blocking = !is_nonblocking(s);
    let mut put = 0;
    let mut idle = 0u32;
    let mut since: Option<Instant> = None;
    while put < buf.len() {
        match s.write(&buf[put..]) {
            Ok(0) => bail!("the floor's TCP peer closed the stream"),
            Ok(n) => {
                put += n;
                idle = 0;
                since = None;
            }
            Err(e)
                if blocking && matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) =>
            {
                bail!("the floor's TCP write waited {timeout:?} for its peer")
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                idle = back_off(idle, &mut since, timeout, "write")?;
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Whether `s` is in non-blocking mode (`O_NONBLOCK`); a stream whose
/// flags cannot be read counts as blocking.
fn is_nonblocking(s: &TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    // SAFETY: F_GETFL on a descriptor this stream owns reads its flags.
    let flags = unsafe { libc::fcntl(s.as_raw_fd(), libc::F_GETFL) };
    flags >= 0 && flags & libc::O_NONBLOCK != 0
}

/// One empty look of a polling loop: spins first, then yields; fails when
/// the loop has been idle for `timeout`.
fn back_off(idle: u32, since: &mut Option<Instant>, timeout: Duration, what: &str) -> Result<u32> {
    if idle < 2000 {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
        if idle.is_multiple_of(256) && since.get_or_insert_with(Instant::now).elapsed() > timeout {
            bail!("the floor's TCP {what} waited {timeout:?} for its peer");
        }
    }
    Ok(idle.wrapping_add(1))
}

/// How a raw TCP floor waits for its socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TcpWait {
    /// Blocking calls: the kernel wakes the thread when data arrives.
    Block,
    /// Non-blocking calls in a loop that spins, then yields (as gin-rs's
    /// fastest TCP path polls).
    Poll,
}

impl TcpWait {
    /// Both, in the order a floor measures them.
    pub const BOTH: [Self; 2] = [Self::Poll, Self::Block];
}

/// A raw TCP ping-pong of `size` bytes between ranks 0 and 1: half round
/// trips, µs, waiting as `wait` says. Neither way is the faster at every
/// size (polling wins small messages, blocking can win large ones on a
/// machine with few cores), so the floor is the faster of the two
/// (see [`tcp_pingpong_floor`]).
pub fn tcp_pingpong(
    s: &mut TcpPair,
    rank: usize,
    size: u64,
    (warm, iters): (usize, usize),
    timeout: Duration,
    wait: TcpWait,
) -> Result<Vec<f64>> {
    s.set_nonblocking(wait == TcpWait::Poll)?;
    let mut buf = vec![rank as u8; size as usize];
    let mut out = Vec::with_capacity(iters);
    for i in 0..warm + iters {
        let t = Instant::now();
        if rank == 0 {
            poll_write(&mut s.tx, &buf, timeout)?;
            poll_read(&mut s.rx, &mut buf, timeout)?;
        } else {
            poll_read(&mut s.rx, &mut buf, timeout)?;
            poll_write(&mut s.tx, &buf, timeout)?;
        }
        if i >= warm {
            out.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
        }
    }
    s.set_nonblocking(false)?;
    Ok(out)
}

/// The raw TCP ping-pong floor: the lower of the blocking and the polling
/// loop's medians, both measured here (µs per half round trip).
pub fn tcp_pingpong_floor(
    s: &mut TcpPair,
    rank: usize,
    size: u64,
    rounds: (usize, usize),
    timeout: Duration,
) -> Result<f64> {
    let mut best = f64::INFINITY;
    for wait in TcpWait::BOTH {
        best = best.min(crate::stats::median(&tcp_pingpong(
            s, rank, size, rounds, timeout, wait,
        )?));
    }
    Ok(best)
}

/// One run of a stream: who sends, how much, and when the receiver is told.
#[derive(Debug, Clone, Copy)]
pub struct Stream {
    pub size: u64,
    /// Messages per window (between flushes).
    pub window: usize,
    /// Windows per run.
    pub windows: usize,
    pub slots: Slots,
    /// Both ranks send (bidirectional) or only rank 0.
    pub bidir: bool,
    /// When the receiver hears about data.
    pub completion: Completion,
}

impl Stream {
    pub fn messages(&self) -> usize {
        self.window * self.windows
    }

    /// Whether rank `r` (0 or 1) sends in this stream.
    pub fn sends(&self, r: usize) -> bool {
        r == 0 || self.bidir
    }

    /// Whether rank `r` (0 or 1) receives in this stream.
    pub fn receives(&self, r: usize) -> bool {
        r == 1 || self.bidir
    }

    /// Signals a receiver counts in one run.
    pub fn signals(&self) -> u64 {
        self.completion.signals(self.window, self.windows)
    }
}

/// The raw shared-memory stream, on rank 0 or 1: messages are copied into
/// the peer's half slot by slot, and a flag is bumped as the completion
/// mode says (per window, per message, once at the end); the receiver waits for the last count, then
/// acknowledges. Returns this rank's elapsed µs.
pub fn shm_stream(pair: &ShmPair, comm: &Comm, st: &Stream, src: &[u8]) -> Result<f64> {
    let r = pair.rank();
    let peer = 1 - r;
    // Flags: 0/1 data counts into rank 0/1; 2/3 acknowledgements into 0/1.
    let dst = pair.half_ptr(peer);
    let size = st.size as usize;
    // Flags 4/5: "ready" into rank 0/1; the clock starts when the receiver is.
    if st.receives(r) {
        pair.flag(4 + peer).fetch_add(1, Ordering::Release);
    }
    if st.sends(r) {
        spin_until(pair.flag(4 + r), 1, pair, comm, "receiver ready")?;
    }
    let t = Instant::now();
    if st.sends(r) {
        let data = pair.flag(peer);
        for k in 0..st.windows {
            for j in 0..st.window {
                let off = st.slots.offset(k * st.window + j) as usize;
                // SAFETY: `off + size` is within one half (Slots keeps every
                // slot inside its buffer, which is what the half holds) and
                // `src` has the same layout.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr().add(off), dst.add(off), size) };
                if st.completion == Completion::PerMessage {
                    data.fetch_add(1, Ordering::Release);
                }
            }
            if st.completion == Completion::PerWindow {
                data.fetch_add(1, Ordering::Release);
            }
        }
        if st.completion == Completion::AtEnd {
            data.fetch_add(1, Ordering::Release);
        }
    }
    if st.receives(r) {
        spin_until(pair.flag(r), st.signals(), pair, comm, "data")?;
        pair.flag(2 + peer).fetch_add(1, Ordering::Release);
    }
    if st.sends(r) {
        spin_until(pair.flag(2 + r), 1, pair, comm, "acknowledgement")?;
    }
    Ok(t.elapsed().as_secs_f64() * 1e6)
}

/// Resets this rank's incoming flags before a run; a barrier must separate
/// this from the peer's first write.
pub fn reset_incoming(pair: &ShmPair) {
    let r = pair.rank();
    for f in [r, 2 + r, 4 + r] {
        pair.flag(f).store(0, Ordering::Relaxed);
    }
}

/// The raw TCP stream, on rank 0 or 1: one `write` of `size` bytes per
/// message; the receiver says it is ready with one byte, reads every
/// message, then acknowledges with one byte. Both sides wait as `wait`
/// says (see [`tcp_pingpong`]); the floor is the faster of the two.
/// Bidirectional streams read on a second thread. Returns elapsed µs.
pub fn tcp_stream(
    s: &mut TcpPair,
    rank: usize,
    st: &Stream,
    src: &[u8],
    timeout: Duration,
    wait: TcpWait,
) -> Result<f64> {
    s.set_nonblocking(wait == TcpWait::Poll)?;
    let size = st.size as usize;
    let total = st.messages() * size;
    let receive = |rx: &mut TcpStream| -> Result<()> {
        let mut buf = vec![0u8; (1 << 20).min(total.max(1))];
        let mut left = total;
        while left > 0 {
            let want = left.min(buf.len());
            poll_read(rx, &mut buf[..want], timeout)?;
            left -= want;
        }
        Ok(())
    };
    // "Ready" first, so that the clock starts when the receiver is.
    if st.receives(rank) {
        poll_write(&mut s.tx, &[2], timeout)?;
    }
    if st.sends(rank) {
        poll_read(&mut s.rx, &mut [0u8], timeout).context("waiting for the floor's receiver")?;
    }
    let t = Instant::now();
    if st.bidir {
        let TcpPair { tx, rx } = &mut *s;
        std::thread::scope(|sc| -> Result<()> {
            let h = sc.spawn(move || receive(rx));
            for m in 0..st.messages() {
                let off = st.slots.offset(m) as usize;
                poll_write(tx, &src[off..off + size], timeout)?;
            }
            h.join()
                .map_err(|_| anyhow::anyhow!("the floor's TCP reader panicked"))??;
            Ok(())
        })?;
        poll_write(&mut s.tx, &[1], timeout)?;
        poll_read(&mut s.rx, &mut [0u8], timeout)?;
    } else if rank == 0 {
        for m in 0..st.messages() {
            let off = st.slots.offset(m) as usize;
            poll_write(&mut s.tx, &src[off..off + size], timeout)?;
        }
        poll_read(&mut s.rx, &mut [0u8], timeout)
            .context("waiting for the floor's acknowledgement")?;
    } else {
        receive(&mut s.rx)?;
        poll_write(&mut s.tx, &[1], timeout)?;
    }
    let us = t.elapsed().as_secs_f64() * 1e6;
    s.set_nonblocking(false)?;
    Ok(us)
}
