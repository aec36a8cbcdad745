//! A thin, checked layer over the CUDA driver API (cudarc's `sys` level,
//! loaded at run time): nothing CUDA is needed to build, and a machine
//! without a driver gets an error, never a panic.

use std::ffi::{CStr, c_void};
use std::sync::OnceLock;

use cudarc::driver::sys as cu;

use crate::error::CoreError;

/// Turns a driver result into an error naming the call.
pub(crate) fn check(call: &'static str, r: cu::CUresult) -> Result<(), CoreError> {
    if r == cu::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut name: *const std::ffi::c_char = std::ptr::null();
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: both calls only write a pointer to a static string.
    unsafe {
        cu::cuGetErrorName(r, &raw mut name);
        cu::cuGetErrorString(r, &raw mut text);
    }
    let s = |p: *const std::ffi::c_char| {
        if p.is_null() {
            String::from("?")
        } else {
            // SAFETY: the driver returns NUL-terminated static strings.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    Err(CoreError::Cuda {
        call,
        code: r as i32,
        name: s(name),
        text: s(text),
    })
}

/// Whether a CUDA driver with at least one GPU is usable here; the error says
/// why not. Checked once per process.
pub fn available() -> Result<usize, CoreError> {
    static STATE: OnceLock<Result<usize, String>> = OnceLock::new();
    STATE
        .get_or_init(|| {
            // SAFETY: only probes for the library with dlopen.
            if !unsafe { cu::is_culib_present() } {
                return Err("no CUDA driver library (libcuda.so) could be loaded".into());
            }
            // SAFETY: plain driver calls with valid out-pointers.
            unsafe {
                check("cuInit", cu::cuInit(0)).map_err(|e| e.to_string())?;
                let mut n = 0;
                check("cuDeviceGetCount", cu::cuDeviceGetCount(&raw mut n))
                    .map_err(|e| e.to_string())?;
                if n <= 0 {
                    return Err("the CUDA driver reports no GPU".into());
                }
                Ok(n as usize)
            }
        })
        .clone()
        .map_err(|why| CoreError::Unavailable {
            what: "CUDA".into(),
            why,
            available: "CPU ranks".into(),
        })
}

/// One GPU and its primary context.
#[derive(Debug)]
pub struct Device {
    pub ordinal: usize,
    dev: cu::CUdevice,
    ctx: cu::CUcontext,
    /// Compute capability (major, minor).
    pub cc: (i32, i32),
    pub name: String,
    /// The GPU's UUID (a MIG instance's own under MIG), as
    /// `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`: which GPU this is on any host,
    /// whatever `CUDA_VISIBLE_DEVICES` renumbered. `None` if the driver
    /// does not say.
    pub uuid: Option<String>,
    /// Streaming multiprocessors.
    pub sms: u32,
    /// Whether this process's contexts on the GPU go through MPS (the
    /// Multi-Process Service), so that kernels of several processes run
    /// side by side instead of taking turns.
    pub mps: bool,
}

// SAFETY: a CUcontext may be made current on any thread.
unsafe impl Send for Device {}
// SAFETY: as above; Device's methods only read its fields.
unsafe impl Sync for Device {}

