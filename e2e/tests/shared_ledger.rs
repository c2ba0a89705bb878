//! Two `dropgate-sidecar` processes on the fallback path with one PostgreSQL ledger
//! between them: together they never sell more than the drop holds.

use std::collections::HashMap;

use dropgate_e2e::processes::{SidecarProcess, apply, sale_manifest};
use dropgate_testkit::{DropSpec, HttpClient, PostgresServer, RedisServer};
use futures::future::join_all;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_sidecar_processes_share_postgresql_without_overselling() {
    let redis = RedisServer::start().expect("redis-server");
    let postgres = PostgresServer::start().expect("PostgreSQL");
    let dir = tempfile::tempdir().expect("dir");
    let manifest =
        sale_manifest(dir.path(), &DropSpec::new(20).kill_switch().yaml()).expect("manifest");
    let status = apply(&manifest, &redis.url()).expect("apply publishes fail-open");
    assert!(status.contains("mode: fail-open"), "{status}");

    let a = SidecarProcess::start(&redis.url(), "shop", &postgres.url())
        .await
        .expect("sidecar a");
    let b = SidecarProcess::start(&redis.url(), "shop", &postgres.url())
        .await
        .expect("sidecar b");
    let (http_a, http_b) = (
        HttpClient::new(a.base.clone()),
        HttpClient::new(b.base.clone()),
    );
    let replies = join_all((0..100).map(|i| {
        let http = if i % 2 == 0 {
            http_a.clone()
        } else {
            http_b.clone()
        };
        async move {
            let body = format!(r#"{{"key":"k{i}","user":"u{i}","quantity":1}}"#);
            http.post("/v1/drops/sale/reservations", &body)
                .await
                .expect("answers")
        }
    }))
    .await;
    let mut counts: HashMap<String, usize> = HashMap::new();
    for reply in &replies {
        assert_eq!(
            reply
                .headers
                .get("dropgate-path")
                .and_then(|v| v.to_str().ok()),
            Some("fallback"),
            "{}",
            reply.text
        );
        *counts.entry(reply.outcome().to_string()).or_default() += 1;
    }
    assert_eq!(counts.get("admitted"), Some(&20), "{counts:?}");
    assert_eq!(counts.get("sold_out"), Some(&80), "{counts:?}");
    for sidecar in [a, b] {
        assert!(sidecar.terminate().expect("stops").success());
    }
}
