//! The operator's side of Redis: publish, seed, restock, read back, clean up.

use std::time::Duration;

use dropgate_api::{DropConfig, DropKeys, Mode};
use dropgate_redis::Connection;
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
                if dropgate_redis::is_not_a_cluster(&source) {
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
/// it orders two sales of the same name (see `lua/seed.lua`). `sale_ledger` is the
/// sale's ledger as the drop's status keeps it, written back into Redis.
pub async fn seed(
    conn: &mut Connection,
    keys: &DropKeys,
    config: &DropConfig,
    created_ms: Option<i64>,
    sale_ledger: Option<&str>,
    claims: dropgate_api::keys::Claims,
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
        .key(keys.ledger())
        .key(keys.deleted())
        .key(keys.variants())
        .key(keys.by_buyer());
    invocation.arg(config.limit);
    invocation.arg(
        config
            .expire_at_ms
            .map(|t| t.to_string())
            .unwrap_or_default(),
    );
    invocation.arg(&config.sale);
    invocation.arg(created_ms.map(|t| t.to_string()).unwrap_or_default());
    invocation.arg(sale_ledger.unwrap_or_default());
    for (field, value) in config.to_fields() {
        invocation.arg(field).arg(value);
    }
    invocation.arg("claims").arg(claims.as_str());
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
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stock {
    /// Unclamped: negative while a cut below what is held is being paid back.
    pub remaining: i64,
    /// Units held by active or confirmed reservations.
    pub held: i64,
    /// The variants' hash (see [`DropKeys::variants`]): `r:<name>` and `h:<name>`.
    pub variants: std::collections::HashMap<String, i64>,
}

impl Stock {
    /// What `variant` may still admit (unclamped) and what its reservations hold.
    pub fn variant(&self, variant: &str) -> (i64, i64) {
        let field = |prefix: &str| {
            self.variants
                .get(&format!("{prefix}:{variant}"))
                .copied()
                .unwrap_or(0)
        };
        (field("r"), field("h"))
    }
}

pub async fn stock(conn: &mut Connection, keys: &DropKeys) -> Result<Stock> {
    let (remaining, held, variants): (
        Option<i64>,
        Option<i64>,
        std::collections::HashMap<String, i64>,
    ) = redis::pipe()
        .get(keys.remaining())
        .get(keys.held())
        .hgetall(keys.variants())
        .query_async(conn)
        .await?;
    Ok(Stock {
        remaining: remaining.unwrap_or(0),
        held: held.unwrap_or(0),
        variants,
    })
}

/// The sale's ledger (see [`DropKeys::ledger`]), once a sidecar claimed it.
pub async fn sale_ledger(conn: &mut Connection, keys: &DropKeys) -> Result<SaleLedger> {
    let ledger: Option<String> = conn.get(keys.ledger()).await?;
    let Some(ledger) = ledger else {
        return Ok(SaleLedger::None);
    };
    Ok(match ledger.strip_prefix(dropgate_api::keys::PROVISIONAL) {
        Some(id) if dropgate_api::config::is_sale(id) => SaleLedger::Claimed(id.to_string()),
        None if dropgate_api::config::is_sale(&ledger) => SaleLedger::Recorded(ledger),
        _ => SaleLedger::None,
    })
}

/// Makes a sidecar's claim of the sale for ledger `id` count, once the drop's
/// status holds it: `claimed:<id>` becomes `<id>` (and nothing else changes).
pub async fn record_claim(conn: &mut Connection, keys: &DropKeys, id: &str) -> Result<bool> {
    static RECORD: std::sync::LazyLock<Script> = std::sync::LazyLock::new(|| {
        Script::new(
            "if redis.call('GET', KEYS[1]) == ARGV[1] .. ARGV[2] then \
               redis.call('SET', KEYS[1], ARGV[2], 'KEEPTTL') return 1 end return 0",
        )
    });
    let recorded: i64 = RECORD
        .key(keys.ledger())
        .arg(dropgate_api::keys::PROVISIONAL)
        .arg(id)
        .invoke_async(conn)
        .await?;
    Ok(recorded == 1)
}

/// The sale's ledger as Redis names it (see [`DropKeys::ledger`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SaleLedger {
    /// No sidecar claimed the sale yet.
    None,
    /// A sidecar claimed it for this ledger; it counts once the status holds it
    /// and the next seed writes it back plain.
    Claimed(String),
    /// The sale's ledger.
    Recorded(String),
}

impl SaleLedger {
    /// The id to keep in status: a claim is recorded before it counts.
    pub fn id(&self) -> Option<&str> {
        match self {
            SaleLedger::None => None,
            SaleLedger::Claimed(id) | SaleLedger::Recorded(id) => Some(id),
        }
    }
}

/// The config the sidecars currently read for this drop, if any.
pub async fn published(conn: &mut Connection, keys: &DropKeys) -> Result<Option<DropConfig>> {
    let fields: std::collections::HashMap<String, String> = conn.hgetall(keys.config()).await?;
    Ok(DropConfig::from_fields(&fields)?)
}

/// How long the deletion tombstone (see [`DropKeys::deleted`]) stays: longer than
/// any sidecar goes without reading the drop's config.
const TOMBSTONE_SECONDS: u64 = 3600;

/// Deletes every key of a drop. The tombstone comes first, then the config hash in
/// its own command, so that sidecars see the drop as deleted (not as lost) before
/// its stock disappears; then the reservations' markers and the waitlist's keys.
pub async fn remove(conn: &mut Connection, keys: &DropKeys) -> Result<()> {
    let fixed = keys.fixed();
    let _: () = conn.set_ex(keys.deleted(), "1", TOMBSTONE_SECONDS).await?;
    let _: () = conn.del(&fixed[0]).await?;
    let _: () = conn.del(&fixed[1..]).await?;
    for pattern in [keys.reservation_pattern(), keys.waitlist_pattern()] {
        remove_matching(conn, &fixed[0], &pattern).await?;
    }
    Ok(())
}

/// Deletes every key matching `pattern` (all in the slot of `slot_key`).
async fn remove_matching(conn: &mut Connection, slot_key: &str, pattern: &str) -> Result<()> {
    let mut cursor: u64 = 0;
    loop {
        let mut scan = redis::cmd("SCAN");
        scan.arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(500);
        // On a cluster the drop's reservations are all on the node of its slot.
        let (next, batch): (u64, Vec<String>) =
            redis::from_redis_value(conn.on_slot_of(slot_key, scan).await?)
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
