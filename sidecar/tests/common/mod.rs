//! The sidecar under test: a real redis-server on a free port, the sidecar's `run`
//! on port 0, drops seeded through the operator's own reconcile.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::fmt::Display;

use dropgate_api::DropKeys;
use dropgate_testkit::{DropSpec, HttpClient, RedisServer, Reply};
use tokio::sync::oneshot;

pub mod failover;

pub const NS: &str = "shop";

pub struct Sidecar {
    pub redis: RedisServer,
    pub http: HttpClient,
    pub addr: std::net::SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<Result<(), dropgate_sidecar::Error>>>,
    _dir: tempfile::TempDir,
    /// Its ledger's URL.
    database_url: String,
}

/// A sidecar process of its own (in-process `run`), for tests with more than one.
pub struct Peer {
    pub http: HttpClient,
    pub addr: std::net::SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<Result<(), dropgate_sidecar::Error>>>,
}

impl Peer {
    pub async fn start(redis_url: &str, database_url: &str) -> Self {
        Self::start_with(redis_url, database_url, 100).await
    }

    /// A sidecar that re-reads configs only every `refresh_ms` (a long one keeps a
    /// stale view of a drop).
    pub async fn start_with(redis_url: &str, database_url: &str, refresh_ms: u64) -> Self {
        Self::start_custom(redis_url, database_url, |settings| {
            settings.refresh_ms = refresh_ms;
        })
        .await
    }

    /// A sidecar with settings of the test's choosing.
    pub async fn start_custom(
        redis_url: &str,
        database_url: &str,
        customize: impl FnOnce(&mut dropgate_sidecar::Settings),
    ) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind port 0");
        let addr = listener.local_addr().expect("local addr");
        let mut settings = dropgate_sidecar::Settings {
            log_format: dropgate_telemetry::LogFormat::Text,
            listen: addr,
            listen_any: false,
            health_listen: None,
            redis_url: redis_url.into(),
            namespace: NS.into(),
            database_url: database_url.into(),
            watch_drops: false,
            // No API server to watch here: outages fall back on the config last
            // read (fallback.rs's
            // `a_fallback_with_no_watch_of_the_api_server_admits_nothing_on_the_config_last_read`
            // holds the default).
            fallback_on_last_read_config: true,
            refresh_ms: 100,
            sweep_ms: 100,
            wait_replicas: 0,
            wait_timeout_ms: 100,
            trace_buyer_ids: false,
            redis_cluster: false,
            max_lock_names: 10_000,
            ledger_retention: std::time::Duration::from_secs(30 * 86_400),
        };
        customize(&mut settings);
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(dropgate_sidecar::run(listener, settings, async {
            let _ = stopped.await;
        }));
        let http = HttpClient::new(format!("http://{addr}"));
        for _ in 0..250 {
            if http.get("/healthz").await.is_ok() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        Self {
            http,
            addr,
            stop: Some(stop),
            task: Some(task),
        }
    }

    pub async fn reserve(&self, drop: &str, key: &str, user: &str, quantity: i64) -> Reply {
        reserve(&self.http, drop, key, user, quantity).await
    }

    pub async fn settle(&self, drop: &str, key: &str, op: &str) -> Reply {
        self.http
            .post(&format!("/v1/drops/{drop}/reservations/{key}/{op}"), "")
            .await
            .expect("answers")
    }

    pub async fn lookup(&self, drop: &str, key: &str) -> Reply {
        self.http
            .get(&format!("/v1/drops/{drop}/reservations/{key}"))
            .await
            .expect("answers")
    }

    /// Asks to extend `key`'s hold to `seconds` from now.
    pub async fn extend(&self, drop: &str, key: &str, seconds: i64) -> Reply {
        let until = jiff::Timestamp::now() + jiff::SignedDuration::from_secs(seconds);
        self.http
            .post(
                &format!("/v1/drops/{drop}/reservations/{key}/extend"),
                &format!(r#"{{"expiresAt":"{until}"}}"#),
            )
            .await
            .expect("answers")
    }

    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            task.await.expect("joins").expect("run returns Ok");
        }
    }
}

impl Sidecar {
    /// A sidecar with its own Redis and a SQLite ledger in a temp dir.
    pub async fn start() -> Self {
        Self::start_with_database(None).await
    }

