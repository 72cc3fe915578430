//! `/admin/shares`: each region's share of the limits.
//!
//! `GET` shows every region (its default and current global share) and
//! every `region_share` row. `PUT` sets the shares of one scope (global, a
//! tenant, a route, or a tenant's route) for all regions at once, in one
//! transaction; they must name every region, lie in [0.001, 1] and sum to 1.
//! `DELETE` removes a scope's rows (back to the next broader scope). Writes
//! need the bearer token, regions and a database.

use std::collections::{BTreeMap, HashMap};

use actix_web::{HttpRequest, HttpResponse, web};
use serde_json::{Value, json};

use super::error::AdminError;
use super::rules::id;
use super::{AdminState, authorize_read, authorize_write, read_body, refuse};
use crate::db::ShareStore;
use crate::key::{RouteId, TenantId};
use crate::region::model::{SUM_TOLERANCE, check_share};
use crate::region::shares::{Scope, effective};

/// Adds the share routes to an actix `App`.
pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.route("/admin/shares", web::get().to(list))
        .route("/admin/shares", web::put().to(put))
        .route("/admin/shares", web::delete().to(delete));
}

/// Rebalancer decisions `GET /admin/shares` shows.
const RECENT_DECISIONS: i64 = 10;

/// Longest wait for them; the rest of the answer needs no database.
const DECISIONS_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(500);

/// `GET /admin/shares`: every region with its default and global share,
/// every row, and the rebalancer's latest decisions (newest first; `null`
/// without a database or when it does not answer within 500 ms).
async fn list(req: HttpRequest, state: web::Data<AdminState>) -> Result<HttpResponse, AdminError> {
    authorize_read(&req, &state)?;
    let snapshot = state.shares.snapshot();
    let regions: Vec<Value> = state
        .shares
        .regions()
        .map(|all| {
            all.all
                .iter()
                .map(|r| {
                    let global = effective(snapshot.rows(), &r.id, r.default_share, None, None);
                    json!({ "id": r.id, "default_share": r.default_share, "share": global })
                })
                .collect()
        })
        .unwrap_or_default();
    // The rebalancer's latest decisions, when a database holds them; the
    // rest of the answer does not need it.
    let decisions = match state.shares.store() {
        Some(store) => {
            let read = store.decisions(RECENT_DECISIONS);
            match tokio::time::timeout(DECISIONS_TIMEOUT, read).await {
                Ok(Ok(rows)) => Some(rows),
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "Cannot read rebalancer decisions.");
                    None
                }
                Err(_) => {
                    tracing::debug!("Rebalancer decisions did not arrive in time.");
                    None
                }
            }
        }
        None => None,
    };
    Ok(HttpResponse::Ok().json(json!({
        "region": state.region,
        "regions": regions,
        "rows": snapshot.rows(),
        "decisions": decisions,
    })))
}

/// `PUT /admin/shares` with
/// `{"tenant": "…"|null, "route": "…"|null, "shares": {"<region>": 0.7, …}}`.
async fn put(
    req: HttpRequest,
    state: web::Data<AdminState>,
    body: web::Payload,
) -> Result<HttpResponse, AdminError> {
    let store = match writable(&req, &state) {
        Ok(store) => store,
        Err(e) => return Err(refuse(body, e).await),
    };
    let body = read_body(body).await?;
    let value = super::json::parse(&body).map_err(|f| AdminError::invalid(f.field, f.problem))?;
    let object = value.as_object().ok_or_else(|| {
        AdminError::invalid(
            "body",
            "expected {\"tenant\": …, \"route\": …, \"shares\": {…}}",
        )
    })?;
    if let Some(unknown) = object
        .keys()
        .find(|k| !["tenant", "route", "shares"].contains(&k.as_str()))
    {
        return Err(AdminError::invalid(unknown.as_str(), "unknown field"));
    }
    let text = |field: &'static str| -> Result<Option<&str>, AdminError> {
        match object.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(other) => Err(AdminError::invalid(
                field,
                format!("must be a string or null, found {other}"),
            )),
        }
    };
    let scope = Scope {
        tenant: text("tenant")?
            .map(|t| id("tenant", t, TenantId::parse))
            .transpose()?,
        route: text("route")?
            .map(|r| id("route", r, RouteId::parse))
            .transpose()?,
    };
    let shares = parse_shares(object.get("shares"), &state)?;
    store.replace(&[(scope.clone(), shares.clone())]).await?;
    tracing::info!(
        ?scope,
        ?shares,
        "Region shares written through the admin API."
    );
    Ok(HttpResponse::Ok().json(json!({
        "tenant": scope.tenant.as_ref().map(TenantId::as_str),
        "route": scope.route.as_ref().map(RouteId::as_str),
        "shares": shares,
    })))
}

/// `DELETE /admin/shares?tenant=&route=`: 204, or 404 when nothing was set.
async fn delete(
    req: HttpRequest,
    state: web::Data<AdminState>,
    query: web::Query<HashMap<String, String>>,
) -> Result<HttpResponse, AdminError> {
    let store = writable(&req, &state)?;
    let mut scope = Scope {
        tenant: None,
        route: None,
    };
    for (key, value) in query.iter() {
        match key.as_str() {
            "tenant" => scope.tenant = Some(id("tenant", value, TenantId::parse)?),
            "route" => scope.route = Some(id("route", value, RouteId::parse)?),
            other => return Err(AdminError::invalid(other, "unknown query parameter")),
        }
    }
    if store.delete(&scope).await? {
        Ok(HttpResponse::NoContent().finish())
    } else {
        Err(AdminError::NotFound)
    }
}

/// The share store for a write: 409 without a database, then the token check.
fn writable<'a>(req: &HttpRequest, state: &'a AdminState) -> Result<&'a ShareStore, AdminError> {
    authorize_write(req, state, state.shares.store(), AdminError::NoShareStore)
}

/// Validates `{"<region>": share, …}`: every region named once, each share
/// in [`crate::region::model::MIN_SHARE`, 1] ([`check_share`]), summing to 1.
fn parse_shares(
    value: Option<&Value>,
    state: &AdminState,
) -> Result<BTreeMap<String, f64>, AdminError> {
    let regions = state.shares.regions().ok_or(AdminError::NoShareStore)?;
    let object = value.and_then(Value::as_object).ok_or_else(|| {
        AdminError::invalid(
            "shares",
            "expected an object such as {\"eu-west\": 0.7, \"us-east\": 0.3}",
        )
    })?;
    let mut shares = BTreeMap::new();
    for (region, share) in object {
        if regions.get(region).is_none() {
            return Err(AdminError::invalid(
                "shares",
                format!("unknown region {region:?}"),
            ));
        }
        let share = share
            .as_f64()
            .ok_or_else(|| format!("must be a number, found {share}"))
            .and_then(check_share)
            .map_err(|message| AdminError::invalid("shares", format!("{region}: {message}")))?;
        shares.insert(region.clone(), share);
    }
    if let Some(missing) = regions.ids().find(|id| !shares.contains_key(*id)) {
        return Err(AdminError::invalid(
            "shares",
            format!("missing region {missing:?}"),
        ));
    }
    let sum: f64 = shares.values().sum();
    if (sum - 1.0).abs() > SUM_TOLERANCE {
        return Err(AdminError::invalid(
            "shares",
            format!("must sum to 1, found {sum}"),
        ));
    }
    Ok(shares)
}
