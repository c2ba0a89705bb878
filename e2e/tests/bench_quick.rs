//! The bench in its quick mode, so that it never rots: every row runs, every
//! oversell check holds, the tables print. Timings are printed, never asserted.

use std::process::Command;

#[test]
fn the_bench_runs_every_design_and_checks_each_for_oversell() {
    let out = Command::new(env!("CARGO_BIN_EXE_bench"))
        .arg("--quick")
        .output()
        .expect("the bench runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for row in [
        "sidecar reserve (HTTP, ledger)",
        "cart of 2 drops",
        "cart confirm (2 lines)",
        "gate script by EVALSHA (raw)",
        "lock + GET/DECRBY + release",
        "SQL row UPDATE (PostgreSQL)",
        "SQL row UPDATE (SQLite)",
        "sidecar sold-out answer",
        "gate script sold-out (raw)",
        "raw EVALSHA admit (redis-benchmark 50c)",
        "sidecar durable admit (SQLite)",
        "8 sidecars sold-out answer",
    ] {
        assert!(stdout.contains(row), "row {row:?} missing:\n{stdout}");
    }
    println!("{stdout}");
}

/// The ledger across sales: rows of each sale gone after its retention, every sale.
#[test]
fn the_ledger_stays_flat_across_sales_with_retention() {
    let out = Command::new(env!("CARGO_BIN_EXE_bench"))
        .args(["--quick", "--retention-sales", "3"])
        .output()
        .expect("the bench runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<Vec<&str>> = stdout
        .lines()
        .filter(|line| {
            line.starts_with("| ") && line[2..].starts_with(|c: char| c.is_ascii_digit())
        })
        .map(|line| line.split('|').map(str::trim).collect())
        .collect();
    assert_eq!(rows.len(), 3, "{stdout}");
    for row in rows {
        // | sale | reservations done | outbox done | reservations after | outbox after | ...
        assert_eq!(row[2], "50", "{stdout}");
        assert_eq!(
            (row[4], row[5]),
            ("0", "0"),
            "a sale's rows outlived its retention:\n{stdout}"
        );
    }
    println!("{stdout}");
}
