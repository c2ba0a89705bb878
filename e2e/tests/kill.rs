//! `kill -9` in the middle of a flash sale, on two sidecar processes that share a
//! PostgreSQL ledger: every acknowledged reservation survives, nothing is sold
//! beyond the limit, and once the killed sidecar is back Redis and the ledger agree.

use std::collections::HashSet;
use std::time::Duration;

use dropgate_api::DropKeys;
use dropgate_e2e::processes::{SidecarProcess, apply, sale_manifest};
use dropgate_testkit::{DropSpec, HttpClient, PostgresServer, RedisServer, Reply};
use futures::future::join_all;

const LIMIT: usize = 60;

async fn reserve(http: &HttpClient, i: usize) -> Option<Reply> {
    let body = format!(r#"{{"key":"k{i}","user":"u{i}","quantity":1}}"#);
    // A connection cut by the kill is an answer the buyer never got.
    http.post("/v1/drops/sale/reservations", &body).await.ok()
}

/// Whether a reserve's answer means the buyer holds a unit now: 201, or 200
/// `already_reserved`, which only ever names a reservation made durable: a retry of
/// an admission that was taken back (its sidecar died before the ledger had it) is
/// decided afresh, and no buyer here cancels or outlives a hold.
fn holds(reply: &Option<Reply>) -> bool {
    reply.as_ref().is_some_and(|r| {
        if r.outcome() == "already_reserved" {
            let state = r.body.get("state").and_then(|s| s.as_str());
            assert!(
                matches!(state, Some("active" | "confirmed")),
                "already_reserved names a reservation nobody holds: {}",
                r.text
            );
        }
        r.status == 201 || r.outcome() == "already_reserved"
    })
}

/// The integer at one of drop `shop/sale`'s keys (`DropKeys::held`, say).
fn get(redis: &RedisServer, key: fn(&DropKeys) -> String) -> i64 {
    let mut conn = redis.connection().expect("connect");
    redis::cmd("GET")
        .arg(key(&DropKeys::new("shop", "sale")))
        .query::<Option<i64>>(&mut conn)
        .expect("GET")
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sidecar_killed_mid_sale_loses_nothing_acknowledged_and_oversells_nothing() {
    let redis = RedisServer::start().expect("redis-server");
    let postgres = PostgresServer::start().expect("PostgreSQL");
    let dir = tempfile::tempdir().expect("dir");
    let manifest = sale_manifest(
        dir.path(),
        &DropSpec::new(LIMIT as i64).permits(1000).yaml(),
    )
    .expect("manifest");
    apply(&manifest, &redis.url()).expect("apply");
    let steady = SidecarProcess::start(&redis.url(), "shop", &postgres.url())
        .await
        .expect("sidecar");
    let doomed = SidecarProcess::start(&redis.url(), "shop", &postgres.url())
        .await
        .expect("sidecar");
    let (steady_http, doomed_http) = (
        HttpClient::new(steady.base.clone()),
        HttpClient::new(doomed.base.clone()),
    );

    let buyers = join_all((0..300).map(|i| {
        let http = if i % 2 == 0 {
            steady_http.clone()
        } else {
            doomed_http.clone()
        };
        async move { (i, reserve(&http, i).await) }
    }));
    let killer = async {
        tokio::time::sleep(Duration::from_millis(30)).await;
        doomed.kill();
    };
    let (replies, ()) = tokio::join!(buyers, killer);
    let acknowledged: HashSet<usize> = replies
        .iter()
        .filter(|(_, reply)| reply.as_ref().is_some_and(|r| r.status == 201))
        .map(|(i, _)| *i)
        .collect();
    assert!(
        acknowledged.len() <= LIMIT,
        "{} admitted",
        acknowledged.len()
    );

    // The killed sidecar comes back on the same ledger; every buyer retries.
    let back = SidecarProcess::start(&redis.url(), "shop", &postgres.url())
        .await
        .expect("sidecar restarts");
    let back_http = HttpClient::new(back.base.clone());
    let mut admitted = HashSet::new();
    for _ in 0..20 {
        let retries = join_all((0..300).map(|i| {
            let http = if i % 2 == 0 {
                steady_http.clone()
            } else {
                back_http.clone()
            };
            async move { (i, reserve(&http, i).await) }
        }))
        .await;
        admitted = retries
            .iter()
            .filter(|(_, r)| holds(r))
            .map(|(i, _)| *i)
            .collect();
        let unresolved = retries
            .iter()
            .filter(|(_, r)| r.as_ref().is_none_or(|r| r.status == 503))
            .count();
        if let Some((i, r)) = retries
            .iter()
            .find(|(_, r)| r.as_ref().is_none_or(|r| r.status == 503))
        {
            eprintln!(
                "unresolved {unresolved}: k{i}: {:?}",
                r.as_ref().map(|r| r.text.clone())
            );
        }
        // Units taken back during this round go to the next round's buyers.
        if unresolved == 0 && get(&redis, DropKeys::remaining) == 0 {
            let mut tally = std::collections::HashMap::new();
            for (_, r) in &retries {
                if let Some(r) = r {
                    *tally.entry(r.outcome().to_string()).or_insert(0) += 1;
                }
            }
            eprintln!(
                "final retry: {tally:?} held {} remaining {}",
                get(&redis, DropKeys::held),
                get(&redis, DropKeys::remaining)
            );
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(
        acknowledged.is_subset(&admitted),
        "every acknowledged reservation survives the kill"
    );
    assert_eq!(admitted.len(), LIMIT, "the whole stock, once");
    assert_eq!(get(&redis, DropKeys::held) as usize, LIMIT);
    assert_eq!(get(&redis, DropKeys::remaining), 0);
    for sidecar in [steady, back] {
        assert!(sidecar.terminate().expect("stops").success());
    }
}

/// Issue 10's second scenario: one sidecar with its own SQLite ledger, 900 buyers
/// for 300 units, `kill -9` after the first few dozen 201s, restarted on the same
/// ledger, every buyer retrying its key. Admissions the dead process left half-done
/// (pending in Redis, maybe committed in the ledger) resolve within seconds: each
/// retry ends in 201 or 200 `already_reserved` holding one unit, or its unit goes
/// back to stock and someone else buys it; never both, and never a frozen unit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sidecar_killed_mid_admission_leaves_no_unit_frozen() {
    const UNITS: usize = 300;
    const BUYERS: usize = 900;
    let redis = RedisServer::start().expect("redis-server");
    let dir = tempfile::tempdir().expect("dir");
    let ledger = format!("sqlite://{}", dir.path().join("ledger.db").display());
    let manifest = sale_manifest(
        dir.path(),
        &DropSpec::new(UNITS as i64).permits(1000).yaml(),
    )
    .expect("manifest");
    apply(&manifest, &redis.url()).expect("apply");
    let doomed = SidecarProcess::start(&redis.url(), "shop", &ledger)
        .await
        .expect("sidecar");
    let http = HttpClient::new(doomed.base.clone());

    let admitted_so_far = std::sync::atomic::AtomicUsize::new(0);
    let buyers = join_all((0..BUYERS).map(|i| {
        let (http, admitted_so_far) = (http.clone(), &admitted_so_far);
        async move {
            let reply = reserve(&http, i).await;
            if reply.as_ref().is_some_and(|r| r.status == 201) {
                admitted_so_far.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
            (i, reply)
        }
    }));
    let killer = async {
        for _ in 0..10_000 {
            if admitted_so_far.load(std::sync::atomic::Ordering::SeqCst) >= 36 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        doomed.kill();
    };
    let (replies, ()) = tokio::join!(buyers, killer);
    let acknowledged: HashSet<usize> = replies
        .iter()
        .filter(|(_, reply)| reply.as_ref().is_some_and(|r| r.status == 201))
        .map(|(i, _)| *i)
        .collect();
    assert!(acknowledged.len() < UNITS, "the kill came mid-sale");
    let half_done: i64 = redis::cmd("ZCARD")
        .arg(DropKeys::new("shop", "sale").pending())
        .query(&mut redis.connection().expect("connect"))
        .expect("ZCARD");
    eprintln!(
        "killed after {} acknowledged; {half_done} admissions left pending",
        acknowledged.len()
    );
    let killed_at = std::time::Instant::now();

    let back = SidecarProcess::start(&redis.url(), "shop", &ledger)
        .await
        .expect("sidecar restarts on the same ledger");
    let http = HttpClient::new(back.base.clone());
    let mut holders = HashSet::new();
    let mut settled = false;
    for _ in 0..40 {
        let retries = join_all((0..BUYERS).map(|i| {
            let http = http.clone();
            async move { (i, reserve(&http, i).await) }
        }))
        .await;
        holders = retries
            .iter()
            .filter(|(_, r)| holds(r))
            .map(|(i, _)| *i)
            .collect();
        let waiting: Vec<String> = retries
            .iter()
            .filter_map(|(i, r)| match r {
                None => Some(format!("k{i}: no answer")),
                Some(r) if r.status == 503 => Some(format!("k{i}: {}", r.text)),
                Some(r) if r.status == 201 || r.status == 200 || r.outcome() == "sold_out" => None,
                Some(r) => panic!("k{i} answered {} {}", r.status, r.text),
            })
            .collect();
        // Units taken back during this round go to the next round's buyers.
        if waiting.is_empty() && get(&redis, DropKeys::remaining) == 0 {
            settled = true;
            break;
        }
        if let Some(first) = waiting.first() {
            eprintln!("{} retries still wait, e.g. {first}", waiting.len());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(settled, "every half-done admission resolves within seconds");
    eprintln!("settled {:?} after the kill", killed_at.elapsed());
    assert!(
        acknowledged.is_subset(&holders),
        "every acknowledged reservation survives the kill"
    );
    assert_eq!(holders.len(), UNITS, "every unit sold once: none frozen");
    // Admissions the dead process committed but never activated are the ledger's
    // word until the refresh replays them into Redis (a second or so).
    let mut counts = (0, 0);
    for _ in 0..50 {
        counts = (
            get(&redis, DropKeys::held),
            get(&redis, DropKeys::remaining),
        );
        if counts == (UNITS as i64, 0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    if counts != (UNITS as i64, 0) {
        sqlx::any::install_default_drivers();
        let pool = sqlx::AnyPool::connect(&ledger).await.expect("ledger");
        let rows: Vec<(String, String, i64)> =
            sqlx::query_as("SELECT res_key, state, replayed FROM reservations")
                .fetch_all(&pool)
                .await
                .expect("rows");
        let mut conn = redis.connection().expect("connect");
        let mut differ = Vec::new();
        for (k, state, replayed) in &rows {
            let marker: Option<String> = redis::cmd("HGET")
                .arg(DropKeys::new("shop", "sale").reservation(k))
                .arg("state")
                .query(&mut conn)
                .expect("HGET");
            if marker.as_deref() != Some(state.as_str()) {
                differ.push(format!(
                    "{k}: ledger {state} (replayed {replayed}) Redis {marker:?}"
                ));
            }
        }
        panic!(
            "Redis (held, remaining) {counts:?} once quiet; {} ledger rows; differ: {differ:?}",
            rows.len()
        );
    }
    assert!(back.terminate().expect("stops").success());
}
