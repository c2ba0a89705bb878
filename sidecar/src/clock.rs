//! The sidecar's clock: Redis's, whenever Redis answers.
//!
//! The gate judges deadlines and the sale window by Redis's `TIME`, inside its
//! scripts. What the sidecar judges itself (the fallback's window and holds, the
//! ledger's sweeper and repair, permit release, outbox claims) uses the same
//! clock: the local clock corrected by its offset to Redis, measured at every
//! config refresh. While Redis cannot be reached the last offset stays, so a
//! machine whose clock is off never decides a deadline differently from the gate.

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Redis's clock minus ours, in ms, as last measured.
static OFFSET_MS: AtomicI64 = AtomicI64::new(0);

/// Milliseconds since the Unix epoch, on Redis's clock.
pub fn now_ms() -> i64 {
    local_ms() + OFFSET_MS.load(Ordering::Relaxed)
}

/// Milliseconds since the Unix epoch on this machine's clock.
pub fn local_ms() -> i64 {
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0);
    ms + crate::faults::clock_skew_ms()
}

/// Records Redis's `TIME` (`redis_ms`), asked at local `sent` and answered at
/// local `received`: Redis read its clock about halfway between.
pub fn observe_redis(redis_ms: i64, sent: i64, received: i64) {
    let midpoint = sent + (received - sent) / 2;
    OFFSET_MS.store(redis_ms - midpoint, Ordering::Relaxed);
}
