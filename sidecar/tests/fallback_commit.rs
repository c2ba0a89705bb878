//! The fallback gate's COMMIT goes unanswered (the connection to the ledger breaks
//! as it commits): the answer is still true. A reserve, confirm, refund or cart
//! whose commit landed is answered as made; one whose commit did not is a 503 that
//! changed nothing (even when a duplicate of it landed meanwhile), and its retry
//! goes through. Fault points are process-wide, so this file holds one
//! test.

mod common;

use common::Sidecar;
use dropgate_sidecar::faults::{self, Fault};
use dropgate_testkit::{DropSpec, Reply};
use serde_json::json;

/// The ledger's row of `key` on drop `drop`, as (state, quantity); `None` without
/// one (an `abandoned` claim is none).
async fn row(sidecar: &Sidecar, drop: &str, key: &str) -> Option<(String, i64)> {
    let ledger = common::ledger_of(sidecar).await;
    sqlx::query_as(
        "SELECT state, quantity FROM reservations \
         WHERE drop_key LIKE $1 AND res_key = $2 AND state <> 'abandoned'",
    )
    .bind(format!("{}/{drop}/%", common::NS))
    .bind(key)
    .fetch_optional(ledger.pool())
    .await
    .expect("query")
}

/// What `GET /v1/drops/{drop}` says remains.
async fn left(sidecar: &Sidecar, drop: &str) -> i64 {
    let shown = sidecar
        .http
        .get(&format!("/v1/drops/{drop}"))
        .await
        .expect("answers");
    shown.body["remaining"]
        .as_i64()
        .unwrap_or_else(|| panic!("GET /v1/drops/{drop}: {}", shown.text))
}

fn two_line_cart(key: &str, user: &str) -> String {
    json!({
        "key": key,
        "user": user,
        "lines": [{"drop": "shirt", "quantity": 1}, {"drop": "cap", "quantity": 1}],
    })
    .to_string()
}

fn rfc3339(ms: i64) -> String {
    jiff::Timestamp::from_millisecond(ms)
        .expect("a time")
        .to_string()
}

