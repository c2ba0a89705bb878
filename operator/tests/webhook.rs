//! The injection webhook's HTTP glue on real AdmissionReview v1 JSON, as the API
//! server sends it: the patch it answers, applied to the pod, is the injected pod.

use clap::Parser;
use dropgate_operator::inject::{self, webhook};
use http_body_util::BodyExt;
use serde_json::{Value, json};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    settings: inject::Settings,
}

fn settings() -> inject::Settings {
    Cli::parse_from(["test", "--operator-namespace", "dropgate-system"]).settings
}

/// An AdmissionReview of a CREATE of `pod` in `namespace`.
fn review(pod: Value, namespace: &str, dry_run: bool) -> Value {
    json!({
        "kind": "AdmissionReview",
        "apiVersion": "admission.k8s.io/v1",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": namespace,
            "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
            "object": pod,
            "oldObject": null,
            "dryRun": dry_run,
            "options": {"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1"}
        }
    })
}

fn shop_pod(labels: Value, annotations: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"generateName": "shop-7d9f-", "labels": labels, "annotations": annotations},
        "spec": {"containers": [{"name": "app", "image": "shop:1", "resources": {}}], "restartPolicy": "Always"}
    })
}

/// Sends `body` through the handler; returns the HTTP status and JSON answer.
async fn ask(body: &[u8]) -> (u16, Value) {
    let response = webhook::answer(body, &settings());
    let status = response.status().as_u16();
    let bytes = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    let value = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()));
    (status, value)
}

/// The review's response, checked to answer the request's uid.
async fn response_to(review: &Value) -> Value {
    let (status, answer) = ask(&serde_json::to_vec(review).expect("json")).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(answer["kind"], "AdmissionReview");
    let response = answer["response"].clone();
    assert_eq!(response["uid"], review["request"]["uid"]);
    response
}

/// The pod after applying the response's JSON patch (none: unchanged).
fn patched(pod: &Value, response: &Value) -> Value {
    let mut pod = pod.clone();
    if let Some(bytes) = response["patch"].as_array() {
        assert_eq!(response["patchType"], "JSONPatch");
        let bytes: Vec<u8> = bytes
            .iter()
            .map(|b| b.as_u64().expect("byte") as u8)
            .collect();
        let patch: json_patch::Patch = serde_json::from_slice(&bytes).expect("a JSON patch");
        json_patch::patch(&mut pod, &patch).expect("the patch applies");
    }
    pod
}

#[tokio::test]
async fn a_labelled_pod_is_answered_with_a_patch_that_adds_the_sidecar() {
    let pod = shop_pod(json!({"dropgate.io/inject": "true"}), json!({}));
    let response = response_to(&review(pod.clone(), "shop", false)).await;
    assert_eq!(response["allowed"], true);
    let injected = patched(&pod, &response);
    assert_eq!(
        injected["spec"]["initContainers"][0]["name"],
        "dropgate-sidecar"
    );
    assert_eq!(
        injected["spec"]["initContainers"][0]["restartPolicy"],
        "Always"
    );
    assert_eq!(
        injected["spec"]["containers"], pod["spec"]["containers"],
        "the app is untouched"
    );
    assert_eq!(
        injected["metadata"]["annotations"]["dropgate.io/injected"],
        env!("CARGO_PKG_VERSION")
    );

    // Reinvocation, or a re-apply of the injected pod: nothing more.
    let again = response_to(&review(injected.clone(), "shop", false)).await;
    assert_eq!(again["allowed"], true);
    assert!(again.get("patch").is_none(), "{again}");
}

#[tokio::test]
async fn a_dry_run_is_answered_the_same() {
    let pod = shop_pod(json!({"dropgate.io/inject": "true"}), json!({}));
    let real = response_to(&review(pod.clone(), "shop", false)).await;
    let dry = response_to(&review(pod, "shop", true)).await;
    assert_eq!(real["patch"], dry["patch"]);
}

#[tokio::test]
async fn opted_out_and_protected_pods_are_allowed_unchanged() {
    let cases = [
        (
            shop_pod(json!({"dropgate.io/inject": "false"}), json!({})),
            "shop",
        ),
        (
            shop_pod(json!({"dropgate.io/inject": "true"}), json!({})),
            "kube-system",
        ),
        (
            shop_pod(json!({"dropgate.io/inject": "true"}), json!({})),
            "dropgate-system",
        ),
    ];
    for (pod, namespace) in cases {
        let response = response_to(&review(pod, namespace, false)).await;
        assert_eq!(response["allowed"], true);
        assert!(response.get("patch").is_none(), "{namespace}: {response}");
    }
}

#[tokio::test]
async fn a_malformed_annotation_is_refused_with_its_name() {
    let pod = shop_pod(
        json!({"dropgate.io/inject": "true"}),
        json!({"dropgate.io/sidecar-memory": "lots"}),
    );
    let response = response_to(&review(pod, "shop", false)).await;
    assert_eq!(response["allowed"], false);
    let message = response["status"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("dropgate.io/sidecar-memory") && message.contains("lots"),
        "{response}"
    );
    assert!(response.get("patch").is_none());
}

#[tokio::test]
async fn what_is_not_a_pod_review_gets_a_clear_error() {
    let (status, answer) = ask(b"{not json").await;
    assert_eq!(status, 400);
    assert!(
        answer
            .as_str()
            .is_some_and(|m| m.contains("not an AdmissionReview")),
        "{answer}"
    );
    let (status, _) = ask(br#"{"kind":"AdmissionReview","apiVersion":"admission.k8s.io/v1","request":{"object":{"spec":{"containers":"x"}}}}"#).await;
    assert_eq!(status, 400);
    // A review without a request is answered with a refusal, not a crash.
    let (status, answer) =
        ask(br#"{"kind":"AdmissionReview","apiVersion":"admission.k8s.io/v1","request":null}"#)
            .await;
    assert_eq!(
        (status, &answer["response"]["allowed"]),
        (200, &json!(false)),
        "{answer}"
    );
}
