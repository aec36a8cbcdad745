//! The initiating side of the tcp transport: one [`Link`] per peer, one
//! ordered connection to that peer's server, a thread that reads its
//! replies, and a sticky error state entered at the first failure.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use super::SLICE;
use super::wire::{
    CHUNK, FLAG_SIGNAL, MAX_ERROR, OP_CAS, OP_FADD, OP_FENCE, OP_GET, OP_PUT, REP, REP_ACK,
    REP_DATA, REP_ERROR, REP_VALUE, REQ, Reply, Req, hello,
};
use crate::NetError;
use crate::sticky::StickyError;
use crate::transport::{Alive, Blame};
use crate::window::KeepAlive;

/// Replies carry a 32-bit length: larger reads go as several requests.
const PIECE: u64 = 1 << 30;

/// How long a request past its deadline still waits for an answer before
/// the peer is blamed (see `Link::call`).
const LATE_ANSWER: Duration = Duration::from_millis(100);

/// The job-health check shared by a transport's links, and where they
/// report a peer that did not answer for the whole timeout (each set once).
#[derive(Default)]
pub(super) struct Watch {
    pub(super) alive: OnceLock<Alive>,
    pub(super) blame: OnceLock<Blame>,
}

impl Watch {
    fn check(&self) -> Result<(), String> {
        self.alive.get().map_or(Ok(()), |f| f())
    }

    /// A peer's server thread drains its connection and answers requests
    /// whatever its rank thread is doing: one silent for the link's whole
    /// timeout belongs to a process that stopped (or a host that froze), so
    /// the job hears of it (see [`Blame`]).
    fn blame(&self, peer: usize, why: &str) {
        if let Some(f) = self.blame.get() {
            f(peer, why);
        }
    }
}

impl std::fmt::Debug for Watch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watch")
            .field("alive", &self.alive.get().is_some())
            .field("blame", &self.blame.get().is_some())
            .finish()
    }
}

/// Why a link failed: the first cause, and whether it was the target
/// refusing a request (rather than the connection breaking).
#[derive(Debug, Clone)]
struct Failure {
    why: String,
    refused: bool,
}

/// A connection to one peer's server.
#[derive(Debug)]
pub struct Link {
    rank: usize,
    peer: usize,
    w: Mutex<TcpStream>,
    /// Another handle on the same socket: shutting it down wakes a sender
    /// blocked in a write without waiting for the lock that sender holds.
    pub(super) ctl: TcpStream,
    /// How long a send may go without the peer accepting a byte.
    timeout: Duration,
    watch: Arc<Watch>,
    /// Puts written to the socket.
    seq: AtomicU64,
    /// Puts the target has confirmed executing (see [`Link::confirm`]).
    confirmed: AtomicU64,
    next_req: AtomicU64,
    pending: Mutex<HashMap<u64, Pending>>,
    error: StickyError<Failure>,
    closing: Arc<AtomicBool>,
}

/// Where a read's answer lands while nobody may have stopped waiting: the
/// reader copies each chunk under the lock, and the waiter empties it
/// before it returns, so nothing writes the destination after that.
type Slot = Arc<Mutex<Option<usize>>>;

#[derive(Debug)]
enum Pending {
    /// A get: copy the reply to `dst` and decrement `done`.
    Read {
        dst: usize,
        len: u64,
        done: Arc<AtomicU64>,
        /// Keeps `dst` mapped until the reply has landed or the read
        /// failed: dropped with this entry, after `done` is released.
        _keep: Option<KeepAlive>,
    },
    /// A blocking read: copy the reply into the slot's buffer, if it is
    /// still there, then tell the waiter.
    Fill {
        slot: Slot,
        len: u64,
        tx: mpsc::SyncSender<Result<(), String>>,
    },
    /// A fetch-add, compare-swap or fence: send the value back.
    Value(mpsc::SyncSender<Result<u64, String>>),
}

