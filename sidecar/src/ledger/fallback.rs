//! The ledger's own gate: reserve, confirm, cancel and look-up when Redis is not the
//! gate (kill switch, or Redis unreachable under failurePolicy Open).
//!
//! Each call is one transaction that checks and changes together: the reservation
//! row is inserted first (the idempotency check), then the per-user count and the
//! stock move by conditional UPDATEs (`... WHERE available >= q`). With PostgreSQL
//! shared by every sidecar, concurrent transactions serialise on those rows, so the
//! fallback cannot oversell either. Every change is marked for replay into Redis.
//!
//! Each transaction first checks that the ledger is the drop's authority (see
//! [`super::authority`]): a sidecar still on the fallback after the gate reopened
//! is refused.

use dropgate_api::DropConfig;
use sqlx::{Any, Row, Transaction};

use super::authority::{Holder, read_in, require_ledger};
use super::carts::{CartCommit, CartWrite, CartWritten};
use super::{
    Backend, EventIds, Ledger, LedgerError, RecordError, adjust_holdings, ensure_stock,
    insert_reservation, lock_stock, transition, write_event,
};
use crate::reservation::{
    Ask, Change, Outcome, Reservation, Settle, State, Stock, Terms, VariantRefusal, View,
};

/// One line of a cart confirmed on the ledger's gate (see
/// [`Ledger::fallback_confirm_cart`]).
pub struct FallbackLine<'a> {
    /// The drop's key in the ledger (`namespace/name/sale`).
    pub drop_key: &'a str,
    pub config: &'a DropConfig,
    /// The line's reservation key.
    pub key: &'a str,
}

/// A reservation as the ledger holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Recorded {
    pub key: String,
    pub user: String,
    pub quantity: i64,
    pub state: State,
    pub expires_at_ms: i64,
    /// Redis's number for its last change on the gate (0 for fallback changes).
    pub seq: i64,
    /// The variant it holds units of.
    pub variant: Option<String>,
    /// When it was admitted (ms since the epoch; `None` for a row written before
    /// the ledger kept it).
    pub admitted_at_ms: Option<i64>,
    /// Which attempt prepared the confirm, cancel or extension numbered `seq`
    /// (`None` for an admission, a fallback change, or a row written before the
    /// ledger kept it): a promoted replica can hand the same number out twice, so
    /// the number alone does not say which change the ledger recorded.
    pub changed_by: Option<String>,
}

/// The columns [`to_row`] reads, in its order.
macro_rules! row_columns {
    () => {
        "res_key, user_id, quantity, state, expires_at_ms, seq, variant, admitted_at_ms, changed_by"
    };
}

impl Recorded {
    pub fn reservation(&self) -> Reservation {
        Reservation {
            user: self.user.clone(),
            quantity: self.quantity,
            state: self.state,
            expires_at_ms: self.expires_at_ms,
            variant: self.variant.clone(),
        }
    }
}

/// Whether an admission whose commit had an unknown outcome is in the ledger.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Landed {
    /// Its row is the attempt's.
    Yes,
    /// It is not, and can no longer be.
    No,
    /// The key's row is another attempt's (an earlier one that landed, in `state`).
    Other(State),
}

/// What a fallback transaction came to.
enum Decision<T> {
    Done(T),
    /// The ledger is not the drop's authority: nothing was changed.
    NotAuthority(String),
}

/// Why a fallback transaction did not come to a decision.
enum TxError {
    Sql(sqlx::Error),
    /// It lost a race to a concurrent transaction (the row it was to move moved):
    /// run it again.
    Raced,
    /// The ledger holds a newer generation of the drop than the caller's config
    /// (and not its terms): the caller reads the config again.
    Stale(i64),
}

impl From<sqlx::Error> for TxError {
    fn from(error: sqlx::Error) -> Self {
        TxError::Sql(error)
    }
}

/// Attempts at a transaction that lost a race (a PostgreSQL unique or
/// serialisation conflict) before giving up.
const ATTEMPTS: usize = 5;

/// What a fallback transaction decided, and whether its COMMIT was answered.
enum Committed<T> {
    /// Committed, or rolled back on purpose.
    Known(T),
    /// The COMMIT failed without the server's word (the connection broke, the
    /// driver failed): it may have landed.
    Unknown(T, sqlx::Error),
}

/// Commits `tx`, which decided `done`. A COMMIT the server refused landed nothing
/// (an error as any other); one that failed otherwise is [`Committed::Unknown`].
async fn commit<T>(tx: Transaction<'static, Any>, done: T) -> Result<Committed<T>, TxError> {
    use crate::faults::{Fault, check};
    let unanswered = || sqlx::Error::Io(std::io::Error::other("injected: COMMIT unanswered"));
    if check(Fault::LostCommitUnanswered).is_err() {
        tx.rollback().await?;
        return Ok(Committed::Unknown(done, unanswered()));
    }
    let committed = tx.commit().await;
    if committed.is_ok() && check(Fault::LandedCommitUnanswered).is_err() {
        return Ok(Committed::Unknown(done, unanswered()));
    }
    match committed {
        Ok(()) => Ok(Committed::Known(done)),
        Err(sqlx::Error::Database(db)) if rolled_back(db.code().as_deref()) => {
            Err(TxError::Sql(sqlx::Error::Database(db)))
        }
        Err(unanswered) => Ok(Committed::Unknown(done, unanswered)),
    }
}

/// Whether a COMMIT that failed with this error code surely left nothing behind:
/// PostgreSQL's serialisation, deadlock and constraint failures, a transaction
/// already aborted, a lock not had or a statement cancelled; SQLite's busy and
/// locked. Anything else (an I/O or internal error, a server shutting down) may
/// have landed, and is asked about.
fn rolled_back(code: Option<&str>) -> bool {
    match code {
        // 40003 is "statement completion unknown": it may have landed.
        Some("40003") => false,
        Some(code)
            if code.starts_with("40") || code.starts_with("23") || code.starts_with("25") =>
        {
            true
        }
        Some("55P03" | "57014") => true,
        // SQLITE_BUSY, SQLITE_LOCKED and their extended codes.
        Some("5" | "6" | "261" | "262" | "517" | "518" | "773") => true,
        _ => false,
    }
}

/// How long an admission whose COMMIT was not answered asks the ledger whether it
/// landed before the caller is told that nobody can say.
const ASK_WHETHER_LANDED_FOR: std::time::Duration = std::time::Duration::from_secs(5);

/// How much of a hold must be left for an admission whose COMMIT was not answered
/// to be answered 201 once the ledger says it landed.
const HOLD_MARGIN_MS: i64 = 1_000;

/// A fresh attempt id: the reservation rows (and a confirm's or cancel's event) a
/// fallback transaction writes carry it, so that a COMMIT that was not answered can
/// be asked about (and fenced off).
fn new_attempt() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// `ask` until the ledger answers, for at most `within`; past that,
/// [`LedgerError::CommitUnknown`] naming `error`, the COMMIT's failure.
async fn ask_until_answered<T, F, Fut>(
    ask: F,
    within: std::time::Duration,
    error: &sqlx::Error,
) -> Result<T, LedgerError>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T, LedgerError>>,
{
    let until = std::time::Instant::now() + within;
    let mut pause = std::time::Duration::from_millis(10);
    loop {
        match ask().await {
            Ok(answer) => return Ok(answer),
            Err(asking) if std::time::Instant::now() >= until => {
                return Err(LedgerError::CommitUnknown(format!(
                    "{error}; asking whether it landed: {asking}"
                )));
            }
            Err(_) => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(std::time::Duration::from_millis(500));
            }
        }
    }
}

