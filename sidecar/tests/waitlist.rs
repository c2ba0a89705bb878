//! The waitlist through the HTTP API, against a real Redis and ledger: buyers
//! turned away wait in line, units that come back go to the head of the line in
//! order and to nobody else while anyone waits, and the line survives a Redis that
//! lost its data and a round trip through the fallback gate.

mod common;

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use common::{NS, Sidecar, ledger_of};
use dropgate_api::DropKeys;
use dropgate_testkit::{DropSpec, Reply};
use serde_json::json;
use sqlx::Row;

/// `POST /v1/drops/{drop}/waitlist`.
async fn join(sidecar: &Sidecar, drop: &str, key: &str, user: &str, quantity: i64) -> Reply {
    common::join_line(&sidecar.http, drop, key, user, quantity).await
}

/// `GET /v1/drops/{drop}/waitlist/{key}`.
async fn look(sidecar: &Sidecar, drop: &str, key: &str) -> Reply {
    common::look_line(&sidecar.http, drop, key).await
}

/// `POST /v1/drops/{drop}/waitlist/{key}/cancel`.
async fn leave(sidecar: &Sidecar, drop: &str, key: &str) -> Reply {
    sidecar
        .http
        .post(&format!("/v1/drops/{drop}/waitlist/{key}/cancel"), "")
        .await
        .expect("answers")
}

