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
    let mut child = Command::new(binary("dropgate-operator"))
        .args(global)
        .args(["apply", "-f", "-", "--redis-url", redis_url])
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
