//! Confirm, cancel and look-up, on the Redis gate or the ledger's fallback gate.

use dropgate_api::DropConfig;

use super::handover::{self, Opening, Reason};
use super::record::{change_key, change_of, record_expiry, replay_later};
use super::{Call, Failure, Served, Turn, decide, on_ledger, redis_failed};
use crate::app::App;
use crate::clock::now_ms;
use crate::drops::Drop;
use crate::gate::{self, Reply};
use crate::ledger::{RecordError, Recorded};
use crate::reservation::{Outcome, Settle, State, View};

/// Confirms, cancels or looks up the reservation `key` of drop `drop_name`, on
/// whichever gate decides the drop now.
pub async fn settle(
    app: &App,
    drop_name: &str,
    key: &str,
    settle: Settle,
) -> Result<Served, Failure> {
    let drop = super::find_drop(app, drop_name).await?;
    decide(app, &drop, Call::Settle(key, settle)).await
}

/// A reservation that no longer waits for its buyer frees its permit at once,
/// whichever call found it so (a look-up that expired it included), on either
/// gate, before anything else can fail.
fn free_permit_if_settled(drop: &Drop, key: &str, outcome: &Outcome) {
    if outcome.settles() {
        drop.throttle.release(key);
    }
}

/// Confirm, cancel or look-up on the ledger's gate. `None`: the drop is back on
/// the gate, try there.
pub(super) async fn on_fallback(
    app: &App,
    drop: &Drop,
    config: &DropConfig,
    key: &str,
    settle: Settle,
    reason: Reason,
) -> Option<Result<Outcome, Failure>> {
    let ledger_key = drop.ledger_key();
    let decided = on_ledger(app, drop, reason, || {
        app.ledger
            .fallback_settle(&ledger_key, config, key, settle, now_ms())
    })
    .await
    .transpose();
    if let Some(Ok(outcome)) = &decided {
        free_permit_if_settled(drop, key, outcome);
    }
    decided
}

/// One attempt at the Redis gate: the script, the expiry it made on the way, and
/// the ledger's record of a confirm or cancel (the ledger's word when Redis has no
/// marker for the key).
pub(super) async fn on_gate(
    app: &App,
    drop: &Drop,
    config: &DropConfig,
    key: &str,
    settle: Settle,
) -> Turn<Outcome> {
    let mut conn = app.redis.clone();
    let reply = match settle {
        Settle::Confirm => gate::confirm(&mut conn, &drop.keys, key).await,
        Settle::Cancel => gate::cancel(&mut conn, &drop.keys, key).await,
        Settle::Lookup => gate::lookup(&mut conn, &drop.keys, key).await,
    };
    let reply = match reply {
        Ok(reply) => reply,
        Err(e) => return Turn::Reroute(redis_failed(app, drop, config, &e)),
    };
    app.breaker(Some(drop)).answered();
    if reply.outcome == Outcome::Closed {
        return Turn::Reopen { suspect: false };
    }
    record_expiry(app, drop, config, key, &reply.step).await;
    if reply.outcome == Outcome::NotFound {
        // Redis has no granted marker of this sale: an admission still being
        // recorded, or a marker that outlived its TTL. Answer from the ledger's
        // record, moving no unit: replaying it here would take its units a second
        // time.
        let outcome = match app.ledger.reservation(&drop.ledger_key(), key).await {
            Ok(Some(row)) => from_ledger(row, settle),
            Ok(None) => Outcome::NotFound,
            Err(e) => {
                return Turn::Done(Err(Failure::unavailable(format!(
                    "Redis has no reservation {key} and the ledger could not be asked ({e}): nothing was changed"
                ))));
            }
        };
        free_permit_if_settled(drop, key, &outcome);
        return Turn::Done(Ok(outcome));
    }
    free_permit_if_settled(drop, key, &reply.outcome);
    match record_settled(app, drop, config, key, &reply).await {
        Ok(None) => Turn::Done(Ok(reply.outcome)),
        Ok(Some(overruled)) => Turn::Done(Ok(overruled)),
        Err(failure) => Turn::Done(Err(failure)),
    }
}

/// What the ledger's record says when Redis has no marker for the key.
fn from_ledger(row: Recorded, settle: Settle) -> Outcome {
    let expires_at_ms = row.expires_at_ms;
    let state = row.state;
    // Redis's count is not the ledger's: nothing is said about what is left.
    let view = View {
        reservation: row.reservation(),
        remaining: 0,
    };
    match (settle, state) {
        (Settle::Lookup, _) => Outcome::Found(view),
        (_, State::Active) if expires_at_ms > now_ms() => Outcome::Recording,
        (_, State::Active | State::Expired) => Outcome::Expired(view),
        (Settle::Confirm, State::Confirmed) => Outcome::AlreadyConfirmed(view),
        (Settle::Cancel, State::Cancelled) => Outcome::AlreadyCancelled(view),
        (Settle::Confirm, State::Cancelled) => Outcome::WasCancelled(view),
        (Settle::Cancel, State::Confirmed) | (_, State::Pending) => Outcome::RecordExpired(view),
    }
}

/// Records in the ledger what the Redis gate decided for a confirm or cancel (also
/// an `already_*` answer, which heals a record an earlier failure missed).
/// `Some(Overruled)` when the ledger's record went elsewhere: its word stands.
async fn record_settled(
    app: &App,
    drop: &Drop,
    config: &DropConfig,
    key: &str,
    reply: &Reply,
) -> Result<Option<Outcome>, Failure> {
    let (state, view) = match &reply.outcome {
        Outcome::Confirmed(view) | Outcome::AlreadyConfirmed(view) => (State::Confirmed, view),
        Outcome::Cancelled(view) | Outcome::AlreadyCancelled(view) => (State::Cancelled, view),
        _ => return Ok(None),
    };
    if reply.step.epoch.is_none() {
        // Not decided by an open gate: nothing to record.
        return Ok(None);
    }
    let change = change_of(drop, config, key, &reply.step, &view.reservation, state);
    let mut recorded = app.ledger.record(change.clone()).await;
    if matches!(recorded, Err(RecordError::NotAuthority { .. })) {
        // This ledger is behind the gate's epoch (it never joined it, or a peer
        // with a ledger of its own reopened the gate): join, then record.
        if handover::open_gate(app, drop, false).await == Opening::Open {
            recorded = app.ledger.record(change).await;
        }
    }
    match recorded {
        Ok(()) => Ok(None),
        Err(RecordError::KeyUsed { state: recorded }) => {
            // Redis is brought in line with the ledger by the refresh's replay.
            replay_later(app, drop, &change_key(drop, &reply.step), key).await;
            Ok(Some(Outcome::Overruled {
                recorded,
                asked: state,
            }))
        }
        Err(e) => Err(Failure::unavailable(format!(
            "Redis has the reservation {} but the ledger did not record it ({e}): retry",
            state.as_str()
        ))),
    }
}
