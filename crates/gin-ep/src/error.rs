//! Errors of gin-ep. Every variant names the rank that raised it and the
//! token, slot, expert, peer or limit involved. Input errors are raised
//! before this rank sends a token; where a step has begun, the rank still
//! takes part in it without tokens, so that its peers stop at once with
//! [`EpError::PeerRefused`] naming it; a CUDA rank whose combine tensor
//! (its expert outputs) is refused takes part in the combine without
//! outputs, and its peers' combines end with
//! [`EpError::PeerRefusedCombine`] naming it.

use std::time::Duration;

/// Everything a gin-ep call can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EpError {
    /// A buffer configuration that cannot work (zero sizes, experts not a
    /// multiple of the rank count, FP8 with a hidden size that is not a
    /// multiple of 128...).
    #[error("rank {rank}: invalid configuration: {field} = {value}: {why}")]
    Config {
        /// The rank that checked it.
        rank: usize,
        /// The field at fault.
        field: &'static str,
        /// Its value.
        value: usize,
        /// What it must be.
        why: &'static str,
    },
    /// Ranks created their buffers with different configurations.
    #[error(
        "rank {rank}: buffer configuration differs from rank {peer}'s: {field} is {mine} here and {theirs} there"
    )]
    ConfigMismatch {
        /// This rank.
        rank: usize,
        /// The first rank that differs.
        peer: usize,
        /// The field that differs.
        field: &'static str,
        /// This rank's value.
        mine: u64,
        /// The peer's value.
        theirs: u64,
    },
    /// More tokens than the buffer was sized for.
    #[error("rank {rank}: {tokens} tokens given, the buffer holds at most {max} per rank")]
    TooManyTokens {
        /// This rank.
        rank: usize,
        /// Tokens given.
        tokens: usize,
        /// The buffer's maximum.
        max: usize,
    },
    /// An input array whose length does not fit the token count and the
    /// buffer's hidden size or top-k.
    #[error(
        "rank {rank}: {what} has {len} elements, expected {expected} ({tokens} tokens x {per_token})"
    )]
    Shape {
        /// This rank.
        rank: usize,
        /// Which input (`x`, `topk_idx`, `topk_weights`, `expert output`...).
        what: &'static str,
        /// Its length.
        len: usize,
        /// The length expected.
        expected: usize,
        /// Tokens.
        tokens: usize,
        /// Elements per token (hidden size or top-k).
        per_token: usize,
    },
    /// A device buffer whose address is not aligned as the kernel reads it
    /// (CUDA ranks' device-resident inputs and outputs).
    #[error(
        "rank {rank}: {what} lies at device address {addr:#x}, not a multiple of {align} bytes"
    )]
    Misaligned {
        /// This rank.
        rank: usize,
        /// Which buffer (`x`, `topk_idx`, `topk_weights`, `combine output`).
        what: &'static str,
        /// Its device address.
        addr: u64,
        /// The alignment it needs.
        align: u64,
    },
    /// A top-k slot names an expert that does not exist (only -1, "no
    /// expert", is allowed outside `0..experts`).
    #[error(
        "rank {rank}: token {token} top-k slot {slot} names expert {expert}, outside 0..{experts} (-1 marks an empty slot)"
    )]
    ExpertOutOfRange {
        /// This rank.
        rank: usize,
        /// The token.
        token: usize,
        /// The top-k slot.
        slot: usize,
        /// The expert named.
        expert: i64,
        /// Number of experts.
        experts: usize,
    },
    /// A token names the same expert in two top-k slots.
    #[error("rank {rank}: token {token} names expert {expert} in top-k slots {first} and {second}")]
    DuplicateExpert {
        /// This rank.
        rank: usize,
        /// The token.
        token: usize,
        /// The expert.
        expert: i64,
        /// The first slot naming it.
        first: usize,
        /// The second.
        second: usize,
    },
    /// A top-k weight that is not finite.
    #[error(
        "rank {rank}: token {token} top-k slot {slot} has weight {weight}, not a finite number"
    )]
    BadWeight {
        /// This rank.
        rank: usize,
        /// The token.
        token: usize,
        /// The slot.
        slot: usize,
        /// The weight.
        weight: f32,
    },
    /// A table that every rank must hold alike differs.
    #[error(
        "rank {rank}: the {what} differs from rank {peer}'s (fingerprint {mine:016x} here, {theirs:016x} there)"
    )]
    RoutingMismatch {
        /// This rank.
        rank: usize,
        /// The first rank that differs.
        peer: usize,
        /// What was compared.
        what: &'static str,
        /// This rank's fingerprint.
        mine: u64,
        /// The peer's.
        theirs: u64,
    },
    /// A call for a mode the buffer was not sized for, or a host layout the
    /// mode cannot use.
    #[error("rank {rank}: {what}")]
    Mode {
        /// This rank.
        rank: usize,
        /// What is wrong.
        what: String,
    },
    /// High-throughput mode on CUDA ranks: the channel blocks of the ranks
    /// sharing one GPU cannot all be resident at once (a channel's block
    /// waits for the same channel's block of its peers, so one that never
    /// starts makes its peers time out). Checked at `CudaBuffer::new`, on
    /// every rank alike.
    #[error(
        "rank {rank}: {channels} channels x {ranks_on_gpu} ranks on GPU {gpu} (ranks {ranks:?}) need {} resident blocks, but its {sms} SMs hold {blocks_per_sm} block(s) of the high-throughput kernels each ({} in all): {}",
        channels * ranks_on_gpu, sms * blocks_per_sm, resident_advice(*most, *ranks_on_gpu)
    )]
    NotResident {
        /// This rank.
        rank: usize,
        /// The GPU (its UUID) whose ranks do not fit.
        gpu: String,
        /// The ranks on it.
        ranks: Vec<usize>,
        /// Channels per rank (one block each).
        channels: usize,
        /// Ranks sharing that GPU.
        ranks_on_gpu: usize,
        /// Its streaming multiprocessors.
        sms: usize,
        /// Blocks of the dispatch and combine kernels one SM holds at once.
        blocks_per_sm: usize,
        /// The most channels that fit.
        most: usize,
    },
    /// A handle from another step or another buffer.
    #[error(
        "rank {rank}: handle of step {handle_step} used at step {step} (handles are valid for the step that made them)"
    )]
    StaleHandle {
        /// This rank.
        rank: usize,
        /// The handle's step.
        handle_step: u64,
        /// The buffer's step.
        step: u64,
    },
    /// A call out of order (dispatch twice without receiving, combine before
    /// dispatch...).
    #[error("rank {rank}: {call} called while the buffer is {phase}")]
    Phase {
        /// This rank.
        rank: usize,
        /// The call.
        call: &'static str,
        /// Where the step stands.
        phase: &'static str,
    },
    /// Rank `peer`'s inputs were refused this step (its own error names
    /// what it refused: a bad entry, the token count, a buffer's size), so
    /// it sent no token and the step gives no result on any rank, which
    /// every rank ends alike: a waiting call returns this once it ended the
    /// step; a CUDA step queued on a stream runs to its end as queued, and
    /// [`crate::cuda::CudaBuffer::check`] reports this, possibly between
    /// the step's dispatch and its combine, which must then still be
    /// queued (every peer's combine waits for it). No protocol was broken:
    /// this rank's buffer takes the next step (docs/ep.md, "Bad input").
    #[error(
        "rank {rank}: rank {peer}'s inputs were refused this step (its own error names what it refused), so it sent no token and the step gives no result on any rank, every rank ending it alike; no protocol was broken, and the buffer takes the next step"
    )]
    PeerRefused {
        /// This rank.
        rank: usize,
        /// The rank whose inputs were refused (the lowest, where several
        /// were).
        peer: usize,
    },
    /// Rank `peer` refused this step's combine: its expert outputs (the
    /// tensor of `ll_combine_from_device` or `ll_combine_from_on`) were
    /// refused by its host's checks (its own error names the tensor), so
    /// it sent none of them. This rank's tokens were dispatched and
    /// reached the experts, but their outputs are missing: nothing was
    /// reduced and this rank's combine output was not written (left as it
    /// was). Every rank ended the step alike: a waiting call returns this
    /// once its combine ended; a combine queued on a stream runs to its
    /// end, and [`crate::cuda::CudaBuffer::check`] reports this. No
    /// protocol was broken: this rank's buffer takes the next step
    /// (docs/ep.md, "Bad input").
    #[error(
        "rank {rank}: rank {peer} refused this step's combine (its combine tensor, the expert outputs, was refused; its own error names it), so this rank's combine output was not written and the step gives no result; every rank ended it alike, no protocol was broken, and the buffer takes the next step"
    )]
    PeerRefusedCombine {
        /// This rank.
        rank: usize,
        /// The rank that refused the combine (the lowest, where several
        /// did).
        peer: usize,
    },
    /// A peer sent something the protocol does not allow (a count or token
    /// index out of range): a bug or corruption at the peer.
    #[error("rank {rank}: rank {peer} broke the protocol: {what}")]
    Protocol {
        /// This rank.
        rank: usize,
        /// The peer.
        peer: usize,
        /// What it sent.
        what: String,
    },
    /// A bounded wait ran out: the peer named did not deliver in time.
    #[error(
        "rank {rank}: timed out after {waited:.1?} waiting for {what} from rank {peer} (signal value {last}, expected at least {expected})"
    )]
    Timeout {
        /// This rank.
        rank: usize,
        /// The peer waited for.
        peer: usize,
        /// What was awaited.
        what: String,
        /// Last value seen.
        last: u64,
        /// The value needed.
        expected: u64,
        /// How long.
        waited: Duration,
    },
    /// A peer the step needs is gone (died, left, or its link broke).
    #[error("rank {rank}: rank {peer} is lost while waiting for {what}: {why}")]
    PeerLost {
        /// This rank.
        rank: usize,
        /// The lost peer.
        peer: usize,
        /// What was awaited or sent.
        what: String,
        /// The cause as reported by the bootstrap or the backend.
        why: String,
    },
    /// A CUDA rank's kernel failed: a bounded wait ran out or gave up (the
    /// peer it waited for is named where the kernel knows it), or a device
    /// operation was refused.
    #[error("rank {rank}: the {kernel} kernel failed{}: {source}", peer.map(|p| format!(" waiting for rank {p}")).unwrap_or_default())]
    Kernel {
        /// This rank.
        rank: usize,
        /// Which kernel (`dispatch`, `combine`, `echo`, `floor`).
        kernel: &'static str,
        /// The peer the failed operation waited for or targeted.
        peer: Option<usize>,
        /// gin-core's account (kind, context, peer, id or value).
        source: Box<gin_core::CoreError>,
    },
    /// High-throughput mode on CUDA ranks: rank `peer`'s driver could not
    /// say how many blocks of the kernels one of its SMs holds (the
    /// residency check's occupancy query), so no rank can check that the
    /// channels fit. Checked at `CudaBuffer::new`, on every rank alike.
    #[error(
        "rank {rank}: rank {peer} could not ask its driver how many blocks of the high-throughput kernels one SM holds (cuOccupancyMaxActiveBlocksPerMultiprocessor): {why}"
    )]
    Occupancy {
        /// This rank.
        rank: usize,
        /// The rank whose query failed.
        peer: usize,
        /// Its driver's error.
        why: String,
    },
    /// A step's inputs in GPU memory could not be read back to the host
    /// (the high-throughput dispatch reads its routing back for the plan).
    #[error("rank {rank}: reading {what} back from GPU memory failed: {source}")]
    ReadBack {
        /// This rank.
        rank: usize,
        /// The input (`topk_idx`, `topk_weights`).
        what: &'static str,
        /// gin-core's account of the failed copy.
        source: Box<gin_core::CoreError>,
    },
    /// A device-API error (gin-core / gin-device).
    #[error(transparent)]
    Gin(#[from] gin_core::GinError),
    /// A host-API error.
    #[error(transparent)]
    Core(#[from] gin_core::CoreError),
    /// A bootstrap error (configuration agreement).
    #[error(transparent)]
    Bootstrap(#[from] gin_bootstrap::BootstrapError),
}

/// What [`EpError::NotResident`] advises: the channel count that fits
/// (`Config::channels`; `Config::with_cuda_channels` takes an SM count and
/// uses at most one channel per SM, so passing it `most` gives at most
/// `most`), or, where none does, fewer ranks on the GPU.
fn resident_advice(most: usize, ranks_on_gpu: usize) -> String {
    if most == 0 {
        format!(
            "no channel count fits its {ranks_on_gpu} rank(s): put fewer ranks on that GPU (or see why its SMs hold no block of these kernels)"
        )
    } else {
        format!(
            "set channels <= {most} (Config {{ channels: {most}, .. }}, or Config::with_cuda_channels({most}): it takes an SM count and uses at most one channel per SM), or put fewer ranks on that GPU"
        )
    }
}
