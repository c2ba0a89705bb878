//! Carts: several lines, on one drop or several, held as a whole (`all`) or line by
//! line (`available`), then confirmed, cancelled or looked up as one.
//!
//! Every line is an ordinary reservation of its drop under `<cart key>:<n>`, made,
//! confirmed and cancelled by [`super::reserve`] and [`super::settle`]: whichever
//! gate decides the drop, every rule of a reservation (the limit, the per-user
//! limit across variants and carts, the window, durability before 201) holds for
//! each line. What makes the lines one cart is the ledger's cart row
//! ([`crate::ledger::carts`]), written before the first line is held and moved by
//! compare-and-set only:
//!
//! - a cart that cannot be held as asked gives back every line it held before it
//!   answers (`releasing`, then `refused`);
//! - a cart whose line could not be decided (503) keeps what it held for a retry
//!   of its key until its deadline (`holding` with no attempt working on it); the
//!   retry goes on where it stopped, and past the deadline anyone gives it back;
//! - a sidecar killed mid-cart leaves the row `holding`: a retry past the deadline
//!   goes on with it, the cart sweeper gives it back;
//! - a held cart expires as a whole at its earliest line's deadline: the sweeper
//!   gives back what is left of it (`releasing`, then `expired`).

use std::time::Duration;

use crate::app::App;
use crate::clock::now_ms;
use crate::faults::{self, Fault};
use crate::input::{CartLine, CartMode, CartReserve, Reserve, line_key};
use crate::ledger::LedgerError;
use crate::ledger::carts::{CartMove, CartRow, CartState, NewCart};
use crate::reservation::{Outcome, Reservation, Settle, State, VariantRefusal};

use super::settle::ConfirmAsOne;
use super::{Failure, Path, Retry, Served, Throttled, UnderWay, admit, pending_bound_ms};

/// Why a line of a cart was not held.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum ShortWhy {
    SoldOut { remaining: i64 },
    PerUserLimitExceeded { held: i64, limit: i64 },
    NotOpen { starts_at_ms: Option<i64> },
    Ended { ends_at_ms: Option<i64> },
    Paused,
}

impl ShortWhy {
    /// The reason a refusal of one reservation gives, if it is one a cart's line
    /// may be short for.
    fn of(outcome: &Outcome) -> Option<Self> {
        Some(match outcome {
            Outcome::SoldOut { remaining } => ShortWhy::SoldOut {
                remaining: *remaining,
            },
            Outcome::PerUserLimit { held, limit } => ShortWhy::PerUserLimitExceeded {
                held: *held,
                limit: *limit,
            },
            Outcome::NotOpen { starts_at_ms } => ShortWhy::NotOpen {
                starts_at_ms: *starts_at_ms,
            },
            Outcome::Ended { ends_at_ms } => ShortWhy::Ended {
                ends_at_ms: *ends_at_ms,
            },
            Outcome::Paused => ShortWhy::Paused,
            _ => return None,
        })
    }
}

/// A line not held, and why.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ShortLine {
    /// Its number in the cart, from 1.
    pub n: usize,
    #[serde(flatten)]
    pub why: ShortWhy,
}

/// A held line of a cart: its number, what it asked, its reservation's key, and
/// the reservation as it stands (`None` when it could not be looked up).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldLine {
    pub n: usize,
    pub line: CartLine,
    pub key: String,
    pub reservation: Option<Reservation>,
}

/// A cart as an answer shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CartView {
    pub key: String,
    pub user: String,
    pub state: CartState,
    pub lines: Vec<CartLine>,
    pub held: Vec<HeldLine>,
    pub short: Vec<ShortLine>,
    /// When the cart expires as a whole: its earliest held line's deadline.
    pub expires_at_ms: Option<i64>,
    /// Its lines are still being given back (its `state` is the end it is given
    /// back to): a line may hold units whether or not its look-up said so.
    pub giving_back: bool,
}

/// What a cart call came to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CartOutcome {
    /// 201: held now.
    Reserved(CartView),
    /// 200: the key's cart as it stands (a retry).
    AlreadyReserved(CartView),
    /// 409: nothing is held; each line not held, and why.
    Short(CartView),
    /// 422: the key was used by another user or for other lines.
    KeyReused,
    /// A line's drop or variant does not fit (404 or 400): nothing is held.
    LineRefused {
        line: CartLine,
        refusal: VariantRefusal,
    },
    /// A line's key is held by a reservation that is not this cart's (422).
    LineKeyTaken {
        key: String,
    },
    Found(CartView),
    Confirmed(CartView),
    AlreadyConfirmed(CartView),
    Cancelled(CartView),
    AlreadyCancelled(CartView),
    /// 409: the cart expired (or was given back unanswered) and cannot be confirmed.
    Gone(CartView),
    /// 409: a line lapsed or was cancelled before the cart's confirm reached it;
    /// the lines confirmed before it stay confirmed.
    PartlyConfirmed(CartView),
    NotFound,
}

/// What a call asks of an existing cart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CartSettle {
    Confirm,
    Cancel,
    Lookup,
}

/// Slack per line beyond its pending bound: a line's reserve may first wait for
/// its gate to open or its breaker to decide.
const LINE_SLACK_MS: i64 = 2_000;
/// How long a duplicate of a cart waits for the attempt deciding it.
const WAIT_FOR_OTHER: std::time::Duration = std::time::Duration::from_secs(3);
/// How long before a held cart's expiry a confirm is still taken on: confirming
/// its lines one by one must end before the first of them lapses.
const CONFIRM_MARGIN_MS: i64 = 2_000;
/// How long a confirm or a give-back of a whole cart may take before another
/// sidecar finishes it.
const SETTLE_BOUND_MS: i64 = 10_000;

fn attempt() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// The attempt a move that ends the work on a cart names (to held, or to an end
/// state; its callers give it deadline 0): nobody works under it, but it is this
/// move's own, so that a move made again after a commit of unknown outcome tells
/// its own landing from another attempt's (see `CartWrite::apply_again`).
fn closing_attempt() -> String {
    attempt()
}

fn ledger_down(what: &str, error: LedgerError) -> Failure {
    Failure::unavailable(format!(
        "the ledger could not {what} ({error}): nothing was changed; retry the same key"
    ))
}

/// A cart write's failure as its answer: nothing was changed, unless the ledger
/// cannot tell whether the write landed (see [`LedgerError::CommitUnknown`]).
fn not_written(key: &str, what: &str, error: LedgerError) -> Failure {
    match error {
        LedgerError::CommitUnknown(_) => unknown(key, what, error),
        error => ledger_down(what, error),
    }
}

/// The answer while another attempt decides the cart: throttled, as a duplicate
/// reserve whose first attempt is unresolved is.
fn in_flight(key: &str) -> Failure {
    tracing::debug!(cart = %key, "another attempt decides this cart");
    Failure::Throttled {
        permits: 0,
        why: super::Throttled::KeyInFlight,
        path: super::Path::Gate,
    }
}

/// The lines of a recorded cart (its terms as [`CartReserve::terms`] wrote them).
pub(super) fn lines_of(row: &CartRow) -> Vec<CartLine> {
    #[derive(serde::Deserialize)]
    struct Terms {
        lines: Vec<Line>,
    }
    #[derive(serde::Deserialize)]
    struct Line {
        drop: String,
        variant: Option<String>,
        quantity: i64,
    }
    serde_json::from_str::<Terms>(&row.terms)
        .map(|terms| {
            terms
                .lines
                .into_iter()
                .map(|l| CartLine {
                    drop: l.drop,
                    variant: l.variant,
                    quantity: l.quantity,
                })
                .collect()
        })
        .unwrap_or_default()
}

fn numbers(json: &str) -> Vec<usize> {
    serde_json::from_str(json).unwrap_or_default()
}

