//! The listener's limits, against real sockets: what a silent, trickling, greedy or
//! oversized client gets, and that ordinary requests are served meanwhile.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use dropgate_listener::{Limits, plain, serve};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio_util::sync::CancellationToken;

/// Small limits, so that every timeout passes within a test.
const LIMITS: Limits = Limits {
    max_connections: 8,
    max_per_peer: 6,
    head_timeout: Duration::from_millis(300),
    body_timeout: Duration::from_millis(300),
    max_body: 1024,
    body_budget: 4096,
    max_age: Duration::from_secs(60),
    evict_idle: true,
    evict_silent_after: Duration::from_secs(1),
    accept_queue: 1024,
};

/// How long a test waits for something that must happen (a close, an answer):
/// far past the limits above, so only a listener that never does it fails.
const EVENTUALLY: Duration = Duration::from_secs(10);

/// A listener on a free port answering "ok <body length>", stopped on drop.
struct Server {
    addr: SocketAddr,
    stop: CancellationToken,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn start(limits: Limits) -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let stop = CancellationToken::new();
    let handler = |request: Request<Full<Bytes>>| async move {
        let body = request.into_body().collect().await.map(|b| b.to_bytes());
        let n = body.map(|b| b.len()).unwrap_or(0);
        Response::new(Full::new(Bytes::from(format!("ok {n}"))))
    };
    let refuse = |status: StatusCode, message: String| {
        let mut response = Response::new(Full::new(Bytes::from(message)));
        *response.status_mut() = status;
        response
    };
    tokio::spawn(serve(
        listener,
        limits,
        plain,
        handler,
        refuse,
        stop.clone().cancelled_owned(),
    ));
    Server { addr, stop }
}

/// A connection from the loopback address `from` (127.0.0.x: every one is this
/// machine, but a peer of its own to the listener).
async fn connect_from(from: [u8; 4], to: SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().expect("socket");
    socket
        .bind(SocketAddr::from((from, 0)))
        .expect("bind the source address");
    socket.connect(to).await.expect("connect")
}

/// One GET on a new connection; the raw answer.
async fn get(from: [u8; 4], to: SocketAddr) -> String {
    let mut stream = connect_from(from, to).await;
    stream
        .write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .expect("write");
    read_all(&mut stream).await
}

async fn read_all(stream: &mut TcpStream) -> String {
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(EVENTUALLY, stream.read_to_end(&mut answer)).await;
    String::from_utf8_lossy(&answer).into_owned()
}

/// Whether the server closes `stream` (EOF or reset) while the client stays silent.
async fn closed_by_server(stream: &mut TcpStream) -> bool {
    let mut buf = [0u8; 256];
    loop {
        match tokio::time::timeout(EVENTUALLY, stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue,
            Err(_) => return false,
        }
    }
}

#[tokio::test]
async fn a_silent_connection_is_closed() {
    let server = start(LIMITS).await;
    let mut silent = connect_from([127, 0, 0, 1], server.addr).await;
    assert!(closed_by_server(&mut silent).await);
}

