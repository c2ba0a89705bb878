//! A call checked Redis against the ledger; its gate script then ran on a replica
//! promoted without the last writes (another call's failure made the client
//! reconnect there); another call then found that replica behind the ledger and
//! rebuilt it, before the first call judged its reply. The reply was read before
//! the rebuild: it must not be answered, though Redis counts as checked by then
//! (before: the reply was compared with the drop's latest check, which the
//! rebuild had renewed, and its stale `active` was answered).
//! Fault points are process-wide, so this file holds one test.

mod common;

use std::time::Duration;

use common::failover::LossyFailover;
use common::{Peer, eventually, one_per_buyer, redis_counts, seed};
use dropgate_sidecar::faults::{self, Fault};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_look_up_read_before_another_call_rebuilt_redis_reads_again() {
    let mut redis = LossyFailover::start().await;
    // Closed: a call that meets the failover fails, and hands nothing to the ledger.
    seed(&redis.primary.url(), "sale", one_per_buyer(6).fail_closed()).await;
    // Refreshes 3 s apart: only the calls below compare the replica with the ledger.
    let sidecar = Peer::start_with(&redis.proxy.redis_url(), &redis.ledger, 3000).await;
    for i in 0..3 {
        let key = format!("b-{i}");
        sidecar
            .reserve("sale", &key, &key, 1)
            .await
            .assert_answer(201, "admitted");
    }
    // Cut off from here on: the replica misses the cancel.
    redis.cut_off_replica_holding("sale", 3).await;
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
        redis.fail_over(&sidecar, "sale").await;
        // Past the breaker's second, the next call checks the replica.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        sidecar.lookup("sale", "b-2").await
    };
    let (stale, checked) = tokio::join!(stale, failover);
    assert_eq!(checked.body["state"], "active", "{}", checked.text);
    assert_eq!(stale.status, 200, "{}", stale.text);
    assert_eq!(stale.body["state"], "cancelled", "{}", stale.text);
    eventually("Redis to hold what the ledger holds", async || {
        redis_counts(&redis.replica, "sale") == (4, 2)
    })
    .await;
    sidecar.shutdown().await;
}
