//! Confirm, cancel and look-up, on the Redis gate or the ledger's fallback gate.

use dropgate_api::DropConfig;

use std::time::{Duration, Instant};

use super::handover::{self, Opening, Reason};
use super::record::{change_key, change_of, record_expiry, replay_later};
use super::{
    Backoff, Call, Checked, Failure, IN_FLIGHT_GRACE, Served, Throttled, Turn, decide,
    foreign_ledger, on_ledger, pending_bound_ms, redis_failed,
};
use crate::app::App;
use crate::clock::now_ms;
use crate::drops::Drop;
use crate::gate::{self, Finished, Prepare, Reply, Settling};
use crate::ledger::COMMIT_DEADLINE_MS;
use crate::ledger::carts::CartCommit;
use crate::ledger::{LedgerError, RecordError, Recorded};
use crate::reservation::{Change, Outcome, Settle, State, View};

/// Confirms, cancels or looks up the reservation `key` of drop `drop_name`, on
/// whichever gate decides the drop now.
pub async fn settle(
    app: &App,
    drop_name: &str,
    key: &str,
    settle: Settle,
) -> Result<Served, Failure> {
    settle_for(app, drop_name, key, settle, None).await
}

/// [`settle`] on behalf of buyer `user`, when named: a confirm or cancel of a
/// reservation that is another buyer's answers [`Outcome::NotOwner`] and changes
/// nothing. The reservation is looked up first (on whichever gate decides the
/// drop) and settled only if it is `user`'s: a key's buyer never changes once its
/// reservation was answered, and a key the look-up does not find is answered as
/// not found rather than settled, so a reservation made under it meanwhile is
/// never touched on the strength of a look-up that did not see it.
pub async fn settle_for(
    app: &App,
    drop_name: &str,
    key: &str,
    settle: Settle,
    user: Option<&str>,
) -> Result<Served, Failure> {
    let drop = super::find_drop(app, drop_name).await?;
    // A cart's line lives and ends with its cart (the cart's deadline, the cart's
    // confirm and cancel): it is neither extended nor confirmed in part alone.
    if let Settle::Extend { .. } | Settle::Confirm { quantity: Some(_) } = settle
        && let Some(cart) = cart_of_line(app, drop_name, key).await?
    {
        return Ok(Served {
            outcome: Outcome::CartLine {
                cart,
                asked: settle,
            },
            path: super::Path::Gate,
        });
    }
    if let Some(user) = user
        && settle != Settle::Lookup
    {
        let looked = decide(app, &drop, Call::Settle(key, Settle::Lookup)).await?;
        match looked.outcome.view() {
            None => return Ok(looked),
            Some(view) if view.reservation.user != user => {
                return Ok(Served {
                    outcome: Outcome::NotOwner,
                    path: looked.path,
                });
            }
            Some(_) => {}
        }
    }
    decide(app, &drop, Call::Settle(key, settle)).await
}

/// The cart whose line `key` of drop `drop_name` is (`<cart key>:<n>`, the cart's
/// n-th line being of that drop), if the ledger has that cart.
async fn cart_of_line(app: &App, drop_name: &str, key: &str) -> Result<Option<String>, Failure> {
    let Some((cart, n)) = key.rsplit_once(':') else {
        return Ok(None);
    };
    let Some(n) = n.parse::<usize>().ok().filter(|n| *n > 0) else {
        return Ok(None);
    };
    if cart.is_empty() {
        return Ok(None);
    }
    match app.ledger.cart(app.drops.namespace(), cart).await {
        Ok(row) => Ok(row
            .filter(|row| {
                super::cart::lines_of(row)
                    .get(n - 1)
                    .is_some_and(|line| line.drop == drop_name)
            })
            .map(|row| row.key)),
        Err(e) => Err(Failure::unavailable(format!(
            "the ledger could not say whether {key} is a cart's line ({e}): nothing was changed; retry"
        ))),
    }
}

/// At most this many reservations answer a buyer's look-up.
pub const BUYER_LOOKUP_MAX: usize = 100;

/// A buyer's reservations of a drop, newest first, each as a look-up of its key
/// answers it (a hold past its deadline expired first), and the path that decided.
#[derive(Debug)]
pub struct Bought {
    pub reservations: Vec<(String, View)>,
    pub path: super::Path,
}

/// The reservations of buyer `user` in drop `drop_name`, newest first (at most
/// [`BUYER_LOOKUP_MAX`]): listed by Redis on the gate (it sees the whole sale,
/// whatever ledger each sidecar has), by the ledger on the fallback (then the
/// sale's), then each looked up as [`settle`] looks one up.
pub async fn reservations_of(app: &App, drop_name: &str, user: &str) -> Result<Bought, Failure> {
    let drop = super::find_drop(app, drop_name).await?;
    // Entries of keys another look-up would not show (taken back, another sale's)
    // are skipped: read some past the answer's bound. Listed as any call is decided:
    // from a Redis checked against the ledger (rebuilt first when it is behind), or
    // from the sale's own ledger on the fallback.
    let listed = decide(app, &drop, Call::Buyer(user, 2 * BUYER_LOOKUP_MAX)).await?;
    let Outcome::Listed(keys) = listed.outcome else {
        return Err(Failure::unavailable(format!(
            "the reservations of drop {} could not be listed ({:?}): nothing was changed; retry",
            drop.name, listed.outcome
        )));
    };
    let mut bought = Bought {
        reservations: Vec::new(),
        path: super::Path::Gate,
    };
    for key in keys {
        if bought.reservations.len() == BUYER_LOOKUP_MAX {
            break;
        }
        // Boxed: a look-up's future is large, and this one runs up to a hundred.
        let served = Box::pin(decide(app, &drop, Call::Settle(&key, Settle::Lookup))).await?;
        bought.path = served.path;
        if let Some(view) = served.outcome.view()
            && view.reservation.user == user
        {
            bought.reservations.push((key, view.clone()));
        }
    }
    Ok(bought)
}

/// The keys of `user`'s reservations on the gate, newest first.
pub(super) async fn buyer_on_gate(
    app: &App,
    drop: &Drop,
    config: &DropConfig,
    redis: Checked,
    user: &str,
    limit: usize,
) -> Turn<Outcome> {
    let mut conn = app.redis.clone();
    // A gate that is not open (Redis lost its data, or it is being rebuilt) lists
    // nothing true: open it first, as every other call does.
    match gate::is_open(&mut conn, &drop.keys).await {
        Ok(true) => {}
        Ok(false) => return Turn::Reopen { suspect: false },
        Err(e) => return Turn::Reroute(redis_failed(app, drop, config, &e)),
    }
    match gate::keys_of_buyer(&mut conn, &drop.keys, user, limit).await {
        Ok(_) if !super::redis_still_checked(app, drop, redis) => Turn::Recheck,
        Ok(keys) => {
            app.breaker(Some(drop)).answered();
            Turn::Done(Ok(Outcome::Listed(keys)))
        }
        Err(e) => Turn::Reroute(redis_failed(app, drop, config, &e)),
    }
}

