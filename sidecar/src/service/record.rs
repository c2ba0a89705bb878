//! What the Redis gate decided, as the ledger records it.

use dropgate_api::DropConfig;

use crate::app::App;
use crate::drops::Drop;
use crate::gate::{self, Step};
use crate::ledger::RecordError;
use crate::reservation::{Change, Reservation, State, Stock, Terms};

/// The ledger change moving `reservation` of `key` to `state`, as a gate call's
/// `step` made it: recorded under the sale Redis named in the same step, so a
/// sidecar whose config is older than a re-created drop never records into the
/// earlier sale.
pub fn change_of(
    drop: &Drop,
    config: &DropConfig,
    key: &str,
    step: &Step,
    reservation: &Reservation,
    state: State,
) -> Change {
    let sale = step.sale.as_deref().unwrap_or(&config.sale);
    // This sidecar's config describes the stock only at its own sale and generation.
    let known = |generation: i64| sale == config.sale && generation == config.generation;
    let stock = match (step.limit, step.generation) {
        // The config as the script read it, in the same step: however stale this
        // sidecar's copy, the ledger counts the admission against the stock in force.
        (Some(limit), Some(generation)) => Stock {
            limit,
            generation,
            terms: known(generation).then(|| Terms::of(config)),
            // As the script read them, like the limit; else this sidecar's own
            // when they describe the same generation.
            variants: match &step.variants {
                Some(variants) => Some(variants.clone()),
                None if known(generation) => Some(config.variants.clone()),
                None => None,
            },
        },
        _ => Stock {
            limit: config.limit,
            // A config of another sale says nothing about this one's limit:
            // generation 0 never moves the stock row.
            generation: if sale == config.sale {
                config.generation
            } else {
                0
            },
            terms: None,
            variants: (sale == config.sale).then(|| config.variants.clone()),
        },
    };
    Change::new(&drop.ledger_key_of(sale), stock, key, reservation, state)
        .numbered(step.seq, step.epoch.unwrap_or(0))
        .decided_on(step.generation)
}

/// The ledger key a gate call's change belongs to.
pub fn change_key(drop: &Drop, step: &Step) -> String {
    step.sale
        .as_deref()
        .map_or_else(|| drop.ledger_key(), |sale| drop.ledger_key_of(sale))
}

/// Records an expiry a gate script made on the way (the sweeper, or a look-up,
/// retry, confirm or cancel that found the hold past its deadline), and frees its
/// permit at once. False when the ledger refused it (it has the hold confirmed,
/// cancelled, or extended past the deadline Redis expired it at): Redis was
/// brought to the ledger's record instead, and the caller asks Redis again rather
/// than answer the expiry.
pub async fn record_expiry(
    app: &App,
    drop: &Drop,
    config: &DropConfig,
    key: &str,
    step: &Step,
) -> bool {
    let Some(expiry) = &step.expired else {
        return true;
    };
    let numbered = Step {
        seq: Some(expiry.seq),
        ..step.clone()
    };
    let change = Change {
        from_pending: expiry.from == State::Pending,
        ..change_of(
            drop,
            config,
            key,
            &numbered,
            &expiry.reservation,
            State::Expired,
        )
    };
    let stood = record_from_redis(app, drop, step, key, change).await;
    if stood {
        app.metrics.expired.inc();
        drop.throttle.release(key);
        app.units_back.notify_one();
    }
    stood
}

/// Records a change Redis made on its own (an expiry, or one the ledger repair
/// found there). False when the ledger's record went elsewhere: Redis is brought
/// forward to it at once, so that what Redis made does not stand. (Other failures
/// are logged: the ledger repair asks Redis again.)
pub async fn record_from_redis(
    app: &App,
    drop: &Drop,
    step: &Step,
    key: &str,
    change: Change,
) -> bool {
    match app.ledger.record(change).await {
        Ok(()) => true,
        Err(RecordError::KeyUsed { .. }) => {
            let ledger_key = change_key(drop, step);
            match app.ledger.reservation(&ledger_key, key).await {
                Ok(Some(row)) => {
                    let mut conn = app.redis.clone();
                    if let Err(error) =
                        gate::replay(&mut conn, &drop.keys, app.ledger.id(), &row, &ledger_key)
                            .await
                    {
                        tracing::warn!(drop = %drop.name, %error, "a change the ledger refused was not undone in Redis yet");
                        replay_later(app, drop, &ledger_key, key).await;
                    }
                }
                _ => replay_later(app, drop, &ledger_key, key).await,
            }
            false
        }
        Err(error) => {
            tracing::warn!(drop = %drop.name, %error, "a change Redis made was not recorded in the ledger");
            true
        }
    }
}

/// Marks the ledger's record of `key` as one Redis has not seen, so that the
/// refresh replays it (best effort: a failure is logged, and the ledger's repair
/// and the next rebuild bring Redis in line too).
pub async fn replay_later(app: &App, drop: &Drop, ledger_key: &str, key: &str) {
    if let Err(error) = app.ledger.mark_unreplayed(ledger_key, key).await {
        tracing::warn!(drop = %drop.name, %error, "could not mark a record for replay");
    }
}
