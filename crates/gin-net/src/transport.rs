//! The transport seam: what a transport does for the peers it reaches, and
//! the one place transports are registered and chosen.
//!
//! A transport moves bytes and performs atomics on one peer's memory:
//! put with an optional ordered signal, get, fetch-add, compare-swap, and
//! fence, confirm and health for what it sent. The [`crate::Fabric`]
//! checks every operation against its window directory first (the peer
//! exists, the range fits the peer's part) and then calls the peer's
//! transport with a [`Target`]: the window's description and offset, from
//! which the transport takes what it addresses by (a mapping here, or the
//! key the owner serves the part under), or a bare region key.
//!
//! # Adding a transport
//!
//! One module that implements [`Transport`] and exports a [`Registration`],
//! and one line in [`REGISTRY`]. [`select`] then offers it by name through
//! `GIN_TRANSPORT`, and `auto` uses the first registered transport of each
//! [`Scope`] (within a host, across hosts). Transports that need set-up
//! with their peers (addresses, connections) do it in their registration's
//! `start`, which every rank calls collectively when any rank of the job
//! chose the transport for some pair.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use gin_bootstrap::Bootstrap;

use crate::NetError;
use crate::region::RegionTable;
use crate::window::{Addr, KeepAlive, MemDesc, Memory};

/// How a transport addresses a peer's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reach {
    /// Through a mapping of the peer's part in this process (shared memory,
    /// or this rank itself): operations are loads and stores here, and the
    /// peer's parts must be mapped (window registration does that).
    Mapped,
    /// Through requests the peer's side executes, naming the part by the
    /// key the owner serves it under (tcp; RDMA transports later).
    Keyed,
}

/// What an operation addresses at a peer.
#[derive(Debug, Clone, Copy)]
pub enum Target<'a> {
    /// `(window, offset)` with the window's description, checked by the
    /// fabric against the peer's size.
    Window(&'a MemDesc, Addr),
    /// A region the peer serves under `key`, at `offset` (keyed transports
    /// only; the peer's side checks bounds and rights).
    Key {
        /// The region key.
        key: u32,
        /// Offset in the region.
        offset: u64,
    },
}

impl Target<'_> {
    /// The key and offset a keyed transport sends for this target at
    /// `peer`; refuses a window part the peer does not serve.
    pub fn key_at(&self, peer: usize, transport: &'static str) -> Result<(u32, u64), NetError> {
        match *self {
            Self::Window(d, a) => match d.key_of(peer) {
                0 => Err(NetError::NotServed {
                    peer,
                    window: a.window,
                    transport,
                }),
                k => Ok((k, a.offset)),
            },
            Self::Key { key, offset } => Ok((key, offset)),
        }
    }

    /// Checks that `len` bytes at a window target fit `peer`'s part (a bare
    /// key's range is the peer's to check).
    pub fn check_range(&self, peer: usize, len: u64) -> Result<(), NetError> {
        if let Self::Window(d, a) = *self {
            let size = d.size_of(peer);
            if a.offset.checked_add(len).is_none_or(|e| e > size) {
                return Err(NetError::OutOfBounds {
                    peer,
                    window: a.window,
                    offset: a.offset,
                    len,
                    size,
                });
            }
        }
        Ok(())
    }

    /// Checks that an 8-byte word at a window target is aligned at its
    /// owner (by the owner's address of its part, where known): keyed
    /// transports refuse a misaligned atomic or signal here rather than
    /// have the target refuse it and fail the path.
    pub fn check_aligned(&self, peer: usize, what: &'static str) -> Result<(), NetError> {
        if let Self::Window(d, a) = *self {
            let base = d.addrs.get(peer).copied().unwrap_or(0);
            if !base.wrapping_add(a.offset).is_multiple_of(8) {
                return Err(NetError::Misaligned {
                    peer,
                    window: a.window,
                    offset: a.offset,
                    what,
                });
            }
        }
        Ok(())
    }

    /// The window's description and address, for transports that reach
    /// memory through mappings; a bare key is not something they offer.
    pub fn window(&self, transport: &'static str) -> Result<(&MemDesc, Addr), NetError> {
        match *self {
            Self::Window(d, a) => Ok((d, a)),
            Self::Key { .. } => Err(NetError::Unsupported {
                transport,
                op: "operations on bare region keys",
            }),
        }
    }

    /// Host memory the host may load and store, or the error that says it
    /// is GPU memory.
    pub fn host(&self, peer: usize, transport: &'static str) -> Result<(), NetError> {
        match *self {
            Self::Window(d, a) if d.memory == Memory::Device => Err(NetError::DeviceMemory {
                peer,
                window: a.window,
                transport,
            }),
            _ => Ok(()),
        }
    }
}