impl Pending {
    /// Tells whoever waits for this request that it failed.
    fn release(self, why: &str) {
        match self {
            Self::Read { done, .. } => {
                done.fetch_sub(1, Ordering::AcqRel);
            }
            Self::Fill { tx, .. } => {
                let _ = tx.send(Err(why.into()));
            }
            Self::Value(tx) => {
                let _ = tx.send(Err(why.into()));
            }
        }
    }
}

/// How a reply reader's loop ended: why, and whether the connection simply
/// closed (the peer exited or died).
type End = (String, bool);

impl Link {
    pub(super) fn connect(
        rank: usize,
        peer: usize,
        addr: SocketAddr,
        token: &[u8; 32],
        closing: Arc<AtomicBool>,
        timeout: Duration,
        watch: Arc<Watch>,
    ) -> Result<Arc<Self>, NetError> {
        let io = |what: String| move |e| NetError::Io { what, source: e };
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(30)).map_err(io(
            format!("connecting to rank {peer}'s transport at {addr}"),
        ))?;
        s.set_nodelay(true)
            .map_err(io("setting TCP_NODELAY".into()))?;
        s.write_all(&hello(token, rank))
            .map_err(io(format!("greeting rank {peer}")))?;
        // Writes wake every slice to check their deadline (see `write_all`).
        s.set_write_timeout(Some(SLICE.min(timeout).max(Duration::from_millis(1))))
            .map_err(io("setting a write timeout".into()))?;
        let r = s.try_clone().map_err(io("cloning a socket".into()))?;
        let ctl = s.try_clone().map_err(io("cloning a socket".into()))?;
        let link = Arc::new(Self {
            rank,
            peer,
            w: Mutex::new(s),
            ctl,
            timeout,
            watch,
            seq: AtomicU64::new(0),
            confirmed: AtomicU64::new(0),
            next_req: AtomicU64::new(1),
            pending: Mutex::new(HashMap::new()),
            error: StickyError::default(),
            closing,
        });
        let l = link.clone();
        thread::Builder::new()
            .name(format!("gin-tcp-reply-{rank}"))
            .spawn(move || l.read_replies(r))
            .map_err(io("spawning a reply reader".into()))?;
        Ok(link)
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Pending>> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn fail(&self, why: String) {
        self.fail_as(why, false, true);
    }

    /// Records the link's error (`refused`: the target refused a request;
    /// `loud`: also log it as a warning) and releases every waiter.
    fn fail_as(&self, why: String, refused: bool, loud: bool) {
        let first = self.error.set(Failure {
            why: why.clone(),
            refused,
        });
        if first {
            if loud {
                warn!(rank = self.rank, peer = self.peer, %why, "tcp transport error");
            } else {
                debug!(rank = self.rank, peer = self.peer, %why, "tcp transport closed");
            }
        }
        // Nothing pending will be answered now: release every waiter.
        let pending: Vec<Pending> = self.pending().drain().map(|(_, p)| p).collect();
        for p in pending {
            p.release(&why);
        }
    }

    fn read_replies(&self, mut r: TcpStream) {
        let mut buf = vec![0u8; CHUNK];
        let (why, eof) = loop {
            if let Err(end) = self.next_reply(&mut r, &mut buf) {
                break end;
            }
        };
        if !self.closing.load(Ordering::SeqCst) {
            // A peer that exits closes its server's connections; with
            // nothing asked of it, that is news for whoever uses the link
            // next (it gets this error), not a warning at every job's end.
            let idle = self.pending().is_empty();
            self.fail_as(why, false, !(eof && idle));
        }
    }

    /// Reads and handles one reply.
    fn next_reply(&self, r: &mut TcpStream, buf: &mut [u8]) -> Result<(), End> {
        let mut h = [0u8; REP];
        if let Err(e) = r.read_exact(&mut h) {
            let eof = e.kind() == std::io::ErrorKind::UnexpectedEof;
            let why = if eof {
                format!(
                    "lost the connection to rank {}'s transport (that rank exited, died or became unreachable)",
                    self.peer
                )
            } else {
                format!("reading from rank {}'s transport: {e}", self.peer)
            };
            return Err((why, eof));
        }
        let rep = Reply::decode(&h);
        let p = self.pending().remove(&rep.req);
        match rep.kind {
            REP_DATA => self.on_data(r, buf, &rep, p).map_err(|w| (w, false)),
            REP_VALUE | REP_ACK => {
                if let Some(Pending::Value(tx)) = p {
                    let _ = tx.send(Ok(rep.value));
                }
                Ok(())
            }
            REP_ERROR => self.on_error(r, &rep, p).map_err(|w| (w, false)),
            other => Err((
                format!("rank {} sent an unknown reply kind {other}", self.peer),
                false,
            )),
        }
    }

