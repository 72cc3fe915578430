//! In-process buckets: local-only mode and the fallback when Redis fails.
//!
//! Owns a keyed set of [`TokenState`]s, sharded behind plain mutexes so the
//! two proxy workers rarely contend. Each lock is held only for one bucket
//! update, never across an `.await`.
//!
//! Invariant: memory is bounded. [`LocalBuckets::sweep`] drops buckets that
//! have refilled completely (forgetting a full bucket loses nothing), and a
//! shard at its cap makes room before it admits a new key, so attacker-chosen
//! keys cannot grow the map without bound.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Mutex, MutexGuard, PoisonError};

use super::decision::{BucketSpec, Decision};
use super::tokens::TokenState;
use crate::clock::SharedClock;

/// Number of independently locked shards.
const SHARDS: usize = 16;

/// One tracked bucket.
#[derive(Debug, Clone, Copy)]
struct Entry {
    /// Tokens and last update.
    state: TokenState,
    /// The bucket size and rate last applied, needed to tell when it is full.
    spec: BucketSpec,
}

/// Keyed in-process token buckets.
pub struct LocalBuckets {
    /// Key → bucket, split by key hash.
    shards: Box<[Mutex<HashMap<String, Entry>>]>,
    /// Picks a key's shard.
    hasher: RandomState,
    /// Most buckets one shard holds.
    max_per_shard: usize,
    /// Time source for refills.
    clock: SharedClock,
}

impl LocalBuckets {
    /// An empty set holding at most about `max_keys` buckets.
    pub fn new(max_keys: usize, clock: SharedClock) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            hasher: RandomState::new(),
            max_per_shard: max_keys.div_ceil(SHARDS).max(1),
            clock,
        }
    }

    /// Refills `key`'s bucket to now and tries to take `cost` tokens.
    pub fn take(&self, key: &str, spec: &BucketSpec, cost: u32) -> Decision {
        let now = self.clock.now_ms();
        let mut shard = self.shard(key);
        if let Some(entry) = shard.get_mut(key) {
            entry.spec = *spec;
            return entry.state.take(spec, cost, now);
        }
        if shard.len() >= self.max_per_shard {
            make_room(&mut shard, now, self.max_per_shard);
        }
        let mut state = TokenState::full(spec, now);
        let decision = state.take(spec, cost, now);
        shard.insert(key.to_owned(), Entry { state, spec: *spec });
        decision
    }

    /// Drops every bucket that is full again; returns how many remain.
    pub fn sweep(&self) -> usize {
        let now = self.clock.now_ms();
        self.shards
            .iter()
            .map(|shard| {
                let mut map = lock(shard);
                map.retain(|_, e| !e.state.is_full(&e.spec, now));
                map.len()
            })
            .sum()
    }

    /// Number of tracked buckets.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(s).len()).sum()
    }

    /// Whether no bucket is tracked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn shard(&self, key: &str) -> MutexGuard<'_, HashMap<String, Entry>> {
        // Truncation is fine: only the low bits pick a shard.
        let i = self.hasher.hash_one(key) as usize % SHARDS;
        lock(&self.shards[i])
    }
}

/// Locks a shard; a panic elsewhere leaves plain numbers, still usable.
fn lock(shard: &Mutex<HashMap<String, Entry>>) -> MutexGuard<'_, HashMap<String, Entry>> {
    shard.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Frees a slot in a full shard: first every full bucket, else one arbitrary
/// bucket (it comes back full, a bounded over-admission under key floods).
fn make_room(map: &mut HashMap<String, Entry>, now: u64, max: usize) {
    map.retain(|_, e| !e.state.is_full(&e.spec, now));
    if map.len() >= max
        && let Some(victim) = map.keys().next().cloned()
    {
        map.remove(&victim);
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
    fn sweep_drops_only_refilled_buckets() {
        let clock = ManualClock::new(0);
        let buckets = LocalBuckets::new(100, clock.clone());
        buckets.take("slow", &spec(10, 1), 5);
        buckets.take("fast", &spec(10, 100), 5);
        clock.advance(Duration::from_millis(100));
        assert_eq!(buckets.sweep(), 1);
        clock.advance(Duration::from_secs(5));
        assert_eq!(buckets.sweep(), 0);
        assert!(buckets.is_empty());
    }

    #[test]
    fn a_flood_of_new_keys_stays_bounded() {
        let clock = ManualClock::new(0);
        let buckets = LocalBuckets::new(64, clock);
        for i in 0..10_000 {
            buckets.take(&format!("attacker-{i}"), &spec(100, 1), 1);
        }
        assert!(buckets.len() <= 64, "{}", buckets.len());
    }
}