/// A remote atomic on an aligned 8-byte word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtomicOp {
    /// Adds the amount; returns the old value.
    FetchAdd(u64),
    /// Stores `desired` where the word is `expected`; returns the old value.
    CompareSwap {
        /// The value to compare with.
        expected: u64,
        /// The value stored when they are equal.
        desired: u64,
    },
}

/// A check of the job as a whole that a transport's blocked sends ask
/// periodically (a rank died, the root was lost): an error ends the send
/// with that cause. It must not block.
pub type Alive = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

/// Where a transport reports a peer that left one of its requests unanswered
/// (or its connection undrained) for the job's whole timeout: `(peer, why)`.
/// The job tells every rank (see
/// [`gin_bootstrap::Bootstrap::report_unresponsive`]), so ranks waiting on
/// a third rank that gives up because of that peer name the peer, not the
/// third rank's departure. It must not block.
pub type Blame = Arc<dyn Fn(usize, &str) + Send + Sync>;

/// What a transport does for the peers it reaches. One instance serves
/// every peer the job chose it for; `peer` is always a rank of the job.
///
/// Completion: a put is complete locally on return (its source may be
/// reused); [`Transport::confirm`] says the target executed it. A signal
/// carried by a put is applied after the put's data, never when the data
/// was refused. Errors name the peer; refusals by the target are
/// [`NetError::Refused`] and leave the path to that peer in its error
/// state, as an RDMA QP.
pub trait Transport: Send + Sync + std::fmt::Debug + std::any::Any {
    /// The name used by `GIN_TRANSPORT`, paths, logs and errors.
    fn name(&self) -> &'static str;

    /// How it addresses a peer's memory.
    fn reach(&self) -> Reach;

