//! A replica promoted without a hold's extension: a call checked before the
//! failover runs its script there past the hold's old deadline, and the script
//! expires the hold, taking the number of the extension the replica lost. Redis
//! must not then pass for in line with the ledger (which keeps the hold active
//! until its new deadline), and once it is brought in line the hold is held again
//! (before: Redis passed for in line, and the hold read `expired`). Fault points
//! are process-wide, so this file holds one test.

mod common;

use std::time::Duration;

use common::failover::LossyFailover;
use common::{Peer, eventually, one_per_buyer, redis_counts, seed};
use dropgate_sidecar::faults::{self, Fault};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hold_a_stale_replica_expired_after_missing_its_extension_is_held_again() {
    let mut redis = LossyFailover::start().await;
    let hold = one_per_buyer(6)
        .hold_seconds(3)
        .acquire_timeout_ms(500)
        .max_hold_seconds(3600)
        .fail_closed();
    seed(&redis.primary.url(), "sale", hold).await;
    // Neither the refresh nor the sweeper checks the replica in the meantime: only
    // the calls below do.
    let sidecar = Peer::start_custom(&redis.proxy.redis_url(), &redis.ledger, |settings| {
        settings.refresh_ms = 3000;
        settings.sweep_ms = 60_000;
    })
    .await;
    let reserved = std::time::Instant::now();
    sidecar
        .reserve("sale", "k", "k", 1)
        .await
        .assert_answer(201, "admitted");
    // Cut off from here on: the replica misses the extension.
    redis.cut_off_replica_holding("sale", 1).await;
    sidecar
        .extend("sale", "k", 600)
        .await
        .assert_answer(200, "extended");
    // Past k's first deadline, which is all the replica knows of.
    tokio::time::sleep(Duration::from_millis(3300).saturating_sub(reserved.elapsed())).await;

    // The look-up of k is checked now and runs 300 ms later, on the replica: the
    // primary died and a call failed on the dead connection meanwhile.
    faults::arm(Fault::PauseAfterCheck, 1);
    let stale = sidecar.lookup("sale", "k");
    let failover = redis.fail_over(&sidecar, "sale");
    let (stale, _) = tokio::join!(stale, failover);
    if stale.status == 503 {
        // (Answered while the breaker was open; asked again past it.)
        tokio::time::sleep(Duration::from_millis(1100)).await;
    }
    let looked = sidecar.lookup("sale", "k").await;
    assert_eq!(looked.status, 200, "{}", looked.text);
    assert_eq!(looked.body["state"], "active", "{}", looked.text);
    sidecar
        .settle("sale", "k", "confirm")
        .await
        .assert_answer(200, "confirmed");
    eventually("Redis to hold what the ledger holds", async || {
        redis_counts(&redis.replica, "sale") == (5, 1)
    })
    .await;
    sidecar.shutdown().await;
}
