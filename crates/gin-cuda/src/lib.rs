//! gin-cuda: the CUDA host runtime under gin-rs's CUDA ranks — the driver
//! wrapper, run-time compilation, kernel launches and the watch over them,
//! stream batching and TCP staging of GPU memory. (The CUDA proxy and the
//! soft NIC run on their backend crates' drivers, gin-proxy's and
//! gin-gdaki's, as on CPU ranks.)
//!
//! # Design
//!
//! - **Nothing CUDA is needed to build.** The driver and NVRTC are loaded at
//!   run time through cudarc's `dynamic-loading` (its `sys` level only);
//!   [`available`] says why CUDA cannot be used on a machine without a
//!   driver or GPU, and no call here panics for want of one.
//! - **Sound by construction.** Memory types ([`DevMem`], [`HostMem`],
//!   [`IpcMem`]) keep their pointers private and free what they own on
//!   drop; their safe accessors check every range against the allocation
//!   and fail before any driver call. Whatever takes a raw device or host
//!   address — queueing a copy or a store on a [`Stream`], a [`batch::Dma`]
//!   executor, a staged transfer — is an `unsafe fn` with a `# Safety`
//!   section, and so is launching a kernel ([`Function::launch`]): nothing
//!   here can check a kernel's parameter list or what it writes.
//!   [`Function::launch_with`] takes any shape, dynamic shared memory, a
//!   cooperative launch and any stream of the GPU's primary context
//!   ([`StreamRef`]: gin's, a cudarc `CudaStream`, or a raw `CUstream`
//!   through an `unsafe` constructor); [`Function::launch_params`] packs a
//!   parameter list of integers and borrowed values ([`Param`]) for it.
//!   Memory another allocator owns enters through `unsafe`
//!   [`DevMem::from_raw_parts`], which drop leaves alone.
//! - **Run-time compilation** ([`nvrtc`]): NVRTC with the header tree
//!   handed over as data, the user's include folders, defines and options
//!   ([`nvrtc::CompileOptions`]), and CCCL's headers where a toolkit or the
//!   NVRTC wheel has them ([`nvrtc::cccl_dir`]).
//! - **Watching kernels** ([`watch`]): kernels cannot learn that a peer
//!   died, so a host thread (or the launching thread) asks a health
//!   callback each millisecond and raises an abort flag in device memory
//!   that their waits poll. One flag serves every watch of a communicator
//!   and stays raised until the last watch that raised it ends. A
//!   [`watch::Watcher`] owns what it touches (the flag, a weak hold of the
//!   job and engine it asks about), so it may outlive the communicator
//!   that started it, whose check refuses another's watcher;
//!   [`watch::Supervisor`] launches, watches and reads the error word
//!   kernels record their first error in, whose meaning is its caller's.
//!   [`watch::Sentinel`] is the callback's policy: a dead peer at once, a
//!   lost link only after a grace without a dead peer named, then the
//!   engine's first error, over what the caller reports of each.
//! - **Batching** ([`batch::StreamBatch`]): the driver time of one
//!   `cuMemcpyAsync` or `cuStreamWriteValue64` bounds a CPU-driven engine,
//!   so consecutive copies and stores of one queue go to the driver as one
//!   call each, with the outcome of issuing them one by one (proptested
//!   against that model with a host-memory executor). Every batch an
//!   engine hands a stream ends with a mark in mapped host memory
//!   ([`batch::stall`]): work not done long after it was queued is a
//!   *stall* (the stream waits behind a user's kernel on a shared hardware
//!   work queue), which the engine reports as its error, naming
//!   `CUDA_DEVICE_MAX_CONNECTIONS`, instead of letting kernels time out.
//! - **Puts from GPU memory** ([`puts`]): the per-peer queue of puts
//!   handed to a transport that takes GPU memory (ucx), shared by the CUDA
//!   executors of the proxy and the soft NIC: puts in flight, the signals'
//!   running totals held behind them until they completed, a failure
//!   blamed on the put the transport names; and the merging of puts that
//!   continue one another within an engine's pass into one transport put
//!   (at most [`puts::MERGE_MAX`] by default), every original still
//!   accounted for.
//! - **Staging** ([`staging`]): GPU memory served to TCP peers through
//!   gin-net's region table ([`staging::GpuRegion`] is a
//!   `gin_net::region::Backing`), and the pinned buffer through which an
//!   engine sends and fetches through the fabric's keyed operations.
//! - **Window parts** ([`window`]): this rank's part of a GPU window
//!   (device memory, its IPC handle, its registration for TCP peers), the
//!   record ranks exchange about it (with gin-bootstrap's record codec),
//!   and the peers' parts as reached here (CUDA IPC or region keys). A
//!   part may be the user's memory ([`window::LocalPart::register`]):
//!   [`pointer`](mod@pointer) asks the driver what it is and decides, as pure code,
//!   whether it can be one and how it is exported: its allocation's IPC
//!   handle, or for VMM memory ([`vmm`]) the allocation's POSIX file
//!   descriptor, and its offset there. Same-host peers fetch such a
//!   descriptor from the exporting rank over a Unix socket in the abstract
//!   namespace (`SCM_RIGHTS`, [`fdpass`]: each side checks the other's
//!   `SO_PEERCRED` against the rank's uid and pid, then a challenge-response
//!   under a job token; every wait bounded by the job's timeout) and import
//!   and map it whole
//!   ([`vmm::VmmMapping`]). Ranks exchange offers, not bare
//!   records ([`window::exchange`]), so a rank that cannot contribute makes
//!   every rank fail alike; the parts are listed in the fabric's window
//!   directory as `Memory::Device` while they live ([`window::Listed`]).
//!   The memory of a part gin allocates comes from a per-device pool
//!   (size classes of whole 2 MiB pages, at most 1 GiB idle, freed with the
//!   device): a freed part's allocation, zeroed, serves the next part of its
//!   class, so a peer's UCX never finds a new allocation at an address whose
//!   IPC mapping it cached. Users' registered memory is not pooled.
//! - Errors are [`CudaError`]: the failing driver call with its `CUresult`
//!   name, the allocation size, the device ordinal, NVRTC's log.
//!
//! # What it does not know
//!
//! What a window means to the device API (ids, NIC keys, the arrays kernels
//! index), signals, descriptors, WQEs, the error word's encoding, where job
//! health comes from (the bootstrap, the fabric, an engine: the sentinel
//! asks its caller), and the device API: the backend crates and gin-core build
//! their CUDA engines and windows on top of this crate, hand NVRTC their
//! headers ([`nvrtc::compile`] takes them as data) and the watch its
//! health check.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod batch;
mod driver;
mod error;
pub mod fdpass;
mod launch;
pub mod nvrtc;
pub mod pointer;
mod pool;
pub mod puts;
pub mod staging;
pub mod testing;
pub mod vmm;
pub mod watch;
pub mod window;

/// The cudarc gin-cuda is built on (its driver API, loaded at run time),
/// re-exported so that users share its version: a cudarc `CudaStream`
/// converts into a [`StreamRef`].
pub use cudarc;
pub use driver::{
    Cubin, DevMem, Device, Event, Function, HostMem, IpcMem, MAX_WRITES, Module, RelaxedCapture,
    Stream, available,
};
pub use error::{CudaError, DriverError};
pub use launch::{Borrowed, LaunchConfig, Param, StreamRef};