fn stock(config: &DropConfig) -> Stock {
    Stock::of(config)
}

/// Extends the active hold `row` to `until_ms` on the ledger's gate, within
/// `terms.max_hold_seconds` from its admission: the row's deadline and its event,
/// in the caller's transaction, with the event's id. A deadline at or before the
/// current one changes nothing.
async fn extend_on_fallback(
    tx: &mut Transaction<'static, Any>,
    drop_key: &str,
    config: &DropConfig,
    row: &Recorded,
    terms: Terms,
    until_ms: i64,
    now: i64,
) -> Result<(Outcome, Option<Landing>), TxError> {
    let current = View {
        reservation: row.reservation(),
        remaining: 0,
    };
    if until_ms <= row.expires_at_ms {
        return Ok((Outcome::Extended(current), None));
    }
    // A row written before admissions kept their time: its deadline minus the hold.
    let admitted = row
        .admitted_at_ms
        .unwrap_or(row.expires_at_ms - terms.hold_seconds * 1000);
    if until_ms > admitted + terms.max_hold_seconds * 1000 {
        return Ok((Outcome::ExtensionRefused(current), None));
    }
    let change = Change {
        extension: true,
        expires_at_ms: until_ms,
        ..Change::new(
            drop_key,
            stock(config),
            &row.key,
            &row.reservation(),
            State::Active,
        )
    };
    if !super::extend_hold(tx, &change, false, now).await? {
        return Err(TxError::Raced);
    }
    let mut ids = EventIds::for_events(1);
    write_event(tx, &mut ids, &change, "fallback", now).await?;
    Ok((
        Outcome::Extended(view(tx, drop_key, &row.key).await?),
        Some(Landing::of(&change, "extended")),
    ))
}

/// The event a fallback settle writes, by which its unanswered commit is looked
/// for: its id, the quantity the change left held, and its attempt (where it has
/// one).
struct Landing {
    event_id: String,
    quantity: i64,
    attempt: Option<String>,
}

impl Landing {
    fn of(change: &Change, kind: &str) -> Self {
        Self {
            event_id: super::event_id(change, kind),
            quantity: change.quantity,
            attempt: change.attempt.clone(),
        }
    }

    /// Whether the outbox event `payload` (of this landing's id), written by
    /// `attempt`, is this change's: a duplicate of another attempt that landed
    /// instead is not.
    fn is_in(&self, payload: &str, attempt: Option<&str>) -> bool {
        let quantity = serde_json::from_str::<serde_json::Value>(payload)
            .ok()
            .and_then(|event| event.get("quantity").and_then(serde_json::Value::as_i64));
        quantity == Some(self.quantity)
            && self
                .attempt
                .as_deref()
                .is_none_or(|mine| attempt == Some(mine))
    }
}

/// The terms a fallback admission is decided on: the newest the ledger has seen,
/// which are the caller's own when its config is as new. A caller whose config is
/// older than a generation the ledger knows no terms of is told to read it again.
fn effective_terms(
    config: &DropConfig,
    (generation, terms): (i64, Option<Terms>),
) -> Result<Terms, TxError> {
    if generation <= config.generation {
        return Ok(Terms::of(config));
    }
    terms.ok_or(TxError::Stale(generation))
}

impl Ledger {
    /// Reserve on the ledger's gate, in one transaction: the key (a retry hears what
    /// it holds), the sale window, the per-user limit and the stock, decided on the
    /// newest terms any sidecar sharing the ledger has read.
    pub async fn fallback_reserve(
        &self,
        drop_key: &str,
        config: &DropConfig,
        ask: Ask<'_>,
        now: i64,
    ) -> Result<Outcome, LedgerError> {
        let attempt = new_attempt();
        let decided = retry(|| async {
            let mut tx = self.pool.begin().await?;
            if let Err(authority) = require_ledger(&mut tx, self.backend, drop_key).await? {
                return Ok(not_authority(authority));
            }
            let outcome = match reserve_in(&mut tx, drop_key, config, ask, &attempt, now).await? {
                Line::Kept(outcome) => commit(tx, outcome).await?,
                Line::Refused(outcome) => {
                    tx.rollback().await?;
                    Committed::Known(outcome)
                }
            };
            Ok(Decision::Done(outcome))
        })
        .await?;
        match decided {
            Committed::Known(outcome) => Ok(outcome),
            Committed::Unknown(Outcome::Admitted(view), error) => {
                let deadline = view.reservation.expires_at_ms;
                self.landed(drop_key, ask, &attempt, deadline, error)
                    .await?;
                Ok(Outcome::Admitted(view))
            }
            // A retry's answer: nothing of the request's own was to be written.
            Committed::Unknown(_, error) => Err(error.into()),
        }
    }

    /// Settles the admission `attempt` of `ask`, whose COMMIT was not answered, so
    /// that the caller's answer is true: `Ok` when it landed; the commit's error
    /// when it did not, and now never can (see [`Self::admission_landed`]): nothing
    /// changed; [`LedgerError::CommitUnknown`] when the ledger cannot be asked
    /// before the hold's `deadline_ms` (less a margin): a 201 is never sent for a
    /// hold that may have lapsed meanwhile.
    async fn landed(
        &self,
        drop_key: &str,
        ask: Ask<'_>,
        attempt: &str,
        deadline_ms: i64,
        error: sqlx::Error,
    ) -> Result<(), LedgerError> {
        let left_ms = deadline_ms - crate::clock::now_ms() - HOLD_MARGIN_MS;
        let within = ASK_WHETHER_LANDED_FOR.min(std::time::Duration::from_millis(
            u64::try_from(left_ms).unwrap_or(0),
        ));
        let asked = ask_until_answered(
            || {
                self.admission_landed(
                    drop_key,
                    ask.key,
                    ask.user,
                    ask.quantity,
                    attempt,
                    crate::clock::now_ms(),
                )
            },
            within,
            &error,
        )
        .await?;
        match asked {
            Landed::Yes => Ok(()),
            Landed::No | Landed::Other(_) => Err(error.into()),
        }
    }

