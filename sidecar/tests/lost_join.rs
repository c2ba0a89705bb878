//! Joins a promoted replica lost: a buyer whose join was answered `waiting` keeps
//! their place, whether the loss shows when Redis is checked against the ledger
//! or only when Redis hands the lost join's place out again.

mod common;

use common::failover::LossyFailover;
use common::{
    NS, Peer, eventually, has_waitlist_entry as has_entry, join_line, ledger_key_in, look_line,
    one_per_buyer, seed,
};
use dropgate_api::DropKeys;
use dropgate_testkit::{RedisServer, Reply};

/// `key` (a buyer of its own name) waits for one unit of `drop`.
async fn join(peer: &Peer, drop: &str, key: &str) -> Reply {
    join_line(&peer.http, drop, key, key, 1).await
}

/// k0 takes the only unit of `sale`, and w1 waits in line for one.
async fn sell_out_and_wait(sidecar: &Peer) {
    sidecar
        .reserve("sale", "k0", "k0", 1)
        .await
        .assert_answer(201, "admitted");
    join(sidecar, "sale", "w1")
        .await
        .assert_answer(201, "waiting");
}

/// A drop of one unit, sold (k0 holds it), with w1 waiting in line, served by one
/// sidecar on its own Redis and SQLite ledger.
struct SoldOutLine {
    redis: RedisServer,
    sidecar: Peer,
    ledger_url: String,
    _dir: tempfile::TempDir,
}

impl SoldOutLine {
    async fn start(
        spec: dropgate_testkit::DropSpec,
        customize: impl FnOnce(&mut dropgate_sidecar::Settings),
    ) -> Self {
        let redis = RedisServer::start().expect("redis-server");
        let dir = tempfile::tempdir().expect("temp dir");
        let ledger_url = format!("sqlite://{}", dir.path().join("ledger.db").display());
        seed(&redis.url(), "sale", spec).await;
        let sidecar = Peer::start_custom(&redis.url(), &ledger_url, customize).await;
        sell_out_and_wait(&sidecar).await;
        Self {
            redis,
            sidecar,
            ledger_url,
            _dir: dir,
        }
    }
}

/// A replica promoted without the last join the ledger recorded, whose position
/// counter reads as far as the ledger's anyway: a join that ran there unchecked
/// took the lost join's position and was taken back, which leaves the counter
/// where it is (written here straight into the replica, as that join would). Redis
/// must not then pass for in line with the ledger (before: the counter decided
/// alone, and the entry was gone for good).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_join_lost_by_a_replica_whose_counter_caught_up_keeps_its_place() {
    let mut redis = LossyFailover::start().await;
    seed(
        &redis.primary.url(),
        "sale",
        one_per_buyer(1).waitlist().fail_closed(),
    )
    .await;
    // Neither the refresh nor the sweeper checks the replica in the meantime: only
    // the calls below do.
    let sidecar = Peer::start_custom(&redis.proxy.redis_url(), &redis.ledger, |settings| {
        settings.refresh_ms = 3000;
        settings.sweep_ms = 60_000;
    })
    .await;
    sell_out_and_wait(&sidecar).await;
    eventually("the replica to hold w1's entry", async || {
        has_entry(&redis.replica, "sale", "w1")
    })
    .await;
    redis.cut_off_replica_holding("sale", 1).await;
    // A join that ran on the replica took position 2 and was taken back.
    let mut replica = redis.replica.connection().expect("connect");
    let counter: i64 = redis::cmd("INCR")
        .arg(DropKeys::new(NS, "sale").waitlist_counter())
        .query(&mut replica)
        .expect("INCR");
    assert_eq!(counter, 2);
    // w2 joins at position 2, on the primary alone.
    let joined = join(&sidecar, "sale", "w2").await;
    joined.assert_answer(201, "waiting");
    assert_eq!(joined.body["position"], 2, "{}", joined.text);

    redis.fail_over(&sidecar, "sale").await;
    let mut looked = look_line(&sidecar.http, "sale", "w2").await;
    if looked.status == 503 {
        // (Answered while the breaker was open; asked again past it.)
        tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
        looked = look_line(&sidecar.http, "sale", "w2").await;
    }
    looked.assert_answer(200, "waiting");
    assert_eq!(looked.body["position"], 2, "{}", looked.text);
    assert!(has_entry(&redis.replica, "sale", "w2"));
    sidecar.shutdown().await;
}

