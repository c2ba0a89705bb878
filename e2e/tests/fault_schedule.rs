//! Randomized fault schedules against real processes: a seeded generator interleaves
//! buyers, retries, confirms, duplicate cancels, restocks and limit cuts, `endsAt`
//! moved into the past and back, kill-switch flips, Redis restarting empty (then
//! re-seeded), Redis losing its last writes, `kill -9` of a sidecar process followed
//! by its restart, a pod scaled in just before a failover that loses its last
//! writes, the ledger stalled past the commit deadline, the ledger down under
//! confirms and cancels, and a pod with a per-pod ledger joining the sale, with two
//! sidecar processes sharing one PostgreSQL ledger.
//!
//! After every step: nothing is sold beyond the limit in force when each buyer was
//! admitted (a cut below what is held lets nobody in until returns pay the deficit
//! back), as the buyers were told it and as Redis and the ledger record it; a confirm
//! or cancel answered 503 changed nothing in Redis; nobody is admitted while the sale
//! has ended, and no pod but the sale's ledger's sells. After each schedule, once healed and
//! quiet, docs/design.md's invariants hold: remaining + held == limit in Redis, the
//! ledger holds what Redis holds, every acknowledged reservation that no
//! acknowledged cancel ended is held, and every event written since the last loss
//! of Redis data reached the drop's stream.
//!
//! `DROPGATE_SCHEDULES=n` (default 14) schedules of `DROPGATE_OPS=m` (default 2000)
//! operations each; `DROPGATE_SEED=s` replays the one schedule a failure names.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::time::Duration;

use dropgate_api::DropKeys;
use dropgate_e2e::processes::{SidecarProcess, apply};
use dropgate_testkit::{Checkpoint, HttpClient, PostgresServer, RedisServer, Reply};
use futures::future::join_all;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sqlx::Row;

const NS: &str = "shop";
const SIDECARS: usize = 2;
/// Requests in flight on a sidecar when it is killed.
const KILLED_MID_RUSH: usize = 20;

/// One thing that happens to the sale; buyer steps carry how many requests.
#[derive(Clone, Copy, Debug)]
enum Step {
    Rush(usize),
    Retry(usize),
    Confirm(usize),
    /// Each picked reservation cancelled twice at once, through both sidecars.
    DuplicateCancel(usize),
    Restock(i64),
    KillSwitch(bool),
    /// Redis killed and started empty, then the drop re-seeded.
    RedisRestart,
    Checkpoint,
    /// Redis put back to the last checkpoint: a failover that lost the last writes.
    LoseSinceCheckpoint,
    /// `kill -9` of one sidecar while buyers' requests are in flight on it, then a
    /// new process on the same ledger.
    KillSidecar(usize),
    /// The limit cut by this much (on the gate or the fallback, whichever decides).
    LimitCut(i64),
    /// `endsAt` moved into the past (true) or back into the future.
    MoveEnd(bool),
    /// PostgreSQL holds a lock on the ledger's reservations past the commit deadline
    /// while buyers arrive.
    StallLedger(usize),
    /// PostgreSQL down while buyers confirm and cancel; then back.
    LedgerDownUnderSettle(usize),
    /// A pod sells, is scaled in, and then Redis fails over to a replica that missed
    /// its last writes; the other pod sells on; the pod comes back later.
    ScaleInBeforeLossyFailover(usize),
    /// A pod with a per-pod SQLite ledger joins the sale (a rollout mid-sale): it
    /// must sell nothing.
    MixedLedger(usize),
}

impl Step {
    /// Operations it counts for: one per request, one per fault.
    fn ops(self) -> usize {
        match self {
            Step::Rush(n) | Step::Retry(n) | Step::Confirm(n) => n,
            Step::DuplicateCancel(n) => 2 * n,
            Step::KillSidecar(_) => KILLED_MID_RUSH + 1,
            Step::StallLedger(n) | Step::LedgerDownUnderSettle(n) | Step::MixedLedger(n) => n + 1,
            Step::ScaleInBeforeLossyFailover(_) => 2 * SCALED_IN_RUSH + 1,
            _ => 1,
        }
    }
}

/// Buyers of each half of a scale-in before a lossy failover.
const SCALED_IN_RUSH: usize = 10;

fn next_step(rng: &mut StdRng) -> Step {
    match rng.random_range(0..100) {
        0..36 => Step::Rush(rng.random_range(5..40)),
        36..48 => Step::Retry(rng.random_range(5..30)),
        48..56 => Step::Confirm(rng.random_range(1..10)),
        56..64 => Step::DuplicateCancel(rng.random_range(1..6)),
        64..68 => Step::Restock(rng.random_range(1..5)),
        68..71 => Step::LimitCut(rng.random_range(1..8)),
        71..74 => Step::MoveEnd(rng.random_bool(0.5)),
        74..79 => Step::KillSwitch(rng.random_bool(0.5)),
        79..81 => Step::RedisRestart,
        81..84 => Step::Checkpoint,
        84..86 => Step::LoseSinceCheckpoint,
        86..89 => Step::KillSidecar(rng.random_range(0..SIDECARS)),
        89..92 => Step::StallLedger(rng.random_range(5..20)),
        92..95 => Step::LedgerDownUnderSettle(rng.random_range(1..6)),
        95..97 => Step::ScaleInBeforeLossyFailover(rng.random_range(0..SIDECARS)),
        _ => Step::MixedLedger(rng.random_range(3..10)),
    }
}

