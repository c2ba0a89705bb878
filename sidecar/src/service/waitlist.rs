//! The waitlist: joining a line, looking at one's place, leaving, and the offers
//! the sweeper makes to the head of each line when units are back.
//!
//! The lines live on the Redis gate (`gate::waitlist`) and in the ledger, which
//! has each entry durable before its buyer hears 201 and decides, between a buyer
//! leaving and an offer to them, which came first. An offer is an admission of the
//! head's units under the entry's key, made durable like any other
//! ([`admit::on_gate`] with the offer flag): the buyer is never told of a hold the
//! ledger has not recorded. While a drop is on its fallback gate, the lines wait:
//! the fallback refuses new reserves while anyone waits (so what comes back stays
//! theirs), and the waitlist's routes answer 503 until the gate is back.

use dropgate_api::{DropConfig, Mode};

use super::handover::{self, HandoverError, Opening};
use super::{
    Checked, Choice, Failure, Turn, admit, being_rebuilt, check_redis, checked, choose, find_drop,
    foreign_ledger, pending_bound_ms, redis_changed, redis_failed, redis_still_checked,
};
use crate::app::App;
use crate::drops::Drop;
use crate::gate::waitlist::{self as line, Entry, EntryState, Said, Word};
use crate::input::Reserve;
use crate::ledger::waitlist::Join;
use crate::ledger::{LedgerError, WaitRow, WaitState};
use crate::reservation::{Outcome, Settle, VariantRefusal, View};

/// Offers made per line per sweep; the rest wait for the next sweep.
const OFFERS_PER_SWEEP: usize = 64;

/// An entry's place, as an answer shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Place {
    pub user: String,
    pub quantity: i64,
    pub variant: Option<String>,
    /// 1 for the head of the line.
    pub place: i64,
}

/// What a waitlist call came to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Waiting {
    /// The buyer joined the line (201).
    Joined(Place),
    /// A retry of a join, or a look-up: the entry waits.
    AlreadyWaiting(Place),
    /// The entry was served: its key holds this reservation.
    Offered(View),
    /// The entry left the line (the buyer left, or could no longer be served).
    Left,
    Full {
        limit: i64,
    },
    PerUserLimit {
        held: i64,
        limit: i64,
    },
    /// The key names a reservation, or another entry.
    KeyReused,
    /// No entry has this key.
    NotFound,
    /// The drop has no waitlist.
    Disabled,
    NotOpen {
        starts_at_ms: Option<i64>,
    },
    Ended {
        ends_at_ms: Option<i64>,
    },
    VariantRefused(VariantRefusal),
}

fn place_of(entry: &Entry) -> Place {
    Place {
        user: entry.user.clone(),
        quantity: entry.quantity,
        variant: entry.variant.clone(),
        // Being offered: out of line, at its head.
        place: entry.place.unwrap_or(1),
    }
}

/// Joins `request.key` to the line of its variant, durable in the ledger before
/// it is answered.
pub async fn join(app: &App, drop_name: &str, request: &Reserve) -> Result<Waiting, Failure> {
    let drop = find_drop(app, drop_name).await?;
    let attempt = format!("{:016x}", rand::random::<u64>());
    let mut reopened = false;
    let mut resolved = false;
    let mut rechecked = false;
    loop {
        let (config, redis) = ready(app, &drop).await?;
        let mut conn = app.redis.clone();
        let said = line::join(
            &mut conn,
            &drop.keys,
            app.ledger.id(),
            &request.key,
            &request.user,
            request.quantity,
            request.variant.as_deref(),
            &attempt,
            pending_bound_ms(&config),
        )
        .await
        .map_err(|e| redis_failure(app, &drop, &config, &e))?;
        if !redis_still_checked(app, &drop, redis) {
            // Perhaps another Redis than the one checked (the client reconnected
            // meanwhile): a join placed there is taken back, and Redis is checked
            // again before the join is asked for anew.
            if let Said::Entry(Word::Joining, _) = said
                && let Err(error) = line::unjoin(
                    &mut conn,
                    &drop.keys,
                    app.ledger.id(),
                    &request.key,
                    &attempt,
                )
                .await
            {
                tracing::warn!(drop = %drop.name, %error, "a join placed in an unchecked Redis could not be taken back now");
            }
            if rechecked {
                return Err(redis_changed(&drop));
            }
            rechecked = true;
            continue;
        }
        match said {
            Said::Entry(Word::Joining, entry) => {
                return make_durable(app, &drop, &request.key, &attempt, &entry).await;
            }
            Said::Entry(Word::Pending, _) => {
                return Err(Failure::retry(
                    "an earlier attempt to join with this key is being recorded: nothing was changed; retry the same key",
                ));
            }
            Said::Entry(Word::Overdue, entry) if !resolved => {
                resolved = true;
                resolve_join(app, &drop, &request.key, &entry).await?;
            }
            Said::Entry(_, entry) => return standing(app, &drop, &request.key, entry).await,
            Said::Closed if !reopened => {
                reopened = true;
                reopen(app, &drop, false).await?;
            }
            other => return refused(app, &drop, other).await,
        }
    }
}

