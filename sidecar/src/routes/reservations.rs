//! `POST /v1/drops/{drop}/reservations` and the reservation's confirm, cancel and
//! look-up, on the Redis gate or, when the drop is off it, the ledger's fallback gate.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use dropgate_api::{DropConfig, FailurePolicy, Mode};
use warp::http::StatusCode;
use warp::reply::Response;

use super::finish;
use crate::answer::{Answer, rfc3339};
use crate::app::App;
use crate::clock::now_ms;
use crate::drops::Drop;
use crate::faults::{self, Fault};
use crate::gate::{self, GateReply};
use crate::handover::{self, Opening, Reason, Refusal};
use crate::input::{self, Reserve};
use crate::ledger::{LedgerError, RecordError, Recorded, State};
use crate::record::{change_of, record_expiry};

/// Seconds a throttled buyer is told to wait: permits free up as others confirm.
const RETRY_AFTER_SECONDS: u64 = 1;
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

/// Which gate answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    Gate,
    Fallback,
}

impl Path {
    /// Answers of the fallback gate carry `Dropgate-Path: fallback`.
    fn mark(self, answer: Answer) -> Answer {
        match self {
            Path::Gate => answer,
            Path::Fallback => answer.via_fallback(),
        }
    }
}

pub async fn reserve(drop: String, app: Arc<App>, body: Result<Bytes, Answer>) -> Response {
    let started = Instant::now();
    let answer = match body {
        Ok(body) => admit(&app, &drop, &body).await,
        Err(refusal) => Err(refusal),
    }
    .unwrap_or_else(|refusal| refusal);
    finish(&app, "reserve", started, answer)
}

pub async fn confirm(drop: String, key: String, app: Arc<App>) -> Response {
    let started = Instant::now();
    let answer = settle(&app, &drop, &key, Some(State::Confirmed))
        .await
        .unwrap_or_else(|refusal| refusal);
    finish(&app, "confirm", started, answer)
}

pub async fn cancel(drop: String, key: String, app: Arc<App>) -> Response {
    let started = Instant::now();
    let answer = settle(&app, &drop, &key, Some(State::Cancelled))
        .await
        .unwrap_or_else(|refusal| refusal);
    finish(&app, "cancel", started, answer)
}

pub async fn lookup(drop: String, key: String, app: Arc<App>) -> Response {
    let started = Instant::now();
    let answer = settle(&app, &drop, &key, None)
        .await
        .unwrap_or_else(|refusal| refusal);
    finish(&app, "lookup", started, answer)
}

/// Which gate decides a request, chosen once per attempt: the drop's mode, then the
/// Redis breaker, then (after a Redis failure) the failure policy.
enum Route {
    Gate,
    Fallback(Reason),
    Refused(Answer),
}

fn route(app: &App, drop: &Drop, config: &DropConfig) -> Route {
    match config.mode {
        Mode::FailOpen => Route::Fallback(Reason::Mode),
        Mode::Closed => Route::Refused(app.closed(drop)),
        Mode::Gate => match app.redis_breaker() {
            None => Route::Gate,
            Some(unreachable) => after_redis_failure(app, drop, config, &unreachable),
        },
    }
}

/// Where a request goes when Redis failed under it.
fn after_redis_failure(
    app: &App,
    drop: &Drop,
    config: &DropConfig,
    error: &redis::RedisError,
) -> Route {
    app.redis_failed(error);
    match config.failure_policy {
        FailurePolicy::Open => {
            tracing::warn!(drop = %drop.name, %error, "Redis failed: fallback path");
            Route::Fallback(Reason::Outage)
        }
        FailurePolicy::Closed => Route::Refused(app.redis_down(drop, error)),
    }
}

/// How a turn on the gate ended.
enum Turn<T> {
    Done(T),
    /// Go elsewhere (Redis failed, or the drop left the gate).
    Reroute(Route),
    /// The gate is closed or behind the ledger: open it and try again.
    Reopen {
        suspect: bool,
    },
}

/// Opens the gate after a turn found it closed; `Ok` to try the gate again.
async fn reopen(app: &App, drop: &Drop, suspect: bool) -> Result<(), Answer> {
    match handover::open_gate(app, drop, suspect).await {
        Opening::Open | Opening::NotGate(_) => Ok(()),
        Opening::Busy => Err(being_rebuilt(drop)),
        Opening::Refused(why) => Err(Answer::unavailable(why)),
    }
}

