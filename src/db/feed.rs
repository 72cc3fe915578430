//! Following a PostgreSQL `NOTIFY` channel on behalf of an actor.
//!
//! Owns the listener connection: it subscribes, hands each payload to the
//! actor as [`Notified`], and sends [`Resync`] every time it (re)subscribes,
//! because notifications sent while it was away are lost (sqlx's
//! `PgListener` reconnects silently). A lost connection is re-subscribed
//! with backoff; a quiet one is probed with `SELECT 1`, so a connection
//! that died without a reset (a network partition) is noticed too. [`Feed::stop`] ends it inside the runtime, so no connection
//! outlives it.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use actix::dev::ToEnvelope;
use actix::{Actor, Addr, Handler, Message};
use sqlx::postgres::PgListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::DbError;

/// First and longest pause between attempts to re-subscribe.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(5));

/// Silence after which the listener connection is probed.
const PROBE_AFTER: Duration = Duration::from_secs(10);

/// Bound on the probe's answer before the connection counts as dead.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// The feed (re)subscribed: reload everything, since changes made while it
/// was away were not announced.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Resync;

/// One notification's payload.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Notified(pub String);

/// A running feed.
#[derive(Clone)]
pub struct Feed {
    /// Tells the task to stop.
    stop: Arc<watch::Sender<bool>>,
    /// The task, until stopped.
    task: Arc<Mutex<Option<JoinHandle<()>>>>,
}

impl Feed {
    /// Follows `channel` at `url` for `actor`, on the current arbiter.
    pub fn start<A>(url: String, channel: &'static str, actor: Addr<A>) -> Self
    where
        A: Actor + Handler<Resync> + Handler<Notified>,
        A::Context: ToEnvelope<A, Resync> + ToEnvelope<A, Notified>,
    {
        let (stop, stopped) = watch::channel(false);
        let task = actix::spawn(follow(url, channel, actor, stopped));
        Self {
            stop: Arc::new(stop),
            task: Arc::new(Mutex::new(Some(task))),
        }
    }

    /// Stops following and waits until the listener is closed.
    pub async fn stop(&self) {
        let _ = self.stop.send(true);
        let task = self
            .task
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(task) = task {
            let _ = task.await;
        }
    }
}

/// The feed's loop, until `stop` says so or the actor is gone.
async fn follow<A>(
    url: String,
    channel: &'static str,
    actor: Addr<A>,
    mut stop: watch::Receiver<bool>,
) where
    A: Actor + Handler<Resync> + Handler<Notified>,
    A::Context: ToEnvelope<A, Resync> + ToEnvelope<A, Notified>,
{
    let (min, max) = BACKOFF;
    let mut backoff = min;
    let mut announced_down = false;
    loop {
        let subscribed = tokio::select! {
            _ = stop.changed() => return,
            s = subscribe(&url, channel) => s,
        };
        match subscribed {
            Ok(mut listener) => {
                backoff = min;
                announced_down = false;
                let sent = tokio::select! {
                    _ = stop.changed() => return,
                    sent = actor.send(Resync) => sent,
                };
                if sent.is_err() {
                    return;
                }
                loop {
                    // try_recv is cancel-safe: a timeout loses no message.
                    let received = tokio::select! {
                        _ = stop.changed() => return,
                        r = tokio::time::timeout(PROBE_AFTER, listener.try_recv()) => r,
                    };
                    let Ok(received) = received else {
                        if alive(&mut listener).await {
                            continue;
                        }
                        tracing::warn!(
                            channel,
                            "The PostgreSQL change feed stopped answering; re-subscribing."
                        );
                        break;
                    };
                    match received {
                        Ok(Some(note)) => {
                            let sent = tokio::select! {
                                _ = stop.changed() => return,
                                sent = actor.send(Notified(note.payload().to_owned())) => sent,
                            };
                            if sent.is_err() {
                                return;
                            }
                        }
                        Ok(None) => {
                            tracing::warn!(
                                channel,
                                "Lost the PostgreSQL change feed; re-subscribing."
                            );
                            break;
                        }
                        Err(e) => {
                            tracing::warn!(channel, error = %e, "PostgreSQL change feed failed; re-subscribing.");
                            break;
                        }
                    }
                }
            }
            Err(e) => {
                if !announced_down {
                    tracing::warn!(
                        channel,
                        error = %DbError::from(e),
                        "Cannot follow changes: the rules database cannot be reached; retrying."
                    );
                    announced_down = true;
                }
            }
        }
        if !actor.connected() {
            return;
        }
        tokio::select! {
            _ = stop.changed() => return,
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(max);
    }
}

/// Whether the listener's connection answers a query in time.
async fn alive(listener: &mut PgListener) -> bool {
    let probe = sqlx::query("SELECT 1").execute(&mut *listener);
    matches!(tokio::time::timeout(PROBE_TIMEOUT, probe).await, Ok(Ok(_)))
}

/// A listener subscribed to `channel`.
async fn subscribe(url: &str, channel: &str) -> Result<PgListener, sqlx::Error> {
    let mut listener = PgListener::connect(url).await?;
    // A lost connection ends `try_recv` at once with `Ok(None)`, so the
    // loop re-subscribes and resynchronises instead of the listener
    // reconnecting by itself (possibly inside a probe) unannounced.
    listener.eager_reconnect(false);
    listener.listen(channel).await?;
    Ok(listener)
}
