//! A progress bar on stderr for the front end, fed by rank 0.
//!
//! Ranks run in child processes whose output the launcher captures, so rank 0
//! reports progress by appending one byte per finished unit of work to a file
//! named by `GIN_BENCH_PROGRESS`; the front end polls the file's length. The
//! bar is hidden when stderr is not a terminal, and appears only once a job
//! has run for a couple of seconds: short runs print nothing extra.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// The variable that names the progress file.
pub const ENV: &str = "GIN_BENCH_PROGRESS";

/// How long a job runs before its bar appears.
const SHOW_AFTER: Duration = Duration::from_secs(2);

/// The front end's bar over `total` units of work, spread over jobs.
#[derive(Debug)]
pub struct Progress {
    bar: ProgressBar,
    start: Instant,
    visible: AtomicBool,
    done: AtomicU64,
}

impl Progress {
    pub fn new(total: u64, what: &str) -> Self {
        let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::hidden());
        if let Ok(style) = ProgressStyle::with_template(
            "{msg} [{elapsed_precise}] {wide_bar} {pos}/{len} (eta {eta})",
        ) {
            bar.set_style(style);
        }
        bar.set_message(what.to_owned());
        Self {
            bar,
            start: Instant::now(),
            visible: AtomicBool::new(false),
            done: AtomicU64::new(0),
        }
    }

    fn show_if_due(&self) {
        if !self.visible.load(Ordering::Relaxed)
            && self.start.elapsed() >= SHOW_AFTER
            && std::io::stderr().is_terminal()
        {
            self.visible.store(true, Ordering::Relaxed);
            self.bar.set_draw_target(ProgressDrawTarget::stderr());
        }
    }

    /// Runs one job worth `units`, passing it the environment that lets its
    /// rank 0 report progress; the bar follows while the job runs.
    pub fn job<T>(
        &self,
        units: u64,
        run: impl FnOnce(Vec<(String, String)>) -> anyhow::Result<T>,
    ) -> anyhow::Result<T> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "gin-bench-progress-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_file(&path);
        let base = self.done.load(Ordering::Relaxed);
        let finished = AtomicBool::new(false);
        let result = std::thread::scope(|s| {
            s.spawn(|| {
                while !finished.load(Ordering::Relaxed) {
                    self.show_if_due();
                    let n = std::fs::metadata(&path).map_or(0, |m| m.len());
                    self.bar.set_position(base + n.min(units));
                    // A display refresh, ten times a second: this thread only
                    // reads how far rank 0 got, off every measured path.
                    std::thread::sleep(Duration::from_millis(100));
                }
            });
            let env = vec![(ENV.to_owned(), path.to_string_lossy().into_owned())];
            let r = run(env);
            finished.store(true, Ordering::Relaxed);
            r
        });
        let _ = std::fs::remove_file(&path);
        self.done.fetch_add(units, Ordering::Relaxed);
        self.bar.set_position(self.done.load(Ordering::Relaxed));
        result
    }

    /// Prints a line above the bar (or plainly when there is none).
    pub fn println(&self, line: &str) {
        if self.visible.load(Ordering::Relaxed) {
            self.bar.println(line);
        } else {
            eprintln!("{line}");
        }
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// In a rank: one unit of work done (rank 0 reports; others call it too and
/// nothing happens unless their environment names a file).
pub fn tick(rank: usize) {
    static FILE: OnceLock<Option<Mutex<std::fs::File>>> = OnceLock::new();
    if rank != 0 {
        return;
    }
    let f = FILE.get_or_init(|| {
        let path = PathBuf::from(std::env::var_os(ENV)?);
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .ok()
            .map(Mutex::new)
    });
    if let Some(f) = f
        && let Ok(mut f) = f.lock()
    {
        // Progress is advisory: a failed write only stalls the bar.
        let _ = f.write_all(b".");
    }
}