    /// A get's data: lands it where the get asked, then releases the waiter.
    fn on_data(
        &self,
        r: &mut TcpStream,
        buf: &mut [u8],
        rep: &Reply,
        p: Option<Pending>,
    ) -> Result<(), String> {
        let len = rep.len as usize;
        let Some(p @ (Pending::Read { len: want, .. } | Pending::Fill { len: want, .. })) = p
        else {
            return Err(format!(
                "rank {} answered unknown get {}",
                self.peer, rep.req
            ));
        };
        if want != len as u64 {
            let why = format!(
                "rank {} answered get {} with {len} bytes, not {want}",
                self.peer, rep.req
            );
            // The error first, then release the waiter: a flush that sees
            // the get done also sees the failure.
            self.fail(why.clone());
            p.release(&why);
            return Err(why);
        }
        let mut at = 0;
        while at < len {
            let n = (len - at).min(CHUNK);
            if let Err(e) = r.read_exact(&mut buf[..n]) {
                let why = format!("reading get data from rank {}: {e}", self.peer);
                self.fail(why.clone());
                p.release(&why);
                return Err(why);
            }
            land(&p, at, &buf[..n]);
            at += n;
        }
        match p {
            Pending::Read { done, .. } => {
                done.fetch_sub(1, Ordering::AcqRel);
            }
            Pending::Fill { tx, .. } => {
                let _ = tx.send(Ok(()));
            }
            Pending::Value(_) => {}
        }
        Ok(())
    }

    /// A refusal: the link enters its error state, then the waiter (if the
    /// refused request has one) hears of it.
    fn on_error(&self, r: &mut TcpStream, rep: &Reply, p: Option<Pending>) -> Result<(), String> {
        let mut m = vec![0u8; (rep.len as usize).min(MAX_ERROR)];
        if r.read_exact(&mut m).is_err() {
            return Err(format!(
                "rank {}'s transport sent a truncated error",
                self.peer
            ));
        }
        let msg = format!(
            "rank {} refused: {}",
            self.peer,
            String::from_utf8_lossy(&m)
        );
        // Refusals are sticky (the link is in its error state from now on):
        // record that before answering the waiter, so the waiter's next
        // request is refused here, not sent.
        self.fail_as(msg.clone(), true, true);
        if let Some(p) = p {
            p.release(&msg);
        }
        Ok(())
    }

    /// The first error this link saw, if any.
    pub fn check(&self) -> Result<(), NetError> {
        match self.error.get() {
            Some(f) if f.refused => Err(NetError::Refused {
                peer: self.peer,
                why: f.why,
                window: None,
            }),
            Some(f) => Err(NetError::Broken {
                peer: self.peer,
                why: f.why,
            }),
            None => Ok(()),
        }
    }

    /// The error to report for a request that failed with `why`: the
    /// link's first error (set before any waiter is released), else `why`.
    fn failure(&self, why: String) -> NetError {
        match self.check() {
            Err(e) => e,
            Ok(()) => NetError::Broken {
                peer: self.peer,
                why,
            },
        }
    }

