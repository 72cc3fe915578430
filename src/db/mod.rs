//! PostgreSQL, the one module that speaks it: the pool, the migrations,
//! the `LISTEN` feeds ([`feed`]), the advisory lock that elects the
//! rebalancer's leader ([`leader`]), and the queries on the rules
//! ([`rules`]) and region share ([`shares`]) tables.
//!
//! Nothing here is on the request path. Every other module reaches the
//! database through a [`Database`] handle and the stores built on it.

pub mod feed;
pub mod leader;
pub mod rules;
pub mod shares;

use std::time::Duration;

use sqlx::postgres::{PgPool, PgPoolOptions};

pub use rules::{RuleStore, StoredRule};
pub use shares::ShareStore;

/// The SQL migrations, compiled in.
static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// Longest wait for a pooled connection before a query gives up.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(2);

/// Connections the pool keeps at most.
const MAX_CONNECTIONS: u32 = 4;

/// Why a database operation failed. The messages carry their cause
/// (there is no separate source, so a printed chain says it once).
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    /// The server answered, but the database in the URL does not exist.
    #[error(
        "database {0:?} does not exist: create it (psql -c 'CREATE DATABASE \"{0}\"', \
         or createdb {0}), then run tollgate migrate --database-url <url>"
    )]
    MissingDatabase(String),
    /// The database could not be reached or the query failed.
    #[error("database error: {0}")]
    Database(sqlx::Error),
    /// A migration could not be applied.
    #[error("migration failed: {0}")]
    Migrate(sqlx::migrate::MigrateError),
    /// A write that only the rebalancer's leader may make, while this
    /// instance does not hold the leader lock.
    #[error("this instance does not hold the rebalancer's leader lock")]
    NotLeader,
}

/// The database a "does not exist" error (SQLSTATE 3D000) names.
fn missing_database(e: &sqlx::Error) -> Option<String> {
    let db = e.as_database_error()?;
    if db.code().as_deref() != Some("3D000") {
        return None;
    }
    let message = db.message();
    let name = message
        .split('"')
        .nth(1)
        .map_or_else(|| message.to_owned(), str::to_owned);
    Some(name)
}

impl From<sqlx::Error> for DbError {
    fn from(e: sqlx::Error) -> Self {
        missing_database(&e).map_or(Self::Database(e), Self::MissingDatabase)
    }
}

impl From<sqlx::migrate::MigrateError> for DbError {
    fn from(e: sqlx::migrate::MigrateError) -> Self {
        use sqlx::migrate::MigrateError::{Execute, ExecuteMigration};
        match &e {
            Execute(inner) | ExecuteMigration(inner, _) => missing_database(inner),
            _ => None,
        }
        .map_or(Self::Migrate(e), Self::MissingDatabase)
    }
}

/// A database: its URL and a small pool shared by every table's queries;
/// connections are opened on demand.
#[derive(Clone)]
pub struct Database {
    pool: PgPool,
    /// The URL, for connections of their own (`LISTEN`, the leader lock).
    url: String,
}

impl Database {
    /// A handle on the database at `url`. Connects to nothing until first
    /// used.
    ///
    /// # Errors
    /// When the URL cannot be parsed.
    pub fn connect_lazy(url: &str) -> Result<Self, DbError> {
        let pool = PgPoolOptions::new()
            .max_connections(MAX_CONNECTIONS)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .connect_lazy(url)?;
        Ok(Self {
            pool,
            url: url.to_owned(),
        })
    }

    /// The database URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The connection pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Closes every pooled connection.
    pub async fn close(&self) {
        self.pool.close().await;
    }

    /// Applies every pending migration (rules and region tables alike);
    /// already applied ones are skipped.
    ///
    /// # Errors
    /// When the database is unreachable or a migration fails.
    pub async fn migrate(&self) -> Result<(), DbError> {
        MIGRATOR.run(&self.pool).await?;
        Ok(())
    }
}
