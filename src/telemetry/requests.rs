//! `tollgate_requests_total`, and per route the upstream histogram and the
//! tokens of limits on what answers cost.
//!
//! Owns the outcome labels of a request, the entry point it came through
//! (`entry`: the proxy, Envoy's rate limit service, the HTTP check) and
//! the bounded `tenant` label: only tenants with an explicit rule get one,
//! up to `metrics.max_tenant_labels`; everyone else counts as `_other`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use arc_swap::ArcSwap;
use metrics::{Counter, Histogram};

use super::{REQUESTS_TOTAL, UPSTREAM_SECONDS, USAGE_TOKENS_TOTAL, UsageKind};
use crate::key::{RouteId, TenantName, full_fingerprint, tenant_label};

/// Number of [`Outcome`]s.
const OUTCOMES: usize = 10;

/// What happened to one proxied request, as a metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Admitted and answered by the upstream.
    Allowed,
    /// Over the limit: 429.
    Rejected,
    /// Over a limit in shadow mode: forwarded anyway (whatever the
    /// upstream then answered).
    ShadowRejected,
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
        Self::ShadowRejected,
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
            Self::ShadowRejected => "shadow_rejected",
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

/// Where a request came in: the `entry` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Entry {
    /// The proxy listener (`server.listen`): limited and forwarded.
    Proxy,
    /// Envoy's rate limit service (`rls.listen`): one decision per
    /// descriptor.
    Rls,
    /// The HTTP check (`check.listen`): a decision, nothing forwarded.
    Check,
}

impl Entry {
    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            Self::Proxy => "proxy",
            Self::Rls => "rls",
            Self::Check => "check",
        }
    }
}

/// Pre-registered series of one route.
#[derive(Clone)]
pub struct RouteMetrics {
    /// `tollgate_upstream_duration_seconds{route}`.
    upstream: Histogram,
    /// `tollgate_usage_tokens_total{route, kind}`, in [`UsageKind::ALL`]
    /// order.
    usage: [Counter; 4],
}

impl RouteMetrics {
    /// Registers the series of `route`.
    pub fn new(route: &RouteId) -> Self {
        let route = route.as_str();
        Self {
            upstream: metrics::histogram!(UPSTREAM_SECONDS, "route" => route.to_owned()),
            usage: UsageKind::ALL.map(|kind| {
                metrics::counter!(
                    USAGE_TOKENS_TOTAL,
                    "route" => route.to_owned(),
                    "kind" => kind.label(),
                )
            }),
        }
    }

    /// Counts `tokens` of `kind` on a limit of what answers cost.
    pub fn usage(&self, kind: UsageKind, tokens: u64) {
        self.usage[kind as usize].increment(tokens);
    }

    /// Records the time to an upstream's response head.
    pub fn upstream_seconds(&self, seconds: f64) {
        self.upstream.record(seconds);
    }
}

/// `tollgate_requests_total{route, tenant, outcome, entry}` with a bounded tenant
/// label: tenants that have an explicit rule get their own label, up to
/// `metrics.max_tenant_labels`; every other request counts under
/// `tenant="_other"`. The label is never the key: it is the tenant's name
/// when its rule gives one, else a fingerprint of the key
/// ([`tenant_label`]); a name two labelled tenants share gets each one's
/// full fingerprint appended. The rebalancer reads per-tenant demand from
/// these and maps labels back with [`RequestCounters::tenant_of`].
pub struct RequestCounters {
    /// Route ids, by route index.
    routes: Vec<String>,
    /// The entry points served, each with its series.
    entries: Vec<Entry>,
    /// `tenant="_other"` counters, by entry and route (see [`slot`]), then
    /// outcome.
    other: Vec<[Counter; OUTCOMES]>,
    /// The labelled tenants.
    labelled: ArcSwap<Labelled>,
    /// Most tenants with their own label.
    max_tenants: usize,
}

/// The tenants with a label of their own.
#[derive(Default)]
struct Labelled {
    /// Tenant id → its label and its counters: looked up on every
    /// request, so hashed by foldhash (seeded per process), not SipHash;
    /// its keys are tenants that rules name, never a client's choice.
    by_tenant: HashMap<Arc<str>, (Arc<str>, RouteCounters), foldhash::fast::RandomState>,
    /// Label → tenant id.
    by_label: HashMap<Arc<str>, Arc<str>>,
}

