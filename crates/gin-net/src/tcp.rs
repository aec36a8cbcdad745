//! The TCP transport: one-sided operations to any host.
//!
//! Each rank serves the regions in its [`RegionTable`] to its peers: a thread
//! per incoming connection executes writes, reads and atomics in arrival
//! order, after checking key, rights, bounds and alignment, and answers an
//! error instead of touching memory when a check fails. Because one
//! connection carries everything from one rank to another, in order, a
//! signal sent after data is applied after that data.
//!
//! Requests (64-byte header, little-endian):
//!
//! | offset | field |
//! | --- | --- |
//! | 0 | op: 1 put, 2 get, 3 fetch-add, 4 compare-swap, 5 fence |
//! | 1 | flags: bit 0 = put carries a signal |
//! | 4 | key (u32) |
//! | 8 | offset (u64) |
//! | 16 | length (u64); a put's data follows the header |
//! | 24 | request id (u64; answered ops) |
//! | 32 | signal key (u32) |
//! | 40 | signal offset (u64) |
//! | 48 | a: signal / fetch-add amount, compare-swap expected |
//! | 56 | b: compare-swap desired |
//!
//! Replies (24-byte header): kind (1 data, 2 value, 3 ack, 4 error), payload
//! length (u32 at 4), request id (u64 at 8), value (u64 at 16); then the
//! payload (read data, or an error message). A failed put, which has no
//! request id, is answered with its sequence number on the connection with
//! bit 63 set, so it never matches a pending request.
//!
//! # Deadlines
//!
//! No call blocks forever on a peer that stopped draining its connection (a
//! stopped process, a frozen host): a send writes in slices of at most
//! [`SLICE`] and fails once no byte was accepted for the job's timeout
//! (`GIN_TIMEOUT`), or at once when the job heard of a death (see
//! [`TcpTransport::watch`]) or the transport is closing; the error names the
//! peer. A failed send leaves the stream out of step, so it fails the link
//! (sticky) and shuts the socket down. A server blocked answering an
//! initiator that stopped reading gives up after the same timeout and drops
//! that connection. Dropping the transport shuts every socket down without
//! waiting for a sender blocked in a write: that sender fails at once.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use gin_bootstrap::Bootstrap;
use tracing::{debug, warn};

use crate::NetError;
use crate::fabric::KeepAlive;
use crate::region::{AccessKind, RegionTable};

const REQ: usize = 64;
const REP: usize = 24;
const OP_PUT: u8 = 1;
const OP_GET: u8 = 2;
const OP_FADD: u8 = 3;
const OP_CAS: u8 = 4;
const OP_FENCE: u8 = 5;
const FLAG_SIGNAL: u8 = 1;
const REP_DATA: u8 = 1;
const REP_VALUE: u8 = 2;
const REP_ACK: u8 = 3;
const REP_ERROR: u8 = 4;
/// No request moves more than this (a region is never larger).
const MAX_LEN: u64 = 1 << 40;
const CHUNK: usize = 1 << 20;
const HELLO_MAGIC: u32 = 0x4749_4e54; // "GINT"
/// Refused puts are answered under their sequence number with this bit set,
/// so they never collide with a pending request's id.
const PUT_SEQ: u64 = 1 << 63;
/// A blocked send wakes at least this often to check its deadline, the
/// job's health and whether the transport is closing.
pub const SLICE: Duration = Duration::from_millis(50);

/// A request header.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Req {
    pub op: u8,
    pub flags: u8,
    pub key: u32,
    pub off: u64,
    pub len: u64,
    pub req: u64,
    pub sig_key: u32,
    pub sig_off: u64,
    pub a: u64,
    pub b: u64,
}

