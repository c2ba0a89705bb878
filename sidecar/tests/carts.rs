//! Carts (docs/design.md, "Carts") through the real HTTP API against a real Redis
//! and the sidecar's ledger, on the Redis gate and on the ledger's fallback gate:
//! several lines on several drops (one sold in sizes) held, confirmed, cancelled and
//! looked up as one; a cart that cannot be held as asked holds nothing; lines of the
//! same drop and size are checked in sum; the per-user limit counts across carts and
//! single reserves; bad carts are refused naming what is wrong with nothing
//! changed; and a rush of buyers with carts never oversells nor leaves an `all`
//! cart partly held.

mod common;

use std::collections::HashMap;

use common::{Sidecar, marker_state};
use dropgate_testkit::{DropSpec, Reply};
use futures::future::join_all;
use serde_json::{Value, json};

const SIZES: [(&str, i64); 4] = [("S", 4), ("M", 6), ("L", 5), ("XL", 3)];

/// The sale the tests run: a shoe in sizes, a shirt and a cap, two units a buyer.
async fn shop(sidecar: &Sidecar, kill_switch: bool) {
    let gate = |spec: DropSpec| {
        if kill_switch {
            spec.kill_switch()
        } else {
            spec
        }
    };
    sidecar
        .seed(
            "shoe",
            gate(
                DropSpec::new(0)
                    .variants(&SIZES)
                    .per_user_limit(2)
                    .permits(1000),
            ),
        )
        .await;
    sidecar
        .seed(
            "shirt",
            gate(DropSpec::new(10).per_user_limit(2).permits(1000)),
        )
        .await;
    sidecar
        .seed(
            "cap",
            gate(DropSpec::new(3).per_user_limit(2).permits(1000)),
        )
        .await;
}

/// A cart line as the tests write it: (drop, variant, quantity).
type Line<'a> = (&'a str, Option<&'a str>, i64);

/// A cart body: `lines` as (drop, variant, quantity).
fn cart(key: &str, user: &str, lines: &[Line], mode: Option<&str>) -> String {
    let lines: Vec<Value> = lines
        .iter()
        .map(|(drop, variant, quantity)| {
            let mut line = json!({"drop": drop, "quantity": quantity});
            if let Some(variant) = variant {
                line["variant"] = (*variant).into();
            }
            line
        })
        .collect();
    let mut body = json!({"key": key, "user": user, "lines": lines});
    if let Some(mode) = mode {
        body["mode"] = mode.into();
    }
    body.to_string()
}

async fn post_cart(sidecar: &Sidecar, body: &str) -> Reply {
    sidecar.http.post("/v1/carts", body).await.expect("answers")
}

async fn cart_call(sidecar: &Sidecar, key: &str, op: &str) -> Reply {
    let path = match op {
        "lookup" => format!("/v1/carts/{key}"),
        op => format!("/v1/carts/{key}/{op}"),
    };
    if op == "lookup" {
        sidecar.http.get(&path).await.expect("answers")
    } else {
        sidecar.http.post(&path, "").await.expect("answers")
    }
}