/// 503 while another sidecar brings Redis in line with the ledger.
fn being_rebuilt(drop: &Drop) -> Answer {
    Answer::unavailable(format!(
        "drop {} is being brought in line with the ledger before its gate opens: nothing was changed; retry",
        drop.name
    ))
    .retry_after(RETRY_AFTER_SECONDS)
}

async fn admit(app: &App, raw_drop: &str, body: &[u8]) -> Result<Answer, Answer> {
    let request = Reserve::parse(body).map_err(|e| Answer::invalid(e.0))?;
    let drop = app.find_drop(raw_drop).await?;
    let mut reopened = false;
    loop {
        let config = drop.config();
        let turn = match route(app, &drop, &config) {
            Route::Gate => admit_gate(app, &drop, &config, &request).await,
            other => Turn::Reroute(other),
        };
        match turn {
            Turn::Done(answer) => return answer,
            Turn::Reroute(Route::Fallback(reason)) => {
                if let Some(answer) = admit_fallback(app, &drop, &config, &request, reason).await {
                    return answer;
                }
            }
            Turn::Reroute(Route::Refused(answer)) => return Err(answer),
            Turn::Reroute(Route::Gate) => {}
            Turn::Reopen { suspect } if !reopened => {
                reopened = true;
                reopen(app, &drop, suspect).await?;
            }
            Turn::Reopen { .. } => return Err(being_rebuilt(&drop)),
        }
    }
}

