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

fn cart(i: usize) -> String {
    let size = SIZES[i % SIZES.len()].0;
    json!({
        "key": format!("c{i}"),
        "user": format!("u{i}"),
        "lines": [
            {"drop": "shoe", "variant": size, "quantity": 1},
            {"drop": "cap", "quantity": 1},
        ],
    })
    .to_string()
}

/// Sends cart `i` until it is answered something other than 503 (or gives up
/// after 30 s): its last answer, and whether the outage touched it (a 503 on the
/// way, or the fallback gate's answer).
async fn until_decided(http: &HttpClient, i: usize) -> (Reply, bool) {
    let body = cart(i);
    let mut touched = false;
    let mut last = http.post("/v1/carts", &body).await.expect("answers");
    for _ in 0..150 {
        touched |= last.headers.contains_key("dropgate-path");
        if last.status.as_u16() != 503 {
            break;
        }
        touched = true;
        tokio::time::sleep(Duration::from_millis(200)).await;
        last = http.post("/v1/carts", &body).await.expect("answers");
    }
    (last, touched)
}

/// Every cart's lines, as its look-up shows them, are all held or all free, as its
/// last answer says; then the drops' counts as `GET /v1/drops/{drop}` shows them.
async fn assert_whole(http: &HttpClient, answers: &[Reply]) -> usize {
    let mut held_carts = 0;
    for (i, answer) in answers.iter().enumerate() {
        let looked = http.get(&format!("/v1/carts/c{i}")).await.expect("answers");
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
                assert_eq!(held, 2, "c{i}: 201 but {states:?}: {}", looked.text);
                held_carts += 1;
            }
            _ => assert_eq!(
                held, 0,
                "c{i}: answered {} yet holds {states:?}",
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
    let touched = decided.iter().filter(|(_, touched)| *touched).count();
    assert!(touched > 0, "the cut came after every cart was decided");
    let answers: Vec<Reply> = decided.into_iter().map(|(answer, _)| answer).collect();
    for (i, answer) in answers.iter().enumerate() {
        assert!(
            matches!(answer.status.as_u16(), 201 | 409),
            "c{i} was never decided: {}",
            answer.text
        );
    }
    // Quiet: whatever the fallback decided is in Redis again.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let held = assert_whole(&http, &answers).await;
    assert!(held > 0, "some carts were held");
    assert!(held <= 8, "the cap has 8: {held} carts hold one");
    let shown = http.get("/v1/drops/cap").await.expect("answers");
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
        async move { until_decided(&http, i).await.0 }
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
    let (mut answers, ()) = tokio::join!(first, change);
    // More buyers after the change.
    answers.extend(
        join_all((20..40).map(|i| {
            let http = http.clone();
            async move { until_decided(&http, i).await.0 }
        }))
        .await,
    );
    let held = assert_whole(&http, &answers).await;
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
