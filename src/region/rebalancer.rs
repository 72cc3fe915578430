//! The rebalancer: moves each region's share with real traffic.
//!
//! Owns the scheduled round. Every instance runs the actor, but only the
//! one holding a PostgreSQL advisory lock acts (the lock lives as long as
//! its session, so a dead leader frees it). A round asks Prometheus for the
//! demand that reached the limiter, by region, tenant and route, over
//! `rebalancer.window_seconds`; moves every scope's shares toward that
//! demand with [`super::split::rebalance`] (labelled tenants per route; the
//! rest, `tenant="_other"`, moves the global default share); writes every
//! change, with a record of the decision, in one transaction on the session
//! that holds the lock (an instance that lost it cannot write); and logs
//! and counts the outcome. The table's
//! trigger then carries the new shares to every gateway.
//!
//! Invariant: when Prometheus is unreachable or has no data, nothing is
//! written; the shares hold still.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use actix::fut::{ActorFutureExt, WrapFuture};
use actix::{Actor, Addr, AsyncContext, Context, Handler, Message};
use sqlx::Connection as _;
use sqlx::postgres::PgConnection;

use super::model::Regions;
use super::prom::{Demand, Prometheus};
use super::shares::{Decision, Scope, ScopeKey, ShareRow, ShareStore, effective};
use super::split::{SplitParams, rebalance};
use crate::config::RebalancerSettings;
use crate::key::{RouteId, TenantId, fingerprint};
use crate::telemetry::{Metrics, OTHER_TENANTS, RequestCounters};

/// The advisory lock that makes one instance the leader ("tollgate").
const LEADER_LOCK: i64 = 0x746F_6C6C_6761_7465;

/// Longest a round may take (leader check, Prometheus, database) before it
/// is abandoned, so a stuck connection cannot stop rebalancing.
const ROUND_TIMEOUT: Duration = Duration::from_secs(30);

/// Changes smaller than this are not written.
const MIN_CHANGE: f64 = 1e-4;

/// How a round ended, as a metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoundResult {
    /// New shares were written.
    Applied,
    /// The shares already match the demand.
    Unchanged,
    /// Another instance leads.
    NotLeader,
    /// Prometheus could not be asked.
    PrometheusError,
    /// Prometheus had no demand to go by.
    NoData,
    /// PostgreSQL failed.
    DatabaseError,
    /// The round took longer than 30 s; the leader session was dropped
    /// (and with it the lock).
    Timeout,
}

impl RoundResult {
    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            Self::Applied => "applied",
            Self::Unchanged => "unchanged",
            Self::NotLeader => "not_leader",
            Self::PrometheusError => "prometheus_error",
            Self::Timeout => "timeout",
            Self::NoData => "no_data",
            Self::DatabaseError => "database_error",
        }
    }
}

/// Requests per second by scope, then region, over the known regions.
/// `_other` is the demand of the global scope.
fn demand_by_scope<'a>(
    regions: &Regions,
    demand: &'a [Demand],
) -> BTreeMap<ScopeKey, BTreeMap<&'a str, f64>> {
    let mut by_scope: BTreeMap<ScopeKey, BTreeMap<&str, f64>> = BTreeMap::new();
    for d in demand {
        if regions.get(&d.region).is_none() {
            continue;
        }
        let key = if d.tenant == OTHER_TENANTS {
            (None, None)
        } else {
            (Some(d.tenant.clone()), Some(d.route.clone()))
        };
        *by_scope
            .entry(key)
            .or_default()
            .entry(d.region.as_str())
            .or_default() += d.rate;
    }
    by_scope
}

/// New shares for every scope whose demand calls for a change.
pub fn plan_round(
    regions: &Regions,
    rows: &[ShareRow],
    demand: &[Demand],
    params: SplitParams,
) -> Vec<(Scope, BTreeMap<String, f64>)> {
    demand_by_scope(regions, demand)
        .into_iter()
        .filter_map(|((tenant, route), per_region)| {
            let scope = Scope {
                tenant: tenant.as_deref().map(TenantId::parse).transpose().ok()?,
                route: route.as_deref().map(RouteId::parse).transpose().ok()?,
            };
            let current: Vec<f64> = regions
                .all
                .iter()
                .map(|r| {
                    effective(
                        rows,
                        &r.id,
                        r.default_share,
                        tenant.as_deref(),
                        route.as_deref(),
                    )
                })
                .collect();
            // Rows written before a region was added (or removed) need not
            // sum to 1; start from the same proportions, normalised.
            let total: f64 = current.iter().sum();
            let current: Vec<f64> = current.iter().map(|c| c / total).collect();
            let wanted: Vec<f64> = regions
                .all
                .iter()
                .map(|r| per_region.get(r.id.as_str()).copied().unwrap_or(0.0))
                .collect();
            let next = rebalance(&current, &wanted, params)?;
            let moved = current
                .iter()
                .zip(&next)
                .any(|(c, n)| (c - n).abs() > MIN_CHANGE);
            moved.then(|| {
                let shares = regions.all.iter().map(|r| r.id.clone()).zip(next).collect();
                (scope, shares)
            })
        })
        .collect()
}

