//! Interleavings a hostile review of "one authority at a time" found: each failed
//! before its fix (per-pod ledgers, a marker past its TTL, a pod new to a sale, a
//! drop re-created under a stale sidecar, an expiry waiting on an extension's lock,
//! an expiry by a deadline the ledger has moved on from) and holds now.

mod common;

use std::time::Duration;

use common::{NS, Peer, eventually, marker_state, one_per_buyer, redis_counts, seed};
use dropgate_api::DropKeys;
use dropgate_testkit::{DropSpec, PostgresServer, RedisServer, Reply, TcpProxy};
use futures::future::join_all;

fn sqlite_url(dir: &tempfile::TempDir, name: &str) -> String {
    format!("sqlite://{}", dir.path().join(name).display())
}

fn show(r: &Reply) -> String {
    format!("{} {}", r.status, r.text)
}

/// The state of `key`'s reservation of `drop` in `ledger` (any sale of it).
async fn ledger_state(
    ledger: &dropgate_sidecar::ledger::Ledger,
    drop: &str,
    key: &str,
) -> Option<String> {
    sqlx::query_scalar("SELECT state FROM reservations WHERE drop_key LIKE $1 AND res_key = $2")
        .bind(format!("{NS}/{drop}/%"))
        .bind(key)
        .fetch_optional(ledger.pool())
        .await
        .expect("the ledger answers")
}

/// Per-pod SQLite ledgers (two pods, one Redis): a hold admitted through pod A and
/// confirmed through pod B (the shop's load balancer picks any pod) stayed `active`
/// in A's ledger; past the deadline A's "ledger repair" expired it there and the
/// refresh replayed `expired` into Redis, which ranks above `confirmed`: the
/// confirmed unit went back to stock and was sold again. Now the sale has one
/// ledger (A's, which opened it): B changes nothing, and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_confirm_through_another_pod_is_never_reverted_or_resold() {
    let redis = RedisServer::start().expect("redis-server");
    let dir = tempfile::tempdir().expect("temp dir");
    seed(&redis.url(), "sale", one_per_buyer(2).hold_seconds(3)).await;
    let a = Peer::start(&redis.url(), &sqlite_url(&dir, "a.db")).await;
    let b = Peer::start(&redis.url(), &sqlite_url(&dir, "b.db")).await;
    let r = a.reserve("sale", "k", "alice", 1).await;
    assert_eq!(r.status, 201, "{}", show(&r));
    let r = b.reserve("sale", "j", "bob", 1).await;
    r.assert_answer(503, "unavailable");
    let c = b.settle("sale", "k", "confirm").await;
    c.assert_answer(503, "unavailable");
    assert_eq!(marker_state(&redis, "sale", "k").as_deref(), Some("active"));
    let c = a.settle("sale", "k", "confirm").await;
    assert_eq!(c.outcome(), "confirmed", "{}", show(&c));
    assert_eq!(redis_counts(&redis, "sale"), (1, 1));

    // Past the hold's deadline and the ledger repair's grace (5 s).
    tokio::time::sleep(Duration::from_millis(10_000)).await;
    let state = marker_state(&redis, "sale", "k");
    let late = a.reserve("sale", "late", "carol", 1).await;
    let later = a.reserve("sale", "later", "dave", 1).await;
    eprintln!(
        "k in Redis: {state:?}; late reserves: {} / {}; counts {:?}",
        show(&late),
        show(&later),
        redis_counts(&redis, "sale")
    );
    assert_eq!(
        state.as_deref(),
        Some("confirmed"),
        "alice's acknowledged confirm was reverted"
    );
    assert!(
        !(late.status == 201 && later.status == 201),
        "oversold: 3 units held for a limit of 2"
    );
    a.shutdown().await;
    b.shutdown().await;
}

