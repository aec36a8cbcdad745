//! A transport for engines' step tests: keyed (as tcp), it records the
//! puts it is handed, answers reads with a fixed pattern, and can be made
//! to fail as a dead peer's connection does. No sockets, no threads.
//! [`KeyedRecorder::taking_device_memory`] makes one that also takes GPU
//! memory directly, as ucx with its CUDA transports does: it records
//! device addresses ([`KeyedOp`]) and dereferences nothing. Its puts from
//! GPU memory complete at once, or, once held
//! ([`KeyedRecorder::hold_device_puts`]), only when the test says
//! ([`KeyedRecorder::complete_device_puts`]); it can order requests after
//! them by waiting, as ucx's `GIN_UCX_GPU_ORDER=wait` does
//! ([`KeyedRecorder::order_by_waiting`]), and then refuses a request that
//! would have to wait for a put not yet complete. Puts from GPU memory are
//! numbered per peer, as ucx numbers them; one of them can be made to fail
//! ([`KeyedRecorder::fail_device_put`]), reported once those before it
//! completed, as ucx reports it. [`KeyedRecorder::lending_host_puts`] makes
//! it lend large host puts' sources as ucx does ([`Transport::start_put`]):
//! numbered and completed with the puts from GPU memory, their keepers held
//! until then.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::transport::{AtomicOp, Reach, Target, Transport};
use crate::{KeepAlive, NetError};

/// A put the transport was handed: (peer, key, offset, bytes).
pub type KeyedPut = (usize, u32, u64, Vec<u8>);

/// The byte every read answers with.
pub const READ_PATTERN: u8 = 0x5a;

/// Everything a [`KeyedRecorder`] was handed, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyedOp {
    /// Host bytes put at `(peer, key, offset)`; `ordered`: through
    /// [`Transport::put_ordered`] (after every earlier request).
    Put {
        /// The target rank.
        peer: usize,
        /// The key it serves the region under.
        key: u32,
        /// Offset in the region.
        offset: u64,
        /// The bytes.
        bytes: Vec<u8>,
        /// Whether the put was ordered after earlier requests.
        ordered: bool,
    },
    /// A put of `len` bytes of GPU memory at device address `src`.
    PutDevice {
        /// The target rank.
        peer: usize,
        /// The key it serves the region under.
        key: u32,
        /// Offset in the region.
        offset: u64,
        /// The source's device address.
        src: u64,
        /// Bytes.
        len: u64,
    },
    /// A put of `len` bytes of host memory at `src` lent to the transport
    /// ([`Transport::start_put`], numbered with the puts from GPU memory):
    /// the address is recorded, the bytes are not copied.
    PutLent {
        /// The target rank.
        peer: usize,
        /// The key it serves the region under.
        key: u32,
        /// Offset in the region.
        offset: u64,
        /// The source's address in this process.
        src: u64,
        /// Bytes.
        len: u64,
        /// The signal's key, offset and amount, if any.
        signal: Option<(u32, u64, u64)>,
    },
    /// A read of `len` bytes into GPU memory at device address `dst`.
    ReadDevice {
        /// The rank read from.
        peer: usize,
        /// The key it serves the region under.
        key: u32,
        /// Offset in the region.
        offset: u64,
        /// The destination's device address.
        dst: u64,
        /// Bytes.
        len: u64,
    },
}

