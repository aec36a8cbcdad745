//! Shared by the integration tests: a device communicator with no signals,
//! counters or barriers, over a test's own backend and job health.

use std::sync::Arc;
use std::time::Duration;

use gin_device::{Backend, Counters, DevComm, DevCommParts, Health, Window};

/// Rank `rank` of `nranks`, one context, every peer connected and none by
/// load/store, waits bounded by `timeout`.
pub fn dev_comm(
    rank: usize,
    nranks: usize,
    backend: Arc<dyn Backend>,
    health: Arc<dyn Health>,
    timeout: Duration,
) -> DevComm {
    DevComm::new(DevCommParts {
        rank,
        nranks,
        comm_id: 0,
        nctx: 1,
        nsignals: 0,
        ncounters: 0,
        world_barriers: 0,
        rail_barriers: 0,
        signal_window: Window::empty(),
        signal_base: 0,
        signal_slots: 0,
        counters: Arc::new(Counters::new(0)),
        counter_base: 0,
        lsa: vec![false; nranks],
        connected: vec![true; nranks],
        rail: vec![0],
        strong_signals: false,
        va_signals: false,
        exclusive_contexts: false,
        backend,
        health,
        timeout,
    })
    .expect("a device communicator with no signals")
}
