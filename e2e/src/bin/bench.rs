#![forbid(unsafe_code)]
//! Times the sidecar's calls against baselines measured in the same run: a raw
//! Redis round trip (PING) and the sidecar's own `/healthz` (HTTP with no Redis and
//! no ledger). These machines are shared and noisy, so the ratios are the figures to
//! quote, not the milliseconds.
//!
//! `cargo run --release -p dropgate-e2e --bin bench -- --requests 3000`

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use dropgate_e2e::processes::{SidecarProcess, apply};
use dropgate_testkit::{HttpClient, RedisServer};
use futures::future::join_all;

#[derive(Parser)]
struct Cli {
    /// Calls per sequential measurement.
    #[arg(long, default_value_t = 3000)]
    requests: usize,
    /// Clients for the concurrent measurement.
    #[arg(long, default_value_t = 64)]
    clients: usize,
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
    let n = cli.requests.max(10);
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
    let http = HttpClient::new(sidecar.base.clone());
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

    // The same reserve from a sidecar that waits for a replica's acknowledgement
    // (--wait-replicas 1) before each 201.
    let replica = RedisServer::start_replica_of(&redis).map_err(|e| e.to_string())?;
    let waiting_ledger = format!("sqlite://{}", dir.path().join("waiting.db").display());
    let waiting = SidecarProcess::start_with(
        &redis.url(),
        "shop",
        &waiting_ledger,
        &["--wait-replicas", "1", "--wait-timeout-ms", "1000"],
    )
    .await?;
    let waiting_http = HttpClient::new(waiting.base.clone());
    for i in 0..n {
        let body = format!(r#"{{"key":"w{i}","user":"w{i}","quantity":1}}"#);
        let started = Instant::now();
        let reply = waiting_http
            .post("/v1/drops/bench/reservations", &body)
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
    for process in [sidecar, waiting] {
        let status = process.terminate()?;
        if !status.success() {
            return Err(format!("sidecar exited with {status}"));
        }
    }
    Ok(())
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
