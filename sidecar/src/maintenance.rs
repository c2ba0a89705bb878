//! Background work: re-reading known drops' configs, and the hold sweeper.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::watch;

use crate::app::App;
use crate::gate;
use crate::metrics::DropLabel;

/// Due holds expired per drop per sweep; the rest wait for the next sweep.
const SWEEP_BATCH: isize = 256;

/// Runs until `stop` turns true.
pub async fn run(
    app: Arc<App>,
    refresh: Duration,
    sweep: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let mut refresh_tick = tokio::time::interval(refresh);
    let mut sweep_tick = tokio::time::interval(sweep);
    for tick in [&mut refresh_tick, &mut sweep_tick] {
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    }
    loop {
        tokio::select! {
            _ = refresh_tick.tick() => refresh_configs(&app).await,
            _ = sweep_tick.tick() => expire_due_holds(&app).await,
            _ = stop.changed() => return,
        }
    }
}

async fn refresh_configs(app: &App) {
    let mut conn = app.redis.clone();
    for drop in app.drops.all() {
        if let Err(error) = app.drops.refresh(&mut conn, &drop.name).await {
            tracing::debug!(drop = %drop.name, %error, "config refresh failed");
        }
    }
}

/// Expires holds past their deadline (returning their stock in the same atomic step)
/// and frees the permits of holds that expired, here or through another sidecar.
async fn expire_due_holds(app: &App) {
    let mut conn = app.redis.clone();
    let now = now_ms();
    for drop in app.drops.all() {
        match gate::due_holds(&mut conn, &drop.keys, now, SWEEP_BATCH).await {
            Ok(due) => {
                for key in due {
                    match gate::expire(&mut conn, &drop.keys, &key).await {
                        Ok(reply) if reply.outcome == "expired" => {
                            app.metrics.expired.inc();
                            drop.throttle.release(&key);
                        }
                        Ok(_) => {}
                        Err(error) => tracing::debug!(drop = %drop.name, %error, "expiry failed"),
                    }
                }
            }
            Err(error) => tracing::debug!(drop = %drop.name, %error, "sweep failed"),
        }
        drop.throttle.release_due(now);
        app.metrics
            .permits_in_use
            .get_or_create(&DropLabel {
                drop: drop.name.clone(),
            })
            .set(drop.throttle.in_use() as i64);
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
