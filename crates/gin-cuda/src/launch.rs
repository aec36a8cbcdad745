//! Launching kernels the way their authors want: any grid and block shape,
//! dynamic shared memory, cooperative launches, on gin's streams or on the
//! user's own (a raw `CUstream` or a cudarc `CudaStream` of the same
//! context).
//!
//! Launching stays `unsafe` ([`Function::launch_with`]): nothing here knows
//! a kernel's parameter list or what it writes. What is checked before the
//! driver is called — the shape's limits, that the stream belongs to the
//! GPU's context — is pure code, tested without a GPU.

use std::ffi::c_void;
use std::marker::PhantomData;

use cudarc::driver::sys as cu;

use crate::driver::{Device, Function, Stream, check};
use crate::error::CudaError;

/// How a kernel is launched: its grid and block shapes (x, y, z), its
/// dynamic shared memory and whether it is a cooperative launch
/// (`cuLaunchCooperativeKernel`: every block resident at once, so grid-wide
/// synchronisation is allowed; the grid must fit the GPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks in x, y, z.
    pub grid: (u32, u32, u32),
    /// Threads per block in x, y, z.
    pub block: (u32, u32, u32),
    /// Dynamic shared memory per block, in bytes (above 48 KiB, raise the
    /// kernel's limit first: [`Function::set_max_dynamic_shared`]).
    pub shared_mem_bytes: u32,
    /// Whether to launch with `cuLaunchCooperativeKernel`.
    pub cooperative: bool,
}

impl LaunchConfig {
    /// `grid` blocks of `block` threads in x, no dynamic shared memory, not
    /// cooperative.
    pub fn linear(grid: u32, block: u32) -> Self {
        Self {
            grid: (grid, 1, 1),
            block: (block, 1, 1),
            shared_mem_bytes: 0,
            cooperative: false,
        }
    }

    /// Threads per block.
    pub fn threads_per_block(&self) -> u64 {
        let (x, y, z) = self.block;
        u64::from(x) * u64::from(y) * u64::from(z)
    }

    /// Checks the shape against CUDA's fixed limits (no dimension zero, at
    /// most 1024 threads per block, a block's y and z at most 1024 and 64,
    /// a grid's y and z at most 65535), before any driver call.
    pub fn check(&self) -> Result<(), CudaError> {
        let bad = |why: String| Err(CudaError::LaunchShape { config: *self, why });
        let (gx, gy, gz) = self.grid;
        let (bx, by, bz) = self.block;
        if [gx, gy, gz, bx, by, bz].contains(&0) {
            return bad("a grid or block dimension is zero".into());
        }
        if gx > i32::MAX as u32 || gy > 65_535 || gz > 65_535 {
            return bad("the grid exceeds (2^31 - 1, 65535, 65535) blocks".into());
        }
        if by > 1024 || bz > 64 {
            return bad("the block exceeds (1024, 1024, 64) threads".into());
        }
        let t = self.threads_per_block();
        if t > 1024 {
            return bad(format!("{t} threads per block, at most 1024"));
        }
        Ok(())
    }
}

/// A stream to queue a kernel on: one of gin's ([`Stream`]), a cudarc
/// `CudaStream`, or a raw `CUstream` from elsewhere
/// ([`StreamRef::from_raw`]). It borrows what it was made from, so the
/// stream outlives every use of it.
#[derive(Debug, Clone, Copy)]
pub struct StreamRef<'s> {
    raw: cu::CUstream,
    _borrow: PhantomData<&'s ()>,
}

impl<'s> From<&'s Stream> for StreamRef<'s> {
    fn from(s: &'s Stream) -> Self {
        Self {
            raw: s.0,
            _borrow: PhantomData,
        }
    }
}

