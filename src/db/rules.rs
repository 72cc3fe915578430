//! The `rate_limit_rule` table: its queries and its change events.
//!
//! Owns every SQL statement about rules and the `tollgate_rules`
//! notification format written by the triggers in `migrations/`. Nothing
//! here is on the request path: the cache loads through [`RuleStore`] and
//! the admin API writes through it.
//!
//! Invariant: every write is one transaction, and the trigger announces it
//! to every gateway (including the writer) through `NOTIFY`.

use std::num::NonZeroU32;

use serde::{Deserialize, Serialize};

use super::{Database, DbError};
use crate::key::{RouteId, TenantId};
use crate::rules::model::Rule;
use crate::rules::spec::RuleSpec;

/// The `NOTIFY` channel the triggers write to.
pub const CHANNEL: &str = "tollgate_rules";

/// One row of `rate_limit_rule`, as the admin API shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct StoredRule {
    /// Tenant id.
    pub tenant: String,
    /// Route id.
    pub route: String,
    /// Burst size of the first bucket; `None` for a rule of quotas only.
    pub capacity: Option<i32>,
    /// Tokens per second of the first bucket.
    pub refill_per_second: Option<i32>,
    /// Further limits: the `limits` column's JSON text, shown as JSON.
    #[serde(serialize_with = "as_json")]
    pub limits: String,
    /// Sub-buckets.
    pub shards: i32,
    /// Exact mode (no leases).
    pub exact: bool,
    /// `enforce` or `shadow`.
    pub mode: String,
    /// The tenant's display name, if the rule gives one.
    pub name: Option<String>,
    /// Last change, RFC 3339 in UTC.
    pub updated_at: Option<String>,
}

/// Writes JSON `text` as the JSON it holds (as a string if it holds none).
fn as_json<S: serde::Serializer>(text: &str, out: S) -> Result<S::Ok, S::Error> {
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(value) => value.serialize(out),
        Err(_) => out.serialize_str(text),
    }
}

impl StoredRule {
    /// A rule in force, shown like a row (without `updated_at`).
    pub fn in_force(rule: &Rule) -> Self {
        let bucket = rule.limit.bucket;
        Self {
            tenant: rule.tenant.to_string(),
            route: rule.route.to_string(),
            capacity: bucket.then(|| to_i32(rule.limit.capacity)),
            refill_per_second: bucket.then(|| to_i32(rule.limit.refill_per_second)),
            limits: limits_json(rule),
            shards: to_i32(rule.limit.shards),
            exact: rule.limit.exact,
            mode: rule.limit.mode.as_str().to_owned(),
            name: rule.name.as_ref().map(ToString::to_string),
            updated_at: None,
        }
    }
}

/// The further limits of `rule` as the `limits` column holds them.
fn limits_json(rule: &Rule) -> String {
    // expect: a list of plain structs of numbers and strings always
    // serialises.
    serde_json::to_string(&RuleSpec::from(rule).limits).expect("limits serialise to JSON")
}

impl TryFrom<StoredRule> for RuleSpec {
    type Error = serde_json::Error;

    fn try_from(row: StoredRule) -> Result<Self, Self::Error> {
        Ok(Self {
            limits: serde_json::from_str(&row.limits)?,
            tenant: row.tenant,
            route: row.route,
            capacity: row.capacity.map(i64::from),
            refill_per_second: row.refill_per_second.map(i64::from),
            shards: row.shards.into(),
            exact: row.exact,
            mode: Some(row.mode),
            name: row.name,
        })
    }
}

/// Columns of [`StoredRule`], in order.
const COLUMNS: &str = "tenant_id AS tenant, route_id AS route, capacity, refill_per_second, limits::text AS limits, shards, exact, mode, name, \
     to_char(updated_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') AS updated_at";

/// The rules table.
#[derive(Clone)]
pub struct RuleStore {
    db: Database,
}

impl RuleStore {
    /// The rules table of `db`.
    pub fn new(db: Database) -> Self {
        Self { db }
    }

    /// The database the rules live in.
    pub fn database(&self) -> &Database {
        &self.db
    }

