//! CPU per answer: the measure the project's speed is judged by. On a fresh Redis,
//! side by side in one run: a plain gate script (plain_gate.lua) by EVALSHA from
//! `redis-benchmark` (50 clients), against HTTP reserves through `dropgate-sidecar`
//! processes (64 clients), for durable admissions and for sold-out answers, with one
//! sidecar (SQLite ledger) and with eight on one hot drop (one PostgreSQL ledger).
//!
//! CPU time per answer is far steadier than answers/s on a shared machine: it is
//! read from /proc (the sidecars) and `INFO cpu` (Redis) before and after each row
//! and divided by the answers the row got. The bench's load generator runs in this
//! process and is not counted.

use std::time::{Duration, Instant};

use dropgate_e2e::processes::{SidecarProcess, apply};
use dropgate_testkit::{HttpClient, PostgresServer, RedisServer};
use futures::future::join_all;

const PLAIN_GATE: &str = include_str!("plain_gate.lua");

/// How long each row runs, and with how many clients and sidecars.
pub struct Options {
    pub length: Duration,
    pub clients: usize,
    /// Sidecars for the hot-drop rows.
    pub fleet: usize,
    /// The sidecar binary to run, when not this build's.
    pub sidecar: Option<std::path::PathBuf>,
}

/// One row: what it answered, how fast, and what each answer cost.
struct Row {
    name: String,
    per_second: f64,
    p99: Option<Duration>,
    /// CPU seconds per answer, of the sidecars (none for the raw rows) and of Redis.
    sidecar: Option<f64>,
    redis: f64,
    /// Allocations and bytes allocated per answer, by the sidecars (a build with
    /// the `allocation-count` feature only).
    allocations: Option<(f64, f64)>,
    /// Every Redis command during the row per answer, most first (`INFO
    /// commandstats`: EVALSHA, the scripts' own calls and the sidecars' background
    /// work alike; those under 0.005 an answer left out; the sidecar rows only).
    commands: Vec<(String, f64)>,
    note: String,
}

/// The lines of the cart row's carts: one in each of the cart drop's sizes.
const CART_LINES: usize = 3;

