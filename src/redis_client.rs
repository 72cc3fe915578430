//! Connections to Redis (one server or a Redis Cluster) and bounded calls.
//!
//! Owns how tollgate reaches Redis: [`RedisConnector`] parses the target
//! once; [`RedisConnector::connect`] hands out a [`RedisConn`] whose driver
//! runs on the calling thread's runtime (each proxy worker gets its own, so
//! a reply wakes the worker that asked). Every call is bounded by a timeout
//! and abandoned, never replayed, when it expires. Scripts are sent by SHA
//! (`EVALSHA`); a `NOSCRIPT` reply loads the script and repeats the call
//! once; a call that finds its connection dropped (not timed out) is made
//! once more on the reconnected one, within the same timeout.
//!
//! Invariant: nothing here waits for Redis to come up; calls fail fast with
//! [`RedisCallError::NotConnected`] until a connection exists.

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwapOption;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::io::tcp::TcpSettings;
use redis::{Cmd, FromRedisValue, IntoConnectionInfo, RedisResult, ScriptInvocation};

use crate::config::{RedisSettings, RedisTarget};

/// Longest pause between attempts to reach a Redis Cluster.
const MAX_CONNECT_BACKOFF: Duration = Duration::from_secs(5);

/// Why a Redis call produced no answer.
#[derive(Debug, thiserror::Error)]
pub enum RedisCallError {
    /// Redis did not answer within the timeout; the call was abandoned.
    #[error("redis call timed out")]
    Timeout,
    /// No connection exists yet (a cluster still being reached).
    #[error("not connected to redis")]
    NotConnected,
    /// Redis answered with an error or the connection failed.
    #[error("redis call failed: {0}")]
    Redis(#[source] redis::RedisError),
    /// Redis answered, but not with what the script returns.
    #[error("unexpected reply from redis")]
    BadReply,
    /// A coalesced decision got no answer (the reason kept for the logs):
    /// the call it rode, with others, failed (counted once, for the call),
    /// or it waited out the timeout, or its worker's queue was full.
    #[error("no answer from the shared redis call ({0})")]
    CallFailed(&'static str),
}

impl RedisCallError {
    /// A short, stable label for metrics (`timeout`, `connection`, `server`).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Timeout => "timeout",
            Self::NotConnected => "connection",
            Self::Redis(e) if e.is_io_error() || e.is_connection_dropped() => "connection",
            Self::Redis(_) | Self::BadReply => "server",
            Self::CallFailed(kind) => kind,
        }
    }
}

/// A live connection of either kind; both clone cheaply.
#[derive(Clone)]
enum Conn {
    /// One server, reconnected in the background after failures.
    Single(ConnectionManager),
    /// A Redis Cluster; follows MOVED/ASK and topology changes.
    Cluster(ClusterConnection),
}

/// The client of one deployment kind.
#[derive(Clone)]
enum Target {
    /// One server.
    Single(redis::Client),
    /// A Redis Cluster (boxed: its client is more than twice the size).
    Cluster(Box<redis::cluster::ClusterClient>),
}

/// Socket options of every Redis connection: `TCP_NODELAY`, so that a
/// call sent while another is in flight on the same multiplexed connection
/// leaves at once instead of waiting for the previous reply's ACK (Nagle).
fn tcp_settings() -> TcpSettings {
    TcpSettings::default().set_nodelay(true)
}

/// A parsed Redis target that hands out connections.
#[derive(Clone)]
pub struct RedisConnector {
    /// Which deployment, with its client.
    target: Target,
    /// Bound on one connection attempt and on connection-level replies.
    connect_timeout: Duration,
}

impl RedisConnector {
    /// Parses `settings`; `None` in local-only mode. Connects to nothing.
    ///
    /// # Errors
    /// When a URL cannot be used (config validation already checked them).
    pub fn new(settings: &RedisSettings) -> RedisResult<Option<Self>> {
        let target = match &settings.target {
            RedisTarget::LocalOnly => return Ok(None),
            RedisTarget::Single(url) => Target::Single(redis::Client::open(
                url.as_str()
                    .into_connection_info()?
                    .set_tcp_settings(tcp_settings()),
            )?),
            RedisTarget::Cluster(nodes) => Target::Cluster(Box::new(
                redis::cluster::ClusterClient::builder(nodes.clone())
                    .tcp_settings(tcp_settings())
                    .connection_timeout(settings.connect_timeout)
                    .response_timeout(settings.connect_timeout)
                    .build()?,
            )),
        };
        Ok(Some(Self {
            target,
            connect_timeout: settings.connect_timeout,
        }))
    }

