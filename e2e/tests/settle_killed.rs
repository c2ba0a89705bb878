//! A cancel the shared PostgreSQL ledger recorded but Redis did not finish at once:
//! its sidecar process died (as under `kill -9`) in between, or Redis failed under
//! the finish. The cancel happened: the ledger has it. Whoever hears of it (its own
//! answer, a duplicate reserve of the key or a look-up through another sidecar) must
//! find the drop's count already giving the units back: an answer `cancelled` while
//! Redis still counts the units held would turn the next buyer away for stock the
//! sale has (found by the linearizability-checked histories: a `GET` of the drop,
//! after a look-up said `cancelled`, counted the units held; and after a cancel
//! answered while Redis was cut off from its sidecar).

use dropgate_e2e::processes::{SidecarProcess, apply};
use dropgate_testkit::{DropSpec, HttpClient, PostgresServer, RedisServer, Reply};

const LIMIT: i64 = 2;

fn publish(dir: &std::path::Path, redis: &RedisServer) {
    let path = dir.join("shoe.yaml");
    std::fs::write(
        &path,
        format!(
            "apiVersion: dropgate.io/v1alpha1\nkind: InventoryDrop\nmetadata: {{name: shoe, namespace: shop}}\n\
             spec:\n  redis: {{url: redis://unused:1}}\n{}",
            DropSpec::new(LIMIT).per_user_limit(2).permits(100).yaml()
        ),
    )
    .expect("manifest written");
    apply(&path, &redis.url()).expect("apply");
}

