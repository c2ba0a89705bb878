//! The outbox's far side: canonical event JSON, the dispatcher that publishes
//! pending events to each drop's Redis Stream, and the consumer's dedup helper.

use std::collections::BTreeMap;

use dropgate_redis::Connection;
use serde_json::Value;
use sqlx::{Any, AnyPool, Row, Transaction};

use crate::clock::now_ms;
use crate::faults::{self, Fault};

/// A value that has no canonical form.
#[derive(Debug, thiserror::Error)]
pub enum NotCanonical {
    #[error("booleans are not allowed in events")]
    Boolean,
    #[error("floats are not allowed in events ({0})")]
    Float(serde_json::Number),
}

/// Canonical JSON: keys sorted, no spaces; booleans and floats refused, so that the
/// same event always has the same bytes.
pub fn canonical(value: &Value) -> Result<String, NotCanonical> {
    match value {
        Value::Null => Ok("null".into()),
        Value::Bool(_) => Err(NotCanonical::Boolean),
        Value::Number(n) if n.is_i64() || n.is_u64() => Ok(n.to_string()),
        Value::Number(n) => Err(NotCanonical::Float(n.clone())),
        Value::String(s) => Ok(quoted(s)),
        Value::Array(items) => {
            let parts = items.iter().map(canonical).collect::<Result<Vec<_>, _>>()?;
            Ok(format!("[{}]", parts.join(",")))
        }
        Value::Object(map) => {
            let sorted: BTreeMap<&String, &Value> = map.iter().collect();
            let mut parts = Vec::with_capacity(sorted.len());
            for (key, value) in sorted {
                parts.push(format!("{}:{}", quoted(key), canonical(value)?));
            }
            Ok(format!("{{{}}}", parts.join(",")))
        }
    }
}

