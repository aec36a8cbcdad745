//! A transport for engines' step tests: keyed (as tcp), it records the
//! puts it is handed, answers reads with a fixed pattern, and can be made
//! to fail as a dead peer's connection does. No sockets, no threads.
//! [`KeyedRecorder::taking_device_memory`] makes one that also takes GPU
//! memory directly, as ucx with its CUDA transports does: it records
//! device addresses ([`KeyedOp`]) and dereferences nothing.

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
/// signal is refused. Gets and atomics are unsupported.
#[derive(Debug, Default)]
pub struct KeyedRecorder {
    puts: Mutex<Vec<KeyedPut>>,
    ops: Mutex<Vec<KeyedOp>>,
    dead: AtomicBool,
    device: bool,
    refused: Mutex<Vec<u32>>,
    /// Puts from GPU memory started and not yet completed, and each
    /// completion: (peer, how many operations were recorded before it).
    started: AtomicU64,
    completions: Mutex<Vec<(usize, usize)>>,
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

    /// Everything handed over so far, in order (host puts, device puts and
    /// device reads).
    pub fn ops(&self) -> Vec<KeyedOp> {
        self.ops
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Every [`Transport::complete_device`] that had puts to complete:
    /// (peer, how many operations [`KeyedRecorder::ops`] held then).
    pub fn completions(&self) -> Vec<(usize, usize)> {
        self.completions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Puts from GPU memory started ([`Transport::start_put_device`]) and
    /// not completed since.
    pub fn in_flight(&self) -> u64 {
        self.started.load(Ordering::Acquire)
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
        _: usize,
        _: Target<'_>,
        _: *mut u8,
        _: u64,
        _: &Arc<AtomicU64>,
        _: Option<KeepAlive>,
    ) -> Result<(), NetError> {
        Err(NetError::Unsupported {
            transport: "keyed",
            op: "get",
        })
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
        self.host_put(peer, dst, src, true)
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
    /// counts the put in flight until [`Transport::complete_device`].
    unsafe fn start_put_device(
        &self,
        peer: usize,
        dst: Target<'_>,
        src: u64,
        len: u64,
        _: Option<KeepAlive>,
    ) -> Result<(), NetError> {
        // SAFETY: records the address only.
        unsafe { self.put_device(peer, dst, src, len) }?;
        self.started.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }
    /// Completes every put started, recording when.
    fn complete_device(&self, peer: usize, _: Duration) -> Result<(), NetError> {
        if self.started.swap(0, Ordering::AcqRel) > 0 {
            let n = self.ops().len();
            self.completions
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push((peer, n));
        }
        self.alive(peer)
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
