//! The owner's side of the ucx transport, and the progress thread: regions
//! are mapped and their rkeys packed when a peer first asks for a key,
//! and revoked at every peer that holds them when the region stops being
//! served.

use std::collections::HashSet;
use std::ffi::c_void;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::worker::{Started, Ucp, started};
use super::{Inner, Peer, Work, lock, sys, wire};
use crate::NetError;
use crate::region::RegionObserver;

/// A region this rank mapped for its peers.
pub(super) struct Mapping {
    memh: sys::ucp_mem_h,
    base: usize,
    served: wire::Served,
    /// Peers that were sent its rkey.
    holders: HashSet<usize>,
}

// SAFETY: a memory handle of a context shared by threads
// (`mt_workers_shared`); only used under the `served` lock.
unsafe impl Send for Mapping {}

impl Mapping {
    pub(super) fn unmap(self, ucp: &Ucp) {
        // SAFETY: mapped once by `map`, unmapped once (the mapping was
        // taken out of the table).
        let _ = unsafe { ucp.lib.ucp_mem_unmap(ucp.ctx, self.memh) };
    }
}

/// How long an owner waits for peers to acknowledge a revocation before it
/// unmaps anyway (a stopped or dead peer must not hold a deregistration).
const REVOKE_WAIT: Duration = Duration::from_secs(2);

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
unsafe fn parts<'a>(arg: *mut c_void, header: *const c_void, len: usize) -> (&'a Inner, &'a [u8]) {
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
        Ok(()) => wire::Served::decode(body).ok_or(wire::Refusal::Map),
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

/// What a message send owns until it completes.
struct Sending {
    data: Vec<u8>,
    lib: *const sys::UcpLib,
}

/// Completion of a message send: frees what it carried and the request.
unsafe extern "C" fn sent(req: *mut c_void, _status: sys::ucs_status_t, user: *mut c_void) {
    // SAFETY: the `Box<Sending>` leaked by `send`; each request completes
    // once; the library outlives every request.
    unsafe {
        let s = Box::from_raw(user.cast::<Sending>());
        (*s.lib).ucp_request_free(req);
    }
}

impl Inner {
    fn queue(&self, w: Work) {
        lock(&self.work).push(w);
        self.ucp.signal();
    }

    /// Sends an active message to `peer` (header copied, `data` owned by
    /// the request until sent). Failures surface as the peer's error.
    fn send(&self, peer: &Peer, id: u32, header: &[u8], data: Vec<u8>) {
        let s = lock(&peer.state);
        if s.ep.is_null() {
            return;
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
        match started(r) {
            // `sent` frees it and the request.
            Started::Pending(_) => {}
            Started::Done | Started::Failed(_) => {
                // SAFETY: UCX did not keep the data (no callback runs).
                drop(unsafe { Box::from_raw(p.user_data.cast::<Sending>()) });
            }
        }
    }

    /// Maps `key` (once) and answers `from`'s request for its rkey.
    fn serve(&self, from: usize, key: u32, id: u64) {
        let Some(peer) = self.peer_opt(from) else {
            return;
        };
        let answer = self.table.with_region(key, |info| {
            let info = info.ok_or(wire::Refusal::Unknown)?;
            let mut served = lock(&self.served);
            if let Some(m) = served.get_mut(&key).filter(|m| m.base == info.base) {
                m.holders.insert(from);
                return Ok(m.served.clone());
            }
            let m = self.map(info).ok_or(if info.backed {
                wire::Refusal::Device
            } else {
                wire::Refusal::Map
            })?;
            let s = m.served.clone();
            if let Some(old) = served.insert(key, m) {
                old.unmap(&self.ucp);
            }
            if let Some(m) = served.get_mut(&key) {
                m.holders.insert(from);
            }
            Ok(s)
        });
        let (status, data) = match answer {
            Ok(s) => (Ok(()), s.encode()),
            Err(r) => (Err(r), Vec::new()),
        };
        self.send(
            peer,
            wire::id::ANSWER,
            &wire::Answer { id, status }.encode(),
            data,
        );
    }

    /// `ucp_mem_map` and `ucp_rkey_pack` of a region (called under the
    /// table's read guard: the memory stays valid meanwhile).
    fn map(&self, info: crate::region::RegionInfo) -> Option<Mapping> {
        let params = map_params(&info)?;
        let mut memh: sys::ucp_mem_h = std::ptr::null_mut();
        // SAFETY: a registered region (valid while the guard is held);
        // UCX registers it without allocating.
        let st = unsafe {
            self.ucp
                .lib
                .ucp_mem_map(self.ucp.ctx, &raw const params, &raw mut memh)
        };
        if st != sys::UCS_OK {
            tracing::warn!(rank = self.rank, st = %self.ucp.text(st), gpu = info.backed, "ucp_mem_map failed");
            return None;
        }
        let (mut buf, mut n): (*mut c_void, usize) = (std::ptr::null_mut(), 0);
        // SAFETY: a live memory handle; valid out-pointers; released below.
        let st = unsafe {
            self.ucp
                .lib
                .ucp_rkey_pack(self.ucp.ctx, memh, &raw mut buf, &raw mut n)
        };
        if st != sys::UCS_OK {
            // SAFETY: mapped above, unmapped once.
            let _ = unsafe { self.ucp.lib.ucp_mem_unmap(self.ucp.ctx, memh) };
            return None;
        }
        // SAFETY: UCX returned `n` bytes at `buf`.
        let rkey = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), n) }.to_vec();
        // SAFETY: returned by `ucp_rkey_pack`, released once.
        unsafe { self.ucp.lib.ucp_rkey_buffer_release(buf) };
        Some(Mapping {
            memh,
            base: info.base,
            served: wire::Served {
                base: info.base as u64,
                len: info.len,
                access: info.access,
                rkey,
            },
            holders: HashSet::new(),
        })
    }

    /// Drops `key`'s rkey from `owner`, then flushes what was sent to it
    /// and acknowledges: the owner unmaps only after that.
    fn revoke(&self, owner: usize, key: u32) {
        let Some(peer) = self.peer_opt(owner) else {
            return;
        };
        let ep = {
            let mut s = lock(&peer.state);
            if let Some(r) = s.keys.remove(&key) {
                s.graveyard.push(r);
            }
            s.revoked.insert(key);
            s.ep
        };
        if ep.is_null() {
            return;
        }
        let p = sys::ucp_request_param_t::default();
        let r = {
            let s = lock(&peer.state);
            if s.ep.is_null() {
                return;
            }
            // SAFETY: a live endpoint under the peer's lock.
            unsafe { self.ucp.lib.ucp_ep_flush_nbx(s.ep, &raw const p) }
        };
        if let Started::Pending(req) = started(r) {
            let until = Instant::now() + self.timeout;
            // SAFETY: a live request of this worker (the progress thread
            // progresses here, outside any callback).
            while unsafe { self.ucp.status(req) } == sys::UCS_INPROGRESS && Instant::now() < until {
                self.ucp.progress();
            }
            // SAFETY: released once.
            unsafe { self.ucp.free(req) };
        }
        let ack = wire::Ask {
            from: u32::try_from(self.rank).unwrap_or(u32::MAX),
            key,
            id: 0,
        };
        self.send(peer, wire::id::REVOKED, &ack.encode(), Vec::new());
    }

    /// Does the queued work.
    fn drain(&self) {
        let work = std::mem::take(&mut *lock(&self.work));
        for w in work {
            match w {
                Work::Serve { from, key, id } => self.serve(from, key, id),
                Work::Revoke { owner, key } => self.revoke(owner, key),
            }
        }
    }
}