    fn send(&self, h: &Req, data: &[u8]) -> Result<(), NetError> {
        self.check()?;
        let mut w = self.w.lock().unwrap_or_else(PoisonError::into_inner);
        // A sender that waited for the lock behind one that failed must not
        // write into a stream left out of step.
        self.check()?;
        let r = if data.len() <= 4096 {
            let mut one = Vec::with_capacity(REQ + data.len());
            one.extend_from_slice(&h.encode());
            one.extend_from_slice(data);
            self.write_all(&mut w, &one)
        } else {
            self.write_all(&mut w, &h.encode())
                .and_then(|()| self.write_all(&mut w, data))
        };
        drop(w);
        r.map_err(|(why, e)| {
            // Part of a request may have gone out: the stream is out of step
            // for good. Fail the link, and shut the socket so its reader and
            // the peer's server see the end too.
            self.fail(why);
            let _ = self.ctl.shutdown(std::net::Shutdown::Both);
            e
        })
    }

    /// Writes all of `buf`, failing once the peer accepted no byte for the
    /// link's timeout, when the job's watch reports a failure, or when the
    /// transport is closing. The error: the link's sticky reason and what to
    /// return.
    fn write_all(&self, w: &mut TcpStream, mut buf: &[u8]) -> Result<(), (String, NetError)> {
        let peer = self.peer;
        let broken = |why: String| {
            (
                why.clone(),
                NetError::Broken {
                    peer,
                    why: why.clone(),
                },
            )
        };
        let mut progress = Instant::now();
        while !buf.is_empty() {
            match w.write(buf) {
                Ok(0) => return Err(broken(format!("sending to rank {peer}: connection closed"))),
                Ok(n) => {
                    buf = &buf[n..];
                    progress = Instant::now();
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    if self.closing.load(Ordering::SeqCst) {
                        return Err(broken(format!(
                            "sending to rank {peer}: the transport is closing"
                        )));
                    }
                    if let Err(cause) = self.watch.check() {
                        return Err(broken(format!(
                            "gave up sending to rank {peer}, which stopped draining its connection: {cause}"
                        )));
                    }
                    let waited = progress.elapsed();
                    if waited >= self.timeout {
                        let what = format!(
                            "rank {peer} to drain its transport connection (it accepted no byte: stopped, frozen or overloaded)"
                        );
                        self.watch.blame(
                            peer,
                            &format!(
                                "rank {} could not send to it for {waited:.1?}: its transport connection accepted no byte",
                                self.rank
                            ),
                        );
                        return Err((
                            format!("timed out after {waited:.1?} waiting for {what}"),
                            NetError::Timeout { peer, what, waited },
                        ));
                    }
                }
                Err(e) => return Err(broken(format!("sending to rank {peer}: {e}"))),
            }
        }
        Ok(())
    }

