//! Reserve, on the Redis gate or the ledger's fallback gate.

use std::time::{Duration, Instant};

use dropgate_api::{DropConfig, Mode};

use super::handover::Reason;
use super::record::{change_key, change_of, record_expiry, replay_later};
use super::settle::Helped;
use super::{
    Backoff, Call, Checked, Choice, Failure, IN_FLIGHT_GRACE, Path, Published, Served, Throttled,
    Turn, closed, decide, foreign_ledger, handover, on_ledger, pending_bound_ms, published_now,
    redis_failed,
};
use crate::app::App;
use crate::clock::now_ms;
use crate::drops::Drop;
use crate::faults::{self, Fault};
use crate::gate::{self, Activation, Replay};
use crate::input::{CartMode, Reserve};
use crate::ledger::{Landed, RecordError};
use crate::reservation::{Outcome, Reservation, State, View};

/// Reserves `request.quantity` units of drop `drop_name` for `request.user` under
/// `request.key`, on whichever gate decides the drop now.
pub async fn reserve(app: &App, drop_name: &str, request: &Reserve) -> Result<Served, Failure> {
    let drop = super::find_drop(app, drop_name).await?;
    decide(app, &drop, Call::Reserve(request)).await
}

/// One attempt at the Redis gate: admit pending, take a permit, make it durable in
/// the ledger (which checks the gate's epoch and its own count), then activate.
/// `offer`: the admission serves the head of the request's waitlist line under its
/// entry's key (see [`crate::service::waitlist`]).
pub(super) async fn on_gate(
    app: &App,
    drop: &Drop,
    config: &DropConfig,
    redis: Checked,
    request: &Reserve,
    offer: bool,
) -> Turn<Outcome> {
    let attempt = new_attempt();
    let settle_by = settle_by(config);
    // A duplicate of a key this sidecar is admitting waits for that attempt in the
    // process rather than ask Redis over and over (see crate::in_flight).
    let _admitting = drop
        .in_flight
        .admit(&request.key, &terms(request), settle_by)
        .await;
    let admission = admission(config, request, &attempt, offer);
    let reply = match asked(app, drop, config, request, &admission, settle_by).await {
        Ok(asked) => asked,
        Err(turn) => return turn,
    };
    if !reply_stands(app, drop, redis, &[(&admission, &reply)]).await {
        return Turn::Recheck;
    }
    after_gate(app, drop, config, &admission, reply).await
}

/// Whether gate replies came from the Redis `redis` the call checked (see
/// [`super::redis_still_checked`]). If not, what they admitted is taken back, and
/// nothing else of them is kept: not even an expiry
/// made on the way is recorded, as the ledger's answer to it would be replayed
/// into that Redis and could make it look in line when it is not. The call
/// checks Redis again ([`Turn::Recheck`]), which rebuilds what it lacks.
async fn reply_stands(
    app: &App,
    drop: &Drop,
    redis: Checked,
    replies: &[(&gate::ReserveRequest, &gate::Reply)],
) -> bool {
    if super::redis_still_checked(app, drop, redis) {
        return true;
    }
    // Taken back together, each within one pending bound from now (should the
    // undo fail, the marker goes back with its own bound).
    let now = now_ms();
    let undos = replies
        .iter()
        .filter(|(_, reply)| matches!(reply.outcome, Outcome::Admitted(_)))
        .map(|(admission, _)| {
            let deadline = now + admission.pending_bound_ms as i64;
            undo(app, drop, &admission.key, &admission.attempt, deadline)
        });
    futures::future::join_all(undos).await;
    false
}

/// A new admission's id.
fn new_attempt() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// Until when a duplicate of a key still in flight is asked again: its permit wait
/// and some slack, rather than promise a unit that may be undone; one that is still
/// pending then (its commit is slow) answers throttled, and the buyer's retry asks
/// again.
fn settle_by(config: &DropConfig) -> Instant {
    Instant::now() + Duration::from_millis(config.acquire_timeout_ms) + IN_FLIGHT_GRACE
}

/// What makes two reserves of one key the same request (see crate::in_flight).
fn terms(request: &Reserve) -> String {
    format!(
        "{}\n{}\n{}",
        request.user,
        request.quantity,
        request.variant.as_deref().unwrap_or("")
    )
}

fn admission(
    config: &DropConfig,
    request: &Reserve,
    attempt: &str,
    offer: bool,
) -> gate::ReserveRequest {
    gate::ReserveRequest {
        key: request.key.clone(),
        user: request.user.clone(),
        quantity: request.quantity,
        variant: request.variant.clone(),
        attempt: attempt.to_string(),
        pending_bound_ms: pending_bound_ms(config),
        offer,
    }
}

/// How a line of a cart came out when its drop's lines were decided together on
/// the gate (see [`lines_on_gate`]).
pub(super) enum Lined {
    Done(Result<Served, Failure>),
    /// Admitted and taken back in the same step: another of the cart's lines on
    /// the drop was refused (mode `all`). Nothing of it is held.
    Withdrawn,
    /// Not decided with the others (the drop is not on the gate now, Redis failed,
    /// or an earlier attempt at the line's key is unresolved): to be reserved on
    /// its own, as any reserve is.
    Alone,
}

