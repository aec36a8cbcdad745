//! The streaming engine under `bandwidth` and `rate`: rank 0 (and rank 1 as
//! well, bidirectionally) issues windows of puts to the other, flushing
//! after each window; the receiver is told through signals, waits for the
//! run's last one, acknowledges, and checks every slot it received. The raw
//! floor runs the same traffic pattern without gin-rs (see [`crate::floor`]).
//!
//! One run is `windows` windows; its time, taken on the sender from the
//! receiver's "ready" (ranks leave a barrier at different times) to the
//! acknowledgement (the slower rank's, bidirectionally), divided
//! by the messages moved, is one sample. Rows report the median and spread
//! over runs.

use std::time::Instant;

use anyhow::{Context, Result, bail};
use gin_core::{Comm, Ctx, Local, Remote, Window};
use serde::{Deserialize, Serialize};

use crate::floor::{self, FloorKind, ShmPair, Stream};
use crate::layout::Slots;
use crate::stats::{Row, Summary};

/// When the receiver hears about data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Completion {
    /// The last put of each window carries a signal (bandwidth).
    PerWindow,
    /// Every put carries a signal (put + signal rate).
    PerMessage,
    /// Plain puts; one signal after the run's last flush (put rate).
    AtEnd,
}

impl Completion {
    /// Signals a receiver counts in a run of `windows` windows of `window`.
    pub fn signals(self, window: usize, windows: usize) -> u64 {
        match self {
            Completion::PerWindow => windows as u64,
            Completion::PerMessage => (window * windows) as u64,
            Completion::AtEnd => 1,
        }
    }
}

/// One measured point of a stream.
#[derive(Debug, Clone, Copy)]
pub struct Point {
    pub size: u64,
    pub window: usize,
    pub windows: usize,
    pub bidir: bool,
    pub completion: Completion,
    pub warmup_windows: usize,
    pub runs: usize,
    /// Bytes the slots of one direction may span (the buffer cap; slots
    /// are reused round-robin within it): [`crate::layout::STREAM_BUFFER`]
    /// unless `bandwidth --footprint` says otherwise.
    pub footprint: u64,
}

impl Point {
    fn stream(&self, windows: usize) -> Stream {
        Stream {
            size: self.size,
            window: self.window,
            windows,
            slots: Slots::new(self.size, self.window, self.footprint),
            bidir: self.bidir,
            completion: self.completion,
        }
    }
}

/// Rank 0's view of one point.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PointResult {
    pub bytes: u64,
    pub window: usize,
    pub bidir: bool,
    pub completion: Completion,
    /// Messages per run (both directions together when bidirectional).
    pub messages: usize,
    /// Per message: µs over runs, GB/s, the floor and the ratio.
    pub row: Row,
    /// Issue-side cost per put (µs): time inside the put calls of a window,
    /// without the flush; measured for windows of 8 and more, where reading
    /// the clock twice per window costs under a few ns per put.
    pub issue_us: Option<Summary>,
    pub issue_runs: Vec<f64>,
}

/// What a rank holds for streaming: its windows, its context, the floor.
pub struct Engine<'a> {
    pub comm: &'a Comm,
    pub ctx: Ctx<'a>,
    pub src: &'a Window,
    pub dst: &'a Window,
    pub floor: FloorKind,
    pub shm: Option<ShmPair>,
    pub tcp: Option<floor::TcpPair>,
    /// `ucx_perftest` for the ucx path's floor.
    pub ucx: Option<crate::ucxfloor::UcxPerf>,
    /// Cumulative signal targets (signals only ever grow).
    data_seen: u64,
    ack_seen: u64,
    ready_seen: u64,
    seq: u64,
}

impl std::fmt::Debug for Engine<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("rank", &self.comm.rank())
            .field("floor", &self.floor)
            .finish_non_exhaustive()
    }
}

/// Seeds the byte pattern of one run from one sender.
fn seed(seq: u64, sender: usize) -> u64 {
    (seq << 8) ^ sender as u64 ^ 0x5eed
}

