//! `POST /v1/locks/{name}`, `POST /v1/locks/{name}/renew`, `DELETE /v1/locks/{name}`.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use dropgate_api::LockKeys;
use warp::http::StatusCode;
use warp::reply::Response;

use super::{Caller, LOCK_ACQUIRE, LOCK_RELEASE, LOCK_RENEW, served};
use crate::answer::{Answer, rfc3339};
use crate::app::App;
use crate::input::{self, Fields};
use crate::locks;

/// Longest lease and longest wait accepted, in ms.
const MAX_TTL_MS: i64 = 86_400_000;
const MAX_WAIT_MS: i64 = 60_000;

pub async fn acquire(
    name: String,
    caller: Caller,
    app: Arc<App>,
    body: Result<Bytes, Answer>,
) -> Response {
    served(&app, &LOCK_ACQUIRE, None, caller, async {
        match body {
            Ok(body) => take(&app, &name, &body).await,
            Err(refusal) => Err(refusal),
        }
        .unwrap_or_else(|refusal| refusal)
    })
    .await
}

pub async fn renew(
    name: String,
    caller: Caller,
    app: Arc<App>,
    body: Result<Bytes, Answer>,
) -> Response {
    served(&app, &LOCK_RENEW, None, caller, async {
        match body {
            Ok(body) => extend(&app, &name, &body).await,
            Err(refusal) => Err(refusal),
        }
        .unwrap_or_else(|refusal| refusal)
    })
    .await
}

pub async fn release(
    name: String,
    caller: Caller,
    app: Arc<App>,
    body: Result<Bytes, Answer>,
) -> Response {
    served(&app, &LOCK_RELEASE, None, caller, async {
        match body {
            Ok(body) => give_up(&app, &name, &body).await,
            Err(refusal) => Err(refusal),
        }
        .unwrap_or_else(|refusal| refusal)
    })
    .await
}

/// The lock's name from the path, checked, and its keys.
fn lock_of(app: &App, raw: &str) -> Result<(String, LockKeys, String), Answer> {
    let name = input::path_id("name", raw).map_err(|e| Answer::invalid(e.0))?;
    if !dropgate_api::keys::is_lock_name(&name) {
        return Err(Answer::invalid("`name` must not contain { or }"));
    }
    let namespace = app.drops.namespace();
    let keys = LockKeys::new(namespace, &name);
    let ledger_name = format!("{namespace}/{name}");
    Ok((name, keys, ledger_name))
}

async fn take(app: &App, raw: &str, body: &[u8]) -> Result<Answer, Answer> {
    let mut fields =
        Fields::parse(body, &["owner", "ttlMs", "waitMs"]).map_err(|e| Answer::invalid(e.0))?;
    let owner = fields.id("owner").map_err(|e| Answer::invalid(e.0))?;
    let ttl_ms = fields
        .int("ttlMs", 1, MAX_TTL_MS)
        .map_err(|e| Answer::invalid(e.0))?;
    let wait_ms = fields
        .int("waitMs", 0, MAX_WAIT_MS)
        .map_err(|e| Answer::invalid(e.0))?;
    let (name, keys, ledger_name) = lock_of(app, raw)?;
    let mut conn = app.redis.clone();
    let namespace = app.drops.namespace();
    match locks::note_name(&mut conn, namespace, &name, ttl_ms, app.max_lock_names).await {
        Ok(true) => {}
        Ok(false) => {
            return Err(Answer::refusal(
                StatusCode::TOO_MANY_REQUESTS,
                "too_many_locks",
                format!(
                    "namespace {namespace} has {} lock names in use (--max-lock-names): lock {name} is not taken until older names lapse, a day after their last lease",
                    app.max_lock_names
                ),
            ));
        }
        Err(e) => {
            return Err(Answer::unavailable(format!(
                "lock {name} cannot be taken: {e}"
            )));
        }
    }
    let wait = Duration::from_millis(u64::try_from(wait_ms).unwrap_or(0));
    let ledger = locks::FenceLedger {
        pool: app.ledger.pool(),
    };
    match locks::acquire(&mut conn, ledger, &keys, &ledger_name, ttl_ms, wait).await {
        Ok(Some(held)) => {
            tracing::debug!(lock = %name, %owner, fence = held.fence, "lock acquired");
            Ok(Answer::new(StatusCode::OK, "acquired")
                .with("lock", name)
                .with("owner", owner)
                .with("token", held.token)
                .with("fence", held.fence)
                .with("expiresAt", rfc3339(held.expires_at_ms)))
        }
        Ok(None) => Err(Answer::refusal(
            StatusCode::CONFLICT,
            "busy",
            format!("lock {name} is held by someone else and did not free within {wait_ms} ms"),
        )),
        Err(e) => Err(Answer::unavailable(format!(
            "lock {name} cannot be taken: {e}"
        ))),
    }
}

async fn extend(app: &App, raw: &str, body: &[u8]) -> Result<Answer, Answer> {
    let mut fields = Fields::parse(body, &["token", "ttlMs"]).map_err(|e| Answer::invalid(e.0))?;
    let token = fields.id("token").map_err(|e| Answer::invalid(e.0))?;
    let ttl_ms = fields
        .int("ttlMs", 1, MAX_TTL_MS)
        .map_err(|e| Answer::invalid(e.0))?;
    let (name, keys, _) = lock_of(app, raw)?;
    let mut conn = app.redis.clone();
    match locks::renew(&mut conn, &keys, &token, ttl_ms).await {
        Ok(Some(until)) => {
            // Its name stays in use past the new lease (never refused: it is in use).
            let namespace = app.drops.namespace();
            if let Err(error) =
                locks::note_name(&mut conn, namespace, &name, ttl_ms, u32::MAX).await
            {
                tracing::debug!(lock = %name, %error, "a renewed lock's name was not noted");
            }
            Ok(Answer::new(StatusCode::OK, "renewed")
                .with("lock", name)
                .with("expiresAt", rfc3339(until)))
        }
        Ok(None) => Err(Answer::refusal(
            StatusCode::CONFLICT,
            "lost",
            format!("lock {name} is no longer held with this token: its lease ran out"),
        )),
        Err(e) => Err(Answer::unavailable(format!(
            "lock {name} cannot be renewed: {e}"
        ))),
    }
}

async fn give_up(app: &App, raw: &str, body: &[u8]) -> Result<Answer, Answer> {
    let mut fields = Fields::parse(body, &["token"]).map_err(|e| Answer::invalid(e.0))?;
    let token = fields.id("token").map_err(|e| Answer::invalid(e.0))?;
    let (name, keys, _) = lock_of(app, raw)?;
    let mut conn = app.redis.clone();
    match locks::release(&mut conn, &keys, &token).await {
        Ok(true) => Ok(Answer::new(StatusCode::OK, "released").with("lock", name)),
        Ok(false) => Err(Answer::refusal(
            StatusCode::CONFLICT,
            "not_owner",
            format!("lock {name} is not held with this token; nothing was released"),
        )),
        Err(e) => Err(Answer::unavailable(format!(
            "lock {name} cannot be released: {e}"
        ))),
    }
}