/// The lines `row` holds: each one's number, line and reservation key.
fn held_lines(row: &CartRow) -> Vec<(usize, CartLine, String)> {
    let lines = lines_of(row);
    numbers(&row.held)
        .into_iter()
        .filter_map(|n| {
            let line = lines.get(n.wrapping_sub(1))?;
            Some((n, line.clone(), line_key(&row.key, n)))
        })
        .collect()
}

/// The move that records `row` confirmed, from `from` under `attempt` (a
/// confirm's), naming `closing` as the attempt nobody works under from then on.
fn move_to_confirmed<'a>(
    namespace: &'a str,
    row: &'a CartRow,
    from: CartState,
    attempt: &'a str,
    closing: &'a str,
) -> CartMove<'a> {
    CartMove {
        namespace,
        key: &row.key,
        from,
        attempt,
        to: CartState::Confirmed,
        ends_as: None,
        new_attempt: closing,
        deadline_ms: 0,
        expires_at_ms: row.expires_at_ms,
        held: &row.held,
        short: &row.short,
    }
}

fn shorts(json: &str) -> Vec<ShortLine> {
    serde_json::from_str(json).unwrap_or_default()
}

/// How long holding `lines` may take: each line's pending bound and some slack.
async fn holding_bound(app: &App, lines: &[CartLine]) -> i64 {
    let mut bound = 0;
    for line in lines {
        let config = match super::find_drop(app, &line.drop).await {
            Ok(drop) => drop.config(),
            Err(_) => continue,
        };
        bound += pending_bound_ms(&config) as i64 + LINE_SLACK_MS;
    }
    bound
}

/// Reserves every line of `cart` as its mode asks: a new cart, or the key's
/// existing one as it stands (a retry), or what is left of an unfinished one.
pub async fn reserve(app: &App, cart: &CartReserve) -> Result<CartOutcome, Failure> {
    // Every line's drop and variant first: a cart naming one that does not exist
    // holds nothing.
    for line in &cart.lines {
        let drop = super::find_drop(app, &line.drop).await?;
        if let Some(refusal) = VariantRefusal::of(line.variant.as_deref(), &drop.config().variants)
        {
            return Ok(CartOutcome::LineRefused {
                line: line.clone(),
                refusal,
            });
        }
    }
    let namespace = app.drops.namespace();
    let terms = cart.terms();
    let mine = attempt();
    let bound = holding_bound(app, &cart.lines).await;
    // A duplicate of a cart another attempt is deciding waits for that one's
    // answer (a little while in all), as a duplicate reserve does. One that held
    // nothing and answered 503 forgot the cart: a duplicate then begins it afresh.
    let until = std::time::Instant::now() + WAIT_FOR_OTHER;
    let row = loop {
        let now = now_ms();
        let begun = app
            .ledger
            .begin_cart(NewCart {
                namespace,
                key: &cart.key,
                user: &cart.user,
                terms: &terms,
                attempt: &mine,
                deadline_ms: now + bound,
                now_ms: now,
            })
            .await
            .map_err(|e| not_written(&cart.key, "record the cart", e))?;
        let waited = match begun {
            Some((row, _)) if row.user != cart.user || row.terms != terms => {
                return Ok(CartOutcome::KeyReused);
            }
            Some((_, true)) => return hold(app, cart, &mine, now + bound, Reach::Counted).await,
            Some((row, false)) => wait_for_other(app, row, until).await?,
            None => None,
        };
        match waited {
            Some(row) => break row,
            None if std::time::Instant::now() < until => {}
            None => return Err(in_flight(&cart.key)),
        }
    };
    let now = now_ms();
    match row.state {
        CartState::Holding => {
            // Its sidecar died (or is too slow) past the cart's bound: this
            // retry goes on with it.
            if row.deadline_ms >= now {
                return Err(in_flight(&cart.key));
            }
            let taken = app
                .ledger
                .move_cart(CartMove {
                    namespace,
                    key: &cart.key,
                    from: CartState::Holding,
                    attempt: &row.attempt,
                    to: CartState::Holding,
                    ends_as: None,
                    new_attempt: &mine,
                    deadline_ms: now + bound,
                    expires_at_ms: 0,
                    held: "[]",
                    short: "[]",
                })
                .await
                .map_err(|e| not_written(&cart.key, "take the cart over", e))?;
            if !taken {
                return Err(in_flight(&cart.key));
            }
            return hold(app, cart, &mine, now + bound, Reach::BeyondCount).await;
        }
        CartState::Refused => Ok(CartOutcome::Short(view(app, &row, false).await)),
        // Given back before it was ever answered: nothing is held, the key is
        // spent.
        CartState::Released => Ok(CartOutcome::Gone(view(app, &row, false).await)),
        CartState::Releasing | CartState::Confirming => Err(in_flight(&cart.key)),
        _ => Ok(CartOutcome::AlreadyReserved(view(app, &row, true).await)),
    }
}

/// The cart `row` once the attempt deciding it is done with it, or at `until` as
/// it stands then; `None` when that attempt forgot it.
async fn wait_for_other(
    app: &App,
    row: CartRow,
    until: std::time::Instant,
) -> Result<Option<CartRow>, Failure> {
    let mut backoff = super::Backoff::new();
    let mut row = row;
    loop {
        let busy = match row.state {
            CartState::Holding | CartState::Releasing | CartState::Confirming => {
                row.deadline_ms >= now_ms()
            }
            _ => false,
        };
        if !busy || std::time::Instant::now() >= until {
            return Ok(Some(row));
        }
        backoff.wait(until).await;
        row = match app.ledger.cart(app.drops.namespace(), &row.key).await {
            Ok(Some(row)) => row,
            Ok(None) => return Ok(None),
            Err(e) => return Err(ledger_down("read the cart", e)),
        };
    }
}

