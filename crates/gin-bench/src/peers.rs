//! Peers measured in the same job (`gin-bench cuda --peer-json FILE`):
//! another system's figures for the same test, coop and size, read from the
//! JSON a peer program wrote on the same machine in the same run (NVSHMEM:
//! `xtask/gpu/peers/nvshmem_pingpong.cu`, built and run by
//! `xtask/gpu/peers/peers.sh`), printed beside gin-rs's with the ratio.
//!
//! No figure from another run stands in for a peer: when the file is not
//! there, the peer's column says why, read from the `.why` file the peer's
//! script leaves beside it (`peer-nvshmem.json` -> `peer-nvshmem.why`).
//!
//! The peer JSON: `{"peer": NAME, "like": PATH, "results": [ROW...]}`
//! (other keys are ignored; `like`, optional, is the gin-rs path the peer's
//! figures compare with: NVSHMEM within one host moves data by load/store,
//! so its figures stand beside gin-rs's load/store rows only), each ROW `{"test": "pingpong"|"bandwidth", "path", "coop",
//! "threads", "bytes", "value": {"n", "median", "p10", "p90", "p99", "min",
//! "max"}}` — the shape of gin-bench cuda's own rows. `coop` is `thread`,
//! `warp` or `block` for the ping-pong (with `threads` the block's threads)
//! and `NxT threads, signal last` for bandwidth, as gin-bench writes it.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::cuda::CudaTest;
use crate::stats::Summary;

/// One of a peer's figures.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PeerRow {
    /// Which measurement.
    pub test: CudaTest,
    /// The peer's path (`nvshmem`).
    pub path: String,
    /// As gin-bench cuda's rows: `thread` / `warp` / `block`, or
    /// `NxT threads, signal last` for bandwidth.
    pub coop: String,
    /// Threads of the coop's block (1, 32, the block's; bandwidth: per
    /// block). Absent: any.
    #[serde(default)]
    pub threads: Option<u32>,
    /// Message size.
    pub bytes: u64,
    /// Over launches: round-trip µs (ping-pong) or GB/s (bandwidth).
    pub value: Summary,
}

/// What a peer file holds.
#[derive(Debug, Clone, Deserialize)]
struct PeerFile {
    peer: String,
    #[serde(default)]
    like: Option<String>,
    results: Vec<PeerRow>,
}

/// A peer as gin-bench found it: its figures, or why there are none.
#[derive(Debug, Clone, PartialEq)]
pub enum Peer {
    /// The peer ran; its figures.
    Found {
        /// What it is (`NVSHMEM 3.4.5`).
        name: String,
        /// Where its figures came from.
        file: PathBuf,
        /// The gin-rs path its figures compare with (any, when absent).
        like: Option<String>,
        /// Its figures.
        rows: Vec<PeerRow>,
    },
    /// No figures, and why.
    Missing {
        /// The file's name without `peer-` and the extension (`nvshmem`).
        name: String,
        /// Why: the `.why` file's text, or what went wrong reading.
        why: String,
    },
}

/// The figure a peer gives one of gin-rs's rows.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PeerCell {
    /// The peer's name.
    pub peer: String,
    /// Its median for the same test, coop, size and threads.
    pub value: Option<f64>,
    /// gin-rs's median / the peer's.
    pub ratio: Option<f64>,
    /// Why there is no value.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
}

impl Peer {
    /// Reads `file`; never fails: a missing or unreadable file is a
    /// [`Peer::Missing`] saying why.
    pub fn load(file: &Path) -> Peer {
        let stem = file
            .file_stem()
            .map_or_else(|| "peer".into(), |s| s.to_string_lossy().into_owned());
        let name = stem.strip_prefix("peer-").unwrap_or(&stem).to_owned();
        let text = match std::fs::read_to_string(file) {
            Ok(t) => t,
            Err(e) => {
                let why_file = file.with_extension("why");
                let why = match std::fs::read_to_string(&why_file) {
                    Ok(w) if !w.trim().is_empty() => w.trim().to_owned(),
                    _ => format!(
                        "{} could not be read ({e}) and no {} says why: was the peer run?",
                        file.display(),
                        why_file.display()
                    ),
                };
                return Peer::Missing { name, why };
            }
        };
        match serde_json::from_str::<PeerFile>(&text) {
            Ok(p) => Peer::Found {
                name: p.peer,
                file: file.to_path_buf(),
                like: p.like,
                rows: p.results,
            },
            Err(e) => Peer::Missing {
                name,
                why: format!("{} is not a peer's results: {e}", file.display()),
            },
        }
    }

