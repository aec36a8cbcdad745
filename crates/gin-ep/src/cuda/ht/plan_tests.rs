//! The step's plan built on the GPU (`kernels/ht.cu`'s `plan_word`,
//! `plan_recv_starts` and `plan_item_bad`, which `ep_ht_notify` runs once
//! it holds every rank's
//! row, so that the dispatch kernel follows it with no host step between
//! them) against the host's: compiled as host C++
//! (`tests/ht_plan_host.cpp`) over random rows (1 to 5 emulated hosts of 1
//! to 8 ranks: up to 40 ranks, two words of active mask; masked ranks
//! whose stale rows hold garbage; 1 to 4 channels), real or broken the
//! ways a row can be (a peer's refused row, a count above the buffer's
//! maximum per destination or per host, an active mask that differs from
//! this rank's), the kernel's verdict is the host's
//! ([`notify_rows`]: taken, or refused or an error) and, where the host
//! takes the rows, its table is [`Plan::tables`] word for word.
//!
//! Needs a C++ compiler (`CXX`, else `c++`): skipped with a printed reason
//! where there is none, except in CI (`CI` set), where that is a failure.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::fmt::Write as _;
use std::sync::OnceLock;

use proptest::prelude::*;

use super::tests::common;
use super::*;
use crate::Config;

fn host_exe() -> Option<&'static std::path::PathBuf> {
    static EXE: OnceLock<Option<std::path::PathBuf>> = OnceLock::new();
    EXE.get_or_init(|| common::compile("ht_plan_host", &[], "plan built on the GPU"))
        .as_ref()
}

/// One case: this rank's shape and mask, and the rows it received.
#[derive(Debug, Clone)]
struct Case {
    s: Shape,
    active: Vec<bool>,
    rows: Vec<Vec<u32>>,
}

/// What the kernel's functions give: whether the rows are refused, and
/// the table.
fn run_host(c: &Case) -> Option<(bool, Vec<u32>)> {
    let exe = host_exe()?;
    let mut input = String::new();
    for w in shape_words(&c.s, 0, c.s.h2 / 2, 1, false) {
        write!(input, "{w} ").unwrap();
    }
    for &a in &c.active {
        write!(input, "{} ", u32::from(a)).unwrap();
    }
    for v in c.rows.iter().flatten() {
        write!(input, "{v} ").unwrap();
    }
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!("gin-ep-ht-plan-{}-{n}.txt", std::process::id()));
    std::fs::write(&path, input).unwrap();
    let out = std::process::Command::new(exe).arg(&path).output().unwrap();
    std::fs::remove_file(&path).ok();
    assert!(out.status.success(), "ht_plan_host: {:?}", out.status);
    let text = String::from_utf8(out.stdout).unwrap();
    let mut lines = text.lines();
    let refused = lines.next().unwrap() == "1";
    let words: usize = lines.next().unwrap().parse().unwrap();
    let table: Vec<u32> = lines
        .by_ref()
        .take(words)
        .map(|l| l.parse().unwrap())
        .collect();
    assert_eq!(
        lines.next(),
        Some("--"),
        "ht_plan_host printed more than a case"
    );
    Some((refused, table))
}

static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A small deterministic generator (splitmix64) for the rows' values.
struct Gen(u64);