impl Device {
    /// Retains the primary context of GPU `ordinal` and makes it current.
    pub fn open(ordinal: usize) -> Result<Self, CoreError> {
        let n = available()?;
        if ordinal >= n {
            return Err(CoreError::Invalid(format!(
                "GPU {ordinal} does not exist (this machine has {n})"
            )));
        }
        let mut dev = 0;
        let (mut major, mut minor, mut sms) = (0, 0, 0);
        let mut name = [0 as std::ffi::c_char; 128];
        // The queries need no context: made first, a failure leaves nothing
        // retained.
        // SAFETY: valid out-pointers; the ordinal was checked.
        unsafe {
            check("cuDeviceGet", cu::cuDeviceGet(&raw mut dev, ordinal as i32))?;
            check(
                "cuDeviceGetAttribute",
                cu::cuDeviceGetAttribute(
                    &raw mut major,
                    cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                    dev,
                ),
            )?;
            check(
                "cuDeviceGetAttribute",
                cu::cuDeviceGetAttribute(
                    &raw mut minor,
                    cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                    dev,
                ),
            )?;
            check(
                "cuDeviceGetAttribute",
                cu::cuDeviceGetAttribute(
                    &raw mut sms,
                    cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                    dev,
                ),
            )?;
            check(
                "cuDeviceGetName",
                cu::cuDeviceGetName(name.as_mut_ptr(), 127, dev),
            )?;
        }
        // SAFETY: cuDeviceGetName wrote a NUL-terminated string (the buffer
        // is zeroed and the driver was given one byte less).
        let name = unsafe { CStr::from_ptr(name.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        let uuid = device_uuid(dev);
        let mut mps = 0;
        // SAFETY: valid out-pointer and device handle. An old driver that
        // does not know the attribute answers with an error: no MPS then.
        let mps = unsafe {
            cu::cuDeviceGetAttribute(
                &raw mut mps,
                cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MPS_ENABLED,
                dev,
            )
        } == cu::CUresult::CUDA_SUCCESS
            && mps != 0;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: valid out-pointer and device handle.
        check("cuDevicePrimaryCtxRetain", unsafe {
            cu::cuDevicePrimaryCtxRetain(&raw mut ctx, dev)
        })?;
        let this = Self {
            ordinal,
            dev,
            ctx,
            cc: (major, minor),
            name,
            uuid,
            sms: sms.max(0) as u32,
            mps,
        };
        // On failure `this` is dropped, which releases the retain.
        this.make_current()?;
        Ok(this)
    }

    /// Makes this GPU's context current on the calling thread.
    pub fn make_current(&self) -> Result<(), CoreError> {
        // SAFETY: the context is retained until drop.
        check("cuCtxSetCurrent", unsafe { cu::cuCtxSetCurrent(self.ctx) })
    }

    /// Whether this GPU can map `other`'s memory (NVLink or PCIe peer access).
    pub fn can_access_peer(&self, other: &Device) -> Result<bool, CoreError> {
        if other.ordinal == self.ordinal {
            return Ok(true);
        }
        let mut ok = 0;
        // SAFETY: valid out-pointer and device handles.
        check("cuDeviceCanAccessPeer", unsafe {
            cu::cuDeviceCanAccessPeer(&raw mut ok, self.dev, other.dev)
        })?;
        Ok(ok != 0)
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: releases the retain taken in `open`.
        unsafe {
            cu::cuDevicePrimaryCtxRelease_v2(self.dev);
        }
    }
}

/// Device memory (cuMemAlloc), zeroed.
#[derive(Debug)]
pub struct DevMem {
    pub ptr: u64,
    pub len: usize,
}

impl DevMem {
    pub fn new(len: usize) -> Result<Self, CoreError> {
        let mut ptr = 0;
        // SAFETY: valid out-pointer; at least one byte is asked for.
        unsafe {
            check("cuMemAlloc", cu::cuMemAlloc_v2(&raw mut ptr, len.max(1)))?;
            check("cuMemsetD8", cu::cuMemsetD8_v2(ptr, 0, len.max(1)))?;
        }
        Ok(Self { ptr, len })
    }

    /// Copies `data` to `off` bytes into this allocation.
    pub fn write<T: Copy>(&self, off: usize, data: &[T]) -> Result<(), CoreError> {
        let n = std::mem::size_of_val(data);
        if off + n > self.len {
            return Err(CoreError::Invalid(format!(
                "write of {n} bytes at {off} exceeds a {}-byte device buffer",
                self.len
            )));
        }
        // SAFETY: the range was checked; `data` is valid for `n` bytes.
        check("cuMemcpyHtoD", unsafe {
            cu::cuMemcpyHtoD_v2(self.ptr + off as u64, data.as_ptr().cast(), n)
        })
    }

    /// Reads `out.len()` values from `off` bytes into this allocation.
    pub fn read<T: Copy>(&self, off: usize, out: &mut [T]) -> Result<(), CoreError> {
        let n = std::mem::size_of_val(out);
        if off + n > self.len {
            return Err(CoreError::Invalid(format!(
                "read of {n} bytes at {off} exceeds a {}-byte device buffer",
                self.len
            )));
        }
        // SAFETY: the range was checked; `out` is valid for `n` bytes.
        check("cuMemcpyDtoH", unsafe {
            cu::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), self.ptr + off as u64, n)
        })
    }