/// The keys of `user`'s reservations in the sale's ledger, newest first. `None`:
/// the drop is back on the gate, try there.
pub(super) async fn buyer_on_fallback(
    app: &App,
    drop: &Drop,
    user: &str,
    limit: usize,
    reason: Reason,
) -> Option<Result<Outcome, Failure>> {
    let ledger_key = drop.ledger_key();
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    on_ledger(app, drop, reason, || async {
        app.ledger
            .keys_of_buyer(&ledger_key, user, limit)
            .await
            .map(Outcome::Listed)
    })
    .await
    .transpose()
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
    // An extension is decided on the bound the operator published now, as a
    // reserve is (a lowered maxHoldSeconds is obeyed at once).
    let fresh;
    let config = match settle {
        Settle::Extend { .. } => match super::published_now(app, drop).await {
            // Decided on the config just read, its mode and failure policy too (see
            // `admit::on_fallback`).
            super::Published::Now(published) | super::Published::Kept(published) => {
                fresh = *published;
                match super::choose_again(app, drop, &fresh, reason) {
                    super::Choice::Fallback(_) => &fresh,
                    super::Choice::Gate => return None,
                    super::Choice::Refused(failure) => return Some(Err(failure)),
                }
            }
            super::Published::Missing => {
                return Some(Err(Failure::retry(format!(
                    "drop {}'s config in Redis is not the one this sidecar holds: nothing is decided on an older copy; retry",
                    drop.name
                ))));
            }
            super::Published::Stale(why) => return Some(Err(Failure::retry(why))),
        },
        _ => config,
    };
    let ledger_key = drop.ledger_key();
    let decided = on_ledger(app, drop, reason, || {
        app.ledger
            .fallback_settle(&ledger_key, config, key, settle, now_ms())
    })
    .await
    .transpose();
    if let Some(Ok(outcome)) = &decided {
        free_permit_if_settled(drop, key, outcome);
        if let Outcome::Extended(view) = outcome {
            drop.throttle.extend(key, view.reservation.expires_at_ms);
        }
    }
    decided
}

/// One attempt at the Redis gate. A look-up reads the gate (and the ledger, for a
/// reservation whose confirm or cancel is in flight); a confirm or cancel is
/// prepared in Redis, recorded in the ledger, then finished in Redis, so that one
/// the ledger could not record is undone before its error is answered.
pub(super) async fn on_gate(
    app: &App,
    drop: &Drop,
    config: &DropConfig,
    redis: Checked,
    key: &str,
    settle: Settle,
) -> Turn<Outcome> {
    let settling = match settle {
        Settle::Lookup => return lookup_on_gate(app, drop, config, redis, key).await,
        Settle::Confirm { quantity } => Settling::Confirm { quantity },
        Settle::Cancel => Settling::Cancel,
        Settle::CancelHold => Settling::CancelHold,
        Settle::Extend { until_ms } => Settling::Extend { until_ms },
    };
    change_on_gate(app, drop, config, redis, key, settling).await
}

async fn lookup_on_gate(
    app: &App,
    drop: &Drop,
    config: &DropConfig,
    redis: Checked,
    key: &str,
) -> Turn<Outcome> {
    let mut conn = app.redis.clone();
    let settle_by = Instant::now() + unresolved_bound(config);
    let mut backoff = Backoff::new();
    let mut helped = 0;
    let reply = loop {
        let reply = match gate::lookup(&mut conn, &drop.keys, app.ledger.id(), key).await {
            Ok(reply) => reply,
            Err(e) => return Turn::Reroute(redis_failed(app, drop, config, &e)),
        };
        app.breaker(Some(drop)).answered();
        if matches!(reply.outcome, Outcome::Unsettled(_)) {
            match help_finish(app, drop, key, &mut helped).await {
                Helped::AskAgain => continue,
                Helped::AsItStands => {}
                Helped::Failed(failure) => return Turn::Done(Err(failure)),
            }
        }
        // An admission of the key not answered yet: its answer is the look-up's,
        // unless the ledger already has it (it is made; only its activation is left).
        if reply.outcome != Outcome::Pending {
            break reply;
        }
        if let Ok(Some(row)) = app
            .ledger
            .reservation(&change_key(drop, &reply.step), key)
            .await
        {
            return Turn::Done(Ok(Outcome::Found(View {
                reservation: row.reservation(),
                remaining: 0,
            })));
        }
        if Instant::now() >= settle_by {
            return Turn::Done(Err(Failure::throttled(config, Throttled::KeyInFlight)));
        }
        backoff.wait(settle_by).await;
    };
    if crate::faults::check(crate::faults::Fault::PauseAfterReply).is_err() {
        tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    }
    // (Nothing of an unchecked Redis's reply is recorded, an expiry included: see
    // admit::reply_stands.)
    if !super::redis_still_checked(app, drop, redis) {
        return Turn::Recheck;
    }
    match reply.outcome {
        Outcome::Closed => return Turn::Reopen { suspect: false },
        // No ledger named (Redis lost the key, or a claim waits to be recorded):
        // claim it again, or hear that it waits.
        Outcome::ForeignLedger { ledger } if ledger.is_empty() => {
            return Turn::Reopen { suspect: false };
        }
        Outcome::ForeignLedger { ledger } => {
            return Turn::Done(Err(foreign_ledger(app, drop, &ledger).await));
        }
        _ => {}
    }
    if !record_expiry(app, drop, config, key, &reply.step).await {
        // The ledger keeps the hold: Redis has it back, and is asked again.
        return Turn::Recheck;
    }
    let outcome = match reply.outcome {
        Outcome::NotFound => {
            match from_ledger_or_not_found(app, &change_key(drop, &reply.step), key, Settle::Lookup)
                .await
            {
                Ok(outcome) => outcome,
                Err(failure) => return Turn::Done(Err(failure)),
            }
        }
        // Its confirm or cancel is prepared: it happened once the ledger recorded it.
        Outcome::Unsettled(view) => match app
            .ledger
            .reservation(&change_key(drop, &reply.step), key)
            .await
        {
            // Recorded: a confirm or cancel moved it, an extension moved its deadline.
            Ok(Some(row))
                if row.state != view.reservation.state
                    || row.expires_at_ms > view.reservation.expires_at_ms =>
            {
                Outcome::Found(View {
                    reservation: row.reservation(),
                    remaining: view.remaining,
                })
            }
            Ok(_) => Outcome::Found(view),
            Err(e) => {
                return Turn::Done(Err(Failure::retry(format!(
                    "a confirm or cancel of reservation {key} is being recorded and the ledger could not be asked ({e}): retry"
                ))));
            }
        },
        other => other,
    };
    free_permit_if_settled(drop, key, &outcome);
    Turn::Done(Ok(outcome))
}

