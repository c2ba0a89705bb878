//! Moving a drop between its two gates, one authority at a time.
//!
//! The ledger's authority row (see [`crate::ledger::authority`]) says who decides
//! admissions; Redis's gate key says whether the gate is open and at which epoch.
//! This module is the only one that moves either:
//!
//! - [`open_gate`]: the gate opens (or reopens after the fallback, or after Redis
//!   lost data) only once Redis holds everything the ledger recorded: the ledger
//!   first moves to `replaying` at a new epoch (refusing every change from an older
//!   one), the gate is closed in Redis, every recorded reservation is replayed
//!   forward into Redis, the change counter is raised past the ledger's, and only
//!   then does Redis open at the new epoch.
//! - [`hand_to_ledger`]: the fallback gate takes over (kill switch, or a Redis
//!   outage that no peer sharing the ledger can see past), after the gate was closed
//!   in Redis where Redis is reachable.
//! - [`check`]: the refresh loop's look for evidence that Redis is behind the
//!   ledger (its gate key gone, its change counter below the ledger's), which
//!   starts a rebuild; and its note that this sidecar reached Redis.
//!
//! A sale has one ledger (see [`dropgate_api::DropKeys::ledger`]): the first sidecar
//! to open its gate or hand it to the ledger claims it for its own ledger, and only
//! sidecars of that ledger move the drop, rebuild it or fall back for it. A ledger
//! that is not the sale's holds only part of it (per-pod ledgers on several
//! replicas, a ledger added mid-sale): its fallback could oversell and its rebuild
//! would be partial, so it refuses both, and the gate refuses its changes.

use dropgate_api::Mode;

use crate::app::App;
use crate::clock::now_ms;
use crate::drops::{Drop, LookupError};
use crate::gate::{self, Claim, Closing, Opened, Replay};
use crate::ledger::{Authority, Holder, LastChange, LedgerError};
use crate::reservation::{State, Stock};

/// Why the gate could not be opened or checked.
#[derive(Debug, thiserror::Error)]
pub enum HandoverError {
    #[error("Redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    #[error(transparent)]
    Config(#[from] LookupError),
    #[error("drop {0} is no longer published")]
    Unpublished(String),
    /// The sale is recorded by another ledger than this sidecar's.
    #[error("{}", foreign_sale(.drop, .ledger))]
    Foreign { drop: String, ledger: String },
    /// This ledger's claim of the sale is not recorded by the operator yet.
    #[error(
        "drop {0}'s sale waits for the operator to record its ledger (the first seconds of a sale): retry"
    )]
    Awaiting(String),
    /// Redis's config changed under a rebuild or a look at the gate (re-created,
    /// or lost and re-seeded): deciding now could skip rows or compare another
    /// sale's numbers; the next attempt starts over afresh.
    #[error(
        "drop {0}'s config changed in Redis (re-created, or published again) while it was checked: retry"
    )]
    ConfigChanged(String),
    /// The refresh found the gate behind and could not open it; the sentence says
    /// why (it was logged where it happened).
    #[error("{0}")]
    NotOpened(String),
}

/// How an attempt to open the gate ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Opening {
    /// The gate is open at the ledger's epoch: use it.
    Open,
    /// The drop is not on the gate any more (the operator's mode changed).
    NotGate(Mode),
    /// Another sidecar is bringing Redis in line right now.
    Busy,
    /// This ledger's claim of the sale waits for the operator to record it (the
    /// first seconds of a sale): ask again soon.
    Awaiting,
    /// It cannot be opened from here; the sentence says why.
    Refused(String),
}

/// Rows replayed per ledger read during a rebuild.
const REBUILD_BATCH: i64 = 512;
/// A replay that has not finished this long after it began was abandoned (its
/// sidecar died): another sidecar may start over at a new epoch.
const REPLAY_ABANDONED_MS: i64 = 10_000;
/// How long a rebuild spends taking back unrecorded admissions, well within
/// [`REPLAY_ABANDONED_MS`]: a huge pending set would otherwise hold the gate closed
/// until another sidecar starts over. What is left then goes back through the
/// sweepers at each admission's bound, as it would without the rebuild.
const TAKE_BACK_BUDGET: std::time::Duration = std::time::Duration::from_secs(4);

