//! Drops on a real Redis Cluster (three primaries with a replica each, on loopback
//! ports): `dropgate-operator apply` seeds and checks them, one `dropgate-sidecar
//! --redis-cluster` sells them, and every drop's script runs on its own shard.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use dropgate_api::DropKeys;
use dropgate_e2e::processes::{SidecarProcess, binary};
use dropgate_testkit::{DropSpec, HttpClient, RedisCluster, Reply};
use futures::future::join_all;

/// One cluster at a time: each test runs six redis-servers and a sidecar, and two
/// at once on a 2-core machine starve the failovers' timing.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const LIMIT: usize = 100;
const BUYERS: usize = 500;
/// Enough drops that their hash tags land on all three shards.
const DROPS: usize = 6;

fn drop_name(i: usize) -> String {
    format!("drop-{i}")
}

/// An InventoryDrop manifest for `shop/<name>` on the cluster, with `spec`'s lines.
fn manifest(dir: &Path, name: &str, spec: &DropSpec) -> PathBuf {
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(
        &path,
        format!(
            "apiVersion: dropgate.io/v1alpha1\nkind: InventoryDrop\nmetadata: {{name: {name}, namespace: shop}}\n\
             spec:\n  redis: {{url: redis://unused:1, cluster: true, requireHighAvailability: true}}\n{}",
            spec.yaml()
        ),
    )
    .expect("manifest");
    path
}

/// `dropgate-operator apply` against the cluster: its exit status and its output.
fn apply(manifest: &Path, cluster: &RedisCluster) -> (bool, String) {
    apply_to(manifest, &cluster.url())
}