/// A confirm or cancel on the gate: prepared, then recorded, then finished; an
/// attempt the ledger does not record is aborted and changes nothing. Another
/// confirm or cancel of the key in flight is waited for (its answer is the
/// reservation's next state), within its bound.
async fn change_on_gate(
    app: &App,
    drop: &Drop,
    config: &DropConfig,
    redis: Checked,
    key: &str,
    settling: Settling,
) -> Turn<Outcome> {
    let to = settling.state();
    let kept = match settling {
        Settling::Confirm { quantity } => quantity,
        Settling::Cancel | Settling::CancelHold | Settling::Extend { .. } => None,
    };
    let what = match settling {
        Settling::Confirm { .. } => "confirm",
        Settling::Cancel => "cancel",
        Settling::CancelHold => "give-back",
        Settling::Extend { .. } => "extension",
    };
    let mut conn = app.redis.clone();
    let attempt = format!("{:016x}", rand::random::<u64>());
    let settle_by = Instant::now() + unresolved_bound(config);
    let mut backoff = Backoff::new();
    let prepared = loop {
        let prepared = match gate::prepare(
            &mut conn,
            &drop.keys,
            app.ledger.id(),
            key,
            settling,
            &attempt,
            COMMIT_DEADLINE_MS,
        )
        .await
        {
            Ok(prepared) => prepared,
            Err(e) => return Turn::Reroute(redis_failed(app, drop, config, &e)),
        };
        app.breaker(Some(drop)).answered();
        match &prepared {
            Prepare::Answered(reply)
                if reply.outcome == Outcome::Pending && Instant::now() < settle_by =>
            {
                backoff.wait(settle_by).await;
            }
            _ => break prepared,
        }
    };
    // (Nothing of an unchecked Redis's reply is recorded, an expiry included: see
    // admit::reply_stands.)
    if !super::redis_still_checked(app, drop, redis) {
        if let Prepare::Prepared { .. } = prepared {
            undo_prepared(app, &mut conn, drop, key, &attempt).await;
        }
        return Turn::Recheck;
    }
    let deadline = now_ms() + COMMIT_DEADLINE_MS as i64;
    let (view, step) = match prepared {
        Prepare::Answered(reply) => return answered(app, drop, config, key, settling, reply).await,
        Prepare::Prepared { view, step } => (view, step),
    };
    let change = change_of(drop, config, key, &step, &view.reservation, to)
        .keeping(kept)
        .hold_only(settling == Settling::CancelHold)
        .by(&attempt, deadline);
    let change = match settling {
        Settling::Extend { until_ms } => Change {
            extension: true,
            expires_at_ms: until_ms,
            ..change
        },
        _ => change,
    };
    let abort = |why: &str| {
        tracing::warn!(drop = %drop.name, key, why, what, "a change was not recorded: undone");
    };
    let undo = async |conn: &mut dropgate_redis::Connection| {
        undo_prepared(app, conn, drop, key, &attempt).await;
    };
    // An extension Redis judged on an older config of the sale than this sidecar
    // read there (a lower maxHoldSeconds perhaps) is undone, as an admission is.
    if let Settling::Extend { .. } = settling
        && let Some(failure) = super::redis_lost_a_change(app, drop, config, &step)
    {
        undo(&mut conn).await;
        return Turn::Done(Err(failure));
    }
    // What the reservation reads as once the change took effect.
    let settled = with_state(view, to, change.quantity, change.expires_at_ms);
    match app.ledger.record(change).await {
        Ok(()) => {}
        Err(RecordError::KeyUsed { state: recorded }) => {
            undo(&mut conn).await;
            abort("the ledger's record went elsewhere");
            let ledger_key = change_key(drop, &step);
            replay_later(app, drop, &ledger_key, key).await;
            // Another change made it so first, one this Redis has not seen (a
            // replica promoted without it): the answer is the ledger's record of it.
            if recorded == to && !matches!(settling, Settling::Extend { .. }) {
                let view = match app.ledger.reservation(&ledger_key, key).await {
                    Ok(Some(row)) => View {
                        reservation: row.reservation(),
                        remaining: settled.remaining,
                    },
                    _ => settled,
                };
                drop.throttle.release(key);
                return Turn::Done(Ok(match to {
                    State::Cancelled => Outcome::AlreadyCancelled(view),
                    _ => Outcome::AlreadyConfirmed(view),
                }));
            }
            return Turn::Done(Ok(Outcome::Overruled {
                recorded,
                asked: to,
            }));
        }
        Err(RecordError::NotAuthority { .. }) => {
            undo(&mut conn).await;
            return Turn::Reopen { suspect: false };
        }
        // It may have landed: the attempt is fenced off (its commit refused from
        // now on) and the ledger's row says which way it went, so that the answer
        // is true either way.
        Err(RecordError::Unknown(why)) => {
            // (A prepared change is always numbered; were it not, 0 reads any
            // numbered row as moved on, and the answer errs toward outcomeUnknown.)
            let seq = step.seq.unwrap_or(0);
            match settle_landing(app, &change_key(drop, &step), key, &attempt, seq, settling).await
            {
                Some(Landing::Landed) => {}
                Some(Landing::NotLanded) => {
                    undo(&mut conn).await;
                    abort(&why);
                    return Turn::Done(Err(Failure::retry(format!(
                        "the ledger could not record the {} ({why}): nothing was changed; retry",
                        what
                    ))));
                }
                // The ledger cannot be asked, or its row moved on past this change:
                // the preparation stays, and past its bound the resolver fences the
                // attempt off and finishes or undoes it by what the ledger holds.
                landing @ (None | Some(Landing::MovedOn)) => {
                    let cannot_tell = match landing {
                        None => "the ledger cannot be asked",
                        Some(_) => "the ledger's record moved on past it since",
                    };
                    tracing::warn!(drop = %drop.name, key, %why, cannot_tell, "a confirm or cancel's commit has an unknown outcome: left for its resolution");
                    return Turn::Done(Err(Failure::outcome_unknown(format!(
                        "the ledger's commit of this {what} failed without saying whether it landed ({why}), and {cannot_tell}; it is resolved by the ledger's record: retry the same key to learn how it went"
                    ))));
                }
            }
        }
        Err(RecordError::SeqReused(_)) => {
            undo(&mut conn).await;
            return Turn::Reopen { suspect: true };
        }
        Err(refusal) => {
            undo(&mut conn).await;
            abort(&refusal.to_string());
            if let RecordError::ConfigBehind { .. } = refusal {
                super::count_decided_on_lost_config(app, drop);
            }
            return Turn::Done(Err(Failure::retry(format!(
                "the ledger could not record the {} ({refusal}): nothing was changed; retry",
                what
            ))));
        }
    }
    // Durable from here on: whatever Redis does next, the answer is the change.
    if crate::faults::check(crate::faults::Fault::DieBeforeFinish).is_err() {
        tracing::error!(drop = %drop.name, key, what, "injected fault: the process dies before finishing a recorded change");
        std::process::abort();
    }
    let done = finish_recorded(app, drop, &mut conn, key, &attempt, deadline, &step)
        .await
        .unwrap_or(settled);
    if let Settling::Extend { .. } = settling {
        // Still held: its permit stays taken, as long as the hold now lasts.
        drop.throttle.extend(key, done.reservation.expires_at_ms);
        return Turn::Done(Ok(Outcome::Extended(done)));
    }
    drop.throttle.release(key);
    app.units_back.notify_one();
    if to == State::Cancelled
        && crate::faults::check(crate::faults::Fault::ErrorAfterRedisCancel).is_err()
    {
        return Turn::Done(Err(Failure::unavailable(
            "injected: a cancel answered 503 after Redis made it",
        )));
    }
    Turn::Done(Ok(match to {
        State::Cancelled => Outcome::Cancelled(done),
        _ => Outcome::Confirmed(done),
    }))
}

