//! The executor of CPU ranks: gin-net's [`Fabric`], synchronous.
//!
//! Every put completes locally before it returns (shm: copied; tcp: written
//! to the ordered link), its signal applied after the data as an add at the
//! target; a tcp get is in flight until its answer lands; a counter is a
//! local add; publication is a release store of the [`Ring`]'s completion
//! index; a waiter's [`Executor::confirm`] asks a tcp peer to confirm what it
//! was sent.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use gin_device::Counters;
use gin_net::{Addr, Fabric, MemDesc, NetError};

use crate::error::ExecError;
use crate::executor::{Executor, Get, Issued, Put, Site, Source, Target};
use crate::ring::Ring;

/// gin-net's fabric as an [`Executor`] for CPU ranks. Cheap to clone: the
/// proxy keeps one for the producers' direct sends and confirmations, and
/// the driver thread owns another.
#[derive(Debug, Clone)]
pub(crate) struct FabricExecutor {
    fabric: Arc<Fabric>,
    counters: Arc<Counters>,
    rings: Arc<[Arc<Ring>]>,
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
fn net(peer: usize, e: NetError) -> ExecError {
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
    type InFlight = Arc<AtomicU64>;

    fn window(&self, id: u32) -> Option<Arc<MemDesc>> {
        self.fabric.window(id).ok()
    }

    fn part_size(&self, window: &Arc<MemDesc>, owner: usize) -> u64 {
        window.sizes.get(owner).copied().unwrap_or(0)
    }

    fn put(&mut self, site: Site, put: &Put<Arc<MemDesc>>) -> Result<(), ExecError> {
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
        r.map_err(|e| net(peer, e))
    }

    fn get(
        &mut self,
        site: Site,
        get: &Get<Arc<MemDesc>>,
    ) -> Result<Issued<Arc<AtomicU64>>, ExecError> {
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
            Ok(Issued::InFlight(done))
        }
    }

    fn landed(&mut self, _: Site, get: &mut Arc<AtomicU64>) -> Result<bool, ExecError> {
        Ok(get.load(Ordering::Acquire) == 0)
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
