//! The ledger's own gate: reserve, confirm, cancel and look-up when Redis is not the
//! gate (kill switch, or Redis unreachable under failurePolicy Open).
//!
//! Each call is one transaction that checks and changes together: the reservation
//! row is inserted first (the idempotency check), then the per-user count and the
//! stock move by conditional UPDATEs (`... WHERE available >= q`). With PostgreSQL
//! shared by every sidecar, concurrent transactions serialise on those rows, so the
//! fallback cannot oversell either. Every change is marked for replay into Redis.
//!
//! Each transaction first checks that the ledger is the drop's authority (see
//! [`super::authority`]): a sidecar still on the fallback after the gate reopened
//! is refused.

use dropgate_api::DropConfig;
use sqlx::{Any, Row, Transaction};

use super::authority::require_ledger;
use super::{
    EventIds, Ledger, LedgerError, adjust_holdings, ensure_stock, insert_reservation, transition,
    write_event,
};
use crate::reservation::{Change, Outcome, Reservation, Settle, State, Stock, View};

/// A reservation as the ledger holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Recorded {
    pub key: String,
    pub user: String,
    pub quantity: i64,
    pub state: State,
    pub expires_at_ms: i64,
    /// Redis's number for its last change on the gate (0 for fallback changes).
    pub seq: i64,
}

impl Recorded {
    pub fn reservation(&self) -> Reservation {
        Reservation {
            user: self.user.clone(),
            quantity: self.quantity,
            state: self.state,
            expires_at_ms: self.expires_at_ms,
        }
    }
}

/// What a fallback transaction came to.
enum Decision<T> {
    Done(T),
    /// The ledger is not the drop's authority: nothing was changed.
    NotAuthority(String),
}

/// Why a fallback transaction did not come to a decision.
enum TxError {
    Sql(sqlx::Error),
    /// It lost a race to a concurrent transaction (the row it was to move moved):
    /// run it again.
    Raced,
}

impl From<sqlx::Error> for TxError {
    fn from(error: sqlx::Error) -> Self {
        TxError::Sql(error)
    }
}

/// Attempts at a transaction that lost a race (a PostgreSQL unique or
/// serialisation conflict) before giving up.
const ATTEMPTS: usize = 5;

fn stock(config: &DropConfig) -> Stock {
    Stock {
        limit: config.limit,
        generation: config.generation,
    }
}

impl Ledger {
    pub async fn fallback_reserve(
        &self,
        drop_key: &str,
        config: &DropConfig,
        key: &str,
        user: &str,
        quantity: i64,
        now: i64,
    ) -> Result<Outcome, LedgerError> {
        let held = Reservation {
            user: user.to_string(),
            quantity,
            state: State::Active,
            expires_at_ms: now + config.hold_seconds * 1000,
        };
        let change = Change::new(drop_key, stock(config), key, &held, State::Active);
        retry(|| async {
            let mut tx = self.pool.begin().await?;
            if let Err(authority) = require_ledger(&mut tx, self.backend, drop_key).await? {
                return Ok(not_authority(authority));
            }
            ensure_stock(&mut tx, drop_key, config.limit, config.generation).await?;
            if !insert_reservation(&mut tx, &change, "fallback", false, now).await? {
                let existing = expire_if_due(&mut tx, drop_key, config, key, now).await?;
                let outcome = match retry_answer(&mut tx, drop_key, existing, user, quantity).await? {
                    Some(outcome) => outcome,
                    None => Outcome::KeyReused,
                };
                tx.commit().await?;
                return Ok(Decision::Done(outcome));
            }
            sqlx::query(
                "INSERT INTO buyers (drop_key, user_id, held) VALUES ($1, $2, 0) \
                 ON CONFLICT (drop_key, user_id) DO NOTHING",
            )
            .bind(drop_key)
            .bind(user)
            .execute(&mut *tx)
            .await?;
            let within_limit = sqlx::query(
                "UPDATE buyers SET held = held + $1 WHERE drop_key = $2 AND user_id = $3 AND held + $4 <= $5",
            )
            .bind(quantity)
            .bind(drop_key)
            .bind(user)
            .bind(quantity)
            .bind(config.per_user_limit)
            .execute(&mut *tx)
            .await?
            .rows_affected()
                == 1;
            if !within_limit {
                let held: i64 = sqlx::query("SELECT held FROM buyers WHERE drop_key = $1 AND user_id = $2")
                    .bind(drop_key)
                    .bind(user)
                    .fetch_one(&mut *tx)
                    .await?
                    .try_get(0)?;
                tx.rollback().await?;
                return Ok(Decision::Done(Outcome::PerUserLimit { held, limit: config.per_user_limit }));
            }
            let in_stock = sqlx::query("UPDATE stock SET available = available - $1 WHERE drop_key = $2 AND available >= $3")
                .bind(quantity)
                .bind(drop_key)
                .bind(quantity)
                .execute(&mut *tx)
                .await?
                .rows_affected()
                == 1;
            if !in_stock {
                let remaining = available(&mut tx, drop_key).await?;
                tx.rollback().await?;
                return Ok(Decision::Done(Outcome::SoldOut { remaining }));
            }
            let mut ids = EventIds::for_events(1);
            write_event(&mut tx, &mut ids, &change, "fallback", now).await?;
            let view = view(&mut tx, drop_key, key).await?;
            tx.commit().await?;
            Ok(Decision::Done(Outcome::Admitted(view)))
        })
        .await
    }

