//! The user's own VMM allocator (`--memory vmm` and `--memory vmm-no-fd`),
//! written as a CUDA application writes one with the driver API through
//! cudarc's `sys` level: `cuMemCreate` of whole granules (with
//! `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` among the requested handle
//! types, or without it), `cuMemAddressReserve`, `cuMemMap`,
//! `cuMemSetAccess` read/write for this GPU; drop undoes it in reverse.
//! gin knows nothing of it: `register_window` finds out from the driver
//! that it is VMM memory and shares it with same-host peers by its file
//! descriptor, or refuses it (without that handle type) on every rank.

use gin_core::cuda::cudarc::driver::sys as cu;
use gin_core::cuda::cudarc::driver::sys::CUdevice_attribute as A;

use crate::R;

/// `Ok` for `CUDA_SUCCESS`, else the call's name and the result.
fn ok(call: &str, r: cu::CUresult) -> R {
    if r == cu::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{call} failed: {r:?}"))
    }
}

/// `bytes` rounded up to a whole number of `granule`s (at least one).
pub fn granules(bytes: usize, granule: usize) -> Option<usize> {
    let g = granule.max(1);
    bytes.max(1).div_ceil(g).checked_mul(g)
}

/// A VMM allocation mapped in this process for one GPU.
#[derive(Debug)]
pub struct VmmAlloc {
    handle: cu::CUmemGenericAllocationHandle,
    /// The reserved range (0 until reserved).
    ptr: u64,
    size: usize,
    mapped: bool,
}

impl VmmAlloc {
    /// At least `bytes` on GPU `ordinal` (whose context is current),
    /// exportable as a POSIX file descriptor where `posix_fd`.
    pub fn new(ordinal: usize, bytes: usize, posix_fd: bool) -> R<Self> {
        let mut dev = 0;
        // SAFETY: valid out-pointer; the driver checks the ordinal.
        ok("cuDeviceGet", unsafe {
            cu::cuDeviceGet(&raw mut dev, ordinal as i32)
        })?;
        let attr = |a| {
            let mut v = 0;
            // SAFETY: valid out-pointer.
            ok("cuDeviceGetAttribute", unsafe {
                cu::cuDeviceGetAttribute(&raw mut v, a, dev)
            })
            .map(|()| v != 0)
        };
        if !attr(A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)? {
            return Err(format!("GPU {ordinal} does not support VMM (cuMemCreate)"));
        }
        if posix_fd && !attr(A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)? {
            return Err(format!(
                "GPU {ordinal} cannot export VMM allocations as POSIX file descriptors"
            ));
        }
        // SAFETY: all-zero is a valid CUmemAllocationProp (INVALID enums,
        // no handle types, a null pointer); the fields are set below.
        let mut prop: cu::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = ordinal as i32;
        prop.requestedHandleTypes = if posix_fd {
            cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        } else {
            cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE
        };
        let mut granule = 0usize;
        // SAFETY: valid pointers.
        ok("cuMemGetAllocationGranularity", unsafe {
            cu::cuMemGetAllocationGranularity(
                &raw mut granule,
                &raw const prop,
                cu::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            )
        })?;
        let size = granules(bytes, granule).ok_or("allocation too large")?;
        let mut handle = 0;
        // SAFETY: valid pointers; `size` is a whole number of granules.
        ok("cuMemCreate", unsafe {
            cu::cuMemCreate(&raw mut handle, size, &raw const prop, 0)
        })?;
        // From here on, drop undoes what was done.
        let mut m = Self {
            handle,
            ptr: 0,
            size,
            mapped: false,
        };
        // SAFETY: valid out-pointer; size and alignment are granules.
        ok("cuMemAddressReserve", unsafe {
            cu::cuMemAddressReserve(&raw mut m.ptr, size, granule, 0, 0)
        })?;
        // SAFETY: the whole allocation onto the range just reserved.
        ok("cuMemMap", unsafe {
            cu::cuMemMap(m.ptr, size, 0, handle, 0)
        })?;
        m.mapped = true;
        let access = cu::CUmemAccessDesc {
            location: prop.location,
            flags: cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: one descriptor for the range just mapped.
        ok("cuMemSetAccess", unsafe {
            cu::cuMemSetAccess(m.ptr, size, &raw const access, 1)
        })?;
        Ok(m)
    }

    /// The mapping's device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for VmmAlloc {
    fn drop(&mut self) {
        // SAFETY: undoes, in reverse, what `new` did (and only that).
        unsafe {
            if self.mapped {
                cu::cuMemUnmap(self.ptr, self.size);
            }
            if self.ptr != 0 {
                cu::cuMemAddressFree(self.ptr, self.size);
            }
            cu::cuMemRelease(self.handle);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocations_are_whole_granules() {
        let mib2 = 2 << 20;
        assert_eq!(granules(1, mib2), Some(mib2));
        assert_eq!(granules(0, mib2), Some(mib2));
        assert_eq!(granules(mib2, mib2), Some(mib2));
        assert_eq!(granules(mib2 + 1, mib2), Some(2 * mib2));
        assert_eq!(granules(4096 + 3 * 4096 * 4, mib2), Some(mib2));
        assert_eq!(granules(usize::MAX, mib2), None);
        assert_eq!(granules(5, 0), Some(5));
    }
}
