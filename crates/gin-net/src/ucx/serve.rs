//! The owner's side of the ucx transport, and the progress thread: regions
//! are mapped and their rkeys packed when they are registered (on the
//! registering thread, which for a CUDA rank has its context current), or
//! when a peer first asks for a key of a region registered before the
//! transport started; every request is answered, with UCX's status when
//! the mapping failed; rkeys are revoked at every peer that holds them
//! when the region stops being served.

use std::collections::HashSet;
use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::worker::{Context, Started, Ucp, started};
use super::{Inner, Peer, Work, lock, sys, wire};
use crate::NetError;
use crate::region::{RegionInfo, RegionObserver, Removal};

/// `UCP_MEM_MAP_ALLOCATE` (ucp.h's flags of `ucp_mem_map`, an anonymous
/// enum bindgen does not generate): UCX allocates the memory it maps.
const MEM_MAP_ALLOCATE: u32 = 1 << 1;

/// A memory handle of the context, shared by threads.
#[derive(Clone, Copy)]
pub(super) struct MemH(sys::ucp_mem_h);

// SAFETY: a memory handle of a context shared by threads
// (`mt_workers_shared`); UCX serialises calls on it.
unsafe impl Send for MemH {}
// SAFETY: as above; this side only passes it to UCX.
unsafe impl Sync for MemH {}

/// Window memory UCX allocated for this rank ([`Inner::alloc_host`]), by
/// base: its length and handle. A region registered there gets its rkey
/// packed from that handle ([`Inner::map`]), not from a second
/// `ucp_mem_map` by address, which would register it with the memory
/// domains that register memory (cma) but not with the one that made it
/// (posix shared memory), so peers' atomics would be emulated by this
/// rank's progress thread again.
pub(super) type Allocations = Arc<Mutex<std::collections::HashMap<usize, (usize, MemH)>>>;

/// Owns window memory UCX allocated: dropping it unmaps (frees) it. Holds
/// the context (not the worker, which the transport destroys when it
/// goes), so memory outliving the transport (a window dropped after it, a
/// quarantined one leaked) is freed with a live context or never.
struct Allocation {
    context: Arc<Context>,
    allocations: Allocations,
    base: usize,
    memh: MemH,
}

impl Drop for Allocation {
    fn drop(&mut self) {
        #[cfg(test)]
        if super::tests::IN_CALLBACK.with(std::cell::Cell::get) {
            super::tests::UNMAPPED_IN_CALLBACK.fetch_add(1, Ordering::AcqRel);
        }
        lock(&self.allocations).remove(&self.base);
        // SAFETY: allocated and mapped once by `Inner::alloc_host`, unmapped
        // once here; the window registered on it was removed from the
        // region table before its keeper (this) dropped, and a mapping
        // packed from it borrows the handle without unmapping it.
        let _ = unsafe {
            self.context
                .lib
                .ucp_mem_unmap(self.context.ctx, self.memh.0)
        };
    }
}

/// A region this rank mapped for its peers.
pub(super) struct Mapping {
    memh: sys::ucp_mem_h,
    /// The handle is an [`Allocation`]'s, which unmaps it: not unmapped
    /// with the mapping.
    borrowed: bool,
    base: usize,
    served: wire::Served,
    /// Peers that were sent its rkey.
    pub(super) holders: HashSet<usize>,
}

// SAFETY: a memory handle of a context shared by threads
// (`mt_workers_shared`); only used under the `served` lock.
unsafe impl Send for Mapping {}

impl Mapping {
    /// The region's base.
    #[cfg(test)]
    pub(super) fn base(&self) -> usize {
        self.base
    }

    /// Whether its handle is the one that allocated the region (an
    /// [`Allocation`]'s), rather than a mapping of memory gin-rs allocated.
    #[cfg(test)]
    pub(super) fn borrowed(&self) -> bool {
        self.borrowed
    }

    pub(super) fn unmap(self, ucp: &Ucp) {
        if self.borrowed {
            return;
        }
        // SAFETY: mapped once by `map`, unmapped once (the mapping was
        // taken out of the table).
        let _ = unsafe { ucp.lib.ucp_mem_unmap(ucp.ctx, self.memh) };
    }
}

/// `ucp_mem_map`'s parameters for a region: its address and length, and
/// for GPU memory (a region behind a backing, whose base is its device
/// address) the CUDA memory type, so UCX registers it with its CUDA
/// memory domains (cuda_ipc between processes of a host, GPUDirect RDMA
/// on a NIC) instead of probing it. `None`: a length this process cannot
/// address.
pub(super) fn map_params(info: &crate::region::RegionInfo) -> Option<sys::ucp_mem_map_params_t> {
    let mut p = sys::ucp_mem_map_params_t {
        field_mask: u64::from(
            sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH,
        ),
        address: info.base as *mut c_void,
        length: usize::try_from(info.len).ok()?,
        ..Default::default()
    };
    if info.backed {
        p.field_mask |= u64::from(sys::UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE);
        p.memory_type = sys::UCS_MEMORY_TYPE_CUDA;
    }
    Some(p)
}

/// Registers the transport's active-message handlers on the worker.
pub(super) fn set_handlers(inner: &Arc<Inner>) -> Result<(), NetError> {
    for (id, cb) in [
        (wire::id::ASK, on_ask as AmCb),
        (wire::id::ANSWER, on_answer),
        (wire::id::REVOKE, on_revoke),
        (wire::id::REVOKED, on_revoked),
        (wire::id::PING, on_ping),
        (wire::id::PONG, on_pong),
        (wire::id::PUT, super::am::on_put),
        (wire::id::SYNC, super::am::on_sync),
        (wire::id::SYNCED, super::am::on_synced),
        (wire::id::ATOMIC, super::am::on_atomic),
    ] {
        let p = sys::ucp_am_handler_param_t {
            field_mask: u64::from(
                sys::UCP_AM_HANDLER_PARAM_FIELD_ID
                    | sys::UCP_AM_HANDLER_PARAM_FIELD_CB
                    | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG,
            ),
            id,
            cb: Some(cb),
            // The handlers run only while the worker lives, which `Inner`
            // owns: the pointer is valid whenever they run.
            arg: Arc::as_ptr(inner).cast_mut().cast(),
            ..Default::default()
        };
        // SAFETY: a live worker and a valid parameter block.
        let st = unsafe {
            inner
                .ucp
                .lib
                .ucp_worker_set_am_recv_handler(inner.ucp.worker, &raw const p)
        };
        if st != sys::UCS_OK {
            return Err(super::worker::setup_error(
                &inner.ucp.lib,
                "ucp_worker_set_am_recv_handler",
                st,
            ));
        }
    }
    Ok(())
}