    /// Every rule. Rows that fail validation are skipped with a warning
    /// naming the row id (the table's checks make that impossible short of
    /// manual DDL).
    ///
    /// # Errors
    /// When the database is unreachable or the query fails.
    pub async fn load_all(&self) -> Result<Vec<Rule>, DbError> {
        let sql = sqlx::AssertSqlSafe(format!("SELECT {COLUMNS} FROM rate_limit_rule"));
        let rows: Vec<StoredRule> = sqlx::query_as(sql).fetch_all(self.db.pool()).await?;
        Ok(rows
            .into_iter()
            .filter_map(|row| {
                let (tenant, route) = (row.tenant.clone(), row.route.clone());
                RuleSpec::try_from(row)
                    .map_err(|e| {
                        tracing::warn!(tenant, route, error = %e, "Skipping a rule row whose limits cannot be read.");
                    })
                    .ok()?
                    .validate()
                    .map_err(|problems| {
                        let problems: Vec<_> = problems.iter().map(ToString::to_string).collect();
                        tracing::warn!(tenant, route, ?problems, "Skipping an invalid rule row.");
                    })
                    .ok()
            })
            .collect())
    }

    /// The rule of `tenant` on `route`, if any.
    ///
    /// # Errors
    /// When the database is unreachable or the query fails.
    pub async fn get(
        &self,
        tenant: &TenantId,
        route: &RouteId,
    ) -> Result<Option<StoredRule>, DbError> {
        let sql = sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM rate_limit_rule WHERE tenant_id = $1 AND route_id = $2"
        ));
        Ok(sqlx::query_as(sql)
            .bind(tenant.as_str())
            .bind(route.as_str())
            .fetch_optional(self.db.pool())
            .await?)
    }

    /// Up to `limit` rules ordered by (tenant, route), after the pair
    /// `after` when given, of one tenant when `tenant` is given.
    ///
    /// # Errors
    /// When the database is unreachable or the query fails.
    pub async fn list(
        &self,
        tenant: Option<&TenantId>,
        after: Option<(&TenantId, &RouteId)>,
        limit: u32,
    ) -> Result<Vec<StoredRule>, DbError> {
        let sql = sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM rate_limit_rule \
             WHERE ($1::text IS NULL OR tenant_id = $1) \
               AND ($2::text IS NULL OR (tenant_id, route_id) > ($2, $3)) \
             ORDER BY tenant_id, route_id LIMIT $4"
        ));
        Ok(sqlx::query_as(sql)
            .bind(tenant.map(TenantId::as_str))
            .bind(after.map(|(t, _)| t.as_str()))
            .bind(after.map(|(_, r)| r.as_str()).unwrap_or(""))
            .bind(i64::from(limit))
            .fetch_all(self.db.pool())
            .await?)
    }

    /// Creates or replaces a rule in one transaction; returns the row as
    /// stored and whether it was created.
    ///
    /// # Errors
    /// When the database is unreachable or the statement fails.
    pub async fn put(&self, rule: &Rule) -> Result<(StoredRule, bool), DbError> {
        let sql = sqlx::AssertSqlSafe(format!(
            "INSERT INTO rate_limit_rule \
               (tenant_id, route_id, capacity, refill_per_second, shards, exact, mode, name, limits) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9::jsonb) \
             ON CONFLICT (tenant_id, route_id) DO UPDATE \
               SET capacity = EXCLUDED.capacity, refill_per_second = EXCLUDED.refill_per_second, \
                   shards = EXCLUDED.shards, exact = EXCLUDED.exact, mode = EXCLUDED.mode, \
                   name = EXCLUDED.name, limits = EXCLUDED.limits \
             RETURNING {COLUMNS}, (xmax = 0) AS created"
        ));
        let limit = rule.limit;
        let limits = limits_json(rule);
        let mut tx = self.db.pool().begin().await?;
        let (row, created): (StoredRule, bool) = sqlx::query_as::<_, StoredRuleCreated>(sql)
            .bind(rule.tenant.as_str())
            .bind(rule.route.as_str())
            .bind(limit.bucket.then(|| to_i32(limit.capacity)))
            .bind(limit.bucket.then(|| to_i32(limit.refill_per_second)))
            .bind(to_i32(limit.shards))
            .bind(limit.exact)
            .bind(limit.mode.as_str())
            .bind(rule.name.as_ref().map(|n| n.as_str()))
            .bind(limits)
            .fetch_one(&mut *tx)
            .await
            .map(StoredRuleCreated::split)?;
        tx.commit().await?;
        Ok((row, created))
    }

    /// Deletes a rule in one transaction; returns whether one existed.
    ///
    /// # Errors
    /// When the database is unreachable or the statement fails.
    pub async fn delete(&self, tenant: &TenantId, route: &RouteId) -> Result<bool, DbError> {
        let mut tx = self.db.pool().begin().await?;
        let done =
            sqlx::query("DELETE FROM rate_limit_rule WHERE tenant_id = $1 AND route_id = $2")
                .bind(tenant.as_str())
                .bind(route.as_str())
                .execute(&mut *tx)
                .await?;
        tx.commit().await?;
        Ok(done.rows_affected() > 0)
    }
}

