//! The HTTP check endpoint (`check.listen`): a decision and nothing
//! forwarded, for gateways that ask before they proxy.
//!
//! Owns two forms of the same question, and the calls that follow one:
//! - `POST /v1/check`, JSON `{"tenant", "route", "cost", "request_id"}`
//!   (cost defaults to 1; request_id optional): 200 when allowed, 429
//!   when refused, a JSON body with the numbers and the rate-limit headers
//!   either way. A concurrency slot it takes is held for one lease
//!   (`limits.slot_lease_ms`), or until `POST /v1/release` names its
//!   request_id;
//! - `POST /v1/release`, JSON `{"tenant", "route", "request_id"}`: gives
//!   back the slots that request holds; 200 with `{"released": true}`
//!   when the limits in force hold a concurrency limit (whether or not
//!   the request still held its slot), else `false`;
//! - `POST /v1/charge`, the same JSON with a required cost: usage
//!   reported after the fact, taken whatever the limits hold (they may go
//!   into debt; a negative cost gives tokens back); always 200, the same
//!   body and headers saying what is left;
//! - `/v1/auth`, any method, for subrequests (nginx `auth_request`,
//!   Traefik `forwardAuth`): the tenant from `X-Api-Key` (checked as the
//!   proxy checks it), the route from `X-Tollgate-Route`, the cost from
//!   `X-Tollgate-Cost` (default 1); 200 when allowed, `check.refused_status`
//!   (403, what nginx understands; 429 for Traefik) when refused, with
//!   `Retry-After` and the RateLimit fields as headers for the gateway to
//!   copy. A missing or malformed key answers 401 (nginx passes 401 on,
//!   and turns anything but 2xx/401/403 into a 500), so that the refused
//!   status means only "over the limit".
//!
//! Malformed requests take nothing: every input is checked before the
//! decision.

use std::num::NonZeroU32;

