//! The SQL ledger behind `--database-url`: the durable record of every reservation,
//! the transactional outbox, lock fences, and the fallback gate's stock.
//!
//! `sqlite://FILE` (the default) is an embedded, per-pod ledger: the fallback path
//! it backs is per pod too, so more than one replica needs PostgreSQL
//! (`postgres://...`), shared by every sidecar of the shop. Both run the same code
//! and the same migrations (`sidecar/migrations`) through sqlx's `Any` driver.
//!
//! - this module: opening, and [`Ledger::record`], which writes a reservation change
//!   with its outbox event in one transaction. Concurrent records share one
//!   transaction (group commit: a writer task takes everything that arrived while
//!   the previous commit ran), so durability costs one commit per batch.
//! - [`fallback`]: the ledger's own gate, used when Redis is not.
//! - [`outbox`]: canonical event JSON, the dispatcher, the consumer's dedup helper.
//! - [`fences`]: lock fence high-water marks and fenced writes.

pub mod fallback;
pub mod fences;
pub mod outbox;

use std::time::{SystemTime, UNIX_EPOCH};

use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::{Any, AnyPool, Row, Transaction};
use tokio::sync::{mpsc, oneshot};

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
    #[error("ledger migrations failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("the ledger failed: {0}")]
    Sql(#[from] sqlx::Error),
    #[error("the ledger's writer stopped")]
    WriterGone,
}

/// A reservation's state as both stores spell it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    Active,
    Confirmed,
    Cancelled,
    Expired,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Active => "active",
            State::Confirmed => "confirmed",
            State::Cancelled => "cancelled",
            State::Expired => "expired",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "active" => Some(State::Active),
            "confirmed" => Some(State::Confirmed),
            "cancelled" => Some(State::Cancelled),
            "expired" => Some(State::Expired),
            _ => None,
        }
    }

    /// Whether the reservation keeps its units out of stock.
    pub fn holds_units(self) -> bool {
        matches!(self, State::Active | State::Confirmed)
    }

    /// The outbox event's type.
    fn event(self) -> &'static str {
        match self {
            State::Active => "admitted",
            State::Confirmed => "confirmed",
            State::Cancelled => "cancelled",
            State::Expired => "expired",
        }
    }
}

/// One change of one reservation, as the Redis gate decided it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Change {
    /// `namespace/name`.
    pub drop_key: String,
    pub limit: i64,
    pub key: String,
    pub user: String,
    pub quantity: i64,
    pub state: State,
    pub expires_at_ms: i64,
}

type Pending = (Change, oneshot::Sender<Result<(), String>>);

/// An open ledger.
#[derive(Debug, Clone)]
pub struct Ledger {
    pool: AnyPool,
    writer: mpsc::Sender<Pending>,
}

/// Most changes one group commit takes.
const BATCH: usize = 512;

impl Ledger {
    /// Opens the ledger (creating a SQLite file), runs the migrations, and starts
    /// the group-commit writer.
    pub async fn open(url: &str) -> Result<Self, LedgerError> {
        sqlx::any::install_default_drivers();
        let failed = |source| LedgerError::Open {
            url: dropgate_api::redact_url(url),
            source,
        };
        let (url, connections) = if url.starts_with("sqlite:") {
            // One connection: SQLite has one writer anyway, and a single connection
            // never meets SQLITE_BUSY between the writer task and the fallback gate.
            let create = if url.contains("mode=") {
                url.to_string()
            } else if url.contains('?') {
                format!("{url}&mode=rwc")
            } else {
                format!("{url}?mode=rwc")
            };
            (create, 1)
        } else if url.starts_with("postgres:") || url.starts_with("postgresql:") {
            (url.to_string(), 16)
        } else {
            return Err(LedgerError::Scheme(dropgate_api::redact_url(url)));
        };
        let pool = AnyPoolOptions::new()
            .max_connections(connections)
            .after_connect(|conn, _| {
                Box::pin(async move {
                    if conn.backend_name() == "SQLite" {
                        for pragma in [
                            "PRAGMA journal_mode = WAL",
                            "PRAGMA synchronous = FULL",
                            "PRAGMA busy_timeout = 5000",
                        ] {
                            sqlx::query(pragma).execute(&mut *conn).await?;
                        }
                    }
                    Ok(())
                })
            })
            .connect(&url)
            .await
            .map_err(failed)?;
        sqlx::migrate!("./migrations").run(&pool).await?;
        let (writer, queue) = mpsc::channel(BATCH * 4);
        tokio::spawn(group_commit(pool.clone(), queue));
        Ok(Self { pool, writer })
    }