/// The lines `requests` of one cart, all on `drop`, decided in one atomic step of
/// the gate (batched with the drop's other reserves, see gate::Batcher), then each made durable and activated as
/// [`on_gate`] does. With `all`, when one is refused, none of them is admitted.
pub(super) async fn lines_on_gate(
    app: &App,
    drop: &Drop,
    requests: &[Reserve],
    all: bool,
) -> Vec<Lined> {
    let alone = || requests.iter().map(|_| Lined::Alone).collect();
    let config = drop.config();
    if !matches!(super::choose(app, drop, &config), Choice::Gate) {
        return alone();
    }
    let Ok(redis) = super::checked::<Outcome>(app, drop, &config).await else {
        return alone();
    };
    let settle_by = settle_by(&config);
    let attempts: Vec<String> = requests.iter().map(|_| new_attempt()).collect();
    let mut admitting = Vec::with_capacity(requests.len());
    for request in requests {
        admitting.push(
            drop.in_flight
                .admit(&request.key, &terms(request), settle_by)
                .await,
        );
    }
    let admissions: Vec<gate::ReserveRequest> = requests
        .iter()
        .zip(&attempts)
        .map(|(request, attempt)| admission(&config, request, attempt, false))
        .collect();
    let mode = if all {
        CartMode::All
    } else {
        CartMode::Available
    };
    let replies = match drop
        .gate
        .reserve_cart(&app.redis, app.ledger.id(), &admissions, mode)
        .await
    {
        Ok(replies) => replies,
        // Each line then asks on its own, and hears Redis's failure there.
        Err(_) => return alone(),
    };
    app.breaker(Some(drop)).answered();
    let made: Vec<(&gate::ReserveRequest, &gate::Reply)> = admissions
        .iter()
        .zip(&replies)
        .filter_map(|(admission, reply)| match reply {
            Ok(Some(reply)) => Some((admission, reply)),
            _ => None,
        })
        .collect();
    // Each line is then decided on its own, on a Redis checked anew.
    if !reply_stands(app, drop, redis, &made).await {
        return alone();
    }
    let config = &config;
    let lines = admissions.iter().zip(replies).zip(admitting).map(
        |((admission, reply), admitting)| async move {
            let lined = match reply {
                Ok(None) => Lined::Withdrawn,
                Ok(Some(reply)) if matches!(reply.outcome, Outcome::Pending | Outcome::Overdue) => {
                    Lined::Alone
                }
                Ok(Some(reply)) => {
                    match after_gate(app, drop, config, admission, reply).await {
                        Turn::Done(done) => Lined::Done(done.map(|outcome| Served {
                            outcome,
                            path: Path::Gate,
                        })),
                        // Nothing was admitted (the gate is closed or not the
                        // drop's): decided on its own.
                        _ => Lined::Alone,
                    }
                }
                Err(_) => Lined::Alone,
            };
            std::mem::drop(admitting);
            lined
        },
    );
    let mut lined = futures::future::join_all(lines).await;
    // A line withdrawn because another was refused stands only with that refusal:
    // when any line of the step is decided again on its own (its reply came from a
    // Redis not checked, or it met another attempt in flight), so are the
    // withdrawn ones (they hold nothing), and the cart's rule (all or nothing)
    // is kept over what the lines then hear.
    if lined.iter().any(|line| matches!(line, Lined::Alone)) {
        for line in &mut lined {
            if matches!(line, Lined::Withdrawn) {
                *line = Lined::Alone;
            }
        }
    }
    lined
}

