//! Host-side tests of high-throughput mode on CUDA ranks: the kernels
//! compile (NVRTC), the names and constants the host and `kernels/ht.cu`
//! share agree, the host's staging and checks of a step, and the kernels'
//! index arithmetic (compiled as host C++) against the CPU ranks' plan.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::fmt::Write as _;
use std::sync::OnceLock;

use proptest::prelude::*;

use super::*;
use crate::Config;
use crate::ht::plan::{CGET, CHUNK, CRDMA, CSEND, CSTAGE, MIN, NRECV, NSEND, RECVM, RECVX};
use crate::ht::plan::{RINGM, RINGX, RUN, STAGE, XIN, forwarder};
use crate::num::quantize_fp8;

#[path = "../../../tests/common/mod.rs"]
pub(super) mod common;

/// NVRTC compiles the high-throughput kernels (with the low-latency ones
/// before them, as `CudaBuffer::new` does) for Hopper and Ampere. Skipped
/// with a reason where NVRTC cannot be loaded, except under
/// `GIN_REQUIRE_NVRTC=1` (`.ci/nvcc-check`).
#[test]
fn nvrtc_compiles_the_ht_kernels_for_hopper_and_ampere() {
    crate::cuda::tests::assert_nvrtc_compiles(HT_KERNELS, "ht.cu");
}

/// The kernels the host launches exist under the names it looks up, one
/// line each as the low-latency test reads them.
#[test]
fn every_ht_kernel_is_defined() {
    for name in [
        "ep_ht_notify",
        "ep_ht_dispatch",
        "ep_ht_echo",
        "ep_ht_combine",
        "ep_ht_quantize",
        "ep_ht_stage_meta",
        "ep_ht_layout",
    ] {
        let want = format!("extern \"C\" __global__ void __launch_bounds__(EP_THREADS) {name}(");
        assert!(HT_KERNELS.lines().any(|l| l.starts_with(&want)), "{name}");
    }
}

/// `constexpr u32 NAME = V;` of ht.cu, where declared alone or in a list.
fn kernel_u32(name: &str) -> Option<u64> {
    let text = include_str!("../../../kernels/ht.cu");
    text.split([';', '\n', ',']).find_map(|part| {
        let part = part.trim().trim_start_matches("constexpr u32 ");
        let (n, v) = part.split_once('=')?;
        (n.trim() == name).then(|| v.trim().parse().ok())?
    })
}

/// The shape words, constants and window indices are where ht.cu reads
/// them.
#[test]
fn shape_words_constants_and_windows_match_the_kernels() {
    for (name, at) in SHAPE_WORDS {
        assert_eq!(kernel_u32(name), Some(at as u64), "{name}");
    }
    assert_eq!(kernel_u32("SW_WORDS"), Some(SHAPE_WORDS.len() as u64));
    for (name, v) in [
        ("CHUNK", CHUNK),
        ("RUN", RUN),
        ("STAGE", STAGE),
        ("MAX_ROWS", MAX_ROWS),
        ("FETCH_ROWS", FETCH_ROWS),
    ] {
        assert_eq!(kernel_u32(name), Some(v as u64), "{name}");
    }
    for (name, w) in [
        ("NSEND", NSEND),
        ("NRECV", NRECV),
        ("XIN", XIN),
        ("MIN", MIN),
        ("RINGX", RINGX),
        ("RINGM", RINGM),
        ("RECVX", RECVX),
        ("RECVM", RECVM),
        ("CSEND", CSEND),
        ("CSTAGE", CSTAGE),
        ("CRDMA", CRDMA),
        ("CGET", CGET),
    ] {
        assert_eq!(kernel_u32(name), Some(w as u64), "window {name}");
    }
    assert_eq!(kernel_u32("WINDOWS"), Some(12));
    assert_eq!(
        kernel_u32("NONE"),
        None,
        "NONE is 0xffffffffu, not a decimal"
    );
    assert!(include_str!("../../../kernels/ht.cu").contains("constexpr u32 NONE = 0xffffffffu;"));
    assert_eq!(crate::layout::NONE, 0xffff_ffff);
}

#[test]
fn shape_words_hold_the_buffers_values() {
    let cfg = Config {
        channels: 3,
        ring_slots: 5,
        fp8: true,
        ..Config::high_throughput(256, 40, 16, 4)
    };
    let s = Shape::of(&cfg, 8, 2);
    let w = shape_words(&s, 5, cfg.hidden, cfg.local_experts(8), cfg.fp8);
    let at = |name: &str| w[SHAPE_WORDS.iter().find(|(n, _)| *n == name).unwrap().1];
    assert_eq!(w.len(), SHAPE_WORDS.len());
    assert_eq!((at("SW_R"), at("SW_H"), at("SW_L")), (8, 4, 2));
    assert_eq!(
        (at("SW_T"), at("SW_K"), at("SW_RING"), at("SW_CHANS")),
        (40, 4, 5, 3)
    );
    assert_eq!(at("SW_P") as usize, cfg.payload_bytes());
    assert_eq!(at("SW_MM") as usize, s.mm);
    assert_eq!(at("SW_H2"), 512);
    assert_eq!(
        (at("SW_RANK"), at("SW_HIDDEN"), at("SW_LEXP"), at("SW_FP8")),
        (5, 256, 2, 1)
    );
    assert_eq!(at("SW_NSIG"), s.signals());
}

