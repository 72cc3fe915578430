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

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use arc_swap::ArcSwap;

use metrics::{Counter, Gauge, Histogram, Unit};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Requests by route and outcome (counter).
pub const REQUESTS_TOTAL: &str = "tollgate_requests_total";
/// Time to reach a limiter decision, by source (histogram, seconds).
pub const DECISION_SECONDS: &str = "tollgate_decision_duration_seconds";
/// Round-trip time of bucket script calls to Redis (histogram, seconds).
pub const REDIS_CALL_SECONDS: &str = "tollgate_redis_call_duration_seconds";
/// Failed Redis calls by kind (counter).
pub const REDIS_ERRORS_TOTAL: &str = "tollgate_redis_errors_total";
/// Decisions made by the local fallback limiter, by outcome (counter).
pub const FALLBACK_DECISIONS_TOTAL: &str = "tollgate_fallback_decisions_total";
/// Buckets held by the local fallback limiter (gauge).
pub const LOCAL_BUCKETS: &str = "tollgate_local_buckets";
/// Upstream response-head latency by route (histogram, seconds).
pub const UPSTREAM_SECONDS: &str = "tollgate_upstream_duration_seconds";
/// Rule reload attempts by result (counter).
pub const RULE_RELOADS_TOTAL: &str = "tollgate_rule_reloads_total";
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

/// Label value for requests that matched no route.
pub const NO_ROUTE: &str = "_none";

/// Bucket bounds for sub-millisecond to tens-of-ms decisions.
const DECISION_BUCKETS: &[f64] = &[
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1,
];
/// Bucket bounds for upstream latency.
const UPSTREAM_BUCKETS: &[f64] = &[
    0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

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
                // unwrap: the bucket lists above are non-empty constants.
                .expect("static histogram buckets are valid");
            // unwrap: tollgate installs no other recorder; a second install
            // attempt never happens because of the OnceLock.
            let handle = builder
                .install_recorder()
                .expect("no other metrics recorder is installed");
            describe();
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
        RULE_RELOADS_TOTAL,
        Unit::Count,
        "Rule reload attempts by result."
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
    describe_gauge!(
        LIVE_INSTANCES,
        Unit::Count,
        "Live gateway instances sharing each limit (N of the 1/N fallback)."
    );
}

/// What happened to one proxied request, as a metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Admitted and answered by the upstream.
    Allowed,
    /// Over the limit: 429.
    Rejected,
    /// No `X-Api-Key`: 401.
    Unauthorized,
    /// Malformed `X-Api-Key`: 400.
    BadKey,
    /// Upstream refused or broke the connection: 502.
    UpstreamError,
    /// Upstream too slow: 504.
    UpstreamTimeout,
}

impl Outcome {
    /// Every outcome, in label order.
    const ALL: [Self; 6] = [
        Self::Allowed,
        Self::Rejected,
        Self::Unauthorized,
        Self::BadKey,
        Self::UpstreamError,
        Self::UpstreamTimeout,
    ];

    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            Self::Allowed => "allowed",
            Self::Rejected => "rejected",
            Self::Unauthorized => "unauthorized",
            Self::BadKey => "bad_key",
            Self::UpstreamError => "upstream_error",
            Self::UpstreamTimeout => "upstream_timeout",
        }
    }
}

/// Pre-registered series of one route.
#[derive(Clone)]
pub struct RouteMetrics {
    /// `tollgate_upstream_duration_seconds{route}`.
    upstream: Histogram,
}

impl RouteMetrics {
    /// Registers the series of `route`.
    pub fn new(route: &str) -> Self {
        Self {
            upstream: metrics::histogram!(UPSTREAM_SECONDS, "route" => route.to_owned()),
        }
    }

    /// Records the time to an upstream's response head.
    pub fn upstream_seconds(&self, seconds: f64) {
        self.upstream.record(seconds);
    }
}

/// `tollgate_requests_total{route, tenant, outcome}` with a bounded tenant
/// label: tenants that have an explicit rule get their own label, up to
/// `metrics.max_tenant_labels`; every other request counts under
/// `tenant="_other"`. The rebalancer reads per-tenant demand from these.
pub struct RequestCounters {
    /// Route ids, by route index.
    routes: Vec<String>,
    /// `tenant="_other"` counters, by route index then outcome.
    other: Vec<[Counter; 6]>,
    /// Labelled tenants' counters, by route index then outcome.
    labeled: ArcSwap<HashMap<Arc<str>, Vec<[Counter; 6]>>>,
    /// Most tenants with their own label.
    max_tenants: usize,
}