/// A keyed transport that records puts (see the module documentation).
/// Signals must travel as puts of their running totals: a put with a
/// signal is refused. Gets are unsupported, or, once
/// [`KeyedRecorder::leave_gets_unanswered`], accepted and never answered;
/// atomics are unsupported.
#[derive(Debug, Default)]
pub struct KeyedRecorder {
    puts: Mutex<Vec<KeyedPut>>,
    ops: Mutex<Vec<KeyedOp>>,
    dead: AtomicBool,
    device: bool,
    refused: Mutex<Vec<u32>>,
    /// Puts from GPU memory by peer.
    device_puts: Mutex<BTreeMap<usize, DevicePuts>>,
    /// Each [`Transport::complete_device`] that had puts started since the
    /// one before: (peer, how many operations were recorded before it).
    completions: Mutex<Vec<(usize, usize)>>,
    /// Puts from GPU memory complete only when the test says.
    hold: AtomicBool,
    /// A request ordered after puts from GPU memory waits for them.
    waits: AtomicBool,
    /// Why [`Transport::device_puts_completed`] fails, once it does.
    device_failure: Mutex<Option<String>>,
    /// Gets are accepted and never answered: what keeps their landing
    /// buffers alive, held for good.
    unanswered: Option<Mutex<Vec<Option<KeepAlive>>>>,
    /// Host puts of at least this many bytes are lent, not copied
    /// ([`KeyedRecorder::lending_host_puts`]).
    lend_from: Option<u64>,
    /// What keeps the sources of lent host puts alive: (peer, number,
    /// keeper), dropped once the put is complete.
    lent_keeps: Mutex<Vec<(usize, u64, Option<KeepAlive>)>>,
}

/// A peer's puts from GPU memory.
#[derive(Debug, Default, Clone)]
struct DevicePuts {
    /// The newest's number (numbered from 1 per peer).
    started: u64,
    /// How far they are complete, in order.
    done: u64,
    /// Up to which the last [`Transport::complete_device`] covered them.
    covered: u64,
    /// The put that fails, and why ([`KeyedRecorder::fail_device_put`]).
    fails: Option<(u64, String)>,
}

impl DevicePuts {
    /// The failed put, once every put before it is complete.
    fn failure(&self) -> Option<(u64, &str)> {
        self.fails
            .as_ref()
            .filter(|(f, _)| self.done >= f - 1)
            .map(|(f, why)| (*f, why.as_str()))
    }
}

impl KeyedRecorder {
    /// A recorder that takes GPU memory directly
    /// ([`Transport::takes_device_memory`]).
    pub fn taking_device_memory() -> Self {
        Self {
            device: true,
            ..Self::default()
        }
    }

    /// From now on gets are accepted and never answered, as by a peer
    /// that stopped (its connection open): their counters never count
    /// down, and what keeps their landing buffers alive is held.
    #[must_use]
    pub fn leave_gets_unanswered(mut self) -> Self {
        self.unanswered = Some(Mutex::default());
        self
    }

    /// From now on host puts of at least `min` bytes are lent
    /// ([`Transport::lends_puts`], [`Transport::start_put`]), as ucx lends
    /// large ones: numbered with the puts from GPU memory, complete as
    /// those are (at once, or held: [`KeyedRecorder::hold_device_puts`]),
    /// their keepers held until then.
    #[must_use]
    pub fn lending_host_puts(mut self, min: u64) -> Self {
        self.lend_from = Some(min);
        self
    }