fn shape(r: usize, l: usize, chans: usize) -> (Config, Shape) {
    let cfg = Config {
        channels: chans,
        ..Config::high_throughput(128, 10, 2 * r, 2)
    };
    (cfg, Shape::of(&cfg, r, l))
}

/// A row as `notify_row` writes it, as bytes.
fn row_bytes(row: &[u32]) -> Vec<u8> {
    row.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// Every rank's layout of a small routing table, under `active`.
fn layouts(cfg: &Config, s: &Shape, active: &[bool], seed: u64) -> Vec<Layout> {
    (0..s.r)
        .map(|rank| {
            let input = crate::oracle::rank_input(
                seed,
                rank,
                s.r,
                crate::oracle::tokens_for_rank(cfg.max_tokens_per_rank, rank),
                cfg.hidden,
                cfg.num_experts,
                cfg.topk,
            );
            Layout::new(
                rank,
                &input.topk_idx,
                cfg.topk,
                cfg.num_experts,
                active,
                s.l,
            )
            .unwrap()
        })
        .collect()
}

#[test]
fn notify_rows_are_taken_checked_and_a_differing_mask_is_refused() {
    let (cfg, s) = shape(4, 2, 2);
    let active = vec![true, true, false, true];
    let lays = layouts(&cfg, &s, &active, 7);
    let mut raw: Vec<u8> = Vec::new();
    for lay in &lays {
        raw.extend(row_bytes(&plan::notify_row(&s, lay, &active)));
    }
    let Rows::Taken(rows) = notify_rows(&s, 1, &active, &raw).unwrap() else {
        panic!("good rows read as refused")
    };
    assert!(rows[2].is_none(), "a masked rank's row is not taken");
    for (p, row) in rows.iter().enumerate().filter(|(p, _)| active[*p]) {
        assert_eq!(
            row.as_ref().unwrap(),
            &plan::notify_row(&s, &lays[p], &active)
        );
    }
    // Rank 3 masked rank 0 where this rank did not.
    let width = 4 * s.row_words();
    let mut odd = raw.clone();
    odd[3 * width] &= !1;
    match notify_rows(&s, 1, &active, &odd) {
        Err(EpError::Protocol {
            rank: 1,
            peer: 3,
            what,
        }) => {
            assert!(
                what.contains("rank 0") && what.contains("set_active"),
                "{what}"
            );
        }
        other => panic!("{other:?}"),
    }
    // Rank 0 claims more tokens for this rank than the buffer holds.
    let mut over = raw;
    let at = 4 * (s.mask_words() + s.chans); // rank 0's count for rank 1, channel 0
    over[at..at + 4].copy_from_slice(&(s.t as u32 + 1).to_le_bytes());
    assert!(matches!(
        notify_rows(&s, 1, &active, &over),
        Err(EpError::Protocol {
            rank: 1,
            peer: 0,
            ..
        })
    ));
}

/// A rank whose inputs were refused sends [`plan::refused_row`] in the
/// count exchange: every peer reads it as that rank's refusal (a protocol
/// error naming it, the lowest such rank where several refused), not as a
/// broken row, before any other row's checks; a masked rank's row is not
/// read at all; and a reader that did not know the mark would still
/// refuse the row (its counts are above any maximum).
#[test]
fn a_refused_row_ends_the_step_naming_its_rank() {
    let (cfg, s) = shape(4, 2, 2);
    let active = vec![true, true, false, true];
    let lays = layouts(&cfg, &s, &active, 7);
    let width = 4 * s.row_words();
    let mut raw: Vec<u8> = Vec::new();
    for lay in &lays {
        raw.extend(row_bytes(&plan::notify_row(&s, lay, &active)));
    }
    let refused = plan::refused_row(&s, &active);
    assert!(plan::is_refused(&s, &refused));
    assert_eq!(
        refused[..s.mask_words()],
        plan::notify_row(&s, &lays[0], &active)[..s.mask_words()]
    );
    assert!(matches!(
        plan::check_row(&s, 1, 3, &refused),
        Err(EpError::Protocol { peer: 3, .. })
    ));
    let with = |raw: &[u8], p: usize| {
        let mut v = raw.to_vec();
        v[p * width..(p + 1) * width].copy_from_slice(&row_bytes(&refused));
        v
    };
    let by3 = with(&raw, 3);
    match notify_rows(&s, 1, &active, &by3).unwrap() {
        Rows::Refused(e @ EpError::PeerRefused { rank: 1, peer: 3 }) => {
            assert!(e.to_string().contains("inputs were refused"), "{e}");
        }
        other => panic!("{other:?}"),
    }
    // Rank 0's row is broken too: the refusal (rank 3's) still comes first.
    let mut broken = by3.clone();
    broken[4 * s.mask_words()..4 * s.mask_words() + 4]
        .copy_from_slice(&(s.t as u32 + 1).to_le_bytes());
    assert!(matches!(
        notify_rows(&s, 1, &active, &broken),
        Ok(Rows::Refused(EpError::PeerRefused { peer: 3, .. }))
    ));
    // Ranks 0 and 3 refused: the lowest is named.
    assert!(matches!(
        notify_rows(&s, 1, &active, &with(&by3, 0)),
        Ok(Rows::Refused(EpError::PeerRefused { peer: 0, .. }))
    ));
    // A masked rank's slot is not read, whatever it holds.
    assert!(matches!(
        notify_rows(&s, 1, &active, &with(&raw, 2)),
        Ok(Rows::Taken(_))
    ));
}

fn handle(step: u64, tokens: usize, recv_prefix: &[u32]) -> CudaHtStep {
    CudaHtStep {
        step,
        tokens,
        recv_prefix: recv_prefix.to_vec(),
    }
}

/// A handle is the step under way only where this buffer's plan gave it:
/// one of another buffer at the same step number (other blocks by source,
/// or other tokens), or of a step with no plan from GPU memory (a
/// dispatch from host memory, a finished step), is refused naming it.
#[test]
fn a_foreign_handle_at_the_same_step_is_refused() {
    let prefix = [0u32, 3, 7];
    let mine = handle(4, 5, &prefix);
    own_step(1, "ht_read_back", &mine, 4, Some((&prefix, 5))).unwrap();
    for (h, here, says) in [
        (
            handle(4, 5, &[0, 2, 7]),
            Some((&prefix[..], 5)),
            "[0, 2, 7]",
        ),
        (
            handle(4, 6, &prefix),
            Some((&prefix[..], 5)),
            "dispatched 5 tokens",
        ),
        (mine.clone(), None, "no plan"),
    ] {
        match own_step(1, "ht_combine_device", &h, 4, here) {
            Err(EpError::Mode { rank: 1, what }) => {
                assert!(
                    what.starts_with("ht_combine_device: the handle of step 4"),
                    "{what}"
                );
                assert!(what.contains(says), "{what}");
            }
            other => panic!("{other:?}"),
        }
    }
}

/// The metadata `ep_ht_stage_meta` writes into MIN is the CPU ranks'
/// ([`plan::meta_word`], every word of every token: the kernel's
/// `meta_word` compiled as host C++ against it, from the routing and slots
/// as the pinned staging holds them), the staging's parts ([`Pinned`]) each
/// hold `t` tokens' worth, aligned and apart, and the receive side reads
/// the source index and weights back from those words.
#[test]
fn staged_metadata_is_the_cpu_ranks() {
    // 2 hosts of 2 ranks, top-2 of 8 experts, rank 0 with its 10 tokens.
    let j = job(2, 2, 2, 10, 2, 2, 4, 3, 0);
    let s = j.s;
    assert_eq!(j.tokens, 10);
    if let Some(got) = run_ht_host(&j, "staged") {
        assert_eq!(got, expected(&j));
    }
    let at = Pinned::of(&s);
    assert_eq!(
        (at.idx, at.weights, at.host_slot, at.rank_slot, at.bytes),
        (
            0,
            8 * s.t * s.k,
            12 * s.t * s.k,
            12 * s.t * s.k + 4 * s.t * s.h,
            12 * s.t * s.k + 4 * s.t * (s.h + s.r)
        )
    );
    assert_eq!(std::mem::size_of_val(&j.idx[..]), 8 * j.tokens * s.k);
    assert!(std::mem::size_of_val(&j.lay.host_slot[..]) <= at.rank_slot - at.host_slot);
    assert!(std::mem::size_of_val(&j.lay.rank_slot[..]) <= at.bytes - at.rank_slot);
    // What the combine and forwarders read: the host and rank slots.
    for t in 0..j.tokens {
        for h in 0..s.h {
            let w = plan::meta_word(&s, &j.lay, &j.idx, &j.w, t, s.w_host_slot(h));
            assert_eq!(w, j.lay.host_slot[t * s.h + h]);
        }
    }
    // The receive side reads the source index and weights back (rank 1's
    // experts: 2 and 3).
    let meta: Vec<u8> = (0..s.mm / 4)
        .flat_map(|i| plan::meta_word(&s, &j.lay, &j.idx, &j.w, 3, i).to_le_bytes())
        .collect();
    let mut counts = vec![0u32; 2];
    let (tok, w) = crate::ht::read_meta(&s, 2..4, &meta, &mut counts);
    assert_eq!(tok, 3);
    let k = s.k;
    let want_w: f32 = (0..k)
        .filter(|&i| (2..4).contains(&j.idx[3 * k + i]))
        .map(|i| j.w[3 * k + i])
        .sum();
    assert_eq!(w.to_bits(), want_w.to_bits());
}

/// A dispatch from GPU memory reads the caller's tokens in place unless
/// another active rank may be reached through a queue (which ranks receive
/// or forward its tokens the layout on the GPU and the plan decide, after
/// the copy is queued): a masked rank, or the rank itself, does not count.
#[test]
fn tokens_are_copied_into_xin_only_where_a_peer_may_be_queued() {
    let (_, s) = shape(4, 2, 2);
    let active = vec![true; 4];
    let q =
        |lsa: &[usize], active: &[bool]| queued_destination(&s, 0, active, |p| lsa.contains(&p));
    assert!(!q(&[0, 1, 2, 3], &active), "every peer load/store");
    assert!(!q(&[1, 2, 3], &active), "rank 0 itself is never queued");
    assert!(q(&[0, 2, 3], &active), "rank 1 queued");
    assert!(q(&[0, 1, 2], &active), "host 1's rank 3 queued");
    let mut masked = active.clone();
    masked[3] = false;
    assert!(!q(&[0, 1, 2], &masked), "rank 3 masked: it gets nothing");
}

/// The payloads go up as the caller's BF16 bytes, which are the CPU ranks'
/// BF16 payloads; with FP8, `ep_ht_quantize` quantises them on the GPU
/// into XIN with the payload as its message stride: ll.cu's
/// `quantize_tokens` (the low-latency dispatch's, checked bit for bit
/// against [`quantize_fp8`] on the GPU), whose layout (codes, then one
/// scale per 128 elements) is [`quantize_fp8`]'s for a payload of
/// `Config::payload_bytes`.
#[test]
fn payloads_go_up_as_the_callers_bytes_and_fp8_is_quantised_on_the_gpu() {
    let (cfg, s) = shape(4, 2, 2);
    let input = crate::oracle::rank_input(3, 1, 4, 9, cfg.hidden, cfg.num_experts, cfg.topk);
    assert_eq!(s.p, 2 * cfg.hidden);
    assert_eq!(bf16_bytes(&input.x).len(), 9 * s.p);
    for t in 0..9 {
        let row = &input.x[t * cfg.hidden..(t + 1) * cfg.hidden];
        assert_eq!(
            &bf16_bytes(&input.x)[t * s.p..(t + 1) * s.p],
            bf16_bytes(row)
        );
    }
    let f = Config { fp8: true, ..cfg };
    let sf = Shape::of(&f, 4, 2);
    let mut out = vec![0u8; sf.p];
    quantize_fp8(&input.x[..cfg.hidden], &mut out);
    assert_eq!(sf.p, cfg.hidden + 4 * (cfg.hidden / crate::num::FP8_BLOCK));
    let text = include_str!("../../../kernels/ht.cu");
    let body = text
        .split("ep_ht_quantize(")
        .nth(1)
        .and_then(|b| b.split('}').next())
        .unwrap();
    assert!(
        body.contains("ep::quantize_tokens(xin, xbf, tokens, p, h);"),
        "{body}"
    );
}

#[test]
fn tables_follow_their_layout() {
    let (cfg, s) = shape(6, 3, 2);
    let active = vec![true, true, true, true, false, true];
    let lays = layouts(&cfg, &s, &active, 11);
    let rows: Vec<Option<Vec<u32>>> = lays
        .iter()
        .enumerate()
        .map(|(p, lay)| active[p].then(|| plan::notify_row(&s, lay, &active)))
        .collect();
    let plan = Plan::new(&s, active.clone(), &rows);
    let t = plan.tables();
    let at = TableAt::of(s.r, s.h, s.chans);
    assert_eq!(t.len(), at.words);
    for src in 0..s.r {
        for dst in 0..s.r {
            for ch in 0..s.chans {
                assert_eq!(
                    t[at.rank_chan + (src * s.r + dst) * s.chans + ch],
                    plan.rank_chan(src, dst, ch)
                );
            }
            assert_eq!(
                t[at.recv_pre + dst * (s.r + 1) + src],
                plan.recv_start(dst, src)
            );
        }
        for h in 0..s.h {
            let f = plan
                .forwarder(src, h)
                .map_or(crate::layout::NONE, |p| p as u32);
            assert_eq!(t[at.fwd_of + src * s.h + h], f);
            for ch in 0..s.chans {
                assert_eq!(
                    t[at.host_chan + (src * s.h + h) * s.chans + ch],
                    plan.host_chan(src, h, ch)
                );
            }
        }
    }
}

/// The host C++ build of `tests/ht_host.cpp` (once per test process).
fn ht_host() -> Option<&'static std::path::PathBuf> {
    static EXE: OnceLock<Option<std::path::PathBuf>> = OnceLock::new();
    EXE.get_or_init(|| common::compile("ht_host", &[], "high-throughput index cross-check"))
        .as_ref()
}

