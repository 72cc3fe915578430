//! The circuit breaker's state machine, as a pure struct on explicit time.
//!
//! Closed → Open when a run of consecutive failures reaches the threshold,
//! or when the failure ratio over the current window reaches its limit with
//! enough calls in it. Open → HalfOpen once the cool-down has passed.
//! HalfOpen → Closed when a probe succeeds, → Open (a new cool-down) when it
//! fails. While closed, background health probes (sent whether or not
//! traffic flows) open it after [`HEALTH_FAILURES_TO_OPEN`] failures in a
//! row, so an unreachable Redis is noticed without traffic too. Nothing
//! here reads a clock or touches Redis.

use crate::clock::millis;
use crate::config::BreakerSettings;

/// Failed health probes in a row that open a closed breaker.
pub const HEALTH_FAILURES_TO_OPEN: u32 = 2;

pub use crate::telemetry::BreakerState as State;

/// Call outcomes observed since the previous step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Outcomes {
    /// Calls that succeeded.
    pub successes: u64,
    /// Calls that failed or timed out.
    pub failures: u64,
    /// Longest run of consecutive failures seen.
    pub longest_failure_run: u64,
}

/// A state change, for logs and metrics.
pub type Transition = (State, State);

/// The state machine.
#[derive(Debug, Clone)]
pub struct Machine {
    /// Thresholds and durations.
    settings: BreakerSettings,
    /// Current state.
    state: State,
    /// When the breaker last opened (ms).
    opened_at_ms: u64,
    /// Start of the current failure-ratio window (ms).
    window_start_ms: u64,
    /// Calls in the current window.
    window_calls: u64,
    /// Failed calls in the current window.
    window_failures: u64,
    /// Health probes failed in a row while closed.
    health_failures: u32,
}

impl Machine {
    /// A closed breaker whose first window starts at `now_ms`.
    pub fn new(settings: BreakerSettings, now_ms: u64) -> Self {
        Self {
            settings,
            state: State::Closed,
            opened_at_ms: 0,
            window_start_ms: now_ms,
            window_calls: 0,
            window_failures: 0,
            health_failures: 0,
        }
    }

    /// The current state.
    pub fn state(&self) -> State {
        self.state
    }

    /// Feeds the outcomes seen since the last step and advances to `now_ms`.
    pub fn observe(&mut self, seen: Outcomes, now_ms: u64) -> Option<Transition> {
        match self.state {
            State::Closed => {
                let window_ms = millis(self.settings.window);
                if now_ms.saturating_sub(self.window_start_ms) >= window_ms {
                    self.reset_window(now_ms);
                }
                self.window_calls += seen.successes + seen.failures;
                self.window_failures += seen.failures;
                let run_too_long =
                    seen.longest_failure_run >= u64::from(self.settings.failure_threshold);
                let ratio_too_high = self.window_calls >= u64::from(self.settings.min_calls)
                    && self.window_failures as f64
                        >= self.settings.failure_ratio * self.window_calls as f64;
                (run_too_long || ratio_too_high).then(|| self.open(now_ms))
            }
            State::Open => {
                let cooldown_ms = millis(self.settings.cooldown);
                (now_ms.saturating_sub(self.opened_at_ms) >= cooldown_ms)
                    .then(|| self.move_to(State::HalfOpen))
            }
            State::HalfOpen => None,
        }
    }

    /// Applies a probe's result; only meaningful while half-open.
    pub fn probe_result(&mut self, ok: bool, now_ms: u64) -> Option<Transition> {
        if self.state != State::HalfOpen {
            return None;
        }
        if ok {
            self.reset_window(now_ms);
            Some(self.move_to(State::Closed))
        } else {
            Some(self.open(now_ms))
        }
    }

    /// Applies a background health probe's result; only counts while
    /// closed.
    pub fn health_result(&mut self, ok: bool, now_ms: u64) -> Option<Transition> {
        if self.state != State::Closed {
            return None;
        }
        if ok {
            self.health_failures = 0;
            return None;
        }
        self.health_failures += 1;
        (self.health_failures >= HEALTH_FAILURES_TO_OPEN).then(|| self.open(now_ms))
    }

    fn open(&mut self, now_ms: u64) -> Transition {
        self.opened_at_ms = now_ms;
        self.health_failures = 0;
        self.move_to(State::Open)
    }

    fn move_to(&mut self, to: State) -> Transition {
        let from = self.state;
        self.state = to;
        (from, to)
    }