    /// Writes `src` to `dst` at `peer`, then, if `sig` is given, adds its
    /// amount to the 8-byte word it names with release ordering: whoever
    /// sees the new value sees the data.
    fn put(
        &self,
        peer: usize,
        dst: Target<'_>,
        src: &[u8],
        sig: Option<(Target<'_>, u64)>,
    ) -> Result<(), NetError>;

    /// Starts a read of `len` bytes at `src` on `peer` into `dst`: `done`
    /// is decremented when the data has landed or the read failed (the
    /// caller incremented it first); `keep` is held until then.
    ///
    /// # Safety
    /// `dst` must be valid for writes of `len` bytes until `done` drops,
    /// or, if the caller may stop waiting before that, for as long as
    /// `keep` lives.
    unsafe fn get(
        &self,
        peer: usize,
        src: Target<'_>,
        dst: *mut u8,
        len: u64,
        done: &Arc<AtomicU64>,
        keep: Option<KeepAlive>,
    ) -> Result<(), NetError>;

    /// Reads `out.len()` bytes at `src` on `peer` into `out` and returns
    /// once they have landed, or with an error (at the latest after
    /// `timeout`). Nothing writes `out` after it returns.
    fn read(
        &self,
        peer: usize,
        src: Target<'_>,
        out: &mut [u8],
        timeout: Duration,
    ) -> Result<(), NetError>;

    /// An atomic on the aligned 8-byte word at `at` on `peer`; returns the
    /// old value.
    fn atomic(
        &self,
        peer: usize,
        at: Target<'_>,
        op: AtomicOp,
        timeout: Duration,
    ) -> Result<u64, NetError>;

    /// Returns once every earlier request to `peer` was executed there.
    fn fence(&self, peer: usize, timeout: Duration) -> Result<(), NetError>;

    /// Returns once every put to `peer` so far was executed there, or with
    /// the first refusal of any of them; cheap when nothing was put since
    /// the last confirmation.
    fn confirm(&self, peer: usize, timeout: Duration) -> Result<(), NetError>;

    /// The first error the path to `peer` saw, if any (sticky).
    fn health(&self, peer: usize) -> Result<(), NetError>;

    /// Hands the transport the job-health check its blocked operations
    /// should consult (set once; later calls may be ignored).
    fn watch(&self, alive: Alive) {
        let _ = alive;
    }

    /// Hands the transport where to report a peer that did not answer for
    /// the job's whole timeout (set once; later calls may be ignored). A
    /// transport whose requests a live peer answers on its own threads
    /// (whatever the peer's rank thread does) reports such a peer as
    /// stopped; the default reports nothing.
    fn blame_to(&self, blame: Blame) {
        let _ = blame;
    }

    /// Writes `src` to `dst` at `peer`, executed there after every earlier
    /// request to `peer` (a running total after the data it counts).
    /// Complete locally on return, as [`Transport::put`].
    ///
    /// The default is [`Transport::put`]: right for transports whose
    /// requests to one peer execute in order (one connection, as tcp).
    /// Transports that may reorder puts to one peer (ucx) fence first.
    fn put_ordered(&self, peer: usize, dst: Target<'_>, src: &[u8]) -> Result<(), NetError> {
        self.put(peer, dst, src, None)
    }

    /// Whether [`Transport::start_put`] of `len` bytes to `peer` may return
    /// with its source still lent (the transport reads it later, from the
    /// caller's memory, rather than copying it first). A caller that cannot
    /// track completion (one that reports the put complete on return) uses
    /// [`Transport::put`] for such puts. The default: never.
    fn lends_puts(&self, peer: usize, len: u64) -> bool {
        let _ = (peer, len);
        false
    }

    /// [`Transport::put`] from `len` bytes of this process's host memory at
    /// `src` that may return before the transport has read the source: no
    /// copy is made, and many are in flight. Returns the put's sequence
    /// number among the puts from lent memory to `peer` (shared with
    /// [`Transport::start_put_device`]'s), or 0 where it is complete on
    /// return (the default: [`Transport::put`], then 0).
    ///
    /// Complete locally (the source may be reused, `keep` dropped) once
    /// [`Transport::lent_puts_completed`] to `peer` answers at least its
    /// number, or once a later [`Transport::complete_device`],
    /// [`Transport::confirm`] or [`Transport::fence`] to `peer` returned,
    /// whether or not it succeeded. Its signal, if any, is applied at the
    /// target after its data, as [`Transport::put`]'s.
    ///
    /// # Safety
    /// `src..src + len` must be host memory of this process, valid for
    /// reads and that stays allocated until the put is complete locally as
    /// above or the transport was dropped (or, where `keep` owns that
    /// memory, for as long as `keep` is held); this holds also when the
    /// call returns an error after the put was issued (a failed signal):
    /// the put may still be in flight then, and the loan ends only as
    /// above. Writes to it meanwhile are no memory-safety matter but race
    /// with the data: the target may receive either bytes.
    unsafe fn start_put(
        &self,
        peer: usize,
        dst: Target<'_>,
        src: *const u8,
        len: u64,
        sig: Option<(Target<'_>, u64)>,
        keep: Option<KeepAlive>,
    ) -> Result<u64, NetError> {
        drop(keep);
        let n = usize::try_from(len).map_err(|_| too_long(peer, dst, len))?;
        // SAFETY: the caller lends `len` readable bytes at `src`, unwritten
        // until this returns (complete on return).
        let src = unsafe { std::slice::from_raw_parts(src, n) };
        self.put(peer, dst, src, sig)?;
        Ok(0)
    }

    /// Without blocking: how far the puts from lent memory to `peer`
    /// ([`Transport::start_put`]'s and [`Transport::start_put_device`]'s,
    /// one numbering) are complete locally, in order of their numbers, with
    /// the errors of [`Transport::device_puts_completed`], which this is.
    fn lent_puts_completed(&self, peer: usize) -> Result<u64, NetError> {
        self.device_puts_completed(peer)
    }

    /// Memory for this rank's part of a host window that no peer maps
    /// (every peer reaches it through a keyed transport), allocated the way
    /// this transport's remote operations need it, or `None` (the default)
    /// when any host memory serves as well. ucx allocates with UCX
    /// (`ucp_mem_map` with `UCP_MEM_MAP_ALLOCATE`): over UCX's shared
    /// memory, a peer's atomic into memory UCX allocated is that peer's own
    /// CPU atomic, while one into other memory is emulated by this rank's
    /// progress thread (docs/ucx.md, "Signal slots in memory UCX
    /// allocates").
    fn alloc_host(&self, bytes: usize) -> Option<Result<crate::HostMemory, NetError>> {
        let _ = bytes;
        None
    }

    /// Whether [`Transport::put_device`] and [`Transport::read_device`]
    /// move GPU memory of this process directly, with no staging through
    /// host memory (ucx with its CUDA transports).
    fn takes_device_memory(&self) -> bool {
        false
    }

    /// Writes `len` bytes of this process's GPU memory at device address
    /// `src` to `dst` at `peer`. Complete locally on return (the source may
    /// be reused); ordered before a later [`Transport::put_ordered`] to
    /// `peer`. The default refuses: see
    /// [`Transport::takes_device_memory`].
    ///
    /// # Safety
    /// `src..src + len` must be GPU memory of this process that no one
    /// writes until the call returns.
    unsafe fn put_device(
        &self,
        peer: usize,
        dst: Target<'_>,
        src: u64,
        len: u64,
    ) -> Result<(), NetError> {
        let _ = (peer, dst, src, len);
        Err(NetError::Unsupported {
            transport: self.name(),
            op: "puts from GPU memory",
        })
    }

    /// [`Transport::put_device`] that may return before the transport has
    /// read the source, so that many are in flight. Returns the put's
    /// sequence number among those started to `peer` (1 for the first,
    /// one more for each next), or 0 where the put is complete on return.
    ///
    /// Each is complete locally (and `keep` dropped) once
    /// [`Transport::device_puts_completed`] to `peer` answers at least its
    /// number, or once a later [`Transport::complete_device`],
    /// [`Transport::confirm`] or [`Transport::fence`] to `peer` returned,
    /// whether or not it succeeded. Ordered as `put_device`: before a later
    /// [`Transport::put_ordered`] to `peer` at the target. The default is
    /// `put_device` (complete on return: 0).
    ///
    /// # Safety
    /// `src..src + len` must be GPU memory of this process that no one
    /// writes, and that stays allocated, until the put is complete locally
    /// as above or the transport was dropped (or, where `keep` owns that
    /// memory, for as long as `keep` is held).
    unsafe fn start_put_device(
        &self,
        peer: usize,
        dst: Target<'_>,
        src: u64,
        len: u64,
        keep: Option<KeepAlive>,
    ) -> Result<u64, NetError> {
        drop(keep);
        // SAFETY: the caller's contract covers `put_device`'s.
        unsafe { self.put_device(peer, dst, src, len) }?;
        Ok(0)
    }

    /// Without blocking: how far the [`Transport::start_put_device`]s to
    /// `peer` are complete locally, in order of their sequence numbers:
    /// every put numbered at or below the answer is complete (the
    /// transport reads none of their sources any more). A put that
    /// completes before an earlier one is covered only once the earlier one
    /// is. The answer never decreases; the default, for transports whose
    /// puts complete on return (numbered 0), is 0: a transport that numbers
    /// its puts must answer itself (a wrapper that forwards
    /// `start_put_device` but not this leaves its puts in flight until
    /// [`Transport::complete_device`], never complete too early).
    ///
    /// An error names the peer: a put to it failed, its path failed, or no
    /// put to it completed for the job's whole timeout while some were in
    /// flight (which fails the path). A put's failure is reported only once
    /// every put numbered before it is complete (those answered complete
    /// before it succeeded), and [`Transport::device_put_failed`] then
    /// names it. After an error the puts not yet complete may still read
    /// their sources: [`Transport::complete_device`] waits for them.
    fn device_puts_completed(&self, peer: usize) -> Result<u64, NetError> {
        let _ = peer;
        Ok(0)
    }

    /// After [`Transport::device_puts_completed`] to `peer` failed because
    /// a put from GPU memory failed: that put's number (every put numbered
    /// below it completed successfully), so that its caller blames it
    /// rather than the oldest put in flight. `None` where the failure was
    /// not one put's (the path's, a stall, the job's) or is not known; the
    /// default.
    fn device_put_failed(&self, peer: usize) -> Option<u64> {
        let _ = peer;
        None
    }

    /// Whether [`Transport::put_ordered`] to a peer waits (blocks) until
    /// the puts from GPU memory started to it before are complete, rather
    /// than ordering itself after them without waiting (ucx with
    /// `GIN_UCX_GPU_ORDER=wait`, its default). A caller that must not block
    /// holds such a request back until
    /// [`Transport::device_puts_completed`] covers the puts it follows,
    /// then sends it with [`Transport::put_ordered_after`]. The default:
    /// no.
    fn ordered_waits_for_device_puts(&self) -> bool {
        false
    }

    /// [`Transport::put_ordered`] that, where it waits for puts from GPU
    /// memory ([`Transport::ordered_waits_for_device_puts`]), waits only
    /// for those to `peer` numbered at or below `after` (a sequence number
    /// [`Transport::start_put_device`] returned), not for any started
    /// since: executed at `peer` after every earlier request to it all the
    /// same. The default is [`Transport::put_ordered`].
    fn put_ordered_after(
        &self,
        peer: usize,
        dst: Target<'_>,
        src: &[u8],
        after: u64,
    ) -> Result<(), NetError> {
        let _ = after;
        self.put_ordered(peer, dst, src)
    }

    /// Returns once every [`Transport::start_put_device`] to `peer` so far
    /// is complete locally (the transport reads none of their sources any
    /// more, also when this returns an error), or with the first failure
    /// among them (at the latest after `timeout` plus the time the
    /// transport needs to cancel them). The default has nothing to wait
    /// for.
    fn complete_device(&self, peer: usize, timeout: Duration) -> Result<(), NetError> {
        let _ = (peer, timeout);
        Ok(())
    }

    /// Reads `len` bytes at `src` on `peer` into this process's GPU memory
    /// at device address `dst` and returns once they have landed (after
    /// every earlier request to `peer`), or with an error (at the latest
    /// after `timeout`). Nothing writes `dst` after it returns. The default
    /// refuses: see [`Transport::takes_device_memory`].
    ///
    /// # Safety
    /// `dst..dst + len` must be GPU memory of this process that nothing
    /// else reads or writes until the call returns.
    unsafe fn read_device(
        &self,
        peer: usize,
        src: Target<'_>,
        dst: u64,
        len: u64,
        timeout: Duration,
    ) -> Result<(), NetError> {
        let _ = (peer, src, dst, len, timeout);
        Err(NetError::Unsupported {
            transport: self.name(),
            op: "reads into GPU memory",
        })
    }
}

/// What a transport's start needs from the job.
#[derive(Debug)]
pub struct Setup<'a> {
    /// The job's bootstrap (address exchange, barriers).
    pub bootstrap: &'a Bootstrap,
    /// The regions this rank serves.
    pub table: Arc<RegionTable>,
    /// The job's timeout.
    pub timeout: Duration,
}

/// Which peers a transport can reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Only ranks of this host.
    Host,
    /// Ranks on any host.
    Any,
}

