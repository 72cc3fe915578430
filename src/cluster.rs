//! Gateway membership: how many instances share each limit.
//!
//! Owns N, the divisor of the local fallback limiter (each instance holds
//! 1/N of every limit while Redis is away). Every `instance.heartbeat_ms`
//! the membership actor runs `lua/heartbeat.lua`, which records this
//! instance in a sorted set in Redis (scored by Redis's clock), drops
//! instances silent for three heartbeats, and returns the count. The count
//! is published in an atomic that the request path reads.
//!
//! Invariants: N ≥ 1; before the first reading N is
//! `instance.expected_count`; while Redis is unreachable the last reading
//! stays. On shutdown the instance removes itself, so N drops at once.

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use actix::fut::{ActorFutureExt, WrapFuture};
use actix::{
    Actor, ActorContext, Addr, AsyncContext, Context, Handler, Message, ResponseActFuture,
    SpawnHandle,
};
use redis::Script;

use crate::clock::millis;
use crate::redis_client::{RedisConn, Route, evalsha};
use crate::telemetry::Metrics;

/// The heartbeat script, compiled into the binary.
static HEARTBEAT: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/heartbeat.lua")));

/// Heartbeats an instance may miss before it stops counting.
const MISSED_HEARTBEATS: u32 = 3;

/// The live instance count the request path reads.
#[derive(Debug)]
pub struct LiveInstances(AtomicU32);

impl LiveInstances {
    /// A count starting at `n`.
    pub fn new(n: NonZeroU32) -> Self {
        Self(AtomicU32::new(n.get()))
    }

    /// The current count (at least 1).
    pub fn get(&self) -> NonZeroU32 {
        NonZeroU32::new(self.0.load(Ordering::Relaxed)).unwrap_or(NonZeroU32::MIN)
    }

    fn set(&self, n: NonZeroU32) -> bool {
        self.0.swap(n.get(), Ordering::Relaxed) != n.get()
    }
}

/// The running membership heartbeat.
pub struct Membership {
    /// The actor; `None` without Redis.
    actor: Option<Addr<Heartbeat>>,
}

impl Membership {
    /// Starts heartbeating on `conn` (or nothing in local-only mode) and
    /// publishes counts into `live`.
    pub fn start(
        conn: Option<RedisConn>,
        live: Arc<LiveInstances>,
        instance: &str,
        region: Option<&str>,
        interval: Duration,
        timeout: Duration,
        metrics: Metrics,
    ) -> Self {
        metrics.live_instances(live.get().get());
        let actor = conn.map(|conn| {
            Heartbeat {
                conn,
                key: format!("tollgate:{{instances}}:{}", region.unwrap_or("global")),
                id: instance.to_owned(),
                ttl: interval * MISSED_HEARTBEATS,
                interval,
                timeout,
                live,
                metrics,
                reachable: true,
                beating: None,
            }
            .start()
        });
        Self { actor }
    }

    /// Removes this instance from the live set (bounded), then stops.
    pub async fn leave(&self) {
        if let Some(actor) = &self.actor {
            let _ = tokio::time::timeout(Duration::from_secs(1), actor.send(Leave)).await;
        }
    }
}

/// The heartbeat actor.
struct Heartbeat {
    /// Its own Redis connection.
    conn: RedisConn,
    /// The sorted set of live instances.
    key: String,
    /// This instance's member name.
    id: String,
    /// Silence after which an instance no longer counts.
    ttl: Duration,
    /// Heartbeat period.
    interval: Duration,
    /// Bound on one heartbeat.
    timeout: Duration,
    /// Where the count is published.
    live: Arc<LiveInstances>,
    /// The live instance gauge.
    metrics: Metrics,
    /// Whether the last heartbeat reached Redis (to log changes only).
    reachable: bool,
    /// The heartbeat schedule, cancelled on leaving.
    beating: Option<SpawnHandle>,
}

impl Heartbeat {
    fn beat(&mut self, ctx: &mut Context<Self>) {
        let mut eval = evalsha(&HEARTBEAT, 1, 2);
        eval.arg(&self.key).arg(&self.id).arg(millis(self.ttl));
        let (conn, timeout, key) = (self.conn.clone(), self.timeout, self.key.clone());
        ctx.spawn(
            async move {
                conn.invoke::<u32>(Route::Key(&key), &HEARTBEAT, &eval, timeout)
                    .await
            }
            .into_actor(self)
            .map(|result, beat, _| match result {
                Ok(n) => {
                    let n = NonZeroU32::new(n).unwrap_or(NonZeroU32::MIN);
                    if beat.live.set(n) {
                        tracing::info!(live = n.get(), "Live gateway instances changed.");
                    }
                    beat.metrics.live_instances(n.get());
                    beat.reachable = true;
                }
                Err(e) => {
                    if beat.reachable {
                        tracing::warn!(
                            error = %e,
                            live = beat.live.get().get(),
                            "Membership heartbeat failed; keeping the last instance count."
                        );
                    }
                    beat.reachable = false;
                }
            }),
        );
    }
}

impl Actor for Heartbeat {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        self.beat(ctx);
        self.beating = Some(ctx.run_interval(self.interval, Self::beat));
    }
}

/// Leave the live set and stop.
#[derive(Message)]
#[rtype(result = "()")]
struct Leave;

impl Handler<Leave> for Heartbeat {
    type Result = ResponseActFuture<Self, ()>;

    fn handle(&mut self, _: Leave, ctx: &mut Context<Self>) -> Self::Result {
        // No heartbeat may re-add this instance after it left.
        if let Some(beating) = self.beating.take() {
            ctx.cancel_future(beating);
        }
        let mut cmd = redis::cmd("ZREM");
        cmd.arg(&self.key).arg(&self.id);
        let (conn, timeout, key) = (self.conn.clone(), self.timeout, self.key.clone());
        Box::pin(
            async move { conn.query::<()>(Route::Key(&key), &cmd, timeout).await }
                .into_actor(self)
                .map(|_, _, ctx| ctx.stop()),
        )
    }
}
