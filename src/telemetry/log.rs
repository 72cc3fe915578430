//! Log setup: the subscriber, its filter, and the client-noise summary.
//!
//! Owns what reaches the log. A client can make the HTTP layer log one
//! error per connection (a malformed request, a stream broken off, a body
//! cut off for being too slow) at will, so those events never reach the
//! output one by one: they are counted, exported as
//! `tollgate_malformed_requests_total`, and summarised in at most one
//! warning per [`NOISE_REPORT_PERIOD_MS`] ([`ClientNoise::report`]).
//! Logs go to stderr (stdout is left to command output such as the demo's
//! banner), as text (colour codes only on a terminal) or as one JSON
//! object per line (`log.format`).

use std::io::IsTerminal as _;
use std::sync::atomic::{AtomicU64, Ordering};

use metrics::Counter;
use tracing::{Level, Metadata, Subscriber};
use tracing_subscriber::Layer;
use tracing_subscriber::filter::filter_fn;
use tracing_subscriber::layer::{Context, SubscriberExt as _};
use tracing_subscriber::util::SubscriberInitExt as _;

use super::MALFORMED_REQUESTS_TOTAL;
use crate::config::{LogFormat, LogSettings};

/// Client-caused events seen since start.
static NOISE: AtomicU64 = AtomicU64::new(0);

/// Shortest time between two client-noise warnings.
const NOISE_REPORT_PERIOD_MS: u64 = 60_000;

/// The filter for a configured level: a bare level (`info`, `debug`)
/// applies to tollgate while other crates stay at `warn`; anything else is a
/// full `tracing` filter used as written.
pub fn log_filter(level: &str) -> String {
    let bare = ["error", "warn", "info", "debug", "trace", "off"];
    if bare.contains(&level.trim()) {
        format!("warn,tollgate={}", level.trim())
    } else {
        level.to_owned()
    }
}

/// Whether an event is one the admin listener's HTTP layer logs per
/// connection over a client's doing (warnings and errors of actix-http's
/// HTTP/1 code). The proxy listener counts its own with
/// [`count_client_noise`].
fn is_client_noise(meta: &Metadata<'_>) -> bool {
    meta.is_event() && is_noise_source(meta.target(), *meta.level())
}

/// Whether `target` logs at `level` only over a client's doing.
fn is_noise_source(target: &str, level: Level) -> bool {
    level <= Level::WARN && target.starts_with("actix_http::h1")
}

/// Counts one client connection that ended in an error (a malformed
/// request, a stream broken off), for the summary.
pub fn count_client_noise() {
    NOISE.fetch_add(1, Ordering::Relaxed);
}

/// Counts client-noise events (the output layer filters them out).
struct CountNoise;

impl<S: Subscriber> Layer<S> for CountNoise {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        if is_client_noise(event.metadata()) {
            NOISE.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The target of access-log lines (`log.access`).
pub const ACCESS_TARGET: &str = "tollgate::access";

/// Starts the log subscriber, in `settings.format`. `RUST_LOG`, when set,
/// wins over `settings.level`; access lines pass whenever `log.access` is
/// on.
///
/// # Errors
/// When a subscriber is already installed or the filter is invalid.
pub fn init_tracing(settings: &LogSettings) -> anyhow::Result<()> {
    let mut filter = match std::env::var("RUST_LOG") {
        Ok(from_env) if !from_env.is_empty() => tracing_subscriber::EnvFilter::try_new(from_env)?,
        _ => tracing_subscriber::EnvFilter::try_new(log_filter(&settings.level))?,
    };
    if settings.access_sample_percent.is_some() {
        // Turned on explicitly: access lines pass whatever the level.
        filter = filter.add_directive(format!("{ACCESS_TARGET}=info").parse()?);
    }
    let quiet = || filter_fn(|meta| !is_client_noise(meta));
    let base = tracing_subscriber::registry().with(filter).with(CountNoise);
    let installed = match settings.format {
        LogFormat::Text => base
            .with(
                tracing_subscriber::fmt::layer()
                    .with_writer(std::io::stderr)
                    .with_target(false)
                    .with_ansi(std::io::stderr().is_terminal())
                    .with_filter(quiet()),
            )
            .try_init(),
        // One object per line: timestamp, level, target and the event's
        // fields (the message among them) at the top level.
        LogFormat::Json => base
            .with(
                tracing_subscriber::fmt::layer()
                    .json()
                    .flatten_event(true)
                    .with_current_span(false)
                    .with_span_list(false)
                    .with_writer(std::io::stderr)
                    .with_filter(quiet()),
            )
            .try_init(),
    };
    installed.map_err(|e| anyhow::anyhow!(e))
}

/// Turns the client-noise count into the metric and a rate-limited
/// warning.
pub struct ClientNoise {
    /// `tollgate_malformed_requests_total`.
    counter: Counter,
    /// The count already exported.
    exported: u64,
    /// Events not yet mentioned in a warning.
    unreported: u64,
    /// When the last warning was logged (ms of the caller's clock).
    last_warning_ms: Option<u64>,
}

impl ClientNoise {
    /// Starts from the events counted so far (call after [`super::install`]).
    pub fn new() -> Self {
        #[allow(clippy::disallowed_macros)] // Named in this module's parent.
        let counter = metrics::counter!(MALFORMED_REQUESTS_TOTAL);
        Self {
            counter,
            exported: NOISE.load(Ordering::Relaxed),
            unreported: 0,
            last_warning_ms: None,
        }
    }

    /// Exports the events counted since the last call and, at most once
    /// a minute, logs how many there were.
    pub fn report(&mut self, now_ms: u64) {
        let seen = NOISE.load(Ordering::Relaxed);
        let new = seen.saturating_sub(self.exported);
        self.exported = seen;
        self.counter.increment(new);
        self.unreported += new;
        let due = self
            .last_warning_ms
            .is_none_or(|last| now_ms.saturating_sub(last) >= NOISE_REPORT_PERIOD_MS);
        if self.unreported > 0 && due {
            tracing::warn!(
                connections = self.unreported,
                "Clients sent malformed requests, broke off, or were cut off for being too slow \
                 (counted in tollgate_malformed_requests_total; RUST_LOG=tollgate=debug shows each)."
            );
            self.unreported = 0;
            self.last_warning_ms = Some(now_ms);
        }
    }
}

impl Default for ClientNoise {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_warnings_and_errors_of_the_http_layer_are_client_noise() {
        assert!(is_noise_source("actix_http::h1::dispatcher", Level::ERROR));
        assert!(is_noise_source("actix_http::h1::dispatcher", Level::WARN));
        assert!(!is_noise_source("actix_http::h1::dispatcher", Level::TRACE));
        assert!(!is_noise_source("tollgate::proxy", Level::ERROR));
    }

    #[test]
    fn noise_is_summarised_at_most_once_per_period() {
        crate::telemetry::install();
        let mut noise = ClientNoise::new();
        NOISE.fetch_add(3, Ordering::Relaxed);
        noise.report(1_000);
        assert_eq!(noise.unreported, 0, "the first report warns at once");
        assert_eq!(noise.last_warning_ms, Some(1_000));
        NOISE.fetch_add(2, Ordering::Relaxed);
        noise.report(30_000);
        assert_eq!(noise.unreported, 2, "held back within the period");
        noise.report(61_000);
        assert_eq!(noise.unreported, 0);
        assert_eq!(noise.last_warning_ms, Some(61_000));
    }
}