    /// Same, with the given ledger (a PostgreSQL URL) instead of SQLite.
    pub async fn start_with_database(database_url: Option<String>) -> Self {
        let redis = RedisServer::start().expect("redis-server starts");
        let dir = tempfile::tempdir().expect("temp dir");
        let database_url = database_url
            .unwrap_or_else(|| format!("sqlite://{}", dir.path().join("ledger.db").display()));
        let mut peer = Peer::start(&redis.url(), &database_url).await;
        Self {
            redis,
            http: peer.http.clone(),
            addr: peer.addr,
            stop: peer.stop.take(),
            task: peer.task.take(),
            _dir: dir,
            database_url,
        }
    }

    pub fn database_path(&self) -> std::path::PathBuf {
        self._dir.path().join("ledger.db")
    }

    /// Publishes and seeds drop `name` with the given spec lines (YAML, indented
    /// two spaces: a `DropSpec`, or a string for a spec it cannot write), through
    /// the operator's `apply`.
    pub async fn seed(&self, name: &str, spec: impl Display) {
        seed(&self.redis.url(), name, spec).await;
    }

    pub async fn reserve(&self, drop: &str, key: &str, user: &str, quantity: i64) -> Reply {
        reserve(&self.http, drop, key, user, quantity).await
    }

    pub async fn settle(&self, drop: &str, key: &str, op: &str) -> Reply {
        self.http
            .post(&format!("/v1/drops/{drop}/reservations/{key}/{op}"), "")
            .await
            .expect("answers")
    }

    pub async fn lookup(&self, drop: &str, key: &str) -> Reply {
        self.http
            .get(&format!("/v1/drops/{drop}/reservations/{key}"))
            .await
            .expect("answers")
    }

    /// `POST /v1/carts` with `body`.
    pub async fn post_cart(&self, body: &serde_json::Value) -> Reply {
        self.http
            .post("/v1/carts", &body.to_string())
            .await
            .expect("answers")
    }

    /// The ledger key of drop `drop`'s current sale (`shop/drop/sale`).
    pub fn ledger_key(&self, drop: &str) -> String {
        ledger_key_in(&self.redis, drop)
    }

    pub fn remaining(&self, drop: &str) -> i64 {
        self.int(&DropKeys::new(NS, drop).remaining())
    }

    pub fn held(&self, drop: &str) -> i64 {
        self.int(&DropKeys::new(NS, drop).held())
    }

    fn int(&self, key: &str) -> i64 {
        let mut conn = self.redis.connection().expect("connect");
        redis::cmd("GET")
            .arg(key)
            .query::<Option<i64>>(&mut conn)
            .expect("GET")
            .unwrap_or(0)
    }

    /// Every key with its full contents: equal snapshots mean nothing changed. Left
    /// out: the outbox's event streams (the dispatcher appends to them on its own
    /// schedule), the gate's epoch (the first request to a drop opens its gate,
    /// whatever it is answered) and the change counter (an undone admission leaves
    /// a gap in the numbers, which means nothing).
    pub fn snapshot(&self) -> BTreeMap<String, String> {
        let mut conn = self.redis.connection().expect("connect");
        let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut conn).expect("KEYS");
        keys.into_iter()
            // The gate's bookkeeping (its epoch, the change counter, the sale's
            // ledger) moves when a sidecar first opens a drop, whatever it answers.
            .filter(|key| {
                !key.ends_with(":events")
                    && !key.ends_with(":gate")
                    && !key.ends_with(":seq")
                    && !key.ends_with(":ledger")
            })
            .map(|key| {
                let dump: Vec<u8> = redis::cmd("DUMP").arg(&key).query(&mut conn).expect("DUMP");
                (key, format!("{dump:?}"))
            })
            .collect()
    }

    /// docs/design.md's invariants for a quiet drop: remaining + held == limit, the
    /// buyers' counts add up to held, and so do the live reservations.
    pub fn assert_invariants(&self, drop: &str, limit: i64) {
        let keys = DropKeys::new(NS, drop);
        let mut conn = self.redis.connection().expect("connect");
        let remaining = self.remaining(drop);
        let held = self.held(drop);
        assert_eq!(
            remaining + held,
            limit,
            "remaining {remaining} + held {held} != limit {limit}"
        );
        assert!(held <= limit, "oversold: {held} held of {limit}");
        let buyers: BTreeMap<String, i64> = redis::cmd("HGETALL")
            .arg(keys.buyers())
            .query(&mut conn)
            .expect("HGETALL");
        assert_eq!(buyers.values().sum::<i64>(), held, "buyers' counts");
        let markers: Vec<String> = redis::cmd("KEYS")
            .arg(keys.reservation_pattern())
            .query(&mut conn)
            .expect("KEYS");
        let mut live = 0;
        for marker in markers {
            let (state, quantity): (String, i64) = redis::cmd("HMGET")
                .arg(&marker)
                .arg("state")
                .arg("quantity")
                .query(&mut conn)
                .expect("HMGET");
            if state == "active" || state == "confirmed" {
                live += quantity;
            }
        }
        assert_eq!(live, held, "live reservations");
    }

    /// Stops the sidecar gracefully and waits for it.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            task.await.expect("joins").expect("run returns Ok");
        }
    }
}

