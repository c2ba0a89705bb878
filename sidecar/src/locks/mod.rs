//! Fencing-token locks: a lease in Redis plus a fence that only grows, so storage
//! can refuse a holder whose lease ran out while it was paused.
//!
//! Acquire is one Lua script (SET NX PX with a random token and the next fence);
//! renew and release compare the token in Lua. A fence is above the lock's last one,
//! above the highest the ledger recorded ([`crate::ledger::fences`]), and never below
//! Redis's clock in microseconds, so fences keep growing across a Redis that lost the
//! counter, whichever pod asks (per-pod ledgers included).

use std::sync::LazyLock;
use std::time::{Duration, Instant};

use dropgate_api::LockKeys;
use dropgate_redis::Connection;
use rand::Rng;
use redis::{RedisResult, Script};
use sqlx::AnyPool;
use tracing::Instrument;

use crate::ledger::fences;

static ACQUIRE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("acquire.lua")));
static RENEW: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("renew.lua")));
static RELEASE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("release.lua")));
static NAME: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("name.lua")));

/// First backoff step between acquire attempts, and the largest.
const BACKOFF_BASE: Duration = Duration::from_millis(5);
const BACKOFF_CAP: Duration = Duration::from_millis(250);

/// A granted lock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Held {
    pub token: String,
    pub fence: i64,
    pub expires_at_ms: i64,
}

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("Redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("ledger: {0}")]
    Ledger(#[from] sqlx::Error),
}

/// The ledger a lock's fences are recorded in.
#[derive(Clone, Copy, Debug)]
pub struct FenceLedger<'a> {
    pub pool: &'a AnyPool,
}

/// Tries to take the lock until `wait` is spent, sleeping between attempts with
/// exponential backoff and full jitter (a random pause up to the step), so that
/// contenders spread out instead of retrying in lockstep. `Ok(None)`: still busy.
pub async fn acquire(
    conn: &mut Connection,
    ledger: FenceLedger<'_>,
    keys: &LockKeys,
    ledger_name: &str,
    ttl_ms: i64,
    wait: Duration,
) -> Result<Option<Held>, LockError> {
    let span = tracing::debug_span!(
        "lock acquire",
        otel.kind = "client",
        db.system = "redis",
        db.system.name = "redis",
        dropgate.lock.attempts = tracing::field::Empty,
        dropgate.lock.granted = tracing::field::Empty,
        dropgate.lock.fence = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    );
    let mut attempts: u32 = 0;
    let taken = take(conn, ledger, keys, ledger_name, ttl_ms, wait, &mut attempts)
        .instrument(span.clone())
        .await;
    span.record("dropgate.lock.attempts", i64::from(attempts));
    match &taken {
        Ok(held) => {
            span.record("dropgate.lock.granted", held.is_some());
            if let Some(held) = held {
                span.record("dropgate.lock.fence", held.fence);
            }
        }
        Err(_) => {
            span.record("otel.status_code", "ERROR");
        }
    }
    taken
}

/// [`acquire`]'s attempts, counted in `attempts` (also when one fails).
async fn take(
    conn: &mut Connection,
    ledger: FenceLedger<'_>,
    keys: &LockKeys,
    ledger_name: &str,
    ttl_ms: i64,
    wait: Duration,
    attempts: &mut u32,
) -> Result<Option<Held>, LockError> {
    let token = format!("{:032x}", rand::random::<u128>());
    let deadline = Instant::now() + wait;
    let mut step = BACKOFF_BASE;
    loop {
        *attempts += 1;
        // Read on every attempt: another holder may have raised it meanwhile.
        let floor = fences::high_water(ledger.pool, ledger_name).await?;
        let (granted, fence, when): (i64, i64, i64) = ACQUIRE
            .key(keys.lock())
            .key(keys.fence())
            .arg(&token)
            .arg(ttl_ms)
            .arg(floor)
            .invoke_async(conn)
            .await?;
        if granted == 1 {
            // The fence is durable, and above every fence recorded before it, before
            // anyone may use it; one that is not (a Redis that lost its counter
            // raced a holder whose fence the ledger has) is given back and the
            // attempt made again above the new floor.
            match fences::record(ledger.pool, ledger_name, fence).await {
                Ok(true) => {
                    return Ok(Some(Held {
                        token,
                        fence,
                        expires_at_ms: when,
                    }));
                }
                Ok(false) => {
                    let _ = release(conn, keys, &token).await;
                    continue;
                }
                Err(e) => {
                    let _ = release(conn, keys, &token).await;
                    return Err(e.into());
                }
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(None);
        }
        let pause = Duration::from_micros(rand::rng().random_range(0..=step.as_micros() as u64));
        tokio::time::sleep(pause.min(left)).await;
        step = (step * 2).min(BACKOFF_CAP);
    }
}

/// Notes lock `name` of `namespace` as in use for `ttl_ms` and a day; false when it
/// is a new name and the namespace already has `max` names in use. (A step of its
/// own, apart from the lock's: the names of a namespace live in one slot, each
/// lock in its own. Racing acquires of new names may pass the cap by a few.)
pub async fn note_name(
    conn: &mut Connection,
    namespace: &str,
    name: &str,
    ttl_ms: i64,
    max: u32,
) -> RedisResult<bool> {
    let noted: i64 = NAME
        .key(LockKeys::names(namespace))
        .arg(name)
        .arg(ttl_ms)
        .arg(max)
        .invoke_async(conn)
        .await?;
    Ok(noted == 1)
}

/// Extends the lease of the holder of `token`; `None` when the lease was lost.
pub async fn renew(
    conn: &mut Connection,
    keys: &LockKeys,
    token: &str,
    ttl_ms: i64,
) -> RedisResult<Option<i64>> {
    let span = lock_span("lock renew");
    let renewed: RedisResult<(i64, i64)> = RENEW
        .key(keys.lock())
        .key(keys.fence())
        .arg(token)
        .arg(ttl_ms)
        .invoke_async(conn)
        .instrument(span.clone())
        .await;
    let (renewed, when) = held(&span, renewed)?;
    Ok(renewed.then_some(when))
}

/// Releases the lock if `token` holds it; false when it does not.
pub async fn release(conn: &mut Connection, keys: &LockKeys, token: &str) -> RedisResult<bool> {
    let span = lock_span("lock release");
    let released: RedisResult<i64> = RELEASE
        .key(keys.lock())
        .arg(token)
        .invoke_async(conn)
        .instrument(span.clone())
        .await;
    Ok(held(&span, released.map(|r| (r, 0)))?.0)
}

/// Reads a renew's or release's `(1 when the token held the lock, when)` into
/// `span`.
fn held(span: &tracing::Span, answer: RedisResult<(i64, i64)>) -> RedisResult<(bool, i64)> {
    match answer {
        Ok((held, when)) => {
            span.record("dropgate.lock.held", held == 1);
            Ok((held == 1, when))
        }
        Err(e) => {
            span.record("otel.status_code", "ERROR");
            Err(e)
        }
    }
}

/// The span of one renew or release: `dropgate.lock.held` says whether the token
/// still held the lock.
fn lock_span(name: &'static str) -> tracing::Span {
    // `lock` in logs (a span's name there must be a constant), `name` in a trace.
    tracing::debug_span!(
        "lock",
        otel.name = name,
        otel.kind = "client",
        otel.status_code = tracing::field::Empty,
        db.system = "redis",
        db.system.name = "redis",
        dropgate.lock.held = tracing::field::Empty,
    )
}
