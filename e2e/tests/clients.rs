//! The example clients (examples/clients: TypeScript, Python, Go) against a real
//! sidecar: each runs a crowd of checkouts on a drop whose throttle makes it retry
//! (one permit), and the drop's counts afterwards must be what it reports: every
//! confirmed checkout holds one unit, every cancelled or refused one none, never
//! more than the limit. scripts/setup installs Node, npm's TypeScript, Python's
//! requests and Go where missing.

use std::path::{Path, PathBuf};
use std::process::Command;

use dropgate_e2e::processes::{SidecarProcess, apply, sale_manifest};
use dropgate_testkit::{DropSpec, HttpClient, RedisServer};

const LIMIT: i64 = 8;
const BUYERS: i64 = 12;

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/clients")
}

/// A program on PATH or at one of `fallbacks`.
fn program(name: &str, fallbacks: &[&str]) -> PathBuf {
    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|dir| dir.join(name))
        .chain(fallbacks.iter().map(PathBuf::from))
        .find(|path| path.is_file())
        .unwrap_or_else(|| panic!("no {name}: scripts/setup installs it"))
}

/// Debian's python3, where scripts/setup installs requests and redis (another
/// python3 first on PATH, such as pyenv's, does not see them); else the one on PATH.
fn python3() -> PathBuf {
    let debian = PathBuf::from("/usr/bin/python3");
    if debian.is_file() {
        debian
    } else {
        program("python3", &[])
    }
}