/// What ht_host prints for one case, computed from the CPU ranks' plan
/// and metadata words (`j`'s rank 0: see tests/ht_host.cpp for the order).
fn expected(j: &Job) -> String {
    let (s, tokens, plan) = (&j.s, j.tokens, &j.plan);
    let mut o = String::new();
    let mut put = |v: u64| writeln!(o, "{v}").unwrap();
    put(u64::from(s.signals()));
    for src in 0..s.r {
        for v in [s.notify(src), s.tail(src), s.dtail(src), s.head(src)] {
            put(u64::from(v));
        }
    }
    for l in 0..s.l {
        put(u64::from(s.fwd(l)));
        put(u64::from(s.cready(l)));
    }
    for h in 0..s.h {
        put(u64::from(s.ctail(h)));
    }
    put(s.w_ids() as u64);
    put(s.w_weights() as u64);
    for h in 0..s.h {
        put(s.w_host_slot(h) as u64);
    }
    for r in 0..s.r {
        put(s.w_rank_slot(r) as u64);
    }
    for c in 0..s.chans {
        put(s.chan_range(tokens, c).start as u64);
    }
    put(s.chan_range(tokens, s.chans - 1).end as u64);
    put(TableAt::of(s.r, s.h, s.chans).words as u64);
    for src in 0..s.r {
        for dst in 0..s.r {
            for ch in 0..s.chans {
                put(u64::from(plan.rank_chan(src, dst, ch)));
                put(u64::from(plan.rank_chan_start(src, dst, ch)));
            }
            put(u64::from(plan.count(src, dst)));
        }
    }
    for src in 0..s.r {
        for h in 0..s.h {
            for ch in 0..s.chans {
                put(u64::from(plan.host_chan(src, h, ch)));
                put(u64::from(plan.host_chan_start(src, h, ch)));
            }
        }
    }
    for dst in 0..s.r {
        for &v in plan.recv_prefix(dst) {
            put(u64::from(v));
        }
    }
    for src in 0..s.r {
        for h in 0..s.h {
            put(plan
                .forwarder(src, h)
                .map_or(u64::from(crate::layout::NONE), |p| p as u64));
        }
    }
    for fwd in 0..s.r {
        let mine = plan.forwarded_sources(fwd);
        for src in 0..s.r {
            put(u64::from(mine.contains(&src)));
        }
    }
    for src in 0..s.r {
        for me in 0..s.r {
            for ch in 0..s.chans {
                // The CPU forwarder's FwdFrom::ring_expect and direct_expect.
                let n = plan.host_chan(src, me / s.l, ch);
                let direct = plan.rank_chan(src, me, ch);
                put(u64::from(n - direct.min(n)));
                put(u64::from(direct));
            }
        }
    }
    for ch in 0..s.chans {
        for src in 0..s.r {
            for seq in [0, 1, s.ring, 3 * s.ring + 1] {
                // The CPU lane's ring slot of a message's sequence number.
                put(((ch * s.r + src) * s.ring + seq % s.ring) as u64);
            }
        }
    }
    for h in 0..s.h {
        for hs in [0, s.t - 1] {
            put(((h * s.t + hs) * s.h2) as u64);
        }
    }
    for src in 0..s.r {
        for l in 0..s.l {
            for hs in [0, s.t - 1] {
                let at = (src * s.t + hs) * s.l + l;
                assert!(
                    at < s.r * s.t * s.l,
                    "contrib entry inside HtState's r × t × l"
                );
                put(at as u64);
            }
        }
    }
    for ch in 0..s.chans {
        put((ch * STAGE * s.h2) as u64);
        put(((ch * STAGE + STAGE - 1) * s.h2) as u64);
        for v in cget_places(s, ch) {
            put(v);
        }
    }
    for v in cget_verdicts(s) {
        put(v);
    }
    put(lane_words(s) as u64);
    // What ep_ht_stage_meta writes: the CPU ranks' words.
    for t in 0..tokens {
        for i in 0..s.mm / 4 {
            put(u64::from(plan::meta_word(s, &j.lay, &j.idx, &j.w, t, i)));
        }
    }
    o.push_str("--\n");
    o
}