    /// Writes `data` to `(key, off)` at the peer, then (optionally) adds
    /// `sig.2` to the 8-byte slot at `(sig.0, sig.1)`. Complete locally on
    /// return: `data` may be reused.
    pub fn put(
        &self,
        key: u32,
        off: u64,
        data: &[u8],
        sig: Option<(u32, u64, u64)>,
    ) -> Result<(), NetError> {
        let (flags, sig_key, sig_off, a) =
            sig.map_or((0, 0, 0, 0), |(k, o, v)| (FLAG_SIGNAL, k, o, v));
        self.send(
            &Req {
                op: OP_PUT,
                flags,
                key,
                off,
                len: data.len() as u64,
                sig_key,
                sig_off,
                a,
                ..Req::default()
            },
            data,
        )?;
        // Counted once written: a later `confirm` that reads the count
        // sends its fence after this put in the stream.
        self.seq.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// Returns once the target has executed every put written on this link
    /// so far, or with the first refusal of any of them (then the link is
    /// failed): a put's data and signal either both landed or neither did
    /// and this says so. One round trip when puts were written since the
    /// last confirmation, none otherwise.
    pub fn confirm(&self, timeout: Duration) -> Result<(), NetError> {
        self.check()?;
        let upto = self.seq.load(Ordering::Acquire);
        if self.confirmed.load(Ordering::Acquire) >= upto {
            return Ok(());
        }
        // Answers come in order: a refusal of an earlier put fails the link
        // (and this fence's waiter) before the fence's own answer.
        self.fence(timeout)?;
        self.check()?;
        self.confirmed.fetch_max(upto, Ordering::AcqRel);
        Ok(())
    }

    /// Starts a read of `len` bytes at `(key, off)` into `dst`; `done` is
    /// decremented when the data has landed (or the read failed: see
    /// [`Link::check`]). The caller increments `done` before calling.
    /// `keep`, if any, is held until the reply has landed or the read has
    /// failed, whether or not anyone still waits for `done`.
    ///
    /// # Safety
    /// `dst` must stay valid for writes of `len` bytes until `done` drops,
    /// or, if the caller may stop waiting before that (a timeout), for as
    /// long as `keep` lives.
    pub unsafe fn get(
        &self,
        key: u32,
        off: u64,
        len: u64,
        dst: *mut u8,
        done: Arc<AtomicU64>,
        keep: Option<KeepAlive>,
    ) -> Result<(), NetError> {
        // Large reads go as several requests, each releasing `done` once.
        let pieces = len.div_ceil(PIECE).max(1);
        done.fetch_add(pieces - 1, Ordering::AcqRel);
        for i in 0..pieces {
            let at = i * PIECE;
            let n = (len - at).min(PIECE);
            let read = Pending::Read {
                dst: dst as usize + at as usize,
                len: n,
                done: done.clone(),
                _keep: keep.clone(),
            };
            if let Err(e) = self.request_read(key, off + at, n, read) {
                // This piece and the ones never sent will not be answered.
                let unsent = pieces - i - 1;
                done.fetch_sub(unsent + u64::from(e.1), Ordering::AcqRel);
                return Err(e.0);
            }
        }
        Ok(())
    }

    /// Sends a get whose answer `p` lands. On failure: the error, and
    /// whether `p` was still pending (so nobody else released it).
    fn request_read(
        &self,
        key: u32,
        off: u64,
        len: u64,
        p: Pending,
    ) -> Result<u64, (NetError, bool)> {
        let req = self.next_req.fetch_add(1, Ordering::Relaxed);
        self.pending().insert(req, p);
        let h = Req {
            op: OP_GET,
            key,
            off,
            len,
            req,
            ..Req::default()
        };
        match self.send(&h, &[]) {
            Ok(()) => Ok(req),
            Err(e) => {
                let mine = self.pending().remove(&req).is_some();
                Err((e, mine))
            }
        }
    }

    /// Reads `out.len()` bytes at `(key, off)` into `out` and returns once
    /// they landed, or with the link's error, or after `timeout`. Nothing
    /// writes `out` after this returns: a late answer is dropped.
    pub fn read(
        &self,
        key: u32,
        off: u64,
        out: &mut [u8],
        timeout: Duration,
    ) -> Result<(), NetError> {
        let until = Instant::now() + timeout;
        for (i, piece) in out.chunks_mut(PIECE as usize).enumerate() {
            self.read_piece(key, off + i as u64 * PIECE, piece, until)?;
        }
        Ok(())
    }

    fn read_piece(
        &self,
        key: u32,
        off: u64,
        out: &mut [u8],
        until: Instant,
    ) -> Result<(), NetError> {
        let len = out.len() as u64;
        let start = Instant::now();
        let slot: Slot = Arc::new(Mutex::new(Some(out.as_mut_ptr() as usize)));
        let (tx, rx) = mpsc::sync_channel(1);
        let fill = Pending::Fill {
            slot: slot.clone(),
            len,
            tx,
        };
        let r = self
            .request_read(key, off, len, fill)
            .map_err(|(e, _)| e)
            .map(|req| {
                (
                    req,
                    rx.recv_timeout(until.saturating_duration_since(Instant::now()))
                        .or_else(|_| rx.recv_timeout(LATE_ANSWER)),
                )
            });
        // Whatever happened, nothing writes `out` once this is done: the
        // reader copies under the slot's lock and finds it empty from now.
        *slot.lock().unwrap_or_else(PoisonError::into_inner) = None;
        match r? {
            (_, Ok(Ok(()))) => Ok(()),
            (_, Ok(Err(why))) => Err(self.failure(why)),
            (req, Err(_)) => Err(self.unanswered(
                format!("the answer to get {req} ({len} bytes at offset {off} of key {key:#010x})"),
                start.elapsed(),
            )),
        }
    }

    /// The timeout of a request `peer` left unanswered for `waited`; one
    /// silent for the link's whole timeout is reported to the job (see
    /// [`Watch::blame`]). A caller's shorter deadline blames nobody.
    fn unanswered(&self, what: String, waited: Duration) -> NetError {
        if waited >= self.timeout {
            self.watch.blame(
                self.peer,
                &format!(
                    "rank {} had no answer from it for {waited:.1?} ({what})",
                    self.rank
                ),
            );
        }
        NetError::Timeout {
            peer: self.peer,
            what,
            waited,
        }
    }

    fn call(&self, mut h: Req, timeout: Duration) -> Result<u64, NetError> {
        let req = self.next_req.fetch_add(1, Ordering::Relaxed);
        h.req = req;
        let (tx, rx) = mpsc::sync_channel(1);
        self.pending().insert(req, Pending::Value(tx));
        if let Err(e) = self.send(&h, &[]) {
            self.pending().remove(&req);
            return Err(e);
        }
        // A short second look after the deadline: had this rank itself
        // been stopped past it, the answer that arrived meanwhile is still
        // being filed by its reader thread, and the peer is not to blame.
        match rx
            .recv_timeout(timeout)
            .or_else(|_| rx.recv_timeout(LATE_ANSWER))
        {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(why)) => Err(self.failure(why)),
            Err(_) => Err(self.unanswered(format!("the answer to request {req}"), timeout)),
        }
    }

