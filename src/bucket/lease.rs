//! Hot keys: observed rate, batched token leases, and the over-limit cache.
//!
//! Owns the per-key state that lets an instance skip Redis:
//! - **rate**: tokens requested per second over the last 250 ms window (or
//!   the current one, once it is 50 ms long, when that is higher);
//! - **lease**: when a key's local rate reaches `lease.min_rate_per_second`,
//!   the instance takes a batch of tokens from Redis in one call and spends
//!   them locally. The batch is `min(local rate, refill) × lease.window_ms`,
//!   capped by `lease.max_batch` and the capacity; a lease call takes at
//!   least half of it or nothing, and the whole batch or nothing when the
//!   key was blocked (contended). Tokens unspent after the window of the
//!   latest lease expire (counted). Leased tokens really left Redis, so
//!   leasing never admits more than Redis granted; it only moves when they
//!   are spent, which lets the cluster over-admit by at most instances ×
//!   batch in a short interval. Only one request per key fetches
//!   a lease at a time; the others wait for it (bounded by the Redis
//!   timeout) and spend from it, instead of all asking Redis when a lease
//!   runs out. The next lease is fetched ahead, in the background, when the
//!   current one falls under a quarter batch, topping it up to one batch
//!   (what was left then expires with the new lease's window), so a steady
//!   hot key is served without waiting for Redis. Rules in exact mode never
//!   lease.
//! - **over-limit cache**: when Redis says no request like this one can pass
//!   for t ms (a rejection, or an admission that took the last tokens), the
//!   instance rejects that key locally until t has passed, without calling
//!   Redis. When the block ends, one request goes to Redis while the others
//!   keep being rejected, so a spamming tenant costs at most one Redis call
//!   per key per retry interval per instance.
//!
//! Memory is bounded by the shared [`KeyMap`] cap; idle entries are swept.

use std::sync::Arc;

use tokio::sync::Notify;
use tokio::sync::futures::OwnedNotified;

use super::decision::{Ask, BucketSpec, Decision, Grant};
use super::keymap::{Hashed, Idle, KeyMap};
use crate::clock::{SharedClock, millis};
use crate::config::LeaseSettings;
use crate::telemetry::{DecisionSource, Metrics};

/// Length of one rate-measurement window.
const RATE_WINDOW_MS: u64 = 250;
/// The current window counts once it is this long, so a key that turns hot
/// leases within tens of milliseconds rather than a whole window later.
const MIN_PARTIAL_WINDOW_MS: u64 = 50;

/// What to do with a request, before any Redis call.
#[derive(Debug)]
pub enum Plan {
    /// Decided here: spent from a lease, or rejected by the over-limit cache.
    Local(Decision, DecisionSource),
    /// Ask Redis as `ask` says: this request's cost alone
    /// ([`Ask::single`]), or a lease.
    Call {
        /// What to take.
        ask: Ask,
        /// This call holds the key's slot (the one request after a block,
        /// or the one fetching a lease); [`HotKeys::record`] or
        /// [`HotKeys::settle`] must release it.
        owner: bool,
    },
    /// Spent from the lease, which is running low: fetch the next one, as
    /// `ask` says, in the background (this request holds the key's slot for
    /// it, as an owner [`Plan::Call`] does), so that a steady hot key never
    /// waits for Redis.
    Refresh {
        /// This request's admission.
        decision: Decision,
        /// The top-up to ask for.
        ask: Ask,
    },
    /// Another request is fetching a lease for this key: wait for it, then
    /// plan again.
    Wait(OwnedNotified),
}

impl Plan {
    /// A call for `cost` tokens alone.
    fn single(cost: u32, owner: bool) -> Self {
        Self::Call {
            ask: Ask::single(cost),
            owner,
        }
    }
}

