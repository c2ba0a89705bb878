//! Joins a promoted replica lost: a buyer whose join was answered `waiting` keeps
//! their place, whether the loss shows when Redis is checked against the ledger
//! or only when Redis hands the lost join's place out again.

mod common;

use common::failover::LossyFailover;
use common::{NS, Peer, eventually, one_per_buyer, seed};
use dropgate_api::DropKeys;
use dropgate_testkit::{RedisServer, Reply};
use serde_json::json;

/// `POST /v1/drops/{drop}/waitlist`.
async fn join(peer: &Peer, drop: &str, key: &str) -> Reply {
    let body = json!({"key": key, "user": key, "quantity": 1});
    peer.http
        .post(&format!("/v1/drops/{drop}/waitlist"), &body.to_string())
        .await
        .expect("answers")
}

/// `GET /v1/drops/{drop}/waitlist/{key}`.
async fn look(peer: &Peer, drop: &str, key: &str) -> Reply {
    peer.http
        .get(&format!("/v1/drops/{drop}/waitlist/{key}"))
        .await
        .expect("answers")
}

/// Whether `redis` holds `key`'s entry in `drop`'s lines.
fn has_entry(redis: &RedisServer, drop: &str, key: &str) -> bool {
    let mut conn = redis.connection().expect("connect");
    redis::cmd("EXISTS")
        .arg(DropKeys::new(NS, drop).waitlist_entry(key))
        .query(&mut conn)
        .expect("EXISTS")
}

/// A replica promoted without the last join the ledger recorded, whose position
/// counter reads as far as the ledger's anyway: a join that ran there unchecked
/// took the lost join's position and was taken back, which leaves the counter
/// where it is (written here straight into the replica, as that join would). Redis
/// must not then pass for in line with the ledger (before: the counter decided
/// alone, and the entry was gone for good).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_join_a_replica_lost_behind_a_counter_as_far_keeps_its_place() {
    let mut redis = LossyFailover::start().await;
    seed(
        &redis.primary.url(),
        "sale",
        one_per_buyer(1).waitlist().fail_closed(),
    )
    .await;
    // Neither the refresh nor the sweeper checks the replica in the meantime: only
    // the calls below do.
    let sidecar = Peer::start_custom(&redis.proxy.redis_url(), &redis.ledger, |settings| {
        settings.refresh_ms = 3000;
        settings.sweep_ms = 60_000;
    })
    .await;
    sidecar
        .reserve("sale", "k0", "k0", 1)
        .await
        .assert_answer(201, "admitted");
    join(&sidecar, "sale", "w1")
        .await
        .assert_answer(201, "waiting");
    eventually("the replica to hold w1's entry", async || {
        has_entry(&redis.replica, "sale", "w1")
    })
    .await;
    redis.cut_off_replica_holding("sale", 1).await;
    // A join that ran on the replica took position 2 and was taken back.
    let mut replica = redis.replica.connection().expect("connect");
    let counter: i64 = redis::cmd("INCR")
        .arg(DropKeys::new(NS, "sale").waitlist_counter())
        .query(&mut replica)
        .expect("INCR");
    assert_eq!(counter, 2);
    // w2 joins at position 2, on the primary alone.
    let joined = join(&sidecar, "sale", "w2").await;
    joined.assert_answer(201, "waiting");
    assert_eq!(joined.body["position"], 2, "{}", joined.text);

    redis.fail_over(&sidecar, "sale").await;
    let mut looked = look(&sidecar, "sale", "w2").await;
    if looked.status == 503 {
        // (Answered while the breaker was open; asked again past it.)
        tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
        looked = look(&sidecar, "sale", "w2").await;
    }
    looked.assert_answer(200, "waiting");
    assert_eq!(looked.body["position"], 2, "{}", looked.text);
    assert!(has_entry(&redis.replica, "sale", "w2"));
    sidecar.shutdown().await;
}

/// The ledger records a join Redis no longer has after Redis was checked (a join
/// placed on the old primary whose commit landed late, after the check of the
/// promoted replica: written here straight into the ledger, at the next place).
/// The next join is then handed that same place by Redis: the ledger refuses it
/// (503, nothing changed) and Redis is rebuilt, the lost join with it; the retry
/// joins behind it. Before, the ledger recorded two joins at one place, and the
/// first was lost from the line for good (404).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_place_in_line_handed_out_twice_is_refused_and_the_lost_join_kept() {
    let redis = RedisServer::start().expect("redis-server");
    let dir = tempfile::tempdir().expect("temp dir");
    let ledger_url = format!("sqlite://{}", dir.path().join("ledger.db").display());
    seed(&redis.url(), "sale", one_per_buyer(1).waitlist().fail_closed()).await;
    // No check of Redis by the refresh in the meantime: only the calls below run.
    let sidecar = Peer::start_custom(&redis.url(), &ledger_url, |settings| {
        settings.refresh_ms = 3000;
        settings.sweep_ms = 60_000;
    })
    .await;
    sidecar
        .reserve("sale", "k0", "k0", 1)
        .await
        .assert_answer(201, "admitted");
    join(&sidecar, "sale", "w1")
        .await
        .assert_answer(201, "waiting");
    let ledger = dropgate_sidecar::ledger::Ledger::open(&ledger_url)
        .await
        .expect("the ledger");
    let mut conn = redis.connection().expect("connect");
    let sale: String = redis::cmd("HGET")
        .arg(DropKeys::new(NS, "sale").config())
        .arg("sale")
        .query(&mut conn)
        .expect("HGET sale");
    let lost = dropgate_sidecar::ledger::waitlist::Join {
        key: "lost",
        user: "lost",
        quantity: 1,
        variant: None,
        position: 2,
        attempt: "late",
    };
    ledger
        .join(&dropgate_api::keys::ledger_key(NS, "sale", &sale), lost)
        .await
        .expect("the late join's write");

    let twice = join(&sidecar, "sale", "w3").await;
    twice.assert_answer(503, "unavailable");
    assert!(twice.text.contains("twice"), "{}", twice.text);
    let joined = join(&sidecar, "sale", "w3").await;
    joined.assert_answer(201, "waiting");
    assert_eq!(joined.body["position"], 3, "{}", joined.text);
    let kept = look(&sidecar, "sale", "lost").await;
    kept.assert_answer(200, "waiting");
    assert_eq!(kept.body["position"], 2, "{}", kept.text);
    sidecar.shutdown().await;
}
