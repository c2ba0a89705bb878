//! The controller against a scripted Kubernetes API server (tower-test) and a real
//! Redis: every request's method, path and body is asserted, in order, and nothing
//! else may be called.

use std::sync::Arc;
use std::time::Duration;

use dropgate_api::{InventoryDrop, InventoryDropSpec};
use dropgate_operator::controller::{self, Context, FINALIZER, Settings};
use dropgate_operator::memorystore::Memorystore;
use dropgate_operator::metrics::Metrics;
use dropgate_testkit::RedisServer;
use http::{Method, Request, Response};
use kube::client::Body;
use kube::runtime::controller::Action;
use kube::{Client, Resource, ResourceExt};
use redis::Commands;
use serde_json::{Value, json};
use tower_test::mock::{self, Handle, SendResponse};

type ApiHandle = Handle<Request<Body>, Response<Body>>;

/// One request the controller made.
struct Call {
    method: Method,
    path: String,
    query: String,
    body: Value,
    reply: SendResponse<Response<Body>>,
}

impl Call {
    fn respond(self, status: u16, body: &Value) {
        let bytes = serde_json::to_vec(body).expect("json");
        self.reply.send_response(
            Response::builder()
                .status(status)
                .body(Body::from(bytes))
                .expect("response"),
        );
    }
}

async fn next(handle: &mut ApiHandle) -> Call {
    let (request, reply) = tokio::time::timeout(Duration::from_secs(10), handle.next_request())
        .await
        .expect("the controller made a call in time")
        .expect("the client is alive");
    let method = request.method().clone();
    let path = request.uri().path().to_string();
    let query = request.uri().query().unwrap_or("").to_string();
    let bytes = request.into_body().collect_bytes().await.expect("body");
    let body = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).expect("request body is JSON")
    };
    Call {
        method,
        path,
        query,
        body,
        reply,
    }
}

fn context(redis_url: Option<String>) -> (Arc<Context>, ApiHandle) {
    context_with(redis_url, Memorystore::default())
}

fn context_with(redis_url: Option<String>, memorystore: Memorystore) -> (Arc<Context>, ApiHandle) {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let client = Client::new(service, "default");
    let settings = Settings {
        resync: Duration::from_secs(30),
        backoff_base: Duration::from_secs(2),
        backoff_max: Duration::from_secs(60),
        redis_url,
        ha_grace: Duration::from_secs(300),
    };
    let ctx = Context::new(client, memorystore, Arc::new(Metrics::default()), settings);
    (Arc::new(ctx), handle)
}

fn drop_of(spec_yaml: &str, redis: &RedisServer) -> InventoryDrop {
    let spec = format!("{spec_yaml}\nredis: {{url: '{}'}}", redis.url());
    let spec: InventoryDropSpec = serde_norway::from_str(&spec).expect("spec");
    let mut drop = InventoryDrop::new("sale", spec);
    drop.metadata.namespace = Some("shop".into());
    drop.metadata.generation = Some(1);
    drop.metadata.uid = Some("6f1c1d2e-0000-4000-8000-000000000001".into());
    drop
}

fn finalized(mut drop: InventoryDrop) -> InventoryDrop {
    drop.finalizers_mut().push(FINALIZER.into());
    drop
}

const OBJECT: &str = "/apis/dropgate.io/v1alpha1/namespaces/shop/inventorydrops/sale";

/// Expects the status patch by server-side apply and answers with the object.
async fn expect_status_patch(handle: &mut ApiHandle, drop: &InventoryDrop) -> Value {
    let call = next(handle).await;
    assert_eq!(call.method, Method::PATCH);
    assert_eq!(call.path, format!("{OBJECT}/status"));
    assert!(
        call.query.contains("fieldManager=dropgate-operator"),
        "{}",
        call.query
    );
    assert!(call.query.contains("force=true"), "{}", call.query);
    assert_eq!(call.body["apiVersion"], "dropgate.io/v1alpha1");
    assert_eq!(call.body["kind"], "InventoryDrop");
    let status = call.body["status"].clone();
    let mut answer = serde_json::to_value(drop).expect("json");
    answer["status"] = status.clone();
    call.respond(200, &answer);
    status
}