    /// A cart's lines on the ledger's gate, in one transaction: each decided as
    /// [`Self::fallback_reserve`] decides a reserve, in the order given (a line
    /// refused is rolled back to before it, the others stand). With `all`, when
    /// any line is refused, and in any mode when a line is refused for something
    /// other than being short (its key holds another reservation, its variant does
    /// not fit: the whole cart is refused then), nothing is changed: the lines that
    /// would have been admitted are answered `None` (withdrawn), the others with
    /// their outcomes.
    pub async fn fallback_cart(
        &self,
        lines: &[CartAsk<'_>],
        all: bool,
        now: i64,
    ) -> Result<Vec<Option<Outcome>>, LedgerError> {
        let attempt = new_attempt();
        let decided = retry(|| async {
            let mut tx = self.pool.begin().await?;
            let mut checked: Vec<&str> = Vec::new();
            for line in lines {
                if checked.contains(&line.drop_key) {
                    continue;
                }
                if let Err(authority) = require_ledger(&mut tx, self.backend, line.drop_key).await?
                {
                    return Ok(not_authority(authority));
                }
                checked.push(line.drop_key);
            }
            // Every drop's stock row locked before any line, in the order of their
            // keys (a line would lock them in the cart's order, which another
            // cart or a group commit may take the other way round).
            checked.sort_unstable();
            for drop_key in &checked {
                lock_stock(&mut tx, drop_key).await?;
            }
            let mut decided: Vec<Line> = Vec::with_capacity(lines.len());
            for line in lines {
                sqlx::query("SAVEPOINT cart_line").execute(&mut *tx).await?;
                let line = reserve_in(&mut tx, line.drop_key, line.config, line.ask, &attempt, now)
                    .await?;
                if let Line::Refused(_) = line {
                    sqlx::query("ROLLBACK TO SAVEPOINT cart_line")
                        .execute(&mut *tx)
                        .await?;
                }
                sqlx::query("RELEASE SAVEPOINT cart_line")
                    .execute(&mut *tx)
                    .await?;
                decided.push(line);
            }
            let outcome = |line: &Line| match line {
                Line::Kept(outcome) | Line::Refused(outcome) => outcome.clone(),
            };
            let holds = |outcome: &Outcome| {
                outcome
                    .view()
                    .is_some_and(|v| v.reservation.state.holds_units())
            };
            // A line short of stock, of the buyer's limit or of the sale's window;
            // any other refusal (a key used for something else, a variant that does
            // not fit) refuses the whole cart, whatever its mode.
            let short = |outcome: &Outcome| {
                matches!(
                    outcome,
                    Outcome::SoldOut { .. }
                        | Outcome::PerUserLimit { .. }
                        | Outcome::NotOpen { .. }
                        | Outcome::Ended { .. }
                        | Outcome::Paused
                )
            };
            let refused = decided.iter().any(|line| !holds(&outcome(line)));
            let stopped = decided.iter().any(|line| {
                let outcome = outcome(line);
                !holds(&outcome) && !short(&outcome)
            });
            if (all && refused) || stopped {
                tx.rollback().await?;
                return Ok(Decision::Done(Committed::Known(
                    decided
                        .into_iter()
                        .map(|line| match line {
                            Line::Kept(Outcome::Admitted(_)) => None,
                            Line::Kept(outcome) | Line::Refused(outcome) => Some(outcome),
                        })
                        .collect(),
                )));
            }
            let outcomes = decided
                .into_iter()
                .map(|line| match line {
                    Line::Kept(outcome) | Line::Refused(outcome) => Some(outcome),
                })
                .collect();
            Ok(Decision::Done(commit(tx, outcomes).await?))
        })
        .await?;
        match decided {
            Committed::Known(outcomes) => Ok(outcomes),
            Committed::Unknown(outcomes, error) => {
                // The lines were one transaction: whether the first admitted one
                // landed says whether they all did.
                let first_admitted = lines
                    .iter()
                    .zip(&outcomes)
                    .find(|(_, outcome)| matches!(outcome, Some(Outcome::Admitted(_))));
                match first_admitted {
                    Some((line, _)) => {
                        let deadline = outcomes
                            .iter()
                            .flatten()
                            .filter_map(|outcome| match outcome {
                                Outcome::Admitted(view) => Some(view.reservation.expires_at_ms),
                                _ => None,
                            })
                            .min()
                            .unwrap_or(0);
                        self.landed(line.drop_key, line.ask, &attempt, deadline, error)
                            .await?;
                        Ok(outcomes)
                    }
                    None => Err(error.into()),
                }
            }
        }
    }

    /// The answer to a retry of `key`, when the ledger already holds it: what the
    /// gate checks first, before the sale window, the permit and the stock, so
    /// that a retry of an admitted key hears `already_reserved` (or
    /// `idempotency_key_reused`) whatever else changed since. `None`: a new key.
    pub async fn fallback_retry(
        &self,
        drop_key: &str,
        config: &DropConfig,
        ask: Ask<'_>,
        now: i64,
    ) -> Result<Option<Outcome>, LedgerError> {
        let Ask {
            key,
            user,
            quantity,
            variant,
        } = ask;
        let decided = retry(|| async {
            let mut tx = self.pool.begin().await?;
            if let Err(authority) = require_ledger(&mut tx, self.backend, drop_key).await? {
                return Ok(not_authority(authority));
            }
            ensure_stock(&mut tx, drop_key, &stock(config)).await?;
            let expiring = expire_if_due(&mut tx, drop_key, config, key, now).await?;
            let outcome =
                retry_answer(&mut tx, drop_key, expiring.row, user, quantity, variant).await?;
            match expiring.landing {
                // The look-up changed nothing of the key's.
                None => {
                    tx.commit().await?;
                    Ok(Decision::Done(Committed::Known((outcome, None))))
                }
                Some(landing) => Ok(Decision::Done(commit(tx, (outcome, Some(landing))).await?)),
            }
        })
        .await?;
        // The look-up expired the hold: its answer stands if that landed.
        self.as_it_landed(drop_key, key, decided).await
    }

    /// confirm, cancel or look-up on the fallback path.
    pub async fn fallback_settle(
        &self,
        drop_key: &str,
        config: &DropConfig,
        key: &str,
        settle: Settle,
        now: i64,
    ) -> Result<Outcome, LedgerError> {
        // Written with its event, so that an unanswered COMMIT is told from a
        // duplicate's (`settled`).
        let attempt = new_attempt();
        let decided = retry(|| async {
            let mut tx = self.pool.begin().await?;
            if let Err(authority) = require_ledger(&mut tx, self.backend, drop_key).await? {
                return Ok(not_authority(authority));
            }
            let stored = ensure_stock(&mut tx, drop_key, &stock(config)).await?;
            // A hold past its deadline expires first, whatever was asked.
            let expiring = expire_if_due(&mut tx, drop_key, config, key, now).await?;
            let Some(row) = expiring.row else {
                return Ok(Decision::Done(commit(tx, (Outcome::NotFound, None)).await?));
            };
            if let (Settle::Extend { until_ms }, State::Active) = (settle, row.state) {
                let terms = effective_terms(config, stored)?;
                let extended =
                    extend_on_fallback(&mut tx, drop_key, config, &row, terms, until_ms, now)
                        .await?;
                return Ok(Decision::Done(commit(tx, extended).await?));
            }
            let kept = match settle {
                Settle::Confirm { quantity } => quantity,
                _ => None,
            };
            if row.state == State::Active
                && let Some(asked) = kept
                && asked > row.quantity
            {
                // More than is held: nothing changes.
                let outcome = Outcome::AboveHeld { held: row.quantity };
                return Ok(Decision::Done(commit(tx, (outcome, None)).await?));
            }
            let target = match (settle, row.state) {
                (Settle::Confirm { .. }, State::Active) => Some(State::Confirmed),
                (Settle::Cancel, State::Active | State::Confirmed) => Some(State::Cancelled),
                (Settle::CancelHold, State::Active) => Some(State::Cancelled),
                _ => None,
            };
            // An expiry written above is what this request changed, if anything.
            let mut landing = expiring.landing;
            if let Some(target) = target {
                let change = Change::new(drop_key, stock(config), key, &row.reservation(), target)
                    .keeping(kept);
                // The attempt goes on the event only: the row's `changed_by` names
                // the gate's prepared changes.
                let event = Change {
                    attempt: Some(attempt.clone()),
                    ..change.clone()
                };
                landing = Some(Landing::of(&event, super::event(target)));
                if transition(&mut tx, &change, false, now, None)
                    .await?
                    .is_none()
                {
                    return Err(TxError::Raced);
                }
                if target == State::Cancelled {
                    adjust_holdings(&mut tx, &change, change.quantity).await?;
                } else if change.released > 0 {
                    adjust_holdings(&mut tx, &change, change.released).await?;
                }
                let mut ids = EventIds::for_events(1);
                write_event(&mut tx, &mut ids, &event, "fallback", now).await?;
            }
            let view = view(&mut tx, drop_key, key).await?;
            let outcome = match (settle, row.state) {
                // A look-up that expired the hold answers it like any look-up.
                (Settle::Lookup, _) => Outcome::Found(view),
                (_, State::Expired) => Outcome::Expired(view),
                (Settle::Confirm { .. }, State::Active) => Outcome::Confirmed(view),
                (Settle::Confirm { .. }, State::Confirmed) => Outcome::AlreadyConfirmed(view),
                (Settle::Confirm { .. }, State::Cancelled) => Outcome::WasCancelled(view),
                // An active hold's extension was decided above.
                (Settle::Extend { .. }, State::Active) => Outcome::Extended(view),
                (Settle::Extend { .. }, State::Confirmed) => Outcome::WasConfirmed(view),
                (Settle::Extend { .. }, State::Cancelled) => Outcome::WasCancelled(view),
                (Settle::Cancel, State::Active | State::Confirmed)
                | (Settle::CancelHold, State::Active) => Outcome::Cancelled(view),
                (Settle::Cancel | Settle::CancelHold, State::Cancelled) => {
                    Outcome::AlreadyCancelled(view)
                }
                // A give-back never refunds.
                (Settle::CancelHold, State::Confirmed) => Outcome::AlreadyConfirmed(view),
                // The ledger never records a pending admission.
                (_, State::Pending) => Outcome::Recording,
            };
            Ok(Decision::Done(commit(tx, (outcome, landing)).await?))
        })
        .await?;
        self.as_it_landed(drop_key, key, decided).await
    }

    /// The confirms of a cart's lines `lines` (each its drop's ledger key, config
    /// and reservation key) on the ledger's gate and the cart's move `cart`, in one
    /// transaction, all or nothing: a line that is not an active hold, or a cart
    /// another mover moved first, rolls the whole back ([`CartCommit::LineRefused`],
    /// [`CartCommit::CartMoved`]); so does a drop the ledger is not the authority
    /// of ([`LedgerError::NotAuthority`]). A COMMIT that went unanswered is asked
    /// about by the cart's row: landed, or not, or (the row moved on since)
    /// [`LedgerError::CommitUnknown`].
    pub async fn fallback_confirm_cart(
        &self,
        lines: &[FallbackLine<'_>],
        cart: super::carts::CartMove<'_>,
    ) -> Result<CartCommit, LedgerError> {
        let write = CartWrite::from(cart);
        let mut drops: Vec<(&str, &DropConfig)> = Vec::new();
        for line in lines {
            if !drops.iter().any(|(key, _)| *key == line.drop_key) {
                drops.push((line.drop_key, line.config));
            }
        }
        // Every transaction takes a drop's rows in the order of the drops' keys.
        drops.sort_by(|a, b| a.0.cmp(b.0));
        let decided = retry(|| async {
            // (Read for each try: a try that waited for locks decides as of now.)
            let now = crate::clock::now_ms();
            let mut tx = self.pool.begin().await?;
            for (drop_key, config) in &drops {
                if let Err(authority) = require_ledger(&mut tx, self.backend, drop_key).await? {
                    return Ok(not_authority(authority));
                }
                ensure_stock(&mut tx, drop_key, &stock(config)).await?;
            }
            let mut ids = EventIds::for_events(lines.len());
            for line in lines {
                let expiring =
                    expire_if_due(&mut tx, line.drop_key, line.config, line.key, now).await?;
                let row = match expiring.row {
                    Some(row) if row.state == State::Active => row,
                    // (Dropping the transaction rolls it back, an expiry included.)
                    other => {
                        let state = other.map_or(State::Expired, |row| row.state);
                        let refused = CartCommit::LineRefused(RecordError::KeyUsed { state });
                        return Ok(Decision::Done(Committed::Known(refused)));
                    }
                };
                let change = Change::new(
                    line.drop_key,
                    stock(line.config),
                    line.key,
                    &row.reservation(),
                    State::Confirmed,
                );
                if transition(&mut tx, &change, false, now, None)
                    .await?
                    .is_none()
                {
                    return Err(TxError::Raced);
                }
                write_event(&mut tx, &mut ids, &change, "fallback", now).await?;
            }
            if !matches!(write.apply(&mut tx).await?, CartWritten::Moved(true)) {
                return Ok(Decision::Done(Committed::Known(CartCommit::CartMoved)));
            }
            Ok(Decision::Done(commit(tx, CartCommit::Committed).await?))
        })
        .await?;
        match decided {
            Committed::Known(done) => Ok(done),
            Committed::Unknown(done, error) => match self.cart_move_landed(&write, &error).await? {
                Some(true) => Ok(done),
                Some(false) => Err(error.into()),
                None => Err(LedgerError::CommitUnknown(format!(
                    "{error}; the cart has moved on since, so whether this confirm landed cannot be told"
                ))),
            },
        }
    }

    /// A transaction that asks whether an unanswered COMMIT landed. On PostgreSQL
    /// that COMMIT's session may hold the rows asked about for as long as its
    /// server takes to notice it gone (hours, on a half-open connection): a wait
    /// for them past the asking window fails, like any ask.
    async fn begin_asking(&self) -> Result<Transaction<'static, Any>, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        if self.backend == Backend::Postgres {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "SET LOCAL lock_timeout = {}",
                ASK_WHETHER_LANDED_FOR.as_millis()
            )))
            .execute(&mut *tx)
            .await?;
        }
        Ok(tx)
    }

    /// Whether the cart's move `write`, whose COMMIT (failing with `error`) went
    /// unanswered, landed: `Some(true)` when the row is where the move put it (its
    /// new attempt), `Some(false)` when it is still where the move found it (that
    /// transaction ended without it: on PostgreSQL the row is locked first, which
    /// waits for it to end; SQLite has one connection), `None` when it moved on to
    /// anything else since (after this move or instead of it: nobody can say).
    async fn cart_move_landed(
        &self,
        write: &CartWrite,
        error: &sqlx::Error,
    ) -> Result<Option<bool>, LedgerError> {
        let CartWrite::Move {
            namespace,
            key,
            from,
            attempt,
            to,
            new_attempt,
            ..
        } = write
        else {
            return Err(super::carts::mixed_up());
        };
        let read = || async {
            let mut tx = self.begin_asking().await?;
            let lock = match self.backend {
                Backend::Postgres => " FOR UPDATE",
                Backend::Sqlite => "",
            };
            let row = sqlx::query(sqlx::AssertSqlSafe(format!(
                "SELECT state, attempt FROM carts WHERE namespace = $1 AND cart_key = $2{lock}"
            )))
            .bind(namespace)
            .bind(key)
            .fetch_optional(&mut *tx)
            .await?;
            tx.commit().await?;
            let moved = match row {
                Some(row) => {
                    let (state, by): (String, String) = (row.try_get(0)?, row.try_get(1)?);
                    if state == to.as_str() && by == *new_attempt {
                        Some(true)
                    } else if state == from.as_str() && by == *attempt {
                        Some(false)
                    } else {
                        None
                    }
                }
                None => None,
            };
            Ok::<_, LedgerError>(moved)
        };
        ask_until_answered(read, ASK_WHETHER_LANDED_FOR, error).await
    }

    /// The answer of a settle or retry of `key`, which wrote the change `landing`
    /// describes (if any): when its COMMIT went unanswered, the answer stands only if
    /// that change is in the ledger (see [`Self::settled`]); one that was to write
    /// nothing fails with the commit's error.
    async fn as_it_landed<T>(
        &self,
        drop_key: &str,
        key: &str,
        decided: Committed<(T, Option<Landing>)>,
    ) -> Result<T, LedgerError> {
        match decided {
            Committed::Known((answer, _)) => Ok(answer),
            Committed::Unknown((answer, Some(landing)), error) => {
                self.settled(drop_key, key, &landing, error).await?;
                Ok(answer)
            }
            Committed::Unknown((_, None), error) => Err(error.into()),
        }
    }

    /// Whether the change of `key` that `landing` describes, and whose COMMIT was
    /// not answered, is in the ledger, so that the caller's answer is true: `Ok`
    /// when it is; the commit's error when it is not; [`LedgerError::CommitUnknown`]
    /// when the ledger cannot be asked. The event was written in the change's own
    /// transaction, and its id is the reservation's and the change's kind: it is
    /// there when this change, or another of the same kind, landed, whatever changed
    /// the reservation since. The attempt it was written with tells the two apart
    /// (a duplicate cancel or confirm that landed instead of this one), and for a
    /// change without one, its quantity (a concurrent confirm that kept another
    /// quantity). On PostgreSQL the row is locked first, which waits for the
    /// unanswered transaction to end.
    async fn settled(
        &self,
        drop_key: &str,
        key: &str,
        landing: &Landing,
        error: sqlx::Error,
    ) -> Result<(), LedgerError> {
        let read = || async {
            let mut tx = self.begin_asking().await?;
            if self.backend == Backend::Postgres {
                sqlx::query(
                    "SELECT 1 FROM reservations WHERE drop_key = $1 AND res_key = $2 FOR UPDATE",
                )
                .bind(drop_key)
                .bind(key)
                .fetch_optional(&mut *tx)
                .await?;
            }
            let event: Option<(String, Option<String>)> =
                sqlx::query_as("SELECT payload, attempt FROM outbox WHERE event_id = $1")
                    .bind(&landing.event_id)
                    .fetch_optional(&mut *tx)
                    .await?;
            tx.commit().await?;
            Ok::<_, LedgerError>(
                event.is_some_and(|(payload, attempt)| landing.is_in(&payload, attempt.as_deref())),
            )
        };
        if crate::faults::check(crate::faults::Fault::PauseBeforeAsking).is_err() {
            tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
        }
        if ask_until_answered(read, ASK_WHETHER_LANDED_FOR, &error).await? {
            Ok(())
        } else {
            Err(error.into())
        }
    }

    /// Expires the drop's active holds whose deadline is at or before `due`, each
    /// once, returning their units and writing their events; returns their keys. The
    /// fallback's sweeper, with the ledger in charge.
    pub async fn expire_due(
        &self,
        drop_key: &str,
        config: &DropConfig,
        due: i64,
        batch: i64,
    ) -> Result<Vec<String>, LedgerError> {
        let mut expired = Vec::new();
        for key in self.active_due(drop_key, due, batch).await? {
            if self
                .expire_one(drop_key, config, &key, due, Holder::Ledger)
                .await?
            {
                expired.push(key);
            }
        }
        Ok(expired)
    }

    /// Keys of the drop's active holds whose deadline is at or before `due`.
    pub async fn active_due(
        &self,
        drop_key: &str,
        due: i64,
        batch: i64,
    ) -> Result<Vec<String>, LedgerError> {
        let keys = sqlx::query(
            "SELECT res_key FROM reservations WHERE drop_key = $1 AND state = 'active' AND expires_at_ms <= $2 LIMIT $3",
        )
        .bind(drop_key)
        .bind(due)
        .bind(batch)
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(|row| row.try_get(0))
        .collect::<Result<_, _>>()?;
        Ok(keys)
    }

    /// Expires the hold of `key` if it is active with a deadline at or before
    /// `due`, returning its units and writing its event; true when it did. Only
    /// while `in_charge` decides the drop's admissions, read in the same
    /// transaction: a sweeper that read the authority before a hand-over (the
    /// fallback's, before a replay reopened the gate; the gate's repair, before a
    /// hand-over to the fallback) changes nothing.
    pub async fn expire_one(
        &self,
        drop_key: &str,
        config: &DropConfig,
        key: &str,
        due: i64,
        in_charge: Holder,
    ) -> Result<bool, LedgerError> {
        let mut tx = self.pool.begin().await?;
        // The authority row, then the drop's stock row, then the reservation's, as
        // every transaction that moves them takes them.
        let authority = read_in(&mut tx, self.backend, drop_key, true).await?;
        if authority.map(|a| a.holder) != Some(in_charge) {
            tx.rollback().await?;
            return Ok(false);
        }
        lock_stock(&mut tx, drop_key).await?;
        // What this call wrote, not what it found: a request may have expired the
        // hold a moment before.
        let expired = expire_if_due(&mut tx, drop_key, config, key, due)
            .await?
            .landing
            .is_some();
        tx.commit().await?;
        Ok(expired)
    }

    /// Changes Redis has not seen yet: made on the fallback path, or recorded for an
    /// admission whose activation in Redis failed.
    pub async fn unreplayed(
        &self,
        drop_key: &str,
        batch: i64,
    ) -> Result<Vec<Recorded>, LedgerError> {
        let rows = sqlx::query(
            concat!("SELECT ", row_columns!(), " FROM reservations \
             WHERE drop_key = $1 AND replayed = 0 AND state <> 'abandoned' ORDER BY updated_at_ms LIMIT $2"),
        )
        .bind(drop_key)
        .bind(batch)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| to_row(row).map_err(Into::into))
            .collect()
    }

    /// The keys of `user`'s reservations of the drop, newest admission first, at
    /// most `limit`: a buyer's look-up on the fallback path, where this ledger is
    /// the sale's and holds all of it.
    pub async fn keys_of_buyer(
        &self,
        drop_key: &str,
        user: &str,
        limit: i64,
    ) -> Result<Vec<String>, LedgerError> {
        let rows = sqlx::query(
            "SELECT res_key FROM reservations WHERE drop_key = $1 AND user_id = $2 AND state <> 'abandoned' \
             ORDER BY COALESCE(admitted_at_ms, updated_at_ms) DESC, res_key DESC LIMIT $3",
        )
        .bind(drop_key)
        .bind(user)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| row.try_get(0).map_err(Into::into))
            .collect()
    }

    /// Every reservation of the drop, `batch` at a time in key order after
    /// `after`: what a Redis that lost writes is rebuilt from.
    pub async fn recorded_after(
        &self,
        drop_key: &str,
        after: &str,
        batch: i64,
    ) -> Result<Vec<Recorded>, LedgerError> {
        let rows = sqlx::query(
            concat!("SELECT ", row_columns!(), " FROM reservations \
             WHERE drop_key = $1 AND res_key > $2 AND state <> 'abandoned' ORDER BY res_key LIMIT $3"),
        )
        .bind(drop_key)
        .bind(after)
        .bind(batch)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| to_row(row).map_err(Into::into))
            .collect()
    }

    /// Claims `key` for the admission `attempt`, judged dead before it was
    /// recorded: an `abandoned` row (no reservation: no units, no event, invisible to
    /// look-ups) so that the attempt's own commit, should it land after all, is
    /// refused, while any other attempt of the key may still be admitted. False when
    /// the key holds a reservation (a commit came first).
    pub async fn claim_abandoned(
        &self,
        drop_key: &str,
        key: &str,
        user: &str,
        quantity: i64,
        attempt: &str,
        now: i64,
    ) -> Result<bool, LedgerError> {
        let claimed = sqlx::query(
            "INSERT INTO reservations \
             (drop_key, res_key, user_id, quantity, state, path, expires_at_ms, updated_at_ms, replayed, seq, attempt) \
             VALUES ($1, $2, $3, $4, 'abandoned', 'gate', $5, $6, 1, NULL, $7) \
             ON CONFLICT (drop_key, res_key) DO UPDATE SET attempt = excluded.attempt, updated_at_ms = excluded.updated_at_ms \
             WHERE reservations.state = 'abandoned'",
        )
        .bind(drop_key)
        .bind(key)
        .bind(user)
        .bind(quantity)
        .bind(now)
        .bind(now)
        .bind(attempt)
        .execute(&self.pool)
        .await?;
        Ok(claimed.rows_affected() == 1)
    }

    /// Whether `attempt`'s admission of `key`, whose commit failed without saying
    /// whether it landed, is in the ledger; final from here on: the key is claimed
    /// for the attempt first (waiting for a commit of it still in flight, and
    /// refusing it from then on), then its row read.
    pub async fn admission_landed(
        &self,
        drop_key: &str,
        key: &str,
        user: &str,
        quantity: i64,
        attempt: &str,
        now: i64,
    ) -> Result<Landed, LedgerError> {
        if self
            .claim_abandoned(drop_key, key, user, quantity, attempt, now)
            .await?
        {
            return Ok(Landed::No);
        }
        let row = sqlx::query(
            "SELECT state, attempt FROM reservations WHERE drop_key = $1 AND res_key = $2",
        )
        .bind(drop_key)
        .bind(key)
        .fetch_optional(&self.pool)
        .await?;
        Ok(match row {
            Some(row) => {
                let state: String = row.try_get(0)?;
                let landed_by: Option<String> = row.try_get(1)?;
                match (state.as_str(), State::parse(&state)) {
                    ("abandoned", _) | (_, None) => Landed::No,
                    (_, Some(_)) if landed_by.as_deref() == Some(attempt) => Landed::Yes,
                    (_, Some(state)) => Landed::Other(state),
                }
            }
            None => Landed::No,
        })
    }

    /// Fences off the confirm, cancel or extension `attempt` of `key`, judged dead
    /// before it was recorded: from now on its commit is refused. Returns the
    /// reservation after, in the same transaction: in the attempt's target state
    /// (or at its deadline) when its commit came first.
    pub async fn fence_settle(
        &self,
        drop_key: &str,
        key: &str,
        attempt: &str,
    ) -> Result<Option<Recorded>, LedgerError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "UPDATE reservations SET fenced_attempt = $1 WHERE drop_key = $2 AND res_key = $3",
        )
        .bind(attempt)
        .bind(drop_key)
        .bind(key)
        .execute(&mut *tx)
        .await?;
        let row = read(&mut tx, drop_key, key).await?;
        tx.commit().await?;
        Ok(row)
    }

    /// Marks a change as one Redis has not seen (its activation failed).
    pub async fn mark_unreplayed(&self, drop_key: &str, key: &str) -> Result<(), LedgerError> {
        sqlx::query("UPDATE reservations SET replayed = 0 WHERE drop_key = $1 AND res_key = $2")
            .bind(drop_key)
            .bind(key)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Marks a replayed change, unless the reservation moved on since it was read.
    pub async fn mark_replayed(
        &self,
        drop_key: &str,
        key: &str,
        state: State,
    ) -> Result<(), LedgerError> {
        sqlx::query("UPDATE reservations SET replayed = 1 WHERE drop_key = $1 AND res_key = $2 AND state = $3")
            .bind(drop_key)
            .bind(key)
            .bind(state.as_str())
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// The reservation of `key`, if the ledger has it.
    pub async fn reservation(
        &self,
        drop_key: &str,
        key: &str,
    ) -> Result<Option<Recorded>, LedgerError> {
        let mut tx = self.pool.begin().await?;
        let row = read(&mut tx, drop_key, key).await?;
        tx.commit().await?;
        Ok(row)
    }

    /// The fallback gate's stock for the drop (if it has a row) and per variant,
    /// by name (the variants it has rows for), read in one statement: one moment's
    /// counts, never the drop's before a sale and a variant's after it.
    pub async fn counts(
        &self,
        drop_key: &str,
    ) -> Result<(Option<i64>, std::collections::HashMap<String, i64>), LedgerError> {
        let rows = sqlx::query(
            "SELECT '' AS variant, available, 0 AS is_variant FROM stock WHERE drop_key = $1 \
             UNION ALL SELECT variant, available, 1 FROM variant_stock WHERE drop_key = $2",
        )
        .bind(drop_key)
        .bind(drop_key)
        .fetch_all(&self.pool)
        .await?;
        let (mut drop, mut variants) = (None, std::collections::HashMap::new());
        for row in rows {
            let available: i64 = row.try_get(1)?;
            if row.try_get::<i64, _>(2)? == 0 {
                drop = Some(available);
            } else {
                variants.insert(row.try_get(0)?, available);
            }
        }
        Ok((drop, variants))
    }

    /// The fallback gate's stock for the drop, if it has a row.
    pub async fn available(&self, drop_key: &str) -> Result<Option<i64>, LedgerError> {
        let row = sqlx::query("SELECT available FROM stock WHERE drop_key = $1")
            .bind(drop_key)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.map(|row| row.try_get(0)).transpose()?)
    }
}

