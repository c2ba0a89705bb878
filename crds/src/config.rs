//! The config hash: what the operator publishes for each drop and every sidecar reads.
//!
//! It is a Redis hash at [`crate::DropKeys::config`]. Values are decimal strings; an
//! optional value that is not set is the empty string. The gate's Lua scripts read
//! `mode`, `perUserLimit`, `startsAt`, `endsAt`, `holdSeconds`, `maxHoldSeconds`,
//! `paused` and `expireAt` from it directly, inside the same atomic step that admits, so a mode change or a new
//! per-user limit takes effect at once in every sidecar, whatever it has cached.

use std::collections::HashMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::drop::{Variant, is_variant_name};

/// Version of this format, written as the `format` field.
pub const FORMAT: &str = "1";

/// How the sidecars answer for a drop.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// Redis's atomic Lua gate admits.
    Gate,
    /// The SQL ledger's own gate admits (kill switch, or HA missing under policy Open).
    FailOpen,
    /// Nothing is admitted: HA is required, missing, and the policy is Closed.
    Closed,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Gate => "gate",
            Mode::FailOpen => "fail-open",
            Mode::Closed => "closed",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "gate" => Some(Mode::Gate),
            "fail-open" => Some(Mode::FailOpen),
            "closed" => Some(Mode::Closed),
            _ => None,
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a sidecar does when it cannot reach Redis at all.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum FailurePolicy {
    /// Go on selling through the SQL ledger's gate.
    #[default]
    Open,
    /// Answer `unavailable`: no sale rather than a sale that is not gated by Redis.
    Closed,
}

impl FailurePolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            FailurePolicy::Open => "Open",
            FailurePolicy::Closed => "Closed",
        }
    }
}

/// One drop's published configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DropConfig {
    pub sku: String,
    /// The limit that `remaining` currently reflects: a restock moves `remaining` by
    /// the difference between a new limit and this one, so it must be stored. With
    /// variants, the sum of their quantities.
    pub limit: i64,
    /// The drop's variants and the quantity each stock reflects (written as
    /// `variants`: `US-9=20,US-10=30`); empty for a drop without variants, whose
    /// reserves name none.
    pub variants: Vec<Variant>,
    pub per_user_limit: i64,
    /// Sale window in ms since the epoch, `[starts_at, ends_at)`.
    pub starts_at_ms: Option<i64>,
    pub ends_at_ms: Option<i64>,
    pub hold_seconds: i64,
    /// How far an extension may move a hold's deadline, counted from its admission
    /// (`spec.maxHoldSeconds`, holdSeconds when not set).
    pub max_hold_seconds: i64,
    /// No new reservations while true (see `spec.paused`).
    pub paused: bool,
    /// Most entries a waitlist line holds (`spec.waitlist.maxLength`); `None` when
    /// the drop has no waitlist.
    pub waitlist: Option<i64>,
    /// Throttle permits per sidecar.
    pub permits: u32,
    pub acquire_timeout_ms: u64,
    pub mode: Mode,
    pub failure_policy: FailurePolicy,
    /// `metadata.generation` of the InventoryDrop this was published from; outside
    /// Kubernetes (`apply -f`), the seed's time in ms (at or above
    /// [`STAMPED_GENERATIONS`]).
    pub generation: i64,
    /// When the drop's keys expire (ms since the epoch): past `endsAt`, so that
    /// late confirms and refunds still find their reservations.
    pub expire_at_ms: Option<i64>,
    /// When the seed script last created the stock key (ms since the epoch). Written
    /// by the script itself, never by [`DropConfig::to_fields`]; for people reading
    /// the hash (the sidecars learn of a Redis that lost its data from the gate key
    /// and the change counter, see [`crate::DropKeys::gate`]).
    pub seeded_at_ms: Option<i64>,
    /// The sale's identity: the InventoryDrop's uid (outside Kubernetes, the
    /// manifest's `metadata.uid`, else a fixed word: the name is the sale). A new
    /// sale under the same name starts from fresh stock and its own ledger rows;
    /// markers of an earlier sale are not its reservations.
    pub sale: String,
}

