//! A sidecar process that dies (as under `kill -9`) between placing a buyer in a
//! waitlist line and writing the place to the ledger, on a PostgreSQL ledger it
//! shares with another sidecar: the line is not held up by the half-made join, a
//! retry of the key through the other sidecar hears the truth (a fresh place in
//! line), and a unit that comes back goes to the first entry that really waits.

use std::time::{Duration, Instant};

use dropgate_e2e::processes::{SidecarProcess, apply};
use dropgate_testkit::{DropSpec, HttpClient, PostgresServer, RedisServer, Reply};

fn publish(dir: &std::path::Path, redis: &RedisServer) {
    let path = dir.join("sale.yaml");
    std::fs::write(
        &path,
        format!(
            "apiVersion: dropgate.io/v1alpha1\nkind: InventoryDrop\nmetadata: {{name: sale, namespace: shop}}\n\
             spec:\n  redis: {{url: redis://unused:1}}\n{}",
            DropSpec::new(1).per_user_limit(1).permits(100).waitlist().yaml()
        ),
    )
    .expect("manifest written");
    apply(&path, &redis.url()).expect("apply");
}

fn join_body(key: &str, user: &str) -> String {
    format!(r#"{{"key":"{key}","user":"{user}","quantity":1}}"#)
}

/// Polls `GET .../waitlist/{key}` until its outcome is `outcome`.
async fn until(http: &HttpClient, key: &str, outcome: &str) -> Reply {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let reply = http
            .get(&format!("/v1/drops/sale/waitlist/{key}"))
            .await
            .expect("answers");
        if reply.outcome() == outcome {
            return reply;
        }
        assert!(
            Instant::now() < deadline,
            "{key} never {outcome}: {}",
            reply.text
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecar_dying_mid_join_holds_up_nobody() {
    let redis = RedisServer::start().expect("redis-server");
    let postgres = PostgresServer::start().expect("PostgreSQL");
    let dir = tempfile::tempdir().expect("dir");
    publish(dir.path(), &redis);
    let steady = SidecarProcess::start(&redis.url(), "shop", &postgres.url())
        .await
        .expect("a sidecar starts");
    let http = HttpClient::new(steady.base.clone());
    http.post(
        "/v1/drops/sale/reservations",
        r#"{"key":"held","user":"h","quantity":1}"#,
    )
    .await
    .expect("answers")
    .assert_answer(201, "admitted");
    let doomed = SidecarProcess::start_with_env(
        &redis.url(),
        "shop",
        &postgres.url(),
        &[],
        &[("DROPGATE_FAULTS", "die-mid-join=1")],
    )
    .await
    .expect("the doomed sidecar starts");

    // Ann's join dies half made: first in line in Redis, unknown to the ledger.
    let answer = HttpClient::new(doomed.base.clone())
        .post("/v1/drops/sale/waitlist", &join_body("ann", "ann"))
        .await;
    assert!(
        answer.is_err(),
        "the sidecar died mid-join, yet answered: {answer:?}"
    );
    // Bob joins behind it, through the other sidecar.
    let bob = http
        .post("/v1/drops/sale/waitlist", &join_body("bob", "bob"))
        .await
        .expect("answers");
    bob.assert_answer(201, "waiting");
    assert_eq!(bob.body["position"], 2, "{}", bob.text);

    // A unit comes back: the half-made join is resolved (never written: it goes)
    // once past its bound, and Bob, the first who really waits, is served.
    http.post("/v1/drops/sale/reservations/held/cancel", "")
        .await
        .expect("answers")
        .assert_answer(200, "cancelled");
    let served = until(&http, "bob", "offered").await;
    assert_eq!(served.body["state"], "active", "{}", served.text);
    http.get("/v1/drops/sale/waitlist/ann")
        .await
        .expect("answers")
        .assert_answer(404, "not_found");
    // Ann's retry is decided afresh: a place at the end of the line.
    let ann = http
        .post("/v1/drops/sale/waitlist", &join_body("ann", "ann"))
        .await
        .expect("answers");
    ann.assert_answer(201, "waiting");
    assert_eq!(ann.body["position"], 1, "{}", ann.text);
    drop(doomed);
    steady.kill();
}
