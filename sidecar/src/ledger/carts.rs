//! Carts in the ledger: what each cart key asked, and how far deciding it went
//! (see `migrations/0006_carts.sql`). A cart's lines are ordinary reservations of
//! their drops; this row is what makes the cart one thing: a retry of its key, a
//! sidecar that died mid-cart, and a refusal that must give back what was held are
//! all decided from it. Every move is a compare-and-set on the row's state (and
//! attempt), so that two sidecars never both finish one cart.

use sqlx::any::AnyRow;
use sqlx::{Any, Row, Transaction};
use tracing::Instrument;

use super::{Ledger, LedgerError, RecordError};
use crate::reservation::Change;

/// Where a cart as a whole stands (see `migrations/0006_carts.sql`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CartState {
    /// A sidecar is holding its lines until the row's deadline.
    Holding,
    /// Answered 201: the lines it lists are held until the cart's expiry.
    Held,
    /// A sidecar confirms its lines until the row's deadline.
    Confirming,
    /// Every line it held is confirmed.
    Confirmed,
    /// A line lapsed (or was cancelled on its own) before the cart's confirm
    /// reached it: the lines confirmed before stay so, the rest were given back.
    PartlyConfirmed,
    /// Its lines are being given back, to end as the row's `ends_as`; past the
    /// deadline anyone finishes that.
    Releasing,
    /// Answered 409: nothing is held.
    Refused,
    /// Given back after its sidecar stopped mid-way: nothing is held.
    Released,
    Cancelled,
    Expired,
}

impl CartState {
    pub fn as_str(self) -> &'static str {
        match self {
            CartState::Holding => "holding",
            CartState::Held => "held",
            CartState::Confirming => "confirming",
            CartState::Confirmed => "confirmed",
            CartState::PartlyConfirmed => "partly_confirmed",
            CartState::Releasing => "releasing",
            CartState::Refused => "refused",
            CartState::Released => "released",
            CartState::Cancelled => "cancelled",
            CartState::Expired => "expired",
        }
    }

    fn parse(s: &str) -> Result<Self, LedgerError> {
        Ok(match s {
            "holding" => CartState::Holding,
            "held" => CartState::Held,
            "confirming" => CartState::Confirming,
            "confirmed" => CartState::Confirmed,
            "partly_confirmed" => CartState::PartlyConfirmed,
            "releasing" => CartState::Releasing,
            "refused" => CartState::Refused,
            "released" => CartState::Released,
            "cancelled" => CartState::Cancelled,
            "expired" => CartState::Expired,
            other => {
                return Err(LedgerError::Sql(sqlx::Error::Decode(
                    format!("unknown cart state {other:?}").into(),
                )));
            }
        })
    }
}

/// A cart as the ledger records it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CartRow {
    pub key: String,
    pub user: String,
    /// The cart's mode and added-up lines, as canonical JSON.
    pub terms: String,
    pub state: CartState,
    /// What a releasing cart ends as.
    pub ends_as: Option<CartState>,
    /// Which attempt is holding or releasing it.
    pub attempt: String,
    /// Until when that attempt may work on it (ms since the epoch).
    pub deadline_ms: i64,
    /// When a held cart expires as a whole: its earliest line's deadline.
    pub expires_at_ms: i64,
    /// The numbers (from 1) of the lines held, as a JSON array.
    pub held: String,
    /// The lines not held and why, as the JSON the answer gave.
    pub short: String,
}

fn cart_row(row: &AnyRow) -> Result<CartRow, LedgerError> {
    Ok(CartRow {
        key: row.try_get("cart_key")?,
        user: row.try_get("user_id")?,
        terms: row.try_get("terms")?,
        state: CartState::parse(&row.try_get::<String, _>("state")?)?,
        ends_as: match row.try_get::<String, _>("ends_as")?.as_str() {
            "" => None,
            other => Some(CartState::parse(other)?),
        },
        attempt: row.try_get("attempt")?,
        deadline_ms: row.try_get("deadline_ms")?,
        expires_at_ms: row.try_get("expires_at_ms")?,
        held: row.try_get("held")?,
        short: row.try_get("short")?,
    })
}