/// Opens the gate of `drop` if it is closed or behind the ledger. With `suspect`
/// (a sidecar saw Redis hand out a change number or a place in line twice, or lose
/// a join the ledger had just recorded) Redis is rebuilt even if its counters look
/// in line.
///
/// Requests that wait here together share one opening that began after they came
/// (see [`crate::drops::Openings`]).
pub async fn open_gate(app: &App, drop: &Drop, suspect: bool) -> Opening {
    let seen = drop.openings.seen();
    let _one_at_a_time = drop.handover.lock().await;
    // A suspicion still waiting for its rebuild makes any opening one (its
    // standing finds Redis behind), and the opening records it as one.
    let suspect = suspect || drop.openings.still_suspect();
    if drop.openings.opened_since(seen, suspect) {
        return Opening::Open;
    }
    let ticket = drop.openings.begin();
    let era = app.redis_era(drop);
    match try_open(app, drop, suspect).await {
        Ok(Opening::Open) => {
            drop.verified
                .store(era, std::sync::atomic::Ordering::Release);
            drop.openings.opened(ticket, suspect);
            Opening::Open
        }
        Ok(opening) => opening,
        Err(HandoverError::Awaiting(_)) => {
            tracing::debug!(drop = %drop.name, "the sale's ledger claim waits for the operator to record it");
            Opening::Awaiting
        }
        Err(why) => {
            tracing::warn!(drop = %drop.name, %why, "the gate could not be opened");
            Opening::Refused(why.to_string())
        }
    }
}

async fn try_open(app: &App, drop: &Drop, suspect: bool) -> Result<Opening, HandoverError> {
    let mut conn = app.redis.clone();
    // The operator may have moved the drop off the gate: read its config afresh.
    let config = match app.drops.refresh(&mut conn, &drop.name).await {
        Ok(Some(_)) => drop.config(),
        Ok(None) => return Err(HandoverError::Unpublished(drop.name.clone())),
        Err(e) => return Err(e.into()),
    };
    if config.mode != Mode::Gate {
        return Ok(Opening::NotGate(config.mode));
    }
    let key = drop.ledger_key();
    // Only the sale's ledger opens its gate; the first to get here makes it its own.
    require_sale(app, drop, &key).await?;
    let standing = standing(app, drop, &key).await?;
    let redis_behind = suspect || standing.redis_behind();
    let Standing {
        authority,
        ledger_seq,
        gate,
        gate_floor,
        redis_seq,
        ..
    } = standing;
    let now = now_ms();

    if let (Some(a), Some(g)) = (&authority, gate)
        && a.holder != Holder::Ledger
        && a.epoch == g
        && !redis_behind
    {
        if a.holder == Holder::Replaying {
            // Redis opened at this epoch after its replay: only the bookkeeping
            // was left (or its sidecar died just before it).
            let _ = app.ledger.finish_replay(&key, g).await;
        }
        return Ok(Opening::Open);
    }
    if let Some(a) = &authority
        && a.holder == Holder::Replaying
        && now - a.changed_at_ms < REPLAY_ABANDONED_MS
        && gate != Some(a.epoch)
        // A replay whose epoch Redis was closed past can never open: not busy.
        && gate_floor <= a.epoch
    {
        return Ok(Opening::Busy);
    }
    let lost = authority.is_some() && (gate.is_none() || redis_behind);
    let Some(epoch) = app
        .ledger
        .begin_replay(&key, authority.as_ref(), gate_floor, now)
        .await?
    else {
        return Ok(Opening::Busy);
    };
    tracing::info!(drop = %drop.name, epoch, lost, ?gate, redis_seq, ledger_seq, ?authority, "bringing Redis in line with the ledger");
    if let Closing::Foreign(ledger) =
        gate::close(&mut conn, &drop.keys, app.ledger.id(), epoch).await?
    {
        return Err(foreign(drop, ledger));
    }
    rebuild(app, drop, &key, epoch).await?;
    let ledger_seq = app.ledger.max_seq(&key).await?;
    match gate::open(&mut conn, &drop.keys, app.ledger.id(), epoch, ledger_seq).await? {
        Opened::Unpublished => return Err(HandoverError::Unpublished(drop.name.clone())),
        Opened::Foreign(ledger) => return Err(foreign(drop, ledger)),
        // The authority moved past this replay's epoch meanwhile (the fallback
        // took the drop): this opening is stale, and the next starts afresh.
        Opened::Fenced => return Ok(Opening::Busy),
        Opened::Opened | Opened::AlreadyOpen => {}
    }
    if !app.ledger.finish_replay(&key, epoch).await? {
        // The authority moved past this replay meanwhile (another sidecar took the
        // drop over, or the fallback did): the gate opened here is stale. Closed
        // again for this epoch; the next attempt starts afresh.
        gate::close(&mut conn, &drop.keys, app.ledger.id(), epoch).await?;
        return Ok(Opening::Busy);
    }
    Ok(Opening::Open)
}

