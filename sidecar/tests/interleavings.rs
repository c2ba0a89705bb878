//! Random interleavings of everything that breaks a sale — buyers, retries,
//! confirms, cancels, the kill switch both ways, limit raises, sidecar restarts, one
//! sidecar cut off from Redis, Redis restarting empty, Redis losing its
//! last writes — with three sidecars, on a shared PostgreSQL ledger and on per-pod
//! SQLite ledgers. After every step: nothing was sold beyond the limit, as the
//! buyers were told it and as each ledger and Redis record it. Once everything is
//! healed (shared ledger): Redis and the ledger agree, and remaining + held = limit.
//!
//! The schedule comes from a seed; `DROPGATE_SEED=n` replays one.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::{NS, Peer, one_per_buyer, seed};
use dropgate_api::DropKeys;
use dropgate_testkit::{Checkpoint, PostgresServer, RedisServer, Reply, TcpProxy};
use futures::future::join_all;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sqlx::Row;

const DROP: &str = "sale";
const SIDECARS: usize = 3;
const STEPS: usize = 30;

/// One thing that happens to the sale.
#[derive(Clone, Copy, Debug)]
enum Step {
    Rush(usize),
    Retry,
    Confirm,
    Cancel,
    KillSwitch(bool),
    RaiseLimit(i64),
    Restart(usize),
    Cut(usize),
    Heal(usize),
    RedisRestart,
    Checkpoint,
    LoseSinceCheckpoint,
}

fn next_step(rng: &mut StdRng) -> Step {
    match rng.random_range(0..100) {
        0..30 => Step::Rush(rng.random_range(3..25)),
        30..38 => Step::Retry,
        38..46 => Step::Confirm,
        46..54 => Step::Cancel,
        54..62 => Step::KillSwitch(rng.random_bool(0.5)),
        62..67 => Step::RaiseLimit(rng.random_range(1..6)),
        67..77 => Step::Restart(rng.random_range(0..SIDECARS)),
        77..83 => Step::Cut(rng.random_range(0..SIDECARS)),
        83..89 => Step::Heal(rng.random_range(0..SIDECARS)),
        89..92 => Step::RedisRestart,
        92..96 => Step::Checkpoint,
        _ => Step::LoseSinceCheckpoint,
    }
}

/// The sale under test and what its buyers were told.
struct World {
    redis: RedisServer,
    proxies: Vec<TcpProxy>,
    peers: Vec<Option<Peer>>,
    ledgers: Vec<String>,
    limit: i64,
    gate_on: bool,
    /// Keys whose buyer heard 201 (or, for a retry, already_reserved).
    admitted: HashSet<String>,
    /// Keys whose buyer heard `cancelled`.
    cancelled: HashSet<String>,
    checkpoint: Checkpoint,
    lost_data: bool,
    next_key: usize,
    _dir: tempfile::TempDir,
}

impl World {
    async fn new(ledgers: Vec<String>, dir: tempfile::TempDir) -> Self {
        let redis = RedisServer::start().expect("redis-server");
        let mut world = World {
            proxies: Vec::new(),
            peers: Vec::new(),
            ledgers,
            limit: 10,
            gate_on: true,
            admitted: HashSet::new(),
            cancelled: HashSet::new(),
            checkpoint: Checkpoint::default(),
            lost_data: false,
            next_key: 0,
            _dir: dir,
            redis,
        };
        world.publish().await;
        for i in 0..SIDECARS {
            let proxy = TcpProxy::start(world.redis.port()).await.expect("proxy");
            world.peers.push(Some(
                Peer::start(&proxy.redis_url(), &world.ledgers[i]).await,
            ));
            world.proxies.push(proxy);
        }
        world
    }

    async fn publish(&self) {
        let spec = one_per_buyer(self.limit);
        let spec = if self.gate_on {
            spec
        } else {
            spec.kill_switch()
        };
        seed(&self.redis.url(), DROP, spec).await;
    }

    fn running(&self) -> Vec<&Peer> {
        self.peers.iter().flatten().collect()
    }

