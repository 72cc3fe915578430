//! Hot keys: observed rate, batched token leases, and the over-limit cache.
//!
//! Owns the per-key state that lets an instance skip Redis:
//! - **rate**: requests (in tokens) per second over the last full second;
//! - **lease**: when a key's local rate reaches `lease.min_rate_per_second`,
//!   the instance takes a batch of tokens from Redis in one call and spends
//!   them locally. The batch is `min(local rate, refill) × lease.window_ms`,
//!   capped by `lease.max_batch` and the capacity; tokens unspent after the
//!   window expire (counted). Leased tokens really left Redis, so a lease
//!   only shifts admission by up to one window: the cluster can over-admit
//!   by at most instances × batch in a short interval. Rules in exact mode
//!   never lease.
//! - **over-limit cache**: when Redis says no request like this one can pass
//!   for t ms (a rejection, or an admission that took the last tokens), the
//!   instance rejects that key locally until t has passed, without calling
//!   Redis. When the block ends, one request goes to Redis while the others
//!   keep being rejected, so a spamming tenant costs at most one Redis call
//!   per key per retry interval per instance.
//!
//! Memory is bounded by the shared [`KeyMap`] cap; idle entries are swept.

use super::decision::{BucketSpec, Decision};
use super::keymap::{Idle, KeyMap};
use crate::clock::SharedClock;
use crate::config::LeaseSettings;
use crate::telemetry::{DecisionSource, Metrics};

/// Length of one rate-measurement window.
const RATE_WINDOW_MS: u64 = 1_000;

/// What to do with a request, before any Redis call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Plan {
    /// Decided here: spent from a lease, or rejected by the over-limit cache.
    Local(Decision, DecisionSource),
    /// Ask Redis for up to `want` tokens, at least `min`: this request's
    /// cost alone (`want == min == cost`), or a lease.
    Call {
        /// Tokens wanted.
        want: u32,
        /// Fewest tokens worth taking (covers this request).
        min: u32,
        /// This is the one request let through after a block; others are
        /// turned away until [`HotKeys::record`] or [`HotKeys::settle`].
        probe: bool,
    },
}

impl Plan {
    /// A call for `cost` tokens alone.
    fn single(cost: u32, probe: bool) -> Self {
        Self::Call {
            want: cost,
            min: cost,
            probe,
        }
    }
}

/// One key's hot-path state.
#[derive(Debug, Clone, Copy)]
struct KeyState {
    /// Start of the current rate window (ms).
    window_start_ms: u64,
    /// Tokens requested in the current rate window.
    window_tokens: u64,
    /// Tokens per second requested over the last full window.
    rate: f64,
    /// Leased tokens not yet spent.
    leased: u32,
    /// When the lease expires (ms).
    lease_expires_ms: u64,
    /// Reject locally until this time (ms); 0 when not blocked.
    blocked_until_ms: u64,
    /// Length of the last block (ms), quoted to requests turned away while
    /// the one request after a block is in flight.
    last_wait_ms: u64,
    /// Whether the one request after a block is waiting for Redis.
    in_flight: bool,
    /// Tokens Redis reported left at the last call, for headers.
    last_remaining: u64,
    /// Last request (ms).
    last_seen_ms: u64,
}

impl KeyState {
    fn new(now_ms: u64) -> Self {
        Self {
            window_start_ms: now_ms,
            window_tokens: 0,
            rate: 0.0,
            leased: 0,
            lease_expires_ms: 0,
            blocked_until_ms: 0,
            last_wait_ms: 0,
            in_flight: false,
            last_remaining: 0,
            last_seen_ms: now_ms,
        }
    }

    /// Counts a request of `cost` tokens at `now_ms`.
    fn observe(&mut self, cost: u32, now_ms: u64) {
        let elapsed = now_ms.saturating_sub(self.window_start_ms);
        if elapsed >= RATE_WINDOW_MS {
            self.rate = self.window_tokens as f64 * 1000.0 / elapsed as f64;
            self.window_start_ms = now_ms;
            self.window_tokens = 0;
        }
        self.window_tokens += u64::from(cost);
        self.last_seen_ms = now_ms;
    }
}

