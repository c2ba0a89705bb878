//! The `InventoryDrop` custom resource.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::MAX_QUANTITY;
use crate::config::{FailurePolicy, Mode};

/// A limited-quantity sale: `limitedQuantity` units of `sku`, never one more.
// clippy reads the repeated `type_ = "integer"` of two printcolumns as a duplicate.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "dropgate.io",
    version = "v1alpha1",
    kind = "InventoryDrop",
    namespaced,
    status = "InventoryDropStatus",
    shortname = "idrop",
    printcolumn(name = "SKU", type_ = "string", json_path = ".spec.sku"),
    printcolumn(name = "LIMIT", type_ = "integer", json_path = ".spec.limitedQuantity"),
    printcolumn(name = "REMAINING", type_ = "integer", json_path = ".status.remaining"),
    printcolumn(name = "MODE", type_ = "string", json_path = ".status.mode"),
    printcolumn(
        name = "AGE",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InventoryDropSpec {
    /// The stock-keeping unit being sold.
    #[schemars(length(min = 1))]
    pub sku: String,
    /// Units for sale. Changing it later restocks by the difference.
    #[schemars(range(min = 0, max = 2147483647))]
    pub limited_quantity: i64,
    /// Units one user may hold at once.
    #[serde(default = "default_per_user_limit")]
    #[schemars(range(min = 1, max = 2147483647))]
    pub per_user_limit: i64,
    /// Before this instant the gate answers `not_open`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub starts_at: Option<Time>,
    /// From this instant on the gate answers `ended`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ends_at: Option<Time>,
    /// An admitted reservation not confirmed within this many seconds expires and
    /// returns its stock.
    #[serde(default = "default_hold_seconds")]
    #[schemars(range(min = 1, max = 604800))]
    pub hold_seconds: i64,
    pub redis: RedisSpec,
    #[serde(default)]
    pub gate: GateSpec,
    #[serde(default)]
    pub throttle: ThrottleSpec,
}

fn default_per_user_limit() -> i64 {
    1
}

fn default_hold_seconds() -> i64 {
    600
}

/// Where the drop's Redis is and how much to trust it.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RedisSpec {
    /// `redis://` or `rediss://` (TLS) URL, with AUTH credentials if needed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// A Secret key holding the URL, when it carries credentials.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<SecretKeyRef>,
    /// Verify the tier through Google's Memorystore API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memorystore: Option<MemorystoreInstance>,
    /// Refuse to trust a Redis that is not highly available.
    #[serde(default)]
    pub require_high_availability: bool,
}

#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SecretKeyRef {
    #[schemars(length(min = 1))]
    pub name: String,
    #[schemars(length(min = 1))]
    pub key: String,
}

#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MemorystoreInstance {
    #[schemars(length(min = 1))]
    pub project: String,
    #[schemars(length(min = 1))]
    pub location: String,
    #[schemars(length(min = 1))]
    pub instance: String,
}

#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GateSpec {
    /// Kill switch: `false` sends every sidecar to the fallback path.
    #[serde(default = "default_true")]
    pub enabled: bool,
    #[serde(default)]
    pub failure_policy: FailurePolicy,
}

impl Default for GateSpec {
    fn default() -> Self {
        Self {
            enabled: true,
            failure_policy: FailurePolicy::Open,
        }
    }
}

fn default_true() -> bool {
    true
}

#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ThrottleSpec {
    /// Per sidecar: admitted-but-unconfirmed reservations in flight.
    #[serde(default = "default_permits")]
    #[schemars(range(min = 1, max = 1000000))]
    pub permits: i64,
    /// How long an admitted reservation waits for a permit before it is undone.
    #[serde(default = "default_acquire_timeout_ms")]
    #[schemars(range(min = 0, max = 60000))]
    pub acquire_timeout_ms: i64,
}

impl Default for ThrottleSpec {
    fn default() -> Self {
        Self {
            permits: default_permits(),
            acquire_timeout_ms: default_acquire_timeout_ms(),
        }
    }
}

fn default_permits() -> i64 {
    64
}

fn default_acquire_timeout_ms() -> i64 {
    50
}

/// Lifecycle summary shown by `kubectl get`.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum Phase {
    #[default]
    Pending,
    Active,
    FailOpen,
    SoldOut,
    Ended,
    Error,
}

/// What the HA check found behind the drop's Redis.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum Tier {
    #[serde(rename = "STANDARD_HA")]
    StandardHa,
    #[serde(rename = "BASIC")]
    Basic,
    #[serde(rename = "replicated")]
    Replicated,
    #[serde(rename = "standalone")]
    Standalone,
    #[serde(rename = "unknown")]
    Unknown,
}

impl Tier {
    pub fn is_highly_available(self) -> bool {
        matches!(self, Tier::StandardHa | Tier::Replicated)
    }
}

#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InventoryDropStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default)]
    pub phase: Phase,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<Mode>,
    /// Units the gate may still admit, never below 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remaining: Option<i64>,
    /// Units held by active or confirmed reservations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserved: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier: Option<Tier>,
    #[serde(default)]
    pub fail_open: bool,
    #[serde(default)]
    pub conditions: Vec<Condition>,
}

