//! A one-rank fabric with one window over memory it owns: drive the GDAKI
//! device side and the soft NIC without a bootstrap or other ranks (tests,
//! benchmarks, trying out work requests).

use std::sync::Arc;
use std::time::Duration;

use gin_device::{Window, WindowParts};
use gin_net::region::{Access, RegionTable};
use gin_net::{Fabric, MemDesc, Path};

/// The fabric, window 0 over `len` bytes, and the memory behind it.
#[derive(Debug)]
pub struct Loopback {
    /// The one-rank fabric.
    pub fabric: Arc<Fabric>,
    /// Window 0 over the memory.
    pub window: Window,
    /// The NIC key of the window ([`crate::ids::window_key`]).
    pub key: u32,
    /// The window's memory; dropped last.
    mem: Box<[u64]>,
}

impl Loopback {
    /// `len` is rounded down to a multiple of 8.
    pub fn new(len: usize, timeout: Duration) -> Self {
        let table = Arc::new(RegionTable::default());
        let fabric = Arc::new(Fabric::new(
            0,
            vec![Path::Local],
            table.clone(),
            None,
            timeout,
        ));
        let mut mem = vec![0u64; len / 8].into_boxed_slice();
        let len = mem.len() * 8;
        let base = mem.as_mut_ptr().cast::<u8>();
        // SAFETY: `mem` lives in the returned value, and the key is removed
        // from the table only with the fabric, which the value also holds.
        let region = unsafe { table.insert(base, len as u64, Access::ALL) }.unwrap_or(0);
        fabric.add_window(
            0,
            MemDesc {
                local_base: base as usize,
                sizes: vec![len as u64],
                peer_bases: vec![base as usize],
                keys: vec![region],
                addrs: vec![base as u64],
                states: vec![0],
                keep: None,
            },
        );
        // SAFETY: as above; the window's memory is `mem`.
        let window = unsafe {
            Window::from_parts(
                WindowParts {
                    id: 0,
                    rank: 0,
                    comm_id: 1,
                    local_base: base,
                    sizes: vec![len as u64],
                    peer_bases: vec![base],
                    keys: vec![region],
                    addrs: vec![base as u64],
                    states: vec![std::ptr::null()],
                },
                Box::new(()),
            )
        };
        Self {
            fabric,
            window,
            key: crate::ids::window_key(0, 0, 1).unwrap_or(0),
            mem,
        }
    }

    /// The address of byte `offset` of the window.
    pub fn addr(&self, offset: u64) -> u64 {
        self.mem.as_ptr() as u64 + offset
    }
}
