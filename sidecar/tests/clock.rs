//! A sidecar on a machine whose clock is ten minutes fast judges what it judges
//! itself (permit release, the fallback's sale window) by Redis's clock, as the
//! gate does. The skew is process-wide, so this file holds one test.

mod common;

use std::time::Duration;

use common::Sidecar;
use dropgate_sidecar::faults;
use dropgate_testkit::DropSpec;

const TEN_MINUTES_MS: i64 = 10 * 60 * 1000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fast_clock_decides_nothing_the_gate_would_not() {
    faults::skew_clock(TEN_MINUTES_MS);

    // The gate: a one-minute hold keeps its permit for a minute of Redis's time,
    // not until this machine's clock passes the deadline (at once).
    let sidecar = Sidecar::start().await;
    sidecar
        .seed(
            "sale",
            DropSpec::new(10)
                .hold_seconds(60)
                .permits(1)
                .acquire_timeout_ms(20),
        )
        .await;
    assert_eq!(sidecar.reserve("sale", "a", "alice", 1).await.status, 201);
    tokio::time::sleep(Duration::from_millis(500)).await; // several sweeps
    let b = sidecar.reserve("sale", "b", "bob", 1).await;
    b.assert_answer(503, "throttled");
    assert_eq!(
        sidecar.lookup("sale", "a").await.body["state"],
        "active",
        "not expired by the fast clock"
    );
    sidecar.shutdown().await;

    // The fallback: a sale that opens in five minutes of Redis's time is not open,
    // although this machine's clock says it opened five minutes ago.
    let sidecar = Sidecar::start().await;
    let opens = jiff::Timestamp::now() + jiff::SignedDuration::from_mins(5);
    sidecar
        .seed("later", DropSpec::new(10).starts_at(opens).kill_switch())
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await; // a refresh measured the offset
    let early = sidecar.reserve("later", "e", "eve", 1).await;
    early.assert_answer(403, "not_open");
    sidecar.shutdown().await;
    faults::skew_clock(0);
}