/// Waits (a few seconds at most) until `key`'s entry was served, and answers its
/// look-up then.
async fn offered(sidecar: &Sidecar, drop: &str, key: &str) -> Reply {
    let mut last = look(sidecar, drop, key).await;
    for _ in 0..100 {
        if last.outcome() == "offered" {
            return last;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        last = look(sidecar, drop, key).await;
    }
    panic!("{key} was never offered: {}", last.text);
}

/// Each of `buyers` holds one unit of `sale` under a key of their name.
async fn hold_each(sidecar: &Sidecar, buyers: &[&str]) {
    for buyer in buyers {
        sidecar
            .reserve("sale", buyer, buyer, 1)
            .await
            .assert_answer(201, "admitted");
    }
}

/// Each of `buyers` waits for one unit of `sale`, in this order, under a key of
/// their name.
async fn join_each(sidecar: &Sidecar, buyers: &[&str]) {
    for buyer in buyers {
        join(sidecar, "sale", buyer, buyer, 1)
            .await
            .assert_answer(201, "waiting");
    }
}

/// Asserts `key` waits at `position`.
fn assert_waiting_at(reply: &Reply, position: i64) {
    reply.assert_answer(200, "waiting");
    assert_eq!(reply.body["position"], position, "{}", reply.text);
}

/// The ledger's entries of the drop's sale, by position: `key:state`.
async fn ledger_line(sidecar: &Sidecar, drop: &str) -> Vec<String> {
    let ledger = ledger_of(sidecar).await;
    sqlx::query("SELECT res_key, state FROM waitlist WHERE drop_key = $1 ORDER BY position")
        .bind(sidecar.ledger_key(drop))
        .fetch_all(ledger.pool())
        .await
        .expect("reads the waitlist")
        .iter()
        .map(|row| format!("{}:{}", row.get::<String, _>(0), row.get::<String, _>(1)))
        .collect()
}

/// Which gate answered (`Dropgate-Path`).
fn path_of(reply: &Reply) -> &str {
    reply
        .headers
        .get("dropgate-path")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("gate")
}

fn spec(limit: i64) -> DropSpec {
    DropSpec::new(limit).per_user_limit(2).waitlist()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn units_that_come_back_go_to_the_head_of_the_line_in_order() {
    let sidecar = Sidecar::start().await;
    sidecar.seed("sale", spec(3)).await;
    hold_each(&sidecar, &["a", "b", "c"]).await;
    sidecar
        .reserve("sale", "late", "g", 1)
        .await
        .assert_answer(409, "sold_out");
    for (n, buyer) in ["d", "e", "f"].into_iter().enumerate() {
        let joined = join(&sidecar, "sale", buyer, buyer, 1).await;
        joined.assert_answer(201, "waiting");
        assert_eq!(joined.body["position"], n as i64 + 1, "{}", joined.text);
    }
    // A retry hears its place; GET says the same.
    let again = join(&sidecar, "sale", "e", "e", 1).await;
    again.assert_answer(200, "already_waiting");
    assert_eq!(again.body["position"], 2);
    assert_waiting_at(&look(&sidecar, "sale", "f").await, 3);
    // Where DropKeys says the line and its counts are.
    let keys = DropKeys::new(NS, "sale");
    let mut conn = sidecar.redis.connection().expect("connect");
    let in_line: Vec<String> = redis::cmd("ZRANGE")
        .arg(keys.waitlist_line(""))
        .arg(0)
        .arg(-1)
        .query(&mut conn)
        .expect("ZRANGE");
    assert_eq!(in_line, ["d", "e", "f"]);
    let waiting: BTreeMap<String, i64> = redis::cmd("HGETALL")
        .arg(keys.waitlist_users())
        .query(&mut conn)
        .expect("HGETALL");
    assert_eq!(waiting.values().sum::<i64>(), 3);
    let state: String = redis::cmd("HGET")
        .arg(keys.waitlist_entry("d"))
        .arg("state")
        .query(&mut conn)
        .expect("HGET");
    assert_eq!(state, "waiting");
    let counter: i64 = redis::cmd("GET")
        .arg(keys.waitlist_counter())
        .query(&mut conn)
        .expect("GET");
    assert_eq!(counter, 3);

    // b gives its unit back: it goes to d, the head, and nobody else gets it.
    sidecar
        .settle("sale", "b", "cancel")
        .await
        .assert_answer(200, "cancelled");
    sidecar
        .reserve("sale", "late-2", "g", 1)
        .await
        .assert_answer(409, "sold_out");
    let served = offered(&sidecar, "sale", "d").await;
    assert_eq!(served.body["state"], "active", "{}", served.text);
    assert_waiting_at(&look(&sidecar, "sale", "e").await, 1);
    assert_waiting_at(&look(&sidecar, "sale", "f").await, 2);
    // The offer is a reservation under the entry's key: confirmed as any other.
    sidecar
        .settle("sale", "d", "confirm")
        .await
        .assert_answer(200, "confirmed");
    // A served entry cannot leave; its reservation is cancelled instead.
    leave(&sidecar, "sale", "d")
        .await
        .assert_answer(409, "offered");

    // f leaves; a retry is harmless. c's unit then goes to e, f is skipped.
    leave(&sidecar, "sale", "f")
        .await
        .assert_answer(200, "left");
    leave(&sidecar, "sale", "f")
        .await
        .assert_answer(200, "left");
    look(&sidecar, "sale", "f").await.assert_answer(200, "left");
    sidecar
        .settle("sale", "c", "cancel")
        .await
        .assert_answer(200, "cancelled");
    offered(&sidecar, "sale", "e").await;

    // Nobody waits now: the next unit back is anyone's.
    sidecar
        .settle("sale", "a", "cancel")
        .await
        .assert_answer(200, "cancelled");
    sidecar
        .reserve("sale", "late-3", "g", 1)
        .await
        .assert_answer(201, "admitted");
    assert_eq!(
        ledger_line(&sidecar, "sale").await,
        ["d:offered", "e:offered", "f:left"]
    );
    // The offers were announced as such, once each.
    let ledger = ledger_of(&sidecar).await;
    let kinds: Vec<String> =
        sqlx::query("SELECT payload FROM outbox WHERE drop_key = $1 ORDER BY id")
            .bind(sidecar.ledger_key("sale"))
            .fetch_all(ledger.pool())
            .await
            .expect("reads the outbox")
            .iter()
            .filter_map(|row| {
                let payload: serde_json::Value =
                    serde_json::from_str(&row.get::<String, _>(0)).ok()?;
                (payload["type"] == "offered")
                    .then(|| payload["key"].as_str().map(str::to_string))?
            })
            .collect();
    assert_eq!(kinds, ["d", "e"]);
    sidecar.assert_invariants("sale", 3);
    sidecar.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_units_count_toward_the_per_user_limit() {
    let sidecar = Sidecar::start().await;
    sidecar.seed("sale", spec(1)).await;
    sidecar
        .reserve("sale", "a", "alice", 1)
        .await
        .assert_answer(201, "admitted");
    // Alice holds 1 of her 2: she may wait for 1 more, not 2.
    join(&sidecar, "sale", "a-2", "alice", 2)
        .await
        .assert_answer(409, "per_user_limit_exceeded");
    join(&sidecar, "sale", "a-2", "alice", 1)
        .await
        .assert_answer(201, "waiting");
    // Waiting for 1 and holding 1, she can reserve nothing more anywhere.
    join(&sidecar, "sale", "a-3", "alice", 1)
        .await
        .assert_answer(409, "per_user_limit_exceeded");
    // Her place is hers even after her own unit comes back to the line.
    sidecar
        .settle("sale", "a", "cancel")
        .await
        .assert_answer(200, "cancelled");
    let served = offered(&sidecar, "sale", "a-2").await;
    assert_eq!(served.body["user"], "alice");
    sidecar.assert_invariants("sale", 1);
    sidecar.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_that_cannot_be_made_is_refused_and_changes_nothing() {
    let sidecar = Sidecar::start().await;
    sidecar.seed("plain", DropSpec::new(1)).await;
    sidecar
        .seed("sale", DropSpec::new(1).per_user_limit(2).waitlist_of(2))
        .await;
    sidecar
        .reserve("sale", "held", "h", 1)
        .await
        .assert_answer(201, "admitted");
    let before = sidecar.snapshot();
    join(&sidecar, "plain", "x", "x", 1)
        .await
        .assert_answer(409, "waitlist_disabled");
    join(&sidecar, "nope", "x", "x", 1)
        .await
        .assert_answer(404, "not_found");
    // The key of a reservation is not a place in line.
    join(&sidecar, "sale", "held", "h", 1)
        .await
        .assert_answer(422, "idempotency_key_reused");
    for body in [
        "{",
        r#"{"key": "x", "user": "x"}"#,
        r#"{"key": "x", "user": "x", "quantity": 0}"#,
        r#"{"key": "x", "user": "x", "quantity": 1, "variant": "XL"}"#,
        r#"{"key": "x", "user": "x", "quantity": 1, "extra": 1}"#,
    ] {
        let refused = sidecar
            .http
            .post("/v1/drops/sale/waitlist", body)
            .await
            .expect("answers");
        refused.assert_answer_because(400, "invalid", body);
    }
    look(&sidecar, "sale", "x")
        .await
        .assert_answer(404, "not_found");
    leave(&sidecar, "sale", "x")
        .await
        .assert_answer(404, "not_found");
    assert_eq!(sidecar.snapshot(), before, "a refused call changed Redis");

    join(&sidecar, "sale", "w1", "u1", 1)
        .await
        .assert_answer(201, "waiting");
    join(&sidecar, "sale", "w1", "u1", 2)
        .await
        .assert_answer(422, "idempotency_key_reused");
    join(&sidecar, "sale", "w2", "u2", 1)
        .await
        .assert_answer(201, "waiting");
    join(&sidecar, "sale", "w3", "u3", 1)
        .await
        .assert_answer(409, "waitlist_full");
    // A key waiting in line is not a new reserve either.
    sidecar
        .reserve("sale", "w1", "u1", 1)
        .await
        .assert_answer(422, "idempotency_key_reused");
    assert_eq!(
        ledger_line(&sidecar, "sale").await,
        ["w1:waiting", "w2:waiting"]
    );
    sidecar.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_variant_has_a_line_of_its_own() {
    let sidecar = Sidecar::start().await;
    let sized = || {
        DropSpec::new(0)
            .variants(&[("S", 1), ("M", 1)])
            .per_user_limit(2)
            .waitlist()
    };
    sidecar.seed("sale", sized()).await;
    for (key, size) in [("s", "S"), ("m", "M")] {
        let body = json!({"key": key, "user": key, "quantity": 1, "variant": size});
        sidecar
            .http
            .post("/v1/drops/sale/reservations", &body.to_string())
            .await
            .expect("answers")
            .assert_answer(201, "admitted");
    }
    let body = json!({"key": "w", "user": "w", "quantity": 1, "variant": "S"});
    let joined = sidecar
        .http
        .post("/v1/drops/sale/waitlist", &body.to_string())
        .await
        .expect("answers");
    joined.assert_answer(201, "waiting");
    assert_eq!(joined.body["variant"], "S");
    // An M that comes back is not S's line's: anyone may have it.
    sidecar
        .settle("sale", "m", "cancel")
        .await
        .assert_answer(200, "cancelled");
    let body = json!({"key": "m2", "user": "x", "quantity": 1, "variant": "M"});
    sidecar
        .http
        .post("/v1/drops/sale/reservations", &body.to_string())
        .await
        .expect("answers")
        .assert_answer(201, "admitted");
    sidecar
        .settle("sale", "s", "cancel")
        .await
        .assert_answer(200, "cancelled");
    let served = offered(&sidecar, "sale", "w").await;
    assert_eq!(served.body["variant"], "S");
    sidecar.assert_invariants("sale", 2);
    sidecar.shutdown().await;
}

/// `POST /v1/drops/sale/reservations` of `variant`.
async fn reserve_size(
    sidecar: &Sidecar,
    key: &str,
    user: &str,
    quantity: i64,
    size: &str,
) -> Reply {
    let body = json!({"key": key, "user": user, "quantity": quantity, "variant": size});
    sidecar
        .http
        .post("/v1/drops/sale/reservations", &body.to_string())
        .await
        .expect("answers")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_size_cut_another_size_takes_no_unit_a_line_waits_for_on_the_gate() {
    another_size_takes_no_unit_a_line_waits_for(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_size_cut_another_size_takes_no_unit_a_line_waits_for_on_the_fallback() {
    another_size_takes_no_unit_a_line_waits_for(true).await;
}

/// After M is cut below what it holds, the drop's own count is the tighter one
/// (M's debt is in it): a unit of S that comes back is the drop's only unit, and
/// an L buyer (L has a unit of its own) must not take it while S's head waits for
/// two; once S's second unit is back the head is served whole, and once M's debt
/// is paid L's unit is anyone's.
async fn another_size_takes_no_unit_a_line_waits_for(kill_switch: bool) {
    let sized = |m: i64| {
        let spec = DropSpec::new(0)
            .variants(&[("S", 2), ("M", m), ("L", 1)])
            .per_user_limit(2)
            .waitlist();
        if kill_switch {
            spec.kill_switch()
        } else {
            spec
        }
    };
    let sidecar = Sidecar::start().await;
    // The sale and its line start on the gate (joins are the gate's).
    sidecar
        .seed(
            "sale",
            DropSpec::new(0)
                .variants(&[("S", 2), ("M", 2), ("L", 1)])
                .per_user_limit(2)
                .waitlist(),
        )
        .await;
    for (key, size) in [("s1", "S"), ("s2", "S"), ("m1", "M"), ("m2", "M")] {
        reserve_size(&sidecar, key, key, 1, size)
            .await
            .assert_answer(201, "admitted");
    }
    let body = json!({"key": "w", "user": "w", "quantity": 2, "variant": "S"});
    sidecar
        .http
        .post("/v1/drops/sale/waitlist", &body.to_string())
        .await
        .expect("answers")
        .assert_answer(201, "waiting");
    // M cut from 2 to 1 while both are held: the drop owes one unit.
    sidecar.seed("sale", sized(1)).await;
    let mut probe = reserve_size(&sidecar, "probe", "p", 1, "M").await;
    for _ in 0..50 {
        if !kill_switch || path_of(&probe) == "fallback" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        probe = reserve_size(&sidecar, "probe", "p", 1, "M").await;
    }
    probe.assert_answer(409, "sold_out");
    // s1's unit comes back: S has one, and so has the drop (M still owes one).
    sidecar
        .settle("sale", "s1", "cancel")
        .await
        .assert_answer(200, "cancelled");
    // L has a unit of its own, but the drop's one unit is what S's head needs.
    let outsider = reserve_size(&sidecar, "z", "z", 1, "L").await;
    outsider.assert_answer(409, "sold_out");
    assert_eq!(outsider.body["remaining"], 0, "{}", outsider.text);
    if !kill_switch {
        look(&sidecar, "sale", "w")
            .await
            .assert_answer(200, "waiting");
        // Nor does the unit go to L's own line: the L buyer who joins it waits
        // through several sweeps while S's head does.
        let body = json!({"key": "zl", "user": "z", "quantity": 1, "variant": "L"});
        sidecar
            .http
            .post("/v1/drops/sale/waitlist", &body.to_string())
            .await
            .expect("answers")
            .assert_answer(201, "waiting");
        tokio::time::sleep(Duration::from_millis(1200)).await;
        look(&sidecar, "sale", "zl")
            .await
            .assert_answer(200, "waiting");
    }
    // Back on the gate with S's second unit, the head is served whole.
    if kill_switch {
        sidecar
            .seed(
                "sale",
                DropSpec::new(0)
                    .variants(&[("S", 2), ("M", 1), ("L", 1)])
                    .per_user_limit(2)
                    .waitlist(),
            )
            .await;
    }
    sidecar
        .settle("sale", "s2", "cancel")
        .await
        .assert_answer(200, "cancelled");
    let served = offered(&sidecar, "sale", "w").await;
    assert_eq!(served.body["quantity"], 2, "{}", served.text);
    // Once M's debt is paid, L's unit goes to L's line on the gate, to anyone on
    // the fallback (it has no line there: joins are the gate's).
    sidecar
        .settle("sale", "m1", "cancel")
        .await
        .assert_answer(200, "cancelled");
    if kill_switch {
        reserve_size(&sidecar, "z2", "z", 1, "L")
            .await
            .assert_answer(201, "admitted");
    } else {
        offered(&sidecar, "sale", "zl").await;
    }
    sidecar.assert_invariants("sale", 4);
    sidecar.shutdown().await;
}

/// 300 buyers for 20 units: the turned-away half waits in line, holds are
/// cancelled or expire, and every unit that comes back goes to the line in order
/// while the other buyers keep asking and get nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn returned_units_go_to_the_line_in_order_under_load() {
    under_load(Sidecar::start().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn returned_units_go_to_the_line_in_order_under_load_on_postgresql() {
    let postgres = dropgate_testkit::PostgresServer::start().expect("PostgreSQL");
    under_load(Sidecar::start_with_database(Some(postgres.url())).await).await;
}

async fn under_load(sidecar: Sidecar) {
    let sidecar = Arc::new(sidecar);
    sidecar
        .seed(
            "sale",
            DropSpec::new(20)
                .per_user_limit(1)
                .hold_seconds(3)
                .permits(1000)
                .waitlist(),
        )
        .await;
    let buyers: Vec<_> = (0..300)
        .map(|n| {
            let sidecar = sidecar.clone();
            tokio::spawn(async move {
                let key = format!("k{n}");
                let user = format!("u{n}");
                let reply = sidecar.reserve("sale", &key, &user, 1).await;
                (n, reply.status.as_u16(), reply.outcome().to_string())
            })
        })
        .collect();
    let mut admitted = Vec::new();
    let mut refused = Vec::new();
    for buyer in buyers {
        let (n, status, outcome) = buyer.await.expect("buyer");
        match (status, outcome.as_str()) {
            (201, "admitted") => admitted.push(n),
            (409, "sold_out") => refused.push(n),
            other => panic!("buyer {n}: {other:?}"),
        }
    }
    assert_eq!(admitted.len(), 20, "exactly the stock is admitted");
    // Half of those turned away wait, one after the other.
    let waiting: Vec<usize> = refused.iter().copied().step_by(2).collect();
    for n in &waiting {
        join(&sidecar, "sale", &format!("w{n}"), &format!("u{n}"), 1)
            .await
            .assert_answer(201, "waiting");
    }
    // The other half keep asking while units come back.
    let outsiders: Vec<usize> = refused.iter().copied().skip(1).step_by(2).collect();
    let asking = {
        let sidecar = sidecar.clone();
        tokio::spawn(async move {
            let mut admitted = 0;
            for round in 0..30 {
                for n in &outsiders {
                    let reply = sidecar
                        .reserve("sale", &format!("o{n}-{round}"), &format!("u{n}"), 1)
                        .await;
                    if reply.status.as_u16() == 201 {
                        admitted += 1;
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            admitted
        })
    };
    // Half of the holders cancel; the other half let their holds expire.
    for n in admitted.iter().take(10) {
        sidecar
            .settle("sale", &format!("k{n}"), "cancel")
            .await
            .assert_answer(200, "cancelled");
    }
    // Each offer is confirmed as it comes, in the line's order.
    let mut served = Vec::new();
    for n in waiting.iter().take(20) {
        offered(&sidecar, "sale", &format!("w{n}")).await;
        sidecar
            .settle("sale", &format!("w{n}"), "confirm")
            .await
            .assert_answer(200, "confirmed");
        served.push(*n);
    }
    assert_eq!(
        asking.await.expect("outsiders"),
        0,
        "an outsider got a unit while the line waited"
    );
    // Nobody past the twentieth in line was served.
    let line = ledger_line(&sidecar, "sale").await;
    let offered_keys: Vec<&String> = line.iter().filter(|e| e.ends_with(":offered")).collect();
    assert_eq!(offered_keys.len(), 20, "{line:?}");
    let expected: Vec<String> = waiting
        .iter()
        .take(20)
        .map(|n| format!("w{n}:offered"))
        .collect();
    assert_eq!(
        line[..20],
        expected[..],
        "the offers went in the line's order"
    );
    // The ledger made the offers in that order (their change numbers grow).
    let ledger = ledger_of(&sidecar).await;
    let numbered: Vec<String> = sqlx::query(
        "SELECT res_key FROM reservations WHERE drop_key = $1 AND res_key LIKE 'w%' ORDER BY seq",
    )
    .bind(sidecar.ledger_key("sale"))
    .fetch_all(ledger.pool())
    .await
    .expect("reads")
    .iter()
    .map(|row| row.get::<String, _>(0))
    .collect();
    let in_order: Vec<String> = waiting.iter().take(20).map(|n| format!("w{n}")).collect();
    assert_eq!(numbered, in_order);
    // The stream carries one `offered` event per offer the ledger has.
    let mut stream_offers = HashSet::new();
    for _ in 0..100 {
        stream_offers = offered_on_stream(&sidecar);
        if stream_offers.len() == 20 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let expected: HashSet<String> = in_order.iter().cloned().collect();
    assert_eq!(stream_offers, expected);
    sidecar.assert_invariants("sale", 20);
    match Arc::try_unwrap(sidecar) {
        Ok(sidecar) => sidecar.shutdown().await,
        Err(_) => panic!("the sidecar is still shared"),
    }
}

/// Keys of the `offered` events on the drop's stream.
fn offered_on_stream(sidecar: &Sidecar) -> HashSet<String> {
    let mut conn = sidecar.redis.connection().expect("connect");
    let entries: Vec<(String, BTreeMap<String, String>)> = redis::cmd("XRANGE")
        .arg(DropKeys::new(NS, "sale").events())
        .arg("-")
        .arg("+")
        .query(&mut conn)
        .unwrap_or_default();
    entries
        .into_iter()
        .filter_map(|(_, fields)| {
            let payload: serde_json::Value = serde_json::from_str(fields.get("payload")?).ok()?;
            (payload["type"] == "offered").then(|| payload["key"].as_str().map(str::to_string))?
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_line_survives_a_redis_that_lost_its_data_in_order() {
    let sidecar = Sidecar::start().await;
    sidecar.seed("sale", spec(2)).await;
    hold_each(&sidecar, &["a", "b"]).await;
    join_each(&sidecar, &["c", "d", "e"]).await;
    leave(&sidecar, "sale", "d")
        .await
        .assert_answer(200, "left");

    let mut conn = sidecar.redis.connection().expect("connect");
    redis::cmd("FLUSHALL")
        .query::<()>(&mut conn)
        .expect("FLUSHALL");
    sidecar.seed("sale", spec(2)).await;
    // The look-up finds Redis behind the ledger: rebuilt first, the line with it.
    assert_waiting_at(&look(&sidecar, "sale", "c").await, 1);
    assert_waiting_at(&look(&sidecar, "sale", "e").await, 2);
    look(&sidecar, "sale", "d").await.assert_answer(200, "left");
    // The holds came back too, and the line still comes first.
    sidecar
        .reserve("sale", "late", "z", 1)
        .await
        .assert_answer(409, "sold_out");
    // A new join goes behind the rebuilt ones.
    let joined = join(&sidecar, "sale", "f", "f", 1).await;
    joined.assert_answer(201, "waiting");
    assert_eq!(joined.body["position"], 3, "{}", joined.text);
    sidecar
        .settle("sale", "a", "cancel")
        .await
        .assert_answer(200, "cancelled");
    offered(&sidecar, "sale", "c").await;
    assert_waiting_at(&look(&sidecar, "sale", "e").await, 1);
    sidecar.assert_invariants("sale", 2);
    sidecar.shutdown().await;
}

/// A Redis that lost only a join (a failover to a replica that missed it) is behind
/// the ledger although no change number is missing: it is rebuilt, and the lost
/// entry waits at its place again; a later join never gets its position.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_lost_only_a_join_is_rebuilt_and_no_position_is_handed_out_twice() {
    let sidecar = Sidecar::start().await;
    sidecar.seed("sale", spec(2)).await;
    hold_each(&sidecar, &["a", "b"]).await;
    join_each(&sidecar, &["c", "d"]).await;
    // The replica never saw d's join: its entry, its place, its units, its number.
    let keys = DropKeys::new(NS, "sale");
    let mut conn = sidecar.redis.connection().expect("connect");
    let seq_before: i64 = redis::cmd("GET")
        .arg(keys.seq())
        .query(&mut conn)
        .expect("GET");
    redis::pipe()
        .cmd("DEL")
        .arg(keys.waitlist_entry("d"))
        .cmd("ZREM")
        .arg(keys.waitlist_line(""))
        .arg("d")
        .cmd("HDEL")
        .arg(keys.waitlist_users())
        .arg("d")
        .cmd("SET")
        .arg(keys.waitlist_counter())
        .arg(1)
        .query::<()>(&mut conn)
        .expect("forget d's join");

    // The sidecar's refresh finds the line behind the ledger and rebuilds Redis.
    let mut place: Option<i64> = None;
    for _ in 0..100 {
        place = redis::cmd("ZSCORE")
            .arg(keys.waitlist_line(""))
            .arg("d")
            .query(&mut conn)
            .expect("ZSCORE");
        if place.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(place, Some(2), "d waits at its place again");
    let seq_after: i64 = redis::cmd("GET")
        .arg(keys.seq())
        .query(&mut conn)
        .expect("GET");
    assert!(seq_after >= seq_before);
    assert_waiting_at(&look(&sidecar, "sale", "d").await, 2);
    let joined = join(&sidecar, "sale", "f", "f", 1).await;
    joined.assert_answer(201, "waiting");
    assert_eq!(joined.body["position"], 3, "{}", joined.text);
    // Units back go to c, then d, in order.
    for (holder, head) in [("a", "c"), ("b", "d")] {
        sidecar
            .settle("sale", holder, "cancel")
            .await
            .assert_answer(200, "cancelled");
        offered(&sidecar, "sale", head).await;
    }
    assert_waiting_at(&look(&sidecar, "sale", "f").await, 1);
    sidecar.assert_invariants("sale", 2);
    sidecar.shutdown().await;
}

/// An offer that expired while still pending leaves its entry back at the head of
/// the line and its marker `expired` (what `expire_if_due` leaves when the offer's
/// commit was slower than its hold). The next unit back is offered to that entry
/// afresh, and the line goes on; before, every offer to it heard the dead marker
/// and the line stood still for the rest of the sale.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offer_that_expired_while_pending_does_not_stop_the_line() {
    let sidecar = Sidecar::start().await;
    sidecar.seed("sale", spec(2)).await;
    hold_each(&sidecar, &["a", "b"]).await;
    join_each(&sidecar, &["c", "d"]).await;
    let keys = DropKeys::new(NS, "sale");
    let mut conn = sidecar.redis.connection().expect("connect");
    let sale: String = redis::cmd("HGET")
        .arg(keys.reservation("a"))
        .arg("sale")
        .query(&mut conn)
        .expect("HGET");
    redis::cmd("HSET")
        .arg(keys.reservation("c"))
        .arg(&[
            ("user", "c"),
            ("quantity", "1"),
            ("state", "expired"),
            ("expiresAt", "1"),
            ("sale", sale.as_str()),
            ("line", "1"),
            ("attempt", "dead"),
        ])
        .query::<()>(&mut conn)
        .expect("the expired offer's marker");

    for (holder, head) in [("a", "c"), ("b", "d")] {
        sidecar
            .settle("sale", holder, "cancel")
            .await
            .assert_answer(200, "cancelled");
        offered(&sidecar, "sale", head).await;
    }
    assert_eq!(
        ledger_line(&sidecar, "sale").await,
        ["c:offered", "d:offered"]
    );
    sidecar.assert_invariants("sale", 2);
    sidecar.shutdown().await;
}

/// An entry the ledger has served (its offer recorded) that Redis has back in
/// line, its marker dead (an offer Redis expired while pending whose commit
/// landed all the same): the ledger refuses a second offer under its key, and the
/// entry leaves the line in Redis too instead of standing at its head for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_the_ledger_served_leaves_the_line_in_redis_too() {
    let sidecar = Sidecar::start().await;
    sidecar.seed("sale", spec(2)).await;
    hold_each(&sidecar, &["a", "b"]).await;
    join(&sidecar, "sale", "c", "c", 1)
        .await
        .assert_answer(201, "waiting");
    sidecar
        .settle("sale", "a", "cancel")
        .await
        .assert_answer(200, "cancelled");
    offered(&sidecar, "sale", "c").await;
    // c gives its unit back; the line is empty, so it is anyone's.
    sidecar
        .settle("sale", "c", "cancel")
        .await
        .assert_answer(200, "cancelled");
    // Redis has c back in line at its place, its marker dead.
    let keys = DropKeys::new(NS, "sale");
    let mut conn = sidecar.redis.connection().expect("connect");
    redis::pipe()
        .cmd("HSET")
        .arg(keys.reservation("c"))
        .arg("state")
        .arg("expired")
        .cmd("HSET")
        .arg(keys.waitlist_entry("c"))
        .arg("state")
        .arg("waiting")
        .cmd("ZADD")
        .arg(keys.waitlist_line(""))
        .arg(1)
        .arg("c")
        .cmd("HINCRBY")
        .arg(keys.waitlist_users())
        .arg("c")
        .arg(1)
        .query::<()>(&mut conn)
        .expect("c back in line");

    // The sweeper meets c at the head with a unit free: the ledger says c was
    // served, and Redis follows; then the unit is anyone's again.
    let mut late = sidecar.reserve("sale", "late", "z", 1).await;
    for _ in 0..100 {
        if late.status.as_u16() == 201 {
            break;
        }
        late.assert_answer(409, "sold_out");
        tokio::time::sleep(Duration::from_millis(50)).await;
        late = sidecar.reserve("sale", "late", "z", 1).await;
    }
    late.assert_answer(201, "admitted");
    look(&sidecar, "sale", "c")
        .await
        .assert_answer(200, "offered");
    assert_eq!(ledger_line(&sidecar, "sale").await, ["c:offered"]);
    sidecar.assert_invariants("sale", 2);
    sidecar.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_line_waits_through_the_fallback_gate_and_keeps_its_order() {
    through_the_fallback(Sidecar::start().await).await;
    // The same on a shared PostgreSQL ledger.
    let postgres = dropgate_testkit::PostgresServer::start().expect("PostgreSQL");
    through_the_fallback(Sidecar::start_with_database(Some(postgres.url())).await).await;
}

async fn through_the_fallback(sidecar: Sidecar) {
    sidecar.seed("sale", spec(2)).await;
    hold_each(&sidecar, &["a", "b"]).await;
    join_each(&sidecar, &["c", "d"]).await;
    // The kill switch: the ledger decides; the line is kept, and waits.
    sidecar.seed("sale", spec(2).kill_switch()).await;
    // (Once this sidecar read it: a reserve is then decided by the ledger.)
    let mut probe = sidecar.reserve("sale", "probe", "p", 1).await;
    for _ in 0..50 {
        if path_of(&probe) == "fallback" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        probe = sidecar.reserve("sale", "probe", "p", 1).await;
    }
    probe.assert_answer(409, "sold_out");
    join(&sidecar, "sale", "e", "e", 1)
        .await
        .assert_answer(503, "unavailable");
    // A unit back on the fallback is still the line's: nobody else gets it.
    let cancelled = sidecar.settle("sale", "a", "cancel").await;
    cancelled.assert_answer(200, "cancelled");
    assert_eq!(path_of(&cancelled), "fallback");
    let sold_out = sidecar.reserve("sale", "late", "z", 1).await;
    sold_out.assert_answer(409, "sold_out");
    assert_eq!(path_of(&sold_out), "fallback");

    // Back on the gate: the head is served, in order.
    sidecar.seed("sale", spec(2)).await;
    offered(&sidecar, "sale", "c").await;
    assert_waiting_at(&look(&sidecar, "sale", "d").await, 1);
    sidecar
        .reserve("sale", "late-2", "z", 1)
        .await
        .assert_answer(409, "sold_out");
    sidecar.assert_invariants("sale", 2);
    sidecar.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restock_goes_to_the_line_first() {
    let sidecar = Sidecar::start().await;
    sidecar.seed("sale", spec(1)).await;
    sidecar
        .reserve("sale", "a", "a", 1)
        .await
        .assert_answer(201, "admitted");
    join_each(&sidecar, &["b", "c", "d"]).await;
    // Two more units: the first two in line get them, the third still waits and
    // keeps the next reserve out.
    sidecar.seed("sale", spec(3)).await;
    offered(&sidecar, "sale", "b").await;
    offered(&sidecar, "sale", "c").await;
    assert_waiting_at(&look(&sidecar, "sale", "d").await, 1);
    sidecar
        .reserve("sale", "late", "z", 1)
        .await
        .assert_answer(409, "sold_out");
    sidecar.assert_invariants("sale", 3);
    sidecar.shutdown().await;
}