    /// The answer to a retry of `key`, when the ledger already holds it: what the
    /// gate checks first, before the sale window, the permit and the stock, so
    /// that a retry of an admitted key hears `already_reserved` (or
    /// `idempotency_key_reused`) whatever else changed since. `None`: a new key.
    pub async fn fallback_retry(
        &self,
        drop_key: &str,
        config: &DropConfig,
        key: &str,
        user: &str,
        quantity: i64,
        now: i64,
    ) -> Result<Option<Outcome>, LedgerError> {
        retry(|| async {
            let mut tx = self.pool.begin().await?;
            if let Err(authority) = require_ledger(&mut tx, self.backend, drop_key).await? {
                return Ok(not_authority(authority));
            }
            ensure_stock(&mut tx, drop_key, config.limit, config.generation).await?;
            let existing = expire_if_due(&mut tx, drop_key, config, key, now).await?;
            let outcome = retry_answer(&mut tx, drop_key, existing, user, quantity).await?;
            tx.commit().await?;
            Ok(Decision::Done(outcome))
        })
        .await
    }

    /// confirm, cancel or look-up on the fallback path.
    pub async fn fallback_settle(
        &self,
        drop_key: &str,
        config: &DropConfig,
        key: &str,
        settle: Settle,
        now: i64,
    ) -> Result<Outcome, LedgerError> {
        retry(|| async {
            let mut tx = self.pool.begin().await?;
            if let Err(authority) = require_ledger(&mut tx, self.backend, drop_key).await? {
                return Ok(not_authority(authority));
            }
            ensure_stock(&mut tx, drop_key, config.limit, config.generation).await?;
            // A hold past its deadline expires first, whatever was asked.
            let Some(row) = expire_if_due(&mut tx, drop_key, config, key, now).await? else {
                tx.commit().await?;
                return Ok(Decision::Done(Outcome::NotFound));
            };
            let target = match (settle, row.state) {
                (Settle::Confirm, State::Active) => Some(State::Confirmed),
                (Settle::Cancel, State::Active | State::Confirmed) => Some(State::Cancelled),
                _ => None,
            };
            if let Some(target) = target {
                let change = Change::new(drop_key, stock(config), key, &row.reservation(), target);
                if !transition(&mut tx, &change, false, now).await? {
                    return Err(TxError::Raced);
                }
                if target == State::Cancelled {
                    adjust_holdings(&mut tx, &change, 1).await?;
                }
                let mut ids = EventIds::for_events(1);
                write_event(&mut tx, &mut ids, &change, "fallback", now).await?;
            }
            let view = view(&mut tx, drop_key, key).await?;
            let outcome = match (settle, row.state) {
                // A look-up that expired the hold answers it like any look-up.
                (Settle::Lookup, _) => Outcome::Found(view),
                (_, State::Expired) => Outcome::Expired(view),
                (Settle::Confirm, State::Active) => Outcome::Confirmed(view),
                (Settle::Confirm, State::Confirmed) => Outcome::AlreadyConfirmed(view),
                (Settle::Confirm, State::Cancelled) => Outcome::WasCancelled(view),
                (Settle::Cancel, State::Active | State::Confirmed) => Outcome::Cancelled(view),
                (Settle::Cancel, State::Cancelled) => Outcome::AlreadyCancelled(view),
                // The ledger never records a pending admission.
                (_, State::Pending) => Outcome::Recording,
            };
            tx.commit().await?;
            Ok(Decision::Done(outcome))
        })
        .await
    }

    /// Expires the drop's active holds whose deadline is at or before `due`, each
    /// once, returning their units and writing their events; returns their keys. The
    /// fallback's sweeper, with the ledger in charge.
    pub async fn expire_due(
        &self,
        drop_key: &str,
        config: &DropConfig,
        due: i64,
        batch: i64,
    ) -> Result<Vec<String>, LedgerError> {
        let mut expired = Vec::new();
        for key in self.active_due(drop_key, due, batch).await? {
            if self.expire_one(drop_key, config, &key, due).await? {
                expired.push(key);
            }
        }
        Ok(expired)
    }

