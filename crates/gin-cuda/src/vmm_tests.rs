//! VMM memory on a real GPU (GPU 0), opt-in: they run only with
//! `GIN_GPU_TESTS=1` (and say they skipped otherwise), as CI has no GPU.
//! Built here and run on the GPU machine:
//!
//! ```text
//! cargo test -p gin-cuda --lib --no-run      # prints target/debug/deps/gin_cuda-<hash>
//! GIN_GPU_TESTS=1 ./gin_cuda-<hash> vmm::tests --test-threads=1 --nocapture
//! ```

#![allow(clippy::unwrap_used)]

use std::os::fd::AsFd;

use super::*;
use crate::driver::{DevMem, Device};
use crate::pointer::{PointerFacts, unmeasured};

/// GPU 0, current on this thread, where `GIN_GPU_TESTS=1`.
fn gpu() -> Option<Device> {
    if std::env::var("GIN_GPU_TESTS").as_deref() != Ok("1") {
        eprintln!("skipped: set GIN_GPU_TESTS=1 to run the VMM tests on GPU 0");
        return None;
    }
    let d = Device::open(0).unwrap();
    d.make_current().unwrap();
    Some(d)
}

/// `n` `cuMemCreate` allocations of one granule each, with the POSIX-FD
/// handle type, mapped side by side in one reserved range (read/write for
/// GPU 0 where `access`); undone on drop.
struct Chunks {
    base: u64,
    granule: usize,
    handles: Vec<cu::CUmemGenericAllocationHandle>,
    mapped: usize,
}

