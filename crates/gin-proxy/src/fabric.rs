//! The executor of CPU ranks: gin-net's [`Fabric`], synchronous.
//!
//! Every put completes locally before it returns (shm: copied; tcp: written
//! to the ordered link), its signal applied after the data as an add at the
//! target, except a put the transport lends its source to (large puts over
//! ucx: no copy), which is in flight until the transport's count of puts
//! from lent memory covers it; a tcp get is in flight until its answer lands, and fails once
//! it has not for the fabric's timeout (a stopped peer never answers, and
//! the transport sets no deadline on a get); a counter is a
//! local add; publication is a release store of the [`Ring`]'s completion
//! index; a waiter's [`Executor::confirm`] asks a tcp peer to confirm what it
//! was sent.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use gin_device::Counters;
use gin_net::{Addr, Fabric, MemDesc, Memory, NetError};

use crate::error::ExecError;
use crate::executor::{Executor, Get, Issued, Put, Site, Source, Target};
use crate::ring::Ring;

/// gin-net's fabric as an [`Executor`] for CPU ranks. Cheap to clone: the
/// proxy keeps one for the producers' direct sends and confirmations, and
/// the engine another (behind the driver's lock: the driver thread and,
/// for lent puts, a rank's own thread take turns stepping with it).
#[derive(Debug, Clone)]
pub(crate) struct FabricExecutor {
    fabric: Arc<Fabric>,
    counters: Arc<Counters>,
    rings: Arc<[Arc<Ring>]>,
}

/// A get or a put in flight.
#[derive(Debug)]
pub(crate) enum InFlight {
    /// A get, counted down by the transport when its answer landed, given
    /// up on once it has not for the fabric's timeout.
    Get {
        done: Arc<AtomicU64>,
        since: Instant,
        bytes: u64,
        offset: u64,
        window: u32,
    },
    /// A put whose source the transport reads from the window's memory
    /// (lent, not copied: [`Fabric::start_put_in`]): complete once the
    /// transport's count of puts from lent memory to the peer covers
    /// `seq`. The transport holds the window's keep-alive until then, and
    /// fails the count (naming the peer) when none completes for the
    /// fabric's timeout or the job fails.
    Put { seq: u64 },
}

impl FabricExecutor {
    /// An executor over `fabric`, bumping `counters`, publishing completion
    /// into `rings` (indexed as the engine's rings).
    pub(crate) fn new(
        fabric: Arc<Fabric>,
        counters: Arc<Counters>,
        rings: Arc<[Arc<Ring>]>,
    ) -> Self {
        Self {
            fabric,
            counters,
            rings,
        }
    }

    /// The fabric.
    pub(crate) fn fabric(&self) -> &Arc<Fabric> {
        &self.fabric
    }

    /// The address of this rank's `bytes` at `t`, checked against its part
    /// right here, where the memory is touched.
    fn local(&self, t: &Target<Arc<MemDesc>>, bytes: u64) -> Result<usize, ExecError> {
        let rank = self.fabric.rank();
        let size = t.window.sizes.get(rank).copied().unwrap_or(0);
        if t.window.local_base == 0 || t.offset.checked_add(bytes).is_none_or(|e| e > size) {
            return Err(ExecError::Invalid {
                why: format!(
                    "{bytes} bytes at offset {} exceed rank {rank}'s {size} bytes of window {}",
                    t.offset, t.id
                ),
            });
        }
        Ok(t.window.local_base + t.offset as usize)
    }
}

/// A fabric error as an executor error, keeping its words.
pub(crate) fn net(peer: usize, e: NetError) -> ExecError {
    match e {
        NetError::Refused { peer, .. } | NetError::Revoked { peer, .. } => {
            let words = e.to_string();
            let why = words
                .strip_prefix(&format!("rank {peer}: "))
                .map_or_else(|| words.clone(), str::to_owned);
            ExecError::Refused { peer, why }
        }
        NetError::Timeout { peer, what, waited } => ExecError::Timeout { peer, what, waited },
        e if e.is_local_refusal() => ExecError::Invalid { why: e.to_string() },
        e => ExecError::Unreachable {
            peer: e.peer().unwrap_or(peer),
            why: e.to_string(),
        },
    }
}

