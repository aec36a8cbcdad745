//! The proxy descriptor: one 64-byte cache line, eight little-endian qwords,
//! each carrying the ring lap's phase in bit 63.
//!
//! NCCL 2.28 used 64 bytes published by a flag; NCCL 2.30 moved to 128 bytes
//! with a valid bit in every qword, because a GPU's 16-byte stores to host
//! memory may land in any order. This format keeps the per-qword valid bit
//! (no fence between payload and flag, no torn reads) and fits one cache line:
//! the peer and context are implied by the ring, so they are not stored.
//! Because the bit is the lap's phase, slots never need clearing.
//!
//! | qword | bits 62..0 |
//! | --- | --- |
//! | 0 | `[62:59]` opcode, `[55:48]` flags, `[47:0]` byte count |
//! | 1 | `[61:31]` source window, `[30:0]` destination window (get: local, remote) |
//! | 2 | destination offset (get: remote offset) |
//! | 3 | source offset (get: local offset); inline value bits 62..0 |
//! | 4 | `[61:31]` counter slot, `[30:0]` signal window |
//! | 5 | signal offset |
//! | 6 | signal amount |
//! | 7 | ring sequence number (checked by the consumer) |
//!
//! Flags: 0x01 signal, 0x02 strong, 0x04 counter, 0x08 inline data, 0x10
//! bit 63 of the inline value, 0x20 bit 63 of the signal amount (signals are
//! 64-bit on every backend; the phase bit takes bit 63 of qword 6).

/// Bytes in a descriptor.
pub const DESC_BYTES: usize = 64;
/// Qwords in a descriptor.
pub const DESC_QWORDS: usize = 8;
const PHASE: u64 = 1 << 63;
const LOW63: u64 = PHASE - 1;
/// Largest encodable window id, counter slot (31 bits).
pub const MAX_ID: u32 = (1 << 31) - 1;
/// Largest byte count (48 bits).
pub const MAX_BYTES: u64 = (1 << 48) - 1;
/// Largest offset (63 bits). Signal amounts and inline values carry their
/// bit 63 in a flag, so any u64 fits.
pub const MAX_FIELD: u64 = LOW63;

const F_SIGNAL: u64 = 0x01;
const F_STRONG: u64 = 0x02;
const F_COUNTER: u64 = 0x04;
const F_INLINE: u64 = 0x08;
const F_INLINE_TOP: u64 = 0x10;
const F_SIGNAL_TOP: u64 = 0x20;

/// What a descriptor asks the proxy to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Write to the peer (with an optional signal and counter).
    Put = 1,
    /// Read from the peer.
    Get = 2,
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Put => "put",
            Self::Get => "get",
        })
    }
}

/// A signal update carried by a put.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sig {
    /// The signal window.
    pub window: u32,
    /// Byte offset of the 8-byte slot in the peer's part.
    pub offset: u64,
    /// The amount added (any u64; wraps).
    pub add: u64,
    /// Every earlier put of the ring is visible before the signal.
    pub strong: bool,
}

/// A decoded descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Desc {
    /// The operation.
    pub op: Op,
    /// Bytes moved (48 bits).
    pub bytes: u64,
    /// Put: destination window at the peer. Get: remote window.
    pub dst_window: u32,
    /// Put: destination offset at the peer. Get: remote offset.
    pub dst_offset: u64,
    /// Put: source window here. Get: local destination window.
    pub src_window: u32,
    /// Put: source offset here. Get: local destination offset.
    pub src_offset: u64,
    /// Put: data carried in the descriptor instead of a source window.
    pub inline: Option<u64>,
    /// Put: the signal applied after the data.
    pub signal: Option<Sig>,
    /// The local counter slot bumped once the operation completed locally.
    pub counter: Option<u32>,
}

/// Why a descriptor cannot be encoded (checked before reserving a slot).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EncodeError {
    /// A field exceeds its width.
    #[error("{what} {value} does not fit the descriptor (largest {max})")]
    TooLarge {
        /// The field.
        what: &'static str,
        /// Its value.
        value: u64,
        /// The largest value it may hold.
        max: u64,
    },
}

fn fit(what: &'static str, value: u64, max: u64) -> Result<u64, EncodeError> {
    if value > max {
        Err(EncodeError::TooLarge { what, value, max })
    } else {
        Ok(value)
    }
}