/// Expects an Event about the drop and answers with it.
async fn expect_event(handle: &mut ApiHandle) -> Value {
    let call = next(handle).await;
    assert_eq!(call.method, Method::POST);
    assert_eq!(call.path, "/apis/events.k8s.io/v1/namespaces/shop/events");
    assert_eq!(call.body["regarding"]["name"], "sale");
    assert_eq!(call.body["regarding"]["kind"], "InventoryDrop");
    let event = call.body.clone();
    call.respond(201, &event);
    event
}

/// Drops the context (the only client) and checks the controller made no call
/// beyond the script.
async fn expect_no_more(ctx: Arc<Context>, mut handle: ApiHandle) {
    drop(ctx);
    let extra = tokio::time::timeout(Duration::from_secs(2), handle.next_request())
        .await
        .expect("the client was dropped");
    assert!(
        extra.is_none(),
        "an unexpected call: {:?}",
        extra.map(|(r, _)| r.uri().clone())
    );
}

fn condition<'a>(status: &'a Value, type_: &str) -> &'a Value {
    status["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == type_))
        .unwrap_or_else(|| panic!("condition {type_} in {status}"))
}

#[tokio::test]
async fn first_sight_adds_the_finalizer_and_nothing_else() {
    let redis = RedisServer::start().expect("redis");
    let (ctx, mut handle) = context(None);
    let drop = drop_of("sku: X\nlimitedQuantity: 10", &redis);
    let expected = finalized(drop.clone());
    let server = tokio::spawn(async move {
        let call = next(&mut handle).await;
        assert_eq!(call.method, Method::PATCH);
        assert_eq!(call.path, OBJECT);
        assert_eq!(
            call.body,
            json!([
                {"op": "test", "path": "/metadata/finalizers", "value": null},
                {"op": "add", "path": "/metadata/finalizers", "value": [FINALIZER]}
            ])
        );
        call.respond(200, &serde_json::to_value(&expected).expect("json"));
        handle
    });
    let action = controller::reconcile(Arc::new(drop), ctx.clone())
        .await
        .expect("reconciles");
    assert_eq!(action, Action::await_change());
    let handle = server.await.expect("script ran");
    let keys: Vec<String> = redis.connection().expect("c").keys("*").expect("KEYS");
    assert!(
        keys.is_empty(),
        "nothing is seeded before the finalizer is in place"
    );
    expect_no_more(ctx, handle).await;
}

#[tokio::test]
async fn apply_seeds_redis_writes_status_and_announces_the_mode() {
    let redis = RedisServer::start().expect("redis");
    let (ctx, mut handle) = context(None);
    let drop = finalized(drop_of("sku: X\nlimitedQuantity: 100", &redis));
    let for_server = drop.clone();
    let server = tokio::spawn(async move {
        let status = expect_status_patch(&mut handle, &for_server).await;
        assert_eq!(status["remaining"], 100);
        assert_eq!(status["reserved"], 0);
        assert_eq!(status["mode"], "gate");
        assert_eq!(status["phase"], "Active");
        assert_eq!(status["tier"], "standalone");
        assert_eq!(status["failOpen"], false);
        assert_eq!(status["observedGeneration"], 1);
        for type_ in ["Seeded", "HighlyAvailable", "FailOpen", "Ready"] {
            let c = condition(&status, type_);
            assert!(c["reason"].as_str().is_some_and(|r| !r.is_empty()));
            assert!(c["message"].as_str().is_some_and(|m| !m.is_empty()));
            assert!(c["lastTransitionTime"].is_string());
            assert_eq!(c["observedGeneration"], 1);
        }
        assert_eq!(condition(&status, "Ready")["status"], "True");
        let event = expect_event(&mut handle).await;
        assert_eq!(event["reason"], "GateEnabled");
        assert_eq!(event["type"], "Normal");
        handle
    });
    let action = controller::reconcile(Arc::new(drop), ctx.clone())
        .await
        .expect("reconciles");
    // No sidecar has claimed the sale for a ledger yet: looked at again in 2 s
    // (not the 30 s resync), so that the claim reaches status soon after it is made.
    assert_eq!(action, Action::requeue(Duration::from_secs(2)));
    let handle = server.await.expect("script ran");
    let remaining: i64 = redis
        .connection()
        .expect("c")
        .get("dropgate:{shop/sale}:remaining")
        .expect("GET");
    assert_eq!(remaining, 100);
    expect_no_more(ctx, handle).await;
}

