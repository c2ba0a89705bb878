//! Fencing-token locks through the HTTP API against a real Redis.

mod common;

use std::time::Duration;

use common::Sidecar;
use dropgate_sidecar::ledger::{Ledger, fences};
use futures::future::join_all;
use serde_json::Value;
use warp::http::Method;

async fn acquire(
    sidecar: &Sidecar,
    name: &str,
    owner: &str,
    ttl: i64,
    wait: i64,
) -> dropgate_testkit::Reply {
    let body = format!(r#"{{"owner":"{owner}","ttlMs":{ttl},"waitMs":{wait}}}"#);
    sidecar
        .http
        .post(&format!("/v1/locks/{name}"), &body)
        .await
        .expect("answers")
}

async fn renew(sidecar: &Sidecar, name: &str, token: &Value, ttl: i64) -> dropgate_testkit::Reply {
    let body = format!(r#"{{"token":{token},"ttlMs":{ttl}}}"#);
    sidecar
        .http
        .post(&format!("/v1/locks/{name}/renew"), &body)
        .await
        .expect("answers")
}

async fn release(sidecar: &Sidecar, name: &str, token: &Value) -> dropgate_testkit::Reply {
    let body = format!(r#"{{"token":{token}}}"#);
    sidecar
        .http
        .request(Method::DELETE, &format!("/v1/locks/{name}"), Some(&body))
        .await
        .expect("answers")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_of_fifty_contenders_gets_the_lock() {
    let sidecar = Sidecar::start().await;
    let replies = join_all((0..50).map(|i| {
        let sidecar = &sidecar;
        async move { acquire(sidecar, "restock", &format!("worker-{i}"), 10_000, 0).await }
    }))
    .await;
    let acquired: Vec<_> = replies
        .iter()
        .filter(|r| r.outcome() == "acquired")
        .collect();
    assert_eq!(acquired.len(), 1);
    assert_eq!(acquired[0].status, 200);
    assert!(
        acquired[0].body["token"]
            .as_str()
            .is_some_and(|t| t.len() >= 32)
    );
    assert!(acquired[0].body["fence"].as_i64().is_some_and(|f| f >= 1));
    let expires = acquired[0].body["expiresAt"].as_str().unwrap_or("");
    assert!(
        expires.ends_with('Z') && expires.contains('T'),
        "RFC 3339 UTC: {expires}"
    );
    for busy in replies.iter().filter(|r| r.outcome() != "acquired") {
        busy.assert_answer(409, "busy");
        assert!(busy.body["message"].is_string());
    }
}

#[tokio::test]
async fn only_the_token_holder_renews_or_releases() {
    let sidecar = Sidecar::start().await;
    let held = acquire(&sidecar, "l", "a", 10_000, 0).await;
    let token = held.body["token"].clone();
    let wrong = Value::String("not-the-token".into());
    let refused = release(&sidecar, "l", &wrong).await;
    refused.assert_answer(409, "not_owner");
    assert_eq!(renew(&sidecar, "l", &wrong, 1000).await.outcome(), "lost");
    assert_eq!(
        acquire(&sidecar, "l", "b", 1000, 0).await.outcome(),
        "busy",
        "still held"
    );
    let renewed = renew(&sidecar, "l", &token, 20_000).await;
    renewed.assert_answer(200, "renewed");
    let released = release(&sidecar, "l", &token).await;
    released.assert_answer(200, "released");
    assert_eq!(release(&sidecar, "l", &token).await.outcome(), "not_owner");
    assert_eq!(
        acquire(&sidecar, "l", "b", 1000, 0).await.outcome(),
        "acquired"
    );
}

#[tokio::test]
async fn an_expired_holder_loses_and_changes_nothing() {
    let sidecar = Sidecar::start().await;
    let old = acquire(&sidecar, "l", "old", 100, 0).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let new = acquire(&sidecar, "l", "new", 10_000, 0).await;
    assert_eq!(new.outcome(), "acquired");
    assert!(
        new.body["fence"].as_i64() > old.body["fence"].as_i64(),
        "fences grow"
    );
    let lost = renew(&sidecar, "l", &old.body["token"], 10_000).await;
    lost.assert_answer(409, "lost");
    assert_eq!(
        release(&sidecar, "l", &old.body["token"]).await.outcome(),
        "not_owner"
    );
    assert_eq!(
        acquire(&sidecar, "l", "third", 100, 0).await.outcome(),
        "busy",
        "the new holder keeps it"
    );
}

#[tokio::test]
async fn a_waiting_contender_gets_the_lock_when_the_lease_ends() {
    let sidecar = Sidecar::start().await;
    let first = acquire(&sidecar, "l", "a", 150, 0).await;
    assert_eq!(first.outcome(), "acquired");
    let second = acquire(&sidecar, "l", "b", 1000, 2000).await;
    second.assert_answer(200, "acquired");
    assert!(second.body["fence"].as_i64() > first.body["fence"].as_i64());
    let third = acquire(&sidecar, "l", "c", 1000, 100).await;
    assert_eq!(third.outcome(), "busy", "gives up when waitMs is spent");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fences_keep_growing_when_redis_lost_the_counter() {
    let mut sidecar = Sidecar::start().await;
    let mut last = 0;
    for i in 0..3 {
        let held = acquire(&sidecar, "l", &format!("w{i}"), 10_000, 0).await;
        last = held.body["fence"].as_i64().expect("fence");
        assert_eq!(
            release(&sidecar, "l", &held.body["token"]).await.outcome(),
            "released"
        );
    }
    // A failover that lost everything: an empty Redis.
    sidecar.redis.restart().expect("restarts");
    let mut after = None;
    for _ in 0..50 {
        let reply = acquire(&sidecar, "l", "after", 10_000, 0).await;
        if reply.outcome() == "acquired" {
            after = reply.body["fence"].as_i64();
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let after = after.expect("acquired after the restart");
    assert!(
        after > last,
        "fence {after} after the failover, {last} before"
    );
}

/// Lock names a client used once leave nothing behind for long: the fence key goes
/// a day after its last lease (a later fence is still higher: Redis's clock and the
/// ledger's highest are its floor), the lock key with its lease.
#[tokio::test]
async fn a_locks_keys_expire_after_its_last_lease() {
    let sidecar = Sidecar::start().await;
    let held = acquire(&sidecar, "once", "w", 10_000, 0).await;
    assert_eq!(held.outcome(), "acquired");
    let keys = dropgate_api::LockKeys::new(common::NS, "once");
    let mut conn = sidecar.redis.connection().expect("connect");
    let ttl = |key: String, conn: &mut redis::Connection| -> i64 {
        redis::cmd("PTTL").arg(key).query(conn).expect("PTTL")
    };
    let lease = ttl(keys.lock(), &mut conn);
    assert!((1..=10_000).contains(&lease), "lock key PTTL {lease}");
    let fence = ttl(keys.fence(), &mut conn);
    assert!(
        (86_400_000..=86_410_000).contains(&fence),
        "fence key PTTL {fence}: a day past the lease"
    );
    // Renewed for a day: the fence key stays a day past the new lease.
    renew(&sidecar, "once", &held.body["token"], 86_400_000)
        .await
        .assert_answer(200, "renewed");
    let fence = ttl(keys.fence(), &mut conn);
    assert!(
        (2 * 86_400_000 - 10_000..=2 * 86_400_000).contains(&fence),
        "fence key PTTL {fence}: a day past the renewed lease"
    );
}

#[tokio::test]
async fn storage_refuses_the_late_write_of_a_paused_holder() {
    let sidecar = Sidecar::start().await;
    let dir = tempfile::tempdir().expect("dir");
    let storage = Ledger::open(&format!(
        "sqlite://{}",
        dir.path().join("storage.db").display()
    ))
    .await
    .expect("storage");
    let pool = storage.pool();
    let old = acquire(&sidecar, "inventory-file", "old", 100, 0).await;
    let old_fence = old.body["fence"].as_i64().expect("fence");
    assert!(
        fences::fenced_write(pool, "inventory-file", old_fence, "old v1")
            .await
            .expect("write")
    );
    // The old holder pauses (a GC, a VM migration) past its lease...
    tokio::time::sleep(Duration::from_millis(200)).await;
    let new = acquire(&sidecar, "inventory-file", "new", 10_000, 0).await;
    let new_fence = new.body["fence"].as_i64().expect("fence");
    assert!(
        fences::fenced_write(pool, "inventory-file", new_fence, "new v1")
            .await
            .expect("write")
    );
    // ...and wakes up believing it still holds the lock.
    let late = fences::fenced_write(pool, "inventory-file", old_fence, "old v2")
        .await
        .expect("write");
    assert!(!late, "the stale holder's write is refused");
    let replayed = fences::fenced_write(pool, "inventory-file", new_fence, "new v1 again")
        .await
        .expect("write");
    assert!(!replayed, "an equal fence is refused: fences never repeat");
    assert_eq!(
        fences::read(pool, "inventory-file").await.expect("read"),
        Some((new_fence, "new v1".to_string()))
    );
}

#[tokio::test]
async fn bad_lock_requests_are_refused_and_change_nothing() {
    let sidecar = Sidecar::start().await;
    let long = "x".repeat(257);
    let table: Vec<(Method, String, String, &str)> = vec![
        (Method::POST, "/v1/locks/l".into(), "{".into(), "JSON"),
        (
            Method::POST,
            "/v1/locks/l".into(),
            r#"{"ttlMs":100,"waitMs":0}"#.into(),
            "owner",
        ),
        (
            Method::POST,
            "/v1/locks/l".into(),
            r#"{"owner":"a","waitMs":0}"#.into(),
            "ttlMs",
        ),
        (
            Method::POST,
            "/v1/locks/l".into(),
            r#"{"owner":"a","ttlMs":0,"waitMs":0}"#.into(),
            "ttlMs",
        ),
        (
            Method::POST,
            "/v1/locks/l".into(),
            r#"{"owner":"a","ttlMs":true,"waitMs":0}"#.into(),
            "ttlMs",
        ),
        (
            Method::POST,
            "/v1/locks/l".into(),
            r#"{"owner":"a","ttlMs":100,"waitMs":-1}"#.into(),
            "waitMs",
        ),
        (
            Method::POST,
            "/v1/locks/l".into(),
            r#"{"owner":"a","ttlMs":100,"waitMs":60001}"#.into(),
            "waitMs",
        ),
        (
            Method::POST,
            "/v1/locks/l".into(),
            r#"{"owner":"","ttlMs":100,"waitMs":0}"#.into(),
            "owner",
        ),
        (
            Method::POST,
            "/v1/locks/l".into(),
            r#"{"owner":"a","ttlMs":100,"waitMs":0,"x":1}"#.into(),
            "x",
        ),
        (
            Method::POST,
            format!("/v1/locks/{long}"),
            r#"{"owner":"a","ttlMs":100,"waitMs":0}"#.into(),
            "name",
        ),
        (
            Method::POST,
            "/v1/locks/a%7Bb".into(),
            r#"{"owner":"a","ttlMs":100,"waitMs":0}"#.into(),
            "name",
        ),
        (
            Method::POST,
            "/v1/locks/l/renew".into(),
            r#"{"token":"t"}"#.into(),
            "ttlMs",
        ),
        (
            Method::POST,
            "/v1/locks/l/renew".into(),
            r#"{"token":1,"ttlMs":100}"#.into(),
            "token",
        ),
        (Method::DELETE, "/v1/locks/l".into(), "{}".into(), "token"),
        (
            Method::DELETE,
            "/v1/locks/l".into(),
            r#"{"token":""}"#.into(),
            "token",
        ),
    ];
    let before = sidecar.snapshot();
    for (method, path, body, word) in table {
        let reply = sidecar
            .http
            .request(method.clone(), &path, Some(&body))
            .await
            .expect("answers");
        reply.assert_answer_because(400, "invalid", &format!("{method} {path} {body}"));
        let message = reply.body["message"].as_str().unwrap_or("");
        assert!(message.contains(word), "{method} {path} {body}: {message}");
        assert_eq!(sidecar.snapshot(), before, "{method} {path} {body}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiting_acquire_reads_the_fence_floor_on_every_attempt() {
    let sidecar = Sidecar::start().await;
    let first = acquire(&sidecar, "floor", "first", 300, 0).await;
    let first_fence = first.body["fence"].as_i64().expect("a fence");
    // Far above Redis's clock in microseconds (the fences' other floor).
    let floor = first_fence + 1_000_000_000_000;
    let waiting = {
        let http = sidecar.http.clone();
        tokio::spawn(async move {
            http.post(
                "/v1/locks/floor",
                r#"{"owner":"second","ttlMs":10000,"waitMs":3000}"#,
            )
            .await
            .expect("answers")
        })
    };
    // While the second waits, another pod sharing the ledger hands out a fence far
    // ahead, and Redis loses its counter.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let ledger = common::ledger_of(&sidecar).await;
    assert!(
        fences::record(ledger.pool(), "shop/floor", floor)
            .await
            .expect("record")
    );
    let mut conn = sidecar.redis.connection().expect("connect");
    let _: () = redis::cmd("DEL")
        .arg(dropgate_api::LockKeys::new("shop", "floor").fence())
        .query(&mut conn)
        .expect("DEL");
    let second = waiting.await.expect("joins");
    assert_eq!(second.outcome(), "acquired", "{}", second.text);
    assert_eq!(
        second.body["fence"],
        floor + 1,
        "above the floor recorded meanwhile"
    );
    assert!(
        !fences::record(ledger.pool(), "shop/floor", floor + 1)
            .await
            .expect("record"),
        "a fence not above the high-water is not recorded twice"
    );
}

/// Two sidecars with per-pod ledgers share a lock, and Redis loses all its data (the
/// fence counter with it): the next fence, from the other pod whose ledger never saw
/// the first's, is still above every earlier one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fences_keep_growing_across_pods_when_redis_loses_the_counter() {
    let mut sidecar = Sidecar::start().await;
    let dir = tempfile::tempdir().expect("dir");
    let mut fences = Vec::new();
    for _ in 0..5 {
        let held = acquire(&sidecar, "shared", "me", 10_000, 0).await;
        assert_eq!(held.outcome(), "acquired", "{}", held.text);
        fences.push(held.body["fence"].as_i64().expect("a fence"));
        let token = held.body["token"].as_str().expect("a token").to_string();
        let released = sidecar
            .http
            .request(
                Method::DELETE,
                "/v1/locks/shared",
                Some(&format!(r#"{{"token":"{token}"}}"#)),
            )
            .await
            .expect("answers");
        assert_eq!(released.outcome(), "released", "{}", released.text);
    }
    assert!(fences.windows(2).all(|w| w[0] < w[1]), "{fences:?}");
    sidecar
        .redis
        .restart()
        .expect("Redis restarts without its data");
    let other_pod = common::Peer::start(
        &sidecar.redis.url(),
        &format!("sqlite://{}", dir.path().join("other.db").display()),
    )
    .await;
    let theirs = other_pod
        .http
        .post(
            "/v1/locks/shared",
            r#"{"owner":"them","ttlMs":100,"waitMs":0}"#,
        )
        .await
        .expect("answers");
    assert_eq!(theirs.outcome(), "acquired", "{}", theirs.text);
    let fence = theirs.body["fence"].as_i64().expect("a fence");
    assert!(
        fence > fences[4],
        "fence {fence} after {fences:?}: a storage guarded by it would take a stale holder's write"
    );
    other_pod.shutdown().await;
}

/// A namespace holds at most `--max-lock-names` lock names at once: a new name past
/// it answers 429 and leaves nothing behind, a name in use is always served, and a
/// name whose time lapsed makes room.
#[tokio::test]
async fn a_namespace_holds_a_bounded_number_of_lock_names() {
    let redis = dropgate_testkit::RedisServer::start().expect("redis-server starts");
    let dir = tempfile::tempdir().expect("dir");
    let sidecar = common::Peer::start_custom(
        &redis.url(),
        &format!("sqlite://{}", dir.path().join("ledger.db").display()),
        |settings| settings.max_lock_names = 3,
    )
    .await;
    let take = |name: &'static str| {
        let http = sidecar.http.clone();
        async move {
            http.post(
                &format!("/v1/locks/{name}"),
                r#"{"owner":"w","ttlMs":10000,"waitMs":0}"#,
            )
            .await
            .expect("answers")
        }
    };
    for name in ["a", "b", "c"] {
        take(name).await.assert_answer(200, "acquired");
    }
    let refused = take("d").await;
    refused.assert_answer(429, "too_many_locks");
    assert!(
        refused.text.contains("--max-lock-names"),
        "{}",
        refused.text
    );
    let keys = dropgate_api::LockKeys::new(common::NS, "d");
    let mut conn = redis.connection().expect("connect");
    let left: bool = redis::cmd("EXISTS")
        .arg(keys.lock())
        .arg(keys.fence())
        .query(&mut conn)
        .expect("EXISTS");
    assert!(!left, "a refused lock leaves no key");
    // A name in use is served whatever the count: busy, not refused.
    take("a").await.assert_answer(409, "busy");
    // A name whose time ran out (its lease and the day after) makes room.
    redis::cmd("ZADD")
        .arg(dropgate_api::LockKeys::names(common::NS))
        .arg(1)
        .arg("b")
        .query::<()>(&mut conn)
        .expect("ZADD");
    take("d").await.assert_answer(200, "acquired");
    sidecar.shutdown().await;
}

/// The ledger forgets the fence of a lock not taken for days (one row per name
/// ever used would stay for good), and the next fence of that name is still above
/// every earlier one.
#[tokio::test]
async fn fences_of_locks_long_unused_are_forgotten_and_never_reused() {
    let sidecar = Sidecar::start().await;
    let first = acquire(&sidecar, "old", "w", 100, 0).await;
    let first_fence = first.body["fence"].as_i64().expect("fence");
    release(&sidecar, "old", &first.body["token"])
        .await
        .assert_answer(200, "released");
    let ledger = common::ledger_of(&sidecar).await;
    let now_ms = jiff::Timestamp::now().as_millisecond();
    // Two days from now, the row is long unused.
    assert_eq!(
        fences::prune(ledger.pool(), now_ms + 2 * 86_400_000)
            .await
            .expect("prunes"),
        1
    );
    assert_eq!(
        fences::high_water(ledger.pool(), &format!("{}/old", common::NS))
            .await
            .expect("reads"),
        0
    );
    // Not yet: a row taken a moment ago stays.
    let second = acquire(&sidecar, "old", "w", 100, 0).await;
    let second_fence = second.body["fence"].as_i64().expect("fence");
    assert!(
        second_fence > first_fence,
        "{second_fence} after {first_fence}"
    );
    assert_eq!(
        fences::prune(ledger.pool(), now_ms - 60_000)
            .await
            .expect("prunes"),
        0
    );
}
