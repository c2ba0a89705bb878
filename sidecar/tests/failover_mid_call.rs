//! Redis fails over between a call's check of Redis against the ledger and the
//! call's gate script (another call's failure made the client reconnect, to a
//! replica promoted without the last writes). Found by the linearizability-checked
//! histories (seed 29): a cancel made on the primary, made again on the promoted
//! replica, was answered `cancelled` twice. Fault points are process-wide, so this
//! file holds one test.

mod common;

use common::failover::LossyFailover;
use common::{NS, Peer, eventually, one_per_buyer, redis_counts, seed};
use dropgate_sidecar::faults::{self, Fault};
use sqlx::Row;

/// The units the ledger counts available and held (active or confirmed), in the
/// order of [`redis_counts`].
async fn ledger_counts(database_url: &str) -> (i64, i64) {
    let pool = sqlx::AnyPool::connect(database_url).await.expect("ledger");
    let like = format!("{NS}/sale/%");
    let held: i64 = sqlx::query(
        "SELECT COALESCE(SUM(quantity), 0) FROM reservations \
         WHERE drop_key LIKE $1 AND state IN ('active', 'confirmed')",
    )
    .bind(&like)
    .fetch_one(&pool)
    .await
    .expect("held")
    .try_get(0)
    .expect("a count");
    let available: i64 = sqlx::query("SELECT available FROM stock WHERE drop_key LIKE $1")
        .bind(&like)
        .fetch_one(&pool)
        .await
        .expect("stock row")
        .try_get(0)
        .expect("a count");
    (available, held)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cancel_checked_before_a_failover_and_run_after_it_is_already_cancelled() {
    let mut redis = LossyFailover::start().await;
    // Closed: a call that meets the failover fails, and hands nothing to the ledger.
    seed(&redis.primary.url(), "sale", one_per_buyer(6).fail_closed()).await;
    // Refreshes 3 s apart: no refresh compares the replica with the ledger first.
    let sidecar = Peer::start_with(&redis.proxy.redis_url(), &redis.ledger, 3000).await;
    for i in 0..3 {
        let key = format!("b-{i}");
        let reply = sidecar.reserve("sale", &key, &key, 1).await;
        reply.assert_answer(201, "admitted");
    }
    // The replica is cut off now: it misses the cancel below.
    redis.cut_off_replica_holding("sale", 3).await;
    let first = sidecar.settle("sale", "b-0", "cancel").await;
    first.assert_answer(200, "cancelled");

    // The cancel again, checked now and run 300 ms later: meanwhile the primary
    // dies, and a call fails on the dead connection (a read of the drop's page, or
    // the sidecar's own sweep): the client reconnects, to the promoted replica, where
    // b-0 is still held.
    faults::arm(Fault::PauseAfterCheck, 1);
    let again = sidecar.settle("sale", "b-0", "cancel");
    let failover = redis.fail_over(&sidecar, "sale");
    let (again, _) = tokio::join!(again, failover);
    again.assert_answer(200, "already_cancelled");

    // Redis is brought in line with the ledger: the unit went back once.
    let looked = sidecar.lookup("sale", "b-0").await;
    assert_eq!(looked.body["state"], "cancelled", "{}", looked.text);
    eventually("Redis to hold what the ledger holds", async || {
        redis_counts(&redis.replica, "sale") == (4, 2)
    })
    .await;
    assert_eq!(ledger_counts(&redis.ledger).await, (4, 2));
    sidecar.shutdown().await;
}
