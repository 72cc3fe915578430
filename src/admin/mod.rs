//! The admin listener: liveness, readiness, metrics and the rules API.
//!
//! Owns `/live`, `/ready`, `/metrics` and `/admin/rules…` ([`rules`]) on
//! `server.admin_listen`, a port apart from the proxy so operators and
//! scrapers never compete with tenant traffic. `/live`, `/ready` and
//! `/metrics` are open and carry no secret (no tenant id, no credential);
//! everything under `/admin/` needs a bearer token. Health handlers only read
//! published state (rule snapshot, limiter health); rule writes go to the
//! database, never to the snapshot directly.

pub mod error;
mod json;
pub mod rules;
pub mod shares;

use std::sync::Arc;

use actix_web::http::header::{AUTHORIZATION, ContentType};
use actix_web::{HttpRequest, HttpResponse, web};
use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::json;

use crate::bucket::{LimiterCore, RedisState, WarmWorkers};
use crate::clock::unix_now_seconds;
use crate::key::RouteId;
use crate::redis_client::{Mode, Topology};
use crate::region::shares::SharesHandle;
use crate::rules::RulesHandle;
use error::AdminError;

/// What the admin endpoints read.
pub struct AdminState {
    /// Renders `/metrics`.
    pub prometheus: PrometheusHandle,
    /// Rules in force.
    pub rules: RulesHandle,
    /// Redis health and instance count.
    pub limiter: Arc<LimiterCore>,
    /// This instance's id.
    pub instance_id: String,
    /// This instance's region, if any.
    pub region: Option<String>,
    /// Bearer token for writes and reads; `None` disables writes.
    pub token: Option<String>,
    /// Bearer token for reads only.
    pub read_token: Option<String>,
    /// Region shares.
    pub shares: SharesHandle,
    /// Proxy workers whose Redis connection is warm; `None` without Redis.
    pub warm: Option<Arc<WarmWorkers>>,
    /// The configured route ids: a rule written here must name one.
    pub routes: Vec<RouteId>,
}

/// Admits an admin write to `store`: without one, `missing` (a 409 saying
/// where the data comes from, whatever the token); then the bearer token.
///
/// # Errors
/// `missing` without a store, [`AdminError::WritesDisabled`] without a
/// configured token, [`AdminError::Unauthorized`] when the request's token
/// is missing or wrong.
fn authorize_write<'a, T>(
    req: &HttpRequest,
    state: &AdminState,
    store: Option<&'a T>,
    missing: AdminError,
) -> Result<&'a T, AdminError> {
    let store = store.ok_or(missing)?;
    let token = state.token.as_deref().ok_or(AdminError::WritesDisabled)?;
    if presents(credentials(req)?, token) {
        Ok(store)
    } else {
        Err(AdminError::Unauthorized)
    }
}

/// Admits an admin read: it needs `admin.token` or `admin.read_token`
/// (tenant ids are API keys, so the rules are as secret as the keys).
///
/// # Errors
/// [`AdminError::ReadsDisabled`] when neither token is configured,
/// [`AdminError::Unauthorized`] when the request presents neither.
fn authorize_read(req: &HttpRequest, state: &AdminState) -> Result<(), AdminError> {
    let mut tokens = [state.token.as_deref(), state.read_token.as_deref()]
        .into_iter()
        .flatten()
        .peekable();
    if tokens.peek().is_none() {
        return Err(AdminError::ReadsDisabled);
    }
    let presented = credentials(req)?;
    // Compare with every token, so the time taken does not tell which.
    let matched = tokens.fold(false, |ok, token| presents(presented, token) | ok);
    if matched {
        Ok(())
    } else {
        Err(AdminError::Unauthorized)
    }
}

/// The credentials of `req`'s `Authorization: Bearer <token>`, if it has
/// one.
///
/// # Errors
/// [`AdminError::Invalid`] (field `authorization`) when the header comes
/// more than once: which copy counts would be a guess, and a proxy that
/// appends its own would decide it.
fn credentials(req: &HttpRequest) -> Result<Option<&str>, AdminError> {
    let mut all = req.headers().get_all(AUTHORIZATION);
    let first = all.next();
    if all.next().is_some() {
        return Err(AdminError::invalid(
            "authorization",
            "the header came more than once; send exactly one",
        ));
    }
    Ok(first
        .and_then(|v| v.to_str().ok())
        .and_then(bearer)
        .map(str::trim))
}

/// Whether `presented` credentials are `token` (compared in constant
/// time).
fn presents(presented: Option<&str>, token: &str) -> bool {
    presented.is_some_and(|presented| constant_time_eq(presented.as_bytes(), token.as_bytes()))
}

/// Reads a request body of at most [`MAX_BODY_BYTES`] (the 64 KiB that
/// [`AdminError::TooLarge`] names).
///
/// # Errors
/// [`AdminError::TooLarge`] when it is longer, [`AdminError::Invalid`]
/// (field `body`) when the client's stream breaks off.
async fn read_body(payload: web::Payload) -> Result<web::Bytes, AdminError> {
    match payload.to_bytes_limited(MAX_BODY_BYTES).await {
        Ok(Ok(body)) => Ok(body),
        Ok(Err(_)) => Err(AdminError::invalid("body", "the body could not be read")),
        Err(_) => Err(AdminError::TooLarge),
    }
}

/// How long a refused write's body may take to arrive.
const REFUSED_BODY_DEADLINE: std::time::Duration = std::time::Duration::from_millis(500);

