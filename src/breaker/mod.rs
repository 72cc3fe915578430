//! The circuit breaker in front of Redis.
//!
//! Owns the [`BreakerGate`] the request path consults and reports to, the
//! pure state machine ([`state`]) and the actor that drives it
//! ([`prober`]). The request path only touches atomics: one load to ask
//! whether Redis may be called, one or two increments to report how the call
//! went. Every [`prober::TICK`] the actor drains those counters into the
//! state machine, publishes the new state, and while half-open sends one
//! probe; every transition is logged at `warn`.

pub mod prober;
pub mod state;

use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

pub use state::{Machine, Outcomes, State};

/// What the request path reads and writes: the published state and the
/// outcome counters since the actor's last tick.
#[derive(Debug, Default)]
pub struct BreakerGate {
    /// [`State`] as its discriminant.
    state: AtomicU8,
    /// Successful calls since the last drain.
    successes: AtomicU64,
    /// Failed calls since the last drain.
    failures: AtomicU64,
    /// Current run of consecutive failures.
    run: AtomicU64,
    /// Longest run since the last drain.
    longest_run: AtomicU64,
    /// Failed calls since start, never drained (for `/ready`).
    total_failures: AtomicU64,
}

impl BreakerGate {
    /// A closed gate.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether requests may call Redis now (the breaker is closed).
    pub fn allows(&self) -> bool {
        self.state() == State::Closed
    }

    /// The published state.
    pub fn state(&self) -> State {
        State::from_u8(self.state.load(Ordering::Relaxed))
    }

    /// Reports a successful call.
    pub fn success(&self) {
        self.successes.fetch_add(1, Ordering::Relaxed);
        self.run.store(0, Ordering::Relaxed);
    }

    /// Reports a failed or timed-out call.
    pub fn failure(&self) {
        self.failures.fetch_add(1, Ordering::Relaxed);
        self.total_failures.fetch_add(1, Ordering::Relaxed);
        let run = self.run.fetch_add(1, Ordering::Relaxed) + 1;
        self.longest_run.fetch_max(run, Ordering::Relaxed);
    }

    /// Failed or timed-out calls reported since start.
    pub fn total_failures(&self) -> u64 {
        self.total_failures.load(Ordering::Relaxed)
    }

    /// Takes the outcomes reported since the previous drain.
    pub fn drain(&self) -> Outcomes {
        Outcomes {
            successes: self.successes.swap(0, Ordering::Relaxed),
            failures: self.failures.swap(0, Ordering::Relaxed),
            longest_failure_run: self.longest_run.swap(0, Ordering::Relaxed),
        }
    }

    /// Publishes a new state.
    pub fn publish(&self, state: State) {
        if state == State::Closed {
            self.run.store(0, Ordering::Relaxed);
        }
        self.state.store(state as u8, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gate_counts_outcomes_and_the_longest_failure_run() {
        let gate = BreakerGate::new();
        for ok in [false, false, true, false, false, false, true] {
            if ok { gate.success() } else { gate.failure() }
        }
        assert_eq!(
            gate.drain(),
            Outcomes {
                successes: 2,
                failures: 5,
                longest_failure_run: 3
            }
        );
        assert_eq!(gate.drain(), Outcomes::default());
        assert_eq!(gate.total_failures(), 5, "not drained");
        assert!(gate.allows());
        gate.publish(State::Open);
        assert!(!gate.allows());
    }
}
