//! The OpenAPI document (sidecar/openapi.yaml) against the real sidecar: every
//! route of the code is in it, the sidecar serves it, and a tour of the API gives
//! every documented answer, each one checked against the document by the test
//! client (dropgate_testkit::openapi: status, Retry-After and Dropgate-Path, body).

mod common;

use std::collections::BTreeSet;

use dropgate_testkit::{DropSpec, HttpClient, RedisServer, Reply, openapi};
use warp::http::Method;

/// `METHOD /template` of every route the code declares (`warp::path!` and the method
/// filter of its statement in src/routes/mod.rs), with `{}` for each parameter.
fn routes_in_the_code() -> BTreeSet<String> {
    let source = include_str!("../src/routes/mod.rs");
    let mut routes = BTreeSet::new();
    for statement in source.split(';') {
        let Some(start) = statement.find("warp::path!(") else {
            continue;
        };
        let rest = &statement[start + "warp::path!(".len()..];
        let Some(end) = rest.find(')') else { continue };
        let path: Vec<String> = rest[..end]
            .split('/')
            .map(|segment| {
                let segment = segment.trim();
                match segment.strip_prefix('"').and_then(|s| s.strip_suffix('"')) {
                    Some(literal) => literal.to_string(),
                    None => "{}".to_string(),
                }
            })
            .collect();
        let method = ["get", "post", "delete", "put", "patch"]
            .into_iter()
            .find(|m| statement.contains(&format!("warp::{m}()")))
            .unwrap_or_else(|| panic!("no method filter for warp::path!({})", &rest[..end]));
        routes.insert(format!("{} /{}", method.to_uppercase(), path.join("/")));
    }
    routes
}

/// The document's operations in the same form.
fn routes_in_the_document() -> BTreeSet<String> {
    openapi::contract()
        .operations()
        .into_iter()
        .map(|op| {
            let (method, template) = op.split_once(' ').expect("METHOD /path");
            let path: Vec<&str> = template
                .split('/')
                .map(|s| if s.starts_with('{') { "{}" } else { s })
                .collect();
            format!("{method} {}", path.join("/"))
        })
        .collect()
}

