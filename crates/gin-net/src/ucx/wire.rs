//! The ucx transport's own messages (UCP active messages), pure encoding:
//! a peer asks an owner for the rkey of a region key, the owner answers,
//! and an owner that stops serving a region revokes it and waits for each
//! peer that holds its rkey to acknowledge, after flushing what it sent.
//!
//! Small puts travel as one message each (data and signal, applied by the
//! target's handler), with a request that asks the target to say once it
//! executed them.
//!
//! All little-endian; headers are fixed-size, the answer's rkey and a
//! put's bytes are the active message's data.

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
    /// "Are you there?": an owner waiting for a revocation's
    /// acknowledgement asks a peer that is late (header [`super::Ask`],
    /// key 0).
    pub const PING: u32 = 0x67_05;
    /// "I am": the answer, sent by the peer's progress thread.
    pub const PONG: u32 = 0x67_06;
    /// A small put, and its signal, carried whole (header
    /// [`super::AmPut`], data the bytes): the target's handler checks and
    /// applies it, data first, then the signal.
    pub const PUT: u32 = 0x67_07;
    /// "Tell me once you executed my puts up to N" (header
    /// [`super::Sync`]).
    pub const SYNC: u32 = 0x67_08;
    /// The answer (header [`super::Synced`], data the first refusal's
    /// text, empty when none).
    pub const SYNCED: u32 = 0x67_09;
    /// An atomic executed in turn with the put messages (header
    /// [`super::AmAtomic`]), answered as a sync with its old value.
    pub const ATOMIC: u32 = 0x67_0a;
}

/// An atomic carried as an active message (`id::ATOMIC`), in the same
/// sequence as [`AmPut`]s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AmAtomic {
    /// The sender's rank.
    pub from: u32,
    /// Its place in the sender's sequence of messages to this target.
    pub seq: u64,
    /// The answer's request id.
    pub id: u64,
    /// The word's region key and offset.
    pub key: u32,
    /// Offset of the 8-byte word in its region.
    pub offset: u64,
    /// Fetch-add of `a` (`None`), or compare-swap from `a` to this.
    pub swap: Option<u64>,
    /// The amount added, or the value expected.
    pub a: u64,
}

impl AmAtomic {
    /// Encoded size.
    pub const LEN: usize = 56;

    /// Encodes.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0; Self::LEN];
        let (op, desired) = self.swap.map_or((0u32, 0), |d| (1, d));
        b[0..4].copy_from_slice(&self.from.to_le_bytes());
        b[4..8].copy_from_slice(&op.to_le_bytes());
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.id.to_le_bytes());
        b[24..28].copy_from_slice(&self.key.to_le_bytes());
        b[32..40].copy_from_slice(&self.offset.to_le_bytes());
        b[40..48].copy_from_slice(&self.a.to_le_bytes());
        b[48..56].copy_from_slice(&desired.to_le_bytes());
        b
    }

    /// Decodes, or `None` for a malformed header.
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() != Self::LEN {
            return None;
        }
        let u64_at = |i: usize| Some(u64::from_le_bytes(b[i..i + 8].try_into().ok()?));
        let swap = match u32::from_le_bytes(b[4..8].try_into().ok()?) {
            0 => None,
            1 => Some(u64_at(48)?),
            _ => return None,
        };
        Some(Self {
            from: u32::from_le_bytes(b[0..4].try_into().ok()?),
            seq: u64_at(8)?,
            id: u64_at(16)?,
            key: u32::from_le_bytes(b[24..28].try_into().ok()?),
            offset: u64_at(32)?,
            swap,
            a: u64_at(40)?,
        })
    }
}

/// A put carried as one active message (`id::PUT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AmPut {
    /// The sender's rank.
    pub from: u32,
    /// The sender's count of such puts to this target, this one included
    /// (from 1): the target executes them in this order.
    pub seq: u64,
    /// The data's region key and offset.
    pub key: u32,
    /// Offset of the data in its region.
    pub offset: u64,
    /// The signal, if any: region key, offset of its 8-byte word, and the
    /// amount added.
    pub signal: Option<(u32, u64, u64)>,
}

impl AmPut {
    /// Encoded size.
    pub const LEN: usize = 48;