/// One reserve's decision in a fallback transaction.
enum Line {
    /// Admitted, or a retry's answer from the row its key holds: its changes stand.
    Kept(Outcome),
    /// Refused: its changes are to be rolled back.
    Refused(Outcome),
}

/// A reserve decided in the caller's transaction on the ledger's gate (whose
/// authority for the drop the caller has checked): the key (a retry hears what it
/// holds), the variant, the sale window, a pause, the waitlist, the per-user limit
/// and the stock, on the newest terms any sidecar sharing the ledger has read.
async fn reserve_in(
    tx: &mut Transaction<'static, Any>,
    drop_key: &str,
    config: &DropConfig,
    ask: Ask<'_>,
    attempt: &str,
    now: i64,
) -> Result<Line, TxError> {
    let Ask {
        key,
        user,
        quantity,
        variant,
    } = ask;
    let terms = effective_terms(config, ensure_stock(tx, drop_key, &stock(config)).await?)?;
    let held = Reservation {
        user: user.to_string(),
        quantity,
        state: State::Active,
        expires_at_ms: now + terms.hold_seconds * 1000,
        variant: variant.map(str::to_string),
    };
    let change =
        Change::new(drop_key, stock(config), key, &held, State::Active).by(attempt, i64::MAX);
    if !insert_reservation(tx, &change, "fallback", false, now).await? {
        let existing = expire_if_due(tx, drop_key, config, key, now).await?.row;
        let outcome = match retry_answer(tx, drop_key, existing, user, quantity, variant).await? {
            Some(outcome) => outcome,
            None => Outcome::KeyReused,
        };
        return Ok(Line::Kept(outcome));
    }
    // The variant as the config read afresh names it: the ledger keeps a
    // stock row for each variant a change told it of.
    if let Some(refusal) = VariantRefusal::of(variant, &config.variants) {
        return Ok(Line::Refused(Outcome::VariantRefused(refusal)));
    }
    if terms.starts_at_ms.is_some_and(|start| now < start) {
        return Ok(Line::Refused(Outcome::NotOpen {
            starts_at_ms: terms.starts_at_ms,
        }));
    }
    if terms.ends_at_ms.is_some_and(|end| now >= end) {
        return Ok(Line::Refused(Outcome::Ended {
            ends_at_ms: terms.ends_at_ms,
        }));
    }
    if terms.paused {
        return Ok(Line::Refused(Outcome::Paused));
    }
    // The waitlist: while anyone waits, what comes back is theirs (the gate
    // offers it when it is back); a buyer's waiting units count as held. A
    // waitlist turned off leaves its entries where they are, and counts them no
    // more (as on the gate).
    let (anyone_waits, waiting) = if config.waitlist.is_some() {
        super::waitlist::standing(tx, drop_key, variant, user).await?
    } else {
        (false, 0)
    };
    if anyone_waits {
        return Ok(Line::Refused(Outcome::SoldOut { remaining: 0 }));
    }
    sqlx::query(
        "INSERT INTO buyers (drop_key, user_id, held) VALUES ($1, $2, 0) \
         ON CONFLICT (drop_key, user_id) DO NOTHING",
    )
    .bind(drop_key)
    .bind(user)
    .execute(&mut **tx)
    .await?;
    let within_limit = sqlx::query(
        "UPDATE buyers SET held = held + $1 WHERE drop_key = $2 AND user_id = $3 AND held + $4 <= $5",
    )
    .bind(quantity)
    .bind(drop_key)
    .bind(user)
    .bind(quantity + waiting)
    .bind(terms.per_user_limit)
    .execute(&mut **tx)
    .await?
    .rows_affected()
        == 1;
    if !within_limit {
        let held: i64 = sqlx::query("SELECT held FROM buyers WHERE drop_key = $1 AND user_id = $2")
            .bind(drop_key)
            .bind(user)
            .fetch_one(&mut **tx)
            .await?
            .try_get(0)?;
        return Ok(Line::Refused(Outcome::PerUserLimit {
            held: held + waiting,
            limit: terms.per_user_limit,
        }));
    }
    // Units other sizes' line heads need are not this buyer's (as on the gate).
    let aside = match variant {
        Some(variant) if config.waitlist.is_some() => {
            super::waitlist::set_aside(tx, drop_key, variant, &config.variants).await?
        }
        _ => 0,
    };
    let in_stock = sqlx::query(
        "UPDATE stock SET available = available - $1 WHERE drop_key = $2 AND available >= $3",
    )
    .bind(quantity)
    .bind(drop_key)
    .bind(quantity + aside)
    .execute(&mut **tx)
    .await?
    .rows_affected()
        == 1;
    if !in_stock {
        let remaining = (available(tx, drop_key).await? - aside).max(0);
        return Ok(Line::Refused(Outcome::SoldOut { remaining }));
    }
    if let Some(variant) = variant {
        let in_variant_stock = sqlx::query(
            "UPDATE variant_stock SET available = available - $1 WHERE drop_key = $2 AND variant = $3 AND available >= $4",
        )
        .bind(quantity)
        .bind(drop_key)
        .bind(variant)
        .bind(quantity)
        .execute(&mut **tx)
        .await?
        .rows_affected()
            == 1;
        if !in_variant_stock {
            let remaining = variant_available(tx, drop_key, variant).await?;
            return Ok(Line::Refused(Outcome::SoldOut { remaining }));
        }
    }
    let mut ids = EventIds::for_events(1);
    write_event(tx, &mut ids, &change, "fallback", now).await?;
    let view = view(tx, drop_key, key).await?;
    Ok(Line::Kept(Outcome::Admitted(view)))
}

