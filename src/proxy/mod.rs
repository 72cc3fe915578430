//! The proxy listener: route, identify, limit, forward.
//!
//! Owns the request phases, in order:
//! 0. **screen** — `CONNECT` and `TRACE` answer 405; the path is
//!    normalised ([`crate::path`]: 400 when ambiguous), and the normal form
//!    is what is matched and what the upstream receives;
//! 1. **route** — method + path → [`route::Route`] (404 when none);
//! 2. **identify** — exactly one `X-Api-Key` → [`TenantId`] (401 missing,
//!    400 malformed or more than one; a rejected key never reaches Redis);
//! 3. **limit** — a slot among the tenant's exchanges in flight (429 when
//!    at its bound, before any token is taken), then rule snapshot →
//!    [`Limiter::check`] (429 with headers; under a rule in shadow mode, or
//!    `[limits] shadow`, a refusal is counted as `shadow_rejected` and the
//!    request goes on, without `Retry-After`);
//! 4. **forward** — stream to the upstream and back ([`forward`]), adding
//!    the rate-limit headers ([`headers`]).
//!
//! The phases run inline in one handler: no per-request actor message and
//! no lock beyond the local limiter's short shard lock. The upstream gets
//! exactly the key that was limited, whatever the client's `Connection`
//! header lists. Connections, workers and shutdown are [`server`]'s.

pub mod access;
pub mod error;
pub mod forward;
pub mod headers;

mod body;
mod check;
mod decide;
mod early;
mod grpc;
mod hop;
mod pool;
mod rls;
pub mod route;
pub mod server;
mod slots;
mod speak;
mod stall;

use std::sync::Arc;

use hyper::body::{Body, Incoming};
use hyper::header::{HeaderMap, HeaderName};
use hyper::{Method, Request, Response, Version};

use crate::bucket::Limiter;
use crate::clock::SharedClock;
use crate::config::{CheckSettings, RlsSettings};
use crate::key::TenantId;
use crate::path;
use crate::region::shares::SharesHandle;
use crate::rules::RulesHandle;
use crate::telemetry::{BodyDirection, Entry, Metrics, Outcome, RequestCounters, Unrouted};
use access::{AccessLog, AccessNote};
use body::ProxyBody;
use decide::{Decided, decide};
use error::ProxyError;
use forward::{Forwarder, Target};
use route::RouteTable;
use server::Client;

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
    /// `[limits] shadow`: every rule in shadow mode.
    pub shadow: bool,
    /// The access log, when `log.access` is on.
    pub access: Option<AccessLog>,
    /// Envoy's rate limit service, when served.
    pub rls: Option<RlsSettings>,
    /// The HTTP check, when served.
    pub check: Option<CheckSettings>,
}

/// One proxy worker: the state every worker shares, and the worker's own
/// limiter (its bucket client) and upstream connections.
pub struct Worker {
    /// Shared by every worker.
    pub state: Arc<ProxyState>,
    /// Decides, through this worker's bucket client.
    pub limiter: Limiter,
    /// This worker's upstream connections.
    pub forwarder: Forwarder,
}

/// Answers one request from `client` that came in through `entry`.
async fn handle(
    entry: Entry,
    req: Request<Incoming>,
    client: &Client,
    worker: &Worker,
) -> Response<ProxyBody> {
    match entry {
        Entry::Proxy => proxy(req, client, worker).await,
        Entry::Rls => rls::handle(req, worker).await,
        Entry::Check => check::handle(req, worker, &client.linger).await,
    }
}

/// Runs the phases for one proxied request from `client`, and writes its
/// access line when the access log is on and keeps this request.
async fn proxy(req: Request<Incoming>, client: &Client, worker: &Worker) -> Response<ProxyBody> {
    let state = &*worker.state;
    let Some(log) = state.access.as_ref().filter(|log| log.sampled()) else {
        return phases(req, client, worker, None).await;
    };
    let started = state.clock.now_micros();
    let method = req.method().clone();
    let mut note = AccessNote::default();
    let response = phases(req, client, worker, Some(&mut note)).await;
    let duration = state.clock.now_micros().saturating_sub(started);
    log.write(
        &note,
        &method,
        response.status(),
        duration,
        &state.routes,
        &state.requests,
    );
    response
}

