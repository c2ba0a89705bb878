//! The sidecar's command line; every flag also reads a `DROPGATE_*` variable.

use std::net::SocketAddr;

use clap::Parser;

/// The dropgate sidecar: reserve / confirm / cancel on localhost, gated by Redis.
#[derive(Parser, Debug, Clone)]
#[command(name = "dropgate-sidecar", version, about)]
pub struct Settings {
    /// How log lines (on stderr) are written: text, or json (one object per line).
    #[arg(long, env = "DROPGATE_LOG_FORMAT", default_value = "text")]
    pub log_format: dropgate_telemetry::LogFormat,
    /// Where to serve the HTTP API. Loopback by default: the API has no
    /// authentication, and only the shop's own containers should reach it.
    #[arg(long, env = "DROPGATE_LISTEN", default_value = "127.0.0.1:7070")]
    pub listen: SocketAddr,
    /// Allow --listen on an address other than loopback. The API has no
    /// authentication: whoever reaches it can reserve, confirm and cancel for any
    /// buyer, so exposing it needs this explicit opt-in (and a NetworkPolicy).
    #[arg(long, env = "DROPGATE_LISTEN_ANY")]
    pub listen_any: bool,
    /// A second listener serving only /healthz, /readyz and /metrics, for probes and
    /// scrapes from outside the pod (the API stays on loopback), e.g. 0.0.0.0:7071.
    #[arg(long, env = "DROPGATE_HEALTH_LISTEN")]
    pub health_listen: Option<SocketAddr>,
    /// The Redis holding the drops (redis:// or rediss://, credentials in the URL).
    #[arg(long, env = "DROPGATE_REDIS_URL")]
    pub redis_url: String,
    /// `--redis-url` names a node (or the discovery endpoint) of a Redis Cluster.
    #[arg(long, env = "DROPGATE_REDIS_CLUSTER", default_value_t = false)]
    pub redis_cluster: bool,
    /// The Kubernetes namespace whose drops this sidecar serves.
    #[arg(long, env = "DROPGATE_NAMESPACE", default_value = "default")]
    pub namespace: String,
    /// The SQL ledger. SQLite is per pod (so is its fallback path): use PostgreSQL
    /// for more than one replica.
    #[arg(
        long,
        env = "DROPGATE_DATABASE_URL",
        default_value = "sqlite://dropgate-ledger.db"
    )]
    pub database_url: String,
    /// Lock names one namespace may have in use at once (each leaves keys in Redis
    /// for a day past its last lease, and Redis evicts nothing): past it, a lock of
    /// a new name answers 429 `too_many_locks` until older names lapse.
    #[arg(long, env = "DROPGATE_MAX_LOCK_NAMES", default_value_t = 10_000,
        value_parser = clap::value_parser!(u32).range(1..))]
    pub max_lock_names: u32,
    /// How long the ledger keeps a sale that is over (its InventoryDrop deleted, or
    /// replaced by a new sale) before it forgets its rows, and how old an event must
    /// be before the drop's stream drops it once every consumer group has
    /// acknowledged it: a number and s, m, h or d (30d, 12h); at least 1h.
    #[arg(long, env = "DROPGATE_LEDGER_RETENTION", default_value = "30d",
        value_parser = dropgate_api::config::parse_retention)]
    pub ledger_retention: std::time::Duration,
    /// Watch the namespace's InventoryDrops in the API server (as the pod's service
    /// account, or `KUBECONFIG`), and decide no fallback admission on a config older
    /// than the drop there: a change the operator published into Redis while this
    /// sidecar could not reach Redis is obeyed anyway. The webhook sets it. Without
    /// it, an admission on the fallback while Redis cannot be asked is refused (503),
    /// unless `--fallback-on-last-read-config`. A sidecar that cannot build a client
    /// for the API server does not start.
    #[arg(long, env = "DROPGATE_WATCH_DROPS", default_value_t = false)]
    pub watch_drops: bool,
    /// Without `--watch-drops` (outside Kubernetes), let an admission on the
    /// fallback decide on the config this sidecar last read while Redis cannot be
    /// asked. It gives up a promise: a limit cut, an endsAt moved or a pause that
    /// the operator publishes while this sidecar cannot reach Redis is not obeyed
    /// by its fallback until it reads Redis again (or a sidecar sharing its
    /// PostgreSQL ledger does, and notes it there). Only for sales whose config does
    /// not change during an outage (and the project's tests, which have no API
    /// server). Ignored with `--watch-drops`.
    #[arg(
        long,
        env = "DROPGATE_FALLBACK_ON_LAST_READ_CONFIG",
        default_value_t = false
    )]
    pub fallback_on_last_read_config: bool,
    /// How often known drops' configs are re-read from Redis.
    #[arg(long, env = "DROPGATE_REFRESH_MS", default_value_t = 500)]
    pub refresh_ms: u64,
    /// How often due holds are expired.
    #[arg(long, env = "DROPGATE_SWEEP_MS", default_value_t = 250)]
    pub sweep_ms: u64,
    /// Redis replicas that must acknowledge an admission (Redis WAIT) before it is
    /// answered 201. 0 does not wait: the ledger makes every 201 durable anyway, and
    /// a failover that loses writes is rebuilt from it; waiting narrows that window
    /// at the cost of a replication round trip.
    #[arg(long, env = "DROPGATE_WAIT_REPLICAS", default_value_t = 0)]
    pub wait_replicas: u32,
    /// How long an admission waits for those acknowledgements (ms); past it the
    /// 201 is sent anyway (the admission is durable in the ledger) and counted.
    #[arg(long, env = "DROPGATE_WAIT_TIMEOUT_MS", default_value_t = 100)]
    pub wait_timeout_ms: u64,
    /// Put the buyer's user id and idempotency key on the request's trace span
    /// (`dropgate.user`, `dropgate.key`). Off by default: traces often leave the
    /// shop's hands, buyer identifiers should not without a decision.
    #[arg(long, env = "DROPGATE_TRACE_BUYER_IDS", default_value_t = false)]
    pub trace_buyer_ids: bool,
}

