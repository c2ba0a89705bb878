//! A Redis primary with a replica, reached through a cuttable proxy, and a SQLite
//! ledger: for failovers to a replica that missed the last writes.

use std::time::Duration;

use dropgate_testkit::{RedisServer, Reply, TcpProxy};

use super::{Peer, eventually, redis_counts};

pub struct LossyFailover {
    pub primary: RedisServer,
    pub replica: RedisServer,
    /// What the sidecar connects to: the primary, then the replica.
    pub proxy: TcpProxy,
    /// The ledger's URL.
    pub ledger: String,
    _dir: tempfile::TempDir,
}

impl LossyFailover {
    pub async fn start() -> Self {
        sqlx::any::install_default_drivers();
        let primary = RedisServer::start().expect("redis-server");
        let replica = RedisServer::start_replica_of(&primary).expect("replica");
        let proxy = TcpProxy::start(primary.port()).await.expect("proxy");
        let dir = tempfile::tempdir().expect("temp dir");
        let ledger = format!("sqlite://{}", dir.path().join("ledger.db").display());
        Self {
            primary,
            replica,
            proxy,
            ledger,
            _dir: dir,
        }
    }

    /// Once the replica holds `held` units of `drop`, it is cut off: it misses
    /// every write from here on.
    pub async fn cut_off_replica_holding(&self, drop: &str, held: i64) {
        eventually("the replica to catch up", async || {
            redis_counts(&self.replica, drop).1 == held
        })
        .await;
        self.replica.promote().expect("REPLICAOF NO ONE");
    }

    /// 50 ms from now the primary dies and the proxy points at the replica; then
    /// a read of `drop`'s page through `peer` (or the sidecar's own sweep) fails
    /// on the dead connection, and the client reconnects, to the replica. (The
    /// page: it changes nothing, and meets none of the fault points the tests arm
    /// for the calls on reservations.)
    pub async fn fail_over(&mut self, peer: &Peer, drop: &str) -> Reply {
        tokio::time::sleep(Duration::from_millis(50)).await;
        self.primary.stop();
        self.proxy.point_to(self.replica.port()).await;
        let failed = peer
            .http
            .get(&format!("/v1/drops/{drop}"))
            .await
            .expect("answers");
        assert!(
            failed.status == 200 || failed.status == 503,
            "{}",
            failed.text
        );
        failed
    }
}
