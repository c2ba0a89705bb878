//! Traces over OTLP, as a collector receives them: a local OTLP/HTTP receiver
//! decodes the protobuf the real binaries send.
//!
//! One reserve is one server span that continues the caller's W3C trace, with the
//! gate script, the throttle wait and the ledger commit as its children; a lock's
//! acquire is a span with its attempts and fence; `apply` is a reconcile span with
//! the drop, the mode and the HA verdict, its Memorystore call a client span whose
//! trace the API hears in `traceparent`. With no endpoint set, nothing is sent.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dropgate_e2e::processes::{SidecarProcess, apply, binary, sale_manifest};
use dropgate_testkit::{DropSpec, HttpClient, RedisServer, Reply};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use prost::Message;
use warp::Filter;
use warp::http::Method;

/// The caller's span: trace `CALLER_TRACE`, span `CALLER_SPAN`, sampled.
const CALLER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

/// One span as the receiver decoded it, with its process's resource.
#[derive(Debug, Clone)]
struct Received {
    service: String,
    resource: HashMap<String, String>,
    name: String,
    kind: i32,
    trace_id: String,
    span_id: String,
    parent: String,
    attributes: HashMap<String, String>,
    /// The attributes sent as integers (OpenTelemetry's `int`), not text.
    integers: Vec<String>,
}

impl Received {
    fn attribute(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }

    /// The attribute `key` is `value`, sent as an integer.
    #[track_caller]
    fn assert_integer(&self, key: &str, value: i64) {
        self.assert_attribute(key, &value.to_string());
        assert!(
            self.integers.iter().any(|k| k == key),
            "attribute {key} of span {} is not an integer",
            self.name
        );
    }

    #[track_caller]
    fn assert_attribute(&self, key: &str, value: &str) {
        assert_eq!(
            self.attribute(key),
            Some(value),
            "attribute {key} of span {}: {self:#?}",
            self.name
        );
    }
}

/// A local OTLP/HTTP receiver: `POST /v1/traces` with an
/// `ExportTraceServiceRequest` in protobuf, as a collector takes it. Every request
/// counts as an export, whatever its path or content.
struct Receiver {
    addr: SocketAddr,
    spans: Arc<Mutex<Vec<Received>>>,
    exports: Arc<Mutex<usize>>,
}

impl Receiver {
    async fn start() -> Receiver {
        Self::on("127.0.0.1:0").await.expect("bind a free port")
    }