/// The regions with no series at all in `demand`.
fn unseen_regions<'a>(regions: &'a Regions, demand: &[Demand]) -> Vec<&'a str> {
    regions
        .all
        .iter()
        .map(|r| r.id.as_str())
        .filter(|id| !demand.iter().any(|d| d.region == *id))
        .collect()
}

/// Starts the rebalancer on the current arbiter; send it [`Round`] on a
/// schedule.
pub fn start(
    settings: RebalancerSettings,
    regions: Arc<Regions>,
    store: ShareStore,
    database_url: String,
    instance_id: String,
    labels: Arc<RequestCounters>,
    metrics: Metrics,
) -> Addr<Rebalancer> {
    Rebalancer {
        settings,
        regions,
        store,
        database_url,
        instance_id,
        labels,
        lock: None,
        running: false,
        prometheus: None,
        metrics,
    }
    .start()
}

/// The rebalancing actor.
pub struct Rebalancer {
    /// Knobs.
    settings: RebalancerSettings,
    /// Every region.
    regions: Arc<Regions>,
    /// Where shares are written.
    store: ShareStore,
    /// For the leader lock's own session.
    database_url: String,
    /// This instance, named in the decisions it records.
    instance_id: String,
    /// Maps the tenant labels Prometheus reports back to tenant ids.
    labels: Arc<RequestCounters>,
    /// The session holding the leader lock, while this instance leads.
    lock: Option<PgConnection>,
    /// Whether a round is under way.
    running: bool,
    /// The Prometheus client (created on the actor's thread).
    prometheus: Option<Prometheus>,
    /// Round counter.
    metrics: Metrics,
}

impl Actor for Rebalancer {
    type Context = Context<Self>;

    fn started(&mut self, _: &mut Self::Context) {
        self.prometheus = Some(Prometheus::new(&self.settings.prometheus_url));
    }
}

/// Run one round now.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Round;

impl Handler<Round> for Rebalancer {
    type Result = ();

    fn handle(&mut self, _: Round, ctx: &mut Context<Self>) {
        let Some(prometheus) = self.prometheus.clone() else {
            return;
        };
        if self.running {
            return;
        }
        self.running = true;
        let lock = self.lock.take();
        let (url, store, regions, instance, labels) = (
            self.database_url.clone(),
            self.store.clone(),
            self.regions.clone(),
            self.instance_id.clone(),
            self.labels.clone(),
        );
        let settings = self.settings.clone();
        let round = async move {
            let work = async move {
                let (mut lock, leader) = lead(lock, &url).await;
                let Some(session) = lock.as_mut().filter(|_| leader) else {
                    return (lock, RoundResult::NotLeader);
                };
                let leader = Leader {
                    session,
                    instance: &instance,
                    labels: &labels,
                };
                let result = run(&prometheus, &store, &regions, &settings, leader).await;
                (lock, result)
            };
            // On a timeout the session is dropped with the round: its lock
            // goes with it, and the next round starts afresh.
            tokio::time::timeout(ROUND_TIMEOUT, work)
                .await
                .unwrap_or_else(|_| {
                    tracing::warn!(
                        seconds = ROUND_TIMEOUT.as_secs(),
                        "A rebalancer round did not finish in time; abandoned."
                    );
                    (None, RoundResult::Timeout)
                })
        };
        ctx.spawn(round.into_actor(self).map(|(lock, result), actor, _| {
            actor.lock = lock;
            actor.running = false;
            actor.metrics.rebalance_round(result.label());
        }));
    }
}

