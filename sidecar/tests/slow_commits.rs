//! An admission whose ledger commit is slow past its pending bound, so the sweeper
//! takes it for one a dead sidecar left (a second hostile review found these): the
//! buyer's retry and the late commit end with one reservation Redis and the ledger
//! both hold, and nothing oversold.

mod common;

use std::time::Duration;

use common::{NS, Peer, marker_state, one_per_buyer, seed};
use dropgate_api::DropKeys;
use dropgate_testkit::{DropSpec, PostgresServer, RedisServer, Reply};

/// This file's drop: one per buyer, holds that outlast the test.
fn spec(limit: i64) -> DropSpec {
    one_per_buyer(limit)
        .hold_seconds(60)
        .acquire_timeout_ms(100)
}

fn show(r: &Reply) -> String {
    format!("{} {}", r.status, r.text)
}

/// The integer at one of drop `sale`'s keys (`DropKeys::held`, say).
fn redis_int(redis: &RedisServer, key: fn(&DropKeys) -> String) -> i64 {
    let mut conn = redis.connection().expect("connect");
    redis::cmd("GET")
        .arg(key(&DropKeys::new(NS, "sale")))
        .query::<Option<i64>>(&mut conn)
        .expect("GET")
        .unwrap_or(0)
}

async fn ledger_state(pool: &sqlx::PgPool, key: &str) -> Option<String> {
    sqlx::query_as::<_, (String,)>(
        "SELECT state FROM reservations WHERE drop_key LIKE 'shop/sale/%' AND res_key = $1",
    )
    .bind(key)
    .fetch_optional(pool)
    .await
    .expect("query")
    .map(|(s,)| s)
}

/// Holds the outbox sequence row: every ledger commit of an admission waits on it
/// (a slow PostgreSQL, a lock wait, a long fsync): the admission stays pending in
/// Redis past its bound while its sidecar is alive and about to commit.
async fn stall_commits(pool: &sqlx::PgPool) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut tx = pool.begin().await.expect("begin");
    sqlx::query("SELECT next_value FROM sequences WHERE name = 'outbox' FOR UPDATE")
        .execute(&mut *tx)
        .await
        .expect("lock");
    tx
}

/// Drop `sale` published in a Redis, a shared PostgreSQL ledger for its sidecars,
/// and a pool on that ledger for the test's own looks.
struct SharedSale {
    redis: RedisServer,
    postgres: PostgresServer,
    pool: sqlx::PgPool,
}

impl SharedSale {
    async fn start(spec: DropSpec) -> Self {
        let redis = RedisServer::start().expect("redis-server");
        let postgres = PostgresServer::start().expect("postgres");
        seed(&redis.url(), "sale", spec).await;
        let pool = sqlx::PgPool::connect(&postgres.url()).await.expect("pg");
        Self {
            redis,
            postgres,
            pool,
        }
    }

    /// A sidecar of the sale on its Redis and ledger.
    async fn sidecar(&self) -> Peer {
        Peer::start(&self.redis.url(), &self.postgres.url()).await
    }
}

