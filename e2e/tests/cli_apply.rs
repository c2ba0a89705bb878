//! `dropgate-operator apply` as a user runs it: a manifest on standard input, several
//! drops in one file (each reconciled, one status each), the documented exit codes,
//! and log lines as JSON when asked.

use std::io::Write;
use std::process::{Command, Output, Stdio};

use dropgate_api::DropKeys;
use dropgate_e2e::processes::binary;
use dropgate_testkit::{DropSpec, RedisServer};

fn drop_manifest(name: &str, spec: &str) -> String {
    format!(
        "apiVersion: dropgate.io/v1alpha1\nkind: InventoryDrop\nmetadata: {{name: {name}, namespace: shop}}\n\
         spec:\n  redis: {{url: redis://unused:1, requireHighAvailability: false}}\n{spec}"
    )
}

/// `dropgate-operator [global] apply -f - --redis-url URL` with `stdin` as the manifest.
fn apply(stdin: &str, redis_url: &str, global: &[&str], env: &[(&str, &str)]) -> Output {
    let args: Vec<&str> = global
        .iter()
        .copied()
        .chain(["apply", "-f", "-", "--redis-url", redis_url])
        .collect();
    operator_with_stdin(stdin, &args, env)
}

/// `dropgate-operator ARGS` with `stdin` on its standard input.
fn operator_with_stdin(stdin: &str, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut child = Command::new(binary("dropgate-operator"))
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("dropgate-operator runs");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(stdin.as_bytes())
        .expect("manifest written");
    child.wait_with_output().expect("it exits")
}

fn published(redis: &RedisServer, drop: &str) -> bool {
    let mut conn = redis.connection().expect("connect");
    redis::cmd("EXISTS")
        .arg(DropKeys::new("shop", drop).config())
        .query::<i64>(&mut conn)
        .expect("EXISTS")
        == 1
}

fn code(out: &Output) -> i32 {
    out.status.code().unwrap_or(-1)
}