/// A cart's lines (each with its drop) decided by the ledger's gate in one
/// transaction (see crate::ledger::Ledger::fallback_cart), when every drop of the
/// cart is on the fallback now. `None`: they are not all (or a line's throttle
/// permit is not free, or a drop's config must be read again first): the cart goes
/// drop by drop, each line on whichever gate decides its drop. Every drop on the
/// fallback has its config read first, whatever the others' gates: one that
/// cannot be decided on refuses the cart whole before any line is held.
pub(super) async fn lines_on_fallback(
    app: &App,
    lines: &[(&Drop, Reserve)],
    all: bool,
) -> Option<Vec<Lined>> {
    let whole = |failure: Failure| {
        Some(
            lines
                .iter()
                .map(|_| Lined::Done(Err(failure.clone().on_fallback())))
                .collect(),
        )
    };
    // Each drop once: its gate now, and its config as published now.
    let mut drops: Vec<(&Drop, Reason, DropConfig)> = Vec::new();
    let mut drop_by_drop = false;
    let mut seen: Vec<&str> = Vec::new();
    for (drop, _) in lines {
        if seen.contains(&drop.name.as_str()) {
            continue;
        }
        seen.push(&drop.name);
        let reason = match super::choose(app, drop, &drop.config()) {
            Choice::Fallback(reason) => reason,
            Choice::Refused(failure) if all => return whole(failure),
            Choice::Gate | Choice::Refused(_) => {
                drop_by_drop = true;
                continue;
            }
        };
        match published_now(app, drop).await {
            // The mode and failure policy just read decide too: a drop back on
            // the gate is decided line by line there; a closed one refuses the
            // cart whole if it must be whole, else its own lines.
            Published::Now(fresh) | Published::Kept(fresh) => {
                match super::choose_again(app, drop, &fresh, reason) {
                    Choice::Fallback(_) => drops.push((drop, reason, *fresh)),
                    Choice::Refused(failure) if all => return whole(failure),
                    Choice::Gate | Choice::Refused(_) => drop_by_drop = true,
                }
            }
            // A cart that must be whole is refused whole, nothing held, as its
            // line would be (`on_fallback`); else each line is decided on its own,
            // and this drop's answers why.
            Published::Missing if all => return whole(config_missing(drop)),
            Published::Missing => drop_by_drop = true,
            // Nothing is held yet: the whole cart is refused, its key kept.
            Published::Stale(why) => return whole(Failure::retry(why)),
        }
    }
    if drop_by_drop {
        return None;
    }
    let config_of = |drop: &Drop| {
        drops
            .iter()
            .find(|(d, ..)| d.name == drop.name)
            .map(|(_, _, config)| config)
    };
    let mut permits = Vec::with_capacity(lines.len());
    for (drop, request) in lines {
        let config = config_of(drop)?;
        let wait = Duration::from_millis(config.acquire_timeout_ms);
        permits.push(drop.throttle.acquire_for(&request.key, wait).await?);
    }
    // The waits may have been long enough for a drop to change.
    for (drop, _, config) in &drops {
        if let Err(why) = still_current(app, drop, config).await {
            return whole(Failure::retry(why));
        }
    }
    // The ledger rows of the sale of each config decided on.
    let ledger_keys: Vec<String> = lines
        .iter()
        .map(|(drop, _)| {
            config_of(drop).map_or_else(|| drop.ledger_key(), |c| drop.ledger_key_of(&c.sale))
        })
        .collect();
    let asks: Vec<crate::ledger::fallback::CartAsk<'_>> = lines
        .iter()
        .zip(&ledger_keys)
        .filter_map(|((drop, request), drop_key)| {
            Some(crate::ledger::fallback::CartAsk {
                drop_key,
                config: config_of(drop)?,
                ask: request.ask(),
            })
        })
        .collect();
    let mut handed = false;
    let decided = loop {
        // (The window judged when the ledger decides: after any hand-over waited for.)
        match app.ledger.fallback_cart(&asks, all, now_ms()).await {
            Ok(decided) => break decided,
            // A drop not handed to the ledger yet: each is, then the cart is
            // decided again, once.
            Err(crate::ledger::LedgerError::NotAuthority(_)) if !handed => {
                handed = true;
                for (drop, reason, _) in &drops {
                    match handover::hand_to_ledger(app, drop, *reason).await {
                        Ok(_) => {}
                        Err(handover::Refusal::BackOnGate) => return None,
                        Err(handover::Refusal::Refused(why)) => {
                            return whole(Failure::unavailable(why));
                        }
                    }
                }
            }
            Err(crate::ledger::LedgerError::StaleConfig(_)) => {
                return whole(Failure::retry(
                    "the ledger holds a newer config of a drop of this cart than this sidecar read: nothing was changed; retry",
                ));
            }
            Err(unknown @ crate::ledger::LedgerError::CommitUnknown(_)) => {
                return whole(Failure::outcome_unknown(unknown.to_string()));
            }
            Err(error) => {
                return whole(Failure::unavailable(format!(
                    "Redis is not gating this cart's drops and the ledger failed: {error}"
                )));
            }
        }
    };
    Some(
        lines
            .iter()
            .zip(permits)
            .zip(decided)
            .map(|(((drop, request), permit), outcome)| match outcome {
                None => Lined::Withdrawn,
                Some(outcome) => {
                    match &outcome {
                        Outcome::Admitted(view) => {
                            drop.throttle.hold(
                                &request.key,
                                permit,
                                view.reservation.expires_at_ms,
                            );
                        }
                        settled if settled.settles() => drop.throttle.release(&request.key),
                        _ => {}
                    }
                    Lined::Done(Ok(Served {
                        outcome,
                        path: Path::Fallback,
                    }))
                }
            })
            .collect(),
    )
}

/// Asks the gate for `admission` until its answer is not about another attempt
/// still in flight (or `settle_by` passes). `Err`: the turn is over.
async fn asked(
    app: &App,
    drop: &Drop,
    config: &DropConfig,
    request: &Reserve,
    admission: &gate::ReserveRequest,
    settle_by: Instant,
) -> Result<gate::Reply, Turn<Outcome>> {
    let mut conn = app.redis.clone();
    let mut backoff = Backoff::new();
    let mut tried_resolving = false;
    let mut helped = 0;
    loop {
        let reply = match drop.gate.reserve(&conn, app.ledger.id(), admission).await {
            Ok(reply) => reply,
            Err(e) => return Err(Turn::Reroute(redis_failed(app, drop, config, &e))),
        };
        app.breaker(Some(drop)).answered();
        // A duplicate of a reservation whose confirm or cancel the ledger has
        // recorded: finished in Redis first, then answered as it now stands.
        if matches!(reply.outcome, Outcome::Unsettled(_)) {
            match super::settle::help_finish(app, drop, &request.key, &mut helped).await {
                Helped::AskAgain => continue,
                Helped::AsItStands => {}
                Helped::Failed(failure) => return Err(Turn::Done(Err(failure))),
            }
        }
        if reply.outcome == Outcome::Overdue && Instant::now() < settle_by {
            // An earlier attempt of this buyer's key that its sidecar never
            // finished: resolved from the ledger, then this one is decided afresh
            // (or hears the reservation the ledger holds). Still overdue after a
            // resolution: asked again after a pause, not at once.
            if tried_resolving {
                backoff.wait(settle_by).await;
            }
            tried_resolving = true;
            if let Err(why) = resolve_key(app, drop, &mut conn, &request.key).await {
                return Err(Turn::Done(Err(Failure::retry(format!(
                    "an earlier attempt with this key is unresolved and could not be resolved now ({why}): nothing was reserved; retry the same key"
                )))));
            }
            continue;
        }
        if reply.outcome != Outcome::Pending || Instant::now() >= settle_by {
            return Ok(reply);
        }
        tracing::debug!(
            drop = %drop.name,
            key = %request.key,
            "waiting for another attempt's pending admission of this key to be activated or undone"
        );
        backoff.wait(settle_by).await;
    }
}

