//! Reserve, on the Redis gate or the ledger's fallback gate.

use std::time::{Duration, Instant};

use dropgate_api::{DropConfig, Mode};

use super::handover::Reason;
use super::record::{change_key, change_of, record_expiry, replay_later};
use super::{
    Call, Choice, Failure, Served, Throttled, Turn, closed, decide, on_ledger, redis_failed,
};
use crate::app::App;
use crate::clock::now_ms;
use crate::drops::Drop;
use crate::faults::{self, Fault};
use crate::gate::{self, Activation};
use crate::input::Reserve;
use crate::ledger::RecordError;
use crate::reservation::{Outcome, Reservation, State, View};

/// How soon a request first re-reads a key whose admission another request holds
/// pending; each further wait doubles, up to [`PENDING_POLL_MAX`]. Most pending
/// admissions settle within a few ms (a group commit); a slow one is not worth a
/// script call every 2 ms.
const PENDING_POLL: Duration = Duration::from_millis(2);
const PENDING_POLL_MAX: Duration = Duration::from_millis(50);
/// Slack beyond the permit wait for that other request to activate or undo.
const PENDING_GRACE: Duration = Duration::from_millis(250);
/// How long the ledger's commit of an admission may take before the admission is
/// overdue: past its permit wait plus this, a pending admission is one its sidecar
/// never finished (it died), and a retry of the same key takes it over.
const PENDING_COMMIT_MS: u64 = 2_000;

/// Reserves `request.quantity` units of drop `drop_name` for `request.user` under
/// `request.key`, on whichever gate decides the drop now.
pub async fn reserve(app: &App, drop_name: &str, request: &Reserve) -> Result<Served, Failure> {
    let drop = super::find_drop(app, drop_name).await?;
    decide(app, &drop, Call::Reserve(request)).await
}

