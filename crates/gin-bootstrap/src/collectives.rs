//! Collectives over the point-to-point layer. Every rank must call the same
//! collectives in the same order (each takes the next sequence number as its
//! message tag); they may be interleaved freely with user `send` / `recv`.

use crate::comm::Bootstrap;
use crate::error::BootstrapError;

impl Bootstrap {
    /// Ring allgather: each rank contributes `mine` (sizes may differ between
    /// ranks) and gets every rank's contribution, indexed by rank. In step `s`
    /// of `n - 1`, a rank passes block `rank - s` to `rank + 1` and receives
    /// block `rank - s - 1` from `rank - 1`.
    pub fn allgather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, BootstrapError> {
        let (n, r) = (self.nranks(), self.rank());
        let tag = self.next_collective_tag();
        let deadline = self.deadline();
        let mut out: Vec<Vec<u8>> = vec![Vec::new(); n];
        out[r] = mine.to_vec();
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        for step in 0..n - 1 {
            let send_block = (r + n - step) % n;
            let recv_block = (r + n - step - 1) % n;
            self.send_tagged(next, tag, &out[send_block], "allgather")?;
            out[recv_block] = self.recv_tagged(prev, tag, "allgather", deadline)?;
        }
        Ok(out)
    }

    /// Allgather of equal-sized contributions, concatenated in rank order.
    /// A rank whose contribution has another size is an error naming it.
    pub fn allgather_equal(&self, mine: &[u8]) -> Result<Vec<u8>, BootstrapError> {
        let all = self.allgather(mine)?;
        let mut out = Vec::with_capacity(mine.len() * all.len());
        for (peer, block) in all.iter().enumerate() {
            if block.len() != mine.len() {
                return Err(BootstrapError::BadArgument {
                    rank: self.rank(),
                    op: "allgather_equal",
                    why: format!(
                        "rank {peer} contributed {} bytes, this rank {}",
                        block.len(),
                        mine.len()
                    ),
                });
            }
            out.extend_from_slice(block);
        }
        Ok(out)
    }

    /// Full-mesh all-to-all with per-peer sizes: `blocks[p]` goes to rank `p`;
    /// the result's entry `p` came from rank `p`.
    pub fn alltoallv<B: AsRef<[u8]>>(&self, blocks: &[B]) -> Result<Vec<Vec<u8>>, BootstrapError> {
        let (n, r) = (self.nranks(), self.rank());
        if blocks.len() != n {
            return Err(BootstrapError::BadArgument {
                rank: r,
                op: "alltoallv",
                why: format!("{} blocks given for {n} ranks", blocks.len()),
            });
        }
        let tag = self.next_collective_tag();
        let deadline = self.deadline();
        // Start with the next rank so that not everyone hits rank 0 first.
        for k in 1..n {
            let p = (r + k) % n;
            self.send_tagged(p, tag, blocks[p].as_ref(), "alltoall")?;
        }
        let mut out: Vec<Vec<u8>> = vec![Vec::new(); n];
        out[r] = blocks[r].as_ref().to_vec();
        for k in 1..n {
            let p = (r + n - k) % n;
            out[p] = self.recv_tagged(p, tag, "alltoall", deadline)?;
        }
        Ok(out)
    }

    /// All-to-all of fixed `block`-byte pieces: `send` holds `nranks` blocks
    /// in rank order; the result holds the blocks received, in rank order.
    pub fn alltoall(&self, send: &[u8], block: usize) -> Result<Vec<u8>, BootstrapError> {
        let n = self.nranks();
        if Some(send.len()) != block.checked_mul(n) {
            return Err(BootstrapError::BadArgument {
                rank: self.rank(),
                op: "alltoall",
                why: format!(
                    "send buffer of {} bytes is not {n} blocks of {block} bytes",
                    send.len()
                ),
            });
        }
        let blocks: Vec<&[u8]> = if block == 0 {
            vec![&[]; n]
        } else {
            send.chunks(block).collect()
        };
        let got = self.alltoallv(&blocks)?;
        let mut out = Vec::with_capacity(send.len());
        for (peer, b) in got.iter().enumerate() {
            if b.len() != block {
                return Err(BootstrapError::BadArgument {
                    rank: self.rank(),
                    op: "alltoall",
                    why: format!("rank {peer} sent {} bytes, expected {block}", b.len()),
                });
            }
            out.extend_from_slice(b);
        }
        Ok(out)
    }

    /// Broadcast from `root` along a binomial tree; `data` matters only on the
    /// root. Every rank returns the root's bytes.
    pub fn broadcast(&self, root: usize, data: &[u8]) -> Result<Vec<u8>, BootstrapError> {
        self.check_peer(root)?;
        let (n, r) = (self.nranks(), self.rank());
        let tag = self.next_collective_tag();
        let deadline = self.deadline();
        let me = (r + n - root) % n;
        let mut mask = 1usize;
        let mut buf = if me == 0 { data.to_vec() } else { Vec::new() };
        // Receive from the parent: the relative rank with my lowest set bit cleared.
        while mask < n {
            if me & mask != 0 {
                let parent = (me - mask + root) % n;
                buf = self.recv_tagged(parent, tag, "broadcast", deadline)?;
                break;
            }
            mask <<= 1;
        }
        // Forward to children below that bit.
        mask >>= 1;
        while mask > 0 {
            if me + mask < n {
                self.send_tagged((me + mask + root) % n, tag, &buf, "broadcast")?;
            }
            mask >>= 1;
        }
        Ok(buf)
    }

    /// Dissemination barrier: in round `k`, signal `rank + 2^k` and wait for
    /// `rank - 2^k`; after ceil(log2 n) rounds everyone has heard from everyone.
    pub fn barrier(&self) -> Result<(), BootstrapError> {
        let (n, r) = (self.nranks(), self.rank());
        let tag = self.next_collective_tag();
        let deadline = self.deadline();
        let mut dist = 1;
        while dist < n {
            self.send_tagged((r + dist) % n, tag, &[], "barrier")?;
            self.recv_tagged((r + n - dist) % n, tag, "barrier", deadline)?;
            dist <<= 1;
        }
        Ok(())
    }
}
