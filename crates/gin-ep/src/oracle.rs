//! The correctness oracle: inputs whose values can be traced, and the
//! checks DeepEP's own tests make, shared by the tests and `gin-bench moe`.
//!
//! - Every element of a token from rank `r` is `r + 1`, except the last 128
//!   columns: the first 64 of them hold the token index modulo 256, the next
//!   64 the index divided by 256 (each exact in BF16).
//! - Routing is the top-k of `|randn| + 1` with a fixed seed per rank; the
//!   last expert is never chosen (an expert that gets nothing), some slots
//!   are set to -1, and token 1 goes only to its own rank's experts (routed
//!   to no remote rank). Weights are `|randn|`.
//! - Ranks get unequal token counts ([`tokens_for_rank`]).

use crate::num::{Bf16, dequantize_fp8};

/// SplitMix64: small, fast and the same everywhere.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.uniform() * n as f64) as usize
    }

    /// A standard normal sample (Box–Muller).
    pub fn randn(&mut self) -> f64 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

/// One rank's inputs.
#[derive(Debug, Clone, PartialEq)]
pub struct RankInput {
    /// Tokens.
    pub tokens: usize,
    /// `tokens × hidden`.
    pub x: Vec<Bf16>,
    /// `tokens × topk`, -1 for empty slots.
    pub topk_idx: Vec<i64>,
    /// `tokens × topk`.
    pub weights: Vec<f32>,
}

/// The token count of `rank`: unequal across ranks, at least 1, at most
/// `max`.
pub fn tokens_for_rank(max: usize, rank: usize) -> usize {
    (max - (rank % 3) * max / 4).max(1)
}

/// The traceable value of column `col` of token `t` of `rank`.
pub fn value(rank: usize, t: usize, col: usize, hidden: usize) -> f32 {
    let tail = hidden.saturating_sub(128);
    if col < tail {
        (rank + 1) as f32
    } else if col < tail + 64 {
        (t % 256) as f32
    } else {
        (t / 256) as f32
    }
}

/// Builds `rank`'s inputs for a job of `nranks` ranks (seed `seed`).
pub fn rank_input(
    seed: u64,
    rank: usize,
    nranks: usize,
    tokens: usize,
    hidden: usize,
    experts: usize,
    topk: usize,
) -> RankInput {
    let mut rng = Rng::new(seed ^ (rank as u64).wrapping_mul(0x1000_0001));
    let x: Vec<Bf16> = (0..tokens * hidden)
        .map(|i| Bf16::from_f32(value(rank, i / hidden, i % hidden, hidden)))
        .collect();
    let mut topk_idx = Vec::with_capacity(tokens * topk);
    let mut scores: Vec<(f64, usize)> = Vec::with_capacity(experts);
    for _ in 0..tokens {
        scores.clear();
        for e in 0..experts {
            let s = rng.randn().abs() + 1.0;
            // The last expert never wins: an expert that gets nothing.
            scores.push((if e + 1 == experts { 0.0 } else { s }, e));
        }
        scores.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        topk_idx.extend(scores[..topk].iter().map(|&(_, e)| e as i64));
    }
    // Some empty slots.
    for _ in 0..tokens.div_ceil(4) {
        let (t, k) = (rng.below(tokens), rng.below(topk));
        topk_idx[t * topk + k] = -1;
    }
    // Token 1 goes to this rank's own experts only.
    let local = experts / nranks;
    if tokens > 1 {
        for k in 0..topk {
            topk_idx[topk + k] = if k < local && rank * local + k + 1 < experts {
                (rank * local + k) as i64
            } else {
                -1
            };
        }
    }
    let weights = (0..tokens * topk)
        .map(|_| rng.randn().abs() as f32)
        .collect();
    RankInput {
        tokens,
        x,
        topk_idx,
        weights,
    }
}

/// DeepEP's `calc_diff`: `1 - 2Σxy / Σ(x² + y²)` on `x + 1`, `y + 1` in f64.
pub fn calc_diff(x: &[f64], y: &[f64]) -> f64 {
    let (mut xy, mut sq) = (0.0, 0.0);
    for (a, b) in x.iter().zip(y) {
        let (a, b) = (a + 1.0, b + 1.0);
        xy += a * b;
        sq += a * a + b * b;
    }
    if sq == 0.0 { 0.0 } else { 1.0 - 2.0 * xy / sq }
}

/// The tolerance DeepEP allows: 1e-5 for BF16, 7e-4 when tokens travelled
/// as FP8.
pub fn tolerance(fp8: bool) -> f64 {
    if fp8 { 7e-4 } else { 1e-5 }
}

