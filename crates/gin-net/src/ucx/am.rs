//! Small puts as one active message each (`GIN_UCX_AM_MAX`): over UCX's
//! tcp a put with a signal is otherwise two UCX messages (the emulated
//! put and the signal's emulated atomic, each handled by the target's
//! progress), where `ucp_put_lat` sends one.
//!
//! How large: `GIN_UCX_AM_MAX` for every peer when set, else per peer by
//! the transports of its endpoint's lanes (`ucp_ep_query`): 64 KiB
//! ([`AM_MAX_TCP`]) where they are UCX's tcp alone, whose segment sizes
//! every context sets for it ([`TCP_SEGMENTS`]: UCX then sends a 64 KiB
//! message as one zero-copy fragment, not eight copied ones), and 16 KiB
//! ([`AM_MAX`]) otherwise: over shared memory and RDMA an active message
//! above its transport's 8 KiB segment is fragmented and reassembled by
//! UCX, and an RMA put (cma, an RDMA write) lands with no copy at the
//! target.
//!
//! The initiator sends the header ([`wire::AmPut`]: key, offset, signal)
//! and the bytes in one eager active message; the target's handler (on
//! whichever of its threads progresses the worker) checks them against
//! its region table as gin-rs's tcp server does (key, rights, bounds,
//! alignment, each copy under the table's read guard, so a removed region
//! is never written) and applies the data, then the signal (release
//! ordering: [`RegionTable::fetch_add`]). Puts are executed in the
//! initiator's sequence order whatever order UCX delivers them in. A
//! refusal puts the initiator's stream into its error state, as an RDMA
//! QP (every later put of it is refused, never applied, so a signal is
//! never applied after refused data), and is reported back.
//!
//! Completion: the target acknowledges execution on demand. A
//! [`wire::Sync`] asks it to answer once every put up to a sequence number
//! was executed (or refused), with the first refusal's text; `confirm`,
//! `fence`, and every request that must execute after them on the RMA
//! path (a larger put, a get, a put from GPU memory) send one and wait.
//! An atomic after them goes as a message in their sequence instead
//! ([`wire::AmAtomic`], answered with its old value): one round trip. UCX's flush is not used for them: it completes an
//! active message once the transport delivered it, not once the handler
//! ran.
//!
//! Ordering against the RMA path, per peer: a put goes by active message
//! only when no RMA put to that peer is unflushed (every one since the
//! last completed flush of its endpoint, so they are executed: UCP's
//! flush contract), else by RMA; and a request that goes by RMA after
//! active-message puts first waits for their execution (the sync above).
//! UCP's `ucp_worker_fence` is documented for "communication operations"
//! on an endpoint, but whether UCX applies it to active messages is not
//! what gin-rs relies on: over shared memory a cma put is done by the
//! initiator's own process while an active message waits in the target's
//! queue, so neither direction could be left to UCX.
//! `a_mix_of_put_messages_and_rma_puts_to_one_peer_keeps_issue_order`
//! tests it (without the sync it fails over shared memory: a small put
//! landed after the larger RMA put issued after it).
//!
//! GPU memory (a region behind a backing) is never a target: the
//! handler would copy into it from the progress thread.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::serve::parts;
use super::{Inner, Peer, UcxTransport, Work, lock, sys, wire};
use crate::NetError;
use crate::region::{AccessKind, RegionError};

/// The target's state for one initiator's active-message puts.
#[derive(Default)]
pub(super) struct AmIn {
    /// How many were executed (or refused): the next is `done + 1`.
    done: u64,
    /// Those that arrived before their turn (a put with a copy of its
    /// bytes).
    held: BTreeMap<u64, Msg<'static>>,
    /// The first refusal: every later put is refused too.
    refused: Option<String>,
    /// Sync requests not answered yet: (upto, id).
    syncs: Vec<(u64, u64)>,
}

/// An answer to a sync or an atomic message: how many messages were
/// executed, an atomic's old value, the first refusal.
pub(super) type SyncAnswer = (u64, u64, Option<String>);

/// A message executed in its sender's sequence.
enum Msg<'a> {
    /// A put and its bytes (`Err(len)`: it came by rendezvous, refused).
    Put(wire::AmPut, Result<Cow<'a, [u8]>, usize>),
    /// An atomic, answered with its old value.
    Atomic(wire::AmAtomic),
}