#[test]
fn every_route_in_the_code_is_in_the_document_and_back() {
    let code = routes_in_the_code();
    let document = routes_in_the_document();
    assert!(code.len() >= 18, "the routes were not found: {code:?}");
    let undocumented: Vec<_> = code.difference(&document).collect();
    assert!(
        undocumented.is_empty(),
        "routes missing from sidecar/openapi.yaml: {undocumented:?}"
    );
    let unserved: Vec<_> = document.difference(&code).collect();
    assert!(
        unserved.is_empty(),
        "sidecar/openapi.yaml documents routes the code does not have: {unserved:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sidecar_serves_its_document() {
    let sidecar = common::Sidecar::start().await;
    let served = sidecar.http.get("/openapi.json").await.expect("answers");
    assert_eq!(served.status, 200, "{}", served.text);
    assert_eq!(&served.body, openapi::document());
    sidecar.shutdown().await;
}

/// The calls of the tour, each answer checked by the client and its documented
/// operation and status noted.
struct Tour {
    http: HttpClient,
    seen: BTreeSet<(String, u16)>,
}

impl Tour {
    async fn call(&mut self, method: Method, path: &str, body: Option<&str>) -> Reply {
        let reply = self
            .http
            .request(method.clone(), path, body)
            .await
            .expect("answers");
        let operation = openapi::contract()
            .operation_of(&method, path)
            .unwrap_or_else(|| panic!("{method} {path} is no documented operation"));
        self.seen.insert((operation, reply.status.as_u16()));
        reply
    }

    async fn post(&mut self, path: &str, body: &str) -> Reply {
        self.call(Method::POST, path, Some(body)).await
    }

    async fn get(&mut self, path: &str) -> Reply {
        self.call(Method::GET, path, None).await
    }

    async fn delete(&mut self, path: &str, body: &str) -> Reply {
        self.call(Method::DELETE, path, Some(body)).await
    }

    /// Asserts that `reply` is `status` `outcome` (the tour drives each answer on
    /// purpose, so a different one is a broken step).
    #[track_caller]
    fn expect(reply: &Reply, status: u16, outcome: &str) {
        reply.assert_answer(status, outcome);
    }
}

/// The (operation, status) pairs the tour cannot give, and why.
const NOT_TOURED: [(&str, u16, &str); 4] = [
    (
        "GET /v1/carts/{key}",
        503,
        "a ledger that does not answer (a cart is read from the ledger, so Redis down does not do it)",
    ),
    (
        "GET /v1/drops/{drop}/reservations/{key}",
        409,
        "the ledger overruling a Redis that lost a reservation's record; the client checks it where sidecar/tests drive it",
    ),
    (
        "GET /readyz",
        503,
        "a ledger that does not answer: the e2e suite's SQL outage drives it",
    ),
    (
        "GET /metrics",
        503,
        "metrics that cannot be encoded: no input causes it",
    ),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tour_of_the_api_gives_every_documented_answer() {
    let mut redis = RedisServer::start().expect("redis-server");
    let dir = tempfile::tempdir().expect("temp dir");
    let ledger = format!("sqlite://{}", dir.path().join("ledger.db").display());
    let url = redis.url();
    common::seed(
        &url,
        "sale",
        DropSpec::new(10).per_user_limit(2).max_hold_seconds(3600),
    )
    .await;
    common::seed(
        &url,
        "tight",
        DropSpec::new(10).permits(1).acquire_timeout_ms(20),
    )
    .await;
    common::seed(
        &url,
        "later",
        DropSpec::new(10).starts_at("2099-01-01T00:00:00Z"),
    )
    .await;
    common::seed(
        &url,
        "sizes",
        DropSpec::new(2).variants(&[("S", 1), ("M", 1)]),
    )
    .await;
    common::seed(&url, "brief", DropSpec::new(10).hold_seconds(3)).await;
    common::seed(
        &url,
        "line",
        DropSpec::new(1).per_user_limit(2).waitlist_of(1),
    )
    .await;
    common::seed(
        &url,
        "soon",
        DropSpec::new(1)
            .starts_at("2099-01-01T00:00:00Z")
            .waitlist(),
    )
    .await;
    common::seed(&url, "down", DropSpec::new(10).fail_closed()).await;
    let sidecar = common::Peer::start_custom(&url, &ledger, |settings| {
        settings.max_lock_names = 2;
    })
    .await;
    let mut tour = Tour {
        http: sidecar.http.clone(),
        seen: BTreeSet::new(),
    };
    let big = format!(r#"{{"key":"{}"}}"#, "k".repeat(17 * 1024));
    let reserve = |key: &str, user: &str, quantity: i64| {
        format!(r#"{{"key":"{key}","user":"{user}","quantity":{quantity}}}"#)
    };

    // A reservation's life.
    let r = tour
        .post("/v1/drops/sale/reservations", &reserve("a", "alice", 2))
        .await;
    Tour::expect(&r, 201, "admitted");
    let r = tour
        .post("/v1/drops/sale/reservations", &reserve("a", "alice", 2))
        .await;
    Tour::expect(&r, 200, "already_reserved");
    let r = tour.post("/v1/drops/sale/reservations", "{").await;
    Tour::expect(&r, 400, "invalid");
    let r = tour
        .post("/v1/drops/later/reservations", &reserve("l", "alice", 1))
        .await;
    Tour::expect(&r, 403, "not_open");
    let r = tour
        .post("/v1/drops/nothing/reservations", &reserve("n", "alice", 1))
        .await;
    Tour::expect(&r, 404, "not_found");
    let r = tour
        .post("/v1/drops/sale/reservations", &reserve("b", "alice", 1))
        .await;
    Tour::expect(&r, 409, "per_user_limit_exceeded");
    let r = tour.post("/v1/drops/sale/reservations", &big).await;
    Tour::expect(&r, 413, "invalid");
    let r = tour
        .post("/v1/drops/sale/reservations", &reserve("a", "mallory", 2))
        .await;
    Tour::expect(&r, 422, "idempotency_key_reused");
    let r = tour
        .post("/v1/drops/tight/reservations", &reserve("t1", "alice", 1))
        .await;
    Tour::expect(&r, 201, "admitted");
    let r = tour
        .post("/v1/drops/tight/reservations", &reserve("t2", "bob", 1))
        .await;
    Tour::expect(&r, 503, "throttled");
    assert!(r.headers.contains_key("retry-after"), "{:?}", r.headers);
    let r = tour
        .post(
            "/v1/drops/sizes/reservations",
            r#"{"key":"s1","user":"alice","quantity":1,"variant":"XL"}"#,
        )
        .await;
    Tour::expect(&r, 404, "not_found");

    let r = tour.get("/v1/drops/sale/reservations?user=alice").await;
    Tour::expect(&r, 200, "found");
    let r = tour.get("/v1/drops/sale/reservations").await;
    Tour::expect(&r, 400, "invalid");
    let r = tour.get("/v1/drops/nothing/reservations?user=alice").await;
    Tour::expect(&r, 404, "not_found");

    let r = tour.get("/v1/drops/sale/reservations/a").await;
    Tour::expect(&r, 200, "found");
    let r = tour.get("/v1/drops/sale/reservations/%01").await;
    Tour::expect(&r, 400, "invalid");
    let r = tour.get("/v1/drops/sale/reservations/nobody").await;
    Tour::expect(&r, 404, "not_found");

    let r = tour
        .post(
            "/v1/drops/sale/reservations/a/extend",
            r#"{"expiresAt":"2099-01-01T00:00:00Z"}"#,
        )
        .await;
    Tour::expect(&r, 409, "extension_refused");
    let later = jiff::Timestamp::now() + jiff::SignedDuration::from_secs(1800);
    let r = tour
        .post(
            "/v1/drops/sale/reservations/a/extend",
            &format!(r#"{{"expiresAt":"{later}"}}"#),
        )
        .await;
    Tour::expect(&r, 200, "extended");
    let r = tour
        .post("/v1/drops/sale/reservations/a/extend", "{}")
        .await;
    Tour::expect(&r, 400, "invalid");
    let r = tour
        .post(
            "/v1/drops/sale/reservations/nobody/extend",
            &format!(r#"{{"expiresAt":"{later}"}}"#),
        )
        .await;
    Tour::expect(&r, 404, "not_found");
    let r = tour
        .post("/v1/drops/sale/reservations/a/extend", &big)
        .await;
    Tour::expect(&r, 413, "invalid");

    let r = tour
        .post("/v1/drops/sale/reservations/a/cancel", r#"{"user":"bob"}"#)
        .await;
    Tour::expect(&r, 409, "not_owner");
    let r = tour
        .post("/v1/drops/sale/reservations/a/confirm", r#"{"quantity":3}"#)
        .await;
    Tour::expect(&r, 400, "invalid");
    let r = tour
        .post("/v1/drops/sale/reservations/a/confirm", r#"{"quantity":1}"#)
        .await;
    Tour::expect(&r, 200, "confirmed");
    let r = tour.post("/v1/drops/sale/reservations/a/confirm", "").await;
    Tour::expect(&r, 200, "already_confirmed");
    let r = tour
        .post("/v1/drops/sale/reservations/nobody/confirm", "")
        .await;
    Tour::expect(&r, 404, "not_found");
    let r = tour
        .post("/v1/drops/sale/reservations/a/confirm", &big)
        .await;
    Tour::expect(&r, 413, "invalid");
    let r = tour.post("/v1/drops/sale/reservations/a/cancel", "").await;
    Tour::expect(&r, 200, "cancelled");
    let r = tour.post("/v1/drops/sale/reservations/a/cancel", "").await;
    Tour::expect(&r, 200, "already_cancelled");
    let r = tour.post("/v1/drops/sale/reservations/a/confirm", "").await;
    Tour::expect(&r, 409, "cancelled");
    let r = tour
        .post("/v1/drops/sale/reservations/a/cancel", "[]")
        .await;
    Tour::expect(&r, 400, "invalid");
    let r = tour
        .post("/v1/drops/sale/reservations/nobody/cancel", "")
        .await;
    Tour::expect(&r, 404, "not_found");
    let r = tour
        .post("/v1/drops/sale/reservations/a/cancel", &big)
        .await;
    Tour::expect(&r, 413, "invalid");
    let r = tour
        .post("/v1/drops/sale/reservations", &reserve("c", "carol", 1))
        .await;
    Tour::expect(&r, 201, "admitted");
    let r = tour.post("/v1/drops/sale/reservations/c/cancel", "").await;
    Tour::expect(&r, 200, "cancelled");
    let r = tour
        .post("/v1/drops/sale/reservations", &reserve("d", "dave", 1))
        .await;
    Tour::expect(&r, 201, "admitted");
    let r = tour
        .post(
            "/v1/drops/sizes/reservations",
            r#"{"key":"s2","user":"erin","quantity":1,"variant":"S"}"#,
        )
        .await;
    Tour::expect(&r, 201, "admitted");
    let r = tour
        .post(
            "/v1/drops/sizes/reservations",
            r#"{"key":"s3","user":"frank","quantity":1,"variant":"S"}"#,
        )
        .await;
    Tour::expect(&r, 409, "sold_out");
    let r = tour
        .post("/v1/drops/brief/reservations", &reserve("e", "erin", 1))
        .await;
    Tour::expect(&r, 201, "admitted");
    tokio::time::sleep(std::time::Duration::from_millis(3500)).await;
    let r = tour
        .post(
            "/v1/drops/brief/reservations/e/extend",
            &format!(r#"{{"expiresAt":"{later}"}}"#),
        )
        .await;
    Tour::expect(&r, 409, "expired");

    // The drop.
    let r = tour.get("/v1/drops/sizes").await;
    Tour::expect(&r, 200, "found");
    let r = tour.get("/v1/drops/%01").await;
    Tour::expect(&r, 400, "invalid");
    let r = tour.get("/v1/drops/nothing").await;
    Tour::expect(&r, 404, "not_found");

    // Carts.
    let cart = r#"{"key":"cart1","user":"gina","lines":[{"drop":"sale","quantity":1},{"drop":"sizes","variant":"M","quantity":1}]}"#;
    let r = tour.post("/v1/carts", cart).await;
    Tour::expect(&r, 201, "reserved");
    let r = tour.post("/v1/carts", cart).await;
    Tour::expect(&r, 200, "already_reserved");
    let r = tour
        .post("/v1/carts", r#"{"key":"cart1","user":"gina"}"#)
        .await;
    Tour::expect(&r, 400, "invalid");
    let r = tour
        .post(
            "/v1/carts",
            r#"{"key":"cart2","user":"gina","lines":[{"drop":"nothing","quantity":1}]}"#,
        )
        .await;
    Tour::expect(&r, 404, "not_found");
    let r = tour.post("/v1/carts", r#"{"key":"cart3","user":"hank","lines":[{"drop":"sizes","variant":"M","quantity":1}]}"#).await;
    Tour::expect(&r, 409, "short");
    let r = tour.post("/v1/carts", &big).await;
    Tour::expect(&r, 413, "invalid");
    let r = tour
        .post(
            "/v1/carts",
            r#"{"key":"cart1","user":"ivan","lines":[{"drop":"sale","quantity":1}]}"#,
        )
        .await;
    Tour::expect(&r, 422, "idempotency_key_reused");
    let r = tour.get("/v1/carts/cart1").await;
    Tour::expect(&r, 200, "found");
    let r = tour.get("/v1/carts/%01").await;
    Tour::expect(&r, 400, "invalid");
    let r = tour.get("/v1/carts/nocart").await;
    Tour::expect(&r, 404, "not_found");
    let r = tour.post("/v1/carts/cart1/confirm", "").await;
    Tour::expect(&r, 200, "confirmed");
    let r = tour.post("/v1/carts/cart1/confirm", "").await;
    Tour::expect(&r, 200, "already_confirmed");
    let r = tour.post("/v1/carts/%01/confirm", "").await;
    Tour::expect(&r, 400, "invalid");
    let r = tour.post("/v1/carts/nocart/confirm", "").await;
    Tour::expect(&r, 404, "not_found");
    let r = tour.post("/v1/carts/cart1/cancel", "").await;
    Tour::expect(&r, 200, "cancelled");
    let r = tour.post("/v1/carts/cart1/cancel", "").await;
    Tour::expect(&r, 200, "already_cancelled");
    let r = tour.post("/v1/carts/cart1/confirm", "").await;
    Tour::expect(&r, 409, "cancelled");
    let r = tour.post("/v1/carts/%01/cancel", "").await;
    Tour::expect(&r, 400, "invalid");
    let r = tour.post("/v1/carts/nocart/cancel", "").await;
    Tour::expect(&r, 404, "not_found");
    let brief = r#"{"key":"cart4","user":"judy","lines":[{"drop":"brief","quantity":1}]}"#;
    let r = tour.post("/v1/carts", brief).await;
    Tour::expect(&r, 201, "reserved");
    tokio::time::sleep(std::time::Duration::from_millis(3500)).await;
    let r = tour.post("/v1/carts/cart4/cancel", "").await;
    Tour::expect(&r, 409, "expired");

    // Locks.
    let r = tour
        .post(
            "/v1/locks/restock",
            r#"{"owner":"w1","ttlMs":60000,"waitMs":0}"#,
        )
        .await;
    Tour::expect(&r, 200, "acquired");
    let token = r.body["token"].clone();
    let r = tour
        .post(
            "/v1/locks/restock",
            r#"{"owner":"w2","ttlMs":60000,"waitMs":0}"#,
        )
        .await;
    Tour::expect(&r, 409, "busy");
    let r = tour.post("/v1/locks/restock", r#"{"owner":"w2"}"#).await;
    Tour::expect(&r, 400, "invalid");
    let r = tour.post("/v1/locks/restock", &big).await;
    Tour::expect(&r, 413, "invalid");
    let r = tour
        .post(
            "/v1/locks/other",
            r#"{"owner":"w1","ttlMs":60000,"waitMs":0}"#,
        )
        .await;
    Tour::expect(&r, 200, "acquired");
    let r = tour
        .post(
            "/v1/locks/third",
            r#"{"owner":"w1","ttlMs":60000,"waitMs":0}"#,
        )
        .await;
    Tour::expect(&r, 429, "too_many_locks");
    let r = tour
        .post(
            "/v1/locks/restock/renew",
            &format!(r#"{{"token":{token},"ttlMs":60000}}"#),
        )
        .await;
    Tour::expect(&r, 200, "renewed");
    let r = tour
        .post(
            "/v1/locks/restock/renew",
            r#"{"token":"stale","ttlMs":60000}"#,
        )
        .await;
    Tour::expect(&r, 409, "lost");
    let r = tour
        .post("/v1/locks/restock/renew", r#"{"token":"stale"}"#)
        .await;
    Tour::expect(&r, 400, "invalid");
    let r = tour.post("/v1/locks/restock/renew", &big).await;
    Tour::expect(&r, 413, "invalid");
    let r = tour
        .delete("/v1/locks/restock", r#"{"token":"stale"}"#)
        .await;
    Tour::expect(&r, 409, "not_owner");
    let r = tour
        .delete("/v1/locks/restock", &format!(r#"{{"token":{token}}}"#))
        .await;
    Tour::expect(&r, 200, "released");
    let r = tour.delete("/v1/locks/restock", "{}").await;
    Tour::expect(&r, 400, "invalid");
    let r = tour.delete("/v1/locks/restock", &big).await;
    Tour::expect(&r, 413, "invalid");

    // A place in line, served.
    let r = tour
        .post("/v1/drops/line/reservations", &reserve("k1", "alice", 1))
        .await;
    Tour::expect(&r, 201, "admitted");
    let r = tour
        .post("/v1/drops/line/waitlist", &reserve("w1", "bob", 1))
        .await;
    Tour::expect(&r, 201, "waiting");
    let r = tour
        .post("/v1/drops/line/waitlist", &reserve("w1", "bob", 1))
        .await;
    Tour::expect(&r, 200, "already_waiting");
    let r = tour.post("/v1/drops/line/waitlist", "{").await;
    Tour::expect(&r, 400, "invalid");
    let r = tour
        .post("/v1/drops/soon/waitlist", &reserve("s1", "bob", 1))
        .await;
    Tour::expect(&r, 403, "not_open");
    let r = tour
        .post("/v1/drops/nothing/waitlist", &reserve("n1", "bob", 1))
        .await;
    Tour::expect(&r, 404, "not_found");
    let r = tour
        .post("/v1/drops/line/waitlist", &reserve("w2", "carol", 1))
        .await;
    Tour::expect(&r, 409, "waitlist_full");
    let r = tour.post("/v1/drops/line/waitlist", &big).await;
    Tour::expect(&r, 413, "invalid");
    let r = tour
        .post("/v1/drops/line/waitlist", &reserve("k1", "alice", 1))
        .await;
    Tour::expect(&r, 422, "idempotency_key_reused");
    let r = tour.get("/v1/drops/line/waitlist/w1").await;
    Tour::expect(&r, 200, "waiting");
    let r = tour.get("/v1/drops/line/waitlist/%01").await;
    Tour::expect(&r, 400, "invalid");
    let r = tour.get("/v1/drops/line/waitlist/none").await;
    Tour::expect(&r, 404, "not_found");
    let r = tour.post("/v1/drops/line/reservations/k1/cancel", "").await;
    Tour::expect(&r, 200, "cancelled");
    let mut served = tour.get("/v1/drops/line/waitlist/w1").await;
    for _ in 0..100 {
        if served.outcome() == "offered" {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        served = tour.get("/v1/drops/line/waitlist/w1").await;
    }
    Tour::expect(&served, 200, "offered");
    let r = tour.post("/v1/drops/line/waitlist/w1/cancel", "").await;
    Tour::expect(&r, 409, "offered");
    let r = tour
        .post("/v1/drops/line/waitlist", &reserve("w3", "dave", 1))
        .await;
    Tour::expect(&r, 201, "waiting");
    let r = tour.post("/v1/drops/line/waitlist/w3/cancel", "").await;
    Tour::expect(&r, 200, "left");
    let r = tour.post("/v1/drops/line/waitlist/%01/cancel", "").await;
    Tour::expect(&r, 400, "invalid");
    let r = tour.post("/v1/drops/line/waitlist/none/cancel", "").await;
    Tour::expect(&r, 404, "not_found");

    // Probes and the document.
    let r = tour.get("/healthz").await;
    Tour::expect(&r, 200, "ok");
    let r = tour.get("/readyz").await;
    Tour::expect(&r, 200, "ready");
    let r = tour.get("/metrics").await;
    assert_eq!(r.status, 200);
    let r = tour.get("/openapi.json").await;
    assert_eq!(r.status, 200);

    // Redis down: a drop that fails closed answers 503 on every route, locks too.
    let r = tour.get("/v1/drops/down").await;
    Tour::expect(&r, 200, "found");
    let held = r#"{"key":"cart5","user":"zoe","lines":[{"drop":"down","quantity":1}]}"#;
    let r = tour.post("/v1/carts", held).await;
    Tour::expect(&r, 201, "reserved");
    redis.stop();
    let calls: [(Method, &str, &str); 16] = [
        (
            Method::POST,
            "/v1/drops/down/reservations",
            &reserve("z", "zoe", 1),
        ),
        (Method::GET, "/v1/drops/down/reservations?user=zoe", ""),
        (Method::GET, "/v1/drops/down/reservations/z", ""),
        (Method::POST, "/v1/drops/down/reservations/z/confirm", ""),
        (Method::POST, "/v1/drops/down/reservations/z/cancel", ""),
        (
            Method::POST,
            "/v1/drops/down/reservations/z/extend",
            &format!(r#"{{"expiresAt":"{later}"}}"#),
        ),
        (Method::GET, "/v1/drops/down", ""),
        (
            Method::POST,
            "/v1/drops/down/waitlist",
            &reserve("w", "zoe", 1),
        ),
        (Method::GET, "/v1/drops/down/waitlist/w", ""),
        (Method::POST, "/v1/drops/down/waitlist/w/cancel", ""),
        (
            Method::POST,
            "/v1/carts",
            r#"{"key":"cart9","user":"zoe","lines":[{"drop":"down","quantity":1}]}"#,
        ),
        (Method::GET, "/v1/carts/cart5", ""),
        (Method::POST, "/v1/carts/cart5/confirm", ""),
        (Method::POST, "/v1/carts/cart5/cancel", ""),
        (
            Method::POST,
            "/v1/locks/restock",
            r#"{"owner":"w1","ttlMs":60000,"waitMs":0}"#,
        ),
        (
            Method::POST,
            "/v1/locks/other/renew",
            r#"{"token":"t","ttlMs":60000}"#,
        ),
    ];
    for (method, path, body) in calls {
        let body = (!body.is_empty()).then_some(body);
        let r = tour.call(method.clone(), path, body).await;
        println!("Redis down: {method} {path}: {} {}", r.status, r.outcome());
    }
    let r = tour.delete("/v1/locks/other", r#"{"token":"t"}"#).await;
    println!(
        "Redis down: DELETE /v1/locks/other: {} {}",
        r.status,
        r.outcome()
    );

    let mut missing = Vec::new();
    for operation in openapi::contract().operations() {
        for status in openapi::contract().statuses(&operation) {
            let excused = NOT_TOURED
                .iter()
                .any(|(op, st, _)| *op == operation && *st == status);
            if !excused && !tour.seen.contains(&(operation.clone(), status)) {
                missing.push(format!("{operation} {status}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "documented answers the tour never got: {missing:#?}"
    );
    sidecar.shutdown().await;
}