    /// Zeroes `len` bytes at `off`.
    pub fn zero(&self, off: usize, len: usize) -> Result<(), CoreError> {
        if off + len > self.len {
            return Err(CoreError::Invalid("zeroing past a device buffer".into()));
        }
        // SAFETY: the range was checked.
        check("cuMemsetD8", unsafe {
            cu::cuMemsetD8_v2(self.ptr + off as u64, 0, len)
        })
    }

    /// The IPC handle other processes open this allocation with.
    pub fn ipc_handle(&self) -> Result<[u8; 64], CoreError> {
        // SAFETY: an all-zero handle is a valid out-value.
        let mut h: cu::CUipcMemHandle = unsafe { std::mem::zeroed() };
        // SAFETY: `ptr` is the base of a cuMemAlloc allocation.
        check("cuIpcGetMemHandle", unsafe {
            cu::cuIpcGetMemHandle(&raw mut h, self.ptr)
        })?;
        Ok(h.reserved.map(|c| c as u8))
    }
}

impl Drop for DevMem {
    fn drop(&mut self) {
        // SAFETY: frees what `new` allocated.
        unsafe {
            cu::cuMemFree_v2(self.ptr);
        }
    }
}

/// Another process's allocation mapped here through CUDA IPC.
#[derive(Debug)]
pub struct IpcMem {
    pub ptr: u64,
}

impl IpcMem {
    pub fn open(handle: &[u8; 64]) -> Result<Self, CoreError> {
        // SAFETY: an all-zero handle is a valid value; it is overwritten.
        let mut h: cu::CUipcMemHandle = unsafe { std::mem::zeroed() };
        h.reserved = handle.map(|b| b as std::ffi::c_char);
        let mut ptr = 0;
        // SAFETY: valid out-pointer; the driver validates the handle.
        check("cuIpcOpenMemHandle", unsafe {
            cu::cuIpcOpenMemHandle_v2(
                &raw mut ptr,
                h,
                cu::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        })?;
        Ok(Self { ptr })
    }
}

impl Drop for IpcMem {
    fn drop(&mut self) {
        // SAFETY: closes what `open` mapped.
        unsafe {
            cu::cuIpcCloseMemHandle(self.ptr);
        }
    }
}

/// Pinned host memory mapped into the GPU's address space (portable, not
/// write-combined: the CPU polls it, and CPU reads of write-combined memory
/// are very slow). Zeroed.
#[derive(Debug)]
pub struct HostMem {
    pub host: *mut u8,
    pub dev: u64,
    pub len: usize,
}

// SAFETY: plain memory; users synchronise through atomics.
unsafe impl Send for HostMem {}
// SAFETY: as above.
unsafe impl Sync for HostMem {}

impl HostMem {
    pub fn new(len: usize) -> Result<Self, CoreError> {
        let mut p: *mut c_void = std::ptr::null_mut();
        let mut dev = 0;
        // SAFETY: valid out-pointers; the allocation is zeroed before use.
        unsafe {
            check(
                "cuMemHostAlloc",
                cu::cuMemHostAlloc(
                    &raw mut p,
                    len.max(64),
                    cu::CU_MEMHOSTALLOC_DEVICEMAP | cu::CU_MEMHOSTALLOC_PORTABLE,
                ),
            )?;
            std::ptr::write_bytes(p.cast::<u8>(), 0, len.max(64));
            check(
                "cuMemHostGetDevicePointer",
                cu::cuMemHostGetDevicePointer_v2(&raw mut dev, p, 0),
            )?;
        }
        Ok(Self {
            host: p.cast(),
            dev,
            len,
        })
    }
}

impl Drop for HostMem {
    fn drop(&mut self) {
        // SAFETY: frees what `new` allocated.
        unsafe {
            cu::cuMemFreeHost(self.host.cast());
        }
    }
}

/// A non-blocking stream.
#[derive(Debug)]
pub struct Stream(pub(crate) cu::CUstream);

// SAFETY: streams may be used from any thread with the context current.
unsafe impl Send for Stream {}
// SAFETY: as above.
unsafe impl Sync for Stream {}

impl Stream {
    pub fn new() -> Result<Self, CoreError> {
        let mut s = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        check("cuStreamCreate", unsafe {
            cu::cuStreamCreate(
                &raw mut s,
                cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
            )
        })?;
        Ok(Self(s))
    }