#[tokio::test]
async fn a_mode_change_emits_one_event_and_a_steady_state_none() {
    let redis = RedisServer::start().expect("redis");
    let (ctx, mut handle) = context(None);
    let on = finalized(drop_of("sku: X\nlimitedQuantity: 5", &redis));
    let mut off = finalized(drop_of(
        "sku: X\nlimitedQuantity: 5\ngate: {enabled: false}",
        &redis,
    ));
    off.metadata.generation = Some(2);
    let (on_s, off_s) = (on.clone(), off.clone());
    let server = tokio::spawn(async move {
        expect_status_patch(&mut handle, &on_s).await;
        assert_eq!(expect_event(&mut handle).await["reason"], "GateEnabled");

        let status = expect_status_patch(&mut handle, &off_s).await;
        assert_eq!(status["mode"], "fail-open");
        assert_eq!(status["failOpen"], true);
        assert_eq!(status["phase"], "FailOpen");
        assert_eq!(condition(&status, "FailOpen")["reason"], "KillSwitch");
        assert_eq!(
            condition(&status, "Ready")["status"],
            "True",
            "a kill switch is a reached state"
        );
        let event = expect_event(&mut handle).await;
        assert_eq!(event["reason"], "FailOpenEnabled");
        assert_eq!(event["type"], "Warning");
        assert!(
            event["note"]
                .as_str()
                .is_some_and(|n| n.contains("gate -> fail-open")),
            "{event}"
        );

        // The same spec again: status only.
        expect_status_patch(&mut handle, &off_s).await;
        handle
    });
    controller::reconcile(Arc::new(on), ctx.clone())
        .await
        .expect("on");
    controller::reconcile(Arc::new(off.clone()), ctx.clone())
        .await
        .expect("off");
    controller::reconcile(Arc::new(off), ctx.clone())
        .await
        .expect("off again");
    let handle = server.await.expect("script ran");
    let mode: String = redis
        .connection()
        .expect("c")
        .hget("dropgate:{shop/sale}:config", "mode")
        .expect("HGET");
    assert_eq!(mode, "fail-open");
    expect_no_more(ctx, handle).await;
}

#[tokio::test]
async fn deletion_removes_the_keys_before_the_finalizer() {
    let redis = RedisServer::start().expect("redis");
    let mut conn = redis.connection().expect("c");
    let (ctx, mut handle) = context(None);
    let drop = finalized(drop_of("sku: X\nlimitedQuantity: 5", &redis));
    // Seed through a normal reconcile first.
    let seeded = drop.clone();
    let server = tokio::spawn(async move {
        expect_status_patch(&mut handle, &seeded).await;
        expect_event(&mut handle).await;
        handle
    });
    controller::reconcile(Arc::new(drop.clone()), ctx.clone())
        .await
        .expect("seeds");
    let mut handle = server.await.expect("script ran");
    let _: () = conn
        .hset("dropgate:{shop/sale}:res:k", "state", "active")
        .expect("marker");

    let mut deleting = drop;
    deleting.meta_mut().deletion_timestamp =
        Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            "2026-12-01T10:00:00Z".parse().expect("ts"),
        ));
    let url = redis.url();
    let server = tokio::spawn(async move {
        let call = next(&mut handle).await;
        // By the time the finalizer goes, the keys are gone, but for the tombstone
        // that tells sidecars the drop was deleted (not lost), which expires.
        let mut conn = redis::Client::open(url)
            .expect("url")
            .get_connection()
            .expect("c");
        let left: Vec<String> = conn.keys("*").expect("KEYS");
        assert_eq!(
            left,
            ["dropgate:{shop/sale}:deleted"],
            "keys left: {left:?}"
        );
        let ttl: i64 = redis::cmd("TTL")
            .arg("dropgate:{shop/sale}:deleted")
            .query(&mut conn)
            .expect("TTL");
        assert!(ttl > 0, "the tombstone expires: TTL {ttl}");
        assert_eq!(call.method, Method::PATCH);
        assert_eq!(call.path, OBJECT);
        assert_eq!(
            call.body,
            json!([
                {"op": "test", "path": "/metadata/finalizers/0", "value": FINALIZER},
                {"op": "remove", "path": "/metadata/finalizers/0"}
            ])
        );
        call.respond(200, &json!({"apiVersion": "dropgate.io/v1alpha1", "kind": "InventoryDrop", "metadata": {"name": "sale", "namespace": "shop"}, "spec": {"sku": "X", "limitedQuantity": 5, "redis": {}}}));
        handle
    });
    let action = controller::reconcile(Arc::new(deleting), ctx.clone())
        .await
        .expect("cleans up");
    assert_eq!(action, Action::await_change());
    let handle = server.await.expect("script ran");
    expect_no_more(ctx, handle).await;
}