/// Which phase bit slot `seq` carries in a ring of `2^log2` entries: 1 on
/// the first lap, so zeroed memory is never mistaken for a descriptor.
pub fn phase_of(seq: u64, log2: u32) -> u64 {
    ((seq >> log2) & 1) ^ 1
}

impl Desc {
    /// Checks that every field fits.
    pub fn validate(&self) -> Result<(), EncodeError> {
        fit("byte count", self.bytes, MAX_BYTES)?;
        fit(
            "destination window",
            u64::from(self.dst_window),
            u64::from(MAX_ID),
        )?;
        fit(
            "source window",
            u64::from(self.src_window),
            u64::from(MAX_ID),
        )?;
        fit("destination offset", self.dst_offset, MAX_FIELD)?;
        fit("source offset", self.src_offset, MAX_FIELD)?;
        if let Some(s) = &self.signal {
            fit("signal window", u64::from(s.window), u64::from(MAX_ID))?;
            fit("signal offset", s.offset, MAX_FIELD)?;
        }
        if let Some(c) = self.counter {
            fit("counter slot", u64::from(c), u64::from(MAX_ID))?;
        }
        Ok(())
    }

    /// The eight qwords for ring position `seq` (phase bits included).
    /// Call [`Desc::validate`] first; out-of-range fields are truncated.
    pub fn encode(&self, seq: u64, log2: u32) -> [u64; DESC_QWORDS] {
        let mut flags = 0;
        let mut q3 = self.src_offset & LOW63;
        if let Some(v) = self.inline {
            flags |= F_INLINE;
            if v & PHASE != 0 {
                flags |= F_INLINE_TOP;
            }
            q3 = v & LOW63;
        }
        let (mut q4, mut q5, mut q6) = (0, 0, 0);
        if let Some(s) = &self.signal {
            flags |= F_SIGNAL;
            if s.strong {
                flags |= F_STRONG;
            }
            q4 |= u64::from(s.window) & u64::from(MAX_ID);
            q5 = s.offset & LOW63;
            if s.add & PHASE != 0 {
                flags |= F_SIGNAL_TOP;
            }
            q6 = s.add & LOW63;
        }
        if let Some(c) = self.counter {
            flags |= F_COUNTER;
            q4 |= (u64::from(c) & u64::from(MAX_ID)) << 31;
        }
        let q0 = ((self.op as u64) << 59) | (flags << 48) | (self.bytes & MAX_BYTES);
        let q1 = ((u64::from(self.src_window) & u64::from(MAX_ID)) << 31)
            | (u64::from(self.dst_window) & u64::from(MAX_ID));
        let p = phase_of(seq, log2) << 63;
        [
            q0 | p,
            q1 | p,
            (self.dst_offset & LOW63) | p,
            q3 | p,
            q4 | p,
            q5 | p,
            q6 | p,
            (seq & LOW63) | p,
        ]
    }
}

/// What the consumer finds at a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// Not (completely) written yet.
    Pending,
    /// A complete descriptor.
    Ready(Desc),
}

/// Why a fully published descriptor is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// Qword 7 names another sequence number.
    #[error("descriptor at sequence {seq} carries sequence {found}")]
    WrongSequence {
        /// The position read.
        seq: u64,
        /// The sequence number found (bits 62..0).
        found: u64,
    },
    /// An opcode that is neither put nor get.
    #[error("descriptor at sequence {seq} has unknown opcode {op}")]
    BadOp {
        /// The position read.
        seq: u64,
        /// The opcode found.
        op: u64,
    },
    /// Unknown or inconsistent flags.
    #[error("descriptor at sequence {seq} has unknown flags {flags:#x}")]
    BadFlags {
        /// The position read.
        seq: u64,
        /// The flags found.
        flags: u64,
    },
}

