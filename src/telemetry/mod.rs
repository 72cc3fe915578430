//! Metric names, label sets, the Prometheus recorder and log setup.
//!
//! Owns every metric name tollgate exports (`tollgate_<what>_<unit>[_total]`)
//! and every label value, all drawn from bounded sets: route ids come from
//! the config, outcomes and error kinds are fixed words, and no raw key or
//! error text ever becomes a label. The rest of the crate records through
//! the pre-registered handles in [`Metrics`] and [`RouteMetrics`], so the
//! request path only increments atomics and never builds a label set.
//!
//! The recorder is process-global: [`install`] sets it up once and returns
//! the same handle on later calls (tests run several gateways per process).

#![allow(clippy::disallowed_macros)] // The one module that names metrics.

mod labels;
mod log;
mod process;
mod requests;

use std::sync::OnceLock;

use metrics::{Counter, Gauge, Histogram, Unit};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Requests by route and outcome (counter).
pub const REQUESTS_TOTAL: &str = "tollgate_requests_total";
/// Time to reach a limiter decision, by source (histogram, seconds).
pub const DECISION_SECONDS: &str = "tollgate_decision_duration_seconds";
/// Round-trip time of bucket script calls to Redis (histogram, seconds).
pub const REDIS_CALL_SECONDS: &str = "tollgate_redis_call_duration_seconds";
/// Keys decided by one bucket script call (histogram).
pub const REDIS_CALL_KEYS: &str = "tollgate_redis_call_keys";
/// Failed Redis calls by kind (counter).
pub const REDIS_ERRORS_TOTAL: &str = "tollgate_redis_errors_total";
/// Decisions made by the local fallback limiter, by outcome (counter).
pub const FALLBACK_DECISIONS_TOTAL: &str = "tollgate_fallback_decisions_total";
/// Buckets held by the local fallback limiter (gauge).
pub const LOCAL_BUCKETS: &str = "tollgate_local_buckets";
/// Upstream response-head latency by route (histogram, seconds).
pub const UPSTREAM_SECONDS: &str = "tollgate_upstream_duration_seconds";
/// Tokens of limits on what answers cost, by route and kind (counter).
pub const USAGE_TOKENS_TOTAL: &str = "tollgate_usage_tokens_total";
/// Rule reload attempts by result (counter).
pub const RULE_RELOADS_TOTAL: &str = "tollgate_rule_reloads_total";
/// Gauge: concurrency slots this gateway holds for requests in flight.
pub const SLOTS_HELD: &str = "tollgate_slots_held";
/// Counter: slot holds whose lease ran out while their request was still
/// in flight (the gateway could not renew them in time).
pub const SLOTS_LOST_TOTAL: &str = "tollgate_slots_lost_total";
/// Explicit rules in the snapshot in force (gauge).
pub const RULES: &str = "tollgate_rules";

/// Circuit breaker state: 0 closed, 1 open, 2 half-open (gauge).
pub const BREAKER_STATE: &str = "tollgate_breaker_state";
/// Circuit breaker transitions by target state (counter).
pub const BREAKER_TRANSITIONS_TOTAL: &str = "tollgate_breaker_transitions_total";
/// Token leases taken from Redis (counter).
pub const LEASES_TOTAL: &str = "tollgate_leases_total";
/// Tokens taken from Redis in leases (counter).
pub const LEASED_TOKENS_TOTAL: &str = "tollgate_leased_tokens_total";
/// Leased tokens that expired unspent (counter).
pub const LEASE_EXPIRED_TOKENS_TOTAL: &str = "tollgate_lease_expired_tokens_total";
/// Each region's share of a limit, by scope (gauge).
pub const REGION_SHARE: &str = "tollgate_region_share";
/// Rebalancer rounds by result (counter).
pub const REBALANCE_ROUNDS_TOTAL: &str = "tollgate_rebalance_rounds_total";
/// Live gateway instances seen by the membership heartbeat (gauge).
pub const LIVE_INSTANCES: &str = "tollgate_live_instances";
/// Clients cut off for moving a body too slowly, by body (counter).
pub const CLIENT_TIMEOUTS_TOTAL: &str = "tollgate_client_timeouts_total";
/// Client mistakes the HTTP layer refused before routing (counter).
pub const MALFORMED_REQUESTS_TOTAL: &str = "tollgate_malformed_requests_total";
/// Client connections that could not be accepted (counter).
pub const ACCEPT_ERRORS_TOTAL: &str = "tollgate_accept_errors_total";

