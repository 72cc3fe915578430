//! The actor that keeps a Cluster's or Sentinel's layout current.
//!
//! Owns when the primaries are looked up again ([`super::discover`]) and
//! the publication of what is found into the [`Topology`]. Every
//! [`TICK`] it decides whether a lookup is due: at start and until one
//! succeeds; soon after a call saw a sign of change (a lost connection, a
//! redirection, a read-only primary: [`Topology::suspect`]); often while
//! some shard's breaker is not closed (a failover may be under way); and
//! every [`PERIOD`] regardless. With Sentinel it also listens to one
//! sentinel's `+switch-master` announcements, moving to the next sentinel
//! when that connection ends, and looks up the primary at once when one
//! names its master. One lookup runs at a time, each bounded by the
//! connection timeout per node asked.

use std::sync::Arc;
use std::time::Duration;

use actix::fut::{ActorFutureExt, WrapFuture};
use actix::{Actor, AsyncContext, Context};
use futures_util::StreamExt;

use super::discover::{DiscoveryError, SentinelLookup, cluster_owners};
use super::node::{Endpoints, NodeAddr};
use super::topology::{Health, Owner, Topology};
use crate::clock::{SharedClock, millis, unix_now_seconds};

/// How often the actor decides whether a lookup is due.
pub(crate) const TICK: Duration = Duration::from_millis(100);

/// Longest time between lookups.
pub(crate) const PERIOD: Duration = Duration::from_secs(5);

/// Shortest time between lookups after a call suspected the layout.
const AFTER_SUSPICION: Duration = Duration::from_millis(100);

/// How long one sentinel's `+switch-master` subscription may stay silent
/// before the next sentinel is subscribed to instead.
const SUBSCRIPTION_IDLE: Duration = Duration::from_secs(60);

/// Time between lookups while a shard's breaker is not closed.
const WHILE_DEGRADED: Duration = Duration::from_millis(250);

/// What is watched.
pub(crate) enum Watched {
    /// A Redis Cluster, first reached through these seeds.
    Cluster {
        /// The configured seed nodes.
        seeds: Vec<NodeAddr>,
    },
    /// A primary monitored by Sentinel.
    Sentinel {
        /// The configured sentinels.
        sentinels: Vec<NodeAddr>,
        /// The name they monitor it under.
        master: String,
    },
}

/// How one kind of deployment is asked.
enum Asker {
    /// `CLUSTER SLOTS` of a known primary, else a seed.
    Cluster(Vec<NodeAddr>),
    /// Sentinel's lookup (boxed: it is large); taken out while a lookup
    /// runs.
    Sentinel(Option<Box<SentinelLookup>>),
}

/// Starts the watcher on the current arbiter.
///
/// # Errors
/// When the Sentinel client cannot be built (checked at configuration).
pub(crate) fn start(
    topology: Arc<Topology>,
    endpoints: Endpoints,
    watched: Watched,
    timeout: Duration,
    clock: SharedClock,
) -> redis::RedisResult<()> {
    let asker = match watched {
        Watched::Cluster { seeds } => Asker::Cluster(seeds),
        Watched::Sentinel { sentinels, master } => {
            let lookup = SentinelLookup::new(&endpoints, &sentinels, &master)?;
            actix_web::rt::spawn(listen_for_switches(
                endpoints.clone(),
                sentinels,
                master,
                topology.clone(),
                timeout,
            ));
            Asker::Sentinel(Some(Box::new(lookup)))
        }
    };
    Watcher {
        topology,
        endpoints,
        asker,
        timeout,
        clock,
        last_ms: None,
        failed: false,
        busy: false,
    }
    .start();
    Ok(())
}

/// Keeps one topology current.
struct Watcher {
    /// Where layouts are published.
    topology: Arc<Topology>,
    /// How nodes are reached.
    endpoints: Endpoints,
    /// How the deployment is asked.
    asker: Asker,
    /// Bound on asking one node.
    timeout: Duration,
    /// Monotonic time, for the pacing of lookups.
    clock: SharedClock,
    /// When the last lookup started; `None` before the first.
    last_ms: Option<u64>,
    /// Whether the last lookup failed (to log changes only).
    failed: bool,
    /// Whether a lookup is running.
    busy: bool,
}

