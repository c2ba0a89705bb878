use std::path::PathBuf;
use std::process::{Command, Stdio};

use crate::{find_binary, free_port};

/// A throwaway PostgreSQL cluster on a free loopback port, stopped and deleted on drop.
pub struct PostgresServer {
    port: u16,
    dir: tempfile::TempDir,
    bin: PathBuf,
}

const PG_DIRS: &[&str] = &[
    "/usr/lib/postgresql/17/bin",
    "/usr/lib/postgresql/16/bin",
    "/usr/lib/postgresql/15/bin",
];

impl PostgresServer {
    /// `initdb` + `pg_ctl start` as the current user. PostgreSQL refuses to run as
    /// root, so under root the cluster is owned by and run as `postgres`.
    pub fn start() -> std::io::Result<Self> {
        let initdb = find_binary("initdb", PG_DIRS).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "initdb not found: run scripts/setup (apt-get install postgresql)",
            )
        })?;
        let bin = initdb.parent().map(PathBuf::from).unwrap_or_default();
        let dir = tempfile::Builder::new().prefix("dropgate-pg").tempdir()?;
        let data = dir.path().join("data");
        let as_root = is_root();
        if as_root {
            run(Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(dir.path()))?;
        }
        let mut init = pg_command(&bin.join("initdb"), as_root);
        init.args(["-A", "trust", "-U", "postgres", "--no-sync", "-D"])
            .arg(&data);
        run(&mut init)?;
        let mut last = None;
        for _ in 0..5 {
            let port = free_port()?;
            let opts = format!(
                "-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories={} -c fsync=off -c max_connections=200",
                dir.path().display()
            );
            let mut start = pg_command(&bin.join("pg_ctl"), as_root);
            start
                .args(["-w", "-t", "30", "-D"])
                .arg(&data)
                .args(["-o", &opts, "-l"])
                .arg(log_path(&dir))
                .arg("start");
            match run(&mut start) {
                Ok(()) => return Ok(Self { port, dir, bin }),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| std::io::Error::other("PostgreSQL did not start")))
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's log so far (its errors carry their statements: a deadlock's
    /// entry names the queries of both sides).
    pub fn log(&self) -> std::io::Result<String> {
        std::fs::read_to_string(log_path(&self.dir))
    }

    /// Stops the server at once (`pg_ctl stop -m immediate`: a crash, connections
    /// cut); [`PostgresServer::start_again`] brings it back with its data.
    pub fn stop(&self) -> std::io::Result<()> {
        let mut stop = pg_command(&self.bin.join("pg_ctl"), is_root());
        stop.args(["-m", "immediate", "-w", "-D"])
            .arg(self.dir.path().join("data"))
            .arg("stop");
        run(&mut stop)
    }

    /// Starts a stopped server again on the same port, with its data.
    pub fn start_again(&self) -> std::io::Result<()> {
        let opts = format!(
            "-c listen_addresses=127.0.0.1 -c port={} -c unix_socket_directories={} -c fsync=off -c max_connections=200",
            self.port,
            self.dir.path().display()
        );
        let mut start = pg_command(&self.bin.join("pg_ctl"), is_root());
        start
            .args(["-w", "-t", "30", "-D"])
            .arg(self.dir.path().join("data"))
            .args(["-o", &opts, "-l"])
            .arg(log_path(&self.dir))
            .arg("start");
        run(&mut start)
    }
}

impl PostgresServer {
    /// Stops every process of the server (`SIGSTOP`) without closing anything: it
    /// stops answering as a server behind a network cut without resets does, and
    /// its connections and locks stay. [`PostgresServer::thaw`] lets it go on.
    pub fn freeze(&self) -> std::io::Result<()> {
        self.signal_all("-STOP")
    }

    /// Lets a frozen server go on (`SIGCONT`).
    pub fn thaw(&self) -> std::io::Result<()> {
        self.signal_all("-CONT")
    }

    /// Sends `signal` to the postmaster and its children.
    fn signal_all(&self, signal: &str) -> std::io::Result<()> {
        let pid_file = self.dir.path().join("data").join("postmaster.pid");
        let postmaster = std::fs::read_to_string(&pid_file)?
            .lines()
            .next()
            .map(str::trim)
            .unwrap_or_default()
            .to_string();
        let children = Command::new("pgrep").args(["-P", &postmaster]).output()?;
        let mut pids = vec![postmaster];
        pids.extend(
            String::from_utf8_lossy(&children.stdout)
                .split_whitespace()
                .map(String::from),
        );
        run(Command::new("kill").arg(signal).args(&pids))
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        // A server a failed test left frozen could not stop.
        let _ = self.thaw();
        let mut stop = pg_command(&self.bin.join("pg_ctl"), is_root());
        stop.args(["-m", "immediate", "-D"])
            .arg(self.dir.path().join("data"))
            .arg("stop");
        let _ = run(&mut stop);
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|out| String::from_utf8_lossy(&out.stdout).trim() == "0")
        .unwrap_or(false)
}

fn pg_command(program: &std::path::Path, as_root: bool) -> Command {
    if as_root {
        let mut cmd = Command::new("runuser");
        cmd.args(["-u", "postgres", "--"]).arg(program);
        cmd
    } else {
        Command::new(program)
    }
}

fn run(cmd: &mut Command) -> std::io::Result<()> {
    let out = cmd.stdin(Stdio::null()).output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(std::io::Error::other(format!(
            "{:?} failed: {}{}",
            cmd,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )))
    }
}

/// Where the server of `dir` writes its log.
fn log_path(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().join("log")
}