/// Keeps or takes the leader lock; returns the session holding it.
async fn lead(lock: Option<PgConnection>, url: &str) -> (Option<PgConnection>, bool) {
    if let Some(mut conn) = lock {
        if conn.ping().await.is_ok() {
            return (Some(conn), true);
        }
        tracing::warn!("Lost the rebalancer's leader session; trying to lead again.");
    }
    let Ok(mut conn) = PgConnection::connect(url).await else {
        return (None, false);
    };
    let locked: Result<bool, _> = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(LEADER_LOCK)
        .fetch_one(&mut conn)
        .await;
    match locked {
        Ok(true) => {
            tracing::info!("This instance now leads region rebalancing.");
            (Some(conn), true)
        }
        _ => {
            let _ = conn.close().await;
            (None, false)
        }
    }
}

/// The instance leading a round, and the session holding its lock.
struct Leader<'a> {
    /// Writes go through this session: it holds the leader lock.
    session: &'a mut PgConnection,
    /// This instance's id, recorded with each decision.
    instance: &'a str,
    /// Tenant labels, to map demand back to tenants and to name them in
    /// logs.
    labels: &'a RequestCounters,
}

/// `demand` by tenant id instead of tenant label; series of labels this
/// gateway does not know (a tenant whose rule just went away) are left out.
fn by_tenant_id(demand: Vec<Demand>, labels: &RequestCounters) -> Vec<Demand> {
    demand
        .into_iter()
        .filter_map(|d| {
            if d.tenant == OTHER_TENANTS {
                return Some(d);
            }
            let tenant = labels.tenant_of(&d.tenant)?;
            Some(Demand {
                tenant: tenant.to_string(),
                ..d
            })
        })
        .collect()
}

