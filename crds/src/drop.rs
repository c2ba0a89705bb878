//! The `InventoryDrop` custom resource.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::MAX_QUANTITY;
use crate::config::{FailurePolicy, Mode};

/// A limited-quantity sale: `limitedQuantity` units of `sku`, never one more. The
/// operator seeds the stock into Redis and decides whether the sidecars' fast gate is
/// on; the sidecars sell from it.
// clippy reads the repeated `type_ = "integer"` of two printcolumns as a duplicate.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, PartialEq, KubeSchema)]
#[kube(
    group = "dropgate.io",
    version = "v1alpha1",
    kind = "InventoryDrop",
    doc = "A limited-quantity sale (a drop): limitedQuantity units of sku, never one more. The operator seeds the stock into the Redis of spec.redis and decides whether the injected sidecars sell through the Redis gate (mode gate), through their SQL ledgers (fail-open) or not at all (closed).",
    namespaced,
    status = "InventoryDropStatus",
    shortname = "idrop",
    category = "dropgate",
    printcolumn(name = "SKU", type_ = "string", json_path = ".spec.sku"),
    printcolumn(name = "LIMIT", type_ = "integer", json_path = ".status.limit"),
    printcolumn(name = "REMAINING", type_ = "integer", json_path = ".status.remaining"),
    printcolumn(
        name = "RESERVED",
        type_ = "integer",
        json_path = ".status.reserved",
        priority = 1
    ),
    printcolumn(name = "MODE", type_ = "string", json_path = ".status.mode"),
    printcolumn(name = "PHASE", type_ = "string", json_path = ".status.phase"),
    printcolumn(
        name = "READY",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "AGE",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    // Moving a live drop to another Redis would strand its stock and its buyers'
    // reservations in the old one.
    // Only where the Redis is: requireHighAvailability or the Memorystore instance
    // may change mid-sale (an HA incident may call for it).
    validation = Rule::new(
        "!has(oldSelf.status) || !has(oldSelf.status.mode) || oldSelf.status.phase == 'Ended' || ((has(self.spec.redis.url) ? self.spec.redis.url : '') == (has(oldSelf.spec.redis.url) ? oldSelf.spec.redis.url : '') && has(self.spec.redis.secretRef) == has(oldSelf.spec.redis.secretRef) && (!has(self.spec.redis.secretRef) || self.spec.redis.secretRef == oldSelf.spec.redis.secretRef))"
    ).message(
        "spec.redis.url and spec.redis.secretRef cannot change while the sale runs (its stock and reservations live in that Redis): wait until it ended, or delete and re-create the drop"
    ).field_path(".spec.redis")
)]
// Unknown fields are ignored here (the API server prunes them anyway), so that an
// object written under a newer CRD version cannot stop the watch of every drop;
// `dropgate-operator apply -f` refuses them itself (see `unknown_fields`).
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("!has(self.startsAt) || !has(self.endsAt) || self.endsAt > self.startsAt")
        .message("endsAt must be after startsAt")
        .field_path(".endsAt"),
    // Ratcheted: an object stored before the rule may still be changed otherwise
    // (a restock, the kill switch); the operator publishes its hold raised to the
    // shortest that keeps the promise (`published_hold_seconds`).
    validation = Rule::new("self.throttle.acquireTimeoutMs + 2000 < self.holdSeconds * 1000 || oldSelf.optMap(o, o.holdSeconds == self.holdSeconds && o.throttle.acquireTimeoutMs == self.throttle.acquireTimeoutMs).orValue(false)")
        .message("holdSeconds must be longer than throttle.acquireTimeoutMs plus the ledger's 2 s commit deadline (a hold outlasts its admission's pending bound)")
        .field_path(".holdSeconds")
        .optional_old_self(true),
    validation = Rule::new("!has(self.maxHoldSeconds) || self.maxHoldSeconds >= self.holdSeconds")
        .message("maxHoldSeconds must be at least holdSeconds (a hold is never cut short by it)")
        .field_path(".maxHoldSeconds"),
    validation = Rule::new("has(self.limitedQuantity) || (has(self.variants) && size(self.variants) > 0)")
        .message("set limitedQuantity, or variants (whose quantities add up to the drop's), or both")
        .field_path(".limitedQuantity"),
    validation = Rule::new("!has(self.limitedQuantity) || !has(self.variants) || size(self.variants) == 0 || self.limitedQuantity == self.variants.map(v, v.quantity).sum()")
        .message("limitedQuantity must equal the sum of the variants' quantities (or leave it out)")
        .field_path(".limitedQuantity")
)]
pub struct InventoryDropSpec {
    /// The stock-keeping unit being sold, as the shop names it.
    #[schemars(length(min = 1, max = 256))]
    pub sku: String,
    /// Units for sale. Without variants, changing it later restocks by the
    /// difference. Optional with variants; when given with them, it must equal their
    /// sum (change the variants' quantities to restock).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 2147483647))]
    pub limited_quantity: Option<i64>,
    /// The drop's variants (sizes, colours), each with its own stock: a reserve then
    /// names one. perUserLimit counts a buyer's units across all of them. A changed
    /// quantity restocks that variant by the difference; a variant removed keeps its
    /// holds (they count in status.reserved) and sells nothing more: new reserves of
    /// it answer 404, and it leaves status.variants and the sidecars' GET.
    #[serde(default)]
    #[schemars(length(max = 100))]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["name".into()]))]
    pub variants: Vec<Variant>,
    /// Units one user may hold at once (active and confirmed reservations).
    #[serde(default = "default_per_user_limit")]
    #[schemars(range(min = 1, max = 2147483647))]
    pub per_user_limit: i64,
    /// Before this instant (RFC 3339) the gate answers `not_open`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub starts_at: Option<Time>,
    /// From this instant (RFC 3339) on the gate answers `ended`. Must be after
    /// startsAt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ends_at: Option<Time>,
    /// An admitted reservation not confirmed within this many seconds expires and
    /// returns its stock. Longer than throttle.acquireTimeoutMs plus the ledger's 2 s
    /// commit deadline, so that no hold expires while its admission is being made
    /// durable: the schema allows 1, the smallest valid hold is
    /// floor((acquireTimeoutMs + 2000) / 1000) + 1 (3 with the default).
    #[serde(default = "default_hold_seconds")]
    #[schemars(range(min = 1, max = 604800))]
    pub hold_seconds: i64,
    /// How far an extension (`POST .../reservations/{key}/extend`) may move a hold's
    /// deadline, in seconds counted from its admission. Defaults to holdSeconds: no
    /// extension unless set. At least holdSeconds, at most 604800 (one week).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 604800))]
    pub max_hold_seconds: Option<i64>,
    /// True stops new reservations (a reserve answers 403 `paused`, a cart line is
    /// short for it) and nothing else: confirms, cancels, look-ups and expiry go
    /// on, the stock is untouched. Set it back to false to sell again at once.
    #[serde(default)]
    pub paused: bool,
    /// A line for buyers turned away: units that come back (a cancel, an expiry, a
    /// restock) are offered to it first, strictly in order, and while anyone waits a
    /// new reserve answers `sold_out`.
    #[serde(default)]
    pub waitlist: WaitlistSpec,
    /// The Redis that holds the drop's stock, and whether it must be highly
    /// available. Cannot change while the sale runs.
    pub redis: RedisSpec,
    /// Whether the sidecars sell through the Redis gate, and what they do when it
    /// cannot be trusted.
    #[serde(default)]
    pub gate: GateSpec,
    /// Per-sidecar throttling of admitted but unconfirmed reservations.
    #[serde(default)]
    pub throttle: ThrottleSpec,
}