/// Label value for tenants without a label of their own.
pub const OTHER_TENANTS: &str = "_other";

impl RequestCounters {
    /// Registers the `_other` series of every route.
    pub fn new<'a>(routes: impl IntoIterator<Item = &'a str>, max_tenants: usize) -> Self {
        let routes: Vec<String> = routes.into_iter().map(str::to_owned).collect();
        let other = routes.iter().map(|r| register(r, OTHER_TENANTS)).collect();
        Self {
            routes,
            other,
            labeled: ArcSwap::from_pointee(HashMap::new()),
            max_tenants,
        }
    }

    /// Counts one request of `tenant` (when known) on route `route`.
    pub fn count(&self, tenant: Option<&str>, route: usize, outcome: Outcome) {
        let labeled = self.labeled.load();
        let counters = tenant
            .and_then(|t| labeled.get(t))
            .and_then(|per_route| per_route.get(route))
            .or_else(|| self.other.get(route));
        if let Some(c) = counters {
            c[outcome as usize].increment(1);
        }
    }

    /// Gives the first `metrics.max_tenant_labels` of `tenants` (in sorted
    /// order) a label of their own; the rest count as `_other`.
    /// Tenants already labelled keep their counters, so a rule change
    /// that leaves the labelled set alone registers nothing.
    pub fn label_tenants<'a>(&self, tenants: impl IntoIterator<Item = &'a str>) {
        let chosen: std::collections::BTreeSet<&str> = tenants.into_iter().collect();
        let current = self.labeled.load();
        let chosen: Vec<&str> = chosen.into_iter().take(self.max_tenants).collect();
        if chosen.len() == current.len() && chosen.iter().all(|t| current.contains_key(*t)) {
            return;
        }
        let map = chosen
            .into_iter()
            .map(|t| match current.get_key_value(t) {
                Some((name, per_route)) => (name.clone(), per_route.clone()),
                None => {
                    let per_route = self.routes.iter().map(|r| register(r, t)).collect();
                    (Arc::from(t), per_route)
                }
            })
            .collect();
        self.labeled.store(Arc::new(map));
    }
}

/// The six outcome counters of one (route, tenant) label pair.
fn register(route: &str, tenant: &str) -> [Counter; 6] {
    Outcome::ALL.map(|o| {
        metrics::counter!(
            REQUESTS_TOTAL,
            "route" => route.to_owned(),
            "tenant" => tenant.to_owned(),
            "outcome" => o.label()
        )
    })
}

/// Pre-registered series outside any route.
#[derive(Clone)]
pub struct Metrics {
    /// `tollgate_requests_total{route="_none", outcome="no_route"}`.
    no_route: Counter,
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
    /// `tollgate_redis_errors_total{kind}` for timeout, connection, server.
    redis_errors: [Counter; 3],
    /// `tollgate_fallback_decisions_total{outcome}`: allowed, rejected.
    fallback: [Counter; 2],
    /// `tollgate_local_buckets`.
    local_buckets: Gauge,
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
}

/// Breaker states, as labels, in discriminant order.
const BREAKER_STATES: [&str; 3] = ["closed", "open", "half_open"];

/// Where a decision came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecisionSource {
    /// The shared bucket in Redis.
    Redis,
    /// This instance's local limiter (local-only mode or fallback).
    Local,
    /// Tokens leased earlier from Redis, spent locally.
    Lease,
    /// The over-limit cache: Redis said no tokens before a retry time.
    Cache,
}

impl DecisionSource {
    /// Every source, in label order.
    const ALL: [Self; 4] = [Self::Redis, Self::Local, Self::Lease, Self::Cache];

    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            Self::Redis => "redis",
            Self::Local => "local",
            Self::Lease => "lease",
            Self::Cache => "cache",
        }
    }
}

/// Redis error kinds, as labels.
const REDIS_ERROR_KINDS: [&str; 3] = ["timeout", "connection", "server"];