/// Spec values that the schema cannot express or that came from a file rather than
/// the API server: each names its field, as `kubectl` would.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("spec.{field}: {problem}")]
pub struct SpecError {
    pub field: &'static str,
    pub problem: String,
}

impl InventoryDropSpec {
    /// Checks what the CRD schema checks (for manifests that never met an API server)
    /// and what it cannot: the sale window's order.
    pub fn validate(&self) -> Result<(), SpecError> {
        let err = |field, problem: &str| {
            Err(SpecError {
                field,
                problem: problem.to_string(),
            })
        };
        if self.sku.trim().is_empty() {
            return err("sku", "must not be empty");
        }
        if !(0..=MAX_QUANTITY).contains(&self.limited_quantity) {
            return err("limitedQuantity", "must be an integer from 0 to 2147483647");
        }
        if !(1..=MAX_QUANTITY).contains(&self.per_user_limit) {
            return err("perUserLimit", "must be an integer from 1 to 2147483647");
        }
        if !(1..=604_800).contains(&self.hold_seconds) {
            return err("holdSeconds", "must be from 1 to 604800 (one week)");
        }
        if let (Some(start), Some(end)) = (&self.starts_at, &self.ends_at)
            && end.0 <= start.0
        {
            return err("endsAt", "must be after startsAt");
        }
        if self.redis.url.is_some() && self.redis.secret_ref.is_some() {
            return err("redis", "set either url or secretRef, not both");
        }
        if let Some(url) = &self.redis.url
            && !(url.starts_with("redis://") || url.starts_with("rediss://"))
        {
            return err("redis.url", "must start with redis:// or rediss://");
        }
        if !(1..=1_000_000).contains(&self.throttle.permits) {
            return err("throttle.permits", "must be from 1 to 1000000");
        }
        if !(0..=60_000).contains(&self.throttle.acquire_timeout_ms) {
            return err("throttle.acquireTimeoutMs", "must be from 0 to 60000");
        }
        // An admission waits for its permit within its hold, so that it cannot
        // expire before it is activated.
        if self.throttle.acquire_timeout_ms >= self.hold_seconds * 1000 {
            return err(
                "throttle.acquireTimeoutMs",
                "must be shorter than holdSeconds",
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(yaml: &str) -> Result<InventoryDrop, serde_norway::Error> {
        serde_norway::from_str(yaml)
    }

    const MINIMAL: &str = "
apiVersion: dropgate.io/v1alpha1
kind: InventoryDrop
metadata: {name: d, namespace: shop}
spec:
  sku: X
  limitedQuantity: 5
  redis: {url: redis://localhost:6379}
";

    #[test]
    fn defaults_fill_what_the_manifest_leaves_out() {
        let drop = parse(MINIMAL).expect("minimal manifest parses");
        assert_eq!(drop.spec.per_user_limit, 1);
        assert_eq!(drop.spec.hold_seconds, 600);
        assert!(drop.spec.gate.enabled);
        assert_eq!(drop.spec.gate.failure_policy, FailurePolicy::Open);
        assert_eq!(drop.spec.throttle.permits, 64);
        assert_eq!(drop.spec.throttle.acquire_timeout_ms, 50);
        assert_eq!(drop.spec.validate(), Ok(()));
    }

    #[test]
    fn wrong_types_and_unknown_fields_are_refused_by_name() {
        let boolean = MINIMAL.replace("limitedQuantity: 5", "limitedQuantity: true");
        assert!(parse(&boolean).is_err());
        let typo = MINIMAL.replace("limitedQuantity: 5", "limitedQuantity: 5\n  limitedQty: 5");
        let msg = parse(&typo).expect_err("unknown field").to_string();
        assert!(msg.contains("limitedQty"), "{msg}");
    }

    #[test]
    fn out_of_range_values_name_their_field() {
        let mut drop = parse(MINIMAL).expect("parses");
        drop.spec.limited_quantity = -1;
        assert_eq!(
            drop.spec.validate().map_err(|e| e.field),
            Err("limitedQuantity")
        );
        let mut drop = parse(MINIMAL).expect("parses");
        drop.spec.per_user_limit = 0;
        assert_eq!(
            drop.spec.validate().map_err(|e| e.field),
            Err("perUserLimit")
        );
        let mut drop = parse(MINIMAL).expect("parses");
        drop.spec.sku = " ".into();
        assert_eq!(drop.spec.validate().map_err(|e| e.field), Err("sku"));
        let window = MINIMAL.replace(
            "limitedQuantity: 5",
            "limitedQuantity: 5\n  startsAt: 2026-12-01T12:00:00Z\n  endsAt: 2026-12-01T10:00:00Z",
        );
        let drop = parse(&window).expect("parses");
        assert_eq!(drop.spec.validate().map_err(|e| e.field), Err("endsAt"));
    }
}
