//! The shared bucket in Redis: one atomic script call per decision.
//!
//! Owns the connection to Redis (one server, or a Redis Cluster) and the
//! call of `lua/token_bucket.lua`. The script is sent by SHA (`EVALSHA`); on
//! a `NOSCRIPT` reply it is loaded and the call repeated once. A call that
//! times out is abandoned, never replayed: the caller's fallback decides.
//!
//! Invariant: every call is bounded by `redis.timeout_ms`.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{RedisResult, Script};

use super::decision::{BucketError, BucketSpec, Decision};
use crate::clock::SharedClock;
use crate::config::{RedisSettings, RedisTarget};
use crate::telemetry::Metrics;

/// The token bucket script, compiled into the binary.
static TOKEN_BUCKET: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/token_bucket.lua")));

/// Longest pause between attempts to reach a Redis Cluster at start.
const MAX_CONNECT_BACKOFF: Duration = Duration::from_secs(5);

/// A live connection of either kind; both clone cheaply.
#[derive(Clone)]
enum Conn {
    /// One server, reconnected in the background after failures.
    Single(ConnectionManager),
    /// A Redis Cluster; follows MOVED/ASK and topology changes.
    Cluster(ClusterConnection),
}

/// A parsed Redis target that hands out per-worker bucket clients.
#[derive(Clone)]
pub struct RedisConnector {
    /// Which deployment, with its client.
    target: Target,
    /// Bound on one script call.
    timeout: Duration,
    /// Bound on one connection attempt and on connection-level replies.
    connect_timeout: Duration,
}

/// The client of one deployment kind.
#[derive(Clone)]
enum Target {
    /// One server.
    Single(redis::Client),
    /// A Redis Cluster (boxed: its client is more than twice the size).
    Cluster(Box<redis::cluster::ClusterClient>),
}

impl RedisConnector {
    /// Parses `settings`; `None` in local-only mode. Connects to nothing.
    ///
    /// # Errors
    /// When a URL cannot be used (config validation already checked them).
    pub fn new(settings: &RedisSettings) -> RedisResult<Option<Self>> {
        let target = match &settings.target {
            RedisTarget::LocalOnly => return Ok(None),
            RedisTarget::Single(url) => Target::Single(redis::Client::open(url.as_str())?),
            RedisTarget::Cluster(nodes) => Target::Cluster(Box::new(
                redis::cluster::ClusterClient::builder(nodes.clone())
                    .connection_timeout(settings.connect_timeout)
                    .response_timeout(settings.connect_timeout)
                    .build()?,
            )),
        };
        Ok(Some(Self {
            target,
            timeout: settings.timeout,
            connect_timeout: settings.connect_timeout,
        }))
    }

    /// A bucket client with its own connection, driven by the runtime of
    /// the calling thread (call it on the worker that will use it).
    ///
    /// Never waits for Redis: a single server is connected on first use and
    /// reconnected in the background; a cluster is connected by a background
    /// task that retries until it succeeds. Until then calls fail fast with
    /// [`BucketError::NotConnected`].
    pub fn bucket(&self, metrics: Metrics, clock: SharedClock) -> RedisBucket {
        let conn = Arc::new(ArcSwapOption::empty());
        match &self.target {
            Target::Single(client) => {
                let config = ConnectionManagerConfig::new()
                    .set_number_of_retries(1)
                    .set_max_delay(Duration::from_millis(200))
                    .set_connection_timeout(Some(self.connect_timeout))
                    .set_response_timeout(Some(self.connect_timeout));
                // unwrap: a lazy manager only fails for push/resubscribe
                // settings, which are never set here.
                let manager = client
                    .get_connection_manager_lazy(config)
                    .expect("a lazy connection manager without push settings");
                conn.store(Some(Arc::new(Conn::Single(manager))));
            }
            Target::Cluster(client) => {
                let (client, slot) = ((**client).clone(), conn.clone());
                actix_web::rt::spawn(async move {
                    let mut backoff = Duration::from_millis(100);
                    loop {
                        match client.get_async_connection().await {
                            Ok(c) => {
                                tracing::info!("Connected to the Redis Cluster.");
                                slot.store(Some(Arc::new(Conn::Cluster(c))));
                                return;
                            }
                            Err(e) => {
                                tracing::warn!(error = %e, "Redis Cluster unreachable; retrying.");
                                tokio::time::sleep(backoff).await;
                                backoff = (backoff * 2).min(MAX_CONNECT_BACKOFF);
                            }
                        }
                    }
                });
            }
        }
        RedisBucket {
            conn,
            timeout: self.timeout,
            metrics,
            clock,
        }
    }
}

/// Client for token buckets held in Redis.
#[derive(Clone)]
pub struct RedisBucket {
    /// The connection once established; `None` while a cluster is unreachable.
    conn: Arc<ArcSwapOption<Conn>>,
    /// Bound on one script call.
    timeout: Duration,
    /// Round-trip histogram.
    metrics: Metrics,
    /// Source of call timings.
    clock: SharedClock,
}

impl RedisBucket {
    /// Refills `key`'s bucket and tries to take `cost` tokens, atomically.
    ///
    /// # Errors
    /// [`BucketError`] on timeout, connection or server failure.
    pub async fn take(
        &self,
        key: &str,
        spec: &BucketSpec,
        cost: u32,
    ) -> Result<Decision, BucketError> {
        let conn = self.conn.load_full().ok_or(BucketError::NotConnected)?;
        let mut invocation = TOKEN_BUCKET.key(key);
        invocation
            .arg(spec.capacity.get())
            .arg(spec.refill_per_second)
            .arg(cost);
        let started = self.clock.now_micros();
        let call = async {
            match &*conn {
                Conn::Single(c) => {
                    invocation
                        .invoke_async::<(i64, i64, i64)>(&mut c.clone())
                        .await
                }
                Conn::Cluster(c) => {
                    invocation
                        .invoke_async::<(i64, i64, i64)>(&mut c.clone())
                        .await
                }
            }
        };
        let (allowed, remaining, retry_after_ms) = tokio::time::timeout(self.timeout, call)
            .await
            .map_err(|_| BucketError::Timeout)?
            .map_err(BucketError::Redis)?;
        let elapsed = self.clock.now_micros().saturating_sub(started);
        self.metrics.redis_call(elapsed as f64 / 1e6);
        Ok(Decision {
            allowed: allowed == 1,
            remaining: u64::try_from(remaining).unwrap_or(0),
            retry_after_ms: u64::try_from(retry_after_ms).unwrap_or(0),
        })
    }
}
