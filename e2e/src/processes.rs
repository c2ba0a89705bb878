//! The binaries, run as a user runs them.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use dropgate_testkit::HttpClient;

/// Where `cargo build` put the binaries: next to the running executable (bins live
/// in `target/<profile>/`, test executables one level down in `deps/`).
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_default();
    let dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    let candidates = [
        dir.join(name),
        dir.parent().map(|p| p.join(name)).unwrap_or_default(),
    ];
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .unwrap_or_else(|| candidates[0].clone())
}

/// Writes an InventoryDrop manifest for drop `sale` in namespace `shop` with the
/// given spec lines (indented two spaces) into `dir`, and returns its path.
pub fn sale_manifest(dir: &Path, spec: &str) -> Result<PathBuf, String> {
    let path = dir.join("drop.yaml");
    std::fs::write(
        &path,
        format!(
            "apiVersion: dropgate.io/v1alpha1\nkind: InventoryDrop\nmetadata: {{name: sale, namespace: shop}}\n\
             spec:\n  redis: {{url: redis://unused:1}}\n{spec}"
        ),
    )
    .map_err(|e| e.to_string())?;
    Ok(path)
}

/// Why binary `name` could not be run, and how to build it: the bench and the
/// flash sale run the binaries of their own profile, which `cargo run` of them
/// does not build.
fn not_built(name: &str, error: &std::io::Error) -> String {
    let path = binary(name);
    let profile = if path.components().any(|c| c.as_os_str() == "release") {
        " --release"
    } else {
        ""
    };
    format!(
        "cannot run {} ({error}): build it first with `cargo build{profile} -p dropgate-sidecar -p dropgate-operator --bins`",
        path.display()
    )
}

/// `dropgate-operator apply -f MANIFEST --redis-url URL`: its stdout (the status
/// YAML) on success, its stderr otherwise.
pub fn apply(manifest: &Path, redis_url: &str) -> Result<String, String> {
    let out = Command::new(binary("dropgate-operator"))
        .arg("apply")
        .arg("-f")
        .arg(manifest)
        .args(["--redis-url", redis_url])
        .output()
        .map_err(|e| not_built("dropgate-operator", &e))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "dropgate-operator apply failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// A `dropgate-sidecar` child process, killed on drop.
pub struct SidecarProcess {
    child: Child,
    pub base: String,
}

impl SidecarProcess {
    pub async fn start(
        redis_url: &str,
        namespace: &str,
        database_url: &str,
    ) -> Result<Self, String> {
        Self::start_with(redis_url, namespace, database_url, &[]).await
    }

    /// Same, with more command-line flags.
    pub async fn start_with(
        redis_url: &str,
        namespace: &str,
        database_url: &str,
        extra: &[&str],
    ) -> Result<Self, String> {
        Self::start_with_env(redis_url, namespace, database_url, extra, &[]).await
    }

    /// Same, with more command-line flags and environment variables.
    pub async fn start_with_env(
        redis_url: &str,
        namespace: &str,
        database_url: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Self, String> {
        Self::start_binary(
            &binary("dropgate-sidecar"),
            redis_url,
            namespace,
            database_url,
            extra,
            env,
        )
        .await
    }

    /// Same, from the sidecar binary at `path` (an earlier build, for the bench).
    pub async fn start_binary(
        path: &Path,
        redis_url: &str,
        namespace: &str,
        database_url: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Self, String> {
        let port = dropgate_testkit::free_port().map_err(|e| e.to_string())?;
        let listen = format!("127.0.0.1:{port}");
        let mut command = Command::new(path);
        // The caller's `OTEL_*` settings stay out of it: only `env` says what it
        // exports.
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("OTEL_") {
                command.env_remove(name);
            }
        }
        let child = command
            .args([
                "--listen",
                &listen,
                "--redis-url",
                redis_url,
                "--namespace",
                namespace,
            ])
            .args(["--database-url", database_url])
            .args(extra)
            // No API server to watch: an outage's fallback decides on the config
            // last read, opted in (the sidecar refuses it by default; an older
            // build ignores the variable).
            .env("DROPGATE_FALLBACK_ON_LAST_READ_CONFIG", "true")
            .envs(env.iter().copied())
            .env(
                "RUST_LOG",
                std::env::var("DROPGATE_E2E_LOG")
                    .unwrap_or_else(|_| "warn,sqlx::query=error".into()),
            )
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| not_built("dropgate-sidecar", &e))?;
        let sidecar = Self {
            child,
            base: format!("http://{listen}"),
        };
        let http = HttpClient::new(sidecar.base.clone());
        for _ in 0..200 {
            if let Ok(reply) = http.get("/healthz").await
                && reply.status == 200
            {
                return Ok(sidecar);
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        Err("dropgate-sidecar did not answer /healthz within 5s".into())
    }

    /// The process id (for a `kill -9` that must land while requests are in flight).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL, then wait: the process dies wherever it is, as `kill -9` does.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, then wait: the sidecar drains in-flight requests and exits 0.
    pub fn terminate(mut self) -> Result<std::process::ExitStatus, String> {
        let pid = self.child.id().to_string();
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .map_err(|e| e.to_string())?;
        self.child.wait().map_err(|e| e.to_string())
    }
}

impl Drop for SidecarProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
