//! Channels as lanes: each channel of a step is a state machine (DeepEP's
//! warp roles for that channel: sender, forwarder, receiver) polled without
//! blocking, and the lanes run on the calling thread or spread over several
//! (one context per channel, so each context has one thread).
//!
//! The dispatch lane of channel `c`, at rank `me` on host `H`:
//! - **sender**: for each other host, its tokens of the channel's range go
//!   to that host's forwarder for `me` in runs of consecutive tokens (one
//!   put of payloads and one of metadata carrying the signal): straight
//!   into their final place when the forwarder receives them itself
//!   (`dtail`), else into the forwarder's ring for (`c`, `me`) within the
//!   credits (`tail`, `head`);
//! - **own host**: its tokens for ranks of `H` are written into their final
//!   place at each of them (load/store where mapped, else put);
//! - **forwarder**: messages from other hosts' sources are copied from the
//!   ring (or from this rank's own final place) to the other ranks of `H`
//!   that receive them, and the ring's credits go back; what each token's
//!   receivers hold is recorded for the combine (DeepEP's `send_nvl_head`);
//! - **receiver**: once done, it tells each rank of `H` how many tokens it
//!   delivered there, and waits for the same from each of them.

use std::ops::Range;
use std::time::{Duration, Instant};

use gin_bootstrap::BootstrapError;
use gin_core::{Comm, CounterId, DevComm, Local, Remote};

use super::mem::Mem;
use super::plan::{CHUNK, MIN, Plan, RECVM, RECVX, RINGM, RINGX, RUN, Shape, XIN};
use crate::buffer::reached;
use crate::error::EpError;
use crate::layout::{Layout, NONE};
use crate::num::{Bf16, bf16_bytes, quantize_fp8};

/// What every lane of a step reads.
#[derive(Debug)]
pub(crate) struct Shared<'a> {
    pub(crate) s: Shape,
    pub(crate) fp8: bool,
    pub(crate) hidden: usize,
    pub(crate) rank: usize,
    pub(crate) step: u64,
    pub(crate) comm: &'a Comm,
    pub(crate) dc: &'a DevComm,
    pub(crate) mem: Mem<'a>,
    pub(crate) plan: &'a Plan,
    pub(crate) timeout: Duration,
    /// Per rank: loads and stores reach its windows from here (this rank,
    /// and same-host peers the device communicator reaches directly).
    pub(crate) direct: Vec<bool>,
}

/// One put: `len` bytes from window `src` at `src_off` here to window `dst`
/// at `dst_off` of `peer`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Xfer {
    pub(crate) peer: usize,
    pub(crate) dst: usize,
    pub(crate) dst_off: usize,
    pub(crate) src: usize,
    pub(crate) src_off: usize,
    pub(crate) len: usize,
}

impl Shared<'_> {
    /// Issues `x` on context `ch`, counted for local completion (see
    /// [`complete`]).
    pub(crate) fn put(
        &self,
        ch: usize,
        issued: &mut u64,
        x: Xfer,
        remote: Remote<'_>,
    ) -> Result<(), EpError> {
        let w = self.mem.wins;
        self.dc.ctx(ch as u32)?.put(
            x.peer,
            &w[x.dst],
            x.dst_off as u64,
            &w[x.src],
            x.src_off as u64,
            x.len as u64,
            remote,
            Local::CounterInc(CounterId(0)),
        )?;
        *issued += 1;
        Ok(())
    }

    /// Puts a token's payload (window `x`, slot `xs`) and its metadata
    /// (window `m`, slot `ms`) to slot `j` of `dst`'s receive windows: two
    /// puts, counted for local completion.
    pub(crate) fn put_token(
        &self,
        ch: usize,
        issued: &mut u64,
        dst: usize,
        j: usize,
        (x, xs): (usize, usize),
        (m, ms): (usize, usize),
    ) -> Result<(), EpError> {
        let s = &self.s;
        for (win, src, slot, len) in [(RECVX, x, xs, s.p), (RECVM, m, ms, s.mm)] {
            let xfer = Xfer {
                peer: dst,
                dst: win,
                dst_off: j * len,
                src,
                src_off: slot * len,
                len,
            };
            self.put(ch, issued, xfer, Remote::None)?;
        }
        Ok(())
    }

    pub(crate) fn host(&self) -> usize {
        self.rank / self.s.l
    }
    pub(crate) fn local(&self) -> usize {
        self.rank % self.s.l
    }
}

