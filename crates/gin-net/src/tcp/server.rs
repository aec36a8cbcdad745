//! The serving side of the tcp transport: a thread per incoming connection
//! executes one peer's requests in arrival order, after the region table
//! checked key, rights, bounds and alignment, and answers an error instead
//! of touching memory when a check fails.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::Duration;

use tracing::{debug, warn};

use super::wire::{
    CHUNK, FLAG_SIGNAL, MAX_ERROR, MAX_LEN, OP_CAS, OP_FADD, OP_FENCE, OP_GET, OP_PUT, PUT_SEQ,
    REP_ACK, REP_DATA, REP_ERROR, REP_VALUE, REQ, Reply, Req, check_hello,
};
use crate::region::{AccessKind, RegionTable};

/// Accepts connections until the transport is closing; each authenticated
/// one gets its own thread.
pub(super) fn accept(
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
        let Ok(s) = conn else { continue };
        let token = *token;
        let table = table.clone();
        let closing = closing.clone();
        let _ = thread::Builder::new()
            .name(format!("gin-tcp-serve-{rank}"))
            .spawn(move || greet_and_serve(s, rank, &token, &table, &closing, timeout));
    }
}

fn greet_and_serve(
    mut s: TcpStream,
    rank: usize,
    token: &[u8; 32],
    table: &RegionTable,
    closing: &AtomicBool,
    timeout: Duration,
) {
    let from = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    let _ = s.set_nodelay(true);
    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
    let mut hello = [0u8; 40];
    let Ok(Some(peer)) = s
        .read_exact(&mut hello)
        .map(|()| check_hello(&hello, token))
    else {
        warn!(rank, %from, "tcp transport refused a connection without the job token");
        return;
    };
    let _ = s.set_read_timeout(None);
    // An initiator that stops reading its answers must not hold this thread
    // forever: after the timeout the connection is dropped (the initiator,
    // if it ever runs again, sees it closed).
    let _ = s.set_write_timeout(Some(timeout.max(Duration::from_millis(1))));
    let r = s
        .try_clone()
        .and_then(|w| Conn::new(&mut s, w, table).serve());
    if let Err(e) = r
        && !closing.load(Ordering::SeqCst)
    {
        debug!(rank, peer, %e, "tcp transport connection ended");
    }
}

/// One peer's connection, served in order.
struct Conn<'a> {
    /// Requests come in here.
    s: &'a mut TcpStream,
    /// Replies go out here (the same socket).
    w: TcpStream,
    table: &'a RegionTable,
    buf: Vec<u8>,
    /// Puts received so far.
    seq: u64,
    /// Once a request of this connection was refused, the connection is in
    /// its error state, as an RDMA QP: every later request is refused too,
    /// never executed. So a signal sent as its own request after refused
    /// data (a soft NIC's atomic after its write) is never applied.
    refused: Option<String>,
}

impl<'a> Conn<'a> {
    fn new(s: &'a mut TcpStream, w: TcpStream, table: &'a RegionTable) -> Self {
        Self {
            s,
            w,
            table,
            buf: vec![0u8; CHUNK],
            seq: 0,
            refused: None,
        }
    }