/// CGET as CudaBuffer::new sizes it where a same-host peer's rows are
/// fetched (cget_bytes): its rows per channel, then channel `ch`'s rows'
/// offsets (ht.cu's `cget_rows`, `cget_off`).
fn cget_places(s: &Shape, ch: usize) -> Vec<u64> {
    let cfg = Config {
        channels: s.chans,
        ..Config::high_throughput(s.h2 / 2, s.t, s.r, 1)
    };
    let rows = cget_bytes(&cfg, s.l, true) / (s.chans * s.h2);
    assert_eq!(rows, cget_rows(s.l));
    std::iter::once(rows as u64)
        .chain((0..rows).map(|i| ((ch * rows + i) * s.h2) as u64))
        .collect()
}

/// check_cget's verdict (1: accepted) where every rank's rows are fetched,
/// for CGET of `l` rows a channel, `l - 1`, none and as sized: what ht.cu's
/// `cget_enough` says of the same sizes.
fn cget_verdicts(s: &Shape) -> [u64; 4] {
    let cfg = Config {
        channels: s.chans,
        ..Config::high_throughput(s.h2 / 2, s.t, s.r, 1)
    };
    let per = s.chans * s.h2;
    let fetched = vec![false; s.r];
    [per * s.l, per * (s.l - 1), 0, cget_bytes(&cfg, s.l, true)]
        .map(|bytes| u64::from(check_cget(&cfg, 0, s.l, bytes, &fetched).is_ok()))
}