fn addr<W>(t: &Target<W>) -> Addr {
    Addr {
        window: t.id,
        offset: t.offset,
    }
}

impl Executor for FabricExecutor {
    type Window = Arc<MemDesc>;
    type InFlight = InFlight;

    /// Host windows only: a GPU window (`Memory::Device`, registered by a
    /// CUDA rank of the same communicator) has device addresses this
    /// executor must never load or store, so a descriptor naming one is
    /// refused as naming an unknown window.
    fn window(&self, id: u32) -> Option<Arc<MemDesc>> {
        self.fabric
            .window(id)
            .ok()
            .filter(|w| w.memory == Memory::Host)
    }

    fn part_size(&self, window: &Arc<MemDesc>, owner: usize) -> u64 {
        window.sizes.get(owner).copied().unwrap_or(0)
    }

    /// Complete on return, or, for a put from a window the transport lends
    /// rather than copies ([`Fabric::lends_puts`]: large puts over ucx), in
    /// flight until the transport read the source: its counter is counted
    /// and the ring published past it only then, so a producer reuses the
    /// source only after the transport is done with it (the API's local
    /// completion).
    fn put(&mut self, site: Site, put: &Put<Arc<MemDesc>>) -> Result<Issued<InFlight>, ExecError> {
        let peer = site.peer;
        let sig = put
            .signal
            .as_ref()
            .map(|s| (&*s.at.window, addr(&s.at), s.add));
        let r = match (&put.data, sig) {
            (None, None) => Ok(()),
            // A signal alone: no data, aimed at the signal's own slot.
            (None, Some((w, a, v))) => self.fabric.put_in(peer, (w, a), &[], Some((w, a, v))),
            (Some(d), sig) => {
                let inline;
                let src = match &d.src {
                    Source::Inline(v) => {
                        inline = v.to_le_bytes();
                        &inline[..(d.bytes as usize).min(8)]
                    }
                    // Lent only from a window whose keep-alive owns this
                    // rank's part (a segment gin-net made): a put can
                    // outlive a failed wait holding only the keep-alive,
                    // and a registered buffer's owner may free it once
                    // told the wait failed. Others are copied.
                    Source::Window(t)
                        if t.window.keeps_local() && self.fabric.lends_puts(peer, d.bytes) =>
                    {
                        let at = self.local(t, d.bytes)?;
                        // SAFETY: `local` checked the range against this
                        // rank's registered part of the window; the
                        // window's keep-alive, which owns that part
                        // (`keeps_local`), handed to the transport, keeps
                        // it mapped until the put completed, and the
                        // producer does not write it before then: it was
                        // promised nothing (no counter, no publication)
                        // until `landed` says the put is complete.
                        let seq = unsafe {
                            self.fabric.start_put_in(
                                peer,
                                (&d.dst.window, addr(&d.dst)),
                                at as *const u8,
                                d.bytes,
                                sig,
                                t.window.keep.clone(),
                            )
                        }
                        .map_err(|e| net(peer, e))?;
                        // Complete already (shared memory's cma copies
                        // within the call): no poll needed.
                        let done = seq == 0
                            || self
                                .fabric
                                .lent_puts_completed(peer)
                                .map_err(|e| net(peer, e))?
                                >= seq;
                        return Ok(if done {
                            Issued::Ordered
                        } else {
                            Issued::InFlight(InFlight::Put { seq })
                        });
                    }
                    Source::Window(t) => {
                        let at = self.local(t, d.bytes)?;
                        // SAFETY: `local` checked the range against this
                        // rank's registered part of the window; the
                        // description held across the put (`t.window`, with
                        // its keep-alive) keeps it mapped even if its owner
                        // drops the window meanwhile, and the slice lives
                        // only for the put below.
                        unsafe { std::slice::from_raw_parts(at as *const u8, d.bytes as usize) }
                    }
                };
                self.fabric
                    .put_in(peer, (&d.dst.window, addr(&d.dst)), src, sig)
            }
        };
        r.map(|()| Issued::Ordered).map_err(|e| net(peer, e))
    }