/// Where a drop stands in the ledger and in Redis.
struct Standing {
    authority: Option<Authority>,
    /// The highest change number the ledger recorded.
    ledger_seq: i64,
    /// The epoch the gate is open at in Redis.
    gate: Option<i64>,
    /// The lowest epoch the gate may next open at, less one (see
    /// [`gate::GateKey::floor`]).
    gate_floor: i64,
    /// Redis's change counter.
    redis_seq: i64,
    /// Whether Redis lost joins the ledger recorded (see [`has_every_join`]): joins
    /// carry no change number, so this is how a Redis that lost only joins shows.
    lines_behind: bool,
    /// Whether Redis lacks the last change the ledger recorded (see
    /// [`has_change`]).
    last_change_missing: bool,
    /// Whether a call found Redis had lost a write and its rebuild has not been
    /// made yet (see [`crate::drops::Openings::suspect`]).
    suspected: bool,
}

impl Standing {
    /// Whether Redis lost writes the ledger recorded.
    fn redis_behind(&self) -> bool {
        self.redis_seq < self.ledger_seq
            || self.lines_behind
            || self.last_change_missing
            || self.suspected
    }
}

/// Reads where the drop stands, the ledger first: every number it holds was handed
/// out by Redis before it was recorded, so Redis read afterwards is at least as far
/// unless it lost writes.
///
/// Redis's numbers are compared only with the ledger rows of the sale they belong
/// to: a drop re-created since `key` was taken has a new sale whose counters start
/// afresh, and read against the old sale's rows they would look like a Redis that
/// lost writes (and force a needless rebuild). The config is read again then, and
/// the next look starts over.
async fn standing(app: &App, drop: &Drop, key: &str) -> Result<Standing, HandoverError> {
    let authority = app.ledger.authority(key).await?;
    let ledger_seq = app.ledger.max_seq(key).await?;
    let last_change = app.ledger.last_change(key).await?;
    let ledger_positions = app.ledger.max_position(key).await?;
    let last_join = app.ledger.last_join(key).await?;
    let mut conn = app.redis.clone();
    let redis = gate::standing(
        &mut conn,
        &drop.keys,
        last_change.as_ref().map(|last| last.key.as_str()),
        last_join.as_deref(),
    )
    .await?;
    if let Some(sale) = &redis.sale
        && drop.ledger_key_of(sale) != key
    {
        app.drops.refresh(&mut conn, &drop.name).await?;
        return Err(HandoverError::ConfigChanged(drop.name.clone()));
    }
    Ok(Standing {
        authority,
        ledger_seq,
        gate: redis.gate.open_at,
        gate_floor: redis.gate.floor(),
        redis_seq: redis.seq,
        lines_behind: !has_every_join(&Joins {
            ledger_positions,
            ledger_has_joins: last_join.is_some(),
            redis_positions: redis.positions,
            redis_has_last: redis.last_join_sale.as_deref()
                == Some(dropgate_api::keys::ledger_sale(key)),
        }),
        last_change_missing: last_change
            .is_some_and(|last| !has_change(&last, redis.marker.as_ref(), now_ms())),
        suspected: drop.openings.still_suspect(),
    })
}

/// How far this sidecar's clock may be from Redis's (which sets the markers'
/// expiry) when an absent marker is judged: an hour.
const CLOCKS_APART_MS: i64 = 3_600_000;

/// Whether Redis has the ledger's last change `last` of a sale, by its key's
/// `marker`. Redis writes a drop's changes in the order it numbers them, and a
/// replica holds a prefix of its primary's writes: one that has the last change
/// has every change before it. The change counter alone can be fooled: a promoted
/// replica that missed one change hands that change's number out again, to any
/// key, and its counter then reads as far as the ledger's. So the marker must
/// carry the change's number, or a later one, in a state at least as far as the
/// ledger's, or have that change prepared by the attempt the ledger names. A
/// change prepared under a later number proves nothing: a replica that lost the
/// change hands its number, and later ones, out again. A marker Redis no longer
/// keeps (past its hold's deadline by [`gate::MARKER_KEPT_MS`],
/// less [`CLOCKS_APART_MS`]) tells nothing, and the counter decides alone.
fn has_change(last: &LastChange, marker: Option<&gate::MarkerSeen>, now_ms: i64) -> bool {
    // A state's place on the way forward; an admission waiting for its activation
    // is as far as the hold the ledger recorded for it.
    let rank = |state: State| match state {
        State::Pending | State::Active => 1,
        State::Expired => 2,
        State::Confirmed => 3,
        State::Cancelled => 4,
    };
    match marker {
        None => {
            now_ms
                >= last
                    .expires_at_ms
                    .saturating_add(gate::MARKER_KEPT_MS - CLOCKS_APART_MS)
        }
        Some(marker) => {
            // A change at or past the ledger's last one is built on it only if it
            // left the reservation at least as far (no change moves one back):
            // a replica that lost a confirm and then expired the hold under a
            // later number did not build on the confirm. Nor is an expiry of a
            // hold the ledger keeps past the deadline it expired at: the replica
            // lost an extension, and expired the hold by its old deadline.
            let expired_early = marker.state == Some(State::Expired)
                && rank(last.state) == rank(State::Active)
                && last.expires_at_ms > marker.expires_at_ms;
            let as_far = marker
                .state
                .is_some_and(|state| rank(state) >= rank(last.state));
            // The change itself, prepared and not finished yet: the ledger names
            // the attempt that prepared it (a replica re-using the number gives
            // it to another attempt).
            let prepared = marker.settle_seq == last.seq
                && last.changed_by.is_some()
                && marker.settle_attempt == last.changed_by;
            // An admission waiting for its activation is the ledger's only if it
            // is the attempt the ledger recorded: a replica that lost the
            // admission admits a retry of its key afresh, pending, perhaps under
            // the same number, and would read as in line until it is undone.
            let other_admission = marker.state == Some(State::Pending)
                && (last.attempt.is_none() || marker.attempt != last.attempt);
            prepared || (marker.seq >= last.seq && as_far && !expired_early && !other_admission)
        }
    }
}

