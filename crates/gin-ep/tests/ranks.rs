//! gin-ep across rank processes started by the launcher users use, under
//! every backend and transport: the oracle of DeepEP's tests (exact tokens,
//! ordered per-source blocks, weights, per-expert counts against the
//! all-gathered table, combine within calc_diff, 20 bit-identical repeats,
//! unequal token counts), bad inputs, and a rank killed mid-job.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::time::Duration;

use gin_bootstrap::{LaunchReport, LaunchSpec, Output, launch};

const BIN: &str = env!("CARGO_BIN_EXE_gin-ep-selftest");

/// (name, environment) of each backend and transport.
const MODES: [(&str, &[(&str, &str)]); 7] = [
    ("auto (direct load/store)", &[]),
    ("auto over tcp", &[("GIN_TRANSPORT", "tcp")]),
    ("proxy over shm", &[("GIN_BACKEND", "proxy")]),
    (
        "proxy over tcp",
        &[("GIN_BACKEND", "proxy"), ("GIN_TRANSPORT", "tcp")],
    ),
    ("gdaki (soft-mlx5) over shm", &[("GIN_BACKEND", "gdaki")]),
    (
        "gdaki (soft-mlx5) over tcp",
        &[("GIN_BACKEND", "gdaki"), ("GIN_TRANSPORT", "tcp")],
    ),
    (
        "gdaki with batched doorbells",
        &[("GIN_BACKEND", "gdaki"), ("GIN_GDAKI_BATCH", "8")],
    ),
];

fn run(n: usize, args: &[&str], env: &[(&str, &str)]) -> LaunchReport {
    let mut spec = LaunchSpec::new(n, BIN, args.iter().copied()).env("GIN_TIMEOUT", "30");
    for (k, v) in env {
        spec = spec.env(k, v);
    }
    spec.output = Output::Capture;
    spec.grace = Duration::from_secs(20);
    spec.limit = Some(Duration::from_secs(120));
    launch(&spec).unwrap()
}

fn assert_ok(report: &LaunchReport, what: &str) {
    for r in &report.ranks {
        assert!(
            r.success() && r.stdout.contains(" ok in "),
            "{what}, rank {}: {:?}\n{}{}",
            r.rank,
            r.status,
            r.stdout,
            r.stderr
        );
    }
}

#[test]
fn low_latency_passes_the_oracle_on_every_backend_and_transport() {
    for (name, env) in MODES {
        for n in [2, 3, 5] {
            let report = run(n, &["ll", "repeats=20"], env);
            assert_ok(&report, &format!("ll, {name}, {n} ranks"));
        }
    }
}

#[test]
fn low_latency_passes_the_oracle_with_8_and_16_ranks() {
    let report = run(8, &["ll", "tokens=16"], &[]);
    assert_ok(&report, "ll, 8 ranks");
    let small = ["ll", "tokens=8", "hidden=128", "experts=2", "repeats=5"];
    assert_ok(&run(16, &small, &[]), "ll, 16 ranks");
    assert_ok(
        &run(16, &small, &[("GIN_BACKEND", "proxy")]),
        "ll, 16 ranks, proxy",
    );
}

#[test]
fn low_latency_fp8_stays_within_deepeps_tolerance() {
    for (name, env) in [MODES[0], MODES[3], MODES[4]] {
        let report = run(4, &["ll", "fp8=1", "repeats=5"], env);
        assert_ok(&report, &format!("ll fp8, {name}"));
    }
}

#[test]
fn bad_inputs_are_refused_before_anything_is_sent() {
    for (name, env) in [MODES[0], MODES[3], MODES[5]] {
        let report = run(3, &["bad"], env);
        assert_ok(&report, &format!("bad inputs, {name}"));
    }
    let report = run_hosts(4, 2, "bad ht=1", &[]);
    assert_ok(&report, "bad inputs, high-throughput, 2 hosts");
}