/// Decodes the qwords at ring position `seq`: `Pending` unless every qword
/// carries this lap's phase.
pub fn decode(q: &[u64; DESC_QWORDS], seq: u64, log2: u32) -> Result<Slot, DecodeError> {
    let p = phase_of(seq, log2);
    if q.iter().any(|w| w >> 63 != p) {
        return Ok(Slot::Pending);
    }
    let w: [u64; DESC_QWORDS] = q.map(|w| w & LOW63);
    if w[7] != seq & LOW63 {
        return Err(DecodeError::WrongSequence { seq, found: w[7] });
    }
    let op = match w[0] >> 59 {
        1 => Op::Put,
        2 => Op::Get,
        op => return Err(DecodeError::BadOp { seq, op }),
    };
    let flags = (w[0] >> 48) & 0xff;
    if flags & !(F_SIGNAL | F_STRONG | F_COUNTER | F_INLINE | F_INLINE_TOP | F_SIGNAL_TOP) != 0
        || (w[0] >> 56) & 0x7 != 0
        || (flags & F_SIGNAL_TOP != 0 && flags & F_SIGNAL == 0)
    {
        return Err(DecodeError::BadFlags { seq, flags });
    }
    let inline =
        (flags & F_INLINE != 0).then(|| w[3] | if flags & F_INLINE_TOP != 0 { PHASE } else { 0 });
    Ok(Slot::Ready(Desc {
        op,
        bytes: w[0] & MAX_BYTES,
        dst_window: (w[1] & u64::from(MAX_ID)) as u32,
        src_window: ((w[1] >> 31) & u64::from(MAX_ID)) as u32,
        dst_offset: w[2],
        src_offset: if inline.is_some() { 0 } else { w[3] },
        inline,
        signal: (flags & F_SIGNAL != 0).then(|| Sig {
            window: (w[4] & u64::from(MAX_ID)) as u32,
            offset: w[5],
            add: w[6] | if flags & F_SIGNAL_TOP != 0 { PHASE } else { 0 },
            strong: flags & F_STRONG != 0,
        }),
        counter: (flags & F_COUNTER != 0).then(|| ((w[4] >> 31) & u64::from(MAX_ID)) as u32),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn any_desc() -> impl Strategy<Value = Desc> {
        (
            any::<bool>(),
            0..=MAX_BYTES,
            0..=MAX_ID,
            0..=MAX_FIELD,
            0..=MAX_ID,
            0..=MAX_FIELD,
            proptest::option::of(any::<u64>()),
            proptest::option::of((0..=MAX_ID, 0..=MAX_FIELD, any::<u64>(), any::<bool>())),
            proptest::option::of(0..=MAX_ID),
        )
            .prop_map(
                |(get, bytes, dw, doff, sw, soff, inline, sig, counter)| Desc {
                    op: if get { Op::Get } else { Op::Put },
                    bytes,
                    dst_window: dw,
                    dst_offset: doff,
                    src_window: sw,
                    src_offset: if inline.is_some() { 0 } else { soff },
                    inline,
                    signal: sig.map(|(window, offset, add, strong)| Sig {
                        window,
                        offset,
                        add,
                        strong,
                    }),
                    counter,
                },
            )
    }

    proptest! {
        #[test]
        fn roundtrip_at_any_sequence(d in any_desc(), seq in any::<u64>(), log2 in 0u32..20) {
            prop_assert!(d.validate().is_ok());
            let q = d.encode(seq, log2);
            prop_assert_eq!(decode(&q, seq, log2), Ok(Slot::Ready(d)));
            // The same bytes are stale one lap later and one lap earlier.
            let next = seq.wrapping_add(1 << log2);
            prop_assert_eq!(decode(&q, next, log2), Ok(Slot::Pending));
        }

        /// A descriptor with any subset of qwords still from the previous lap
        /// is pending, never half-read.
        #[test]
        fn partially_written_is_pending(d in any_desc(), seq in (1u64 << 10)..u64::MAX, log2 in 0u32..10, torn in 1u8..=255) {
            let new = d.encode(seq, log2);
            let old = d.encode(seq - (1 << log2), log2);
            let mut q = new;
            for i in 0..8 {
                if torn & (1 << i) != 0 {
                    q[i] = old[i];
                }
            }
            prop_assert_eq!(decode(&q, seq, log2), Ok(Slot::Pending));
        }

        #[test]
        fn zeroed_memory_is_pending_on_the_first_lap(seq in 0u64..1024) {
            prop_assert_eq!(decode(&[0; 8], seq, 10), Ok(Slot::Pending));
        }
    }

    #[test]
    fn golden_put_with_signal_and_counter() {
        let d = Desc {
            op: Op::Put,
            bytes: 4096,
            dst_window: 3,
            dst_offset: 0x100,
            src_window: 2,
            src_offset: 0x40,
            inline: None,
            signal: Some(Sig {
                window: 1,
                offset: 0x18,
                add: 1,
                strong: true,
            }),
            counter: Some(5),
        };
        // Sequence 5 of a 4-entry ring: lap 1, phase 0.
        let q = d.encode(5, 2);
        assert_eq!(
            q,
            [
                0x0807_0000_0000_1000,
                0x0000_0001_0000_0003,
                0x0000_0000_0000_0100,
                0x0000_0000_0000_0040,
                0x0000_0002_8000_0001,
                0x0000_0000_0000_0018,
                0x0000_0000_0000_0001,
                0x0000_0000_0000_0005,
            ]
        );
        // Sequence 1: lap 0, phase 1 in every qword.
        let q = d.encode(1, 2);
        assert!(q.iter().all(|w| w >> 63 == 1));
    }

    #[test]
    fn golden_inline_value_with_top_bit() {
        let d = Desc {
            op: Op::Put,
            bytes: 8,
            dst_window: 7,
            dst_offset: 8,
            src_window: 0,
            src_offset: 0,
            inline: Some(0x8000_0000_0000_00ff),
            signal: None,
            counter: None,
        };
        let q = d.encode(0, 4);
        assert_eq!(q[0], 0x8818_0000_0000_0008);
        assert_eq!(q[3], 0x8000_0000_0000_00ff);
        assert_eq!(decode(&q, 0, 4), Ok(Slot::Ready(d)));
    }

    #[test]
    fn oversize_fields_are_refused_before_encoding() {
        let mut d = Desc {
            op: Op::Put,
            bytes: MAX_BYTES + 1,
            dst_window: 0,
            dst_offset: 0,
            src_window: 0,
            src_offset: 0,
            inline: None,
            signal: None,
            counter: None,
        };
        assert!(matches!(
            d.validate(),
            Err(EncodeError::TooLarge {
                what: "byte count",
                ..
            })
        ));
        d.bytes = 1;
        d.signal = Some(Sig {
            window: 0,
            offset: 1 << 63,
            add: 1,
            strong: false,
        });
        assert!(matches!(
            d.validate(),
            Err(EncodeError::TooLarge {
                what: "signal offset",
                ..
            })
        ));
    }

    /// Signals are 64-bit: an amount with bit 63 set travels in qword 6's
    /// low 63 bits plus flag 0x20, the way an inline value's bit 63 does.
    /// Added with the flag; every earlier vector is unchanged, since no
    /// amount the old format accepted sets it.
    #[test]
    fn golden_signal_amount_with_top_bit() {
        let d = Desc {
            op: Op::Put,
            bytes: 0,
            dst_window: 1,
            dst_offset: 0,
            src_window: 0,
            src_offset: 0,
            inline: None,
            signal: Some(Sig {
                window: 1,
                offset: 0x18,
                add: (1 << 63) + 5,
                strong: true,
            }),
            counter: None,
        };
        assert_eq!(d.validate(), Ok(()));
        // Sequence 0 of a 4-entry ring: lap 0, phase 1 in bit 63.
        let q = d.encode(0, 2);
        assert_eq!(
            q,
            [
                // Put, flags 0x23 (signal, strong, amount bit 63), 0 bytes.
                0x8823_0000_0000_0000,
                // Source window 0, destination window 1.
                0x8000_0000_0000_0001,
                0x8000_0000_0000_0000,
                0x8000_0000_0000_0000,
                // Signal window 1, no counter.
                0x8000_0000_0000_0001,
                0x8000_0000_0000_0018,
                // Amount bits 62..0: 5.
                0x8000_0000_0000_0005,
                0x8000_0000_0000_0000,
            ]
        );
        assert_eq!(decode(&q, 0, 2), Ok(Slot::Ready(d)));
        // The flag without a signal is a corrupt descriptor.
        let mut bad = q;
        bad[0] &= !(0x01 << 48);
        assert!(matches!(
            decode(&bad, 0, 2),
            Err(DecodeError::BadFlags { .. })
        ));
    }

    #[test]
    fn corrupted_descriptors_are_errors() {
        let d = Desc {
            op: Op::Get,
            bytes: 1,
            dst_window: 0,
            dst_offset: 0,
            src_window: 0,
            src_offset: 0,
            inline: None,
            signal: None,
            counter: None,
        };
        let mut q = d.encode(9, 3);
        q[7] = (q[7] & PHASE) | 8;
        assert_eq!(
            decode(&q, 9, 3),
            Err(DecodeError::WrongSequence { seq: 9, found: 8 })
        );
        let mut q = d.encode(9, 3);
        q[0] = (q[0] & !(0xf << 59)) | (7 << 59);
        assert_eq!(decode(&q, 9, 3), Err(DecodeError::BadOp { seq: 9, op: 7 }));
    }
}
