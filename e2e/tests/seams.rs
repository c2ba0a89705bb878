//! The seams a third hostile round found in "never oversell", each against real
//! processes (redis-server, PostgreSQL, the sidecar and operator binaries): a
//! fallback deciding on a stale config, ledgers that see only part of a sale, and
//! errors whose change took effect anyway. Every test failed before its fix.

use std::path::Path;
use std::time::{Duration, Instant};

use dropgate_api::DropKeys;
use dropgate_e2e::processes::{SidecarProcess, apply, binary, sale_manifest};
use dropgate_testkit::{Checkpoint, DropSpec, HttpClient, PostgresServer, RedisServer, Reply};
use futures::future::join_all;

/// How long a test waits for something that must happen soon (a ledger back, a
/// pending admission resolved): far past what it should take, far below the holds'
/// 600 s, so only a sidecar that does not do it fails.
const EVENTUALLY: Duration = Duration::from_secs(20);

/// Publishes drop `shop/sale` with `spec`, as `kubectl apply` of a changed manifest
/// would (the operator's `apply -f`).
fn publish(dir: &Path, redis: &RedisServer, spec: DropSpec) {
    let manifest = sale_manifest(dir, &spec.yaml()).expect("manifest");
    apply(&manifest, &redis.url()).expect("apply");
}

/// A sidecar process and a client of its API; the process is killed when this is
/// dropped.
struct Shop {
    http: HttpClient,
    _process: SidecarProcess,
}

impl std::ops::Deref for Shop {
    type Target = HttpClient;
    fn deref(&self) -> &HttpClient {
        &self.http
    }
}

/// A sidecar whose own copy of a drop's config is re-read only every minute: what
/// it decides must not depend on that copy.
async fn stale_sidecar(redis: &RedisServer, ledger: &str) -> Shop {
    sidecar(redis, ledger, &["--refresh-ms", "60000"]).await
}

async fn sidecar(redis: &RedisServer, ledger: &str, flags: &[&str]) -> Shop {
    let process = SidecarProcess::start_with(&redis.url(), "shop", ledger, flags)
        .await
        .expect("sidecar");
    Shop {
        http: HttpClient::new(process.base.clone()),
        _process: process,
    }
}

