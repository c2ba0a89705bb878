//! A cart's confirm is one change: its lines' confirms and the cart's own move are
//! recorded in one ledger transaction, so a confirm that answers an error changed
//! nothing. The ledger's commit is made to fail at the cart's first commit, then
//! at its second: before, the lines were confirmed one commit each, and a failure
//! at the second line answered 503 with the first line confirmed (its unit sold,
//! its `confirmed` event sent) while the buyer heard that the confirm failed. Now
//! an error leaves every line active in Redis and in the ledger and the cart held;
//! a retry then confirms every line. Fault points are process-wide, so this file
//! holds one test.

mod common;

use common::{Sidecar, marker_state};
use dropgate_sidecar::faults::{self, Fault, Times};
use dropgate_testkit::{DropSpec, Reply};
use serde_json::json;

/// Where each line of a cart of a cap and a shirt stands, in Redis and in the
/// ledger, as `drop: redis state / ledger state`.
async fn line_states(sidecar: &Sidecar, cart: &str) -> Vec<String> {
    use sqlx::Row;
    let ledger = common::ledger_of(sidecar).await;
    let mut states = Vec::new();
    for (n, drop) in ["cap", "shirt"].into_iter().enumerate() {
        let key = format!("{cart}:{}", n + 1);
        let in_redis = marker_state(&sidecar.redis, drop, &key).unwrap_or_else(|| "-".into());
        let in_ledger: String = sqlx::query("SELECT state FROM reservations WHERE res_key = $1")
            .bind(&key)
            .fetch_optional(ledger.pool())
            .await
            .expect("query")
            .map_or_else(|| "-".into(), |row| row.get(0));
        states.push(format!("{drop}: {in_redis} / {in_ledger}"));
    }
    states
}

fn all(state: &str) -> Vec<String> {
    ["cap", "shirt"]
        .iter()
        .map(|drop| format!("{drop}: {state} / {state}"))
        .collect()
}

async fn confirm(sidecar: &Sidecar, cart: &str) -> Reply {
    sidecar
        .http
        .post(&format!("/v1/carts/{cart}/confirm"), "")
        .await
        .expect("answers")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cart_confirm_that_answers_an_error_confirmed_no_line() {
    let sidecar = Sidecar::start().await;
    for (drop, limit) in [("cap", 3), ("shirt", 10)] {
        sidecar
            .seed(drop, DropSpec::new(limit).per_user_limit(2).permits(1000))
            .await;
    }
    // The ledger's next commit fails; then every second one (the first passes).
    for (cart, fault) in [("first", Times::Next(1)), ("second", Times::Every(2))] {
        let body = json!({
            "key": cart,
            "user": "ann",
            "lines": [{"drop": "cap", "quantity": 1}, {"drop": "shirt", "quantity": 1}],
        });
        sidecar
            .http
            .post("/v1/carts", &body.to_string())
            .await
            .expect("answers")
            .assert_answer(201, "reserved");

        faults::arm_times(Fault::BeforeLedgerCommit, fault);
        let answered = confirm(&sidecar, cart).await;
        faults::arm(Fault::BeforeLedgerCommit, 0);

        if answered.status == 200 {
            assert_eq!(answered.body["outcome"], "confirmed", "{}", answered.text);
            assert_eq!(
                line_states(&sidecar, cart).await,
                all("confirmed"),
                "{cart}"
            );
        } else {
            assert_eq!(answered.status, 503, "{cart}: {}", answered.text);
            assert_eq!(
                line_states(&sidecar, cart).await,
                all("active"),
                "{cart}: an error, yet a line changed: {}",
                answered.text
            );
            let looked = sidecar
                .http
                .get(&format!("/v1/carts/{cart}"))
                .await
                .expect("answers");
            assert_eq!(looked.body["state"], "active", "{cart}: {}", looked.text);
            confirm(&sidecar, cart)
                .await
                .assert_answer(200, "confirmed");
            assert_eq!(
                line_states(&sidecar, cart).await,
                all("confirmed"),
                "{cart}"
            );
        }
    }
    sidecar.assert_invariants("cap", 3);
    sidecar.assert_invariants("shirt", 10);
    sidecar.shutdown().await;
}
