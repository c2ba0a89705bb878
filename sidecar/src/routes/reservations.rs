//! `POST /v1/drops/{drop}/reservations` and the reservation's confirm, cancel and
//! look-up.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use warp::http::StatusCode;
use warp::reply::Response;

use super::finish;
use crate::answer::{Answer, rfc3339};
use crate::app::App;
use crate::drops::Drop;
use crate::gate::{self, GateReply};
use crate::input::{self, Reserve};

/// Seconds a throttled buyer is told to wait: permits free up as others confirm.
const RETRY_AFTER_SECONDS: u64 = 1;
/// How often a request re-reads a key whose admission another request holds pending.
const PENDING_POLL: Duration = Duration::from_millis(2);
/// Slack beyond the permit wait for that other request to activate or undo.
const PENDING_GRACE: Duration = Duration::from_millis(250);

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
    let answer = settle(&app, &drop, &key, Settle::Confirm)
        .await
        .unwrap_or_else(|refusal| refusal);
    finish(&app, "confirm", started, answer)
}

pub async fn cancel(drop: String, key: String, app: Arc<App>) -> Response {
    let started = Instant::now();
    let answer = settle(&app, &drop, &key, Settle::Cancel)
        .await
        .unwrap_or_else(|refusal| refusal);
    finish(&app, "cancel", started, answer)
}

pub async fn lookup(drop: String, key: String, app: Arc<App>) -> Response {
    let started = Instant::now();
    let answer = settle(&app, &drop, &key, Settle::Lookup)
        .await
        .unwrap_or_else(|refusal| refusal);
    finish(&app, "lookup", started, answer)
}

async fn admit(app: &App, raw_drop: &str, body: &[u8]) -> Result<Answer, Answer> {
    let request = Reserve::parse(body).map_err(|e| Answer::invalid(e.0))?;
    let drop = app.find_drop(raw_drop).await?;
    let mut conn = app.redis.clone();
    let attempt = format!("{:016x}", rand::random::<u64>());
    let config = drop.config();
    let permit_wait = Duration::from_millis(config.acquire_timeout_ms);
    // A duplicate of this key that is still waiting for its permit settles within
    // the permit wait; until then this request asks again rather than promise a
    // unit that may be undone.
    let settle_by = Instant::now() + permit_wait + PENDING_GRACE;
    let reply = loop {
        let reply = gate::reserve(
            &mut conn,
            &drop.keys,
            &request.key,
            &request.user,
            request.quantity,
            &attempt,
        )
        .await
        .map_err(|e| app.redis_down(&drop, &e))?;
        if reply.outcome != "pending" || Instant::now() >= settle_by {
            break reply;
        }
        tokio::time::sleep(PENDING_POLL).await;
    };
    let name = &drop.name;
    let conflict =
        |outcome: &str, message: String| Answer::refusal(StatusCode::CONFLICT, outcome, message);
    match reply.outcome.as_str() {
        "admitted" => {}
        "already_reserved" => {
            return Ok(reservation(
                StatusCode::OK,
                "already_reserved",
                &drop,
                &request.key,
                &reply,
            ));
        }
        "sold_out" => {
            return Err(conflict(
                "sold_out",
                format!(
                    "drop {name} is sold out: {} left, {} asked for",
                    clamp(reply.remaining),
                    request.quantity
                ),
            )
            .with("remaining", clamp(reply.remaining)));
        }
        "per_user_limit_exceeded" => {
            return Err(conflict(
                "per_user_limit_exceeded",
                format!(
                    "user {} already holds {} of the {} units one user may hold in drop {name}",
                    request.user,
                    reply.quantity.unwrap_or(0),
                    reply.when.unwrap_or(0)
                ),
            ));
        }
        "idempotency_key_reused" => {
            return Err(Answer::refusal(
                StatusCode::UNPROCESSABLE_ENTITY,
                "idempotency_key_reused",
                format!(
                    "key {} was already used in drop {name} for a different user or quantity",
                    request.key
                ),
            ));
        }
        "not_open" => {
            return Err(Answer::refusal(
                StatusCode::FORBIDDEN,
                "not_open",
                format!("drop {name} is not open yet"),
            )
            .with(
                "startsAt",
                reply.when.map_or(serde_json::Value::Null, rfc3339),
            ));
        }
        "ended" => {
            return Err(Answer::refusal(
                StatusCode::FORBIDDEN,
                "ended",
                format!("drop {name} has ended"),
            )
            .with(
                "endsAt",
                reply.when.map_or(serde_json::Value::Null, rfc3339),
            ));
        }
        "not_found" => return Err(app.unknown_drop(name)),
        "mode" => return Err(app.not_gated(&drop, reply.state.as_deref().unwrap_or(""))),
        "pending" => {
            return Err(throttled(
                &config,
                "another request with this key is still waiting for a permit",
            ));
        }
        other => return Err(Answer::unavailable(format!("the gate answered {other:?}"))),
    }

    let Some(permit) = drop.throttle.acquire(permit_wait).await else {
        return match gate::undo(&mut conn, &drop.keys, &request.key, &attempt).await {
            Ok(_) => Err(throttled(&config, "nothing was reserved")),
            Err(e) => Err(Answer::unavailable(format!(
                "no throttle permit was free and Redis failed while taking the admission back ({e}); it expires by itself: retry the same key"
            ))),
        };
    };
    let active = gate::activate(&mut conn, &drop.keys, &request.key, &attempt)
        .await
        .map_err(|e| app.redis_down(&drop, &e))?;
    if active.outcome != "admitted" {
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
    ))
}

