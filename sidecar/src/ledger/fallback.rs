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
    Change, Ledger, LedgerError, State, adjust_holdings, ensure_stock, insert_reservation,
    transition, write_event,
};
use crate::gate::GateReply;

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

/// What a fallback transaction came to.
enum Decision {
    Reply(GateReply),
    /// The ledger is not the drop's authority: nothing was changed.
    NotAuthority(String),
}

/// [`Ledger::fallback_retry`]'s word for a key the ledger does not hold.
const NEW_KEY: &str = "new_key";

/// Attempts at a transaction that lost a race (a PostgreSQL unique or
/// serialisation conflict) before giving up.
const ATTEMPTS: usize = 5;

impl Ledger {
    pub async fn fallback_reserve(
        &self,
        drop_key: &str,
        config: &DropConfig,
        key: &str,
        user: &str,
        quantity: i64,
        now: i64,
    ) -> Result<GateReply, LedgerError> {
        let change = Change {
            drop_key: drop_key.to_string(),
            limit: config.limit,
            generation: config.generation,
            key: key.to_string(),
            user: user.to_string(),
            quantity,
            state: State::Active,
            expires_at_ms: now + config.hold_seconds * 1000,
            seq: None,
            epoch: 0,
            from_pending: false,
        };
        retry(|| async {
            let mut tx = self.pool.begin().await?;
            if let Err(authority) = require_ledger(&mut tx, self.backend, drop_key).await? {
                return Ok(not_authority(authority));
            }
            ensure_stock(&mut tx, drop_key, config.limit, config.generation).await?;
            if !insert_reservation(&mut tx, &change, "fallback", false, now).await? {
                let existing = expire_if_due(&mut tx, drop_key, config, key, now).await?;
                let reply = match retry_answer(&mut tx, drop_key, existing, user, quantity).await? {
                    Some(reply) => reply,
                    None => answer(&mut tx, drop_key, "idempotency_key_reused", None).await?,
                };
                tx.commit().await?;
                return Ok(Decision::Reply(reply));
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
                return Ok(Decision::Reply(refusal("per_user_limit_exceeded", Some(user), Some(held), Some(config.per_user_limit), None)));
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
                let left = available(&mut tx, drop_key).await?;
                tx.rollback().await?;
                return Ok(Decision::Reply(refusal("sold_out", None, None, None, Some(left))));
            }
            write_event(&mut tx, &change, "fallback", now).await?;
            let row = read(&mut tx, drop_key, key).await?;
            let reply = answer(&mut tx, drop_key, "admitted", row.as_ref()).await?;
            tx.commit().await?;
            Ok(Decision::Reply(reply))
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
    ) -> Result<Option<GateReply>, LedgerError> {
        let reply = retry(|| async {
            let mut tx = self.pool.begin().await?;
            if let Err(authority) = require_ledger(&mut tx, self.backend, drop_key).await? {
                return Ok(not_authority(authority));
            }
            ensure_stock(&mut tx, drop_key, config.limit, config.generation).await?;
            let existing = expire_if_due(&mut tx, drop_key, config, key, now).await?;
            let reply = retry_answer(&mut tx, drop_key, existing, user, quantity)
                .await?
                .unwrap_or_else(|| refusal(NEW_KEY, None, None, None, None));
            tx.commit().await?;
            Ok(Decision::Reply(reply))
        })
        .await?;
        Ok((reply.outcome != NEW_KEY).then_some(reply))
    }

    /// confirm, cancel or look-up (`to` = None) on the fallback path.
    pub async fn fallback_settle(
        &self,
        drop_key: &str,
        config: &DropConfig,
        key: &str,
        to: Option<State>,
        now: i64,
    ) -> Result<GateReply, LedgerError> {
        retry(|| async {
            let mut tx = self.pool.begin().await?;
            if let Err(authority) = require_ledger(&mut tx, self.backend, drop_key).await? {
                return Ok(not_authority(authority));
            }
            ensure_stock(&mut tx, drop_key, config.limit, config.generation).await?;
            let before = read(&mut tx, drop_key, key).await?;
            let Some(row) = expire_if_due(&mut tx, drop_key, config, key, now).await? else {
                tx.commit().await?;
                return Ok(Decision::Reply(refusal(
                    "not_found",
                    None,
                    None,
                    None,
                    None,
                )));
            };
            let expired_now = before.as_ref().is_some_and(|b| b.state == State::Active)
                && row.state == State::Expired;
            let outcome = match (to, row.state) {
                // A look-up that expired the hold answers it like any look-up.
                (None, _) => "found",
                (_, State::Expired) if expired_now => "expired",
                (Some(State::Confirmed), State::Active)
                | (Some(State::Cancelled), State::Active | State::Confirmed) => {
                    let target = to.unwrap_or(State::Cancelled);
                    let change = Change {
                        drop_key: drop_key.to_string(),
                        limit: config.limit,
                        generation: config.generation,
                        key: key.to_string(),
                        user: row.user.clone(),
                        quantity: row.quantity,
                        state: target,
                        expires_at_ms: row.expires_at_ms,
                        seq: None,
                        epoch: 0,
                        from_pending: false,
                    };
                    if !transition(&mut tx, &change, false, now).await? {
                        return Err(sqlx::Error::Protocol(RACED.into()));
                    }
                    if target == State::Cancelled {
                        adjust_holdings(&mut tx, &change, 1).await?;
                    }
                    write_event(&mut tx, &change, "fallback", now).await?;
                    target.as_str()
                }
                (Some(State::Confirmed), State::Confirmed) => "already_confirmed",
                (Some(State::Cancelled), State::Cancelled) => "already_cancelled",
                (_, state) => state.as_str(),
            };
            let row = read(&mut tx, drop_key, key).await?;
            let reply = answer(&mut tx, drop_key, outcome, row.as_ref()).await?;
            tx.commit().await?;
            Ok(Decision::Reply(reply))
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

/// The word a transaction that lost a race to a concurrent one fails with.
const RACED: &str = "raced with a concurrent transaction; retrying";

/// A retry's answer from the row its key holds: `already_reserved` for the same
/// buyer and quantity, `idempotency_key_reused` for any other; `None` when the key
/// holds nothing.
async fn retry_answer(
    tx: &mut Transaction<'static, Any>,
    drop_key: &str,
    row: Option<Recorded>,
    user: &str,
    quantity: i64,
) -> Result<Option<GateReply>, sqlx::Error> {
    Ok(match row {
        None => None,
        Some(row) if row.user == user && row.quantity == quantity => {
            Some(answer(tx, drop_key, "already_reserved", Some(&row)).await?)
        }
        Some(_) => Some(answer(tx, drop_key, "idempotency_key_reused", None).await?),
    })
}

fn not_authority(authority: Option<super::Authority>) -> Decision {
    Decision::NotAuthority(authority.map_or_else(
        || "no sidecar has handed it to the ledger".into(),
        |a| format!("the authority is {a}"),
    ))
}

/// Runs a transaction again when it lost a race to a concurrent one.
async fn retry<F, Fut>(mut attempt: F) -> Result<GateReply, LedgerError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Decision, sqlx::Error>>,
{
    for _ in 0..ATTEMPTS {
        match attempt().await {
            Ok(Decision::Reply(reply)) => return Ok(reply),
            Ok(Decision::NotAuthority(why)) => return Err(LedgerError::NotAuthority(why)),
            Err(e) if is_race(&e) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Err(LedgerError::Contended(ATTEMPTS))
}

fn is_race(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Database(db) => {
            matches!(db.code().as_deref(), Some("23505" | "40001" | "40P01"))
        }
        sqlx::Error::Protocol(message) => message == RACED,
        _ => false,
    }
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
            .ok_or_else(|| sqlx::Error::Protocol(format!("unknown state {state:?}")))?,
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
    let change = Change {
        drop_key: drop_key.to_string(),
        limit: config.limit,
        generation: config.generation,
        key: key.to_string(),
        user: row.user.clone(),
        quantity: row.quantity,
        state: State::Expired,
        expires_at_ms: row.expires_at_ms,
        seq: None,
        epoch: 0,
        from_pending: false,
    };
    if transition(tx, &change, false, now).await? {
        adjust_holdings(tx, &change, 1).await?;
        write_event(tx, &change, "fallback", now).await?;
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

async fn answer(
    tx: &mut Transaction<'static, Any>,
    drop_key: &str,
    outcome: &str,
    row: Option<&Recorded>,
) -> Result<GateReply, sqlx::Error> {
    let remaining = available(tx, drop_key).await?;
    Ok(GateReply {
        user: row.map(|r| r.user.clone()),
        quantity: row.map(|r| r.quantity),
        state: row.map(|r| r.state.as_str().to_string()),
        when: row.map(|r| r.expires_at_ms),
        remaining: Some(remaining),
        ..GateReply::made(outcome)
    })
}

fn refusal(
    outcome: &str,
    user: Option<&str>,
    quantity: Option<i64>,
    when: Option<i64>,
    remaining: Option<i64>,
) -> GateReply {
    GateReply {
        user: user.map(str::to_string),
        quantity,
        when,
        remaining,
        ..GateReply::made(outcome)
    }
}
