//! The stock-keeping designs the bench compares the sidecar with, each driven the
//! way a service would drive it, each with the check that it sold no more than it
//! had: the gate script called straight from a Rust client, the lock-and-counter a
//! naive service writes, and the SQL row a database-first service updates.

use std::time::Duration;

use redis::aio::ConnectionManager;
use sqlx::AnyPool;

/// What one attempt to take a unit came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Took {
    Unit,
    SoldOut,
}

/// The lock-and-counter design: `SET lock NX PX` with a random token, `GET` the
/// stock, `DECRBY` when some is left, release by compare-and-delete; a busy lock
/// is retried with a growing pause.
pub struct LockAndCounter {
    pub conn: ConnectionManager,
    pub stock: String,
    pub lock: String,
}

const RELEASE: &str =
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0";

impl LockAndCounter {
    pub async fn seed(&mut self, units: i64) -> redis::RedisResult<()> {
        redis::cmd("SET")
            .arg(&self.stock)
            .arg(units)
            .query_async(&mut self.conn)
            .await
    }

    pub async fn take(&mut self) -> redis::RedisResult<Took> {
        let token = format!("{:016x}", rand::random::<u64>());
        let mut pause = Duration::from_micros(100);
        loop {
            let got: Option<String> = redis::cmd("SET")
                .arg(&self.lock)
                .arg(&token)
                .arg("NX")
                .arg("PX")
                .arg(1000)
                .query_async(&mut self.conn)
                .await?;
            if got.is_some() {
                break;
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(5));
        }
        let left: i64 = redis::cmd("GET")
            .arg(&self.stock)
            .query_async(&mut self.conn)
            .await?;
        let took = if left > 0 {
            let _: i64 = redis::cmd("DECRBY")
                .arg(&self.stock)
                .arg(1)
                .query_async(&mut self.conn)
                .await?;
            Took::Unit
        } else {
            Took::SoldOut
        };
        let _: i64 = redis::Script::new(RELEASE)
            .key(&self.lock)
            .arg(&token)
            .invoke_async(&mut self.conn)
            .await?;
        Ok(took)
    }

    pub async fn left(&mut self) -> redis::RedisResult<i64> {
        redis::cmd("GET")
            .arg(&self.stock)
            .query_async(&mut self.conn)
            .await
    }
}

/// The SQL row design: `UPDATE stock SET available = available - 1 WHERE sku = $1
/// AND available >= 1`, one statement in its own transaction.
pub struct SqlRow {
    pub pool: AnyPool,
}

impl SqlRow {
    pub async fn seed(&self, units: i64) -> Result<(), sqlx::Error> {
        sqlx::query("DROP TABLE IF EXISTS bench_stock")
            .execute(&self.pool)
            .await?;
        sqlx::query("CREATE TABLE bench_stock (sku TEXT PRIMARY KEY, available BIGINT NOT NULL)")
            .execute(&self.pool)
            .await?;
        sqlx::query("INSERT INTO bench_stock (sku, available) VALUES ($1, $2)")
            .bind("BENCH")
            .bind(units)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    pub async fn take(&self) -> Result<Took, sqlx::Error> {
        let taken = sqlx::query(
            "UPDATE bench_stock SET available = available - 1 WHERE sku = $1 AND available >= 1",
        )
        .bind("BENCH")
        .execute(&self.pool)
        .await?
        .rows_affected();
        Ok(if taken == 1 {
            Took::Unit
        } else {
            Took::SoldOut
        })
    }

    pub async fn left(&self) -> Result<i64, sqlx::Error> {
        use sqlx::Row;
        sqlx::query("SELECT available FROM bench_stock WHERE sku = $1")
            .bind("BENCH")
            .fetch_one(&self.pool)
            .await?
            .try_get(0)
    }
}