/// Bad inputs on one rank only (an expert id out of range), after a
/// verified step: the victim's error names its entry; every other rank's
/// step ends at once (well within the job timeout) with `PeerRefused`
/// naming the victim, in low-latency mode (the victim's dispatch signals
/// carry a refused mark instead of counts) and in high-throughput mode on
/// two emulated hosts (its notify row does); then two victims at once; then
/// the steps after them verify on every rank, bit-identical to the first,
/// on every backend and transport.
#[test]
fn a_lone_refused_rank_ends_the_step_on_every_rank_at_once() {
    for (name, env) in MODES {
        for victim in [1, 2] {
            let report = run(3, &["refuse", &format!("victim={victim}")], env);
            assert_ok(&report, &format!("ll refuse {victim}, {name}"));
            let args = format!("refuse ht=1 victim={victim}");
            let report = run_hosts(4, 2, &args, env);
            assert_ok(&report, &format!("ht refuse {victim}, {name}"));
        }
    }
    let report = run_hosts(
        4,
        2,
        "refuse ht=1 victim=3 channels=3 threads=2 ring=2",
        &[],
    );
    assert_ok(&report, "ht refuse, 3 channels on 2 threads");
}

/// A refused step that cannot be ended (no peer takes part, so the
/// victim's wait for their signals times out) leaves the victim's buffer
/// refusing further steps, never idle: a next step would take the refused
/// step's late signals for its own.
#[test]
fn a_refused_step_that_times_out_leaves_the_buffer_refusing_steps() {
    let report = run(2, &["refuse-unended", "victim=1", "wait_ms=300"], &[]);
    assert_ok(&report, "refuse-unended");
    let report = run(
        2,
        &["refuse-unended", "ht=1", "victim=1", "wait_ms=300"],
        &[],
    );
    assert_ok(&report, "refuse-unended ht=1");
    // High-throughput mode with good inputs: a step whose count exchange
    // times out leaves the buffer refusing steps too.
    let report = run(
        2,
        &[
            "refuse-unended",
            "ht=1",
            "good=1",
            "victim=1",
            "wait_ms=300",
        ],
        &[],
    );
    assert_ok(&report, "refuse-unended ht=1 good=1");
}

/// A rank dies after a step; the survivors finish the next step with its
/// experts masked, report it, and keep going with the mask.
#[test]
fn survivors_finish_the_step_with_a_dead_ranks_experts_masked() {
    for (name, env) in [MODES[0], MODES[2]] {
        let report = run(4, &["kill", "victim=2"], env);
        for r in &report.ranks {
            if r.rank == 2 {
                assert!(!r.success(), "{name}: the victim lived: {}", r.stdout);
                continue;
            }
            assert!(
                r.success() && r.stdout.contains("kill ok in"),
                "{name}, rank {}: {:?}\n{}{}",
                r.rank,
                r.status,
                r.stdout,
                r.stderr
            );
        }
    }
}

/// High-throughput mode: a rank dies after a step; the survivors finish
/// the next step with its experts masked (found lost in the count exchange,
/// which then runs again), report it, and keep going with the mask. On one
/// host over load/store: over tcp gin's backends are fail-stop once a link
/// breaks (every later operation fails), and where a host's ranks reach
/// each other only through a backend the combine's fetches end in device
/// waits, which fail once any rank died (docs/ep.md, "Faults").
#[test]
fn high_throughput_survivors_finish_the_step_with_a_dead_ranks_experts_masked() {
    for victim in [2, 1] {
        let report = run(4, &["kill", "ht=1", &format!("victim={victim}")], &[]);
        assert_survivors(&report, victim, "ht kill");
    }
    let report = run(
        6,
        &["kill", "ht=1", "victim=5", "channels=3", "threads=2"],
        &[],
    );
    assert_survivors(&report, 5, "ht kill, 3 channels on 2 threads");
}

fn assert_survivors(report: &LaunchReport, victim: usize, what: &str) {
    for r in &report.ranks {
        if r.rank == victim {
            assert!(!r.success(), "{what}: the victim lived: {}", r.stdout);
            continue;
        }
        assert!(
            r.success() && r.stdout.contains("kill ok in"),
            "{what}, victim {victim}, rank {}: {:?}\n{}{}",
            r.rank,
            r.status,
            r.stdout,
            r.stderr
        );
    }
}