impl<'a> Engine<'a> {
    /// Collective: sets up the floor matching rank 0's path to rank 1.
    pub fn new(
        comm: &'a Comm,
        ctx: Ctx<'a>,
        src: &'a Window,
        dst: &'a Window,
        path: &str,
    ) -> Result<Self> {
        let floor = FloorKind::for_path(path);
        let (shm, tcp, ucx) = match floor {
            FloorKind::Shm => (ShmPair::new(comm, src.local_size() as usize)?, None, None),
            FloorKind::Tcp => (None, floor::tcp_pair(comm)?, None),
            FloorKind::Ucx => (None, None, Some(crate::ucxfloor::setup(comm)?)),
        };
        Ok(Self {
            comm,
            ctx,
            src,
            dst,
            floor,
            shm,
            tcp,
            ucx,
            data_seen: 0,
            ack_seen: 0,
            ready_seen: 0,
            seq: 0,
        })
    }

    /// One gin-rs run on this rank: returns (elapsed µs, µs spent issuing).
    fn gin_run(&mut self, st: &Stream, check: bool) -> Result<(f64, f64)> {
        let r = self.comm.rank();
        let peer = 1 - r;
        self.seq += 1;
        let bytes = st.slots.bytes() as usize;
        if st.sends(r) {
            let pat = gin_bootstrap::selftest::pattern(seed(self.seq, r), bytes);
            self.src.write(0, &pat)?;
        }
        self.comm.bootstrap().barrier()?;
        let ctx = &self.ctx;
        // Ranks leave the barrier tens of µs apart: a receiver says it is
        // ready, and the sender's clock starts when it hears so.
        if st.receives(r) {
            ctx.signal(peer, Remote::signal_inc(2))?;
            ctx.flush()?;
        }
        if st.sends(r) {
            self.ready_seen += 1;
            ctx.wait_signal(2, self.ready_seen)?;
        }
        let mut issue = 0.0;
        let timed_issue = st.window >= 8;
        let t = Instant::now();
        if st.sends(r) {
            for k in 0..st.windows {
                let ti = timed_issue.then(Instant::now);
                for j in 0..st.window {
                    let off = st.slots.offset(k * st.window + j);
                    let remote = match st.completion {
                        Completion::PerMessage => Remote::signal_inc(0),
                        Completion::PerWindow if j + 1 == st.window => Remote::signal_inc(0),
                        _ => Remote::None,
                    };
                    ctx.put(
                        peer,
                        self.dst,
                        off,
                        self.src,
                        off,
                        st.size,
                        remote,
                        Local::None,
                    )?;
                }
                if let Some(ti) = ti {
                    issue += ti.elapsed().as_secs_f64() * 1e6;
                }
                ctx.flush()?;
            }
            if st.completion == Completion::AtEnd {
                ctx.signal(peer, Remote::signal_inc(0))?;
                ctx.flush()?;
            }
        }
        if st.receives(r) {
            self.data_seen += st.signals();
            ctx.wait_signal(0, self.data_seen)?;
            ctx.signal(peer, Remote::signal_inc(1))?;
            ctx.flush()?;
        }
        if st.sends(r) {
            self.ack_seen += 1;
            ctx.wait_signal(1, self.ack_seen)?;
        }
        let elapsed = t.elapsed().as_secs_f64() * 1e6;
        if check && st.receives(r) {
            let want = gin_bootstrap::selftest::pattern(seed(self.seq, peer), bytes);
            for slot in 0..st.slots.written(st.messages()) {
                let off = slot as u64 * st.size;
                let got = self.dst.read_vec(off, st.size as usize)?;
                if got[..] != want[off as usize..(off + st.size) as usize] {
                    bail!(
                        "rank {r}: slot {slot} ({} bytes at offset {off}) from rank {peer} is wrong \
                         after a run of {} messages",
                        st.size,
                        st.messages()
                    );
                }
            }
        }
        Ok((elapsed, if timed_issue { issue } else { f64::NAN }))
    }

