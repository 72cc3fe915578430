//! The proxy listener: route, identify, limit, forward.
//!
//! Owns the request phases, in order:
//! 1. **route** — method + path → [`route::Route`] (404 when none);
//! 2. **identify** — `X-Api-Key` → [`TenantId`] (401 missing, 400 malformed;
//!    a rejected key never reaches Redis);
//! 3. **limit** — rule snapshot → [`Limiter::check`] (429 with headers);
//! 4. **forward** — stream to the upstream and back ([`forward`]), adding
//!    the rate-limit headers ([`headers`]).
//!
//! The phases run inline in one handler: no per-request actor message and
//! no lock beyond the local limiter's short shard lock.

pub mod error;
pub mod forward;
pub mod headers;
mod pool;
pub mod route;

use std::sync::Arc;

use actix_web::http::header::HeaderName;
use actix_web::{HttpRequest, HttpResponse, web};

use crate::bucket::Limiter;
use crate::clock::SharedClock;
use crate::key::TenantId;
use crate::region::shares::SharesHandle;
use crate::rules::RulesHandle;
use crate::telemetry::{Metrics, Outcome, RequestCounters};
use error::ProxyError;
use forward::Forwarder;
use headers::RateLimitHeaders;
use route::RouteTable;

/// The header that identifies the tenant.
pub const API_KEY: HeaderName = HeaderName::from_static("x-api-key");

/// State shared by every proxy worker.
pub struct ProxyState {
    /// Route table with per-route metrics.
    pub routes: RouteTable,
    /// Rules in force.
    pub rules: RulesHandle,
    /// This region's share of every limit.
    pub shares: SharesHandle,
    /// Series outside any route.
    pub metrics: Metrics,
    /// Requests by route, tenant and outcome.
    pub requests: Arc<RequestCounters>,
    /// Times upstream calls.
    pub clock: SharedClock,
}

/// Adds the proxy handler for every method and path to an actix `App`.
pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.default_service(web::to(handle));
}

/// Runs the four phases for one request.
async fn handle(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<ProxyState>,
    limiter: web::Data<Limiter>,
    forwarder: web::Data<Forwarder>,
) -> HttpResponse {
    let Some(route) = state.routes.find(req.method(), req.path()) else {
        state.metrics.no_route();
        return ProxyError::NoRoute.response();
    };

    let tenant = match identify(&req) {
        Ok(tenant) => tenant,
        Err(e) => {
            let outcome = if matches!(e, ProxyError::MissingKey) {
                Outcome::Unauthorized
            } else {
                Outcome::BadKey
            };
            state.requests.count(None, route.index, outcome);
            return e.response();
        }
    };

    let limit = state
        .rules
        .snapshot()
        .limit_for(tenant.as_str(), route.spec.id.as_str());
    let share = state
        .shares
        .snapshot()
        .share_for(tenant.as_str(), route.spec.id.as_str());
    let verdict = limiter
        .check(&tenant, &route.spec.id, limit, share, route.spec.cost)
        .await;
    let headers = RateLimitHeaders::new(route.spec.id.as_str(), &verdict);
    if !verdict.decision.allowed {
        state
            .requests
            .count(Some(tenant.as_str()), route.index, Outcome::Rejected);
        let rejected = ProxyError::RateLimited;
        let mut builder = rejected.builder();
        headers.apply(&mut builder);
        return rejected.finish(builder);
    }

    let started = state.clock.now_micros();
    let forwarded = forwarder
        .forward(&req, payload, route, |b| headers.apply(b))
        .await;
    let elapsed = state.clock.now_micros().saturating_sub(started);
    route.metrics.upstream_seconds(elapsed as f64 / 1e6);
    let outcome = match &forwarded {
        Ok(_) => Outcome::Allowed,
        Err(ProxyError::UpstreamTimeout) => Outcome::UpstreamTimeout,
        Err(_) => Outcome::UpstreamError,
    };
    state
        .requests
        .count(Some(tenant.as_str()), route.index, outcome);
    match forwarded {
        Ok(response) => response,
        Err(e) => {
            let mut builder = e.builder();
            headers.apply(&mut builder);
            e.finish(builder)
        }
    }
}

/// Reads and validates the tenant from `X-Api-Key`.
fn identify(req: &HttpRequest) -> Result<TenantId, ProxyError> {
    let raw = req.headers().get(API_KEY).ok_or(ProxyError::MissingKey)?;
    let text = raw.to_str().map_err(|_| ProxyError::BadKeyEncoding)?;
    TenantId::parse(text).map_err(ProxyError::BadKey)
}