impl Req {
    pub fn encode(&self) -> [u8; REQ] {
        let mut b = [0u8; REQ];
        b[0] = self.op;
        b[1] = self.flags;
        b[4..8].copy_from_slice(&self.key.to_le_bytes());
        b[8..16].copy_from_slice(&self.off.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b[24..32].copy_from_slice(&self.req.to_le_bytes());
        b[32..36].copy_from_slice(&self.sig_key.to_le_bytes());
        b[40..48].copy_from_slice(&self.sig_off.to_le_bytes());
        b[48..56].copy_from_slice(&self.a.to_le_bytes());
        b[56..64].copy_from_slice(&self.b.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; REQ]) -> Self {
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Self {
            op: b[0],
            flags: b[1],
            key: u32_at(4),
            off: u64_at(8),
            len: u64_at(16),
            req: u64_at(24),
            sig_key: u32_at(32),
            sig_off: u64_at(40),
            a: u64_at(48),
            b: u64_at(56),
        }
    }
}

fn reply_header(kind: u8, len: u32, req: u64, value: u64) -> [u8; REP] {
    let mut b = [0u8; REP];
    b[0] = kind;
    b[4..8].copy_from_slice(&len.to_le_bytes());
    b[8..16].copy_from_slice(&req.to_le_bytes());
    b[16..24].copy_from_slice(&value.to_le_bytes());
    b
}

/// What a blocked send asks, each [`SLICE`], about the job as a whole: an
/// error (a rank died, the root was lost) ends the send with that cause.
type WatchFn = Box<dyn Fn() -> Result<(), String> + Send + Sync>;

/// The job-health check shared by a transport's links (set once).
#[derive(Default)]
struct Watch(OnceLock<WatchFn>);

impl Watch {
    fn check(&self) -> Result<(), String> {
        self.0.get().map_or(Ok(()), |f| f())
    }
}

impl std::fmt::Debug for Watch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.get().is_some() {
            "Watch(set)"
        } else {
            "Watch(unset)"
        })
    }
}

/// The TCP transport of one rank: its server and its links to peers.
#[derive(Debug)]
pub struct TcpTransport {
    rank: usize,
    links: Vec<Option<Arc<Link>>>,
    closing: Arc<AtomicBool>,
    listen_addr: SocketAddr,
    watch: Arc<Watch>,
}

/// A connection to one peer's server.
#[derive(Debug)]
pub struct Link {
    rank: usize,
    peer: usize,
    w: Mutex<TcpStream>,
    /// Another handle on the same socket: shutting it down wakes a sender
    /// blocked in a write without waiting for the lock that sender holds.
    ctl: TcpStream,
    /// How long a send may go without the peer accepting a byte.
    timeout: Duration,
    watch: Arc<Watch>,
    /// Puts written to the socket.
    seq: AtomicU64,
    /// Puts the target has confirmed executing (see [`Link::confirm`]).
    confirmed: AtomicU64,
    next_req: AtomicU64,
    pending: Mutex<HashMap<u64, Pending>>,
    error: crate::sticky::StickyError,
    closing: Arc<AtomicBool>,
}

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
    /// A fetch-add, compare-swap or fence: send the value back.
    Value(mpsc::SyncSender<Result<u64, String>>),
}

impl TcpTransport {
    /// Starts this rank's server, exchanges addresses through the bootstrap
    /// (a collective: every rank calls it), and connects to each peer in
    /// `peers`. Connections are authenticated with a token derived from the
    /// job secret.
    pub fn start(b: &Bootstrap, table: Arc<RegionTable>, peers: &[bool]) -> Result<Self, NetError> {
        let rank = b.rank();
        let ip = b.listen_addr().ip();
        let listener = TcpListener::bind((ip, 0)).map_err(|e| NetError::Io {
            what: format!("listening for tcp transport on {ip}"),
            source: e,
        })?;
        let listen_addr = listener.local_addr().map_err(|e| NetError::Io {
            what: "reading the transport address".into(),
            source: e,
        })?;
        let token = b.job_token("gin-net tcp v1");
        let timeout = b.config().timeout;
        let closing = Arc::new(AtomicBool::new(false));
        let watch = Arc::new(Watch::default());
        {
            let closing = closing.clone();
            thread::Builder::new()
                .name(format!("gin-tcp-accept-{rank}"))
                .spawn(move || accept(&listener, rank, &token, &table, &closing, timeout))
                .map_err(|e| NetError::Io {
                    what: "spawning the tcp server".into(),
                    source: e,
                })?;
        }
        let addrs = b.allgather(listen_addr.to_string().as_bytes())?;
        let mut links = Vec::with_capacity(b.nranks());
        for (peer, a) in addrs.iter().enumerate() {
            if !peers.get(peer).copied().unwrap_or(false) {
                links.push(None);
                continue;
            }
            let addr: SocketAddr = std::str::from_utf8(a)
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| {
                    NetError::Invalid(format!("rank {peer} sent a bad transport address"))
                })?;
            links.push(Some(Link::connect(
                rank,
                peer,
                addr,
                &token,
                closing.clone(),
                timeout,
                watch.clone(),
            )?));
        }
        // Every server has its connections before anyone sends.
        b.barrier()?;
        Ok(Self {
            rank,
            links,
            closing,
            listen_addr,
            watch,
        })
    }

    /// Makes every blocked send of this transport's links also ask `alive`
    /// (each [`SLICE`]) whether the job still stands, and fail with its
    /// error when not: a send to a peer that stopped draining then ends as
    /// soon as the job heard of a death, not only after the timeout. Set
    /// once; later calls are ignored. `alive` must not block.
    pub fn watch(&self, alive: impl Fn() -> Result<(), String> + Send + Sync + 'static) {
        let _ = self.watch.0.set(Box::new(alive));
    }

    /// The link to `peer`, when this transport reaches it.
    pub fn link(&self, peer: usize) -> Option<&Arc<Link>> {
        self.links.get(peer).and_then(Option::as_ref)
    }

    pub fn listen_addr(&self) -> SocketAddr {
        self.listen_addr
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        self.closing.store(true, Ordering::SeqCst);
        for l in self.links.iter().flatten() {
            // Not through the writer's lock: a sender blocked in a write
            // holds it, and the shutdown is what wakes that sender.
            let _ = l.ctl.shutdown(std::net::Shutdown::Both);
        }
        let _ = TcpStream::connect_timeout(&self.listen_addr, Duration::from_secs(1));
    }
}

