//! Background work: re-reading known drops' configs (and keeping each drop with its
//! authority), the hold sweepers, and the outbox dispatcher.

use std::sync::Arc;
use std::time::Duration;

use dropgate_api::Mode;

use tokio::sync::watch;

use crate::app::App;
use crate::clock::now_ms;
use crate::gate;
use crate::handover::{self, Reason};
use crate::ledger::Holder;
use crate::metrics::DropLabel;
use crate::record::record_expiry;

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

/// Re-reads known drops' configs and keeps each drop with its authority: for a
/// drop on the gate, checks that Redis is in line with the ledger (rebuilding it
/// when it is behind) and replays what it has not seen; for a drop the operator
/// put on the fallback, hands it to the ledger (closing the gate in Redis) without
/// waiting for a request.
async fn refresh_configs(app: &App) {
    let mut conn = app.redis.clone();
    let reached = match redis::cmd("PING").query_async::<String>(&mut conn).await {
        Ok(_) => {
            app.redis_answered();
            true
        }
        Err(error) => {
            app.redis_failed(&error);
            false
        }
    };
    for drop in app.drops.all() {
        if let Err(error) = app.drops.refresh(&mut conn, &drop.name).await {
            tracing::debug!(drop = %drop.name, %error, "config refresh failed");
            continue;
        }
        if !reached {
            continue;
        }
        let checked = match drop.config().mode {
            Mode::Gate => handover::check(app, &drop).await,
            Mode::FailOpen => handover::hand_to_ledger(app, &drop, Reason::Mode)
                .await
                .map(|_| ())
                .map_err(|refusal| format!("{refusal:?}")),
            Mode::Closed => Ok(()),
        };
        if let Err(error) = checked {
            tracing::debug!(drop = %drop.name, %error, "authority check failed");
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
/// Redis while the gate is, the ledger while its fallback gate is — returning their
/// stock in the same atomic step and recording the expiry; frees the permits of
/// holds that expired, here or through another sidecar. On the gate, holds the
/// ledger still has active well past their deadline (Redis never reported their
/// expiry: a record that failed, a Redis that lost them) are expired in the ledger
/// too, and the refresh replays that into Redis.
async fn expire_due_holds(app: &App) {
    let mut conn = app.redis.clone();
    let now = now_ms();
    for drop in app.drops.all() {
        let config = drop.config();
        let ledger_decides = matches!(
            app.ledger.authority(&drop.ledger_key()).await,
            Ok(Some(authority)) if authority.holder == Holder::Ledger
        );
        if !ledger_decides && config.mode == Mode::Gate {
            match gate::due_holds(&mut conn, &drop.keys, now, SWEEP_BATCH).await {
                Ok(due) => {
                    for key in due {
                        match gate::expire(&mut conn, &drop.keys, &key).await {
                            Ok(reply) => record_expiry(app, &drop, &config, &key, &reply).await,
                            Err(error) => {
                                tracing::debug!(drop = %drop.name, %error, "expiry failed")
                            }
                        }
                    }
                }
                Err(error) => tracing::debug!(drop = %drop.name, %error, "sweep failed"),
            }
        }
        let due = if ledger_decides {
            now
        } else {
            now - LEDGER_REPAIR_GRACE_MS
        };
        match app
            .ledger
            .expire_due(&drop.ledger_key(), &config, due, SWEEP_BATCH as i64)
            .await
        {
            Ok(expired) => {
                for key in &expired {
                    app.metrics.expired.inc();
                    drop.throttle.release(key);
                }
            }
            Err(error) => tracing::debug!(drop = %drop.name, %error, "ledger sweep failed"),
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

/// How long past its deadline a hold the ledger has active waits for Redis to report
/// its expiry before the ledger expires it itself.
const LEDGER_REPAIR_GRACE_MS: i64 = 30_000;