/// One channel's state machine.
pub(crate) trait Lane: Send {
    /// Makes what progress it can without waiting; true if anything moved.
    fn poll(&mut self) -> Result<bool, EpError>;
    /// Everything of the step is done here.
    fn done(&self) -> bool;
    /// What it waits for: the peer, a description, the signal id and the
    /// value needed (for the timeout's error).
    fn waiting(&self) -> (usize, String, u32, u64);
    /// Its context.
    fn ctx(&self) -> u32;
}

/// Runs `lanes` to completion on `threads` threads (the calling one
/// included); returns them, or the first error.
pub(crate) fn run<L: Lane>(
    sh: &Shared<'_>,
    lanes: Vec<L>,
    threads: usize,
) -> Result<Vec<L>, EpError> {
    let threads = threads.clamp(1, lanes.len().max(1));
    let mut groups: Vec<Vec<(usize, L)>> = (0..threads).map(|_| Vec::new()).collect();
    for (i, lane) in lanes.into_iter().enumerate() {
        groups[i % threads].push((i, lane));
    }
    let mut first = groups.remove(0);
    let (mine, others) = std::thread::scope(|scope| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|mut g| {
                scope.spawn(move || {
                    let r = drive(sh, &mut g);
                    (g, r)
                })
            })
            .collect();
        let mine = drive(sh, &mut first);
        let others: Vec<_> = handles
            .into_iter()
            .map(std::thread::ScopedJoinHandle::join)
            .collect();
        (mine, others)
    });
    mine?;
    let mut all = first;
    for joined in others {
        match joined {
            Ok((g, r)) => {
                r?;
                all.extend(g);
            }
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }
    all.sort_by_key(|(i, _)| *i);
    Ok(all.into_iter().map(|(_, lane)| lane).collect())
}

/// Polls `lanes` until every one is done. Idle, it rings held-back
/// doorbells, then spins, yields and sleeps a little (ranks share cores with
/// their peers and backend threads); it fails when nothing moved for the
/// timeout, naming what the first unfinished lane waits for, or at once when
/// the bootstrap reports an active peer dead.
fn drive<L: Lane>(sh: &Shared<'_>, lanes: &mut [(usize, L)]) -> Result<(), EpError> {
    let mut idle: Option<Instant> = None;
    let mut spins = 0u32;
    loop {
        let mut moved = false;
        let mut all = true;
        for (_, lane) in lanes.iter_mut() {
            if !lane.done() {
                moved |= lane.poll()?;
                all &= lane.done();
            }
        }
        if all {
            return Ok(());
        }
        if moved {
            idle = None;
            spins = 0;
            continue;
        }
        spins = spins.wrapping_add(1);
        let since = *idle.get_or_insert_with(Instant::now);
        if spins == 1 {
            for (_, lane) in lanes.iter() {
                kick(sh.dc, lane.ctx())?;
            }
        }
        if spins < 64 {
            std::hint::spin_loop();
            continue;
        }
        let waited = since.elapsed();
        // Back-off while polling, not synchronisation (as gin-device's
        // waits): ranks share cores with their peers and backend threads.
        if waited < Duration::from_micros(200) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(20).min(waited / 16));
        }
        if spins.is_multiple_of(32) {
            stalled(sh, lanes, waited)?;
        }
    }
}

/// Rings the doorbells a batching backend may hold for context `ctx` (a
/// wait already satisfied returns at once, after the backend's progress).
pub(crate) fn kick(dc: &DevComm, ctx: u32) -> Result<(), EpError> {
    let c = dc.ctx(ctx)?;
    let v = c.read_signal(0)?;
    c.wait_signal_for(0, v, Duration::from_secs(1))?;
    Ok(())
}

