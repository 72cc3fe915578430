//! A bounded, sharded map from bucket key to per-key state.
//!
//! Owns the memory bound shared by every per-key table on the request path
//! (local buckets, hot-key state). Shards sit behind plain mutexes, held for
//! one entry update and never across an `.await`, so proxy workers rarely
//! contend.
//!
//! Invariant: at most about `max_keys` entries. [`KeyMap::sweep`] drops
//! entries that say they are idle (forgetting them loses nothing), and a
//! shard at its cap drops its idle entries, then the least recently used
//! down to 90 % of its cap, before it admits a new key; attacker-chosen keys cannot grow
//! memory without bound, and a flood of them costs amortised constant work
//! per key. A key is hashed once per call: the hash picks the shard and
//! finds the key in it; a caller that visits a key more than once keeps
//! its hash ([`KeyMap::hashed`]).

use std::hash::{BuildHasher, RandomState};
use std::sync::{Mutex, MutexGuard, PoisonError};

use hashbrown::HashTable;

/// Number of independently locked shards.
const SHARDS: usize = 16;

/// Per-key state that can tell when forgetting it loses nothing.
pub trait Idle {
    /// Whether the entry can be dropped at `now_ms` without changing any
    /// future decision.
    fn is_idle(&self, now_ms: u64) -> bool;

    /// When the entry was last used (ms); at the cap, the least recently
    /// used entries go first.
    fn last_used_ms(&self) -> u64;
}

/// Called with every entry the map drops.
type Evicted<V> = Box<dyn Fn(&V) + Send + Sync>;

/// One shard: each key with its state.
type Shard<V> = HashTable<(String, V)>;

/// A key and its hash in one [`KeyMap`] (made by [`KeyMap::hashed`]):
/// several visits to its entry hash it once.
#[derive(Debug, Clone, Copy)]
pub struct Hashed<'k> {
    /// The key.
    key: &'k str,
    /// Its hash under the map's hasher.
    hash: u64,
}

/// Sharded `key → V` with a size cap.
pub struct KeyMap<V> {
    /// Key → state, split by key hash.
    shards: Box<[Mutex<Shard<V>>]>,
    /// Hashes keys (randomly seeded: chosen keys cannot collide on purpose).
    hasher: RandomState,
    /// Most entries one shard holds.
    max_per_shard: usize,
    /// Accounts for what a dropped entry still held (e.g. unspent leases).
    evicted: Option<Evicted<V>>,
}

impl<V: Idle> KeyMap<V> {
    /// An empty map holding at most about `max_keys` entries.
    pub fn new(max_keys: usize) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(HashTable::new())).collect(),
            hasher: RandomState::new(),
            max_per_shard: max_keys.div_ceil(SHARDS).max(1),
            evicted: None,
        }
    }

    /// The same map, calling `evicted` with every entry it drops.
    pub fn on_evict(self, evicted: impl Fn(&V) + Send + Sync + 'static) -> Self {
        Self {
            evicted: Some(Box::new(evicted)),
            ..self
        }
    }

    /// Whether to keep `v` at `now_ms`; reports it when not.
    fn keep(&self, v: &V, now_ms: u64) -> bool {
        let idle = v.is_idle(now_ms);
        if idle {
            self.dropped(v);
        }
        !idle
    }

    /// Reports a dropped entry.
    fn dropped(&self, v: &V) {
        if let Some(evicted) = &self.evicted {
            evicted(v);
        }
    }

    /// `key` with its hash in this map, for visits that would hash it
    /// again ([`KeyMap::with_hashed`], [`KeyMap::get_hashed`]). Valid in
    /// this map only.
    pub fn hashed<'k>(&self, key: &'k str) -> Hashed<'k> {
        Hashed {
            key,
            hash: self.hasher.hash_one(key),
        }
    }

    /// Runs `f` on `key`'s entry, creating it with `create` first when absent.
    pub fn with<R>(
        &self,
        key: &str,
        now_ms: u64,
        create: impl FnOnce() -> V,
        f: impl FnOnce(&mut V) -> R,
    ) -> R {
        self.with_hashed(self.hashed(key), now_ms, create, f)
    }

    /// [`KeyMap::with`] for a key hashed by [`KeyMap::hashed`].
    pub fn with_hashed<R>(
        &self,
        key: Hashed<'_>,
        now_ms: u64,
        create: impl FnOnce() -> V,
        f: impl FnOnce(&mut V) -> R,
    ) -> R {
        let Hashed { key, hash } = key;
        let mut shard = self.shard(hash);
        if let Some((_, entry)) = shard.find_mut(hash, |(k, _)| k == key) {
            return f(entry);
        }
        if shard.len() >= self.max_per_shard {
            // Make room for a tenth of the shard at once, so a flood of new
            // keys pays for one full pass per tenth of the cap, not per key.
            shard.retain(|(_, v)| self.keep(v, now_ms));
            let keep = self.max_per_shard - self.max_per_shard.div_ceil(10);
            let over = shard.len().saturating_sub(keep);
            if over > 0 {
                self.evict_oldest(&mut shard, over);
            }
        }
        let rehash = |(k, _): &(String, V)| self.hasher.hash_one(k);
        let entry = shard.insert_unique(hash, (key.to_owned(), create()), rehash);
        f(&mut entry.into_mut().1)
    }

    /// Drops the `n` (at least 1) least recently used entries of `shard`:
    /// a flood of new keys evicts its own oldest entries before a key
    /// still in use.
    fn evict_oldest(&self, shard: &mut Shard<V>, n: usize) {
        let mut ages: Vec<u64> = shard.iter().map(|(_, v)| v.last_used_ms()).collect();
        let (_, &mut cutoff, _) = ages.select_nth_unstable(n - 1);
        // Every entry older than the n-th oldest goes, and of those just
        // as old, as many as make n.
        let mut ties = n - ages.iter().filter(|&&age| age < cutoff).count();
        shard.retain(|(_, v)| {
            let age = v.last_used_ms();
            let tie = age == cutoff && ties > 0;
            if tie {
                ties -= 1;
            }
            let evict = age < cutoff || tie;
            if evict {
                self.dropped(v);
            }
            !evict
        });
    }

    /// About how many entries it holds at most.
    pub fn max_keys(&self) -> usize {
        self.max_per_shard * SHARDS
    }

    /// Runs `f` on `key`'s entry when it exists.
    pub fn get<R>(&self, key: &str, f: impl FnOnce(&mut V) -> R) -> Option<R> {
        self.get_hashed(self.hashed(key), f)
    }

    /// [`KeyMap::get`] for a key hashed by [`KeyMap::hashed`].
    pub fn get_hashed<R>(&self, key: Hashed<'_>, f: impl FnOnce(&mut V) -> R) -> Option<R> {
        let Hashed { key, hash } = key;
        let mut shard = self.shard(hash);
        shard.find_mut(hash, |(k, _)| k == key).map(|(_, v)| f(v))
    }

    /// Drops every idle entry; returns how many remain.
    pub fn sweep(&self, now_ms: u64) -> usize {
        self.shards
            .iter()
            .map(|shard| {
                let mut map = lock(shard);
                map.retain(|(_, v)| self.keep(v, now_ms));
                map.len()
            })
            .sum()
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(s).len()).sum()
    }

    /// Whether the map is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The shard of the key whose hash is `hash`, locked.
    fn shard(&self, hash: u64) -> MutexGuard<'_, Shard<V>> {
        // Bits a shard's table uses for neither its bucket index (the low
        // ones) nor its tags (the top seven); truncation keeps them.
        let i = (hash >> 32) as usize % SHARDS;
        lock(&self.shards[i])
    }
}