/// One variant of a drop and its units for sale.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
pub struct Variant {
    /// The variant's name as reserves give it (`US-9`): unique within the drop.
    #[schemars(regex(pattern = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"))]
    pub name: String,
    /// Its units for sale. Changing it later restocks the variant by the difference.
    #[schemars(range(min = 0, max = 2147483647))]
    pub quantity: i64,
}

/// Whether `name` is a variant name (`^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$`): it is
/// written into Redis's config hash and keys as it is.
pub fn is_variant_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphanumeric())
        && name.len() <= 63
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

/// A Google Cloud project ID: `^[a-z][a-z0-9-]{4,28}[a-z0-9]$`.
fn is_project_id(s: &str) -> bool {
    (6..=30).contains(&s.len()) && is_lowercase_name(s)
}

/// A region such as `europe-west1`: words joined by hyphens, ending in digits.
fn is_region(s: &str) -> bool {
    let words = s.trim_end_matches(|c: char| c.is_ascii_digit());
    s.len() <= 63
        && words.len() < s.len()
        && words.split('-').count() >= 2
        && words
            .split('-')
            .all(|word| !word.is_empty() && word.chars().all(|c| c.is_ascii_lowercase()))
}

/// A Memorystore instance ID: `^[a-z]([a-z0-9-]{0,61}[a-z0-9])?$`.
fn is_instance_id(s: &str) -> bool {
    (1..=63).contains(&s.len()) && is_lowercase_name(s)
}

