//! What a [`crate::Buffer`] is sized from, and the message layout that
//! follows from it. Pure code.

use crate::error::EpError;
use crate::num::FP8_BLOCK;

/// The most tokens per rank a buffer takes (`Config::validate`): a count
/// signal (`count + 1`) then stays far below the low-latency refusal mark
/// (`ll::POISON`, 2^32).
pub(crate) const MAX_TOKENS_PER_RANK: usize = u32::MAX as usize / 2;

/// Which of the two schemes a buffer runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Every token goes straight to each rank holding one of its experts,
    /// into per-(local expert, source rank) slots sized for the maximum:
    /// no count exchange, one round trip per step.
    LowLatency,
    /// DeepEP's normal mode: counts first, then two stages (between hosts to
    /// the rank with the same local index, within a host forwarded over
    /// load/store) through credit-controlled channels.
    HighThroughput,
}

/// The largest `hidden` a buffer takes (2^24 BF16 elements per token).
pub const MAX_HIDDEN: usize = 1 << 24;
/// The largest `topk` a buffer takes.
pub const MAX_TOPK: usize = 1 << 16;
/// The most experts a buffer takes.
pub const MAX_EXPERTS: usize = 1 << 24;

/// Channels CUDA ranks use by default in high-throughput mode
/// ([`Config::with_cuda_channels`]): a channel is one block of the dispatch
/// and combine kernels, and both kernels are bound per channel block. On an
/// H200 (4096 tokens, hidden 7168, top-8, inputs in GPU memory; docs/ep.md,
/// "Channels"), 32 channels against 16: at 2 ranks the dispatch kernel
/// 160-166 against 225-228 µs and the combine 178-264 against 302-343 µs;
/// at 4 ranks the dispatch kernel 487-492 against 527-545 µs and the
/// combine 553-593 against 733-804 µs. A GPU holds `channels` × the ranks
/// sharing it blocks at once (`CudaBuffer::new` checks it): 32 channels fit
/// 4 ranks on an H200's 132 SMs; more ranks on one GPU need fewer channels
/// (`EpError::NotResident` says how many). The CPU ranks' default stays 2
/// ([`Config::high_throughput`]: there a channel is a lane of a thread).
pub const CUDA_HT_CHANNELS: usize = 32;

/// The shape a buffer is sized for; every rank passes the same values
/// (checked when the buffer is created).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// Elements per token.
    pub hidden: usize,
    /// The most tokens any rank dispatches in one step.
    pub max_tokens_per_rank: usize,
    /// Experts in the job, spread evenly: expert `e` lives on rank
    /// `e / (experts / ranks)`.
    pub num_experts: usize,
    /// Top-k slots per token.
    pub topk: usize,
    /// Tokens travel as FP8 E4M3 with one f32 scale per 128 elements
    /// (dispatch only; combine stays BF16, as in DeepEP).
    pub fp8: bool,
    /// The scheme.
    pub mode: Mode,
    /// High-throughput mode: message slots of each channel's ring (its
    /// credits). Ignored in low-latency mode.
    pub ring_slots: usize,
    /// High-throughput mode: channels (DeepEP's), each with its own context,
    /// rings and head/tail credits, carrying a contiguous range of each
    /// rank's tokens. Ignored in low-latency mode.
    pub channels: usize,
}

impl Config {
    /// A low-latency configuration.
    pub fn low_latency(
        hidden: usize,
        max_tokens_per_rank: usize,
        num_experts: usize,
        topk: usize,
    ) -> Self {
        Self {
            hidden,
            max_tokens_per_rank,
            num_experts,
            topk,
            fp8: false,
            mode: Mode::LowLatency,
            ring_slots: 0,
            channels: 1,
        }
    }

