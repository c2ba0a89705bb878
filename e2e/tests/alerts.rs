//! The chart's alerts (charts/dropgate/files/prometheus-rules.yaml) against what the
//! binaries export: every metric an alert's expression reads is one a live sidecar
//! (after a sale's first calls) or the operator exports, every label value it
//! matches on is one they write, and every alert has its runbook in
//! docs/operating.md.

use std::collections::BTreeSet;

use dropgate_e2e::processes::{SidecarProcess, apply, sale_manifest};
use dropgate_testkit::{DropSpec, HttpClient, RedisServer};

fn repo(path: &str) -> String {
    let full = format!("{}/../{path}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{full}: {e}"))
}

/// Each alert's name and expression.
fn alerts() -> Vec<(String, String)> {
    let rules: serde_json::Value =
        serde_norway::from_str(&repo("charts/dropgate/files/prometheus-rules.yaml"))
            .expect("the rules file is YAML");
    let mut out = Vec::new();
    for group in rules["groups"].as_array().expect("groups") {
        for rule in group["rules"].as_array().expect("rules") {
            let name = rule["alert"].as_str().expect("an alert name").to_string();
            let expr = rule["expr"].as_str().expect("an expression").to_string();
            assert!(
                rule["annotations"]["runbook_url"].is_string(),
                "{name}: no runbook_url"
            );
            out.push((name, expr));
        }
    }
    out
}

/// The metric names an expression reads (`dropgate_...`), as their families are
/// named: without the `_total`, `_bucket`, `_sum` and `_count` of their samples.
fn metrics_in(expr: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while let Some(at) = expr[i..].find("dropgate_") {
        let start = i + at;
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_lowercase() || bytes[end] == b'_') {
            end += 1;
        }
        let name = &expr[start..end];
        let family = ["_total", "_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| name.strip_suffix(suffix))
            .unwrap_or(name);
        names.insert(family.to_string());
        i = end;
    }
    names
}

/// The families a Prometheus text exposition declares (`# TYPE name kind`).
fn families(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .filter_map(|rest| rest.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_alert_reads_metrics_the_binaries_export_and_has_a_runbook() {
    let redis = RedisServer::start().expect("redis-server");
    let dir = tempfile::tempdir().expect("dir");
    let manifest = sale_manifest(dir.path(), &DropSpec::new(5).yaml()).expect("manifest");
    apply(&manifest, &redis.url()).expect("apply");
    let ledger = format!("sqlite://{}", dir.path().join("ledger.db").display());
    let sidecar = SidecarProcess::start(&redis.url(), "shop", &ledger)
        .await
        .expect("the sidecar starts");
    let http = HttpClient::new(sidecar.base.clone());
    http.post(
        "/v1/drops/sale/reservations",
        r#"{"key":"k","user":"u","quantity":1}"#,
    )
    .await
    .expect("a reserve answers")
    .assert_answer(201, "admitted");
    // The refresh notes the drop's mode and what it has left.
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let scraped = http.get("/metrics").await.expect("/metrics answers").text;
    // A labelled family is exposed once it has a series: the operator's errors after
    // its first failed reconcile.
    let metrics = dropgate_operator::metrics::Metrics::default();
    metrics
        .errors
        .get_or_create(&dropgate_operator::metrics::ErrorLabel { error: "redis" })
        .inc();
    // And the HA condition's series after a drop's first status.
    metrics.set_high_availability("shop", "sale", Some("Unknown"));
    let operator = metrics.encode().expect("the operator's metrics encode");
    let exported: BTreeSet<String> = families(&scraped)
        .into_iter()
        .chain(families(&operator))
        .collect();

    let runbooks = repo("docs/operating.md");
    for (name, expr) in alerts() {
        let read = metrics_in(&expr);
        assert!(!read.is_empty(), "{name} reads no dropgate metric: {expr}");
        for metric in &read {
            assert!(
                exported.contains(metric),
                "{name} reads {metric}, which no binary exports; they export {exported:?}"
            );
        }
        assert!(
            runbooks.contains(&format!("### {name}")),
            "{name} has no runbook (### {name}) in docs/operating.md"
        );
    }
    // The label values the HA alert matches, as the operator writes them.
    assert!(
        operator.contains(r#"dropgate_operator_drop_high_availability{drop_namespace="shop",drop="sale",status="Unknown"} 1"#),
        "{operator}"
    );
    // A sidecar that reaches Redis says so.
    assert!(
        scraped.contains("dropgate_sidecar_redis_up 1"),
        "the sidecar reports Redis up: {scraped}"
    );
    // The label values the mode alerts match are the ones the sidecar writes.
    assert!(
        scraped.contains(r#"mode="gate""#),
        "the sidecar writes drop_mode with mode=\"gate\": {scraped}"
    );
    let modes = repo("charts/dropgate/files/prometheus-rules.yaml");
    for mode in ["fail-open", "closed"] {
        assert!(modes.contains(&format!(r#"mode="{mode}""#)));
        assert!(
            dropgate_api::Mode::parse(mode).is_some(),
            "{mode} is not a mode the drops' config names"
        );
    }
}
