//! Bounded growth (`--ledger-retention`): the ledger forgets a sale once Redis says
//! it is over and the retention has passed, never one still selling or with events
//! not yet sent; a drop's event stream drops only what every consumer group has
//! read and acknowledged.

mod common;

use std::time::Duration;

use common::{NS, Sidecar};
use dropgate_api::DropKeys;
use dropgate_sidecar::clock::now_ms;
use dropgate_sidecar::ledger::retention::{self, Pruned};
use dropgate_testkit::{DropSpec, PostgresServer, RedisServer};
use sqlx::AnyPool;

/// Rows of the sale `drop_key` in each table that holds them.
async fn rows_of(pool: &AnyPool, drop_key: &str) -> Vec<(&'static str, i64)> {
    let mut counts = Vec::new();
    for table in [
        "reservations",
        "outbox",
        "stock",
        "variant_stock",
        "buyers",
        "authority",
        "gate_seen",
        "sales",
        "ended_sales",
    ] {
        let count: i64 = sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(format!(
            "SELECT COUNT(*) FROM {table} WHERE drop_key = $1"
        )))
        .bind(drop_key)
        .fetch_one(pool)
        .await
        .expect("count");
        counts.push((table, count));
    }
    counts
}

fn total(rows: &[(&str, i64)]) -> i64 {
    rows.iter().map(|(_, n)| n).sum()
}