/// Whether Redis has every join the ledger recorded: its position counter is as
/// far as the highest position the ledger holds (`ledger_positions`, given-up joins
/// included), and it holds this sale's entry for the last key the ledger recorded
/// joining (`last_join`), whatever became of it since. The counter alone can be
/// fooled, as the change counter can: a promoted replica that lost a join hands
/// its position out again (to a join then taken back, which leaves the counter
/// where it is) and reads as far as the ledger. (Only the entry's presence is
/// asked: the replay leaves an entry in line where it stands, so a position test it
/// cannot make true would rebuild for ever. A position handed out again to a join
/// the ledger is asked to record is refused there, see
/// `service::waitlist::make_durable`.)
fn has_every_join(joins: &Joins) -> bool {
    joins.redis_positions >= joins.ledger_positions
        && (!joins.ledger_has_joins || joins.redis_has_last)
}

/// What [`has_every_join`] compares.
struct Joins {
    /// The highest position the ledger recorded (given-up joins included).
    ledger_positions: i64,
    /// Whether the ledger recorded any join (not given up on).
    ledger_has_joins: bool,
    /// Redis's position counter.
    redis_positions: i64,
    /// Whether Redis holds this sale's entry for the ledger's last join.
    redis_has_last: bool,
}

/// Makes this sidecar's ledger the sale's if the sale has none yet, or finds that it
/// is another's. The ledger remembers whose it is: to fall back when Redis cannot be
/// asked, and to give the answer back to a Redis that lost it.
async fn claim_sale(app: &App, drop: &Drop, key: &str) -> Result<Claim, HandoverError> {
    let remembered = app.ledger.sale_ledger(key).await?;
    let candidate = remembered.as_deref().unwrap_or(app.ledger.id());
    let mut conn = app.redis.clone();
    let claimed = gate::claim(&mut conn, &drop.keys, app.ledger.id(), candidate).await?;
    note_claim(app, drop, &claimed);
    match &claimed {
        Claim::Mine => {
            app.ledger
                .note_sale_ledger(key, app.ledger.id(), now_ms())
                .await?
        }
        Claim::Foreign(ledger) if !ledger.is_empty() => {
            app.ledger.note_sale_ledger(key, ledger, now_ms()).await?
        }
        Claim::Foreign(_) | Claim::Awaiting | Claim::Unpublished => {}
    }
    Ok(claimed)
}

/// [`claim_sale`], as the gate may be opened: only when it is this ledger's.
async fn require_sale(app: &App, drop: &Drop, key: &str) -> Result<(), HandoverError> {
    match claim_sale(app, drop, key).await? {
        Claim::Mine => Ok(()),
        // Another ledger's claim not recorded yet: whose the sale is shows soon.
        Claim::Foreign(ledger) if ledger.is_empty() => {
            Err(HandoverError::Awaiting(drop.name.clone()))
        }
        Claim::Foreign(ledger) => Err(foreign(drop, ledger)),
        Claim::Awaiting => Err(HandoverError::Awaiting(drop.name.clone())),
        Claim::Unpublished => Err(HandoverError::Unpublished(drop.name.clone())),
    }
}