/// The expected combine of `input`: each token times the sum of the weights
/// of its slots whose expert is live (`live(e)`).
pub fn expected_combine(
    input: &RankInput,
    hidden: usize,
    topk: usize,
    live: impl Fn(usize) -> bool,
) -> Vec<f64> {
    let mut out = Vec::with_capacity(input.tokens * hidden);
    for t in 0..input.tokens {
        let s: f64 = (0..topk)
            .filter(|&k| {
                let e = input.topk_idx[t * topk + k];
                e >= 0 && live(e as usize)
            })
            .map(|k| f64::from(input.weights[t * topk + k]))
            .sum();
        out.extend(
            input.x[t * hidden..(t + 1) * hidden]
                .iter()
                .map(|v| f64::from(v.to_f32()) * s),
        );
    }
    out
}

/// Checks a received token's payload against the token `t` of `src`:
/// exact for BF16, within E4M3 precision for FP8.
pub fn check_payload(
    payload: &[u8],
    src: usize,
    t: usize,
    hidden: usize,
    fp8: bool,
) -> Result<(), String> {
    let mut got = vec![Bf16::ZERO; hidden];
    if fp8 {
        dequantize_fp8(payload, hidden, &mut got);
    } else {
        for (o, c) in got.iter_mut().zip(payload.chunks_exact(2)) {
            *o = Bf16(u16::from_le_bytes([c[0], c[1]]));
        }
    }
    for (col, g) in got.iter().enumerate() {
        let want = Bf16::from_f32(value(src, t, col, hidden)).to_f32();
        let g = g.to_f32();
        let ok = if fp8 {
            (g - want).abs() <= want.abs() / 14.0 + 1e-3
        } else {
            g.to_bits() == want.to_bits()
        };
        if !ok {
            return Err(format!(
                "token {t} of rank {src}: column {col} is {g}, expected {want}"
            ));
        }
    }
    Ok(())
}

/// Counts, per expert, the slots of every rank's table (the all-gathered
/// routing table) whose source and expert owner are live.
pub fn count_experts(
    tables: &[Vec<i64>],
    experts: usize,
    live_rank: impl Fn(usize) -> bool,
) -> Vec<usize> {
    let per_rank = experts / tables.len().max(1);
    let mut counts = vec![0; experts];
    for (src, t) in tables.iter().enumerate() {
        if !live_rank(src) {
            continue;
        }
        for &e in t {
            if e >= 0 && live_rank(e as usize / per_rank) {
                counts[e as usize] += 1;
            }
        }
    }
    counts
}

/// What a low-latency dispatch delivered at one rank, as the checks read
/// it: CPU ranks' [`crate::LlDispatch`] in its buffer, or what CUDA ranks
/// copied back ([`crate::cuda::LlReceived`]).
pub trait LlView {
    /// Tokens received from `src` for local expert `le`.
    fn count(&self, le: usize, src: usize) -> usize;
    /// The index, at its source, of the `i`th token from `src` for `le`.
    fn src_token(&self, le: usize, src: usize, i: usize) -> usize;
    /// The top-k weight the source gave this expert for that token.
    fn weight(&self, le: usize, src: usize, i: usize) -> f32;
    /// That token's payload.
    fn payload(&self, le: usize, src: usize, i: usize) -> Result<&[u8], String>;
}

/// A CPU rank's dispatch in its buffer, as an [`LlView`].
struct CpuLl<'a, 'c> {
    buf: &'a crate::Buffer<'c>,
    d: &'a crate::LlDispatch,
}

impl LlView for CpuLl<'_, '_> {
    fn count(&self, le: usize, src: usize) -> usize {
        self.d.count(le, src)
    }
    fn src_token(&self, le: usize, src: usize, i: usize) -> usize {
        self.d.src_token(le, src, i)
    }
    fn weight(&self, le: usize, src: usize, i: usize) -> f32 {
        self.d.weight(le, src, i)
    }
    fn payload(&self, le: usize, src: usize, i: usize) -> Result<&[u8], String> {
        self.buf
            .ll_token(self.d, le, src, i)
            .map_err(|e| e.to_string())
    }
}

/// Checks a low-latency dispatch at this rank against every rank's inputs
/// (`inputs[src]`) and the all-gathered routing table (`tables[src]`):
/// exactly the tokens routed here, in one contiguous, ordered block per
/// source, with the right payloads and weights, and per-expert counts equal
/// to counting the table.
pub fn check_ll_dispatch(
    buf: &crate::Buffer<'_>,
    d: &crate::LlDispatch,
    inputs: &[RankInput],
    tables: &[Vec<i64>],
) -> Result<(), String> {
    let view = CpuLl { buf, d };
    check_ll_view(
        buf.rank(),
        buf.config(),
        buf.active(),
        &view,
        inputs,
        tables,
    )
}

