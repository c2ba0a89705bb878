//! The `spec:` of an InventoryDrop as tests write it, without hand-indented YAML.

use std::fmt;

/// An InventoryDrop's spec, minus `redis:` (the manifest wrappers add that line):
/// `DropSpec::new(10).per_user_limit(5).yaml()` is
/// `"  sku: X\n  limitedQuantity: 10\n  perUserLimit: 5\n"`.
///
/// Fields left unset are left out of the YAML, so the CRD's defaults apply to them,
/// exactly as when a test's hand-written spec did not mention them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DropSpec {
    sku: String,
    limited_quantity: i64,
    per_user_limit: Option<i64>,
    hold_seconds: Option<i64>,
    max_hold_seconds: Option<i64>,
    paused: bool,
    /// `waitlist: {enabled: true, maxLength: N}` (the length `None`: the default).
    waitlist: Option<Option<i64>>,
    starts_at: Option<String>,
    ends_at: Option<String>,
    kill_switch: bool,
    fail_closed: bool,
    permits: Option<i64>,
    acquire_timeout_ms: Option<i64>,
    variants: Vec<(String, i64)>,
}

impl DropSpec {
    /// `limit` units of SKU `X`.
    pub fn new(limit: i64) -> Self {
        Self {
            sku: "X".into(),
            limited_quantity: limit,
            per_user_limit: None,
            hold_seconds: None,
            max_hold_seconds: None,
            paused: false,
            waitlist: None,
            starts_at: None,
            ends_at: None,
            kill_switch: false,
            fail_closed: false,
            permits: None,
            acquire_timeout_ms: None,
            variants: Vec::new(),
        }
    }

    /// `variants:` with these names and quantities; `limitedQuantity` is then their
    /// sum (as the API server requires when both are given).
    pub fn variants(mut self, variants: &[(&str, i64)]) -> Self {
        self.variants = variants
            .iter()
            .map(|(name, quantity)| (name.to_string(), *quantity))
            .collect();
        self.limited_quantity = self.variants.iter().map(|(_, q)| q).sum();
        self
    }

    /// `sku:`, written as a plain YAML scalar (a word such as `SNKR-0412`).
    pub fn sku(mut self, sku: &str) -> Self {
        self.sku = sku.into();
        self
    }

    /// `perUserLimit:`.
    pub fn per_user_limit(mut self, units: i64) -> Self {
        self.per_user_limit = Some(units);
        self
    }

    /// `holdSeconds:`.
    pub fn hold_seconds(mut self, seconds: i64) -> Self {
        self.hold_seconds = Some(seconds);
        self
    }

    /// `maxHoldSeconds:`: how far an extension may move a hold.
    pub fn max_hold_seconds(mut self, seconds: i64) -> Self {
        self.max_hold_seconds = Some(seconds);
        self
    }

    /// `waitlist: {enabled: true}`: buyers turned away may wait in line.
    pub fn waitlist(mut self) -> Self {
        self.waitlist = Some(None);
        self
    }

    /// A waitlist of at most `length` entries per line.
    pub fn waitlist_of(mut self, length: i64) -> Self {
        self.waitlist = Some(Some(length));
        self
    }

    /// `paused: true`: no new reservations.
    pub fn paused(mut self) -> Self {
        self.paused = true;
        self
    }

    /// `startsAt:`, an RFC 3339 time (`2099-01-01T00:00:00Z`, a `jiff::Timestamp`).
    pub fn starts_at(mut self, at: impl fmt::Display) -> Self {
        self.starts_at = Some(at.to_string());
        self
    }

    /// `endsAt:`, an RFC 3339 time.
    pub fn ends_at(mut self, at: impl fmt::Display) -> Self {
        self.ends_at = Some(at.to_string());
        self
    }

    /// `gate: {enabled: false}`: the kill switch, every sale goes through the
    /// ledger's fallback gate.
    pub fn kill_switch(mut self) -> Self {
        self.kill_switch = true;
        self
    }

    /// `gate: {failurePolicy: Closed}`: refuse sales while Redis is down instead of
    /// failing open to the ledger.
    pub fn fail_closed(mut self) -> Self {
        self.fail_closed = true;
        self
    }

    /// `throttle: {permits: N}`: reservations in flight at once per sidecar.
    pub fn permits(mut self, permits: i64) -> Self {
        self.permits = Some(permits);
        self
    }

    /// `throttle: {acquireTimeoutMs: N}`: how long a reserve waits for a permit.
    pub fn acquire_timeout_ms(mut self, ms: i64) -> Self {
        self.acquire_timeout_ms = Some(ms);
        self
    }

