//! Socket plumbing shared by the root and the ranks: connecting with retry,
//! the challenge/response handshake, and whole-frame writes.

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use crate::error::BootstrapError;
use crate::frame::{self, Frame, Hello, Purpose, ReadError, read_frame};
use crate::id::UniqueId;

/// How long a send blocked on a full socket waits before it looks again at
/// its deadline and at the job's death notices (the write timeout of every
/// sending connection).
pub(crate) const SEND_POLL: Duration = Duration::from_millis(100);

/// Why [`write_all_checked`] stopped.
#[derive(Debug)]
pub(crate) enum WriteStop<E> {
    /// The socket failed.
    Io(std::io::Error),
    /// The caller's check said stop.
    Stopped(E),
}

/// Writes all of `bytes` to a stream whose write timeout is [`SEND_POLL`].
/// Between writes, and whenever the socket stays full for a poll period,
/// `go_on(sent)` decides whether to keep going: a peer that stops draining
/// (a frozen process) then costs a deadline, not a hang.
pub(crate) fn write_all_checked<E>(
    s: &mut TcpStream,
    bytes: &[u8],
    mut go_on: impl FnMut(usize) -> Result<(), E>,
) -> Result<(), WriteStop<E>> {
    let mut sent = 0;
    while sent < bytes.len() {
        match s.write(&bytes[sent..]) {
            Ok(0) => return Err(WriteStop::Io(std::io::ErrorKind::WriteZero.into())),
            Ok(n) => sent += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) => return Err(WriteStop::Io(e)),
        }
        if sent < bytes.len() {
            go_on(sent).map_err(WriteStop::Stopped)?;
        }
    }
    Ok(())
}

/// Writes one frame with a single `write_all`.
pub(crate) fn write_frame(s: &mut TcpStream, f: &Frame) -> std::io::Result<()> {
    let bytes = frame::encode(f).map_err(std::io::Error::other)?;
    s.write_all(&bytes)
}

/// Connects to `to`, retrying refused connections until `deadline` (the other
/// side may still be starting).
pub(crate) fn connect(
    rank: Option<usize>,
    to: SocketAddr,
    deadline: Instant,
    what: &str,
) -> Result<TcpStream, BootstrapError> {
    let mut pause = Duration::from_millis(5);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(BootstrapError::Io {
                rank,
                context: format!("connecting to {what} at {to}: gave up at the deadline"),
                source: std::io::ErrorKind::TimedOut.into(),
            });
        }
        match TcpStream::connect_timeout(&to, left) {
            Ok(s) => {
                s.set_nodelay(true)
                    .map_err(|e| BootstrapError::io(rank, "setting TCP_NODELAY", e))?;
                return Ok(s);
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::ConnectionReset
                ) =>
            {
                // Retrying a refused connect is not synchronisation: nothing
                // signals "the listener is up" across processes, so back off.
                std::thread::sleep(pause.min(left));
                pause = (pause * 2).min(Duration::from_millis(200));
            }
            Err(e) => {
                return Err(BootstrapError::io(
                    rank,
                    format!("connecting to {what} at {to}"),
                    e,
                ));
            }
        }
    }
}

/// The dialing side of the handshake: answer the challenge, then wait for the
/// verdict. `Ok(Err(reason))` is a refusal.
pub(crate) fn handshake_dial(
    s: &mut TcpStream,
    id: &UniqueId,
    hello: (Purpose, u32, u32, &str),
    deadline: Instant,
    max_frame: usize,
    what: &str,
) -> Result<Result<(), String>, BootstrapError> {
    let (purpose, rank, nranks, listen_addr) = hello;
    let r = Some(rank as usize);
    let started = Instant::now();
    let left = deadline
        .saturating_duration_since(started)
        .max(Duration::from_millis(1));
    s.set_read_timeout(Some(left))
        .map_err(|e| BootstrapError::io(r, "setting a read timeout", e))?;
    // A read that ran into the deadline is a timeout, named as such, not a
    // socket failure.
    let read = |s: &mut TcpStream, awaited: &str| {
        read_frame(s, max_frame).map_err(|e| match e {
            ReadError::Io(io)
                if matches!(
                    io.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                BootstrapError::Timeout {
                    rank: rank as usize,
                    op: format!("the handshake with {what}"),
                    what: awaited.to_owned(),
                    waited: started.elapsed(),
                    missing: Vec::new(),
                }
            }
            e => BootstrapError::from_read(r, what, e),
        })
    };
    let nonce = match read(s, "its challenge")? {
        Some(Frame::Challenge { nonce }) => nonce,
        Some(other) => {
            return Err(BootstrapError::Frame {
                rank: r,
                from: what.to_owned(),
                source: frame::FrameError::BadField {
                    what: "handshake",
                    why: format!("expected a challenge, got {other:?}"),
                },
            });
        }
        None => {
            return Err(BootstrapError::io(
                r,
                format!("handshake with {what}"),
                std::io::ErrorKind::UnexpectedEof.into(),
            ));
        }
    };
    let mac = id.mac(&nonce, purpose, rank, nranks, listen_addr);
    write_frame(
        s,
        &Frame::Hello(Hello {
            purpose,
            rank,
            nranks,
            listen_addr: listen_addr.to_owned(),
            mac,
        }),
    )
    .map_err(|e| BootstrapError::io(r, format!("sending hello to {what}"), e))?;
    let verdict = match read(s, "its verdict on our hello")? {
        Some(Frame::Welcome) => Ok(()),
        Some(Frame::Refuse { reason }) => Err(reason),
        other => Err(format!("unexpected handshake answer {other:?}")),
    };
    s.set_read_timeout(None)
        .map_err(|e| BootstrapError::io(r, "clearing the read timeout", e))?;
    Ok(verdict)
}