/// Per-pod SQLite: a pod whose ledger has not yet joined the drop's epoch (fresh
/// emptyDir after a restart, or a pod that only confirms) confirms / cancels in
/// Redis and then answers 503 because its own ledger has no authority row; a
/// retry is 503 again. Redis changed (the cancel returned the unit, and it can
/// be sold), yet the buyer was told nothing happened.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cancel_through_a_pod_new_to_the_sale_is_recorded() {
    let redis = RedisServer::start().expect("redis-server");
    let dir = tempfile::tempdir().expect("temp dir");
    seed(&redis.url(), "sale", one_per_buyer(1)).await;
    let a = Peer::start(&redis.url(), &sqlite_url(&dir, "a.db")).await;
    let b = Peer::start(&redis.url(), &sqlite_url(&dir, "b.db")).await;
    let r = a.reserve("sale", "k", "alice", 1).await;
    assert_eq!(r.status, 201, "{}", show(&r));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let first = b.settle("sale", "k", "cancel").await;
    let again = b.settle("sale", "k", "cancel").await;
    let state = marker_state(&redis, "sale", "k");
    eprintln!(
        "cancel: {}; retry: {}; Redis marker {state:?}; counts {:?}",
        show(&first),
        show(&again),
        redis_counts(&redis, "sale")
    );
    assert!(
        first.status.is_success() || state.as_deref() == Some("active"),
        "answered {} but Redis has the reservation {state:?}",
        first.status
    );
    a.shutdown().await;
    b.shutdown().await;
}

async fn buyers(peer: &Peer, drop: &str, prefix: &str, n: usize) -> Vec<Reply> {
    join_all((0..n).map(|i| async move {
        peer.reserve(drop, &format!("{prefix}-{i}"), &format!("{prefix}-{i}"), 1)
            .await
    }))
    .await
}

fn admitted(replies: &[Reply]) -> usize {
    replies.iter().filter(|r| r.status == 201).count()
}

/// Per-pod SQLite, failurePolicy Open: pod A was alone when it last reached Redis,
/// then lost Redis (a partition of its own). Pod B starts meanwhile (scale-up,
/// rolling update) and reaches Redis. A's "alone" is a stale view (its
/// ledger_peers were learnt before B registered; the quiet rule only sees A's own
/// gate_seen), so A hands the drop to its own ledger while B joins the gate:
/// both sell the same units.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_partitioned_per_pod_sidecar_never_sells_beside_the_gate() {
    let redis = RedisServer::start().expect("redis-server");
    let proxy = TcpProxy::start(redis.port()).await.expect("proxy");
    let dir = tempfile::tempdir().expect("temp dir");
    seed(&redis.url(), "sale", one_per_buyer(3)).await;
    let a = Peer::start(&proxy.redis_url(), &sqlite_url(&dir, "a.db")).await;
    let r = a.reserve("sale", "a0", "a0", 1).await;
    assert_eq!(r.status, 201, "{}", show(&r));
    tokio::time::sleep(Duration::from_millis(300)).await;

    proxy.cut().await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let b = Peer::start(&redis.url(), &sqlite_url(&dir, "b.db")).await;
    let (on_a, on_b) = tokio::join!(buyers(&a, "sale", "pa", 5), buyers(&b, "sale", "pb", 5));
    let sold = 1 + admitted(&on_a) + admitted(&on_b);
    eprintln!(
        "A (partitioned): {:?}\nB (on the gate): {:?}",
        on_a.iter()
            .map(|r| format!("{} {}", r.status, r.body["path"]))
            .collect::<Vec<_>>(),
        on_b.iter()
            .map(|r| format!("{} {}", r.status, r.body["path"]))
            .collect::<Vec<_>>()
    );
    assert!(sold <= 3, "oversold: {sold} admitted for a limit of 3");
    a.shutdown().await;
    b.shutdown().await;
}

