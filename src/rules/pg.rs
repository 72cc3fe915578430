//! Rules in PostgreSQL: migrations, queries and change events.
//!
//! Owns every SQL statement tollgate runs and the `tollgate_rules`
//! notification format written by the triggers in `migrations/`. Nothing
//! here is on the request path: the cache loads through [`RuleStore`] and
//! the admin API writes through it.
//!
//! Invariant: every write is one transaction, and the trigger announces it
//! to every gateway (including the writer) through `NOTIFY`.

use std::num::NonZeroU32;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgPool, PgPoolOptions};

use super::model::{LimitSpec, Rule, RuleSpec};
use crate::key::{RouteId, TenantId};

/// The `NOTIFY` channel the triggers write to.
pub const CHANNEL: &str = "tollgate_rules";

/// The SQL migrations, compiled in.
static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// Longest wait for a pooled connection before a query gives up.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(2);

/// Why a database operation failed. The messages carry their cause
/// (there is no separate source, so a printed chain says it once).
#[derive(Debug, thiserror::Error)]
pub enum RuleStoreError {
    /// The server answered, but the database in the URL does not exist.
    #[error(
        "database {0:?} does not exist: create it (psql -c 'CREATE DATABASE \"{0}\"', \
         or createdb {0}), then run tollgate migrate --database-url <url>"
    )]
    MissingDatabase(String),
    /// The database could not be reached or the query failed.
    #[error("database error: {0}")]
    Database(sqlx::Error),
    /// A migration could not be applied.
    #[error("migration failed: {0}")]
    Migrate(sqlx::migrate::MigrateError),
}

/// The database a "does not exist" error (SQLSTATE 3D000) names.
fn missing_database(e: &sqlx::Error) -> Option<String> {
    let db = e.as_database_error()?;
    if db.code().as_deref() != Some("3D000") {
        return None;
    }
    let message = db.message();
    let name = message
        .split('"')
        .nth(1)
        .map_or_else(|| message.to_owned(), str::to_owned);
    Some(name)
}

impl From<sqlx::Error> for RuleStoreError {
    fn from(e: sqlx::Error) -> Self {
        missing_database(&e).map_or(Self::Database(e), Self::MissingDatabase)
    }
}

impl From<sqlx::migrate::MigrateError> for RuleStoreError {
    fn from(e: sqlx::migrate::MigrateError) -> Self {
        use sqlx::migrate::MigrateError::{Execute, ExecuteMigration};
        match &e {
            Execute(inner) | ExecuteMigration(inner, _) => missing_database(inner),
            _ => None,
        }
        .map_or(Self::Migrate(e), Self::MissingDatabase)
    }
}

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
    /// Further limits.
    #[sqlx(try_from = "String")]
    pub limits: LimitList,
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

/// A rule's further limits, stored as a JSON array.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct LimitList(pub Vec<LimitSpec>);

impl TryFrom<String> for LimitList {
    type Error = serde_json::Error;

    fn try_from(text: String) -> Result<Self, Self::Error> {
        serde_json::from_str(&text).map(Self)
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
            limits: LimitList(RuleSpec::from(rule).limits),
            shards: to_i32(rule.limit.shards),
            exact: rule.limit.exact,
            mode: rule.limit.mode.as_str().to_owned(),
            name: rule.name.as_ref().map(ToString::to_string),
            updated_at: None,
        }
    }
}

/// Columns of [`StoredRule`], in order.
const COLUMNS: &str = "tenant_id AS tenant, route_id AS route, capacity, refill_per_second, limits::text AS limits, shards, exact, mode, name, \
     to_char(updated_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') AS updated_at";

/// Access to the rules table.
#[derive(Clone)]
pub struct RuleStore {
    /// A small pool; connections are opened on demand.
    pool: PgPool,
    /// The URL, for the listener's own connection.
    url: String,
}

impl RuleStore {
    /// A store for `url`. Connects to nothing until first used.
    ///
    /// # Errors
    /// When the URL cannot be parsed.
    pub fn connect_lazy(url: &str) -> Result<Self, RuleStoreError> {
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .connect_lazy(url)?;
        Ok(Self {
            pool,
            url: url.to_owned(),
        })
    }

    /// The database URL (for `LISTEN`).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The connection pool, shared with the other tables' queries.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Closes every pooled connection.
    pub async fn close(&self) {
        self.pool.close().await;
    }

    /// Applies every pending migration; already applied ones are skipped.
    ///
    /// # Errors
    /// When the database is unreachable or a migration fails.
    pub async fn migrate(&self) -> Result<(), RuleStoreError> {
        MIGRATOR.run(&self.pool).await?;
        Ok(())
    }