async fn extend(sidecar: &Sidecar, key: &str, until_ms: i64) -> Reply {
    let body = format!(r#"{{"expiresAt":"{}"}}"#, rfc3339(until_ms));
    sidecar
        .http
        .post(&format!("/v1/drops/sale/reservations/{key}/extend"), &body)
        .await
        .expect("answers")
}

/// A cart's line keys go by its drops' names in order: `cap` is line 1.
const LINES: [(&str, &str); 2] = [("cap", ":1"), ("shirt", ":2")];

async fn post_cart(sidecar: &Sidecar, body: &str) -> Reply {
    sidecar.http.post("/v1/carts", body).await.expect("answers")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unanswered_fallback_commit_is_answered_as_it_turned_out() {
    // One after the other: the fault points are the process's.
    an_unanswered_commit_on(Sidecar::start().await).await;
    an_expiry_whose_commit_is_unanswered_on(None).await;
    let postgres = dropgate_testkit::PostgresServer::start().expect("PostgreSQL");
    an_unanswered_commit_on(Sidecar::start_with_database(Some(postgres.url())).await).await;
    an_expiry_whose_commit_is_unanswered_on(Some(postgres.url())).await;
}

/// A confirm (or a retry) that meets an overdue hold expires it in its own
/// transaction: when that COMMIT goes unanswered, the answer is the expiry's if it
/// landed, and a 503 that changed nothing if it did not. The sweeper is off, so
/// that the requests meet the holds overdue.
async fn an_expiry_whose_commit_is_unanswered_on(database_url: Option<String>) {
    let redis = dropgate_testkit::RedisServer::start().expect("redis-server starts");
    let dir = tempfile::tempdir().expect("temp dir");
    let database_url = database_url
        .unwrap_or_else(|| format!("sqlite://{}", dir.path().join("ledger.db").display()));
    let peer = common::Peer::start_custom(&redis.url(), &database_url, |settings| {
        settings.sweep_ms = 3_600_000;
    })
    .await;
    common::seed(
        &redis.url(),
        "brief",
        DropSpec::new(5).hold_seconds(3).kill_switch(),
    )
    .await;
    let reserve =
        |key: &'static str, user: &'static str| common::reserve(&peer.http, "brief", key, user, 1);
    let confirm = |key: &str| {
        let path = format!("/v1/drops/brief/reservations/{key}/confirm");
        let http = peer.http.clone();
        async move { http.post(&path, "").await.expect("answers") }
    };
    let ledger = dropgate_sidecar::ledger::Ledger::open(&database_url)
        .await
        .expect("the ledger");
    let state = |key: &'static str| {
        sqlx::query_scalar::<_, String>(
            "SELECT state FROM reservations WHERE drop_key LIKE $1 AND res_key = $2",
        )
        .bind(format!("{}/brief/%", common::NS))
        .bind(key)
        .fetch_optional(ledger.pool())
    };
    for (key, user) in [("x1", "xena"), ("x2", "xavier"), ("x3", "ximena")] {
        reserve(key, user).await.assert_answer(201, "admitted");
    }
    tokio::time::sleep(std::time::Duration::from_millis(3_300)).await;

    // The expiry landed: the confirm hears `expired`, not a 503.
    faults::arm(Fault::LandedCommitUnanswered, 1);
    confirm("x1").await.assert_answer(409, "expired");
    assert_eq!(
        state("x1").await.expect("query").as_deref(),
        Some("expired")
    );
    // It did not: a 503, and the hold is as it was until a retry expires it.
    faults::arm(Fault::LostCommitUnanswered, 1);
    confirm("x2").await.assert_answer(503, "unavailable");
    assert_eq!(
        state("x2").await.expect("query").as_deref(),
        Some("active"),
        "the 503 changed nothing"
    );
    confirm("x2").await.assert_answer(409, "expired");
    // A retry of the reserve whose look-up expired the hold: told of it as it is.
    faults::arm(Fault::LandedCommitUnanswered, 1);
    let retried = reserve("x3", "ximena").await;
    retried.assert_answer(200, "already_reserved");
    assert_eq!(retried.body["state"], "expired", "{}", retried.text);
    assert_eq!(
        state("x3").await.expect("query").as_deref(),
        Some("expired")
    );
    peer.shutdown().await;
}

async fn an_unanswered_commit_on(sidecar: Sidecar) {
    for (drop, stock) in [("sale", 5), ("shirt", 5), ("cap", 5), ("pair", 20)] {
        sidecar
            .seed(
                drop,
                DropSpec::new(stock)
                    .per_user_limit(2)
                    .max_hold_seconds(3600)
                    .kill_switch(),
            )
            .await;
    }

    // A reserve whose commit landed: admitted, and a retry hears it.
    faults::arm(Fault::LandedCommitUnanswered, 1);
    sidecar
        .reserve("sale", "a", "alice", 1)
        .await
        .assert_answer(201, "admitted");
    assert_eq!(row(&sidecar, "sale", "a").await, Some(("active".into(), 1)));
    sidecar
        .reserve("sale", "a", "alice", 1)
        .await
        .assert_answer(200, "already_reserved");
    assert_eq!(left(&sidecar, "sale").await, 4);

    // One whose commit was lost: a 503, nothing held, and the same key is
    // admitted afresh.
    faults::arm(Fault::LostCommitUnanswered, 1);
    sidecar
        .reserve("sale", "b", "bob", 1)
        .await
        .assert_answer(503, "unavailable");
    assert_eq!(row(&sidecar, "sale", "b").await, None);
    assert_eq!(left(&sidecar, "sale").await, 4, "the 503 changed nothing");
    sidecar
        .reserve("sale", "b", "bob", 1)
        .await
        .assert_answer(201, "admitted");
    assert_eq!(left(&sidecar, "sale").await, 3);

    // A confirm whose commit landed is confirmed; a refund whose commit was lost
    // is a 503 that leaves the reservation confirmed, and its retry refunds it.
    faults::arm(Fault::LandedCommitUnanswered, 1);
    sidecar
        .settle("sale", "a", "confirm")
        .await
        .assert_answer(200, "confirmed");
    assert_eq!(
        row(&sidecar, "sale", "a").await,
        Some(("confirmed".into(), 1))
    );
    faults::arm(Fault::LostCommitUnanswered, 1);
    sidecar
        .settle("sale", "a", "cancel")
        .await
        .assert_answer(503, "unavailable");
    assert_eq!(
        row(&sidecar, "sale", "a").await,
        Some(("confirmed".into(), 1))
    );
    assert_eq!(left(&sidecar, "sale").await, 3, "the 503 changed nothing");
    sidecar
        .settle("sale", "a", "cancel")
        .await
        .assert_answer(200, "cancelled");
    assert_eq!(left(&sidecar, "sale").await, 4);

    // A refund whose commit was lost while a duplicate of it landed: only the
    // duplicate says it refunded (the shop refunds once). The lost one is a 503
    // that changed nothing of its own, and its retry hears the refund made.
    sidecar
        .reserve("sale", "r", "rita", 1)
        .await
        .assert_answer(201, "admitted");
    sidecar
        .settle("sale", "r", "confirm")
        .await
        .assert_answer(200, "confirmed");
    faults::arm(Fault::LostCommitUnanswered, 1);
    faults::arm(Fault::PauseBeforeAsking, 1);
    let http = sidecar.http.clone();
    let lost = tokio::spawn(async move {
        http.post("/v1/drops/sale/reservations/r/cancel", "")
            .await
            .expect("answers")
    });
    common::eventually("the lost refund to ask whether it landed", async || {
        faults::spent(Fault::PauseBeforeAsking)
    })
    .await;
    sidecar
        .settle("sale", "r", "cancel")
        .await
        .assert_answer(200, "cancelled");
    lost.await.expect("joins").assert_answer(503, "unavailable");
    sidecar
        .settle("sale", "r", "cancel")
        .await
        .assert_answer(200, "already_cancelled");
    assert_eq!(left(&sidecar, "sale").await, 4);

    // So with extensions: one that landed is extended, one that did not is a 503
    // that leaves the deadline where the first put it.
    let first = jiff::Timestamp::now().as_millisecond() + 1_200_000;
    faults::arm(Fault::LandedCommitUnanswered, 1);
    extend(&sidecar, "b", first)
        .await
        .assert_answer(200, "extended");
    faults::arm(Fault::LostCommitUnanswered, 1);
    extend(&sidecar, "b", first + 600_000)
        .await
        .assert_answer(503, "unavailable");
    let looked = sidecar.lookup("sale", "b").await;
    assert_eq!(looked.body["expiresAt"], rfc3339(first), "{}", looked.text);

    // A cart is one transaction on the fallback: the same for all its lines.
    faults::arm(Fault::LandedCommitUnanswered, 1);
    post_cart(&sidecar, &two_line_cart("c1", "carol"))
        .await
        .assert_answer(201, "reserved");
    for (drop, line) in LINES {
        let state = row(&sidecar, drop, &format!("c1{line}")).await.map(|r| r.0);
        assert_eq!(state.as_deref(), Some("active"), "{drop}");
        assert_eq!(left(&sidecar, drop).await, 4, "{drop}");
    }
    faults::arm(Fault::LostCommitUnanswered, 1);
    post_cart(&sidecar, &two_line_cart("c2", "dave"))
        .await
        .assert_answer(503, "unavailable");
    for (drop, line) in LINES {
        assert_eq!(
            row(&sidecar, drop, &format!("c2{line}")).await,
            None,
            "{drop}"
        );
        assert_eq!(
            left(&sidecar, drop).await,
            4,
            "{drop}: the 503 changed nothing"
        );
    }
    post_cart(&sidecar, &two_line_cart("c2", "dave"))
        .await
        .assert_answer(201, "reserved");
    for drop in ["shirt", "cap"] {
        assert_eq!(left(&sidecar, drop).await, 3, "{drop}");
    }

    // Partial confirms of one hold, racing, the first commit lost: the confirm
    // that lands after it has the same kind of event, and only the quantity it
    // kept tells whose it is. Every `confirmed` answer names what the ledger kept.
    for round in 0..5 {
        let key = format!("p{round}");
        sidecar
            .reserve("pair", &key, &format!("paul{round}"), 2)
            .await
            .assert_answer(201, "admitted");
        faults::arm(Fault::LostCommitUnanswered, 1);
        let confirms = (0..6).map(|i| confirm_keeping(&sidecar, &key, 1 + i % 2));
        let answers = futures::future::join_all(confirms).await;
        let (_, kept) = row(&sidecar, "pair", &key).await.expect("a row");
        for answer in answers {
            if answer.status == 200 && answer.body["outcome"] == "confirmed" {
                assert_eq!(answer.body["quantity"], kept, "{}", answer.text);
            }
        }
    }
    sidecar.shutdown().await;
}

/// A confirm of `key` on `pair` that keeps `quantity` of its hold.
async fn confirm_keeping(sidecar: &Sidecar, key: &str, quantity: i64) -> Reply {
    let body = json!({ "quantity": quantity }).to_string();
    sidecar
        .http
        .post(&format!("/v1/drops/pair/reservations/{key}/confirm"), &body)
        .await
        .expect("answers")
}
