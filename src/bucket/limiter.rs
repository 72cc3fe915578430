//! The hot-path decision: Redis first, the local limiter when Redis fails.
//!
//! Owns the order in which a request's tokens are sought, and the bucket in
//! force for the answer:
//! 1. sub-bucket: a sharded rule tries its sub-buckets from a random one
//!    ([`super::shard`]) until one admits, each through steps 2–5;
//! 2. breaker: while the breaker of the primary serving the key is open
//!    (on a Cluster, each primary has its own), the local limiter decides;
//! 3. hot keys ([`super::lease`]): the over-limit cache rejects, or a lease
//!    admits, without calling Redis (fetching the next lease in the
//!    background when this one runs low);
//! 4. Redis, bounded by its timeout: one request's tokens, or a lease batch
//!    (the store coalesces decisions into shared calls and reports each
//!    call to the breaker, see [`super::coalesce`]);
//! 5. on error or timeout: the local limiter, which
//!    holds 1/N of the limit (N = live gateway instances), so the cluster
//!    total stays about right while Redis is away.
//!
//! A request under several limits is decided by [`Limiter::check_group`]
//! (`group`); usage reported after the fact is taken by
//! [`Limiter::charge`] (`charge`).
//!
//! A rejection is a [`Decision`], never an error; this module never fails a
//! request.

use std::borrow::Borrow;
use std::num::NonZeroU32;
use std::sync::Arc;

use super::coalesce::Coalesced;
use super::decision::Ask;
use super::decision::{BucketSpec, Decision};
use super::lease::{HotKeys, Plan};
use super::local::LocalBuckets;
use super::shard;
use super::store::SharedStore;
use crate::breaker::State;
use crate::clock::SharedClock;
use crate::cluster::LiveInstances;
use crate::key::{BucketKey, RouteId, TenantId};
use crate::redis_client::{Health, Topology};
use crate::rules::Limit;
use crate::telemetry::{DecisionSource, Metrics};

/// A decision together with the bucket that made it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Verdict {
    /// Allowed or not, remaining tokens, retry delay.
    pub decision: Decision,
    /// The bucket in force (whole limit, or the local 1/N share).
    pub spec: BucketSpec,
    /// Which limiter decided.
    pub source: DecisionSource,
}

/// The verdict of a sharded rule's sub-bucket `decision` under the whole
/// limit `whole`: its remaining tokens estimated for the whole as the
/// sub-bucket's count × the `shards` in force (exact when they drain
/// evenly, which random first choices make them do).
fn sharded(
    mut decision: Decision,
    source: DecisionSource,
    shards: NonZeroU32,
    whole: BucketSpec,
) -> Verdict {
    decision.remaining =
        (decision.remaining * u64::from(shards.get())).min(u64::from(whole.capacity.get()));
    Verdict {
        decision,
        spec: whole,
        source,
    }
}

/// Whether Redis is in use and answering, for `/ready`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RedisState {
    /// No Redis configured: local-only limiting.
    Disabled,
    /// The primaries of a Cluster or Sentinel are being looked up for the
    /// first time.
    Starting,
    /// Every primary's breaker is closed: decisions are shared.
    Up,
    /// Some Cluster primaries' breakers are open or probing: their keys
    /// are decided locally, the others' shared.
    Partial,
    /// No primary's breaker is closed (or none is known yet): decisions
    /// are local.
    Down,
}

impl RedisState {
    /// Lower-case name for JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Disabled => "disabled",
            Self::Starting => "starting",
            Self::Up => "up",
            Self::Partial => "partial",
            Self::Down => "down",
        }
    }
}

/// A concurrency slot's lease when the core is not told one.
const DEFAULT_SLOT_LEASE: std::time::Duration = std::time::Duration::from_secs(10);