    /// Encodes.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0; Self::LEN];
        b[0..4].copy_from_slice(&self.from.to_le_bytes());
        let (flag, (sk, so, add)) = match self.signal {
            Some(s) => (1u32, s),
            None => (0, (0, 0, 0)),
        };
        b[4..8].copy_from_slice(&flag.to_le_bytes());
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..20].copy_from_slice(&self.key.to_le_bytes());
        b[20..24].copy_from_slice(&sk.to_le_bytes());
        b[24..32].copy_from_slice(&self.offset.to_le_bytes());
        b[32..40].copy_from_slice(&so.to_le_bytes());
        b[40..48].copy_from_slice(&add.to_le_bytes());
        b
    }

    /// Decodes, or `None` for a malformed header.
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() != Self::LEN {
            return None;
        }
        let u32_at = |i: usize| Some(u32::from_le_bytes(b[i..i + 4].try_into().ok()?));
        let u64_at = |i: usize| Some(u64::from_le_bytes(b[i..i + 8].try_into().ok()?));
        let signal = match u32_at(4)? {
            0 => None,
            1 => Some((u32_at(20)?, u64_at(32)?, u64_at(40)?)),
            _ => return None,
        };
        Some(Self {
            from: u32_at(0)?,
            seq: u64_at(8)?,
            key: u32_at(16)?,
            offset: u64_at(24)?,
            signal,
        })
    }
}

/// "Answer `id` once you executed my puts up to `upto`" (`id::SYNC`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sync {
    /// The sender's rank.
    pub from: u32,
    /// The request id, carried back.
    pub id: u64,
    /// The sequence number of the sender's last put so far.
    pub upto: u64,
}

impl Sync {
    /// Encoded size.
    pub const LEN: usize = 24;

    /// Encodes.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0; Self::LEN];
        b[0..4].copy_from_slice(&self.from.to_le_bytes());
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b[16..24].copy_from_slice(&self.upto.to_le_bytes());
        b
    }

    /// Decodes, or `None` for a header of the wrong size.
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() != Self::LEN {
            return None;
        }
        Some(Self {
            from: u32::from_le_bytes(b[0..4].try_into().ok()?),
            id: u64::from_le_bytes(b[8..16].try_into().ok()?),
            upto: u64::from_le_bytes(b[16..24].try_into().ok()?),
        })
    }
}

/// The answer to a [`Sync`] (`id::SYNCED`): every put up to `done` was
/// executed or refused; the data is the first refusal's text, if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Synced {
    /// The request id of the [`Sync`].
    pub id: u64,
    /// How many of the sender's puts the target executed (or refused).
    pub done: u64,
    /// An atomic's old value (0 for a sync).
    pub value: u64,
}

impl Synced {
    /// Encoded size.
    pub const LEN: usize = 24;

    /// Encodes.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0; Self::LEN];
        b[0..8].copy_from_slice(&self.id.to_le_bytes());
        b[8..16].copy_from_slice(&self.done.to_le_bytes());
        b[16..24].copy_from_slice(&self.value.to_le_bytes());
        b
    }

    /// Decodes, or `None` for a header of the wrong size.
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() != Self::LEN {
            return None;
        }
        Some(Self {
            id: u64::from_le_bytes(b[0..8].try_into().ok()?),
            done: u64::from_le_bytes(b[8..16].try_into().ok()?),
            value: u64::from_le_bytes(b[16..24].try_into().ok()?),
        })
    }
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
    /// the CUDA memory type (UCX without its CUDA transports, or a CUDA
    /// error).
    Device(Failure),
    /// `ucp_mem_map` or `ucp_rkey_pack` failed at the owner.
    Map(Failure),
    /// The owner failed serving the key for a reason of its own (its log
    /// says which).
    Internal,
}

/// Which UCX call failed at the owner, and its status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Failure {
    /// The call.
    pub call: Call,
    /// UCX's status (`ucs_status_t`, negative).
    pub status: i8,
}

/// An owner-side UCX call that can refuse a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    /// `ucp_mem_map`.
    MemMap,
    /// `ucp_rkey_pack`.
    RkeyPack,
}

