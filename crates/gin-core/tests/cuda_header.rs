//! The CUDA header (`gin/gin.cuh`) compiled as host C++ produces the same
//! ABI layout, descriptor bytes, WQE bytes and error words as the Rust
//! encoders (whose golden vectors are reviewed in gin-proxy and gin-gdaki).
//!
//! Needs a C++ compiler (`CXX`, else `c++`): skipped with a printed reason
//! where there is none, except in CI (`CI` set), where that is a failure.

use std::collections::HashMap;
use std::mem::{offset_of, size_of};
use std::path::{Path, PathBuf};
use std::process::Command;

use gin_device::abi::{self, DevCommAbi, GdakiQpAbi, GdakiSqAbi, ProxyRingAbi, WindowAbi, errword};
use gin_gdaki::wqe::{self, MemRef, Op as WqeOp};
use gin_proxy::descriptor::{Desc, MAX_BYTES, MAX_FIELD, MAX_ID, Op, Sig};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Compiles and runs header_host.cpp; `None` (after saying why) when no
/// compiler exists outside CI.
fn host_output() -> Option<HashMap<String, String>> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let out = std::env::temp_dir().join(format!("gin-header-host-{}", std::process::id()));
    let r = root();
    let status = Command::new(&cxx)
        .args(["-std=c++17", "-Wall", "-Wextra", "-Werror", "-O1"])
        .arg("-I")
        .arg(r.join("crates/gin-device/include"))
        .arg("-I")
        .arg(r.join("crates/gin-proxy/include"))
        .arg("-I")
        .arg(r.join("crates/gin-gdaki/include"))
        .arg(r.join("crates/gin-core/tests/header_host.cpp"))
        .arg("-o")
        .arg(&out)
        .status();
    match status {
        Err(e) => {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI needs a C++ compiler for the header test: {cxx}: {e}"
            );
            eprintln!("skipped: no C++ compiler ({cxx}: {e}); set CXX to run this test");
            return None;
        }
        Ok(s) => assert!(
            s.success(),
            "{cxx} failed to compile the header as host C++"
        ),
    }
    let run = Command::new(&out).output().expect("run the host program");
    let _ = std::fs::remove_file(&out);
    assert!(run.status.success(), "host program failed");
    let text = String::from_utf8(run.stdout).expect("utf-8");
    Some(
        text.lines()
            .filter_map(|l| l.split_once(' '))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
    )
}

fn hex(b: &[u8]) -> String {
    use std::fmt::Write as _;
    b.iter().fold(String::new(), |mut s, x| {
        let _ = write!(s, "{x:02x}");
        s
    })
}