/// Lowercase letters, digits and hyphens, starting with a letter, not ending with a
/// hyphen.
fn is_lowercase_name(s: &str) -> bool {
    s.starts_with(|c: char| c.is_ascii_lowercase())
        && !s.ends_with('-')
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
}

fn default_per_user_limit() -> i64 {
    1
}

fn default_hold_seconds() -> i64 {
    600
}

/// Where the drop's Redis is and how much to trust it.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!(has(self.url) && has(self.secretRef))").message("set either url or secretRef, not both"))]
#[x_kube(validation = Rule::new("!has(self.url) || !self.url.matches('^rediss?://[^/?#]*:[^/?#]*@')").message("spec.redis.url holds a password, which whoever may read the drop would see (the injected sidecars' service accounts may): put the URL in a Secret and name it in spec.redis.secretRef"))]
pub struct RedisSpec {
    /// `redis://` or `rediss://` (TLS) URL, without a password (the API server
    /// refuses one: whoever may read the drop would see it; put such a URL in a
    /// Secret and use secretRef). Without either, the operator's --redis-url applies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^rediss?://"), length(max = 2048))]
    pub url: Option<String>,
    /// A key of a Secret in the drop's namespace that holds the URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<SecretKeyRef>,
    /// A Google Memorystore for Redis instance: its tier and state are checked
    /// through Google's API (and its host and port against the drop's URL) instead
    /// of `INFO replication`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memorystore: Option<MemorystoreInstance>,
    /// Refuse to trust a Redis that is not highly available: without a verified
    /// replica, gate.failurePolicy decides (fail open to the SQL fallback, or close).
    #[serde(default)]
    pub require_high_availability: bool,
    /// The URL names a node (or the discovery endpoint) of a Redis Cluster: the
    /// drop lives in its hash tag's slot, and highly available means every shard's
    /// primary has an online replica. The sidecars need `--redis-cluster` too.
    #[serde(default)]
    pub cluster: bool,
}

/// A key of a Secret in the drop's namespace.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
pub struct SecretKeyRef {
    /// The Secret's name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// The key within the Secret's data.
    #[schemars(length(min = 1, max = 253))]
    pub key: String,
}

/// A Memorystore for Redis instance: `projects/{project}/locations/{location}/instances/{instance}`.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
pub struct MemorystoreInstance {
    /// The Google Cloud project ID: 6 to 30 lowercase letters, digits and hyphens,
    /// starting with a letter, not ending with a hyphen.
    #[schemars(regex(pattern = r"^[a-z][a-z0-9-]{4,28}[a-z0-9]$"))]
    pub project: String,
    /// The region, such as europe-west1.
    #[schemars(regex(pattern = r"^[a-z]+(-[a-z]+)+[0-9]+$"), length(max = 63))]
    pub location: String,
    /// The instance ID; with `cluster: true`, the Memorystore for Redis Cluster's
    /// ID (checked as ACTIVE with a replica per shard): lowercase letters, digits and
    /// hyphens, starting with a letter, not ending with a hyphen, at most 63.
    #[schemars(regex(pattern = r"^[a-z]([a-z0-9-]{0,61}[a-z0-9])?$"))]
    pub instance: String,
}