/// The error of a stall: a peer the bootstrap reports dead, or the timeout.
fn stalled<L: Lane>(
    sh: &Shared<'_>,
    lanes: &[(usize, L)],
    waited: Duration,
) -> Result<(), EpError> {
    let Some((_, lane)) = lanes.iter().find(|(_, l)| !l.done()) else {
        return Ok(());
    };
    // Each active peer's own health: a rank lost after an earlier (masked)
    // one is seen too.
    let boot = sh.comm.bootstrap();
    let dead = (0..sh.plan.active.len())
        .filter(|&p| sh.plan.active[p])
        .find_map(|p| match boot.peer_health(p) {
            Err(
                BootstrapError::PeerDied { ref why, .. }
                | BootstrapError::PeerUnresponsive { ref why, .. },
            ) => Some((p, why.clone())),
            _ => None,
        });
    if dead.is_none() && waited < sh.timeout {
        return Ok(());
    }
    let (peer, what, id, expected) = lane.waiting();
    let what = format!("{what} (step {}, channel {})", sh.step, lane.ctx());
    if let Some((lost, why)) = dead {
        return Err(EpError::PeerLost {
            rank: sh.rank,
            peer: lost,
            what,
            why,
        });
    }
    let last = sh.dc.ctx(lane.ctx())?.read_signal(id)?;
    Err(EpError::Timeout {
        rank: sh.rank,
        peer,
        what,
        last,
        expected,
        waited,
    })
}

/// Waits until the `issued` puts counted on context `ctx` completed locally
/// (their sources may be rewritten). It polls the completion counter
/// rather than waiting in the device API, whose waits fail once any rank of
/// the job died: survivors that masked a lost rank must still complete
/// their own puts. Bounded by `timeout`.
pub(crate) fn complete(
    dc: &DevComm,
    ctx: u32,
    issued: u64,
    timeout: Duration,
    rank: usize,
) -> Result<(), EpError> {
    const MASK: u64 = (1 << 56) - 1;
    let c = dc.ctx(ctx)?;
    let done = |v: u64| v.wrapping_sub(issued) & MASK < 1 << 55;
    let mut v = c.read_counter(0)?;
    if done(v) {
        return Ok(());
    }
    // A batching backend may hold the puts.
    kick(dc, ctx)?;
    let start = Instant::now();
    let mut spins = 0u32;
    while !done(v) {
        spins = spins.wrapping_add(1);
        if spins < 64 {
            std::hint::spin_loop();
        } else {
            let waited = start.elapsed();
            if waited >= timeout {
                return Err(EpError::Timeout {
                    rank,
                    peer: rank,
                    what: format!("local completion of its puts on context {ctx}"),
                    last: v,
                    expected: issued & MASK,
                    waited,
                });
            }
            // Back-off while polling the counter, not synchronisation.
            if waited < Duration::from_micros(200) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
        v = c.read_counter(0)?;
    }
    Ok(())
}

/// This rank's inputs to one dispatch.
#[derive(Debug)]
pub(crate) struct DispatchIn<'a> {
    pub(crate) lay: &'a Layout,
    pub(crate) x: &'a [Bf16],
    pub(crate) idx: &'a [i64],
    pub(crate) w: &'a [f32],
}

/// What a forwarder keeps of the tokens it forwarded from one source in one
/// channel, for the combine: for each (token, local rank), where that rank
/// holds the token among its received tokens ([`NONE`]: not there).
#[derive(Debug, Clone)]
pub(crate) struct FwdBlock {
    pub(crate) src: usize,
    /// The first token's slot among the source's tokens for this host.
    pub(crate) hs_start: u32,
    pub(crate) n: u32,
    /// `[i * l + local]`.
    pub(crate) contrib: Vec<u32>,
}

/// Sender progress towards one other host.
#[derive(Debug)]
struct SendTo {
    host: usize,
    fwd: usize,
    cursor: usize,
    ring: u64,
}

