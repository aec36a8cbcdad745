//! One UCP context and worker, owned together: created from the
//! environment (`UCX_TLS` and every other `UCX_*` variable are honoured),
//! destroyed together. The worker runs in `UCS_THREAD_MODE_MULTI`: rank
//! threads issue operations and progress it while they wait, and the
//! transport's progress thread progresses it when nobody else does (UCX's
//! tcp transport emulates RMA and atomics with active messages the target
//! must progress).

use std::ffi::c_void;
use std::sync::Arc;

use super::load::{MIN_VERSION, status_text};
use super::sys;
use crate::NetError;

/// A UCP context, cleaned up (`ucp_cleanup`) when the last reference
/// drops: the worker's [`Ucp`] holds one, and so does each piece of window
/// memory UCX allocated (`serve::Allocation`), which must be unmapped with
/// a live context but may outlive the worker (`ucp_mem_unmap` after
/// `ucp_worker_destroy` and before `ucp_cleanup` is legal).
pub(super) struct Context {
    pub(super) lib: Arc<sys::UcpLib>,
    pub(super) ctx: sys::ucp_context_h,
}

// SAFETY: the context is created with `mt_workers_shared`, so UCX
// serialises calls on it (memory mapping) itself.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: the last reference: the worker was destroyed and every
        // memory handle unmapped first (each holder of a handle holds a
        // reference); cleaned up once.
        unsafe { self.lib.ucp_cleanup(self.ctx) };
    }
}

/// A context and its worker. Dropping it destroys the worker at once, and
/// the context once nothing else holds it ([`Context`]).
pub struct Ucp {
    pub(super) lib: Arc<sys::UcpLib>,
    /// The context's handle, as `context` holds it.
    pub(super) ctx: sys::ucp_context_h,
    pub(super) context: Arc<Context>,
    pub(super) worker: sys::ucp_worker_h,
    /// Whether the context has UCX's tcp segment sizes from
    /// [`super::am::TCP_SEGMENTS`] (so a put message up to
    /// [`super::am::AM_MAX_TCP`] is one zero-copy message over tcp).
    pub(super) tcp_segments: bool,
}

// SAFETY: the context is created with `mt_workers_shared` and the worker in
// `UCS_THREAD_MODE_MULTI`, so UCX serialises every call on them itself.
unsafe impl Send for Ucp {}
// SAFETY: as above.
unsafe impl Sync for Ucp {}

impl std::fmt::Debug for Ucp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ucp").finish_non_exhaustive()
    }
}

/// The error for a failed UCX set-up call.
pub(super) fn setup_error(lib: &sys::UcpLib, what: &str, st: sys::ucs_status_t) -> NetError {
    NetError::Unavailable {
        transport: "ucx",
        why: format!("{what} failed: {}", status_text(lib, st)),
        alternatives: "check UCX_TLS and the UCX_* variables, or choose GIN_TRANSPORT=tcp",
    }
}

#[cfg(test)]
thread_local! {
    /// `UCX_TLS` for contexts this thread makes (a test's rank thread),
    /// without touching the environment other tests' ranks read.
    pub(super) static TEST_TLS: std::cell::Cell<Option<&'static std::ffi::CStr>> =
        const { std::cell::Cell::new(None) };
}

/// `UCX_FENCE_MODE=ep_based`: `ucp_worker_fence` then orders each
/// endpoint's next operation after its earlier ones, with a fence on the
/// lane when both use one lane (free over tcp) and a flush of that
/// endpoint only when they do not. UCX 1.22's default with its new
/// protocols is a blocking flush of every endpoint of the worker at each
/// fence: a put-with-signal then waited a round trip for the put's
/// acknowledgement before the signal left (26 µs against 11.6 µs at 8 B
/// over tcp on this repository's machine).
pub(super) const EP_BASED_FENCE: (&std::ffi::CStr, &std::ffi::CStr) = (c"FENCE_MODE", c"ep_based");

impl Ucp {
    /// `ucp_init` with the environment's configuration and `set` (a name
    /// and value) changed.
    #[cfg(test)]
    pub(super) fn init(
        lib: &sys::UcpLib,
        set: Option<(&std::ffi::CStr, &std::ffi::CStr)>,
    ) -> Result<sys::ucp_context_h, NetError> {
        Self::init_tuned(lib, set, &[]).map(|(ctx, _)| ctx)
    }