type AmCb = unsafe extern "C" fn(
    *mut c_void,
    *const c_void,
    usize,
    *mut c_void,
    usize,
    *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t;

/// The handler's argument and header.
///
/// # Safety
/// As UCX calls a handler: `arg` is what `set_handlers` registered and
/// `header` points to `len` bytes (or is unused when `len` is 0).
pub(super) unsafe fn parts<'a>(
    arg: *mut c_void,
    header: *const c_void,
    len: usize,
) -> (&'a Inner, &'a [u8]) {
    // SAFETY: see the function's contract.
    unsafe {
        let h = if len == 0 {
            &[][..]
        } else {
            std::slice::from_raw_parts(header.cast::<u8>(), len)
        };
        (&*arg.cast::<Inner>(), h)
    }
}

unsafe extern "C" fn on_ask(
    arg: *mut c_void,
    header: *const c_void,
    hlen: usize,
    _data: *mut c_void,
    _len: usize,
    _param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: called by UCX as registered.
    let (inner, h) = unsafe { parts(arg, header, hlen) };
    if let Some(a) = wire::Ask::decode(h) {
        inner.queue(Work::Serve {
            from: a.from as usize,
            key: a.key,
            id: a.id,
        });
    }
    sys::UCS_OK
}

unsafe extern "C" fn on_answer(
    arg: *mut c_void,
    header: *const c_void,
    hlen: usize,
    data: *mut c_void,
    len: usize,
    _param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: called by UCX as registered.
    let (inner, h) = unsafe { parts(arg, header, hlen) };
    let Some(a) = wire::Answer::decode(h) else {
        return sys::UCS_OK;
    };
    let body = if len == 0 || data.is_null() {
        &[][..]
    } else {
        // SAFETY: UCX passes `len` bytes of data, valid during the call.
        unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) }
    };
    let got = match a.status {
        Ok(()) => wire::Served::decode(body).ok_or(wire::Refusal::Internal),
        Err(r) => Err(r),
    };
    if let Some(slot) = lock(&inner.answers).get_mut(&a.id) {
        *slot = Some(got);
    }
    sys::UCS_OK
}

unsafe extern "C" fn on_revoke(
    arg: *mut c_void,
    header: *const c_void,
    hlen: usize,
    _data: *mut c_void,
    _len: usize,
    _param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: called by UCX as registered.
    let (inner, h) = unsafe { parts(arg, header, hlen) };
    if let Some(a) = wire::Ask::decode(h) {
        inner.queue(Work::Revoke {
            owner: a.from as usize,
            key: a.key,
        });
    }
    sys::UCS_OK
}

unsafe extern "C" fn on_revoked(
    arg: *mut c_void,
    header: *const c_void,
    hlen: usize,
    _data: *mut c_void,
    _len: usize,
    _param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: called by UCX as registered.
    let (inner, h) = unsafe { parts(arg, header, hlen) };
    if let Some(a) = wire::Ask::decode(h) {
        lock(&inner.acks).remove(&(a.key, a.from as usize));
    }
    sys::UCS_OK
}

unsafe extern "C" fn on_ping(
    arg: *mut c_void,
    header: *const c_void,
    hlen: usize,
    _data: *mut c_void,
    _len: usize,
    _param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: called by UCX as registered.
    let (inner, h) = unsafe { parts(arg, header, hlen) };
    if let Some(a) = wire::Ask::decode(h) {
        inner.queue(Work::Pong {
            to: a.from as usize,
        });
    }
    sys::UCS_OK
}

unsafe extern "C" fn on_pong(
    arg: *mut c_void,
    header: *const c_void,
    hlen: usize,
    _data: *mut c_void,
    _len: usize,
    _param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: called by UCX as registered.
    let (inner, h) = unsafe { parts(arg, header, hlen) };
    if let Some(a) = wire::Ask::decode(h) {
        lock(&inner.heard).insert(a.from as usize, Instant::now());
    }
    sys::UCS_OK
}

/// What a message send owns until it completes.
struct Sending {
    data: Vec<u8>,
    lib: *const sys::UcpLib,
}

/// Completion of a message send: frees what it carried and the request.
unsafe extern "C" fn sent(req: *mut c_void, status: sys::ucs_status_t, user: *mut c_void) {
    if status != sys::UCS_OK {
        // Its receiver times out waiting (naming what it waited for).
        tracing::warn!(status, "a ucx transport message was not delivered");
    }
    // SAFETY: the `Box<Sending>` leaked by `send`; each request completes
    // once; the library outlives every request.
    unsafe {
        let s = Box::from_raw(user.cast::<Sending>());
        (*s.lib).ucp_request_free(req);
    }
}

impl Inner {
    pub(super) fn queue(&self, w: Work) {
        lock(&self.work).push(w);
        self.ucp.signal();
    }

    /// Sends an active message to `peer` (header copied, `data` owned by
    /// the request until sent); why not, when it could not be sent.
    pub(super) fn send(
        &self,
        peer: &Peer,
        id: u32,
        header: &[u8],
        data: Vec<u8>,
    ) -> Result<(), String> {
        let s = lock(&peer.state);
        self.send_locked(peer, &s, id, header, data)
    }