    /// A connection driven by the runtime of the calling thread.
    ///
    /// A single server is connected on first use and reconnected in the
    /// background after failures; a cluster is connected by a background
    /// task that retries until it succeeds.
    pub fn connect(&self) -> RedisConn {
        let slot = Arc::new(ArcSwapOption::empty());
        match &self.target {
            Target::Single(client) => {
                let config = ConnectionManagerConfig::new()
                    .set_number_of_retries(1)
                    .set_max_delay(Duration::from_millis(200))
                    .set_connection_timeout(Some(self.connect_timeout))
                    // Every call is bounded by its caller's timeout
                    // already; a second timer per call would cost another
                    // timer registration, often a wake-up of the worker's
                    // event loop with it.
                    .set_response_timeout(None);
                // unwrap: a lazy manager only fails for push/resubscribe
                // settings, which are never set here.
                let manager = client
                    .get_connection_manager_lazy(config)
                    .expect("a lazy connection manager without push settings");
                slot.store(Some(Arc::new(Conn::Single(manager))));
            }
            Target::Cluster(client) => {
                let (client, slot) = ((**client).clone(), slot.clone());
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
        RedisConn { slot }
    }
}

/// One connection (shared by clones), usable for bounded calls.
#[derive(Clone)]
pub struct RedisConn {
    /// The connection once established.
    slot: Arc<ArcSwapOption<Conn>>,
}

impl RedisConn {
    /// Runs a script invocation, bounded by `timeout`.
    ///
    /// # Errors
    /// [`RedisCallError`] on timeout, connection or server failure.
    pub async fn invoke<T: FromRedisValue>(
        &self,
        invocation: &ScriptInvocation<'_>,
        timeout: Duration,
    ) -> Result<T, RedisCallError> {
        let conn = self.slot.load_full().ok_or(RedisCallError::NotConnected)?;
        let call = async {
            match &*conn {
                Conn::Single(c) => {
                    again_if_dropped(|| {
                        let mut c = c.clone();
                        async move { invocation.invoke_async(&mut c).await }
                    })
                    .await
                }
                Conn::Cluster(c) => invocation.invoke_async(&mut c.clone()).await,
            }
        };
        bounded(timeout, call).await
    }

    /// Runs one command, bounded by `timeout`.
    ///
    /// # Errors
    /// [`RedisCallError`] on timeout, connection or server failure.
    pub async fn query<T: FromRedisValue>(
        &self,
        cmd: &Cmd,
        timeout: Duration,
    ) -> Result<T, RedisCallError> {
        let conn = self.slot.load_full().ok_or(RedisCallError::NotConnected)?;
        let call = async {
            match &*conn {
                Conn::Single(c) => {
                    again_if_dropped(|| {
                        let mut c = c.clone();
                        async move { cmd.query_async(&mut c).await }
                    })
                    .await
                }
                Conn::Cluster(c) => cmd.query_async(&mut c.clone()).await,
            }
        };
        bounded(timeout, call).await
    }
}

/// Makes `call`, and once more when the first attempt found the connection
/// dropped: the connection manager reconnects on that error, so the first
/// call after an outage (or a server restart) reaches the new connection
/// instead of failing. A timed-out attempt is never repeated. A connection
/// that drops after the call was written may have run it: the repeat then
/// charges that call's tokens twice (fewer admissions, never more). The
/// caller's timeout bounds both attempts; the cluster client reconnects and
/// retries by itself.
async fn again_if_dropped<T, F: Future<Output = RedisResult<T>>>(
    call: impl Fn() -> F,
) -> RedisResult<T> {
    match call().await {
        Err(e) if e.is_connection_dropped() && !e.is_timeout() => call().await,
        other => other,
    }
}

/// Awaits `call` for at most `timeout`.
async fn bounded<T>(
    timeout: Duration,
    call: impl Future<Output = RedisResult<T>>,
) -> Result<T, RedisCallError> {
    tokio::time::timeout(timeout, call)
        .await
        .map_err(|_| RedisCallError::Timeout)?
        .map_err(RedisCallError::Redis)
}
