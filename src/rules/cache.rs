//! The rule cache actor and the handle the rest of the gateway uses.
//!
//! Owns the published rule snapshot. The `RuleCache` actor is the only
//! writer. Request handlers read the snapshot through
//! [`RulesHandle::snapshot`], an atomic pointer load: no lock, no mailbox.
//!
//! Sources:
//! - **file**: the file is checked every `rules.watch_interval_ms` and
//!   read once a change has held still for `rules.settle_ms`
//!   ([`FileWatch`]); a read whose contents equal those in force does no
//!   further work, and a file with no rule at all never replaces rules in
//!   force unless it says `rule = []`;
//! - **database**: a listener task follows `NOTIFY tollgate_rules` and hands
//!   each change to the actor, which batches changes arriving within
//!   [`BATCH_WINDOW`] into one new snapshot. Every time the listener
//!   (re)connects it asks for a full reload, so changes made while it was
//!   away are never lost. Each snapshot loaded from the database is saved to
//!   `rules.snapshot_file`; a gateway that starts while the database is down
//!   serves that copy (or only the default rule when there is none) and
//!   keeps retrying.
//!
//! Both sources are also reloaded in full by [`RulesHandle::reload`], which
//! the periodic safety-net job calls.
//!
//! Invariant: a failed reload never replaces the snapshot in force.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use actix::fut::{ActorFutureExt, WrapFuture};
use actix::{
    Actor, Addr, AsyncContext, AtomicResponse, Context, Handler, Message, ResponseActFuture,
};
use arc_swap::{ArcSwap, Guard};

use super::feed::{Feed, Notified, Resync};
use super::file::{self, FileChange, FileFingerprint, FileWatch, RuleFileError};
use super::model::{Limit, Rule, RuleSet, SnapshotOrigin};
use super::pg::{CHANNEL, Change, RuleStore, RuleStoreError};
use super::snapshot;
use crate::clock::{SharedClock, millis, unix_now_seconds};
use crate::config::{RuleSource, RulesSettings};
use crate::key::RouteId;
use crate::telemetry::{Metrics, RequestCounters};

/// Longest a full load from the database may take.
const LOAD_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a caller waits for the cache to answer a reload request.
const RELOAD_TIMEOUT: Duration = Duration::from_secs(40);
/// Changes arriving within this window are applied as one new snapshot.
pub const BATCH_WINDOW: Duration = Duration::from_millis(20);

