//! A release in several sizes (docs/design.md, "Variants"), through the real HTTP API
//! against a real Redis and the sidecar's ledger, on the Redis gate and on the
//! ledger's fallback gate: each size sells exactly its quantity, the per-user limit
//! counts across sizes, restocks and cuts move one size, and a variant that does
//! not fit the drop is refused with nothing changed.

mod common;

use std::collections::{BTreeMap, HashMap};

use common::{NS, Sidecar};
use dropgate_api::DropKeys;
use dropgate_testkit::{DropSpec, Reply};
use futures::future::join_all;

const SIZES: [(&str, i64); 3] = [("US-9", 5), ("US-10", 12), ("US-11", 3)];

/// A drop in these sizes, with permits enough that the throttle never refuses.
fn in_sizes(sizes: &[(&str, i64)]) -> DropSpec {
    DropSpec::new(0).variants(sizes).permits(1000)
}

/// The drop these tests sell: three sizes, one pair per buyer unless told.
fn sneaker() -> DropSpec {
    in_sizes(&SIZES)
}

/// Buyers `<prefix>-<i>` for each i in `buyers`, one after another, each reserving
/// a pair of `size` and told `admitted`.
async fn admit_each(sidecar: &Sidecar, prefix: &str, buyers: std::ops::Range<usize>, size: &str) {
    for i in buyers {
        let key = format!("{prefix}-{i}");
        reserve_size(sidecar, &key, &key, Some(size))
            .await
            .assert_answer(201, "admitted");
    }
}

/// `n` buyers `<prefix>-<i>` at once, buyer i asking for `size_of(i)`: their
/// answers as `<size> <status> <outcome>`.
async fn race(
    sidecar: &Sidecar,
    prefix: &str,
    n: usize,
    size_of: impl Fn(usize) -> &'static str,
) -> Vec<String> {
    join_all((0..n).map(|i| {
        let size = size_of(i);
        async move {
            let key = format!("{prefix}-{i}");
            let reply = reserve_size(sidecar, &key, &key, Some(size)).await;
            format!("{size} {} {}", reply.status.as_u16(), reply.outcome())
        }
    }))
    .await
}