/// One round as leader.
async fn run(
    prometheus: &Prometheus,
    store: &ShareStore,
    regions: &Regions,
    settings: &RebalancerSettings,
    leader: Leader<'_>,
) -> RoundResult {
    let demand = match prometheus.demand(settings.window).await {
        Ok(d) if d.iter().any(|d| d.rate > 0.0) => by_tenant_id(d, leader.labels),
        Ok(_) => {
            tracing::warn!("Prometheus has no request rates yet; region shares stay as they are.");
            return RoundResult::NoData;
        }
        Err(e) => {
            tracing::warn!(error = %e, "Prometheus is unreachable; region shares stay as they are.");
            return RoundResult::PrometheusError;
        }
    };
    // Every gateway exports its `_other` series from the start, so a region
    // absent from the answer is one Prometheus does not see (failed
    // scrapes, a partition), not one without traffic: moving its share
    // towards the floor would punish it for a monitoring fault.
    let unseen = unseen_regions(regions, &demand);
    if !unseen.is_empty() {
        tracing::warn!(
            regions = %unseen.join(", "),
            "Prometheus has no series for some regions; region shares stay as they are."
        );
        return RoundResult::NoData;
    }
    let rows = match store.load_all().await {
        Ok(rows) => rows,
        Err(e) => {
            tracing::warn!(error = %e, "Cannot read region shares; skipping this round.");
            return RoundResult::DatabaseError;
        }
    };
    let params = SplitParams {
        smoothing: settings.smoothing,
        max_step: settings.max_step,
        floor: settings.floor,
    };
    let changes = plan_round(regions, &rows, &demand, params);
    if changes.is_empty() {
        return RoundResult::Unchanged;
    }
    let by_scope = demand_by_scope(regions, &demand);
    let record: Vec<serde_json::Value> = changes
        .iter()
        .map(|(scope, shares)| {
            let (tenant, route) = (
                scope.tenant.as_ref().map(TenantId::as_str),
                scope.route.as_ref().map(RouteId::as_str),
            );
            let key = (tenant.map(str::to_owned), route.map(str::to_owned));
            serde_json::json!({
                "tenant": tenant,
                "route": route,
                "shares": shares,
                "demand_per_second": by_scope.get(&key),
            })
        })
        .collect();
    let decision = Decision {
        instance: leader.instance,
        changes: serde_json::Value::Array(record),
    };
    match ShareStore::replace_on(leader.session, &changes, Some(&decision)).await {
        Ok(()) => {
            for (scope, shares) in &changes {
                let tenant = scope.tenant.as_ref().map(|t| {
                    leader
                        .labels
                        .label_of(t.as_str())
                        .map_or_else(|| fingerprint(t.as_str()), |l| l.to_string())
                });
                tracing::info!(
                    tenant = tenant.as_deref().unwrap_or("*"),
                    route = scope.route.as_ref().map_or("*", RouteId::as_str),
                    shares = ?shares,
                    "Region shares rebalanced."
                );
            }
            RoundResult::Applied
        }
        Err(e) => {
            tracing::warn!(error = %e, "Cannot write region shares; they stay as they were.");
            RoundResult::DatabaseError
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::model::RegionSpec;

    fn regions() -> Regions {
        let spec = |id: &str, share| RegionSpec {
            id: id.into(),
            default_share: share,
            redis: crate::config::RedisTarget::LocalOnly,
        };
        Regions {
            all: vec![spec("eu", 0.5), spec("us", 0.5)],
        }
    }

    fn demand(region: &str, tenant: &str, rate: f64) -> Demand {
        Demand {
            region: region.into(),
            tenant: tenant.into(),
            route: "api".into(),
            rate,
        }
    }

    const P: SplitParams = SplitParams {
        smoothing: 0.5,
        max_step: 0.2,
        floor: 0.05,
    };

    #[test]
    fn a_region_without_series_is_unseen_even_when_others_have_traffic() {
        let r = regions();
        assert_eq!(unseen_regions(&r, &[demand("eu", "_other", 70.0)]), ["us"]);
        let both = [demand("eu", "_other", 70.0), demand("us", "_other", 0.0)];
        assert!(unseen_regions(&r, &both).is_empty(), "idle is not unseen");
    }

    #[test]
    fn demand_is_mapped_from_labels_back_to_tenants() {
        crate::telemetry::install();
        let labels = RequestCounters::new(["api"], &[], 10);
        let name = crate::key::TenantName::parse("Acme").unwrap();
        labels.label_tenants([("sk-acme", Some(&name)), ("sk-beta", None)]);
        let demand = vec![
            demand("eu", "Acme", 5.0),
            demand("eu", &fingerprint("sk-beta"), 3.0),
            demand("eu", OTHER_TENANTS, 2.0),
            demand("eu", "Unknown", 1.0),
        ];
        let tenants: Vec<_> = by_tenant_id(demand, &labels)
            .into_iter()
            .map(|d| d.tenant)
            .collect();
        assert_eq!(tenants, ["sk-acme", "sk-beta", OTHER_TENANTS]);
    }

    #[test]
    fn other_tenants_move_the_global_share_and_labelled_ones_their_own() {
        let changes = plan_round(
            &regions(),
            &[],
            &[
                demand("eu", "_other", 70.0),
                demand("us", "_other", 30.0),
                demand("eu", "big", 10.0),
                demand("us", "big", 90.0),
                demand("mars", "big", 1000.0),
            ],
            P,
        );
        assert_eq!(changes.len(), 2, "{changes:?}");
        let global = &changes.iter().find(|(s, _)| s.tenant.is_none()).unwrap().1;
        assert!((global["eu"] - 0.6).abs() < 1e-9, "{global:?}");
        let big = &changes.iter().find(|(s, _)| s.tenant.is_some()).unwrap();
        assert_eq!(big.0.route.as_ref().map(RouteId::as_str), Some("api"));
        assert!((big.1["us"] - 0.7).abs() < 1e-9, "{:?}", big.1);
    }

    #[test]
    fn current_shares_come_from_the_most_specific_row() {
        let row = |region: &str, tenant: Option<&str>, share| ShareRow {
            region: region.into(),
            tenant: tenant.map(Into::into),
            route: None,
            share,
            updated_at: None,
        };
        let rows = [
            row("eu", None, 0.8),
            row("us", None, 0.2),
            row("eu", Some("t"), 0.3),
        ];
        assert_eq!(effective(&rows, "eu", 0.5, Some("t"), Some("api")), 0.3);
        assert_eq!(effective(&rows, "eu", 0.5, Some("x"), Some("api")), 0.8);
        assert_eq!(effective(&rows, "us", 0.5, None, None), 0.2);
        assert_eq!(effective(&[], "us", 0.5, None, None), 0.5);
        // Already at the demand ratio: nothing to write.
        let settled = [row("eu", None, 0.7), row("us", None, 0.3)];
        let none = plan_round(
            &regions(),
            &settled,
            &[demand("eu", "_other", 7.0), demand("us", "_other", 3.0)],
            P,
        );
        assert!(none.is_empty(), "{none:?}");
    }
}
