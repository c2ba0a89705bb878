//! The dropgate contract shared by the operator and the sidecar.
//!
//! # Layout
//!
//! - [`drop`]: the `InventoryDrop` custom resource (spec, status, conditions) and the
//!   validation that `kubectl apply` and `dropgate-operator apply -f` both rely on. The
//!   CRD in `crds/inventorydrop.yaml` is generated from these types.
//! - [`keys`]: the only place that formats Redis key names. Every key of one drop
//!   carries the hash tag `{namespace/name}`, so a drop lives in one Redis Cluster slot
//!   and each Lua script touches one slot.
//! - [`config`]: the config hash the operator publishes per drop and the sidecars read:
//!   field names, encoding and decoding.
//! - [`connection`]: one Redis or a Redis Cluster, as both binaries talk to it.

mod cluster;
pub mod config;
pub mod connection;
pub mod drop;
pub mod keys;

pub use cluster::{is_cluster_redirect, is_not_a_cluster};
pub use config::{ConfigError, DropConfig, FailurePolicy, Mode};
pub use connection::Connection;
pub use drop::{InventoryDrop, InventoryDropSpec, InventoryDropStatus, Phase, Tier};
pub use keys::{DropKeys, LockKeys};

/// Largest quantity, limit or count the gate handles: Lua numbers stay exact far
/// beyond it, and the HTTP API refuses anything larger.
pub const MAX_QUANTITY: i64 = i32::MAX as i64;

/// Longest idempotency key, user id or lock name accepted, in bytes.
pub const MAX_ID_BYTES: usize = 256;

/// A URL (Redis, PostgreSQL) with any password replaced, fit for logs, errors and status messages.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    match rest.split_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
            format!("{scheme}://{user}:***@{host}")
        }
        None => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn passwords_never_reach_messages() {
        assert_eq!(
            super::redact_url("rediss://default:s3cret@redis:6379/0"),
            "rediss://default:***@redis:6379/0"
        );
        assert_eq!(
            super::redact_url("postgres://app:pw@db/shop"),
            "postgres://app:***@db/shop"
        );
        assert_eq!(
            super::redact_url("redis://redis:6379"),
            "redis://redis:6379"
        );
    }
}
