//! Background work: re-reading known drops' configs (and keeping each drop with its
//! authority), the hold sweepers, and the outbox dispatcher.

use std::sync::Arc;
use std::time::Duration;

use dropgate_api::{DropConfig, Mode};

use tokio::sync::watch;

use crate::app::App;
use crate::clock::now_ms;
use crate::gate::{self, PendingAdmission, Unresolved};
use crate::ledger::Holder;
use crate::metrics::DropLabel;
use crate::reservation::{Outcome, State};
use crate::service::handover::{self, Reason};
use crate::service::record::{change_of, record_expiry, record_from_redis};
use crate::service::{self, admit};

/// Due holds expired per drop per sweep; the rest wait for the next sweep.
const SWEEP_BATCH: isize = 256;

/// How long one sweep of a drop spends resolving overdue changes before it moves on
/// (a ledger that cannot be asked makes each resolution wait for its pool).
const RESOLVE_BUDGET: std::time::Duration = std::time::Duration::from_secs(2);

/// How long a change whose resolution failed waits before the sweeper tries it
/// again (a retry of its key resolves it at once).
const RETRY_RESOLVING_MS: i64 = 1_000;

/// Runs until `stop` turns true.
pub async fn run(
    app: Arc<App>,
    refresh: Duration,
    sweep: Duration,
    mut stop: watch::Receiver<bool>,
) {
    // Carts are swept on a task of their own: a ledger that is slow to answer the
    // carts' query must not hold up expiries or the outbox.
    let carts = tokio::spawn(sweep_carts(
        app.clone(),
        sweep.max(CART_SWEEP_MIN),
        stop.clone(),
    ));
    let mut refresh_tick = tokio::time::interval(refresh);
    let mut sweep_tick = tokio::time::interval(sweep);
    let mut dispatch_tick = tokio::time::interval(DISPATCH_EVERY);
    let mut prune_tick = tokio::time::interval(PRUNE_EVERY);
    for tick in [
        &mut refresh_tick,
        &mut sweep_tick,
        &mut dispatch_tick,
        &mut prune_tick,
    ] {
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    }
    loop {
        tokio::select! {
            _ = refresh_tick.tick() => {
                refresh_configs(&app).await;
                note_outbox_lag(&app).await;
            }
            _ = sweep_tick.tick() => expire_due_holds(&app).await,
            _ = app.units_back.notified() => {
                // A moment for the burst to land (a rush of cancels is one pass),
                // and a bound on how often an offer that cannot be made (no permit
                // free, its undo ringing again) is tried.
                tokio::time::sleep(UNITS_BACK_PAUSE).await;
                offer_units_back(&app).await;
            }
            _ = dispatch_tick.tick() => dispatch_events(&app).await,
            _ = prune_tick.tick() => {
                prune_lock_fences(&app).await;
                forget_what_is_over(&app).await;
            }
            _ = stop.changed() => {
                let _ = carts.await;
                return;
            }
        }
    }
}

/// How long the offers of returned units wait for more of them.
const UNITS_BACK_PAUSE: Duration = Duration::from_millis(20);

/// How often the ledger forgets the fences of locks long unused.
const PRUNE_EVERY: Duration = Duration::from_secs(3600);
/// How long a lock's fence is kept after it was last taken: past its longest lease
/// (a day) and the day its fence key outlives that in Redis.
const FENCE_KEPT_MS: i64 = 2 * 86_400_000;

/// Forgets the ledger's fences of locks not taken for [`FENCE_KEPT_MS`].
async fn prune_lock_fences(app: &App) {
    match crate::ledger::fences::prune(app.ledger.pool(), now_ms() - FENCE_KEPT_MS).await {
        Ok(0) => {}
        Ok(pruned) => tracing::debug!(pruned, "fences of locks long unused forgotten"),
        Err(error) => tracing::debug!(%error, "lock fences not pruned"),
    }
}