/// ht_host's input for job `j` (see tests/ht_host.cpp).
fn host_input(j: &Job) -> String {
    let mut input = String::new();
    for w in shape_words(&j.s, 0, j.s.h2 / 2, 1, false) {
        write!(input, "{w} ").unwrap();
    }
    let tables = j.plan.tables();
    write!(input, "{} {} ", j.tokens, tables.len()).unwrap();
    for w in &tables {
        write!(input, "{w} ").unwrap();
    }
    for v in &j.idx {
        write!(input, "{v} ").unwrap();
    }
    for v in &j.w {
        write!(input, "{} ", v.to_bits()).unwrap();
    }
    for v in j.lay.host_slot.iter().chain(&j.lay.rank_slot) {
        write!(input, "{v} ").unwrap();
    }
    input
}

/// Runs ht_host on job `j`: what it printed (None: no C++ compiler).
fn run_ht_host(j: &Job, tag: &str) -> Option<String> {
    let exe = ht_host()?;
    let path =
        std::env::temp_dir().join(format!("gin-ep-ht-host-{}-{tag}.txt", std::process::id()));
    std::fs::write(&path, host_input(j)).unwrap();
    let out = std::process::Command::new(exe).arg(&path).output().unwrap();
    std::fs::remove_file(&path).ok();
    assert!(out.status.success(), "ht_host: {:?}", out.status);
    Some(String::from_utf8(out.stdout).unwrap())
}