const COLUMNS: &str =
    "cart_key, user_id, terms, state, ends_as, attempt, deadline_ms, expires_at_ms, held, short";

/// A new cart's row, as [`Ledger::begin_cart`] writes it.
pub struct NewCart<'a> {
    pub namespace: &'a str,
    pub key: &'a str,
    pub user: &'a str,
    pub terms: &'a str,
    pub attempt: &'a str,
    pub deadline_ms: i64,
    pub now_ms: i64,
}

/// How a cart's state moves, if it still is where the mover saw it.
#[derive(Clone, Copy, Debug)]
pub struct CartMove<'a> {
    pub namespace: &'a str,
    pub key: &'a str,
    pub from: CartState,
    /// The attempt the mover saw on it: the row moves only if that is still so.
    pub attempt: &'a str,
    pub to: CartState,
    /// What a move to `Releasing` ends as.
    pub ends_as: Option<CartState>,
    /// The attempt that works on it from now on, and until when (a move that ends
    /// the work names a fresh attempt nobody works under, with deadline 0: it is
    /// how the move is told apart from another's once made again).
    pub new_attempt: &'a str,
    pub deadline_ms: i64,
    pub expires_at_ms: i64,
    pub held: &'a str,
    pub short: &'a str,
}

impl Ledger {
    /// Writes a new cart in state `holding` for `cart.attempt`, unless the key has
    /// one: then that one, unchanged. `Ok((row, true))` when this call wrote it.
    /// Written in the writer's next group commit, with the admissions of the
    /// moment: a cart then costs no commit of its own.
    pub async fn begin_cart(
        &self,
        cart: NewCart<'_>,
    ) -> Result<Option<(CartRow, bool)>, LedgerError> {
        let write = CartWrite::Begin {
            namespace: cart.namespace.to_string(),
            key: cart.key.to_string(),
            user: cart.user.to_string(),
            terms: cart.terms.to_string(),
            attempt: cart.attempt.to_string(),
            deadline_ms: cart.deadline_ms,
            now_ms: cart.now_ms,
        };
        match self.write_cart(write).await? {
            CartWritten::Begun(begun) => Ok(begun),
            CartWritten::Moved(_) => Err(mixed_up()),
        }
    }

    /// The cart recorded under `key`, if any.
    pub async fn cart(&self, namespace: &str, key: &str) -> Result<Option<CartRow>, LedgerError> {
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM carts WHERE namespace = $1 AND cart_key = $2"
        )))
        .bind(namespace)
        .bind(key)
        .fetch_optional(self.pool())
        .await?;
        row.as_ref().map(cart_row).transpose()
    }

    /// Moves a cart as `change` says, if it still is in `change.from` with
    /// `change.attempt` working on it: whether it moved. Every move names a new
    /// attempt, so a mover that read the row before another moved it
    /// moves nothing. Written in the writer's next group commit, as
    /// [`Ledger::begin_cart`].
    pub async fn move_cart(&self, change: CartMove<'_>) -> Result<bool, LedgerError> {
        let write = CartWrite::from(change);
        match self.write_cart(write).await? {
            CartWritten::Moved(moved) => Ok(moved),
            CartWritten::Begun(_) => Err(mixed_up()),
        }
    }

    /// Records `changes` and the cart's move `cart` in one transaction, all or
    /// nothing: a change the ledger refuses, or a cart another mover moved first,
    /// rolls the whole back (the first refusal is returned). Made by the writer, in
    /// a transaction of its own. `Err(LedgerError::CommitUnknown)`: it may have
    /// landed, whole.
    pub async fn record_with_cart(
        &self,
        changes: Vec<Change>,
        cart: CartMove<'_>,
    ) -> Result<CartCommit, LedgerError> {
        let span = tracing::debug_span!(
            "ledger commit",
            otel.kind = "client",
            db.system = self.backend.system(),
            db.system.name = self.backend.system(),
            db.operation.name = "COMMIT",
        );
        let (done, wait) = tokio::sync::oneshot::channel();
        let gone = || LedgerError::Sql(sqlx::Error::Protocol("the ledger's writer stopped".into()));
        async {
            self.writer
                .send(super::Queued::AllOrNothing((
                    changes,
                    CartWrite::from(cart),
                    done,
                )))
                .await
                .map_err(|_| gone())?;
            wait.await.map_err(|_| gone())?
        }
        .instrument(span)
        .await
    }

    /// Forgets a cart that `attempt` is holding with nothing held (a line could
    /// not be decided before any was held): its key is free for a fresh try.
    pub async fn forget_cart(
        &self,
        namespace: &str,
        key: &str,
        attempt: &str,
    ) -> Result<bool, LedgerError> {
        let forgotten = sqlx::query(
            "DELETE FROM carts WHERE namespace = $1 AND cart_key = $2 AND state = 'holding' AND attempt = $3",
        )
        .bind(namespace)
        .bind(key)
        .bind(attempt)
        .execute(self.pool())
        .await?;
        Ok(forgotten.rows_affected() == 1)
    }

    /// Carts of `namespace` that someone must finish (at most `limit`): held past
    /// their expiry, or holding, confirming or releasing past their attempt's
    /// deadline (its sidecar died or gave up mid-way).
    pub async fn overdue_carts(
        &self,
        namespace: &str,
        now_ms: i64,
        limit: i64,
    ) -> Result<Vec<CartRow>, LedgerError> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM carts WHERE namespace = $2 AND \
             ((state IN ('holding', 'confirming', 'releasing') AND deadline_ms < $1) \
              OR (state = 'held' AND expires_at_ms < $1)) \
             ORDER BY deadline_ms LIMIT $3"
        )))
        .bind(now_ms)
        .bind(namespace)
        .bind(limit)
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(cart_row).collect()
    }
}

