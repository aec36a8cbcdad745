//! The TCP target checks every request itself (defence in depth): a request
//! that the initiator should never have sent is answered with an error and
//! touches nothing.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use gin_bootstrap::{Config, run_threads};
use gin_net::region::{Access, RegionTable};
use gin_net::tcp::TcpTransport;

/// One bad request on a fresh pair of ranks; returns each rank's error and
/// its memory afterwards. A link that saw a refusal stays failed (as a QP
/// enters the error state), so every case gets its own job.
fn one_bad_request(case: usize) -> Vec<(String, Vec<u64>, Vec<u64>)> {
    let cfg = Config {
        timeout: Duration::from_secs(20),
        ..Config::default()
    };
    run_threads(2, cfg, move |b| {
        let table = Arc::new(RegionTable::default());
        let mut mem = vec![0u64; 8]; // 64 bytes, 8-aligned
        let ro = vec![7u64; 1];
        // SAFETY: both buffers outlive the transport (dropped at the end).
        let key = unsafe { table.insert(mem.as_mut_ptr().cast(), 64, Access::ALL) }.unwrap();
        // SAFETY: as above; the transport never writes a read-only region.
        let ro_key = unsafe {
            table.insert(
                ro.as_ptr().cast_mut().cast(),
                8,
                Access {
                    write: false,
                    read: true,
                    atomic: false,
                },
            )
        }
        .unwrap();
        let t = TcpTransport::start(&b, table.clone(), &[true, true]).unwrap();
        let keys = b
            .allgather(&[key.to_le_bytes(), ro_key.to_le_bytes()].concat())
            .unwrap();
        let peer = 1 - b.rank();
        let pk = u32::from_le_bytes(keys[peer][..4].try_into().unwrap());
        let pro = u32::from_le_bytes(keys[peer][4..].try_into().unwrap());
        let link = t.link(peer).unwrap();
        let to = Duration::from_secs(10);
        let e = match case {
            0 => link.fetch_add(pk, 4, 1, to).unwrap_err(),
            1 => link.fetch_add(pro, 0, 1, to).unwrap_err(),
            2 => link.compare_swap(pk ^ 0x55, 0, 0, 1, to).unwrap_err(),
            _ => {
                // A write to read-only memory, then a fence to collect the answer.
                link.put(pro, 0, &[1; 8], None).unwrap();
                link.fence(to).unwrap_err()
            }
        };
        // Later requests on the failed link fail too, with the first error.
        let again = link.fetch_add(pk, 0, 1, to).unwrap_err().to_string();
        assert_eq!(again, e.to_string());
        b.barrier().unwrap();
        drop(t);
        (e.to_string(), mem, ro)
    })
    .unwrap()
}

#[test]
fn target_refuses_bad_keys_bounds_rights_and_alignment() {
    for (case, want) in [
        (0, "not 8-byte aligned"),
        (1, "does not allow Atomic"),
        (2, "unknown memory key"),
        (3, "does not allow Write"),
    ] {
        for (e, mem, ro) in one_bad_request(case) {
            assert!(e.contains(want), "case {case}: {e}");
            assert_eq!(
                mem,
                vec![0; 8],
                "case {case}: a refused request touched memory"
            );
            assert_eq!(ro, vec![7], "case {case}: read-only memory changed");
        }
    }
}

#[test]
fn refused_puts_are_reported_and_good_traffic_lands() {
    let cfg = Config {
        timeout: Duration::from_secs(20),
        ..Config::default()
    };
    let out = run_threads(2, cfg, |b| {
        let table = Arc::new(RegionTable::default());
        let mut mem = vec![0u64; 8];
        // SAFETY: `mem` outlives the transport.
        let key = unsafe { table.insert(mem.as_mut_ptr().cast(), 64, Access::ALL) }.unwrap();
        let t = TcpTransport::start(&b, table.clone(), &[true, true]).unwrap();
        let keys = b.allgather(&key.to_le_bytes()).unwrap();
        let peer = 1 - b.rank();
        let pk = u32::from_le_bytes(keys[peer][..].try_into().unwrap());
        let link = t.link(peer).unwrap();
        let to = Duration::from_secs(10);
        // Good: 16 bytes at 8, then a signal at 0, then read it back.
        link.put(pk, 8, &[1u8; 16], Some((pk, 0, 5))).unwrap();
        assert_eq!(link.fetch_add(pk, 0, 0, to).unwrap(), 5);
        let mut back = [0u8; 16];
        let done = Arc::new(AtomicU64::new(1));
        // SAFETY: `back` lives until `done` reaches zero below.
        unsafe { link.get(pk, 8, 16, back.as_mut_ptr(), done.clone(), None) }.unwrap();
        link.fence(to).unwrap();
        assert_eq!(done.load(std::sync::atomic::Ordering::Acquire), 0);
        assert_eq!(back, [1u8; 16]);
        b.barrier().unwrap();
        // Bad: past the end. The put returns (it is one-sided) but the link
        // reports the refusal, and the bytes after it are untouched.
        link.put(pk, 60, &[9u8; 8], None).unwrap();
        let e = link
            .fence(to)
            .err()
            .map(|e| e.to_string())
            .or_else(|| link.check().err().map(|e| e.to_string()));
        b.barrier().unwrap();
        drop(t);
        (e, mem)
    })
    .unwrap();
    for (e, mem) in out {
        let e = e.expect("the refused put was reported");
        assert!(
            e.contains("put #2") && e.contains("exceed the 64 bytes"),
            "{e}"
        );
        assert_eq!(mem[0], 5);
        assert_eq!(&mem[1..3], &[0x0101_0101_0101_0101; 2]);
        assert_eq!(mem[7], 0, "a refused put wrote past the region");
    }
}
