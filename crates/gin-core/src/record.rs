//! The records ranks allgather while building a communicator and its CUDA
//! device communicators (a window part's is gin-net's,
//! `gin_net::part::PartRecord`, or for GPU windows gin-cuda's,
//! `gin_cuda::window::PartRecord`), each a layout over
//! gin-bootstrap's record codec ([`gin_bootstrap::record`]): decoding checks
//! the shape and names the rank that sent a malformed record (the ranks run
//! different builds, or memory was corrupted), instead of slicing bytes by
//! hand at each use.

use gin_bootstrap::record::{Reader, Writer};

use crate::error::CoreError;

/// What a rank tells the others about its host and process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HostRecord<'a> {
    /// The host id (`GIN_HOSTID` or the machine's).
    pub host: &'a [u8],
    /// The encoded process identity (`gin_bootstrap::liveness::ProcessId`).
    pub process: &'a [u8],
}

impl<'a> HostRecord<'a> {
    /// Host id length (u32 LE), host id, process identity.
    pub fn encode(&self) -> Vec<u8> {
        Writer::new()
            .prefixed(self.host)
            .bytes(self.process)
            .finish()
    }

    /// Decodes what rank `rank` sent.
    pub fn decode(rank: usize, b: &'a [u8]) -> Result<Self, CoreError> {
        let mut r = Reader::with_head(rank, "host record", b, 4)?;
        Ok(Self {
            host: r.prefixed()?,
            process: r.rest(),
        })
    }
}

/// Where a rank placed a CUDA device communicator's signals and counters,
/// and whether it reaches every peer by load/store. Every rank must place
/// them alike.
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

    pub fn encode(&self) -> Vec<u8> {
        Writer::new()
            .u64(self.signals)
            .u64(self.counters)
            .flag(self.lsa_only)
            .finish()
    }

    /// Decodes what rank `rank` sent.
    pub fn decode(rank: usize, b: &[u8]) -> Result<Self, CoreError> {
        let what = "CUDA device communicator placement record";
        let mut r = Reader::exact(rank, what, b, Self::LEN)?;
        Ok(Self {
            signals: r.u64()?,
            counters: r.u64()?,
            lsa_only: r.flag("load/store flag")?,
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

    /// A host window part's record is gin-net's (`gin_net::part`); a
    /// malformed one still reaches gin-core's callers as
    /// [`CoreError::MalformedRecord`], naming rank and window.
    #[test]
    fn a_malformed_window_record_is_a_malformed_record_naming_the_rank_and_window() {
        let e: CoreError = gin_net::part::PartRecord::decode(2, 9, &[0u8; 20])
            .unwrap_err()
            .into();
        assert!(
            matches!(
                &e,
                CoreError::MalformedRecord {
                    rank: 2,
                    got: 20,
                    expected: 21,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("window 9"), "{e}");
    }

    /// A GPU window part's record is gin-cuda's (`gin_cuda::window`); a
    /// malformed one still reaches gin-core's callers as
    /// [`CoreError::MalformedRecord`], naming rank and window.
    #[test]
    fn a_malformed_gpu_window_record_is_a_malformed_record_naming_the_rank_and_window() {
        let e: CoreError = gin_cuda::window::PartRecord::decode(3, 9, &[0u8; 80])
            .unwrap_err()
            .into();
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