/// What this sidecar learnt of whose the sale is: for `/metrics`, and said once in
/// the log when it finds the sale another ledger's.
pub(crate) fn note_claim(app: &App, drop: &Drop, claim: &Claim) {
    // A claim by another ledger that is not recorded yet names nobody.
    let foreign = matches!(claim, Claim::Foreign(ledger) if !ledger.is_empty());
    let gauge = app
        .metrics
        .foreign_ledger
        .get_or_create(&crate::metrics::DropLabel {
            drop: drop.name.clone(),
        });
    if gauge.set(i64::from(foreign)) == 0
        && let Claim::Foreign(ledger) = claim
    {
        tracing::error!(drop = %drop.name, sale_ledger = %ledger, ledger = %app.ledger.id(), "{}", foreign_sale(&drop.name, ledger));
    }
}

fn foreign(drop: &Drop, ledger: String) -> HandoverError {
    HandoverError::Foreign {
        drop: drop.name.clone(),
        ledger,
    }
}

pub(super) fn foreign_sale(drop: &str, ledger: &str) -> String {
    format!(
        "drop {drop}'s sale is recorded by another ledger ({ledger}) than this sidecar's: a ledger \
         that sees only part of a sale could neither rebuild it nor fall back for it without \
         overselling, so nothing of it is changed here (give every replica that serves the drop \
         the same PostgreSQL ledger; a per-pod SQLite ledger serves a sale from one pod only)"
    )
}

/// Replays every reservation the ledger recorded for the drop into Redis, forward
/// only: what Redis already has as far or further is left alone. Then takes back
/// the admissions Redis holds as pending that the ledger does not have: the epoch
/// moved, so their commits are refused from now on, and a Redis that came back with
/// them (a restart, a failover to a replica that missed their undo) would otherwise
/// hold their units until their bound.
#[tracing::instrument(level = "debug", name = "rebuild", skip_all, fields(dropgate.drop = %drop.name))]
async fn rebuild(app: &App, drop: &Drop, key: &str, epoch: i64) -> Result<usize, HandoverError> {
    let mut conn = app.redis.clone();
    let mut after = String::new();
    let mut replayed = 0;
    loop {
        let rows = app
            .ledger
            .recorded_after(key, &after, REBUILD_BATCH)
            .await?;
        let Some(last) = rows.last() else {
            take_back_unrecorded(app, drop, key, epoch).await?;
            return Ok(replayed + replay_waitlist(app, drop, key).await?);
        };
        after = last.key.clone();
        for row in &rows {
            match gate::replay(&mut conn, &drop.keys, app.ledger.id(), row, key).await? {
                Replay::OtherSale => return Err(HandoverError::ConfigChanged(drop.name.clone())),
                Replay::Foreign(ledger) => return Err(foreign(drop, ledger)),
                Replay::Replayed => replayed += 1,
                Replay::InLine => {}
            }
            app.ledger.mark_replayed(key, &row.key, row.state).await?;
        }
    }
}

/// Puts the waitlist's lines back from the ledger, forward only, after the
/// reservations (an offer the ledger recorded is a reservation by then), each
/// entry at its recorded position: the order survives a Redis that lost it.
async fn replay_waitlist(app: &App, drop: &Drop, key: &str) -> Result<usize, HandoverError> {
    let mut conn = app.redis.clone();
    let sale = dropgate_api::keys::ledger_sale(key);
    let mut after = String::new();
    let mut replayed = 0;
    loop {
        let rows = app.ledger.entries_after(key, &after, REBUILD_BATCH).await?;
        let Some(last) = rows.last() else {
            // Past the joins given up on too, which are not replayed: the
            // counter must read as far as every position the ledger holds.
            let positions = app.ledger.max_position(key).await?;
            if let gate::waitlist::Said::Foreign(ledger) =
                gate::waitlist::raise_positions(&mut conn, &drop.keys, app.ledger.id(), positions)
                    .await?
            {
                return Err(foreign(drop, ledger));
            }
            return Ok(replayed);
        };
        after = last.key.clone();
        for row in &rows {
            match gate::waitlist::replay(&mut conn, &drop.keys, app.ledger.id(), row, sale).await? {
                gate::waitlist::Said::OtherSale => {
                    return Err(HandoverError::ConfigChanged(drop.name.clone()));
                }
                gate::waitlist::Said::Foreign(ledger) => return Err(foreign(drop, ledger)),
                gate::waitlist::Said::Entry(gate::waitlist::Word::Replayed, _) => replayed += 1,
                _ => {}
            }
        }
    }
}

