//! What the CUDA host runtime fails with.

/// A CUDA driver call that did not return `CUDA_SUCCESS`: which call, and
/// the `CUresult` by number, name and description.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("CUDA call {call} failed: {name} ({code}): {text}")]
pub struct DriverError {
    /// The driver entry point, as `cuMemAlloc`.
    pub call: &'static str,
    /// The `CUresult` value.
    pub code: i32,
    /// The `CUresult` name, as `CUDA_ERROR_OUT_OF_MEMORY` (`?` if the
    /// driver does not name it).
    pub name: String,
    /// The driver's description of the result.
    pub text: String,
}

/// Everything the CUDA host runtime can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// No usable CUDA driver or GPU on this machine: CUDA ranks cannot run
    /// here (CPU ranks can).
    #[error("CUDA is not available: {why}")]
    Unavailable {
        /// Why not (no driver library, no GPU, a failing `cuInit`).
        why: String,
    },
    /// A driver call failed.
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// Allocating memory failed (out of memory, most often).
    #[error("allocating {bytes} bytes of {what}: {source}")]
    Alloc {
        /// What was allocated: "device memory" or "pinned host memory".
        what: &'static str,
        /// The size asked for.
        bytes: usize,
        /// The failing driver call.
        source: DriverError,
    },
    /// The GPU asked for is not one of this machine's.
    #[error("GPU {ordinal} does not exist (this machine has {count})")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// How many GPUs the driver reports.
        count: usize,
    },
    /// Opening a GPU (its properties or its primary context) failed.
    #[error("opening GPU {ordinal}: {source}")]
    Open {
        /// The GPU's ordinal.
        ordinal: usize,
        /// The failing driver call.
        source: DriverError,
    },
    /// An access outside memory this crate owns, refused before any driver
    /// call.
    #[error("{op} of {bytes} bytes at {offset} exceeds a {size}-byte {what}")]
    OutOfBounds {
        /// The operation: "write", "read", "zeroing", ...
        op: &'static str,
        /// What was accessed: "device buffer", "pinned host buffer", ...
        what: &'static str,
        /// The offset into it.
        offset: u64,
        /// The bytes asked for.
        bytes: u64,
        /// Its size.
        size: u64,
    },
    /// An offset that an 8-byte atomic cannot use.
    #[error("offset {offset} of a {size}-byte pinned host buffer is not 8-byte aligned")]
    Misaligned {
        /// The offset asked for.
        offset: usize,
        /// The buffer's size.
        size: usize,
    },
    /// More stores than one `cuStreamBatchMemOp` call takes.
    #[error("write_many: {count} stores, at most {max} in one call")]
    TooManyWrites {
        /// Stores asked for.
        count: usize,
        /// The limit ([`crate::MAX_WRITES`]).
        max: usize,
    },
    /// The three lists of a batched copy differ in length.
    #[error(
        "copy_many: lists of different lengths ({dst} destinations, {src} sources, {len} lengths)"
    )]
    CopyLists {
        /// Destinations given.
        dst: usize,
        /// Sources given.
        src: usize,
        /// Lengths given.
        len: usize,
    },
    /// A module has no kernel of that name (or the name has a NUL).
    #[error("kernel {name}: {why}")]
    NoKernel {
        /// The kernel's name.
        name: String,
        /// What the driver said, or that the name has a NUL.
        why: String,
    },
    /// NVRTC cannot be loaded: nothing can be compiled at run time here.
    #[error("run-time compilation of {name} is not available: {why}")]
    NvrtcUnavailable {
        /// The source's name.
        name: String,
        /// Why not.
        why: String,
    },
    /// NVRTC was given input it cannot take (a NUL in a source, a header
    /// file that cannot be read).
    #[error("run-time compilation of {name}: {why}")]
    CompileInput {
        /// The source's name.
        name: String,
        /// What was wrong.
        why: String,
    },
    /// NVRTC failed to compile a source; `log` holds its diagnostics.
    #[error("run-time compilation of {name} failed: {call}: {result}{}", if log.is_empty() { String::new() } else { format!("\n{log}") })]
    Compile {
        /// The source's name.
        name: String,
        /// The failing NVRTC call.
        call: &'static str,
        /// The `nvrtcResult`'s description.
        result: String,
        /// NVRTC's log (empty if it wrote none).
        log: String,
    },
    /// A host thread could not be started.
    #[error("cannot start the {what} thread: {source}")]
    Spawn {
        /// Which thread ("CUDA proxy", ...).
        what: &'static str,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// A worker thread stopped with an error (the first it met).
    #[error("{context}: {error}")]
    Worker {
        /// Who reports it ("the soft NIC reported").
        context: String,
        /// The worker's first error.
        error: String,
    },
    /// The TCP transport failed a staged transfer.
    #[error(transparent)]
    Net(#[from] gin_net::NetError),
    /// A rank's allgathered record (of a GPU window part) has the wrong
    /// shape: the ranks run different builds, or memory was corrupted.
    #[error(transparent)]
    Record(#[from] gin_bootstrap::record::Malformed),
    /// A peer reached over TCP does not serve its part of a GPU window: the
    /// ranks disagree on who is reached over TCP.
    #[error(
        "rank {peer} does not serve GPU window {window} over TCP, but rank {rank} reaches it \
         over TCP (GIN_TRANSPORT or host ids differ between ranks?)"
    )]
    NotServed {
        /// The rank that reaches it over TCP.
        rank: usize,
        /// The rank that does not serve its part.
        peer: usize,
        /// The window's id.
        window: u32,
    },
    /// A same-host peer's part of a GPU window cannot be mapped through
    /// CUDA IPC.
    #[error("rank {rank} cannot map GPU window {window} of rank {peer} through CUDA IPC: {source}")]
    IpcOpen {
        /// The rank mapping it.
        rank: usize,
        /// The rank whose part it is.
        peer: usize,
        /// The window's id.
        window: u32,
        /// Why the mapping failed.
        source: Box<CudaError>,
    },
    /// A same-host peer's part of a GPU window, a VMM allocation, cannot be
    /// imported from its file descriptor and mapped here.
    #[error(
        "rank {rank} cannot map GPU window {window} of rank {peer} from its VMM export (POSIX \
         file descriptor): {source}"
    )]
    VmmOpen {
        /// The rank mapping it.
        rank: usize,
        /// The rank whose part it is.
        peer: usize,
        /// The window's id.
        window: u32,
        /// Why the mapping failed.
        source: Box<CudaError>,
    },
    /// Handing a VMM allocation's file descriptor to a same-host peer
    /// failed (the error names the ranks and the window).
    #[error(transparent)]
    FdPass(#[from] crate::fdpass::FdPassError),
    /// A launch shape CUDA cannot run, refused before the driver.
    #[error("launch of grid {:?} x block {:?}: {why}", config.grid, config.block)]
    LaunchShape {
        /// The launch asked for.
        config: crate::LaunchConfig,
        /// What is wrong with it.
        why: String,
    },
    /// A watcher handed to the check of kernels it was not started for
    /// (another device communicator's, or another CUDA communicator's).
    #[error(
        "watcher {watcher} was started by device communicator {started_by}, but handed to the \
         check of device communicator {checked_by} (or of another CUDA communicator); hand each \
         check the watchers its own device communicator's watch started"
    )]
    ForeignWatcher {
        /// The watcher's thread name (gin-core's names the rank).
        watcher: String,
        /// The device communicator that started it ([`crate::watch::Owner::id`]).
        started_by: u64,
        /// The one whose check it was handed.
        checked_by: u64,
    },
    /// A stream that does not belong to this GPU's primary context.
    #[error(
        "the stream belongs to another CUDA context than GPU {ordinal}'s primary context \
         (where gin's memory and modules live); create it in the primary context, e.g. with \
         cudarc's CudaContext::new({ordinal})"
    )]
    ForeignStream {
        /// The GPU gin runs on.
        ordinal: usize,
    },
    /// Memory this rank was asked to register as a GPU window cannot be
    /// used as one (here: the pointer, and why).
    #[error("rank {rank} cannot register {bytes} bytes at {ptr:#x} as a GPU window: {why}")]
    NotRegistrable {
        /// The rank that was asked.
        rank: usize,
        /// The device address given.
        ptr: u64,
        /// The bytes given.
        bytes: u64,
        /// Why not (not device memory, another GPU's, not exportable
        /// through CUDA IPC, ...).
        why: String,
    },
    /// A kernel launched with more threads per block than its register
    /// use allows (`CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES`).
    #[error(
        "{call}: blocks of {threads} threads are more than the kernel can run: it uses {regs} \
         registers per thread, so at most {max_threads} threads per block (give the kernel \
         __launch_bounds__({threads}) so the compiler keeps within the block, or launch fewer \
         threads)"
    )]
    LaunchResources {
        /// The driver call that refused.
        call: &'static str,
        /// Threads per block asked for.
        threads: u32,
        /// Registers per thread the kernel was compiled with.
        regs: i32,
        /// The most threads per block the kernel can be launched with.
        max_threads: i32,
    },
    /// Some rank could not contribute its part of a GPU window (its memory
    /// could not be allocated or registered): every rank fails alike.
    #[error("GPU window {window} was not created on rank {rank}: rank {peer} refused: {why}")]
    WindowRefused {
        /// This rank.
        rank: usize,
        /// The window id it would have had.
        window: u32,
        /// The first rank that refused.
        peer: usize,
        /// That rank's account.
        why: String,
    },
}
