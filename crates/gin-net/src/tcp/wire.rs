//! The tcp transport's wire format: pure encode and decode, no sockets.
//! The table of fields is in the module documentation of [`super`].

pub(super) const REQ: usize = 64;
pub(super) const REP: usize = 24;
pub(super) const OP_PUT: u8 = 1;
pub(super) const OP_GET: u8 = 2;
pub(super) const OP_FADD: u8 = 3;
pub(super) const OP_CAS: u8 = 4;
pub(super) const OP_FENCE: u8 = 5;
pub(super) const FLAG_SIGNAL: u8 = 1;
pub(super) const REP_DATA: u8 = 1;
pub(super) const REP_VALUE: u8 = 2;
pub(super) const REP_ACK: u8 = 3;
pub(super) const REP_ERROR: u8 = 4;
/// No request moves more than this (a region is never larger).
pub(super) const MAX_LEN: u64 = 1 << 40;
/// Bytes copied at a time, on both sides.
pub(super) const CHUNK: usize = 1 << 20;
/// The greeting's magic number, after the job token.
pub(super) const HELLO_MAGIC: u32 = 0x4749_4e54; // "GINT"
/// Refused puts are answered under their sequence number with this bit set,
/// so they never collide with a pending request's id.
pub(super) const PUT_SEQ: u64 = 1 << 63;
/// Longest error message a reply carries.
pub(super) const MAX_ERROR: usize = 4096;

/// A request header.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Req {
    /// 1 put, 2 get, 3 fetch-add, 4 compare-swap, 5 fence.
    pub op: u8,
    /// Bit 0: the put carries a signal.
    pub flags: u8,
    /// The target region's key.
    pub key: u32,
    /// Offset in the region.
    pub off: u64,
    /// Bytes; a put's data follows the header.
    pub len: u64,
    /// The request id of answered operations.
    pub req: u64,
    /// The signal's region key.
    pub sig_key: u32,
    /// The signal's offset.
    pub sig_off: u64,
    /// Signal or fetch-add amount, compare-swap expected value.
    pub a: u64,
    /// Compare-swap desired value.
    pub b: u64,
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[i..i + 4]);
    u32::from_le_bytes(w)
}

fn u64_at(b: &[u8], i: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[i..i + 8]);
    u64::from_le_bytes(w)
}

impl Req {
    /// The header's bytes.
    pub fn encode(&self) -> [u8; REQ] {
        let mut b = [0u8; REQ];
        b[0] = self.op;
        b[1] = self.flags;
        b[4..8].copy_from_slice(&self.key.to_le_bytes());
        b[8..16].copy_from_slice(&self.off.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b[24..32].copy_from_slice(&self.req.to_le_bytes());
        b[32..36].copy_from_slice(&self.sig_key.to_le_bytes());
        b[40..48].copy_from_slice(&self.sig_off.to_le_bytes());
        b[48..56].copy_from_slice(&self.a.to_le_bytes());
        b[56..64].copy_from_slice(&self.b.to_le_bytes());
        b
    }

    /// Reads a header.
    pub fn decode(b: &[u8; REQ]) -> Self {
        Self {
            op: b[0],
            flags: b[1],
            key: u32_at(b, 4),
            off: u64_at(b, 8),
            len: u64_at(b, 16),
            req: u64_at(b, 24),
            sig_key: u32_at(b, 32),
            sig_off: u64_at(b, 40),
            a: u64_at(b, 48),
            b: u64_at(b, 56),
        }
    }
}

/// A reply header.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Reply {
    /// 1 data, 2 value, 3 ack, 4 error.
    pub kind: u8,
    /// Bytes of payload after the header.
    pub len: u32,
    /// The request answered (a refused put: its sequence number | PUT_SEQ).
    pub req: u64,
    /// An atomic's old value.
    pub value: u64,
}

impl Reply {
    pub fn encode(&self) -> [u8; REP] {
        let mut b = [0u8; REP];
        b[0] = self.kind;
        b[4..8].copy_from_slice(&self.len.to_le_bytes());
        b[8..16].copy_from_slice(&self.req.to_le_bytes());
        b[16..24].copy_from_slice(&self.value.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; REP]) -> Self {
        Self {
            kind: b[0],
            len: u32_at(b, 4),
            req: u64_at(b, 8),
            value: u64_at(b, 16),
        }
    }
}

/// The greeting a connecting rank sends: the job token, the magic number,
/// its rank.
pub(super) fn hello(token: &[u8; 32], rank: usize) -> [u8; 40] {
    let mut h = [0u8; 40];
    h[..32].copy_from_slice(token);
    h[32..36].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
    h[36..40].copy_from_slice(&(rank as u32).to_le_bytes());
    h
}

/// The rank a greeting names, if it carries `token` and the magic number.
pub(super) fn check_hello(h: &[u8; 40], token: &[u8; 32]) -> Option<u32> {
    (h[..32] == token[..] && u32_at(h, 32) == HELLO_MAGIC).then(|| u32_at(h, 36))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn request_header_roundtrip(op in any::<u8>(), flags in any::<u8>(), key in any::<u32>(), off in any::<u64>(),
                                    len in any::<u64>(), req in any::<u64>(), sig_key in any::<u32>(), sig_off in any::<u64>(),
                                    a in any::<u64>(), b in any::<u64>()) {
            let r = Req { op, flags, key, off, len, req, sig_key, sig_off, a, b };
            prop_assert_eq!(Req::decode(&r.encode()), r);
        }

        #[test]
        fn reply_header_roundtrip(kind in any::<u8>(), len in any::<u32>(), req in any::<u64>(), value in any::<u64>()) {
            let r = Reply { kind, len, req, value };
            prop_assert_eq!(Reply::decode(&r.encode()), r);
        }

        #[test]
        fn a_greeting_is_accepted_only_with_the_token(rank in 0usize..1 << 20, flip in 0usize..36) {
            let token = [7u8; 32];
            let mut h = hello(&token, rank);
            prop_assert_eq!(check_hello(&h, &token), Some(rank as u32));
            h[flip] ^= 1;
            prop_assert_eq!(check_hello(&h, &token), None);
        }
    }
}