    async fn on(addr: &str) -> std::io::Result<Receiver> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let spans: Arc<Mutex<Vec<Received>>> = Arc::default();
        let exports: Arc<Mutex<usize>> = Arc::default();
        let (into, counted) = (spans.clone(), exports.clone());
        let traces = warp::method()
            .and(warp::path::full())
            .and(warp::header::optional::<String>("content-type"))
            .and(warp::body::bytes())
            .map(
                move |method,
                      path: warp::path::FullPath,
                      kind: Option<String>,
                      body: bytes::Bytes| {
                    *counted.lock().expect("count") += 1;
                    let otlp = method == Method::POST
                        && path.as_str() == "/v1/traces"
                        && kind.as_deref() == Some("application/x-protobuf");
                    match ExportTraceServiceRequest::decode(body)
                        .ok()
                        .filter(|_| otlp)
                    {
                        Some(request) => {
                            into.lock().expect("spans").extend(decoded(request));
                            warp::http::Response::builder()
                                .header("content-type", "application/x-protobuf")
                                .body(ExportTraceServiceResponse::default().encode_to_vec())
                        }
                        None => warp::http::Response::builder()
                            .status(400)
                            .body(b"not an OTLP/HTTP protobuf export".to_vec()),
                    }
                },
            );
        tokio::spawn(warp::serve(traces).incoming(listener).run());
        Ok(Receiver {
            addr,
            spans,
            exports,
        })
    }

    fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn exports(&self) -> usize {
        *self.exports.lock().expect("count")
    }

    /// The first span `matches` accepts, waiting up to 15 s for the exporter's batch.
    async fn span(&self, what: &str, matches: impl Fn(&Received) -> bool) -> Received {
        for _ in 0..300 {
            if let Some(span) = self
                .spans
                .lock()
                .expect("spans")
                .iter()
                .find(|s| matches(s))
            {
                return span.clone();
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let names: Vec<String> = self
            .spans
            .lock()
            .expect("spans")
            .iter()
            .map(|s| s.name.clone())
            .collect();
        panic!("no span {what} arrived within 15 s; received: {names:?}")
    }

    /// The spans whose parent is `parent`.
    fn children_of(&self, parent: &Received) -> Vec<Received> {
        self.spans
            .lock()
            .expect("spans")
            .iter()
            .filter(|s| s.parent == parent.span_id && s.trace_id == parent.trace_id)
            .cloned()
            .collect()
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn is_integer(value: &Option<Value>) -> bool {
    matches!(value, Some(Value::IntValue(_)))
}

fn text(value: Option<Value>) -> String {
    match value {
        Some(Value::StringValue(s)) => s,
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}

fn decoded(request: ExportTraceServiceRequest) -> Vec<Received> {
    let mut out = Vec::new();
    for resource_spans in request.resource_spans {
        let resource: HashMap<String, String> = resource_spans
            .resource
            .map(|r| r.attributes)
            .unwrap_or_default()
            .into_iter()
            .map(|kv| (kv.key, text(kv.value.and_then(|v| v.value))))
            .collect();
        let service = resource.get("service.name").cloned().unwrap_or_default();
        for scope in resource_spans.scope_spans {
            for span in scope.spans {
                let integers = span
                    .attributes
                    .iter()
                    .filter(|kv| is_integer(&kv.value.as_ref().and_then(|v| v.value.clone())))
                    .map(|kv| kv.key.clone())
                    .collect();
                out.push(Received {
                    integers,
                    service: service.clone(),
                    resource: resource.clone(),
                    name: span.name,
                    kind: span.kind,
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent: hex(&span.parent_span_id),
                    attributes: span
                        .attributes
                        .into_iter()
                        .map(|kv| (kv.key, text(kv.value.and_then(|v| v.value))))
                        .collect(),
                });
            }
        }
    }
    out
}

/// Redis with the drop `shop/sale` published, and a directory for ledgers.
struct Sale {
    redis: RedisServer,
    dir: tempfile::TempDir,
}

impl Sale {
    fn published() -> Sale {
        let redis = RedisServer::start().expect("redis-server");
        let dir = tempfile::tempdir().expect("dir");
        let manifest = sale_manifest(dir.path(), &DropSpec::new(10).yaml()).expect("manifest");
        apply(&manifest, &redis.url()).expect("apply");
        Sale { redis, dir }
    }

    /// A sidecar on its own SQLite ledger with `env` and `flags`.
    async fn sidecar(&self, name: &str, env: &[(&str, &str)], flags: &[&str]) -> SidecarProcess {
        let ledger = format!("sqlite://{}", self.dir.path().join(name).display());
        SidecarProcess::start_with_env(&self.redis.url(), "shop", &ledger, flags, env)
            .await
            .expect("sidecar")
    }
}

/// The OpenTelemetry environment pointing at `receiver`, exporting every 100 ms.
fn exporting_to(receiver: &Receiver) -> Vec<(&'static str, String)> {
    vec![
        ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint()),
        ("OTEL_SERVICE_NAME", "shop-sidecar".into()),
        (
            "OTEL_RESOURCE_ATTRIBUTES",
            "deployment.environment.name=test".into(),
        ),
        ("OTEL_BSP_SCHEDULE_DELAY", "100".into()),
    ]
}

fn borrowed<'a>(env: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    env.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

async fn reserve(http: &HttpClient, key: &str, headers: &[(&str, &str)]) -> Reply {
    let body = format!(r#"{{"key":"{key}","user":"buyer-{key}","quantity":1}}"#);
    http.request_with_headers(
        Method::POST,
        "/v1/drops/sale/reservations",
        Some(&body),
        headers,
    )
    .await
    .expect("reserve")
}

fn is_reserve(span: &Received) -> bool {
    span.name == "POST /v1/drops/{drop}/reservations"
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_reserve_is_one_server_span_in_the_callers_trace_with_its_steps_as_children() {
    let receiver = Receiver::start().await;
    let sale = Sale::published();
    let env = exporting_to(&receiver);
    let sidecar = sale.sidecar("a.db", &borrowed(&env), &[]).await;
    let http = HttpClient::new(sidecar.base.clone());

    let traceparent = format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01");
    reserve(
        &http,
        "k1",
        &[("traceparent", &traceparent), ("tracestate", "shop=1")],
    )
    .await
    .assert_answer(201, "admitted");

    let server = receiver.span("for the reserve", is_reserve).await;
    assert_eq!(
        server.trace_id, CALLER_TRACE,
        "continues the caller's trace"
    );
    assert_eq!(server.parent, CALLER_SPAN, "a child of the caller's span");
    assert_eq!(server.kind, SpanKind::Server as i32);
    assert_eq!(server.service, "shop-sidecar");
    assert_eq!(
        server
            .resource
            .get("deployment.environment.name")
            .map(String::as_str),
        Some("test")
    );
    for (key, value) in [
        ("http.request.method", "POST"),
        ("http.route", "/v1/drops/{drop}/reservations"),
        ("dropgate.drop", "sale"),
        ("dropgate.outcome", "admitted"),
        ("dropgate.path", "gate"),
    ] {
        server.assert_attribute(key, value);
    }
    server.assert_integer("http.response.status_code", 201);
    assert!(
        server
            .attributes
            .iter()
            .all(|(key, value)| !key.contains("user")
                && !value.contains("buyer-k1")
                && value != "k1"),
        "no buyer identifiers without --trace-buyer-ids: {server:#?}"
    );

    // Its steps, each a child of the server span.
    receiver
        .span("for the ledger commit", |s| s.name == "ledger commit")
        .await;
    let children = receiver.children_of(&server);
    let child = |name: &str| {
        children
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no child span {name} of the reserve: {children:#?}"))
            .clone()
    };
    let gate = child("EVALSHA reserve");
    assert_eq!(gate.kind, SpanKind::Client as i32);
    gate.assert_attribute("db.system", "redis");
    gate.assert_attribute("db.operation.name", "EVALSHA");
    let throttle = child("throttle wait");
    throttle.assert_attribute("dropgate.throttle.granted", "true");
    let commit = child("ledger commit");
    commit.assert_attribute("db.system", "sqlite");
    for named in ["dropgate.ledger.batch", "dropgate.ledger.batch_size"] {
        let n = commit.attribute(named).unwrap_or("");
        assert!(
            n.parse::<u64>().is_ok_and(|n| n >= 1),
            "{named}: {commit:#?}"
        );
        assert!(
            commit.integers.iter().any(|k| k == named),
            "{named} is an integer"
        );
    }
    child("EVALSHA activate");

    // Without a traceparent the reserve starts a trace of its own.
    reserve(&http, "k2", &[])
        .await
        .assert_answer(201, "admitted");
    let root = receiver
        .span("for the second reserve", |s| {
            is_reserve(s) && s.trace_id != CALLER_TRACE
        })
        .await;
    assert_eq!(root.parent, "", "a root span: {root:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_acquire_is_a_span_with_its_attempts_and_fence() {
    let receiver = Receiver::start().await;
    let sale = Sale::published();
    let env = exporting_to(&receiver);
    let sidecar = sale.sidecar("l.db", &borrowed(&env), &[]).await;
    let http = HttpClient::new(sidecar.base.clone());
    let taken = http
        .post(
            "/v1/locks/packing-slip",
            r#"{"owner":"packer-1","ttlMs":5000,"waitMs":0}"#,
        )
        .await
        .expect("lock");
    assert_eq!(taken.status, 200, "{}", taken.text);
    let acquire = receiver
        .span("for the lock's acquire", |s| s.name == "lock acquire")
        .await;
    acquire.assert_integer("dropgate.lock.attempts", 1);
    acquire.assert_attribute("dropgate.lock.granted", "true");
    acquire.assert_integer(
        "dropgate.lock.fence",
        taken.body["fence"].as_i64().unwrap_or(-1),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buyer_identifiers_are_on_the_span_only_when_asked_for() {
    let receiver = Receiver::start().await;
    let sale = Sale::published();
    let env = exporting_to(&receiver);
    let sidecar = sale
        .sidecar("b.db", &borrowed(&env), &["--trace-buyer-ids"])
        .await;
    let http = HttpClient::new(sidecar.base.clone());
    reserve(&http, "k7", &[])
        .await
        .assert_answer(201, "admitted");
    let server = receiver.span("for the reserve", is_reserve).await;
    server.assert_attribute("dropgate.user", "buyer-k7");
    server.assert_attribute("dropgate.key", "k7");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_sent_without_an_endpoint_or_when_disabled() {
    // The OTLP/HTTP default endpoint: an exporter that ignored the missing setting
    // would send here.
    let default = Receiver::on("127.0.0.1:4318")
        .await
        .expect("the test needs 127.0.0.1:4318, OTLP/HTTP's default port, free");
    let elsewhere = Receiver::start().await;
    let sale = Sale::published();
    let no_endpoint = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", ""),
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", ""),
        ("OTEL_SERVICE_NAME", "shop-sidecar"),
        ("OTEL_TRACES_SAMPLER", "always_on"),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ];
    let endpoint = elsewhere.endpoint();
    let disabled = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_SDK_DISABLED", "true"),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ];
    // One ledger for both sidecars (one after the other), each its own buyer.
    for (buyer, env) in [("c1", &no_endpoint[..]), ("c2", &disabled[..])] {
        let sidecar = sale.sidecar("c.db", env, &[]).await;
        let http = HttpClient::new(sidecar.base.clone());
        let traceparent = format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01");
        reserve(&http, buyer, &[("traceparent", &traceparent)])
            .await
            .assert_answer(201, "admitted");
        // Several export intervals, then a clean exit, which flushes what is queued.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let exit = sidecar.terminate().expect("SIGTERM");
        assert!(exit.success(), "{exit}");
    }
    assert_eq!(default.exports(), 0, "nothing sent to the default endpoint");
    assert_eq!(
        elsewhere.exports(),
        0,
        "nothing sent while OTEL_SDK_DISABLED=true"
    );
}

/// The Memorystore API and metadata server, answering that instance `i` is
/// STANDARD_HA and READY at `redis_port`, and keeping each call's `traceparent`.
async fn fake_google(redis_port: u16) -> (SocketAddr, Arc<Mutex<Vec<String>>>) {
    let heard: Arc<Mutex<Vec<String>>> = Arc::default();
    let kept = heard.clone();
    let token = warp::path!(
        "computeMetadata" / "v1" / "instance" / "service-accounts" / "default" / "token"
    )
    .map(|| r#"{"access_token":"ya29.t","expires_in":3599,"token_type":"Bearer"}"#);
    let instance = warp::path!(
        "v1" / "projects" / "shop-project" / "locations" / "europe-west1" / "instances" / "i"
    )
    .and(warp::header::optional::<String>("traceparent"))
    .map(move |traceparent: Option<String>| {
        kept.lock()
            .expect("heard")
            .push(traceparent.unwrap_or_default());
        format!(
            r#"{{"tier":"STANDARD_HA","state":"READY","host":"127.0.0.1","port":{redis_port}}}"#
        )
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(warp::serve(token.or(instance)).incoming(listener).run());
    (addr, heard)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconcile_is_a_span_with_the_mode_the_ha_verdict_and_its_memorystore_call() {
    let receiver = Receiver::start().await;
    let redis = RedisServer::start().expect("redis-server");
    let (google, heard) = fake_google(redis.port()).await;
    let dir = tempfile::tempdir().expect("dir");
    let manifest = dir.path().join("drop.yaml");
    std::fs::write(
        &manifest,
        r#"apiVersion: dropgate.io/v1alpha1
kind: InventoryDrop
metadata: {name: sale, namespace: shop}
spec:
  sku: SNKR-1
  limitedQuantity: 10
  redis:
    url: redis://unused:1
    requireHighAvailability: true
    memorystore: {project: shop-project, location: europe-west1, instance: i}
"#,
    )
    .expect("manifest");
    let google = format!("http://{google}");
    let mut apply = Command::new(binary("dropgate-operator"));
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("OTEL_") {
            apply.env_remove(name);
        }
    }
    let out = apply
        .arg("apply")
        .arg("-f")
        .arg(&manifest)
        .args(["--redis-url", &redis.url()])
        .env("DROPGATE_MEMORYSTORE_ENDPOINT", &google)
        .env("DROPGATE_METADATA_ENDPOINT", &google)
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint())
        .env("OTEL_SERVICE_NAME", "dropgate-operator")
        .output()
        .expect("run dropgate-operator");
    assert!(
        out.status.success(),
        "apply: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    // `apply` exits at once: what it sent, it sent on its way out.
    let reconcile = receiver
        .span("for the reconcile", |s| s.name == "reconcile")
        .await;
    reconcile.assert_attribute("dropgate.drop", "shop/sale");
    reconcile.assert_attribute("dropgate.mode", "gate");
    reconcile.assert_attribute("dropgate.ha.verdict", "highly_available");
    reconcile.assert_attribute("dropgate.ha.reason", "StandardHaReady");
    let call = receiver
        .span("for the Memorystore call", |s| {
            s.name == "GET"
                && s.attribute("url.full")
                    .is_some_and(|u| u.contains("/instances/i"))
        })
        .await;
    assert_eq!(call.kind, SpanKind::Client as i32);
    assert_eq!(
        (call.trace_id.as_str(), call.parent.as_str()),
        (reconcile.trace_id.as_str(), reconcile.span_id.as_str())
    );
    call.assert_attribute("http.request.method", "GET");
    call.assert_integer("http.response.status_code", 200);
    call.assert_attribute("server.address", "127.0.0.1");
    let heard = heard.lock().expect("heard").clone();
    assert_eq!(heard.len(), 1, "one Memorystore call: {heard:?}");
    assert!(
        heard[0].starts_with(&format!("00-{}-{}-", call.trace_id, call.span_id)),
        "the API heard the call's span in traceparent: {heard:?}"
    );
}