    /// [`Ucp::init`], with the `tuning` settings (names and values) also
    /// made, in order, as far as UCX takes them; whether it took all.
    fn init_tuned(
        lib: &sys::UcpLib,
        set: Option<(&std::ffi::CStr, &std::ffi::CStr)>,
        tuning: &[(std::ffi::CString, std::ffi::CString)],
    ) -> Result<(sys::ucp_context_h, bool), NetError> {
        let mut config: *mut sys::ucp_config_t = std::ptr::null_mut();
        // SAFETY: null prefix and file mean "UCX_ from the environment";
        // `config` is a valid out-pointer, released below.
        let st =
            unsafe { lib.ucp_config_read(std::ptr::null(), std::ptr::null(), &raw mut config) };
        if st != sys::UCS_OK {
            return Err(setup_error(lib, "ucp_config_read", st));
        }
        #[cfg(test)]
        let tls = TEST_TLS.with(std::cell::Cell::get).map(|t| (c"TLS", t));
        #[cfg(not(test))]
        let tls = None;
        for (name, value) in set.into_iter().chain(tls) {
            // SAFETY: a live configuration and two NUL-terminated strings.
            let st = unsafe { lib.ucp_config_modify(config, name.as_ptr(), value.as_ptr()) };
            if st != sys::UCS_OK {
                // SAFETY: read above; not used after this.
                unsafe { lib.ucp_config_release(config) };
                return Err(setup_error(lib, "ucp_config_modify", st));
            }
        }
        let mut tuned = true;
        for (name, value) in tuning {
            // SAFETY: as above.
            let st = unsafe { lib.ucp_config_modify(config, name.as_ptr(), value.as_ptr()) };
            if st != sys::UCS_OK {
                tracing::debug!(
                    ?name,
                    ?value,
                    st,
                    "UCX refused a setting; its default stays"
                );
                tuned = false;
                break;
            }
        }
        let params = sys::ucp_params_t {
            field_mask: u64::from(
                sys::UCP_PARAM_FIELD_FEATURES | sys::UCP_PARAM_FIELD_MT_WORKERS_SHARED,
            ),
            features: u64::from(
                sys::UCP_FEATURE_RMA
                    | sys::UCP_FEATURE_AMO64
                    | sys::UCP_FEATURE_AM
                    | sys::UCP_FEATURE_WAKEUP,
            ),
            mt_workers_shared: 1,
            ..Default::default()
        };
        let mut ctx: sys::ucp_context_h = std::ptr::null_mut();
        // SAFETY: valid params and config; `ctx` is a valid out-pointer.
        let st = unsafe {
            lib.ucp_init_version(
                MIN_VERSION.0,
                MIN_VERSION.1,
                &raw const params,
                config,
                &raw mut ctx,
            )
        };
        // SAFETY: read above; not used after this.
        unsafe { lib.ucp_config_release(config) };
        if st != sys::UCS_OK {
            return Err(setup_error(lib, "ucp_init", st));
        }
        Ok((ctx, tuned && !tuning.is_empty()))
    }