/// One key's hot-path state.
#[derive(Debug)]
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
    /// The cost the block was computed for: a cheaper request is blocked
    /// for less (see [`KeyState::blocked_for`]).
    blocked_need: u32,
    /// Length of the last block (ms), quoted to requests turned away while
    /// the one request after a block is in flight.
    last_wait_ms: u64,
    /// Whether the one request after a block is waiting for Redis.
    in_flight: bool,
    /// A lease being fetched; requests arriving meanwhile wait on it.
    fetch: Option<Arc<Notify>>,
    /// Tokens Redis reported left at the last call, for headers.
    last_remaining: u64,
    /// Last request (ms).
    last_seen_ms: u64,
    /// The bucket (capacity, refill bits) of the last request; a block
    /// computed under another bucket no longer holds.
    bucket: (u32, u64),
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
            blocked_need: 0,
            last_wait_ms: 0,
            in_flight: false,
            fetch: None,
            last_remaining: 0,
            last_seen_ms: now_ms,
            bucket: (0, 0),
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

    /// Tokens per second: the last full window's rate, or the current
    /// window's when it is higher and long enough to count.
    fn rate_at(&self, now_ms: u64) -> f64 {
        let elapsed = now_ms.saturating_sub(self.window_start_ms);
        if elapsed >= MIN_PARTIAL_WINDOW_MS {
            self.rate
                .max(self.window_tokens as f64 * 1000.0 / elapsed as f64)
        } else {
            self.rate
        }
    }

    /// How long a request of `cost` tokens from `spec` is still blocked at
    /// `now_ms`, if it is: the block was computed for `blocked_need`
    /// tokens, and a cheaper request needs (need − cost) / refill less.
    /// (Rounding down the difference keeps the answer no shorter than the
    /// wait Redis would give.)
    fn blocked_for(&self, cost: u32, spec: &BucketSpec, now_ms: u64) -> Option<u64> {
        let left = self
            .blocked_until_ms
            .checked_sub(now_ms)
            .filter(|l| *l > 0)?;
        let capacity = spec.capacity.get();
        let (need, cost) = (self.blocked_need.min(capacity), cost.min(capacity));
        if cost >= need {
            return Some(left);
        }
        let sooner = (f64::from(need - cost) * 1000.0 / spec.refill_per_second).floor() as u64;
        left.checked_sub(sooner).filter(|w| *w > 0)
    }

    /// Ends a probe or lease fetch, waking the requests waiting on it.
    fn release(&mut self) {
        self.in_flight = false;
        if let Some(fetch) = self.fetch.take() {
            fetch.notify_waiters();
        }
    }
}

impl Idle for KeyState {
    fn is_idle(&self, now_ms: u64) -> bool {
        (self.leased == 0 || now_ms >= self.lease_expires_ms)
            && !self.in_flight
            && self.fetch.is_none()
            && now_ms >= self.blocked_until_ms
            && now_ms.saturating_sub(self.last_seen_ms) >= 8 * RATE_WINDOW_MS
    }

    fn last_used_ms(&self) -> u64 {
        self.last_seen_ms
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
        let expired = metrics.clone();
        Self {
            // A key forgotten with a lease (expired, or evicted at the cap)
            // loses those tokens unspent.
            keys: KeyMap::new(max_keys).on_evict(move |s: &KeyState| {
                if s.leased > 0 {
                    expired.lease_expired(s.leased);
                }
            }),
            settings,
            clock,
            metrics,
        }
    }

