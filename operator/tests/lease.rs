//! Leader election on a Lease, against a scripted API server.

use std::time::Duration;

use dropgate_operator::lease::LeaderElector;
use http::{Method, Request, Response};
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::client::Body;
use serde_json::{Value, json};
use tower_test::mock;

const LEASE: &str =
    "/apis/coordination.k8s.io/v1/namespaces/dropgate-system/leases/dropgate-operator";

fn now() -> Timestamp {
    "2026-12-01T10:00:00Z".parse().expect("ts")
}

fn lease(holder: &str, renewed: &str, transitions: i32) -> Value {
    json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "dropgate-operator", "namespace": "dropgate-system", "resourceVersion": "41"},
        "spec": {
            "holderIdentity": holder,
            "leaseDurationSeconds": 15,
            "acquireTime": renewed,
            "renewTime": renewed,
            "leaseTransitions": transitions
        }
    })
}

fn reply(status: u16, body: &Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .body(Body::from(serde_json::to_vec(body).expect("json")))
        .expect("response")
}

fn not_found() -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404, "message": "not found"})
}

fn conflict() -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Conflict", "code": 409, "message": "conflict"})
}

async fn body(request: Request<Body>) -> Value {
    serde_json::from_slice(&request.into_body().collect_bytes().await.expect("body")).expect("json")
}

/// Runs `try_acquire` against a server that answers the given script.
async fn acquire_with(
    script: impl FnOnce(mock::Handle<Request<Body>, Response<Body>>) -> tokio::task::JoinHandle<()>,
) -> bool {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let elector = LeaderElector::new(
        Client::new(service, "default"),
        "dropgate-system",
        "dropgate-operator",
        "replica-a",
        Duration::from_secs(15),
    );
    let server = script(handle);
    let won = elector.try_acquire(now()).await.expect("no API error");
    drop(elector);
    server.await.expect("script ran");
    won
}

#[tokio::test]
async fn a_missing_lease_is_created_with_us_as_holder() {
    let won = acquire_with(|mut handle| {
        tokio::spawn(async move {
            let (get, send) = handle.next_request().await.expect("GET");
            assert_eq!((get.method(), get.uri().path()), (&Method::GET, LEASE));
            send.send_response(reply(404, &not_found()));
            let (create, send) = handle.next_request().await.expect("POST");
            assert_eq!(create.method(), Method::POST);
            assert_eq!(
                create.uri().path(),
                "/apis/coordination.k8s.io/v1/namespaces/dropgate-system/leases"
            );
            let lease = body(create).await;
            assert_eq!(lease["spec"]["holderIdentity"], "replica-a");
            assert_eq!(lease["spec"]["leaseDurationSeconds"], 15);
            send.send_response(reply(201, &lease));
            assert!(handle.next_request().await.is_none(), "no further call");
        })
    })
    .await;
    assert!(won);
}

#[tokio::test]
async fn a_fresh_lease_of_another_replica_is_left_alone() {
    let won = acquire_with(|mut handle| {
        tokio::spawn(async move {
            let (_, send) = handle.next_request().await.expect("GET");
            send.send_response(reply(
                200,
                &lease("replica-b", "2026-12-01T09:59:55.000000Z", 3),
            ));
            assert!(
                handle.next_request().await.is_none(),
                "no write to a held lease"
            );
        })
    })
    .await;
    assert!(!won);
}

#[tokio::test]
async fn an_expired_lease_is_taken_over_with_its_resource_version() {
    let won = acquire_with(|mut handle| {
        tokio::spawn(async move {
            let (_, send) = handle.next_request().await.expect("GET");
            send.send_response(reply(
                200,
                &lease("replica-b", "2026-12-01T09:59:30.000000Z", 3),
            ));
            let (put, send) = handle.next_request().await.expect("PUT");
            assert_eq!((put.method(), put.uri().path()), (&Method::PUT, LEASE));
            let lease = body(put).await;
            assert_eq!(
                lease["metadata"]["resourceVersion"], "41",
                "optimistic concurrency"
            );
            assert_eq!(lease["spec"]["holderIdentity"], "replica-a");
            assert_eq!(lease["spec"]["leaseTransitions"], 4);
            send.send_response(reply(200, &lease));
            assert!(handle.next_request().await.is_none());
        })
    })
    .await;
    assert!(won);
}

#[tokio::test]
async fn losing_the_race_for_a_lease_is_not_winning() {
    let won = acquire_with(|mut handle| {
        tokio::spawn(async move {
            let (_, send) = handle.next_request().await.expect("GET");
            send.send_response(reply(
                200,
                &lease("replica-b", "2026-12-01T09:00:00.000000Z", 1),
            ));
            let (_, send) = handle.next_request().await.expect("PUT");
            send.send_response(reply(409, &conflict()));
        })
    })
    .await;
    assert!(!won);
}

#[tokio::test]
async fn our_own_lease_is_renewed() {
    let won = acquire_with(|mut handle| {
        tokio::spawn(async move {
            let (_, send) = handle.next_request().await.expect("GET");
            send.send_response(reply(
                200,
                &lease("replica-a", "2026-12-01T09:59:58.000000Z", 2),
            ));
            let (put, send) = handle.next_request().await.expect("PUT");
            let lease = body(put).await;
            assert_eq!(
                lease["spec"]["leaseTransitions"], 2,
                "a renewal is no transition"
            );
            assert_eq!(lease["spec"]["renewTime"], "2026-12-01T10:00:00.000000Z");
            send.send_response(reply(200, &lease));
        })
    })
    .await;
    assert!(won);
}