    fn reset_window(&mut self, now_ms: u64) {
        self.window_start_ms = now_ms;
        self.window_calls = 0;
        self.window_failures = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::{Clock, ManualClock};
    use std::sync::Arc;
    use std::time::Duration;

    /// A machine with the test settings, closed at time 0 of its clock.
    fn machine() -> (Arc<ManualClock>, Machine) {
        let clock = ManualClock::new(0);
        let m = Machine::new(settings(), clock.now_ms());
        (clock, m)
    }

    fn settings() -> BreakerSettings {
        BreakerSettings {
            failure_threshold: 5,
            failure_ratio: 0.5,
            min_calls: 20,
            window: Duration::from_secs(10),
            cooldown: Duration::from_secs(1),
        }
    }

    fn seen(successes: u64, failures: u64, run: u64) -> Outcomes {
        Outcomes {
            successes,
            failures,
            longest_failure_run: run,
        }
    }

    #[test]
    fn a_run_of_consecutive_failures_opens() {
        let (clock, mut m) = machine();
        assert_eq!(m.observe(seen(100, 4, 4), clock.now_ms()), None);
        assert_eq!(
            m.observe(seen(0, 5, 5), clock.now_ms()),
            Some((State::Closed, State::Open))
        );
    }

    #[test]
    fn a_failure_ratio_over_the_window_opens_only_with_enough_calls() {
        let (clock, mut m) = machine();
        // 10 calls, 6 failed in short runs: above the ratio, below min_calls.
        assert_eq!(m.observe(seen(4, 6, 2), clock.now_ms()), None);
        clock.advance(Duration::from_secs(1));
        // 20 calls, 10 failed: 50 % reached.
        assert_eq!(
            m.observe(seen(6, 4, 1), clock.now_ms()),
            Some((State::Closed, State::Open))
        );
    }

    #[test]
    fn the_window_forgets_old_failures() {
        let (clock, mut m) = machine();
        assert_eq!(m.observe(seen(5, 9, 2), clock.now_ms()), None);
        clock.advance(Duration::from_secs(10));
        assert_eq!(m.observe(seen(9, 2, 1), clock.now_ms()), None);
        assert_eq!(m.state(), State::Closed);
    }

    #[test]
    fn cooldown_then_probe_closes_or_reopens() {
        let (clock, mut m) = machine();
        m.observe(seen(0, 5, 5), clock.now_ms());
        clock.advance(Duration::from_millis(999));
        assert_eq!(m.observe(Outcomes::default(), clock.now_ms()), None);
        clock.advance(Duration::from_millis(1));
        assert_eq!(
            m.observe(Outcomes::default(), clock.now_ms()),
            Some((State::Open, State::HalfOpen))
        );
        assert_eq!(
            m.probe_result(false, clock.now_ms()),
            Some((State::HalfOpen, State::Open))
        );
        clock.advance(Duration::from_secs(1));
        m.observe(Outcomes::default(), clock.now_ms());
        assert_eq!(
            m.probe_result(true, clock.now_ms()),
            Some((State::HalfOpen, State::Closed))
        );
        // A fresh window after closing: earlier failures do not count.
        assert_eq!(m.observe(seen(10, 9, 1), clock.now_ms()), None);
    }

    #[test]
    fn failed_health_probes_in_a_row_open_a_closed_breaker() {
        let mut m = Machine::new(settings(), 0);
        assert_eq!(m.health_result(false, 0), None);
        assert_eq!(m.health_result(true, 500), None, "a success resets the run");
        assert_eq!(m.health_result(false, 1_000), None);
        assert_eq!(
            m.health_result(false, 1_500),
            Some((State::Closed, State::Open))
        );
        assert_eq!(
            m.health_result(false, 1_600),
            None,
            "only counts while closed"
        );
        assert_eq!(
            m.observe(Outcomes::default(), 2_500),
            Some((State::Open, State::HalfOpen))
        );
        assert_eq!(
            m.probe_result(true, 2_600),
            Some((State::HalfOpen, State::Closed))
        );
        assert_eq!(m.health_result(false, 3_000), None, "the run starts afresh");
    }

    #[test]
    fn outcomes_while_open_are_ignored() {
        let mut m = Machine::new(settings(), 0);
        m.observe(seen(0, 5, 5), 0);
        assert_eq!(m.observe(seen(0, 100, 100), 10), None);
        assert_eq!(m.state(), State::Open);
        assert_eq!(
            m.probe_result(true, 20),
            None,
            "no probe result counts unless half-open"
        );
    }
}