/// A config hash that cannot be read: published by an incompatible operator, or
/// edited by hand.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("config hash has no field `{0}`")]
    Missing(&'static str),
    #[error("config hash field `{field}` has an invalid value {value:?}")]
    Invalid { field: &'static str, value: String },
}

/// Generations at or above this are `apply -f`'s seed times (ms since the epoch,
/// from Redis's clock: seed.lua's `STAMPED`), below it the API server's.
pub const STAMPED_GENERATIONS: i64 = 1_000_000_000_000;

/// Whether `generation` is one the API server numbered (see
/// [`DropConfig::published_by_operator`]): only such generations are compared to
/// tell a config Redis lost.
pub fn numbered_by_api_server(generation: i64) -> bool {
    generation > 0 && generation < STAMPED_GENERATIONS
}

/// Whether `newest` is a generation the API server numbered after `decided_on`
/// (one it numbered too): a decision made on `decided_on` was made on a config
/// Redis lost a change of.
pub fn lost_since(decided_on: i64, newest: i64) -> bool {
    numbered_by_api_server(decided_on) && numbered_by_api_server(newest) && newest > decided_on
}

impl DropConfig {
    /// Whether the API server numbered this config's generation, so that the
    /// operator publishes a newer one again at its next reconcile should Redis lose
    /// it (outside Kubernetes nothing does, and a new seed's time may even be lower
    /// on another host's clock).
    pub fn published_by_operator(&self) -> bool {
        numbered_by_api_server(self.generation)
    }

    /// The hash's fields, in the order they are written.
    pub fn to_fields(&self) -> Vec<(&'static str, String)> {
        let opt = |v: Option<i64>| v.map(|v| v.to_string()).unwrap_or_default();
        vec![
            ("format", FORMAT.to_string()),
            ("sku", self.sku.clone()),
            ("limit", self.limit.to_string()),
            ("variants", write_variants(&self.variants)),
            ("perUserLimit", self.per_user_limit.to_string()),
            ("startsAt", opt(self.starts_at_ms)),
            ("endsAt", opt(self.ends_at_ms)),
            ("holdSeconds", self.hold_seconds.to_string()),
            ("maxHoldSeconds", self.max_hold_seconds.to_string()),
            ("paused", if self.paused { "1" } else { "" }.to_string()),
            ("waitlist", opt(self.waitlist)),
            ("permits", self.permits.to_string()),
            ("acquireTimeoutMs", self.acquire_timeout_ms.to_string()),
            ("mode", self.mode.as_str().to_string()),
            ("failurePolicy", self.failure_policy.as_str().to_string()),
            ("generation", self.generation.to_string()),
            ("expireAt", opt(self.expire_at_ms)),
            ("sale", self.sale.clone()),
        ]
    }

    /// Reads a config hash as returned by HGETALL. An empty map means the drop is not
    /// published: that is `Ok(None)`, not an error.
    pub fn from_fields(fields: &HashMap<String, String>) -> Result<Option<Self>, ConfigError> {
        if fields.is_empty() {
            return Ok(None);
        }
        let get = |field: &'static str| {
            fields
                .get(field)
                .map(String::as_str)
                .ok_or(ConfigError::Missing(field))
        };
        let invalid = |field: &'static str, value: &str| ConfigError::Invalid {
            field,
            value: value.to_string(),
        };
        let int = |field: &'static str| -> Result<i64, ConfigError> {
            let v = get(field)?;
            v.parse().map_err(|_| invalid(field, v))
        };
        let opt_int = |field: &'static str| -> Result<Option<i64>, ConfigError> {
            match fields.get(field).map(String::as_str) {
                None | Some("") => Ok(None),
                Some(v) => v.parse().map(Some).map_err(|_| invalid(field, v)),
            }
        };
        let format = get("format")?;
        if format != FORMAT {
            return Err(invalid("format", format));
        }
        let mode = get("mode")?;
        let policy = get("failurePolicy")?;
        let permits = int("permits")?;
        let acquire_timeout_ms = int("acquireTimeoutMs")?;
        Ok(Some(DropConfig {
            sku: get("sku")?.to_string(),
            limit: int("limit")?,
            variants: match fields.get("variants").map(String::as_str) {
                None | Some("") => Vec::new(),
                Some(v) => parse_variants(v).ok_or_else(|| invalid("variants", v))?,
            },
            per_user_limit: int("perUserLimit")?,
            starts_at_ms: opt_int("startsAt")?,
            ends_at_ms: opt_int("endsAt")?,
            hold_seconds: int("holdSeconds")?,
            // It came after format 1's first fields: a hash without it was published
            // by an operator that knew no extension (none is allowed).
            max_hold_seconds: match opt_int("maxHoldSeconds")? {
                Some(max) => max,
                None => int("holdSeconds")?,
            },
            // It came after format 1's first fields: a hash without it was
            // published by an operator that knew no pause.
            paused: match fields.get("paused").map(String::as_str) {
                None | Some("") => false,
                Some("1") => true,
                Some(other) => return Err(invalid("paused", other)),
            },
            // Later still: a hash without it has no waitlist.
            waitlist: match opt_int("waitlist")? {
                Some(bound) if bound >= 1 => Some(bound),
                Some(bound) => return Err(invalid("waitlist", &bound.to_string())),
                None => None,
            },
            permits: u32::try_from(permits)
                .ok()
                .filter(|p| *p > 0)
                .ok_or_else(|| invalid("permits", &permits.to_string()))?,
            acquire_timeout_ms: u64::try_from(acquire_timeout_ms)
                .map_err(|_| invalid("acquireTimeoutMs", &acquire_timeout_ms.to_string()))?,
            mode: Mode::parse(mode).ok_or_else(|| invalid("mode", mode))?,
            failure_policy: match policy {
                "Open" => FailurePolicy::Open,
                "Closed" => FailurePolicy::Closed,
                other => return Err(invalid("failurePolicy", other)),
            },
            generation: int("generation")?,
            expire_at_ms: opt_int("expireAt")?,
            seeded_at_ms: opt_int("seededAt")?,
            sale: match get("sale")? {
                sale if is_sale(sale) => sale.to_string(),
                sale => return Err(invalid("sale", sale)),
            },
        }))
    }
}