fn accept(
    listener: &TcpListener,
    rank: usize,
    token: &[u8; 32],
    table: &Arc<RegionTable>,
    closing: &Arc<AtomicBool>,
    timeout: Duration,
) {
    for conn in listener.incoming() {
        if closing.load(Ordering::SeqCst) {
            return;
        }
        let Ok(mut s) = conn else { continue };
        let token = *token;
        let table = table.clone();
        let closing = closing.clone();
        let _ = thread::Builder::new()
            .name(format!("gin-tcp-serve-{rank}"))
            .spawn(move || {
                let from = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
                let _ = s.set_nodelay(true);
                let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
                let mut hello = [0u8; 40];
                if s.read_exact(&mut hello).is_err()
                    || hello[..32] != token
                    || u32::from_le_bytes(hello[32..36].try_into().expect("4 bytes")) != HELLO_MAGIC
                {
                    warn!(rank, %from, "tcp transport refused a connection without the job token");
                    return;
                }
                let peer = u32::from_le_bytes(hello[36..40].try_into().expect("4 bytes"));
                let _ = s.set_read_timeout(None);
                // An initiator that stops reading its answers must not hold
                // this thread forever: after the timeout the connection is
                // dropped (the initiator, if it ever runs again, sees it
                // closed).
                let _ = s.set_write_timeout(Some(timeout.max(Duration::from_millis(1))));
                if let Err(e) = serve(&mut s, &table)
                    && !closing.load(Ordering::SeqCst)
                {
                    debug!(rank, peer, %e, "tcp transport connection ended");
                }
            });
    }
}

