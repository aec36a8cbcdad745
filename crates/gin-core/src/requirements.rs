//! Checks every device communicator's requirements before anything is
//! allocated: the ranks agree on every field that shapes the layout, and
//! every field and product of fields stays within a stated limit.
//!
//! Agreement comes first and is collective: every rank contributes its
//! requirements whatever their values, so a rank with absurd or different
//! requirements makes every rank fail with the same error, instead of one
//! rank failing alone while the others wait in a later collective for it.
//! The bounds then depend only on values every rank holds alike, so every
//! rank passes or fails them together.

use std::fmt::Write as _;

use gin_bootstrap::Bootstrap;

use crate::comm::{Connection, DevCommRequirements};
use crate::error::CoreError;

/// The most contexts a device communicator may have.
pub const MAX_CONTEXTS: u32 = 1 << 16;

/// The most bytes a device communicator's queues (one per context and peer,
/// `queue_depth` slots of [`QUEUE_SLOT_BYTES`]) may take on one rank.
pub const MAX_QUEUE_BYTES: u64 = 1 << 30;

/// The size of one queue slot: a proxy descriptor or a GDAKI WQE basic block.
pub const QUEUE_SLOT_BYTES: u64 = 64;

/// A field every rank must give alike, by name, with its value.
type Field = (&'static str, u64);

/// The fields of `req` that shape the layout or the semantics of a device
/// communicator, in a fixed order.
pub(crate) fn fields(req: &DevCommRequirements) -> Vec<Field> {
    vec![
        ("signals", req.signals.into()),
        ("counters", req.counters.into()),
        ("contexts", req.contexts.into()),
        ("world_barriers", req.world_barriers.into()),
        ("rail_barriers", req.rail_barriers.into()),
        ("queue_depth", req.queue_depth.into()),
        (
            "connection",
            match req.connection {
                Connection::Full => 0,
                Connection::Rail => 1,
            },
        ),
        ("exclusive_contexts", req.exclusive_contexts.into()),
        ("strong_signals", req.strong_signals.into()),
        ("va_signals", req.va_signals.into()),
    ]
}

fn encode(fields: &[Field]) -> Vec<u8> {
    fields.iter().flat_map(|(_, v)| v.to_le_bytes()).collect()
}

/// Decodes every rank's record; `None` for a record of the wrong length.
fn decode(all: &[u8], n: usize) -> Option<Vec<u64>> {
    if all.len() != n * 8 {
        return None;
    }
    Some(
        all.chunks_exact(8)
            .map(|c| {
                let mut b = [0; 8];
                b.copy_from_slice(c);
                u64::from_le_bytes(b)
            })
            .collect(),
    )
}

/// Compares every rank's fields (`all[rank][field]`) and describes the
/// first field on which they differ: which ranks gave which value.
pub(crate) fn first_disagreement(names: &[&'static str], all: &[Vec<u64>]) -> Option<Disagreement> {
    for (f, name) in names.iter().enumerate() {
        let mut groups: Vec<(u64, Vec<usize>)> = Vec::new();
        for (r, vals) in all.iter().enumerate() {
            let v = vals[f];
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
                    "{}{} {} gave {v}",
                    if i == 0 { "" } else { "; " },
                    if ranks.len() == 1 { "rank" } else { "ranks" },
                    rank_list(ranks),
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

/// The field the ranks disagree on and who gave what.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Disagreement {
    pub field: &'static str,
    pub detail: String,
}

/// `0, 2, 3` with runs shortened: `0-3, 7`.
fn rank_list(ranks: &[usize]) -> String {
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

/// Collective: every rank sends its fields (`req`'s, then `extra`), and
/// every rank fails alike, naming the field and the ranks, unless all gave
/// the same values.
pub(crate) fn agree(
    bootstrap: &Bootstrap,
    req: &DevCommRequirements,
    extra: &[Field],
) -> Result<(), CoreError> {
    let mut mine = fields(req);
    mine.extend_from_slice(extra);
    let names: Vec<&'static str> = mine.iter().map(|(n, _)| *n).collect();
    let all = bootstrap.allgather_equal(&encode(&mine))?;
    let n = bootstrap.nranks();
    let per_rank: Vec<Vec<u64>> = all
        .chunks(mine.len() * 8)
        .map(|c| decode(c, mine.len()).unwrap_or_default())
        .collect();
    if per_rank.len() != n || per_rank.iter().any(|v| v.len() != mine.len()) {
        return Err(CoreError::MalformedRecord {
            rank: per_rank
                .iter()
                .position(|v| v.len() != mine.len())
                .unwrap_or(bootstrap.rank()),
            what: "device communicator requirements record".into(),
            got: per_rank.iter().map(Vec::len).min().unwrap_or(0) * 8,
            expected: mine.len() * 8,
        });
    }
    match first_disagreement(&names, &per_rank) {
        None => Ok(()),
        Some(p) => Err(CoreError::Mismatch {
            rank: bootstrap.rank(),
            what: format!("DevCommRequirements::{}", p.field),
            detail: p.detail,
        }),
    }
}

/// Bounds the contexts and the queue memory they imply with `nranks` ranks
/// before anything is allocated (signals and counters are bounded by the id
/// spaces, the queue depth by each backend's range).
pub(crate) fn check_bounds(
    rank: usize,
    nranks: usize,
    req: &DevCommRequirements,
) -> Result<(), CoreError> {
    let limit = |what: &str, asked: u64, limit: u64, hint: &str| CoreError::Limit {
        rank,
        what: what.to_owned(),
        asked,
        limit,
        hint: hint.to_owned(),
    };
    if req.contexts == 0 {
        return Err(CoreError::Requirement {
            rank,
            what: "a device communicator needs at least one context \
                   (DevCommRequirements::contexts is 0)"
                .into(),
        });
    }
    if req.contexts > MAX_CONTEXTS {
        return Err(limit(
            "DevCommRequirements::contexts",
            req.contexts.into(),
            MAX_CONTEXTS.into(),
            "contexts are ordering domains; threads may share one",
        ));
    }
    // Each backend checks the depth against its own range
    // (`BackendKind::queue_log2`); here it only sizes the memory bound.
    let depth = u64::from(req.queue_depth).max(2).next_power_of_two();
    let bytes = u64::from(req.contexts)
        .saturating_mul(nranks as u64)
        .saturating_mul(depth)
        .saturating_mul(QUEUE_SLOT_BYTES);
    if bytes > MAX_QUEUE_BYTES {
        return Err(limit(
            "queue memory (contexts x ranks x queue_depth x 64 B)",
            bytes,
            MAX_QUEUE_BYTES,
            &format!(
                "{} contexts x {nranks} ranks x depth {depth}: ask for fewer contexts or a shallower queue",
                req.contexts
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
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
    fn every_field_that_shapes_the_layout_is_compared() {
        let base = DevCommRequirements::default();
        let variants = [
            DevCommRequirements { signals: 4, ..base },
            DevCommRequirements {
                counters: 4,
                ..base
            },
            DevCommRequirements {
                contexts: 2,
                ..base
            },
            DevCommRequirements {
                world_barriers: 2,
                ..base
            },
            DevCommRequirements {
                rail_barriers: 1,
                ..base
            },
            DevCommRequirements {
                queue_depth: 8,
                ..base
            },
            DevCommRequirements {
                connection: Connection::Rail,
                ..base
            },
            DevCommRequirements {
                exclusive_contexts: true,
                ..base
            },
            DevCommRequirements {
                strong_signals: false,
                ..base
            },
            DevCommRequirements {
                va_signals: false,
                ..base
            },
        ];
        let names: Vec<&str> = fields(&base).iter().map(|(n, _)| *n).collect();
        for (i, v) in variants.iter().enumerate() {
            let all = vec![
                fields(&base).iter().map(|f| f.1).collect::<Vec<_>>(),
                fields(v).iter().map(|f| f.1).collect(),
            ];
            let p = first_disagreement(&names, &all).expect("a difference");
            assert_eq!(p.field, names[i]);
        }
    }

    #[test]
    fn absurd_requirements_are_refused_naming_the_limit() {
        let huge = DevCommRequirements {
            contexts: u32::MAX,
            signals: 0,
            counters: 0,
            world_barriers: 0,
            ..DevCommRequirements::default()
        };
        let e = check_bounds(0, 2, &huge).unwrap_err().to_string();
        assert!(e.contains("contexts") && e.contains("65536"), "{e}");
        let wide = DevCommRequirements {
            contexts: MAX_CONTEXTS,
            ..DevCommRequirements::default()
        };
        let e = check_bounds(0, 8, &wide).unwrap_err().to_string();
        assert!(
            e.contains("queue memory") && e.contains(&MAX_QUEUE_BYTES.to_string()),
            "{e}"
        );
        let deep = DevCommRequirements {
            queue_depth: u32::MAX,
            contexts: 4,
            ..DevCommRequirements::default()
        };
        let e = check_bounds(0, 2, &deep).unwrap_err().to_string();
        assert!(e.contains("queue memory"), "{e}");
        check_bounds(0, 16, &DevCommRequirements::default()).unwrap();
    }
}