    /// A high-throughput configuration with 2 channels of rings of 64
    /// slots.
    pub fn high_throughput(
        hidden: usize,
        max_tokens_per_rank: usize,
        num_experts: usize,
        topk: usize,
    ) -> Self {
        Self {
            mode: Mode::HighThroughput,
            ring_slots: 64,
            channels: 2,
            ..Self::low_latency(hidden, max_tokens_per_rank, num_experts, topk)
        }
    }

    /// This configuration with the channel count CUDA ranks use by default
    /// in high-throughput mode: [`CUDA_HT_CHANNELS`], bounded by `sms` (the
    /// streaming multiprocessors a rank's kernels may use: a channel is one
    /// block that polls for the whole step, so each gets an SM of its own)
    /// and by `max_tokens_per_rank` (a channel carries a contiguous range of
    /// each rank's tokens: more channels than tokens would carry nothing).
    /// Every rank must pass the same `sms` (the channel count is checked
    /// to agree). The rings grow with it: `channels × ranks × ring_slots`
    /// messages per ring window.
    #[must_use]
    pub fn with_cuda_channels(self, sms: usize) -> Self {
        Self {
            channels: CUDA_HT_CHANNELS
                .min(sms)
                .min(self.max_tokens_per_rank)
                .max(1),
            ..self
        }
    }

    /// Checks the configuration for a job of `nranks` ranks.
    pub fn validate(&self, rank: usize, nranks: usize) -> Result<(), EpError> {
        let bad = |field, value, why| {
            Err(EpError::Config {
                rank,
                field,
                value,
                why,
            })
        };
        if self.hidden == 0 || !self.hidden.is_multiple_of(8) {
            return bad("hidden", self.hidden, "must be a positive multiple of 8");
        }
        // The limits below keep every size a kernel takes in a u32 (a
        // message is under 2^26 bytes) and a top-k slot within the 20 bits
        // the device-side input check keys it by.
        if self.hidden > MAX_HIDDEN {
            return bad("hidden", self.hidden, "must be at most 2^24");
        }
        if self.fp8 && !self.hidden.is_multiple_of(FP8_BLOCK) {
            return bad(
                "hidden",
                self.hidden,
                "FP8 needs a multiple of 128 (one scale per 128 elements)",
            );
        }
        if self.max_tokens_per_rank == 0 || self.max_tokens_per_rank > MAX_TOKENS_PER_RANK {
            return bad(
                "max_tokens_per_rank",
                self.max_tokens_per_rank,
                "must be positive and below 2^31",
            );
        }
        if self.num_experts > MAX_EXPERTS {
            return bad("num_experts", self.num_experts, "must be at most 2^24");
        }
        if self.num_experts == 0 || !self.num_experts.is_multiple_of(nranks) {
            return bad(
                "num_experts",
                self.num_experts,
                "must be a positive multiple of the rank count",
            );
        }
        if self.topk == 0 || self.topk > self.num_experts {
            return bad("topk", self.topk, "must be in 1..=num_experts");
        }
        if self.topk > MAX_TOPK {
            return bad("topk", self.topk, "must be at most 2^16");
        }
        if self.mode == Mode::HighThroughput && self.ring_slots == 0 {
            return bad("ring_slots", self.ring_slots, "must be positive");
        }
        if self.mode == Mode::HighThroughput && !(1..=64).contains(&self.channels) {
            return bad("channels", self.channels, "must be in 1..=64");
        }
        Ok(())
    }

    /// Experts per rank.
    pub fn local_experts(&self, nranks: usize) -> usize {
        self.num_experts / nranks
    }

    /// Bytes of one token's payload: BF16 `2 * hidden`, FP8 `hidden` plus
    /// one f32 scale per 128 elements.
    pub fn payload_bytes(&self) -> usize {
        if self.fp8 {
            self.hidden + self.hidden / FP8_BLOCK * 4
        } else {
            2 * self.hidden
        }
    }

    /// Bytes of one dispatch message: the payload, then the source token
    /// index (u32), the token's top-k expert ids (i32 each) and weights (f32
    /// each), padded to 16 bytes.
    pub fn msg_bytes(&self) -> usize {
        (self.payload_bytes() + 4 + 8 * self.topk).next_multiple_of(16)
    }

