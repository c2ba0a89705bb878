//! The flash sale, smaller, against the debug binaries: the command lines, the HTTP
//! API and the invariants, end to end through real processes.

use dropgate_e2e::flash_sale::{Options, run};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_thousand_buyers_never_oversell() {
    let options = Options {
        manifest: concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/drop.yaml").into(),
        buyers: 1000,
        concurrency: 300,
        ..Options::default()
    };
    let summary = run(&options).await.expect("the sale runs");
    println!("{summary}");
    assert_eq!(summary.violations(), Vec::<String>::new());
    assert_eq!(summary.oversold, 0);
    assert_eq!(summary.remaining, 0, "1000 buyers empty 100 units");
    assert!(summary.sold_out > 0);
    assert!(
        summary.retries_absorbed > 0,
        "duplicates were sent and absorbed"
    );
}
