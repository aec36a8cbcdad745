//! What the driver knows about a device pointer a user hands in
//! (`cuPointerGetAttributes`, and for VMM memory the allocation's handle
//! types and mapped range), and whether that memory can be a GPU window
//! part: this GPU's device memory, inside one allocation, and, where a
//! same-host peer maps it, exportable — through legacy CUDA IPC (a
//! `cuMemAlloc` allocation) or as a POSIX file descriptor (a VMM
//! `cuMemCreate` allocation that requested that handle type, within one
//! mapping) — but not managed memory nor a stream-ordered pool's. The
//! decision ([`PointerFacts::export`]) is pure code, tested without a GPU.

use std::ffi::c_void;

use cudarc::driver::sys as cu;

use crate::driver::check;
use crate::error::CudaError;
pub use crate::vmm::VmmFacts;

/// `CU_MEMORYTYPE_DEVICE`.
const MEMORYTYPE_DEVICE: u32 = 2;
/// `CU_MEMORYTYPE_HOST`.
const MEMORYTYPE_HOST: u32 = 1;

/// What the driver says about a pointer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PointerFacts {
    /// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE` (0: the driver does not know the
    /// pointer; 1 host, 2 device, 3 array, 4 unified).
    pub memory_type: u32,
    /// `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL`.
    pub ordinal: i32,
    /// `CU_POINTER_ATTRIBUTE_IS_MANAGED`.
    pub managed: bool,
    /// `CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE`.
    pub legacy_ipc: bool,
    /// Whether `CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE` names a pool (a
    /// `cuMemAllocAsync` allocation).
    pub pool: bool,
    /// `CU_POINTER_ATTRIBUTE_RANGE_START_ADDR`: the allocation's start.
    pub range_start: u64,
    /// `CU_POINTER_ATTRIBUTE_RANGE_SIZE`: the allocation's size.
    pub range_size: u64,
    /// The VMM mapping the pointer lies in (`None`: not VMM memory, or not
    /// asked), asked of the driver for device memory that legacy CUDA IPC
    /// cannot export and no pool holds, where same-host peers map it.
    pub vmm: Option<VmmFacts>,
}

/// How a registered range is exported: the allocation's start (what CUDA
/// IPC exports, or where the VMM allocation is mapped) and the range's
/// offset in it (what a peer adds to its mapping).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Export {
    /// The allocation's start.
    pub base: u64,
    /// The range's offset from it.
    pub offset: u64,
    /// `Some(size)`: a VMM allocation that same-host peers import from its
    /// POSIX file descriptor and map, `size` bytes from `base`; `None`:
    /// legacy CUDA IPC (or no same-host peer).
    pub vmm: Option<u64>,
}

impl PointerFacts {
    /// Asks the driver about `ptr` (in one `cuPointerGetAttributes` call,
    /// which answers zeros rather than failing for an unknown pointer),
    /// and, where `same_host` peers map it and only then, about the VMM
    /// mapping it may lie in (without them nothing is exported: a VMM
    /// range whose mapping the driver cannot measure yet is no obstacle).
    pub fn query(ptr: u64, same_host: bool) -> Result<Self, CudaError> {
        use cu::CUpointer_attribute as A;
        crate::available()?;
        let mut memory_type = 0u32;
        let mut ordinal = -1i32;
        let mut managed = 0u32;
        let mut legacy_ipc = 0u32;
        let mut pool: *mut c_void = std::ptr::null_mut();
        let mut range_start = 0u64;
        let mut range_size = 0usize;
        let mut attrs = [
            A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            A::CU_POINTER_ATTRIBUTE_IS_MANAGED,
            A::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
            A::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
            A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            A::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        ];
        let mut data: [*mut c_void; 7] = [
            (&raw mut memory_type).cast(),
            (&raw mut ordinal).cast(),
            (&raw mut managed).cast(),
            (&raw mut legacy_ipc).cast(),
            (&raw mut pool).cast(),
            (&raw mut range_start).cast(),
            (&raw mut range_size).cast(),
        ];
        // SAFETY: seven attributes, seven out-pointers of the sizes the
        // driver writes for them (unsigned int, int, unsigned int, unsigned
        // int as a bool, a pool handle, a CUdeviceptr, a size_t).
        check("cuPointerGetAttributes", unsafe {
            cu::cuPointerGetAttributes(7, attrs.as_mut_ptr(), data.as_mut_ptr(), ptr)
        })?;
        let mut facts = Self {
            memory_type,
            ordinal,
            managed: managed != 0,
            legacy_ipc: legacy_ipc != 0,
            pool: !pool.is_null(),
            range_start,
            range_size: range_size as u64,
            vmm: None,
        };
        if same_host
            && facts.memory_type == MEMORYTYPE_DEVICE
            && !facts.managed
            && !facts.legacy_ipc
            && !facts.pool
        {
            facts.vmm = crate::vmm::facts(ptr)?;
        }
        Ok(facts)
    }

