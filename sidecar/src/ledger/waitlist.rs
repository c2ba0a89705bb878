//! The waitlist in the ledger: each entry's row, so that a Redis that lost its data
//! gets its lines back in order, and the one place that decides, between a buyer
//! leaving and an offer to them, which came first.
//!
//! A join is written by its attempt (`join`); a sidecar that finds a join past its
//! bound claims the key for that attempt first (`give_up_join`), so the late write
//! of a dead attempt is refused, exactly as an admission's is. An offer is recorded
//! with its admission (`serve`, inside the group commit), only while the row waits;
//! a leave (`leave`) only while it waits too.

use sqlx::{Any, Row, Transaction};

use super::{Ledger, LedgerError};
use crate::clock::now_ms;

/// An entry's state in the ledger.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitState {
    Waiting,
    Offered,
    Left,
    /// A join given up on before it was written (its attempt named in the row): the
    /// key may join again under another attempt.
    Abandoned,
}

impl WaitState {
    pub fn as_str(self) -> &'static str {
        match self {
            WaitState::Waiting => "waiting",
            WaitState::Offered => "offered",
            WaitState::Left => "left",
            WaitState::Abandoned => "abandoned",
        }
    }

    fn parse(word: &str) -> Result<Self, sqlx::Error> {
        Ok(match word {
            "waiting" => WaitState::Waiting,
            "offered" => WaitState::Offered,
            "left" => WaitState::Left,
            "abandoned" => WaitState::Abandoned,
            other => {
                return Err(sqlx::Error::Decode(
                    format!("a waitlist row's state is {other:?}").into(),
                ));
            }
        })
    }
}

/// One entry as the ledger has it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WaitRow {
    pub key: String,
    pub user: String,
    pub quantity: i64,
    pub variant: Option<String>,
    pub position: i64,
    pub state: WaitState,
    pub attempt: String,
}

/// A join to write: the entry as Redis placed it.
#[derive(Clone, Copy, Debug)]
pub struct Join<'a> {
    pub key: &'a str,
    pub user: &'a str,
    pub quantity: i64,
    pub variant: Option<&'a str>,
    pub position: i64,
    pub attempt: &'a str,
    /// The generation of the drop's config Redis decided the join on, when the API
    /// server numbered it: [`Ledger::join`] refuses it if the ledger has seen a
    /// newer one (a change Redis lost). `None`: not compared.
    pub decided_on: Option<i64>,
    /// The drop's stock as the joining sidecar's config has it. A compared join on
    /// a drop the ledger has no stock row for yet creates the row with it, as a
    /// first commit would, so that a commit noting another generation meanwhile is
    /// ordered with the join (it waits for the row, or the join waits for it)
    /// rather than unseen. `None`: nothing to create the row from, and such a
    /// join on a drop with no row yet is not ordered with that commit (only a
    /// test's join, or one not compared, passes `None`).
    pub stock_if_first: Option<&'a crate::reservation::Stock>,
}

fn row_of(row: &sqlx::any::AnyRow) -> Result<WaitRow, sqlx::Error> {
    Ok(WaitRow {
        key: row.try_get(0)?,
        user: row.try_get(1)?,
        quantity: row.try_get(2)?,
        variant: row.try_get(3)?,
        position: row.try_get(4)?,
        state: WaitState::parse(&row.try_get::<String, _>(5)?)?,
        attempt: row.try_get(6)?,
    })
}

