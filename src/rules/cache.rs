//! The rule cache actor: the only writer of the published rule snapshot
//! (readers hold a [`RulesHandle`](super::RulesHandle)).
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
//!   away are never lost. The cache reads the table through the
//!   [`RuleRows`] seam; loading, the first load's fallbacks and the saved
//!   copy (`rules.snapshot_file`) are in [`super::database`].
//!
//! Both sources are also reloaded in full by [`RulesHandle::reload`](super::RulesHandle::reload), which
//! the periodic safety-net job calls.
//!
//! Invariant: a failed reload never replaces the snapshot in force.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use actix::fut::{ActorFutureExt, WrapFuture};
use actix::{
    Actor, Addr, AsyncContext, AtomicResponse, Context, Handler, Message, ResponseActFuture,
};
use arc_swap::ArcSwap;

use super::database::{self, RuleRows, SnapshotSaver, origin};
use super::file::{self, FileChange, FileFingerprint, FileWatch, RuleFileError};
use super::handle::RulesError;
use super::model::{Limit, RuleSet};
use crate::clock::SharedClock;
use crate::db::feed::{Notified, Resync};
use crate::db::rules::Change;
use crate::key::RouteId;
use crate::telemetry::{Metrics, RequestCounters};

/// Changes arriving within this window are applied as one new snapshot.
pub const BATCH_WINDOW: Duration = Duration::from_millis(20);

/// What a cache is started with, whatever its source.
pub(super) struct Parts {
    /// Limit for pairs without a rule.
    pub default: Limit,
    /// How often to look at the rules file.
    pub watch_interval: Duration,
    /// Times how long a changed rules file holds still.
    pub clock: SharedClock,
    /// Reload counters.
    pub reloads: Reloads,
    /// Request counters, whose tenant labels follow the rules.
    pub labels: Arc<RequestCounters>,
}

/// A digest of rules file contents, to tell a reread of the same file.
pub(super) fn digest(contents: &str) -> u64 {
    use std::hash::{BuildHasher, BuildHasherDefault};
    BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default().hash_one(contents)
}

/// Where the actor reads rules from.
pub(super) enum Source {
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
        /// The rules table.
        rows: Arc<dyn RuleRows>,
        /// Migrations still to apply before the next load.
        migrate_pending: bool,
        /// Writes the on-disk copy.
        saver: SnapshotSaver,
    },
}

/// Counts reloads: in metrics (shared by every gateway of a process) and
/// for this gateway alone (its `/ready`).
#[derive(Clone)]
pub(super) struct Reloads {
    /// `tollgate_rule_reloads_total`.
    pub metrics: Metrics,
    /// This gateway's counts.
    pub counts: Arc<ReloadCounts>,
}

/// One gateway's reloads since start.
#[derive(Default)]
pub(super) struct ReloadCounts {
    /// Reloads that published rules (the first load excluded).
    pub applied: AtomicU64,
    /// Reloads that failed.
    pub failed: AtomicU64,
}

impl Reloads {
    /// The first load, which published `n` rules.
    pub(super) fn first(&self, n: usize) {
        self.metrics.rule_reload(Some(n));
    }

    /// A reload that published `n` rules.
    fn ok(&self, n: usize) {
        self.metrics.rule_reload(Some(n));
        self.counts.applied.fetch_add(1, Ordering::Relaxed);
    }

    /// A reload that failed; the snapshot in force stays.
    pub(super) fn failed(&self) {
        self.metrics.rule_reload(None);
        self.counts.failed.fetch_add(1, Ordering::Relaxed);
    }
}

/// The actor that owns rule reloading.
pub(super) struct RuleCache {
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
    /// Starts a cache on the current arbiter, publishing into `snapshot`.
    pub(super) fn spawn(
        source: Source,
        snapshot: Arc<ArcSwap<RuleSet>>,
        parts: Parts,
    ) -> Addr<Self> {
        Self {
            source,
            default: parts.default,
            snapshot,
            watch_interval: parts.watch_interval,
            clock: parts.clock,
            reloads: parts.reloads,
            labels: parts.labels,
            pending: Vec::new(),
        }
        .start()
    }

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
                rows,
                migrate_pending,
                ..
            } => {
                let (rows, migrate) = (rows.clone(), *migrate_pending);
                Box::pin(
                    async move { database::load(&*rows, migrate).await }
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
pub(super) struct Reload;

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