/// Limiter state shared by every proxy worker: the local buckets, hot-key
/// state, the breaker gate and the live instance count.
pub struct LimiterCore {
    /// Local buckets for local-only mode and fallback.
    local: LocalBuckets,
    /// Rates, leases and the over-limit cache of Redis-backed keys.
    hot: HotKeys,
    /// The last answers of groups (requests under several limits).
    answers: GroupMemory,
    /// N, the divisor of the local share.
    live: Arc<LiveInstances>,
    /// Redis's primaries, each with the breaker in front of it; `None`
    /// without Redis.
    breaker: Option<Arc<Topology>>,
    /// Decision timings.
    clock: SharedClock,
    /// Decision, error and fallback counters.
    metrics: Metrics,
    /// Holder ids and the lease of concurrency slots.
    holders: slots::Holders,
}

impl LimiterCore {
    /// Shared state; `breaker` (Redis's topology, with a breaker per
    /// primary) is `None` in local-only mode.
    pub fn new(
        local: LocalBuckets,
        hot: HotKeys,
        live: Arc<LiveInstances>,
        breaker: Option<Arc<Topology>>,
        clock: SharedClock,
        metrics: Metrics,
    ) -> Self {
        Self {
            answers: GroupMemory::new(local.max_keys(), clock.clone()),
            local,
            hot,
            live,
            breaker,
            clock,
            metrics,
            holders: slots::Holders::new(DEFAULT_SLOT_LEASE),
        }
    }

    /// The same core, its concurrency slots held `lease` unless renewed
    /// (`[limits] slot_lease_ms`; 10 s when not set).
    pub fn with_slot_lease(self, lease: std::time::Duration) -> Self {
        Self {
            holders: slots::Holders::new(lease),
            ..self
        }
    }

    /// Whether Redis is configured and in use.
    pub fn redis_state(&self) -> RedisState {
        match self.breaker.as_ref().map(|t| t.health()) {
            None => RedisState::Disabled,
            Some(Health::Unknown) => RedisState::Starting,
            Some(Health::Up) => RedisState::Up,
            Some(Health::Partial) => RedisState::Partial,
            Some(Health::Down) => RedisState::Down,
        }
    }

    /// The worst primary's breaker state (open while no primary is
    /// known); `None` without Redis.
    pub fn breaker_state(&self) -> Option<State> {
        self.breaker
            .as_ref()
            .map(|t| t.worst_state().unwrap_or(State::Open))
    }

    /// Redis's topology; `None` without Redis.
    pub fn topology(&self) -> Option<&Arc<Topology>> {
        self.breaker.as_ref()
    }

    /// Redis calls of this gateway that failed or timed out since start;
    /// `None` without Redis.
    pub fn redis_failures(&self) -> Option<u64> {
        self.breaker.as_ref().map(|t| t.total_failures())
    }

    /// Live gateway instances (N of the 1/N local share).
    pub fn instances(&self) -> NonZeroU32 {
        self.live.get()
    }

    /// Drops refilled local buckets and idle hot-key state, and reports
    /// how many local buckets remain.
    pub fn sweep_local(&self) {
        self.metrics.local_buckets(self.local.sweep());
        self.hot.sweep();
        self.answers.sweep();
    }

    /// Decides with the local 1/N share of `whole`.
    fn local(&self, key: &BucketKey, whole: &BucketSpec, cost: NonZeroU32) -> Verdict {
        let spec = whole.divided(self.live.get());
        Verdict {
            decision: self.local.take(key.as_str(), &spec, cost.get()),
            spec,
            source: DecisionSource::Local,
        }
    }

    /// A local decision standing in for Redis, counted as a fallback.
    fn fallback(&self, key: &BucketKey, whole: &BucketSpec, cost: NonZeroU32) -> Verdict {
        let verdict = self.local(key, whole, cost);
        self.metrics.fallback(verdict.decision.allowed);
        verdict
    }
}

/// One decision on one rule's bucket, as the shared path takes it.
struct Asked<'a> {
    /// Whose bucket.
    tenant: &'a TenantId,
    /// On which route.
    route: &'a RouteId,
    /// The rule's limit: its shards, whether it is exact.
    limit: Limit,
    /// This region's share of the limit.
    whole: BucketSpec,
    /// Tokens asked for.
    cost: NonZeroU32,
}

