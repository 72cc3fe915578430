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

use super::model::Regions;
use super::prom::{Demand, PromError, Prometheus};
use super::shares::{Scope, ScopeKey, effective};
use super::split::{SplitParams, rebalance};
use crate::config::RebalancerSettings;
use crate::db::DbError;
use crate::db::leader::LeaderLedger;
use crate::db::shares::{Decision, ShareRow, ShareStore};
use crate::key::{RouteId, TenantId, fingerprint};
use crate::telemetry::{Metrics, OTHER_TENANTS, RequestCounters, RoundResult};
use actix::fut::{ActorFutureExt, WrapFuture};
use actix::{Actor, Addr, AsyncContext, Context, Handler, Message};

/// Longest a round may take (leader check, Prometheus, database) before it
/// is abandoned, so a stuck connection cannot stop rebalancing.
const ROUND_TIMEOUT: Duration = Duration::from_secs(30);

/// Changes smaller than this are not written.
const MIN_CHANGE: f64 = 1e-4;

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

/// What a round needs of the database: the leader lock, the shares in
/// force, and the write of its changes.
pub(crate) trait Ledger {
    /// Whether this instance leads: keeps the lock it holds while its
    /// session answers, else tries to take it.
    async fn lead(&mut self) -> bool;
    /// Lets go of the lock, after a round that was abandoned half-way.
    fn resign(&mut self);
    /// The shares in force.
    async fn shares(&self) -> Result<Vec<ShareRow>, DbError>;
    /// Writes `changes` with the record of `decision`, as leader: one
    /// transaction, which fails when the lock has been lost.
    async fn record(
        &mut self,
        changes: &[(Scope, BTreeMap<String, f64>)],
        decision: &Decision<'_>,
    ) -> Result<(), DbError>;
}

/// Where the demand a round follows comes from.
pub(crate) trait DemandSource {
    /// Requests per second by region, tenant label and route over `window`.
    async fn demand(&self, window: Duration) -> Result<Vec<Demand>, PromError>;
}

impl DemandSource for Prometheus {
    async fn demand(&self, window: Duration) -> Result<Vec<Demand>, PromError> {
        Prometheus::demand(self, window).await
    }
}

/// What stays the same from round to round.
pub(crate) struct Plan {
    /// Knobs.
    pub settings: RebalancerSettings,
    /// Every region.
    pub regions: Arc<Regions>,
    /// This instance, named in the decisions it records.
    pub instance: String,
    /// Maps the tenant labels Prometheus reports back to tenant ids, and
    /// names tenants in logs.
    pub labels: Arc<RequestCounters>,
}

/// Starts the rebalancer on the current arbiter; send it [`Round`] on a
/// schedule.
pub fn start(
    settings: RebalancerSettings,
    regions: Arc<Regions>,
    store: ShareStore,
    instance: String,
    labels: Arc<RequestCounters>,
    metrics: Metrics,
) -> Addr<Rebalancer> {
    Rebalancer {
        prometheus: Prometheus::new(&settings.prometheus_url),
        plan: Arc::new(Plan {
            settings,
            regions,
            instance,
            labels,
        }),
        ledger: Some(LeaderLedger::new(store)),
        metrics,
    }
    .start()
}

/// The rebalancing actor.
pub struct Rebalancer {
    /// Where demand is read.
    prometheus: Prometheus,
    /// What every round works with.
    plan: Arc<Plan>,
    /// The shares and the leader lock; `None` while a round runs.
    ledger: Option<LeaderLedger>,
    /// Round counter.
    metrics: Metrics,
}

impl Actor for Rebalancer {
    type Context = Context<Self>;
}

/// Run one round now.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Round;

impl Handler<Round> for Rebalancer {
    type Result = ();

    fn handle(&mut self, _: Round, ctx: &mut Context<Self>) {
        let Some(mut ledger) = self.ledger.take() else {
            return;
        };
        let (prometheus, plan) = (self.prometheus.clone(), self.plan.clone());
        let work = async move {
            let result = round(&prometheus, &mut ledger, &plan).await;
            (ledger, result)
        };
        ctx.spawn(work.into_actor(self).map(|(ledger, result), actor, _| {
            actor.ledger = Some(ledger);
            actor.metrics.rebalance_round(result);
        }));
    }
}

