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
//! A per-pod (SQLite) ledger holds only its own pod's sales: once another ledger has
//! been seen admitting for the drop, its fallback would oversell and its rebuild would
//! be partial, so it refuses both and the drop is closed on this sidecar instead.

use dropgate_api::Mode;

use crate::app::App;
use crate::clock::now_ms;
use crate::drops::{Drop, LookupError};
use crate::gate::{self, Closing, Gate, Opened, Replay};
use crate::ledger::{Authority, Holder, LedgerError};

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
    /// Redis lost a sale that no ledger can rebuild (see [`lost_sale`]).
    #[error("{}", lost_sale(.0))]
    LostSale(String),
    /// Redis's config changed under a rebuild (re-created, or lost and re-seeded):
    /// opening now could skip rows; the next attempt starts over afresh.
    #[error("drop {0}'s config changed in Redis during its rebuild: retrying")]
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
    /// It cannot be opened from here; the sentence says why.
    Refused(String),
}

/// Rows replayed per ledger read during a rebuild.
const REBUILD_BATCH: i64 = 512;
/// A replay that has not finished this long after it began was abandoned (its
/// sidecar died): another sidecar may start over at a new epoch.
const REPLAY_ABANDONED_MS: i64 = 10_000;

/// Opens the gate of `drop` if it is closed or behind the ledger. With `suspect`
/// (a sidecar saw Redis hand out a change number twice) Redis is rebuilt even if
/// its counter looks in line.
pub async fn open_gate(app: &App, drop: &Drop, suspect: bool) -> Opening {
    let _one_at_a_time = drop.handover.lock().await;
    match try_open(app, drop, suspect).await {
        Ok(opening) => opening,
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
    let Standing {
        authority,
        ledger_seq,
        gate,
        redis_seq,
    } = standing(app, drop, &key).await?;
    let redis_behind = suspect || redis_seq < ledger_seq;
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
    {
        return Ok(Opening::Busy);
    }
    let lost = authority.is_some() && (gate.is_none() || redis_behind);
    if lost && app.ledger.is_per_pod() && app.ledger.has_peers(&key).await? {
        // No ledger can rebuild the sale; a ledger new to it could not even tell
        // that it was lost. The tombstone keeps every sidecar's gate closed.
        gate::condemn(&mut conn, &drop.keys).await?;
        return Err(HandoverError::LostSale(drop.name.clone()));
    }

    // A gate opened by a sidecar with another ledger (per-pod ledgers), on a Redis
    // that lost nothing: join its epoch after replaying this ledger's own rows.
    if let Some(g) = gate
        && authority.as_ref().is_none_or(|a| a.epoch < g)
        && !redis_behind
    {
        let begun = app
            .ledger
            .begin_replay(&key, authority.as_ref(), g - 1, now)
            .await?;
        let Some(epoch) = begun else {
            return Ok(Opening::Busy);
        };
        rebuild(app, drop, &key).await?;
        app.ledger.finish_replay(&key, epoch).await?;
        return Ok(Opening::Open);
    }

    let floor = gate.unwrap_or(0);
    let Some(epoch) = app
        .ledger
        .begin_replay(&key, authority.as_ref(), floor, now)
        .await?
    else {
        return Ok(Opening::Busy);
    };
    tracing::info!(drop = %drop.name, epoch, lost, ?gate, redis_seq, ledger_seq, ?authority, "bringing Redis in line with the ledger");
    if gate::close(&mut conn, &drop.keys, epoch).await? == Closing::Lost {
        return Err(HandoverError::LostSale(drop.name.clone()));
    }
    rebuild(app, drop, &key).await?;
    let ledger_seq = app.ledger.max_seq(&key).await?;
    match gate::open(&mut conn, &drop.keys, epoch, ledger_seq).await? {
        Opened::Unpublished => return Err(HandoverError::Unpublished(drop.name.clone())),
        Opened::Lost => return Err(HandoverError::LostSale(drop.name.clone())),
        Opened::Opened | Opened::AlreadyOpen => {}
    }
    app.ledger.finish_replay(&key, epoch).await?;
    Ok(Opening::Open)
}

/// Where a drop stands in the ledger and in Redis.
struct Standing {
    authority: Option<Authority>,
    /// The highest change number the ledger recorded.
    ledger_seq: i64,
    /// The epoch the gate is open at in Redis.
    gate: Option<i64>,
    /// Redis's change counter.
    redis_seq: i64,
}

/// Reads where the drop stands, the ledger first: every number it holds was handed
/// out by Redis before it was recorded, so Redis read afterwards is at least as far
/// unless it lost writes. The tombstone refuses.
async fn standing(app: &App, drop: &Drop, key: &str) -> Result<Standing, HandoverError> {
    let authority = app.ledger.authority(key).await?;
    let ledger_seq = app.ledger.max_seq(key).await?;
    let mut conn = app.redis.clone();
    let (gate, redis_seq) = gate::standing(&mut conn, &drop.keys).await?;
    if gate == Gate::Lost {
        return Err(HandoverError::LostSale(drop.name.clone()));
    }
    Ok(Standing {
        authority,
        ledger_seq,
        gate: gate.epoch(),
        redis_seq,
    })
}

fn lost_sale(drop: &str) -> String {
    format!(
        "Redis lost writes of drop {} and its record is spread over per-pod ledgers, none of which \
         holds the whole sale: its gate stays closed rather than sell units it may not have \
         (settle its reservations from the ledgers, then re-create the drop as a new sale; \
         use a shared PostgreSQL ledger to survive this)",
        drop
    )
}

/// Replays every reservation the ledger recorded for the drop into Redis, forward
/// only: what Redis already has as far or further is left alone.
#[tracing::instrument(level = "debug", name = "rebuild", skip_all, fields(dropgate.drop = %drop.name))]
async fn rebuild(app: &App, drop: &Drop, key: &str) -> Result<usize, HandoverError> {
    let mut conn = app.redis.clone();
    let mut after = String::new();
    let mut replayed = 0;
    loop {
        let rows = app
            .ledger
            .recorded_after(key, &after, REBUILD_BATCH)
            .await?;
        let Some(last) = rows.last() else {
            return Ok(replayed);
        };
        after = last.key.clone();
        for row in &rows {
            match gate::replay(&mut conn, &drop.keys, row, key).await? {
                Replay::OtherSale => return Err(HandoverError::ConfigChanged(drop.name.clone())),
                Replay::Replayed => replayed += 1,
                Replay::InLine => {}
            }
            app.ledger.mark_replayed(key, &row.key, row.state).await?;
        }
    }
}

/// Replays the ledger's changes Redis has not seen (an activation that failed
/// after its admission was recorded), forward only.
pub async fn replay_unseen(app: &App, drop: &Drop) -> Result<usize, HandoverError> {
    let key = drop.ledger_key();
    let mut conn = app.redis.clone();
    let rows = app.ledger.unreplayed(&key, REBUILD_BATCH).await?;
    for row in &rows {
        gate::replay(&mut conn, &drop.keys, row, &key).await?;
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
/// may decide only when it holds the whole sale (not a per-pod ledger among
/// others); for the operator's mode, only when the config read afresh still says
/// so; for an outage, only when no sidecar sharing the ledger reached Redis lately.
pub async fn hand_to_ledger(app: &App, drop: &Drop, reason: Reason) -> Result<Authority, Refusal> {
    let refused = |e: &dyn std::fmt::Display| Refusal::Refused(e.to_string());
    let _one_at_a_time = drop.handover.lock().await;
    let key = drop.ledger_key();
    let mut conn = app.redis.clone();
    let current = app.ledger.authority(&key).await.map_err(|e| refused(&e))?;
    if app.ledger.is_per_pod() {
        // A per-pod ledger holds the whole sale only if its sidecar sells alone: no
        // other ledger ever registered for the drop, as seen by a registration
        // now (of two sidecars registering, the later sees the earlier).
        let registered = match gate::register(&mut conn, &drop.keys, app.ledger.id()).await {
            Ok(ledgers) => {
                say_per_pod_peers(app, drop, &ledgers);
                app.ledger
                    .note_peers(&key, &ledgers)
                    .await
                    .map_err(|e| refused(&e))?;
                true
            }
            Err(_) => false,
        };
        // Without a registration now (Redis unreachable) a per-pod ledger cannot
        // know that no pod joined the sale since its last look: a Redis outage
        // closes the drop on it rather than risk selling beside a gate.
        let alone = registered
            && reason == Reason::Mode
            && !app.ledger.has_peers(&key).await.map_err(|e| refused(&e))?;
        if !alone {
            return Err(Refusal::Refused(format!(
                "this sidecar's ledger is per pod and it cannot know that it sells drop {} alone: \
                 its fallback gate could oversell, so nothing is sold here until Redis gates again \
                 (use a shared PostgreSQL ledger)",
                drop.name
            )));
        }
    }
    if let Some(current) = current.as_ref().filter(|a| a.holder == Holder::Ledger) {
        return Ok(current.clone());
    }
    let now = now_ms();
    let quiet_since = match reason {
        Reason::Mode => match app.drops.refresh(&mut conn, &drop.name).await {
            Ok(Some(fresh)) if fresh.config().mode == Mode::Gate => {
                return Err(Refusal::BackOnGate);
            }
            Ok(_) => {
                // Stop Redis changing anything before the ledger decides. A gate
                // reopened at a later epoch than the ledger knows is left open, and
                // the hand-over below is then refused by the ledger's row.
                let epoch = current.as_ref().map_or(0, |a| a.epoch);
                gate::close(&mut conn, &drop.keys, epoch)
                    .await
                    .map_err(|e| refused(&e))?;
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
        .hand_to_ledger(&key, config.limit, config.generation, now, quiet_since)
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

/// The refresh loop's look at one drop on the gate: notes that this sidecar reached
/// Redis, registers its ledger and remembers the other ones serving the drop,
/// replays what Redis has not seen, and rebuilds Redis when it is behind the
/// ledger.
pub async fn check(app: &App, drop: &Drop) -> Result<(), HandoverError> {
    let key = drop.ledger_key();
    let mut conn = app.redis.clone();
    let now = now_ms();
    app.ledger
        .note_gate_seen(&key, &app.sidecar_id, now)
        .await?;
    let ledgers = gate::register(&mut conn, &drop.keys, app.ledger.id()).await?;
    say_per_pod_peers(app, drop, &ledgers);
    app.ledger.note_peers(&key, &ledgers).await?;
    let Standing {
        authority,
        ledger_seq,
        gate,
        redis_seq,
    } = standing(app, drop, &key).await?;
    let in_line = matches!((&authority, gate), (Some(a), Some(g)) if a.holder == Holder::Gate && a.epoch == g);
    if redis_seq < ledger_seq || !in_line {
        if let Opening::Refused(why) = open_gate(app, drop, redis_seq < ledger_seq).await {
            return Err(HandoverError::NotOpened(why));
        }
        return Ok(());
    }
    if in_line {
        replay_unseen(app, drop).await?;
    }
    Ok(())
}

/// A per-pod (SQLite) ledger that finds other ledgers registered for the drop
/// says so loudly, once per change of their number, and in the metric
/// `dropgate_sidecar_per_pod_ledger_peers`: other replicas sell the drop (or this
/// pod sold it before a restart that lost its emptyDir), and a per-pod fallback
/// then closes the drop on a Redis outage instead of failing open (use one
/// PostgreSQL ledger for all replicas).
fn say_per_pod_peers(app: &App, drop: &Drop, ledgers: &[String]) {
    if !app.ledger.is_per_pod() {
        return;
    }
    let peers = ledgers.iter().filter(|l| *l != app.ledger.id()).count() as i64;
    let gauge = app
        .metrics
        .per_pod_ledger_peers
        .get_or_create(&crate::metrics::DropLabel {
            drop: drop.name.clone(),
        });
    let before = gauge.set(peers);
    if before != peers && peers > 0 {
        tracing::warn!(
            drop = %drop.name,
            peers,
            "this sidecar keeps a per-pod SQLite ledger, and {peers} other ledger(s) registered for this drop (other replicas, or this pod before a restart that lost its ledger): its fallback path is per pod, so a Redis outage closes the drop instead of failing open; give the replicas one PostgreSQL ledger (--database-url postgres://...)"
        );
    }
}