/// The generation of the drop's config Redis decided `entry` on, when the API
/// server numbered it (outside Kubernetes nothing publishes a lost change again,
/// so there is nothing to compare).
fn compared_generation(entry: &Entry) -> Option<i64> {
    entry
        .config_generation
        .filter(|g| dropgate_api::config::numbered_by_api_server(*g))
}

/// Counts, and words, the refusal of a join Redis decided on generation
/// `decided_on` of the drop's config when `newest` is known (this sidecar read it,
/// or the ledger has seen it): Redis lost a change (a waitlist closed or a per-user
/// limit cut perhaps), and a stale view never decides.
fn refuse_on_lost_config(app: &App, drop: &Drop, decided_on: i64, newest: i64) -> Failure {
    super::count_decided_on_lost_config(app, drop);
    Failure::retry(format!(
        "Redis decided this join on an older config of drop {} (generation {decided_on}) than generation {newest}: it lost that change, and the operator publishes it again; nothing was changed: retry the same key",
        drop.name
    ))
}

/// The entry of `key` as it stands: its place, its reservation once served.
pub async fn look(app: &App, drop_name: &str, key: &str) -> Result<Waiting, Failure> {
    let drop = find_drop(app, drop_name).await?;
    match entry_of(app, &drop, key).await? {
        Some(entry) => standing(app, &drop, key, entry).await,
        None => Ok(Waiting::NotFound),
    }
}

/// Takes `key`'s entry out of its line: recorded in the ledger first, which
/// decides against an offer to it racing this; Redis follows.
pub async fn leave(app: &App, drop_name: &str, key: &str) -> Result<Waiting, Failure> {
    let drop = find_drop(app, drop_name).await?;
    let Some(entry) = entry_of(app, &drop, key).await? else {
        return Ok(Waiting::NotFound);
    };
    match entry.state {
        EntryState::Joining => Err(Failure::retry(
            "this key's join is being recorded: nothing was changed; retry",
        )),
        EntryState::Offered | EntryState::Left => standing(app, &drop, key, entry).await,
        EntryState::Waiting | EntryState::Offering => {
            let row = app
                .ledger
                .leave(&drop.ledger_key(), key)
                .await
                .map_err(|e| {
                    Failure::unavailable(format!(
                        "the ledger could not record leaving the line ({e}): nothing was changed; retry"
                    ))
                })?;
            match row {
                Some(WaitRow {
                    state: WaitState::Left,
                    ..
                }) => {
                    follow_leave(app, &drop, key).await;
                    Ok(Waiting::Left)
                }
                Some(WaitRow {
                    state: WaitState::Offered,
                    ..
                }) => offered(app, &drop, key).await,
                other => Err(Failure::unavailable(format!(
                    "the ledger's record of this place in line is {}: nothing was changed",
                    other.map_or("missing", |row| row.state.as_str())
                ))),
            }
        }
    }
}

/// Redis follows a leave the ledger recorded (best effort: an entry Redis still
/// has waiting is taken out when an offer to it is refused by the ledger, or when
/// it is looked at).
async fn follow_leave(app: &App, drop: &Drop, key: &str) {
    let mut conn = app.redis.clone();
    if let Err(error) = line::leave(&mut conn, &drop.keys, app.ledger.id(), key).await {
        tracing::warn!(drop = %drop.name, %error, "a leave the ledger recorded is not in Redis yet");
    }
}

/// Offers the head of each line of `drop` its units when they are back, in order,
/// for the sweeper (which runs it while Redis decides the drop).
pub async fn offer_due(app: &App, drop: &Drop) {
    let config = drop.config();
    if config.waitlist.is_none() {
        return;
    }
    let variants: Vec<Option<String>> = if config.variants.is_empty() {
        vec![None]
    } else {
        config
            .variants
            .iter()
            .map(|v| Some(v.name.clone()))
            .collect()
    };
    for variant in variants {
        for _ in 0..OFFERS_PER_SWEEP {
            if !offer_head(app, drop, &config, variant.as_deref()).await {
                break;
            }
        }
    }
}