impl Msg<'_> {
    fn seq(&self) -> u64 {
        match self {
            Msg::Put(p, _) => p.seq,
            Msg::Atomic(a) => a.seq,
        }
    }

    fn owned(self) -> Msg<'static> {
        match self {
            Msg::Put(p, b) => Msg::Put(p, b.map(|b| Cow::Owned(b.into_owned()))),
            Msg::Atomic(a) => Msg::Atomic(a),
        }
    }
}

/// `GIN_UCX_AM_MAX`: the largest put (bytes) sent as one active message
/// to every peer; 0 turns them off; `None`: unset, each peer gets its
/// transport's default ([`default_limit`]).
pub(super) fn am_max_setting(v: Option<&str>) -> Result<Option<usize>, NetError> {
    match v.map(str::trim) {
        None | Some("") => Ok(None),
        Some(t) => t.parse().map(Some).map_err(|_| NetError::Unavailable {
            transport: "ucx",
            why: format!("GIN_UCX_AM_MAX={t:?} is not a number of bytes"),
            alternatives: "unset GIN_UCX_AM_MAX, or give a size in bytes (0: no active-message puts)",
        }),
    }
}

/// `GIN_UCX_AM_MAX`'s default for a peer reached by anything but UCX's
/// tcp alone (shared memory, RDMA): above it an active message is
/// fragmented by UCX (posix FIFO elements and RDMA segments are 8 KiB)
/// and an RMA put wins (docs/ucx.md has the measurement).
pub(super) const AM_MAX: usize = 16 << 10;

/// `GIN_UCX_AM_MAX`'s default for a peer whose endpoint uses UCX's tcp
/// alone, with [`TCP_SEGMENTS`]: a 64 KiB put and its signal are then one
/// zero-copy message (one `sendmsg`, one receive into UCX's segment, one
/// copy into the window), where the RMA path sends the put, then the
/// signal's emulated atomic, which the target answers (measured: 15.6-18.4
/// against 23-24 µs; the floor 16).
pub(super) const AM_MAX_TCP: usize = 64 << 10;

/// UCX's tcp segment sizes every context is made with, unless the
/// environment sets either (`UCX_TCP_RX_SEG_SIZE`, `UCX_TCP_TX_SEG_SIZE`).
/// UCX 1.22 sends an active message as one zero-copy fragment only up to
/// the receive segment (less its headers) and, by its own estimate, about
/// twice the send segment; with its defaults (64 KiB and 8 KiB) that is
/// 16,515 bytes, above which it copies the message into 8 KiB fragments
/// and the target reassembles it (a 64 KiB put message took 33 µs, the RMA
/// path 24). With 128 KiB and 64 KiB it is 131,064 bytes. Receive first:
/// a send segment above the receive segment is refused. Every rank of a
/// job must use the same sizes (UCX's own rule).
pub const TCP_SEGMENTS: [(&str, &str); 2] =
    [("TCP_RX_SEG_SIZE", "128k"), ("TCP_TX_SEG_SIZE", "64k")];

/// The [`TCP_SEGMENTS`] to set given `env` (a variable's value by name):
/// all of them, or none when the environment sets any.
pub(super) fn tcp_segments(env: impl Fn(&str) -> Option<String>) -> Vec<(String, String)> {
    if TCP_SEGMENTS
        .iter()
        .any(|(name, _)| env(&format!("UCX_{name}")).is_some())
    {
        return Vec::new();
    }
    TCP_SEGMENTS
        .iter()
        .map(|&(n, v)| (n.to_owned(), v.to_owned()))
        .collect()
}

/// The default largest put message to a peer whose endpoint's lanes use
/// `transports` (UCX's names: `tcp`, `posix`, `cma`, `rc_mlx5`, ...):
/// [`AM_MAX_TCP`] where every lane that carries host memory is tcp and the
/// context has [`TCP_SEGMENTS`] (`tcp_segments`), else [`AM_MAX`].
/// Memory-type transports (`cuda_copy`, `cuda_ipc`, `rocm_*`, `ze_*`,
/// `gdr_copy`) carry GPU memory, never a put message, and are left out.
pub(super) fn default_limit(transports: &[String], tcp_segments: bool) -> usize {
    let gpu = |t: &str| {
        ["cuda", "rocm", "ze_", "gdr"]
            .iter()
            .any(|p| t.starts_with(p))
    };
    let mut host = transports.iter().filter(|t| !gpu(t)).peekable();
    if tcp_segments && host.peek().is_some() && host.all(|t| t == "tcp") {
        AM_MAX_TCP
    } else {
        AM_MAX
    }
}

