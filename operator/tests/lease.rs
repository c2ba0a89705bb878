//! Leader election on a Lease, against a scripted API server.

use std::time::Duration;

use dropgate_operator::Error;
use dropgate_operator::lease::{Attempt, LeaderElector, LeaseTimings};
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
    lease_at("41", holder, renewed, transitions)
}

fn lease_at(version: &str, holder: &str, renewed: &str, transitions: i32) -> Value {
    json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "dropgate-operator", "namespace": "dropgate-system", "resourceVersion": version},
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

type Handle = mock::Handle<Request<Body>, Response<Body>>;

fn elector(service: mock::Mock<Request<Body>, Response<Body>>) -> LeaderElector {
    LeaderElector::new(
        Client::new(service, "default"),
        "dropgate-system",
        "dropgate-operator",
        "replica-a",
        LeaseTimings::new(Duration::from_secs(15)),
    )
}

/// Runs `try_acquire` against a server that answers the given script.
async fn acquire_with(script: impl FnOnce(Handle) -> tokio::task::JoinHandle<()>) -> Attempt {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let elector = elector(service);
    let server = script(handle);
    let attempt = elector.try_acquire(now()).await.expect("no API error");
    drop(elector);
    server.await.expect("script ran");
    attempt
}

/// Answers the next request, which must be a GET of the Lease, with `lease`.
async fn answer_get(handle: &mut Handle, status: u16, lease: &Value) {
    let (get, send) = handle.next_request().await.expect("GET");
    assert_eq!((get.method(), get.uri().path()), (&Method::GET, LEASE));
    send.send_response(reply(status, lease));
}

/// Takes the next request, which must be a PUT of the Lease, answers it 200 and
/// returns what was written.
async fn answer_put(handle: &mut Handle) -> Value {
    let (put, send) = handle.next_request().await.expect("PUT");
    assert_eq!((put.method(), put.uri().path()), (&Method::PUT, LEASE));
    let lease = body(put).await;
    send.send_response(reply(200, &lease));
    lease
}

fn server_error() -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "InternalError", "code": 500, "message": "etcdserver: request timed out"})
}

#[tokio::test]
async fn a_missing_lease_is_created_with_us_as_holder() {
    let attempt = acquire_with(|mut handle| {
        tokio::spawn(async move {
            answer_get(&mut handle, 404, &not_found()).await;
            let (create, send) = handle.next_request().await.expect("POST");
            assert_eq!(create.method(), Method::POST);
            assert_eq!(
                create.uri().path(),
                "/apis/coordination.k8s.io/v1/namespaces/dropgate-system/leases"
            );
            let lease = body(create).await;
            assert_eq!(lease["spec"]["holderIdentity"], "replica-a");
            assert_eq!(lease["spec"]["leaseDurationSeconds"], 15);
            assert_eq!(lease["spec"]["leaseTransitions"], 0);
            send.send_response(reply(201, &lease));
            assert!(handle.next_request().await.is_none(), "no further call");
        })
    })
    .await;
    assert_eq!(attempt, Attempt::Leading);
}

#[tokio::test]
async fn another_replicas_lease_is_left_alone_however_old_its_renew_time_looks() {
    // Its renewTime is an hour behind our clock: a skewed clock, not a dead holder.
    // Expiry is judged by how long we have seen the Lease unchanged.
    let attempt = acquire_with(|mut handle| {
        tokio::spawn(async move {
            answer_get(
                &mut handle,
                200,
                &lease("replica-b", "2026-12-01T09:00:00.000000Z", 3),
            )
            .await;
            assert!(
                handle.next_request().await.is_none(),
                "no write to a held lease"
            );
        })
    })
    .await;
    assert_eq!(attempt, Attempt::HeldBy("replica-b".into()));
}

