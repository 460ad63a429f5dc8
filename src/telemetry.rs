//! How the process reports: logging to stderr (human-readable or JSON lines), an error's
//! chain of causes, and the exit code of a configuration error.

use std::io::IsTerminal;

use clap::ValueEnum;
use tracing_subscriber::EnvFilter;

/// Exit code for a configuration or usage error detected before any work starts.
pub(crate) const EXIT_CONFIG: u8 = 2;

/// How log lines are written to stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum LogFormat {
    /// One readable line per event.
    Human,
    /// One JSON object per event, for log shippers.
    Json,
}

/// Installs the global subscriber; `RUST_LOG` overrides `default_level`.
pub(crate) fn init(format: LogFormat, default_level: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    // Colour only for a person at a terminal: log files and collectors get plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    // A second init (tests calling into the CLI twice) is harmless: keep the first subscriber.
    let _ = match format {
        LogFormat::Human => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

/// The message of an error followed by its causes, for logs and error events. A cause whose
/// text already ends the message is not repeated: many errors put their source in their own
/// message and return it as their `source()` too, and printing both doubled the cause.
pub(crate) fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let cause = s.to_string();
        if !out.ends_with(&cause) {
            out.push_str(": ");
            out.push_str(&cause);
        }
        source = s.source();
    }
    out
}

/// [`error_chain`] of an error at the edge of the program.
pub(crate) fn report(e: &anyhow::Error) -> String {
    error_chain(e.as_ref())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot listen on 127.0.0.1:1: {source}")]
    struct Bind {
        source: std::io::Error,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("config file x.toml")]
    struct Read {
        #[source]
        source: std::io::Error,
    }

    #[test]
    fn a_cause_already_in_the_message_is_printed_once() {
        let e = Bind {
            source: std::io::Error::new(std::io::ErrorKind::AddrInUse, "Address already in use"),
        };
        assert_eq!(
            error_chain(&e),
            "cannot listen on 127.0.0.1:1: Address already in use"
        );
        let wrapped = anyhow::Error::new(e).context("cannot start the simulator");
        assert_eq!(
            report(&wrapped),
            "cannot start the simulator: cannot listen on 127.0.0.1:1: Address already in use"
        );
    }

    #[test]
    fn a_cause_not_in_the_message_is_appended() {
        let e = Read {
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "No such file"),
        };
        assert_eq!(error_chain(&e), "config file x.toml: No such file");
    }
}