impl Ledger {
    /// Writes `join` as waiting, unless the key has a row already: an abandoned one
    /// is taken over by another attempt (never by the one given up on). Returns the
    /// key's row as it stands after: the caller's join landed when it is waiting
    /// under the caller's attempt. [`LedgerError::PositionTaken`] when another
    /// join holds its position, [`LedgerError::ConfigBehind`] when the join was
    /// decided on an older generation of the drop's config than the ledger has seen
    /// (`join.decided_on`); nothing is written either way.
    pub async fn join(&self, drop_key: &str, join: Join<'_>) -> Result<WaitRow, LedgerError> {
        let now = now_ms();
        // The newest generation is read in the join's own transaction, before its
        // row: on PostgreSQL with a share lock on the stock row (the order in
        // which every transaction takes a drop's rows: stock first), so a commit
        // noting a newer generation either came first and is seen, or waits for
        // this one; on SQLite the transaction holds the write lock from its BEGIN.
        let mut tx = match self.backend {
            super::Backend::Sqlite => self.pool().begin_with("BEGIN IMMEDIATE").await?,
            super::Backend::Postgres => self.pool().begin().await?,
        };
        let newest = match join.decided_on {
            Some(_) => match (
                newest_generation(&mut tx, self.backend, drop_key).await?,
                join.stock_if_first,
            ) {
                (Some(newest), _) => newest,
                (None, Some(stock)) => super::ensure_stock(&mut tx, drop_key, stock).await?.0,
                (None, None) => 0,
            },
            None => 0,
        };
        let written = sqlx::query(
            "INSERT INTO waitlist (drop_key, res_key, user_id, quantity, variant, position, state, \
             attempt, joined_at_ms, updated_at_ms) VALUES ($1, $2, $3, $4, $5, $6, 'waiting', $7, $8, $9) \
             ON CONFLICT (drop_key, res_key) DO UPDATE SET user_id = excluded.user_id, \
             quantity = excluded.quantity, variant = excluded.variant, position = excluded.position, \
             state = 'waiting', attempt = excluded.attempt, joined_at_ms = excluded.joined_at_ms, \
             updated_at_ms = excluded.updated_at_ms \
             WHERE waitlist.state = 'abandoned' AND waitlist.attempt <> excluded.attempt",
        )
        .bind(drop_key)
        .bind(join.key)
        .bind(join.user)
        .bind(join.quantity)
        .bind(join.variant)
        .bind(join.position)
        .bind(join.attempt)
        .bind(now)
        .bind(now)
        .execute(&mut *tx)
        .await;
        let written = match written {
            // (The key's own row is the upsert's; the position's index is
            // migration 0013's: PostgreSQL names it, SQLite names its columns.)
            Err(sqlx::Error::Database(db))
                if db.is_unique_violation()
                    && (db.constraint() == Some("waitlist_position_once")
                        || db.message().contains("waitlist_position_once")
                        || db.message().contains("waitlist.position")) =>
            {
                return Err(LedgerError::PositionTaken(join.position));
            }
            written => written?,
        };
        // Only a join this call wrote is judged: a key whose row was there already
        // (an earlier attempt's) keeps it, and the caller hears of that row.
        if let Some(decided_on) = join.decided_on
            && written.rows_affected() == 1
            && dropgate_api::config::lost_since(decided_on, newest)
        {
            // (Dropping the transaction rolls it back.)
            return Err(LedgerError::ConfigBehind { decided_on, newest });
        }
        tx.commit().await?;
        self.waiting_entry(drop_key, join.key)
            .await?
            .ok_or_else(|| LedgerError::Sql(sqlx::Error::RowNotFound))
    }

    /// Claims `key` for the dead join `attempt` (a row abandoned under it) unless
    /// an entry is there already (an abandoned row is claimed anew, so that the
    /// late write of this attempt cannot take it over); returns the key's row as it
    /// stands after.
    pub async fn give_up_join(
        &self,
        drop_key: &str,
        key: &str,
        attempt: &str,
        entry: Join<'_>,
    ) -> Result<WaitRow, LedgerError> {
        let now = now_ms();
        sqlx::query(
            "INSERT INTO waitlist (drop_key, res_key, user_id, quantity, variant, position, state, \
             attempt, joined_at_ms, updated_at_ms) VALUES ($1, $2, $3, $4, $5, $6, 'abandoned', $7, $8, $9) \
             ON CONFLICT (drop_key, res_key) DO UPDATE SET attempt = excluded.attempt, \
             updated_at_ms = excluded.updated_at_ms WHERE waitlist.state = 'abandoned'",
        )
        .bind(drop_key)
        .bind(key)
        .bind(entry.user)
        .bind(entry.quantity)
        .bind(entry.variant)
        .bind(entry.position)
        .bind(attempt)
        .bind(now)
        .bind(now)
        .execute(self.pool())
        .await?;
        self.waiting_entry(drop_key, key)
            .await?
            .ok_or_else(|| LedgerError::Sql(sqlx::Error::RowNotFound))
    }