/// A row from `RETURNING …, (xmax = 0) AS created`.
#[derive(sqlx::FromRow)]
struct StoredRuleCreated {
    #[sqlx(flatten)]
    rule: StoredRule,
    created: bool,
}

impl StoredRuleCreated {
    fn split(self) -> (StoredRule, bool) {
        (self.rule, self.created)
    }
}

/// A limit value as the `integer` column holds it (limits never exceed
/// `i32::MAX`: config, rules file and admin API all check it).
fn to_i32(v: NonZeroU32) -> i32 {
    i32::try_from(v.get()).unwrap_or(i32::MAX)
}

/// A change announced on [`CHANNEL`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// A rule was created or changed.
    Upsert(Rule),
    /// A rule was deleted.
    Delete(TenantId, RouteId),
    /// Many rules changed (`TRUNCATE`): reload everything.
    Reload,
}

impl Change {
    /// Parses a notification payload: an object whose `op` is `upsert`
    /// (with the fields of a [`RuleSpec`]), `delete` (with `tenant` and
    /// `route`) or `reload`; the triggers also write a `seq` number, which
    /// is not needed here. `None`, with the reason logged, when it is not
    /// one of these or its rule is not valid: the rule in force stays.
    pub fn parse(payload: &str) -> Option<Self> {
        let serde_json::Value::Object(mut fields) = serde_json::from_str(payload).ok()? else {
            return None;
        };
        fields.remove("seq");
        let op = fields.remove("op")?;
        let text = |fields: &serde_json::Map<_, _>, key: &str| {
            fields
                .get(key)
                .and_then(serde_json::Value::as_str)
                .map(str::to_owned)
        };
        match op.as_str()? {
            "upsert" => {
                let spec = RuleSpec::deserialize(serde_json::Value::Object(fields))
                    .map_err(|e| tracing::warn!(error = %e, "A rule change event is not a rule."))
                    .ok()?;
                spec.validate()
                    .map_err(|problems| {
                        let problems: Vec<_> = problems.iter().map(ToString::to_string).collect();
                        tracing::warn!(?problems, "A rule change event holds an invalid rule.");
                    })
                    .ok()
                    .map(Change::Upsert)
            }
            "delete" => Some(Change::Delete(
                TenantId::parse(&text(&fields, "tenant")?).ok()?,
                RouteId::parse_scope(&text(&fields, "route")?).ok()?,
            )),
            "reload" => Some(Change::Reload),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trigger_payloads_parse_into_changes() {
        let up = Change::parse(
            r#"{"op":"upsert","tenant":"shop-a","route":"r","capacity":5,"refill_per_second":2}"#,
        );
        let Some(Change::Upsert(rule)) = up else {
            panic!("{up:?}");
        };
        assert_eq!(
            (rule.tenant.as_str(), rule.limit.capacity.get()),
            ("shop-a", 5)
        );
        assert!(matches!(
            Change::parse(r#"{"op":"delete","tenant":"a","route":"b"}"#),
            Some(Change::Delete(..))
        ));
        assert_eq!(Change::parse(r#"{"op":"reload"}"#), Some(Change::Reload));
    }

    #[test]
    fn shards_exact_and_mode_travel_in_payloads() {
        let Some(Change::Upsert(rule)) = Change::parse(
            r#"{"op":"upsert","tenant":"t","route":"r","capacity":5,"refill_per_second":2,"shards":4,"exact":true,"mode":"shadow"}"#,
        ) else {
            panic!("not an upsert");
        };
        assert_eq!(
            (rule.limit.shards.get(), rule.limit.exact, rule.limit.mode),
            (4, true, crate::rules::model::Mode::Shadow)
        );
        assert_eq!(
            Change::parse(
                r#"{"op":"upsert","tenant":"t","route":"r","capacity":5,"refill_per_second":2,"shards":65}"#
            ),
            None
        );
    }

    #[test]
    fn malformed_payloads_are_ignored() {
        for bad in [
            "",
            "{}",
            r#"{"op":"upsert","tenant":"{x}","route":"r","capacity":5,"refill_per_second":2}"#,
            r#"{"op":"upsert","tenant":"t","route":"r","capacity":0,"refill_per_second":2}"#,
            r#"{"op":"upsert","tenant":"t","route":"r","capacity":5,"refill_per_second":3000000000}"#,
            r#"{"op":"explode"}"#,
        ] {
            assert_eq!(Change::parse(bad), None, "{bad}");
        }
    }
}
