//! The SQL ledger behind `--database-url`.
//!
//! `sqlite://FILE` (the default) is an embedded, per-pod ledger: the fallback path
//! it backs is per pod too, so more than one replica needs PostgreSQL
//! (`postgres://...`), shared by every sidecar of the shop.

use std::str::FromStr;

use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};

#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("--database-url must start with sqlite:// or postgres:// (got {0:?})")]
    Scheme(String),
    #[error("cannot open the ledger at {url}: {source}")]
    Open {
        url: String,
        #[source]
        source: sqlx::Error,
    },
}

/// An open ledger.
#[derive(Debug, Clone)]
pub enum Ledger {
    Sqlite(sqlx::SqlitePool),
    Postgres(sqlx::PgPool),
}

impl Ledger {
    /// Opens (and for SQLite creates) the ledger. PostgreSQL is connected lazily so
    /// that a sidecar starts while the database is still coming up.
    pub async fn open(url: &str) -> Result<Self, LedgerError> {
        let failed = |source| LedgerError::Open {
            url: dropgate_api::redact_url(url),
            source,
        };
        if url.starts_with("sqlite:") {
            let options = SqliteConnectOptions::from_str(url)
                .map_err(failed)?
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal);
            let pool = SqlitePoolOptions::new()
                .max_connections(4)
                .connect_with(options)
                .await
                .map_err(failed)?;
            Ok(Ledger::Sqlite(pool))
        } else if url.starts_with("postgres:") || url.starts_with("postgresql:") {
            let pool = PgPoolOptions::new()
                .max_connections(8)
                .connect_lazy(url)
                .map_err(failed)?;
            Ok(Ledger::Postgres(pool))
        } else {
            Err(LedgerError::Scheme(dropgate_api::redact_url(url)))
        }
    }
}