/// Executes one peer's requests in order until its connection closes.
#[allow(clippy::many_single_char_names)] // s/w/r/h: stream, writer, request, header
fn serve(s: &mut TcpStream, table: &RegionTable) -> std::io::Result<()> {
    let mut w = s.try_clone()?;
    let mut buf = vec![0u8; CHUNK];
    let mut seq = 0u64;
    // Once a request of this connection was refused, the connection is in
    // its error state, as an RDMA QP: every later request is refused too,
    // never executed. So a signal sent as its own request after refused
    // data (a soft NIC's atomic after its write) is never applied.
    let mut refused: Option<String> = None;
    loop {
        let mut h = [0u8; REQ];
        if let Err(e) = s.read_exact(&mut h) {
            return if e.kind() == std::io::ErrorKind::UnexpectedEof {
                Ok(())
            } else {
                Err(e)
            };
        }
        let r = Req::decode(&h);
        if r.len > MAX_LEN {
            return Err(std::io::Error::other(format!(
                "request length {} is absurd",
                r.len
            )));
        }
        if let Some(first) = &refused {
            let why = format!("refused: this connection is in its error state since {first}");
            match r.op {
                OP_PUT => {
                    // Consume the data, touch nothing; the initiator already
                    // has its error (the first refusal's answer).
                    seq += 1;
                    let mut left = r.len;
                    while left > 0 {
                        let n = left.min(CHUNK as u64) as usize;
                        s.read_exact(&mut buf[..n])?;
                        left -= n as u64;
                    }
                }
                OP_GET | OP_FADD | OP_CAS | OP_FENCE => send_error(&mut w, r.req, &why)?,
                other => {
                    send_error(&mut w, r.req, &format!("unknown request op {other}"))?;
                    return Err(std::io::Error::other(format!("unknown op {other}")));
                }
            }
            continue;
        }
        match r.op {
            OP_PUT => {
                seq += 1;
                // Check first, and on failure still consume the data so the
                // stream stays in step, then answer an error. Each chunk is
                // copied under the region table's guard, so a region removed
                // mid-request is never written after its removal. The signal
                // is applied only when all of the data landed.
                let mut failed = table.check(r.key, r.off, r.len, AccessKind::Write).err();
                if failed.is_none() && r.flags & FLAG_SIGNAL != 0 {
                    failed = table
                        .check(r.sig_key, r.sig_off, 8, AccessKind::Atomic)
                        .err();
                }
                let mut left = r.len;
                let mut at = 0u64;
                while left > 0 {
                    let n = left.min(CHUNK as u64) as usize;
                    s.read_exact(&mut buf[..n])?;
                    if failed.is_none() {
                        failed = table.write(r.key, r.off + at, &buf[..n]).err();
                    }
                    at += n as u64;
                    left -= n as u64;
                }
                if failed.is_none() && r.flags & FLAG_SIGNAL != 0 {
                    failed = table.fetch_add(r.sig_key, r.sig_off, r.a).err();
                }
                if let Some(e) = failed {
                    let msg = format!("put #{seq} ({} bytes at offset {}): {e}", r.len, r.off);
                    send_error(&mut w, PUT_SEQ | seq, &msg)?;
                    refused = Some(msg);
                }
            }
            OP_GET => match table.check(r.key, r.off, r.len, AccessKind::Read) {
                Ok(()) => {
                    let len =
                        u32::try_from(r.len).map_err(|_| std::io::Error::other("get too large"))?;
                    w.write_all(&reply_header(REP_DATA, len, r.req, 0))?;
                    let mut at = 0u64;
                    let mut failed = None;
                    while at < r.len {
                        let n = (r.len - at).min(CHUNK as u64) as usize;
                        if failed.is_none() {
                            failed = table.read(r.key, r.off + at, &mut buf[..n]).err();
                        }
                        if failed.is_some() {
                            buf[..n].fill(0);
                        }
                        w.write_all(&buf[..n])?;
                        at += n as u64;
                    }
                    if let Some(e) = failed {
                        // The region went away mid-read: the data sent is not
                        // the region's; say so (this fails the link).
                        let msg = format!("get ({} bytes at offset {}): {e}", r.len, r.off);
                        send_error(&mut w, r.req, &msg)?;
                        refused = Some(msg);
                    }
                }
                Err(e) => {
                    let msg = format!("get ({} bytes at offset {}): {e}", r.len, r.off);
                    send_error(&mut w, r.req, &msg)?;
                    refused = Some(msg);
                }
            },
            OP_FADD | OP_CAS => {
                let old = if r.op == OP_FADD {
                    table.fetch_add(r.key, r.off, r.a)
                } else {
                    table.compare_swap(r.key, r.off, r.a, r.b)
                };
                match old {
                    Ok(old) => w.write_all(&reply_header(REP_VALUE, 0, r.req, old))?,
                    Err(e) => {
                        let msg = format!("atomic at offset {}: {e}", r.off);
                        send_error(&mut w, r.req, &msg)?;
                        refused = Some(msg);
                    }
                }
            }
            OP_FENCE => w.write_all(&reply_header(REP_ACK, 0, r.req, 0))?,
            other => {
                send_error(&mut w, r.req, &format!("unknown request op {other}"))?;
                return Err(std::io::Error::other(format!("unknown op {other}")));
            }
        }
    }
}

fn send_error(w: &mut TcpStream, req: u64, msg: &str) -> std::io::Result<()> {
    let m = msg.as_bytes();
    let m = &m[..m.len().min(4096)];
    let mut out = reply_header(REP_ERROR, m.len() as u32, req, 0).to_vec();
    out.extend_from_slice(m);
    w.write_all(&out)
}

