//! The hot-path decision: Redis first, the local limiter when Redis fails.
//!
//! Owns the order in which a request's tokens are sought and the bucket in
//! force for the answer. With Redis configured, the shared bucket decides;
//! a timeout or error sends the request to the local limiter, which holds
//! 1/N of the limit (N = gateway instances), so the cluster total stays
//! about right while Redis is away. A rejection is a [`Decision`], never an
//! error; this module never fails a request.

use std::num::NonZeroU32;
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

/// The per-request limiter shared by all proxy workers.
pub struct Limiter {
    /// The shared buckets; `None` in local-only mode.
    redis: Option<RedisBucket>,
    /// Local buckets for local-only mode and fallback.
    local: LocalBuckets,
    /// Gateway instances sharing each limit (the local share is 1/N).
    instances: NonZeroU32,
    /// Whether the last Redis call failed.
    degraded: AtomicBool,
    /// Decision timings.
    clock: SharedClock,
    /// Decision, error and fallback counters.
    metrics: Metrics,
}

impl Limiter {
    /// A limiter over `redis` (or local-only when `None`).
    pub fn new(
        redis: Option<RedisBucket>,
        local: LocalBuckets,
        instances: NonZeroU32,
        clock: SharedClock,
        metrics: Metrics,
    ) -> Self {
        Self {
            redis,
            local,
            instances,
            degraded: AtomicBool::new(false),
            clock,
            metrics,
        }
    }

    /// Takes `cost` tokens from `key`'s bucket under `limit`.
    pub async fn check(&self, key: &BucketKey, limit: Limit, cost: NonZeroU32) -> Verdict {
        let started = self.clock.now_micros();
        let whole = BucketSpec::of(limit.capacity, limit.refill_per_second);
        let verdict = match &self.redis {
            Some(redis) => match redis.take(key.as_str(), &whole, cost.get()).await {
                Ok(decision) => {
                    self.set_degraded(false, None);
                    Verdict {
                        decision,
                        spec: whole,
                        source: DecisionSource::Redis,
                    }
                }
                Err(e) => {
                    self.metrics.redis_error(e.kind());
                    tracing::debug!(error = %e, "Redis call failed; deciding locally.");
                    self.set_degraded(true, Some(&e));
                    let verdict = self.local(key, &whole, cost);
                    self.metrics.fallback(verdict.decision.allowed);
                    verdict
                }
            },
            None => self.local(key, &whole, cost),
        };
        let elapsed = self.clock.now_micros().saturating_sub(started);
        self.metrics.decision(verdict.source, elapsed as f64 / 1e6);
        verdict
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
        if self.degraded.load(Ordering::Relaxed) == down {
            return;
        }
        if self.degraded.swap(down, Ordering::Relaxed) != down {
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

    /// Whether Redis is configured and answering.
    pub fn redis_state(&self) -> RedisState {
        match (&self.redis, self.degraded.load(Ordering::Relaxed)) {
            (None, _) => RedisState::Disabled,
            (Some(_), false) => RedisState::Up,
            (Some(_), true) => RedisState::Down,
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
}