/// One job of the cross-check: its shape, the plan, and rank 0's tokens,
/// routing and layout.
struct Job {
    s: Shape,
    tokens: usize,
    plan: Plan,
    lay: Layout,
    idx: Vec<i64>,
    w: Vec<f32>,
}

/// One random job: hosts of `l` ranks, some masked, random routing; the
/// plan every rank builds from the notify rows.
#[allow(clippy::too_many_arguments)] // the proptest's parameters, one each
fn job(
    hosts: usize,
    l: usize,
    chans: usize,
    t: usize,
    k: usize,
    per: usize,
    ring: usize,
    seed: u64,
    masked: u64,
) -> Job {
    let r = hosts * l;
    let cfg = Config {
        channels: chans,
        ring_slots: ring,
        ..Config::high_throughput(128, t, per * r, k.min(per * r))
    };
    let s = Shape::of(&cfg, r, l);
    let mut active: Vec<bool> = (0..r).map(|p| masked >> p & 1 == 0).collect();
    active[0] = true;
    let inputs: Vec<_> = (0..r)
        .map(|rank| {
            crate::oracle::rank_input(
                seed,
                rank,
                r,
                crate::oracle::tokens_for_rank(t, rank),
                128,
                cfg.num_experts,
                cfg.topk,
            )
        })
        .collect();
    let lays: Vec<Layout> = inputs
        .iter()
        .enumerate()
        .map(|(rank, input)| {
            Layout::new(rank, &input.topk_idx, cfg.topk, cfg.num_experts, &active, l).unwrap()
        })
        .collect();
    let rows: Vec<Option<Vec<u32>>> = lays
        .iter()
        .enumerate()
        .map(|(p, lay)| active[p].then(|| plan::notify_row(&s, lay, &active)))
        .collect();
    let input = inputs.into_iter().next().unwrap();
    Job {
        s,
        tokens: lays[0].tokens,
        plan: Plan::new(&s, active, &rows),
        lay: lays.into_iter().next().unwrap(),
        idx: input.topk_idx,
        w: input.weights,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// The kernels' index arithmetic (ht.cu's ep::ht as host C++) computes,
    /// from the shape words and the plan's table, what the CPU ranks' plan,
    /// lanes and combine compute: signal ids, metadata offsets, channel
    /// ranges, counts and their prefix sums per channel, block starts,
    /// forwarders (masked ranks rerouted), ring and direct expectations,
    /// ring slots, the combine's places; and the metadata words
    /// `ep_ht_stage_meta` writes (`meta_word`) are `plan::meta_word`'s.
    #[test]
    fn kernel_index_arithmetic_matches_the_cpu_plan(
        hosts in 1usize..4, l in 1usize..5, chans in 1usize..4, t in 1usize..13,
        k in 1usize..4, per in 1usize..4, ring in 1usize..6, seed in 0u64..1000, masked in 0u64..64,
    ) {
        let j = job(hosts, l, chans, t, k, per, ring, seed, masked);
        let Some(got) = run_ht_host(&j, &format!("{seed}-{masked}")) else { return Ok(()) };
        let want = expected(&j);
        if got != want {
            let line = got.lines().zip(want.lines()).position(|(a, b)| a != b);
            prop_assert!(false, "the kernels' arithmetic differs from the plan at line {line:?} (r {}, l {}, chans {}, t {})", j.s.r, j.s.l, j.s.chans, j.s.t);
        }
    }
}

#[test]
fn forwarders_in_the_table_are_the_cpu_ranks() {
    // 2 hosts of 3, rank 4 masked: its role passes on, as plan::forwarder.
    let plan = job(2, 3, 2, 6, 2, 2, 2, 5, 1 << 4).plan;
    let mut active = vec![true; 6];
    active[4] = false;
    for src in 0..6 {
        for h in 0..2 {
            assert_eq!(plan.forwarder(src, h), forwarder(&active, 3, src, h));
        }
    }
}

/// The parts of the pinned staging a step writes (offset, bytes): the
/// layout's slots and host inputs' top-k ids and weights.
fn pinned_parts(s: &Shape, lay: &Layout, idx: &[i64], w: &[f32]) -> Vec<(usize, Vec<u8>)> {
    let at = Pinned::of(s);
    vec![
        (
            at.host_slot,
            lay.host_slot.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ),
        (
            at.rank_slot,
            lay.rank_slot.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ),
        (at.idx, idx.iter().flat_map(|v| v.to_le_bytes()).collect()),
        (at.weights, w.iter().flat_map(|v| v.to_le_bytes()).collect()),
    ]
}

/// The metadata of every token of `lay`, as MIN holds it.
fn meta_bytes(s: &Shape, lay: &Layout, idx: &[i64], w: &[f32]) -> Vec<u8> {
    (0..lay.tokens)
        .flat_map(|t| (0..s.mm / 4).map(move |i| (t, i)))
        .flat_map(|(t, i)| plan::meta_word(s, lay, idx, w, t, i).to_le_bytes())
        .collect()
}

/// The host's stages of one high-throughput dispatch on CUDA ranks at
/// DeepEP's normal-mode size (4096 tokens × hidden 7168, top-8 of 64
/// experts, 2 ranks on one host): printed, not asserted (run with
/// `cargo test --release -p gin-ep host_stage_times -- --ignored
/// --nocapture`). docs/ep.md quotes what it printed.
#[test]
#[ignore = "timing, run by hand"]
fn host_stage_times() {
    use std::time::Instant;
    let (r, l, tokens, hidden, topk) = (2, 2, 4096, 7168, 8);
    for (fp8, chans) in [(false, 2), (false, 16), (true, 16)] {
        let cfg = Config {
            channels: chans,
            fp8,
            ..Config::high_throughput(hidden, tokens, 32 * r, topk)
        };
        let s = Shape::of(&cfg, r, l);
        let active = vec![true; r];
        let inputs: Vec<_> = (0..r)
            .map(|p| crate::oracle::rank_input(42, p, r, tokens, hidden, cfg.num_experts, topk))
            .collect();
        let me = &inputs[0];
        let reps = 5;
        let mut times: Vec<(&str, Vec<f64>)> = Vec::new();
        let mut time = |name: &'static str, f: &mut dyn FnMut()| {
            let mut v = Vec::new();
            for _ in 0..reps {
                let t0 = Instant::now();
                f();
                v.push(t0.elapsed().as_secs_f64() * 1e6);
            }
            v.sort_by(f64::total_cmp);
            times.push((name, v));
        };
        let mut lay = None;
        time("check_inputs (layout)", &mut || {
            lay = Some(
                crate::ll::check_inputs(0, &cfg, &active, l, me.x.len(), &me.topk_idx, &me.weights)
                    .unwrap(),
            );
        });
        let lay = lay.unwrap();
        let lays: Vec<Layout> = inputs
            .iter()
            .enumerate()
            .map(|(p, i)| Layout::new(p, &i.topk_idx, topk, cfg.num_experts, &active, l).unwrap())
            .collect();
        let mut raw = Vec::new();
        time("notify_row", &mut || {
            raw = lays
                .iter()
                .flat_map(|ly| row_bytes(&plan::notify_row(&s, ly, &active)))
                .collect();
        });
        let mut plan_ = None;
        time("notify_rows + Plan::new + tables", &mut || {
            let Rows::Taken(rows) = notify_rows(&s, 0, &active, &raw).unwrap() else {
                panic!("good rows read as refused")
            };
            let p = Plan::new(&s, active.clone(), &rows);
            std::hint::black_box(p.tables());
            plan_ = Some(p);
        });
        // What the host stages for ep_ht_stage_meta (into pinned memory
        // there, a plain buffer here): the slots, host inputs' routing.
        let parts = pinned_parts(&s, &lay, &me.topk_idx, &me.weights);
        let mut pinned = vec![0u8; Pinned::of(&s).bytes];
        time("staging slots and host routing (pinned)", &mut || {
            for (off, b) in &parts {
                pinned[*off..*off + b.len()].copy_from_slice(b);
            }
        });
        let meta = meta_bytes(&s, &lay, &me.topk_idx, &me.weights);
        let mut xin = vec![0u8; tokens * s.p];
        time(
            "before: stage_tokens' payload copy or quantisation",
            &mut || {
                for t in 0..tokens {
                    let row = &me.x[t * hidden..(t + 1) * hidden];
                    let out = &mut xin[t * s.p..(t + 1) * s.p];
                    if fp8 {
                        quantize_fp8(row, out);
                    } else {
                        out.copy_from_slice(bf16_bytes(row));
                    }
                }
            },
        );
        let plan_ = plan_.unwrap();
        let total = plan_.recv_prefix(0)[r] as usize;
        let rawm: Vec<u8> = (0..total)
            .flat_map(|j| meta[(j % tokens) * s.mm..(j % tokens + 1) * s.mm].to_vec())
            .collect();
        time("read_meta of the received", &mut || {
            let mut counts = vec![0u32; cfg.local_experts(r)];
            for j in 0..total {
                std::hint::black_box(crate::ht::read_meta(
                    &s,
                    0..cfg.local_experts(r),
                    &rawm[j * s.mm..(j + 1) * s.mm],
                    &mut counts,
                ));
            }
        });
        println!(
            "fp8 {fp8} channels {chans}: {} payload bytes, {} metadata bytes, {total} received",
            xin.len(),
            meta.len()
        );
        for (name, v) in &times {
            println!(
                "  {name:40} median {:9.0} us  min {:9.0} us",
                v[v.len() / 2],
                v[0]
            );
        }
    }
}

