//! Ranks as separate processes, started by the same launcher users use.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::time::Duration;

use gin_bootstrap::{Config, LaunchSpec, Output, launch};

const BIN: &str = env!("CARGO_BIN_EXE_gin-bootstrap-selftest");

fn spec(n: usize, args: &[&str], timeout: &str) -> LaunchSpec {
    let mut s = LaunchSpec::new(n, BIN, args.iter().copied()).env("GIN_TIMEOUT", timeout);
    s.output = Output::Capture;
    s.grace = Duration::from_secs(20);
    s.limit = Some(Duration::from_secs(120));
    s.config = Config {
        timeout: Duration::from_secs(60),
        ..Config::default()
    };
    s
}

#[test]
fn collectives_are_correct_for_1_to_16_process_ranks() {
    for n in 1..=16 {
        let report = launch(&spec(n, &["check", "2"], "60")).unwrap();
        for r in &report.ranks {
            assert!(
                r.success(),
                "{n} ranks, rank {}: {:?}\n{}{}",
                r.rank,
                r.status,
                r.stdout,
                r.stderr
            );
            assert!(
                r.stdout.contains(&format!("rank {} of {n}: ok", r.rank)),
                "{}",
                r.stdout
            );
        }
    }
}

#[test]
fn a_rank_killed_mid_allgather_fails_the_others_promptly() {
    // The timeout is long, so a prompt failure proves death detection, not a timeout.
    let report = launch(&spec(6, &["die", "2"], "60")).unwrap();
    assert!(!report.success());
    assert!(
        report.elapsed < Duration::from_secs(30),
        "took {:?}",
        report.elapsed
    );
    assert!(!report.ranks[2].success());
    for r in report.ranks.iter().filter(|r| r.rank != 2) {
        assert_eq!(
            r.status.and_then(|s| s.code()),
            Some(3),
            "rank {}: {}{}",
            r.rank,
            r.stdout,
            r.stderr
        );
        assert!(
            r.stdout.contains("rank 2 died"),
            "rank {}: {}",
            r.rank,
            r.stdout
        );
        assert!(
            !r.stopped,
            "rank {} had to be stopped instead of failing by itself",
            r.rank
        );
    }
}

/// What a rank sent before it died, and what live ranks send after the
/// others heard of the death, is delivered; only what can never come fails.
/// (A rank that crashes right after a collective must not fail the peers
/// still finishing it: they may need exactly these messages.)
#[test]
fn messages_sent_before_and_after_a_death_are_delivered() {
    let report = launch(&spec(3, &["last-words"], "60")).unwrap();
    assert!(!report.ranks[2].success());
    for r in report.ranks.iter().filter(|r| r.rank != 2) {
        assert!(
            r.success() && r.stdout.contains("ok") && r.stdout.contains("rank 2 died"),
            "rank {}: {:?}\n{}{}",
            r.rank,
            r.status,
            r.stdout,
            r.stderr
        );
    }
}

/// The seconds a survivor spent in its failed allgather, from the line the
/// selftest prints.
fn seconds_in_allgather(stdout: &str) -> Option<f64> {
    let (_, tail) = stdout.split_once("(after ")?;
    tail.split_once("s in allgather")?.0.parse().ok()
}

#[test]
fn a_stopped_rank_fails_every_other_rank_within_twice_the_timeout() {
    // Rank 2 freezes (SIGSTOP) with its sockets open: rank 1's 16 MiB send to
    // it fills the socket buffers (a few MiB on loopback) and must still end
    // at its deadline, and every survivor must name rank 2, not the rank that
    // gave up before it. The slack covers moving 2 x 16 MiB on loaded cores.
    let timeout = 2.0;
    let mut s = spec(4, &["stop", "2", &(16 << 20).to_string()], "2");
    s.config.timeout = Duration::from_secs(10);
    s.grace = Duration::from_secs(8);
    let report = launch(&s).unwrap();
    for r in report.ranks.iter().filter(|r| r.rank != 2) {
        assert!(
            !r.stopped,
            "rank {} hung and had to be stopped: {}{}",
            r.rank, r.stdout, r.stderr
        );
        assert_eq!(
            r.status.and_then(|s| s.code()),
            Some(3),
            "rank {}: {}{}",
            r.rank,
            r.stdout,
            r.stderr
        );
        assert!(
            r.stdout.contains("rank 2"),
            "rank {} does not name rank 2: {}",
            r.rank,
            r.stdout
        );
        let took = seconds_in_allgather(&r.stdout).unwrap();
        assert!(
            took < 2.0 * timeout + 1.0,
            "rank {} failed after {took}s: {}",
            r.rank,
            r.stdout
        );
    }
}

#[test]
fn a_rank_that_never_joins_is_named_by_every_other() {
    let mut s = spec(4, &["absent", "3"], "2");
    s.config.timeout = Duration::from_secs(2);
    let report = launch(&s).unwrap();
    for r in report.ranks.iter().filter(|r| r.rank != 3) {
        assert_eq!(
            r.status.and_then(|s| s.code()),
            Some(3),
            "rank {}: {}",
            r.rank,
            r.stdout
        );
        assert!(
            r.stdout.contains("never answered: [3]"),
            "rank {}: {}",
            r.rank,
            r.stdout
        );
    }
}