    /// Reads UCX's configuration from the environment and creates the
    /// context (RMA, 64-bit atomics, active messages, wake-up) and worker.
    pub fn new(lib: Arc<sys::UcpLib>) -> Result<Self, NetError> {
        // The endpoint-based fence unless the user chose one: see
        // `fence_mode`. A UCX that refuses it (the old protocols) gets
        // its own default.
        let ep_based = std::env::var_os("UCX_FENCE_MODE").is_none();
        // UCX's tcp segments for one-message puts (`am::TCP_SEGMENTS`),
        // unless the environment chose its own.
        let tcp: Vec<_> = super::am::tcp_segments(|v| std::env::var(v).ok())
            .into_iter()
            .filter_map(|(n, v)| {
                Some((
                    std::ffi::CString::new(n).ok()?,
                    std::ffi::CString::new(v).ok()?,
                ))
            })
            .collect();
        let fence = ep_based.then_some(EP_BASED_FENCE);
        let (ctx, tcp_segments) = match Self::init_tuned(&lib, fence, &tcp) {
            Err(_) if ep_based => Self::init_tuned(&lib, None, &tcp),
            r => r,
        }
        .or_else(|e| {
            if tcp.is_empty() {
                Err(e)
            } else {
                Self::init_tuned(&lib, None, &[])
            }
        })?;
        let wp = sys::ucp_worker_params_t {
            field_mask: u64::from(sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE),
            thread_mode: sys::UCS_THREAD_MODE_MULTI,
            ..Default::default()
        };
        // Cleans the context up on every path from here (it has no worker
        // yet).
        let context = Arc::new(Context {
            lib: lib.clone(),
            ctx,
        });
        let mut worker: sys::ucp_worker_h = std::ptr::null_mut();
        // SAFETY: a live context, valid params and out-pointer.
        let st = unsafe { lib.ucp_worker_create(ctx, &raw const wp, &raw mut worker) };
        if st != sys::UCS_OK {
            return Err(setup_error(&lib, "ucp_worker_create", st));
        }
        let ucp = Self {
            lib,
            ctx,
            context,
            worker,
            tcp_segments,
        };
        // Dropping `ucp` on a refusal destroys the worker and the context.
        thread_mode_ok(ucp.thread_mode()?)?;
        Ok(ucp)
    }

    /// The thread mode UCX actually gave the worker (`ucp_worker_query`):
    /// a UCX built without thread support hands out a single-thread worker
    /// whatever was asked.
    pub(super) fn thread_mode(&self) -> Result<sys::ucs_thread_mode_t, NetError> {
        let mut attr = sys::ucp_worker_attr_t {
            field_mask: u64::from(sys::UCP_WORKER_ATTR_FIELD_THREAD_MODE),
            ..Default::default()
        };
        // SAFETY: a live worker and a valid attribute block asking for the
        // thread mode only.
        let st = unsafe { self.lib.ucp_worker_query(self.worker, &raw mut attr) };
        if st != sys::UCS_OK {
            return Err(setup_error(&self.lib, "ucp_worker_query", st));
        }
        Ok(attr.thread_mode)
    }

    /// The worker's address, to be sent to peers.
    pub fn address(&self) -> Result<Vec<u8>, NetError> {
        let mut a: *mut sys::ucp_address_t = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: a live worker; valid out-pointers; released below.
        let st = unsafe {
            self.lib
                .ucp_worker_get_address(self.worker, &raw mut a, &raw mut len)
        };
        if st != sys::UCS_OK {
            return Err(setup_error(&self.lib, "ucp_worker_get_address", st));
        }
        // SAFETY: UCX returned `len` bytes at `a`.
        let v = unsafe { std::slice::from_raw_parts(a.cast::<u8>(), len) }.to_vec();
        // SAFETY: returned by `ucp_worker_get_address` on this worker.
        unsafe { self.lib.ucp_worker_release_address(self.worker, a) };
        Ok(v)
    }

    /// Progresses the worker once; the number of events handled.
    pub fn progress(&self) -> u32 {
        // SAFETY: a live worker in multi-thread mode.
        unsafe { self.lib.ucp_worker_progress(self.worker) }
    }

    /// The worker's event file descriptor.
    pub fn efd(&self) -> Result<i32, NetError> {
        let mut fd = -1;
        // SAFETY: a live worker created with the wake-up feature.
        let st = unsafe { self.lib.ucp_worker_get_efd(self.worker, &raw mut fd) };
        if st != sys::UCS_OK {
            return Err(setup_error(&self.lib, "ucp_worker_get_efd", st));
        }
        Ok(fd)
    }

    /// Arms the event descriptor: true when the caller may sleep on it.
    pub fn arm(&self) -> bool {
        // SAFETY: a live worker.
        unsafe { self.lib.ucp_worker_arm(self.worker) == sys::UCS_OK }
    }

    /// Wakes a thread sleeping on the event descriptor.
    pub fn signal(&self) {
        // SAFETY: a live worker; safe from any thread and from callbacks.
        let _ = unsafe { self.lib.ucp_worker_signal(self.worker) };
    }

