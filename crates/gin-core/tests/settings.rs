//! Settings and backend kinds as users see them: parsing `GIN_*`
//! variables (unknown choices list the alternatives), each backend's queue
//! depths, and how a backend's start error reaches the caller. (The
//! selection table itself is checked beside it, in `config.rs`.)

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use gin_core::{BackendKind, CoreError, NicKind, Settings, TransportKind};
use gin_device::StartError;

fn vars<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
    move |k| {
        pairs
            .iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| (*v).to_owned())
    }
}

#[test]
fn queue_depths_are_rounded_up_within_the_backends_range_never_clamped() {
    assert_eq!(BackendKind::Proxy.queue_log2(2).unwrap(), 1);
    assert_eq!(BackendKind::Auto.queue_log2(3).unwrap(), 2);
    assert_eq!(BackendKind::Gdaki.queue_log2(4).unwrap(), 2);
    assert_eq!(BackendKind::Gdaki.queue_log2(5).unwrap(), 3);
    assert_eq!(BackendKind::Proxy.queue_log2(1 << 16).unwrap(), 16);
    let e = BackendKind::Gdaki.queue_log2(3).unwrap_err().to_string();
    assert!(
        e.contains("queue depth 3 is below the gdaki backend's minimum 4"),
        "{e}"
    );
    let e = BackendKind::Gdaki
        .queue_log2((1 << 14) + 1)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("exceeds the gdaki backend's maximum 16384"),
        "{e}"
    );
    let e = BackendKind::Proxy
        .queue_log2(u32::MAX)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("exceeds the proxy backend's maximum 65536"),
        "{e}"
    );
    let e = BackendKind::Proxy.queue_log2(1).unwrap_err().to_string();
    assert!(e.contains("below the proxy backend's minimum 2"), "{e}");
}

#[test]
fn start_errors_keep_the_lower_layers_error() {
    let e: CoreError =
        StartError::Host(Box::new(gin_net::NetError::NotRegistered { window: 7 })).into();
    assert!(matches!(e, CoreError::Net(_)), "{e:?}");
    let e: CoreError = StartError::Host("a ring's size is out of range".into()).into();
    assert!(
        matches!(&e, CoreError::Invalid(m) if m == "a ring's size is out of range"),
        "{e:?}"
    );
    let e: CoreError = StartError::Gin(gin_device::GinError::Spawn {
        rank: 2,
        what: "CUDA proxy thread",
        why: "no".into(),
    })
    .into();
    assert!(matches!(e, CoreError::Device(_)), "{e:?}");
}

#[test]
fn choices_parse_and_unknown_ones_list_the_alternatives() {
    let s = Settings::from_vars(vars(&[
        ("GIN_BACKEND", "proxy"),
        ("GIN_TRANSPORT", "tcp"),
        ("GIN_HOSTID", "h1"),
    ]))
    .unwrap();
    assert_eq!(
        (s.backend, s.transport, s.host_id.as_str()),
        (BackendKind::Proxy, TransportKind::TCP, "h1")
    );
    let e = Settings::from_vars(vars(&[("GIN_NIC", "cx9")]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("GIN_NIC=cx9") && e.contains("soft, mlx5"), "{e}");
    // A NIC for a backend that would ignore it is refused, not ignored.
    let e = Settings::from_vars(vars(&[("GIN_NIC", "mlx5")]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("GIN_NIC=mlx5")
            && e.contains("GIN_BACKEND is auto")
            && e.contains("GIN_BACKEND=gdaki"),
        "{e}"
    );
    let e = Settings::from_vars(vars(&[("GIN_NIC", "mlx5"), ("GIN_BACKEND", "proxy")]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("GIN_BACKEND is proxy"), "{e}");
    let s = Settings::from_vars(vars(&[("GIN_NIC", "mlx5"), ("GIN_BACKEND", "gdaki")])).unwrap();
    assert_eq!(s.nic, NicKind::Mlx5);
    // No ConnectX here (or anywhere CI runs): an error naming what is
    // missing, and the way out.
    let e = s.check_nic().unwrap_err().to_string();
    assert!(
        e.contains("GIN_NIC=mlx5") && e.contains("GIN_NIC=soft") && e.contains("RDMA")
            || e.contains("libmlx5.so.1"),
        "{e}"
    );
    let e = Settings::from_vars(vars(&[("GIN_BACKEND", "ibgda")]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("GIN_BACKEND=ibgda") && e.contains("auto, proxy, gdaki"),
        "{e}"
    );
    let e = Settings::from_vars(vars(&[("GIN_TRANSPORT", "rdma")]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("auto, shm, tcp"), "{e}");
    let e = Settings::from_vars(vars(&[("GIN_SIGNAL_SLOTS", "0")]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("GIN_SIGNAL_SLOTS"), "{e}");
}
