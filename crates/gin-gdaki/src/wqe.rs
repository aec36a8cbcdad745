//! mlx5 send work-queue entries: pure encode / decode, big-endian, one
//! 64-byte basic block each (every WQE gin-rs builds fits in one).
//!
//! Facts from rdma-core's `providers/mlx5/mlx5dv.h` (segment layouts,
//! opcodes, control flags) and NCCL's vendored DOCA GPUNetIO headers (the
//! WAIT opcode 0x0f and its segment); see `docs/gdaki.md`.
//!
//! | segment | bytes | fields (big-endian) |
//! | --- | --- | --- |
//! | control | 16 | `opmod<<24 \| wqe_index<<8 \| opcode`, `qpn<<8 \| ds`, signature, 2 reserved, `fm_ce_se`, imm |
//! | remote address | 16 | raddr (64), rkey (32), reserved |
//! | data | 16 | byte count (32, bit 31 clear), lkey (32), addr (64) |
//! | inline | 4 + n | `n \| 0x8000_0000`, then the bytes, padded to 16 |
//! | atomic | 16 | swap/add (64), compare (64) |
//! | wait | 16 | 8 reserved, max_index (32), qpn_cqn (32) |

/// Bytes in a basic block.
pub const BB: usize = 64;
/// Bytes in a DS unit.
pub const DS: usize = 16;

/// Opcode: no operation.
pub const OP_NOP: u8 = 0x00;
/// Opcode: RDMA write.
pub const OP_RDMA_WRITE: u8 = 0x08;
/// Opcode: WAIT on another CQ (DOCA GPUNetIO).
pub const OP_WAIT: u8 = 0x0f;
/// Opcode: RDMA read.
pub const OP_RDMA_READ: u8 = 0x10;
/// Opcode: 8-byte atomic compare-and-swap.
pub const OP_ATOMIC_CS: u8 = 0x11;
/// Opcode: 8-byte atomic fetch-and-add.
pub const OP_ATOMIC_FA: u8 = 0x12;

/// `fm_ce_se`: always generate a CQE.
pub const CQ_UPDATE: u8 = 2 << 2;
/// `fm_ce_se`: solicited event.
pub const SOLICITED: u8 = 1 << 1;
/// Fence mode (bits 7:5 of `fm_ce_se`): none.
pub const FM_NONE: u8 = 0;
/// Fence mode: initiator small fence.
pub const FM_INITIATOR_SMALL: u8 = 1 << 5;
/// Fence mode: fence (wait for earlier reads and atomics).
pub const FM_FENCE: u8 = 2 << 5;
/// Fence mode: strong ordering (after every earlier WQE of the QP).
pub const FM_STRONG_ORDERING: u8 = 3 << 5;
/// Fence mode: fence and initiator small fence.
pub const FM_FENCE_AND_SMALL: u8 = 4 << 5;
/// Inline segment marker in the byte-count word.
pub const INLINE_SEG: u32 = 0x8000_0000;
/// Largest inline payload that keeps a WQE in one basic block.
pub const MAX_INLINE: usize = 28;
/// Largest transfer one WQE carries; larger puts are split (as DOCA does at 1 GiB).
pub const MAX_TRANSFER: u64 = 1 << 30;

/// A memory reference: address and key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemRef {
    /// The address, as the memory's owner names it.
    pub addr: u64,
    /// The memory key (lkey or rkey).
    pub key: u32,
}