/// Forwarder progress on one source's streams.
#[derive(Debug)]
struct FwdFrom {
    src: usize,
    ring_expect: u64,
    ring_done: u64,
    direct_expect: u64,
    direct_done: u64,
    block: FwdBlock,
}

/// Where a message to forward lies in this rank's windows.
#[derive(Debug, Clone, Copy)]
enum At {
    Ring(usize),
    Recv(usize),
}

/// The progress of one channel's dispatch, kept between polls (by a
/// pending dispatch, see [`crate::Buffer::ht_dispatch_send`]).
#[derive(Debug)]
pub(crate) struct DispatchState {
    ch: usize,
    range: Range<usize>,
    staged: usize,
    sends: Vec<SendTo>,
    local_cursor: usize,
    froms: Vec<FwdFrom>,
    /// Per local rank: tokens this lane delivered there.
    delivered: Vec<u64>,
    signalled: bool,
    /// Per local forwarder: the count it reported (`Some(0)` for masked).
    heard: Vec<Option<u64>>,
    meta: Vec<u8>,
}

impl DispatchState {
    /// Channel `ch`'s dispatch of `tokens` tokens under the step's plan.
    pub(crate) fn new(sh: &Shared<'_>, tokens: usize, ch: usize) -> Self {
        let (s, plan, me) = (&sh.s, sh.plan, sh.rank);
        let range = s.chan_range(tokens, ch);
        let sends = (0..s.h)
            .filter(|&h| h != sh.host())
            .filter_map(|host| {
                plan.forwarder(me, host).map(|fwd| SendTo {
                    host,
                    fwd,
                    cursor: range.start,
                    ring: 0,
                })
            })
            .collect();
        let froms = plan
            .forwarded_sources(me)
            .into_iter()
            .map(|src| {
                let n = plan.host_chan(src, sh.host(), ch);
                let direct = plan.rank_chan(src, me, ch);
                FwdFrom {
                    src,
                    ring_expect: u64::from(n - direct.min(n)),
                    ring_done: 0,
                    direct_expect: u64::from(direct),
                    direct_done: 0,
                    block: FwdBlock {
                        src,
                        hs_start: plan.host_chan_start(src, sh.host(), ch),
                        n,
                        contrib: vec![NONE; n as usize * s.l],
                    },
                }
            })
            .collect();
        let heard = (0..s.l)
            .map(|fl| (!plan.active[sh.host() * s.l + fl]).then_some(0))
            .collect();
        Self {
            ch,
            staged: range.start,
            local_cursor: range.start,
            range,
            sends,
            froms,
            delivered: vec![0; s.l],
            signalled: false,
            heard,
            meta: vec![0; s.mm],
        }
    }

    /// Everything of the channel's dispatch is done here.
    pub(crate) fn done(&self) -> bool {
        self.signalled && self.heard.iter().all(Option::is_some)
    }

    /// The forwarded blocks, for the combine.
    pub(crate) fn into_blocks(self) -> Vec<FwdBlock> {
        self.froms.into_iter().map(|f| f.block).collect()
    }
}

/// The dispatch lane of one channel: its state, and what it works with.
#[derive(Debug)]
pub(crate) struct DispatchLane<'a> {
    sh: &'a Shared<'a>,
    inp: &'a DispatchIn<'a>,
    ch: usize,
    seen: &'a mut [u64],
    issued: &'a mut u64,
    st: &'a mut DispatchState,
}

impl<'a> DispatchLane<'a> {
    pub(crate) fn new(
        sh: &'a Shared<'a>,
        inp: &'a DispatchIn<'a>,
        st: &'a mut DispatchState,
        seen: &'a mut [u64],
        issued: &'a mut u64,
    ) -> Self {
        Self {
            sh,
            inp,
            ch: st.ch,
            seen,
            issued,
            st,
        }
    }