/// `tollgate_build_info{version}`: always 1 (gauge).
pub const BUILD_INFO: &str = "tollgate_build_info";
/// Resident set size in bytes (gauge).
pub const PROCESS_RESIDENT_MEMORY_BYTES: &str = "tollgate_process_resident_memory_bytes";
/// User and system CPU time since start, in seconds (a gauge that only
/// grows: the metrics crate's counters hold whole numbers, and a counter
/// of whole seconds would be too coarse; `rate()` reads it all the same).
pub const PROCESS_CPU_SECONDS: &str = "tollgate_process_cpu_seconds";
/// Open file descriptors, sockets included (gauge).
pub const PROCESS_OPEN_FDS: &str = "tollgate_process_open_fds";

/// Label value for requests that matched no route.
pub const NO_ROUTE: &str = "_none";

/// Bucket bounds for sub-millisecond to tens-of-ms decisions.
const DECISION_BUCKETS: &[f64] = &[
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1,
];
/// Bucket bounds for keys per call.
const KEYS_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];
/// Bucket bounds for upstream latency.
const UPSTREAM_BUCKETS: &[f64] = &[
    0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

pub use labels::{
    BodyDirection, BreakerState, DecisionSource, RedisErrorKind, RoundResult, Unrouted, UsageKind,
};
pub use log::{
    ACCESS_TARGET, ClientNoise, count_accept_failure, count_client_noise, init_tracing, log_filter,
};
pub use process::sample_process;
pub use requests::{Entry, OTHER_TENANTS, Outcome, RequestCounters, RouteMetrics};

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the global Prometheus recorder (once per process) and returns
/// the handle that renders `/metrics` and runs upkeep.
///
/// # Panics
/// If another metrics recorder was installed outside this function.
pub fn install() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Full(DECISION_SECONDS.into()), DECISION_BUCKETS)
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Full(REDIS_CALL_SECONDS.into()),
                        DECISION_BUCKETS,
                    )
                })
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Full(UPSTREAM_SECONDS.into()),
                        UPSTREAM_BUCKETS,
                    )
                })
                .and_then(|b| {
                    b.set_buckets_for_metric(Matcher::Full(REDIS_CALL_KEYS.into()), KEYS_BUCKETS)
                })
                // unwrap: the bucket lists above are non-empty constants.
                .expect("static histogram buckets are valid");
            // unwrap: tollgate installs no other recorder; a second install
            // attempt never happens because of the OnceLock.
            let handle = builder
                .install_recorder()
                .expect("no other metrics recorder is installed");
            describe();
            process::describe();
            handle
        })
        .clone()
}

/// Registers help text and units, required by `promtool check metrics`.
fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        REQUESTS_TOTAL,
        Unit::Count,
        "Requests by route and outcome."
    );
    describe_histogram!(
        DECISION_SECONDS,
        Unit::Seconds,
        "Time to reach a rate-limit decision, by source (redis, local, lease, cache)."
    );
    describe_histogram!(
        REDIS_CALL_SECONDS,
        Unit::Seconds,
        "Round trip of bucket script calls to Redis."
    );
    describe_histogram!(
        REDIS_CALL_KEYS,
        Unit::Count,
        "Decisions coalesced into one bucket script call."
    );
    describe_counter!(
        REDIS_ERRORS_TOTAL,
        Unit::Count,
        "Failed Redis bucket calls by kind."
    );
    describe_counter!(
        FALLBACK_DECISIONS_TOTAL,
        Unit::Count,
        "Decisions made by the local fallback limiter, by outcome."
    );
    describe_gauge!(
        LOCAL_BUCKETS,
        Unit::Count,
        "Buckets held by the local fallback limiter."
    );
    describe_histogram!(
        UPSTREAM_SECONDS,
        Unit::Seconds,
        "Upstream latency to the response head, by route."
    );
    describe_counter!(
        USAGE_TOKENS_TOTAL,
        Unit::Count,
        "Tokens reserved, charged after the fact and refunded, by route."
    );
    describe_counter!(
        RULE_RELOADS_TOTAL,
        Unit::Count,
        "Rule reload attempts by result."
    );
    describe_gauge!(
        SLOTS_HELD,
        Unit::Count,
        "Concurrency slots this gateway holds for requests in flight."
    );
    describe_counter!(
        SLOTS_LOST_TOTAL,
        Unit::Count,
        "Slot holds whose lease ran out while their request was in flight."
    );
    describe_gauge!(
        RULES,
        Unit::Count,
        "Explicit rules in the snapshot in force."
    );
    describe_counter!(LEASES_TOTAL, Unit::Count, "Token leases taken from Redis.");
    describe_counter!(
        LEASED_TOKENS_TOTAL,
        Unit::Count,
        "Tokens taken from Redis in leases."
    );
    describe_counter!(
        LEASE_EXPIRED_TOKENS_TOTAL,
        Unit::Count,
        "Leased tokens that expired unspent."
    );
    describe_counter!(
        REBALANCE_ROUNDS_TOTAL,
        Unit::Count,
        "Region rebalancer rounds by result (applied, unchanged, not_leader, prometheus_error, no_data, database_error, timeout)."
    );
    describe_gauge!(
        REGION_SHARE,
        Unit::Count,
        "Each region's share of a limit, by tenant and route scope (_all = every)."
    );
    describe_gauge!(
        BREAKER_STATE,
        Unit::Count,
        "Redis circuit breaker state: 0 closed, 1 open, 2 half-open."
    );
    describe_counter!(
        BREAKER_TRANSITIONS_TOTAL,
        Unit::Count,
        "Redis circuit breaker transitions by target state."
    );
    describe_counter!(
        CLIENT_TIMEOUTS_TOTAL,
        Unit::Count,
        "Clients cut off for sending a request body or reading a response too slowly, by body."
    );
    describe_counter!(
        MALFORMED_REQUESTS_TOTAL,
        Unit::Count,
        "Connections the HTTP layer closed over a malformed request or a broken stream."
    );
    describe_counter!(
        ACCEPT_ERRORS_TOTAL,
        Unit::Count,
        "Client connections that could not be accepted (out of file descriptors, say)."
    );
    describe_gauge!(
        LIVE_INSTANCES,
        Unit::Count,
        "Live gateway instances sharing each limit (N of the 1/N fallback)."
    );
}