/// Runs `command` to its end; its stdout, or a panic with its stderr.
fn run(mut command: Command, what: &str) -> String {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run: {e}"));
    assert!(
        out.status.success(),
        "{what}: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The command that runs client `name` (built first where it needs it).
fn client(name: &str) -> Command {
    let dir = examples().join(name);
    match name {
        "typescript" => {
            assert!(
                dir.join("node_modules/typescript").is_dir(),
                "examples/clients/typescript has no node_modules: scripts/setup runs npm ci there"
            );
            let mut tsc = Command::new(program("npx", &[]));
            tsc.args(["--no-install", "tsc"]).current_dir(&dir);
            run(tsc, "tsc");
            let mut node = Command::new(program("node", &[]));
            node.arg("dist/checkout.js").current_dir(&dir);
            node
        }
        "python" => {
            let mut python = Command::new(python3());
            python.arg("checkout.py").current_dir(&dir);
            python
        }
        "go" => {
            let mut go = Command::new(program("go", &["/usr/local/go/bin/go"]));
            go.args(["run", "."])
                .current_dir(&dir)
                .env("GOTOOLCHAIN", "local")
                .env("GOFLAGS", "-mod=mod");
            go
        }
        other => panic!("no client {other}"),
    }
}

/// One client's crowd against a fresh sidecar, and the drop's counts checked.
async fn checkouts_of(name: &str) {
    let redis = RedisServer::start().expect("redis-server");
    let dir = tempfile::tempdir().expect("dir");
    // One permit: most of the crowd is told `throttled` and retries.
    let spec = DropSpec::new(LIMIT)
        .per_user_limit(1)
        .permits(1)
        .acquire_timeout_ms(5);
    let manifest = sale_manifest(dir.path(), &spec.yaml()).expect("manifest");
    apply(&manifest, &redis.url()).expect("apply");
    let ledger = format!("sqlite://{}", dir.path().join("ledger.db").display());
    let sidecar = SidecarProcess::start(&redis.url(), "shop", &ledger)
        .await
        .expect("the sidecar starts");

    let mut command = client(name);
    command
        .env("DROPGATE_URL", &sidecar.base)
        .env("DROP", "sale")
        .env("BUYERS", BUYERS.to_string())
        .env("PREFIX", name);
    let printed = tokio::task::spawn_blocking(move || run(command, "the client"))
        .await
        .expect("joins");
    let report: serde_json::Value = printed
        .lines()
        .last()
        .and_then(|line| serde_json::from_str(line).ok())
        .unwrap_or_else(|| panic!("{name}: no JSON report: {printed}"));
    let outcomes = &report["outcomes"];
    let count = |outcome: &str| outcomes[outcome].as_i64().unwrap_or(0);
    let (confirmed, cancelled, sold_out) =
        (count("confirmed"), count("cancelled"), count("sold_out"));
    assert_eq!(
        confirmed + cancelled + sold_out,
        BUYERS,
        "{name}: every checkout ends confirmed, cancelled or sold out: {report}"
    );
    assert!(confirmed <= LIMIT, "{name}: oversold: {report}");
    // Every third buyer's payment fails; each of them held a unit first unless the
    // drop was sold out when they came.
    assert!(cancelled <= BUYERS / 3, "{name}: {report}");

    let http = HttpClient::new(sidecar.base.clone());
    let drop = http.get("/v1/drops/sale").await.expect("the drop answers");
    drop.assert_answer(200, "found");
    assert_eq!(
        drop.body["remaining"].as_i64(),
        Some(LIMIT - confirmed),
        "{name}: the drop's stock after {report}: {}",
        drop.text
    );
    let metrics = http.get("/metrics").await.expect("metrics").text;
    let answered = |outcome: &str| -> f64 {
        metrics
            .lines()
            .filter(|line| {
                line.starts_with("dropgate_sidecar_answers_total{route=\"reserve\"")
                    && line.contains(&format!("outcome=\"{outcome}\""))
            })
            .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    // Each checkout that held a unit was admitted once, however often it was told
    // `throttled` and came back with its key.
    assert_eq!(
        answered("admitted") as i64,
        confirmed + cancelled,
        "{name}: {report}\n{metrics}"
    );
    let throttled = answered("throttled");
    println!("{name}: {report}; answered throttled {throttled} times, each retried");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_typescript_client_checks_out_as_the_drop_counts() {
    checkouts_of("typescript").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_client_checks_out_as_the_drop_counts() {
    checkouts_of("python").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_go_client_checks_out_as_the_drop_counts() {
    checkouts_of("go").await;
}

/// examples/consumer/consume.py against a real sale's stream: it dies once after
/// committing an effect and before acknowledging it, and the stream also carries a
/// republished copy of an event; every event's effect is applied exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_consumer_applies_each_event_once() {
    let redis = RedisServer::start().expect("redis-server");
    let dir = tempfile::tempdir().expect("dir");
    let manifest = sale_manifest(dir.path(), &DropSpec::new(10).yaml()).expect("manifest");
    apply(&manifest, &redis.url()).expect("apply");
    let ledger = format!("sqlite://{}", dir.path().join("ledger.db").display());
    let sidecar = SidecarProcess::start(&redis.url(), "shop", &ledger)
        .await
        .expect("the sidecar starts");
    let http = HttpClient::new(sidecar.base.clone());
    for i in 1..=5 {
        http.post(
            "/v1/drops/sale/reservations",
            &format!(r#"{{"key":"k{i}","user":"u{i}","quantity":1}}"#),
        )
        .await
        .expect("answers")
        .assert_answer(201, "admitted");
    }
    for (key, op) in [
        ("k1", "confirm"),
        ("k2", "confirm"),
        ("k3", "confirm"),
        ("k4", "cancel"),
    ] {
        let reply = http
            .post(&format!("/v1/drops/sale/reservations/{key}/{op}"), "")
            .await
            .expect("answers");
        assert_eq!(reply.status, 200, "{}", reply.text);
    }
    let stream = dropgate_api::DropKeys::new("shop", "sale").events();
    let mut conn = redis.connection().expect("connect");
    for _ in 0..100 {
        let published: i64 = redis::cmd("XLEN")
            .arg(&stream)
            .query(&mut conn)
            .expect("XLEN");
        if published >= 9 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let consumer = |crash_after: &str| {
        let mut python = Command::new(python3());
        python
            .arg("consume.py")
            .current_dir(examples().join("../consumer"))
            .env("REDIS_URL", redis.url())
            .env("STREAM", &stream)
            .env("DATABASE", dir.path().join("orders.db"))
            .env("CRASH_AFTER", crash_after);
        python
    };
    // Dies after its 4th effect committed, before that entry's XACK.
    let crashed = consumer("4").output().expect("python3 runs");
    assert_eq!(
        crashed.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&crashed.stderr)
    );
    // The dispatcher republishes an event (as after a crash before it marked it sent).
    let first: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg(&stream)
        .arg("-")
        .arg("+")
        .arg("COUNT")
        .arg(1)
        .query(&mut conn)
        .expect("XRANGE");
    let fields = &first[0].1;
    let mut xadd = redis::cmd("XADD");
    xadd.arg(&stream).arg("*");
    for (name, value) in fields {
        xadd.arg(name).arg(value);
    }
    let _: String = xadd.query(&mut conn).expect("XADD");

    let printed = run(consumer("0"), "the consumer");
    let report: serde_json::Value =
        serde_json::from_str(printed.trim()).unwrap_or_else(|_| panic!("a report: {printed}"));
    assert_eq!(
        report,
        serde_json::json!({"applied": 5, "skipped": 2}),
        "the unacknowledged and the republished event are skipped"
    );
    let mut sqlite = Command::new(program("sqlite3", &["/usr/bin/sqlite3"]));
    sqlite
        .arg(dir.path().join("orders.db"))
        .arg("SELECT type, events, units FROM tally ORDER BY type");
    assert_eq!(
        run(sqlite, "sqlite3"),
        "admitted|5|5\ncancelled|1|1\nconfirmed|3|3\n",
        "each event's effect once"
    );
}