/// An attempt at the gate once the gate has answered: refused, or admitted
/// pending and then made durable and activated (or taken back).
async fn after_gate(
    app: &App,
    drop: &Drop,
    config: &DropConfig,
    request: &gate::ReserveRequest,
    reply: gate::Reply,
) -> Turn<Outcome> {
    let mut conn = app.redis.clone();
    let attempt = &request.attempt;
    let permit_wait = Duration::from_millis(config.acquire_timeout_ms);
    // The admission's answer is due by the end of its pending bound: its commit
    // may not begin later (a sweeper resolves the key by then, and its claim of the
    // key in the ledger refuses a commit of this attempt still in flight).
    let deadline = now_ms() + pending_bound_ms(config) as i64;
    if !record_expiry(app, drop, config, &request.key, &reply.step).await {
        // The ledger keeps the hold: Redis has it back, and is asked again.
        if let Outcome::Admitted(_) = reply.outcome {
            let _ = undo(app, drop, &request.key, attempt, deadline).await;
        }
        return Turn::Recheck;
    }
    let admitted = match reply.outcome {
        Outcome::Admitted(_) if reply.step.sale.as_deref() != Some(config.sale.as_str()) => {
            // The drop was re-created since this sidecar read its config: never
            // record under the old sale. Taken back and answered as the 503 it is
            // (the admission was seen by others meanwhile); the retry reads the new
            // sale's config.
            let _ = undo(app, drop, &request.key, attempt, deadline).await;
            let _ = app.drops.refresh(&mut conn, &drop.name).await;
            return Turn::Done(Err(moved_on(drop)));
        }
        Outcome::Admitted(_)
            if let Some(failure) = super::redis_lost_a_change(app, drop, config, &reply.step) =>
        {
            // (Should the undo fail, the marker goes back with its pending bound.)
            let _ = undo(app, drop, &request.key, attempt, deadline).await;
            return Turn::Done(Err(failure));
        }
        // Pending until activated below.
        Outcome::Admitted(view) => view,
        Outcome::Closed => return Turn::Reopen { suspect: false },
        Outcome::OffGate(Mode::FailOpen) => return Turn::Reroute(Choice::Fallback(Reason::Mode)),
        Outcome::OffGate(_) => return Turn::Reroute(Choice::Refused(closed(drop))),
        // Another attempt still in flight, or a dead one not resolved within this
        // request's wait: the buyer retries the same key.
        Outcome::Pending | Outcome::Overdue => {
            return Turn::Done(Err(Failure::throttled(config, Throttled::KeyInFlight)));
        }
        // No ledger named (Redis lost the key, or a claim waits to be recorded):
        // claim it again, or hear that it waits.
        Outcome::ForeignLedger { ledger } if ledger.is_empty() => {
            return Turn::Reopen { suspect: false };
        }
        Outcome::ForeignLedger { ledger } => {
            return Turn::Done(Err(foreign_ledger(app, drop, &ledger).await));
        }
        // The config of a drop this sidecar serves is gone from Redis: deleted (then
        // the refresh forgets the drop) or lost with Redis's data (then the operator
        // publishes it again). Neither is decided here.
        Outcome::UnknownDrop => {
            return Turn::Done(Err(Failure::retry(format!(
                "drop {}'s config is not in Redis right now (being deleted, or lost with Redis's data and published again soon): nothing was reserved; retry",
                drop.name
            ))));
        }
        // A duplicate of a reservation whose confirm or cancel is being recorded:
        // answered as it stands in the ledger once the ledger has it.
        Outcome::Unsettled(view) => {
            return Turn::Done(
                // (The sale Redis named, not this sidecar's copy of the config's.)
                match app
                    .ledger
                    .reservation(&change_key(drop, &reply.step), &request.key)
                    .await
                {
                    Ok(Some(row)) if row.state != view.reservation.state => {
                        Ok(Outcome::AlreadyReserved(View {
                            reservation: row.reservation(),
                            remaining: view.remaining,
                        }))
                    }
                    Ok(_) => Ok(Outcome::AlreadyReserved(view)),
                    Err(e) => Err(Failure::retry(format!(
                        "a confirm or cancel of reservation {} is being recorded and the ledger could not be asked ({e}): retry",
                        request.key
                    ))),
                },
            );
        }
        refused => return Turn::Done(Ok(refused)),
    };

    let Some(permit) = drop.throttle.acquire_for(&request.key, permit_wait).await else {
        // Taken back before the answer, however long Redis takes to answer within
        // the admission's bound: a 503 leaves no pending marker counting stock.
        return Turn::Done(
            match undo(app, drop, &request.key, attempt, deadline).await {
                Ok(()) => Err(Failure::throttled(config, Throttled::NoPermit)),
                Err(e) => Err(Failure::unavailable(format!(
                    "no throttle permit was free and Redis failed while taking the admission back ({e}); it expires by itself: retry the same key"
                ))),
            },
        );
    };
    // A 201 means the admission is durable in the ledger: record it before the
    // reservation is activated, and take it back if that fails. The ledger refuses
    // it if the gate was not its authority at this epoch, or if Redis admitted a
    // unit the ledger's own count does not have.
    let change = change_of(
        drop,
        config,
        &request.key,
        &reply.step,
        &admitted.reservation,
        State::Active,
    )
    .by(attempt, deadline)
    .offer(request.offer);
    let ledger_key = change_key(drop, &reply.step);
    let recorded = match faults::check(Fault::AfterRedisAdmit) {
        Ok(()) if faults::check(Fault::SkipLedgerOnAdmit).is_err() => Ok(()),
        Ok(()) => app.ledger.record(change).await,
        Err(injected) => Err(RecordError::Failed(injected.to_string())),
    };
    // A commit that may have landed is asked about until the ledger says, so that
    // the answer is true either way: taking back a durable admission would lose
    // it, answering 503 for one would change what an error may not.
    let recorded = match recorded {
        Err(RecordError::Unknown(why)) => {
            match admission_landed(app, &ledger_key, request).await {
                Some(Landed::Yes) => Ok(()),
                Some(Landed::No) => Err(RecordError::Failed(why)),
                // An earlier attempt's reservation of the key: answered from it
                // below, as when the ledger refuses the key as used.
                Some(Landed::Other(state)) => Err(RecordError::KeyUsed { state }),
                None => {
                    // The ledger cannot be asked: the marker stays pending, and the
                    // key is resolved from the ledger past its bound (by a retry
                    // or the sweeper), whichever way it went. Its permit stays
                    // held as for an admission until then: the resolution lets it
                    // go if the admission is undone.
                    drop.throttle.hold_unresolved(
                        &request.key,
                        attempt,
                        permit,
                        admitted.reservation.expires_at_ms,
                    );
                    tracing::warn!(drop = %drop.name, key = %request.key, %why, "an admission's commit has an unknown outcome: left for its resolution");
                    return Turn::Done(Err(Failure::outcome_unknown(format!(
                        "the ledger's commit of this reservation failed without saying whether it landed ({why}), and the ledger cannot be asked; it is resolved by the ledger's record once the ledger answers again: retry the same key"
                    ))));
                }
            }
        }
        other => other,
    };
    let earlier = match recorded {
        Err(RecordError::KeyUsed { .. }) => {
            match app.ledger.reservation(&ledger_key, &request.key).await {
                Ok(row) => row,
                Err(e) => {
                    // Which reservation holds the key cannot be read: taking this
                    // marker back could leave Redis without the unit of one the
                    // ledger holds. It stays pending and is resolved from the
                    // ledger past its bound. (This attempt never landed: the
                    // ledger refused its key; its permit goes back.)
                    std::mem::drop(permit);
                    return Turn::Done(Err(Failure::retry(format!(
                        "the ledger holds a reservation under this key and could not be read ({e}); it is resolved by the ledger's record once the ledger answers again: retry the same key"
                    ))));
                }
            }
        }
        _ => None,
    };
    if let Some(row) = earlier
        && row.user == request.user
        && row.quantity == request.quantity
        && row.variant == request.variant
        && row.state.holds_units()
    {
        // The ledger already holds this buyer's reservation under the key (an
        // earlier attempt's commit landed after this one was admitted afresh):
        // this pending marker becomes that reservation, the unit it holds is its.
        return Turn::Done(
            match gate::replay(&mut conn, &drop.keys, app.ledger.id(), &row, &ledger_key).await {
                Ok(_) => {
                    drop.throttle.hold(&request.key, permit, row.expires_at_ms);
                    Ok(Outcome::AlreadyReserved(View {
                        reservation: row.reservation(),
                        remaining: admitted.remaining,
                    }))
                }
                Err(e) => Err(super::redis_down(drop, config, &e)),
            },
        );
    }
    if let Err(refusal) = recorded {
        std::mem::drop(permit);
        let undone = undo(app, drop, &request.key, attempt, deadline).await;
        tracing::warn!(drop = %drop.name, %refusal, undone = undone.is_ok(), "the ledger refused an admission");
        return match refusal {
            // The gate moved to another epoch, or Redis lost writes, while this was
            // recorded: the gate is brought in line, and the buyer, whose admission
            // others may have seen held meanwhile, hears the 503 it is: retry.
            RecordError::NotAuthority { .. } | RecordError::SeqReused(_) => {
                let suspect = matches!(refusal, RecordError::SeqReused(_));
                let _ = super::handover::open_gate(app, drop, suspect).await;
                Turn::Done(Err(moved_on(drop)))
            }
            // The ledger counts fewer units left than Redis (a return it has not
            // recorded yet, or a Redis behind it): neither says sold out for sure.
            RecordError::SoldOut { available } => Turn::Done(Err(Failure::retry(format!(
                "the ledger counts {available} units left where Redis admitted this one: nothing was reserved; retry the same key"
            )))),
            RecordError::KeyUsed { .. } => {
                Turn::Done(from_ledger_record(app, &ledger_key, request).await)
            }
            // Redis decided on a config it lost (another sidecar read the newer one):
            // the buyer retries once the operator has published it again.
            RecordError::ConfigBehind { .. } => {
                super::count_decided_on_lost_config(app, drop);
                Turn::Done(Err(Failure::retry(format!(
                    "{refusal}: nothing was reserved; retry the same request"
                ))))
            }
            RecordError::GivenUp | RecordError::Late => Turn::Done(Err(Failure::retry(
                "the ledger did not record the reservation within its deadline; nothing was reserved: retry the same key",
            ))),
            RecordError::Failed(error) | RecordError::Unknown(error) => {
                Turn::Done(Err(Failure::unavailable(format!(
                    "the ledger could not record the reservation ({error}); nothing was reserved: retry the same key"
                ))))
            }
        };
    }
    // Durable from here on: whatever Redis does next, the buyer hears 201.
    let held = View {
        reservation: Reservation {
            state: State::Active,
            ..admitted.reservation.clone()
        },
        remaining: admitted.remaining,
    };
    let activated = match faults::check(Fault::AfterLedgerCommit) {
        Ok(()) => {
            drop.gate
                .activate(&conn, app.ledger.id(), &request.key, attempt)
                .await
        }
        Err(injected) => Err(redis::RedisError::from((
            redis::ErrorKind::Client,
            "injected",
            injected.to_string(),
        ))),
    };
    let view = match activated {
        Ok((Activation::Activated(view), _)) => view,
        Err(error) => {
            // Redis is in line again once the refresh replays the ledger's record
            // (pending -> active); until then the hold still counts in Redis.
            app.breaker(Some(drop)).failed(&error);
            tracing::warn!(drop = %drop.name, %error, "activation failed after the ledger recorded the admission");
            replay_later(app, drop, &ledger_key, &request.key).await;
            // No replica wait: Redis just failed under this connection, and the
            // ledger already has the admission.
            drop.throttle
                .hold(&request.key, permit, held.reservation.expires_at_ms);
            return Turn::Done(Ok(Outcome::Admitted(held)));
        }
        Ok((
            Activation::Gone {
                marker: Some(marker),
                remaining,
            },
            _,
        )) if matches!(
            marker.state,
            State::Pending | State::Active | State::Confirmed
        ) =>
        {
            // Another attempt's marker (one admitted afresh after this one was
            // taken for dead), or a replay from
            // the ledger activated it: the replay makes Redis hold this durable
            // reservation whatever that attempt does.
            replay_later(app, drop, &ledger_key, &request.key).await;
            View {
                reservation: Reservation {
                    state: State::Active,
                    expires_at_ms: admitted.reservation.expires_at_ms,
                    ..marker
                },
                remaining,
            }
        }
        Ok((
            Activation::Gone {
                marker: Some(marker),
                ..
            },
            step,
        )) => {
            // Redis expired it while it waited; the expiry's caller recorded it
            // too, and this record of it is a no-op then (the same transition).
            let expired = change_of(drop, config, &request.key, &step, &marker, State::Expired);
            if let Err(error) = app.ledger.record(expired).await {
                tracing::warn!(drop = %drop.name, %error, "expiry not recorded in the ledger");
            }
            return Turn::Done(Err(Failure::throttled(
                config,
                Throttled::ExpiredWhileWaiting,
            )));
        }
        Ok((Activation::Gone { marker: None, .. }, _)) => {
            // The sweeper took it for an admission its sidecar never finished just
            // before the commit landed: the ledger has it, and the refresh replays
            // it into Redis.
            replay_later(app, drop, &ledger_key, &request.key).await;
            held
        }
    };
    drop.throttle
        .hold(&request.key, permit, view.reservation.expires_at_ms);
    match app.replicas.acknowledged(&mut conn).await {
        Ok(true) => {}
        Ok(false) => {
            app.metrics.replica_wait_timeouts.inc();
            tracing::debug!(drop = %drop.name, "replicas did not acknowledge in time; the ledger has the admission");
        }
        Err(error) => {
            app.metrics.replica_wait_timeouts.inc();
            tracing::warn!(drop = %drop.name, %error, "WAIT failed; the ledger has the admission");
        }
    }
    Turn::Done(Ok(Outcome::Admitted(view)))
}

