//! Serving the API until shutdown.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use dropgate_listener::{Limits, plain, warp_handler};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::answer::Answer;
use crate::app::App;
use crate::settings::Settings;
use crate::{Error, maintenance, routes};

/// The API's listener: loopback, the shop's own containers. Enough connections for
/// a busy app's pool; every one bounded in time and memory (about 12 KiB while it
/// waits for a head), so a runaway client holds at most ~12 MiB. Nothing is closed
/// for room before its head timeout: on an overloaded pod a connection whose
/// request is already sent can wait seconds to be read, and cutting it would lose
/// a buyer's request; past the cap, new connections wait in the accept queue, deep
/// enough for a rush of the app's new connections (thousands of buyers at once).
pub const API_LIMITS: Limits = Limits {
    max_connections: 1024,
    max_per_peer: usize::MAX,
    head_timeout: Duration::from_secs(10),
    body_timeout: Duration::from_secs(10),
    max_body: routes::MAX_BODY_BYTES,
    body_budget: 4 * 1024 * 1024,
    max_age: Duration::from_secs(600),
    evict_idle: false,
    evict_silent_after: Duration::from_secs(10),
    accept_queue: 4096,
};

/// The probe and scrape listener, reachable from outside the pod: few clients (the
/// kubelet, Prometheus), each address with a small share, so that no pod in the
/// cluster can take the kubelet's probes away or the sidecar's memory.
pub const HEALTH_LIMITS: Limits = Limits {
    max_connections: 128,
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

/// The listener's own refusals (a body too large or too slow), as API answers.
fn refuse(status: warp::http::StatusCode, message: String) -> warp::reply::Response {
    Answer::refusal(status, "invalid", message).into_response()
}

/// Serves the API on `listener` until `shutdown` completes, then lets in-flight
/// requests finish and stops the background work. Tests pass a listener bound to
/// port 0.
pub async fn run(
    listener: TcpListener,
    settings: Settings,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    settings.validate().map_err(Error::Settings)?;
    let app = Arc::new(App::new(&settings).await?);
    tracing::info!(
        listen = %listener.local_addr()?,
        namespace = %settings.namespace,
        redis = %dropgate_api::redact_url(&settings.redis_url),
        "serving"
    );
    if app.ledger.is_per_pod() {
        tracing::info!(
            "the ledger is per pod (SQLite): a sale is recorded by one ledger, so only one replica can sell it; several replicas of a shop need one PostgreSQL ledger (dropgate_sidecar_foreign_ledger says when another ledger holds a sale)"
        );
    }
    let (stop, stopped) = watch::channel(false);
    let health = match settings.health_listen {
        Some(addr) => {
            let health_listener = dropgate_listener::bind(addr, &HEALTH_LIMITS)?;
            tracing::info!(listen = %addr, "serving /healthz, /readyz and /metrics");
            let mut stopped = stopped.clone();
            Some(tokio::spawn(dropgate_listener::serve(
                health_listener,
                HEALTH_LIMITS,
                plain,
                warp_handler(routes::health_only(app.clone())),
                refuse,
                async move {
                    let _ = stopped.wait_for(|stop| *stop).await;
                },
            )))
        }
        None => None,
    };
    let background = tokio::spawn(maintenance::run(
        app.clone(),
        Duration::from_millis(settings.refresh_ms),
        Duration::from_millis(settings.sweep_ms),
        stopped,
    ));
    dropgate_listener::serve(
        listener,
        API_LIMITS,
        plain,
        warp_handler(routes::all(app)),
        refuse,
        shutdown,
    )
    .await;
    let _ = stop.send(true);
    let _ = background.await;
    if let Some(health) = health {
        let _ = health.await;
    }
    tracing::info!("stopped");
    Ok(())
}