/// High-throughput mode on two emulated hosts, tcp between them: with a rank
/// masked on every rank, its experts get nothing and its forwarding role
/// passes to the next rank of its host, so that tokens still cross between
/// hosts only through one rank per (source, host); verified by the oracle,
/// bit-identical over repeats, on every backend over tcp.
#[test]
fn high_throughput_reroutes_a_masked_ranks_forwarding_across_hosts() {
    for (name, env) in [MODES[0], MODES[1], MODES[3], MODES[5]] {
        for victim in [2, 1] {
            let report = run_hosts(4, 2, &format!("mask ht=1 victim={victim}"), env);
            assert_ok(&report, &format!("ht mask {victim}, {name}"));
        }
    }
    let report = run_hosts(6, 3, "mask ht=1 victim=4 ring=2 tokens=30", &[]);
    assert_ok(&report, "ht mask, 2 hosts of 3");
}

/// Runs `args` on `n` ranks split into hosts of `per` ranks by identity
/// (`GIN_HOSTID`): the auto backend crosses hosts over tcp and uses
/// load/store within one, as on two real hosts.
fn run_hosts(n: usize, per: usize, args: &str, env: &[(&str, &str)]) -> LaunchReport {
    let script = format!("GIN_HOSTID=host$((GIN_RANK / {per})) exec {BIN} {args}");
    let mut spec = LaunchSpec::new(n, "sh", ["-c", script.as_str()]).env("GIN_TIMEOUT", "30");
    for (k, v) in env {
        spec = spec.env(k, v);
    }
    spec.output = Output::Capture;
    spec.grace = Duration::from_secs(20);
    spec.limit = Some(Duration::from_secs(120));
    launch(&spec).unwrap()
}

#[test]
fn high_throughput_passes_the_oracle_on_two_emulated_hosts() {
    for (name, env) in MODES {
        let report = run_hosts(4, 2, "ht", env);
        assert_ok(&report, &format!("ht, 2 hosts of 2, {name}"));
        if env.is_empty() {
            assert!(
                report.ranks[0]
                    .stdout
                    .contains(r#"paths ["local", "shm", "tcp", "tcp"]"#),
                "{}",
                report.ranks[0].stdout
            );
        }
    }
}

#[test]
fn high_throughput_rings_smaller_than_a_step_wrap_under_credits() {
    // 2 slots per ring: every step wraps each ring many times.
    for (name, env) in [MODES[0], MODES[3], MODES[5]] {
        let report = run_hosts(4, 2, "ht ring=2 tokens=40", env);
        assert_ok(&report, &format!("ht ring=2, {name}"));
    }
    let report = run_hosts(6, 3, "ht ring=3 fp8=1 repeats=5", &[]);
    assert_ok(&report, "ht, 2 hosts of 3, fp8");
    let report = run_hosts(8, 4, "ht repeats=5", &[]);
    assert_ok(&report, "ht, 2 hosts of 4");
    let report = run_hosts(16, 8, "ht tokens=8 experts=2 hidden=128 repeats=3", &[]);
    assert_ok(&report, "ht, 2 hosts of 8");
}

/// Channels split each rank's tokens into contiguous ranges, each with its
/// own context, rings and credits: one channel, several on as many threads
/// (each context used by one thread), and more channels than some ranks
/// have tokens (empty channels) all pass the oracle, bit-identical over
/// repeats.
#[test]
fn high_throughput_channels_on_several_threads_pass_the_oracle() {
    for (name, env) in [MODES[0], MODES[3], MODES[5]] {
        let report = run_hosts(
            4,
            2,
            "ht channels=3 threads=3 ring=2 tokens=40 repeats=5",
            env,
        );
        assert_ok(&report, &format!("ht 3 channels on 3 threads, {name}"));
    }
    assert_ok(
        &run_hosts(4, 2, "ht channels=1 repeats=5", &[]),
        "ht 1 channel",
    );
    assert_ok(
        &run_hosts(4, 2, "ht channels=6 threads=2 tokens=4 repeats=5", &[]),
        "ht 6 channels, 4 tokens",
    );
}

/// The high-throughput receive hook: the sending half returns once counts
/// are exchanged and every channel started; the caller computes between
/// polls, and the polls alone (every rank polling) complete the dispatch,
/// through small rings and several channels; the receiving half then
/// passes the oracle, bit-identical over repeats.
#[test]
fn high_throughput_receive_hook_completes_by_polling_between_compute() {
    for (name, env) in [MODES[0], MODES[3]] {
        let report = run_hosts(4, 2, "ht hook=1 ring=2 tokens=40 channels=3 repeats=5", env);
        assert_ok(&report, &format!("ht receive hook, {name}"));
    }
}

/// `device=cuda` without a usable GPU fails at once with an error saying it
/// needs one and why (no rank is started, nothing hangs); with a GPU, the
/// low-latency oracle passes on CUDA ranks.
#[test]
fn cuda_ranks_need_a_gpu_and_say_so() {
    match gin_core::cuda::skip_reason() {
        Some(why) => {
            let out = std::process::Command::new(BIN)
                .args(["ll", "device=cuda", "ranks=2"])
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "exited successfully: {err}");
            assert!(
                err.contains("gin-ep-selftest: device=cuda needs a GPU: ") && err.contains(&why),
                "{err}"
            );
            assert!(
                out.stdout.is_empty(),
                "{}",
                String::from_utf8_lossy(&out.stdout)
            );
        }
        None => assert_ok(
            &run(2, &["ll", "device=cuda", "repeats=5"], &[]),
            "ll on CUDA ranks",
        ),
    }
}

