//! A cart's confirm is one change: its lines' confirms and the cart's own move are
//! recorded in one ledger transaction, so a confirm that answers an error changed
//! nothing, on the Redis gate and on the ledger's fallback gate. Before, the lines
//! were confirmed one commit each: a ledger failure at the second line answered
//! 503 with the first line confirmed (its unit sold, its `confirmed` event on the
//! way) while the buyer heard that the confirm failed. A cart whose drops are on
//! different gates is still confirmed line by line, and its 503 then says how far
//! it went (`underWay`, `confirmedLines`). Fault points are process-wide, so this file holds
//! one test, its scenarios one after another.

mod common;

use common::{Sidecar, marker_state};
use dropgate_sidecar::faults::{self, Fault, Times};
use dropgate_testkit::{DropSpec, Reply};
use serde_json::json;

/// The drops of every cart here: one unit of each, line 1 and line 2.
const DROPS: [&str; 2] = ["cap", "shirt"];

async fn hold_cart(sidecar: &Sidecar, cart: &str) {
    let lines: Vec<_> = DROPS
        .iter()
        .map(|drop| json!({"drop": drop, "quantity": 1}))
        .collect();
    let body = json!({"key": cart, "user": "ann", "lines": lines});
    sidecar
        .post_cart(&body)
        .await
        .assert_answer(201, "reserved");
}

async fn confirm(sidecar: &Sidecar, cart: &str) -> Reply {
    sidecar
        .http
        .post(&format!("/v1/carts/{cart}/confirm"), "")
        .await
        .expect("answers")
}

/// Asserts where every line of `cart` stands: `state` in the ledger (and in Redis,
/// on the Redis gate), with that many `confirmed` events in the outbox for it.
async fn assert_lines(
    sidecar: &Sidecar,
    gate: Gate,
    cart: &str,
    state: &str,
    confirmed_events: usize,
) {
    use sqlx::Row;
    let ledger = common::ledger_of(sidecar).await;
    for (n, drop) in DROPS.into_iter().enumerate() {
        let key = format!("{cart}:{}", n + 1);
        // (On the ledger's gate Redis holds no markers of the sale.)
        let in_redis = match gate {
            Gate::Redis => marker_state(&sidecar.redis, drop, &key),
            Gate::Fallback => None,
        };
        let expected_in_redis = match gate {
            Gate::Redis => Some(state),
            Gate::Fallback => None,
        };
        let in_ledger: Option<String> =
            sqlx::query("SELECT state FROM reservations WHERE res_key = $1")
                .bind(&key)
                .fetch_optional(ledger.pool())
                .await
                .expect("query")
                .map(|row| row.get(0));
        let events: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM outbox WHERE event_id LIKE $1")
            .bind(format!("%/{key}/confirmed"))
            .fetch_one(ledger.pool())
            .await
            .expect("query");
        assert_eq!(
            (in_redis.as_deref(), in_ledger.as_deref(), events),
            (expected_in_redis, Some(state), confirmed_events as i64),
            "{key} (Redis, ledger, confirmed events)"
        );
    }
}

/// Which gate decides the drops, and the fault that fails its commit.
#[derive(Clone, Copy, Debug)]
enum Gate {
    Redis,
    Fallback,
}

impl Gate {
    fn failing_commit(self) -> Fault {
        match self {
            Gate::Redis => Fault::BeforeLedgerCommit,
            // A COMMIT lost on its way: nothing lands, and no answer says so.
            Gate::Fallback => Fault::LostCommitUnanswered,
        }
    }
}

async fn a_failed_confirm_changes_nothing(gate: Gate) {
    let sidecar = Sidecar::start().await;
    for (drop, limit) in [("cap", 3), ("shirt", 10)] {
        let spec = DropSpec::new(limit).per_user_limit(2).permits(1000);
        let spec = match gate {
            Gate::Redis => spec,
            Gate::Fallback => spec.kill_switch(),
        };
        sidecar.seed(drop, spec).await;
    }
    let fault = gate.failing_commit();

    // The ledger's commit fails: 503, and nothing of the cart changed. Its retry
    // confirms every line.
    hold_cart(&sidecar, "failed").await;
    faults::arm(fault, 1);
    let answered = confirm(&sidecar, "failed").await;
    faults::arm(fault, 0);
    assert_eq!(answered.status, 503, "{gate:?}: {}", answered.text);
    assert_lines(&sidecar, gate, "failed", "active", 0).await;
    let looked = sidecar.http.get("/v1/carts/failed").await.expect("answers");
    assert_eq!(looked.body["state"], "active", "{gate:?}: {}", looked.text);
    confirm(&sidecar, "failed")
        .await
        .assert_answer(200, "confirmed");
    assert_lines(&sidecar, gate, "failed", "confirmed", 1).await;

    // Every second commit of the ledger fails, the first passing: the cart's
    // confirm is one commit, so it passes whole (before, its second line's commit
    // failed after the first line's landed).
    hold_cart(&sidecar, "second").await;
    faults::arm_times(fault, Times::Every(2));
    let answered = confirm(&sidecar, "second").await;
    faults::arm(fault, 0);
    answered.assert_answer(200, "confirmed");
    assert_lines(&sidecar, gate, "second", "confirmed", 1).await;

    if let Gate::Redis = gate {
        sidecar.assert_invariants("cap", 3);
        sidecar.assert_invariants("shirt", 10);
    }
    sidecar.shutdown().await;
}

/// The cap on the Redis gate, the shirt on the ledger's: the cart is confirmed line
/// by line, and a failure at the shirt after the cap was confirmed answers a 503
/// that says so in its body; the retry goes on with the rest.
async fn a_confirm_line_by_line_says_how_far_it_went() {
    let sidecar = Sidecar::start().await;
    let spec = |limit| DropSpec::new(limit).per_user_limit(2).permits(1000);
    sidecar.seed("cap", spec(3)).await;
    sidecar.seed("shirt", spec(10).kill_switch()).await;
    hold_cart(&sidecar, "mixed").await;

    // The shirt's COMMIT on the ledger's gate is lost (nothing lands).
    faults::arm(Fault::LostCommitUnanswered, 1);
    let answered = confirm(&sidecar, "mixed").await;
    faults::arm(Fault::LostCommitUnanswered, 0);
    assert_eq!(answered.status, 503, "{}", answered.text);
    assert_eq!(answered.body["underWay"], true, "{}", answered.text);
    assert_eq!(answered.body["confirmedLines"], 1, "{}", answered.text);
    let looked = sidecar.http.get("/v1/carts/mixed").await.expect("answers");
    // (A cart being confirmed reads `active`; its lines say how far it went.)
    assert_eq!(looked.body["state"], "active", "{}", looked.text);
    assert_eq!(
        looked.body["lines"][0]["state"], "confirmed",
        "{}",
        looked.text
    );
    assert_eq!(
        looked.body["lines"][1]["state"], "active",
        "{}",
        looked.text
    );
    // The retry, after the Retry-After the 503 asked for, goes on with the rest.
    let wait: u64 = answered.headers["retry-after"]
        .to_str()
        .ok()
        .and_then(|s| s.parse().ok())
        .expect("a Retry-After in seconds");
    tokio::time::sleep(std::time::Duration::from_millis(wait * 1000 + 100)).await;
    confirm(&sidecar, "mixed")
        .await
        .assert_answer(200, "confirmed");
    sidecar.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cart_confirms_error_says_what_it_changed() {
    a_failed_confirm_changes_nothing(Gate::Redis).await;
    a_failed_confirm_changes_nothing(Gate::Fallback).await;
    a_confirm_line_by_line_says_how_far_it_went().await;
}