/// One attempt at the Redis gate: admit pending, take a permit, make it durable in
/// the ledger (which checks the gate's epoch and its own count), then activate.
async fn admit_gate(
    app: &App,
    drop: &Drop,
    config: &DropConfig,
    request: &Reserve,
) -> Turn<Result<Answer, Answer>> {
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
            Err(e) => return Turn::Reroute(after_redis_failure(app, drop, config, &e)),
        };
        app.redis_answered();
        if reply.outcome != "pending" || Instant::now() >= settle_by {
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
    record_expiry(app, drop, config, &request.key, &reply).await;
    match reply.outcome.as_str() {
        "admitted" if reply.sale.as_deref() != Some(config.sale.as_str()) => {
            // The drop was re-created since this sidecar read its config: admit
            // again with the new sale's config, never record under the old one.
            let _ = gate::undo(&mut conn, &drop.keys, &request.key, &attempt).await;
            return Turn::Reopen { suspect: false };
        }
        "admitted" => {}
        "closed" => return Turn::Reopen { suspect: false },
        "mode" => {
            return Turn::Reroute(match reply.state.as_deref().and_then(Mode::parse) {
                Some(Mode::FailOpen) => Route::Fallback(Reason::Mode),
                _ => Route::Refused(app.closed(drop)),
            });
        }
        "pending" => {
            return Turn::Done(Err(throttled(
                config,
                "an earlier attempt with this key is unresolved; it is settled or taken over within a few seconds",
            )));
        }
        _ => return Turn::Done(refused(app, drop, request, &reply, Path::Gate)),
    }

    let Some(permit) = drop.throttle.acquire(permit_wait).await else {
        return Turn::Done(
            match gate::undo(&mut conn, &drop.keys, &request.key, &attempt).await {
                Ok(_) => Err(throttled(config, "nothing was reserved")),
                Err(e) => Err(Answer::unavailable(format!(
                    "no throttle permit was free and Redis failed while taking the admission back ({e}); it expires by itself: retry the same key"
                ))),
            },
        );
    };
    // A 201 means the admission is durable in the ledger: record it before the
    // reservation is activated, and take it back if that fails. The ledger refuses
    // it if the gate was not its authority at this epoch, or if Redis admitted a
    // unit the ledger's own count does not have.
    let change = change_of(drop, config, &request.key, &reply, State::Active);
    let recorded = match faults::check(Fault::AfterRedisAdmit) {
        Ok(()) => app.ledger.record(change).await,
        Err(injected) => Err(RecordError::Failed(injected.to_string())),
    };
    let ledger_key = change_key(drop, &reply);
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
                    let shown = from_ledger(row, None, reply.remaining);
                    Ok(reservation(
                        StatusCode::OK,
                        "already_reserved",
                        drop,
                        &request.key,
                        &shown,
                        Path::Gate,
                    ))
                }
                Err(e) => Err(app.redis_down(drop, &e)),
            },
        );
    }
    if let Err(refusal) = recorded {
        drop_permit(permit);
        let undone = gate::undo(&mut conn, &drop.keys, &request.key, &attempt).await;
        tracing::warn!(drop = %drop.name, %refusal, undone = undone.is_ok(), "the ledger refused an admission");
        return match refusal {
            RecordError::NotAuthority { .. } => Turn::Reopen { suspect: false },
            RecordError::SeqReused(_) => Turn::Reopen { suspect: true },
            RecordError::SoldOut { available } => Turn::Done(Err(Answer::refusal(
                StatusCode::CONFLICT,
                "sold_out",
                format!(
                    "drop {} is sold out: the ledger has {} left, {} asked for",
                    drop.name,
                    available.max(0),
                    request.quantity
                ),
            )
            .with("remaining", available.max(0)))),
            RecordError::KeyUsed { .. } => Turn::Done(from_ledger_record(app, drop, request).await),
            RecordError::Failed(error) => Turn::Done(Err(Answer::unavailable(format!(
                "the ledger could not record the reservation ({error}); nothing was reserved: retry the same key"
            )))),
        };
    }
    // Durable from here on: whatever Redis does next, the buyer hears 201.
    let activated = match faults::check(Fault::AfterLedgerCommit) {
        Ok(()) => gate::activate(&mut conn, &drop.keys, &request.key, &attempt).await,
        Err(injected) => Err(redis::RedisError::from((
            redis::ErrorKind::Client,
            "injected",
            injected.to_string(),
        ))),
    };
    let active = match activated {
        Ok(active) => active,
        Err(error) => {
            // Redis is in line again once the refresh replays the ledger's record
            // (pending -> active); until then the hold still counts in Redis.
            app.redis_failed(&error);
            tracing::warn!(drop = %drop.name, %error, "activation failed after the ledger recorded the admission");
            replay_later(app, drop, &drop.ledger_key(), &request.key).await;
            drop.throttle
                .hold(&request.key, permit, reply.when.unwrap_or(0));
            let shown = GateReply {
                state: Some(State::Active.as_str().into()),
                ..reply
            };
            return Turn::Done(Ok(reservation(
                StatusCode::CREATED,
                "admitted",
                drop,
                &request.key,
                &shown,
                Path::Gate,
            )));
        }
    };
    let active = match active.state.as_deref() {
        _ if active.outcome == "admitted" => active,
        // A retry took the admission over (this request was taken for dead), or a
        // replay from the ledger activated it: the same reservation, durable.
        Some("pending" | "active" | "confirmed") => {
            // Another attempt's marker (a retry that took this one over, or one
            // admitted afresh after this one was taken for dead): the replay makes
            // Redis hold this durable reservation whatever that attempt does.
            replay_later(app, drop, &drop.ledger_key(), &request.key).await;
            GateReply {
                state: Some(State::Active.as_str().into()),
                when: reply.when,
                ..active
            }
        }
        Some(_) => {
            // Redis expired it while it waited; the expiry's caller recorded it
            // too, and this record of it is a no-op then (the same transition).
            let expired = change_of(drop, config, &request.key, &active, State::Expired);
            if let Err(error) = app.ledger.record(expired).await {
                tracing::warn!(drop = %drop.name, %error, "expiry not recorded in the ledger");
            }
            return Turn::Done(Err(throttled(
                config,
                "the admission expired while it waited",
            )));
        }
        None => {
            // The sweeper took it for an admission its sidecar never finished just
            // before the commit landed: the ledger has it, and the refresh replays
            // it into Redis.
            replay_later(app, drop, &drop.ledger_key(), &request.key).await;
            GateReply {
                state: Some(State::Active.as_str().into()),
                ..reply
            }
        }
    };
    drop.throttle
        .hold(&request.key, permit, active.when.unwrap_or(0));
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
    Turn::Done(Ok(reservation(
        StatusCode::CREATED,
        "admitted",
        drop,
        &request.key,
        &active,
        Path::Gate,
    )))
}

fn drop_permit(permit: crate::throttle::Permit) {
    std::mem::drop(permit);
}

