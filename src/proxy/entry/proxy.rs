//! The proxy entry: the phases of one proxied request, in order:
//! 0. **screen** — `CONNECT` and `TRACE` answer 405; the path is
//!    normalised ([`crate::path`]: 400 when ambiguous), and the normal form
//!    is what is matched and what the upstream receives;
//! 1. **route** — method + path → a [`Route`](crate::proxy::route::Route)
//!    (404 when none);
//! 2. **identify** — exactly one `X-Api-Key` → a tenant (401 missing,
//!    400 malformed or more than one; a rejected key never reaches Redis);
//! 3. **limit** — a slot among the tenant's exchanges in flight (429 when
//!    at its bound, before any token is taken), then rule snapshot → the
//!    limiter (429 with headers; under a rule in shadow mode, or
//!    `[limits] shadow`, a refusal is counted as `shadow_rejected` and the
//!    request goes on, without `Retry-After`);
//! 4. **forward** — stream to the upstream and back (after a local
//!    decision, in the worker's next turn), adding the rate-limit
//!    headers; on a route with `usage_header`, the reservation taken in
//!    step 3 is settled when the answer's head or trailers report its
//!    usage (`crate::proxy::usage`).
//!
//! The phases run inline in one handler: no per-request actor message and
//! no lock beyond the local limiter's short shard lock. The upstream gets
//! exactly the key that was limited, whatever the client's `Connection`
//! header lists.

use hyper::body::{Body, Incoming};
use hyper::{Method, Request, Response, Version};

use super::identify_counted;
use crate::path;
use crate::proxy::Worker;
use crate::proxy::access::AccessNote;
use crate::proxy::body::ProxyBody;
use crate::proxy::client::Client;
use crate::proxy::decide::{Decided, decide};
use crate::proxy::early;
use crate::proxy::error::ProxyError;
use crate::proxy::upstream::Target;
use crate::proxy::usage::{Settlement, reservation};
use crate::telemetry::{BodyDirection, DecisionSource, Entry, Outcome, Unrouted, UsageKind};

/// Runs the phases for one proxied request from `client`, and writes its
/// access line when the access log is on and keeps this request. The
/// phases are a block of this function, not a function of their own: a
/// request's future is then one state machine, not one moved into
/// another.
pub(super) async fn handle(
    req: Request<Incoming>,
    client: &Client,
    worker: &Worker,
) -> Response<ProxyBody> {
    let state = &*worker.state;
    let mut sampled = state
        .access
        .as_ref()
        .filter(|log| log.sampled())
        .map(|log| {
            let started = state.clock.now_micros();
            (log, started, req.method().clone(), AccessNote::default())
        });
    let mut note = sampled.as_mut().map(|(.., note)| note);
    let response = 'phases: {
        let Worker {
            state,
            forwarder,
            slots,
            ..
        } = worker;
        let early = |req, error: ProxyError| early::answer(req, error.response(), &client.linger);
        if matches!(*req.method(), Method::CONNECT | Method::TRACE) {
            state.metrics.unrouted(Unrouted::BadRequest);
            break 'phases early(req, ProxyError::MethodNotAllowed).await;
        }
        let path = match path::normalize(req.uri().path()) {
            Ok(path) => path,
            Err(e) => {
                state.metrics.unrouted(Unrouted::BadRequest);
                break 'phases early(req, ProxyError::BadPath(e)).await;
            }
        };
        let Some(route) = state.routes.find(req.method(), &path) else {
            state.metrics.unrouted(Unrouted::NoRoute);
            break 'phases early(req, ProxyError::NoRoute).await;
        };
        if let Some(note) = note.as_deref_mut() {
            note.route = Some(route.index);
        }

        let tenant = match identify_counted(req.headers(), state, Entry::Proxy, route.index) {
            Ok(tenant) => tenant,
            Err(e) => break 'phases early(req, e).await,
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
        let Some(mut slot) = slots.acquire(&tenant, in_force.names_tenant()) else {
            count(Outcome::InFlightLimited);
            break 'phases early(req, ProxyError::TooManyInFlight).await;
        };
        drop(rules);
        let cost = match &route.spec.usage {
            None => route.spec.cost,
            Some(usage) => match reservation(req.headers(), usage) {
                Ok(reserved) => reserved,
                Err(()) => break 'phases early(req, ProxyError::BadReservation).await,
            },
        };
        let Decided {
            refused,
            shadowed,
            took,
            source,
            headers,
            held,
        } = decide(worker, &tenant, &route.spec.id, &in_force, cost, None).await;
        // The cluster's concurrency slots last as long as the worker's.
        slot.keep(held);
        if let Some(note) = note.as_deref_mut() {
            note.source = Some(source);
        }
        // A request let through in shadow mode took nothing unless enforced
        // limits beside the refusing ones took it: one that took nothing
        // has its usage charged whole when settled.
        let reserved = if took { cost.get() } else { 0 };
        if route.spec.usage.is_some() && reserved > 0 {
            route
                .metrics
                .usage(UsageKind::Reserved, u64::from(reserved));
        }
        if refused {
            count(Outcome::Rejected);
            let mut rejected = ProxyError::RateLimited.response();
            headers.apply(rejected.headers_mut());
            break 'phases early::answer(req, rejected, &client.linger).await;
        }

        // Dropped unsettled (an error, no usage reported), its reservation
        // is counted as expired (a request that reserved nothing counts
        // none).
        let settlement = route.spec.usage.as_ref().map(|usage| {
            let limiter = &worker.limiter;
            Settlement::new(
                limiter,
                state,
                &tenant,
                &route.spec.id,
                &usage.header,
                reserved,
            )
        });
        // A local decision (local-only mode, or the fallback while the
        // breaker is open) is made without letting the worker go:
        // forwarded as soon as read, each request would wake its upstream,
        // which on a shared core then takes the core between the gateway's
        // requests. Such a request goes upstream in the worker's next turn,
        // with the others read in this one. (A fallback after a failed call
        // has waited already; its extra turn costs a poll.) Requests
        // decided by Redis or from leases measured better without the
        // extra turn (docs/performance.md).
        if source == DecisionSource::Local {
            tokio::task::yield_now().await;
        }
        let started = state.clock.now_micros();
        // A failed exchange may leave some of the body unread.
        let body_pending = req.version() != Version::HTTP_2 && !req.body().is_end_stream();
        let target = Target::new(route, &path, req.uri().query(), &tenant);
        let forwarded = forwarder
            .forward(req, client, target, slot, started / 1000)
            .await;
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
            Ok(mut response) => {
                headers.apply(response.headers_mut());
                if let Some(unsettled) = settlement.and_then(|s| s.settle_from(response.headers()))
                    && let ProxyBody::Streamed(body) = response.body_mut()
                {
                    body.settle_from_trailers(unsettled);
                }
                response
            }
            Err(e) => {
                let mut response = e.response();
                headers.apply(response.headers_mut());
                if body_pending {
                    early::close(&mut response, &client.linger);
                }
                response
            }
        }
    };
    if let Some((log, started, method, note)) = sampled {
        let duration = state.clock.now_micros().saturating_sub(started);
        log.write(
            &note,
            &method,
            response.status(),
            duration,
            &state.routes,
            &state.requests,
        );
    }
    response
}