/// What each buyer of a row asks for.
#[derive(Clone, Copy)]
enum Ask<'a> {
    /// One unit of a drop without variants.
    Reserve(&'a str),
    /// One unit of the first size of a drop sold in sizes.
    ReserveSize(&'a str),
    /// A cart of one unit in each of [`CART_LINES`] sizes of one drop.
    Cart(&'a str),
}

impl Ask<'_> {
    fn path(self) -> String {
        match self {
            Ask::Reserve(drop) | Ask::ReserveSize(drop) => {
                format!("/v1/drops/{drop}/reservations")
            }
            Ask::Cart(_) => "/v1/carts".to_string(),
        }
    }

    fn body(self, key: &str) -> String {
        match self {
            Ask::Reserve(_) => format!(r#"{{"key":"{key}","user":"{key}","quantity":1}}"#),
            Ask::ReserveSize(_) => {
                format!(r#"{{"key":"{key}","user":"{key}","variant":"s1","quantity":1}}"#)
            }
            Ask::Cart(drop) => {
                let lines: Vec<String> = (1..=CART_LINES)
                    .map(|n| format!(r#"{{"drop":"{drop}","variant":"s{n}","quantity":1}}"#))
                    .collect();
                format!(
                    r#"{{"key":"{key}","user":"{key}","lines":[{}]}}"#,
                    lines.join(",")
                )
            }
        }
    }
}

pub async fn table(options: &Options) -> Result<(), String> {
    let redis = RedisServer::start().map_err(|e| e.to_string())?;
    let mut conn = redis
        .connection()
        .map_err(|e| format!("connect to Redis: {e}"))?;
    let seconds = options.length.as_secs_f64();
    let raw_admit = raw(
        &redis,
        &mut conn,
        1_000_000_000,
        (seconds * 30_000.0) as usize,
    )
    .await?;
    let raw_sold_out = raw(&redis, &mut conn, 0, (seconds * 40_000.0) as usize).await?;

    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    for (name, limit) in [
        ("admit", 100_000_000),
        ("soldout", 100),
        ("admit-hot", 100_000_000),
        ("soldout-hot", 100),
    ] {
        publish(&redis, dir.path(), name, limit)?;
    }
    let sizes: Vec<String> = (1..=CART_LINES)
        .map(|n| format!("{{name: s{n}, quantity: 100000000}}"))
        .collect();
    publish_with(
        &redis,
        dir.path(),
        "cart",
        &format!("variants: [{}]", sizes.join(", ")),
    )?;
    let sqlite = format!("sqlite://{}", dir.path().join("ledger.db").display());
    let one = Fleet::start(&redis, &[sqlite], options).await?;
    let admit = one
        .row(
            "sidecar durable admit (SQLite)",
            &mut conn,
            Ask::Reserve("admit"),
            201,
            options,
        )
        .await?;
    let size = one
        .row(
            "sidecar durable admit of a size (SQLite)",
            &mut conn,
            Ask::ReserveSize("cart"),
            201,
            options,
        )
        .await?;
    let cart = one
        .row(
            "sidecar 3-line cart, one drop (SQLite)",
            &mut conn,
            Ask::Cart("cart"),
            201,
            options,
        )
        .await?;
    one.sell_out("soldout").await?;
    let sold_out = one
        .row(
            "sidecar sold-out answer",
            &mut conn,
            Ask::Reserve("soldout"),
            409,
            options,
        )
        .await?;
    drop(one);

    let postgres = PostgresServer::start().map_err(|e| format!("PostgreSQL: {e}"))?;
    let fleet = Fleet::start(&redis, &vec![postgres.url(); options.fleet], options).await?;
    let label = |what: &str| format!("{} sidecars {what}", options.fleet);
    let hot_admit = fleet
        .row(
            &label("durable admit (PostgreSQL)"),
            &mut conn,
            Ask::Reserve("admit-hot"),
            201,
            options,
        )
        .await?;
    fleet.sell_out("soldout-hot").await?;
    let hot_sold_out = fleet
        .row(
            &label("sold-out answer"),
            &mut conn,
            Ask::Reserve("soldout-hot"),
            409,
            options,
        )
        .await?;
    drop(fleet);
    report_deadlocks(&postgres);

    println!();
    println!(
        "CPU per answer, {} clients, {:.0} s a row; x raw = over the plain gate script by redis-benchmark in this run",
        options.clients, seconds
    );
    println!(
        "{:<40} {:>10} {:>8} {:>11} {:>10} {:>7} {:>8}  note",
        "path", "answers/s", "p99 ms", "sidecar us", "redis us", "x rate", "x redis"
    );
    // Admissions against the raw admit, sold-out answers against the raw sold-out.
    let rows = [
        (&raw_admit, &raw_admit),
        (&raw_sold_out, &raw_sold_out),
        (&admit, &raw_admit),
        (&size, &raw_admit),
        (&cart, &raw_admit),
        (&sold_out, &raw_sold_out),
        (&hot_admit, &raw_admit),
        (&hot_sold_out, &raw_sold_out),
    ];
    for (row, base) in rows {
        let note = match row.allocations {
            Some((count, bytes)) => format!(
                "{count:.0} allocations, {:.1} KB allocated per answer; {}",
                bytes / 1024.0,
                row.note
            ),
            None => row.note.clone(),
        };
        println!(
            "{:<40} {:>10.0} {:>8} {:>11} {:>10.1} {:>7.2} {:>8.2}  {}",
            row.name,
            row.per_second,
            row.p99
                .map(|p| format!("{:.1}", p.as_secs_f64() * 1e3))
                .unwrap_or_else(|| "-".into()),
            row.sidecar
                .map(|s| format!("{:.1}", s * 1e6))
                .unwrap_or_else(|| "-".into()),
            row.redis * 1e6,
            row.per_second / base.per_second,
            row.redis / base.redis,
            note,
        );
    }
    let us = |s: Option<f64>| s.unwrap_or(0.0) * 1e6;
    println!(
        "ratios: admit {:.2}x raw rate (target >= 0.35), sold-out {:.2}x (>= 1.0); Redis CPU per answer admit {:.2}x raw (<= 1.0), sold-out {:.2}x (<= 0.3), {} sidecars admit {:.2}x, sold-out {:.2}x; sidecar CPU per answer admit {:.0} us (<= 60), sold-out {:.0} us (<= 15)",
        admit.per_second / raw_admit.per_second,
        sold_out.per_second / raw_sold_out.per_second,
        admit.redis / raw_admit.redis,
        sold_out.redis / raw_sold_out.redis,
        options.fleet,
        hot_admit.redis / raw_admit.redis,
        hot_sold_out.redis / raw_sold_out.redis,
        us(admit.sidecar),
        us(sold_out.sidecar),
    );
    // The cart's lines are sizes: a reserve of one size of the same drop is the
    // like-for-like single reserve; the drop without sizes is shown beside it.
    let per = |row: &Row, base: &Row| {
        (
            row.sidecar.unwrap_or(0.0) / base.sidecar.unwrap_or(f64::NAN),
            row.redis / base.redis,
        )
    };
    let (by_size_sidecar, by_size_redis) = per(&cart, &size);
    println!(
        "Redis commands per answer (all of them during the row: EVALSHA, the scripts' own calls, the sidecars' background work; INFO commandstats):"
    );
    for row in [&admit, &size, &cart, &sold_out, &hot_admit, &hot_sold_out] {
        let total: f64 = row.commands.iter().map(|(_, per)| per).sum();
        let per_command: Vec<String> = row
            .commands
            .iter()
            .map(|(name, per)| format!("{name} {per:.2}"))
            .collect();
        println!(
            "  {:<38} {total:>6.1}  {}",
            row.name,
            per_command.join(", ")
        );
    }
    let (by_plain_sidecar, by_plain_redis) = per(&cart, &admit);
    println!(
        "a {CART_LINES}-line cart on one drop over one reserve of a size of it: sidecar CPU per answer {by_size_sidecar:.2}x, Redis CPU per answer {by_size_redis:.2}x (target <= 2.0 each); over one reserve of a drop without sizes: {by_plain_sidecar:.2}x, {by_plain_redis:.2}x"
    );
    Ok(())
}

/// The plain gate script by EVALSHA from `redis-benchmark`, 50 clients, `calls`
/// calls, on a stock of `stock` (0: every call answers sold out).
async fn raw(
    redis: &RedisServer,
    conn: &mut redis::Connection,
    stock: i64,
    calls: usize,
) -> Result<Row, String> {
    let failed = |e: redis::RedisError| e.to_string();
    let sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(PLAIN_GATE)
        .query(conn)
        .map_err(failed)?;
    redis::cmd("SET")
        .arg("plain:stock")
        .arg(stock)
        .query::<()>(conn)
        .map_err(failed)?;
    let before = redis_cpu(conn)?;
    let out = tokio::process::Command::new("redis-benchmark")
        .args(["-h", "127.0.0.1", "-p", &redis.port().to_string()])
        .args([
            "-c",
            "50",
            "-n",
            &calls.to_string(),
            "-r",
            "100000000",
            "--csv",
        ])
        .args([
            "EVALSHA",
            &sha,
            "3",
            "plain:stock",
            "plain:buyer:__rand_int__",
        ])
        .args(["plain:marker:__rand_int__", "1", "1000000", "60"])
        .output()
        .await
        .map_err(|e| format!("redis-benchmark: {e}"))?;
    let after = redis_cpu(conn)?;
    let text = String::from_utf8_lossy(&out.stdout);
    let per_second = text
        .lines()
        .find(|l| l.starts_with("\"EVALSHA"))
        .and_then(|l| l.split("\",\"").nth(1))
        .and_then(|rps| rps.trim_matches('"').parse::<f64>().ok())
        .ok_or_else(|| format!("redis-benchmark printed no rate: {text}"))?;
    redis::cmd("FLUSHALL").query::<()>(conn).map_err(failed)?;
    Ok(Row {
        name: format!(
            "raw EVALSHA {} (redis-benchmark 50c)",
            if stock > 0 { "admit" } else { "sold-out" }
        ),
        per_second,
        p99: None,
        sidecar: None,
        redis: (after - before) / calls as f64,
        allocations: None,
        commands: Vec::new(),
        note: format!("{calls} calls"),
    })
}

/// A drop of `limit` units for the bench's rows: one unit a buyer, holds for ten
/// minutes, the gate only (a Redis failure is answered, not fallen back from).
fn publish(
    redis: &RedisServer,
    dir: &std::path::Path,
    name: &str,
    limit: i64,
) -> Result<(), String> {
    publish_with(redis, dir, name, &format!("limitedQuantity: {limit}"))
}

/// [`publish`] with the stock given as `stock` (a `limitedQuantity` or `variants`
/// line of the spec).
fn publish_with(
    redis: &RedisServer,
    dir: &std::path::Path,
    name: &str,
    stock: &str,
) -> Result<(), String> {
    let manifest = dir.join(format!("{name}.yaml"));
    std::fs::write(
        &manifest,
        format!(
            "apiVersion: dropgate.io/v1alpha1\nkind: InventoryDrop\nmetadata: {{name: {name}, namespace: shop}}\n\
             spec:\n  sku: BENCH\n  {stock}\n  perUserLimit: {CART_LINES}\n  holdSeconds: 600\n  redis: {{url: redis://unused:1}}\n\
             \x20 gate: {{enabled: true, failurePolicy: Closed}}\n  throttle: {{permits: 1000000}}\n"
        ),
    )
    .map_err(|e| e.to_string())?;
    apply(&manifest, &redis.url()).map(|_| ())
}

/// Sidecar processes on one Redis, one per ledger URL given.
struct Fleet {
    sidecars: Vec<SidecarProcess>,
    http: Vec<HttpClient>,
}

impl Fleet {
    async fn start(
        redis: &RedisServer,
        ledgers: &[String],
        options: &Options,
    ) -> Result<Self, String> {
        let mut sidecars = Vec::new();
        for ledger in ledgers {
            sidecars.push(match &options.sidecar {
                Some(path) => {
                    SidecarProcess::start_binary(path, &redis.url(), "shop", ledger, &[], &[])
                        .await?
                }
                None => SidecarProcess::start(&redis.url(), "shop", ledger).await?,
            });
        }
        let http = sidecars
            .iter()
            .map(|s| HttpClient::unchecked(s.base.clone()))
            .collect();
        Ok(Self { sidecars, http })
    }

    /// CPU seconds the fleet's processes have used so far.
    fn cpu(&self) -> Result<f64, String> {
        self.sidecars.iter().map(|s| process_cpu(s.pid())).sum()
    }

    /// Allocations and bytes the fleet's processes have allocated so far, from
    /// their /metrics; `None` unless every one was built to count them.
    async fn allocations(&self) -> Result<Option<(f64, f64)>, String> {
        let mut total = (0.0, 0.0);
        for http in &self.http {
            let text = http.get("/metrics").await.map_err(|e| e.to_string())?.text;
            let value = |name: &str| {
                text.lines()
                    .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
                    .and_then(|v| v.trim().parse::<f64>().ok())
            };
            match (
                value("dropgate_sidecar_allocations"),
                value("dropgate_sidecar_allocated_bytes"),
            ) {
                (Some(count), Some(bytes)) => {
                    total.0 += count;
                    total.1 += bytes;
                }
                _ => return Ok(None),
            }
        }
        Ok(Some(total))
    }

    /// Reserves until drop `drop` answers sold out.
    async fn sell_out(&self, drop: &str) -> Result<(), String> {
        for i in 0.. {
            let body = format!(r#"{{"key":"pre-{i}","user":"pre-{i}","quantity":1}}"#);
            let reply = self.http[i % self.http.len()]
                .post(&format!("/v1/drops/{drop}/reservations"), &body)
                .await
                .map_err(|e| e.to_string())?;
            match reply.status.as_u16() {
                201 | 503 => continue,
                409 => return Ok(()),
                _ => return Err(format!("selling {drop} out: {}", reply.text)),
            }
        }
        Ok(())
    }

    /// A warm-up of a second, then `options.length` of new buyers on `drop` from
    /// `options.clients` clients spread over the fleet; each answer should be `want`.
    async fn row(
        &self,
        name: &str,
        conn: &mut redis::Connection,
        ask: Ask<'_>,
        want: u16,
        options: &Options,
    ) -> Result<Row, String> {
        self.load(ask, "warm", options.clients, Duration::from_secs(1), want)
            .await?;
        let allocated_before = self.allocations().await?;
        let (sidecar_before, redis_before) = (self.cpu()?, redis_cpu(conn)?);
        let commands_before = redis_commands(conn)?;
        let started = Instant::now();
        let load = self
            .load(ask, "run", options.clients, options.length, want)
            .await?;
        let elapsed = started.elapsed().as_secs_f64();
        let (sidecar_after, redis_after) = (self.cpu()?, redis_cpu(conn)?);
        let commands_after = redis_commands(conn)?;
        let allocated_after = self.allocations().await?;
        let answers = load.times.len().max(1) as f64;
        let mut commands: Vec<(String, f64)> = commands_after
            .into_iter()
            .map(|(name, calls)| {
                let before = commands_before.get(&name).copied().unwrap_or(0);
                (name, calls.saturating_sub(before) as f64 / answers)
            })
            .filter(|(_, per)| *per >= 0.005)
            .collect();
        commands.sort_by(|a, b| b.1.total_cmp(&a.1));
        let mut times = load.times;
        times.sort_unstable();
        Ok(Row {
            name: name.to_string(),
            per_second: answers / elapsed,
            p99: Some(dropgate_e2e::quantile(&times, 0.99)),
            sidecar: Some((sidecar_after - sidecar_before) / answers),
            redis: (redis_after - redis_before) / answers,
            allocations: allocated_before
                .zip(allocated_after)
                .map(|(before, after)| {
                    (
                        (after.0 - before.0) / answers,
                        (after.1 - before.1) / answers,
                    )
                }),
            commands,
            note: if load.other == 0 {
                format!("every answer {want}")
            } else {
                format!("{} of {} answers not {want}", load.other, times.len())
            },
        })
    }

    async fn load(
        &self,
        ask: Ask<'_>,
        prefix: &str,
        clients: usize,
        length: Duration,
        want: u16,
    ) -> Result<Load, String> {
        let path = ask.path();
        let until = Instant::now() + length;
        let tag = rand::random::<u32>();
        let results = join_all((0..clients).map(|c| {
            let (http, path) = (self.http[c % self.http.len()].clone(), path.clone());
            async move {
                let mut load = Load::default();
                let mut i = 0;
                while Instant::now() < until {
                    i += 1;
                    let key = format!("{prefix}{tag}-{c}-{i}");
                    let body = ask.body(&key);
                    let t = Instant::now();
                    let reply = http.post(&path, &body).await.map_err(|e| e.to_string())?;
                    load.times.push(t.elapsed());
                    if reply.status.as_u16() != want {
                        load.other += 1;
                    }
                }
                Ok::<Load, String>(load)
            }
        }))
        .await;
        let mut all = Load::default();
        for load in results {
            let load = load?;
            all.times.extend(load.times);
            all.other += load.other;
        }
        Ok(all)
    }
}

#[derive(Default)]
struct Load {
    times: Vec<Duration>,
    /// Answers other than the one the row is for.
    other: usize,
}

/// Redis's commands so far by name, with how often each was called (`INFO
/// commandstats`: a script's own calls count too). The bench's own INFO calls
/// are among them, a handful a row.
fn redis_commands(
    conn: &mut redis::Connection,
) -> Result<std::collections::HashMap<String, u64>, String> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(conn)
        .map_err(|e| e.to_string())?;
    Ok(info
        .lines()
        .filter_map(|line| {
            let (name, stats) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = stats.strip_prefix("calls=")?.split(',').next()?;
            Some((name.to_string(), calls.parse().ok()?))
        })
        .collect())
}

/// Redis's CPU seconds so far (user + system, from `INFO cpu`).
fn redis_cpu(conn: &mut redis::Connection) -> Result<f64, String> {
    let info: String = redis::cmd("INFO")
        .arg("cpu")
        .query(conn)
        .map_err(|e| e.to_string())?;
    let field = |name: &str| {
        info.lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .ok_or_else(|| format!("INFO cpu has no {name}"))
    };
    Ok(field("used_cpu_user:")? + field("used_cpu_sys:")?)
}

/// A process's CPU seconds so far (utime + stime, from /proc).
fn process_cpu(pid: u32) -> Result<f64, String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map_err(|e| format!("/proc/{pid}/stat: {e}"))?;
    // The fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .ok_or_else(|| format!("/proc/{pid}/stat has no field {i}"))
    };
    Ok((ticks(11)? + ticks(12)?) / clock_ticks())
}

/// Clock ticks a second (`getconf CLK_TCK`; 100 on Linux unless it says otherwise).
fn clock_ticks() -> f64 {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|out| String::from_utf8_lossy(&out.stdout).trim().parse().ok())
            .unwrap_or(100.0)
    })
}

/// Lines of PostgreSQL's log shown for the first deadlock: its ERROR, DETAIL
/// (both processes and what they waited for), HINT, CONTEXT and STATEMENT lines.
const DEADLOCK_ENTRY_LINES: usize = 12;

/// Says on stderr how many deadlocks PostgreSQL broke (one transaction aborted
/// each: a group commit begun again, or refused) since the server started (the
/// fleet's rows and their sell-out), with the first one's entry.
fn report_deadlocks(postgres: &PostgresServer) {
    let log = match postgres.log() {
        Ok(log) => log,
        Err(e) => {
            eprintln!("PostgreSQL's log could not be read for deadlocks: {e}");
            return;
        }
    };
    let lines: Vec<&str> = log.lines().collect();
    let found: Vec<usize> = (0..lines.len())
        .filter(|&i| lines[i].contains("deadlock detected"))
        .collect();
    eprintln!(
        "PostgreSQL broke {} deadlocks during the fleet's rows",
        found.len()
    );
    if let Some(&first) = found.first() {
        for line in lines.iter().skip(first).take(DEADLOCK_ENTRY_LINES) {
            eprintln!("  {line}");
        }
    }
}
