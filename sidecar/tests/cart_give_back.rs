//! A cart that cannot be confirmed whole gives back its lines still held, and
//! never refunds one, and then ends confirmed as far as it went:
//! - a line confirmed through its own route between the give-back's look-up of it
//!   and the give-back stays confirmed (the give-back checks it in the same step as
//!   it cancels), on the Redis gate and on the ledger's fallback gate; before, the
//!   give-back's cancel refunded the paid line (state `cancelled`, its unit back in
//!   stock) and the cart ended `expired`;
//! - a line the ledger has confirmed while Redis still shows it a hold (Redis
//!   missed the confirm's finish, as a promoted replica can) stays confirmed: the
//!   ledger refuses the give-back; before, it recorded the refund;
//! - a refused cart whose give-back stalls answers 503 `underWay` until its lines
//!   are back (before, 409 `short`, "nothing is held", with a line still held).
//!
//! Fault points are process-wide, so this file holds one test, its scenarios one
//! after another.

mod common;

use common::{Sidecar, eventually};
use dropgate_api::DropKeys;
use dropgate_sidecar::faults::{self, Fault};
use dropgate_testkit::{DropSpec, Reply};
use serde_json::json;

/// A sidecar selling caps and shirts, with cart `pair` (one of each, for ann)
/// held: line 1 the cap, line 2 the shirt.
async fn shop_with_a_pair(kill_switch: bool) -> Sidecar {
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
        .post_cart(&body)
        .await
        .assert_answer(201, "reserved");
    sidecar
}

async fn confirm_pair(sidecar: &Sidecar) -> Reply {
    sidecar
        .http
        .post("/v1/carts/pair/confirm", "")
        .await
        .expect("answers")
}

/// Asserts that the pair's cart was confirmed as far as its shirt, which stays
/// sold, and that both drops are whole.
async fn assert_shirt_kept(sidecar: &Sidecar, confirm: &Reply) {
    // A cart not confirmable whole answers 409 `expired`; its state says it is
    // confirmed as far as it went.
    confirm.assert_answer(409, "expired");
    assert_eq!(
        confirm.body["state"], "partly_confirmed",
        "{}",
        confirm.text
    );
    let looked = sidecar.http.get("/v1/carts/pair").await.expect("answers");
    assert_eq!(looked.body["state"], "partly_confirmed", "{}", looked.text);
    let ledger = common::ledger_of(sidecar).await;
    let in_ledger: String =
        sqlx::query_scalar("SELECT state FROM reservations WHERE res_key = 'pair:2'")
            .fetch_one(ledger.pool())
            .await
            .expect("the shirt's row");
    assert_eq!(in_ledger, "confirmed", "the shirt's row in the ledger");
    eventually("the shirt to read confirmed, its unit sold", async || {
        let shirt = sidecar.lookup("shirt", "pair:2").await;
        let shown = sidecar.http.get("/v1/drops/shirt").await.expect("answers");
        shirt.body["state"] == "confirmed" && shown.body["remaining"] == 9
    })
    .await;
    sidecar.assert_invariants("shirt", 10);
    sidecar.assert_invariants("cap", 3);
}

/// The shirt is confirmed through its own route while the cart's confirm, having
/// found the cap cancelled, is about to give the shirt back.
async fn a_line_confirmed_during_its_carts_give_back_stays_confirmed(kill_switch: bool) {
    let sidecar = shop_with_a_pair(kill_switch).await;
    sidecar
        .settle("cap", "pair:1", "cancel")
        .await
        .assert_answer(200, "cancelled");

    // The cap, no hold any more, is passed over before the pause point: the shirt
    // is the line that pauses there, after its look-up found it a hold.
    faults::arm(Fault::PauseBeforeGiveBack, 1);
    let http = sidecar.http.clone();
    let confirm = tokio::spawn(async move {
        http.post("/v1/carts/pair/confirm", "")
            .await
            .expect("answers")
    });
    eventually("the give-back to look the shirt up", async || {
        faults::spent(Fault::PauseBeforeGiveBack)
    })
    .await;
    sidecar
        .settle("shirt", "pair:2", "confirm")
        .await
        .assert_answer(200, "confirmed");
    let confirm = confirm.await.expect("joins");

    assert_shirt_kept(&sidecar, &confirm).await;
    sidecar.shutdown().await;
}