/// Retention (`--ledger-retention`): the ledger forgets the sales over for longer
/// than it, and each known drop's event stream the entries older than it that
/// every consumer group acknowledged (see [`crate::ledger::retention`]).
async fn forget_what_is_over(app: &App) {
    let before = now_ms().saturating_sub(app.retention_ms);
    match crate::ledger::retention::prune(app.ledger.pool(), before).await {
        Ok(pruned) if pruned.rows > 0 => {
            tracing::info!(
                sales = pruned.sales,
                rows = pruned.rows,
                "ledger rows of sales over for longer than the retention forgotten"
            );
        }
        Ok(_) => {}
        Err(error) => tracing::warn!(%error, "ledger retention: nothing pruned this round"),
    }
    let mut conn = app.redis.clone();
    for drop in app.drops.all() {
        match crate::ledger::retention::trim_stream(&mut conn, &drop.keys.events(), before).await {
            Ok(0) => {}
            Ok(trimmed) => {
                tracing::debug!(drop = %drop.name, trimmed, "events read by every consumer group trimmed")
            }
            Err(error) => tracing::debug!(drop = %drop.name, %error, "event stream not trimmed"),
        }
    }
}

/// The cart sweeper's pace, at the quickest: a cart is overdue after seconds.
const CART_SWEEP_MIN: Duration = Duration::from_millis(500);

/// Gives back carts left unfinished and expires held ones (see
/// [`crate::service::cart::sweep`]) every `every`, until `stop` turns true.
async fn sweep_carts(app: Arc<App>, every: Duration, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => crate::service::cart::sweep(&app).await,
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
    // TIME rather than PING: the answer also keeps the sidecar's clock on Redis's.
    let sent = crate::clock::local_ms();
    let reached = match redis::cmd("TIME")
        .query_async::<(String, String)>(&mut conn)
        .await
    {
        Ok((seconds, micros)) => {
            if let (Ok(seconds), Ok(micros)) = (seconds.parse::<i64>(), micros.parse::<i64>()) {
                crate::clock::observe_redis(
                    seconds * 1000 + micros / 1000,
                    sent,
                    crate::clock::local_ms(),
                );
            }
            app.breaker(None).answered();
            true
        }
        Err(error) => {
            app.breaker(None).failed(&error);
            false
        }
    };
    app.metrics.redis_up.set(i64::from(reached));
    let drops = app.drops.all();
    for drop in &drops {
        // On a cluster, a drop whose shard just failed waits for the next round:
        // its calls would only wait out timeouts that delay every other drop.
        if app.redis.is_cluster() && app.breaker(Some(drop)).tripped().is_some() {
            continue;
        }
        // On a cluster this read reached the drop's own shard: its breaker learns
        // from it (on one Redis, TIME above already said).
        let sale_before = drop.ledger_key();
        let refreshed = app.drops.refresh(&mut conn, &drop.name).await;
        // Redis says the sale is over: the drop deleted (the refresh forgot it on
        // the deletion tombstone) or its config naming a new sale; noted below
        // with those any other refresh found.
        let over = match &refreshed {
            Ok(None) => true,
            Ok(Some(now)) => now.ledger_key() != sale_before,
            Err(_) => false,
        };
        if let Err(error) = refreshed {
            tracing::debug!(drop = %drop.name, %error, "config refresh failed");
            if let (true, crate::drops::LookupError::Unavailable(unreachable)) =
                (app.redis.is_cluster(), &error)
            {
                app.breaker(Some(drop)).failed(unreachable);
            }
            continue;
        }
        if over {
            continue;
        }
        if app.redis.is_cluster() {
            app.breaker(Some(drop)).answered();
        }
        // On a cluster TIME went to some node; this drop's shard answered the
        // refresh just now, which is what its checks need.
        if !reached && !app.redis.is_cluster() {
            continue;
        }
        let checked = match drop.config().mode {
            Mode::Gate => handover::check(app, drop)
                .await
                .map_err(|error| tracing::debug!(drop = %drop.name, %error, "authority check failed")),
            Mode::FailOpen => handover::hand_to_ledger(app, drop, Reason::Mode)
                .await
                .map(|_| ())
                .map_err(|refusal| tracing::debug!(drop = %drop.name, ?refusal, "hand-over to the ledger refused")),
            Mode::Closed => Ok(()),
        };
        let _ = checked;
    }
    note_sales_over(app).await;
    if reached {
        note_drops(app, &drops).await;
    }
}