    /// As [`Inner::send`], with the peer's lock held (`s` is its state).
    pub(super) fn send_locked(
        &self,
        peer: &Peer,
        s: &super::PeerState,
        id: u32,
        header: &[u8],
        data: Vec<u8>,
    ) -> Result<(), String> {
        if s.ep.is_null() {
            return Err(format!("the endpoint to rank {} is closed", peer.rank));
        }
        let data = Box::new(Sending {
            data,
            lib: Arc::as_ptr(&self.ucp.lib),
        });
        let (ptr, n) = (data.data.as_ptr(), data.data.len());
        let mut p = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK
                | sys::UCP_OP_ATTR_FIELD_USER_DATA
                | sys::UCP_OP_ATTR_FIELD_FLAGS,
            flags: sys::UCP_AM_SEND_FLAG_COPY_HEADER,
            user_data: Box::into_raw(data).cast(),
            ..Default::default()
        };
        p.cb.send = Some(sent);
        // SAFETY: a live endpoint under the peer's lock; the header is
        // copied; the data is owned by the request until `sent` runs.
        let r = unsafe {
            self.ucp.lib.ucp_am_send_nbx(
                s.ep,
                id,
                header.as_ptr().cast(),
                header.len(),
                ptr.cast(),
                n,
                &raw const p,
            )
        };
        let st = started(r);
        if !matches!(st, Started::Pending(_)) {
            // SAFETY: UCX did not keep the data (no callback runs).
            drop(unsafe { Box::from_raw(p.user_data.cast::<Sending>()) });
        }
        match st {
            // `sent` frees it and the request.
            Started::Pending(_) | Started::Done => Ok(()),
            Started::Failed(st) => Err(format!("ucp_am_send_nbx failed: {}", self.ucp.text(st))),
        }
    }

    /// Answers `from`'s request for `key`'s rkey, always: with the rkey
    /// (mapped at registration, or now), or with why not (an unknown key,
    /// the UCX call that failed and its status, or an internal failure).
    fn serve(&self, from: usize, key: u32, id: u64) {
        let Some(peer) = self.peer_opt(from) else {
            tracing::warn!(
                rank = self.rank,
                from,
                key,
                "an rkey request from a rank this transport does not reach"
            );
            return;
        };
        let answer = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // A GPU region mapped here (registered before the transport
            // started) needs its context current on this thread.
            if let Some(h) = self.table.thread_context(key) {
                h();
                self.adopt_thread_context(h);
            }
            self.answer_for(from, key)
        }))
        .unwrap_or_else(|_| {
            tracing::error!(
                rank = self.rank,
                from,
                key,
                "serving an rkey request panicked"
            );
            Err(wire::Refusal::Internal)
        });
        if let Err(r) = answer {
            tracing::warn!(
                rank = self.rank,
                from,
                key = format_args!("{key:#010x}"),
                ?r,
                "refusing an rkey request"
            );
        }
        let (status, data) = match answer {
            Ok(s) => (Ok(()), s.encode()),
            Err(r) => (Err(r), Vec::new()),
        };
        if let Err(why) = self.send(
            peer,
            wire::id::ANSWER,
            &wire::Answer { id, status }.encode(),
            data,
        ) {
            tracing::warn!(rank = self.rank, to = from, key, %why, "cannot answer an rkey request");
        }
    }

    /// The rkey of `key` for `from`: the mapping made at registration, or
    /// one made now (a region registered before this transport started);
    /// a mapping that failed is refused with the failed call and status.
    fn answer_for(&self, from: usize, key: u32) -> Result<wire::Served, wire::Refusal> {
        self.table.with_region(key, |info| {
            let info = info.ok_or(wire::Refusal::Unknown)?;
            if let Some(&(_, r)) = lock(&self.failed)
                .get(&key)
                .filter(|(b, _)| *b == info.base)
            {
                return Err(r);
            }
            let mut served = lock(&self.served);
            if let Some(m) = served.get_mut(&key).filter(|m| m.base == info.base) {
                m.holders.insert(from);
                return Ok(m.served.clone());
            }
            let mut m = self.map(info).map_err(|f| refusal(info, f))?;
            m.holders.insert(from);
            let s = m.served.clone();
            if let Some(old) = served.insert(key, m) {
                old.unmap(&self.ucp);
            }
            Ok(s)
        })
    }

    /// Has the progress thread make `h` current on itself (a device
    /// context: UCX executes peers' software-emulated writes into GPU
    /// memory there).
    pub(super) fn adopt_thread_context(&self, h: crate::region::ThreadContext) {
        let mut cur = lock(&self.thread_context);
        if cur.as_ref().is_some_and(|c| Arc::ptr_eq(c, &h)) {
            return;
        }
        *cur = Some(h);
        self.thread_context_changes.fetch_add(1, Ordering::AcqRel);
        drop(cur);
        self.ucp.signal();
    }

    /// Runs the newest thread-context hook on the calling thread (the
    /// progress thread) if it changed since `seen`.
    fn enter_thread_context(&self, seen: &mut u64) {
        let now = self.thread_context_changes.load(Ordering::Acquire);
        if now != *seen {
            *seen = now;
            let h = lock(&self.thread_context).clone();
            if let Some(h) = h {
                h();
            }
        }
    }

    /// Maps a region just registered, on the registering thread (a CUDA
    /// rank's, where its context is current); a failure is kept and
    /// answered to every peer that asks. A GPU region's thread-context
    /// hook is handed to the progress thread.
    fn map_registered(&self, key: u32, base: usize) {
        self.map_registered_here(key, base);
        if let Some(h) = self.table.thread_context(key) {
            self.adopt_thread_context(h);
        }
    }

    fn map_registered_here(&self, key: u32, base: usize) {
        self.table.with_region(key, |info| {
            // Removed (or the key drawn again) meanwhile: nothing to map.
            let Some(info) = info.filter(|i| i.base == base) else {
                return;
            };
            let mut served = lock(&self.served);
            if served.get(&key).is_some_and(|m| m.base == base) {
                return;
            }
            match self.map(info) {
                Ok(m) => {
                    if let Some(old) = served.insert(key, m) {
                        old.unmap(&self.ucp);
                    }
                }
                Err(f) => {
                    tracing::warn!(
                        rank = self.rank,
                        key = format_args!("{key:#010x}"),
                        gpu = info.backed,
                        call = f.call.name(),
                        status = %self.ucp.text(f.status),
                        "cannot map a registered region with UCX; peers asking for it are refused"
                    );
                    lock(&self.failed).insert(key, (base, refusal(info, f)));
                }
            }
        });
    }

    /// `bytes` of zeroed host memory allocated by UCX (`ucp_mem_map` with
    /// `UCP_MEM_MAP_ALLOCATE`: over its shared-memory transports a posix
    /// segment peers attach, so a peer's atomic there is its own CPU atomic),
    /// freed when the returned memory drops.
    pub(super) fn alloc_host(&self, bytes: usize) -> Result<crate::HostMemory, NetError> {
        let fail = |call: &str, st: sys::ucs_status_t| NetError::Io {
            what: format!(
                "rank {}: allocating {bytes} bytes of window memory with UCX ({call}; GIN_UCX_ALLOC=0 makes a shared segment instead)",
                self.rank
            ),
            source: std::io::Error::other(self.ucp.text(st)),
        };
        let params = sys::ucp_mem_map_params_t {
            field_mask: u64::from(
                sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                    | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                    | sys::UCP_MEM_MAP_PARAM_FIELD_FLAGS,
            ),
            address: std::ptr::null_mut(),
            length: bytes,
            flags: MEM_MAP_ALLOCATE,
            ..Default::default()
        };
        // SAFETY: UCX allocates the memory (MEM_MAP_ALLOCATE).
        let memh = unsafe { self.ucp.mem_map(&params) }.map_err(|st| fail("ucp_mem_map", st))?;
        let mut attr = sys::ucp_mem_attr_t {
            field_mask: u64::from(sys::UCP_MEM_ATTR_FIELD_ADDRESS | sys::UCP_MEM_ATTR_FIELD_LENGTH),
            ..Default::default()
        };
        // SAFETY: a live handle and a valid out-pointer.
        let st = unsafe { self.ucp.lib.ucp_mem_query(memh, &raw mut attr) };
        let base = attr.address as usize;
        let wrong = if st != sys::UCS_OK {
            Some(fail("ucp_mem_query", st))
        } else if base == 0 || attr.length < bytes || !base.is_multiple_of(8) {
            Some(NetError::Io {
                what: format!(
                    "rank {}: allocating {bytes} bytes of window memory with UCX (ucp_mem_map gave {} bytes at {base:#x}: null, short or not 8-byte aligned; GIN_UCX_ALLOC=0 makes a shared segment instead)",
                    self.rank, attr.length
                ),
                source: std::io::Error::other("unusable memory from UCX"),
            })
        } else {
            None
        };
        if let Some(e) = wrong {
            // SAFETY: mapped above, unmapped once.
            let _ = unsafe { self.ucp.lib.ucp_mem_unmap(self.ucp.ctx, memh) };
            return Err(e);
        }
        // SAFETY: UCX allocated at least `bytes` at `base` for this
        // process; nobody else knows it yet. Zeroed, as a new segment is
        // (UCX's heap fallback is not).
        unsafe { std::ptr::write_bytes(base as *mut u8, 0, bytes) };
        lock(&self.allocations).insert(base, (bytes, MemH(memh)));
        let owner = Allocation {
            context: self.ucp.context.clone(),
            allocations: self.allocations.clone(),
            base,
            memh: MemH(memh),
        };
        // SAFETY: 8-byte aligned, zeroed, valid for `bytes` until `owner`
        // unmaps it, and only `owner` frees it.
        Ok(unsafe { crate::HostMemory::new(base as *mut u8, bytes, Box::new(owner)) })
    }

    /// `ucp_mem_map` and `ucp_rkey_pack` of a region (called under the
    /// table's read guard: the memory stays valid meanwhile).
    fn map(&self, info: RegionInfo) -> Result<Mapping, wire::Failure> {
        let fail = |call, status| wire::Failure { call, status };
        let params =
            map_params(&info).ok_or(fail(wire::Call::MemMap, sys::UCS_ERR_INVALID_PARAM))?;
        #[cfg(test)]
        self.test.mapping_on_this_thread(info.base);
        #[cfg(test)]
        let params = if self.test.backed_as_host.load(Ordering::Acquire) {
            map_params(&RegionInfo {
                backed: false,
                ..info
            })
            .unwrap_or(params)
        } else {
            params
        };
        #[cfg(test)]
        if let Some(st) = self.test.map_fails() {
            return Err(fail(wire::Call::MemMap, st));
        }
        let allocated = lock(&self.allocations)
            .get(&info.base)
            .filter(|&&(len, _)| !info.backed && info.len <= len as u64)
            .map(|&(_, h)| h.0);
        let borrowed = allocated.is_some();
        let memh = match allocated {
            Some(h) => h,
            None => {
                // SAFETY: a registered region (valid while the guard is
                // held); UCX registers it without allocating.
                unsafe { self.ucp.mem_map(&params) }.map_err(|st| fail(wire::Call::MemMap, st))?
            }
        };
        let (mut buf, mut n): (*mut c_void, usize) = (std::ptr::null_mut(), 0);
        // SAFETY: a live memory handle; valid out-pointers; released below.
        let st = unsafe {
            self.ucp
                .lib
                .ucp_rkey_pack(self.ucp.ctx, memh, &raw mut buf, &raw mut n)
        };
        if st != sys::UCS_OK {
            if !borrowed {
                // SAFETY: mapped above, unmapped once.
                let _ = unsafe { self.ucp.lib.ucp_mem_unmap(self.ucp.ctx, memh) };
            }
            return Err(fail(wire::Call::RkeyPack, st));
        }
        // SAFETY: UCX returned `n` bytes at `buf`.
        let rkey = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), n) }.to_vec();
        // SAFETY: returned by `ucp_rkey_pack`, released once.
        unsafe { self.ucp.lib.ucp_rkey_buffer_release(buf) };
        Ok(Mapping {
            memh,
            borrowed,
            base: info.base,
            served: wire::Served {
                base: info.base as u64,
                len: info.len,
                access: info.access,
                backed: info.backed,
                rkey,
            },
            holders: HashSet::new(),
        })
    }

    /// Drops `key`'s rkey from `owner`, then flushes what was sent to it
    /// and acknowledges once the flush completed (the owner unmaps only
    /// after that). Never waits here: the flush's completion queues the
    /// acknowledgement, so the progress thread keeps answering meanwhile.
    fn revoke(&self, owner: usize, key: u32) {
        let Some(peer) = self.peer_opt(owner) else {
            return;
        };
        let ctx = Box::new(Flushed {
            work: self.work.clone(),
            lib: Arc::as_ptr(&self.ucp.lib),
            owner,
            key,
        });
        let mut p = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK | sys::UCP_OP_ATTR_FIELD_USER_DATA,
            user_data: Box::into_raw(ctx).cast(),
            ..Default::default()
        };
        p.cb.send = Some(flushed);
        let r = {
            let mut s = lock(&peer.state);
            if let Some(r) = s.keys.remove(&key) {
                s.graveyard.push(r);
            }
            s.revoked.insert(key);
            if s.ep.is_null() {
                None
            } else {
                // SAFETY: a live endpoint under the peer's lock; the
                // context is the callback's until it runs.
                Some(unsafe { self.ucp.lib.ucp_ep_flush_nbx(s.ep, &raw const p) })
            }
        };
        match r.map(started) {
            // `flushed` queues the acknowledgement.
            Some(Started::Pending(_)) => {}
            Some(Started::Done | Started::Failed(_)) => {
                // SAFETY: UCX did not keep the context (no callback runs).
                drop(unsafe { Box::from_raw(p.user_data.cast::<Flushed>()) });
                self.acknowledge(owner, key);
            }
            None => {
                // SAFETY: never handed to UCX.
                drop(unsafe { Box::from_raw(p.user_data.cast::<Flushed>()) });
            }
        }
    }

    /// Tells `owner` that `key`'s rkey is dropped and what was sent before
    /// is complete.
    fn acknowledge(&self, owner: usize, key: u32) {
        let Some(peer) = self.peer_opt(owner) else {
            return;
        };
        #[cfg(test)]
        if self.test.hold_ack(owner, key) {
            return;
        }
        let ack = wire::Ask {
            from: u32::try_from(self.rank).unwrap_or(u32::MAX),
            key,
            id: 0,
        };
        if let Err(why) = self.send(peer, wire::id::REVOKED, &ack.encode(), Vec::new()) {
            tracing::warn!(rank = self.rank, owner, key, %why, "cannot acknowledge a revocation");
        }
    }

    /// Sends `to` a message with this rank's id and nothing else (a ping
    /// or its answer).
    fn signal_to(&self, to: usize, id: u32) {
        let Some(peer) = self.peer_opt(to) else {
            return;
        };
        let h = wire::Ask {
            from: u32::try_from(self.rank).unwrap_or(u32::MAX),
            key: 0,
            id: 0,
        };
        if let Err(why) = self.send(peer, id, &h.encode(), Vec::new()) {
            tracing::debug!(rank = self.rank, to, id, %why, "cannot send a liveness message");
        }
    }

    /// Does the queued work; whether there was any.
    fn drain(&self) -> bool {
        let work = std::mem::take(&mut *lock(&self.work));
        let any = !work.is_empty();
        for w in work {
            match w {
                Work::Serve { from, key, id } => self.serve(from, key, id),
                Work::Revoke { owner, key } => self.revoke(owner, key),
                Work::Acknowledge { owner, key } => self.acknowledge(owner, key),
                Work::Pong { to } => self.signal_to(to, wire::id::PONG),
                Work::Synced {
                    to,
                    id,
                    done,
                    value,
                    refused,
                } => self.am_answer(to, id, done, value, refused),
            }
        }
        any
    }

    /// Progresses the worker until it has nothing more to do, work was
    /// queued or the transport is closing; whether anything happened.
    fn progress_until_idle(&self) -> bool {
        let mut any = false;
        loop {
            let began = Instant::now();
            let n = self.ucp.progress();
            // Waiting for the worker held by another thread's call, or
            // for a callback: either way nothing was answered meanwhile.
            self.held(began, None, "ucp_worker_progress on the progress thread");
            if n == 0 {
                break;
            }
            any = true;
            if self.closing.load(Ordering::Acquire) || !lock(&self.work).is_empty() {
                break;
            }
        }
        any
    }
}

