//! The seed cases of the gate, through the real HTTP API against a real Redis.

mod common;

use std::collections::HashMap;

use common::Sidecar;
use dropgate_sidecar::reservation::State;
use dropgate_testkit::DropSpec;
use futures::future::join_all;

/// This file's drops: `limit` pairs of SNKR-0412.
fn spec(limit: i64) -> DropSpec {
    DropSpec::new(limit).sku("SNKR-0412")
}

/// Drop `sale` (`limit` units) seeded and sold once through `sidecar` (bob's `k0`),
/// so that the sale's ledger is the sidecar's: that ledger, a connection to the
/// drop's Redis and its keys, for calling gate scripts as another sidecar of the
/// same ledger would.
async fn sold_once(
    sidecar: &Sidecar,
    limit: i64,
) -> (
    dropgate_sidecar::ledger::Ledger,
    dropgate_redis::Connection,
    dropgate_api::DropKeys,
) {
    sidecar.seed("sale", spec(limit)).await;
    sidecar
        .reserve("sale", "k0", "bob", 1)
        .await
        .assert_answer(201, "admitted");
    let ledger = common::ledger_of(sidecar).await;
    let conn = gate_connection(sidecar).await;
    (
        ledger,
        conn,
        dropgate_api::DropKeys::new(common::NS, "sale"),
    )
}

/// Drop `sale` (3 units) seeded and claimed by the ledger `the-sales-ledger`: a
/// connection to its Redis, its keys and that ledger, for calling gate scripts
/// directly as the sale's ledger does.
async fn claimed_sale(
    sidecar: &Sidecar,
) -> (
    dropgate_redis::Connection,
    dropgate_api::DropKeys,
    &'static str,
) {
    sidecar.seed("sale", spec(3)).await;
    let mut conn = gate_connection(sidecar).await;
    let keys = dropgate_api::DropKeys::new(common::NS, "sale");
    let ledger = "the-sales-ledger";
    dropgate_sidecar::gate::claim(&mut conn, &keys, ledger, ledger)
        .await
        .expect("claims");
    (conn, keys, ledger)
}

/// A connection to the sidecar's Redis, as the gate's own calls use it.
async fn gate_connection(sidecar: &Sidecar) -> dropgate_redis::Connection {
    redis::Client::open(sidecar.redis.url())
        .expect("url")
        .get_connection_manager()
        .await
        .expect("connect")
        .into()
}

