//! A call checked Redis against the ledger; its gate script then ran on a replica
//! promoted without the last writes (another call's failure made the client
//! reconnect there); another call then found that replica behind the ledger and
//! rebuilt it, before the first call judged its reply. The reply was read before
//! the rebuild: it must not be answered, though Redis counts as checked by then.
//! Fault points are process-wide, so this file holds one test.

mod common;

use std::time::Duration;

use common::{Peer, eventually, one_per_buyer, redis_counts, seed};
use dropgate_sidecar::faults::{self, Fault};
use dropgate_testkit::{RedisServer, TcpProxy};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_look_up_read_before_another_call_rebuilt_redis_reads_again() {
    sqlx::any::install_default_drivers();
    let mut primary = RedisServer::start().expect("redis-server");
    let replica = RedisServer::start_replica_of(&primary).expect("replica");
    let proxy = TcpProxy::start(primary.port()).await.expect("proxy");
    let dir = tempfile::tempdir().expect("temp dir");
    let ledger = format!("sqlite://{}", dir.path().join("ledger.db").display());
    // Closed: a call that meets the failover fails, and hands nothing to the ledger.
    seed(&primary.url(), "sale", one_per_buyer(6).fail_closed()).await;
    // Refreshes 3 s apart: only the calls below compare the replica with the ledger.
    let sidecar = Peer::start_with(&proxy.redis_url(), &ledger, 3000).await;
    for i in 0..3 {
        let key = format!("b-{i}");
        sidecar
            .reserve("sale", &key, &key, 1)
            .await
            .assert_answer(201, "admitted");
    }
    eventually("the replica to catch up", async || {
        redis_counts(&replica, "sale").1 == 3
    })
    .await;
    // Cut off from here on: the replica misses the cancel.
    replica.promote().expect("REPLICAOF NO ONE");
    sidecar
        .settle("sale", "b-0", "cancel")
        .await
        .assert_answer(200, "cancelled");

    // The look-up of b-0 is checked now; its script runs 300 ms later, after the
    // primary died and a call failed on the dead connection (the client
    // reconnected, to the replica, where b-0 is still held); its reply is judged
    // 1.5 s after that, when another call has found the replica behind and rebuilt
    // it.
    faults::arm(Fault::PauseAfterCheck, 1);
    faults::arm(Fault::PauseAfterReply, 1);
    let stale = sidecar.lookup("sale", "b-0");
    let failover = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        primary.stop();
        proxy.point_to(replica.port()).await;
        let failed = sidecar.lookup("sale", "b-1").await;
        // Past the breaker's second, the next call checks the replica.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let checked = sidecar.lookup("sale", "b-2").await;
        (failed, checked)
    };
    let (stale, (failed, checked)) = tokio::join!(stale, failover);
    assert!(
        failed.status == 503 || failed.body["state"] == "active",
        "{}",
        failed.text
    );
    assert_eq!(checked.body["state"], "active", "{}", checked.text);
    assert_eq!(stale.status, 200, "{}", stale.text);
    assert_eq!(stale.body["state"], "cancelled", "{}", stale.text);
    eventually("Redis to hold what the ledger holds", async || {
        redis_counts(&replica, "sale") == (4, 2)
    })
    .await;
    sidecar.shutdown().await;
}
