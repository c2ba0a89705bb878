//! Who decides admissions for a drop: one authority at a time.
//!
//! The `authority` row of a drop says `gate` (Redis admits, at this epoch),
//! `ledger` (the fallback gate admits) or `replaying` (Redis is being brought in
//! line with the ledger before the gate opens at this epoch). The epoch only grows.
//! Every durable admission checks the row in its own transaction: a gate change
//! must carry the row's epoch, a fallback change needs `ledger`. On PostgreSQL a
//! group commit reads the row with a shared lock and a hand-over takes it
//! exclusively, so a hand-over waits for the commits in flight and the commits after
//! it see the new holder: a sidecar acting on a stale view is refused, not obeyed.

use std::fmt;

use sqlx::any::AnyRow;
use sqlx::{Any, Row, Transaction};

use super::{Backend, Ledger, LedgerError, RecordError, ensure_stock};
use crate::reservation::{State, Stock};

/// Who decides admissions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Holder {
    Gate,
    Ledger,
    Replaying,
}

impl Holder {
    fn as_str(self) -> &'static str {
        match self {
            Holder::Gate => "gate",
            Holder::Ledger => "ledger",
            Holder::Replaying => "replaying",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        match s {
            "gate" => Some(Holder::Gate),
            "ledger" => Some(Holder::Ledger),
            "replaying" => Some(Holder::Replaying),
            _ => None,
        }
    }
}

/// A drop's authority row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Authority {
    pub holder: Holder,
    pub epoch: i64,
    /// When it last changed (ms since the epoch): a replay that has not finished
    /// long after it began was abandoned by a sidecar that died.
    pub changed_at_ms: i64,
}

impl fmt::Display for Authority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} at epoch {}", self.holder.as_str(), self.epoch)
    }
}

/// The drop's authority row inside `tx`; `lock` takes a shared lock on PostgreSQL
/// (SQLite has one writer: its transactions never interleave).
pub(super) async fn read_in(
    tx: &mut Transaction<'static, Any>,
    backend: Backend,
    drop_key: &str,
    lock: bool,
) -> Result<Option<Authority>, sqlx::Error> {
    let sql = match (backend, lock) {
        (Backend::Postgres, true) => {
            "SELECT holder, epoch, changed_at_ms FROM authority WHERE drop_key = $1 FOR SHARE"
        }
        _ => "SELECT holder, epoch, changed_at_ms FROM authority WHERE drop_key = $1",
    };
    let row: Option<AnyRow> = sqlx::query(sql)
        .bind(drop_key)
        .fetch_optional(&mut **tx)
        .await?;
    row.map(|row| to_authority(&row)).transpose()
}

/// The row for exclusive use in `tx` (a hand-over).
async fn lock_in(
    tx: &mut Transaction<'static, Any>,
    backend: Backend,
    drop_key: &str,
) -> Result<Option<Authority>, sqlx::Error> {
    let sql = match backend {
        Backend::Postgres => {
            "SELECT holder, epoch, changed_at_ms FROM authority WHERE drop_key = $1 FOR UPDATE"
        }
        Backend::Sqlite => "SELECT holder, epoch, changed_at_ms FROM authority WHERE drop_key = $1",
    };
    let row: Option<AnyRow> = sqlx::query(sql)
        .bind(drop_key)
        .fetch_optional(&mut **tx)
        .await?;
    row.map(|row| to_authority(&row)).transpose()
}

fn to_authority(row: &AnyRow) -> Result<Authority, sqlx::Error> {
    let holder: String = row.try_get(0)?;
    Ok(Authority {
        holder: Holder::parse(&holder)
            .ok_or_else(|| sqlx::Error::Decode(format!("unknown authority {holder:?}").into()))?,
        epoch: row.try_get(1)?,
        changed_at_ms: row.try_get(2)?,
    })
}

