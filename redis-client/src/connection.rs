//! One Redis or a Redis Cluster behind one connection type. Every key of a drop
//! carries the drop's hash tag, so whatever dropgate sends about a drop (a script,
//! a pipeline, a stream append) goes to the one node that serves its slot; with a
//! cluster, the client finds that node, follows MOVED and ASK, and keeps one
//! connection per node however many drops live there.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::{Cmd, IntoConnectionInfo, Pipeline, RedisFuture, RedisResult, Value};

use crate::cluster::{ClusterClient, Request};

/// A connection to the Redis a drop lives on; cheap to clone (clones share it).
#[derive(Clone)]
pub enum Connection {
    /// One Redis primary: a multiplexed connection that reconnects by itself, and
    /// how many calls met a connection-level failure (see [`Connection::changes`]).
    Single(ConnectionManager, Arc<AtomicU64>),
    /// A Redis Cluster, found from one seed address (a discovery endpoint works):
    /// one multiplexed connection per node it needs.
    Cluster(Arc<ClusterClient>),
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Connection::Single(..) => "Connection::Single",
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
            Connection::Single(conn, failures) => {
                let reply = cmd.query_async(conn).await;
                count_failure(failures, &reply);
                reply
            }
            Connection::Cluster(link) => {
                link.run_on_slot_of(key.as_bytes(), Request::Cmd(&cmd))
                    .await
            }
        }
    }

    pub fn is_cluster(&self) -> bool {
        matches!(self, Connection::Cluster(_))
    }

    /// A number that moves whenever the Redis that serves `key` may have changed:
    /// on one Redis, the calls that met a connection-level failure, since the
    /// client reconnects after one by itself, and what answers next may be another
    /// server (a replica promoted in a failover, or a Redis restarted without its
    /// data); on a cluster, [`ClusterClient::changes_of_slot`] (another node, or a
    /// new connection, for that slot). Counted here, under every call, so that no
    /// caller that forgets to report a failure can miss a change.
    pub fn changes_for(&self, key: &str) -> u64 {
        match self {
            Connection::Single(_, failures) => failures.load(Ordering::Acquire),
            Connection::Cluster(link) => link.changes_of_slot(key.as_bytes()),
        }
    }
}

impl From<ConnectionManager> for Connection {
    fn from(single: ConnectionManager) -> Self {
        Connection::Single(single, Arc::default())
    }
}

/// Counts a call that failed at the connection level (the connection dropped,
/// refused, timed out or broke), after which the client reconnects by itself; so
/// does every error after which the client reconnects (a reply it could not
/// parse, a failed AUTH): what answers next may be another server.
fn count_failure<T>(failures: &AtomicU64, reply: &RedisResult<T>) {
    if let Err(e) = reply
        && (e.is_io_error()
            || e.is_connection_refusal()
            || e.is_connection_dropped()
            || e.is_timeout()
            || e.is_unrecoverable_error())
    {
        failures.fetch_add(1, Ordering::AcqRel);
    }
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Connection::Single(conn, failures) => Box::pin(async move {
                let reply = conn.req_packed_command(cmd).await;
                count_failure(failures, &reply);
                reply
            }),
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
            Connection::Single(conn, failures) => Box::pin(async move {
                let replies = conn.req_packed_commands(pipeline, offset, count).await;
                count_failure(failures, &replies);
                replies
            }),
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
            Connection::Single(conn, _) => conn.get_db(),
            Connection::Cluster(_) => 0,
        }
    }
}
