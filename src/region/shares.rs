//! Region shares: the splitter that follows the `region_share` table and
//! the snapshot the request path reads.
//!
//! Owns this region's share of every limit. The splitter actor loads every
//! `region_share` row, follows `NOTIFY tollgate_shares` (any change reloads
//! every row: the table holds at most a row per region and labelled tenant),
//! and publishes a [`ShareSet`]; requests read it with one atomic load and
//! at most four hash probes (tenant+route, tenant, route, global), then
//! scale their rule by the share. Without regions every share is 1.
//!
//! Invariant: a share in force is in [`super::model::MIN_SHARE`, 1]; the shares of one scope across regions
//! sum to 1 when written through the admin API or the rebalancer.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use actix::fut::{ActorFutureExt, WrapFuture};
use actix::{Actor, Addr, AsyncContext, AtomicResponse, Context, Handler};
use arc_swap::{ArcSwap, Guard};

use super::model::{Regions, check_share};
use crate::db::Database;
use crate::db::feed::{Feed, Notified, Resync};
use crate::db::shares::{CHANNEL, ShareRow, ShareStore};
use crate::key::{PAIR_KEY_BUF, RouteId, TenantId, fingerprint, pair_key};
use crate::telemetry::{Metrics, RequestCounters};

/// Changes arriving within this window cause one reload.
const BATCH_WINDOW: Duration = Duration::from_millis(20);

/// The scope of a share: a tenant and/or route, or everything.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Scope {
    /// Tenant, or `None` for every tenant.
    pub tenant: Option<TenantId>,
    /// Route, or `None` for every route.
    pub route: Option<RouteId>,
}

/// The shares in force.
#[derive(Debug, Clone)]
pub struct ShareSet {
    /// This region's share where no row applies.
    default: f64,
    /// This region's shares by scope key (`t/r`, `t/`, `/r`, `/`).
    local: HashMap<Arc<str>, f64>,
    /// Every row of every region, for `/admin/shares`.
    rows: Vec<ShareRow>,
}

impl ShareSet {
    /// Every share is 1: no regions.
    pub fn whole() -> Self {
        Self {
            default: 1.0,
            local: HashMap::new(),
            rows: Vec::new(),
        }
    }

    /// The shares of `region` (whose default is `default`) from `rows`; a
    /// row whose share [`check_share`] refuses is ignored (its scope keeps
    /// the default) and logged.
    pub fn new(region: &str, default: f64, rows: Vec<ShareRow>) -> Self {
        let local = rows
            .iter()
            .filter(|r| r.region == region)
            .filter(|r| match check_share(r.share) {
                Ok(_) => true,
                Err(message) => {
                    tracing::warn!(
                        tenant = r.tenant.as_deref().unwrap_or("*"),
                        route = r.route.as_deref().unwrap_or("*"),
                        problem = %message,
                        "A region_share row is ignored; its scope keeps the region's default share."
                    );
                    false
                }
            })
            .filter_map(|r| {
                let (tenant, route) = (r.tenant.as_deref(), r.route.as_deref());
                let mut buf = [0; PAIR_KEY_BUF];
                let key = pair_key(&mut buf, tenant.unwrap_or(""), route.unwrap_or(""))?;
                Some((Arc::from(key), r.share))
            })
            .collect();
        Self {
            default,
            local,
            rows,
        }
    }

    /// This region's share of `tenant`'s limit on `route`: the most
    /// specific row, else the region's default.
    pub fn share_for(&self, tenant: &str, route: &str) -> f64 {
        if self.local.is_empty() {
            return self.default;
        }
        let mut buf = [0; PAIR_KEY_BUF];
        for (t, r) in [(tenant, route), (tenant, ""), ("", route), ("", "")] {
            if let Some(share) = pair_key(&mut buf, t, r).and_then(|k| self.local.get(k)) {
                return *share;
            }
        }
        self.default
    }

    /// Every row.
    pub fn rows(&self) -> &[ShareRow] {
        &self.rows
    }
}

/// Read access to the shares in force.
#[derive(Clone)]
pub struct SharesHandle {
    /// The published snapshot.
    snapshot: Arc<ArcSwap<ShareSet>>,
    /// The database, in database mode with regions.
    store: Option<ShareStore>,
    /// The change feed, with it.
    feed: Option<Feed>,
    /// The splitter, with it.
    splitter: Option<Addr<Splitter>>,
    /// Every region, when regions are used.
    regions: Option<Arc<Regions>>,
}

impl SharesHandle {
    /// Shares that are always 1 (no regions).
    pub fn whole() -> Self {
        Self {
            snapshot: Arc::new(ArcSwap::from_pointee(ShareSet::whole())),
            store: None,
            feed: None,
            splitter: None,
            regions: None,
        }
    }

    /// Reloads every share row now (the periodic safety net behind
    /// `NOTIFY`); a no-op without a database.
    pub async fn reload(&self) {
        if let Some(splitter) = &self.splitter {
            let _ = tokio::time::timeout(Duration::from_secs(40), splitter.send(Resync)).await;
        }
    }

