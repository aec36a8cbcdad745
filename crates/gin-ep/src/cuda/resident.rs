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
    /// least over the dispatch and combine kernels).
    pub blocks_per_sm: u32,
}

impl Seat {
    /// The bytes a rank all-gathers: `sms`, `blocks_per_sm` (LE u32 each),
    /// then the UUID's bytes (none: empty).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(8 + 40);
        v.extend_from_slice(&self.sms.to_le_bytes());
        v.extend_from_slice(&self.blocks_per_sm.to_le_bytes());
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
        let gpu = b
            .get(8..)
            .filter(|g| !g.is_empty())
            .map(|g| String::from_utf8_lossy(g).into_owned());
        Self {
            gpu,
            sms: word(0),
            blocks_per_sm: word(1),
        }
    }
}

/// Checks that `channels` blocks per rank fit at once on every GPU of the
/// job (`seats[r]`: rank `r`'s): the ranks sharing a GPU need `channels ×
/// ranks` blocks, which its `sms × blocks_per_sm` must hold (the least any
/// of them reports). Pure: every rank decides alike from the same table.
///
/// # Errors
/// [`EpError::NotResident`] for the first GPU (by its lowest rank) that
/// cannot hold them, naming its ranks, the channels, its SMs, blocks per SM
/// and the most channels that would fit.
pub fn check(rank: usize, channels: usize, seats: &[Seat]) -> Result<(), EpError> {
    let mut done = vec![false; seats.len()];
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
        let at = |f: fn(&Seat) -> u32| {
            ranks
                .iter()
                .map(|&p| f(&seats[p]) as usize)
                .min()
                .unwrap_or(0)
        };
        let (sms, per_sm) = (at(|s| s.sms), at(|s| s.blocks_per_sm));
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
            blocks_per_sm: per_sm,
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
            "Config::with_cuda_channels at most 14 channels",
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
        assert_eq!(Seat::from_bytes(&[1, 2]), seat(None, 0, 0));
    }
}