impl<'s> From<&'s cudarc::driver::CudaStream> for StreamRef<'s> {
    /// A cudarc stream: made in cudarc's `CudaContext::new(ordinal)`, the
    /// GPU's primary context, which is gin's too ([`Device::open`]).
    fn from(s: &'s cudarc::driver::CudaStream) -> Self {
        Self {
            raw: s.cu_stream(),
            _borrow: PhantomData,
        }
    }
}

impl StreamRef<'static> {
    /// A stream gin did not create (PyTorch's, a CUDA graph's capture
    /// stream, the legacy default stream as null).
    ///
    /// # Safety
    /// `raw` must be null or a live stream, and stay alive (not destroyed)
    /// for as long as the result or a copy of it is used.
    pub unsafe fn from_raw(raw: cu::CUstream) -> Self {
        Self {
            raw,
            _borrow: PhantomData,
        }
    }
}

impl StreamRef<'_> {
    /// The raw `CUstream`.
    pub fn raw(&self) -> cu::CUstream {
        self.raw
    }

    /// Whether all work queued so far on the stream has finished.
    pub fn idle(&self) -> Result<bool, CudaError> {
        // SAFETY: the stream is alive (this borrows its owner, or the
        // creator of a raw one promised so).
        let r = unsafe { cu::cuStreamQuery(self.raw) };
        if r == cu::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check("cuStreamQuery", r).map(|()| true).map_err(Into::into)
    }

    /// Waits until all work queued so far on the stream has finished.
    pub fn sync(&self) -> Result<(), CudaError> {
        // SAFETY: as in `idle`.
        Ok(check("cuStreamSynchronize", unsafe {
            cu::cuStreamSynchronize(self.raw)
        })?)
    }

    /// Checks that the stream belongs to `dev`'s context (a stream of
    /// another GPU, or of a context the user created, would run the kernel
    /// where gin's memory is not).
    pub fn check_context(&self, dev: &Device) -> Result<(), CudaError> {
        dev.make_current()?;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the stream is alive (see `idle`). The
        // null stream answers with the current context.
        check("cuStreamGetCtx", unsafe {
            cu::cuStreamGetCtx(self.raw, &raw mut ctx)
        })?;
        if ctx != dev.raw_context() {
            return Err(CudaError::ForeignStream {
                ordinal: dev.ordinal(),
            });
        }
        Ok(())
    }
}

// SAFETY: a CUstream may be used from any thread with its context current.
unsafe impl Send for StreamRef<'_> {}
// SAFETY: as above.
unsafe impl Sync for StreamRef<'_> {}

