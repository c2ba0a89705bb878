//! The dropgate sidecar: reserve / confirm / cancel on localhost, gated by Redis.
//!
//! # Layout
//!
//! Imports run one way: `routes` -> `service` -> storage (`gate`, `ledger`,
//! `throttle`, `drops`); nothing below the routes knows HTTP, and background work
//! never touches a route: it moves drops through the service's hand-over and
//! records through its `record`, and sweeps storage directly.
//!
//! - [`server`]: `run(listener, settings, shutdown)`, the entry point; serves the
//!   routes and runs the background work until shutdown, then drains.
//! - `routes`: the HTTP API, one module per route group (reservations, carts,
//!   drops, waitlist, locks, health). Handlers parse input, call the service, and turn what it
//!   decided into a JSON answer (`answer`: `outcome`, `message`, headers).
//! - [`input`]: request bodies and path segments, checked field by field; every
//!   refusal names its field and nothing reaches Redis before it passed.
//! - [`reservation`]: the vocabulary both gates speak: a reservation and its
//!   [`State`](reservation::State), what a call came to
//!   ([`Outcome`](reservation::Outcome), one variant per answer with only its own
//!   fields), and the [`Change`](reservation::Change) the ledger records.
//! - [`service`]: the reservation service. Each attempt of a call chooses its gate
//!   in one place (the drop's mode, the Redis breaker, then the failure policy),
//!   and runs reserve ([`service::reserve`], in `service/admit.rs`) and confirm /
//!   cancel / look-up ([`service::settle`], in `service/settle.rs`) on
//!   the Redis gate or the ledger's fallback gate, records what the gate decided
//!   ([`service::record`]), and moves drops between the gates
//!   ([`service::handover`]: opening the gate only once Redis holds everything the
//!   ledger recorded, rebuilding a Redis that lost writes, handing a drop to the
//!   fallback). [`service::cart`] holds, confirms and cancels carts, each line a
//!   reservation of its drop, the whole kept in step by the ledger's cart row;
//!   [`service::waitlist`] the line of buyers a sold-out drop offers units to.
//! - [`gate`]: the atomic Lua scripts (`gate/*.lua`, one per operation, run by SHA)
//!   and the thin Rust calls around them; `gate/reply.rs` parses the replies of the
//!   reservation scripts into the vocabulary, the one place that knows their words.
//! - [`ledger`]: the SQL ledger behind `--database-url`: the durable record with
//!   its outbox, the fallback gate (answering the same [`Outcome`](reservation::Outcome)s),
//!   carts, lock fences.
//! - [`drops`]: the drops this sidecar serves, read from the operator's config
//!   hashes and kept through Redis outages.
//! - [`drop_watch`]: the drops as the API server holds them (`--watch-drops`), what a
//!   fallback admission's config is checked against while Redis cannot be asked.
//! - [`throttle`]: the per-drop permit semaphore that bounds unconfirmed holds.
//! - [`replicas`]: waiting for Redis replicas to acknowledge admissions
//!   (`--wait-replicas`).
//! - [`locks`]: fencing-token locks (`locks/*.lua`) behind `/v1/locks`.
//! - [`app`]: the state every request shares: the drops, the Redis connection and
//!   its [`breaker`], the ledger, the metrics.
//! - [`maintenance`]: background work: the config refresh that keeps each drop with
//!   its authority (through the service's hand-over), the hold sweepers (with the
//!   settling of admissions a dead sidecar left pending, and the ledger's repair
//!   from Redis), and the outbox dispatcher.
//! - [`clock`]: the wall clock in milliseconds, following Redis's.
//! - [`faults`]: fault-injection points, armed in debug builds and with the
//!   `fault-injection` feature.
//! - [`metrics`]: Prometheus metrics for `/metrics`.
//! - [`settings`]: the command line.

mod answer;
pub mod app;
pub mod breaker;
pub mod clock;
pub mod drop_watch;
pub mod drops;
pub mod faults;
pub mod gate;
pub mod in_flight;
pub mod input;
pub mod ledger;
pub mod locks;
pub mod maintenance;
pub mod metrics;
pub mod replicas;
pub mod reservation;
mod routes;
pub mod server;
pub mod service;
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

/// The log filter when `RUST_LOG` is not set. A connection a client drops or the
/// listener closes (see `dropgate-listener`) is logged at debug: not the sidecar's
/// error. sqlx's notes of slow statements are left out: a slow ledger shows in the
/// commit histogram and, past its deadline, as the failure it causes.
pub const DEFAULT_LOG_FILTER: &str = "info,sqlx::query=error";
