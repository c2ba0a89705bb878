//! What the Redis gate decided, as the ledger records it.

use dropgate_api::DropConfig;

use crate::app::App;
use crate::drops::Drop;
use crate::gate::Step;
use crate::reservation::{Change, Reservation, State, Stock};

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
    let stock = Stock {
        limit: config.limit,
        // A config of another sale says nothing about this one's limit: generation
        // 0 never moves the stock row.
        generation: if sale == config.sale {
            config.generation
        } else {
            0
        },
    };
    Change::new(&drop.ledger_key_of(sale), stock, key, reservation, state)
        .numbered(step.seq, step.epoch.unwrap_or(0))
}

/// The ledger key a gate call's change belongs to.
pub fn change_key(drop: &Drop, step: &Step) -> String {
    step.sale
        .as_deref()
        .map_or_else(|| drop.ledger_key(), |sale| drop.ledger_key_of(sale))
}

/// Records an expiry a gate script made on the way (the sweeper, or a look-up,
/// retry, confirm or cancel that found the hold past its deadline), and frees its
/// permit at once.
pub async fn record_expiry(app: &App, drop: &Drop, config: &DropConfig, key: &str, step: &Step) {
    let Some(expiry) = &step.expired else {
        return;
    };
    app.metrics.expired.inc();
    drop.throttle.release(key);
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
    if let Err(error) = app.ledger.record(change).await {
        tracing::warn!(drop = %drop.name, %error, "expiry not recorded in the ledger");
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
