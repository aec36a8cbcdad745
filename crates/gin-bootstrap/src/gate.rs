//! The accepting side of the handshake, for the root and for every rank: one
//! thread owns a listener and every connection that has not yet proved it
//! knows the job secret.
//!
//! An unauthenticated connection costs a socket and a few bytes of buffer,
//! never a thread. The gate reads the pending connections without blocking,
//! drops each one that has not answered its challenge within
//! [`Config::auth_timeout`](crate::Config::auth_timeout), and keeps at most
//! [`MAX_PENDING`] of them: a newcomer evicts the oldest, which is nearest its
//! deadline anyway, since a real rank answers within microseconds. Only an
//! admitted connection is handed on (to the root's state machine, or to a
//! reader thread of its own), and that number is bounded by the job's ranks.
//!
//! With nothing pending the gate blocks in `accept`; while strangers are
//! pending it polls them with naps that grow to [`MAX_NAP`], so a real rank's
//! handshake waits at most a few naps behind any number of strangers. Plain
//! std sockets keep the crate free of `unsafe` and of an event-loop
//! dependency.

use std::collections::VecDeque;
use std::io::{ErrorKind, Read};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use tracing::warn;

use crate::frame::{self, Frame, HEADER_LEN, Header, Hello, Kind, Purpose};
use crate::id::UniqueId;
use crate::net::{judge_hello, write_frame};

/// Unauthenticated connections held at once; beyond it the oldest is dropped.
pub(crate) const MAX_PENDING: usize = 128;
/// The longest nap between polls of pending connections.
const MAX_NAP: Duration = Duration::from_millis(5);
/// A hello is small; a stranger's claim of more is refused before reading it.
const MAX_HELLO: usize = 64 << 10;

/// What a gate admits and how long it waits.
#[derive(Debug, Clone)]
pub(crate) struct Gate {
    pub id: UniqueId,
    pub expect: Purpose,
    /// The job's size when known: hellos claiming another are refused.
    pub nranks: Option<u32>,
    pub auth_timeout: Duration,
    /// Who is accepting, for log lines ("the bootstrap root", "rank 3").
    pub who: String,
}

/// One connection on its way through the handshake.
struct Pending {
    stream: TcpStream,
    from: SocketAddr,
    nonce: [u8; 16],
    buf: Vec<u8>,
    header: Option<Header>,
    until: Instant,
}

enum Step {
    /// Nothing new arrived.
    Idle,
    /// Some bytes arrived; the hello is not complete yet.
    Progress,
    /// The hello was judged: admitted, or refused with a reason.
    Done(Result<Hello, String>),
}

