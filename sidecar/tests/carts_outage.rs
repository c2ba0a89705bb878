//! Carts while Redis goes away under them (a cut connection, both failure
//! policies) and while one size is restocked and another cut: every cart ends
//! wholly held or wholly free, as its last answer said, and no drop or size is
//! sold past the quantity in force.

mod common;

use std::time::Duration;

use common::{Peer, seed};
use dropgate_testkit::{DropSpec, HttpClient, PostgresServer, RedisServer, Reply, TcpProxy};
use futures::future::join_all;
use serde_json::json;

const SIZES: [(&str, i64); 2] = [("S", 6), ("M", 6)];

fn shop(open: bool) -> [(&'static str, DropSpec); 2] {
    let policy = |spec: DropSpec| if open { spec } else { spec.fail_closed() };
    [
        (
            "shoe",
            policy(
                DropSpec::new(0)
                    .variants(&SIZES)
                    .per_user_limit(2)
                    .permits(1000),
            ),
        ),
        (
            "cap",
            policy(DropSpec::new(8).per_user_limit(2).permits(1000)),
        ),
    ]
}

fn cart(i: usize, key: &str) -> String {
    let size = SIZES[i % SIZES.len()].0;
    json!({
        "key": key,
        "user": format!("u{i}"),
        "lines": [
            {"drop": "shoe", "variant": size, "quantity": 1},
            {"drop": "cap", "quantity": 1},
        ],
    })
    .to_string()
}

/// Buyer `i`'s cart as a shop sends it: again with the same key after a 503,
/// with a new key after a 503 that says the key is spent (its lines were held,
/// then given back); until answered something else, or for 30 s.
struct Decided {
    last: Reply,
    /// The key of the last try.
    key: String,
    /// Whether the outage touched it: a 503 on the way, or the fallback's answer.
    touched: bool,
}

async fn until_decided(http: &HttpClient, i: usize) -> Decided {
    let mut tries = 0;
    let mut key = format!("c{i}");
    let mut touched = false;
    let mut last = http
        .post("/v1/carts", &cart(i, &key))
        .await
        .expect("answers");
    for _ in 0..150 {
        touched |= last.headers.contains_key("dropgate-path");
        if last.status.as_u16() != 503 {
            break;
        }
        touched = true;
        if last.body["keySpent"] == true {
            tries += 1;
            key = format!("c{i}-{tries}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        last = http
            .post("/v1/carts", &cart(i, &key))
            .await
            .expect("answers");
    }
    Decided { last, key, touched }
}

/// Every cart's lines, as its look-up shows them, are all held or all free, as its
/// last answer says; then the drops' counts as `GET /v1/drops/{drop}` shows them.
async fn assert_whole(http: &HttpClient, decided: &[Decided]) -> usize {
    let mut held_carts = 0;
    for Decided {
        last: answer, key, ..
    } in decided
    {
        let looked = http
            .get(&format!("/v1/carts/{key}"))
            .await
            .expect("answers");
        let states: Vec<String> = looked.body["lines"]
            .as_array()
            .map(|lines| {
                lines
                    .iter()
                    .map(|l| l["state"].as_str().unwrap_or("?").to_string())
                    .collect()
            })
            .unwrap_or_default();
        let held = states.iter().filter(|s| *s == "active").count();
        match answer.status.as_u16() {
            201 => {
                assert_eq!(held, 2, "{key}: 201 but {states:?}: {}", looked.text);
                held_carts += 1;
            }
            _ => assert_eq!(
                held, 0,
                "{key}: answered {} yet holds {states:?}",
                answer.text
            ),
        }
    }
    held_carts
}

async fn through_an_outage(open: bool) {
    let redis = RedisServer::start().expect("redis-server");
    let postgres = PostgresServer::start().expect("PostgreSQL");
    let proxy = TcpProxy::start(redis.port()).await.expect("proxy");
    for (name, spec) in shop(open) {
        seed(&redis.url(), name, spec).await;
    }
    let sidecar = Peer::start(&proxy.redis_url(), &postgres.url()).await;
    let http = sidecar.http.clone();
    // Warm: the sale's ledger claimed, every drop's gate open.
    for drop in ["shoe", "cap"] {
        http.get(&format!("/v1/drops/{drop}"))
            .await
            .expect("answers");
    }
    // Carts keep coming, a few at a time, while the connection is cut and healed.
    let rush = join_all((0..40).map(|i| {
        let http = http.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(25 * i as u64)).await;
            until_decided(&http, i).await
        }
    }));
    let cut = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        proxy.cut().await;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        proxy.heal();
    };
    let (decided, ()) = tokio::join!(rush, cut);
    let touched = decided.iter().filter(|d| d.touched).count();
    assert!(touched > 0, "the cut came after every cart was decided");
    for Decided { last, key, .. } in &decided {
        assert!(
            matches!(last.status.as_u16(), 201 | 409),
            "{key} was never decided: {}",
            last.text
        );
    }
    // Quiet: whatever the fallback decided is in Redis again.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let held = assert_whole(&http, &decided).await;
    assert!(
        held > 0,
        "no cart was held: {:?}",
        decided.iter().map(|d| &d.last.text).collect::<Vec<_>>()
    );
    assert!(held <= 8, "the cap has 8: {held} carts hold one");
    // A spent key's lines that could not be given back during the cut are given
    // back by the cart sweeper once the gate answers: then the cap has left what
    // the held carts do not hold.
    let mut shown = http.get("/v1/drops/cap").await.expect("answers");
    for _ in 0..40 {
        if shown.body["remaining"] == 8 - held as i64 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
        shown = http.get("/v1/drops/cap").await.expect("answers");
    }
    assert_eq!(shown.body["remaining"], 8 - held as i64, "{}", shown.text);
    sidecar.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cut_mid_cart_with_failure_policy_open() {
    through_an_outage(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cut_mid_cart_with_failure_policy_closed() {
    through_an_outage(false).await;
}

/// One size restocked and the other cut while carts are held: each size's counts
/// follow its quantity in force, and no cart is left partly held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_size_restocked_and_another_cut_mid_sale_with_carts() {
    let redis = RedisServer::start().expect("redis-server");
    let postgres = PostgresServer::start().expect("PostgreSQL");
    for (name, spec) in shop(true) {
        seed(&redis.url(), name, spec).await;
    }
    let sidecar = Peer::start(&redis.url(), &postgres.url()).await;
    let http = sidecar.http.clone();
    let first = join_all((0..20).map(|i| {
        let http = http.clone();
        async move { until_decided(&http, i).await }
    }));
    let change = async {
        tokio::time::sleep(Duration::from_millis(20)).await;
        // S restocked from 6 to 9, M cut from 6 to 2.
        seed(
            &redis.url(),
            "shoe",
            DropSpec::new(0)
                .variants(&[("S", 9), ("M", 2)])
                .per_user_limit(2)
                .permits(1000),
        )
        .await;
    };
    let (mut decided, ()) = tokio::join!(first, change);
    // More buyers after the change.
    decided.extend(
        join_all((20..40).map(|i| {
            let http = http.clone();
            async move { until_decided(&http, i).await }
        }))
        .await,
    );
    let held = assert_whole(&http, &decided).await;
    assert!(held > 0);
    // Each size: what its carts hold plus what it has left is its new quantity
    // (below zero left while a cut is paid back: GET shows 0).
    let mut conn = redis.connection().expect("connect");
    let sizes: std::collections::HashMap<String, i64> = redis::cmd("HGETALL")
        .arg(dropgate_api::DropKeys::new(common::NS, "shoe").variants())
        .query(&mut conn)
        .expect("HGETALL");
    for (size, quantity) in [("S", 9), ("M", 2)] {
        assert_eq!(
            sizes[&format!("r:{size}")] + sizes[&format!("h:{size}")],
            quantity,
            "{size}: {sizes:?}"
        );
    }
    // Nothing of M was admitted past its cut: once quiet it holds at most what it
    // held when the cut came, and S at most its new 9.
    assert!(sizes["h:S"] <= 9, "{sizes:?}");
    sidecar.shutdown().await;
}

/// A cart's cancel cut off from Redis once it recorded the cart releasing: the
/// give-back is decided (nothing can confirm the cart any more) and under way, and
/// its 503 says so (`underWay`), as a confirm's says how far it went; the retry
/// after its `Retry-After`, Redis back, finishes it. Before, that 503 read like any
/// other ("nothing was changed"), and every retry for the attempt's whole bound
/// (10 s) was refused as in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cart_cancel_cut_off_from_redis_is_under_way_and_its_retry_finishes_it() {
    let redis = RedisServer::start().expect("redis-server");
    let postgres = PostgresServer::start().expect("PostgreSQL");
    let proxy = TcpProxy::start(redis.port()).await.expect("proxy");
    // Failure policy closed: nothing is decided without Redis.
    for (name, spec) in shop(false) {
        seed(&redis.url(), name, spec).await;
    }
    // The sweeper kept out of it: the retry is what finishes the give-back.
    let sidecar = Peer::start_custom(&proxy.redis_url(), &postgres.url(), |settings| {
        settings.sweep_ms = 600_000;
    })
    .await;
    let http = sidecar.http.clone();
    http.post("/v1/carts", &cart(0, "gone"))
        .await
        .expect("answers")
        .assert_answer(201, "reserved");

    proxy.cut().await;
    let cancel = http
        .post("/v1/carts/gone/cancel", "")
        .await
        .expect("answers");
    assert_eq!(cancel.status, 503, "{}", cancel.text);
    assert_eq!(cancel.body["underWay"], true, "{}", cancel.text);
    assert!(
        cancel.body.get("confirmedLines").is_none(),
        "{}",
        cancel.text
    );
    // The cancel's give-back under way (handed on for a second, within which this
    // confirm arrives): a confirm meanwhile changes nothing.
    let confirm = http
        .post("/v1/carts/gone/confirm", "")
        .await
        .expect("answers");
    confirm.assert_answer(503, "throttled");

    proxy.heal();
    let wait: u64 = cancel.headers["retry-after"]
        .to_str()
        .ok()
        .and_then(|s| s.parse().ok())
        .expect("a Retry-After in seconds");
    tokio::time::sleep(Duration::from_millis(wait * 1000 + 200)).await;
    http.post("/v1/carts/gone/cancel", "")
        .await
        .expect("answers")
        .assert_answer(200, "cancelled");
    let looked = http.get("/v1/carts/gone").await.expect("answers");
    assert_eq!(looked.body["state"], "cancelled", "{}", looked.text);
    for (drop, left) in [("shoe", 12), ("cap", 8)] {
        let shown = http
            .get(&format!("/v1/drops/{drop}"))
            .await
            .expect("answers");
        assert_eq!(shown.body["remaining"], left, "{drop}: {}", shown.text);
    }
    // A confirm now finds it cancelled: nothing to confirm.
    http.post("/v1/carts/gone/confirm", "")
        .await
        .expect("answers")
        .assert_answer(409, "cancelled");
    sidecar.shutdown().await;
}