    /// The column's name.
    pub fn name(&self) -> &str {
        match self {
            Peer::Found { name, .. } | Peer::Missing { name, .. } => name,
        }
    }

    /// This peer's figure for gin-rs's row (`test` on `path`, `coop`,
    /// `bytes`, run by blocks of `threads`) whose median is `median`.
    #[allow(clippy::too_many_arguments)] // one row's identity, spelled out
    pub fn cell(
        &self,
        test: CudaTest,
        path: &str,
        coop: &str,
        bytes: u64,
        threads: u32,
        median: f64,
    ) -> PeerCell {
        let (value, why) = match self {
            Peer::Missing { why, .. } => (None, Some(format!("not run: {why}"))),
            Peer::Found {
                like: Some(like), ..
            } if like != path => (None, Some(format!("the peer compares with {like} rows"))),
            Peer::Found { rows, .. } => {
                let same = |r: &&PeerRow| r.test == test && r.coop == coop && r.bytes == bytes;
                let mut like = rows.iter().filter(same).peekable();
                let first_threads = like.peek().and_then(|r| r.threads);
                match like
                    .clone()
                    .find(|r| r.threads.is_none_or(|t| t == threads))
                {
                    Some(r) => (Some(r.value.median), None),
                    None => match first_threads {
                        Some(t) => (
                            None,
                            Some(format!(
                                "measured with {t} threads, this row with {threads}"
                            )),
                        ),
                        None => (None, Some("not measured by the peer".into())),
                    },
                }
            }
        };
        PeerCell {
            peer: self.name().to_owned(),
            ratio: value.map(|v| median / v),
            value,
            why,
        }
    }
}

impl PeerCell {
    /// The table's text: `2.76 (1.02x)`, or `- (why)`.
    pub fn text(&self) -> String {
        match (self.value, self.ratio, &self.why) {
            (Some(v), Some(r), _) => format!("{v:.2} ({r:.2}x)"),
            (_, _, Some(why)) => format!("- ({})", short(why, 70)),
            _ => "-".into(),
        }
    }
}