impl Watcher {
    /// Starts a lookup when one is due and none runs.
    fn tick(&mut self, ctx: &mut Context<Self>) {
        if self.busy {
            return;
        }
        let now = self.clock.now_ms();
        let since = self
            .last_ms
            .map_or(u64::MAX, |last| now.saturating_sub(last));
        let suspected = self.topology.take_suspicion();
        let due = since >= millis(PERIOD)
            || (suspected && since >= millis(AFTER_SUSPICION))
            || (self.topology.health() != Health::Up && since >= millis(WHILE_DEGRADED));
        if !due {
            if suspected {
                // Not yet: keep the hint for a later tick.
                self.topology.suspect();
            }
            return;
        }
        self.last_ms = Some(now);
        self.busy = true;
        let timeout = self.timeout;
        let lookup: std::pin::Pin<Box<dyn Future<Output = _>>> = match &mut self.asker {
            Asker::Cluster(seeds) => {
                // Known primaries whose breaker is closed first, then the
                // others, then the seeds.
                let layout = self.topology.layout();
                let mut candidates: Vec<NodeAddr> = layout
                    .shards
                    .iter()
                    .filter(|s| s.gate.allows())
                    .chain(layout.shards.iter().filter(|s| !s.gate.allows()))
                    .map(|s| s.addr.clone())
                    .collect();
                for seed in seeds.iter() {
                    if !candidates.contains(seed) {
                        candidates.push(seed.clone());
                    }
                }
                let endpoints = self.endpoints.clone();
                Box::pin(
                    async move { (cluster_owners(&endpoints, &candidates, timeout).await, None) },
                )
            }
            Asker::Sentinel(slot) => {
                let Some(mut lookup) = slot.take() else {
                    self.busy = false;
                    return;
                };
                Box::pin(async move {
                    let found = lookup.primary(timeout).await.map(|addr| {
                        vec![Owner {
                            addr,
                            ranges: Vec::new(),
                        }]
                    });
                    (found, Some(lookup))
                })
            }
        };
        ctx.spawn(lookup.into_actor(self).map(|(found, lookup), watcher, _| {
            watcher.busy = false;
            if let Some(lookup) = lookup {
                watcher.asker = Asker::Sentinel(Some(lookup));
            }
            watcher.found(found);
        }));
    }

    /// Publishes what a lookup found, and logs changes.
    fn found(&mut self, found: Result<Vec<Owner>, DiscoveryError>) {
        let mode = self.topology.mode().as_str();
        match found {
            Ok(owners) => {
                let before = self.topology.failovers();
                if self.topology.publish(&owners, unix_now_seconds()) {
                    let primaries: Vec<String> =
                        owners.iter().map(|o| o.addr.to_string()).collect();
                    if self.topology.failovers() > before {
                        tracing::warn!(
                            mode,
                            primaries = %primaries.join(","),
                            "Followed a Redis failover: decisions go to the new primary."
                        );
                    } else {
                        tracing::info!(mode, primaries = %primaries.join(","), "Redis primaries found.");
                    }
                }
                self.failed = false;
            }
            Err(e) => {
                self.topology.looked_up();
                if !self.failed {
                    tracing::warn!(mode, error = %e, "Cannot look up the Redis primaries; retrying.");
                }
                self.failed = true;
            }
        }
    }
}

impl Actor for Watcher {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.run_interval(TICK, Self::tick);
    }
}

/// Listens to `+switch-master` on one sentinel after another, and
/// suspects the layout whenever one names `master` (the watcher then
/// looks the primary up at once). Runs for the life of the gateway.
async fn listen_for_switches(
    endpoints: Endpoints,
    sentinels: Vec<NodeAddr>,
    master: String,
    topology: Arc<Topology>,
    timeout: Duration,
) {
    let mut backoff = Duration::from_millis(100);
    for addr in sentinels.iter().cycle() {
        let subscribed = async {
            let client = endpoints.sentinel_client(addr)?;
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe("+switch-master").await?;
            Ok::<_, redis::RedisError>(pubsub)
        };
        let pubsub = match tokio::time::timeout(timeout, subscribed).await {
            Ok(Ok(pubsub)) => pubsub,
            Ok(Err(e)) => {
                tracing::debug!(sentinel = %addr, error = %e, "Cannot subscribe to +switch-master.");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(PERIOD);
                continue;
            }
            Err(_) => {
                tracing::debug!(sentinel = %addr, "Subscribing to +switch-master timed out.");
                continue;
            }
        };
        backoff = Duration::from_millis(100);
        // A sentinel that joins after missing a switch: look up at once.
        topology.suspect();
        let mut messages = pubsub.into_on_message();
        // A sentinel that froze keeps the connection open and silent: move
        // on to the next one after a while without a message (polling
        // finds a new primary meanwhile).
        while let Ok(Some(message)) = tokio::time::timeout(SUBSCRIPTION_IDLE, messages.next()).await
        {
            let payload: String = message.get_payload().unwrap_or_default();
            if payload.split(' ').next() == Some(master.as_str()) {
                tracing::info!(sentinel = %addr, "Sentinel announced a new primary.");
                topology.suspect();
            }
        }
        tracing::debug!(sentinel = %addr, "The +switch-master subscription ended or went idle.");
    }
}
