//! The handle the rest of the gateway holds on the rules: the snapshot
//! in force, reloads on demand, and the start of a cache for the
//! configured source.
//!
//! Request handlers read the snapshot through [`RulesHandle::snapshot`],
//! an atomic pointer load: no lock, no mailbox. The writer is the
//! [`super::cache`] actor.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use actix::Addr;
use arc_swap::{ArcSwap, Guard};

use super::cache::{Parts, Reload, ReloadCounts, Reloads, RuleCache, Source, digest};
use super::database::{self, RuleRows, SnapshotSaver, origin};
use super::file::{self, FileFingerprint, FileWatch, RuleFileError};
use super::model::{Limit, RuleSet};
use crate::clock::{SharedClock, millis};
use crate::config::{RuleSource, RulesSettings};
use crate::db::feed::Feed;
use crate::db::rules::CHANNEL;
use crate::db::{Database, DbError, RuleStore};
use crate::telemetry::{Metrics, RequestCounters};

/// How long a caller waits for the cache to answer a reload request.
const RELOAD_TIMEOUT: Duration = Duration::from_secs(40);

/// Why rules could not be (re)loaded.
#[derive(Debug, thiserror::Error)]
pub enum RulesError {
    /// The rules file is unreadable or invalid.
    #[error(transparent)]
    File(#[from] RuleFileError),
    /// The database failed.
    #[error(transparent)]
    Store(#[from] DbError),
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
            && tokio::time::timeout(Duration::from_secs(2), store.database().close())
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
    let parts = Parts {
        default,
        watch_interval: settings.watch_interval,
        clock,
        reloads,
        labels,
    };
    match &settings.source {
        RuleSource::File(path) => {
            let fingerprint = FileFingerprint::of(path);
            let contents = file::read(path)?;
            let parsed = file::parse_for(path, &contents, &settings.routes)?;
            let first = RuleSet::new(parsed.rules, default, origin("file"));
            parts.reloads.first(first.len());
            tracing::info!(rules = first.len(), file = %path.display(), "Rules loaded.");
            let source = Source::File {
                path: path.clone(),
                watch: FileWatch::new(fingerprint, millis(settings.settle)),
                applied: Some(digest(&contents)),
                recheck: false,
                routes: settings.routes.clone(),
            };
            Ok(launch(source, first, parts))
        }
        RuleSource::Database(url) => {
            let store = RuleStore::new(Database::connect_lazy(url)?);
            let saver = SnapshotSaver::new(settings.snapshot_file.as_deref());
            let mut handle = start_database(
                Arc::new(store.clone()),
                settings.migrate_on_start,
                saver,
                parts,
            )
            .await;
            handle.feed = Some(Feed::start(url.clone(), CHANNEL, handle.cache.clone()));
            handle.store = Some(store);
            Ok(handle)
        }
    }
}

/// Loads the rules from `rows` once (falling back to the snapshot `saver`
/// writes, then to the default rule) and starts a cache following them.
/// The handle has no change feed yet.
async fn start_database(
    rows: Arc<dyn RuleRows>,
    mut migrate_pending: bool,
    saver: SnapshotSaver,
    parts: Parts,
) -> RulesHandle {
    let first = database::first_load(
        &*rows,
        &mut migrate_pending,
        &saver,
        parts.default,
        &parts.reloads,
    )
    .await;
    let source = Source::Database {
        rows,
        migrate_pending,
        saver,
    };
    launch(source, first, parts)
}

/// Publishes `first` and starts the cache actor that keeps it current.
fn launch(source: Source, first: RuleSet, parts: Parts) -> RulesHandle {
    parts.labels.label_tenants(first.tenants());
    let snapshot = Arc::new(ArcSwap::from_pointee(first));
    let counts = parts.reloads.counts.clone();
    let cache = RuleCache::spawn(source, snapshot.clone(), parts);
    RulesHandle {
        snapshot,
        cache,
        store: None,
        feed: None,
        counts,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::num::NonZeroU32;
    use std::sync::Mutex;

    use futures_util::future::BoxFuture;

    use super::*;
    use crate::clock::{Clock as _, SystemClock};
    use crate::db::feed::Notified;
    use crate::rules::Rule;
    use crate::rules::cache::BATCH_WINDOW;
    use crate::rules::spec::RuleSpec;

    /// What the fake table answers to one read.
    enum Answer {
        Rules(Vec<Rule>),
        Fail,
        Hang,
    }

    /// A rules table in memory, answering reads in order (then failing).
    #[derive(Default)]
    struct FakeRows {
        answers: Mutex<VecDeque<Answer>>,
    }

    impl FakeRows {
        fn answering(answers: impl IntoIterator<Item = Answer>) -> Arc<Self> {
            Arc::new(Self {
                answers: Mutex::new(answers.into_iter().collect()),
            })
        }
    }

    impl RuleRows for FakeRows {
        fn migrate(&self) -> BoxFuture<'static, Result<(), DbError>> {
            Box::pin(async { Ok(()) })
        }

        fn rules(&self) -> BoxFuture<'static, Result<Vec<Rule>, DbError>> {
            let answer = self.answers.lock().unwrap().pop_front();
            Box::pin(async move {
                match answer {
                    Some(Answer::Rules(rules)) => Ok(rules),
                    Some(Answer::Hang) => std::future::pending().await,
                    Some(Answer::Fail) | None => Err(DbError::Database(sqlx::Error::PoolClosed)),
                }
            })
        }
    }

    fn spec(tenant: &str, capacity: u32) -> serde_json::Value {
        serde_json::json!({
            "tenant": tenant, "route": "api", "capacity": capacity, "refill_per_second": 1
        })
    }

    fn rule(tenant: &str, capacity: u32) -> Rule {
        serde_json::from_value::<RuleSpec>(spec(tenant, capacity))
            .unwrap()
            .validate()
            .unwrap()
    }

    fn upsert(tenant: &str, capacity: u32) -> Notified {
        let mut event = spec(tenant, capacity);
        event["op"] = "upsert".into();
        event["seq"] = 1.into();
        Notified(event.to_string())
    }

    async fn cache(rows: &Arc<FakeRows>, saver: SnapshotSaver) -> RulesHandle {
        crate::telemetry::install();
        let one = NonZeroU32::MIN;
        let parts = Parts {
            default: Limit::new(one, one),
            watch_interval: Duration::from_secs(1),
            clock: SystemClock::shared(),
            reloads: Reloads {
                metrics: Metrics::new(),
                counts: Arc::default(),
            },
            labels: Arc::new(RequestCounters::new(["api"], &[], 10)),
        };
        start_database(rows.clone(), false, saver, parts).await
    }

    /// Each tenant's capacity in the published rules.
    fn capacities(handle: &RulesHandle) -> Vec<(String, u32)> {
        let mut all: Vec<_> = handle
            .snapshot()
            .rules()
            .map(|r| (r.tenant.as_str().to_owned(), r.limit.capacity.get()))
            .collect();
        all.sort();
        all
    }

    fn owned(pairs: &[(&str, u32)]) -> Vec<(String, u32)> {
        pairs.iter().map(|(t, c)| ((*t).to_owned(), *c)).collect()
    }

    #[actix_web::test]
    async fn changes_within_the_batch_window_are_published_as_one_snapshot() {
        tokio::time::pause();
        let rows = FakeRows::answering([Answer::Rules(vec![rule("a", 5)])]);
        let handle = cache(&rows, SnapshotSaver::new(None)).await;
        assert_eq!(capacities(&handle), owned(&[("a", 5)]));
        for change in [
            upsert("b", 7),
            upsert("c", 9),
            Notified(r#"{"op":"delete","seq":2,"tenant":"a","route":"api"}"#.into()),
            Notified(r#"{"op":"upsert","seq":3,"tenant":"d"}"#.into()),
        ] {
            handle.cache.send(change).await.unwrap();
        }
        assert_eq!(
            capacities(&handle),
            owned(&[("a", 5)]),
            "not before the window"
        );
        tokio::time::sleep(BATCH_WINDOW * 2).await;
        assert_eq!(capacities(&handle), owned(&[("b", 7), ("c", 9)]));
        assert_eq!(handle.applied_reloads(), 1, "one snapshot for the batch");
    }

    #[actix_web::test]
    async fn a_failed_or_stuck_reload_keeps_the_rules_in_force() {
        tokio::time::pause();
        let rows = FakeRows::answering([
            Answer::Rules(vec![rule("a", 5)]),
            Answer::Fail,
            Answer::Hang,
            Answer::Rules(vec![rule("a", 6)]),
        ]);
        let handle = cache(&rows, SnapshotSaver::new(None)).await;
        assert!(matches!(handle.reload().await, Err(RulesError::Store(_))));
        let started = tokio::time::Instant::now();
        assert!(matches!(handle.reload().await, Err(RulesError::Store(_))));
        let waited = started.elapsed();
        assert!(
            (database::LOAD_TIMEOUT..database::LOAD_TIMEOUT + Duration::from_millis(10))
                .contains(&waited),
            "{waited:?}"
        );
        assert_eq!(capacities(&handle), owned(&[("a", 5)]));
        assert_eq!((handle.failed_reloads(), handle.applied_reloads()), (2, 0));
        assert_eq!(handle.reload().await.unwrap(), 1);
        assert_eq!(capacities(&handle), owned(&[("a", 6)]));
    }

    #[actix_web::test]
    async fn a_reload_supersedes_the_changes_received_before_it() {
        tokio::time::pause();
        // `b` is changed, then deleted before the reload reads the table.
        let rows = FakeRows::answering([
            Answer::Rules(vec![rule("a", 5), rule("b", 6)]),
            Answer::Rules(vec![rule("a", 5)]),
        ]);
        let handle = cache(&rows, SnapshotSaver::new(None)).await;
        handle.cache.send(upsert("b", 8)).await.unwrap();
        assert_eq!(handle.reload().await.unwrap(), 1);
        tokio::time::sleep(BATCH_WINDOW * 2).await;
        assert_eq!(capacities(&handle), owned(&[("a", 5)]), "b stays deleted");
    }

    #[actix_web::test]
    async fn the_first_load_falls_back_to_the_saved_snapshot_then_to_the_default() {
        let dir = std::env::temp_dir().join(format!("tollgate-cache-{}", std::process::id()));
        let path = dir.join("rules.snapshot.json");
        let saver = || SnapshotSaver::new(Some(&path));
        let loaded = cache(
            &FakeRows::answering([Answer::Rules(vec![rule("a", 5)])]),
            saver(),
        )
        .await;
        assert_eq!(loaded.snapshot().origin().source, "database");
        let clock = SystemClock::new();
        while !path.exists() && clock.now_ms() < 5_000 {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(path.exists(), "the first load saved no snapshot");

        let saved = cache(&FakeRows::answering([Answer::Fail]), saver()).await;
        assert_eq!(saved.snapshot().origin().source, "snapshot");
        assert_eq!(capacities(&saved), owned(&[("a", 5)]));
        assert_eq!(saved.failed_reloads(), 1);

        let bare = cache(&FakeRows::answering([]), SnapshotSaver::new(None)).await;
        assert_eq!(bare.snapshot().origin().source, "default");
        assert!(bare.snapshot().is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
