//! Log setup: the subscriber, its filter, and the client-noise summary.
//!
//! Owns what reaches the log. A client can make the HTTP layer log one
//! error per connection (a malformed request, a stream broken off, a body
//! cut off for being too slow, the HTTP/2 library's warnings about a
//! peer's resets) at will, and a flood of connections makes every accept
//! fail once file descriptors run out, so those events never reach the
//! output one by one: they are counted, exported as
//! `tollgate_malformed_requests_total` and `tollgate_accept_errors_total`,
//! and summarised in at most one warning each per
//! [`NOISE_REPORT_PERIOD_MS`] ([`ClientNoise::report`]).
//! Logs go to stderr (stdout is left to command output such as the demo's
//! banner), as text (colour codes only on a terminal) or as one JSON
//! object per line (`log.format`).

use std::io::IsTerminal as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use metrics::Counter;
use tracing::{Level, Metadata, Subscriber};
use tracing_subscriber::Layer;
use tracing_subscriber::filter::filter_fn;
use tracing_subscriber::layer::{Context, SubscriberExt as _};
use tracing_subscriber::util::SubscriberInitExt as _;

use super::{ACCEPT_ERRORS_TOTAL, MALFORMED_REQUESTS_TOTAL};
use crate::config::{LogFormat, LogSettings};

/// Client-caused events seen since start.
static NOISE: AtomicU64 = AtomicU64::new(0);

/// Failed accepts seen since start.
static ACCEPT_FAILURES: AtomicU64 = AtomicU64::new(0);

/// The latest accept failure, for the summary.
static LAST_ACCEPT_FAILURE: Mutex<Option<String>> = Mutex::new(None);

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

/// Whether an event is one an HTTP library logs per connection over a
/// peer's doing: warnings and errors of actix-http's HTTP/1 code (the
/// admin listener), of the HTTP/2 library (a peer's resets past its
/// limit, pings it never sent) and of hyper (headers a peer may not
/// send). The proxy listener counts its own with [`count_client_noise`].
fn is_client_noise(meta: &Metadata<'_>) -> bool {
    meta.is_event() && is_noise_source(meta.target(), *meta.level())
}

/// Whether `target` logs at `level` only over a peer's doing.
fn is_noise_source(target: &str, level: Level) -> bool {
    level <= Level::WARN
        && ["actix_http::h1", "h2::", "hyper::"]
            .iter()
            .any(|source| target.starts_with(source))
}

/// Counts one client connection that ended in an error (a malformed
/// request, a stream broken off), for the summary.
pub fn count_client_noise() {
    NOISE.fetch_add(1, Ordering::Relaxed);
}

/// Counts a failed accept (out of file descriptors, say), for the
/// summary; the caller backs off before the next.
pub fn count_accept_failure(error: &std::io::Error) {
    note_accept_failure(error.to_string());
}

/// Counts a failed accept described by `what`.
fn note_accept_failure(what: String) {
    ACCEPT_FAILURES.fetch_add(1, Ordering::Relaxed);
    *LAST_ACCEPT_FAILURE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(what);
}

/// Whether an event is the admin listener's accept loop (actix-server)
/// failing, which it logs once per attempt; counted with the proxy's own
/// failed accepts.
fn is_accept_failure(meta: &Metadata<'_>) -> bool {
    meta.is_event()
        && *meta.level() == Level::ERROR
        && meta.target().starts_with("actix_server::accept")
}

/// The `message` field of an event.
#[derive(Default)]
struct Message(String);

impl tracing::field::Visit for Message {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }
}

/// Counts client-noise events (the output layer filters them out).
struct CountNoise;