    /// Writes the metadata (and, where a put or FP8 needs it, the payload)
    /// of this lane's tokens below `end` into the send windows.
    fn stage_upto(&mut self, end: usize) -> Result<(), EpError> {
        let (sh, lay) = (self.sh, self.inp.lay);
        let (s, me) = (&sh.s, sh.rank);
        while self.st.staged < end {
            let t = self.st.staged;
            self.st.staged += 1;
            for i in 0..s.mm / 4 {
                let w = self.meta_word(t, i);
                self.st.meta[4 * i..4 * i + 4].copy_from_slice(&w.to_le_bytes());
            }
            sh.mem.write(MIN, me, t * s.mm, &self.st.meta)?;
            let remote = (0..s.h).any(|h| h != sh.host() && lay.is_token_in_host[t * s.h + h]);
            let put_local = (0..s.l).any(|dl| {
                let dst = sh.host() * s.l + dl;
                lay.is_token_in_rank[t * s.r + dst] && !sh.direct[dst]
            });
            let row = &self.inp.x[t * sh.hidden..(t + 1) * sh.hidden];
            if sh.fp8 {
                // SAFETY: token `t`'s payload slot is this lane's alone (its
                // token range), and no put reads it: the step began with a
                // flush of every context.
                let out = unsafe { sh.mem.own_mut(XIN, t * s.p, s.p)? };
                quantize_fp8(row, out);
            } else if remote || put_local {
                sh.mem.write(XIN, me, t * s.p, bf16_bytes(row))?;
            }
        }
        Ok(())
    }

    fn meta_word(&self, t: usize, i: usize) -> u32 {
        super::plan::meta_word(&self.sh.s, self.inp.lay, self.inp.idx, self.inp.w, t, i)
    }

    /// Sends runs of tokens to host `sends[i]`'s forwarder as far as credits
    /// allow; true if any left.
    fn send_remote(&mut self, i: usize) -> Result<bool, EpError> {
        let (sh, lay) = (self.sh, self.inp.lay);
        let (s, me, plan) = (&sh.s, sh.rank, sh.plan);
        let ctx = sh.dc.ctx(self.ch as u32)?;
        let (host, fwd) = (self.st.sends[i].host, self.st.sends[i].fwd);
        let goes = |t: usize| lay.is_token_in_host[t * s.h + host];
        let mut moved = false;
        for _ in 0..4 {
            let mut t0 = self.st.sends[i].cursor;
            while t0 < self.st.range.end && !goes(t0) {
                t0 += 1;
            }
            self.st.sends[i].cursor = t0;
            if t0 == self.st.range.end {
                break;
            }
            let direct = lay.is_token_in_rank[t0 * s.r + fwd];
            let (limit, slot, sig) = if direct {
                let j = plan.recv_start(fwd, me) + lay.rank_slot[t0 * s.r + fwd];
                (RUN, j as usize, s.dtail(me))
            } else {
                let sent = self.seen[s.head(fwd) as usize] + self.st.sends[i].ring;
                let head = ctx.read_signal(s.head(fwd))?;
                let credits = (s.ring as u64).saturating_sub(sent.wrapping_sub(head));
                if credits == 0 {
                    break;
                }
                let at = (sent % s.ring as u64) as usize;
                let lim = (credits as usize).min(s.ring - at).min(CHUNK);
                (lim, (self.ch * s.r + me) * s.ring + at, s.tail(me))
            };
            let mut n = 1;
            while n < limit
                && t0 + n < self.st.range.end
                && goes(t0 + n)
                && lay.is_token_in_rank[(t0 + n) * s.r + fwd] == direct
            {
                n += 1;
            }
            self.stage_upto(t0 + n)?;
            let (wx, wm) = if direct {
                (RECVX, RECVM)
            } else {
                (RINGX, RINGM)
            };
            sh.put(
                self.ch,
                self.issued,
                Xfer {
                    peer: fwd,
                    dst: wx,
                    dst_off: slot * s.p,
                    src: XIN,
                    src_off: t0 * s.p,
                    len: n * s.p,
                },
                Remote::None,
            )?;
            sh.put(
                self.ch,
                self.issued,
                Xfer {
                    peer: fwd,
                    dst: wm,
                    dst_off: slot * s.mm,
                    src: MIN,
                    src_off: t0 * s.mm,
                    len: n * s.mm,
                },
                Remote::signal_add(sig, n as u64),
            )?;
            if !direct {
                self.st.sends[i].ring += n as u64;
            }
            self.st.sends[i].cursor = t0 + n;
            moved = true;
        }
        Ok(moved)
    }