/// Why rules could not be (re)loaded.
#[derive(Debug, thiserror::Error)]
pub enum RulesError {
    /// The rules file is unreadable or invalid.
    #[error(transparent)]
    File(#[from] RuleFileError),
    /// The database failed.
    #[error(transparent)]
    Store(#[from] RuleStoreError),
    /// The cache actor did not answer.
    #[error("rule cache is not answering")]
    Unavailable,
}

/// Read access to the rules in force, and a way to ask for a reload.
#[derive(Clone)]
pub struct RulesHandle {
    /// The published snapshot.
    snapshot: Arc<ArcSwap<RuleSet>>,
    /// The writer.
    cache: Addr<RuleCache>,
    /// The database, when rules come from one.
    store: Option<RuleStore>,
    /// The change feed, when rules come from a database.
    feed: Option<Feed>,
    /// This gateway's reloads since start.
    counts: Arc<ReloadCounts>,
}

impl RulesHandle {
    /// The rules in force now; cheap enough for every request.
    pub fn snapshot(&self) -> Guard<Arc<RuleSet>> {
        self.snapshot.load()
    }

    /// Reloads that failed since start (the rules in force stayed).
    pub fn failed_reloads(&self) -> u64 {
        self.counts.failed.load(Ordering::Relaxed)
    }

    /// Reloads that published new rules since start (the first load and
    /// rereads that found the rules in force excluded).
    pub fn applied_reloads(&self) -> u64 {
        self.counts.applied.load(Ordering::Relaxed)
    }

    /// The database the rules come from; `None` in file mode.
    pub fn store(&self) -> Option<&RuleStore> {
        self.store.as_ref()
    }

    /// Stops following database changes and closes the database pool, so
    /// no connection outlives the runtime.
    pub async fn shutdown(&self) {
        if let Some(feed) = &self.feed {
            feed.stop().await;
        }
        if let Some(store) = &self.store
            && tokio::time::timeout(Duration::from_secs(2), store.close())
                .await
                .is_err()
        {
            tracing::warn!("Database connections did not close within 2 s.");
        }
    }

    /// Reloads every rule from the source now.
    ///
    /// # Errors
    /// [`RulesError`] when the source fails; the old snapshot stays.
    pub async fn reload(&self) -> Result<usize, RulesError> {
        match tokio::time::timeout(RELOAD_TIMEOUT, self.cache.send(Reload)).await {
            Ok(Ok(result)) => result,
            _ => Err(RulesError::Unavailable),
        }
    }
}

/// Loads the rules once and starts the cache actor on the current arbiter.
///
/// In database mode this never fails for an unreachable database: it falls
/// back to the saved snapshot or the default rule and keeps retrying.
///
/// # Errors
/// [`RulesError`] when the rules file is invalid, or the database URL cannot
/// be used; nothing is started then.
pub async fn start(
    settings: &RulesSettings,
    default: Limit,
    metrics: Metrics,
    labels: Arc<RequestCounters>,
    clock: SharedClock,
) -> Result<RulesHandle, RulesError> {
    let reloads = Reloads {
        metrics,
        counts: Arc::new(ReloadCounts::default()),
    };
    let (source, first, store) = match &settings.source {
        RuleSource::File(path) => {
            let fingerprint = FileFingerprint::of(path);
            let contents = file::read(path)?;
            let parsed = file::parse_for(path, &contents, &settings.routes)?;
            let first = RuleSet::new(parsed.rules, default, origin("file"));
            reloads.first(first.len());
            tracing::info!(rules = first.len(), file = %path.display(), "Rules loaded.");
            let source = Source::File {
                path: path.clone(),
                watch: FileWatch::new(fingerprint, millis(settings.settle)),
                applied: Some(digest(&contents)),
                recheck: false,
                routes: settings.routes.clone(),
            };
            (source, first, None)
        }
        RuleSource::Database(url) => {
            let store = RuleStore::connect_lazy(url)?;
            let mut migrate_pending = settings.migrate_on_start;
            let first = first_database_load(
                &store,
                &mut migrate_pending,
                settings.snapshot_file.as_deref(),
                default,
                &reloads,
            )
            .await;
            let source = Source::Database {
                store: store.clone(),
                migrate_pending,
                saver: SnapshotSaver::new(settings.snapshot_file.clone()),
            };
            (source, first, Some(store))
        }
    };
    labels.label_tenants(first.tenants());
    let snapshot = Arc::new(ArcSwap::from_pointee(first));
    let cache = RuleCache {
        source,
        default,
        snapshot: snapshot.clone(),
        watch_interval: settings.watch_interval,
        clock,
        reloads: reloads.clone(),
        labels,
        pending: Vec::new(),
    }
    .start();
    let feed = store
        .as_ref()
        .map(|s| Feed::start(s.url().to_owned(), CHANNEL, cache.clone()));
    Ok(RulesHandle {
        snapshot,
        cache,
        store,
        feed,
        counts: reloads.counts,
    })
}

/// The first load in database mode: the database, else the saved snapshot,
/// else nothing but the default rule.
async fn first_database_load(
    store: &RuleStore,
    migrate_pending: &mut bool,
    snapshot_file: Option<&Path>,
    default: Limit,
    reloads: &Reloads,
) -> RuleSet {
    match load_database(store, *migrate_pending).await {
        Ok(rules) => {
            *migrate_pending = false;
            let set = RuleSet::new(rules, default, origin("database"));
            reloads.first(set.len());
            tracing::info!(rules = set.len(), "Rules loaded from PostgreSQL.");
            SnapshotSaver::new(snapshot_file.map(Path::to_path_buf)).save(Arc::new(set.clone()));
            set
        }
        Err(e) => {
            reloads.failed();
            let saved = snapshot_file.map(snapshot::load);
            match saved {
                Some(Ok((rules, loaded_at_unix))) => {
                    let origin = SnapshotOrigin {
                        source: "snapshot",
                        loaded_at_unix,
                    };
                    let set = RuleSet::new(rules, default, origin);
                    tracing::warn!(
                        error = %e,
                        rules = set.len(),
                        "The rules database cannot be read; serving the saved rule snapshot and retrying."
                    );
                    set
                }
                other => {
                    let reason = match other {
                        Some(Err(snap)) => snap.to_string(),
                        _ => "no snapshot file is configured".to_owned(),
                    };
                    tracing::error!(
                        error = %e,
                        snapshot = %reason,
                        "The rules database cannot be read and no saved rules exist; every tenant gets the default rule until it can."
                    );
                    RuleSet::new(Vec::new(), default, origin("default"))
                }
            }
        }
    }
}

/// Migrates when asked, then reads every rule.
async fn load_database(store: &RuleStore, migrate: bool) -> Result<Vec<Rule>, RuleStoreError> {
    let load = async {
        if migrate {
            store.migrate().await?;
        }
        store.load_all().await
    };
    // A database that stops answering must not hold the cache forever.
    tokio::time::timeout(LOAD_TIMEOUT, load)
        .await
        .map_err(|_| RuleStoreError::Database(sqlx::Error::PoolTimedOut))?
}

/// A digest of rules file contents, to tell a reread of the same file.
fn digest(contents: &str) -> u64 {
    use std::hash::{BuildHasher, BuildHasherDefault};
    BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default().hash_one(contents)
}

/// Provenance stamped now.
fn origin(source: &'static str) -> SnapshotOrigin {
    SnapshotOrigin {
        source,
        loaded_at_unix: unix_now_seconds(),
    }
}

/// Where the actor reads rules from.
enum Source {
    /// A TOML file.
    File {
        /// The file.
        path: PathBuf,
        /// Tells when it changed and held still.
        watch: FileWatch,
        /// Digest of the contents in force.
        applied: Option<u64>,
        /// Whether a look at a settling file is already scheduled.
        recheck: bool,
        /// The configured route ids; a file naming another is refused.
        routes: Vec<RouteId>,
    },
    /// The `rate_limit_rule` table.
    Database {
        /// Queries.
        store: RuleStore,
        /// Migrations still to apply before the next load.
        migrate_pending: bool,
        /// Writes the on-disk copy.
        saver: SnapshotSaver,
    },
}

/// Saves snapshots off the actor's thread, never letting an older one
/// overwrite a newer one.
#[derive(Clone)]
struct SnapshotSaver {
    /// Target file; `None` disables saving.
    path: Option<PathBuf>,
    /// Generation of the last save started, and of the last one written.
    generations: Arc<Mutex<(u64, u64)>>,
}

impl SnapshotSaver {
    fn new(path: Option<PathBuf>) -> Self {
        Self {
            path,
            generations: Arc::new(Mutex::new((0, 0))),
        }
    }

    /// Writes `set` in the background.
    fn save(&self, set: Arc<RuleSet>) {
        let Some(path) = self.path.clone() else {
            return;
        };
        let generations = self.generations.clone();
        let generation = {
            let mut g = generations.lock().unwrap_or_else(PoisonError::into_inner);
            g.0 += 1;
            g.0
        };
        tokio::task::spawn_blocking(move || {
            let mut g = generations.lock().unwrap_or_else(PoisonError::into_inner);
            if generation < g.1 {
                return;
            }
            match snapshot::save(&path, &set) {
                Ok(()) => g.1 = generation,
                Err(e) => {
                    tracing::warn!(error = %e, file = %path.display(), "Cannot save the rule snapshot.")
                }
            }
        });
    }
}

/// Counts reloads: in metrics (shared by every gateway of a process) and
/// for this gateway alone (its `/ready`).
#[derive(Clone)]
struct Reloads {
    /// `tollgate_rule_reloads_total`.
    metrics: Metrics,
    /// This gateway's counts.
    counts: Arc<ReloadCounts>,
}

/// One gateway's reloads since start.
#[derive(Default)]
struct ReloadCounts {
    /// Reloads that published rules (the first load excluded).
    applied: AtomicU64,
    /// Reloads that failed.
    failed: AtomicU64,
}

impl Reloads {
    /// The first load, which published `n` rules.
    fn first(&self, n: usize) {
        self.metrics.rule_reload(Some(n));
    }

    /// A reload that published `n` rules.
    fn ok(&self, n: usize) {
        self.metrics.rule_reload(Some(n));
        self.counts.applied.fetch_add(1, Ordering::Relaxed);
    }

    /// A reload that failed; the snapshot in force stays.
    fn failed(&self) {
        self.metrics.rule_reload(None);
        self.counts.failed.fetch_add(1, Ordering::Relaxed);
    }
}

/// The actor that owns rule reloading.
struct RuleCache {
    /// Where rules come from.
    source: Source,
    /// Limit for pairs without a rule.
    default: Limit,
    /// Where snapshots are published.
    snapshot: Arc<ArcSwap<RuleSet>>,
    /// How often to look at the rules file.
    watch_interval: Duration,
    /// Times how long a changed rules file holds still.
    clock: SharedClock,
    /// Reload counters.
    reloads: Reloads,
    /// Request counters, whose tenant labels follow the rules.
    labels: Arc<RequestCounters>,
    /// Database changes not yet applied.
    pending: Vec<Change>,
}

impl RuleCache {
    /// Replaces the snapshot with `set` and records the reload.
    fn publish(&mut self, set: RuleSet) -> usize {
        let n = set.len();
        self.labels.label_tenants(set.tenants());
        let set = Arc::new(set);
        self.snapshot.store(set.clone());
        self.reloads.ok(n);
        if let Source::Database { saver, .. } = &self.source {
            saver.save(set);
        }
        n
    }

    /// A full reload from the source, published when it succeeds.
    fn full_reload(&mut self) -> ResponseActFuture<Self, Result<usize, RulesError>> {
        let default = self.default;
        // Changes received so far were committed before this reload reads,
        // so it includes them; applying them again afterwards could revive
        // a rule deleted in between.
        self.pending.clear();
        match &mut self.source {
            Source::File { .. } => {
                let result = self
                    .reload_file()
                    .map(|applied| applied.unwrap_or_else(|| self.snapshot.load().len()));
                Box::pin(actix::fut::ready(result))
            }
            Source::Database {
                store,
                migrate_pending,
                ..
            } => {
                let (store, migrate) = (store.clone(), *migrate_pending);
                Box::pin(
                    async move { load_database(&store, migrate).await }
                        .into_actor(self)
                        .map(move |result, cache, _| match result {
                            Ok(rules) => {
                                if let Source::Database {
                                    migrate_pending, ..
                                } = &mut cache.source
                                {
                                    *migrate_pending = false;
                                }
                                Ok(cache.publish(RuleSet::new(rules, default, origin("database"))))
                            }
                            Err(e) => {
                                cache.reloads.failed();
                                Err(e.into())
                            }
                        }),
                )
            }
        }
    }

    /// Reads the rules file and publishes its rules; `None` when its
    /// contents are those in force (nothing else is done then).
    ///
    /// # Errors
    /// When the file is unreadable or invalid, or holds no rule without
    /// saying so while rules are in force; the rules in force stay.
    fn reload_file(&mut self) -> Result<Option<usize>, RulesError> {
        let Source::File {
            path,
            watch,
            applied,
            routes,
            ..
        } = &mut self.source
        else {
            return Ok(None);
        };
        watch.was_read(FileFingerprint::of(path));
        let read = file::read(path).and_then(|contents| {
            let digest = digest(&contents);
            if *applied == Some(digest) {
                return Ok(None);
            }
            let parsed = file::parse_for(path, &contents, routes)?;
            if parsed.rules.is_empty() && !parsed.declares_empty && !self.snapshot.load().is_empty()
            {
                return Err(RuleFileError::Emptied { path: path.clone() });
            }
            Ok(Some((digest, parsed.rules)))
        });
        match read {
            Ok(None) => Ok(None),
            Ok(Some((digest, rules))) => {
                *applied = Some(digest);
                let set = RuleSet::new(rules, self.default, origin("file"));
                Ok(Some(self.publish(set)))
            }
            Err(e) => {
                self.reloads.failed();
                Err(e.into())
            }
        }
    }

    /// Reads the rules file once a change has held still for the settle
    /// time; while it settles, looks again when that time is up.
    fn poll_file(&mut self, ctx: &mut Context<Self>) {
        let now = self.clock.now_ms();
        let Source::File {
            path,
            watch,
            recheck,
            ..
        } = &mut self.source
        else {
            return;
        };
        match watch.look(FileFingerprint::of(path), now) {
            FileChange::None => {}
            FileChange::Settling(_) if *recheck => {}
            FileChange::Settling(wait_ms) => {
                *recheck = true;
                ctx.run_later(Duration::from_millis(wait_ms), |cache, ctx| {
                    if let Source::File { recheck, .. } = &mut cache.source {
                        *recheck = false;
                    }
                    cache.poll_file(ctx);
                });
            }
            FileChange::Settled => {
                let file = path.display().to_string();
                match self.reload_file() {
                    Ok(Some(n)) => {
                        tracing::info!(rules = n, file, "Rules file changed; rules reloaded.")
                    }
                    Ok(None) => {
                        tracing::debug!(file, "Rules file rewritten with the rules in force.")
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "Rules file changed but cannot be used; the previous rules stay in force.")
                    }
                }
            }
        }
    }

    /// Applies every pending database change as one new snapshot.
    fn flush(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let mut next = RuleSet::clone(&self.snapshot.load());
        for change in self.pending.drain(..) {
            match change {
                Change::Upsert(rule) => next.upsert(&rule),
                Change::Delete(tenant, route) => next.remove(&tenant, &route),
                Change::Reload => {}
            }
        }
        next.set_origin(origin("database"));
        let n = self.publish(next);
        tracing::debug!(rules = n, "Rule changes applied.");
    }
}

impl Actor for RuleCache {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        if let Source::File { .. } = &self.source {
            ctx.run_interval(self.watch_interval, Self::poll_file);
        }
    }
}