/// Offers the head of one line its units if they are there: true when the next
/// head may be looked at.
async fn offer_head(app: &App, drop: &Drop, config: &DropConfig, variant: Option<&str>) -> bool {
    let mut conn = app.redis.clone();
    let (key, entry, left, overdue) =
        match line::head(&mut conn, &drop.keys, app.ledger.id(), variant).await {
            Ok(Said::Head {
                key,
                entry,
                left,
                overdue,
            }) => (key, entry, left, overdue),
            Ok(Said::Stale) => return true,
            Ok(_) => return false,
            Err(error) => {
                tracing::debug!(drop = %drop.name, %error, "waitlist head not read");
                return false;
            }
        };
    match entry.state {
        // A join not durable yet holds the line until it is; one past its bound
        // was left by a sidecar that died, and is resolved here.
        EntryState::Joining if overdue => {
            return resolve_join(app, drop, &key, &entry).await.is_ok();
        }
        EntryState::Waiting if left >= entry.quantity => {}
        _ => return false,
    }
    let request = Reserve {
        key,
        user: entry.user.clone(),
        quantity: entry.quantity,
        variant: entry.variant.clone(),
    };
    // The offer stands only if made on a Redis checked against the ledger.
    let Ok(Ok(redis)) = check_redis(app, drop).await else {
        return false;
    };
    match admit::on_gate(app, drop, config, redis, &request, true).await {
        Turn::Done(Ok(Outcome::Admitted(_))) => {
            app.metrics.offered.inc();
            tracing::debug!(drop = %drop.name, key = %request.key, "offered to the waitlist's head");
            true
        }
        // The buyer can no longer take the units (the limit was cut, or the key
        // was used meanwhile): the entry leaves the line rather than hold it up.
        Turn::Done(Ok(outcome @ (Outcome::PerUserLimit { .. } | Outcome::KeyReused))) => {
            tracing::info!(drop = %drop.name, key = %request.key, ?outcome, "a waitlist entry that cannot be served leaves the line");
            match app.ledger.leave(&drop.ledger_key(), &request.key).await {
                Ok(Some(WaitRow {
                    state: WaitState::Left,
                    ..
                })) => {
                    follow_leave(app, drop, &request.key).await;
                    true
                }
                _ => false,
            }
        }
        // Refused by the ledger, or the key holds a reservation already: what the
        // ledger recorded of the entry says why.
        _ => follow_ledger(app, drop, &request.key).await,
    }
}

/// Brings Redis's entry `key`, which could not be offered, to the ledger's record
/// of it: true when it left the line so, and the next head may be looked at.
/// - Left: the buyer left first (the offer's undo put it back in line).
/// - Offered: it was served already: an offer whose commit landed after Redis took
///   it back or expired it while pending, which put it back in line. Left there
///   it would stop the line for good (its key answers every new offer with the
///   reservation it holds, or the ledger refuses one).
async fn follow_ledger(app: &App, drop: &Drop, key: &str) -> bool {
    let drop_key = drop.ledger_key();
    match app.ledger.waiting_entry(&drop_key, key).await {
        Ok(Some(WaitRow {
            state: WaitState::Left,
            ..
        })) => {
            follow_leave(app, drop, key).await;
            true
        }
        Ok(Some(
            row @ WaitRow {
                state: WaitState::Offered,
                ..
            },
        )) => {
            let mut conn = app.redis.clone();
            let sale = drop.config().sale;
            match line::replay(&mut conn, &drop.keys, app.ledger.id(), &row, &sale).await {
                Ok(_) => {
                    tracing::info!(drop = %drop.name, key, "an entry the ledger has served leaves the line in Redis too");
                    true
                }
                Err(error) => {
                    tracing::warn!(drop = %drop.name, key, %error, "an entry the ledger has served is still in line in Redis");
                    false
                }
            }
        }
        _ => false,
    }
}

