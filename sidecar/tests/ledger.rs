//! The ledger and its outbox through the real API: every change is recorded with
//! its event, events reach the drop's stream, a redelivered event has one effect,
//! and each crash point leaves the invariants true. Fault points are process-wide,
//! so this file holds one test.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::Sidecar;
use dropgate_api::DropKeys;
use dropgate_sidecar::faults::{self, Fault};
use dropgate_sidecar::ledger::{Ledger, outbox};
use dropgate_testkit::DropSpec;
use futures::future::join_all;
use sqlx::Row;

async fn events(ledger: &Ledger) -> Vec<String> {
    sqlx::query("SELECT event_id FROM outbox ORDER BY id")
        .fetch_all(ledger.pool())
        .await
        .expect("query")
        .iter()
        .map(|row| row.get::<String, _>(0))
        .collect()
}

/// Stream entries of the drop: (eventId, payload).
fn stream(sidecar: &Sidecar) -> Vec<(String, String)> {
    let mut conn = sidecar.redis.connection().expect("connect");
    let entries: Vec<(String, HashMap<String, String>)> = redis::cmd("XRANGE")
        .arg(DropKeys::new(common::NS, "sale").events())
        .arg("-")
        .arg("+")
        .query(&mut conn)
        .expect("XRANGE");
    entries
        .into_iter()
        .map(|(_, fields)| (fields["eventId"].clone(), fields["payload"].clone()))
        .collect()
}

