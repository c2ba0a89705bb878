//! The dropgate operator: makes Redis match each `InventoryDrop`.
//!
//! # Layout
//!
//! - [`decide`]: the reconciler's judgement as plain functions — which mode a drop
//!   runs in, its phase and its conditions — from the spec and what was observed.
//!   No I/O, so table tests cover every case.
//! - [`store`]: the Redis side: publish the config hash and seed or restock stock in
//!   one Lua script (`lua/seed.lua`), read stock back, clean a deleted drop's keys.
//! - [`ha`]: high-availability verification by `INFO replication`; [`memorystore`]:
//!   by Google's Memorystore API when the drop names an instance.
//! - [`reconcile`]: one reconcile of one drop against Redis, shared by the controller
//!   and by `apply`.
//! - [`apply`]: `dropgate-operator apply -f`, the same reconcile without Kubernetes.
//! - [`controller`]: `dropgate-operator run`: the kube-runtime controller around
//!   [`reconcile`], with the finalizer, status by server-side apply, Events on mode
//!   changes and backoff; [`lease`] keeps it to one active replica.
//! - [`admin`] and [`metrics`]: `/metrics` and `/healthz` on the admin port.
//! - [`cli`]: the command line and what each command runs; `main` only calls it.
//! - [`inject`]: sidecar injection, a pure function from pod to injected pod, served
//!   by the webhook ([`inject::webhook`]) and `inject -f` ([`inject::manifest`]).

pub mod admin;
pub mod apply;
pub mod cli;
pub mod controller;
pub mod decide;
pub mod ha;
pub mod inject;
pub mod lease;
pub mod memorystore;
pub mod metrics;
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
    #[error(
        "Redis at {0} is a Redis Cluster node: set spec.redis.cluster: true (and run the sidecars with --redis-cluster)"
    )]
    ClusterNotDeclared(String),
    #[error(
        "Redis at {0} is not a Redis Cluster (its cluster support is disabled): set spec.redis.cluster: false"
    )]
    NotACluster(String),
    #[error("config hash in Redis is unreadable: {0}")]
    Config(#[from] ConfigError),
    #[error("high availability is required but missing: {0}")]
    HighAvailabilityMissing(String),
    #[error("secret {name}: {problem}")]
    Secret { name: String, problem: String },
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("finalizer: {0}")]
    Finalizer(#[source] Box<kube::runtime::finalizer::Error<Error>>),
    #[error("lost the leader lease {0}: another replica may be reconciling")]
    LeadershipLost(String),
    #[error("timed out: {0}")]
    Timeout(String),
    #[error("a newer config of this drop is already in Redis ({0}): not written back")]
    StaleConfig(String),
    #[error("the injection webhook cannot serve: {0}")]
    Webhook(String),
    #[error("{0}")]
    Admin(String),
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
            Error::ClusterNotDeclared(_) | Error::NotACluster(_) => "cluster_flag",
            Error::Config(_) => "config",
            Error::HighAvailabilityMissing(_) => "ha_missing",
            Error::Secret { .. } => "secret",
            Error::Kube(_) => "kube",
            Error::Finalizer(inner) => match inner.as_ref() {
                kube::runtime::finalizer::Error::ApplyFailed(e)
                | kube::runtime::finalizer::Error::CleanupFailed(e) => e.metric_label(),
                _ => "finalizer",
            },
            Error::LeadershipLost(_) => "leadership_lost",
            Error::Timeout(_) => "timeout",
            Error::StaleConfig(_) => "stale_config",
            Error::Webhook(_) => "webhook",
            Error::Admin(_) => "admin",
        }
    }

    /// Whether retrying cannot help: the cause is in the drop or its Secret, not in
    /// a Redis or an API that may come back.
    pub fn is_permanent(&self) -> bool {
        match self {
            Error::InvalidManifest(_)
            | Error::InvalidSpec(_)
            | Error::NoRedisUrl
            | Error::SecretRefOutsideCluster
            | Error::Secret { .. } => true,
            Error::RedisUnavailable { source, .. } => {
                source.kind() == redis::ErrorKind::InvalidClientConfig
            }
            _ => false,
        }
    }

    /// The `reason` of the Ready condition when a reconcile fails (CamelCase, as
    /// Kubernetes API conventions want).
    pub fn reason(&self) -> &'static str {
        match self {
            Error::InvalidManifest(_) | Error::InvalidSpec(_) => "InvalidSpec",
            Error::NoRedisUrl | Error::SecretRefOutsideCluster | Error::Secret { .. } => {
                "NoRedisUrl"
            }
            Error::RedisUnavailable { .. } | Error::Redis(_) => "RedisUnavailable",
            Error::ClusterNotDeclared(_) | Error::NotACluster(_) => "ClusterFlagMismatch",
            Error::Config(_) => "ConfigUnreadable",
            Error::StaleConfig(_) => "StaleConfig",
            Error::HighAvailabilityMissing(_) => "HighAvailabilityMissing",
            Error::Kube(_)
            | Error::Finalizer(_)
            | Error::LeadershipLost(_)
            | Error::Timeout(_)
            | Error::Webhook(_)
            | Error::Admin(_) => "KubernetesApiError",
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The InventoryDrop CRD as YAML, as `crdgen` prints it and `crds/` commits it.
pub fn crd_yaml() -> std::result::Result<String, serde_norway::Error> {
    use kube::CustomResourceExt;
    serde_norway::to_string(&dropgate_api::InventoryDrop::crd())
}