    async fn apply(&mut self, rng: &mut StdRng, step: Step) {
        match step {
            Step::Rush(n) => {
                let first = self.next_key;
                self.next_key += n;
                let peers = self.running();
                if peers.is_empty() {
                    return;
                }
                let replies = join_all((first..first + n).map(|i| {
                    let peer = peers[i % peers.len()];
                    async move {
                        let key = format!("k{i}");
                        (key.clone(), peer.reserve(DROP, &key, &key, 1).await)
                    }
                }))
                .await;
                self.note_admissions(replies);
            }
            Step::Retry => {
                let keys: Vec<String> = (0..self.next_key).map(|i| format!("k{i}")).collect();
                let picked: Vec<String> =
                    keys.into_iter().filter(|_| rng.random_bool(0.3)).collect();
                let peers = self.running();
                if peers.is_empty() {
                    return;
                }
                let replies = join_all(picked.iter().enumerate().map(|(i, key)| {
                    let peer = peers[i % peers.len()];
                    async move { (key.clone(), peer.reserve(DROP, key, key, 1).await) }
                }))
                .await;
                self.note_admissions(replies);
            }
            Step::Confirm | Step::Cancel => {
                let op = if matches!(step, Step::Confirm) {
                    "confirm"
                } else {
                    "cancel"
                };
                let keys: Vec<String> = self
                    .admitted
                    .iter()
                    .filter(|_| rng.random_bool(0.3))
                    .cloned()
                    .collect();
                let peers = self.running();
                if peers.is_empty() {
                    return;
                }
                let replies = join_all(keys.iter().enumerate().map(|(i, key)| {
                    let peer = peers[i % peers.len()];
                    async move { (key.clone(), peer.settle(DROP, key, op).await) }
                }))
                .await;
                for (key, reply) in replies {
                    if reply.outcome() == "cancelled" {
                        self.cancelled.insert(key);
                    }
                }
            }
            Step::KillSwitch(on) => {
                self.gate_on = on;
                self.publish().await;
            }
            Step::RaiseLimit(by) => {
                self.limit += by;
                self.publish().await;
            }
            Step::Restart(i) => {
                if let Some(peer) = self.peers[i].take() {
                    peer.shutdown().await;
                }
                self.peers[i] =
                    Some(Peer::start(&self.proxies[i].redis_url(), &self.ledgers[i]).await);
            }
            Step::Cut(i) => self.proxies[i].cut().await,
            Step::Heal(i) => self.proxies[i].heal(),
            Step::RedisRestart => {
                self.redis.restart().expect("redis restarts empty");
                self.lost_data = true;
                self.publish().await;
            }
            Step::Checkpoint => self.checkpoint = self.redis.checkpoint(),
            Step::LoseSinceCheckpoint => {
                if !self.checkpoint.is_empty() {
                    self.redis
                        .roll_back_to(&self.checkpoint)
                        .expect("Redis rolls back");
                    self.lost_data = true;
                }
            }
        }
    }

    fn note_admissions(&mut self, replies: Vec<(String, Reply)>) {
        for (key, reply) in replies {
            if reply.status == 201 || reply.outcome() == "already_reserved" {
                self.admitted.insert(key);
            }
        }
    }

    /// Never oversold, as the buyers were told it and as every store records it.
    async fn assert_never_oversold(&self, step: usize, what: &dyn std::fmt::Debug) {
        let live = self.admitted.difference(&self.cancelled).count() as i64;
        assert!(
            live <= self.limit,
            "step {step} ({what:?}): buyers hold {live} units of {}",
            self.limit
        );
        let mut seen = HashSet::new();
        for url in &self.ledgers {
            if seen.insert(url) {
                let held = ledger_held(url).await;
                assert!(
                    held <= self.limit,
                    "step {step} ({what:?}): a ledger holds {held} of {}",
                    self.limit
                );
            }
        }
        let held = redis_int(&self.redis, DropKeys::held);
        assert!(
            held <= self.limit,
            "step {step} ({what:?}): Redis holds {held} of {}",
            self.limit
        );
    }

