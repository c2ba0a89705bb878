//! A replica promoted without a hold's extension: a call checked before the
//! failover runs its script there past the hold's old deadline, and the script
//! expires the hold, taking the number of the extension the replica lost. Redis
//! must not then pass for in line with the ledger (which holds the hold until its
//! new deadline), and once it is brought in line the hold is held again. Fault
//! points are process-wide, so this file holds one test.

mod common;

use std::time::Duration;

use common::{Peer, eventually, one_per_buyer, redis_counts, seed};
use dropgate_sidecar::faults::{self, Fault};
use dropgate_testkit::{RedisServer, TcpProxy};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hold_a_stale_replica_expired_after_missing_its_extension_is_held_again() {
    sqlx::any::install_default_drivers();
    let mut primary = RedisServer::start().expect("redis-server");
    let replica = RedisServer::start_replica_of(&primary).expect("replica");
    let proxy = TcpProxy::start(primary.port()).await.expect("proxy");
    let dir = tempfile::tempdir().expect("temp dir");
    let ledger = format!("sqlite://{}", dir.path().join("ledger.db").display());
    let hold = one_per_buyer(6)
        .hold_seconds(3)
        .acquire_timeout_ms(500)
        .max_hold_seconds(3600)
        .fail_closed();
    seed(&primary.url(), "sale", hold).await;
    // Neither the refresh nor the sweeper checks the replica in the meantime: only
    // the calls below do.
    let sidecar = Peer::start_custom(&proxy.redis_url(), &ledger, |settings| {
        settings.refresh_ms = 3000;
        settings.sweep_ms = 60_000;
    })
    .await;
    let reserved = std::time::Instant::now();
    for key in ["k", "b-1"] {
        sidecar
            .reserve("sale", key, key, 1)
            .await
            .assert_answer(201, "admitted");
    }
    eventually("the replica to catch up", async || {
        redis_counts(&replica, "sale").1 == 2
    })
    .await;
    // Cut off from here on: the replica misses the extension.
    replica.promote().expect("REPLICAOF NO ONE");
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
    let failover = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        primary.stop();
        proxy.point_to(replica.port()).await;
        sidecar.lookup("sale", "b-1").await
    };
    let (stale, failed) = tokio::join!(stale, failover);
    assert!(
        failed.status == 503 || failed.body["state"] == "active",
        "{}",
        failed.text
    );
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
        redis_counts(&replica, "sale") == (4, 2)
    })
    .await;
    sidecar.shutdown().await;
}
