//! What the buyer hears matches what was recorded: a 201 is durable even when Redis
//! fails right after the ledger's commit, and a hold that a look-up found past its
//! deadline is expired once, recorded with its event, and its permit freed at once.
//! One test: the fault points are process-wide.

mod common;

use std::time::Duration;

use common::Sidecar;
use dropgate_sidecar::faults::{self, Fault};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn answers_match_the_record() {
    let sidecar = Sidecar::start().await;
    sidecar
        .seed(
            "sale",
            "  sku: X\n  limitedQuantity: 10\n  perUserLimit: 1\n  holdSeconds: 1\n  throttle: {permits: 1, acquireTimeoutMs: 20}\n",
        )
        .await;
    let ledger = common::ledger_of(&sidecar).await;

    // Redis fails between the ledger's commit and the activation: the admission is
    // durable, so the buyer hears 201, and Redis catches up from the ledger.
    faults::arm(Fault::AfterLedgerCommit, 1);
    let admitted = sidecar.reserve("sale", "a", "alice", 1).await;
    assert_eq!(admitted.status, 201, "{}", admitted.text);
    assert_eq!(common::ledger_states(&ledger).await["a"], "active");
    let marker = format!("dropgate:{{{}/sale}}:res:a", common::NS);
    let mut conn = sidecar.redis.connection().expect("connect");
    let mut active = false;
    for _ in 0..40 {
        let state: Option<String> = redis::cmd("HGET")
            .arg(&marker)
            .arg("state")
            .query(&mut conn)
            .expect("HGET");
        if state.as_deref() != Some("pending") {
            active = state.as_deref() == Some("active") || state.as_deref() == Some("expired");
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(
        active,
        "the refresh replayed the recorded admission into Redis"
    );

    // The hold lapses; a look-up notices first. It answers expired, records the
    // expiry with its event, and frees the permit: the next buyer gets in at once.
    let mut state = String::new();
    for _ in 0..60 {
        let reply = sidecar.lookup("sale", "a").await;
        state = reply.body["state"].as_str().unwrap_or("").to_string();
        if state == "expired" {
            assert_eq!(reply.status, 200, "{}", reply.text);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(state, "expired");
    assert_eq!(common::ledger_states(&ledger).await["a"], "expired");
    let next = sidecar.reserve("sale", "b", "bob", 1).await;
    assert_eq!(next.status, 201, "the permit was freed: {}", next.text);
    let events: Vec<String> = sqlx::query_scalar("SELECT event_id FROM outbox ORDER BY id")
        .fetch_all(ledger.pool())
        .await
        .expect("events");
    assert_eq!(
        events
            .iter()
            .filter(|id| id.ends_with("/a/expired"))
            .count(),
        1,
        "{events:?}"
    );
    sidecar.assert_invariants("sale", 10);
}
