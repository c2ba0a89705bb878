//! What every request shares: the drops, Redis and its breaker, the ledger, the
//! metrics. State only: the service decides, the routes answer.

use std::time::Duration;

use dropgate_redis::Connection;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use crate::Error;
use crate::breaker::Breaker;
use crate::drop_watch::DropWatch;
use crate::drops::Drops;
use crate::ledger::Ledger;
use crate::metrics::Metrics;
use crate::replicas::Replicas;
use crate::settings::Settings;

#[derive(Debug)]
pub struct App {
    pub drops: Drops,
    /// The drops as the API server holds them (`--watch-drops`): what a fallback
    /// admission's config is checked against while Redis cannot be asked.
    pub drop_watch: Option<DropWatch>,
    /// One multiplexed connection for every request. It reconnects by itself, so a
    /// Redis restart needs no sidecar restart; while Redis is down, commands fail
    /// within the timeouts below instead of queueing.
    pub redis: Connection,
    pub ledger: Ledger,
    pub metrics: Metrics,
    /// Replica acknowledgements an admission waits for (`--wait-replicas`).
    pub replicas: Replicas,
    /// Whether the one Redis is reachable. On a cluster each drop has its own (its
    /// shard's), so that one shard's failover pauses no drop on another.
    breaker: Breaker,
    /// This process, in the ledger's record of which sidecars reach Redis.
    pub sidecar_id: String,
    /// How long no sidecar sharing the ledger may have reached Redis before a Redis
    /// outage hands a drop to the fallback gate (ms): a few refreshes, so that one
    /// sidecar's partition is told from everyone's outage.
    pub quiet_ms: i64,
    /// Whether a fallback admission may decide on the config last read while Redis
    /// cannot be asked and no watch of the API server can check it
    /// (`--fallback-on-last-read-config`).
    pub fallback_on_last_read: bool,
    /// `--trace-buyer-ids`: name the buyer on request spans.
    pub trace_buyer_ids: bool,
    /// `--max-lock-names`: lock names one namespace may have in use at once.
    pub max_lock_names: u32,
    /// `--ledger-retention` (ms): how long a sale that is over, and an event every
    /// consumer group acknowledged, are kept.
    pub retention_ms: i64,
    /// Rung when this sidecar returned units (a cancel, an expiry, an undone
    /// admission): the waitlists' heads are offered them at once rather than at the
    /// next sweep.
    pub units_back: tokio::sync::Notify,
}

impl App {
    pub async fn new(settings: &Settings) -> Result<Self, Error> {
        let client = redis::Client::open(settings.redis_url.as_str())?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_millis(500)))
            .set_response_timeout(Some(Duration::from_secs(2)))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(200));
        let redis = if settings.redis_cluster {
            // Lazy too: the cluster's map of slots is read on the first call, so a
            // native sidecar never holds its pod's start on a cluster outage.
            Connection::cluster_lazy(
                &settings.redis_url,
                Duration::from_millis(500),
                Duration::from_secs(2),
            )?
        } else {
            // Lazy: the sidecar starts (and answers `unavailable`) while Redis is down.
            ConnectionManager::new_lazy_with_config(client, config)?.into()
        };
        let ledger = Ledger::open(&settings.database_url).await?;
        let drop_watch = if settings.watch_drops {
            Some(DropWatch::start(&settings.namespace).await.map_err(|e| {
                Error::Settings(format!(
                    "--watch-drops: no client for the Kubernetes API server ({e}); the sidecar checks its fallback's config there (the pod needs its service account token, which the webhook mounts)"
                ))
            })?)
        } else {
            if settings.fallback_on_last_read_config {
                tracing::warn!(
                    "--fallback-on-last-read-config without --watch-drops: while Redis cannot be asked, the fallback decides on the config last read, so a limit cut, an endsAt moved or a pause published meanwhile is not obeyed by it until it reads Redis again (or a sidecar sharing its PostgreSQL ledger does)"
                );
            } else {
                tracing::info!(
                    "no --watch-drops and no --fallback-on-last-read-config: while Redis cannot be asked, the fallback admits nothing (confirms and cancels go on)"
                );
            }
            None
        };
        let mut metrics = Metrics::new();
        metrics.register_ledger(ledger.commit_seconds());
        if let Some(watch) = &drop_watch {
            metrics.register_drop_watch(watch.caught_up_gauge());
        }
        Ok(Self {
            drops: Drops::new(&settings.namespace),
            drop_watch,
            redis,
            ledger,
            metrics,
            replicas: Replicas::new(settings.wait_replicas, settings.wait_timeout_ms),
            breaker: Breaker::default(),
            sidecar_id: format!("{:016x}", rand::random::<u64>()),
            fallback_on_last_read: settings.fallback_on_last_read_config,
            quiet_ms: i64::try_from(settings.refresh_ms.saturating_mul(4))
                .unwrap_or(i64::MAX)
                .max(1000),
            trace_buyer_ids: settings.trace_buyer_ids,
            max_lock_names: settings.max_lock_names,
            retention_ms: i64::try_from(settings.ledger_retention.as_millis()).unwrap_or(i64::MAX),
            units_back: tokio::sync::Notify::new(),
        })
    }

    /// What a drop's check against the ledger holds for: Redis as it was after this
    /// many failures (and cluster changes); a drop checked at an older count is
    /// checked again before Redis answers for it (see `service::check_redis`).
    pub fn redis_era(&self, drop: &crate::drops::Drop) -> u64 {
        self.breaker(Some(drop))
            .failures()
            .wrapping_add(self.redis.changes_for(&drop.keys.gate()))
    }

    /// The breaker of the Redis that `drop` lives on; `None`: the sidecar's own
    /// calls (on a cluster they reach some node, which says nothing of a shard).
    pub fn breaker<'a>(&'a self, drop: Option<&'a crate::drops::Drop>) -> &'a Breaker {
        match drop {
            Some(drop) if self.redis.is_cluster() => &drop.breaker,
            _ => &self.breaker,
        }
    }
}