/// Takes back every pending admission Redis holds that the ledger has no
/// reservation for (see [`rebuild`]).
async fn take_back_unrecorded(
    app: &App,
    drop: &Drop,
    key: &str,
    epoch: i64,
) -> Result<(), HandoverError> {
    let mut conn = app.redis.clone();
    // Every listed key (however many), then each looked at. (A key listed after
    // the scan began is not of this epoch's making: the gate is closed for it.)
    let until = std::time::Instant::now() + TAKE_BACK_BUDGET;
    for pending in gate::all_unresolved(&mut conn, &drop.keys).await? {
        if std::time::Instant::now() > until {
            tracing::info!(drop = %drop.name, "the rebuild's time to take back unrecorded admissions is spent: the sweepers take back the rest at their bound");
            break;
        }
        if let Some(gate::Unresolved::Admission(gate::PendingAdmission { attempt, .. })) =
            gate::unresolved(&mut conn, &drop.keys, &pending).await?
            && app.ledger.reservation(key, &pending).await?.is_none()
        {
            gate::undo_for_rebuild(
                &mut conn,
                &drop.keys,
                app.ledger.id(),
                &pending,
                &attempt,
                epoch,
            )
            .await?;
        }
    }
    Ok(())
}

/// Replays the ledger's changes Redis has not seen (an activation that failed
/// after its admission was recorded), forward only.
pub async fn replay_unseen(app: &App, drop: &Drop) -> Result<usize, HandoverError> {
    let key = drop.ledger_key();
    let mut conn = app.redis.clone();
    let rows = app.ledger.unreplayed(&key, REBUILD_BATCH).await?;
    for row in &rows {
        if let Replay::Foreign(ledger) =
            gate::replay(&mut conn, &drop.keys, app.ledger.id(), row, &key).await?
        {
            return Err(foreign(drop, ledger));
        }
        app.ledger.mark_replayed(&key, &row.key, row.state).await?;
    }
    Ok(rows.len())
}

/// Why the fallback gate is wanted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// The operator put the drop on the fallback (kill switch, or HA missing).
    Mode,
    /// This sidecar cannot reach Redis and the failure policy is Open.
    Outage,
}

/// Why the ledger may not decide for a drop.
#[derive(Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The operator has the drop on the gate again: this sidecar's view was stale.
    BackOnGate,
    /// The sentence says why.
    Refused(String),
}

/// Makes the ledger the drop's authority, or says why it may not be. The ledger
/// may decide only when it is the sale's ledger (Redis says so, or said so before
/// when Redis cannot be asked now); for the operator's mode, only when the config read
/// afresh still says so; for an outage, only when no sidecar sharing the ledger
/// reached Redis lately.
pub async fn hand_to_ledger(app: &App, drop: &Drop, reason: Reason) -> Result<Authority, Refusal> {
    let refused = |e: &dyn std::fmt::Display| Refusal::Refused(e.to_string());
    let _one_at_a_time = drop.handover.lock().await;
    // Whatever happens below, an earlier opening no longer speaks for the gate.
    drop.openings.forget();
    let key = drop.ledger_key();
    let mut conn = app.redis.clone();
    let current = app.ledger.authority(&key).await.map_err(|e| refused(&e))?;
    match require_sale(app, drop, &key).await {
        Ok(()) => {}
        Err(HandoverError::Redis(_)) if app.ledger.owns(&key).await.map_err(|e| refused(&e))? => {
            // Redis cannot be asked: a ledger Redis once named the sale's holds all
            // of it (no other ledger can have changed it since).
        }
        Err(HandoverError::Redis(error)) => {
            return Err(Refusal::Refused(format!(
                "Redis is unreachable ({error}) and this sidecar's ledger was never named drop {}'s: \
                 it cannot tell whether another ledger holds part of the sale, so it sells nothing \
                 until Redis answers",
                drop.name
            )));
        }
        Err(other) => return Err(refused(&other)),
    }
    if let Some(current) = current.as_ref().filter(|a| a.holder == Holder::Ledger) {
        return Ok(current.clone());
    }
    let now = now_ms();
    // A sidecar that reaches Redis is bringing it in line right now: its rebuild may
    // outlast the quiet period, and the gate it opens would not hold the changes
    // the fallback made meanwhile.
    if reason == Reason::Outage
        && let Some(replaying) = current.as_ref().filter(|a| {
            a.holder == Holder::Replaying && now - a.changed_at_ms < REPLAY_ABANDONED_MS
        })
    {
        return Err(Refusal::Refused(format!(
            "drop {} is being brought in line in Redis by another sidecar ({replaying}): nothing is sold until it is done or given up",
            drop.name
        )));
    }
    let quiet_since = match reason {
        Reason::Mode => match app.drops.refresh(&mut conn, &drop.name).await {
            Ok(Some(fresh)) if fresh.config().mode == Mode::Gate => {
                return Err(Refusal::BackOnGate);
            }
            Ok(_) => {
                // Stop Redis changing anything before the ledger decides, closed for
                // the epoch the ledger takes below, so that no sidecar that began
                // reopening the gate before this move can open it after. A gate
                // reopened at a later epoch than that is left open, and this
                // hand-over is refused (the ledger's row moved on too).
                let epoch = current.as_ref().map_or(0, |a| a.epoch) + 1;
                match gate::close(&mut conn, &drop.keys, app.ledger.id(), epoch).await {
                    Ok(Closing::Closed) => {}
                    Ok(Closing::Reopened) => {
                        return Err(Refusal::Refused(format!(
                            "drop {}'s gate was reopened by another sidecar meanwhile: retry",
                            drop.name
                        )));
                    }
                    Ok(Closing::Foreign(ledger)) => return Err(refused(&foreign(drop, ledger))),
                    Err(e) => return Err(refused(&e)),
                }
                None
            }
            // Redis cannot be asked: the outage rule decides.
            Err(_) => Some(now - app.quiet_ms),
        },
        Reason::Outage => Some(now - app.quiet_ms),
    };
    if let Some(since) = quiet_since
        && (app.breaker(Some(drop)).reached_at() > since
            || current.as_ref().is_some_and(|a| a.changed_at_ms > since))
    {
        return Err(Refusal::Refused(format!(
            "Redis failed for drop {} a moment after it answered: nothing is sold until it answers again or stays away for {} ms",
            drop.name, app.quiet_ms
        )));
    }
    let config = drop.config();
    let after = app
        .ledger
        .hand_to_ledger(
            &key,
            &Stock::of(&config),
            now,
            current.as_ref(),
            quiet_since,
        )
        .await
        .map_err(|e| refused(&e))?;
    if after.holder != Holder::Ledger {
        return Err(Refusal::Refused(format!(
            "this sidecar cannot reach Redis but other sidecars of drop {} can: it sells nothing until it reaches Redis again",
            drop.name
        )));
    }
    tracing::warn!(drop = %drop.name, epoch = after.epoch, ?reason, "the ledger's fallback gate decides admissions");
    Ok(after)
}

