//! `/admin/rules`: read and change per-tenant rules.
//!
//! Reads need `Authorization: Bearer` with `admin.token` or
//! `admin.read_token`; writes need `admin.token` (compared in constant
//! time) and are refused when it is empty. Writes go to PostgreSQL in one
//! transaction and answer with what the database now holds; the table's
//! trigger then announces the change to every gateway. In file mode the
//! rules can be read here, and writes answer 409.

use std::collections::HashMap;

use actix_web::{HttpRequest, HttpResponse, web};
use serde_json::{Value, json};

use super::error::AdminError;
use super::{AdminState, authorize_read, authorize_write, read_body, refuse};
use crate::config::unknown_route;
use crate::db::{RuleStore, StoredRule};
use crate::json_body;
use crate::key::{RouteId, TenantId, tenant_label};
use crate::rules::model::Rule;
use crate::rules::spec::RuleSpec;

/// Page size when `limit` is not given.
const DEFAULT_PAGE: u32 = 100;
/// Largest accepted `limit`.
const MAX_PAGE: u32 = 1000;

/// Adds the rule routes to an actix `App`.
pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.route("/admin/rules", web::get().to(list))
        .route("/admin/rules/{tenant}/{route}", web::get().to(get_one))
        .route("/admin/rules/{tenant}/{route}", web::put().to(put))
        .route("/admin/rules/{tenant}/{route}", web::delete().to(delete));
}

/// `GET /admin/rules?tenant=&after=<tenant>/<route>&limit=`: one page of
/// rules ordered by (tenant, route), and the cursor of the next page.
async fn list(
    req: HttpRequest,
    state: web::Data<AdminState>,
    query: web::Query<HashMap<String, String>>,
) -> Result<HttpResponse, AdminError> {
    authorize_read(&req, &state)?;
    let mut tenant = None;
    let mut after = None;
    let mut limit = DEFAULT_PAGE;
    for (key, value) in query.iter() {
        match key.as_str() {
            "tenant" => tenant = Some(id::<TenantId>("tenant", value, TenantId::parse)?),
            "after" => {
                let (t, r) = value
                    .split_once('/')
                    .ok_or_else(|| AdminError::invalid("after", "expected <tenant>/<route>"))?;
                after = Some((
                    id("after", t, TenantId::parse)?,
                    id("after", r, RouteId::parse_scope)?,
                ));
            }
            "limit" => {
                limit = value
                    .parse()
                    .ok()
                    .filter(|n| (1..=MAX_PAGE).contains(n))
                    .ok_or_else(|| {
                        AdminError::invalid("limit", format!("must be between 1 and {MAX_PAGE}"))
                    })?;
            }
            other => return Err(AdminError::invalid(other, "unknown query parameter")),
        }
    }
    let after_ref = after.as_ref().map(|(t, r)| (t, r));
    let mut rules = match state.rules.store() {
        Some(store) => store.list(tenant.as_ref(), after_ref, limit + 1).await?,
        None => page_from_snapshot(&state, tenant.as_ref(), after_ref, limit + 1),
    };
    let next_after = if rules.len() > limit as usize {
        rules.truncate(limit as usize);
        rules.last().map(|r| format!("{}/{}", r.tenant, r.route))
    } else {
        None
    };
    Ok(HttpResponse::Ok().json(json!({ "rules": rules, "next_after": next_after })))
}

/// A page of the rules in force, for file mode.
fn page_from_snapshot(
    state: &AdminState,
    tenant: Option<&TenantId>,
    after: Option<(&TenantId, &RouteId)>,
    limit: u32,
) -> Vec<StoredRule> {
    let snapshot = state.rules.snapshot();
    let mut rules: Vec<_> = snapshot
        .rules()
        .filter(|r| tenant.is_none_or(|t| &r.tenant == t))
        .filter(|r| after.is_none_or(|(t, rt)| (&r.tenant, &r.route) > (t, rt)))
        .collect();
    rules.sort_by(|a, b| (&a.tenant, &a.route).cmp(&(&b.tenant, &b.route)));
    rules
        .into_iter()
        .take(limit as usize)
        .map(|r| StoredRule::in_force(&r))
        .collect()
}

