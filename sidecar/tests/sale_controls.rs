//! Sale controls through the HTTP API, on the Redis gate and on the ledger's
//! fallback gate alike: a pause (`spec.paused`) stops new reservations and nothing
//! else, a confirm may keep part of a hold (`{"quantity"}`) and give the rest back,
//! and a buyer's reservations are one look-up (`?user=`).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use common::Sidecar;
use dropgate_testkit::{DropSpec, PostgresServer, Reply};
use serde_json::json;

/// The drop every case sells, as seeded for one gate.
type Spec = fn() -> DropSpec;

/// The two gates a sidecar sells through: the drop as seeded on each.
const GATES: [(&str, Spec); 2] = [
    ("gate", || DropSpec::new(10).per_user_limit(3)),
    ("fallback", || {
        DropSpec::new(10).per_user_limit(3).kill_switch()
    }),
];

/// What the drop has left, as `GET /v1/drops/sale` says.
async fn remaining(sidecar: &Sidecar) -> i64 {
    let drop = sidecar.http.get("/v1/drops/sale").await.expect("answers");
    drop.body["remaining"].as_i64().expect("remaining")
}

/// `GET /v1/drops/sale/reservations` with `query`.
async fn by_buyer(sidecar: &Sidecar, query: &str) -> Reply {
    sidecar
        .http
        .get(&format!("/v1/drops/sale/reservations{query}"))
        .await
        .expect("answers")
}

