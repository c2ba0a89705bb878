//! What every request handler shares, and the answers about a drop itself.

use std::sync::Arc;
use std::time::Duration;

use dropgate_api::FailurePolicy;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use warp::http::StatusCode;

use crate::answer::Answer;
use crate::drops::{Drop, Drops, LookupError};
use crate::ledger::Ledger;
use crate::ledger::now_ms;
use crate::metrics::Metrics;
use crate::settings::Settings;
use crate::{Error, input};
use std::sync::atomic::{AtomicI64, Ordering};

#[derive(Debug)]
pub struct App {
    pub drops: Drops,
    /// One multiplexed connection for every request. It reconnects by itself, so a
    /// Redis restart needs no sidecar restart; while Redis is down, commands fail
    /// within the timeouts below instead of queueing.
    pub redis: ConnectionManager,
    pub ledger: Ledger,
    pub metrics: Metrics,
    /// Until when (ms since the epoch) Redis is taken as unreachable without asking
    /// it: after a connection failure, every request would otherwise wait out a
    /// reconnect attempt before its failure policy applied.
    redis_down_until: AtomicI64,
}

/// How long one connection failure keeps requests off Redis. The background refresh
/// asks Redis twice as often and closes the breaker as soon as it answers.
const REDIS_BREAK_MS: i64 = 1000;

impl App {
    pub async fn new(settings: &Settings) -> Result<Self, Error> {
        let client = redis::Client::open(settings.redis_url.as_str())?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_millis(500)))
            .set_response_timeout(Some(Duration::from_secs(2)))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(200));
        // Lazy: the sidecar starts (and answers `unavailable`) while Redis is down.
        let redis = ConnectionManager::new_lazy_with_config(client, config)?;
        Ok(Self {
            drops: Drops::new(&settings.namespace),
            redis,
            ledger: Ledger::open(&settings.database_url).await?,
            metrics: Metrics::new(),
            redis_down_until: AtomicI64::new(0),
        })
    }

    /// The error to act on while Redis is taken as unreachable, if it is.
    pub fn redis_breaker(&self) -> Option<redis::RedisError> {
        (now_ms() < self.redis_down_until.load(Ordering::Acquire)).then(|| {
            redis::RedisError::from((
                redis::ErrorKind::Client,
                "Redis is unreachable (a connection failed within the last second)",
            ))
        })
    }

    /// Notes a failed Redis call: a connection-level failure opens the breaker.
    pub fn redis_failed(&self, error: &redis::RedisError) {
        if error.is_io_error()
            || error.is_connection_refusal()
            || error.is_connection_dropped()
            || error.is_timeout()
        {
            self.redis_down_until
                .store(now_ms() + REDIS_BREAK_MS, Ordering::Release);
        }
    }

    /// Notes that Redis answered: requests go to it again.
    pub fn redis_answered(&self) {
        self.redis_down_until.store(0, Ordering::Release);
    }

    /// The drop named by a path segment, or the answer that ends the request.
    pub async fn find_drop(&self, raw_name: &str) -> Result<Arc<Drop>, Answer> {
        let name = input::path_id("drop", raw_name).map_err(|e| Answer::invalid(e.0))?;
        if !dropgate_api::keys::is_object_name(&name) {
            return Err(self.unknown_drop(&name));
        }
        let mut conn = self.redis.clone();
        match self.drops.get(&mut conn, &name).await {
            Ok(Some(drop)) => Ok(drop),
            Ok(None) => Err(self.unknown_drop(&name)),
            Err(LookupError::Unavailable(e)) => Err(Answer::unavailable(format!(
                "Redis is unreachable and this sidecar has not seen drop {name} before: {e}"
            ))),
            Err(e @ LookupError::Damaged(_)) => Err(Answer::unavailable(format!(
                "drop {name} cannot be served: {e}"
            ))),
        }
    }

    pub fn unknown_drop(&self, name: &str) -> Answer {
        Answer::refusal(
            StatusCode::NOT_FOUND,
            "not_found",
            format!(
                "no drop named {name} in namespace {}",
                self.drops.namespace()
            ),
        )
    }

    /// The answer when Redis failed under a request and the drop's failure policy
    /// is Closed (policy Open goes to the fallback path instead).
    pub fn redis_down(&self, drop: &Drop, error: &redis::RedisError) -> Answer {
        let policy = drop.config().failure_policy;
        tracing::warn!(drop = %drop.name, %error, "Redis failed");
        match policy {
            FailurePolicy::Closed => Answer::unavailable(format!(
                "Redis is unreachable and drop {} has failurePolicy Closed: nothing is sold until it is back",
                drop.name
            )),
            FailurePolicy::Open => Answer::unavailable(format!(
                "Redis is unreachable for drop {}: {error}",
                drop.name
            )),
        }
    }

    /// Brings Redis in line with what the fallback path changed for `drop`, before
    /// the gate is used again. Best effort: while it fails the flag stays set.
    pub async fn replay(&self, drop: &Drop) {
        if !drop
            .needs_replay
            .swap(false, std::sync::atomic::Ordering::AcqRel)
        {
            return;
        }
        if drop
            .needs_rebuild
            .swap(false, std::sync::atomic::Ordering::AcqRel)
            && let Err(error) = self.ledger.replay_all(&drop.ledger_key()).await
        {
            drop.needs_rebuild
                .store(true, std::sync::atomic::Ordering::Release);
            drop.needs_replay
                .store(true, std::sync::atomic::Ordering::Release);
            tracing::debug!(drop = %drop.name, %error, "rebuild from the ledger failed");
            return;
        }
        if let Err(error) = self.replay_now(drop).await {
            drop.needs_replay
                .store(true, std::sync::atomic::Ordering::Release);
            tracing::debug!(drop = %drop.name, %error, "replay into Redis failed");
        }
    }

    /// Replays every fallback change of `drop` that Redis has not seen.
    pub async fn replay_now(&self, drop: &Drop) -> Result<usize, String> {
        let mut conn = self.redis.clone();
        let mut replayed = 0;
        loop {
            let rows = self
                .ledger
                .unreplayed(&drop.ledger_key(), 256)
                .await
                .map_err(|e| e.to_string())?;
            if rows.is_empty() {
                return Ok(replayed);
            }
            for row in &rows {
                crate::gate::replay(
                    &mut conn,
                    &drop.keys,
                    &row.key,
                    &row.user,
                    row.quantity,
                    row.state.as_str(),
                    row.expires_at_ms,
                )
                .await
                .map_err(|e| e.to_string())?;
                self.ledger
                    .mark_replayed(&drop.ledger_key(), &row.key, row.state)
                    .await
                    .map_err(|e| e.to_string())?;
                replayed += 1;
            }
        }
    }

    /// The answer for a drop the operator took off the Redis gate.
    pub fn not_gated(&self, drop: &Drop, mode: &str) -> Answer {
        match mode {
            "closed" => Answer::unavailable(format!(
                "drop {} is closed: its Redis is not highly available and the failure policy is Closed",
                drop.name
            )),
            _ => Answer::unavailable(format!("drop {} is in unknown mode {mode:?}", drop.name)),
        }
    }
}