impl Idle for KeyState {
    fn is_idle(&self, now_ms: u64) -> bool {
        self.leased == 0
            && !self.in_flight
            && now_ms >= self.blocked_until_ms
            && now_ms.saturating_sub(self.last_seen_ms) >= 2 * RATE_WINDOW_MS
    }
}

/// Hot-key state of every key this instance sees.
pub struct HotKeys {
    /// Key → state.
    keys: KeyMap<KeyState>,
    /// Lease knobs.
    settings: LeaseSettings,
    /// Time.
    clock: SharedClock,
    /// Lease counters.
    metrics: Metrics,
}

impl HotKeys {
    /// An empty table holding at most about `max_keys` keys.
    pub fn new(
        settings: LeaseSettings,
        max_keys: usize,
        clock: SharedClock,
        metrics: Metrics,
    ) -> Self {
        Self {
            keys: KeyMap::new(max_keys),
            settings,
            clock,
            metrics,
        }
    }

    /// Decides what a request for `cost` tokens of `key` (bucket `spec`)
    /// needs; `exact` forbids leasing.
    pub fn plan(&self, key: &str, spec: &BucketSpec, cost: u32, exact: bool) -> Plan {
        let now = self.clock.now_ms();
        let create = || KeyState::new(now);
        self.keys.with(key, now, create, |s| {
            self.plan_for(s, spec, cost, exact, now)
        })
    }

    /// [`HotKeys::plan`] on one key's state.
    fn plan_for(
        &self,
        s: &mut KeyState,
        spec: &BucketSpec,
        cost: u32,
        exact: bool,
        now: u64,
    ) -> Plan {
        s.observe(cost, now);
        if s.leased > 0 && now >= s.lease_expires_ms {
            self.metrics.lease_expired(s.leased);
            s.leased = 0;
        }
        if s.leased >= cost {
            s.leased -= cost;
            let allowed = Decision {
                allowed: true,
                remaining: s.last_remaining + u64::from(s.leased),
                retry_after_ms: 0,
            };
            return Plan::Local(allowed, DecisionSource::Lease);
        }
        let wait = if now < s.blocked_until_ms {
            Some(s.blocked_until_ms - now)
        } else if s.in_flight {
            Some(s.last_wait_ms.max(1))
        } else {
            None
        };
        if let Some(retry_after_ms) = wait {
            let rejected = Decision {
                allowed: false,
                remaining: s.last_remaining,
                retry_after_ms,
            };
            return Plan::Local(rejected, DecisionSource::Cache);
        }
        // The first request after a block goes to Redis alone.
        let probe = s.blocked_until_ms != 0;
        s.in_flight = probe;
        if exact || !self.settings.enabled || s.rate < self.settings.min_rate_per_second {
            return Plan::single(cost, probe);
        }
        let batch = self.batch(s.rate, spec);
        if batch >= 2 * cost {
            Plan::Call {
                want: batch,
                min: cost.max(batch / 2),
                probe,
            }
        } else {
            Plan::single(cost, probe)
        }
    }

    /// Tokens to lease at a local rate of `rate` tokens/s.
    fn batch(&self, rate: f64, spec: &BucketSpec) -> u32 {
        let per_window = rate.min(spec.refill_per_second) * self.settings.window.as_secs_f64();
        // Saturating float-to-int cast; the value is finite and >= 0.
        (per_window.floor() as u32)
            .min(self.settings.max_batch)
            .min(spec.capacity.get())
    }

