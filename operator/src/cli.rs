//! The command line: `run`, `apply`, `inject` and `crdgen`, their flags (each also
//! read from a `DROPGATE_*` variable) and what each does. `main` only parses and
//! calls [`run`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use tokio_util::sync::CancellationToken;

use crate::controller::{self, RunSettings};
use crate::inject;
use crate::lease::LeaseTimings;
use crate::memorystore::{self, Memorystore};

/// The dropgate operator: keeps Redis in line with each InventoryDrop.
#[derive(Parser)]
#[command(name = "dropgate-operator", version, about)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
    /// How log lines (on stderr) are written: text, or json (one object per line).
    #[arg(
        long,
        global = true,
        env = "DROPGATE_LOG_FORMAT",
        default_value = "text"
    )]
    pub log_format: dropgate_telemetry::LogFormat,
}

// Parsed once per process: the size of `Run` costs nothing worth a Box.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Run the controller in a cluster (leader-elected), with /metrics and /healthz.
    Run {
        /// Where /metrics and /healthz are served.
        #[arg(long, env = "DROPGATE_ADMIN_LISTEN", default_value = "0.0.0.0:8080")]
        admin_listen: SocketAddr,
        /// Overrides every drop's spec.redis.url.
        #[arg(long, env = "DROPGATE_REDIS_URL")]
        redis_url: Option<String>,
        /// Seconds between reconciles of a healthy drop (keeps REMAINING current).
        #[arg(long, env = "DROPGATE_RESYNC_SECONDS", default_value_t = 30)]
        resync_seconds: u64,
        /// Namespace of the leader Lease (the operator's own).
        #[arg(long, env = "POD_NAMESPACE", default_value = "dropgate-system")]
        lease_namespace: String,
        /// Name of the leader Lease (one per release).
        #[arg(long, env = "DROPGATE_LEASE_NAME", default_value = "dropgate-operator")]
        lease_name: String,
        /// This replica's name in the Lease.
        #[arg(long, env = "POD_NAME")]
        identity: Option<String>,
        /// How long a Lease nobody renews protects its holder; the leader stops
        /// after 2/3 of it without a renewal, and retries every 2/15 of it.
        #[arg(long, env = "DROPGATE_LEASE_SECONDS", default_value_t = 15,
              value_parser = clap::value_parser!(u64).range(3..=3600))]
        lease_seconds: u64,
        /// How long an HA check that cannot be made (timeout, 5xx, 429) keeps the
        /// last published mode before the failure policy applies.
        #[arg(long, env = "DROPGATE_HA_GRACE_SECONDS", default_value_t = 300,
              value_parser = clap::value_parser!(u64).range(0..=86400))]
        ha_grace_seconds: u64,
        /// Where the injection webhook is served (HTTPS, `/mutate`).
        #[arg(long, env = "DROPGATE_WEBHOOK_LISTEN", default_value = "0.0.0.0:9443")]
        webhook_listen: SocketAddr,
        /// A directory holding the webhook's `tls.crt` and `tls.key` (re-read when
        /// they change). Without it no webhook is served.
        #[arg(long, env = "DROPGATE_WEBHOOK_CERT_DIR")]
        webhook_cert_dir: Option<PathBuf>,
        #[command(flatten)]
        injection: inject::Settings,
        #[command(flatten)]
        google: Google,
    },
    /// Print a manifest with the sidecar injected into its Pods and pod templates
    /// (Deployments, StatefulSets, DaemonSets, ReplicaSets, Jobs, CronJobs), the
    /// webhook's mutation. The file is the opt-in: every pod not labelled
    /// dropgate.io/inject: "false" is injected, whatever its other labels.
    Inject {
        /// The manifest (`-` reads standard input).
        #[arg(short = 'f', long = "filename", value_name = "FILE")]
        file: PathBuf,
        #[command(flatten)]
        injection: inject::Settings,
    },
    /// Reconcile InventoryDrop manifests against Redis, outside Kubernetes, and print
    /// each drop's status (YAML documents, in the manifest's order).
    ///
    /// Exit codes: 0 every drop reconciled and Ready; 3 a manifest is invalid
    /// (nothing of that drop was written); 4 Redis is unreachable or failing; 5 a
    /// requirement is not met (high availability missing: the drop's mode was
    /// published, it is not Ready); 1 anything else (the file cannot be read). With
    /// several drops, every one is tried and the first failure's code is returned.
    #[command(verbatim_doc_comment)]
    Apply {
        /// The manifest: one InventoryDrop or several (YAML documents separated by
        /// `---`); `-` reads standard input.
        #[arg(short = 'f', long = "filename", value_name = "FILE")]
        file: PathBuf,
        /// Overrides spec.redis.url.
        #[arg(long, env = "DROPGATE_REDIS_URL")]
        redis_url: Option<String>,
        #[command(flatten)]
        google: Google,
    },
    /// Print the InventoryDrop CustomResourceDefinition as YAML.
    Crdgen,
}