    /// Whether all work queued so far has finished.
    pub fn idle(&self) -> Result<bool, CoreError> {
        // SAFETY: the stream is alive.
        let r = unsafe { cu::cuStreamQuery(self.0) };
        if r == cu::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check("cuStreamQuery", r).map(|()| true)
    }

    pub fn sync(&self) -> Result<(), CoreError> {
        // SAFETY: the stream is alive.
        check("cuStreamSynchronize", unsafe {
            cu::cuStreamSynchronize(self.0)
        })
    }

    /// Queues a copy of `n` bytes (any mix of device, mapped-host and
    /// IPC-mapped addresses: unified addressing resolves them).
    pub fn copy(&self, dst: u64, src: u64, n: usize) -> Result<(), CoreError> {
        // SAFETY: the caller's addresses were bounds-checked against their
        // windows; the driver faults the stream, not this process, on error.
        check("cuMemcpyAsync", unsafe {
            cu::cuMemcpyAsync(dst, src, n, self.0)
        })
    }

    /// Queues an 8-byte store of `v` at `addr` after earlier work.
    pub fn write_u64(&self, addr: u64, v: u64) -> Result<(), CoreError> {
        // SAFETY: as for `copy`; `addr` is 8-byte aligned device memory.
        check("cuStreamWriteValue64", unsafe {
            cu::cuStreamWriteValue64_v2(self.0, addr, v, 0)
        })
    }

    /// Queues the 8-byte stores `(addr, v)` after earlier work and in their
    /// order, in one driver call (`cuStreamBatchMemOp`): each has the
    /// memory barrier of `cuStreamWriteValue64`, so what the stream wrote
    /// before a store is visible before it. At most [`MAX_WRITES`] at once.
    pub fn write_many(&self, writes: &[(u64, u64)]) -> Result<(), CoreError> {
        if writes.len() > MAX_WRITES {
            return Err(CoreError::Invalid(format!(
                "write_many: {} stores, at most {MAX_WRITES} in one call",
                writes.len()
            )));
        }
        let mut ops: Vec<cu::CUstreamBatchMemOpParams> = writes
            .iter()
            .map(|&(addr, v)| {
                // SAFETY: a plain C union, all zero is valid; the write-value
                // member is filled in whole below.
                let mut op: cu::CUstreamBatchMemOpParams = unsafe { std::mem::zeroed() };
                op.writeValue.operation =
                    cu::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WRITE_VALUE_64;
                op.writeValue.address = addr;
                op.writeValue.__bindgen_anon_1.value64 = v;
                op.writeValue.flags = 0;
                op
            })
            .collect();
        // SAFETY: `ops` holds `writes.len()` (< 256) initialised write-value
        // operations on 8-byte aligned device addresses, as for `write_u64`.
        check("cuStreamBatchMemOp", unsafe {
            cu::cuStreamBatchMemOp_v2(self.0, ops.len() as u32, ops.as_mut_ptr(), 0)
        })
    }