/// One label's outcome counters, by entry and route (see [`slot`]), then
/// outcome.
type RouteCounters = Vec<[Counter; OUTCOMES]>;

/// Label value for tenants without a label of their own.
pub const OTHER_TENANTS: &str = "_other";

impl RequestCounters {
    /// Registers the `_other` series of every route on every entry point
    /// in `entries` (the proxy's always).
    pub fn new<'a>(
        routes: impl IntoIterator<Item = &'a str>,
        entries: &[Entry],
        max_tenants: usize,
    ) -> Self {
        let routes: Vec<String> = routes.into_iter().map(str::to_owned).collect();
        let mut served = vec![Entry::Proxy];
        served.extend(entries.iter().filter(|e| **e != Entry::Proxy));
        let mut this = Self {
            routes,
            entries: served,
            other: Vec::new(),
            labelled: ArcSwap::from_pointee(Labelled::default()),
            max_tenants,
        };
        this.other = this.register_all(OTHER_TENANTS);
        this
    }

    /// The counters of `tenant` on every entry point and route.
    fn register_all(&self, tenant: &str) -> RouteCounters {
        self.entries
            .iter()
            .flat_map(|entry| self.routes.iter().map(|r| register(*entry, r, tenant)))
            .collect()
    }

    /// Where the counters of `entry` and route index `route` are; `None`
    /// for an entry point not served.
    fn slot(&self, entry: Entry, route: usize) -> Option<usize> {
        let e = self.entries.iter().position(|served| *served == entry)?;
        (route < self.routes.len()).then(|| e * self.routes.len() + route)
    }

    /// Counts one request of `tenant` (when known) on route `route`, come
    /// through `entry`.
    pub fn count(&self, entry: Entry, tenant: Option<&str>, route: usize, outcome: Outcome) {
        let Some(slot) = self.slot(entry, route) else {
            return;
        };
        let labelled = self.labelled.load();
        let counters = tenant
            .and_then(|t| labelled.by_tenant.get(t))
            .and_then(|(_, per_route)| per_route.get(slot))
            .or_else(|| self.other.get(slot));
        if let Some(c) = counters {
            c[outcome as usize].increment(1);
        }
    }

    /// The label of `tenant`, when it has one of its own.
    pub fn label_of(&self, tenant: &str) -> Option<Arc<str>> {
        let labelled = self.labelled.load();
        labelled
            .by_tenant
            .get(tenant)
            .map(|(label, _)| label.clone())
    }

    /// The tenant whose label is `label`, if any.
    pub fn tenant_of(&self, label: &str) -> Option<Arc<str>> {
        self.labelled.load().by_label.get(label).cloned()
    }

    /// Gives the first `metrics.max_tenant_labels` of `tenants` (in sorted
    /// order; each with the name one of its rules gives, the smallest when
    /// they differ) a label of their own; the rest count as `_other`.
    /// Tenants whose label stays keep their counters, so a rule change
    /// that leaves the labels alone registers nothing.
    pub fn label_tenants<'a>(
        &self,
        tenants: impl IntoIterator<Item = (&'a str, Option<&'a TenantName>)>,
    ) {
        let mut named: BTreeMap<&str, Option<&TenantName>> = BTreeMap::new();
        for (tenant, name) in tenants {
            let entry = named.entry(tenant).or_insert(name);
            if let Some(name) = name
                && entry.is_none_or(|current| name < current)
            {
                *entry = Some(name);
            }
        }
        let chosen: Vec<(&str, String)> = named
            .into_iter()
            .take(self.max_tenants)
            .map(|(tenant, name)| (tenant, tenant_label(tenant, name)))
            .collect();
        let mut uses: HashMap<&str, usize> = HashMap::new();
        for (_, label) in &chosen {
            *uses.entry(label.as_str()).or_default() += 1;
        }
        let chosen: Vec<(&str, String)> = chosen
            .iter()
            .map(|(tenant, label)| match uses[label.as_str()] {
                1 => (*tenant, label.clone()),
                _ => (*tenant, format!("{label}{}", full_fingerprint(tenant))),
            })
            .collect();

        let current = self.labelled.load();
        let unchanged = chosen.len() == current.by_tenant.len()
            && chosen.iter().all(|(tenant, label)| {
                current
                    .by_tenant
                    .get(*tenant)
                    .is_some_and(|(now, _)| **now == **label)
            });
        if unchanged {
            return;
        }
        let mut next = Labelled::default();
        for (tenant, label) in chosen {
            let (tenant, label): (Arc<str>, Arc<str>) = (Arc::from(tenant), Arc::from(label));
            let counters = match current.by_tenant.get(&tenant) {
                Some((now, counters)) if *now == label => counters.clone(),
                _ => self.register_all(&label),
            };
            next.by_label.insert(label.clone(), tenant.clone());
            next.by_tenant.insert(tenant, (label, counters));
        }
        self.labelled.store(Arc::new(next));
    }
}