/// Holds each line of `cart` for attempt `mine`, then answers as its mode says,
/// giving back what it held when the cart cannot be held as asked.
async fn hold(
    app: &App,
    cart: &CartReserve,
    mine: &str,
    deadline_ms: i64,
    reach: Reach,
) -> Result<CartOutcome, Failure> {
    let namespace = app.drops.namespace();
    let mut held: Vec<usize> = Vec::new();
    let mut reservations: Vec<HeldLine> = Vec::new();
    let mut short: Vec<ShortLine> = Vec::new();
    let mut stopped: Option<Stop> = None;
    // A line whose commit may have landed unbeknown to this attempt (the ledger
    // could not be asked): it may be held, so the cart is given back as one taken
    // over is, every line looked up, and never forgotten.
    let mut may_hold_more = false;
    let permits = Prepaid::take(app, cart, mine).await;
    // When every drop of the cart is on the ledger's gate, the ledger decides the
    // whole cart in one transaction.
    let mut on_fallback = whole_on_fallback(app, cart).await;
    for (g, (drop, members)) in by_drop(&cart.lines).into_iter().enumerate() {
        if g > 0 && faults::check(Fault::DieMidCart).is_err() {
            tracing::error!(cart = %cart.key, "injected fault: the process dies mid-cart");
            std::process::abort();
        }
        // (A cart the ledger decided whole is past any bound's reach: its lines are
        // decided.)
        if on_fallback.is_none() && now_ms() > deadline_ms {
            stopped = Some(Stop::Failed(Failure::retry(format!(
                "cart {} took longer than its bound to hold: retry the same key to go on with it",
                cart.key
            ))));
            break;
        }
        let requests: Vec<Reserve> = members
            .iter()
            .map(|&n| {
                let line = &cart.lines[n - 1];
                Reserve {
                    key: cart.line_key(n),
                    user: cart.user.clone(),
                    quantity: line.quantity,
                    variant: line.variant.clone(),
                }
            })
            .collect();
        let answered = match on_fallback.as_mut() {
            Some(decided) => members.iter().map(|&n| decided[n - 1].take()).collect(),
            None => reserve_lines(app, drop, &requests, cart.mode == CartMode::All).await,
        };
        for ((n, request), answered) in members.into_iter().zip(requests).zip(answered) {
            let line = &cart.lines[n - 1];
            match answered {
                // Withdrawn, or not asked after another line of the drop was
                // refused: not held, and not short of anything itself.
                None => {}
                Some(Ok(Served { outcome, .. })) => match outcome {
                    Outcome::Admitted(view) | Outcome::AlreadyReserved(view)
                        if view.reservation.state.holds_units() =>
                    {
                        held.push(n);
                        reservations.push(HeldLine {
                            n,
                            line: line.clone(),
                            key: request.key.clone(),
                            reservation: Some(view.reservation),
                        });
                    }
                    other => match ShortWhy::of(&other) {
                        Some(why) => short.push(ShortLine { n, why }),
                        None if stopped.is_none() => {
                            stopped = Some(match other {
                                Outcome::VariantRefused(refusal) => {
                                    Stop::Refused(CartOutcome::LineRefused {
                                        line: line.clone(),
                                        refusal,
                                    })
                                }
                                _ => Stop::Refused(CartOutcome::LineKeyTaken { key: request.key }),
                            });
                        }
                        None => {}
                    },
                },
                Some(Err(failure)) => {
                    may_hold_more |= failure.may_stand();
                    if stopped.is_none() {
                        stopped = Some(Stop::Failed(failure));
                    }
                }
            }
        }
        // A cart that must be whole cannot be any more: holding its later drops'
        // lines only to give them back would turn away other buyers meanwhile (in
        // a rush, every cart of them).
        if stopped.is_some() || (cart.mode == CartMode::All && !short.is_empty()) {
            break;
        }
    }
    held.sort_unstable();
    reservations.sort_by_key(|line| line.n);
    short.sort_by_key(|line| line.n);
    let reach = if may_hold_more {
        Reach::BeyondCount
    } else {
        reach
    };
    // The permits of lines not admitted go back before anything is given back.
    std::mem::drop(permits);
    let held_json = serde_json::to_string(&held).unwrap_or_else(|_| "[]".into());
    let short_json = serde_json::to_string(&short).unwrap_or_else(|_| "[]".into());
    let now = now_ms();
    match stopped {
        // A line could not be decided: the 503 must mean nothing is held. A cart
        // with nothing held, as far as it is known, is forgotten and its retry
        // starts afresh; lines held are given back, which spends the key (their
        // keys are used). So are those of a cart held beyond its count (taken
        // over, or a line whose commit may have landed).
        Some(Stop::Failed(failure)) if held.is_empty() && reach == Reach::Counted => {
            if let Err(e) = app.ledger.forget_cart(namespace, &cart.key, mine).await {
                tracing::warn!(cart = %cart.key, error = %e, "an unheld cart could not be forgotten; its sweep releases it");
            }
            return Err(failure);
        }
        Some(Stop::Failed(failure)) => {
            let released = release_now(
                app,
                cart,
                mine,
                reach,
                CartState::Released,
                &held,
                &short_json,
            )
            .await;
            return Err(match released {
                Ok(()) => spent(&cart.key, failure, true),
                // Given back later by the sweeper, which ends it `released` too:
                // the key is spent all the same, and the answer says so.
                Err(Unreleased::Releasing(_)) => spent(&cart.key, failure, false),
                // Still `holding` (the ledger could not record the give-back's
                // start), or taken over by another attempt of the key: a retry of
                // the same key goes on with it.
                Err(Unreleased::Holding(failure)) => failure,
            });
        }
        Some(Stop::Refused(outcome)) => {
            refuse(app, cart, mine, reach, &held, &short_json).await?;
            return Ok(outcome);
        }
        None => {}
    }
    let whole = match cart.mode {
        CartMode::All => short.is_empty(),
        CartMode::Available => !held.is_empty(),
    };
    if !whole {
        refuse(app, cart, mine, reach, &held, &short_json).await?;
        // As recorded; as this attempt just recorded it if the ledger cannot be
        // read (the refusal stands: its 409 must not turn into a 503).
        let row = match recorded(app, &cart.key).await {
            Ok(row) => row,
            Err(_) => CartRow {
                key: cart.key.clone(),
                user: cart.user.clone(),
                terms: cart.terms(),
                state: CartState::Refused,
                ends_as: None,
                attempt: String::new(),
                deadline_ms: 0,
                expires_at_ms: 0,
                held: held_json,
                short: short_json,
            },
        };
        return Ok(CartOutcome::Short(view(app, &row, false).await));
    }
    // Held: the cart expires with its earliest line.
    let expires_at_ms = reservations
        .iter()
        .filter_map(|h| h.reservation.as_ref().map(|r| r.expires_at_ms))
        .min()
        .unwrap_or(now);
    let finished = app
        .ledger
        .move_cart(CartMove {
            expires_at_ms,
            namespace,
            key: &cart.key,
            from: CartState::Holding,
            attempt: mine,
            to: CartState::Held,
            ends_as: None,
            new_attempt: &closing_attempt(),
            deadline_ms: 0,
            held: &held_json,
            short: &short_json,
        })
        .await;
    match finished {
        Ok(true) => Ok(CartOutcome::Reserved(CartView {
            key: cart.key.clone(),
            user: cart.user.clone(),
            state: CartState::Held,
            lines: cart.lines.clone(),
            held: reservations,
            short,
            expires_at_ms: Some(expires_at_ms),
            giving_back: false,
        })),
        // Taken over past its deadline (this attempt was too slow).
        Ok(false) => {
            abandon(app, cart, &held).await;
            Err(in_flight(&cart.key))
        }
        Err(e) => Err(unknown(&cart.key, "record the held cart", e)),
    }
}

/// Throttle permits taken ahead for a cart's lines by one attempt: a line then
/// finds its permit at once rather than, with earlier lines held, find none and
/// spend the cart. Taken only if free at once (a cart waiting for several permits
/// would go ahead of single admissions); lines of a drop whose permits were not
/// all free take their own after the gate admits them, as a reserve does. Those
/// not used are given back when this is dropped.
struct Prepaid<'a> {
    attempt: &'a str,
    lines: Vec<(std::sync::Arc<crate::drops::Drop>, String)>,
}

impl<'a> Prepaid<'a> {
    async fn take(app: &App, cart: &CartReserve, attempt: &'a str) -> Prepaid<'a> {
        let mut taken = Prepaid {
            attempt,
            lines: Vec::new(),
        };
        let mut drops: Vec<&str> = cart.lines.iter().map(|l| l.drop.as_str()).collect();
        drops.dedup();
        for name in drops {
            let Ok(drop) = super::find_drop(app, name).await else {
                continue;
            };
            let keys: Vec<String> = (1..=cart.lines.len())
                .filter(|n| cart.lines[n - 1].drop == name)
                .map(|n| cart.line_key(n))
                .collect();
            let count = u32::try_from(keys.len()).unwrap_or(u32::MAX);
            let Some(permits) = drop.throttle.try_acquire_many(count) else {
                continue;
            };
            for (key, permit) in keys.into_iter().zip(permits) {
                drop.throttle.prepay(&key, attempt, permit);
                taken.lines.push((drop.clone(), key));
            }
        }
        taken
    }
}

impl std::ops::Drop for Prepaid<'_> {
    fn drop(&mut self) {
        for (drop, key) in &self.lines {
            drop.throttle.refund(key, self.attempt);
        }
    }
}

/// Whether the lines of a cart that may be held are those its attempt counted as
/// held, or may go beyond them: a cart taken over from an attempt that died (which
/// may have held lines this one never reaches), or a line whose commit may have
/// landed unbeknown to this attempt. Beyond its count, every line is looked up
/// when the cart is given back, and the cart is never forgotten.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Reach {
    Counted,
    BeyondCount,
}

/// Why holding a cart's lines stopped before the last.
enum Stop {
    Failed(Failure),
    Refused(CartOutcome),
}

