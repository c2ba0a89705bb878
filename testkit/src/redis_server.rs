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

    fn start_with(extra: &[&str]) -> std::io::Result<Self> {
        let binary =
            find_binary("redis-server", &["/usr/bin", "/usr/local/bin"]).ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "redis-server not found: run scripts/setup (apt-get install redis-server)",
                )
            })?;
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

    /// A blocking connection for the test's own reads and writes.
    pub fn connection(&self) -> redis::RedisResult<redis::Connection> {
        redis::Client::open(self.url())?.get_connection_with_timeout(Duration::from_secs(2))
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

    /// Every key with its DUMP, as a replica that stops here would hold them (empty
    /// while the server is unreachable).
    pub fn checkpoint(&self) -> Vec<(String, Vec<u8>)> {
        let Ok(mut conn) = self.connection() else {
            return Vec::new();
        };
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("*")
            .query(&mut conn)
            .unwrap_or_default();
        keys.into_iter()
            .filter_map(|key| {
                let dumped: Option<Vec<u8>> = redis::cmd("DUMP").arg(&key).query(&mut conn).ok()?;
                dumped.map(|d| (key, d))
            })
            .collect()
    }

    /// Puts the data back to `checkpoint`: everything written since is lost, as in a
    /// failover to a replica that was behind.
    pub fn roll_back_to(&self, checkpoint: &[(String, Vec<u8>)]) -> redis::RedisResult<()> {
        let mut conn = self.connection()?;
        redis::cmd("FLUSHALL").query::<()>(&mut conn)?;
        for (key, dumped) in checkpoint {
            redis::cmd("RESTORE")
                .arg(key)
                .arg(0)
                .arg(dumped.as_slice())
                .arg("REPLACE")
                .query::<()>(&mut conn)?;
        }
        Ok(())
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