/// Finishes the recorded change `attempt` of `key` in Redis, asking again while
/// Redis fails, until the change's commit deadline `deadline_ms` (past it, any
/// sidecar's resolver finishes it): the answer waits for Redis to have the change,
/// so that nobody hears of a cancel while the drop still counts its units held.
async fn finish_by(
    app: &App,
    drop: &Drop,
    conn: &mut dropgate_redis::Connection,
    key: &str,
    attempt: &str,
    deadline_ms: i64,
) -> redis::RedisResult<Finished> {
    let until = Instant::now() + Duration::from_millis((deadline_ms - now_ms()).max(0) as u64);
    let mut backoff = Backoff::new();
    let mut failed = false;
    loop {
        let finished = match crate::faults::check(crate::faults::Fault::FinishFails) {
            Ok(()) => gate::finish(conn, &drop.keys, app.ledger.id(), key, attempt).await,
            Err(injected) => Err(redis::RedisError::from((
                redis::ErrorKind::Client,
                "injected",
                injected.to_string(),
            ))),
        };
        match finished {
            Err(error) => {
                if !failed {
                    app.breaker(Some(drop)).failed(&error);
                    failed = true;
                }
                if Instant::now() >= until {
                    return Err(error);
                }
                backoff.wait(until).await;
            }
            finished => {
                if failed {
                    app.breaker(Some(drop)).answered();
                }
                return finished;
            }
        }
    }
}

/// The reservation of `view` moved to `state`, holding `quantity` until
/// `expires_at_ms`.
fn with_state(view: View, state: State, quantity: i64, expires_at_ms: i64) -> View {
    View {
        reservation: crate::reservation::Reservation {
            state,
            quantity,
            expires_at_ms,
            ..view.reservation
        },
        remaining: view.remaining,
    }
}

/// A confirm or cancel that had nothing to prepare: answered as the gate says, or
/// from the ledger when Redis has no marker for the key.
async fn answered(
    app: &App,
    drop: &Drop,
    config: &DropConfig,
    key: &str,
    settling: Settling,
    reply: Reply,
) -> Turn<Outcome> {
    match &reply.outcome {
        Outcome::Closed => return Turn::Reopen { suspect: false },
        Outcome::ForeignLedger { ledger } if ledger.is_empty() => {
            return Turn::Reopen { suspect: false };
        }
        Outcome::ForeignLedger { ledger } => {
            return Turn::Done(Err(foreign_ledger(app, drop, ledger).await));
        }
        Outcome::Pending => {
            return Turn::Done(Err(Failure::throttled(config, Throttled::KeyInFlight)));
        }
        _ => {}
    }
    if !record_expiry(app, drop, config, key, &reply.step).await {
        // The ledger keeps the hold: Redis has it back, and is asked again.
        return Turn::Recheck;
    }
    let settle = match settling {
        Settling::Cancel => Settle::Cancel,
        Settling::CancelHold => Settle::CancelHold,
        Settling::Confirm { quantity } => Settle::Confirm { quantity },
        Settling::Extend { until_ms } => Settle::Extend { until_ms },
    };
    if reply.outcome == Outcome::NotFound {
        // Redis has no granted marker of this sale: an admission still being
        // recorded, or a marker that outlived its TTL. Answer from the ledger's
        // record, moving no unit: replaying it here would take its units a second
        // time.
        return Turn::Done(
            from_ledger_or_not_found(app, &change_key(drop, &reply.step), key, settle)
                .await
                .inspect(|outcome| {
                    free_permit_if_settled(drop, key, outcome);
                }),
        );
    }
    free_permit_if_settled(drop, key, &reply.outcome);
    match record_settled(app, drop, config, key, &reply).await {
        Ok(None) => Turn::Done(Ok(reply.outcome)),
        Ok(Some(overruled)) => Turn::Done(Ok(overruled)),
        Err(failure) => Turn::Done(Err(failure)),
    }
}

/// The ledger's answer for a key Redis has no marker of, from the sale Redis named
/// (`ledger_key`: see `change_key`), not this sidecar's copy of the config's.
async fn from_ledger_or_not_found(
    app: &App,
    ledger_key: &str,
    key: &str,
    settle: Settle,
) -> Result<Outcome, Failure> {
    match app.ledger.reservation(ledger_key, key).await {
        Ok(Some(row)) => Ok(from_ledger(row, settle)),
        Ok(None) => Ok(Outcome::NotFound),
        Err(e) => Err(Failure::unavailable(format!(
            "Redis has no reservation {key} and the ledger could not be asked ({e}): nothing was changed"
        ))),
    }
}

