//! The Redis gate: one atomic Lua script per operation, run by SHA.
//!
//! redis-rs's [`Script`] sends EVALSHA and, on NOSCRIPT (a restarted or failed-over
//! Redis that lost its script cache), loads the script and retries, so the scripts
//! survive a Redis restart without a sidecar restart.
//!
//! `prelude.lua` holds what several scripts share (the key layout, Redis's clock,
//! returning units, expiring a due hold); it is concatenated in front of each script
//! at compile time, so each script stays one atomic EVALSHA.

use std::sync::LazyLock;

use dropgate_api::Connection;
use dropgate_api::DropKeys;
use redis::{RedisResult, Script};
use tracing::Instrument;

use crate::ledger::Recorded;

/// A gate script and the name its client span has.
struct GateScript {
    script: Script,
    /// `EVALSHA <script>`: what one call is called in a trace.
    span: &'static str,
}

macro_rules! gate_script {
    ($name:literal) => {
        LazyLock::new(|| GateScript {
            script: Script::new(concat!(
                include_str!("prelude.lua"),
                include_str!(concat!($name, ".lua"))
            )),
            span: concat!("EVALSHA ", $name),
        })
    };
}

static RESERVE: LazyLock<GateScript> = gate_script!("reserve");
static CONFIRM: LazyLock<GateScript> = gate_script!("confirm");
static CANCEL: LazyLock<GateScript> = gate_script!("cancel");
static LOOKUP: LazyLock<GateScript> = gate_script!("lookup");
static EXPIRE: LazyLock<GateScript> = gate_script!("expire");
static UNDO: LazyLock<GateScript> = gate_script!("undo");
static ACTIVATE: LazyLock<GateScript> = gate_script!("activate");
static REPLAY: LazyLock<GateScript> = gate_script!("replay");
static OPEN: LazyLock<GateScript> = gate_script!("open");
static ABANDON: LazyLock<GateScript> = gate_script!("abandon");
static CLOSE: LazyLock<GateScript> = gate_script!("close");

mod reply;

pub use reply::{Activation, Closing, Expiry, Opened, Replay, Reply, Step};
use reply::{Call, Wire};

/// Runs `script` on the drop's keys (every script gets the same ten, so each call
/// stays in the drop's hash slot), as one client span.
async fn run(
    script: &GateScript,
    conn: &mut Connection,
    keys: &DropKeys,
    key: &str,
    args: &[&str],
) -> RedisResult<Wire> {
    let mut invocation = script.script.key(keys.config());
    invocation
        .key(keys.remaining())
        .key(keys.held())
        .key(keys.buyers())
        .key(keys.holds())
        .key(keys.reservation(key))
        .key(keys.gate())
        .key(keys.seq())
        .key(keys.ledgers())
        .key(keys.pending())
        .arg(key);
    for arg in args {
        invocation.arg(*arg);
    }
    let span = tracing::debug_span!(
        "EVALSHA",
        otel.name = script.span,
        otel.kind = "client",
        otel.status_code = tracing::field::Empty,
        error.type = tracing::field::Empty,
        db.system = "redis",
        db.system.name = "redis",
        db.operation.name = "EVALSHA",
        db.query.summary = script.span,
    );
    let called = invocation.invoke_async(conn).instrument(span.clone()).await;
    if let Err(error) = &called {
        span.record("otel.status_code", "ERROR");
        span.record("error.type", error.category());
    }
    Wire::parse(called?)
}

/// The SHA1 of the reserve script as Redis caches it (for a bench that drives the
/// same script with `redis-benchmark`).
pub fn reserve_sha() -> &'static str {
    RESERVE.script.get_hash()
}

/// Admits `quantity` units for `user` under idempotency key `key` as a pending
/// reservation, or says why not. `attempt` identifies this admission for
/// [`activate`] and [`undo`]; `ledger` is the id of the ledger that will record it;
/// an admission still pending `pending_bound_ms` later is overdue (its sidecar
/// died), and a retry of the same key by the same buyer takes it over.
/// [`Outcome::Pending`](crate::reservation::Outcome::Pending): a concurrent attempt
/// with the same key is still within its bound, ask again shortly;
/// [`Outcome::Closed`](crate::reservation::Outcome::Closed): the gate is not open
/// (see [`open`]).
#[allow(clippy::too_many_arguments)]
pub async fn reserve(
    conn: &mut Connection,
    keys: &DropKeys,
    key: &str,
    user: &str,
    quantity: i64,
    attempt: &str,
    ledger: &str,
    pending_bound_ms: u64,
) -> RedisResult<Reply> {
    let (quantity, bound) = (quantity.to_string(), pending_bound_ms.to_string());
    run(
        &RESERVE,
        conn,
        keys,
        key,
        &[user, &quantity, attempt, ledger, &bound],
    )
    .await?
    .reply(Call::Reserve)
}