    /// Heals everything and, with a shared ledger, waits until Redis and the ledger
    /// agree and remaining + held = limit.
    async fn settle(&mut self) {
        for proxy in &self.proxies {
            proxy.heal();
        }
        for i in 0..SIDECARS {
            if self.peers[i].is_none() {
                self.peers[i] =
                    Some(Peer::start(&self.proxies[i].redis_url(), &self.ledgers[i]).await);
            }
        }
        self.gate_on = true;
        self.publish().await;
        let shared = self.ledgers.iter().all(|url| *url == self.ledgers[0]);
        if !shared && self.lost_data {
            // Per-pod ledgers after a loss: the drop stays closed (none holds the
            // whole sale); nothing more to converge.
            return;
        }
        let mut agreed = false;
        for _ in 0..100 {
            // A buyer nudges every sidecar to open the gate.
            for peer in self.running() {
                let _ = peer.lookup(DROP, "nudge").await;
            }
            let (remaining, held) = (
                redis_int(&self.redis, DropKeys::remaining),
                redis_int(&self.redis, DropKeys::held),
            );
            let ledger = ledger_held(&self.ledgers[0]).await;
            if remaining + held == self.limit && (!shared || held == ledger) {
                agreed = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(
            agreed,
            "Redis remaining {} held {}, ledger {}, limit {}",
            redis_int(&self.redis, DropKeys::remaining),
            redis_int(&self.redis, DropKeys::held),
            ledger_held(&self.ledgers[0]).await,
            self.limit
        );
    }

    async fn shutdown(mut self) {
        for peer in self.peers.iter_mut().filter_map(Option::take) {
            peer.shutdown().await;
        }
    }
}

/// The integer at one of the drop's keys (`DropKeys::held`, say), 0 when Redis
/// has none or cannot be reached.
fn redis_int(redis: &RedisServer, key: fn(&DropKeys) -> String) -> i64 {
    let Ok(mut conn) = redis.connection() else {
        return 0;
    };
    redis::cmd("GET")
        .arg(key(&DropKeys::new(NS, DROP)))
        .query::<Option<i64>>(&mut conn)
        .ok()
        .flatten()
        .unwrap_or(0)
}

async fn ledger_held(url: &str) -> i64 {
    sqlx::any::install_default_drivers();
    let pool = sqlx::AnyPool::connect(url).await.expect("the ledger opens");
    let held: i64 = sqlx::query(
        "SELECT CAST(COALESCE(SUM(quantity), 0) AS BIGINT) FROM reservations \
         WHERE drop_key LIKE $1 AND state IN ('active', 'confirmed')",
    )
    .bind(format!("{NS}/{DROP}/%"))
    .fetch_one(&pool)
    .await
    .expect("sum")
    .get(0);
    pool.close().await;
    held
}

fn seeds() -> Vec<u64> {
    match std::env::var("DROPGATE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        Some(seed) => vec![seed],
        None => vec![1, 2, 3],
    }
}

async fn run(seed_value: u64, ledgers: Vec<String>, dir: tempfile::TempDir) {
    let mut rng = StdRng::seed_from_u64(seed_value);
    let mut world = World::new(ledgers, dir).await;
    for step in 0..STEPS {
        let what = next_step(&mut rng);
        world.apply(&mut rng, what).await;
        eprintln!(
            "step {step}: {what:?}: {} admitted, {} cancelled, limit {}, Redis held {}",
            world.admitted.len(),
            world.cancelled.len(),
            world.limit,
            redis_int(&world.redis, DropKeys::held)
        );
        world.assert_never_oversold(step, &what).await;
    }
    world.settle().await;
    world.assert_never_oversold(STEPS, &"settled").await;
    world.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_sidecars_sharing_postgresql_never_oversell_whatever_happens() {
    for seed_value in seeds() {
        let postgres = PostgresServer::start().expect("postgres");
        let dir = tempfile::tempdir().expect("dir");
        run(seed_value, vec![postgres.url(); SIDECARS], dir).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_sidecars_with_per_pod_ledgers_never_oversell_whatever_happens() {
    for seed_value in seeds() {
        let dir = tempfile::tempdir().expect("dir");
        let ledgers = (0..SIDECARS)
            .map(|i| {
                format!(
                    "sqlite://{}",
                    dir.path().join(format!("pod-{i}.db")).display()
                )
            })
            .collect();
        run(seed_value, ledgers, dir).await;
    }
}