    /// One floor run on this rank: elapsed µs. The TCP floor runs the
    /// stream blocking and polling and keeps the faster.
    fn floor_run(&mut self, st: &Stream, src: &[u8]) -> Result<f64> {
        let r = self.comm.rank();
        if let Some(pair) = &self.shm {
            floor::reset_incoming(pair);
        }
        if let Some(perf) = &self.ucx {
            return ucx_stream(perf, self.comm, st);
        }
        self.comm.bootstrap().barrier()?;
        match (&self.shm, &mut self.tcp) {
            (Some(pair), _) => floor::shm_stream(pair, self.comm, st, src),
            (None, Some(s)) => {
                let mut best = f64::INFINITY;
                for wait in floor::TcpWait::BOTH {
                    self.comm.bootstrap().barrier()?;
                    best = best.min(floor::tcp_stream(s, r, st, src, self.comm.timeout(), wait)?);
                }
                Ok(best)
            }
            (None, None) => bail!("rank {r}: no floor connection"),
        }
    }

    /// Measures one point on every rank (ranks past 1 only join the
    /// collectives); rank 0 returns the result.
    pub fn measure(&mut self, p: &Point, mut tick: impl FnMut()) -> Result<Option<PointResult>> {
        let r = self.comm.rank();
        let plays = r <= 1;
        let st = p.stream(p.windows);
        let warm = p.stream(p.warmup_windows.max(1));
        let mut times = Vec::with_capacity(p.runs);
        let mut issue = Vec::with_capacity(p.runs);
        if plays {
            self.gin_run(&warm, true)?;
        } else {
            self.comm.bootstrap().barrier()?;
        }
        for _ in 0..p.runs {
            let mine = if plays {
                self.gin_run(&st, true)?
            } else {
                self.comm.bootstrap().barrier()?;
                (0.0, f64::NAN)
            };
            let all = self
                .comm
                .bootstrap()
                .allgather(&[mine.0.to_le_bytes(), mine.1.to_le_bytes()].concat())?;
            times.push(run_time(&all, p.bidir)?);
            issue.push(crate::ranks::f64_le(&all[0][8..16])?);
            tick();
        }
        let src = gin_bootstrap::selftest::pattern(seed(0, r), st.slots.bytes() as usize);
        let mut floors = Vec::with_capacity(p.runs);
        if plays {
            self.floor_run(&warm, &src)?;
        } else {
            self.comm.bootstrap().barrier()?;
        }
        for _ in 0..p.runs {
            let mine = if plays {
                self.floor_run(&st, &src)?
            } else {
                self.comm.bootstrap().barrier()?;
                0.0
            };
            let all = self
                .comm
                .bootstrap()
                .allgather(&[mine.to_le_bytes(), 0f64.to_le_bytes()].concat())?;
            floors.push(run_time(&all, p.bidir)?);
        }
        if r != 0 {
            return Ok(None);
        }
        let messages = st.messages() * if p.bidir { 2 } else { 1 };
        let per = |v: Vec<f64>| {
            v.into_iter()
                .map(|t| t / messages as f64)
                .collect::<Vec<_>>()
        };
        let issue_runs: Vec<f64> = issue
            .into_iter()
            .filter(|v| !v.is_nan())
            .map(|v| v / st.messages() as f64)
            .collect();
        Ok(Some(PointResult {
            bytes: p.size,
            window: p.window,
            bidir: p.bidir,
            completion: p.completion,
            messages,
            row: Row::new(p.size as f64, per(times), per(floors)).context("no samples")?,
            issue_us: Summary::of(&issue_runs),
            issue_runs,
        }))
    }
}

