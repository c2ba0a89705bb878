//! End-to-end runs of the real binaries: the local flash sale (`flash-sale`) and the
//! helpers the kind scripts in `e2e/kind/` share with it.
//!
//! # Layout
//!
//! - [`processes`]: starts `dropgate-operator apply` and `dropgate-sidecar` as child
//!   processes, the way a user would.
//! - [`flash_sale`]: thousands of concurrent buyers with retries, duplicate cancels
//!   and throttling; counts every answer and checks docs/design.md's invariants.
//! - [`designs`]: the stock-keeping designs the `bench` binary compares the
//!   sidecar with (lock-and-counter, the SQL row).

pub mod designs;
pub mod flash_sale;
pub mod processes;

use std::time::Duration;

/// The `q` quantile (0.0..=1.0) of sorted samples; zero when there are none.
pub fn quantile(sorted: &[Duration], q: f64) -> Duration {
    let index = ((sorted.len() as f64 * q) as usize).min(sorted.len().saturating_sub(1));
    sorted.get(index).copied().unwrap_or_default()
}
