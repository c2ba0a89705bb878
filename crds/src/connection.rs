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
use redis::{Cmd, Pipeline, RedisFuture, RedisResult, Value};
use tokio::sync::OnceCell;

/// A connection to the Redis a drop lives on; cheap to clone (clones share it).
#[derive(Clone)]
pub enum Connection {
    /// One Redis primary: a multiplexed connection that reconnects by itself.
    Single(ConnectionManager),
    /// A Redis Cluster, found from one seed address (a discovery endpoint works).
    Cluster(ClusterConnection),
    /// A Redis Cluster connected on first use: until it is reached, every call
    /// fails as an unreachable Redis does (so a sidecar starts, and answers by its
    /// failure policy, while the cluster is down).
    LazyCluster(Arc<LazyCluster>),
}

/// A cluster client and, once a call reached the cluster, its connection.
pub struct LazyCluster {
    client: ClusterClient,
    connected: OnceCell<ClusterConnection>,
}

impl LazyCluster {
    async fn connection(&self) -> RedisResult<ClusterConnection> {
        self.connected
            .get_or_try_init(|| self.client.get_async_connection())
            .await
            .cloned()
    }
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Connection::Single(_) => "Connection::Single",
            Connection::Cluster(_) | Connection::LazyCluster(_) => "Connection::Cluster",
        })
    }
}

impl Connection {
    /// Connects to the cluster that `url` (any of its nodes) belongs to: every
    /// call fails within `response` and a node's connection is tried for at most
    /// `connect`.
    pub async fn cluster(url: &str, connect: Duration, response: Duration) -> RedisResult<Self> {
        let client = cluster_client(url, connect, response)?;
        Ok(Connection::Cluster(client.get_async_connection().await?))
    }

    /// [`Connection::cluster`], connected on the first call instead of now: only
    /// a URL that is not one fails here.
    pub fn cluster_lazy(url: &str, connect: Duration, response: Duration) -> RedisResult<Self> {
        Ok(Connection::LazyCluster(Arc::new(LazyCluster {
            client: cluster_client(url, connect, response)?,
            connected: OnceCell::new(),
        })))
    }

    /// Runs `cmd` on the primary serving `key`'s slot (on one Redis, on it): for
    /// a command without keys about one drop, such as a SCAN of its reservations,
    /// which a cluster client would otherwise send to any node.
    pub async fn on_slot_of(&mut self, key: &str, cmd: Cmd) -> RedisResult<Value> {
        use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, Slot, SlotAddr};
        let route = || {
            RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(Route::with_slot(
                Slot::for_key(key),
                SlotAddr::Master,
            )))
        };
        match self {
            Connection::Single(conn) => cmd.query_async(conn).await,
            Connection::Cluster(conn) => conn.route_command(cmd, route()).await,
            Connection::LazyCluster(lazy) => {
                lazy.connection().await?.route_command(cmd, route()).await
            }
        }
    }

    pub fn is_cluster(&self) -> bool {
        matches!(self, Connection::Cluster(_) | Connection::LazyCluster(_))
    }
}

fn cluster_client(url: &str, connect: Duration, response: Duration) -> RedisResult<ClusterClient> {
    ClusterClient::builder(vec![url])
        .connection_timeout(connect)
        .response_timeout(response)
        .retries(2)
        .build()
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
            Connection::Cluster(conn) => conn.req_packed_command(cmd),
            Connection::LazyCluster(lazy) => Box::pin(async move {
                let mut conn = lazy.connection().await?;
                conn.req_packed_command(cmd).await
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
            Connection::Cluster(conn) => conn.req_packed_commands(pipeline, offset, count),
            Connection::LazyCluster(lazy) => Box::pin(async move {
                let mut conn = lazy.connection().await?;
                conn.req_packed_commands(pipeline, offset, count).await
            }),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Single(conn) => conn.get_db(),
            Connection::Cluster(conn) => conn.get_db(),
            Connection::LazyCluster(_) => 0,
        }
    }
}
