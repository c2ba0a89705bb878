//! Confirm and cancel on behalf of a buyer: `{"user"}` in their body must name the
//! reservation's buyer, or the answer is 409 `not_owner` and nothing changes, on
//! the Redis gate and on the ledger's fallback gate alike.

mod common;

use common::Sidecar;
use dropgate_testkit::{DropSpec, Reply};

/// The drop every case sells, as seeded for one gate.
type Spec = fn() -> DropSpec;

/// The two gates a sidecar sells through: the drop as seeded on each.
const GATES: [(&str, Spec); 2] = [
    ("gate", || DropSpec::new(5).per_user_limit(2)),
    ("fallback", || {
        DropSpec::new(5).per_user_limit(2).kill_switch()
    }),
];

/// `op` (`confirm` or `cancel`) of reservation `key` with `body`.
async fn settle_with(sidecar: &Sidecar, key: &str, op: &str, body: &str) -> Reply {
    sidecar
        .http
        .post(&format!("/v1/drops/sale/reservations/{key}/{op}"), body)
        .await
        .expect("answers")
}

/// The reservation's state and the drop's stock, as the API reads them.
async fn standing(sidecar: &Sidecar, key: &str) -> (String, i64) {
    let reservation = sidecar.lookup("sale", key).await;
    let drop = sidecar.http.get("/v1/drops/sale").await.expect("answers");
    (
        reservation.body["state"]
            .as_str()
            .unwrap_or("none")
            .to_string(),
        drop.body["remaining"].as_i64().unwrap_or(-1),
    )
}

/// Asks `op` of `key` with `body`, expects `status` and `outcome`, and that the
/// reservation and the stock read as before.
async fn refused_unchanged(
    sidecar: &Sidecar,
    gate: &str,
    key: &str,
    op: &str,
    body: &str,
    (status, outcome): (u16, &str),
) {
    let before = standing(sidecar, key).await;
    let reply = settle_with(sidecar, key, op, body).await;
    reply.assert_answer_because(status, outcome, &format!("{gate}: {op} {body}"));
    assert!(
        status != 409 || reply.text.contains("nothing was changed"),
        "{gate}: {}",
        reply.text
    );
    assert_eq!(
        standing(sidecar, key).await,
        before,
        "{gate}: a refused {op} ({body}) changed something"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_buyer_neither_confirms_nor_cancels_a_reservation() {
    for (gate, spec) in GATES {
        let sidecar = Sidecar::start().await;
        sidecar.seed("sale", spec()).await;
        sidecar
            .reserve("sale", "a", "alice", 1)
            .await
            .assert_answer(201, "admitted");
        let not_owner = (409, "not_owner");
        refused_unchanged(
            &sidecar,
            gate,
            "a",
            "confirm",
            r#"{"user":"bob"}"#,
            not_owner,
        )
        .await;
        refused_unchanged(
            &sidecar,
            gate,
            "a",
            "cancel",
            r#"{"user":"bob"}"#,
            not_owner,
        )
        .await;

        settle_with(&sidecar, "a", "confirm", r#"{"user":"alice"}"#)
            .await
            .assert_answer_because(200, "confirmed", gate);
        // A refund asked by another buyer is refused as well.
        refused_unchanged(
            &sidecar,
            gate,
            "a",
            "cancel",
            r#"{"user":"bob"}"#,
            not_owner,
        )
        .await;
        settle_with(&sidecar, "a", "confirm", r#"{"user":"alice"}"#)
            .await
            .assert_answer_because(200, "already_confirmed", gate);
        sidecar.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_buyer_named_settles_as_without_a_user() {
    for (gate, spec) in GATES {
        let sidecar = Sidecar::start().await;
        sidecar.seed("sale", spec()).await;
        for key in ["a", "b"] {
            sidecar
                .reserve("sale", key, "alice", 1)
                .await
                .assert_answer(201, "admitted");
        }
        settle_with(&sidecar, "a", "cancel", r#"{"user":"alice"}"#)
            .await
            .assert_answer_because(200, "cancelled", gate);
        settle_with(&sidecar, "a", "cancel", r#"{"user":"alice"}"#)
            .await
            .assert_answer_because(200, "already_cancelled", gate);
        // An empty body, or whitespace, is a call without a user.
        settle_with(&sidecar, "b", "confirm", " \n")
            .await
            .assert_answer_because(200, "confirmed", gate);
        assert_eq!(standing(&sidecar, "b").await, ("confirmed".into(), 4));
        sidecar.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_not_found_is_not_found_and_stays_free() {
    for (gate, spec) in GATES {
        let sidecar = Sidecar::start().await;
        sidecar.seed("sale", spec()).await;
        settle_with(&sidecar, "later", "confirm", r#"{"user":"alice"}"#)
            .await
            .assert_answer_because(404, "not_found", gate);
        sidecar
            .reserve("sale", "later", "bob", 1)
            .await
            .assert_answer(201, "admitted");
        sidecar.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_body_is_refused_and_changes_nothing() {
    for (gate, spec) in GATES {
        let sidecar = Sidecar::start().await;
        sidecar.seed("sale", spec()).await;
        sidecar
            .reserve("sale", "a", "alice", 1)
            .await
            .assert_answer(201, "admitted");
        for (body, says) in [
            (r#"{"user":5}"#, "`user` must be a string"),
            (r#"{"user":""}"#, "user"),
            (r#"{"owner":"alice"}"#, "unknown field `owner`"),
            (r#"{"user":"alice","user":"bob"}"#, "not valid JSON"),
            ("not json", "not valid JSON"),
            ("[]", "JSON object"),
        ] {
            for op in ["confirm", "cancel"] {
                let before = standing(&sidecar, "a").await;
                let reply = settle_with(&sidecar, "a", op, body).await;
                reply.assert_answer_because(400, "invalid", &format!("{gate}: {op} {body}"));
                assert!(reply.text.contains(says), "{gate}: {body}: {}", reply.text);
                assert_eq!(standing(&sidecar, "a").await, before, "{gate}: {op} {body}");
            }
        }
        assert_eq!(standing(&sidecar, "a").await, ("active".into(), 4));
        sidecar.shutdown().await;
    }
}