/// The work requests gin-rs builds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Nothing (completes at once).
    Nop,
    /// Write `len` bytes from `local` to `remote`.
    Write {
        /// Where the bytes go.
        remote: MemRef,
        /// Where they come from.
        local: MemRef,
        /// Bytes.
        len: u32,
    },
    /// Write bytes carried in the WQE.
    WriteInline {
        /// Where the bytes go.
        remote: MemRef,
        /// The bytes (at most [`MAX_INLINE`]).
        data: Vec<u8>,
    },
    /// Read `len` bytes from `remote` into `local`.
    Read {
        /// Where the bytes come from.
        remote: MemRef,
        /// Where they land.
        local: MemRef,
        /// Bytes.
        len: u32,
    },
    /// 8-byte fetch-and-add at `remote`; the old value lands at `result`.
    FetchAdd {
        /// The 8 bytes added to.
        remote: MemRef,
        /// What is added.
        add: u64,
        /// Where the old value lands (big-endian).
        result: MemRef,
    },
    /// 8-byte compare-and-swap at `remote`; the old value lands at `result`.
    CompareSwap {
        /// The 8 bytes compared and swapped.
        remote: MemRef,
        /// The value expected there.
        compare: u64,
        /// The value stored if it is there.
        swap: u64,
        /// Where the old value lands (big-endian).
        result: MemRef,
    },
    /// Stall this queue until completion queue `cqn` has produced the CQE of
    /// WQE index `max_index` (a 16-bit index zero-extended).
    Wait {
        /// The awaited WQE index (16 bits, zero-extended).
        max_index: u32,
        /// The CQ whose completion is awaited.
        cqn: u32,
    },
}

/// A decoded WQE.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wqe {
    /// The operation.
    pub op: Op,
    /// The 16-bit WQE index the control segment carries.
    pub index: u16,
    /// The QP number it carries.
    pub qpn: u32,
    /// Fence mode, completion and solicited-event flags.
    pub fm_ce_se: u8,
}

fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_be_bytes());
}
fn put64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_be_bytes());
}
fn get32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn get64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn raddr(b: &mut [u8], at: usize, m: MemRef) {
    put64(b, at, m.addr);
    put32(b, at + 8, m.key);
}

fn data(b: &mut [u8], at: usize, m: MemRef, len: u32) {
    put32(b, at, len & !INLINE_SEG);
    put32(b, at + 4, m.key);
    put64(b, at + 8, m.addr);
}

/// Why a WQE cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// An inline payload longer than [`MAX_INLINE`] bytes.
    #[error("inline payload of {0} bytes exceeds {MAX_INLINE}")]
    InlineTooLarge(usize),
    #[error(
        "transfer of {0} bytes exceeds the {MAX_TRANSFER}-byte WQE limit (bit 31 is the inline flag)"
    )]
    /// A transfer longer than [`MAX_TRANSFER`] bytes.
    TooLong(u64),
    /// A QP number wider than 24 bits.
    #[error("QP number {0:#x} does not fit 24 bits")]
    Qpn(u32),
}

/// Encodes one WQE into a basic block. `index` is the 16-bit WQE index.
pub fn encode(op: &Op, index: u16, qpn: u32, fm_ce_se: u8) -> Result<[u8; BB], BuildError> {
    if qpn >> 24 != 0 {
        return Err(BuildError::Qpn(qpn));
    }
    let mut b = [0u8; BB];
    let (opcode, ds) = match op {
        Op::Nop => (OP_NOP, 1),
        Op::Write { remote, local, len } | Op::Read { remote, local, len } => {
            if u64::from(*len) > MAX_TRANSFER {
                return Err(BuildError::TooLong(u64::from(*len)));
            }
            raddr(&mut b, 16, *remote);
            data(&mut b, 32, *local, *len);
            (
                if matches!(op, Op::Write { .. }) {
                    OP_RDMA_WRITE
                } else {
                    OP_RDMA_READ
                },
                3,
            )
        }
        Op::WriteInline {
            remote,
            data: bytes,
        } => {
            if bytes.len() > MAX_INLINE {
                return Err(BuildError::InlineTooLarge(bytes.len()));
            }
            raddr(&mut b, 16, *remote);
            put32(&mut b, 32, bytes.len() as u32 | INLINE_SEG);
            b[36..36 + bytes.len()].copy_from_slice(bytes);
            (OP_RDMA_WRITE, 2 + (4 + bytes.len()).div_ceil(DS) as u8)
        }
        Op::FetchAdd {
            remote,
            add,
            result,
        } => {
            raddr(&mut b, 16, *remote);
            put64(&mut b, 32, *add);
            put64(&mut b, 40, *add);
            data(&mut b, 48, *result, 8);
            (OP_ATOMIC_FA, 4)
        }
        Op::CompareSwap {
            remote,
            compare,
            swap,
            result,
        } => {
            raddr(&mut b, 16, *remote);
            put64(&mut b, 32, *swap);
            put64(&mut b, 40, *compare);
            data(&mut b, 48, *result, 8);
            (OP_ATOMIC_CS, 4)
        }
        Op::Wait { max_index, cqn } => {
            put32(&mut b, 24, *max_index);
            put32(&mut b, 28, *cqn);
            (OP_WAIT, 2)
        }
    };
    put32(&mut b, 0, (u32::from(index) << 8) | u32::from(opcode));
    put32(&mut b, 4, (qpn << 8) | u32::from(ds));
    b[11] = fm_ce_se;
    Ok(b)
}

