//! A one-rank fabric with one window over memory it owns: drive the GDAKI
//! device side and the soft NIC without a bootstrap or other ranks (tests,
//! benchmarks, trying out work requests).

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use gin_device::{Window, WindowParts};
use gin_net::region::{Access, RegionTable};
use gin_net::{Fabric, KeepAlive, MemDesc, MemParts};

/// The fabric, window 0 over `len` bytes, and the memory behind it.
#[derive(Debug)]
pub struct Loopback {
    /// The one-rank fabric.
    pub fabric: Arc<Fabric>,
    /// Window 0 over the memory.
    pub window: Window,
    /// The window's region key (the fabric's).
    pub key: u32,
    /// The window's NIC key ([`crate::ids::window_key`]): what WQEs carry.
    pub nic_key: u32,
    /// The window's memory, also held by the fabric's description of it and
    /// by the window: it outlives every user of either.
    mem: Arc<Box<[AtomicU64]>>,
}

impl Loopback {
    /// `len` is rounded down to a multiple of 8.
    pub fn new(len: usize, timeout: Duration) -> Self {
        let table = Arc::new(RegionTable::default());
        let fabric = Arc::new(Fabric::local(table.clone(), timeout));
        let mem: Arc<Box<[AtomicU64]>> =
            Arc::new((0..len / 8).map(|_| AtomicU64::new(0)).collect());
        let len = mem.len() * 8;
        // Atomics: memory the fabric and the NIC write through raw pointers.
        let base = mem.as_ptr().cast_mut().cast::<u8>();
        // SAFETY: `mem` lives in the returned value, whose drop removes the
        // key (the table may live on in clones of `fabric`).
        let key = unsafe { table.insert(base, len as u64, Access::ALL) }.unwrap_or(0);
        let parts = MemParts {
            local_base: base as usize,
            sizes: vec![len as u64],
            peer_bases: vec![base as usize],
            keys: vec![key],
            addrs: vec![base as u64],
            states: vec![0],
            keep: Some(KeepAlive(mem.clone())),
            ..MemParts::default()
        };
        // SAFETY: `base` is `len` bytes of `mem`, which the description
        // keeps alive; it is only written through raw pointers and atomics.
        fabric.add_window(0, unsafe { MemDesc::new(parts) });
        // SAFETY: the window's memory is `mem`, which the window keeps alive.
        let window = unsafe {
            Window::from_parts(
                WindowParts {
                    id: 0,
                    rank: 0,
                    comm_id: 1,
                    local_base: base,
                    sizes: vec![len as u64],
                    peer_bases: vec![base],
                    keys: vec![key],
                    addrs: vec![base as u64],
                    states: vec![std::ptr::null()],
                },
                Box::new(mem.clone()),
            )
        };
        Self {
            fabric,
            window,
            key,
            nic_key: crate::ids::window_key(0, 0, 1).unwrap_or(0),
            mem,
        }
    }

    /// The address of byte `offset` of the window.
    pub fn addr(&self, offset: u64) -> u64 {
        self.mem.as_ptr() as u64 + offset
    }
}

impl Drop for Loopback {
    fn drop(&mut self) {
        // The table may outlive `mem` in a clone of the fabric.
        self.fabric.table().remove(self.key);
    }
}