/// The answer's held lines as `drop/variant x quantity: state`.
fn lines(reply: &Reply) -> Vec<String> {
    reply.body["lines"]
        .as_array()
        .map(|lines| {
            lines
                .iter()
                .map(|l| {
                    format!(
                        "{}/{} x{}: {}",
                        l["drop"].as_str().unwrap_or("?"),
                        l["variant"].as_str().unwrap_or("-"),
                        l["quantity"],
                        l["state"].as_str().unwrap_or("?")
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The answer's short lines as `drop/variant: outcome`.
fn short(reply: &Reply) -> Vec<String> {
    reply.body["short"]
        .as_array()
        .map(|lines| {
            lines
                .iter()
                .map(|l| {
                    format!(
                        "{}/{}: {}",
                        l["drop"].as_str().unwrap_or("?"),
                        l["variant"].as_str().unwrap_or("-"),
                        l["outcome"].as_str().unwrap_or("?")
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Units of `drop` left (of `variant`, for a drop in sizes), as
/// `GET /v1/drops/{drop}` says: whichever gate decides the drop.
async fn left(sidecar: &Sidecar, drop: &str, variant: Option<&str>) -> i64 {
    let shown = sidecar
        .http
        .get(&format!("/v1/drops/{drop}"))
        .await
        .expect("answers");
    match variant {
        None => shown.body["remaining"].as_i64(),
        Some(size) => shown.body["variants"].as_array().and_then(|variants| {
            variants
                .iter()
                .find(|v| v["name"] == size)
                .and_then(|v| v["remaining"].as_i64())
        }),
    }
    .unwrap_or_else(|| panic!("GET /v1/drops/{drop}: {}", shown.text))
}

/// The states of cart `key`'s line reservations in Redis, by line number (lines in
/// order by drop, each drop named once): `None` where a line has no marker.
fn line_states(sidecar: &Sidecar, key: &str, drops: &[&str]) -> Vec<Option<String>> {
    let mut drops = drops.to_vec();
    drops.sort_unstable();
    drops
        .iter()
        .enumerate()
        .map(|(i, drop)| marker_state(&sidecar.redis, drop, &format!("{key}:{}", i + 1)))
        .collect()
}

fn held(state: &Option<String>) -> bool {
    matches!(state.as_deref(), Some("active" | "confirmed"))
}

async fn a_cart_is_held_confirmed_and_cancelled_as_one(kill_switch: bool) {
    let sidecar = Sidecar::start().await;
    shop(&sidecar, kill_switch).await;
    // Two lines of the same size are one line of two.
    let body = cart(
        "c1",
        "ann",
        &[
            ("shoe", Some("M"), 1),
            ("shirt", None, 1),
            ("shoe", Some("M"), 1),
        ],
        None,
    );
    let reply = post_cart(&sidecar, &body).await;
    reply.assert_answer(201, "reserved");
    // Lines in order by drop, then variant.
    assert_eq!(
        lines(&reply),
        ["shirt/- x1: active", "shoe/M x2: active"],
        "{}",
        reply.text
    );
    assert_eq!(reply.body["lines"][1]["key"], "c1:2");
    assert_eq!(reply.body["state"], "active");
    assert!(reply.body["expiresAt"].is_string(), "{}", reply.text);
    assert_eq!(left(&sidecar, "shoe", Some("M")).await, 4);
    assert_eq!(left(&sidecar, "shirt", None).await, 9);

    // A retry is the same cart; the lines are reservations of their drops.
    let again = post_cart(&sidecar, &body).await;
    again.assert_answer(200, "already_reserved");
    assert_eq!(lines(&again), lines(&reply));
    // The same lines in another order are the same cart.
    let reordered = cart(
        "c1",
        "ann",
        &[("shirt", None, 1), ("shoe", Some("M"), 2)],
        None,
    );
    let again = post_cart(&sidecar, &reordered).await;
    again.assert_answer(200, "already_reserved");
    assert_eq!(lines(&again), lines(&reply));
    sidecar
        .lookup("shoe", "c1:2")
        .await
        .assert_answer(200, "found");
    cart_call(&sidecar, "c1", "lookup")
        .await
        .assert_answer(200, "found");

    let confirmed = cart_call(&sidecar, "c1", "confirm").await;
    confirmed.assert_answer(200, "confirmed");
    assert_eq!(
        lines(&confirmed),
        ["shirt/- x1: confirmed", "shoe/M x2: confirmed"]
    );
    assert!(confirmed.body["expiresAt"].is_null(), "{}", confirmed.text);
    cart_call(&sidecar, "c1", "confirm")
        .await
        .assert_answer(200, "already_confirmed");

    // Cancelled as one: both drops get their units back.
    let cancelled = cart_call(&sidecar, "c1", "cancel").await;
    cancelled.assert_answer(200, "cancelled");
    cart_call(&sidecar, "c1", "cancel")
        .await
        .assert_answer(200, "already_cancelled");
    assert_eq!(left(&sidecar, "shoe", Some("M")).await, 6);
    assert_eq!(left(&sidecar, "shirt", None).await, 10);
    cart_call(&sidecar, "nope", "lookup")
        .await
        .assert_answer(404, "not_found");
    sidecar.assert_invariants("shoe", 18);
    sidecar.assert_invariants("shirt", 10);
    sidecar.shutdown().await;
}

#[tokio::test]
async fn a_cart_is_held_confirmed_and_cancelled_as_one_on_the_gate() {
    a_cart_is_held_confirmed_and_cancelled_as_one(false).await;
}

#[tokio::test]
async fn a_cart_is_held_confirmed_and_cancelled_as_one_on_the_fallback() {
    a_cart_is_held_confirmed_and_cancelled_as_one(true).await;
}

#[tokio::test]
async fn an_all_cart_with_a_short_line_holds_nothing_and_an_available_one_holds_the_rest() {
    let sidecar = Sidecar::start().await;
    shop(&sidecar, false).await;
    // The cap sells out to someone else.
    sidecar
        .reserve("cap", "other", "other", 2)
        .await
        .assert_answer(201, "admitted");
    let lines_asked = [("shoe", Some("S"), 1), ("cap", None, 2), ("shirt", None, 1)];

    let refused = post_cart(&sidecar, &cart("c2", "bob", &lines_asked, None)).await;
    refused.assert_answer(409, "short");
    assert_eq!(short(&refused), ["cap/-: sold_out"], "{}", refused.text);
    assert_eq!(refused.body["short"][0]["remaining"], 1);
    assert_eq!(
        line_states(&sidecar, "c2", &["shoe", "cap", "shirt"])
            .iter()
            .filter(|s| held(s))
            .count(),
        0,
        "an `all` cart refused holds nothing"
    );
    assert_eq!(left(&sidecar, "shoe", Some("S")).await, 4);
    assert_eq!(left(&sidecar, "shirt", None).await, 10);
    // Its retry hears the same; a look-up shows it refused.
    let again = post_cart(&sidecar, &cart("c2", "bob", &lines_asked, None)).await;
    again.assert_answer(409, "short");
    assert_eq!(short(&again), short(&refused));
    assert_eq!(
        cart_call(&sidecar, "c2", "lookup").await.body["state"],
        "refused"
    );

    // `available`: the lines that fit are held, the rest listed.
    let partial = post_cart(
        &sidecar,
        &cart("c3", "bob", &lines_asked, Some("available")),
    )
    .await;
    partial.assert_answer(201, "reserved");
    assert_eq!(lines(&partial), ["shirt/- x1: active", "shoe/S x1: active"]);
    assert_eq!(short(&partial), ["cap/-: sold_out"]);
    assert_eq!(left(&sidecar, "shoe", Some("S")).await, 3);

    // `available` with nothing that fits: 409, nothing held.
    let none = post_cart(
        &sidecar,
        &cart("c4", "cid", &[("cap", None, 2)], Some("available")),
    )
    .await;
    none.assert_answer(409, "short");
    sidecar.assert_invariants("shoe", 18);
    sidecar.assert_invariants("shirt", 10);
    sidecar.assert_invariants("cap", 3);
    sidecar.shutdown().await;
}

/// A cart whose later line cannot be decided (its drop's one throttle permit is
/// taken by a buyer in checkout) gives back the line it held before answering
/// 503; the key is spent, and the answer says so in its body, so the shop
/// retries with a new key, which holds the cart once a permit is free.
#[tokio::test]
async fn a_cart_that_held_a_line_and_then_failed_gives_it_back_and_says_its_key_is_spent() {
    let sidecar = Sidecar::start().await;
    sidecar
        .seed("bag", DropSpec::new(5).per_user_limit(2).permits(1000))
        .await;
    sidecar
        .seed("pin", DropSpec::new(5).per_user_limit(2).permits(1))
        .await;
    sidecar
        .reserve("pin", "in-checkout", "ann", 1)
        .await
        .assert_answer(201, "admitted");
    let lines_asked = [("bag", None, 1), ("pin", None, 1)];

    let failed = post_cart(&sidecar, &cart("k1", "bob", &lines_asked, None)).await;
    failed.assert_answer(503, "unavailable");
    assert_eq!(failed.body["keySpent"], true, "{}", failed.text);
    assert_eq!(
        marker_state(&sidecar.redis, "bag", "k1:1").as_deref(),
        Some("cancelled"),
        "the bag's line was held, then given back"
    );
    assert_eq!(left(&sidecar, "bag", None).await, 5);
    assert_eq!(left(&sidecar, "pin", None).await, 4);
    // The spent key answers what became of it; it holds nothing.
    post_cart(&sidecar, &cart("k1", "bob", &lines_asked, None))
        .await
        .assert_answer(409, "cancelled");

    // A permit free again, a new key holds the cart.
    sidecar
        .settle("pin", "in-checkout", "cancel")
        .await
        .assert_answer(200, "cancelled");
    post_cart(&sidecar, &cart("k2", "bob", &lines_asked, None))
        .await
        .assert_answer(201, "reserved");
    sidecar.assert_invariants("bag", 5);
    sidecar.assert_invariants("pin", 5);
    sidecar.shutdown().await;
}

/// A cart whose line was cancelled through its own reservation route cannot be
/// confirmed whole: its confirm answers 409 `expired`, the lines it still held go
/// back, and a retry of the confirm hears the same. With no line confirmed the cart
/// ends expired; with one confirmed before the cancelled line, it ends confirmed as
/// far as it went, and that line stays sold. (Before, such a cart was recorded
/// confirmed whatever was: a retry heard 200 `already_confirmed` with no line
/// confirmed, and the lines after the cancelled one stayed held until their own
/// deadline.)
#[tokio::test]
async fn a_cart_not_confirmable_whole_gives_back_its_other_lines() {
    let sidecar = Sidecar::start().await;
    shop(&sidecar, false).await;
    let lines_asked = [("shirt", None, 1), ("shoe", Some("M"), 1)];
    for key in ["first-gone", "last-gone"] {
        post_cart(&sidecar, &cart(key, "ann", &lines_asked, None))
            .await
            .assert_answer(201, "reserved");
    }
    // Line 1 (the shirt) of one cart, line 2 (the shoe) of the other, cancelled on
    // their own.
    for line in ["first-gone:1", "last-gone:2"] {
        let drop = if line.ends_with(":1") {
            "shirt"
        } else {
            "shoe"
        };
        sidecar
            .settle(drop, line, "cancel")
            .await
            .assert_answer(200, "cancelled");
    }

    let confirm = cart_call(&sidecar, "first-gone", "confirm").await;
    confirm.assert_answer(409, "expired");
    assert_eq!(
        lines(&confirm),
        ["shirt/- x1: cancelled", "shoe/M x1: cancelled"],
        "{}",
        confirm.text
    );
    assert_eq!(confirm.body["state"], "expired", "{}", confirm.text);
    assert!(
        confirm.body["expiresAt"].is_null(),
        "an ended cart holds nothing until any time: {}",
        confirm.text
    );
    let confirm = cart_call(&sidecar, "last-gone", "confirm").await;
    confirm.assert_answer(409, "expired");
    assert_eq!(
        lines(&confirm),
        ["shirt/- x1: confirmed", "shoe/M x1: cancelled"],
        "{}",
        confirm.text
    );
    assert_eq!(
        confirm.body["state"], "partly_confirmed",
        "{}",
        confirm.text
    );
    for key in ["first-gone", "last-gone"] {
        cart_call(&sidecar, key, "confirm")
            .await
            .assert_answer(409, "expired");
    }
    assert_eq!(
        left(&sidecar, "shoe", Some("M")).await,
        6,
        "both shoes back"
    );
    assert_eq!(left(&sidecar, "shirt", None).await, 9, "one shirt sold");

    // A line confirmed through its own route counts as confirmed too: the cart is
    // confirmed as far as it went, not expired with a line sold.
    post_cart(&sidecar, &cart("own-route", "bea", &lines_asked, None))
        .await
        .assert_answer(201, "reserved");
    sidecar
        .settle("shoe", "own-route:2", "confirm")
        .await
        .assert_answer(200, "confirmed");
    sidecar
        .settle("shirt", "own-route:1", "cancel")
        .await
        .assert_answer(200, "cancelled");
    let confirm = cart_call(&sidecar, "own-route", "confirm").await;
    confirm.assert_answer(409, "expired");
    assert_eq!(
        confirm.body["state"], "partly_confirmed",
        "{}",
        confirm.text
    );

    // A cancel of a cart confirmed as far as it went refunds what was sold.
    cart_call(&sidecar, "last-gone", "cancel")
        .await
        .assert_answer(200, "cancelled");
    assert_eq!(
        left(&sidecar, "shirt", None).await,
        10,
        "the shirt refunded"
    );
    sidecar.assert_invariants("shoe", 18);
    sidecar.assert_invariants("shirt", 10);
    sidecar.shutdown().await;
}

/// Whether the ledger holds a reservation under `key` in any drop.
async fn in_ledger(sidecar: &Sidecar, key: &str) -> bool {
    use sqlx::Row;
    let ledger = common::ledger_of(sidecar).await;
    let rows = sqlx::query("SELECT COUNT(*) FROM reservations WHERE res_key = $1")
        .bind(key)
        .fetch_one(ledger.pool())
        .await
        .expect("query")
        .get::<i64, _>(0);
    rows > 0
}

#[tokio::test]
async fn a_carts_lines_on_one_drop_are_decided_in_one_step_on_the_gate() {
    a_carts_lines_on_one_drop_are_decided_in_one_step(false).await;
}

#[tokio::test]
async fn a_whole_cart_is_decided_in_one_transaction_on_the_fallback() {
    a_carts_lines_on_one_drop_are_decided_in_one_step(true).await;
}

async fn a_carts_lines_on_one_drop_are_decided_in_one_step(kill_switch: bool) {
    let sidecar = Sidecar::start().await;
    shop(&sidecar, kill_switch).await;
    // Size XL sells out to others.
    for (key, user, quantity) in [("x1", "o1", 2), ("x2", "o2", 1)] {
        let body = json!({"key": key, "user": user, "quantity": quantity, "variant": "XL"});
        sidecar
            .http
            .post("/v1/drops/shoe/reservations", &body.to_string())
            .await
            .expect("answers")
            .assert_answer(201, "admitted");
    }

    // `all`: size S fits, XL does not. Decided in one step, S is never held: no
    // marker, no ledger row, no event (held and given back, it would have all
    // three, and buyers of S would have heard sold out meanwhile).
    let lines_asked = [("shoe", Some("S"), 1), ("shoe", Some("XL"), 1)];
    let refused = post_cart(&sidecar, &cart("one", "bob", &lines_asked, None)).await;
    refused.assert_answer(409, "short");
    assert_eq!(short(&refused), ["shoe/XL: sold_out"], "{}", refused.text);
    assert_eq!(marker_state(&sidecar.redis, "shoe", "one:1"), None);
    assert_eq!(marker_state(&sidecar.redis, "shoe", "one:2"), None);
    assert!(
        !in_ledger(&sidecar, "one:1").await,
        "a withdrawn line left a ledger row"
    );
    assert_eq!(left(&sidecar, "shoe", Some("S")).await, 4);

    // On the ledger's gate the whole cart is one transaction: a line on another
    // drop (the shirt, line 1) is not held either when a size is short.
    if kill_switch {
        let across = [("shoe", Some("XL"), 1), ("shirt", None, 1)];
        let refused = post_cart(&sidecar, &cart("across", "eve", &across, None)).await;
        refused.assert_answer(409, "short");
        assert_eq!(short(&refused), ["shoe/XL: sold_out"], "{}", refused.text);
        assert!(
            !in_ledger(&sidecar, "across:1").await,
            "the shirt's line left a row"
        );
        assert_eq!(left(&sidecar, "shirt", None).await, 10);
    }

    // An `available` cart refused for a line whose key holds something else (422)
    // holds nothing on its other drops either.
    let taken = json!({"key": "taken:1", "user": "fay", "quantity": 2});
    sidecar
        .http
        .post("/v1/drops/shirt/reservations", &taken.to_string())
        .await
        .expect("answers")
        .assert_answer(201, "admitted");
    let other_key = [("shirt", None, 1), ("shoe", Some("S"), 1)];
    let refused = post_cart(
        &sidecar,
        &cart("taken", "fay", &other_key, Some("available")),
    )
    .await;
    assert_eq!(refused.status, 422, "{}", refused.text);
    assert!(
        !in_ledger(&sidecar, "taken:2").await,
        "the shoe's line stayed held"
    );
    assert_eq!(left(&sidecar, "shoe", Some("S")).await, 4);

    // Lines in sizes within one drop count toward the per-user limit together,
    // in the same step: three sizes for a limit of two is short, nothing held.
    let three = [
        ("shoe", Some("S"), 1),
        ("shoe", Some("M"), 1),
        ("shoe", Some("L"), 1),
    ];
    let over = post_cart(&sidecar, &cart("three", "cid", &three, None)).await;
    over.assert_answer(409, "short");
    assert_eq!(
        short(&over),
        ["shoe/S: per_user_limit_exceeded"],
        "{}",
        over.text
    );
    for n in 1..=3 {
        assert_eq!(
            marker_state(&sidecar.redis, "shoe", &format!("three:{n}")),
            None
        );
        assert!(!in_ledger(&sidecar, &format!("three:{n}")).await);
    }

    // `available`: the sizes that fit are held, in the same step (the third size
    // is over the buyer's limit once the first two are counted).
    let asked = [
        ("shoe", Some("S"), 1),
        ("shoe", Some("XL"), 1),
        ("shoe", Some("M"), 1),
    ];
    let partial = post_cart(&sidecar, &cart("two", "dee", &asked, Some("available"))).await;
    partial.assert_answer(201, "reserved");
    assert_eq!(
        lines(&partial),
        ["shoe/M x1: active", "shoe/S x1: active"],
        "{}",
        partial.text
    );
    assert_eq!(short(&partial), ["shoe/XL: per_user_limit_exceeded"]);
    // Its retry is the same cart.
    post_cart(&sidecar, &cart("two", "dee", &asked, Some("available")))
        .await
        .assert_answer(200, "already_reserved");
    assert_eq!(left(&sidecar, "shoe", Some("S")).await, 3);
    assert_eq!(left(&sidecar, "shoe", Some("M")).await, 5);
    assert_eq!(left(&sidecar, "shirt", None).await, 8);
    sidecar.assert_invariants("shoe", 18);
    sidecar.shutdown().await;
}

#[tokio::test]
async fn the_per_user_limit_counts_across_carts_and_single_reserves() {
    let sidecar = Sidecar::start().await;
    shop(&sidecar, false).await;
    let body = r#"{"key":"one","user":"dee","quantity":1,"variant":"L"}"#;
    sidecar
        .http
        .post("/v1/drops/shoe/reservations", body)
        .await
        .expect("answers")
        .assert_answer(201, "admitted");
    // One more pair fits her limit of two; two more do not, whatever their sizes.
    let over = post_cart(
        &sidecar,
        &cart(
            "c5",
            "dee",
            &[
                ("shoe", Some("S"), 1),
                ("shoe", Some("M"), 1),
                ("shirt", None, 1),
            ],
            None,
        ),
    )
    .await;
    over.assert_answer(409, "short");
    assert_eq!(
        short(&over),
        ["shoe/S: per_user_limit_exceeded"],
        "{}",
        over.text
    );
    assert_eq!(
        left(&sidecar, "shoe", Some("S")).await,
        4,
        "the S line was given back"
    );
    let fits = post_cart(
        &sidecar,
        &cart(
            "c6",
            "dee",
            &[("shoe", Some("S"), 1), ("shirt", None, 2)],
            None,
        ),
    )
    .await;
    fits.assert_answer(201, "reserved");
    // Her shirt limit is used up by the cart: a single reserve is refused.
    sidecar
        .reserve("shirt", "two", "dee", 1)
        .await
        .assert_answer(409, "per_user_limit_exceeded");
    sidecar.assert_invariants("shoe", 18);
    sidecar.assert_invariants("shirt", 10);
    sidecar.shutdown().await;
}

#[tokio::test]
async fn bad_carts_are_refused_naming_what_is_wrong_and_change_nothing() {
    let sidecar = Sidecar::start().await;
    shop(&sidecar, false).await;
    post_cart(&sidecar, &cart("used", "eve", &[("shirt", None, 1)], None))
        .await
        .assert_answer(201, "reserved");
    let before = sidecar.snapshot();
    let many: Vec<Line> = (0..21).map(|_| ("shirt", None, 1)).collect();
    let table: Vec<(String, u16, &str)> = vec![
        ("{".into(), 400, "not valid JSON"),
        (
            r#"{"key":"k","user":"u"}"#.into(),
            400,
            "missing field `lines`",
        ),
        (
            r#"{"key":"k","user":"u","lines":[]}"#.into(),
            400,
            "`lines` must hold 1 to 20",
        ),
        (
            cart("k", "u", &many, None),
            400,
            "`lines` must hold 1 to 20 entries, not 21",
        ),
        (
            r#"{"key":"k","user":"u","lines":[{"quantity":1}]}"#.into(),
            400,
            "missing field `lines[0].drop`",
        ),
        (
            r#"{"key":"k","user":"u","lines":[{"drop":"shirt"}]}"#.into(),
            400,
            "missing field `lines[0].quantity`",
        ),
        (
            r#"{"key":"k","user":"u","lines":[{"drop":"shirt","quantity":0}]}"#.into(),
            400,
            "`lines[0].quantity`",
        ),
        (
            r#"{"key":"k","user":"u","lines":[{"drop":"shirt","quantity":1,"quantity":2}]}"#.into(),
            400,
            "given twice",
        ),
        (
            r#"{"key":"k","user":"u","lines":[{"drop":"shirt","quantity":1,"size":"M"}]}"#.into(),
            400,
            "unknown field `lines[0].size`",
        ),
        (
            r#"{"key":"k","user":"u","lines":[1]}"#.into(),
            400,
            "`lines[0]` must be an object",
        ),
        (
            r#"{"key":"k","user":"u","lines":[{"drop":"shirt","quantity":1}],"mode":"some"}"#
                .into(),
            400,
            "`mode` must be one of all, available",
        ),
        (
            cart("k", "u", &[("shoe", None, 1)], None),
            400,
            "no `variant`",
        ),
        (
            cart("k", "u", &[("shirt", Some("M"), 1)], None),
            400,
            "has no variants",
        ),
        (
            cart(
                "k",
                "u",
                &[("shirt", None, 1), ("shoe", Some("XXL"), 1)],
                None,
            ),
            404,
            "no variant XXL",
        ),
        (
            cart("k", "u", &[("shirt", None, 1), ("ghost", None, 1)], None),
            404,
            "ghost",
        ),
        (
            cart("used", "eve", &[("shirt", None, 2)], None),
            422,
            "already used",
        ),
        (
            cart("used", "zed", &[("shirt", None, 1)], None),
            422,
            "already used",
        ),
        (
            cart(&"k".repeat(254), "u", &[("shirt", None, 1)], None),
            400,
            "at most 253 bytes",
        ),
    ];
    for (body, status, says) in table {
        let reply = post_cart(&sidecar, &body).await;
        assert_eq!(reply.status.as_u16(), status, "{body}: {}", reply.text);
        assert!(reply.text.contains(says), "{body}: {}", reply.text);
    }
    assert_eq!(sidecar.snapshot(), before, "a refused cart changed Redis");
    sidecar.shutdown().await;
}

/// A rush of buyers, each with a cart of 2-3 lines over the three drops (sizes of
/// the shoe at random) and some with a single reserve too, against stock for far
/// fewer: every drop and size sells at most its quantity, the counts add up, and
/// no `all` cart is partly held once quiet.
#[tokio::test]
async fn a_rush_of_carts_never_oversells_nor_leaves_a_cart_partly_held() {
    let sidecar = Sidecar::start().await;
    shop(&sidecar, false).await;
    let buyers = 300;
    let plans: Vec<(String, Vec<Line>)> = (0..buyers)
        .map(|i| {
            let size = SIZES[i % SIZES.len()].0;
            let lines = match i % 3 {
                0 => vec![("shoe", Some(size), 1), ("shirt", None, 1)],
                1 => vec![
                    ("shirt", None, 1),
                    ("cap", None, 1),
                    ("shoe", Some(size), 1),
                ],
                _ => vec![("cap", None, 1), ("shoe", Some(size), 2)],
            };
            (format!("r{i}"), lines)
        })
        .collect();
    let sidecar = &sidecar;
    let answers: Vec<(String, Vec<&str>, Reply)> =
        join_all(plans.iter().map(|(key, lines)| async move {
            let user = format!("u{}", key.len() % 7 + key.as_bytes()[1] as usize % 50);
            // Some buyers also reserve a shirt alone, racing their own cart.
            if key.ends_with('7') {
                let _ = sidecar
                    .reserve("shirt", &format!("{key}-single"), &user, 1)
                    .await;
            }
            let reply = post_cart(sidecar, &cart(key, &user, lines, None)).await;
            let drops = lines.iter().map(|(d, _, _)| *d).collect();
            (key.clone(), drops, reply)
        }))
        .await;
    let mut tally: HashMap<String, usize> = HashMap::new();
    for (key, drops, reply) in &answers {
        *tally
            .entry(format!("{} {}", reply.status.as_u16(), reply.outcome()))
            .or_default() += 1;
        let states = line_states(sidecar, key, drops);
        match reply.status.as_u16() {
            201 => assert!(states.iter().all(held), "{key}: 201 but {states:?}"),
            409 | 503 => assert!(
                !states.iter().any(held),
                "{key}: answered {} yet holds {states:?}",
                reply.text
            ),
            other => panic!("{key}: unexpected {other}: {}", reply.text),
        }
    }
    assert!(
        tally.get("201 reserved").copied().unwrap_or(0) > 0,
        "{tally:?}"
    );
    assert!(
        tally.get("409 short").copied().unwrap_or(0) > 0,
        "{tally:?}"
    );
    sidecar.assert_invariants("shoe", 18);
    sidecar.assert_invariants("shirt", 10);
    sidecar.assert_invariants("cap", 3);
    for (size, quantity) in SIZES {
        let units = left(sidecar, "shoe", Some(size)).await;
        assert!(
            (0..=quantity).contains(&units),
            "{size}: {units} left of {quantity}"
        );
    }
}

/// A cancel of a held cart past its expiry, before the sweeper came by: the cart
/// expired as a whole, and the cancel answers as a cancel of an expired cart does
/// (409 `expired`), its lines given back. Before, it answered 200 `cancelled`, or
/// 409 `expired` had the sweeper been first: the same request, two answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_of_a_cart_past_its_expiry_answers_expired() {
    let redis = dropgate_testkit::RedisServer::start().expect("redis-server starts");
    let dir = tempfile::tempdir().expect("temp dir");
    let ledger = format!("sqlite://{}", dir.path().join("ledger.db").display());
    // The sweepers kept out of it: the cancel is what finds the cart expired.
    let sidecar = common::Peer::start_custom(&redis.url(), &ledger, |settings| {
        settings.sweep_ms = 600_000;
    })
    .await;
    for drop in ["cap", "shirt"] {
        let spec = DropSpec::new(3)
            .per_user_limit(2)
            .permits(100)
            .acquire_timeout_ms(100)
            .hold_seconds(3);
        common::seed(&redis.url(), drop, spec).await;
    }
    let body = json!({
        "key": "late",
        "user": "ann",
        "lines": [{"drop": "cap", "quantity": 1}, {"drop": "shirt", "quantity": 1}],
    });
    sidecar
        .http
        .post("/v1/carts", &body.to_string())
        .await
        .expect("answers")
        .assert_answer(201, "reserved");
    tokio::time::sleep(std::time::Duration::from_millis(3500)).await;

    let cancel = sidecar
        .http
        .post("/v1/carts/late/cancel", "")
        .await
        .expect("answers");
    cancel.assert_answer(409, "expired");
    let looked = sidecar.http.get("/v1/carts/late").await.expect("answers");
    assert_eq!(looked.body["state"], "expired", "{}", looked.text);
    for drop in ["cap", "shirt"] {
        let shown = sidecar
            .http
            .get(&format!("/v1/drops/{drop}"))
            .await
            .expect("answers");
        assert_eq!(shown.body["remaining"], 3, "{drop}: {}", shown.text);
    }
    sidecar.shutdown().await;
}

/// A sidecar that read drop `bag` on the gate and drop `cap` on the fallback (its
/// kill switch), and re-reads configs only every ten minutes.
async fn a_bag_on_the_gate_and_a_cap_on_the_fallback() -> (
    dropgate_testkit::RedisServer,
    tempfile::TempDir,
    common::Peer,
) {
    let redis = dropgate_testkit::RedisServer::start().expect("redis-server starts");
    let dir = tempfile::tempdir().expect("temp dir");
    let ledger = format!("sqlite://{}", dir.path().join("ledger.db").display());
    let sidecar = common::Peer::start_with(&redis.url(), &ledger, 600_000).await;
    let shop = [
        ("bag", DropSpec::new(10).per_user_limit(2).permits(1000)),
        (
            "cap",
            DropSpec::new(3)
                .per_user_limit(2)
                .permits(1000)
                .kill_switch(),
        ),
    ];
    for (name, spec) in shop {
        common::seed(&redis.url(), name, spec).await;
        let read = sidecar.http.get(&format!("/v1/drops/{name}")).await;
        assert_eq!(read.expect("answers").status, 200);
    }
    (redis, dir, sidecar)
}

/// Asserts that a cart of a bag and a cap, mode `all`, is refused whole with a
/// 503 saying `why`, its key kept, and no bag held nor given back (the bag's line
/// is decided first).
async fn assert_refused_whole(
    redis: &dropgate_testkit::RedisServer,
    sidecar: &common::Peer,
    why: &str,
) {
    let bags_before = common::redis_counts(redis, "bag");
    let body = cart(
        "c1",
        "alice",
        &[("bag", None, 1), ("cap", None, 1)],
        Some("all"),
    );
    let reply = sidecar
        .http
        .post("/v1/carts", &body)
        .await
        .expect("answers");
    common::assert_unavailable_saying(&reply, why);
    assert_ne!(reply.body["keySpent"], true, "{}", reply.text);
    assert_eq!(
        common::redis_counts(redis, "bag"),
        bags_before,
        "no bag was held nor given back"
    );
}

/// A cart that must be whole with a line on a drop the operator has closed (HA
/// required and missing, failure policy Closed) since the sidecar read it on the
/// fallback, after a line on a drop on the gate: refused whole before any line is
/// held, its key kept. (Before, the gate's line was held, then given back, and
/// the answer spent the key.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_cart_with_a_line_on_a_drop_closed_meanwhile_holds_nothing() {
    let (redis, _dir, sidecar) = a_bag_on_the_gate_and_a_cap_on_the_fallback().await;
    common::publish_closed(
        &redis.url(),
        "cap",
        DropSpec::new(3).per_user_limit(2).permits(1000),
    )
    .await;
    assert_refused_whole(&redis, &sidecar, "is closed").await;
    sidecar.shutdown().await;
}

/// The same when Redis lost the fallback drop's config (its data lost, the
/// operator not yet back to publish it again): nothing is decided on the copy,
/// and the cart is refused whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_cart_with_a_line_on_a_drop_whose_config_redis_lost_holds_nothing() {
    let (redis, _dir, sidecar) = a_bag_on_the_gate_and_a_cap_on_the_fallback().await;
    let mut conn = redis.connection().expect("connects");
    redis::cmd("DEL")
        .arg(dropgate_api::DropKeys::new(common::NS, "cap").config())
        .query::<()>(&mut conn)
        .expect("DEL the config");
    assert_refused_whole(&redis, &sidecar, "not the one this sidecar holds").await;
    sidecar.shutdown().await;
}