    /// Records that the buyer left the line, if the entry still waits; returns the
    /// row as it stands after (`None`: the ledger has no such entry).
    pub async fn leave(&self, drop_key: &str, key: &str) -> Result<Option<WaitRow>, LedgerError> {
        sqlx::query(
            "UPDATE waitlist SET state = 'left', updated_at_ms = $1 \
             WHERE drop_key = $2 AND res_key = $3 AND state = 'waiting'",
        )
        .bind(now_ms())
        .bind(drop_key)
        .bind(key)
        .execute(self.pool())
        .await?;
        self.waiting_entry(drop_key, key).await
    }

    /// The highest position the drop's lines handed out that the ledger recorded
    /// (0 when none): Redis numbered it first, so a Redis whose position counter is
    /// lower lost joins.
    pub async fn max_position(&self, drop_key: &str) -> Result<i64, LedgerError> {
        let row = sqlx::query("SELECT MAX(position) FROM waitlist WHERE drop_key = $1")
            .bind(drop_key)
            .fetch_one(self.pool())
            .await?;
        Ok(row.try_get::<Option<i64>, _>(0)?.unwrap_or(0))
    }

    /// The key of the last entry the ledger recorded joining the drop's lines (the
    /// highest position; a join given up on is none): a Redis that has every join
    /// the ledger recorded holds that entry.
    pub async fn last_join(&self, drop_key: &str) -> Result<Option<String>, LedgerError> {
        let row = sqlx::query(
            "SELECT res_key FROM waitlist WHERE drop_key = $1 AND state <> 'abandoned' \
             ORDER BY position DESC LIMIT 1",
        )
        .bind(drop_key)
        .fetch_optional(self.pool())
        .await?;
        Ok(match row {
            Some(row) => Some(row.try_get(0)?),
            None => None,
        })
    }

    /// The key's entry as the ledger has it.
    pub async fn waiting_entry(
        &self,
        drop_key: &str,
        key: &str,
    ) -> Result<Option<WaitRow>, LedgerError> {
        let row = sqlx::query(
            "SELECT res_key, user_id, quantity, variant, position, state, attempt FROM waitlist WHERE drop_key = $1 AND res_key = $2",
        )
        .bind(drop_key)
        .bind(key)
        .fetch_optional(self.pool())
        .await?;
        Ok(row.as_ref().map(row_of).transpose()?)
    }

    /// Entries after `after` (by key), at most `limit`, for a rebuild (abandoned
    /// joins are nobody's).
    pub async fn entries_after(
        &self,
        drop_key: &str,
        after: &str,
        limit: i64,
    ) -> Result<Vec<WaitRow>, LedgerError> {
        let rows = sqlx::query(
            "SELECT res_key, user_id, quantity, variant, position, state, attempt FROM waitlist WHERE drop_key = $1 AND res_key > $2 \
             AND state <> 'abandoned' ORDER BY res_key LIMIT $3",
        )
        .bind(drop_key)
        .bind(after)
        .bind(limit)
        .fetch_all(self.pool())
        .await?;
        Ok(rows.iter().map(row_of).collect::<Result<_, _>>()?)
    }

    /// The entries waiting in the line of `variant`, first first, at most `limit`.
    pub async fn line(
        &self,
        drop_key: &str,
        variant: Option<&str>,
        limit: i64,
    ) -> Result<Vec<WaitRow>, LedgerError> {
        let rows = sqlx::query(
            "SELECT res_key, user_id, quantity, variant, position, state, attempt FROM waitlist WHERE drop_key = $1 AND state = 'waiting' \
             AND COALESCE(variant, '') = $2 ORDER BY position LIMIT $3",
        )
        .bind(drop_key)
        .bind(variant.unwrap_or(""))
        .bind(limit)
        .fetch_all(self.pool())
        .await?;
        Ok(rows.iter().map(row_of).collect::<Result<_, _>>()?)
    }
}

