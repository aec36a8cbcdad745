//! What every binary and example of the project shares: `GIN_DEBUG` and how
//! a failed `main` is reported.
//!
//! The libraries install nothing global: they emit `tracing` events and
//! return typed errors, and the program that links them decides where logs
//! go. The project's own programs (gin-bench, the selftests, the examples,
//! xtask) all decide the same way by calling [`init_tracing_from_env`] first
//! and ending with [`exit_code`]. It lives here because gin-bootstrap is the
//! one crate all of them reach.

use std::error::Error;
use std::io::IsTerminal as _;
use std::process::ExitCode;

use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

/// The variable that sets the log filter, like `NCCL_DEBUG`.
pub const DEBUG_VAR: &str = "GIN_DEBUG";

/// What is logged when `GIN_DEBUG` is unset, and for every target it does not
/// name: warnings and errors.
const DEFAULT_LEVEL: LevelFilter = LevelFilter::WARN;

/// Parses a `GIN_DEBUG` value: comma-separated `level` or `target=level`
/// directives (`debug`, `gin_core=debug`, `gin_bootstrap=trace,info`), as
/// `RUST_LOG` without span filters. Targets it does not name stay at
/// warnings unless a bare level says otherwise.
pub fn parse_filter(value: &str) -> Result<Targets, String> {
    let targets: Targets = value
        .parse()
        .map_err(|e| format!("{DEBUG_VAR}={value:?} is not a log filter ({e}); expected e.g. `debug` or `gin_core=debug,warn`"))?;
    Ok(if targets.default_level().is_some() {
        targets
    } else {
        targets.with_default(DEFAULT_LEVEL)
    })
}

/// Whether `GIN_DEBUG` asks for logs (set and not empty). A front end that
/// spawns ranks uses it to pass their logs through.
pub fn tracing_requested() -> bool {
    std::env::var_os(DEBUG_VAR).is_some_and(|v| !v.is_empty())
}

/// For binaries, never libraries: logs `tracing` events to stderr, filtered by
/// `GIN_DEBUG` (warnings by default), with ANSI colours only when stderr is a
/// terminal. An unusable `GIN_DEBUG` is reported on stderr and the default
/// used. Does nothing if the program already installed a subscriber.
pub fn init_tracing_from_env() {
    let value = std::env::var(DEBUG_VAR).unwrap_or_default();
    let filter = if value.is_empty() {
        Targets::new().with_default(DEFAULT_LEVEL)
    } else {
        parse_filter(&value).unwrap_or_else(|e| {
            eprintln!("warning: {e}; logging warnings only");
            Targets::new().with_default(DEFAULT_LEVEL)
        })
    };
    let _ = tracing_subscriber::registry()
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_ansi(std::io::stderr().is_terminal()),
        )
        .with(filter)
        .try_init();
}

/// Ends a binary's `main`: success for `Ok`; for an error, one line on stderr
/// with the error's Display and its sources after colons
/// (`ring: creating the communicator: GIN_BACKEND=gdaki is unavailable: ...`),
/// never the Debug form, and exit status 1.
pub fn exit_code<E: Into<Box<dyn Error>>>(result: Result<(), E>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let program = std::env::args()
                .next()
                .and_then(|a| {
                    std::path::Path::new(&a)
                        .file_name()
                        .map(|f| f.to_string_lossy().into_owned())
                })
                .unwrap_or_else(|| "error".to_owned());
            eprintln!("{program}: {}", error_chain(&*e.into()));
            ExitCode::FAILURE
        }
    }
}

/// An error and its sources, joined by `: ` (sources already quoted in the
/// message, as anyhow's context does not do, appear once).
pub fn error_chain(e: &dyn Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let text = c.to_string();
        if !s.ends_with(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing::Level;

    #[test]
    fn a_target_filter_keeps_warnings_for_every_other_target() {
        let f = parse_filter("gin_core=debug").unwrap();
        assert!(f.would_enable("gin_core::comm", &Level::DEBUG));
        assert!(!f.would_enable("gin_net", &Level::INFO));
        assert!(f.would_enable("gin_net", &Level::WARN));
    }

    #[test]
    fn a_bare_level_applies_everywhere() {
        let f = parse_filter("debug").unwrap();
        assert!(f.would_enable("gin_bootstrap::root", &Level::DEBUG));
        assert!(!f.would_enable("gin_bootstrap::root", &Level::TRACE));
        let f = parse_filter("gin_net=trace,info").unwrap();
        assert!(f.would_enable("gin_net::tcp", &Level::TRACE));
        assert!(f.would_enable("gin_core", &Level::INFO));
    }

    #[test]
    fn a_bad_filter_is_an_error_naming_the_variable() {
        let e = parse_filter("gin_core=loud").unwrap_err();
        assert!(e.contains("GIN_DEBUG=\"gin_core=loud\""), "{e}");
    }

    #[test]
    fn error_chains_read_as_one_line_of_display() {
        #[derive(Debug)]
        struct Outer(std::io::Error);
        impl std::fmt::Display for Outer {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("creating the communicator")
            }
        }
        impl Error for Outer {
            fn source(&self) -> Option<&(dyn Error + 'static)> {
                Some(&self.0)
            }
        }
        let e = Outer(std::io::Error::other("backend gdaki is unavailable"));
        assert_eq!(
            error_chain(&e),
            "creating the communicator: backend gdaki is unavailable"
        );
    }
}
