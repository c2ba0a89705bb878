//! `/healthz` (the process answers), `/readyz` (the ledger answers), `/metrics`.

use std::sync::Arc;

use warp::http::{HeaderValue, StatusCode};
use warp::reply::Response;

use crate::answer::Answer;
use crate::app::App;

pub async fn live() -> Response {
    Answer::new(StatusCode::OK, "ok").into_response()
}

/// Ready when the sidecar can answer: its ledger answers. Redis is reported, not
/// required: a Redis outage must not pull the shop's pods out of their Service,
/// since drops with failurePolicy Open sell on through the ledger and the rest say
/// `unavailable` themselves.
pub async fn ready(app: Arc<App>) -> Response {
    let mut conn = app.redis.clone();
    // Bounded well inside a probe's timeout: the answer reports Redis, it does not
    // wait for it.
    let ping = redis::cmd("PING");
    let ping = ping.query_async::<String>(&mut conn);
    let redis = match tokio::time::timeout(std::time::Duration::from_millis(300), ping).await {
        Ok(Ok(_)) => "ok".to_string(),
        Ok(Err(e)) => format!("unreachable: {e}"),
        Err(_) => "unreachable: no answer within 300ms".to_string(),
    };
    let answer = match sqlx::query("SELECT 1").execute(app.ledger.pool()).await {
        Ok(_) => Answer::new(StatusCode::OK, "ready").with("redis", redis),
        Err(e) => {
            Answer::unavailable(format!("the ledger does not answer: {e}")).with("redis", redis)
        }
    };
    answer.into_response()
}

pub async fn metrics(app: Arc<App>) -> Response {
    match app.metrics.encode() {
        Ok(text) => {
            let mut response = warp::reply::Reply::into_response(text);
            response.headers_mut().insert(
                "content-type",
                HeaderValue::from_static(
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                ),
            );
            response
        }
        Err(e) => Answer::unavailable(format!("metrics could not be encoded: {e}")).into_response(),
    }
}
