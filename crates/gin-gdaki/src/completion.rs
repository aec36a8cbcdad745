//! mlx5 64-byte completion queue entries: encode (the NIC), decode and the
//! owner-bit validity rule (the poller). Pure.
//!
//! | offset | field |
//! | --- | --- |
//! | 44 | byte count (BE32) |
//! | 54 | vendor error syndrome (error CQEs) |
//! | 55 | syndrome (error CQEs) |
//! | 56 | bits 31:24 send opcode of the completed WQE, 23:0 QP number (BE32) |
//! | 60 | WQE counter: index of the completed WQE's first block (BE16) |
//! | 62 | signature |
//! | 63 | `op_own`: CQE opcode in bits 7:4, owner in bit 0 |
//!
//! A CQE at consumer index `n` of a CQ of `2^k` entries is valid when its
//! opcode is not `INVALID` and its owner bit equals `(n >> k) & 1`. A fresh
//! CQ holds `op_own = 0xF0` everywhere (invalid, owner 0), as rdma-core
//! initialises it.

/// Bytes in a CQE.
pub const CQE_BYTES: usize = 64;
/// CQE opcode: a send-side completion.
pub const CQE_REQ: u8 = 0;
/// CQE opcode: a send-side error completion.
pub const CQE_REQ_ERR: u8 = 13;
/// CQE opcode: a receive-side error completion.
pub const CQE_RESP_ERR: u8 = 14;
/// CQE opcode: no CQE written here yet.
pub const CQE_INVALID: u8 = 15;
/// `op_own` of a never-written CQE.
pub const FRESH_OP_OWN: u8 = CQE_INVALID << 4;

/// Error syndromes (mlx5dv.h).
pub mod syndrome {
    /// Local length error.
    pub const LOCAL_LENGTH_ERR: u8 = 0x01;
    /// Local QP operation error: a malformed WQE, a doorbell record that cannot be believed.
    pub const LOCAL_QP_OP_ERR: u8 = 0x02;
    /// Local protection error: a local key or range the NIC refuses.
    pub const LOCAL_PROT_ERR: u8 = 0x04;
    /// Work request flushed in error: the QP was in the error state.
    pub const WR_FLUSH_ERR: u8 = 0x05;
    /// Bad response.
    pub const BAD_RESP_ERR: u8 = 0x10;
    /// Local access error.
    pub const LOCAL_ACCESS_ERR: u8 = 0x11;
    /// Remote invalid request: an unaligned atomic.
    pub const REMOTE_INVAL_REQ_ERR: u8 = 0x12;
    /// Remote access error: a remote key, range or access the NIC refuses.
    pub const REMOTE_ACCESS_ERR: u8 = 0x13;
    /// Remote operation error: an operation the target cannot do.
    pub const REMOTE_OP_ERR: u8 = 0x14;
    /// Transport retry counter exceeded: the peer did not answer.
    pub const TRANSPORT_RETRY_EXC_ERR: u8 = 0x15;
    /// Receiver-not-ready retry counter exceeded.
    pub const RNR_RETRY_EXC_ERR: u8 = 0x16;
    /// Remote aborted error.
    pub const REMOTE_ABORTED_ERR: u8 = 0x22;

    /// A human name for a syndrome.
    pub fn name(s: u8) -> &'static str {
        match s {
            LOCAL_LENGTH_ERR => "local length error",
            LOCAL_QP_OP_ERR => "local QP operation error",
            LOCAL_PROT_ERR => "local protection error",
            WR_FLUSH_ERR => "work request flushed in error",
            BAD_RESP_ERR => "bad response",
            LOCAL_ACCESS_ERR => "local access error",
            REMOTE_INVAL_REQ_ERR => "remote invalid request",
            REMOTE_ACCESS_ERR => "remote access error",
            REMOTE_OP_ERR => "remote operation error",
            TRANSPORT_RETRY_EXC_ERR => "transport retry counter exceeded",
            RNR_RETRY_EXC_ERR => "RNR retry counter exceeded",
            REMOTE_ABORTED_ERR => "remote aborted",
            _ => "general error",
        }
    }
}

/// A completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cqe {
    /// `CQE_REQ` or `CQE_REQ_ERR` for send completions.
    pub opcode: u8,
    /// The completed WQE's 16-bit index.
    pub wqe_counter: u16,
    /// The QP number (24 bits).
    pub qpn: u32,
    /// Send opcode of the completed WQE.
    pub send_opcode: u8,
    /// Bytes transferred.
    pub byte_cnt: u32,
    /// Error syndrome ([`syndrome`]; error CQEs).
    pub syndrome: u8,
    /// Vendor error syndrome (error CQEs).
    pub vendor_syndrome: u8,
}