/// How long a call waits for another change of its key to be resolved: an
/// admission's pending bound and some slack.
fn unresolved_bound(config: &DropConfig) -> Duration {
    Duration::from_millis(pending_bound_ms(config)) + IN_FLIGHT_GRACE
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
        (Settle::Extend { .. }, State::Confirmed) => Outcome::WasConfirmed(view),
        (Settle::Extend { .. }, State::Cancelled) => Outcome::WasCancelled(view),
        (_, State::Active | State::Expired) => Outcome::Expired(view),
        (Settle::Confirm { .. }, State::Confirmed) => Outcome::AlreadyConfirmed(view),
        (Settle::Cancel | Settle::CancelHold, State::Cancelled) => Outcome::AlreadyCancelled(view),
        (Settle::Confirm { .. }, State::Cancelled) => Outcome::WasCancelled(view),
        (Settle::CancelHold, State::Confirmed) => Outcome::AlreadyConfirmed(view),
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

/// Whether the ledger's record of a key (read after its attempt was fenced off)
/// shows the change `settling` made: the state it moves to, or for an extension an
/// active hold at or past the deadline asked. What may finish a preparation in Redis
/// (the resolver, a call that meets it): Redis is made to show what the ledger's
/// row shows now. Whether a request's own change landed, for its answer, is
/// [`landing`]'s question, which a row moved on since can still answer.
pub fn landed(settling: Settling, row: Option<&Recorded>) -> bool {
    row.is_some_and(|row| match settling {
        Settling::Extend { until_ms } => {
            row.state == State::Active && row.expires_at_ms >= until_ms
        }
        other => row.state == other.state(),
    })
}

/// How a change whose commit had an unknown outcome came out, read from the key's
/// row once the change's attempt is fenced off (a late commit of it is refused
/// from then on, so the reading is final).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Landing {
    /// The row names this change (its number and its attempt): it landed, whatever
    /// happened to the row since (a refund on the ledger's gate, say: that gate
    /// numbers no change, so the row keeps this one's number and attempt).
    Landed,
    /// The row is older than the change, or names another change of that number:
    /// it did not land, and cannot now.
    NotLanded,
    /// The row moved on past the change's number: whether this change landed
    /// before it cannot be read from it.
    MovedOn,
}

/// How the change `settling` of a key, numbered `seq` by Redis and prepared by
/// `attempt`, came out, from the key's ledger `row` read after the attempt was
/// fenced off. A landed commit numbers the row `seq` and names its attempt; a
/// row that names no attempt at that number (written by a sidecar older than
/// `changed_by`) is judged by its state.
fn landing(settling: Settling, row: Option<&Recorded>, seq: i64, attempt: &str) -> Landing {
    let Some(row) = row else {
        return Landing::NotLanded;
    };
    if row.seq > seq {
        return Landing::MovedOn;
    }
    let ours = row.seq == seq
        && match row.changed_by.as_deref() {
            Some(by) => by == attempt,
            None => landed(settling, Some(row)),
        };
    if ours {
        Landing::Landed
    } else {
        Landing::NotLanded
    }
}

/// Whether the ledger's row of a reservation names another attempt than `attempt`
/// as the one that prepared its last change. A row that names none (a change
/// recorded by a sidecar older than the ledger's `changed_by`, or one no attempt
/// prepared, such as an expiry) names no other: its number and state decide alone.
pub fn made_by_another(row: &Recorded, attempt: &str) -> bool {
    row.changed_by.as_deref().is_some_and(|by| by != attempt)
}

/// A confirm, cancel or extension of `key` prepared in Redis (by any sidecar's
/// attempt), met by another call: once the ledger has recorded it, it is finished
/// here, as its own attempt would a moment later (the later finish then changes
/// nothing). Else a duplicate would answer `cancelled` while the drop still counts
/// the units held. `Ok(true)`: nothing is prepared any more (finished here or by
/// its attempt, or undone): the gate is asked again. `Ok(false)`: the ledger has
/// not recorded that change (yet); until it does, the reservation is as it was.
async fn finish_if_recorded(app: &App, drop: &Drop, key: &str) -> Result<bool, String> {
    let mut conn = app.redis.clone();
    let (attempt, seq, sale, settling) = match gate::unresolved(&mut conn, &drop.keys, key)
        .await
        .map_err(|e| e.to_string())?
    {
        Some(gate::Unresolved::Settle {
            attempt,
            to,
            seq,
            sale,
            ..
        }) => {
            let settling = match to {
                State::Cancelled => Settling::Cancel,
                _ => Settling::Confirm { quantity: None },
            };
            (attempt, seq, sale, settling)
        }
        Some(gate::Unresolved::Extend {
            attempt,
            until_ms,
            seq,
            sale,
            ..
        }) => (attempt, seq, sale, Settling::Extend { until_ms }),
        Some(gate::Unresolved::Admission(_)) | None => return Ok(true),
    };
    // Change numbers start again with a re-created drop's sale: only a row of the
    // marker's own sale can be its record.
    let Some(sale) = sale else {
        return Ok(false);
    };
    let row = app
        .ledger
        .reservation(&drop.ledger_key_of(&sale), key)
        .await
        .map_err(|e| e.to_string())?;
    // The row carries Redis's number for the last change it recorded and the
    // attempt that prepared it: this one's, or the change is not (yet) in the
    // ledger. (A promoted replica that lost a recorded change hands its number out
    // again: a change another attempt prepared there under that number is not the
    // one the ledger recorded, and finishing it would apply the replica's change,
    // not the ledger's.)
    let recorded = row
        .as_ref()
        .filter(|row| seq != 0 && row.seq == seq && !made_by_another(row, &attempt));
    if !landed(settling, recorded) {
        return Ok(false);
    }
    crate::faults::check(crate::faults::Fault::FinishFails).map_err(|e| e.to_string())?;
    gate::finish(&mut conn, &drop.keys, app.ledger.id(), key, &attempt)
        .await
        .map_err(|e| e.to_string())?;
    if !matches!(settling, Settling::Extend { .. }) {
        drop.throttle.release(key);
        app.units_back.notify_one();
    }
    Ok(true)
}

/// How many prepared changes of one key a call finishes for others before it
/// answers from the ledger's record (each is a change of its own, prepared after
/// the last was finished).
const HELP_AT_MOST: u32 = 3;

