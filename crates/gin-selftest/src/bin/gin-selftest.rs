//! Checks the device API across the ranks of a job, byte for byte. Run it as
//! every rank (`cargo xtask launch -n 4 -- gin-selftest all`) or let it spawn
//! its own ranks (`gin-selftest all --ranks 4`). The multi-process tests run
//! it under every backend and transport.
//!
//! Scenarios: `all` (every functional check), `ring`, `alltoall`, `order`,
//! `counters`, `flush`, `get`, `reset`, `va`, `barrier`, `badinput`, `reuse`,
//! `dereg` (large puts in flight at deregistration; tcp-only parts need GIN_TRANSPORT=tcp),
//! `die VICTIM` (VICTIM crashes while the others wait on it; they must fail
//! with an error naming it), `stop VICTIM` (VICTIM stops itself, as a frozen
//! host, while the others stream 1 MiB puts at it over tcp; they must fail
//! within about the timeout naming it, and tear down in bounded time),
//! `stop-bystander VICTIM [wait]` (VICTIM stops itself while one witness
//! streams at it, or waits on it, and the other ranks wait on the witness:
//! they must fail naming VICTIM, not the witness that left because of it). A
//! failed check prints `FAILED: ...` and exits 3. `killreg` (rank 1 dies,
//! without running a destructor, right after creating its segment of a
//! window the others are registering: they must fail and leave nothing in
//! `GIN_SHM_DIR`). `refused` (a put with a signal to a window its owner
//! dropped: the initiator's flush reports the refusal naming window, offset
//! and rank, and the signal is never applied). `leave VICTIM` (VICTIM returns
//! from main, a clean exit, while the others wait on it; they must fail
//! within seconds naming it as exited), `signal-leave VICTIM` (VICTIM signals
//! everyone, flushes and exits at once; the others' waits it satisfied must
//! succeed).

#![allow(clippy::many_single_char_names)] // c, r, n, w: comm, rank, nranks, window, as in the docs

use std::process::ExitCode;
use std::time::{Duration, Instant};

use gin_core::launch::{Role, run_ranks};
use gin_core::{
    Comm, CounterId, DevCommRequirements, Fence, GinError, Local, Order, Remote, SignalOp, Team,
};

type R = Result<(), String>;

