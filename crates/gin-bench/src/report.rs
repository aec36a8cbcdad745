//! What a subcommand hands back: tables (printed, written as CSV, embedded
//! in the JSON so that `cargo xtask bench` renders Markdown without knowing
//! each benchmark's fields) and one JSON envelope for every subcommand.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

/// A table: a title, column names, rows of cells already formatted, notes.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Table {
    /// Short name (file suffix for extra CSV tables).
    pub name: String,
    pub title: String,
    pub columns: Vec<String>,
    pub rows: Vec<Vec<String>>,
    /// Sentences printed under the table.
    pub notes: Vec<String>,
}

impl Table {
    pub fn new(name: &str, title: impl Into<String>, columns: &[&str]) -> Self {
        Self {
            name: name.to_owned(),
            title: title.into(),
            columns: columns.iter().map(|c| (*c).to_owned()).collect(),
            rows: Vec::new(),
            notes: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub fn note(&mut self, s: impl Into<String>) {
        self.notes.push(s.into());
    }

    /// Right-aligned columns for a terminal.
    pub fn render_text(&self) -> String {
        let mut width: Vec<usize> = self.columns.iter().map(|c| c.chars().count()).collect();
        for r in &self.rows {
            for (i, c) in r.iter().enumerate() {
                if let Some(w) = width.get_mut(i) {
                    *w = (*w).max(c.chars().count());
                }
            }
        }
        let line = |cells: &[String]| {
            let mut s = String::new();
            for (i, c) in cells.iter().enumerate() {
                let w = width.get(i).copied().unwrap_or(0);
                let pad = w.saturating_sub(c.chars().count());
                let _ = write!(s, "{}{}{c}", if i > 0 { "  " } else { "" }, " ".repeat(pad));
            }
            s.push('\n');
            s
        };
        let mut out = format!("{}\n", self.title);
        out.push_str(&line(&self.columns));
        for r in &self.rows {
            out.push_str(&line(r));
        }
        for n in &self.notes {
            let _ = writeln!(out, "({n})");
        }
        out
    }

    /// RFC 4180 CSV: header then rows; cells with commas, quotes or line
    /// breaks are quoted.
    pub fn render_csv(&self) -> String {
        let cell = |c: &str| {
            if c.contains([',', '"', '\n', '\r']) {
                format!("\"{}\"", c.replace('"', "\"\""))
            } else {
                c.to_owned()
            }
        };
        let mut out = String::new();
        for r in std::iter::once(&self.columns).chain(&self.rows) {
            let cells: Vec<String> = r.iter().map(|c| cell(c)).collect();
            out.push_str(&cells.join(","));
            out.push('\n');
        }
        out
    }
}

/// The machine a result came from.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Host {
    pub hostname: String,
    pub cpu: String,
    /// CPUs this process may use.
    pub cores: usize,
    pub kernel: String,
    pub memory_gib: f64,
}

impl Host {
    pub fn probe() -> Self {
        let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
        let cpuinfo = read("/proc/cpuinfo");
        let cpu = cpuinfo
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split_once(':'))
            .map_or_else(
                || std::env::consts::ARCH.to_owned(),
                |(_, v)| v.trim().to_owned(),
            );
        let memory_kib: f64 = read("/proc/meminfo")
            .lines()
            .find(|l| l.starts_with("MemTotal:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        Self {
            hostname: read("/proc/sys/kernel/hostname").trim().to_owned(),
            cpu,
            cores: std::thread::available_parallelism().map_or(1, usize::from),
            kernel: read("/proc/sys/kernel/osrelease").trim().to_owned(),
            memory_gib: (memory_kib / f64::from(1u32 << 20) * 10.0).round() / 10.0,
        }
    }
}

/// The one JSON shape every subcommand writes with `--json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report<T> {
    /// The subcommand.
    pub bench: String,
    /// The command line that produced this, as typed.
    pub command: String,
    /// Every option as parsed (defaults filled in).
    pub args: serde_json::Value,
    pub host: Host,
    /// UTC date of the run, `YYYY-MM-DD`.
    pub date: String,
    pub tables: Vec<Table>,
    pub results: T,
}

