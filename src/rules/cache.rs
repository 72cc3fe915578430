//! The rule cache actor and the handle the rest of the gateway uses.
//!
//! Owns the published rule snapshot. The `RuleCache` actor is the only
//! writer: it reloads when the rules file changes (checked every
//! `rules.watch_interval_ms`) and when asked through [`RulesHandle::reload`]
//! (the periodic safety-net job). Request handlers read the snapshot through
//! [`RulesHandle::snapshot`], an atomic pointer load: no lock, no mailbox.
//!
//! Invariant: a failed reload never replaces the snapshot in force.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use actix::{Actor, Addr, AsyncContext, Context, Handler, Message};
use arc_swap::{ArcSwap, Guard};

use super::file::{self, FileFingerprint, RuleFileError};
use super::model::{Limit, RuleSet, SnapshotOrigin};
use crate::clock::unix_now_seconds;
use crate::config::RuleSource;
use crate::telemetry::Metrics;

/// How long a caller waits for the cache to answer a reload request.
const RELOAD_TIMEOUT: Duration = Duration::from_secs(10);

/// Why rules could not be (re)loaded.
#[derive(Debug, thiserror::Error)]
pub enum RulesError {
    /// The rules file is unreadable or invalid.
    #[error(transparent)]
    File(#[from] RuleFileError),
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
}

impl RulesHandle {
    /// The rules in force now; cheap enough for every request.
    pub fn snapshot(&self) -> Guard<Arc<RuleSet>> {
        self.snapshot.load()
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
/// # Errors
/// [`RulesError`] when the initial load fails; nothing is started then.
pub fn start(
    source: &RuleSource,
    default: Limit,
    watch_interval: Duration,
    metrics: Metrics,
) -> Result<RulesHandle, RulesError> {
    let RuleSource::File(path) = source;
    let fingerprint = FileFingerprint::of(path);
    let first = read(path, default)?;
    metrics.rule_reload(Some(first.len()));
    tracing::info!(rules = first.len(), file = %path.display(), "Rules loaded.");
    let snapshot = Arc::new(ArcSwap::from_pointee(first));
    let cache = RuleCache {
        path: path.clone(),
        fingerprint,
        default,
        snapshot: snapshot.clone(),
        watch_interval,
        metrics,
    }
    .start();
    Ok(RulesHandle { snapshot, cache })
}

/// Reads the file into a snapshot.
fn read(path: &Path, default: Limit) -> Result<RuleSet, RuleFileError> {
    let rules = file::load(path)?;
    let origin = SnapshotOrigin {
        source: "file",
        loaded_at_unix: unix_now_seconds(),
    };
    Ok(RuleSet::new(rules, default, origin))
}

/// The actor that owns rule reloading.
struct RuleCache {
    /// The rules file.
    path: PathBuf,
    /// The file's fingerprint at the last read attempt.
    fingerprint: Option<FileFingerprint>,
    /// Limit for pairs without a rule.
    default: Limit,
    /// Where snapshots are published.
    snapshot: Arc<ArcSwap<RuleSet>>,
    /// How often to look at the file.
    watch_interval: Duration,
    /// Reload counters.
    metrics: Metrics,
}

impl RuleCache {
    /// Reads the file and publishes it; keeps the old snapshot on failure.
    fn reload(&mut self) -> Result<usize, RuleFileError> {
        self.fingerprint = FileFingerprint::of(&self.path);
        match read(&self.path, self.default) {
            Ok(set) => {
                let n = set.len();
                self.snapshot.store(Arc::new(set));
                self.metrics.rule_reload(Some(n));
                Ok(n)
            }
            Err(e) => {
                self.metrics.rule_reload(None);
                Err(e)
            }
        }
    }

    /// Reloads when the file's fingerprint changed since the last attempt.
    fn poll_file(&mut self) {
        if FileFingerprint::of(&self.path) == self.fingerprint {
            return;
        }
        match self.reload() {
            Ok(n) => {
                tracing::info!(rules = n, file = %self.path.display(), "Rules file changed; rules reloaded.")
            }
            Err(e) => {
                tracing::error!(error = %e, "Rules file changed but is invalid; the previous rules stay in force.")
            }
        }
    }
}

impl Actor for RuleCache {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.run_interval(self.watch_interval, |cache, _| cache.poll_file());
    }
}

/// Ask the cache to reload everything now.
#[derive(Message)]
#[rtype(result = "Result<usize, RulesError>")]
struct Reload;

impl Handler<Reload> for RuleCache {
    type Result = Result<usize, RulesError>;

    fn handle(&mut self, _: Reload, _: &mut Context<Self>) -> Self::Result {
        self.reload().map_err(RulesError::from)
    }
}