/// What a call that met a change prepared in Redis does next.
pub(super) enum Helped {
    /// Nothing is prepared any more: ask the gate again.
    AskAgain,
    /// The ledger has not recorded the change: the reservation is as it was.
    AsItStands,
    /// Whether the ledger has it, or finishing it, failed: Redis may still count
    /// what the ledger no longer does, so no answer is given from either.
    Failed(Failure),
}

/// [`finish_if_recorded`] for a call that met a prepared change of `key`, at most
/// [`HELP_AT_MOST`] times per call (`helped` counts them).
pub(super) async fn help_finish(app: &App, drop: &Drop, key: &str, helped: &mut u32) -> Helped {
    if *helped >= HELP_AT_MOST {
        return Helped::AsItStands;
    }
    *helped += 1;
    match finish_if_recorded(app, drop, key).await {
        Ok(true) => Helped::AskAgain,
        Ok(false) => Helped::AsItStands,
        Err(why) => Helped::Failed(Failure::retry(format!(
            "a confirm, cancel or extension of reservation {key} is prepared in Redis, and whether the ledger has it could not be learned or Redis could not finish it ({why}): nothing was changed; retry"
        ))),
    }
}

/// How long a request asks the ledger whether its commit landed.
const ASK_LEDGER_FOR: Duration = Duration::from_secs(5);

/// How the change `settling` of `key` (numbered `seq`) by `attempt`, whose commit
/// had an unknown outcome, came out; final, as the attempt is fenced off first.
/// `None` while the ledger cannot say, for [`ASK_LEDGER_FOR`].
async fn settle_landing(
    app: &App,
    ledger_key: &str,
    key: &str,
    attempt: &str,
    seq: i64,
    settling: Settling,
) -> Option<Landing> {
    fence_off(app, ledger_key, key, attempt)
        .await
        .map(|row| landing(settling, row.as_ref(), seq, attempt))
}

/// Fences the attempt `attempt` at `key` off (its commit is refused from now on)
/// and reads the key's row as it then stands; `None` while the ledger cannot
/// say, for [`ASK_LEDGER_FOR`].
async fn fence_off(
    app: &App,
    ledger_key: &str,
    key: &str,
    attempt: &str,
) -> Option<Option<Recorded>> {
    let until = Instant::now() + ASK_LEDGER_FOR;
    let mut backoff = Backoff::new();
    loop {
        match app.ledger.fence_settle(ledger_key, key, attempt).await {
            Ok(row) => return Some(row),
            Err(error) if Instant::now() < until => {
                tracing::debug!(%error, "asking the ledger whether a commit landed");
                backoff.wait(until).await;
            }
            Err(_) => return None,
        }
    }
}

/// How confirming several reservations as one came out (see [`confirm_as_one`]).
pub(super) enum ConfirmAsOne {
    /// Every reservation confirmed, and the ledger write riding along made, in
    /// one transaction.
    Confirmed,
    /// Nothing changed: no reservation confirmed, the ledger write not made.
    Failed(Failure),
    /// The cart was not where its move expected it (another mover came first):
    /// nothing changed.
    CartMoved,
    /// Not decided as one, and no reservation changed (an expiry Redis made on the
    /// way is recorded): the drops are on different gates, a reservation is not an
    /// active hold (lapsed, cancelled, another change of it in flight), Redis
    /// failed or changed under the call, a drop could not be handed to the
    /// ledger, or the ledger refused a change. To be confirmed one by one, as any
    /// confirm is.
    OneByOne,
    /// The ledger's commit failed without saying whether it landed, and that
    /// cannot be told now: on the Redis gate the preparations stay, and their
    /// resolution finishes or undoes them all alike by the ledger's record (the
    /// commit was whole).
    Unknown(Failure),
}

/// One reservation prepared for its confirm on the Redis gate.
struct PreparedConfirm {
    drop: std::sync::Arc<Drop>,
    config: DropConfig,
    redis: Checked,
    key: String,
    attempt: String,
    view: View,
    step: gate::Step,
}

/// Confirms the reservations `keys` (each its drop's name and key: a cart's
/// lines) as one, with the cart's move `cart` made in the same ledger transaction,
/// all or nothing: on the Redis gate when it decides every line's drop now (see
/// [`confirm_on_gate_as_one`]), on the ledger's gate when that decides every one
/// (one transaction, [`crate::ledger::Ledger::fallback_confirm_cart`]). An answer
/// that says the confirm failed means nothing was confirmed.
///
/// Only the happy path is taken here, on the gates as each drop's call finds them
/// (a drop whose authority is still the gate is handed to the ledger first, as
/// any fallback call does): whatever else [`decide`] would route, recheck or
/// reopen (drops on different gates, Redis failing or changed, a hand-over
/// refused, a reservation not an active hold) is [`ConfirmAsOne::OneByOne`], left
/// to the confirms one by one, which do.
pub(super) async fn confirm_as_one(
    app: &App,
    keys: &[(&str, String)],
    cart: crate::ledger::carts::CartMove<'_>,
) -> ConfirmAsOne {
    if keys.is_empty() {
        return ConfirmAsOne::OneByOne;
    }
    let mut lines = Vec::with_capacity(keys.len());
    let mut on_gate = 0;
    let mut on_fallback: Vec<Reason> = Vec::new();
    for (drop_name, key) in keys {
        let Ok(drop) = super::find_drop(app, drop_name).await else {
            return ConfirmAsOne::OneByOne;
        };
        let config = drop.config();
        match super::choose(app, &drop, &config) {
            super::Choice::Gate => on_gate += 1,
            super::Choice::Fallback(reason) => on_fallback.push(reason),
            super::Choice::Refused(_) => return ConfirmAsOne::OneByOne,
        }
        lines.push(LineToConfirm {
            drop,
            config,
            key: key.clone(),
        });
    }
    if on_gate == lines.len() {
        confirm_on_gate_as_one(app, lines, cart).await
    } else if on_fallback.len() == lines.len() {
        confirm_on_fallback_as_one(app, &lines, &on_fallback, cart).await
    } else {
        ConfirmAsOne::OneByOne
    }
}

/// A reservation to confirm as one with others: its drop, as this sidecar's
/// config has it, and its key.
struct LineToConfirm {
    drop: std::sync::Arc<Drop>,
    config: DropConfig,
    key: String,
}