#[test]
fn several_drops_from_standard_input_are_each_reconciled() {
    let redis = RedisServer::start().expect("redis-server");
    let manifest = format!(
        "{}---\n{}",
        drop_manifest("shoes", &DropSpec::new(10).yaml()),
        drop_manifest("shirts", &DropSpec::new(20).yaml())
    );
    let out = apply(&manifest, &redis.url(), &[], &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        code(&out),
        0,
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(published(&redis, "shoes") && published(&redis, "shirts"));
    let statuses: Vec<serde_json::Value> = stdout
        .split("---\n")
        .map(|doc| serde_norway::from_str(doc).expect("a status document"))
        .collect();
    let limits: Vec<i64> = statuses
        .iter()
        .map(|s| s["limit"].as_i64().expect("limit"))
        .collect();
    assert_eq!(limits, [10, 20], "{stdout}");
}

#[test]
fn apply_says_what_failed_in_its_exit_code() {
    let redis = RedisServer::start().expect("redis-server");
    let good = drop_manifest("fine", &DropSpec::new(5).yaml());

    let invalid = apply(
        &drop_manifest("bad", "  sku: X\n  limitedQuantity: -1\n"),
        &redis.url(),
        &[],
        &[],
    );
    assert_eq!(
        code(&invalid),
        3,
        "{}",
        String::from_utf8_lossy(&invalid.stderr)
    );
    assert!(!published(&redis, "bad"));

    let not_yaml = apply(": : :\n- [", &redis.url(), &[], &[]);
    assert_eq!(
        code(&not_yaml),
        3,
        "{}",
        String::from_utf8_lossy(&not_yaml.stderr)
    );

    let unreachable = apply(&good, "redis://127.0.0.1:1", &[], &[]);
    assert_eq!(
        code(&unreachable),
        4,
        "{}",
        String::from_utf8_lossy(&unreachable.stderr)
    );

    // High availability required of a standalone Redis: published, not Ready.
    let ha = drop_manifest("needs-ha", &DropSpec::new(5).yaml()).replace(
        "requireHighAvailability: false",
        "requireHighAvailability: true",
    );
    let not_ready = apply(&ha, &redis.url(), &[], &[]);
    assert_eq!(
        code(&not_ready),
        5,
        "{}",
        String::from_utf8_lossy(&not_ready.stderr)
    );

    // Every drop is tried; the first failure's code is returned.
    let mixed = format!(
        "{}---\n{good}",
        drop_manifest("bad2", "  sku: X\n  limitedQuantity: -1\n")
    );
    let out = apply(&mixed, &redis.url(), &[], &[]);
    assert_eq!(code(&out), 3);
    assert!(
        published(&redis, "fine"),
        "the valid drop after an invalid one is reconciled"
    );
}

#[test]
fn log_lines_are_json_objects_when_asked() {
    let redis = RedisServer::start().expect("redis-server");
    let manifest = drop_manifest("logged", &DropSpec::new(5).yaml());
    for (global, env) in [
        (vec!["--log-format", "json"], vec![("RUST_LOG", "debug")]),
        (
            vec![],
            vec![("RUST_LOG", "debug"), ("DROPGATE_LOG_FORMAT", "json")],
        ),
    ] {
        let out = apply(&manifest, &redis.url(), &global, &env);
        assert_eq!(code(&out), 0);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert!(!lines.is_empty(), "debug logging wrote nothing");
        for line in lines {
            let value: serde_json::Value = serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
            assert!(
                value["level"].is_string() && value["timestamp"].is_string(),
                "{line}"
            );
        }
    }
    let refused = apply(&manifest, &redis.url(), &["--log-format", "xml"], &[]);
    assert_eq!(code(&refused), 2, "clap refuses an unknown format");
    assert!(String::from_utf8_lossy(&refused.stderr).contains("text or json"));
}

/// Hostile Redis and ledger URLs, each with a secret in it, through every path the
/// binaries print a URL on (the override and the drop's own URL in `apply`, the
/// sidecar's start-up): whatever fails, no secret reaches standard output or error.
#[test]
fn no_secret_in_a_url_is_ever_printed() {
    let secrets = [
        "p@ss",
        "hunter2",
        "topsecret",
        "s3cr3t",
        "sëcret",
        "SECRET-VALUE",
    ];
    let printed = |out: &Output| {
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    };
    let assert_clean = |what: &str, out: &Output| {
        let text = printed(out);
        assert!(!text.is_empty(), "{what}: says nothing of what failed");
        for secret in secrets {
            assert!(!text.contains(secret), "{what} printed {secret:?}: {text}");
        }
    };
    let hostile = [
        "redis://:p@ss@127.0.0.1:1/0",
        "redis://user:hunter2@127.0.0.1:1/0?password=topsecret",
        "rediss://:sëcret@127.0.0.1:1",
        "redis://127.0.0.1:1/0?sslpassword=s3cr3t&x=1",
        "hunter2-SECRET-VALUE",
    ];
    let good = DropSpec::new(5).yaml();
    for url in hostile {
        // As the operator's override.
        let out = apply(&drop_manifest("sale", &good), url, &[], &[]);
        assert_ne!(code(&out), 0, "{url}");
        assert_clean(&format!("apply --redis-url {url}"), &out);
        // As the drop's own spec.redis.url.
        let manifest = drop_manifest("sale", &good).replace("redis://unused:1", url);
        let out = operator_with_stdin(&manifest, &["apply", "-f", "-"], &[]);
        assert_ne!(code(&out), 0, "{url}");
        assert_clean(&format!("apply of spec.redis.url {url}"), &out);
    }
    // The sidecar: its Redis URL is logged at start, its ledger's fails to open.
    for (redis_url, database_url) in [
        (
            "redis://:p@ss@127.0.0.1:1/0",
            "postgres://u:hunter2@127.0.0.1:1/x?password=topsecret",
        ),
        (
            "redis://user:hunter2@127.0.0.1:1/0?password=topsecret",
            "postgres://u@127.0.0.1:1/x?sslpassword=s3cr3t",
        ),
        ("redis://127.0.0.1:1", "hunter2-SECRET-VALUE"),
    ] {
        let out = Command::new(binary("dropgate-sidecar"))
            .args(["--listen", "127.0.0.1:0", "--health-listen", "127.0.0.1:0"])
            .args(["--redis-url", redis_url, "--database-url", database_url])
            .output()
            .expect("dropgate-sidecar runs");
        assert_ne!(code(&out), 0, "{database_url}: the ledger cannot open");
        assert_clean(
            &format!("dropgate-sidecar with {redis_url} and {database_url}"),
            &out,
        );
    }
}

/// `dropgate-operator run` whose admin port is taken stops at once with an error
/// naming the port, rather than running on without /healthz and /metrics.
#[test]
fn run_stops_when_its_admin_port_is_taken() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
    let addr = taken.local_addr().expect("its address");
    let mut child = Command::new(binary("dropgate-operator"))
        .args(["run", "--admin-listen", &addr.to_string()])
        .env("KUBECONFIG", "/nonexistent")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("dropgate-operator runs");
    // Bounded: a process that ran on would be killed here and fail the test.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while child.try_wait().expect("waits").is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("dropgate-operator kept running with its admin port taken");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = child.wait_with_output().expect("it exits");
    assert_ne!(code(&out), 0);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("cannot listen on {addr}")),
        "{stderr}"
    );
    drop(taken);
}
