//! dropgate's Redis connection, shared by the operator and the sidecar.
//!
//! # Layout
//!
//! - [`connection`]: [`Connection`], one Redis primary (a reconnecting multiplexed
//!   connection) or a Redis Cluster behind one type; what both binaries send their
//!   scripts, pipelines and stream appends through.
//! - `cluster`: the cluster client behind [`Connection::Cluster`]: the slot map read
//!   from any node and refreshed on MOVED, ASK followed for a slot in migration, one
//!   multiplexed connection per node however many drops live there, and every call
//!   bounded in time. [`is_cluster_redirect`] and [`is_not_a_cluster`] tell a caller
//!   that pointed a single-Redis client at a cluster, or the reverse.
//!
//! Every key of one drop carries the drop's hash tag (`dropgate_api::keys`), so each
//! call about a drop goes to the one node that serves its slot.
//!
//! Why not redis-rs's own `cluster-async` client (or fred's): dropgate needs a call's
//! total time bounded (its redirections and map refreshes included) so that a
//! request applies its drop's failure policy in time, a count of connection-level
//! failures per connection (a failover may have lost writes, see the sidecar's
//! breaker), and one error shape for single and cluster Redis; redis-rs 1.x's
//! cluster client retries on its own schedule and hides the connection failures it
//! recovered from, which is what the gate must see.

mod cluster;
pub mod connection;

pub use cluster::{is_cluster_redirect, is_not_a_cluster};
pub use connection::Connection;
