//! Run a program as every rank of a local job without a launcher: when no
//! launcher variables are set, [`run_ranks`] starts `n` copies of the
//! program through gin-bootstrap's launcher; each copy (or a process
//! started by a real launcher) is one rank. Both are gin-bootstrap's,
//! re-exported here where the examples and selftests name them.

pub use gin_bootstrap::launch::{Role, run_ranks};