/// Refuses `cart`: gives back the lines attempt `mine` held ([`release_now`])
/// and records it refused. The refusal is answered only once every line is back.
/// One whose give-back stalled after the cart was recorded releasing is decided
/// and under way (503 `underWay`: the sweeper gives back the rest, and a retry of
/// the key hears the refusal once it has); one still `holding` goes on with a
/// retry of the key, and the failure is the answer.
async fn refuse(
    app: &App,
    cart: &CartReserve,
    mine: &str,
    reach: Reach,
    held: &[usize],
    short: &str,
) -> Result<(), Failure> {
    match release_now(app, cart, mine, reach, CartState::Refused, held, short).await {
        Ok(()) => Ok(()),
        Err(Unreleased::Releasing(failure)) => {
            Err(under_way(&cart.key, UnderWay::GiveBack, failure))
        }
        Err(Unreleased::Holding(failure)) => Err(failure),
    }
}

/// Why a cart's lines were not all given back by [`release_now`].
enum Unreleased {
    /// The cart is still `holding` (the ledger could not record that it is being
    /// given back) or another attempt took it over: the key is not spent.
    Holding(Failure),
    /// The cart is `releasing`: the sweeper gives back what is left, and ends it.
    Releasing(Failure),
}

/// Gives back every line of `cart` that attempt `mine` may have held, and records
/// the cart as `ends_as`. A 503 when a line could not be given back: the cart stays
/// `releasing`, and the sweeper finishes it.
async fn release_now(
    app: &App,
    cart: &CartReserve,
    mine: &str,
    reach: Reach,
    ends_as: CartState,
    lines_held: &[usize],
    short: &str,
) -> Result<(), Unreleased> {
    let namespace = app.drops.namespace();
    let held = serde_json::to_string(lines_held).unwrap_or_else(|_| "[]".into());
    if lines_held.is_empty() && reach == Reach::Counted {
        // Nothing of it was ever held (the usual refusal in a sold-out rush): one
        // write records the end, without looking up lines to give back.
        let moved = app
            .ledger
            .move_cart(CartMove {
                namespace,
                key: &cart.key,
                from: CartState::Holding,
                attempt: mine,
                to: ends_as,
                ends_as: None,
                new_attempt: &closing_attempt(),
                deadline_ms: 0,
                expires_at_ms: 0,
                held: "[]",
                short,
            })
            .await
            .map_err(|e| {
                Unreleased::Holding(not_written(&cart.key, "record the cart's refusal", e))
            })?;
        return if moved {
            Ok(())
        } else {
            Err(Unreleased::Holding(in_flight(&cart.key)))
        };
    }
    let releasing = attempt();
    let deadline = now_ms() + SETTLE_BOUND_MS;
    let moved = app
        .ledger
        .move_cart(CartMove {
            namespace,
            key: &cart.key,
            from: CartState::Holding,
            attempt: mine,
            to: CartState::Releasing,
            ends_as: Some(ends_as),
            new_attempt: &releasing,
            deadline_ms: deadline,
            expires_at_ms: 0,
            held: &held,
            short,
        })
        .await
        .map_err(|e| Unreleased::Holding(not_written(&cart.key, "record the cart's refusal", e)))?;
    if !moved {
        abandon(app, cart, lines_held).await;
        return Err(Unreleased::Holding(in_flight(&cart.key)));
    }
    if let Err(failure) =
        give_back(app, &cart.key, &cart.user, &cart.lines, PaidLines::Refund).await
    {
        // Handed to the sweeper now rather than at the bound, so the units held
        // come back as soon as the gate answers again, not seconds after.
        let handed = app
            .ledger
            .move_cart(CartMove {
                namespace,
                key: &cart.key,
                from: CartState::Releasing,
                attempt: &releasing,
                to: CartState::Releasing,
                ends_as: Some(ends_as),
                new_attempt: &attempt(),
                deadline_ms: 0,
                expires_at_ms: 0,
                held: &held,
                short,
            })
            .await;
        if let Err(error) = handed {
            tracing::debug!(cart = %cart.key, %error, "a give-back is left to its bound");
        }
        return Err(Unreleased::Releasing(failure));
    }
    app.ledger
        .move_cart(CartMove {
            namespace,
            key: &cart.key,
            from: CartState::Releasing,
            attempt: &releasing,
            to: ends_as,
            ends_as: None,
            new_attempt: &closing_attempt(),
            deadline_ms: 0,
            expires_at_ms: 0,
            held: "[]",
            short,
        })
        .await
        .map_err(|e| Unreleased::Releasing(unknown(&cart.key, "record the cart's refusal", e)))?;
    Ok(())
}

/// After this attempt lost the cart to another (it was too slow): gives back the
/// lines it held unless the cart is still being held, or is held, by the other.
async fn abandon(app: &App, cart: &CartReserve, lines_held: &[usize]) {
    let row = app.ledger.cart(app.drops.namespace(), &cart.key).await;
    let kept = matches!(&row, Ok(Some(row)) if matches!(row.state, CartState::Holding | CartState::Held | CartState::Confirming | CartState::Confirmed | CartState::PartlyConfirmed));
    if kept {
        return;
    }
    let lines: Vec<CartLine> = cart
        .lines
        .iter()
        .enumerate()
        .map(|(i, line)| CartLine {
            // A line this attempt never held is left alone: another's, or none.
            quantity: if lines_held.contains(&(i + 1)) {
                line.quantity
            } else {
                0
            },
            ..line.clone()
        })
        .collect();
    if let Err(failure) = give_back(app, &cart.key, &cart.user, &lines, PaidLines::Refund).await {
        tracing::warn!(cart = %cart.key, ?failure, "lines of a cart taken over could not be given back; they expire with their holds");
    }
}

/// A line's 503 after the lines held before it were given back (`given_back`), or
/// while they are still being given back.
fn spent(key: &str, failure: Failure, given_back: bool) -> Failure {
    let (why, path) = match failure {
        Failure::Throttled {
            why: Throttled::KeyInFlight,
            path,
            ..
        } => (
            "an earlier attempt at one of its lines was still unresolved".to_string(),
            path,
        ),
        Failure::Throttled { path, .. } => ("a line found no throttle permit".to_string(), path),
        Failure::Unavailable { why, path, .. } => (why, path),
        Failure::UnknownDrop { name, .. } => {
            (format!("drop {name} is not published any more"), Path::Gate)
        }
    };
    let lines = if given_back {
        "every line it held was given back, so nothing is held"
    } else {
        "the lines it held are being given back (none can be confirmed; the sweeper finishes it once the gate answers)"
    };
    Failure::Unavailable {
        why: format!(
            "cart {key} could not be held ({why}); {lines}, and this cart key is spent: retry with a new key"
        ),
        path,
        retry: Retry::NewKey,
    }
}

/// The cart's line numbers (from 1) grouped by drop, the drops in the order their
/// first line comes: the lines on one drop are decided together.
fn by_drop(lines: &[CartLine]) -> Vec<(&str, Vec<usize>)> {
    let mut groups: Vec<(&str, Vec<usize>)> = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        match groups.iter_mut().find(|(drop, _)| *drop == line.drop) {
            Some((_, members)) => members.push(i + 1),
            None => groups.push((&line.drop, vec![i + 1])),
        }
    }
    groups
}