    /// The shares in force now; cheap enough for every request.
    pub fn snapshot(&self) -> Guard<Arc<ShareSet>> {
        self.snapshot.load()
    }

    /// Where shares are stored; `None` without regions or a database.
    pub fn store(&self) -> Option<&ShareStore> {
        self.store.as_ref()
    }

    /// Every region; `None` when regions are not used.
    pub fn regions(&self) -> Option<&Regions> {
        self.regions.as_deref()
    }

    /// Stops following share changes.
    pub async fn shutdown(&self) {
        if let Some(feed) = &self.feed {
            feed.stop().await;
        }
    }
}

/// Starts the splitter for `region` (one of `regions`): with `db`, it loads and follows `region_share`; without, every share is
/// the region's default.
pub fn start(
    region: &str,
    regions: Arc<Regions>,
    db: Option<&Database>,
    labels: Arc<RequestCounters>,
    metrics: Metrics,
) -> SharesHandle {
    let default = regions.get(region).map_or(1.0, |r| r.default_share);
    let first = ShareSet::new(region, default, Vec::new());
    let mut exported = BTreeSet::new();
    export(&regions, &first, &mut exported, &labels, &metrics);
    let snapshot = Arc::new(ArcSwap::from_pointee(first));
    let Some(db) = db else {
        return SharesHandle {
            snapshot,
            store: None,
            feed: None,
            splitter: None,
            regions: Some(regions),
        };
    };
    let store = ShareStore::new(db.clone());
    let splitter = Splitter {
        region: region.to_owned(),
        default,
        regions: regions.clone(),
        store: store.clone(),
        snapshot: snapshot.clone(),
        metrics,
        labels,
        exported,
        reload_scheduled: false,
    }
    .start();
    let feed = Feed::start(db.url().to_owned(), CHANNEL, splitter.clone());
    SharesHandle {
        snapshot,
        store: Some(store),
        feed: Some(feed),
        splitter: Some(splitter),
        regions: Some(regions),
    }
}

/// The effective share of `region` (default `default`) for a scope: the most
/// specific row that covers it.
pub fn effective(
    rows: &[ShareRow],
    region: &str,
    default: f64,
    tenant: Option<&str>,
    route: Option<&str>,
) -> f64 {
    let candidates = [(tenant, route), (tenant, None), (None, route), (None, None)];
    candidates
        .iter()
        .find_map(|(t, r)| {
            rows.iter()
                .find(|row| {
                    row.region == region
                        && row.tenant.as_deref() == *t
                        && row.route.as_deref() == *r
                })
                .map(|row| row.share)
        })
        .unwrap_or(default)
}

/// A scope as `(tenant, route)`, `None` standing for every one.
pub type ScopeKey = (Option<String>, Option<String>);

/// Sets `tollgate_region_share` for every region's global share and, in
/// every region, for every scope that has or ever had a row (`exported`
/// remembers them, as many as the series already published): a deleted
/// row's gauge shows the share in force for its scope, not the row's last
/// value.
/// Tenants show as their labels ([`RequestCounters::label_of`], else a
/// fingerprint), never as their keys.
fn export(
    regions: &Regions,
    set: &ShareSet,
    exported: &mut BTreeSet<ScopeKey>,
    labels: &RequestCounters,
    metrics: &Metrics,
) {
    for region in &regions.all {
        let global = effective(&set.rows, &region.id, region.default_share, None, None);
        metrics.region_share(&region.id, None, None, global);
    }
    exported.extend(
        set.rows
            .iter()
            .filter(|r| r.tenant.is_some() || r.route.is_some())
            .map(|r| (r.tenant.clone(), r.route.clone())),
    );
    // A published series stays until restart whatever is done here, so a
    // deleted scope's gauge keeps following the share in force for it.
    for (tenant, route) in exported.iter() {
        let (tenant, route) = (tenant.as_deref(), route.as_deref());
        let label = tenant.map(|t| {
            labels
                .label_of(t)
                .map_or_else(|| fingerprint(t), |l| l.to_string())
        });
        for region in &regions.all {
            let share = effective(&set.rows, &region.id, region.default_share, tenant, route);
            metrics.region_share(&region.id, label.as_deref(), route, share);
        }
    }
}

/// The actor that owns this region's share snapshot.
pub struct Splitter {
    /// This region.
    region: String,
    /// Its default share.
    default: f64,
    /// Every region.
    regions: Arc<Regions>,
    /// Queries.
    store: ShareStore,
    /// Where snapshots are published.
    snapshot: Arc<ArcSwap<ShareSet>>,
    /// The share gauge.
    metrics: Metrics,
    /// Tenant labels for the gauge.
    labels: Arc<RequestCounters>,
    /// Scopes that ever had a row (each already has a published series).
    exported: BTreeSet<ScopeKey>,
    /// Whether a reload is already queued.
    reload_scheduled: bool,
}

