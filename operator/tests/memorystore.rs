//! The real Memorystore client against a local server that answers like the
//! Memorystore API and the GCE metadata server.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use dropgate_api::Tier;
use dropgate_api::drop::MemorystoreInstance;
use dropgate_operator::memorystore::Memorystore;
use warp::Filter;
use warp::http::StatusCode;

const TOKEN: &str = "ya29.test-token";

/// Serves the fake Google endpoints on a free port.
async fn fake_google() -> SocketAddr {
    let token = warp::path!(
        "computeMetadata" / "v1" / "instance" / "service-accounts" / "default" / "token"
    )
    .and(warp::header::optional::<String>("metadata-flavor"))
    .map(|flavor: Option<String>| {
        if flavor.as_deref() == Some("Google") {
            warp::reply::with_status(
                format!(r#"{{"access_token":"{TOKEN}","expires_in":3599,"token_type":"Bearer"}}"#),
                StatusCode::OK,
            )
        } else {
            warp::reply::with_status("missing Metadata-Flavor".to_string(), StatusCode::FORBIDDEN)
        }
    });
    let instance = warp::path!("v1" / "projects" / String / "locations" / String / "instances" / String)
        .and(warp::header::optional::<String>("authorization"))
        .then(|_project: String, _location: String, name: String, auth: Option<String>| async move {
            if auth.as_deref() != Some(&format!("Bearer {TOKEN}")) {
                return Ok::<_, Infallible>(warp::reply::with_status("unauthenticated".to_string(), StatusCode::UNAUTHORIZED));
            }
            let instance = |tier: &str, state: &str| {
                format!(r#"{{"name":"projects/p/locations/l/instances/{name}","tier":"{tier}","state":"{state}","memorySizeGb":1,"replicaCount":1}}"#)
            };
            let (status, body) = match name.as_str() {
                "ha-ready" => (StatusCode::OK, instance("STANDARD_HA", "READY")),
                "ha-updating" => (StatusCode::OK, instance("STANDARD_HA", "UPDATING")),
                "basic" => (StatusCode::OK, instance("BASIC", "READY")),
                "denied" => (StatusCode::FORBIDDEN, r#"{"error":{"code":403}}"#.to_string()),
                "broken" => (StatusCode::INTERNAL_SERVER_ERROR, "oops".to_string()),
                "unavailable" => (StatusCode::SERVICE_UNAVAILABLE, "later".to_string()),
                "garbage" => (StatusCode::OK, "<html>not json</html>".to_string()),
                "no-tier" => (StatusCode::OK, r#"{"state":"READY"}"#.to_string()),
                "slow" => {
                    tokio::time::sleep(Duration::from_secs(3)).await;
                    (StatusCode::OK, instance("STANDARD_HA", "READY"))
                }
                _ => (StatusCode::NOT_FOUND, r#"{"error":{"code":404}}"#.to_string()),
            };
            Ok(warp::reply::with_status(body, status))
        });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(warp::serve(token.or(instance)).incoming(listener).run());
    addr
}

fn instance(name: &str) -> MemorystoreInstance {
    MemorystoreInstance {
        project: "my-proj".into(),
        location: "asia-northeast1".into(),
        instance: name.into(),
    }
}

#[tokio::test]
async fn every_answer_of_the_api_is_judged() {
    let addr = fake_google().await;
    let base = format!("http://{addr}");
    let client = Memorystore::new(&base, &base, Duration::from_millis(500));
    // (instance, tier, highly available, reason, a word of the message)
    let table = [
        (
            "ha-ready",
            Tier::StandardHa,
            true,
            "StandardHaReady",
            "READY",
        ),
        (
            "ha-updating",
            Tier::StandardHa,
            false,
            "InstanceNotReady",
            "UPDATING",
        ),
        ("basic", Tier::Basic, false, "BasicTier", "BASIC"),
        (
            "denied",
            Tier::Unknown,
            false,
            "MemorystoreAccessDenied",
            "403",
        ),
        (
            "missing",
            Tier::Unknown,
            false,
            "MemorystoreInstanceNotFound",
            "does not exist",
        ),
        ("broken", Tier::Unknown, false, "MemorystoreError", "500"),
        (
            "unavailable",
            Tier::Unknown,
            false,
            "MemorystoreError",
            "503",
        ),
        (
            "garbage",
            Tier::Unknown,
            false,
            "MemorystoreBadResponse",
            "not an instance",
        ),
        ("no-tier", Tier::Unknown, false, "UnknownTier", "none"),
        (
            "slow",
            Tier::Unknown,
            false,
            "MemorystoreUnreachable",
            "no answer within",
        ),
    ];
    for (name, tier, ha, reason, word) in table {
        let report = client.verify(&instance(name)).await;
        assert_eq!(report.tier, tier, "{name}: {report:?}");
        assert_eq!(report.is_highly_available(), ha, "{name}: {report:?}");
        assert_eq!(report.reason, reason, "{name}: {report:?}");
        assert!(report.message.contains(word), "{name}: {}", report.message);
    }
}

#[tokio::test]
async fn a_missing_metadata_server_is_reported_not_passed() {
    let api = fake_google().await;
    let closed = dropgate_testkit::free_port().expect("port");
    let client = Memorystore::new(
        &format!("http://{api}"),
        &format!("http://127.0.0.1:{closed}"),
        Duration::from_millis(500),
    );
    let report = client.verify(&instance("ha-ready")).await;
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
    let metadata = fake_google().await;
    let closed = dropgate_testkit::free_port().expect("port");
    let client = Memorystore::new(
        &format!("http://127.0.0.1:{closed}"),
        &format!("http://{metadata}"),
        Duration::from_millis(500),
    );
    let report = client.verify(&instance("ha-ready")).await;
    assert_eq!(report.reason, "MemorystoreUnreachable");
    assert!(!report.is_highly_available());
}