/// Runs a fallback-gate call; when the ledger is not the drop's authority yet,
/// hands the drop to it (if it may be) and runs the call once more. `Ok(None)`: the
/// drop is back on the gate (this sidecar's view was stale), nothing was done.
async fn on_fallback<T, F, Fut>(
    app: &App,
    drop: &Drop,
    reason: Reason,
    call: F,
) -> Result<Option<T>, Answer>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T, LedgerError>>,
{
    match call().await {
        Err(LedgerError::NotAuthority(_)) => {
            match handover::hand_to_ledger(app, drop, reason).await {
                Ok(_) => {}
                Err(Refusal::BackOnGate) => return Ok(None),
                Err(Refusal::Refused(why)) => {
                    return Err(Answer::unavailable(why).via_fallback());
                }
            }
            call().await.map(Some).map_err(|e| ledger_failed(drop, &e))
        }
        other => other.map(Some).map_err(|e| ledger_failed(drop, &e)),
    }
}

/// Reserve on the ledger's gate: same checks, same answers. `None`: the drop is
/// back on the gate, try there.
async fn admit_fallback(
    app: &App,
    drop: &Drop,
    config: &DropConfig,
    request: &Reserve,
    reason: Reason,
) -> Option<Result<Answer, Answer>> {
    let now = now_ms();
    let ledger_key = drop.ledger_key();
    // A retry first, as on the gate: it hears what its key holds, whatever the
    // window, the permits or the stock say now.
    let retried = on_fallback(app, drop, reason, || {
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
        Ok(Some(Some(reply))) => {
            if matches!(
                reply.state.as_deref(),
                Some("confirmed" | "cancelled" | "expired")
            ) {
                drop.throttle.release(&request.key);
            }
            return Some(refused(app, drop, request, &reply, Path::Fallback));
        }
        Ok(Some(None)) => {}
        Ok(None) => return None,
        Err(answer) => return Some(Err(answer)),
    }
    if config.starts_at_ms.is_some_and(|start| now < start) {
        let reply = window_reply("not_open", config.starts_at_ms);
        return Some(refused(app, drop, request, &reply, Path::Fallback));
    }
    if config.ends_at_ms.is_some_and(|end| now >= end) {
        let reply = window_reply("ended", config.ends_at_ms);
        return Some(refused(app, drop, request, &reply, Path::Fallback));
    }
    // The permit comes first here: a ledger admission cannot be taken back as if it
    // never happened once its event may have been published, so one that finds no
    // permit never starts.
    let wait = Duration::from_millis(config.acquire_timeout_ms);
    let Some(permit) = drop.throttle.acquire(wait).await else {
        return Some(Err(throttled(config, "nothing was reserved").via_fallback()));
    };
    let reply = match on_fallback(app, drop, reason, || {
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
        Ok(Some(reply)) => reply,
        Ok(None) => return None,
        Err(answer) => return Some(Err(answer)),
    };
    if reply.outcome == "admitted" {
        drop.throttle
            .hold(&request.key, permit, reply.when.unwrap_or(0));
        return Some(Ok(reservation(
            StatusCode::CREATED,
            "admitted",
            drop,
            &request.key,
            &reply,
            Path::Fallback,
        )
        .via_fallback()));
    }
    Some(refused(app, drop, request, &reply, Path::Fallback))
}

/// The answer when the fallback gate's ledger fails: there is no third gate.
fn ledger_failed(drop: &Drop, error: &crate::ledger::LedgerError) -> Answer {
    Answer::unavailable(format!(
        "Redis is not gating drop {} and the ledger failed: {error}",
        drop.name
    ))
}

fn window_reply(outcome: &str, when: Option<i64>) -> GateReply {
    GateReply {
        when,
        ..GateReply::made(outcome)
    }
}

/// The answers for every reserve outcome but `admitted`, on either path.
fn refused(
    app: &App,
    drop: &Drop,
    request: &Reserve,
    reply: &GateReply,
    path: Path,
) -> Result<Answer, Answer> {
    let name = &drop.name;
    let conflict = |outcome: &str, message: String| {
        path.mark(Answer::refusal(StatusCode::CONFLICT, outcome, message))
    };
    match reply.outcome.as_str() {
        "already_reserved" => Ok(path.mark(reservation(
            StatusCode::OK,
            "already_reserved",
            drop,
            &request.key,
            reply,
            path,
        ))),
        "sold_out" => Err(conflict(
            "sold_out",
            format!(
                "drop {name} is sold out: {} left, {} asked for",
                clamp(reply.remaining),
                request.quantity
            ),
        )
        .with("remaining", clamp(reply.remaining))),
        "per_user_limit_exceeded" => Err(conflict(
            "per_user_limit_exceeded",
            format!(
                "user {} already holds {} of the {} units one user may hold in drop {name}",
                request.user,
                reply.quantity.unwrap_or(0),
                reply.when.unwrap_or(0)
            ),
        )),
        "idempotency_key_reused" => Err(path.mark(Answer::refusal(
            StatusCode::UNPROCESSABLE_ENTITY,
            "idempotency_key_reused",
            format!(
                "key {} was already used in drop {name} for a different user or quantity",
                request.key
            ),
        ))),
        "not_open" => Err(path.mark(
            Answer::refusal(
                StatusCode::FORBIDDEN,
                "not_open",
                format!("drop {name} is not open yet"),
            )
            .with(
                "startsAt",
                reply.when.map_or(serde_json::Value::Null, rfc3339),
            ),
        )),
        "ended" => Err(path.mark(
            Answer::refusal(
                StatusCode::FORBIDDEN,
                "ended",
                format!("drop {name} has ended"),
            )
            .with(
                "endsAt",
                reply.when.map_or(serde_json::Value::Null, rfc3339),
            ),
        )),
        "not_found" => Err(app.unknown_drop(name)),
        other => Err(Answer::unavailable(format!("the gate answered {other:?}"))),
    }
}

/// 503 throttled with Retry-After: this sidecar's permits are all held by
/// unconfirmed reservations.
fn throttled(config: &DropConfig, detail: &str) -> Answer {
    Answer::refusal(
        StatusCode::SERVICE_UNAVAILABLE,
        "throttled",
        format!(
            "all {} reservation permits of this sidecar are in use ({detail}): retry the same key after {RETRY_AFTER_SECONDS}s",
            config.permits
        ),
    )
    .retry_after(RETRY_AFTER_SECONDS)
}

/// confirm (`to` Confirmed), cancel (`to` Cancelled) or look-up (`to` None).
async fn settle(
    app: &App,
    raw_drop: &str,
    raw_key: &str,
    to: Option<State>,
) -> Result<Answer, Answer> {
    let key = input::path_id("key", raw_key).map_err(|e| Answer::invalid(e.0))?;
    let drop = app.find_drop(raw_drop).await?;
    let mut reopened = false;
    let (config, reply, path) = loop {
        let config = drop.config();
        let turn = match route(app, &drop, &config) {
            Route::Gate => settle_gate(app, &drop, &config, &key, to).await,
            other => Turn::Reroute(other),
        };
        match turn {
            Turn::Done(reply) => break (config, reply, Path::Gate),
            Turn::Reroute(Route::Fallback(reason)) => {
                if let Some(reply) = settle_fallback(app, &drop, &config, &key, to, reason).await? {
                    break (config, reply, Path::Fallback);
                }
            }
            Turn::Reroute(Route::Refused(answer)) => return Err(answer),
            Turn::Reroute(Route::Gate) => {}
            Turn::Reopen { suspect } if !reopened => {
                reopened = true;
                reopen(app, &drop, suspect).await?;
            }
            Turn::Reopen { .. } => return Err(being_rebuilt(&drop)),
        }
    };
    // A reservation that no longer waits for its buyer frees its permit at once,
    // whichever call found it so (a look-up that expired it included).
    if matches!(
        reply.state.as_deref(),
        Some("confirmed" | "cancelled" | "expired")
    ) {
        drop.throttle.release(&key);
    }
    if path == Path::Gate && to.is_some() {
        record_settled(app, &drop, &config, &key, &reply).await?;
    }

    let name = &drop.name;
    let refused = |status, message: String| {
        Err(path.mark(
            reservation(status, &reply.outcome, &drop, &key, &reply, path).with("message", message),
        ))
    };
    match (to, reply.outcome.as_str()) {
        (_, "not_found") => Err(path.mark(Answer::refusal(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no reservation with key {key} in drop {name}"),
        ))),
        (_, "recording") => Err(Answer::unavailable(format!(
            "reservation {key} is still being recorded: nothing was changed; retry"
        ))
        .retry_after(RETRY_AFTER_SECONDS)),
        (_, "expired") => refused(
            StatusCode::CONFLICT,
            format!("reservation {key} expired and its units went back to stock"),
        ),
        // DESIGN.md has no word for it: `expired` (409), the message says which.
        (_, "gate_record_expired") => Err(path.mark(
            reservation(StatusCode::CONFLICT, "expired", &drop, &key, &reply, path).with(
                "message",
                format!(
                    "the gate's record of reservation {key} has expired (the ledger keeps it {}): it can no longer change",
                    reply.state.as_deref().unwrap_or("")
                ),
            ),
        )),
        (Some(State::Confirmed), "cancelled") => refused(
            StatusCode::CONFLICT,
            format!("reservation {key} was cancelled and cannot be confirmed"),
        ),
        (None, "found") => Ok(path.mark(reservation(
            StatusCode::OK,
            "found",
            &drop,
            &key,
            &reply,
            path,
        ))),
        (_, "confirmed" | "already_confirmed" | "cancelled" | "already_cancelled") => Ok(path
            .mark(reservation(
                StatusCode::OK,
                &reply.outcome,
                &drop,
                &key,
                &reply,
                path,
            ))),
        (_, other) => Err(Answer::unavailable(format!("the gate answered {other:?}"))),
    }
}

async fn settle_gate(
    app: &App,
    drop: &Drop,
    config: &DropConfig,
    key: &str,
    to: Option<State>,
) -> Turn<GateReply> {
    let mut conn = app.redis.clone();
    let reply = match to {
        Some(State::Confirmed) => gate::confirm(&mut conn, &drop.keys, key).await,
        Some(_) => gate::cancel(&mut conn, &drop.keys, key).await,
        None => gate::lookup(&mut conn, &drop.keys, key).await,
    };
    let reply = match reply {
        Ok(reply) => reply,
        Err(e) => return Turn::Reroute(after_redis_failure(app, drop, config, &e)),
    };
    app.redis_answered();
    if reply.outcome == "closed" {
        return Turn::Reopen { suspect: false };
    }
    record_expiry(app, drop, config, key, &reply).await;
    if reply.outcome != "not_found" {
        return Turn::Done(reply);
    }
    // Redis has no granted marker of this sale: an admission still being recorded,
    // or a marker that outlived its TTL. Answer from the ledger's record, moving no
    // unit: replaying it here would take its units a second time.
    match app.ledger.reservation(&drop.ledger_key(), key).await {
        Ok(Some(row)) => Turn::Done(from_ledger(row, to, reply.remaining)),
        _ => Turn::Done(reply),
    }
}

/// What the ledger's record says when Redis has no marker for the key.
fn from_ledger(row: Recorded, to: Option<State>, remaining: Option<i64>) -> GateReply {
    let outcome = match (to, row.state) {
        (None, _) => "found",
        (_, State::Active) if row.expires_at_ms > now_ms() => "recording",
        (_, State::Active | State::Expired) => "expired",
        (Some(State::Confirmed), State::Confirmed) => "already_confirmed",
        (Some(State::Cancelled), State::Cancelled) => "already_cancelled",
        (Some(State::Confirmed), State::Cancelled) => "cancelled",
        _ => "gate_record_expired",
    };
    GateReply {
        user: Some(row.user),
        quantity: Some(row.quantity),
        state: Some(row.state.as_str().into()),
        when: Some(row.expires_at_ms),
        remaining,
        ..GateReply::made(outcome)
    }
}

async fn settle_fallback(
    app: &App,
    drop: &Drop,
    config: &DropConfig,
    key: &str,
    to: Option<State>,
    reason: Reason,
) -> Result<Option<GateReply>, Answer> {
    let ledger_key = drop.ledger_key();
    on_fallback(app, drop, reason, || {
        app.ledger
            .fallback_settle(&ledger_key, config, key, to, now_ms())
    })
    .await
}

/// Records in the ledger what the Redis gate decided for a confirm or cancel (also
/// an `already_*` answer, which heals a record an earlier failure missed).
async fn record_settled(
    app: &App,
    drop: &Drop,
    config: &DropConfig,
    key: &str,
    reply: &GateReply,
) -> Result<(), Answer> {
    let state = match reply.outcome.as_str() {
        "confirmed" | "already_confirmed" => State::Confirmed,
        "cancelled" | "already_cancelled" => State::Cancelled,
        _ => return Ok(()),
    };
    if reply.epoch.is_none() {
        // Answered from the ledger's own record: nothing to record.
        return Ok(());
    }
    let change = change_of(drop, config, key, reply, state);
    let mut recorded = app.ledger.record(change.clone()).await;
    if matches!(recorded, Err(RecordError::NotAuthority { .. })) {
        // This ledger is behind the gate's epoch (it never joined it, or a peer
        // with a ledger of its own reopened the gate): join, then record.
        if handover::open_gate(app, drop, false).await == Opening::Open {
            recorded = app.ledger.record(change).await;
        }
    }
    match recorded {
        Ok(()) => Ok(()),
        Err(RecordError::KeyUsed { state: recorded }) => {
            // The ledger's record went elsewhere: its word stands, and Redis is
            // brought in line with it by the refresh's replay.
            replay_later(app, drop, &change_key(drop, reply), key).await;
            Err(Answer::refusal(
                StatusCode::CONFLICT,
                recorded.as_str(),
                format!(
                    "reservation {key} is {} in the ledger: it cannot be {}",
                    recorded.as_str(),
                    state.as_str()
                ),
            ))
        }
        Err(e) => Err(Answer::unavailable(format!(
            "Redis has the reservation {} but the ledger did not record it ({e}): retry",
            state.as_str()
        ))),
    }
}

/// Marks the ledger's record of `key` as one Redis has not seen, so that the
/// refresh replays it (best effort: a failure is logged, and the ledger's repair
/// and the next rebuild bring Redis in line too).
async fn replay_later(app: &App, drop: &Drop, ledger_key: &str, key: &str) {
    if let Err(error) = app.ledger.mark_unreplayed(ledger_key, key).await {
        tracing::warn!(drop = %drop.name, %error, "could not mark a record for replay");
    }
}

/// The ledger key a gate reply's change belongs to.
fn change_key(drop: &Drop, reply: &GateReply) -> String {
    reply
        .sale
        .as_deref()
        .map_or_else(|| drop.ledger_key(), |sale| drop.ledger_key_of(sale))
}

/// The answer for a reserve whose key the ledger already holds for a reservation
/// Redis no longer knows (its marker outlived its TTL): the ledger's word.
async fn from_ledger_record(app: &App, drop: &Drop, request: &Reserve) -> Result<Answer, Answer> {
    match app
        .ledger
        .reservation(&drop.ledger_key(), &request.key)
        .await
    {
        Ok(Some(row)) if row.user == request.user && row.quantity == request.quantity => {
            let reply = from_ledger(row, None, None);
            Ok(reservation(
                StatusCode::OK,
                "already_reserved",
                drop,
                &request.key,
                &reply,
                Path::Gate,
            ))
        }
        Ok(Some(_)) => Err(Answer::refusal(
            StatusCode::UNPROCESSABLE_ENTITY,
            "idempotency_key_reused",
            format!(
                "key {} was already used in drop {} for a different user or quantity",
                request.key, drop.name
            ),
        )),
        _ => Err(Answer::unavailable(format!(
            "the ledger holds another record of key {}: nothing was reserved; retry",
            request.key
        ))),
    }
}

/// An answer that shows the reservation.
fn reservation(
    status: StatusCode,
    outcome: &str,
    drop: &Drop,
    key: &str,
    reply: &GateReply,
    path: Path,
) -> Answer {
    Answer::new(status, outcome)
        .with("drop", drop.name.as_str())
        .with("key", key)
        .with("user", reply.user.as_deref().unwrap_or(""))
        .with("quantity", reply.quantity.unwrap_or(0))
        .with("state", reply.state.as_deref().unwrap_or(""))
        .with(
            "expiresAt",
            reply.when.map_or(serde_json::Value::Null, rfc3339),
        )
        .with("remaining", clamp(reply.remaining))
        .with(
            "path",
            match path {
                Path::Gate => "gate",
                Path::Fallback => "fallback",
            },
        )
}

/// `remaining` as reported: never below 0, even while a cut is being paid back.
fn clamp(remaining: Option<i64>) -> i64 {
    remaining.unwrap_or(0).max(0)
}