#[test]
fn the_launcher_stops_survivors_after_the_grace_period() {
    // `sh -c` ranks: rank 0 fails at once, the others would sleep for a minute.
    let mut s = LaunchSpec::new(
        3,
        "sh",
        [
            "-c",
            r#"if [ "$GIN_RANK" = 0 ]; then echo bye; exit 4; fi; exec sleep 60"#,
        ],
    );
    s.output = Output::Capture;
    s.grace = Duration::from_millis(300);
    let report = launch(&s).unwrap();
    assert_eq!(report.first_failure, Some(0));
    assert_eq!(report.ranks[0].status.and_then(|s| s.code()), Some(4));
    assert_eq!(report.ranks[0].stdout, "bye\n");
    assert!(report.ranks[1].stopped && report.ranks[2].stopped);
    assert!(
        report.elapsed < Duration::from_secs(20),
        "took {:?}",
        report.elapsed
    );
    let d = report.describe_failures();
    assert!(
        d.contains("rank 0: exited with status 4") && d.contains("rank 0 failed first"),
        "{d}"
    );
}

#[test]
fn launch_reports_a_program_that_cannot_start() {
    let e = launch(&LaunchSpec::new(
        2,
        "/nonexistent/gin-rank",
        Vec::<String>::new(),
    ))
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("starting rank 0 (/nonexistent/gin-rank)"),
        "{e}"
    );
}

/// A scratch folder for pid files, removed when dropped.
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!("gin-launch-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }

    fn pid(&self, rank: usize) -> u32 {
        let f = self.0.join(rank.to_string());
        let s = std::fs::read_to_string(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        s.trim().parse().unwrap()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Whether `pid` is still a live process (an unreaped zombie has exited).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        // The state follows the parenthesised command name.
        s.rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X']))
    })
}

/// Whether `pid` is still alive a second after the launcher returned. A
/// SIGKILLed process closes its files (ending the launcher's wait for its
/// output) a moment before the kernel marks it a zombie, so a loaded machine
/// can show it running just after `launch` returns; a process the launcher
/// did not signal at all is still there a second later.
fn survives(pid: u32) -> bool {
    let until = std::time::Instant::now() + Duration::from_secs(1);
    while alive(pid) {
        if std::time::Instant::now() >= until {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

#[test]
fn a_failed_rank_stops_every_process_a_wrapper_script_started() {
    // Ranks 1 and 2 run their "work" (a minute-long sleep) as a child of a
    // wrapper shell, as `sh -c 'prog; ...'` or a job script does; rank 2's
    // wrapper and work also ignore SIGTERM. Rank 0 fails once both have
    // started. Stopping only the wrappers would leave the sleeps running and
    // holding the ranks' output open, keeping the launcher waiting.
    let dir = Scratch::new("wrapped");
    let script = r#"
        if [ "$GIN_RANK" = 0 ]; then
            while [ ! -s "$PIDS/1" ] || [ ! -s "$PIDS/2" ]; do sleep 0.01; done
            exit 4
        fi
        if [ "$GIN_RANK" = 2 ]; then trap '' TERM; fi
        sleep 60 &
        echo $! > "$PIDS/$GIN_RANK.tmp" && mv "$PIDS/$GIN_RANK.tmp" "$PIDS/$GIN_RANK"
        wait
        echo "rank $GIN_RANK was not stopped"
    "#;
    let mut s = LaunchSpec::new(3, "sh", ["-c", script]).env("PIDS", &dir.0);
    s.output = Output::Capture;
    s.grace = Duration::from_millis(500);
    let report = launch(&s).unwrap();
    assert_eq!(
        report.first_failure,
        Some(0),
        "{}",
        report.describe_failures()
    );
    assert!(report.ranks[1].stopped && report.ranks[2].stopped);
    // The grace, then SIGTERM, then SIGKILL at most 2 s later, plus a margin
    // for a loaded machine.
    assert!(
        report.elapsed < s.grace + Duration::from_secs(2) + Duration::from_secs(3),
        "took {:?}",
        report.elapsed
    );
    for rank in [1, 2] {
        let pid = dir.pid(rank);
        assert!(
            !survives(pid),
            "rank {rank}'s child {pid} survived the launcher"
        );
        assert!(
            !report.ranks[rank].stdout.contains("was not stopped"),
            "{}",
            report.ranks[rank].stdout
        );
    }
}

#[test]
fn a_rank_that_exits_leaving_a_child_behind_does_not_keep_the_launcher_waiting() {
    // The rank succeeds, but a background child it forgot holds its output
    // open: the launcher stops what the rank left in its process group.
    let dir = Scratch::new("leftover");
    let script = r#"sleep 60 & echo $! > "$PIDS/$GIN_RANK"; echo done"#;
    let mut s = LaunchSpec::new(2, "sh", ["-c", script]).env("PIDS", &dir.0);
    s.output = Output::Capture;
    s.grace = Duration::from_millis(500);
    let report = launch(&s).unwrap();
    assert!(report.success(), "{}", report.describe_failures());
    assert_eq!(report.ranks[0].stdout, "done\n");
    assert!(
        report.elapsed < Duration::from_secs(5),
        "took {:?}",
        report.elapsed
    );
    for rank in [0, 1] {
        let pid = dir.pid(rank);
        assert!(
            !survives(pid),
            "rank {rank}'s child {pid} survived the launcher"
        );
    }
}