async fn reserve(http: &HttpClient, key: &str) -> Reply {
    let body = format!(r#"{{"key":"{key}","user":"{key}","quantity":1}}"#);
    http.post("/v1/drops/sale/reservations", &body)
        .await
        .expect("the sidecar answers")
}

async fn settle(http: &HttpClient, key: &str, op: &str) -> Reply {
    http.post(&format!("/v1/drops/sale/reservations/{key}/{op}"), "")
        .await
        .expect("the sidecar answers")
}

/// `n` buyers at once, spread over `sidecars`, keys `<prefix>-<i>`.
async fn rush(sidecars: &[&HttpClient], prefix: &str, n: usize) -> Vec<Reply> {
    join_all((0..n).map(|i| async move {
        reserve(sidecars[i % sidecars.len()], &format!("{prefix}-{i}")).await
    }))
    .await
}

fn admitted(replies: &[Reply]) -> usize {
    replies.iter().filter(|r| r.status == 201).count()
}

fn answers(replies: &[Reply]) -> Vec<String> {
    replies
        .iter()
        .map(|r| format!("{} {}", r.status, r.outcome()))
        .collect()
}

fn keys() -> DropKeys {
    DropKeys::new("shop", "sale")
}

fn redis_int(redis: &RedisServer, key: String) -> i64 {
    let mut conn = redis.connection().expect("connect");
    redis::cmd("GET")
        .arg(key)
        .query::<Option<i64>>(&mut conn)
        .expect("GET")
        .unwrap_or(0)
}

fn marker_state(redis: &RedisServer, key: &str) -> Option<String> {
    let mut conn = redis.connection().expect("connect");
    redis::cmd("HGET")
        .arg(keys().reservation(key))
        .arg("state")
        .query(&mut conn)
        .expect("HGET")
}

/// The event types the drop's stream holds for reservation `key`.
fn events_of(redis: &RedisServer, key: &str) -> Vec<String> {
    let mut conn = redis.connection().expect("connect");
    let entries: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg(keys().events())
        .arg("-")
        .arg("+")
        .query(&mut conn)
        .unwrap_or_default();
    entries
        .into_iter()
        .flat_map(|(_, fields)| fields)
        .filter_map(|(_, payload)| serde_json::from_str::<serde_json::Value>(&payload).ok())
        .filter(|event| event["key"] == key)
        .filter_map(|event| event["type"].as_str().map(String::from))
        .collect()
}

/// Asks until the answer is not 503 (the ledger coming back), within EVENTUALLY.
async fn until_answered(mut ask: impl AsyncFnMut() -> Reply) -> Reply {
    let started = Instant::now();
    loop {
        let reply = ask().await;
        if reply.status != 503 || started.elapsed() > EVENTUALLY {
            return reply;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Where a sale is recorded (README's failure table): the ledgers of the sidecars
/// that open it, and of those that join it later.
#[derive(Clone, Copy, Debug)]
enum Ledgers {
    /// Two sidecars on one PostgreSQL ledger; nobody joins.
    Shared,
    /// A pod on its own SQLite ledger, joined by another such pod.
    PerPodSeveral,
    /// Two sidecars on PostgreSQL, joined by a pod on its own SQLite ledger.
    SharedThenPerPod,
    /// A pod on its own SQLite ledger, joined by two sidecars on PostgreSQL: a
    /// rollout that adds `dropgate.io/database-secret` mid-sale (README's *mixed*).
    PerPodThenShared,
}

/// A sale served as `ledgers` says: the sale's ledger's sidecars first (the first
/// of them opens the sale by selling `early` units, each buyer asking until
/// answered), then the newcomers, every sidecar started with `flags`.
struct Sale {
    ledgers: Ledgers,
    owners: Vec<Shop>,
    newcomers: Vec<Shop>,
    _postgres: Option<PostgresServer>,
}

impl Sale {
    async fn start(
        redis: &RedisServer,
        dir: &Path,
        ledgers: Ledgers,
        flags: &[&str],
        early: usize,
    ) -> Self {
        let postgres = match ledgers {
            Ledgers::PerPodSeveral => None,
            _ => Some(PostgresServer::start().expect("PostgreSQL")),
        };
        let shared = async || {
            let url = postgres.as_ref().expect("PostgreSQL").url();
            vec![
                sidecar(redis, &url, flags).await,
                sidecar(redis, &url, flags).await,
            ]
        };
        let per_pod = async |name: &str| {
            let url = format!("sqlite://{}", dir.join(name).display());
            vec![sidecar(redis, &url, flags).await]
        };
        let owners = match ledgers {
            Ledgers::Shared | Ledgers::SharedThenPerPod => shared().await,
            Ledgers::PerPodSeveral | Ledgers::PerPodThenShared => per_pod("first.db").await,
        };
        for i in 0..early {
            let shop = &owners[i % owners.len()];
            until_answered(async || reserve(shop, &format!("early-{i}")).await)
                .await
                .assert_answer(201, "admitted");
        }
        let newcomers = match ledgers {
            Ledgers::Shared => Vec::new(),
            Ledgers::PerPodSeveral | Ledgers::SharedThenPerPod => per_pod("newcomer.db").await,
            Ledgers::PerPodThenShared => shared().await,
        };
        Self {
            ledgers,
            owners,
            newcomers,
            _postgres: postgres,
        }
    }

    /// `n` buyers at once over every sidecar (keys `<prefix>-<i>`). The newcomers
    /// sell nothing (checked); the answers of the sale's ledger's sidecars, and the
    /// newcomers', are returned apart.
    async fn rush(&self, prefix: &str, n: usize) -> (Vec<Reply>, Vec<Reply>) {
        let every: Vec<&HttpClient> = self
            .owners
            .iter()
            .chain(&self.newcomers)
            .map(|shop| &**shop)
            .collect();
        let (mut owned, mut newcomers) = (Vec::new(), Vec::new());
        for (i, reply) in rush(&every, prefix, n).await.into_iter().enumerate() {
            if i % every.len() < self.owners.len() {
                owned.push(reply);
            } else {
                newcomers.push(reply);
            }
        }
        assert_eq!(
            admitted(&newcomers),
            0,
            "{:?}: a ledger not the sale's sold: {:?}",
            self.ledgers,
            answers(&newcomers)
        );
        (owned, newcomers)
    }
}

/// Every answer of a sidecar whose ledger is not the sale's says so.
fn assert_refused_as_another_ledgers(replies: &[Reply]) {
    for reply in replies {
        assert_eq!(reply.status, 503, "{}", reply.text);
        assert!(
            reply.text.contains("another ledger"),
            "a newcomer's refusal names the sale's ledger: {}",
            reply.text
        );
    }
}

/// A sidecar whose copy of a drop's config is re-read only every minute.
const STALE: &[&str] = &["--refresh-ms", "60000"];

async fn a_limit_cut_on_the_fallback_is_obeyed(ledgers: Ledgers) {
    let redis = RedisServer::start().expect("redis-server");
    let dir = tempfile::tempdir().expect("dir");
    publish(
        dir.path(),
        &redis,
        DropSpec::new(20).kill_switch().permits(100),
    );
    let sale = Sale::start(&redis, dir.path(), ledgers, STALE, 5).await;

    publish(
        dir.path(),
        &redis,
        DropSpec::new(10).kill_switch().permits(100),
    );
    let (late, newcomers) = sale.rush("late", 30).await;
    assert_refused_as_another_ledgers(&newcomers);
    assert_eq!(
        5 + admitted(&late),
        10,
        "{ledgers:?}: the limit in force is 10: {:?}",
        answers(&late)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_limit_cut_on_the_fallback_is_obeyed_by_the_next_buyer() {
    a_limit_cut_on_the_fallback_is_obeyed(Ledgers::Shared).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_limit_cut_on_the_fallback_of_per_pod_or_mixed_ledgers_is_obeyed() {
    a_limit_cut_on_the_fallback_is_obeyed(Ledgers::PerPodSeveral).await;
    a_limit_cut_on_the_fallback_is_obeyed(Ledgers::PerPodThenShared).await;
    a_limit_cut_on_the_fallback_is_obeyed(Ledgers::SharedThenPerPod).await;
}

async fn an_end_moved_into_the_past_on_the_fallback_is_obeyed(ledgers: Ledgers) {
    let redis = RedisServer::start().expect("redis-server");
    let dir = tempfile::tempdir().expect("dir");
    publish(
        dir.path(),
        &redis,
        DropSpec::new(20).kill_switch().permits(100),
    );
    let sale = Sale::start(&redis, dir.path(), ledgers, STALE, 3).await;

    publish(
        dir.path(),
        &redis,
        DropSpec::new(20)
            .kill_switch()
            .permits(100)
            .ends_at("2001-01-01T00:00:00Z"),
    );
    let (late, newcomers) = sale.rush("late", 12).await;
    assert_refused_as_another_ledgers(&newcomers);
    assert!(
        late.iter()
            .all(|r| r.status == 403 && r.outcome() == "ended"),
        "{ledgers:?}: the sale has ended: {:?}",
        answers(&late)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_end_moved_into_the_past_on_the_fallback_ends_the_sale_for_the_next_buyer() {
    an_end_moved_into_the_past_on_the_fallback_is_obeyed(Ledgers::Shared).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_end_moved_on_the_fallback_of_per_pod_or_mixed_ledgers_ends_the_sale() {
    an_end_moved_into_the_past_on_the_fallback_is_obeyed(Ledgers::PerPodSeveral).await;
    an_end_moved_into_the_past_on_the_fallback_is_obeyed(Ledgers::PerPodThenShared).await;
    an_end_moved_into_the_past_on_the_fallback_is_obeyed(Ledgers::SharedThenPerPod).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restock_of_a_sold_out_drop_sells_to_the_next_buyer() {
    let redis = RedisServer::start().expect("redis-server");
    let postgres = PostgresServer::start().expect("PostgreSQL");
    let dir = tempfile::tempdir().expect("dir");
    publish(dir.path(), &redis, DropSpec::new(5));
    let a = stale_sidecar(&redis, &postgres.url()).await;
    assert_eq!(admitted(&rush(&[&*a], "first", 5).await), 5);
    assert_eq!(reserve(&a, "one-too-many").await.outcome(), "sold_out");

    publish(dir.path(), &redis, DropSpec::new(10));
    let restocked = rush(&[&*a], "restocked", 5).await;
    assert_eq!(
        admitted(&restocked),
        5,
        "5 more units are there: {:?}",
        answers(&restocked)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_refund_or_confirm_the_ledger_cannot_record_changes_nothing() {
    let redis = RedisServer::start().expect("redis-server");
    let postgres = PostgresServer::start().expect("PostgreSQL");
    let dir = tempfile::tempdir().expect("dir");
    publish(dir.path(), &redis, DropSpec::new(2));
    let seeded = redis.checkpoint();
    let shop = sidecar(&redis, &postgres.url(), &[]).await;
    reserve(&shop, "alice").await.assert_answer(201, "admitted");
    settle(&shop, "alice", "confirm")
        .await
        .assert_answer(200, "confirmed");
    reserve(&shop, "carol").await.assert_answer(201, "admitted");

    postgres.stop().expect("PostgreSQL stops");
    let refund = settle(&shop, "alice", "cancel").await;
    assert_eq!(refund.status, 503, "{}", refund.text);
    let confirm = settle(&shop, "carol", "confirm").await;
    assert_eq!(confirm.status, 503, "{}", confirm.text);
    // Nothing changed: in Redis, in what the drop shows, for the next buyer.
    assert_eq!(marker_state(&redis, "alice").as_deref(), Some("confirmed"));
    assert_eq!(marker_state(&redis, "carol").as_deref(), Some("active"));
    assert_eq!(redis_int(&redis, keys().remaining()), 0);
    assert_eq!(redis_int(&redis, keys().held()), 2);
    let drop = shop.get("/v1/drops/sale").await.expect("answers");
    assert_eq!(drop.body["remaining"], 0, "{}", drop.text);
    assert_ne!(reserve(&shop, "bob").await.status, 201);

    postgres.start_again().expect("PostgreSQL starts again");
    assert!(
        !events_of(&redis, "alice").contains(&"cancelled".to_string()),
        "no event of a refund that was not made"
    );
    until_answered(async || settle(&shop, "alice", "cancel").await)
        .await
        .assert_answer(200, "cancelled");
    until_answered(async || settle(&shop, "carol", "confirm").await)
        .await
        .assert_answer(200, "confirmed");
    until_answered(async || reserve(&shop, "bob").await)
        .await
        .assert_answer(201, "admitted");
    let started = Instant::now();
    while !events_of(&redis, "alice").contains(&"cancelled".to_string()) {
        assert!(
            started.elapsed() < EVENTUALLY,
            "the refund's event reaches the stream"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let cancelled = events_of(&redis, "alice")
        .iter()
        .filter(|t| *t == "cancelled")
        .count();
    assert_eq!(cancelled, 1, "one refund, one event");

    // Redis loses everything since the seed: it comes back as the ledger has it,
    // alice refunded (the retried refund is not reverted), carol confirmed, bob
    // active.
    fail_over(&redis, &seeded);
    for (key, state) in [
        ("alice", "cancelled"),
        ("carol", "confirmed"),
        ("bob", "active"),
    ] {
        let found = until_answered(async || {
            shop.get(&format!("/v1/drops/sale/reservations/{key}"))
                .await
                .expect("the sidecar answers")
        })
        .await;
        assert_eq!(
            found.body["state"], state,
            "{key} after the rebuild: {}",
            found.text
        );
    }
    assert_eq!(
        (
            redis_int(&redis, keys().remaining()),
            redis_int(&redis, keys().held())
        ),
        (0, 2),
        "Redis rebuilt counts carol's and bob's units, not alice's"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_commit_slower_than_its_deadline_is_refused_undone_and_retried() {
    let redis = RedisServer::start().expect("redis-server");
    let postgres = PostgresServer::start().expect("PostgreSQL");
    let dir = tempfile::tempdir().expect("dir");
    publish(dir.path(), &redis, DropSpec::new(3));
    let shop = sidecar(&redis, &postgres.url(), &[]).await;
    reserve(&shop, "warm").await.assert_answer(201, "admitted");

    // PostgreSQL holds a lock on the ledger's reservations for 4 s.
    let pool = sqlx::PgPool::connect(&postgres.url())
        .await
        .expect("the test's own connection");
    let mut tx = pool.begin().await.expect("begin");
    sqlx::query("LOCK TABLE reservations IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *tx)
        .await
        .expect("lock");
    let holder = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(4)).await;
        tx.commit().await.expect("commit");
    });
    let first = reserve(&shop, "k").await;
    assert_eq!(first.status, 503, "refused and undone: {}", first.text);
    // The 503 changed nothing: Redis holds no unit for `k` once it is answered, and
    // the attempt's commit, let through when the lock goes, is refused: no row holds
    // `k` in the ledger and no event names it.
    assert!(
        !matches!(
            marker_state(&redis, "k").as_deref(),
            Some("pending" | "active" | "confirmed")
        ),
        "Redis holds k after its 503: {:?}",
        marker_state(&redis, "k")
    );
    assert_eq!(
        redis_int(&redis, keys().held()),
        1,
        "only warm's unit is held"
    );
    assert_eq!(redis_int(&redis, keys().remaining()), 2);
    holder.await.expect("the lock is released");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (k_in_ledger,): (i64,) = sqlx::query_as(
        "SELECT COUNT(*) FROM reservations WHERE drop_key LIKE 'shop/sale/%' AND res_key = 'k' AND state IN ('active', 'confirmed')",
    )
    .fetch_one(&pool)
    .await
    .expect("count");
    assert_eq!(k_in_ledger, 0, "the refused attempt's late commit landed");
    assert!(
        events_of(&redis, "k").is_empty(),
        "events of the refused attempt: {:?}",
        events_of(&redis, "k")
    );
    assert_eq!(redis_int(&redis, keys().held()), 1);

    let retry = until_answered(async || reserve(&shop, "k").await).await;
    retry.assert_answer(201, "admitted");
    settle(&shop, "k", "confirm")
        .await
        .assert_answer(200, "confirmed");
    assert_eq!(redis_int(&redis, keys().held()), 2);
    let (in_ledger,): (i64,) = sqlx::query_as(
        "SELECT COUNT(*) FROM reservations WHERE drop_key LIKE 'shop/sale/%' AND state IN ('active', 'confirmed')",
    )
    .fetch_one(&pool)
    .await
    .expect("count");
    assert_eq!(in_ledger, 2, "Redis and the ledger agree");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_pods_unfinished_admissions_go_back_within_the_pending_bound() {
    let redis = RedisServer::start().expect("redis-server");
    let postgres = PostgresServer::start().expect("PostgreSQL");
    let dir = tempfile::tempdir().expect("dir");
    publish(
        dir.path(),
        &redis,
        DropSpec::new(300).hold_seconds(600).permits(1000),
    );
    let steady = sidecar(&redis, &postgres.url(), &[]).await;
    let doomed = SidecarProcess::start(&redis.url(), "shop", &postgres.url())
        .await
        .expect("sidecar");
    let doomed_http = HttpClient::new(doomed.base.clone());
    reserve(&steady, "warm")
        .await
        .assert_answer(201, "admitted");
    let buyers = join_all((0..200).map(|i| {
        let http = doomed_http.clone();
        async move {
            let body = format!(r#"{{"key":"d{i}","user":"d{i}","quantity":1}}"#);
            http.post("/v1/drops/sale/reservations", &body).await.ok()
        }
    }));
    let killer = async {
        tokio::time::sleep(Duration::from_millis(20)).await;
        doomed.kill();
    };
    let (replies, ()) = tokio::join!(buyers, killer);
    let acknowledged: Vec<String> = replies
        .iter()
        .enumerate()
        .filter(|(_, r)| r.as_ref().is_some_and(|r| r.status == 201))
        .map(|(i, _)| format!("d{i}"))
        .collect();
    assert!(
        replies.iter().any(Option::is_none),
        "the pod was killed with buyers in flight"
    );

    // The pod never comes back; the steady one resolves what it left half done.
    let mut conn = redis.connection().expect("connect");
    let pool = sqlx::PgPool::connect(&postgres.url())
        .await
        .expect("the test's own connection");
    let started = Instant::now();
    loop {
        let unresolved: i64 = redis::cmd("ZCARD")
            .arg(keys().pending())
            .query(&mut conn)
            .expect("ZCARD");
        let held = redis_int(&redis, keys().held());
        let (in_ledger,): (i64,) = sqlx::query_as(
            "SELECT COUNT(*) FROM reservations WHERE drop_key LIKE 'shop/sale/%' AND state IN ('active', 'confirmed')",
        )
        .fetch_one(&pool)
        .await
        .expect("count");
        if unresolved == 0 && held == in_ledger {
            for key in &acknowledged {
                let state = marker_state(&redis, key);
                assert!(
                    matches!(state.as_deref(), Some("active" | "confirmed")),
                    "{key} was acknowledged, and Redis has it {state:?}"
                );
                let (rows,): (i64,) = sqlx::query_as(
                    "SELECT COUNT(*) FROM reservations WHERE drop_key LIKE 'shop/sale/%' AND res_key = $1 AND state IN ('active', 'confirmed')",
                )
                .bind(key)
                .fetch_one(&pool)
                .await
                .expect("count");
                assert_eq!(
                    rows, 1,
                    "{key} was acknowledged, and the ledger does not hold it"
                );
            }
            break;
        }
        assert!(
            started.elapsed() < EVENTUALLY,
            "{unresolved} admissions still unresolved, Redis holds {held}, the ledger {in_ledger}: long past the pending bound, far from the 600 s hold"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_garbage_sqlite_ledger_stops_the_sidecar_at_once_saying_why() {
    let redis = RedisServer::start().expect("redis-server");
    let dir = tempfile::tempdir().expect("dir");
    let file = dir.path().join("ledger.db");
    std::fs::write(
        &file,
        "this is not a database, it is a shopping list\n".repeat(200),
    )
    .expect("write");
    let port = dropgate_testkit::free_port().expect("port");
    let mut child = std::process::Command::new(binary("dropgate-sidecar"))
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--redis-url", &redis.url()])
        .args(["--database-url", &format!("sqlite://{}", file.display())])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("runs");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("waits") {
            break status;
        }
        assert!(
            started.elapsed() < EVENTUALLY,
            "still running on a garbage ledger"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut stderr = String::new();
    use std::io::Read;
    if let Some(mut pipe) = child.stderr.take() {
        let _ = pipe.read_to_string(&mut stderr);
    }
    assert!(!status.success());
    assert!(stderr.contains("ledger"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn per_pod_ledgers_on_several_pods_sell_through_one_and_survive_a_lossy_failover() {
    let redis = RedisServer::start().expect("redis-server");
    let dir = tempfile::tempdir().expect("dir");
    let sqlite = |name: &str| format!("sqlite://{}", dir.path().join(name).display());
    publish(dir.path(), &redis, DropSpec::new(40).permits(100));
    let a = SidecarProcess::start(&redis.url(), "shop", &sqlite("a.db"))
        .await
        .expect("sidecar a");
    let a_http = HttpClient::new(a.base.clone());
    let b = sidecar(&redis, &sqlite("b.db"), &[]).await;
    assert_eq!(admitted(&rush(&[&a_http], "a", 20).await), 20);
    let refused = rush(&[&*b], "b", 10).await;
    assert!(
        refused.iter().all(|r| r.status == 503),
        "a second per-pod ledger sells nothing: {:?}",
        answers(&refused)
    );
    let checkpoint = redis.checkpoint();
    assert_eq!(admitted(&rush(&[&a_http], "a-late", 20).await), 20);

    // Pod a is scaled in; Redis fails over to a replica that missed a's last 20.
    a.kill();
    redis.roll_back_to(&checkpoint).expect("Redis rolls back");
    let after = rush(&[&*b], "after", 20).await;
    let c = sidecar(&redis, &sqlite("c.db"), &[]).await;
    let newcomer = rush(&[&*c], "newcomer", 20).await;
    assert_eq!(
        admitted(&after) + admitted(&newcomer),
        0,
        "40 sold of 40 before the failover: b {:?}, a new pod {:?}",
        answers(&after),
        answers(&newcomer)
    );
}

/// One sale served by sidecars with different ledgers (`ledgers`): the newcomers
/// sell nothing, with Redis up or gone (then, with failurePolicy Open, only the
/// sale's own ledger falls back), and never more than the limit is sold.
async fn only_the_sales_ledger_sells(ledgers: Ledgers) {
    let mut redis = RedisServer::start().expect("redis-server");
    let dir = tempfile::tempdir().expect("dir");
    publish(dir.path(), &redis, DropSpec::new(6).permits(100));
    let sale = Sale::start(&redis, dir.path(), ledgers, &["--refresh-ms", "100"], 3).await;
    let newcomers: Vec<&HttpClient> = sale.newcomers.iter().map(|shop| &**shop).collect();
    let refused = rush(&newcomers, "newcomer", 6).await;
    assert_refused_as_another_ledgers(&refused);

    // Redis gone for everyone, failurePolicy Open: only the sale's ledger falls back.
    redis.stop();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // The same buyers ask again and again: a key sold counts once.
    let mut on_fallback = std::collections::HashSet::new();
    let mut last = Vec::new();
    for _ in 0..10 {
        let (owned, _) = sale.rush("outage", 12).await;
        last = answers(&owned);
        for reply in owned.iter().filter(|reply| reply.status == 201) {
            on_fallback.insert(
                reply.body["key"]
                    .as_str()
                    .expect("a 201 names its key")
                    .to_string(),
            );
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(
        !on_fallback.is_empty(),
        "{ledgers:?}: the sale's ledger fell back (its last answers: {last:?})"
    );
    assert!(
        3 + on_fallback.len() <= 6,
        "{ledgers:?}: {} sold of 6",
        3 + on_fallback.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mixed_ledgers_never_sell_what_another_sold() {
    only_the_sales_ledger_sells(Ledgers::SharedThenPerPod).await;
}

/// README's *mixed* order: a sale opened on a per-pod ledger, joined by sidecars
/// on a PostgreSQL ledger (a rollout that adds `dropgate.io/database-secret`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mixed_ledgers_opened_per_pod_never_sell_through_the_shared_one() {
    only_the_sales_ledger_sells(Ledgers::PerPodThenShared).await;
}

/// Per-pod ledgers on two pods: the sale's pod falls back when Redis is gone, the
/// other sells nothing, with Redis up or gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn per_pod_ledgers_on_two_pods_fall_back_only_on_the_sales_pod() {
    only_the_sales_ledger_sells(Ledgers::PerPodSeveral).await;
}

/// Lock `shared` acquired by `owner` for `ttl_ms` through `http`, asking until the
/// sidecar answers (it may still be starting).
async fn acquire(http: &HttpClient, owner: &str, ttl_ms: u64) -> Reply {
    let body = format!(r#"{{"owner":"{owner}","ttlMs":{ttl_ms},"waitMs":0}}"#);
    let held = until_answered(async || {
        http.post("/v1/locks/shared", &body)
            .await
            .expect("the sidecar answers")
    })
    .await;
    held.assert_answer(200, "acquired");
    held
}

/// Two sidecar processes share a lock; Redis restarts without its data (the fence
/// counter with it); the next fence, from the other process, is still above every
/// fence handed out before. With per-pod ledgers (neither saw the other's fences)
/// what keeps it above is Redis's clock (a fence is never below it in
/// microseconds: README's "Not guaranteed" (2)). With one shared PostgreSQL ledger
/// the fences before the loss are put far above the clock, so that only the
/// ledger's record of them can keep the next one above.
async fn fences_grow_across_processes_over_a_redis_loss(shared: bool) {
    let mut redis = RedisServer::start().expect("redis-server");
    let postgres = shared.then(|| PostgresServer::start().expect("PostgreSQL"));
    let dir = tempfile::tempdir().expect("dir");
    let ledger = |name: &str| match &postgres {
        Some(postgres) => postgres.url(),
        None => format!("sqlite://{}", dir.path().join(name).display()),
    };
    if shared {
        let mut conn = redis.connection().expect("connect");
        let (seconds, micros): (i64, i64) = redis::cmd("TIME").query(&mut conn).expect("TIME");
        // Eleven days of microseconds past Redis's clock.
        let far_ahead = seconds * 1_000_000 + micros + 1_000_000_000_000;
        redis::cmd("SET")
            .arg(dropgate_api::LockKeys::new("shop", "shared").fence())
            .arg(far_ahead)
            .query::<()>(&mut conn)
            .expect("SET fence");
    }
    let first = sidecar(&redis, &ledger("first.db"), &[]).await;
    let mut fences = Vec::new();
    for _ in 0..5 {
        let held = acquire(&first, "me", 10_000).await;
        fences.push(held.body["fence"].as_i64().expect("a fence"));
        let token = held.body["token"].as_str().expect("a token").to_string();
        let released = first
            .delete("/v1/locks/shared", &format!(r#"{{"token":"{token}"}}"#))
            .await
            .expect("the sidecar answers");
        assert_eq!(released.outcome(), "released", "{}", released.text);
    }
    assert!(fences.windows(2).all(|w| w[0] < w[1]), "{fences:?}");
    redis.restart().expect("Redis restarts without its data");
    let second = sidecar(&redis, &ledger("second.db"), &[]).await;
    // (Held for a moment only: the fence is what is checked.)
    let theirs = acquire(&second, "them", 100).await;
    let fence = theirs.body["fence"].as_i64().expect("a fence");
    let last = *fences.last().expect("five fences");
    assert!(
        fence > last,
        "shared {shared}: fence {fence} after {fences:?}: a storage guarded by it would take a stale holder's write"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fences_of_per_pod_ledgers_keep_growing_over_a_redis_loss() {
    fences_grow_across_processes_over_a_redis_loss(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fences_of_a_shared_ledger_keep_growing_over_a_redis_loss() {
    fences_grow_across_processes_over_a_redis_loss(true).await;
}

/// What the operator does for a sale in Kubernetes: publishes claims as `recorded`,
/// and once a sidecar's claim is in the drop's status, writes the plain id back.
fn operator_publishes(dir: &Path, redis: &RedisServer, spec: DropSpec, ledger: Option<&str>) {
    publish(dir, redis, spec);
    let mut conn = redis.connection().expect("connect");
    redis::cmd("HSET")
        .arg(keys().config())
        .arg("claims")
        .arg("recorded")
        .query::<()>(&mut conn)
        .expect("HSET claims");
    if let Some(ledger) = ledger {
        redis::cmd("SET")
            .arg(keys().ledger())
            .arg(ledger)
            .query::<()>(&mut conn)
            .expect("SET ledger");
    }
}

/// A failover to a replica that was at `checkpoint`: the data put back to it and
/// every client's connection dropped, so that each sidecar's Redis era changes and
/// it checks Redis against its ledger again before trusting it.
fn fail_over(redis: &RedisServer, checkpoint: &Checkpoint) {
    redis.roll_back_to(checkpoint).expect("Redis rolls back");
    let mut conn = redis.connection().expect("connect");
    redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("normal")
        .query::<i64>(&mut conn)
        .expect("CLIENT KILL");
}

fn ledger_key_value(redis: &RedisServer) -> Option<String> {
    let mut conn = redis.connection().expect("connect");
    redis::cmd("GET")
        .arg(keys().ledger())
        .query(&mut conn)
        .expect("GET ledger")
}

/// The hostile review's sale on per-pod ledgers: a pod sold part of it, Redis lost
/// its data, and a pod with a ledger new to the sale came first after the re-seed.
/// Nothing is sold on a claim the operator has not recorded, so the re-seed always
/// names the sale's ledger, and the new pod sells nothing of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_counts_once_recorded_so_a_redis_that_lost_it_gets_it_back() {
    let mut redis = RedisServer::start().expect("redis-server");
    let dir = tempfile::tempdir().expect("dir");
    let sqlite = |name: &str| format!("sqlite://{}", dir.path().join(name).display());
    operator_publishes(dir.path(), &redis, DropSpec::new(5), None);
    let a = sidecar(&redis, &sqlite("a.db"), &[]).await;

    // The first request claims the sale; claimed, not recorded, nothing is sold yet
    // and the buyer is asked to retry.
    let first = reserve(&a, "first").await;
    first.assert_answer(503, "unavailable");
    let started = Instant::now();
    let claimed = loop {
        match ledger_key_value(&redis) {
            Some(value) if value.starts_with("claimed:") => break value,
            _ => {
                assert!(
                    started.elapsed() < EVENTUALLY,
                    "the sidecar claims the sale: {:?}",
                    ledger_key_value(&redis)
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    let early = reserve(&a, "early").await;
    early.assert_answer(503, "unavailable");
    assert!(early.headers.contains_key("retry-after"), "{}", early.text);
    assert_eq!(redis_int(&redis, keys().held()), 0);

    // The operator records it (status.ledger) and writes it back plain: the sale opens.
    let ledger_a = claimed.trim_start_matches("claimed:").to_string();
    operator_publishes(dir.path(), &redis, DropSpec::new(5), Some(&ledger_a));
    for key in ["a-1", "a-2", "a-3"] {
        until_answered(async || reserve(&a, key).await)
            .await
            .assert_answer(201, "admitted");
    }

    // Redis loses everything; the operator re-seeds from status, naming ledger a.
    redis.restart().expect("redis restarts empty");
    operator_publishes(dir.path(), &redis, DropSpec::new(5), Some(&ledger_a));
    let b = sidecar(&redis, &sqlite("b.db"), &[]).await;
    let mut sold_by_b = 0;
    let mut sold_by_a = 0;
    for i in 0..5 {
        if reserve(&b, &format!("b-{i}")).await.status == 201 {
            sold_by_b += 1;
        }
        let reply = until_answered(async || reserve(&a, &format!("a-more-{i}")).await).await;
        if reply.status == 201 {
            sold_by_a += 1;
        }
    }
    assert_eq!(sold_by_b, 0, "a ledger new to the sale sold part of it");
    assert_eq!(sold_by_a, 2, "the sale's ledger sells what is left: 5 - 3");
}

/// A confirm Redis lost in a failover (the replica promoted never had it) is not
/// undone by the sweeper expiring the hold there: Redis is checked against the
/// ledger before it acts on its own, and a rebuild brings the reservation forward
/// to the ledger's `confirmed` even from an `expired` marker.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_confirm_lost_in_a_failover_is_never_expired_by_the_sweeper() {
    let redis = RedisServer::start().expect("redis-server");
    let dir = tempfile::tempdir().expect("dir");
    let ledger = format!("sqlite://{}", dir.path().join("ledger.db").display());
    publish(
        dir.path(),
        &redis,
        DropSpec::new(3).hold_seconds(3).acquire_timeout_ms(50),
    );
    // Sweeps every 100 ms; no refresh (which would rebuild Redis) for a minute.
    let shop = sidecar(
        &redis,
        &ledger,
        &["--sweep-ms", "100", "--refresh-ms", "60000"],
    )
    .await;
    let reserved_at = Instant::now();
    reserve(&shop, "k1").await.assert_answer(201, "admitted");
    let before_confirm = redis.checkpoint();
    settle(&shop, "k1", "confirm")
        .await
        .assert_answer(200, "confirmed");

    // Past the hold's deadline, the failover: Redis as the replica had it (the hold
    // active, its deadline passed), and every connection dropped.
    tokio::time::sleep(Duration::from_millis(3300).saturating_sub(reserved_at.elapsed())).await;
    fail_over(&redis, &before_confirm);
    // Ten sweeps' time.
    tokio::time::sleep(Duration::from_millis(1000)).await;

    let found = until_answered(async || settle(&shop, "k1", "confirm").await).await;
    found.assert_answer(200, "already_confirmed");
    let started = Instant::now();
    while marker_state(&redis, "k1").as_deref() != Some("confirmed")
        && started.elapsed() < EVENTUALLY
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(marker_state(&redis, "k1").as_deref(), Some("confirmed"));
    let refund = settle(&shop, "k1", "cancel").await;
    refund.assert_answer(200, "cancelled");
}