    pub fn pool(&self) -> &AnyPool {
        &self.pool
    }

    /// Records a change the Redis gate made, with its outbox event, durably: it
    /// returns after the transaction holding it committed. Recording the same change
    /// twice changes nothing.
    pub async fn record(&self, change: Change) -> Result<(), LedgerError> {
        let (done, wait) = oneshot::channel();
        self.writer
            .send((change, done))
            .await
            .map_err(|_| LedgerError::WriterGone)?;
        wait.await
            .map_err(|_| LedgerError::WriterGone)?
            .map_err(|e| LedgerError::Sql(sqlx::Error::Protocol(e)))
    }
}

/// The writer task: one transaction for everything that queued up while the last
/// commit ran. A batch that fails is retried change by change, so that one bad
/// change cannot fail the others.
async fn group_commit(pool: AnyPool, mut queue: mpsc::Receiver<Pending>) {
    while let Some(first) = queue.recv().await {
        let mut batch = vec![first];
        while batch.len() < BATCH {
            match queue.try_recv() {
                Ok(next) => batch.push(next),
                Err(_) => break,
            }
        }
        let changes: Vec<&Change> = batch.iter().map(|(c, _)| c).collect();
        match commit(&pool, &changes).await {
            Ok(()) => {
                for (_, done) in batch {
                    let _ = done.send(Ok(()));
                }
            }
            Err(_) if batch.len() > 1 => {
                for (change, done) in batch {
                    let _ = done.send(commit(&pool, &[&change]).await.map_err(|e| e.to_string()));
                }
            }
            Err(e) => {
                for (_, done) in batch {
                    let _ = done.send(Err(e.to_string()));
                }
            }
        }
    }
}

async fn commit(pool: &AnyPool, changes: &[&Change]) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    for change in changes {
        apply_gate_change(&mut tx, change, now_ms()).await?;
    }
    crate::faults::check(crate::faults::Fault::BeforeLedgerCommit)
        .map_err(|e| sqlx::Error::Protocol(e.to_string()))?;
    tx.commit().await
}

/// Writes a change the Redis gate decided: the reservation row, the fallback stock
/// and buyer counts kept in step, and the outbox event, all only if the change is
/// new (a transition from a state that allows it).
async fn apply_gate_change(
    tx: &mut Transaction<'static, Any>,
    change: &Change,
    now: i64,
) -> Result<(), sqlx::Error> {
    ensure_stock(tx, &change.drop_key, change.limit).await?;
    let changed = if change.state == State::Active {
        insert_reservation(tx, change, "gate", true, now).await?
    } else {
        let moved = transition(tx, &change.drop_key, &change.key, change.state, true, now).await?;
        // A reservation this ledger never saw admitted (another pod's SQLite): keep
        // its record, with no stock effect here.
        if !moved && insert_reservation(tx, change, "gate", true, now).await? {
            write_event(tx, change, "gate", now).await?;
            return Ok(());
        }
        moved
    };
    if changed {
        adjust_holdings(tx, change, if change.state.holds_units() { -1 } else { 1 }).await?;
        write_event(tx, change, "gate", now).await?;
    }
    Ok(())
}

