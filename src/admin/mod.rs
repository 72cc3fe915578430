//! The admin listener: liveness, readiness, metrics and the rules API.
//!
//! Owns `/live`, `/ready`, `/metrics` and `/admin/rules…` ([`rules`]) on
//! `server.admin_listen`, a port apart from the proxy so operators and
//! scrapers never compete with tenant traffic. Health handlers only read
//! published state (rule snapshot, limiter health); rule writes go to the
//! database, never to the snapshot directly.

pub mod error;
pub mod rules;

use std::sync::Arc;

use actix_web::http::header::ContentType;
use actix_web::{HttpResponse, web};
use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::json;

use crate::bucket::LimiterCore;
use crate::clock::unix_now_seconds;
use crate::rules::RulesHandle;

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
    /// Bearer token for writes; `None` disables writes.
    pub token: Option<String>,
}

/// Adds the admin routes to an actix `App`.
pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.route("/live", web::get().to(live))
        .route("/ready", web::get().to(ready))
        .route("/metrics", web::get().to(metrics))
        .configure(rules::configure);
}

/// 200 whenever the process serves HTTP.
async fn live() -> HttpResponse {
    HttpResponse::Ok()
        .content_type(ContentType::plaintext())
        .body("ok\n")
}

/// Readiness and the state an operator needs at a glance.
async fn ready(state: web::Data<AdminState>) -> HttpResponse {
    let rules = state.rules.snapshot();
    let origin = rules.origin();
    HttpResponse::Ok().json(json!({
        "status": "ready",
        "instance": state.instance_id,
        "region": state.region,
        "redis": state.limiter.redis_state().as_str(),
        "breaker": state.limiter.breaker_state().map(|b| b.as_str()),
        "live_instances": state.limiter.instances().get(),
        "rules": {
            "count": rules.len(),
            "store": if state.rules.store().is_some() { "database" } else { "file" },
            "source": origin.source,
            "loaded_at_unix": origin.loaded_at_unix,
            "age_seconds": unix_now_seconds().saturating_sub(origin.loaded_at_unix),
        },
    }))
}

/// Prometheus text exposition.
async fn metrics(state: web::Data<AdminState>) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4; charset=utf-8")
        .body(state.prometheus.render())
}