impl<T: Serialize> Report<T> {
    pub fn new(bench: &str, args: &impl Serialize, tables: Vec<Table>, results: T) -> Result<Self> {
        Ok(Self {
            bench: bench.to_owned(),
            command: command_line(),
            args: serde_json::to_value(args)?,
            host: Host::probe(),
            date: today(),
            tables,
            results,
        })
    }

    /// Prints the tables, then writes `--json` and `--csv` where asked.
    pub fn finish(&self, json: Option<&Path>, csv: Option<&Path>) -> Result<()> {
        for t in &self.tables {
            println!("{}", t.render_text());
        }
        if let Some(path) = json {
            let _ = REPORT_WRITTEN.set(path.to_path_buf());
            std::fs::write(path, serde_json::to_string_pretty(self)?)
                .with_context(|| format!("writing {}", path.display()))?;
            eprintln!("wrote {}", path.display());
        }
        if let Some(path) = csv {
            for (i, t) in self.tables.iter().enumerate() {
                let p = if i == 0 {
                    path.to_path_buf()
                } else {
                    extra_csv_path(path, &t.name)
                };
                std::fs::write(&p, t.render_csv())
                    .with_context(|| format!("writing {}", p.display()))?;
                eprintln!("wrote {}", p.display());
            }
        }
        Ok(())
    }
}

/// The `--json` path this process wrote a whole report to, if any.
static REPORT_WRITTEN: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();

/// What one rank of a launched job writes with `--json` (a rank prints no
/// tables: the front end that would has not run). In a `--json` path,
/// `{rank}` stands for the rank, so that every rank of a multi-host job
/// (`cargo xtask cluster`) writes its own file; a path without it is written
/// by rank 0 only.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RankRecord {
    /// The subcommand.
    pub bench: String,
    /// The command line, as typed.
    pub command: String,
    /// This process's rank and the job's rank count.
    pub rank: usize,
    pub nranks: usize,
    /// Whose variables named the rank: `gin`, `torchrun`, `slurm`, `openmpi`.
    pub launcher: String,
    pub host: Host,
    /// UTC date of the run, `YYYY-MM-DD`.
    pub date: String,
    /// The error this rank ended with, if any.
    pub error: Option<String>,
    /// The result this rank printed for the job (rank 0 in most
    /// subcommands), else null.
    pub result: Option<serde_json::Value>,
}

/// `path` with `{rank}` replaced by `rank`; `None` when the path has no
/// `{rank}` and this is not rank 0 (one file, one writer).
pub fn rank_json_path(path: &Path, rank: usize) -> Option<std::path::PathBuf> {
    let text = path.to_string_lossy();
    if text.contains("{rank}") {
        Some(text.replace("{rank}", &rank.to_string()).into())
    } else {
        (rank == 0).then(|| path.to_path_buf())
    }
}

/// Where rank `rank`'s record goes ([`rank_json_path`]), unless this
/// process already wrote the whole report there (`written`): a subcommand
/// whose rank 0 writes the report itself (`cuda`, whose ranks are copies of
/// the command line) keeps it rather than have the shorter record replace it.
fn record_path(path: &Path, rank: usize, written: Option<&Path>) -> Option<PathBuf> {
    rank_json_path(path, rank).filter(|p| Some(p.as_path()) != written)
}

