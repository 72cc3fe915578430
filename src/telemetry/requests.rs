//! `tollgate_requests_total` and the per-route upstream histogram.
//!
//! Owns the outcome labels of a proxied request and the bounded `tenant`
//! label: only tenants with an explicit rule get one, up to
//! `metrics.max_tenant_labels`; everyone else counts as `_other`.

use std::collections::HashMap;
use std::sync::Arc;

use arc_swap::ArcSwap;
use metrics::{Counter, Histogram};

use super::{REQUESTS_TOTAL, UPSTREAM_SECONDS};

/// Number of [`Outcome`]s.
const OUTCOMES: usize = 9;

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
    /// The tenant (or the default-rule group) had too many requests in
    /// flight: 429 before any decision.
    InFlightLimited,
    /// The client sent its body too slowly: 408.
    ClientTimeout,
    /// The client's body broke off: 400.
    ClientAborted,
}

impl Outcome {
    /// Every outcome, in label order.
    const ALL: [Self; OUTCOMES] = [
        Self::Allowed,
        Self::Rejected,
        Self::Unauthorized,
        Self::BadKey,
        Self::UpstreamError,
        Self::UpstreamTimeout,
        Self::InFlightLimited,
        Self::ClientTimeout,
        Self::ClientAborted,
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
            Self::InFlightLimited => "in_flight_limited",
            Self::ClientTimeout => "client_timeout",
            Self::ClientAborted => "client_aborted",
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
    other: Vec<[Counter; OUTCOMES]>,
    /// Labelled tenants' counters, by route index then outcome.
    labeled: ArcSwap<HashMap<Arc<str>, Vec<[Counter; OUTCOMES]>>>,
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

/// The outcome counters of one (route, tenant) label pair.
fn register(route: &str, tenant: &str) -> [Counter; OUTCOMES] {
    Outcome::ALL.map(|o| {
        metrics::counter!(
            REQUESTS_TOTAL,
            "route" => route.to_owned(),
            "tenant" => tenant.to_owned(),
            "outcome" => o.label()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::install;

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