/// Whether a change the gate made at `epoch` may be recorded. `replaying` at the
/// same epoch admits too: Redis opens the gate at an epoch only after the replay for
/// it finished, so a change carrying it was made on a Redis in line with the ledger.
pub(super) fn admits_gate(authority: Option<&Authority>, epoch: i64) -> Result<(), RecordError> {
    match authority {
        Some(a) if a.epoch == epoch && matches!(a.holder, Holder::Gate | Holder::Replaying) => {
            Ok(())
        }
        other => Err(RecordError::NotAuthority {
            epoch,
            current: other.map_or_else(|| "no authority yet".into(), ToString::to_string),
        }),
    }
}

/// Refuses a fallback transaction unless the ledger is the drop's authority.
pub(super) async fn require_ledger(
    tx: &mut Transaction<'static, Any>,
    backend: Backend,
    drop_key: &str,
) -> Result<Result<(), Option<Authority>>, sqlx::Error> {
    Ok(match read_in(tx, backend, drop_key, true).await? {
        Some(a) if a.holder == Holder::Ledger => Ok(()),
        other => Err(other),
    })
}

impl Ledger {
    /// The drop's authority, if any sidecar has opened its gate or fallback yet.
    pub async fn authority(&self, drop_key: &str) -> Result<Option<Authority>, LedgerError> {
        let mut tx = self.pool.begin().await?;
        let authority = read_in(&mut tx, self.backend, drop_key, false).await?;
        tx.commit().await?;
        Ok(authority)
    }

    /// Hands the drop to the ledger's fallback gate at the epoch after `seen` (the
    /// authority the caller read, and closed the gate in Redis for), and returns
    /// the authority after. Refused when the authority moved since `seen` was read:
    /// the gate may have been reopened at a later epoch than the caller closed. With
    /// `quiet_since` (a Redis outage seen by this sidecar) only if no sidecar sharing
    /// this ledger reached Redis since then: one sidecar's partition does not move
    /// the others off a working gate; the authority is then returned unchanged.
    pub async fn hand_to_ledger(
        &self,
        drop_key: &str,
        stock: &Stock,
        now: i64,
        seen: Option<&Authority>,
        quiet_since: Option<i64>,
    ) -> Result<Authority, LedgerError> {
        let mut tx = self.pool.begin().await?;
        let current = lock_in(&mut tx, self.backend, drop_key).await?;
        if let Some(current) = current.as_ref().filter(|a| a.holder == Holder::Ledger) {
            tx.commit().await?;
            return Ok(current.clone());
        }
        let moved = |a: Option<&Authority>| a.map(|a| (a.holder, a.epoch));
        if moved(current.as_ref()) != moved(seen) {
            tx.commit().await?;
            return Err(LedgerError::NotAuthority(format!(
                "it moved to {} since it was read: retry",
                current.map_or_else(|| "nobody".into(), |a| a.to_string())
            )));
        }
        if let Some(since) = quiet_since {
            let seen: i64 = sqlx::query(
                "SELECT COUNT(*) FROM gate_seen WHERE drop_key = $1 AND seen_at_ms > $2",
            )
            .bind(drop_key)
            .bind(since)
            .fetch_one(&mut *tx)
            .await?
            .try_get(0)?;
            if seen > 0 {
                // Another sidecar of this ledger reached Redis since: one sidecar's
                // outage moves nobody off the gate, whether or not it was opened yet.
                tx.commit().await?;
                return current.ok_or_else(|| {
                    LedgerError::NotAuthority(
                        "other sidecars of this ledger reach Redis: one sidecar's outage hands nothing to the ledger"
                            .into(),
                    )
                });
            }
        }
        ensure_stock(&mut tx, drop_key, stock).await?;
        let epoch = current.as_ref().map_or(0, |a| a.epoch) + 1;
        put(
            &mut tx,
            drop_key,
            current.as_ref(),
            Holder::Ledger,
            epoch,
            now,
        )
        .await?;
        tx.commit().await?;
        Ok(Authority {
            holder: Holder::Ledger,
            epoch,
            changed_at_ms: now,
        })
    }