impl Settings {
    /// Checks what clap's types cannot.
    pub fn validate(&self) -> Result<(), String> {
        if !self.listen.ip().is_loopback() && !self.listen_any {
            return Err(format!(
                "--listen {} is not a loopback address: the API has no authentication, so it listens on 127.0.0.1 (or ::1) unless --listen-any says otherwise",
                self.listen
            ));
        }
        if !dropgate_api::keys::is_object_name(&self.namespace) {
            return Err(format!(
                "--namespace {:?} is not a valid Kubernetes namespace name",
                self.namespace
            ));
        }
        let client = redis::Client::open(self.redis_url.as_str())
            .map_err(|e| format!("--redis-url is not a Redis URL: {e}"))?;
        // With RESP3 the client reconnects by itself when a connection drops while
        // idle, and no call fails: the sidecar would not learn that the Redis
        // answering may be another (a promoted replica that missed writes), which it
        // must check against the ledger before trusting it.
        if client
            .get_connection_info()
            .redis_settings()
            .protocol()
            .supports_resp3()
        {
            return Err(
                "--redis-url asks for RESP3 (protocol=resp3): dropgate speaks RESP2, so that a dropped connection always shows as a failed call; remove the protocol parameter".into(),
            );
        }
        // WAIT covers the writes of the connection it is sent on; a cluster
        // connection is one per node, and which node's WAIT a drop needs is not
        // modelled yet.
        if self.redis_cluster && self.wait_replicas > 0 {
            return Err("--wait-replicas is not supported with --redis-cluster".into());
        }
        if self.refresh_ms == 0 || self.sweep_ms == 0 {
            return Err("--refresh-ms and --sweep-ms must be positive".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::Settings;

    /// Every flag says what it is for (`--help`).
    #[test]
    fn every_flag_has_help_text() {
        use clap::CommandFactory;
        let command = Settings::command();
        let missing: Vec<String> = command
            .get_arguments()
            .filter(|arg| !matches!(arg.get_id().as_str(), "help" | "version"))
            .filter(|arg| arg.get_help().is_none() && arg.get_long_help().is_none())
            .map(|arg| arg.get_id().to_string())
            .collect();
        assert!(missing.is_empty(), "flags without help: {missing:?}");
    }

    /// The sidecar's settings for `redis_url` and the namespace `shop`, plus `args`.
    fn settings(redis_url: &str, namespace: &str, args: &[&str]) -> Settings {
        let mut argv = vec![
            "dropgate-sidecar",
            "--namespace",
            namespace,
            "--redis-url",
            redis_url,
        ];
        argv.extend_from_slice(args);
        Settings::try_parse_from(argv).expect("parses")
    }

    const REDIS: &str = "redis://127.0.0.1:6379/";

    #[test]
    fn the_ledger_retention_is_a_number_and_a_unit_of_at_least_an_hour() {
        let days = |text: &str| dropgate_api::config::parse_retention(text).map(|d| d.as_secs());
        assert_eq!(
            settings(REDIS, "shop", &[]).ledger_retention.as_secs(),
            30 * 86_400
        );
        assert_eq!(days("12h"), Ok(12 * 3600));
        assert_eq!(days("90m"), Ok(5400));
        assert_eq!(days("7d"), Ok(7 * 86_400));
        for refused in [
            "",
            "30",
            "d",
            "59m",
            "1.5d",
            "-1d",
            "30w",
            "99999999999999999d",
        ] {
            assert!(days(refused).is_err(), "{refused:?} was taken");
        }
        assert!(
            Settings::try_parse_from([
                "dropgate-sidecar",
                "--redis-url",
                REDIS,
                "--ledger-retention",
                "10m"
            ])
            .is_err()
        );
    }

    #[test]
    fn a_redis_url_asking_for_resp3_is_refused() {
        let resp3 = settings("redis://127.0.0.1:6379/?protocol=resp3", "shop", &[]);
        let refusal = resp3.validate().expect_err("refused");
        assert!(refusal.contains("RESP3"), "{refusal}");
        assert!(!refusal.contains("127.0.0.1"), "names no URL: {refusal}");
        assert_eq!(settings(REDIS, "shop", &[]).validate(), Ok(()));
    }

    #[test]
    fn options_that_cannot_work_together_are_refused() {
        let both = settings(REDIS, "shop", &["--redis-cluster", "--wait-replicas", "1"]);
        assert!(both.validate().is_err());
        let zero = settings(REDIS, "shop", &["--refresh-ms", "0"]);
        assert!(zero.validate().is_err());
        let exposed = settings(REDIS, "shop", &["--listen", "0.0.0.0:7070"]);
        assert!(
            exposed
                .validate()
                .expect_err("refused")
                .contains("--listen-any")
        );
        let opted_in = settings(REDIS, "shop", &["--listen", "0.0.0.0:7070", "--listen-any"]);
        assert_eq!(opted_in.validate(), Ok(()));
        assert_eq!(
            settings(REDIS, "shop", &["--listen", "[::1]:7070"]).validate(),
            Ok(())
        );
        assert!(settings(REDIS, "Not_A_Namespace", &[]).validate().is_err());
    }
}