/// A drop re-created under its name (new uid, new sale; Kubernetes restarts
/// metadata.generation at 1) while one sidecar still caches the old sale's config
/// (old sale, old limit 10, generation 3). HEAD records that sidecar's gate
/// admission under the OLD sale's ledger key (its epoch 1 matches the old sale's
/// authority row), so the new sale's ledger never counts it; with the uncommitted
/// "sale in the reply" fix it is recorded under the new sale but with the stale
/// limit and generation 3, which moves the new sale's stock row to limit 10 for
/// good (generation 1/2 never moves it back). Either way the fallback then sells
/// more than the new limit of 4.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stale_sidecar_never_records_into_a_re_created_sale() {
    let redis = RedisServer::start().expect("redis-server");
    let postgres = PostgresServer::start().expect("postgres");
    let manifest = |uid: &str, generation: i64, spec: DropSpec| {
        common::manifest("sale", spec).replace(
            "metadata: {name: sale,",
            &format!("metadata: {{uid: {uid}, generation: {generation}, name: sale,"),
        )
    };
    common::apply(&redis.url(), &manifest("first", 3, one_per_buyer(10))).await;
    let fresh = Peer::start(&redis.url(), &postgres.url()).await;
    let stale = Peer::start_with(&redis.url(), &postgres.url(), 600_000).await;
    assert_eq!(fresh.reserve("sale", "o1", "o1", 1).await.status, 201);
    assert_eq!(stale.reserve("sale", "o2", "o2", 1).await.status, 201);

    common::apply(&redis.url(), &manifest("second", 1, one_per_buyer(4))).await;
    for _ in 0..100 {
        let d = fresh.http.get("/v1/drops/sale").await.expect("answers");
        if d.body["limit"] == 4 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let f1 = fresh.reserve("sale", "n1", "n1", 1).await;
    assert_eq!(f1.status, 201, "{}", show(&f1));
    let s1 = stale.reserve("sale", "n2", "n2", 1).await;
    eprintln!("stale sidecar's admission in the new sale: {}", show(&s1));

    // The operator puts the new sale on the fallback (kill switch).
    common::apply(
        &redis.url(),
        &manifest("second", 2, one_per_buyer(4).kill_switch()),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    let rush = buyers(&fresh, "sale", "rush", 10).await;
    let sold = 1 + usize::from(s1.status == 201) + admitted(&rush);
    eprintln!(
        "rush on the fallback: {:?}",
        rush.iter()
            .map(|r| format!("{} {}", r.status, r.outcome()))
            .collect::<Vec<_>>()
    );
    assert!(
        sold <= 4,
        "oversold: {sold} admitted in the new sale for a limit of 4"
    );
    fresh.shutdown().await;
    stale.shutdown().await;
}

/// A marker that lived out its TTL (deadline + 7 days on a sale without an end)
/// and a late retry of the same key: reserve.lua admits it afresh, the ledger's
/// insert conflicts with the old (cancelled) row and is counted as "recorded"
/// (`insert_reservation` false -> moved 0 -> Ok), so the buyer hears 201 for a
/// unit the ledger does not hold; its confirm is "recorded" the same way. The
/// ledger's count then sells that unit again on the fallback.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_retry_after_the_marker_ttl_gets_the_ledgers_answer() {
    let redis = RedisServer::start().expect("redis-server");
    let dir = tempfile::tempdir().expect("temp dir");
    seed(&redis.url(), "sale", one_per_buyer(1)).await;
    let sidecar = Peer::start(&redis.url(), &sqlite_url(&dir, "l.db")).await;
    assert_eq!(sidecar.reserve("sale", "k", "alice", 1).await.status, 201);
    assert_eq!(
        sidecar.settle("sale", "k", "cancel").await.outcome(),
        "cancelled"
    );
    let mut conn = redis.connection().expect("connect");
    let _: () = redis::cmd("DEL")
        .arg(DropKeys::new(NS, "sale").reservation("k"))
        .query(&mut conn)
        .expect("DEL");
    let again = sidecar.reserve("sale", "k", "alice", 1).await;
    let confirm = sidecar.settle("sale", "k", "confirm").await;
    eprintln!("late retry: {}\nconfirm: {}", show(&again), show(&confirm));
    seed(&redis.url(), "sale", one_per_buyer(1).kill_switch()).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let bob = sidecar.reserve("sale", "b", "bob", 1).await;
    eprintln!("bob on the fallback: {}", show(&bob));
    let alice_holds = again.status == 201 && confirm.outcome() == "confirmed";
    assert!(
        !(alice_holds && bob.status == 201),
        "oversold: alice confirmed (201 + 200) and bob admitted, limit 1"
    );
    sidecar.shutdown().await;
}