    /// Starts bringing Redis in line with the ledger before the gate opens: moves
    /// the authority from what the caller saw (`seen`) to `replaying` at an epoch
    /// above both it and `floor` (the gate's epoch in Redis). `None` when another
    /// sidecar moved it first.
    pub async fn begin_replay(
        &self,
        drop_key: &str,
        seen: Option<&Authority>,
        floor: i64,
        now: i64,
    ) -> Result<Option<i64>, LedgerError> {
        let epoch = seen.map_or(0, |a| a.epoch).max(floor) + 1;
        let mut tx = self.pool.begin().await?;
        let moved = put(&mut tx, drop_key, seen, Holder::Replaying, epoch, now).await?;
        tx.commit().await?;
        Ok(moved.then_some(epoch))
    }

    /// Ends a replay at `epoch`: the gate is the authority. False when another
    /// sidecar took the replay over meanwhile.
    pub async fn finish_replay(&self, drop_key: &str, epoch: i64) -> Result<bool, LedgerError> {
        let done = sqlx::query(
            "UPDATE authority SET holder = 'gate' WHERE drop_key = $1 AND epoch = $2 AND holder = 'replaying'",
        )
        .bind(drop_key)
        .bind(epoch)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Notes that `sidecar` reached Redis for the drop at `now`.
    pub async fn note_gate_seen(
        &self,
        drop_key: &str,
        sidecar: &str,
        now: i64,
    ) -> Result<(), LedgerError> {
        sqlx::query(
            "INSERT INTO gate_seen (drop_key, sidecar, seen_at_ms) VALUES ($1, $2, $3) \
             ON CONFLICT (drop_key, sidecar) DO UPDATE SET seen_at_ms = excluded.seen_at_ms",
        )
        .bind(drop_key)
        .bind(sidecar)
        .bind(now)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Notes the config a sidecar read in Redis (`stock`: its limit, generation and
    /// terms): when it is of a newer generation than the ledger's, the ledger's
    /// stock moves to it now, not at the next admission. So a peer sharing the
    /// ledger that could not read that config before Redis became unreachable to it
    /// decides on the fallback on it (see `effective_terms`), not on its own stale
    /// copy. Only reads when the ledger has that generation already.
    pub async fn note_config(&self, drop_key: &str, stock: &Stock) -> Result<(), LedgerError> {
        let mut tx = self.pool.begin().await?;
        ensure_stock(&mut tx, drop_key, stock).await?;
        tx.commit().await?;
        Ok(())
    }

    /// The highest change number the ledger recorded for the drop (0 when none).
    pub async fn max_seq(&self, drop_key: &str) -> Result<i64, LedgerError> {
        let row = sqlx::query("SELECT MAX(seq) FROM reservations WHERE drop_key = $1")
            .bind(drop_key)
            .fetch_one(&self.pool)
            .await?;
        Ok(row.try_get::<Option<i64>, _>(0)?.unwrap_or(0))
    }

    /// The reservation the ledger's highest change number belongs to, with that
    /// number, its state and deadline: among the rows a rebuild replays (an
    /// abandoned claim is none), and only numbers Redis handed out (the fallback's
    /// rows carry none).
    pub async fn last_change(&self, drop_key: &str) -> Result<Option<LastChange>, LedgerError> {
        let row = sqlx::query(
            "SELECT res_key, seq, state, expires_at_ms, changed_by, attempt FROM reservations \
             WHERE drop_key = $1 AND state <> 'abandoned' AND seq > 0 \
             ORDER BY seq DESC LIMIT 1",
        )
        .bind(drop_key)
        .fetch_optional(&self.pool)
        .await?;
        let Some(row) = row else {
            return Ok(None);
        };
        let state: String = row.try_get(2)?;
        Ok(Some(LastChange {
            key: row.try_get(0)?,
            seq: row.try_get(1)?,
            state: State::parse(&state).ok_or_else(|| {
                LedgerError::Sql(sqlx::Error::Protocol(format!(
                    "the ledger holds a reservation in an unknown state {state:?}"
                )))
            })?,
            expires_at_ms: row.try_get(3)?,
            changed_by: row.try_get(4)?,
            attempt: row.try_get(5)?,
        }))
    }

    /// Notes which ledger Redis named the sale's (see
    /// [`dropgate_api::DropKeys::ledger`]). Redis's latest answer stands: a different
    /// one than before is a Redis that lost the key, claimed anew by a ledger new to
    /// the sale, which now decides on the gate; this ledger may then no longer fall
    /// back for the sale on its own word (see [`Self::owns`]), or two ledgers would
    /// sell it.
    pub async fn note_sale_ledger(
        &self,
        drop_key: &str,
        ledger: &str,
        now: i64,
    ) -> Result<(), LedgerError> {
        sqlx::query(
            "INSERT INTO sales (drop_key, ledger_id, noted_at_ms) VALUES ($1, $2, $3) \
             ON CONFLICT (drop_key) DO UPDATE SET ledger_id = excluded.ledger_id, \
             noted_at_ms = excluded.noted_at_ms WHERE sales.ledger_id <> excluded.ledger_id",
        )
        .bind(drop_key)
        .bind(ledger)
        .bind(now)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The sale's ledger as Redis once named it to this ledger's sidecars.
    pub async fn sale_ledger(&self, drop_key: &str) -> Result<Option<String>, LedgerError> {
        let row = sqlx::query("SELECT ledger_id FROM sales WHERE drop_key = $1")
            .bind(drop_key)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.map(|row| row.try_get(0)).transpose()?)
    }

    /// Whether Redis once named this ledger the sale's: then no other ledger ever
    /// changed the sale, and this one holds all of it.
    pub async fn owns(&self, drop_key: &str) -> Result<bool, LedgerError> {
        Ok(self.sale_ledger(drop_key).await?.as_deref() == Some(self.id.as_str()))
    }
}

/// Writes the authority row, conditional on it still being `seen`: true when this
/// call moved it.
async fn put(
    tx: &mut Transaction<'static, Any>,
    drop_key: &str,
    seen: Option<&Authority>,
    holder: Holder,
    epoch: i64,
    now: i64,
) -> Result<bool, sqlx::Error> {
    let written = match seen {
        None => {
            sqlx::query(
                "INSERT INTO authority (drop_key, holder, epoch, changed_at_ms) VALUES ($1, $2, $3, $4) \
                 ON CONFLICT (drop_key) DO NOTHING",
            )
            .bind(drop_key)
            .bind(holder.as_str())
            .bind(epoch)
            .bind(now)
            .execute(&mut **tx)
            .await?
        }
        Some(seen) => {
            sqlx::query(
                "UPDATE authority SET holder = $1, epoch = $2, changed_at_ms = $3 \
                 WHERE drop_key = $4 AND holder = $5 AND epoch = $6",
            )
            .bind(holder.as_str())
            .bind(epoch)
            .bind(now)
            .bind(drop_key)
            .bind(seen.holder.as_str())
            .bind(seen.epoch)
            .execute(&mut **tx)
            .await?
        }
    };
    Ok(written.rows_affected() == 1)
}

/// The last change the ledger recorded of a sale Redis numbered (see
/// [`Ledger::last_change`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LastChange {
    /// The reservation's key.
    pub key: String,
    pub seq: i64,
    /// The state the change left it in.
    pub state: State,
    /// Its hold's deadline (ms): Redis keeps its marker until a while past it.
    pub expires_at_ms: i64,
    /// The attempt that prepared it in Redis, for a confirm, cancel or extension.
    pub changed_by: Option<String>,
    /// The attempt id of the admission that made the reservation (the marker's
    /// `attempt` in Redis).
    pub attempt: Option<String>,
}