impl RegionObserver for Inner {
    fn removed(&self, key: u32, base: usize) {
        let m = {
            let mut served = lock(&self.served);
            match served.get(&key) {
                Some(m) if m.base == base => served.remove(&key),
                _ => None,
            }
        };
        let Some(m) = m else {
            return;
        };
        let me = u32::try_from(self.rank).unwrap_or(u32::MAX);
        let holders: Vec<&Peer> = m
            .holders
            .iter()
            .filter_map(|&p| self.peer_opt(p))
            .filter(|p| p.error.get().is_none())
            .collect();
        lock(&self.acks).extend(holders.iter().map(|p| (key, p.rank)));
        for p in &holders {
            self.send(
                p,
                wire::id::REVOKE,
                &wire::Ask {
                    from: me,
                    key,
                    id: 0,
                }
                .encode(),
                Vec::new(),
            );
        }
        let until = Instant::now() + REVOKE_WAIT.min(self.timeout);
        loop {
            let left: Vec<usize> = lock(&self.acks)
                .iter()
                .filter(|(k, _)| *k == key)
                .map(|(_, p)| *p)
                .collect();
            let waiting = left
                .iter()
                .any(|&p| self.peer_opt(p).is_some_and(|p| p.error.get().is_none()));
            // A job that lost a rank is over: nobody will send again.
            let job_over = self.alive.get().is_some_and(|a| a().is_err());
            if !waiting || job_over || Instant::now() > until {
                if waiting {
                    tracing::warn!(
                        rank = self.rank,
                        key,
                        ?left,
                        "peers did not acknowledge a revoked rkey in time"
                    );
                }
                lock(&self.acks).retain(|(k, _)| *k != key);
                break;
            }
            if self.ucp.progress() == 0 {
                std::thread::yield_now();
            }
        }
        m.unmap(&self.ucp);
    }
}

/// Asks `peer` for `key`'s rkey and progresses until the answer arrives
/// (within the job's timeout).
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
    inner.send(peer, wire::id::ASK, &a.encode(), Vec::new());
    let start = Instant::now();
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
            let err = if let Err(e) = inner.broken(peer) {
                Some(e)
            } else if let Some(Err(job)) = inner.alive.get().map(|a| a()) {
                Some(NetError::Broken {
                    peer: peer.rank,
                    why: job,
                })
            } else if start.elapsed() > inner.timeout {
                Some(NetError::Timeout {
                    peer: peer.rank,
                    what: format!("the rkey of key {key:#010x}"),
                    waited: start.elapsed(),
                })
            } else {
                None
            };
            if let Some(e) = err {
                lock(&inner.answers).remove(&id);
                return Err(e);
            }
        }
        if inner.ucp.progress() == 0 {
            std::thread::yield_now();
        }
    }
}

/// Starts the progress thread: it does queued work, progresses the worker
/// until idle, then sleeps on its event descriptor.
pub(super) fn spawn_progress(inner: &Arc<Inner>) -> Result<JoinHandle<()>, NetError> {
    let efd = inner.ucp.efd()?;
    let inner = inner.clone();
    std::thread::Builder::new()
        .name(format!("gin-ucx-{}", inner.rank))
        .spawn(move || {
            while !inner.closing.load(Ordering::Acquire) {
                inner.drain();
                while inner.ucp.progress() != 0 {}
                if !lock(&inner.work).is_empty() {
                    continue;
                }
                if inner.inflight.load(Ordering::Acquire) > 0 {
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
                    // is noticed.
                    unsafe { libc::poll(&raw mut fds, 1, 100) };
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