/// Pre-registered series outside any route.
#[derive(Clone)]
pub struct Metrics {
    /// `tollgate_requests_total{route="_none", outcome}` for requests
    /// refused before routing, indexed like [`Unrouted::ALL`].
    unrouted: [Counter; 2],
    /// `tollgate_client_timeouts_total{body}`, indexed like
    /// [`BodyDirection::ALL`].
    client_timeouts: [Counter; 2],
    /// `tollgate_decision_duration_seconds{source}`, indexed like
    /// [`DecisionSource::ALL`].
    decisions: [Histogram; 4],
    /// `tollgate_leases_total`.
    leases: Counter,
    /// `tollgate_leased_tokens_total`.
    leased_tokens: Counter,
    /// `tollgate_lease_expired_tokens_total`.
    lease_expired_tokens: Counter,
    /// `tollgate_redis_call_duration_seconds`.
    redis_call: Histogram,
    /// `tollgate_redis_call_keys`.
    redis_call_keys: Histogram,
    /// `tollgate_redis_errors_total{kind}`, one per [`RedisErrorKind`].
    redis_errors: [Counter; 5],
    /// `tollgate_fallback_decisions_total{outcome}`: allowed, rejected.
    fallback: [Counter; 2],
    /// `tollgate_local_buckets`.
    local_buckets: Gauge,
    /// `tollgate_slots_held`.
    slots_held: Gauge,
    /// `tollgate_slots_lost_total`.
    slots_lost: Counter,
    /// `tollgate_rule_reloads_total{result}`: ok, error.
    rule_reloads: [Counter; 2],
    /// `tollgate_rules`.
    rules: Gauge,
    /// `tollgate_breaker_state`.
    breaker_state: Gauge,
    /// `tollgate_breaker_transitions_total{to}`: closed, open, half_open.
    breaker_transitions: [Counter; 3],
    /// `tollgate_live_instances`.
    live_instances: Gauge,
    /// `tollgate_rebalance_rounds_total{result}`, one per [`RoundResult`].
    rebalance_rounds: [Counter; 7],
}

impl Metrics {
    /// Registers the series (call after [`install`]).
    pub fn new() -> Self {
        Self {
            unrouted: Unrouted::ALL.map(|u| {
                metrics::counter!(
                    REQUESTS_TOTAL,
                    "route" => NO_ROUTE,
                    "tenant" => OTHER_TENANTS,
                    "outcome" => u.label()
                )
            }),
            client_timeouts: BodyDirection::ALL
                .map(|b| metrics::counter!(CLIENT_TIMEOUTS_TOTAL, "body" => b.label())),
            decisions: DecisionSource::ALL
                .map(|s| metrics::histogram!(DECISION_SECONDS, "source" => s.label())),
            leases: metrics::counter!(LEASES_TOTAL),
            leased_tokens: metrics::counter!(LEASED_TOKENS_TOTAL),
            lease_expired_tokens: metrics::counter!(LEASE_EXPIRED_TOKENS_TOTAL),
            redis_call: metrics::histogram!(REDIS_CALL_SECONDS),
            redis_call_keys: metrics::histogram!(REDIS_CALL_KEYS),
            redis_errors: RedisErrorKind::ALL
                .map(|k| metrics::counter!(REDIS_ERRORS_TOTAL, "kind" => k.label())),
            fallback: ["allowed", "rejected"]
                .map(|o| metrics::counter!(FALLBACK_DECISIONS_TOTAL, "outcome" => o)),
            local_buckets: metrics::gauge!(LOCAL_BUCKETS),
            slots_held: metrics::gauge!(SLOTS_HELD),
            slots_lost: metrics::counter!(SLOTS_LOST_TOTAL),
            rule_reloads: ["ok", "error"]
                .map(|r| metrics::counter!(RULE_RELOADS_TOTAL, "result" => r)),
            rules: metrics::gauge!(RULES),
            breaker_state: metrics::gauge!(BREAKER_STATE),
            breaker_transitions: BreakerState::ALL
                .map(|s| metrics::counter!(BREAKER_TRANSITIONS_TOTAL, "to" => s.as_str())),
            live_instances: metrics::gauge!(LIVE_INSTANCES),
            rebalance_rounds: RoundResult::ALL
                .map(|r| metrics::counter!(REBALANCE_ROUNDS_TOTAL, "result" => r.label())),
        }
    }

