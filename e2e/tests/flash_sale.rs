//! The flash sale, smaller, against the debug binaries: the command lines, the HTTP
//! API and the invariants, end to end through real processes.

use dropgate_e2e::flash_sale::{Options, Summary, run};

/// A thousand buyers, 300 in flight, for the example `manifest`: the summary, once
/// it was printed and found to break no invariant.
async fn sale_of(manifest: &str) -> Summary {
    sale(manifest, false).await
}

/// One sale at a time: four at once on two cores turn the debug sidecars' ledger
/// answers into 503s (busy), which tests the client's retries more than the sale.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Same, the buyers checking out through carts when `carts`.
async fn sale(manifest: &str, carts: bool) -> Summary {
    let _turn = ONE_AT_A_TIME.lock().await;
    let options = Options {
        manifest: format!("{}/../examples/{manifest}", env!("CARGO_MANIFEST_DIR")).into(),
        buyers: 1000,
        concurrency: 300,
        carts,
        ..Options::default()
    };
    let summary = run(&options).await.expect("the sale runs");
    println!("{summary}");
    assert_eq!(summary.violations(), Vec::<String>::new());
    summary
}

/// Demand far beyond supply leaves nothing unsold but units returned by a cancel
/// (one returned after the last buyer who wanted it had been answered stays).
fn assert_sold_through(name: &str, remaining: i64, cancelled: u64) {
    assert!(
        (0..=cancelled as i64).contains(&remaining),
        "{name}: {remaining} left, only returned units ({cancelled} cancelled) may be"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_thousand_buyers_never_oversell() {
    let summary = sale_of("drop.yaml").await;
    assert_eq!(summary.oversold, 0);
    assert_sold_through("the drop", summary.remaining, summary.cancelled);
    assert!(summary.sold_out > 0);
    assert!(
        summary.retries_absorbed > 0,
        "duplicates were sent and absorbed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_release_in_four_sizes_sells_each_size_exactly_once() {
    let summary = sale_of("drop-sizes.yaml").await;
    assert_eq!(summary.variants.len(), 4);
    for size in &summary.variants {
        assert_sold_through(&size.name, size.remaining, size.cancelled);
        assert_eq!(size.oversold, 0, "{size:?}");
        assert_eq!(size.held, size.confirmed as i64, "{size:?}");
    }
    assert_sold_through("the drop", summary.remaining, summary.cancelled);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn buyers_checking_out_through_carts_sell_each_size_exactly_once() {
    let summary = sale("drop-sizes.yaml", true).await;
    assert_eq!(summary.variants.len(), 4);
    for size in &summary.variants {
        assert_eq!(size.oversold, 0, "{size:?}");
        assert_eq!(size.held, size.confirmed as i64, "{size:?}");
    }
    for size in &summary.variants {
        assert_sold_through(&size.name, size.remaining, size.cancelled);
    }
    assert!(
        summary.retries_absorbed > 0,
        "duplicate carts were absorbed"
    );
}

/// With a waitlist, the buyers turned away wait in line: the units that come back
/// once the line formed go to it, served in order, and nothing is left unsold.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn returned_units_go_to_the_waiting_buyers_in_order() {
    let options = Options {
        manifest: format!("{}/../examples/drop.yaml", env!("CARGO_MANIFEST_DIR")).into(),
        buyers: 1000,
        concurrency: 300,
        waitlist: true,
        ..Options::default()
    };
    let _turn = ONE_AT_A_TIME.lock().await;
    let summary = run(&options).await.expect("the sale runs");
    println!("{summary}");
    assert_eq!(summary.violations(), Vec::<String>::new());
    let waitlist = summary.waitlist.expect("a waitlist summary");
    assert!(waitlist.joined > 0, "{waitlist:?}");
    // Units come back by cancels and by throttled admissions taken back; one
    // returned before anyone waited was anyone's, once the line formed the line's.
    assert!(waitlist.offered > 0, "{waitlist:?}");
    assert_eq!(waitlist.out_of_order, 0);
    assert_eq!(summary.remaining, 0);
    assert_eq!(summary.oversold, 0);
}