/// Waits until `check` holds (the sidecar's refresh and dispatcher run every
/// 100 ms in tests).
async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..100 {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{what}: not within 10 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_drops_sale_is_forgotten_once_the_retention_passed_and_no_other() {
    deleted_sale_forgotten(None).await;
    let postgres = PostgresServer::start().expect("PostgreSQL starts");
    deleted_sale_forgotten(Some(postgres.url())).await;
}

/// The case on a SQLite ledger (None) or the PostgreSQL at `database`.
async fn deleted_sale_forgotten(database: Option<String>) {
    let sidecar = Sidecar::start_with_database(database.clone()).await;
    sidecar.seed("sale", DropSpec::new(10)).await;
    sidecar.seed("other", DropSpec::new(10)).await;
    for (drop, key) in [("sale", "a"), ("sale", "b"), ("sale", "c"), ("other", "x")] {
        sidecar
            .reserve(drop, key, key, 1)
            .await
            .assert_answer(201, "admitted");
    }
    sidecar
        .settle("sale", "a", "confirm")
        .await
        .assert_answer(200, "confirmed");
    sidecar
        .settle("sale", "b", "cancel")
        .await
        .assert_answer(200, "cancelled");
    let (sale, other) = (sidecar.ledger_key("sale"), sidecar.ledger_key("other"));
    let url = database.unwrap_or_else(|| format!("sqlite://{}", sidecar.database_path().display()));
    let ledger = dropgate_sidecar::ledger::Ledger::open(&url)
        .await
        .expect("the ledger opens");
    let pool = ledger.pool();
    let unsent = || async {
        sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM outbox WHERE sent_at_ms IS NULL")
            .fetch_one(pool)
            .await
            .expect("count")
    };
    eventually("every event sent", || async { unsent().await == 0 }).await;
    // The other drop's rows as they stay: its gate's note is written by the
    // sidecar's own check of Redis, which may come after its first sale.
    eventually("the other drop's gate noted", || async {
        rows_of(pool, &other)
            .await
            .iter()
            .any(|(t, n)| *t == "gate_seen" && *n == 1)
    })
    .await;
    let other_before = rows_of(pool, &other).await;

    // Selling, or ended by its clock only: nothing is noted, nothing goes.
    assert_eq!(
        retention::prune(pool, now_ms() + 86_400_000)
            .await
            .expect("prune"),
        Pruned::default()
    );

    // The shop deletes the drop: the sidecar notes its sale over.
    let mut conn = dropgate_redis::Connection::from(
        redis::aio::ConnectionManager::new(redis::Client::open(sidecar.redis.url()).expect("url"))
            .await
            .expect("connect"),
    );
    dropgate_operator::store::remove(&mut conn, &DropKeys::new(NS, "sale"))
        .await
        .expect("deleted");
    eventually("the sale noted over", || async {
        rows_of(pool, &sale)
            .await
            .iter()
            .any(|(t, n)| *t == "ended_sales" && *n == 1)
    })
    .await;

    // Within the retention it stays.
    let noted = rows_of(pool, &sale).await;
    assert_eq!(
        retention::prune(pool, now_ms() - 3_600_000)
            .await
            .expect("prune"),
        Pruned::default()
    );
    assert_eq!(rows_of(pool, &sale).await, noted);

    // An event not yet sent holds it back.
    sqlx::query(
        "UPDATE outbox SET sent_at_ms = NULL WHERE drop_key = $1 AND event_id LIKE '%/a/confirmed'",
    )
    .bind(&sale)
    .execute(pool)
    .await
    .expect("update");
    assert_eq!(
        retention::prune(pool, now_ms() + 1000)
            .await
            .expect("prune")
            .sales,
        0
    );
    sqlx::query("UPDATE outbox SET sent_at_ms = 1 WHERE drop_key = $1")
        .bind(&sale)
        .execute(pool)
        .await
        .expect("update");

    // Past the retention: every row of the sale goes, the other drop's stay.
    let pruned = retention::prune(pool, now_ms() + 1000)
        .await
        .expect("prune");
    assert_eq!(pruned.sales, 1);
    assert_eq!(pruned.rows as i64, total(&noted));
    assert_eq!(total(&rows_of(pool, &sale).await), 0);
    assert_eq!(rows_of(pool, &other).await, other_before);
    // The other drop sells on.
    sidecar
        .reserve("other", "y", "y", 1)
        .await
        .assert_answer(201, "admitted");
    sidecar.shutdown().await;
}

/// `XADD` of an entry at `ms`.
fn add(conn: &mut redis::Connection, stream: &str, ms: i64) -> String {
    redis::cmd("XADD")
        .arg(stream)
        .arg(format!("{ms}-0"))
        .arg("payload")
        .arg("{}")
        .query(conn)
        .expect("XADD")
}

fn ids(conn: &mut redis::Connection, stream: &str) -> Vec<String> {
    let entries: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg(stream)
        .arg("-")
        .arg("+")
        .query(conn)
        .expect("XRANGE");
    entries.into_iter().map(|(id, _)| id).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_drops_only_old_entries_every_consumer_group_acknowledged() {
    let redis = RedisServer::start().expect("redis-server");
    let mut sync = redis.connection().expect("connect");
    let mut conn = dropgate_redis::Connection::from(
        redis::aio::ConnectionManager::new(redis::Client::open(redis.url()).expect("url"))
            .await
            .expect("connect"),
    );
    let stream = DropKeys::new(NS, "sale").events();
    let cutoff = now_ms() - 3_600_000;

    // No stream: nothing to do.
    assert_eq!(
        retention::trim_stream(&mut conn, &stream, cutoff)
            .await
            .expect("trim"),
        0
    );

    // Without groups, age alone decides.
    let old: Vec<String> = (1..=6).map(|i| add(&mut sync, &stream, 1000 * i)).collect();
    let fresh = add(&mut sync, &stream, now_ms());
    // A group that read and acknowledged the first four, and one that was given
    // the first five but acknowledged only up to the second: it still needs the
    // third.
    for group in ["shipping", "email"] {
        let _: () = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&stream)
            .arg(group)
            .arg("0")
            .query(&mut sync)
            .expect("XGROUP");
    }
    let read = |sync: &mut redis::Connection, group: &str, count: usize| {
        let _: redis::Value = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(group)
            .arg("c1")
            .arg("COUNT")
            .arg(count)
            .arg("STREAMS")
            .arg(&stream)
            .arg(">")
            .query(sync)
            .expect("XREADGROUP");
    };
    let ack = |sync: &mut redis::Connection, group: &str, ids: &[String]| {
        let _: i64 = redis::cmd("XACK")
            .arg(&stream)
            .arg(group)
            .arg(ids)
            .query(sync)
            .expect("XACK");
    };
    read(&mut sync, "shipping", 4);
    ack(&mut sync, "shipping", &old[..4]);
    read(&mut sync, "email", 5);
    ack(&mut sync, "email", &old[..2]);
    assert_eq!(
        retention::trim_stream(&mut conn, &stream, cutoff)
            .await
            .expect("trim"),
        2
    );
    let mut kept = old[2..].to_vec();
    kept.push(fresh.clone());
    assert_eq!(ids(&mut sync, &stream), kept);

    // Once email acknowledged what it was given, shipping's progress (it was last
    // given the fourth) bounds the trim.
    ack(&mut sync, "email", &old[2..5]);
    assert_eq!(
        retention::trim_stream(&mut conn, &stream, cutoff)
            .await
            .expect("trim"),
        1
    );
    assert_eq!(ids(&mut sync, &stream)[0], old[3]);

    // Both read everything: only what is younger than the retention stays (and
    // the last entry delivered, which XTRIM MINID keeps).
    read(&mut sync, "shipping", 10);
    read(&mut sync, "email", 10);
    let rest: Vec<String> = ids(&mut sync, &stream);
    ack(&mut sync, "shipping", &rest);
    ack(&mut sync, "email", &rest);
    retention::trim_stream(&mut conn, &stream, cutoff)
        .await
        .expect("trim");
    assert_eq!(ids(&mut sync, &stream), vec![fresh]);
}