    /// Records Redis's answer to a call for `key`: `granted` tokens of which
    /// the request spent `cost` (the rest become a lease), or a rejection
    /// that blocks the key locally until its retry delay has passed.
    pub fn record(&self, key: &str, decision: &Decision, granted: u32, cost: u32) {
        let now = self.clock.now_ms();
        let window = self.settings.window;
        self.keys.get(key, |s| {
            s.in_flight = false;
            s.last_remaining = decision.remaining;
            s.blocked_until_ms = match decision.retry_after_ms {
                0 => 0,
                wait => {
                    s.last_wait_ms = wait;
                    now + wait
                }
            };
            if decision.allowed && granted > cost {
                s.leased += granted - cost;
                s.lease_expires_ms = now + u64::try_from(window.as_millis()).unwrap_or(u64::MAX);
                self.metrics.lease_taken(granted);
            }
        });
    }

    /// Ends the in-flight request of `key` without an answer (Redis
    /// failed, or the request was dropped), so the next one may try.
    pub fn settle(&self, key: &str) {
        self.keys.get(key, |s| s.in_flight = false);
    }

    /// Drops idle keys; returns how many remain.
    pub fn sweep(&self) -> usize {
        self.keys.sweep(self.clock.now_ms())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use std::num::NonZeroU32;
    use std::sync::Arc;
    use std::time::Duration;

    fn settings() -> LeaseSettings {
        LeaseSettings {
            enabled: true,
            window: Duration::from_millis(100),
            max_batch: 50,
            min_rate_per_second: 100.0,
        }
    }

    fn spec(capacity: u32, refill: u32) -> BucketSpec {
        BucketSpec::of(
            NonZeroU32::new(capacity).unwrap(),
            NonZeroU32::new(refill).unwrap(),
        )
    }

    fn table(clock: &Arc<ManualClock>) -> HotKeys {
        crate::telemetry::install();
        HotKeys::new(settings(), 1_000, clock.clone(), Metrics::new())
    }

    /// Sends `n` requests spread evenly over `ms`, answering each Redis
    /// call with `granted` tokens; returns the plans.
    fn drive(hot: &HotKeys, clock: &ManualClock, s: &BucketSpec, n: u64, ms: u64) -> Vec<Plan> {
        (0..n)
            .map(|_| {
                let plan = hot.plan("k", s, 1, false);
                clock.advance(Duration::from_micros(ms * 1000 / n));
                plan
            })
            .collect()
    }

    /// 300 requests in 900 ms, then a pause to the end of the rate window:
    /// the next request completes the window at exactly 300 tokens/s.
    fn warm(hot: &HotKeys, clock: &ManualClock, s: &BucketSpec) {
        drive(hot, clock, s, 300, 900);
        clock.advance(Duration::from_millis(100));
    }

    #[test]
    fn slow_keys_call_redis_for_every_request() {
        let clock = ManualClock::new(0);
        let hot = table(&clock);
        let plans = drive(&hot, &clock, &spec(100, 1000), 150, 2_000);
        assert!(plans.iter().all(|p| *p == Plan::single(1, false)));
    }

    #[test]
    fn batch_follows_the_observed_rate_capped_by_refill_and_maximum() {
        let clock = ManualClock::new(0);
        let hot = table(&clock);
        // 300 req/s, refill 1000/s: 300 × 0.1 s = 30.
        warm(&hot, &clock, &spec(100, 1000));
        assert_eq!(
            hot.plan("k", &spec(100, 1000), 1, false),
            Plan::Call {
                want: 30,
                min: 15,
                probe: false
            }
        );
        // The same rate against a 200/s refill: 200 × 0.1 s = 20.
        assert_eq!(
            hot.plan("k", &spec(100, 200), 1, false),
            Plan::Call {
                want: 20,
                min: 10,
                probe: false
            }
        );
        // Capped by lease.max_batch, and by the capacity.
        assert_eq!(hot.batch(5_000.0, &spec(100, 10_000)), 50);
        assert_eq!(hot.batch(5_000.0, &spec(8, 10_000)), 8);
        // Exact mode never leases.
        assert_eq!(
            hot.plan("k", &spec(100, 1000), 1, true),
            Plan::single(1, false)
        );
    }

    #[test]
    fn leased_tokens_are_spent_locally_then_expire_after_the_window() {
        let clock = ManualClock::new(0);
        let hot = table(&clock);
        let s = spec(100, 1000);
        warm(&hot, &clock, &s);
        assert!(matches!(
            hot.plan("k", &s, 1, false),
            Plan::Call { want: 30, .. }
        ));
        let granted = Decision {
            allowed: true,
            remaining: 40,
            retry_after_ms: 0,
        };
        hot.record("k", &granted, 30, 1);
        for left in (0..29).rev() {
            let Plan::Local(d, DecisionSource::Lease) = hot.plan("k", &s, 1, false) else {
                panic!("expected a lease spend");
            };
            assert!(d.allowed);
            assert_eq!(d.remaining, 40 + left);
        }
        assert!(
            matches!(hot.plan("k", &s, 1, false), Plan::Call { want: 30, .. }),
            "lease used up"
        );

        hot.record("k", &granted, 30, 1);
        clock.advance(Duration::from_millis(100));
        assert!(
            matches!(hot.plan("k", &s, 1, false), Plan::Call { want: 30, .. }),
            "lease expired"
        );
    }

    #[test]
    fn a_rejection_blocks_the_key_until_its_retry_delay_passes() {
        let clock = ManualClock::new(0);
        let hot = table(&clock);
        let s = spec(10, 1);
        assert_eq!(hot.plan("spam", &s, 1, true), Plan::single(1, false));
        let rejected = Decision {
            allowed: false,
            remaining: 0,
            retry_after_ms: 250,
        };
        hot.record("spam", &rejected, 0, 1);
        for _ in 0..100 {
            clock.advance(Duration::from_millis(2));
            let Plan::Local(d, DecisionSource::Cache) = hot.plan("spam", &s, 1, true) else {
                panic!("expected a cached rejection");
            };
            assert!(!d.allowed && d.retry_after_ms <= 250);
        }
        clock.advance(Duration::from_millis(50));
        assert_eq!(
            hot.plan("spam", &s, 1, true),
            Plan::single(1, true),
            "one Redis call per retry interval"
        );
        // While that call is in flight, the others are still turned away.
        let Plan::Local(d, DecisionSource::Cache) = hot.plan("spam", &s, 1, true) else {
            panic!("expected a cached rejection while one request is in flight");
        };
        assert_eq!(d.retry_after_ms, 250);
        // An admission that took the last token blocks until the next one.
        let last = Decision {
            allowed: true,
            remaining: 0,
            retry_after_ms: 900,
        };
        hot.record("spam", &last, 1, 1);
        clock.advance(Duration::from_millis(899));
        assert!(matches!(
            hot.plan("spam", &s, 1, true),
            Plan::Local(_, DecisionSource::Cache)
        ));
        clock.advance(Duration::from_millis(1));
        assert_eq!(hot.plan("spam", &s, 1, true), Plan::single(1, true));
        // A failed call releases the key for the next request.
        hot.settle("spam");
        assert_eq!(hot.plan("spam", &s, 1, true), Plan::single(1, true));
        // An admission with tokens to spare lifts the block.
        let plenty = Decision {
            allowed: true,
            remaining: 3,
            retry_after_ms: 0,
        };
        hot.record("spam", &plenty, 1, 1);
        assert_eq!(hot.plan("spam", &s, 1, true), Plan::single(1, false));
    }

    #[test]
    fn idle_keys_are_swept() {
        let clock = ManualClock::new(0);
        let hot = table(&clock);
        hot.plan("k", &spec(10, 1), 1, false);
        assert_eq!(hot.sweep(), 1);
        clock.advance(Duration::from_secs(2));
        assert_eq!(hot.sweep(), 0);
    }
}
