//! What the driver knows about a device pointer a user hands in
//! (`cuPointerGetAttributes`), and whether that memory can be a GPU window
//! part: this GPU's device memory, inside one allocation, and, where a
//! same-host peer maps it, exportable through legacy CUDA IPC (a
//! `cuMemAlloc` allocation: not managed memory, not a stream-ordered pool's,
//! not a VMM `cuMemCreate` mapping). The decision ([`PointerFacts::export`])
//! is pure code, tested without a GPU.

use std::ffi::c_void;

use cudarc::driver::sys as cu;

use crate::driver::check;
use crate::error::CudaError;

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
}

/// How a registered range is exported: the allocation's start (what CUDA
/// IPC exports) and the range's offset in it (what a peer adds to its
/// mapping).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Export {
    /// The allocation's start.
    pub base: u64,
    /// The range's offset from it.
    pub offset: u64,
}

impl PointerFacts {
    /// Asks the driver about `ptr` (in one `cuPointerGetAttributes` call,
    /// which answers zeros rather than failing for an unknown pointer).
    pub fn query(ptr: u64) -> Result<Self, CudaError> {
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
        Ok(Self {
            memory_type,
            ordinal,
            managed: managed != 0,
            legacy_ipc: legacy_ipc != 0,
            pool: !pool.is_null(),
            range_start,
            range_size: range_size as u64,
        })
    }

    /// Whether `bytes` at `ptr` can be a window part on GPU `ordinal`, and
    /// how it is exported; `ipc`: whether a same-host peer maps it
    /// (through legacy CUDA IPC). The error says why not, in words.
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
        let end = self.range_start.saturating_add(self.range_size);
        if ptr < self.range_start || ptr.checked_add(bytes).is_none_or(|e| e > end) {
            return Err(format!(
                "the range does not lie inside one allocation (the allocation at {:#x} holds {} \
                 bytes)",
                self.range_start, self.range_size
            ));
        }
        if ipc && !self.legacy_ipc {
            return Err(if self.pool {
                "it comes from a stream-ordered memory pool (cuMemAllocAsync, which cudarc's \
                 alloc uses on GPUs with memory pools), which legacy CUDA IPC cannot export to \
                 same-host peers; allocate it with cuMemAlloc (cudarc: result::malloc_sync, \
                 then stream.upgrade_device_ptr)"
                    .into()
            } else {
                "it cannot be exported through legacy CUDA IPC to same-host peers (a VMM \
                 cuMemCreate mapping?); allocate it with cuMemAlloc"
                    .into()
            });
        }
        Ok(Export {
            base: self.range_start,
            offset: ptr - self.range_start,
        })
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
                offset: 0x1000
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
}