/// A buyer's reservations as `key:quantity:state`, in the order answered.
fn listed(reply: &Reply) -> Vec<String> {
    reply.body["reservations"]
        .as_array()
        .expect("a list")
        .iter()
        .map(|r| {
            format!(
                "{}:{}:{}",
                r["key"].as_str().unwrap_or("?"),
                r["quantity"],
                r["state"].as_str().unwrap_or("?")
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_sale_admits_nothing_new_and_keeps_everything_held() {
    for (gate, spec) in GATES {
        let sidecar = Sidecar::start().await;
        sidecar.seed("sale", spec()).await;
        for key in ["a", "b"] {
            sidecar
                .reserve("sale", key, key, 1)
                .await
                .assert_answer_because(201, "admitted", gate);
        }
        sidecar.seed("sale", spec().paused()).await;
        let refused = sidecar.reserve("sale", "c", "c", 1).await;
        refused.assert_answer_because(403, "paused", gate);
        assert!(refused.text.contains("paused"), "{gate}: {}", refused.text);
        // A retry of a reservation made before hears what its key holds.
        sidecar
            .reserve("sale", "a", "a", 1)
            .await
            .assert_answer_because(200, "already_reserved", gate);
        // A cart line is refused for the same reason.
        let cart = json!({"key": "cart", "user": "d", "lines": [{"drop": "sale", "quantity": 1}]});
        let cart = sidecar
            .http
            .post("/v1/carts", &cart.to_string())
            .await
            .expect("answers");
        cart.assert_answer_because(409, "short", gate);
        assert_eq!(cart.body["short"][0]["outcome"], "paused", "{gate}");
        // The stock is untouched; holds in checkout are confirmed and cancelled.
        assert_eq!(remaining(&sidecar).await, 8, "{gate}");
        // The sidecar's copy of the config says so once it refreshed.
        let mut shown = serde_json::Value::Null;
        for _ in 0..60 {
            shown = sidecar
                .http
                .get("/v1/drops/sale")
                .await
                .expect("answers")
                .body;
            if shown["paused"] == true {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        assert_eq!(shown["paused"], true, "{gate}: {shown}");
        sidecar
            .settle("sale", "a", "confirm")
            .await
            .assert_answer_because(200, "confirmed", gate);
        sidecar
            .settle("sale", "b", "cancel")
            .await
            .assert_answer_because(200, "cancelled", gate);
        assert_eq!(remaining(&sidecar).await, 9, "{gate}");

        // Resumed: the next buyer is admitted at once.
        sidecar.seed("sale", spec()).await;
        sidecar
            .reserve("sale", "c", "c", 1)
            .await
            .assert_answer_because(201, "admitted", gate);
        assert_eq!(remaining(&sidecar).await, 8, "{gate}");
        sidecar.shutdown().await;
    }
}

/// Buyers keep coming while the shop pauses: no reserve that started after the
/// pause was published is admitted, on either gate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_admitted_after_the_pause_is_published() {
    for (gate, _) in GATES {
        let sidecar = Arc::new(Sidecar::start().await);
        // Stock for every buyer: before the pause each is admitted.
        let spec = || match gate {
            "gate" => DropSpec::new(1000).permits(5000),
            _ => DropSpec::new(1000).permits(5000).kill_switch(),
        };
        sidecar.seed("sale", spec()).await;
        let published = Arc::new(AtomicBool::new(false));
        let buyers: Vec<_> = (0..4)
            .map(|b| {
                let (sidecar, published) = (sidecar.clone(), published.clone());
                tokio::spawn(async move {
                    let mut late = Vec::new();
                    for i in 0..150 {
                        let after_pause = published.load(Ordering::Acquire);
                        let key = format!("b{b}-{i}");
                        let reply = sidecar.reserve("sale", &key, &key, 1).await;
                        if after_pause {
                            late.push(reply);
                        }
                    }
                    late
                })
            })
            .collect();
        tokio::time::sleep(std::time::Duration::from_millis(150)).await;
        sidecar.seed("sale", spec().paused()).await;
        published.store(true, Ordering::Release);
        let mut late = 0;
        for buyer in buyers {
            for reply in buyer.await.expect("buyer") {
                reply.assert_answer_because(403, "paused", gate);
                late += 1;
            }
        }
        assert!(late > 0, "{gate}: no reserve started after the pause");
        let sidecar = Arc::into_inner(sidecar).expect("buyers are done");
        sidecar.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buyer_reads_their_reservations_newest_first() {
    for (gate, spec) in GATES {
        let sidecar = Sidecar::start().await;
        sidecar.seed("sale", spec()).await;
        for (key, user, quantity) in [("a", "alice", 1), ("b", "alice", 2), ("c", "bob", 1)] {
            sidecar
                .reserve("sale", key, user, quantity)
                .await
                .assert_answer_because(201, "admitted", gate);
            // Admissions a few ms apart: newest first is a real order.
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        sidecar
            .settle("sale", "a", "confirm")
            .await
            .assert_answer(200, "confirmed");
        sidecar
            .settle("sale", "b", "cancel")
            .await
            .assert_answer(200, "cancelled");

        let alice = by_buyer(&sidecar, "?user=alice").await;
        alice.assert_answer_because(200, "found", gate);
        assert_eq!(
            listed(&alice),
            ["b:2:cancelled", "a:1:confirmed"],
            "{gate}: {}",
            alice.text
        );
        let bob = by_buyer(&sidecar, "?user=bob").await;
        assert_eq!(listed(&bob), ["c:1:active"], "{gate}");
        assert!(
            bob.body["reservations"][0]["expiresAt"].is_string(),
            "{gate}"
        );
        let nobody = by_buyer(&sidecar, "?user=carol").await;
        nobody.assert_answer_because(200, "found", gate);
        assert!(listed(&nobody).is_empty(), "{gate}");
        // A user with a space and a percent-encoded one read the same.
        sidecar
            .reserve("sale", "d", "dan smith", 1)
            .await
            .assert_answer(201, "admitted");
        for query in ["?user=dan+smith", "?user=dan%20smith"] {
            assert_eq!(
                listed(&by_buyer(&sidecar, query).await),
                ["d:1:active"],
                "{gate}: {query}"
            );
        }
        sidecar.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_buyer_query_is_refused() {
    let sidecar = Sidecar::start().await;
    sidecar.seed("sale", DropSpec::new(5)).await;
    for (query, says) in [
        ("", "`user` is required"),
        ("?", "`user` is required"),
        ("?user=", "`user` must not be empty"),
        ("?user=a%01", "control characters"),
        ("?user=a&user=b", "given twice"),
        ("?buyer=a", "unknown query parameter `buyer`"),
        ("?user=%FF", "not UTF-8"),
    ] {
        let reply = by_buyer(&sidecar, query).await;
        reply.assert_answer_because(400, "invalid", query);
        assert!(reply.text.contains(says), "{query}: {}", reply.text);
    }
    sidecar
        .http
        .get("/v1/drops/nope/reservations?user=a")
        .await
        .expect("answers")
        .assert_answer(404, "not_found");
    sidecar.shutdown().await;
}

/// Redis loses everything; the rebuild from the ledger lists each buyer's
/// reservations again, in the order they were admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buyers_reservations_survive_a_redis_loss() {
    let sidecar = Sidecar::start().await;
    let spec = || DropSpec::new(10).per_user_limit(3);
    sidecar.seed("sale", spec()).await;
    for key in ["a", "b"] {
        sidecar
            .reserve("sale", key, "alice", 1)
            .await
            .assert_answer(201, "admitted");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    sidecar
        .settle("sale", "a", "confirm")
        .await
        .assert_answer(200, "confirmed");
    let before = listed(&by_buyer(&sidecar, "?user=alice").await);
    assert_eq!(before, ["b:1:active", "a:1:confirmed"]);

    let mut conn = sidecar.redis.connection().expect("connect");
    redis::cmd("FLUSHALL")
        .query::<()>(&mut conn)
        .expect("FLUSHALL");
    sidecar.seed("sale", spec()).await;
    // The look-up itself finds Redis behind the ledger: it is rebuilt first.
    let after = by_buyer(&sidecar, "?user=alice").await;
    after.assert_answer(200, "found");
    assert_eq!(listed(&after), before, "{}", after.text);
    // (A second rebuild, the refresh's, may still move the gate on under the first
    // attempt: its 503 changed nothing, and the same key is retried.)
    let mut bought = sidecar.reserve("sale", "c", "bob", 1).await;
    for _ in 0..5 {
        if bought.status != 503 {
            break;
        }
        bought.assert_answer(503, "unavailable");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        bought = sidecar.reserve("sale", "c", "bob", 1).await;
    }
    bought.assert_answer(201, "admitted");
    sidecar.assert_invariants("sale", 10);
    sidecar.shutdown().await;
}

/// `POST .../{key}/{op}` with `body`.
async fn settle_with(sidecar: &Sidecar, key: &str, op: &str, body: &str) -> Reply {
    sidecar
        .http
        .post(&format!("/v1/drops/sale/reservations/{key}/{op}"), body)
        .await
        .expect("answers")
}

/// The payload of the ledger's `kind` event of reservation `key`.
async fn event_of(ledger: &sqlx::AnyPool, key: &str, kind: &str) -> serde_json::Value {
    use sqlx::Row;
    let row = sqlx::query("SELECT payload FROM outbox WHERE event_id LIKE $1")
        .bind(format!("shop/sale/%/{key}/{kind}"))
        .fetch_one(ledger)
        .await
        .expect("the event is in the outbox");
    serde_json::from_str(&row.get::<String, _>(0)).expect("a JSON payload")
}

/// What the ledger holds of reservation `key`: `quantity:state`.
async fn ledger_row(ledger: &sqlx::AnyPool, key: &str) -> String {
    use sqlx::Row;
    let row = sqlx::query(
        "SELECT quantity, state FROM reservations WHERE drop_key LIKE 'shop/sale/%' AND res_key = $1",
    )
    .bind(key)
    .fetch_one(ledger)
    .await
    .expect("the ledger has the reservation");
    format!("{}:{}", row.get::<i64, _>(0), row.get::<String, _>(1))
}

/// The ledger's count of what drop `sale` has left.
async fn ledger_available(ledger: &sqlx::AnyPool) -> i64 {
    use sqlx::Row;
    sqlx::query("SELECT available FROM stock WHERE drop_key LIKE 'shop/sale/%'")
        .fetch_one(ledger)
        .await
        .expect("the ledger has the stock row")
        .get(0)
}

/// The ledger a sidecar writes: its SQLite file, or the PostgreSQL it was given.
async fn open_ledger(url: &str) -> sqlx::AnyPool {
    sqlx::any::install_default_drivers();
    sqlx::AnyPool::connect(url).await.expect("the ledger opens")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_confirm_keeps_part_and_gives_the_rest_back() {
    for ledger in ["sqlite", "postgres"] {
        for (gate, spec) in GATES {
            let case = format!("{gate} with {ledger}");
            // A PostgreSQL of its own per case: each sale starts from an empty ledger.
            let postgres =
                (ledger == "postgres").then(|| PostgresServer::start().expect("PostgreSQL starts"));
            let (sidecar, url) = match &postgres {
                Some(postgres) => (
                    Sidecar::start_with_database(Some(postgres.url())).await,
                    postgres.url(),
                ),
                None => {
                    let sidecar = Sidecar::start().await;
                    let url = format!("sqlite://{}", sidecar.database_path().display());
                    (sidecar, url)
                }
            };
            sidecar.seed("sale", spec()).await;
            sidecar
                .reserve("sale", "a", "alice", 3)
                .await
                .assert_answer_because(201, "admitted", &case);
            assert_eq!(remaining(&sidecar).await, 7, "{case}");

            let kept = settle_with(&sidecar, "a", "confirm", r#"{"quantity":1}"#).await;
            kept.assert_answer_because(200, "confirmed", &case);
            assert_eq!(kept.body["quantity"], 1, "{case}: {}", kept.text);
            assert_eq!(remaining(&sidecar).await, 9, "{case}");
            // The buyer's count gave the two back too: two more fit the limit of 3.
            sidecar
                .reserve("sale", "b", "alice", 2)
                .await
                .assert_answer_because(201, "admitted", &case);
            // A retry, with or without the body, hears what was confirmed.
            for body in [r#"{"quantity":1}"#, ""] {
                let again = settle_with(&sidecar, "a", "confirm", body).await;
                again.assert_answer_because(200, "already_confirmed", &case);
                assert_eq!(again.body["quantity"], 1, "{case}: {}", again.text);
            }
            let looked = sidecar.lookup("sale", "a").await;
            assert_eq!(looked.body["quantity"], 1, "{case}: {}", looked.text);

            let pool = open_ledger(&url).await;
            assert_eq!(ledger_row(&pool, "a").await, "1:confirmed", "{case}");
            let event = event_of(&pool, "a", "confirmed").await;
            assert_eq!(event["quantity"], 1, "{case}: {event}");
            assert_eq!(event["released"], 2, "{case}: {event}");
            // A refund returns the one unit kept.
            sidecar
                .settle("sale", "a", "cancel")
                .await
                .assert_answer_because(200, "cancelled", &case);
            assert_eq!(remaining(&sidecar).await, 8, "{case}");
            assert_eq!(ledger_available(&pool).await, 8, "{case}");
            if gate == "gate" {
                sidecar.assert_invariants("sale", 10);
            }
            pool.close().await;
            sidecar.shutdown().await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_confirm_keeps_at_most_what_is_held() {
    for (gate, spec) in GATES {
        let sidecar = Sidecar::start().await;
        sidecar.seed("sale", spec()).await;
        sidecar
            .reserve("sale", "a", "alice", 2)
            .await
            .assert_answer_because(201, "admitted", gate);
        for (op, body, says) in [
            ("confirm", r#"{"quantity":3}"#, "more than the 2 units"),
            (
                "confirm",
                r#"{"quantity":0}"#,
                "`quantity` must be an integer from 1",
            ),
            (
                "confirm",
                r#"{"quantity":"1"}"#,
                "`quantity` must be an integer",
            ),
            (
                "confirm",
                r#"{"quantity":1.5}"#,
                "`quantity` must be an integer",
            ),
            ("cancel", r#"{"quantity":1}"#, "quantity"),
        ] {
            let refused = settle_with(&sidecar, "a", op, body).await;
            refused.assert_answer_because(400, "invalid", &format!("{gate}: {op} {body}"));
            assert!(
                refused.text.contains(says),
                "{gate}: {body}: {}",
                refused.text
            );
        }
        // Nothing changed.
        let looked = sidecar.lookup("sale", "a").await;
        assert_eq!(looked.body["state"], "active", "{gate}: {}", looked.text);
        assert_eq!(looked.body["quantity"], 2, "{gate}: {}", looked.text);
        assert_eq!(remaining(&sidecar).await, 8, "{gate}");
        // Keeping all that is held is a plain confirm.
        let all = settle_with(&sidecar, "a", "confirm", r#"{"quantity":2}"#).await;
        all.assert_answer_because(200, "confirmed", gate);
        assert_eq!(all.body["quantity"], 2, "{gate}");
        assert_eq!(remaining(&sidecar).await, 8, "{gate}");
        sidecar.shutdown().await;
    }
}

/// Each buyer's partial confirm and cancel race: whichever lands first, every unit
/// goes back exactly once (the refund returns what the confirm kept, a cancel
/// first leaves the confirm nothing), in Redis and in the ledger alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partial_confirms_racing_cancels_return_each_unit_once() {
    for (gate, spec) in [
        (
            "gate",
            (|| DropSpec::new(90).per_user_limit(3).permits(1000)) as Spec,
        ),
        ("fallback", || {
            DropSpec::new(90)
                .per_user_limit(3)
                .permits(1000)
                .kill_switch()
        }),
    ] {
        let sidecar = Arc::new(Sidecar::start().await);
        sidecar.seed("sale", spec()).await;
        let keys: Vec<String> = (0..30).map(|i| format!("k{i}")).collect();
        for key in &keys {
            sidecar
                .reserve("sale", key, key, 3)
                .await
                .assert_answer_because(201, "admitted", gate);
        }
        assert_eq!(remaining(&sidecar).await, 0, "{gate}");
        let races: Vec<_> = keys
            .iter()
            .map(|key| {
                let (sidecar, key) = (sidecar.clone(), key.clone());
                tokio::spawn(async move {
                    let confirm = settle_with(&sidecar, &key, "confirm", r#"{"quantity":1}"#);
                    let cancel = settle_with(&sidecar, &key, "cancel", "");
                    let (confirm, cancel) = tokio::join!(confirm, cancel);
                    (key, confirm, cancel)
                })
            })
            .collect();
        for race in races {
            let (key, confirm, cancel) = race.await.expect("race");
            cancel.assert_answer_because(200, "cancelled", &format!("{gate}: {key}"));
            match confirm.status.as_u16() {
                200 => {
                    confirm.assert_answer_because(200, "confirmed", gate);
                    assert_eq!(confirm.body["quantity"], 1, "{gate}: {}", confirm.text);
                }
                _ => confirm.assert_answer_because(409, "cancelled", gate),
            }
            let looked = sidecar.lookup("sale", &key).await;
            assert_eq!(looked.body["state"], "cancelled", "{gate}: {}", looked.text);
        }
        // Every unit is back, once: nothing is held, nothing counted twice.
        assert_eq!(remaining(&sidecar).await, 90, "{gate}");
        let pool = open_ledger(&format!("sqlite://{}", sidecar.database_path().display())).await;
        assert_eq!(ledger_available(&pool).await, 90, "{gate}");
        if gate == "gate" {
            sidecar.assert_invariants("sale", 90);
        }
        pool.close().await;
        let sidecar = Arc::into_inner(sidecar).expect("races are done");
        sidecar.shutdown().await;
    }
}

/// Redis loses everything after a partial confirm: the rebuild from the ledger
/// holds what was kept, not what was first reserved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_confirm_survives_a_redis_loss() {
    let sidecar = Sidecar::start().await;
    let spec = || DropSpec::new(10).per_user_limit(3);
    sidecar.seed("sale", spec()).await;
    sidecar
        .reserve("sale", "a", "alice", 3)
        .await
        .assert_answer(201, "admitted");
    settle_with(&sidecar, "a", "confirm", r#"{"quantity":2}"#)
        .await
        .assert_answer(200, "confirmed");

    let mut conn = sidecar.redis.connection().expect("connect");
    redis::cmd("FLUSHALL")
        .query::<()>(&mut conn)
        .expect("FLUSHALL");
    sidecar.seed("sale", spec()).await;
    sidecar
        .reserve("sale", "b", "bob", 1)
        .await
        .assert_answer(201, "admitted");
    let looked = sidecar.lookup("sale", "a").await;
    assert_eq!(looked.body["quantity"], 2, "{}", looked.text);
    assert_eq!(looked.body["state"], "confirmed", "{}", looked.text);
    assert_eq!(remaining(&sidecar).await, 7);
    sidecar.assert_invariants("sale", 10);
    sidecar.shutdown().await;
}

/// `POST .../{key}/extend` to `until` (ms since the epoch), with more `fields`.
async fn extend(sidecar: &Sidecar, key: &str, until: i64, fields: &str) -> Reply {
    let at = jiff::Timestamp::from_millisecond(until).expect("a time");
    let body = format!(r#"{{"expiresAt":"{at}"{fields}}}"#);
    settle_with(sidecar, key, "extend", &body).await
}

/// An answer's `expiresAt`, in ms since the epoch.
fn expires_at(reply: &Reply) -> i64 {
    reply.body["expiresAt"]
        .as_str()
        .and_then(|at| at.parse::<jiff::Timestamp>().ok())
        .unwrap_or_else(|| panic!("an expiresAt: {}", reply.text))
        .as_millisecond()
}

/// The ledger's deadline of reservation `key`.
async fn ledger_expires_at(ledger: &sqlx::AnyPool, key: &str) -> i64 {
    use sqlx::Row;
    sqlx::query(
        "SELECT expires_at_ms FROM reservations WHERE drop_key LIKE 'shop/sale/%' AND res_key = $1",
    )
    .bind(key)
    .fetch_one(ledger)
    .await
    .expect("the ledger has the reservation")
    .get(0)
}

/// Holds of 60 s that may be extended to 300 s from their admission, on each gate.
const EXTENSIBLE: [(&str, Spec); 2] = [
    ("gate", || {
        DropSpec::new(10)
            .per_user_limit(3)
            .hold_seconds(60)
            .max_hold_seconds(300)
    }),
    ("fallback", || {
        DropSpec::new(10)
            .per_user_limit(3)
            .hold_seconds(60)
            .max_hold_seconds(300)
            .kill_switch()
    }),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_is_extended_within_its_bound_and_retries_change_nothing() {
    for (gate, spec) in EXTENSIBLE {
        let sidecar = Sidecar::start().await;
        sidecar.seed("sale", spec()).await;
        let held = sidecar.reserve("sale", "a", "alice", 1).await;
        held.assert_answer_because(201, "admitted", gate);
        let deadline = expires_at(&held);
        // Admitted 60 s before its deadline: 300 s from then is the bound.
        let asked = deadline + 120_000;
        let moved = extend(&sidecar, "a", asked, "").await;
        moved.assert_answer_because(200, "extended", gate);
        assert_eq!(expires_at(&moved), asked, "{gate}: {}", moved.text);
        assert_eq!(moved.body["state"], "active", "{gate}");
        // A retry, and a time before the deadline: nothing moves, both hear it.
        for again in [asked, deadline + 1_000] {
            let same = extend(&sidecar, "a", again, "").await;
            same.assert_answer_because(200, "extended", gate);
            assert_eq!(expires_at(&same), asked, "{gate}: {}", same.text);
        }
        // Past the bound: refused, nothing changed.
        let refused = extend(&sidecar, "a", deadline + 300_000, "").await;
        refused.assert_answer_because(409, "extension_refused", gate);
        assert_eq!(expires_at(&refused), asked, "{gate}: {}", refused.text);
        let looked = sidecar.lookup("sale", "a").await;
        assert_eq!(expires_at(&looked), asked, "{gate}: {}", looked.text);

        let pool = open_ledger(&format!("sqlite://{}", sidecar.database_path().display())).await;
        assert_eq!(ledger_expires_at(&pool, "a").await, asked, "{gate}");
        let event = event_of(&pool, "a", &format!("extended/{asked}")).await;
        assert_eq!(event["type"], "extended", "{gate}: {event}");
        assert_eq!(event["expiresAt"], asked, "{gate}: {event}");
        // Still a hold: it is confirmed as any other.
        sidecar
            .settle("sale", "a", "confirm")
            .await
            .assert_answer_because(200, "confirmed", gate);
        assert_eq!(remaining(&sidecar).await, 9, "{gate}");
        pool.close().await;
        sidecar.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_an_active_hold_of_a_drop_that_allows_it_is_extended() {
    for (gate, spec) in GATES {
        let sidecar = Sidecar::start().await;
        // Without maxHoldSeconds a hold cannot be extended at all.
        sidecar.seed("sale", spec()).await;
        let held = sidecar.reserve("sale", "a", "alice", 1).await;
        let deadline = expires_at(&held);
        extend(&sidecar, "a", deadline + 1_000, "")
            .await
            .assert_answer_because(409, "extension_refused", gate);
        extend(&sidecar, "a", deadline - 1_000, "")
            .await
            .assert_answer_because(200, "extended", gate);
        extend(&sidecar, "a", deadline, r#","user":"mallory""#)
            .await
            .assert_answer_because(409, "not_owner", gate);
        extend(&sidecar, "a", deadline, r#","user":"alice""#)
            .await
            .assert_answer_because(200, "extended", gate);
        for (body, says) in [
            ("", "not valid JSON"),
            ("{}", "missing field `expiresAt`"),
            (r#"{"expiresAt":"tomorrow"}"#, "RFC 3339"),
            (r#"{"expiresAt":"2026-12-01T10:00:00"}"#, "RFC 3339"),
            (
                r#"{"expiresAt":1764583200000}"#,
                "must be an RFC 3339 time string",
            ),
            (
                r#"{"expiresAt":"2026-12-01T10:00:00Z","quantity":1}"#,
                "quantity",
            ),
        ] {
            let refused = settle_with(&sidecar, "a", "extend", body).await;
            refused.assert_answer_because(400, "invalid", &format!("{gate}: {body}"));
            assert!(
                refused.text.contains(says),
                "{gate}: {body}: {}",
                refused.text
            );
        }
        let looked = sidecar.lookup("sale", "a").await;
        assert_eq!(expires_at(&looked), deadline, "{gate}: {}", looked.text);

        sidecar
            .seed("sale", spec().hold_seconds(600).max_hold_seconds(900))
            .await;
        // The bound in force is what the drop's look-up shows (once re-read).
        let mut shown = sidecar.http.get("/v1/drops/sale").await.expect("answers");
        for _ in 0..50 {
            if shown.body["maxHoldSeconds"] == 900 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            shown = sidecar.http.get("/v1/drops/sale").await.expect("answers");
        }
        assert_eq!(shown.body["maxHoldSeconds"], 900, "{gate}: {}", shown.text);
        assert_eq!(shown.body["holdSeconds"], 600, "{gate}: {}", shown.text);
        for (key, op, outcome) in [("b", "confirm", "confirmed"), ("c", "cancel", "cancelled")] {
            let held = sidecar.reserve("sale", key, key, 1).await;
            held.assert_answer_because(201, "admitted", gate);
            sidecar
                .settle("sale", key, op)
                .await
                .assert_answer(200, outcome);
            extend(&sidecar, key, expires_at(&held) + 1_000, "")
                .await
                .assert_answer_because(409, outcome, &format!("{gate}: {key}"));
        }
        extend(&sidecar, "nope", deadline, "")
            .await
            .assert_answer_because(404, "not_found", gate);
        sidecar.shutdown().await;
    }
}

/// Extensions race their holds' expiry: each hold is either extended (and then
/// still held after its first deadline) or expired (and its unit back), never
/// answered extended and then lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_extension_racing_expiry_is_either_kept_or_refused() {
    for (gate, spec) in [
        (
            "gate",
            (|| {
                DropSpec::new(20)
                    .hold_seconds(3)
                    .max_hold_seconds(60)
                    .permits(1000)
                    .acquire_timeout_ms(100)
            }) as Spec,
        ),
        ("fallback", || {
            DropSpec::new(20)
                .hold_seconds(3)
                .max_hold_seconds(60)
                .permits(1000)
                .acquire_timeout_ms(100)
                .kill_switch()
        }),
    ] {
        let sidecar = Arc::new(Sidecar::start().await);
        sidecar.seed("sale", spec()).await;
        let mut races = Vec::new();
        for i in 0..20 {
            let key = format!("k{i}");
            let held = sidecar.reserve("sale", &key, &key, 1).await;
            held.assert_answer_because(201, "admitted", gate);
            let deadline = expires_at(&held);
            let sidecar = sidecar.clone();
            races.push(tokio::spawn(async move {
                // Asked around the deadline, a few ms either side.
                let wait = deadline - common_now_ms() - 10 + (i as i64 % 5) * 5;
                if wait > 0 {
                    tokio::time::sleep(std::time::Duration::from_millis(wait as u64)).await;
                }
                let answer = extend(&sidecar, &key, deadline + 30_000, "").await;
                (key, answer)
            }));
        }
        let mut answers = Vec::new();
        for race in races {
            answers.push(race.await.expect("race"));
        }
        // Past every first deadline, with time for the sweeper.
        tokio::time::sleep(std::time::Duration::from_millis(2_500)).await;
        let mut kept = 0;
        for (key, answer) in answers {
            let looked = sidecar.lookup("sale", &key).await;
            match answer.outcome() {
                "extended" => {
                    assert_eq!(
                        looked.body["state"], "active",
                        "{gate}: {key}: {}",
                        looked.text
                    );
                    kept += 1;
                }
                "expired" => {
                    assert_eq!(
                        looked.body["state"], "expired",
                        "{gate}: {key}: {}",
                        looked.text
                    );
                }
                other => panic!("{gate}: {key}: unexpected {other}: {}", answer.text),
            }
        }
        assert_eq!(remaining(&sidecar).await, 20 - kept, "{gate}");
        if gate == "gate" {
            sidecar.assert_invariants("sale", 20);
        }
        let sidecar = Arc::into_inner(sidecar).expect("races are done");
        sidecar.shutdown().await;
    }
}

/// The wall clock, as the gate's deadlines are counted.
fn common_now_ms() -> i64 {
    jiff::Timestamp::now().as_millisecond()
}

/// An extension made on the ledger's gate reaches Redis when the gate takes the
/// drop back (the marker's deadline moves forward), and one made on the gate
/// survives Redis losing everything: in both cases the hold outlives its first
/// deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_extension_survives_a_mode_switch_and_a_redis_loss() {
    let sidecar = Sidecar::start().await;
    let spec = || {
        DropSpec::new(10)
            .per_user_limit(3)
            .hold_seconds(3)
            .max_hold_seconds(120)
    };
    sidecar.seed("sale", spec()).await;
    let on_gate = sidecar.reserve("sale", "a", "alice", 1).await;
    on_gate.assert_answer(201, "admitted");
    let on_fallback_until = expires_at(&on_gate) + 60_000;
    // The kill switch: extended on the ledger only.
    sidecar.seed("sale", spec().kill_switch()).await;
    extend(&sidecar, "a", on_fallback_until, "")
        .await
        .assert_answer(200, "extended");
    sidecar.seed("sale", spec()).await;
    let on_gate = sidecar.reserve("sale", "b", "bob", 1).await;
    on_gate.assert_answer(201, "admitted");
    let gate_until = expires_at(&on_gate) + 60_000;
    extend(&sidecar, "b", gate_until, "")
        .await
        .assert_answer(200, "extended");
    // Past a's first deadline: Redis had it, the extension came from the ledger.
    tokio::time::sleep(std::time::Duration::from_millis(3_500)).await;
    let looked = sidecar.lookup("sale", "a").await;
    assert_eq!(looked.body["state"], "active", "{}", looked.text);
    assert_eq!(expires_at(&looked), on_fallback_until, "{}", looked.text);

    let mut conn = sidecar.redis.connection().expect("connect");
    redis::cmd("FLUSHALL")
        .query::<()>(&mut conn)
        .expect("FLUSHALL");
    sidecar.seed("sale", spec()).await;
    sidecar
        .reserve("sale", "c", "carol", 1)
        .await
        .assert_answer(201, "admitted");
    // Past both first deadlines and the sweeper's turn.
    tokio::time::sleep(std::time::Duration::from_millis(4_500)).await;
    for (key, until) in [("a", on_fallback_until), ("b", gate_until)] {
        let looked = sidecar.lookup("sale", key).await;
        assert_eq!(looked.body["state"], "active", "{key}: {}", looked.text);
        assert_eq!(expires_at(&looked), until, "{key}: {}", looked.text);
    }
    // c expired on its own: its unit is back.
    assert_eq!(remaining(&sidecar).await, 8);
    sidecar.assert_invariants("sale", 10);
    sidecar.shutdown().await;
}

/// The ledger's record of an extension Redis missed (its finish was lost) moves the
/// marker's deadline forward when it is replayed; an older record never moves it
/// back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_extension_moves_a_deadline_forward_only() {
    use dropgate_api::DropKeys;
    use dropgate_sidecar::gate;
    let sidecar = Sidecar::start().await;
    sidecar
        .seed(
            "sale",
            DropSpec::new(10).hold_seconds(60).max_hold_seconds(300),
        )
        .await;
    let held = sidecar.reserve("sale", "a", "alice", 1).await;
    held.assert_answer(201, "admitted");
    let deadline = expires_at(&held);
    let ledger = common::ledger_of(&sidecar).await;
    let ledger_key = sidecar.ledger_key("sale");
    let row = ledger
        .reservation(&ledger_key, "a")
        .await
        .expect("the ledger answers")
        .expect("it has the reservation");
    let mut conn = gate_connection(&sidecar).await;
    let keys = DropKeys::new(common::NS, "sale");
    let deadline_in_redis = |conn: &mut redis::Connection| -> (i64, i64) {
        let at: i64 = redis::cmd("HGET")
            .arg(keys.reservation("a"))
            .arg("expiresAt")
            .query(conn)
            .expect("HGET");
        let due: i64 = redis::cmd("ZSCORE")
            .arg(keys.holds())
            .arg("a")
            .query(conn)
            .expect("ZSCORE");
        (at, due)
    };
    let mut plain = sidecar.redis.connection().expect("connect");
    for (replayed, expected) in [
        (deadline + 60_000, deadline + 60_000),
        // Older than what Redis has now: nothing moves back.
        (deadline, deadline + 60_000),
    ] {
        let record = dropgate_sidecar::ledger::Recorded {
            expires_at_ms: replayed,
            ..row.clone()
        };
        gate::replay(&mut conn, &keys, ledger.id(), &record, &ledger_key)
            .await
            .expect("replays");
        assert_eq!(deadline_in_redis(&mut plain), (expected, expected));
    }
    sidecar.assert_invariants("sale", 10);
    sidecar.shutdown().await;
}

/// An extension whose sidecar died between its preparation and its finish is
/// resolved by a sweeper past its bound: finished when the ledger recorded it,
/// undone when not; meanwhile the hold neither expires nor changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_extension_left_unfinished_is_resolved_by_the_ledger() {
    use dropgate_api::DropKeys;
    use dropgate_sidecar::gate::{self, Settling};
    let sidecar = Sidecar::start().await;
    sidecar
        .seed(
            "sale",
            DropSpec::new(10).hold_seconds(60).max_hold_seconds(300),
        )
        .await;
    let ledger = common::ledger_of(&sidecar).await;
    let ledger_key = sidecar.ledger_key("sale");
    let keys = DropKeys::new(common::NS, "sale");
    let mut conn = gate_connection(&sidecar).await;
    for (key, recorded) in [("lost", false), ("landed", true)] {
        let held = sidecar.reserve("sale", key, key, 1).await;
        held.assert_answer(201, "admitted");
        let deadline = expires_at(&held);
        let until = deadline + 60_000;
        // Prepared by an attempt that then died, with a bound of 300 ms.
        gate::prepare(
            &mut conn,
            &keys,
            ledger.id(),
            key,
            Settling::Extend { until_ms: until },
            "a-dead-attempt",
            300,
        )
        .await
        .expect("prepares");
        if recorded {
            // Its commit landed before it died.
            sqlx::query(
                "UPDATE reservations SET expires_at_ms = $1 WHERE drop_key = $2 AND res_key = $3",
            )
            .bind(until)
            .bind(&ledger_key)
            .bind(key)
            .execute(ledger.pool())
            .await
            .expect("the ledger records it");
        }
        let expected = if recorded { until } else { deadline };
        let settling = || -> Option<String> {
            let mut plain = sidecar.redis.connection().expect("connect");
            redis::cmd("HGET")
                .arg(keys.reservation(key))
                .arg("settling")
                .query(&mut plain)
                .expect("HGET")
        };
        assert_eq!(settling().as_deref(), Some("extended"), "{key}");
        for _ in 0..200 {
            if settling().is_none() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        assert_eq!(settling(), None, "{key}: never resolved");
        let looked = sidecar.lookup("sale", key).await;
        assert_eq!(looked.body["state"], "active", "{key}: {}", looked.text);
        assert_eq!(expires_at(&looked), expected, "{key}: {}", looked.text);
        // A new extension of the key is decided as any other.
        extend(&sidecar, key, until + 1_000, "")
            .await
            .assert_answer_because(200, "extended", key);
    }
    sidecar.assert_invariants("sale", 10);
    sidecar.shutdown().await;
}

/// A cart's line is held, confirmed and cancelled with its cart: extending it alone
/// or confirming part of it is refused, and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_carts_line_is_neither_extended_nor_confirmed_in_part_alone() {
    let sidecar = Sidecar::start().await;
    sidecar
        .seed(
            "sale",
            DropSpec::new(10)
                .per_user_limit(5)
                .hold_seconds(60)
                .max_hold_seconds(300),
        )
        .await;
    let cart = json!({"key": "cart", "user": "alice", "lines": [{"drop": "sale", "quantity": 2}]});
    sidecar
        .http
        .post("/v1/carts", &cart.to_string())
        .await
        .expect("answers")
        .assert_answer(201, "reserved");
    let line = sidecar.lookup("sale", "cart:1").await;
    line.assert_answer(200, "found");
    let refused = extend(&sidecar, "cart:1", expires_at(&line) + 10_000, "").await;
    refused.assert_answer(409, "extension_refused");
    assert!(
        refused.text.contains("line of cart cart"),
        "{}",
        refused.text
    );
    let refused = settle_with(&sidecar, "cart:1", "confirm", r#"{"quantity":1}"#).await;
    refused.assert_answer(400, "invalid");
    assert!(
        refused.text.contains("/v1/carts/cart/confirm"),
        "{}",
        refused.text
    );
    let after = sidecar.lookup("sale", "cart:1").await;
    assert_eq!(after.body["quantity"], 2, "{}", after.text);
    assert_eq!(expires_at(&after), expires_at(&line), "{}", after.text);
    // A key that only looks like a line is a reservation like any other: no such
    // cart, or a cart whose line of that number is not of this drop.
    for key in ["order:7", "cart:2"] {
        sidecar
            .reserve("sale", key, "bob", 1)
            .await
            .assert_answer_because(201, "admitted", key);
        let until = expires_at(&sidecar.lookup("sale", key).await) + 10_000;
        extend(&sidecar, key, until, "")
            .await
            .assert_answer_because(200, "extended", key);
        settle_with(&sidecar, key, "confirm", r#"{"quantity":1}"#)
            .await
            .assert_answer_because(200, "confirmed", key);
    }
    sidecar.shutdown().await;
}

/// A refund after a partial confirm returns what the ledger holds, even when the
/// gate's marker says more (a Redis put back from a copy older than the confirm):
/// the ledger's stock, which the fallback sells from, is never credited twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_returns_what_the_ledger_kept() {
    use dropgate_api::DropKeys;
    let sidecar = Sidecar::start().await;
    sidecar
        .seed("sale", DropSpec::new(10).per_user_limit(3))
        .await;
    sidecar
        .reserve("sale", "a", "alice", 3)
        .await
        .assert_answer(201, "admitted");
    settle_with(&sidecar, "a", "confirm", r#"{"quantity":1}"#)
        .await
        .assert_answer(200, "confirmed");
    let pool = open_ledger(&format!("sqlite://{}", sidecar.database_path().display())).await;
    assert_eq!(ledger_available(&pool).await, 9);
    // The marker as an older copy of Redis would have it: all three units.
    let mut conn = sidecar.redis.connection().expect("connect");
    redis::cmd("HSET")
        .arg(DropKeys::new(common::NS, "sale").reservation("a"))
        .arg("quantity")
        .arg(3)
        .query::<()>(&mut conn)
        .expect("HSET");
    sidecar
        .settle("sale", "a", "cancel")
        .await
        .assert_answer(200, "cancelled");
    assert_eq!(
        ledger_available(&pool).await,
        10,
        "one unit back, not three"
    );
    let event = event_of(&pool, "a", "cancelled").await;
    assert_eq!(event["quantity"], 1, "{event}");
    pool.close().await;
    sidecar.shutdown().await;
}

/// Outside Kubernetes (`apply -f`, no metadata.generation) a pause alone is a new
/// generation, as a limit change is: the ledgers keep the newest terms by
/// generation, and a fallback that cannot reach Redis decides on them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_applied_outside_kubernetes_is_a_new_generation() {
    use dropgate_api::DropKeys;
    let sidecar = Sidecar::start().await;
    let generation = || -> i64 {
        let mut conn = sidecar.redis.connection().expect("connect");
        redis::cmd("HGET")
            .arg(DropKeys::new(common::NS, "sale").config())
            .arg("generation")
            .query(&mut conn)
            .expect("HGET")
    };
    sidecar.seed("sale", DropSpec::new(10)).await;
    let first = generation();
    sidecar.seed("sale", DropSpec::new(10)).await;
    assert_eq!(
        generation(),
        first,
        "the same manifest again is the same generation"
    );
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    sidecar.seed("sale", DropSpec::new(10).paused()).await;
    let paused = generation();
    assert!(paused > first, "paused: generation {paused} after {first}");
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    sidecar.seed("sale", DropSpec::new(10)).await;
    assert!(generation() > paused, "resumed: a newer generation still");
    sidecar.shutdown().await;
}

/// An extended hold keeps its throttle permit as long as it now lasts: the
/// throttle still bounds the holds waiting for their buyers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_extended_hold_keeps_its_permit() {
    let sidecar = Sidecar::start().await;
    sidecar
        .seed(
            "sale",
            DropSpec::new(10)
                .hold_seconds(3)
                .max_hold_seconds(60)
                .permits(1)
                .acquire_timeout_ms(100),
        )
        .await;
    let held = sidecar.reserve("sale", "a", "alice", 1).await;
    held.assert_answer(201, "admitted");
    extend(&sidecar, "a", expires_at(&held) + 30_000, "")
        .await
        .assert_answer(200, "extended");
    // Past the first deadline: the one permit is still the extended hold's.
    tokio::time::sleep(std::time::Duration::from_millis(3_500)).await;
    sidecar
        .reserve("sale", "b", "bob", 1)
        .await
        .assert_answer(503, "throttled");
    sidecar
        .settle("sale", "a", "confirm")
        .await
        .assert_answer(200, "confirmed");
    sidecar
        .reserve("sale", "b", "bob", 1)
        .await
        .assert_answer(201, "admitted");
    sidecar.shutdown().await;
}

/// A connection to the sidecar's Redis as the gate's own calls make them.
async fn gate_connection(sidecar: &Sidecar) -> dropgate_redis::Connection {
    redis::Client::open(sidecar.redis.url())
        .expect("url")
        .get_connection_manager()
        .await
        .expect("connect")
        .into()
}
