//! The shared bucket in Redis: one atomic script call per decision.
//!
//! Owns the call of `lua/token_bucket.lua` and its reply. Connections,
//! timeouts and `NOSCRIPT` handling live in [`crate::redis_client`].
//!
//! Invariant: every call is bounded by `redis.timeout_ms`.

use std::sync::LazyLock;
use std::time::Duration;

use redis::Script;

use super::decision::{BucketSpec, Decision};
use crate::clock::SharedClock;
use crate::redis_client::{RedisCallError, RedisConn};
use crate::telemetry::Metrics;

/// The token bucket script, compiled into the binary.
static TOKEN_BUCKET: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/token_bucket.lua")));

/// Client for token buckets held in Redis.
#[derive(Clone)]
pub struct RedisBucket {
    /// This worker's connection.
    conn: RedisConn,
    /// Bound on one script call.
    timeout: Duration,
    /// Round-trip histogram.
    metrics: Metrics,
    /// Source of call timings.
    clock: SharedClock,
}

impl RedisBucket {
    /// A bucket client over `conn`, each call bounded by `timeout`.
    pub fn new(conn: RedisConn, timeout: Duration, metrics: Metrics, clock: SharedClock) -> Self {
        Self {
            conn,
            timeout,
            metrics,
            clock,
        }
    }

    /// The bound on one call.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Refills `key`'s bucket and takes tokens atomically, as `ask` says.
    ///
    /// # Errors
    /// [`RedisCallError`] on timeout, connection or server failure.
    pub async fn take(
        &self,
        key: &str,
        spec: &BucketSpec,
        ask: Ask,
    ) -> Result<Grant, RedisCallError> {
        let mut invocation = TOKEN_BUCKET.key(key);
        invocation
            .arg(spec.capacity.get())
            .arg(spec.refill_per_second)
            .arg(ask.want)
            .arg(ask.min)
            .arg(ask.need);
        let started = self.clock.now_micros();
        let (allowed, remaining, retry_after_ms, granted, block_ms): (i64, i64, i64, i64, i64) =
            self.conn.invoke(&invocation, self.timeout).await?;
        let elapsed = self.clock.now_micros().saturating_sub(started);
        self.metrics.redis_call(elapsed as f64 / 1e6);
        Ok(Grant {
            granted: u32::try_from(granted).unwrap_or(0),
            decision: Decision {
                allowed: allowed == 1,
                remaining: u64::try_from(remaining).unwrap_or(0),
                retry_after_ms: u64::try_from(retry_after_ms).unwrap_or(0),
            },
            block_ms: u64::try_from(block_ms).unwrap_or(0),
        })
    }
}

/// What one script call asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ask {
    /// Most tokens to take (a request's cost, or a lease batch).
    pub want: u32,
    /// Fewest tokens worth a lease.
    pub min: u32,
    /// The request's own cost: taken alone when fewer than `min` exist.
    pub need: u32,
}

impl Ask {
    /// One request's `cost`, no lease.
    pub fn single(cost: u32) -> Self {
        Self {
            want: cost,
            min: cost,
            need: cost,
        }
    }
}

/// What one script call got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// Tokens taken (0 when the request was rejected).
    pub granted: u32,
    /// The request's decision; `retry_after_ms` is about its own cost.
    pub decision: Decision,
    /// Milliseconds until another call like this one could be granted
    /// its minimum (the over-limit cache blocks the key that long).
    pub block_ms: u64,
}
