//! `ep_ht_layout` (`kernels/ht.cu`: the checks and layout of a dispatch
//! from GPU memory, on the GPU) against the host path's: its steps compiled
//! as host C++ (`tests/ht_layout_host.cpp`, the kernel's functions in the
//! kernel's order, its chunks of `LAYOUT_TILES` 512-thread tiles emulated)
//! over random routings (unequal token counts, empty `-1` slots, masked
//! ranks, 2 to 16 ranks on 1 or 2 emulated hosts, 1 to 8 channels, more
//! channels than tokens, up to 1600 tokens: several tiles; by hand, 16384 +
//! 700 tokens: two chunks) write the notify row the host
//! builds from [`Layout`] ([`plan::notify_row`]), every word of the
//! metadata `ep_ht_stage_meta` writes from the host's slots
//! ([`plan::meta_word`]), and on bad entries (experts out of range or
//! below -1 or beyond the i32 range, named twice, a live slot's weight NaN
//! or infinite, alone and together, on active and masked ranks) the
//! refused row
//! ([`plan::refused_row`]) and the words that decode to the error the
//! host's checks ([`crate::ll::check_inputs`]) return for the same inputs:
//! the same first bad entry.
//!
//! Needs a C++ compiler (`CXX`, else `c++`): skipped with a printed reason
//! where there is none, except in CI (`CI` set), where that is a failure.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::sync::OnceLock;

use proptest::prelude::*;

use super::*;
use crate::Config;

use super::tests::common;

/// One case: rank `me`'s shape, mask and routing.
#[derive(Debug, Clone)]
struct Case {
    cfg: Config,
    s: Shape,
    me: usize,
    active: Vec<bool>,
    tokens: usize,
    idx: Vec<i64>,
    w: Vec<f32>,
}

impl Case {
    fn lexp(&self) -> usize {
        self.cfg.local_experts(self.s.r)
    }
}

/// What ht_layout_host wrote for one case.
#[derive(Debug, PartialEq, Eq)]
struct Out {
    row: Vec<u32>,
    meta: Vec<u32>,
    words: Vec<u64>,
}

fn host_exe() -> Option<&'static std::path::PathBuf> {
    static EXE: OnceLock<Option<std::path::PathBuf>> = OnceLock::new();
    EXE.get_or_init(|| common::compile("ht_layout_host", &[], "device layout check"))
        .as_ref()
}