/// One proxy worker's limiter: its own connection to the shared store (so
/// Redis replies wake the worker that asked, not another thread) over the
/// shared core. A clone shares both.
#[derive(Clone)]
pub struct Limiter<S: SharedStore = Coalesced> {
    /// This worker's client of the shared store; `None` in local-only mode.
    redis: Option<S>,
    /// State shared with the other workers.
    core: Arc<LimiterCore>,
}

impl<S: SharedStore> Limiter<S> {
    /// A worker limiter over `redis` (or local-only when `None`).
    pub fn new(redis: Option<S>, core: Arc<LimiterCore>) -> Self {
        Self { redis, core }
    }

    /// Takes `cost` tokens from the bucket of `tenant` on `route` under
    /// this region's `share` of `limit`.
    pub async fn check(
        &self,
        tenant: &TenantId,
        route: &RouteId,
        limit: Limit,
        share: f64,
        cost: NonZeroU32,
    ) -> Verdict {
        let core = &self.core;
        let started = core.clock.now_micros();
        let whole = BucketSpec::of(limit.capacity, limit.refill_per_second).scaled(share);
        let verdict = match (&self.redis, &core.breaker) {
            (Some(redis), Some(_)) => {
                let asked = Asked {
                    tenant,
                    route,
                    limit,
                    whole,
                    cost,
                };
                self.shared(redis, asked).await
            }
            (Some(_), None) => core.fallback(&BucketKey::new(tenant, route), &whole, cost),
            (None, _) => core.local(&BucketKey::new(tenant, route), &whole, cost),
        };
        let elapsed = core.clock.now_micros().saturating_sub(started);
        core.metrics.decision(verdict.source, elapsed as f64 / 1e6);
        verdict
    }

    /// Steps 1–5; `whole` is this region's share of `limit`. A sharded
    /// rule tries its sub-buckets in turn from a random one until one
    /// admits the request: it is refused only when none can take it.
    async fn shared(&self, redis: &S, asked: Asked<'_>) -> Verdict {
        let Asked {
            tenant,
            route,
            limit,
            whole,
            cost,
        } = asked;
        let n = cost.get();
        // Every sub-bucket must hold at least one request's cost, or k small
        // buckets would admit more than the whole one: fewer shards then.
        let shards = NonZeroU32::new(limit.shards.get().min(whole.capacity.get() / n))
            .unwrap_or(NonZeroU32::MIN);
        let fallback = || {
            self.core
                .fallback(&BucketKey::new(tenant, route), &whole, cost)
        };
        let k = shards.get();
        if k == 1 {
            let key = BucketKey::new(tenant, route);
            return match self.take_key(redis, &key, &whole, n, limit.exact).await {
                Some((decision, source)) => Verdict {
                    decision,
                    spec: whole,
                    source,
                },
                None => fallback(),
            };
        }
        let spec = whole.divided(shards);
        let start = shard::pick(shards);
        let mut refused: Option<(Decision, DecisionSource)> = None;
        for i in 0..k {
            let key = BucketKey::shard(tenant, route, (start + i) % k);
            match self.take_key(redis, &key, &spec, n, limit.exact).await {
                None => return fallback(),
                Some((decision, source)) if decision.allowed => {
                    return sharded(decision, source, shards, whole);
                }
                // The refusal to quote is the one that passes soonest.
                Some(this) => {
                    if refused.is_none_or(|(r, _)| this.0.retry_after_ms < r.retry_after_ms) {
                        refused = Some(this);
                    }
                }
            }
        }
        // Every one of the k ≥ 2 sub-buckets refused.
        let Some((mut decision, source)) = refused else {
            return fallback();
        };
        decision.remaining = 0;
        sharded(decision, source, shards, whole)
    }

