//! A thin, checked layer over the CUDA driver API (cudarc's `sys` level,
//! loaded at run time): nothing CUDA is needed to build, and a machine
//! without a driver gets an error, never a panic.

use std::ffi::{CStr, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use cudarc::driver::sys as cu;

use crate::error::{CudaError, DriverError};
use crate::pool::{IDLE_LIMIT, Pool, size_class};

/// Turns a driver result into an error naming the call.
pub(crate) fn check(call: &'static str, r: cu::CUresult) -> Result<(), DriverError> {
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
    Err(DriverError {
        call,
        code: r as i32,
        name: s(name),
        text: s(text),
    })
}

/// The end of `bytes` bytes at `offset` if they lie within `size` bytes;
/// else the error for `op` on `what`.
pub(crate) fn span(
    op: &'static str,
    what: &'static str,
    offset: u64,
    bytes: u64,
    size: u64,
) -> Result<u64, CudaError> {
    offset
        .checked_add(bytes)
        .filter(|&end| end <= size)
        .ok_or(CudaError::OutOfBounds {
            op,
            what,
            offset,
            bytes,
            size,
        })
}

/// Whether a CUDA driver with at least one GPU is usable here; the error says
/// why not. Checked once per process.
pub fn available() -> Result<usize, CudaError> {
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
        .map_err(|why| CudaError::Unavailable { why })
}

/// One GPU and its primary context.
#[derive(Debug)]
pub struct Device {
    ordinal: usize,
    dev: cu::CUdevice,
    ctx: cu::CUcontext,
    cc: (i32, i32),
    name: String,
    uuid: Option<String>,
    sms: u32,
    mps: bool,
    /// Freed windows' allocations kept for later windows
    /// ([`Device::window_mem`]), freed before the context is released.
    pool: Arc<Mutex<Pool<DevMem>>>,
}

// SAFETY: a CUcontext may be made current on any thread.
unsafe impl Send for Device {}
// SAFETY: as above; Device's methods only read its fields.
unsafe impl Sync for Device {}

impl Device {
    /// Retains the primary context of GPU `ordinal` and makes it current.
    pub fn open(ordinal: usize) -> Result<Self, CudaError> {
        let n = available()?;
        if ordinal >= n {
            return Err(CudaError::NoSuchDevice { ordinal, count: n });
        }
        let open = |source| CudaError::Open { ordinal, source };
        let mut dev = 0;
        let (mut major, mut minor, mut sms) = (0, 0, 0);
        let mut name = [0 as std::ffi::c_char; 128];
        // The queries need no context: made first, a failure leaves nothing
        // retained.
        // SAFETY: valid out-pointers; the ordinal was checked.
        unsafe {
            check("cuDeviceGet", cu::cuDeviceGet(&raw mut dev, ordinal as i32)).map_err(open)?;
            check(
                "cuDeviceGetAttribute",
                cu::cuDeviceGetAttribute(
                    &raw mut major,
                    cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                    dev,
                ),
            )
            .map_err(open)?;
            check(
                "cuDeviceGetAttribute",
                cu::cuDeviceGetAttribute(
                    &raw mut minor,
                    cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                    dev,
                ),
            )
            .map_err(open)?;
            check(
                "cuDeviceGetAttribute",
                cu::cuDeviceGetAttribute(
                    &raw mut sms,
                    cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                    dev,
                ),
            )
            .map_err(open)?;
            check(
                "cuDeviceGetName",
                cu::cuDeviceGetName(name.as_mut_ptr(), 127, dev),
            )
            .map_err(open)?;
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
        })
        .map_err(open)?;
        let this = Self {
            ordinal,
            dev,
            ctx,
            cc: (major, minor),
            name,
            uuid,
            sms: sms.max(0) as u32,
            mps,
            pool: Arc::new(Mutex::new(Pool::new(IDLE_LIMIT))),
        };
        // On failure `this` is dropped, which releases the retain.
        this.make_current()?;
        Ok(this)
    }

    /// Makes this GPU's context current on the calling thread.
    pub fn make_current(&self) -> Result<(), CudaError> {
        // SAFETY: the context is retained until drop.
        Ok(check("cuCtxSetCurrent", unsafe {
            cu::cuCtxSetCurrent(self.ctx)
        })?)
    }

    /// The GPU's primary context (`cuDevicePrimaryCtxRetain`), in which gin
    /// allocates, creates its streams and loads its modules. cudarc's
    /// `CudaContext::new(ordinal)` retains the same primary context, so a
    /// cudarc user's streams, slices and modules share it with gin.
    pub fn raw_context(&self) -> cu::CUcontext {
        self.ctx
    }

    /// The GPU's ordinal among those the driver shows this process (after
    /// `CUDA_VISIBLE_DEVICES`).
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Compute capability (major, minor).
    pub fn cc(&self) -> (i32, i32) {
        self.cc
    }

    /// The GPU's name, as `NVIDIA H200`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The GPU's UUID (a MIG instance's own under MIG), as
    /// `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`: which GPU this is on any host,
    /// whatever `CUDA_VISIBLE_DEVICES` renumbered. `None` if the driver
    /// does not say.
    pub fn uuid(&self) -> Option<&str> {
        self.uuid.as_deref()
    }

    /// Streaming multiprocessors.
    pub fn sms(&self) -> u32 {
        self.sms
    }

    /// Whether this process's contexts on the GPU go through MPS (the
    /// Multi-Process Service), so that kernels of several processes run
    /// side by side instead of taking turns.
    pub fn mps(&self) -> bool {
        self.mps
    }

    /// `bytes` of zeroed device memory for a window gin allocates, from
    /// this device's pool: an idle allocation of the size class
    /// ([`crate::pool`]: `bytes` rounded up to a multiple of 2 MiB) if one
    /// was returned, else a fresh one (after freeing the idle ones, where
    /// the driver is out of memory). Only `bytes` are exposed; the whole
    /// allocation is zeroed, as a fresh one is. Dropping the result
    /// returns the allocation to the pool (freed there beyond its idle
    /// limit, or once the device has gone).
    pub(crate) fn window_mem(&self, bytes: usize) -> Result<PoolMem, CudaError> {
        self.make_current()?;
        // Past the largest class: a class of its own, which the driver
        // refuses and the pool would never keep.
        let class = size_class(bytes).unwrap_or(bytes);
        // Blocks their last holders let go of on threads that must not wait
        // for the device are freed here, on an allocating thread.
        // (Outside the pool's lock: a holder letting go meanwhile must not
        // wait for these frees.)
        let doomed = lock(&self.pool).reap();
        drop(doomed);
        let reused = lock(&self.pool).take(class);
        let fresh = reused.is_none();
        let block = match reused {
            Some(b) => {
                // On failure the block is dropped: freed, not returned.
                b.zero_wait(0, class)?;
                b
            }
            None => match DevMem::new(class) {
                Ok(b) => b,
                Err(e) => {
                    let idle = lock(&self.pool).drain();
                    if idle.is_empty() {
                        return Err(e);
                    }
                    drop(idle);
                    DevMem::new(class)?
                }
            },
        };
        if fresh {
            // A fresh allocation's zeroing (DevMem::new) is asynchronous
            // too: done before any peer learns of the memory.
            wait_legacy_stream()?;
        }
        Ok(PoolMem {
            block: Some(block),
            class,
            len: bytes,
            pool: self.pool.clone(),
            leak: AtomicBool::new(false),
        })
    }

    /// Bytes of freed windows' memory this device keeps for later windows.
    pub fn pooled_bytes(&self) -> usize {
        lock(&self.pool).idle_bytes()
    }

    /// Whether this GPU can map `other`'s memory (NVLink or PCIe peer access).
    pub fn can_access_peer(&self, other: &Device) -> Result<bool, CudaError> {
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
        // The pool's idle memory goes back to the driver while the context
        // is still retained; a block still in use when the device goes is
        // freed when it is returned. (Best effort: on failure the frees
        // below report nothing, as any drop's.)
        let _ = self.make_current();
        let all = lock(&self.pool).close();
        drop(all);
        // SAFETY: releases the retain taken in `open`.
        unsafe {
            cu::cuDevicePrimaryCtxRelease_v2(self.dev);
        }
    }
}

