//! Agreement: every rank contributes named values that all must give
//! alike (requirements, placements), or whether it can go on at all, and
//! every rank learns the same verdict: the first value they differ on and
//! which ranks gave what, or the first rank that cannot go on. So a
//! rank with different values makes every rank fail with the same error,
//! instead of one rank failing alone while the others wait for it in a
//! later collective.

use std::fmt::Write as _;

use crate::comm::Bootstrap;
use crate::error::BootstrapError;

/// A named value every rank must give alike.
pub type Field = (&'static str, u64);

/// The first field the ranks disagree on, and who gave what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Disagreement {
    /// The field's name.
    pub field: &'static str,
    /// Which ranks gave which value: `"rank 0 gave 4; ranks 1-3 gave 64"`.
    pub detail: String,
}

impl Bootstrap {
    /// Collective: every rank sends its `fields` (the same names in the
    /// same order on every rank) and every rank returns the same verdict:
    /// `None` when all gave the same values, else the first field they
    /// differ on. A rank that sends another number of fields is an error
    /// naming it.
    pub fn agree(&self, fields: &[Field]) -> Result<Option<Disagreement>, BootstrapError> {
        let mine: Vec<u8> = fields.iter().flat_map(|(_, v)| v.to_le_bytes()).collect();
        let all = self.allgather_equal(&mine)?;
        let per_rank: Vec<Vec<u64>> = all
            .chunks(mine.len().max(1))
            .map(|c| {
                c.chunks_exact(8)
                    .map(|w| u64::from_le_bytes(std::array::from_fn(|i| w[i])))
                    .collect()
            })
            .collect();
        let names: Vec<&'static str> = fields.iter().map(|(n, _)| *n).collect();
        Ok(first_disagreement(&names, &per_rank))
    }

    /// Collective: every rank says whether it can go on (`ok`); every rank
    /// learns the first rank that cannot (`None`: all can), so that all
    /// stop alike instead of some waiting for the others in a later
    /// collective.
    pub fn first_refusal(&self, ok: bool) -> Result<Option<usize>, BootstrapError> {
        Ok(self
            .allgather(&[u8::from(ok)])?
            .iter()
            .position(|v| v.first() != Some(&1)))
    }
}

/// Compares every rank's fields (`all[rank][field]`) and describes the
/// first field on which they differ: which ranks gave which value.
pub fn first_disagreement(names: &[&'static str], all: &[Vec<u64>]) -> Option<Disagreement> {
    for (f, name) in names.iter().enumerate() {
        let mut groups: Vec<(Option<u64>, Vec<usize>)> = Vec::new();
        for (r, vals) in all.iter().enumerate() {
            let v = vals.get(f).copied();
            match groups.iter_mut().find(|(g, _)| *g == v) {
                Some((_, ranks)) => ranks.push(r),
                None => groups.push((v, vec![r])),
            }
        }
        if groups.len() > 1 {
            let mut detail = String::new();
            for (i, (v, ranks)) in groups.iter().enumerate() {
                let _ = write!(
                    detail,
                    "{}{} {} gave {}",
                    if i == 0 { "" } else { "; " },
                    if ranks.len() == 1 { "rank" } else { "ranks" },
                    rank_list(ranks),
                    v.map_or_else(|| "nothing".to_owned(), |v| v.to_string()),
                );
            }
            return Some(Disagreement {
                field: name,
                detail,
            });
        }
    }
    None
}

/// `0, 2, 3` with runs shortened: `0-3, 7`.
pub fn rank_list(ranks: &[usize]) -> String {
    let mut out = String::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
            j += 1;
        }
        if !out.is_empty() {
            out.push_str(", ");
        }
        let _ = match j - i {
            0 => write!(out, "{}", ranks[i]),
            1 => write!(out, "{}, {}", ranks[i], ranks[j]),
            _ => write!(out, "{}-{}", ranks[i], ranks[j]),
        };
        i = j + 1;
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn rank_lists_shorten_runs() {
        assert_eq!(rank_list(&[0]), "0");
        assert_eq!(rank_list(&[1, 2]), "1, 2");
        assert_eq!(rank_list(&[1, 2, 3, 7, 9, 10]), "1-3, 7, 9, 10");
    }

    #[test]
    fn the_first_differing_field_is_named_with_who_gave_what() {
        let names = ["signals", "counters"];
        let all = vec![vec![4, 16], vec![64, 16], vec![64, 16], vec![64, 8]];
        let p = first_disagreement(&names, &all).unwrap();
        assert_eq!(p.field, "signals");
        assert_eq!(p.detail, "rank 0 gave 4; ranks 1-3 gave 64");
        let same = vec![vec![4, 16], vec![4, 16]];
        assert_eq!(first_disagreement(&names, &same), None);
    }

    #[test]
    fn every_rank_learns_the_first_that_cannot_go_on() {
        let out = crate::run_threads(3, crate::Config::default(), |b| {
            b.first_refusal(b.rank() != 1)
        })
        .unwrap();
        assert!(out.into_iter().all(|r| r.unwrap() == Some(1)));
        let out =
            crate::run_threads(2, crate::Config::default(), |b| b.first_refusal(true)).unwrap();
        assert!(out.into_iter().all(|r| r.unwrap().is_none()));
    }

    #[test]
    fn every_rank_learns_the_same_verdict() {
        let out = crate::run_threads(3, crate::Config::default(), |b| {
            let mine = [("a", 1), ("b", if b.rank() == 2 { 7 } else { 5 })];
            b.agree(&mine)
        })
        .unwrap();
        for verdict in out {
            let d = verdict.unwrap().unwrap();
            assert_eq!(d.field, "b");
            assert_eq!(d.detail, "ranks 0, 1 gave 5; rank 2 gave 7");
        }
    }
}