async fn reserve_size(sidecar: &Sidecar, key: &str, user: &str, size: Option<&str>) -> Reply {
    let variant = size.map_or(String::new(), |s| format!(r#","variant":"{s}""#));
    let body = format!(r#"{{"key":"{key}","user":"{user}","quantity":1{variant}}}"#);
    sidecar
        .http
        .post("/v1/drops/sale/reservations", &body)
        .await
        .expect("reserve answers")
}

/// The drop's variants hash: (remaining, held) per size.
fn variant_counts(sidecar: &Sidecar) -> HashMap<String, (i64, i64)> {
    let mut conn = sidecar.redis.connection().expect("connect");
    let fields: HashMap<String, i64> = redis::cmd("HGETALL")
        .arg(DropKeys::new(NS, "sale").variants())
        .query(&mut conn)
        .expect("HGETALL");
    let mut counts: HashMap<String, (i64, i64)> = HashMap::new();
    for (field, value) in fields {
        if let Some(name) = field.strip_prefix("r:") {
            counts.entry(name.into()).or_default().0 = value;
        } else if let Some(name) = field.strip_prefix("h:") {
            counts.entry(name.into()).or_default().1 = value;
        }
    }
    counts
}

/// The invariants per size, for a quiet drop: remaining + held = its quantity, and
/// its live reservations hold what its count says; and the drop's as a whole.
fn assert_sizes_add_up(sidecar: &Sidecar, sizes: &[(&str, i64)]) {
    let counts = variant_counts(sidecar);
    let keys = DropKeys::new(NS, "sale");
    let mut conn = sidecar.redis.connection().expect("connect");
    let markers: Vec<String> = redis::cmd("KEYS")
        .arg(keys.reservation_pattern())
        .query(&mut conn)
        .expect("KEYS");
    let mut live: HashMap<String, i64> = HashMap::new();
    for marker in markers {
        let (state, quantity, variant): (String, i64, Option<String>) = redis::cmd("HMGET")
            .arg(&marker)
            .arg("state")
            .arg("quantity")
            .arg("variant")
            .query(&mut conn)
            .expect("HMGET");
        if state == "active" || state == "confirmed" {
            *live
                .entry(variant.expect("a reservation of a drop with variants names one"))
                .or_default() += quantity;
        }
    }
    for (size, quantity) in sizes {
        let (remaining, held) = counts.get(*size).copied().unwrap_or_default();
        assert_eq!(
            remaining + held,
            *quantity,
            "{size}: remaining {remaining} + held {held}"
        );
        assert!(held <= *quantity, "{size} oversold: {held} of {quantity}");
        assert_eq!(
            live.get(*size).copied().unwrap_or(0),
            held,
            "{size}'s live reservations"
        );
    }
    sidecar.assert_invariants("sale", sizes.iter().map(|(_, q)| q).sum());
}

/// `n` buyers at once, buyer i asking for size `i % 3`; answers by size.
async fn rush(sidecar: &Sidecar, prefix: &str, n: usize) -> BTreeMap<String, Vec<String>> {
    let replies = join_all((0..n).map(|i| {
        let size = SIZES[i % SIZES.len()].0;
        async move {
            let key = format!("{prefix}-{i}");
            let reply = reserve_size(sidecar, &key, &key, Some(size)).await;
            (size, key, reply)
        }
    }))
    .await;
    let mut by_size: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (size, key, reply) in replies {
        by_size.entry(size.into()).or_default().push(format!(
            "{key} {} {}",
            reply.status.as_u16(),
            reply.outcome()
        ));
    }
    by_size
}

fn admitted(answers: &[String]) -> usize {
    answers
        .iter()
        .filter(|a| a.ends_with("201 admitted"))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_hundred_buyers_for_three_sizes_get_exactly_each_sizes_pairs() {
    let sidecar = Sidecar::start().await;
    sidecar.seed("sale", sneaker()).await;
    let by_size = rush(&sidecar, "b", 300).await;
    for (size, quantity) in SIZES {
        let answers = &by_size[size];
        assert_eq!(admitted(answers), quantity as usize, "{size}: {answers:?}");
        assert!(
            answers
                .iter()
                .all(|a| a.ends_with(" 201 admitted") || a.ends_with(" 409 sold_out")),
            "{size}: {answers:?}"
        );
    }
    assert_sizes_add_up(&sidecar, &SIZES);
    // The ledger counts each size as Redis does.
    let ledger = common::ledger_of(&sidecar).await;
    let key = sidecar.ledger_key("sale");
    let (_, recorded) = ledger.counts(&key).await.expect("reads");
    for (size, _) in SIZES {
        assert_eq!(
            recorded.get(size),
            Some(&0),
            "{size} in the ledger: {recorded:?}"
        );
    }
    let shown = sidecar.http.get("/v1/drops/sale").await.expect("answers");
    assert_eq!(shown.body["remaining"], 0);
    assert_eq!(
        shown.body["variants"],
        serde_json::json!([
            {"name": "US-9", "limit": 5, "remaining": 0},
            {"name": "US-10", "limit": 12, "remaining": 0},
            {"name": "US-11", "limit": 3, "remaining": 0},
        ])
    );
    sidecar.shutdown().await;
}

#[tokio::test]
async fn the_per_user_limit_counts_a_buyers_pairs_across_sizes() {
    let sidecar = Sidecar::start().await;
    sidecar.seed("sale", sneaker().per_user_limit(2)).await;
    reserve_size(&sidecar, "a-1", "alice", Some("US-9"))
        .await
        .assert_answer(201, "admitted");
    let second = reserve_size(&sidecar, "a-2", "alice", Some("US-10")).await;
    second.assert_answer(201, "admitted");
    assert_eq!(second.body["variant"], "US-10");
    reserve_size(&sidecar, "a-3", "alice", Some("US-11"))
        .await
        .assert_answer(409, "per_user_limit_exceeded");
    // A cancel gives the pair back to its own size, and the buyer one more pair.
    sidecar
        .settle("sale", "a-1", "cancel")
        .await
        .assert_answer(200, "cancelled");
    reserve_size(&sidecar, "a-3", "alice", Some("US-11"))
        .await
        .assert_answer(201, "admitted");
    assert_eq!(variant_counts(&sidecar)["US-9"], (5, 0));
    let found = sidecar.lookup("sale", "a-3").await;
    found.assert_answer(200, "found");
    assert_eq!(found.body["variant"], "US-11");
    sidecar.shutdown().await;
}

#[tokio::test]
async fn a_size_that_does_not_fit_the_drop_is_refused_and_changes_nothing() {
    let sidecar = Sidecar::start().await;
    sidecar.seed("sale", sneaker()).await;
    sidecar.seed("plain", DropSpec::new(3)).await;
    reserve_size(&sidecar, "warm", "warm", Some("US-9"))
        .await
        .assert_answer(201, "admitted");
    let before = sidecar.snapshot();

    let missing = reserve_size(&sidecar, "k1", "u1", None).await;
    missing.assert_answer(400, "invalid");
    assert!(missing.text.contains("`variant`"), "{}", missing.text);
    let unknown = reserve_size(&sidecar, "k2", "u2", Some("US-14")).await;
    unknown.assert_answer(404, "not_found");
    assert!(unknown.text.contains("US-14"), "{}", unknown.text);
    let bad_name = reserve_size(&sidecar, "k3", "u3", Some("US 9")).await;
    bad_name.assert_answer(400, "invalid");
    // The same key again with another size is another reservation: refused.
    reserve_size(&sidecar, "warm", "warm", Some("US-10"))
        .await
        .assert_answer(422, "idempotency_key_reused");
    assert_eq!(sidecar.snapshot(), before, "nothing changed");

    let body = r#"{"key":"p1","user":"u1","quantity":1,"variant":"US-9"}"#;
    let on_plain = sidecar
        .http
        .post("/v1/drops/plain/reservations", body)
        .await
        .expect("answers");
    on_plain.assert_answer(400, "invalid");
    assert_eq!(sidecar.remaining("plain"), 3);
    sidecar.shutdown().await;
}

#[tokio::test]
async fn a_restock_and_a_cut_of_one_size_move_only_that_size() {
    let sidecar = Sidecar::start().await;
    sidecar.seed("sale", sneaker()).await;
    admit_each(&sidecar, "n", 0..4, "US-9").await;
    // US-9 restocked by 3, US-10 cut to 2, US-11 removed from the spec.
    let changed = [("US-9", 8), ("US-10", 2)];
    sidecar.seed("sale", in_sizes(&changed)).await;
    let counts = variant_counts(&sidecar);
    assert_eq!(counts["US-9"], (4, 4));
    assert_eq!(counts["US-10"], (2, 0));
    assert_eq!(counts["US-11"].0, 0, "a removed size sells nothing more");
    reserve_size(&sidecar, "gone", "gone", Some("US-11"))
        .await
        .assert_answer(404, "not_found");
    let by_size = race(&sidecar, "late", 10, |_| "US-10").await;
    assert_eq!(admitted(&by_size), 2, "{by_size:?}");
    assert_sizes_add_up(&sidecar, &changed);
    sidecar.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_fallback_sells_sizes_with_the_same_answers() {
    let sidecar = Sidecar::start().await;
    sidecar
        .seed("sale", sneaker().per_user_limit(2).kill_switch())
        .await;
    let by_size = rush(&sidecar, "f", 90).await;
    for (size, quantity) in SIZES {
        let answers = &by_size[size];
        assert_eq!(admitted(answers), quantity as usize, "{size}: {answers:?}");
    }
    reserve_size(&sidecar, "f-x", "f-x", Some("US-14"))
        .await
        .assert_answer(404, "not_found");
    reserve_size(&sidecar, "f-y", "f-y", None)
        .await
        .assert_answer(400, "invalid");
    // A retry of a buyer the rush admitted a US-9 pair (which buyers won is the
    // race's to say).
    let winner = by_size["US-9"]
        .iter()
        .find(|a| a.ends_with("201 admitted"))
        .and_then(|a| a.split(' ').next())
        .expect("a US-9 pair was admitted")
        .to_string();
    let again = reserve_size(&sidecar, &winner, &winner, Some("US-9")).await;
    again.assert_answer(200, "already_reserved");
    assert_eq!(again.body["variant"], "US-9");
    assert_eq!(
        again
            .headers
            .get("dropgate-path")
            .and_then(|v| v.to_str().ok()),
        Some("fallback")
    );
    // A cancel on the fallback gives the pair back to its size: the next buyer of
    // that size gets it, and no other size gains one.
    sidecar
        .settle("sale", &winner, "cancel")
        .await
        .assert_answer(200, "cancelled");
    reserve_size(&sidecar, "f-z", "f-z", Some("US-9"))
        .await
        .assert_answer(201, "admitted");
    reserve_size(&sidecar, "f-w", "f-w", Some("US-11"))
        .await
        .assert_answer(409, "sold_out");
    let shown = sidecar.http.get("/v1/drops/sale").await.expect("answers");
    assert_eq!(shown.body["variants"][0]["remaining"], 0);

    // A restock of one size mid-sale, on the fallback: two more US-11, nothing else.
    let restocked = [("US-9", 5), ("US-10", 12), ("US-11", 5)];
    sidecar
        .seed(
            "sale",
            DropSpec::new(0)
                .variants(&restocked)
                .per_user_limit(2)
                .permits(1000)
                .kill_switch(),
        )
        .await;
    let late = race(&sidecar, "late", 6, |i| {
        if i % 2 == 0 { "US-11" } else { "US-10" }
    })
    .await;
    let admitted_late: Vec<&String> = late
        .iter()
        .filter(|a| a.ends_with("201 admitted"))
        .collect();
    assert_eq!(admitted_late.len(), 2, "{late:?}");
    assert!(
        admitted_late.iter().all(|a| a.starts_with("US-11")),
        "{late:?}"
    );
    sidecar.shutdown().await;
}

/// Mode switches and a rebuild carry the sizes forward: what the fallback sold of
/// each size is replayed into Redis when the gate reopens, and a Redis that lost
/// its data is rebuilt from the ledger size by size.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_kill_switch_both_ways_and_a_rebuild_keep_every_sizes_count() {
    let sidecar = Sidecar::start().await;
    sidecar.seed("sale", sneaker()).await;
    let on_gate = rush(&sidecar, "g", 15).await;
    sidecar.seed("sale", sneaker().kill_switch()).await;
    let on_fallback = rush(&sidecar, "f", 15).await;
    sidecar.seed("sale", sneaker()).await;
    let back = rush(&sidecar, "b", 60).await;
    for (size, quantity) in SIZES {
        let sold: usize = [&on_gate, &on_fallback, &back]
            .iter()
            .map(|answers| admitted(&answers[size]))
            .sum();
        assert_eq!(sold, quantity as usize, "{size}");
    }
    assert_sizes_add_up(&sidecar, &SIZES);

    // Redis loses everything; the operator publishes the drop again; the next
    // buyer's reserve finds Redis behind the ledger and it is rebuilt first.
    let mut conn = sidecar.redis.connection().expect("connect");
    redis::cmd("FLUSHALL")
        .query::<()>(&mut conn)
        .expect("FLUSHALL");
    sidecar.seed("sale", sneaker()).await;
    let after = rush(&sidecar, "after", 30).await;
    for (size, _) in SIZES {
        assert_eq!(
            admitted(&after[size]),
            0,
            "{size} was sold out: {:?}",
            after[size]
        );
    }
    assert_sizes_add_up(&sidecar, &SIZES);
    let counts = variant_counts(&sidecar);
    for (size, quantity) in SIZES {
        assert_eq!(
            counts[size],
            (0, quantity),
            "{size} rebuilt: every pair held"
        );
    }
    sidecar.shutdown().await;
}

/// Found in review: one size restocked against a cut of another (the same total,
/// with `apply -f`) reaches the ledger too, so the gate sells the restocked pairs and
/// the fallback sells no more of the cut size than its new quantity.
#[tokio::test]
async fn a_restock_of_one_size_against_a_cut_of_another_reaches_the_ledger() {
    let sidecar = Sidecar::start().await;
    let before = [("A", 5), ("B", 5)];
    sidecar.seed("sale", in_sizes(&before)).await;
    admit_each(&sidecar, "a", 0..5, "A").await;
    let after = [("A", 7), ("B", 3)];
    sidecar.seed("sale", in_sizes(&after)).await;
    admit_each(&sidecar, "a", 5..7, "A").await;
    reserve_size(&sidecar, "a-7", "a-7", Some("A"))
        .await
        .assert_answer(409, "sold_out");
    sidecar
        .seed(
            "sale",
            DropSpec::new(0)
                .variants(&after)
                .permits(1000)
                .kill_switch(),
        )
        .await;
    let on_fallback = race(&sidecar, "b", 5, |_| "B").await;
    assert_eq!(admitted(&on_fallback), 3, "{on_fallback:?}");
    sidecar.shutdown().await;
}

/// Found in review: a retry of a reservation whose size was since removed from the
/// drop hears what its key holds (its first answer may have been lost), and the
/// drop's page shows no size with more pairs than the drop has left.
#[tokio::test]
async fn a_retry_after_its_size_was_removed_hears_its_reservation() {
    let sidecar = Sidecar::start().await;
    let sizes = [("A", 2), ("B", 2)];
    sidecar.seed("sale", in_sizes(&sizes)).await;
    admit_each(&sidecar, "a", 0..2, "A").await;
    // A is removed while its two pairs are held: the drop's total is 2, and it has
    // none left until those are paid back.
    sidecar.seed("sale", in_sizes(&[("B", 2)])).await;
    let retry = reserve_size(&sidecar, "a-0", "a-0", Some("A")).await;
    retry.assert_answer(200, "already_reserved");
    assert_eq!(retry.body["variant"], "A");
    reserve_size(&sidecar, "new", "new", Some("A"))
        .await
        .assert_answer(404, "not_found");
    // The page shows the config this sidecar last read (refreshed every 100 ms).
    let mut shown = sidecar.http.get("/v1/drops/sale").await.expect("answers");
    for _ in 0..50 {
        if shown.body["limit"] == 2 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        shown = sidecar.http.get("/v1/drops/sale").await.expect("answers");
    }
    assert_eq!(shown.body["remaining"], 0);
    assert_eq!(
        shown.body["variants"],
        serde_json::json!([{"name": "B", "limit": 2, "remaining": 0}])
    );
    reserve_size(&sidecar, "b-0", "b-0", Some("B"))
        .await
        .assert_answer(409, "sold_out");
    // A's holds paid back, B sells.
    for i in 0..2 {
        sidecar
            .settle("sale", &format!("a-{i}"), "cancel")
            .await
            .assert_answer(200, "cancelled");
    }
    reserve_size(&sidecar, "b-0", "b-0", Some("B"))
        .await
        .assert_answer(201, "admitted");
    sidecar.shutdown().await;
}
