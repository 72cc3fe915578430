//! The access log: one line per proxied request, when `log.access` is on.
//!
//! Owns which requests are logged (every one, or an even share of them:
//! `log.access_sample_percent`) and what a line says: method, route,
//! status, the decision's source, the tenant (its rule's display name or
//! its key's fingerprint, never the key), the upstream's time to a response
//! head and the whole request's time. Lines go through `tracing` under the
//! target `tollgate::access`, so they take the log's format (text or JSON).

use std::sync::atomic::{AtomicU64, Ordering};

use hyper::{Method, StatusCode};

use super::route::RouteTable;
use crate::key::{TenantId, fingerprint};
use crate::telemetry::{ACCESS_TARGET, DecisionSource, NO_ROUTE, RequestCounters};

/// Which requests the access log keeps.
pub struct AccessLog {
    /// Share of requests logged, 1..=100 percent.
    percent: u64,
    /// Requests seen, for an even spread of the sampled ones.
    seen: AtomicU64,
}

/// What the phases learnt about one request, for its access line.
#[derive(Debug, Default)]
pub struct AccessNote {
    /// Index of the matched route.
    pub route: Option<usize>,
    /// The identified tenant.
    pub tenant: Option<TenantId>,
    /// Who decided.
    pub source: Option<DecisionSource>,
    /// Microseconds until the upstream's response head (or failure).
    pub upstream_us: Option<u64>,
}

impl AccessLog {
    /// Logs `percent` (1..=100) of the requests.
    pub fn new(percent: u8) -> Self {
        Self {
            percent: u64::from(percent.clamp(1, 100)),
            seen: AtomicU64::new(0),
        }
    }

    /// Whether this request is logged: exactly `percent` of every 100 in a
    /// row, spread evenly.
    pub fn sampled(&self) -> bool {
        if self.percent == 100 {
            return true;
        }
        let n = self.seen.fetch_add(1, Ordering::Relaxed);
        (n + 1) * self.percent / 100 != n * self.percent / 100
    }

    /// Writes the line of one request; `requests` gives labelled tenants
    /// their label.
    pub fn write(
        &self,
        note: &AccessNote,
        method: &Method,
        status: StatusCode,
        duration_us: u64,
        routes: &RouteTable,
        requests: &RequestCounters,
    ) {
        let route = note
            .route
            .and_then(|i| routes.get(i))
            .map_or(NO_ROUTE, |r| r.spec.id.as_str());
        let tenant = note.tenant.as_ref().map(|t| {
            requests
                .label_of(t.as_str())
                .map_or_else(|| fingerprint(t.as_str()), |label| label.to_string())
        });
        tracing::info!(
            target: ACCESS_TARGET,
            method = method.as_str(),
            route,
            status = status.as_u16(),
            source = note.source.map(DecisionSource::label),
            tenant,
            upstream_ms = note.upstream_us.map(|us| us as f64 / 1000.0),
            duration_ms = duration_us as f64 / 1000.0,
            "access"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logged(percent: u8, requests: usize) -> usize {
        let log = AccessLog::new(percent);
        (0..requests).filter(|_| log.sampled()).count()
    }

    #[test]
    fn a_sample_keeps_exactly_its_share() {
        assert_eq!(logged(100, 250), 250);
        assert_eq!(logged(10, 1_000), 100);
        assert_eq!(logged(1, 100), 1);
        assert_eq!(logged(33, 300), 99);
    }

    #[test]
    fn sampled_requests_are_spread_evenly() {
        let log = AccessLog::new(25);
        let picks: Vec<usize> = (0..12).filter(|_| log.sampled()).collect();
        assert_eq!(picks, [3, 7, 11]);
    }
}