/// Every line of `cart` decided by the ledger's gate in one transaction, when all
/// its drops are on the fallback now (see admit::lines_on_fallback); `None`
/// otherwise. A line's `None`: withdrawn (not held, not refused itself).
async fn whole_on_fallback(
    app: &App,
    cart: &CartReserve,
) -> Option<Vec<Option<Result<Served, Failure>>>> {
    let mut drops = Vec::new();
    for line in &cart.lines {
        drops.push(super::find_drop(app, &line.drop).await.ok()?);
    }
    let lines: Vec<(&crate::drops::Drop, Reserve)> = cart
        .lines
        .iter()
        .zip(&drops)
        .enumerate()
        .map(|(i, (line, drop))| {
            (
                drop.as_ref(),
                Reserve {
                    key: cart.line_key(i + 1),
                    user: cart.user.clone(),
                    quantity: line.quantity,
                    variant: line.variant.clone(),
                },
            )
        })
        .collect();
    let decided = admit::lines_on_fallback(app, &lines, cart.mode == CartMode::All).await?;
    Some(
        decided
            .into_iter()
            .map(|lined| match lined {
                admit::Lined::Done(done) => Some(done),
                admit::Lined::Withdrawn | admit::Lined::Alone => None,
            })
            .collect(),
    )
}

/// Reserves a cart's lines on drop `drop`: on the gate in one atomic step (with
/// `all`, none of them when one is refused), otherwise (or for a line whose key is
/// still unresolved) one by one, and then with `all` no further line once one was
/// refused. `None`: a line not held and not refused itself (withdrawn, or not
/// asked).
async fn reserve_lines(
    app: &App,
    drop: &str,
    requests: &[Reserve],
    all: bool,
) -> Vec<Option<Result<Served, Failure>>> {
    let together = match requests {
        [_] => vec![admit::Lined::Alone],
        _ => match super::find_drop(app, drop).await {
            Ok(found) => admit::lines_on_gate(app, &found, requests, all).await,
            Err(failure) => {
                return requests
                    .iter()
                    .map(|_| Some(Err(failure.clone())))
                    .collect();
            }
        },
    };
    let mut answered = Vec::with_capacity(requests.len());
    let mut refused = false;
    for (request, lined) in requests.iter().zip(together) {
        let line = match lined {
            admit::Lined::Done(done) => Some(done),
            admit::Lined::Withdrawn => None,
            admit::Lined::Alone if all && refused => None,
            admit::Lined::Alone => Some(reserve_line(app, drop, request).await),
        };
        refused |= matches!(&line, Some(Ok(served)) if ShortWhy::of(&served.outcome).is_some());
        answered.push(line);
    }
    answered
}

/// Reserves one line of a cart. A line whose key an earlier attempt of this cart
/// left pending (a retry that goes on with a cart whose sidecar died can come
/// before that line's own bound has passed) is asked again until the bound has
/// passed and the line resolved, rather than spend the cart's key on it.
async fn reserve_line(app: &App, drop: &str, request: &Reserve) -> Result<Served, Failure> {
    let found = super::find_drop(app, drop).await?;
    let until = std::time::Instant::now()
        + Duration::from_millis(pending_bound_ms(&found.config()))
        + super::IN_FLIGHT_GRACE;
    let mut backoff = super::Backoff::new();
    loop {
        match super::reserve(app, drop, request).await {
            Err(Failure::Throttled {
                why: Throttled::KeyInFlight,
                ..
            }) if std::time::Instant::now() < until => backoff.wait(until).await,
            answered => return answered,
        }
    }
}

/// A ledger failure after which whether the cart's change was recorded is unknown.
fn unknown(key: &str, what: &str, error: LedgerError) -> Failure {
    Failure::outcome_unknown(format!(
        "the ledger failed while it was asked to {what} ({error}); whether it did is not known: GET /v1/carts/{key} says where the cart stands"
    ))
}

/// What a give-back does with a line its buyer paid for (confirmed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PaidLines {
    /// Refunds it: a cancel of the cart, or a cart given back before it was ever
    /// answered (nothing of it may stay held).
    Refund,
    /// Keeps it: an expiry, or a confirm that found a line lapsed.
    Keep,
}

impl PaidLines {
    /// What a give-back toward `ends_as` does with a paid line.
    fn toward(ends_as: CartState) -> Self {
        match ends_as {
            CartState::Expired | CartState::PartlyConfirmed => Self::Keep,
            _ => Self::Refund,
        }
    }
}

/// Cancels each line of the cart `key` that is a reservation of its buyer `user`
/// (a line never held, or whose key another buyer's reservation uses, is left
/// alone; so is a line of quantity 0); a paid line only if `paid` says to refund
/// it (an expiry never refunds a line its buyer paid for).
async fn give_back(
    app: &App,
    key: &str,
    user: &str,
    lines: &[CartLine],
    paid: PaidLines,
) -> Result<GivenBack, Failure> {
    let mut given = GivenBack::default();
    // Kept, a line is given back only if it is still a hold, checked in the same
    // step as the give-back (`Settle::CancelHold`): one confirmed through its own
    // route after the look-up below stays confirmed.
    let how = match paid {
        PaidLines::Refund => Settle::Cancel,
        PaidLines::Keep => Settle::CancelHold,
    };
    for (i, line) in lines.iter().enumerate() {
        if line.quantity == 0 {
            continue;
        }
        let line_key = line_key(key, i + 1);
        let looked = match super::settle(app, &line.drop, &line_key, Settle::Lookup).await {
            Ok(looked) => looked,
            // The drop is gone, and its holds with it.
            Err(Failure::UnknownDrop { .. }) => continue,
            Err(failure) => return Err(failure),
        };
        let Some(view) = looked.outcome.view() else {
            continue;
        };
        let ours = view.reservation.user == user
            && view.reservation.quantity == line.quantity
            && view.reservation.variant == line.variant;
        let state = view.reservation.state;
        if !ours {
            continue;
        }
        if state == State::Confirmed && paid == PaidLines::Keep {
            given.paid += 1;
            continue;
        }
        if !state.holds_units() && state != State::Pending {
            continue;
        }
        if faults::check(Fault::PauseBeforeGiveBack).is_err() {
            tokio::time::sleep(Duration::from_millis(2500)).await;
        }
        let mut pause = Duration::from_millis(50);
        let mut tries = 0;
        loop {
            let given_back = match super::settle(app, &line.drop, &line_key, how).await {
                Ok(served) => match served.outcome {
                    // Confirmed meanwhile (a give-back without a refund): it stays so.
                    Outcome::AlreadyConfirmed(_)
                    | Outcome::Overruled {
                        recorded: State::Confirmed,
                        ..
                    } if paid == PaidLines::Keep => {
                        given.paid += 1;
                        true
                    }
                    Outcome::Cancelled(_)
                    | Outcome::AlreadyCancelled(_)
                    | Outcome::Expired(_)
                    | Outcome::NotFound
                    | Outcome::Overruled { .. } => true,
                    _ => false,
                },
                Err(Failure::UnknownDrop { .. }) => true,
                Err(failure) if tries >= 4 => return Err(failure),
                Err(_) => false,
            };
            if given_back {
                break;
            }
            if tries >= 4 {
                return Err(Failure::retry(format!(
                    "line {line_key} of cart {key} could not be given back yet: retry"
                )));
            }
            tries += 1;
            tokio::time::sleep(pause).await;
            pause *= 2;
        }
    }
    Ok(given)
}

/// What a give-back found of a cart's lines.
#[derive(Debug, Default)]
struct GivenBack {
    /// Lines found confirmed (paid) and kept so.
    paid: usize,
}

async fn recorded(app: &App, key: &str) -> Result<CartRow, Failure> {
    match app.ledger.cart(app.drops.namespace(), key).await {
        Ok(Some(row)) => Ok(row),
        Ok(None) => Err(Failure::unavailable(format!(
            "cart {key} is not in the ledger any more"
        ))),
        Err(e) => Err(ledger_down("read the cart", e)),
    }
}

