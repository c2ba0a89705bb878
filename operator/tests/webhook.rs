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

/// A shop's pod; one that names no ledger opts into a per-pod one (a pod that
/// names neither is refused, see `a_pod_that_names_no_ledger_is_refused`).
fn shop_pod(labels: Value, mut annotations: Value) -> Value {
    if let Some(map) = annotations.as_object_mut()
        && !map.contains_key("dropgate.io/database-secret")
        && !map.contains_key("dropgate.io/ledger")
    {
        map.insert("dropgate.io/ledger".into(), "per-pod".into());
    }
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
    assert!(again.get("warnings").is_none(), "{again}");
}

#[tokio::test]
async fn a_pod_injected_by_an_older_dropgate_is_let_through_with_a_warning() {
    let mut pod = shop_pod(json!({"dropgate.io/inject": "true"}), json!({}));
    pod["spec"]["initContainers"] = json!([{"name": "dropgate-sidecar", "image": "dropgate:0.0.9",
        "env": [{"name": "DROPGATE_NAMESPACE", "value": "shop"}]}]);
    let response = response_to(&review(pod, "shop", false)).await;
    assert_eq!(response["allowed"], true);
    assert!(response.get("patch").is_none(), "{response}");
    let warning = response["warnings"][0].as_str().unwrap_or_default();
    assert!(
        warning.contains("does not watch its drops") && warning.contains("inject -f"),
        "{response}"
    );
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
async fn a_pod_that_names_no_ledger_is_refused() {
    let mut pod = shop_pod(json!({"dropgate.io/inject": "true"}), json!({}));
    pod["metadata"]["annotations"] = json!({});
    let response = response_to(&review(pod, "shop", false)).await;
    assert_eq!(response["allowed"], false, "{response}");
    let message = response["status"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("dropgate.io/ledger: per-pod"), "{message}");
    assert!(message.contains("dropgate.io/database-secret"), "{message}");
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

/// Makes, in `dir`, a CA and a serving certificate for 127.0.0.1 that it signed,
/// with the openssl command: an RSA key in PKCS#1, as the chart's genSignedCert
/// writes it, or an ECDSA key in PKCS#8, as cert-manager does. Returns (CA
/// certificate, serving certificate, its key), PEM.
fn issued(dir: &std::path::Path, name: &str, ecdsa: bool) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    let path = |file: &str| dir.join(format!("{name}-{file}")).display().to_string();
    let run = |args: &[&str]| {
        let out = std::process::Command::new("openssl")
            .args(args)
            .output()
            .expect("openssl runs");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let (ca_crt, ca_key, crt, key) = (
        path("ca.crt"),
        path("ca.key"),
        path("tls.crt"),
        path("tls.key"),
    );
    run(&[
        "req",
        "-x509",
        "-nodes",
        "-days",
        "1",
        "-newkey",
        "rsa:2048",
        "-subj",
        &format!("/CN={name}-ca"),
        "-keyout",
        &ca_key,
        "-out",
        &ca_crt,
    ]);
    let newkey: &[&str] = if ecdsa {
        &["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"]
    } else {
        &["-newkey", "rsa:2048"]
    };
    let mut leaf = vec![
        "req", "-x509", "-nodes", "-days", "1", "-CA", &ca_crt, "-CAkey", &ca_key,
    ];
    leaf.extend_from_slice(newkey);
    leaf.extend_from_slice(&[
        "-subj",
        "/CN=127.0.0.1",
        "-addext",
        "subjectAltName=IP:127.0.0.1",
        "-addext",
        "basicConstraints=critical,CA:FALSE",
        "-keyout",
        &key,
        "-out",
        &crt,
    ]);
    run(&leaf);
    if !ecdsa {
        run(&["rsa", "-in", &key, "-traditional", "-out", &key]);
    }
    let read = |p: &str| std::fs::read(p).expect("read");
    (read(&ca_crt), read(&crt), read(&key))
}

/// POSTs a pod review to the webhook over TLS, trusting only `ca`; the raw
/// HTTP answer, or why the handshake failed.
async fn post_over_tls(port: u16, ca: &[u8]) -> Result<String, String> {
    use rustls::pki_types::pem::PemObject;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_slice_iter(ca) {
        roots.add(cert.expect("pem")).expect("root");
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| e.to_string())?;
    let name = rustls::pki_types::ServerName::IpAddress(std::net::Ipv4Addr::LOCALHOST.into());
    let mut tls = connector
        .connect(name, tcp)
        .await
        .map_err(|e| e.to_string())?;
    let body = serde_json::to_vec(&review(
        shop_pod(json!({"dropgate.io/inject": "true"}), json!({})),
        "shop",
        false,
    ))
    .expect("json");
    let head = format!(
        "POST /mutate HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    tls.write_all(head.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    tls.write_all(&body).await.map_err(|e| e.to_string())?;
    let mut answer = String::new();
    tls.read_to_string(&mut answer)
        .await
        .map_err(|e| e.to_string())?;
    Ok(answer)
}

#[tokio::test]
async fn the_webhook_serves_tls_and_picks_up_a_rotated_certificate() {
    let dir = tempfile::tempdir().expect("dir");
    let served = dir.path().join("served");
    std::fs::create_dir(&served).expect("dir");
    let (first_ca, first_crt, first_key) = issued(dir.path(), "first", false);
    let (second_ca, second_crt, second_key) = issued(dir.path(), "second", true);
    std::fs::write(served.join("tls.crt"), &first_crt).expect("write");
    std::fs::write(served.join("tls.key"), &first_key).expect("write");

    let port = dropgate_testkit::free_port().expect("port");
    let shutdown = tokio_util::sync::CancellationToken::new();
    let bound = webhook::Webhook::bind(([127, 0, 0, 1], port).into(), served.clone(), settings())
        .await
        .expect("binds with the first certificate");
    let server = tokio::spawn(bound.run(shutdown.clone()));
    let mut answer = Err(String::new());
    for _ in 0..50 {
        answer = post_over_tls(port, &first_ca).await;
        if answer.is_ok() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let answer = answer.expect("served with the first certificate");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("\"patchType\":\"JSONPatch\""), "{answer}");

    // The Secret is rotated: the next handshakes present the new certificate.
    std::fs::write(served.join("tls.key"), &second_key).expect("write");
    std::fs::write(served.join("tls.crt"), &second_crt).expect("write");
    let mut rotated = false;
    for _ in 0..100 {
        if post_over_tls(port, &second_ca).await.is_ok() {
            rotated = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(rotated, "the rotated certificate was never served");
    assert!(
        post_over_tls(port, &first_crt).await.is_err(),
        "the old one is gone"
    );

    // A half-written rotation (no key yet) keeps the current pair.
    std::fs::write(served.join("tls.key"), b"").expect("write");
    tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
    assert!(post_over_tls(port, &second_ca).await.is_ok());

    shutdown.cancel();
    server.await.expect("joins");
}

#[tokio::test]
async fn a_webhook_without_a_usable_certificate_does_not_start() {
    let dir = tempfile::tempdir().expect("dir");
    let port = dropgate_testkit::free_port().expect("port");
    let addr = ([127, 0, 0, 1], port).into();
    let missing = webhook::Webhook::bind(addr, dir.path().to_path_buf(), settings()).await;
    assert!(missing.is_err_and(|e| e.contains("tls.crt")));
    std::fs::write(dir.path().join("tls.crt"), b"not a certificate").expect("write");
    std::fs::write(dir.path().join("tls.key"), b"not a key").expect("write");
    let garbage = webhook::Webhook::bind(addr, dir.path().to_path_buf(), settings()).await;
    assert!(garbage.is_err(), "refused");
}

/// A TLS connection from the loopback address `from`, trusting only `ca`.
async fn tls_from(
    from: [u8; 4],
    port: u16,
    ca: &[u8],
) -> Option<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_slice_iter(ca) {
        roots.add(cert.ok()?).ok()?;
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .ok()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let socket = tokio::net::TcpSocket::new_v4().ok()?;
    socket.bind(std::net::SocketAddr::from((from, 0))).ok()?;
    let tcp = socket
        .connect(std::net::SocketAddr::from(([127, 0, 0, 1], port)))
        .await
        .ok()?;
    let name = rustls::pki_types::ServerName::IpAddress(std::net::Ipv4Addr::LOCALHOST.into());
    tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
        .connect(name, tcp)
        .await
        .ok()
}

/// The chart's `webhook.timeoutSeconds`: how long the API server waits for a review.
const API_SERVER_GIVES_UP_AFTER: std::time::Duration = std::time::Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slow_clients_announcing_big_reviews_cannot_stall_the_webhook() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use tokio::io::AsyncWriteExt;
    let dir = tempfile::tempdir().expect("dir");
    let served = dir.path().join("served");
    std::fs::create_dir(&served).expect("dir");
    let (ca, crt, key) = issued(dir.path(), "webhook", true);
    std::fs::write(served.join("tls.crt"), &crt).expect("write");
    std::fs::write(served.join("tls.key"), &key).expect("write");
    let port = dropgate_testkit::free_port().expect("port");
    let admin = dropgate_testkit::free_port().expect("port");
    // The release binary's way in: `dropgate-operator run`, as the chart starts it.
    // Its API server is nowhere (no lease is ever won), which leaves the webhook,
    // served by every replica whether it leads or not.
    let kubeconfig = nowhere_kubeconfig(dir.path());
    let mut operator = std::process::Command::new(env!("CARGO_BIN_EXE_dropgate-operator"))
        .args(["run", "--webhook-listen", &format!("127.0.0.1:{port}")])
        .arg("--webhook-cert-dir")
        .arg(&served)
        .args(["--admin-listen", &format!("127.0.0.1:{admin}")])
        .env("KUBECONFIG", &kubeconfig)
        .env("RUST_LOG", "off")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("dropgate-operator runs");
    let mut up = false;
    for _ in 0..200 {
        if post_over_tls(port, &ca).await.is_ok() {
            up = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(up, "the webhook of dropgate-operator run never answered");
    let baseline = dropgate_testkit::resident_kb(operator.id());

    // 1,200 connections from 12 addresses (past the listener's 1,024), each
    // announcing a 3 MB review and sending it a byte a second, connecting again
    // whenever the webhook closes it.
    let stop = Arc::new(AtomicBool::new(false));
    let ca = Arc::new(ca);
    let mut attackers = Vec::new();
    for i in 0..1200u32 {
        let (stop, ca) = (stop.clone(), ca.clone());
        let from = [127, 0, 4, 1 + (i % 12) as u8];
        attackers.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let Some(mut tls) = tls_from(from, port, &ca).await else {
                    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                    continue;
                };
                let head = "POST /mutate HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: 3000000\r\n\r\n{";
                if tls.write_all(head.as_bytes()).await.is_err() {
                    continue;
                }
                while !stop.load(Ordering::Relaxed) {
                    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                    if tls.write_all(b" ").await.is_err() {
                        break;
                    }
                }
            }
        }));
    }
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    // Meanwhile the API server's reviews are answered, for longer than the body
    // timeout (so that attackers that were closed came back), each within the
    // chart's webhook timeoutSeconds: past it the API server gives up on the review
    // and, with failurePolicy Fail, refuses the pod.
    for _ in 0..8 {
        let answer = tokio::time::timeout(API_SERVER_GIVES_UP_AFTER, post_over_tls(port, &ca))
            .await
            .expect("answered before the API server gives up, under attack")
            .expect("admitted under attack");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.contains("\"patchType\":\"JSONPatch\""), "{answer}");
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
    let under_attack = dropgate_testkit::resident_kb(operator.id());
    eprintln!("dropgate-operator RSS: {baseline} kB before the attack, {under_attack} kB under it");
    stop.store(true, Ordering::Relaxed);
    for attacker in attackers {
        attacker.abort();
    }
    assert!(
        operator.try_wait().expect("waits").is_none(),
        "the operator exited under attack"
    );
    let _ = operator.kill();
    let _ = operator.wait();
    // Under the chart's memory limit for the operator (256Mi), with room to spare:
    // what the kubelet would kill it past.
    assert!(
        under_attack < OPERATOR_RSS_BOUND_KB,
        "the operator grew from {baseline} kB to {under_attack} kB under attack"
    );
}

/// The most memory the operator may use under the attack above (kB): half the
/// chart's limit of 256Mi.
const OPERATOR_RSS_BOUND_KB: u64 = 128 * 1024;

/// A kubeconfig whose API server is nowhere: `dropgate-operator run` starts (its
/// client connects lazily), never leads, and serves its webhook.
fn nowhere_kubeconfig(dir: &std::path::Path) -> std::path::PathBuf {
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        "apiVersion: v1\nkind: Config\ncurrent-context: none\n\
         clusters: [{name: none, cluster: {server: \"https://127.0.0.1:1\"}}]\n\
         users: [{name: none, user: {token: none}}]\n\
         contexts: [{name: none, context: {cluster: none, user: none}}]\n",
    )
    .expect("write");
    kubeconfig
}

/// `dropgate-operator run` whose webhook port is taken stops with an error naming
/// it, rather than running on without admitting pods.
#[test]
fn run_stops_when_its_webhook_port_is_taken() {
    let dir = tempfile::tempdir().expect("dir");
    let served = dir.path().join("served");
    std::fs::create_dir(&served).expect("dir");
    let (_, crt, key) = issued(dir.path(), "webhook", true);
    std::fs::write(served.join("tls.crt"), &crt).expect("write");
    std::fs::write(served.join("tls.key"), &key).expect("write");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
    let addr = taken.local_addr().expect("its address");
    let admin = dropgate_testkit::free_port().expect("port");
    let mut operator = std::process::Command::new(env!("CARGO_BIN_EXE_dropgate-operator"))
        .args(["run", "--webhook-listen", &addr.to_string()])
        .arg("--webhook-cert-dir")
        .arg(&served)
        .args(["--admin-listen", &format!("127.0.0.1:{admin}")])
        .env("KUBECONFIG", nowhere_kubeconfig(dir.path()))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("dropgate-operator runs");
    // Bounded: a process that ran on is killed here and fails the test.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while operator.try_wait().expect("waits").is_none() {
        if std::time::Instant::now() > deadline {
            let _ = operator.kill();
            panic!("dropgate-operator kept running with its webhook port taken");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = operator.wait_with_output().expect("it exits");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("cannot listen on {addr} for the webhook")),
        "{stderr}"
    );
    drop(taken);
}