impl Call {
    /// The call's name.
    pub fn name(self) -> &'static str {
        match self {
            Self::MemMap => "ucp_mem_map",
            Self::RkeyPack => "ucp_rkey_pack",
        }
    }
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
    /// Encoded size: the id, the status word, the failed call and UCX's
    /// status (both 0 unless a call failed), two bytes of padding.
    pub const LEN: usize = 16;

    /// Encodes.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0; Self::LEN];
        b[0..8].copy_from_slice(&self.id.to_le_bytes());
        let (s, f): (u32, Option<Failure>) = match self.status {
            Ok(()) => (0, None),
            Err(Refusal::Unknown) => (1, None),
            Err(Refusal::Device(f)) => (2, Some(f)),
            Err(Refusal::Map(f)) => (3, Some(f)),
            Err(Refusal::Internal) => (4, None),
        };
        b[8..12].copy_from_slice(&s.to_le_bytes());
        if let Some(f) = f {
            b[12] = match f.call {
                Call::MemMap => 1,
                Call::RkeyPack => 2,
            };
            b[13] = f.status.to_le_bytes()[0];
        }
        b
    }

    /// Decodes, or `None` for a malformed header.
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() != Self::LEN {
            return None;
        }
        let failure = || {
            let call = match b[12] {
                1 => Call::MemMap,
                2 => Call::RkeyPack,
                _ => return None,
            };
            Some(Failure {
                call,
                status: i8::from_le_bytes([b[13]]),
            })
        };
        let status = match u32::from_le_bytes(b[8..12].try_into().ok()?) {
            0 => Ok(()),
            1 => Err(Refusal::Unknown),
            2 => Err(Refusal::Device(failure()?)),
            3 => Err(Refusal::Map(failure()?)),
            4 => Err(Refusal::Internal),
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
    /// GPU memory (a region behind a backing): written by UCX only, never
    /// by the transport's own put messages.
    pub backed: bool,
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
                | u8::from(self.access.atomic) << 2
                | u8::from(self.backed) << 3,
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
            backed: r & 8 != 0,
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
        let f = Failure {
            call: Call::RkeyPack,
            status: -3,
        };
        for status in [
            Ok(()),
            Err(Refusal::Unknown),
            Err(Refusal::Device(f)),
            Err(Refusal::Map(Failure {
                call: Call::MemMap,
                status: -100,
            })),
            Err(Refusal::Internal),
        ] {
            let x = Answer { id: 9, status };
            assert_eq!(Answer::decode(&x.encode()), Some(x));
        }
        // A refusal that names no call is malformed.
        let mut bad = Answer {
            id: 1,
            status: Err(Refusal::Map(f)),
        }
        .encode();
        bad[12] = 0;
        assert_eq!(Answer::decode(&bad), None);
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
            backed: true,
            rkey: vec![1, 2, 3],
        };
        assert_eq!(Served::decode(&s.encode()), Some(s.clone()));
        // An answer without an rkey is malformed.
        assert_eq!(Served::decode(&s.encode()[..17]), None);
        for signal in [None, Some((0xfeed_f00d, 4088, u64::MAX - 1))] {
            let put = AmPut {
                from: 3,
                seq: 1 << 33,
                key: 0x1234_5678,
                offset: 1 << 40,
                signal,
            };
            assert_eq!(AmPut::decode(&put.encode()), Some(put));
            assert_eq!(AmPut::decode(&put.encode()[..47]), None);
        }
        let mut bad = AmPut {
            from: 0,
            seq: 1,
            key: 1,
            offset: 0,
            signal: None,
        }
        .encode();
        bad[4] = 2;
        assert_eq!(AmPut::decode(&bad), None);
        let sync = Sync {
            from: 1,
            id: 77,
            upto: 1 << 50,
        };
        assert_eq!(Sync::decode(&sync.encode()), Some(sync));
        assert_eq!(Sync::decode(&sync.encode()[..23]), None);
        let synced = Synced {
            id: 77,
            done: 9,
            value: u64::MAX,
        };
        assert_eq!(Synced::decode(&synced.encode()), Some(synced));
        assert_eq!(Synced::decode(&[0; 23]), None);
        for swap in [None, Some(u64::MAX)] {
            let atomic = AmAtomic {
                from: 2,
                seq: 5,
                id: 1 << 60,
                key: 0xabcd_ef01,
                offset: 4088,
                swap,
                a: 3,
            };
            assert_eq!(AmAtomic::decode(&atomic.encode()), Some(atomic));
            assert_eq!(AmAtomic::decode(&atomic.encode()[..55]), None);
        }
    }
}
