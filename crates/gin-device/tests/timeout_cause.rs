//! When a peer stops, every rank's waits time out at about the moment the
//! job hears which peer it was, and a backend error seen then (the link to
//! a rank that gave up because of that peer and left) is only the echo. A
//! wait that times out names the job's cause when there is one: it used to
//! ask the backend alone and report "lost the connection to rank 0's
//! transport" where rank 1 had stopped (`cargo xtask faults`, alltoall on
//! 4 ranks, gdaki over tcp).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

mod common;

use gin_device::{Backend, DevComm, GetOp, GinError, Health, PutOp, Ticket, TicketIssuer};

/// The news of the stop: it arrives while the wait runs its last health
/// check, just before it times out.
#[derive(Debug, Default)]
struct News(AtomicBool);

/// Operations never complete. The first backend health check passes and
/// brings the news; every later one fails with the echo.
#[derive(Debug)]
struct Stalled {
    issuer: TicketIssuer,
    news: Arc<News>,
}

impl Backend for Stalled {
    fn name(&self) -> &'static str {
        "stalled"
    }
    fn put(&self, _: &PutOp<'_>) -> Result<(), GinError> {
        Ok(())
    }
    fn get(&self, _: &GetOp<'_>) -> Result<(), GinError> {
        Ok(())
    }
    fn ticket(&self, ctx: u32, peer: Option<usize>) -> Result<Ticket, GinError> {
        Ok(self.issuer.issue(ctx, peer, vec![0; 3]))
    }
    fn done(&self, _: &Ticket) -> Result<bool, GinError> {
        Ok(false)
    }
    fn health(&self) -> Result<(), GinError> {
        if self.news.0.swap(true, Ordering::SeqCst) {
            Err(GinError::JobFailed {
                rank: 3,
                why: "rank 0: lost the connection to rank 0's transport".into(),
            })
        } else {
            Ok(())
        }
    }
}

/// The job hears that rank 1 stopped once the news is in.
#[derive(Debug)]
struct Job(Arc<News>);

impl Health for Job {
    fn check(&self) -> Result<(), String> {
        if self.0.0.load(Ordering::SeqCst) {
            Err("rank 1 stopped responding (rank 2 had no answer from it for 5.0s)".into())
        } else {
            Ok(())
        }
    }
}

fn dev_comm(timeout: Duration) -> DevComm {
    let news = Arc::new(News::default());
    let backend = Stalled {
        issuer: TicketIssuer::default(),
        news: news.clone(),
    };
    common::dev_comm(3, 4, Arc::new(backend), Arc::new(Job(news)), timeout)
}

#[test]
fn a_timed_out_wait_names_the_jobs_cause_not_the_backends_echo() {
    // A zero timeout: the wait checks health once (the news arrives during
    // that check) and times out at once.
    let dc = dev_comm(Duration::ZERO);
    let e = dc.ctx(0).unwrap().flush().unwrap_err();
    assert!(matches!(e, GinError::JobFailed { rank: 3, .. }), "{e}");
    assert!(e.to_string().contains("rank 1 stopped responding"), "{e}");
}