    fn get(&mut self, site: Site, get: &Get<Arc<MemDesc>>) -> Result<Issued<InFlight>, ExecError> {
        let dst = self.local(&get.local, get.bytes)? as *mut u8;
        let done = Arc::new(AtomicU64::new(1));
        // SAFETY: `dst` is `get.bytes` inside this rank's registered part
        // (checked by `local`). The transport holds the window's keep-alive
        // until the answer has landed, so a window its owner drops with the
        // get in flight stays mapped until then; a window without one (its
        // owner keeps the memory) outlives every context by construction.
        unsafe {
            self.fabric.get_in(
                site.peer,
                (&get.remote.window, addr(&get.remote)),
                dst,
                get.bytes,
                &done,
                get.local.window.keep.clone(),
            )
        }
        .map_err(|e| net(site.peer, e))?;
        if done.load(Ordering::Acquire) == 0 {
            Ok(Issued::Ordered)
        } else {
            Ok(Issued::InFlight(InFlight::Get {
                done,
                since: Instant::now(),
                bytes: get.bytes,
                offset: get.remote.offset,
                window: get.remote.id,
            }))
        }
    }

    /// Whether the get's answer landed; a get unanswered for the fabric's
    /// timeout fails, naming the peer (the transport sets no deadline on
    /// it: a stopped peer's would never land, and a proxy stopping waits
    /// for what is in flight). Its landing buffer stays lent to the
    /// transport, which holds the window's keep-alive until it lands.
    ///
    /// A put from lent memory: whether the transport's in-order count of
    /// them covers it (without blocking); its errors (the peer's path
    /// failed, a put to it failed, none completed for the timeout, the job
    /// failed) name the peer.
    fn landed(&mut self, site: Site, op: &mut InFlight) -> Result<bool, ExecError> {
        let (done, since, bytes, offset, window) = match op {
            InFlight::Put { seq } => {
                let upto = self
                    .fabric
                    .lent_puts_completed(site.peer)
                    .map_err(|e| net(site.peer, e))?;
                return Ok(upto >= *seq);
            }
            InFlight::Get {
                done,
                since,
                bytes,
                offset,
                window,
            } => (done, since, bytes, offset, window),
        };
        if done.load(Ordering::Acquire) == 0 {
            return Ok(true);
        }
        let waited = since.elapsed();
        if waited >= self.fabric.timeout() {
            return Err(ExecError::Timeout {
                peer: site.peer,
                what: format!(
                    "the answer to a get of {bytes} bytes at offset {offset} of its part of window {window}"
                ),
                waited,
            });
        }
        Ok(false)
    }

    fn count(&mut self, _: Site, slot: u32, _total: u64) -> Result<(), ExecError> {
        // Other paths (the direct path, sends without the ring) bump the
        // same counters: add, never store the engine's total.
        match self.counters.slot(u64::from(slot)) {
            Some(c) => {
                c.fetch_add(1, Ordering::Release);
                Ok(())
            }
            None => Err(ExecError::Invalid {
                why: format!(
                    "counter slot {slot} does not exist ({} slots)",
                    self.counters.len()
                ),
            }),
        }
    }

    fn publish(&mut self, site: Site, upto: u64) -> Result<(), ExecError> {
        match self.rings.get(site.ring) {
            Some(r) => {
                r.advance(upto);
                Ok(())
            }
            None => Err(ExecError::Invalid {
                why: format!("no ring {} to publish into", site.ring),
            }),
        }
    }

    fn confirm(&self, peer: usize) -> Result<(), ExecError> {
        self.fabric.confirm(peer).map_err(|e| net(peer, e))
    }