    /// Executes requests until the connection closes.
    fn serve(mut self) -> std::io::Result<()> {
        loop {
            let mut h = [0u8; REQ];
            if let Err(e) = self.s.read_exact(&mut h) {
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
            if let Some(first) = &self.refused {
                let why = format!("refused: this connection is in its error state since {first}");
                self.refuse(&r, &why)?;
                continue;
            }
            match r.op {
                OP_PUT => self.put(&r)?,
                OP_GET => self.get(&r)?,
                OP_FADD | OP_CAS => self.atomic(&r)?,
                OP_FENCE => self.reply(REP_ACK, r.req, 0)?,
                other => return self.unknown(&r, other),
            }
        }
    }

    /// Answers `r` with an error without executing it (the connection is
    /// in its error state).
    fn refuse(&mut self, r: &Req, why: &str) -> std::io::Result<()> {
        match r.op {
            OP_PUT => {
                // Consume the data, touch nothing; the initiator already
                // has its error (the first refusal's answer).
                self.seq += 1;
                self.skip(r.len)
            }
            OP_GET | OP_FADD | OP_CAS | OP_FENCE => send_error(&mut self.w, r.req, why),
            other => self.unknown(r, other),
        }
    }

    fn unknown(&mut self, r: &Req, op: u8) -> std::io::Result<()> {
        send_error(&mut self.w, r.req, &format!("unknown request op {op}"))?;
        Err(std::io::Error::other(format!("unknown op {op}")))
    }

    /// Reads and drops `len` bytes of request data.
    fn skip(&mut self, mut len: u64) -> std::io::Result<()> {
        while len > 0 {
            let n = len.min(CHUNK as u64) as usize;
            self.s.read_exact(&mut self.buf[..n])?;
            len -= n as u64;
        }
        Ok(())
    }

    fn reply(&mut self, kind: u8, req: u64, value: u64) -> std::io::Result<()> {
        let h = Reply {
            kind,
            len: 0,
            req,
            value,
        };
        self.w.write_all(&h.encode())
    }

    /// Records the connection's first refusal and answers it.
    fn fail(&mut self, req: u64, msg: String) -> std::io::Result<()> {
        send_error(&mut self.w, req, &msg)?;
        self.refused = Some(msg);
        Ok(())
    }

    /// A put: check first, and on failure still consume the data so the
    /// stream stays in step, then answer an error. Each chunk is copied
    /// under the region table's guard, so a region removed mid-request is
    /// never written after its removal. The signal is applied only when all
    /// of the data landed.
    fn put(&mut self, r: &Req) -> std::io::Result<()> {
        self.seq += 1;
        let signal = r.flags & FLAG_SIGNAL != 0;
        let t = self.table;
        let mut failed = t.check(r.key, r.off, r.len, AccessKind::Write).err();
        if failed.is_none() && signal {
            failed = t.check(r.sig_key, r.sig_off, 8, AccessKind::Atomic).err();
        }
        let mut at = 0u64;
        while at < r.len {
            let n = (r.len - at).min(CHUNK as u64) as usize;
            self.s.read_exact(&mut self.buf[..n])?;
            if failed.is_none() {
                failed = t.write(r.key, r.off + at, &self.buf[..n]).err();
            }
            at += n as u64;
        }
        if failed.is_none() && signal {
            failed = t.fetch_add(r.sig_key, r.sig_off, r.a).err();
        }
        match failed {
            Some(e) => {
                let msg = format!(
                    "put #{} ({} bytes at offset {}): {e}",
                    self.seq, r.len, r.off
                );
                self.fail(PUT_SEQ | self.seq, msg)
            }
            None => Ok(()),
        }
    }

    /// A get: the data follows its header; a region that went away mid-read
    /// is answered with zeros and then an error (which fails the link).
    fn get(&mut self, r: &Req) -> std::io::Result<()> {
        if let Err(e) = self.table.check(r.key, r.off, r.len, AccessKind::Read) {
            let msg = format!("get ({} bytes at offset {}): {e}", r.len, r.off);
            return self.fail(r.req, msg);
        }
        let len = u32::try_from(r.len).map_err(|_| std::io::Error::other("get too large"))?;
        let h = Reply {
            kind: REP_DATA,
            len,
            req: r.req,
            value: 0,
        };
        self.w.write_all(&h.encode())?;
        let mut at = 0u64;
        let mut failed = None;
        while at < r.len {
            let n = (r.len - at).min(CHUNK as u64) as usize;
            if failed.is_none() {
                failed = self.table.read(r.key, r.off + at, &mut self.buf[..n]).err();
            }
            if failed.is_some() {
                self.buf[..n].fill(0);
            }
            self.w.write_all(&self.buf[..n])?;
            at += n as u64;
        }
        match failed {
            Some(e) => {
                let msg = format!("get ({} bytes at offset {}): {e}", r.len, r.off);
                self.fail(r.req, msg)
            }
            None => Ok(()),
        }
    }

    fn atomic(&mut self, r: &Req) -> std::io::Result<()> {
        let old = if r.op == OP_FADD {
            self.table.fetch_add(r.key, r.off, r.a)
        } else {
            self.table.compare_swap(r.key, r.off, r.a, r.b)
        };
        match old {
            Ok(old) => self.reply(REP_VALUE, r.req, old),
            Err(e) => self.fail(r.req, format!("atomic at offset {}: {e}", r.off)),
        }
    }
}

/// Answers request `req` with an error message (truncated to
/// [`MAX_ERROR`] bytes).
fn send_error(w: &mut TcpStream, req: u64, msg: &str) -> std::io::Result<()> {
    let m = msg.as_bytes();
    let m = &m[..m.len().min(MAX_ERROR)];
    let h = Reply {
        kind: REP_ERROR,
        len: m.len() as u32,
        req,
        value: 0,
    };
    let mut out = h.encode().to_vec();
    out.extend_from_slice(m);
    w.write_all(&out)
}
