//! In-process buckets: local-only mode and the fallback when Redis fails.
//!
//! Owns a bounded [`KeyMap`] of [`TokenState`]s, and ones of quota counts
//! and of concurrency slots for requests with several limits
//! ([`LocalBuckets::take_group`]). A bucket that has refilled completely
//! is idle, and so is a quota whose window has ended and a set of slots
//! whose holds have all ended: forgetting either loses nothing, since it
//! comes back full.

use super::decision::{Ask, AskKind, BucketSpec, Decision, GroupGrant, GroupLimit, Holder};
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

/// One tracked quota: its window's count.
#[derive(Debug, Clone, Copy)]
struct Counted {
    /// When the counted window ends (Unix milliseconds).
    ends_ms: u64,
    /// Requests counted in it.
    used: u64,
    /// When the window ends by the map's own (monotonic) clock.
    idle_at_ms: u64,
}

impl Idle for Counted {
    fn is_idle(&self, now_ms: u64) -> bool {
        now_ms >= self.idle_at_ms
    }

    fn last_used_ms(&self) -> u64 {
        self.idle_at_ms
    }
}

/// Wait quoted when no slot is free: a slot frees when a request ends,
/// which no clock foretells (the script's figure).
const SLOT_WAIT_MS: u64 = 1000;

/// One tracked set of concurrency slots: who holds one, and until when
/// (by the map's own clock) unless renewed.
#[derive(Debug, Clone, Default)]
struct Seats {
    /// Holder id → end of its hold.
    holds: Vec<(u64, u64)>,
}

impl Seats {
    /// Drops the holds that ended by `now_ms`; the slots still held.
    fn live(&mut self, now_ms: u64) -> u64 {
        self.holds.retain(|(_, ends)| *ends > now_ms);
        self.holds.len() as u64
    }

    /// Where `holder`'s hold is, if it has one.
    fn of(&self, holder: Holder) -> Option<usize> {
        self.holds.iter().position(|(id, _)| *id == holder.id)
    }
}

impl Idle for Seats {
    fn is_idle(&self, now_ms: u64) -> bool {
        self.holds.iter().all(|(_, ends)| *ends <= now_ms)
    }

    fn last_used_ms(&self) -> u64 {
        self.holds.iter().map(|(_, ends)| *ends).max().unwrap_or(0)
    }
}

/// Keyed in-process token buckets, quota counts and concurrency slots.
pub struct LocalBuckets {
    /// Key → bucket.
    buckets: KeyMap<Entry>,
    /// Key → quota count.
    quotas: KeyMap<Counted>,
    /// Key → concurrency slots.
    slots: KeyMap<Seats>,
    /// Time source for refills.
    clock: SharedClock,
}

impl LocalBuckets {
    /// An empty set holding at most about `max_keys` buckets.
    pub fn new(max_keys: usize, clock: SharedClock) -> Self {
        Self {
            buckets: KeyMap::new(max_keys),
            quotas: KeyMap::new(max_keys),
            slots: KeyMap::new(max_keys),
            clock,
        }
    }

    /// About how many keys it holds at most.
    pub fn max_keys(&self) -> usize {
        self.buckets.max_keys()
    }

    /// Refills `key`'s bucket to now and tries to take `cost` tokens.
    pub fn take(&self, key: &str, spec: &BucketSpec, cost: u32) -> Decision {
        self.with_bucket(key, spec, |state, now| state.take(spec, cost, now))
    }

    /// Runs `f` on `key`'s bucket (made full when new) under `spec`, with
    /// the time now.
    fn with_bucket<R>(
        &self,
        key: &str,
        spec: &BucketSpec,
        f: impl FnOnce(&mut TokenState, u64) -> R,
    ) -> R {
        let now = self.clock.now_ms();
        let create = || Entry {
            state: TokenState::full(spec, now),
            spec: *spec,
            last_used_ms: now,
        };
        self.buckets.with(key, now, create, |entry| {
            entry.spec = *spec;
            entry.last_used_ms = now;
            f(&mut entry.state, now)
        })
    }

