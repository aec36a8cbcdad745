//! High-throughput mode (see below).

use crate::buffer::Hosts;
use crate::config::Config;
use crate::error::EpError;

/// Signals and window sizes of a high-throughput buffer.
pub(crate) fn resources(
    cfg: &Config,
    rank: usize,
    hosts: &Hosts,
) -> Result<(u32, Vec<usize>), EpError> {
    let _ = (cfg, hosts);
    Err(EpError::Mode {
        rank,
        what: "high-throughput mode is not built yet".into(),
    })
}