    /// Keys of the drop's active holds whose deadline is at or before `due`.
    pub async fn active_due(
        &self,
        drop_key: &str,
        due: i64,
        batch: i64,
    ) -> Result<Vec<String>, LedgerError> {
        let keys = sqlx::query(
            "SELECT res_key FROM reservations WHERE drop_key = $1 AND state = 'active' AND expires_at_ms <= $2 LIMIT $3",
        )
        .bind(drop_key)
        .bind(due)
        .bind(batch)
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(|row| row.try_get(0))
        .collect::<Result<_, _>>()?;
        Ok(keys)
    }

    /// Expires the hold of `key` if it is active with a deadline at or before
    /// `due`, returning its units and writing its event; true when it did.
    pub async fn expire_one(
        &self,
        drop_key: &str,
        config: &DropConfig,
        key: &str,
        due: i64,
    ) -> Result<bool, LedgerError> {
        let mut tx = self.pool.begin().await?;
        let before = read(&mut tx, drop_key, key).await?;
        let after = expire_if_due(&mut tx, drop_key, config, key, due).await?;
        tx.commit().await?;
        Ok(before.is_some_and(|b| b.state == State::Active)
            && after.is_some_and(|a| a.state == State::Expired))
    }

    /// Changes Redis has not seen yet: made on the fallback path, or recorded for an
    /// admission whose activation in Redis failed.
    pub async fn unreplayed(
        &self,
        drop_key: &str,
        batch: i64,
    ) -> Result<Vec<Recorded>, LedgerError> {
        let rows = sqlx::query(
            "SELECT res_key, user_id, quantity, state, expires_at_ms, seq FROM reservations \
             WHERE drop_key = $1 AND replayed = 0 ORDER BY updated_at_ms LIMIT $2",
        )
        .bind(drop_key)
        .bind(batch)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| to_row(row).map_err(Into::into))
            .collect()
    }

    /// Every reservation of the drop, `batch` at a time in key order after
    /// `after`: what a Redis that lost writes is rebuilt from.
    pub async fn recorded_after(
        &self,
        drop_key: &str,
        after: &str,
        batch: i64,
    ) -> Result<Vec<Recorded>, LedgerError> {
        let rows = sqlx::query(
            "SELECT res_key, user_id, quantity, state, expires_at_ms, seq FROM reservations \
             WHERE drop_key = $1 AND res_key > $2 ORDER BY res_key LIMIT $3",
        )
        .bind(drop_key)
        .bind(after)
        .bind(batch)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| to_row(row).map_err(Into::into))
            .collect()
    }

    /// Claims `key` for an admission judged dead before it was recorded: a
    /// placeholder row (expired, no units, no event) so that its commit, should it
    /// land after all, finds the key used and is refused. False when the key has a
    /// record already (the commit came first).
    pub async fn claim_abandoned(
        &self,
        drop_key: &str,
        key: &str,
        user: &str,
        quantity: i64,
        now: i64,
    ) -> Result<bool, LedgerError> {
        let claimed = sqlx::query(
            "INSERT INTO reservations \
             (drop_key, res_key, user_id, quantity, state, path, expires_at_ms, updated_at_ms, replayed, seq) \
             VALUES ($1, $2, $3, $4, 'expired', 'gate', $5, $6, 1, NULL) \
             ON CONFLICT (drop_key, res_key) DO NOTHING",
        )
        .bind(drop_key)
        .bind(key)
        .bind(user)
        .bind(quantity)
        .bind(now)
        .bind(now)
        .execute(&self.pool)
        .await?;
        Ok(claimed.rows_affected() == 1)
    }

    /// Marks a change as one Redis has not seen (its activation failed).
    pub async fn mark_unreplayed(&self, drop_key: &str, key: &str) -> Result<(), LedgerError> {
        sqlx::query("UPDATE reservations SET replayed = 0 WHERE drop_key = $1 AND res_key = $2")
            .bind(drop_key)
            .bind(key)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Marks a replayed change, unless the reservation moved on since it was read.
    pub async fn mark_replayed(
        &self,
        drop_key: &str,
        key: &str,
        state: State,
    ) -> Result<(), LedgerError> {
        sqlx::query("UPDATE reservations SET replayed = 1 WHERE drop_key = $1 AND res_key = $2 AND state = $3")
            .bind(drop_key)
            .bind(key)
            .bind(state.as_str())
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// The reservation of `key`, if the ledger has it.
    pub async fn reservation(
        &self,
        drop_key: &str,
        key: &str,
    ) -> Result<Option<Recorded>, LedgerError> {
        let mut tx = self.pool.begin().await?;
        let row = read(&mut tx, drop_key, key).await?;
        tx.commit().await?;
        Ok(row)
    }

    /// The fallback gate's stock for the drop, if it has a row.
    pub async fn available(&self, drop_key: &str) -> Result<Option<i64>, LedgerError> {
        let row = sqlx::query("SELECT available FROM stock WHERE drop_key = $1")
            .bind(drop_key)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.map(|row| row.try_get(0)).transpose()?)
    }
}