    /// Whether `bytes` at `ptr` can be a window part on GPU `ordinal`, and
    /// how it is exported; `ipc`: whether a same-host peer maps it (through
    /// legacy CUDA IPC, or a VMM allocation's file descriptor). The error
    /// says why not, in words.
    pub fn export(
        &self,
        ptr: u64,
        bytes: u64,
        ordinal: usize,
        ipc: bool,
    ) -> Result<Export, String> {
        if ptr == 0 || bytes == 0 {
            return Err("a window part needs a non-null pointer and at least one byte".into());
        }
        if self.memory_type == 0 {
            return Err(
                "the CUDA driver does not know this pointer (host memory, or freed)".into(),
            );
        }
        if self.managed {
            return Err(
                "managed memory (cuMemAllocManaged) cannot be shared through CUDA IPC; allocate \
                 the window with cuMemAlloc"
                    .into(),
            );
        }
        if self.memory_type == MEMORYTYPE_HOST {
            return Err(
                "pinned host memory is not device memory; allocate it with cuMemAlloc".into(),
            );
        }
        if self.memory_type != MEMORYTYPE_DEVICE {
            return Err(format!(
                "memory of type {} is not device memory",
                self.memory_type
            ));
        }
        if usize::try_from(self.ordinal).ok() != Some(ordinal) {
            return Err(format!(
                "it is memory of GPU {}, but this rank runs on GPU {ordinal}",
                self.ordinal
            ));
        }
        if ipc && !self.legacy_ipc {
            return match (self.pool, self.vmm) {
                (true, _) => Err(
                    "it comes from a stream-ordered memory pool (cuMemAllocAsync, which cudarc's \
                     alloc uses on GPUs with memory pools), which legacy CUDA IPC cannot export \
                     to same-host peers; allocate it with cuMemAlloc (cudarc: \
                     result::malloc_sync, then stream.upgrade_device_ptr), or with cuMemCreate \
                     requesting CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR"
                        .into(),
                ),
                (false, Some(v)) => Self::export_vmm(v, ptr, bytes),
                (false, None) => Err(
                    "it cannot be exported to same-host peers: neither legacy CUDA IPC nor the \
                     driver's VMM calls (cuMemRetainAllocationHandle) know it; allocate it with \
                     cuMemAlloc, or with cuMemCreate requesting \
                     CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR"
                        .into(),
                ),
            };
        }
        let end = self.range_start.saturating_add(self.range_size);
        if ptr < self.range_start || ptr.checked_add(bytes).is_none_or(|e| e > end) {
            return Err(format!(
                "the range does not lie inside one allocation (the allocation at {:#x} holds {} \
                 bytes)",
                self.range_start, self.range_size
            ));
        }
        Ok(Export {
            base: self.range_start,
            offset: ptr - self.range_start,
            vmm: None,
        })
    }