/// Locks a shard; a panic elsewhere leaves plain numbers, still usable.
fn lock<V>(shard: &Mutex<Shard<V>>) -> MutexGuard<'_, Shard<V>> {
    shard.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Idle once `now` passes the stored time.
    struct Until(u64);

    impl Idle for Until {
        fn is_idle(&self, now_ms: u64) -> bool {
            now_ms >= self.0
        }

        fn last_used_ms(&self) -> u64 {
            0
        }
    }

    /// Never idle; last used at the stored time.
    struct Used(u64);

    impl Idle for Used {
        fn is_idle(&self, _: u64) -> bool {
            false
        }

        fn last_used_ms(&self) -> u64 {
            self.0
        }
    }

    #[test]
    fn at_the_cap_the_least_recently_used_keys_go_first() {
        let map = KeyMap::new(16 * 10);
        // One key in use all along, among a flood of single-use keys.
        let mut created = 0;
        for i in 0..5_000u64 {
            let create = || {
                created += 1;
                Used(i)
            };
            map.with("busy", i, create, |e| e.0 = i);
            map.with(&format!("flood-{i}"), i, || Used(i), |_| ());
        }
        assert!(map.len() <= 16 * 10, "{}", map.len());
        assert_eq!(created, 1, "the key in use was never evicted");
    }

    #[test]
    fn entries_are_created_once_and_updated_in_place() {
        let map = KeyMap::new(100);
        map.with("a", 0, || Until(5), |e| e.0 += 1);
        map.with("a", 0, || Until(0), |e| e.0 += 1);
        assert_eq!(map.get("a", |e| e.0), Some(7));
        assert_eq!(map.get("b", |e| e.0), None);
    }

    #[test]
    fn sweep_drops_idle_entries_only() {
        let map = KeyMap::new(100);
        map.with("short", 0, || Until(10), |_| ());
        map.with("long", 0, || Until(1_000), |_| ());
        assert_eq!(map.sweep(10), 1);
        assert_eq!(map.sweep(1_000), 0);
        assert!(map.is_empty());
    }

    #[test]
    fn a_flood_of_new_keys_stays_bounded_and_every_dropped_entry_is_reported() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicUsize, Ordering};

        let dropped = Arc::new(AtomicUsize::new(0));
        let count = dropped.clone();
        let map = KeyMap::new(64).on_evict(move |_: &Until| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        for i in 0..10_000 {
            map.with(&format!("attacker-{i}"), 0, || Until(u64::MAX), |_| ());
        }
        assert!(map.len() <= 64, "{}", map.len());
        assert_eq!(dropped.load(Ordering::Relaxed) + map.len(), 10_000);
        map.with("idle", 0, || Until(5), |_| ());
        let before = dropped.load(Ordering::Relaxed);
        map.sweep(5);
        assert_eq!(dropped.load(Ordering::Relaxed), before + 1, "swept");
    }
}