impl Metrics {
    /// Registers the series (call after [`install`]).
    pub fn new() -> Self {
        Self {
            no_route: metrics::counter!(
                REQUESTS_TOTAL,
                "route" => NO_ROUTE,
                "tenant" => OTHER_TENANTS,
                "outcome" => "no_route"
            ),
            decisions: DecisionSource::ALL
                .map(|s| metrics::histogram!(DECISION_SECONDS, "source" => s.label())),
            leases: metrics::counter!(LEASES_TOTAL),
            leased_tokens: metrics::counter!(LEASED_TOKENS_TOTAL),
            lease_expired_tokens: metrics::counter!(LEASE_EXPIRED_TOKENS_TOTAL),
            redis_call: metrics::histogram!(REDIS_CALL_SECONDS),
            redis_errors: REDIS_ERROR_KINDS
                .map(|k| metrics::counter!(REDIS_ERRORS_TOTAL, "kind" => k)),
            fallback: ["allowed", "rejected"]
                .map(|o| metrics::counter!(FALLBACK_DECISIONS_TOTAL, "outcome" => o)),
            local_buckets: metrics::gauge!(LOCAL_BUCKETS),
            rule_reloads: ["ok", "error"]
                .map(|r| metrics::counter!(RULE_RELOADS_TOTAL, "result" => r)),
            rules: metrics::gauge!(RULES),
            breaker_state: metrics::gauge!(BREAKER_STATE),
            breaker_transitions: BREAKER_STATES
                .map(|s| metrics::counter!(BREAKER_TRANSITIONS_TOTAL, "to" => s)),
            live_instances: metrics::gauge!(LIVE_INSTANCES),
        }
    }

    /// Counts a request that matched no route.
    pub fn no_route(&self) {
        self.no_route.increment(1);
    }

    /// Records how long a decision took and where it came from.
    pub fn decision(&self, source: DecisionSource, seconds: f64) {
        self.decisions[source as usize].record(seconds);
    }

    /// Records one successful Redis call's round trip.
    pub fn redis_call(&self, seconds: f64) {
        self.redis_call.record(seconds);
    }

    /// Counts a failed Redis call; `kind` is `timeout`, `connection` or `server`.
    pub fn redis_error(&self, kind: &str) {
        if let Some(i) = REDIS_ERROR_KINDS.iter().position(|k| *k == kind) {
            self.redis_errors[i].increment(1);
        }
    }

    /// Counts a decision made by the local fallback.
    pub fn fallback(&self, allowed: bool) {
        self.fallback[usize::from(!allowed)].increment(1);
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
    pub fn breaker_state(&self, state: u8) {
        self.breaker_state.set(f64::from(state));
    }

    /// Counts a breaker transition to `to` (`closed`, `open`, `half_open`).
    pub fn breaker_transition(&self, to: &str) {
        if let Some(i) = BREAKER_STATES.iter().position(|s| *s == to) {
            self.breaker_transitions[i].increment(1);
        }
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

    /// Counts a rebalancer round ending with `result` (a fixed word).
    pub fn rebalance_round(&self, result: &'static str) {
        metrics::counter!(REBALANCE_ROUNDS_TOTAL, "result" => result).increment(1);
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

/// The filter for a configured level: a bare level (`info`, `debug`)
/// applies to tollgate while other crates stay at `warn`; anything else is a
/// full `tracing` filter used as written.
pub fn log_filter(level: &str) -> String {
    let bare = ["error", "warn", "info", "debug", "trace", "off"];
    if bare.contains(&level.trim()) {
        format!("warn,tollgate={}", level.trim())
    } else {
        level.to_owned()
    }
}

/// Starts the log subscriber. `RUST_LOG`, when set, wins over `level`.
///
/// # Errors
/// When a subscriber is already installed or the filter is invalid.
pub fn init_tracing(level: &str) -> anyhow::Result<()> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(from_env) if !from_env.is_empty() => tracing_subscriber::EnvFilter::try_new(from_env)?,
        _ => tracing_subscriber::EnvFilter::try_new(log_filter(level))?,
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .try_init()
        .map_err(|e| anyhow::anyhow!(e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_capped_rule_tenants_get_their_own_label() {
        let handle = install();
        let counters = RequestCounters::new(["cap-route"], 2);
        counters.label_tenants(["zeta", "alpha", "beta", "alpha"]);
        counters.count(Some("alpha"), 0, Outcome::Allowed);
        counters.count(Some("zeta"), 0, Outcome::Allowed);
        counters.count(None, 0, Outcome::Unauthorized);
        let text = handle.render();
        let series = |tenant: &str, outcome: &str| {
            format!(
                "tollgate_requests_total{{route=\"cap-route\",tenant=\"{tenant}\",outcome=\"{outcome}\"}} 1"
            )
        };
        assert!(text.contains(&series("alpha", "allowed")), "{text}");
        assert!(
            text.contains(&series("_other", "allowed")),
            "zeta is past the cap:\n{text}"
        );
        assert!(text.contains(&series("_other", "unauthorized")));
        assert!(!text.contains("tenant=\"zeta\""));
    }
}
