//! gin-proxy: the proxy backend. Device code writes fixed-size descriptors
//! into a ring per (context, peer); a host proxy thread drains them in batches,
//! executes them through gin-net, applies each signal after its data, and bumps
//! local counters on completion.
//!
//! Not yet built: an empty library until the CPU-ranks issue fills it.
