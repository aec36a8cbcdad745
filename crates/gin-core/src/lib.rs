//! gin-core: the host API (tier 1) that users hold.
//!
//! # Design
//!
//! - [`Comm`] is built from a `gin_bootstrap::Bootstrap`. It learns which
//!   ranks share a host (`GIN_HOSTID`, else hostname and boot id: the
//!   bootstrap's `topology` exchange), picks a path to every peer
//!   (`GIN_TRANSPORT`: shm within a host and tcp across, or one transport
//!   everywhere, shm, tcp or ucx; `GIN_TRANSPORT_REMOTE` may name another
//!   for peers on other hosts, as ucx), and builds the fabric.
//! - **Windows** are registered collectively and in order, so a window's id is
//!   the same on every rank; sizes may differ per rank and every rank knows
//!   every size. [`Comm::alloc_window`] allocates shared memory that same-host
//!   peers map (the direct path); [`Comm::register_window`] registers user
//!   memory for TCP peers. gin-net's `host_window` module creates, names,
//!   exchanges, maps, serves and lists the parts (gin-cuda's `window` for
//!   GPU windows); gin-core gives a window its id, runs the collectives and
//!   hands out the handle users hold.
//! - **Device communicators** ([`Comm::dev_comm`]) take their signal and
//!   counter ranges from communicator-wide id spaces ([`space::IdSpace`],
//!   first fit with coalescing); ranges freed by destroy are reused, and
//!   every rank checks that all placed them alike (`Bootstrap::agree`, as
//!   for the requirements: every rank fails alike, naming who gave what).
//! - **Backend selection** (`GIN_BACKEND`): `auto` uses direct load/store for
//!   same-host peers and the proxy for the rest; `proxy` sends everything
//!   through the proxy; `gdaki` builds mlx5 WQEs that soft-mlx5 executes.
//!   The kind is turned into a backend once (`config.rs`, the one table);
//!   from there each backend is started through gin-device's
//!   [`HostBackend`](gin_device::HostBackend), one call for CPU ranks
//!   (`start_cpu`) and one for CUDA ranks (`start_cuda`), with no match on
//!   backend kinds anywhere else.
//! - **CUDA ranks** ([`cuda`]): GPU windows, device communicators for
//!   kernels that include `gin/gin.cuh`; gin-proxy's CUDA proxy,
//!   gin-gdaki's CUDA soft NIC, NVRTC and the rest of the runtime come from
//!   gin-proxy, gin-gdaki and gin-cuda, loaded at run time, so nothing CUDA
//!   is needed to build.
//!
//! # What it does not know
//!
//! Descriptor, WQE and CQE formats, queue set-up and connection exchanges
//! (gin-proxy, gin-gdaki, behind the `HostBackend` seam), the device API's
//! semantics (gin-device), the job's topology, liveness, records and
//! agreement (gin-bootstrap), and how window parts are mapped and served
//! (gin-net, gin-cuda): it assembles them. Its checks of the whole API
//! across a job are users' code and live in the gin-selftest crate.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

mod comm;
pub mod config;
pub mod cuda;
mod error;
pub mod launch;

pub mod requirements;
pub mod space;

pub use comm::{Comm, Connection, DevCommHandle, DevCommRequirements};
pub use config::{BackendKind, NicKind, Settings, TransportKind};
pub use error::CoreError;
pub use gin_device::{
    BarrierSession, CounterId, Ctx, DevComm, Fence, GinError, Local, Order, Remote, SignalId,
    SignalOp, Team, Ticket, Window,
};