#[tokio::test]
async fn redis_down_is_written_into_status_and_backs_off() {
    let port = dropgate_testkit::free_port().expect("port");
    let (ctx, mut handle) = context(Some(format!("redis://127.0.0.1:{port}")));
    let mut drop = finalized(InventoryDrop::new(
        "sale",
        serde_norway::from_str("{sku: X, limitedQuantity: 5, redis: {}}").expect("spec"),
    ));
    drop.metadata.namespace = Some("shop".into());
    drop.metadata.generation = Some(3);
    let for_server = drop.clone();
    let server = tokio::spawn(async move {
        let status = expect_status_patch(&mut handle, &for_server).await;
        assert_eq!(status["phase"], "Error");
        let ready = condition(&status, "Ready");
        assert_eq!(ready["status"], "False");
        assert_eq!(ready["reason"], "RedisUnavailable");
        assert!(
            ready["message"]
                .as_str()
                .is_some_and(|m| m.contains("unreachable")),
            "{ready}"
        );
        handle
    });
    let error = controller::reconcile(Arc::new(drop.clone()), ctx.clone())
        .await
        .expect_err("Redis is down");
    assert_eq!(error.metric_label(), "redis_unavailable");
    let handle = server.await.expect("script ran");
    let first = controller::error_policy(Arc::new(drop.clone()), &error, ctx.clone());
    let second = controller::error_policy(Arc::new(drop.clone()), &error, ctx.clone());
    assert_eq!(first, Action::requeue(Duration::from_secs(2)));
    assert_eq!(second, Action::requeue(Duration::from_secs(4)));
    for _ in 0..10 {
        controller::error_policy(Arc::new(drop.clone()), &error, ctx.clone());
    }
    assert_eq!(
        controller::error_policy(Arc::new(drop), &error, ctx.clone()),
        Action::requeue(Duration::from_secs(60)),
        "capped"
    );
    let metrics = ctx.metrics.encode().expect("metrics");
    assert!(
        metrics
            .contains("dropgate_operator_reconcile_errors_total{error=\"redis_unavailable\"} 13"),
        "{metrics}"
    );
    expect_no_more(ctx, handle).await;
}

#[tokio::test]
async fn the_redis_url_can_come_from_a_secret() {
    let redis = RedisServer::start().expect("redis");
    let (ctx, mut handle) = context(None);
    let spec: InventoryDropSpec = serde_norway::from_str(
        "{sku: X, limitedQuantity: 7, redis: {secretRef: {name: redis-creds, key: url}}}",
    )
    .expect("spec");
    let mut drop = finalized(InventoryDrop::new("sale", spec));
    drop.metadata.namespace = Some("shop".into());
    let (for_server, url) = (drop.clone(), redis.url());
    let server = tokio::spawn(async move {
        let call = next(&mut handle).await;
        assert_eq!(call.method, Method::GET);
        assert_eq!(call.path, "/api/v1/namespaces/shop/secrets/redis-creds");
        let encoded = base64_encode(url.as_bytes());
        call.respond(200, &json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "redis-creds", "namespace": "shop"}, "data": {"url": encoded}}));
        let status = expect_status_patch(&mut handle, &for_server).await;
        assert_eq!(status["remaining"], 7);
        expect_event(&mut handle).await;
        handle
    });
    controller::reconcile(Arc::new(drop), ctx.clone())
        .await
        .expect("reconciles");
    let handle = server.await.expect("script ran");
    expect_no_more(ctx, handle).await;
}

