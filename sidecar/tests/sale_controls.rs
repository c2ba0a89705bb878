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
    // The next buyer's reserve finds Redis behind the ledger: it is rebuilt first.
    sidecar
        .reserve("sale", "c", "bob", 1)
        .await
        .assert_answer(201, "admitted");
    let after = by_buyer(&sidecar, "?user=alice").await;
    after.assert_answer(200, "found");
    assert_eq!(listed(&after), before, "{}", after.text);
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
