//! Leadership of the rebalancer: a PostgreSQL advisory lock, and the
//! rebalancer's view of the database through it.
//!
//! Owns the lock and the session holding it. The lock lives as long as
//! its session, so a leader that dies frees it; writes made on the
//! session fail once it is gone, so an instance that lost the lock
//! cannot write as leader.

use std::collections::BTreeMap;

use sqlx::Connection as _;
use sqlx::postgres::PgConnection;

use super::DbError;
use super::shares::{Decision, ShareRow, ShareStore};
use crate::region::rebalancer::Ledger;
use crate::region::shares::Scope;

/// The advisory lock that makes one instance the leader ("tollgate").
const LEADER_LOCK: i64 = 0x746F_6C6C_6761_7465;

/// The lock, held by this instance on a session of its own.
struct Leadership {
    session: PgConnection,
}

impl Leadership {
    /// Keeps `held` while its session answers, else tries to take the
    /// lock on a new session to `url`; `None` when another instance holds
    /// it or the database cannot be reached.
    async fn keep_or_take(held: Option<Self>, url: &str) -> Option<Self> {
        if let Some(mut held) = held {
            if held.session.ping().await.is_ok() {
                return Some(held);
            }
            tracing::warn!("Lost the rebalancer's leader session; trying to lead again.");
        }
        let mut session = PgConnection::connect(url).await.ok()?;
        let locked: Result<bool, _> = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(LEADER_LOCK)
            .fetch_one(&mut session)
            .await;
        if matches!(locked, Ok(true)) {
            tracing::info!("This instance now leads region rebalancing.");
            Some(Self { session })
        } else {
            let _ = session.close().await;
            None
        }
    }
}

/// The share tables as the rebalancer uses them: read through the pool,
/// written on the session that holds the leader lock.
pub struct LeaderLedger {
    /// Reads, and the URL of the lock's own session.
    store: ShareStore,
    /// The lock, while this instance leads.
    lock: Option<Leadership>,
}

impl LeaderLedger {
    /// A ledger on `store` that does not lead yet.
    pub fn new(store: ShareStore) -> Self {
        Self { store, lock: None }
    }
}

impl Ledger for LeaderLedger {
    async fn lead(&mut self) -> bool {
        let held = self.lock.take();
        self.lock = Leadership::keep_or_take(held, self.store.database().url()).await;
        self.lock.is_some()
    }

    fn resign(&mut self) {
        self.lock = None;
    }

    async fn shares(&self) -> Result<Vec<ShareRow>, DbError> {
        self.store.load_all().await
    }

    async fn record(
        &mut self,
        changes: &[(Scope, BTreeMap<String, f64>)],
        decision: &Decision<'_>,
    ) -> Result<(), DbError> {
        let lock = self.lock.as_mut().ok_or(DbError::NotLeader)?;
        ShareStore::replace_on(&mut lock.session, changes, Some(decision)).await
    }
}
