//! Redis going away and coming back, and the sidecar's own shutdown.

mod common;

use std::time::Duration;

use common::Sidecar;
use dropgate_testkit::{DropSpec, HttpClient};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
/// Under failurePolicy Closed (Open sells through the ledger: tests/fallback.rs).
async fn a_redis_restart_needs_no_sidecar_restart() {
    let mut sidecar = Sidecar::start().await;
    sidecar.seed("sale", DropSpec::new(10).fail_closed()).await;
    assert_eq!(
        sidecar.reserve("sale", "before", "alice", 1).await.status,
        201
    );
    assert_eq!(
        sidecar.http.get("/readyz").await.expect("answers").status,
        200
    );

    sidecar.redis.stop();
    let down = sidecar.reserve("sale", "during", "bob", 1).await;
    down.assert_answer(503, "unavailable");
    assert!(
        down.body["message"]
            .as_str()
            .is_some_and(|m| m.contains("Redis"))
    );
    let known = sidecar.http.get("/v1/drops/sale").await.expect("answers");
    assert_eq!(
        known.status, 503,
        "a known drop is never not_found during an outage"
    );
    let unseen = sidecar.reserve("other", "k", "bob", 1).await;
    unseen.assert_answer(503, "unavailable");
    let ready = sidecar.http.get("/readyz").await.expect("answers");
    assert_eq!(
        ready.status, 200,
        "a Redis outage does not take the pod out of service"
    );
    assert!(
        ready.body["redis"]
            .as_str()
            .is_some_and(|r| r.starts_with("unreachable"))
    );
    assert_eq!(
        sidecar.http.get("/healthz").await.expect("answers").status,
        200
    );

    // The restarted Redis is empty (no persistence here): the operator re-seeds it on
    // its next reconcile, and the sidecar reloads its scripts on NOSCRIPT.
    sidecar.redis.restart().expect("redis restarts");
    sidecar.seed("sale", DropSpec::new(10).fail_closed()).await;
    let mut admitted = None;
    for attempt in 0..50 {
        let reply = sidecar
            .reserve("sale", &format!("after-{attempt}"), "carol", 1)
            .await;
        if reply.status == 201 {
            admitted = Some(reply);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(admitted.is_some(), "admits again after the restart");
    sidecar.assert_invariants("sale", 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_in_flight_requests_finish() {
    let sidecar = Sidecar::start().await;
    sidecar
        .seed("sale", DropSpec::new(10).permits(1).acquire_timeout_ms(500))
        .await;
    assert_eq!(sidecar.reserve("sale", "a", "alice", 1).await.status, 201);
    // This request waits up to 500 ms for a permit; shut down while it waits.
    let http = HttpClient::new(format!("http://{}", sidecar.addr));
    let waiting = tokio::spawn(async move {
        http.post(
            "/v1/drops/sale/reservations",
            r#"{"key":"b","user":"bob","quantity":1}"#,
        )
        .await
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let redis_url = sidecar.redis.url();
    let addr = sidecar.addr;
    let stopping = tokio::spawn(sidecar.shutdown());
    let reply = waiting
        .await
        .expect("joins")
        .expect("the in-flight request got its answer");
    assert_eq!(reply.outcome(), "throttled");
    stopping.await.expect("run returned");
    assert!(
        HttpClient::new(format!("http://{addr}"))
            .get("/healthz")
            .await
            .is_err()
    );
    let _ = redis_url;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_lost_its_data_is_rebuilt_from_the_ledger() {
    let mut sidecar = Sidecar::start().await;
    let spec = DropSpec::new(10).per_user_limit(5);
    sidecar.seed("sale", &spec).await;
    assert_eq!(sidecar.reserve("sale", "a", "alice", 2).await.status, 201);
    assert_eq!(sidecar.reserve("sale", "b", "bob", 3).await.status, 201);
    assert_eq!(
        sidecar.settle("sale", "a", "confirm").await.outcome(),
        "confirmed"
    );
    assert_eq!(sidecar.reserve("sale", "c", "carol", 1).await.status, 201);
    assert_eq!(
        sidecar.settle("sale", "c", "cancel").await.outcome(),
        "cancelled"
    );

    // A failover to a replica that had none of it; the operator seeds fresh stock.
    sidecar.redis.restart().expect("restarts");
    sidecar.seed("sale", &spec).await;
    let mut rebuilt = false;
    for _ in 0..60 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if sidecar.held("sale") == 5 && sidecar.remaining("sale") == 5 {
            rebuilt = true;
            break;
        }
    }
    assert!(
        rebuilt,
        "remaining {} held {}",
        sidecar.remaining("sale"),
        sidecar.held("sale")
    );
    assert_eq!(sidecar.lookup("sale", "a").await.body["state"], "confirmed");
    assert_eq!(sidecar.lookup("sale", "b").await.body["state"], "active");
    let retry = sidecar.reserve("sale", "b", "bob", 3).await;
    assert_eq!(
        retry.outcome(),
        "already_reserved",
        "acknowledged keys stay recognised"
    );
    let limit = sidecar.reserve("sale", "d", "bob", 3).await;
    assert_eq!(
        limit.outcome(),
        "per_user_limit_exceeded",
        "buyer counts are rebuilt too"
    );
    sidecar.assert_invariants("sale", 10);
}