/// One line of a cart for [`Ledger::fallback_cart`]: the drop's ledger key, its
/// config as the caller read it, and what the line asks.
pub struct CartAsk<'a> {
    pub drop_key: &'a str,
    pub config: &'a DropConfig,
    pub ask: Ask<'a>,
}

/// A retry's answer from the row its key holds: `already_reserved` for the same
/// buyer and quantity, `idempotency_key_reused` for any other; `None` when the key
/// holds nothing.
async fn retry_answer(
    tx: &mut Transaction<'static, Any>,
    drop_key: &str,
    row: Option<Recorded>,
    user: &str,
    quantity: i64,
    variant: Option<&str>,
) -> Result<Option<Outcome>, sqlx::Error> {
    Ok(match row {
        None => None,
        Some(row)
            if row.user == user
                && row.quantity == quantity
                && row.variant.as_deref() == variant =>
        {
            Some(Outcome::AlreadyReserved(View {
                remaining: left_for(tx, drop_key, row.variant.as_deref()).await?,
                reservation: row.reservation(),
            }))
        }
        Some(_) => Some(Outcome::KeyReused),
    })
}

fn not_authority<T>(authority: Option<super::Authority>) -> Decision<T> {
    Decision::NotAuthority(authority.map_or_else(
        || "no sidecar has handed it to the ledger".into(),
        |a| format!("the authority is {a}"),
    ))
}