/// Shared PostgreSQL. Alice's admission k1 is pending while its commit is slow
/// (> acquireTimeoutMs + 2 s). The sweeper finds it overdue, the ledger has no row
/// yet: abandon. Alice's client retries k1 (same user, quantity): reserve.lua has
/// no marker, admits afresh (new seq, new attempt). The first commit then lands;
/// its activate finds the retry's pending marker ("gone", state pending) and the
/// first request answers 201 without marking the row for replay. The retry's
/// record is KeyUsed (seq differs), so it undoes its marker and answers 200
/// already_reserved. Redis now has no marker and the unit back in stock, the ledger
/// has k1 active and "replayed": nothing ever replays it. Alice's confirm fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_201_after_the_sweeper_abandoned_and_a_retry_readmitted_stays_confirmable() {
    let sale = SharedSale::start(spec(2)).await;
    let a = sale.sidecar().await;
    let w = a.reserve("sale", "w", "w", 1).await;
    assert_eq!(w.status, 201, "{}", show(&w));

    let lock = stall_commits(&sale.pool).await;
    let http = a.http.clone();
    let first = tokio::spawn(async move { common::reserve(&http, "sale", "k1", "alice", 1).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        marker_state(&sale.redis, "sale", "k1").as_deref(),
        Some("pending")
    );
    // Past acquireTimeoutMs (100) + COMMIT_DEADLINE_MS (2000) and a sweep.
    tokio::time::sleep(Duration::from_millis(2600)).await;
    eprintln!(
        "after the bound: marker {:?}",
        marker_state(&sale.redis, "sale", "k1")
    );
    let http = a.http.clone();
    let retry = tokio::spawn(async move { common::reserve(&http, "sale", "k1", "alice", 1).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    eprintln!(
        "retry in flight: marker {:?}",
        marker_state(&sale.redis, "sale", "k1")
    );
    lock.rollback().await.expect("release");

    let first = first.await.expect("first");
    let retry = retry.await.expect("retry");
    eprintln!("first: {}\nretry: {}", show(&first), show(&retry));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let marker = marker_state(&sale.redis, "sale", "k1");
    let ledger = ledger_state(&sale.pool, "k1").await;
    eprintln!(
        "marker {marker:?}, ledger {ledger:?}, remaining {} held {}",
        redis_int(&sale.redis, DropKeys::remaining),
        redis_int(&sale.redis, DropKeys::held)
    );
    assert!(
        first.status == 201 || retry.status == 201 || retry.status == 200,
        "someone was told k1 is reserved"
    );
    let c = a.settle("sale", "k1", "confirm").await;
    eprintln!("confirm: {}", show(&c));
    assert_eq!(
        ledger.as_deref(),
        Some("active"),
        "the ledger holds alice's reservation"
    );
    assert_eq!(
        marker.as_deref(),
        Some("active"),
        "Redis must hold the reservation the ledger holds and alice was told about"
    );
    assert_eq!(c.outcome(), "confirmed", "{}", show(&c));
    a.shutdown().await;
}

/// Shared PostgreSQL, limit 2: the same abandon, then another buyer takes the
/// unit Redis got back while the first commit is still stuck. The shared ledger's
/// count must refuse one of them; after the replay Redis and the ledger agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_abandoned_admission_whose_commit_lands_never_oversells_a_shared_ledger() {
    let sale = SharedSale::start(spec(2)).await;
    let a = sale.sidecar().await;
    let b = sale.sidecar().await;
    let w = a.reserve("sale", "w", "w", 1).await;
    assert_eq!(w.status, 201, "{}", show(&w));

    let lock = stall_commits(&sale.pool).await;
    let http = a.http.clone();
    let first = tokio::spawn(async move { common::reserve(&http, "sale", "k1", "alice", 1).await });
    tokio::time::sleep(Duration::from_millis(2900)).await;
    eprintln!(
        "after the bound: marker {:?}",
        marker_state(&sale.redis, "sale", "k1")
    );
    let http = b.http.clone();
    let other = tokio::spawn(async move { common::reserve(&http, "sale", "k2", "bob", 1).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    lock.rollback().await.expect("release");
    let first = first.await.expect("first");
    let other = other.await.expect("other");
    eprintln!("first: {}\nother: {}", show(&first), show(&other));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let sold = 1 + [&first, &other].iter().filter(|r| r.status == 201).count();
    let remaining = redis_int(&sale.redis, DropKeys::remaining);
    let held = redis_int(&sale.redis, DropKeys::held);
    eprintln!(
        "k1 marker {:?} ledger {:?}; k2 marker {:?} ledger {:?}; remaining {remaining} held {held}",
        marker_state(&sale.redis, "sale", "k1"),
        ledger_state(&sale.pool, "k1").await,
        marker_state(&sale.redis, "sale", "k2"),
        ledger_state(&sale.pool, "k2").await,
    );
    assert!(sold <= 2, "oversold: {sold} 201s for a limit of 2");
    assert_eq!(remaining + held, 2, "Redis counts");
    assert!(held <= 2, "Redis holds {held} of 2");
    a.shutdown().await;
    b.shutdown().await;
}

/// Shared PostgreSQL, one throttle permit. The ledger stops answering in the
/// middle of k1's commit without closing anything (a frozen server, as behind a
/// network cut without resets): k1's buyer hears a 503 within bounded time, and
/// while nobody can say whether k1 landed its permit stays taken (k2 is
/// throttled). Once the ledger answers again k1 is resolved as it turned out (its
/// commit never landed: undone) and its permit goes back, so k2 is admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_admission_whose_commit_outcome_is_unknown_keeps_its_permit_until_resolved() {
    let sale = SharedSale::start(spec(5).permits(1)).await;
    let a = sale.sidecar().await;
    let w = a.reserve("sale", "w", "w", 1).await;
    assert_eq!(w.status, 201, "{}", show(&w));
    a.settle("sale", "w", "confirm")
        .await
        .assert_answer(200, "confirmed");

    let lock = stall_commits(&sale.pool).await;
    let http = a.http.clone();
    let first = tokio::spawn(async move { common::reserve(&http, "sale", "k1", "alice", 1).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    sale.postgres.freeze().expect("freeze");
    let first = first.await.expect("k1");
    first.assert_answer(503, "unavailable");
    assert!(
        first.text.contains("without saying whether it landed"),
        "{}",
        show(&first)
    );
    a.reserve("sale", "k2", "bob", 1)
        .await
        .assert_answer(503, "throttled");

    sale.postgres.thaw().expect("thaw");
    lock.rollback().await.expect("release");
    let mut second = a.reserve("sale", "k2", "bob", 1).await;
    for _ in 0..100 {
        if second.status != 503 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        second = a.reserve("sale", "k2", "bob", 1).await;
    }
    second.assert_answer(201, "admitted");
    assert_ne!(
        ledger_state(&sale.pool, "k1").await.as_deref(),
        Some("active")
    );
    assert_eq!(
        marker_state(&sale.redis, "sale", "k1"),
        None,
        "k1 was undone"
    );
    assert_eq!(redis_int(&sale.redis, DropKeys::remaining), 3);
    a.shutdown().await;
}

/// Shared PostgreSQL frozen while a confirm's commit is in flight and a cancel
/// waits behind it: both answer 503 in bounded time, and once the ledger answers
/// again neither turned out to have changed anything (Redis and the ledger both
/// hold the two reservations active, and the stock did not move).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_confirm_and_a_cancel_meeting_a_frozen_ledger_change_nothing() {
    let sale = SharedSale::start(spec(5)).await;
    let a = sale.sidecar().await;
    for key in ["c1", "c2", "c3"] {
        a.reserve("sale", key, key, 1)
            .await
            .assert_answer(201, "admitted");
    }
    let lock = stall_commits(&sale.pool).await;
    let http = a.http.clone();
    let confirm = tokio::spawn(async move {
        http.post("/v1/drops/sale/reservations/c1/confirm", "")
            .await
            .expect("answers")
    });
    let http = a.http.clone();
    let cancel = tokio::spawn(async move {
        http.post("/v1/drops/sale/reservations/c2/cancel", "")
            .await
            .expect("answers")
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    sale.postgres.freeze().expect("freeze");
    confirm
        .await
        .expect("confirm")
        .assert_answer(503, "unavailable");
    cancel
        .await
        .expect("cancel")
        .assert_answer(503, "unavailable");

    sale.postgres.thaw().expect("thaw");
    lock.rollback().await.expect("release");
    for key in ["c1", "c2"] {
        let mut looked = a.lookup("sale", key).await;
        for _ in 0..100 {
            if looked.status == 200 && looked.body["state"] == "active" {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            looked = a.lookup("sale", key).await;
        }
        assert_eq!(looked.body["state"], "active", "{key}: {}", show(&looked));
        assert_eq!(
            ledger_state(&sale.pool, key).await.as_deref(),
            Some("active"),
            "{key}"
        );
    }
    assert_eq!(redis_int(&sale.redis, DropKeys::remaining), 2);
    a.shutdown().await;
}