/// The gate's switches.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GateSpec {
    /// Kill switch: `false` sends every sidecar to the SQL fallback path.
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// When HA is required and missing: `Open` sells through the SQL fallback,
    /// `Closed` stops selling until Redis is highly available again.
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

/// The drop's waitlist.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WaitlistSpec {
    /// Whether buyers may wait in line (`POST /v1/drops/{drop}/waitlist`).
    #[serde(default)]
    pub enabled: bool,
    /// Most entries the line holds at once (per variant); a join beyond it answers
    /// 409 `waitlist_full`.
    #[serde(default = "default_waitlist_length")]
    #[schemars(range(min = 1, max = 1000000))]
    pub max_length: i64,
}

impl Default for WaitlistSpec {
    fn default() -> Self {
        Self {
            enabled: false,
            max_length: default_waitlist_length(),
        }
    }
}

fn default_waitlist_length() -> i64 {
    10_000
}

impl WaitlistSpec {
    /// The line's length bound, `None` when the drop has no waitlist.
    pub fn bound(&self) -> Option<i64> {
        self.enabled.then_some(self.max_length)
    }
}

/// Throttling, per sidecar.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ThrottleSpec {
    /// Per sidecar: how many admitted but unconfirmed reservations may be in flight
    /// at once; an admission beyond it waits for a permit.
    #[serde(default = "default_permits")]
    #[schemars(range(min = 1, max = 1000000))]
    pub permits: i64,
    /// How long an admitted reservation waits for a permit before it is undone
    /// and answered 503 throttled (ms). Plus the ledger's 2 s commit deadline, it
    /// must be shorter than holdSeconds.
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
    /// spec.paused: no new reservations until it is set back.
    Paused,
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

/// What the operator last observed and decided.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct InventoryDropStatus {
    /// The generation of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Pending, Active, Paused, FailOpen, SoldOut, Ended or Error.
    #[serde(default)]
    pub phase: Phase,
    /// The mode published to the sidecars: gate, fail-open or closed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<Mode>,
    /// Units for sale as published: limitedQuantity, or the sum of the variants'.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<i64>,
    /// Units the gate may still admit, never below 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remaining: Option<i64>,
    /// Units held by active or confirmed reservations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserved: Option<i64>,
    /// Per variant (when the drop has variants): what it may still admit and what
    /// its reservations hold.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub variants: Vec<VariantStatus>,
    /// What the last HA check found behind the drop's Redis.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier: Option<Tier>,
    /// The sidecars sell through the SQL fallback.
    #[serde(default)]
    pub fail_open: bool,
    /// The id of the sale's ledger: the first sidecar to open the drop's gate or hand
    /// it to the ledger made its ledger the sale's, and only sidecars of that ledger
    /// change the sale. Kept here (Kubernetes is durable) and written back into a
    /// Redis that lost its data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ledger: Option<String>,
    /// Seeded, HighlyAvailable, FailOpen and Ready, one of each type.
    #[serde(default)]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["type".into()]))]
    pub conditions: Vec<Condition>,
}

/// One variant's stock as the operator last read it.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
pub struct VariantStatus {
    /// The variant's name, as in spec.variants.
    pub name: String,
    /// Its units for sale.
    pub limit: i64,
    /// Units the gate may still admit of it, never below 0 nor above what the drop
    /// as a whole may still admit.
    pub remaining: i64,
    /// Units held by active or confirmed reservations.
    pub reserved: i64,
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
    /// Units for sale: limitedQuantity, or the sum of the variants' quantities.
    pub fn limit(&self) -> i64 {
        self.limited_quantity.or(self.variants_total()).unwrap_or(0)
    }

    /// How far an extension may move a hold, from its admission (s): maxHoldSeconds,
    /// else holdSeconds (no extension).
    pub fn max_hold_seconds(&self) -> i64 {
        self.max_hold_seconds.unwrap_or(self.hold_seconds)
    }

