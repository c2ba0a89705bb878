//! Background work: re-reading known drops' configs (and replaying fallback changes
//! into Redis), the hold sweepers, and the outbox dispatcher.

use std::sync::Arc;
use std::time::Duration;

use dropgate_api::Mode;

use tokio::sync::watch;

use crate::app::App;
use crate::gate;
use crate::ledger::{State, now_ms};
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
    let mut dispatch_tick = tokio::time::interval(DISPATCH_EVERY);
    for tick in [&mut refresh_tick, &mut sweep_tick, &mut dispatch_tick] {
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    }
    loop {
        tokio::select! {
            _ = refresh_tick.tick() => refresh_configs(&app).await,
            _ = sweep_tick.tick() => expire_due_holds(&app).await,
            _ = dispatch_tick.tick() => dispatch_events(&app).await,
            _ = stop.changed() => return,
        }
    }
}

/// How often pending outbox events are published.
const DISPATCH_EVERY: Duration = Duration::from_millis(100);
/// Events published per round.
const DISPATCH_BATCH: i64 = 512;

/// Re-reads known drops' configs; for drops on the gate, replays what the fallback
/// path changed (also another sidecar's, with a shared PostgreSQL ledger).
async fn refresh_configs(app: &App) {
    let mut conn = app.redis.clone();
    match redis::cmd("PING").query_async::<String>(&mut conn).await {
        Ok(_) => app.redis_answered(),
        Err(error) => app.redis_failed(&error),
    }
    for drop in app.drops.all() {
        if let Err(error) = app.drops.refresh(&mut conn, &drop.name).await {
            tracing::debug!(drop = %drop.name, %error, "config refresh failed");
            continue;
        }
        if drop.config().mode == Mode::Gate {
            drop.needs_replay
                .store(true, std::sync::atomic::Ordering::Relaxed);
            app.replay(&drop).await;
        }
    }
}

async fn dispatch_events(app: &App) {
    let mut conn = app.redis.clone();
    if let Err(error) =
        crate::ledger::outbox::dispatch(app.ledger.pool(), &mut conn, DISPATCH_BATCH).await
    {
        tracing::debug!(%error, "outbox dispatch failed; events stay pending");
    }
}

/// Expires holds past their deadline in the store that is in charge of the drop —
/// Redis for drops on the gate, the ledger otherwise — returning their stock in the
/// same atomic step and recording the expiry; frees the permits of holds that
/// expired, here or through another sidecar.
async fn expire_due_holds(app: &App) {
    let mut conn = app.redis.clone();
    let now = now_ms();
    for drop in app.drops.all() {
        let config = drop.config();
        let on_gate = config.mode == Mode::Gate;
        let due = if on_gate {
            gate::due_holds(&mut conn, &drop.keys, now, SWEEP_BATCH).await
        } else {
            Ok(Vec::new())
        };
        let redis_failed = due.is_err();
        match due {
            Ok(due) => {
                for key in due {
                    match gate::expire(&mut conn, &drop.keys, &key).await {
                        Ok(reply) if reply.outcome == "expired" => {
                            app.metrics.expired.inc();
                            drop.throttle.release(&key);
                            let change = crate::routes::change_of(
                                &drop,
                                &config,
                                &key,
                                &reply,
                                State::Expired,
                            );
                            if let Err(error) = app.ledger.record(change).await {
                                tracing::warn!(drop = %drop.name, %error, "expiry not recorded in the ledger");
                            }
                        }
                        Ok(_) => {}
                        Err(error) => tracing::debug!(drop = %drop.name, %error, "expiry failed"),
                    }
                }
            }
            Err(error) => tracing::debug!(drop = %drop.name, %error, "sweep failed"),
        }
        // Redis could not be swept: under failure policy Open the ledger is in charge.
        if !on_gate || redis_failed {
            match app
                .ledger
                .expire_due(&drop.ledger_key(), config.limit, now, SWEEP_BATCH as i64)
                .await
            {
                Ok(expired) => {
                    for key in &expired {
                        app.metrics.expired.inc();
                        drop.throttle.release(key);
                    }
                    if !expired.is_empty() {
                        drop.needs_replay
                            .store(true, std::sync::atomic::Ordering::Relaxed);
                    }
                }
                Err(error) => tracing::debug!(drop = %drop.name, %error, "ledger sweep failed"),
            }
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