/// The refusal for a region UCX could not map.
fn refusal(info: RegionInfo, f: wire::Failure) -> wire::Refusal {
    if info.backed {
        wire::Refusal::Device(f)
    } else {
        wire::Refusal::Map(f)
    }
}

/// What a revocation's flush needs to queue its acknowledgement.
struct Flushed {
    work: Arc<Mutex<Vec<Work>>>,
    lib: *const sys::UcpLib,
    owner: usize,
    key: u32,
}

/// Completion of a revocation's flush: queues the acknowledgement for the
/// progress thread. The callback takes no peer lock (it may run inside a
/// thread's progress that holds one) and does not call into the worker
/// (it may run while the worker is destroyed, cancelled): the progress
/// thread, which runs most completions itself, sees the work after its
/// progress call, or within its bounded sleep.
unsafe extern "C" fn flushed(req: *mut c_void, _status: sys::ucs_status_t, user: *mut c_void) {
    // SAFETY: the `Box<Flushed>` leaked by `revoke`; each request
    // completes once; the library outlives every request.
    unsafe {
        let f = Box::from_raw(user.cast::<Flushed>());
        lock(&f.work).push(Work::Acknowledge {
            owner: f.owner,
            key: f.key,
        });
        (*f.lib).ucp_request_free(req);
    }
}