/// A retry's answer from the row its key holds: `already_reserved` for the same
/// buyer and quantity, `idempotency_key_reused` for any other; `None` when the key
/// holds nothing.
async fn retry_answer(
    tx: &mut Transaction<'static, Any>,
    drop_key: &str,
    row: Option<Recorded>,
    user: &str,
    quantity: i64,
) -> Result<Option<Outcome>, sqlx::Error> {
    Ok(match row {
        None => None,
        Some(row) if row.user == user && row.quantity == quantity => {
            Some(Outcome::AlreadyReserved(View {
                reservation: row.reservation(),
                remaining: available(tx, drop_key).await?,
            }))
        }
        Some(_) => Some(Outcome::KeyReused),
    })
}

fn not_authority<T>(authority: Option<super::Authority>) -> Decision<T> {
    Decision::NotAuthority(authority.map_or_else(
        || "no sidecar has handed it to the ledger".into(),
        |a| format!("the authority is {a}"),
    ))
}

/// Runs a transaction again when it lost a race to a concurrent one.
async fn retry<T, F, Fut>(mut attempt: F) -> Result<T, LedgerError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Decision<T>, TxError>>,
{
    for _ in 0..ATTEMPTS {
        match attempt().await {
            Ok(Decision::Done(done)) => return Ok(done),
            Ok(Decision::NotAuthority(why)) => return Err(LedgerError::NotAuthority(why)),
            Err(TxError::Raced) => {}
            Err(TxError::Sql(sqlx::Error::Database(db)))
                if matches!(db.code().as_deref(), Some("23505" | "40001" | "40P01")) => {}
            Err(TxError::Sql(e)) => return Err(e.into()),
        }
    }
    Err(LedgerError::Contended(ATTEMPTS))
}

pub(super) async fn read(
    tx: &mut Transaction<'static, Any>,
    drop_key: &str,
    key: &str,
) -> Result<Option<Recorded>, sqlx::Error> {
    let row = sqlx::query(
        "SELECT res_key, user_id, quantity, state, expires_at_ms, seq FROM reservations WHERE drop_key = $1 AND res_key = $2",
    )
    .bind(drop_key)
    .bind(key)
    .fetch_optional(&mut **tx)
    .await?;
    row.as_ref().map(to_row).transpose()
}

fn to_row(row: &sqlx::any::AnyRow) -> Result<Recorded, sqlx::Error> {
    let state: String = row.try_get(3)?;
    Ok(Recorded {
        key: row.try_get(0)?,
        user: row.try_get(1)?,
        quantity: row.try_get(2)?,
        state: State::parse(&state)
            .ok_or_else(|| sqlx::Error::Decode(format!("unknown state {state:?}").into()))?,
        expires_at_ms: row.try_get(4)?,
        seq: row.try_get::<Option<i64>, _>(5)?.unwrap_or(0),
    })
}

/// Expires the hold of `key` if it is active and past its deadline, returning its
/// units and writing the event; returns the reservation as it then stands.
async fn expire_if_due(
    tx: &mut Transaction<'static, Any>,
    drop_key: &str,
    config: &DropConfig,
    key: &str,
    now: i64,
) -> Result<Option<Recorded>, sqlx::Error> {
    let Some(row) = read(tx, drop_key, key).await? else {
        return Ok(None);
    };
    if row.state != State::Active || row.expires_at_ms > now {
        return Ok(Some(row));
    }
    let change = Change::new(
        drop_key,
        stock(config),
        key,
        &row.reservation(),
        State::Expired,
    );
    if transition(tx, &change, false, now).await? {
        adjust_holdings(tx, &change, 1).await?;
        let mut ids = EventIds::for_events(1);
        write_event(tx, &mut ids, &change, "fallback", now).await?;
    }
    read(tx, drop_key, key).await
}

async fn available(tx: &mut Transaction<'static, Any>, drop_key: &str) -> Result<i64, sqlx::Error> {
    sqlx::query("SELECT available FROM stock WHERE drop_key = $1")
        .bind(drop_key)
        .fetch_one(&mut **tx)
        .await?
        .try_get(0)
}

/// The reservation of `key` as an answer shows it, with the stock left.
async fn view(
    tx: &mut Transaction<'static, Any>,
    drop_key: &str,
    key: &str,
) -> Result<View, sqlx::Error> {
    let reservation = read(tx, drop_key, key)
        .await?
        .map(|row| row.reservation())
        .ok_or_else(|| sqlx::Error::RowNotFound)?;
    Ok(View {
        reservation,
        remaining: available(tx, drop_key).await?,
    })
}
