//! The hot-path decision: Redis first, the local limiter when Redis fails.
//!
//! Owns the order in which a request's tokens are sought and the bucket in
//! force for the answer. With Redis configured, the shared bucket decides;
//! a timeout or error sends the request to the local limiter, which holds
//! 1/N of the limit (N = gateway instances), so the cluster total stays
//! about right while Redis is away. A rejection is a [`Decision`], never an
//! error; this module never fails a request.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::decision::{BucketSpec, Decision};
use super::local::LocalBuckets;
use super::redis::RedisBucket;
use crate::clock::SharedClock;
use crate::key::BucketKey;
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

/// Whether Redis is in use and answering, for `/ready`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RedisState {
    /// No Redis configured: local-only limiting.
    Disabled,
    /// The last call succeeded.
    Up,
    /// The last call failed; decisions are local.
    Down,
}

impl RedisState {
    /// Lower-case name for JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Disabled => "disabled",
            Self::Up => "up",
            Self::Down => "down",
        }
    }
}

/// Limiter state shared by every proxy worker: the local buckets and
/// Redis health.
pub struct LimiterCore {
    /// Local buckets for local-only mode and fallback.
    local: LocalBuckets,
    /// Gateway instances sharing each limit (the local share is 1/N).
    instances: NonZeroU32,
    /// Whether Redis is configured at all.
    redis_configured: bool,
    /// Whether the last Redis call failed.
    degraded: AtomicBool,
    /// Decision timings.
    clock: SharedClock,
    /// Decision, error and fallback counters.
    metrics: Metrics,
}

impl LimiterCore {
    /// Shared state for limiters with (`redis_configured`) or without Redis.
    pub fn new(
        local: LocalBuckets,
        instances: NonZeroU32,
        redis_configured: bool,
        clock: SharedClock,
        metrics: Metrics,
    ) -> Self {
        Self {
            local,
            instances,
            redis_configured,
            degraded: AtomicBool::new(false),
            clock,
            metrics,
        }
    }

    /// Whether Redis is configured and answering.
    pub fn redis_state(&self) -> RedisState {
        match (self.redis_configured, self.degraded.load(Ordering::Relaxed)) {
            (false, _) => RedisState::Disabled,
            (true, false) => RedisState::Up,
            (true, true) => RedisState::Down,
        }
    }

    /// Gateway instances each limit is divided between when deciding locally.
    pub fn instances(&self) -> NonZeroU32 {
        self.instances
    }

    /// Drops refilled local buckets and reports how many remain.
    pub fn sweep_local(&self) {
        self.metrics.local_buckets(self.local.sweep());
    }

    /// Decides with the local 1/N share of `whole`.
    fn local(&self, key: &BucketKey, whole: &BucketSpec, cost: NonZeroU32) -> Verdict {
        let spec = whole.divided(self.instances);
        Verdict {
            decision: self.local.take(key.as_str(), &spec, cost.get()),
            spec,
            source: DecisionSource::Local,
        }
    }

    /// Records Redis health, logging only the transitions.
    fn set_degraded(&self, down: bool, error: Option<&super::BucketError>) {
        if self.degraded.load(Ordering::Relaxed) != down
            && self.degraded.swap(down, Ordering::Relaxed) != down
        {
            if down {
                tracing::warn!(
                    error = error.map(ToString::to_string).unwrap_or_default(),
                    instances = self.instances.get(),
                    "Redis is not answering; deciding locally at 1/N of every limit."
                );
            } else {
                tracing::info!("Redis is answering again; limits are shared cluster-wide.");
            }
        }
    }
}

/// One proxy worker's limiter: its own Redis connection (so Redis replies
/// wake the worker that asked, not another thread) over the shared core.
pub struct Limiter {
    /// This worker's Redis client; `None` in local-only mode.
    redis: Option<RedisBucket>,
    /// State shared with the other workers.
    core: Arc<LimiterCore>,
}

impl Limiter {
    /// A worker limiter over `redis` (or local-only when `None`).
    pub fn new(redis: Option<RedisBucket>, core: Arc<LimiterCore>) -> Self {
        Self { redis, core }
    }

    /// Takes `cost` tokens from `key`'s bucket under `limit`.
    pub async fn check(&self, key: &BucketKey, limit: Limit, cost: NonZeroU32) -> Verdict {
        let core = &self.core;
        let started = core.clock.now_micros();
        let whole = BucketSpec::of(limit.capacity, limit.refill_per_second);
        let verdict = match &self.redis {
            Some(redis) => match redis.take(key.as_str(), &whole, cost.get()).await {
                Ok(decision) => {
                    core.set_degraded(false, None);
                    Verdict {
                        decision,
                        spec: whole,
                        source: DecisionSource::Redis,
                    }
                }
                Err(e) => {
                    core.metrics.redis_error(e.kind());
                    tracing::debug!(error = %e, "Redis call failed; deciding locally.");
                    core.set_degraded(true, Some(&e));
                    let verdict = core.local(key, &whole, cost);
                    core.metrics.fallback(verdict.decision.allowed);
                    verdict
                }
            },
            None => core.local(key, &whole, cost),
        };
        let elapsed = core.clock.now_micros().saturating_sub(started);
        core.metrics.decision(verdict.source, elapsed as f64 / 1e6);
        verdict
    }
}
