//! High-availability verification of a drop's Redis.

use dropgate_api::Tier;
use dropgate_redis::Connection;

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
pub async fn replication(conn: &mut Connection) -> HaReport {
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

/// Reads `CLUSTER SHARDS` on a Redis Cluster (from whichever node answers): every
/// shard that serves slots needs an online primary and an online replica. A failed
/// read is a check that could not be made, not a verdict.
pub async fn cluster_shards(conn: &mut Connection) -> HaReport {
    match redis::cmd("CLUSTER")
        .arg("SHARDS")
        .query_async::<redis::Value>(conn)
        .await
    {
        Ok(shards) => from_cluster_shards(&shards),
        Err(e) => HaReport::unknown("ClusterShardsFailed", format!("CLUSTER SHARDS failed: {e}")),
    }
}

/// The field/value pairs of a `CLUSTER SHARDS` entry (an array in RESP2, a map in
/// RESP3).
fn pairs(value: &redis::Value) -> Vec<(String, &redis::Value)> {
    let text = |v: &redis::Value| match v {
        redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        redis::Value::SimpleString(s) => s.clone(),
        _ => String::new(),
    };
    match value {
        redis::Value::Array(items) => items
            .chunks(2)
            .filter_map(|kv| match kv {
                [k, v] => Some((text(k), v)),
                _ => None,
            })
            .collect(),
        redis::Value::Map(items) => items.iter().map(|(k, v)| (text(k), v)).collect(),
        _ => Vec::new(),
    }
}

/// Judges a `CLUSTER SHARDS` reply.
pub fn from_cluster_shards(reply: &redis::Value) -> HaReport {
    let redis::Value::Array(shards) = reply else {
        return HaReport::unknown(
            "ClusterShardsUnreadable",
            "CLUSTER SHARDS answered something that is not a list of shards".into(),
        );
    };
    let field = |pairs: &[(String, &redis::Value)], name: &str| -> String {
        pairs
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| match v {
                redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
                redis::Value::SimpleString(s) => s.clone(),
                redis::Value::Int(i) => i.to_string(),
                _ => String::new(),
            })
            .unwrap_or_default()
    };
    let mut serving = 0;
    let mut without_replica = Vec::new();
    for shard in shards {
        let shard = pairs(shard);
        let slots = shard.iter().find(|(k, _)| k == "slots").map(|(_, v)| *v);
        if !matches!(slots, Some(redis::Value::Array(s)) if !s.is_empty()) {
            continue;
        }
        serving += 1;
        let nodes: Vec<Vec<(String, &redis::Value)>> =
            match shard.iter().find(|(k, _)| k == "nodes").map(|(_, v)| *v) {
                Some(redis::Value::Array(nodes)) => nodes.iter().map(pairs).collect(),
                _ => Vec::new(),
            };
        let online = |role: &str| {
            nodes
                .iter()
                .filter(|n| field(n, "role") == role && field(n, "health") == "online")
                .count()
        };
        if online("master") == 0 || online("replica") == 0 {
            let primary = nodes
                .iter()
                .find(|n| field(n, "role") == "master")
                .map(|n| format!("{}:{}", field(n, "ip"), field(n, "port")))
                .unwrap_or_else(|| "(no primary)".into());
            without_replica.push(primary);
        }
    }
    if serving == 0 {
        return HaReport::verdict(
            Tier::Unknown,
            false,
            "ClusterServesNoSlots",
            "the Redis Cluster has no shard serving slots".into(),
        );
    }
    if without_replica.is_empty() {
        HaReport::verdict(
            Tier::Replicated,
            true,
            "ClusterReplicated",
            format!("all {serving} shards of the Redis Cluster have an online primary and replica"),
        )
    } else {
        HaReport::verdict(
            Tier::Standalone,
            false,
            "ClusterShardWithoutReplica",
            format!(
                "{} of {serving} shards have no online replica (primaries {}): a failover there loses the drop",
                without_replica.len(),
                without_replica.join(", ")
            ),
        )
    }
}

/// Reads Redis's `maxmemory-policy`: anything but `noeviction` may evict a drop's
/// keys under memory pressure, and an evicted stock key loses the sale's count.
/// `None` when the server does not say (managed Redis often refuses CONFIG).
/// On a cluster every primary answers; any one that evicts is reported.
pub async fn eviction_policy(conn: &mut Connection) -> Option<String> {
    let reply: redis::Value = redis::cmd("INFO")
        .arg("memory")
        .query_async(conn)
        .await
        .ok()?;
    let policy = |info: &str| {
        info.lines()
            .find_map(|line| line.trim().strip_prefix("maxmemory_policy:"))
            .map(str::to_string)
    };
    let text = |value: &redis::Value| match value {
        redis::Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        redis::Value::SimpleString(s) => Some(s.clone()),
        redis::Value::VerbatimString { text, .. } => Some(text.clone()),
        _ => None,
    };
    match &reply {
        redis::Value::Map(nodes) => {
            let policies: Vec<String> = nodes
                .iter()
                .filter_map(|(_, info)| policy(&text(info)?))
                .collect();
            policies
                .iter()
                .find(|p| p.as_str() != "noeviction")
                .or(policies.first())
                .cloned()
        }
        single => policy(&text(single)?),
    }
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

    fn text(s: &str) -> redis::Value {
        redis::Value::BulkString(s.as_bytes().to_vec())
    }

    fn node(port: i64, role: &str, health: &str) -> redis::Value {
        redis::Value::Array(vec![
            text("ip"),
            text("127.0.0.1"),
            text("port"),
            redis::Value::Int(port),
            text("role"),
            text(role),
            text("health"),
            text(health),
        ])
    }

    fn shard(slots: &[i64], nodes: Vec<redis::Value>) -> redis::Value {
        redis::Value::Array(vec![
            text("slots"),
            redis::Value::Array(slots.iter().map(|s| redis::Value::Int(*s)).collect()),
            text("nodes"),
            redis::Value::Array(nodes),
        ])
    }

    #[test]
    fn judges_cluster_shards() {
        let replicated = |port| {
            vec![
                node(port, "master", "online"),
                node(port + 3, "replica", "online"),
            ]
        };
        let all = redis::Value::Array(vec![
            shard(&[0, 5460], replicated(7000)),
            shard(&[5461, 10922], replicated(7001)),
            shard(&[10923, 16383], replicated(7002)),
            // A primary serving no slots is no shard of the data.
            shard(&[], vec![node(7009, "master", "online")]),
        ]);
        let report = from_cluster_shards(&all);
        assert_eq!(
            (report.tier, report.reason),
            (Tier::Replicated, "ClusterReplicated")
        );
        assert!(report.is_highly_available());

        let syncing = redis::Value::Array(vec![
            shard(&[0, 8191], replicated(7000)),
            shard(
                &[8192, 16383],
                vec![
                    node(7001, "master", "online"),
                    node(7004, "replica", "loading"),
                ],
            ),
        ]);
        let report = from_cluster_shards(&syncing);
        assert_eq!(report.reason, "ClusterShardWithoutReplica");
        assert!(report.is_verified() && !report.is_highly_available());
        assert!(
            report.message.contains("127.0.0.1:7001"),
            "{}",
            report.message
        );

        let unreadable = from_cluster_shards(&redis::Value::Okay);
        assert!(!unreadable.is_verified());
    }

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
