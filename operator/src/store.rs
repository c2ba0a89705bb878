//! The operator's side of Redis: publish, seed, restock, read back, clean up.

use std::time::Duration;

use dropgate_api::Connection;
use dropgate_api::{DropConfig, DropKeys, Mode};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{AsyncCommands, Script};

use crate::{Error, Result, redact_url};

/// Connects to the drop's Redis. The manager reconnects by itself, so the controller
/// keeps one per URL for the life of the process.
pub async fn connect(url: &str, cluster: bool) -> Result<Connection> {
    let unavailable = |source| Error::RedisUnavailable {
        url: redact_url(url),
        source,
    };
    if cluster {
        return Connection::cluster(url, Duration::from_secs(2), Duration::from_secs(5))
            .await
            .map_err(|source| {
                if dropgate_api::is_not_a_cluster(&source) {
                    Error::NotACluster(redact_url(url))
                } else {
                    unavailable(source)
                }
            });
    }
    let client = redis::Client::open(url).map_err(unavailable)?;
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(2)))
        .set_response_timeout(Some(Duration::from_secs(5)))
        .set_number_of_retries(2)
        .set_max_delay(Duration::from_millis(500));
    let mut conn = ConnectionManager::new_with_config(client, config)
        .await
        .map_err(unavailable)?;
    // One Redis of a cluster serves only its own slots: the drop's keys may be
    // elsewhere. (A Redis that does not answer INFO is taken at its word.)
    let info: Option<String> = redis::cmd("INFO")
        .arg("cluster")
        .query_async(&mut conn)
        .await
        .ok();
    if info.is_some_and(|info| info.lines().any(|l| l.trim() == "cluster_enabled:1")) {
        return Err(Error::ClusterNotDeclared(redact_url(url)));
    }
    Ok(Connection::from(conn))
}

/// What [`seed`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seeded {
    /// The stock key did not exist and was set to the limit.
    pub created: bool,
    /// How far a restock moved `remaining` (new limit minus the previous one).
    pub moved: i64,
    /// The mode published before this seed, if the drop was published.
    pub previous_mode: Option<Mode>,
    /// `remaining` right after, unclamped.
    pub remaining: i64,
}

/// Publishes `config` and seeds or restocks the stock, atomically (see `lua/seed.lua`).
/// `created_ms` is when the drop's object was created (None outside Kubernetes):
/// it orders two sales of the same name (see `lua/seed.lua`).
pub async fn seed(
    conn: &mut Connection,
    keys: &DropKeys,
    config: &DropConfig,
    created_ms: Option<i64>,
) -> Result<Seeded> {
    static SEED: std::sync::LazyLock<Script> =
        std::sync::LazyLock::new(|| Script::new(include_str!("lua/seed.lua")));
    let mut invocation = SEED.key(keys.config());
    invocation
        .key(keys.remaining())
        .key(keys.gate())
        .key(keys.held())
        .key(keys.buyers())
        .key(keys.holds())
        .key(keys.pending())
        .key(keys.seq())
        .key(keys.ledgers());
    invocation.arg(config.limit);
    invocation.arg(
        config
            .expire_at_ms
            .map(|t| t.to_string())
            .unwrap_or_default(),
    );
    invocation.arg(&config.sale);
    invocation.arg(created_ms.map(|t| t.to_string()).unwrap_or_default());
    for (field, value) in config.to_fields() {
        invocation.arg(field).arg(value);
    }
    let (created, moved, previous_mode, remaining): (i64, i64, String, i64) =
        match invocation.invoke_async(conn).await {
            Ok(reply) => reply,
            Err(e) if e.code() == Some("STALE") => {
                return Err(Error::StaleConfig(
                    e.detail().unwrap_or_default().to_string(),
                ));
            }
            Err(e) => return Err(e.into()),
        };
    Ok(Seeded {
        created: created == 1,
        moved,
        previous_mode: Mode::parse(&previous_mode),
        remaining,
    })
}

/// A drop's stock as Redis holds it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stock {
    /// Unclamped: negative while a cut below what is held is being paid back.
    pub remaining: i64,
    /// Units held by active or confirmed reservations.
    pub held: i64,
}

pub async fn stock(conn: &mut Connection, keys: &DropKeys) -> Result<Stock> {
    let (remaining, held): (Option<i64>, Option<i64>) = redis::pipe()
        .get(keys.remaining())
        .get(keys.held())
        .query_async(conn)
        .await?;
    Ok(Stock {
        remaining: remaining.unwrap_or(0),
        held: held.unwrap_or(0),
    })
}

/// The config the sidecars currently read for this drop, if any.
pub async fn published(conn: &mut Connection, keys: &DropKeys) -> Result<Option<DropConfig>> {
    let fields: std::collections::HashMap<String, String> = conn.hgetall(keys.config()).await?;
    Ok(DropConfig::from_fields(&fields)?)
}

/// Deletes every key of a drop. The config hash goes first, in its own command, so
/// that sidecars see the drop as unknown before its stock disappears.
pub async fn remove(conn: &mut Connection, keys: &DropKeys) -> Result<()> {
    let fixed = keys.fixed();
    let _: () = conn.del(&fixed[0]).await?;
    let _: () = conn.del(&fixed[1..]).await?;
    let pattern = keys.reservation_pattern();
    let mut cursor: u64 = 0;
    loop {
        let mut scan = redis::cmd("SCAN");
        scan.arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(500);
        // On a cluster the drop's reservations are all on the node of its slot.
        let (next, batch): (u64, Vec<String>) =
            redis::from_redis_value(conn.on_slot_of(&fixed[0], scan).await?)
                .map_err(redis::RedisError::from)?;
        if !batch.is_empty() {
            let _: () = conn.del(batch).await?;
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}
