//! The TCP transport: one-sided operations to any host.
//!
//! Modules: [`wire`] (the request and reply headers, pure), `server` (the
//! serving side), `link` (the initiating side: [`Link`]); this module holds
//! [`TcpTransport`], its [`Transport`] implementation and its registration.
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

mod link;
mod server;
pub mod wire;

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;
use std::time::Duration;

use gin_bootstrap::Bootstrap;

pub use link::Link;
use link::Watch;

use crate::NetError;
use crate::region::RegionTable;
use crate::transport::{Alive, AtomicOp, Blame, Reach, Registration, Scope, Target, Transport};
use crate::window::KeepAlive;

/// A blocked send wakes at least this often to check its deadline, the
/// job's health and whether the transport is closing.
pub const SLICE: Duration = Duration::from_millis(50);

/// How the fabric finds and starts the tcp transport.
pub const REGISTRATION: Registration = Registration {
    name: "tcp",
    scope: Scope::Any,
    start: |setup, peers| {
        Ok(Arc::new(TcpTransport::start(
            setup.bootstrap,
            setup.table.clone(),
            peers,
        )?))
    },
};

/// The TCP transport of one rank: its server and its links to peers.
#[derive(Debug)]
pub struct TcpTransport {
    rank: usize,
    links: Vec<Option<Arc<Link>>>,
    closing: Arc<AtomicBool>,
    listen_addr: SocketAddr,
    watch: Arc<Watch>,
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
                .spawn(move || server::accept(&listener, rank, &token, &table, &closing, timeout))
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
                .ok_or(NetError::BadRecord {
                    peer,
                    what: "transport address",
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
        let _ = self.watch.alive.set(Arc::new(alive));
    }

    /// The link to `peer`, when this transport reaches it.
    pub fn link(&self, peer: usize) -> Option<&Arc<Link>> {
        self.links.get(peer).and_then(Option::as_ref)
    }

    /// Where this rank's server listens.
    pub fn listen_addr(&self) -> SocketAddr {
        self.listen_addr
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The link to `peer`, or the error that says this transport does not
    /// reach it.
    fn reach_link(&self, peer: usize) -> Result<&Arc<Link>, NetError> {
        self.link(peer).ok_or(NetError::NoPath {
            peer,
            nranks: self.links.len(),
        })
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
impl Transport for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn reach(&self) -> Reach {
        Reach::Keyed
    }

    fn put(
        &self,
        peer: usize,
        dst: Target<'_>,
        src: &[u8],
        sig: Option<(Target<'_>, u64)>,
    ) -> Result<(), NetError> {
        let link = self.reach_link(peer)?;
        dst.check_range(peer, src.len() as u64)?;
        let (key, off) = dst.key_at(peer, "tcp")?;
        let sig = match sig {
            Some((t, v)) => {
                t.check_range(peer, 8)?;
                t.check_aligned(peer, "signal")?;
                let (k, o) = t.key_at(peer, "tcp")?;
                Some((k, o, v))
            }
            None => None,
        };
        link.put(key, off, src, sig)
    }

    unsafe fn get(
        &self,
        peer: usize,
        src: Target<'_>,
        dst: *mut u8,
        len: u64,
        done: &Arc<AtomicU64>,
        keep: Option<KeepAlive>,
    ) -> Result<(), NetError> {
        let link = self.reach_link(peer)?;
        src.check_range(peer, len)?;
        let (key, off) = src.key_at(peer, "tcp")?;
        // SAFETY: forwarded from the caller.
        unsafe { link.get(key, off, len, dst, done.clone(), keep) }
    }

    fn read(
        &self,
        peer: usize,
        src: Target<'_>,
        out: &mut [u8],
        timeout: Duration,
    ) -> Result<(), NetError> {
        let link = self.reach_link(peer)?;
        src.check_range(peer, out.len() as u64)?;
        let (key, off) = src.key_at(peer, "tcp")?;
        link.read(key, off, out, timeout)
    }

    fn atomic(
        &self,
        peer: usize,
        at: Target<'_>,
        op: AtomicOp,
        timeout: Duration,
    ) -> Result<u64, NetError> {
        let link = self.reach_link(peer)?;
        at.check_range(peer, 8)?;
        at.check_aligned(peer, "atomic")?;
        let (key, off) = at.key_at(peer, "tcp")?;
        match op {
            AtomicOp::FetchAdd(v) => link.fetch_add(key, off, v, timeout),
            AtomicOp::CompareSwap { expected, desired } => {
                link.compare_swap(key, off, expected, desired, timeout)
            }
        }
    }

    fn fence(&self, peer: usize, timeout: Duration) -> Result<(), NetError> {
        self.link(peer).map_or(Ok(()), |l| l.fence(timeout))
    }

    fn confirm(&self, peer: usize, timeout: Duration) -> Result<(), NetError> {
        self.link(peer).map_or(Ok(()), |l| l.confirm(timeout))
    }

    fn health(&self, peer: usize) -> Result<(), NetError> {
        self.link(peer).map_or(Ok(()), |l| l.check())
    }

    fn watch(&self, alive: Alive) {
        let _ = self.watch.alive.set(alive);
    }

    /// A request to a peer unanswered for the whole timeout, or a connection
    /// it did not drain for as long, is reported: its server thread answers
    /// whatever its rank does, so only a stopped process stays silent.
    fn blame_to(&self, blame: Blame) {
        let _ = self.watch.blame.set(blame);
    }
}