/// What the doorbell register receives: the first 8 bytes of a control
/// segment naming the new producer index and the queue.
pub fn doorbell(pi: u16, qpn: u32) -> u64 {
    (u64::from(u32::from(pi) << 8) << 32) | u64::from(qpn << 8)
}

/// Why a basic block is not a WQE gin-rs's NIC executes (a real NIC would
/// report most of these as a local QP operation error).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ParseError {
    /// An opcode this NIC does not execute.
    #[error("unsupported opcode {0:#04x}")]
    Opcode(u8),
    /// A DS count that does not match the opcode.
    #[error("opcode {opcode:#04x} with {ds} DS units (expected {want})")]
    Ds {
        /// The opcode.
        opcode: u8,
        /// The DS count found.
        ds: u8,
        /// The DS count expected.
        want: u8,
    },
    /// An opcode modifier other than 0.
    #[error("opmod {0:#04x} is not supported")]
    Opmod(u8),
    /// An inline segment where a pointer segment belongs, or the reverse.
    #[error("data segment of the wrong kind (inline flag {inline})")]
    SegmentKind {
        /// Whether the segment found was inline.
        inline: bool,
    },
    /// An inline length that does not fit the DS count.
    #[error("inline payload of {0} bytes does not fit its DS count")]
    InlineLength(u32),
}