/// Where the Memorystore API and the metadata server are (tests point them at a
/// local server).
#[derive(Args)]
struct Google {
    /// Base URL of Google's Memorystore for Redis API (HA checks of
    /// spec.redis.memorystore).
    #[arg(long, env = "DROPGATE_MEMORYSTORE_ENDPOINT", default_value = memorystore::DEFAULT_ENDPOINT)]
    memorystore_endpoint: String,
    /// Base URL of the metadata server that issues the operator's access tokens.
    #[arg(long, env = "DROPGATE_METADATA_ENDPOINT", default_value = memorystore::DEFAULT_METADATA_ENDPOINT)]
    metadata_endpoint: String,
}

impl Google {
    fn client(&self) -> Memorystore {
        Memorystore::new(
            &self.memorystore_endpoint,
            &self.metadata_endpoint,
            Duration::from_secs(5),
        )
    }
}

/// Runs the command `cli` names; the exit code says how it went.
pub async fn run(cli: Cli) -> ExitCode {
    // rediss:// and the Memorystore client need a process-wide rustls provider.
    let _ = rustls::crypto::ring::default_provider().install_default();
    match cli.command {
        Command::Crdgen => match crate::crd_yaml() {
            Ok(yaml) => {
                print!("{yaml}");
                ExitCode::SUCCESS
            }
            Err(e) => fail(&e),
        },
        Command::Inject { file, injection } => {
            let text = match read_input(&file) {
                Ok(text) => text,
                Err(e) => return fail(&format!("cannot read {}: {e}", file.display())),
            };
            match inject::manifest::inject_manifest(&text, &injection) {
                Ok(yaml) => {
                    print!("{yaml}");
                    ExitCode::SUCCESS
                }
                Err(e) => fail(&e),
            }
        }
        Command::Apply {
            file,
            redis_url,
            google,
        } => {
            let text = match read_input(&file) {
                Ok(text) => text,
                Err(e) => return fail(&format!("cannot read {}: {e}", file.display())),
            };
            let manifests = match crate::apply::documents(&text) {
                Ok(manifests) => manifests,
                Err(e) => return failed_with(ApplyExit::InvalidManifest, &e),
            };
            let memorystore = google.client();
            let mut first_failure: Option<ApplyExit> = None;
            for (i, manifest) in manifests.iter().enumerate() {
                let failure =
                    match crate::apply::apply(manifest, redis_url.as_deref(), &memorystore).await {
                        Ok(done) => {
                            if i > 0 {
                                println!("---");
                            }
                            match serde_norway::to_string(&done.status) {
                                Ok(yaml) => print!("{yaml}"),
                                Err(e) => eprintln!("error: {e}"),
                            }
                            done.not_ready.map(|reason| {
                                eprintln!("error: not ready: {reason}");
                                ApplyExit::NotReady
                            })
                        }
                        Err(e) => {
                            eprintln!("error: document {}: {e}", i + 1);
                            Some(ApplyExit::of(&e))
                        }
                    };
                first_failure = first_failure.or(failure);
            }
            match first_failure {
                None => ExitCode::SUCCESS,
                Some(exit) => ExitCode::from(exit as u8),
            }
        }
        Command::Run {
            admin_listen,
            redis_url,
            resync_seconds,
            lease_namespace,
            lease_name,
            identity,
            lease_seconds,
            ha_grace_seconds,
            webhook_listen,
            webhook_cert_dir,
            injection,
            google,
        } => {
            let identity = identity
                .or_else(|| std::env::var("HOSTNAME").ok())
                .unwrap_or_else(|| format!("dropgate-operator-{}", std::process::id()));
            let settings = RunSettings {
                admin_listen,
                lease_namespace,
                lease_name,
                identity,
                lease: LeaseTimings::new(Duration::from_secs(lease_seconds)),
                webhook: webhook_cert_dir.map(|dir| (webhook_listen, dir)),
                injection,
                controller: controller::Settings {
                    resync: Duration::from_secs(resync_seconds.max(1)),
                    redis_url,
                    ha_grace: Duration::from_secs(ha_grace_seconds),
                    ..controller::Settings::default()
                },
            };
            let shutdown = CancellationToken::new();
            tokio::spawn(cancel_on_signal(shutdown.clone()));
            match controller::run(settings, google.client(), shutdown).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => fail(&e),
            }
        }
    }
}