/// PostgreSQL ledger, fallback path: a request that met a hold overdue decided to
/// expire it on its read, then waited for the row lock of another pod's extension
/// of that hold, and expired it anyway once that committed (its UPDATE checked the
/// state, not the deadline): the buyer heard `extended`, then `expired` at
/// checkout. The expiry now checks the deadline again on the row it waited for.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_expiry_never_lands_on_a_hold_extended_meanwhile() {
    let redis = RedisServer::start().expect("redis-server starts");
    let postgres = PostgresServer::start().expect("PostgreSQL starts");
    // The sweeper off: the confirm is what meets the hold overdue.
    let peer = Peer::start_custom(&redis.url(), &postgres.url(), |settings| {
        settings.sweep_ms = 3_600_000;
    })
    .await;
    seed(
        &redis.url(),
        "held",
        DropSpec::new(5)
            .hold_seconds(3)
            .max_hold_seconds(3600)
            .kill_switch(),
    )
    .await;
    peer.reserve("held", "h1", "hana", 1)
        .await
        .assert_answer(201, "admitted");
    tokio::time::sleep(Duration::from_millis(3_300)).await;

    // Another pod extends the hold; its transaction holds the row until it commits.
    let ledger = dropgate_sidecar::ledger::Ledger::open(&postgres.url())
        .await
        .expect("the ledger");
    let mut extension = ledger.pool().begin().await.expect("BEGIN");
    sqlx::query(
        "UPDATE reservations SET expires_at_ms = expires_at_ms + 600000 \
         WHERE drop_key LIKE $1 AND res_key = $2 AND state = 'active'",
    )
    .bind(format!("{NS}/held/%"))
    .bind("h1")
    .execute(&mut *extension)
    .await
    .expect("the extension's UPDATE");

    // The confirm reads the hold as it was (overdue) and waits for that lock.
    let http = peer.http.clone();
    let confirm = tokio::spawn(async move {
        http.post("/v1/drops/held/reservations/h1/confirm", "")
            .await
            .expect("answers")
    });
    let waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'";
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while sqlx::query_scalar::<_, i64>(waiting)
        .fetch_one(ledger.pool())
        .await
        .expect("pg_stat_activity")
        == 0
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the confirm never waited for the extension's lock"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    extension.commit().await.expect("COMMIT");

    let confirmed = confirm.await.expect("the confirm's task");
    confirmed.assert_answer(200, "confirmed");
    assert_eq!(
        ledger_state(&ledger, "held", "h1").await.as_deref(),
        Some("confirmed"),
        "{}",
        show(&confirmed)
    );
    peer.shutdown().await;
}

/// Redis expires a hold by a deadline the ledger has moved on from (an extension
/// recorded in the ledger that Redis lost: written here straight into the ledger's
/// row), in the look-up that meets it past that deadline. The ledger refuses the
/// expiry, its record is replayed into Redis, where the hold takes its unit
/// again, and the look-up asks again: a buyer who was told the hold runs ten more
/// minutes keeps it, and hears so. (The row's change number is left as it was:
/// the check of Redis after a failover is `stale_expiry.rs`'s.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hold_redis_expires_before_the_deadline_the_ledger_has_is_held_again() {
    let redis = RedisServer::start().expect("redis-server starts");
    let dir = tempfile::tempdir().expect("temp dir");
    let ledger_url = sqlite_url(&dir, "ledger.db");
    // The sweeper off: the look-up is what meets the hold past its deadline.
    let peer = Peer::start_custom(&redis.url(), &ledger_url, |settings| {
        settings.sweep_ms = 3_600_000;
    })
    .await;
    seed(
        &redis.url(),
        "held",
        one_per_buyer(5)
            .hold_seconds(3)
            .acquire_timeout_ms(500)
            .max_hold_seconds(3600),
    )
    .await;
    peer.reserve("held", "h1", "hana", 1)
        .await
        .assert_answer(201, "admitted");
    let ledger = dropgate_sidecar::ledger::Ledger::open(&ledger_url)
        .await
        .expect("the ledger");
    let extended = sqlx::query(
        "UPDATE reservations SET expires_at_ms = expires_at_ms + 600000 \
         WHERE drop_key LIKE $1 AND res_key = $2 AND state = 'active'",
    )
    .bind(format!("{NS}/held/%"))
    .bind("h1")
    .execute(ledger.pool())
    .await
    .expect("the extension's UPDATE");
    assert_eq!(extended.rows_affected(), 1);

    tokio::time::sleep(Duration::from_millis(3_500)).await;
    let looked = peer.lookup("held", "h1").await;
    assert_eq!(looked.body["state"], "active", "{}", show(&looked));
    assert_eq!(
        marker_state(&redis, "held", "h1").as_deref(),
        Some("active")
    );
    assert_eq!(redis_counts(&redis, "held"), (4, 1));
    assert_eq!(
        ledger_state(&ledger, "held", "h1").await.as_deref(),
        Some("active")
    );
    peer.shutdown().await;
}

