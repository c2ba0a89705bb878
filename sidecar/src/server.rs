//! Serving the API until shutdown.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::app::App;
use crate::settings::Settings;
use crate::{Error, maintenance, routes};

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
            "the ledger is per pod (SQLite): fine for one replica; several replicas of a shop need one PostgreSQL ledger (a warning and dropgate_sidecar_per_pod_ledger_peers say when others sell the same drop)"
        );
    }
    let (stop, stopped) = watch::channel(false);
    let health = match settings.health_listen {
        Some(addr) => {
            let health_listener = TcpListener::bind(addr).await?;
            tracing::info!(listen = %addr, "serving /healthz, /readyz and /metrics");
            let mut stopped = stopped.clone();
            Some(tokio::spawn(
                warp::serve(routes::health_only(app.clone()))
                    .incoming(health_listener)
                    .graceful(async move {
                        let _ = stopped.wait_for(|stop| *stop).await;
                    })
                    .run(),
            ))
        }
        None => None,
    };
    let background = tokio::spawn(maintenance::run(
        app.clone(),
        Duration::from_millis(settings.refresh_ms),
        Duration::from_millis(settings.sweep_ms),
        stopped,
    ));
    warp::serve(routes::all(app))
        .incoming(listener)
        .graceful(shutdown)
        .run()
        .await;
    let _ = stop.send(true);
    let _ = background.await;
    if let Some(health) = health {
        let _ = health.await;
    }
    tracing::info!("stopped");
    Ok(())
}
