#![forbid(unsafe_code)]
//! Times the sidecar's calls against baselines measured in the same run: a raw
//! Redis round trip (PING) and the sidecar's own `/healthz` (HTTP with no Redis and
//! no ledger). These machines are shared and noisy, so the ratios are the figures to
//! quote, not the milliseconds.
//!
//! A second table compares, with concurrent clients on one hot drop, the sidecar
//! with the designs it replaces (see [`dropgate_e2e::designs`]) and with the gate
//! script called straight from Rust: operations/s, p50/p99/p99.9 and the ratio to
//! that raw script, each row followed by its oversell check.
//!
//! `cargo run --release -p dropgate-e2e --bin bench -- --requests 3000`
//! (`--quick` for the few hundred calls the test command runs so the bench never
//! rots).

mod cpu_per_answer;

use dropgate_sidecar::reservation::Outcome;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use dropgate_e2e::processes::{SidecarProcess, apply};
use dropgate_testkit::{HttpClient, RedisServer};
use futures::future::join_all;
use warp::Filter;

#[derive(Parser)]
struct Cli {
    /// Calls per sequential measurement.
    #[arg(long, default_value_t = 3000)]
    requests: usize,
    /// Clients for the concurrent measurement.
    #[arg(long, default_value_t = 64)]
    clients: usize,
    /// A few hundred calls per row: proves the bench runs, measures nothing.
    #[arg(long)]
    quick: bool,
    /// Instead of the tables: mixed load for this many seconds (600 for the
    /// ten-minute soak), printing the sidecar's RSS as it goes; fails on any answer
    /// outside the expected ones.
    #[arg(long)]
    soak: Option<u64>,
    /// Instead of the tables: this many sales one after another on one sidecar and
    /// its SQLite ledger, each deleted when done, and the ledger's rows and file
    /// size after each once the retention has passed (see [`retention_sales`]).
    #[arg(long)]
    retention_sales: Option<u32>,
    /// Only the CPU-per-answer table (see [`cpu_per_answer`]).
    #[arg(long)]
    cpu: bool,
    /// Seconds each row of the CPU-per-answer table runs.
    #[arg(long, default_value_t = 8)]
    cpu_seconds: u64,
    /// Another dropgate-sidecar binary (an earlier build) measured in the same run:
    /// its reserve and sold-out rows come after this build's, on drops of their own.
    #[arg(long)]
    baseline_sidecar: Option<std::path::PathBuf>,
    /// The dropgate-sidecar binary the CPU-per-answer table runs (default: this
    /// build's). One built with `--features allocation-count` adds allocations
    /// per answer to each row (its CPU figures are then the counting build's); one
    /// without it gives none, silently. Read by `--cpu` only.
    #[arg(long)]
    sidecar: Option<std::path::PathBuf>,
}

struct Row {
    name: &'static str,
    p50: Duration,
    p99: Duration,
}