    /// Queues the copies `(dst[i], src[i], len[i])` after earlier work, in
    /// one driver call (`cuMemcpyBatchAsync`, CUDA 12.8 and later) where
    /// the driver has it, else one call each. The copies of a batch may run
    /// in any order among themselves: the caller keeps overlapping ones in
    /// different batches.
    pub fn copy_many(
        &self,
        dst: &mut [u64],
        src: &mut [u64],
        len: &mut [usize],
    ) -> Result<(), CoreError> {
        let n = dst.len();
        if src.len() != n || len.len() != n {
            return Err(CoreError::Invalid(
                "copy_many: lists of different lengths".into(),
            ));
        }
        let Some(batch) = batch_copy() else {
            for i in 0..n {
                self.copy(dst[i], src[i], len[i])?;
            }
            return Ok(());
        };
        // SAFETY: a plain C struct, all zero is valid (no location hints).
        let mut attr: cu::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
        attr.srcAccessOrder = cu::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
        let mut first = [0usize];
        // SAFETY: the three lists hold `n` entries each, the attribute
        // applies from index 0; addresses are checked as for `copy`.
        check("cuMemcpyBatchAsync", unsafe {
            batch(
                dst.as_mut_ptr(),
                src.as_mut_ptr(),
                len.as_mut_ptr(),
                n,
                &raw mut attr,
                first.as_mut_ptr(),
                1,
                self.0,
            )
        })
    }
}

type BatchCopy = unsafe extern "C" fn(
    *mut cu::CUdeviceptr,
    *mut cu::CUdeviceptr,
    *mut usize,
    usize,
    *mut cu::CUmemcpyAttributes,
    *mut usize,
    usize,
    cu::CUstream,
) -> cu::CUresult;

/// The most stores [`Stream::write_many`] takes in one call (the driver's
/// limit is fewer than 256).
pub const MAX_WRITES: usize = 255;

/// The driver's entry point `name` in its CUDA 13.0 form, if it has one,
/// looked up with `cuGetProcAddress` (cudarc's loader panics on a missing
/// symbol).
fn proc_address(name: &std::ffi::CStr) -> Option<*mut c_void> {
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: zero is a valid query result to be overwritten.
    let mut status: cu::CUdriverProcAddressQueryResult = unsafe { std::mem::zeroed() };
    // SAFETY: valid symbol name and out-pointers.
    let r =
        unsafe { cu::cuGetProcAddress_v2(name.as_ptr(), &raw mut p, 13000, 0, &raw mut status) };
    (r == cu::CUresult::CUDA_SUCCESS && !p.is_null()).then_some(p)
}

/// The UUID of `dev` from the driver's `cuDeviceGetUuid` (MIG-aware in its
/// 13.0 form); `None` if the driver lacks it or fails.
fn device_uuid(dev: cu::CUdevice) -> Option<String> {
    type GetUuid = unsafe extern "C" fn(*mut cu::CUuuid, cu::CUdevice) -> cu::CUresult;
    let p = proc_address(c"cuDeviceGetUuid")?;
    // SAFETY: for CUDA version 13000 the driver returns the 13.0 entry
    // point, whose signature `GetUuid` is.
    let get = unsafe { std::mem::transmute::<*mut c_void, GetUuid>(p) };
    // SAFETY: a plain C struct of 16 bytes; all zero is valid.
    let mut id: cu::CUuuid = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer and device handle.
    if unsafe { get(&raw mut id, dev) } != cu::CUresult::CUDA_SUCCESS {
        return None;
    }
    Some(format_uuid(id.bytes.map(|b| b as u8)))
}

/// `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as `nvidia-smi -L` shows a UUID
/// (without its `GPU-` or `MIG-` prefix).
fn format_uuid(b: [u8; 16]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(36);
    for (i, x) in b.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            s.push('-');
        }
        let _ = write!(s, "{x:02x}");
    }
    s
}