/// Device memory (cuMemAlloc), zeroed, freed on drop. Its address is
/// readable ([`DevMem::ptr`]) for kernels and descriptors; the safe
/// accessors check every range against the allocation.
#[derive(Debug)]
pub struct DevMem {
    ptr: u64,
    len: usize,
    /// Whether drop frees it (`false`: memory the user lent,
    /// [`DevMem::from_raw_parts`]).
    owned: bool,
}

/// Waits for the current context's legacy stream, where `cuMemsetD8` of
/// device memory is ordered.
fn wait_legacy_stream() -> Result<(), CudaError> {
    // SAFETY: the legacy stream of the current context always exists.
    Ok(check("cuStreamSynchronize", unsafe {
        cu::cuStreamSynchronize(std::ptr::null_mut())
    })?)
}

impl DevMem {
    /// Allocates `len` bytes (at least one is asked of the driver) and
    /// zeroes them.
    pub fn new(len: usize) -> Result<Self, CudaError> {
        // Without a driver, an error rather than cudarc's loader panicking.
        available()?;
        let mut ptr = 0;
        let alloc = |source| CudaError::Alloc {
            what: "device memory",
            bytes: len,
            source,
        };
        // SAFETY: valid out-pointer; at least one byte is asked for.
        check("cuMemAlloc", unsafe {
            cu::cuMemAlloc_v2(&raw mut ptr, len.max(1))
        })
        .map_err(alloc)?;
        // From here on, a failure frees the allocation (drop).
        let this = Self {
            ptr,
            len,
            owned: true,
        };
        // SAFETY: the allocation holds `len.max(1)` bytes.
        check("cuMemsetD8", unsafe {
            cu::cuMemsetD8_v2(ptr, 0, len.max(1))
        })
        .map_err(alloc)?;
        Ok(this)
    }

