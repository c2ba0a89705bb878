//! The dropgate operator: makes Redis match each `InventoryDrop`.
//!
//! # Layout
//!
//! - [`decide`]: the reconciler's judgement as plain functions — which mode a drop
//!   runs in, its phase and its conditions — from the spec and what was observed.
//!   No I/O, so table tests cover every case.
//! - [`store`]: the Redis side: publish the config hash and seed or restock stock in
//!   one Lua script (`lua/seed.lua`), read stock back, clean a deleted drop's keys.
//! - [`ha`]: high-availability verification: `INFO replication`, or the Memorystore
//!   API when the drop names an instance.
//! - [`reconcile`]: one reconcile of one drop against Redis, shared by the controller
//!   and by `apply`.
//! - [`apply`]: `dropgate-operator apply -f`, the same reconcile without Kubernetes.

pub mod apply;
pub mod decide;
pub mod ha;
pub mod reconcile;
pub mod store;

use dropgate_api::ConfigError;
use dropgate_api::drop::SpecError;
pub use dropgate_api::redact_url;

/// Failures of a reconcile, one variant per thing a user can act on.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid manifest: {0}")]
    InvalidManifest(String),
    #[error("invalid spec: {0}")]
    InvalidSpec(#[from] SpecError),
    #[error("no Redis URL: set spec.redis.url, or pass --redis-url")]
    NoRedisUrl,
    #[error("spec.redis.secretRef needs the Kubernetes API: pass --redis-url outside a cluster")]
    SecretRefOutsideCluster,
    #[error("Redis at {url} is unreachable: {source}")]
    RedisUnavailable {
        url: String,
        #[source]
        source: redis::RedisError,
    },
    #[error("Redis command failed: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("config hash in Redis is unreadable: {0}")]
    Config(#[from] ConfigError),
    #[error("high availability is required but missing: {0}")]
    HighAvailabilityMissing(String),
}

impl Error {
    /// A short, bounded label for the `dropgate_operator_reconcile_errors_total` metric.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::InvalidManifest(_) => "invalid_manifest",
            Error::InvalidSpec(_) => "invalid_spec",
            Error::NoRedisUrl | Error::SecretRefOutsideCluster => "no_redis_url",
            Error::RedisUnavailable { .. } => "redis_unavailable",
            Error::Redis(_) => "redis",
            Error::Config(_) => "config",
            Error::HighAvailabilityMissing(_) => "ha_missing",
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The InventoryDrop CRD as YAML, as `crdgen` prints it and `crds/` commits it.
pub fn crd_yaml() -> std::result::Result<String, serde_norway::Error> {
    use kube::CustomResourceExt;
    serde_norway::to_string(&dropgate_api::InventoryDrop::crd())
}

pub mod telemetry {
    /// Logs go to stderr so that `crdgen` and `apply` print clean YAML on stdout.
    /// `RUST_LOG` filters; the default is `info`.
    pub fn init() {
        let filter = tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init();
    }
}