/// [`check_ll_dispatch`] on any [`LlView`] of rank `rank` of a job of
/// `active.len()` ranks (`active`: the mask the step ran with).
pub fn check_ll_view(
    rank: usize,
    cfg: &crate::Config,
    active: &[bool],
    d: &impl LlView,
    inputs: &[RankInput],
    tables: &[Vec<i64>],
) -> Result<(), String> {
    let n = active.len();
    let l = cfg.local_experts(n);
    let counts = count_experts(tables, cfg.num_experts, |r| active[r]);
    for le in 0..l {
        let e = rank * l + le;
        let got: usize = (0..n).map(|s| d.count(le, s)).sum();
        if got != counts[e] {
            return Err(format!(
                "rank {rank}: expert {e} received {got} tokens, the all-gathered table routes {}",
                counts[e]
            ));
        }
        for (src, input) in inputs.iter().enumerate() {
            let want: Vec<(usize, usize)> = if active[src] {
                (0..input.tokens)
                    .filter_map(|t| {
                        (0..cfg.topk)
                            .find(|&k| input.topk_idx[t * cfg.topk + k] == e as i64)
                            .map(|k| (t, k))
                    })
                    .collect()
            } else {
                Vec::new()
            };
            if d.count(le, src) != want.len() {
                return Err(format!(
                    "rank {rank}: expert {e} got {} tokens from rank {src}, expected {}",
                    d.count(le, src),
                    want.len()
                ));
            }
            for (i, &(t, k)) in want.iter().enumerate() {
                if d.src_token(le, src, i) != t {
                    return Err(format!(
                        "rank {rank}: expert {e}, block of rank {src}, place {i}: token {}, expected {t} (blocks are in source order)",
                        d.src_token(le, src, i)
                    ));
                }
                let w = input.weights[t * cfg.topk + k];
                if d.weight(le, src, i).to_bits() != w.to_bits() {
                    return Err(format!(
                        "rank {rank}: expert {e}, token {t} of rank {src}: weight {}, expected {w}",
                        d.weight(le, src, i)
                    ));
                }
                let p = d.payload(le, src, i)?;
                check_payload(p, src, t, cfg.hidden, cfg.fp8)
                    .map_err(|m| format!("rank {rank}: expert {e}: {m}"))?;
            }
        }
    }
    Ok(())
}

/// A digest of everything a low-latency dispatch delivered here (counts,
/// token indices, weights, payload bytes): equal digests across repeats
/// mean bit-identical outputs.
pub fn ll_digest(buf: &crate::Buffer<'_>, d: &crate::LlDispatch) -> u64 {
    ll_view_digest(buf.config(), buf.nranks(), &CpuLl { buf, d })
}

/// [`ll_digest`] on any [`LlView`] of a job of `nranks` ranks.
pub fn ll_view_digest(cfg: &crate::Config, nranks: usize, d: &impl LlView) -> u64 {
    let mut words = Vec::new();
    for le in 0..cfg.local_experts(nranks) {
        for src in 0..nranks {
            words.push(d.count(le, src) as i64);
            for i in 0..d.count(le, src) {
                words.push(d.src_token(le, src, i) as i64);
                words.push(i64::from(d.weight(le, src, i).to_bits()));
                if let Ok(p) = d.payload(le, src, i) {
                    words.extend(p.chunks(8).map(|c| {
                        let mut b = [0u8; 8];
                        b[..c.len()].copy_from_slice(c);
                        i64::from_le_bytes(b)
                    }));
                }
            }
        }
    }
    crate::fingerprint(&words)
}

/// The digest of combined tokens.
pub fn bf16_digest(x: &[Bf16]) -> u64 {
    crate::fingerprint(&x.iter().map(|v| i64::from(v.0)).collect::<Vec<_>>())
}

/// Checks a combine against `x · Σ(weights of live slots)` with DeepEP's
/// `calc_diff`; returns the difference.
pub fn check_combine(
    rank: usize,
    got: &[Bf16],
    input: &RankInput,
    hidden: usize,
    topk: usize,
    fp8: bool,
    live: impl Fn(usize) -> bool,
) -> Result<f64, String> {
    let want = expected_combine(input, hidden, topk, live);
    if got.len() != want.len() {
        return Err(format!(
            "rank {rank}: combine returned {} elements, expected {}",
            got.len(),
            want.len()
        ));
    }
    let g: Vec<f64> = got.iter().map(|v| f64::from(v.to_f32())).collect();
    let diff = calc_diff(&g, &want);
    if diff.is_nan() || diff >= tolerance(fp8) {
        return Err(format!(
            "rank {rank}: combine differs from x·Σweights: calc_diff {diff:e} (limit {:e})",
            tolerance(fp8)
        ));
    }
    Ok(diff)
}