pub(super) unsafe extern "C" fn on_put(
    arg: *mut c_void,
    header: *const c_void,
    hlen: usize,
    data: *mut c_void,
    len: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: called by UCX as registered.
    let (inner, h) = unsafe { parts(arg, header, hlen) };
    let Some(put) = wire::AmPut::decode(h) else {
        tracing::warn!(rank = inner.rank, "a malformed put message was dropped");
        return sys::UCS_OK;
    };
    // SAFETY: UCX passes its receive parameters, valid during the call.
    let rndv = !param.is_null()
        && unsafe { (*param).recv_attr } & u64::from(sys::UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    let bytes = if rndv {
        // Sent eager: a rendezvous put is a protocol error, refused.
        Err(len)
    } else if len == 0 || data.is_null() {
        Ok(Cow::Borrowed(&[][..]))
    } else {
        // SAFETY: UCX passes `len` bytes of data, valid during the call.
        Ok(Cow::Borrowed(unsafe {
            std::slice::from_raw_parts(data.cast::<u8>(), len)
        }))
    };
    inner.am_arrived(put.from as usize, Msg::Put(put, bytes));
    sys::UCS_OK
}

pub(super) unsafe extern "C" fn on_atomic(
    arg: *mut c_void,
    header: *const c_void,
    hlen: usize,
    _data: *mut c_void,
    _len: usize,
    _param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: called by UCX as registered.
    let (inner, h) = unsafe { parts(arg, header, hlen) };
    if let Some(a) = wire::AmAtomic::decode(h) {
        inner.am_arrived(a.from as usize, Msg::Atomic(a));
    } else {
        tracing::warn!(rank = inner.rank, "a malformed atomic message was dropped");
    }
    sys::UCS_OK
}

pub(super) unsafe extern "C" fn on_sync(
    arg: *mut c_void,
    header: *const c_void,
    hlen: usize,
    _data: *mut c_void,
    _len: usize,
    _param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: called by UCX as registered.
    let (inner, h) = unsafe { parts(arg, header, hlen) };
    if let Some(y) = wire::Sync::decode(h) {
        let from = y.from as usize;
        if let Some(state) = inner.am_in.get(from) {
            let mut st = lock(state);
            if y.upto <= st.done {
                inner.queue(Work::Synced {
                    to: from,
                    id: y.id,
                    done: st.done,
                    value: 0,
                    refused: st.refused.clone(),
                });
            } else {
                st.syncs.push((y.upto, y.id));
            }
        }
    }
    sys::UCS_OK
}

pub(super) unsafe extern "C" fn on_synced(
    arg: *mut c_void,
    header: *const c_void,
    hlen: usize,
    data: *mut c_void,
    len: usize,
    _param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: called by UCX as registered.
    let (inner, h) = unsafe { parts(arg, header, hlen) };
    let Some(a) = wire::Synced::decode(h) else {
        return sys::UCS_OK;
    };
    let refused = (len > 0 && !data.is_null()).then(|| {
        // SAFETY: UCX passes `len` bytes of data, valid during the call.
        let b = unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) };
        String::from_utf8_lossy(b).into_owned()
    });
    if let Some(slot) = lock(&inner.synced).get_mut(&a.id) {
        *slot = Some((a.done, a.value, refused));
    }
    sys::UCS_OK
}