#[tokio::test]
async fn a_head_sent_a_byte_at_a_time_is_closed() {
    let server = start(LIMITS).await;
    let mut trickle = connect_from([127, 0, 0, 1], server.addr).await;
    let head = b"GET / HTTP/1.1\r\nhost: x\r\nx-slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n\r\n";
    let mut closed = false;
    for byte in head {
        if trickle.write_all(&[*byte]).await.is_err() {
            closed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(closed || closed_by_server(&mut trickle).await);
    let mut answer = [0u8; 64];
    let read = trickle.read(&mut answer).await.unwrap_or(0);
    assert!(
        !String::from_utf8_lossy(&answer[..read]).contains("ok"),
        "a head that took too long is never served"
    );
}

#[tokio::test]
async fn an_idle_kept_alive_connection_is_closed() {
    let server = start(LIMITS).await;
    let mut kept = connect_from([127, 0, 0, 1], server.addr).await;
    kept.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .expect("write");
    let mut buf = [0u8; 256];
    let n = kept.read(&mut buf).await.expect("answered");
    assert!(String::from_utf8_lossy(&buf[..n]).contains("ok 0"));
    assert!(closed_by_server(&mut kept).await);
}

#[tokio::test]
async fn a_body_that_trickles_past_its_deadline_is_refused_with_408() {
    let server = start(LIMITS).await;
    let mut slow = connect_from([127, 0, 0, 1], server.addr).await;
    slow.write_all(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n")
        .await
        .expect("write");
    for _ in 0..10 {
        if slow.write_all(b"a").await.is_err() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let answer = read_all(&mut slow).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
}

#[tokio::test]
async fn a_body_over_the_limit_is_refused_with_413_before_it_is_read() {
    let server = start(LIMITS).await;
    let mut big = connect_from([127, 0, 0, 1], server.addr).await;
    big.write_all(
        b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 3000000\r\nconnection: close\r\n\r\n",
    )
    .await
    .expect("write");
    let answer = read_all(&mut big).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    // A chunked body (no Content-Length) is cut off at the limit too.
    let mut chunked = connect_from([127, 0, 0, 1], server.addr).await;
    let chunk = format!("800\r\n{}\r\n", "a".repeat(0x800));
    chunked
        .write_all(b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n")
        .await
        .expect("write");
    let _ = chunked.write_all(chunk.as_bytes()).await;
    let answer = read_all(&mut chunked).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
}

#[tokio::test]
async fn one_address_holds_at_most_its_share_and_others_are_served() {
    let server = start(LIMITS).await;
    let mut greedy = Vec::new();
    for _ in 0..LIMITS.max_per_peer {
        greedy.push(connect_from([127, 0, 0, 2], server.addr).await);
    }
    // Past its share, a new connection from the same address is closed at once.
    let mut one_more = connect_from([127, 0, 0, 2], server.addr).await;
    assert!(closed_by_server(&mut one_more).await);
    // Another address is served.
    assert!(get([127, 0, 0, 1], server.addr).await.contains("ok 0"));
    drop(greedy);
}

#[tokio::test]
async fn a_full_listener_closes_the_connection_that_waited_longest_for_a_request() {
    // Head timeouts far longer than the test waits: only eviction can make room.
    let limits = Limits {
        head_timeout: Duration::from_secs(120),
        ..LIMITS
    };
    let server = start(limits).await;
    // Every slot taken by silent connections from several addresses.
    let mut silent = Vec::new();
    for i in 0..LIMITS.max_connections {
        let from = [127, 0, 0, 10 + (i % 4) as u8];
        silent.push(connect_from(from, server.addr).await);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // A new client is served (the oldest silent one made room) long before the
    // silent ones' head timeout would have freed a slot.
    let answer = get([127, 0, 0, 1], server.addr).await;
    assert!(answer.contains("ok 0"), "{answer:?}");
    assert!(
        closed_by_server(&mut silent[0]).await,
        "the oldest was closed"
    );
}

/// Silent connections from `from`, reconnecting whenever closed, until `stop`.
async fn flood(from: [u8; 4], to: SocketAddr, stop: CancellationToken) {
    while !stop.is_cancelled() {
        let socket = TcpSocket::new_v4().expect("socket");
        if socket.bind(SocketAddr::from((from, 0))).is_err() {
            return;
        }
        let connected = tokio::select! {
            connected = socket.connect(to) => connected,
            () = stop.cancelled() => return,
        };
        match connected {
            Ok(mut stream) => {
                tokio::select! {
                    _ = closed_by_server(&mut stream) => {}
                    () = stop.cancelled() => return,
                }
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_address_is_served_ahead_of_a_flood_of_reconnects() {
    let limits = Limits {
        head_timeout: Duration::from_secs(120),
        accept_queue: 8,
        ..LIMITS
    };
    let server = start(limits).await;
    let stop = CancellationToken::new();
    // 120 addresses, each holding its share and reconnecting the moment it is
    // closed: far more than the slots, the process's queue and the kernel's.
    let mut attackers = Vec::new();
    for address in 0..120u8 {
        for _ in 0..LIMITS.max_per_peer {
            let from = [127, 0, 1, 1 + address];
            attackers.push(tokio::spawn(flood(from, server.addr, stop.clone())));
        }
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    // The kubelet's probe, from an address holding nothing: served next.
    let answer = tokio::time::timeout(EVENTUALLY, get([127, 0, 0, 1], server.addr))
        .await
        .unwrap_or_default();
    stop.cancel();
    for attacker in attackers {
        let _ = attacker.await;
    }
    assert!(
        answer.contains("ok 0"),
        "the probe was not served: {answer:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_address_is_served_ahead_of_a_flood_holding_one_connection_an_address() {
    let limits = Limits {
        head_timeout: Duration::from_secs(120),
        accept_queue: 8,
        ..LIMITS
    };
    let server = start(limits).await;
    let stop = CancellationToken::new();
    // 600 addresses, one silent connection each, reconnecting the moment it is
    // closed: every address in the process's queue holds as many as the probe's,
    // so only how often an address comes back tells the flood from the probe.
    let mut attackers = Vec::new();
    for address in 0..600u16 {
        let from = [127, 0, 2 + (address / 250) as u8, 1 + (address % 250) as u8];
        attackers.push(tokio::spawn(flood(from, server.addr, stop.clone())));
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let answer = tokio::time::timeout(EVENTUALLY, get([127, 0, 0, 1], server.addr))
        .await
        .unwrap_or_default();
    stop.cancel();
    for attacker in attackers {
        let _ = attacker.await;
    }
    assert!(
        answer.contains("ok 0"),
        "the probe was not served: {answer:?}"
    );
}

#[tokio::test]
async fn a_request_in_flight_is_never_cut_off_to_make_room() {
    // A slow handler holds its connection inside a request while others knock.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let stop = CancellationToken::new();
    let handler = |_request: Request<Full<Bytes>>| async move {
        tokio::time::sleep(Duration::from_millis(500)).await;
        Response::new(Full::new(Bytes::from("slow ok")))
    };
    let refuse = |status: StatusCode, message: String| {
        let mut response = Response::new(Full::new(Bytes::from(message)));
        *response.status_mut() = status;
        response
    };
    let limits = Limits {
        max_connections: 2,
        ..LIMITS
    };
    tokio::spawn(serve(
        listener,
        limits,
        plain,
        handler,
        refuse,
        stop.clone().cancelled_owned(),
    ));
    let first = tokio::spawn(get([127, 0, 0, 1], addr));
    let second = tokio::spawn(get([127, 0, 0, 2], addr));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let third = get([127, 0, 0, 3], addr).await;
    for answer in [
        first.await.expect("joins"),
        second.await.expect("joins"),
        third,
    ] {
        assert!(answer.contains("slow ok"), "{answer:?}");
    }
    stop.cancel();
}

#[tokio::test]
async fn bodies_trickled_on_every_slot_do_not_keep_a_new_request_out() {
    let limits = Limits {
        head_timeout: Duration::from_secs(120),
        body_timeout: Duration::from_secs(120),
        ..LIMITS
    };
    let server = start(limits).await;
    let mut slow = Vec::new();
    for i in 0..LIMITS.max_connections {
        let mut stream = connect_from([127, 0, 0, 20 + (i % 4) as u8], server.addr).await;
        stream
            .write_all(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\na")
            .await
            .expect("write");
        slow.push(stream);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Its body not read yet, a request can still be closed to make room.
    assert!(get([127, 0, 0, 1], server.addr).await.contains("ok 0"));
}

#[tokio::test]
async fn a_kept_alive_connection_is_never_cut_for_room_where_clients_reuse_theirs() {
    let limits = Limits {
        max_connections: 1,
        head_timeout: Duration::from_secs(3),
        evict_idle: false,
        ..LIMITS
    };
    let server = start(limits).await;
    let mut kept = connect_from([127, 0, 0, 1], server.addr).await;
    let mut buf = [0u8; 256];
    kept.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .expect("write");
    let n = kept.read(&mut buf).await.expect("answered");
    assert!(String::from_utf8_lossy(&buf[..n]).contains("ok 0"));
    // Another client knocks on the full listener, well past the kept one's second
    // of idleness: the kept one is not cut under its client, who uses it again.
    let knocking = tokio::spawn(get([127, 0, 0, 2], server.addr));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    kept.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .expect("still open");
    let n = kept.read(&mut buf).await.expect("answered again");
    assert!(String::from_utf8_lossy(&buf[..n]).contains("ok 0"));
    // Once it idles past its head timeout it is closed, and the knocker is served.
    assert!(knocking.await.expect("joins").contains("ok 0"));
}