/// SIGTERM (a rollout, `kubectl delete pod`) or Ctrl-C: stop in either role.
async fn cancel_on_signal(shutdown: CancellationToken) {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(error) => {
                tracing::warn!(%error, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        () = terminate => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!("shutting down");
    shutdown.cancel();
}

/// The file at `path`, or standard input for `-`.
fn read_input(path: &std::path::Path) -> std::io::Result<String> {
    if path.as_os_str() == "-" {
        std::io::read_to_string(std::io::stdin())
    } else {
        std::fs::read_to_string(path)
    }
}

/// `apply`'s exit codes (its help text says them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ApplyExit {
    Other = 1,
    InvalidManifest = 3,
    RedisUnavailable = 4,
    NotReady = 5,
}

impl ApplyExit {
    fn of(error: &crate::Error) -> Self {
        use crate::Error;
        match error {
            Error::InvalidManifest(_)
            | Error::InvalidSpec(_)
            | Error::NoRedisUrl
            | Error::SecretRefOutsideCluster
            | Error::ClusterNotDeclared(_)
            | Error::NotACluster(_) => ApplyExit::InvalidManifest,
            Error::RedisUnavailable { .. } | Error::Redis(_) | Error::Timeout(_) => {
                ApplyExit::RedisUnavailable
            }
            Error::HighAvailabilityMissing(_) => ApplyExit::NotReady,
            _ => ApplyExit::Other,
        }
    }
}

fn failed_with(exit: ApplyExit, reason: &dyn std::fmt::Display) -> ExitCode {
    eprintln!("error: {reason}");
    ExitCode::from(exit as u8)
}

fn fail(reason: &dyn std::fmt::Display) -> ExitCode {
    eprintln!("error: {reason}");
    ExitCode::FAILURE
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    /// Every flag of every subcommand says what it is for (`--help`).
    #[test]
    fn every_flag_has_help_text() {
        let mut missing = Vec::new();
        let cli = super::Cli::command();
        let mut commands = vec![cli];
        while let Some(command) = commands.pop() {
            for arg in command.get_arguments() {
                let builtin = matches!(arg.get_id().as_str(), "help" | "version");
                if !builtin && arg.get_help().is_none() && arg.get_long_help().is_none() {
                    missing.push(format!("{} --{}", command.get_name(), arg.get_id()));
                }
            }
            commands.extend(command.get_subcommands().cloned());
        }
        assert!(missing.is_empty(), "flags without help: {missing:?}");
    }
}