    /// `key` hashed for [`HotKeys::plan`] and [`HotKeys::record`], which a
    /// decision calls one after the other: the key is hashed once.
    pub fn key<'k>(&self, key: &'k str) -> Hashed<'k> {
        self.keys.hashed(key)
    }

    /// Decides what a request for `cost` tokens of `key` (bucket `spec`)
    /// needs. `exact` forbids leasing; without `may_wait` the request never
    /// waits for another's lease and asks Redis alone instead.
    pub fn plan(
        &self,
        key: Hashed<'_>,
        spec: &BucketSpec,
        cost: u32,
        exact: bool,
        may_wait: bool,
    ) -> Plan {
        let now = self.clock.now_ms();
        let request = Request {
            spec,
            cost,
            exact,
            may_wait,
            now,
        };
        self.keys.with_hashed(
            key,
            now,
            || KeyState::new(now),
            |s| self.plan_for(s, &request),
        )
    }

    /// [`HotKeys::plan`] on one key's state.
    fn plan_for(&self, s: &mut KeyState, r: &Request<'_>) -> Plan {
        let (cost, now) = (r.cost, r.now);
        s.observe(cost, now);
        let bucket = (r.spec.capacity.get(), r.spec.refill_per_second.to_bits());
        if s.bucket != bucket {
            // The rule (or this region's share of it) changed.
            s.bucket = bucket;
            s.blocked_until_ms = 0;
        }
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
            return match self.refresh(s, r) {
                Some(ask) => Plan::Refresh {
                    decision: allowed,
                    ask,
                },
                None => Plan::Local(allowed, DecisionSource::Lease),
            };
        }
        let wait = if let Some(blocked) = s.blocked_for(cost, r.spec, now) {
            Some(blocked)
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
        if let Some(fetch) = &s.fetch {
            return if r.may_wait {
                // Registered now, so the fetch's notification cannot be missed.
                Plan::Wait(fetch.clone().notified_owned())
            } else {
                Plan::single(cost, false)
            };
        }
        // The first request after a block goes to Redis alone.
        let probe = s.blocked_until_ms != 0;
        s.in_flight = probe;
        let rate = s.rate_at(now);
        let batch = self.batch(rate, r.spec);
        if !self.leases(r, rate, batch) {
            return Plan::single(cost, probe);
        }
        // After a block the key is contended (several instances wait for
        // the same tokens): ask for the whole batch or nothing, so a
        // rejection blocks until a full batch exists instead of sending a
        // probe for every few tokens. Otherwise at least half a batch, or
        // just this request when fewer exist.
        let (min, need) = if probe {
            (batch, batch)
        } else {
            s.fetch = Some(Arc::new(Notify::new()));
            (cost.max(batch / 2), cost)
        };
        Plan::Call {
            ask: Ask::lease(batch, min, need),
            owner: true,
        }
    }

    /// Whether a key at `rate` tokens/s, whose batch would be `batch`, leases.
    fn leases(&self, r: &Request<'_>, rate: f64, batch: u32) -> bool {
        !r.exact
            && self.settings.enabled
            && rate >= self.settings.min_rate_per_second
            && batch >= 2 * r.cost
    }

    /// After a spend from the lease: the [`Ask`] for the next lease when
    /// what is left fell under a quarter batch and no call for the key is
    /// under way (the key's slot is then taken for it). Fetched ahead, the
    /// next lease usually arrives before this one runs out. It tops the
    /// lease up to one batch, never more, so the over-admission bound stays
    /// instances × batch.
    fn refresh(&self, s: &mut KeyState, r: &Request<'_>) -> Option<Ask> {
        if s.fetch.is_some() || s.in_flight || r.now < s.blocked_until_ms {
            return None;
        }
        let rate = s.rate_at(r.now);
        let batch = self.batch(rate, r.spec);
        if !self.leases(r, rate, batch) || s.leased >= (batch / 4).max(r.cost) {
            return None;
        }
        s.fetch = Some(Arc::new(Notify::new()));
        // leased < max(batch/4, cost) and batch >= 2 × cost, so the top-up
        // exceeds half a batch: min <= want.
        Some(Ask::lease(batch - s.leased, r.cost.max(batch / 2), r.cost))
    }

    /// Tokens to lease at a local rate of `rate` tokens/s.
    fn batch(&self, rate: f64, spec: &BucketSpec) -> u32 {
        let per_window = rate.min(spec.refill_per_second) * self.settings.window.as_secs_f64();
        // Saturating float-to-int cast; the value is finite and >= 0.
        (per_window.floor() as u32)
            .min(self.settings.max_batch)
            .min(spec.capacity.get())
    }

    /// Records Redis's answer to a call for `key`: the tokens granted, of
    /// which the request spent `cost` (the rest become a lease), and how long
    /// the key must now be blocked. An `owner` call releases the key's slot.
    ///
    /// An answer that sets no block and leaves no lease, to a call that
    /// holds no slot (most calls: a key neither hot nor over its limit),
    /// is not recorded, and the key is not looked up. Such a call was
    /// planned for a key with no block (the first call after one holds the
    /// slot), and what it would record is read only under a block or a
    /// lease, which their own answers record first. A block recorded
    /// meanwhile from another call's refusal is left to run out rather
    /// than lifted by this grant: when the two calls' answers come back in
    /// another order than Redis ran them, the refusal is the later word.
    pub fn record(&self, key: Hashed<'_>, grant: &Grant, cost: u32, owner: bool) {
        if !owner && grant.block_ms == 0 && grant.granted <= cost {
            return;
        }
        let now = self.clock.now_ms();
        let window = millis(self.settings.window);
        self.keys.get_hashed(key, |s| {
            s.last_remaining = grant.decision.remaining;
            s.blocked_until_ms = match grant.block_ms {
                0 => 0,
                wait => {
                    s.last_wait_ms = wait;
                    s.blocked_need = cost;
                    now + wait
                }
            };
            if grant.granted > cost {
                s.leased += grant.granted - cost;
                s.lease_expires_ms = now + window;
                self.metrics.lease_taken(grant.granted - cost);
            }
            if owner {
                s.release();
            }
        });
    }

    /// Records what a charge (usage taken or given back after the fact)
    /// left `key` with, as Redis answered it: what remains, and how long
    /// the key is blocked (a debt) or that it no longer is (a refund), so
    /// the over-limit cache never answers from what the charge changed.
    /// A key with no hot-key state is left without one.
    pub fn charged(&self, key: &str, left: &Decision) {
        let now = self.clock.now_ms();
        self.keys.get(key, |s| {
            s.last_remaining = left.remaining;
            s.blocked_until_ms = match left.retry_after_ms {
                0 => 0,
                wait => {
                    s.last_wait_ms = wait;
                    s.blocked_need = 1;
                    now + wait
                }
            };
        });
    }

    /// Releases `key`'s slot without an answer (Redis failed, or the
    /// request was dropped), so the next request may try.
    pub fn settle(&self, key: &str) {
        self.keys.get(key, KeyState::release);
    }

    /// Drops idle keys; returns how many remain.
    pub fn sweep(&self) -> usize {
        self.keys.sweep(self.clock.now_ms())
    }
}

