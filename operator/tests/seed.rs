//! Seeding, restock, idempotence, cleanup and the HA check against real Redis.

use dropgate_api::keys::Claims;
use dropgate_api::{DropKeys, Mode, Phase, Tier};
use dropgate_operator::memorystore::Memorystore;
use dropgate_operator::reconcile::Reconciled;
use dropgate_operator::{Error, store};
use dropgate_testkit::RedisServer;
use redis::Commands;

fn manifest(spec: &str) -> String {
    format!(
        "apiVersion: dropgate.io/v1alpha1\nkind: InventoryDrop\nmetadata: {{name: sale, namespace: shop}}\nspec:\n  sku: SNKR\n{spec}\n  redis: {{url: redis://ignored:1}}\n"
    )
}

/// `apply` as the command line runs it; no drop here names a Memorystore instance.
async fn apply(manifest: &str, redis_url: Option<&str>) -> Result<Reconciled, Error> {
    dropgate_operator::apply::apply(manifest, redis_url, &Memorystore::default()).await
}

fn keys() -> DropKeys {
    DropKeys::new("shop", "sale")
}

/// Takes `units` out of stock the way an admission does, without a sidecar.
fn hold(redis: &RedisServer, units: i64) {
    let mut conn = redis.connection().expect("connect");
    let _: () = conn.decr(keys().remaining(), units).expect("DECRBY");
    let _: () = conn.incr(keys().held(), units).expect("INCRBY");
}

fn remaining(redis: &RedisServer) -> i64 {
    redis
        .connection()
        .expect("connect")
        .get(keys().remaining())
        .expect("GET")
}

#[tokio::test]
async fn seeding_is_idempotent_and_restock_moves_by_the_difference() {
    let redis = RedisServer::start().expect("redis");
    let url = redis.url();
    let first = apply(&manifest("  limitedQuantity: 100"), Some(&url))
        .await
        .expect("seeds");
    assert_eq!(first.status.remaining, Some(100));
    assert_eq!(first.status.mode, Some(Mode::Gate));
    assert_eq!(first.status.phase, Phase::Active);
    assert_eq!(first.previous_mode, None);

    hold(&redis, 30);
    let again = apply(&manifest("  limitedQuantity: 100"), Some(&url))
        .await
        .expect("re-applies");
    assert_eq!(again.status.remaining, Some(70), "a repeat moves nothing");
    assert_eq!(again.status.reserved, Some(30));
    assert!(!again.mode_changed());

    let up = apply(&manifest("  limitedQuantity: 150"), Some(&url))
        .await
        .expect("restocks");
    assert_eq!(up.status.remaining, Some(120));
    let down = apply(&manifest("  limitedQuantity: 90"), Some(&url))
        .await
        .expect("cuts");
    assert_eq!(down.status.remaining, Some(60));

    // Below what is held: remaining reads 0, the deficit is paid back first.
    let cut = apply(&manifest("  limitedQuantity: 20"), Some(&url))
        .await
        .expect("cuts deep");
    assert_eq!(cut.status.remaining, Some(0));
    assert_eq!(remaining(&redis), -10);
    let seeded = cut
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == "Seeded")
        .expect("Seeded");
    assert_eq!(seeded.reason, "LimitBelowHeld");
    assert_eq!(cut.status.phase, Phase::SoldOut);
    let same = apply(&manifest("  limitedQuantity: 20"), Some(&url))
        .await
        .expect("repeat");
    assert_eq!(remaining(&redis), -10, "a repeated cut moves nothing");
    assert_eq!(same.status.remaining, Some(0));
}

#[tokio::test]
async fn the_kill_switch_publishes_fail_open_and_back() {
    let redis = RedisServer::start().expect("redis");
    let url = redis.url();
    apply(&manifest("  limitedQuantity: 5"), Some(&url))
        .await
        .expect("seeds");
    let off = apply(
        &manifest("  limitedQuantity: 5\n  gate: {enabled: false}"),
        Some(&url),
    )
    .await
    .expect("kill switch is a reached state");
    assert_eq!(off.status.mode, Some(Mode::FailOpen));
    assert!(off.status.fail_open);
    assert!(off.mode_changed());
    assert!(off.not_ready.is_none());
    let mut conn = redis.connection().expect("connect");
    let mode: String = conn.hget(keys().config(), "mode").expect("HGET");
    assert_eq!(mode, "fail-open");
    let on = apply(&manifest("  limitedQuantity: 5"), Some(&url))
        .await
        .expect("back on");
    assert_eq!(on.previous_mode, Some(Mode::FailOpen));
    assert_eq!(on.status.mode, Some(Mode::Gate));
}

#[tokio::test]
async fn required_ha_on_a_standalone_redis_publishes_the_policy_then_fails() {
    let redis = RedisServer::start().expect("redis");
    let url = redis.url();
    let spec = "  limitedQuantity: 5\n  gate: {failurePolicy: Closed}";
    let text = manifest(spec).replace(
        "redis: {url: redis://ignored:1}",
        "redis: {url: redis://ignored:1, requireHighAvailability: true}",
    );
    let done = apply(&text, Some(&url)).await.expect("reconciles");
    assert_eq!(done.status.tier, Some(Tier::Standalone));
    assert_eq!(done.status.mode, Some(Mode::Closed));
    assert!(matches!(
        done.not_ready,
        Some(Error::HighAvailabilityMissing(_))
    ));
    let mode: String = redis
        .connection()
        .expect("c")
        .hget(keys().config(), "mode")
        .expect("HGET");
    assert_eq!(mode, "closed");
}

