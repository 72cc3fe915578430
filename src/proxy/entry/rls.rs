//! Envoy's rate limit service: `ShouldRateLimit` over gRPC
//! (`envoy.service.ratelimit.v3`, Envoy's published protos through the
//! `envoy-types` crate), on its own listener (`rls.listen`).
//!
//! Owns how a request's descriptors become decisions. Each descriptor is
//! one: its entry `rls.tenant_key` (default `api_key`) names the tenant,
//! its entry `rls.route_key` (default `route`) a configured route, and its
//! `hits_addend`, else the request's, else 1, is the cost. A descriptor
//! whose entry `rls.charge_key` (default `charge`) is `true` is a charge:
//! usage reported after the fact (Envoy's `apply_on_stream_done`), taken
//! whatever the limits hold and never answered over-limit; its
//! `hits_addend` may be 0, and with `is_negative_hits` it gives tokens
//! back. Every
//! descriptor is checked before any is decided, so a malformed request
//! (`INVALID_ARGUMENT`, naming the descriptor) takes nothing. A tenant
//! value that is not a valid key comes from the client, not from Envoy's
//! configuration: that request is refused (`OVER_LIMIT`, nothing taken),
//! never answered with an error that Envoy's `failure_mode_deny: false`
//! would let through. The
//! decisions run together on the worker, so they share Redis calls. The
//! answer is `OVER_LIMIT` when any descriptor is refused; statuses come
//! in request order; the IETF RateLimit fields (and `Retry-After` on a
//! refusal) of the most restrictive descriptor ride in
//! `response_headers_to_add` for Envoy to pass on.

use std::num::NonZeroU32;

use envoy_types::pb::envoy::config::core::v3::HeaderValue as EnvoyHeader;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code as RlsCode, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use hyper::body::Incoming;
use hyper::{Request, Response};

use super::grpc::{self, Code, Status};
use super::request_id;
use crate::bucket::GroupLimit;
use crate::config::RlsSettings;
use crate::key::{RouteId, TenantId};
use crate::proxy::Worker;
use crate::proxy::body::ProxyBody;
use crate::proxy::client::Client;
use crate::proxy::decide::{Decided, charge_now, decide_now, release_now};
use crate::proxy::headers::Binding;
use crate::proxy::route::{Route, quoted};
use crate::rules::Window;
use crate::telemetry::{Entry, Outcome};

/// The one method served.
const SHOULD_RATE_LIMIT: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// Most descriptors one request may carry.
pub(super) const MAX_DESCRIPTORS: usize = 64;

/// Answers one call on the RLS listener.
pub(super) async fn handle(
    req: Request<Incoming>,
    client: &Client,
    worker: &Worker,
) -> Response<ProxyBody> {
    let Some(settings) = worker.state.rls.as_ref() else {
        return Status::new(Code::Unimplemented, "rls is not configured").response();
    };
    let timeout = worker.forwarder.read_timeout();
    let request: RateLimitRequest =
        match grpc::read_unary(req, SHOULD_RATE_LIMIT, timeout, &client.budget).await {
            Ok(request) => request,
            Err(response) => return response,
        };
    let asks = match parse(settings, worker, &request) {
        Ok(asks) => asks,
        Err(message) => return Status::new(Code::InvalidArgument, message).response(),
    };
    if asks.iter().any(|a| a.tenant.is_none()) {
        return grpc::respond(&refused_keys(worker, &asks));
    }
    grpc::respond(&answer(worker, &asks).await)
}

