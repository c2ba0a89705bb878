//! A cart that cannot be confirmed whole gives back its lines still held, and
//! never refunds one: a line confirmed through its own route between the give-back's
//! look-up of it and the give-back stays confirmed (the give-back checks it in the
//! same step as it cancels), and the cart ends confirmed as far as it went. Before,
//! the give-back's cancel refunded the paid line (state `cancelled`, its unit back
//! in stock) and the cart ended `expired`. On the Redis gate and on the ledger's
//! fallback gate. Fault points are process-wide, so this file holds one test.

mod common;

use common::{Sidecar, eventually};
use dropgate_sidecar::faults::{self, Fault};
use dropgate_testkit::DropSpec;
use serde_json::json;

/// A cart of one cap and one shirt; its line 2 (the shirt) is confirmed through its
/// own route while the cart's confirm, having found line 1 cancelled, is about to
/// give line 2 back.
async fn a_line_confirmed_during_its_carts_give_back_stays_confirmed(kill_switch: bool) {
    let sidecar = Sidecar::start().await;
    for (drop, limit) in [("cap", 3), ("shirt", 10)] {
        let spec = DropSpec::new(limit).per_user_limit(2).permits(1000);
        let spec = if kill_switch {
            spec.kill_switch()
        } else {
            spec
        };
        sidecar.seed(drop, spec).await;
    }
    let body = json!({
        "key": "pair",
        "user": "ann",
        "lines": [{"drop": "cap", "quantity": 1}, {"drop": "shirt", "quantity": 1}],
    });
    sidecar
        .http
        .post("/v1/carts", &body.to_string())
        .await
        .expect("answers")
        .assert_answer(201, "reserved");
    sidecar
        .settle("cap", "pair:1", "cancel")
        .await
        .assert_answer(200, "cancelled");

    faults::arm(Fault::PauseBeforeGiveBack, 1);
    let http = sidecar.http.clone();
    let confirm = tokio::spawn(async move {
        http.post("/v1/carts/pair/confirm", "")
            .await
            .expect("answers")
    });
    eventually("the give-back to look line 2 up", async || {
        faults::spent(Fault::PauseBeforeGiveBack)
    })
    .await;
    sidecar
        .settle("shirt", "pair:2", "confirm")
        .await
        .assert_answer(200, "confirmed");
    let confirm = confirm.await.expect("joins");

    confirm.assert_answer(409, "expired");
    assert_eq!(
        confirm.body["state"], "partly_confirmed",
        "{}",
        confirm.text
    );
    let shirt = sidecar.lookup("shirt", "pair:2").await;
    assert_eq!(shirt.body["state"], "confirmed", "{}", shirt.text);
    let shown = sidecar.http.get("/v1/drops/shirt").await.expect("answers");
    assert_eq!(
        shown.body["remaining"], 9,
        "the paid shirt stays sold: {}",
        shown.text
    );
    let looked = sidecar.http.get("/v1/carts/pair").await.expect("answers");
    assert_eq!(looked.body["state"], "partly_confirmed", "{}", looked.text);
    sidecar.assert_invariants("shirt", 10);
    sidecar.assert_invariants("cap", 3);
    sidecar.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_line_confirmed_during_its_carts_give_back_stays_confirmed_on_either_gate() {
    a_line_confirmed_during_its_carts_give_back_stays_confirmed(false).await;
    a_line_confirmed_during_its_carts_give_back_stays_confirmed(true).await;
}
