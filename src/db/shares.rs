//! The `region_share` and `rebalance_decision` tables: their queries.
//!
//! Owns every SQL statement about region shares and the rebalancer's
//! recorded decisions; the splitter (`region::shares`) loads through
//! [`ShareStore`], the admin API and the rebalancer write through it.

use std::collections::BTreeMap;

use serde::Serialize;
use sqlx::Connection as _;
use sqlx::postgres::PgConnection;

use super::{Database, DbError};
use crate::key::{RouteId, TenantId};
use crate::region::shares::Scope;

/// The `NOTIFY` channel of share changes.
pub const CHANNEL: &str = "tollgate_shares";

/// One `region_share` row.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct ShareRow {
    /// Region id.
    pub region: String,
    /// Tenant, or `None` for every tenant.
    pub tenant: Option<String>,
    /// Route, or `None` for every route.
    pub route: Option<String>,
    /// Share in (0, 1].
    pub share: f64,
    /// Last change, RFC 3339 in UTC.
    pub updated_at: Option<String>,
}

/// Rebalancer decisions kept in `rebalance_decision`.
const KEPT_DECISIONS: i64 = 100;

/// A rebalancer round to record with the shares it writes.
#[derive(Debug)]
pub struct Decision<'a> {
    /// The instance that led the round.
    pub instance: &'a str,
    /// `[{"tenant", "route", "shares", "demand_per_second"}, …]`.
    pub changes: serde_json::Value,
}

/// One recorded rebalancer decision.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DecisionRow {
    /// When, RFC 3339 in UTC.
    pub decided_at: String,
    /// The instance that led the round.
    pub instance_id: String,
    /// What changed, and the demand behind it.
    pub changes: serde_json::Value,
}

/// The `region_share` and `rebalance_decision` tables.
#[derive(Clone)]
pub struct ShareStore {
    db: Database,
}

impl ShareStore {
    /// The share tables of `db`.
    pub fn new(db: Database) -> Self {
        Self { db }
    }

    /// The database the tables are in.
    pub fn database(&self) -> &Database {
        &self.db
    }

    /// Every row.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn load_all(&self) -> Result<Vec<ShareRow>, DbError> {
        Ok(sqlx::query_as(
            "SELECT region_id AS region, tenant_id AS tenant, route_id AS route, share, \
             to_char(updated_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') AS updated_at \
             FROM region_share ORDER BY tenant_id NULLS FIRST, route_id NULLS FIRST, region_id",
        )
        .fetch_all(self.db.pool())
        .await?)
    }

    /// Replaces the shares of each scope with the given per-region shares
    /// in one transaction on a pooled connection.
    ///
    /// # Errors
    /// When the database fails; nothing is written then.
    pub async fn replace(&self, changes: &[(Scope, BTreeMap<String, f64>)]) -> Result<(), DbError> {
        let mut conn = self.db.pool().acquire().await?;
        Self::replace_on(&mut conn, changes, None).await
    }

    /// Replaces the shares of each scope with the given per-region shares,
    /// and records `decision` when the rebalancer made them, all in one
    /// transaction on `conn`. The rebalancer passes the session that holds
    /// its leader lock: an instance that lost the lock (its session died)
    /// cannot write.
    ///
    /// # Errors
    /// When the database fails; nothing is written then.
    pub async fn replace_on(
        conn: &mut PgConnection,
        changes: &[(Scope, BTreeMap<String, f64>)],
        decision: Option<&Decision<'_>>,
    ) -> Result<(), DbError> {
        let mut tx = conn.begin().await?;
        if let Some(decision) = decision {
            sqlx::query(
                "INSERT INTO rebalance_decision (instance_id, changes) VALUES ($1, $2::jsonb)",
            )
            .bind(decision.instance)
            .bind(decision.changes.to_string())
            .execute(&mut *tx)
            .await?;
            sqlx::query(
                "DELETE FROM rebalance_decision WHERE id NOT IN \
                 (SELECT id FROM rebalance_decision ORDER BY id DESC LIMIT $1)",
            )
            .bind(KEPT_DECISIONS)
            .execute(&mut *tx)
            .await?;
        }
        for (scope, shares) in changes {
            for (region, share) in shares {
                sqlx::query(
                    "INSERT INTO region_share (region_id, tenant_id, route_id, share) VALUES ($1, $2, $3, $4) \
                     ON CONFLICT ON CONSTRAINT region_share_scope \
                     DO UPDATE SET share = EXCLUDED.share, updated_at = now()",
                )
                .bind(region)
                .bind(scope.tenant.as_ref().map(TenantId::as_str))
                .bind(scope.route.as_ref().map(RouteId::as_str))
                .bind(share)
                .execute(&mut *tx)
                .await?;
            }
        }
        tx.commit().await?;
        Ok(())
    }

    /// The latest `limit` rebalancer decisions, newest first.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn decisions(&self, limit: i64) -> Result<Vec<DecisionRow>, DbError> {
        let rows: Vec<(String, String, String)> = sqlx::query_as(
            "SELECT to_char(decided_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), \
             instance_id, changes::text FROM rebalance_decision ORDER BY id DESC LIMIT $1",
        )
        .bind(limit)
        .fetch_all(self.db.pool())
        .await?;
        Ok(rows
            .into_iter()
            .map(|(decided_at, instance_id, changes)| DecisionRow {
                decided_at,
                instance_id,
                changes: serde_json::from_str(&changes).unwrap_or(serde_json::Value::Null),
            })
            .collect())
    }

    /// Deletes every region's share of `scope`; returns whether any existed.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn delete(&self, scope: &Scope) -> Result<bool, DbError> {
        let done = sqlx::query(
            "DELETE FROM region_share WHERE tenant_id IS NOT DISTINCT FROM $1 AND route_id IS NOT DISTINCT FROM $2",
        )
        .bind(scope.tenant.as_ref().map(TenantId::as_str))
        .bind(scope.route.as_ref().map(RouteId::as_str))
        .execute(self.db.pool())
        .await?;
        Ok(done.rows_affected() > 0)
    }
}