    /// Writes up to `budget` of this lane's tokens into their final place at
    /// the ranks of this host that receive them; true if any.
    fn local_writes(&mut self, budget: usize) -> Result<bool, EpError> {
        let (sh, lay) = (self.sh, self.inp.lay);
        let (s, me, plan) = (&sh.s, sh.rank, sh.plan);
        let mut done = 0;
        while self.st.local_cursor < self.st.range.end && done < budget {
            let t = self.st.local_cursor;
            self.st.local_cursor += 1;
            if !lay.is_token_in_host[t * s.h + sh.host()] {
                continue;
            }
            self.stage_upto(t + 1)?;
            for dl in 0..s.l {
                let dst = sh.host() * s.l + dl;
                if !lay.is_token_in_rank[t * s.r + dst] {
                    continue;
                }
                let j = (plan.recv_start(dst, me) + lay.rank_slot[t * s.r + dst]) as usize;
                if sh.direct[dst] {
                    let payload = if sh.fp8 {
                        sh.mem.bytes(XIN, me, t * s.p, s.p)?
                    } else {
                        bf16_bytes(&self.inp.x[t * sh.hidden..(t + 1) * sh.hidden])
                    };
                    sh.mem.write(RECVX, dst, j * s.p, payload)?;
                    sh.mem
                        .write(RECVM, dst, j * s.mm, sh.mem.bytes(MIN, me, t * s.mm, s.mm)?)?;
                } else {
                    sh.put_token(self.ch, self.issued, dst, j, (XIN, t), (MIN, t))?;
                }
                self.st.delivered[dl] += 1;
            }
            done += 1;
        }
        Ok(done > 0)
    }

    /// Forwards what arrived from other hosts' sources; true if anything.
    fn forward(&mut self) -> Result<bool, EpError> {
        let sh = self.sh;
        let (s, me) = (&sh.s, sh.rank);
        let ctx = sh.dc.ctx(self.ch as u32)?;
        let mut moved = false;
        for fi in 0..self.st.froms.len() {
            let src = self.st.froms[fi].src;
            let f = &self.st.froms[fi];
            if f.direct_done < f.direct_expect {
                let base = self.seen[s.dtail(src) as usize] + f.direct_done;
                let avail = self.arrived(
                    ctx.read_signal(s.dtail(src))?,
                    base,
                    f.direct_expect - f.direct_done,
                    src,
                )?;
                for _ in 0..avail {
                    let f = &self.st.froms[fi];
                    let k = f.direct_done as u32;
                    let j = (sh.plan.recv_start(me, src)
                        + sh.plan.rank_chan_start(src, me, self.ch)
                        + k) as usize;
                    self.deliver(fi, At::Recv(j))?;
                    self.st.froms[fi].direct_done += 1;
                }
                moved |= avail > 0;
            }
            let f = &self.st.froms[fi];
            if f.ring_done < f.ring_expect {
                let base = self.seen[s.tail(src) as usize] + f.ring_done;
                let most = (f.ring_expect - f.ring_done).min(s.ring as u64);
                let avail = self.arrived(ctx.read_signal(s.tail(src))?, base, most, src)?;
                let mut put = false;
                for _ in 0..avail {
                    let seq = self.seen[s.tail(src) as usize] + self.st.froms[fi].ring_done;
                    let slot = (self.ch * s.r + src) * s.ring + (seq % s.ring as u64) as usize;
                    put |= self.deliver(fi, At::Ring(slot))?;
                    self.st.froms[fi].ring_done += 1;
                }
                if avail > 0 {
                    // Credits go back once no put reads the slots any more.
                    if put {
                        complete(sh.dc, self.ch as u32, *self.issued, sh.timeout, me)?;
                    }
                    ctx.signal(src, Remote::signal_add(s.head(me), avail))?;
                    moved = true;
                }
            }
        }
        Ok(moved)
    }

