//! gin-device: the device API (tier 2) — what a kernel, or a CPU rank running
//! the same algorithm, calls to put, signal, get, flush, wait and barrier.
//!
//! # Design
//!
//! - **The ABI** ([`abi`]) is what a kernel receives: `#[repr(C)]` structs of
//!   fixed-width integers and 64-bit addresses, with size and offset
//!   assertions, so the CUDA header and Rust agree byte for byte.
//! - **CPU ranks** call the same operations through [`DevComm`] and its
//!   contexts ([`Ctx`]). Every argument (peer, window range, signal and
//!   counter ids, alignment) is checked before anything moves; errors name the
//!   rank, peer, context, id, offset and size.
//! - **Two paths.** Peers whose window parts are mapped into this process
//!   (same-host shared memory) are reached by direct load/store: a copy, then
//!   an atomic add with release ordering on the signal — NCCL's LSA path.
//!   Before anything moves, the direct path loads the owners' revocation
//!   words of the data's and the signal's parts ([`WindowParts::states`]):
//!   a put to a part its owner dropped or deregistered is refused as a
//!   whole, signal included ([`GinError::Refused`]). All
//!   other traffic goes to a [`Backend`] (the proxy or GDAKI), which issues it
//!   and reports local completion through tickets. Only a backend makes a
//!   [`Ticket`] (private fields, a [`TicketIssuer`] it owns), and only the
//!   instance that issued one redeems it.
//! - **The host-side seam** ([`host`]): every backend crate provides one
//!   [`HostBackend`], through which the host layer starts it for CPU ranks
//!   (a [`Backend`]) or CUDA ranks (a [`CudaEngine`]) with one call each;
//!   [`Direct`] (load/store only, no queues) is always available. The
//!   fabric and the GPU are type parameters here, never named.
//! - **Waits** poll with back-off (spin, yield, short sleeps, so ranks and
//!   proxies share few cores), honour a timeout and an abort flag, consult the
//!   job's health (a dead or departed peer is an error, not a hang; the
//!   condition is looked at once more first, so what the peer did before it
//!   went counts), and compare with rolling arithmetic ([`wait`]): 64-bit
//!   signals, 56-bit counters.
//! - **Signals** are 64-bit slots per context in a communicator-wide signal
//!   window; barrier sessions use reserved slots past the user's ids.
//!
//! # What it does not know
//!
//! **Invariant:** gin-device knows nothing about sockets, threads, transports
//! or WQE/descriptor formats. Memory arrives as [`Window`]s built by the host
//! layer (gin-core); backends implement [`Backend`].

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod abi;
mod comm;
mod error;
pub mod host;
mod ops;
pub mod wait;
mod window;

pub use abi::Coop;
pub use comm::{
    Backend, BarrierSession, CAUSE_GRACE, Counters, Ctx, DevComm, DevCommParts, GetOp, Health,
    PutOp, SignalUpdate, Source, Ticket, TicketIssuer, signal_slots_per_context,
};
pub use error::GinError;
pub use host::{
    CpuStart, CudaEngine, CudaEngineSpec, Direct, Exchange, HostBackend, HostError, StartError,
};
pub use ops::{CounterId, Fence, Local, Order, Remote, SignalId, SignalOp, Team};
pub use window::{Window, WindowParts};

/// This crate's CUDA headers, by the name kernels include them with
/// (`#include "gin/…"`): the data NVRTC is handed at run time, so that no
/// crate reads another crate's files to assemble the tree.
pub const HEADERS: &[(&str, &str)] = &[
    ("gin/abi.cuh", include_str!("../include/gin/abi.cuh")),
    ("gin/gin.cuh", include_str!("../include/gin/gin.cuh")),
    (
        "gin/nccl_compat.cuh",
        include_str!("../include/gin/nccl_compat.cuh"),
    ),
];