impl Splitter {
    fn reload(&mut self) -> actix::ResponseActFuture<Self, ()> {
        let store = self.store.clone();
        Box::pin(async move { store.load_all().await }.into_actor(self).map(|result, s, _| {
            s.reload_scheduled = false;
            match result {
                Ok(rows) => {
                    let set = ShareSet::new(&s.region, s.default, rows);
                    export(&s.regions, &set, &mut s.exported, &s.labels, &s.metrics);
                    s.snapshot.store(Arc::new(set));
                }
                Err(e) => tracing::warn!(error = %e, "Cannot load region shares; the previous ones stay."),
            }
        }))
    }
}

impl Actor for Splitter {
    type Context = Context<Self>;
}

impl Handler<Resync> for Splitter {
    type Result = AtomicResponse<Self, ()>;

    fn handle(&mut self, _: Resync, _: &mut Context<Self>) -> Self::Result {
        AtomicResponse::new(self.reload())
    }
}

impl Handler<Notified> for Splitter {
    type Result = ();

    fn handle(&mut self, _: Notified, ctx: &mut Context<Self>) {
        if !self.reload_scheduled {
            self.reload_scheduled = true;
            ctx.run_later(BATCH_WINDOW, |_, ctx| ctx.notify(Resync));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(region: &str, tenant: Option<&str>, route: Option<&str>, share: f64) -> ShareRow {
        ShareRow {
            region: region.into(),
            tenant: tenant.map(Into::into),
            route: route.map(Into::into),
            share,
            updated_at: None,
        }
    }

    #[test]
    fn a_deleted_rows_gauge_shows_the_share_now_in_force() {
        use crate::region::model::RegionSpec;

        let handle = crate::telemetry::install();
        let spec = |id: &str, default_share| RegionSpec {
            id: id.into(),
            default_share,
            redis: crate::config::RedisTarget::LocalOnly,
        };
        let regions = Regions {
            all: vec![spec("gauge-eu", 0.5), spec("gauge-us", 0.5)],
        };
        let gauge = |region: &str| {
            let line = format!(
                "tollgate_region_share{{region=\"{region}\",tenant=\"Gauge T\",route=\"api\"}} "
            );
            let text = handle.render();
            text.lines()
                .find_map(|l| l.strip_prefix(line.as_str()).map(str::to_owned))
                .unwrap_or_else(|| panic!("no {line} in\n{text}"))
        };
        let (metrics, mut exported) = (Metrics::new(), BTreeSet::new());
        let labels = RequestCounters::new(["api"], &[], 10);
        let name = crate::key::TenantName::parse("Gauge T").unwrap();
        labels.label_tenants([("gauge-t", Some(&name))]);
        // Exports `eu`/`us` shares of `scope` and reads the scoped gauges.
        let mut step = |scope: Option<(&str, &str)>, eu: f64, us: f64| {
            let (tenant, route) = (scope.map(|s| s.0), scope.map(|s| s.1));
            let rows = vec![
                row("gauge-eu", tenant, route, eu),
                row("gauge-us", tenant, route, us),
            ];
            let set = ShareSet::new("gauge-eu", 0.5, rows);
            export(&regions, &set, &mut exported, &labels, &metrics);
            (gauge("gauge-eu"), gauge("gauge-us"))
        };
        let scoped = Some(("gauge-t", "api"));
        assert_eq!(step(scoped, 0.75, 0.25), ("0.75".into(), "0.25".into()));
        // The scoped rows are gone: the gauge shows the global share.
        assert_eq!(step(None, 0.6, 0.4), ("0.6".into(), "0.4".into()));
        // And it keeps following the global share afterwards.
        assert_eq!(step(None, 0.7, 0.3), ("0.7".into(), "0.3".into()));
    }

    #[test]
    fn the_most_specific_row_wins_then_the_default() {
        let set = ShareSet::new(
            "eu",
            0.7,
            vec![
                row("eu", None, None, 0.6),
                row("us", None, None, 0.4),
                row("eu", Some("big"), None, 0.9),
                row("eu", None, Some("search"), 0.5),
                row("eu", Some("big"), Some("search"), 0.8),
            ],
        );
        assert_eq!(set.share_for("big", "search"), 0.8);
        assert_eq!(set.share_for("big", "orders"), 0.9);
        assert_eq!(set.share_for("small", "search"), 0.5);
        assert_eq!(set.share_for("small", "orders"), 0.6);
        assert_eq!(
            ShareSet::new("eu", 0.7, vec![row("us", None, None, 0.4)]).share_for("x", "y"),
            0.7
        );
        assert_eq!(ShareSet::whole().share_for("x", "y"), 1.0);
    }

    #[test]
    fn a_row_below_the_share_floor_is_ignored() {
        let set = ShareSet::new(
            "eu",
            0.7,
            vec![
                row("eu", None, None, 5e-324),
                row("eu", Some("t"), None, 1e-17),
                row("eu", Some("u"), None, f64::NAN),
                row("eu", Some("v"), None, 0.001),
            ],
        );
        assert_eq!(set.share_for("t", "api"), 0.7, "the region's default");
        assert_eq!(set.share_for("u", "api"), 0.7);
        assert_eq!(set.share_for("v", "api"), 0.001, "the floor itself holds");
    }
}
