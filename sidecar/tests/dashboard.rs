//! The chart's Grafana dashboard queries only metrics the code really exports: each
//! `dropgate_*` name in its queries is checked against a live sidecar's `/metrics`
//! (after a little selling) and the operator's registry.

mod common;

use std::collections::BTreeSet;

use common::Sidecar;
use dropgate_testkit::DropSpec;

const DASHBOARD: &str = include_str!("../../charts/dropgate/files/dashboard.json");

/// Every series name an OpenMetrics text exposes: sample names, and the names
/// declared by `# TYPE` lines.
fn exported(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        if let Some(declared) = line.strip_prefix("# TYPE ") {
            let mut parts = declared.split_whitespace();
            if let (Some(name), Some(kind)) = (parts.next(), parts.next()) {
                let suffixes: &[&str] = match kind {
                    "counter" => &["_total"],
                    "histogram" => &["_bucket", "_sum", "_count"],
                    _ => &[""],
                };
                for suffix in suffixes {
                    names.insert(format!("{name}{suffix}"));
                }
            }
        } else if !line.starts_with('#') {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            names.insert(line[..end].to_string());
        }
    }
    names
}

/// The `dropgate_*` metric names the dashboard's queries use.
fn queried() -> BTreeSet<String> {
    let dashboard: serde_json::Value =
        serde_json::from_str(DASHBOARD).expect("the dashboard is JSON");
    let mut exprs = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            exprs.push(target["expr"].as_str().expect("expr").to_string());
        }
    }
    exprs.push(
        dashboard["templating"]["list"][1]["query"]
            .as_str()
            .expect("the drop variable's query")
            .to_string(),
    );
    let mut names = BTreeSet::new();
    for expr in exprs {
        let mut rest = expr.as_str();
        while let Some(at) = rest.find("dropgate_") {
            let tail = &rest[at..];
            let end = tail
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(tail.len());
            names.insert(tail[..end].to_string());
            rest = &tail[end..];
        }
    }
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_dashboard_query_reads_an_exported_metric() {
    let sidecar = Sidecar::start().await;
    sidecar.seed("sale", DropSpec::new(3)).await;
    for i in 0..5 {
        let key = format!("k{i}");
        sidecar.reserve("sale", &key, &key, 1).await;
    }
    sidecar.settle("sale", "k0", "confirm").await;
    // The per-drop gauges are set by the background refresh and sweep: wait for
    // them (a few ticks) before judging.
    let queried = queried();
    let mut text = String::new();
    for _ in 0..50 {
        text = sidecar.http.get("/metrics").await.expect("/metrics").text;
        if ["remaining", "drop_mode", "throttle_permits_in_use"]
            .iter()
            .all(|name| text.contains(&format!("dropgate_sidecar_{name}{{")))
        {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let mut available = exported(&text);
    // An empty family encodes nothing: the operator's registry with one sample each.
    let operator = dropgate_operator::metrics::Metrics::default();
    operator
        .errors
        .get_or_create(&dropgate_operator::metrics::ErrorLabel { error: "redis" })
        .inc();
    available.extend(exported(
        &operator.encode().expect("the operator's metrics encode"),
    ));

    assert!(queried.len() >= 8, "the dashboard queries {queried:?}");
    let missing: Vec<&String> = queried.difference(&available).collect();
    assert!(
        missing.is_empty(),
        "the dashboard queries metrics nothing exports: {missing:?}\nexported: {available:?}"
    );
    // The per-drop series carry the drop, so the dashboard's drop filter works.
    assert!(
        text.contains(r#"drop="sale""#),
        "no per-drop series in:\n{text}"
    );
    sidecar.shutdown().await;
}