    /// Device memory that something else allocated and frees (a cudarc
    /// `CudaSlice`, another allocator's buffer): the same checked accessors,
    /// but drop leaves the memory alone.
    ///
    /// # Safety
    /// `ptr` must be the start of `len` bytes of device memory of the
    /// current context's GPU (or memory it reaches, such as a peer's
    /// allocation with peer access enabled) that stay allocated, and are
    /// not freed or reused, until the returned value has dropped.
    pub unsafe fn from_raw_parts(ptr: u64, len: usize) -> Self {
        Self {
            ptr,
            len,
            owned: false,
        }
    }

    /// Whether drop frees the memory (`false` for
    /// [`DevMem::from_raw_parts`]).
    pub fn is_owned(&self) -> bool {
        self.owned
    }

    /// The allocation's device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Its size in bytes, as asked for.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it was asked for zero bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address `off` bytes in, where `bytes` bytes fit from
    /// there on; `op` names the access in the error.
    fn at(&self, op: &'static str, off: usize, bytes: usize) -> Result<u64, CudaError> {
        span(
            op,
            "device buffer",
            off as u64,
            bytes as u64,
            self.len as u64,
        )?;
        Ok(self.ptr + off as u64)
    }

    /// Copies `data` to `off` bytes into this allocation; the bytes are in
    /// device memory when it returns, for work on any stream.
    ///
    /// `cuMemcpyHtoD` from pageable memory returns once the source was
    /// staged for DMA, not once the DMA landed (CUDA's "API
    /// synchronization behavior"), and gin's streams are non-blocking, so
    /// they do not wait for the legacy stream that copy runs on: a kernel
    /// launched on one right after could read the tail of a large copy
    /// before it lands. Waiting for the legacy stream closes that (so, as
    /// with [`DevMem::zero_wait`], not while a stream capture is open).
    pub fn write<T: Copy>(&self, off: usize, data: &[T]) -> Result<(), CudaError> {
        let n = std::mem::size_of_val(data);
        let dst = self.at("write", off, n)?;
        // SAFETY: the range was checked; `data` is valid for `n` bytes.
        check("cuMemcpyHtoD", unsafe {
            cu::cuMemcpyHtoD_v2(dst, data.as_ptr().cast(), n)
        })?;
        wait_legacy_stream()
    }

    /// Reads `out.len()` values from `off` bytes into this allocation
    /// (synchronously).
    pub fn read<T: Copy>(&self, off: usize, out: &mut [T]) -> Result<(), CudaError> {
        let n = std::mem::size_of_val(out);
        let src = self.at("read", off, n)?;
        // SAFETY: the range was checked; `out` is valid for `n` bytes. `T`
        // is `Copy` plain data the caller chose for the bytes.
        Ok(check("cuMemcpyDtoH", unsafe {
            cu::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), src, n)
        })?)
    }

    /// Zeroes `len` bytes at `off` with `cuMemsetD8`: for device memory
    /// asynchronous to the host and ordered on the legacy stream only (use
    /// [`DevMem::zero_wait`] where a peer may write right afterwards).
    pub fn zero(&self, off: usize, len: usize) -> Result<(), CudaError> {
        let dst = self.at("zeroing", off, len)?;
        // SAFETY: the range was checked.
        Ok(check("cuMemsetD8", unsafe {
            cu::cuMemsetD8_v2(dst, 0, len)
        })?)
    }

    /// Zeroes as [`DevMem::zero`] does and waits for the legacy stream, so
    /// the bytes are zero before a peer (through IPC) or gin's non-blocking
    /// streams write them. Not for use while a capture is open.
    pub fn zero_wait(&self, off: usize, len: usize) -> Result<(), CudaError> {
        self.zero(off, len)?;
        wait_legacy_stream()
    }

    /// The IPC handle other processes open this allocation with.
    pub fn ipc_handle(&self) -> Result<[u8; 64], CudaError> {
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
        if !self.owned {
            return;
        }
        // SAFETY: frees what `new` allocated.
        unsafe {
            cu::cuMemFree_v2(self.ptr);
        }
    }
}