/// One attempt at the Redis gate: admit pending, take a permit, make it durable in
/// the ledger (which checks the gate's epoch and its own count), then activate.
pub(super) async fn on_gate(
    app: &App,
    drop: &Drop,
    config: &DropConfig,
    request: &Reserve,
) -> Turn<Outcome> {
    let mut conn = app.redis.clone();
    let attempt = format!("{:016x}", rand::random::<u64>());
    let permit_wait = Duration::from_millis(config.acquire_timeout_ms);
    // A duplicate of this key that is still waiting for its permit settles within
    // the permit wait; until then this request asks again rather than promise a
    // unit that may be undone.
    let settle_by = Instant::now() + permit_wait + PENDING_GRACE;
    let mut poll = PENDING_POLL;
    let reply = loop {
        let reply = match gate::reserve(
            &mut conn,
            &drop.keys,
            &request.key,
            &request.user,
            request.quantity,
            &attempt,
            app.ledger.id(),
            config.acquire_timeout_ms + PENDING_COMMIT_MS,
        )
        .await
        {
            Ok(reply) => reply,
            Err(e) => return Turn::Reroute(redis_failed(app, drop, config, &e)),
        };
        app.breaker(Some(drop)).answered();
        if reply.outcome != Outcome::Pending || Instant::now() >= settle_by {
            break reply;
        }
        tracing::debug!(
            drop = %drop.name,
            key = %request.key,
            wait_ms = poll.as_millis() as u64,
            "waiting for another attempt's pending admission of this key to be activated or undone"
        );
        tokio::time::sleep(poll.min(settle_by.saturating_duration_since(Instant::now()))).await;
        poll = (poll * 2).min(PENDING_POLL_MAX);
    };
    record_expiry(app, drop, config, &request.key, &reply.step).await;
    let admitted = match reply.outcome {
        Outcome::Admitted(_) if reply.step.sale.as_deref() != Some(config.sale.as_str()) => {
            // The drop was re-created since this sidecar read its config: admit
            // again with the new sale's config, never record under the old one.
            let _ = gate::undo(&mut conn, &drop.keys, &request.key, &attempt).await;
            return Turn::Reopen { suspect: false };
        }
        // Pending until activated below; also a retry's take-over of an admission
        // its dead sidecar never finished (that one carries no change number).
        Outcome::Admitted(view) => view,
        Outcome::Closed => return Turn::Reopen { suspect: false },
        Outcome::OffGate(Mode::FailOpen) => return Turn::Reroute(Choice::Fallback(Reason::Mode)),
        Outcome::OffGate(_) => return Turn::Reroute(Choice::Refused(closed(drop))),
        Outcome::Pending => {
            return Turn::Done(Err(Failure::throttled(config, Throttled::KeyInFlight)));
        }
        refused => return Turn::Done(Ok(refused)),
    };

    let Some(permit) = drop.throttle.acquire(permit_wait).await else {
        return Turn::Done(
            match gate::undo(&mut conn, &drop.keys, &request.key, &attempt).await {
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
    );
    let recorded = match faults::check(Fault::AfterRedisAdmit) {
        Ok(()) => app.ledger.record(change).await,
        Err(injected) => Err(RecordError::Failed(injected.to_string())),
    };
    let ledger_key = change_key(drop, &reply.step);
    if let Err(RecordError::KeyUsed { .. }) = recorded
        && let Ok(Some(row)) = app.ledger.reservation(&ledger_key, &request.key).await
        && row.user == request.user
        && row.quantity == request.quantity
        && row.state.holds_units()
    {
        // The ledger already holds this buyer's reservation under the key (an
        // earlier attempt's commit landed after this one was admitted afresh):
        // this pending marker becomes that reservation, the unit it holds is its.
        return Turn::Done(
            match gate::replay(&mut conn, &drop.keys, &row, &ledger_key).await {
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
        let undone = gate::undo(&mut conn, &drop.keys, &request.key, &attempt).await;
        tracing::warn!(drop = %drop.name, %refusal, undone = undone.is_ok(), "the ledger refused an admission");
        return match refusal {
            RecordError::NotAuthority { .. } => Turn::Reopen { suspect: false },
            RecordError::SeqReused(_) => Turn::Reopen { suspect: true },
            RecordError::SoldOut { available } => Turn::Done(Ok(Outcome::SoldOut {
                remaining: available,
            })),
            RecordError::KeyUsed { .. } => {
                Turn::Done(from_ledger_record(app, &ledger_key, request).await)
            }
            RecordError::Failed(error) => Turn::Done(Err(Failure::unavailable(format!(
                "the ledger could not record the reservation ({error}); nothing was reserved: retry the same key"
            )))),
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
        Ok(()) => gate::activate(&mut conn, &drop.keys, &request.key, &attempt).await,
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
            // Another attempt's marker (a retry that took this one over, or one
            // admitted afresh after this one was taken for dead), or a replay from
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

/// The answer for a reserve whose key the ledger already holds for a reservation
/// Redis no longer knows (its marker outlived its TTL): the ledger's word.
async fn from_ledger_record(
    app: &App,
    ledger_key: &str,
    request: &Reserve,
) -> Result<Outcome, Failure> {
    match app.ledger.reservation(ledger_key, &request.key).await {
        Ok(Some(row)) if row.user == request.user && row.quantity == request.quantity => {
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

/// Reserve on the ledger's gate: same checks, same answers. `None`: the drop is
/// back on the gate, try there.
pub(super) async fn on_fallback(
    app: &App,
    drop: &Drop,
    config: &DropConfig,
    request: &Reserve,
    reason: Reason,
) -> Option<Result<Outcome, Failure>> {
    let now = now_ms();
    let ledger_key = drop.ledger_key();
    // A retry first, as on the gate: it hears what its key holds, whatever the
    // window, the permits or the stock say now.
    let retried = on_ledger(app, drop, reason, || {
        app.ledger.fallback_retry(
            &ledger_key,
            config,
            &request.key,
            &request.user,
            request.quantity,
            now,
        )
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
    if config.starts_at_ms.is_some_and(|start| now < start) {
        return Some(Ok(Outcome::NotOpen {
            starts_at_ms: config.starts_at_ms,
        }));
    }
    if config.ends_at_ms.is_some_and(|end| now >= end) {
        return Some(Ok(Outcome::Ended {
            ends_at_ms: config.ends_at_ms,
        }));
    }
    // The permit comes first here: a ledger admission cannot be taken back as if it
    // never happened once its event may have been published, so one that finds no
    // permit never starts.
    let wait = Duration::from_millis(config.acquire_timeout_ms);
    let Some(permit) = drop.throttle.acquire(wait).await else {
        return Some(Err(Failure::throttled(config, Throttled::NoPermit)));
    };
    let outcome = match on_ledger(app, drop, reason, || {
        app.ledger.fallback_reserve(
            &ledger_key,
            config,
            &request.key,
            &request.user,
            request.quantity,
            now,
        )
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