/// Ask the cache to reload everything now.
#[derive(Message)]
#[rtype(result = "Result<usize, RulesError>")]
struct Reload;

impl Handler<Reload> for RuleCache {
    type Result = AtomicResponse<Self, Result<usize, RulesError>>;

    fn handle(&mut self, _: Reload, _: &mut Context<Self>) -> Self::Result {
        AtomicResponse::new(self.full_reload())
    }
}

impl Handler<Resync> for RuleCache {
    type Result = AtomicResponse<Self, ()>;

    fn handle(&mut self, _: Resync, _: &mut Context<Self>) -> Self::Result {
        AtomicResponse::new(Box::pin(self.full_reload().map(|result, _, _| match result {
            Ok(n) => tracing::info!(rules = n, "Following rule changes in PostgreSQL; all rules reloaded."),
            Err(e) => tracing::warn!(error = %e, "Rule resync failed; the previous rules stay in force."),
        })))
    }
}

impl Handler<Notified> for RuleCache {
    type Result = ();

    fn handle(&mut self, Notified(payload): Notified, ctx: &mut Context<Self>) {
        let Some(change) = Change::parse(&payload) else {
            tracing::warn!(payload, "Ignoring an unknown rule notification.");
            return;
        };
        if change == Change::Reload {
            ctx.notify(Resync);
            return;
        }
        if self.pending.is_empty() {
            ctx.run_later(BATCH_WINDOW, |cache, _| cache.flush());
        }
        self.pending.push(change);
    }
}
