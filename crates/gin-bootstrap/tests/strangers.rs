//! Many silent connections (a port scanner, a stuck client, an attacker) at
//! the root and at a rank's listener cost a bounded number of threads and do
//! not hold up the job. This file has one test so that the process's thread
//! count is this test's alone.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use gin_bootstrap::{Bootstrap, BootstrapRoot, Config, selftest};

const SILENT: usize = 300;

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

fn silent(to: SocketAddr) -> Vec<TcpStream> {
    (0..SILENT)
        .map(|_| TcpStream::connect(to).unwrap())
        .collect()
}

#[test]
fn hundreds_of_silent_connections_cost_few_threads_and_no_delay() {
    let config = Config {
        timeout: Duration::from_secs(20),
        ..Config::default()
    };
    let root =
        BootstrapRoot::start(SocketAddr::from(([127, 0, 0, 1], 0)), Some(2), config).unwrap();
    let id = root.id();
    let base = threads();
    let _at_root = silent(id.addr);
    let hold = Arc::new(Barrier::new(3));
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let hold = hold.clone();
            std::thread::spawn(move || {
                let t = Instant::now();
                let b = Bootstrap::init_with(&id, rank, 2, config).unwrap();
                let joined = t.elapsed();
                // Rank 0 floods rank 1's listener before its first dial to it,
                // so its real handshake queues behind the strangers.
                let _at_rank = (rank == 0).then(|| silent(b.peer_addrs()[1]));
                let t = Instant::now();
                b.barrier().unwrap();
                // Rank 1's barrier also waits for rank 0 to open its strangers.
                let first_barrier = if rank == 0 {
                    t.elapsed()
                } else {
                    Duration::ZERO
                };
                let checked = selftest::verify(&b, 1);
                hold.wait(); // the main thread counts threads here
                hold.wait();
                (joined, first_barrier, checked)
            })
        })
        .collect();
    hold.wait();
    let grown = threads() - base;
    hold.wait();
    for (rank, h) in ranks.into_iter().enumerate() {
        let (joined, first_barrier, checked) = h.join().unwrap();
        assert_eq!(checked, Ok(()), "rank {rank}");
        assert!(
            joined < Duration::from_secs(3),
            "rank {rank} took {joined:?} to join past {SILENT} strangers"
        );
        assert!(
            first_barrier < Duration::from_secs(3),
            "rank 0's first barrier (its dial to rank 1) took {first_barrier:?} past {SILENT} strangers"
        );
    }
    assert!(
        grown < 40,
        "{} silent connections made the process grow by {grown} threads",
        2 * SILENT
    );
}
