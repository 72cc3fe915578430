//! What a group of limits last answered, kept so that decisions made
//! without Redis (leases, the over-limit cache) report each limit as
//! Redis last saw it.

use std::sync::Arc;

use super::super::decision::Decision;
use super::super::keymap::{Idle, KeyMap};
use crate::clock::SharedClock;

/// How long a group's last answer is kept beyond its longest wait, for
/// the leases and refusals answered from it.
const MEMORY_MS: u64 = 10_000;

/// A group's last answer from Redis.
#[derive(Debug, Clone)]
struct Memory {
    /// Each limit's decision, in group order.
    decisions: Arc<[Decision]>,
    /// When it was answered (ms of the clock).
    at_ms: u64,
    /// When it may be forgotten.
    until_ms: u64,
}

impl Idle for Memory {
    fn is_idle(&self, now_ms: u64) -> bool {
        now_ms >= self.until_ms
    }

    fn last_used_ms(&self) -> u64 {
        self.at_ms
    }
}

/// Each group's last answer from Redis, keyed by the group's keys: what a
/// decision made without Redis (from the group's lease, or by the
/// over-limit cache) reports for each limit.
pub(crate) struct GroupMemory {
    /// Group key → its last answer.
    answers: KeyMap<Memory>,
    /// Reads now.
    clock: SharedClock,
}

impl GroupMemory {
    /// A memory of at most about `max_keys` groups.
    pub(crate) fn new(max_keys: usize, clock: SharedClock) -> Self {
        Self {
            answers: KeyMap::new(max_keys),
            clock,
        }
    }

    /// Keeps Redis's answer for the group `key`.
    pub(super) fn remember(&self, key: &str, decisions: &[Decision]) {
        let now = self.clock.now_ms();
        let longest = decisions
            .iter()
            .map(|d| d.retry_after_ms)
            .max()
            .unwrap_or(0);
        let memory = Memory {
            decisions: Arc::from(decisions),
            at_ms: now,
            until_ms: now + longest + MEMORY_MS,
        };
        self.answers
            .with(key, now, || memory.clone(), |m| *m = memory.clone());
    }

    /// Each limit's decision when `decision`, for the whole group of `len`
    /// limits, was made without Redis: the last answer's, the waits counted
    /// down, with the limit that binds (fewest left, or the longest wait)
    /// reporting `decision` itself.
    pub(super) fn recall(&self, key: &str, len: usize, decision: Decision) -> Vec<Decision> {
        let now = self.clock.now_ms();
        let mut decisions = self
            .answers
            .get(key, |m| {
                let passed = now.saturating_sub(m.at_ms);
                m.decisions
                    .iter()
                    .map(|d| Decision {
                        allowed: decision.allowed,
                        remaining: d.remaining,
                        retry_after_ms: match d.retry_after_ms {
                            0 => 0,
                            wait => wait.saturating_sub(passed).max(1),
                        },
                    })
                    .collect::<Vec<_>>()
            })
            .filter(|d| d.len() == len)
            .unwrap_or_else(|| vec![decision; len]);
        let binding = if decision.allowed {
            decisions
                .iter()
                .enumerate()
                .min_by_key(|(_, d)| d.remaining)
        } else {
            decisions
                .iter()
                .enumerate()
                .max_by_key(|(_, d)| d.retry_after_ms)
        }
        .map(|(i, _)| i);
        if let Some(i) = binding {
            decisions[i] = decision;
        }
        decisions
    }

    /// Drops the answers no longer needed.
    pub(crate) fn sweep(&self) {
        self.answers.sweep(self.clock.now_ms());
    }
}
