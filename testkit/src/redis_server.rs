use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::{find_binary, free_port};

/// A real `redis-server` on a free loopback port, killed on drop.
pub struct RedisServer {
    port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
    binary: PathBuf,
}

impl RedisServer {
    /// Starts a standalone server without persistence.
    pub fn start() -> std::io::Result<Self> {
        Self::start_with(&[])
    }

    /// Starts a server that replicates `master`.
    pub fn start_replica_of(master: &RedisServer) -> std::io::Result<Self> {
        let port = master.port.to_string();
        Self::start_with(&["--replicaof", "127.0.0.1", &port])
    }

    /// Starts an empty node of a Redis Cluster (see [`RedisCluster`]).
    pub fn start_cluster_node() -> std::io::Result<Self> {
        Self::start_with(&[
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            "2000",
            // A replica counts as in sync (CLUSTER SHARDS: `online`, not `loading`)
            // once its replication offset moved; the primary's pings move it.
            "--repl-ping-replica-period",
            "1",
        ])
    }

    /// Starts a standalone server on `port` (one that a stopped server left).
    pub fn start_on(port: u16) -> std::io::Result<Self> {
        let mut server = Self {
            port,
            dir: tempfile::tempdir()?,
            child: None,
            binary: redis_server_binary()?,
        };
        server.spawn(&[])?;
        Ok(server)
    }

    fn start_with(extra: &[&str]) -> std::io::Result<Self> {
        let binary = redis_server_binary()?;
        let mut last_error = None;
        for _ in 0..5 {
            let mut server = Self {
                port: free_port()?,
                dir: tempfile::tempdir()?,
                child: None,
                binary: binary.clone(),
            };
            match server.spawn(extra) {
                Ok(()) => return Ok(server),
                Err(e) => last_error = Some(e),
            }
        }
        Err(last_error.unwrap_or_else(|| std::io::Error::other("redis-server did not start")))
    }

    fn spawn(&mut self, extra: &[&str]) -> std::io::Result<()> {
        let child = Command::new(&self.binary)
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            // A replica gets its first copy at once, not after the default 5 s wait
            // for more replicas to share it.
            .args(["--repl-diskless-sync-delay", "0"])
            .arg("--dir")
            .arg(self.dir.path())
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        self.child = Some(child);
        self.wait_ready()
    }

