//! Lock fences in the ledger: the high-water mark that keeps fences growing across a
//! Redis failover, and the storage-side check fencing needs.

use sqlx::{AnyPool, Row};

/// The highest fence ever handed out for `lock` (0 when none).
pub async fn high_water(pool: &AnyPool, lock: &str) -> Result<i64, sqlx::Error> {
    let row = sqlx::query("SELECT fence FROM lock_fences WHERE lock_name = $1")
        .bind(lock)
        .fetch_optional(pool)
        .await?;
    match row {
        Some(row) => row.try_get(0),
        None => Ok(0),
    }
}

/// Raises the high-water mark of `lock` to `fence`; false (and nothing changed)
/// when `fence` is not above it: a fence is handed out once.
pub async fn record(pool: &AnyPool, lock: &str, fence: i64) -> Result<bool, sqlx::Error> {
    let recorded = sqlx::query(
        "INSERT INTO lock_fences (lock_name, fence) VALUES ($1, $2) \
         ON CONFLICT (lock_name) DO UPDATE SET fence = excluded.fence \
         WHERE lock_fences.fence < excluded.fence",
    )
    .bind(lock)
    .bind(fence)
    .execute(pool)
    .await?;
    Ok(recorded.rows_affected() == 1)
}

/// Forgets the high-water marks of locks last taken before `before_ms` (ms since
/// the epoch); returns how many. A fence is never below Redis's clock in
/// microseconds when it is handed out, so a mark that low belongs to a lock not
/// taken since, and the next fence of that name is above it anyway (by Redis's
/// clock, under the same assumption as every fence): one row per lock name ever
/// used would otherwise stay for good.
pub async fn prune(pool: &AnyPool, before_ms: i64) -> Result<u64, sqlx::Error> {
    let pruned = sqlx::query("DELETE FROM lock_fences WHERE fence < $1")
        .bind(before_ms.saturating_mul(1000))
        .execute(pool)
        .await?;
    Ok(pruned.rows_affected())
}

/// Writes `value` to `resource` on behalf of the holder of `fence`, unless a holder
/// with this fence or a higher one already wrote: the check that makes a paused,
/// expired holder's late write harmless (an equal fence is refused too: fences
/// never repeat, so an equal one is a replayed or forged write). Returns whether the
/// write was accepted.
pub async fn fenced_write(
    pool: &AnyPool,
    resource: &str,
    fence: i64,
    value: &str,
) -> Result<bool, sqlx::Error> {
    let written = sqlx::query(
        "INSERT INTO fenced_writes (resource, fence, value) VALUES ($1, $2, $3) \
         ON CONFLICT (resource) DO UPDATE SET fence = excluded.fence, value = excluded.value \
         WHERE fenced_writes.fence < excluded.fence",
    )
    .bind(resource)
    .bind(fence)
    .bind(value)
    .execute(pool)
    .await?;
    Ok(written.rows_affected() == 1)
}

/// What `resource` holds, and the fence that wrote it.
pub async fn read(pool: &AnyPool, resource: &str) -> Result<Option<(i64, String)>, sqlx::Error> {
    let row = sqlx::query("SELECT fence, value FROM fenced_writes WHERE resource = $1")
        .bind(resource)
        .fetch_optional(pool)
        .await?;
    row.map(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
        .transpose()
}