/// 503 throttled with Retry-After: this sidecar's permits are all held by
/// unconfirmed reservations.
fn throttled(config: &dropgate_api::DropConfig, detail: &str) -> Answer {
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

#[derive(Clone, Copy)]
enum Settle {
    Confirm,
    Cancel,
    Lookup,
}

async fn settle(app: &App, raw_drop: &str, raw_key: &str, op: Settle) -> Result<Answer, Answer> {
    let key = input::path_id("key", raw_key).map_err(|e| Answer::invalid(e.0))?;
    let drop = app.find_drop(raw_drop).await?;
    let mut conn = app.redis.clone();
    let reply = match op {
        Settle::Confirm => gate::confirm(&mut conn, &drop.keys, &key).await,
        Settle::Cancel => gate::cancel(&mut conn, &drop.keys, &key).await,
        Settle::Lookup => gate::lookup(&mut conn, &drop.keys, &key).await,
    }
    .map_err(|e| app.redis_down(&drop, &e))?;

    let name = &drop.name;
    if matches!(
        reply.outcome.as_str(),
        "confirmed" | "cancelled" | "expired"
    ) && !matches!(op, Settle::Lookup)
    {
        drop.throttle.release(&key);
    }
    let refused = |status, message: String| {
        Err(reservation(status, &reply.outcome, &drop, &key, &reply).with("message", message))
    };
    match (op, reply.outcome.as_str()) {
        (_, "not_found") => Err(Answer::refusal(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no reservation with key {key} in drop {name}"),
        )),
        (_, "expired") => refused(
            StatusCode::CONFLICT,
            format!("reservation {key} expired and its units went back to stock"),
        ),
        (Settle::Confirm, "cancelled") => refused(
            StatusCode::CONFLICT,
            format!("reservation {key} was cancelled and cannot be confirmed"),
        ),
        (Settle::Lookup, "found") => Ok(reservation(StatusCode::OK, "found", &drop, &key, &reply)),
        (_, "confirmed" | "already_confirmed" | "cancelled" | "already_cancelled") => Ok(
            reservation(StatusCode::OK, &reply.outcome, &drop, &key, &reply),
        ),
        (_, other) => Err(Answer::unavailable(format!("the gate answered {other:?}"))),
    }
}

/// An answer that shows the reservation.
fn reservation(
    status: StatusCode,
    outcome: &str,
    drop: &Drop,
    key: &str,
    reply: &GateReply,
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
        .with("path", "gate")
}

/// `remaining` as reported: never below 0, even while a cut is being paid back.
fn clamp(remaining: Option<i64>) -> i64 {
    remaining.unwrap_or(0).max(0)
}