impl Link {
    fn connect(
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
        let mut hello = [0u8; 40];
        hello[..32].copy_from_slice(token);
        hello[32..36].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
        hello[36..40].copy_from_slice(&(rank as u32).to_le_bytes());
        s.write_all(&hello)
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
            error: crate::sticky::StickyError::default(),
            closing,
        });
        let l = link.clone();
        thread::Builder::new()
            .name(format!("gin-tcp-reply-{rank}"))
            .spawn(move || l.read_replies(r))
            .map_err(io("spawning a reply reader".into()))?;
        Ok(link)
    }

    fn fail(&self, why: String) {
        self.fail_as(why, true);
    }

    /// Records the link's error (`loud`: also log it as a warning) and
    /// releases every waiter.
    fn fail_as(&self, why: String, loud: bool) {
        if self.error.set(why.clone()) {
            if loud {
                warn!(rank = self.rank, peer = self.peer, %why, "tcp transport error");
            } else {
                debug!(rank = self.rank, peer = self.peer, %why, "tcp transport closed");
            }
        }
        // Nothing pending will be answered now: release every waiter.
        let pending: Vec<Pending> = self
            .pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .drain()
            .map(|(_, p)| p)
            .collect();
        for p in pending {
            match p {
                Pending::Read { done, .. } => {
                    done.fetch_sub(1, Ordering::AcqRel);
                }
                Pending::Value(tx) => {
                    let _ = tx.send(Err(why.clone()));
                }
            }
        }
    }

    fn read_replies(&self, mut r: TcpStream) {
        let mut buf = vec![0u8; CHUNK];
        // Whether the connection simply ended (the peer exited or died).
        let mut eof = false;
        let why = loop {
            let mut h = [0u8; REP];
            if let Err(e) = r.read_exact(&mut h) {
                eof = e.kind() == std::io::ErrorKind::UnexpectedEof;
                break if eof {
                    format!(
                        "lost the connection to rank {}'s transport (that rank exited, died or became unreachable)",
                        self.peer
                    )
                } else {
                    format!("reading from rank {}'s transport: {e}", self.peer)
                };
            }
            let kind = h[0];
            let len = u32::from_le_bytes(h[4..8].try_into().expect("4 bytes")) as usize;
            let req = u64::from_le_bytes(h[8..16].try_into().expect("8 bytes"));
            let value = u64::from_le_bytes(h[16..24].try_into().expect("8 bytes"));
            let p = self
                .pending
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .remove(&req);
            match kind {
                REP_DATA => {
                    let Some(Pending::Read {
                        dst,
                        len: want,
                        done,
                        _keep,
                    }) = p
                    else {
                        break format!("rank {} answered unknown get {req}", self.peer);
                    };
                    if want != len as u64 {
                        let why = format!(
                            "rank {} answered get {req} with {len} bytes, not {want}",
                            self.peer
                        );
                        // The error first, then release the waiter: a flush
                        // that sees the get done also sees the failure.
                        self.fail(why.clone());
                        done.fetch_sub(1, Ordering::AcqRel);
                        break why;
                    }
                    let mut at = 0;
                    let mut bad = None;
                    while at < len {
                        let n = (len - at).min(CHUNK);
                        if let Err(e) = r.read_exact(&mut buf[..n]) {
                            bad = Some(e);
                            break;
                        }
                        // SAFETY: the issuer of the get promised `dst` valid for
                        // `len` bytes until `done` is decremented.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                buf.as_ptr(),
                                (dst as *mut u8).add(at),
                                n,
                            );
                        };
                        at += n;
                    }
                    if let Some(e) = bad {
                        let why = format!("reading get data from rank {}: {e}", self.peer);
                        self.fail(why.clone());
                        done.fetch_sub(1, Ordering::AcqRel);
                        break why;
                    }
                    done.fetch_sub(1, Ordering::AcqRel);
                }
                REP_VALUE | REP_ACK => {
                    if let Some(Pending::Value(tx)) = p {
                        let _ = tx.send(Ok(value));
                    }
                }
                REP_ERROR => {
                    let mut m = vec![0u8; len.min(4096)];
                    if r.read_exact(&mut m).is_err() {
                        break format!("rank {}'s transport sent a truncated error", self.peer);
                    }
                    let msg = format!(
                        "rank {} refused: {}",
                        self.peer,
                        String::from_utf8_lossy(&m)
                    );
                    // Refusals are sticky (the link is in its error state from
                    // now on): record that before answering the waiter, so the
                    // waiter's next request is refused here, not sent.
                    self.fail(msg.clone());
                    match p {
                        Some(Pending::Value(tx)) => {
                            let _ = tx.send(Err(msg));
                        }
                        Some(Pending::Read { done, .. }) => {
                            done.fetch_sub(1, Ordering::AcqRel);
                        }
                        None => {}
                    }
                }
                other => break format!("rank {} sent an unknown reply kind {other}", self.peer),
            }
        };
        if !self.closing.load(Ordering::SeqCst) {
            // A peer that exits closes its server's connections; with
            // nothing asked of it, that is news for whoever uses the link
            // next (it gets this error), not a warning at every job's end.
            let idle = self
                .pending
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .is_empty();
            self.fail_as(why, !(eof && idle));
        }
    }

    /// The first error this link saw, if any.
    pub fn check(&self) -> Result<(), NetError> {
        match self.error.get() {
            Some(why) => Err(NetError::Remote {
                peer: self.peer,
                why,
            }),
            None => Ok(()),
        }
    }

    fn send(&self, h: &Req, data: &[u8]) -> Result<(), NetError> {
        self.check()?;
        let mut w = self
            .w
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
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
        let remote = |why: String| {
            (
                why.clone(),
                NetError::Remote {
                    peer,
                    why: why.clone(),
                },
            )
        };
        let mut progress = Instant::now();
        while !buf.is_empty() {
            match w.write(buf) {
                Ok(0) => return Err(remote(format!("sending to rank {peer}: connection closed"))),
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
                        return Err(remote(format!(
                            "sending to rank {peer}: the transport is closing"
                        )));
                    }
                    if let Err(cause) = self.watch.check() {
                        return Err(remote(format!(
                            "gave up sending to rank {peer}, which stopped draining its connection: {cause}"
                        )));
                    }
                    let waited = progress.elapsed();
                    if waited >= self.timeout {
                        let what = format!(
                            "rank {peer} to drain its transport connection (it accepted no byte: stopped, frozen or overloaded)"
                        );
                        return Err((
                            format!("timed out after {waited:.1?} waiting for {what}"),
                            NetError::Timeout { peer, what, waited },
                        ));
                    }
                }
                Err(e) => return Err(remote(format!("sending to rank {peer}: {e}"))),
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
        // Replies carry a 32-bit length: large reads go as several requests,
        // each releasing `done` once.
        const PIECE: u64 = 1 << 30;
        let pieces = len.div_ceil(PIECE).max(1);
        done.fetch_add(pieces - 1, Ordering::AcqRel);
        for i in 0..pieces {
            let at = i * PIECE;
            let n = (len - at).min(PIECE);
            let req = self.next_req.fetch_add(1, Ordering::Relaxed);
            self.pending
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(
                    req,
                    Pending::Read {
                        dst: dst as usize + at as usize,
                        len: n,
                        done: done.clone(),
                        _keep: keep.clone(),
                    },
                );
            let r = self.send(
                &Req {
                    op: OP_GET,
                    key,
                    off: off + at,
                    len: n,
                    req,
                    ..Req::default()
                },
                &[],
            );
            if let Err(e) = r {
                // This piece and the ones never sent will not be answered.
                let unsent = pieces - i - 1;
                let mine = self
                    .pending
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .remove(&req)
                    .is_some();
                done.fetch_sub(unsent + u64::from(mine), Ordering::AcqRel);
                return Err(e);
            }
        }
        Ok(())
    }

    fn call(&self, mut h: Req, timeout: Duration) -> Result<u64, NetError> {
        let req = self.next_req.fetch_add(1, Ordering::Relaxed);
        h.req = req;
        let (tx, rx) = mpsc::sync_channel(1);
        self.pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(req, Pending::Value(tx));
        if let Err(e) = self.send(&h, &[]) {
            self.pending
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .remove(&req);
            return Err(e);
        }
        match rx.recv_timeout(timeout) {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(why)) => Err(NetError::Remote {
                peer: self.peer,
                why,
            }),
            Err(_) => Err(NetError::Timeout {
                peer: self.peer,
                what: format!("the answer to request {req}"),
                waited: timeout,
            }),
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

    pub fn peer(&self) -> usize {
        self.peer
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

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
        let sent = link.seq.load(Ordering::Relaxed);
        let mut last = sent;
        let blocked = loop {
            thread::sleep(SLICE * 4);
            let now = link.seq.load(Ordering::Relaxed);
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

    proptest! {
        #[test]
        fn request_header_roundtrip(op in any::<u8>(), flags in any::<u8>(), key in any::<u32>(), off in any::<u64>(),
                                    len in any::<u64>(), req in any::<u64>(), sig_key in any::<u32>(), sig_off in any::<u64>(),
                                    a in any::<u64>(), b in any::<u64>()) {
            let r = Req { op, flags, key, off, len, req, sig_key, sig_off, a, b };
            prop_assert_eq!(Req::decode(&r.encode()), r);
        }
    }
}
