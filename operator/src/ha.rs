//! High-availability verification of a drop's Redis.

use dropgate_api::Tier;
use redis::aio::ConnectionManager;

/// What a check found, with a sentence for the HighlyAvailable condition.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HaReport {
    pub tier: Tier,
    pub verdict: Verdict,
    pub reason: &'static str,
    pub message: String,
}

/// A verified answer, or none. Only a verified answer may change a drop's mode: a
/// check that could not be made (a timeout, a 5xx, a token that did not refresh)
/// says nothing about the Redis behind it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Verified: the right tier *and* in a state to fail over (a STANDARD_HA
    /// instance in maintenance does not count).
    HighlyAvailable,
    /// Verified: no replica to fail over to.
    NotHighlyAvailable,
    /// The check could not be made.
    Unknown,
}

impl Verdict {
    /// The verdict as traces name it.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::HighlyAvailable => "highly_available",
            Verdict::NotHighlyAvailable => "not_highly_available",
            Verdict::Unknown => "unknown",
        }
    }
}

impl HaReport {
    pub fn is_highly_available(&self) -> bool {
        self.verdict == Verdict::HighlyAvailable
    }

    pub fn is_verified(&self) -> bool {
        self.verdict != Verdict::Unknown
    }

    /// A verified answer.
    pub fn verdict(
        tier: Tier,
        highly_available: bool,
        reason: &'static str,
        message: String,
    ) -> Self {
        Self {
            tier,
            verdict: if highly_available {
                Verdict::HighlyAvailable
            } else {
                Verdict::NotHighlyAvailable
            },
            reason,
            message,
        }
    }

    /// A check that could not be made.
    pub fn unknown(reason: &'static str, message: String) -> Self {
        Self {
            tier: Tier::Unknown,
            verdict: Verdict::Unknown,
            reason,
            message,
        }
    }
}

/// Reads `INFO replication` on the drop's Redis. A failed read is a check that
/// could not be made, not a verdict.
pub async fn replication(conn: &mut ConnectionManager) -> HaReport {
    match redis::cmd("INFO")
        .arg("replication")
        .query_async::<String>(conn)
        .await
    {
        Ok(info) => from_replication_info(&info),
        Err(e) => HaReport::unknown(
            "InfoReplicationFailed",
            format!("INFO replication failed: {e}"),
        ),
    }
}

/// Reads Redis's `maxmemory-policy`: anything but `noeviction` may evict a drop's
/// keys under memory pressure, and an evicted stock key loses the sale's count.
/// `None` when the server does not say (managed Redis often refuses CONFIG).
pub async fn eviction_policy(conn: &mut ConnectionManager) -> Option<String> {
    let info: String = redis::cmd("INFO")
        .arg("memory")
        .query_async(conn)
        .await
        .ok()?;
    info.lines()
        .find_map(|line| line.trim().strip_prefix("maxmemory_policy:"))
        .map(str::to_string)
}

/// Judges an `INFO replication` reply: a master with at least one replica in state
/// `online` is replicated. A replica that is still syncing would lose the writes of a
/// failover, so it does not count.
pub fn from_replication_info(info: &str) -> HaReport {
    let field = |name: &str| {
        info.lines()
            .find_map(|line| line.trim().strip_prefix(name)?.strip_prefix(':'))
    };
    let role = field("role").unwrap_or("unknown");
    if role != "master" {
        return HaReport::verdict(
            Tier::Unknown,
            false,
            "NotAMaster",
            format!("Redis reports role {role:?}: point the drop at the master"),
        );
    }
    let connected = field("connected_slaves").and_then(|n| n.parse::<u32>().ok());
    let online = info
        .lines()
        .filter(|line| {
            let line = line.trim();
            line.starts_with("slave")
                && line.contains(':')
                && line.split(',').any(|kv| kv == "state=online")
        })
        .count();
    if online > 0 {
        HaReport::verdict(
            Tier::Replicated,
            true,
            "Replicated",
            format!("master with {online} online replica(s)"),
        )
    } else {
        HaReport::verdict(
            Tier::Standalone,
            false,
            "NoOnlineReplica",
            format!(
                "master with no online replica ({} connected)",
                connected.unwrap_or(0)
            ),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn judges_info_replication() {
        let standalone =
            "# Replication\r\nrole:master\r\nconnected_slaves:0\r\nmaster_repl_offset:0\r\n";
        assert_eq!(from_replication_info(standalone).tier, Tier::Standalone);

        let replicated = "role:master\r\nconnected_slaves:1\r\nslave0:ip=127.0.0.1,port=6380,state=online,offset=42,lag=0\r\n";
        let report = from_replication_info(replicated);
        assert_eq!(report.tier, Tier::Replicated);
        assert!(report.is_highly_available());

        let syncing = "role:master\r\nconnected_slaves:1\r\nslave0:ip=127.0.0.1,port=6380,state=wait_bgsave,offset=0,lag=0\r\n";
        assert_eq!(from_replication_info(syncing).tier, Tier::Standalone);

        let replica = "role:slave\r\nmaster_host:10.0.0.1\r\n";
        assert_eq!(from_replication_info(replica).tier, Tier::Unknown);
    }
}