/// The Redis and the PostgreSQL ledger every schedule runs on (each on a drop of
/// its own): starting PostgreSQL takes seconds.
struct Lab {
    redis: RedisServer,
    postgres: PostgresServer,
    pool: sqlx::PgPool,
    dir: tempfile::TempDir,
}

impl Lab {
    async fn start() -> Self {
        let postgres = PostgresServer::start().expect("PostgreSQL");
        let pool = sqlx::PgPool::connect(&postgres.url())
            .await
            .expect("the test's own connection to the ledger");
        Lab {
            redis: RedisServer::start().expect("redis-server"),
            postgres,
            pool,
            dir: tempfile::tempdir().expect("dir"),
        }
    }
}

/// One schedule's sale and what its buyers were told.
struct World {
    lab: Lab,
    drop: String,
    sidecars: Vec<SidecarProcess>,
    https: Vec<HttpClient>,
    limit: i64,
    gate_on: bool,
    /// `endsAt` is in the past: nobody may be admitted.
    ended: bool,
    /// What may be held after the step that runs now: the limit, or what was held
    /// before it when that is more (a cut below what is held admits nobody).
    allowed: (i64, i64, i64),
    /// Keys whose buyer heard 201 or `already_reserved`.
    acknowledged: HashSet<String>,
    /// Keys whose cancel was acknowledged (`cancelled` / `already_cancelled`).
    cancelled: HashSet<String>,
    /// Keys whose cancel got no answer (the sidecar died under it): it may or may
    /// not have happened.
    cancel_unknown: HashSet<String>,
    /// Keys whose reserve got no answer, or a 503 saying its commit's outcome is
    /// unknown (the ledger could not be asked): the admission may have landed, and
    /// a retry then hears of it.
    reserve_unknown: HashSet<String>,
    /// Keys of `reserve_unknown` acknowledged in this step: units held before it,
    /// which the buyer hears of only now.
    revealed: i64,
    /// Keys acknowledged before the step, and every reserve answer each key got:
    /// what a failure names (which keys the step told of, and what they heard).
    acknowledged_before: HashSet<String>,
    heard: HashMap<String, Vec<String>>,
    checkpoint: Checkpoint,
    /// The units Redis's reservations held when the checkpoint was taken: what a
    /// roll-back to it puts back (stale holds until the rebuild, not sales).
    checkpoint_sold: i64,
    /// When Redis last lost data (ms since the epoch): events written before it may
    /// have gone with it.
    lost_at_ms: i64,
    next_key: usize,
    /// The steps so far, as a failure names the ones that led to it.
    steps: Vec<String>,
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// SIGKILL, wherever the process is.
fn kill_9(pid: u32) {
    let _ = std::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status();
}

fn key(i: usize) -> String {
    format!("k{i}")
}

/// A reserve; `None` when no answer came (the sidecar died under it).
async fn reserve(http: &HttpClient, drop: &str, key: &str) -> Option<Reply> {
    let body = format!(r#"{{"key":"{key}","user":"{key}","quantity":1}}"#);
    http.post(&format!("/v1/drops/{drop}/reservations"), &body)
        .await
        .ok()
}

async fn settle(http: &HttpClient, drop: &str, key: &str, op: &str) -> Option<Reply> {
    http.post(&format!("/v1/drops/{drop}/reservations/{key}/{op}"), "")
        .await
        .ok()
}

impl World {
    async fn new(lab: Lab, seed: u64) -> Self {
        let mut world = World {
            lab,
            drop: format!("sale-{seed}"),
            sidecars: Vec::new(),
            https: Vec::new(),
            limit: 40,
            gate_on: true,
            ended: false,
            allowed: (40, 40, 40),
            acknowledged: HashSet::new(),
            cancelled: HashSet::new(),
            cancel_unknown: HashSet::new(),
            reserve_unknown: HashSet::new(),
            revealed: 0,
            acknowledged_before: HashSet::new(),
            heard: HashMap::new(),
            checkpoint: Checkpoint::default(),
            checkpoint_sold: 0,
            lost_at_ms: 0,
            next_key: 0,
            steps: Vec::new(),
        };
        world.publish();
        for _ in 0..SIDECARS {
            let sidecar = world.start_sidecar().await;
            world.https.push(HttpClient::new(sidecar.base.clone()));
            world.sidecars.push(sidecar);
        }
        world
    }

    async fn start_sidecar(&self) -> SidecarProcess {
        SidecarProcess::start(&self.lab.redis.url(), NS, &self.lab.postgres.url())
            .await
            .expect("sidecar starts")
    }

    /// The drop's manifest, as a shop would `kubectl apply` it.
    fn manifest(&self) -> PathBuf {
        let gate = if self.gate_on {
            ""
        } else {
            "  gate: {enabled: false}\n"
        };
        let end = if self.ended {
            "  endsAt: 2001-01-01T00:00:00Z\n"
        } else {
            "  endsAt: 2099-01-01T00:00:00Z\n"
        };
        // Holds outlast the schedule: an acknowledged reservation is held until an
        // acknowledged cancel ends it.
        let path = self.lab.dir.path().join(format!("{}.yaml", self.drop));
        std::fs::write(
            &path,
            format!(
                "apiVersion: dropgate.io/v1alpha1\nkind: InventoryDrop\nmetadata: {{name: {}, namespace: {NS}}}\n\
                 spec:\n  redis: {{url: redis://unused:1}}\n  sku: X\n  limitedQuantity: {}\n  perUserLimit: 1\n  \
                 holdSeconds: 3600\n  throttle: {{permits: 5000}}\n{gate}{end}",
                self.drop, self.limit
            ),
        )
        .expect("manifest written");
        path
    }

    /// Publishes the drop as the operator's `apply -f` does (the same sale each
    /// time: a manifest has no creation time).
    fn publish(&self) {
        apply(&self.manifest(), &self.lab.redis.url()).expect("apply");
    }

    /// Waits (a few seconds at most) until every sidecar's copy of the config has
    /// the limit and end last published. README "Not guaranteed" (4): a change
    /// published less than one config refresh before Redis became unreachable
    /// reaches the fallback only once Redis answers again, so the schedule lets the
    /// sidecars read each change before it takes Redis away, and checks the promise
    /// as the contract states it.
    async fn until_sidecars_read_the_config(&self) {
        let ends = if self.ended {
            "2001-01-01"
        } else {
            "2099-01-01"
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        for http in &self.https {
            while std::time::Instant::now() < deadline {
                let read = http.get(&format!("/v1/drops/{}", self.drop)).await.ok();
                let current = read.is_some_and(|reply| {
                    reply.body.get("limit").and_then(|l| l.as_i64()) == Some(self.limit)
                        && reply
                            .body
                            .get("endsAt")
                            .and_then(|e| e.as_str())
                            .is_some_and(|e| e.starts_with(ends))
                });
                if current {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }

    fn http(&self, i: usize) -> &HttpClient {
        &self.https[i % SIDECARS]
    }

    async fn apply(&mut self, rng: &mut StdRng, step: Step) {
        match step {
            Step::Rush(n) => {
                let first = self.next_key;
                self.next_key += n;
                let replies = self.reserve_all((first..first + n).map(|i| (i, i))).await;
                self.note_reserves(replies);
            }
            Step::Retry(n) => {
                if self.next_key == 0 {
                    return;
                }
                // Half of them through another sidecar than their first attempt.
                let picked: Vec<(usize, usize)> = (0..n)
                    .map(|_| {
                        let i = rng.random_range(0..self.next_key);
                        (i, i + usize::from(rng.random_bool(0.5)))
                    })
                    .collect();
                let replies = self.reserve_all(picked.into_iter()).await;
                self.note_reserves(replies);
            }
            Step::Confirm(n) => {
                let picked = self.pick_held(rng, n);
                let this = &*self;
                join_all(
                    picked
                        .iter()
                        .enumerate()
                        .map(|(i, k)| settle(this.http(i), &this.drop, k, "confirm")),
                )
                .await;
            }
            Step::DuplicateCancel(n) => {
                let picked = self.pick_held(rng, n);
                let this = &*self;
                let replies = join_all(picked.iter().flat_map(|k| {
                    (0..2).map(move |i| async move {
                        (
                            k.clone(),
                            settle(this.http(i), &this.drop, k, "cancel").await,
                        )
                    })
                }))
                .await;
                for (k, reply) in replies {
                    match reply {
                        Some(r)
                            if r.outcome() == "cancelled" || r.outcome() == "already_cancelled" =>
                        {
                            self.cancelled.insert(k);
                        }
                        // A sidecar that died under the request: it may have happened.
                        None => {
                            self.cancel_unknown.insert(k);
                        }
                        // 503: retried as a buyer would (a cancel Redis made but the
                        // ledger did not record is recorded by its retry).
                        Some(r) if r.status == 503 => match self.cancel_until_answered(&k).await {
                            Some(outcome)
                                if outcome == "cancelled" || outcome == "already_cancelled" =>
                            {
                                self.cancelled.insert(k);
                            }
                            Some(_) => {}
                            None => {
                                self.cancel_unknown.insert(k);
                            }
                        },
                        Some(_) => {}
                    }
                }
            }
            Step::Restock(by) => {
                self.limit += by;
                self.publish();
            }
            Step::LimitCut(by) => {
                self.limit = (self.limit - by).max(1);
                self.publish();
            }
            Step::MoveEnd(past) => {
                self.ended = past;
                self.publish();
            }
            Step::StallLedger(n) => {
                let mut tx = self.lab.pool.begin().await.expect("begin");
                sqlx::query("LOCK TABLE reservations IN ACCESS EXCLUSIVE MODE")
                    .execute(&mut *tx)
                    .await
                    .expect("lock");
                let holder = tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(3000)).await;
                    let _ = tx.commit().await;
                });
                let first = self.next_key;
                self.next_key += n;
                let replies = self.reserve_all((first..first + n).map(|i| (i, i))).await;
                // New keys, asked once each: a 503 that says nothing landed refused
                // the admission and undid it, and its commit, let through when the
                // lock goes, is refused too.
                let refused: Vec<(String, String)> = replies
                    .iter()
                    .filter_map(|(k, reply)| reply.as_ref().map(|reply| (k, reply)))
                    .filter(|(_, reply)| {
                        reply.status == 503
                            && !reply.text.contains("without saying whether it landed")
                    })
                    .map(|(k, reply)| (k.clone(), reply.text.clone()))
                    .collect();
                self.note_reserves(replies);
                let _ = holder.await;
                tokio::time::sleep(Duration::from_millis(500)).await;
                for (k, text) in refused {
                    let state = self.marker_state(&k);
                    assert!(
                        !matches!(state.as_deref(), Some("pending" | "active" | "confirmed")),
                        "{k}: answered 503 ({text}), yet Redis holds it {state:?}"
                    );
                    let row: Option<(String,)> = sqlx::query_as(
                        "SELECT state FROM reservations WHERE drop_key LIKE $1 AND res_key = $2 AND state IN ('active', 'confirmed')",
                    )
                    .bind(format!("{NS}/{}/%", self.drop))
                    .bind(&k)
                    .fetch_optional(&self.lab.pool)
                    .await
                    .expect("the ledger answers");
                    assert_eq!(
                        row, None,
                        "{k}: answered 503 ({text}), yet the ledger holds it"
                    );
                }
            }
            Step::LedgerDownUnderSettle(n) => {
                let picked = self.pick_held(rng, n);
                self.lab.postgres.stop().expect("PostgreSQL stops");
                for (i, k) in picked.iter().enumerate() {
                    let op = if i % 2 == 0 { "cancel" } else { "confirm" };
                    let before = self.marker_state(k);
                    match settle(self.http(i), &self.drop, k, op).await {
                        Some(reply) if reply.status == 503 => assert_eq!(
                            self.marker_state(k),
                            before,
                            "{k}: a {op} answered 503 changed Redis: {}",
                            reply.text
                        ),
                        Some(reply)
                            if reply.outcome() == "cancelled"
                                || reply.outcome() == "already_cancelled" =>
                        {
                            self.cancelled.insert(k.clone());
                        }
                        Some(_) => {}
                        None => {
                            if op == "cancel" {
                                self.cancel_unknown.insert(k.clone());
                            }
                        }
                    }
                }
                self.lab
                    .postgres
                    .start_again()
                    .expect("PostgreSQL starts again");
            }
            Step::ScaleInBeforeLossyFailover(s) => {
                self.checkpoint = self.lab.redis.checkpoint();
                self.checkpoint_sold = self.redis_sold().unwrap_or(0);
                let first = self.next_key;
                self.next_key += SCALED_IN_RUSH;
                let replies = self
                    .reserve_all((first..first + SCALED_IN_RUSH).map(|i| (i, s)))
                    .await;
                self.note_reserves(replies);
                // Scaled in: gone before the failover, and not back until the other
                // pod has sold on the Redis that lost its writes.
                kill_9(self.sidecars[s].pid());
                self.lab
                    .redis
                    .roll_back_to(&self.checkpoint)
                    .expect("Redis rolls back");
                self.lost_at_ms = now_ms();
                self.publish();
                let other = (s + 1) % SIDECARS;
                let first = self.next_key;
                self.next_key += SCALED_IN_RUSH;
                let replies = self
                    .reserve_all((first..first + SCALED_IN_RUSH).map(|i| (i, other)))
                    .await;
                self.note_reserves(replies);
                let fresh = self.start_sidecar().await;
                self.https[s] = HttpClient::new(fresh.base.clone());
                std::mem::replace(&mut self.sidecars[s], fresh).kill();
            }
            Step::MixedLedger(n) => {
                // The sale's ledger is the one that claimed it: the shared ledger's
                // sidecars, which a buyer reaches first. (A ledger new to a sale whose
                // Redis lost the claim before anyone wrote it back may claim it: the
                // README's "Not guaranteed" (1); the operator writes it back from
                // status.ledger, which `apply` has not.)
                for attempt in 0..50 {
                    if self.redis_text(DropKeys::ledger).is_some() {
                        break;
                    }
                    let first = self.next_key;
                    self.next_key += 1;
                    let replies = self.reserve_all(std::iter::once((first, attempt))).await;
                    self.note_reserves(replies);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                if self.redis_text(DropKeys::ledger).is_none() {
                    return;
                }
                let sqlite = format!(
                    "sqlite://{}",
                    self.lab
                        .dir
                        .path()
                        .join(format!("{}-pod.db", self.drop))
                        .display()
                );
                let pod = SidecarProcess::start(&self.lab.redis.url(), NS, &sqlite)
                    .await
                    .expect("a per-pod sidecar starts");
                let http = HttpClient::new(pod.base.clone());
                let first = self.next_key;
                self.next_key += n;
                for i in first..first + n {
                    if let Some(reply) = reserve(&http, &self.drop, &key(i)).await {
                        assert_ne!(
                            reply.status,
                            201,
                            "{}: a pod whose ledger is not the sale's sold: {}",
                            key(i),
                            reply.text
                        );
                    }
                }
                pod.kill();
            }
            Step::KillSwitch(on) => {
                self.gate_on = on;
                self.publish();
            }
            Step::RedisRestart => {
                self.until_sidecars_read_the_config().await;
                self.lab.redis.restart().expect("redis restarts empty");
                self.lost_at_ms = now_ms();
                self.checkpoint = Checkpoint::default();
                self.publish();
            }
            Step::Checkpoint => {
                self.checkpoint = self.lab.redis.checkpoint();
                self.checkpoint_sold = self.redis_sold().unwrap_or(0);
            }
            Step::LoseSinceCheckpoint => {
                if !self.checkpoint.is_empty() {
                    self.until_sidecars_read_the_config().await;
                    self.lab
                        .redis
                        .roll_back_to(&self.checkpoint)
                        .expect("Redis rolls back");
                    self.lost_at_ms = now_ms();
                    // The failover may have lost a config change too: the operator's
                    // next reconcile publishes the drop again (README, "Not
                    // guaranteed" (6): until then Redis's config decides).
                    self.publish();
                }
            }
            Step::KillSidecar(s) => {
                // New buyers on the doomed sidecar; the kill lands among them.
                let first = self.next_key;
                self.next_key += KILLED_MID_RUSH;
                let delay = Duration::from_millis(rng.random_range(0..15));
                let doomed = self.sidecars[s].pid();
                let killer = async move {
                    tokio::time::sleep(delay).await;
                    kill_9(doomed);
                };
                let rush = self.reserve_all((first..first + KILLED_MID_RUSH).map(|i| (i, s)));
                let (replies, ()) = tokio::join!(rush, killer);
                self.note_reserves(replies);
                let fresh = self.start_sidecar().await;
                self.https[s] = HttpClient::new(fresh.base.clone());
                std::mem::replace(&mut self.sidecars[s], fresh).kill();
            }
        }
    }

    /// Reserves key `k` through sidecar `via` for each `(k, via)`, all at once.
    async fn reserve_all(
        &self,
        picked: impl Iterator<Item = (usize, usize)>,
    ) -> Vec<(String, Option<Reply>)> {
        join_all(picked.map(|(i, via)| async move {
            let k = key(i);
            let reply = reserve(self.http(via), &self.drop, &k).await;
            (k, reply)
        }))
        .await
    }

    /// Retries the cancel of `k` until it is answered other than 503 (20 times at
    /// most); its outcome, or `None` if it never was.
    async fn cancel_until_answered(&self, k: &str) -> Option<String> {
        for attempt in 0..20 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if let Some(reply) = settle(self.http(attempt), &self.drop, k, "cancel").await
                && reply.status != 503
            {
                return Some(reply.outcome().to_string());
            }
        }
        None
    }

    fn pick_held(&self, rng: &mut StdRng, n: usize) -> Vec<String> {
        let held: Vec<&String> = self.acknowledged.difference(&self.cancelled).collect();
        if held.is_empty() {
            return Vec::new();
        }
        (0..n)
            .map(|_| held[rng.random_range(0..held.len())].clone())
            .collect()
    }

    fn note_reserves(&mut self, replies: Vec<(String, Option<Reply>)>) {
        for (k, reply) in replies {
            let Some(reply) = reply else {
                self.heard
                    .entry(k.clone())
                    .or_default()
                    .push("no answer".into());
                self.reserve_unknown.insert(k);
                continue;
            };
            self.heard.entry(k.clone()).or_default().push(format!(
                "{} {}",
                reply.status.as_u16(),
                reply.text
            ));
            let state = reply.body.get("state").and_then(|s| s.as_str());
            let held = reply.status == 201
                || (reply.outcome() == "already_reserved"
                    && matches!(state, Some("active" | "confirmed")));
            if held && !self.acknowledged.contains(&k) && self.reserve_unknown.remove(&k) {
                self.revealed += 1;
            }
            if reply.status == 503 && reply.text.contains("without saying whether it landed") {
                self.reserve_unknown.insert(k.clone());
            }
            if reply.status == 201 {
                assert!(
                    !self.ended,
                    "{k}: admitted after the sale ended: {}",
                    reply.text
                );
                self.acknowledged.insert(k);
            } else if reply.outcome() == "already_reserved" {
                // A retry hears what its key holds, cancelled included; never a
                // reservation that was not made (an admission taken back).
                if matches!(state, Some("active" | "confirmed")) {
                    self.acknowledged.insert(k);
                } else {
                    assert!(
                        self.acknowledged.contains(&k),
                        "{k}: already_reserved names a reservation never made: {}",
                        reply.text
                    );
                    self.cancelled.insert(k);
                }
            } else {
                assert!(
                    matches!(reply.status.as_u16(), 403 | 409 | 503),
                    "{k}: unexpected answer {} {}",
                    reply.status,
                    reply.text
                );
            }
        }
    }

    /// The state of `k`'s marker in Redis, if it has one (and Redis answers).
    fn marker_state(&self, k: &str) -> Option<String> {
        let mut conn = self.lab.redis.connection().ok()?;
        redis::cmd("HGET")
            .arg(DropKeys::new(NS, &self.drop).reservation(k))
            .arg("state")
            .query(&mut conn)
            .ok()
            .flatten()
    }

    /// Units the buyers were told they hold: acknowledged, and neither cancelled
    /// nor under a cancel whose answer never came.
    fn told_held(&self) -> i64 {
        self.acknowledged
            .iter()
            .filter(|k| !self.cancelled.contains(*k) && !self.cancel_unknown.contains(*k))
            .count() as i64
    }

    async fn ledger_held(&self) -> i64 {
        sqlx::query(
            "SELECT CAST(COALESCE(SUM(quantity), 0) AS BIGINT) FROM reservations \
             WHERE drop_key LIKE $1 AND state IN ('active', 'confirmed')",
        )
        .bind(format!("{NS}/{}/%", self.drop))
        .fetch_one(&self.lab.pool)
        .await
        .expect("the ledger answers")
        .get(0)
    }

    fn redis_int(&self, name: fn(&DropKeys) -> String) -> Option<i64> {
        let mut conn = self.lab.redis.connection().ok()?;
        redis::cmd("GET")
            .arg(name(&DropKeys::new(NS, &self.drop)))
            .query::<Option<i64>>(&mut conn)
            .ok()
            .map(|v| v.unwrap_or(0))
    }

    fn redis_text(&self, name: fn(&DropKeys) -> String) -> Option<String> {
        let mut conn = self.lab.redis.connection().ok()?;
        redis::cmd("GET")
            .arg(name(&DropKeys::new(NS, &self.drop)))
            .query::<Option<String>>(&mut conn)
            .ok()
            .flatten()
    }

    /// Where Redis and the ledger disagree, for a failure's message.
    async fn diagnose(&self) -> String {
        let keys = DropKeys::new(NS, &self.drop);
        let Ok(mut conn) = self.lab.redis.connection() else {
            return "Redis unreachable".into();
        };
        let config: HashMap<String, String> = redis::cmd("HGETALL")
            .arg(keys.config())
            .query(&mut conn)
            .unwrap_or_default();
        let buyers: HashMap<String, i64> = redis::cmd("HGETALL")
            .arg(keys.buyers())
            .query(&mut conn)
            .unwrap_or_default();
        let ledger: HashMap<String, String> =
            sqlx::query("SELECT res_key, state FROM reservations WHERE drop_key LIKE $1")
                .bind(format!("{NS}/{}/%", self.drop))
                .fetch_all(&self.lab.pool)
                .await
                .map(|rows| rows.iter().map(|row| (row.get(0), row.get(1))).collect())
                .unwrap_or_default();
        let mut states: HashMap<String, usize> = HashMap::new();
        let mut differ = Vec::new();
        for i in 0..self.next_key {
            let k = key(i);
            let state: Option<String> = redis::cmd("HGET")
                .arg(keys.reservation(&k))
                .arg("state")
                .query(&mut conn)
                .unwrap_or(None);
            if let Some(state) = &state {
                *states.entry(state.clone()).or_default() += 1;
            }
            if state.as_deref() != ledger.get(&k).map(String::as_str) {
                differ.push(format!("{k}: Redis {state:?} ledger {:?}", ledger.get(&k)));
            }
        }
        let stock: Option<(i64, i64, i64)> =
            sqlx::query("SELECT available, lim, generation FROM stock WHERE drop_key LIKE $1")
                .bind(format!("{NS}/{}/%", self.drop))
                .fetch_optional(&self.lab.pool)
                .await
                .ok()
                .flatten()
                .map(|row| (row.get(0), row.get(1), row.get(2)));
        format!(
            "config limit {:?} generation {:?}; remaining {:?} held {:?} buyers {}; markers {states:?}; ledger stock (available, limit, generation) {stock:?}; differ {differ:?}",
            config.get("limit"),
            config.get("generation"),
            self.redis_int(DropKeys::remaining),
            self.redis_int(DropKeys::held),
            buyers.values().sum::<i64>()
        )
    }

    /// Before a step: what each record may hold after it (see `allowed`).
    async fn note_allowed(&mut self) {
        let (told, ledger) = (self.told_held(), self.ledger_held().await);
        let redis = self.redis_sold().unwrap_or(0);
        self.allowed = (told, ledger, redis);
        self.revealed = 0;
        self.acknowledged_before = self.acknowledged.clone();
    }

    /// Never oversold, as the buyers were told it and as each store records it: no
    /// more than the limit in force, or than was held before the step when a cut
    /// left more held than the limit.
    async fn assert_never_oversold(&self, seed: u64, step: usize, what: Step) {
        let told = self.told_held();
        let recent = self.steps[self.steps.len().saturating_sub(12)..].join("; ");
        let at = format!("seed {seed} step {step} ({what:?}, after: {recent})");
        let (told_before, ledger_before, redis_before) = self.allowed;
        let allowed = |before: i64| self.limit.max(before);
        // A retry may hear of an admission whose first answer said nothing (its
        // outcome unknown): a unit held before the step, not a new sale.
        if told > allowed(told_before + self.revealed) {
            let newly: Vec<String> = self
                .acknowledged
                .difference(&self.acknowledged_before)
                .map(|k| format!("{k}: {:?}", self.heard.get(k)))
                .collect();
            panic!(
                "{at}: buyers hold {told} of {} (held before the step: {told_before}, of which {} they hear of only now); the ledger holds {}; newly told: {newly:?}\nnow: {}",
                self.limit,
                self.revealed,
                self.ledger_held().await,
                self.diagnose().await
            );
        }
        let ledger = self.ledger_held().await;
        assert!(
            ledger <= allowed(ledger_before),
            "{at}: the ledger holds {ledger} of {} (held before the step: {ledger_before})",
            self.limit
        );
        // Redis's record: the units its reservations hold. Pending markers are
        // admissions nobody was told of yet (a dead sidecar's stay until they are
        // abandoned), and while the gate is closed for a rebuild the count moves
        // row by row: neither is a sale. A Redis behind the ledger (it lost writes)
        // is brought back in line with it: up to what the ledger held before. A
        // roll-back puts back what its checkpoint held, until the rebuild.
        let rolled_back = match what {
            Step::LoseSinceCheckpoint | Step::ScaleInBeforeLossyFailover(_) => self.checkpoint_sold,
            _ => 0,
        };
        // Open: an epoch (a closed gate reads `closed:<epoch>`, or is absent).
        let gate = self
            .redis_text(DropKeys::gate)
            .filter(|g| g.parse::<i64>().is_ok());
        if gate.is_some()
            && let Some(sold) = self.redis_sold()
            && sold > allowed(redis_before.max(ledger_before).max(rolled_back))
        {
            let now = self.diagnose().await;
            tokio::time::sleep(Duration::from_secs(3)).await;
            panic!(
                "{at}: Redis's reservations hold {sold} of {} with its gate open at {gate:?} (the ledger holds {ledger})\nthen: {now}\n3 s later: {}",
                self.limit,
                self.diagnose().await
            );
        }
    }

    /// Units held by Redis's active and confirmed reservations.
    fn redis_sold(&self) -> Option<i64> {
        let keys = DropKeys::new(NS, &self.drop);
        let mut conn = self.lab.redis.connection().ok()?;
        let mut pipe = redis::pipe();
        for i in 0..self.next_key {
            pipe.cmd("HMGET")
                .arg(keys.reservation(&key(i)))
                .arg("state")
                .arg("quantity");
        }
        let markers: Vec<(Option<String>, Option<i64>)> = pipe.query(&mut conn).ok()?;
        Some(
            markers
                .into_iter()
                .filter(|(state, _)| matches!(state.as_deref(), Some("active" | "confirmed")))
                .map(|(_, quantity)| quantity.unwrap_or(0))
                .sum(),
        )
    }

    /// Everything healed and quiet: the invariants of docs/design.md.
    async fn assert_settled(&mut self, seed: u64) {
        self.gate_on = true;
        self.ended = false;
        self.publish();
        let mut last = String::new();
        let mut agreed = false;
        // Up to 45 s: a rebuild whose sidecar was killed mid-way is taken over
        // after 10 s, and a killed sidecar's pending admissions are abandoned after
        // their bound; on a loaded machine either can take a while.
        for _ in 0..450 {
            // A look-up nudges each sidecar to open the gate after a loss.
            for i in 0..SIDECARS {
                let _ = self.https[i]
                    .get(&format!("/v1/drops/{}/reservations/nudge", self.drop))
                    .await;
            }
            let remaining = self.redis_int(DropKeys::remaining).unwrap_or(-1);
            let held = self.redis_int(DropKeys::held).unwrap_or(-1);
            let ledger = self.ledger_held().await;
            last = format!(
                "remaining {remaining} held {held} ledger {ledger} limit {}",
                self.limit
            );
            if remaining + held == self.limit && held == ledger {
                agreed = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if !agreed {
            panic!(
                "seed {seed}: never quiet: {last}\n{}",
                self.diagnose().await
            );
        }

        let states: HashMap<String, String> =
            sqlx::query("SELECT res_key, state FROM reservations WHERE drop_key LIKE $1")
                .bind(format!("{NS}/{}/%", self.drop))
                .fetch_all(&self.lab.pool)
                .await
                .expect("the ledger answers")
                .iter()
                .map(|row| (row.get(0), row.get(1)))
                .collect();
        for k in self.acknowledged.difference(&self.cancelled) {
            let state = states.get(k).map(String::as_str);
            let held = matches!(state, Some("active" | "confirmed"));
            assert!(
                held || (self.cancel_unknown.contains(k) && state == Some("cancelled")),
                "seed {seed}: acknowledged {k} is {state:?} in the ledger"
            );
        }

        // Every event written since Redis last lost data reaches the stream.
        // A dispatcher killed mid-round keeps its claim on the drop's events for
        // the claim's 30 s; then the other sidecar's dispatcher takes them over.
        let mut sent = false;
        for _ in 0..450 {
            let unsent: i64 = sqlx::query(
                "SELECT COUNT(*) FROM outbox WHERE sent_at_ms IS NULL AND drop_key LIKE $1",
            )
            .bind(format!("{NS}/{}/%", self.drop))
            .fetch_one(&self.lab.pool)
            .await
            .expect("the ledger answers")
            .get(0);
            if unsent == 0 {
                sent = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(sent, "seed {seed}: the outbox never drained");
        let written: Vec<String> = sqlx::query(
            "SELECT event_id FROM outbox WHERE drop_key LIKE $1 AND created_at_ms > $2",
        )
        .bind(format!("{NS}/{}/%", self.drop))
        .bind(self.lost_at_ms + 1000)
        .fetch_all(&self.lab.pool)
        .await
        .expect("the ledger answers")
        .iter()
        .map(|row| row.get(0))
        .collect();
        let published = stream_event_ids(&self.lab.redis, &self.drop);
        for id in &written {
            assert!(
                published.contains_key(id),
                "seed {seed}: event {id} never reached the stream"
            );
        }
    }

    fn shutdown(self) -> Lab {
        for sidecar in self.sidecars {
            let _ = sidecar.terminate();
        }
        self.lab
    }
}

/// Each event id in the drop's stream, with how many times it is there.
fn stream_event_ids(redis: &RedisServer, drop: &str) -> HashMap<String, usize> {
    let mut conn = redis.connection().expect("connect");
    let entries: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg(DropKeys::new(NS, drop).events())
        .arg("-")
        .arg("+")
        .query(&mut conn)
        .expect("XRANGE");
    let mut ids = HashMap::new();
    for (_, fields) in entries {
        for (name, value) in fields {
            if name == "eventId" {
                *ids.entry(value).or_insert(0) += 1;
            }
        }
    }
    ids
}

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

async fn run(lab: Lab, seed: u64, ops: usize) -> Lab {
    eprintln!("schedule seed {seed} (replay: DROPGATE_SEED={seed})");
    let mut rng = StdRng::seed_from_u64(seed);
    let mut world = World::new(lab, seed).await;
    let (mut done, mut step) = (0, 0);
    while done < ops {
        let what = next_step(&mut rng);
        world.note_allowed().await;
        world.apply(&mut rng, what).await;
        world.assert_never_oversold(seed, step, what).await;
        world
            .steps
            .push(format!("{step} {what:?} -> limit {}", world.limit));
        done += what.ops();
        step += 1;
    }
    world.assert_settled(seed).await;
    eprintln!(
        "seed {seed}: {step} steps, {done} operations, {} acknowledged, {} cancelled, limit {}",
        world.acknowledged.len(),
        world.cancelled.len(),
        world.limit
    );
    world.shutdown()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn randomized_fault_schedules_never_oversell() {
    let ops = env_number("DROPGATE_OPS", 2000) as usize;
    let seeds: Vec<u64> = match std::env::var("DROPGATE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        Some(seed) => vec![seed],
        None => (1..=env_number("DROPGATE_SCHEDULES", 14)).collect(),
    };
    let mut lab = Lab::start().await;
    for seed in seeds {
        lab = run(lab, seed, ops).await;
    }
}
