//! A TCP proxy on a free loopback port in front of a server: a test cuts it to
//! partition one client from the server while others still reach it, or points it
//! at another server, as a failover moves a service address.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;
use tokio::task::JoinHandle;

/// The proxy; it stops when dropped.
pub struct TcpProxy {
    port: u16,
    shared: Arc<Shared>,
    accept: JoinHandle<()>,
}

struct Shared {
    upstream: AtomicU16,
    open: AtomicBool,
    connections: Mutex<Vec<JoinHandle<()>>>,
}

impl TcpProxy {
    /// Forwards a free loopback port to `127.0.0.1:upstream`.
    pub async fn start(upstream: u16) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let shared = Arc::new(Shared {
            upstream: AtomicU16::new(upstream),
            open: AtomicBool::new(true),
            connections: Mutex::new(Vec::new()),
        });
        let accepting = shared.clone();
        let accept = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                if !accepting.open.load(Ordering::Acquire) {
                    continue;
                }
                let upstream = accepting.upstream.load(Ordering::Acquire);
                let forward = tokio::spawn(async move {
                    if let Ok(mut server) = TcpStream::connect(("127.0.0.1", upstream)).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
                accepting.connections.lock().await.push(forward);
            }
        });
        Ok(Self {
            port,
            shared,
            accept,
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://` URL of the proxy.
    pub fn redis_url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Drops every connection and refuses new ones until [`TcpProxy::heal`].
    pub async fn cut(&self) {
        self.shared.open.store(false, Ordering::Release);
        self.drop_connections().await;
    }

    /// Lets connections through again.
    pub fn heal(&self) {
        self.shared.open.store(true, Ordering::Release);
    }

    /// Sends new connections to `127.0.0.1:upstream` and drops the current ones, so
    /// that clients reconnect there.
    pub async fn point_to(&self, upstream: u16) {
        self.shared.upstream.store(upstream, Ordering::Release);
        self.drop_connections().await;
    }

    async fn drop_connections(&self) {
        for connection in self.shared.connections.lock().await.drain(..) {
            connection.abort();
        }
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}