    /// The shortest hold, in whole seconds, that outlasts an admission's pending
    /// bound: its permit wait, then the ledger's commit deadline.
    pub fn shortest_hold_seconds(&self) -> i64 {
        (self.throttle.acquire_timeout_ms + crate::COMMIT_DEADLINE_MS) / 1000 + 1
    }

    /// The hold the operator publishes: holdSeconds, or the shortest hold that
    /// keeps the promise when an object stored before that rule asks for less (the
    /// API server refuses such a hold on anything new or changed).
    pub fn published_hold_seconds(&self) -> i64 {
        self.hold_seconds.max(self.shortest_hold_seconds())
    }

    /// [`Self::max_hold_seconds`], never below the published hold.
    pub fn published_max_hold_seconds(&self) -> i64 {
        self.max_hold_seconds().max(self.published_hold_seconds())
    }

    /// The sum of the variants' quantities; `None` without variants.
    fn variants_total(&self) -> Option<i64> {
        (!self.variants.is_empty()).then(|| self.variants.iter().map(|v| v.quantity).sum())
    }

    /// Checks what the CRD schema checks (for manifests that never met an API server)
    /// and what it cannot: the sale window's order.
    pub fn validate(&self) -> Result<(), SpecError> {
        self.validate_stored()?;
        // A hold outlasts its admission's pending bound (the permit wait, then the
        // ledger's commit deadline), so that it cannot expire, and its unit be sold
        // again, before its admission is made durable.
        if self.throttle.acquire_timeout_ms + crate::COMMIT_DEADLINE_MS >= self.hold_seconds * 1000
        {
            return Err(SpecError {
                field: "holdSeconds",
                problem: "must be longer than throttle.acquireTimeoutMs plus the ledger's 2 s commit deadline".into(),
            });
        }
        Ok(())
    }

