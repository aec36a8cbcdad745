//! Opening `libucp.so.0` at run time: `GIN_UCX_LIB` names a library (a
//! cluster's HPC-X, a distribution's, or the pinned wheel's), else the
//! usual names are tried. Building gin-net needs no UCX.

use std::sync::Arc;

use super::sys;
use crate::NetError;

/// The names tried when `GIN_UCX_LIB` is unset.
pub const USUAL: &[&str] = &["libucp.so.0", "libucp.so"];

/// The oldest UCP API whose calls and structures the bindings use
/// (`ucp_request_param_t` with `memh`, `ucp_am_send_nbx`).
pub const MIN_VERSION: (u32, u32) = (1, 12);

/// What the alternatives are, for every error that says UCX is missing.
pub const ALTERNATIVES: &str = "set GIN_UCX_LIB to a UCX (>= 1.12) libucp.so.0 (`cargo xtask wheels` installs one under target/wheels), or choose GIN_TRANSPORT=tcp (any host) or GIN_TRANSPORT=shm (one host)";

/// Opens libucp: the library `GIN_UCX_LIB` names, or the first of
/// [`USUAL`] that loads, and checks its version.
pub fn open() -> Result<Arc<sys::UcpLib>, NetError> {
    let named = std::env::var_os("GIN_UCX_LIB").filter(|v| !v.is_empty());
    let candidates: Vec<std::ffi::OsString> = match &named {
        Some(p) => vec![p.clone()],
        None => USUAL.iter().map(Into::into).collect(),
    };
    let mut tried = Vec::new();
    for c in &candidates {
        // SAFETY: loading libucp runs its (and libucs's, libuct's)
        // initialisers, which are safe to run in any process; every symbol
        // the bindings name must resolve (`dynamic_link_require_all`), so a
        // library without them is refused here, not called later.
        match unsafe { sys::UcpLib::new(c) } {
            Ok(lib) => {
                let lib = Arc::new(lib);
                check_version(&lib, &c.to_string_lossy())?;
                return Ok(lib);
            }
            Err(e) => tried.push(format!("{}: {e}", c.to_string_lossy())),
        }
    }
    let how = if named.is_some() {
        "GIN_UCX_LIB names"
    } else {
        "GIN_UCX_LIB is unset; tried"
    };
    Err(NetError::Unavailable {
        transport: "ucx",
        why: format!("cannot load libucp ({how} {})", tried.join("; ")),
        alternatives: ALTERNATIVES,
    })
}

fn check_version(lib: &sys::UcpLib, path: &str) -> Result<(), NetError> {
    let (mut major, mut minor, mut release) = (0u32, 0u32, 0u32);
    // SAFETY: three valid out-pointers.
    unsafe { lib.ucp_get_version(&raw mut major, &raw mut minor, &raw mut release) };
    if (major, minor) < MIN_VERSION {
        return Err(NetError::Unavailable {
            transport: "ucx",
            why: format!(
                "{path} is UCX {major}.{minor}.{release}; gin-rs needs {}.{} or later",
                MIN_VERSION.0, MIN_VERSION.1
            ),
            alternatives: ALTERNATIVES,
        });
    }
    Ok(())
}

/// UCX's text for a status.
pub fn status_text(lib: &sys::UcpLib, status: sys::ucs_status_t) -> String {
    // SAFETY: returns a pointer to a static NUL-terminated string (or null
    // for an unknown code, handled below).
    let p = unsafe { lib.ucs_status_string(status) };
    if p.is_null() {
        return format!("UCX status {status}");
    }
    // SAFETY: non-null, NUL-terminated, static.
    unsafe { std::ffi::CStr::from_ptr(p) }
        .to_string_lossy()
        .into_owned()
}
