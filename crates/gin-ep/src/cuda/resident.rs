//! Whether every rank's high-throughput grid can be resident at once.
//!
//! A channel is one block of `ep_ht_dispatch` and `ep_ht_combine`, and a
//! channel's block polls until the same channel's block of each peer has
//! done its part: if the ranks sharing one GPU (under MPS) launch more
//! channel blocks than its SMs hold at once, a block that never starts
//! makes its peers' blocks time out, naming a healthy peer. So
//! [`super::CudaBuffer::new`] refuses such a job up front, on every rank
//! alike: each rank says which GPU it drives (its UUID), its SMs and how
//! many blocks of the kernels one SM holds (the driver's occupancy,
//! `cuOccupancyMaxActiveBlocksPerMultiprocessor` at the launch's block
//! size), the answers are all-gathered, and [`check`] decides from the
//! whole table.

use crate::error::EpError;

/// What one rank says about its GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seat {
    /// The GPU's UUID (a MIG instance's own); `None` where the driver does
    /// not say (the rank is then counted alone on its GPU).
    pub gpu: Option<String>,
    /// Its streaming multiprocessors.
    pub sms: u32,
    /// Blocks of the high-throughput kernels one SM holds at once (the
    /// least over the dispatch and combine kernels), or the driver's error
    /// where the occupancy query failed (every rank then refuses, naming
    /// this rank and the error).
    pub blocks_per_sm: Result<u32, String>,
    /// Whether this rank's contexts go through MPS (ranks sharing a GPU
    /// without it take turns on it: [`time_sliced`]).
    pub mps: bool,
}

/// Flag bits of an encoded seat.
const MPS: u32 = 1;
const QUERY_FAILED: u32 = 2;

impl Seat {
    /// The bytes a rank all-gathers: `sms`, blocks per SM (0 where the
    /// query failed), flags (1: MPS, 2: the query failed) and the error's
    /// length (LE u32 each), the error's bytes, then the UUID's (none:
    /// empty).
    pub fn to_bytes(&self) -> Vec<u8> {
        let (per_sm, why) = match &self.blocks_per_sm {
            Ok(n) => (*n, ""),
            Err(why) => (0, why.as_str()),
        };
        let flags = if self.mps { MPS } else { 0 }
            | if self.blocks_per_sm.is_err() {
                QUERY_FAILED
            } else {
                0
            };
        let mut v = Vec::with_capacity(16 + why.len() + 40);
        for w in [
            self.sms,
            per_sm,
            flags,
            u32::try_from(why.len()).unwrap_or(0),
        ] {
            v.extend_from_slice(&w.to_le_bytes());
        }
        v.extend_from_slice(why.as_bytes());
        if let Some(g) = &self.gpu {
            v.extend_from_slice(g.as_bytes());
        }
        v
    }

    /// A rank's seat from what it all-gathered ([`Seat::to_bytes`]); a
    /// short message reads as a GPU of no SMs (then [`check`] refuses it).
    pub fn from_bytes(b: &[u8]) -> Self {
        let word = |i: usize| {
            b.get(4 * i..4 * i + 4)
                .and_then(|w| w.try_into().ok())
                .map_or(0, u32::from_le_bytes)
        };
        let flags = word(2);
        let why_end = 16usize
            .saturating_add(word(3) as usize)
            .min(b.len().max(16));
        let text = |r: std::ops::Range<usize>| {
            b.get(r)
                .filter(|g| !g.is_empty())
                .map(|g| String::from_utf8_lossy(g).into_owned())
        };
        Self {
            gpu: text(why_end..b.len()),
            sms: word(0),
            blocks_per_sm: if flags & QUERY_FAILED == 0 {
                Ok(word(1))
            } else {
                Err(text(16..why_end).unwrap_or_default())
            },
            mps: flags & MPS != 0,
        }
    }
}

/// The ranks of each GPU, by its lowest rank (a rank whose GPU is unknown
/// alone).
fn by_gpu(seats: &[Seat]) -> Vec<Vec<usize>> {
    let mut done = vec![false; seats.len()];
    let mut groups = Vec::new();
    for first in 0..seats.len() {
        if done[first] {
            continue;
        }
        let ranks: Vec<usize> = match &seats[first].gpu {
            Some(g) => (first..seats.len())
                .filter(|&p| seats[p].gpu.as_deref() == Some(g.as_str()))
                .collect(),
            None => vec![first],
        };
        for &p in &ranks {
            done[p] = true;
        }
        groups.push(ranks);
    }
    groups
}