/// Decodes a basic block written by a producer.
pub fn decode(b: &[u8; BB]) -> Result<Wqe, ParseError> {
    let w0 = get32(b, 0);
    let w1 = get32(b, 4);
    let opmod = (w0 >> 24) as u8;
    let index = (w0 >> 8) as u16;
    let opcode = w0 as u8;
    let qpn = w1 >> 8;
    let ds = (w1 & 0x3f) as u8;
    let fm_ce_se = b[11];
    if opmod != 0 {
        return Err(ParseError::Opmod(opmod));
    }
    let want = |w: u8| {
        if ds == w {
            Ok(())
        } else {
            Err(ParseError::Ds {
                opcode,
                ds,
                want: w,
            })
        }
    };
    let remote = || MemRef {
        addr: get64(b, 16),
        key: get32(b, 24),
    };
    let local = |at: usize| -> Result<(MemRef, u32), ParseError> {
        let bc = get32(b, at);
        if bc & INLINE_SEG != 0 {
            return Err(ParseError::SegmentKind { inline: true });
        }
        Ok((
            MemRef {
                addr: get64(b, at + 8),
                key: get32(b, at + 4),
            },
            bc,
        ))
    };
    let op = match opcode {
        OP_NOP => {
            // DOCA sends 1 DS, NVSHMEM 2: accept both.
            if ds != 1 && ds != 2 {
                return Err(ParseError::Ds {
                    opcode,
                    ds,
                    want: 1,
                });
            }
            Op::Nop
        }
        OP_RDMA_WRITE if get32(b, 32) & INLINE_SEG != 0 => {
            let n = get32(b, 32) & !INLINE_SEG;
            if n as usize > MAX_INLINE || 2 + (4 + n as usize).div_ceil(DS) != ds as usize {
                return Err(ParseError::InlineLength(n));
            }
            Op::WriteInline {
                remote: remote(),
                data: b[36..36 + n as usize].to_vec(),
            }
        }
        OP_RDMA_WRITE | OP_RDMA_READ => {
            want(3)?;
            let (l, len) = local(32)?;
            if opcode == OP_RDMA_WRITE {
                Op::Write {
                    remote: remote(),
                    local: l,
                    len,
                }
            } else {
                Op::Read {
                    remote: remote(),
                    local: l,
                    len,
                }
            }
        }
        OP_ATOMIC_FA | OP_ATOMIC_CS => {
            want(4)?;
            let (result, _) = local(48)?;
            if opcode == OP_ATOMIC_FA {
                Op::FetchAdd {
                    remote: remote(),
                    add: get64(b, 32),
                    result,
                }
            } else {
                Op::CompareSwap {
                    remote: remote(),
                    swap: get64(b, 32),
                    compare: get64(b, 40),
                    result,
                }
            }
        }
        OP_WAIT => {
            want(2)?;
            Op::Wait {
                max_index: get32(b, 24),
                cqn: get32(b, 28),
            }
        }
        other => return Err(ParseError::Opcode(other)),
    };
    Ok(Wqe {
        op,
        index,
        qpn,
        fm_ce_se,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hex(b: &[u8]) -> String {
        use std::fmt::Write as _;
        b.iter().fold(String::new(), |mut s, x| {
            let _ = write!(s, "{x:02x}");
            s
        })
    }

    /// Reviewed against mlx5dv.h: ctrl `opmod_idx_opcode` = idx<<8 | 0x08,
    /// `qpn_ds` = qpn<<8 | 3, fm_ce_se at byte 11 = CQ_UPDATE (0x08); raddr
    /// segment at 16; data segment at 32 (byte count, lkey, addr).
    #[test]
    fn golden_rdma_write() {
        let w = encode(
            &Op::Write {
                remote: MemRef {
                    addr: 0x1122_3344_5566_7788,
                    key: 0xaabb_ccdd,
                },
                local: MemRef {
                    addr: 0x0000_7f00_0000_1000,
                    key: 0x0102_0304,
                },
                len: 4096,
            },
            0x1234,
            0x00ab_cdef,
            CQ_UPDATE,
        )
        .unwrap();
        assert_eq!(
            hex(&w[..48]),
            "00123408abcdef0300000008000000001122334455667788aabbccdd000000000000100001020304\
             00007f0000001000"
        );
        assert!(w[48..].iter().all(|&x| x == 0));
    }

    /// ATOMIC_FA: atomic segment at 32 (add value twice, as DOCA writes it),
    /// data segment for the fetched value at 48; 4 DS; strong ordering fence.
    #[test]
    fn golden_fetch_add() {
        let w = encode(
            &Op::FetchAdd {
                remote: MemRef { addr: 0x10, key: 7 },
                add: 1,
                result: MemRef { addr: 0x20, key: 9 },
            },
            0xffff,
            5,
            CQ_UPDATE | FM_STRONG_ORDERING,
        )
        .unwrap();
        let want = [
            "00ffff12",
            "00000504",
            "00000068",
            "00000000", // ctrl: idx 0xffff, FA; qpn 5, 4 DS; CQ_UPDATE|strong
            "0000000000000010",
            "00000007",
            "00000000", // raddr seg
            "0000000000000001",
            "0000000000000001", // atomic seg: add, (add)
            "00000008",
            "00000009",
            "0000000000000020", // data seg: 8 bytes, lkey, addr
        ]
        .concat();
        assert_eq!(hex(&w), want);
    }

    /// Inline write of 8 bytes: header `0x80000008` at 32, data at 36,
    /// 2 + ceil(12/16) = 3 DS.
    #[test]
    fn golden_inline_and_wait_and_doorbell() {
        let w = encode(
            &Op::WriteInline {
                remote: MemRef { addr: 0x40, key: 3 },
                data: vec![1, 2, 3, 4, 5, 6, 7, 8],
            },
            2,
            1,
            CQ_UPDATE,
        )
        .unwrap();
        let want = [
            "00000208",
            "00000103",
            "00000008",
            "00000000", // ctrl: idx 2, write; qpn 1, 3 DS
            "0000000000000040",
            "00000003",
            "00000000", // raddr seg
            "80000008",
            "0102030405060708", // inline header, data
        ]
        .concat();
        assert_eq!(hex(&w[..44]), want);
        let w = encode(
            &Op::Wait {
                max_index: 0x1_0203,
                cqn: 0x42,
            },
            9,
            2,
            CQ_UPDATE,
        )
        .unwrap();
        assert_eq!(
            hex(&w[..32]),
            "0000090f00000202000000080000000000000000000000000001020300000042"
        );
        assert_eq!(doorbell(0x0102, 0x00ab_cdef), 0x0001_0200_abcd_ef00);
    }

    fn any_ref() -> impl Strategy<Value = MemRef> {
        (any::<u64>(), any::<u32>()).prop_map(|(addr, key)| MemRef { addr, key })
    }

    fn any_op() -> impl Strategy<Value = Op> {
        prop_oneof![
            Just(Op::Nop),
            (any_ref(), any_ref(), 0u32..(1 << 30)).prop_map(|(remote, local, len)| Op::Write {
                remote,
                local,
                len
            }),
            (any_ref(), any_ref(), 0u32..(1 << 30)).prop_map(|(remote, local, len)| Op::Read {
                remote,
                local,
                len
            }),
            (
                any_ref(),
                proptest::collection::vec(any::<u8>(), 0..=MAX_INLINE)
            )
                .prop_map(|(remote, data)| Op::WriteInline { remote, data }),
            (any_ref(), any::<u64>(), any_ref()).prop_map(|(remote, add, result)| Op::FetchAdd {
                remote,
                add,
                result
            }),
            (any_ref(), any::<u64>(), any::<u64>(), any_ref()).prop_map(
                |(remote, compare, swap, result)| Op::CompareSwap {
                    remote,
                    compare,
                    swap,
                    result
                }
            ),
            (any::<u16>(), 0u32..(1 << 24)).prop_map(|(i, cqn)| Op::Wait {
                max_index: u32::from(i),
                cqn
            }),
        ]
    }

    proptest! {
        #[test]
        fn encode_decode_roundtrip(op in any_op(), index in any::<u16>(), qpn in 0u32..(1 << 24), flags in any::<u8>()) {
            let b = encode(&op, index, qpn, flags).unwrap();
            let w = decode(&b).unwrap();
            prop_assert_eq!(w, Wqe { op, index, qpn, fm_ce_se: flags });
        }

        /// Arbitrary bytes never panic the parser.
        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), BB)) {
            let b: [u8; BB] = bytes.try_into().unwrap();
            let _ = decode(&b);
        }
    }

    #[test]
    fn malformed_wqes_are_named() {
        let mut b = encode(&Op::Nop, 0, 1, 0).unwrap();
        b[3] = 0x0a; // SEND: not executed by this NIC
        assert_eq!(decode(&b), Err(ParseError::Opcode(0x0a)));
        let mut b = encode(
            &Op::Write {
                remote: MemRef { addr: 0, key: 0 },
                local: MemRef { addr: 0, key: 0 },
                len: 1,
            },
            0,
            1,
            0,
        )
        .unwrap();
        b[7] = 5;
        assert_eq!(
            decode(&b),
            Err(ParseError::Ds {
                opcode: OP_RDMA_WRITE,
                ds: 5,
                want: 3
            })
        );
        b[7] = 3;
        b[0] = 1;
        assert_eq!(decode(&b), Err(ParseError::Opmod(1)));
        assert_eq!(
            encode(
                &Op::WriteInline {
                    remote: MemRef { addr: 0, key: 0 },
                    data: vec![0; 29]
                },
                0,
                1,
                0
            ),
            Err(BuildError::InlineTooLarge(29))
        );
        assert_eq!(
            encode(&Op::Nop, 0, 1 << 24, 0),
            Err(BuildError::Qpn(1 << 24))
        );
    }
}