/// [`confirm_as_one`] on the ledger's gate (each line's drop there for its
/// `reasons`): one transaction. A ledger not yet the authority of a drop is
/// handed it first, as any call on the fallback does, and asked once more.
async fn confirm_on_fallback_as_one(
    app: &App,
    lines: &[LineToConfirm],
    reasons: &[Reason],
    cart: crate::ledger::carts::CartMove<'_>,
) -> ConfirmAsOne {
    let ledger_keys: Vec<String> = lines
        .iter()
        .map(|line| line.drop.ledger_key_of(&line.config.sale))
        .collect();
    let asks: Vec<crate::ledger::fallback::FallbackLine> = lines
        .iter()
        .zip(&ledger_keys)
        .map(|(line, drop_key)| crate::ledger::fallback::FallbackLine {
            drop_key,
            config: &line.config,
            key: &line.key,
        })
        .collect();
    let mut decided = app.ledger.fallback_confirm_cart(&asks, cart).await;
    if let Err(LedgerError::NotAuthority(_)) = decided {
        // Each drop once (a cart may have several lines of one drop).
        let mut handed: Vec<&str> = Vec::new();
        for (line, reason) in lines.iter().zip(reasons) {
            if handed.contains(&line.drop.name.as_str()) {
                continue;
            }
            if handover::hand_to_ledger(app, &line.drop, *reason)
                .await
                .is_err()
            {
                return ConfirmAsOne::OneByOne;
            }
            handed.push(&line.drop.name);
        }
        decided = app.ledger.fallback_confirm_cart(&asks, cart).await;
    }
    match decided {
        Ok(CartCommit::Committed) => {
            for line in lines {
                line.drop.throttle.release(&line.key);
            }
            ConfirmAsOne::Confirmed
        }
        Ok(CartCommit::CartMoved) => ConfirmAsOne::CartMoved,
        Ok(CartCommit::LineRefused(_))
        | Err(LedgerError::NotAuthority(_) | LedgerError::StaleConfig(_)) => ConfirmAsOne::OneByOne,
        Err(unknown @ LedgerError::CommitUnknown(_)) => ConfirmAsOne::Unknown(
            Failure::outcome_unknown(format!("the cart's confirm: {unknown}")),
        ),
        Err(e) => ConfirmAsOne::Failed(Failure::retry(format!(
            "the ledger could not record the cart's confirm ({e}): nothing was changed; retry"
        ))),
    }
}

/// [`confirm_as_one`] on the Redis gate: each reservation prepared in Redis
/// (nothing changes for anyone until it is finished), then every confirm and the
/// cart's move recorded all or nothing, then each finished in Redis. Before the
/// commit, anything that goes wrong undoes every preparation.
async fn confirm_on_gate_as_one(
    app: &App,
    lines: Vec<LineToConfirm>,
    cart: crate::ledger::carts::CartMove<'_>,
) -> ConfirmAsOne {
    let mut conn = app.redis.clone();
    // The ledger refuses the commit past this; every preparation is bound to its
    // own moment plus the same span, so none is resolved by another call (fenced
    // off, which would refuse the commit whole) before the commit's deadline.
    let deadline = now_ms() + COMMIT_DEADLINE_MS as i64;
    let settling = Settling::Confirm { quantity: None };
    let mut prepared: Vec<PreparedConfirm> = Vec::with_capacity(lines.len());
    let mut one_by_one = false;
    for LineToConfirm { drop, config, key } in lines {
        let Ok(redis) = super::checked::<Outcome>(app, &drop, &config).await else {
            one_by_one = true;
            break;
        };
        let attempt = format!("{:016x}", rand::random::<u64>());
        let asked = gate::prepare(
            &mut conn,
            &drop.keys,
            app.ledger.id(),
            &key,
            settling,
            &attempt,
            COMMIT_DEADLINE_MS,
        )
        .await;
        match asked {
            Ok(Prepare::Prepared { view, step }) => {
                app.breaker(Some(&drop)).answered();
                prepared.push(PreparedConfirm {
                    drop,
                    config,
                    redis,
                    key,
                    attempt,
                    view,
                    step,
                });
            }
            Ok(Prepare::Answered(reply)) => {
                app.breaker(Some(&drop)).answered();
                // An expiry the script made on the way is recorded now, as the
                // confirm one by one would (its own call finds it expired already).
                if super::redis_still_checked(app, &drop, redis) {
                    record_expiry(app, &drop, &config, &key, &reply.step).await;
                }
                one_by_one = true;
                break;
            }
            Err(e) => {
                // (The breaker hears of it; the confirms one by one go where it says.)
                let _ = redis_failed(app, &drop, &config, &e);
                one_by_one = true;
                break;
            }
        }
    }
    // (Nothing of an unchecked Redis's reply is recorded: see admit::reply_stands.)
    if one_by_one
        || !prepared
            .iter()
            .all(|line| super::redis_still_checked(app, &line.drop, line.redis))
    {
        undo_all(app, &mut conn, &prepared).await;
        return ConfirmAsOne::OneByOne;
    }
    let changes: Vec<Change> = prepared
        .iter()
        .map(|line| {
            change_of(
                &line.drop,
                &line.config,
                &line.key,
                &line.step,
                &line.view.reservation,
                State::Confirmed,
            )
            .by(&line.attempt, deadline)
        })
        .collect();
    let landed = match app.ledger.record_with_cart(changes, cart).await {
        Ok(CartCommit::Committed) => true,
        Ok(CartCommit::CartMoved) => {
            undo_all(app, &mut conn, &prepared).await;
            return ConfirmAsOne::CartMoved;
        }
        Ok(CartCommit::LineRefused(refusal)) => {
            tracing::debug!(%refusal, "a cart's lines were not confirmed as one: one by one");
            undo_all(app, &mut conn, &prepared).await;
            // A change number handed out twice: this Redis lost writes. Each of the
            // cart's drops is checked against the ledger (and rebuilt when behind)
            // before anything else is decided on it, as a single change's
            // `Turn::Reopen { suspect: true }` does; the confirms one by one then
            // draw numbers that collide with nothing, and would not notice.
            if let RecordError::SeqReused(_) = refusal {
                let mut checked: Vec<&str> = Vec::new();
                for line in &prepared {
                    if checked.contains(&line.drop.name.as_str()) {
                        continue;
                    }
                    let opened = handover::open_gate(app, &line.drop, true).await;
                    tracing::warn!(drop = %line.drop.name, ?opened, "a cart confirm met a change number Redis handed out twice: the gate was checked again");
                    checked.push(&line.drop.name);
                }
            }
            return ConfirmAsOne::OneByOne;
        }
        // All or nothing: once the first reservation's attempt is fenced off (a
        // late commit is then refused on it, and so refused whole), its row says
        // whether the commit landed: confirmed by this attempt, it did; still the
        // active hold the commit found, it did not and cannot. Moved on to
        // anything else (another change after this one landed, say), it cannot
        // say: the preparations stay for their resolution, which reads each line.
        Err(LedgerError::CommitUnknown(why)) => {
            let first = &prepared[0];
            let ledger_key = change_key(&first.drop, &first.step);
            let row = fence_off(app, &ledger_key, &first.key, &first.attempt).await;
            match row.as_ref().map(|row| row.as_ref().map(|r| (r.state, r))) {
                Some(Some((State::Confirmed, row)))
                    if row.changed_by.as_deref() == Some(first.attempt.as_str()) =>
                {
                    true
                }
                Some(None | Some((State::Active, _))) => false,
                _ => {
                    tracing::warn!(%why, "a cart confirm's commit has an unknown outcome: left for its lines' resolution");
                    return ConfirmAsOne::Unknown(Failure::outcome_unknown(format!(
                        "the ledger's commit of the cart's confirm failed without saying whether it landed ({why}), and the ledger cannot say now; its lines are resolved by the ledger's record: retry"
                    )));
                }
            }
        }
        Err(e) => {
            undo_all(app, &mut conn, &prepared).await;
            return ConfirmAsOne::Failed(Failure::retry(format!(
                "the ledger could not record the cart's confirm ({e}): nothing was changed; retry"
            )));
        }
    };
    if !landed {
        undo_all(app, &mut conn, &prepared).await;
        return ConfirmAsOne::Failed(Failure::retry(
            "the ledger's commit of the cart's confirm did not land: nothing was changed; retry",
        ));
    }
    for line in &prepared {
        finish_recorded(
            app,
            &line.drop,
            &mut conn,
            &line.key,
            &line.attempt,
            deadline,
            &line.step,
        )
        .await;
        line.drop.throttle.release(&line.key);
    }
    ConfirmAsOne::Confirmed
}

