//! What the Redis gate decided, as the ledger records it.

use dropgate_api::DropConfig;

use crate::app::App;
use crate::drops::Drop;
use crate::gate::GateReply;
use crate::ledger::{Change, State};

/// The ledger change for what a gate script answered about `key`: recorded under
/// the sale Redis named in the same step, so a sidecar whose config is older than
/// a re-created drop never records into the earlier sale.
pub fn change_of(
    drop: &Drop,
    config: &DropConfig,
    key: &str,
    reply: &GateReply,
    state: State,
) -> Change {
    let sale = reply.sale.as_deref().unwrap_or(&config.sale);
    Change {
        drop_key: drop.ledger_key_of(sale),
        limit: config.limit,
        // A config of another sale says nothing about this one's limit: generation
        // 0 never moves the stock row.
        generation: if sale == config.sale {
            config.generation
        } else {
            0
        },
        key: key.to_string(),
        user: reply.user.clone().unwrap_or_default(),
        quantity: reply.quantity.unwrap_or(0),
        state,
        expires_at_ms: reply.when.unwrap_or(0),
        seq: reply.seq,
        epoch: reply.epoch.unwrap_or(0),
        from_pending: false,
    }
}

/// Records an expiry a gate script made on the way (the sweeper, or a look-up,
/// retry, confirm or cancel that found the hold past its deadline), and frees its
/// permit at once.
pub async fn record_expiry(
    app: &App,
    drop: &Drop,
    config: &DropConfig,
    key: &str,
    reply: &GateReply,
) {
    let Some((seq, from)) = &reply.expired else {
        return;
    };
    app.metrics.expired.inc();
    drop.throttle.release(key);
    let change = Change {
        seq: Some(*seq),
        from_pending: from == "pending",
        ..change_of(drop, config, key, reply, State::Expired)
    };
    if let Err(error) = app.ledger.record(change).await {
        tracing::warn!(drop = %drop.name, %error, "expiry not recorded in the ledger");
    }
}