impl<S: Subscriber> Layer<S> for CountNoise {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        if is_client_noise(event.metadata()) {
            NOISE.fetch_add(1, Ordering::Relaxed);
        } else if is_accept_failure(event.metadata()) {
            let mut message = Message::default();
            event.record(&mut message);
            note_accept_failure(format!("admin listener: {}", message.0));
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
    let quiet = || filter_fn(|meta| !is_client_noise(meta) && !is_accept_failure(meta));
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

/// One count of events, exported as a counter and summarised in at most
/// one warning per period.
struct Summarised {
    /// The counter.
    counter: Counter,
    /// The count already exported.
    exported: u64,
    /// Events not yet mentioned in a warning.
    unreported: u64,
    /// When the last warning was logged (ms of the caller's clock).
    last_warning_ms: Option<u64>,
}

impl Summarised {
    /// Starting from `seen` events.
    fn new(counter: Counter, seen: u64) -> Self {
        Self {
            counter,
            exported: seen,
            unreported: 0,
            last_warning_ms: None,
        }
    }

    /// Exports the events up to `seen`; returns how many to warn about
    /// when a warning is due at `now_ms`.
    fn due(&mut self, seen: u64, now_ms: u64) -> Option<u64> {
        let new = seen.saturating_sub(self.exported);
        self.exported = seen;
        self.counter.increment(new);
        self.unreported += new;
        let due = self
            .last_warning_ms
            .is_none_or(|last| now_ms.saturating_sub(last) >= NOISE_REPORT_PERIOD_MS);
        if self.unreported == 0 || !due {
            return None;
        }
        self.last_warning_ms = Some(now_ms);
        Some(std::mem::take(&mut self.unreported))
    }
}

/// Turns the client-noise and accept-failure counts into their metrics
/// and rate-limited warnings.
pub struct ClientNoise {
    /// `tollgate_malformed_requests_total`.
    noise: Summarised,
    /// `tollgate_accept_errors_total`.
    accepts: Summarised,
}

impl ClientNoise {
    /// Starts from the events counted so far (call after [`super::install`]).
    pub fn new() -> Self {
        #[allow(clippy::disallowed_macros)] // Named in this module's parent.
        let (noise, accepts) = (
            metrics::counter!(MALFORMED_REQUESTS_TOTAL),
            metrics::counter!(ACCEPT_ERRORS_TOTAL),
        );
        Self {
            noise: Summarised::new(noise, NOISE.load(Ordering::Relaxed)),
            accepts: Summarised::new(accepts, ACCEPT_FAILURES.load(Ordering::Relaxed)),
        }
    }

    /// Exports the events counted since the last call and, at most once
    /// a minute each, logs how many there were.
    pub fn report(&mut self, now_ms: u64) {
        if let Some(connections) = self.noise.due(NOISE.load(Ordering::Relaxed), now_ms) {
            tracing::warn!(
                connections,
                "Clients sent malformed requests, broke off, or were cut off for being too slow \
                 (counted in tollgate_malformed_requests_total; RUST_LOG=tollgate=debug shows each)."
            );
        }
        if let Some(failures) = self
            .accepts
            .due(ACCEPT_FAILURES.load(Ordering::Relaxed), now_ms)
        {
            let last = LAST_ACCEPT_FAILURE
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone()
                .unwrap_or_default();
            tracing::error!(
                failures,
                last = %last,
                "Accepting client connections failed (counted in tollgate_accept_errors_total); \
                 if the last error says too many open files, raise the open-files limit \
                 (LimitNOFILE in the systemd unit)."
            );
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
        assert!(is_noise_source("h2::proto::streams::recv", Level::WARN));
        assert!(is_noise_source("hyper::proto::h2::server", Level::WARN));
        assert!(!is_noise_source("h2::proto::connection", Level::DEBUG));
        assert!(!is_noise_source("tollgate::proxy", Level::ERROR));
    }

    #[test]
    fn noise_is_summarised_at_most_once_per_period() {
        crate::telemetry::install();
        let mut report = ClientNoise::new();
        NOISE.fetch_add(3, Ordering::Relaxed);
        report.report(1_000);
        let noise = &report.noise;
        assert_eq!(noise.unreported, 0, "the first report warns at once");
        assert_eq!(noise.last_warning_ms, Some(1_000));
        NOISE.fetch_add(2, Ordering::Relaxed);
        count_accept_failure(&std::io::Error::from_raw_os_error(24));
        report.report(30_000);
        assert_eq!(report.noise.unreported, 2, "held back within the period");
        assert_eq!(report.accepts.unreported, 0, "its own period");
        assert_eq!(report.accepts.last_warning_ms, Some(30_000));
        report.report(61_000);
        assert_eq!(report.noise.unreported, 0);
        assert_eq!(report.noise.last_warning_ms, Some(61_000));
    }
}
