//! `GET /v1/drops/{drop}`: what a shop's page shows before the sale.

use std::sync::Arc;

use warp::http::StatusCode;
use warp::reply::Response;

use super::{Caller, SHOW, failed, served};
use crate::answer::{Answer, rfc3339};
use crate::app::App;
use crate::input;
use crate::service;

pub async fn show(drop: String, caller: Caller, app: Arc<App>) -> Response {
    let answer = describe(&app, &drop);
    served(&app, &SHOW, Some(&drop), caller, answer).await
}

async fn describe(app: &App, raw_drop: &str) -> Answer {
    let name = match input::path_id("drop", raw_drop) {
        Ok(name) => name,
        Err(invalid) => return Answer::invalid(invalid.0),
    };
    let shown = match service::show(app, &name).await {
        Ok(shown) => shown,
        Err(failure) => return failed(app, failure),
    };
    let config = shown.config;
    let time = |ms: Option<i64>| ms.map_or(serde_json::Value::Null, rfc3339);
    let found = Answer::new(StatusCode::OK, "found");
    // A drop with variants shows each: its name, limit and what is left of it.
    let found = if shown.variants.is_empty() {
        found
    } else {
        let variants: Vec<serde_json::Value> = shown
            .variants
            .iter()
            .map(|(name, limit, left)| {
                serde_json::json!({"name": name, "limit": limit, "remaining": (*left).max(0)})
            })
            .collect();
        found.with("variants", variants)
    };
    found
        .with("drop", name.as_str())
        .with("namespace", app.drops.namespace())
        .with("sku", config.sku)
        .with("limit", config.limit)
        .with("remaining", shown.remaining.max(0))
        .with("mode", config.mode.as_str())
        .with("perUserLimit", config.per_user_limit)
        .with("holdSeconds", config.hold_seconds)
        .with("maxHoldSeconds", config.max_hold_seconds)
        .with("paused", config.paused)
        .with("startsAt", time(config.starts_at_ms))
        .with("endsAt", time(config.ends_at_ms))
}
