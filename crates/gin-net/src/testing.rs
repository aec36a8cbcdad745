//! A transport for engines' step tests: keyed (as tcp), it records the
//! puts it is handed, answers reads with a fixed pattern, and can be made
//! to fail as a dead peer's connection does. No sockets, no threads.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::transport::{AtomicOp, Reach, Target, Transport};
use crate::{KeepAlive, NetError};

/// A put the transport was handed: (peer, key, offset, bytes).
pub type KeyedPut = (usize, u32, u64, Vec<u8>);

/// The byte every read answers with.
pub const READ_PATTERN: u8 = 0x5a;

/// A keyed transport that records puts (see the module documentation).
/// Signals must travel as puts of their running totals: a put with a
/// signal is refused. Gets and atomics are unsupported.
#[derive(Debug, Default)]
pub struct KeyedRecorder {
    puts: Mutex<Vec<KeyedPut>>,
    dead: AtomicBool,
}

impl KeyedRecorder {
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
        self.alive(peer)?;
        let (key, offset) = dst.key_at(peer, "keyed")?;
        self.puts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((peer, key, offset, src.to_vec()));
        Ok(())
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
}