/// The combine's row sums (`sum_ops` in ht.cu) take whole 16-byte pieces
/// of a row (8 columns) and have no element-by-element path: every hidden
/// size a high-throughput buffer takes is a multiple of 8, and any other
/// (260, for one) is refused at `Config::validate`, before a kernel could
/// see it.
#[test]
fn every_hidden_the_combine_sees_is_whole_16_byte_pieces() {
    for hidden in [4, 12, 260, 7172] {
        let cfg = Config::high_throughput(hidden, 16, 8, 2);
        match cfg.validate(0, 2) {
            Err(EpError::Config {
                field: "hidden", ..
            }) => {}
            other => panic!("hidden {hidden}: {other:?}"),
        }
    }
    for hidden in [8, 264, 7168] {
        Config::high_throughput(hidden, 16, 8, 2)
            .validate(0, 2)
            .unwrap();
    }
    let ht = include_str!("../../../kernels/ht.cu");
    assert!(
        !ht.contains("sum_rows"),
        "an element-by-element sum came back"
    );
}

/// CGET is sized only where a same-host peer's combine rows are fetched by
/// get (every one mapped: none, the window never used), and a CGET of
/// fewer than `l` rows a channel is refused where any is fetched, naming
/// the rank and the rows.
#[test]
fn cget_sized_by_fetches_and_checked() {
    let cfg = Config {
        channels: 16,
        ..Config::high_throughput(7168, 4096, 16, 8)
    };
    // Two hosts of 2: rank 2 reads rank 3 in place, rank 0 and 1 not.
    let direct = [false, false, true, true];
    assert!(!fetches_rows(2, 2, &direct));
    assert!(fetches_rows(3, 2, &[false, false, true, false]));
    assert!(fetches_rows(0, 2, &direct));
    assert_eq!(cget_bytes(&cfg, 2, false), 0);
    assert_eq!(cget_bytes(&cfg, 2, true), 16 * 64 * 2 * 7168);
    assert_eq!(cget_bytes(&cfg, 80, true), 16 * 80 * 2 * 7168);
    // Every peer mapped: no rows needed.
    assert!(check_cget(&cfg, 2, 2, 0, &direct).is_ok());
    // Fetched: l rows a channel suffice, l - 1 do not.
    let row = 2 * 7168;
    assert!(check_cget(&cfg, 0, 2, 16 * 2 * row, &direct).is_ok());
    assert!(check_cget(&cfg, 0, 2, cget_bytes(&cfg, 2, true), &direct).is_ok());
    let e = check_cget(&cfg, 0, 2, 16 * row, &direct).unwrap_err();
    assert!(
        matches!(
            e,
            EpError::Config {
                rank: 0,
                field: "CGET rows per channel",
                value: 1,
                ..
            }
        ),
        "{e}"
    );
    let e = check_cget(&cfg, 1, 2, 16 * 2 * row - 1, &direct).unwrap_err();
    assert!(
        matches!(
            e,
            EpError::Config {
                rank: 1,
                value: 1,
                ..
            }
        ),
        "{e}"
    );
}