    /// Atomic fetch-add at the peer; returns the old value.
    pub fn fetch_add(
        &self,
        key: u32,
        off: u64,
        v: u64,
        timeout: Duration,
    ) -> Result<u64, NetError> {
        self.call(
            Req {
                op: OP_FADD,
                key,
                off,
                a: v,
                ..Req::default()
            },
            timeout,
        )
    }

    /// Atomic compare-and-swap at the peer; returns the old value.
    pub fn compare_swap(
        &self,
        key: u32,
        off: u64,
        expected: u64,
        desired: u64,
        timeout: Duration,
    ) -> Result<u64, NetError> {
        self.call(
            Req {
                op: OP_CAS,
                key,
                off,
                a: expected,
                b: desired,
                ..Req::default()
            },
            timeout,
        )
    }

    /// Returns once every earlier request on this link was executed remotely.
    pub fn fence(&self, timeout: Duration) -> Result<(), NetError> {
        self.call(
            Req {
                op: OP_FENCE,
                ..Req::default()
            },
            timeout,
        )
        .map(drop)
    }

    /// The peer this link reaches.
    pub fn peer(&self) -> usize {
        self.peer
    }

    /// Puts written so far (for tests that watch a sender's progress).
    #[cfg(test)]
    fn sent(&self) -> u64 {
        self.seq.load(Ordering::Relaxed)
    }
}