/// The pool's lock; a panic while it was held leaves the pool consistent
/// (each operation completes before anything can panic), so poisoning is
/// ignored.
fn lock(pool: &Mutex<Pool<DevMem>>) -> MutexGuard<'_, Pool<DevMem>> {
    pool.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A window's allocation from its device's pool ([`Device::window_mem`]):
/// `len` bytes exposed of a `class`-byte allocation, returned to the pool
/// on drop (and the blocks the pool lets go freed, outside its lock).
#[derive(Debug)]
pub(crate) struct PoolMem {
    /// `Some` until drop.
    block: Option<DevMem>,
    class: usize,
    len: usize,
    pool: Arc<Mutex<Pool<DevMem>>>,
    /// Quarantined ([`PoolMem::quarantine`]): leaked on drop.
    leak: AtomicBool,
}

impl PoolMem {
    /// The allocation's device address.
    pub(crate) fn ptr(&self) -> u64 {
        self.block.as_ref().map_or(0, DevMem::ptr)
    }

    /// The `len` bytes asked for, as device memory that drop leaves alone
    /// (this block frees or returns the allocation).
    pub(crate) fn view(&self) -> DevMem {
        DevMem {
            ptr: self.ptr(),
            len: self.len,
            owned: false,
        }
    }

    /// Returns the allocation to the pool now, freeing at once what the
    /// pool lets go of: for its owner's thread (which may wait for the
    /// device), when no transport holds the allocation any more.
    pub(crate) fn release_now(mut self) {
        if let Some(b) = self.block.take() {
            if self.leak.load(Ordering::Acquire) {
                std::mem::forget(b);
                return;
            }
            let free = lock(&self.pool).give(self.class, b);
            drop(free);
        }
    }

    /// A peer may still write the allocation (a transport quarantined
    /// it): whichever holder drops it last leaks it, never returning it to
    /// the pool for another window.
    pub(crate) fn quarantine(&self) {
        self.leak.store(true, Ordering::Release);
    }

    /// The allocation's IPC handle.
    pub(crate) fn ipc_handle(&self) -> Result<[u8; 64], CudaError> {
        match &self.block {
            Some(b) => b.ipc_handle(),
            None => Ok([0; 64]),
        }
    }
}

impl Drop for PoolMem {
    fn drop(&mut self) {
        if let Some(b) = self.block.take() {
            if self.leak.load(Ordering::Acquire) {
                std::mem::forget(b);
                return;
            }
            // Not freed here while the device lives: the last holder may be
            // a thread a running kernel waits on (see `Pool::give_later`).
            let mut pool = lock(&self.pool);
            pool.give_later(self.class, b);
            if pool.closed() {
                // The device has gone: nothing runs on it any more.
                let free = pool.reap();
                drop(pool);
                drop(free);
            }
        }
    }
}

/// Another process's allocation mapped here through CUDA IPC, unmapped on
/// drop.
#[derive(Debug)]
pub struct IpcMem {
    ptr: u64,
}