/// The answer for an admission taken back because its gate moved on under it.
fn moved_on(drop: &Drop) -> Failure {
    Failure::retry(format!(
        "drop {}'s gate moved on while this admission was being recorded (a rebuild, a hand-over, or the drop re-created): nothing was reserved; retry the same key",
        drop.name
    ))
}

/// Takes the pending admission `attempt` of `key` back, asking Redis again until
/// it is done or `deadline_ms` (the admission's pending bound, past which its
/// resolution takes it back) has passed, so that a 503 answered after it leaves no
/// pending marker counting stock while Redis is merely slow or reconnecting. (The
/// request waits that long at most when Redis does not answer.)
async fn undo(
    app: &App,
    drop: &Drop,
    key: &str,
    attempt: &str,
    deadline_ms: i64,
) -> redis::RedisResult<()> {
    let mut conn = app.redis.clone();
    let mut pause = Duration::from_millis(20);
    loop {
        match gate::undo(&mut conn, &drop.keys, app.ledger.id(), key, attempt).await {
            Ok(()) => {
                app.units_back.notify_one();
                return Ok(());
            }
            Err(error) if now_ms() + pause.as_millis() as i64 >= deadline_ms => {
                return Err(error);
            }
            Err(_) => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(100));
            }
        }
    }
}

