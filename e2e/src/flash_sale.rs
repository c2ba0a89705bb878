//! The local flash sale: a real redis-server, `dropgate-operator apply`, a real
//! sidecar, and thousands of concurrent buyers who retry, duplicate and cancel the
//! way real clients do. It prints what happened and fails if anything was oversold.

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dropgate_api::InventoryDrop;
use dropgate_testkit::{HttpClient, RedisServer, Reply};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::Semaphore;

use crate::processes::{SidecarProcess, apply};

#[derive(Clone, Debug)]
pub struct Options {
    /// The InventoryDrop to sell (examples/drop.yaml).
    pub manifest: PathBuf,
    pub buyers: usize,
    /// Requests in flight at once.
    pub concurrency: usize,
    /// Per cent of buyers whose reserve is sent twice at once (a client retry
    /// racing its own original).
    pub duplicate_percent: u32,
    /// Per cent of admitted buyers who cancel instead of confirming.
    pub cancel_percent: u32,
    /// Per cent of cancels delivered twice.
    pub duplicate_cancel_percent: u32,
    /// Throttled buyers retry the same key this many times.
    pub throttle_retries: u32,
    pub seed: u64,
    /// Buyers check out through `POST /v1/carts`: a cart of their size (and, where
    /// the per-user limit allows two, a second size), confirmed or cancelled whole.
    pub carts: bool,
    /// The drop gets a waitlist: buyers turned away wait in line, the units that
    /// cancels return go to them in order, and they confirm what they are offered.
    pub waitlist: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            manifest: PathBuf::from("examples/drop.yaml"),
            buyers: 5000,
            concurrency: 1000,
            duplicate_percent: 10,
            cancel_percent: 10,
            duplicate_cancel_percent: 50,
            throttle_retries: 3,
            seed: 412,
            carts: false,
            waitlist: false,
        }
    }
}

/// What one buyer went through.
#[derive(Default)]
struct Buyer {
    /// One unit of each of these (the variant, on a drop with variants; a single
    /// reserve asks for one, a cart for one or two).
    lines: Vec<Option<String>>,
    /// Units held, confirmed and cancelled.
    admitted: u64,
    confirmed: u64,
    cancelled: u64,
    sold_out: u64,
    throttled: u64,
    unavailable: u64,
    retries_absorbed: u64,
    duplicate_cancels_absorbed: u64,
    unexpected: Vec<String>,
    reserve_latencies: Vec<Duration>,
    /// The key of this buyer's place in the waitlist, once it joined.
    waiting: Option<String>,
}

#[derive(Debug, Clone)]
pub struct Summary {
    pub buyers: usize,
    pub limit: i64,
    pub admitted: u64,
    pub confirmed: u64,
    pub cancelled: u64,
    pub sold_out: u64,
    pub throttled: u64,
    /// Reserves answered 503 because the ledger was busy, then tried again with
    /// the same key (what the answer asks).
    pub unavailable: u64,
    pub retries_absorbed: u64,
    pub duplicate_cancels_absorbed: u64,
    pub unexpected: Vec<String>,
    pub remaining: i64,
    pub held: i64,
    pub oversold: i64,
    pub requests: u64,
    pub elapsed: Duration,
    pub p50: Duration,
    pub p99: Duration,
    pub max: Duration,
    /// Per variant, for a drop with variants.
    pub variants: Vec<VariantSummary>,
    /// With `--waitlist`.
    pub waitlist: Option<WaitlistSummary>,
}

/// What the waitlist did.
#[derive(Debug, Clone, Default)]
pub struct WaitlistSummary {
    /// Buyers turned away who joined the line.
    pub joined: u64,
    /// Units that came back and went to waiting buyers (each confirmed).
    pub offered: u64,
    /// Entries still waiting when the sale went quiet.
    pub still_waiting: u64,
    /// Joins refused because the line was full.
    pub full: u64,
    /// Entries served out of their line's order (an entry served while one ahead
    /// of it, in the same line, still waits): must be 0.
    pub out_of_order: u64,
}

/// One variant's part of the sale.
#[derive(Debug, Clone, Default)]
pub struct VariantSummary {
    pub name: String,
    pub limit: i64,
    pub admitted: u64,
    pub confirmed: u64,
    pub cancelled: u64,
    /// As Redis counts it (unclamped), and what its reservations hold.
    pub remaining: i64,
    pub held: i64,
    pub oversold: i64,
}