fn main() -> ExitCode {
    gin_bootstrap::init_tracing_from_env();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = args.first().cloned().unwrap_or_else(|| "all".into());
    let n = args
        .iter()
        .position(|a| a == "--ranks")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    match run_ranks(n) {
        Ok(Role::Launched) => return ExitCode::SUCCESS,
        Ok(Role::Rank) => {}
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    }
    let t = Instant::now();
    let comm = match Comm::from_env() {
        Ok(c) => c,
        Err(e) => {
            println!("FAILED: {e}");
            return ExitCode::from(3);
        }
    };
    let r = match mode.as_str() {
        "all" => all(&comm),
        "ring" => ring(&comm),
        "alltoall" => alltoall(&comm),
        "order" => order(&comm),
        "counters" => counters(&comm),
        "flush" => flush(&comm),
        "get" => get(&comm),
        "reset" => reset(&comm),
        "va" => va(&comm),
        "barrier" => barrier(&comm),
        "badinput" => badinput(&comm),
        "reuse" => reuse(&comm),
        "dereg" => dereg(&comm),
        "requirements" => requirements(&comm),
        "dropped" => dropped(&comm),
        "die" => die(&comm, args.get(1).and_then(|v| v.parse().ok()).unwrap_or(1)),
        "leave" => leave(&comm, args.get(1).and_then(|v| v.parse().ok()).unwrap_or(1)),
        "signal-leave" => {
            signal_leave(&comm, args.get(1).and_then(|v| v.parse().ok()).unwrap_or(1))
        }
        "echo" => echo(&comm),
        "killreg" => killreg(&comm),
        "refused" => refused(&comm),
        "stop" => stop(&comm, args.get(1).and_then(|v| v.parse().ok()).unwrap_or(1)),
        "stop-bystander" => stop_bystander(
            &comm,
            args.get(1).and_then(|v| v.parse().ok()).unwrap_or(1),
            args.get(2).is_some_and(|v| v == "wait"),
        ),
        other => Err(format!("unknown scenario {other:?}")),
    };
    match r {
        Ok(()) => {
            println!(
                "rank {} of {}: {mode} ok in {:.2}s (paths {:?})",
                comm.rank(),
                comm.nranks(),
                t.elapsed().as_secs_f64(),
                comm.path_names()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("FAILED: {e}");
            ExitCode::from(3)
        }
    }
}

fn s<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

fn all(c: &Comm) -> R {
    for (name, f) in [
        ("ring", ring as fn(&Comm) -> R),
        ("alltoall", alltoall),
        ("order", order),
        ("counters", counters),
        ("flush", flush),
        ("get", get),
        ("reset", reset),
        ("va", va),
        ("barrier", barrier),
        ("badinput", badinput),
        ("reuse", reuse),
    ] {
        f(c).map_err(|e| format!("{name}: {e}"))?;
    }
    Ok(())
}

use gin_bootstrap::selftest::pattern;

/// The paper's ring exchange: a block travels around the ring, each rank
/// forwarding what it received, until every rank has seen every block.
fn ring(c: &Comm) -> R {
    let (r, n) = (c.rank(), c.nranks());
    let bytes = 1000u64;
    let buf = c.alloc_window(bytes * n as u64).map_err(s)?;
    let dc = c.dev_comm(&DevCommRequirements::default()).map_err(s)?;
    let ctx = dc.ctx(0).map_err(s)?;
    let next = (r + 1) % n;
    buf.write(r as u64 * bytes, &pattern(r as u64, bytes as usize))
        .map_err(s)?;
    for step in 0..n.saturating_sub(1) {
        let block = ((r + n - step) % n) as u64;
        ctx.put(
            next,
            &buf,
            block * bytes,
            &buf,
            block * bytes,
            bytes,
            Remote::signal_inc(1),
            Local::None,
        )
        .map_err(s)?;
        ctx.wait_signal(1, step as u64 + 1).map_err(s)?;
    }
    ctx.flush().map_err(s)?;
    for p in 0..n {
        if buf.read_vec(p as u64 * bytes, bytes as usize).map_err(s)?
            != pattern(p as u64, bytes as usize)
        {
            return Err(format!(
                "rank {r}: block of rank {p} is wrong after the ring"
            ));
        }
    }
    dc.destroy().map_err(s)
}

fn alltoall(c: &Comm) -> R {
    let (r, n) = (c.rank(), c.nranks());
    let bytes = 2048u64;
    let send = c.alloc_window(bytes * n as u64).map_err(s)?;
    let recv = c.alloc_window(bytes * n as u64).map_err(s)?;
    for p in 0..n {
        send.write(
            p as u64 * bytes,
            &pattern((r * 1000 + p) as u64, bytes as usize),
        )
        .map_err(s)?;
    }
    let dc = c.dev_comm(&DevCommRequirements::default()).map_err(s)?;
    let ctx = dc.ctx(0).map_err(s)?;
    dc.barrier(Team::World, 0)
        .map_err(s)?
        .sync(0, Fence::None)
        .map_err(s)?;
    for k in 0..n {
        let p = (r + k) % n;
        ctx.put(
            p,
            &recv,
            r as u64 * bytes,
            &send,
            p as u64 * bytes,
            bytes,
            Remote::signal_inc(0),
            Local::None,
        )
        .map_err(s)?;
    }
    ctx.wait_signal(0, n as u64).map_err(s)?;
    ctx.flush().map_err(s)?;
    for p in 0..n {
        if recv.read_vec(p as u64 * bytes, bytes as usize).map_err(s)?
            != pattern((p * 1000 + r) as u64, bytes as usize)
        {
            return Err(format!("rank {r}: block from rank {p} is wrong"));
        }
    }
    dc.destroy().map_err(s)
}

/// Ordering under randomized stress: on each of two contexts (one thread
/// each), a rank sends bursts of unsignalled puts of random sizes to its
/// successor, then one strong signal; when the successor sees the signal,
/// every byte of the burst must be there. Weak signals cover their own put.
fn order(c: &Comm) -> R {
    let (r, n) = (c.rank(), c.nranks());
    let slots = 32u64;
    let max = 3000u64;
    let nctx = 2u32;
    let rounds = 12u64;
    let src = c.alloc_window(slots * max * u64::from(nctx)).map_err(s)?;
    let dst = c.alloc_window(slots * max * u64::from(nctx)).map_err(s)?;
    let dc = c
        .dev_comm(&DevCommRequirements {
            contexts: nctx,
            ..DevCommRequirements::default()
        })
        .map_err(s)?;
    let next = (r + 1) % n;
    let prev = (r + n - 1) % n;
    let size_of = |sender: usize, ctx: u32, round: u64, i: u64| {
        1 + (u64::from(
            pattern(
                sender as u64 * 7919 + u64::from(ctx) * 31 + round * 1009 + i,
                2,
            )[0],
        ) * 11)
            % max
    };
    let fill = |sender: usize, ctx: u32, round: u64, i: u64| {
        pattern(
            (sender as u64) << 40 | u64::from(ctx) << 32 | round << 16 | i,
            size_of(sender, ctx, round, i) as usize,
        )
    };
    let dc_ref = &*dc;
    let results: Vec<R> = std::thread::scope(|scope| {
        let hs: Vec<_> = (0..nctx)
            .map(|ci| {
                let (src, dst) = (&src, &dst);
                scope.spawn(move || -> R {
                    let ctx = dc_ref.ctx(ci).map_err(s)?;
                    let base = u64::from(ci) * slots * max;
                    for round in 0..rounds {
                        // Send a burst; the sender's source is reused each round,
                        // so flush before rewriting it.
                        ctx.flush().map_err(s)?;
                        for i in 0..slots {
                            let data = fill(r, ci, round, i);
                            src.write(base + i * max, &data).map_err(s)?;
                            ctx.put(next, dst, base + i * max, src, base + i * max, data.len() as u64, Remote::None, Local::None)
                                .map_err(s)?;
                        }
                        let order = if round % 2 == 0 { Order::Strong } else { Order::Weak };
                        // Weak signals ride on the last put only: give it its own payload.
                        let remote = Remote::Signal { id: gin_core::SignalId(2), op: SignalOp::Inc, order };
                        ctx.put_value(next, dst, base + slots * max - 8, round, remote).map_err(s)?;
                        ctx.wait_signal(2, round + 1).map_err(s)?;
                        let v = dst.read_vec(base + slots * max - 8, 8).map_err(s)?;
                        if u64::from_le_bytes(v.try_into().expect("8 bytes")) != round {
                            return Err(format!("ctx {ci} round {round}: the signal's own put is not visible"));
                        }
                        if order == Order::Strong {
                            for i in 0..slots {
                                let want = fill(prev, ci, round, i);
                                let got = dst.read_vec(base + i * max, want.len()).map_err(s)?;
                                if got != want {
                                    return Err(format!(
                                        "ctx {ci} round {round}: put {i} from rank {prev} not visible after a strong signal"
                                    ));
                                }
                            }
                        }
                        // Both sides done with this round before the next overwrites.
                        dc_ref.barrier(Team::World, 0).map_err(s)?.sync(ci, Fence::None).map_err(s)?;
                    }
                    Ok(())
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("thread panicked".into())))
            .collect()
    });
    for r in results {
        r?;
    }
    dc.destroy().map_err(s)
}

fn counters(c: &Comm) -> R {
    let (r, n) = (c.rank(), c.nranks());
    let w = c.alloc_window(64 * n as u64).map_err(s)?;
    let dc = c.dev_comm(&DevCommRequirements::default()).map_err(s)?;
    let ctx = dc.ctx(0).map_err(s)?;
    for round in 1..=3u64 {
        for p in 0..n {
            ctx.put(
                p,
                &w,
                r as u64 * 64,
                &w,
                p as u64 * 64,
                64,
                Remote::None,
                Local::CounterInc(CounterId(3)),
            )
            .map_err(s)?;
        }
        let seen = ctx.wait_counter(3, round * n as u64).map_err(s)?;
        if seen != round * n as u64 {
            return Err(format!(
                "counter 3 is {seen}, expected {}",
                round * n as u64
            ));
        }
    }
    ctx.flush().map_err(s)?;
    ctx.reset_counter(3).map_err(s)?;
    if ctx.read_counter(3).map_err(s)? != 0 {
        return Err("reset_counter did not reset".into());
    }
    dc.barrier(Team::World, 0)
        .map_err(s)?
        .sync(0, Fence::Context)
        .map_err(s)?;
    dc.destroy().map_err(s)
}

/// After flush the source may be reused: overwriting it must not change
/// what the peer receives.
fn flush(c: &Comm) -> R {
    let (r, n) = (c.rank(), c.nranks());
    let bytes = 64 * 1024u64;
    let src = c.alloc_window(bytes).map_err(s)?;
    let dst = c.alloc_window(bytes).map_err(s)?;
    let dc = c.dev_comm(&DevCommRequirements::default()).map_err(s)?;
    let ctx = dc.ctx(0).map_err(s)?;
    let next = (r + 1) % n;
    src.write(0, &pattern(r as u64 + 77, bytes as usize))
        .map_err(s)?;
    ctx.put(
        next,
        &dst,
        0,
        &src,
        0,
        bytes,
        Remote::signal_inc(4),
        Local::None,
    )
    .map_err(s)?;
    let t = ctx.flush_async(next).map_err(s)?;
    ctx.wait(&t).map_err(s)?;
    src.write(0, &vec![0xEE; bytes as usize]).map_err(s)?;
    ctx.wait_signal(4, 1).map_err(s)?;
    let prev = (r + n - 1) % n;
    if dst.read_vec(0, bytes as usize).map_err(s)? != pattern(prev as u64 + 77, bytes as usize) {
        return Err("data changed after the source was reused past a flush".into());
    }
    ctx.flush().map_err(s)?;
    dc.barrier(Team::World, 0)
        .map_err(s)?
        .sync(0, Fence::None)
        .map_err(s)?;
    dc.destroy().map_err(s)
}

fn get(c: &Comm) -> R {
    let (r, n) = (c.rank(), c.nranks());
    let bytes = 10_000u64;
    let w = c.alloc_window(bytes).map_err(s)?;
    let local = c.alloc_window(bytes * n as u64).map_err(s)?;
    w.write(0, &pattern(r as u64 + 5, bytes as usize))
        .map_err(s)?;
    let dc = c.dev_comm(&DevCommRequirements::default()).map_err(s)?;
    let ctx = dc.ctx(0).map_err(s)?;
    dc.barrier(Team::World, 0)
        .map_err(s)?
        .sync(0, Fence::None)
        .map_err(s)?;
    for p in 0..n {
        ctx.get(p, &w, 0, &local, p as u64 * bytes, bytes)
            .map_err(s)?;
    }
    ctx.flush().map_err(s)?;
    for p in 0..n {
        if local
            .read_vec(p as u64 * bytes, bytes as usize)
            .map_err(s)?
            != pattern(p as u64 + 5, bytes as usize)
        {
            return Err(format!("get from rank {p} returned wrong bytes"));
        }
    }
    dc.barrier(Team::World, 0)
        .map_err(s)?
        .sync(0, Fence::None)
        .map_err(s)?;
    dc.destroy().map_err(s)
}

fn reset(c: &Comm) -> R {
    let n = c.nranks();
    let dc = c.dev_comm(&DevCommRequirements::default()).map_err(s)?;
    let ctx = dc.ctx(0).map_err(s)?;
    let bar = dc.barrier(Team::World, 0).map_err(s)?;
    for round in 0..3 {
        for p in 0..n {
            ctx.signal(p, Remote::signal_add(5, 10)).map_err(s)?;
        }
        ctx.wait_signal(5, 10 * n as u64).map_err(s)?;
        // Everyone has seen all of this round's signals before anyone resets.
        bar.sync(0, Fence::None).map_err(s)?;
        ctx.reset_signal(5).map_err(s)?;
        if ctx.read_signal(5).map_err(s)? != 0 {
            return Err(format!("round {round}: reset_signal did not reset"));
        }
        bar.sync(0, Fence::None).map_err(s)?;
    }
    dc.destroy().map_err(s)
}

/// Signals addressed by (window, offset).
fn va(c: &Comm) -> R {
    let (r, n) = (c.rank(), c.nranks());
    let flags = c.alloc_window(8 * n as u64).map_err(s)?;
    let data = c.alloc_window(256).map_err(s)?;
    let dc = c.dev_comm(&DevCommRequirements::default()).map_err(s)?;
    let ctx = dc.ctx(0).map_err(s)?;
    data.write(0, &pattern(r as u64 + 9, 256)).map_err(s)?;
    let next = (r + 1) % n;
    let remote = Remote::VaSignal {
        window: &flags,
        offset: 8 * r as u64,
        op: SignalOp::Add(7),
        order: Order::Strong,
    };
    ctx.put(next, &data, 0, &data, 0, 0, remote, Local::None)
        .map_err(s)?;
    let prev = (r + n - 1) % n;
    let seen = ctx.wait_va_signal(&flags, 8 * prev as u64, 7).map_err(s)?;
    if seen != 7 {
        return Err(format!("VA signal reads {seen}, expected 7"));
    }
    ctx.flush().map_err(s)?;
    dc.barrier(Team::World, 0)
        .map_err(s)?
        .sync(0, Fence::None)
        .map_err(s)?;
    dc.destroy().map_err(s)
}

/// Barriers with a fence make unsignalled puts visible.
fn barrier(c: &Comm) -> R {
    let (r, n) = (c.rank(), c.nranks());
    let w = c.alloc_window(128 * n as u64).map_err(s)?;
    let dc = c
        .dev_comm(&DevCommRequirements {
            world_barriers: 2,
            rail_barriers: 1,
            contexts: 2,
            ..DevCommRequirements::default()
        })
        .map_err(s)?;
    for round in 0..4u64 {
        let ci = (round % 2) as u32;
        let ctx = dc.ctx(ci).map_err(s)?;
        let mine = pattern(round * 100 + r as u64, 128);
        for p in 0..n {
            ctx.put_value(p, &w, r as u64 * 128, round, Remote::None)
                .map_err(s)?;
            let _ = &mine;
        }
        dc.barrier(Team::World, 1)
            .map_err(s)?
            .sync(ci, Fence::Context)
            .map_err(s)?;
        for p in 0..n {
            let v = u64::from_le_bytes(
                w.read_vec(p as u64 * 128, 8)
                    .map_err(s)?
                    .try_into()
                    .expect("8 bytes"),
            );
            if v != round {
                return Err(format!(
                    "round {round}: value from rank {p} is {v} after a fenced barrier"
                ));
            }
        }
        dc.barrier(Team::World, 1)
            .map_err(s)?
            .sync(ci, Fence::None)
            .map_err(s)?;
    }
    let rail = dc.barrier(Team::Rail, 0).map_err(s)?;
    rail.sync(0, Fence::AllContexts).map_err(s)?;
    if !rail.members().contains(&r) {
        return Err("a rank is not in its own rail".into());
    }
    dc.destroy().map_err(s)
}

fn expect_err(what: &str, r: Result<(), GinError>, needle: &str) -> R {
    match r {
        Ok(()) => Err(format!(
            "{what}: accepted, expected an error containing {needle:?}"
        )),
        Err(e) if e.to_string().contains(needle) => Ok(()),
        Err(e) => Err(format!("{what}: error {e:?} does not mention {needle:?}")),
    }
}

/// Bad input is an error before anything moves, and the memory around
/// windows (canaries) stays untouched.
// A flat list of cases, one check each: longer than the library limit,
// clearer than split in parts.
#[allow(clippy::too_many_lines)]
fn badinput(c: &Comm) -> R {
    let (r, n) = (c.rank(), c.nranks());
    // Sizes differ per rank: rank p has 64 + 8p bytes.
    let size = |p: usize| 64 + 8 * p as u64;
    let w = c.alloc_window(size(r)).map_err(s)?;
    let canary = c.alloc_window(64).map_err(s)?;
    w.write(0, &vec![0xAB; size(r) as usize]).map_err(s)?;
    canary.write(0, &[0xCD; 64]).map_err(s)?;
    let src = c.alloc_window(4096).map_err(s)?;
    let dc = c.dev_comm(&DevCommRequirements::default()).map_err(s)?;
    let ctx = dc.ctx(0).map_err(s)?;
    let next = (r + 1) % n;
    let ns = size(next);
    dc.barrier(Team::World, 0)
        .map_err(s)?
        .sync(0, Fence::None)
        .map_err(s)?;
    expect_err(
        "offset past the peer's window",
        ctx.put(next, &w, ns - 4, &src, 0, 8, Remote::None, Local::None),
        "do not fit in window",
    )?;
    expect_err(
        "offset at the end",
        ctx.put(next, &w, ns, &src, 0, 1, Remote::None, Local::None),
        &format!("window {} of rank {next} ({ns} bytes)", w.id()),
    )?;
    expect_err(
        "offset overflow",
        ctx.put(
            next,
            &w,
            u64::MAX - 3,
            &src,
            0,
            8,
            Remote::None,
            Local::None,
        ),
        "do not fit",
    )?;
    expect_err(
        "bytes larger than the window",
        ctx.put(next, &w, 0, &src, 0, 4096, Remote::None, Local::None),
        "do not fit",
    )?;
    expect_err(
        "source past its window",
        ctx.put(next, &w, 0, &src, 4090, 8, Remote::None, Local::None),
        "put source",
    )?;
    expect_err(
        "unknown signal",
        ctx.put(
            next,
            &w,
            0,
            &src,
            0,
            8,
            Remote::signal_inc(999),
            Local::None,
        ),
        "unknown signal id 999",
    )?;
    expect_err(
        "unknown counter",
        ctx.put(
            next,
            &w,
            0,
            &src,
            0,
            8,
            Remote::None,
            Local::CounterInc(CounterId(500)),
        ),
        "unknown counter id 500",
    )?;
    expect_err(
        "peer out of range",
        ctx.put(n + 3, &w, 0, &src, 0, 8, Remote::None, Local::None),
        &format!("peer {} does not exist", n + 3),
    )?;
    expect_err(
        "context out of range",
        dc.ctx(9).map(drop),
        "context 9 does not exist",
    )?;
    expect_err(
        "wait on unknown signal",
        ctx.wait_signal(77, 1).map(drop),
        "unknown signal id 77",
    )?;
    let misaligned = Remote::VaSignal {
        window: &w,
        offset: 4,
        op: SignalOp::Inc,
        order: Order::Strong,
    };
    expect_err(
        "misaligned VA signal",
        ctx.signal(next, misaligned),
        "aligned",
    )?;
    expect_err(
        "get past the peer's window",
        ctx.get(next, &w, ns, &src, 0, 1),
        "get source",
    )?;
    expect_err(
        "timeout names what it waited for",
        ctx.wait_signal_for(6, 1, Duration::from_millis(50))
            .map(drop),
        "signal 6 on context 0: last value 0, expected 1",
    )?;
    // Abort flag.
    let flag = dc.abort_flag();
    flag.store(1, std::sync::atomic::Ordering::Relaxed);
    expect_err("abort flag", ctx.wait_signal(6, 1).map(drop), "aborted")?;
    flag.store(0, std::sync::atomic::Ordering::Relaxed);
    ctx.flush().map_err(s)?;
    dc.barrier(Team::World, 0)
        .map_err(s)?
        .sync(0, Fence::Context)
        .map_err(s)?;
    // Nothing moved: every window still holds its canary.
    if w.read_vec(0, size(r) as usize)
        .map_err(s)?
        .iter()
        .any(|&b| b != 0xAB)
    {
        return Err("a refused put changed the target window".into());
    }
    if canary
        .read_vec(0, 64)
        .map_err(s)?
        .iter()
        .any(|&b| b != 0xCD)
    {
        return Err("a refused put changed a neighbouring window".into());
    }
    // Use after deregistration.
    c.deregister_window(&w).map_err(s)?;
    expect_err(
        "use after deregistration",
        ctx.put(next, &w, 0, &src, 0, 8, Remote::None, Local::None),
        "deregistered",
    )?;
    expect_err(
        "read after deregistration",
        w.read(0, &mut [0; 8]),
        "deregistered",
    )?;
    dc.destroy().map_err(s)
}

/// The victim crashes while everyone else waits for a signal it would send.
fn die(c: &Comm, victim: usize) -> R {
    let (r, n) = (c.rank(), c.nranks());
    let dc = c.dev_comm(&DevCommRequirements::default()).map_err(s)?;
    let ctx = dc.ctx(0).map_err(s)?;
    dc.barrier(Team::World, 0)
        .map_err(s)?
        .sync(0, Fence::None)
        .map_err(s)?;
    if r == victim {
        std::process::abort();
    }
    let t = Instant::now();
    // Every other rank signals everyone, the victim never does.
    for p in (0..n).filter(|&p| p != victim) {
        let _ = ctx.signal(p, Remote::signal_inc(0));
    }
    match ctx.wait_signal(0, n as u64) {
        Ok(_) => Err("the wait succeeded without the victim's signal".into()),
        Err(e) => Err(format!("{e} (after {:.2}s)", t.elapsed().as_secs_f64())),
    }
}

/// Rank 1 crashes; rank 2 hears of it, drops its window and leaves, as a
/// rank whose job broke does; rank 0 keeps putting to rank 2 (flushing
/// only where puts go through a backend, so that on the direct path the put
/// itself meets the dropped part). Rank 0's error must name the death, the
/// cause, not rank 2's dropped part, its echo. Prints `echo named: ERROR`.
fn echo(c: &Comm) -> R {
    let r = c.rank();
    if c.nranks() != 3 {
        return Err("echo runs on three ranks".into());
    }
    let w = c.alloc_window(4096).map_err(s)?;
    let dc = c.dev_comm(&DevCommRequirements::default()).map_err(s)?;
    let ctx = dc.ctx(0).map_err(s)?;
    c.bootstrap().barrier().map_err(s)?;
    match r {
        1 => std::process::abort(),
        2 => {
            let t = Instant::now();
            while c.bootstrap().health().is_ok() {
                if t.elapsed() > Duration::from_secs(20) {
                    return Err("rank 1's death was never heard of".into());
                }
                std::thread::yield_now();
            }
            drop(w);
            Ok(())
        }
        _ => {
            let direct = c.settings().backend == gin_core::BackendKind::Auto
                && c.path_names().get(2) == Some(&"shm");
            let t = Instant::now();
            let e = loop {
                let sent = ctx.put(2, &w, 0, &w, 0, 4096, Remote::None, Local::None);
                let done = if direct {
                    sent
                } else {
                    sent.and_then(|()| ctx.flush())
                };
                match done {
                    Err(e) => break e.to_string(),
                    Ok(()) if t.elapsed() > Duration::from_secs(20) => {
                        return Err("puts to a rank that left kept succeeding".into());
                    }
                    Ok(()) => {}
                }
            };
            // Over tcp the broken link to rank 1 may speak first: it names
            // rank 1 too.
            if (e.contains("rank 1 died") || e.contains("rank 1's transport"))
                && !e.contains("dropped or deregistered")
            {
                println!("echo named: {e}");
                Ok(())
            } else {
                Err(format!(
                    "the error names the echo, not the death of rank 1: {e}"
                ))
            }
        }
    }
}

/// The victim stops itself (SIGSTOP: a frozen host, as far as its peers can
/// tell) while the others stream 1 MiB puts at it, 64 per flush, as
/// `gin-bench bandwidth` does. Once its socket buffers are full every
/// sender blocks; each must fail within about the timeout with an error
/// naming the victim, then drop its device communicator (and with it the
/// proxy or soft NIC, whose thread was the one blocked) in bounded time.
/// Prints `stopped peer noticed after S s, torn down in T s: ERROR`.
fn stop(c: &Comm, victim: usize) -> R {
    const BIG: u64 = 1 << 20;
    let r = c.rank();
    let w = c.alloc_window(BIG).map_err(s)?;
    let dc = c.dev_comm(&DevCommRequirements::default()).map_err(s)?;
    let ctx = dc.ctx(0).map_err(s)?;
    c.bootstrap().barrier().map_err(s)?;
    if r == victim {
        return stop_self();
    }
    let limit = c.settings().timeout * 10;
    let t = Instant::now();
    let e = stream_until_failure(&ctx, victim, &w, limit)?;
    let noticed = t.elapsed();
    let t = Instant::now();
    drop(dc);
    drop(w);
    let line = format!(
        "stopped peer noticed after {:.2} s, torn down in {:.2} s: {e}",
        noticed.as_secs_f64(),
        t.elapsed().as_secs_f64()
    );
    println!("{line}");
    Err(line)
}

/// Stops this process (SIGSTOP: a frozen host, as far as its peers can
/// tell). `kill` is a child process: it returns after stopping this one.
fn stop_self() -> R {
    let _ = std::process::Command::new("kill")
        .args(["-STOP", &std::process::id().to_string()])
        .status();
    Err("the victim was resumed".into())
}

/// Streams the first 1 MiB of `w` at `victim`, 64 puts per flush, until
/// a put or a flush fails (its error) or `limit` passes (an error).
fn stream_until_failure(
    ctx: &gin_core::Ctx<'_>,
    victim: usize,
    w: &gin_core::Window,
    limit: Duration,
) -> Result<GinError, String> {
    const BIG: u64 = 1 << 20;
    let t = Instant::now();
    loop {
        for _ in 0..64 {
            if let Err(e) = ctx.put(victim, w, 0, w, 0, BIG, Remote::None, Local::None) {
                return Ok(e);
            }
        }
        if let Err(e) = ctx.flush() {
            return Ok(e);
        }
        if t.elapsed() > limit {
            return Err(format!(
                "still streaming to the stopped rank after {limit:?}"
            ));
        }
    }
}

/// The victim stops itself; one witness (the lowest other rank) streams
/// 1 MiB puts at it, as in `stop` (or, with `wait`, waits for a signal from
/// it), and fails after about the timeout; every other rank, a bystander,
/// waits (ten timeouts long) for a signal the witness would send after.
/// A bystander must end soon after the witness gives up, naming the victim
/// as the cause: the witness's departure is only a symptom. Prints
/// `bystander failed after S s: ERROR` (or `witness failed ...`).
fn stop_bystander(c: &Comm, victim: usize, wait: bool) -> R {
    const BIG: u64 = 1 << 20;
    let r = c.rank();
    let witness = usize::from(victim == 0);
    let w = c.alloc_window(BIG).map_err(s)?;
    let dc = c.dev_comm(&DevCommRequirements::default()).map_err(s)?;
    let ctx = dc.ctx(0).map_err(s)?;
    c.bootstrap().barrier().map_err(s)?;
    if r == victim {
        return stop_self();
    }
    let limit = c.settings().timeout * 10;
    let t = Instant::now();
    let e = if r == witness && wait {
        match ctx.wait_signal(0, 1) {
            Ok(_) => return Err("a signal nobody sends arrived".into()),
            Err(e) => e.to_string(),
        }
    } else if r == witness {
        stream_until_failure(&ctx, victim, &w, limit)?.to_string()
    } else {
        match ctx.wait_signal_for(0, 1, limit) {
            Ok(_) => return Err("a signal nobody sends arrived".into()),
            Err(e) => e.to_string(),
        }
    };
    let role = if r == witness { "witness" } else { "bystander" };
    let line = format!(
        "{role} failed after {:.2} s: {e}",
        t.elapsed().as_secs_f64()
    );
    println!("{line}");
    Err(line)
}

/// Rank 1 drops a window without deregistering it; rank 0 then puts 1 KiB
/// at offset 64 of it with a signal. The rule (docs/device-api.md,
/// "Refused operations"): a signal is never applied when its data was
/// refused, and the refusal is reported by the operation's completion (the
/// flush), naming window, offset and rank.
fn refused(c: &Comm) -> R {
    let r = c.rank();
    let dc = c.dev_comm(&DevCommRequirements::default()).map_err(s)?;
    let ctx = dc.ctx(0).map_err(s)?;
    let w = c.alloc_window(4096).map_err(s)?;
    let b = c.bootstrap();
    if r == 1 {
        let id = w.id();
        drop(w);
        b.barrier().map_err(s)?;
        // Rank 0 has flushed.
        b.barrier().map_err(s)?;
        let v = ctx.read_signal(0).map_err(s)?;
        if v != 0 {
            return Err(format!(
                "signal 0 is {v}: applied although its data to dropped window {id} was refused"
            ));
        }
        return Ok(());
    }
    b.barrier().map_err(s)?;
    let got = if r == 0 {
        ctx.put(1, &w, 64, &w, 0, 1024, Remote::signal_inc(0), Local::None)
            .and_then(|()| ctx.flush())
    } else {
        Ok(())
    };
    b.barrier().map_err(s)?;
    match got {
        Ok(()) if r == 0 => Err("a put to a dropped window completed without an error".into()),
        Ok(()) => Ok(()),
        Err(e) => {
            let e = e.to_string();
            let want = [
                format!("window {}", w.id()),
                "offset 64".into(),
                "rank 1".into(),
            ];
            if want.iter().all(|x| e.contains(x.as_str())) {
                println!("rank {r}: refused as expected: {e}");
                Ok(())
            } else {
                Err(format!("the refusal does not name {want:?}: {e}"))
            }
        }
    }
}

/// Rank 1 dies (abort: no destructor runs, as under SIGKILL) as soon as its
/// shared-memory segment for a new window exists, while it waits for the
/// others in that window's registration; rank 0 registers the window once
/// it heard of the death. Rank 0's registration must fail naming rank 1,
/// and no segment of the job may be left in `GIN_SHM_DIR` (the test checks
/// the directory after the job).
fn killreg(c: &Comm) -> R {
    let b = c.bootstrap();
    if c.rank() == 0 {
        // Rank 1 must not die before rank 0 has left the collective that
        // created the communicator.
        b.send(1, 7, b"go").map_err(s)?;
        if b.recv(1, 8).is_ok() {
            return Err("rank 1 answered instead of dying".into());
        }
    } else if c.rank() == 1 {
        b.recv(0, 7).map_err(s)?;
        let dir = gin_net_shm_dir();
        std::thread::spawn(move || {
            loop {
                let created = std::fs::read_dir(&dir)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .any(|e| e.file_name().to_string_lossy().ends_with("-r1-w1"));
                if created {
                    std::process::abort();
                }
                std::thread::yield_now();
            }
        });
    }
    match c.alloc_window(1 << 20) {
        Ok(_) => Err("the registration succeeded without rank 1".into()),
        Err(e) => Err(format!("registration failed: {e}")),
    }
}

fn gin_net_shm_dir() -> std::path::PathBuf {
    std::env::var_os("GIN_SHM_DIR").map_or_else(|| "/dev/shm".into(), Into::into)
}

/// The victim returns from main without an error while everyone else waits
/// for a signal it would send: its comm is dropped, its process exits 0.
fn leave(c: &Comm, victim: usize) -> R {
    let (r, n) = (c.rank(), c.nranks());
    let dc = c.dev_comm(&DevCommRequirements::default()).map_err(s)?;
    let ctx = dc.ctx(0).map_err(s)?;
    dc.barrier(Team::World, 0)
        .map_err(s)?
        .sync(0, Fence::None)
        .map_err(s)?;
    if r == victim {
        // Its barrier signals complete before it goes (what a rank issued
        // but never completed may be lost when it leaves).
        return ctx.flush().map_err(s);
    }
    let t = Instant::now();
    for p in (0..n).filter(|&p| p != victim) {
        let _ = ctx.signal(p, Remote::signal_inc(0));
    }
    match ctx.wait_signal(0, n as u64) {
        Ok(_) => Err("the wait succeeded without the victim's signal".into()),
        Err(e) => Err(format!("{e} (after {:.2}s)", t.elapsed().as_secs_f64())),
    }
}

/// The victim signals every other rank, flushes, and leaves at once (its
/// device communicator dropped, not destroyed: destroy is collective). Its
/// signals landed before it left, so the waits they satisfy succeed, however
/// the news of its departure races them.
fn signal_leave(c: &Comm, victim: usize) -> R {
    let (r, n) = (c.rank(), c.nranks());
    let dc = c.dev_comm(&DevCommRequirements::default()).map_err(s)?;
    let ctx = dc.ctx(0).map_err(s)?;
    dc.barrier(Team::World, 0)
        .map_err(s)?
        .sync(0, Fence::None)
        .map_err(s)?;
    if r == victim {
        for p in (0..n).filter(|&p| p != victim) {
            ctx.signal(p, Remote::signal_inc(0)).map_err(s)?;
        }
        return ctx.flush().map_err(s);
    }
    ctx.wait_signal(0, 1).map_err(s)?;
    // Stay until the victim is known to have left (its flush may still wait
    // for this rank's transport), then wait again: satisfied waits stay so.
    let t = Instant::now();
    let gone = loop {
        match c.bootstrap().health() {
            Ok(()) if t.elapsed() < Duration::from_secs(10) => std::thread::yield_now(),
            Ok(()) => return Err(format!("rank {victim}'s departure was never noticed")),
            Err(e) => break e.to_string(),
        }
    };
    if !gone.contains(&format!("rank {victim} exited")) {
        return Err(format!("expected rank {victim} to have exited: {gone}"));
    }
    ctx.wait_signal(0, 1).map(|_| ()).map_err(s)
}

/// Ids freed by destroy are reused: far more create/destroy cycles than the
/// signal space could hold at once. Asking for more than it holds is a clear
/// error, and requirements are honoured (no strong signals when not asked).
fn reuse(c: &Comm) -> R {
    let slots = c.settings().signal_slots;
    let big = DevCommRequirements {
        signals: (slots / 4) as u32,
        ..DevCommRequirements::default()
    };
    for round in 0..12 {
        let dc = c
            .dev_comm(&big)
            .map_err(|e| format!("cycle {round}: {e}"))?;
        dc.ctx(0)
            .map_err(s)?
            .signal(c.rank(), Remote::signal_inc(0))
            .map_err(s)?;
        dc.destroy().map_err(s)?;
    }
    let too_big = DevCommRequirements {
        signals: slots as u32 + 1,
        ..DevCommRequirements::default()
    };
    match c.dev_comm(&too_big) {
        Ok(_) => return Err("a communicator larger than the signal space was created".into()),
        Err(e) if e.to_string().contains("signal space exhausted") => {}
        Err(e) => return Err(format!("exhaustion error does not say so: {e}")),
    }
    let weak_only = DevCommRequirements {
        strong_signals: false,
        ..DevCommRequirements::default()
    };
    let dc = c.dev_comm(&weak_only).map_err(s)?;
    let ctx = dc.ctx(0).map_err(s)?;
    expect_err(
        "strong signal without the requirement",
        ctx.signal(c.rank(), Remote::signal_inc(0)),
        "strong signals",
    )?;
    let weak = Remote::Signal {
        id: gin_core::SignalId(0),
        op: SignalOp::Inc,
        order: Order::Weak,
    };
    ctx.signal(c.rank(), weak).map_err(s)?;
    ctx.wait_signal(0, 1).map_err(s)?;
    dc.destroy().map_err(s)
}

/// Deregistration with large puts just flushed: over TCP a flushed put may
/// still sit in a socket, and the memory must not be released under it.
/// Also: two windows over the same user buffer are deregistered one at a
/// time without disturbing each other (tcp transport only).
/// A window rank 1 drops without deregistering stops being served at once:
/// rank 0's later put to it over tcp fails with an error naming the key,
/// and rank 1 lives on (it used to write into the unmapped segment). Over
/// shm the segment's revocation word refuses it (rank 0's mapping stays
/// valid, so nothing could crash, but nothing is written either).
fn dropped(c: &Comm) -> R {
    let r = c.rank();
    let dc = c.dev_comm(&DevCommRequirements::default()).map_err(s)?;
    let ctx = dc.ctx(0).map_err(s)?;
    let w = c.alloc_window(4096).map_err(s)?;
    if r == 1 {
        drop(w);
        c.bootstrap().barrier().map_err(s)?;
        // Alive until rank 0 has tried.
        return c.bootstrap().barrier().map_err(s);
    }
    c.bootstrap().barrier().map_err(s)?;
    let mut got = Ok(());
    if r == 0 {
        // The put is one-way; the get after it comes back after the put's
        // answer, so the flush sees both.
        got = ctx
            .put(1, &w, 0, &w, 0, 4096, Remote::None, Local::None)
            .and_then(|()| ctx.get(1, &w, 0, &w, 0, 8))
            .and_then(|()| ctx.flush())
            .map_err(s);
    }
    c.bootstrap().barrier().map_err(s)?;
    let over_tcp = c.path_names().get(1) == Some(&"tcp");
    let want = if over_tcp {
        "unknown memory key"
    } else {
        "dropped or deregistered"
    };
    match got {
        Err(e) if e.contains(want) => {
            println!("rank {r}: put to a dropped window refused: {e}");
            Ok(())
        }
        Ok(()) if r != 0 => Ok(()),
        Err(e) => Err(format!("put to a dropped window: wrong error: {e}")),
        Ok(()) => Err("a put to a dropped window succeeded".into()),
    }
}

fn dereg(c: &Comm) -> R {
    let (r, n) = (c.rank(), c.nranks());
    let big = 32u64 << 20;
    for round in 0..3 {
        let w = c.alloc_window(big).map_err(s)?;
        let dc = c.dev_comm(&DevCommRequirements::default()).map_err(s)?;
        let ctx = dc.ctx(0).map_err(s)?;
        w.write(0, &pattern(round, 4096)).map_err(s)?;
        ctx.put((r + 1) % n, &w, 0, &w, 0, big, Remote::None, Local::None)
            .map_err(s)?;
        ctx.flush().map_err(s)?;
        dc.destroy().map_err(s)?;
        c.deregister_window(&w).map_err(s)?;
        drop(w);
    }
    if c.path_names().iter().all(|p| *p != "shm") {
        let mut buf = vec![0u64; 512];
        let ptr = buf.as_mut_ptr().cast::<u8>();
        // SAFETY: `buf` outlives both windows (dropped at the end).
        let (a, b) = unsafe {
            (
                c.register_window(ptr, 4096).map_err(s)?,
                c.register_window(ptr, 4096).map_err(s)?,
            )
        };
        c.deregister_window(&b).map_err(s)?;
        let dc = c.dev_comm(&DevCommRequirements::default()).map_err(s)?;
        let ctx = dc.ctx(0).map_err(s)?;
        ctx.put_value((r + 1) % n, &a, 8, 77, Remote::signal_inc(0))
            .map_err(s)?;
        ctx.wait_signal(0, 1).map_err(s)?;
        let v = u64::from_le_bytes(a.read_vec(8, 8).map_err(s)?.try_into().expect("8 bytes"));
        if v != 77 {
            return Err(format!(
                "the window sharing a buffer with a deregistered one got {v}"
            ));
        }
        dc.destroy().map_err(s)?;
        c.deregister_window(&a).map_err(s)?;
        drop(buf);
    }
    Ok(())
}

/// Requirements every rank must give alike are compared on every rank
/// before anything is placed: rank 0 asking for fewer signals than the
/// others (whose legal signal would land in rank 0's barrier slot) makes
/// every rank fail naming the field and who gave what. Absurd requirements
/// are refused naming the limit, not by an aborted allocation. Afterwards a
/// well-formed communicator still works, and a window deregistered twice is
/// an error.
fn requirements(c: &Comm) -> R {
    let r = c.rank();
    let fewer = DevCommRequirements {
        signals: if r == 0 { 4 } else { 64 },
        ..DevCommRequirements::default()
    };
    match c.dev_comm(&fewer) {
        Ok(_) => return Err("mismatched signal counts were accepted".into()),
        Err(e) => {
            let e = e.to_string();
            if !(e.contains("DevCommRequirements::signals") && e.contains("rank 0 gave 4")) {
                return Err(format!(
                    "mismatch error does not name the field and ranks: {e}"
                ));
            }
            println!("rank {r}: mismatch refused: {e}");
        }
    }
    let absurd = DevCommRequirements {
        contexts: u32::MAX,
        signals: 0,
        counters: 0,
        world_barriers: 0,
        ..DevCommRequirements::default()
    };
    match c.dev_comm(&absurd) {
        Ok(_) => return Err("u32::MAX contexts were accepted".into()),
        Err(e) if e.to_string().contains("contexts") && e.to_string().contains("limit") => {
            println!("rank {r}: absurd requirements refused: {e}");
        }
        Err(e) => return Err(format!("absurd requirements: wrong error: {e}")),
    }
    let dc = c.dev_comm(&DevCommRequirements::default()).map_err(s)?;
    let ctx = dc.ctx(0).map_err(s)?;
    let n = c.nranks();
    for p in 0..n {
        ctx.signal(p, Remote::signal_inc(1)).map_err(s)?;
    }
    ctx.wait_signal(1, n as u64).map_err(s)?;
    dc.barrier(Team::World, 0)
        .map_err(s)?
        .sync(0, Fence::None)
        .map_err(s)?;
    dc.destroy().map_err(s)?;
    let w = c.alloc_window(4096).map_err(s)?;
    c.deregister_window(&w).map_err(s)?;
    match c.deregister_window(&w) {
        Ok(()) => Err("a window was deregistered twice without an error".into()),
        Err(e) if e.to_string().contains("already deregistered") => Ok(()),
        Err(e) => Err(format!("second deregistration: wrong error: {e}")),
    }
}
