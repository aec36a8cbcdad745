//! Two emulated hosts on one machine: each is a network namespace (joined to
//! the other by a veth pair) plus its own UTS namespace (hostname) and mount
//! namespace (a private /dev/shm), running two ranks. `auto` must pick shm
//! within a host and tcp across, and the all-to-all must verify.
//!
//! Needs root and iproute2; skipped with a printed reason otherwise.

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_gin-selftest");

struct Hosts {
    names: [String; 2],
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
    }
}

fn sh(cmd: &str) -> Result<(), String> {
    let out = Command::new("sh")
        .args(["-c", cmd])
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`{cmd}`: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Creates the two hosts, or says why it cannot.
fn make_hosts() -> Result<Hosts, String> {
    let id = std::process::id() % 100_000;
    let hosts = Hosts {
        names: [format!("ginA{id}"), format!("ginB{id}")],
    };
    let [a, b] = &hosts.names;
    sh(&format!("ip netns add {a}"))?;
    sh(&format!("ip netns add {b}"))?;
    sh(&format!(
        "ip link add va{id} netns {a} type veth peer name vb{id} netns {b}"
    ))?;
    sh(&format!(
        "ip -n {a} addr add 10.213.7.1/24 dev va{id} && ip -n {a} link set va{id} up && ip -n {a} link set lo up"
    ))?;
    sh(&format!(
        "ip -n {b} addr add 10.213.7.2/24 dev vb{id} && ip -n {b} link set vb{id} up && ip -n {b} link set lo up"
    ))?;
    Ok(hosts)
}

/// Starts one host: its own hostname and /dev/shm, ranks `first` and
/// `first + 1` of 4.
fn start_host(
    netns: &str,
    hostname: &str,
    first: usize,
    scenario: &str,
    backend: &str,
) -> std::process::Child {
    let script = format!(
        "hostname {hostname} && mount -t tmpfs gin-shm /dev/shm && \
         GIN_RANK={first} {BIN} {scenario} & p0=$!; \
         GIN_RANK={second} {BIN} {scenario} & p1=$!; \
         s=0; wait $p0 || s=1; wait $p1 || s=1; exit $s",
        second = first + 1
    );
    Command::new("ip")
        .args([
            "netns", "exec", netns, "unshare", "--uts", "--mount", "--fork", "sh", "-c", &script,
        ])
        .env("GIN_NRANKS", "4")
        .env("GIN_ROOT_ADDR", "10.213.7.1:29500")
        .env(
            "GIN_JOB_SECRET",
            format!("two-hosts-{}", std::process::id()),
        )
        .env("GIN_TIMEOUT", "60")
        .env_remove("GIN_UNIQUE_ID")
        .env_remove("GIN_HOSTID")
        .env_remove("GIN_TRANSPORT")
        .env("GIN_BACKEND", backend)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn wait(child: std::process::Child, limit: Duration) -> Output {
    let start = Instant::now();
    let mut child = child;
    loop {
        if child.try_wait().unwrap().is_some() || start.elapsed() > limit {
            let _ = child.kill();
            return child.wait_with_output().unwrap();
        }
        // std offers no wait-with-timeout for a child: poll its status.
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn auto_picks_shm_within_a_host_and_tcp_across() {
    let hosts = match make_hosts() {
        Ok(h) => h,
        Err(why) => {
            println!("SKIPPED: cannot create network namespaces here ({why})");
            return;
        }
    };
    let [a, b] = &hosts.names;
    for (scenario, backend) in [("alltoall", "auto"), ("all", "auto"), ("all", "gdaki")] {
        let host_a = start_host(a, "gin-host-a", 0, scenario, backend);
        let host_b = start_host(b, "gin-host-b", 2, scenario, backend);
        let (oa, ob) = (
            wait(host_a, Duration::from_secs(120)),
            wait(host_b, Duration::from_secs(120)),
        );
        let text = |o: &Output| {
            format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            )
        };
        let (ta, tb) = (text(&oa), text(&ob));
        assert!(
            oa.status.success() && ob.status.success(),
            "{scenario} ({backend}):\nhost A:\n{ta}\nhost B:\n{tb}"
        );
        assert!(
            ta.contains("rank 0 of 4: ")
                && ta.contains(r#"(paths ["local", "shm", "tcp", "tcp"])"#),
            "{ta}"
        );
        assert!(
            ta.contains(r#"(paths ["shm", "local", "tcp", "tcp"])"#),
            "{ta}"
        );
        assert!(
            tb.contains(r#"(paths ["tcp", "tcp", "local", "shm"])"#),
            "{tb}"
        );
        assert!(
            tb.contains(r#"(paths ["tcp", "tcp", "shm", "local"])"#),
            "{tb}"
        );
        println!("{scenario} ({backend}): host A:\n{ta}host B:\n{tb}");
    }
}
