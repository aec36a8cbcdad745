//! Which ranks share a host: one exchange of host ids (with each rank's
//! process identity, which [`Liveness`] looks at after a timeout), from
//! which every rank learns the host of every rank, its index among its
//! host's ranks, and its rail (the ranks with that index on every host).

use crate::comm::Bootstrap;
use crate::error::BootstrapError;
use crate::liveness::{Liveness, ProcessId};
use crate::record::{Malformed, Reader, Writer};

/// What a rank tells the others about its host and process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostRecord<'a> {
    /// The host id (`GIN_HOSTID` or [`default_host_id`]).
    pub host: &'a [u8],
    /// The encoded process identity ([`ProcessId`]).
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
    pub fn decode(rank: usize, b: &'a [u8]) -> Result<Self, Malformed> {
        let mut r = Reader::with_head(rank, "host record", b, 4)?;
        Ok(Self {
            host: r.prefixed()?,
            process: r.rest(),
        })
    }
}

/// Where the ranks of a job are, as one rank sees it.
#[derive(Debug, Clone)]
pub struct Topology {
    /// Each rank's host, numbered in order of first appearance (ranks with
    /// equal numbers share a host).
    pub hosts: Vec<usize>,
    /// How many distinct hosts.
    pub nhosts: usize,
    /// This rank's index among the ranks of its host.
    pub local_rank: usize,
    /// The ranks with this rank's local index, one per host (itself
    /// included).
    pub rail: Vec<usize>,
    /// Same-host peers' processes, looked at after a timeout.
    pub liveness: Liveness,
}

impl Topology {
    /// The topology `rank` sees from every rank's host id (`ids`, in rank
    /// order).
    pub fn from_ids<T: PartialEq>(rank: usize, ids: &[T], liveness: Liveness) -> Self {
        let n = ids.len();
        let mut distinct: Vec<&T> = Vec::new();
        let hosts: Vec<usize> = ids
            .iter()
            .map(|id| {
                distinct.iter().position(|d| *d == id).unwrap_or_else(|| {
                    distinct.push(id);
                    distinct.len() - 1
                })
            })
            .collect();
        let here = hosts.get(rank).copied();
        let local_rank = (0..n)
            .filter(|&r| Some(hosts[r]) == here)
            .position(|r| r == rank)
            .unwrap_or(0);
        let rail = (0..n)
            .filter(|&r| (0..n).filter(|&q| q < r && hosts[q] == hosts[r]).count() == local_rank)
            .collect();
        Self {
            hosts,
            nhosts: distinct.len(),
            local_rank,
            rail,
            liveness,
        }
    }
}

impl Bootstrap {
    /// Collective: every rank sends its host id (`GIN_HOSTID`, else
    /// [`default_host_id`]) and its process identity; every rank learns
    /// the job's [`Topology`]. A malformed record is an error naming the
    /// rank that sent it.
    pub fn topology(&self, host_id: &str) -> Result<Topology, BootstrapError> {
        let me = ProcessId::own().encode();
        let rec = HostRecord {
            host: host_id.as_bytes(),
            process: &me,
        }
        .encode();
        let recs = self.allgather(&rec)?;
        let mut ids = Vec::with_capacity(recs.len());
        let mut procs = Vec::with_capacity(recs.len());
        for (r, rec) in recs.iter().enumerate() {
            let HostRecord { host, process } = HostRecord::decode(r, rec)?;
            ids.push(host);
            procs.push(ProcessId::decode(process));
        }
        let liveness = Liveness::new(self.rank(), &procs);
        Ok(Topology::from_ids(self.rank(), &ids, liveness))
    }
}

/// Hostname plus kernel boot id: processes in another UTS namespace, or on
/// another machine, count as another host.
pub fn default_host_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    format!("{}/{}", host.trim(), boot.trim())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
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
    fn hosts_local_ranks_and_rails_follow_the_host_ids() {
        let ids = ["a", "b", "a", "b", "a"];
        let none = Liveness::new(0, &[]);
        let t = Topology::from_ids(2, &ids, none.clone());
        assert_eq!(t.hosts, [0, 1, 0, 1, 0]);
        assert_eq!((t.nhosts, t.local_rank), (2, 1));
        assert_eq!(t.rail, [2, 3]);
        let t = Topology::from_ids(4, &ids, none);
        assert_eq!((t.local_rank, t.rail), (2, vec![4]));
    }
}