/// `GET /admin/rules/{tenant}/{route}`.
async fn get_one(
    req: HttpRequest,
    state: web::Data<AdminState>,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, AdminError> {
    authorize_read(&req, &state)?;
    let (tenant, route) = ids(&path)?;
    let rule = match state.rules.store() {
        Some(store) => store.get(&tenant, &route).await?,
        None => state
            .rules
            .snapshot()
            .find(&tenant, &route)
            .map(|rule| StoredRule::in_force(&rule)),
    };
    rule.map(|r| HttpResponse::Ok().json(r))
        .ok_or(AdminError::NotFound)
}

/// `PUT /admin/rules/{tenant}/{route}` with `{"capacity":…,"refill_per_second":…}`:
/// 201 when created, 200 when replaced, with the stored row.
async fn put(
    req: HttpRequest,
    state: web::Data<AdminState>,
    path: web::Path<(String, String)>,
    body: web::Payload,
) -> Result<HttpResponse, AdminError> {
    let store = match writable(&req, &state) {
        Ok(store) => store,
        Err(e) => return Err(refuse(body, e).await),
    };
    let rule = parse_rule(&path.0, &path.1, &read_body(body).await?)?;
    if let Some(why) =
        unknown_route(&state.routes, rule.route.as_str()).filter(|_| !rule.route.is_all())
    {
        return Err(AdminError::invalid("route", why));
    }
    if let Some(problem) = state.rules.snapshot().conflict(&rule) {
        return Err(AdminError::invalid(problem.field, problem.message));
    }
    let (row, created) = store.put(&rule).await?;
    tracing::info!(
        tenant = %tenant_label(rule.tenant.as_str(), rule.name.as_ref()),
        route = %rule.route,
        created,
        "Rule written through the admin API."
    );
    Ok(if created {
        HttpResponse::Created().json(row)
    } else {
        HttpResponse::Ok().json(row)
    })
}

/// `DELETE /admin/rules/{tenant}/{route}`: 204, or 404 when there was none.
async fn delete(
    req: HttpRequest,
    state: web::Data<AdminState>,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, AdminError> {
    let store = writable(&req, &state)?;
    let (tenant, route) = ids(&path)?;
    let name = state
        .rules
        .snapshot()
        .find(&tenant, &route)
        .and_then(|rule| rule.name);
    if store.delete(&tenant, &route).await? {
        tracing::info!(
            tenant = %tenant_label(tenant.as_str(), name.as_ref()),
            route = %route,
            "Rule deleted through the admin API."
        );
        Ok(HttpResponse::NoContent().finish())
    } else {
        Err(AdminError::NotFound)
    }
}

/// The rule store for a write: 409 in file mode, then the token check.
fn writable<'a>(req: &HttpRequest, state: &'a AdminState) -> Result<&'a RuleStore, AdminError> {
    authorize_write(req, state, state.rules.store(), AdminError::FileMode)
}

/// Validates an id from the path or query.
pub(super) fn id<T>(
    field: &str,
    raw: &str,
    parse: fn(&str) -> Result<T, crate::key::IdError>,
) -> Result<T, AdminError> {
    parse(raw).map_err(|e| AdminError::invalid(field, format!("{raw:?} {e}")))
}

/// The (tenant, route) pair of a rule path.
fn ids(path: &(String, String)) -> Result<(TenantId, RouteId), AdminError> {
    Ok((
        id("tenant", &path.0, TenantId::parse)?,
        id("route", &path.1, RouteId::parse_scope)?,
    ))
}