impl Summary {
    /// docs/design.md's invariants, checked on the quiet system.
    pub fn violations(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.oversold != 0 {
            out.push(format!("oversold by {}", self.oversold));
        }
        if self.remaining + self.held != self.limit {
            out.push(format!(
                "remaining {} + held {} != limit {}",
                self.remaining, self.held, self.limit
            ));
        }
        if self.held != self.confirmed as i64 {
            out.push(format!(
                "held {} != confirmed {}",
                self.held, self.confirmed
            ));
        }
        for v in &self.variants {
            if v.oversold != 0 {
                out.push(format!("variant {} oversold by {}", v.name, v.oversold));
            }
            if v.remaining + v.held != v.limit {
                out.push(format!(
                    "variant {}: remaining {} + held {} != limit {}",
                    v.name, v.remaining, v.held, v.limit
                ));
            }
            if v.held != v.confirmed as i64 {
                out.push(format!(
                    "variant {}: held {} != confirmed {}",
                    v.name, v.held, v.confirmed
                ));
            }
        }
        if let Some(waitlist) = &self.waitlist
            && waitlist.out_of_order != 0
        {
            out.push(format!(
                "{} waitlist entries were served ahead of one still waiting",
                waitlist.out_of_order
            ));
        }
        if !self.unexpected.is_empty() {
            // The first answer of each kind (its outcome word), at most four kinds.
            let mut kinds: Vec<&String> = Vec::new();
            for answer in &self.unexpected {
                let outcome = |text: &str| {
                    serde_json::from_str::<serde_json::Value>(text)
                        .ok()
                        .and_then(|v| v["outcome"].as_str().map(str::to_string))
                };
                if kinds.len() < 4 && kinds.iter().all(|k| outcome(k) != outcome(answer)) {
                    kinds.push(answer);
                }
            }
            out.push(format!(
                "{} unexpected answers, the first of each kind: {kinds:?}",
                self.unexpected.len(),
            ));
        }
        out
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        writeln!(
            f,
            "flash sale: {} buyers for {} units",
            self.buyers, self.limit
        )?;
        writeln!(f, "  admitted                   {:>8}", self.admitted)?;
        writeln!(f, "    confirmed                {:>8}", self.confirmed)?;
        writeln!(f, "    cancelled (returned)     {:>8}", self.cancelled)?;
        writeln!(f, "  sold out                   {:>8}", self.sold_out)?;
        writeln!(f, "  throttled (then retried)   {:>8}", self.throttled)?;
        writeln!(f, "  unavailable (then retried) {:>8}", self.unavailable)?;
        writeln!(
            f,
            "  retries absorbed           {:>8}",
            self.retries_absorbed
        )?;
        writeln!(
            f,
            "  duplicate cancels absorbed {:>8}",
            self.duplicate_cancels_absorbed
        )?;
        writeln!(f, "  remaining                  {:>8}", self.remaining)?;
        writeln!(f, "  held (confirmed)           {:>8}", self.held)?;
        writeln!(f, "  oversold                   {:>8}", self.oversold)?;
        for v in &self.variants {
            writeln!(
                f,
                "  variant {:<12} limit {:>5}  admitted {:>5}  confirmed {:>5}  cancelled {:>4}  remaining {:>5}  oversold {}",
                v.name, v.limit, v.admitted, v.confirmed, v.cancelled, v.remaining, v.oversold
            )?;
        }
        if let Some(w) = &self.waitlist {
            writeln!(f, "  waitlist: joined           {:>8}", w.joined)?;
            writeln!(f, "    returned units offered   {:>8}", w.offered)?;
            writeln!(f, "    still waiting            {:>8}", w.still_waiting)?;
            writeln!(f, "    refused (line full)      {:>8}", w.full)?;
            writeln!(f, "    served out of order      {:>8}", w.out_of_order)?;
        }
        writeln!(
            f,
            "  unexpected answers         {:>8}",
            self.unexpected.len()
        )?;
        writeln!(
            f,
            "  reserve latency  p50 {:.2} ms  p99 {:.2} ms  max {:.2} ms",
            ms(self.p50),
            ms(self.p99),
            ms(self.max)
        )?;
        write!(
            f,
            "  {} requests in {:.2} s ({:.0} req/s)",
            self.requests,
            self.elapsed.as_secs_f64(),
            self.requests as f64 / self.elapsed.as_secs_f64().max(1e-9)
        )
    }
}