/// Makes the join `attempt` durable in the ledger, then lets it wait in Redis.
async fn make_durable(
    app: &App,
    drop: &Drop,
    key: &str,
    attempt: &str,
    entry: &Entry,
) -> Result<Waiting, Failure> {
    // One reading of the config: the sale the row goes under and the stock it
    // may make there are the same config's.
    let config = drop.config();
    let drop_key = drop.ledger_key_of(&config.sale);
    // Against this sidecar's config here; against the newest the ledger has seen
    // inside the join's own transaction (Ledger::join).
    let decided_on = compared_generation(entry);
    let read_here = config.generation;
    if let Some(decided_on) = decided_on
        && dropgate_api::config::lost_since(decided_on, read_here)
    {
        take_back_join(app, drop, key, attempt).await;
        return Err(refuse_on_lost_config(app, drop, decided_on, read_here));
    }
    let known = crate::reservation::Stock::of(&config);
    let join = Join {
        key,
        user: &entry.user,
        quantity: entry.quantity,
        variant: entry.variant.as_deref(),
        position: entry.position,
        attempt,
        decided_on,
        stock_if_first: Some(&known),
    };
    if crate::faults::check(crate::faults::Fault::DieMidJoin).is_err() {
        tracing::error!(key, "injected fault: the process dies mid-join");
        std::process::abort();
    }
    let row = match app.ledger.join(&drop_key, join).await {
        Ok(row) => Some(row),
        // The ledger has seen a newer config than Redis decided on. Nothing was
        // written.
        Err(LedgerError::ConfigBehind { decided_on, newest }) => {
            take_back_join(app, drop, key, attempt).await;
            return Err(refuse_on_lost_config(app, drop, decided_on, newest));
        }
        // Another join holds this position in the ledger: Redis handed it out
        // twice (a promoted replica that lost that join). Nothing was written.
        Err(LedgerError::PositionTaken(position)) => {
            take_back_join(app, drop, key, attempt).await;
            rebuild_after_lost_join(app, drop, &format!("position {position} handed out twice"))
                .await;
            return Err(Failure::retry(format!(
                "Redis lost a recent join of drop {}'s line and is being brought in line with the ledger: nothing was changed; retry the same key",
                drop.name
            )));
        }
        // The write may have landed: the key is claimed for this attempt, so it
        // cannot land later, and the row says which way it went.
        Err(error) => {
            tracing::warn!(drop = %drop.name, %error, "a join was not recorded");
            app.ledger
                .give_up_join(&drop_key, key, attempt, join)
                .await
                .ok()
        }
    };
    let mut conn = app.redis.clone();
    match row {
        Some(row) if row.attempt == attempt && row.state == WaitState::Waiting => {
            match line::joined(&mut conn, &drop.keys, app.ledger.id(), key, attempt).await {
                Ok(Said::Entry(_, now)) if now.state != EntryState::Joining => {
                    Ok(Waiting::Joined(place_of(&now)))
                }
                // Redis no longer has the entry the ledger just recorded: it lost
                // it (a failover since the join was placed), and is rebuilt from
                // the ledger, this join with it. The 201 stands whether or not the
                // rebuild succeeds now: the ledger has the join.
                Ok(Said::NoEntry) => {
                    rebuild_after_lost_join(app, drop, "a durable join is gone from Redis").await;
                    Ok(Waiting::Joined(place_of(entry)))
                }
                // Durable all the same: Redis is told when the entry is met past
                // its bound (a retry of the key, or the line's head).
                other => {
                    tracing::warn!(drop = %drop.name, ?other, "a durable join is not waiting in Redis yet");
                    Ok(Waiting::Joined(place_of(entry)))
                }
            }
        }
        Some(row) => {
            take_back_join(app, drop, key, attempt).await;
            Err(Failure::unavailable(format!(
                "the ledger did not record the place in line (its record of the key is {}): nothing was changed; retry",
                row.state.as_str()
            )))
        }
        None => Err(Failure::retry(format!(
            "the ledger could not record the place in line and cannot be asked now; it is settled within {} ms: retry the same key",
            pending_bound_ms(&drop.config())
        ))),
    }
}

/// Takes the join `attempt` of `key` out of Redis's line: the ledger did not
/// record it. (One Redis does not take back now stays `joining`, and is resolved
/// from the ledger past its bound.)
async fn take_back_join(app: &App, drop: &Drop, key: &str, attempt: &str) {
    let mut conn = app.redis.clone();
    if let Err(error) = line::unjoin(&mut conn, &drop.keys, app.ledger.id(), key, attempt).await {
        tracing::warn!(drop = %drop.name, %error, "a join the ledger did not record is still in Redis; it is resolved past its bound");
    }
}

