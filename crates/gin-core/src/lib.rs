//! gin-core: the host API (tier 1) that users hold.
//!
//! It will own the communicator built from a `gin_bootstrap::Bootstrap`, the
//! device-communicator requirements (signals, counters, contexts, barriers,
//! queue depth, connection type), the signal/counter id space, window
//! registration with symmetric addressing, and backend selection
//! (`GIN_BACKEND=auto|proxy|gdaki`, `GIN_TRANSPORT=auto|shm|tcp`).
//!
//! Not yet built: this crate is an empty library until the CPU-ranks issue
//! fills it. It will not know WQE or descriptor formats: those belong to the
//! backends.
