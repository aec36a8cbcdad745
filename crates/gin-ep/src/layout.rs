//! The layout of one step, computed from `topk_idx` alone: which ranks,
//! experts and hosts each token goes to, how many go to each, and the
//! prefix sums that place every token in its receiver's contiguous,
//! ordered per-source block. Pure code: values in, values out.

use crate::error::EpError;

/// Marks "no slot" in [`Layout::expert_slot`] and [`Layout::rank_slot`].
pub const NONE: u32 = u32::MAX;

/// Where one rank's tokens go in one step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// Tokens of this rank.
    pub tokens: usize,
    /// Ranks of the job.
    pub nranks: usize,
    /// Experts of the job.
    pub experts: usize,
    /// Top-k slots per token.
    pub topk: usize,
    /// Ranks per host (for the per-host counts).
    pub ranks_per_host: usize,
    /// Tokens going to each rank (a token counts once per rank however many
    /// of the rank's experts it names).
    pub tokens_per_rank: Vec<u32>,
    /// Tokens going to each expert.
    pub tokens_per_expert: Vec<u32>,
    /// Tokens going to each host (once per host).
    pub tokens_per_host: Vec<u32>,
    /// `[token * nranks + rank]`: does the token go to the rank?
    pub is_token_in_rank: Vec<bool>,
    /// `[token * nranks + rank]`: the token's index among this rank's tokens
    /// going to `rank` ([`NONE`] if it does not go there): its slot in the
    /// receiver's block for this source.
    pub rank_slot: Vec<u32>,
    /// `[token * topk + k]`: the token's index among this rank's tokens going
    /// to the slot's expert ([`NONE`] for an empty or masked slot).
    pub expert_slot: Vec<u32>,
    /// `[token * nhosts + host]`: does the token go to the host?
    pub is_token_in_host: Vec<bool>,
    /// `[token * nhosts + host]`: the token's index among this rank's tokens
    /// going to `host` ([`NONE`] if it does not go there).
    pub host_slot: Vec<u32>,
    /// Top-k slots emptied because their expert's rank is masked.
    pub masked_slots: usize,
}

impl Layout {
    /// Computes the layout of `topk_idx` (`tokens * topk` entries, -1 for an
    /// empty slot). Slots whose expert lives on a rank that is not `active`
    /// count as empty. Every entry is checked first: an expert outside
    /// `0..experts` or named twice by one token is an error naming the
    /// token and slot.
    pub fn new(
        rank: usize,
        topk_idx: &[i64],
        topk: usize,
        experts: usize,
        active: &[bool],
        ranks_per_host: usize,
    ) -> Result<Self, EpError> {
        let nranks = active.len();
        check_topk(rank, topk_idx, topk, experts)?;
        let tokens = topk_idx.len() / topk;
        let per_rank = experts / nranks;
        let nhosts = nranks / ranks_per_host;
        let mut l = Self {
            tokens,
            nranks,
            experts,
            topk,
            ranks_per_host,
            tokens_per_rank: vec![0; nranks],
            tokens_per_expert: vec![0; experts],
            tokens_per_host: vec![0; nhosts],
            is_token_in_rank: vec![false; tokens * nranks],
            rank_slot: vec![NONE; tokens * nranks],
            expert_slot: vec![NONE; tokens * topk],
            is_token_in_host: vec![false; tokens * nhosts],
            host_slot: vec![NONE; tokens * nhosts],
            masked_slots: 0,
        };
        for t in 0..tokens {
            for k in 0..topk {
                let e = topk_idx[t * topk + k];
                if e < 0 {
                    continue;
                }
                let e = e as usize;
                let r = e / per_rank;
                if !active[r] {
                    l.masked_slots += 1;
                    continue;
                }
                l.expert_slot[t * topk + k] = l.tokens_per_expert[e];
                l.tokens_per_expert[e] += 1;
                if !l.is_token_in_rank[t * nranks + r] {
                    l.is_token_in_rank[t * nranks + r] = true;
                    l.rank_slot[t * nranks + r] = l.tokens_per_rank[r];
                    l.tokens_per_rank[r] += 1;
                }
                let h = r / ranks_per_host;
                if !l.is_token_in_host[t * nhosts + h] {
                    l.is_token_in_host[t * nhosts + h] = true;
                    l.host_slot[t * nhosts + h] = l.tokens_per_host[h];
                    l.tokens_per_host[h] += 1;
                }
            }
        }
        Ok(l)
    }

    /// Hosts of the job.
    pub fn nhosts(&self) -> usize {
        self.tokens_per_host.len()
    }

    /// Exclusive prefix sums of [`Layout::tokens_per_rank`] (`nranks + 1`
    /// entries): where each destination's tokens start in a rank-major
    /// packing of this rank's sends.
    pub fn rank_prefix(&self) -> Vec<u32> {
        prefix(&self.tokens_per_rank)
    }

    /// Exclusive prefix sums of [`Layout::tokens_per_expert`].
    pub fn expert_prefix(&self) -> Vec<u32> {
        prefix(&self.tokens_per_expert)
    }
}

/// Exclusive prefix sums, with the total last.
pub fn prefix(counts: &[u32]) -> Vec<u32> {
    let mut out = Vec::with_capacity(counts.len() + 1);
    let mut s = 0u32;
    out.push(0);
    for &c in counts {
        s += c;
        out.push(s);
    }
    out
}