/// The ledger has the shirt confirmed, and Redis still shows it active.
async fn a_line_redis_missed_the_confirm_of_is_not_refunded() {
    let sidecar = shop_with_a_pair(false).await;
    sidecar
        .settle("shirt", "pair:2", "confirm")
        .await
        .assert_answer(200, "confirmed");
    // As a replica promoted before the confirm's finish reached it has it.
    let mut conn = sidecar.redis.connection().expect("connects");
    let _: () = redis::cmd("HSET")
        .arg(DropKeys::new("shop", "shirt").reservation("pair:2"))
        .arg("state")
        .arg("active")
        .query(&mut conn)
        .expect("HSET");
    sidecar
        .settle("cap", "pair:1", "cancel")
        .await
        .assert_answer(200, "cancelled");

    let confirm = confirm_pair(&sidecar).await;
    assert_shirt_kept(&sidecar, &confirm).await;
    sidecar.shutdown().await;
}

/// A cart refused (a line short) whose give-back of the line it held stalls
/// (Redis refuses writes, failure policy Closed) is not answered 409 while that
/// line still holds its unit: 503 `underWay`, and once Redis takes writes again
/// the sweeper gives the line back and a retry of the key hears the refusal.
async fn a_refused_carts_stalled_give_back_is_under_way_until_it_is_done() {
    let sidecar = Sidecar::start().await;
    let spec = |limit| {
        DropSpec::new(limit)
            .per_user_limit(2)
            .permits(1000)
            .fail_closed()
    };
    sidecar.seed("cap", spec(3)).await;
    sidecar.seed("shirt", spec(0)).await;
    let body = json!({
        "key": "pair",
        "user": "ann",
        "lines": [{"drop": "cap", "quantity": 1}, {"drop": "shirt", "quantity": 1}],
    });

    // The cap is held, the shirt short: the cap is given back, and pauses first.
    faults::arm(Fault::PauseBeforeGiveBack, 1);
    let http = sidecar.http.clone();
    let asked = body.to_string();
    let reserve =
        tokio::spawn(async move { http.post("/v1/carts", &asked).await.expect("answers") });
    eventually("the give-back to look the cap up", async || {
        faults::spent(Fault::PauseBeforeGiveBack)
    })
    .await;
    common::refuse_writes(&sidecar.redis, true);
    let reply = reserve.await.expect("joins");
    reply.assert_answer(503, "unavailable");
    assert_eq!(reply.body["underWay"], true, "{}", reply.text);
    assert_eq!(
        common::redis_counts(&sidecar.redis, "cap").0,
        2,
        "the cap is still held"
    );
    // (Within the refusing attempt's deadline a confirm hears that attempt in
    // flight, 503 `throttled`; past it, what the cart is.)
    let mut confirm = confirm_pair(&sidecar).await;
    for _ in 0..50 {
        if confirm.status != 503 {
            break;
        }
        confirm.assert_answer(503, "throttled");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        confirm = confirm_pair(&sidecar).await;
    }
    confirm.assert_answer(409, "refused");
    assert!(
        confirm.body["message"]
            .as_str()
            .is_some_and(|m| m.contains("being given back")),
        "{}",
        confirm.text
    );

    common::refuse_writes(&sidecar.redis, false);
    eventually("the sweeper to give the cap back", async || {
        common::redis_counts(&sidecar.redis, "cap").0 == 3
    })
    .await;
    eventually("a retry of the key to hear the refusal", async || {
        let retried = sidecar.post_cart(&body).await;
        retried.status == 409 && retried.body["outcome"] == "short"
    })
    .await;
    sidecar.assert_invariants("cap", 3);
    sidecar.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_carts_give_back_never_refunds_a_paid_line() {
    a_line_confirmed_during_its_carts_give_back_stays_confirmed(false).await;
    a_line_confirmed_during_its_carts_give_back_stays_confirmed(true).await;
    a_line_redis_missed_the_confirm_of_is_not_refunded().await;
    a_refused_carts_stalled_give_back_is_under_way_until_it_is_done().await;
}