/// The answer for a reserve whose key the ledger already holds for a reservation
/// Redis no longer knows (its marker outlived its TTL): the ledger's word.
async fn from_ledger_record(
    app: &App,
    ledger_key: &str,
    request: &gate::ReserveRequest,
) -> Result<Outcome, Failure> {
    match app.ledger.reservation(ledger_key, &request.key).await {
        Ok(Some(row))
            if row.user == request.user
                && row.quantity == request.quantity
                && row.variant == request.variant =>
        {
            Ok(Outcome::AlreadyReserved(View {
                reservation: row.reservation(),
                remaining: 0,
            }))
        }
        Ok(Some(_)) => Ok(Outcome::KeyReused),
        _ => Err(Failure::unavailable(format!(
            "the ledger holds another record of key {}: nothing was reserved; retry",
            request.key
        ))),
    }
}

/// Reserve on the ledger's gate: same checks, same answers, decided on the config
/// the operator published (read afresh when Redis answers) and the newest the
/// ledger holds. `None`: the drop is back on the gate, try there.
pub(super) async fn on_fallback(
    app: &App,
    drop: &Drop,
    request: &Reserve,
    reason: Reason,
) -> Option<Result<Outcome, Failure>> {
    let config = match published_now(app, drop).await {
        // Decided on the config just read, its mode and failure policy too: a drop
        // the operator put back on the gate goes there, one it closed (or whose
        // failure policy is now Closed while Redis is down) is refused.
        Published::Now(config) | Published::Kept(config) => {
            match super::choose_again(app, drop, &config, reason) {
                Choice::Fallback(_) => *config,
                Choice::Gate => return None,
                Choice::Refused(failure) => return Some(Err(failure)),
            }
        }
        Published::Missing => return Some(Err(config_missing(drop))),
        // Not even a retry's look-up: on a ledger that is not the drop's authority
        // yet it would hand the drop over, on this config.
        Published::Stale(why) => return Some(Err(Failure::retry(why))),
    };
    let config = &config;
    // The ledger rows of the sale of the config decided on.
    let ledger_key = drop.ledger_key_of(&config.sale);
    // A retry first, as on the gate: it hears what its key holds, whatever the
    // window, the permits or the stock say now.
    let retried = on_ledger(app, drop, reason, || {
        app.ledger
            .fallback_retry(&ledger_key, config, request.ask(), now_ms())
    })
    .await;
    match retried {
        Ok(Some(Some(outcome))) => {
            if outcome.settles() {
                drop.throttle.release(&request.key);
            }
            return Some(Ok(outcome));
        }
        Ok(Some(None)) => {}
        Ok(None) => return None,
        Err(failure) => return Some(Err(failure)),
    }

    // The permit comes first here: a ledger admission cannot be taken back as if it
    // never happened once its event may have been published, so one that finds no
    // permit never starts. (The window, the per-user limit and the stock are
    // checked in the ledger's transaction, on its newest terms.)
    let wait = Duration::from_millis(config.acquire_timeout_ms);
    let Some(permit) = drop.throttle.acquire_for(&request.key, wait).await else {
        return Some(Err(Failure::throttled(config, Throttled::NoPermit)));
    };
    // The wait may have been long enough for the drop to change.
    if let Err(why) = still_current(app, drop, config).await {
        return Some(Err(Failure::retry(why)));
    }
    // The sale window is judged when the ledger decides, not when the request came
    // (nor before a hand-over to the ledger it waited for).
    let outcome = match on_ledger(app, drop, reason, || {
        app.ledger
            .fallback_reserve(&ledger_key, config, request.ask(), now_ms())
    })
    .await
    {
        Ok(Some(outcome)) => outcome,
        Ok(None) => return None,
        Err(failure) => return Some(Err(failure)),
    };
    if let Outcome::Admitted(view) = &outcome {
        drop.throttle
            .hold(&request.key, permit, view.reservation.expires_at_ms);
    }
    Some(Ok(outcome))
}

