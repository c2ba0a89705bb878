//! Bounded growth: the ledger forgets sales that are over, and a drop's event
//! stream forgets what every consumer has read.
//!
//! A sale is over when Redis says so: its drop was deleted (the operator's deletion
//! tombstone beside the missing config) or its config names another sale. Only
//! then is it noted in `ended_sales`; a drop whose sale merely passed its `endsAt`
//! keeps its rows, since moving `endsAt` later sells on in the same sale and a
//! rebuild of Redis counts the units sold from those rows. Deleting the
//! InventoryDrop once a sale is done is what lets its rows go.

use sqlx::{AnyPool, Row};

use dropgate_redis::Connection;

/// Rows deleted per statement: a prune never holds the ledger for long.
pub const PRUNE_BATCH: i64 = 500;

/// The tables keyed by a sale's ledger key that are emptied once its reservations
/// and events are gone, in the order every transaction locks a drop's rows
/// (authority, stock, variants, then the rest: a late commit for the sale meets
/// the prune without a deadlock); `sales` and `ended_sales` last, so that a prune
/// cut short is found and finished by the next.
const SALE_TABLES: [&str; 8] = [
    "DELETE FROM authority WHERE drop_key = $1",
    "DELETE FROM stock WHERE drop_key = $1",
    "DELETE FROM variant_stock WHERE drop_key = $1",
    "DELETE FROM buyers WHERE drop_key = $1",
    "DELETE FROM waitlist WHERE drop_key = $1",
    "DELETE FROM gate_seen WHERE drop_key = $1",
    "DELETE FROM sales WHERE drop_key = $1",
    "DELETE FROM ended_sales WHERE drop_key = $1",
];

/// Notes that the sale `drop_key` (`namespace/drop/sale`) is over, at `now` (the
/// first note stands).
pub async fn note_ended(pool: &AnyPool, drop_key: &str, now: i64) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO ended_sales (drop_key, ended_at_ms) VALUES ($1, $2) \
         ON CONFLICT (drop_key) DO NOTHING",
    )
    .bind(drop_key)
    .bind(now)
    .execute(pool)
    .await?;
    Ok(())
}

/// What one prune removed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Pruned {
    /// Sales forgotten whole.
    pub sales: u64,
    /// Rows deleted, of every table.
    pub rows: u64,
}

/// Forgets every sale noted over before `ended_before_ms` whose events are all
/// sent and whose rows did not change since it was noted over (a sale that sells
/// again under the same identity, as `apply` outside Kubernetes may, is kept),
/// [`PRUNE_BATCH`] rows per statement.
pub async fn prune(pool: &AnyPool, ended_before_ms: i64) -> Result<Pruned, sqlx::Error> {
    let over = sqlx::query(
        "SELECT e.drop_key FROM ended_sales e WHERE e.ended_at_ms < $1 \
         AND NOT EXISTS (SELECT 1 FROM outbox o WHERE o.drop_key = e.drop_key AND o.sent_at_ms IS NULL) \
         AND NOT EXISTS (SELECT 1 FROM reservations r WHERE r.drop_key = e.drop_key AND r.updated_at_ms > e.ended_at_ms) \
         ORDER BY e.ended_at_ms",
    )
    .bind(ended_before_ms)
    .fetch_all(pool)
    .await?;
    let mut pruned = Pruned::default();
    for row in over {
        let drop_key: String = row.try_get(0)?;
        pruned.rows += in_batches(
            pool,
            "DELETE FROM reservations WHERE drop_key = $1 AND res_key IN \
             (SELECT res_key FROM reservations WHERE drop_key = $1 LIMIT $2)",
            &drop_key,
        )
        .await?;
        pruned.rows += in_batches(
            pool,
            "DELETE FROM outbox WHERE id IN \
             (SELECT id FROM outbox WHERE drop_key = $1 LIMIT $2)",
            &drop_key,
        )
        .await?;
        let mut tx = pool.begin().await?;
        for statement in SALE_TABLES {
            pruned.rows += sqlx::query(statement)
                .bind(&drop_key)
                .execute(&mut *tx)
                .await?
                .rows_affected();
        }
        tx.commit().await?;
        pruned.sales += 1;
    }
    // Carts that ended without units sold (refused, given back, cancelled,
    // expired): nothing of them can change any more. A confirmed cart (or one
    // confirmed as far as it went) is kept: a refund cancels through it.
    pruned.rows += sqlx::query(
        "DELETE FROM carts WHERE state IN ('refused', 'released', 'cancelled', 'expired') \
         AND created_at_ms < $1 AND cart_key IN (SELECT cart_key FROM carts \
         WHERE state IN ('refused', 'released', 'cancelled', 'expired') AND created_at_ms < $1 LIMIT $2)",
    )
    .bind(ended_before_ms)
    .bind(PRUNE_BATCH)
    .execute(pool)
    .await?
    .rows_affected();
    Ok(pruned)
}