impl RegionObserver for Inner {
    fn inserted(&self, key: u32, base: usize) {
        self.map_registered(key, base);
    }

    fn removed(&self, key: u32, base: usize) -> Removal {
        {
            let mut failed = lock(&self.failed);
            if failed.get(&key).is_some_and(|(b, _)| *b == base) {
                failed.remove(&key);
            }
        }
        let m = {
            let mut served = lock(&self.served);
            match served.get(&key) {
                Some(m) if m.base == base => served.remove(&key),
                _ => None,
            }
        };
        let Some(m) = m else {
            return Removal::Released;
        };
        let me = u32::try_from(self.rank).unwrap_or(u32::MAX);
        // Every holder may still write, reachable or not: a path this rank
        // gave up on (its own wait timed out, its endpoint closed here)
        // does not stop the peer's puts already under way; only an
        // acknowledgement or the peer's process gone does.
        let holders: Vec<&Peer> = m.holders.iter().filter_map(|&p| self.peer_opt(p)).collect();
        lock(&self.acks).extend(holders.iter().map(|p| (key, p.rank)));
        for p in holders.iter().filter(|p| Self::reachable(p)) {
            let revoke = wire::Ask {
                from: me,
                key,
                id: 0,
            };
            if let Err(why) = self.send(p, wire::id::REVOKE, &revoke.encode(), Vec::new()) {
                tracing::warn!(rank = self.rank, peer = p.rank, key, %why, "cannot revoke an rkey");
            }
        }
        match self.await_acks(key) {
            Removal::Released => {
                #[cfg(test)]
                lock(&self.test.unmapped).push(m.base);
                m.unmap(&self.ucp);
                Removal::Released
            }
            Removal::Quarantined => {
                // Still mapped, never reused through this transport: a
                // late put lands where it always would have.
                lock(&self.quarantined).push(m);
                Removal::Quarantined
            }
        }
    }
}