    /// Every rule. Rows that fail validation are skipped with a warning
    /// naming the row id (the table's checks make that impossible short of
    /// manual DDL).
    ///
    /// # Errors
    /// When the database is unreachable or the query fails.
    pub async fn load_all(&self) -> Result<Vec<Rule>, RuleStoreError> {
        let rows: Vec<RuleRow> = sqlx::query_as(
            "SELECT id, tenant_id, route_id, capacity, refill_per_second, limits::text AS limits, \
             shards, exact, mode, name FROM rate_limit_rule",
        )
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .filter_map(|row| {
                let id = row.id;
                RuleSpec::try_from(row)
                    .map_err(|e| {
                        tracing::warn!(row = id, error = %e, "Skipping a rule row whose limits are not JSON.");
                    })
                    .ok()?
                    .validate()
                    .map_err(|problems| {
                        let problems: Vec<_> = problems.iter().map(|p| p.field).collect();
                        tracing::warn!(row = id, ?problems, "Skipping an invalid rule row.");
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
    ) -> Result<Option<StoredRule>, RuleStoreError> {
        let sql = sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM rate_limit_rule WHERE tenant_id = $1 AND route_id = $2"
        ));
        Ok(sqlx::query_as(sql)
            .bind(tenant.as_str())
            .bind(route.as_str())
            .fetch_optional(&self.pool)
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
    ) -> Result<Vec<StoredRule>, RuleStoreError> {
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
            .fetch_all(&self.pool)
            .await?)
    }

    /// Creates or replaces a rule in one transaction; returns the row as
    /// stored and whether it was created.
    ///
    /// # Errors
    /// When the database is unreachable or the statement fails.
    pub async fn put(&self, rule: &Rule) -> Result<(StoredRule, bool), RuleStoreError> {
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
        // expect: a list of plain structs of numbers and strings always
        // serialises.
        let limits =
            serde_json::to_string(&RuleSpec::from(rule).limits).expect("limits serialise to JSON");
        let mut tx = self.pool.begin().await?;
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
    pub async fn delete(&self, tenant: &TenantId, route: &RouteId) -> Result<bool, RuleStoreError> {
        let mut tx = self.pool.begin().await?;
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

/// One row of `rate_limit_rule` as loaded for the cache.
#[derive(sqlx::FromRow)]
struct RuleRow {
    id: i64,
    tenant_id: String,
    route_id: String,
    capacity: Option<i32>,
    refill_per_second: Option<i32>,
    limits: String,
    shards: i32,
    exact: bool,
    mode: String,
    name: Option<String>,
}

impl TryFrom<RuleRow> for RuleSpec {
    type Error = serde_json::Error;

    fn try_from(row: RuleRow) -> Result<Self, Self::Error> {
        Ok(Self {
            tenant: row.tenant_id,
            route: row.route_id,
            capacity: row.capacity.map(i64::from),
            refill_per_second: row.refill_per_second.map(i64::from),
            limits: LimitList::try_from(row.limits)?.0,
            shards: row.shards.into(),
            exact: row.exact,
            mode: Some(row.mode),
            name: row.name,
        })
    }
}

/// The default of a payload's `shards` (events written before migration 2).
fn one() -> i64 {
    1
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

/// The JSON written by the triggers.
#[derive(Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
enum Payload {
    Upsert {
        tenant: String,
        route: String,
        capacity: Option<i64>,
        refill_per_second: Option<i64>,
        #[serde(default)]
        limits: Vec<LimitSpec>,
        #[serde(default = "one")]
        shards: i64,
        #[serde(default)]
        exact: bool,
        #[serde(default)]
        mode: Option<String>,
        #[serde(default)]
        name: Option<String>,
    },
    Delete {
        tenant: String,
        route: String,
    },
    Reload,
}

impl Change {
    /// Parses a notification payload; `None` when it is not one of ours.
    pub fn parse(payload: &str) -> Option<Self> {
        match serde_json::from_str(payload).ok()? {
            Payload::Upsert {
                tenant,
                route,
                capacity,
                refill_per_second,
                limits,
                shards,
                exact,
                mode,
                name,
            } => RuleSpec {
                tenant,
                route,
                capacity,
                refill_per_second,
                limits,
                shards,
                exact,
                mode,
                name,
            }
            .validate()
            .ok()
            .map(Change::Upsert),
            Payload::Delete { tenant, route } => Some(Change::Delete(
                TenantId::parse(&tenant).ok()?,
                RouteId::parse_scope(&route).ok()?,
            )),
            Payload::Reload => Some(Change::Reload),
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
