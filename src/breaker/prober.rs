//! The actor that drives the breakers off the request path.
//!
//! One state machine per shard of the Redis topology (the single server,
//! the primary Sentinel names, or each Cluster primary), so a node that
//! fails opens only its own breaker. Every [`TICK`] the actor follows the
//! current layout (a primary new to it starts closed, one gone from it
//! is forgotten), drains each gate's counters into its machine and
//! publishes the result. Probes are a bounded `SET` of a short-lived key
//! whose slot the shard serves, sent to that shard on the actor's own
//! connection (a keyed write, so a server that refuses keys or writes
//! does not pass), one at a time per shard:
//! - while closed, a health probe every [`HEALTH_PERIOD`], traffic or not,
//!   from the moment the gateway starts: an unreachable Redis opens the
//!   breaker within about a second, so `/ready` tells the truth without
//!   traffic;
//! - while half-open, one probe: success closes the breaker, failure
//!   re-opens it for another cool-down.
//!
//! A failed probe also marks the layout suspect, so a failover is looked
//! for at once.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use actix::fut::{ActorFutureExt, WrapFuture};
use actix::{Actor, AsyncContext, Context};

use super::BreakerGate;
use super::state::{Machine, State, Transition};
use crate::clock::{SharedClock, millis};
use crate::config::BreakerSettings;
use crate::redis_client::{Mode, NodeAddr, RedisConn, Route, Topology};
use crate::telemetry::Metrics;

/// How often the state machines are advanced.
pub const TICK: Duration = Duration::from_millis(50);

/// How often a closed breaker probes its shard in the background.
pub const HEALTH_PERIOD: Duration = Duration::from_millis(500);

/// Starts the breaker actor on the current arbiter.
///
/// `probe` is a connection of its own; `instance` names the keys probes
/// write (one per instance and shard).
pub fn start(
    topology: Arc<Topology>,
    settings: BreakerSettings,
    probe: RedisConn,
    instance: String,
    probe_timeout: Duration,
    clock: SharedClock,
    metrics: Metrics,
) {
    metrics.breaker_state(State::Closed);
    BreakerActor {
        topology,
        settings,
        shards: HashMap::new(),
        probe,
        instance,
        probe_timeout,
        clock,
        metrics,
        worst: State::Closed,
    }
    .start();
}

/// One shard's breaker.
struct ShardBreaker {
    /// What the request path reads and reports to.
    gate: Arc<BreakerGate>,
    /// Transitions.
    machine: Machine,
    /// The key the probe writes (its slot served by this shard).
    probe_key: String,
    /// Whether a probe is in flight.
    probing: bool,
    /// When the last health probe was sent.
    last_health_ms: Option<u64>,
}

/// Owns the state machines.
struct BreakerActor {
    /// The shards, with their gates.
    topology: Arc<Topology>,
    /// Thresholds and durations of every machine.
    settings: BreakerSettings,
    /// Each known primary's breaker.
    shards: HashMap<NodeAddr, ShardBreaker>,
    /// Connection for probes.
    probe: RedisConn,
    /// This instance's id, in probe keys.
    instance: String,
    /// Bound on one probe.
    probe_timeout: Duration,
    /// Time.
    clock: SharedClock,
    /// State gauge and transition counter.
    metrics: Metrics,
    /// The worst state published to the gauge.
    worst: State,
}