/// The cart `row` as an answer shows it; with `look_up`, each held line's
/// reservation as it stands now.
async fn view(app: &App, row: &CartRow, look_up: bool) -> CartView {
    let lines = lines_of(row);
    let mut held = Vec::new();
    for (n, line, key) in held_lines(row) {
        let reservation = if look_up {
            match super::settle(app, &line.drop, &key, Settle::Lookup).await {
                Ok(served) => served.outcome.view().map(|v| v.reservation.clone()),
                Err(_) => None,
            }
        } else {
            None
        };
        held.push(HeldLine {
            n,
            line: line.clone(),
            key,
            reservation,
        });
    }
    // The earliest deadline of the lines still held; the row's (its earliest
    // line's) only for a held cart whose lines were not read. An ended cart holds
    // nothing, and has none.
    let read = held.iter().any(|h| h.reservation.is_some());
    let expires_at_ms = held
        .iter()
        .filter_map(|h| h.reservation.as_ref())
        .filter(|r| r.state == State::Active)
        .map(|r| r.expires_at_ms)
        .min()
        .or(
            (row.state == CartState::Held && !read && row.expires_at_ms > 0)
                .then_some(row.expires_at_ms),
        );
    CartView {
        key: row.key.clone(),
        user: row.user.clone(),
        // Being given back: the state it is given back to.
        state: match (row.state, row.ends_as) {
            (CartState::Releasing, Some(ends_as)) => ends_as,
            (state, _) => state,
        },
        lines,
        held,
        short: shorts(&row.short),
        expires_at_ms,
        giving_back: row.state == CartState::Releasing,
    }
}

/// Confirms, cancels or looks up the cart `key` as a whole.
pub async fn settle(app: &App, key: &str, asked: CartSettle) -> Result<CartOutcome, Failure> {
    let namespace = app.drops.namespace();
    let row = match app.ledger.cart(namespace, key).await {
        Ok(Some(row)) => row,
        Ok(None) => return Ok(CartOutcome::NotFound),
        Err(e) => return Err(ledger_down("read the cart", e)),
    };
    let now = now_ms();
    match (asked, row.state) {
        (CartSettle::Lookup, _) => Ok(CartOutcome::Found(view(app, &row, true).await)),
        (_, CartState::Holding | CartState::Releasing | CartState::Confirming)
            // (A row an older sidecar ended names no attempt.)
            if !row.attempt.is_empty() && row.deadline_ms >= now =>
        {
            Err(in_flight(key))
        }
        (CartSettle::Confirm, CartState::Confirmed) => {
            Ok(CartOutcome::AlreadyConfirmed(view(app, &row, true).await))
        }
        // The answer its first confirm heard (also while its unpaid lines are
        // still being given back).
        (CartSettle::Confirm, CartState::PartlyConfirmed) => {
            Ok(CartOutcome::PartlyConfirmed(view(app, &row, true).await))
        }
        (CartSettle::Confirm, CartState::Releasing)
            if matches!(
                row.ends_as,
                Some(CartState::PartlyConfirmed | CartState::Expired)
            ) =>
        {
            Ok(CartOutcome::PartlyConfirmed(view(app, &row, true).await))
        }
        (CartSettle::Cancel, CartState::Cancelled) => {
            Ok(CartOutcome::AlreadyCancelled(view(app, &row, true).await))
        }
        (CartSettle::Confirm, CartState::Confirming) => confirm(app, row).await,
        (CartSettle::Confirm, CartState::Held) if row.expires_at_ms - CONFIRM_MARGIN_MS >= now => {
            confirm(app, row).await
        }
        // Too close to (or past) its expiry to confirm line by line: it expires
        // as a whole now.
        (CartSettle::Confirm, CartState::Held) => {
            let lines = lines_of(&row);
            match finish_release(app, &row, CartState::Expired, &lines).await {
                // Answered from the end it recorded.
                Ok(ended) => Ok(expired_answer(app, ended_as(app, key, ended, row).await).await),
                // Its own give-back stalled after the cart was recorded releasing:
                // under way, said so (its lines may still hold units).
                Err(failure @ Failure::Unavailable {
                    retry: Retry::SameKeyToGoOn { .. },
                    ..
                }) => Err(failure),
                Err(failure) => match recorded(app, key).await {
                    // Its move to releasing landed (this attempt's or another
                    // expiry's): it is expired, whoever gives its lines back (the
                    // sweeper, when this attempt could not).
                    Ok(now)
                        if now.state == CartState::Releasing
                            && matches!(
                                now.ends_as,
                                Some(CartState::Expired | CartState::PartlyConfirmed)
                            ) =>
                    {
                        Ok(expired_answer(app, now).await)
                    }
                    // Moved by another (confirmed, being confirmed, cancelled,
                    // ended): answered as any confirm of it now is. (Never back to
                    // held, so this asks once.)
                    Ok(now) if now.state != CartState::Held => {
                        Box::pin(settle(app, key, CartSettle::Confirm)).await
                    }
                    // Nothing moved, or nothing can be read: as the failure says.
                    _ => Err(failure),
                },
            }
        }
        (
            CartSettle::Cancel,
            CartState::Held
            | CartState::Confirmed
            | CartState::PartlyConfirmed
            | CartState::Confirming
            | CartState::Holding
            | CartState::Releasing,
        ) => cancel(app, row).await,
        // Expired, refused, given back, or being given back: nothing to confirm
        // or cancel any more.
        (_, _) => Ok(CartOutcome::Gone(view(app, &row, true).await)),
    }
}