    /// The spec's lines, each indented two spaces and ending in `\n`: what goes
    /// under `spec:` (after `redis:`) in `common::manifest` and `sale_manifest`.
    pub fn yaml(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for DropSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "  sku: {}", self.sku)?;
        writeln!(f, "  limitedQuantity: {}", self.limited_quantity)?;
        if !self.variants.is_empty() {
            writeln!(f, "  variants:")?;
            for (name, quantity) in &self.variants {
                writeln!(f, "  - {{name: {name}, quantity: {quantity}}}")?;
            }
        }
        if let Some(units) = self.per_user_limit {
            writeln!(f, "  perUserLimit: {units}")?;
        }
        if let Some(seconds) = self.hold_seconds {
            writeln!(f, "  holdSeconds: {seconds}")?;
        }
        if let Some(seconds) = self.max_hold_seconds {
            writeln!(f, "  maxHoldSeconds: {seconds}")?;
        }
        if self.paused {
            writeln!(f, "  paused: true")?;
        }
        match self.waitlist {
            Some(Some(length)) => {
                writeln!(f, "  waitlist: {{enabled: true, maxLength: {length}}}")?
            }
            Some(None) => writeln!(f, "  waitlist: {{enabled: true}}")?,
            None => {}
        }
        if let Some(at) = &self.starts_at {
            writeln!(f, "  startsAt: {at}")?;
        }
        if let Some(at) = &self.ends_at {
            writeln!(f, "  endsAt: {at}")?;
        }
        // `gate:` and `throttle:` are flow mappings of the fields set, so that a spec
        // with both gate settings still has one `gate:` key (YAML forbids two).
        let gate = flow(&[
            ("enabled", self.kill_switch.then(|| "false".into())),
            ("failurePolicy", self.fail_closed.then(|| "Closed".into())),
        ]);
        if let Some(gate) = gate {
            writeln!(f, "  gate: {gate}")?;
        }
        let throttle = flow(&[
            ("permits", self.permits.map(|n| n.to_string())),
            (
                "acquireTimeoutMs",
                self.acquire_timeout_ms.map(|ms| ms.to_string()),
            ),
        ]);
        if let Some(throttle) = throttle {
            writeln!(f, "  throttle: {throttle}")?;
        }
        Ok(())
    }
}

/// `{a: 1, b: 2}` of the fields that have a value, `None` when none has.
fn flow(fields: &[(&str, Option<String>)]) -> Option<String> {
    let set: Vec<String> = fields
        .iter()
        .filter_map(|(name, value)| value.as_ref().map(|value| format!("{name}: {value}")))
        .collect();
    (!set.is_empty()).then(|| format!("{{{}}}", set.join(", ")))
}

#[cfg(test)]
mod tests {
    use super::DropSpec;

    #[test]
    fn renders_the_lines_tests_wrote_by_hand() {
        assert_eq!(
            DropSpec::new(10).per_user_limit(5).yaml(),
            "  sku: X\n  limitedQuantity: 10\n  perUserLimit: 5\n"
        );
        assert_eq!(
            DropSpec::new(10)
                .hold_seconds(60)
                .permits(1)
                .acquire_timeout_ms(20)
                .yaml(),
            "  sku: X\n  limitedQuantity: 10\n  holdSeconds: 60\n  throttle: {permits: 1, acquireTimeoutMs: 20}\n"
        );
        assert_eq!(
            DropSpec::new(5)
                .sku("SNKR-0412")
                .starts_at("2099-01-01T00:00:00Z")
                .ends_at("2099-01-02T00:00:00Z")
                .yaml(),
            "  sku: SNKR-0412\n  limitedQuantity: 5\n  startsAt: 2099-01-01T00:00:00Z\n  endsAt: 2099-01-02T00:00:00Z\n"
        );
    }

    #[test]
    fn both_gate_settings_share_one_gate_key() {
        assert_eq!(
            DropSpec::new(1).kill_switch().permits(1000).yaml(),
            "  sku: X\n  limitedQuantity: 1\n  gate: {enabled: false}\n  throttle: {permits: 1000}\n"
        );
        assert_eq!(
            DropSpec::new(1).fail_closed().yaml(),
            "  sku: X\n  limitedQuantity: 1\n  gate: {failurePolicy: Closed}\n"
        );
        assert_eq!(
            DropSpec::new(1).kill_switch().fail_closed().yaml(),
            "  sku: X\n  limitedQuantity: 1\n  gate: {enabled: false, failurePolicy: Closed}\n"
        );
    }
}