/// How Redis stands against the ledger for one drop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verified {
    /// The gate is open at the ledger's epoch and Redis's change counter is not
    /// below the ledger's highest number.
    InLine,
    /// Redis's change counter is below the ledger's highest number: it lost writes.
    Behind,
    /// The gate is not open at the ledger's epoch (closed, being opened, or moved
    /// on): opening it decides.
    NotOpen,
}

/// How Redis stands against the ledger for `drop`; in line, the drop counts as
/// checked for the Redis era this began in.
pub async fn verify(app: &App, drop: &Drop) -> Result<Verified, HandoverError> {
    let era = app.redis_era(drop);
    // Checked at this era meanwhile (by another call): nothing to do again,
    // unless a loss was found since that waits for its rebuild.
    if drop.verified.load(std::sync::atomic::Ordering::Acquire) == era
        && !drop.openings.still_suspect()
    {
        return Ok(Verified::InLine);
    }
    let key = drop.ledger_key();
    let standing = standing(app, drop, &key).await?;
    if standing.redis_behind() {
        return Ok(Verified::Behind);
    }
    let Standing {
        authority, gate, ..
    } = standing;
    if !matches!((&authority, gate), (Some(a), Some(g)) if a.holder == Holder::Gate && a.epoch == g)
    {
        return Ok(Verified::NotOpen);
    }
    drop.verified
        .store(era, std::sync::atomic::Ordering::Release);
    Ok(Verified::InLine)
}

