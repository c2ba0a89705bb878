//! `POST /v1/drops/{drop}/reservations` and the reservation's confirm, cancel and
//! look-up, on the Redis gate or, when the drop is off it, the ledger's fallback gate.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use dropgate_api::{DropConfig, FailurePolicy, Mode};
use warp::http::StatusCode;
use warp::reply::Response;

use super::finish;
use crate::answer::{Answer, rfc3339};
use crate::app::App;
use crate::drops::Drop;
use crate::faults::{self, Fault};
use crate::gate::{self, GateReply};
use crate::input::{self, Reserve};
use crate::ledger::{Change, State, now_ms};

/// Seconds a throttled buyer is told to wait: permits free up as others confirm.
const RETRY_AFTER_SECONDS: u64 = 1;
/// How often a request re-reads a key whose admission another request holds pending.
const PENDING_POLL: Duration = Duration::from_millis(2);
/// Slack beyond the permit wait for that other request to activate or undo.
const PENDING_GRACE: Duration = Duration::from_millis(250);

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

async fn admit(app: &App, raw_drop: &str, body: &[u8]) -> Result<Answer, Answer> {
    let request = Reserve::parse(body).map_err(|e| Answer::invalid(e.0))?;
    let drop = app.find_drop(raw_drop).await?;
    let config = drop.config();
    if config.mode == Mode::FailOpen {
        return admit_fallback(app, &drop, &config, &request).await;
    }
    if let Some(unreachable) = app.redis_breaker() {
        return match config.failure_policy {
            FailurePolicy::Open => admit_fallback(app, &drop, &config, &request).await,
            FailurePolicy::Closed => Err(app.redis_down(&drop, &unreachable)),
        };
    }
    app.replay(&drop).await;
    let mut conn = app.redis.clone();
    let attempt = format!("{:016x}", rand::random::<u64>());
    let permit_wait = Duration::from_millis(config.acquire_timeout_ms);
    // A duplicate of this key that is still waiting for its permit settles within
    // the permit wait; until then this request asks again rather than promise a
    // unit that may be undone.
    let settle_by = Instant::now() + permit_wait + PENDING_GRACE;
    let reply = loop {
        let reply = match gate::reserve(
            &mut conn,
            &drop.keys,
            &request.key,
            &request.user,
            request.quantity,
            &attempt,
        )
        .await
        {
            Ok(reply) => reply,
            Err(e) if config.failure_policy == FailurePolicy::Open => {
                app.redis_failed(&e);
                tracing::warn!(drop = %drop.name, error = %e, "Redis failed: fallback path");
                return admit_fallback(app, &drop, &config, &request).await;
            }
            Err(e) => {
                app.redis_failed(&e);
                return Err(app.redis_down(&drop, &e));
            }
        };
        if reply.outcome != "pending" || Instant::now() >= settle_by {
            break reply;
        }
        tokio::time::sleep(PENDING_POLL).await;
    };
    match reply.outcome.as_str() {
        "admitted" => {}
        "mode" if reply.state.as_deref() == Some("fail-open") => {
            return admit_fallback(app, &drop, &config, &request).await;
        }
        "mode" => return Err(app.not_gated(&drop, reply.state.as_deref().unwrap_or(""))),
        "pending" => {
            return Err(throttled(
                &config,
                "another request with this key is still waiting for a permit",
            ));
        }
        _ => return refused(app, &drop, &request, &reply, Path::Gate),
    }

    let Some(permit) = drop.throttle.acquire(permit_wait).await else {
        return match gate::undo(&mut conn, &drop.keys, &request.key, &attempt).await {
            Ok(_) => Err(throttled(&config, "nothing was reserved")),
            Err(e) => Err(Answer::unavailable(format!(
                "no throttle permit was free and Redis failed while taking the admission back ({e}); it expires by itself: retry the same key"
            ))),
        };
    };
    // A 201 means the admission is durable in the ledger: record it before the
    // reservation is activated, and take it back if that fails.
    let change = change_of(&drop, &config, &request.key, &reply, State::Active);
    let recorded = match faults::check(Fault::AfterRedisAdmit) {
        Ok(()) => app.ledger.record(change).await.map_err(|e| e.to_string()),
        Err(injected) => Err(injected.to_string()),
    };
    if let Err(error) = recorded {
        drop_permit(permit);
        let undone = gate::undo(&mut conn, &drop.keys, &request.key, &attempt).await;
        tracing::warn!(drop = %drop.name, %error, undone = undone.is_ok(), "ledger write failed");
        return Err(Answer::unavailable(format!(
            "the ledger could not record the reservation ({error}); nothing was reserved: retry the same key"
        )));
    }
    let active = gate::activate(&mut conn, &drop.keys, &request.key, &attempt)
        .await
        .map_err(|e| app.redis_down(&drop, &e))?;
    if active.outcome != "admitted" {
        // Redis expired it (and returned its units) while the ledger recorded it:
        // record the expiry too, so that the two agree.
        let expired = change_of(&drop, &config, &request.key, &active, State::Expired);
        if let Err(error) = app.ledger.record(expired).await {
            tracing::warn!(drop = %drop.name, %error, "expiry not recorded in the ledger");
        }
        return Err(throttled(&config, "the admission expired while it waited"));
    }
    drop.throttle
        .hold(&request.key, permit, active.when.unwrap_or(0));
    Ok(reservation(
        StatusCode::CREATED,
        "admitted",
        &drop,
        &request.key,
        &active,
        Path::Gate,
    ))
}