/// Runs a transaction again when it lost a race to a concurrent one.
async fn retry<T, F, Fut>(mut attempt: F) -> Result<T, LedgerError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Decision<T>, TxError>>,
{
    for _ in 0..ATTEMPTS {
        match attempt().await {
            Ok(Decision::Done(done)) => return Ok(done),
            Ok(Decision::NotAuthority(why)) => return Err(LedgerError::NotAuthority(why)),
            Err(TxError::Raced) => {}
            Err(TxError::Stale(generation)) => return Err(LedgerError::StaleConfig(generation)),
            Err(TxError::Sql(sqlx::Error::Database(db)))
                if matches!(db.code().as_deref(), Some("23505" | "40001" | "40P01")) => {}
            Err(TxError::Sql(e)) => return Err(e.into()),
        }
    }
    Err(LedgerError::Contended(ATTEMPTS))
}

/// The reservation of `key`, if the ledger holds one (an `abandoned` claim is none).
pub(super) async fn read(
    tx: &mut Transaction<'static, Any>,
    drop_key: &str,
    key: &str,
) -> Result<Option<Recorded>, sqlx::Error> {
    let row = sqlx::query(concat!(
        "SELECT ",
        row_columns!(),
        " FROM reservations \
         WHERE drop_key = $1 AND res_key = $2 AND state <> 'abandoned'"
    ))
    .bind(drop_key)
    .bind(key)
    .fetch_optional(&mut **tx)
    .await?;
    row.as_ref().map(to_row).transpose()
}