impl DropConfig {
    /// The variant named `name`, if the drop has it.
    pub fn variant(&self, name: &str) -> Option<&Variant> {
        self.variants.iter().find(|v| v.name == name)
    }
}

/// `name=quantity` pairs, comma-separated (variant names have neither `=` nor `,`).
fn write_variants(variants: &[Variant]) -> String {
    variants
        .iter()
        .map(|v| format!("{}={}", v.name, v.quantity))
        .collect::<Vec<_>>()
        .join(",")
}

/// The `variants` field as written (empty: none); `None` when it is damaged.
pub fn parse_variants(value: &str) -> Option<Vec<Variant>> {
    if value.is_empty() {
        return Some(Vec::new());
    }
    value
        .split(',')
        .map(|pair| {
            let (name, quantity) = pair.split_once('=')?;
            let quantity: i64 = quantity.parse().ok()?;
            (is_variant_name(name) && quantity >= 0).then(|| Variant {
                name: name.to_string(),
                quantity,
            })
        })
        .collect()
}

/// Whether `s` can be a sale's identity: a uid or a number, nothing that could
/// break a ledger key apart.
pub fn is_sale(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
}

/// The sidecar's `--ledger-retention` (and the chart's `sidecar.ledgerRetention`,
/// checked by the webhook's flag): `<number><s|m|h|d>`, at least an hour (a sale's
/// rows and events must outlive any hold and any consumer's restart).
pub fn parse_retention(text: &str) -> Result<std::time::Duration, String> {
    let unit = text.chars().last().ok_or("a duration such as 30d or 12h")?;
    let seconds_per = match unit {
        's' => 1,
        'm' => 60,
        'h' => 3600,
        'd' => 86_400,
        _ => return Err(format!("{text:?}: end it with s, m, h or d (30d, 12h)")),
    };
    let number: u64 = text[..text.len() - 1]
        .parse()
        .map_err(|_| format!("{text:?}: a whole number then s, m, h or d (30d, 12h)"))?;
    let seconds = number
        .checked_mul(seconds_per)
        .filter(|s| *s <= 10 * 365 * 86_400)
        .ok_or_else(|| format!("{text:?}: at most ten years"))?;
    if seconds < 3600 {
        return Err(format!("{text:?}: at least 1h"));
    }
    Ok(std::time::Duration::from_secs(seconds))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> DropConfig {
        DropConfig {
            sku: "SNKR-0412".into(),
            limit: 100,
            variants: vec![
                Variant {
                    name: "US-9".into(),
                    quantity: 40,
                },
                Variant {
                    name: "US-10".into(),
                    quantity: 60,
                },
            ],
            per_user_limit: 1,
            starts_at_ms: Some(1_764_583_200_000),
            ends_at_ms: None,
            hold_seconds: 600,
            max_hold_seconds: 900,
            paused: true,
            waitlist: Some(500),
            permits: 64,
            acquire_timeout_ms: 50,
            mode: Mode::FailOpen,
            failure_policy: FailurePolicy::Closed,
            generation: 3,
            expire_at_ms: None,
            seeded_at_ms: None,
            sale: "9b1f0c2e".into(),
        }
    }

    fn as_map(cfg: &DropConfig) -> HashMap<String, String> {
        cfg.to_fields()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect()
    }

    #[test]
    fn only_the_api_servers_generations_are_published_by_the_operator() {
        let at = |generation| DropConfig {
            generation,
            ..sample()
        };
        assert!(at(3).published_by_operator());
        assert!(!at(0).published_by_operator(), "apply -f before its stamp");
        assert!(
            !at(1_764_000_000_000).published_by_operator(),
            "an apply -f seed time"
        );
    }

    #[test]
    fn a_hash_without_max_hold_allows_no_extension() {
        let mut fields = as_map(&sample());
        fields.remove("maxHoldSeconds");
        let read = DropConfig::from_fields(&fields)
            .expect("reads")
            .expect("published");
        assert_eq!(read.max_hold_seconds, read.hold_seconds);
    }

    #[test]
    fn a_hash_without_paused_is_not_paused() {
        let mut fields = as_map(&sample());
        fields.remove("paused");
        let read = DropConfig::from_fields(&fields)
            .expect("reads")
            .expect("published");
        assert!(!read.paused);
        fields.insert("paused".into(), "yes".into());
        assert_eq!(
            DropConfig::from_fields(&fields),
            Err(ConfigError::Invalid {
                field: "paused",
                value: "yes".into()
            })
        );
    }

    #[test]
    fn round_trips_through_the_hash() {
        let cfg = sample();
        assert_eq!(DropConfig::from_fields(&as_map(&cfg)), Ok(Some(cfg)));
    }

    #[test]
    fn an_empty_hash_is_an_unpublished_drop() {
        assert_eq!(DropConfig::from_fields(&HashMap::new()), Ok(None));
    }

    #[test]
    fn damaged_fields_are_named() {
        let mut map = as_map(&sample());
        map.insert("mode".into(), "fast".into());
        assert_eq!(
            DropConfig::from_fields(&map),
            Err(ConfigError::Invalid {
                field: "mode",
                value: "fast".into()
            })
        );
        map.remove("limit");
        assert_eq!(
            DropConfig::from_fields(&map),
            Err(ConfigError::Missing("limit"))
        );
        let mut map = as_map(&sample());
        map.insert("permits".into(), "0".into());
        assert!(DropConfig::from_fields(&map).is_err());
        for damaged in ["US-9", "US-9=x", "=4", "US 9=4", "US-9=-1", "US-9=4,"] {
            let mut map = as_map(&sample());
            map.insert("variants".into(), damaged.into());
            assert_eq!(
                DropConfig::from_fields(&map),
                Err(ConfigError::Invalid {
                    field: "variants",
                    value: damaged.into()
                }),
                "{damaged}"
            );
        }
    }
}
