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
        Self {
            registry,
            reconciliations,
            errors,
            duration,
            status_patches,
            leader,
        }
    }
}

impl Metrics {
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)?;
        Ok(text)
    }
}
