//! gin-device: the device API (tier 2): what a kernel, or a CPU rank running
//! the same algorithm, calls to put, signal, get, flush, wait and barrier.
//!
//! It will own the `#[repr(C)]` ABI the GPU sees (device communicator, window
//! and context handles, signal and counter ids, teams, coop kinds) with layout
//! assertions, the Rust API for CPU ranks, and the CUDA C++ header tree.
//!
//! Not yet built: an empty library until the CPU-ranks issue fills it.
//! **Invariant:** gin-device knows nothing about sockets, threads or
//! transports; backends plug in beneath it.
