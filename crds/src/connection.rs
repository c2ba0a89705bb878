//! One Redis or a Redis Cluster behind one connection type. Every key of a drop
//! carries the drop's hash tag, so whatever dropgate sends about a drop (a script,
//! a pipeline, a stream append) goes to the one node that serves its slot; with a
//! cluster, the client finds that node, follows MOVED and ASK, and keeps one
//! connection per node however many drops live there.

use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisError, RedisFuture, RedisResult, Value};
use tokio::sync::Mutex;

/// A connection to the Redis a drop lives on; cheap to clone (clones share it).
#[derive(Clone)]
pub enum Connection {
    /// One Redis primary: a multiplexed connection that reconnects by itself.
    Single(ConnectionManager),
    /// A Redis Cluster, found from one seed address (a discovery endpoint works).
    Cluster(Arc<ClusterLink>),
}

/// A cluster client and its connection, made on first use and made again after a
/// call outlived its deadline: redis-rs's cluster connection can stop answering
/// altogether after a node dies mid-refresh (seen in CI: every call, the HTTP
/// requests waiting on them included, hung for minutes), and a fresh connection
/// reads the slots anew.
pub struct ClusterLink {
    client: ClusterClient,
    connected: Mutex<Option<ClusterConnection>>,
    /// The longest one call may take: the client's own retries included.
    deadline: Duration,
}

impl ClusterLink {
    async fn connection(&self) -> RedisResult<ClusterConnection> {
        let mut connected = self.connected.lock().await;
        if let Some(conn) = connected.as_ref() {
            return Ok(conn.clone());
        }
        let conn = self.client.get_async_connection().await?;
        *connected = Some(conn.clone());
        Ok(conn)
    }

    /// Runs `call` on the connection within the deadline; past it the connection
    /// is dropped (the next call makes a new one) and the call fails as a timeout.
    async fn within_deadline<T>(
        &self,
        call: impl AsyncFnOnce(ClusterConnection) -> RedisResult<T>,
    ) -> RedisResult<T> {
        let conn = self.connection().await?;
        match tokio::time::timeout(self.deadline, call(conn)).await {
            Ok(answered) => answered,
            Err(_) => {
                *self.connected.lock().await = None;
                Err(RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "the Redis Cluster did not answer within {:?}",
                        self.deadline
                    ),
                )))
            }
        }
    }
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Connection::Single(_) => "Connection::Single",
            Connection::Cluster(_) => "Connection::Cluster",
        })
    }
}

impl Connection {
    /// Connects to the cluster that `url` (any of its nodes) belongs to: a node's
    /// connection is tried for at most `connect`, a reply waited for at most
    /// `response` (a call, with the client's retries, at most three times that).
    pub async fn cluster(url: &str, connect: Duration, response: Duration) -> RedisResult<Self> {
        let connection = Self::cluster_lazy(url, connect, response)?;
        if let Connection::Cluster(link) = &connection {
            link.connection().await?;
        }
        Ok(connection)
    }

    /// [`Connection::cluster`], connected on the first call instead of now: only
    /// a URL that is not one fails here, and until the cluster is reached every
    /// call fails as an unreachable Redis does.
    pub fn cluster_lazy(url: &str, connect: Duration, response: Duration) -> RedisResult<Self> {
        let client = ClusterClient::builder(vec![url])
            .connection_timeout(connect)
            .response_timeout(response)
            .retries(2)
            .build()?;
        Ok(Connection::Cluster(Arc::new(ClusterLink {
            client,
            connected: Mutex::new(None),
            deadline: response * 3 + connect,
        })))
    }

    /// Runs `cmd` on the primary serving `key`'s slot (on one Redis, on it): for
    /// a command without keys about one drop, such as a SCAN of its reservations,
    /// which a cluster client would otherwise send to any node.
    pub async fn on_slot_of(&mut self, key: &str, cmd: Cmd) -> RedisResult<Value> {
        use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, Slot, SlotAddr};
        match self {
            Connection::Single(conn) => cmd.query_async(conn).await,
            Connection::Cluster(link) => {
                let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(
                    Route::with_slot(Slot::for_key(key), SlotAddr::Master),
                ));
                link.within_deadline(async move |mut conn| conn.route_command(cmd, route).await)
                    .await
            }
        }
    }

    pub fn is_cluster(&self) -> bool {
        matches!(self, Connection::Cluster(_))
    }
}

impl From<ConnectionManager> for Connection {
    fn from(single: ConnectionManager) -> Self {
        Connection::Single(single)
    }
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Connection::Single(conn) => conn.req_packed_command(cmd),
            Connection::Cluster(link) => Box::pin(async move {
                link.within_deadline(async |mut conn| conn.req_packed_command(cmd).await)
                    .await
            }),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Connection::Single(conn) => conn.req_packed_commands(pipeline, offset, count),
            Connection::Cluster(link) => Box::pin(async move {
                link.within_deadline(async |mut conn| {
                    conn.req_packed_commands(pipeline, offset, count).await
                })
                .await
            }),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Single(conn) => conn.get_db(),
            Connection::Cluster(_) => 0,
        }
    }
}