fn qwords(q: &[u64; 8]) -> String {
    q.iter()
        .map(|w| format!("{w:016x}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The host program's xorshift64*.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

#[test]
#[allow(clippy::too_many_lines)] // a table of golden cases, one per line of the C++ side
fn header_matches_rust_abi_and_encoders() {
    let Some(h) = host_output() else { return };
    let get = |k: &str| h.get(k).unwrap_or_else(|| panic!("{k} missing")).clone();
    let num = |k: &str| get(k).parse::<usize>().expect("number");

    for (name, v) in [
        ("flag.STRONG_SIGNALS", abi::DEVCOMM_FLAG_STRONG_SIGNALS),
        ("flag.VA_SIGNALS", abi::DEVCOMM_FLAG_VA_SIGNALS),
        ("flag.EXCLUSIVE_CTX", abi::DEVCOMM_FLAG_EXCLUSIVE_CTX),
        ("flag.SENDER_SLOTS", abi::DEVCOMM_FLAG_SENDER_SLOTS),
        ("flag.CTA_CTX", abi::DEVCOMM_FLAG_CTA_CTX),
        ("flag.LSA_ONLY", abi::DEVCOMM_FLAG_LSA_ONLY),
        ("flag.QUEUE_ATOMICS", abi::DEVCOMM_FLAG_QUEUE_ATOMICS),
        ("fence.NONE", abi::FENCE_NONE),
        ("fence.CONTEXT", abi::FENCE_CONTEXT),
        ("fence.ALL_CONTEXTS", abi::FENCE_ALL_CONTEXTS),
        ("backend.NONE", abi::BACKEND_NONE),
        ("backend.PROXY", abi::BACKEND_PROXY),
        ("backend.GDAKI", abi::BACKEND_GDAKI),
    ] {
        assert_eq!(num(name), v as usize, "{name}");
    }
    assert_eq!(num("sizeof.DevComm"), size_of::<DevCommAbi>());
    assert_eq!(num("sizeof.Window"), size_of::<WindowAbi>());
    assert_eq!(num("sizeof.ProxyRingAbi"), size_of::<ProxyRingAbi>());
    assert_eq!(
        num("offset.DevComm.timeout_ticks"),
        offset_of!(DevCommAbi, timeout_ticks)
    );
    assert_eq!(
        num("offset.DevComm.error_word"),
        offset_of!(DevCommAbi, error_word)
    );
    assert_eq!(num("offset.Window.sizes"), offset_of!(WindowAbi, sizes));
    for (f, rust) in [
        ("rings", offset_of!(DevCommAbi, rings)),
        ("backend_kind", offset_of!(DevCommAbi, backend_kind)),
        ("lsa", offset_of!(DevCommAbi, lsa)),
        ("signal_peers", offset_of!(DevCommAbi, signal_peers)),
        ("signal_window", offset_of!(DevCommAbi, signal_window)),
    ] {
        assert_eq!(num(&format!("offset.DevComm.{f}")), rust, "DevComm.{f}");
    }
    assert_eq!(
        num("offset.ProxyRingAbi.head"),
        offset_of!(ProxyRingAbi, head)
    );
    assert_eq!(num("sizeof.GdakiSqAbi"), size_of::<GdakiSqAbi>());
    assert_eq!(num("sizeof.GdakiQpAbi"), size_of::<GdakiQpAbi>());
    for (f, rust) in [
        ("GdakiSqAbi.indices", offset_of!(GdakiSqAbi, indices)),
        ("GdakiSqAbi.log2", offset_of!(GdakiSqAbi, log2)),
        ("GdakiQpAbi.companion", offset_of!(GdakiQpAbi, companion)),
        (
            "GdakiQpAbi.counter_key",
            offset_of!(GdakiQpAbi, counter_key),
        ),
        ("GdakiQpAbi.sink_key", offset_of!(GdakiQpAbi, sink_key)),
    ] {
        assert_eq!(num(&format!("offset.{f}")), rust, "{f}");
    }
    assert_eq!(num("errkind.WQE_ERROR"), usize::from(errword::WQE_ERROR));
    assert_eq!(
        num("errkind.COPY_ENGINE"),
        usize::from(errword::COPY_ENGINE)
    );
    assert_eq!(
        num("errkind.PATH_NOT_BUILT"),
        usize::from(errword::PATH_NOT_BUILT)
    );
    // Both queue paths unless a kernel's build asks for fewer.
    assert_eq!(num("queue_paths.default"), 3);

    let golden = Desc {
        op: Op::Put,
        bytes: 4096,
        dst_window: 3,
        dst_offset: 0x100,
        src_window: 2,
        src_offset: 0x40,
        inline: None,
        signal: Some(Sig {
            window: 1,
            offset: 0x18,
            add: 1,
            strong: true,
        }),
        counter: Some(5),
    };
    assert_eq!(get("desc.golden_put"), qwords(&golden.encode(5, 2)));
    let inline = Desc {
        op: Op::Put,
        bytes: 8,
        dst_window: 7,
        dst_offset: 8,
        src_window: 0,
        src_offset: 0,
        inline: Some(0x8000_0000_0000_00ff),
        signal: None,
        counter: None,
    };
    assert_eq!(get("desc.golden_inline"), qwords(&inline.encode(0, 4)));
    let signal_top = Desc {
        op: Op::Put,
        bytes: 0,
        dst_window: 1,
        dst_offset: 0,
        src_window: 0,
        src_offset: 0,
        inline: None,
        signal: Some(Sig {
            window: 1,
            offset: 0x18,
            add: (1 << 63) + 5,
            strong: true,
        }),
        counter: None,
    };
    assert_eq!(
        get("desc.golden_signal_top"),
        qwords(&signal_top.encode(0, 2))
    );

    // A 2-byte put_value with a weak VA signal: the descriptor carries the
    // size and any signal window, which the proxy engine checks.
    let value2 = Desc {
        op: Op::Put,
        bytes: 2,
        dst_window: 6,
        dst_offset: 0x22,
        src_window: 0,
        src_offset: 0,
        inline: Some(0xbeef),
        signal: Some(Sig {
            window: 4,
            offset: 0x40,
            add: 3,
            strong: false,
        }),
        counter: None,
    };
    assert_eq!(get("desc.golden_value2_va"), qwords(&value2.encode(9, 3)));

    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for i in 0..64 {
        let op = if rng.next() & 1 == 1 {
            Op::Put
        } else {
            Op::Get
        };
        let bytes = rng.next() & MAX_BYTES;
        let dst_window = (rng.next() & u64::from(MAX_ID)) as u32;
        let src_window = (rng.next() & u64::from(MAX_ID)) as u32;
        let dst_offset = rng.next() & MAX_FIELD;
        let src_offset = rng.next() & MAX_FIELD;
        let has_inline = op == Op::Put && rng.next() & 1 == 1;
        let inline = has_inline.then(|| rng.next());
        let signal = (rng.next() & 1 == 1).then(|| Sig {
            window: (rng.next() & u64::from(MAX_ID)) as u32,
            offset: rng.next() & MAX_FIELD,
            add: rng.next(),
            strong: rng.next() & 1 == 1,
        });
        let counter = (rng.next() & 1 == 1).then(|| (rng.next() & u64::from(MAX_ID)) as u32);
        let seq = rng.next();
        let log2 = (rng.next() % 20) as u32;
        let d = Desc {
            op,
            bytes,
            dst_window,
            dst_offset,
            src_window,
            src_offset,
            inline,
            signal,
            counter,
        };
        d.validate().expect("in range");
        assert_eq!(
            get(&format!("desc.random{i}")),
            qwords(&d.encode(seq, log2)),
            "random descriptor {i}: {d:?} at {seq}/{log2}"
        );
    }

    let m = |addr, key| MemRef { addr, key };
    let cases = [
        (
            "wqe.write",
            WqeOp::Write {
                remote: m(0x1122_3344_5566_7788, 0xaabb_ccdd),
                local: m(0x0000_7f00_0000_1000, 0x0102_0304),
                len: 4096,
            },
            0x1234,
            0x00ab_cdef,
            wqe::CQ_UPDATE,
        ),
        (
            "wqe.read",
            WqeOp::Read {
                remote: m(0x1000, 9),
                local: m(0x2000, 10),
                len: 64,
            },
            7,
            0x42,
            wqe::CQ_UPDATE,
        ),
        (
            "wqe.fetch_add",
            WqeOp::FetchAdd {
                remote: m(0x10, 7),
                add: 1,
                result: m(0x20, 9),
            },
            0xffff,
            5,
            wqe::CQ_UPDATE | wqe::FM_STRONG_ORDERING,
        ),
        (
            "wqe.compare_swap",
            WqeOp::CompareSwap {
                remote: m(0x18, 7),
                compare: 11,
                swap: 12,
                result: m(0x28, 9),
            },
            3,
            5,
            wqe::CQ_UPDATE,
        ),
        (
            "wqe.inline",
            WqeOp::WriteInline {
                remote: m(0x40, 3),
                data: vec![1, 2, 3, 4, 5, 6, 7, 8],
            },
            2,
            1,
            wqe::CQ_UPDATE,
        ),
        (
            "wqe.inline_value8",
            WqeOp::WriteInline {
                remote: m(0x40, 3),
                data: vec![1, 2, 3, 4, 5, 6, 7, 8],
            },
            2,
            1,
            wqe::CQ_UPDATE,
        ),
        (
            "wqe.inline1",
            WqeOp::WriteInline {
                remote: m(0x41, 3),
                data: vec![1],
            },
            4,
            1,
            wqe::CQ_UPDATE,
        ),
        (
            "wqe.inline2",
            WqeOp::WriteInline {
                remote: m(0x42, 3),
                data: vec![1, 2],
            },
            5,
            1,
            wqe::CQ_UPDATE,
        ),
        (
            "wqe.inline4",
            WqeOp::WriteInline {
                remote: m(0x44, 3),
                data: vec![1, 2, 3, 4],
            },
            6,
            1,
            wqe::CQ_UPDATE,
        ),
        (
            "wqe.wait",
            WqeOp::Wait {
                max_index: 0x1_0203,
                cqn: 0x42,
            },
            9,
            2,
            wqe::CQ_UPDATE,
        ),
        ("wqe.nop", WqeOp::Nop, 0x55, 0x77, 0),
    ];
    for (name, op, index, qpn, fm) in cases {
        let b = wqe::encode(&op, index, qpn, fm).expect("valid WQE");
        assert_eq!(get(name), hex(&b), "{name}");
    }
    // Kernels read the collapsed CQE's last qword and unwrap its 16-bit
    // WQE counter as the NIC's Rust side writes and unwraps them.
    let mut rng = Rng(0x243f_6a88_85a3_08d3);
    for i in 0..64 {
        let tail = rng.next();
        let c = rng.next() as u16;
        let near = rng.next();
        let mut b = [0u8; 64];
        b[56..].copy_from_slice(&tail.to_le_bytes());
        let cqe = gin_gdaki::completion::Cqe::decode(&b);
        let want = format!(
            "{tail:016x} {} {} {:016x}",
            cqe.opcode,
            cqe.wqe_counter,
            gin_gdaki::queue::unwrap_counter(c, near)
        );
        assert_eq!(get(&format!("cqe.{i}")), want, "cqe.{i}");
    }
    assert_eq!(
        get("doorbell"),
        format!("{:016x}", wqe::doorbell(0x0102, 0x00ab_cdef))
    );
    assert_eq!(
        get("errword"),
        format!(
            "{:016x}",
            errword::encode(errword::OUT_OF_WINDOW, 3, Some(7), 0xdead_beef)
        )
    );
    assert_eq!(
        get("errword_none"),
        format!("{:016x}", errword::encode(errword::ABORTED, 1000, None, 1))
    );
    assert_eq!(
        get("errword_copy_engine"),
        format!(
            "{:016x}",
            errword::encode(errword::COPY_ENGINE, 0, Some(1), 9)
        )
    );
}