/// The rule of `tenant` on `route` that a PUT body such as
/// `{"capacity":…,"refill_per_second":…}` states, naming the first bad
/// field: the body is a [`RuleSpec`] without `tenant` and `route` (the
/// path names them), read as every source reads one and checked by the
/// one rule validation, [`RuleSpec::validate`].
fn parse_rule(tenant: &str, route: &str, body: &[u8]) -> Result<Rule, AdminError> {
    let example = "expected a JSON object such as {\"capacity\": 200, \"refill_per_second\": 100} \
                   (optional: \"limits\": [{\"quota\": 10000, \"window\": \"day\"}], \"shards\": 1..64, \"exact\": true|false, \"mode\": \"enforce\"|\"shadow\", \"name\": \"Acme\")";
    let value = super::json::parse(body)
        .map_err(|f| AdminError::invalid(f.field, format!("{}; {example}", f.problem)))?;
    let Value::Object(mut fields) = value else {
        return Err(AdminError::invalid("body", example));
    };
    for (field, value) in [("tenant", tenant), ("route", route)] {
        if fields.insert(field.to_owned(), value.into()).is_some() {
            return Err(AdminError::invalid(
                field,
                "is named by the path /admin/rules/{tenant}/{route}, not by the body",
            ));
        }
    }
    let spec: RuleSpec = json_body::from_value(Value::Object(fields))
        .map_err(|f| AdminError::invalid(f.field, f.problem))?;
    spec.validate().map_err(|problems| {
        // validate() reports at least one problem whenever it fails.
        problems.into_iter().next().map_or_else(
            || AdminError::invalid("body", "invalid rule"),
            |p| AdminError::invalid(p.field, p.message),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rule `body` declares for tenant `acme` on `route`.
    fn acme(route: &str, body: &str) -> Rule {
        parse_rule("acme", route, body.as_bytes()).unwrap()
    }

    fn field_of(body: &str) -> String {
        match parse_rule("t", "r", body.as_bytes()) {
            Err(AdminError::Invalid { field, .. }) => field,
            other => panic!("{body}: {other:?}"),
        }
    }

    #[test]
    fn a_valid_body_parses() {
        let rule = acme(
            "api",
            r#"{"capacity": 200, "refill_per_second": 100, "mode": "shadow", "name": "Acme"}"#,
        );
        assert_eq!(rule.limit.mode, crate::rules::model::Mode::Shadow);
        assert_eq!(
            (
                rule.limit.capacity.get(),
                rule.limit.refill_per_second.get()
            ),
            (200, 100)
        );
        assert_eq!(rule.name.unwrap().as_str(), "Acme");
    }

    #[test]
    fn each_bad_body_names_its_field() {
        assert_eq!(field_of("nope"), "body");
        assert_eq!(field_of("[1]"), "body");
        assert_eq!(field_of(r#"{"refill_per_second": 1}"#), "capacity");
        assert_eq!(
            field_of(r#"{"capacity": 0, "refill_per_second": 1}"#),
            "capacity"
        );
        assert_eq!(
            field_of(r#"{"capacity": -5, "refill_per_second": 1}"#),
            "capacity"
        );
        assert_eq!(
            field_of(r#"{"capacity": 2.5, "refill_per_second": 1}"#),
            "capacity"
        );
        assert_eq!(
            field_of(r#"{"capacity": "5", "refill_per_second": 1}"#),
            "capacity"
        );
        assert_eq!(
            field_of(r#"{"capacity": 5, "refill_per_second": 2147483648}"#),
            "refill_per_second"
        );
        assert_eq!(
            field_of(r#"{"capacity": 5, "refill_per_second": 1, "burst": 3}"#),
            "burst"
        );
        assert_eq!(
            field_of(r#"{"capacity": 5, "refill_per_second": 1, "name": "_x"}"#),
            "name"
        );
        assert_eq!(
            field_of(r#"{"capacity": 5, "refill_per_second": 1, "name": 7}"#),
            "name"
        );
        for mode in [r#""dry-run""#, "true"] {
            assert_eq!(
                field_of(&format!(
                    r#"{{"capacity": 5, "refill_per_second": 1, "mode": {mode}}}"#
                )),
                "mode"
            );
        }
        assert!(matches!(
            parse_rule("{x}", "r", br#"{"capacity": 5, "refill_per_second": 1}"#),
            Err(AdminError::Invalid { field, .. }) if field == "tenant"
        ));
        assert_eq!(field_of(r#"{"limits": 3}"#), "limits");
        assert_eq!(
            field_of(r#"{"limits": [{"quota": 5, "every": "day"}]}"#),
            "limits[0].every"
        );
        assert_eq!(
            field_of(r#"{"limits": [{"quota": 5, "window": "week"}]}"#),
            "limits.window"
        );
        assert_eq!(field_of(r#"{"limits": []}"#), "capacity");
        assert_eq!(
            field_of(r#"{"tenant": "other", "capacity": 5, "refill_per_second": 1}"#),
            "tenant"
        );
    }

    #[test]
    fn limits_and_tenant_wide_scopes_parse() {
        let rule = acme(
            "*",
            r#"{"limits": [{"quota": 1000, "window": "day"}, {"capacity": 5, "refill_per_second": 1}]}"#,
        );
        assert!(rule.route.is_all());
        assert!(!rule.limit.bucket);
        assert_eq!(rule.limits().count(), 2);
    }
}