/// The phases for one request; `note`, when given, collects what the
/// access line reports.
async fn phases(
    req: Request<Incoming>,
    client: &Client,
    worker: &Worker,
    mut note: Option<&mut AccessNote>,
) -> Response<ProxyBody> {
    let Worker {
        state, forwarder, ..
    } = worker;
    let early = |req, error: ProxyError| early::answer(req, error.response(), &client.linger);
    if matches!(*req.method(), Method::CONNECT | Method::TRACE) {
        state.metrics.unrouted(Unrouted::BadRequest);
        return early(req, ProxyError::MethodNotAllowed).await;
    }
    let path = match path::normalize(req.uri().path()) {
        Ok(path) => path,
        Err(e) => {
            state.metrics.unrouted(Unrouted::BadRequest);
            return early(req, ProxyError::BadPath(e)).await;
        }
    };
    let Some(route) = state.routes.find(req.method(), &path) else {
        state.metrics.unrouted(Unrouted::NoRoute);
        return early(req, ProxyError::NoRoute).await;
    };
    if let Some(note) = note.as_deref_mut() {
        note.route = Some(route.index);
    }

    let tenant = match identify_counted(req.headers(), state, Entry::Proxy, route.index) {
        Ok(tenant) => tenant,
        Err(e) => return early(req, e).await,
    };
    if let Some(note) = note.as_deref_mut() {
        note.tenant = Some(tenant.clone());
    }
    let count = |outcome| {
        state
            .requests
            .count(Entry::Proxy, Some(tenant.as_str()), route.index, outcome);
    };

    let rules = state.rules.snapshot();
    let in_force = rules.in_force(tenant.as_str(), route.spec.id.as_str());
    let Some(slot) = forwarder.slot(&tenant, in_force.names_tenant()) else {
        count(Outcome::InFlightLimited);
        return early(req, ProxyError::TooManyInFlight).await;
    };
    drop(rules);
    let Decided {
        refused,
        shadowed,
        source,
        headers,
    } = decide(worker, &tenant, &route.spec.id, &in_force, route.spec.cost).await;
    if let Some(note) = note.as_deref_mut() {
        note.source = Some(source);
    }
    if refused {
        count(Outcome::Rejected);
        let mut rejected = ProxyError::RateLimited.response();
        headers.apply(rejected.headers_mut());
        return early::answer(req, rejected, &client.linger).await;
    }

    let started = state.clock.now_micros();
    // A failed exchange may leave some of the body unread.
    let body_pending = req.version() != Version::HTTP_2 && !req.body().is_end_stream();
    let forwarded = match Target::new(route, &path, req.uri().query(), &tenant) {
        Ok(target) => forwarder.forward(req, client, target, slot, &headers).await,
        Err(e) => Err(e),
    };
    let elapsed = state.clock.now_micros().saturating_sub(started);
    route.metrics.upstream_seconds(elapsed as f64 / 1e6);
    if let Some(note) = note {
        note.upstream_us = Some(elapsed);
    }
    count(match &forwarded {
        Ok(_) if shadowed => Outcome::ShadowRejected,
        Ok(_) => Outcome::Allowed,
        Err(ProxyError::UpstreamTimeout) => Outcome::UpstreamTimeout,
        Err(ProxyError::ClientTimeout) => {
            state.metrics.client_timeout(BodyDirection::Request);
            Outcome::ClientTimeout
        }
        Err(ProxyError::ClientAborted) => Outcome::ClientAborted,
        Err(_) => Outcome::UpstreamError,
    });
    match forwarded {
        Ok(response) => response,
        Err(e) => {
            let mut response = e.response();
            headers.apply(response.headers_mut());
            if body_pending {
                early::close(&mut response, &client.linger);
            }
            response
        }
    }
}

/// The tenant of `headers` ([`identify`]); a missing or malformed key is
/// counted for `entry` on route index `route`.
fn identify_counted(
    headers: &HeaderMap,
    state: &ProxyState,
    entry: Entry,
    route: usize,
) -> Result<TenantId, ProxyError> {
    identify(headers).map_err(|e| {
        let outcome = if matches!(e, ProxyError::MissingKey) {
            Outcome::Unauthorized
        } else {
            Outcome::BadKey
        };
        state.requests.count(entry, None, route, outcome);
        e
    })
}

/// Reads and validates the tenant: exactly one `X-Api-Key` header holding
/// one key, and no other spelling of the header name (`X_Api_Key`, which
/// CGI-style servers read as the same header).
fn identify(headers: &HeaderMap) -> Result<TenantId, ProxyError> {
    if headers.keys().any(|name| is_key_alias(name.as_str())) {
        return Err(ProxyError::SeveralKeys);
    }
    let mut keys = headers.get_all(API_KEY).iter();
    let raw = keys.next().ok_or(ProxyError::MissingKey)?;
    if keys.next().is_some() {
        return Err(ProxyError::SeveralKeys);
    }
    let text = raw.to_str().map_err(|_| ProxyError::BadKeyEncoding)?;
    if text.contains(',') {
        return Err(ProxyError::SeveralKeys);
    }
    TenantId::parse(text).map_err(ProxyError::BadKey)
}

/// Whether the (lower-case) header `name` is `x-api-key` spelt with
/// underscores for some of its dashes.
fn is_key_alias(name: &str) -> bool {
    const KEY: &[u8] = b"x-api-key";
    name.len() == KEY.len()
        && name.contains('_')
        && name
            .bytes()
            .zip(KEY)
            .all(|(b, &k)| b == k || (b == b'_' && k == b'-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn underscore_spellings_of_the_key_header_are_aliases() {
        assert!(is_key_alias("x_api_key"));
        assert!(is_key_alias("x-api_key"));
        assert!(!is_key_alias("x-api-key"));
        assert!(!is_key_alias("x_api_kez"));
        assert!(!is_key_alias("accept"));
    }
}
