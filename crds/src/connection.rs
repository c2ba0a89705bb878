//! One Redis or a Redis Cluster behind one connection type. Every key of a drop
//! carries the drop's hash tag, so whatever dropgate sends about a drop (a script,
//! a pipeline, a stream append) goes to the one node that serves its slot; with a
//! cluster, the client finds that node, follows MOVED and ASK, and keeps one
//! connection per node however many drops live there.

use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::{Cmd, IntoConnectionInfo, Pipeline, RedisFuture, RedisResult, Value};

use crate::cluster::{ClusterClient, Request};

/// A connection to the Redis a drop lives on; cheap to clone (clones share it).
#[derive(Clone)]
pub enum Connection {
    /// One Redis primary: a multiplexed connection that reconnects by itself.
    Single(ConnectionManager),
    /// A Redis Cluster, found from one seed address (a discovery endpoint works):
    /// one multiplexed connection per node it needs.
    Cluster(Arc<ClusterClient>),
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
    /// `response`, and a call, its redirections and pauses included, takes at most
    /// 3 x `response` + `connect`.
    pub async fn cluster(url: &str, connect: Duration, response: Duration) -> RedisResult<Self> {
        let connection = Self::cluster_lazy(url, connect, response)?;
        if let Connection::Cluster(client) = &connection {
            client.connect().await?;
        }
        Ok(connection)
    }

    /// [`Connection::cluster`], connected on the first call instead of now: only
    /// a URL that is not one fails here, and until the cluster is reached every
    /// call fails as an unreachable Redis does.
    pub fn cluster_lazy(url: &str, connect: Duration, response: Duration) -> RedisResult<Self> {
        let link = ClusterClient::new(url.into_connection_info()?, connect, response)?;
        Ok(Connection::Cluster(Arc::new(link)))
    }

    /// Runs `cmd` on the primary serving `key`'s slot (on one Redis, on it): for
    /// a command without keys about one drop, such as a SCAN of its reservations,
    /// which a cluster client would otherwise send to any node.
    pub async fn on_slot_of(&mut self, key: &str, cmd: Cmd) -> RedisResult<Value> {
        match self {
            Connection::Single(conn) => cmd.query_async(conn).await,
            Connection::Cluster(link) => {
                link.run_on_slot_of(key.as_bytes(), Request::Cmd(&cmd))
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
            Connection::Cluster(link) => Box::pin(link.run(Request::Cmd(cmd))),
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
                let request = Request::Pipeline {
                    pipeline,
                    offset,
                    count,
                };
                // A pipeline's answer is always its replies.
                match link.run(request).await? {
                    Value::Array(replies) => Ok(replies),
                    other => Err(redis::RedisError::from((
                        redis::ErrorKind::UnexpectedReturnType,
                        "a pipeline was answered with something else than its replies",
                        format!("{other:?}"),
                    ))),
                }
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