/// A drop's `secretRef` may name any key of any Secret in its namespace: one that
/// holds no Redis URL is refused, and neither the status nor the error shows the
/// value (a user who may read drops but not Secrets would read it there).
#[tokio::test]
async fn a_secret_that_holds_no_redis_url_is_refused_without_showing_it() {
    let (ctx, mut handle) = context(None);
    let drop = from_secret("db-creds");
    let for_server = drop.clone();
    let server = tokio::spawn(async move {
        let call = next(&mut handle).await;
        assert_eq!(call.path, "/api/v1/namespaces/shop/secrets/db-creds");
        let encoded = base64_encode(b"hunter2-SECRET-VALUE");
        call.respond(200, &json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "db-creds", "namespace": "shop"}, "data": {"url": encoded}}));
        let status = expect_status_patch(&mut handle, &for_server).await;
        let text = status.to_string();
        assert!(
            text.contains("does not hold a redis:// or rediss:// URL"),
            "{text}"
        );
        assert!(!text.contains("hunter2"), "{text}");
        handle
    });
    let error = controller::reconcile(Arc::new(drop), ctx.clone())
        .await
        .expect_err("refused");
    assert!(!error.to_string().contains("hunter2"), "{error}");
    let handle = server.await.expect("script ran");
    expect_no_more(ctx, handle).await;
}

/// Standard base64, enough for a Secret's data in a test.
fn base64_encode(bytes: &[u8]) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn deleting(mut drop: InventoryDrop) -> InventoryDrop {
    drop.meta_mut().deletion_timestamp =
        Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            "2026-12-01T10:00:00Z".parse().expect("ts"),
        ));
    drop
}

/// A drop whose status says it was seeded in `mode`.
fn published(mut drop: InventoryDrop, mode: &str) -> InventoryDrop {
    drop.status =
        Some(serde_json::from_value(json!({"phase": "Active", "mode": mode})).expect("status"));
    drop
}

/// Expects the finalizer's removal and answers it.
async fn expect_finalizer_removed(handle: &mut ApiHandle) {
    let call = next(handle).await;
    assert_eq!(
        (call.method.clone(), call.path.as_str()),
        (Method::PATCH, OBJECT)
    );
    assert_eq!(
        call.body,
        json!([
            {"op": "test", "path": "/metadata/finalizers/0", "value": FINALIZER},
            {"op": "remove", "path": "/metadata/finalizers/0"}
        ])
    );
    call.respond(200, &json!({"apiVersion": "dropgate.io/v1alpha1", "kind": "InventoryDrop", "metadata": {"name": "sale", "namespace": "shop"}, "spec": {"sku": "X", "limitedQuantity": 5, "redis": {}}}));
}

/// Expects a Warning Event with `reason` whose note mentions every word.
async fn expect_warning(handle: &mut ApiHandle, reason: &str, words: &[&str]) {
    let event = expect_event(handle).await;
    assert_eq!(
        (event["type"].as_str(), event["reason"].as_str()),
        (Some("Warning"), Some(reason)),
        "{event}"
    );
    let note = event["note"].as_str().unwrap_or_default();
    for word in words {
        assert!(note.contains(word), "{word:?} in {note}");
    }
}

async fn expect_namespace(handle: &mut ApiHandle, terminating: bool) {
    let call = next(handle).await;
    assert_eq!(
        (call.method.clone(), call.path.as_str()),
        (Method::GET, "/api/v1/namespaces/shop")
    );
    let mut namespace =
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop"}});
    if terminating {
        namespace["metadata"]["deletionTimestamp"] = json!("2026-12-01T10:00:00Z");
    }
    call.respond(200, &namespace);
}

fn from_secret(name: &str) -> InventoryDrop {
    let spec: InventoryDropSpec = serde_norway::from_str(&format!(
        "{{sku: X, limitedQuantity: 5, redis: {{secretRef: {{name: {name}, key: url}}}}}}"
    ))
    .expect("spec");
    let mut drop = InventoryDrop::new("sale", spec);
    drop.metadata.namespace = Some("shop".into());
    finalized(drop)
}