fn percentiles(mut samples: Vec<Duration>) -> (Duration, Duration) {
    samples.sort_unstable();
    (
        dropgate_e2e::quantile(&samples, 0.5),
        dropgate_e2e::quantile(&samples, 0.99),
    )
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(&cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: &Cli) -> Result<(), String> {
    if let Some(seconds) = cli.soak {
        return soak(cli.clients, Duration::from_secs(seconds)).await;
    }
    if let Some(sales) = cli.retention_sales {
        return retention_sales(sales, if cli.quick { 50 } else { 500 }).await;
    }
    let cpu = cpu_per_answer::Options {
        length: Duration::from_secs(if cli.quick { 1 } else { cli.cpu_seconds.max(1) }),
        clients: cli.clients,
        fleet: 8,
        sidecar: cli.sidecar.clone(),
    };
    if cli.cpu {
        return cpu_per_answer::table(&cpu).await;
    }
    let n = if cli.quick { 100 } else { cli.requests.max(10) };
    let redis = RedisServer::start().map_err(|e| e.to_string())?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let manifest = dir.path().join("bench.yaml");
    std::fs::write(
        &manifest,
        "apiVersion: dropgate.io/v1alpha1\nkind: InventoryDrop\nmetadata: {name: bench, namespace: shop}\n\
         spec:\n  sku: BENCH\n  limitedQuantity: 10000000\n  redis: {url: redis://unused:1}\n  throttle: {permits: 1000000}\n",
    )
    .map_err(|e| e.to_string())?;
    apply(&manifest, &redis.url())?;
    let ledger = format!("sqlite://{}", dir.path().join("ledger.db").display());
    let sidecar = SidecarProcess::start(&redis.url(), "shop", &ledger).await?;
    let http = HttpClient::unchecked(sidecar.base.clone());
    let client = redis::Client::open(redis.url()).map_err(|e| e.to_string())?;
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| e.to_string())?;

    let mut rows = Vec::new();
    let mut timings = Vec::with_capacity(n);
    for _ in 0..n {
        let started = Instant::now();
        let _: String = redis::cmd("PING")
            .query_async(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
        timings.push(started.elapsed());
    }
    let (p50, p99) = percentiles(std::mem::take(&mut timings));
    rows.push(Row {
        name: "redis PING (baseline)",
        p50,
        p99,
    });

    for _ in 0..n {
        let started = Instant::now();
        http.get("/healthz").await.map_err(|e| e.to_string())?;
        timings.push(started.elapsed());
    }
    let (p50, p99) = percentiles(std::mem::take(&mut timings));
    rows.push(Row {
        name: "GET /healthz (HTTP floor)",
        p50,
        p99,
    });

    for i in 0..n {
        let body = format!(r#"{{"key":"s{i}","user":"u{i}","quantity":1}}"#);
        let started = Instant::now();
        let reply = http
            .post("/v1/drops/bench/reservations", &body)
            .await
            .map_err(|e| e.to_string())?;
        timings.push(started.elapsed());
        if reply.status != 201 {
            return Err(format!("reserve answered {}", reply.text));
        }
    }
    let (p50, p99) = percentiles(std::mem::take(&mut timings));
    rows.push(Row {
        name: "reserve (gate + ledger)",
        p50,
        p99,
    });

    for i in 0..n {
        let started = Instant::now();
        http.post(&format!("/v1/drops/bench/reservations/s{i}/confirm"), "")
            .await
            .map_err(|e| e.to_string())?;
        timings.push(started.elapsed());
    }
    let (p50, p99) = percentiles(std::mem::take(&mut timings));
    rows.push(Row {
        name: "confirm (gate + ledger)",
        p50,
        p99,
    });

    // A cart of two lines on two drops (each line held by its drop's reserve, one
    // after the other), then its confirm: what a checkout of two items costs.
    let second = dir.path().join("bench-b.yaml");
    std::fs::write(
        &second,
        "apiVersion: dropgate.io/v1alpha1\nkind: InventoryDrop\nmetadata: {name: bench-b, namespace: shop}\n\
         spec:\n  sku: BENCH-B\n  limitedQuantity: 10000000\n  redis: {url: redis://unused:1}\n  throttle: {permits: 1000000}\n",
    )
    .map_err(|e| e.to_string())?;
    apply(&second, &redis.url())?;
    for i in 0..n {
        let body = format!(
            r#"{{"key":"cart{i}","user":"cu{i}","lines":[{{"drop":"bench","quantity":1}},{{"drop":"bench-b","quantity":1}}]}}"#
        );
        let started = Instant::now();
        let reply = http
            .post("/v1/carts", &body)
            .await
            .map_err(|e| e.to_string())?;
        timings.push(started.elapsed());
        if reply.status != 201 {
            return Err(format!("a cart answered {}", reply.text));
        }
    }
    let (p50, p99) = percentiles(std::mem::take(&mut timings));
    rows.push(Row {
        name: "cart of 2 drops",
        p50,
        p99,
    });
    for i in 0..n {
        let started = Instant::now();
        let reply = http
            .post(&format!("/v1/carts/cart{i}/confirm"), "")
            .await
            .map_err(|e| e.to_string())?;
        timings.push(started.elapsed());
        if reply.status != 200 {
            return Err(format!("a cart's confirm answered {}", reply.text));
        }
    }
    let (p50, p99) = percentiles(std::mem::take(&mut timings));
    rows.push(Row {
        name: "cart confirm (2 lines)",
        p50,
        p99,
    });

    // The same reserve from a sidecar that waits for a replica's acknowledgement
    // (--wait-replicas 1) before each 201.
    let replica = RedisServer::start_replica_of(&redis).map_err(|e| e.to_string())?;
    // On a drop of its own: a sale is recorded by one ledger.
    let waiting_manifest = dir.path().join("waiting.yaml");
    std::fs::write(
        &waiting_manifest,
        "apiVersion: dropgate.io/v1alpha1\nkind: InventoryDrop\nmetadata: {name: bench-wait, namespace: shop}\n\
         spec:\n  sku: BENCH-WAIT\n  limitedQuantity: 10000000\n  redis: {url: redis://unused:1}\n  throttle: {permits: 1000000}\n",
    )
    .map_err(|e| e.to_string())?;
    apply(&waiting_manifest, &redis.url())?;
    let waiting_ledger = format!("sqlite://{}", dir.path().join("waiting.db").display());
    let waiting = SidecarProcess::start_with(
        &redis.url(),
        "shop",
        &waiting_ledger,
        &["--wait-replicas", "1", "--wait-timeout-ms", "1000"],
    )
    .await?;
    let waiting_http = HttpClient::unchecked(waiting.base.clone());
    for i in 0..n {
        let body = format!(r#"{{"key":"w{i}","user":"w{i}","quantity":1}}"#);
        let started = Instant::now();
        let reply = waiting_http
            .post("/v1/drops/bench-wait/reservations", &body)
            .await
            .map_err(|e| e.to_string())?;
        timings.push(started.elapsed());
        if reply.status != 201 {
            return Err(format!("reserve with WAIT answered {}", reply.text));
        }
    }
    let (p50, p99) = percentiles(std::mem::take(&mut timings));
    rows.push(Row {
        name: "reserve, WAIT 1 replica",
        p50,
        p99,
    });

    let floor = rows[1].p50.as_secs_f64();
    let ping = rows[0].p50.as_secs_f64();
    println!(
        "{:<28} {:>10} {:>10} {:>10} {:>10}",
        "sequential, one client", "p50 ms", "p99 ms", "x PING", "x healthz"
    );
    for row in &rows {
        println!(
            "{:<28} {:>10.3} {:>10.3} {:>10.1} {:>10.1}",
            row.name,
            row.p50.as_secs_f64() * 1e3,
            row.p99.as_secs_f64() * 1e3,
            row.p50.as_secs_f64() / ping,
            row.p50.as_secs_f64() / floor
        );
    }

    // Throughput with concurrent clients: reserve against /healthz.
    let per_client = (n / cli.clients.max(1)).max(1);
    let healthz_rate = throughput(cli.clients, per_client, |_, _| {
        let http = http.clone();
        async move {
            http.get("/healthz")
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        }
    })
    .await?;
    let reserve_rate = throughput(cli.clients, per_client, |c, i| {
        let http = http.clone();
        async move {
            let body = format!(r#"{{"key":"c{c}-{i}","user":"c{c}-{i}","quantity":1}}"#);
            http.post("/v1/drops/bench/reservations", &body)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        }
    })
    .await?;
    println!();
    println!(
        "{} concurrent clients          req/s     x healthz",
        cli.clients
    );
    println!(
        "{:<28} {:>10.0} {:>10.2}",
        "GET /healthz", healthz_rate, 1.0
    );
    println!(
        "{:<28} {:>10.0} {:>10.2}",
        "reserve",
        reserve_rate,
        reserve_rate / healthz_rate
    );
    let waiting_rate = throughput(cli.clients, per_client, |c, i| {
        let http = waiting_http.clone();
        async move {
            let body = format!(r#"{{"key":"wc{c}-{i}","user":"wc{c}-{i}","quantity":1}}"#);
            http.post("/v1/drops/bench/reservations", &body)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        }
    })
    .await?;
    println!(
        "{:<28} {:>10.0} {:>10.2}",
        "reserve, WAIT 1 replica",
        waiting_rate,
        waiting_rate / healthz_rate
    );
    drop(replica);
    compare_designs(cli, n, &redis, &http).await?;
    for process in [sidecar, waiting] {
        let status = process.terminate()?;
        if !status.success() {
            return Err(format!("sidecar exited with {status}"));
        }
    }
    cpu_per_answer::table(&cpu).await
}

async fn throughput<F, Fut>(clients: usize, per_client: usize, call: F) -> Result<f64, String>
where
    F: Fn(usize, usize) -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let started = Instant::now();
    let results = join_all((0..clients).map(|c| {
        let call = &call;
        async move {
            for i in 0..per_client {
                call(c, i).await?;
            }
            Ok::<(), String>(())
        }
    }))
    .await;
    results.into_iter().collect::<Result<Vec<()>, String>>()?;
    Ok((clients * per_client) as f64 / started.elapsed().as_secs_f64())
}

/// One row of the comparison: what was measured and how it went.
struct Measured {
    name: String,
    per_second: f64,
    p50: Duration,
    p99: Duration,
    p999: Duration,
    check: String,
}

/// Runs `per_client` calls on each of `clients` concurrent clients and times each.
async fn measure<F, Fut>(
    clients: usize,
    per_client: usize,
    call: F,
) -> Result<(f64, Vec<Duration>), String>
where
    F: Fn(usize, usize) -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let started = Instant::now();
    let results = join_all((0..clients).map(|c| {
        let call = &call;
        async move {
            let mut times = Vec::with_capacity(per_client);
            for i in 0..per_client {
                let t = Instant::now();
                call(c, i).await?;
                times.push(t.elapsed());
            }
            Ok::<Vec<Duration>, String>(times)
        }
    }))
    .await;
    let elapsed = started.elapsed().as_secs_f64();
    let mut all = Vec::with_capacity(clients * per_client);
    for times in results {
        all.extend(times?);
    }
    Ok((all.len() as f64 / elapsed, all))
}

fn row(name: &str, (per_second, mut times): (f64, Vec<Duration>), check: String) -> Measured {
    times.sort_unstable();
    Measured {
        name: name.to_string(),
        per_second,
        p50: dropgate_e2e::quantile(&times, 0.5),
        p99: dropgate_e2e::quantile(&times, 0.99),
        p999: dropgate_e2e::quantile(&times, 0.999),
        check,
    }
}

/// The second table: one hot drop, `cli.clients` clients, every design.
async fn compare_designs(
    cli: &Cli,
    n: usize,
    redis: &RedisServer,
    http: &HttpClient,
) -> Result<(), String> {
    use dropgate_e2e::designs::{LockAndCounter, SqlRow, Took};
    use std::sync::atomic::AtomicI64;
    let clients = cli.clients.max(1);
    let per_client = (n / clients).max(if cli.quick { 2 } else { 20 });
    let units = (clients * per_client) as i64;
    let client = redis::Client::open(redis.url()).map_err(|e| e.to_string())?;
    let conn = redis::aio::ConnectionManager::new(client.clone())
        .await
        .map_err(|e| e.to_string())?;
    let mut rows = Vec::new();

    // 1. The sidecar: HTTP reserve, durable in its SQLite ledger.
    let sidecar = http_reserves(clients, per_client, http, "bench", "d", 201).await?;
    let keys = dropgate_api::DropKeys::new("shop", "bench");
    let (remaining, held): (i64, i64) = redis::pipe()
        .get(keys.remaining())
        .get(keys.held())
        .query_async(&mut conn.clone())
        .await
        .map_err(|e| e.to_string())?;
    if remaining + held != 10_000_000 || remaining < 0 {
        return Err(format!(
            "the sidecar's drop does not add up: remaining {remaining}, held {held}"
        ));
    }
    rows.push(row(
        "sidecar reserve (HTTP, ledger)",
        sidecar,
        format!("remaining + held = {} (limit 10000000)", remaining + held),
    ));

    // 2. The same gate script by EVALSHA from a Rust client, on the open gate.
    let raw = script_reserves(clients, per_client, &conn, &keys, "r", Want::Admitted).await?;
    rows.push(row(
        "gate script by EVALSHA (raw)",
        raw,
        "pending markers, as admitted".into(),
    ));

    // 3. Lock-and-counter, stock exactly the calls: every call must get a unit.
    let sold = Arc::new(AtomicI64::new(0));
    let mut design = LockAndCounter {
        conn: conn.clone(),
        stock: "bench:lock:stock".into(),
        lock: "bench:lock".into(),
    };
    design.seed(units).await.map_err(|e| e.to_string())?;
    let lock = measure(clients, per_client, |_, _| {
        let mut design = LockAndCounter {
            conn: conn.clone(),
            stock: "bench:lock:stock".into(),
            lock: "bench:lock".into(),
        };
        let sold = sold.clone();
        async move {
            if design.take().await.map_err(|e| e.to_string())? == Took::Unit {
                sold.fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        }
    })
    .await?;
    let left = design.left().await.map_err(|e| e.to_string())?;
    if left < 0 || sold.load(Ordering::Relaxed) + left != units {
        return Err(format!("lock-and-counter oversold: left {left}"));
    }
    rows.push(row(
        "lock + GET/DECRBY + release",
        lock,
        format!(
            "sold {} of {units}, left {left}",
            sold.load(Ordering::Relaxed)
        ),
    ));

    // 4. The SQL row, on PostgreSQL and on SQLite (synchronous=FULL).
    sqlx::any::install_default_drivers();
    let postgres = dropgate_testkit::PostgresServer::start().map_err(|e| e.to_string())?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let sqlite = format!("sqlite://{}?mode=rwc", dir.path().join("row.db").display());
    for (name, url) in [
        ("SQL row UPDATE (PostgreSQL)", postgres.url()),
        ("SQL row UPDATE (SQLite)", sqlite),
    ] {
        let pool = sqlx::any::AnyPoolOptions::new()
            .max_connections(if url.starts_with("sqlite") { 1 } else { 16 })
            .connect(&url)
            .await
            .map_err(|e| format!("{name}: {e}"))?;
        if url.starts_with("sqlite") {
            for pragma in ["PRAGMA journal_mode=WAL", "PRAGMA synchronous=FULL"] {
                sqlx::query(pragma)
                    .execute(&pool)
                    .await
                    .map_err(|e| e.to_string())?;
            }
        }
        let design = Arc::new(SqlRow { pool });
        design.seed(units).await.map_err(|e| e.to_string())?;
        let sold = Arc::new(AtomicI64::new(0));
        let timed = measure(clients, per_client, |_, _| {
            let (design, sold) = (design.clone(), sold.clone());
            async move {
                if design.take().await.map_err(|e| e.to_string())? == Took::Unit {
                    sold.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            }
        })
        .await?;
        let left = design.left().await.map_err(|e| e.to_string())?;
        rows.push(row(
            name,
            timed,
            format!(
                "sold {} of {units}, left {left}",
                sold.load(Ordering::Relaxed)
            ),
        ));
    }

    // 5. Sold-out answers: the bulk of a flash sale, through the sidecar and raw.
    let apply_dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let manifest = apply_dir.path().join("gone.yaml");
    std::fs::write(
        &manifest,
        "apiVersion: dropgate.io/v1alpha1\nkind: InventoryDrop\nmetadata: {name: gone, namespace: shop}\n\
         spec:\n  sku: GONE\n  limitedQuantity: 0\n  redis: {url: redis://unused:1}\n",
    )
    .map_err(|e| e.to_string())?;
    apply(&manifest, &redis.url())?;
    let gone = dropgate_api::DropKeys::new("shop", "gone");
    // The first call opens the drop's gate (a sidecar rebuilds it before selling).
    let first = http
        .post(
            "/v1/drops/gone/reservations",
            r#"{"key":"open","user":"open","quantity":1}"#,
        )
        .await
        .map_err(|e| e.to_string())?;
    if first.outcome() != "sold_out" {
        return Err(format!("the empty drop answered {}", first.text));
    }
    let sold_out = http_reserves(clients, per_client, http, "gone", "g", 409).await?;
    rows.push(row(
        "sidecar sold-out answer",
        sold_out,
        "409 sold_out every time".into(),
    ));
    let raw_sold_out =
        script_reserves(clients, per_client, &conn, &gone, "rg", Want::SoldOut).await?;
    rows.push(row(
        "gate script sold-out (raw)",
        raw_sold_out,
        "sold_out every time".into(),
    ));

    // 6. The same gate script driven by redis-benchmark, 50 clients, no pipelining:
    //    Redis's own ceiling for it, against which the sidecar's sold-out answers are
    //    measured (target: at or above it).
    let sha = dropgate_sidecar::gate::reserve_sha();
    let bench_admit = redis_benchmark(redis, &keys, sha, n * 20).await?;
    let bench_sold_out = redis_benchmark(redis, &gone, sha, n * 20).await?;
    let sidecar_sold_out = rows[rows.len() - 2].per_second / bench_sold_out.per_second;
    rows.push(bench_admit.named("redis-benchmark admit (50c)"));
    rows.push(bench_sold_out.named("redis-benchmark sold-out (50c)"));

    // 7. A thousand drops, the load spread over them: the sidecar (HTTP, ledger) and
    //    the raw script.
    let spread = spread_drops(redis, SPREAD_DROPS).await?;
    // Each drop's first call opens its gate: done before the clock starts, as a
    // sale's drops are warm by the time their buyers arrive.
    for chunk in (0..SPREAD_DROPS).collect::<Vec<_>>().chunks(clients) {
        join_all(chunk.iter().map(|drop| async move {
            http.get(&format!("/v1/drops/spread-{drop}/reservations/warm-up"))
                .await
        }))
        .await;
    }
    let sidecar_spread = measure(clients, per_client, |c, i| {
        let http = http.clone();
        let drop = (c * per_client + i) % SPREAD_DROPS;
        async move {
            let body = format!(r#"{{"key":"s{c}-{i}","user":"s{c}-{i}","quantity":1}}"#);
            let reply = http
                .post(&format!("/v1/drops/spread-{drop}/reservations"), &body)
                .await
                .map_err(|e| e.to_string())?;
            if reply.status == 201 {
                Ok(())
            } else {
                Err(format!("reserve answered {}", reply.text))
            }
        }
    })
    .await?;
    rows.push(row(
        "sidecar reserve, 1,000 drops",
        sidecar_spread,
        spread_check(&conn, SPREAD_DROPS).await?,
    ));
    let mut spread_ledgers = Vec::new();
    for keys in &spread {
        spread_ledgers.push(sale_ledger(&mut conn.clone().into(), keys).await?);
    }
    let raw_spread = measure(clients, per_client, |c, i| {
        let (mut conn, spread, ledgers) = (
            dropgate_redis::Connection::from(conn.clone()),
            &spread,
            &spread_ledgers,
        );
        async move {
            let key = format!("r{c}-{i}");
            let n = (c * per_client + i) % SPREAD_DROPS;
            let reply = dropgate_sidecar::gate::reserve(
                &mut conn,
                &spread[n],
                &ledgers[n],
                &key,
                &key,
                1,
                None,
                "bench",
                60_000,
            )
            .await
            .map_err(|e| e.to_string())?;
            match reply.outcome {
                Outcome::Admitted(_) => Ok(()),
                other => Err(format!("the gate script answered {other:?}")),
            }
        }
    })
    .await?;
    rows.push(row(
        "gate script raw, 1,000 drops",
        raw_spread,
        "pending markers, as admitted".into(),
    ));

    // 8. The same spread over a three-shard Redis Cluster (three primaries and their
    //    replicas, on this same machine): the raw script through a cluster client,
    //    and a sidecar with --redis-cluster.
    let (cluster_raw, cluster_sidecar, cluster_check) = on_a_cluster(
        clients,
        per_client,
        if cli.quick { 30 } else { SPREAD_DROPS },
    )
    .await?;
    rows.push(row(
        "gate script raw, drops, 3 shards",
        cluster_raw,
        "pending markers, as admitted".into(),
    ));
    rows.push(row(
        "sidecar reserve, drops, 3 shards",
        cluster_sidecar,
        cluster_check,
    ));

    // 9. What tracing costs: a fresh sidecar of this build without and with every
    //    request's spans exported over OTLP (to a sink in this process that reads
    //    and drops them), each on drops and a ledger of its own, and, when given,
    //    an earlier build the same way.
    let sink = OtlpSink::start().await?;
    let exporting = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", sink.endpoint.as_str()),
        ("OTEL_TRACES_SAMPLER", "always_on"),
    ];
    let sidecar_binary = dropgate_e2e::processes::binary("dropgate-sidecar");
    let mut others = vec![
        ("plain", "OTLP off", sidecar_binary.clone(), &[][..]),
        ("traced", "OTLP on", sidecar_binary, &exporting[..]),
    ];
    if let Some(path) = &cli.baseline_sidecar {
        others.push(("baseline", "baseline bin", path.clone(), &[]));
    }
    for (drop, label, binary, env) in others {
        let (served, sold_out) =
            other_sidecar(&binary, env, redis, drop, clients, per_client).await?;
        let (admitted, answered) = (
            format!("sidecar reserve, {label}"),
            format!("sidecar sold-out, {label}"),
        );
        let check = match drop {
            "traced" => sink.received(),
            "plain" => "no OTEL_* set".into(),
            _ => binary.display().to_string(),
        };
        rows.push(row(&admitted, served, check.clone()));
        rows.push(row(&answered, sold_out, check));
    }

    let baseline = rows[1].per_second;
    println!();
    println!(
        "{clients} clients, one hot drop: ops/s and latency (ms); x raw = ops/s over the raw gate script's"
    );
    println!(
        "{:<32} {:>9} {:>7} {:>7} {:>7} {:>7}  check",
        "design", "ops/s", "p50", "p99", "p99.9", "x raw"
    );
    for r in &rows {
        let p999 = if r.p999.is_zero() {
            "-".to_string()
        } else {
            format!("{:.2}", r.p999.as_secs_f64() * 1e3)
        };
        println!(
            "{:<32} {:>9.0} {:>7.2} {:>7.2} {:>7} {:>7.2}  {}",
            r.name,
            r.per_second,
            r.p50.as_secs_f64() * 1e3,
            r.p99.as_secs_f64() * 1e3,
            p999,
            r.per_second / baseline,
            r.check
        );
    }
    println!(
        "targets: durable admissions {:.2}x raw EVALSHA (target >= 0.35); sold-out answers {:.2}x redis-benchmark's sold-out EVALSHA (target >= 1.0)",
        rows[0].per_second / baseline,
        sidecar_sold_out
    );
    Ok(())
}

/// The spread case on a local three-shard Redis Cluster: the raw script's row, the
/// sidecar's row, and the sidecar's drops checked afterwards.
async fn on_a_cluster(
    clients: usize,
    per_client: usize,
    drops: usize,
) -> Result<((f64, Vec<Duration>), (f64, Vec<Duration>), String), String> {
    let cluster = dropgate_testkit::RedisCluster::start().map_err(|e| e.to_string())?;
    let spread = publish_spread(&cluster.url(), true, drops).await?;
    let conn = dropgate_redis::Connection::cluster(
        &cluster.url(),
        Duration::from_secs(2),
        Duration::from_secs(5),
    )
    .await
    .map_err(|e| e.to_string())?;
    // The raw script sells only through an open gate (a sidecar opens it before
    // selling; here the bench does, at the first epoch).
    let mut ledgers = Vec::new();
    for keys in &spread {
        let ledger = sale_ledger(&mut conn.clone(), keys).await?;
        dropgate_sidecar::gate::open(&mut conn.clone(), keys, &ledger, 1, 0)
            .await
            .map_err(|e| e.to_string())?;
        ledgers.push(ledger);
    }
    let raw = measure(clients, per_client, |c, i| {
        let (mut conn, spread, ledgers) = (conn.clone(), &spread, &ledgers);
        async move {
            let key = format!("r{c}-{i}");
            let n = (c * per_client + i) % spread.len();
            let reply = dropgate_sidecar::gate::reserve(
                &mut conn,
                &spread[n],
                &ledgers[n],
                &key,
                &key,
                1,
                None,
                "bench",
                60_000,
            )
            .await
            .map_err(|e| e.to_string())?;
            match reply.outcome {
                Outcome::Admitted(_) => Ok(()),
                other => Err(format!("the gate script answered {other:?}")),
            }
        }
    })
    .await?;
    // The sidecar sells drops of their own (the raw rows' pending markers would
    // stand in its way): the same names in another namespace.
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let memorystore = dropgate_operator::memorystore::Memorystore::default();
    for i in 0..drops {
        let manifest = format!(
            "apiVersion: dropgate.io/v1alpha1\nkind: InventoryDrop\nmetadata: {{name: spread-{i}, namespace: sold}}\n\
             spec:\n  sku: S{i}\n  limitedQuantity: 1000000\n  redis: {{url: redis://unused:1, cluster: true}}\n  throttle: {{permits: 1000000}}\n"
        );
        dropgate_operator::apply::apply(&manifest, Some(&cluster.url()), &memorystore)
            .await
            .map_err(|e| format!("spread-{i}: {e}"))?;
    }
    let ledger = format!("sqlite://{}", dir.path().join("ledger.db").display());
    let sidecar =
        SidecarProcess::start_with(&cluster.url(), "sold", &ledger, &["--redis-cluster"]).await?;
    let http = HttpClient::unchecked(sidecar.base.clone());
    for chunk in (0..drops).collect::<Vec<_>>().chunks(clients) {
        join_all(chunk.iter().map(|drop| {
            let http = http.clone();
            async move {
                http.get(&format!("/v1/drops/spread-{drop}/reservations/warm-up"))
                    .await
            }
        }))
        .await;
    }
    let served = measure(clients, per_client, |c, i| {
        let http = http.clone();
        let drop = (c * per_client + i) % drops;
        async move {
            let body = format!(r#"{{"key":"s{c}-{i}","user":"s{c}-{i}","quantity":1}}"#);
            let reply = http
                .post(&format!("/v1/drops/spread-{drop}/reservations"), &body)
                .await
                .map_err(|e| e.to_string())?;
            if reply.status == 201 {
                Ok(())
            } else {
                Err(format!("reserve answered {}", reply.text))
            }
        }
    })
    .await?;
    let mut conn = conn;
    for i in 0..drops {
        let keys = dropgate_api::DropKeys::new("sold", &format!("spread-{i}"));
        let (remaining, held): (Option<i64>, Option<i64>) = (
            redis::cmd("GET")
                .arg(keys.remaining())
                .query_async(&mut conn)
                .await
                .map_err(|e| e.to_string())?,
            redis::cmd("GET")
                .arg(keys.held())
                .query_async(&mut conn)
                .await
                .map_err(|e| e.to_string())?,
        );
        if remaining.unwrap_or(0) + held.unwrap_or(0) != 1_000_000 {
            return Err(format!("cluster drop spread-{i} does not add up"));
        }
    }
    Ok((
        raw,
        served,
        format!("remaining + held = limit on all {drops} drops"),
    ))
}

/// A sidecar from `binary` with `env`, on a ledger and drops of its own (`drop`,
/// 10,000,000 units, and `drop-gone`, none): its reserve row and its sold-out row.
async fn other_sidecar(
    binary: &std::path::Path,
    env: &[(&str, &str)],
    redis: &RedisServer,
    drop: &str,
    clients: usize,
    per_client: usize,
) -> Result<((f64, Vec<Duration>), (f64, Vec<Duration>)), String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    for (name, units) in [(drop.to_string(), 10_000_000), (format!("{drop}-gone"), 0)] {
        let manifest = dir.path().join(format!("{name}.yaml"));
        std::fs::write(
            &manifest,
            format!(
                "apiVersion: dropgate.io/v1alpha1\nkind: InventoryDrop\nmetadata: {{name: {name}, namespace: shop}}\n\
                 spec:\n  sku: {name}\n  limitedQuantity: {units}\n  redis: {{url: redis://unused:1}}\n  throttle: {{permits: 1000000}}\n"
            ),
        )
        .map_err(|e| e.to_string())?;
        apply(&manifest, &redis.url())?;
    }
    let ledger = format!("sqlite://{}", dir.path().join("ledger.db").display());
    let sidecar =
        SidecarProcess::start_binary(binary, &redis.url(), "shop", &ledger, &[], env).await?;
    let http = HttpClient::unchecked(sidecar.base.clone());
    let served = http_reserves(clients, per_client, &http, drop, "o", 201).await?;
    let gone = format!("{drop}-gone");
    let first = http
        .post(
            &format!("/v1/drops/{gone}/reservations"),
            r#"{"key":"open","user":"open","quantity":1}"#,
        )
        .await
        .map_err(|e| e.to_string())?;
    if first.outcome() != "sold_out" {
        return Err(format!("the empty drop answered {}", first.text));
    }
    let sold_out = http_reserves(clients, per_client, &http, &gone, "og", 409).await?;
    sidecar.terminate()?;
    let keys = dropgate_api::DropKeys::new("shop", drop);
    let mut conn = redis.connection().map_err(|e| e.to_string())?;
    let (remaining, held): (i64, i64) = redis::pipe()
        .get(keys.remaining())
        .get(keys.held())
        .query(&mut conn)
        .map_err(|e| e.to_string())?;
    if remaining + held != 10_000_000 || remaining < 0 {
        return Err(format!(
            "drop {drop} does not add up: remaining {remaining}, held {held}"
        ));
    }
    Ok((served, sold_out))
}

/// An OTLP/HTTP endpoint that takes every export and keeps only counts.
struct OtlpSink {
    endpoint: String,
    exports: Arc<AtomicU64>,
    bytes: Arc<AtomicU64>,
}

impl OtlpSink {
    async fn start() -> Result<Self, String> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| e.to_string())?;
        let endpoint = format!(
            "http://{}",
            listener.local_addr().map_err(|e| e.to_string())?
        );
        let (exports, bytes) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let (e, b) = (exports.clone(), bytes.clone());
        let sink = warp::post()
            .and(warp::path!("v1" / "traces"))
            .and(warp::body::bytes())
            .map(move |body: bytes::Bytes| {
                e.fetch_add(1, Ordering::Relaxed);
                b.fetch_add(body.len() as u64, Ordering::Relaxed);
                warp::reply::with_header("", "content-type", "application/x-protobuf")
            });
        tokio::spawn(warp::serve(sink).incoming(listener).run());
        Ok(Self {
            endpoint,
            exports,
            bytes,
        })
    }

    /// What arrived, for the row's check column.
    fn received(&self) -> String {
        format!(
            "OTLP sink got {} exports, {} KB",
            self.exports.load(Ordering::Relaxed),
            self.bytes.load(Ordering::Relaxed) / 1024
        )
    }
}

/// Drops of the spread case.
const SPREAD_DROPS: usize = 1000;

/// Publishes `count` drops `spread-N` as the operator's `apply` does, in process (a
/// thousand `apply -f` processes would take longer than the measurement).
async fn spread_drops(
    redis: &RedisServer,
    count: usize,
) -> Result<Vec<dropgate_api::DropKeys>, String> {
    publish_spread(&redis.url(), false, count).await
}

/// Publishes `count` drops `spread-N` on the Redis (or the cluster) at `url`.
async fn publish_spread(
    url: &str,
    cluster: bool,
    count: usize,
) -> Result<Vec<dropgate_api::DropKeys>, String> {
    let memorystore = dropgate_operator::memorystore::Memorystore::default();
    let mut keys = Vec::with_capacity(count);
    for i in 0..count {
        let manifest = format!(
            "apiVersion: dropgate.io/v1alpha1\nkind: InventoryDrop\nmetadata: {{name: spread-{i}, namespace: shop}}\n\
             spec:\n  sku: S{i}\n  limitedQuantity: 1000000\n  redis: {{url: redis://unused:1, cluster: {cluster}}}\n  throttle: {{permits: 1000000}}\n"
        );
        dropgate_operator::apply::apply(&manifest, Some(url), &memorystore)
            .await
            .map_err(|e| format!("spread-{i}: {e}"))?;
        keys.push(dropgate_api::DropKeys::new("shop", &format!("spread-{i}")));
    }
    Ok(keys)
}

/// The spread drops' invariant: remaining + held == limit for each.
async fn spread_check(
    conn: &redis::aio::ConnectionManager,
    count: usize,
) -> Result<String, String> {
    let mut pipe = redis::pipe();
    for i in 0..count {
        let keys = dropgate_api::DropKeys::new("shop", &format!("spread-{i}"));
        pipe.get(keys.remaining()).get(keys.held());
    }
    let counts: Vec<Option<i64>> = pipe
        .query_async(&mut conn.clone())
        .await
        .map_err(|e| e.to_string())?;
    let off = counts
        .chunks(2)
        .filter(|pair| pair[0].unwrap_or(0) + pair[1].unwrap_or(0) != 1_000_000)
        .count();
    if off > 0 {
        return Err(format!("{off} spread drops do not add up"));
    }
    Ok(format!("remaining + held = limit on all {count} drops"))
}

/// `redis-benchmark` running the reserve script by EVALSHA on drop `keys`, 50
/// clients, no pipelining, each call a random key and buyer.
async fn redis_benchmark(
    redis: &RedisServer,
    keys: &dropgate_api::DropKeys,
    sha: &str,
    requests: usize,
) -> Result<Measured, String> {
    let marker = keys.reservation("__rand_int__");
    let ledger = sale_ledger(&mut redis_connection(redis).await?, keys).await?;
    let (config, remaining, held, buyers, holds, gate, seq, ledgers, pending) = (
        keys.config(),
        keys.remaining(),
        keys.held(),
        keys.buyers(),
        keys.holds(),
        keys.gate(),
        keys.seq(),
        keys.ledger(),
        keys.pending(),
    );
    let port = redis.port().to_string();
    let requests = requests.to_string();
    let args: Vec<&str> = vec![
        "-h",
        "127.0.0.1",
        "-p",
        &port,
        "-c",
        "50",
        "-n",
        &requests,
        "-r",
        "100000000",
        "--csv",
        "EVALSHA",
        sha,
        "10",
        &config,
        &remaining,
        &held,
        &buyers,
        &holds,
        &marker,
        &gate,
        &seq,
        &ledgers,
        &pending,
        "__rand_int__",
        &ledger,
        "__rand_int__",
        "1",
        "bench",
        "60000",
    ];
    let out = tokio::process::Command::new("redis-benchmark")
        .args(&args)
        .output()
        .await
        .map_err(|e| format!("redis-benchmark: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    // "test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms","p95_latency_ms","p99_latency_ms","max_latency_ms"
    let line = text
        .lines()
        .find(|l| l.starts_with("\"EVALSHA"))
        .ok_or_else(|| format!("redis-benchmark printed no result: {text}"))?;
    let fields: Vec<f64> = line
        .split("\",\"")
        .skip(1)
        .map(|f| f.trim_matches('"').parse::<f64>().unwrap_or(f64::NAN))
        .collect();
    let [rps, _avg, _min, p50, _p95, p99, ..] = fields[..] else {
        return Err(format!(
            "redis-benchmark's CSV line is not as expected: {line}"
        ));
    };
    let ms = |v: f64| Duration::from_secs_f64(v.max(0.0) / 1e3);
    Ok(Measured {
        name: String::new(),
        per_second: rps,
        p50: ms(p50),
        p99: ms(p99),
        p999: Duration::ZERO,
        check: "redis-benchmark -c 50 -P 1, same Redis".into(),
    })
}

impl Measured {
    fn named(self, name: &str) -> Self {
        Self {
            name: name.into(),
            ..self
        }
    }
}

/// Reserves through the sidecar's HTTP API, each call a new key (`prefix`), each
/// answered `want`.
async fn http_reserves(
    clients: usize,
    per_client: usize,
    http: &HttpClient,
    drop: &str,
    prefix: &str,
    want: u16,
) -> Result<(f64, Vec<Duration>), String> {
    let path = format!("/v1/drops/{drop}/reservations");
    measure(clients, per_client, |c, i| {
        let (http, path) = (http.clone(), path.clone());
        async move {
            let body =
                format!(r#"{{"key":"{prefix}{c}-{i}","user":"{prefix}{c}-{i}","quantity":1}}"#);
            let reply = http.post(&path, &body).await.map_err(|e| e.to_string())?;
            if reply.status == want {
                Ok(())
            } else {
                Err(format!("reserve answered {}", reply.text))
            }
        }
    })
    .await
}

/// What every call of a raw-script row must answer.
#[derive(Clone, Copy, Debug)]
enum Want {
    Admitted,
    SoldOut,
}

/// The sale's ledger of drop `keys` (the sidecar's that opened it), claimed for the
/// bench itself when no sidecar opened it: the raw script runs as that ledger.
async fn sale_ledger(
    conn: &mut dropgate_redis::Connection,
    keys: &dropgate_api::DropKeys,
) -> Result<String, String> {
    match dropgate_sidecar::gate::claim(conn, keys, "bench", "bench")
        .await
        .map_err(|e| e.to_string())?
    {
        dropgate_sidecar::gate::Claim::Mine => Ok("bench".into()),
        dropgate_sidecar::gate::Claim::Foreign(ledger) => Ok(ledger),
        dropgate_sidecar::gate::Claim::Unpublished => {
            Err("the bench's drop is not published".into())
        }
        // The bench publishes with `apply`, whose claims count at once.
        dropgate_sidecar::gate::Claim::Awaiting => {
            Err("the bench's drop waits for an operator to record its claim".into())
        }
    }
}

/// A connection of the bench's own to `redis`.
async fn redis_connection(redis: &RedisServer) -> Result<dropgate_redis::Connection, String> {
    let client = redis::Client::open(redis.url()).map_err(|e| e.to_string())?;
    redis::aio::ConnectionManager::new(client)
        .await
        .map(Into::into)
        .map_err(|e| e.to_string())
}

/// Runs the gate's reserve script straight from Rust, each call a new key, each
/// answered `want`.
async fn script_reserves(
    clients: usize,
    per_client: usize,
    conn: &redis::aio::ConnectionManager,
    keys: &dropgate_api::DropKeys,
    prefix: &str,
    want: Want,
) -> Result<(f64, Vec<Duration>), String> {
    let ledger = sale_ledger(&mut conn.clone().into(), keys).await?;
    measure(clients, per_client, |c, i| {
        let (mut conn, keys, ledger) = (
            dropgate_redis::Connection::from(conn.clone()),
            keys.clone(),
            ledger.clone(),
        );
        async move {
            let key = format!("{prefix}{c}-{i}");
            let reply = dropgate_sidecar::gate::reserve(
                &mut conn, &keys, &ledger, &key, &key, 1, None, "bench", 60_000,
            )
            .await
            .map_err(|e| e.to_string())?;
            match (want, &reply.outcome) {
                (Want::Admitted, Outcome::Admitted(_))
                | (Want::SoldOut, Outcome::SoldOut { .. }) => Ok(()),
                (_, other) => Err(format!("the gate script answered {other:?}")),
            }
        }
    })
    .await
}

/// The sidecar's resident set (kB), from /proc.
fn rss_kb(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// Whether an answer is one the API promises for the call (docs/design.md's table).
fn expected(call: &str, status: u16, outcome: &str) -> bool {
    matches!(
        (call, status, outcome),
        ("reserve", 201, "admitted")
            | ("reserve", 200, "already_reserved")
            | ("reserve", 409, "sold_out")
            | ("reserve", 503, "throttled")
            | ("confirm", 200, "confirmed" | "already_confirmed")
            | ("confirm", 409, "expired" | "cancelled")
            | ("cancel", 200, "cancelled" | "already_cancelled")
            | ("cancel", 409, "expired")
            | ("lookup", 200, "found")
            // Calls on keys the mix never reserved (or reserved on the sold-out drop).
            | ("confirm" | "cancel" | "lookup", 404, "not_found")
    )
}

/// Mixed load for `length` on one sidecar: new buyers, retries, confirms, cancels
/// (refunds too), look-ups, and buyers of a sold-out drop; holds of 5 s so that
/// expiries churn. Prints RSS every minute; fails on an unexpected answer or a
/// drop that does not add up at the end.
async fn soak(clients: usize, length: Duration) -> Result<(), String> {
    use std::collections::BTreeMap;
    use std::sync::Mutex;
    let redis = RedisServer::start().map_err(|e| e.to_string())?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    for (name, limit) in [("soak", 100_000_000), ("gone", 0)] {
        let manifest = dir.path().join(format!("{name}.yaml"));
        std::fs::write(
            &manifest,
            format!(
                "apiVersion: dropgate.io/v1alpha1\nkind: InventoryDrop\nmetadata: {{name: {name}, namespace: shop}}\n\
                 spec:\n  sku: SOAK\n  limitedQuantity: {limit}\n  holdSeconds: 5\n  redis: {{url: redis://unused:1}}\n  throttle: {{permits: 100000}}\n"
            ),
        )
        .map_err(|e| e.to_string())?;
        apply(&manifest, &redis.url())?;
    }
    let ledger = format!("sqlite://{}", dir.path().join("ledger.db").display());
    let sidecar = SidecarProcess::start(&redis.url(), "shop", &ledger).await?;
    let pid = sidecar.pid();
    let http = HttpClient::unchecked(sidecar.base.clone());
    let started = Instant::now();
    let rss_start = rss_kb(pid);
    println!("soak: {clients} clients for {length:?}; sidecar RSS at start {rss_start:?} kB");
    let answers: Mutex<BTreeMap<String, u64>> = Mutex::new(BTreeMap::new());
    let unexpected: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let reporter = async {
        let mut minute = 0;
        while started.elapsed() < length {
            tokio::time::sleep(Duration::from_secs(1)).await;
            if started.elapsed().as_secs() / 60 > minute {
                minute += 1;
                let total: u64 = answers.lock().map(|a| a.values().sum()).unwrap_or(0);
                println!(
                    "  {minute} min: {total} answers, sidecar RSS {:?} kB",
                    rss_kb(pid)
                );
            }
        }
    };
    let load = join_all((0..clients).map(|c| {
        let (http, answers, unexpected) = (http.clone(), &answers, &unexpected);
        async move {
            let mut i = 0u64;
            while started.elapsed() < length {
                i += 1;
                let key = format!("c{c}-{i}");
                let earlier = format!("c{c}-{}", i.saturating_sub(1 + i % 7).max(1));
                let (call, reply) = match i % 20 {
                    0..=10 => {
                        let body = format!(r#"{{"key":"{key}","user":"{key}","quantity":1}}"#);
                        (
                            "reserve",
                            http.post("/v1/drops/soak/reservations", &body).await,
                        )
                    }
                    11..=12 => {
                        let body =
                            format!(r#"{{"key":"{earlier}","user":"{earlier}","quantity":1}}"#);
                        (
                            "reserve",
                            http.post("/v1/drops/soak/reservations", &body).await,
                        )
                    }
                    13..=14 => (
                        "confirm",
                        http.post(
                            &format!("/v1/drops/soak/reservations/{earlier}/confirm"),
                            "",
                        )
                        .await,
                    ),
                    15..=16 => (
                        "cancel",
                        http.post(&format!("/v1/drops/soak/reservations/{earlier}/cancel"), "")
                            .await,
                    ),
                    17 => (
                        "lookup",
                        http.get(&format!("/v1/drops/soak/reservations/{earlier}"))
                            .await,
                    ),
                    _ => {
                        let body = format!(r#"{{"key":"{key}","user":"{key}","quantity":1}}"#);
                        (
                            "reserve",
                            http.post("/v1/drops/gone/reservations", &body).await,
                        )
                    }
                };
                match reply {
                    Ok(reply) => {
                        let (status, outcome) =
                            (reply.status.as_u16(), reply.outcome().to_string());
                        if let Ok(mut a) = answers.lock() {
                            *a.entry(format!("{call} {status} {outcome}")).or_insert(0) += 1;
                        }
                        if !expected(call, status, &outcome)
                            && let Ok(mut u) = unexpected.lock()
                            && u.len() < 20
                        {
                            u.push(format!("{call} {key}: {} {}", reply.status, reply.text));
                        }
                    }
                    Err(e) => {
                        if let Ok(mut u) = unexpected.lock()
                            && u.len() < 20
                        {
                            u.push(format!("{call} {key}: no answer ({e})"));
                        }
                    }
                }
            }
        }
    }));
    tokio::join!(load, reporter);
    let rss_end = rss_kb(pid);
    println!("soak: sidecar RSS at start {rss_start:?} kB, at the end {rss_end:?} kB");
    if let Ok(answers) = answers.lock() {
        for (answer, count) in answers.iter() {
            println!("  {answer:<40} {count}");
        }
    }
    let keys = dropgate_api::DropKeys::new("shop", "soak");
    let client = redis::Client::open(redis.url()).map_err(|e| e.to_string())?;
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| e.to_string())?;
    let (remaining, held): (i64, i64) = redis::pipe()
        .get(keys.remaining())
        .get(keys.held())
        .query_async(&mut conn)
        .await
        .map_err(|e| e.to_string())?;
    if remaining + held != 100_000_000 {
        return Err(format!(
            "the soak's drop does not add up: remaining {remaining}, held {held}"
        ));
    }
    let unexpected = unexpected.lock().map(|u| u.clone()).unwrap_or_default();
    if !unexpected.is_empty() {
        return Err(format!("unexpected answers: {unexpected:#?}"));
    }
    println!("soak: every answer expected; remaining + held = limit");
    Ok(())
}

/// The ledger across sales (`--retention-sales N`): N sales of `buyers` buyers each
/// (a reserve, then a confirm or, for every fourth, a cancel) on one sidecar and
/// its SQLite ledger; each drop deleted when its sale is done, as a shop does. After
/// each sale the ledger's retention runs as if it had passed (the sidecar runs it
/// hourly with `--ledger-retention`): the rows and the file stay flat instead of
/// growing with every sale.
async fn retention_sales(sales: u32, buyers: usize) -> Result<(), String> {
    let redis = RedisServer::start().map_err(|e| e.to_string())?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let file = dir.path().join("ledger.db");
    let ledger_url = format!("sqlite://{}", file.display());
    let sidecar =
        SidecarProcess::start_with(&redis.url(), "shop", &ledger_url, &["--refresh-ms", "100"])
            .await?;
    let http = HttpClient::unchecked(sidecar.base.clone());
    let ledger = dropgate_sidecar::ledger::Ledger::open(&ledger_url)
        .await
        .map_err(|e| e.to_string())?;
    let mut conn = redis_connection(&redis).await?;
    let rows = |table: &'static str| {
        let pool = ledger.pool().clone();
        async move {
            sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(format!(
                "SELECT COUNT(*) FROM {table}"
            )))
            .fetch_one(&pool)
            .await
            .map_err(|e| e.to_string())
        }
    };
    // The WAL is SQLite's: checkpointed into the file every 1000 pages and reused,
    // so it levels off at its own size; the file reuses the pages pruned rows freed.
    println!(
        "| sale | reservation rows, sale done | outbox rows, sale done | reservation rows after retention | outbox rows after retention | ledger file (kB) | its WAL (kB) |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for sale in 1..=sales {
        let name = format!("sale-{sale}");
        let manifest = dir.path().join(format!("{name}.yaml"));
        std::fs::write(
            &manifest,
            format!(
                "apiVersion: dropgate.io/v1alpha1\nkind: InventoryDrop\nmetadata: {{name: {name}, namespace: shop, uid: sale-{sale}}}\n\
                 spec:\n  sku: RETAIN\n  limitedQuantity: {buyers}\n  redis: {{url: redis://unused:1}}\n  throttle: {{permits: 100000}}\n"
            ),
        )
        .map_err(|e| e.to_string())?;
        apply(&manifest, &redis.url())?;
        let calls = (0..buyers).map(|i| {
            let http = &http;
            let name = &name;
            async move {
                let body = format!(r#"{{"key":"k{i}","user":"u{i}","quantity":1}}"#);
                let admitted = http
                    .post(&format!("/v1/drops/{name}/reservations"), &body)
                    .await
                    .map_err(|e| e.to_string())?;
                if admitted.status != 201 {
                    return Err(format!("{name} k{i}: {}", admitted.text));
                }
                let op = if i % 4 == 3 { "cancel" } else { "confirm" };
                let settled = http
                    .post(&format!("/v1/drops/{name}/reservations/k{i}/{op}"), "")
                    .await
                    .map_err(|e| e.to_string())?;
                if settled.status != 200 {
                    return Err(format!("{name} k{i} {op}: {}", settled.text));
                }
                Ok::<(), String>(())
            }
        });
        for answer in join_all(calls).await {
            answer?;
        }
        // Every event sent, then the shop deletes the drop.
        let sent = async {
            loop {
                let unsent = sqlx::query_scalar::<_, i64>(
                    "SELECT COUNT(*) FROM outbox WHERE sent_at_ms IS NULL",
                )
                .fetch_one(ledger.pool())
                .await
                .map_err(|e| e.to_string())?;
                if unsent == 0 {
                    return Ok::<(), String>(());
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(30), sent)
            .await
            .map_err(|_| format!("{name}: events not sent within 30 s"))??;
        let done = (rows("reservations").await?, rows("outbox").await?);
        dropgate_operator::store::remove(&mut conn, &dropgate_api::DropKeys::new("shop", &name))
            .await
            .map_err(|e| e.to_string())?;
        let noted = async {
            loop {
                if rows("ended_sales").await? > 0 {
                    return Ok::<(), String>(());
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), noted)
            .await
            .map_err(|_| format!("{name}: the sidecar did not note the sale over"))??;
        // As if the retention had passed.
        dropgate_sidecar::ledger::retention::prune(
            ledger.pool(),
            dropgate_sidecar::clock::now_ms() + 1,
        )
        .await
        .map_err(|e| e.to_string())?;
        let kb = |suffix: &str| {
            std::fs::metadata(format!("{}{suffix}", file.display()))
                .map(|m| m.len() / 1024)
                .unwrap_or(0)
        };
        println!(
            "| {sale} | {} | {} | {} | {} | {} | {} |",
            done.0,
            done.1,
            rows("reservations").await?,
            rows("outbox").await?,
            kb(""),
            kb("-wal"),
        );
    }
    Ok(())
}