impl Inner {
    /// A message from peer `from`: executed in its sequence order (held
    /// until its turn), then the syncs it completes are answered.
    fn am_arrived(&self, from: usize, msg: Msg<'_>) {
        let Some(state) = self
            .am_in
            .get(from)
            .filter(|_| self.peer_opt(from).is_some())
        else {
            tracing::warn!(
                rank = self.rank,
                from,
                "a message from a rank this transport does not reach was dropped"
            );
            return;
        };
        let mut st = lock(state);
        let seq = msg.seq();
        if seq <= st.done {
            return;
        }
        if seq > st.done + 1 {
            st.held.insert(seq, msg.owned());
            return;
        }
        self.am_execute(from, &mut st, msg);
        loop {
            let next = st.done + 1;
            let Some(m) = st.held.remove(&next) else {
                break;
            };
            self.am_execute(from, &mut st, m);
        }
        let done = st.done;
        let refused = st.refused.clone();
        st.syncs.retain(|&(upto, id)| {
            if upto > done {
                return true;
            }
            self.queue(Work::Synced {
                to: from,
                id,
                done,
                value: 0,
                refused: refused.clone(),
            });
            false
        });
    }

    /// Executes one message in its turn, or refuses it (and every later
    /// one); an atomic is answered.
    fn am_execute(&self, from: usize, st: &mut AmIn, msg: Msg<'_>) {
        st.done = msg.seq();
        let (r, atomic) = match msg {
            Msg::Put(put, bytes) => {
                if st.refused.is_some() {
                    return;
                }
                let r = match &bytes {
                    Err(_) => Err("it came by rendezvous (puts are sent eager)".to_owned()),
                    Ok(b) => self.am_apply(&put, b).map_err(|e| e.to_string()),
                };
                let len = bytes.as_ref().map_or_else(|&n| n, |b| b.len());
                let r = r.map_err(|e| {
                    format!(
                        "put #{} ({len} bytes at offset {}): {e}",
                        put.seq, put.offset
                    )
                });
                (r.map(|()| 0), None)
            }
            Msg::Atomic(a) => {
                let r = if st.refused.is_some() {
                    Ok(0)
                } else {
                    let t = &self.table;
                    match a.swap {
                        None => t.fetch_add(a.key, a.offset, a.a),
                        Some(d) => t.compare_swap(a.key, a.offset, a.a, d),
                    }
                    .map_err(|e| format!("atomic #{} at offset {}: {e}", a.seq, a.offset))
                };
                (r, Some(a.id))
            }
        };
        let value = match r {
            Ok(v) => v,
            Err(why) => {
                tracing::warn!(rank = self.rank, from, %why, "refusing a message");
                st.refused = Some(why);
                0
            }
        };
        if let Some(id) = atomic {
            self.queue(Work::Synced {
                to: from,
                id,
                done: st.done,
                value,
                refused: st.refused.clone(),
            });
        }
    }

    /// Checks the data's range and the signal's word, then writes the
    /// data, then adds the signal (release: whoever sees it sees the data).
    fn am_apply(&self, put: &wire::AmPut, bytes: &[u8]) -> Result<(), RegionError> {
        let t = &self.table;
        // GPU memory is never written from a UCX handler (a CUDA copy there
        // could wait on a kernel that waits on this worker): initiators send
        // put messages to host memory only, and a stale or recycled key
        // that now names GPU memory is refused here too.
        if t.with_region(put.key, |r| r.is_some_and(|r| r.backed)) {
            return Err(RegionError::CopyOnly { key: put.key });
        }
        t.check(put.key, put.offset, bytes.len() as u64, AccessKind::Write)?;
        if let Some((k, o, _)) = put.signal {
            t.check(k, o, 8, AccessKind::Atomic)?;
        }
        t.write(put.key, put.offset, bytes)?;
        if let Some((k, o, v)) = put.signal {
            t.fetch_add(k, o, v)?;
        }
        Ok(())
    }

    /// Answers a sync (on the progress thread: queued by the handlers).
    pub(super) fn am_answer(
        &self,
        to: usize,
        id: u64,
        done: u64,
        value: u64,
        refused: Option<String>,
    ) {
        let Some(peer) = self.peer_opt(to) else {
            return;
        };
        let data = refused.map(String::into_bytes).unwrap_or_default();
        if let Err(why) = self.send(
            peer,
            wire::id::SYNCED,
            &wire::Synced { id, done, value }.encode(),
            data,
        ) {
            tracing::warn!(rank = self.rank, to, %why, "cannot answer a sync of put messages");
        }
    }
}