/// `POST /v1/drops/{drop}/reservations` with a well-formed body.
pub async fn reserve(http: &HttpClient, drop: &str, key: &str, user: &str, quantity: i64) -> Reply {
    let body = format!(r#"{{"key":"{key}","user":"{user}","quantity":{quantity}}}"#);
    http.post(&format!("/v1/drops/{drop}/reservations"), &body)
        .await
        .expect("reserve answers")
}

/// `POST /v1/drops/{drop}/waitlist`: `user` waits for `quantity` units under `key`.
pub async fn join_line(
    http: &HttpClient,
    drop: &str,
    key: &str,
    user: &str,
    quantity: i64,
) -> Reply {
    let body = format!(r#"{{"key":"{key}","user":"{user}","quantity":{quantity}}}"#);
    http.post(&format!("/v1/drops/{drop}/waitlist"), &body)
        .await
        .expect("join answers")
}

/// `GET /v1/drops/{drop}/waitlist/{key}`.
pub async fn look_line(http: &HttpClient, drop: &str, key: &str) -> Reply {
    http.get(&format!("/v1/drops/{drop}/waitlist/{key}"))
        .await
        .expect("look-up answers")
}

/// Whether `redis` holds `key`'s entry in `drop`'s lines.
pub fn has_waitlist_entry(redis: &RedisServer, drop: &str, key: &str) -> bool {
    let mut conn = redis.connection().expect("connect");
    redis::cmd("EXISTS")
        .arg(DropKeys::new(NS, drop).waitlist_entry(key))
        .query(&mut conn)
        .expect("EXISTS")
}

/// Drop `drop`'s gate as its sale's ledger calls it directly: a connection to the
/// Redis at `redis_url` (as the gate's own calls use it), the drop's keys, and the
/// ledger Redis names as the sale's.
pub struct AsTheSalesLedger {
    pub conn: dropgate_redis::Connection,
    pub keys: DropKeys,
    pub ledger: String,
}

impl AsTheSalesLedger {
    pub async fn of(redis_url: &str, drop: &str) -> Self {
        let mut conn: dropgate_redis::Connection = redis::Client::open(redis_url)
            .expect("url")
            .get_connection_manager()
            .await
            .expect("connects")
            .into();
        let keys = DropKeys::new(NS, drop);
        let ledger: String = redis::cmd("GET")
            .arg(keys.ledger())
            .query_async(&mut conn)
            .await
            .expect("the sale's ledger");
        Self { conn, keys, ledger }
    }
}

impl AsTheSalesLedger {
    /// Field `field` of `key`'s marker (`None` when it has none).
    pub async fn marker_field(&mut self, key: &str, field: &str) -> Option<String> {
        redis::cmd("HGET")
            .arg(self.keys.reservation(key))
            .arg(field)
            .query_async(&mut self.conn)
            .await
            .expect("HGET")
    }
}

/// The ledger key of drop `drop`'s current sale (`shop/drop/sale`), by the sale
/// its config in `redis` names.
pub fn ledger_key_in(redis: &RedisServer, drop: &str) -> String {
    let mut conn = redis.connection().expect("connect");
    let sale: String = redis::cmd("HGET")
        .arg(DropKeys::new(NS, drop).config())
        .arg("sale")
        .query(&mut conn)
        .expect("HGET sale");
    dropgate_api::keys::ledger_key(NS, drop, &sale)
}

/// The state of reservation `key`'s marker in Redis, if it has one.
pub fn marker_state(redis: &RedisServer, drop: &str, key: &str) -> Option<String> {
    let mut conn = redis.connection().expect("connect");
    redis::cmd("HGET")
        .arg(DropKeys::new(NS, drop).reservation(key))
        .arg("state")
        .query(&mut conn)
        .expect("HGET")
}

/// The sidecar's ledger (its own SQLite file, or the PostgreSQL it was given),
/// opened beside it.
pub async fn ledger_of(sidecar: &Sidecar) -> dropgate_sidecar::ledger::Ledger {
    dropgate_sidecar::ledger::Ledger::open(&sidecar.database_url)
        .await
        .expect("the sidecar's ledger opens")
}

/// Each reservation's state in the ledger of drop `shop/sale` (any sale of it), by
/// key.
pub async fn ledger_states(
    ledger: &dropgate_sidecar::ledger::Ledger,
) -> std::collections::HashMap<String, String> {
    use sqlx::Row;
    sqlx::query("SELECT res_key, state FROM reservations WHERE drop_key LIKE 'shop/sale/%'")
        .fetch_all(ledger.pool())
        .await
        .expect("query")
        .iter()
        .map(|row| (row.get::<String, _>(0), row.get::<String, _>(1)))
        .collect()
}

/// The drop the race and outage tests sell: `limit` units, one per buyer, and
/// permits enough that the throttle never refuses a rush.
pub fn one_per_buyer(limit: i64) -> DropSpec {
    DropSpec::new(limit).per_user_limit(1).permits(1000)
}

/// Publishes and seeds drop `name` in the Redis at `redis_url` through the
/// operator's `apply`.
pub async fn seed(redis_url: &str, name: &str, spec: impl Display) {
    apply(redis_url, &manifest(name, spec)).await;
}

/// Runs the operator's `apply` of `manifest` against the Redis at `redis_url`.
pub async fn apply(redis_url: &str, manifest: &str) {
    let done = dropgate_operator::apply::apply(
        manifest,
        Some(redis_url),
        &dropgate_operator::memorystore::Memorystore::default(),
    )
    .await
    .expect("apply succeeds");
    assert!(done.not_ready.is_none(), "{:?}", done.not_ready);
}

/// Publishes drop `name` closed by the operator: its spec requires a highly
/// available Redis (which a test's lone redis-server is not) under failure policy
/// Closed, so the operator publishes mode `closed`.
pub async fn publish_closed(redis_url: &str, name: &str, spec: DropSpec) {
    let manifest = manifest(name, spec.fail_closed()).replace(
        "redis: {url: redis://unused:1}",
        "redis: {url: redis://unused:1, requireHighAvailability: true}",
    );
    let done = dropgate_operator::apply::apply(
        &manifest,
        Some(redis_url),
        &dropgate_operator::memorystore::Memorystore::default(),
    )
    .await
    .expect("apply runs");
    assert!(done.not_ready.is_some(), "published closed: {manifest}");
}

/// Asserts a 503 `unavailable` whose message says `why`.
pub fn assert_unavailable_saying(reply: &Reply, why: &str) {
    reply.assert_answer(503, "unavailable");
    assert!(
        reply.body["message"]
            .as_str()
            .is_some_and(|m| m.contains(why)),
        "not saying {why:?}: {}",
        reply.text
    );
}

/// Makes the Redis at `redis` refuse writes (out of memory under `noeviction`;
/// reads still answer), or, with `false`, take them again.
pub fn refuse_writes(redis: &RedisServer, refuse: bool) {
    let mut conn = redis.connection().expect("connects");
    for (name, value) in [
        ("maxmemory-policy", "noeviction"),
        ("maxmemory", if refuse { "1" } else { "0" }),
    ] {
        redis::cmd("CONFIG")
            .arg("SET")
            .arg(name)
            .arg(value)
            .query::<()>(&mut conn)
            .expect("CONFIG SET");
    }
}

/// An InventoryDrop `name` in namespace [`NS`] with the given spec lines.
pub fn manifest(name: &str, spec: impl Display) -> String {
    format!(
        "apiVersion: dropgate.io/v1alpha1\nkind: InventoryDrop\nmetadata: {{name: {name}, namespace: {NS}}}\nspec:\n  redis: {{url: redis://unused:1}}\n{spec}\n"
    )
}

/// `remaining` and `held` of drop `drop` as Redis has them.
pub fn redis_counts(redis: &RedisServer, drop: &str) -> (i64, i64) {
    let mut conn = redis.connection().expect("connect");
    let keys = DropKeys::new(NS, drop);
    let mut get = |key: String| -> i64 {
        redis::cmd("GET")
            .arg(key)
            .query::<Option<i64>>(&mut conn)
            .expect("GET")
            .unwrap_or(0)
    };
    (get(keys.remaining()), get(keys.held()))
}

/// Waits (bounded: 5 s) until `done` holds.
pub async fn eventually(what: &str, mut done: impl AsyncFnMut() -> bool) {
    for _ in 0..100 {
        if done().await {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("timed out waiting for {what}");
}
