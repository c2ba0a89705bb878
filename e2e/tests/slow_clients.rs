//! Slow and hostile clients against the real sidecar binary: thousands of silent and
//! trickling connections on its probe port (reachable from any pod) and on its API
//! port cannot grow its memory past a bound or stop it answering.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use dropgate_e2e::processes::{SidecarProcess, apply, sale_manifest};
use dropgate_testkit::{DropSpec, HttpClient, RedisServer};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpSocket, TcpStream};

/// The sidecar's resident memory may grow this much under the attack: its two
/// listeners hold 128 + 1,024 connections at most, each about 25 KiB while it waits
/// for a head (hyper's read and write buffers, the task: ~34 MiB measured in a debug
/// build), and only the 128 of the probe port are reachable from other pods; the injected
/// container's limit is 64 MiB. Without the caps, memory grew with every connection
/// (10,000 half-sent heads: 177 MB).
const RSS_GROWTH_BOUND_KB: u64 = 48 * 1024;

async fn connect_from(from: [u8; 4], to: SocketAddr) -> Option<TcpStream> {
    let socket = TcpSocket::new_v4().ok()?;
    socket.bind(SocketAddr::from((from, 0))).ok()?;
    tokio::time::timeout(Duration::from_secs(2), socket.connect(to))
        .await
        .ok()?
        .ok()
}

/// One attacking connection, kept up until `stop`: silent, or a request head sent
/// one byte a second; it connects again whenever the sidecar closes it.
async fn attack(from: [u8; 4], to: SocketAddr, trickle: bool, stop: Arc<AtomicBool>) {
    let head = b"GET /metrics HTTP/1.1\r\nhost: x\r\nx-padding: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    while !stop.load(Ordering::Relaxed) {
        let Some(mut stream) = connect_from(from, to).await else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        let mut sent = 0;
        while !stop.load(Ordering::Relaxed) {
            if trickle {
                let byte = head[sent % head.len()];
                if stream.write_all(&[byte]).await.is_err() {
                    break;
                }
                sent += 1;
            } else {
                // A silent client learns of the close when it tries to write.
                if stream.write_all(b"").await.is_err() || stream.peer_addr().is_err() {
                    break;
                }
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thousands_of_slow_clients_leave_the_sidecar_bounded_and_answering() {
    let redis = RedisServer::start().expect("redis-server");
    let dir = tempfile::tempdir().expect("dir");
    let manifest = sale_manifest(dir.path(), &DropSpec::new(100_000).yaml()).expect("manifest");
    apply(&manifest, &redis.url()).expect("apply");
    let health_port = dropgate_testkit::free_port().expect("port");
    let health = format!("127.0.0.1:{health_port}");
    let ledger = format!("sqlite://{}", dir.path().join("ledger.db").display());
    let sidecar =
        SidecarProcess::start_with(&redis.url(), "shop", &ledger, &["--health-listen", &health])
            .await
            .expect("sidecar");
    let api = HttpClient::new(sidecar.base.clone());
    // A new connection per probe, as the kubelet's (keep-alive off).
    let probe = HttpClient::without_keep_alive(format!("http://{health}"));
    // Warm up: the drop known, a reservation made, the ledger open.
    let first = api
        .post(
            "/v1/drops/sale/reservations",
            r#"{"key":"warm","user":"warm","quantity":1}"#,
        )
        .await
        .expect("answers");
    assert_eq!(first.status, 201, "{}", first.text);
    let baseline = dropgate_testkit::resident_kb(sidecar.pid());

    let api_addr: SocketAddr = sidecar
        .base
        .trim_start_matches("http://")
        .parse()
        .expect("api address");
    let health_addr: SocketAddr = health.parse().expect("health address");
    let stop = Arc::new(AtomicBool::new(false));
    let mut attackers = Vec::new();
    // 7,000 on the probe port from 350 addresses (20 each, past the per-address
    // share of 16), half of them trickling; 3,000 on the API port (past its 1,024).
    for i in 0..7000u32 {
        let from = [127, 0, 1 + (i / 20 / 250) as u8, 1 + ((i / 20) % 250) as u8];
        attackers.push(tokio::spawn(attack(
            from,
            health_addr,
            i % 2 == 0,
            stop.clone(),
        )));
    }
    for i in 0..3000u32 {
        let from = [127, 0, 3, 1 + (i % 200) as u8];
        attackers.push(tokio::spawn(attack(
            from,
            api_addr,
            i % 2 == 0,
            stop.clone(),
        )));
    }

    // For twice the probe port's head timeout (so that closed attackers came back):
    // the API sells, the probe port answers another address, memory stays bounded.
    let mut peak = baseline;
    let mut sold = 0;
    let mut probe_failures = 0;
    for round in 0..20 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let body = format!(r#"{{"key":"k{round}","user":"u{round}","quantity":1}}"#);
        let reply = api
            .post("/v1/drops/sale/reservations", &body)
            .await
            .expect("the API answers under attack");
        assert_eq!(reply.status, 201, "{}", reply.text);
        sold += 1;
        // As the kubelet probes: a failure counts only after its failureThreshold
        // (3 by default) in a row, the probes its periodSeconds apart (1 s at the
        // least). A full probe port may close a new connection it cannot tell from
        // the flood's; it must never turn the probe away three times running.
        let mut failures = Vec::new();
        let healthz = loop {
            match probe.get("/healthz").await {
                Ok(answer) => break answer,
                Err(error) if failures.len() < 2 => {
                    failures.push(error);
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Err(error) => {
                    panic!("the probe port failed three probes in a row: {failures:?}, {error}")
                }
            }
        };
        assert_eq!(healthz.status, 200);
        probe_failures += failures.len();
        peak = peak.max(dropgate_testkit::resident_kb(sidecar.pid()));
    }
    stop.store(true, Ordering::Relaxed);
    for attacker in attackers {
        attacker.abort();
    }
    eprintln!(
        "slow clients: RSS {baseline} KiB before, {peak} KiB at most under 10,000 attacking connections; {sold} reservations meanwhile; {probe_failures} of the probes failed (none three in a row)"
    );
    assert!(
        peak < baseline + RSS_GROWTH_BOUND_KB,
        "RSS grew from {baseline} KiB to {peak} KiB"
    );
}