/// What the high-throughput oracle reads of a dispatch: CPU ranks'
/// [`crate::HtDispatch`] with its buffer, or CUDA ranks' dispatch with its
/// payloads copied back ([`crate::cuda::HtReceived`]).
pub trait HtView {
    /// Tokens received from `src`.
    fn count(&self, src: usize) -> usize;
    /// Where `src`'s block starts among the received tokens.
    fn block_start(&self, src: usize) -> usize;
    /// Tokens received in all.
    fn received(&self) -> usize;
    /// The index at its source of received token `j`.
    fn src_token(&self, j: usize) -> usize;
    /// The sum of received token `j`'s weights for this rank's experts.
    fn local_weight(&self, j: usize) -> f32;
    /// Received tokens naming local expert `le`.
    fn expert_count(&self, le: usize) -> usize;
    /// The payload of received token `j`.
    fn payload(&self, j: usize) -> Result<&[u8], String>;
}

/// A CPU rank's high-throughput dispatch, with its buffer (where the
/// payloads are).
struct CpuHt<'b, 'c> {
    buf: &'b crate::Buffer<'c>,
    d: &'b crate::HtDispatch,
}

impl HtView for CpuHt<'_, '_> {
    fn count(&self, src: usize) -> usize {
        self.d.count(src)
    }
    fn block_start(&self, src: usize) -> usize {
        self.d.block_start(src)
    }
    fn received(&self) -> usize {
        self.d.received()
    }
    fn src_token(&self, j: usize) -> usize {
        self.d.src_token(j)
    }
    fn local_weight(&self, j: usize) -> f32 {
        self.d.local_weight(j)
    }
    fn expert_count(&self, le: usize) -> usize {
        self.d.expert_count(le)
    }
    fn payload(&self, j: usize) -> Result<&[u8], String> {
        self.buf.ht_token(self.d, j).map_err(|e| e.to_string())
    }
}

/// Checks a high-throughput dispatch at this rank: every active source's
/// block holds exactly its tokens that name one of this rank's experts, in
/// token order, with the right payloads and summed local weights, masked
/// sources' blocks are empty, and per-expert counts equal counting the
/// all-gathered routing table (DeepEP's checks).
pub fn check_ht_dispatch(
    buf: &crate::Buffer<'_>,
    d: &crate::HtDispatch,
    inputs: &[RankInput],
    tables: &[Vec<i64>],
) -> Result<(), String> {
    check_ht_view(
        buf.rank(),
        buf.config(),
        buf.active(),
        &CpuHt { buf, d },
        inputs,
        tables,
    )
}

/// What a high-throughput dispatch delivers to `rank` from each source, by
/// the all-gathered routing `tables` (`tables[src]`: its `tokens × topk`
/// expert ids) under the active mask `active`: the source's tokens that
/// name one of `rank`'s experts (none from a masked source).
pub fn ht_counts(
    rank: usize,
    cfg: &crate::Config,
    active: &[bool],
    tables: &[Vec<i64>],
) -> Vec<usize> {
    let l = cfg.local_experts(active.len());
    let k = cfg.topk;
    tables
        .iter()
        .enumerate()
        .map(|(src, table)| {
            if !active[src] {
                return 0;
            }
            table
                .chunks_exact(k)
                .filter(|row| row.iter().any(|&e| e >= 0 && e as usize / l == rank))
                .count()
        })
        .collect()
}

