//! Waiting for Redis replicas to acknowledge admissions before the 201 (Redis
//! `WAIT`), for shops that prefer a little latency to a rebuild window after a
//! failover.
//!
//! `WAIT` covers every earlier write of the connection it is sent on, and every
//! request shares one multiplexed connection: one `WAIT` in flight at a time
//! covers every admission written before it was sent, so concurrent admissions
//! share it instead of queueing one each.

use std::sync::atomic::{AtomicU64, Ordering};

use dropgate_redis::Connection;
use redis::RedisResult;

#[derive(Debug)]
pub struct Replicas {
    /// Replicas that must acknowledge (0: do not wait).
    wanted: u32,
    timeout_ms: u64,
    /// One `WAIT` in flight at a time.
    round: tokio::sync::Mutex<()>,
    /// Tickets handed out, one per admission written.
    issued: AtomicU64,
    /// Every ticket below this one is covered by a finished `WAIT`.
    covered: AtomicU64,
}

impl Replicas {
    pub fn new(wanted: u32, timeout_ms: u64) -> Self {
        Self {
            wanted,
            timeout_ms,
            round: tokio::sync::Mutex::new(()),
            issued: AtomicU64::new(0),
            covered: AtomicU64::new(0),
        }
    }

    /// Waits until `wanted` replicas acknowledged the writes this request made
    /// (call it after they completed), or the timeout passed. Returns whether they
    /// did; `true` at once when no replica is wanted.
    pub async fn acknowledged(&self, conn: &mut Connection) -> RedisResult<bool> {
        if self.wanted == 0 {
            return Ok(true);
        }
        let ticket = self.issued.fetch_add(1, Ordering::AcqRel);
        let _round = self.round.lock().await;
        if self.covered.load(Ordering::Acquire) > ticket {
            return Ok(true);
        }
        let covers = self.issued.load(Ordering::Acquire);
        let acked: i64 = redis::cmd("WAIT")
            .arg(self.wanted)
            .arg(self.timeout_ms)
            .query_async(conn)
            .await?;
        let enough = acked >= i64::from(self.wanted);
        if enough {
            self.covered.fetch_max(covers, Ordering::AcqRel);
        }
        Ok(enough)
    }
}