/// Each peer's largest put message: `set` (`GIN_UCX_AM_MAX`) for every
/// peer, else each endpoint's [`default_limit`], with the larger tcp
/// segments only where both this rank's context and the peer's (`tuned`,
/// by rank) took them (0 where this rank has no endpoint to the rank).
/// Logged at `debug` with the endpoint's transports.
pub(super) fn limits(inner: &Inner, set: Option<usize>, tuned: &[bool]) -> Vec<usize> {
    (0..inner.peers.len())
        .map(|rank| {
            let Some(p) = inner.peer_opt(rank) else {
                return 0;
            };
            let transports = transports(inner, p);
            let both = inner.ucp.tcp_segments && tuned.get(rank).copied().unwrap_or(false);
            let max = set.unwrap_or_else(|| default_limit(&transports, both));
            tracing::debug!(
                rank = inner.rank,
                peer = rank,
                ?transports,
                am_max = max,
                "largest put message"
            );
            max
        })
        .collect()
}

/// The transport of each lane of `p`'s endpoint (`ucp_ep_query`); empty
/// where UCX does not say (before 1.14, or no endpoint).
fn transports(inner: &Inner, p: &Peer) -> Vec<String> {
    const MAX_LANES: usize = 64;
    let mut entries = [sys::ucp_transport_entry_t::default(); MAX_LANES];
    let mut attr = sys::ucp_ep_attr_t {
        field_mask: u64::from(sys::UCP_EP_ATTR_FIELD_TRANSPORTS),
        transports: sys::ucp_transports_t {
            entries: entries.as_mut_ptr(),
            num_entries: MAX_LANES as u32,
            entry_size: std::mem::size_of::<sys::ucp_transport_entry_t>(),
        },
        ..Default::default()
    };
    let st = lock(&p.state);
    if st.ep.is_null() {
        return Vec::new();
    }
    // SAFETY: a live endpoint (under the peer's lock); `attr` asks for the
    // transports only, into `entries`, whose size and count it gives.
    if unsafe { inner.ucp.lib.ucp_ep_query(st.ep, &raw mut attr) } != sys::UCS_OK {
        return Vec::new();
    }
    drop(st);
    let n = (attr.transports.num_entries as usize).min(MAX_LANES);
    entries[..n]
        .iter()
        .map(|e| {
            if e.transport_name.is_null() {
                String::new()
            } else {
                // SAFETY: UCX points at a NUL-terminated name it keeps for
                // the context's life; copied at once.
                unsafe { std::ffi::CStr::from_ptr(e.transport_name) }
                    .to_string_lossy()
                    .into_owned()
            }
        })
        .collect()
}

impl Peer {
    /// Active-message puts sent that the target has not said it executed.
    pub(super) fn am_pending(&self) -> bool {
        self.am_sent.load(Ordering::Acquire) > self.am_synced.load(Ordering::Acquire)
    }

    /// No RMA put to this peer since the last completed flush.
    pub(super) fn rma_clean(&self) -> bool {
        self.rma_issued.load(Ordering::Acquire) <= self.rma_flushed.load(Ordering::Acquire)
    }
}

impl UcxTransport {
    /// Whether a put of `len` bytes to `dst` of `peer` (and its signal's
    /// word) may go as one active message, its peer's RMA state aside.
    pub(super) fn am_fits(
        &self,
        peer: usize,
        len: usize,
        dst: &super::Resolved,
        sig: Option<&super::Resolved>,
    ) -> bool {
        let max = self.am_max.get(peer).copied().unwrap_or(0);
        max > 0 && len <= max && !dst.remote.backed && sig.is_none_or(|s| !s.remote.backed)
    }