/// Notes in the ledger the sales a refresh found over, whichever path refreshed
/// (a request or a gate opening may see the deletion before this task does); a
/// note that fails is tried again next round.
async fn note_sales_over(app: &App) {
    let mut failed = Vec::new();
    for sale in app.drops.take_over() {
        if let Err(error) =
            crate::ledger::retention::note_ended(app.ledger.pool(), &sale, now_ms()).await
        {
            tracing::warn!(%sale, %error, "a sale's end not noted yet: tried again next round");
            failed.push(sale);
        }
    }
    app.drops.give_back_over(failed);
}

/// The drops' modes and what they have left, for `/metrics`: Redis's count (all
/// of them in one MGET, so that a thousand drops cost one round trip) unless the
/// ledger's fallback decides the drop, then the ledger's.
async fn note_drops(app: &App, drops: &[std::sync::Arc<crate::drops::Drop>]) {
    let mut on_redis = Vec::new();
    for drop in drops {
        let config = drop.config();
        app.metrics.set_mode(&drop.name, config.mode);
        match config.mode {
            Mode::FailOpen => {
                if let Ok(left) = app.ledger.available(&drop.ledger_key()).await {
                    set_remaining(app, drop, left.unwrap_or(config.limit));
                }
            }
            Mode::Gate | Mode::Closed => on_redis.push(drop),
        }
    }
    if on_redis.is_empty() {
        return;
    }
    let mut mget = redis::cmd("MGET");
    for drop in &on_redis {
        mget.arg(drop.keys.remaining());
    }
    let mut conn = app.redis.clone();
    match mget.query_async::<Vec<Option<i64>>>(&mut conn).await {
        Ok(counts) => {
            for (drop, left) in on_redis.into_iter().zip(counts) {
                set_remaining(app, drop, left.unwrap_or(0));
            }
        }
        Err(error) => tracing::debug!(%error, "remaining not read for /metrics"),
    }
}

fn set_remaining(app: &App, drop: &crate::drops::Drop, remaining: i64) {
    let label = DropLabel {
        drop: drop.name.clone(),
    };
    app.metrics.remaining.get_or_create(&label).set(remaining);
    // Its series from 0, so that the first refusal is an increase an alert sees.
    let _ = app.metrics.decided_on_lost_config.get_or_create(&label);
}

/// How far the outbox is behind, for `/metrics`.
async fn note_outbox_lag(app: &App) {
    match crate::ledger::outbox::oldest_unsent_ms(app.ledger.pool()).await {
        Ok(oldest) => {
            let lag = oldest.map_or(0.0, |at| (now_ms() - at).max(0) as f64 / 1000.0);
            app.metrics.outbox_lag.set(lag);
        }
        Err(error) => tracing::debug!(%error, "outbox lag not read"),
    }
}