/// A sale of five units with 3 s holds on one sidecar (its sweeper, which would
/// resolve a dead admission first, does not come by): alice holds a unit, and
/// bob's key `b` holds a dead attempt's admission (pending, overdue at once,
/// never recorded) past its hold.
struct DeadAdmission {
    redis: RedisServer,
    sidecar: Peer,
    gate: common::AsTheSalesLedger,
    ledger_url: String,
    _dir: tempfile::TempDir,
}

impl DeadAdmission {
    async fn past_its_hold() -> Self {
        let redis = RedisServer::start().expect("redis-server starts");
        let dir = tempfile::tempdir().expect("temp dir");
        let ledger_url = sqlite_url(&dir, "ledger.db");
        let sidecar = Peer::start_custom(&redis.url(), &ledger_url, |s| {
            s.sweep_ms = 600_000;
        })
        .await;
        seed(&redis.url(), "sale", one_per_buyer(5).hold_seconds(3)).await;
        // The gate opened, the sale claimed by this sidecar's ledger.
        sidecar
            .reserve("sale", "a", "alice", 1)
            .await
            .assert_answer(201, "admitted");
        let mut gate = common::AsTheSalesLedger::of(&redis.url(), "sale").await;
        let (conn, keys, ledger) = (&mut gate.conn, &gate.keys, &gate.ledger);
        dropgate_sidecar::gate::reserve(conn, keys, ledger, "b", "bob", 1, None, "dead", 1)
            .await
            .expect("the gate admits");
        assert_eq!(
            marker_state(&redis, "sale", "b").as_deref(),
            Some("pending")
        );
        tokio::time::sleep(Duration::from_millis(3_200)).await;
        Self {
            redis,
            sidecar,
            gate,
            ledger_url,
            _dir: dir,
        }
    }

    /// Bob's retry of `b` is admitted afresh: alice's and bob's units held, once.
    async fn retry_is_decided_afresh(self) {
        let retried = self.sidecar.reserve("sale", "b", "bob", 1).await;
        retried.assert_answer(201, "admitted");
        assert_eq!(
            redis_counts(&self.redis, "sale").0,
            3,
            "alice's and bob's units"
        );
        self.sidecar.shutdown().await;
    }

    /// The hold's end met by a sweep that could not reach the ledger to resolve the
    /// admission first (as the sweeper's expiry runs then): bob's unit goes back.
    async fn expired_by_a_sweep_without_the_ledger(mut self) -> Self {
        let gate = &mut self.gate;
        dropgate_sidecar::gate::expire(&mut gate.conn, &gate.keys, &gate.ledger, "b")
            .await
            .expect("the expiry");
        assert_eq!(
            marker_state(&self.redis, "sale", "b").as_deref(),
            Some("expired")
        );
        assert_eq!(redis_counts(&self.redis, "sale").0, 4, "alice's unit held");
        self
    }
}

/// A buyer's reserve left pending past its hold (its sidecar died, or its commit's
/// outcome went unknown, before the ledger recorded it; no sweep has resolved it
/// yet, as when the hold is barely longer than the pending bound): the retry of its
/// key is decided afresh (201), never told of a reservation nobody made durable.
/// Regression: the retry's own step expired the marker first and answered 200
/// `already_reserved`, state `expired`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_of_an_admission_left_pending_past_its_hold_is_decided_afresh() {
    let sale = DeadAdmission::past_its_hold().await;
    sale.retry_is_decided_afresh().await;
}

/// The same admission expired at its hold's end before anything could ask the
/// ledger about it: its unit went back, and the retry of its key is still decided
/// afresh from the ledger (the key claimed, the marker forgotten; nothing given
/// back twice). Regression: it was answered 200 `already_reserved`, state `expired`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_of_an_admission_expired_while_pending_is_decided_afresh() {
    let sale = DeadAdmission::past_its_hold()
        .await
        .expired_by_a_sweep_without_the_ledger()
        .await;
    sale.retry_is_decided_afresh().await;
}