#[tokio::test(start_paused = true)]
async fn a_lease_unchanged_for_a_whole_duration_by_our_clock_is_taken_over() {
    let (service, mut handle) = mock::pair::<Request<Body>, Response<Body>>();
    let elector = elector(service);
    // renewTime in the future by the holder's clock: it does not matter either.
    let held = lease("replica-b", "2026-12-01T10:05:00.000000Z", 3);
    let server = tokio::spawn(async move {
        answer_get(&mut handle, 200, &held).await;
        answer_get(&mut handle, 200, &held).await;
        answer_get(&mut handle, 200, &held).await;
        let taken = answer_put(&mut handle).await;
        assert_eq!(
            taken["metadata"]["resourceVersion"], "41",
            "optimistic concurrency"
        );
        assert_eq!(taken["spec"]["holderIdentity"], "replica-a");
        assert_eq!(taken["spec"]["leaseTransitions"], 4);
        assert_eq!(taken["spec"]["acquireTime"], "2026-12-01T10:00:00.000000Z");
    });
    assert_eq!(
        elector.try_acquire(now()).await.expect("ok"),
        Attempt::HeldBy("replica-b".into())
    );
    tokio::time::advance(Duration::from_secs(14)).await;
    assert_eq!(
        elector.try_acquire(now()).await.expect("ok"),
        Attempt::HeldBy("replica-b".into())
    );
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(
        elector.try_acquire(now()).await.expect("ok"),
        Attempt::Leading
    );
    server.await.expect("script ran");
}

#[tokio::test(start_paused = true)]
async fn a_lease_renewed_meanwhile_is_not_taken_over() {
    let (service, mut handle) = mock::pair::<Request<Body>, Response<Body>>();
    let elector = elector(service);
    let server = tokio::spawn(async move {
        answer_get(
            &mut handle,
            200,
            &lease_at("41", "replica-b", "2026-12-01T09:00:00.000000Z", 3),
        )
        .await;
        // Renewed (a new resourceVersion) 10 s later: the count starts again.
        answer_get(
            &mut handle,
            200,
            &lease_at("42", "replica-b", "2026-12-01T09:00:10.000000Z", 3),
        )
        .await;
        answer_get(
            &mut handle,
            200,
            &lease_at("42", "replica-b", "2026-12-01T09:00:10.000000Z", 3),
        )
        .await;
        assert!(handle.next_request().await.is_none(), "never written");
    });
    assert!(matches!(
        elector.try_acquire(now()).await,
        Ok(Attempt::HeldBy(_))
    ));
    tokio::time::advance(Duration::from_secs(10)).await;
    assert!(matches!(
        elector.try_acquire(now()).await,
        Ok(Attempt::HeldBy(_))
    ));
    tokio::time::advance(Duration::from_secs(10)).await;
    assert!(
        matches!(elector.try_acquire(now()).await, Ok(Attempt::HeldBy(_))),
        "20 s since first sight, but only 10 s since the last renewal"
    );
    drop(elector);
    server.await.expect("script ran");
}

#[tokio::test]
async fn a_released_lease_is_taken_at_once() {
    let attempt = acquire_with(|mut handle| {
        tokio::spawn(async move {
            let mut released = lease("", "2026-12-01T09:59:59.000000Z", 5);
            released["spec"]["holderIdentity"] = Value::Null;
            answer_get(&mut handle, 200, &released).await;
            let taken = answer_put(&mut handle).await;
            assert_eq!(taken["spec"]["holderIdentity"], "replica-a");
            assert_eq!(taken["spec"]["leaseTransitions"], 6);
        })
    })
    .await;
    assert_eq!(attempt, Attempt::Leading);
}

#[tokio::test]
async fn losing_the_race_for_a_lease_is_not_winning() {
    let attempt = acquire_with(|mut handle| {
        tokio::spawn(async move {
            let mut released = lease("", "2026-12-01T09:00:00.000000Z", 1);
            released["spec"]["holderIdentity"] = Value::Null;
            answer_get(&mut handle, 200, &released).await;
            let (_, send) = handle.next_request().await.expect("PUT");
            send.send_response(reply(409, &conflict()));
        })
    })
    .await;
    assert_eq!(attempt, Attempt::Conflict);
}