async fn confirm(app: &App, row: CartRow) -> Result<CartOutcome, Failure> {
    let namespace = app.drops.namespace();
    // A held cart whose lines are all active holds on the gate that decides all
    // their drops is confirmed as one: its lines' confirms and its own move in one
    // ledger transaction, so that a failure anywhere before it commits leaves
    // every line as it was.
    if row.state == CartState::Held {
        let held = held_lines(&row);
        let keys: Vec<(&str, String)> = held
            .iter()
            .map(|(_, line, key)| (line.drop.as_str(), key.clone()))
            .collect();
        let closing = closing_attempt();
        let cart = move_to_confirmed(namespace, &row, CartState::Held, &row.attempt, &closing);
        match super::settle::confirm_as_one(app, &keys, cart).await {
            ConfirmAsOne::Confirmed => {
                // Answered from the move just made: a failed read of the row now
                // must not answer 503 for a cart that is confirmed.
                let confirmed = CartRow {
                    state: CartState::Confirmed,
                    attempt: closing,
                    ..row
                };
                return Ok(CartOutcome::Confirmed(view(app, &confirmed, true).await));
            }
            ConfirmAsOne::Failed(failure) | ConfirmAsOne::Unknown(failure) => return Err(failure),
            ConfirmAsOne::CartMoved => return Err(in_flight(&row.key)),
            ConfirmAsOne::OneByOne => {}
        }
    }
    let mine = attempt();
    let taken = app
        .ledger
        .move_cart(CartMove {
            namespace,
            key: &row.key,
            from: row.state,
            attempt: &row.attempt,
            to: CartState::Confirming,
            ends_as: None,
            new_attempt: &mine,
            deadline_ms: now_ms() + SETTLE_BOUND_MS,
            expires_at_ms: row.expires_at_ms,
            held: &row.held,
            short: &row.short,
        })
        .await
        .map_err(|e| not_written(&row.key, "record the cart's confirm", e))?;
    if !taken {
        return Err(in_flight(&row.key));
    }
    let lines = lines_of(&row);
    let mut confirmed = 0;
    for (_, line, key) in held_lines(&row) {
        let served = super::settle(app, &line.drop, &key, Settle::Confirm { quantity: None }).await;
        let over = match &served {
            Ok(served) => match &served.outcome {
                Outcome::Confirmed(_) | Outcome::AlreadyConfirmed(_) => {
                    confirmed += 1;
                    continue;
                }
                outcome => over_unconfirmed(outcome),
            },
            // The drop is gone, and its holds with it.
            Err(Failure::UnknownDrop { .. }) => true,
            Err(_) => false,
        };
        if !over {
            // Not confirmable yet (a failure, a record being made): the cart stays
            // confirming, handed on at once (this attempt stops here), so that a
            // retry of its confirm, or the sweeper's next round, goes on from here.
            let failure = match served {
                Err(failure) => failure,
                Ok(_) => Failure::retry(format!(
                    "line {key} of cart {} is still being recorded or brought in line, and cannot be confirmed yet: retry the confirm",
                    row.key
                )),
            };
            hand_on(app, &row, CartState::Confirming, &mine).await;
            return Err(confirmed_so_far(&row.key, confirmed, failure));
        }
        // A line that lapsed or was cancelled on its own (through its
        // reservation's routes): the cart cannot be confirmed whole. What was
        // confirmed stays so (a paid line is never taken back here), the lines
        // still held go back, and the cart ends confirmed as far as it went (kept
        // by retention, see retention.rs), or expired when no line is confirmed
        // (by this pass, an earlier one, or through a line's own route: the lines
        // are looked up); a retry of its confirm hears the same, its lines saying
        // where each stands.
        let any_confirmed = confirmed > 0
            || view(app, &row, true).await.held.iter().any(|line| {
                line.reservation
                    .as_ref()
                    .is_some_and(|r| r.state == State::Confirmed)
            });
        let ends_as = if any_confirmed {
            CartState::PartlyConfirmed
        } else {
            CartState::Expired
        };
        let confirming = CartRow {
            state: CartState::Confirming,
            attempt: mine.clone(),
            ..row.clone()
        };
        if let Err(failure) = finish_release(app, &confirming, ends_as, &lines).await {
            // Still confirming (its move to releasing was not recorded): a retry of
            // the confirm goes on with it. Releasing: handed on, a retry or the sweeper finishes it.
            // Ended already (its last move's answer was lost, and it landed): done.
            let now = recorded(app, &row.key)
                .await
                .map_err(|f| confirmed_so_far(&row.key, confirmed, f))?;
            if now.state == CartState::Confirming {
                hand_on(app, &row, CartState::Confirming, &mine).await;
                return Err(confirmed_so_far(&row.key, confirmed, failure));
            }
            tracing::warn!(cart = %row.key, ?failure, "the lines of a cart not confirmed whole are left to the sweeper to give back");
        }
        // (Past the move to confirming, every failure says what was confirmed.)
        let row = recorded(app, &row.key)
            .await
            .map_err(|f| confirmed_so_far(&row.key, confirmed, f))?;
        return Ok(CartOutcome::PartlyConfirmed(view(app, &row, true).await));
    }
    let recorded_confirmed = finish_confirm(app, &row, &mine)
        .await
        .map_err(|f| confirmed_so_far(&row.key, confirmed, f))?;
    if !recorded_confirmed {
        // Taken over past its bound by another attempt, which goes on with it.
        return Err(confirmed_so_far(&row.key, confirmed, in_flight(&row.key)));
    }
    // Answered from the move just made: a failed read of the row now must not
    // answer 503 for a cart that is confirmed.
    let confirmed_row = CartRow {
        state: CartState::Confirmed,
        ..row
    };
    Ok(CartOutcome::Confirmed(
        view(app, &confirmed_row, true).await,
    ))
}

/// The answer to a confirm of `row`, which expired (whole, or as far as it went:
/// a line paid through its own route keeps it `partly_confirmed`).
async fn expired_answer(app: &App, row: CartRow) -> CartOutcome {
    let ended = match (row.state, row.ends_as) {
        (CartState::Releasing, Some(ends_as)) => ends_as,
        (state, _) => state,
    };
    if ended == CartState::PartlyConfirmed {
        CartOutcome::PartlyConfirmed(view(app, &row, true).await)
    } else {
        CartOutcome::Gone(view(app, &row, true).await)
    }
}

/// Whether a line's answer to its cart's confirm says it is over without being
/// confirmed: lapsed, cancelled on its own, or gone.
fn over_unconfirmed(outcome: &Outcome) -> bool {
    match outcome {
        Outcome::Expired(_)
        | Outcome::WasCancelled(_)
        | Outcome::Cancelled(_)
        | Outcome::AlreadyCancelled(_)
        | Outcome::NotFound => true,
        Outcome::Overruled { recorded, .. } => {
            matches!(recorded, State::Expired | State::Cancelled)
        }
        Outcome::RecordExpired(view) => {
            matches!(view.reservation.state, State::Expired | State::Cancelled)
        }
        _ => false,
    }
}

/// How soon a cart an attempt stopped working on is anyone's: as long as a 503's
/// `Retry-After` asks a client to wait, so the retry finds it free, and the
/// sweeper goes on with it no oftener than that.
const HANDED_ON_MS: i64 = 1_000;

/// Hands the cart `row`, which attempt `mine` moved to `state` and stops working
/// on, to whoever comes next: a retry of its key goes on with it after
/// [`HANDED_ON_MS`], and so does the sweeper's next round after that. (Should the
/// ledger not take the move, the attempt's own deadline does the same later.)
async fn hand_on(app: &App, row: &CartRow, state: CartState, mine: &str) {
    let handed = app
        .ledger
        .move_cart(CartMove {
            namespace: app.drops.namespace(),
            key: &row.key,
            from: state,
            attempt: mine,
            to: state,
            ends_as: row.ends_as,
            new_attempt: &attempt(),
            deadline_ms: now_ms() + HANDED_ON_MS,
            expires_at_ms: row.expires_at_ms,
            held: &row.held,
            short: &row.short,
        })
        .await;
    if let Err(error) = handed {
        tracing::debug!(cart = %row.key, %error, "a cart is left to its attempt's bound");
    }
}

/// A cart confirm's failure at a line, after it recorded the cart `confirming` and
/// confirmed `confirmed` lines (decided line by line; 0 counts too): those stay
/// so, and the confirm is under way (see [`under_way`]).
fn confirmed_so_far(key: &str, confirmed: usize, failure: Failure) -> Failure {
    under_way(
        key,
        UnderWay::Confirm {
            lines_confirmed: confirmed,
        },
        failure,
    )
}

/// A failure of a cart's change `change` after the cart was recorded `confirming`
/// or releasing: the change is decided and under way, handed on, and a retry of the
/// same call (or the sweeper's next round) goes on with the rest. The answer says
/// so, in its sentence and its body; a commit that may have landed unbeknown keeps
/// saying that.
fn under_way(key: &str, change: UnderWay, failure: Failure) -> Failure {
    let (what, so_far, retry) = match change {
        UnderWay::Confirm { lines_confirmed } => (
            "confirm",
            format!("{lines_confirmed} of its lines confirmed so far"),
            "retry the same call to go on with the rest",
        ),
        UnderWay::GiveBack => (
            "give-back",
            "some of its lines may be given back already".to_string(),
            // (A cart's reserve retried waits for it: it hears the cart's end once
            // every line is back.)
            "retry the same call to go on with the rest or hear how it ended",
        ),
    };
    let (why, path, outcome_unknown) = match failure {
        // Said so already (a give-back under way that a confirm met).
        under_way @ Failure::Unavailable {
            retry: Retry::SameKeyToGoOn { .. },
            ..
        } => return under_way,
        Failure::Unavailable { why, path, retry } => (why, path, retry == Retry::SameKeyToLearn),
        Failure::Throttled { path, .. } => (
            format!("the {what} of cart {key} cannot go on at once"),
            path,
            false,
        ),
        other => return other,
    };
    Failure::Unavailable {
        why: format!(
            "cart {key}: its {what} is decided and under way ({so_far}) and stopped where a line could not go on ({why}); {retry}, or the sidecars finish it"
        ),
        path,
        retry: Retry::SameKeyToGoOn {
            under_way: change,
            outcome_unknown,
        },
    }
}