/// Starts a transport for the peers marked in the slice (collective: every
/// rank calls it once any rank chose the transport).
pub type StartFn = fn(&Setup<'_>, &[bool]) -> Result<Arc<dyn Transport>, NetError>;

/// A transport the fabric can choose.
#[derive(Debug)]
pub struct Registration {
    /// Its name (`GIN_TRANSPORT`).
    pub name: &'static str,
    /// Which peers it can reach.
    pub scope: Scope,
    /// How it is started for a job.
    pub start: StartFn,
}

/// Every transport, in order of preference for `auto`.
pub static REGISTRY: &[Registration] = &[
    crate::shm::REGISTRATION,
    crate::tcp::REGISTRATION,
    crate::ucx::REGISTRATION,
];

/// The registered transports' names, in order.
pub fn names() -> Vec<&'static str> {
    REGISTRY.iter().map(|r| r.name).collect()
}

/// The registered transport called `name`.
pub fn find(name: &str) -> Result<&'static Registration, NetError> {
    REGISTRY
        .iter()
        .find(|r| r.name == name)
        .ok_or_else(|| NetError::UnknownTransport {
            name: name.into(),
            available: std::iter::once("auto")
                .chain(names())
                .collect::<Vec<_>>()
                .join(", "),
        })
}

/// `GIN_TRANSPORT_REMOTE`: the transport for peers on other hosts, whatever
/// `GIN_TRANSPORT` chose within a host (unset, empty or `auto`: as
/// `GIN_TRANSPORT` says). `GIN_TRANSPORT=auto GIN_TRANSPORT_REMOTE=ucx` is
/// shared memory within a host and UCX across hosts.
pub const REMOTE_ENV: &str = "GIN_TRANSPORT_REMOTE";