    /// Messages newly arrived on a stream: `value` less `base`, at most
    /// `most` (more is a protocol error naming `src`).
    fn arrived(&self, value: u64, base: u64, most: u64, src: usize) -> Result<u64, EpError> {
        let avail = value.wrapping_sub(base);
        if avail > most {
            return Err(EpError::Protocol {
                rank: self.sh.rank,
                peer: src,
                what: format!(
                    "stream signal {value} runs {avail} messages ahead of the {most} expected (channel {})",
                    self.ch
                ),
            });
        }
        Ok(avail)
    }

    /// Forwards one message of `froms[fi]` to the ranks of this host that
    /// receive it and records where they hold it; true if a put read it.
    fn deliver(&mut self, fi: usize, at: At) -> Result<bool, EpError> {
        let sh = self.sh;
        let (s, me, plan) = (&sh.s, sh.rank, sh.plan);
        let src = self.st.froms[fi].src;
        let (xw, mw, slot) = match at {
            At::Ring(i) => (RINGX, RINGM, i),
            At::Recv(j) => (RECVX, RECVM, j),
        };
        let meta = sh.mem.bytes(mw, me, slot * s.mm, s.mm)?;
        let word = |i: usize| {
            u32::from_le_bytes([
                meta[4 * i],
                meta[4 * i + 1],
                meta[4 * i + 2],
                meta[4 * i + 3],
            ])
        };
        let bad = |what: String| EpError::Protocol {
            rank: me,
            peer: src,
            what,
        };
        let (tok, hs) = (word(0), word(s.w_host_slot(sh.host())));
        let b = &self.st.froms[fi].block;
        if tok as usize >= s.t || hs < b.hs_start || hs - b.hs_start >= b.n {
            return Err(bad(format!(
                "token {tok} with host slot {hs}, outside channel {}'s {}..{}",
                self.ch,
                b.hs_start,
                b.hs_start + b.n
            )));
        }
        let i = (hs - b.hs_start) as usize;
        let mut put = false;
        for dl in 0..s.l {
            let dst = sh.host() * s.l + dl;
            let rs = word(s.w_rank_slot(dst));
            if rs == NONE {
                continue;
            }
            if !plan.active[dst] || rs >= plan.count(src, dst) {
                return Err(bad(format!(
                    "rank slot {rs} for rank {dst}, which expects {} tokens",
                    plan.count(src, dst)
                )));
            }
            let j = (plan.recv_start(dst, src) + rs) as usize;
            self.st.froms[fi].block.contrib[i * s.l + dl] = j as u32;
            match at {
                At::Recv(j0) if dst == me => {
                    if j != j0 {
                        return Err(bad(format!(
                            "token {tok} landed in place {j0}, its slot says {j}"
                        )));
                    }
                    continue;
                }
                At::Ring(_) if dst == me => {
                    return Err(bad(format!(
                        "token {tok} for this forwarder came through the ring"
                    )));
                }
                _ => {}
            }
            if sh.direct[dst] {
                sh.mem
                    .write(RECVX, dst, j * s.p, sh.mem.bytes(xw, me, slot * s.p, s.p)?)?;
                sh.mem.write(RECVM, dst, j * s.mm, meta)?;
            } else {
                sh.put_token(self.ch, self.issued, dst, j, (xw, slot), (mw, slot))?;
                put = true;
            }
            self.st.delivered[dl] += 1;
        }
        Ok(put)
    }

    fn sent_all(&self) -> bool {
        self.st.local_cursor == self.st.range.end
            && self
                .st
                .sends
                .iter()
                .all(|sd| sd.cursor == self.st.range.end)
            && self
                .st
                .froms
                .iter()
                .all(|f| f.ring_done == f.ring_expect && f.direct_done == f.direct_expect)
    }