/// Whether `key`'s row is the claim of `attempt` as abandoned (so that attempt's
/// admission must not be recorded).
pub(super) async fn abandoned_by(
    tx: &mut Transaction<'static, Any>,
    drop_key: &str,
    key: &str,
    attempt: Option<&str>,
) -> Result<bool, sqlx::Error> {
    row_names(tx, drop_key, key, attempt, Named::Abandoned).await
}

/// The attempt that wrote `key`'s row, if any.
pub(super) async fn attempt_of(
    tx: &mut Transaction<'static, Any>,
    drop_key: &str,
    key: &str,
) -> Result<Option<String>, sqlx::Error> {
    let row = sqlx::query("SELECT attempt FROM reservations WHERE drop_key = $1 AND res_key = $2")
        .bind(drop_key)
        .bind(key)
        .fetch_optional(&mut **tx)
        .await?;
    Ok(row.and_then(|row| row.try_get::<Option<String>, _>(0).ok().flatten()))
}

/// Whether the confirm or cancel `attempt` of `key` was fenced off.
pub(super) async fn fenced_off(
    tx: &mut Transaction<'static, Any>,
    drop_key: &str,
    key: &str,
    attempt: Option<&str>,
) -> Result<bool, sqlx::Error> {
    row_names(tx, drop_key, key, attempt, Named::Fenced).await
}