/// One request's parameters, for planning.
struct Request<'a> {
    spec: &'a BucketSpec,
    cost: u32,
    exact: bool,
    may_wait: bool,
    now: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use std::num::NonZeroU32;
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

    fn plan(hot: &HotKeys, s: &BucketSpec, exact: bool) -> Plan {
        hot.plan(hot.key("k"), s, 1, exact, true)
    }

    /// `(want, min, owner)` of a call plan.
    fn call(p: Plan) -> (u32, u32, bool) {
        match p {
            Plan::Call { ask, owner } => (ask.want, ask.min, owner),
            other => panic!("expected a call, got {other:?}"),
        }
    }

    /// The decision of a plan the over-limit cache answered; `why` says,
    /// on a failure, what the test expected.
    fn cached(p: Plan, why: &str) -> Decision {
        match p {
            Plan::Local(d, DecisionSource::Cache) => d,
            other => panic!("{why}: expected a cached rejection, got {other:?}"),
        }
    }

    /// `n` requests, each spent from the lease with nothing else to do.
    fn spend_from_lease(hot: &HotKeys, s: &BucketSpec, n: usize) {
        for i in 0..n {
            let p = plan(hot, s, false);
            assert!(
                matches!(p, Plan::Local(_, DecisionSource::Lease)),
                "request {i}: {p:?}"
            );
        }
    }

    /// One request every 2.5 ms for a second: exactly 400 tokens/s.
    fn warm(hot: &HotKeys, clock: &ManualClock, s: &BucketSpec) {
        for _ in 0..400 {
            hot.plan(hot.key("k"), s, 1, true, false);
            clock.advance(Duration::from_micros(2_500));
        }
    }

    /// A grant of `tokens` leaving `remaining`, blocking for `block_ms`.
    fn grant(tokens: u32, remaining: u64, retry_after_ms: u64, block_ms: u64) -> Grant {
        Grant {
            granted: tokens,
            decision: Decision {
                allowed: tokens > 0,
                remaining,
                retry_after_ms,
            },
            block_ms,
        }
    }

    #[test]
    fn slow_keys_call_redis_for_every_request() {
        let clock = ManualClock::new(0);
        let hot = table(&clock);
        let s = spec(100, 1000);
        for _ in 0..150 {
            assert_eq!(call(plan(&hot, &s, false)), (1, 1, false));
            clock.advance(Duration::from_millis(13));
        }
    }

    #[test]
    fn batch_follows_the_observed_rate_capped_by_refill_and_maximum() {
        let clock = ManualClock::new(0);
        let hot = table(&clock);
        warm(&hot, &clock, &spec(100, 1000));
        // 400 tokens/s, refill 1000/s: 400 × 0.1 s = 40, at least half.
        assert_eq!(call(plan(&hot, &spec(100, 1000), false)), (40, 20, true));
        hot.settle("k");
        // The same rate against a 200/s refill: 200 × 0.1 s = 20.
        assert_eq!(call(plan(&hot, &spec(100, 200), false)), (20, 10, true));
        hot.settle("k");
        // Capped by lease.max_batch, and by the capacity.
        assert_eq!(hot.batch(5_000.0, &spec(100, 10_000)), 50);
        assert_eq!(hot.batch(5_000.0, &spec(8, 10_000)), 8);
        // Exact mode never leases.
        assert_eq!(call(plan(&hot, &spec(100, 1000), true)), (1, 1, false));
    }

    #[test]
    fn one_request_fetches_a_lease_while_the_others_wait_then_spend_it() {
        let clock = ManualClock::new(0);
        let hot = table(&clock);
        let s = spec(100, 1000);
        warm(&hot, &clock, &s);
        assert_eq!(call(plan(&hot, &s, false)), (40, 20, true));
        let waiter = plan(&hot, &s, false);
        assert!(matches!(waiter, Plan::Wait(_)), "{waiter:?}");
        assert_eq!(
            call(hot.plan(hot.key("k"), &s, 1, false, false)),
            (1, 1, false),
            "unless it may not wait"
        );

        hot.record(hot.key("k"), &grant(40, 40, 0, 0), 1, true);
        for left in (0..39).rev() {
            let (Plan::Local(d, DecisionSource::Lease) | Plan::Refresh { decision: d, .. }) =
                plan(&hot, &s, false)
            else {
                panic!("expected a lease spend");
            };
            assert!(d.allowed);
            assert_eq!(d.remaining, 40 + left);
        }
        // The next lease, fetched ahead, has not arrived: wait for it.
        assert!(
            matches!(plan(&hot, &s, false), Plan::Wait(_)),
            "lease used up"
        );

        hot.record(hot.key("k"), &grant(40, 40, 0, 0), 0, true);
        clock.advance(Duration::from_millis(100));
        let (want, _, owner) = call(plan(&hot, &s, false));
        assert!(owner && want >= 40, "lease expired: a new one is fetched");
    }

    #[test]
    fn the_next_lease_is_fetched_ahead_once_a_quarter_batch_is_left() {
        let clock = ManualClock::new(0);
        let hot = table(&clock);
        let s = spec(100, 1000);
        warm(&hot, &clock, &s);
        assert_eq!(call(plan(&hot, &s, false)), (40, 20, true));
        hot.record(hot.key("k"), &grant(40, 40, 0, 0), 1, true);
        // 39 leased after the fetching request; spends down to 10 stay local.
        spend_from_lease(&hot, &s, 29);
        // Under a quarter batch (10): this spend also fetches the next lease.
        let Plan::Refresh { decision, ask } = plan(&hot, &s, false) else {
            panic!("expected a refresh");
        };
        assert!(decision.allowed);
        assert_eq!(
            (ask.want, ask.min),
            (31, 20),
            "tops the 9 left up to one batch"
        );
        // Only one fetch at a time; the rest of the lease is still spent.
        spend_from_lease(&hot, &s, 9);
        assert!(
            matches!(plan(&hot, &s, false), Plan::Wait(_)),
            "lease used up"
        );
        // The background answer is all lease, and releases the key.
        hot.record(hot.key("k"), &grant(40, 0, 0, 0), 0, true);
        spend_from_lease(&hot, &s, 30);
        assert!(matches!(plan(&hot, &s, false), Plan::Refresh { .. }));
    }

    #[actix_web::test]
    async fn waiters_wake_when_the_lease_arrives() {
        let clock = ManualClock::new(0);
        let hot = table(&clock);
        let s = spec(100, 1000);
        warm(&hot, &clock, &s);
        call(plan(&hot, &s, false));
        let Plan::Wait(wait) = plan(&hot, &s, false) else {
            panic!("expected to wait");
        };
        hot.record(hot.key("k"), &grant(40, 40, 0, 0), 1, true);
        tokio::time::timeout(Duration::from_secs(1), wait)
            .await
            .expect("the waiter was woken");
    }

    #[test]
    fn a_rejection_blocks_the_key_until_its_retry_delay_passes() {
        let clock = ManualClock::new(0);
        let hot = table(&clock);
        let s = spec(10, 1);
        assert_eq!(call(plan(&hot, &s, true)), (1, 1, false));
        hot.record(hot.key("k"), &grant(0, 0, 250, 250), 1, false);
        for _ in 0..100 {
            clock.advance(Duration::from_millis(2));
            let d = cached(plan(&hot, &s, true), "while the block holds");
            assert!(!d.allowed && d.retry_after_ms <= 250);
        }
        clock.advance(Duration::from_millis(50));
        assert_eq!(
            call(plan(&hot, &s, true)),
            (1, 1, true),
            "one Redis call per retry interval"
        );
        // While that call is in flight, the others are still turned away.
        let d = cached(plan(&hot, &s, true), "while one request is in flight");
        assert_eq!(d.retry_after_ms, 250);
        // An admission that took the last token blocks until the next one.
        hot.record(hot.key("k"), &grant(1, 0, 900, 900), 1, true);
        clock.advance(Duration::from_millis(899));
        assert!(matches!(
            plan(&hot, &s, true),
            Plan::Local(_, DecisionSource::Cache)
        ));
        clock.advance(Duration::from_millis(1));
        assert_eq!(call(plan(&hot, &s, true)), (1, 1, true));
        // A failed call releases the key for the next request.
        hot.settle("k");
        assert_eq!(call(plan(&hot, &s, true)), (1, 1, true));
        // An admission with tokens to spare lifts the block.
        hot.record(hot.key("k"), &grant(1, 3, 0, 0), 1, true);
        assert_eq!(call(plan(&hot, &s, true)), (1, 1, false));
    }

    #[test]
    fn a_grant_to_a_call_without_the_slot_leaves_a_block_recorded_meanwhile() {
        let clock = ManualClock::new(0);
        let hot = table(&clock);
        let s = spec(10, 1);
        // Two requests ask Redis at once; neither holds the key's slot.
        assert_eq!(call(plan(&hot, &s, true)), (1, 1, false));
        assert_eq!(call(plan(&hot, &s, true)), (1, 1, false));
        // One is refused (a block of 250 ms), then the other's admission
        // comes back.
        hot.record(hot.key("k"), &grant(0, 0, 250, 250), 1, false);
        hot.record(hot.key("k"), &grant(1, 2, 0, 0), 1, false);
        clock.advance(Duration::from_millis(249));
        let d = cached(plan(&hot, &s, true), "the block still holds");
        assert_eq!((d.allowed, d.remaining, d.retry_after_ms), (false, 0, 1));
        // Once it has run out, one request asks Redis for the key.
        clock.advance(Duration::from_millis(1));
        assert_eq!(call(plan(&hot, &s, true)), (1, 1, true));
    }

    #[test]
    fn a_block_for_a_larger_cost_holds_a_cheaper_request_only_as_long_as_it_needs() {
        let clock = ManualClock::new(0);
        let hot = table(&clock);
        let s = spec(20, 2);
        let ask = |cost| hot.plan(hot.key("k"), &s, cost, true, true);
        assert!(matches!(ask(20), Plan::Call { .. }));
        // 20 tokens taken: full again in 10 s at 2/s; one token in 0.5 s.
        hot.record(hot.key("k"), &grant(20, 0, 10_000, 10_000), 20, false);
        let d = cached(ask(20), "the same cost waits for the whole block");
        assert_eq!(d.retry_after_ms, 10_000);
        let d = cached(ask(1), "one token is not there yet");
        assert_eq!(d.retry_after_ms, 500, "19 tokens sooner at 2/s");
        clock.advance(Duration::from_millis(500));
        assert!(
            matches!(ask(1), Plan::Call { .. }),
            "a token may exist: Redis is asked"
        );
        let d = cached(ask(20), "the larger cost is still blocked");
        assert_eq!(d.retry_after_ms, 9_500);
    }

    #[test]
    fn idle_keys_are_swept() {
        let clock = ManualClock::new(0);
        let hot = table(&clock);
        plan(&hot, &spec(10, 1), false);
        assert_eq!(hot.sweep(), 1);
        clock.advance(Duration::from_secs(2));
        assert_eq!(hot.sweep(), 0);
    }
}
