//! A sidecar process that dies (as under `kill -9`) between two lines of a cart, on
//! a PostgreSQL ledger it shares with another sidecar: the line it held is not held
//! past the cart's bound, a retry of the cart key through the other sidecar either
//! completes the cart or hears it was given back, and once quiet every drop's counts
//! add up with the cart wholly held or wholly free.

use std::time::{Duration, Instant};

use dropgate_api::DropKeys;
use dropgate_e2e::processes::{SidecarProcess, apply};
use dropgate_testkit::{DropSpec, HttpClient, PostgresServer, RedisServer, Reply};

/// Its lines are held in order by drop: the cap (line 1), then the shoe (line 2).
const CART: &str = r#"{"key":"mid","user":"ann","lines":[{"drop":"cap","quantity":2},{"drop":"shoe","quantity":1}]}"#;

fn publish(dir: &std::path::Path, redis: &RedisServer, drop: &str, limit: i64) {
    let path = dir.join(format!("{drop}.yaml"));
    std::fs::write(
        &path,
        format!(
            "apiVersion: dropgate.io/v1alpha1\nkind: InventoryDrop\nmetadata: {{name: {drop}, namespace: shop}}\n\
             spec:\n  redis: {{url: redis://unused:1}}\n{}",
            DropSpec::new(limit).per_user_limit(2).permits(100).yaml()
        ),
    )
    .expect("manifest written");
    apply(&path, &redis.url()).expect("apply");
}

fn marker(redis: &RedisServer, drop: &str, key: &str) -> Option<String> {
    let mut conn = redis.connection().expect("connect");
    redis::cmd("HGET")
        .arg(DropKeys::new("shop", drop).reservation(key))
        .arg("state")
        .query(&mut conn)
        .expect("HGET")
}

fn counts(redis: &RedisServer, drop: &str) -> (i64, i64) {
    let keys = DropKeys::new("shop", drop);
    let mut conn = redis.connection().expect("connect");
    let get = |conn: &mut redis::Connection, key: String| -> i64 {
        redis::cmd("GET")
            .arg(key)
            .query::<Option<i64>>(conn)
            .expect("GET")
            .unwrap_or(0)
    };
    (
        get(&mut conn, keys.remaining()),
        get(&mut conn, keys.held()),
    )
}

fn held(state: &Option<String>) -> bool {
    matches!(state.as_deref(), Some("active" | "confirmed"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecar_dying_mid_cart_leaves_it_wholly_held_or_wholly_free() {
    let redis = RedisServer::start().expect("redis-server");
    let postgres = PostgresServer::start().expect("PostgreSQL");
    let dir = tempfile::tempdir().expect("dir");
    publish(dir.path(), &redis, "shoe", 5);
    publish(dir.path(), &redis, "cap", 5);
    let steady = SidecarProcess::start(&redis.url(), "shop", &postgres.url())
        .await
        .expect("a sidecar starts");
    let doomed = SidecarProcess::start_with_env(
        &redis.url(),
        "shop",
        &postgres.url(),
        &[],
        &[("DROPGATE_FAULTS", "die-mid-cart=1")],
    )
    .await
    .expect("the doomed sidecar starts");

    let answer = HttpClient::new(doomed.base.clone())
        .post("/v1/carts", CART)
        .await;
    assert!(
        answer.is_err(),
        "the sidecar died mid-cart, yet answered: {answer:?}"
    );
    assert!(
        held(&marker(&redis, "cap", "mid:1")),
        "the first line was held before the sidecar died"
    );
    assert_eq!(
        marker(&redis, "shoe", "mid:2"),
        None,
        "the second never was"
    );

    // The buyer retries through the other sidecar until the cart is decided: in
    // flight while its dead attempt's bound lasts, then completed by the retry or
    // given back by the sweeper.
    let http = HttpClient::new(steady.base.clone());
    let until = Instant::now() + Duration::from_secs(60);
    let reply: Reply = loop {
        let reply = http.post("/v1/carts", CART).await.expect("answers");
        if reply.status != 503 {
            break reply;
        }
        assert!(Instant::now() < until, "never decided: {}", reply.text);
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    let state = reply.body["state"].as_str().unwrap_or_default().to_string();
    let lines = [
        marker(&redis, "cap", "mid:1"),
        marker(&redis, "shoe", "mid:2"),
    ];
    match (reply.status.as_u16(), state.as_str()) {
        // The retry went on with the cart and completed it.
        (201, "active") => assert!(lines.iter().all(held), "{}: {lines:?}", reply.text),
        // The sweeper gave it back first: nothing held, the key spent.
        (409, "cancelled") => assert!(!lines.iter().any(held), "{}: {lines:?}", reply.text),
        _ => panic!("unexpected answer to the retry: {}", reply.text),
    }
    let (shoe_held, cap_held) = if state == "active" { (1, 2) } else { (0, 0) };
    assert_eq!(counts(&redis, "shoe"), (5 - shoe_held, shoe_held));
    assert_eq!(counts(&redis, "cap"), (5 - cap_held, cap_held));
    drop(doomed);
    steady.kill();
}