impl IpcMem {
    /// Maps the allocation `handle` ([`DevMem::ipc_handle`]) names.
    pub fn open(handle: &[u8; 64]) -> Result<Self, CudaError> {
        available()?;
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

    /// The mapping's device address in this process.
    pub fn ptr(&self) -> u64 {
        self.ptr
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
/// are very slow). Zeroed, freed on drop.
///
/// The GPU may write it at any time, so the host reaches it through
/// [`HostMem::atomic_u64`] (checked) or through [`HostMem::host_ptr`] in
/// `unsafe` code that reads with atomics.
#[derive(Debug)]
pub struct HostMem {
    host: *mut u8,
    dev: u64,
    len: usize,
}

// SAFETY: plain memory; users synchronise through atomics.
unsafe impl Send for HostMem {}
// SAFETY: as above.
unsafe impl Sync for HostMem {}

impl HostMem {
    /// Allocates `len` bytes (at least 64 are asked of the driver), zeroed
    /// and mapped for the current context's GPU.
    pub fn new(len: usize) -> Result<Self, CudaError> {
        available()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        let mut dev = 0;
        let alloc = |source| CudaError::Alloc {
            what: "pinned host memory",
            bytes: len,
            source,
        };
        // SAFETY: valid out-pointer.
        check("cuMemHostAlloc", unsafe {
            cu::cuMemHostAlloc(
                &raw mut p,
                len.max(64),
                cu::CU_MEMHOSTALLOC_DEVICEMAP | cu::CU_MEMHOSTALLOC_PORTABLE,
            )
        })
        .map_err(alloc)?;
        // SAFETY: the allocation holds `len.max(64)` bytes; nothing else
        // uses it yet.
        unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0, len.max(64)) };
        // From here on, a failure frees the allocation (drop).
        let mut this = Self {
            host: p.cast(),
            dev: 0,
            len,
        };
        // SAFETY: valid out-pointer; `p` is a mapped pinned allocation.
        check("cuMemHostGetDevicePointer", unsafe {
            cu::cuMemHostGetDevicePointer_v2(&raw mut dev, p, 0)
        })
        .map_err(alloc)?;
        this.dev = dev;
        Ok(this)
    }

    /// The host address of the allocation. Reading or writing through it
    /// is `unsafe`: stay within [`HostMem::len`] bytes, and use atomics
    /// where the GPU writes concurrently.
    pub fn host_ptr(&self) -> *mut u8 {
        self.host
    }

    /// The allocation's device address (what kernels use).
    pub fn dev(&self) -> u64 {
        self.dev
    }

    /// Its size in bytes, as asked for.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it was asked for zero bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The 8-byte word at `off`, which both the host and the GPU may access
    /// (the GPU through `dev() + off`).
    pub fn atomic_u64(&self, off: usize) -> Result<&AtomicU64, CudaError> {
        span(
            "atomic access",
            "pinned host buffer",
            off as u64,
            8,
            self.len as u64,
        )?;
        if !off.is_multiple_of(8) {
            return Err(CudaError::Misaligned {
                offset: off,
                size: self.len,
            });
        }
        // SAFETY: inside the allocation (checked) and 8-aligned (the
        // allocation is page-aligned and `off` a multiple of 8); it lives
        // as long as `self`, and every host access goes through atomics.
        Ok(unsafe { &*self.host.add(off).cast::<AtomicU64>() })
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

/// The calling thread's stream-capture mode set to relaxed, until dropped
/// (then the mode it had before comes back).
///
/// While any thread of the process captures a stream in global mode, the
/// driver refuses "potentially unsafe" calls (`cuStreamSynchronize`,
/// synchronous copies, ...) on every other thread whose own mode is global
/// (every thread's mode until it sets another), with
/// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`, and invalidates the capture.
/// gin's engine threads and the TCP transport's staging of a peer's put
/// into GPU memory make such calls at any moment, unrelated to the user's
/// capture, so they make them in relaxed mode, as NCCL's proxy threads do;
/// a user's own thread is left in its mode. The guard is not `Send`: it
/// restores the mode of the thread that made it.
#[derive(Debug)]
#[must_use = "the mode is restored when the guard drops"]
pub struct RelaxedCapture(cu::CUstreamCaptureMode, std::marker::PhantomData<*const ()>);

impl RelaxedCapture {
    /// Sets relaxed mode on this thread.
    ///
    /// # Errors
    /// The driver's (or no driver).
    pub fn enter() -> Result<Self, CudaError> {
        available()?;
        let mut mode = cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: valid in/out pointer; the call touches only this thread's
        // capture mode.
        check("cuThreadExchangeStreamCaptureMode", unsafe {
            cu::cuThreadExchangeStreamCaptureMode(&raw mut mode)
        })?;
        Ok(Self(mode, std::marker::PhantomData))
    }

    /// Sets relaxed mode on this thread for good: for a thread gin owns
    /// (an engine's), which makes no capture of its own.
    ///
    /// # Errors
    /// As [`RelaxedCapture::enter`].
    pub fn for_this_thread() -> Result<(), CudaError> {
        std::mem::forget(Self::enter()?);
        Ok(())
    }
}

impl Drop for RelaxedCapture {
    fn drop(&mut self) {
        let mut mode = self.0;
        // SAFETY: as in `enter`; a failure leaves the thread relaxed, which
        // only allows more.
        let _ = unsafe { cu::cuThreadExchangeStreamCaptureMode(&raw mut mode) };
    }
}

/// A non-blocking stream, destroyed on drop.
///
/// Queueing work on raw addresses is `unsafe` ([`Stream::copy`],
/// [`Stream::write_u64`], [`Stream::write_many`], [`Stream::copy_many`]):
/// the stream executes later, on whatever the addresses name then.
#[derive(Debug)]
pub struct Stream(pub(crate) cu::CUstream);

// SAFETY: streams may be used from any thread with the context current.
unsafe impl Send for Stream {}
// SAFETY: as above.
unsafe impl Sync for Stream {}

impl Stream {
    /// Creates a non-blocking stream in the current context.
    pub fn new() -> Result<Self, CudaError> {
        available()?;
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

    /// The raw `CUstream` (for another CUDA library; queueing work on it
    /// there is as `unsafe` as here).
    pub fn raw(&self) -> cu::CUstream {
        self.0
    }

    /// Whether all work queued so far has finished.
    pub fn idle(&self) -> Result<bool, CudaError> {
        // SAFETY: the stream is alive.
        let r = unsafe { cu::cuStreamQuery(self.0) };
        if r == cu::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check("cuStreamQuery", r).map(|()| true).map_err(Into::into)
    }

    /// Waits until all work queued so far has finished.
    pub fn sync(&self) -> Result<(), CudaError> {
        // SAFETY: the stream is alive.
        Ok(check("cuStreamSynchronize", unsafe {
            cu::cuStreamSynchronize(self.0)
        })?)
    }

    /// Queues a copy of `n` bytes (any mix of device, mapped-host and
    /// IPC-mapped addresses: unified addressing resolves them).
    ///
    /// # Safety
    /// `src` must be readable and `dst` writable for `n` bytes, in memory
    /// the GPU reaches, from now until the stream has executed the copy;
    /// nothing else may access `dst` meanwhile except through the stream's
    /// ordering.
    pub unsafe fn copy(&self, dst: u64, src: u64, n: usize) -> Result<(), CudaError> {
        // SAFETY: the caller's contract; the driver faults the stream, not
        // this process, on a bad device address.
        Ok(check("cuMemcpyAsync", unsafe {
            cu::cuMemcpyAsync(dst, src, n, self.0)
        })?)
    }

    /// Queues an 8-byte store of `v` at `addr` after earlier work.
    ///
    /// # Safety
    /// `addr` must be 8-byte aligned memory the GPU reaches, writable until
    /// the stream has executed the store, and any concurrent reader must
    /// read it as an atomic.
    pub unsafe fn write_u64(&self, addr: u64, v: u64) -> Result<(), CudaError> {
        // SAFETY: the caller's contract.
        Ok(check("cuStreamWriteValue64", unsafe {
            cu::cuStreamWriteValue64_v2(self.0, addr, v, 0)
        })?)
    }

    /// Queues the 8-byte stores `(addr, v)` after earlier work and in their
    /// order, in one driver call (`cuStreamBatchMemOp`): each has the
    /// memory barrier of `cuStreamWriteValue64`, so what the stream wrote
    /// before a store is visible before it. At most [`MAX_WRITES`] at once.
    ///
    /// # Safety
    /// Every `addr` must satisfy [`Stream::write_u64`]'s contract.
    pub unsafe fn write_many(&self, writes: &[(u64, u64)]) -> Result<(), CudaError> {
        if writes.len() > MAX_WRITES {
            return Err(CudaError::TooManyWrites {
                count: writes.len(),
                max: MAX_WRITES,
            });
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
        // operations on addresses the caller vouches for, as for
        // `write_u64`.
        Ok(check("cuStreamBatchMemOp", unsafe {
            cu::cuStreamBatchMemOp_v2(self.0, ops.len() as u32, ops.as_mut_ptr(), 0)
        })?)
    }

    /// Queues the copies `(dst[i], src[i], len[i])` after earlier work, in
    /// one driver call (`cuMemcpyBatchAsync`, CUDA 12.8 and later) where
    /// the driver has it, else one call each. The copies of a batch may run
    /// in any order among themselves: the caller keeps overlapping ones in
    /// different batches.
    ///
    /// # Safety
    /// Every `(dst[i], src[i], len[i])` must satisfy [`Stream::copy`]'s
    /// contract, and no copy of the batch may write bytes another of the
    /// batch reads or writes.
    pub unsafe fn copy_many(
        &self,
        dst: &mut [u64],
        src: &mut [u64],
        len: &mut [usize],
    ) -> Result<(), CudaError> {
        let n = dst.len();
        if src.len() != n || len.len() != n {
            return Err(CudaError::CopyLists {
                dst: n,
                src: src.len(),
                len: len.len(),
            });
        }
        let Some(batch) = batch_copy() else {
            for i in 0..n {
                // SAFETY: the caller's contract, copy by copy.
                unsafe { self.copy(dst[i], src[i], len[i])? };
            }
            return Ok(());
        };
        // SAFETY: a plain C struct, all zero is valid (no location hints).
        let mut attr: cu::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
        attr.srcAccessOrder = cu::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
        let mut first = [0usize];
        // SAFETY: the three lists hold `n` entries each, the attribute
        // applies from index 0; the addresses are the caller's contract.
        Ok(check("cuMemcpyBatchAsync", unsafe {
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
        })?)
    }
}

impl Stream {
    /// Records `e` after the work queued on this stream so far: a stream
    /// that waits for `e` from now on waits for that work. Recording again
    /// replaces what `e` stands for, for later waits only (a wait already
    /// queued keeps the record it saw), so one event serves over and over.
    pub fn record(&self, e: &Event) -> Result<(), CudaError> {
        // SAFETY: the stream and the event are alive and of one context.
        Ok(check("cuEventRecord", unsafe {
            cu::cuEventRecord(e.0, self.0)
        })?)
    }

    /// Makes the work queued on this stream from now on wait until the
    /// work `e` was last recorded after has executed (at once if `e` was
    /// never recorded). Nothing waits on the host.
    pub fn wait(&self, e: &Event) -> Result<(), CudaError> {
        // SAFETY: the stream and the event are alive and of one context.
        Ok(check("cuStreamWaitEvent", unsafe {
            cu::cuStreamWaitEvent(self.0, e.0, 0)
        })?)
    }
}

/// An event without timing, for one stream's work to wait for another's
/// ([`Stream::record`], [`Stream::wait`]); destroyed on drop.
#[derive(Debug)]
pub struct Event(cu::CUevent);

// SAFETY: events may be used from any thread with the context current.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Event {
    /// Creates an event in the current context.
    pub fn new() -> Result<Self, CudaError> {
        available()?;
        let mut e = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        check("cuEventCreate", unsafe {
            cu::cuEventCreate(
                &raw mut e,
                cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
            )
        })?;
        Ok(Self(e))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: destroys what `new` created; the driver releases it once
        // work recorded or waiting on it is done.
        unsafe {
            cu::cuEventDestroy_v2(self.0);
        }
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
    /// Loads a cubin that [`crate::nvrtc::compile`] produced into the
    /// current context.
    pub fn load(cubin: &Cubin) -> Result<Self, CudaError> {
        // SAFETY: NVRTC produced the image whole.
        unsafe { Self::load_image(cubin.as_bytes()) }
    }

    /// Loads a module image (cubin, fatbin or PTX) into the current
    /// context.
    ///
    /// # Safety
    /// `image` must be a complete image as nvcc or NVRTC write one (PTX
    /// NUL-terminated): the driver is not told its length and parses it
    /// as far as its headers say.
    pub unsafe fn load_image(image: &[u8]) -> Result<Self, CudaError> {
        available()?;
        let mut m = std::ptr::null_mut();
        // SAFETY: the caller's contract; valid out-pointer.
        check("cuModuleLoadData", unsafe {
            cu::cuModuleLoadData(&raw mut m, image.as_ptr().cast())
        })?;
        Ok(Self(m))
    }

    /// The kernel `name` (as `extern "C"` names it).
    pub fn function(&self, name: &str) -> Result<Function, CudaError> {
        let c = std::ffi::CString::new(name).map_err(|_| CudaError::NoKernel {
            name: name.into(),
            why: "the name has a NUL".into(),
        })?;
        let mut f = std::ptr::null_mut();
        // SAFETY: valid out-pointer and NUL-terminated name.
        check("cuModuleGetFunction", unsafe {
            cu::cuModuleGetFunction(&raw mut f, self.0, c.as_ptr())
        })
        .map_err(|e| CudaError::NoKernel {
            name: name.into(),
            why: e.to_string(),
        })?;
        Ok(Function(f))
    }
}

/// A cubin as NVRTC produced it: the only image [`Module::load`] takes
/// without `unsafe`.
#[derive(Debug, Clone)]
pub struct Cubin(pub(crate) Vec<u8>);

impl Cubin {
    /// The image's bytes (an ELF file).
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
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

/// A kernel. Launching one is `unsafe` ([`Function::launch`]): nothing
/// here knows its parameter list or what it writes.
#[derive(Debug, Clone, Copy)]
pub struct Function(pub(crate) cu::CUfunction);

// SAFETY: function handles may be launched from any thread.
unsafe impl Send for Function {}
// SAFETY: as above.
unsafe impl Sync for Function {}

impl Function {
    /// How many blocks of `threads` threads (no dynamic shared memory) one
    /// SM holds at once.
    pub fn blocks_per_sm(&self, threads: u32) -> Result<u32, CudaError> {
        let mut n = 0;
        // SAFETY: valid out-pointer and function handle.
        check("cuOccupancyMaxActiveBlocksPerMultiprocessor", unsafe {
            cu::cuOccupancyMaxActiveBlocksPerMultiprocessor(&raw mut n, self.0, threads as i32, 0)
        })?;
        Ok(n.max(0) as u32)
    }

    /// Queues the kernel on `stream`, `grid` blocks of `block` threads,
    /// with one pointer per kernel parameter.
    ///
    /// # Safety
    /// `params` must match the kernel's parameter list in number, order and
    /// size, and stay valid until this call returns; every address the
    /// kernel receives must be memory it may access as it does, until it
    /// has finished.
    pub unsafe fn launch(
        &self,
        stream: &Stream,
        grid: u32,
        block: u32,
        params: &mut [*mut c_void],
    ) -> Result<(), CudaError> {
        // SAFETY: forwarded from the caller; gin's own stream is live.
        unsafe {
            self.launch_with(
                &crate::LaunchConfig::linear(grid, block),
                stream.into(),
                params,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::ManuallyDrop;

    /// Without a driver library, CUDA is an availability error that says
    /// why, and opening a GPU or allocating fails with it instead of
    /// panicking in the loader.
    #[test]
    fn without_a_driver_cuda_is_unavailable() {
        // SAFETY: only probes for the library with dlopen.
        if unsafe { cu::is_culib_present() } {
            eprintln!("skipped: a CUDA driver library can be loaded here");
            return;
        }
        let e = available().expect_err("no driver");
        assert!(
            matches!(&e, CudaError::Unavailable { why } if why.contains("libcuda.so")),
            "{e}"
        );
        assert!(matches!(
            Device::open(0),
            Err(CudaError::Unavailable { .. })
        ));
        // Every constructor says so too.
        assert!(matches!(DevMem::new(8), Err(CudaError::Unavailable { .. })));
        assert!(matches!(
            HostMem::new(8),
            Err(CudaError::Unavailable { .. })
        ));
        assert!(matches!(Stream::new(), Err(CudaError::Unavailable { .. })));
        assert!(matches!(Event::new(), Err(CudaError::Unavailable { .. })));
        assert!(matches!(
            IpcMem::open(&[0; 64]),
            Err(CudaError::Unavailable { .. })
        ));
        let cubin = Cubin(b"\x7fELF".to_vec());
        assert!(matches!(
            Module::load(&cubin),
            Err(CudaError::Unavailable { .. })
        ));
    }

    /// A device buffer that no driver allocated: its accessors must fail
    /// before reaching the driver (which is absent here), and it is never
    /// dropped (no `cuMemFree` either).
    fn fake_devmem(len: usize) -> ManuallyDrop<DevMem> {
        ManuallyDrop::new(DevMem {
            ptr: 0x1000,
            len,
            owned: true,
        })
    }

    #[test]
    fn device_buffer_ranges_are_checked_before_any_driver_call() {
        let m = fake_devmem(64);
        let e = m.write(60, &[0u8; 8]).expect_err("past the end");
        assert!(
            matches!(
                e,
                CudaError::OutOfBounds {
                    op: "write",
                    offset: 60,
                    bytes: 8,
                    size: 64,
                    ..
                }
            ),
            "{e}"
        );
        assert_eq!(
            e.to_string(),
            "write of 8 bytes at 60 exceeds a 64-byte device buffer"
        );
        let mut out = [0u64; 2];
        assert!(matches!(
            m.read(56, &mut out),
            Err(CudaError::OutOfBounds {
                op: "read",
                bytes: 16,
                ..
            })
        ));
        assert!(matches!(
            m.zero(1, 64),
            Err(CudaError::OutOfBounds { op: "zeroing", .. })
        ));
        // An offset that would wrap around is refused, not wrapped.
        assert!(matches!(
            m.zero(usize::MAX, 2),
            Err(CudaError::OutOfBounds { .. })
        ));
        assert_eq!((m.ptr(), m.len(), m.is_empty()), (0x1000, 64, false));
    }

    /// Host buffers: the atomic word must lie inside and be aligned.
    #[test]
    fn host_words_are_checked() {
        let mut backing = vec![0u64; 4];
        let h = ManuallyDrop::new(HostMem {
            host: backing.as_mut_ptr().cast(),
            dev: 0x2000,
            len: 32,
        });
        h.atomic_u64(24)
            .unwrap()
            .store(7, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(backing[3], 7);
        assert!(matches!(
            h.atomic_u64(4),
            Err(CudaError::Misaligned {
                offset: 4,
                size: 32
            })
        ));
        assert!(matches!(
            h.atomic_u64(32),
            Err(CudaError::OutOfBounds { offset: 32, .. })
        ));
    }

    #[test]
    fn spans_end_inside_or_fail() {
        assert_eq!(span("x", "y", 8, 8, 16).unwrap(), 16);
        assert!(span("x", "y", 9, 8, 16).is_err());
        assert!(span("x", "y", u64::MAX, 1, u64::MAX).is_err());
        assert_eq!(span("x", "y", 16, 0, 16).unwrap(), 16);
    }

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
