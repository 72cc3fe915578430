//! The actor that drives the breaker off the request path.
//!
//! Every [`TICK`] it drains the gate's counters into the state machine and
//! publishes the result. Probes are a bounded `SET` of a short-lived key on
//! the actor's own connection (a keyed write, so a cluster that refuses
//! keys or a server that refuses writes does not pass), one at a time:
//! - while closed, a health probe every [`HEALTH_PERIOD`], traffic or not,
//!   from the moment the gateway starts: an unreachable Redis opens the
//!   breaker within about a second, so `/ready` tells the truth without
//!   traffic;
//! - while half-open, one probe: success closes the breaker, failure
//!   re-opens it for another cool-down.

use std::sync::Arc;
use std::time::Duration;

use actix::fut::{ActorFutureExt, WrapFuture};
use actix::{Actor, AsyncContext, Context};

use super::BreakerGate;
use super::state::{Machine, State, Transition};
use crate::clock::{SharedClock, millis};
use crate::config::BreakerSettings;
use crate::redis_client::RedisConn;
use crate::telemetry::Metrics;

/// How often the state machine is advanced.
pub const TICK: Duration = Duration::from_millis(50);

/// How often a closed breaker probes Redis in the background.
pub const HEALTH_PERIOD: Duration = Duration::from_millis(500);

/// Starts the breaker actor on the current arbiter.
///
/// `probe` is a connection of its own; `probe_key` names the key the probe
/// writes (one per instance).
pub fn start(
    gate: Arc<BreakerGate>,
    settings: BreakerSettings,
    probe: RedisConn,
    probe_key: String,
    probe_timeout: Duration,
    clock: SharedClock,
    metrics: Metrics,
) {
    let machine = Machine::new(settings, clock.now_ms());
    metrics.breaker_state(State::Closed as u8);
    BreakerActor {
        gate,
        machine,
        probe,
        probe_key,
        probe_timeout,
        probing: false,
        last_health_ms: None,
        clock,
        metrics,
    }
    .start();
}

/// Owns the state machine.
struct BreakerActor {
    /// Published state and outcome counters.
    gate: Arc<BreakerGate>,
    /// Transitions.
    machine: Machine,
    /// Connection for probes.
    probe: RedisConn,
    /// Key the probe writes.
    probe_key: String,
    /// Bound on one probe.
    probe_timeout: Duration,
    /// Whether a probe is in flight.
    probing: bool,
    /// When the last health probe was sent.
    last_health_ms: Option<u64>,
    /// Time.
    clock: SharedClock,
    /// State gauge and transition counter.
    metrics: Metrics,
}

impl BreakerActor {
    fn tick(&mut self, ctx: &mut Context<Self>) {
        let seen = self.gate.drain();
        let now = self.clock.now_ms();
        if let Some(t) = self.machine.observe(seen, now) {
            self.apply(t);
        }
        if self.probing {
            return;
        }
        let health_due = self
            .last_health_ms
            .is_none_or(|last| now.saturating_sub(last) >= millis(HEALTH_PERIOD));
        match self.machine.state() {
            State::HalfOpen => self.probe(ctx, Machine::probe_result),
            State::Closed if health_due => {
                self.last_health_ms = Some(now);
                self.probe(ctx, Machine::health_result);
            }
            _ => {}
        }
    }

    /// Sends one probe and hands its result to `judge`.
    fn probe(
        &mut self,
        ctx: &mut Context<Self>,
        judge: fn(&mut Machine, bool, u64) -> Option<Transition>,
    ) {
        self.probing = true;
        let (conn, timeout) = (self.probe.clone(), self.probe_timeout);
        let mut cmd = redis::cmd("SET");
        cmd.arg(&self.probe_key).arg(1).arg("PX").arg(10_000);
        ctx.spawn(
            async move { conn.query::<()>(&cmd, timeout).await }
                .into_actor(self)
                .map(move |result, actor, _| {
                    actor.probing = false;
                    if let Err(e) = &result {
                        tracing::debug!(error = %e, "Redis probe failed.");
                    }
                    let now = actor.clock.now_ms();
                    if let Some(t) = judge(&mut actor.machine, result.is_ok(), now) {
                        actor.apply(t);
                    }
                }),
        );
    }

    /// Publishes a transition, counts and logs it.
    fn apply(&mut self, (from, to): Transition) {
        self.gate.publish(to);
        self.metrics.breaker_state(to as u8);
        self.metrics.breaker_transition(to.as_str());
        match to {
            State::Open if from == State::Closed => tracing::warn!(
                "Redis circuit breaker opened: requests are decided locally at 1/N of each limit."
            ),
            State::Open => tracing::warn!("Redis is still unavailable; the breaker stays open."),
            State::HalfOpen => tracing::warn!("Redis circuit breaker half-open: probing Redis."),
            State::Closed => tracing::warn!(
                "Redis circuit breaker closed: limits are shared cluster-wide again."
            ),
        }
    }
}

impl Actor for BreakerActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.run_interval(TICK, Self::tick);
    }
}