/// Records the confirm of `row` by attempt `mine` as done: whether it still was
/// this attempt's to record.
async fn finish_confirm(app: &App, row: &CartRow, mine: &str) -> Result<bool, Failure> {
    let closing = closing_attempt();
    app.ledger
        .move_cart(move_to_confirmed(
            app.drops.namespace(),
            row,
            CartState::Confirming,
            mine,
            &closing,
        ))
        .await
        .map_err(|e| unknown(&row.key, "record the cart's confirm", e))
}

async fn cancel(app: &App, row: CartRow) -> Result<CartOutcome, Failure> {
    let lines = lines_of(&row);
    let key = row.key.clone();
    // A held cart past its expiry expired as a whole (whether or not the sweeper
    // has come by yet): it is given back as an expiry is, never refunding a line
    // paid through its own route, and then that paid line is refunded below.
    let toward = if row.state == CartState::Held && row.expires_at_ms <= now_ms() {
        CartState::Expired
    } else {
        CartState::Cancelled
    };
    let ended = finish_release(app, &row, toward, &lines).await?;
    match ended {
        // An expired cart holds nothing and paid nothing: answered as a cancel of
        // an expired cart is.
        CartState::Expired => {
            let now = ended_as(app, &key, ended, row).await;
            Ok(CartOutcome::Gone(view(app, &now, true).await))
        }
        // It was being given back toward another end (an expiry, or a confirm that
        // found a line lapsed), recorded now, with a paid line: the cancel goes on
        // from the cart as it stands (another attempt may have moved it since), and
        // refunds that line. The unpaid lines are given back already, so a failure
        // there says the cart's give-back is under way.
        CartState::PartlyConfirmed | CartState::Confirmed => {
            Box::pin(settle(app, &key, CartSettle::Cancel))
                .await
                .map_err(|failure| refund_not_begun(&key, failure))
        }
        CartState::Cancelled => {
            let now = ended_as(app, &key, ended, row).await;
            Ok(CartOutcome::Cancelled(view(app, &now, true).await))
        }
        // It was being given back toward an end of its own (refused, or left
        // holding by a sidecar that stopped), recorded now: a cancel of a cart that
        // ended so hears its state, as it would have a moment later.
        _ => {
            let now = ended_as(app, &key, ended, row).await;
            Ok(CartOutcome::Gone(view(app, &now, true).await))
        }
    }
}

/// A cancel's failure to refund the paid lines of cart `key`, which had ended (an
/// expiry, or a confirm that found a line lapsed) and whose end this cancel
/// recorded: that end was due whoever recorded it, and the refund, unless its
/// failure says it is under way, has not begun (only a cancel begins it).
fn refund_not_begun(key: &str, failure: Failure) -> Failure {
    match failure {
        under_way @ Failure::Unavailable {
            retry: Retry::SameKeyToGoOn { .. } | Retry::SameKeyToLearn,
            ..
        } => under_way,
        Failure::Unavailable { why, path, retry } => Failure::Unavailable {
            why: format!(
                "cart {key} had ended (its unpaid lines are given back, as its end does); the refund of its paid lines has not begun ({why}): retry the cancel"
            ),
            path,
            retry,
        },
        Failure::Throttled { path, .. } => Failure::Unavailable {
            why: format!(
                "cart {key} had ended (its unpaid lines are given back, as its end does); this call did not begin the refund of its paid lines (another call on the cart is under way and may be making it): retry the cancel"
            ),
            path,
            retry: Retry::SameKeySoon,
        },
        other => other,
    }
}

/// The cart `key` as recorded now, which this request just ended as `ended`; as
/// `row` ended so when the ledger cannot be read (a failed re-read must not answer
/// 503 for a cart this request ended).
async fn ended_as(app: &App, key: &str, ended: CartState, row: CartRow) -> CartRow {
    match recorded(app, key).await {
        Ok(now) => now,
        Err(_) => CartRow {
            state: ended,
            ends_as: None,
            ..row
        },
    }
}

/// Moves `row` to releasing (to end as `ends_as`), gives back its lines, and
/// records it as the end it came to (returned). A failure before the move to
/// releasing changed nothing; after it, the give-back is decided and the failure
/// says it is under way ([`UnderWay::GiveBack`]), the cart handed on.
async fn finish_release(
    app: &App,
    row: &CartRow,
    ends_as: CartState,
    lines: &[CartLine],
) -> Result<CartState, Failure> {
    let namespace = app.drops.namespace();
    let mine = attempt();
    let ends_as = row
        .ends_as
        .filter(|_| row.state == CartState::Releasing)
        .unwrap_or(ends_as);
    let taken = app
        .ledger
        .move_cart(CartMove {
            namespace,
            key: &row.key,
            from: row.state,
            attempt: &row.attempt,
            to: CartState::Releasing,
            ends_as: Some(ends_as),
            new_attempt: &mine,
            deadline_ms: now_ms() + SETTLE_BOUND_MS,
            expires_at_ms: row.expires_at_ms,
            held: &row.held,
            short: &row.short,
        })
        .await
        .map_err(|e| not_written(&row.key, "record the cart's give-back", e))?;
    if !taken {
        return Err(in_flight(&row.key));
    }
    // Recorded as releasing: from here on the give-back is decided, and a
    // failure leaves it under way (some lines may be given back already), handed
    // on to a retry or the sweeper; its answer says so.
    let releasing = CartRow {
        state: CartState::Releasing,
        ends_as: Some(ends_as),
        attempt: mine.clone(),
        ..row.clone()
    };
    let given = match give_back(app, &row.key, &row.user, lines, PaidLines::toward(ends_as)).await {
        Ok(given) => given,
        Err(failure) => {
            hand_on(app, &releasing, CartState::Releasing, &mine).await;
            return Err(under_way(&row.key, UnderWay::GiveBack, failure));
        }
    };
    // A cart found with a paid line (confirmed through the line's own route,
    // before or during the give-back) is confirmed as far as it went, never
    // expired: retention keeps it, and a cancel of it refunds that line.
    let ends_as = if ends_as == CartState::Expired && given.paid > 0 {
        CartState::PartlyConfirmed
    } else {
        ends_as
    };
    let finished = app
        .ledger
        .move_cart(CartMove {
            namespace,
            key: &row.key,
            from: CartState::Releasing,
            attempt: &mine,
            to: ends_as,
            ends_as: None,
            new_attempt: &closing_attempt(),
            deadline_ms: 0,
            expires_at_ms: row.expires_at_ms,
            held: &row.held,
            short: &row.short,
        })
        .await
        .map_err(|e| {
            under_way(
                &row.key,
                UnderWay::GiveBack,
                unknown(&row.key, "record the cart's give-back", e),
            )
        })?;
    if finished {
        Ok(ends_as)
    } else {
        // Taken over past its bound by another attempt, which goes on with it.
        Err(under_way(&row.key, UnderWay::GiveBack, in_flight(&row.key)))
    }
}

/// The cart sweeper's round: gives back carts left holding past their deadline
/// (their sidecar died, or their buyer never retried), finishes give-backs whose
/// sidecar stopped, expires held carts past their earliest line's deadline, and
/// finishes confirms whose sidecar stopped.
pub async fn sweep(app: &App) {
    let now = now_ms();
    let rows = match app
        .ledger
        .overdue_carts(app.drops.namespace(), now, 64)
        .await
    {
        Ok(rows) => rows,
        Err(error) => {
            tracing::warn!(%error, "overdue carts could not be read");
            return;
        }
    };
    for row in rows {
        let lines = lines_of(&row);
        let done = match row.state {
            CartState::Holding | CartState::Releasing => {
                finish_release(app, &row, CartState::Released, &lines)
                    .await
                    .map(|_| ())
            }
            CartState::Held => finish_release(app, &row, CartState::Expired, &lines)
                .await
                .map(|_| ()),
            CartState::Confirming => confirm(app, row.clone()).await.map(|_| ()),
            _ => Ok(()),
        };
        if let Err(failure) = done {
            tracing::debug!(cart = %row.key, ?failure, "an overdue cart is left for the next round");
        }
    }
}
