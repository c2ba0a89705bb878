//! The outbox with sidecars sharing one PostgreSQL ledger: each event reaches its
//! drop's stream once, and an event that cannot be published holds back only its
//! own drop's later events.

mod common;

use std::time::Duration;

use common::{NS, Peer, one_per_buyer, seed};
use dropgate_api::DropKeys;
use dropgate_testkit::{PostgresServer, RedisServer};
use futures::future::join_all;
use sqlx::Row;

/// Events the ledger holds for `drop`, and how many are still unpublished.
async fn ledger_events(database_url: &str, drop: &str) -> (i64, i64) {
    let pool = sqlx::postgres::PgPool::connect(database_url)
        .await
        .expect("connect");
    let row = sqlx::query(
        "SELECT COUNT(*), COUNT(*) FILTER (WHERE sent_at_ms IS NULL) FROM outbox WHERE drop_key LIKE $1",
    )
    .bind(format!("{NS}/{drop}/%"))
    .fetch_one(&pool)
    .await
    .expect("query");
    pool.close().await;
    (row.get(0), row.get(1))
}

/// Entries in `drop`'s event stream.
fn stream_length(redis: &RedisServer, drop: &str) -> i64 {
    let mut conn = redis.connection().expect("connect");
    redis::cmd("XLEN")
        .arg(DropKeys::new(NS, drop).events())
        .query(&mut conn)
        .unwrap_or(0)
}

/// Event ids in `drop`'s stream, in stream order.
fn stream_order(redis: &RedisServer, drop: &str) -> Vec<String> {
    let mut conn = redis.connection().expect("connect");
    let entries: Vec<(String, std::collections::HashMap<String, String>)> = redis::cmd("XRANGE")
        .arg(DropKeys::new(NS, drop).events())
        .arg("-")
        .arg("+")
        .query(&mut conn)
        .expect("XRANGE");
    entries
        .into_iter()
        .map(|(_, f)| f["eventId"].clone())
        .collect()
}

/// Event ids of `drop` in the ledger's order.
async fn outbox_order(database_url: &str, drop: &str) -> Vec<String> {
    let pool = sqlx::postgres::PgPool::connect(database_url)
        .await
        .expect("connect");
    let rows = sqlx::query("SELECT event_id FROM outbox WHERE drop_key LIKE $1 ORDER BY id")
        .bind(format!("{NS}/{drop}/%"))
        .fetch_all(&pool)
        .await
        .expect("query");
    pool.close().await;
    rows.iter().map(|r| r.get::<String, _>(0)).collect()
}

/// Sells `buyers` reservations of `drop` through the peers in turn, and confirms them.
async fn sell(peers: &[&Peer], drop: &str, buyers: usize) {
    join_all((0..buyers).map(|i| {
        let peer = peers[i % peers.len()];
        async move {
            let key = format!("{drop}-{i}");
            // The first requests may meet the gate while it opens (503, retry).
            let mut reply = peer.reserve(drop, &key, &key, 1).await;
            for _ in 0..50 {
                if reply.status != 503 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
                reply = peer.reserve(drop, &key, &key, 1).await;
            }
            assert_eq!(reply.status, 201, "{}", reply.text);
            assert_eq!(
                peer.settle(drop, &key, "confirm").await.status.as_u16(),
                200
            );
        }
    }))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_sidecars_sharing_a_ledger_publish_each_event_once() {
    let redis = RedisServer::start().expect("redis-server");
    let postgres = PostgresServer::start().expect("postgres");
    seed(&redis.url(), "sale", one_per_buyer(100)).await;
    let peers = [
        Peer::start(&redis.url(), &postgres.url()).await,
        Peer::start(&redis.url(), &postgres.url()).await,
        Peer::start(&redis.url(), &postgres.url()).await,
    ];
    sell(&peers.iter().collect::<Vec<_>>(), "sale", 100).await;
    let mut published = (0, -1);
    for _ in 0..100 {
        published = ledger_events(&postgres.url(), "sale").await;
        if published.1 == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (events, unpublished) = published;
    assert_eq!(unpublished, 0, "every event published");
    assert_eq!(events, 200, "an admission and a confirm per buyer");
    assert_eq!(stream_length(&redis, "sale"), events, "each event once");
    assert_eq!(
        stream_order(&redis, "sale"),
        outbox_order(&postgres.url(), "sale").await,
        "in the order the ledger wrote them"
    );
    for peer in peers {
        peer.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_event_that_cannot_be_published_holds_back_only_its_drop() {
    let redis = RedisServer::start().expect("redis-server");
    let postgres = PostgresServer::start().expect("postgres");
    seed(&redis.url(), "blocked", one_per_buyer(300)).await;
    seed(&redis.url(), "flowing", one_per_buyer(10)).await;
    // The blocked drop's stream key holds a string: every XADD to it fails.
    let mut conn = redis.connection().expect("connect");
    let _: () = redis::cmd("SET")
        .arg(DropKeys::new(NS, "blocked").events())
        .arg("not a stream")
        .query(&mut conn)
        .expect("SET");
    let peer = Peer::start(&redis.url(), &postgres.url()).await;
    // The blocked drop's events come first in the outbox, more of them than a
    // dispatch round takes (512).
    sell(&[&peer], "blocked", 300).await;
    sell(&[&peer], "flowing", 5).await;
    let mut flowing = (0, -1);
    for _ in 0..100 {
        flowing = ledger_events(&postgres.url(), "flowing").await;
        if flowing.1 == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(flowing, (10, 0), "the other drop's events all went out");
    assert_eq!(stream_length(&redis, "flowing"), 10);
    let (blocked, waiting) = ledger_events(&postgres.url(), "blocked").await;
    assert_eq!(
        (blocked, waiting),
        (600, 600),
        "kept for when its stream works"
    );
    peer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_drops_that_cannot_publish_never_fill_the_rounds() {
    let redis = RedisServer::start().expect("redis-server");
    let postgres = PostgresServer::start().expect("postgres");
    let mut conn = redis.connection().expect("connect");
    // Eight drops whose streams are broken, 64 events each: eight times a drop's
    // share of a round, 512, a round's whole size.
    let blocked: Vec<String> = (0..8).map(|i| format!("blocked-{i}")).collect();
    for drop in &blocked {
        seed(&redis.url(), drop, one_per_buyer(32)).await;
        let _: () = redis::cmd("SET")
            .arg(DropKeys::new(NS, drop).events())
            .arg("not a stream")
            .query(&mut conn)
            .expect("SET");
    }
    seed(&redis.url(), "flowing", one_per_buyer(10)).await;
    let peer = Peer::start(&redis.url(), &postgres.url()).await;
    for drop in &blocked {
        sell(&[&peer], drop, 32).await;
    }
    sell(&[&peer], "flowing", 1).await;
    let mut flowing = (0, -1);
    for _ in 0..150 {
        flowing = ledger_events(&postgres.url(), "flowing").await;
        if flowing.1 == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(flowing, (2, 0), "the healthy drop's events went out");
    peer.shutdown().await;
}