/// The answer to a request with a tenant value that is not a valid key:
/// over the limit, nothing decided or taken; each such descriptor is
/// counted as a bad key.
fn refused_keys(worker: &Worker, asks: &[Ask<'_>]) -> RateLimitResponse {
    for a in asks.iter().filter(|a| a.tenant.is_none()) {
        worker
            .state
            .requests
            .count(Entry::Rls, None, a.route.index, Outcome::BadKey);
    }
    RateLimitResponse {
        overall_code: RlsCode::OverLimit as i32,
        statuses: asks
            .iter()
            .map(|a| DescriptorStatus {
                code: if a.tenant.is_none() {
                    RlsCode::OverLimit
                } else {
                    RlsCode::Unknown
                } as i32,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

/// What one descriptor asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Asked {
    /// A decision: these tokens taken, or refused; a concurrency slot
    /// held for the request it names (`rls.request_id_key`), if any.
    Take(NonZeroU32, Option<String>),
    /// A charge: these tokens taken whatever the limits hold (negative:
    /// given back).
    Charge(i64),
    /// The concurrency slots of the request it names given back.
    Release(String),
}

/// One descriptor, checked.
struct Ask<'a> {
    /// Whose limit; `None` when the value is not a valid key.
    tenant: Option<TenantId>,
    /// On which configured route.
    route: &'a Route,
    /// What it asks for.
    asked: Asked,
}

/// Every descriptor of `request` as a decision to take.
///
/// # Errors
/// What is wrong, naming the descriptor.
fn parse<'a>(
    settings: &RlsSettings,
    worker: &'a Worker,
    request: &RateLimitRequest,
) -> Result<Vec<Ask<'a>>, String> {
    if let Some(domain) = &settings.domain
        && request.domain != *domain
    {
        return Err(format!(
            "domain {} is not served here (rls.domain is {domain:?})",
            quoted(&request.domain)
        ));
    }
    if request.descriptors.is_empty() {
        return Err("no descriptors".into());
    }
    if request.descriptors.len() > MAX_DESCRIPTORS {
        return Err(format!(
            "{} descriptors; at most {MAX_DESCRIPTORS} are served in one request",
            request.descriptors.len()
        ));
    }
    let default_cost = request.hits_addend.max(1);
    request
        .descriptors
        .iter()
        .enumerate()
        .map(|(i, d)| {
            ask(settings, worker, d, default_cost).map_err(|e| format!("descriptors[{i}]: {e}"))
        })
        .collect()
}

/// One descriptor as a decision; `default_cost` when it names no cost.
fn ask<'a>(
    settings: &RlsSettings,
    worker: &'a Worker,
    descriptor: &RateLimitDescriptor,
    default_cost: u32,
) -> Result<Ask<'a>, String> {
    // An entry that may be absent, but never twice.
    let optional = |key: &str| {
        let mut found = descriptor.entries.iter().filter(|e| e.key == key);
        match (found.next(), found.next()) {
            (entry, None) => Ok(entry.map(|e| e.value.as_str())),
            (_, Some(_)) => Err(format!("more than one entry {}", quoted(key))),
        }
    };
    let required = |key: &str| optional(key)?.ok_or_else(|| format!("no entry {}", quoted(key)));
    let tenant = TenantId::parse(required(&settings.tenant_key)?).ok();
    let route = worker
        .state
        .routes
        .named(required(&settings.route_key)?)
        .map_err(|e| format!("{:?}: {e}", settings.route_key))?;
    // An entry that may be absent, else must be "true".
    let flag = |key: &str| match optional(key)? {
        None => Ok(false),
        Some("true") => Ok(true),
        Some(other) => Err(format!("{key:?} must be \"true\", found {}", quoted(other))),
    };
    let charged = flag(&settings.charge_key)?;
    let request = optional(&settings.request_id_key)?
        .map(|id| request_id(&settings.request_id_key, id).map(str::to_owned))
        .transpose()?;
    if flag(&settings.release_key)? {
        if charged || descriptor.is_negative_hits {
            return Err(format!(
                "a release ({:?}) is neither a charge nor negative hits",
                settings.release_key
            ));
        }
        let Some(request) = request else {
            return Err(format!(
                "a release names its request (an entry {})",
                quoted(&settings.request_id_key)
            ));
        };
        return Ok(Ask {
            tenant,
            route,
            asked: Asked::Release(request),
        });
    }
    if charged {
        let hits = descriptor
            .hits_addend
            .as_ref()
            .map_or(u64::from(default_cost), |h| h.value);
        let amount = i64::try_from(hits)
            .ok()
            .filter(|h| *h <= i64::from(u32::MAX))
            .ok_or_else(|| format!("hits_addend {hits} is too large"))?;
        return Ok(Ask {
            tenant,
            route,
            asked: Asked::Charge(if descriptor.is_negative_hits {
                -amount
            } else {
                amount
            }),
        });
    }
    if descriptor.is_negative_hits {
        return Err(format!(
            "negative hits (returning tokens) are served on a charge only (an entry {} = \"true\")",
            quoted(&settings.charge_key)
        ));
    }
    let cost = match &descriptor.hits_addend {
        // A check that takes nothing has no token bucket answer here.
        Some(hits) if hits.value == 0 => {
            return Err("hits_addend 0 (asking without taking) is not supported".into());
        }
        Some(hits) => u32::try_from(hits.value)
            .map_err(|_| format!("hits_addend {} is too large", hits.value))?,
        None => default_cost,
    };
    Ok(Ask {
        tenant,
        route,
        asked: Asked::Take(NonZeroU32::new(cost).unwrap_or(NonZeroU32::MIN), request),
    })
}