/// A run's time from every rank's (elapsed, issue) pair: rank 0's for a
/// one-way stream (it waited for the acknowledgement), the slower of ranks
/// 0 and 1 bidirectionally.
fn run_time(all: &[Vec<u8>], bidir: bool) -> Result<f64> {
    let t0 = crate::ranks::f64_le(all.first().map_or(&[][..], |b| &b[..8.min(b.len())]))?;
    if !bidir {
        return Ok(t0);
    }
    let t1 = crate::ranks::f64_le(all.get(1).map_or(&[][..], |b| &b[..8.min(b.len())]))?;
    Ok(t0.max(t1))
}

/// Rank 0's result of a whole streaming job.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StreamResult {
    pub ranks: usize,
    pub backend: String,
    pub path: String,
    pub floor: String,
    pub points: Vec<PointResult>,
    /// Peak resident memory of each rank (VmHWM), KiB.
    pub peak_kib: Vec<u64>,
}

/// A rank of `bandwidth` or `rate`: measures every point in order.
pub fn rank_main(common: &crate::common::Common, points: &[Point]) -> Result<()> {
    let comm = Comm::from_env()?;
    let r = comm.rank();
    let buf = points
        .iter()
        .map(|p| Slots::new(p.size, p.window, p.footprint).bytes())
        .max()
        .unwrap_or(8);
    let src = comm.alloc_window(buf)?;
    let dst = comm.alloc_window(buf)?;
    let max_window = points.iter().map(|p| p.window).max().unwrap_or(1);
    let req = gin_core::DevCommRequirements {
        // Room for a whole window in flight on every path.
        queue_depth: (max_window as u32).next_power_of_two().max(256),
        ..Default::default()
    };
    let dc = comm.dev_comm(&req)?;
    let ctx = dc.ctx(0)?;
    let path = crate::ranks::path_to_rank1(&comm)?;
    crate::common::bind_rank_thread(common, comm.local_rank())?;
    let backend = crate::ranks::backend_label(&dc);
    let mut engine = Engine::new(&comm, ctx, &src, &dst, &path)?;
    let mut results = Vec::new();
    for p in points {
        if let Some(res) = engine.measure(p, || crate::progress::tick(r))? {
            results.push(res);
        }
    }
    let floor = match engine.floor {
        FloorKind::Shm => "raw shared-memory copy + flag, same traffic",
        FloorKind::Tcp => {
            "raw TCP stream, one write per message, same traffic, the faster of polling and blocking"
        }
        FloorKind::Ucx => {
            "ucx_perftest ucp_put_bw, same size, -O = window (sliding), same library and UCX_TLS, \
             one buffer, sender-timed, plain puts; bi: the one-way time"
        }
    };
    drop(engine);
    let peaks = comm
        .bootstrap()
        .allgather(&crate::ranks::peak_kib().to_le_bytes())?;
    if r == 0 {
        crate::ranks::emit(&StreamResult {
            ranks: comm.nranks(),
            backend,
            path,
            floor: floor.to_owned(),
            points: results,
            peak_kib: peaks
                .iter()
                .map(|p| u64::from_le_bytes(p.as_slice().try_into().unwrap_or([0; 8])))
                .collect(),
        })?;
    }
    comm.bootstrap().barrier()?;
    dc.destroy()?;
    Ok(())
}

/// One ucx floor run on rank 0 or 1 (the caller's only collective is the
/// run's allgather here, as the other floors' barrier): the server beside
/// rank 1 listens before it, the client beside rank 0 runs `ucp_put_bw`
/// after it with `-O` = the window. Rank 0 returns the run's µs (per put
/// times the messages of one direction); rank 1 returns 0, so a
/// bidirectional run's floor is the one-way time ([`crate::ucxfloor`] says
/// why that bounds it).
fn ucx_stream(perf: &crate::ucxfloor::UcxPerf, comm: &Comm, st: &Stream) -> Result<f64> {
    let n = st.messages();
    let test = crate::ucxfloor::Test::PutBw {
        outstanding: st.window,
    };
    let us = perf.run(comm, test, st.size, ((n / 10).max(st.window), n))?;
    Ok(if comm.rank() == 0 { us * n as f64 } else { 0.0 })
}