impl Inner {
    /// Whether `p` can still send: its path has not failed and its
    /// endpoint is open.
    fn reachable(p: &Peer) -> bool {
        p.error.get().is_none() && !lock(&p.state).ep.is_null()
    }

    /// Fails the path to each of `peers` whose process is gone (a peer on
    /// this kernel that died or exited cannot write any more).
    fn mark_gone(&self, peers: &[usize]) {
        for &p in peers {
            if let (Some(peer), Some(Some(id))) = (self.peer_opt(p), self.procs.get(p))
                && id.gone()
            {
                peer.error.set(format!(
                    "rank {p}'s process (pid {}) is gone: it died or exited",
                    id.pid()
                ));
            }
        }
    }

    /// Waits until every peer that held `key`'s rkey acknowledged its
    /// revocation (it dropped the rkey and flushed what it sent) or is gone
    /// (its process, where it runs on this kernel): then the memory may be
    /// reused ([`Removal::Released`]). A peer late to acknowledge is
    /// pinged every [`PING_EVERY`] (the log says whether it answered). The
    /// wait ends without every acknowledgement once the job has failed or
    /// a rank left, the transport is closing, or no holder left is
    /// reachable: a holder whose endpoint failed from its side (it left
    /// after flushing, or died) writes nothing more, but one this rank gave
    /// up on after a timeout (`Peer::gave_up`: silent, perhaps stopped) may
    /// still write, and so may one silent past the job's timeout (answering
    /// pings or not: a stopped rank, or one whose worker a UCX call holds).
    /// With such a holder the region is [`Removal::Quarantined`]: kept
    /// mapped here, its owner told to leak the memory rather than reuse
    /// it.
    fn await_acks(&self, key: u32) -> Removal {
        let start = Instant::now();
        let mut pinged: Option<Instant> = None;
        let mut spins = 0u32;
        let mut gone: Vec<usize> = Vec::new();
        let verdict = loop {
            let now = Instant::now();
            // Collected first, the lock let go before `reachable` takes a
            // peer's state lock: a thread issuing a put holds that one
            // while it waits for the worker, whose progress (on the
            // progress thread) takes this one to file an acknowledgement.
            let holders: Vec<usize> = lock(&self.acks)
                .iter()
                .filter(|(k, _)| *k == key)
                .map(|(_, p)| *p)
                .collect();
            let left: Vec<usize> = holders.into_iter().filter(|p| !gone.contains(p)).collect();
            if left.is_empty() {
                break Removal::Released;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(256) {
                self.mark_gone(&left);
                gone.extend(left.iter().copied().filter(|&p| self.is_gone(p)));
                let waiting: Vec<usize> = left
                    .iter()
                    .copied()
                    .filter(|p| !gone.contains(p))
                    .filter(|&p| self.peer_opt(p).is_some_and(Self::reachable))
                    .collect();
                let job_over = self.job().is_err();
                let closing = self.closing.load(Ordering::Acquire);
                if job_over || closing || waiting.is_empty() {
                    // No acknowledgement will come. A holder whose endpoint
                    // failed from its side (it left, flushing what it sent,
                    // or died) writes nothing more; one this rank gave up
                    // on after a timeout may still be alive and writing.
                    let left: Vec<usize> = left
                        .into_iter()
                        .filter(|p| !gone.contains(p))
                        .filter(|&p| {
                            self.peer_opt(p)
                                .is_some_and(|q| q.gave_up.load(Ordering::Acquire))
                        })
                        .collect();
                    if left.is_empty() {
                        break Removal::Released;
                    }
                    tracing::warn!(
                        rank = self.rank,
                        key = format_args!("{key:#010x}"),
                        ?left,
                        waited = ?start.elapsed(),
                        job_over,
                        closing,
                        "a revoked region's rkey holders will not acknowledge (the job failed, the transport is closing, or their paths failed here) and may still write: the region stays mapped and quarantined (its memory is leaked, not reused)"
                    );
                    break Removal::Quarantined;
                }
                if start.elapsed() > self.timeout {
                    let heard = lock(&self.heard);
                    let answering: Vec<usize> = waiting
                        .iter()
                        .copied()
                        .filter(|p| heard.get(p).is_some_and(|&t| t > start))
                        .collect();
                    drop(heard);
                    for &p in waiting.iter().filter(|p| !answering.contains(p)) {
                        self.blame(
                            p,
                            start.elapsed(),
                            &format!("the acknowledgement of the revocation of key {key:#010x}"),
                        );
                    }
                    tracing::error!(
                        rank = self.rank,
                        key = format_args!("{key:#010x}"),
                        left = ?waiting,
                        answering_pings = ?answering,
                        waited = ?start.elapsed(),
                        "peers never acknowledged the revocation of a region's rkey within the job's timeout, and nothing says they failed: their puts may still land, so the region stays mapped and quarantined (its memory is leaked, not reused)"
                    );
                    break Removal::Quarantined;
                }
                if pinged.is_none_or(|t| now.saturating_duration_since(t) > PING_EVERY) {
                    for &p in &waiting {
                        self.signal_to(p, wire::id::PING);
                    }
                    pinged = Some(now);
                }
            }
            if self.ucp.progress() == 0 {
                std::thread::yield_now();
            }
        };
        lock(&self.acks).retain(|(k, _)| *k != key);
        verdict
    }

    /// Whether `p`'s process is gone (only known for a peer on this
    /// kernel).
    fn is_gone(&self, p: usize) -> bool {
        matches!(self.procs.get(p), Some(Some(id)) if id.gone())
    }
}

/// How often such a peer is pinged.
const PING_EVERY: Duration = Duration::from_millis(200);

/// How often the progress thread asks the job's health (remembered once
/// it failed: see `Inner::job`).
const ASK_JOB_EVERY: Duration = Duration::from_millis(5);

/// The longest the idle progress thread sleeps on the worker's event
/// descriptor, in milliseconds.
const SLEEP_MS: i32 = 100;

/// Asks `peer` for `key`'s rkey and progresses until the answer arrives
/// (within the job's timeout). An owner late to answer is pinged every
/// [`PING_EVERY`] after [`ASK_PATIENCE`]: a timeout then says whether its
/// progress thread answered pings meanwhile (it received the request but
/// did not answer it) or nothing at all (its UCX worker made no progress:
/// a UCX call on another of its threads held it).
pub(super) fn ask(
    inner: &Inner,
    peer: &Peer,
    key: u32,
) -> Result<Result<wire::Served, wire::Refusal>, NetError> {
    let id = inner.next_id.fetch_add(1, Ordering::Relaxed);
    lock(&inner.answers).insert(id, None);
    let a = wire::Ask {
        from: u32::try_from(inner.rank).unwrap_or(u32::MAX),
        key,
        id,
    };
    if let Err(why) = inner.send(peer, wire::id::ASK, &a.encode(), Vec::new()) {
        lock(&inner.answers).remove(&id);
        inner.broken(peer)?;
        return Err(NetError::Broken {
            peer: peer.rank,
            why: format!("cannot ask for the rkey of key {key:#010x}: {why}"),
        });
    }
    let start = Instant::now();
    let mut pinged: Option<Instant> = None;
    let mut spins = 0u32;
    loop {
        {
            let mut answers = lock(&inner.answers);
            if let Some(got) = answers.get_mut(&id).and_then(Option::take) {
                answers.remove(&id);
                return Ok(got);
            }
        }
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(256) {
            let now = Instant::now();
            let err = if let Err(e) = inner.broken(peer) {
                Some(e)
            } else if let Err(job) = inner.job() {
                Some(NetError::Broken {
                    peer: peer.rank,
                    why: job,
                })
            } else if start.elapsed() > inner.timeout {
                Some(unanswered(inner, peer.rank, key, start, pinged.is_some()))
            } else {
                None
            };
            if let Some(e) = err {
                lock(&inner.answers).remove(&id);
                return Err(e);
            }
            let late = now.saturating_duration_since(start) > ASK_PATIENCE;
            if late && pinged.is_none_or(|t| now.saturating_duration_since(t) > PING_EVERY) {
                inner.signal_to(peer.rank, wire::id::PING);
                pinged = Some(now);
            }
        }
        if inner.ucp.progress() == 0 {
            std::thread::yield_now();
        }
    }
}

/// The timeout of a request for `key`'s rkey that `owner` never answered,
/// saying whether its progress thread answered a ping meanwhile.
fn unanswered(inner: &Inner, owner: usize, key: u32, start: Instant, pinged: bool) -> NetError {
    let heard = lock(&inner.heard).get(&owner).is_some_and(|&t| t > start);
    if !heard {
        inner.blame(
            owner,
            start.elapsed(),
            &format!("the rkey of key {key:#010x}"),
        );
    }
    let what = if heard {
        format!(
            "the rkey of key {key:#010x}: rank {owner}'s progress thread answered pings meanwhile but not this request (its log says why)"
        )
    } else if pinged {
        format!(
            "the rkey of key {key:#010x}: rank {owner} answered no ping either, so its UCX worker made no progress (a UCX call on another of its threads held the worker; its log names a call that took long)"
        )
    } else {
        format!("the rkey of key {key:#010x}")
    };
    NetError::Timeout {
        peer: owner,
        what,
        waited: start.elapsed(),
    }
}

/// How long a request for an rkey waits before its owner is pinged (an
/// owner answers within microseconds unless something holds it).
const ASK_PATIENCE: Duration = Duration::from_millis(500);

/// How long the progress thread keeps polling after the last event before
/// it sleeps on the worker's event descriptor: a message arriving within
/// it is handled without a wake-up (the latency of a ping-pong), one after
/// it costs one. At least `spin` (`GIN_UCX_SPIN`), and twice the quiet
/// time that ended in an event lately, up to [`SPIN_REACH`]: a stream of
/// messages a little slower than `spin` apart (1 MiB puts, each handled
/// here: their signals' emulated atomics) is not left to wake the thread
/// every time, which lengthens the gaps, which keeps it sleeping.
#[derive(Debug, Clone, Copy)]
pub(super) struct Idle {
    spin: Duration,
    last: Instant,
    /// The longest quiet time that ended in an event lately (a quarter
    /// of it forgotten at each event): none after a quiet time
    /// over [`SPIN_REACH`].
    reach: Duration,
}

/// The longest the progress thread polls after an event (when events came
/// that far apart lately): a stream sparser than this sleeps between its
/// messages.
pub(super) const SPIN_REACH: Duration = Duration::from_millis(1);

impl Idle {
    pub(super) fn new(spin: Duration, now: Instant) -> Self {
        Self {
            spin,
            last: now,
            reach: Duration::ZERO,
        }
    }