impl Function {
    /// Queues the kernel on `stream` as `cfg` says, with one pointer per
    /// kernel parameter; returns once the driver has queued it.
    ///
    /// # Safety
    /// `params` must match the kernel's parameter list in number, order and
    /// size, and stay valid until this call returns; every address the
    /// kernel receives must be memory it may access as it does, until it
    /// has finished. The stream must belong to the current context.
    pub unsafe fn launch_with(
        &self,
        cfg: &LaunchConfig,
        stream: StreamRef<'_>,
        params: &mut [*mut c_void],
    ) -> Result<(), CudaError> {
        cfg.check()?;
        let (gx, gy, gz) = cfg.grid;
        let (bx, by, bz) = cfg.block;
        let (call, r) = if cfg.cooperative {
            // SAFETY: forwarded from the caller.
            ("cuLaunchCooperativeKernel", unsafe {
                cu::cuLaunchCooperativeKernel(
                    self.0,
                    gx,
                    gy,
                    gz,
                    bx,
                    by,
                    bz,
                    cfg.shared_mem_bytes,
                    stream.raw,
                    params.as_mut_ptr(),
                )
            })
        } else {
            // SAFETY: forwarded from the caller.
            ("cuLaunchKernel", unsafe {
                cu::cuLaunchKernel(
                    self.0,
                    gx,
                    gy,
                    gz,
                    bx,
                    by,
                    bz,
                    cfg.shared_mem_bytes,
                    stream.raw,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            })
        };
        if r == cu::CUresult::CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES {
            // Say why where the kernel's attributes tell it: registers per
            // thread times threads per block over the SM's register file.
            let threads = bx.saturating_mul(by).saturating_mul(bz);
            if let (Ok(regs), Ok(max_threads)) = (
                self.attribute(cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NUM_REGS),
                self.attribute(cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK),
            ) && i64::from(threads) > i64::from(max_threads)
            {
                return Err(CudaError::LaunchResources {
                    call,
                    threads,
                    regs,
                    max_threads,
                });
            }
        }
        Ok(check(call, r)?)
    }

    /// One of the kernel's attributes (`cuFuncGetAttribute`).
    fn attribute(&self, which: cu::CUfunction_attribute) -> Result<i32, CudaError> {
        let mut v = 0;
        // SAFETY: valid out-pointer and function handle.
        check("cuFuncGetAttribute", unsafe {
            cu::cuFuncGetAttribute(&raw mut v, which, self.0)
        })?;
        Ok(v)
    }

    /// Queues the kernel as [`Function::launch_with`] does, with `params`
    /// passed by value: the parameter pointers are made here, from values
    /// that live for the call.
    ///
    /// # Safety
    /// As [`Function::launch_with`]: `params` must match the kernel's
    /// parameter list in number, order and size (a [`Param::value`] the
    /// size and layout of the parameter it stands for), and every address
    /// the kernel reaches through them must be memory it may access as it
    /// does, until it has finished.
    pub unsafe fn launch_params(
        &self,
        cfg: &LaunchConfig,
        stream: StreamRef<'_>,
        params: &[Param<'_>],
    ) -> Result<(), CudaError> {
        let mut values = Values::of(params);
        // SAFETY: the pointers point into `values` and the caller's values,
        // which live until the driver has copied them (before it returns);
        // the rest is the caller's contract.
        unsafe { self.launch_with(cfg, stream, &mut values.pointers()) }
    }

    /// Lets launches of this kernel ask for up to `bytes` of dynamic shared
    /// memory per block (needed above 48 KiB).
    pub fn set_max_dynamic_shared(&self, bytes: u32) -> Result<(), CudaError> {
        // SAFETY: a valid function handle; the driver checks the value.
        Ok(check("cuFuncSetAttribute", unsafe {
            cu::cuFuncSetAttribute(
                self.0,
                cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
        })?)
    }

    /// The raw `CUfunction` (to launch it with another launcher, such as
    /// cudarc's; that launch is as `unsafe` as [`Function::launch_with`]).
    pub fn raw(&self) -> cu::CUfunction {
        self.0
    }
}

/// One kernel parameter, passed by value ([`Function::launch_params`]).
#[derive(Debug, Clone, Copy)]
pub enum Param<'p> {
    /// An 8-byte integer (or a device address).
    U64(u64),
    /// A 4-byte integer.
    U32(u32),
    /// A value of the caller's, passed by value as its bytes (a
    /// `#[repr(C)]` struct the kernel takes by value), borrowed until the
    /// launch has been queued.
    Value(Borrowed<'p>),
}

/// A borrowed value a kernel receives by value ([`Param::value`]).
#[derive(Debug, Clone, Copy)]
pub struct Borrowed<'p> {
    ptr: *const c_void,
    _borrow: PhantomData<&'p ()>,
}

impl<'p> Param<'p> {
    /// `v` passed by value: the kernel's parameter must have `T`'s size
    /// and layout (the launch's contract).
    pub fn value<T: Copy>(v: &'p T) -> Self {
        Self::Value(Borrowed {
            ptr: std::ptr::from_ref(v).cast(),
            _borrow: PhantomData,
        })
    }
}

/// The integers of a parameter list, stored where the driver can read them
/// while a launch is queued.
#[derive(Debug)]
struct Values {
    kinds: Vec<Kind>,
    u64s: Vec<u64>,
    u32s: Vec<u32>,
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    U64,
    U32,
    Value(*const c_void),
}

impl Values {
    fn of(params: &[Param<'_>]) -> Self {
        let mut v = Self {
            kinds: Vec::with_capacity(params.len()),
            u64s: Vec::with_capacity(params.len()),
            u32s: Vec::with_capacity(params.len()),
        };
        for p in params {
            match *p {
                Param::U64(x) => {
                    v.kinds.push(Kind::U64);
                    v.u64s.push(x);
                }
                Param::U32(x) => {
                    v.kinds.push(Kind::U32);
                    v.u32s.push(x);
                }
                Param::Value(b) => v.kinds.push(Kind::Value(b.ptr)),
            }
        }
        v
    }

    /// One pointer per parameter, in order (valid while `self` and the
    /// borrowed values are neither moved nor dropped).
    fn pointers(&mut self) -> Vec<*mut c_void> {
        let (mut i64, mut i32) = (0, 0);
        let (u64s, u32s) = (self.u64s.as_mut_ptr(), self.u32s.as_mut_ptr());
        self.kinds
            .iter()
            .map(|k| match *k {
                Kind::U64 => {
                    i64 += 1;
                    // In bounds: one u64 was stored per U64 kind.
                    u64s.wrapping_add(i64 - 1).cast()
                }
                Kind::U32 => {
                    i32 += 1;
                    u32s.wrapping_add(i32 - 1).cast()
                }
                Kind::Value(p) => p.cast_mut(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each parameter's pointer reads back its value, in order: integers
    /// from the list's own storage, values from the caller's.
    #[test]
    fn parameters_point_at_their_values_in_order() {
        #[derive(Clone, Copy)]
        #[repr(C)]
        struct Abi {
            a: u32,
            b: u64,
        }
        let abi = Abi { a: 7, b: 9 };
        let params = [
            Param::U64(1),
            Param::value(&abi),
            Param::U32(2),
            Param::U64(u64::MAX),
            Param::U32(3),
        ];
        let mut values = Values::of(&params);
        let p = values.pointers();
        assert_eq!(p.len(), 5);
        // SAFETY: each pointer points at a live value of the type read.
        unsafe {
            assert_eq!(*p[0].cast::<u64>(), 1);
            let v = &*p[1].cast::<Abi>();
            assert_eq!((v.a, v.b), (7, 9));
            assert_eq!(*p[2].cast::<u32>(), 2);
            assert_eq!(*p[3].cast::<u64>(), u64::MAX);
            assert_eq!(*p[4].cast::<u32>(), 3);
        }
        assert_eq!(p[1].cast_const(), std::ptr::from_ref(&abi).cast());
    }

    #[test]
    fn launch_shapes_are_checked_before_the_driver() {
        assert!(LaunchConfig::linear(132, 1024).check().is_ok());
        let mut c = LaunchConfig::linear(4, 256);
        c.grid = (4, 2, 3);
        c.block = (16, 16, 4);
        assert_eq!(c.threads_per_block(), 1024);
        assert!(c.check().is_ok());
        c.block = (32, 32, 2);
        let e = c.check().expect_err("2048 threads");
        assert!(e.to_string().contains("2048 threads per block"), "{e}");
        assert!(LaunchConfig::linear(0, 32).check().is_err());
        assert!(LaunchConfig::linear(1, 1025).check().is_err());
        let mut c = LaunchConfig::linear(1, 32);
        c.grid.1 = 65_536;
        assert!(c.check().is_err());
        c.grid.1 = 1;
        c.block = (1, 1, 65);
        let e = c.check().expect_err("z of 65");
        assert!(matches!(e, CudaError::LaunchShape { .. }), "{e}");
    }

    #[test]
    fn a_raw_stream_keeps_its_handle() {
        // SAFETY: the null stream; nothing is queued on it here.
        let s = unsafe { StreamRef::from_raw(std::ptr::null_mut()) };
        assert!(s.raw().is_null());
    }
}