/// A JSON string literal (serde_json's escaping, which cannot fail for a `str`).
fn quoted(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

/// When the oldest event not published yet was written (ms since the epoch). Ids
/// follow commit order, so the first unsent id is the oldest: one index probe
/// (`outbox_pending`), not a scan of the backlog.
pub async fn oldest_unsent_ms(pool: &AnyPool) -> Result<Option<i64>, sqlx::Error> {
    sqlx::query("SELECT created_at_ms FROM outbox WHERE sent_at_ms IS NULL ORDER BY id LIMIT 1")
        .fetch_optional(pool)
        .await?
        .map(|row| row.try_get(0))
        .transpose()
}

/// Why a dispatch round published nothing.
#[derive(Debug, thiserror::Error)]
pub enum DispatchError {
    #[error("the ledger failed: {0}")]
    Sql(#[from] sqlx::Error),
    #[error("publishing to Redis failed: {0}")]
    Publish(String),
}

/// How long a dispatcher's claim on a batch lasts: far longer than a round takes;
/// past it, another dispatcher may take the events of one that died.
const CLAIM_MS: i64 = 30_000;
/// How long a drop whose publish failed is left out of the rounds.
const FAILED_DROP_REST_MS: i64 = 5_000;
/// The claimant of a resting drop's events (no dispatcher's id: those are hex).
const RESTING: &str = "resting";
/// Events of one drop claimed per round: a drop whose events cannot be published
/// takes at most this many of a round's places, never the whole round.
const PER_DROP: i64 = 64;

/// Publishes up to `batch` pending events, each stream's in id order with one
/// script call ([`publish_run`]; a drop's sales share its stream), and marks sent
/// exactly those whose publish Redis confirmed.
///
/// `owner` (one per sidecar process) claims whole drops: the first [`PER_DROP`]
/// unsent events of each drop no other dispatcher holds a claim on. So sidecars
/// sharing a ledger publish each event once and each drop's events in order. An
/// event that cannot be published stops its stream's run for the round, and the
/// events of its drop (its sale) rest for a while; other drops go on. On
/// PostgreSQL the claims are taken one dispatcher at a time (an advisory lock for
/// the claiming statement only; admissions writing events never wait for it).
/// Unpublished events are retried next round (a crash before the marking
/// redelivers them; consumers deduplicate by event id). Returns how many were
/// published.
pub async fn dispatch(
    pool: &AnyPool,
    postgres: bool,
    redis: &mut Connection,
    owner: &str,
    batch: i64,
) -> Result<usize, DispatchError> {
    let now = now_ms();
    let claim_until = now + CLAIM_MS;
    let claim = async {
        let mut tx = pool.begin().await?;
        if postgres {
            sqlx::query("SELECT pg_advisory_xact_lock(7420111)")
                .execute(&mut *tx)
                .await?;
        }
        sqlx::query(
            "UPDATE outbox SET claimed_by = $1, claimed_until_ms = $2 \
             WHERE sent_at_ms IS NULL AND id IN ( \
               SELECT id FROM ( \
                 SELECT id, drop_key, ROW_NUMBER() OVER (PARTITION BY drop_key ORDER BY id) AS place \
                 FROM outbox WHERE sent_at_ms IS NULL) AS pending \
               WHERE place <= $3 AND drop_key NOT IN ( \
                 SELECT drop_key FROM outbox WHERE sent_at_ms IS NULL AND claimed_until_ms >= $4 \
                 AND claimed_by <> $5) \
               ORDER BY id LIMIT $6)",
        )
        .bind(owner)
        .bind(claim_until)
        .bind(PER_DROP)
        .bind(now)
        // A dispatcher's own claims are not in its way: its rounds run one after
        // another, so a claim of its own that is still standing is a round that
        // failed part-way (the ledger restarting under it), whose events would
        // otherwise wait out the whole claim.
        .bind(owner)
        .bind(batch)
        .execute(&mut *tx)
        .await?;
        tx.commit().await
    };
    claim.await?;
    let rows = sqlx::query(
        "SELECT id, event_id, drop_key, payload FROM outbox \
         WHERE sent_at_ms IS NULL AND claimed_by = $1 AND claimed_until_ms = $2 ORDER BY id",
    )
    .bind(owner)
    .bind(claim_until)
    .fetch_all(pool)
    .await?;
    let claimed = rows.len();
    // Each stream's events in order (the rows are in id order; the sales of one
    // drop share its stream), published a run at a time (see [`publish_run`]).
    let mut runs: Vec<(String, Vec<Event>)> = Vec::new();
    for row in rows {
        let event = Event {
            id: row.try_get(0)?,
            event_id: row.try_get(1)?,
            drop_key: row.try_get(2)?,
            payload: row.try_get(3)?,
        };
        let Some((namespace, name)) =
            dropgate_api::keys::ledger_drop(&event.drop_key).split_once('/')
        else {
            continue;
        };
        let stream = dropgate_api::DropKeys::new(namespace, name).events();
        match runs.iter_mut().find(|(key, _)| *key == stream) {
            Some((_, events)) => events.push(event),
            None => runs.push((stream, vec![event])),
        }
    }
    // Published ids, marked sent together afterwards: one commit per round rather
    // than one per event, and never an id whose publish did not succeed.
    let mut published = Vec::with_capacity(claimed);
    let mut held_back = std::collections::HashSet::new();
    let mut failure = None;
    for (stream, events) in runs {
        // A round slower than half its claim ends here: past the claim another
        // dispatcher may take these events, and they must not go out twice.
        if now_ms() > claim_until - CLAIM_MS / 2 {
            break;
        }
        let (sent, error) = publish_run(redis, &stream, &events).await;
        published.extend(events[..sent].iter().map(|event| event.id));
        if let (Some(e), Some(stopped)) = (error, events.get(sent)) {
            tracing::warn!(drop = %stopped.drop_key, event_id = %stopped.event_id, error = %e, "event not published (or its publish not confirmed); its drop's later events wait");
            failure = Some(e);
            held_back.insert(stopped.drop_key.clone());
        }
    }
    if claimed > 0 {
        let mark = async {
            let mut tx = pool.begin().await?;
            let now = now_ms();
            // A statement per run of ids, not per id: each is a round trip to the
            // ledger (with SQLite, a hand-off to its worker thread).
            for run in super::row_runs(published.len()) {
                let ids = (0..run.len())
                    .map(|i| format!("${}", i + 2))
                    .collect::<Vec<_>>()
                    .join(", ");
                let sql = format!("UPDATE outbox SET sent_at_ms = $1 WHERE id IN ({ids})");
                let mut mark = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(now);
                for id in &published[run] {
                    mark = mark.bind(*id);
                }
                mark.execute(&mut *tx).await?;
            }
            // A drop whose publish failed rests (its claim stays, longer, under a
            // name that is nobody's: it holds this dispatcher's rounds off too) so
            // that it cannot fill the next rounds; the rest is free for anyone's
            // next round.
            for drop_key in &held_back {
                sqlx::query(
                    "UPDATE outbox SET claimed_until_ms = $1, claimed_by = $2 \
                     WHERE sent_at_ms IS NULL AND claimed_by = $3 AND claimed_until_ms = $4 AND drop_key = $5",
                )
                .bind(now + FAILED_DROP_REST_MS)
                .bind(RESTING)
                .bind(owner)
                .bind(claim_until)
                .bind(drop_key)
                .execute(&mut *tx)
                .await?;
            }
            sqlx::query(
                "UPDATE outbox SET claimed_by = NULL, claimed_until_ms = NULL \
                 WHERE sent_at_ms IS NULL AND claimed_by = $1 AND claimed_until_ms = $2",
            )
            .bind(owner)
            .bind(claim_until)
            .execute(&mut *tx)
            .await?;
            tx.commit().await
        };
        mark.await?;
    }
    match failure {
        Some(e) if published.is_empty() => Err(e),
        _ => Ok(published.len()),
    }
}

/// An outbox row on its way to its drop's stream.
struct Event {
    id: i64,
    event_id: String,
    drop_key: String,
    payload: String,
}

/// Appends `events` to the drop's `stream` in order, stopping at the first that
/// cannot be (publish.lua: one call for the run, where an XADD a round trip each
/// cost Redis a reply and the sidecar a wake-up per event). Returns how many Redis
/// confirmed (none when its reply was lost: those go out again, and consumers
/// deduplicate), and why the next was not.
async fn publish_run(
    redis: &mut Connection,
    stream: &str,
    events: &[Event],
) -> (usize, Option<DispatchError>) {
    let mut invocation = PUBLISH.key(stream);
    for event in events {
        invocation.arg(&event.event_id).arg(&event.payload);
    }
    let answered: redis::RedisResult<(usize, String)> = invocation.invoke_async(redis).await;
    let (sent, error) = match answered {
        Ok((sent, error)) => (
            // (Never more than were sent, whatever the reply says.)
            sent.min(events.len()),
            (!error.is_empty()).then(|| DispatchError::Publish(error)),
        ),
        Err(e) => (0, Some(DispatchError::Publish(e.to_string()))),
    };
    // The fault point, once per event published: a crash between publishing an
    // event and marking it sent (it and the rest of the run, published too, go out
    // again; consumers deduplicate).
    for n in 0..sent {
        if let Err(e) = faults::check(Fault::AfterPublishBeforeAck) {
            return (n, Some(DispatchError::Publish(e.to_string())));
        }
    }
    (sent, error)
}

static PUBLISH: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(include_str!("publish.lua")));

/// Events still waiting for the dispatcher.
pub async fn pending(pool: &AnyPool) -> Result<i64, sqlx::Error> {
    sqlx::query("SELECT COUNT(*) FROM outbox WHERE sent_at_ms IS NULL")
        .fetch_one(pool)
        .await?
        .try_get(0)
}

/// Applies a delivered event's effect exactly once for `consumer`: the event id is
/// recorded in the same transaction as the effect, so a redelivery is recognised
/// and skipped. Returns whether the effect ran.
pub async fn consume_once<F>(
    pool: &AnyPool,
    consumer: &str,
    event_id: &str,
    effect: F,
) -> Result<bool, sqlx::Error>
where
    F: for<'t> FnOnce(
        &'t mut Transaction<'static, Any>,
    ) -> std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<(), sqlx::Error>> + Send + 't>,
    >,
{
    let mut tx = pool.begin().await?;
    let fresh = sqlx::query(
        "INSERT INTO processed_events (consumer, event_id) VALUES ($1, $2) \
         ON CONFLICT (consumer, event_id) DO NOTHING",
    )
    .bind(consumer)
    .bind(event_id)
    .execute(&mut *tx)
    .await?
    .rows_affected()
        == 1;
    if !fresh {
        tx.rollback().await?;
        return Ok(false);
    }
    effect(&mut tx).await?;
    tx.commit().await?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::canonical;
    use serde_json::json;

    #[test]
    fn canonical_json_sorts_keys_and_refuses_what_would_drift() {
        assert_eq!(
            canonical(&json!({"b": 1, "a": {"d": "x y", "c": [2, null]}})).ok(),
            Some(r#"{"a":{"c":[2,null],"d":"x y"},"b":1}"#.to_string())
        );
        assert!(canonical(&json!({"ok": true})).is_err());
        assert!(canonical(&json!({"price": 1.5})).is_err());
    }
}