/// In a rank: writes its [`RankRecord`] to `path` (see [`rank_json_path`]).
pub fn write_rank_record(
    path: &Path,
    bench: &str,
    error: Option<String>,
    result: Option<serde_json::Value>,
) -> Result<()> {
    let env = gin_bootstrap::LaunchEnv::from_env()?;
    let Some(path) = record_path(path, env.rank, REPORT_WRITTEN.get().map(PathBuf::as_path)) else {
        return Ok(());
    };
    let rec = RankRecord {
        bench: bench.to_owned(),
        command: command_line(),
        rank: env.rank,
        nranks: env.nranks,
        launcher: env.launcher.to_owned(),
        host: Host::probe(),
        date: today(),
        error,
        result,
    };
    std::fs::write(&path, serde_json::to_string_pretty(&rec)?)
        .with_context(|| format!("rank {}: writing {}", env.rank, path.display()))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

/// `out.csv` + `params` -> `out-params.csv`: where tables after the first go.
pub fn extra_csv_path(path: &Path, name: &str) -> std::path::PathBuf {
    let stem = path
        .file_stem()
        .map_or_else(|| "table".into(), |s| s.to_string_lossy().into_owned());
    let ext = path
        .extension()
        .map_or_else(|| "csv".into(), |s| s.to_string_lossy().into_owned());
    path.with_file_name(format!("{stem}-{name}.{ext}"))
}

/// `gin-bench ARGS` as typed (arguments with spaces quoted).
fn command_line() -> String {
    let args = std::env::args().skip(1).map(|a| {
        if a.is_empty() || a.contains(|c: char| c.is_whitespace() || c == '\'') {
            format!("'{}'", a.replace('\'', "'\\''"))
        } else {
            a
        }
    });
    std::iter::once("gin-bench".to_owned())
        .chain(args)
        .collect::<Vec<_>>()
        .join(" ")
}

/// Today's UTC date.
fn today() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (y, m, d) = civil_from_days((secs / 86_400) as i64);
    format!("{y:04}-{m:02}-{d:02}")
}

/// Days since 1970-01-01 to a proleptic Gregorian (year, month, day), after
/// Howard Hinnant's `civil_from_days`.
pub fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// gin-bench cuda's rank 0 writes the whole report to --json; its rank
    /// record must not replace it (seen on the H200: the A/B's JSON files
    /// held a record with no result). Other ranks and {rank} paths still
    /// get their records.
    #[test]
    fn a_rank_keeps_the_report_it_wrote_and_records_elsewhere() {
        let p = Path::new("/tmp/r.json");
        assert_eq!(record_path(p, 0, Some(p)), None);
        assert_eq!(record_path(p, 0, None), Some(p.to_path_buf()));
        assert_eq!(record_path(p, 1, None), None);
        let each = Path::new("/tmp/r-{rank}.json");
        assert_eq!(
            record_path(each, 0, Some(p)),
            Some(PathBuf::from("/tmp/r-0.json"))
        );
    }

    #[test]
    fn rank_placeholders_give_each_rank_its_own_file() {
        let p = Path::new("/out/rank-{rank}.json");
        assert_eq!(rank_json_path(p, 3), Some("/out/rank-3.json".into()));
        let one = Path::new("/out/job.json");
        assert_eq!(rank_json_path(one, 0), Some(one.to_path_buf()));
        assert_eq!(rank_json_path(one, 1), None, "one file, one writer: rank 0");
    }

    #[test]
    fn dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(31 + 28), (1970, 3, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
        assert_eq!(civil_from_days(20_454), (2026, 1, 1));
    }

    #[test]
    fn csv_quotes_what_it_must() {
        let mut t = Table::new("x", "title", &["a", "b"]);
        t.row(vec!["1".into(), "x, y".into()]);
        t.row(vec!["say \"hi\"".into(), "2".into()]);
        assert_eq!(t.render_csv(), "a,b\n1,\"x, y\"\n\"say \"\"hi\"\"\",2\n");
    }

    #[test]
    fn text_aligns_columns() {
        let mut t = Table::new("x", "T", &["size", "µs"]);
        t.row(vec!["8 B".into(), "0.125".into()]);
        t.note("n");
        assert_eq!(t.render_text(), "T\nsize     µs\n 8 B  0.125\n(n)\n");
    }

    #[test]
    fn extra_tables_get_suffixed_names() {
        assert_eq!(
            extra_csv_path(Path::new("/tmp/out.csv"), "params"),
            Path::new("/tmp/out-params.csv")
        );
        assert_eq!(extra_csv_path(Path::new("o"), "p"), Path::new("o-p.csv"));
    }
}