async fn wait_until<F: Fn() -> bool>(what: &str, done: F) {
    for _ in 0..100 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("timed out waiting for {what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_change_is_recorded_published_and_consumed_once() {
    let sidecar = Sidecar::start().await;
    sidecar
        .seed("sale", DropSpec::new(50).per_user_limit(2).permits(1000))
        .await;
    let ledger = common::ledger_of(&sidecar).await;

    // Group commit: 60 concurrent buyers, every 201 durable in the ledger.
    let replies = join_all((0..60).map(|i| {
        let sidecar = &sidecar;
        async move {
            sidecar
                .reserve("sale", &format!("k{i}"), &format!("u{i}"), 1)
                .await
        }
    }))
    .await;
    let admitted: Vec<String> = replies
        .iter()
        .filter(|r| r.status == 201)
        .map(|r| r.body["key"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(admitted.len(), 50);
    let recorded = common::ledger_states(&ledger).await;
    for key in &admitted {
        assert_eq!(
            recorded.get(key).map(String::as_str),
            Some("active"),
            "{key} is durable"
        );
    }
    assert_eq!(recorded.len(), 50, "refusals are not recorded");
    // Which 50 of the 60 win is up to the race: work with keys that did.
    let [k0, k1, k2, k3, k4] = [0, 1, 2, 3, 4].map(|i| admitted[i].clone());
    assert_eq!(
        sidecar.settle("sale", &k0, "confirm").await.outcome(),
        "confirmed"
    );
    assert_eq!(
        sidecar.settle("sale", &k1, "cancel").await.outcome(),
        "cancelled"
    );
    assert_eq!(
        sidecar.settle("sale", &k1, "cancel").await.outcome(),
        "already_cancelled"
    );
    let recorded = common::ledger_states(&ledger).await;
    assert_eq!(recorded[&k0], "confirmed");
    assert_eq!(recorded[&k1], "cancelled");
    let ids = events(&ledger).await;
    let sale = sidecar.ledger_key("sale");
    assert_eq!(
        ids.iter().filter(|id| id.ends_with("/admitted")).count(),
        50
    );
    assert!(ids.contains(&format!("{sale}/{k0}/confirmed")));
    assert_eq!(
        ids.iter()
            .filter(|id| **id == format!("{sale}/{k1}/cancelled"))
            .count(),
        1,
        "a duplicate cancel writes no event"
    );

    // The dispatcher publishes them all, in order, as canonical JSON.
    wait_until("the outbox to drain", || {
        stream(&sidecar).len() == ids.len()
    })
    .await;
    let published = stream(&sidecar);
    let published_ids: Vec<String> = published.iter().map(|(id, _)| id.clone()).collect();
    assert_eq!(published_ids, ids);
    let (_, payload) = &published[0];
    assert!(payload.starts_with(r#"{"at":"#), "sorted keys: {payload}");
    assert!(!payload.contains(' '), "no spaces: {payload}");
    // (Each is marked sent just after its delivery: the stream may be ahead.)
    common::eventually("the outbox to mark them sent", async || {
        outbox::pending(ledger.pool()).await.expect("count") == 0
    })
    .await;

    // The publisher dies right after a delivery, before marking it sent: the event
    // is delivered twice, and the consumer applies it once.
    faults::arm(Fault::AfterPublishBeforeAck, 1);
    assert_eq!(
        sidecar.settle("sale", &k2, "confirm").await.outcome(),
        "confirmed"
    );
    wait_until("the redelivery", || {
        stream(&sidecar)
            .iter()
            .filter(|(id, _)| *id == format!("{sale}/{k2}/confirmed"))
            .count()
            == 2
    })
    .await;
    let consumer_dir = tempfile::tempdir().expect("dir");
    let consumer = Ledger::open(&format!(
        "sqlite://{}",
        consumer_dir.path().join("c.db").display()
    ))
    .await
    .expect("consumer store");
    sqlx::query("CREATE TABLE shipments (event_id TEXT NOT NULL)")
        .execute(consumer.pool())
        .await
        .expect("table");
    let mut applied = 0;
    for (event_id, _) in stream(&sidecar) {
        let id = event_id.clone();
        let ran = outbox::consume_once(consumer.pool(), "shipping", &event_id, move |tx| {
            Box::pin(async move {
                sqlx::query("INSERT INTO shipments (event_id) VALUES ($1)")
                    .bind(id)
                    .execute(&mut **tx)
                    .await
                    .map(|_| ())
            })
        })
        .await
        .expect("consumes");
        applied += usize::from(ran);
    }
    let distinct = stream(&sidecar)
        .iter()
        .map(|(id, _)| id.clone())
        .collect::<std::collections::HashSet<_>>()
        .len();
    assert_eq!(applied, distinct, "one effect per event");
    let (shipments,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM shipments WHERE event_id = $1")
        .bind(format!("{sale}/{k2}/confirmed"))
        .fetch_one(consumer.pool())
        .await
        .expect("count");
    assert_eq!(shipments, 1);

    // A crash between the Redis admission and the ledger, or inside the ledger's
    // commit: refused, undone in Redis, absent from the ledger; a retry succeeds.
    sidecar.settle("sale", &k3, "cancel").await;
    sidecar.settle("sale", &k4, "cancel").await;
    for fault in [Fault::AfterRedisAdmit, Fault::BeforeLedgerCommit] {
        let before = sidecar.snapshot();
        faults::arm(fault, 1);
        let key = format!("crash-{fault:?}");
        let crashed = sidecar.reserve("sale", &key, &key, 1).await;
        crashed.assert_answer_because(503, "unavailable", &format!("{fault:?}"));
        assert_eq!(sidecar.snapshot(), before, "{fault:?}: Redis is as it was");
        assert!(
            !common::ledger_states(&ledger).await.contains_key(&key),
            "{fault:?}: not in the ledger"
        );
        let retry = sidecar.reserve("sale", &key, &key, 1).await;
        retry.assert_answer_because(201, "admitted", &format!("{fault:?}"));
        assert_eq!(
            common::ledger_states(&ledger)
                .await
                .get(&key)
                .map(String::as_str),
            Some("active")
        );
    }
    // A confirm the ledger could not record changed nothing: the hold is active in
    // Redis, its throttle permit still held; the retry confirms it.
    sidecar
        .seed("tight", DropSpec::new(5).permits(1).acquire_timeout_ms(20))
        .await;
    sidecar
        .reserve("tight", "t1", "t1", 1)
        .await
        .assert_answer(201, "admitted");
    let tight = || {
        sidecar
            .snapshot()
            .into_iter()
            .filter(|(key, _)| key.contains("{shop/tight}"))
            .collect::<Vec<_>>()
    };
    let before = tight();
    faults::arm(Fault::BeforeLedgerCommit, 1);
    sidecar
        .settle("tight", "t1", "confirm")
        .await
        .assert_answer(503, "unavailable");
    assert_eq!(tight(), before, "the failed confirm changed nothing");
    sidecar
        .reserve("tight", "t2", "t2", 1)
        .await
        .assert_answer(503, "throttled");
    sidecar
        .settle("tight", "t1", "confirm")
        .await
        .assert_answer(200, "confirmed");
    sidecar
        .reserve("tight", "t2", "t2", 1)
        .await
        .assert_answer(201, "admitted");
    let (t1,): (String,) = sqlx::query_as(
        "SELECT state FROM reservations WHERE drop_key LIKE 'shop/tight/%' AND res_key = 't1'",
    )
    .fetch_one(ledger.pool())
    .await
    .expect("t1 is in the ledger");
    assert_eq!(t1, "confirmed");

    sidecar.assert_invariants("sale", 50);
    let held: i64 = sqlx::query("SELECT COALESCE(SUM(quantity), 0) FROM reservations WHERE drop_key LIKE 'shop/sale/%' AND state IN ('active', 'confirmed')")
        .fetch_one(ledger.pool())
        .await
        .expect("sum")
        .get(0);
    assert_eq!(held, sidecar.held("sale"), "Redis and the ledger agree");
}