/// A write of a cart's row, made by the ledger's writer inside a group commit (see
/// [`Ledger::begin_cart`] and [`Ledger::move_cart`]).
#[derive(Debug)]
pub(super) enum CartWrite {
    Begin {
        namespace: String,
        key: String,
        user: String,
        terms: String,
        attempt: String,
        deadline_ms: i64,
        now_ms: i64,
    },
    Move {
        namespace: String,
        key: String,
        from: CartState,
        attempt: String,
        to: CartState,
        ends_as: Option<CartState>,
        new_attempt: String,
        deadline_ms: i64,
        expires_at_ms: i64,
        held: String,
        short: String,
    },
}

/// What [`Ledger::record_with_cart`] came to.
#[derive(Debug)]
pub enum CartCommit {
    /// Every change and the cart's move committed.
    Committed,
    /// Nothing committed: the ledger refused a change (the first refusal).
    LineRefused(RecordError),
    /// Nothing committed: the cart was not where the move expected it (another
    /// mover came first).
    CartMoved,
}

/// What a [`CartWrite`] came to.
#[derive(Debug)]
pub(super) enum CartWritten {
    /// The key's row and whether this write made it (`None`: the row in the way
    /// was forgotten before it could be read).
    Begun(Option<(CartRow, bool)>),
    /// Whether the row moved.
    Moved(bool),
}

pub(super) fn mixed_up() -> LedgerError {
    LedgerError::Sql(sqlx::Error::Protocol(
        "the ledger's writer answered a cart write with another kind of result".into(),
    ))
}

impl From<CartMove<'_>> for CartWrite {
    fn from(change: CartMove<'_>) -> Self {
        CartWrite::Move {
            namespace: change.namespace.to_string(),
            key: change.key.to_string(),
            from: change.from,
            attempt: change.attempt.to_string(),
            to: change.to,
            ends_as: change.ends_as,
            new_attempt: change.new_attempt.to_string(),
            deadline_ms: change.deadline_ms,
            expires_at_ms: change.expires_at_ms,
            held: change.held.to_string(),
            short: change.short.to_string(),
        }
    }
}

impl CartWrite {
    /// The row it writes, to order a group commit's cart writes: two commits
    /// writing the same carts take their rows' locks in the same order.
    pub(super) fn row(&self) -> (&str, &str) {
        match self {
            CartWrite::Begin { namespace, key, .. } | CartWrite::Move { namespace, key, .. } => {
                (namespace, key)
            }
        }
    }