    fn wait_ready(&mut self) -> std::io::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(child) = self.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                self.child = None;
                return Err(std::io::Error::other(format!(
                    "redis-server exited with {status} (port {} taken?)",
                    self.port
                )));
            }
            if let Ok(client) = redis::Client::open(self.url())
                && let Ok(mut conn) = client.get_connection_with_timeout(Duration::from_millis(200))
                && redis::cmd("PING").query::<String>(&mut conn).is_ok()
            {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(std::io::Error::other(
            "redis-server did not answer PING within 10s",
        ))
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// A blocking connection for the test's own reads and writes; a server that
    /// does not answer (a paused one) fails it within 5 s instead of hanging the test.
    pub fn connection(&self) -> redis::RedisResult<redis::Connection> {
        let conn =
            redis::Client::open(self.url())?.get_connection_with_timeout(Duration::from_secs(2))?;
        conn.set_read_timeout(Some(Duration::from_secs(5)))?;
        conn.set_write_timeout(Some(Duration::from_secs(5)))?;
        Ok(conn)
    }

    /// Kills the server (as a crash would); [`RedisServer::restart`] brings it back on
    /// the same port, empty.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port.
    pub fn restart(&mut self) -> std::io::Result<()> {
        self.stop();
        self.spawn(&[])
    }

    /// Freezes the process (SIGSTOP): a replica that falls behind its primary.
    pub fn pause(&self) -> std::io::Result<()> {
        self.signal("-STOP")
    }

    /// Lets a paused process run again (SIGCONT).
    pub fn resume(&self) -> std::io::Result<()> {
        self.signal("-CONT")
    }

    /// Makes a replica a primary (`REPLICAOF NO ONE`), as a failover does.
    pub fn promote(&self) -> redis::RedisResult<()> {
        let mut conn = self.connection()?;
        redis::cmd("REPLICAOF")
            .arg("NO")
            .arg("ONE")
            .query(&mut conn)
    }

    /// Every key with its DUMP and time to live, read in one script, so the copy is
    /// one moment of the data as a replica that stops there would hold it: copied key
    /// by key while the sidecars write, it could hold a reservation's marker from
    /// before a script and the drop's counters from after it, a state no Redis ever
    /// had. Empty while the server is unreachable.
    pub fn checkpoint(&self) -> Checkpoint {
        let Ok(mut conn) = self.connection() else {
            return Checkpoint::default();
        };
        let dumped: Vec<(String, Vec<u8>, i64)> = redis::Script::new(
            r"local out = {}
            for _, key in ipairs(redis.call('KEYS', '*')) do
              local dumped = redis.call('DUMP', key)
              if dumped then
                out[#out + 1] = {key, dumped, redis.call('PTTL', key)}
              end
            end
            return out",
        )
        .invoke(&mut conn)
        .unwrap_or_default();
        Checkpoint(dumped)
    }

    /// Puts the data back to `checkpoint` in one script: everything written since is
    /// lost, as in a failover to a replica that was behind, and no client sees the
    /// data half put back.
    pub fn roll_back_to(&self, checkpoint: &Checkpoint) -> redis::RedisResult<()> {
        let mut conn = self.connection()?;
        let restore = redis::Script::new(
            r"redis.call('FLUSHALL')
            for i = 1, #ARGV, 3 do
              local ttl = tonumber(ARGV[i + 2])
              if ttl < 0 then ttl = 0 end
              redis.call('RESTORE', ARGV[i], ttl, ARGV[i + 1], 'REPLACE')
            end
            return 1",
        );
        let mut script = restore.prepare_invoke();
        for (key, dumped, ttl) in &checkpoint.0 {
            script.arg(key).arg(dumped.as_slice()).arg(*ttl);
        }
        script.invoke::<()>(&mut conn)
    }

    fn signal(&self, signal: &str) -> std::io::Result<()> {
        let Some(child) = self.child.as_ref() else {
            return Err(std::io::Error::other("redis-server is not running"));
        };
        let status = Command::new("kill")
            .arg(signal)
            .arg(child.id().to_string())
            .status()?;
        if status.success() {
            Ok(())
        } else {
            Err(std::io::Error::other(format!(
                "kill {signal} failed: {status}"
            )))
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A real Redis Cluster on loopback ports: three primaries with one replica each,
/// joined by `redis-cli --cluster create`, every process killed on drop.
pub struct RedisCluster {
    /// The six nodes, in the order `redis-cli` was given them: the first three
    /// start as the primaries.
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts the six nodes, makes them a cluster, and waits until every node says
    /// `cluster_state:ok` and every replica is in sync.
    pub fn start() -> std::io::Result<Self> {
        let nodes = (0..6)
            .map(|_| RedisServer::start_cluster_node())
            .collect::<std::io::Result<Vec<_>>>()?;
        let cli = find_binary("redis-cli", &["/usr/bin", "/usr/local/bin"]).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "redis-cli not found: run scripts/setup (apt-get install redis-tools)",
            )
        })?;
        let out = Command::new(cli)
            .args(["--cluster", "create"])
            .args(nodes.iter().map(|n| format!("127.0.0.1:{}", n.port())))
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()?;
        if !out.status.success() {
            return Err(std::io::Error::other(format!(
                "redis-cli --cluster create failed: {}",
                String::from_utf8_lossy(&out.stdout)
            )));
        }
        let cluster = Self { nodes };
        cluster.wait_until(Duration::from_secs(30), |cluster| cluster.healthy())?;
        Ok(cluster)
    }

    /// A seed address for a cluster client: a node that is running.
    pub fn url(&self) -> String {
        self.nodes
            .iter()
            .find(|n| n.child.is_some())
            .unwrap_or(&self.nodes[0])
            .url()
    }

    /// Waits until `ready` holds, or fails after `limit`.
    pub fn wait_until(
        &self,
        limit: Duration,
        ready: impl Fn(&Self) -> bool,
    ) -> std::io::Result<()> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if ready(self) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(std::io::Error::other(format!(
            "the Redis Cluster was not ready within {limit:?}"
        )))
    }

    /// Every running node says `cluster_state:ok`, and every replica's link to its
    /// primary is up with the first sync done and its offset moved (before that,
    /// Redis 7.0's CLUSTER SHARDS calls it `loading`).
    pub fn healthy(&self) -> bool {
        self.nodes.iter().filter(|n| n.child.is_some()).all(|node| {
            let Ok(mut conn) = node.connection() else {
                return false;
            };
            let info: String = redis::cmd("CLUSTER")
                .arg("INFO")
                .query(&mut conn)
                .unwrap_or_default();
            let replication: String = redis::cmd("INFO")
                .arg("replication")
                .query(&mut conn)
                .unwrap_or_default();
            let offset = replication
                .lines()
                .find_map(|l| l.trim().strip_prefix("slave_repl_offset:"))
                .and_then(|o| o.parse::<i64>().ok())
                .unwrap_or(0);
            info.contains("cluster_state:ok")
                && sees_all_online(
                    &mut conn,
                    self.nodes.iter().filter(|n| n.child.is_some()).count(),
                )
                && (replication.contains("role:master")
                    || replication.contains("master_link_status:up")
                        && replication.contains("master_sync_in_progress:0")
                        && offset > 0)
        })
    }

    /// Moves the slot of `key` to the primary on `to_port` the way `redis-cli
    /// --cluster reshard` does (IMPORTING / MIGRATING, MIGRATE key by key, then
    /// SETSLOT NODE), pausing `pause` after each key so that clients meet the slot
    /// half moved (ASK and TRYAGAIN). Returns how many keys moved.
    pub fn move_slot_of(&self, key: &str, to_port: u16, pause: Duration) -> std::io::Result<usize> {
        let moving = self.begin_slot_move(key, to_port)?;
        self.finish_slot_move(&moving, pause)
    }

    /// Starts moving the slot of `key` to the primary on `to_port`: the target
    /// imports it, the source migrates it; no key has moved yet.
    pub fn begin_slot_move(&self, key: &str, to_port: u16) -> std::io::Result<SlotMove> {
        let source = self
            .primary_of(key)
            .ok_or_else(|| std::io::Error::other("no primary serves the key"))?;
        let target = self.node_on(to_port)?;
        let (mut from, mut to) = (
            source.connection().map_err(|e| failed("connect", e))?,
            target.connection().map_err(|e| failed("connect", e))?,
        );
        let slot: i64 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query(&mut from)
            .map_err(|e| failed("KEYSLOT", e))?;
        let id = |conn: &mut redis::Connection| -> std::io::Result<String> {
            redis::cmd("CLUSTER")
                .arg("MYID")
                .query(conn)
                .map_err(|e| failed("MYID", e))
        };
        let (from_id, to_id) = (id(&mut from)?, id(&mut to)?);
        redis::cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg("IMPORTING")
            .arg(&from_id)
            .exec(&mut to)
            .map_err(|e| failed("SETSLOT IMPORTING", e))?;
        redis::cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg("MIGRATING")
            .arg(&to_id)
            .exec(&mut from)
            .map_err(|e| failed("SETSLOT MIGRATING", e))?;
        Ok(SlotMove {
            slot,
            from_port: source.port(),
            to_port,
            to_id,
        })
    }

    /// Moves one key of a slot being moved.
    pub fn migrate_key(&self, moving: &SlotMove, key: &str) -> std::io::Result<()> {
        let mut from = self
            .node_on(moving.from_port)?
            .connection()
            .map_err(|e| failed("connect", e))?;
        redis::cmd("MIGRATE")
            .arg("127.0.0.1")
            .arg(moving.to_port)
            .arg(key)
            .arg(0)
            .arg(5000)
            .exec(&mut from)
            .map_err(|e| failed("MIGRATE", e))
    }

    /// Moves the slot's remaining keys one by one, `pause` apart, then gives the
    /// slot to the target. Returns how many keys moved.
    pub fn finish_slot_move(&self, moving: &SlotMove, pause: Duration) -> std::io::Result<usize> {
        let mut from = self
            .node_on(moving.from_port)?
            .connection()
            .map_err(|e| failed("connect", e))?;
        let mut moved = 0;
        loop {
            let keys: Vec<String> = redis::cmd("CLUSTER")
                .arg("GETKEYSINSLOT")
                .arg(moving.slot)
                .arg(1)
                .query(&mut from)
                .map_err(|e| failed("GETKEYSINSLOT", e))?;
            let Some(key) = keys.first() else {
                break;
            };
            self.migrate_key(moving, key)?;
            moved += 1;
            std::thread::sleep(pause);
        }
        // The target first, so that the slot is never without an owner; replicas
        // learn it from their primaries.
        let target = self.node_on(moving.to_port)?;
        for node in std::iter::once(target).chain(
            self.nodes
                .iter()
                .filter(|n| n.child.is_some() && n.port() != moving.to_port),
        ) {
            let mut conn = node.connection().map_err(|e| failed("connect", e))?;
            let role: String = redis::cmd("INFO")
                .arg("replication")
                .query(&mut conn)
                .map_err(|e| failed("INFO", e))?;
            if !role.contains("role:master") {
                continue;
            }
            redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(moving.slot)
                .arg("NODE")
                .arg(&moving.to_id)
                .exec(&mut conn)
                .map_err(|e| failed("SETSLOT NODE", e))?;
        }
        Ok(moved)
    }

    fn node_on(&self, port: u16) -> std::io::Result<&RedisServer> {
        self.nodes
            .iter()
            .find(|n| n.port() == port)
            .ok_or_else(|| std::io::Error::other(format!("no node on port {port}")))
    }

    /// The index in [`RedisCluster::nodes`] of the replica of the primary on
    /// `port`.
    pub fn replica_of(&self, port: u16) -> Option<usize> {
        self.nodes.iter().position(|node| {
            node.child.is_some()
                && node.connection().is_ok_and(|mut conn| {
                    redis::cmd("INFO")
                        .arg("replication")
                        .query::<String>(&mut conn)
                        .is_ok_and(|info| info.contains(&format!("master_port:{port}\r\n")))
                })
        })
    }

    /// The node that serves `key` now, as a primary: the one that answers it
    /// without a MOVED redirection.
    pub fn primary_of(&self, key: &str) -> Option<&RedisServer> {
        self.nodes
            .iter()
            .filter(|n| n.child.is_some())
            .find(|node| {
                let Ok(mut conn) = node.connection() else {
                    return false;
                };
                let role: String = redis::cmd("INFO")
                    .arg("replication")
                    .query(&mut conn)
                    .unwrap_or_default();
                role.contains("role:master")
                    && redis::cmd("EXISTS")
                        .arg(key)
                        .query::<i64>(&mut conn)
                        .is_ok()
            })
    }
}

