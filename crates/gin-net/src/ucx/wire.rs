//! The ucx transport's own messages (UCP active messages), pure encoding:
//! a peer asks an owner for the rkey of a region key, the owner answers,
//! and an owner that stops serving a region revokes it and waits for each
//! peer that holds its rkey to acknowledge, after flushing what it sent.
//!
//! All little-endian; headers are fixed-size, the answer's rkey is the
//! active message's data.

use crate::region::Access;

/// Active message ids (UCP's per-worker id space; nothing else in the
/// process registers handlers on this worker).
pub mod id {
    /// "Send me the rkey of key K" (header [`super::Ask`]).
    pub const ASK: u32 = 0x67_01;
    /// The answer (header [`super::Answer`], data [`super::Served`]).
    pub const ANSWER: u32 = 0x67_02;
    /// "Key K is no longer served: drop its rkey, flush, acknowledge."
    pub const REVOKE: u32 = 0x67_03;
    /// "I dropped K's rkey and everything I sent before is done."
    pub const REVOKED: u32 = 0x67_04;
}

/// A request for a key's rkey, or a revocation and its acknowledgement
/// (the same three fields).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ask {
    /// The sender's rank.
    pub from: u32,
    /// The region key.
    pub key: u32,
    /// The request id (answers carry it back; 0 in revocations).
    pub id: u64,
}

impl Ask {
    /// Encoded size.
    pub const LEN: usize = 16;

    /// Encodes.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0; Self::LEN];
        b[0..4].copy_from_slice(&self.from.to_le_bytes());
        b[4..8].copy_from_slice(&self.key.to_le_bytes());
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b
    }

    /// Decodes, or `None` for a header of the wrong size.
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() != Self::LEN {
            return None;
        }
        Some(Self {
            from: u32::from_le_bytes(b[0..4].try_into().ok()?),
            key: u32::from_le_bytes(b[4..8].try_into().ok()?),
            id: u64::from_le_bytes(b[8..16].try_into().ok()?),
        })
    }
}

/// Why an owner did not hand out an rkey.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No region has this key (never registered, or removed).
    Unknown,
    /// The region is GPU memory that the owner's UCX could not map with
    /// the CUDA memory type (UCX without its CUDA transports).
    Device,
    /// `ucp_mem_map` or `ucp_rkey_pack` failed at the owner.
    Map,
}

/// The owner's answer header: the request id and a status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Answer {
    /// The request id of the [`Ask`].
    pub id: u64,
    /// `Ok` with [`Served`] as data, or why not.
    pub status: Result<(), Refusal>,
}

impl Answer {
    /// Encoded size.
    pub const LEN: usize = 12;

    /// Encodes.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0; Self::LEN];
        b[0..8].copy_from_slice(&self.id.to_le_bytes());
        let s: u32 = match self.status {
            Ok(()) => 0,
            Err(Refusal::Unknown) => 1,
            Err(Refusal::Device) => 2,
            Err(Refusal::Map) => 3,
        };
        b[8..12].copy_from_slice(&s.to_le_bytes());
        b
    }

    /// Decodes, or `None` for a malformed header.
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() != Self::LEN {
            return None;
        }
        let status = match u32::from_le_bytes(b[8..12].try_into().ok()?) {
            0 => Ok(()),
            1 => Err(Refusal::Unknown),
            2 => Err(Refusal::Device),
            3 => Err(Refusal::Map),
            _ => return None,
        };
        Some(Self {
            id: u64::from_le_bytes(b[0..8].try_into().ok()?),
            status,
        })
    }
}

/// What an owner serves a region as: its address, size and rights, and
/// the packed rkey (the answer's data).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Served {
    /// The region's address at the owner.
    pub base: u64,
    /// Its size.
    pub len: u64,
    /// What peers may do.
    pub access: Access,
    /// `ucp_rkey_pack`'s bytes.
    pub rkey: Vec<u8>,
}

impl Served {
    const FIXED: usize = 17;

    /// Encodes.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(Self::FIXED + self.rkey.len());
        b.extend_from_slice(&self.base.to_le_bytes());
        b.extend_from_slice(&self.len.to_le_bytes());
        b.push(
            u8::from(self.access.write)
                | u8::from(self.access.read) << 1
                | u8::from(self.access.atomic) << 2,
        );
        b.extend_from_slice(&self.rkey);
        b
    }

    /// Decodes, or `None` when too short or without an rkey.
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() <= Self::FIXED {
            return None;
        }
        let r = b[16];
        Some(Self {
            base: u64::from_le_bytes(b[0..8].try_into().ok()?),
            len: u64::from_le_bytes(b[8..16].try_into().ok()?),
            access: Access {
                write: r & 1 != 0,
                read: r & 2 != 0,
                atomic: r & 4 != 0,
            },
            rkey: b[Self::FIXED..].to_vec(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_malformed_ones_are_refused() {
        let a = Ask {
            from: 7,
            key: 0xdead_beef,
            id: 1 << 40,
        };
        assert_eq!(Ask::decode(&a.encode()), Some(a));
        assert_eq!(Ask::decode(&a.encode()[..15]), None);
        for status in [
            Ok(()),
            Err(Refusal::Unknown),
            Err(Refusal::Device),
            Err(Refusal::Map),
        ] {
            let x = Answer { id: 9, status };
            assert_eq!(Answer::decode(&x.encode()), Some(x));
        }
        let mut bad = Answer {
            id: 1,
            status: Ok(()),
        }
        .encode();
        bad[8] = 9;
        assert_eq!(Answer::decode(&bad), None);
        let s = Served {
            base: 0x7f00_0000_1000,
            len: 4096,
            access: Access {
                write: true,
                read: false,
                atomic: true,
            },
            rkey: vec![1, 2, 3],
        };
        assert_eq!(Served::decode(&s.encode()), Some(s.clone()));
        // An answer without an rkey is malformed.
        assert_eq!(Served::decode(&s.encode()[..17]), None);
    }
}