/// An admission expired while pending and never retried: the sweeper resolves it
/// from the ledger once it comes by (here a restarted sidecar's): the key claimed,
/// the marker forgotten (a look-up then finds no reservation), its unit not given
/// back twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admission_expired_while_pending_is_forgotten_by_the_sweeper() {
    let sale = DeadAdmission::past_its_hold()
        .await
        .expired_by_a_sweep_without_the_ledger()
        .await;
    sale.sidecar.shutdown().await;
    let sweeping = Peer::start_custom(&sale.redis.url(), &sale.ledger_url, |s| {
        s.sweep_ms = 100;
    })
    .await;
    // (Its first call checks Redis against the ledger; the sweeper acts only then.)
    sweeping
        .lookup("sale", "a")
        .await
        .assert_answer(200, "found");
    eventually("the sweeper to forget the marker", async || {
        marker_state(&sale.redis, "sale", "b").is_none()
    })
    .await;
    sweeping
        .lookup("sale", "b")
        .await
        .assert_answer(404, "not_found");
    assert_eq!(
        redis_counts(&sale.redis, "sale").0,
        5,
        "alice's hold expired too, bob's unit back once"
    );
    sweeping.shutdown().await;
}

/// helper-113: a fallback sweeper that read who decides before the drop was handed
/// back to the gate expires nothing. The expiry reads the authority in its own
/// transaction; before, it expired a hold the gate had been given back (the ledger
/// counted the unit free while Redis still held it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fallback_sweep_after_the_gate_took_the_drop_back_expires_nothing() {
    use dropgate_sidecar::ledger::{Holder, Ledger};
    let redis = RedisServer::start().expect("redis-server starts");
    let dir = tempfile::tempdir().expect("temp dir");
    let database_url = format!("sqlite://{}", dir.path().join("ledger.db").display());
    // No sweeps of its own: the test sweeps as a stale fallback sweeper would.
    let peer = Peer::start_custom(&redis.url(), &database_url, |settings| {
        settings.sweep_ms = 3_600_000;
    })
    .await;
    seed(
        &redis.url(),
        "brief",
        DropSpec::new(5).hold_seconds(3).kill_switch(),
    )
    .await;
    common::reserve(&peer.http, "brief", "x1", "xena", 1)
        .await
        .assert_answer(201, "admitted");
    let ledger = Ledger::open(&database_url).await.expect("the ledger");
    let drop_key: String =
        sqlx::query_scalar("SELECT drop_key FROM reservations WHERE res_key = 'x1'")
            .fetch_one(ledger.pool())
            .await
            .expect("x1's row");

    // The kill switch off: the gate takes the drop back once Redis holds the
    // fallback's sale (a buyer's request starts it).
    seed(&redis.url(), "brief", DropSpec::new(5).hold_seconds(3)).await;
    let mut i = 0;
    eventually("the gate takes the drop back", async || {
        i += 1;
        common::reserve(
            &peer.http,
            "brief",
            &format!("poke{i}"),
            &format!("p{i}"),
            1,
        )
        .await;
        matches!(
            ledger.authority(&drop_key).await,
            Ok(Some(authority)) if authority.holder == Holder::Gate
        )
    })
    .await;

    // Past x1's hold, a sweep that still believes the ledger decides.
    tokio::time::sleep(Duration::from_millis(3_300)).await;
    let mut conn = redis.connection().expect("connect");
    let fields: std::collections::HashMap<String, String> = redis::cmd("HGETALL")
        .arg(DropKeys::new(NS, "brief").config())
        .query(&mut conn)
        .expect("HGETALL");
    let config = dropgate_api::DropConfig::from_fields(&fields)
        .expect("a config")
        .expect("seeded");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as i64;
    let expired = ledger
        .expire_due(&drop_key, &config, now, 10)
        .await
        .expect("the sweep runs");
    assert!(
        expired.is_empty(),
        "the fallback's sweeper expired {expired:?} while the gate decides"
    );
    let state: String = sqlx::query_scalar("SELECT state FROM reservations WHERE res_key = 'x1'")
        .fetch_one(ledger.pool())
        .await
        .expect("x1's row");
    assert_eq!(
        state, "active",
        "the gate's sweeper expires it, and records it"
    );
    peer.shutdown().await;
}
