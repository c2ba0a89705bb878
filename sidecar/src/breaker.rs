//! The Redis breaker: whether a Redis (or one shard of a cluster) is taken as
//! reachable, so that a request after a connection failure applies its drop's
//! failure policy at once instead of waiting out a reconnect.

use std::sync::atomic::{AtomicI64, Ordering};

use crate::clock::now_ms;

/// How long one connection failure keeps requests off Redis. The background refresh
/// asks Redis twice as often and closes the breaker as soon as it answers.
const REDIS_BREAK_MS: i64 = 1000;

/// Whether a Redis (or one shard of a cluster) is taken as reachable.
#[derive(Debug, Default)]
pub struct Breaker {
    /// Until when (ms since the epoch) it is taken as unreachable without asking
    /// it: after a connection failure, every request would otherwise wait out a
    /// reconnect attempt before its failure policy applied.
    down_until: AtomicI64,
    /// When it last answered this sidecar (ms since the epoch): a Redis outage
    /// hands a drop to the ledger only once this sidecar, too, has not reached Redis
    /// for a while.
    reached_at: AtomicI64,
    /// Connection-level failures so far: after one, the Redis that answers may be
    /// another (a replica promoted in a failover, which may have missed writes), so
    /// each drop is checked against the ledger again before Redis answers for it.
    failures: std::sync::atomic::AtomicU64,
}

impl Breaker {
    /// The error to act on while Redis is taken as unreachable, if it is.
    pub fn tripped(&self) -> Option<redis::RedisError> {
        (now_ms() < self.down_until.load(Ordering::Acquire)).then(|| {
            redis::RedisError::from((
                redis::ErrorKind::Client,
                "Redis is unreachable (a connection failed within the last second)",
            ))
        })
    }

    /// Notes a failed Redis call: a connection-level failure opens the breaker.
    pub fn failed(&self, error: &redis::RedisError) {
        if error.is_io_error()
            || error.is_connection_refusal()
            || error.is_connection_dropped()
            || error.is_timeout()
        {
            self.failures.fetch_add(1, Ordering::AcqRel);
            self.down_until
                .store(now_ms() + REDIS_BREAK_MS, Ordering::Release);
        }
    }

    /// Connection-level failures so far (see the field).
    pub fn failures(&self) -> u64 {
        self.failures.load(Ordering::Acquire)
    }

    /// Notes that Redis answered: requests go to it again.
    pub fn answered(&self) {
        self.down_until.store(0, Ordering::Release);
        self.reached_at.store(now_ms(), Ordering::Release);
    }

    /// When Redis last answered (ms since the epoch; 0 never).
    pub fn reached_at(&self) -> i64 {
        self.reached_at.load(Ordering::Acquire)
    }
}
