//! The admin port: `/metrics` for Prometheus, `/healthz` for the kubelet.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use dropgate_listener::{Limits, plain, warp_handler};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use warp::Filter;
use warp::http::StatusCode;

use crate::metrics::Metrics;

/// The admin port is reached by the kubelet and Prometheus: few clients, each
/// address with a small share of the connections, every one bounded in time.
const LIMITS: Limits = Limits {
    max_connections: 64,
    max_per_peer: 16,
    head_timeout: Duration::from_secs(5),
    body_timeout: Duration::from_secs(5),
    max_body: 1024,
    body_budget: 64 * 1024,
    max_age: Duration::from_secs(300),
    evict_idle: true,
    evict_silent_after: Duration::from_secs(1),
    accept_queue: 1024,
};

/// Binds the admin port: a port that cannot be bound stops the operator at start-up
/// rather than leave it running without `/healthz`.
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, String> {
    dropgate_listener::bind(addr, &LIMITS)
        .map_err(|e| format!("cannot listen on {addr} for /metrics and /healthz: {e}"))
}

/// Serves `/metrics` and `/healthz` on `listener` until `shutdown`.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>, shutdown: CancellationToken) {
    let healthz = warp::path!("healthz").map(|| text(StatusCode::OK, "text/plain", "ok".into()));
    let metrics = warp::path!("metrics").map(move || match metrics.encode() {
        Ok(body) => text(
            StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            body,
        ),
        Err(e) => text(
            StatusCode::INTERNAL_SERVER_ERROR,
            "text/plain",
            e.to_string(),
        ),
    });
    let routes = warp::get().and(healthz.or(metrics).unify()).boxed();
    dropgate_listener::serve(
        listener,
        LIMITS,
        plain,
        warp_handler(routes),
        |status, message| text(status, "text/plain", message),
        shutdown.cancelled_owned(),
    )
    .await;
}

fn text(status: StatusCode, content_type: &'static str, body: String) -> warp::reply::Response {
    let mut response = warp::reply::Reply::into_response(body);
    *response.status_mut() = status;
    if let Ok(value) = content_type.parse() {
        response.headers_mut().insert("content-type", value);
    }
    response
}
