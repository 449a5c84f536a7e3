//! Structured logs: `tracing` with a `tracing-subscriber` formatter on stderr.
//! `PLIANT_LOG` sets the filter (default `info`), `PLIANT_LOG_FORMAT=json` selects JSON lines,
//! anything else the compact human format.

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber once; later calls are no-ops (tests may call it repeatedly).
pub fn init() {
    let filter = EnvFilter::try_from_env("PLIANT_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let json = std::env::var("PLIANT_LOG_FORMAT").is_ok_and(|v| v == "json");
    // Colour codes only on a terminal: logs redirected to files must stay greppable.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    let _ = if json {
        b.json().try_init()
    } else {
        b.compact().try_init()
    };
}