fn drop_permit(permit: tokio::sync::OwnedSemaphorePermit) {
    std::mem::drop(permit);
}

/// Reserve on the ledger's gate: same checks, same answers.
async fn admit_fallback(
    app: &App,
    drop: &Drop,
    config: &DropConfig,
    request: &Reserve,
) -> Result<Answer, Answer> {
    let now = now_ms();
    if config.starts_at_ms.is_some_and(|start| now < start) {
        let reply = window_reply("not_open", config.starts_at_ms);
        return refused(app, drop, request, &reply, Path::Fallback);
    }
    if config.ends_at_ms.is_some_and(|end| now >= end) {
        let reply = window_reply("ended", config.ends_at_ms);
        return refused(app, drop, request, &reply, Path::Fallback);
    }
    // The permit comes first here: a ledger admission cannot be taken back as if it
    // never happened once its event may have been published, so one that finds no
    // permit never starts.
    let wait = Duration::from_millis(config.acquire_timeout_ms);
    let Some(permit) = drop.throttle.acquire(wait).await else {
        return Err(throttled(config, "nothing was reserved").via_fallback());
    };
    let reply = app
        .ledger
        .fallback_reserve(
            &drop.ledger_key(),
            config,
            &request.key,
            &request.user,
            request.quantity,
            now,
        )
        .await
        .map_err(|e| ledger_failed(drop, &e))?;
    drop.needs_replay.store(true, Ordering::Relaxed);
    if reply.outcome == "admitted" {
        drop.throttle
            .hold(&request.key, permit, reply.when.unwrap_or(0));
        return Ok(reservation(
            StatusCode::CREATED,
            "admitted",
            drop,
            &request.key,
            &reply,
            Path::Fallback,
        )
        .via_fallback());
    }
    refused(app, drop, request, &reply, Path::Fallback)
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
        outcome: outcome.into(),
        user: None,
        quantity: None,
        state: None,
        when,
        remaining: None,
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
    let config = drop.config();
    let (reply, path) = if config.mode == Mode::FailOpen {
        (
            settle_fallback(app, &drop, &config, &key, to).await?,
            Path::Fallback,
        )
    } else {
        let gated = match app.redis_breaker() {
            Some(unreachable) => Err(unreachable),
            None => settle_gate(app, &drop, &config, &key, to).await,
        };
        match gated {
            Ok(reply) => (reply, Path::Gate),
            Err(e) if config.failure_policy == FailurePolicy::Open => {
                app.redis_failed(&e);
                tracing::warn!(drop = %drop.name, error = %e, "Redis failed: fallback path");
                (
                    settle_fallback(app, &drop, &config, &key, to).await?,
                    Path::Fallback,
                )
            }
            Err(e) => {
                app.redis_failed(&e);
                return Err(app.redis_down(&drop, &e));
            }
        }
    };
    if matches!(
        reply.outcome.as_str(),
        "confirmed" | "cancelled" | "expired"
    ) && to.is_some()
    {
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
        (_, "expired") => refused(
            StatusCode::CONFLICT,
            format!("reservation {key} expired and its units went back to stock"),
        ),
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
) -> redis::RedisResult<GateReply> {
    let mut conn = app.redis.clone();
    let run = |mut conn: redis::aio::ConnectionManager| async move {
        match to {
            Some(State::Confirmed) => gate::confirm(&mut conn, &drop.keys, key).await,
            Some(_) => gate::cancel(&mut conn, &drop.keys, key).await,
            None => gate::lookup(&mut conn, &drop.keys, key).await,
        }
    };
    app.replay(drop).await;
    let reply = run(conn.clone()).await?;
    if reply.outcome != "not_found" {
        return Ok(reply);
    }
    // Perhaps admitted on another sidecar's fallback path and not replayed yet.
    match app.ledger.reservation(&drop.ledger_key(), key).await {
        Ok(Some(row)) => {
            gate::replay(
                &mut conn,
                &drop.keys,
                key,
                &row.user,
                row.quantity,
                row.state.as_str(),
                row.expires_at_ms,
            )
            .await?;
            let _ = app
                .ledger
                .mark_replayed(&drop.ledger_key(), key, row.state)
                .await;
            let _ = config;
            run(conn).await
        }
        _ => Ok(reply),
    }
}

async fn settle_fallback(
    app: &App,
    drop: &Drop,
    config: &DropConfig,
    key: &str,
    to: Option<State>,
) -> Result<GateReply, Answer> {
    let reply = app
        .ledger
        .fallback_settle(&drop.ledger_key(), config, key, to, now_ms())
        .await
        .map_err(|e| ledger_failed(drop, &e))?;
    drop.needs_replay.store(true, Ordering::Relaxed);
    Ok(reply)
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
        "expired" => State::Expired,
        _ => return Ok(()),
    };
    app.ledger
        .record(change_of(drop, config, key, reply, state))
        .await
        .map_err(|e| {
            Answer::unavailable(format!(
                "Redis has the reservation {} but the ledger could not record it ({e}): retry",
                state.as_str()
            ))
        })
}

pub fn change_of(
    drop: &Drop,
    config: &DropConfig,
    key: &str,
    reply: &GateReply,
    state: State,
) -> Change {
    Change {
        drop_key: drop.ledger_key(),
        limit: config.limit,
        key: key.to_string(),
        user: reply.user.clone().unwrap_or_default(),
        quantity: reply.quantity.unwrap_or(0),
        state,
        expires_at_ms: reply.when.unwrap_or(0),
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
