//! The real Memorystore client against a local server that answers like the
//! Memorystore API and the GCE metadata server.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use dropgate_api::Tier;
use dropgate_api::drop::MemorystoreInstance;
use dropgate_operator::ha::Verdict;
use dropgate_operator::memorystore::Memorystore;
use warp::Filter;
use warp::http::StatusCode;

/// The fake metadata server hands out `ya29.token-1`, `ya29.token-2`, ...: a new
/// token each time one is asked for, and every one of them is valid except where
/// an instance says otherwise.
fn token(n: usize) -> String {
    format!("ya29.token-{n}")
}

/// Calls the fake Memorystore API answered.
#[derive(Clone, Default)]
struct Calls(Arc<AtomicUsize>);

/// The port the instance `live` serves (STANDARD_HA, READY); 0: the API answers
/// 503 for it.
static LIVE_PORT: AtomicUsize = AtomicUsize::new(0);

/// Serves the fake Google endpoints on a free port.
async fn fake_google() -> (SocketAddr, Calls) {
    let issued = Arc::new(AtomicUsize::new(0));
    let metadata = warp::path!(
        "computeMetadata" / "v1" / "instance" / "service-accounts" / "default" / "token"
    )
    .and(warp::header::optional::<String>("metadata-flavor"))
    .map(move |flavor: Option<String>| {
        if flavor.as_deref() == Some("Google") {
            let n = issued.fetch_add(1, Ordering::SeqCst) + 1;
            warp::reply::with_status(
                format!(
                    r#"{{"access_token":"{}","expires_in":3599,"token_type":"Bearer"}}"#,
                    token(n)
                ),
                StatusCode::OK,
            )
        } else {
            warp::reply::with_status("missing Metadata-Flavor".to_string(), StatusCode::FORBIDDEN)
        }
    });
    let calls = Calls::default();
    let counter = calls.0.clone();
    let instance = warp::path!("v1" / "projects" / String / "locations" / String / "instances" / String)
        .and(warp::header::optional::<String>("authorization"))
        .then(move |_project: String, _location: String, name: String, auth: Option<String>| {
            counter.fetch_add(1, Ordering::SeqCst);
            async move {
            let bearer = auth.unwrap_or_default();
            // "rotated" revokes the first token, as a rotation before its expiry would.
            if !bearer.starts_with("Bearer ya29.token-") || (name == "rotated" && bearer == format!("Bearer {}", token(1))) {
                return Ok::<_, Infallible>(warp::reply::with_status("unauthenticated".to_string(), StatusCode::UNAUTHORIZED));
            }
            let instance = |tier: &str, state: &str, host: &str| {
                format!(r#"{{"name":"projects/p/locations/l/instances/{name}","tier":"{tier}","state":"{state}","host":"{host}","port":6379,"memorySizeGb":1,"replicaCount":1}}"#)
            };
            let live = LIVE_PORT.load(Ordering::SeqCst);
            let (status, body) = match name.as_str() {
                "live" if live == 0 => (StatusCode::SERVICE_UNAVAILABLE, "later".to_string()),
                "live" => (StatusCode::OK, instance("STANDARD_HA", "READY", "127.0.0.1").replace("6379", &live.to_string())),
                "ha-ready" | "rotated" => (StatusCode::OK, instance("STANDARD_HA", "READY", "127.0.0.1")),
                "elsewhere" => (StatusCode::OK, instance("STANDARD_HA", "READY", "10.9.9.9")),
                "ha-updating" => (StatusCode::OK, instance("STANDARD_HA", "UPDATING", "127.0.0.1")),
                "basic" => (StatusCode::OK, instance("BASIC", "READY", "127.0.0.1")),
                "denied" => (StatusCode::FORBIDDEN, r#"{"error":{"code":403}}"#.to_string()),
                "broken" => (StatusCode::INTERNAL_SERVER_ERROR, "oops".to_string()),
                "unavailable" => (StatusCode::SERVICE_UNAVAILABLE, "later".to_string()),
                "quota" => (StatusCode::TOO_MANY_REQUESTS, "slow down".to_string()),
                "garbage" => (StatusCode::OK, "<html>not json</html>".to_string()),
                "no-tier" => (StatusCode::OK, r#"{"state":"READY","host":"127.0.0.1","port":6379}"#.to_string()),
                "slow" => {
                    tokio::time::sleep(Duration::from_secs(3)).await;
                    (StatusCode::OK, instance("STANDARD_HA", "READY", "127.0.0.1"))
                }
                _ => (StatusCode::NOT_FOUND, r#"{"error":{"code":404}}"#.to_string()),
            };
            Ok(warp::reply::with_status(body, status))
            }
        });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let cluster = warp::path!("v1" / "projects" / String / "locations" / String / "clusters" / String)
        .and(warp::header::optional::<String>("authorization"))
        .map(|_project: String, _location: String, name: String, auth: Option<String>| {
            if !auth.unwrap_or_default().starts_with("Bearer ya29.token-") {
                return warp::reply::with_status("unauthenticated".to_string(), StatusCode::UNAUTHORIZED);
            }
            let cluster = |state: &str, replicas: u32, address: &str| {
                format!(
                    r#"{{"name":"projects/p/locations/l/clusters/{name}","state":"{state}","shardCount":3,"replicaCount":{replicas},"discoveryEndpoints":[{{"address":"{address}","port":6379,"pscConfig":{{"network":"projects/p/global/networks/default"}}}}]}}"#
                )
            };
            let (status, body) = match name.as_str() {
                "active" => (StatusCode::OK, cluster("ACTIVE", 1, "127.0.0.1")),
                "no-replicas" => (StatusCode::OK, cluster("ACTIVE", 0, "127.0.0.1")),
                "scaling" => (StatusCode::OK, cluster("UPDATING", 1, "127.0.0.1")),
                "elsewhere" => (StatusCode::OK, cluster("ACTIVE", 1, "10.9.9.9")),
                "garbage" => (StatusCode::OK, r#"{"state": 7}"#.to_string()),
                "broken" => (StatusCode::INTERNAL_SERVER_ERROR, "oops".to_string()),
                _ => (StatusCode::NOT_FOUND, r#"{"error":{"code":404}}"#.to_string()),
            };
            warp::reply::with_status(body, status)
        });
    tokio::spawn(
        warp::serve(metadata.or(instance).or(cluster))
            .incoming(listener)
            .run(),
    );
    (addr, calls)
}

/// The drop's Redis URL the instances are compared with.
const REDIS: &str = "redis://127.0.0.1:6379";

fn instance(name: &str) -> MemorystoreInstance {
    MemorystoreInstance {
        project: "my-proj".into(),
        location: "asia-northeast1".into(),
        instance: name.into(),
    }
}

#[tokio::test]
async fn every_answer_of_the_api_is_judged() {
    let (addr, _) = fake_google().await;
    let base = format!("http://{addr}");
    let client = Memorystore::new(&base, &base, Duration::from_millis(500));
    use Verdict::{HighlyAvailable as Ha, NotHighlyAvailable as NotHa, Unknown};
    // (instance, tier, verdict, reason, a word of the message). Only an answer about
    // the instance is a verdict; a call that failed is Unknown.
    let table = [
        ("ha-ready", Tier::StandardHa, Ha, "StandardHaReady", "READY"),
        ("rotated", Tier::StandardHa, Ha, "StandardHaReady", "READY"),
        (
            "ha-updating",
            Tier::StandardHa,
            NotHa,
            "InstanceNotReady",
            "UPDATING",
        ),
        ("basic", Tier::Basic, NotHa, "BasicTier", "BASIC"),
        (
            "elsewhere",
            Tier::Unknown,
            NotHa,
            "InstanceMismatch",
            "does not serve the drop's Redis 127.0.0.1:6379",
        ),
        (
            "missing",
            Tier::Unknown,
            NotHa,
            "MemorystoreInstanceNotFound",
            "does not exist",
        ),
        (
            "denied",
            Tier::Unknown,
            Unknown,
            "MemorystoreAccessDenied",
            "403",
        ),
        ("broken", Tier::Unknown, Unknown, "MemorystoreError", "500"),
        (
            "unavailable",
            Tier::Unknown,
            Unknown,
            "MemorystoreError",
            "503",
        ),
        ("quota", Tier::Unknown, Unknown, "MemorystoreError", "429"),
        (
            "garbage",
            Tier::Unknown,
            Unknown,
            "MemorystoreBadResponse",
            "not an instance",
        ),
        ("no-tier", Tier::Unknown, Unknown, "UnknownTier", "none"),
        (
            "slow",
            Tier::Unknown,
            Unknown,
            "MemorystoreUnreachable",
            "no answer within",
        ),
    ];
    for (name, tier, verdict, reason, word) in table {
        let report = client.verify(&instance(name), REDIS).await;
        assert_eq!(report.tier, tier, "{name}: {report:?}");
        assert_eq!(report.verdict, verdict, "{name}: {report:?}");
        assert_eq!(report.reason, reason, "{name}: {report:?}");
        assert!(report.message.contains(word), "{name}: {}", report.message);
        // Another instance's addresses are never shown to whoever made the drop.
        assert!(
            !report.message.contains("10.9.9.9"),
            "{name}: {}",
            report.message
        );
    }
}

#[tokio::test]
async fn every_answer_about_a_cluster_is_judged() {
    let (addr, _) = fake_google().await;
    let base = format!("http://{addr}");
    let client = Memorystore::new(&base, &base, Duration::from_millis(500));
    use Verdict::{HighlyAvailable as Ha, NotHighlyAvailable as NotHa, Unknown};
    // (cluster, tier, verdict, reason, a word of the message).
    let table = [
        (
            "active",
            Tier::Replicated,
            Ha,
            "ClusterReplicated",
            "3 shards",
        ),
        (
            "no-replicas",
            Tier::Standalone,
            NotHa,
            "ClusterShardWithoutReplica",
            "replicaCount 0",
        ),
        (
            "scaling",
            Tier::Unknown,
            NotHa,
            "ClusterNotActive",
            "UPDATING",
        ),
        (
            "elsewhere",
            Tier::Unknown,
            NotHa,
            "InstanceMismatch",
            "does not serve the drop's Redis 127.0.0.1:6379",
        ),
        (
            "missing",
            Tier::Unknown,
            NotHa,
            "MemorystoreClusterNotFound",
            "does not exist",
        ),
        (
            "garbage",
            Tier::Unknown,
            Unknown,
            "MemorystoreBadResponse",
            "not a cluster",
        ),
        ("broken", Tier::Unknown, Unknown, "MemorystoreError", "500"),
    ];
    for (name, tier, verdict, reason, word) in table {
        let report = client.verify_cluster(&instance(name), REDIS).await;
        assert_eq!(
            (report.tier, report.verdict, report.reason),
            (tier, verdict, reason),
            "cluster {name}: {}",
            report.message
        );
        assert!(
            report.message.contains(word),
            "cluster {name}: {}",
            report.message
        );
        assert!(
            report.message.contains("/clusters/"),
            "names the cluster: {}",
            report.message
        );
    }
}

#[tokio::test]
async fn a_verdict_is_reused_for_a_minute_and_a_failed_call_is_not() {
    let (addr, calls) = fake_google().await;
    let base = format!("http://{addr}");
    let client = Memorystore::new(&base, &base, Duration::from_millis(500));
    for _ in 0..3 {
        assert!(
            client
                .verify(&instance("ha-ready"), REDIS)
                .await
                .is_highly_available()
        );
    }
    assert_eq!(
        calls.0.load(Ordering::SeqCst),
        1,
        "one call for three checks"
    );
    // The same instance for another Redis URL is another question.
    let report = client
        .verify(&instance("ha-ready"), "redis://127.0.0.1:6380")
        .await;
    assert_eq!(report.reason, "InstanceMismatch");
    // The drop's own address is named, never the instance's.
    assert!(
        report.message.contains("127.0.0.1:6380"),
        "{}",
        report.message
    );
    assert!(!report.message.contains(":6379"), "{}", report.message);
    assert_eq!(calls.0.load(Ordering::SeqCst), 2);
    for _ in 0..2 {
        assert!(
            !client
                .verify(&instance("unavailable"), REDIS)
                .await
                .is_verified()
        );
    }
    assert_eq!(
        calls.0.load(Ordering::SeqCst),
        4,
        "an unanswered check is asked again"
    );
}

#[tokio::test]
async fn a_host_name_for_the_instance_address_is_the_same_redis() {
    let (addr, _) = fake_google().await;
    let base = format!("http://{addr}");
    let client = Memorystore::new(&base, &base, Duration::from_millis(500));
    let report = client
        .verify(&instance("ha-ready"), "rediss://:secret@localhost:6379/0")
        .await;
    assert!(report.is_highly_available(), "{report:?}");
}

#[tokio::test]
async fn a_missing_metadata_server_is_reported_not_passed() {
    let (api, _) = fake_google().await;
    let closed = dropgate_testkit::free_port().expect("port");
    let client = Memorystore::new(
        &format!("http://{api}"),
        &format!("http://127.0.0.1:{closed}"),
        Duration::from_millis(500),
    );
    let report = client.verify(&instance("ha-ready"), REDIS).await;
    assert!(!report.is_highly_available());
    assert_eq!(report.reason, "MetadataServerUnavailable");
    assert!(
        report.message.contains("metadata server"),
        "{}",
        report.message
    );
}

#[tokio::test]
async fn an_unreachable_api_is_reported_not_passed() {
    let (metadata, _) = fake_google().await;
    let closed = dropgate_testkit::free_port().expect("port");
    let client = Memorystore::new(
        &format!("http://127.0.0.1:{closed}"),
        &format!("http://{metadata}"),
        Duration::from_millis(500),
    );
    let report = client.verify(&instance("ha-ready"), REDIS).await;
    assert_eq!(report.reason, "MemorystoreUnreachable");
    assert!(!report.is_highly_available());
}

#[tokio::test]
async fn a_redis_host_that_does_not_resolve_is_no_verdict() {
    let (addr, _) = fake_google().await;
    let base = format!("http://{addr}");
    let client = Memorystore::new(&base, &base, Duration::from_millis(500));
    let report = client
        .verify(&instance("ha-ready"), "redis://redis-primary.invalid:6379")
        .await;
    assert_eq!(
        (report.verdict, report.reason),
        (Verdict::Unknown, "RedisHostUnresolved"),
        "{report:?}"
    );
}

#[tokio::test]
async fn apply_keeps_the_published_mode_when_the_check_goes_unanswered() {
    let redis = dropgate_testkit::RedisServer::start().expect("redis");
    let (addr, _) = fake_google().await;
    let base = format!("http://{addr}");
    let manifest = "apiVersion: dropgate.io/v1alpha1\nkind: InventoryDrop\nmetadata: {name: sale, namespace: shop}\nspec:\n  sku: X\n  limitedQuantity: 5\n  redis: {requireHighAvailability: true, memorystore: {project: my-proj, location: asia-northeast1, instance: live}}\n  gate: {failurePolicy: Closed}\n";
    LIVE_PORT.store(usize::from(redis.port()), Ordering::SeqCst);
    // A fresh client each time, as each `apply` run is a fresh process.
    let apply = || async {
        let client = Memorystore::new(&base, &base, Duration::from_millis(500));
        dropgate_operator::apply::apply(manifest, Some(&redis.url()), &client)
            .await
            .expect("applies")
    };
    let first = apply().await;
    assert_eq!(first.status.mode, Some(dropgate_api::Mode::Gate));
    assert!(first.not_ready.is_none());
    LIVE_PORT.store(0, Ordering::SeqCst);
    let blip = apply().await;
    assert_eq!(
        blip.status.mode,
        Some(dropgate_api::Mode::Gate),
        "a 503 closes nothing"
    );
    let why = blip.not_ready.map(|e| e.to_string()).unwrap_or_default();
    assert!(why.contains("could not check"), "{why}");
}