/// Redis lost a join the ledger recorded (`why` says how it showed): it is rebuilt
/// from the ledger now, within this request, before the buyer is answered, so
/// that the retry meets the line the ledger has. Until a rebuild is made (one
/// another sidecar runs already, or one that fails now), every call checks Redis
/// again and finds it behind: nothing is decided on the Redis that lost the join.
async fn rebuild_after_lost_join(app: &App, drop: &Drop, why: &str) {
    tracing::warn!(drop = %drop.name, why, "Redis lost a join the ledger recorded: rebuilding it from the ledger");
    drop.openings.suspect();
    drop.verified
        .store(u64::MAX, std::sync::atomic::Ordering::Release);
    let opened = handover::open_gate(app, drop, true).await;
    if opened != Opening::Open {
        tracing::warn!(drop = %drop.name, ?opened, "the rebuild after a lost join did not end now");
    }
}

/// Settles a join its sidecar never finished: the ledger's row (claimed for its
/// attempt first) says whether it landed.
async fn resolve_join(app: &App, drop: &Drop, key: &str, entry: &Entry) -> Result<(), Failure> {
    let join = Join {
        key,
        user: &entry.user,
        quantity: entry.quantity,
        variant: entry.variant.as_deref(),
        position: entry.position,
        attempt: &entry.attempt,
        // (A join given up on is written as abandoned, whatever it was decided on.)
        decided_on: None,
        stock_if_first: None,
    };
    let row = app
        .ledger
        .give_up_join(&drop.ledger_key(), key, &entry.attempt, join)
        .await
        .map_err(|e| {
            Failure::retry(format!(
                "an earlier join with this key is unsettled and the ledger cannot be asked ({e}): retry the same key"
            ))
        })?;
    let mut conn = app.redis.clone();
    let settled = if row.attempt == entry.attempt && row.state == WaitState::Waiting {
        line::joined(&mut conn, &drop.keys, app.ledger.id(), key, &entry.attempt).await
    } else {
        line::unjoin(&mut conn, &drop.keys, app.ledger.id(), key, &entry.attempt).await
    };
    settled
        .map(|_| ())
        .map_err(|e| redis_failure(app, drop, &drop.config(), &e))
}

/// The entry of `key` in Redis (the gate checked first; `None`: no entry), or why
/// it cannot be read.
async fn entry_of(app: &App, drop: &Drop, key: &str) -> Result<Option<Entry>, Failure> {
    let mut reopened = false;
    let mut rechecked = false;
    loop {
        let (config, redis) = ready(app, drop).await?;
        let mut conn = app.redis.clone();
        let said = line::look(&mut conn, &drop.keys, app.ledger.id(), key)
            .await
            .map_err(|e| redis_failure(app, drop, &config, &e))?;
        // Perhaps another Redis than the one checked: checked again, then read anew.
        if !redis_still_checked(app, drop, redis) {
            if rechecked {
                return Err(redis_changed(drop));
            }
            rechecked = true;
            continue;
        }
        match said {
            Said::Entry(_, entry) => return Ok(Some(entry)),
            Said::NoEntry => return Ok(None),
            Said::Closed if !reopened => {
                reopened = true;
                reopen(app, drop, false).await?;
            }
            other => {
                return match refused(app, drop, other).await {
                    Ok(_) => Err(Failure::unavailable("the waitlist answered out of turn")),
                    Err(failure) => Err(failure),
                };
            }
        }
    }
}

/// What an entry's state answers.
async fn standing(app: &App, drop: &Drop, key: &str, entry: Entry) -> Result<Waiting, Failure> {
    match entry.state {
        EntryState::Joining => Err(Failure::retry(
            "this key's join is being recorded: retry shortly",
        )),
        EntryState::Waiting => {
            // The ledger's word on a buyer who left while Redis missed it.
            if let Ok(Some(WaitRow {
                state: WaitState::Left,
                ..
            })) = app.ledger.waiting_entry(&drop.ledger_key(), key).await
            {
                follow_leave(app, drop, key).await;
                return Ok(Waiting::Left);
            }
            Ok(Waiting::AlreadyWaiting(place_of(&entry)))
        }
        EntryState::Offering => Ok(Waiting::AlreadyWaiting(place_of(&entry))),
        EntryState::Offered => offered(app, drop, key).await,
        EntryState::Left => Ok(Waiting::Left),
    }
}