    /// [`Self::validate`] for an object the API server stored, which may predate
    /// the hold's rule (it is ratcheted there): everything but that rule, whose
    /// promise [`Self::published_hold_seconds`] keeps.
    pub fn validate_stored(&self) -> Result<(), SpecError> {
        let err = |field, problem: &str| {
            Err(SpecError {
                field,
                problem: problem.to_string(),
            })
        };
        if self.sku.trim().is_empty() {
            return err("sku", "must not be empty");
        }
        if let Some(limit) = self.limited_quantity
            && !(0..=MAX_QUANTITY).contains(&limit)
        {
            return err("limitedQuantity", "must be an integer from 0 to 2147483647");
        }
        if self.variants.len() > 100 {
            return err("variants", "must have at most 100 items");
        }
        let mut names = std::collections::HashSet::new();
        for variant in &self.variants {
            if !is_variant_name(&variant.name) {
                return err(
                    "variants",
                    &format!(
                        "variant name {:?} must match ^[A-Za-z0-9][A-Za-z0-9._-]{{0,62}}$",
                        variant.name
                    ),
                );
            }
            if !names.insert(variant.name.as_str()) {
                return err(
                    "variants",
                    &format!("variant {} is named twice", variant.name),
                );
            }
            if !(0..=MAX_QUANTITY).contains(&variant.quantity) {
                return err(
                    "variants",
                    &format!(
                        "variant {}'s quantity must be an integer from 0 to 2147483647",
                        variant.name
                    ),
                );
            }
        }
        match (self.limited_quantity, self.variants_total()) {
            (None, None) => {
                return err(
                    "limitedQuantity",
                    "set limitedQuantity, or variants (whose quantities add up to the drop's), or both",
                );
            }
            (Some(limit), Some(total)) if limit != total => {
                return err(
                    "limitedQuantity",
                    &format!(
                        "must equal the sum of the variants' quantities ({total}), or be left out"
                    ),
                );
            }
            (_, Some(total)) if total > MAX_QUANTITY => {
                return err("variants", "the quantities add up to more than 2147483647");
            }
            _ => {}
        }
        if !(1..=MAX_QUANTITY).contains(&self.per_user_limit) {
            return err("perUserLimit", "must be an integer from 1 to 2147483647");
        }
        if !(1..=604_800).contains(&self.hold_seconds) {
            return err("holdSeconds", "must be from 1 to 604800 (one week)");
        }
        if let Some(max) = self.max_hold_seconds {
            if !(1..=604_800).contains(&max) {
                return err("maxHoldSeconds", "must be from 1 to 604800 (one week)");
            }
            if max < self.hold_seconds {
                return err("maxHoldSeconds", "must be at least holdSeconds");
            }
        }
        if !(1..=1_000_000).contains(&self.waitlist.max_length) {
            return err("waitlist.maxLength", "must be from 1 to 1000000");
        }
        if let (Some(start), Some(end)) = (&self.starts_at, &self.ends_at)
            && end.0 <= start.0
        {
            return err("endsAt", "must be after startsAt");
        }
        if self.redis.url.is_some() && self.redis.secret_ref.is_some() {
            return err("redis", "set either url or secretRef, not both");
        }
        if let Some(instance) = &self.redis.memorystore {
            // Google's resource-name rules: the names go into the API's URL path.
            let (project, location, id) =
                (&instance.project, &instance.location, &instance.instance);
            if !is_project_id(project) {
                return err(
                    "redis.memorystore.project",
                    "must be a Google Cloud project ID: 6 to 30 lowercase letters, digits and hyphens, starting with a letter, not ending with a hyphen",
                );
            }
            if !is_region(location) {
                return err(
                    "redis.memorystore.location",
                    "must be a region such as europe-west1",
                );
            }
            if !is_instance_id(id) {
                return err(
                    "redis.memorystore.instance",
                    "must be 1 to 63 lowercase letters, digits and hyphens, starting with a letter, not ending with a hyphen",
                );
            }
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
        Ok(())
    }
}

/// The fields of a manifest's `spec` that [`InventoryDropSpec`] does not know, by
/// path (`spec.limitedQty`). The types ignore unknown fields (a watch must survive
/// an object from a newer CRD); a manifest applied by hand should not, since a
/// typo there silently drops a setting.
pub fn unknown_spec_fields(manifest: &serde_json::Value) -> Vec<String> {
    let Some(spec) = manifest.get("spec") else {
        return Vec::new();
    };
    let Ok(known) = serde_json::from_value::<InventoryDropSpec>(spec.clone())
        .and_then(|parsed| serde_json::to_value(&parsed))
    else {
        return Vec::new(); // type errors are reported by the parse itself
    };
    let mut unknown = Vec::new();
    collect_unknown(spec, &known, "spec", &mut unknown);
    unknown
}

fn collect_unknown(
    given: &serde_json::Value,
    known: &serde_json::Value,
    path: &str,
    unknown: &mut Vec<String>,
) {
    let (Some(given), Some(known)) = (given.as_object(), known.as_object()) else {
        return;
    };
    for (key, value) in given {
        let here = format!("{path}.{key}");
        match known.get(key) {
            Some(inner) => collect_unknown(value, inner, &here, unknown),
            // An explicit null of an optional field is not serialized back.
            None if value.is_null() => {}
            None => unknown.push(here),
        }
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
        let typo = MINIMAL.replace(
            "limitedQuantity: 5",
            "limitedQuantity: 5\n  limitedQty: 5\n  throttle: {permits: 2, permitz: 3}",
        );
        let value: serde_json::Value = serde_norway::from_str(&typo).expect("yaml");
        assert_eq!(
            unknown_spec_fields(&value),
            ["spec.limitedQty", "spec.throttle.permitz"]
        );
        assert!(parse(&typo).is_ok(), "a watch tolerates them");
        let value: serde_json::Value = serde_norway::from_str(MINIMAL).expect("yaml");
        assert!(unknown_spec_fields(&value).is_empty());
        // Defaults written out are known fields (how a sale is resumed).
        let defaults = MINIMAL.replace(
            "limitedQuantity: 5",
            "limitedQuantity: 5\n  paused: false\n  variants: []",
        );
        let value: serde_json::Value = serde_norway::from_str(&defaults).expect("yaml");
        assert_eq!(unknown_spec_fields(&value), Vec::<String>::new());
    }

    #[test]
    fn out_of_range_values_name_their_field() {
        let mut drop = parse(MINIMAL).expect("parses");
        drop.spec.limited_quantity = Some(-1);
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

    #[test]
    fn paused_defaults_to_false() {
        assert!(!parse(MINIMAL).expect("parses").spec.paused);
        let paused = MINIMAL.replace("limitedQuantity: 5", "limitedQuantity: 5\n  paused: true");
        assert!(parse(&paused).expect("parses").spec.paused);
    }

    /// The status's descriptions name what the operator writes (`kubectl explain`).
    #[test]
    fn the_status_text_names_every_phase_and_mode() {
        let schema =
            serde_json::to_value(schemars::schema_for!(InventoryDropStatus)).expect("a schema");
        let field = |name: &str| {
            schema["properties"][name]["description"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        };
        for phase in [
            Phase::Pending,
            Phase::Active,
            Phase::Paused,
            Phase::FailOpen,
            Phase::SoldOut,
            Phase::Ended,
            Phase::Error,
        ] {
            let word = serde_json::to_value(phase).expect("a word");
            let word = word.as_str().expect("a string");
            assert!(field("phase").contains(word), "phase text lacks {word}");
        }
        for mode in [Mode::Gate, Mode::FailOpen, Mode::Closed] {
            assert!(
                field("mode").contains(mode.as_str()),
                "mode text lacks {}",
                mode.as_str()
            );
        }
    }

    #[test]
    fn max_hold_defaults_to_the_hold_and_is_never_shorter() {
        let spec = parse(MINIMAL).expect("parses").spec;
        assert_eq!(spec.max_hold_seconds(), spec.hold_seconds);
        let longer = MINIMAL.replace(
            "limitedQuantity: 5",
            "limitedQuantity: 5\n  holdSeconds: 60\n  maxHoldSeconds: 300",
        );
        let spec = parse(&longer).expect("parses").spec;
        assert_eq!(spec.max_hold_seconds(), 300);
        assert_eq!(spec.validate(), Ok(()));
        for (max, says) in [("30", "at least holdSeconds"), ("604801", "604800")] {
            let yaml = MINIMAL.replace(
                "limitedQuantity: 5",
                &format!("limitedQuantity: 5\n  holdSeconds: 60\n  maxHoldSeconds: {max}"),
            );
            let refused = parse(&yaml)
                .expect("parses")
                .spec
                .validate()
                .expect_err(max);
            assert_eq!(refused.field, "maxHoldSeconds");
            assert!(refused.to_string().contains(says), "{refused}");
        }
    }

    #[test]
    fn a_hold_outlasts_its_admissions_pending_bound() {
        let hold = |seconds: i64, acquire_ms: i64| {
            let yaml = MINIMAL.replace(
                "limitedQuantity: 5",
                &format!(
                    "limitedQuantity: 5\n  holdSeconds: {seconds}\n  throttle: {{acquireTimeoutMs: {acquire_ms}}}"
                ),
            );
            parse(&yaml).expect("parses").spec.validate()
        };
        assert_eq!(hold(3, 0), Ok(()));
        assert_eq!(hold(3, 999), Ok(()));
        for (seconds, acquire_ms) in [(1, 0), (2, 0), (3, 1000), (60, 58_000)] {
            let refused = hold(seconds, acquire_ms).expect_err("a hold within its pending bound");
            assert_eq!(refused.field, "holdSeconds");
        }
        // A stored object from before the rule is published with a hold that is.
        for (seconds, acquire_ms, published) in [(1, 0, 3), (2, 50, 3), (3, 999, 3), (2, 1000, 4)] {
            let yaml = MINIMAL.replace(
                "limitedQuantity: 5",
                &format!(
                    "limitedQuantity: 5\n  holdSeconds: {seconds}\n  throttle: {{acquireTimeoutMs: {acquire_ms}}}"
                ),
            );
            let spec = parse(&yaml).expect("parses").spec;
            assert_eq!(spec.validate_stored(), Ok(()));
            assert_eq!(
                spec.published_hold_seconds(),
                published,
                "{seconds} s, {acquire_ms} ms"
            );
            assert_eq!(spec.published_max_hold_seconds(), published);
            assert!(spec.published_hold_seconds() * 1000 > acquire_ms + crate::COMMIT_DEADLINE_MS);
        }
        // The API server's rule writes the deadline out: it must be this one.
        let crd = serde_json::to_string(&<InventoryDrop as kube::CustomResourceExt>::crd())
            .expect("serializes");
        assert!(
            crd.contains(&format!(
                "self.throttle.acquireTimeoutMs + {} < self.holdSeconds * 1000",
                crate::COMMIT_DEADLINE_MS
            )),
            "the CRD's hold rule names another deadline"
        );
    }

    fn with_sizes(limit: &str, sizes: &str) -> InventoryDropSpec {
        let yaml = MINIMAL.replace(
            "limitedQuantity: 5",
            &format!("{limit}\n  variants: {sizes}"),
        );
        parse(&yaml).expect("parses").spec
    }

    #[test]
    fn memorystore_names_follow_googles_rules() {
        let with = |project: &str, location: &str, instance: &str| {
            let yaml = MINIMAL.replace(
                "redis: {url: redis://localhost:6379}",
                &format!("redis: {{url: redis://localhost:6379, memorystore: {{project: '{project}', location: '{location}', instance: '{instance}'}}}}"),
            );
            parse(&yaml)
                .expect("parses")
                .spec
                .validate()
                .map_err(|e| e.field)
        };
        assert_eq!(with("my-proj", "europe-west1", "sale-cache"), Ok(()));
        assert_eq!(with("my-proj", "us-central1", "a"), Ok(()));
        let project = Err("redis.memorystore.project");
        assert_eq!(with("p", "europe-west1", "c"), project);
        assert_eq!(with("My-Proj", "europe-west1", "c"), project);
        assert_eq!(with("my-proj-", "europe-west1", "c"), project);
        assert_eq!(with("../../x", "europe-west1", "c"), project);
        let location = Err("redis.memorystore.location");
        assert_eq!(with("my-proj", "europe", "c"), location);
        assert_eq!(with("my-proj", "europe-west", "c"), location);
        assert_eq!(with("my-proj", "europe-west1/instances", "c"), location);
        let instance = Err("redis.memorystore.instance");
        assert_eq!(with("my-proj", "europe-west1", "1cache"), instance);
        assert_eq!(with("my-proj", "europe-west1", "cache-"), instance);
        assert_eq!(with("my-proj", "europe-west1", "a/../b"), instance);
        assert_eq!(with("my-proj", "europe-west1", &"c".repeat(64)), instance);
    }

    #[test]
    fn variants_add_up_have_unique_names_and_stand_in_for_the_limit() {
        let sizes = "[{name: US-9, quantity: 2}, {name: US-10, quantity: 3}]";
        let alone = with_sizes("", sizes);
        assert_eq!(alone.validate(), Ok(()));
        assert_eq!(alone.limit(), 5);
        assert_eq!(with_sizes("limitedQuantity: 5", sizes).validate(), Ok(()));
        let field = |spec: InventoryDropSpec| spec.validate().map_err(|e| e.field);
        assert_eq!(
            field(with_sizes("limitedQuantity: 6", sizes)),
            Err("limitedQuantity")
        );
        assert_eq!(
            field(with_sizes(
                "",
                "[{name: US-9, quantity: 2}, {name: US-9, quantity: 3}]"
            )),
            Err("variants")
        );
        assert_eq!(
            field(with_sizes("", "[{name: 'US 9', quantity: 2}]")),
            Err("variants")
        );
        assert_eq!(field(with_sizes("", "[]")), Err("limitedQuantity"));
        assert_eq!(
            parse(MINIMAL).expect("parses").spec.limit(),
            5,
            "without variants, limitedQuantity"
        );
    }
}