    /// Sends one put message (under the peer's lock: `ep` is its live
    /// endpoint): the bytes are copied into a buffer the request owns.
    pub(super) fn am_issue(
        &self,
        p: &Peer,
        ep: sys::ucp_ep_h,
        key: u32,
        offset: u64,
        signal: Option<(u32, u64, u64)>,
        src: &[u8],
    ) -> Result<(), NetError> {
        let inner = &self.inner;
        let seq = p.am_sent.load(Ordering::Acquire) + 1;
        let h = wire::AmPut {
            from: u32::try_from(inner.rank).unwrap_or(u32::MAX),
            seq,
            key,
            offset,
            signal,
        }
        .encode();
        let mut ctx = inner.op_ctx(p, "put message");
        let owned: Box<[u8]> = src.into();
        let buf = owned.as_ptr();
        ctx.bounce = Some(owned);
        let mut prm = Inner::params(ctx);
        prm.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_FLAGS;
        prm.flags = sys::UCP_AM_SEND_FLAG_COPY_HEADER | sys::UCP_AM_SEND_FLAG_EAGER;
        // SAFETY: a live endpoint (the caller holds the peer's lock); the
        // header is copied; the bytes are the request's until it completes.
        let r = unsafe {
            inner.ucp.lib.ucp_am_send_nbx(
                ep,
                wire::id::PUT,
                h.as_ptr().cast(),
                h.len(),
                buf.cast(),
                src.len(),
                &raw const prm,
            )
        };
        inner
            .launched(&prm, r)
            .map_err(|st| self.failed(p, "put message", st))?;
        p.am_sent.store(seq, Ordering::Release);
        Ok(())
    }

    /// Waits until the target executed every put message sent to `p` so
    /// far (`what`: what waits, for the error), or with its first
    /// refusal, the path's error, the job's failure or `deadline`.
    pub(super) fn am_sync(&self, p: &Peer, deadline: Instant, what: &str) -> Result<(), NetError> {
        let inner = &self.inner;
        let upto = p.am_sent.load(Ordering::Acquire);
        if upto <= p.am_synced.load(Ordering::Acquire) {
            return inner.broken(p);
        }
        let id = inner.next_id.fetch_add(1, Ordering::Relaxed);
        lock(&inner.synced).insert(id, None);
        let y = wire::Sync {
            from: u32::try_from(inner.rank).unwrap_or(u32::MAX),
            id,
            upto,
        };
        if let Err(why) = inner.send(p, wire::id::SYNC, &y.encode(), Vec::new()) {
            lock(&inner.synced).remove(&id);
            inner.broken(p)?;
            return Err(NetError::Broken {
                peer: p.rank,
                why: format!("cannot ask for the execution of put messages: {why}"),
            });
        }
        self.am_wait(p, id, upto, deadline, what).map(|_| ())
    }

    /// An atomic on the word at `key` and `offset` of `p`, as a message
    /// executed after the put messages before it (instead of a sync and
    /// then an RMA atomic: one round trip, not two); its old value.
    pub(super) fn am_atomic(
        &self,
        p: &Peer,
        remote: &std::sync::Arc<super::Remote>,
        at: crate::transport::Target<'_>,
        op: crate::transport::AtomicOp,
        deadline: Instant,
    ) -> Result<u64, NetError> {
        let inner = &self.inner;
        let (key, offset) = at.key_at(p.rank, "ucx")?;
        let id = inner.next_id.fetch_add(1, Ordering::Relaxed);
        lock(&inner.synced).insert(id, None);
        let (a, swap) = match op {
            crate::transport::AtomicOp::FetchAdd(v) => (v, None),
            crate::transport::AtomicOp::CompareSwap { expected, desired } => {
                (expected, Some(desired))
            }
        };
        let sent = self.with_ep(p, "ucp_am_send_nbx (atomic)", |_, st| {
            if !Self::still(st, remote) {
                return Ok(None);
            }
            let seq = p.am_sent.load(Ordering::Acquire) + 1;
            let h = wire::AmAtomic {
                from: u32::try_from(inner.rank).unwrap_or(u32::MAX),
                seq,
                id,
                key,
                offset,
                swap,
                a,
            };
            // The peer's lock is held: `send` takes it, so send here.
            inner
                .send_locked(p, st, wire::id::ATOMIC, &h.encode(), Vec::new())
                .map_err(|why| NetError::Broken {
                    peer: p.rank,
                    why: format!("cannot send an atomic: {why}"),
                })?;
            p.am_sent.store(seq, Ordering::Release);
            Ok(Some(seq))
        });
        let seq = match sent {
            Ok(Some(seq)) => seq,
            Ok(None) => {
                lock(&inner.synced).remove(&id);
                return Err(super::revoked(p.rank, at, 8, "atomic"));
            }
            Err(e) => {
                lock(&inner.synced).remove(&id);
                return Err(e);
            }
        };
        self.am_wait(p, id, seq, deadline, "an atomic's answer")
    }

