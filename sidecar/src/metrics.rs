//! Prometheus metrics served at `/metrics`.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// An answer's labels. `drop` is empty for routes without one and for names this
/// sidecar does not serve (an unknown name must not mint a series); `path` says
/// which gate answered.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Answered {
    pub route: &'static str,
    pub outcome: String,
    pub drop: String,
    pub path: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Route {
    pub route: &'static str,
    pub drop: String,
}

/// A drop's mode: 1 on the mode it is in, 0 on the others.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DropMode {
    pub drop: String,
    pub mode: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DropLabel {
    pub drop: String,
}

#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Allocations (count, bytes) the process has made, read at each scrape: only
    /// in a build with the `allocation-count` feature.
    #[cfg(feature = "allocation-count")]
    allocations: [Gauge<i64, std::sync::atomic::AtomicI64>; 2],
    /// Answers by route and outcome: admitted vs sold_out vs throttled is the sale.
    pub answers: Family<Answered, Counter>,
    /// Time to answer, by route: the sidecar promises about a millisecond.
    pub latency: Family<Route, Histogram>,
    /// Throttle permits held for unconfirmed reservations, by drop.
    pub permits_in_use: Family<DropLabel, Gauge<i64, std::sync::atomic::AtomicI64>>,
    /// Holds expired (by the sweeper, or by a request that found one past its
    /// deadline).
    pub expired: Counter<u64, AtomicU64>,
    /// Holds offered to the head of a waitlist line (units that came back).
    pub offered: Counter<u64, AtomicU64>,
    /// Admissions answered 201 before the replicas `--wait-replicas` asks for
    /// acknowledged them (durable in the ledger all the same).
    pub replica_wait_timeouts: Counter<u64, AtomicU64>,
    /// 1 while a drop's sale is recorded by another ledger than this sidecar's (per-pod
    /// ledgers on several replicas, a ledger added mid-sale): this sidecar then
    /// changes nothing of the drop and answers `unavailable`.
    pub foreign_ledger: Family<DropLabel, Gauge<i64, std::sync::atomic::AtomicI64>>,
    /// What each drop has left, as the gate deciding it counts (read by the refresh).
    pub remaining: Family<DropLabel, Gauge<i64, std::sync::atomic::AtomicI64>>,
    /// Admissions and extensions Redis decided on a config of the drop it had lost
    /// (this sidecar or a peer sharing its ledger read a newer one): taken back and
    /// answered `unavailable` until the operator publishes the change again.
    pub decided_on_lost_config: Family<DropLabel, Counter>,
    /// Each drop's mode as this sidecar last read it.
    pub mode: Family<DropMode, Gauge<i64, std::sync::atomic::AtomicI64>>,
    /// Age of the oldest event the outbox has not published yet (0 when none).
    pub outbox_lag: Gauge<f64, AtomicU64>,
    /// 1 while the last config refresh reached Redis, 0 after one that did not.
    pub redis_up: Gauge<i64, std::sync::atomic::AtomicI64>,
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("dropgate_sidecar");
        let answers = Family::<Answered, Counter>::default();
        let latency = Family::<Route, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.000_1, 2.0, 16))
        });
        let permits_in_use = Family::default();
        let expired = Counter::default();
        let replica_wait_timeouts = Counter::default();
        let foreign_ledger = Family::default();
        let remaining = Family::default();
        let mode = Family::default();
        let outbox_lag = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "answers",
            "Answers by route, outcome, drop and path",
            answers.clone(),
        );
        registry.register(
            "remaining",
            "Units a drop has left, as the gate deciding it counts",
            remaining.clone(),
        );
        registry.register(
            "drop_mode",
            "1 on the mode a drop is in (gate, fail-open, closed)",
            mode.clone(),
        );
        registry.register(
            "outbox_lag_seconds",
            "Age of the oldest unpublished outbox event",
            outbox_lag.clone(),
        );
        registry.register(
            "request_duration_seconds",
            "Time to answer, by route",
            latency.clone(),
        );
        registry.register(
            "throttle_permits_in_use",
            "Permits held for unconfirmed reservations",
            permits_in_use.clone(),
        );
        registry.register(
            "expired_holds",
            "Holds expired past their deadline",
            expired.clone(),
        );
        let offered = Counter::default();
        registry.register(
            "waitlist_offers",
            "Holds offered to the head of a waitlist line when units came back",
            offered.clone(),
        );
        registry.register(
            "replica_wait_timeouts",
            "Admissions answered before the replicas asked for acknowledged them",
            replica_wait_timeouts.clone(),
        );
        let redis_up = Gauge::default();
        registry.register(
            "redis_up",
            "1 while the sidecar's last config refresh reached Redis, 0 after one that did not",
            redis_up.clone(),
        );
        registry.register(
            "foreign_ledger",
            "1 while a drop's sale is recorded by another ledger than this sidecar's: it answers unavailable",
            foreign_ledger.clone(),
        );
        let decided_on_lost_config = Family::<DropLabel, Counter>::default();
        registry.register(
            "decided_on_lost_config",
            "Admissions and extensions Redis decided on a config it had lost (a newer one was read): taken back, answered unavailable",
            decided_on_lost_config.clone(),
        );
        #[cfg(feature = "allocation-count")]
        let allocations = {
            let gauges: [Gauge<i64, std::sync::atomic::AtomicI64>; 2] = Default::default();
            registry.register(
                "allocations",
                "Allocations the process made since it started (allocation-count builds only)",
                gauges[0].clone(),
            );
            registry.register(
                "allocated_bytes",
                "Bytes the process allocated since it started (allocation-count builds only)",
                gauges[1].clone(),
            );
            gauges
        };
        Self {
            registry,
            #[cfg(feature = "allocation-count")]
            allocations,
            answers,
            decided_on_lost_config,
            latency,
            permits_in_use,
            expired,
            offered,
            replica_wait_timeouts,
            foreign_ledger,
            remaining,
            mode,
            outbox_lag,
            redis_up,
        }
    }

    /// Registers the gauge of the API server watch (`--watch-drops`): 1 while it is
    /// caught up, 0 while it is not (then no fallback admission is decided).
    pub fn register_drop_watch(&mut self, caught_up: Gauge<i64, std::sync::atomic::AtomicI64>) {
        self.registry.register(
            "drop_watch_caught_up",
            "1 while the sidecar's watch of its namespace's InventoryDrops is caught up, 0 while it is not: its fallback then decides no admission",
            caught_up,
        );
    }

    /// Registers the ledger's group-commit durations.
    pub fn register_ledger(&mut self, commit_seconds: Histogram) {
        self.registry.register(
            "ledger_commit_seconds",
            "Time one group commit of the ledger took",
            commit_seconds,
        );
    }

    /// Notes a drop's mode.
    pub fn set_mode(&self, drop: &str, current: dropgate_api::Mode) {
        for mode in [
            dropgate_api::Mode::Gate,
            dropgate_api::Mode::FailOpen,
            dropgate_api::Mode::Closed,
        ] {
            self.mode
                .get_or_create(&DropMode {
                    drop: drop.to_string(),
                    mode: mode.as_str(),
                })
                .set(i64::from(mode == current));
        }
    }

    pub fn observe(
        &self,
        route: &'static str,
        drop: &str,
        outcome: &str,
        path: &'static str,
        seconds: f64,
    ) {
        self.answers
            .get_or_create(&Answered {
                route,
                outcome: outcome.to_string(),
                drop: drop.to_string(),
                path,
            })
            .inc();
        self.latency
            .get_or_create(&Route {
                route,
                drop: drop.to_string(),
            })
            .observe(seconds);
    }

    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        #[cfg(feature = "allocation-count")]
        {
            let stats = stats_alloc::INSTRUMENTED_SYSTEM.stats();
            let total = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
            self.allocations[0].set(total(stats.allocations + stats.reallocations));
            self.allocations[1].set(
                total(stats.bytes_allocated)
                    .saturating_add(i64::try_from(stats.bytes_reallocated.max(0)).unwrap_or(0)),
            );
        }
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)?;
        Ok(text)
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