    /// Takes the same count from every limit of `group`, or nothing from
    /// any, as `ask` says, with the script's arithmetic: the request's cost,
    /// or for a lease as many as the fullest limit allows up to `want` (at
    /// least `min`, else `need` alone), every count clamped to the smallest
    /// limit; a quota counts the requests of its current window. Each limit
    /// is checked, then each taken, not under one lock: two requests racing
    /// for the last tokens of different limits may both pass, which the
    /// fallback's 1/N shares make small.
    ///
    /// A concurrency limit admits when it has a slot free and the ask's
    /// holder holds none, and then holds one for the holder, whatever the
    /// cost, until released or its lease ends unrenewed.
    ///
    /// A charge (or refund) is taken from every limit whatever it holds,
    /// as [`LocalBuckets::charge_group`] says; a release or renewal is
    /// [`LocalBuckets::hold_group`]'s.
    pub fn take_group(&self, group: &[(String, GroupLimit)], ask: Ask) -> GroupGrant {
        if let Some(amount) = ask.charged() {
            return GroupGrant {
                granted: ask.want,
                decisions: self.charge_group(group, amount),
                block_ms: 0,
            };
        }
        if matches!(ask.kind, AskKind::Release | AskKind::Renew) {
            return GroupGrant {
                granted: 0,
                decisions: self.hold_group(group, ask),
                block_ms: 0,
            };
        }
        let now = self.clock.now_ms();
        // Windows end on the calendar: their arithmetic takes Unix time.
        let unix = self.clock.unix_ms();
        let held: Vec<f64> = group
            .iter()
            .map(|(key, limit)| match limit {
                GroupLimit::Bucket(spec) => self
                    .buckets
                    .get(key, |e| e.state.available(spec, now))
                    .unwrap_or(f64::from(spec.capacity.get())),
                GroupLimit::Quota { quota, window } => {
                    let ends_ms = window.end_ms(unix);
                    let used = self
                        .quotas
                        .get(key, |c| if c.ends_ms == ends_ms { c.used } else { 0 })
                        .unwrap_or(0);
                    f64::from(quota.get()) - used as f64
                }
                GroupLimit::Slots { slots, .. } => {
                    let used = self.slots.get(key, |s| s.live(now)).unwrap_or(0);
                    f64::from(slots.get()) - used as f64
                }
            })
            .collect();
        // Slots are not counted in tokens: each admits or not. A holder
        // already holding one is refused: one slot per holder.
        let holds = |key: &str, h: Holder| self.slots.get(key, |s| s.of(h)).flatten();
        let full = group.iter().zip(&held).any(|((key, limit), free)| {
            limit
                .holder()
                .is_some_and(|h| *free < 1.0 || holds(key, h).is_some())
        });
        let counted = || group.iter().zip(&held).filter(|((_, l), _)| !l.is_slots());
        let size = counted()
            .map(|((_, limit), _)| limit.size())
            .min()
            .unwrap_or(u64::MAX);
        let clamp = |n: u32| u64::from(n).min(size);
        let want = clamp(ask.want);
        let min = clamp(ask.min).min(want);
        let need = clamp(ask.need).min(min);
        let avail = counted().map(|(_, t)| *t).fold(f64::INFINITY, f64::min);
        // Saturating float-to-int casts of finite, non-negative values.
        let granted = if full {
            0
        } else if avail >= min as f64 {
            (avail.floor() as u64).min(want)
        } else if avail >= need as f64 {
            need
        } else {
            0
        };
        let mut block_ms = 0;
        let decisions = group
            .iter()
            .zip(held)
            .map(|((key, limit), tokens)| {
                let left = match limit {
                    GroupLimit::Slots { holder, .. } if granted > 0 => {
                        self.hold(key, *holder, now);
                        tokens - 1.0
                    }
                    GroupLimit::Slots { .. } => tokens,
                    _ => tokens - granted as f64,
                };
                let wait = |n: u64| -> u64 {
                    if left >= n as f64 {
                        return 0;
                    }
                    match limit {
                        GroupLimit::Bucket(spec) => {
                            ((n as f64 - left) * 1000.0 / spec.refill_per_second).ceil() as u64
                        }
                        GroupLimit::Quota { window, .. } => window.end_ms(unix) - unix,
                        GroupLimit::Slots { .. } => SLOT_WAIT_MS,
                    }
                };
                if granted > 0 {
                    // u32 because every count is at most a limit's size.
                    let taken = u32::try_from(granted).unwrap_or(u32::MAX);
                    match limit {
                        GroupLimit::Bucket(spec) => {
                            self.take(key, spec, taken);
                        }
                        GroupLimit::Quota { window, .. } => {
                            let ends_ms = window.end_ms(unix);
                            let fresh = || Counted {
                                ends_ms,
                                used: 0,
                                idle_at_ms: now + (ends_ms - unix),
                            };
                            self.quotas.with(key, now, fresh, |c| {
                                if c.ends_ms != ends_ms {
                                    *c = fresh();
                                }
                                c.used += granted;
                            });
                        }
                        GroupLimit::Slots { .. } => {}
                    }
                }
                block_ms = block_ms.max(wait(min));
                Decision {
                    allowed: granted > 0,
                    remaining: left.max(0.0).floor() as u64,
                    retry_after_ms: wait(need),
                }
            })
            .collect();
        GroupGrant {
            granted: u32::try_from(granted).unwrap_or(u32::MAX),
            decisions,
            block_ms,
        }
    }

