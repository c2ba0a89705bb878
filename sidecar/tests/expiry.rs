//! Hold expiry against confirms: exactly one wins, and Redis, the ledger and the
//! answer agree on which.

mod common;

use std::time::Duration;

use common::Sidecar;
use dropgate_api::DropKeys;
use dropgate_testkit::DropSpec;
use futures::future::join_all;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_confirm_racing_the_expiry_has_exactly_one_winner() {
    let sidecar = Sidecar::start().await;
    sidecar
        .seed(
            "sale",
            DropSpec::new(40)
                .per_user_limit(1)
                .hold_seconds(3)
                .permits(1000)
                .acquire_timeout_ms(50),
        )
        .await;
    let ledger = common::ledger_of(&sidecar).await;
    for i in 0..40 {
        assert_eq!(
            sidecar
                .reserve("sale", &format!("r{i}"), &format!("u{i}"), 1)
                .await
                .status,
            201
        );
    }
    // Confirm each right around its deadline, while the sweeper runs.
    tokio::time::sleep(Duration::from_millis(2900)).await;
    let replies = join_all((0..40).map(|i| {
        let sidecar = &sidecar;
        async move {
            tokio::time::sleep(Duration::from_millis(i * 5)).await;
            sidecar.settle("sale", &format!("r{i}"), "confirm").await
        }
    }))
    .await;
    let mut confirmed = 0;
    for (i, reply) in replies.iter().enumerate() {
        match reply.outcome() {
            "confirmed" => confirmed += 1,
            "expired" => assert_eq!(reply.status, 409),
            other => panic!("r{i}: {other}: {}", reply.text),
        }
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let recorded = common::ledger_states(&ledger).await;
    for (i, reply) in replies.iter().enumerate() {
        let want = if reply.outcome() == "confirmed" {
            "confirmed"
        } else {
            "expired"
        };
        assert_eq!(
            recorded[&format!("r{i}")],
            want,
            "r{i}: the ledger agrees with the answer"
        );
        assert_eq!(
            sidecar.lookup("sale", &format!("r{i}")).await.body["state"],
            want
        );
    }
    assert_eq!(sidecar.held("sale"), confirmed);
    sidecar.assert_invariants("sale", 40);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_of_the_due_set_without_a_hold_never_stop_the_sweep() {
    let sidecar = Sidecar::start().await;
    sidecar.seed("sale", DropSpec::new(5).hold_seconds(3)).await;
    // 300 due entries whose markers are gone (lived out their TTL, say): more than
    // one sweep takes at a time, all ahead of the real hold.
    let mut conn = sidecar.redis.connection().expect("connect");
    let holds = DropKeys::new(common::NS, "sale").holds();
    for i in 0..300 {
        let _: () = redis::cmd("ZADD")
            .arg(&holds)
            .arg(i)
            .arg(format!("gone-{i}"))
            .query(&mut conn)
            .expect("ZADD");
    }
    assert_eq!(sidecar.reserve("sale", "k", "alice", 1).await.status, 201);
    assert_eq!(sidecar.remaining("sale"), 4);
    let mut returned = false;
    for _ in 0..140 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        if sidecar.remaining("sale") == 5 {
            returned = true;
            break;
        }
    }
    assert!(
        returned,
        "the sweeper reached the real hold and returned its unit"
    );
    // The entries without a marker stay (Redis may still count their units; the
    // ledger's repair settles them), out of the sweep's way.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as i64;
    let due: i64 = redis::cmd("ZCOUNT")
        .arg(&holds)
        .arg("-inf")
        .arg(now)
        .query(&mut conn)
        .expect("ZCOUNT");
    assert_eq!(due, 0, "nothing due blocks the next sweep");
}

/// Redis evicted a hold's marker (a `volatile-*` memory policy) but still counts
/// its unit: the ledger's repair, past the hold's deadline and its grace, replays
/// the expiry and the unit comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicted_marker_gets_its_unit_back_through_the_ledger_repair() {
    let sidecar = Sidecar::start().await;
    sidecar.seed("sale", DropSpec::new(1).hold_seconds(3)).await;
    assert_eq!(sidecar.reserve("sale", "a", "alice", 1).await.status, 201);
    let mut conn = sidecar.redis.connection().expect("connect");
    let _: () = redis::cmd("DEL")
        .arg(DropKeys::new(common::NS, "sale").reservation("a"))
        .query(&mut conn)
        .expect("DEL");
    // The deadline (3 s) and the repair's grace (30 s) pass.
    let mut sold = false;
    for _ in 0..90 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        if sidecar.reserve("sale", "b", "bob", 1).await.status == 201 {
            sold = true;
            break;
        }
    }
    assert!(sold, "the unit came back and was sold again");
    sidecar.assert_invariants("sale", 1);
}