    /// Tells each rank of this host how many tokens this lane delivered
    /// there, and closes the ledgers of the rings and streams.
    fn signal_delivered(&mut self) -> Result<(), EpError> {
        let sh = self.sh;
        let s = &sh.s;
        let ctx = sh.dc.ctx(self.ch as u32)?;
        for dl in 0..s.l {
            let dst = sh.host() * s.l + dl;
            if sh.plan.active[dst] {
                ctx.signal(
                    dst,
                    Remote::signal_add(s.fwd(sh.local()), self.st.delivered[dl] + 1),
                )?;
            }
        }
        for sd in &self.st.sends {
            self.seen[s.head(sd.fwd) as usize] += sd.ring;
        }
        for f in &self.st.froms {
            self.seen[s.tail(f.src) as usize] += f.ring_done;
            self.seen[s.dtail(f.src) as usize] += f.direct_done;
        }
        self.st.signalled = true;
        Ok(())
    }

    /// Collects the other forwarders' counts; checks the total once all
    /// are in.
    fn hear(&mut self) -> Result<bool, EpError> {
        let sh = self.sh;
        let (s, me) = (&sh.s, sh.rank);
        let ctx = sh.dc.ctx(self.ch as u32)?;
        let mut moved = false;
        for fl in 0..s.l {
            if self.st.heard[fl].is_some() {
                continue;
            }
            let id = s.fwd(fl) as usize;
            let v = ctx.read_signal(id as u32)?;
            if reached(v, self.seen[id].wrapping_add(1)) {
                self.st.heard[fl] = Some(v.wrapping_sub(self.seen[id]).wrapping_sub(1));
                self.seen[id] = v;
                moved = true;
            }
        }
        if moved && self.st.heard.iter().all(Option::is_some) {
            let got: u64 = self.st.heard.iter().flatten().sum::<u64>()
                + self.st.froms.iter().map(|f| f.direct_expect).sum::<u64>();
            let want: u64 = (0..s.r)
                .map(|src| u64::from(sh.plan.rank_chan(src, me, self.ch)))
                .sum();
            if got != want {
                return Err(EpError::Protocol {
                    rank: me,
                    peer: sh.host() * s.l,
                    what: format!(
                        "this host's forwarders delivered {got} tokens in channel {}, the counts say {want}",
                        self.ch
                    ),
                });
            }
        }
        Ok(moved)
    }
}

impl Lane for DispatchLane<'_> {
    fn poll(&mut self) -> Result<bool, EpError> {
        let mut moved = false;
        for i in 0..self.st.sends.len() {
            moved |= self.send_remote(i)?;
        }
        moved |= self.forward()?;
        moved |= self.local_writes(CHUNK)?;
        if !self.st.signalled && self.sent_all() {
            self.signal_delivered()?;
            moved = true;
        }
        if self.st.signalled {
            moved |= self.hear()?;
        }
        Ok(moved)
    }

    fn done(&self) -> bool {
        self.st.done()
    }

    fn waiting(&self) -> (usize, String, u32, u64) {
        let s = &self.sh.s;
        for sd in &self.st.sends {
            if sd.cursor < self.st.range.end {
                let id = s.head(sd.fwd);
                let need = self.seen[id as usize] + sd.ring + 1 - s.ring as u64;
                return (sd.fwd, "credits of its ring (head)".into(), id, need);
            }
        }
        for f in &self.st.froms {
            if f.direct_done < f.direct_expect {
                let id = s.dtail(f.src);
                return (
                    f.src,
                    "tokens into their final place here (direct tail)".into(),
                    id,
                    self.seen[id as usize] + f.direct_done + 1,
                );
            }
            if f.ring_done < f.ring_expect {
                let id = s.tail(f.src);
                return (
                    f.src,
                    "tokens into its ring here (tail)".into(),
                    id,
                    self.seen[id as usize] + f.ring_done + 1,
                );
            }
        }
        let fl = self.st.heard.iter().position(Option::is_none).unwrap_or(0);
        let id = s.fwd(fl);
        (
            self.sh.host() * s.l + fl,
            "its forwarded-token count".into(),
            id,
            self.seen[id as usize] + 1,
        )
    }

    fn ctx(&self) -> u32 {
        self.ch as u32
    }
}