/// The ledger records a join Redis no longer has after Redis was checked (a join
/// placed on the old primary whose commit landed late, after the check of the
/// promoted replica: written here straight into the ledger, at the next place).
/// The next join is then handed that same place by Redis: the ledger refuses it
/// (503, nothing changed) and Redis is rebuilt, the lost join with it; the retry
/// joins behind it. Before, the ledger recorded two joins at one place, and the
/// first was lost from the line for good (404).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_place_in_line_handed_out_twice_is_refused_and_the_lost_join_kept() {
    // No check of Redis by the refresh in the meantime: only the calls below run.
    let line = SoldOutLine::start(one_per_buyer(1).waitlist().fail_closed(), |settings| {
        settings.refresh_ms = 3000;
        settings.sweep_ms = 60_000;
    })
    .await;
    let (redis, sidecar, ledger_url) = (&line.redis, &line.sidecar, &line.ledger_url);
    let ledger = dropgate_sidecar::ledger::Ledger::open(ledger_url)
        .await
        .expect("the ledger");
    let lost = dropgate_sidecar::ledger::waitlist::Join {
        key: "lost",
        user: "lost",
        quantity: 1,
        variant: None,
        position: 2,
        attempt: "late",
        decided_on: None,
        stock_if_first: None,
    };
    ledger
        .join(&ledger_key_in(redis, "sale"), lost)
        .await
        .expect("the late join's write");

    let twice = join(sidecar, "sale", "w3").await;
    twice.assert_answer(503, "unavailable");
    assert!(twice.text.contains("lost a recent join"), "{}", twice.text);
    let joined = join(sidecar, "sale", "w3").await;
    joined.assert_answer(201, "waiting");
    assert_eq!(joined.body["position"], 3, "{}", joined.text);
    let kept = look_line(&sidecar.http, "sale", "lost").await;
    kept.assert_answer(200, "waiting");
    assert_eq!(kept.body["position"], 2, "{}", kept.text);
    line.sidecar.shutdown().await;
}

/// The ledger's highest position is a join given up on (its sidecar never wrote
/// it; written here straight into the ledger, as `give_up_join` does), which a
/// rebuild does not replay. The rebuild raises Redis's position counter past it
/// all the same: Redis is then in line, and rebuilt once. Before, the counter
/// stayed below the ledger's highest position, and every check rebuilt Redis
/// again (the gate's epoch moved at each refresh, each rebuild a closed gate).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_join_given_up_on_costs_one_rebuild_not_one_per_check() {
    let line = SoldOutLine::start(one_per_buyer(1).waitlist(), |_| {}).await;
    let (redis, sidecar, ledger_url) = (&line.redis, &line.sidecar, &line.ledger_url);
    let ledger = dropgate_sidecar::ledger::Ledger::open(ledger_url)
        .await
        .expect("the ledger");
    let keys = DropKeys::new(NS, "sale");
    let mut conn = redis.connection().expect("connect");
    let given_up = dropgate_sidecar::ledger::waitlist::Join {
        key: "w2",
        user: "w2",
        quantity: 1,
        variant: None,
        position: 2,
        attempt: "dead",
        decided_on: None,
        stock_if_first: None,
    };
    ledger
        .give_up_join(&ledger_key_in(redis, "sale"), "w2", "dead", given_up)
        .await
        .expect("the claim of the dead join");

    let counter = |conn: &mut redis::Connection| -> i64 {
        redis::cmd("GET")
            .arg(keys.waitlist_counter())
            .query::<Option<i64>>(conn)
            .expect("GET")
            .unwrap_or(0)
    };
    let gate = |conn: &mut redis::Connection| -> Option<String> {
        redis::cmd("GET").arg(keys.gate()).query(conn).expect("GET")
    };
    // The rebuild raises the counter before it opens the gate again: wait for both,
    // or the gate read below may be the same rebuild still closed.
    eventually(
        "the rebuild to raise the counter past the given-up join and open the gate",
        async || {
            counter(&mut conn) == 2
                && gate(&mut conn).is_some_and(|gate| !gate.starts_with("closed:"))
        },
    )
    .await;
    // Ten refreshes later (one every 100 ms here): no rebuild since.
    let opened = gate(&mut conn);
    tokio::time::sleep(std::time::Duration::from_millis(1000)).await;
    assert_eq!(gate(&mut conn), opened, "Redis was rebuilt again");
    join(sidecar, "sale", "w3")
        .await
        .assert_answer(201, "waiting");
    line.sidecar.shutdown().await;
}

