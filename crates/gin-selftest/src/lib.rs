//! gin-selftest: the project's own checks of the device API across the ranks
//! of a job, written as users' code of gin-core's public API.
//!
//! # Design
//!
//! - **`gin-selftest`** (`src/bin/gin-selftest.rs`) runs every operation on
//!   CPU ranks and checks every byte; the multi-process tests (`tests/`) run
//!   it with 2 to 8 rank processes under every backend and transport, with
//!   ranks killed, stopped or leaving mid-run, and on two emulated hosts.
//! - **`gin-cuda-selftest`** (`src/bin/gin-cuda-selftest.rs`) does the same
//!   on CUDA ranks with the kernels of [`KERNELS`] (CUDA C++ that includes
//!   `gin/gin.cuh`, compiled at run time with NVRTC), and runs NCCL's GIN
//!   all-to-all written in NCCL's names ([`NCCL_ALLTOALL`]). Where no GPU
//!   is usable it prints `SKIPPED: <reason>` and exits 0.
//! - Both spawn their own ranks (`--ranks N`) or run as one rank under a
//!   launcher, through [`gin_core::launch::run_ranks`].
//!
//! # What it does not know
//!
//! Anything gin-core does not make public: a check that needs more is a
//! sign the public API lacks it.

#![warn(missing_docs)]

/// The kernels of `gin-cuda-selftest` and of gin-bench's CUDA benchmarks
/// (CUDA C++ that includes `gin/gin.cuh`), for
/// [`CudaComm::compile`](gin_core::cuda::CudaComm::compile).
pub const KERNELS: &str = include_str!("../kernels/selftest.cu");

/// NCCL's GIN all-to-all example written in NCCL's device names only
/// (through `gin/nccl_compat.cuh`): kernel `nccl_alltoall`, run by
/// `gin-cuda-selftest nccl-alltoall`.
pub const NCCL_ALLTOALL: &str = include_str!("../kernels/nccl_alltoall.cu");

/// The kernels of `gin-cuda-selftest parity` (`gin_parity`,
/// `gin_parity_refuse`): weak signals, put_value of 1/2/4/8 bytes, VA
/// signals, per-call timeouts, flush_async/wait and barrier fences.
pub const PARITY: &str = include_str!("../kernels/parity.cu");