    /// Charges `amount` (gives it back when negative) to every limit of
    /// `group` whatever it holds, with the script's arithmetic: a bucket
    /// as [`TokenState::charge`], a quota counting `amount` more requests
    /// in its window (between none and twice the quota).
    pub fn charge_group(&self, group: &[(String, GroupLimit)], amount: i64) -> Vec<Decision> {
        let now = self.clock.now_ms();
        let unix = self.clock.unix_ms();
        group
            .iter()
            .map(|(key, limit)| match limit {
                GroupLimit::Bucket(spec) => {
                    self.with_bucket(key, spec, |state, now| state.charge(spec, amount, now))
                }
                GroupLimit::Quota { quota, window } => {
                    let ends_ms = window.end_ms(unix);
                    let fresh = || Counted {
                        ends_ms,
                        used: 0,
                        idle_at_ms: now + (ends_ms - unix),
                    };
                    let size = u64::from(quota.get());
                    let used = self.quotas.with(key, now, fresh, |c| {
                        if c.ends_ms != ends_ms {
                            *c = fresh();
                        }
                        c.used = c.used.saturating_add_signed(amount).min(2 * size);
                        c.used
                    });
                    Decision {
                        allowed: true,
                        remaining: size.saturating_sub(used),
                        retry_after_ms: if used < size { 0 } else { ends_ms - unix },
                    }
                }
                GroupLimit::Slots { .. } => self.slot_decision(key, *limit, true, now),
            })
            .collect()
    }

    /// Holds a slot of `key` for `holder`, for its lease.
    fn hold(&self, key: &str, holder: Holder, now: u64) {
        let ends = now + u64::from(holder.lease_ms);
        self.slots.with(key, now, Seats::default, |seats| {
            seats.holds.push((holder.id, ends));
        });
    }

    /// Gives back (a release) or holds for another lease (a renewal) the
    /// slots of `group`'s concurrency limits, each by its holder, as the
    /// script does; buckets and quotas stay as they are. A renewal is
    /// allowed where the holder still holds its slot.
    pub fn hold_group(&self, group: &[(String, GroupLimit)], ask: Ask) -> Vec<Decision> {
        let now = self.clock.now_ms();
        let release = ask.kind == AskKind::Release;
        group
            .iter()
            .map(|(key, limit)| {
                let Some(holder) = limit.holder() else {
                    return Decision {
                        allowed: true,
                        remaining: limit.size(),
                        retry_after_ms: 0,
                    };
                };
                let kept = self
                    .slots
                    .get(key, |seats| {
                        seats.live(now);
                        match seats.of(holder) {
                            Some(at) if release => {
                                seats.holds.swap_remove(at);
                                true
                            }
                            Some(at) => {
                                seats.holds[at].1 = now + u64::from(holder.lease_ms);
                                true
                            }
                            None => release,
                        }
                    })
                    .unwrap_or(release);
                self.slot_decision(key, *limit, kept, now)
            })
            .collect()
    }

    /// A slot limit's decision as it stands: `allowed`, the free slots,
    /// and a wait when none is.
    fn slot_decision(&self, key: &str, limit: GroupLimit, allowed: bool, now: u64) -> Decision {
        let used = self.slots.get(key, |s| s.live(now)).unwrap_or(0);
        let free = limit.size().saturating_sub(used);
        Decision {
            allowed,
            remaining: free,
            retry_after_ms: if free > 0 { 0 } else { SLOT_WAIT_MS },
        }
    }

    /// Drops every bucket that is full again and every quota whose window
    /// ended; returns how many buckets remain.
    pub fn sweep(&self) -> usize {
        let now = self.clock.now_ms();
        self.quotas.sweep(now);
        self.slots.sweep(now);
        self.buckets.sweep(now)
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