impl Gate {
    /// Runs until `stop()` is true (checked after every accept and poll; a
    /// caller stopping a gate blocked in `accept` connects to it to wake it).
    /// `admit` receives each admitted connection, in blocking mode, before
    /// its `Welcome` is sent: it records the peer, then sends the welcome
    /// with [`crate::net::welcome`], so nothing the peer does after the
    /// welcome can overtake that record.
    pub(crate) fn run(
        &self,
        listener: &TcpListener,
        stop: &dyn Fn() -> bool,
        admit: &mut dyn FnMut(Hello, TcpStream),
    ) {
        let mut pending: VecDeque<Pending> = VecDeque::new();
        let mut nap = Duration::ZERO;
        loop {
            if stop() {
                return;
            }
            if pending.is_empty() {
                // Nothing to poll: sleep in accept until someone connects.
                if listener.set_nonblocking(false).is_err() {
                    return;
                }
                match listener.accept() {
                    Ok((s, from)) => {
                        if stop() {
                            return;
                        }
                        self.open(&mut pending, s, from);
                    }
                    // Out of file descriptors and the like: do not spin.
                    Err(_) => std::thread::sleep(MAX_NAP),
                }
                if listener.set_nonblocking(true).is_err() {
                    return;
                }
                nap = Duration::ZERO;
            }
            let mut progressed = false;
            loop {
                match listener.accept() {
                    Ok((s, from)) => {
                        self.open(&mut pending, s, from);
                        progressed = true;
                    }
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
            let now = Instant::now();
            let mut i = 0;
            while i < pending.len() {
                match step(&mut pending[i]) {
                    Step::Idle if now >= pending[i].until => {
                        let p = pending.remove(i).expect("index in range");
                        self.refused(
                            p.from,
                            &format!(
                                "no hello within the authentication deadline of {:.1?}",
                                self.auth_timeout
                            ),
                        );
                    }
                    Step::Idle => i += 1,
                    Step::Progress => {
                        progressed = true;
                        i += 1;
                    }
                    Step::Done(verdict) => {
                        progressed = true;
                        let mut p = pending.remove(i).expect("index in range");
                        let verdict = verdict.and_then(|hello| {
                            judge_hello(
                                &mut p.stream,
                                &self.id,
                                &p.nonce,
                                hello,
                                self.expect,
                                self.nranks,
                            )
                        });
                        match verdict {
                            Ok(hello) => match p.stream.set_nonblocking(false) {
                                Ok(()) => admit(hello, p.stream),
                                Err(e) => self.refused(p.from, &format!("socket setup: {e}")),
                            },
                            Err(why) => self.refused(p.from, &why),
                        }
                    }
                }
            }
            if progressed {
                nap = Duration::ZERO;
            } else if !pending.is_empty() {
                // Polling strangers, not synchronising: std has no readiness
                // wait over many sockets, and a real rank answers at once.
                nap = (nap * 2).clamp(Duration::from_micros(50), MAX_NAP);
                std::thread::sleep(nap);
            }
        }
    }

    /// Sends a new connection its challenge and queues it.
    fn open(&self, pending: &mut VecDeque<Pending>, stream: TcpStream, from: SocketAddr) {
        let mut nonce = [0u8; 16];
        let setup = stream
            .set_nonblocking(true)
            .and_then(|()| stream.set_nodelay(true))
            .map_err(|e| format!("socket setup: {e}"))
            .and_then(|()| getrandom::fill(&mut nonce).map_err(|e| e.to_string()));
        let mut stream = stream;
        // A fresh socket's send buffer always holds a 36-byte challenge.
        let sent = setup.and_then(|()| {
            write_frame(&mut stream, &Frame::Challenge { nonce })
                .map_err(|e| format!("sending the challenge: {e}"))
        });
        if let Err(why) = sent {
            self.refused(from, &why);
            return;
        }
        if pending.len() >= MAX_PENDING
            && let Some(old) = pending.pop_front()
        {
            self.refused(
                old.from,
                &format!(
                    "{MAX_PENDING} connections were waiting to authenticate; dropped the oldest"
                ),
            );
        }
        pending.push_back(Pending {
            stream,
            from,
            nonce,
            buf: Vec::with_capacity(HEADER_LEN),
            header: None,
            until: Instant::now() + self.auth_timeout,
        });
    }

    fn refused(&self, from: SocketAddr, why: &str) {
        warn!(who = %self.who, %from, %why, "refused a bootstrap connection");
    }
}

/// Reads what has arrived of a pending connection's hello, without blocking
/// and never past the end of that one frame.
fn step(p: &mut Pending) -> Step {
    let mut progressed = false;
    let mut chunk = [0u8; 4096];
    loop {
        let want = p.header.map_or(HEADER_LEN, |h| HEADER_LEN + h.len);
        let n = (want - p.buf.len()).min(chunk.len());
        match p.stream.read(&mut chunk[..n]) {
            Ok(0) => return Step::Done(Err("closed before saying hello".into())),
            Ok(k) => {
                p.buf.extend_from_slice(&chunk[..k]);
                progressed = true;
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                return if progressed {
                    Step::Progress
                } else {
                    Step::Idle
                };
            }
            Err(e) => return Step::Done(Err(format!("reading its hello: {e}"))),
        }
        if p.header.is_none() && p.buf.len() == HEADER_LEN {
            let bytes: &[u8; HEADER_LEN] = p.buf[..].try_into().expect("a full header");
            match frame::decode_header(bytes, MAX_HELLO) {
                Ok(h) if h.kind == Kind::Hello => p.header = Some(h),
                Ok(h) => {
                    return Step::Done(Err(format!("expected a hello, got a {:?} frame", h.kind)));
                }
                Err(e) => return Step::Done(Err(format!("bad hello: {e}"))),
            }
        }
        if let Some(h) = p.header
            && p.buf.len() == HEADER_LEN + h.len
        {
            let payload = p.buf.split_off(HEADER_LEN);
            return Step::Done(match frame::decode_payload(h, payload) {
                Ok(Frame::Hello(hello)) => Ok(hello),
                Ok(other) => Err(format!("expected a hello, got a {other:?} frame")),
                Err(e) => Err(format!("bad hello: {e}")),
            });
        }
    }
}