/// Runs the sale end to end with the binaries next to the running executable.
pub async fn run(options: &Options) -> Result<Summary, String> {
    let text = std::fs::read_to_string(&options.manifest)
        .map_err(|e| format!("cannot read {}: {e}", options.manifest.display()))?;
    let drop: InventoryDrop = serde_norway::from_str(&text)
        .map_err(|e| format!("{}: {e}", options.manifest.display()))?;
    let name = drop.metadata.name.clone().unwrap_or_default();
    let namespace = drop
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let limit = drop.spec.limit();

    let redis = RedisServer::start().map_err(|e| format!("redis-server: {e}"))?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    if options.waitlist {
        // The same drop with its waitlist on.
        let mut lined = drop.clone();
        lined.spec.waitlist.enabled = true;
        let manifest = dir.path().join("drop.yaml");
        let yaml = serde_norway::to_string(&lined).map_err(|e| e.to_string())?;
        std::fs::write(&manifest, yaml).map_err(|e| e.to_string())?;
        apply(&manifest, &redis.url())?;
    } else {
        apply(&options.manifest, &redis.url())?;
    }
    let ledger = format!("sqlite://{}", dir.path().join("ledger.db").display());
    let sidecar = SidecarProcess::start(&redis.url(), &namespace, &ledger).await?;
    let http = HttpClient::unchecked(sidecar.base.clone());

    let gate = Arc::new(Semaphore::new(options.concurrency));
    let started = Instant::now();
    let variants: Arc<Vec<String>> =
        Arc::new(drop.spec.variants.iter().map(|v| v.name.clone()).collect());
    let tasks: Vec<_> = (0..options.buyers)
        .map(|i| {
            let (http, gate, options, name, variants) = (
                http.clone(),
                gate.clone(),
                options.clone(),
                name.clone(),
                variants.clone(),
            );
            let per_user = drop.spec.per_user_limit;
            tokio::spawn(
                async move { buy(&http, &gate, &options, &name, &variants, per_user, i).await },
            )
        })
        .collect();
    let mut buyers = Vec::with_capacity(tasks.len());
    for task in tasks {
        buyers.push(task.await.map_err(|e| format!("a buyer panicked: {e}"))?);
    }
    let waitlist = if options.waitlist {
        Some(serve_the_line(&http, &redis, &namespace, &name, &mut buyers).await?)
    } else {
        None
    };
    let elapsed = started.elapsed();

    let drop_path = format!("/v1/drops/{name}");
    let shown = http.get(&drop_path).await.map_err(|e| e.to_string())?;
    let mut conn = redis.connection().map_err(|e| e.to_string())?;
    let keys = dropgate_api::DropKeys::new(&namespace, &name);
    type Counts = (
        Option<i64>,
        Option<i64>,
        std::collections::HashMap<String, i64>,
    );
    let (remaining, held, variant_counts): Counts = redis::pipe()
        .get(keys.remaining())
        .get(keys.held())
        .hgetall(keys.variants())
        .query(&mut conn)
        .map_err(|e| e.to_string())?;
    let status = sidecar.terminate()?;
    if !status.success() {
        return Err(format!("the sidecar exited with {status} on SIGTERM"));
    }

    let mut latencies: Vec<Duration> = Vec::new();
    let mut summary = Summary {
        buyers: options.buyers,
        limit,
        admitted: 0,
        confirmed: 0,
        cancelled: 0,
        sold_out: 0,
        throttled: 0,
        unavailable: 0,
        retries_absorbed: 0,
        duplicate_cancels_absorbed: 0,
        unexpected: Vec::new(),
        remaining: remaining.unwrap_or(0),
        held: held.unwrap_or(0),
        oversold: 0,
        requests: 0,
        elapsed,
        p50: Duration::ZERO,
        p99: Duration::ZERO,
        max: Duration::ZERO,
        variants: drop
            .spec
            .variants
            .iter()
            .map(|v| VariantSummary {
                name: v.name.clone(),
                limit: v.quantity,
                remaining: variant_counts
                    .get(&format!("r:{}", v.name))
                    .copied()
                    .unwrap_or(0),
                held: variant_counts
                    .get(&format!("h:{}", v.name))
                    .copied()
                    .unwrap_or(0),
                ..VariantSummary::default()
            })
            .collect(),
        waitlist,
    };
    for buyer in buyers {
        // Each line holds one unit: a buyer's counts are per line.
        let per_line = |units: u64| units / buyer.lines.len().max(1) as u64;
        for name in buyer.lines.iter().flatten() {
            if let Some(v) = summary.variants.iter_mut().find(|v| v.name == *name) {
                v.admitted += per_line(buyer.admitted);
                v.confirmed += per_line(buyer.confirmed);
                v.cancelled += per_line(buyer.cancelled);
            }
        }
        summary.admitted += buyer.admitted;
        summary.confirmed += buyer.confirmed;
        summary.cancelled += buyer.cancelled;
        summary.sold_out += buyer.sold_out;
        summary.throttled += buyer.throttled;
        summary.unavailable += buyer.unavailable;
        summary.retries_absorbed += buyer.retries_absorbed;
        summary.duplicate_cancels_absorbed += buyer.duplicate_cancels_absorbed;
        summary.unexpected.extend(buyer.unexpected);
        latencies.extend(buyer.reserve_latencies);
    }
    summary.requests = latencies.len() as u64
        + summary.confirmed
        + summary.cancelled
        + summary.duplicate_cancels_absorbed;
    summary.oversold = (summary.admitted as i64 - summary.cancelled as i64 - limit).max(0);
    for v in &mut summary.variants {
        v.oversold = (v.admitted as i64 - v.cancelled as i64 - v.limit).max(0);
    }
    if shown.body["remaining"].as_i64() != Some(summary.remaining.max(0)) {
        summary.unexpected.push(format!(
            "GET {drop_path} shows {} but Redis holds {}",
            shown.text, summary.remaining
        ));
    }
    latencies.sort_unstable();
    summary.p50 = crate::quantile(&latencies, 0.50);
    summary.p99 = crate::quantile(&latencies, 0.99);
    summary.max = crate::quantile(&latencies, 1.0);
    Ok(summary)
}