/// Takes back an overdue pending admission that `ledger` (the caller's) was to
/// record and has claimed as never recorded. One a retry took over, one that moved
/// on, and one another ledger was to record are left alone (and leave the pending
/// set).
pub async fn abandon(
    conn: &mut Connection,
    keys: &DropKeys,
    key: &str,
    ledger: &str,
) -> RedisResult<()> {
    run(&ABANDON, conn, keys, key, &[ledger]).await.map(|_| ())
}

/// A pending admission's marker: who, how many, and the ledger that was to record
/// it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PendingMarker {
    pub user: String,
    pub quantity: i64,
    pub ledger: String,
}

/// The pending admission of `key` as it stands, if the key holds one.
pub async fn pending_marker(
    conn: &mut Connection,
    keys: &DropKeys,
    key: &str,
) -> RedisResult<Option<PendingMarker>> {
    let (state, user, quantity, ledger): (
        Option<String>,
        Option<String>,
        Option<i64>,
        Option<String>,
    ) = redis::cmd("HMGET")
        .arg(keys.reservation(key))
        .arg("state")
        .arg("user")
        .arg("quantity")
        .arg("ledger")
        .query_async(conn)
        .await?;
    Ok(match (state.as_deref(), user, quantity) {
        (Some("pending"), Some(user), Some(quantity)) => Some(PendingMarker {
            user,
            quantity,
            ledger: ledger.unwrap_or_default(),
        }),
        _ => None,
    })
}

/// Keys of pending admissions overdue at `now_ms`, at most `limit`.
pub async fn overdue(
    conn: &mut Connection,
    keys: &DropKeys,
    now_ms: i64,
    limit: isize,
) -> RedisResult<Vec<String>> {
    scored_until(conn, &keys.pending(), now_ms, limit).await
}

/// Members of the sorted set `key` scored at or before `now_ms`, at most `limit`.
async fn scored_until(
    conn: &mut Connection,
    key: &str,
    now_ms: i64,
    limit: isize,
) -> RedisResult<Vec<String>> {
    redis::cmd("ZRANGEBYSCORE")
        .arg(key)
        .arg("-inf")
        .arg(now_ms)
        .arg("LIMIT")
        .arg(0)
        .arg(limit)
        .query_async(conn)
        .await
}

pub async fn confirm(conn: &mut Connection, keys: &DropKeys, key: &str) -> RedisResult<Reply> {
    run(&CONFIRM, conn, keys, key, &[])
        .await?
        .reply(Call::Confirm)
}

pub async fn cancel(conn: &mut Connection, keys: &DropKeys, key: &str) -> RedisResult<Reply> {
    run(&CANCEL, conn, keys, key, &[])
        .await?
        .reply(Call::Cancel)
}

pub async fn lookup(conn: &mut Connection, keys: &DropKeys, key: &str) -> RedisResult<Reply> {
    run(&LOOKUP, conn, keys, key, &[])
        .await?
        .reply(Call::Lookup)
}

/// Expires the hold of `key` if its deadline has passed (the sweeper's step).
pub async fn expire(conn: &mut Connection, keys: &DropKeys, key: &str) -> RedisResult<Step> {
    run(&EXPIRE, conn, keys, key, &[]).await?.step()
}

/// Turns the pending admission `attempt` of `key` into an active reservation, or
/// says how the marker stands when it is not that pending admission any more.
pub async fn activate(
    conn: &mut Connection,
    keys: &DropKeys,
    key: &str,
    attempt: &str,
) -> RedisResult<(Activation, Step)> {
    run(&ACTIVATE, conn, keys, key, &[attempt])
        .await?
        .activation()
}

/// Takes back the pending admission `attempt` of `key` as if it never happened (a
/// marker that moved on meanwhile is left alone).
pub async fn undo(
    conn: &mut Connection,
    keys: &DropKeys,
    key: &str,
    attempt: &str,
) -> RedisResult<()> {
    run(&UNDO, conn, keys, key, &[attempt]).await.map(|_| ())
}

