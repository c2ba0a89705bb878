//! What the buyer hears matches what was recorded: a 201 is durable even when Redis
//! fails right after the ledger's commit, and a hold that a look-up found past its
//! deadline is expired once, recorded with its event, and its permit freed at once.
//! One test: the fault points are process-wide.

mod common;

use std::time::Duration;

use common::{Peer, marker_state, seed};
use dropgate_sidecar::faults::{self, Fault};
use dropgate_testkit::{DropSpec, RedisServer};

/// This file's drops: one permit, so a hold that lapses frees the only one.
fn spec(hold_seconds: i64) -> DropSpec {
    DropSpec::new(10)
        .per_user_limit(1)
        .hold_seconds(hold_seconds)
        .permits(1)
        .acquire_timeout_ms(20)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn answers_match_the_record() {
    let redis = RedisServer::start().expect("redis-server");
    let dir = tempfile::tempdir().expect("dir");
    let database = format!("sqlite://{}", dir.path().join("ledger.db").display());
    // No sweeper: whatever expires a hold here is a request that noticed it.
    let sidecar = Peer::start_custom(&redis.url(), &database, |s| s.sweep_ms = 600_000).await;
    let ledger = dropgate_sidecar::ledger::Ledger::open(&database)
        .await
        .expect("ledger");
    let states = async || -> std::collections::HashMap<String, String> {
        use sqlx::Row;
        sqlx::query("SELECT res_key, state FROM reservations")
            .fetch_all(ledger.pool())
            .await
            .expect("query")
            .iter()
            .map(|row| (row.get::<String, _>(0), row.get::<String, _>(1)))
            .collect()
    };

    // Redis fails between the ledger's commit and the activation: the admission is
    // durable, so the buyer hears 201, and the refresh replays it into Redis.
    seed(&redis.url(), "durable", spec(600)).await;
    faults::arm(Fault::AfterLedgerCommit, 1);
    let admitted = sidecar.reserve("durable", "a", "alice", 1).await;
    assert_eq!(admitted.status, 201, "{}", admitted.text);
    assert_eq!(states().await["a"], "active");
    let mut state = None;
    for _ in 0..80 {
        state = marker_state(&redis, "durable", "a");
        if state.as_deref() == Some("active") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(
        state.as_deref(),
        Some("active"),
        "Redis caught up from the ledger"
    );
    assert_eq!(
        sidecar.settle("durable", "a", "confirm").await.outcome(),
        "confirmed"
    );

    // The hold lapses; a look-up notices. It answers expired, records the expiry
    // with its event, and frees the permit: the next buyer gets in at once.
    seed(&redis.url(), "brief", spec(3)).await;
    assert_eq!(sidecar.reserve("brief", "b", "bob", 1).await.status, 201);
    let busy = sidecar.reserve("brief", "c", "carol", 1).await;
    assert_eq!(busy.outcome(), "throttled", "one permit: {}", busy.text);
    tokio::time::sleep(Duration::from_millis(3100)).await;
    let reply = sidecar.lookup("brief", "b").await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    assert_eq!(reply.body["state"], "expired");
    assert_eq!(states().await["b"], "expired");
    let next = sidecar.reserve("brief", "c", "carol", 1).await;
    assert_eq!(next.status, 201, "the permit was freed: {}", next.text);
    let events: Vec<String> = sqlx::query_scalar("SELECT event_id FROM outbox ORDER BY id")
        .fetch_all(ledger.pool())
        .await
        .expect("events");
    assert_eq!(
        events
            .iter()
            .filter(|id| id.ends_with("/b/expired"))
            .count(),
        1,
        "{events:?}"
    );
    sidecar.shutdown().await;

    // As above, Redis fails between the ledger's commit and the activation (the buyer
    // hears 201), and nothing
    // replays the record (no refresh, no sweep) before the hold ends: the hold's end
    // expires the pending marker, unsure whether it was made. The retry of its key
    // asks the ledger, which has it: a reservation that was made and has ended.
    let quiet = Peer::start_custom(&redis.url(), &database, |s| {
        s.sweep_ms = 600_000;
        s.refresh_ms = 600_000;
    })
    .await;
    seed(&redis.url(), "made", spec(3)).await;
    faults::arm(Fault::AfterLedgerCommit, 1);
    let admitted = quiet.reserve("made", "d", "dave", 1).await;
    assert_eq!(admitted.status, 201, "{}", admitted.text);
    assert_eq!(
        marker_state(&redis, "made", "d").as_deref(),
        Some("pending")
    );
    tokio::time::sleep(Duration::from_millis(3100)).await;
    let mut gate = common::AsTheSalesLedger::of(&redis.url(), "made").await;
    dropgate_sidecar::gate::expire(&mut gate.conn, &gate.keys, &gate.ledger, "d")
        .await
        .expect("the expiry");
    assert_eq!(
        marker_state(&redis, "made", "d").as_deref(),
        Some("expired")
    );
    let retried = quiet.reserve("made", "d", "dave", 1).await;
    retried.assert_answer(200, "already_reserved");
    assert_eq!(retried.body["state"], "expired", "{}", retried.text);
    assert_eq!(
        gate.marker_field("d", "unsure").await,
        None,
        "no longer in doubt"
    );
    quiet.shutdown().await;
}