/// The refresh loop's look at one drop on the gate: notes that this sidecar reached
/// Redis, replays what Redis has not seen, and rebuilds Redis when it is behind the
/// ledger (or opens it, claiming the sale, when it was never opened).
pub async fn check(app: &App, drop: &Drop) -> Result<(), HandoverError> {
    // One read of the config for the key and the terms noted under it: a refresh
    // meanwhile (a request's look at the gate) may move the drop to a new sale.
    let config = drop.config();
    let key = drop.ledger_key_of(&config.sale);
    let now = now_ms();
    let era = app.redis_era(drop);
    app.ledger
        .note_gate_seen(&key, &app.sidecar_id, now)
        .await?;
    // Apart from the note above, so that a busy stock row never costs this
    // sidecar its say that Redis answers.
    if let Err(error) = app.ledger.note_config(&key, &Stock::of(&config)).await {
        tracing::debug!(drop = %drop.name, %error, "the config read was not noted in the ledger");
    }
    let standing = standing(app, drop, &key).await?;
    let behind = standing.redis_behind();
    let Standing {
        authority, gate, ..
    } = standing;
    let in_line = matches!((&authority, gate), (Some(a), Some(g)) if a.holder == Holder::Gate && a.epoch == g);
    if behind || !in_line {
        match open_gate(app, drop, behind).await {
            Opening::Refused(why) => return Err(HandoverError::NotOpened(why)),
            Opening::Awaiting => return Err(HandoverError::Awaiting(drop.name.clone())),
            _ => {}
        }
        return Ok(());
    }
    // Standing was read after `era` began: Redis is in line for it.
    drop.verified
        .store(era, std::sync::atomic::Ordering::Release);
    replay_unseen(app, drop).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: i64 = 1_000_000_000_000;

    fn last(state: State) -> LastChange {
        LastChange {
            key: "k".into(),
            seq: 10,
            state,
            expires_at_ms: NOW,
            changed_by: Some("a".into()),
            attempt: Some("admission".into()),
        }
    }

    /// A marker with a change numbered `settle_seq` prepared by attempt "a".
    fn marker(seq: i64, settle_seq: i64, state: State) -> gate::MarkerSeen {
        gate::MarkerSeen {
            seq,
            settle_seq,
            settle_attempt: (settle_seq > 0).then(|| "a".into()),
            state: Some(state),
            expires_at_ms: NOW,
            attempt: Some("admission".into()),
        }
    }

    #[test]
    fn a_marker_with_the_last_change_has_it() {
        let cancelled = last(State::Cancelled);
        assert!(has_change(
            &cancelled,
            Some(&marker(10, 0, State::Cancelled)),
            NOW
        ));
        // Changed again since (a refund of a confirmed hold), or the change itself
        // prepared by the attempt the ledger names.
        assert!(has_change(
            &last(State::Confirmed),
            Some(&marker(11, 0, State::Cancelled)),
            NOW
        ));
        assert!(has_change(
            &cancelled,
            Some(&marker(9, 10, State::Active)),
            NOW
        ));
        // An admission the ledger recorded, waiting for its activation in Redis.
        assert!(has_change(
            &last(State::Active),
            Some(&marker(10, 0, State::Pending)),
            NOW
        ));
    }

    #[test]
    fn a_replica_that_missed_the_last_change_lacks_it() {
        let cancelled = last(State::Cancelled);
        assert!(!has_change(
            &cancelled,
            Some(&marker(7, 0, State::Active)),
            NOW
        ));
        // It handed the missed number out again, to an expiry of the same key.
        assert!(!has_change(
            &cancelled,
            Some(&marker(10, 0, State::Expired)),
            NOW
        ));
        // It lost an extension of the hold, and expired it by its old deadline
        // under the extension's number.
        let extended = LastChange {
            expires_at_ms: NOW + 600_000,
            ..last(State::Active)
        };
        assert!(!has_change(
            &extended,
            Some(&marker(10, 0, State::Expired)),
            NOW
        ));
        // It lost a confirm, handed its number to another key, and expired the
        // hold under the next one.
        assert!(!has_change(
            &last(State::Confirmed),
            Some(&marker(11, 0, State::Expired)),
            NOW
        ));
        // It handed the number out again to a cancel prepared by another attempt
        // (a retry of the cancel it lost), or prepared a change past it.
        let retried = gate::MarkerSeen {
            settle_attempt: Some("b".into()),
            ..marker(9, 10, State::Active)
        };
        assert!(!has_change(&cancelled, Some(&retried), NOW));
        assert!(!has_change(
            &cancelled,
            Some(&marker(9, 11, State::Active)),
            NOW
        ));
        // It lost the admission and admitted a retry of its key afresh, pending
        // under the admission's number.
        let readmitted = gate::MarkerSeen {
            attempt: Some("retry".into()),
            ..marker(10, 0, State::Pending)
        };
        assert!(!has_change(&last(State::Active), Some(&readmitted), NOW));
        // It never saw the key at all.
        assert!(!has_change(&cancelled, None, NOW));
    }

    #[test]
    fn a_replica_that_lost_the_last_join_lacks_it() {
        let joins = |ledger_positions, ledger_has_joins, redis_positions, redis_has_last| Joins {
            ledger_positions,
            ledger_has_joins,
            redis_positions,
            redis_has_last,
        };
        // In line: no join yet, or the last join's entry is there (and the counter
        // as far, or further).
        assert!(has_every_join(&joins(0, false, 0, false)));
        assert!(has_every_join(&joins(2, true, 2, true)));
        assert!(has_every_join(&joins(3, true, 4, true)));
        // The counter behind the ledger.
        assert!(!has_every_join(&joins(2, true, 1, true)));
        // The counter as far (its position handed out again), the entry lost.
        assert!(!has_every_join(&joins(2, true, 2, false)));
    }

    #[test]
    fn a_marker_redis_no_longer_keeps_tells_nothing() {
        let week_later = NOW + gate::MARKER_KEPT_MS;
        assert!(has_change(&last(State::Confirmed), None, week_later));
    }
}
