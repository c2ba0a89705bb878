//! What every request handler shares, and the answers about a drop itself.

use std::sync::Arc;
use std::time::Duration;

use dropgate_api::FailurePolicy;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use warp::http::StatusCode;

use crate::answer::Answer;
use crate::clock::now_ms;
use crate::drops::{Drop, Drops, LookupError};
use crate::ledger::Ledger;
use crate::metrics::Metrics;
use crate::replicas::Replicas;
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
    /// Replica acknowledgements an admission waits for (`--wait-replicas`).
    pub replicas: Replicas,
    /// Until when (ms since the epoch) Redis is taken as unreachable without asking
    /// it: after a connection failure, every request would otherwise wait out a
    /// reconnect attempt before its failure policy applied.
    redis_down_until: AtomicI64,
    /// When Redis last answered this sidecar (ms since the epoch): a Redis outage
    /// hands a drop to the ledger only once this sidecar, too, has not reached Redis
    /// for a while.
    redis_reached_at: AtomicI64,
    /// This process, in the ledger's record of which sidecars reach Redis.
    pub sidecar_id: String,
    /// How long no sidecar sharing the ledger may have reached Redis before a Redis
    /// outage hands a drop to the fallback gate (ms): a few refreshes, so that one
    /// sidecar's partition is told from everyone's outage.
    pub quiet_ms: i64,
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
            replicas: Replicas::new(settings.wait_replicas, settings.wait_timeout_ms),
            redis_down_until: AtomicI64::new(0),
            redis_reached_at: AtomicI64::new(0),
            sidecar_id: format!("{:016x}", rand::random::<u64>()),
            quiet_ms: i64::try_from(settings.refresh_ms.saturating_mul(4))
                .unwrap_or(i64::MAX)
                .max(1000),
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
        self.redis_reached_at.store(now_ms(), Ordering::Release);
    }

    /// When Redis last answered (ms since the epoch; 0 never).
    pub fn redis_reached_at(&self) -> i64 {
        self.redis_reached_at.load(Ordering::Acquire)
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

    /// The answer for a drop the operator closed (HA missing under policy Closed).
    pub fn closed(&self, drop: &Drop) -> Answer {
        Answer::unavailable(format!(
            "drop {} is closed: its Redis is not highly available and the failure policy is Closed",
            drop.name
        ))
    }
}