/// [`check_ht_dispatch`] for any [`HtView`] (CUDA ranks too): `rank`'s
/// dispatch under `cfg` with the active mask `active`.
pub fn check_ht_view(
    rank: usize,
    cfg: &crate::Config,
    active: &[bool],
    d: &impl HtView,
    inputs: &[RankInput],
    tables: &[Vec<i64>],
) -> Result<(), String> {
    let n = active.len();
    let l = cfg.local_experts(n);
    let mine = |e: i64| e >= 0 && e as usize / l == rank;
    let counts = count_experts(tables, cfg.num_experts, |r| active[r]);
    for le in 0..l {
        if d.expert_count(le) != counts[rank * l + le] {
            return Err(format!(
                "rank {rank}: expert {} received {} tokens, the all-gathered table routes {}",
                rank * l + le,
                d.expert_count(le),
                counts[rank * l + le]
            ));
        }
    }
    for (src, input) in inputs.iter().enumerate() {
        let k = cfg.topk;
        let want: Vec<usize> = (0..input.tokens)
            .filter(|&t| active[src] && input.topk_idx[t * k..(t + 1) * k].iter().any(|&e| mine(e)))
            .collect();
        if d.count(src) != want.len() {
            return Err(format!(
                "rank {rank}: {} tokens from rank {src}, expected {}",
                d.count(src),
                want.len()
            ));
        }
        for (i, &t) in want.iter().enumerate() {
            let j = d.block_start(src) + i;
            if d.src_token(j) != t {
                return Err(format!(
                    "rank {rank}: block of rank {src}, place {i}: token {}, expected {t} (blocks are in source order)",
                    d.src_token(j)
                ));
            }
            let w: f32 = (0..k)
                .filter(|&j| mine(input.topk_idx[t * k + j]))
                .map(|j| input.weights[t * k + j])
                .sum();
            if d.local_weight(j).to_bits() != w.to_bits() {
                return Err(format!(
                    "rank {rank}: token {t} of rank {src}: local weight {}, expected {w}",
                    d.local_weight(j)
                ));
            }
            let p = d.payload(j)?;
            check_payload(p, src, t, cfg.hidden, cfg.fp8)
                .map_err(|m| format!("rank {rank}: {m}"))?;
        }
    }
    Ok(())
}

/// A digest of everything a high-throughput dispatch received (for the
/// repeats' bit-identity).
pub fn ht_digest(buf: &crate::Buffer<'_>, d: &crate::HtDispatch) -> u64 {
    ht_view_digest(&CpuHt { buf, d })
}

/// [`ht_digest`] for any [`HtView`]: CPU and CUDA ranks' digests of the
/// same dispatch are equal.
pub fn ht_view_digest(d: &impl HtView) -> u64 {
    let mut words = Vec::new();
    for j in 0..d.received() {
        words.push(d.src_token(j) as i64);
        words.push(i64::from(d.local_weight(j).to_bits()));
        if let Ok(p) = d.payload(j) {
            words.extend(p.chunks(8).map(|c| {
                let mut b = [0u8; 8];
                b[..c.len()].copy_from_slice(c);
                i64::from_le_bytes(b)
            }));
        }
    }
    crate::fingerprint(&words)
}

#[cfg(test)]
#[allow(clippy::float_cmp)] // traceable values are exact
mod tests {
    use super::*;

    #[test]
    fn inputs_are_deterministic_and_traceable() {
        let a = rank_input(7, 2, 4, 20, 256, 16, 4);
        assert_eq!(a, rank_input(7, 2, 4, 20, 256, 16, 4));
        assert_ne!(a.topk_idx, rank_input(7, 1, 4, 20, 256, 16, 4).topk_idx);
        assert_eq!(a.x[0].to_f32(), 3.0);
        assert_eq!(a.x[19 * 256 + 128].to_f32(), 19.0);
        // The last expert gets nothing; some slots are empty; token 1 stays home.
        assert!(!a.topk_idx.contains(&15));
        assert!(a.topk_idx.contains(&-1));
        assert!(a.topk_idx[4..8].iter().all(|&e| e == -1 || e / 4 == 2));
        assert!(tokens_for_rank(128, 1) < tokens_for_rank(128, 0));
    }

    /// A source's count is its tokens naming any of the rank's experts,
    /// each once however many of them it names; a masked source sends
    /// none.
    #[test]
    fn ht_counts_count_tokens_per_source_from_the_tables() {
        // 3 ranks of 2 experts, top-2.
        let cfg = crate::Config::high_throughput(128, 8, 6, 2);
        let tables = vec![
            vec![2, 3, 0, -1, 3, 5], // rank 1 twice in one token, then once
            vec![-1, -1, 1, 2],
            vec![4, 5, 2, 0, 3, -1],
        ];
        assert_eq!(ht_counts(1, &cfg, &[true; 3], &tables), vec![2, 1, 2]);
        assert_eq!(ht_counts(0, &cfg, &[true; 3], &tables), vec![1, 1, 1]);
        assert_eq!(
            ht_counts(1, &cfg, &[true, true, false], &tables),
            vec![2, 1, 0]
        );
    }

    #[test]
    fn calc_diff_is_zero_on_equal_and_grows_with_error() {
        let x = [1.0, 2.0, 3.0];
        assert_eq!(calc_diff(&x, &x), 0.0);
        assert!(calc_diff(&x, &[1.0, 2.0, 3.1]) > 1e-5);
        assert!(calc_diff(&x, &[1.0, 2.0, 3.000_01]) < 1e-5);
    }
}
