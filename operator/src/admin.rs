//! The admin port: `/metrics` for Prometheus, `/healthz` for the kubelet.

use std::net::SocketAddr;
use std::sync::Arc;

use warp::Filter;
use warp::http::StatusCode;

use crate::metrics::Metrics;

pub async fn serve(addr: SocketAddr, metrics: Arc<Metrics>) {
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
    warp::serve(warp::get().and(healthz.or(metrics).unify()))
        .run(addr)
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