/// The transport `rank` uses for each peer (`None`: the rank itself, which
/// reaches its own memory directly), from the ranks' host indices (equal:
/// same host), the transport asked for (`None`: auto, the first
/// host-scope transport within a host and the first any-scope one across
/// hosts) and [`REMOTE_ENV`] from this process's environment (every rank
/// of a job is given the same). See [`select_with`].
pub fn select(
    rank: usize,
    hosts: &[usize],
    wanted: Option<&str>,
) -> Result<Vec<Option<&'static Registration>>, NetError> {
    let remote = std::env::var(REMOTE_ENV).ok();
    let remote = remote.as_deref().map(str::trim);
    select_with(
        rank,
        hosts,
        wanted,
        remote.filter(|r| !r.is_empty() && *r != "auto"),
    )
}

/// [`select`] with the transport for peers on other hosts given (`None`:
/// as `wanted` says). Pure: every rank computes every rank's choice alike.
pub fn select_with(
    rank: usize,
    hosts: &[usize],
    wanted: Option<&str>,
    remote: Option<&str>,
) -> Result<Vec<Option<&'static Registration>>, NetError> {
    let here = hosts.get(rank).copied();
    let same = |p: usize| hosts.get(p).copied() == here;
    let others: Vec<usize> = (0..hosts.len()).filter(|&p| !same(p)).collect();
    let host_only = |r: &'static Registration| {
        if r.scope == Scope::Host && !others.is_empty() {
            return Err(NetError::HostOnly {
                transport: r.name,
                others: others.clone(),
            });
        }
        Ok(())
    };
    let pick = |scope: Scope| REGISTRY.iter().find(|r| r.scope == scope);
    let (within, mut across) = match wanted {
        None => (pick(Scope::Host), pick(Scope::Any)),
        Some(name) => {
            let r = find(name)?;
            if remote.is_none() {
                host_only(r)?;
            }
            (Some(r), Some(r))
        }
    };
    if let Some(name) = remote {
        let r = find(name)?;
        host_only(r)?;
        across = Some(r);
    }
    (0..hosts.len())
        .map(|p| {
            if p == rank {
                return Ok(None);
            }
            let r = if same(p) { within.or(across) } else { across };
            r.map(Some).ok_or_else(|| NetError::UnknownTransport {
                name: "any transport across hosts".into(),
                available: names().join(", "),
            })
        })
        .collect()
}

