//! `/healthz` (the process answers), `/readyz` (Redis answers), `/metrics`.

use std::sync::Arc;

use warp::http::{HeaderValue, StatusCode};
use warp::reply::Response;

use crate::answer::Answer;
use crate::app::App;

pub async fn live() -> Response {
    Answer::new(StatusCode::OK, "ok").into_response()
}

pub async fn ready(app: Arc<App>) -> Response {
    let mut conn = app.redis.clone();
    let answer = match redis::cmd("PING").query_async::<String>(&mut conn).await {
        Ok(_) => Answer::new(StatusCode::OK, "ready"),
        Err(e) => Answer::unavailable(format!("Redis does not answer: {e}")),
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
