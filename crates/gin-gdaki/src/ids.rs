//! What names things on a GDAKI NIC: queue pair numbers and memory keys.
//! One scheme for CPU and CUDA ranks, so a WQE means the same on both and
//! the soft NIC decodes a number or key without a table.
//!
//! - **QP numbers**: the RC QP of context `c` to peer `p` in a job of `n`
//!   ranks is `0x100 + 2 * (c * n + p)`; its companion loopback QP (the one
//!   that bumps counters) is one above. Each CQ takes its QP's number.
//! - **Window keys**: rank `p`'s part of window `id` has key
//!   `0x1000 + id * n + p`, below [`COUNTER_KEY`].
//! - **Local keys**: the counter array ([`COUNTER_KEY`]) and the atomic
//!   result sink ([`SINK_KEY`]) exist only on the NIC's own rank.

/// The first QP number: context 0's QP to rank 0.
pub const QPN_BASE: u32 = 0x100;

/// QP numbers are 24 bits wide on the wire.
pub const MAX_QPN: u32 = (1 << 24) - 1;

/// First NIC key of window parts.
pub const WINDOW_KEY_BASE: u32 = 0x1000;

/// Local key of the counter array, above every window key.
pub const COUNTER_KEY: u32 = 0xfeed_0000;

/// Local key of the atomic result sink (where fetch-adds nobody reads
/// return their old value).
pub const SINK_KEY: u32 = 0xfeed_0001;

/// The QP number of context `ctx`'s RC QP to `peer` in a job of `nranks`:
/// `0x100 + 2 * (ctx * nranks + peer)`. `None` when it does not fit 24
/// bits (with its companion) or `peer` is not a rank.
pub fn main_qpn(ctx: usize, peer: usize, nranks: usize) -> Option<u32> {
    if peer >= nranks {
        return None;
    }
    let k = ctx.checked_mul(nranks)?.checked_add(peer)?;
    let q = u64::from(QPN_BASE) + 2 * k as u64;
    u32::try_from(q).ok().filter(|&q| q < MAX_QPN)
}

/// The QP number of the companion loopback QP of [`main_qpn`]: one above.
pub fn companion_qpn(ctx: usize, peer: usize, nranks: usize) -> Option<u32> {
    main_qpn(ctx, peer, nranks).map(|q| q + 1)
}

/// Where a QP number sits in the scheme: its context, its peer, and whether
/// it is a companion QP (the inverse of [`main_qpn`] and [`companion_qpn`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpSlot {
    /// The context.
    pub ctx: usize,
    /// The rank the QP reaches (the main QP's; a companion loops back).
    pub peer: usize,
    /// Whether this is the companion loopback QP.
    pub companion: bool,
}

/// The context, peer and kind a QP number names, or `None` when it is not
/// one of the scheme's numbers for `nranks` ranks.
pub fn qp_slot(qpn: u32, nranks: usize) -> Option<QpSlot> {
    let k = qpn.checked_sub(QPN_BASE)?;
    if nranks == 0 || qpn > MAX_QPN {
        return None;
    }
    let i = (k / 2) as usize;
    Some(QpSlot {
        ctx: i / nranks,
        peer: i % nranks,
        companion: k % 2 == 1,
    })
}

/// The NIC key of rank `p`'s part of window `id` in a job of `n` ranks:
/// `0x1000 + id * n + p`, so the soft NIC decodes a key without a table.
/// `None` once window ids run into the local keys.
pub fn window_key(id: u32, p: usize, n: usize) -> Option<u32> {
    if p >= n {
        return None;
    }
    let k = u64::from(id) * n as u64 + p as u64 + u64::from(WINDOW_KEY_BASE);
    u32::try_from(k).ok().filter(|&k| k < COUNTER_KEY)
}

/// The window id and rank a key names (the inverse of [`window_key`]).
pub fn window_of_key(key: u32, n: usize) -> Option<(u32, usize)> {
    let k = key.checked_sub(WINDOW_KEY_BASE)?;
    if key >= COUNTER_KEY || n == 0 {
        return None;
    }
    Some((k / n as u32, (k % n as u32) as usize))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_scheme_matches_the_cuda_ranks_numbers() {
        // gin-core's `gdaki_queues`: QP k of a table of (ctx, peer) pairs,
        // main at 0x100 + 2k, companion one above.
        assert_eq!(main_qpn(0, 0, 4), Some(0x100));
        assert_eq!(companion_qpn(0, 0, 4), Some(0x101));
        assert_eq!(main_qpn(1, 2, 4), Some(0x100 + 2 * 6));
        assert_eq!(main_qpn(0, 4, 4), None);
        assert_eq!(window_key(0, 0, 1), Some(0x1000));
        assert_eq!(window_key(3, 1, 2), Some(0x1007));
        assert_eq!(window_key(u32::MAX, 0, 2), None);
        assert_eq!(window_key(0, 2, 2), None);
        assert_eq!(window_of_key(COUNTER_KEY, 2), None);
        assert_eq!(window_of_key(SINK_KEY, 2), None);
        assert_eq!(window_of_key(0x0fff, 2), None);
        assert_eq!(qp_slot(0xff, 2), None);
        assert_eq!(main_qpn(0, 0, 1 << 23), Some(0x100));
        assert_eq!(main_qpn(1, 0, 1 << 23), None, "past 24 bits");
    }

    proptest! {
        #[test]
        fn keys_decode_to_what_they_encode(id in 0u32..100_000, n in 1usize..5000, p in 0usize..5000) {
            let p = p % n;
            if let Some(k) = window_key(id, p, n) {
                prop_assert!((WINDOW_KEY_BASE..COUNTER_KEY).contains(&k));
                prop_assert_eq!(window_of_key(k, n), Some((id, p)));
            }
        }

        #[test]
        fn qp_numbers_decode_to_what_they_encode(ctx in 0usize..64, n in 1usize..1000, p in 0usize..1000) {
            let p = p % n;
            let m = main_qpn(ctx, p, n).unwrap();
            let c = companion_qpn(ctx, p, n).unwrap();
            prop_assert_eq!(qp_slot(m, n), Some(QpSlot { ctx, peer: p, companion: false }));
            prop_assert_eq!(qp_slot(c, n), Some(QpSlot { ctx, peer: p, companion: true }));
        }
    }
}