/// The GPUs whose ranks take turns on it: two or more ranks sharing it,
/// one of them at least without MPS (the driver then time-slices their
/// contexts, and a channel whose block is not running makes its peers'
/// blocks wait for it, a step taking time slices rather than failing).
/// Each as its UUID and ranks.
pub fn time_sliced(seats: &[Seat]) -> Vec<(String, Vec<usize>)> {
    by_gpu(seats)
        .into_iter()
        .filter(|ranks| ranks.len() > 1 && ranks.iter().any(|&p| !seats[p].mps))
        .map(|ranks| (seats[ranks[0]].gpu.clone().unwrap_or_default(), ranks))
        .collect()
}

/// Checks that `channels` blocks per rank fit at once on every GPU of the
/// job (`seats[r]`: rank `r`'s): the ranks sharing a GPU need `channels ×
/// ranks` blocks, which its `sms × blocks_per_sm` must hold (the least any
/// of them reports). Pure: every rank decides alike from the same table.
///
/// # Errors
/// [`EpError::Occupancy`] where a rank's occupancy query failed (the
/// lowest such rank, with its driver's error);
/// [`EpError::NotResident`] for the first GPU (by its lowest rank) that
/// cannot hold them, naming its ranks, the channels, its SMs, blocks per SM
/// and the most channels that would fit.
pub fn check(rank: usize, channels: usize, seats: &[Seat]) -> Result<(), EpError> {
    if let Some((p, why)) = seats
        .iter()
        .enumerate()
        .find_map(|(p, s)| s.blocks_per_sm.as_ref().err().map(|why| (p, why)))
    {
        return Err(EpError::Occupancy {
            rank,
            peer: p,
            why: why.clone(),
        });
    }
    for ranks in by_gpu(seats) {
        let first = ranks[0];
        let at = |f: fn(&Seat) -> u32| {
            ranks
                .iter()
                .map(|&p| f(&seats[p]) as usize)
                .min()
                .unwrap_or(0)
        };
        let (sms, per_sm) = (
            at(|s| s.sms),
            at(|s| *s.blocks_per_sm.as_ref().unwrap_or(&0)),
        );
        let n = ranks.len();
        if channels.saturating_mul(n) > sms.saturating_mul(per_sm) {
            return Err(EpError::NotResident {
                rank,
                gpu: seats[first]
                    .gpu
                    .clone()
                    .unwrap_or_else(|| format!("of rank {first}")),
                ranks,
                channels,
                ranks_on_gpu: n,
                sms,
                blocks_per_sm: per_sm,
                most: sms * per_sm / n,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seat(gpu: Option<&str>, sms: u32, per_sm: u32) -> Seat {
        Seat {
            gpu: gpu.map(str::to_owned),
            sms,
            blocks_per_sm: Ok(per_sm),
            mps: true,
        }
    }

    #[test]
    fn ranks_sharing_a_gpu_need_channels_times_ranks_blocks() {
        let h200 = |n: usize| vec![seat(Some("GPU-a"), 132, 1); n];
        // 16 channels: up to 8 ranks on an H200's 132 SMs, one block each.
        assert!(check(0, 16, &h200(2)).is_ok());
        assert!(check(0, 16, &h200(8)).is_ok());
        let e = check(3, 16, &h200(9)).unwrap_err();
        match &e {
            EpError::NotResident {
                rank: 3,
                gpu,
                ranks,
                channels: 16,
                ranks_on_gpu: 9,
                sms: 132,
                blocks_per_sm: 1,
                most: 14,
            } => {
                assert_eq!(gpu, "GPU-a");
                assert_eq!(ranks, &(0..9).collect::<Vec<_>>());
            }
            other => panic!("{other:?}"),
        }
        let text = e.to_string();
        for part in [
            "16 channels x 9 ranks on GPU GPU-a",
            "need 144 resident blocks",
            "its 132 SMs hold 1 block(s)",
            "(132 in all)",
            "set channels <= 14 (Config { channels: 14, .. }, or Config::with_cuda_channels(14): it takes an SM count",
        ] {
            assert!(text.contains(part), "{text}");
        }
        // Two blocks an SM double the room.
        assert!(check(0, 16, &vec![seat(Some("GPU-a"), 132, 2); 16]).is_ok());
        // Exactly full fits; one more block does not.
        assert!(check(0, 66, &h200(2)).is_ok());
        assert!(check(0, 67, &h200(2)).is_err());
    }

    #[test]
    fn each_gpu_is_checked_with_its_own_ranks() {
        // Ranks 0, 2 on GPU a; 1, 3, 4 on GPU b (10 SMs); 5 unknown.
        let seats = vec![
            seat(Some("a"), 132, 1),
            seat(Some("b"), 10, 1),
            seat(Some("a"), 132, 1),
            seat(Some("b"), 10, 1),
            seat(Some("b"), 10, 1),
            seat(None, 4, 1),
        ];
        assert!(check(1, 3, &seats).is_ok());
        match check(1, 4, &seats) {
            Err(EpError::NotResident { ranks, most: 3, .. }) => assert_eq!(ranks, vec![1, 3, 4]),
            other => panic!("{other:?}"),
        }
        // A rank whose GPU is unknown counts alone: 4 SMs, 4 channels.
        assert!(check(0, 3, &seats[5..]).is_ok());
        match check(0, 5, &seats[5..]) {
            Err(EpError::NotResident {
                ranks_on_gpu: 1,
                gpu,
                ..
            }) => assert_eq!(gpu, "of rank 0"),
            other => panic!("{other:?}"),
        }
        // The least a rank of the GPU reports counts (an occupancy of 0:
        // the kernel does not fit an SM at all).
        let mixed = vec![seat(Some("a"), 132, 2), seat(Some("a"), 132, 0)];
        assert!(matches!(
            check(0, 1, &mixed),
            Err(EpError::NotResident {
                blocks_per_sm: 0,
                most: 0,
                ..
            })
        ));
    }

    #[test]
    fn seats_round_trip_through_bytes() {
        for s in [seat(Some("GPU-1234-abcd"), 132, 1), seat(None, 78, 3)] {
            assert_eq!(Seat::from_bytes(&s.to_bytes()), s);
        }
        assert_eq!(
            Seat::from_bytes(&[1, 2]),
            Seat {
                mps: false,
                ..seat(None, 0, 0)
            }
        );
        let failed = Seat {
            blocks_per_sm: Err("CUDA_ERROR_INVALID_VALUE".into()),
            mps: false,
            ..seat(Some("GPU-1234-abcd"), 132, 0)
        };
        assert_eq!(Seat::from_bytes(&failed.to_bytes()), failed);
    }

    /// A rank whose occupancy query failed is named with its driver's
    /// error by every rank (not read as "0 blocks an SM, at most 0
    /// channels"), before any GPU's figures.
    #[test]
    fn a_failed_occupancy_query_is_reported_with_its_rank_and_error() {
        let mut seats = vec![seat(Some("a"), 132, 1); 3];
        seats[2].blocks_per_sm =
            Err("CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: too many resources".into());
        let e = check(0, 1, &seats).unwrap_err();
        match &e {
            EpError::Occupancy {
                rank: 0,
                peer: 2,
                why,
            } => {
                assert!(why.contains("LAUNCH_OUT_OF_RESOURCES"), "{why}");
            }
            other => panic!("{other:?}"),
        }
        let text = e.to_string();
        assert!(text.contains("rank 2 could not ask its driver"), "{text}");
        assert!(!text.contains("at most 0"), "{text}");
    }

    /// Where no channel count fits, the error says so rather than advising
    /// 0 channels.
    #[test]
    fn when_nothing_fits_the_error_says_so() {
        let text = check(0, 1, &[seat(Some("a"), 132, 0)])
            .unwrap_err()
            .to_string();
        assert!(
            text.contains("no channel count fits its 1 rank(s)"),
            "{text}"
        );
        assert!(!text.contains("channels <="), "{text}");
        let text = check(0, 1, &vec![seat(Some("a"), 4, 1); 5])
            .unwrap_err()
            .to_string();
        assert!(
            text.contains("no channel count fits its 5 rank(s)"),
            "{text}"
        );
    }

    /// Ranks sharing a GPU without MPS (any of them) are reported, once
    /// per GPU with its ranks; a GPU of one rank, ranks all under MPS, and
    /// ranks whose GPU is unknown are not.
    #[test]
    fn ranks_sharing_a_gpu_without_mps_are_found() {
        let plain = |gpu: Option<&str>| Seat {
            mps: false,
            ..seat(gpu, 132, 1)
        };
        let seats = vec![
            plain(Some("a")),
            seat(Some("b"), 132, 1),
            seat(Some("a"), 132, 1),
            seat(Some("b"), 132, 1),
            plain(Some("c")),
            plain(None),
            plain(None),
        ];
        assert_eq!(time_sliced(&seats), vec![("a".to_owned(), vec![0, 2])]);
        assert!(time_sliced(&seats[1..4]).is_empty());
        // The residency check itself is unchanged by MPS.
        assert!(check(0, 16, &seats).is_ok());
    }
}
