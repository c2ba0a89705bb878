//! The operator's Prometheus metrics.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabel {
    pub error: &'static str,
}

/// A drop's HighlyAvailable condition. `drop_namespace`, not `namespace`: a scrape
/// labels the operator's own series with the operator pod's namespace.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HaLabel {
    pub drop_namespace: String,
    pub drop: String,
    pub status: &'static str,
}

#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub reconciliations: Counter,
    /// By [`crate::Error::metric_label`].
    pub errors: Family<ErrorLabel, Counter>,
    pub duration: Histogram,
    /// Status patches sent (a steady drop costs one per resync).
    pub status_patches: Counter,
    /// 1 while this replica holds the leader lease.
    pub leader: Gauge,
    /// 1 on the status of each drop's HighlyAvailable condition as this replica
    /// last wrote it (True, False, Unknown), 0 on the others.
    pub high_availability: Family<HaLabel, Gauge>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("dropgate_operator");
        let reconciliations = Counter::default();
        let errors = Family::<ErrorLabel, Counter>::default();
        let duration = Histogram::new(exponential_buckets(0.001, 2.0, 14));
        let leader = Gauge::default();
        let status_patches = Counter::default();
        registry.register(
            "reconciliations",
            "Reconciles started",
            reconciliations.clone(),
        );
        registry.register(
            "reconcile_errors",
            "Failed reconciles by kind",
            errors.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "Time one reconcile took",
            duration.clone(),
        );
        registry.register(
            "status_patches",
            "Status patches sent",
            status_patches.clone(),
        );
        registry.register(
            "leader",
            "1 while this replica is the leader",
            leader.clone(),
        );
        let high_availability = Family::<HaLabel, Gauge>::default();
        registry.register(
            "drop_high_availability",
            "1 on the status (True, False, Unknown) of a drop's HighlyAvailable condition as this replica last wrote it",
            high_availability.clone(),
        );
        Self {
            registry,
            high_availability,
            reconciliations,
            errors,
            duration,
            status_patches,
            leader,
        }
    }
}

impl Metrics {
    /// Notes the HighlyAvailable condition's `status` of drop `namespace/drop`
    /// (None: the drop is gone, its series too).
    pub fn set_high_availability(&self, namespace: &str, drop: &str, status: Option<&str>) {
        for word in ["True", "False", "Unknown"] {
            let label = HaLabel {
                drop_namespace: namespace.to_string(),
                drop: drop.to_string(),
                status: word,
            };
            match status {
                Some(status) => {
                    self.high_availability
                        .get_or_create(&label)
                        .set(i64::from(status == word));
                }
                None => {
                    self.high_availability.remove(&label);
                }
            }
        }
    }

    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)?;
        Ok(text)
    }
}