/// `dropgate-operator apply` with `--redis-url url`: its exit status and its output.
fn apply_to(manifest: &Path, url: &str) -> (bool, String) {
    let out = Command::new(binary("dropgate-operator"))
        .arg("apply")
        .arg("-f")
        .arg(manifest)
        .args(["--redis-url", url])
        .output()
        .expect("run dropgate-operator");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

async fn reserve(http: &HttpClient, drop: &str, buyer: usize) -> Reply {
    let body = format!(r#"{{"key":"k{buyer}","user":"u{buyer}","quantity":1}}"#);
    http.post(&format!("/v1/drops/{drop}/reservations"), &body)
        .await
        .expect("reserve")
}

/// Waits until the sidecar's `/metrics` says every drop has `remaining` left.
async fn remaining_on_metrics(http: &HttpClient, remaining: usize) {
    let expected: Vec<String> = (0..DROPS)
        .map(|d| {
            format!(
                "dropgate_sidecar_remaining{{drop=\"{}\"}} {remaining}",
                drop_name(d)
            )
        })
        .collect();
    let mut text = String::new();
    for _ in 0..100 {
        text = http.get("/metrics").await.expect("/metrics").text;
        if expected.iter().all(|line| text.lines().any(|l| l == line)) {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let seen: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("dropgate_sidecar_remaining"))
        .collect();
    panic!("/metrics never said {expected:?}; it says {seen:?}");
}

/// The test's own connection to the cluster `seed` is a node of, through
/// dropgate's cluster client.
async fn connect(seed: &str) -> dropgate_redis::Connection {
    dropgate_redis::Connection::cluster(
        seed,
        std::time::Duration::from_secs(2),
        std::time::Duration::from_secs(5),
    )
    .await
    .expect("a cluster connection")
}

/// A key named `{prefix}:{{...}}` whose slot another primary serves than `key`'s.
fn key_on_another_shard(cluster: &RedisCluster, key: &str, prefix: &str) -> String {
    let primary_port = |key: &str| cluster.primary_of(key).expect("a primary").port();
    (0..100)
        .map(|i| format!("{prefix}:{{elsewhere-{i}}}"))
        .find(|other| primary_port(other) != primary_port(key))
        .expect("a key on another shard")
}

/// A drop's `remaining` and `held` as the cluster holds them.
async fn stock(conn: &mut dropgate_redis::Connection, drop: &str) -> (i64, i64) {
    let keys = DropKeys::new("shop", drop);
    let remaining: i64 = redis::cmd("GET")
        .arg(keys.remaining())
        .query_async(conn)
        .await
        .expect("GET remaining");
    // No `held` key is none held (a gate opening rebuilds it only from units held).
    let held: Option<i64> = redis::cmd("GET")
        .arg(keys.held())
        .query_async(conn)
        .await
        .expect("GET held");
    (remaining, held.unwrap_or(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sale_spread_over_three_shards_sells_each_drop_exactly_once() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let cluster = RedisCluster::start().expect("a local Redis Cluster");
    let dir = tempfile::tempdir().expect("dir");
    let spec = DropSpec::new(LIMIT as i64).permits(1000);
    for i in 0..DROPS {
        let (ready, out) = apply(&manifest(dir.path(), &drop_name(i), &spec), &cluster);
        assert!(ready, "apply on the cluster: {out}");
        assert!(out.contains("mode: gate"), "{out}");
        assert!(
            out.contains("ClusterReplicated"),
            "the shards' HA check: {out}"
        );
    }
    // The drops' slots are spread over every shard.
    let shards: HashSet<u16> = (0..DROPS)
        .map(|i| {
            let config = DropKeys::new("shop", &drop_name(i)).config();
            cluster
                .primary_of(&config)
                .expect("a primary serves it")
                .port()
        })
        .collect();
    assert_eq!(shards.len(), 3, "the drops sit on every shard: {shards:?}");
    // Every primary is asked for its eviction policy: one that evicts, on a shard
    // other than the drop's, is still reported.
    let config = DropKeys::new("shop", &drop_name(0)).config();
    let own = cluster.primary_of(&config).expect("a primary").port();
    let evicting = shards
        .iter()
        .find(|&&port| port != own)
        .and_then(|&port| cluster.nodes.iter().find(|n| n.port() == port))
        .expect("another shard's primary");
    let set_policy = |policy: &str| {
        redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory-policy")
            .arg(policy)
            .query::<()>(&mut evicting.connection().expect("connect"))
            .expect("CONFIG SET");
    };
    set_policy("allkeys-lru");
    let (ready, out) = apply(&manifest(dir.path(), &drop_name(0), &spec), &cluster);
    assert!(ready, "{out}");
    assert!(out.contains("maxmemory-policy is allkeys-lru"), "{out}");
    set_policy("noeviction");

    let ledger = format!("sqlite://{}", dir.path().join("ledger.db").display());
    let sidecar = SidecarProcess::start_with(&cluster.url(), "shop", &ledger, &["--redis-cluster"])
        .await
        .expect("sidecar on the cluster");
    let http = HttpClient::new(sidecar.base.clone());
    // Every drop's rush at once: 500 buyers for 100 units each.
    let rush = join_all((0..DROPS).flat_map(|d| {
        let http = http.clone();
        (0..BUYERS).map(move |b| {
            let http = http.clone();
            async move { (d, b, reserve(&http, &drop_name(d), b).await) }
        })
    }))
    .await;
    let mut admitted: HashMap<usize, Vec<usize>> = HashMap::new();
    for (d, b, reply) in &rush {
        match reply.status.as_u16() {
            201 => admitted.entry(*d).or_default().push(*b),
            409 => reply.assert_answer(409, "sold_out"),
            503 => reply.assert_answer(503, "throttled"),
            _ => panic!("drop {d} buyer {b}: {}", reply.text),
        }
    }
    let mut conn = connect(&cluster.url()).await;
    for d in 0..DROPS {
        let sold = admitted.get(&d).map_or(0, Vec::len);
        assert_eq!(sold, LIMIT, "drop {d} sold {sold} of {LIMIT}");
        assert_eq!(stock(&mut conn, &drop_name(d)).await, (0, LIMIT as i64));
    }

    // Retries of admitted keys are the same reservation; cancels return units once.
    for d in 0..DROPS {
        let name = drop_name(d);
        let buyers = &admitted[&d][..10];
        for &b in buyers {
            reserve(&http, &name, b)
                .await
                .assert_answer(200, "already_reserved");
            for expected in ["cancelled", "already_cancelled"] {
                http.post(&format!("/v1/drops/{name}/reservations/k{b}/cancel"), "")
                    .await
                    .expect("cancel")
                    .assert_answer(200, expected);
            }
        }
        assert_eq!(stock(&mut conn, &name).await, (10, LIMIT as i64 - 10));
        let kept = admitted[&d][10];
        for expected in ["confirmed", "already_confirmed"] {
            http.post(
                &format!("/v1/drops/{name}/reservations/k{kept}/confirm"),
                "",
            )
            .await
            .expect("confirm")
            .assert_answer(200, expected);
        }
    }

    // `/metrics` reads every drop's count at once (one MGET, split by slot).
    remaining_on_metrics(&http, 10).await;

    // Locks live on the cluster too, each in its own slot.
    for name in ["packing-slip", "refunds", "nightly-export"] {
        let taken = http
            .post(
                &format!("/v1/locks/{name}"),
                r#"{"owner":"worker-1","ttlMs":5000,"waitMs":0}"#,
            )
            .await
            .expect("acquire");
        taken.assert_answer(200, "acquired");
        let token = taken.body["token"].as_str().unwrap_or_default().to_string();
        let renew = format!(r#"{{"token":"{token}","ttlMs":5000}}"#);
        http.post(&format!("/v1/locks/{name}/renew"), &renew)
            .await
            .expect("renew")
            .assert_answer(200, "renewed");
        http.request(
            warp::http::Method::DELETE,
            &format!("/v1/locks/{name}"),
            Some(&format!(r#"{{"token":"{token}"}}"#)),
        )
        .await
        .expect("release")
        .assert_answer(200, "released");
    }

    // The kill switch of one drop sends it to the fallback path; the others keep
    // the gate.
    let switched = manifest(dir.path(), &drop_name(0), &spec.clone().kill_switch());
    assert!(apply(&switched, &cluster).0);
    let mut fallback = None;
    for attempt in 0..100 {
        let reply = reserve(&http, &drop_name(0), 10_000 + attempt).await;
        if reply.headers.get("dropgate-path").is_some() {
            fallback = Some(reply);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let fallback = fallback.expect("the kill switch reached the sidecar");
    assert_eq!(fallback.body["path"], "fallback", "{}", fallback.text);
    let other = reserve(&http, &drop_name(1), 10_000).await;
    other.assert_answer(201, "admitted");
    assert_eq!(other.body["path"], "gate", "{}", other.text);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_without_a_replica_fails_the_ha_check() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let mut cluster = RedisCluster::start().expect("a local Redis Cluster");
    let dir = tempfile::tempdir().expect("dir");
    let replica = cluster
        .replica_of(cluster.nodes[0].port())
        .expect("the first primary's replica");
    cluster.nodes[replica].stop();
    // Every running node marks it failed (CLUSTER NODES' `fail` flag) after the
    // node timeout; the operator may ask any of them.
    cluster
        .wait_until(std::time::Duration::from_secs(30), |cluster| {
            cluster.nodes.iter().enumerate().all(|(i, node)| {
                i == replica
                    || node.connection().is_ok_and(|mut conn| {
                        redis::cmd("CLUSTER")
                            .arg("NODES")
                            .query::<String>(&mut conn)
                            .is_ok_and(|nodes| {
                                nodes.lines().any(|l| {
                                    l.contains("slave,fail ") || l.contains("replica,fail ")
                                })
                            })
                    })
            })
        })
        .expect("the cluster sees the replica gone");
    let (ready, out) = apply(&manifest(dir.path(), "sale", &DropSpec::new(10)), &cluster);
    assert!(
        !ready,
        "a shard without a replica is not highly available: {out}"
    );
    assert!(out.contains("ClusterShardWithoutReplica"), "{out}");
}

/// A buyer who retries the same key after a 503 (as `Retry-After` asks) until
/// the answer is final: the answer, and how many 503s it took.
async fn buy(http: &HttpClient, drop: &str, buyer: usize) -> (Reply, usize) {
    let mut unavailable = 0;
    loop {
        let reply = reserve(http, drop, buyer).await;
        if reply.status.as_u16() != 503 || unavailable >= 300 {
            return (reply, unavailable);
        }
        unavailable += 1;
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_shard_failover_mid_sale_oversells_nothing_and_pauses_no_other_shard() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let mut cluster = RedisCluster::start().expect("a local Redis Cluster");
    let dir = tempfile::tempdir().expect("dir");
    let spec = DropSpec::new(LIMIT as i64).permits(1000);
    let mut primary = Vec::new();
    for i in 0..DROPS {
        let (ready, out) = apply(&manifest(dir.path(), &drop_name(i), &spec), &cluster);
        assert!(ready, "{out}");
        let config = DropKeys::new("shop", &drop_name(i)).config();
        primary.push(cluster.primary_of(&config).expect("a primary").port());
    }
    // The shard of drop-0 fails over; the drops elsewhere must not notice.
    let victim = primary[0];
    let on_victim: Vec<usize> = (0..DROPS).filter(|&d| primary[d] == victim).collect();
    let elsewhere: Vec<usize> = (0..DROPS).filter(|&d| primary[d] != victim).collect();
    assert!(!elsewhere.is_empty(), "drops on other shards: {primary:?}");

    let ledger = format!("sqlite://{}", dir.path().join("ledger.db").display());
    let sidecar = SidecarProcess::start_with(&cluster.url(), "shop", &ledger, &["--redis-cluster"])
        .await
        .expect("sidecar on the cluster");
    let http = HttpClient::new(sidecar.base.clone());

    let victim_index = cluster
        .nodes
        .iter()
        .position(|n| n.port() == victim)
        .expect("the victim is a node");
    // Units the failing shard's drops sold so far: the failover waits for a few.
    let sold_on_victim = std::sync::atomic::AtomicUsize::new(0);
    let rush = join_all((0..DROPS).flat_map(|d| {
        let http = http.clone();
        let (on_victim, sold_on_victim) = (&on_victim, &sold_on_victim);
        (0..BUYERS).map(move |b| {
            let http = http.clone();
            async move {
                // Spread over the failover: a buyer every few milliseconds.
                tokio::time::sleep(std::time::Duration::from_millis((b * 6) as u64)).await;
                let (reply, retries) = buy(&http, &drop_name(d), b).await;
                if on_victim.contains(&d) && reply.status.as_u16() == 201 {
                    sold_on_victim.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                (d, b, reply, retries, std::time::Instant::now())
            }
        })
    }));
    let failover = async {
        // Early in the rush (most of the units are sold after the promotion), once
        // the shard's drops have sold a few: then it is mid-sale, however long the
        // sidecar took to answer the first buyers.
        let give_up = std::time::Instant::now() + std::time::Duration::from_secs(15);
        while sold_on_victim.load(std::sync::atomic::Ordering::Relaxed) < 10
            && std::time::Instant::now() < give_up
        {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        cluster.nodes[victim_index].stop();
        std::time::Instant::now()
    };
    let (answers, stopped) = tokio::join!(rush, failover);

    let mut sold: HashMap<usize, usize> = HashMap::new();
    let mut paused: HashMap<usize, usize> = HashMap::new();
    let mut fell_back = 0;
    // Units of the failing shard's drops admitted before its primary stopped and
    // after: the failover happened mid-sale.
    let (mut before, mut after) = (0, 0);
    for (d, b, reply, retries, answered) in &answers {
        if on_victim.contains(d) && reply.status.as_u16() == 201 {
            if *answered < stopped {
                before += 1;
            } else {
                after += 1;
            }
        }
        *paused.entry(*d).or_default() += retries;
        match reply.status.as_u16() {
            201 => {
                // Drops on the other shards sell through the gate throughout. One on
                // the failing shard may move to this sidecar's ledger (failurePolicy
                // Open, and its per-pod ledger is the sale's alone): under load a
                // connection to that shard can break before the node stops too.
                if !on_victim.contains(d) {
                    assert_eq!(reply.body["path"], "gate", "drop {d}: {}", reply.text);
                } else if reply.body["path"] == "fallback" {
                    fell_back += 1;
                }
                *sold.entry(*d).or_default() += 1
            }
            409 => reply.assert_answer(409, "sold_out"),
            _ => panic!("drop {d} buyer {b} after {retries} retries: {}", reply.text),
        }
    }
    for (d, port) in primary.iter().enumerate() {
        let sold = sold.get(&d).copied().unwrap_or(0);
        assert_eq!(
            sold, LIMIT,
            "drop {d} (primary {port}) sold {sold} of {LIMIT}"
        );
    }
    for d in &elsewhere {
        assert_eq!(
            paused.get(d).copied().unwrap_or(0),
            0,
            "drop {d} on another shard heard 503 during the failover of {victim}"
        );
    }
    let mut conn = connect(&cluster.url()).await;
    for d in 0..DROPS {
        assert_eq!(
            stock(&mut conn, &drop_name(d)).await,
            (0, LIMIT as i64),
            "drop {d}"
        );
    }
    assert!(
        before > 0 && after > 0,
        "the failover happened mid-sale: its drops sold {before} units before the primary stopped and {after} after"
    );
    // How the failover showed (503s until the promotion, a move to the ledger, or
    // nothing: the cluster client's retries can span a quick promotion) varies.
    let waited: usize = on_victim.iter().map(|d| paused[d]).sum();
    println!(
        "failover of {victim}: drops {on_victim:?} sold {before} units before it and {after} after, answered 503 {waited} times and {fell_back} from the ledger meanwhile; drops {elsewhere:?} never paused"
    );
}

/// On a cluster, Redis refuses a script whose keys (declared or not) are in more
/// than one slot: every gate script, read and sweep a sidecar makes, and the
/// operator's cleanup, run once against a drop on the cluster without an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_script_and_command_of_a_drop_stays_in_its_slot() {
    let _turn = ONE_AT_A_TIME.lock().await;
    use dropgate_sidecar::gate;
    let cluster = RedisCluster::start().expect("a local Redis Cluster");
    let dir = tempfile::tempdir().expect("dir");
    let (ready, out) = apply(&manifest(dir.path(), "sale", &DropSpec::new(10)), &cluster);
    assert!(ready, "{out}");
    let mut conn = connect(&cluster.url()).await;
    let keys = DropKeys::new("shop", "sale");
    let c = &mut conn;
    let in_one_slot = |what: &str, error: redis::RedisError| -> ! {
        panic!("{what} failed on the cluster: {error}")
    };
    let seq = gate::standing(c, &keys, Some("k"), None)
        .await
        .unwrap_or_else(|e| in_one_slot("standing", e))
        .seq;
    gate::claim(c, &keys, "ledger-a", "ledger-a")
        .await
        .unwrap_or_else(|e| in_one_slot("claim", e));
    gate::open(c, &keys, "ledger-a", 1, seq)
        .await
        .unwrap_or_else(|e| in_one_slot("open", e));
    for key in ["k1", "k2", "k3", "k4", "k5", "k7"] {
        gate::reserve(
            c,
            &keys,
            "ledger-a",
            key,
            key,
            1,
            None,
            &format!("a-{key}"),
            60_000,
        )
        .await
        .unwrap_or_else(|e| in_one_slot("reserve", e));
    }
    gate::activate(c, &keys, "ledger-a", "k1", "a-k1")
        .await
        .unwrap_or_else(|e| in_one_slot("activate", e));
    gate::lookup(c, &keys, "ledger-a", "k1")
        .await
        .unwrap_or_else(|e| in_one_slot("lookup", e));
    let confirm = gate::Settling::Confirm { quantity: None };
    let cancel = gate::Settling::Cancel;
    gate::prepare(c, &keys, "ledger-a", "k1", confirm, "s-k1", 2_000)
        .await
        .unwrap_or_else(|e| in_one_slot("prepare a confirm", e));
    gate::finish(c, &keys, "ledger-a", "k1", "s-k1")
        .await
        .unwrap_or_else(|e| in_one_slot("finish", e));
    gate::activate(c, &keys, "ledger-a", "k2", "a-k2")
        .await
        .unwrap_or_else(|e| in_one_slot("activate", e));
    gate::prepare(c, &keys, "ledger-a", "k2", cancel, "s-k2", 2_000)
        .await
        .unwrap_or_else(|e| in_one_slot("prepare a cancel", e));
    gate::abort(c, &keys, "ledger-a", "k2", "s-k2")
        .await
        .unwrap_or_else(|e| in_one_slot("abort", e));
    gate::activate(c, &keys, "ledger-a", "k3", "a-k3")
        .await
        .unwrap_or_else(|e| in_one_slot("activate", e));
    gate::expire(c, &keys, "ledger-a", "k3")
        .await
        .unwrap_or_else(|e| in_one_slot("expire", e));
    gate::undo(c, &keys, "ledger-a", "k4", "a-k4")
        .await
        .unwrap_or_else(|e| in_one_slot("undo", e));
    gate::abandon(c, &keys, "ledger-a", "k5", "a-k5")
        .await
        .unwrap_or_else(|e| in_one_slot("abandon", e));
    gate::unresolved(c, &keys, "k7")
        .await
        .unwrap_or_else(|e| in_one_slot("unresolved", e));
    gate::overdue(c, &keys, i64::MAX, 10)
        .await
        .unwrap_or_else(|e| in_one_slot("overdue", e));
    gate::due_holds(c, &keys, i64::MAX, 10)
        .await
        .unwrap_or_else(|e| in_one_slot("due_holds", e));
    gate::remaining(c, &keys)
        .await
        .unwrap_or_else(|e| in_one_slot("remaining", e));
    let sale: String = redis::cmd("HGET")
        .arg(keys.config())
        .arg("sale")
        .query_async(c)
        .await
        .unwrap_or_else(|e| in_one_slot("HGET config", e));
    let row = dropgate_sidecar::ledger::Recorded {
        admitted_at_ms: None,
        key: "k6".into(),
        user: "k6".into(),
        quantity: 1,
        state: dropgate_sidecar::reservation::State::Active,
        expires_at_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64)
            + 60_000,
        seq: 100,
        variant: None,
        changed_by: None,
    };
    let ledger_key = dropgate_api::keys::ledger_key("shop", "sale", &sale);
    gate::replay(c, &keys, "ledger-a", &row, &ledger_key)
        .await
        .unwrap_or_else(|e| in_one_slot("replay", e));
    gate::close(c, &keys, "ledger-a", 1)
        .await
        .unwrap_or_else(|e| in_one_slot("close", e));
    dropgate_operator::store::remove(c, &keys)
        .await
        .unwrap_or_else(|e| panic!("the operator's cleanup failed on the cluster: {e}"));
    let mut left = redis::cmd("KEYS");
    left.arg("dropgate:{shop/sale}*");
    let left: Vec<String> = redis::from_redis_value(
        c.on_slot_of(&keys.config(), left)
            .await
            .unwrap_or_else(|e| in_one_slot("KEYS", e)),
    )
    .expect("a list of keys");
    assert_eq!(
        left,
        [keys.deleted()],
        "the cleanup left keys behind (but for the tombstone): {left:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_live_drops_slot_moved_to_another_shard_mid_sale_sells_exactly_its_limit() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let cluster = std::sync::Arc::new(RedisCluster::start().expect("a local Redis Cluster"));
    let dir = tempfile::tempdir().expect("dir");
    let spec = DropSpec::new(LIMIT as i64).permits(1000);
    let (ready, out) = apply(&manifest(dir.path(), &drop_name(0), &spec), &cluster);
    assert!(ready, "{out}");
    let config = DropKeys::new("shop", &drop_name(0)).config();
    let from = cluster.primary_of(&config).expect("a primary").port();
    let to = cluster.nodes[..3]
        .iter()
        .map(|n| n.port())
        .find(|&p| p != from)
        .expect("another primary");

    let ledger = format!("sqlite://{}", dir.path().join("ledger.db").display());
    let sidecar = SidecarProcess::start_with(&cluster.url(), "shop", &ledger, &["--redis-cluster"])
        .await
        .expect("sidecar on the cluster");
    let http = HttpClient::new(sidecar.base.clone());
    // The drop's first buyers, so that its slot holds reservations to move.
    for b in 0..20 {
        buy(&http, &drop_name(0), b)
            .await
            .0
            .assert_answer(201, "admitted");
    }

    let rush = join_all((20..BUYERS).map(|b| {
        let http = http.clone();
        async move {
            tokio::time::sleep(std::time::Duration::from_millis((b * 4) as u64)).await;
            let (reply, retries) = buy(&http, &drop_name(0), b).await;
            (b, reply, retries)
        }
    }));
    let moving = cluster.clone();
    let config_key = config.clone();
    let migration = tokio::task::spawn_blocking(move || {
        let started = std::time::Instant::now();
        let moved = moving.move_slot_of(&config_key, to, std::time::Duration::from_millis(60));
        (moved, started.elapsed())
    });
    let (answers, moved) = tokio::join!(rush, migration);
    let (moved, took) = moved.expect("joined");
    let moved = moved.expect("the slot moved");
    assert_eq!(
        cluster.primary_of(&config).map(|n| n.port()),
        Some(to),
        "the drop lives on its new shard"
    );

    let mut sold = 20;
    let mut retried = 0;
    for (b, reply, retries) in &answers {
        retried += retries;
        match reply.status.as_u16() {
            201 => sold += 1,
            409 => reply.assert_answer(409, "sold_out"),
            _ => panic!("buyer {b} after {retries} retries: {}", reply.text),
        }
    }
    assert_eq!(sold, LIMIT, "sold {sold} of {LIMIT}");
    let mut conn = connect(&cluster.url()).await;
    assert_eq!(stock(&mut conn, &drop_name(0)).await, (0, LIMIT as i64));
    // The first buyers' reservations moved with the slot.
    for b in 0..20 {
        reserve(&http, &drop_name(0), b)
            .await
            .assert_answer(200, "already_reserved");
    }
    println!(
        "slot moved from {from} to {to} mid-sale ({moved} keys one by one in {took:?}): {retried} answers were 503 and retried"
    );
}

/// Waits until every running node of the cluster says `cluster_state:ok`.
fn settled(cluster: &RedisCluster) -> bool {
    cluster.nodes.iter().all(|node| {
        node.connection().is_err()
            || node.connection().is_ok_and(|mut conn| {
                redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query::<String>(&mut conn)
                    .is_ok_and(|info| info.contains("cluster_state:ok"))
            })
    })
}

/// The lossy failover of one shard: its replica is frozen while buyers are
/// admitted on its primary (acknowledged, recorded in the ledger, never
/// replicated), the primary dies, and the stale replica takes over. Every
/// acknowledged reservation is still held afterwards, each drop sells exactly its
/// limit, and the drops on the other shards never pause.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failover_that_loses_acknowledged_writes_is_rebuilt_from_the_ledger() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let mut cluster = RedisCluster::start().expect("a local Redis Cluster");
    let dir = tempfile::tempdir().expect("dir");
    let spec = DropSpec::new(LIMIT as i64).permits(1000);
    let mut primary = Vec::new();
    for i in 0..DROPS {
        let (ready, out) = apply(&manifest(dir.path(), &drop_name(i), &spec), &cluster);
        assert!(ready, "{out}");
        let config = DropKeys::new("shop", &drop_name(i)).config();
        primary.push(cluster.primary_of(&config).expect("a primary").port());
    }
    let victim = primary[0];
    let on_victim: Vec<usize> = (0..DROPS).filter(|&d| primary[d] == victim).collect();
    let elsewhere: Vec<usize> = (0..DROPS).filter(|&d| primary[d] != victim).collect();
    let victim_index = cluster
        .nodes
        .iter()
        .position(|n| n.port() == victim)
        .expect("the victim is a node");
    let stale = cluster.replica_of(victim).expect("the victim's replica");

    let ledger = format!("sqlite://{}", dir.path().join("ledger.db").display());
    let sidecar = SidecarProcess::start_with(&cluster.url(), "shop", &ledger, &["--redis-cluster"])
        .await
        .expect("sidecar on the cluster");
    let http = HttpClient::new(sidecar.base.clone());
    let admit = |range: std::ops::Range<usize>, drops: Vec<usize>| {
        let http = http.clone();
        async move {
            join_all(drops.iter().flat_map(|&d| {
                let http = http.clone();
                range.clone().map(move |b| {
                    let http = http.clone();
                    async move { (d, b, buy(&http, &drop_name(d), b).await) }
                })
            }))
            .await
        }
    };
    for (d, b, (reply, _)) in admit(0..20, (0..DROPS).collect()).await {
        reply.assert_answer_because(201, "admitted", &format!("drop {d} buyer {b}"));
    }

    // Acknowledged on the primary, never replicated: the replica is frozen and its
    // link cut (what it had not read yet is gone with the link).
    cluster.nodes[stale].pause().expect("SIGSTOP the replica");
    {
        let mut conn = cluster.nodes[victim_index].connection().expect("connect");
        redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg("replica")
            .exec(&mut conn)
            .expect("cut the replication link");
    }
    for (d, b, (reply, _)) in admit(20..40, on_victim.clone()).await {
        reply.assert_answer_because(201, "admitted", &format!("drop {d} buyer {b}"));
    }
    // The sidecar is frozen through the failover, so that what the new primary
    // lost can be read before the sidecar rebuilds it.
    let signal = |sig: &str| {
        std::process::Command::new("kill")
            .args([sig, &sidecar.pid().to_string()])
            .status()
            .expect("kill")
    };
    signal("-STOP");
    cluster.nodes[victim_index].stop();
    cluster.nodes[stale].resume().expect("SIGCONT the replica");
    {
        let mut conn = cluster.nodes[stale].connection().expect("connect");
        redis::cmd("CLUSTER")
            .arg("FAILOVER")
            .arg("TAKEOVER")
            .exec(&mut conn)
            .expect("the stale replica takes over");
    }
    cluster
        .wait_until(std::time::Duration::from_secs(30), settled)
        .expect("the cluster settles on the new primary");
    // What the new primary lost (read at once: the sidecar rebuilds soon after).
    let mut fresh = connect(&cluster.nodes[stale].url()).await;
    let mut lost = 0;
    for &d in &on_victim {
        for b in 20..40 {
            let marker = DropKeys::new("shop", &drop_name(d)).reservation(&format!("k{b}"));
            let exists: i64 = redis::cmd("EXISTS")
                .arg(marker)
                .query_async(&mut fresh)
                .await
                .expect("EXISTS");
            lost += usize::from(exists == 0);
        }
    }
    assert_eq!(
        lost,
        on_victim.len() * 20,
        "the failover lost the unreplicated reservations"
    );
    signal("-CONT");

    // Every acknowledged reservation is still held: its retry answers that it is
    // (or, when Redis lost it and the ledger's rebuild has not run yet, admits the
    // same key again, which the ledger records as the reservation it already has).
    // Half of the lost ones retry; the other half never do, and only the ledger's
    // rebuild can give their units back to them rather than to new buyers.
    for (d, b, (reply, _)) in admit(0..30, on_victim.clone()).await {
        let held = matches!(
            (reply.status.as_u16(), reply.outcome()),
            (200, "already_reserved") | (201, "admitted")
        ) && reply.body["state"] == "active";
        assert!(held, "drop {d} buyer {b}: {}", reply.text);
    }
    // The rest of the buyers: each drop sells exactly its limit.
    let rest = admit(40..BUYERS, (0..DROPS).collect()).await;
    let mut sold: HashMap<usize, usize> = HashMap::new();
    let mut paused: HashMap<usize, usize> = HashMap::new();
    for (d, b, (reply, retries)) in &rest {
        *paused.entry(*d).or_default() += retries;
        match reply.status.as_u16() {
            201 => {
                // Sold through the gate, never the fallback path.
                assert_eq!(reply.body["path"], "gate", "drop {d}: {}", reply.text);
                *sold.entry(*d).or_default() += 1
            }
            409 => reply.assert_answer(409, "sold_out"),
            _ => panic!("drop {d} buyer {b} after {retries} retries: {}", reply.text),
        }
    }
    for d in 0..DROPS {
        let before = if on_victim.contains(&d) { 40 } else { 20 };
        let sold = before + sold.get(&d).copied().unwrap_or(0);
        assert_eq!(sold, LIMIT, "drop {d} sold {sold} of {LIMIT}");
    }
    for d in &elsewhere {
        assert_eq!(paused.get(d).copied().unwrap_or(0), 0, "drop {d} paused");
    }
    let mut conn = connect(&cluster.nodes[stale].url()).await;
    for d in 0..DROPS {
        assert_eq!(
            stock(&mut conn, &drop_name(d)).await,
            (0, LIMIT as i64),
            "drop {d}"
        );
    }
    // The never-retried reservations are back in Redis (a look-up would answer
    // from the ledger even without the rebuild).
    for &d in &on_victim {
        for b in 30..40 {
            let marker = DropKeys::new("shop", &drop_name(d)).reservation(&format!("k{b}"));
            let state: Option<String> = redis::cmd("HGET")
                .arg(&marker)
                .arg("state")
                .query_async(&mut conn)
                .await
                .expect("HGET");
            assert_eq!(
                state.as_deref(),
                Some("active"),
                "drop {d} buyer {b}, never retried"
            );
        }
    }
}

/// A sidecar whose cluster cannot be reached starts all the same (its pod must not
/// wait on Redis) and answers 503 until the cluster answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecar_starts_while_its_cluster_is_unreachable() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let dir = tempfile::tempdir().expect("dir");
    let nowhere = format!(
        "redis://127.0.0.1:{}",
        dropgate_testkit::free_port().expect("a free port")
    );
    let ledger = format!("sqlite://{}", dir.path().join("ledger.db").display());
    let sidecar = SidecarProcess::start_with(&nowhere, "shop", &ledger, &["--redis-cluster"])
        .await
        .expect("the sidecar starts without its cluster");
    let http = HttpClient::new(sidecar.base.clone());
    let reply = reserve(&http, "sale", 1).await;
    assert_eq!(reply.status.as_u16(), 503, "{}", reply.text);
}

/// The client in the middle of a slot's move: a key that has left answers ASK, one
/// that has not is still served where it was, and commands, plain pipelines,
/// single-key transactions and MGET over both see every value; once the slot has
/// moved, MOVED sends them all to the new primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_client_follows_a_slot_half_moved_and_then_moved() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let cluster = RedisCluster::start().expect("a local Redis Cluster");
    let mut conn = connect(&cluster.url()).await;
    let (left, stayed) = ("left:{moving}", "stayed:{moving}");
    let elsewhere = &key_on_another_shard(&cluster, left, "other");
    for key in [left, stayed, elsewhere] {
        redis::cmd("SET")
            .arg(key)
            .arg(key.to_uppercase())
            .exec_async(&mut conn)
            .await
            .expect("SET");
    }
    let from = cluster.primary_of(left).expect("a primary").port();
    let to = cluster
        .nodes
        .iter()
        .map(|n| n.port())
        .find(|&port| port != from && cluster.replica_of(port).is_some())
        .expect("another primary");
    // Calls follow a MOVED whatever slot they were routed by: a pipeline over two
    // shards (its second command is refused and sent again on its own), a value
    // that looks like a key.
    let (here, there): (i64, i64) = redis::pipe()
        .incr("count:{moving}", 1)
        .incr(key_on_another_shard(&cluster, left, "count"), 1)
        .query_async(&mut conn)
        .await
        .expect("a pipeline over two shards");
    assert_eq!((here, there), (1, 1), "each command ran once");
    let _: () = redis::cmd("SET")
        .arg("plain")
        .arg("{moving}")
        .query_async(&mut conn)
        .await
        .expect("SET of a value with a hash tag");

    let moving = cluster.begin_slot_move(left, to).expect("slot move begun");
    cluster.migrate_key(&moving, left).expect("MIGRATE");

    let values = async |conn: &mut dropgate_redis::Connection| {
        let get = |key: &str| redis::cmd("GET").arg(key).to_owned();
        let one: (String, String) = (
            get(left).query_async(conn).await.expect("GET left"),
            get(stayed).query_async(conn).await.expect("GET stayed"),
        );
        let plain: (String, String) = redis::pipe()
            .get(left)
            .get(stayed)
            .query_async(conn)
            .await
            .expect("pipeline");
        let (in_transaction,): (String,) = redis::pipe()
            .atomic()
            .get(left)
            .query_async(conn)
            .await
            .expect("transaction");
        // (Two keys of a slot half moved would be TRYAGAIN until it has moved.)
        let mget: Vec<String> = redis::cmd("MGET")
            .arg(left)
            .arg(elsewhere)
            .query_async(conn)
            .await
            .expect("MGET");
        (one, plain, in_transaction, mget)
    };
    let expected = (
        ("LEFT:{MOVING}".to_string(), "STAYED:{MOVING}".to_string()),
        ("LEFT:{MOVING}".to_string(), "STAYED:{MOVING}".to_string()),
        "LEFT:{MOVING}".to_string(),
        vec!["LEFT:{MOVING}".to_string(), elsewhere.to_uppercase()],
    );
    assert_eq!(values(&mut conn).await, expected, "half moved");
    // A script over a key that left and one not created yet: Redis answers ASK,
    // then TRYAGAIN where it went, until the slot has moved; then it runs, once.
    let script =
        redis::Script::new("redis.call('INCR', KEYS[2]); return redis.call('GET', KEYS[1])");
    let mut invocation = script.prepare_invoke();
    invocation.key(left).key("new:{moving}");
    let finish = async {
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        cluster
            .finish_slot_move(&moving, std::time::Duration::ZERO)
            .expect("slot moved");
    };
    let (ran, ()) = tokio::join!(invocation.invoke_async::<String>(&mut conn), finish);
    assert_eq!(
        ran.expect("the script runs once the slot has moved"),
        "LEFT:{MOVING}"
    );
    assert_eq!(values(&mut conn).await, expected, "moved");
    assert_eq!(cluster.primary_of(stayed).map(|n| n.port()), Some(to));
    let created: i64 = redis::cmd("GET")
        .arg("new:{moving}")
        .query_async(&mut conn)
        .await
        .expect("GET");
    assert_eq!(created, 1, "the script ran once");
}

/// Two shards fail over 20 ms apart (`CLUSTER FAILOVER TAKEOVER`, as a rolling
/// maintenance does): a script loaded before goes on running on both shards' new
/// primaries (Redis does not replicate SCRIPT LOAD: the client loads scripts on
/// replicas too), and a script first run after the failovers is loaded where its
/// slot now lives.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn scripts_keep_running_through_failovers_of_two_shards() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let cluster = RedisCluster::start().expect("a local Redis Cluster");
    let mut conn = connect(&cluster.url()).await;
    // Two keys on two shards.
    let primary_port = |key: &str| cluster.primary_of(key).expect("a primary").port();
    let first = "x:{first}";
    let second = key_on_another_shard(&cluster, first, "x");
    let before = redis::Script::new("return redis.call('INCR', KEYS[1])");
    let after = redis::Script::new("return redis.call('INCRBY', KEYS[1], 10)");
    for key in [first, second.as_str()] {
        assert_eq!(run(&before, key, &mut conn).await, 1, "{key}");
    }
    let take_over = |key: &str| {
        let replica = cluster
            .replica_of(primary_port(key))
            .expect("the shard's replica");
        redis::cmd("CLUSTER")
            .arg("FAILOVER")
            .arg("TAKEOVER")
            .exec(&mut cluster.nodes[replica].connection().expect("connect"))
            .expect("CLUSTER FAILOVER TAKEOVER");
        cluster.nodes[replica].port()
    };
    let promoted = take_over(first);
    // The first shard's MOVED makes the client read the map anew; the second
    // shard fails over right after that read.
    let _: Option<String> = redis::cmd("GET")
        .arg(first)
        .query_async(&mut conn)
        .await
        .expect("GET after the first failover");
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    let promoted_too = take_over(&second);
    cluster
        .wait_until(std::time::Duration::from_secs(30), |cluster| {
            cluster.primary_of(first).map(|n| n.port()) == Some(promoted)
                && cluster.primary_of(&second).map(|n| n.port()) == Some(promoted_too)
        })
        .expect("both replicas took over");
    for key in [first, second.as_str()] {
        // One loaded before the failover, one new after it.
        assert_eq!(run(&before, key, &mut conn).await, 2, "{key}");
        assert_eq!(run(&after, key, &mut conn).await, 12, "{key}");
    }
}

/// Runs a counting `script` on `key`: its count.
async fn run(script: &redis::Script, key: &str, conn: &mut dropgate_redis::Connection) -> i64 {
    script
        .key(key)
        .invoke_async(conn)
        .await
        .unwrap_or_else(|error| panic!("the script on {key}: {error}"))
}

/// The `cluster` flag and the Redis disagree: each side names the setting to fix
/// and changes nothing. A drop declared as on one Redis, applied to a cluster node;
/// a sidecar started without `--redis-cluster` on a cluster; a drop declared as on
/// a cluster, applied to one Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cluster_flag_that_does_not_match_the_redis_is_named() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let cluster = RedisCluster::start().expect("a local Redis Cluster");
    let dir = tempfile::tempdir().expect("dir");
    let spec = DropSpec::new(LIMIT as i64);
    let undeclared = dir.path().join("undeclared.yaml");
    let declared = std::fs::read_to_string(manifest(dir.path(), "undeclared", &spec))
        .expect("manifest")
        .replace("cluster: true", "cluster: false");
    std::fs::write(&undeclared, declared).expect("manifest");
    let (ready, out) = apply(&undeclared, &cluster);
    assert!(!ready, "{out}");
    assert!(out.contains("set spec.redis.cluster: true"), "{out}");
    let config = DropKeys::new("shop", "undeclared").config();
    assert!(
        cluster.primary_of(&config).is_some_and(|node| {
            !redis::cmd("EXISTS")
                .arg(&config)
                .query::<bool>(&mut node.connection().expect("connect"))
                .expect("EXISTS")
        }),
        "nothing was written"
    );

    // Drops on every shard, and a sidecar that takes the seed node for the Redis.
    for i in 0..DROPS {
        let (ready, out) = apply(&manifest(dir.path(), &drop_name(i), &spec), &cluster);
        assert!(ready, "{out}");
    }
    let ledger = format!("sqlite://{}", dir.path().join("ledger.db").display());
    let seed = cluster.url();
    let sidecar = SidecarProcess::start(&seed, "shop", &ledger)
        .await
        .expect("sidecar without --redis-cluster");
    let http = HttpClient::new(sidecar.base.clone());
    let seed_port = cluster.nodes[0].port();
    let elsewhere = (0..DROPS)
        .find(|&i| {
            let config = DropKeys::new("shop", &drop_name(i)).config();
            cluster.primary_of(&config).map(|n| n.port()) != Some(seed_port)
        })
        .expect("a drop on another shard than the seed's");
    let reply = reserve(&http, &drop_name(elsewhere), 1).await;
    assert_eq!(reply.status.as_u16(), 503, "{}", reply.text);
    assert!(reply.text.contains("--redis-cluster"), "{}", reply.text);
    let remaining: Option<i64> = redis::cmd("GET")
        .arg(DropKeys::new("shop", &drop_name(elsewhere)).remaining())
        .query_async(&mut connect(&seed).await)
        .await
        .expect("GET remaining");
    assert_eq!(remaining, Some(LIMIT as i64), "nothing was sold");

    // A drop declared as on a cluster, applied to one Redis.
    let single = dropgate_testkit::RedisServer::start().expect("redis-server");
    let (ready, text) = apply_to(&manifest(dir.path(), "declared", &spec), &single.url());
    assert!(!ready, "{text}");
    assert!(text.contains("set spec.redis.cluster: false"), "{text}");
    // And a sidecar started with --redis-cluster on one Redis.
    // (Seeded, if not ready: one Redis without a replica is not highly available.)
    let (_, out) = apply_to(&undeclared, &single.url());
    assert!(out.contains("stock seeded"), "{out}");
    let sidecar = SidecarProcess::start_with(&single.url(), "shop", &ledger, &["--redis-cluster"])
        .await
        .expect("sidecar with --redis-cluster");
    let reply = reserve(&HttpClient::new(sidecar.base.clone()), "undeclared", 1).await;
    assert_eq!(reply.status.as_u16(), 503, "{}", reply.text);
    assert!(
        reply.text.contains("must run without --redis-cluster"),
        "{}",
        reply.text
    );
}

/// The seed node dies and a plain Redis takes its port: the client still follows
/// the cluster (the seed's "cluster support disabled" is one node's answer, not the
/// cluster's), and finds the new primary when another shard fails over later.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_seed_address_taken_by_a_plain_redis_does_not_blind_the_client() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let mut cluster = RedisCluster::start().expect("a local Redis Cluster");
    let seed = cluster.nodes[0].url();
    let seed_port = cluster.nodes[0].port();
    let mut conn = connect(&seed).await;
    let key = (0..100)
        .map(|i| format!("k:{{victim-{i}}}"))
        .find(|key| {
            cluster
                .primary_of(key)
                .is_some_and(|n| n.port() != seed_port)
        })
        .expect("a key on another shard than the seed's");
    redis::cmd("SET")
        .arg(&key)
        .arg("kept")
        .exec_async(&mut conn)
        .await
        .expect("SET");
    let on_seed = (0..100)
        .map(|i| format!("k:{{seed-{i}}}"))
        .find(|key| {
            cluster
                .primary_of(key)
                .is_some_and(|n| n.port() == seed_port)
        })
        .expect("a key on the seed's shard");
    cluster.nodes[0].stop();
    let _plain = dropgate_testkit::RedisServer::start_on(seed_port).expect("a plain redis-server");
    // The seed's shard fails over first (two primaries down at once would leave
    // no majority to elect a replica).
    cluster
        .wait_until(std::time::Duration::from_secs(30), |cluster| {
            cluster
                .primary_of(&on_seed)
                .is_some_and(|n| n.port() != seed_port)
        })
        .expect("the seed's replica took over");
    // The client meets it: its connection to the seed's address now reaches the
    // plain Redis. Then long enough for the seed to be asked first again.
    assert_eq!(get_eventually(&mut conn, &on_seed).await, Ok(None));
    tokio::time::sleep(std::time::Duration::from_secs(6)).await;
    let victim = cluster.primary_of(&key).expect("a primary").port();
    let replica = cluster.replica_of(victim).expect("the shard's replica");
    let promoted = cluster.nodes[replica].port();
    let victim_index = cluster
        .nodes
        .iter()
        .position(|n| n.port() == victim)
        .expect("the victim is a node");
    cluster.nodes[victim_index].stop();
    cluster
        .wait_until(std::time::Duration::from_secs(30), |cluster| {
            cluster.primary_of(&key).map(|n| n.port()) == Some(promoted)
        })
        .expect("the replica took over");
    assert_eq!(
        get_eventually(&mut conn, &key).await,
        Ok(Some("kept".to_string())),
        "the client found the new primary"
    );
}

/// GET `key`, asked again for up to 20 s while it fails: its last answer.
async fn get_eventually(
    conn: &mut dropgate_redis::Connection,
    key: &str,
) -> Result<Option<String>, String> {
    let mut last = Err("never asked".to_string());
    for _ in 0..100 {
        last = redis::cmd("GET")
            .arg(key)
            .query_async::<Option<String>>(&mut *conn)
            .await
            .map_err(|error| error.to_string());
        if last.is_ok() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    last
}

/// A line's reservation state on the cluster.
async fn marker_state(
    conn: &mut dropgate_redis::Connection,
    drop: &str,
    key: &str,
) -> Option<String> {
    redis::cmd("HGET")
        .arg(DropKeys::new("shop", drop).reservation(key))
        .arg("state")
        .query_async(conn)
        .await
        .expect("HGET state")
}

/// Carts whose lines sit on three shards: 500 buyers, each with a cart of 2-3
/// lines over three drops (one sold in four sizes) where about 100 lines can be
/// served. Every drop and size sells at most its quantity and its counts add up,
/// every cart answered 201 holds all its lines and every refused one none, and no
/// buyer holds more than the per-user limit of any drop.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn carts_over_three_shards_never_oversell_nor_stay_partly_held() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let cluster = RedisCluster::start().expect("a local Redis Cluster");
    let dir = tempfile::tempdir().expect("dir");
    // One drop per shard: names tried in order until each shard has one.
    let mut drops: Vec<String> = Vec::new();
    let mut ports: HashSet<u16> = HashSet::new();
    for i in 0..100 {
        let name = format!("cart-{i}");
        let port = cluster
            .primary_of(&DropKeys::new("shop", &name).config())
            .expect("a primary")
            .port();
        if ports.insert(port) {
            drops.push(name);
        }
        if drops.len() == 3 {
            break;
        }
    }
    assert_eq!(drops.len(), 3, "three drops on three shards");
    const SIZES: [(&str, i64); 4] = [("S", 10), ("M", 10), ("L", 10), ("XL", 10)];
    let specs = [
        DropSpec::new(0)
            .variants(&SIZES)
            .per_user_limit(2)
            .permits(1000),
        DropSpec::new(30).per_user_limit(2).permits(1000),
        DropSpec::new(20).per_user_limit(2).permits(1000),
    ];
    for (drop, spec) in drops.iter().zip(&specs) {
        let (ready, out) = apply(&manifest(dir.path(), drop, spec), &cluster);
        assert!(ready, "apply on the cluster: {out}");
    }
    let ledger = format!("sqlite://{}", dir.path().join("ledger.db").display());
    let sidecar = SidecarProcess::start_with(&cluster.url(), "shop", &ledger, &["--redis-cluster"])
        .await
        .expect("sidecar on the cluster");
    let http = HttpClient::new(sidecar.base.clone());
    let (sized, plain, small) = (drops[0].as_str(), drops[1].as_str(), drops[2].as_str());
    // (cart key, buyer, lines as (drop, size))
    type Plan<'a> = (String, String, Vec<(String, Option<&'a str>)>);
    let plans: Vec<Plan> = (0..500)
        .map(|i| {
            let size = SIZES[i % SIZES.len()].0;
            let lines = match i % 3 {
                0 => vec![(sized.to_string(), Some(size)), (plain.to_string(), None)],
                1 => vec![
                    (plain.to_string(), None),
                    (small.to_string(), None),
                    (sized.to_string(), Some(size)),
                ],
                _ => vec![(small.to_string(), None), (sized.to_string(), Some(size))],
            };
            (format!("c{i}"), format!("u{}", i % 200), lines)
        })
        .collect();
    let answers = join_all(plans.iter().map(|(key, user, lines)| {
        let http = http.clone();
        async move {
            let lines: Vec<serde_json::Value> = lines
                .iter()
                .map(|(drop, size)| match size {
                    Some(size) => serde_json::json!({"drop": drop, "variant": size, "quantity": 1}),
                    None => serde_json::json!({"drop": drop, "quantity": 1}),
                })
                .collect();
            let body = serde_json::json!({"key": key, "user": user, "lines": lines});
            http.post("/v1/carts", &body.to_string())
                .await
                .expect("answers")
        }
    }))
    .await;
    let mut conn = connect(&cluster.url()).await;
    let mut reserved = 0;
    for ((key, _, lines), reply) in plans.iter().zip(&answers) {
        // Lines are numbered in the order of their drops' names.
        let mut names: Vec<&str> = lines.iter().map(|(drop, _)| drop.as_str()).collect();
        names.sort_unstable();
        let mut states = Vec::new();
        for (n, drop) in names.iter().enumerate() {
            states.push(marker_state(&mut conn, drop, &format!("{key}:{}", n + 1)).await);
        }
        let held = |s: &Option<String>| matches!(s.as_deref(), Some("active" | "confirmed"));
        match reply.status.as_u16() {
            201 => {
                reserved += 1;
                assert!(states.iter().all(held), "{key}: 201 but {states:?}");
            }
            409 | 503 => assert!(
                !states.iter().any(held),
                "{key}: answered {} yet holds {states:?}",
                reply.text
            ),
            other => panic!("{key}: unexpected {other}: {}", reply.text),
        }
    }
    assert!(reserved > 0, "some carts were served");
    let mut tally: std::collections::BTreeMap<u16, usize> = Default::default();
    for reply in &answers {
        *tally.entry(reply.status.as_u16()).or_default() += 1;
    }
    println!("carts answered, by status: {tally:?}");
    for (drop, limit) in [(sized, 40), (plain, 30), (small, 20)] {
        let (remaining, held) = stock(&mut conn, drop).await;
        println!("{drop}: {held} held, {remaining} left of {limit}");
        assert!(
            (0..=limit).contains(&held),
            "{drop}: {held} held of {limit}"
        );
        assert_eq!(remaining + held, limit, "{drop}'s counts add up");
        let buyers: HashMap<String, i64> = redis::cmd("HGETALL")
            .arg(DropKeys::new("shop", drop).buyers())
            .query_async(&mut conn)
            .await
            .expect("HGETALL buyers");
        assert_eq!(buyers.values().sum::<i64>(), held, "{drop}: buyers' counts");
        assert!(
            buyers.values().all(|units| *units <= 2),
            "{drop}: a buyer past the limit: {buyers:?}"
        );
    }
    let sizes: HashMap<String, i64> = redis::cmd("HGETALL")
        .arg(DropKeys::new("shop", sized).variants())
        .query_async(&mut conn)
        .await
        .expect("HGETALL variants");
    for (size, quantity) in SIZES {
        let (left, held) = (sizes[&format!("r:{size}")], sizes[&format!("h:{size}")]);
        assert!(
            (0..=quantity).contains(&held),
            "{size}: {held} of {quantity}"
        );
        assert_eq!(left + held, quantity, "{size}'s counts add up");
    }
    drop(sidecar);
}