/// NSEND and NRECV as `ht::resources` sizes them pass the check at the
/// buffer's creation; a byte short of one row (NSEND) or of both halves'
/// rows (NRECV, where the notify kernel would copy an earlier round's rows
/// for the host) is refused naming the window, the rank and its size.
#[test]
fn notify_windows_hold_their_rows() {
    let cfg = Config::high_throughput(128, 8, 8, 2);
    let s = Shape::of(&cfg, 4, 2);
    let ids: Vec<Vec<u8>> = ["a", "a", "b", "b"]
        .iter()
        .map(|h| h.as_bytes().to_vec())
        .collect();
    let (_, _, sizes) = crate::ht::resources(&cfg, 3, &crate::Hosts::from_ids(&ids)).unwrap();
    let (nsend, nrecv) = (sizes[NSEND], sizes[NRECV]);
    assert!(check_notify_windows(&s, 3, nsend, nrecv).is_ok());
    let width = 4 * s.row_words();
    assert_eq!((nsend, nrecv), (width, 2 * s.r * width));
    let e = check_notify_windows(&s, 3, width - 1, nrecv).unwrap_err();
    assert!(
        matches!(e, EpError::Config { rank: 3, field: "NSEND bytes", value, .. } if value == width - 1),
        "{e}"
    );
    // One half only: the host would read the other round's rows.
    let e = check_notify_windows(&s, 3, nsend, s.r * width).unwrap_err();
    assert!(
        matches!(e, EpError::Config { rank: 3, field: "NRECV bytes", value, .. } if value == s.r * width),
        "{e}"
    );
    let e = check_notify_windows(&s, 2, nsend, nrecv - 1).unwrap_err();
    assert!(
        matches!(
            e,
            EpError::Config {
                rank: 2,
                field: "NRECV bytes",
                ..
            }
        ),
        "{e}"
    );
}