/// `error`, once the refused write's body (at most [`MAX_BODY_BYTES`],
/// within half a second) has been read and thrown away: the client's
/// kept-alive connection then serves its next request. A longer or slower
/// body is left, and the connection closes after the answer.
async fn refuse(payload: web::Payload, error: AdminError) -> AdminError {
    let _ = tokio::time::timeout(
        REFUSED_BODY_DEADLINE,
        payload.to_bytes_limited(MAX_BODY_BYTES),
    )
    .await;
    error
}

/// The credentials of a `Bearer` authorization (scheme case-insensitive).
fn bearer(value: &str) -> Option<&str> {
    let (scheme, credentials) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then_some(credentials)
}

/// Compares two secrets in time that depends only on the longer length.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = u8::from(a.len() != b.len());
    for i in 0..a.len().max(b.len()) {
        diff |= a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0);
    }
    diff == 0
}

/// Largest admin request body accepted.
const MAX_BODY_BYTES: usize = 64 * 1024;

/// Adds the admin routes to an actix `App`. Malformed query strings and
/// paths get the same JSON error, naming the part, as invalid fields.
pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.app_data(web::QueryConfig::default().error_handler(|_, _| {
        AdminError::invalid("query", "expected key=value pairs, percent-encoded").into()
    }))
    .app_data(web::PathConfig::default().error_handler(|_, _| {
        AdminError::invalid("path", "expected percent-encoded UTF-8 segments").into()
    }))
    .route("/live", web::get().to(live))
    .route("/ready", web::get().to(ready))
    .route("/metrics", web::get().to(metrics))
    .configure(rules::configure)
    .configure(shares::configure);
}

/// 200 whenever the process serves HTTP.
async fn live() -> HttpResponse {
    HttpResponse::Ok()
        .content_type(ContentType::plaintext())
        .body("ok\n")
}

/// Readiness and the state an operator needs at a glance: 200 once every
/// proxy worker's Redis connection is open with the script loaded (or
/// Redis is known to be down, and requests are decided locally), 503
/// `starting` before.
async fn ready(state: web::Data<AdminState>) -> HttpResponse {
    let rules = state.rules.snapshot();
    let origin = rules.origin();
    let redis = state.limiter.redis_state();
    let warm = state.warm.as_deref();
    let ready = is_ready(redis, warm);
    let mut answer = if ready {
        HttpResponse::Ok()
    } else {
        HttpResponse::ServiceUnavailable()
    };
    answer.json(json!({
        "status": if ready { "ready" } else { "starting" },
        "redis_workers_warm": warm.map(WarmWorkers::warm),
        "instance": state.instance_id,
        "region": state.region,
        "redis": redis.as_str(),
        "breaker": state.limiter.breaker_state().map(|b| b.as_str()),
        "redis_topology": state.limiter.topology().map(|t| topology(t)),
        "redis_failures": state.limiter.redis_failures(),
        "live_instances": state.limiter.instances().get(),
        "rules": {
            "count": rules.len(),
            "store": if state.rules.store().is_some() { "database" } else { "file" },
            "source": origin.source,
            "loaded_at_unix": origin.loaded_at_unix,
            "age_seconds": unix_now_seconds().saturating_sub(origin.loaded_at_unix),
            "reloads": state.rules.applied_reloads(),
            "failed_reloads": state.rules.failed_reloads(),
        },
    }))
}

/// Redis's layout without secrets: the mode, each primary with its
/// breaker (and its slot count on a Cluster), and the failovers followed.
fn topology(t: &Topology) -> serde_json::Value {
    let layout = t.layout();
    let cluster = t.mode() == Mode::Cluster;
    let primaries: Vec<serde_json::Value> = layout
        .shards
        .iter()
        .map(|shard| {
            let mut node = json!({
                "address": shard.addr.to_string(),
                "breaker": shard.gate.state().as_str(),
            });
            if cluster {
                node["slots"] = shard.slots.into();
            }
            node
        })
        .collect();
    json!({
        "mode": t.mode().as_str(),
        "primaries": primaries,
        "failovers": t.failovers(),
        "last_failover_unix": t.last_failover_unix(),
    })
}

/// Whether the gateway is ready: without Redis at once; with Redis once
/// every worker's connection is warm, or once some of Redis is known to
/// be down (requests for it are then decided locally, which is the best
/// it can do).
fn is_ready(redis: RedisState, warm: Option<&WarmWorkers>) -> bool {
    matches!(redis, RedisState::Down | RedisState::Partial)
        || warm.is_none_or(WarmWorkers::all_warm)
}

/// Prometheus text exposition.
async fn metrics(state: web::Data<AdminState>) -> HttpResponse {
    crate::telemetry::sample_process();
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4; charset=utf-8")
        .body(state.prometheus.render())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_means_warm_workers_or_a_redis_known_down() {
        let cold = WarmWorkers::new(2);
        assert!(!is_ready(RedisState::Up, Some(&cold)), "starting");
        assert!(is_ready(RedisState::Down, Some(&cold)), "serving locally");
        assert!(is_ready(RedisState::Partial, Some(&cold)), "a node down");
        assert!(is_ready(RedisState::Disabled, None));
        assert!(is_ready(RedisState::Up, Some(&WarmWorkers::new(0))));
    }

    #[test]
    fn tokens_compare_equal_only_when_identical() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"x"));
    }
}