#[tokio::test]
async fn a_drop_whose_redis_secret_is_gone_is_let_go_with_a_warning() {
    let (ctx, mut handle) = context(None);
    let drop = deleting(published(from_secret("redis-creds"), "gate"));
    let server = tokio::spawn(async move {
        let call = next(&mut handle).await;
        assert_eq!(call.path, "/api/v1/namespaces/shop/secrets/redis-creds");
        call.respond(404, &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404}));
        expect_warning(
            &mut handle,
            "CleanupSkipped",
            &["dropgate:{shop/sale}:*", "does not exist", "TTL"],
        )
        .await;
        expect_finalizer_removed(&mut handle).await;
        handle
    });
    let action = controller::reconcile(Arc::new(drop), ctx.clone())
        .await
        .expect("lets it go");
    assert_eq!(action, Action::await_change());
    let handle = server.await.expect("script ran");
    expect_no_more(ctx, handle).await;
}

#[tokio::test]
async fn skip_cleanup_lets_the_drop_go_and_leaves_its_keys() {
    let redis = RedisServer::start().expect("redis");
    let mut conn = redis.connection().expect("c");
    let _: () = conn.set("dropgate:{shop/sale}:remaining", 5).expect("SET");
    let (ctx, mut handle) = context(None);
    let mut drop = deleting(published(
        finalized(drop_of("sku: X\nlimitedQuantity: 5", &redis)),
        "gate",
    ));
    drop.annotations_mut()
        .insert(controller::SKIP_CLEANUP.into(), "true".into());
    let server = tokio::spawn(async move {
        expect_warning(&mut handle, "CleanupSkipped", &["dropgate.io/skip-cleanup"]).await;
        expect_finalizer_removed(&mut handle).await;
        handle
    });
    controller::reconcile(Arc::new(drop), ctx.clone())
        .await
        .expect("lets it go");
    let handle = server.await.expect("script ran");
    let left: Option<i64> = conn.get("dropgate:{shop/sale}:remaining").expect("GET");
    assert_eq!(left, Some(5), "the keys were left alone");
    expect_no_more(ctx, handle).await;
}

#[tokio::test]
async fn a_redis_that_is_down_keeps_the_finalizer_until_its_namespace_goes() {
    let port = dropgate_testkit::free_port().expect("port");
    let (ctx, mut handle) = context(Some(format!("redis://127.0.0.1:{port}")));
    let mut drop = InventoryDrop::new(
        "sale",
        serde_norway::from_str("{sku: X, limitedQuantity: 5, redis: {}}").expect("spec"),
    );
    drop.metadata.namespace = Some("shop".into());
    let drop = deleting(published(finalized(drop), "gate"));
    let server = tokio::spawn(async move {
        // The namespace lives: the cause may pass, so retry with backoff.
        expect_namespace(&mut handle, false).await;
        // The namespace is being deleted: nothing will bring the drop back.
        expect_namespace(&mut handle, true).await;
        expect_warning(
            &mut handle,
            "CleanupSkipped",
            &["namespace is being deleted", "unreachable"],
        )
        .await;
        expect_finalizer_removed(&mut handle).await;
        handle
    });
    let error = controller::reconcile(Arc::new(drop.clone()), ctx.clone())
        .await
        .expect_err("retries");
    assert_eq!(error.metric_label(), "redis_unavailable");
    controller::reconcile(Arc::new(drop), ctx.clone())
        .await
        .expect("lets it go");
    let handle = server.await.expect("script ran");
    expect_no_more(ctx, handle).await;
}

#[tokio::test]
async fn a_drop_never_seeded_goes_without_waiting_for_its_redis() {
    let port = dropgate_testkit::free_port().expect("port");
    let (ctx, mut handle) = context(Some(format!("redis://127.0.0.1:{port}")));
    let mut drop = InventoryDrop::new(
        "sale",
        serde_norway::from_str("{sku: X, limitedQuantity: 5, redis: {}}").expect("spec"),
    );
    drop.metadata.namespace = Some("shop".into());
    let drop = deleting(finalized(drop));
    let server = tokio::spawn(async move {
        expect_warning(&mut handle, "CleanupSkipped", &["never seeded"]).await;
        expect_finalizer_removed(&mut handle).await;
        handle
    });
    controller::reconcile(Arc::new(drop), ctx.clone())
        .await
        .expect("lets it go");
    let handle = server.await.expect("script ran");
    expect_no_more(ctx, handle).await;
}