fn count(outcomes: &[String]) -> HashMap<&str, usize> {
    let mut counts = HashMap::new();
    for outcome in outcomes {
        *counts.entry(outcome.as_str()).or_default() += 1;
    }
    counts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn five_hundred_buyers_for_a_hundred_units() {
    let sidecar = Sidecar::start().await;
    sidecar.seed("sale", spec(100).permits(1000)).await;
    let replies = join_all((0..500).map(|i| {
        let sidecar = &sidecar;
        async move {
            sidecar
                .reserve("sale", &format!("order-{i}"), &format!("user-{i}"), 1)
                .await
        }
    }))
    .await;
    for reply in &replies {
        match reply.outcome() {
            "admitted" => assert_eq!(reply.status, 201),
            "sold_out" => assert_eq!(reply.status, 409),
            other => panic!("unexpected {other}: {}", reply.text),
        }
    }
    let outcomes: Vec<String> = replies.iter().map(|r| r.outcome().to_string()).collect();
    let counts = count(&outcomes);
    assert_eq!(counts.get("admitted"), Some(&100));
    assert_eq!(counts.get("sold_out"), Some(&400));
    assert_eq!(sidecar.remaining("sale"), 0);
    sidecar.assert_invariants("sale", 100);
    sidecar.shutdown().await;
}

#[tokio::test]
async fn the_same_key_twice_is_admitted_once() {
    let sidecar = Sidecar::start().await;
    sidecar.seed("sale", spec(10)).await;
    let first = sidecar.reserve("sale", "order-1", "alice", 1).await;
    let second = sidecar.reserve("sale", "order-1", "alice", 1).await;
    first.assert_answer(201, "admitted");
    second.assert_answer(200, "already_reserved");
    assert_eq!(second.body["state"], "active");
    assert_eq!(sidecar.remaining("sale"), 9);
    sidecar.assert_invariants("sale", 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_concurrent_retries_admit_once() {
    let sidecar = Sidecar::start().await;
    sidecar.seed("sale", spec(10)).await;
    let replies = join_all((0..64).map(|_| sidecar.reserve("sale", "order-1", "alice", 1))).await;
    let outcomes: Vec<String> = replies.iter().map(|r| r.outcome().to_string()).collect();
    let counts = count(&outcomes);
    assert_eq!(counts.get("admitted"), Some(&1), "{counts:?}");
    assert_eq!(counts.get("already_reserved"), Some(&63), "{counts:?}");
    assert_eq!(sidecar.remaining("sale"), 9);
    sidecar.assert_invariants("sale", 10);
}

#[tokio::test]
async fn a_reused_key_with_other_terms_is_refused() {
    let sidecar = Sidecar::start().await;
    sidecar.seed("sale", spec(10).per_user_limit(5)).await;
    assert_eq!(sidecar.reserve("sale", "k", "alice", 1).await.status, 201);
    let before = sidecar.snapshot();
    for (user, quantity) in [("bob", 1), ("alice", 2)] {
        let reply = sidecar.reserve("sale", "k", user, quantity).await;
        reply.assert_answer(422, "idempotency_key_reused");
        assert!(
            reply.body["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty())
        );
    }
    assert_eq!(sidecar.snapshot(), before);
}

#[tokio::test]
async fn one_user_two_keys_meets_the_per_user_limit() {
    let sidecar = Sidecar::start().await;
    sidecar.seed("sale", spec(10).per_user_limit(1)).await;
    assert_eq!(sidecar.reserve("sale", "a", "alice", 1).await.status, 201);
    let before = sidecar.snapshot();
    let second = sidecar.reserve("sale", "b", "alice", 1).await;
    second.assert_answer(409, "per_user_limit_exceeded");
    assert_eq!(sidecar.snapshot(), before, "a refusal changes nothing");
    // Cancelling gives the user their allowance back.
    assert_eq!(
        sidecar.settle("sale", "a", "cancel").await.outcome(),
        "cancelled"
    );
    assert_eq!(sidecar.reserve("sale", "b", "alice", 1).await.status, 201);
    sidecar.assert_invariants("sale", 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cancel_restores_once_however_often_it_arrives() {
    let sidecar = Sidecar::start().await;
    sidecar.seed("sale", spec(10).per_user_limit(3)).await;
    assert_eq!(
        sidecar.reserve("sale", "order-1", "alice", 3).await.status,
        201
    );
    assert_eq!(sidecar.remaining("sale"), 7);
    let replies = join_all((0..20).map(|_| sidecar.settle("sale", "order-1", "cancel"))).await;
    let outcomes: Vec<String> = replies.iter().map(|r| r.outcome().to_string()).collect();
    let counts = count(&outcomes);
    assert_eq!(counts.get("cancelled"), Some(&1), "{counts:?}");
    assert_eq!(counts.get("already_cancelled"), Some(&19), "{counts:?}");
    assert!(replies.iter().all(|r| r.status == 200));
    assert_eq!(sidecar.remaining("sale"), 10);
    sidecar.assert_invariants("sale", 10);
}

#[tokio::test]
async fn confirm_and_cancel_follow_the_reservation_lifecycle() {
    let sidecar = Sidecar::start().await;
    sidecar.seed("sale", spec(5)).await;
    let missing = sidecar.settle("sale", "nope", "confirm").await;
    missing.assert_answer(404, "not_found");
    assert_eq!(sidecar.settle("sale", "nope", "cancel").await.status, 404);
    assert_eq!(sidecar.lookup("sale", "nope").await.status, 404);

    sidecar.reserve("sale", "k", "alice", 1).await;
    let confirmed = sidecar.settle("sale", "k", "confirm").await;
    confirmed.assert_answer(200, "confirmed");
    let again = sidecar.settle("sale", "k", "confirm").await;
    again.assert_answer(200, "already_confirmed");
    let found = sidecar.lookup("sale", "k").await;
    assert_eq!(found.status, 200);
    assert_eq!(found.body["state"], "confirmed");
    assert_eq!(found.body["user"], "alice");
    assert_eq!(found.body["quantity"], 1);
    assert_eq!(found.body["path"], "gate");
    assert_eq!(sidecar.remaining("sale"), 4);

    // A refund of a confirmed reservation returns the unit.
    let refund = sidecar.settle("sale", "k", "cancel").await;
    refund.assert_answer(200, "cancelled");
    assert_eq!(sidecar.remaining("sale"), 5);
    let late = sidecar.settle("sale", "k", "confirm").await;
    late.assert_answer(409, "cancelled");
    // A retry of the original reserve is still recognised, not re-admitted.
    let retry = sidecar.reserve("sale", "k", "alice", 1).await;
    retry.assert_answer(200, "already_reserved");
    assert_eq!(retry.body["state"], "cancelled");
    sidecar.assert_invariants("sale", 5);
}

#[tokio::test]
async fn seeding_twice_keeps_the_stock_in_use() {
    let sidecar = Sidecar::start().await;
    sidecar.seed("sale", spec(10).per_user_limit(5)).await;
    sidecar.reserve("sale", "k", "alice", 4).await;
    sidecar.seed("sale", spec(10).per_user_limit(5)).await;
    assert_eq!(sidecar.remaining("sale"), 6);
    sidecar.assert_invariants("sale", 10);
}

#[tokio::test]
async fn no_permit_undoes_the_admission_and_says_throttled() {
    let sidecar = Sidecar::start().await;
    sidecar
        .seed("sale", spec(10).permits(2).acquire_timeout_ms(20))
        .await;
    assert_eq!(sidecar.reserve("sale", "a", "alice", 1).await.status, 201);
    assert_eq!(sidecar.reserve("sale", "b", "bob", 1).await.status, 201);
    let before = sidecar.snapshot();
    let throttled = sidecar.reserve("sale", "c", "carol", 1).await;
    throttled.assert_answer(503, "throttled");
    assert_eq!(
        throttled.headers.get("retry-after").map(|v| v.as_bytes()),
        Some(&b"1"[..])
    );
    assert_eq!(
        sidecar.snapshot(),
        before,
        "the admission was undone completely"
    );
    assert_eq!(sidecar.lookup("sale", "c").await.status, 404);

    // A confirm gives its permit back: the same key now gets in.
    assert_eq!(
        sidecar.settle("sale", "a", "confirm").await.outcome(),
        "confirmed"
    );
    let retry = sidecar.reserve("sale", "c", "carol", 1).await;
    retry.assert_answer(201, "admitted");
    sidecar.assert_invariants("sale", 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_last_units_raced_by_two() {
    let sidecar = Sidecar::start().await;
    for round in 0..20 {
        for (stock, want_admitted) in [(1, 1), (2, 2)] {
            let name = format!("race-{round}-{stock}");
            sidecar.seed(&name, spec(stock)).await;
            let (a, b) = tokio::join!(
                sidecar.reserve(&name, "a", "alice", 1),
                sidecar.reserve(&name, "b", "bob", 1)
            );
            let admitted = [&a, &b].iter().filter(|r| r.status == 201).count();
            assert_eq!(admitted, want_admitted, "{} / {}", a.text, b.text);
            if stock == 1 {
                assert!([&a, &b].iter().any(|r| r.outcome() == "sold_out"));
            }
            assert_eq!(sidecar.remaining(&name), 0);
            sidecar.assert_invariants(&name, stock);
        }
    }
}

#[tokio::test]
async fn the_sale_window_is_enforced() {
    let sidecar = Sidecar::start().await;
    sidecar
        .seed("later", spec(5).starts_at("2099-01-01T00:00:00Z"))
        .await;
    sidecar
        .seed("over", spec(5).ends_at("2001-01-01T00:00:00Z"))
        .await;
    let before = sidecar.snapshot();
    let early = sidecar.reserve("later", "k", "alice", 1).await;
    early.assert_answer(403, "not_open");
    let late = sidecar.reserve("over", "k", "alice", 1).await;
    late.assert_answer(403, "ended");
    assert_eq!(sidecar.snapshot(), before);
}

#[tokio::test]
async fn an_unconfirmed_hold_expires_and_returns_its_unit() {
    let sidecar = Sidecar::start().await;
    sidecar
        .seed("sale", spec(3).hold_seconds(3).permits(1))
        .await;
    assert_eq!(
        sidecar.reserve("sale", "swept", "alice", 1).await.status,
        201
    );
    assert_eq!(sidecar.remaining("sale"), 2);
    // The sweeper expires it without any look-up, and frees the permit.
    let mut expired = false;
    for _ in 0..80 {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        if sidecar.remaining("sale") == 3 {
            expired = true;
            break;
        }
    }
    assert!(expired, "the sweeper returned the unit");
    let found = sidecar.lookup("sale", "swept").await;
    assert_eq!(found.body["state"], "expired");
    let confirm = sidecar.settle("sale", "swept", "confirm").await;
    confirm.assert_answer(409, "expired");
    let cancel = sidecar.settle("sale", "swept", "cancel").await;
    cancel.assert_answer(409, "expired");
    assert_eq!(
        sidecar.reserve("sale", "next", "bob", 1).await.status,
        201,
        "permit freed"
    );
    sidecar.assert_invariants("sale", 3);
}

#[tokio::test]
async fn a_drop_published_later_is_served_without_restart() {
    let sidecar = Sidecar::start().await;
    let unknown = sidecar.reserve("late", "k", "alice", 1).await;
    unknown.assert_answer(404, "not_found");
    assert!(
        sidecar.snapshot().is_empty(),
        "an unknown drop writes nothing"
    );
    sidecar.seed("late", spec(1)).await;
    assert_eq!(sidecar.reserve("late", "k", "alice", 1).await.status, 201);
    let drop = sidecar.http.get("/v1/drops/late").await.expect("answers");
    assert_eq!(drop.status, 200);
    assert_eq!(drop.body["sku"], "SNKR-0412");
    assert_eq!(drop.body["limit"], 1);
    assert_eq!(drop.body["remaining"], 0);
    assert_eq!(drop.body["mode"], "gate");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_racing_a_throttled_admission_are_never_promised_an_undone_unit() {
    let sidecar = Sidecar::start().await;
    sidecar
        .seed("sale", spec(50).permits(1).acquire_timeout_ms(40))
        .await;
    assert_eq!(sidecar.reserve("sale", "hog", "hog", 1).await.status, 201);
    for round in 0..10 {
        let key = format!("k-{round}");
        let replies = join_all((0..8).map(|_| sidecar.reserve("sale", &key, "alice", 1))).await;
        for reply in &replies {
            reply.assert_answer_because(503, "throttled", "no permit is free, so no promise");
        }
        assert_eq!(
            sidecar.lookup("sale", &key).await.status,
            404,
            "nothing was left behind"
        );
    }
    sidecar.assert_invariants("sale", 50);

    // With the permit free, one admission and duplicates that agree with it.
    assert_eq!(
        sidecar.settle("sale", "hog", "confirm").await.outcome(),
        "confirmed"
    );
    let replies = join_all((0..8).map(|_| sidecar.reserve("sale", "final", "alice", 1))).await;
    let outcomes: Vec<String> = replies.iter().map(|r| r.outcome().to_string()).collect();
    let counts = count(&outcomes);
    assert_eq!(counts.get("admitted"), Some(&1), "{counts:?}");
    assert_eq!(counts.get("already_reserved"), Some(&7), "{counts:?}");
    assert!(replies.iter().all(|r| r.body["state"] == "active"));
    assert_eq!(
        sidecar.lookup("sale", "final").await.body["state"],
        "active"
    );
    sidecar.assert_invariants("sale", 50);
}

/// Script calls Redis answered so far (`INFO commandstats`).
fn script_calls(sidecar: &Sidecar) -> u64 {
    let mut conn = sidecar.redis.connection().expect("connect");
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut conn)
        .expect("INFO");
    info.lines()
        .filter(|line| line.starts_with("cmdstat_evalsha:") || line.starts_with("cmdstat_eval:"))
        .filter_map(|line| {
            line.split("calls=")
                .nth(1)?
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

#[tokio::test]
async fn a_retry_waiting_on_a_pending_admission_backs_off() {
    let sidecar = Sidecar::start().await;
    sidecar
        .seed("sale", spec(5).permits(10).acquire_timeout_ms(1000))
        .await;
    assert_eq!(sidecar.reserve("sale", "first", "bob", 1).await.status, 201);
    // Another attempt's admission of key k: pending, and not overdue for a minute
    // (its sidecar is slow, not dead).
    let mut conn = sidecar.redis.connection().expect("connect");
    let keys = dropgate_api::DropKeys::new(common::NS, "sale");
    let sale: String = redis::cmd("HGET")
        .arg(keys.config())
        .arg("sale")
        .query(&mut conn)
        .expect("sale");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as i64;
    let _: () = redis::cmd("HSET")
        .arg(keys.reservation("k"))
        .arg(&[
            ("user", "alice".to_string()),
            ("quantity", "1".into()),
            ("state", "pending".into()),
            ("expiresAt", (now + 600_000).to_string()),
            ("attempt", "someone-else".into()),
            ("sale", sale),
            ("overdueAt", (now + 60_000).to_string()),
            ("ledger", "another-pod".into()),
        ])
        .query(&mut conn)
        .expect("HSET");
    let before = script_calls(&sidecar);
    let retry = sidecar.reserve("sale", "k", "alice", 1).await;
    let calls = script_calls(&sidecar) - before;
    assert_eq!(retry.status, 503, "{}", retry.text);
    assert!(
        retry.text.contains("unresolved"),
        "says what it waited for: {}",
        retry.text
    );
    // 1.25 s of waiting: polled every 2 ms that was ~600 script calls; backing off
    // to 50 ms it is a few dozen, with the background sweeper's calls.
    assert!(calls < 150, "{calls} script calls while one request waited");
}

/// A ledger row of another sale (read before the drop was re-created) is never
/// replayed into the sale Redis holds now: it would take the new sale's units.
#[tokio::test]
async fn a_row_of_another_sale_is_never_replayed_into_this_one() {
    let sidecar = Sidecar::start().await;
    sidecar.seed("sale", spec(3)).await;
    let mut conn = gate_connection(&sidecar).await;
    let keys = dropgate_api::DropKeys::new(common::NS, "sale");
    let row = dropgate_sidecar::ledger::Recorded {
        admitted_at_ms: None,
        key: "k-0".into(),
        user: "k-0".into(),
        quantity: 1,
        state: dropgate_sidecar::reservation::State::Active,
        expires_at_ms: i64::MAX / 2,
        seq: 1,
        variant: None,
        changed_by: None,
    };
    // The replay runs as the sale's ledger (as a rebuild does).
    dropgate_sidecar::gate::claim(&mut conn, &keys, "the-sales-ledger", "the-sales-ledger")
        .await
        .expect("claims");
    let before = sidecar.snapshot();
    let old_sale = dropgate_api::keys::ledger_key(common::NS, "sale", "the-first-sale");
    let reply =
        dropgate_sidecar::gate::replay(&mut conn, &keys, "the-sales-ledger", &row, &old_sale)
            .await
            .expect("runs");
    assert_eq!(reply, dropgate_sidecar::gate::Replay::OtherSale);
    assert_eq!(sidecar.snapshot(), before, "nothing changed");
    assert_eq!(sidecar.remaining("sale"), 3);
}

/// A marker of another reservation under the key the ledger's row names (Redis lost
/// that row's marker and another buyer re-used the key) is replaced whole by the
/// ledger's: its units go back as it held them, the ledger's buyer holds the
/// ledger's count, and her per-user limit counts it. (Kept with the marker's buyer
/// and count, bob would be counted for alice's unit, and alice could buy past her
/// limit.)
#[tokio::test]
async fn a_replayed_row_replaces_another_buyers_marker_behind_it() {
    let sidecar = Sidecar::start().await;
    sidecar.seed("sale", spec(5).per_user_limit(3)).await;
    // bob's active hold of 3, where the ledger has alice's confirmed unit.
    assert_eq!(sidecar.reserve("sale", "k", "bob", 3).await.status, 201);
    assert_eq!(sidecar.remaining("sale"), 2);
    replay_alices_row(&sidecar, State::Confirmed).await;
    assert_only_alice_holds(&sidecar, 4).await;
    let past_limit = sidecar.reserve("sale", "more", "alice", 3).await;
    assert_eq!(past_limit.status, 409, "{}", past_limit.text);
    assert!(
        past_limit.text.contains("per_user_limit"),
        "{}",
        past_limit.text
    );
    assert_eq!(
        sidecar.reserve("sale", "more", "alice", 2).await.status,
        201
    );
}

/// The same for a marker further along than the ledger's row (bob's reservation
/// cancelled; alice's row active): before, it read as in line, and alice's hold
/// was never counted.
#[tokio::test]
async fn a_replayed_row_replaces_another_buyers_marker_ahead_of_it() {
    let sidecar = Sidecar::start().await;
    sidecar.seed("sale", spec(5).per_user_limit(3)).await;
    assert_eq!(sidecar.reserve("sale", "k", "bob", 3).await.status, 201);
    let cancelled = sidecar.settle("sale", "k", "cancel").await;
    assert_eq!(cancelled.status, 200, "{}", cancelled.text);
    assert_eq!(sidecar.remaining("sale"), 5);
    replay_alices_row(&sidecar, State::Active).await;
    assert_only_alice_holds(&sidecar, 4).await;
}

/// An admission of alice's for two units under `k`, left pending past its hold
/// (expired there, unsure whether it was made), meets the ledger's row of `k`:
/// alice's reservation of one unit. The marker is not that reservation, and
/// never can be (past its hold its commit cannot land): the row replaces it, and
/// a retry for two units is not told of a reservation of two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_row_replaces_an_unsure_marker_of_other_terms() {
    let sidecar = Sidecar::start().await;
    sidecar
        .seed("sale", spec(5).per_user_limit(3).hold_seconds(3))
        .await;
    assert_eq!(
        sidecar.reserve("sale", "warm", "carol", 1).await.status,
        201
    );
    let mut gate = common::AsTheSalesLedger::of(&sidecar.redis.url(), "sale").await;
    // Its bound far off: no sweep resolves it meanwhile.
    let (conn, keys, ledger) = (&mut gate.conn, &gate.keys, &gate.ledger);
    dropgate_sidecar::gate::reserve(conn, keys, ledger, "k", "alice", 2, None, "dead", 600_000)
        .await
        .expect("the gate admits");
    tokio::time::sleep(std::time::Duration::from_millis(3_100)).await;
    dropgate_sidecar::gate::expire(conn, keys, ledger, "k")
        .await
        .expect("the expiry");
    assert_eq!(gate.marker_field("k", "unsure").await.as_deref(), Some("1"));

    replay_alices_row(&sidecar, State::Expired).await;
    assert_eq!(gate.marker_field("k", "unsure").await, None);
    assert_eq!(
        gate.marker_field("k", "quantity").await.as_deref(),
        Some("1"),
        "the ledger's reservation"
    );
    let retried = sidecar.reserve("sale", "k", "alice", 2).await;
    assert_eq!(retried.status, 422, "{}", retried.text);
    assert_eq!(retried.outcome(), "idempotency_key_reused");
}

/// Replays the ledger's row of key `k` as alice's reservation of one unit in
/// `state`, as the sale's ledger (the sidecar's own) does.
async fn replay_alices_row(sidecar: &Sidecar, state: State) {
    let common::AsTheSalesLedger {
        mut conn,
        keys,
        ledger,
    } = common::AsTheSalesLedger::of(&sidecar.redis.url(), "sale").await;
    let row = dropgate_sidecar::ledger::Recorded {
        admitted_at_ms: None,
        key: "k".into(),
        user: "alice".into(),
        quantity: 1,
        state,
        expires_at_ms: dropgate_sidecar::clock::now_ms() + 600_000,
        seq: 1_000,
        variant: None,
        changed_by: None,
    };
    let sale_ledger = sidecar.ledger_key("sale");
    let reply = dropgate_sidecar::gate::replay(&mut conn, &keys, &ledger, &row, &sale_ledger)
        .await
        .expect("runs");
    assert_eq!(reply, dropgate_sidecar::gate::Replay::Replayed);
}

/// Redis counts alice's one unit, and nothing of bob's: `remaining` left, the
/// buyers' counts, the by-buyer listing and the marker of `k`.
async fn assert_only_alice_holds(sidecar: &Sidecar, remaining: i64) {
    let mut conn = gate_connection(sidecar).await;
    let keys = dropgate_api::DropKeys::new(common::NS, "sale");
    assert_eq!(
        sidecar.remaining("sale"),
        remaining,
        "alice's one unit is held"
    );
    let held: HashMap<String, i64> = redis::cmd("HGETALL")
        .arg(keys.buyers())
        .query_async(&mut conn)
        .await
        .expect("buyers");
    assert_eq!(held, [("alice".to_string(), 1)].into(), "held by buyer");
    let listed: Vec<String> = redis::cmd("ZRANGE")
        .arg(keys.by_buyer())
        .arg(0)
        .arg(-1)
        .query_async(&mut conn)
        .await
        .expect("by buyer");
    assert!(
        listed.iter().all(|entry| entry.starts_with("alice\n")),
        "bob's listing is gone: {listed:?}"
    );
    let marker: HashMap<String, String> = redis::cmd("HGETALL")
        .arg(keys.reservation("k"))
        .query_async(&mut conn)
        .await
        .expect("marker");
    assert_eq!(marker.get("user").map(String::as_str), Some("alice"));
    assert_eq!(marker.get("quantity").map(String::as_str), Some("1"));
    assert_eq!(marker.get("attempt"), None, "bob's attempt is not alice's");
}

/// A sidecar that began reopening the gate (its replay at epoch 2) before another
/// handed the drop to the fallback (closing the gate for epoch 3) can no longer open
/// it: Redis would otherwise answer look-ups while the ledger decides, without the
/// fallback's changes. An opening at the later epoch still opens it.
#[tokio::test]
async fn a_gate_closed_for_a_later_epoch_refuses_a_stale_opening() {
    use dropgate_sidecar::gate::{self, Closing, GateKey, Opened};
    let sidecar = Sidecar::start().await;
    let (mut conn, keys, ledger) = claimed_sale(&sidecar).await;
    let closed = gate::close(&mut conn, &keys, ledger, 3)
        .await
        .expect("closes");
    assert_eq!(closed, Closing::Closed);
    let standing = |conn: &mut dropgate_redis::Connection| {
        let mut conn = conn.clone();
        let keys = keys.clone();
        async move {
            gate::standing(&mut conn, &keys, None, None)
                .await
                .expect("reads")
                .gate
        }
    };
    let after_close = standing(&mut conn).await;
    assert_eq!(
        after_close,
        GateKey {
            open_at: None,
            closed_for: 3
        }
    );
    assert_eq!(after_close.floor(), 3, "a new epoch must be above 3");

    let stale = gate::open(&mut conn, &keys, ledger, 2, 0)
        .await
        .expect("runs");
    assert_eq!(stale, Opened::Fenced);
    assert_eq!(standing(&mut conn).await.open_at, None, "still closed");
    // A close for an older epoch never lowers the fence.
    gate::close(&mut conn, &keys, ledger, 1)
        .await
        .expect("closes");
    assert_eq!(standing(&mut conn).await.closed_for, 3);

    let current = gate::open(&mut conn, &keys, ledger, 3, 0)
        .await
        .expect("runs");
    assert_eq!(current, Opened::Opened);
    assert_eq!(standing(&mut conn).await.open_at, Some(3));
    // Open at 3: a close for epoch 2 (a hand-over begun on an older view) leaves it.
    let late = gate::close(&mut conn, &keys, ledger, 2)
        .await
        .expect("runs");
    assert_eq!(late, Closing::Reopened);
    assert_eq!(standing(&mut conn).await.open_at, Some(3));
}

/// A rebuild takes back the pending admissions the ledger never recorded only
/// while it still holds the gate closed for its epoch: one overtaken by another
/// sidecar's rebuild (the gate reopened since) would take back a live admission of
/// the new epoch, whose commit then lands on a marker that is gone.
#[tokio::test]
async fn an_overtaken_rebuild_takes_back_no_live_admission() {
    use dropgate_sidecar::gate;
    use dropgate_sidecar::reservation::Outcome;
    let sidecar = Sidecar::start().await;
    let (mut conn, keys, ledger) = claimed_sale(&sidecar).await;
    // A rebuild at epoch 1 closed the gate; another sidecar took over at epoch 2
    // and opened it, and a buyer is admitted there (pending: its commit in flight).
    gate::close(&mut conn, &keys, ledger, 1)
        .await
        .expect("closes");
    gate::open(&mut conn, &keys, ledger, 2, 0)
        .await
        .expect("opens");
    let admitted = gate::reserve(
        &mut conn,
        &keys,
        ledger,
        "k1",
        "alice",
        1,
        None,
        "attempt-1",
        5000,
    )
    .await
    .expect("runs");
    assert!(
        matches!(admitted.outcome, Outcome::Admitted(_)),
        "{admitted:?}"
    );
    assert_eq!(sidecar.remaining("sale"), 2);

    // The first rebuild, resumed, finds the admission unrecorded.
    gate::undo_for_rebuild(&mut conn, &keys, ledger, "k1", "attempt-1", 1)
        .await
        .expect("runs");
    assert_eq!(
        sidecar.remaining("sale"),
        2,
        "the live admission still holds its unit"
    );

    // A rebuild that holds the gate closed for its own epoch does take it back.
    gate::close(&mut conn, &keys, ledger, 3)
        .await
        .expect("closes");
    gate::undo_for_rebuild(&mut conn, &keys, ledger, "k1", "attempt-1", 3)
        .await
        .expect("runs");
    assert_eq!(sidecar.remaining("sale"), 3);
}

/// An admission left pending by a sidecar that died before recording it is resolved
/// from the ledger when its buyer retries past its bound, and the retry is decided
/// on the sale as it is now: a sale that ended meanwhile admits nobody, and the
/// dead admission's unit goes back to stock instead of to the retry.
#[tokio::test]
async fn a_retry_past_a_dead_admissions_bound_obeys_the_sale_as_it_is_now() {
    use dropgate_sidecar::gate;
    use dropgate_sidecar::reservation::Outcome;
    let sidecar = Sidecar::start().await;
    let (ledger, mut conn, keys) = sold_once(&sidecar, 3).await;
    // Another sidecar of the same ledger admitted k1 and died before recording it:
    // pending, and past its bound at once.
    let dead = gate::reserve(
        &mut conn,
        &keys,
        ledger.id(),
        "k1",
        "alice",
        1,
        None,
        "dead-attempt",
        0,
    )
    .await
    .expect("runs");
    assert!(matches!(dead.outcome, Outcome::Admitted(_)), "{dead:?}");
    assert_eq!(sidecar.remaining("sale"), 1);

    sidecar
        .seed("sale", spec(3).ends_at("2001-01-01T00:00:00Z"))
        .await;
    sidecar
        .reserve("sale", "k1", "alice", 1)
        .await
        .assert_answer(403, "ended");
    // Resolved by the retry or, had it answered from its cached config first, by the
    // sweeper: either way the unit comes back and only bob's is held.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while sidecar.remaining("sale") != 2 && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(
        (sidecar.remaining("sale"), sidecar.held("sale")),
        (2, 1),
        "the dead admission's unit is back, bob's is held"
    );
    assert_eq!(
        common::marker_state(&sidecar.redis, "sale", "k1"),
        None,
        "the dead admission left no reservation"
    );
}

/// A rebuild takes back every pending admission the ledger never recorded, however
/// many there are: it reads their whole list (it read one page of 512, and the rest
/// held their units until their bound).
#[tokio::test]
async fn a_rebuild_takes_back_every_unrecorded_admission_past_one_page() {
    use dropgate_sidecar::gate;
    let sidecar = Sidecar::start().await;
    let (ledger, mut conn, keys) = sold_once(&sidecar, 1000).await;
    // Another sidecar of the same ledger admitted 600 buyers and died before
    // recording any: pending, their bound far off.
    for i in 0..600 {
        gate::reserve(
            &mut conn,
            &keys,
            ledger.id(),
            &format!("p{i}"),
            &format!("u{i}"),
            1,
            None,
            &format!("attempt-{i}"),
            600_000,
        )
        .await
        .expect("runs");
    }
    assert_eq!(sidecar.remaining("sale"), 399);

    // Redis loses the drop's gate (a failover to a replica that never had it):
    // the sidecar's next call finds it and rebuilds the drop from the ledger.
    redis::cmd("DEL")
        .arg(keys.gate())
        .query_async::<()>(&mut conn)
        .await
        .expect("DEL");
    common::eventually("the rebuild to take every one back", async || {
        let _ = sidecar.reserve("sale", "k0", "bob", 1).await;
        sidecar.remaining("sale") == 999
    })
    .await;
    assert_eq!(sidecar.held("sale"), 1);
}