    /// How a range in VMM mapping `v` is exported to same-host peers: as
    /// the allocation's POSIX file descriptor, which it must have been
    /// created to allow, and within the one mapping (a range over several
    /// adjacent mappings, each its own allocation, is refused naming the
    /// one it runs out of).
    fn export_vmm(v: VmmFacts, ptr: u64, bytes: u64) -> Result<Export, String> {
        if !v.posix_fd() {
            return Err(format!(
                "it is VMM memory (cuMemCreate) whose allocation was created without \
                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR among its requested handle types \
                 ({:#x}), or imported from another process (whose allocations report none), so \
                 it cannot be shared with same-host peers; create the allocation with \
                 CUmemAllocationProp::requestedHandleTypes including \
                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR in the process that registers it (or \
                 allocate with cuMemAlloc)",
                v.handle_types
            ));
        }
        let end = v.base.saturating_add(v.size);
        if ptr < v.base || ptr >= end {
            return Err(format!(
                "the driver places it in the VMM mapping at {:#x} ({} bytes), which does not \
                 hold it",
                v.base, v.size
            ));
        }
        if ptr.checked_add(bytes).is_none_or(|e| e > end) {
            return Err(format!(
                "the range runs past the end of the VMM chunk it starts in (the cuMemCreate \
                 allocation mapped at {:#x}, {} bytes, ends {} bytes into the range): a window \
                 over several chunks mapped side by side is not supported; register each chunk \
                 as its own window, or back the range with one cuMemCreate allocation",
                v.base,
                v.size,
                end - ptr
            ));
        }
        Ok(Export {
            base: v.base,
            offset: ptr - v.base,
            vmm: Some(v.size),
        })
    }
}

/// The refusal to give where [`PointerFacts::query`] failed with `e`
/// because the driver cannot measure a VMM mapping: before
/// `cuMemSetAccess`, `cuMemGetAddressRange` does not find the range
/// (`CUDA_ERROR_NOT_FOUND`). `None` for any other failure.
pub(crate) fn unmeasured(e: &CudaError) -> Option<String> {
    match e {
        CudaError::Driver(d) if d.call == "cuMemGetAddressRange" => Some(format!(
            "it is VMM memory (cuMemCreate) whose mapped range the driver cannot give ({d}): set \
             access to the mapping with cuMemSetAccess before registering it"
        )),
        _ => None,
    }
}

