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

use gin_bootstrap::Bootstrap;
use gin_bootstrap::agree::Field;

use crate::comm::{Connection, DevCommRequirements};
use crate::error::CoreError;
use crate::space::{Ranges, Spaces};

/// The most contexts a device communicator may have.
pub const MAX_CONTEXTS: u32 = 1 << 16;

/// The most bytes a device communicator's queues (one per context and peer,
/// `queue_depth` slots of [`QUEUE_SLOT_BYTES`]) may take on one rank.
pub const MAX_QUEUE_BYTES: u64 = 1 << 30;

/// The size of one queue slot: a proxy descriptor or a GDAKI WQE basic block.
pub const QUEUE_SLOT_BYTES: u64 = 64;

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

/// Collective ([`Bootstrap::agree`]): every rank sends its fields
/// (`req`'s, then `extra`), and every rank fails alike, naming the field
/// and the ranks, unless all gave the same values.
pub(crate) fn agree(
    bootstrap: &Bootstrap,
    req: &DevCommRequirements,
    extra: &[Field],
) -> Result<(), CoreError> {
    let mut mine = fields(req);
    mine.extend_from_slice(extra);
    match bootstrap.agree(&mine)? {
        None => Ok(()),
        Some(d) => Err(CoreError::Mismatch {
            rank: bootstrap.rank(),
            what: format!("DevCommRequirements::{}", d.field),
            detail: d.detail,
        }),
    }
}

/// The first steps of every device communicator, on CPU and CUDA ranks
/// alike, in this order: every rank agrees on `req` (and `extra`,
/// collective), `req` is bounded, `check` runs the rank's own checks and
/// returns the signal slots one context takes, the signal and counter
/// ranges are taken from `spaces` and `zero`ed, and every rank checks that
/// all placed them alike (collective). On an error after they were taken
/// the ranges go back.
pub(crate) fn reserve<'s>(
    bootstrap: &Bootstrap,
    spaces: &'s Spaces,
    req: &DevCommRequirements,
    extra: &[Field],
    check: impl FnOnce() -> Result<u32, CoreError>,
    zero: impl FnOnce(&Ranges<'s>) -> Result<(), CoreError>,
) -> Result<(u32, Ranges<'s>), CoreError> {
    agree(bootstrap, req, extra)?;
    check_bounds(bootstrap.rank(), bootstrap.nranks(), req)?;
    let per_ctx = check()?;
    let nsig = u64::from(per_ctx) * u64::from(req.contexts);
    let ncnt = u64::from(req.counters) * u64::from(req.contexts);
    let ranges = spaces.take(nsig, ncnt)?;
    zero(&ranges)?;
    agree_placement(bootstrap, ranges.signals.0, ranges.counters.0)?;
    Ok((per_ctx, ranges))
}

/// What a rank whose signal and barrier counts overflow fails with.
pub(crate) fn overflow(rank: usize) -> CoreError {
    CoreError::Requirement {
        rank,
        what: "signal and barrier counts overflow".into(),
    }
}

/// Checks that every rank placed a device communicator's signals and
/// counters alike (collective), CPU and CUDA ranks alike: each rank fails
/// with the same [`CoreError::Mismatch`], naming who placed them where.
fn agree_placement(
    bootstrap: &Bootstrap,
    signal_base: u64,
    counter_base: u64,
) -> Result<(), CoreError> {
    let placement = [("signal", signal_base), ("counter", counter_base)];
    match bootstrap.agree(&placement)? {
        None => Ok(()),
        Some(d) => Err(CoreError::Mismatch {
            rank: bootstrap.rank(),
            what: format!("{} placement", d.field),
            detail: format!(
                "{}: device communicators were created or destroyed in different orders, \
                 or with different requirements",
                d.detail
            ),
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
    use gin_bootstrap::agree::first_disagreement;

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

    #[test]
    fn reserve_takes_zeroed_ranges_or_gives_them_back() {
        use gin_bootstrap::{Config, run_threads};
        let req = DevCommRequirements {
            counters: 3,
            contexts: 2,
            ..DevCommRequirements::default()
        };
        let out = run_threads(1, Config::default(), move |b| {
            let spaces = Spaces::new(64, 64);
            let refuse = || Err(overflow(0));
            let e = reserve(&b, &spaces, &req, &[], refuse, |_| Ok(())).unwrap_err();
            assert!(e.to_string().contains("overflow"), "{e}");
            let fail = |_: &Ranges<'_>| Err(CoreError::Invalid("zeroing failed".into()));
            reserve(&b, &spaces, &req, &[], || Ok(5), fail).unwrap_err();
            // Neither failure kept a slot: the whole of both spaces is free.
            drop(spaces.take(64, 64).unwrap());
            let mut zeroed = None;
            let zero = |r: &Ranges<'_>| {
                zeroed = Some((r.signals, r.counters));
                Ok(())
            };
            let (per_ctx, r) = reserve(&b, &spaces, &req, &[], || Ok(5), zero).unwrap();
            assert_eq!((per_ctx, r.signals, r.counters), (5, (0, 10), (0, 6)));
            assert_eq!(zeroed, Some(((0, 10), (0, 6))));
        });
        out.unwrap();
    }
}