    /// Waits for the answer `id` to a sync or atomic covering the
    /// messages up to `upto`; the atomic's old value.
    fn am_wait(
        &self,
        p: &Peer,
        id: u64,
        upto: u64,
        deadline: Instant,
        what: &str,
    ) -> Result<u64, NetError> {
        let inner = &self.inner;
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            if let Some((done, value, refused)) = {
                let mut s = lock(&inner.synced);
                let got = s.get_mut(&id).and_then(Option::take);
                if got.is_some() {
                    s.remove(&id);
                }
                got
            } {
                p.am_synced.fetch_max(done, Ordering::AcqRel);
                if let Some(why) = refused {
                    let _ = p.refused.set(why);
                }
                inner.broken(p)?;
                return Ok(value);
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(256) {
                let err = if let Err(e) = inner.broken(p) {
                    Some(e)
                } else if let Err(job) = inner.job() {
                    Some(NetError::Broken {
                        peer: p.rank,
                        why: job,
                    })
                } else if Instant::now() > deadline {
                    let what = format!("{what} (messages up to #{upto})");
                    inner.blame(p.rank, start.elapsed(), &what);
                    Some(NetError::Timeout {
                        peer: p.rank,
                        what,
                        waited: start.elapsed(),
                    })
                } else {
                    None
                };
                if let Some(e) = err {
                    lock(&inner.synced).remove(&id);
                    if !matches!(e, NetError::Refused { .. }) {
                        p.error.set(e.to_string());
                    }
                    return Err(e);
                }
            }
            if inner.ucp.progress() == 0 {
                std::thread::yield_now();
            }
        }
    }

    /// Before a request that goes by RMA: the put messages before it are
    /// executed first.
    pub(super) fn after_am(&self, p: &Peer) -> Result<(), NetError> {
        if !p.am_pending() {
            return Ok(());
        }
        self.am_sync(
            p,
            Instant::now() + self.inner.timeout,
            "the put messages before a request ordered after them",
        )
    }
}

#[cfg(test)]
mod unit {
    use super::{AM_MAX, AM_MAX_TCP, TCP_SEGMENTS, default_limit, tcp_segments};

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    /// 64 KiB only where every lane carrying host memory is tcp and the
    /// context has gin-rs's tcp segments; GPU memory-type lanes are left
    /// out; an endpoint UCX says nothing about keeps the general default.
    #[test]
    fn the_default_limit_is_64_kib_over_tcp_alone_with_the_segments_else_16() {
        assert_eq!(default_limit(&names(&["tcp", "tcp"]), true), AM_MAX_TCP);
        assert_eq!(
            default_limit(&names(&["tcp", "cuda_copy", "cuda_ipc"]), true),
            AM_MAX_TCP
        );
        assert_eq!(default_limit(&names(&["tcp", "tcp"]), false), AM_MAX);
        assert_eq!(default_limit(&names(&["posix", "cma"]), true), AM_MAX);
        assert_eq!(default_limit(&names(&["tcp", "posix"]), true), AM_MAX);
        assert_eq!(default_limit(&names(&["rc_mlx5", "tcp"]), true), AM_MAX);
        assert_eq!(default_limit(&names(&["cuda_ipc"]), true), AM_MAX);
        assert_eq!(default_limit(&[], true), AM_MAX);
    }

    /// The segments are set, receive first, unless the environment sets
    /// either of them (then none: a send segment above the receive one is
    /// refused by UCX).
    #[test]
    fn tcp_segments_are_set_receive_first_unless_the_environment_sets_one() {
        let all = tcp_segments(|_| None);
        assert_eq!(all.len(), 2);
        assert_eq!(all[0].0, "TCP_RX_SEG_SIZE");
        assert_eq!(all[1].0, "TCP_TX_SEG_SIZE");
        assert_eq!(TCP_SEGMENTS[0].1, all[0].1);
        for (name, _) in TCP_SEGMENTS {
            let env = format!("UCX_{name}");
            let set = tcp_segments(|v| (v == env).then(|| "32k".to_owned()));
            assert!(set.is_empty(), "{name}");
        }
    }
}