/// Brings the reservation `key` in Redis forward to the ledger's record of it.
/// `ledger_key` is where `row` was read: a row of another sale than the one Redis
/// now holds (the drop was re-created while this ran) changes nothing.
pub async fn replay(
    conn: &mut Connection,
    keys: &DropKeys,
    row: &Recorded,
    ledger_key: &str,
) -> RedisResult<Replay> {
    let (quantity, expires, seq) = (
        row.quantity.to_string(),
        row.expires_at_ms.to_string(),
        row.seq.to_string(),
    );
    run(
        &REPLAY,
        conn,
        keys,
        &row.key,
        &[
            &row.user,
            &quantity,
            row.state.as_str(),
            &expires,
            &seq,
            dropgate_api::keys::ledger_sale(ledger_key),
        ],
    )
    .await?
    .replay()
}

/// Opens the gate at `epoch` and raises the change counter to `seq_floor`.
pub async fn open(
    conn: &mut Connection,
    keys: &DropKeys,
    epoch: i64,
    seq_floor: i64,
) -> RedisResult<Opened> {
    let (epoch, floor) = (epoch.to_string(), seq_floor.to_string());
    run(&OPEN, conn, keys, "", &[&epoch, &floor])
        .await?
        .opened()
}

/// Closes the gate unless it was reopened after `epoch`.
pub async fn close(conn: &mut Connection, keys: &DropKeys, epoch: i64) -> RedisResult<Closing> {
    run(&CLOSE, conn, keys, "", &[&epoch.to_string(), ""])
        .await?
        .closing()
}

/// Closes the gate for good: Redis lost a sale whose record is spread over per-pod
/// ledgers, none of which can rebuild it.
pub async fn condemn(conn: &mut Connection, keys: &DropKeys) -> RedisResult<()> {
    run(&CLOSE, conn, keys, "", &["0", "lost"])
        .await
        .map(|_| ())
}

/// What the drop has left in Redis; `None` before it was seeded.
pub async fn remaining(conn: &mut Connection, keys: &DropKeys) -> RedisResult<Option<i64>> {
    redis::cmd("GET")
        .arg(keys.remaining())
        .query_async(conn)
        .await
}

/// Where Redis's gate stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gate {
    Closed,
    Open(i64),
    /// The tombstone (see [`condemn`]).
    Lost,
}

impl Gate {
    pub fn epoch(self) -> Option<i64> {
        match self {
            Gate::Open(epoch) => Some(epoch),
            _ => None,
        }
    }
}

/// The gate and the change counter, as Redis holds them now.
pub async fn standing(conn: &mut Connection, keys: &DropKeys) -> RedisResult<(Gate, i64)> {
    let (gate, seq): (Option<String>, Option<i64>) = redis::pipe()
        .get(keys.gate())
        .get(keys.seq())
        .query_async(conn)
        .await?;
    let gate = match gate.as_deref() {
        None => Gate::Closed,
        Some("lost") => Gate::Lost,
        Some(epoch) => epoch.parse().map(Gate::Open).map_err(|_| {
            redis::RedisError::from((
                redis::ErrorKind::Parse,
                "the gate key holds neither an epoch nor the tombstone",
                epoch.to_string(),
            ))
        })?,
    };
    Ok((gate, seq.unwrap_or(0)))
}

/// Registers `ledger` among the ledgers of sidecars that serve the drop (see
/// [`DropKeys::ledgers`]) and returns them all, in one atomic step: of two
/// sidecars registering, the later one sees the earlier.
pub async fn register(
    conn: &mut Connection,
    keys: &DropKeys,
    ledger: &str,
) -> RedisResult<Vec<String>> {
    let (ledgers,): (Vec<String>,) = redis::pipe()
        .atomic()
        .sadd(keys.ledgers(), ledger)
        .ignore()
        .smembers(keys.ledgers())
        .query_async(conn)
        .await?;
    Ok(ledgers)
}

/// Keys of active holds whose deadline is at or before `now_ms`, at most `limit`.
pub async fn due_holds(
    conn: &mut Connection,
    keys: &DropKeys,
    now_ms: i64,
    limit: isize,
) -> RedisResult<Vec<String>> {
    scored_until(conn, &keys.holds(), now_ms, limit).await
}
