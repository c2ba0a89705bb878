//! Test harness shared by the crates' integration tests, the flash sale and e2e:
//! real servers on free loopback ports, a small HTTP client, and the drop specs
//! tests seed.
//!
//! Every server runs in a temporary directory and is killed when its handle drops,
//! so a failed test leaves nothing behind.

mod drop_spec;
mod http_client;
pub mod openapi;
mod postgres;
mod proxy;
mod redis_server;

pub use drop_spec::DropSpec;
pub use http_client::{HttpClient, Reply};
pub use postgres::PostgresServer;
pub use proxy::TcpProxy;
pub use redis_server::{Checkpoint, RedisCluster, RedisServer, SlotMove};

use std::net::TcpListener;

/// A loopback port that was free a moment ago. The OS hands out ephemeral ports
/// round-robin, so the race with another process is rare; servers that lose it fail
/// to start and the callers retry with a new port.
pub fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Looks for an executable on PATH and in the given fallback directories.
pub(crate) fn find_binary(name: &str, fallbacks: &[&str]) -> Option<std::path::PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .chain(
            fallbacks
                .iter()
                .map(|dir| std::path::Path::new(dir).join(name)),
        )
        .find(|candidate| candidate.is_file())
}

/// The resident memory of process `pid` (kB, from /proc; 0 when it cannot be read):
/// what a memory bound in a test is checked against.
pub fn resident_kb(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find(|line| line.starts_with("VmRSS:"))
                .and_then(|line| line.split_whitespace().nth(1))
                .and_then(|kb| kb.parse().ok())
        })
        .unwrap_or(0)
}
