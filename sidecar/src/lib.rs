//! The dropgate sidecar: reserve / confirm / cancel on localhost, gated by Redis.
//!
//! # Layout
//!
//! - [`server`]: `run(listener, settings, shutdown)`, the entry point; serves the
//!   routes and runs the background work until shutdown, then drains.
//! - [`routes`]: the HTTP API, one module per route group (reservations, drops,
//!   locks, health). Handlers parse input, call the Redis gate or, for a drop off
//!   it, the ledger's fallback gate, and answer.
//! - [`input`]: request bodies and path segments, checked field by field; every
//!   refusal names its field and nothing reaches Redis before it passed.
//! - [`gate`]: the atomic Lua scripts (`gate/*.lua`, one per operation, run by SHA)
//!   and the thin Rust calls around them.
//! - [`drops`]: the drops this sidecar serves, read from the operator's config
//!   hashes and kept through Redis outages.
//! - [`handover`]: one authority at a time: opening the gate only once Redis holds
//!   everything the ledger recorded (also rebuilding a Redis that lost writes), and
//!   handing a drop to the ledger's fallback gate.
//! - [`record`]: what the gate decided, as the ledger records it.
//! - [`replicas`]: waiting for Redis replicas to acknowledge admissions
//!   (`--wait-replicas`).
//! - [`clock`]: the wall clock in milliseconds.
//! - [`locks`]: fencing-token locks (`locks/*.lua`) behind `/v1/locks`.
//! - [`throttle`]: the per-drop permit semaphore that bounds unconfirmed holds.
//! - [`app`]: what every request shares: the drops, the Redis connection and its
//!   breaker, the ledger, the metrics.
//! - [`maintenance`]: background work: the config refresh that keeps each drop with
//!   its authority (hand-overs, rebuilds, replays), the hold sweepers (with the
//!   settling of admissions a dead sidecar left pending, and the ledger's repair
//!   from Redis), and the outbox dispatcher.
//! - [`answer`]: the JSON answer type (`outcome`, `message`, headers).
//! - [`ledger`]: the SQL ledger behind `--database-url`: the durable record with
//!   its outbox, the fallback gate, lock fences.
//! - [`faults`]: fault-injection points, armed only in test builds.
//! - [`metrics`]: Prometheus metrics for `/metrics`.
//! - [`settings`]: the command line.

pub mod answer;
pub mod app;
pub mod clock;
pub mod drops;
pub mod faults;
pub mod gate;
pub mod handover;
pub mod input;
pub mod ledger;
pub mod locks;
pub mod maintenance;
pub mod metrics;
pub mod record;
pub mod replicas;
pub mod routes;
pub mod server;
pub mod settings;
pub mod throttle;

pub use server::run;
pub use settings::Settings;

/// Why the sidecar could not start or serve.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Settings(String),
    #[error("Redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error(transparent)]
    Ledger(#[from] ledger::LedgerError),
    #[error("listener: {0}")]
    Io(#[from] std::io::Error),
}

/// Logs go to stderr, filtered by `RUST_LOG`. The default leaves out warp's
/// per-connection errors: a client that hangs up, or an idle keep-alive connection
/// closed by a graceful shutdown, is not the sidecar's error.
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,warp::server=off"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}