/// A served entry's reservation, as a look-up of its key finds it.
async fn offered(app: &App, drop: &Drop, key: &str) -> Result<Waiting, Failure> {
    let served = super::settle(app, &drop.name, key, Settle::Lookup).await?;
    match served.outcome.view() {
        Some(view) => Ok(Waiting::Offered(view.clone())),
        None => Err(Failure::retry(
            "this entry was offered a hold that is still being recorded: retry shortly",
        )),
    }
}

/// The answer for what a script said that is not an entry.
async fn refused(app: &App, drop: &Drop, said: Said) -> Result<Waiting, Failure> {
    Ok(match said {
        Said::KeyReused => Waiting::KeyReused,
        Said::Disabled => Waiting::Disabled,
        Said::VariantMissing => Waiting::VariantRefused(VariantRefusal::Missing),
        Said::VariantUnexpected(v) => Waiting::VariantRefused(VariantRefusal::Unexpected(v)),
        Said::UnknownVariant(v) => Waiting::VariantRefused(VariantRefusal::Unknown(v)),
        Said::NotOpen(starts_at_ms) => Waiting::NotOpen { starts_at_ms },
        Said::Ended(ends_at_ms) => Waiting::Ended { ends_at_ms },
        Said::PerUserLimit { held, limit } => Waiting::PerUserLimit { held, limit },
        Said::Full { limit } => Waiting::Full { limit },
        Said::NoEntry => Waiting::NotFound,
        Said::UnknownDrop => {
            return Err(Failure::retry(format!(
                "drop {}'s config is not in Redis right now: nothing was changed; retry",
                drop.name
            )));
        }
        Said::OffGate(Mode::FailOpen) => return Err(off_gate(drop)),
        Said::OffGate(_) => return Err(super::closed(drop)),
        Said::Closed => return Err(being_rebuilt(drop)),
        Said::Foreign(ledger) if ledger.is_empty() => return Err(being_rebuilt(drop)),
        Said::Foreign(ledger) => return Err(foreign_ledger(app, drop, &ledger).await),
        other => {
            tracing::error!(drop = %drop.name, ?other, "a waitlist script answered out of turn");
            return Err(Failure::unavailable(
                "the waitlist answered something this sidecar did not ask: nothing was changed",
            ));
        }
    })
}

/// The config to act on once the Redis gate decides the drop and is in line with
/// the ledger: the lines are kept there.
async fn ready(app: &App, drop: &Drop) -> Result<(DropConfig, Checked), Failure> {
    for _ in 0..2 {
        let config = drop.config();
        match choose(app, drop, &config) {
            Choice::Gate => {}
            Choice::Fallback(_) => return Err(off_gate(drop)),
            Choice::Refused(failure) => return Err(failure),
        }
        match checked::<()>(app, drop, &config).await {
            Ok(redis) => return Ok((config, redis)),
            Err(Turn::Reopen { suspect }) => reopen(app, drop, suspect).await?,
            // (A check answers neither of these; checked again all the same.)
            Err(Turn::Recheck | Turn::Done(Ok(()))) => {}
            Err(Turn::Reroute(Choice::Refused(failure)) | Turn::Done(Err(failure))) => {
                return Err(failure);
            }
            Err(Turn::Reroute(_)) => return Err(off_gate(drop)),
        }
    }
    Err(being_rebuilt(drop))
}

async fn reopen(app: &App, drop: &Drop, suspect: bool) -> Result<(), Failure> {
    match handover::open_gate(app, drop, suspect).await {
        Opening::Open | Opening::NotGate(_) => Ok(()),
        Opening::Busy => Err(being_rebuilt(drop)),
        Opening::Awaiting => Err(Failure::retry(
            HandoverError::Awaiting(drop.name.clone()).to_string(),
        )),
        Opening::Refused(why) => Err(Failure::unavailable(why)),
    }
}

/// While the drop is off the Redis gate: the lines wait for it.
fn off_gate(drop: &Drop) -> Failure {
    Failure::retry(format!(
        "drop {} is on its fallback gate and the waitlist is kept on the Redis gate: nothing was changed; retry once the gate is back",
        drop.name
    ))
}

fn redis_failure(
    app: &App,
    drop: &Drop,
    config: &DropConfig,
    error: &redis::RedisError,
) -> Failure {
    match redis_failed(app, drop, config, error) {
        Choice::Refused(failure) => failure,
        _ => Failure::retry(format!(
            "Redis failed ({error}) and the waitlist is kept on the Redis gate: nothing was changed; retry"
        )),
    }
}