#[tokio::test]
async fn a_real_replica_makes_the_master_replicated() {
    let master = RedisServer::start().expect("master");
    let replica = RedisServer::start_replica_of(&master).expect("replica");
    let text = manifest("  limitedQuantity: 5").replace(
        "redis: {url: redis://ignored:1}",
        "redis: {url: redis://ignored:1, requireHighAvailability: true}",
    );
    let mut tier = None;
    for _ in 0..100 {
        let done = apply(&text, Some(&master.url())).await.expect("reconciles");
        if done.status.tier == Some(Tier::Replicated) {
            assert_eq!(done.status.mode, Some(Mode::Gate));
            assert!(done.not_ready.is_none());
            tier = done.status.tier;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(tier, Some(Tier::Replicated), "the replica came online");
    drop(replica);
}

#[tokio::test]
async fn removing_a_drop_deletes_every_key() {
    let redis = RedisServer::start().expect("redis");
    apply(&manifest("  limitedQuantity: 5"), Some(&redis.url()))
        .await
        .expect("seeds");
    let mut conn = redis.connection().expect("connect");
    let _: () = conn
        .hset(keys().reservation("k"), "state", "active")
        .expect("marker");
    // A waitlist's line, entry, counts and counter.
    let _: () = conn.zadd(keys().waitlist_line(""), "w", 1).expect("line");
    let _: () = conn
        .hset(keys().waitlist_entry("w"), "state", "waiting")
        .expect("entry");
    let _: () = conn.hset(keys().waitlist_users(), "u", 1).expect("users");
    let _: () = conn.set(keys().waitlist_counter(), 1).expect("counter");
    let _: () = conn.set("unrelated", 1).expect("other key");
    let mut manager = store::connect(&redis.url(), false).await.expect("connects");
    store::remove(&mut manager, &keys()).await.expect("removes");
    let mut left: Vec<String> = conn.keys("*").expect("KEYS");
    left.sort();
    // The deletion tombstone stays (it expires): sidecars read it as "deleted".
    assert_eq!(left, vec![keys().deleted(), "unrelated".to_string()]);
}

#[tokio::test]
async fn unreachable_redis_and_bad_manifests_are_clear_errors() {
    let port = dropgate_testkit::free_port().expect("port");
    let down = apply(
        &manifest("  limitedQuantity: 5"),
        Some(&format!("redis://127.0.0.1:{port}")),
    )
    .await;
    assert!(
        matches!(down, Err(Error::RedisUnavailable { .. })),
        "{down:?}"
    );

    let boolean = apply(&manifest("  limitedQuantity: true"), None).await;
    let message = boolean.expect_err("refused").to_string();
    assert!(message.contains("limitedQuantity"), "{message}");
    let negative = apply(&manifest("  limitedQuantity: -1"), None).await;
    assert!(
        negative
            .expect_err("refused")
            .to_string()
            .contains("limitedQuantity")
    );
    let kind = apply(
        &manifest("  limitedQuantity: 1").replace("kind: InventoryDrop", "kind: Pod"),
        None,
    )
    .await;
    assert!(
        kind.expect_err("refused")
            .to_string()
            .contains("InventoryDrop")
    );
}

#[tokio::test]
async fn a_stale_config_is_refused_and_changes_nothing() {
    let redis = RedisServer::start().expect("redis");
    let mut conn = store::connect(&redis.url(), false).await.expect("connects");
    let at_generation = |generation: i64, limit: i64| {
        let mut drop = dropgate_operator::apply::parse_manifest(&manifest(&format!(
            "  limitedQuantity: {limit}"
        )))
        .expect("manifest");
        drop.metadata.uid = Some("0d6c3a52-4b8e-4d7a-9a63-5d2f3e1b7a10".into());
        drop.metadata.generation = Some(generation);
        dropgate_operator::decide::config(&drop, Mode::Gate)
    };
    store::seed(
        &mut conn,
        &keys(),
        &at_generation(3, 100),
        CREATED,
        None,
        Claims::Recorded,
    )
    .await
    .expect("seeds");
    // A replica that lost its Lease still holds generation 2 (limit 500).
    let stale = store::seed(
        &mut conn,
        &keys(),
        &at_generation(2, 500),
        CREATED,
        None,
        Claims::Recorded,
    )
    .await
    .expect_err("refused");
    assert!(matches!(stale, Error::StaleConfig(_)), "{stale}");
    assert!(
        stale.to_string().contains("published generation 3"),
        "{stale}"
    );
    assert_eq!(remaining(&redis), 100);
    let limit: String = redis
        .connection()
        .expect("connect")
        .hget(keys().config(), "limit")
        .expect("HGET");
    assert_eq!(limit, "100");
    // The same generation again, and a newer one, are written.
    store::seed(
        &mut conn,
        &keys(),
        &at_generation(3, 100),
        CREATED,
        None,
        Claims::Recorded,
    )
    .await
    .expect("same generation");
    store::seed(
        &mut conn,
        &keys(),
        &at_generation(4, 120),
        CREATED,
        None,
        Claims::Recorded,
    )
    .await
    .expect("newer");
    assert_eq!(remaining(&redis), 120);
}

/// When the test drops' objects were created (ms).
const CREATED: Option<i64> = Some(1_796_000_000_000);

#[tokio::test]
async fn writers_that_would_wipe_or_roll_back_a_sale_are_refused() {
    let redis = RedisServer::start().expect("redis");
    let mut conn = store::connect(&redis.url(), false).await.expect("connects");
    let config = |uid: Option<&str>, generation: i64, limit: i64| {
        let mut drop = dropgate_operator::apply::parse_manifest(&manifest(&format!(
            "  limitedQuantity: {limit}"
        )))
        .expect("manifest");
        drop.metadata.uid = uid.map(String::from);
        drop.metadata.generation = Some(generation);
        dropgate_operator::decide::config(&drop, Mode::Gate)
    };
    let (old_uid, new_uid) = (
        Some("0d6c3a52-4b8e-4d7a-9a63-5d2f3e1b7a10"),
        Some("7f0e9b1c-2a3d-4e5f-8a9b-0c1d2e3f4a5b"),
    );
    let later = CREATED.map(|t| t + 60_000);
    // Kubernetes publishes the re-created drop (created a minute later).
    store::seed(
        &mut conn,
        &keys(),
        &config(new_uid, 1, 5),
        later,
        None,
        Claims::Recorded,
    )
    .await
    .expect("seeds");
    hold(&redis, 3);
    let refused = |e: Result<_, Error>| matches!(e, Err(Error::StaleConfig(_)));
    // The old incarnation's stale writer, whatever its generation.
    assert!(refused(
        store::seed(
            &mut conn,
            &keys(),
            &config(old_uid, 7, 100),
            CREATED,
            None,
            Claims::Recorded
        )
        .await
    ));
    // apply -f of a manifest without a uid: would start the sale over.
    assert!(refused(
        store::seed(
            &mut conn,
            &keys(),
            &config(None, 0, 100),
            None,
            None,
            Claims::Immediate
        )
        .await
    ));
    // apply -f of an export with the uid but no generation.
    assert!(refused(
        store::seed(
            &mut conn,
            &keys(),
            &config(new_uid, 0, 100),
            None,
            None,
            Claims::Immediate
        )
        .await
    ));
    assert_eq!(remaining(&redis), 2, "the running sale is untouched");
    // Its next generation is written.
    store::seed(
        &mut conn,
        &keys(),
        &config(new_uid, 2, 6),
        later,
        None,
        Claims::Recorded,
    )
    .await
    .expect("newer generation");
    assert_eq!(remaining(&redis), 3);
}

#[tokio::test]
async fn moving_the_end_moves_every_key_s_expiry_in_the_same_step() {
    let redis = RedisServer::start().expect("redis");
    let url = redis.url();
    let mut conn = redis.connection().expect("connect");
    let ends = |at: &str| manifest(&format!("  limitedQuantity: 10\n  endsAt: {at}"));
    apply(&ends("2030-01-01T00:00:00Z"), Some(&url))
        .await
        .expect("seeds");
    // A buyer's count and a hold, as an admission leaves them.
    let _: () = conn.hincr(keys().buyers(), "alice", 1).expect("HINCRBY");
    let _: () = redis::cmd("ZADD")
        .arg(keys().holds())
        .arg(1)
        .arg("k")
        .query(&mut conn)
        .expect("ZADD");
    hold(&redis, 1);
    let expiry = |conn: &mut redis::Connection, key: String| -> i64 {
        redis::cmd("PEXPIRETIME")
            .arg(key)
            .query(conn)
            .expect("PEXPIRETIME")
    };
    let state_keys = || {
        [
            keys().remaining(),
            keys().held(),
            keys().buyers(),
            keys().holds(),
        ]
    };
    let before = expiry(&mut conn, keys().remaining());
    assert!(before > 0);
    apply(&ends("2031-01-01T00:00:00Z"), Some(&url))
        .await
        .expect("moves the end");
    let moved: Vec<i64> = state_keys()
        .into_iter()
        .map(|k| expiry(&mut conn, k))
        .collect();
    assert!(
        moved.iter().all(|t| *t == moved[0] && *t > before),
        "{moved:?}"
    );

    apply(&manifest("  limitedQuantity: 10"), Some(&url))
        .await
        .expect("removes the end");
    let removed: Vec<i64> = state_keys()
        .into_iter()
        .map(|k| expiry(&mut conn, k))
        .collect();
    assert_eq!(
        removed,
        [-1, -1, -1, -1],
        "no end: the keys live with the drop"
    );
    let bought: i64 = conn.hget(keys().buyers(), "alice").expect("HGET");
    assert_eq!(bought, 1, "the per-user count survived every move");
}