    /// Makes the write in `tx`: one statement (a begin that finds the key taken
    /// reads the row in its way).
    pub(super) async fn apply(
        &self,
        tx: &mut Transaction<'static, Any>,
    ) -> Result<CartWritten, sqlx::Error> {
        match self {
            CartWrite::Begin {
                namespace,
                key,
                user,
                terms,
                attempt,
                deadline_ms,
                now_ms,
            } => {
                // A new cart (the usual case): the row it wrote comes back.
                let written = sqlx::query(sqlx::AssertSqlSafe(format!(
                    "INSERT INTO carts (namespace, cart_key, user_id, terms, state, attempt, deadline_ms, created_at_ms) \
                     VALUES ($1, $2, $3, $4, 'holding', $5, $6, $7) ON CONFLICT (namespace, cart_key) DO NOTHING \
                     RETURNING {COLUMNS}"
                )))
                .bind(namespace)
                .bind(key)
                .bind(user)
                .bind(terms)
                .bind(attempt)
                .bind(deadline_ms)
                .bind(now_ms)
                .fetch_optional(&mut **tx)
                .await?;
                if let Some(row) = written {
                    return Ok(CartWritten::Begun(Some((decoded(&row)?, true))));
                }
                // (A row of this write's own attempt is this write's: attempts are
                // made anew for each request. See `apply_again`.)
                Ok(CartWritten::Begun(read_in(tx, namespace, key).await?.map(
                    |row| {
                        let mine = row.attempt == *attempt;
                        (row, mine)
                    },
                )))
            }
            CartWrite::Move {
                namespace,
                key,
                from,
                attempt,
                to,
                ends_as,
                new_attempt,
                deadline_ms,
                expires_at_ms,
                held,
                short,
            } => {
                let moved = sqlx::query(
                    "UPDATE carts SET state = $1, attempt = $2, deadline_ms = $3, held = $4, short = $5, \
                     ends_as = $6, expires_at_ms = $7 \
                     WHERE namespace = $8 AND cart_key = $9 AND state = $10 AND attempt = $11",
                )
                .bind(to.as_str())
                .bind(new_attempt)
                .bind(deadline_ms)
                .bind(held)
                .bind(short)
                .bind(ends_as.map_or("", CartState::as_str))
                .bind(expires_at_ms)
                .bind(namespace)
                .bind(key)
                .bind(from.as_str())
                .bind(attempt)
                .execute(&mut **tx)
                .await?;
                Ok(CartWritten::Moved(moved.rows_affected() == 1))
            }
        }
    }
}

impl CartWrite {
    /// The write made again after a group commit that held it may or may not have
    /// landed: a begin finds its own row if it did (its attempt), or writes it now;
    /// a move finds the row where it moved it (state and attempt), or moves it now.
    /// On PostgreSQL its statement waits for that commit's row locks, if it is
    /// still running; on SQLite for its write lock.
    pub(super) async fn apply_again(
        &self,
        tx: &mut Transaction<'static, Any>,
    ) -> Result<CartWritten, sqlx::Error> {
        let written = self.apply(tx).await?;
        let CartWrite::Move {
            namespace,
            key,
            to,
            new_attempt,
            ..
        } = self
        else {
            return Ok(written);
        };
        if let CartWritten::Moved(true) = written {
            return Ok(written);
        }
        let landed = read_in(tx, namespace, key)
            .await?
            .is_some_and(|row| row.state == *to && row.attempt == *new_attempt);
        Ok(CartWritten::Moved(landed))
    }
}

/// The cart recorded under `key`, read in `tx`.
async fn read_in(
    tx: &mut Transaction<'static, Any>,
    namespace: &str,
    key: &str,
) -> Result<Option<CartRow>, sqlx::Error> {
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM carts WHERE namespace = $1 AND cart_key = $2"
    )))
    .bind(namespace)
    .bind(key)
    .fetch_optional(&mut **tx)
    .await?;
    row.as_ref().map(decoded).transpose()
}

/// [`cart_row`] inside a transaction, whose errors are SQL errors.
fn decoded(row: &AnyRow) -> Result<CartRow, sqlx::Error> {
    cart_row(row).map_err(|e| match e {
        LedgerError::Sql(e) => e,
        other => sqlx::Error::Decode(other.to_string().into()),
    })
}