fn reserve_body(key: &str, user: &str) -> String {
    format!(r#"{{"key":"{key}","user":"{user}","quantity":{LIMIT}}}"#)
}

/// One drop of `LIMIT` units on a real Redis and a shared PostgreSQL ledger.
struct Sale {
    redis: RedisServer,
    postgres: PostgresServer,
    _manifests: tempfile::TempDir,
}

impl Sale {
    fn start() -> Self {
        let redis = RedisServer::start().expect("redis-server");
        let postgres = PostgresServer::start().expect("PostgreSQL");
        let manifests = tempfile::tempdir().expect("dir");
        publish(manifests.path(), &redis);
        Self {
            redis,
            postgres,
            _manifests: manifests,
        }
    }

    /// A sidecar on the sale, its `DROPGATE_FAULTS` armed as given.
    async fn sidecar(&self, faults: &str) -> SidecarProcess {
        SidecarProcess::start_with_env(
            &self.redis.url(),
            "shop",
            &self.postgres.url(),
            &[],
            &[("DROPGATE_FAULTS", faults)],
        )
        .await
        .expect("a sidecar starts")
    }
}

/// `key`, held whole by `user`, cancelled through a sidecar that dies once the
/// ledger has the cancel.
async fn cancelled_by_a_dying_sidecar(sale: &Sale, steady: &HttpClient, key: &str, user: &str) {
    steady
        .post("/v1/drops/shoe/reservations", &reserve_body(key, user))
        .await
        .expect("answers")
        .assert_answer(201, "admitted");
    // Its next recorded confirm or cancel kills it before Redis finishes it.
    let dying = sale.sidecar("die-before-finish=1").await;
    let answer = HttpClient::new(dying.base.clone())
        .post(&format!("/v1/drops/shoe/reservations/{key}/cancel"), "")
        .await;
    assert!(
        answer.is_err(),
        "the sidecar died before finishing the cancel, yet answered: {answer:?}"
    );
}

fn assert_remaining(reply: &Reply, remaining: i64, context: &str) {
    assert_eq!(
        reply.body["remaining"].as_i64(),
        Some(remaining),
        "{context}: {}",
        reply.text
    );
}

/// The drop's count, as `GET /v1/drops/shoe` shows it.
async fn shown_remaining(steady: &HttpClient) -> Reply {
    let shown = steady.get("/v1/drops/shoe").await.expect("answers");
    assert_eq!(shown.status, 200, "{}", shown.text);
    shown
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_heard_through_another_sidecar_has_given_its_units_back() {
    let sale = Sale::start();
    let steady = sale.sidecar("").await;
    let http = HttpClient::new(steady.base.clone());

    // A duplicate reserve hears of the cancel.
    cancelled_by_a_dying_sidecar(&sale, &http, "ann-1", "ann").await;
    let duplicate = http
        .post("/v1/drops/shoe/reservations", &reserve_body("ann-1", "ann"))
        .await
        .expect("answers");
    duplicate.assert_answer(200, "already_reserved");
    assert_eq!(
        duplicate.body["state"], "cancelled",
        "the ledger has the cancel: {}",
        duplicate.text
    );
    assert_remaining(&duplicate, LIMIT, "the cancel gave its units back");
    assert_remaining(
        &shown_remaining(&http).await,
        LIMIT,
        "the drop's count after a duplicate heard `cancelled`",
    );
    // Another buyer gets the units at once.
    let next = http
        .post("/v1/drops/shoe/reservations", &reserve_body("bob-1", "bob"))
        .await
        .expect("answers");
    next.assert_answer(201, "admitted");

    // A look-up hears of a cancel.
    http.post("/v1/drops/shoe/reservations/bob-1/cancel", "")
        .await
        .expect("answers")
        .assert_answer(200, "cancelled");
    cancelled_by_a_dying_sidecar(&sale, &http, "cy-1", "cy").await;
    let looked = http
        .get("/v1/drops/shoe/reservations/cy-1")
        .await
        .expect("answers");
    assert_eq!(looked.status, 200, "{}", looked.text);
    assert_eq!(
        looked.body["state"], "cancelled",
        "the ledger has the cancel: {}",
        looked.text
    );
    assert_remaining(
        &shown_remaining(&http).await,
        LIMIT,
        "the drop's count after a look-up heard `cancelled`",
    );
    http.post("/v1/drops/shoe/reservations", &reserve_body("dee-1", "dee"))
        .await
        .expect("answers")
        .assert_answer(201, "admitted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_whose_finish_failed_is_answered_once_redis_has_it() {
    let sale = Sale::start();
    // Redis fails the first three attempts to finish a recorded change.
    let flaky = sale.sidecar("finish-fails=3").await;
    let http = HttpClient::new(flaky.base.clone());
    http.post("/v1/drops/shoe/reservations", &reserve_body("ann-1", "ann"))
        .await
        .expect("answers")
        .assert_answer(201, "admitted");
    let cancelled = http
        .post("/v1/drops/shoe/reservations/ann-1/cancel", "")
        .await
        .expect("answers");
    cancelled.assert_answer(200, "cancelled");
    assert_remaining(&cancelled, LIMIT, "the cancel's own answer");
    assert_remaining(
        &shown_remaining(&http).await,
        LIMIT,
        "the drop's count once the cancel was answered",
    );
    http.post("/v1/drops/shoe/reservations", &reserve_body("bob-1", "bob"))
        .await
        .expect("answers")
        .assert_answer(201, "admitted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_that_cannot_finish_a_recorded_cancel_answers_nothing_from_it() {
    let sale = Sale::start();
    // Redis fails this sidecar's first finish of a change another one prepared.
    let flaky = sale.sidecar("finish-fails=1").await;
    let http = HttpClient::new(flaky.base.clone());
    cancelled_by_a_dying_sidecar(&sale, &http, "ann-1", "ann").await;
    // Neither the ledger's `cancelled` (Redis still counts the units held) nor
    // Redis's `active` (the ledger has the cancel) is true of the drop now.
    let duplicate = http
        .post("/v1/drops/shoe/reservations", &reserve_body("ann-1", "ann"))
        .await
        .expect("answers");
    assert_eq!(duplicate.status, 503, "{}", duplicate.text);
    // Its retry finishes the cancel, and hears it.
    let retried = http
        .post("/v1/drops/shoe/reservations", &reserve_body("ann-1", "ann"))
        .await
        .expect("answers");
    retried.assert_answer(200, "already_reserved");
    assert_eq!(retried.body["state"], "cancelled", "{}", retried.text);
    assert_remaining(&retried, LIMIT, "the cancel gave its units back");
    assert_remaining(
        &shown_remaining(&http).await,
        LIMIT,
        "the drop's count after the retry heard `cancelled`",
    );
}