async fn timed(buyer: &mut Buyer, http: &HttpClient, path: &str, body: &str) -> Option<Reply> {
    let started = Instant::now();
    let reply = http.post(path, body).await;
    buyer.reserve_latencies.push(started.elapsed());
    match reply {
        Ok(reply) => Some(reply),
        Err(e) => {
            buyer.unexpected.push(format!("reserve failed: {e}"));
            None
        }
    }
}

async fn buy(
    http: &HttpClient,
    gate: &Semaphore,
    options: &Options,
    drop: &str,
    variants: &[String],
    per_user_limit: i64,
    i: usize,
) -> Buyer {
    let mut rng = StdRng::seed_from_u64(options.seed.wrapping_add(i as u64));
    let mut buyer = Buyer::default();
    let Ok(_in_flight) = gate.acquire().await else {
        return buyer;
    };
    let key = format!("order-{i}");
    // A drop with variants: each buyer wants one of them, picked at random; a cart
    // takes a second size when the per-user limit allows two.
    let pick = |rng: &mut StdRng| {
        (!variants.is_empty()).then(|| variants[rng.random_range(0..variants.len())].clone())
    };
    buyer.lines.push(pick(&mut rng));
    if options.carts && per_user_limit >= 2 && variants.len() >= 2 {
        let first = buyer.lines[0].clone();
        let second = variants
            .iter()
            .find(|v| Some(*v) != first.as_ref())
            .cloned();
        buyer.lines.push(second);
    }
    let (path, body) = if options.carts {
        let lines: Vec<serde_json::Value> = buyer
            .lines
            .iter()
            .map(|variant| match variant {
                Some(v) => serde_json::json!({"drop": drop, "variant": v, "quantity": 1}),
                None => serde_json::json!({"drop": drop, "quantity": 1}),
            })
            .collect();
        let body = serde_json::json!({"key": key, "user": format!("buyer-{i}"), "lines": lines});
        ("/v1/carts".to_string(), body.to_string())
    } else {
        let variant = buyer.lines[0]
            .as_ref()
            .map_or(String::new(), |v| format!(r#","variant":"{v}""#));
        (
            format!("/v1/drops/{drop}/reservations"),
            format!(r#"{{"key":"{key}","user":"buyer-{i}","quantity":1{variant}}}"#),
        )
    };
    let units = buyer.lines.len() as u64;
    let duplicate = rng.random_range(0..100) < options.duplicate_percent;

    for attempt in 0..=options.throttle_retries {
        let replies = if duplicate && attempt == 0 {
            let mut twin = Buyer::default();
            let (a, b) = tokio::join!(
                timed(&mut buyer, http, &path, &body),
                timed(&mut twin, http, &path, &body)
            );
            buyer.reserve_latencies.extend(twin.reserve_latencies);
            buyer.unexpected.extend(twin.unexpected);
            [a, b].into_iter().flatten().collect::<Vec<_>>()
        } else {
            timed(&mut buyer, http, &path, &body)
                .await
                .into_iter()
                .collect()
        };
        let mut admitted = false;
        let mut throttled = false;
        let mut busy = false;
        for reply in &replies {
            match (reply.status.as_u16(), reply.outcome()) {
                (201, "admitted" | "reserved") => admitted = true,
                (200, "already_reserved") => {
                    buyer.retries_absorbed += 1;
                    admitted |= reply.body["state"] == "active";
                }
                (409, "sold_out" | "short") => buyer.sold_out += 1,
                (503, "throttled") => throttled = true,
                // The ledger was busy: nothing changed, the same key is tried
                // again.
                (503, "unavailable") => {
                    buyer.unavailable += 1;
                    busy = true;
                }
                // A cart that held lines before a 503 gave them back and spent
                // its key: its retry learns nothing is held, and the buyer is
                // turned away.
                (409, "cancelled" | "refused") if buyer.unavailable > 0 => buyer.sold_out += 1,
                _ => buyer.unexpected.push(reply.text.clone()),
            }
        }
        if admitted {
            buyer.admitted += units;
            let base = if options.carts {
                format!("/v1/carts/{key}")
            } else {
                format!("/v1/drops/{drop}/reservations/{key}")
            };
            settle(&mut buyer, &mut rng, http, options, &base, units).await;
            return buyer;
        }
        if !throttled && !busy {
            if options.waitlist && !options.carts && buyer.sold_out > 0 {
                join_the_line(&mut buyer, http, drop, i).await;
            }
            return buyer;
        }
        buyer.throttled += u64::from(throttled);
        let wait = replies
            .iter()
            .find_map(|r| {
                r.headers
                    .get("retry-after")?
                    .to_str()
                    .ok()?
                    .parse::<u64>()
                    .ok()
            })
            .unwrap_or(1);
        tokio::time::sleep(Duration::from_secs(wait)).await;
    }
    buyer
}

async fn settle(
    buyer: &mut Buyer,
    rng: &mut StdRng,
    http: &HttpClient,
    options: &Options,
    base: &str,
    units: u64,
) {
    if rng.random_range(0..100) < options.cancel_percent {
        let times = if rng.random_range(0..100) < options.duplicate_cancel_percent {
            2
        } else {
            1
        };
        for sent in 0..times {
            match until_decided(http, &format!("{base}/cancel")).await {
                Ok(r) if r.outcome() == "cancelled" => buyer.cancelled += units,
                // The first cancel sent hears `already_cancelled` only when a 503
                // of its own on the way (`outcomeUnknown`; `underWay` for a cart) had cancelled
                // it after all: the cancel is its.
                Ok(r) if r.outcome() == "already_cancelled" && sent == 0 => {
                    buyer.cancelled += units
                }
                Ok(r) if r.outcome() == "already_cancelled" => {
                    buyer.duplicate_cancels_absorbed += 1
                }
                Ok(r) => buyer.unexpected.push(r.text),
                Err(e) => buyer.unexpected.push(format!("cancel failed: {e}")),
            }
        }
    } else {
        match until_decided(http, &format!("{base}/confirm")).await {
            // (`already_confirmed`: a 503 of its own on the way had confirmed it.)
            Ok(r) if matches!(r.outcome(), "confirmed" | "already_confirmed") => {
                buyer.confirmed += units
            }
            Ok(r) => buyer.unexpected.push(r.text),
            Err(e) => buyer.unexpected.push(format!("confirm failed: {e}")),
        }
    }
}

/// Posts a confirm or cancel again while it answers 503 (the ledger was slow or
/// busy; one that may have changed something says so, and the retry learns how it
/// went), as a shop's checkout does, a few times within the hold.
async fn until_decided(http: &HttpClient, path: &str) -> Result<Reply, String> {
    let mut reply = http.post(path, "").await.map_err(|e| e.to_string())?;
    for _ in 0..20 {
        if reply.status.as_u16() != 503 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
        reply = http.post(path, "").await.map_err(|e| e.to_string())?;
    }
    Ok(reply)
}

/// A buyer turned away joins the drop's line (the reserve's body under a key of
/// its own).
async fn join_the_line(buyer: &mut Buyer, http: &HttpClient, drop: &str, i: usize) {
    let key = format!("wait-{i}");
    let variant = buyer.lines[0]
        .as_ref()
        .map_or(String::new(), |v| format!(r#","variant":"{v}""#));
    let body = format!(r#"{{"key":"{key}","user":"buyer-{i}","quantity":1{variant}}}"#);
    match http
        .post(&format!("/v1/drops/{drop}/waitlist"), &body)
        .await
    {
        Ok(r) if r.status.as_u16() == 201 => buyer.waiting = Some(key),
        Ok(r) if r.outcome() == "waitlist_full" => {}
        Ok(r) => buyer.unexpected.push(r.text),
        Err(e) => buyer.unexpected.push(format!("join failed: {e}")),
    }
}

/// Once the buyers are done: every offer the line gets is confirmed by its buyer,
/// until no new offer came for a second; then checks the order the line was
/// served in, from each entry's position and state in Redis.
async fn serve_the_line(
    http: &HttpClient,
    redis: &RedisServer,
    namespace: &str,
    drop: &str,
    buyers: &mut [Buyer],
) -> Result<WaitlistSummary, String> {
    let keys = dropgate_api::DropKeys::new(namespace, drop);
    let mut conn = redis.connection().map_err(|e| e.to_string())?;
    let mut summary = WaitlistSummary {
        joined: buyers.iter().filter(|b| b.waiting.is_some()).count() as u64,
        ..WaitlistSummary::default()
    };
    let mut served = vec![false; buyers.len()];
    let mut quiet = 0;
    while quiet < 10 {
        let mut progress = false;
        for (n, buyer) in buyers.iter_mut().enumerate() {
            let Some(key) = buyer.waiting.clone() else {
                continue;
            };
            if served[n] {
                continue;
            }
            let state: Option<String> = redis::cmd("HGET")
                .arg(keys.waitlist_entry(&key))
                .arg("state")
                .query(&mut conn)
                .map_err(|e| e.to_string())?;
            if state.as_deref() != Some("offered") {
                continue;
            }
            served[n] = true;
            progress = true;
            buyer.admitted += 1;
            summary.offered += 1;
            match until_decided(
                http,
                &format!("/v1/drops/{drop}/reservations/{key}/confirm"),
            )
            .await
            {
                Ok(r) if r.outcome() == "confirmed" => buyer.confirmed += 1,
                Ok(r) => buyer.unexpected.push(r.text),
                Err(e) => buyer.unexpected.push(format!("confirm failed: {e}")),
            }
        }
        if progress {
            quiet = 0;
        } else {
            quiet += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    // Per line: every served entry must be ahead of every entry still waiting.
    let mut lines: std::collections::HashMap<String, (Vec<i64>, Vec<i64>)> =
        std::collections::HashMap::new();
    for buyer in buyers.iter() {
        let Some(key) = &buyer.waiting else {
            continue;
        };
        let (state, position, variant): (Option<String>, Option<i64>, Option<String>) =
            redis::cmd("HMGET")
                .arg(keys.waitlist_entry(key))
                .arg("state")
                .arg("position")
                .arg("variant")
                .query(&mut conn)
                .map_err(|e| e.to_string())?;
        let line = lines.entry(variant.unwrap_or_default()).or_default();
        match (state.as_deref(), position) {
            (Some("offered"), Some(p)) => line.0.push(p),
            (Some("waiting"), Some(p)) => {
                summary.still_waiting += 1;
                line.1.push(p);
            }
            _ => {}
        }
    }
    for (offered, waiting) in lines.values() {
        let first_waiting = waiting.iter().min().copied().unwrap_or(i64::MAX);
        summary.out_of_order += offered.iter().filter(|p| **p > first_waiting).count() as u64;
    }
    Ok(summary)
}
