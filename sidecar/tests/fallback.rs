//! The fail-open path: the ledger's own gate when the kill switch is off or Redis is
//! down under failurePolicy Open; nothing admitted under Closed; Redis replayed to
//! agree with the ledger when the gate reopens; and a shared PostgreSQL ledger that
//! two sidecars on the fallback path cannot oversell together.

mod common;

use std::collections::HashMap;

use common::{Peer, Sidecar, assert_unavailable_saying, one_per_buyer};
use dropgate_testkit::{DropSpec, PostgresServer};
use futures::future::join_all;

fn tally<'a>(replies: impl Iterator<Item = &'a dropgate_testkit::Reply>) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for reply in replies {
        *counts.entry(reply.outcome().to_string()).or_default() += 1;
    }
    counts
}

fn fallback_header(reply: &dropgate_testkit::Reply) -> Option<&str> {
    reply
        .headers
        .get("dropgate-path")
        .and_then(|v| v.to_str().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_kill_switch_sells_through_the_ledger_and_the_gate_catches_up() {
    let sidecar = Sidecar::start().await;
    sidecar.seed("sale", one_per_buyer(20)).await;
    for i in 0..5 {
        assert_eq!(
            sidecar
                .reserve("sale", &format!("gate-{i}"), &format!("early-{i}"), 1)
                .await
                .status,
            201
        );
    }
    sidecar.seed("sale", one_per_buyer(20).kill_switch()).await;
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let redis_before = sidecar.remaining("sale");

    let replies = join_all((0..100).map(|i| {
        let sidecar = &sidecar;
        async move {
            sidecar
                .reserve("sale", &format!("fb-{i}"), &format!("buyer-{i}"), 1)
                .await
        }
    }))
    .await;
    let counts = tally(replies.iter());
    assert_eq!(
        counts.get("admitted"),
        Some(&15),
        "20 units, 5 sold on the gate: {counts:?}"
    );
    assert_eq!(counts.get("sold_out"), Some(&85), "{counts:?}");
    for reply in &replies {
        assert_eq!(fallback_header(reply), Some("fallback"), "{}", reply.text);
        if reply.status == 201 {
            assert_eq!(reply.body["path"], "fallback");
        }
    }
    assert_eq!(
        sidecar.remaining("sale"),
        redis_before,
        "Redis's gate took no part"
    );

    // Same outcomes as the gate: idempotency, per-user limit, confirm, cancel.
    let admitted: Vec<String> = replies
        .iter()
        .filter(|r| r.status == 201)
        .map(|r| r.body["key"].as_str().unwrap_or("").to_string())
        .collect();
    let first = &admitted[0];
    let user = replies
        .iter()
        .find(|r| r.body["key"] == first.as_str())
        .map(|r| r.body["user"].as_str().unwrap_or("").to_string())
        .unwrap_or_default();
    let again = sidecar.reserve("sale", first, &user, 1).await;
    again.assert_answer(200, "already_reserved");
    let reused = sidecar.reserve("sale", first, "someone-else", 1).await;
    reused.assert_answer(422, "idempotency_key_reused");
    let second_key = sidecar.reserve("sale", "other-key", &user, 1).await;
    second_key.assert_answer(409, "per_user_limit_exceeded");
    let confirmed = sidecar.settle("sale", first, "confirm").await;
    confirmed.assert_answer(200, "confirmed");
    assert_eq!(fallback_header(&confirmed), Some("fallback"));
    assert_eq!(
        sidecar.settle("sale", first, "confirm").await.outcome(),
        "already_confirmed"
    );
    let cancelled = sidecar.settle("sale", &admitted[1], "cancel").await;
    cancelled.assert_answer(200, "cancelled");
    assert_eq!(
        sidecar
            .settle("sale", &admitted[1], "cancel")
            .await
            .outcome(),
        "already_cancelled"
    );
    let found = sidecar.lookup("sale", first).await;
    assert_eq!(
        (found.status.as_u16(), found.body["state"].as_str()),
        (200, Some("confirmed"))
    );
    // A gate-admitted reservation is served by the ledger too.
    let gate_made = sidecar.settle("sale", "gate-0", "confirm").await;
    gate_made.assert_answer(200, "confirmed");
    // The cancelled unit is for sale again, on the fallback path.
    let late = sidecar.reserve("sale", "late", "late-buyer", 1).await;
    late.assert_answer(201, "admitted");

    // Gate back on: Redis replays what the fallback did before it admits again.
    sidecar.seed("sale", one_per_buyer(20)).await;
    let mut caught_up = false;
    for _ in 0..50 {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        if sidecar.remaining("sale") == 0 && sidecar.held("sale") == 20 {
            caught_up = true;
            break;
        }
    }
    assert!(
        caught_up,
        "remaining {} held {}",
        sidecar.remaining("sale"),
        sidecar.held("sale")
    );
    sidecar.assert_invariants("sale", 20);
    let refused = sidecar.reserve("sale", "after", "after-buyer", 1).await;
    refused.assert_answer(409, "sold_out");
    assert_eq!(fallback_header(&refused), None, "the gate answers again");
    let on_gate = sidecar.lookup("sale", first).await;
    assert_eq!(
        on_gate.body["state"], "confirmed",
        "the fallback's confirm reached Redis"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_under_policy_closed_admits_nothing() {
    let mut sidecar = Sidecar::start().await;
    sidecar.seed("sale", one_per_buyer(5).fail_closed()).await;
    assert_eq!(sidecar.reserve("sale", "a", "alice", 1).await.status, 201);
    sidecar.redis.stop();
    for i in 0..10 {
        let reply = sidecar
            .reserve("sale", &format!("k{i}"), &format!("u{i}"), 1)
            .await;
        assert_unavailable_saying(&reply, "Closed");
    }
    let confirm = sidecar.settle("sale", "a", "confirm").await;
    assert_eq!(confirm.status, 503);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_under_policy_open_sells_through_the_ledger() {
    // A shared ledger: a per-pod one cannot know that it sells alone while it
    // cannot reach Redis, and closes instead (below).
    let postgres = PostgresServer::start().expect("PostgreSQL starts");
    let mut sidecar = Sidecar::start_with_database(Some(postgres.url())).await;
    sidecar.seed("sale", one_per_buyer(5)).await;
    assert_eq!(sidecar.reserve("sale", "a", "alice", 1).await.status, 201);
    sidecar.redis.stop();
    // A Redis failure right after Redis answered is not yet an outage: the ledger
    // takes over once no sidecar has reached Redis for a few refreshes (1 s here).
    let early = sidecar.reserve("sale", "early", "early", 1).await;
    assert_eq!(early.outcome(), "unavailable", "{}", early.text);
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let replies = join_all((0..10).map(|i| {
        let sidecar = &sidecar;
        async move {
            sidecar
                .reserve("sale", &format!("k{i}"), &format!("u{i}"), 1)
                .await
        }
    }))
    .await;
    let counts = tally(replies.iter());
    assert_eq!(counts.get("admitted"), Some(&4), "{counts:?}");
    assert_eq!(counts.get("sold_out"), Some(&6), "{counts:?}");
    assert!(
        replies
            .iter()
            .all(|r| fallback_header(r) == Some("fallback"))
    );
    let confirm = sidecar.settle("sale", "a", "confirm").await;
    confirm.assert_answer(200, "confirmed");
    assert_eq!(fallback_header(&confirm), Some("fallback"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_sidecars_sharing_postgresql_never_oversell_on_the_fallback() {
    let postgres = PostgresServer::start().expect("PostgreSQL starts");
    let first = Sidecar::start_with_database(Some(postgres.url())).await;
    let second = Peer::start(&first.redis.url(), &postgres.url()).await;
    first.seed("sale", one_per_buyer(25).kill_switch()).await;

    // Every buyer once, half through each sidecar (`swapped`: each through the other).
    let round = |swapped: bool| {
        let (first, second) = (&first, &second);
        join_all((0..200usize).map(move |i| async move {
            let (key, user) = (format!("k{i}"), format!("u{i}"));
            until_decided(async || {
                if i.is_multiple_of(2) != swapped {
                    first.reserve("sale", &key, &user, 1).await
                } else {
                    second.reserve("sale", &key, &user, 1).await
                }
            })
            .await
        }))
    };
    let replies = round(false).await;
    // And the same keys again through the other sidecar: retries across pods.
    let retries = round(true).await;
    let counts = tally(replies.iter());
    let odd: Vec<&str> = replies
        .iter()
        .filter(|r| r.outcome() != "admitted" && r.outcome() != "sold_out")
        .map(|r| r.text.as_str())
        .collect();
    assert_eq!(counts.get("admitted"), Some(&25), "{counts:?} {odd:?}");
    assert_eq!(counts.get("sold_out"), Some(&175), "{counts:?} {odd:?}");
    let again = tally(retries.iter());
    assert_eq!(again.get("admitted"), None, "{again:?}");
    assert_eq!(again.get("already_reserved"), Some(&25), "{again:?}");

    let pool = sqlx::PgPool::connect(&postgres.url())
        .await
        .expect("connect");
    let (held,): (i64,) = sqlx::query_as(
        "SELECT COALESCE(SUM(quantity), 0)::BIGINT FROM reservations WHERE drop_key LIKE 'shop/sale/%' AND state IN ('active', 'confirmed')",
    )
    .fetch_one(&pool)
    .await
    .expect("query");
    let (available,): (i64,) =
        sqlx::query_as("SELECT available FROM stock WHERE drop_key LIKE 'shop/sale/%'")
            .fetch_one(&pool)
            .await
            .expect("query");
    assert_eq!(held, 25);
    assert_eq!(available, 0);
    second.shutdown().await;
}

#[tokio::test]
async fn the_throttle_holds_on_the_fallback_path_too() {
    let sidecar = Sidecar::start().await;
    sidecar
        .seed(
            "sale",
            DropSpec::new(10)
                .kill_switch()
                .permits(2)
                .acquire_timeout_ms(20),
        )
        .await;
    assert_eq!(sidecar.reserve("sale", "a", "alice", 1).await.status, 201);
    assert_eq!(sidecar.reserve("sale", "b", "bob", 1).await.status, 201);
    let throttled = sidecar.reserve("sale", "c", "carol", 1).await;
    throttled.assert_answer(503, "throttled");
    assert_eq!(
        throttled.headers.get("retry-after").map(|v| v.as_bytes()),
        Some(&b"1"[..])
    );
    assert_eq!(fallback_header(&throttled), Some("fallback"));
    assert_eq!(
        sidecar.lookup("sale", "c").await.status,
        404,
        "nothing was reserved"
    );
    // A confirm frees a permit on this path as on the gate.
    assert_eq!(
        sidecar.settle("sale", "a", "confirm").await.outcome(),
        "confirmed"
    );
    let retry = sidecar.reserve("sale", "c", "carol", 1).await;
    retry.assert_answer(201, "admitted");
    let drop = sidecar.http.get("/v1/drops/sale").await.expect("answers");
    assert_eq!(
        (drop.body["mode"].as_str(), drop.body["remaining"].as_i64()),
        (Some("fail-open"), Some(7))
    );
}

/// A per-pod ledger that is the sale's ledger (Redis named it when its sidecar
/// opened the gate) holds all of the sale: it falls back on a Redis outage as a
/// shared ledger does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sales_own_per_pod_ledger_fails_open_when_redis_is_down() {
    let mut sidecar = Sidecar::start().await;
    sidecar.seed("sale", one_per_buyer(5)).await;
    assert_eq!(sidecar.reserve("sale", "a", "alice", 1).await.status, 201);
    sidecar.redis.stop();
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let reply = sidecar.reserve("sale", "k", "u", 1).await;
    reply.assert_answer(201, "admitted");
    assert_eq!(fallback_header(&reply), Some("fallback"));
    // Its retry and the earlier reservation are the ledger's to answer.
    sidecar
        .reserve("sale", "a", "alice", 1)
        .await
        .assert_answer(200, "already_reserved");
}

/// The same sidecar without a watch of the API server and without
/// `--fallback-on-last-read-config` (its defaults outside Kubernetes): with Redis
/// down, its copy of the config cannot be checked (a limit cut, an endsAt moved or
/// a pause the operator published meanwhile would not be seen), so it admits
/// nothing on it and says why; confirms and cancels go on, as they admit nothing.
/// Before, it sold on the copy last read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fallback_with_no_watch_of_the_api_server_admits_nothing_on_the_config_last_read() {
    let mut redis = dropgate_testkit::RedisServer::start().expect("redis-server starts");
    let dir = tempfile::tempdir().expect("temp dir");
    let ledger = format!("sqlite://{}", dir.path().join("ledger.db").display());
    let sidecar = Peer::start_custom(&redis.url(), &ledger, |settings| {
        settings.fallback_on_last_read_config = false;
    })
    .await;
    common::seed(&redis.url(), "sale", one_per_buyer(5)).await;
    assert_eq!(sidecar.reserve("sale", "a", "alice", 1).await.status, 201);
    redis.stop();
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    for i in 0..3 {
        let reply = sidecar
            .reserve("sale", &format!("k{i}"), &format!("u{i}"), 1)
            .await;
        assert_unavailable_saying(&reply, "--watch-drops");
    }
    // A cart and an extension admit too: refused alike.
    let cart = r#"{"key":"c1","user":"carl","lines":[{"drop":"sale","quantity":1}]}"#;
    let reply = sidecar.http.post("/v1/carts", cart).await.expect("answers");
    assert_unavailable_saying(&reply, "--watch-drops");
    assert_unavailable_saying(&sidecar.extend("sale", "a", 60).await, "--watch-drops");
    let confirm = sidecar.settle("sale", "a", "confirm").await;
    confirm.assert_answer(200, "confirmed");
    assert_eq!(fallback_header(&confirm), Some("fallback"));
    let opened = dropgate_sidecar::ledger::Ledger::open(&ledger)
        .await
        .expect("the ledger opens");
    let held = common::ledger_states(&opened).await;
    let only_alice: HashMap<String, String> = [("a".to_string(), "confirmed".to_string())].into();
    assert_eq!(held, only_alice, "nothing admitted on the fallback");
    sidecar.shutdown().await;
}

/// A second per-pod ledger on a sale sees only its own part of it: everything it
/// would change is refused, by the gate and by its own fallback, and says why; the
/// sale's ledger sells on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_per_pod_ledger_changes_nothing_of_the_sale() {
    let mut redis = dropgate_testkit::RedisServer::start().expect("redis-server");
    let dir = tempfile::tempdir().expect("temp dir");
    common::seed(&redis.url(), "sale", one_per_buyer(10)).await;
    let ledger = |name: &str| format!("sqlite://{}", dir.path().join(name).display());
    let a = Peer::start(&redis.url(), &ledger("a.db")).await;
    assert_eq!(a.reserve("sale", "a-1", "a-1", 1).await.status, 201);
    let b = Peer::start(&redis.url(), &ledger("b.db")).await;
    for reply in [
        b.reserve("sale", "b-1", "b-1", 1).await,
        b.settle("sale", "a-1", "cancel").await,
        b.lookup("sale", "a-1").await,
    ] {
        assert_unavailable_saying(&reply, "another ledger");
    }
    assert_eq!(a.reserve("sale", "a-2", "a-2", 1).await.status, 201);
    let metrics = b.http.get("/metrics").await.expect("answers");
    assert!(
        metrics
            .text
            .lines()
            .any(|l| l == "dropgate_sidecar_foreign_ledger{drop=\"sale\"} 1"),
        "{}",
        metrics.text
    );
    // Redis gone: the second ledger cannot fall back either.
    redis.stop();
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let reply = b.reserve("sale", "b-2", "b-2", 1).await;
    reply.assert_answer(503, "unavailable");
    a.shutdown().await;
    b.shutdown().await;
}

/// A two-line cart of buyer `i` over drops `a` and `b`, its lines in the order
/// `first`, then the other: two carts in opposite orders lock the drops' rows in
/// opposite orders unless the ledger orders them itself.
fn crossing_cart(i: usize, key: &str) -> String {
    let (first, second) = if i.is_multiple_of(2) {
        ("a", "b")
    } else {
        ("b", "a")
    };
    serde_json::json!({
        "key": key,
        "user": format!("u{i}"),
        "lines": [{"drop": first, "quantity": 1}, {"drop": second, "quantity": 1}],
    })
    .to_string()
}

/// The answer `ask` gets, asked again (the same key) while it is 503
/// `unavailable`, as a buyer's client does: on a loaded machine a fallback
/// transaction may wait past its statement or lock timeout behind the others on the
/// same stock rows, and is refused with nothing changed (the tests' counts at the end
/// check that); the retry is decided afresh. (A deadlock is not what this retries:
/// the carts' test checks PostgreSQL found none.)
async fn until_decided(
    mut ask: impl AsyncFnMut() -> dropgate_testkit::Reply,
) -> dropgate_testkit::Reply {
    for _ in 0..5 {
        let reply = ask().await;
        if reply.status != 503 || reply.outcome() != "unavailable" {
            return reply;
        }
        eprintln!("answered 503, asked again: {}", reply.text);
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    panic!("answered 503 unavailable five times in a row");
}

/// `POST path` with `body` until decided (see [`until_decided`]).
async fn answered(
    http: &dropgate_testkit::HttpClient,
    path: &str,
    body: &str,
) -> dropgate_testkit::Reply {
    until_decided(async || http.post(path, body).await.expect("the sidecar answers")).await
}

/// The deadlocks PostgreSQL has found in the database at `url` so far.
async fn deadlocks(url: &str) -> i64 {
    let pool = sqlx::PgPool::connect(url).await.expect("connect");
    let (found,): (i64,) =
        sqlx::query_as("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
            .fetch_one(&pool)
            .await
            .expect("pg_stat_database");
    found
}

/// What the shared ledger counts of drop `name`: units held (active or confirmed)
/// and units available.
async fn ledger_counts(pool: &sqlx::PgPool, name: &str) -> (i64, i64) {
    let pattern = format!("shop/{name}/%");
    let (held,): (i64,) = sqlx::query_as(
        "SELECT COALESCE(SUM(quantity), 0)::BIGINT FROM reservations WHERE drop_key LIKE $1 AND state IN ('active', 'confirmed')",
    )
    .bind(&pattern)
    .fetch_one(pool)
    .await
    .expect("query");
    let (available,): (i64,) = sqlx::query_as("SELECT available FROM stock WHERE drop_key LIKE $1")
        .bind(&pattern)
        .fetch_one(pool)
        .await
        .expect("query");
    (held, available)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crossing_carts_and_refunds_on_a_shared_fallback_neither_deadlock_nor_oversell() {
    let postgres = PostgresServer::start().expect("PostgreSQL starts");
    let first = Sidecar::start_with_database(Some(postgres.url())).await;
    let second = Peer::start(&first.redis.url(), &postgres.url()).await;
    first.seed("a", one_per_buyer(20).kill_switch()).await;
    first.seed("b", one_per_buyer(20).kill_switch()).await;
    let deadlocks_before = deadlocks(&postgres.url()).await;
    let via = |i: usize| {
        if i.is_multiple_of(2) {
            &first.http
        } else {
            &second.http
        }
    };

    // 80 buyers, carts crossing the two drops in both orders through both sidecars.
    let carts = join_all((0..80).map(|i| async move {
        answered(via(i), "/v1/carts", &crossing_cart(i, &format!("c{i}"))).await
    }))
    .await;
    let counts = tally(carts.iter());
    let odd: Vec<&str> = carts
        .iter()
        .filter(|c| c.outcome() != "reserved" && c.outcome() != "short")
        .map(|c| c.text.as_str())
        .collect();
    assert_eq!(counts.get("reserved"), Some(&20), "{counts:?} {odd:?}");
    assert_eq!(counts.get("short"), Some(&60), "{counts:?} {odd:?}");

    // The held carts given back while 40 more buyers cross the drops: expiries of
    // nothing, refunds and admissions on the same rows at once.
    let held: Vec<usize> = (0..80)
        .filter(|&i| carts[i].outcome() == "reserved")
        .collect();
    let refunds = held
        .iter()
        .map(|&i| async move { answered(via(i + 1), &format!("/v1/carts/c{i}/cancel"), "").await });
    let more = (80..120).map(|i| async move {
        answered(via(i), "/v1/carts", &crossing_cart(i, &format!("c{i}"))).await
    });
    let (refunds, more) = tokio::join!(join_all(refunds), join_all(more));
    let refunded = tally(refunds.iter());
    assert_eq!(refunded.get("cancelled"), Some(&20), "{refunded:?}");
    let later = tally(more.iter());
    for outcome in later.keys() {
        assert!(
            outcome == "reserved" || outcome == "short",
            "every cart is answered 201 or 409 short: {later:?}"
        );
    }

    let pool = sqlx::PgPool::connect(&postgres.url())
        .await
        .expect("connect");
    // A backend's statistics reach pg_stat_database once it is idle for a moment (a
    // deadlock counted by one still busy may show later: this can miss one, never
    // report one that was not).
    tokio::time::sleep(std::time::Duration::from_millis(1000)).await;
    assert_eq!(
        deadlocks(&postgres.url()).await,
        deadlocks_before,
        "carts crossing the drops deadlocked (PostgreSQL broke it)"
    );
    let sold = later.get("reserved").copied().unwrap_or(0) as i64;
    for name in ["a", "b"] {
        let (held, available) = ledger_counts(&pool, name).await;
        assert_eq!(
            held, sold,
            "drop {name}: the units of the carts answered 201"
        );
        assert_eq!(
            held + available,
            20,
            "drop {name}: held + available = limit"
        );
    }
    second.shutdown().await;
}

/// A fallback admission is decided on the mode and failure policy the operator
/// published, read afresh, not on the sidecar's copy: here its copy (read before,
/// refreshed only every ten minutes) still says fail-open while the operator has
/// closed the drop (its Redis is not highly available, which the drop now
/// requires, and its failure policy is Closed). Before, the admission was decided
/// on the fallback all the same (201), against a drop published closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fallback_admission_obeys_a_drop_closed_since_the_sidecar_read_it() {
    let redis = dropgate_testkit::RedisServer::start().expect("redis-server starts");
    let dir = tempfile::tempdir().expect("temp dir");
    let ledger = format!("sqlite://{}", dir.path().join("ledger.db").display());
    let sidecar = Peer::start_with(&redis.url(), &ledger, 600_000).await;
    common::seed(&redis.url(), "sale", one_per_buyer(5).kill_switch()).await;
    let first = sidecar.reserve("sale", "a", "alice", 1).await;
    first.assert_answer(201, "admitted");
    assert_eq!(fallback_header(&first), Some("fallback"));

    common::publish_closed(&redis.url(), "sale", one_per_buyer(5)).await;

    let reply = sidecar.reserve("sale", "b", "bob", 1).await;
    assert_unavailable_saying(&reply, "is closed");
    sidecar.shutdown().await;
}

/// A gate call Redis refuses while its connection stays up (out of memory under
/// `maxmemory` with `noeviction`: reads answer, writes do not), under failurePolicy
/// Open: the request is answered (503, nothing changed), not bounced between the
/// gate and the fallback. (A build that sent an outage's fallback back to the gate
/// whenever the config just read said `gate` and the breaker was closed spun here
/// forever: such a failure does not open the breaker.) Once Redis takes writes
/// again, the drop sells.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gate_refused_by_a_redis_out_of_memory_is_answered() {
    let sidecar = Sidecar::start().await;
    sidecar.seed("sale", one_per_buyer(5)).await;
    assert_eq!(sidecar.reserve("sale", "a", "alice", 1).await.status, 201);
    common::refuse_writes(&sidecar.redis, true);

    let reply = tokio::time::timeout(
        std::time::Duration::from_secs(20),
        sidecar.reserve("sale", "b", "bob", 1),
    )
    .await
    .expect("the reserve is answered, not bounced between the gates");
    assert_eq!(reply.status, 503, "{}", reply.text);

    common::refuse_writes(&sidecar.redis, false);
    common::eventually("the drop to sell again", async || {
        sidecar.reserve("sale", "b", "bob", 1).await.status == 201
    })
    .await;
}

/// Redis holds an older config than the sidecar's copy (a failover to a replica
/// that missed the operator's last publish): the gate's script reads the old mode
/// (`fail-open`) and sends the call to the fallback, whose fresh read keeps the
/// sidecar's newer copy (`gate`) and sends it back. The call is answered 503 after
/// a few turns, nothing changed, instead of bouncing between the gates until the
/// operator publishes again; once it has, the drop sells.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_the_gate_and_the_fallback_send_to_each_other_is_answered() {
    let sidecar = Sidecar::start().await;
    let publish = async |generation: i64| {
        let manifest = common::manifest("sale", one_per_buyer(5)).replace(
            "namespace: shop}",
            &format!("namespace: shop, generation: {generation}}}"),
        );
        common::apply(&sidecar.redis.url(), &manifest).await;
    };
    publish(5).await;
    assert_eq!(sidecar.reserve("sale", "a", "alice", 1).await.status, 201);
    let mut conn = sidecar.redis.connection().expect("connects");
    redis::cmd("HSET")
        .arg(dropgate_api::DropKeys::new(common::NS, "sale").config())
        .arg("mode")
        .arg("fail-open")
        .arg("generation")
        .arg(4)
        .query::<()>(&mut conn)
        .expect("HSET an older config");
    let before = sidecar.snapshot();

    let reply = tokio::time::timeout(
        std::time::Duration::from_secs(20),
        sidecar.reserve("sale", "b", "bob", 1),
    )
    .await
    .expect("the reserve is answered, not bounced between the gates");
    assert_unavailable_saying(&reply, "disagree on whether the gate decides");
    assert_eq!(sidecar.snapshot(), before, "the 503 changed nothing");

    publish(5).await;
    sidecar
        .reserve("sale", "b", "bob", 1)
        .await
        .assert_answer(201, "admitted");
}
