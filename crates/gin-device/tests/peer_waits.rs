//! A wait on operations to one peer consults that peer's liveness, not the
//! whole job's: another rank's death must not fail it while its operations
//! can still complete (gin-ep's masking of lost ranks relies on this), and
//! the peer's own death still does, as does any job-wide wait.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

mod common;

use gin_device::{Backend, DevComm, GetOp, GinError, Health, PutOp, Ticket, TicketIssuer};

/// Operations complete after a few looks, as a proxy thread on a busy
/// machine completes them: a wait polls (and checks health) meanwhile.
#[derive(Debug, Default)]
struct Slow {
    issuer: TicketIssuer,
    looks: AtomicU32,
}

impl Backend for Slow {
    fn name(&self) -> &'static str {
        "slow"
    }
    fn put(&self, _: &PutOp<'_>) -> Result<(), GinError> {
        Ok(())
    }
    fn get(&self, _: &GetOp<'_>) -> Result<(), GinError> {
        Ok(())
    }
    fn ticket(&self, ctx: u32, peer: Option<usize>) -> Result<Ticket, GinError> {
        self.looks.store(0, Ordering::Relaxed);
        let marks = if peer.is_some() { 1 } else { 3 };
        Ok(self.issuer.issue(ctx, peer, vec![0; marks]))
    }
    fn done(&self, t: &Ticket) -> Result<bool, GinError> {
        self.issuer.redeem(0, t, 1, 3, 1)?;
        // Long enough for the wait's periodic health checks to run.
        Ok(self.looks.fetch_add(1, Ordering::Relaxed) > 5_000)
    }
    fn health(&self) -> Result<(), GinError> {
        Ok(())
    }
}

/// Rank 2 of 3 has died.
#[derive(Debug)]
struct TwoDied;

impl Health for TwoDied {
    fn check(&self) -> Result<(), String> {
        Err("rank 2 died".into())
    }
    fn check_peer(&self, peer: usize) -> Result<(), String> {
        if peer == 2 {
            Err("rank 2 died".into())
        } else {
            Ok(())
        }
    }
}

fn dev_comm() -> DevComm {
    common::dev_comm(
        0,
        3,
        Arc::new(Slow::default()),
        Arc::new(TwoDied),
        Duration::from_secs(60),
    )
}

#[test]
fn a_wait_for_one_live_peer_completes_although_another_rank_died() {
    let dc = dev_comm();
    let ctx = dc.ctx(0).unwrap();
    let t = ctx.flush_async(1).unwrap();
    ctx.wait(&t).expect("operations to live rank 1 complete");
}

#[test]
fn a_wait_for_the_dead_peer_or_for_every_peer_names_the_death() {
    let dc = dev_comm();
    let ctx = dc.ctx(0).unwrap();
    let t = ctx.flush_async(2).unwrap();
    let e = ctx.wait(&t).unwrap_err();
    assert!(matches!(e, GinError::JobFailed { rank: 0, .. }), "{e}");
    assert!(e.to_string().contains("rank 2 died"), "{e}");
    let e = ctx.flush().unwrap_err();
    assert!(e.to_string().contains("rank 2 died"), "{e}");
}
