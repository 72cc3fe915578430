//! In-process buckets: local-only mode and the fallback when Redis fails.
//!
//! Owns a bounded [`KeyMap`] of [`TokenState`]s. A bucket that has refilled
//! completely is idle: forgetting it loses nothing, since it comes back
//! full.

use super::decision::{BucketSpec, Decision};
use super::keymap::{Idle, KeyMap};
use super::tokens::TokenState;
use crate::clock::SharedClock;

/// One tracked bucket.
#[derive(Debug, Clone, Copy)]
struct Entry {
    /// Tokens and last update.
    state: TokenState,
    /// The bucket size and rate last applied, needed to tell when it is full.
    spec: BucketSpec,
    /// Last request, admitted or not (a rejection leaves `state` alone), so
    /// that a drained bucket under attack is not the first to be evicted.
    last_used_ms: u64,
}

impl Idle for Entry {
    fn is_idle(&self, now_ms: u64) -> bool {
        self.state.is_full(&self.spec, now_ms)
    }

    fn last_used_ms(&self) -> u64 {
        self.last_used_ms
    }
}

/// Keyed in-process token buckets.
pub struct LocalBuckets {
    /// Key → bucket.
    buckets: KeyMap<Entry>,
    /// Time source for refills.
    clock: SharedClock,
}

impl LocalBuckets {
    /// An empty set holding at most about `max_keys` buckets.
    pub fn new(max_keys: usize, clock: SharedClock) -> Self {
        Self {
            buckets: KeyMap::new(max_keys),
            clock,
        }
    }

    /// Refills `key`'s bucket to now and tries to take `cost` tokens.
    pub fn take(&self, key: &str, spec: &BucketSpec, cost: u32) -> Decision {
        let now = self.clock.now_ms();
        let create = || Entry {
            state: TokenState::full(spec, now),
            spec: *spec,
            last_used_ms: now,
        };
        self.buckets.with(key, now, create, |entry| {
            entry.spec = *spec;
            entry.last_used_ms = now;
            entry.state.take(spec, cost, now)
        })
    }

    /// Drops every bucket that is full again; returns how many remain.
    pub fn sweep(&self) -> usize {
        self.buckets.sweep(self.clock.now_ms())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use std::num::NonZeroU32;
    use std::time::Duration;

    fn spec(capacity: u32, refill: u32) -> BucketSpec {
        BucketSpec::of(
            NonZeroU32::new(capacity).unwrap(),
            NonZeroU32::new(refill).unwrap(),
        )
    }

    #[test]
    fn keys_have_independent_buckets() {
        let clock = ManualClock::new(0);
        let buckets = LocalBuckets::new(100, clock.clone());
        let s = spec(1, 1);
        assert!(buckets.take("a", &s, 1).allowed);
        assert!(!buckets.take("a", &s, 1).allowed);
        assert!(buckets.take("b", &s, 1).allowed);
        clock.advance(Duration::from_secs(1));
        assert!(buckets.take("a", &s, 1).allowed);
    }

    #[test]
    fn a_drained_bucket_still_in_use_outlives_a_flood_of_new_keys() {
        let clock = ManualClock::new(0);
        let buckets = LocalBuckets::new(16 * 10, clock.clone());
        let s = spec(1, 1);
        assert!(buckets.take("spam", &s, 1).allowed);
        for i in 0..2_000 {
            clock.advance(Duration::from_micros(100));
            assert!(!buckets.take("spam", &s, 1).allowed, "request {i}");
            buckets.take(&format!("flood-{i}"), &s, 1);
        }
    }

    #[test]
    fn sweep_drops_only_refilled_buckets() {
        let clock = ManualClock::new(0);
        let buckets = LocalBuckets::new(100, clock.clone());
        buckets.take("slow", &spec(10, 1), 5);
        buckets.take("fast", &spec(10, 100), 5);
        clock.advance(Duration::from_millis(100));
        assert_eq!(buckets.sweep(), 1);
        clock.advance(Duration::from_secs(5));
        assert_eq!(buckets.sweep(), 0);
    }
}