    /// Keepers of lent host puts' sources still held (puts not complete).
    pub fn lent_keepers(&self) -> usize {
        self.release_keeps();
        self.lent_keeps
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Drops the keepers of lent host puts that are complete (outside the
    /// lock).
    fn release_keeps(&self) {
        let devs = self.devs().clone();
        let gone: Vec<_> = {
            let mut keeps = self
                .lent_keeps
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let (done, held): (Vec<_>, Vec<_>) = keeps
                .drain(..)
                .partition(|(p, seq, _)| devs.get(p).is_some_and(|d| d.done >= *seq));
            *keeps = held;
            done
        };
        drop(gone);
    }

    /// Everything handed over so far, in order (host puts, device puts and
    /// device reads).
    pub fn ops(&self) -> Vec<KeyedOp> {
        self.ops
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Every [`Transport::complete_device`] that had puts started since
    /// the one before (whether or not they had completed meanwhile):
    /// (peer, how many operations [`KeyedRecorder::ops`] held then).
    pub fn completions(&self) -> Vec<(usize, usize)> {
        self.completions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Puts from GPU memory started ([`Transport::start_put_device`]) and
    /// not complete since, to every peer.
    pub fn in_flight(&self) -> u64 {
        self.devs().values().map(|d| d.started - d.done).sum()
    }

    fn devs(&self) -> std::sync::MutexGuard<'_, BTreeMap<usize, DevicePuts>> {
        self.device_puts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// `peer`'s puts from GPU memory, as they are now.
    fn dev(&self, peer: usize) -> DevicePuts {
        self.devs().get(&peer).cloned().unwrap_or_default()
    }

    /// From now on puts from GPU memory stay in flight until
    /// [`KeyedRecorder::complete_device_puts`] (or
    /// [`Transport::complete_device`]) completes them.
    pub fn hold_device_puts(&self) {
        self.hold.store(true, Ordering::Release);
    }

    /// Completes the puts from GPU memory to every peer numbered up to
    /// `upto` (in order, as [`Transport::device_puts_completed`] reports
    /// them).
    pub fn complete_device_puts(&self, upto: u64) {
        for d in self.devs().values_mut() {
            d.done = d.done.max(upto.min(d.started));
        }
        self.release_keeps();
    }

    /// Completes the puts from GPU memory to `peer` numbered up to `upto`.
    pub fn complete_device_puts_to(&self, peer: usize, upto: u64) {
        if let Some(d) = self.devs().get_mut(&peer) {
            d.done = d.done.max(upto.min(d.started));
        }
        self.release_keeps();
    }

    /// The put from GPU memory to `peer` numbered `seq` fails (`why`):
    /// once every put before it is complete,
    /// [`Transport::device_puts_completed`] fails and
    /// [`Transport::device_put_failed`] names it, as ucx reports a failed
    /// put; [`Transport::complete_device`] to `peer` fails from then on.
    pub fn fail_device_put(&self, peer: usize, seq: u64, why: &str) {
        self.devs().entry(peer).or_default().fails = Some((seq, why.into()));
    }

    /// From now on a request ordered after puts from GPU memory waits for
    /// them ([`Transport::ordered_waits_for_device_puts`]), as ucx's
    /// `GIN_UCX_GPU_ORDER=wait`: the recorder refuses one that would have
    /// to wait (its caller must hold it back instead of blocking).
    pub fn order_by_waiting(&self) {
        self.waits.store(true, Ordering::Release);
    }

    /// From now on [`Transport::device_puts_completed`] fails, as when a
    /// put from GPU memory failed.
    pub fn fail_device_puts(&self, why: &str) {
        *self
            .device_failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(why.into());
    }

    /// Refuses a request ordered after the puts from GPU memory up to
    /// `after` that would have to wait for them.
    fn check_order(&self, peer: usize, after: u64) -> Result<(), NetError> {
        let done = self.dev(peer).done;
        if self.waits.load(Ordering::Acquire) && done < after {
            return Err(NetError::Broken {
                peer,
                why: format!(
                    "an ordered request would block until put {after} from GPU memory completes (complete up to {done})"
                ),
            });
        }
        Ok(())
    }

    /// From now on every operation on `key` is refused, as by a target
    /// that no longer serves it.
    pub fn refuse(&self, key: u32) {
        self.refused
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(key);
    }

    fn record(&self, op: KeyedOp) {
        self.ops
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(op);
    }

    /// The key and offset of `t`, or the refusal of a refused key.
    fn key(&self, peer: usize, t: Target<'_>) -> Result<(u32, u64), NetError> {
        self.alive(peer)?;
        let (key, offset) = t.key_at(peer, "keyed")?;
        if self
            .refused
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(&key)
        {
            return Err(NetError::Refused {
                peer,
                why: format!("unknown memory key {key:#010x}"),
                window: None,
            });
        }
        Ok((key, offset))
    }

    fn host_put(
        &self,
        peer: usize,
        dst: Target<'_>,
        src: &[u8],
        ordered: bool,
    ) -> Result<(), NetError> {
        let (key, offset) = self.key(peer, dst)?;
        self.puts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((peer, key, offset, src.to_vec()));
        self.record(KeyedOp::Put {
            peer,
            key,
            offset,
            bytes: src.to_vec(),
            ordered,
        });
        Ok(())
    }

    /// The puts handed over so far, in order.
    pub fn puts(&self) -> Vec<KeyedPut> {
        self.puts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// From now on every operation fails as a reset connection does.
    pub fn kill(&self) {
        self.dead.store(true, Ordering::Relaxed);
    }

    fn alive(&self, peer: usize) -> Result<(), NetError> {
        if self.dead.load(Ordering::Relaxed) {
            return Err(NetError::Io {
                what: format!("sending to rank {peer}"),
                source: std::io::Error::from(std::io::ErrorKind::ConnectionReset),
            });
        }
        Ok(())
    }
}

impl Transport for KeyedRecorder {
    fn name(&self) -> &'static str {
        "keyed"
    }
    fn reach(&self) -> Reach {
        Reach::Keyed
    }
    fn put(
        &self,
        peer: usize,
        dst: Target<'_>,
        src: &[u8],
        sig: Option<(Target<'_>, u64)>,
    ) -> Result<(), NetError> {
        if sig.is_some() {
            return Err(NetError::Unsupported {
                transport: "keyed",
                op: "a put with a signal (signals travel as puts of their totals)",
            });
        }
        self.host_put(peer, dst, src, false)
    }
    unsafe fn get(
        &self,
        peer: usize,
        src: Target<'_>,
        _: *mut u8,
        _: u64,
        _: &Arc<AtomicU64>,
        keep: Option<KeepAlive>,
    ) -> Result<(), NetError> {
        let Some(unanswered) = &self.unanswered else {
            return Err(NetError::Unsupported {
                transport: "keyed",
                op: "get",
            });
        };
        self.key(peer, src)?;
        unanswered
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(keep);
        Ok(())
    }
    fn read(
        &self,
        peer: usize,
        _: Target<'_>,
        out: &mut [u8],
        _: Duration,
    ) -> Result<(), NetError> {
        self.alive(peer)?;
        out.fill(READ_PATTERN);
        Ok(())
    }
    fn atomic(&self, _: usize, _: Target<'_>, _: AtomicOp, _: Duration) -> Result<u64, NetError> {
        Err(NetError::Unsupported {
            transport: "keyed",
            op: "atomics",
        })
    }
    fn fence(&self, _: usize, _: Duration) -> Result<(), NetError> {
        Ok(())
    }
    fn confirm(&self, _: usize, _: Duration) -> Result<(), NetError> {
        Ok(())
    }
    fn health(&self, peer: usize) -> Result<(), NetError> {
        self.alive(peer)
    }
    fn put_ordered(&self, peer: usize, dst: Target<'_>, src: &[u8]) -> Result<(), NetError> {
        self.check_order(peer, self.dev(peer).started)?;
        self.host_put(peer, dst, src, true)
    }
    fn put_ordered_after(
        &self,
        peer: usize,
        dst: Target<'_>,
        src: &[u8],
        after: u64,
    ) -> Result<(), NetError> {
        self.check_order(peer, after)?;
        self.host_put(peer, dst, src, true)
    }
    fn ordered_waits_for_device_puts(&self) -> bool {
        self.waits.load(Ordering::Acquire)
    }
    fn takes_device_memory(&self) -> bool {
        self.device
    }
    /// Records the device address; dereferences nothing.
    unsafe fn put_device(
        &self,
        peer: usize,
        dst: Target<'_>,
        src: u64,
        len: u64,
    ) -> Result<(), NetError> {
        if !self.device {
            return Err(NetError::Unsupported {
                transport: "keyed",
                op: "puts from GPU memory",
            });
        }
        let (key, offset) = self.key(peer, dst)?;
        self.record(KeyedOp::PutDevice {
            peer,
            key,
            offset,
            src,
            len,
        });
        Ok(())
    }
    /// Records the device address as [`Transport::put_device`] does, and
    /// numbers the put: complete at once, or, held, once the test or
    /// [`Transport::complete_device`] completes it.
    unsafe fn start_put_device(
        &self,
        peer: usize,
        dst: Target<'_>,
        src: u64,
        len: u64,
        _: Option<KeepAlive>,
    ) -> Result<u64, NetError> {
        // SAFETY: records the address only.
        unsafe { self.put_device(peer, dst, src, len) }?;
        let hold = self.hold.load(Ordering::Acquire);
        let mut devs = self.devs();
        let d = devs.entry(peer).or_default();
        d.started += 1;
        if !hold {
            d.done = d.started;
        }
        Ok(d.started)
    }
    fn lends_puts(&self, _: usize, len: u64) -> bool {
        self.lend_from.is_some_and(|m| len >= m)
    }
    /// Lent ([`KeyedRecorder::lending_host_puts`]): records the address and
    /// numbers the put as [`Transport::start_put_device`] does, holding
    /// `keep` until it is complete; else [`Transport::put`].
    unsafe fn start_put(
        &self,
        peer: usize,
        dst: Target<'_>,
        src: *const u8,
        len: u64,
        sig: Option<(Target<'_>, u64)>,
        keep: Option<KeepAlive>,
    ) -> Result<u64, NetError> {
        if !self.lends_puts(peer, len) {
            let n = usize::try_from(len).unwrap_or(usize::MAX);
            // SAFETY: the caller lends `len` readable bytes at `src` until
            // this returns.
            let bytes = unsafe { std::slice::from_raw_parts(src, n) };
            self.put(peer, dst, bytes, sig)?;
            return Ok(0);
        }
        let (key, offset) = self.key(peer, dst)?;
        let signal = match sig {
            Some((at, add)) => {
                let (k, o) = self.key(peer, at)?;
                Some((k, o, add))
            }
            None => None,
        };
        self.record(KeyedOp::PutLent {
            peer,
            key,
            offset,
            src: src as u64,
            len,
            signal,
        });
        let hold = self.hold.load(Ordering::Acquire);
        let seq = {
            let mut devs = self.devs();
            let d = devs.entry(peer).or_default();
            d.started += 1;
            if !hold {
                d.done = d.started;
            }
            d.started
        };
        self.lent_keeps
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((peer, seq, keep));
        self.release_keeps();
        Ok(seq)
    }
    fn device_puts_completed(&self, peer: usize) -> Result<u64, NetError> {
        self.release_keeps();
        self.alive(peer)?;
        if let Some(why) = self
            .device_failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
        {
            return Err(NetError::Broken { peer, why });
        }
        let d = self.dev(peer);
        if let Some((_, why)) = d.failure() {
            return Err(NetError::Broken {
                peer,
                why: why.into(),
            });
        }
        Ok(d.done)
    }
    fn device_put_failed(&self, peer: usize) -> Option<u64> {
        self.dev(peer).failure().map(|(f, _)| f)
    }
    /// Completes every put started to `peer` (failing where one failed:
    /// [`KeyedRecorder::fail_device_put`]), recording when puts were started
    /// since the last time.
    fn complete_device(&self, peer: usize, _: Duration) -> Result<(), NetError> {
        let d = {
            let mut devs = self.devs();
            let d = devs.entry(peer).or_default();
            d.done = d.started;
            let fresh = d.covered < d.started;
            d.covered = d.started;
            (fresh, d.failure().map(|(_, why)| why.to_owned()))
        };
        self.release_keeps();
        if d.0 {
            let n = self.ops().len();
            self.completions
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push((peer, n));
        }
        self.alive(peer)?;
        match d.1 {
            Some(why) => Err(NetError::Broken { peer, why }),
            None => Ok(()),
        }
    }
    /// Records the device address; dereferences nothing.
    unsafe fn read_device(
        &self,
        peer: usize,
        src: Target<'_>,
        dst: u64,
        len: u64,
        _: Duration,
    ) -> Result<(), NetError> {
        if !self.device {
            return Err(NetError::Unsupported {
                transport: "keyed",
                op: "reads into GPU memory",
            });
        }
        let (key, offset) = self.key(peer, src)?;
        self.record(KeyedOp::ReadDevice {
            peer,
            key,
            offset,
            dst,
            len,
        });
        Ok(())
    }
}
