//! gin-net: the fabric under both backends, NCCL's net/RMA plugin layer:
//! memory registration with keys, endpoints, one-sided write, write with an
//! atomic, atomics and reads, and their completions, over shared memory
//! (same host), TCP (any host) and, where hardware exists, ibverbs.
//!
//! Not yet built: an empty library until the CPU-ranks issue fills it.
//! It will use gin-bootstrap only to exchange endpoint addresses.