/// Runs the kernel's steps compiled as host C++ on `cases` (None: no C++
/// compiler).
fn run_host(cases: &[Case]) -> Option<Vec<Out>> {
    let exe = host_exe()?;
    let mut input = Vec::new();
    input.extend(u32::try_from(cases.len()).unwrap().to_le_bytes());
    for c in cases {
        let words = shape_words(&c.s, c.me, c.cfg.hidden, c.lexp(), false);
        for w in words {
            input.extend(w.to_le_bytes());
        }
        input.extend(u32::try_from(c.tokens).unwrap().to_le_bytes());
        for &a in &c.active {
            input.extend(u32::from(a).to_le_bytes());
        }
        for v in &c.idx {
            input.extend(v.to_le_bytes());
        }
        for v in &c.w {
            input.extend(v.to_bits().to_le_bytes());
        }
    }
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = std::env::temp_dir();
    let (inp, outp) = (
        tmp.join(format!("gin-ep-ht-layout-{}-{n}.in", std::process::id())),
        tmp.join(format!("gin-ep-ht-layout-{}-{n}.out", std::process::id())),
    );
    std::fs::write(&inp, &input).unwrap();
    let st = std::process::Command::new(exe)
        .arg(&inp)
        .arg(&outp)
        .status()
        .unwrap();
    let bytes = std::fs::read(&outp).unwrap_or_default();
    std::fs::remove_file(&inp).ok();
    std::fs::remove_file(&outp).ok();
    assert!(st.success(), "ht_layout_host: {st:?}");
    let mut at = 0;
    let mut take = |n: usize| {
        let b = bytes[at..at + n].to_vec();
        at += n;
        b
    };
    let u32s = |b: Vec<u8>| -> Vec<u32> {
        b.chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    let outs = cases
        .iter()
        .map(|c| {
            let row = u32s(take(4 * c.s.row_words()));
            let meta = u32s(take(c.tokens * c.s.mm));
            let words = take(8 * LayoutOut::WORDS)
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
                .collect();
            Out { row, meta, words }
        })
        .collect();
    assert_eq!(at, bytes.len(), "ht_layout_host wrote more than expected");
    Some(outs)
}

static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Checks the kernel's output for `c` against the host path's.
fn check(c: &Case, got: &Out) -> Result<(), TestCaseError> {
    let l = c.s.l;
    let host = crate::ll::check_inputs(
        c.me,
        &c.cfg,
        &c.active,
        l,
        c.tokens * c.cfg.hidden,
        &c.idx,
        &c.w,
    );
    let refused = LayoutOut::refusal(c.me, &c.cfg, &got.words);
    match host {
        Ok(lay) => {
            prop_assert!(refused.is_none(), "refused valid inputs: {refused:?}");
            prop_assert_eq!(got.words[LayoutOut::KEY], u64::MAX);
            prop_assert_eq!(&got.row, &plan::notify_row(&c.s, &lay, &c.active));
            let words = c.s.mm / 4;
            for t in 0..c.tokens {
                for i in 0..words {
                    prop_assert_eq!(
                        got.meta[t * words + i],
                        plan::meta_word(&c.s, &lay, &c.idx, &c.w, t, i),
                        "token {} word {}",
                        t,
                        i
                    );
                }
            }
        }
        Err(e) => {
            prop_assert_eq!(&got.row, &plan::refused_row(&c.s, &c.active));
            prop_assert!(plan::is_refused(&c.s, &got.row));
            let Some(mine) = refused else {
                return Err(TestCaseError::fail(format!("not refused; the host: {e}")));
            };
            prop_assert_eq!(format!("{mine:?}"), format!("{e:?}"));
        }
    }
    Ok(())
}

/// Random routing of up to `max_tokens` tokens (at least `min_tokens` as
/// the buffer's size): per token distinct experts, some slots -1; then
/// `faults` bad entries of random kinds.
fn case_strategy(min_tokens: usize, max_tokens: usize) -> impl Strategy<Value = Case> {
    (
        1usize..=2,              // hosts
        1usize..=8,              // ranks per host
        1usize..=4,              // experts per rank
        1usize..=8,              // top-k (at most the experts)
        1usize..=8,              // channels
        min_tokens..=max_tokens, // max tokens
        any::<u64>(),            // seed
        0usize..=3,              // faults
    )
        .prop_filter("2 to 16 ranks", |(h, l, ..)| (2..=16).contains(&(h * l)))
        .prop_map(|(hosts, l, per, k, chans, t, seed, faults)| {
            let r = hosts * l;
            let experts = per * r;
            let k = k.min(experts);
            let cfg = Config {
                channels: chans,
                ..Config::high_throughput(128, t, experts, k)
            };
            let s = Shape::of(&cfg, r, l);
            let mut rng = Rng(seed | 1);
            let me = rng.below(r);
            let mut active: Vec<bool> = (0..r).map(|_| rng.below(4) != 0).collect();
            active[me] = true;
            // Unequal token counts, 0 included (below min_tokens too).
            let tokens = rng.below(t + 1);
            let mut idx = Vec::with_capacity(tokens * k);
            for _ in 0..tokens {
                let mut row: Vec<i64> = Vec::new();
                while row.len() < k {
                    let e = rng.below(experts) as i64;
                    if !row.contains(&e) {
                        row.push(e);
                    }
                }
                for e in &mut row {
                    if rng.below(4) == 0 {
                        *e = -1;
                    }
                }
                idx.extend(row);
            }
            let mut w: Vec<f32> = (0..tokens * k)
                .map(|_| rng.below(1000) as f32 / 100.0)
                .collect();
            // A NaN weight on an empty slot is no fault.
            if tokens > 0 && rng.below(3) == 0 {
                let at = rng.below(tokens * k);
                if idx[at] == -1 {
                    w[at] = f32::NAN;
                }
            }
            for _ in 0..if tokens == 0 { 0 } else { faults } {
                let at = rng.below(tokens * k);
                match rng.below(8) {
                    0 => idx[at] = (experts + rng.below(4)) as i64,
                    // Beyond the i32 range: the low 32 bits name a valid
                    // expert, which a check of a truncated id would take.
                    6 => idx[at] = (1i64 << 32) + rng.below(experts) as i64,
                    7 => idx[at] = -(1i64 << 32) + rng.below(experts) as i64,
                    1 => idx[at] = -2 - rng.below(3) as i64,
                    2 if k > 1 => {
                        let row = at / k * k;
                        let other = row + (at % k + 1 + rng.below(k - 1)) % k;
                        idx[at] = if idx[other] >= 0 { idx[other] } else { 0 };
                        if idx[other] < 0 {
                            idx[other] = 0;
                        }
                    }
                    3 => w[at] = f32::NAN,
                    4 => w[at] = f32::INFINITY,
                    _ => w[at] = f32::NEG_INFINITY,
                }
            }
            Case {
                cfg,
                s,
                me,
                active,
                tokens,
                idx,
                w,
            }
        })
}

/// xorshift64*.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// The kernel's row, metadata and verdict are the host path's, on 16
    /// random cases per run of the host build.
    #[test]
    fn the_gpu_layout_is_the_hosts(cases in proptest::collection::vec(case_strategy(1, 40), 16)) {
        let Some(outs) = run_host(&cases) else { return Ok(()); };
        for (c, got) in cases.iter().zip(&outs) {
            check(c, got)?;
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// The same over several of the kernel's 512-token tiles (up to 1600
    /// tokens: a slot's count carried from tile to tile, channels that
    /// start inside a later tile), 4 cases per run of the host build.
    #[test]
    fn the_gpu_layout_is_the_hosts_over_tiles(
        cases in proptest::collection::vec(case_strategy(513, 1600), 4)
    ) {
        let Some(outs) = run_host(&cases) else { return Ok(()); };
        for (c, got) in cases.iter().zip(&outs) {
            check(c, got)?;
        }
    }
}

/// Over tiles by hand: 1100 tokens (three 512-token tiles, the last part
/// full) on 2 ranks of one host, every token to rank 1 and every other one
/// to rank 0 too: the slots run on across the tiles (token 1099's slot at
/// rank 1 is 1099, at rank 0 549), the channels' counts are the tokens in
/// their ranges; and an id of 2^32 + 1 (expert 1 in its low 32 bits) at
/// token 1000, in the third tile, is refused naming it as the host does.
#[test]
fn layouts_over_tiles_and_ids_beyond_i32() {
    let tokens = 1100;
    let cfg = Config {
        channels: 3,
        ..Config::high_throughput(128, tokens, 4, 2)
    };
    let s = Shape::of(&cfg, 2, 2);
    let mut idx = Vec::with_capacity(2 * tokens);
    for t in 0..tokens {
        idx.extend([2 + (t % 2) as i64, if t % 2 == 0 { 0 } else { -1 }]);
    }
    let base = Case {
        cfg,
        s,
        me: 0,
        active: vec![true, true],
        tokens,
        idx,
        w: vec![0.5; 2 * tokens],
    };
    let mut wide = base.clone();
    wide.idx[2 * 1000 + 1] = (1i64 << 32) + 1;
    let cases = [base, wide];
    let Some(outs) = run_host(&cases) else {
        return;
    };
    for (c, got) in cases.iter().zip(&outs) {
        check(c, got).unwrap();
    }
    let words = s.mm / 4;
    let slot = |t: usize, d: usize| outs[0].meta[t * words + s.w_rank_slot(d)];
    assert_eq!(
        (slot(1099, 1), slot(1098, 0), slot(1099, 0)),
        (1099, 549, crate::layout::NONE)
    );
    assert_eq!((slot(600, 1), slot(600, 0)), (600, 300));
    // Channels of 366, 367 and 367 tokens (chan_lo): rank 0 gets every
    // other one (the even ones).
    let mw = s.mask_words();
    assert_eq!(&outs[0].row[mw..mw + 3], &[183, 184, 183]);
    assert_eq!(&outs[0].row[mw + 3..mw + 6], &[366, 367, 367]);
    let e = LayoutOut::refusal(0, &cfg, &outs[1].words).unwrap();
    assert!(
        matches!(
            e,
            EpError::ExpertOutOfRange {
                rank: 0,
                token: 1000,
                slot: 1,
                expert,
                ..
            } if expert == (1i64 << 32) + 1
        ),
        "{e}"
    );
}

/// Over the kernel's chunks of `LAYOUT_TILES` tiles (its bits of a u32 per
/// thread): 16384 + 700 tokens on 2 hosts of 2 ranks, rank 2 masked, each
/// token to expert `t mod 8` and, every third token, `(t + 3) mod 8`: the
/// slots and channel counts run on from the first chunk into the second,
/// at ranks and at hosts, as the host path lays them out.
#[test]
fn layouts_over_chunks_of_tiles() {
    let kernels = include_str!("../../../kernels/ht.cu");
    assert!(kernels.contains("constexpr u32 LAYOUT_TILES = 32;"));
    let tokens = 32 * 512 + 700;
    let cfg = Config {
        channels: 5,
        ..Config::high_throughput(128, tokens, 8, 2)
    };
    let s = Shape::of(&cfg, 4, 2);
    let mut idx = Vec::with_capacity(2 * tokens);
    for t in 0..tokens {
        let e = (t % 8) as i64;
        idx.extend([e, if t % 3 == 0 { (e + 3) % 8 } else { -1 }]);
    }
    let c = Case {
        cfg,
        s,
        me: 1,
        active: vec![true, true, false, true],
        tokens,
        idx,
        w: vec![0.25; 2 * tokens],
    };
    let Some(outs) = run_host(std::slice::from_ref(&c)) else {
        return;
    };
    check(&c, &outs[0]).unwrap();
    // The last token (17083: expert 3, rank 1; 17083 mod 3 = 1, one slot)
    // comes after a quarter of the tokens before it at rank 1.
    let words = s.mm / 4;
    let last = tokens - 1;
    assert_eq!(outs[0].meta[last * words + s.w_rank_slot(1)] as usize, {
        (0..last)
            .filter(|t| {
                let (e, f) = (t % 8, (t % 8 + 3) % 8);
                e / 2 == 1 || (t % 3 == 0 && f / 2 == 1)
            })
            .count()
    });
}

/// Over a partial group of the kernel's `LAYOUT_WIDE` tiles judged at a
/// time: 3000 tokens (five full 512-token tiles and one of 440, so the
/// second group of four holds two tiles, the last one partial) at top-3
/// (no whole group of four ids), on 2 hosts of 2 ranks with rank 1 masked:
/// the emulation lays them out as the host path does.
#[test]
fn layouts_over_a_partial_group_of_wide_tiles() {
    let kernels = include_str!("../../../kernels/ht.cu");
    assert!(kernels.contains("constexpr u32 LAYOUT_WIDE = 4;"));
    let tokens = 3000;
    let cfg = Config {
        channels: 7,
        ..Config::high_throughput(128, tokens, 8, 3)
    };
    let s = Shape::of(&cfg, 4, 2);
    let mut idx = Vec::with_capacity(3 * tokens);
    for t in 0..tokens {
        let e = (t % 8) as i64;
        idx.extend([
            e,
            if t % 5 == 0 { -1 } else { (e + 3) % 8 },
            if t % 7 == 0 { (e + 6) % 8 } else { -1 },
        ]);
    }
    let c = Case {
        cfg,
        s,
        me: 2,
        active: vec![true, false, true, true],
        tokens,
        idx,
        w: vec![0.125; 3 * tokens],
    };
    let Some(outs) = run_host(std::slice::from_ref(&c)) else {
        return;
    };
    check(&c, &outs[0]).unwrap();
}

/// The host C++ emulates blocks of the threads the kernels launch with.
#[test]
fn the_host_emulation_tiles_as_the_kernel() {
    let cpp = include_str!("../../../tests/ht_layout_host.cpp");
    let ll = include_str!("../../../kernels/ll.cu");
    let threads = super::super::THREADS;
    assert!(cpp.contains(&format!("constexpr u32 THREADS = {threads};")));
    assert!(ll.contains(&format!("#define EP_THREADS {threads}")));
}

/// Hand-made cases: a token that names two experts of one rank counts once
/// there, a masked rank's slots count as empty, channels that start at the
/// end count nothing, and the first bad entry is the first weight fault
/// before any entry fault (the host's order), named with its token and
/// slot.
#[test]
fn hand_made_layouts_and_refusals() {
    // 2 hosts of 2, 2 experts per rank, top-2, 3 channels.
    let cfg = Config {
        channels: 3,
        ..Config::high_throughput(128, 8, 8, 2)
    };
    let s = Shape::of(&cfg, 4, 2);
    let base = Case {
        cfg,
        s,
        me: 1,
        active: vec![true, true, false, true],
        tokens: 2,
        // Token 0: experts 0 and 1 (rank 0 twice); token 1: expert 5 (rank
        // 2, masked) and 7 (rank 3).
        idx: vec![0, 1, 5, 7],
        w: vec![1.0; 4],
    };
    let mut bad_w = base.clone();
    // A bad weight at token 1 wins over an entry out of range at token 0.
    bad_w.idx[1] = 9;
    bad_w.w[3] = f32::NAN;
    let mut dup = base.clone();
    dup.idx[3] = 5;
    let mut masked_range = base.clone();
    masked_range.idx[2] = -3;
    let cases = [base, bad_w, dup, masked_range];
    let Some(outs) = run_host(&cases) else {
        return;
    };
    for (c, got) in cases.iter().zip(&outs) {
        check(c, got).unwrap();
    }
    // 3 channels over 2 tokens: channel 0 holds none, channel 1 token 0,
    // channel 2 token 1. Rank 0's count in channel 1 is 1, not 2; rank 2
    // gets nothing; rank 3 and host 1 one each, in channel 2.
    let mw = s.mask_words();
    assert_eq!(outs[0].row[0], 0b1011);
    assert_eq!(&outs[0].row[mw..mw + 3], &[0, 1, 0]);
    assert_eq!(&outs[0].row[mw + 6..mw + 9], &[0, 0, 0]);
    assert_eq!(&outs[0].row[mw + 9..mw + 12], &[0, 0, 1]);
    assert_eq!(&outs[0].row[mw + 15..mw + 18], &[0, 0, 1]);
    let e = LayoutOut::refusal(1, &cfg, &outs[1].words).unwrap();
    assert!(
        matches!(
            e,
            EpError::BadWeight {
                rank: 1,
                token: 1,
                slot: 1,
                ..
            }
        ),
        "{e}"
    );
    let e = LayoutOut::refusal(1, &cfg, &outs[2].words).unwrap();
    assert!(
        matches!(
            e,
            EpError::DuplicateExpert {
                token: 1,
                first: 0,
                second: 1,
                expert: 5,
                ..
            }
        ),
        "{e}"
    );
    let e = LayoutOut::refusal(1, &cfg, &outs[3].words).unwrap();
    assert!(
        matches!(
            e,
            EpError::ExpertOutOfRange {
                token: 1,
                slot: 0,
                expert: -3,
                ..
            }
        ),
        "{e}"
    );
}

/// The words the host reads are where ht.cu's `ep_ht_layout` writes them.
#[test]
fn layout_out_words_match_the_kernel() {
    let text = include_str!("../../../kernels/ht.cu");
    let line = text
        .lines()
        .find(|l| l.starts_with("constexpr u32 LO_REFUSED"))
        .unwrap();
    assert_eq!(
        line,
        format!(
            "constexpr u32 LO_REFUSED = {}, LO_KEY = {}, LO_ERR = {}, LO_WORDS = {};",
            LayoutOut::REFUSED,
            LayoutOut::KEY,
            LayoutOut::ERR,
            LayoutOut::WORDS
        )
    );
    assert!(text.contains("constexpr u32 REFUSED = 0xffffffffu;"));
    assert_eq!(plan::REFUSED, 0xffff_ffff);
}

/// How the host reads the kernel's words: a real row is no refusal
/// (whatever else the words hold), a refused one names its entry as the
/// host's checks do, and a refusal naming none (sizes the kernel found
/// beyond the buffer's) is an error saying so rather than a success.
#[test]
fn the_hosts_reading_of_the_layout_words() {
    let cfg = Config::high_throughput(128, 8, 8, 2);
    let mut w = [0u64; LayoutOut::WORDS];
    w[LayoutOut::KEY] = u64::MAX;
    assert!(LayoutOut::refusal(2, &cfg, &w).is_none());
    // ERR_EXPERT_RANGE (5): token 3, slot 1, expert 9.
    w[LayoutOut::REFUSED] = 1;
    w[LayoutOut::ERR..].copy_from_slice(&[5, 3, 1, 9]);
    let e = LayoutOut::refusal(2, &cfg, &w).unwrap();
    assert!(
        matches!(
            e,
            EpError::ExpertOutOfRange {
                rank: 2,
                token: 3,
                slot: 1,
                expert: 9,
                experts: 8
            }
        ),
        "{e}"
    );
    w[LayoutOut::ERR..].fill(0);
    let e = LayoutOut::refusal(2, &cfg, &w).unwrap();
    assert!(
        matches!(&e, EpError::Mode { rank: 2, what } if what.contains("without naming an entry")),
        "{e}"
    );
}