    fn health(&self) -> Result<(), ExecError> {
        self.fabric
            .health()
            .map_err(|e| ExecError::Transport { why: e.to_string() })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

    use std::time::Duration;

    use gin_net::MemParts;
    use gin_net::region::RegionTable;

    use super::*;
    use crate::descriptor::{Desc, Op};
    use crate::engine::{EngineConfig, RingSpec};
    use crate::error::{Invalid, ProxyError, Why};
    use crate::ring::RingMem;
    use crate::{Engine, Progress};

    /// A GPU window in the fabric's directory (a CUDA rank of the same
    /// communicator registered it) is never loaded or stored by the CPU
    /// ranks' executor: a descriptor naming it fails as naming an unknown
    /// window, before anything moves, while a host window next to it works.
    #[test]
    fn gpu_windows_are_refused_by_the_cpu_executor() {
        let fabric = Arc::new(Fabric::local(
            Arc::new(RegionTable::default()),
            Duration::from_secs(1),
        ));
        let mut mem = vec![0u64; 8].into_boxed_slice();
        mem[0] = 0x1122_3344;
        let base = mem.as_mut_ptr() as usize;
        let host = MemParts {
            local_base: base,
            sizes: vec![64],
            peer_bases: vec![base],
            keys: vec![0],
            addrs: vec![base as u64],
            states: vec![0],
            ..MemParts::default()
        };
        // SAFETY: `mem` (64 bytes) outlives the fabric's users below.
        fabric.add_window(1, unsafe { MemDesc::new(host) });
        let device = MemParts {
            memory: Memory::Device,
            local_base: 0x7f00_dead_0000,
            sizes: vec![64],
            peer_bases: vec![0x7f00_dead_0000],
            keys: vec![0],
            addrs: vec![0x7f00_dead_0000],
            states: vec![0],
            keep: None,
        };
        // SAFETY: a device window nobody dereferences in this test: the
        // executor must refuse it (which is what is tested).
        fabric.add_window(2, unsafe { MemDesc::new(device) });
        let ring = Arc::new(Ring::new(3));
        let counters = Arc::new(Counters::new(1));
        let mut exec = FabricExecutor::new(fabric, counters, Arc::from(vec![ring.clone()]));
        assert!(exec.window(1).is_some());
        assert!(exec.window(2).is_none());
        let put = |dst_window, src_window| Desc {
            op: Op::Put,
            bytes: 8,
            dst_window,
            dst_offset: 8,
            src_window,
            src_offset: 0,
            inline: None,
            signal: None,
            counter: None,
        };
        ring.write(0, &put(1, 1));
        ring.write(1, &put(1, 2));
        ring.write(2, &put(2, 1));
        let config = EngineConfig {
            rank: 0,
            batch: 8,
            counter_slots: 1,
        };
        let spec = RingSpec {
            ctx: 0,
            peer: 0,
            mem: RingMem::owned(ring.clone()),
            first: 0,
        };
        let mut engine = Engine::new(config, vec![spec]);
        let p = engine.step(&mut exec);
        assert_eq!(
            p,
            Progress {
                executed: 1,
                landed: 0,
                published: 1
            }
        );
        assert_eq!(mem[1], 0x1122_3344);
        assert_eq!(ring.tail(), 1);
        let e = engine.failure().unwrap();
        assert!(
            matches!(
                e,
                ProxyError::Descriptor {
                    seq: 1,
                    why: Why::Invalid(Invalid::UnknownWindow { window: 2 }),
                    ..
                }
            ),
            "{e}"
        );
    }

    /// Rank 0 with peer 1 over a recorder that lends host puts of 4 KiB
    /// and more and holds them in flight until the test completes them;
    /// window 1 (rank 0's part: 16 KiB of memory that only the window's
    /// keep-alive owns, watched through `Weak`) served to peer 1 under key
    /// 0x77; one ring to peer 1 and one counter.
    struct Lending {
        keyed: Arc<gin_net::testing::KeyedRecorder>,
        fabric: Arc<Fabric>,
        mem: std::sync::Weak<Box<[u64]>>,
        base: usize,
        ring: Arc<Ring>,
        counters: Arc<Counters>,
        exec: FabricExecutor,
        engine: Engine<FabricExecutor>,
    }

    fn lending() -> Lending {
        lending_from(true)
    }

    /// [`lending`], where `owned` says whether window 1's keep-alive owns
    /// rank 0's part (a segment gin-net allocated) or not (a caller's
    /// buffer registered as a window: the memory is then kept here by
    /// the test, not by the keep-alive).
    fn lending_from(owned: bool) -> Lending {
        use gin_net::testing::KeyedRecorder;
        use gin_net::{KeepAlive, Path};

        let keyed = Arc::new(KeyedRecorder::default().lending_host_puts(4096));
        keyed.hold_device_puts();
        let fabric = Arc::new(Fabric::new(
            0,
            vec![Path::local(), Path::new(keyed.clone())],
            Arc::new(RegionTable::default()),
            Duration::from_secs(60),
        ));
        let mem: Arc<Box<[u64]>> = Arc::new(vec![0x5a5a_5a5a_5a5a_5a5a; 2048].into_boxed_slice());
        let base = mem.as_ptr() as usize;
        let weak = Arc::downgrade(&mem);
        let host = MemParts {
            local_base: base,
            sizes: vec![16 << 10, 16 << 10],
            peer_bases: vec![base, 0],
            keys: vec![0, 0x77],
            addrs: vec![base as u64, 0x1000],
            states: vec![0, 0],
            keep: Some(if owned {
                KeepAlive(mem)
            } else {
                // The memory leaks for the test's length (a registered
                // buffer's owner holds it); the keep-alive owns nothing.
                std::mem::forget(mem);
                KeepAlive(Arc::new(()))
            }),
            ..MemParts::default()
        };
        // SAFETY: `base` is 16 KiB that the keep-alive owns (or that is
        // never freed) and nobody writes.
        let desc = unsafe { MemDesc::new(host) };
        // SAFETY: where `owned`, the keep-alive owns the part.
        let desc = if owned {
            // SAFETY: as above: the keeper owns the part.
            unsafe { desc.keeping_local() }
        } else {
            desc
        };
        fabric.add_window(1, desc);
        let ring = Arc::new(Ring::new(3));
        let counters = Arc::new(Counters::new(1));
        let exec = FabricExecutor::new(
            fabric.clone(),
            counters.clone(),
            Arc::from(vec![ring.clone()]),
        );
        let config = EngineConfig {
            rank: 0,
            batch: 8,
            counter_slots: 1,
        };
        let spec = RingSpec {
            ctx: 0,
            peer: 1,
            mem: RingMem::owned(ring.clone()),
            first: 0,
        };
        Lending {
            keyed,
            fabric,
            mem: weak,
            base,
            ring,
            counters,
            exec,
            engine: Engine::new(config, vec![spec]),
        }
    }

    /// A put of `bytes` from window 1 at `src_offset` to peer 1's part at
    /// `dst_offset`, counted in counter 0, with a signal at 8 KiB + 8.
    fn lent_put(bytes: u64, src_offset: u64, dst_offset: u64) -> Desc {
        Desc {
            op: Op::Put,
            bytes,
            dst_window: 1,
            dst_offset,
            src_window: 1,
            src_offset,
            inline: None,
            signal: Some(crate::descriptor::Sig {
                window: 1,
                offset: (8 << 10) + 8,
                add: 3,
                strong: true,
            }),
            counter: Some(0),
        }
    }

    /// A put the transport lends its source to (8 KiB, over the recorder's
    /// 4 KiB) is handed over as the window's own memory (its address, no
    /// copy) with its signal, and stays in flight: its counter is not
    /// counted, the ring is not published past it (a later put, copied and
    /// complete at once, is executed meanwhile but not published), and the
    /// transport holds the window's keeper, until the transport says the
    /// put is complete. Then both are counted and published and the keeper
    /// is let go.
    #[test]
    fn a_lent_put_is_counted_and_published_only_once_the_transport_is_done_with_its_source() {
        use gin_net::testing::KeyedOp;

        let mut r = lending();
        r.ring.write(0, &lent_put(8 << 10, 4096, 0));
        r.ring.write(
            1,
            &Desc {
                signal: None,
                ..lent_put(64, 0, 8 << 10)
            },
        );
        let p = r.engine.step(&mut r.exec);
        assert_eq!((p.executed, p.published), (2, 0), "{p:?}");
        assert!(r.engine.failure().is_none(), "{:?}", r.engine.failure());
        let ops = r.keyed.ops();
        assert_eq!(
            ops[0],
            KeyedOp::PutLent {
                peer: 1,
                key: 0x77,
                offset: 0,
                src: (r.base + 4096) as u64,
                len: 8 << 10,
                signal: Some((0x77, (8 << 10) + 8, 3)),
            }
        );
        assert!(
            matches!(&ops[1], KeyedOp::Put { bytes, offset, .. } if bytes.len() == 64 && *offset == 8 << 10),
            "{ops:?}"
        );
        assert_eq!(r.counters.slot(0).unwrap().load(Ordering::Acquire), 0);
        assert_eq!(r.ring.tail(), 0);
        assert_eq!(r.keyed.lent_keepers(), 1);
        // Polled again, still in flight: nothing changes.
        let p = r.engine.step(&mut r.exec);
        assert_eq!((p.landed, p.published), (0, 0), "{p:?}");
        assert_eq!(r.ring.tail(), 0);
        r.keyed.complete_device_puts(1);
        let p = r.engine.step(&mut r.exec);
        assert!(p.published > 0, "{p:?}");
        assert_eq!(r.ring.tail(), 2);
        assert_eq!(r.counters.slot(0).unwrap().load(Ordering::Acquire), 2);
        assert_eq!(r.keyed.lent_keepers(), 0);
        assert!(r.engine.failure().is_none(), "{:?}", r.engine.failure());
    }

    /// A put from a window whose keep-alive does not own this rank's part
    /// (a caller's buffer registered as a window) is copied, not lent,
    /// however large: a lent put can outlive a failed wait holding only
    /// the keep-alive, and the buffer's owner may free it once told the
    /// wait failed. It is complete at once: counted and published in the
    /// step that executed it, and the transport holds no keeper.
    #[test]
    fn a_put_from_a_registered_buffer_is_copied_not_lent() {
        use gin_net::testing::KeyedOp;

        let mut r = lending_from(false);
        // No signal: the recorder's copied puts carry none.
        r.ring.write(
            0,
            &Desc {
                signal: None,
                ..lent_put(8 << 10, 4096, 0)
            },
        );
        let p = r.engine.step(&mut r.exec);
        assert!(r.engine.failure().is_none(), "{:?}", r.engine.failure());
        assert_eq!((p.executed, p.published), (1, 1), "{p:?}");
        let ops = r.keyed.ops();
        assert!(
            matches!(&ops[0], KeyedOp::Put { bytes, offset: 0, .. } if bytes.len() == 8 << 10),
            "{ops:?}"
        );
        assert!(
            !ops.iter().any(|o| matches!(o, KeyedOp::PutLent { .. })),
            "{ops:?}"
        );
        assert_eq!(r.keyed.lent_keepers(), 0);
        assert_eq!(r.ring.tail(), 1);
        assert_eq!(r.counters.slot(0).unwrap().load(Ordering::Acquire), 1);
    }

    /// A window removed (deregistered, or dropped by its owner) while a put
    /// from it is in flight: its memory stays mapped, owned by the keeper
    /// the transport holds, until the put completes, then is freed; a later
    /// descriptor naming the window fails naming the rank and the window
    /// before anything moves.
    #[test]
    fn a_window_removed_with_a_lent_put_in_flight_stays_mapped_until_it_completes() {
        let mut r = lending();
        r.ring.write(0, &lent_put(8 << 10, 0, 0));
        let p = r.engine.step(&mut r.exec);
        assert_eq!((p.executed, p.published), (1, 0), "{p:?}");
        r.fabric.remove_window(1);
        assert!(r.exec.window(1).is_none());
        // Only the transport's keeper holds the memory now.
        assert!(r.mem.upgrade().is_some(), "freed under a put in flight");
        r.keyed.complete_device_puts(1);
        let p = r.engine.step(&mut r.exec);
        assert_eq!(p.published, 1, "{p:?}");
        assert_eq!(r.keyed.lent_keepers(), 0);
        assert!(r.mem.upgrade().is_none(), "kept after the put completed");
        r.ring.write(1, &lent_put(8 << 10, 0, 0));
        r.engine.step(&mut r.exec);
        let e = r.engine.failure().unwrap();
        assert!(
            matches!(
                e,
                ProxyError::Descriptor {
                    rank: 0,
                    seq: 1,
                    why: Why::Invalid(Invalid::UnknownWindow { window: 1 }),
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("window 1"), "{e}");
        assert_eq!(r.keyed.ops().len(), 1, "nothing more moved");
    }

    /// A peer that dies with lent puts in flight to it: the next poll fails
    /// the engine naming the peer and the oldest descriptor in flight; none
    /// of them is counted or published (their sources were never promised
    /// back), and the transport keeps holding their keepers (a request UCX
    /// did not finish may still read them).
    #[test]
    fn a_dead_peer_with_lent_puts_in_flight_fails_naming_the_peer() {
        let mut r = lending();
        r.ring.write(0, &lent_put(8 << 10, 0, 0));
        r.ring.write(1, &lent_put(4 << 10, 8 << 10, 8 << 10));
        let p = r.engine.step(&mut r.exec);
        assert_eq!((p.executed, p.published), (2, 0), "{p:?}");
        r.keyed.kill();
        r.engine.step(&mut r.exec);
        let e = r.engine.failure().unwrap();
        assert_eq!((e.peer(), e.seq()), (Some(1), Some(0)), "{e}");
        assert!(e.to_string().contains("rank 1"), "{e}");
        assert_eq!(r.ring.tail(), 0);
        assert_eq!(r.counters.slot(0).unwrap().load(Ordering::Acquire), 0);
        assert_eq!(r.keyed.lent_keepers(), 2);
        assert!(r.mem.upgrade().is_some());
    }

    /// A get a peer never answers (stopped, its connection open: the
    /// transport sets no deadline) fails the engine once it has not landed
    /// for the fabric's timeout, naming the ring's descriptor and the
    /// peer, so that a proxy stopping with it in flight stops instead of
    /// waiting for it for good. (A zero timeout: given up at the first
    /// poll.)
    #[test]
    fn a_get_never_answered_fails_its_descriptor_after_the_timeout() {
        use gin_net::Path;
        use gin_net::testing::KeyedRecorder;

        let keyed = Arc::new(KeyedRecorder::default().leave_gets_unanswered());
        let fabric = Arc::new(Fabric::new(
            0,
            vec![Path::local(), Path::new(keyed)],
            Arc::new(RegionTable::default()),
            Duration::ZERO,
        ));
        let mut mem = vec![0u64; 8].into_boxed_slice();
        let base = mem.as_mut_ptr() as usize;
        let host = MemParts {
            local_base: base,
            sizes: vec![64, 64],
            peer_bases: vec![base, 0],
            keys: vec![0, 0x77],
            addrs: vec![base as u64, 0x1000],
            states: vec![0, 0],
            ..MemParts::default()
        };
        // SAFETY: `mem` (64 bytes) outlives the fabric's users below (the
        // recorder writes nothing into it).
        fabric.add_window(1, unsafe { MemDesc::new(host) });
        let ring = Arc::new(Ring::new(3));
        let counters = Arc::new(Counters::new(1));
        let mut exec = FabricExecutor::new(fabric, counters, Arc::from(vec![ring.clone()]));
        ring.write(
            0,
            &Desc {
                op: Op::Get,
                bytes: 8,
                dst_window: 1,
                dst_offset: 16,
                src_window: 1,
                src_offset: 0,
                inline: None,
                signal: None,
                counter: None,
            },
        );
        let config = EngineConfig {
            rank: 0,
            batch: 8,
            counter_slots: 1,
        };
        let spec = RingSpec {
            ctx: 0,
            peer: 1,
            mem: RingMem::owned(ring.clone()),
            first: 0,
        };
        let mut engine = Engine::new(config, vec![spec]);
        engine.step(&mut exec);
        if engine.failure().is_none() {
            engine.step(&mut exec);
        }
        let e = engine.failure().unwrap();
        assert_eq!((e.peer(), e.seq()), (Some(1), Some(0)), "{e}");
        let words = e.to_string();
        assert!(
            words.contains("timed out") && words.contains("window 1"),
            "{words}"
        );
        assert_eq!(ring.tail(), 0, "nothing published");
        drop(mem);
    }
}