/// Whether `CLUSTER SHARDS` on this node reports `nodes` nodes, each `online`
/// (Redis 7.0 shows a replica whose offset it has not yet heard move as `loading`).
fn sees_all_online(conn: &mut redis::Connection, nodes: usize) -> bool {
    fn strings(value: &redis::Value, out: &mut Vec<String>) {
        match value {
            redis::Value::BulkString(b) => out.push(String::from_utf8_lossy(b).into_owned()),
            redis::Value::SimpleString(s) => out.push(s.clone()),
            redis::Value::Array(items) => items.iter().for_each(|v| strings(v, out)),
            _ => {}
        }
    }
    let Ok(shards) = redis::cmd("CLUSTER")
        .arg("SHARDS")
        .query::<redis::Value>(conn)
    else {
        return false;
    };
    let mut all = Vec::new();
    strings(&shards, &mut all);
    let health: Vec<&String> = all
        .windows(2)
        .filter(|w| w[0] == "health")
        .map(|w| &w[1])
        .collect();
    health.len() == nodes && health.iter().all(|h| *h == "online")
}

/// A slot being moved from one primary to another (see
/// [`RedisCluster::begin_slot_move`]).
pub struct SlotMove {
    slot: i64,
    from_port: u16,
    to_port: u16,
    to_id: String,
}

fn failed(what: &str, e: redis::RedisError) -> std::io::Error {
    std::io::Error::other(format!("{what}: {e}"))
}

fn redis_server_binary() -> std::io::Result<PathBuf> {
    find_binary("redis-server", &["/usr/bin", "/usr/local/bin"]).ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "redis-server not found: run scripts/setup (apt-get install redis-server)",
        )
    })
}

/// The data of a Redis at one moment ([`RedisServer::checkpoint`]): each key with its
/// DUMP and its time to live in milliseconds (negative: none).
#[derive(Clone, Debug, Default)]
pub struct Checkpoint(Vec<(String, Vec<u8>, i64)>);

impl Checkpoint {
    /// Whether it holds no key (taken while Redis was unreachable, or empty).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}