/// The driver's `cuMemcpyBatchAsync` in its CUDA 13.0 form, if it has one:
/// a 12.8 or 12.9 driver would hand its 12.8 form, whose arguments differ
/// (a failure index before the stream), so it must be 13.0 or later.
fn batch_copy() -> Option<BatchCopy> {
    static F: OnceLock<Option<BatchCopy>> = OnceLock::new();
    *F.get_or_init(|| {
        let mut v = 0;
        // SAFETY: valid out-pointer.
        let r = unsafe { cu::cuDriverGetVersion(&raw mut v) };
        if r != cu::CUresult::CUDA_SUCCESS || v < 13000 {
            return None;
        }
        proc_address(c"cuMemcpyBatchAsync")
            // SAFETY: for CUDA version 13000 the driver returns the 13.0
            // entry point, whose signature `BatchCopy` is.
            .map(|p| unsafe { std::mem::transmute::<*mut c_void, BatchCopy>(p) })
    })
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: destroys what `new` created.
        unsafe {
            cu::cuStreamDestroy_v2(self.0);
        }
    }
}

/// A loaded module (cubin) and lookups of its kernels.
#[derive(Debug)]
pub struct Module(cu::CUmodule);

// SAFETY: modules may be used from any thread with the context current.
unsafe impl Send for Module {}
// SAFETY: as above.
unsafe impl Sync for Module {}

impl Module {
    pub fn load(image: &[u8]) -> Result<Self, CoreError> {
        let mut m = std::ptr::null_mut();
        // SAFETY: `image` is a cubin produced by NVRTC or nvcc.
        check("cuModuleLoadData", unsafe {
            cu::cuModuleLoadData(&raw mut m, image.as_ptr().cast())
        })?;
        Ok(Self(m))
    }

    pub fn function(&self, name: &str) -> Result<Function, CoreError> {
        let c = std::ffi::CString::new(name)
            .map_err(|_| CoreError::Invalid(format!("kernel name {name:?} has a NUL")))?;
        let mut f = std::ptr::null_mut();
        // SAFETY: valid out-pointer and NUL-terminated name.
        check("cuModuleGetFunction", unsafe {
            cu::cuModuleGetFunction(&raw mut f, self.0, c.as_ptr())
        })
        .map_err(|e| CoreError::Invalid(format!("kernel {name}: {e}")))?;
        Ok(Function(f))
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        // SAFETY: unloads what `load` loaded.
        unsafe {
            cu::cuModuleUnload(self.0);
        }
    }
}

/// A kernel.
#[derive(Debug, Clone, Copy)]
pub struct Function(cu::CUfunction);

// SAFETY: function handles may be launched from any thread.
unsafe impl Send for Function {}
// SAFETY: as above.
unsafe impl Sync for Function {}

impl Function {
    /// How many blocks of `threads` threads (no dynamic shared memory) one
    /// SM holds at once.
    pub fn blocks_per_sm(&self, threads: u32) -> Result<u32, CoreError> {
        let mut n = 0;
        // SAFETY: valid out-pointer and function handle.
        check("cuOccupancyMaxActiveBlocksPerMultiprocessor", unsafe {
            cu::cuOccupancyMaxActiveBlocksPerMultiprocessor(&raw mut n, self.0, threads as i32, 0)
        })?;
        Ok(n.max(0) as u32)
    }

    /// Launches with one pointer per kernel parameter.
    ///
    /// # Safety
    /// `params` must match the kernel's parameter list in number, order and
    /// size, and stay valid until this call returns.
    pub unsafe fn launch(
        &self,
        stream: &Stream,
        grid: u32,
        block: u32,
        params: &mut [*mut c_void],
    ) -> Result<(), CoreError> {
        // SAFETY: forwarded from the caller.
        check("cuLaunchKernel", unsafe {
            cu::cuLaunchKernel(
                self.0,
                grid,
                1,
                1,
                block,
                1,
                1,
                0,
                stream.0,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_uuid_reads_as_nvidia_smi_shows_it() {
        let b = [
            0x8f, 0x1a, 0x02, 0xc3, 0x4d, 0x5e, 0x6f, 0x70, 0x81, 0x92, 0xa3, 0xb4, 0xc5, 0xd6,
            0xe7, 0xf8,
        ];
        assert_eq!(format_uuid(b), "8f1a02c3-4d5e-6f70-8192-a3b4c5d6e7f8");
        assert_eq!(format_uuid([0; 16]).len(), 36);
    }
}