/// Undoes the preparations of `lines`, none of which the ledger recorded.
async fn undo_all(app: &App, conn: &mut dropgate_redis::Connection, lines: &[PreparedConfirm]) {
    for line in lines {
        undo_prepared(app, conn, &line.drop, &line.key, &line.attempt).await;
    }
}

/// Undoes the preparation `attempt` of `key`'s change, which the ledger did not
/// record; one that cannot be undone now is resolved from the ledger (which has
/// nothing) once it is overdue.
async fn undo_prepared(
    app: &App,
    conn: &mut dropgate_redis::Connection,
    drop: &Drop,
    key: &str,
    attempt: &str,
) {
    if let Err(error) = gate::abort(conn, &drop.keys, app.ledger.id(), key, attempt).await {
        tracing::warn!(drop = %drop.name, %error, "a preparation could not be undone now");
    }
}

/// Finishes in Redis the change `attempt` of `key` that the ledger recorded (its
/// gate call's `step`), within `deadline_ms`: the reservation as it then reads, or
/// `None` when Redis has no marker of it (or could not be asked; the resolver or
/// the refresh's replay then makes Redis follow the ledger).
async fn finish_recorded(
    app: &App,
    drop: &Drop,
    conn: &mut dropgate_redis::Connection,
    key: &str,
    attempt: &str,
    deadline_ms: i64,
    step: &gate::Step,
) -> Option<View> {
    match finish_by(app, drop, conn, key, attempt, deadline_ms).await {
        Ok(Finished::Done(view)) => Some(view),
        Ok(Finished::Gone) => None,
        Err(error) => {
            tracing::warn!(drop = %drop.name, %error, "a recorded change could not be finished in Redis yet");
            replay_later(app, drop, &change_key(drop, step), key).await;
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row of key `k` at change number `seq`, last changed by `by`.
    fn row(state: State, seq: i64, by: Option<&str>) -> Recorded {
        Recorded {
            key: "k".into(),
            user: "u".into(),
            quantity: 1,
            state,
            expires_at_ms: 10_000,
            seq,
            variant: None,
            admitted_at_ms: None,
            changed_by: by.map(str::to_string),
        }
    }

    const CONFIRM: Settling = Settling::Confirm { quantity: None };

    #[test]
    fn a_row_naming_the_change_says_it_landed_even_after_a_refund_on_the_ledgers_gate() {
        // The ledger's gate numbers nothing: a refund after the confirm keeps its
        // number and attempt, and the confirm did land.
        for state in [State::Confirmed, State::Cancelled] {
            let row = row(state, 7, Some("a"));
            assert_eq!(landing(CONFIRM, Some(&row), 7, "a"), Landing::Landed);
        }
    }

    #[test]
    fn a_row_older_than_the_change_or_none_says_it_did_not_land() {
        let active = row(State::Active, 3, None);
        assert_eq!(landing(CONFIRM, Some(&active), 7, "a"), Landing::NotLanded);
        // Cancelled on the ledger's gate (no number): still not this confirm.
        let cancelled = row(State::Cancelled, 3, None);
        assert_eq!(
            landing(CONFIRM, Some(&cancelled), 7, "a"),
            Landing::NotLanded
        );
        assert_eq!(landing(CONFIRM, None, 7, "a"), Landing::NotLanded);
    }

    #[test]
    fn another_attempts_change_of_the_same_number_says_this_one_did_not_land() {
        // (A promoted replica handed the number out twice; the ledger refuses the
        // second change of a number.)
        let row = row(State::Confirmed, 7, Some("b"));
        assert_eq!(landing(CONFIRM, Some(&row), 7, "a"), Landing::NotLanded);
    }

    #[test]
    fn a_row_past_the_change_cannot_say() {
        let row = row(State::Cancelled, 9, Some("b"));
        assert_eq!(landing(CONFIRM, Some(&row), 7, "a"), Landing::MovedOn);
    }

    #[test]
    fn a_row_naming_no_attempt_at_the_changes_number_is_judged_by_its_state() {
        let confirmed = row(State::Confirmed, 7, None);
        assert_eq!(landing(CONFIRM, Some(&confirmed), 7, "a"), Landing::Landed);
        let active = row(State::Active, 7, None);
        assert_eq!(landing(CONFIRM, Some(&active), 7, "a"), Landing::NotLanded);
        let extended = row(State::Active, 7, None);
        let extend = Settling::Extend { until_ms: 10_000 };
        assert_eq!(landing(extend, Some(&extended), 7, "a"), Landing::Landed);
    }
}