/// High-throughput mode on CUDA ranks (`ht device=cuda`) needs a GPU alike
/// and says so before starting a rank; with a GPU it passes the oracle on
/// one host and on two emulated hosts through small rings, repeats
/// bit-identical.
#[test]
fn cuda_ranks_run_high_throughput_mode_with_a_gpu_and_say_so_without() {
    if let Some(why) = gin_core::cuda::skip_reason() {
        let out = std::process::Command::new(BIN)
            .args(["ht", "device=cuda", "ranks=2"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "exited successfully: {err}");
        assert!(
            err.contains("gin-ep-selftest: device=cuda needs a GPU: ") && err.contains(&why),
            "{err}"
        );
        assert!(
            out.stdout.is_empty(),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
    } else {
        assert_ok(
            &run(2, &["ht", "device=cuda", "repeats=3"], &[]),
            "ht on CUDA ranks",
        );
        let two_hosts = [
            "ht",
            "device=cuda",
            "hosts=2",
            "ring=2",
            "channels=3",
            "repeats=3",
        ];
        assert_ok(
            &run(4, &two_hosts, &[]),
            "ht on CUDA ranks, two emulated hosts, 2-slot rings",
        );
    }
}

/// The device-resident steps (`inputs=device`, `inputs=stream`) need a GPU
/// alike and say so before starting a rank; with a GPU they pass the same
/// oracle, and bad inputs found on the GPU are reported on every rank.
#[test]
fn device_resident_steps_need_a_gpu_and_pass_the_oracle() {
    for inputs in ["inputs=device", "inputs=stream"] {
        let Some(why) = gin_core::cuda::skip_reason() else {
            assert_ok(
                &run(2, &["ll", "device=cuda", inputs, "repeats=5"], &[]),
                inputs,
            );
            assert_ok(
                &run(
                    2,
                    &["ll", "device=cuda", inputs, "expert=tensor", "repeats=3"],
                    &[],
                ),
                &format!("{inputs} expert=tensor"),
            );
            assert_ok(
                &run(2, &["ll", "device=cuda", "inputs=device", "bad=1"], &[]),
                "bad inputs on the GPU",
            );
            continue;
        };
        let out = std::process::Command::new(BIN)
            .args(["ll", "device=cuda", inputs, "ranks=2"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "{inputs}: exited successfully: {err}"
        );
        assert!(
            err.contains("device=cuda needs a GPU: ") && err.contains(&why),
            "{inputs}: {err}"
        );
        assert!(out.stdout.is_empty(), "{inputs}");
    }
}