    /// Orders every operation issued after it on this worker after every
    /// operation issued before it.
    pub fn fence(&self) -> Result<(), sys::ucs_status_t> {
        // SAFETY: a live worker.
        match unsafe { self.lib.ucp_worker_fence(self.worker) } {
            sys::UCS_OK => Ok(()),
            st => Err(st),
        }
    }

    /// A request's status (`UCS_INPROGRESS` while pending).
    ///
    /// # Safety
    /// `req` is a live request of this worker.
    pub unsafe fn status(&self, req: *mut c_void) -> sys::ucs_status_t {
        // SAFETY: forwarded.
        unsafe { self.lib.ucp_request_check_status(req) }
    }

    /// Releases a request (at once if complete, else when it completes;
    /// its callback still runs).
    ///
    /// # Safety
    /// `req` is a live request of this worker, released once.
    pub unsafe fn free(&self, req: *mut c_void) {
        // SAFETY: forwarded.
        unsafe { self.lib.ucp_request_free(req) };
    }

    /// `ucp_mem_map` on this context: the memory handle, or UCX's status.
    ///
    /// # Safety
    /// `params` describe memory UCX may map: with `UCP_MEM_MAP_ALLOCATE`,
    /// memory it allocates; else a region that stays valid until the
    /// handle is unmapped.
    pub unsafe fn mem_map(
        &self,
        params: &sys::ucp_mem_map_params_t,
    ) -> Result<sys::ucp_mem_h, sys::ucs_status_t> {
        let mut memh: sys::ucp_mem_h = std::ptr::null_mut();
        // SAFETY: the caller's contract; a valid out-pointer.
        let st = unsafe { self.lib.ucp_mem_map(self.ctx, params, &raw mut memh) };
        if st == sys::UCS_OK { Ok(memh) } else { Err(st) }
    }

    /// UCX's text for a status.
    pub fn text(&self, st: sys::ucs_status_t) -> String {
        status_text(&self.lib, st)
    }
}

impl Drop for Ucp {
    fn drop(&mut self) {
        // SAFETY: the owner closed every endpoint and destroyed every rkey
        // first (`Inner::drop`); destroyed once. The context goes with
        // its last reference (`context`, dropped after this), after every
        // memory handle still held elsewhere is unmapped.
        unsafe { self.lib.ucp_worker_destroy(self.worker) };
    }
}

/// Refuses a worker whose thread mode is not `UCS_THREAD_MODE_MULTI`: rank
/// threads, the progress thread and UCX's callbacks all use it at once.
pub(super) fn thread_mode_ok(mode: sys::ucs_thread_mode_t) -> Result<(), NetError> {
    if mode == sys::UCS_THREAD_MODE_MULTI {
        return Ok(());
    }
    let name = match mode {
        sys::UCS_THREAD_MODE_SINGLE => "UCS_THREAD_MODE_SINGLE",
        sys::UCS_THREAD_MODE_SERIALIZED => "UCS_THREAD_MODE_SERIALIZED",
        _ => "an unknown thread mode",
    };
    Err(NetError::Unavailable {
        transport: "ucx",
        why: format!(
            "UCX gave the worker {name} ({mode}), not the UCS_THREAD_MODE_MULTI gin-rs asked for: this UCX was built without multi-thread support (configure --enable-mt)"
        ),
        alternatives: "use a UCX built with --enable-mt (the pinned wheel is; `cargo xtask wheels`), or choose GIN_TRANSPORT=tcp",
    })
}

/// What a `*_nbx` call returned.
pub enum Started {
    /// Completed in place.
    Done,
    /// A request to wait for (or release).
    Pending(*mut c_void),
    /// Failed at once.
    Failed(sys::ucs_status_t),
}

/// Classifies a status pointer (UCX's `UCS_PTR_IS_ERR` / `UCS_PTR_STATUS`).
pub fn started(p: sys::ucs_status_ptr_t) -> Started {
    let v = p as isize;
    if v == 0 {
        Started::Done
    } else if (-100..0).contains(&v) {
        // UCS_ERR_LAST is -100: error codes live in the lowest addresses'
        // negatives, as UCS_PTR_IS_ERR tests.
        Started::Failed(i8::try_from(v).unwrap_or(sys::UCS_ERR_NO_ELEM))
    } else {
        Started::Pending(p)
    }
}
