//! The same answers on both paths: every case runs once through the Redis gate and
//! once through the ledger's fallback gate (the kill switch), and must read the same.

mod common;

use std::time::Duration;

use common::Sidecar;
use dropgate_testkit::DropSpec;

/// The two gates a sidecar sells through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    Gate,
    Fallback,
}

const PATHS: [Path; 2] = [Path::Gate, Path::Fallback];

impl Path {
    /// The drop every case sells, on this path.
    fn spec(self) -> DropSpec {
        let spec = DropSpec::new(10).per_user_limit(5);
        match self {
            Path::Gate => spec,
            Path::Fallback => spec.kill_switch(),
        }
    }

    /// The `Dropgate-Path` header an answer on this path carries.
    fn header(self) -> Option<&'static str> {
        match self {
            Path::Gate => None,
            Path::Fallback => Some("fallback"),
        }
    }
}

/// A sidecar whose sweeper sleeps through the test, on its own Redis and SQLite
/// ledger, selling `sale` seeded with `spec`: what finds a hold lapsed is the
/// request, never the sweeper. The Redis and the folder live as long as the tuple.
async fn without_sweeper(
    spec: DropSpec,
) -> (
    common::Peer,
    dropgate_testkit::RedisServer,
    tempfile::TempDir,
) {
    let redis = dropgate_testkit::RedisServer::start().expect("redis-server");
    let dir = tempfile::tempdir().expect("temp dir");
    let ledger = format!("sqlite://{}", dir.path().join("ledger.db").display());
    common::seed(&redis.url(), "sale", spec).await;
    let sidecar = common::Peer::start_custom(&redis.url(), &ledger, |settings| {
        settings.sweep_ms = 600_000;
    })
    .await;
    (sidecar, redis, dir)
}

/// Checks status, outcome and path of an answer.
fn says(path: Path, reply: &dropgate_testkit::Reply, status: u16, outcome: &str) {
    reply.assert_answer_because(status, outcome, &format!("{path:?}"));
    let header = reply
        .headers
        .get("dropgate-path")
        .and_then(|v| v.to_str().ok());
    assert_eq!(
        header,
        path.header(),
        "{path:?}: answered on the wrong path"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_of_an_admitted_key_is_already_reserved_when_every_permit_is_in_use() {
    for path in PATHS {
        let sidecar = Sidecar::start().await;
        sidecar
            .seed("sale", path.spec().permits(1).acquire_timeout_ms(20))
            .await;
        says(
            path,
            &sidecar.reserve("sale", "a", "alice", 1).await,
            201,
            "admitted",
        );
        says(
            path,
            &sidecar.reserve("sale", "b", "bob", 1).await,
            503,
            "throttled",
        );
        says(
            path,
            &sidecar.reserve("sale", "a", "alice", 1).await,
            200,
            "already_reserved",
        );
        says(
            path,
            &sidecar.reserve("sale", "a", "mallory", 1).await,
            422,
            "idempotency_key_reused",
        );
        sidecar.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_of_an_admitted_key_is_already_reserved_after_the_sale_ended() {
    for path in PATHS {
        let sidecar = Sidecar::start().await;
        sidecar.seed("sale", path.spec()).await;
        says(
            path,
            &sidecar.reserve("sale", "a", "alice", 1).await,
            201,
            "admitted",
        );
        sidecar
            .seed("sale", path.spec().ends_at("2020-01-01T00:00:00Z"))
            .await;
        let mut ended = None;
        // Until the sidecar reads the new config, a new key may still be sold.
        for i in 0..100 {
            let reply = sidecar
                .reserve("sale", &format!("late-{i}"), "bob", 1)
                .await;
            if reply.outcome() == "ended" {
                ended = Some(reply);
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        says(path, &ended.expect("the sidecar saw the end"), 403, "ended");
        says(
            path,
            &sidecar.reserve("sale", "a", "alice", 1).await,
            200,
            "already_reserved",
        );
        sidecar.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_look_up_of_a_lapsed_hold_answers_found_expired() {
    for path in PATHS {
        let (sidecar, _redis, _dir) = without_sweeper(path.spec().hold_seconds(3)).await;
        says(
            path,
            &sidecar.reserve("sale", "a", "alice", 1).await,
            201,
            "admitted",
        );
        tokio::time::sleep(Duration::from_millis(3100)).await;
        for _ in 0..2 {
            let found = sidecar.lookup("sale", "a").await;
            says(path, &found, 200, "found");
            assert_eq!(found.body["state"], "expired", "{path:?}: {}", found.text);
        }
        sidecar.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_look_up_that_expires_a_hold_frees_its_permit_at_once() {
    for path in PATHS {
        let (sidecar, _redis, _dir) = without_sweeper(
            path.spec()
                .hold_seconds(3)
                .permits(1)
                .acquire_timeout_ms(20),
        )
        .await;
        says(
            path,
            &sidecar.reserve("sale", "a", "alice", 1).await,
            201,
            "admitted",
        );
        tokio::time::sleep(Duration::from_millis(3100)).await;
        assert_eq!(sidecar.lookup("sale", "a").await.body["state"], "expired");
        says(
            path,
            &sidecar.reserve("sale", "b", "bob", 1).await,
            201,
            "admitted",
        );
        sidecar.shutdown().await;
    }
}