impl BreakerActor {
    fn tick(&mut self, ctx: &mut Context<Self>) {
        let layout = self.topology.layout();
        let now = self.clock.now_ms();
        self.shards
            .retain(|addr, _| layout.shard_at(addr).is_some());
        let mut due = Vec::new();
        for shard in &layout.shards {
            let fresh = || ShardBreaker {
                gate: shard.gate.clone(),
                machine: Machine::new(self.settings, now),
                probe_key: format!("tollgate:{}:{}", shard.probe_tag, self.instance),
                probing: false,
                last_health_ms: None,
            };
            let breaker = self.shards.entry(shard.addr.clone()).or_insert_with(fresh);
            if !Arc::ptr_eq(&breaker.gate, &shard.gate) {
                // The primary left the layout and came back with a new gate.
                *breaker = fresh();
            } else if !breaker.probe_key.contains(&shard.probe_tag) {
                // Its slots changed: probe a key it serves now.
                breaker.probe_key = fresh().probe_key;
            }
            let seen = breaker.gate.drain();
            let transition = breaker.machine.observe(seen, now);
            if let Some(t) = transition {
                self.apply(&shard.addr, t);
            }
            // unwrap: inserted above.
            let breaker = self.shards.get_mut(&shard.addr).expect("just inserted");
            if breaker.probing {
                continue;
            }
            let health_due = breaker
                .last_health_ms
                .is_none_or(|last| now.saturating_sub(last) >= millis(HEALTH_PERIOD));
            match breaker.machine.state() {
                State::HalfOpen => due.push((shard.addr.clone(), Machine::probe_result as Judge)),
                State::Closed if health_due => {
                    breaker.last_health_ms = Some(now);
                    due.push((shard.addr.clone(), Machine::health_result as Judge));
                }
                _ => {}
            }
        }
        for (addr, judge) in due {
            self.probe(ctx, addr, judge);
        }
        self.publish_worst();
    }

    /// Sends one probe to the shard at `addr` and hands its result to
    /// `judge`.
    fn probe(&mut self, ctx: &mut Context<Self>, addr: NodeAddr, judge: Judge) {
        let Some(breaker) = self.shards.get_mut(&addr) else {
            return;
        };
        breaker.probing = true;
        let (conn, timeout) = (self.probe.clone(), self.probe_timeout);
        let mut cmd = redis::cmd("SET");
        cmd.arg(&breaker.probe_key).arg(1).arg("PX").arg(10_000);
        ctx.spawn(
            async move {
                let result = conn.query::<()>(Route::Node(&addr), &cmd, timeout).await;
                (addr, result)
            }
            .into_actor(self)
            .map(move |(addr, result), actor, _| {
                if let Err(e) = &result {
                    tracing::debug!(node = %addr, error = %e, "Redis probe failed.");
                    actor.topology.suspect();
                }
                let now = actor.clock.now_ms();
                let Some(breaker) = actor.shards.get_mut(&addr) else {
                    return;
                };
                breaker.probing = false;
                if let Some(t) = judge(&mut breaker.machine, result.is_ok(), now) {
                    actor.apply(&addr, t);
                    actor.publish_worst();
                }
            }),
        );
    }

    /// Publishes a shard's transition, counts and logs it.
    fn apply(&mut self, addr: &NodeAddr, (from, to): Transition) {
        if let Some(breaker) = self.shards.get(addr) {
            breaker.gate.publish(to);
        }
        self.metrics.breaker_transition(to);
        let node = addr.to_string();
        let cluster = self.topology.mode() == Mode::Cluster;
        match to {
            State::Open if from == State::Closed && cluster => tracing::warn!(
                node,
                "Redis circuit breaker opened for one Cluster node: its slots are decided locally at 1/N of each limit."
            ),
            State::Open if from == State::Closed => tracing::warn!(
                node,
                "Redis circuit breaker opened: requests are decided locally at 1/N of each limit."
            ),
            State::Open => {
                tracing::warn!(node, "Redis is still unavailable; the breaker stays open.")
            }
            State::HalfOpen => {
                tracing::warn!(node, "Redis circuit breaker half-open: probing Redis.")
            }
            State::Closed => tracing::warn!(
                node,
                "Redis circuit breaker closed: limits are shared cluster-wide again."
            ),
        }
    }

    /// Sets the state gauge to the worst shard's state (open when no
    /// shard is known), when it changed.
    fn publish_worst(&mut self) {
        let worst = self.topology.worst_state().unwrap_or(State::Open);
        if worst != self.worst {
            self.worst = worst;
            self.metrics.breaker_state(worst);
        }
    }
}

/// How a probe's result moves a machine.
type Judge = fn(&mut Machine, bool, u64) -> Option<Transition>;

impl Actor for BreakerActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.run_interval(TICK, Self::tick);
    }
}