use hyper::body::Incoming;
use hyper::header::{CACHE_CONTROL, HeaderName, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use serde::Deserialize;

use super::{identify_counted, request_id};
use crate::json_body;
use crate::key::TenantId;
use crate::proxy::Worker;
use crate::proxy::body::{ProxyBody, SmallBodyError, read_small};
use crate::proxy::client::Client;
use crate::proxy::decide::{Decided, charge_now, decide_now, release_now};
use crate::proxy::early;
use crate::proxy::error::{error_response, json_response};
use crate::proxy::route::Route;
use crate::proxy::route::quoted;
use crate::telemetry::Entry;

/// `X-Tollgate-Route`: the route a subrequest asks about.
const ROUTE_HEADER: HeaderName = HeaderName::from_static("x-tollgate-route");
/// `X-Tollgate-Cost`: the tokens a subrequest asks for.
const COST_HEADER: HeaderName = HeaderName::from_static("x-tollgate-cost");
/// Largest `POST /v1/check` body.
const MAX_BODY: usize = 16 * 1024;

/// Answers one request on the check listener from `client`; a body it
/// does not read is settled as [`early`] says, marking the connection to
/// linger when it must close.
pub(super) async fn handle(
    req: Request<Incoming>,
    client: &Client,
    worker: &Worker,
) -> Response<ProxyBody> {
    let linger = &client.linger;
    let response = match (req.method(), req.uri().path()) {
        (_, "/v1/auth") => auth(&req, worker).await,
        (&Method::POST, "/v1/check") => return check(req, client, worker).await,
        (&Method::POST, "/v1/charge") => return charge(req, client, worker).await,
        (&Method::POST, "/v1/release") => return release(req, client, worker).await,
        (_, "/v1/check") => invalid(StatusCode::METHOD_NOT_ALLOWED, "POST /v1/check"),
        (_, "/v1/charge") => invalid(StatusCode::METHOD_NOT_ALLOWED, "POST /v1/charge"),
        (_, "/v1/release") => invalid(StatusCode::METHOD_NOT_ALLOWED, "POST /v1/release"),
        _ => invalid(
            StatusCode::NOT_FOUND,
            "served here: POST /v1/check, POST /v1/charge, POST /v1/release, /v1/auth",
        ),
    };
    early::answer(req, response, linger).await
}

/// The body of a decision's answer.
#[derive(serde::Serialize)]
struct Answer {
    /// Whether the request may go on (shadowed refusals included).
    allowed: bool,
    /// Refused by limits in shadow mode only.
    shadowed: bool,
    /// The binding limit's size.
    limit: u64,
    /// Requests it has left.
    remaining: u64,
    /// Seconds until a refused request could pass.
    retry_after_seconds: u64,
    /// Which limiter decided.
    source: &'static str,
}

/// An answer to a request the check listener cannot take.
fn invalid(status: StatusCode, message: &str) -> Response<ProxyBody> {
    error_response(status, "invalid_request", message)
}

/// A cost of at least 1.
fn cost(raw: i128) -> Result<NonZeroU32, String> {
    u32::try_from(raw)
        .ok()
        .and_then(NonZeroU32::new)
        .ok_or_else(|| format!("cost must be between 1 and {}, found {raw}", u32::MAX))
}

/// `/v1/auth`.
async fn auth(req: &Request<Incoming>, worker: &Worker) -> Response<ProxyBody> {
    let state = &*worker.state;
    // One value each: a front proxy that appends its header to the
    // client's must not let the client's copy decide.
    let header = |name: &HeaderName| {
        let mut values = req.headers().get_all(name).iter();
        match (values.next(), values.next()) {
            (Some(value), None) => value.to_str().map(Some).map_err(|_| ()),
            (None, _) => Ok(None),
            (Some(_), Some(_)) => Err(()),
        }
    };
    let (Ok(route_id), Ok(cost_header)) = (header(&ROUTE_HEADER), header(&COST_HEADER)) else {
        return invalid(
            StatusCode::BAD_REQUEST,
            "X-Tollgate-Route and X-Tollgate-Cost may each appear once, as text",
        );
    };
    let Some(route_id) = route_id else {
        return invalid(
            StatusCode::BAD_REQUEST,
            "the X-Tollgate-Route header is required",
        );
    };
    let route = match worker.state.routes.named(route_id) {
        Ok(route) => route,
        Err(message) => return invalid(StatusCode::BAD_REQUEST, &message),
    };
    let cost = match cost_header.map(|c| c.trim().parse::<u64>()) {
        None => NonZeroU32::MIN,
        Some(Ok(raw)) => match cost(i128::from(raw)) {
            Ok(cost) => cost,
            Err(message) => return invalid(StatusCode::BAD_REQUEST, &message),
        },
        Some(Err(_)) => {
            return invalid(
                StatusCode::BAD_REQUEST,
                "X-Tollgate-Cost must be a whole number",
            );
        }
    };
    let tenant = match identify_counted(req.headers(), state, Entry::Check, route.index) {
        Ok(tenant) => tenant,
        Err(e) => {
            let mut response = e.response();
            *response.status_mut() = StatusCode::UNAUTHORIZED;
            return response;
        }
    };
    let mut decided = decide_now(worker, &tenant, &route.spec.id, cost, None).await;
    decided.keep_slots_for_lease();
    state.requests.count(
        Entry::Check,
        Some(tenant.as_str()),
        route.index,
        decided.outcome(),
    );
    let mut response = Response::new(ProxyBody::Whole(None));
    if decided.refused {
        let refused = state.check.map_or(403, |c| c.refused_status);
        *response.status_mut() = StatusCode::from_u16(refused).unwrap_or(StatusCode::FORBIDDEN);
    }
    decided.headers.apply(response.headers_mut());
    response
        .headers_mut()
        .insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// The body of `POST /v1/check`, `POST /v1/charge` and `POST
/// /v1/release`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CheckRequest {
    /// The API key to limit.
    tenant: String,
    /// A configured route id.
    route: String,
    /// Tokens to take (a check: default 1), or to charge (a charge:
    /// required; negative gives tokens back).
    #[serde(default)]
    cost: Option<i64>,
    /// The request a check asks for, named so that a release can give
    /// back its concurrency slots (required for a release).
    #[serde(default)]
    request_id: Option<String>,
}

impl CheckRequest {
    /// The fields above, named to a client whose body has a stray one.
    const FIELDS: [&'static str; 4] = ["tenant", "route", "cost", "request_id"];
}

/// A question of `POST /v1/check`, `/v1/charge` or `/v1/release`,
/// checked.
struct Question<'a> {
    /// Whose limit.
    tenant: TenantId,
    /// On which configured route.
    route: &'a Route,
    /// The cost as sent.
    cost: Option<i64>,
    /// The request's name, as sent.
    request_id: Option<String>,
}

/// Reads and checks the JSON body of `req` from `client`; the answer to
/// send instead when it is not a valid question.
async fn question<'a>(
    req: Request<Incoming>,
    client: &Client,
    worker: &'a Worker,
) -> Result<Question<'a>, Response<ProxyBody>> {
    let linger = &client.linger;
    let timeout = worker.forwarder.read_timeout();
    let body = match read_small(req.into_body(), MAX_BODY, timeout, &client.budget).await {
        Ok(body) => body,
        Err(SmallBodyError::TooLarge) => {
            let message = format!("the body is larger than {MAX_BODY} bytes");
            let mut response = invalid(StatusCode::PAYLOAD_TOO_LARGE, &message);
            // The rest of the body is still coming.
            early::close(&mut response, linger);
            return Err(response);
        }
        Err(SmallBodyError::Broken) => {
            return Err(invalid(StatusCode::BAD_REQUEST, "the body broke off"));
        }
        Err(SmallBodyError::TimedOut) => {
            let mut response = invalid(
                StatusCode::REQUEST_TIMEOUT,
                "the body did not arrive in time",
            );
            early::close(&mut response, linger);
            return Err(response);
        }
    };
    let asked: CheckRequest = json_body::read_fields(&body, &CheckRequest::FIELDS)
        .map_err(|fault| invalid(StatusCode::BAD_REQUEST, &fault.to_string()))?;
    let tenant = TenantId::parse(&asked.tenant).map_err(|e| {
        let message = format!("tenant {}: {e}", quoted(&asked.tenant));
        invalid(StatusCode::BAD_REQUEST, &message)
    })?;
    let route = worker
        .state
        .routes
        .named(&asked.route)
        .map_err(|message| invalid(StatusCode::BAD_REQUEST, &format!("route: {message}")))?;
    if let Some(id) = &asked.request_id {
        request_id("request_id", id).map_err(|m| invalid(StatusCode::BAD_REQUEST, &m))?;
    }
    Ok(Question {
        tenant,
        route,
        cost: asked.cost,
        request_id: asked.request_id,
    })
}

