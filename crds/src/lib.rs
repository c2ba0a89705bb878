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
//!
//! No I/O and no async runtime: the Redis connection both binaries use is the
//! `dropgate-redis` crate.

pub mod config;
pub mod drop;
pub mod keys;

pub use config::{ConfigError, DropConfig, FailurePolicy, Mode};
pub use drop::{
    InventoryDrop, InventoryDropSpec, InventoryDropStatus, Phase, Tier, Variant, VariantStatus,
};
pub use keys::{DropKeys, LockKeys};

/// Largest quantity, limit or count the gate handles: Lua numbers stay exact far
/// beyond it, and the HTTP API refuses anything larger.
pub const MAX_QUANTITY: i64 = i32::MAX as i64;

/// How long a sidecar's ledger commit of a change may take (its deadline). An
/// admission stays pending for at most its permit wait plus this (its pending
/// bound), so a drop's hold must outlast both: otherwise a hold could expire, and
/// its unit be sold again, while its admission is still being made durable. The
/// CRD's CEL rule writes the number out (`drop.rs`); a test keeps them equal.
pub const COMMIT_DEADLINE_MS: i64 = 2_000;

/// Longest idempotency key, user id or lock name accepted, in bytes.
pub const MAX_ID_BYTES: usize = 256;

/// Whether `value` (read from a Secret) is a Redis URL: `redis://` or `rediss://`
/// and parsable. The refusal never includes the value, which may be any secret the
/// drop's author pointed `secretRef` at.
pub fn check_redis_url(value: &str) -> Result<(), &'static str> {
    let value = value.trim_end();
    if !(value.starts_with("redis://") || value.starts_with("rediss://")) {
        return Err("does not hold a redis:// or rediss:// URL (its value is not shown)");
    }
    if url::Url::parse(value).is_err() {
        return Err("holds a Redis URL that does not parse (its value is not shown)");
    }
    Ok(())
}

/// A URL (Redis, PostgreSQL) fit for logs, errors, status messages and Events:
/// parsed as a URL, with its user and password replaced by `***`, every query
/// parameter whose name looks like a credential (`password`, `sslpassword`,
/// `token`, `secret`, `auth`, `key`, ...) given the value `***`, and its fragment
/// dropped; anything that does not parse as a URL is never echoed (it may be a
/// secret pasted in the wrong place) but named by a placeholder.
pub fn redact_url(raw: &str) -> String {
    const NOT_A_URL: &str = "<a value that is not a URL (not shown)>";
    let Ok(mut url) = url::Url::parse(raw) else {
        return NOT_A_URL.to_string();
    };
    if url.cannot_be_a_base() {
        return NOT_A_URL.to_string();
    }
    if !url.username().is_empty() || url.password().is_some() {
        // Both fail only for a URL that cannot have credentials (checked above).
        let _ = url.set_password(None);
        let _ = url.set_username("***");
    }
    let credential = |name: &str| {
        let name = name.to_ascii_lowercase();
        [
            "pass", "pwd", "secret", "token", "auth", "key", "cred", "sig",
        ]
        .iter()
        .any(|word| name.contains(word))
    };
    if url.query().is_some() {
        let pairs: Vec<(String, String)> = url
            .query_pairs()
            .map(|(name, value)| {
                let value = if credential(&name) {
                    "***".into()
                } else {
                    value.into_owned()
                };
                (name.into_owned(), value)
            })
            .collect();
        url.query_pairs_mut().clear().extend_pairs(pairs);
    }
    url.set_fragment(None);
    url.to_string()
}

#[cfg(test)]
mod tests {
    #[test]
    fn passwords_never_reach_messages() {
        assert_eq!(
            super::redact_url("rediss://default:s3cret@redis:6379/0"),
            "rediss://***@redis:6379/0"
        );
        assert_eq!(
            super::redact_url("postgres://app:pw@db/shop"),
            "postgres://***@db/shop"
        );
        assert_eq!(
            super::redact_url("redis://redis:6379"),
            "redis://redis:6379"
        );
    }

    #[test]
    fn a_secret_that_holds_no_redis_url_is_refused_without_showing_it() {
        assert_eq!(
            super::check_redis_url("rediss://default:s3cret@redis:6380"),
            Ok(())
        );
        assert_eq!(super::check_redis_url("redis://redis:6379\n"), Ok(()));
        for value in [
            "hunter2-SECRET-VALUE",
            "postgres://u:p@db/x",
            "redis:/x",
            "redis://[bad",
        ] {
            let why = super::check_redis_url(value).expect_err(value);
            assert!(!why.contains("hunter2") && !why.contains("u:p"), "{why}");
        }
    }

    /// Hostile values: whatever is fed in, no part of a credential comes out.
    #[test]
    fn no_credential_survives_redaction_whatever_the_value() {
        let secrets = [
            "s3cret",
            "p@ss",
            "topsecret",
            "hunter2-SECRET-VALUE",
            "pässwörd",
            "tok3n",
        ];
        let hostile = [
            "redis://:p@ss@redis:6379/0",
            "rediss://default:s3cret@redis.example:6380",
            "postgres://app@db/shop?password=topsecret",
            "postgres://app@db/shop?sslmode=require&sslpassword=topsecret",
            "redis://redis:6379/0?token=tok3n#s3cret",
            "hunter2-SECRET-VALUE",
            "redis//user:s3cret@host",
            "redis://user:pässwörd@hôst.example:6379",
            "mailto:s3cret@example.com",
            "",
        ];
        for value in hostile {
            let shown = super::redact_url(value);
            for secret in secrets {
                assert!(!shown.contains(secret), "{value:?} was shown as {shown:?}");
            }
        }
        assert_eq!(
            super::redact_url("redis://:p@ss@redis:6379/0"),
            "redis://***@redis:6379/0"
        );
        assert_eq!(
            super::redact_url("postgres://app@db/shop?sslmode=require&password=topsecret"),
            "postgres://***@db/shop?sslmode=require&password=***"
        );
        assert_eq!(
            super::redact_url("hunter2-SECRET-VALUE"),
            "<a value that is not a URL (not shown)>"
        );
    }
}