/// The legacy CUDA IPC handle of the allocation starting at `base`.
pub(crate) fn ipc_handle_of(base: u64) -> Result<[u8; 64], CudaError> {
    // SAFETY: an all-zero handle is a valid out-value.
    let mut h: cu::CUipcMemHandle = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer; the driver checks that `base` is an
    // exportable allocation's.
    check("cuIpcGetMemHandle", unsafe {
        cu::cuIpcGetMemHandle(&raw mut h, base)
    })?;
    Ok(h.reserved.map(|c| c as u8))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `cuMemAlloc` allocation of 1 MiB on GPU 0 at 0x7f00_0000_0000.
    fn mem_alloc() -> PointerFacts {
        PointerFacts {
            memory_type: MEMORYTYPE_DEVICE,
            ordinal: 0,
            managed: false,
            legacy_ipc: true,
            pool: false,
            range_start: 0x7f00_0000_0000,
            range_size: 1 << 20,
            vmm: None,
        }
    }

    #[test]
    fn a_range_inside_a_mem_alloc_allocation_exports_its_base_and_offset() {
        let f = mem_alloc();
        let e = f
            .export(0x7f00_0000_1000, 4096, 0, true)
            .unwrap_or_else(|w| panic!("{w}"));
        assert_eq!(
            e,
            Export {
                base: 0x7f00_0000_0000,
                offset: 0x1000,
                vmm: None,
            }
        );
        // The whole allocation, exactly.
        let e = f
            .export(0x7f00_0000_0000, 1 << 20, 0, true)
            .unwrap_or_else(|w| panic!("{w}"));
        assert_eq!(e.offset, 0);
    }

    #[test]
    fn memory_that_cannot_be_a_window_part_is_refused_with_the_reason() {
        let f = mem_alloc();
        let why = |f: PointerFacts, ptr, bytes, ipc| f.export(ptr, bytes, 0, ipc).unwrap_err();
        assert!(why(f, 0, 8, true).contains("non-null"));
        assert!(why(f, 0x7f00_0000_0000, 0, true).contains("at least one byte"));
        // Past the allocation's end, and wrapping around.
        assert!(why(f, 0x7f00_000f_f000, 8192, true).contains("inside one allocation"));
        assert!(why(f, 0x7f00_0000_0000, u64::MAX, true).contains("inside one allocation"));
        assert!(why(f, 0x7eff_ffff_f000, 16, true).contains("inside one allocation"));
        // Another GPU's memory.
        let e = f.export(0x7f00_0000_0000, 8, 1, true).unwrap_err();
        assert!(
            e.contains("memory of GPU 0, but this rank runs on GPU 1"),
            "{e}"
        );
        // Unknown to the driver, managed, pinned host.
        let unknown = PointerFacts::default();
        assert!(why(unknown, 0x1000, 8, false).contains("does not know"));
        let managed = PointerFacts {
            managed: true,
            memory_type: 4,
            ..f
        };
        assert!(why(managed, 0x7f00_0000_0000, 8, true).contains("managed memory"));
        let host = PointerFacts {
            memory_type: MEMORYTYPE_HOST,
            ..f
        };
        assert!(why(host, 0x7f00_0000_0000, 8, false).contains("pinned host memory"));
        // A stream-ordered pool's and a VMM allocation: fine without
        // same-host peers, refused with them.
        let pool = PointerFacts {
            legacy_ipc: false,
            pool: true,
            ..f
        };
        assert!(pool.export(0x7f00_0000_0000, 8, 0, false).is_ok());
        assert!(why(pool, 0x7f00_0000_0000, 8, true).contains("cuMemAllocAsync"));
        let vmm = PointerFacts {
            legacy_ipc: false,
            ..f
        };
        assert!(why(vmm, 0x7f00_0000_0000, 8, true).contains("cuMemCreate"));
    }

    /// A VMM allocation of 2 MiB mapped at 0x7e00_0000_0000, as
    /// cuMemCreate makes it with `handle_types` requested; the pointer
    /// attributes say what they say of such memory (device memory, not
    /// legacy-IPC capable, no pool).
    fn vmm(handle_types: u32) -> PointerFacts {
        PointerFacts {
            memory_type: MEMORYTYPE_DEVICE,
            ordinal: 0,
            managed: false,
            legacy_ipc: false,
            pool: false,
            range_start: 0x7e00_0000_0000,
            range_size: 2 << 20,
            vmm: Some(VmmFacts {
                base: 0x7e00_0000_0000,
                size: 2 << 20,
                handle_types,
            }),
        }
    }

    #[test]
    fn vmm_memory_with_the_posix_fd_handle_type_is_exported_by_descriptor() {
        let f = vmm(crate::vmm::HANDLE_TYPE_POSIX_FD);
        let e = f
            .export(0x7e00_0000_1000, 4096, 0, true)
            .unwrap_or_else(|w| panic!("{w}"));
        assert_eq!(
            e,
            Export {
                base: 0x7e00_0000_0000,
                offset: 0x1000,
                vmm: Some(2 << 20),
            }
        );
        // The whole mapping, exactly; and other handle types beside it
        // (FABRIC, 8) change nothing.
        let f = vmm(crate::vmm::HANDLE_TYPE_POSIX_FD | 8);
        let e = f
            .export(0x7e00_0000_0000, 2 << 20, 0, true)
            .unwrap_or_else(|w| panic!("{w}"));
        assert_eq!((e.offset, e.vmm), (0, Some(2 << 20)));
        // Without same-host peers nothing is exported: the pointer's
        // allocation range is all that counts, as for any memory.
        let e = f
            .export(0x7e00_0000_0000, 4096, 0, false)
            .unwrap_or_else(|w| panic!("{w}"));
        assert_eq!(e.vmm, None);
    }

    #[test]
    fn vmm_memory_without_the_posix_fd_handle_type_is_refused_saying_what_to_request() {
        for types in [0, 8] {
            let f = vmm(types);
            let e = f.export(0x7e00_0000_0000, 4096, 0, true).unwrap_err();
            assert!(
                e.contains("VMM memory (cuMemCreate)")
                    && e.contains("created without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR")
                    && e.contains("or imported from another process")
                    && e.contains(
                        "requestedHandleTypes including CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR"
                    ),
                "{e}"
            );
            // Fine where no same-host peer maps it.
            assert!(f.export(0x7e00_0000_0000, 4096, 0, false).is_ok());
        }
    }

    #[test]
    fn a_range_over_several_vmm_chunks_is_refused_naming_the_chunk_it_runs_out_of() {
        let f = vmm(crate::vmm::HANDLE_TYPE_POSIX_FD);
        // 4 KiB before the end of the 2 MiB chunk, 8 KiB long: it runs into
        // whatever is mapped next.
        let e = f.export(0x7e00_001f_f000, 8192, 0, true).unwrap_err();
        assert!(
            e.contains("runs past the end of the VMM chunk")
                && e.contains(
                    "mapped at 0x7e0000000000, 2097152 bytes, ends 4096 bytes into the range"
                )
                && e.contains("register each chunk as its own window"),
            "{e}"
        );
        assert!(f.export(0x7e00_0000_0000, u64::MAX, 0, true).is_err());
        // The driver's account of the mapping not holding the pointer.
        let e = f.export(0x7e00_0020_0000, 8, 0, true).unwrap_err();
        assert!(e.contains("does not hold it"), "{e}");
    }

    #[test]
    fn a_vmm_mapping_the_driver_cannot_measure_is_refused_saying_to_set_access() {
        let d = crate::error::DriverError {
            call: "cuMemGetAddressRange",
            code: 500,
            name: "CUDA_ERROR_NOT_FOUND".into(),
            text: "named symbol not found".into(),
        };
        let why = unmeasured(&CudaError::Driver(d.clone())).unwrap();
        assert!(
            why.contains("CUDA_ERROR_NOT_FOUND")
                && why.contains("set access to the mapping with cuMemSetAccess"),
            "{why}"
        );
        // Any other failure is left as it is.
        let other = crate::error::DriverError {
            call: "cuPointerGetAttributes",
            ..d
        };
        assert_eq!(unmeasured(&CudaError::Driver(other)), None);
    }

    #[test]
    fn pool_and_managed_memory_stay_refused_whatever_the_vmm_facts() {
        let f = vmm(crate::vmm::HANDLE_TYPE_POSIX_FD);
        let pool = PointerFacts { pool: true, ..f };
        let e = pool.export(0x7e00_0000_0000, 8, 0, true).unwrap_err();
        assert!(e.contains("stream-ordered memory pool"), "{e}");
        let managed = PointerFacts {
            managed: true,
            memory_type: 4,
            ..f
        };
        let e = managed.export(0x7e00_0000_0000, 8, 0, true).unwrap_err();
        assert!(e.contains("managed memory"), "{e}");
        // The other checks come first for VMM memory too.
        let e = f.export(0x7e00_0000_0000, 8, 1, true).unwrap_err();
        assert!(
            e.contains("memory of GPU 0, but this rank runs on GPU 1"),
            "{e}"
        );
        assert!(f.export(0, 8, 0, true).unwrap_err().contains("non-null"));
    }
}