#[test]
fn only_spec_finalizer_and_deletion_changes_wake_the_controller() {
    let spec: InventoryDropSpec =
        serde_norway::from_str("{sku: X, limitedQuantity: 5, redis: {}}").expect("spec");
    let mut drop = InventoryDrop::new("sale", spec);
    drop.metadata.generation = Some(1);
    let base = controller::worth_a_reconcile(&drop);
    let mut status_only = drop.clone();
    status_only.status =
        Some(serde_json::from_value(json!({"phase": "Active", "remaining": 3})).expect("status"));
    status_only.metadata.resource_version = Some("99".into());
    assert_eq!(
        controller::worth_a_reconcile(&status_only),
        base,
        "a status write"
    );
    let mut spec_change = drop.clone();
    spec_change.metadata.generation = Some(2);
    let mut finalizer = drop.clone();
    finalizer.finalizers_mut().push(FINALIZER.into());
    let mut skip = drop.clone();
    skip.annotations_mut()
        .insert(controller::SKIP_CLEANUP.into(), "true".into());
    let mut other_annotation = drop.clone();
    other_annotation
        .annotations_mut()
        .insert("team".into(), "shoes".into());
    assert_eq!(controller::worth_a_reconcile(&other_annotation), base);
    for (what, changed) in [
        ("spec", spec_change),
        ("finalizer", finalizer),
        ("deletion", deleting(drop.clone())),
        ("skip-cleanup", skip),
    ] {
        assert_ne!(controller::worth_a_reconcile(&changed), base, "{what}");
    }
}

#[tokio::test]
async fn a_failed_status_write_backs_off() {
    let redis = RedisServer::start().expect("redis");
    let (ctx, mut handle) = context(None);
    let drop = finalized(drop_of("sku: X\nlimitedQuantity: 5", &redis));
    let server = tokio::spawn(async move {
        let call = next(&mut handle).await;
        assert_eq!(call.path, format!("{OBJECT}/status"));
        call.respond(500, &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 500, "message": "etcdserver: leader changed"}));
        handle
    });
    let error = controller::reconcile(Arc::new(drop.clone()), ctx.clone())
        .await
        .expect_err("the write failed");
    let handle = server.await.expect("script ran");
    assert_eq!(
        controller::error_policy(Arc::new(drop), &error, ctx.clone()),
        Action::requeue(Duration::from_secs(2)),
        "backs off, no immediate retry"
    );
    expect_no_more(ctx, handle).await;
}

#[tokio::test]
async fn a_redis_that_hangs_for_one_drop_does_not_hold_up_another() {
    let redis = RedisServer::start().expect("redis");
    // Accepts connections and never answers: a Redis that hangs.
    let hung = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let hung_url = format!("redis://{}", hung.local_addr().expect("addr"));
    let (ctx, mut handle) = context(None);
    let mut stuck = finalized(drop_of("sku: X\nlimitedQuantity: 5", &redis));
    stuck.metadata.name = Some("stuck".into());
    stuck.spec.redis.url = Some(hung_url);
    let healthy = finalized(drop_of("sku: X\nlimitedQuantity: 5", &redis));
    let stuck_task = tokio::spawn(controller::reconcile(Arc::new(stuck), ctx.clone()));
    tokio::time::sleep(Duration::from_millis(200)).await; // it is connecting
    let for_server = healthy.clone();
    let server = tokio::spawn(async move {
        expect_status_patch(&mut handle, &for_server).await;
        expect_event(&mut handle).await;
        handle
    });
    controller::reconcile(Arc::new(healthy), ctx.clone())
        .await
        .expect("the healthy drop reconciles");
    assert!(
        !stuck_task.is_finished(),
        "the other drop is still waiting for its Redis"
    );
    let mut handle = server.await.expect("script ran");
    // The stuck one fails in its own time and says so in its status.
    let call = next(&mut handle).await;
    assert_eq!(
        call.path,
        "/apis/dropgate.io/v1alpha1/namespaces/shop/inventorydrops/stuck/status"
    );
    call.respond(200, &json!({}));
    assert!(stuck_task.await.expect("joins").is_err());
    drop(hung);
    expect_no_more(ctx, handle).await;
}

