//! Every kind of event a sale writes, on both gates, against the events' JSON
//! Schema (sidecar/events.schema.json): what a shop's consumers are promised.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::{NS, Sidecar};
use dropgate_api::DropKeys;
use dropgate_testkit::{DropSpec, openapi};
use serde_json::Value;

/// The payloads in drop `drop`'s event stream.
fn events(sidecar: &Sidecar, drop: &str) -> Vec<Value> {
    let mut conn = sidecar.redis.connection().expect("connect");
    let entries: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg(DropKeys::new(NS, drop).events())
        .arg("-")
        .arg("+")
        .query(&mut conn)
        .expect("XRANGE");
    entries
        .into_iter()
        .filter_map(|(_, fields)| {
            fields
                .into_iter()
                .find(|(name, _)| name == "payload")
                .map(|(_, payload)| serde_json::from_str(&payload).expect("a JSON payload"))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_a_sale_writes_matches_the_schema() {
    let sidecar = Sidecar::start().await;
    sidecar
        .seed(
            "sale",
            DropSpec::new(10)
                .per_user_limit(5)
                .hold_seconds(3)
                .max_hold_seconds(600),
        )
        .await;
    sidecar
        .seed(
            "sizes",
            DropSpec::new(4)
                .variants(&[("S", 2), ("M", 2)])
                .kill_switch(),
        )
        .await;
    sidecar
        .reserve("sale", "a", "alice", 3)
        .await
        .assert_answer(201, "admitted");
    sidecar
        .http
        .post("/v1/drops/sale/reservations/a/confirm", r#"{"quantity":2}"#)
        .await
        .expect("answers")
        .assert_answer(200, "confirmed");
    sidecar
        .reserve("sale", "b", "bob", 1)
        .await
        .assert_answer(201, "admitted");
    sidecar
        .settle("sale", "b", "cancel")
        .await
        .assert_answer(200, "cancelled");
    sidecar
        .reserve("sale", "c", "carol", 1)
        .await
        .assert_answer(201, "admitted");
    let later = jiff::Timestamp::now() + jiff::SignedDuration::from_secs(300);
    sidecar
        .http
        .post(
            "/v1/drops/sale/reservations/c/extend",
            &format!(r#"{{"expiresAt":"{later}"}}"#),
        )
        .await
        .expect("answers")
        .assert_answer(200, "extended");
    sidecar
        .reserve("sale", "d", "dave", 1)
        .await
        .assert_answer(201, "admitted");
    sidecar
        .http
        .post(
            "/v1/drops/sizes/reservations",
            r#"{"key":"s","user":"erin","quantity":1,"variant":"S"}"#,
        )
        .await
        .expect("answers")
        .assert_answer(201, "admitted");
    sidecar
        .settle("sizes", "s", "confirm")
        .await
        .assert_answer(200, "confirmed");

    // d expires within its 3 s hold; the dispatcher publishes within moments.
    let expected = 8 + 2;
    let mut published = Vec::new();
    for _ in 0..150 {
        published = events(&sidecar, "sale");
        published.extend(events(&sidecar, "sizes"));
        if published.len() >= expected {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(published.len(), expected, "events: {published:#?}");
    for event in &published {
        if let Err(broken) = openapi::check_event(event) {
            panic!("an event breaks sidecar/events.schema.json: {broken}");
        }
    }
    let kinds: BTreeSet<&str> = published
        .iter()
        .filter_map(|e| e["type"].as_str())
        .collect();
    assert_eq!(
        kinds,
        BTreeSet::from(["admitted", "confirmed", "cancelled", "expired", "extended"])
    );
    let has = |field: &str| published.iter().any(|e| e.get(field).is_some());
    assert!(has("variant") && has("released") && has("expiresAt"));
    assert!(published.iter().any(|e| e["path"] == "fallback"));
    assert!(published.iter().all(|e| e["schemaVersion"] == 1));
    sidecar.shutdown().await;
}