/// At most `max` characters of `s`, with `...` where it was cut.
fn short(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_owned()
    } else {
        let cut: String = s.chars().take(max.saturating_sub(3)).collect();
        format!("{cut}...")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// As nvshmem_pingpong.cu writes it.
    const NVSHMEM: &str = r#"{
  "bench": "peer",
  "peer": "NVSHMEM 3.4.5",
  "path": "nvshmem",
  "like": "load/store",
  "gpu": "NVIDIA H200",
  "gpus": 1,
  "runs": 5,
  "results": [
    {"test": "pingpong", "path": "nvshmem", "coop": "warp", "threads": 32, "blocks": 1, "bytes": 8, "value": {"n": 5, "median": 2.76, "p10": 2.7, "p90": 2.8, "p99": 2.81, "min": 2.7, "max": 2.81}},
    {"test": "pingpong", "path": "nvshmem", "coop": "block", "threads": 1024, "blocks": 1, "bytes": 1024, "value": {"n": 5, "median": 2.91, "p10": 2.9, "p90": 2.95, "p99": 2.96, "min": 2.9, "max": 2.96}},
    {"test": "bandwidth", "path": "nvshmem", "coop": "16x512 threads, signal last", "threads": 512, "blocks": 16, "bytes": 4194304, "value": {"n": 5, "median": 400, "p10": 390, "p90": 410, "p99": 411, "min": 390, "max": 411}}
  ]
}
"#;

    /// A directory of this test's own under the system's temporary one.
    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("gin-bench-peers-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn reads_the_nvshmem_peer_and_matches_test_coop_size_and_threads() {
        let dir = scratch("found");
        let f = dir.join("peer-nvshmem.json");
        std::fs::write(&f, NVSHMEM).unwrap();
        let p = Peer::load(&f);
        assert_eq!(p.name(), "NVSHMEM 3.4.5");
        let Peer::Found { rows, file, .. } = &p else {
            panic!("{p:?}")
        };
        assert_eq!((rows.len(), file.as_path()), (3, f.as_path()));
        let c = p.cell(CudaTest::Pingpong, "load/store", "warp", 8, 32, 2.82);
        assert_eq!(c.value, Some(2.76));
        assert!((c.ratio.unwrap() - 2.82 / 2.76).abs() < 1e-12);
        assert_eq!(c.text(), "2.76 (1.02x)");
        let bw = p.cell(
            CudaTest::Bandwidth,
            "load/store",
            "16x512 threads, signal last",
            4 << 20,
            512,
            420.0,
        );
        assert_eq!(bw.text(), "400.00 (1.05x)");
        // NVSHMEM within a host is a load/store path: the proxy's rows are
        // not set beside it.
        let proxy = p.cell(CudaTest::Pingpong, "proxy", "warp", 8, 32, 13.0);
        assert_eq!(proxy.value, None);
        assert_eq!(proxy.text(), "- (the peer compares with load/store rows)");
        // The block coop with another thread count is not the same row.
        let b = p.cell(CudaTest::Pingpong, "load/store", "block", 1024, 512, 3.84);
        assert_eq!(b.value, None);
        assert_eq!(
            b.why.as_deref(),
            Some("measured with 1024 threads, this row with 512")
        );
        assert_eq!(
            p.cell(CudaTest::Pingpong, "load/store", "block", 1024, 1024, 3.84)
                .value,
            Some(2.91)
        );
        // Nothing for that size or test.
        for (t, coop, bytes) in [
            (CudaTest::Pingpong, "warp", 64),
            (CudaTest::Alltoall, "2 ranks", 8),
            (CudaTest::Pingpong, "thread", 8),
        ] {
            let c = p.cell(t, "load/store", coop, bytes, 32, 1.0);
            assert_eq!(
                c.text(),
                "- (not measured by the peer)",
                "{t:?} {coop} {bytes}"
            );
            assert_eq!(c.ratio, None);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_missing_peer_says_why_from_its_why_file() {
        let d = scratch("why");
        let f = d.join("peer-nvshmem.json");
        std::fs::write(
            d.join("peer-nvshmem.why"),
            "one GPU and no MPS daemon: its two PEs would be time-sliced\n",
        )
        .unwrap();
        let p = Peer::load(&f);
        assert_eq!(
            p,
            Peer::Missing {
                name: "nvshmem".into(),
                why: "one GPU and no MPS daemon: its two PEs would be time-sliced".into()
            }
        );
        let c = p.cell(CudaTest::Pingpong, "load/store", "warp", 8, 32, 2.82);
        assert_eq!((c.value, c.ratio), (None, None));
        assert_eq!(
            c.why.as_deref(),
            Some("not run: one GPU and no MPS daemon: its two PEs would be time-sliced")
        );
        assert_eq!(
            c.text(),
            "- (not run: one GPU and no MPS daemon: its two PEs would be time-sliced)"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn no_file_and_no_reason_or_a_bad_file_say_so() {
        let d = scratch("none");
        let f = d.join("peer-nccl.json");
        let Peer::Missing { name, why } = Peer::load(&f) else {
            panic!("found a peer in an empty directory")
        };
        assert_eq!(name, "nccl");
        assert!(why.contains("peer-nccl.json could not be read"), "{why}");
        assert!(
            why.contains("peer-nccl.why says why: was the peer run?"),
            "{why}"
        );
        std::fs::write(&f, "{\"peer\": \"x\"}").unwrap();
        let Peer::Missing { why, .. } = Peer::load(&f) else {
            panic!("a file without results is no peer")
        };
        assert!(why.contains("is not a peer's results"), "{why}");
        assert!(why.contains("results"), "{why}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn long_reasons_are_cut_on_characters() {
        assert_eq!(short("abc", 3), "abc");
        assert_eq!(short("abcdef", 5), "ab...");
        assert_eq!(short("µµµµµµ", 5), "µµ...");
    }
}