/// The accepting side's verdict on a hello answering `nonce`: the keyed hash
/// and the claimed identity must hold. A refusal is sent to the dialer and
/// returned as `Err(reason)` for logging; an admitted hello is returned
/// without a welcome, which the caller sends with [`welcome`] once it has
/// recorded the peer.
pub(crate) fn judge_hello(
    s: &mut TcpStream,
    id: &UniqueId,
    nonce: &[u8; 16],
    hello: Hello,
    expect: Purpose,
    nranks: Option<u32>,
) -> Result<Hello, String> {
    let refuse = |s: &mut TcpStream, reason: String| {
        let _ = write_frame(
            s,
            &Frame::Refuse {
                reason: reason.clone(),
            },
        );
        Err(reason)
    };
    let want = id.mac(
        nonce,
        hello.purpose,
        hello.rank,
        hello.nranks,
        &hello.listen_addr,
    );
    // Not constant-time: the nonce is fresh per connection, so timing reveals
    // nothing reusable.
    if want != hello.mac {
        return refuse(s, "wrong job secret".into());
    }
    if hello.purpose != expect {
        return refuse(
            s,
            format!(
                "expected a {expect} connection, got a {} one",
                hello.purpose
            ),
        );
    }
    if let Some(n) = nranks
        && hello.nranks != n
    {
        return refuse(
            s,
            format!(
                "rank {} claims a job of {} ranks, this job has {n}",
                hello.rank, hello.nranks
            ),
        );
    }
    if hello.nranks == 0 || hello.rank >= hello.nranks {
        return refuse(
            s,
            format!(
                "rank {} is out of range for {} ranks",
                hello.rank, hello.nranks
            ),
        );
    }
    Ok(hello)
}

/// Admits a dialer whose hello passed [`judge_hello`].
pub(crate) fn welcome(s: &mut TcpStream) -> std::io::Result<()> {
    write_frame(s, &Frame::Welcome)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

    use super::*;
    use std::net::TcpListener;

    /// A peer that accepts and never reads: the write fills the socket,
    /// then keeps waking every poll period to ask whether to go on, and
    /// stops as soon as the answer is no.
    #[test]
    fn a_write_to_a_peer_that_never_reads_wakes_and_stops_when_told() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let idle = std::thread::spawn(move || l.accept().map(|(s, _)| s));
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_write_timeout(Some(SEND_POLL)).unwrap();
        let bytes = vec![0u8; 64 << 20];
        let (mut last, mut stalls) = (usize::MAX, 0);
        let r = write_all_checked(&mut s, &bytes, |sent| {
            if sent == last {
                stalls += 1;
            }
            last = sent;
            if stalls == 2 {
                Err("told to stop")
            } else {
                Ok(())
            }
        });
        let _keep_open = idle.join().unwrap();
        assert!(
            matches!(r, Err(WriteStop::Stopped("told to stop"))),
            "{r:?}"
        );
        assert!(last < bytes.len(), "all {last} bytes went out");
    }

    /// A listener that accepts and then says nothing: the dialer's
    /// handshake runs into its deadline and says so, naming the step.
    #[test]
    fn a_silent_acceptor_is_a_handshake_timeout() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let silent = std::thread::spawn(move || l.accept().map(|(s, _)| s));
        let mut s = TcpStream::connect(addr).unwrap();
        let id = UniqueId::derived(addr, "test");
        let deadline = Instant::now() + Duration::from_millis(200);
        let e = handshake_dial(
            &mut s,
            &id,
            (Purpose::Peer, 3, 4, ""),
            deadline,
            1 << 20,
            "rank 1",
        )
        .unwrap_err();
        let _keep_open = silent.join().unwrap();
        assert!(
            matches!(e, BootstrapError::Timeout { rank: 3, .. }),
            "not a timeout: {e:?}"
        );
        let text = e.to_string();
        assert!(
            text.contains("the handshake with rank 1") && text.contains("its challenge"),
            "{text}"
        );
    }
}
