//! Time source for all limiter logic.
//!
//! Owns the [`Clock`] trait and its two implementations: [`SystemClock`]
//! (monotonic, process-relative milliseconds) and [`ManualClock`] (advanced by
//! hand in tests). This is the only module allowed to read the system clock;
//! everything else takes a `Clock` or a `now` argument, so bucket, lease and
//! breaker logic is tested without sleeping.
//!
//! Invariant: `now_ms` never goes backwards for one clock.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A monotonic clock with microsecond resolution.
pub trait Clock: Send + Sync + 'static {
    /// Microseconds since an arbitrary, fixed origin; never decreases.
    fn now_micros(&self) -> u64;

    /// Milliseconds since the same origin.
    fn now_ms(&self) -> u64 {
        self.now_micros() / 1000
    }

    /// Milliseconds since the Unix epoch, for calendar windows (UTC days,
    /// months). A test clock's origin is the epoch.
    fn unix_ms(&self) -> u64 {
        self.now_ms()
    }
}

/// Shared clock handle used across the gateway.
pub type SharedClock = Arc<dyn Clock>;

/// The real monotonic clock, counting from its own creation.
#[derive(Debug, Clone, Copy)]
pub struct SystemClock {
    /// Origin of the microsecond (and millisecond) count.
    origin: Instant,
    /// The origin in milliseconds since the Unix epoch.
    origin_unix_ms: u64,
}

impl SystemClock {
    /// A clock whose origin is now.
    #[allow(clippy::disallowed_methods)] // The one place that reads the system clock.
    pub fn new() -> Self {
        let since_epoch = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        Self {
            origin: Instant::now(),
            origin_unix_ms: u64::try_from(since_epoch.as_millis()).unwrap_or(0),
        }
    }

    /// The same clock behind a shared handle.
    pub fn shared() -> SharedClock {
        Arc::new(Self::new())
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    fn now_micros(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    /// The wall clock at the origin plus the monotonic time since: it never
    /// goes backwards, and drifts from the wall clock only as far as the
    /// system clock is stepped while the gateway runs.
    fn unix_ms(&self) -> u64 {
        self.origin_unix_ms.saturating_add(self.now_ms())
    }
}

/// A clock that only moves when told to; for tests of time-based logic.
#[derive(Debug, Default)]
pub struct ManualClock {
    /// Current reading in microseconds.
    now: AtomicU64,
}

impl ManualClock {
    /// A clock reading `start_ms`.
    pub fn new(start_ms: u64) -> Arc<Self> {
        Arc::new(Self {
            now: AtomicU64::new(start_ms.saturating_mul(1000)),
        })
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        let micros = u64::try_from(by.as_micros()).unwrap_or(u64::MAX);
        self.now.fetch_add(micros, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_micros(&self) -> u64 {
        self.now.load(Ordering::SeqCst)
    }
}

/// tokio's clock, which stands still under `tokio::time::pause` and moves
/// with `tokio::time::advance` and auto-advance: logic on it and the timers
/// it awaits move together in paused-time tests.
#[cfg(test)]
#[derive(Debug)]
pub struct TokioClock {
    /// Origin of the count.
    origin: tokio::time::Instant,
}

#[cfg(test)]
impl TokioClock {
    /// A clock whose origin is tokio's now (call inside a runtime).
    pub fn shared() -> SharedClock {
        Arc::new(Self {
            origin: tokio::time::Instant::now(),
        })
    }
}

#[cfg(test)]
impl Clock for TokioClock {
    fn now_micros(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_micros()).unwrap_or(u64::MAX)
    }
}

/// `d` in whole milliseconds (saturating), the unit every clock here
/// counts in.
pub fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Wall-clock seconds since the Unix epoch, for timestamps shown to operators
/// (never used in limiter arithmetic).
#[allow(clippy::disallowed_methods)] // The one place that reads the wall clock.
pub fn unix_now_seconds() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_advanced() {
        let clock = ManualClock::new(1_000);
        assert_eq!(clock.now_ms(), 1_000);
        clock.advance(Duration::from_micros(250_500));
        assert_eq!(clock.now_ms(), 1_250);
        assert_eq!(clock.now_micros(), 1_250_500);
    }

    #[test]
    fn system_clock_is_monotonic() {
        let clock = SystemClock::new();
        let a = clock.now_ms();
        let b = clock.now_ms();
        assert!(b >= a);
    }
}
