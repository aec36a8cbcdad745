//! A self-check of every collective with data that depends on sender,
//! receiver and position, so a misrouted or reordered byte is caught. The
//! process tests run it through the launcher; users can run the
//! `gin-bootstrap-selftest` binary to check a cluster's rendezvous.

use crate::Bootstrap;

/// A deterministic byte sequence per seed (xorshift): bytes differ between
/// seeds and positions, so misrouted or reordered data is caught.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn seed(a: usize, b: usize, c: usize) -> u64 {
    ((a as u64) << 40) ^ ((b as u64) << 20) ^ c as u64
}

/// Runs every collective `rounds` times and checks every byte. The error says
/// which collective, from which rank, and what differed.
pub fn verify(b: &Bootstrap, rounds: usize) -> Result<(), String> {
    let (n, r) = (b.nranks(), b.rank());
    let big = if n <= 4 { 1 << 20 } else { 4096 };
    for round in 0..rounds {
        let e = |what: &str, e: crate::BootstrapError| format!("round {round}: {what}: {e}");
        // Allgather, sizes differ per rank (rank 0 contributes nothing).
        let len_of = |p: usize| (p * 37 + round) % 300 + p;
        let mine = pattern(seed(1, r, round), len_of(r));
        let all = b.allgather(&mine).map_err(|x| e("allgather", x))?;
        for (p, got) in all.iter().enumerate() {
            if *got != pattern(seed(1, p, round), len_of(p)) {
                return Err(format!(
                    "round {round}: allgather block from rank {p} is wrong"
                ));
            }
        }
        // Equal-size allgather.
        let eq = b
            .allgather_equal(&(r as u64 ^ round as u64).to_le_bytes())
            .map_err(|x| e("allgather_equal", x))?;
        for p in 0..n {
            let want = (p as u64 ^ round as u64).to_le_bytes();
            if eq[p * 8..p * 8 + 8] != want {
                return Err(format!("round {round}: allgather_equal entry {p} is wrong"));
            }
        }
        // Fixed-size all-to-all.
        let block = 16;
        let send: Vec<u8> = (0..n)
            .flat_map(|d| pattern(seed(2, r * n + d, round), block))
            .collect();
        let got = b.alltoall(&send, block).map_err(|x| e("alltoall", x))?;
        for s in 0..n {
            if got[s * block..(s + 1) * block] != pattern(seed(2, s * n + r, round), block)[..] {
                return Err(format!(
                    "round {round}: alltoall block from rank {s} is wrong"
                ));
            }
        }
        // Variable-size all-to-all, one large pair to exercise chunked reads.
        let size = |s: usize, d: usize| {
            if s == 0 && d + 1 == n {
                big
            } else {
                (s * 11 + d * 5 + round) % 97
            }
        };
        let blocks: Vec<Vec<u8>> = (0..n)
            .map(|d| pattern(seed(3, r * n + d, round), size(r, d)))
            .collect();
        let got = b.alltoallv(&blocks).map_err(|x| e("alltoallv", x))?;
        for (s, block) in got.iter().enumerate() {
            if *block != pattern(seed(3, s * n + r, round), size(s, r)) {
                return Err(format!(
                    "round {round}: alltoallv block from rank {s} is wrong"
                ));
            }
        }
        // Broadcast from every root.
        for root in 0..n {
            let data = if r == root {
                pattern(seed(4, root, round), root * 3 + 1)
            } else {
                Vec::new()
            };
            let got = b.broadcast(root, &data).map_err(|x| e("broadcast", x))?;
            if got != pattern(seed(4, root, round), root * 3 + 1) {
                return Err(format!(
                    "round {round}: broadcast from root {root} is wrong"
                ));
            }
        }
        b.barrier().map_err(|x| e("barrier", x))?;
        // Point to point: FIFO within a tag, tags matched independently.
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        for i in 0..3u8 {
            b.send(next, 7, &[r as u8, i]).map_err(|x| e("send", x))?;
        }
        b.send(next, 8, &[0xee]).map_err(|x| e("send", x))?;
        if b.recv(prev, 8).map_err(|x| e("recv", x))? != [0xee] {
            return Err(format!(
                "round {round}: tag 8 message from rank {prev} is wrong"
            ));
        }
        for i in 0..3u8 {
            let got = b.recv(prev, 7).map_err(|x| e("recv", x))?;
            if got != [prev as u8, i] {
                return Err(format!(
                    "round {round}: message {i} from rank {prev} arrived as {got:?} (order broken?)"
                ));
            }
        }
        b.barrier().map_err(|x| e("barrier", x))?;
    }
    Ok(())
}