/// A Memorystore API and metadata server that answer 503 for every instance.
async fn google_unavailable() -> String {
    use warp::Filter;
    let token = warp::path!(
        "computeMetadata" / "v1" / "instance" / "service-accounts" / "default" / "token"
    )
    .map(|| r#"{"access_token":"ya29.t","expires_in":3599,"token_type":"Bearer"}"#);
    let instance = warp::path!(
        "v1" / "projects" / String / "locations" / String / "instances" / String
    )
    .map(|_: String, _: String, _: String| {
        warp::reply::with_status("later", warp::http::StatusCode::SERVICE_UNAVAILABLE)
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(
        warp::serve(
            token
                .map(warp::reply::Reply::into_response)
                .or(instance.map(warp::reply::Reply::into_response)),
        )
        .incoming(listener)
        .run(),
    );
    format!("http://{addr}")
}

#[tokio::test]
async fn an_unanswered_ha_check_keeps_the_mode_warns_once_and_asks_again_soon() {
    let redis = RedisServer::start().expect("redis");
    let google = google_unavailable().await;
    let (ctx, mut handle) = context_with(
        None,
        Memorystore::new(&google, &google, Duration::from_millis(500)),
    );
    let mut drop = finalized(drop_of(
        "sku: X\nlimitedQuantity: 5\ngate: {failurePolicy: Closed}",
        &redis,
    ));
    drop.spec.redis.require_high_availability = true;
    drop.spec.redis.memorystore = Some(dropgate_api::drop::MemorystoreInstance {
        project: "shop-project".into(),
        location: "europe-west1".into(),
        instance: "i".into(),
    });
    // Last verified: highly available, the gate on.
    drop.status = Some(
        serde_json::from_value(json!({
            "phase": "Active", "mode": "gate",
            "conditions": [{"type": "HighlyAvailable", "status": "True", "reason": "StandardHaReady",
                            "message": "ok", "lastTransitionTime": "2026-12-01T10:00:00Z"}]
        }))
        .expect("status"),
    );
    let for_server = drop.clone();
    let server = tokio::spawn(async move {
        let status = expect_status_patch(&mut handle, &for_server).await;
        assert_eq!(status["mode"], "gate", "kept");
        assert_eq!(condition(&status, "HighlyAvailable")["status"], "Unknown");
        assert_eq!(condition(&status, "Ready")["status"], "True");
        // This Redis is new to the drop: the mode is published, then the warning.
        assert_eq!(expect_event(&mut handle).await["reason"], "GateEnabled");
        let event = expect_event(&mut handle).await;
        assert_eq!(
            (event["type"].as_str(), event["reason"].as_str()),
            (Some("Warning"), Some("HighAvailabilityUnknown"))
        );
        (handle, status)
    });
    let action = controller::reconcile(Arc::new(drop.clone()), ctx.clone())
        .await
        .expect("reconciles");
    assert_eq!(
        action,
        Action::requeue(Duration::from_secs(2)),
        "asks again soon"
    );
    let (mut handle, status) = server.await.expect("script ran");
    // Still unanswered: the status again, no second Warning.
    drop.status = Some(serde_json::from_value(status).expect("status"));
    let for_server = drop.clone();
    let server = tokio::spawn(async move {
        let status = expect_status_patch(&mut handle, &for_server).await;
        assert_eq!(status["mode"], "gate");
        handle
    });
    let action = controller::reconcile(Arc::new(drop), ctx.clone())
        .await
        .expect("reconciles");
    assert_eq!(
        action,
        Action::requeue(Duration::from_secs(4)),
        "backing off"
    );
    let handle = server.await.expect("script ran");
    expect_no_more(ctx, handle).await;
}