/// Redis holds no config of the drop's sale: nothing is decided on the copy.
fn config_missing(drop: &Drop) -> Failure {
    Failure::retry(format!(
        "drop {}'s config in Redis is not the one this sidecar holds (lost with Redis's data and published again soon, or the drop was deleted or re-created): nothing is decided on an older copy; retry",
        drop.name
    ))
}

/// Whether `config`, which a fallback admission checked before waiting for its
/// throttle permit, is still the drop's current one in the API server (when the
/// sidecar watches it): `Err` with why not.
async fn still_current(app: &App, drop: &Drop, config: &DropConfig) -> Result<(), String> {
    match &app.drop_watch {
        Some(watch) => match watch.check(&drop.name, config).await {
            crate::drop_watch::Verdict::Current => Ok(()),
            crate::drop_watch::Verdict::Stale(why) => Err(why),
        },
        None => Ok(()),
    }
}

/// How long a request asks the ledger whether its commit landed.
const ASK_LEDGER_FOR: Duration = Duration::from_secs(5);

/// Whether the admission `attempt` of `request.key`, whose commit had an unknown
/// outcome, is durable (see [`crate::ledger::Ledger::admission_landed`]); `None`
/// while the ledger cannot say, for [`ASK_LEDGER_FOR`].
async fn admission_landed(
    app: &App,
    ledger_key: &str,
    request: &gate::ReserveRequest,
) -> Option<Landed> {
    let until = Instant::now() + ASK_LEDGER_FOR;
    let mut backoff = Backoff::new();
    loop {
        match app
            .ledger
            .admission_landed(
                ledger_key,
                &request.key,
                &request.user,
                request.quantity,
                &request.attempt,
                now_ms(),
            )
            .await
        {
            Ok(landed) => return Some(landed),
            Err(error) if Instant::now() < until => {
                tracing::debug!(%error, "asking the ledger whether a commit landed");
                backoff.wait(until).await;
            }
            Err(_) => return None,
        }
    }
}

