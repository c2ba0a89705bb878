//! `GET /v1/drops/{drop}`: what a shop's page shows before the sale.

use std::sync::Arc;
use std::time::Instant;

use dropgate_api::{FailurePolicy, Mode};
use redis::AsyncCommands;
use warp::http::StatusCode;
use warp::reply::Response;

use super::finish;
use crate::answer::{Answer, rfc3339};
use crate::app::App;

pub async fn show(drop: String, app: Arc<App>) -> Response {
    let started = Instant::now();
    let answer = describe(&app, &drop)
        .await
        .unwrap_or_else(|refusal| refusal);
    finish(&app, "drop", started, answer)
}

async fn describe(app: &App, raw_drop: &str) -> Result<Answer, Answer> {
    let drop = app.find_drop(raw_drop).await?;
    let config = drop.config();
    // Whichever gate is in charge says what is left.
    let mut conn = app.redis.clone();
    let from_redis: redis::RedisResult<Option<i64>> = if config.mode == Mode::FailOpen {
        Err(redis::RedisError::from((
            redis::ErrorKind::Client,
            "off the gate",
        )))
    } else {
        conn.get(drop.keys.remaining()).await
    };
    let remaining = match from_redis {
        Ok(remaining) => remaining,
        Err(e) if config.mode == Mode::FailOpen || config.failure_policy == FailurePolicy::Open => {
            app.ledger
                .available(&drop.ledger_key())
                .await
                .map_err(|le| {
                    Answer::unavailable(format!(
                        "neither Redis ({e}) nor the ledger ({le}) answered"
                    ))
                })?
                .or(Some(config.limit))
        }
        Err(e) => return Err(app.redis_down(&drop, &e)),
    };
    let time = |ms: Option<i64>| ms.map_or(serde_json::Value::Null, rfc3339);
    Ok(Answer::new(StatusCode::OK, "found")
        .with("drop", drop.name.as_str())
        .with("namespace", app.drops.namespace())
        .with("sku", config.sku)
        .with("limit", config.limit)
        .with("remaining", remaining.unwrap_or(0).max(0))
        .with("mode", config.mode.as_str())
        .with("perUserLimit", config.per_user_limit)
        .with("holdSeconds", config.hold_seconds)
        .with("startsAt", time(config.starts_at_ms))
        .with("endsAt", time(config.ends_at_ms)))
}