#[tokio::test]
async fn our_own_lease_is_renewed() {
    let attempt = acquire_with(|mut handle| {
        tokio::spawn(async move {
            answer_get(
                &mut handle,
                200,
                &lease("replica-a", "2026-12-01T09:59:58.000000Z", 2),
            )
            .await;
            let lease = answer_put(&mut handle).await;
            assert_eq!(
                lease["spec"]["leaseTransitions"], 2,
                "a renewal is no transition"
            );
            assert_eq!(
                lease["spec"]["acquireTime"], "2026-12-01T09:59:58.000000Z",
                "kept"
            );
            assert_eq!(lease["spec"]["renewTime"], "2026-12-01T10:00:00.000000Z");
        })
    })
    .await;
    assert_eq!(attempt, Attempt::Leading);
}

/// Takes the Lease for the leader loop: GET (missing) and POST.
async fn grant(handle: &mut Handle) {
    answer_get(handle, 404, &not_found()).await;
    let (create, send) = handle.next_request().await.expect("POST");
    let lease = body(create).await;
    let mut stored = lease.clone();
    stored["metadata"]["resourceVersion"] = json!("1");
    send.send_response(reply(201, &stored));
}

#[tokio::test(start_paused = true)]
async fn one_failed_renewal_is_retried_and_shutdown_releases_the_lease() {
    let (service, mut handle) = mock::pair::<Request<Body>, Response<Body>>();
    let elector = elector(service);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        grant(&mut handle).await;
        answer_get(&mut handle, 500, &server_error()).await;
        let ours = lease_at("1", "replica-a", "2026-12-01T10:00:00.000000Z", 0);
        answer_get(&mut handle, 200, &ours).await;
        answer_put(&mut handle).await;
        stop.send(()).expect("leader still running");
        // Released: the holder cleared, so that a follower need not wait.
        answer_get(&mut handle, 200, &ours).await;
        let released = answer_put(&mut handle).await;
        assert!(released["spec"]["holderIdentity"].is_null(), "{released}");
    });
    let led = std::sync::Mutex::new(Vec::new());
    let result = elector
        .run_as_leader(
            std::future::pending::<()>(),
            async {
                let _ = stopped.await;
            },
            |leading| led.lock().expect("lock").push(leading),
        )
        .await;
    assert!(result.is_ok(), "{result:?}");
    assert_eq!(*led.lock().expect("lock"), [true, false]);
    server.await.expect("script ran");
}

#[tokio::test(start_paused = true)]
async fn a_leader_that_cannot_renew_stops_before_anyone_may_take_over() {
    let (service, mut handle) = mock::pair::<Request<Body>, Response<Body>>();
    let elector = elector(service);
    let server = tokio::spawn(async move {
        grant(&mut handle).await;
        // Every renewal fails from here on.
        while let Some((_, send)) = handle.next_request().await {
            send.send_response(reply(500, &server_error()));
        }
    });
    let leading_since = std::sync::Mutex::new(None);
    let result = elector
        .run_as_leader(
            std::future::pending::<()>(),
            std::future::pending::<()>(),
            |leading| {
                if leading {
                    *leading_since.lock().expect("lock") = Some(tokio::time::Instant::now());
                }
            },
        )
        .await;
    assert!(
        matches!(result, Err(Error::LeadershipLost(_))),
        "{result:?}"
    );
    let led_for = leading_since
        .lock()
        .expect("lock")
        .expect("it led")
        .elapsed();
    // Virtual time: the renew deadline (10 s of the 15 s lease), never the lease.
    assert!(led_for <= Duration::from_secs(10), "{led_for:?}");
    drop(elector);
    server.await.expect("script ran");
}