    /// Steps 2–5 for one key, holding `spec`: the decision and where it
    /// came from, or `None` when Redis gave no answer (the breaker is open,
    /// or the call failed) and the local limiter must decide.
    async fn take_key(
        &self,
        redis: &S,
        key: &BucketKey,
        spec: &BucketSpec,
        n: u32,
        exact: bool,
    ) -> Option<(Decision, DecisionSource)> {
        let core = &self.core;
        // The breaker of the primary serving the key.
        if !core
            .breaker
            .as_ref()
            .is_some_and(|t| t.allows(key.as_str()))
        {
            return None;
        }
        let hot = core.hot.key(key.as_str());
        // Wait (bounded) for another request's lease at most twice, then
        // ask Redis alone.
        let mut waits = 0;
        let (ask, owner) = loop {
            match core.hot.plan(hot, spec, n, exact, waits < 2) {
                Plan::Local(decision, source) => return Some((decision, source)),
                Plan::Refresh { decision, ask } => {
                    self.refresh(redis, key.as_str(), *spec, ask);
                    return Some((decision, DecisionSource::Lease));
                }
                Plan::Call { ask, owner } => break (ask, owner),
                Plan::Wait(lease) => {
                    waits += 1;
                    let _ = tokio::time::timeout(redis.timeout(), lease).await;
                }
            }
        };
        // Whatever happens to a call holding the key's slot (an error, or
        // the request being dropped mid-await), the slot is released.
        let mut settle = owner.then(|| SlotGuard::new(&**core, key.as_str()));
        match redis.take(key.as_str(), spec, ask).await {
            Ok(grant) => {
                core.hot.record(hot, &grant, n, owner);
                // record() released the slot; the guard must not release a
                // slot another request may hold by now.
                if let Some(guard) = settle.as_mut() {
                    guard.disarm();
                }
                let mut decision = grant.decision;
                // Tokens leased for later requests are still this key's.
                decision.remaining += u64::from(grant.granted.saturating_sub(n));
                Some((decision, DecisionSource::Redis))
            }
            Err(e) => {
                drop(settle);
                tracing::debug!(error = %e, "No answer from Redis; deciding locally.");
                None
            }
        }
    }

    /// Fetches `key`'s next lease in the background; the request that
    /// planned it holds the key's slot, released when the answer (or the
    /// failure) is recorded.
    fn refresh(&self, redis: &S, key: &str, spec: BucketSpec, ask: Ask) {
        let redis = redis.clone();
        // Released however the task ends, even dropped unfinished.
        let mut slot = SlotGuard::new(self.core.clone(), key.to_owned());
        actix_web::rt::spawn(async move {
            let (core, key): (&LimiterCore, &str) = (&slot.core, &slot.key);
            match redis.take(key, &spec, ask).await {
                Ok(grant) => {
                    // No request waits on this call: every token granted
                    // is leased. record() releases the slot.
                    core.hot.record(core.hot.key(key), &grant, 0, true);
                    slot.disarm();
                }
                Err(e) => tracing::debug!(error = %e, "A lease top-up got no answer."),
            }
        });
    }
}

/// Releases a key's in-flight slot when dropped while armed: a call that
/// fails, or a request or task dropped mid-call, never leaves the key held.
/// Borrowed on the request path, owned by a background fetch.
struct SlotGuard<C: Borrow<LimiterCore>, K: Borrow<str>> {
    /// Where the key's state lives.
    core: C,
    /// The key.
    key: K,
    /// Whether the slot is still held (no answer recorded).
    armed: bool,
}

impl<C: Borrow<LimiterCore>, K: Borrow<str>> SlotGuard<C, K> {
    /// A guard over a held slot.
    fn new(core: C, key: K) -> Self {
        Self {
            core,
            key,
            armed: true,
        }
    }

    /// The slot was released by recording an answer.
    fn disarm(&mut self) {
        self.armed = false;
    }
}

impl<C: Borrow<LimiterCore>, K: Borrow<str>> Drop for SlotGuard<C, K> {
    fn drop(&mut self) {
        if self.armed {
            self.core.borrow().hot.settle(self.key.borrow());
        }
    }
}

mod charge;
mod group;
mod memory;
mod slots;

pub use group::{GroupVerdict, LimitVerdict};
use memory::GroupMemory;
pub use slots::{SlotHold, holder_id};
#[cfg(test)]
mod tests;
