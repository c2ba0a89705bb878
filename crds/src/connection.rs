//! One Redis or a Redis Cluster behind one connection type. Every key of a drop
//! carries the drop's hash tag, so whatever dropgate sends about a drop (a script,
//! a pipeline, a stream append) goes to the one node that serves its slot; with a
//! cluster, the client finds that node, follows MOVED and ASK, and keeps one
//! connection per node however many drops live there.

use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, RedisResult, Value};

/// A connection to the Redis a drop lives on; cheap to clone (clones share it).
#[derive(Clone)]
pub enum Connection {
    /// One Redis primary: a multiplexed connection that reconnects by itself.
    Single(ConnectionManager),
    /// A Redis Cluster, found from one seed address (a discovery endpoint works).
    Cluster(ClusterConnection),
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
    /// Connects to the cluster that `url` (any of its nodes) belongs to: every
    /// call fails within `response` and a node's connection is tried for at most
    /// `connect`.
    pub async fn cluster(url: &str, connect: Duration, response: Duration) -> RedisResult<Self> {
        let client = ClusterClient::builder(vec![url])
            .connection_timeout(connect)
            .response_timeout(response)
            .retries(2)
            .build()?;
        Ok(Connection::Cluster(client.get_async_connection().await?))
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
            Connection::Cluster(conn) => conn.req_packed_command(cmd),
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
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Single(conn) => conn.get_db(),
            Connection::Cluster(conn) => conn.get_db(),
        }
    }
}