    /// Counts a request answered before any route was chosen.
    pub fn unrouted(&self, why: Unrouted) {
        self.unrouted[why as usize].increment(1);
    }

    /// Counts a client cut off for moving `body` too slowly.
    pub fn client_timeout(&self, body: BodyDirection) {
        self.client_timeouts[body as usize].increment(1);
    }

    /// Records how long a decision took and where it came from.
    pub fn decision(&self, source: DecisionSource, seconds: f64) {
        self.decisions[source as usize].record(seconds);
    }

    /// Records one successful Redis call's round trip.
    pub fn redis_call(&self, seconds: f64) {
        self.redis_call.record(seconds);
    }

    /// Records how many decisions one bucket script call carries.
    pub fn redis_keys_per_call(&self, keys: usize) {
        self.redis_call_keys.record(keys as f64);
    }

    /// Counts a failed Redis call, or a decision Redis refused.
    pub fn redis_error(&self, kind: RedisErrorKind) {
        self.redis_errors[kind as usize].increment(1);
    }

    /// Counts a decision made by the local fallback.
    pub fn fallback(&self, allowed: bool) {
        self.fallback[usize::from(!allowed)].increment(1);
    }

    /// Counts a request's slots taken (`true`) or given back.
    pub fn slots_held(&self, taken: bool) {
        if taken {
            self.slots_held.increment(1.0);
        } else {
            self.slots_held.decrement(1.0);
        }
    }

    /// Counts a hold found lost when it was renewed.
    pub fn slot_lost(&self) {
        self.slots_lost.increment(1);
    }

    /// Sets the number of buckets the local limiter holds.
    pub fn local_buckets(&self, n: usize) {
        self.local_buckets.set(n as f64);
    }

    /// Counts a rule reload; on success also sets the rule count.
    pub fn rule_reload(&self, loaded: Option<usize>) {
        match loaded {
            Some(n) => {
                self.rule_reloads[0].increment(1);
                self.rules.set(n as f64);
            }
            None => self.rule_reloads[1].increment(1),
        }
    }
}

impl Metrics {
    /// Sets the breaker state gauge (0 closed, 1 open, 2 half-open).
    pub fn breaker_state(&self, state: BreakerState) {
        self.breaker_state.set(f64::from(state as u8));
    }

    /// Counts a breaker transition to `to`.
    pub fn breaker_transition(&self, to: BreakerState) {
        self.breaker_transitions[to as usize].increment(1);
    }

    /// Counts a lease of `tokens` taken from Redis for later requests
    /// (beyond the cost of the request that asked).
    pub fn lease_taken(&self, tokens: u32) {
        self.leases.increment(1);
        self.leased_tokens.increment(u64::from(tokens));
    }

    /// Counts leased tokens that expired unspent.
    pub fn lease_expired(&self, tokens: u32) {
        self.lease_expired_tokens.increment(u64::from(tokens));
    }

    /// Sets `region`'s share of the scope (`None` = every tenant/route,
    /// shown as `_all`). Scopes are bounded: global, and the rows the
    /// rebalancer writes for labelled tenants.
    pub fn region_share(
        &self,
        region: &str,
        tenant: Option<&str>,
        route: Option<&str>,
        share: f64,
    ) {
        metrics::gauge!(
            REGION_SHARE,
            "region" => region.to_owned(),
            "tenant" => tenant.unwrap_or("_all").to_owned(),
            "route" => route.unwrap_or("_all").to_owned()
        )
        .set(share);
    }

    /// Counts a rebalancer round ending with `result`.
    pub fn rebalance_round(&self, result: RoundResult) {
        self.rebalance_rounds[result as usize].increment(1);
    }

    /// Sets the live instance count.
    pub fn live_instances(&self, n: u32) {
        self.live_instances.set(f64::from(n));
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