/// Runs a `DELETE ... LIMIT $2` for `drop_key` until it deletes nothing.
async fn in_batches(
    pool: &AnyPool,
    statement: &'static str,
    drop_key: &str,
) -> Result<u64, sqlx::Error> {
    let mut total = 0;
    loop {
        let deleted = sqlx::query(statement)
            .bind(drop_key)
            .bind(PRUNE_BATCH)
            .execute(pool)
            .await?
            .rows_affected();
        total += deleted;
        if deleted == 0 {
            return Ok(total);
        }
    }
}

/// A stream entry id (`ms-seq`), ordered as Redis orders them.
fn entry_id(id: &str) -> Option<(u64, u64)> {
    let (ms, seq) = id.split_once('-')?;
    Some((ms.parse().ok()?, seq.parse().ok()?))
}

/// Trims the event stream `stream` of the entries older than `older_than_ms` (ms
/// since the epoch, as entry ids count) that every consumer group has been given
/// and acknowledged: an entry still pending for a group, or not yet delivered to
/// one, is kept however old. A reader without a group (plain XREAD) is not seen:
/// it has the retention to read. Returns the entries removed.
pub async fn trim_stream(
    conn: &mut Connection,
    stream: &str,
    older_than_ms: i64,
) -> redis::RedisResult<u64> {
    let mut keep_from = (u64::try_from(older_than_ms).unwrap_or(0), 0);
    let mut xinfo = redis::cmd("XINFO");
    xinfo.arg("GROUPS").arg(stream);
    let groups: Vec<std::collections::HashMap<String, redis::Value>> =
        match conn.on_slot_of(stream, xinfo).await {
            Ok(reply) => redis::from_redis_value(reply)?,
            // No stream yet: nothing to trim.
            Err(e) if e.to_string().contains("no such key") => return Ok(0),
            Err(e) => return Err(e),
        };
    for group in groups {
        let name: String =
            redis::from_redis_value(group.get("name").cloned().unwrap_or(redis::Value::Nil))?;
        let last: String = redis::from_redis_value(
            group
                .get("last-delivered-id")
                .cloned()
                .unwrap_or(redis::Value::Nil),
        )?;
        let pending: i64 = redis::from_redis_value(
            group
                .get("pending")
                .cloned()
                .unwrap_or(redis::Value::Int(0)),
        )?;
        // The group's oldest entry it still needs: its oldest pending one, else the
        // last one delivered (kept: XTRIM MINID keeps the id it is given).
        let mut needed = entry_id(&last).unwrap_or((0, 0));
        if pending > 0 {
            let mut xpending = redis::cmd("XPENDING");
            xpending.arg(stream).arg(&name);
            let (_, oldest, _, _): (i64, Option<String>, Option<String>, redis::Value) =
                redis::from_redis_value(conn.on_slot_of(stream, xpending).await?)?;
            if let Some(oldest) = oldest.as_deref().and_then(entry_id) {
                needed = needed.min(oldest);
            }
        }
        keep_from = keep_from.min(needed);
    }
    let mut xtrim = redis::cmd("XTRIM");
    xtrim
        .arg(stream)
        .arg("MINID")
        .arg(format!("{}-{}", keep_from.0, keep_from.1));
    Ok(redis::from_redis_value(
        conn.on_slot_of(stream, xtrim).await?,
    )?)
}
