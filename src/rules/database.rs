//! The rule cache's side of a rules database.
//!
//! Owns the seam the cache loads through ([`RuleRows`], implemented by
//! [`RuleStore`] and by fakes in tests), a load bounded in time, the first
//! load's fallbacks (the saved snapshot, then the default rule alone), and
//! the writing of the snapshot file.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures_util::future::BoxFuture;

use super::cache::Reloads;
use super::model::{Limit, Rule, RuleSet, SnapshotOrigin};
use super::snapshot;
use crate::clock::unix_now_seconds;
use crate::db::{DbError, RuleStore};

/// Longest a full load from the database may take.
pub(super) const LOAD_TIMEOUT: Duration = Duration::from_secs(30);

/// What the rule cache needs of the rules table.
pub trait RuleRows: Send + Sync + 'static {
    /// Applies the migrations not yet applied.
    fn migrate(&self) -> BoxFuture<'static, Result<(), DbError>>;
    /// Every rule in the table.
    fn rules(&self) -> BoxFuture<'static, Result<Vec<Rule>, DbError>>;
}

impl RuleRows for RuleStore {
    fn migrate(&self) -> BoxFuture<'static, Result<(), DbError>> {
        let db = self.database().clone();
        Box::pin(async move { db.migrate().await })
    }

    fn rules(&self) -> BoxFuture<'static, Result<Vec<Rule>, DbError>> {
        let store = self.clone();
        Box::pin(async move { store.load_all().await })
    }
}

/// Migrates when asked, then reads every rule, within [`LOAD_TIMEOUT`].
///
/// # Errors
/// When the database fails or does not answer in time.
pub(super) async fn load(rows: &dyn RuleRows, migrate: bool) -> Result<Vec<Rule>, DbError> {
    let work = async {
        if migrate {
            rows.migrate().await?;
        }
        rows.rules().await
    };
    // A database that stops answering must not hold the cache forever.
    tokio::time::timeout(LOAD_TIMEOUT, work)
        .await
        .map_err(|_| DbError::Database(sqlx::Error::PoolTimedOut))?
}

/// Provenance stamped now.
pub(super) fn origin(source: &'static str) -> SnapshotOrigin {
    SnapshotOrigin {
        source,
        loaded_at_unix: unix_now_seconds(),
    }
}

/// The first load: the database, else the saved snapshot, else nothing but
/// the default rule. `migrate_pending` is cleared once migrations ran.
pub(super) async fn first_load(
    rows: &dyn RuleRows,
    migrate_pending: &mut bool,
    saver: &SnapshotSaver,
    default: Limit,
    reloads: &Reloads,
) -> RuleSet {
    let e = match load(rows, *migrate_pending).await {
        Ok(rules) => {
            *migrate_pending = false;
            let set = RuleSet::new(rules, default, origin("database"));
            reloads.first(set.len());
            tracing::info!(rules = set.len(), "Rules loaded from PostgreSQL.");
            saver.save(Arc::new(set.clone()));
            return set;
        }
        Err(e) => e,
    };
    reloads.failed();
    match saver.path.as_deref().map(snapshot::load) {
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

/// Saves snapshots off the actor's thread, never letting an older one
/// overwrite a newer one.
#[derive(Clone)]
pub(super) struct SnapshotSaver {
    /// Target file; `None` disables saving.
    path: Option<PathBuf>,
    /// Generation of the last save started, and of the last one written.
    generations: Arc<Mutex<(u64, u64)>>,
}

impl SnapshotSaver {
    /// A saver writing to `path`, or doing nothing without one.
    pub(super) fn new(path: Option<&Path>) -> Self {
        Self {
            path: path.map(Path::to_path_buf),
            generations: Arc::new(Mutex::new((0, 0))),
        }
    }

    /// Writes `set` in the background.
    pub(super) fn save(&self, set: Arc<RuleSet>) {
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