/// The outcome counters of one (entry, route, tenant) label set.
fn register(entry: Entry, route: &str, tenant: &str) -> [Counter; OUTCOMES] {
    Outcome::ALL.map(|o| {
        metrics::counter!(
            REQUESTS_TOTAL,
            "route" => route.to_owned(),
            "tenant" => tenant.to_owned(),
            "outcome" => o.label(),
            "entry" => entry.label()
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
        let counters = RequestCounters::new(["cap-route"], &[Entry::Rls], 2);
        let alpha = TenantName::parse("Alpha Inc").unwrap();
        counters.label_tenants([
            ("zeta", None),
            ("alpha", Some(&alpha)),
            ("beta", None),
            ("alpha", None),
        ]);
        counters.count(Entry::Proxy, Some("alpha"), 0, Outcome::Allowed);
        counters.count(Entry::Proxy, Some("beta"), 0, Outcome::Allowed);
        counters.count(Entry::Proxy, Some("zeta"), 0, Outcome::Allowed);
        counters.count(Entry::Proxy, None, 0, Outcome::Unauthorized);
        counters.count(Entry::Rls, Some("alpha"), 0, Outcome::Rejected);
        counters.count(Entry::Check, Some("alpha"), 0, Outcome::Rejected);
        let text = handle.render();
        let on = |entry: &str, tenant: &str, outcome: &str| {
            format!(
                "tollgate_requests_total{{route=\"cap-route\",tenant=\"{tenant}\",outcome=\"{outcome}\",entry=\"{entry}\"}} 1"
            )
        };
        let series = |tenant: &str, outcome: &str| on("proxy", tenant, outcome);
        assert!(text.contains(&on("rls", "Alpha Inc", "rejected")), "{text}");
        assert!(
            !text.contains("entry=\"check\""),
            "an entry point not served has no series:\n{text}"
        );
        assert!(text.contains(&series("Alpha Inc", "allowed")), "{text}");
        let beta = crate::key::fingerprint("beta");
        assert!(text.contains(&series(&beta, "allowed")), "{text}");
        assert!(
            text.contains(&series("_other", "allowed")),
            "zeta is past the cap:\n{text}"
        );
        assert!(text.contains(&series("_other", "unauthorized")));
        for key in ["alpha", "beta", "zeta"] {
            assert!(!text.contains(&format!("tenant=\"{key}\"")), "{key} shown");
        }
        assert_eq!(counters.tenant_of("Alpha Inc").as_deref(), Some("alpha"));
        assert_eq!(counters.tenant_of(&beta).as_deref(), Some("beta"));
        assert_eq!(counters.label_of("beta").as_deref(), Some(beta.as_str()));
    }

    #[test]
    fn a_name_two_tenants_share_is_told_apart() {
        let counters = RequestCounters::new(["dup-route"], &[], 10);
        let shared = TenantName::parse("Shared").unwrap();
        counters.label_tenants([("one", Some(&shared)), ("two", Some(&shared))]);
        let (a, b) = (
            counters.label_of("one").unwrap(),
            counters.label_of("two").unwrap(),
        );
        assert_ne!(a, b);
        assert!(
            a.starts_with("Shared#") && b.starts_with("Shared#"),
            "{a} {b}"
        );
        assert_eq!(counters.tenant_of(&a).as_deref(), Some("one"));
    }
}