/// The owner bit a valid CQE at consumer index `n` carries.
pub fn owner_of(n: u64, log2: u32) -> u8 {
    ((n >> log2) & 1) as u8
}

/// Whether the `op_own` byte found at consumer index `n` is a new CQE.
pub fn is_valid(op_own: u8, n: u64, log2: u32) -> bool {
    op_own >> 4 != CQE_INVALID && op_own & 1 == owner_of(n, log2)
}

impl Cqe {
    /// The 64 bytes the NIC writes for consumer index `n`.
    pub fn encode(&self, n: u64, log2: u32) -> [u8; CQE_BYTES] {
        let mut b = [0u8; CQE_BYTES];
        b[44..48].copy_from_slice(&self.byte_cnt.to_be_bytes());
        b[54] = self.vendor_syndrome;
        b[55] = self.syndrome;
        let w = (u32::from(self.send_opcode) << 24) | (self.qpn & 0x00ff_ffff);
        b[56..60].copy_from_slice(&w.to_be_bytes());
        b[60..62].copy_from_slice(&self.wqe_counter.to_be_bytes());
        b[63] = (self.opcode << 4) | owner_of(n, log2);
        b
    }

    /// Reads a CQE (validity is checked separately with [`is_valid`]).
    pub fn decode(b: &[u8; CQE_BYTES]) -> Self {
        let w = u32::from_be_bytes(b[56..60].try_into().expect("4 bytes"));
        Self {
            opcode: b[63] >> 4,
            wqe_counter: u16::from_be_bytes([b[60], b[61]]),
            qpn: w & 0x00ff_ffff,
            send_opcode: (w >> 24) as u8,
            byte_cnt: u32::from_be_bytes(b[44..48].try_into().expect("4 bytes")),
            syndrome: b[55],
            vendor_syndrome: b[54],
        }
    }

    /// Whether this completion reports an error.
    pub fn is_error(&self) -> bool {
        self.opcode == CQE_REQ_ERR || self.opcode == CQE_RESP_ERR
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn golden_success_and_error_cqes() {
        let ok = Cqe {
            opcode: CQE_REQ,
            wqe_counter: 0x0102,
            qpn: 0x00ab_cdef,
            send_opcode: 0x08,
            byte_cnt: 4096,
            syndrome: 0,
            vendor_syndrome: 0,
        };
        let b = ok.encode(0, 4);
        assert_eq!(&b[44..48], &[0, 0, 0x10, 0]);
        assert_eq!(
            &b[56..64],
            &[0x08, 0xab, 0xcd, 0xef, 0x01, 0x02, 0x00, 0x00]
        );
        // Second pass of a 16-entry CQ: owner 1.
        assert_eq!(ok.encode(16, 4)[63], 0x01);
        let err = Cqe {
            opcode: CQE_REQ_ERR,
            syndrome: syndrome::REMOTE_ACCESS_ERR,
            ..ok
        };
        let b = err.encode(3, 4);
        assert_eq!((b[55], b[63]), (0x13, 0xd0));
        assert_eq!(Cqe::decode(&b), err);
        assert!(Cqe::decode(&b).is_error());
    }

    proptest! {
        #[test]
        fn roundtrip(opcode in 0u8..15, wqe_counter in any::<u16>(), qpn in 0u32..(1 << 24), send_opcode in any::<u8>(),
                     byte_cnt in any::<u32>(), syndrome in any::<u8>(), vendor_syndrome in any::<u8>(), n in any::<u64>(), log2 in 0u32..24) {
            let c = Cqe { opcode, wqe_counter, qpn, send_opcode, byte_cnt, syndrome, vendor_syndrome };
            let b = c.encode(n, log2);
            prop_assert_eq!(Cqe::decode(&b), c);
            prop_assert!(is_valid(b[63], n, log2));
            // The same bytes are stale one pass later and one pass earlier.
            prop_assert!(!is_valid(b[63], n.wrapping_add(1 << log2), log2));
        }

        /// A fresh CQ is never valid on the first pass, whatever the index.
        #[test]
        fn fresh_cq_is_invalid(n in any::<u64>(), log2 in 0u32..24) {
            prop_assert!(!is_valid(FRESH_OP_OWN, n, log2));
        }
    }
}