async fn dispatch_events(app: &App) {
    let mut conn = app.redis.clone();
    if let Err(error) = crate::ledger::outbox::dispatch(
        app.ledger.pool(),
        !app.ledger.is_per_pod(),
        &mut conn,
        &app.sidecar_id,
        DISPATCH_BATCH,
    )
    .await
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
        // Redis acts on its own below only once it was found in line with the
        // ledger since its last failure; the refresh rebuilds it otherwise.
        let checked = match ledger_decides {
            false => redis_may_act(app, &drop, &config).await,
            true => None,
        };
        if let Some(checked) = checked {
            resolve_overdue(app, &drop, now).await;
            match gate::due_holds(&mut conn, &drop.keys, now, SWEEP_BATCH).await {
                Ok(due) => {
                    for key in due {
                        match gate::expire(&mut conn, &drop.keys, app.ledger.id(), &key).await {
                            Ok(step) if service::redis_still_checked(app, &drop, checked) => {
                                record_expiry(app, &drop, &config, &key, &step).await;
                            }
                            // Made on a Redis not checked (the client reconnected
                            // meanwhile): not recorded; the refresh checks Redis,
                            // and an expiry that stands reaches the ledger through
                            // its repair (heal_from_redis) once the ledger's
                            // deadline is well past.
                            Ok(_) => break,
                            Err(error) => {
                                tracing::debug!(drop = %drop.name, %error, "expiry failed")
                            }
                        }
                    }
                }
                Err(error) => tracing::debug!(drop = %drop.name, %error, "sweep failed"),
            }
            // Units the sweep (or a cancel, or a restock) returned go to the
            // waitlist's heads, in order.
            crate::service::waitlist::offer_due(app, &drop).await;
        }
        if ledger_decides {
            match app
                .ledger
                .expire_due(&drop.ledger_key(), &config, now, SWEEP_BATCH as i64)
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
        } else if let Some(checked) = checked {
            heal_from_redis(app, &drop, &config, checked, now - LEDGER_REPAIR_GRACE_MS).await;
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

/// Whether Redis may act on its own for `drop` (the ledger not deciding it is the
/// caller's to know): the drop is on the gate and Redis was found in line with the
/// ledger since its last failure.
async fn redis_may_act(
    app: &App,
    drop: &crate::drops::Drop,
    config: &DropConfig,
) -> Option<service::Checked> {
    match config.mode {
        Mode::Gate => service::redis_checked(app, drop).await,
        _ => None,
    }
}

/// Offers units this sidecar just returned to the waitlists' heads, on every drop
/// with a waitlist that Redis decides.
async fn offer_units_back(app: &App) {
    for drop in app.drops.all() {
        let config = drop.config();
        if config.waitlist.is_none() {
            continue;
        }
        let ledger_decides = matches!(
            app.ledger.authority(&drop.ledger_key()).await,
            Ok(Some(authority)) if authority.holder == Holder::Ledger
        );
        if !ledger_decides && redis_may_act(app, &drop, &config).await.is_some() {
            crate::service::waitlist::offer_due(app, &drop).await;
        }
    }
}

/// Resolves changes their sidecar never finished (it died, or its ledger stalled
/// past the commit deadline), within their bound rather than at the end of the hold.
/// An admission the ledger recorded is activated by replaying the record; one it did
/// not goes back to stock, after the key is claimed so that the late commit is
/// refused. A confirm or cancel is fenced off in the ledger first (its late commit
/// refused from then on), then finished if the ledger recorded it, else undone.
async fn resolve_overdue(app: &App, drop: &crate::drops::Drop, now: i64) {
    let mut conn = app.redis.clone();
    let overdue = match gate::overdue(&mut conn, &drop.keys, now, SWEEP_BATCH).await {
        Ok(overdue) => overdue,
        Err(error) => {
            tracing::debug!(drop = %drop.name, %error, "overdue sweep failed");
            return;
        }
    };
    let ledger = app.ledger.id();
    let began = std::time::Instant::now();
    for key in overdue {
        // While the ledger cannot be asked each resolution waits out its pool: the
        // rest wait for the next sweep rather than hold up the drops' expiries.
        if began.elapsed() > RESOLVE_BUDGET {
            break;
        }
        let resolved = match gate::unresolved(&mut conn, &drop.keys, &key).await {
            // The key's change as it stands now may not be the one that was listed
            // overdue (a retry resolved it and was admitted afresh, a new confirm
            // was prepared): only one overdue now is judged, and by its own attempt.
            Ok(Some(
                Unresolved::Admission(PendingAdmission { due_ms, .. })
                | Unresolved::Settle { due_ms, .. }
                | Unresolved::Extend { due_ms, .. },
            )) if due_ms > now => Ok(()),
            Ok(Some(Unresolved::Admission(admission))) => {
                admit::resolve_dead_admission(app, drop, &key, &admission, now).await
            }
            Ok(Some(Unresolved::Settle {
                attempt, to, sale, ..
            })) => {
                // Whether a confirm landed does not depend on what it kept.
                let settling = match to {
                    State::Cancelled => gate::Settling::Cancel,
                    _ => gate::Settling::Confirm { quantity: None },
                };
                resolve_settle(app, drop, &key, &attempt, sale.as_deref(), settling).await
            }
            Ok(Some(Unresolved::Extend {
                attempt,
                until_ms,
                sale,
                ..
            })) => {
                let settling = gate::Settling::Extend { until_ms };
                resolve_settle(app, drop, &key, &attempt, sale.as_deref(), settling).await
            }
            // Nothing unresolved any more: the entry goes (abandon drops it).
            Ok(None) => gate::abandon(&mut conn, &drop.keys, ledger, &key, "")
                .await
                .map_err(|e| e.to_string()),
            Err(error) => Err(error.to_string()),
        };
        if let Err(error) = resolved {
            tracing::debug!(drop = %drop.name, %error, "overdue change not resolved");
            // Behind the others for a while: a key that keeps failing (its row
            // locked, its ledger slow) must not take every sweep's budget.
            let again = now_ms() + RETRY_RESOLVING_MS;
            let _ = gate::postpone(&mut conn, &drop.keys, &key, again).await;
        }
    }
}

/// Resolves the overdue confirm, cancel or extension `attempt` of `key`, prepared
/// on a marker of `sale`: fenced off in the ledger first (its late commit refused
/// from then on), then finished if the ledger recorded it, else undone. It is
/// looked up under the marker's own sale: a sidecar whose config has moved on to a
/// re-created drop's sale would otherwise read (and fence) a row that cannot be
/// this change's record.
async fn resolve_settle(
    app: &App,
    drop: &crate::drops::Drop,
    key: &str,
    attempt: &str,
    sale: Option<&str>,
    settling: gate::Settling,
) -> Result<(), String> {
    let mut conn = app.redis.clone();
    let ledger = app.ledger.id();
    // Change numbers and keys start again with a re-created drop's sale: only a row
    // of the marker's own sale can be its record. A marker that names none (written
    // before markers carried their sale) is neither fenced nor finished here, as a
    // retry of the change leaves it too: fencing or finishing another sale's row
    // under a reused key could revert a change the ledger recorded. Its entry in
    // the unresolved set goes (abandon clears the entry of a marker that is not
    // the sale's), or it would come first in every sweep of the drop, for good.
    let Some(sale) = sale else {
        return gate::abandon(&mut conn, &drop.keys, ledger, key, "")
            .await
            .map_err(|e| e.to_string());
    };
    let ledger_key = drop.ledger_key_of(sale);
    let row = match app.ledger.fence_settle(&ledger_key, key, attempt).await {
        Ok(row) => row,
        Err(error) => return Err(error.to_string()),
    };
    // A row naming another attempt's change: this one never landed (it is fenced
    // off now), and Redis, which prepared it beside a change the ledger recorded
    // (a replica re-using a lost number), follows the ledger's record below.
    let another_attempts_change = row
        .as_ref()
        .is_some_and(|row| crate::service::made_by_another(row, attempt));
    let finished = if !another_attempts_change && crate::service::landed(settling, row.as_ref()) {
        gate::finish(&mut conn, &drop.keys, ledger, key, attempt)
            .await
            .map(|_| {
                // A confirmed or cancelled hold no longer needs its permit.
                if !matches!(settling, gate::Settling::Extend { .. }) {
                    drop.throttle.release(key);
                }
            })
            .map_err(|e| e.to_string())
    } else {
        gate::abort(&mut conn, &drop.keys, ledger, key, attempt)
            .await
            .map_err(|e| e.to_string())
    };
    // A marker of an older sale (the drop was re-created) is not this sale's to
    // finish or undo: both leave it, and its entry in the unresolved set goes here
    // (abandon leaves the entry of a change of the sale's still prepared).
    let resolved = match finished {
        Ok(()) => gate::abandon(&mut conn, &drop.keys, ledger, key, "")
            .await
            .map_err(|e| e.to_string()),
        failed => failed,
    };
    // An extension's row may hold a later deadline than the one this attempt asked
    // (another attempt, or the fallback, extended it further while this one was
    // prepared, and a replay left the prepared marker alone): Redis follows it now,
    // as it follows a row another attempt's change made.
    if let Some(row) = &row
        && (another_attempts_change || matches!(settling, gate::Settling::Extend { .. }))
        && resolved.is_ok()
        && let Err(error) = gate::replay(&mut conn, &drop.keys, ledger, row, &ledger_key).await
    {
        return Err(error.to_string());
    }
    resolved
}

/// Holds the ledger still has active well past their deadline while Redis decides:
/// Redis's word was lost on the way (a record that failed). Redis is asked, and the
/// ledger records what it says; a hold Redis no longer has at all expires in the
/// ledger (Redis lost it; its rebuild follows the ledger).
async fn heal_from_redis(
    app: &App,
    drop: &crate::drops::Drop,
    config: &DropConfig,
    checked: service::Checked,
    due: i64,
) {
    let key_of = drop.ledger_key();
    let keys = match app
        .ledger
        .active_due(&key_of, due, SWEEP_BATCH as i64)
        .await
    {
        Ok(keys) => keys,
        Err(error) => {
            tracing::debug!(drop = %drop.name, %error, "ledger repair sweep failed");
            return;
        }
    };
    let mut conn = app.redis.clone();
    for key in keys {
        let reply = match gate::lookup(&mut conn, &drop.keys, app.ledger.id(), &key).await {
            Ok(reply) => reply,
            Err(error) => {
                tracing::debug!(drop = %drop.name, %error, "ledger repair: Redis failed");
                return;
            }
        };
        // Only what a checked Redis says heals the ledger.
        if !service::redis_still_checked(app, drop, checked) {
            return;
        }
        if !record_expiry(app, drop, config, &key, &reply.step).await {
            continue;
        }
        let healed = match &reply.outcome {
            Outcome::Closed => return,
            Outcome::NotFound => app
                .ledger
                .expire_one(&key_of, config, &key, due, Holder::Gate)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            Outcome::Found(view) => match view.reservation.state {
                // An expiry this look-up made was recorded just above.
                State::Expired if reply.step.expired.is_some() => Ok(()),
                state @ (State::Confirmed | State::Cancelled | State::Expired) => {
                    let change =
                        change_of(drop, config, &key, &reply.step, &view.reservation, state);
                    // (Refused: the ledger's record was replayed into Redis.)
                    record_from_redis(app, drop, &reply.step, &key, change).await;
                    Ok(())
                }
                State::Pending | State::Active => Ok(()),
            },
            _ => Ok(()),
        };
        if let Err(error) = healed {
            tracing::debug!(drop = %drop.name, %error, "ledger repair failed");
        }
    }
}

/// How long past its deadline a hold the ledger has active waits for Redis's report
/// of its expiry (recorded by whoever expired it, normally within a sweep) before the
/// ledger asks Redis itself.
const LEDGER_REPAIR_GRACE_MS: i64 = 5_000;