/// Checks every top-k entry: in `0..experts` or -1, no expert twice in a
/// token. `topk_idx.len()` must be a multiple of `topk` (the caller checked
/// it against the token count).
pub fn check_topk(
    rank: usize,
    topk_idx: &[i64],
    topk: usize,
    experts: usize,
) -> Result<(), EpError> {
    for (t, row) in topk_idx.chunks(topk).enumerate() {
        for (k, &e) in row.iter().enumerate() {
            if e == -1 {
                continue;
            }
            if e < 0 || e as u64 >= experts as u64 {
                return Err(EpError::ExpertOutOfRange {
                    rank,
                    token: t,
                    slot: k,
                    expert: e,
                    experts,
                });
            }
            if let Some(first) = row[..k].iter().position(|&o| o == e) {
                return Err(EpError::DuplicateExpert {
                    rank,
                    token: t,
                    expert: e,
                    first,
                    second: k,
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_small_table_lays_out_as_by_hand() {
        // 4 ranks, 8 experts (2 per rank), 2 hosts of 2, top-2.
        let idx = [0, 1, 5, -1, -1, -1, 7, 2];
        let l = Layout::new(0, &idx, 2, 8, &[true; 4], 2).unwrap();
        assert_eq!(l.tokens, 4);
        assert_eq!(l.tokens_per_expert, [1, 1, 1, 0, 0, 1, 0, 1]);
        // Token 0 names two experts of rank 0: it counts once there.
        assert_eq!(l.tokens_per_rank, [1, 1, 1, 1]);
        assert_eq!(l.tokens_per_host, [2, 2]);
        assert_eq!(l.rank_prefix(), [0, 1, 2, 3, 4]);
        assert_eq!(&l.is_token_in_rank[..4], &[true, false, false, false]);
        assert_eq!(&l.rank_slot[12..16], &[NONE, 0, NONE, 0]);
        assert_eq!(l.expert_slot[0..2], [0, 0]);
        assert_eq!(l.expert_slot[4..6], [NONE, NONE]);
    }

    #[test]
    fn a_masked_rank_empties_its_slots_and_counts_them() {
        let idx = [0, 2, 3, 1];
        let l = Layout::new(0, &idx, 2, 4, &[true, false], 1).unwrap();
        assert_eq!(l.masked_slots, 2);
        assert_eq!(l.tokens_per_expert, [1, 1, 0, 0]);
        assert_eq!(l.tokens_per_rank, [2, 0]);
    }

    #[test]
    fn bad_entries_are_errors_naming_token_and_slot() {
        let e = Layout::new(3, &[0, 1, 2, 8], 2, 8, &[true; 2], 1).unwrap_err();
        assert!(
            matches!(
                e,
                EpError::ExpertOutOfRange {
                    rank: 3,
                    token: 1,
                    slot: 1,
                    expert: 8,
                    ..
                }
            ),
            "{e}"
        );
        let e = Layout::new(0, &[0, -2], 2, 8, &[true; 2], 1).unwrap_err();
        assert!(
            matches!(e, EpError::ExpertOutOfRange { expert: -2, .. }),
            "{e}"
        );
        let e = Layout::new(0, &[4, 4], 2, 8, &[true; 2], 1).unwrap_err();
        assert!(
            matches!(
                e,
                EpError::DuplicateExpert {
                    first: 0,
                    second: 1,
                    ..
                }
            ),
            "{e}"
        );
    }

    proptest! {
        /// Against a model: counts are the counts of the table, and every
        /// slot index is the number of earlier tokens with the same target.
        #[test]
        fn layout_matches_counting_the_table(
            raw in proptest::collection::vec(-1i64..12, 0..96),
            mask in proptest::collection::vec(any::<bool>(), 4),
        ) {
            let topk = 3;
            let mut idx: Vec<i64> = raw[..raw.len() / topk * topk].to_vec();
            for row in idx.chunks_mut(topk) {
                for k in 0..topk {
                    if row[..k].contains(&row[k]) { row[k] = -1; }
                }
            }
            let l = Layout::new(0, &idx, topk, 12, &mask, 2).unwrap();
            let owner = |e: i64| e as usize / 3;
            let live = |e: i64| e >= 0 && mask[owner(e)];
            for e in 0..12 {
                let n = idx.iter().filter(|&&x| x == e as i64 && live(x)).count();
                prop_assert_eq!(l.tokens_per_expert[e] as usize, n);
            }
            for r in 0..4 {
                let mut seen = 0;
                for (t, row) in idx.chunks(topk).enumerate() {
                    let goes = row.iter().any(|&e| live(e) && owner(e) == r);
                    prop_assert_eq!(l.is_token_in_rank[t * 4 + r], goes);
                    if goes {
                        prop_assert_eq!(l.rank_slot[t * 4 + r], seen);
                        seen += 1;
                    }
                }
                prop_assert_eq!(l.tokens_per_rank[r], seen);
            }
            let masked = idx.iter().filter(|&&e| e >= 0 && !mask[owner(e)]).count();
            prop_assert_eq!(l.masked_slots, masked);
        }
    }
}