/// Copies a chunk of a get's answer, at byte `at` of the answer, to where
/// the get asked.
fn land(p: &Pending, at: usize, chunk: &[u8]) {
    match p {
        // SAFETY: the issuer of the get promised `dst` valid for `len`
        // bytes until `done` is decremented (or while `_keep` lives, which
        // this entry holds); `at + chunk.len()` is within `len`.
        Pending::Read { dst, .. } => unsafe {
            std::ptr::copy_nonoverlapping(chunk.as_ptr(), (*dst as *mut u8).add(at), chunk.len());
        },
        Pending::Fill { slot, .. } => {
            let g = slot.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(dst) = *g {
                // SAFETY: the slot still holds the waiter's buffer of `len`
                // bytes: the waiter empties it (under this lock) before it
                // returns, and `at + chunk.len()` is within `len`.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        chunk.as_ptr(),
                        (dst as *mut u8).add(at),
                        chunk.len(),
                    );
                }
            }
        }
        Pending::Value(_) => {}
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

    use super::*;
    use crate::tcp::TcpTransport;
    use std::net::TcpListener;

    /// A link from rank 0 to "rank 1": a listener that accepts the
    /// connection and never reads it (a stopped peer, as far as the sender
    /// can tell). Returns the link, the transport that owns it, and the
    /// accepted socket (kept open, never read).
    fn link_to_a_silent_peer(timeout: Duration) -> (Arc<Link>, TcpTransport, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let closing = Arc::new(AtomicBool::new(false));
        let watch = Arc::new(Watch::default());
        let link = Link::connect(
            0,
            1,
            l.local_addr().unwrap(),
            &[7; 32],
            closing.clone(),
            timeout,
            watch.clone(),
        )
        .unwrap();
        let (silent, _) = l.accept().unwrap();
        let t = TcpTransport {
            rank: 0,
            links: vec![None, Some(link.clone())],
            closing,
            listen_addr: l.local_addr().unwrap(),
            watch,
        };
        (link, t, silent)
    }

    /// Puts 1 MiB at a time until one fails; the error and when it came.
    fn put_until_refused(link: Arc<Link>) -> mpsc::Receiver<(String, Instant)> {
        let (tx, rx) = mpsc::channel();
        thread::spawn(move || {
            let data = vec![0u8; 1 << 20];
            let e = loop {
                if let Err(e) = link.put(1, 0, &data, None) {
                    break e;
                }
            };
            let _ = tx.send((e.to_string(), Instant::now()));
        });
        rx
    }

    #[test]
    fn a_send_to_a_peer_that_stopped_reading_fails_within_the_timeout() {
        let timeout = Duration::from_millis(500);
        let (link, _t, _silent) = link_to_a_silent_peer(timeout);
        let start = Instant::now();
        let rx = put_until_refused(link.clone());
        let (e, at) = rx
            .recv_timeout(timeout * 2 + Duration::from_secs(1))
            .expect("the send to a peer that never reads did not return");
        let took = at - start;
        assert!(took < timeout * 2, "failed only after {took:?}: {e}");
        assert!(e.contains("rank 1") && e.contains("timed out"), "{e}");
        // The link stays failed, naming the same cause.
        let again = link.put(1, 0, &[1], None).unwrap_err().to_string();
        assert!(again.contains("drain"), "{again}");
    }

    #[test]
    fn dropping_the_transport_wakes_a_send_blocked_on_a_stopped_peer() {
        // A timeout far longer than the test: only the drop can end the send.
        let (link, t, _silent) = link_to_a_silent_peer(Duration::from_secs(300));
        let rx = put_until_refused(link.clone());
        // Wait until the sender is blocked: the socket's buffers are full
        // once a put has not returned for a while (a bound, not a sync).
        let sent = link.sent();
        let mut last = sent;
        let blocked = loop {
            thread::sleep(SLICE * 4);
            let now = link.sent();
            if now == last {
                break Instant::now();
            }
            last = now;
        };
        let (tx, dropped) = mpsc::channel();
        thread::spawn(move || {
            drop(t);
            let _ = tx.send(());
        });
        dropped
            .recv_timeout(Duration::from_secs(5))
            .expect("dropping the transport waited for the blocked sender");
        let (e, at) = rx
            .recv_timeout(Duration::from_secs(5))
            .expect("the blocked send did not end when the transport was dropped");
        assert!(at - blocked < Duration::from_secs(5), "{e}");
        assert!(e.contains("rank 1"), "{e}");
    }

    #[test]
    fn a_send_blocked_on_a_stopped_peer_ends_when_the_job_hears_of_a_death() {
        let (link, t, _silent) = link_to_a_silent_peer(Duration::from_secs(300));
        let dead = Arc::new(AtomicBool::new(false));
        let d = dead.clone();
        t.watch(move || {
            if d.load(Ordering::SeqCst) {
                Err("rank 2 died".into())
            } else {
                Ok(())
            }
        });
        let rx = put_until_refused(link);
        dead.store(true, Ordering::SeqCst);
        let (e, _) = rx
            .recv_timeout(Duration::from_secs(5))
            .expect("the blocked send ignored the death notice");
        assert!(e.contains("rank 1") && e.contains("rank 2 died"), "{e}");
    }
}
