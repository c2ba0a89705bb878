//! Every bad input is refused with a message naming the field, and changes nothing.

mod common;

use common::Sidecar;
use dropgate_testkit::DropSpec;

#[tokio::test]
async fn every_bad_input_is_refused_and_changes_nothing() {
    let sidecar = Sidecar::start().await;
    sidecar
        .seed("sale", DropSpec::new(10).per_user_limit(5))
        .await;
    assert_eq!(
        sidecar.reserve("sale", "held", "alice", 1).await.status,
        201
    );
    let before = sidecar.snapshot();
    let long = "x".repeat(257);
    let reserve = "/v1/drops/sale/reservations";

    // (path, body, status, outcome, a word the message must contain)
    let table: Vec<(String, String, u16, &str, &str)> = vec![
        (reserve.into(), "{not json".into(), 400, "invalid", "JSON"),
        (reserve.into(), "".into(), 400, "invalid", "JSON"),
        (reserve.into(), "[]".into(), 400, "invalid", "object"),
        (
            reserve.into(),
            r#"{"key":"k","user":"u","quantity":1,"coupon":"x"}"#.into(),
            400,
            "invalid",
            "coupon",
        ),
        (
            reserve.into(),
            r#"{"user":"u","quantity":1}"#.into(),
            400,
            "invalid",
            "key",
        ),
        (
            reserve.into(),
            r#"{"key":"k","quantity":1}"#.into(),
            400,
            "invalid",
            "user",
        ),
        (
            reserve.into(),
            r#"{"key":"k","user":"u"}"#.into(),
            400,
            "invalid",
            "quantity",
        ),
        (
            reserve.into(),
            r#"{"key":"k","user":"u","quantity":true}"#.into(),
            400,
            "invalid",
            "quantity",
        ),
        (
            reserve.into(),
            r#"{"key":"k","user":"u","quantity":1.5}"#.into(),
            400,
            "invalid",
            "quantity",
        ),
        (
            reserve.into(),
            r#"{"key":"k","user":"u","quantity":2.0}"#.into(),
            400,
            "invalid",
            "quantity",
        ),
        (
            reserve.into(),
            r#"{"key":"k","user":"u","quantity":"1"}"#.into(),
            400,
            "invalid",
            "quantity",
        ),
        (
            reserve.into(),
            r#"{"key":"k","user":"u","quantity":0}"#.into(),
            400,
            "invalid",
            "quantity",
        ),
        (
            reserve.into(),
            r#"{"key":"k","user":"u","quantity":-3}"#.into(),
            400,
            "invalid",
            "quantity",
        ),
        (
            reserve.into(),
            r#"{"key":"k","user":"u","quantity":2147483648}"#.into(),
            400,
            "invalid",
            "quantity",
        ),
        (
            reserve.into(),
            r#"{"key":"k","user":"u","quantity":99999999999999999999999}"#.into(),
            400,
            "invalid",
            "quantity",
        ),
        (
            reserve.into(),
            r#"{"key":"k","user":"u","quantity":null}"#.into(),
            400,
            "invalid",
            "quantity",
        ),
        (
            reserve.into(),
            r#"{"key":"","user":"u","quantity":1}"#.into(),
            400,
            "invalid",
            "key",
        ),
        (
            reserve.into(),
            r#"{"key":"k","user":"","quantity":1}"#.into(),
            400,
            "invalid",
            "user",
        ),
        (
            reserve.into(),
            r#"{"key":1,"user":"u","quantity":1}"#.into(),
            400,
            "invalid",
            "key",
        ),
        (
            reserve.into(),
            r#"{"key":"k","user":["u"],"quantity":1}"#.into(),
            400,
            "invalid",
            "user",
        ),
        (
            reserve.into(),
            format!(r#"{{"key":"{long}","user":"u","quantity":1}}"#),
            400,
            "invalid",
            "key",
        ),
        (
            reserve.into(),
            format!(r#"{{"key":"k","user":"{long}","quantity":1}}"#),
            400,
            "invalid",
            "user",
        ),
        (
            "/v1/drops/nope/reservations".into(),
            r#"{"key":"k","user":"u","quantity":1}"#.into(),
            404,
            "not_found",
            "nope",
        ),
        (
            "/v1/drops/Bad_Name/reservations".into(),
            r#"{"key":"k","user":"u","quantity":1}"#.into(),
            404,
            "not_found",
            "Bad_Name",
        ),
        (
            format!("/v1/drops/sale/reservations/{long}/confirm"),
            "".into(),
            400,
            "invalid",
            "key",
        ),
        (
            format!("/v1/drops/sale/reservations/{long}/cancel"),
            "".into(),
            400,
            "invalid",
            "key",
        ),
        (
            "/v1/drops/nope/reservations/held/confirm".into(),
            "".into(),
            404,
            "not_found",
            "nope",
        ),
        (
            "/v1/drops/nope/reservations/held/cancel".into(),
            "".into(),
            404,
            "not_found",
            "nope",
        ),
        (
            reserve.into(),
            r#"{"key":"k\u0000","user":"u","quantity":1}"#.into(),
            400,
            "invalid",
            "control characters",
        ),
        (
            reserve.into(),
            r#"{"key":"k","user":"u\u001b","quantity":1}"#.into(),
            400,
            "invalid",
            "`user`",
        ),
        (
            reserve.into(),
            r#"{"key":"k","user":"u","quantity":1,"quantity":9}"#.into(),
            400,
            "invalid",
            "twice",
        ),
        (
            "/v1/drops/sale/reservations/k%00/confirm".into(),
            "".into(),
            400,
            "invalid",
            "control characters",
        ),
        (
            "/v1/drops//reservations".into(),
            r#"{"key":"k","user":"u","quantity":1}"#.into(),
            400,
            "invalid",
            "empty segment",
        ),
        (
            "/v1/drops/sale/reservations//confirm".into(),
            "".into(),
            400,
            "invalid",
            "empty segment",
        ),
    ];
    for (path, body, status, outcome, word) in table {
        let reply = sidecar.http.post(&path, &body).await.expect("answers");
        let message = reply.body["message"].as_str().unwrap_or("");
        reply.assert_answer_because(status, outcome, &format!("{path} {body}"));
        assert!(
            message.contains(word),
            "{path} {body}: message {message:?} names {word}"
        );
        assert_eq!(sidecar.snapshot(), before, "{path} {body} changed Redis");
    }

    let unknown = sidecar.http.get("/v1/drops/nope").await.expect("answers");
    unknown.assert_answer(404, "not_found");
    let route = sidecar.http.get("/v2/whatever").await.expect("answers");
    route.assert_answer(404, "not_found");
    // A path no route has is 404 whatever the method; a known path with a method
    // it does not take is 405.
    let route = sidecar
        .http
        .post("/v2/whatever", "{}")
        .await
        .expect("answers");
    route.assert_answer(404, "not_found");
    let wrong = sidecar.http.post("/healthz", "").await.expect("answers");
    assert_eq!(wrong.status.as_u16(), 405, "{}", wrong.text);
    assert_eq!(sidecar.snapshot(), before);
}

/// PostgreSQL refuses a NUL in text: a key with one must be refused before it
/// reaches the ledger, not answered 503 (and not send the group commit's whole
/// batch back to one commit per change).
#[tokio::test]
async fn a_control_character_is_refused_before_the_shared_ledger() {
    let postgres = dropgate_testkit::PostgresServer::start().expect("postgres");
    let sidecar = Sidecar::start_with_database(Some(postgres.url())).await;
    sidecar.seed("sale", DropSpec::new(10)).await;
    let reply = sidecar
        .http
        .post(
            "/v1/drops/sale/reservations",
            r#"{"key":"nul\u0000key","user":"u","quantity":1}"#,
        )
        .await
        .expect("answers");
    reply.assert_answer(400, "invalid");
    assert_eq!(sidecar.reserve("sale", "fine", "u", 1).await.status, 201);
}