impl Gen {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// How a case breaks the rows.
#[derive(Debug, Clone, Copy)]
enum Break {
    None,
    /// An active peer's row is [`plan::refused_row`].
    Refused,
    /// One destination's (or host's, `host`) count of an active peer is one
    /// above the maximum.
    Over {
        host: bool,
    },
    /// An active peer's mask says another rank is masked or active where
    /// this rank's does not.
    Mask,
}

/// Random valid rows for every rank (a masked rank's is garbage, as a
/// stale half of NRECV may be), then broken as `brk` says.
fn case(
    hosts: usize,
    l: usize,
    chans: usize,
    t: usize,
    masked: u64,
    seed: u64,
    brk: Break,
) -> Case {
    let r = hosts * l;
    let cfg = Config {
        channels: chans,
        ..Config::high_throughput(128, t, r, 1)
    };
    let s = Shape::of(&cfg, r, l);
    let mut active: Vec<bool> = (0..r).map(|p| masked >> (p % 64) & 1 == 0).collect();
    active[0] = true;
    let mut g = Gen(seed);
    let mw = s.mask_words();
    let c = s.chans;
    let mut rows: Vec<Vec<u32>> = (0..r)
        .map(|p| {
            if !active[p] {
                return (0..s.row_words()).map(|_| g.next() as u32).collect();
            }
            let mut row = vec![0u32; s.row_words()];
            for (q, _) in active.iter().enumerate().filter(|(_, a)| **a) {
                row[q / 32] |= 1 << (q % 32);
            }
            // Each destination's and host's counts sum to at most t.
            for group in 0..r + s.h {
                let mut left = t as u64;
                for ch in 0..c {
                    let n = g.below(left + 1);
                    left -= n;
                    row[mw + group * c + ch] = n as u32;
                }
            }
            row
        })
        .collect();
    let live: Vec<usize> = (0..r).filter(|&p| active[p]).collect();
    let src = live[g.below(live.len() as u64) as usize];
    match brk {
        Break::None => {}
        Break::Refused => rows[src] = plan::refused_row(&s, &active),
        Break::Over { host } => {
            let group = if host {
                r + g.below(s.h as u64) as usize
            } else {
                g.below(r as u64) as usize
            };
            let at = mw + group * c;
            let sum: u32 = rows[src][at..at + c].iter().sum();
            rows[src][at + g.below(c as u64) as usize] += t as u32 + 1 - sum;
        }
        Break::Mask => {
            let q = g.below(r as u64) as usize;
            rows[src][q / 32] ^= 1 << (q % 32);
        }
    }
    Case { s, active, rows }
}

/// The host's verdict on `c`'s rows, and where it takes them its plan.
fn host_plan(c: &Case) -> Option<Vec<u32>> {
    let raw: Vec<u8> = c
        .rows
        .iter()
        .flatten()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    match notify_rows(&c.s, 0, &c.active, &raw) {
        Ok(Rows::Taken(rows)) => Some(Plan::new(&c.s, c.active.clone(), &rows).tables()),
        Ok(Rows::Refused(_)) | Err(_) => None,
    }
}

fn check(c: &Case) -> Result<(), TestCaseError> {
    let Some((refused, table)) = run_host(c) else {
        return Ok(());
    };
    let want = host_plan(c);
    prop_assert_eq!(
        refused,
        want.is_none(),
        "the kernel's verdict is not the host's"
    );
    if let Some(want) = want {
        prop_assert_eq!(table.len(), TableAt::of(c.s.r, c.s.h, c.s.chans).words);
        if let Some(i) = (0..want.len()).find(|&i| table[i] != want[i]) {
            prop_assert!(
                false,
                "table word {} is {}, the host's plan says {}",
                i,
                table[i],
                want[i]
            );
        }
    }
    Ok(())
}

fn breaks() -> impl Strategy<Value = Break> {
    prop_oneof![
        2 => Just(Break::None),
        1 => Just(Break::Refused),
        1 => any::<bool>().prop_map(|host| Break::Over { host }),
        1 => Just(Break::Mask),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn the_plan_built_on_the_gpu_is_the_hosts(
        hosts in 1usize..6, l in 1usize..9, chans in 1usize..5, t in 1usize..40,
        masked in any::<u64>(), seed in any::<u64>(), brk in breaks(),
    ) {
        check(&case(hosts, l, chans, t, masked, seed, brk))?;
    }
}

/// Each kind of break, once each on a fixed shape (2 hosts of 3 ranks,
/// rank 4 masked), is refused by both; the same rows unbroken are taken
/// by both, with the same table.
#[test]
fn every_kind_of_broken_row_is_refused_on_the_gpu_as_on_the_host() {
    for brk in [
        Break::None,
        Break::Refused,
        Break::Over { host: false },
        Break::Over { host: true },
        Break::Mask,
    ] {
        let c = case(2, 3, 2, 9, 1 << 4, 7, brk);
        assert_eq!(
            host_plan(&c).is_none(),
            !matches!(brk, Break::None),
            "{brk:?}"
        );
        check(&c).unwrap();
    }
}

/// Past 32 ranks the rows carry two words of active mask: 5 hosts of 8,
/// ranks 3 and 35 masked (one in each word). Unbroken, the rows are taken
/// with the host's table; a mask bit flipped in the second word (rank 33
/// or 35, seen from an active peer), a count of a destination past rank 32
/// above the maximum, or a refused row, are refused by both.
#[test]
fn forty_ranks_two_mask_words_are_judged_alike() {
    let masked = 1 << 3 | 1 << 35;
    let c = case(5, 8, 3, 17, masked, 11, Break::None);
    assert_eq!(c.s.mask_words(), 2);
    assert!(host_plan(&c).is_some());
    check(&c).unwrap();
    let mw = c.s.mask_words();
    for (src, q) in [(36, 33), (0, 35), (39, 35)] {
        let mut b = c.clone();
        b.rows[src][q / 32] ^= 1 << (q % 32);
        assert!(host_plan(&b).is_none(), "mask bit {q} of rank {src}");
        check(&b).unwrap();
    }
    let mut over = c.clone();
    let at = mw + 38 * c.s.chans;
    over.rows[34][at] += 18;
    assert!(host_plan(&over).is_none());
    check(&over).unwrap();
    let mut refused = c.clone();
    refused.rows[37] = plan::refused_row(&c.s, &c.active);
    assert!(host_plan(&refused).is_none());
    check(&refused).unwrap();
    // A masked rank's stale row, however broken, is not read.
    let mut stale = c;
    stale.rows[35] = plan::refused_row(&stale.s, &stale.active);
    assert!(host_plan(&stale).is_some());
    check(&stale).unwrap();
}
