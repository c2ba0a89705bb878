//! The reconciler's judgement, as plain functions of the spec and what was observed.

use dropgate_api::drop::GateSpec;
use dropgate_api::{
    DropConfig, FailurePolicy, InventoryDrop, InventoryDropStatus, Mode, Phase, VariantStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

use crate::Error;
use crate::ha::{HaReport, Verdict};
use crate::store::{Seeded, Stock};

/// How long a drop's keys outlive `endsAt`: long enough for late confirms, refunds
/// and the outbox's consumers.
const KEY_GRACE_MS: i64 = 7 * 24 * 3600 * 1000;

/// The mode rule of docs/design.md: the kill switch wins; then, where HA is required and
/// missing, the failure policy decides. `kept` is the mode to keep while the HA
/// check cannot be made (see [`kept_mode`]): an unanswered check is no verdict.
pub fn mode(gate: &GateSpec, require_ha: bool, ha: &HaReport, kept: Option<Mode>) -> Mode {
    if !gate.enabled {
        Mode::FailOpen
    } else if !require_ha || ha.is_highly_available() {
        Mode::Gate
    } else if let Some(kept) = kept.filter(|_| !ha.is_verified()) {
        kept
    } else {
        match gate.failure_policy {
            FailurePolicy::Open => Mode::FailOpen,
            FailurePolicy::Closed => Mode::Closed,
        }
    }
}

/// The mode to keep while the HA check cannot be made: the one published before,
/// for `grace` since the check first failed (the HighlyAvailable condition's
/// transition to Unknown). After that, or without a published mode, an unanswered
/// check counts as HA missing.
pub fn kept_mode(
    previous: Option<&InventoryDropStatus>,
    ha: &HaReport,
    now: Timestamp,
    grace: std::time::Duration,
) -> Option<Mode> {
    if ha.is_verified() {
        return None;
    }
    let previous = previous?;
    let since = previous
        .conditions
        .iter()
        .find(|c| c.type_ == "HighlyAvailable" && c.status == UNKNOWN)
        .map_or(now, |c| c.last_transition_time.0);
    let grace = k8s_openapi::jiff::SignedDuration::try_from(grace).ok()?;
    if now.duration_since(since) < grace {
        previous.mode
    } else {
        None
    }
}

/// A condition status: the HA check's third answer.
const UNKNOWN: &str = "Unknown";

/// The config hash to publish for `drop` in `mode`.
pub fn config(drop: &InventoryDrop, mode: Mode) -> DropConfig {
    let spec = &drop.spec;
    let ms = |t: &Option<Time>| t.as_ref().map(|t| t.0.as_millisecond());
    let ends_at_ms = ms(&spec.ends_at);
    DropConfig {
        sku: spec.sku.clone(),
        limit: spec.limit(),
        variants: spec.variants.clone(),
        per_user_limit: spec.per_user_limit,
        starts_at_ms: ms(&spec.starts_at),
        ends_at_ms,
        hold_seconds: spec.published_hold_seconds(),
        max_hold_seconds: spec.published_max_hold_seconds(),
        paused: spec.paused,
        waitlist: spec.waitlist.bound(),
        permits: u32::try_from(spec.throttle.permits).unwrap_or(1),
        acquire_timeout_ms: u64::try_from(spec.throttle.acquire_timeout_ms).unwrap_or(0),
        mode,
        failure_policy: spec.gate.failure_policy,
        generation: drop.metadata.generation.unwrap_or(0),
        // A hold admitted at the end may be extended to its longest.
        expire_at_ms: ends_at_ms
            .map(|end| end + spec.published_max_hold_seconds() * 1000 + KEY_GRACE_MS),
        seeded_at_ms: None,
        sale: sale_of(drop),
    }
}

/// The sale's identity: the object's uid, so that a drop deleted and re-created
/// under the same name is a new sale. A manifest applied outside Kubernetes has no
/// uid unless it sets one: there the name is the sale, so that a Redis that lost
/// its data and was seeded again is still the same sale, rebuilt from the ledgers.
pub fn sale_of(drop: &InventoryDrop) -> String {
    drop.metadata
        .uid
        .clone()
        .filter(|uid| dropgate_api::config::is_sale(uid))
        .unwrap_or_else(|| OUTSIDE_KUBERNETES_SALE.to_string())
}

/// The sale of a manifest without a uid (see [`sale_of`]).
pub const OUTSIDE_KUBERNETES_SALE: &str = "manifest";

/// Everything one reconcile learned, the input of [`status`].
#[derive(Clone, Debug)]
pub struct Observed {
    pub mode: Mode,
    pub ha: HaReport,
    /// The mode was kept from before because the HA check could not be made.
    pub kept: bool,
    pub seeded: Seeded,
    pub stock: Stock,
    /// The sale's ledger, once a sidecar claimed it.
    pub ledger: Option<String>,
    /// Redis's `maxmemory-policy`, when it says.
    pub eviction_policy: Option<String>,
    pub now: Timestamp,
}

/// The Seeded condition's reason when Redis may evict the drop's keys.
pub const EVICTION_POSSIBLE: &str = "EvictionPossible";

/// Whether the drop reached the state its spec asks for. A deliberate kill switch is
/// a reached state; HA that is required and missing is not; a mode kept through an
/// unanswered check stays what it was.
pub fn ready(drop: &InventoryDrop, observed: &Observed) -> bool {
    !drop.spec.redis.require_high_availability
        || observed.ha.is_highly_available()
        || (observed.kept && observed.mode == Mode::Gate)
}

pub fn phase(drop: &InventoryDrop, observed: &Observed) -> Phase {
    let now = observed.now;
    let before = |t: &Option<Time>| t.as_ref().is_some_and(|t| now < t.0);
    let reached = |t: &Option<Time>| t.as_ref().is_some_and(|t| now >= t.0);
    if reached(&drop.spec.ends_at) {
        Phase::Ended
    } else if !ready(drop, observed) && observed.mode == Mode::Closed {
        Phase::Error
    } else if observed.mode == Mode::FailOpen {
        Phase::FailOpen
    } else if before(&drop.spec.starts_at) {
        Phase::Pending
    } else if drop.spec.paused {
        Phase::Paused
    } else if observed.stock.remaining <= 0 {
        Phase::SoldOut
    } else {
        Phase::Active
    }
}

/// The status to write, with conditions whose `lastTransitionTime` moves only when
/// their status changes (Kubernetes API conventions).
pub fn status(
    drop: &InventoryDrop,
    observed: &Observed,
    previous: Option<&InventoryDropStatus>,
) -> InventoryDropStatus {
    let generation = drop.metadata.generation;
    let spec = &drop.spec;
    let ha = &observed.ha;
    let stock = &observed.stock;
    let is_ready = ready(drop, observed);
    let previous_conditions = previous.map(|s| s.conditions.as_slice()).unwrap_or(&[]);
    let cond = |type_: &str, status: &str, reason: &str, message: String| {
        condition(
            previous_conditions,
            observed.now,
            generation,
            type_,
            status,
            reason,
            message,
        )
    };

    let seeded_message = if stock.remaining < 0 {
        format!(
            "limit {} is below the {} units already held: the gate admits nothing until {} returned units pay back the deficit",
            spec.limit(),
            stock.held,
            -stock.remaining
        )
    } else if observed.seeded.created {
        format!("stock seeded with {} units", spec.limit())
    } else if observed.seeded.moved != 0 {
        format!(
            "restocked by {:+} to limit {}",
            observed.seeded.moved,
            spec.limit()
        )
    } else {
        format!("stock in place for limit {}", spec.limit())
    };
    let mut seeded_reason = if stock.remaining < 0 {
        "LimitBelowHeld"
    } else {
        "Seeded"
    };
    let mut seeded_message = seeded_message;
    if let Some(policy) = observed
        .eviction_policy
        .as_deref()
        .filter(|p| *p != "noeviction")
    {
        // An evicted stock or gate key loses the sale's count mid-sale.
        seeded_reason = EVICTION_POSSIBLE;
        seeded_message = format!(
            "{seeded_message}; Redis's maxmemory-policy is {policy}: under memory pressure it may evict this drop's keys, set it to noeviction"
        );
    }

    let ha_message = if !spec.redis.require_high_availability {
        format!("{} (not required)", ha.message)
    } else if observed.kept {
        format!(
            "{}: could not check, keeping mode {} for now",
            ha.message, observed.mode
        )
    } else {
        ha.message.clone()
    };
    let ha_status = match ha.verdict {
        Verdict::HighlyAvailable => "True",
        Verdict::NotHighlyAvailable => "False",
        Verdict::Unknown => UNKNOWN,
    };

    let (fail_open_reason, fail_open_message) = match observed.mode {
        Mode::Gate => ("GateEnabled", "the Redis gate admits".to_string()),
        Mode::FailOpen if !spec.gate.enabled => (
            "KillSwitch",
            "gate.enabled is false: sidecars sell through the SQL ledger's gate".to_string(),
        ),
        Mode::FailOpen => (
            "HighAvailabilityMissing",
            "high availability is required and missing; failurePolicy Open: sidecars sell through the SQL ledger's gate".to_string(),
        ),
        Mode::Closed => (
            "HighAvailabilityMissing",
            "high availability is required and missing; failurePolicy Closed: nothing is sold".to_string(),
        ),
    };

    let (ready_reason, ready_message) = if is_ready {
        (
            "Reconciled",
            format!(
                "mode {}, {} units remaining",
                observed.mode,
                stock.remaining.max(0)
            ),
        )
    } else {
        let reason = if ha.is_verified() {
            "HighAvailabilityMissing"
        } else {
            "HighAvailabilityUnknown"
        };
        (reason, ha.message.clone())
    };

    InventoryDropStatus {
        observed_generation: generation,
        phase: phase(drop, observed),
        mode: Some(observed.mode),
        limit: Some(drop.spec.limit()),
        remaining: Some(stock.remaining.max(0)),
        reserved: Some(stock.held.max(0)),
        variants: drop
            .spec
            .variants
            .iter()
            .map(|variant| {
                let (remaining, reserved) = stock.variant(&variant.name);
                VariantStatus {
                    name: variant.name.clone(),
                    limit: variant.quantity,
                    // No more than the drop as a whole may still admit.
                    remaining: remaining.min(stock.remaining).max(0),
                    reserved: reserved.max(0),
                }
            })
            .collect(),
        tier: Some(ha.tier),
        fail_open: observed.mode == Mode::FailOpen,
        // The first recorded claim stands: a Redis naming another ledger later lost
        // the key (the next seed writes this one back); never record a second.
        ledger: previous
            .and_then(|status| status.ledger.clone())
            .or_else(|| observed.ledger.clone()),
        conditions: vec![
            cond("Seeded", "True", seeded_reason, seeded_message),
            cond("HighlyAvailable", ha_status, ha.reason, ha_message),
            cond(
                "FailOpen",
                true_false(observed.mode == Mode::FailOpen),
                fail_open_reason,
                fail_open_message,
            ),
            cond("Ready", true_false(is_ready), ready_reason, ready_message),
        ],
    }
}

/// A condition that keeps the previous `lastTransitionTime` when its status did not
/// change.
fn condition(
    previous: &[Condition],
    now: Timestamp,
    generation: Option<i64>,
    type_: &str,
    status: &str,
    reason: &str,
    message: String,
) -> Condition {
    let status = status.to_string();
    let last_transition_time = previous
        .iter()
        .find(|c| c.type_ == type_ && c.status == status)
        .map(|c| c.last_transition_time.clone())
        .unwrap_or(Time(now));
    Condition {
        type_: type_.to_string(),
        status,
        reason: reason.to_string(),
        message,
        observed_generation: generation,
        last_transition_time,
    }
}

/// The status after a failed reconcile: what was known stays, phase Error, and the
/// Ready condition says why.
pub fn failed_status(drop: &InventoryDrop, error: &Error, now: Timestamp) -> InventoryDropStatus {
    let mut status = drop.status.clone().unwrap_or_default();
    status.phase = Phase::Error;
    status.observed_generation = drop.metadata.generation;
    let message = error.to_string();
    let keep_time = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready" && c.status == "False")
        .map(|c| c.last_transition_time.clone());
    status.conditions.retain(|c| c.type_ != "Ready");
    status.conditions.push(Condition {
        type_: "Ready".into(),
        status: "False".into(),
        reason: error.reason().into(),
        message,
        observed_generation: drop.metadata.generation,
        last_transition_time: keep_time.unwrap_or(Time(now)),
    });
    status
}

fn true_false(value: bool) -> &'static str {
    if value { "True" } else { "False" }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dropgate_api::{InventoryDropSpec, Tier};

    fn drop(yaml_spec: &str) -> InventoryDrop {
        let spec: InventoryDropSpec = serde_norway::from_str(yaml_spec).expect("spec parses");
        let mut drop = InventoryDrop::new("d", spec);
        drop.metadata.namespace = Some("shop".into());
        drop.metadata.generation = Some(2);
        drop
    }

    fn report(tier: Tier) -> HaReport {
        HaReport::verdict(
            tier,
            tier.is_highly_available(),
            "Test",
            format!("tier {tier:?}"),
        )
    }

    fn unknown() -> HaReport {
        HaReport::unknown("Test", "timed out".into())
    }

    fn observed(mode: Mode, tier: Tier, remaining: i64, held: i64) -> Observed {
        Observed {
            mode,
            ha: report(tier),
            kept: false,
            seeded: Seeded {
                created: false,
                moved: 0,
                previous_mode: Some(mode),
                remaining,
            },
            stock: Stock {
                remaining,
                held,
                ..Stock::default()
            },
            ledger: None,
            eviction_policy: Some("noeviction".into()),
            now: "2026-12-01T11:00:00Z".parse().expect("timestamp"),
        }
    }

    #[test]
    fn mode_follows_the_design_table() {
        let gate = |enabled, failure_policy| GateSpec {
            enabled,
            failure_policy,
        };
        use FailurePolicy::{Closed, Open};
        let (yes, no) = (report(Tier::Replicated), report(Tier::Standalone));
        let kept = Some(Mode::Gate);
        // (enabled, policy, require HA, HA report, kept mode) -> mode
        let table = [
            (true, Open, false, &no, None, Mode::Gate),
            (true, Open, true, &yes, None, Mode::Gate),
            (true, Open, true, &no, None, Mode::FailOpen),
            (true, Closed, true, &no, None, Mode::Closed),
            (true, Closed, false, &no, None, Mode::Gate),
            (false, Open, false, &yes, None, Mode::FailOpen),
            (false, Closed, true, &no, None, Mode::FailOpen),
            (false, Closed, true, &yes, None, Mode::FailOpen),
            // An unanswered check keeps the mode it is given, and only then.
            (true, Open, true, &unknown(), kept, Mode::Gate),
            (true, Open, true, &unknown(), None, Mode::FailOpen),
            (true, Closed, true, &unknown(), None, Mode::Closed),
            (true, Open, true, &no, kept, Mode::FailOpen),
            (false, Open, true, &unknown(), kept, Mode::FailOpen),
        ];
        for (enabled, policy, require, ha, kept, want) in table {
            assert_eq!(
                mode(&gate(enabled, policy), require, ha, kept),
                want,
                "enabled={enabled} policy={policy:?} require={require} ha={ha:?} kept={kept:?}"
            );
        }
    }

    #[test]
    fn an_unanswered_check_keeps_the_mode_for_the_grace_period_only() {
        let grace = std::time::Duration::from_secs(300);
        let at = |t: &str| -> Timestamp { t.parse().expect("ts") };
        let d = drop("{sku: X, limitedQuantity: 10, redis: {requireHighAvailability: true}}");
        let verified = status(&d, &observed(Mode::Gate, Tier::Replicated, 10, 0), None);
        let now = at("2026-12-01T11:00:00Z");
        // First failure: keeps the published mode; a verified answer keeps nothing.
        assert_eq!(
            kept_mode(Some(&verified), &unknown(), now, grace),
            Some(Mode::Gate)
        );
        assert_eq!(
            kept_mode(Some(&verified), &report(Tier::Standalone), now, grace),
            None
        );
        assert_eq!(kept_mode(None, &unknown(), now, grace), None);
        // Written with the check unanswered since 11:00 ...
        let mut obs = observed(Mode::Gate, Tier::Unknown, 10, 0);
        obs.ha = unknown();
        obs.kept = true;
        let unanswered = status(&d, &obs, Some(&verified));
        let ha = unanswered
            .conditions
            .iter()
            .find(|c| c.type_ == "HighlyAvailable")
            .expect("condition");
        assert_eq!(ha.status, "Unknown");
        assert!(ha.message.contains("keeping mode gate"), "{}", ha.message);
        assert_eq!(unanswered.phase, Phase::Active, "still selling");
        // ... the mode is kept until 11:05, then the failure policy decides.
        let later = at("2026-12-01T11:04:59Z");
        assert_eq!(
            kept_mode(Some(&unanswered), &unknown(), later, grace),
            Some(Mode::Gate)
        );
        let past = at("2026-12-01T11:05:00Z");
        assert_eq!(kept_mode(Some(&unanswered), &unknown(), past, grace), None);
    }

    #[test]
    fn config_carries_the_window_and_keys_outlive_it() {
        let d = drop(
            "{sku: X, limitedQuantity: 100, holdSeconds: 60, startsAt: '2026-12-01T10:00:00Z', endsAt: '2026-12-01T12:00:00Z', redis: {}}",
        );
        let cfg = config(&d, Mode::Gate);
        let start: Timestamp = "2026-12-01T10:00:00Z".parse().expect("ts");
        let end: Timestamp = "2026-12-01T12:00:00Z".parse().expect("ts");
        assert_eq!(cfg.starts_at_ms, Some(start.as_millisecond()));
        assert_eq!(cfg.ends_at_ms, Some(end.as_millisecond()));
        assert!(cfg.expire_at_ms.expect("expiry set") > end.as_millisecond() + 60_000);
        assert_eq!(cfg.generation, 2);
        assert_eq!(
            config(&drop("{sku: X, limitedQuantity: 1, redis: {}}"), Mode::Gate).expire_at_ms,
            None
        );
    }

    #[test]
    fn phase_table() {
        let plain = drop("{sku: X, limitedQuantity: 10, redis: {}}");
        let ha_closed = drop(
            "{sku: X, limitedQuantity: 10, redis: {requireHighAvailability: true}, gate: {failurePolicy: Closed}}",
        );
        let later =
            drop("{sku: X, limitedQuantity: 10, startsAt: '2026-12-02T00:00:00Z', redis: {}}");
        let over = drop("{sku: X, limitedQuantity: 10, endsAt: '2026-12-01T10:00:00Z', redis: {}}");
        let paused = drop("{sku: X, limitedQuantity: 10, paused: true, redis: {}}");
        let cases = [
            (
                &paused,
                observed(Mode::Gate, Tier::Standalone, 5, 5),
                Phase::Paused,
            ),
            // Paused says more than sold out: holds may still come back.
            (
                &paused,
                observed(Mode::Gate, Tier::Standalone, 0, 10),
                Phase::Paused,
            ),
            (
                &plain,
                observed(Mode::Gate, Tier::Standalone, 5, 5),
                Phase::Active,
            ),
            (
                &plain,
                observed(Mode::Gate, Tier::Standalone, 0, 10),
                Phase::SoldOut,
            ),
            (
                &plain,
                observed(Mode::Gate, Tier::Standalone, -3, 13),
                Phase::SoldOut,
            ),
            (
                &plain,
                observed(Mode::FailOpen, Tier::Standalone, 5, 5),
                Phase::FailOpen,
            ),
            (
                &ha_closed,
                observed(Mode::Closed, Tier::Standalone, 10, 0),
                Phase::Error,
            ),
            (
                &later,
                observed(Mode::Gate, Tier::Standalone, 10, 0),
                Phase::Pending,
            ),
            (
                &over,
                observed(Mode::Gate, Tier::Standalone, 10, 0),
                Phase::Ended,
            ),
        ];
        for (d, obs, want) in cases {
            assert_eq!(phase(d, &obs), want, "{:?}", d.spec);
        }
    }

    #[test]
    fn status_reports_clamped_stock_and_every_condition() {
        let d = drop("{sku: X, limitedQuantity: 10, redis: {requireHighAvailability: true}}");
        let obs = observed(Mode::FailOpen, Tier::Standalone, -2, 12);
        let s = status(&d, &obs, None);
        assert_eq!(s.remaining, Some(0));
        assert_eq!(s.reserved, Some(12));
        assert!(s.fail_open);
        assert_eq!(s.observed_generation, Some(2));
        let get = |t: &str| s.conditions.iter().find(|c| c.type_ == t).expect(t).clone();
        assert_eq!(get("Seeded").reason, "LimitBelowHeld");
        assert!(get("Seeded").message.contains("2 returned units"));
        assert_eq!(get("HighlyAvailable").status, "False");
        assert_eq!(get("FailOpen").status, "True");
        assert_eq!(get("FailOpen").reason, "HighAvailabilityMissing");
        assert_eq!(get("Ready").status, "False");
        assert_eq!(get("Ready").reason, "HighAvailabilityMissing");

        let mut evicting = obs.clone();
        evicting.eviction_policy = Some("allkeys-lru".into());
        let s = status(&d, &evicting, None);
        let seeded = s
            .conditions
            .iter()
            .find(|c| c.type_ == "Seeded")
            .expect("Seeded");
        assert_eq!(
            (seeded.status.as_str(), seeded.reason.as_str()),
            ("True", EVICTION_POSSIBLE)
        );
        assert!(seeded.message.contains("allkeys-lru"), "{}", seeded.message);
    }

    #[test]
    fn transition_time_moves_only_when_the_status_changes() {
        let d = drop("{sku: X, limitedQuantity: 10, redis: {}}");
        let first = status(&d, &observed(Mode::Gate, Tier::Standalone, 10, 0), None);
        let mut later_obs = observed(Mode::FailOpen, Tier::Standalone, 9, 1);
        later_obs.now = "2026-12-01T11:30:00Z".parse().expect("ts");
        let second = status(&d, &later_obs, Some(&first));
        let time = |s: &InventoryDropStatus, t: &str| {
            s.conditions
                .iter()
                .find(|c| c.type_ == t)
                .map(|c| c.last_transition_time.clone())
        };
        assert_eq!(time(&first, "Ready"), time(&second, "Ready"));
        assert_ne!(time(&first, "FailOpen"), time(&second, "FailOpen"));
    }
}