/// `POST /v1/check` from `client`.
async fn check(req: Request<Incoming>, client: &Client, worker: &Worker) -> Response<ProxyBody> {
    let asked = match question(req, client, worker).await {
        Ok(asked) => asked,
        Err(response) => return response,
    };
    let cost = match cost(i128::from(asked.cost.unwrap_or(1))) {
        Ok(cost) => cost,
        Err(message) => return invalid(StatusCode::BAD_REQUEST, &message),
    };
    let route = &asked.route.spec.id;
    let mut decided = decide_now(
        worker,
        &asked.tenant,
        route,
        cost,
        asked.request_id.as_deref(),
    )
    .await;
    decided.keep_slots_for_lease();
    let state = &*worker.state;
    state.requests.count(
        Entry::Check,
        Some(asked.tenant.as_str()),
        asked.route.index,
        decided.outcome(),
    );
    answer(decided)
}

/// `POST /v1/charge` from `client`: usage reported after the fact,
/// charged whatever the limits hold (a negative cost gives tokens back,
/// never above a limit's size); always 200, with what is left.
async fn charge(req: Request<Incoming>, client: &Client, worker: &Worker) -> Response<ProxyBody> {
    let asked = match question(req, client, worker).await {
        Ok(asked) => asked,
        Err(response) => return response,
    };
    let bound = i64::from(u32::MAX);
    let amount = match asked.cost {
        Some(amount) if (-bound..=bound).contains(&amount) => amount,
        Some(amount) => {
            let message = format!("cost must be between -{bound} and {bound}, found {amount}");
            return invalid(StatusCode::BAD_REQUEST, &message);
        }
        None => return invalid(StatusCode::BAD_REQUEST, "cost is required for a charge"),
    };
    let (state, limiter) = (&worker.state, &worker.limiter);
    answer(charge_now(state, limiter, &asked.tenant, &asked.route.spec.id, amount).await)
}

/// `POST /v1/release` from `client`: the named request's concurrency
/// slots given back.
async fn release(req: Request<Incoming>, client: &Client, worker: &Worker) -> Response<ProxyBody> {
    let asked = match question(req, client, worker).await {
        Ok(asked) => asked,
        Err(response) => return response,
    };
    let Some(request) = asked.request_id.as_deref() else {
        return invalid(
            StatusCode::BAD_REQUEST,
            "request_id is required for a release",
        );
    };
    if asked.cost.is_some() {
        return invalid(StatusCode::BAD_REQUEST, "a release takes no cost");
    }
    let (_, released) = release_now(worker, &asked.tenant, &asked.route.spec.id, request).await;
    json_response(StatusCode::OK, &serde_json::json!({ "released": released }))
}

/// The answer to a question that `decided`.
fn answer(decided: Decided) -> Response<ProxyBody> {
    let binding = decided.headers.binding();
    let status = if decided.refused {
        StatusCode::TOO_MANY_REQUESTS
    } else {
        StatusCode::OK
    };
    let mut response = json_response(
        status,
        &Answer {
            allowed: !decided.refused,
            shadowed: decided.shadowed,
            limit: binding.limit.map_or(0, |l| l.size()),
            remaining: binding.remaining,
            retry_after_seconds: binding.wait,
            source: decided.source.label(),
        },
    );
    decided.headers.apply(response.headers_mut());
    response
}
