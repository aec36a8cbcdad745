//! The records CPU ranks allgather while building a communicator and its
//! windows, as small codecs: decoding checks the shape and names the rank
//! that sent a malformed record (the ranks run different builds, or memory
//! was corrupted), instead of slicing bytes by hand at each use.

use crate::error::CoreError;

/// What a rank tells the others about its host and process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HostRecord<'a> {
    /// The host id (`GIN_HOSTID` or the machine's).
    pub host: &'a [u8],
    /// The encoded process identity (`liveness::ProcessId`).
    pub process: &'a [u8],
}

impl<'a> HostRecord<'a> {
    /// Host id length (u32 LE), host id, process identity.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = (self.host.len() as u32).to_le_bytes().to_vec();
        b.extend_from_slice(self.host);
        b.extend_from_slice(self.process);
        b
    }

    /// Decodes what rank `rank` sent.
    pub fn decode(rank: usize, b: &'a [u8]) -> Result<Self, CoreError> {
        let malformed = || CoreError::MalformedRecord {
            rank,
            what: "host record".into(),
            got: b.len(),
            expected: 4,
        };
        let len = b
            .get(..4)
            .map(|l| u32::from_le_bytes([l[0], l[1], l[2], l[3]]) as usize)
            .ok_or_else(malformed)?;
        let end = 4usize.checked_add(len).ok_or_else(malformed)?;
        Ok(Self {
            host: b.get(4..end).ok_or_else(malformed)?,
            process: b.get(end..).ok_or_else(malformed)?,
        })
    }
}

/// What a rank tells the others about its part of a CPU window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WindowRecord<'a> {
    /// The part's size in bytes.
    pub size: u64,
    /// Its region key (what keyed transports name).
    pub key: u32,
    /// Its address on the sending rank.
    pub addr: u64,
    /// Whether it lives in a shared segment same-host peers may map.
    pub shared: bool,
    /// The segment's path (empty when not shared).
    pub segment: &'a str,
}

impl<'a> WindowRecord<'a> {
    /// Size (u64 LE), key (u32 LE), address (u64 LE), shared flag (one byte,
    /// 0 or 1), then the segment path in UTF-8.
    pub const HEAD: usize = 21;
    // (Decoding spells the 21 out: a generic `Self` cannot size an array.)

    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(Self::HEAD + self.segment.len());
        b.extend_from_slice(&self.size.to_le_bytes());
        b.extend_from_slice(&self.key.to_le_bytes());
        b.extend_from_slice(&self.addr.to_le_bytes());
        b.push(u8::from(self.shared));
        b.extend_from_slice(self.segment.as_bytes());
        b
    }

    /// Decodes what rank `rank` sent for window `window`.
    pub fn decode(rank: usize, window: u32, b: &'a [u8]) -> Result<Self, CoreError> {
        let what = |why: &str| format!("window {window} record ({why})");
        let head: &[u8; 21] = b
            .get(..Self::HEAD)
            .and_then(|h| h.try_into().ok())
            .ok_or_else(|| CoreError::MalformedRecord {
                rank,
                what: what("too short"),
                got: b.len(),
                expected: Self::HEAD,
            })?;
        let shared = match head[20] {
            0 => false,
            1 => true,
            _ => {
                return Err(CoreError::MalformedRecord {
                    rank,
                    what: what("a shared flag that is neither 0 nor 1"),
                    got: b.len(),
                    expected: Self::HEAD,
                });
            }
        };
        let segment =
            std::str::from_utf8(&b[Self::HEAD..]).map_err(|_| CoreError::MalformedRecord {
                rank,
                what: what("a segment path that is not UTF-8"),
                got: b.len(),
                expected: Self::HEAD,
            })?;
        let word = |at: usize| u64::from_le_bytes(std::array::from_fn(|i| head[at + i]));
        Ok(Self {
            size: word(0),
            key: u32::from_le_bytes(std::array::from_fn(|i| head[8 + i])),
            addr: word(12),
            shared,
            segment,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_record_round_trips_and_a_short_one_names_its_rank() {
        let r = HostRecord {
            host: b"node7",
            process: &[1, 2, 3],
        };
        let b = r.encode();
        assert_eq!(HostRecord::decode(3, &b).unwrap(), r);
        for cut in [0, 3, 6] {
            let e = HostRecord::decode(3, &b[..cut]).unwrap_err().to_string();
            assert!(e.contains("rank 3") && e.contains("host record"), "{e}");
        }
        // A length that points past the end (or overflows) is refused.
        let mut bad = u32::MAX.to_le_bytes().to_vec();
        bad.extend_from_slice(b"x");
        assert!(HostRecord::decode(1, &bad).is_err());
    }

    #[test]
    fn a_window_record_round_trips_in_the_byte_layout_ranks_exchange() {
        let r = WindowRecord {
            size: 4096,
            key: 0xdead_beef,
            addr: 0x7f00_0000_1000,
            shared: true,
            segment: "/dev/shm/gin-1-2",
        };
        let b = r.encode();
        assert_eq!(&b[..8], &4096u64.to_le_bytes());
        assert_eq!(&b[8..12], &0xdead_beefu32.to_le_bytes());
        assert_eq!(&b[12..20], &0x7f00_0000_1000u64.to_le_bytes());
        assert_eq!(b[20], 1);
        assert_eq!(&b[21..], b"/dev/shm/gin-1-2");
        assert_eq!(WindowRecord::decode(0, 5, &b).unwrap(), r);
    }

    #[test]
    fn a_malformed_window_record_names_the_rank_and_the_window() {
        let good = WindowRecord {
            size: 8,
            key: 1,
            addr: 2,
            shared: false,
            segment: "",
        }
        .encode();
        let e = WindowRecord::decode(2, 9, &good[..20])
            .unwrap_err()
            .to_string();
        assert!(e.contains("rank 2") && e.contains("window 9"), "{e}");
        let mut flag = good.clone();
        flag[20] = 7;
        let e = WindowRecord::decode(2, 9, &flag).unwrap_err().to_string();
        assert!(e.contains("shared flag"), "{e}");
        let mut name = good;
        name[20] = 1;
        name.extend_from_slice(&[0xff, 0xfe]);
        let e = WindowRecord::decode(2, 9, &name).unwrap_err().to_string();
        assert!(e.contains("UTF-8"), "{e}");
    }
}