impl Chunks {
    fn new(n: usize, access: bool) -> Self {
        // SAFETY: all-zero is a valid CUmemAllocationProp.
        let mut prop: cu::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = 0;
        prop.requestedHandleTypes =
            cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        let mut granule = 0usize;
        // SAFETY: a valid prop and out-pointer.
        check("cuMemGetAllocationGranularity", unsafe {
            cu::cuMemGetAllocationGranularity(
                &raw mut granule,
                &raw const prop,
                cu::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        })
        .unwrap();
        let mut c = Self {
            base: 0,
            granule,
            handles: Vec::new(),
            mapped: 0,
        };
        // SAFETY: valid out-pointer; a multiple of the granularity.
        check("cuMemAddressReserve", unsafe {
            cu::cuMemAddressReserve(&raw mut c.base, n * granule, granule, 0, 0)
        })
        .unwrap();
        for i in 0..n {
            let mut h = 0;
            // SAFETY: valid out-pointer and prop.
            check("cuMemCreate", unsafe {
                cu::cuMemCreate(&raw mut h, granule, &raw const prop, 0)
            })
            .unwrap();
            c.handles.push(h);
            // SAFETY: one granule of the range reserved above, from the
            // allocation's offset 0.
            check("cuMemMap", unsafe {
                cu::cuMemMap(c.chunk(i), granule, 0, h, 0)
            })
            .unwrap();
            c.mapped += 1;
        }
        if access {
            let desc = cu::CUmemAccessDesc {
                location: prop.location,
                flags: cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            // SAFETY: the range mapped above; one descriptor.
            check("cuMemSetAccess", unsafe {
                cu::cuMemSetAccess(c.base, n * granule, &raw const desc, 1)
            })
            .unwrap();
        }
        c
    }

    /// Chunk `i`'s address.
    fn chunk(&self, i: usize) -> u64 {
        self.base + (i * self.granule) as u64
    }
}

impl Drop for Chunks {
    fn drop(&mut self) {
        // SAFETY: undoes what `new` did.
        unsafe {
            for i in 0..self.mapped {
                warn_on("cuMemUnmap", cu::cuMemUnmap(self.chunk(i), self.granule));
            }
            for &h in &self.handles {
                warn_on("cuMemRelease", cu::cuMemRelease(h));
            }
            warn_on(
                "cuMemAddressFree",
                cu::cuMemAddressFree(self.base, self.handles.len() * self.granule),
            );
        }
    }
}

#[test]
fn two_chunks_side_by_side_are_two_mappings_and_a_range_over_both_is_refused() {
    let Some(_gpu) = gpu() else { return };
    let c = Chunks::new(2, true);
    let g = c.granule as u64;
    for i in 0..2 {
        let at = c.chunk(i);
        // Anywhere in the chunk: its own mapping, exportable by descriptor.
        for ptr in [at, at + g / 2, at + g - 1] {
            let f = facts(ptr).unwrap().unwrap();
            assert_eq!((f.base, f.size), (at, g), "chunk {i}, {ptr:#x}");
            assert!(f.posix_fd(), "{f:?}");
        }
    }
    let p = PointerFacts::query(c.chunk(0) + 4096, true).unwrap();
    let e = p.export(c.chunk(0) + 4096, 4096, 0, true).unwrap();
    assert_eq!((e.base, e.offset, e.vmm), (c.chunk(0), 4096, Some(g)));
    // 4 KiB before the first chunk's end, 8 KiB long: refused, naming it.
    let ptr = c.chunk(1) - 4096;
    let why = PointerFacts::query(ptr, true)
        .unwrap()
        .export(ptr, 8192, 0, true)
        .unwrap_err();
    assert!(
        why.contains("runs past the end of the VMM chunk")
            && why.contains(&format!("mapped at {:#x}, {g} bytes", c.chunk(0))),
        "{why}"
    );
}

#[test]
fn what_is_written_through_an_import_of_the_descriptor_is_read_through_the_original() {
    let Some(_gpu) = gpu() else { return };
    let c = Chunks::new(1, true);
    let original = {
        // SAFETY: the chunk's bytes, mapped read/write, outliving this.
        unsafe { DevMem::from_raw_parts(c.base, c.granule) }
    };
    original.write(0, &[0u8; 64]).unwrap();
    // Handed over a descriptor socket, as to a same-host peer.
    let job =
        crate::fdpass::FdJob::from_tokens([0x6d; 8], [1; 32], std::time::Duration::from_secs(30))
            .with_pids(vec![Some(std::process::id()); 2]);
    let server = crate::fdpass::FdServer::start(
        crate::fdpass::FdListener::bind(&job, 0, 1).unwrap(),
        export_fd(c.base).unwrap(),
        [1],
    )
    .unwrap();
    let fd = crate::fdpass::fetch(&job, 1, 1, 0).unwrap();
    server.wait().unwrap();
    let m = VmmMapping::open(fd.as_fd(), c.granule as u64, 0).unwrap();
    drop(fd);
    assert_eq!(m.len(), c.granule);
    assert_ne!(m.ptr(), c.base);
    let import = {
        // SAFETY: the mapping's bytes, read/write for GPU 0, outliving this.
        unsafe { DevMem::from_raw_parts(m.ptr(), m.len()) }
    };
    import.write(4096, b"through the import").unwrap();
    let mut back = [0u8; 18];
    original.read(4096, &mut back).unwrap();
    assert_eq!(&back, b"through the import");
    // And the other way.
    original.write(0, b"original").unwrap();
    let mut back = [0u8; 8];
    import.read(0, &mut back).unwrap();
    assert_eq!(&back, b"original");
}

#[test]
fn a_mapping_without_access_is_asked_about_only_for_same_host_peers() {
    let Some(_gpu) = gpu() else { return };
    let c = Chunks::new(1, false);
    // Without same-host peers nothing is exported: no VMM query, nothing
    // to fail.
    let f = PointerFacts::query(c.base, false).unwrap();
    assert_eq!(f.vmm, None);
    // With them, the driver cannot measure the mapping before
    // cuMemSetAccess: a refusal saying so.
    match PointerFacts::query(c.base, true) {
        Err(e) => {
            let why = unmeasured(&e).unwrap_or_else(|| panic!("{e}"));
            assert!(why.contains("cuMemSetAccess"), "{why}");
        }
        Ok(f) => panic!("no refusal for a mapping without access: {f:?}"),
    }
}
