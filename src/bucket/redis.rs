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

    /// Refills `key`'s bucket and takes between `min` and `want` tokens
    /// atomically (`want == min` for one request's cost; more for a lease).
    /// Returns the tokens granted (0 when fewer than `min` exist) and the
    /// decision.
    ///
    /// # Errors
    /// [`RedisCallError`] on timeout, connection or server failure.
    pub async fn take(
        &self,
        key: &str,
        spec: &BucketSpec,
        want: u32,
        min: u32,
    ) -> Result<(u32, Decision), RedisCallError> {
        let mut invocation = TOKEN_BUCKET.key(key);
        invocation
            .arg(spec.capacity.get())
            .arg(spec.refill_per_second)
            .arg(want)
            .arg(min);
        let started = self.clock.now_micros();
        let (granted, remaining, retry_after_ms): (i64, i64, i64) =
            self.conn.invoke(&invocation, self.timeout).await?;
        let elapsed = self.clock.now_micros().saturating_sub(started);
        self.metrics.redis_call(elapsed as f64 / 1e6);
        let granted = u32::try_from(granted).unwrap_or(0);
        Ok((
            granted,
            Decision {
                allowed: granted > 0,
                remaining: u64::try_from(remaining).unwrap_or(0),
                retry_after_ms: u64::try_from(retry_after_ms).unwrap_or(0),
            },
        ))
    }
}