/// Either ledger refuses a second join at one position, as a position taken (the
/// sidecar then rebuilds Redis), and writes nothing of it; a join given up on
/// holds no position.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn either_ledger_refuses_a_position_twice() {
    use dropgate_sidecar::ledger::{Ledger, LedgerError};
    let ledgers = BothLedgers::start();
    let at = |key: &'static str, position: i64| join_of(key, position, None);
    for url in ledgers.urls() {
        let ledger = Ledger::open(&url).await.expect("the ledger opens");
        let drop_key = "shop/sale/s1";
        ledger
            .give_up_join(drop_key, "dead", "dead", at("dead", 1))
            .await
            .expect("the claim of a dead join");
        ledger.join(drop_key, at("w1", 1)).await.expect("w1 joins");
        match ledger.join(drop_key, at("w2", 1)).await {
            Err(LedgerError::PositionTaken(1)) => {}
            other => panic!("{url}: w2 at w1's position: {other:?}"),
        }
        assert_eq!(
            ledger.waiting_entry(drop_key, "w2").await.expect("reads"),
            None,
            "{url}"
        );
    }
}

/// Either ledger refuses, in the join's own transaction, a join Redis decided on an
/// older generation of the drop's config than the ledger has seen (one a peer's
/// commit noted after this sidecar last read the config), and writes nothing of
/// it; a join decided on the newest, or not compared, is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn either_ledger_refuses_a_join_decided_on_an_older_config() {
    use dropgate_sidecar::ledger::{
        Ledger, LedgerError,
        waitlist::{Join, WaitState},
    };
    let ledgers = BothLedgers::start();
    let on = join_of;
    for url in ledgers.urls() {
        let ledger = Ledger::open(&url).await.expect("the ledger opens");
        let drop_key = "shop/sale/s1";
        // A peer noted generation 5 of the drop's config.
        let stock = dropgate_sidecar::reservation::Stock {
            limit: 0,
            generation: 5,
            terms: None,
            variants: None,
        };
        ledger
            .note_config(drop_key, &stock)
            .await
            .expect("generation 5 noted");
        match ledger.join(drop_key, on("stale", 1, Some(4))).await {
            Err(LedgerError::ConfigBehind {
                decided_on: 4,
                newest: 5,
            }) => {}
            other => panic!("{url}: a join decided on generation 4: {other:?}"),
        }
        assert_eq!(
            ledger
                .waiting_entry(drop_key, "stale")
                .await
                .expect("reads"),
            None,
            "{url}: nothing of it written"
        );
        for (key, position, decided_on) in [("current", 1, Some(5)), ("not-compared", 2, None)] {
            let row = ledger
                .join(drop_key, on(key, position, decided_on))
                .await
                .unwrap_or_else(|e| panic!("{url}: {key} joins: {e}"));
            assert_eq!(row.state, WaitState::Waiting, "{url}");
        }
        // A retry of a key the ledger has a join for writes nothing, so it is not
        // judged: it hears of the join that stands, whatever config it was on.
        let retry = Join {
            attempt: "a-retry",
            ..on("current", 1, Some(4))
        };
        let row = ledger
            .join(drop_key, retry)
            .await
            .unwrap_or_else(|e| panic!("{url}: a retry of a durable join: {e}"));
        assert_eq!(row.attempt, "current", "{url}");
    }
}

/// On PostgreSQL a join decided on generation 5 while a peer's transaction is
/// noting generation 6 (the stock row locked, not yet committed) waits for it and
/// is refused once it commits: read before the join's transaction, generation 5
/// would still have been the newest, and the join recorded after 6 was noted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_waits_for_a_peer_noting_a_newer_config() {
    use dropgate_sidecar::ledger::Ledger;
    let postgres = dropgate_testkit::PostgresServer::start().expect("postgres");
    let ledger = Ledger::open(&postgres.url())
        .await
        .expect("the ledger opens");
    let drop_key = "shop/sale/s1";
    let noted = |generation| dropgate_sidecar::reservation::Stock {
        limit: 0,
        generation,
        terms: None,
        variants: None,
    };
    ledger
        .note_config(drop_key, &noted(5))
        .await
        .expect("generation 5 noted");
    // The peer's transaction, as a group commit takes the row: locked for update.
    let mut peer = ledger.pool().begin().await.expect("begins");
    sqlx::query("SELECT generation FROM stock WHERE drop_key = $1 FOR UPDATE")
        .bind(drop_key)
        .execute(&mut *peer)
        .await
        .expect("locks the stock row");
    sqlx::query("UPDATE stock SET generation = 6 WHERE drop_key = $1")
        .bind(drop_key)
        .execute(&mut *peer)
        .await
        .expect("notes generation 6");
    let joining = {
        let ledger = ledger.clone();
        tokio::spawn(async move { ledger.join(drop_key, join_of("w1", 1, Some(5))).await })
    };
    assert_join_waits_then_is_refused(&ledger, drop_key, peer, joining).await;
}