    /// The fields agreement is checked on, in a fixed order.
    pub(crate) fn fields(&self) -> [(&'static str, u64); 8] {
        [
            ("hidden", self.hidden as u64),
            ("max_tokens_per_rank", self.max_tokens_per_rank as u64),
            ("num_experts", self.num_experts as u64),
            ("topk", self.topk as u64),
            ("fp8", u64::from(self.fp8)),
            ("mode", u64::from(self.mode == Mode::HighThroughput)),
            ("ring_slots", self.ring_slots as u64),
            ("channels", self.channels as u64),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_configurations_name_the_field() {
        let ok = Config::low_latency(256, 16, 8, 2);
        assert!(ok.validate(0, 4).is_ok());
        for (c, field) in [
            (Config { hidden: 0, ..ok }, "hidden"),
            (
                Config {
                    num_experts: 6,
                    ..ok
                },
                "num_experts",
            ),
            (Config { topk: 9, ..ok }, "topk"),
            (
                Config {
                    max_tokens_per_rank: 0,
                    ..ok
                },
                "max_tokens_per_rank",
            ),
            (
                Config {
                    fp8: true,
                    hidden: 200,
                    ..ok
                },
                "hidden",
            ),
        ] {
            let e = c.validate(1, 4).unwrap_err().to_string();
            assert!(e.contains(field) && e.starts_with("rank 1"), "{e}");
        }
    }

    /// Sizes a kernel takes as u32, and top-k slots keyed by 20 bits on
    /// the GPU, are bounded: every size the CUDA kernels receive fits.
    #[test]
    fn sizes_beyond_what_the_kernels_take_are_refused() {
        let ok = Config::low_latency(MAX_HIDDEN, 16, MAX_EXPERTS, MAX_TOPK);
        assert!(ok.validate(0, 4).is_ok());
        assert!(u32::try_from(ok.msg_bytes()).is_ok());
        for (c, field) in [
            (
                Config {
                    hidden: MAX_HIDDEN + 8,
                    ..ok
                },
                "hidden",
            ),
            (
                Config {
                    topk: MAX_TOPK + 1,
                    ..ok
                },
                "topk",
            ),
            (
                Config {
                    num_experts: MAX_EXPERTS + 4,
                    ..ok
                },
                "num_experts",
            ),
        ] {
            let e = c.validate(2, 4).unwrap_err().to_string();
            assert!(e.contains(field) && e.contains("at most"), "{e}");
        }
    }

    #[test]
    fn cuda_channels_are_bounded_by_sms_and_tokens() {
        let c = Config::high_throughput(7168, 4096, 64, 8);
        assert_eq!(c.channels, 2, "the CPU ranks' default");
        assert_eq!(c.with_cuda_channels(132).channels, CUDA_HT_CHANNELS);
        assert_eq!(c.with_cuda_channels(8).channels, 8);
        assert_eq!(c.with_cuda_channels(0).channels, 1);
        let few = Config::high_throughput(7168, 5, 64, 8);
        assert_eq!(few.with_cuda_channels(132).channels, 5);
        let d = c.with_cuda_channels(132);
        assert_eq!(Config { channels: 2, ..d }, c, "nothing else changes");
        assert!(d.validate(0, 2).is_ok());
    }

    #[test]
    fn message_sizes_follow_deepeps_accounting() {
        let c = Config::low_latency(7168, 128, 256, 8);
        assert_eq!(c.payload_bytes(), 2 * 7168);
        let f = Config { fp8: true, ..c };
        assert_eq!(f.payload_bytes(), 7168 + 7168 / 128 * 4);
        assert_eq!(c.msg_bytes() % 16, 0);
        assert!(c.msg_bytes() >= c.payload_bytes() + 4 + 64);
    }
}