/// Resolves the admission of `key` left pending past its bound, if it still is. One not yet due (another
/// retry resolved the dead one and was admitted afresh meanwhile) is left to its
/// own attempt.
async fn resolve_key(
    app: &App,
    drop: &Drop,
    conn: &mut dropgate_redis::Connection,
    key: &str,
) -> Result<(), String> {
    let now = now_ms();
    match gate::unresolved(conn, &drop.keys, key).await {
        Ok(Some(gate::Unresolved::Admission(admission))) if admission.due_ms <= now => {
            resolve_dead_admission(app, drop, key, &admission, now).await
        }
        // Resolved meanwhile (activated, taken back, settling, admitted afresh):
        // asked again.
        Ok(_) => Ok(()),
        Err(e) => Err(e.to_string()),
    }
}

/// Resolves `admission`, an admission of `key` still pending past its bound (its
/// sidecar died, or its commit stalled), as the ledger (its row of the sale the
/// admission was made in) says it ended:
/// - no reservation under the key: the key is claimed in the ledger for the
///   admission's attempt, so that its commit, should it still come, is refused, and
///   its units go back to stock;
/// - this buyer's reservation (the same user, quantity and variant: the commit
///   landed): Redis is brought forward to the ledger's record, whatever state it
///   reached since;
/// - another buyer's or other terms (the key was used before): the admission can
///   never be recorded (the ledger replaces only abandoned rows), and its units go
///   back.
///
/// One already expired while pending (`unsure`: its units went back then, its
/// resolution could not reach the ledger within the hold) gives nothing back: the
/// claim deletes its marker; a row of it is replayed as for any other.
///
/// The sweeper and a retry of the key (which then is decided afresh) call it alike.
pub(crate) async fn resolve_dead_admission(
    app: &App,
    drop: &Drop,
    key: &str,
    admission: &gate::PendingAdmission,
    now: i64,
) -> Result<(), String> {
    let mut conn = app.redis.clone();
    let ledger = app.ledger.id();
    let gate::PendingAdmission {
        user,
        quantity,
        attempt,
        variant,
        sale,
        ..
    } = admission;
    // The ledger row of the sale the admission was made in (the sidecar's copy of
    // the config may be of an older sale, the drop re-created since).
    let ledger_key = &sale
        .as_deref()
        .map_or_else(|| drop.ledger_key(), |sale| drop.ledger_key_of(sale));
    // (abandon.lua deletes an unsure marker without giving anything back.)
    let take_back = async |conn: &mut dropgate_redis::Connection| {
        gate::abandon(conn, &drop.keys, ledger, key, attempt)
            .await
            .map_err(|e| e.to_string())
    };
    let claimed = app
        .ledger
        .claim_abandoned(ledger_key, key, user, *quantity, attempt, now)
        .await
        .map_err(|e| e.to_string())?;
    // Never made (claimed, or another reservation holds the key): the permit
    // this sidecar kept for it while its commit's outcome was unknown goes back.
    // (Kept on another sidecar, it goes back at the hold's deadline.)
    if claimed {
        drop.throttle.release_unresolved(key, attempt);
        return take_back(&mut conn).await;
    }
    match app.ledger.reservation(ledger_key, key).await {
        Ok(Some(row))
            if row.user == *user && row.quantity == *quantity && row.variant == *variant =>
        {
            if !row.state.holds_units() {
                drop.throttle.release_unresolved(key, attempt);
            }
            // (An unsure marker is brought forward too, and no longer unsure: an
            // active row of its deadline leaves it expired.)
            match gate::replay(&mut conn, &drop.keys, ledger, &row, ledger_key).await {
                Ok(Replay::Replayed | Replay::InLine) => Ok(()),
                Ok(other) => Err(format!(
                    "the ledger's record could not be replayed: {other:?}"
                )),
                Err(e) => Err(e.to_string()),
            }
        }
        Ok(Some(_)) => {
            drop.throttle.release_unresolved(key, attempt);
            take_back(&mut conn).await
        }
        // A claim is refused only where the key holds a row, and rows are never
        // deleted: not reached; left for the next resolution.
        Ok(None) => Ok(()),
        Err(error) => Err(error.to_string()),
    }
}
