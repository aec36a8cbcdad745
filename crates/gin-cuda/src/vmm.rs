//! VMM memory — `cuMemCreate` allocations mapped with `cuMemMap` — as a
//! window part same-host peers map: what the driver says about a mapping
//! ([`VmmFacts`]), the exporter's POSIX file descriptor
//! (`cuMemExportToShareableHandle`, handed over by [`crate::fdpass`]), and
//! a peer's import of it ([`VmmMapping`]: `cuMemImportFromShareableHandle`,
//! `cuMemAddressReserve`, `cuMemMap`, `cuMemSetAccess`, undone in reverse
//! on drop). Only an allocation created with
//! `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` among its requested handle
//! types can be exported; [`crate::pointer::PointerFacts::export`] decides.

use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use cudarc::driver::sys as cu;

use crate::driver::check;
use crate::error::{CudaError, DriverError};

/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`'s bit in a requested
/// handle-type mask.
pub const HANDLE_TYPE_POSIX_FD: u32 = 1;

/// `CU_MEM_LOCATION_TYPE_DEVICE`.
const LOCATION_TYPE_DEVICE: u32 = 1;

/// What the driver says about the VMM mapping a pointer lies in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct VmmFacts {
    /// The mapping's start (`cuMemGetAddressRange`): where this process
    /// mapped the allocation. `cuMemMap` maps an allocation from offset 0
    /// only (the driver's current limit: a non-zero offset returns
    /// `CUDA_ERROR_NOT_SUPPORTED` on driver 580), so this is where the
    /// allocation starts, and a peer maps it whole, from offset 0.
    pub base: u64,
    /// The mapping's size.
    pub size: u64,
    /// `CUmemAllocationProp::requestedHandleTypes` as created: the handle
    /// types the allocation can be exported as.
    pub handle_types: u32,
}

impl VmmFacts {
    /// Whether the allocation can be exported as a POSIX file descriptor.
    pub fn posix_fd(&self) -> bool {
        self.handle_types & HANDLE_TYPE_POSIX_FD != 0
    }
}

/// `CUmemAllocationProp` as the driver writes it, with plain integers
/// where cudarc's bindings have enums (a newer driver may write a value
/// the bindings' enum lacks, which a Rust enum must never hold).
#[repr(C)]
#[derive(Clone, Copy)]
struct Props {
    kind: u32,
    requested_handle_types: u32,
    location_type: u32,
    location_id: i32,
    win32_metadata: *mut c_void,
    alloc_flags: [u8; 8],
}

const _: () = assert!(size_of::<Props>() == size_of::<cu::CUmemAllocationProp>());
const _: () = assert!(align_of::<Props>() == align_of::<cu::CUmemAllocationProp>());

/// An allocation's properties (`cuMemGetAllocationPropertiesFromHandle`).
fn props(h: cu::CUmemGenericAllocationHandle) -> Result<Props, DriverError> {
    let mut p = MaybeUninit::<Props>::zeroed();
    // SAFETY: `Props` has `CUmemAllocationProp`'s size and alignment (the
    // assertions above), and every bit pattern is a valid `Props`.
    check("cuMemGetAllocationPropertiesFromHandle", unsafe {
        cu::cuMemGetAllocationPropertiesFromHandle(p.as_mut_ptr().cast(), h)
    })?;
    // SAFETY: zeroed, then written by the driver: plain integers.
    Ok(unsafe { p.assume_init() })
}

/// The allocation handle behind a mapped address, retained
/// (`cuMemRetainAllocationHandle`) and released on drop.
struct Retained(cu::CUmemGenericAllocationHandle);

impl Retained {
    /// Fails unless `ptr` lies in a VMM mapping.
    fn of(ptr: u64) -> Result<Self, DriverError> {
        let mut h = 0;
        // SAFETY: valid out-pointer; the driver checks the address (any
        // address inside a mapping, as an opaque pointer-sized value).
        check("cuMemRetainAllocationHandle", unsafe {
            cu::cuMemRetainAllocationHandle(&raw mut h, ptr as usize as *mut c_void)
        })?;
        Ok(Self(h))
    }
}

impl Drop for Retained {
    fn drop(&mut self) {
        // SAFETY: releases the reference `of` took.
        warn_on("cuMemRelease", unsafe { cu::cuMemRelease(self.0) });
    }
}

/// Logs a failed driver call of a drop (which cannot fail) at warn.
fn warn_on(call: &'static str, r: cu::CUresult) {
    if let Err(e) = check(call, r) {
        tracing::warn!("undoing a VMM mapping: {e}");
    }
}

/// The VMM mapping `ptr` lies in, or `None` when it is not VMM memory
/// (`cuMemRetainAllocationHandle` refuses it).
pub(crate) fn facts(ptr: u64) -> Result<Option<VmmFacts>, CudaError> {
    let Ok(h) = Retained::of(ptr) else {
        return Ok(None);
    };
    let p = props(h.0)?;
    let (mut base, mut size) = (0u64, 0usize);
    // SAFETY: valid out-pointers.
    check("cuMemGetAddressRange", unsafe {
        cu::cuMemGetAddressRange_v2(&raw mut base, &raw mut size, ptr)
    })?;
    Ok(Some(VmmFacts {
        base,
        size: size as u64,
        handle_types: p.requested_handle_types,
    }))
}

/// The POSIX file descriptor of the allocation mapped at `ptr`
/// (`cuMemExportToShareableHandle`): a peer that holds it can import and
/// map the allocation.
pub(crate) fn export_fd(ptr: u64) -> Result<OwnedFd, CudaError> {
    let h = Retained::of(ptr)?;
    let mut fd: libc::c_int = -1;
    // SAFETY: for POSIX file descriptors the shareable handle is an int,
    // written to the out-pointer.
    check("cuMemExportToShareableHandle", unsafe {
        cu::cuMemExportToShareableHandle(
            (&raw mut fd).cast(),
            h.0,
            cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    })?;
    // SAFETY: a descriptor the driver just created for this process.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Another process's VMM allocation, imported from its file descriptor
/// and mapped here, read/write for this GPU. Drop undoes it in reverse:
/// `cuMemUnmap`, `cuMemAddressFree`, `cuMemRelease`. The mapping holds the
/// allocation alive on its own, so its owner freeing it first leaves this
/// mapping valid (unlike legacy CUDA IPC).
#[derive(Debug)]
pub struct VmmMapping {
    handle: cu::CUmemGenericAllocationHandle,
    /// The reserved range (0 until reserved).
    ptr: u64,
    size: usize,
    mapped: bool,
}

impl VmmMapping {
    /// Imports the allocation `fd` names and maps it whole, `size` bytes
    /// from offset 0 (the exporter's mapping, of the whole allocation:
    /// `cuMemMap` maps from offset 0 only), read/write for GPU `ordinal`. The
    /// descriptor stays the caller's (close it after: the import holds the
    /// allocation).
    pub fn open(fd: BorrowedFd<'_>, size: u64, ordinal: usize) -> Result<Self, CudaError> {
        crate::available()?;
        let len = usize::try_from(size).map_err(|_| CudaError::Unavailable {
            why: format!("a {size}-byte mapping does not fit this machine's address space"),
        })?;
        let mut handle = 0;
        // SAFETY: for POSIX file descriptors the shareable handle is the
        // descriptor's number cast to a pointer; the driver checks it.
        check("cuMemImportFromShareableHandle", unsafe {
            cu::cuMemImportFromShareableHandle(
                &raw mut handle,
                fd.as_raw_fd() as usize as *mut c_void,
                cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })?;
        // From here on, drop undoes what was done.
        let mut m = Self {
            handle,
            ptr: 0,
            size: len,
            mapped: false,
        };
        // The granularity of this GPU (the importer's), not of the
        // exporter's, which the handle's properties name.
        let mut p = props(handle)?;
        p.location_type = LOCATION_TYPE_DEVICE;
        p.location_id = i32::try_from(ordinal).map_err(|_| CudaError::NoSuchDevice {
            ordinal,
            count: crate::available().unwrap_or(0),
        })?;
        let mut granularity = 0usize;
        // SAFETY: `p` has `CUmemAllocationProp`'s layout, as the driver
        // wrote it, with this GPU as its location; valid out-pointer.
        check("cuMemGetAllocationGranularity", unsafe {
            cu::cuMemGetAllocationGranularity(
                &raw mut granularity,
                (&raw mut p).cast(),
                cu::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        })?;
        let mut ptr = 0;
        // SAFETY: valid out-pointer; the driver checks size and alignment.
        check("cuMemAddressReserve", unsafe {
            cu::cuMemAddressReserve(&raw mut ptr, len, granularity, 0, 0)
        })?;
        m.ptr = ptr;
        // SAFETY: maps the imported allocation from its start onto the
        // range just reserved, `len` bytes (the exporter mapped as many).
        check("cuMemMap", unsafe { cu::cuMemMap(ptr, len, 0, handle, 0) })?;
        m.mapped = true;
        let access = cu::CUmemAccessDesc {
            location: cu::CUmemLocation {
                type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: ordinal as i32,
            },
            flags: cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: one access descriptor for the range just mapped.
        check("cuMemSetAccess", unsafe {
            cu::cuMemSetAccess(ptr, len, &raw const access, 1)
        })?;
        Ok(m)
    }

    /// The mapping's device address in this process.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.size
    }

    /// Whether it maps nothing (never: an allocation has bytes).
    pub fn is_empty(&self) -> bool {
        self.size == 0
    }
}

impl Drop for VmmMapping {
    fn drop(&mut self) {
        // SAFETY: undoes, in reverse, what `open` did (and only that).
        // Unmapping while a copy engine still reads or writes the range
        // would fault it: the owner (`window::Listed`) drops this only
        // after the engines were stopped or flushed, as for CUDA IPC.
        unsafe {
            if self.mapped {
                warn_on("cuMemUnmap", cu::cuMemUnmap(self.ptr, self.size));
            }
            if self.ptr != 0 {
                warn_on(
                    "cuMemAddressFree",
                    cu::cuMemAddressFree(self.ptr, self.size),
                );
            }
            warn_on("cuMemRelease", cu::cuMemRelease(self.handle));
        }
    }
}

#[cfg(test)]
#[path = "vmm_tests.rs"]
mod tests;