/// On PostgreSQL a join on a drop the ledger has no stock row for yet, decided on
/// generation 5 while a peer's transaction is making the row at generation 6 (not
/// yet committed), waits for it and is refused once it commits. Before, with no
/// row to lock, the join read no generation at all and was written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_waits_for_a_peer_making_the_first_stock_row() {
    use dropgate_sidecar::ledger::{Ledger, waitlist::Join};
    let postgres = dropgate_testkit::PostgresServer::start().expect("postgres");
    let ledger = Ledger::open(&postgres.url())
        .await
        .expect("the ledger opens");
    let drop_key = "shop/sale/s1";
    // The peer's first commit of the drop, making the row (the columns
    // ensure_stock writes that matter here: no limit, generation 6).
    let mut peer = ledger.pool().begin().await.expect("begins");
    sqlx::query("INSERT INTO stock (drop_key, lim, available, generation) VALUES ($1, 0, 0, 6)")
        .bind(drop_key)
        .execute(&mut *peer)
        .await
        .expect("makes the stock row at generation 6");
    let known = dropgate_sidecar::reservation::Stock {
        limit: 0,
        generation: 5,
        terms: None,
        variants: None,
    };
    let joining = {
        let ledger = ledger.clone();
        tokio::spawn(async move {
            let join = Join {
                stock_if_first: Some(&known),
                ..join_of("w1", 1, Some(5))
            };
            ledger.join(drop_key, join).await
        })
    };
    // (Without the row made in its transaction the join would not wait, and this
    // fails; it cannot pass while the join is unordered.)
    assert_join_waits_then_is_refused(&ledger, drop_key, peer, joining).await;
}

/// Asserts that the join of w1 (decided on generation 5) in flight as `joining`
/// waits for the `peer`'s transaction (noting generation 6), and once that commits
/// is refused as decided on an older config, with nothing of it written.
async fn assert_join_waits_then_is_refused(
    ledger: &dropgate_sidecar::ledger::Ledger,
    drop_key: &str,
    peer: sqlx::Transaction<'static, sqlx::Any>,
    joining: tokio::task::JoinHandle<
        Result<dropgate_sidecar::ledger::waitlist::WaitRow, dropgate_sidecar::ledger::LedgerError>,
    >,
) {
    use dropgate_sidecar::ledger::LedgerError;
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(
        !joining.is_finished(),
        "the join waits for the peer's commit"
    );
    peer.commit().await.expect("the peer commits");
    match joining.await.expect("the join's task") {
        Err(LedgerError::ConfigBehind {
            decided_on: 5,
            newest: 6,
        }) => {}
        other => panic!("a join decided on generation 5 after 6 was noted: {other:?}"),
    }
    assert_eq!(
        ledger.waiting_entry(drop_key, "w1").await.expect("reads"),
        None
    );
}

/// A SQLite ledger file and a PostgreSQL server, for a test that runs on either.
struct BothLedgers {
    postgres: dropgate_testkit::PostgresServer,
    dir: tempfile::TempDir,
}

impl BothLedgers {
    fn start() -> Self {
        Self {
            postgres: dropgate_testkit::PostgresServer::start().expect("postgres"),
            dir: tempfile::tempdir().expect("temp dir"),
        }
    }

    fn urls(&self) -> [String; 2] {
        [
            format!("sqlite://{}", self.dir.path().join("ledger.db").display()),
            self.postgres.url(),
        ]
    }
}

/// Buyer `key`'s join of one unit at `position`, under attempt `key`, decided on
/// generation `decided_on` of the drop's config.
fn join_of(
    key: &'static str,
    position: i64,
    decided_on: Option<i64>,
) -> dropgate_sidecar::ledger::waitlist::Join<'static> {
    dropgate_sidecar::ledger::waitlist::Join {
        key,
        user: key,
        quantity: 1,
        variant: None,
        position,
        attempt: key,
        decided_on,
        stock_if_first: None,
    }
}