/// The error for a length of `len` bytes to `t` at `peer` that this
/// process cannot address.
pub(crate) fn too_long(peer: usize, t: Target<'_>, len: u64) -> NetError {
    let (window, offset) = match t {
        Target::Window(_, a) => (a.window, a.offset),
        Target::Key { offset, .. } => (0, offset),
    };
    NetError::OutOfBounds {
        peer,
        window,
        offset,
        len,
        size: usize::MAX as u64,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

    use super::*;

    fn chosen(rank: usize, hosts: &[usize], wanted: Option<&str>) -> Vec<&'static str> {
        select(rank, hosts, wanted)
            .unwrap()
            .into_iter()
            .map(|r| r.map_or("local", |r| r.name))
            .collect()
    }

    #[test]
    fn auto_takes_shm_within_a_host_and_tcp_across() {
        let hosts = [0, 0, 1, 1];
        assert_eq!(chosen(0, &hosts, None), ["local", "shm", "tcp", "tcp"]);
        assert_eq!(chosen(3, &hosts, None), ["tcp", "tcp", "shm", "local"]);
        assert_eq!(chosen(1, &[0, 0], None), ["shm", "local"]);
    }

    #[test]
    fn a_named_transport_reaches_every_peer_or_says_why_not() {
        assert_eq!(chosen(0, &[0, 0], Some("tcp")), ["local", "tcp"]);
        assert_eq!(chosen(1, &[0, 0, 0], Some("shm")), ["shm", "local", "shm"]);
        let e = select(0, &[0, 1, 0, 2], Some("shm")).unwrap_err();
        assert!(
            matches!(&e, NetError::HostOnly { transport: "shm", others } if others == &[1, 3]),
            "{e}"
        );
        assert!(e.to_string().contains("shm reaches only this host"), "{e}");
        let e = select(0, &[0, 0], Some("infiniband"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("infiniband") && e.contains("auto, shm, tcp"),
            "{e}"
        );
    }

    #[test]
    fn a_remote_transport_serves_only_peers_on_other_hosts() {
        let chosen_with = |rank, hosts: &[usize], wanted, remote| -> Vec<&'static str> {
            select_with(rank, hosts, wanted, remote)
                .unwrap()
                .into_iter()
                .map(|r| r.map_or("local", |r| r.name))
                .collect()
        };
        let hosts = [0, 0, 1, 1];
        assert_eq!(
            chosen_with(0, &hosts, None, Some("ucx")),
            ["local", "shm", "ucx", "ucx"]
        );
        assert_eq!(
            chosen_with(3, &hosts, None, Some("ucx")),
            ["ucx", "ucx", "shm", "local"]
        );
        // A host-scope transport asked for within hosts is fine when the
        // remote one covers the others.
        assert_eq!(
            chosen_with(1, &hosts, Some("shm"), Some("tcp")),
            ["shm", "local", "tcp", "tcp"]
        );
        // One host: the remote transport has no peer to serve.
        assert_eq!(chosen_with(0, &[0, 0], None, Some("ucx")), ["local", "shm"]);
        let e = select_with(0, &hosts, None, Some("shm")).unwrap_err();
        assert!(
            matches!(&e, NetError::HostOnly { transport: "shm", others } if others == &[2, 3]),
            "{e}"
        );
        let e = select_with(0, &hosts, None, Some("carrier-pigeon"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("carrier-pigeon"), "{e}");
    }

    #[test]
    fn every_registered_name_is_unique() {
        let n = names();
        let mut d = n.clone();
        d.sort_unstable();
        d.dedup();
        assert_eq!(n.len(), d.len());
        assert!(n.iter().all(|x| find(x).is_ok()));
    }
}