/// Where a row names an attempt that was judged dead.
#[derive(Clone, Copy)]
enum Named {
    /// Its admission was claimed as abandoned.
    Abandoned,
    /// Its confirm or cancel was fenced off.
    Fenced,
}

/// Whether `key`'s row names `attempt` as `named`; never for no attempt.
async fn row_names(
    tx: &mut Transaction<'static, Any>,
    drop_key: &str,
    key: &str,
    attempt: Option<&str>,
    named: Named,
) -> Result<bool, sqlx::Error> {
    let Some(attempt) = attempt else {
        return Ok(false);
    };
    let query = match named {
        Named::Abandoned => {
            "SELECT 1 FROM reservations WHERE drop_key = $1 AND res_key = $2 AND state = 'abandoned' AND attempt = $3"
        }
        Named::Fenced => {
            "SELECT 1 FROM reservations WHERE drop_key = $1 AND res_key = $2 AND fenced_attempt = $3"
        }
    };
    let row = sqlx::query(query)
        .bind(drop_key)
        .bind(key)
        .bind(attempt)
        .fetch_optional(&mut **tx)
        .await?;
    Ok(row.is_some())
}

fn to_row(row: &sqlx::any::AnyRow) -> Result<Recorded, sqlx::Error> {
    let state: String = row.try_get(3)?;
    Ok(Recorded {
        key: row.try_get(0)?,
        user: row.try_get(1)?,
        quantity: row.try_get(2)?,
        state: State::parse(&state)
            .ok_or_else(|| sqlx::Error::Decode(format!("unknown state {state:?}").into()))?,
        expires_at_ms: row.try_get(4)?,
        seq: row.try_get::<Option<i64>, _>(5)?.unwrap_or(0),
        variant: Some(row.try_get::<String, _>(6)?).filter(|v| !v.is_empty()),
        admitted_at_ms: row.try_get(7)?,
        changed_by: row.try_get(8)?,
    })
}

/// Expires the hold of `key` if it is active and past its deadline, returning its
/// units and writing the event; returns the reservation as it then stands.
async fn expire_if_due(
    tx: &mut Transaction<'static, Any>,
    drop_key: &str,
    config: &DropConfig,
    key: &str,
    now: i64,
) -> Result<Expiring, sqlx::Error> {
    let Some(row) = read(tx, drop_key, key).await? else {
        return Ok(Expiring::default());
    };
    if row.state != State::Active || row.expires_at_ms > now {
        return Ok(Expiring {
            row: Some(row),
            landing: None,
        });
    }
    let change = Change::new(
        drop_key,
        stock(config),
        key,
        &row.reservation(),
        State::Expired,
    );
    let mut landing = None;
    if transition(tx, &change, false, now, Some(now))
        .await?
        .is_some()
    {
        adjust_holdings(tx, &change, change.quantity).await?;
        let mut ids = EventIds::for_events(1);
        write_event(tx, &mut ids, &change, "fallback", now).await?;
        landing = Some(Landing::of(&change, super::event(State::Expired)));
    }
    Ok(Expiring {
        row: read(tx, drop_key, key).await?,
        landing,
    })
}

/// A reservation's row after [`expire_if_due`], and the expiry it wrote, if it
/// did: a request whose COMMIT then goes unanswered looks for that expiry, so that
/// its answer is true whichever way the COMMIT went.
#[derive(Default)]
struct Expiring {
    row: Option<Recorded>,
    landing: Option<Landing>,
}

/// What an answer about a reservation shows as left: its variant's stock, or the
/// drop's.
async fn left_for(
    tx: &mut Transaction<'static, Any>,
    drop_key: &str,
    variant: Option<&str>,
) -> Result<i64, sqlx::Error> {
    let drop = available(tx, drop_key).await?;
    match variant {
        // No more than the drop as a whole has left (what a reserve admits).
        Some(variant) => Ok(variant_available(tx, drop_key, variant).await?.min(drop)),
        None => Ok(drop),
    }
}

/// What a variant's stock row holds for sale (0 without a row).
async fn variant_available(
    tx: &mut Transaction<'static, Any>,
    drop_key: &str,
    variant: &str,
) -> Result<i64, sqlx::Error> {
    Ok(super::variant_row(tx, drop_key, variant)
        .await?
        .unwrap_or(0))
}

async fn available(tx: &mut Transaction<'static, Any>, drop_key: &str) -> Result<i64, sqlx::Error> {
    sqlx::query("SELECT available FROM stock WHERE drop_key = $1")
        .bind(drop_key)
        .fetch_one(&mut **tx)
        .await?
        .try_get(0)
}

/// The reservation of `key` as an answer shows it, with the stock left.
async fn view(
    tx: &mut Transaction<'static, Any>,
    drop_key: &str,
    key: &str,
) -> Result<View, sqlx::Error> {
    let reservation = read(tx, drop_key, key)
        .await?
        .map(|row| row.reservation())
        .ok_or_else(|| sqlx::Error::RowNotFound)?;
    Ok(View {
        remaining: left_for(tx, drop_key, reservation.variant.as_deref()).await?,
        reservation,
    })
}
