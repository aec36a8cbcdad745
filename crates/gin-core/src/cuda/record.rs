//! The records CUDA ranks allgather, as small codecs: what each rank tells
//! the others about its part of a GPU window, and where a device
//! communicator placed its signals and counters. Decoding checks the
//! length and names the rank that sent a malformed record.

use crate::error::CoreError;

/// What a rank tells the others about its part of a GPU window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WindowRecord {
    /// The part's size in bytes.
    pub size: u64,
    /// Its device address on the sending rank (what WQEs name).
    pub addr: u64,
    /// Its CUDA IPC handle, for same-host peers.
    pub ipc: [u8; 64],
    /// Its region key for TCP peers (0: not served over TCP).
    pub key: u32,
}

impl WindowRecord {
    /// Encoded length: size, address (u64 LE each), the IPC handle, the
    /// key (u32 LE).
    pub const LEN: usize = 84;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[..8].copy_from_slice(&self.size.to_le_bytes());
        b[8..16].copy_from_slice(&self.addr.to_le_bytes());
        b[16..80].copy_from_slice(&self.ipc);
        b[80..].copy_from_slice(&self.key.to_le_bytes());
        b
    }

    /// Decodes what rank `rank` sent for GPU window `window`.
    pub fn decode(rank: usize, window: u32, b: &[u8]) -> Result<Self, CoreError> {
        let b: &[u8; Self::LEN] = b.try_into().map_err(|_| CoreError::MalformedRecord {
            rank,
            what: format!("GPU window {window} record"),
            got: b.len(),
            expected: Self::LEN,
        })?;
        let word = |at: usize| u64::from_le_bytes(std::array::from_fn(|i| b[at + i]));
        Ok(Self {
            size: word(0),
            addr: word(8),
            ipc: std::array::from_fn(|i| b[16 + i]),
            key: u32::from_le_bytes(std::array::from_fn(|i| b[80 + i])),
        })
    }
}

/// Where a rank placed a device communicator's signals and counters, and
/// whether it reaches every peer by load/store. Every rank must place them
/// alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Placement {
    /// First signal slot.
    pub signals: u64,
    /// First counter slot.
    pub counters: u64,
    /// Whether this rank reaches every rank it is connected to by
    /// load/store.
    pub lsa_only: bool,
}

impl Placement {
    /// Encoded length: signals, counters (u64 LE each), then 0 or 1.
    pub const LEN: usize = 17;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[..8].copy_from_slice(&self.signals.to_le_bytes());
        b[8..16].copy_from_slice(&self.counters.to_le_bytes());
        b[16] = u8::from(self.lsa_only);
        b
    }

    /// Decodes what rank `rank` sent.
    pub fn decode(rank: usize, b: &[u8]) -> Result<Self, CoreError> {
        let malformed = || CoreError::MalformedRecord {
            rank,
            what: "CUDA device communicator placement record".into(),
            got: b.len(),
            expected: Self::LEN,
        };
        let b: &[u8; Self::LEN] = b.try_into().map_err(|_| malformed())?;
        let word = |at: usize| u64::from_le_bytes(std::array::from_fn(|i| b[at + i]));
        let lsa_only = match b[16] {
            0 => false,
            1 => true,
            _ => return Err(malformed()),
        };
        Ok(Self {
            signals: word(0),
            counters: word(8),
            lsa_only,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_record_round_trips_in_the_layout_ranks_exchange() {
        let r = WindowRecord {
            size: 0x0102_0304_0506_0708,
            addr: 0x7f00_0000_1000,
            ipc: std::array::from_fn(|i| i as u8 ^ 0xa5),
            key: 0xfeed_beef,
        };
        let b = r.encode();
        // The layout older builds sent by hand: size, address, handle, key.
        assert_eq!(b[..8], r.size.to_le_bytes());
        assert_eq!(b[8..16], r.addr.to_le_bytes());
        assert_eq!(b[16..80], r.ipc);
        assert_eq!(b[80..], r.key.to_le_bytes());
        assert_eq!(WindowRecord::decode(3, 9, &b).unwrap(), r);
    }

    #[test]
    fn a_malformed_window_record_names_the_rank_and_window() {
        let b = [0u8; 80];
        let e = WindowRecord::decode(3, 9, &b).unwrap_err();
        assert!(
            matches!(
                &e,
                CoreError::MalformedRecord {
                    rank: 3,
                    got: 80,
                    expected: 84,
                    ..
                }
            ),
            "{e}"
        );
        assert_eq!(
            e.to_string(),
            "rank 3 sent a malformed GPU window 9 record (80 bytes, expected 84)"
        );
        assert!(WindowRecord::decode(0, 0, &[0u8; 85]).is_err());
    }

    #[test]
    fn a_placement_round_trips_and_refuses_a_bad_flag() {
        for lsa_only in [false, true] {
            let p = Placement {
                signals: 17,
                counters: u64::MAX - 3,
                lsa_only,
            };
            let b = p.encode();
            assert_eq!(b[..8], 17u64.to_le_bytes());
            assert_eq!(b[16], u8::from(lsa_only));
            assert_eq!(Placement::decode(1, &b).unwrap(), p);
        }
        let mut b = Placement {
            signals: 0,
            counters: 0,
            lsa_only: true,
        }
        .encode();
        b[16] = 2;
        let e = Placement::decode(5, &b).unwrap_err();
        assert!(
            matches!(e, CoreError::MalformedRecord { rank: 5, .. }),
            "{e}"
        );
        assert!(matches!(
            Placement::decode(2, &b[..16]),
            Err(CoreError::MalformedRecord {
                rank: 2,
                got: 16,
                ..
            })
        ));
    }
}