/// Moves the entry of an offer's key from waiting to offered, in the offer's
/// admission's transaction; false when it does not wait (it left, or the offer
/// was recorded before).
pub(super) async fn serve(
    tx: &mut Transaction<'static, Any>,
    drop_key: &str,
    key: &str,
    now: i64,
) -> Result<bool, sqlx::Error> {
    let served = sqlx::query(
        "UPDATE waitlist SET state = 'offered', updated_at_ms = $1 \
         WHERE drop_key = $2 AND res_key = $3 AND state = 'waiting'",
    )
    .bind(now)
    .bind(drop_key)
    .bind(key)
    .execute(&mut **tx)
    .await?;
    Ok(served.rows_affected() == 1)
}

/// What the fallback gate must know of the line when it decides a reserve:
/// whether anyone waits for `variant` (then a new reserve is sold out), and the
/// units `user` waits for (they count toward the per-user limit).
pub(super) async fn standing(
    tx: &mut Transaction<'static, Any>,
    drop_key: &str,
    variant: Option<&str>,
    user: &str,
) -> Result<(bool, i64), sqlx::Error> {
    let row = sqlx::query(
        "SELECT \
         (SELECT COUNT(*) FROM waitlist WHERE drop_key = $1 AND state = 'waiting' AND COALESCE(variant, '') = $2), \
         (SELECT CAST(COALESCE(SUM(quantity), 0) AS BIGINT) FROM waitlist WHERE drop_key = $3 AND state = 'waiting' AND user_id = $4)",
    )
    .bind(drop_key)
    .bind(variant.unwrap_or(""))
    .bind(drop_key)
    .bind(user)
    .fetch_one(&mut **tx)
    .await?;
    Ok((row.try_get::<i64, _>(0)? > 0, row.try_get::<i64, _>(1)?))
}

/// Units of the drop's own count set aside for the heads of the other variants'
/// lines (than `variant`): each head's quantity, as far as its variant has it.
/// The drop's count only binds below the sum of its variants' after a cut, so
/// this matters only then; on the gate `reserve.lua` does the same.
pub(super) async fn set_aside(
    tx: &mut Transaction<'static, Any>,
    drop_key: &str,
    variant: &str,
    variants: &[dropgate_api::Variant],
) -> Result<i64, sqlx::Error> {
    let heads = sqlx::query(
        "SELECT w.quantity, vs.available, w.variant FROM waitlist w \
         LEFT JOIN variant_stock vs ON vs.drop_key = w.drop_key AND vs.variant = w.variant \
         WHERE w.drop_key = $1 AND w.state = 'waiting' AND w.variant IS NOT NULL AND w.variant <> $2 \
         AND w.position = (SELECT MIN(w2.position) FROM waitlist w2 \
           WHERE w2.drop_key = w.drop_key AND w2.state = 'waiting' AND w2.variant = w.variant)",
    )
    .bind(drop_key)
    .bind(variant)
    .fetch_all(&mut **tx)
    .await?;
    let mut aside = 0;
    for head in &heads {
        // A size the config no longer has sells nothing more: its line is not
        // served, and sets nothing aside.
        let size: String = head.try_get(2)?;
        if !variants.iter().any(|v| v.name == size) {
            continue;
        }
        let need: i64 = head.try_get(0)?;
        let own: Option<i64> = head.try_get(1)?;
        aside += need.min(own.unwrap_or(0)).max(0);
    }
    Ok(aside)
}

/// The newest generation of the drop's config the ledger has seen, read in `tx`:
/// on PostgreSQL with a share lock on the stock row, which a commit that notes a
/// newer generation takes for update. `None`: the drop has no stock row yet (there
/// is nothing to lock; [`Ledger::join`] then makes the row).
async fn newest_generation(
    tx: &mut sqlx::Transaction<'static, sqlx::Any>,
    backend: super::Backend,
    drop_key: &str,
) -> Result<Option<i64>, sqlx::Error> {
    let sql = match backend {
        super::Backend::Postgres => "SELECT generation FROM stock WHERE drop_key = $1 FOR SHARE",
        super::Backend::Sqlite => "SELECT generation FROM stock WHERE drop_key = $1",
    };
    let row = sqlx::query(sql)
        .bind(drop_key)
        .fetch_optional(&mut **tx)
        .await?;
    Ok(match row {
        Some(row) => Some(row.try_get::<Option<i64>, _>(0)?.unwrap_or(0)),
        None => None,
    })
}