/// Decides every ask (each with a valid tenant), together.
async fn answer(worker: &Worker, asks: &[Ask<'_>]) -> RateLimitResponse {
    let tenants: Vec<&TenantId> = asks.iter().filter_map(|a| a.tenant.as_ref()).collect();
    let (state, limiter) = (&worker.state, &worker.limiter);
    let mut decisions =
        futures_util::future::join_all(asks.iter().zip(&tenants).map(|(a, tenant)| async move {
            let route = &a.route.spec.id;
            match &a.asked {
                Asked::Take(cost, request) => {
                    decide_now(worker, tenant, route, *cost, request.as_deref()).await
                }
                Asked::Charge(amount) => charge_now(state, limiter, tenant, route, *amount).await,
                Asked::Release(request) => release_now(worker, tenant, route, request).await.0,
            }
        }))
        .await;
    // Envoy refuses the whole request when one descriptor is over the
    // limit: the slots the others took go back at once. Else they are
    // held for one lease, or until a release names their request.
    let over = decisions.iter().any(|d| d.refused);
    for decided in &mut decisions {
        if over {
            decided.held = None;
        } else {
            decided.keep_slots_for_lease();
        }
    }
    let requests = &worker.state.requests;
    // A charge or release reports on a request already counted.
    for ((a, tenant), decided) in asks
        .iter()
        .zip(&tenants)
        .zip(&decisions)
        .filter(|((a, _), _)| matches!(a.asked, Asked::Take(..)))
    {
        requests.count(
            Entry::Rls,
            Some(tenant.as_str()),
            a.route.index,
            decided.outcome(),
        );
    }
    // The most restrictive: the refusal with the longest wait, else the
    // fewest requests left.
    let shown = if over {
        decisions
            .iter()
            .filter(|d| d.refused)
            .max_by_key(|d| d.headers.binding().wait)
    } else {
        decisions
            .iter()
            .min_by_key(|d| d.headers.binding().remaining)
    };
    RateLimitResponse {
        overall_code: if over {
            RlsCode::OverLimit
        } else {
            RlsCode::Ok
        } as i32,
        statuses: asks
            .iter()
            .zip(&decisions)
            .map(|(a, d)| status(&a.route.spec.id, d))
            .collect(),
        response_headers_to_add: shown.map_or_else(Vec::new, |d| {
            d.headers
                .iter()
                .filter_map(|(name, value)| {
                    Some(EnvoyHeader {
                        key: name.as_str().to_owned(),
                        value: value.to_str().ok()?.to_owned(),
                        ..Default::default()
                    })
                })
                .collect()
        }),
        ..Default::default()
    }
}

/// One descriptor's status.
fn status(route: &RouteId, decided: &Decided) -> DescriptorStatus {
    let Binding {
        limit,
        remaining,
        wait,
    } = decided.headers.binding();
    DescriptorStatus {
        code: if decided.refused {
            RlsCode::OverLimit
        } else {
            RlsCode::Ok
        } as i32,
        current_limit: limit.map(|limit| {
            let (requests_per_unit, unit) = per_unit(limit);
            RateLimit {
                name: route.as_str().to_owned(),
                requests_per_unit,
                unit: unit as i32,
            }
        }),
        limit_remaining: u32::try_from(remaining).unwrap_or(u32::MAX),
        duration_until_reset: Some(ProtoDuration {
            seconds: i64::try_from(wait).unwrap_or(i64::MAX),
            nanos: 0,
        }),
        ..Default::default()
    }
}

/// A limit in Envoy's terms: a token bucket as its refill per second
/// (rounded, at least 1); a quota as its size per calendar unit, or per
/// second when its window is a number of seconds that is no unit; a
/// concurrency limit as its slots, in no unit.
fn per_unit(limit: GroupLimit) -> (u32, Unit) {
    match limit {
        GroupLimit::Bucket(spec) => {
            // Saturating float-to-int cast of a finite, positive rate.
            (spec.refill_per_second.round().max(1.0) as u32, Unit::Second)
        }
        GroupLimit::Quota { quota, window } => match window {
            Window::Minute => (quota.get(), Unit::Minute),
            Window::Hour => (quota.get(), Unit::Hour),
            Window::Day => (quota.get(), Unit::Day),
            Window::Month => (quota.get(), Unit::Month),
            Window::Seconds(seconds) => {
                let rate = f64::from(quota.get()) / f64::from(seconds.get());
                // Saturating float-to-int cast of a finite, positive rate.
                (rate.round().max(1.0) as u32, Unit::Second)
            }
        },
        // Requests at once: no unit of time says it.
        GroupLimit::Slots { slots, .. } => (slots.get(), Unit::Unknown),
    }
}