/// One round: leads or stops, then follows demand. Bounded by
/// [`ROUND_TIMEOUT`]; an abandoned round lets go of the lock (its session
/// may be stuck), and the next round starts afresh.
pub(crate) async fn round(
    source: &impl DemandSource,
    ledger: &mut impl Ledger,
    plan: &Plan,
) -> RoundResult {
    let work = async {
        if !ledger.lead().await {
            return RoundResult::NotLeader;
        }
        run(source, ledger, plan).await
    };
    match tokio::time::timeout(ROUND_TIMEOUT, work).await {
        Ok(result) => result,
        Err(_) => {
            tracing::warn!(
                seconds = ROUND_TIMEOUT.as_secs(),
                "A rebalancer round did not finish in time; abandoned."
            );
            ledger.resign();
            RoundResult::Timeout
        }
    }
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
async fn run(source: &impl DemandSource, ledger: &mut impl Ledger, plan: &Plan) -> RoundResult {
    let (settings, regions) = (&plan.settings, &*plan.regions);
    let demand = match source.demand(settings.window).await {
        Ok(d) if d.iter().any(|d| d.rate > 0.0) => by_tenant_id(d, &plan.labels),
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
    let rows = match ledger.shares().await {
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
        instance: &plan.instance,
        changes: serde_json::Value::Array(record),
    };
    match ledger.record(&changes, &decision).await {
        Ok(()) => {
            for (scope, shares) in &changes {
                let tenant = scope.tenant.as_ref().map(|t| {
                    plan.labels
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

    /// The database in memory: leads when told to, records each write.
    #[derive(Default)]
    struct FakeLedger {
        /// Whether `lead` wins the lock.
        wins: bool,
        /// The shares in force.
        rows: Vec<ShareRow>,
        /// Whether reads and writes fail.
        broken: bool,
        /// What was written: the scopes changed and the recording instance.
        written: Vec<(usize, String)>,
        /// Lock taken and held.
        holds: bool,
    }

    impl Ledger for FakeLedger {
        async fn lead(&mut self) -> bool {
            self.holds = self.wins;
            self.holds
        }

        fn resign(&mut self) {
            self.holds = false;
        }

        async fn shares(&self) -> Result<Vec<ShareRow>, DbError> {
            if self.broken {
                return Err(DbError::Database(sqlx::Error::PoolTimedOut));
            }
            Ok(self.rows.clone())
        }

        async fn record(
            &mut self,
            changes: &[(Scope, BTreeMap<String, f64>)],
            decision: &Decision<'_>,
        ) -> Result<(), DbError> {
            if !self.holds {
                return Err(DbError::NotLeader);
            }
            self.written
                .push((changes.len(), decision.instance.to_owned()));
            Ok(())
        }
    }

    /// Prometheus answering `answer` after `delay`.
    struct FakeDemand {
        answer: Option<Vec<Demand>>,
        delay: Duration,
    }

    impl DemandSource for FakeDemand {
        async fn demand(&self, _: Duration) -> Result<Vec<Demand>, PromError> {
            tokio::time::sleep(self.delay).await;
            self.answer
                .clone()
                .ok_or_else(|| PromError::Request("connection refused".into()))
        }
    }

    fn plan() -> Plan {
        crate::telemetry::install();
        Plan {
            settings: RebalancerSettings {
                enabled: true,
                prometheus_url: "http://127.0.0.1:1".into(),
                interval: Duration::from_secs(60),
                window: Duration::from_secs(300),
                smoothing: P.smoothing,
                max_step: P.max_step,
                floor: P.floor,
            },
            regions: Arc::new(regions()),
            instance: "gw-1".into(),
            labels: Arc::new(RequestCounters::new(["api"], &[], 10)),
        }
    }

    fn skewed() -> FakeDemand {
        FakeDemand {
            answer: Some(vec![
                demand("eu", OTHER_TENANTS, 90.0),
                demand("us", OTHER_TENANTS, 10.0),
            ]),
            delay: Duration::from_secs(1),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_leader_writes_the_moved_shares_with_its_name() {
        let mut ledger = FakeLedger {
            wins: true,
            ..FakeLedger::default()
        };
        assert_eq!(
            round(&skewed(), &mut ledger, &plan()).await,
            RoundResult::Applied
        );
        assert_eq!(ledger.written, [(1, "gw-1".to_owned())]);
        // A second round on the shares already at the demand ratio.
        ledger.rows = ["eu", "us"]
            .into_iter()
            .zip([0.9, 0.1])
            .map(|(region, share)| ShareRow {
                region: region.into(),
                tenant: None,
                route: None,
                share,
                updated_at: None,
            })
            .collect();
        assert_eq!(
            round(&skewed(), &mut ledger, &plan()).await,
            RoundResult::Unchanged
        );
        assert_eq!(ledger.written.len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_follower_and_a_failing_source_write_nothing() {
        let mut follower = FakeLedger::default();
        assert_eq!(
            round(&skewed(), &mut follower, &plan()).await,
            RoundResult::NotLeader
        );
        let mut leader = FakeLedger {
            wins: true,
            ..FakeLedger::default()
        };
        let refused = FakeDemand {
            answer: None,
            delay: Duration::ZERO,
        };
        assert_eq!(
            round(&refused, &mut leader, &plan()).await,
            RoundResult::PrometheusError
        );
        for (demand, why) in [
            (demand("eu", OTHER_TENANTS, 0.0), "no traffic anywhere"),
            (demand("eu", OTHER_TENANTS, 5.0), "an unseen region"),
        ] {
            let answer = FakeDemand {
                answer: Some(vec![demand]),
                delay: Duration::ZERO,
            };
            let result = round(&answer, &mut leader, &plan()).await;
            assert_eq!(result, RoundResult::NoData, "{why}");
        }
        leader.broken = true;
        assert_eq!(
            round(&skewed(), &mut leader, &plan()).await,
            RoundResult::DatabaseError
        );
        assert!(follower.written.is_empty() && leader.written.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_round_past_its_time_is_abandoned_and_lets_go_of_the_lock() {
        let mut ledger = FakeLedger {
            wins: true,
            ..FakeLedger::default()
        };
        let stuck = FakeDemand {
            delay: ROUND_TIMEOUT * 2,
            ..skewed()
        };
        let started = tokio::time::Instant::now();
        assert_eq!(
            round(&stuck, &mut ledger, &plan()).await,
            RoundResult::Timeout
        );
        assert_eq!(started.elapsed(), ROUND_TIMEOUT);
        assert!(!ledger.holds && ledger.written.is_empty());
    }
}