/// Creates the drop's stock row (limit minus what is held) or moves it to a new
/// limit by the difference.
async fn ensure_stock(
    tx: &mut Transaction<'static, Any>,
    drop_key: &str,
    limit: i64,
) -> Result<(), sqlx::Error> {
    // The row exists on every call but the first: a key look-up, not a scan.
    let current: Option<AnyRow> = sqlx::query("SELECT lim FROM stock WHERE drop_key = $1")
        .bind(drop_key)
        .fetch_optional(&mut **tx)
        .await?;
    if let Some(row) = current {
        let lim: i64 = row.try_get(0)?;
        if lim != limit {
            sqlx::query("UPDATE stock SET available = available + ($1 - lim), lim = $2 WHERE drop_key = $3 AND lim <> $4")
                .bind(limit)
                .bind(limit)
                .bind(drop_key)
                .bind(limit)
                .execute(&mut **tx)
                .await?;
        }
        return Ok(());
    }
    sqlx::query(
        "INSERT INTO stock (drop_key, lim, available) \
         SELECT $1, $2, $3 - COALESCE(SUM(quantity), 0) FROM reservations \
         WHERE drop_key = $4 AND state IN ('active', 'confirmed') \
         ON CONFLICT (drop_key) DO NOTHING",
    )
    .bind(drop_key)
    .bind(limit)
    .bind(limit)
    .bind(drop_key)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Inserts a reservation unless its key exists; true when inserted.
async fn insert_reservation(
    tx: &mut Transaction<'static, Any>,
    change: &Change,
    path: &str,
    replayed: bool,
    now: i64,
) -> Result<bool, sqlx::Error> {
    let inserted = sqlx::query(
        "INSERT INTO reservations \
         (drop_key, res_key, user_id, quantity, state, path, expires_at_ms, updated_at_ms, replayed) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT (drop_key, res_key) DO NOTHING",
    )
    .bind(&change.drop_key)
    .bind(&change.key)
    .bind(&change.user)
    .bind(change.quantity)
    .bind(change.state.as_str())
    .bind(path)
    .bind(change.expires_at_ms)
    .bind(now)
    .bind(i64::from(replayed))
    .execute(&mut **tx)
    .await?;
    Ok(inserted.rows_affected() == 1)
}

/// Moves a reservation to `to` if it is in a state that allows it (confirm and
/// expire from active, cancel from active or confirmed); true when moved.
async fn transition(
    tx: &mut Transaction<'static, Any>,
    drop_key: &str,
    key: &str,
    to: State,
    replayed: bool,
    now: i64,
) -> Result<bool, sqlx::Error> {
    let sql = match to {
        State::Active => return Ok(false),
        State::Confirmed | State::Expired => {
            "UPDATE reservations SET state = $1, updated_at_ms = $2, replayed = $3 \
             WHERE drop_key = $4 AND res_key = $5 AND state = 'active'"
        }
        State::Cancelled => {
            "UPDATE reservations SET state = $1, updated_at_ms = $2, replayed = $3 \
             WHERE drop_key = $4 AND res_key = $5 AND state IN ('active', 'confirmed')"
        }
    };
    let query = sqlx::query(sql)
        .bind(to.as_str())
        .bind(now)
        .bind(i64::from(replayed))
        .bind(drop_key)
        .bind(key);
    Ok(query.execute(&mut **tx).await?.rows_affected() == 1)
}

/// Moves a change's units in the fallback stock and the buyer's count:
/// `direction` -1 takes them (admission), +1 returns them.
async fn adjust_holdings(
    tx: &mut Transaction<'static, Any>,
    change: &Change,
    direction: i64,
) -> Result<(), sqlx::Error> {
    let units = direction * change.quantity;
    sqlx::query("UPDATE stock SET available = available + $1 WHERE drop_key = $2")
        .bind(units)
        .bind(&change.drop_key)
        .execute(&mut **tx)
        .await?;
    sqlx::query(
        "INSERT INTO buyers (drop_key, user_id, held) VALUES ($1, $2, 0) \
         ON CONFLICT (drop_key, user_id) DO NOTHING",
    )
    .bind(&change.drop_key)
    .bind(&change.user)
    .execute(&mut **tx)
    .await?;
    sqlx::query("UPDATE buyers SET held = held - $1 WHERE drop_key = $2 AND user_id = $3")
        .bind(units)
        .bind(&change.drop_key)
        .bind(&change.user)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Appends the change's event to the outbox (once: the event id is the drop, the
/// key and the transition).
async fn write_event(
    tx: &mut Transaction<'static, Any>,
    change: &Change,
    path: &str,
    now: i64,
) -> Result<(), sqlx::Error> {
    let event_id = format!(
        "{}/{}/{}",
        change.drop_key,
        change.key,
        change.state.event()
    );
    let payload = outbox::canonical(&serde_json::json!({
        "at": now,
        "drop": change.drop_key,
        "eventId": event_id,
        "key": change.key,
        "path": path,
        "quantity": change.quantity,
        "type": change.state.event(),
        "user": change.user,
    }))
    .map_err(|e| sqlx::Error::Protocol(e.to_string()))?;
    let row: AnyRow = sqlx::query("UPDATE sequences SET next_value = next_value + 1 WHERE name = 'outbox' RETURNING next_value")
        .fetch_one(&mut **tx)
        .await?;
    let id: i64 = row.try_get(0)?;
    sqlx::query(
        "INSERT INTO outbox (id, event_id, drop_key, payload, created_at_ms, sent_at_ms) \
         VALUES ($1, $2, $3, $4, $5, NULL) ON CONFLICT (event_id) DO NOTHING",
    )
    .bind(id)
    .bind(&event_id)
    .bind(&change.drop_key)
    .bind(payload)
    .bind(now)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