    /// Something is under way at `now` (a request of this rank in flight):
    /// not an event, no quiet time ended.
    pub(super) fn busy(&mut self, now: Instant) {
        self.last = now;
    }

    /// An event at `now` (a message handled, queued work done): ends the
    /// quiet time since the last one.
    pub(super) fn event(&mut self, now: Instant) {
        let quiet = now.saturating_duration_since(self.last);
        self.reach = if quiet > SPIN_REACH {
            Duration::ZERO
        } else {
            quiet.max(self.reach * 3 / 4)
        };
        self.last = now;
    }

    /// How long the thread polls after the last event now: `spin`, or
    /// twice the recent quiet time up to [`SPIN_REACH`]; nothing with no
    /// `spin` (`GIN_UCX_SPIN=0`: sleep whenever idle).
    pub(super) fn window(&self) -> Duration {
        if self.spin.is_zero() {
            return Duration::ZERO;
        }
        self.spin.max((self.reach * 2).min(SPIN_REACH))
    }

    /// Whether the thread may sleep at `now`.
    pub(super) fn may_sleep(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.last) >= self.window()
    }
}

/// Starts the progress thread: it does queued work and progresses the
/// worker; idle for longer than `spin`, it sleeps on the worker's event
/// descriptor. Every loop in it checks `closing`, so dropping the
/// transport joins it at once.
pub(super) fn spawn_progress(
    inner: &Arc<Inner>,
    spin: Duration,
) -> Result<JoinHandle<()>, NetError> {
    let efd = inner.ucp.efd()?;
    let inner = inner.clone();
    std::thread::Builder::new()
        .name(format!("gin-ucx-{}", inner.rank))
        .spawn(move || {
            let mut idle = Idle::new(spin, Instant::now());
            let mut context_seen = 0;
            let mut asked = Instant::now();
            while !inner.closing.load(Ordering::Acquire) {
                if asked.elapsed() >= ASK_JOB_EVERY {
                    // Remembered once failed (see `Inner::job`).
                    let _ = inner.job();
                    asked = Instant::now();
                }
                #[cfg(test)]
                if inner.test.stopped.load(Ordering::Acquire) {
                    // A stopped rank (SIGSTOP): its worker makes no progress.
                    std::thread::sleep(Duration::from_millis(1));
                    continue;
                }
                inner.enter_thread_context(&mut context_seen);
                if inner.issuing.load(Ordering::Acquire) > 0 {
                    // Another thread holds the worker inside a UCX call
                    // and progresses it there: stand back (see
                    // `Inner::issuing`), attended, not idle.
                    #[cfg(test)]
                    inner.test.stood_back.fetch_add(1, Ordering::AcqRel);
                    idle.busy(Instant::now());
                    std::thread::yield_now();
                    continue;
                }
                #[cfg(test)]
                inner.test.turns.fetch_add(1, Ordering::AcqRel);
                let turn = Instant::now();
                let worked = inner.drain();
                inner.held(turn, None, "the progress thread's queued work");
                let progressed = inner.progress_until_idle();
                if progressed {
                    inner.drop_released();
                }
                if worked || progressed {
                    idle.event(Instant::now());
                    continue;
                }
                // Fire-and-forget requests in flight: a proxy waiting for
                // a get's counter does not progress the worker itself.
                if inner.inflight.load(Ordering::Acquire) > 0 {
                    idle.busy(Instant::now());
                    std::thread::yield_now();
                    continue;
                }
                if !lock(&inner.work).is_empty() {
                    continue;
                }
                if !idle.may_sleep(Instant::now()) {
                    std::thread::yield_now();
                    continue;
                }
                if inner.ucp.arm() {
                    let mut fds = libc::pollfd {
                        fd: efd,
                        events: libc::POLLIN,
                        revents: 0,
                    };
                    // SAFETY: one valid pollfd; a bounded wait, so closing
                    // is noticed (the drop also signals the worker) and the
                    // job's health asked.
                    unsafe { libc::poll(&raw mut fds, 1, SLEEP_MS) };
                }
            }
        })
        .map_err(|e| NetError::Io {
            what: "spawning the ucx progress thread".into(),
            source: e,
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::{Access, RegionInfo};

    /// Host memory is mapped by address and length, UCX detecting nothing
    /// else; GPU memory (a backed region) also names the CUDA memory
    /// type. Nothing is mapped here: the parameter block is what
    /// `ucp_mem_map` would be handed.
    #[test]
    fn gpu_regions_are_mapped_with_the_cuda_memory_type() {
        let host = RegionInfo {
            base: 0x7f00_0000_1000,
            len: 4096,
            access: Access::ALL,
            backed: false,
        };
        let p = map_params(&host).expect("addressable");
        assert_eq!(
            p.field_mask,
            u64::from(sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH)
        );
        assert_eq!(p.address as usize, host.base);
        assert_eq!(p.length, 4096);
        assert_eq!(p.memory_type, sys::UCS_MEMORY_TYPE_HOST);
        assert_eq!(p.flags, 0, "UCX must not allocate: the region exists");
        let gpu = RegionInfo {
            base: 0x7e00_0020_0000,
            len: 1 << 22,
            access: Access::COPY,
            backed: true,
        };
        let p = map_params(&gpu).expect("addressable");
        assert_eq!(
            p.field_mask,
            u64::from(
                sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                    | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                    | sys::UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE
            )
        );
        assert_eq!(p.address as usize, gpu.base);
        assert_eq!(p.length, 1 << 22);
        assert_eq!(p.memory_type, sys::UCS_MEMORY_TYPE_CUDA);
        assert_eq!(p.flags, 0);
    }
}
