//! The reservation service: reserve, confirm, cancel and look-up, between the HTTP
//! routes and storage. It knows no HTTP: it answers an [`Outcome`] and the gate
//! that decided it, or a [`Failure`] when nothing could be decided.
//!
//! Each attempt chooses its gate once ([`choose`]): the drop's mode, then the Redis
//! breaker, then, after a Redis failure, the drop's failure policy. The Redis gate
//! may send the call elsewhere (Redis failed, the mode changed in Redis) or ask for
//! the gate to be opened first (closed, or behind the ledger); [`decide`] runs that
//! loop for every call alike.
//!
//! - [`admit`]: reserve on either gate.
//! - [`settle`]: confirm, cancel and look-up on either gate.
//! - [`cart`]: several lines held, confirmed and cancelled as one, each line a
//!   reservation of its drop.
//! - [`record`]: what the Redis gate decided, recorded in the ledger.
//! - [`handover`]: moving a drop between its two gates (opening the gate after a
//!   replay or rebuild, handing it to the ledger), and the refresh's check.
//! - [`waitlist`]: joining a sold-out drop's line, and the offers made from it.

pub(crate) mod admit;
pub mod cart;
pub mod handover;
pub mod record;
mod settle;
pub mod waitlist;

use std::sync::Arc;

use dropgate_api::{DropConfig, FailurePolicy, Mode};

pub use admit::reserve;
pub use settle::{
    BUYER_LOOKUP_MAX, Bought, landed, made_by_another, reservations_of, settle, settle_for,
};

use crate::app::App;
use crate::drops::{Drop, LookupError};
use crate::gate;
use crate::reservation::Outcome;
use handover::{Opening, Reason};

/// How long an admission may stay pending: its permit wait, then the ledger's
/// commit deadline. Past it the admission is one its sidecar never finished, and a
/// retry or a sweeper resolves it.
pub(crate) fn pending_bound_ms(config: &DropConfig) -> u64 {
    config.acquire_timeout_ms + crate::ledger::COMMIT_DEADLINE_MS
}

/// Slack beyond a bound for another request's change of the same key to finish.
const IN_FLIGHT_GRACE: std::time::Duration = std::time::Duration::from_millis(250);

/// Waits between asks while another change of the same key is in flight: 2 ms first
/// (most finish within a group commit), doubling up to 50 ms (a slow one is not
/// worth a script call every 2 ms), never past the caller's deadline.
struct Backoff {
    next: std::time::Duration,
}

impl Backoff {
    const FIRST: std::time::Duration = std::time::Duration::from_millis(2);
    const MAX: std::time::Duration = std::time::Duration::from_millis(50);

    fn new() -> Self {
        Self { next: Self::FIRST }
    }

    async fn wait(&mut self, until: std::time::Instant) {
        let left = until.saturating_duration_since(std::time::Instant::now());
        tokio::time::sleep(self.next.min(left)).await;
        self.next = (self.next * 2).min(Self::MAX);
    }
}

/// Which gate decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// The Redis gate.
    Gate,
    /// The SQL ledger's fallback gate.
    Fallback,
}

/// What a call came to, and which gate decided it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Served {
    pub outcome: Outcome,
    pub path: Path,
}

/// Why nothing was decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Failure {
    /// No drop of that name is published in this sidecar's namespace.
    UnknownDrop { name: String, namespace: String },
    /// The call could not go on for want of a throttle permit, or of the key's
    /// own earlier attempt settling; `why` says which. Nothing was reserved.
    Throttled {
        permits: u32,
        why: Throttled,
        path: Path,
    },
    /// Neither gate could decide; the sentence says why, `retry` how to ask again.
    Unavailable {
        why: String,
        path: Path,
        retry: Retry,
    },
}

/// How a caller told "unavailable" asks again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retry {
    /// With the same key, once whatever failed is back.
    SameKey,
    /// With the same key, in a moment (a hand-over or a record in progress).
    SameKeySoon,
    /// With a new key: this one is spent (a cart whose held lines were given
    /// back; their keys are used).
    NewKey,
    /// With the same key, which learns how it went: a commit failed without
    /// saying whether it landed, and the ledger could not be asked, so the change
    /// may stand (it is resolved from the ledger's record once it answers).
    SameKeyToLearn,
    /// With the same key, which goes on with a change begun and recorded as under
    /// way, whose parts may stand (see [`UnderWay`]). With `outcome_unknown` a
    /// commit of it (a line's, or the cart's own record) may have landed unbeknown
    /// too. The sidecars' sweeper finishes it if nobody retries.
    SameKeyToGoOn {
        under_way: UnderWay,
        outcome_unknown: bool,
    },
}

/// A cart's change that is decided and under way (recorded so in the ledger)
/// when a failure stopped the attempt making it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnderWay {
    /// Its confirm, decided line by line, with this many lines confirmed so far.
    Confirm { lines_confirmed: usize },
    /// Its give-back (a cancel, or an expiry), some lines perhaps given back.
    GiveBack,
}

impl Failure {
    fn unavailable(why: impl Into<String>) -> Self {
        Failure::Unavailable {
            why: why.into(),
            path: Path::Gate,
            retry: Retry::SameKey,
        }
    }

    fn retry(why: impl Into<String>) -> Self {
        Failure::Unavailable {
            why: why.into(),
            path: Path::Gate,
            retry: Retry::SameKeySoon,
        }
    }

    /// A commit whose outcome could not be learnt: see [`Retry::SameKeyToLearn`].
    fn outcome_unknown(why: impl Into<String>) -> Self {
        Failure::Unavailable {
            why: why.into(),
            path: Path::Gate,
            retry: Retry::SameKeyToLearn,
        }
    }

    /// Whether the change this failure answers may have been made after all.
    pub fn may_stand(&self) -> bool {
        matches!(
            self,
            Failure::Unavailable {
                retry: Retry::SameKeyToLearn,
                ..
            }
        )
    }

    fn on_fallback(self) -> Self {
        match self {
            Failure::Throttled { permits, why, .. } => Failure::Throttled {
                permits,
                why,
                path: Path::Fallback,
            },
            Failure::Unavailable { why, retry, .. } => Failure::Unavailable {
                why,
                retry,
                path: Path::Fallback,
            },
            unknown @ Failure::UnknownDrop { .. } => unknown,
        }
    }

    fn throttled(config: &DropConfig, why: Throttled) -> Self {
        Failure::Throttled {
            permits: config.permits,
            why,
            path: Path::Gate,
        }
    }
}

/// Why a reserve was throttled (503 with Retry-After).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Throttled {
    /// Every permit of this sidecar is held by an unconfirmed reservation.
    NoPermit,
    /// An earlier attempt with this key is between admission and activation (on
    /// this sidecar or another, or left so by one that died): it is activated or
    /// taken back, or past its bound resolved from the ledger by the sweeper or a
    /// retry, within a few seconds.
    KeyInFlight,
    /// The admission's hold lapsed while it waited for its permit and its record.
    ExpiredWhileWaiting,
}

/// The drop a call names, or why it cannot be served.
pub async fn find_drop(app: &App, name: &str) -> Result<Arc<Drop>, Failure> {
    let unknown = || Failure::UnknownDrop {
        name: name.to_string(),
        namespace: app.drops.namespace().to_string(),
    };
    if !dropgate_api::keys::is_object_name(name) {
        return Err(unknown());
    }
    let mut conn = app.redis.clone();
    match app.drops.get(&mut conn, name).await {
        Ok(Some(drop)) => Ok(drop),
        Ok(None) => Err(unknown()),
        Err(LookupError::Unavailable(e))
            if !app.redis.is_cluster() && dropgate_redis::is_cluster_redirect(&e) =>
        {
            Err(not_started_as_cluster_client(name, &e))
        }
        Err(LookupError::Unavailable(e)) if dropgate_redis::is_not_a_cluster(&e) => {
            Err(started_as_cluster_client(name, &e))
        }
        Err(LookupError::Unavailable(e)) => Err(Failure::unavailable(format!(
            "Redis is unreachable and this sidecar has not seen drop {name} before: {e}"
        ))),
        Err(e @ LookupError::Damaged(_)) => Err(Failure::unavailable(format!(
            "drop {name} cannot be served: {e}"
        ))),
    }
}

/// A drop as its page shows it before the sale.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shown {
    pub config: DropConfig,
    /// What is left, as the gate deciding the drop counts it (unclamped).
    pub remaining: i64,
    /// Per variant of the config, in its order: name, limit, what is left.
    pub variants: Vec<(String, i64, i64)>,
}

impl Shown {
    /// `unsold`: a variant without a count has sold nothing (the ledger keeps a
    /// row only once a change told it of the variant; Redis seeds every one).
    fn of(config: DropConfig, left: gate::Left, unsold: bool) -> Self {
        let variants = config
            .variants
            .iter()
            .map(|v| {
                let missing = if unsold { v.quantity } else { 0 };
                // No more than the drop as a whole has left (what a reserve admits).
                let own = left.variants.get(&v.name).copied().unwrap_or(missing);
                (v.name.clone(), v.quantity, own.min(left.drop))
            })
            .collect();
        Self {
            remaining: left.drop,
            variants,
            config,
        }
    }
}

/// The drop `name` and what is left of it. Redis's count (pending admissions
/// included) while its gate is open and in line with the ledger; otherwise the
/// ledger's count of what is durable, which is the whole truth while nothing can be
/// admitted outside it: the gate closed (never opened, or being brought in line),
/// Redis behind the ledger (whatever it admits now is refused at its commit), or the
/// ledger deciding. A sidecar that cannot reach Redis while the gate may still be
/// admitting for others cannot say: `unavailable`.
pub async fn show(app: &App, name: &str) -> Result<Shown, Failure> {
    let drop = find_drop(app, name).await?;
    let config = drop.config();
    let ledger_count = async || -> Result<Shown, Failure> {
        let failed = |e| Failure::unavailable(format!("the ledger failed: {e}"));
        let (left, variants) = app
            .ledger
            .counts(&drop.ledger_key())
            .await
            .map_err(failed)?;
        let left = gate::Left {
            // No stock row yet: the ledger has sold nothing of it.
            drop: left.unwrap_or(config.limit),
            variants,
        };
        Ok(Shown::of(config.clone(), left, true))
    };
    if config.mode == Mode::FailOpen {
        return ledger_count().await;
    }
    let failed = match gate_count(app, &drop).await {
        Ok(Some(left)) => return Ok(Shown::of(config, left, false)),
        Ok(None) => return ledger_count().await,
        Err(e) => e,
    };
    app.breaker(Some(&drop)).failed(&failed);
    let ledger_decides = matches!(
        app.ledger.authority(&drop.ledger_key()).await,
        Ok(Some(authority)) if authority.holder == crate::ledger::Holder::Ledger
    );
    if config.failure_policy == FailurePolicy::Open && ledger_decides {
        return ledger_count().await;
    }
    Err(redis_down(&drop, &config, &failed))
}

/// What Redis has left of the drop when its gate is open and in line with the
/// ledger (checked against the ledger first after a Redis failure or a cluster
/// change); `None` when Redis's count is not the drop's now.
async fn gate_count(app: &App, drop: &Drop) -> redis::RedisResult<Option<gate::Left>> {
    for _ in 0..=RECHECKS {
        if app.breaker(Some(drop)).tripped().is_some() {
            return Err(redis::RedisError::from((
                redis::ErrorKind::Client,
                "Redis is unreachable (a connection failed within the last second)",
            )));
        }
        let redis = match check_redis(app, drop).await {
            Ok(Ok(redis)) => redis,
            Ok(Err(_)) => return Ok(None),
            Err(handover::HandoverError::Redis(e)) => return Err(e),
            Err(_) => return Ok(None),
        };
        let mut conn = app.redis.clone();
        let (open, remaining) = gate::open_count(&mut conn, &drop.keys).await?;
        app.breaker(Some(drop)).answered();
        if redis_still_checked(app, drop, redis) {
            return Ok(open.then_some(remaining));
        }
    }
    Err(redis::RedisError::from((
        redis::ErrorKind::Client,
        "Redis changed while it was asked (failovers or reconnects)",
    )))
}

/// Redis as one call found it checked against the ledger: the era (count of its
/// failures and reconnections, see [`App::redis_era`]) it was in line at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Checked(u64);

/// Redis checked against the ledger for `drop`: at once when it was found in line
/// since its last failure or reconnection, else by checking it now; the check's
/// verdict when it is not in line.
async fn check_redis(
    app: &App,
    drop: &Drop,
) -> Result<Result<Checked, handover::Verified>, handover::HandoverError> {
    let era = app.redis_era(drop);
    // (A loss found since the last check keeps every call checking until
    // Redis is rebuilt: see `drops::Openings::suspect`.)
    if drop.verified.load(std::sync::atomic::Ordering::Acquire) == era
        && !drop.openings.still_suspect()
    {
        return Ok(Ok(Checked(era)));
    }
    Ok(match handover::verify(app, drop).await? {
        // The era last found in line (this check's, or a later one's): a change
        // since fails the reply's test.
        handover::Verified::InLine => Ok(Checked(
            drop.verified.load(std::sync::atomic::Ordering::Acquire),
        )),
        other => Err(other),
    })
}

/// Whether the drop's Redis is still the one this call checked: no connection
/// failure or reconnection under it since. Asked once a gate script answered: a
/// failure of another call between this call's check and its script made the
/// client reconnect, and the reply may be a promoted replica's that missed the
/// last writes. Nothing such a reply decided stands: its caller takes back what
/// it prepared and checks Redis again ([`Turn::Recheck`]). The era is this
/// call's, not the drop's latest check: a reply sent into the new Redis before
/// another call found it in line (or rebuilt it) was read from it unchecked.
pub(crate) fn redis_still_checked(app: &App, drop: &Drop, checked: Checked) -> bool {
    app.redis_era(drop) == checked.0
}

/// Redis for `drop` when it may act on its own (the sweeper's expiries and
/// resolutions): checked against the ledger since its last failure, checking it
/// now if not. A Redis that answers after a failover may be a replica that missed
/// writes; an expiry it made of a hold the ledger has confirmed would stand. What
/// it then answers counts only while [`redis_still_checked`] holds.
pub(crate) async fn redis_checked(app: &App, drop: &Drop) -> Option<Checked> {
    check_redis(app, drop).await.ok()?.ok()
}

/// Before Redis answers for a drop after a failure (the Redis answering may be a
/// replica promoted in a failover, one that missed writes), it is checked against
/// the ledger: the Redis to go on with, else the turn to take (reopen it, or go
/// elsewhere).
async fn checked<T>(app: &App, drop: &Drop, config: &DropConfig) -> Result<Checked, Turn<T>> {
    match check_redis(app, drop).await {
        Ok(Ok(redis)) => Ok(redis),
        Ok(Err(handover::Verified::Behind)) => Err(Turn::Reopen { suspect: true }),
        Ok(Err(_)) => Err(Turn::Reopen { suspect: false }),
        Err(handover::HandoverError::Redis(e)) => {
            Err(Turn::Reroute(redis_failed(app, drop, config, &e)))
        }
        Err(other) => Err(Turn::Done(Err(Failure::retry(format!(
            "drop {} could not be checked against the ledger ({other}): nothing was changed; retry",
            drop.name
        ))))),
    }
}

/// Which gate decides an attempt.
enum Choice {
    Gate,
    Fallback(Reason),
    Refused(Failure),
}

/// The gate for an attempt: the drop's mode, then the Redis breaker, then (after a
/// Redis failure) the failure policy.
fn choose(app: &App, drop: &Drop, config: &DropConfig) -> Choice {
    match config.mode {
        Mode::FailOpen => Choice::Fallback(Reason::Mode),
        Mode::Closed => Choice::Refused(closed(drop)),
        Mode::Gate => match app.breaker(Some(drop)).tripped() {
            None => Choice::Gate,
            Some(unreachable) => after_redis_failure(app, drop, config, &unreachable),
        },
    }
}

/// The gate the config just read chooses for a call a gate sent to the fallback
/// for `reason`. A Redis failure that sent it there need not have opened the
/// breaker (an OOM or READONLY answer does not): back on the gate it would meet
/// that failure again and again, so after one it stays on the fallback, unless
/// the failure policy just read is Closed.
fn choose_again(app: &App, drop: &Drop, fresh: &DropConfig, reason: Reason) -> Choice {
    match choose(app, drop, fresh) {
        Choice::Gate if reason == Reason::Outage => match fresh.failure_policy {
            FailurePolicy::Open => Choice::Fallback(Reason::Outage),
            FailurePolicy::Closed => Choice::Refused(policy_closed(drop)),
        },
        other => other,
    }
}

/// Where an attempt goes when Redis failed under it.
fn after_redis_failure(
    app: &App,
    drop: &Drop,
    config: &DropConfig,
    error: &redis::RedisError,
) -> Choice {
    app.breaker(Some(drop)).failed(error);
    match config.failure_policy {
        FailurePolicy::Open => {
            // Per request, so debug: the breaker opening and the hand-over to the
            // ledger are what an operator needs to see, once each.
            tracing::debug!(drop = %drop.name, %error, "Redis failed: fallback path");
            Choice::Fallback(Reason::Outage)
        }
        FailurePolicy::Closed => Choice::Refused(redis_down(drop, config, error)),
    }
}

/// Where an attempt goes when its gate script failed: a reply this sidecar cannot
/// read is its own bug (a script and its parser out of step), not an outage, and
/// neither moves the drop to the fallback nor blames the network.
fn redis_failed(app: &App, drop: &Drop, config: &DropConfig, error: &redis::RedisError) -> Choice {
    // (On a cluster the client follows redirections; one that reaches here gave up.)
    if !app.redis.is_cluster() && dropgate_redis::is_cluster_redirect(error) {
        return Choice::Refused(not_started_as_cluster_client(&drop.name, error));
    }
    if dropgate_redis::is_not_a_cluster(error) {
        return Choice::Refused(started_as_cluster_client(&drop.name, error));
    }
    if error.kind() == redis::ErrorKind::Parse {
        tracing::error!(drop = %drop.name, %error, "a gate script's reply could not be read");
        return Choice::Refused(Failure::unavailable(format!(
            "the gate answered something this sidecar cannot read ({error}): nothing was decided here"
        )));
    }
    after_redis_failure(app, drop, config, error)
}

/// Not an outage: this sidecar talks to one node of a Redis Cluster as if it were
/// the whole Redis (it was started without `--redis-cluster`), and the node
/// redirected it. Nothing is decided here until it is started right.
fn not_started_as_cluster_client(drop: &str, error: &redis::RedisError) -> Failure {
    tracing::error!(%drop, %error, "Redis is a Redis Cluster: start the sidecar with --redis-cluster");
    Failure::unavailable(format!(
        "drop {drop}'s Redis is a Redis Cluster node that does not serve its keys ({error}): the sidecar needs --redis-cluster (DROPGATE_REDIS_CLUSTER=true); nothing was decided here"
    ))
}

/// Not an outage either: this sidecar was started with `--redis-cluster`, and its
/// Redis is one Redis.
fn started_as_cluster_client(drop: &str, error: &redis::RedisError) -> Failure {
    tracing::error!(%drop, %error, "Redis is no Redis Cluster: start the sidecar without --redis-cluster");
    Failure::unavailable(format!(
        "drop {drop}'s Redis is not a Redis Cluster ({error}): the sidecar must run without --redis-cluster; nothing was decided here"
    ))
}

/// The failure when Redis failed under a call that cannot go to the fallback.
fn redis_down(drop: &Drop, config: &DropConfig, error: &redis::RedisError) -> Failure {
    tracing::warn!(drop = %drop.name, %error, "Redis failed");
    match config.failure_policy {
        FailurePolicy::Closed => policy_closed(drop),
        FailurePolicy::Open => Failure::unavailable(format!(
            "Redis is unreachable for drop {}: {error}",
            drop.name
        )),
    }
}

/// Redis failed under a call on a drop whose failure policy is Closed.
fn policy_closed(drop: &Drop) -> Failure {
    Failure::unavailable(format!(
        "Redis failed for drop {}, whose failurePolicy is Closed: nothing is sold until it answers again",
        drop.name
    ))
}

/// A gate reply judged on an older config of this sidecar's sale than the one it
/// read there: Redis lost that change (a failover to a replica that missed it),
/// which the operator publishes again at its next reconcile. A stale view never
/// decides: the caller undoes what the reply prepared and answers this failure.
/// Only for generations the API server numbers: outside Kubernetes nothing
/// publishes a lost change again, and the sidecar's copy follows Redis's.
fn redis_lost_a_change(
    app: &App,
    drop: &Drop,
    config: &DropConfig,
    step: &gate::Step,
) -> Option<Failure> {
    if !config.published_by_operator() || step.sale.as_deref() != Some(config.sale.as_str()) {
        return None;
    }
    let generation = step.generation.filter(|g| *g < config.generation)?;
    count_decided_on_lost_config(app, drop);
    Some(Failure::retry(format!(
        "Redis holds an older config of drop {} (generation {generation}) than this sidecar read there (generation {}): it lost that change, and the operator publishes it again; nothing was changed: retry the same request",
        drop.name, config.generation
    )))
}

/// Counts an admission, extension or join taken back because Redis decided it on
/// a config it had lost.
pub(super) fn count_decided_on_lost_config(app: &App, drop: &Drop) {
    app.metrics
        .decided_on_lost_config
        .get_or_create(&crate::metrics::DropLabel {
            drop: drop.name.clone(),
        })
        .inc();
}

/// The failure for a drop the operator closed (HA missing under policy Closed).
fn closed(drop: &Drop) -> Failure {
    Failure::unavailable(format!(
        "drop {} is closed: its Redis is not highly available and the failure policy is Closed",
        drop.name
    ))
}

/// While another sidecar brings Redis in line with the ledger.
fn being_rebuilt(drop: &Drop) -> Failure {
    Failure::retry(format!(
        "drop {} is being brought in line with the ledger before its gate opens: nothing was changed; retry",
        drop.name
    ))
}

/// How a turn on the Redis gate ended.
enum Turn<T> {
    Done(Result<T, Failure>),
    /// Go elsewhere (Redis failed, or the drop left the gate).
    Reroute(Choice),
    /// The gate is closed or behind the ledger: open it and try again. `suspect`:
    /// Redis handed out a change number twice, rebuild it whatever it looks like.
    Reopen {
        suspect: bool,
    },
    /// The reply came from a Redis not checked against the ledger (the client
    /// reconnected under the call): nothing of it was kept; check Redis (which
    /// rebuilds it only if the check finds it behind) and try again.
    Recheck,
}

/// How many times one call goes back to checking Redis because the Redis under it
/// changed while it asked (see [`Turn::Recheck`]), or is sent back by the fallback
/// to the gate that sent it there, before it answers 503.
const RECHECKS: usize = 3;

/// A call on a reservation, as [`decide`] runs it.
#[derive(Clone, Copy)]
enum Call<'a> {
    Reserve(&'a crate::input::Reserve),
    Settle(&'a str, crate::reservation::Settle),
    /// The keys of a buyer's reservations, newest first, at most this many.
    Buyer(&'a str, usize),
}

/// Runs a call: on the gate its attempt chooses, reopening a closed gate once.
async fn decide(app: &App, drop: &Drop, call: Call<'_>) -> Result<Served, Failure> {
    let mut reopened = false;
    let mut rechecks = 0;
    let mut sent_back = 0;
    loop {
        let config = drop.config();
        let turn = match (choose(app, drop, &config), call) {
            (Choice::Gate, call) => match checked(app, drop, &config).await {
                Err(turn) => turn,
                Ok(redis) => {
                    if crate::faults::check(crate::faults::Fault::PauseAfterCheck).is_err() {
                        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
                    }
                    on_gate(app, drop, &config, redis, call).await
                }
            },
            (other, _) => Turn::Reroute(other),
        };
        match turn {
            Turn::Done(done) => {
                return done.map(|outcome| Served {
                    outcome,
                    path: Path::Gate,
                });
            }
            Turn::Reroute(Choice::Fallback(reason)) => {
                // `None`: the drop turned out to be back on the gate.
                let done = match call {
                    Call::Reserve(request) => admit::on_fallback(app, drop, request, reason).await,
                    Call::Settle(key, settle) => {
                        settle::on_fallback(app, drop, &config, key, settle, reason).await
                    }
                    Call::Buyer(user, limit) => {
                        settle::buyer_on_fallback(app, drop, user, limit, reason).await
                    }
                };
                if let Some(done) = done {
                    return done
                        .map(|outcome| Served {
                            outcome,
                            path: Path::Fallback,
                        })
                        .map_err(Failure::on_fallback);
                }
                // Each gate sent it to the other: the gate's script read the
                // drop's mode from a Redis config older than this sidecar's (a
                // failover lost the operator's change), and the fallback, reading
                // the newer, sent it back. Answered rather than bounced until the
                // operator publishes the config again.
                sent_back += 1;
                if sent_back > RECHECKS {
                    return Err(gate_and_fallback_disagree(drop));
                }
            }
            Turn::Reroute(Choice::Refused(failure)) => return Err(failure),
            Turn::Reroute(Choice::Gate) => {}
            Turn::Reopen { suspect } if !reopened => {
                reopened = true;
                match handover::open_gate(app, drop, suspect).await {
                    Opening::Open | Opening::NotGate(_) => {}
                    Opening::Busy => return Err(being_rebuilt(drop)),
                    Opening::Awaiting => {
                        return Err(Failure::retry(
                            handover::HandoverError::Awaiting(drop.name.clone()).to_string(),
                        ));
                    }
                    Opening::Refused(why) => return Err(Failure::unavailable(why)),
                }
            }
            Turn::Reopen { .. } => return Err(being_rebuilt(drop)),
            Turn::Recheck if rechecks < RECHECKS => rechecks += 1,
            Turn::Recheck => return Err(redis_changed(drop)),
        }
    }
}

/// The gate and the fallback sent the call to each other, again and again.
fn gate_and_fallback_disagree(drop: &Drop) -> Failure {
    Failure::retry(format!(
        "drop {}'s gate in Redis and this sidecar's config disagree on whether the gate decides (Redis holds an older config, until the operator publishes it again): nothing was changed; retry",
        drop.name
    ))
}

/// Redis changed under the call each time it asked (failovers, reconnects).
fn redis_changed(drop: &Drop) -> Failure {
    Failure::retry(format!(
        "drop {}'s Redis changed while this call was asking it (a failover or a reconnect): nothing was changed; retry",
        drop.name
    ))
}

/// One attempt at a call on the Redis gate, once Redis was checked against the
/// ledger.
async fn on_gate(
    app: &App,
    drop: &Drop,
    config: &DropConfig,
    redis: Checked,
    call: Call<'_>,
) -> Turn<Outcome> {
    match call {
        Call::Reserve(request) => admit::on_gate(app, drop, config, redis, request, false).await,
        Call::Settle(key, settle) => settle::on_gate(app, drop, config, redis, key, settle).await,
        Call::Buyer(user, limit) => {
            settle::buyer_on_gate(app, drop, config, redis, user, limit).await
        }
    }
}

/// Runs a fallback-gate call; when the ledger is not the drop's authority yet,
/// hands the drop to it (if it may be) and runs the call once more. `Ok(None)`: the
/// drop is back on the gate (this sidecar's view was stale), nothing was done.
async fn on_ledger<T, F, Fut>(
    app: &App,
    drop: &Drop,
    reason: Reason,
    call: F,
) -> Result<Option<T>, Failure>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T, crate::ledger::LedgerError>>,
{
    use crate::ledger::LedgerError;
    use handover::Refusal;
    let failed = |error: LedgerError| {
        Failure::unavailable(format!(
            "Redis is not gating drop {} and the ledger failed: {error}",
            drop.name
        ))
    };
    let stale = |error: LedgerError| match error {
        LedgerError::StaleConfig(_) => Failure::retry(format!(
            "the ledger holds a newer config of drop {} than this sidecar read: nothing was changed; retry",
            drop.name
        )),
        unknown @ LedgerError::CommitUnknown(_) => Failure::outcome_unknown(unknown.to_string()),
        other => failed(other),
    };
    match call().await {
        Err(LedgerError::NotAuthority(_)) => {
            match handover::hand_to_ledger(app, drop, reason).await {
                Ok(_) => {}
                Err(Refusal::BackOnGate) => return Ok(None),
                Err(Refusal::Refused(why)) => return Err(Failure::unavailable(why)),
            }
            call().await.map(Some).map_err(stale)
        }
        other => other.map(Some).map_err(stale),
    }
}

/// What Redis says of a drop's config when a fallback admission is decided.
pub(crate) enum Published {
    /// The config as the operator published it now (or this sidecar's copy, when
    /// that is newer).
    Now(Box<DropConfig>),
    /// Redis answers without this sale's config (it lost its data and the operator
    /// publishes it again, or the drop was deleted or re-created): nothing may be
    /// decided on an older copy.
    Missing,
    /// Redis cannot be asked: the config last read stands (this one, checked against
    /// the API server's drop when the sidecar watches it, or taken as it is with
    /// `--fallback-on-last-read-config`); the ledger's transaction then applies any
    /// newer terms a peer sharing it noted there.
    Kept(Box<DropConfig>),
    /// Redis cannot be asked, and the API server holds a newer spec of the drop than
    /// the config last read, or none, or its watch is not caught up (see
    /// [`crate::drop_watch`]), or nothing can check that config (no watch, no
    /// opt-in): nothing may be decided on it. Why, for the 503.
    Stale(String),
}

/// How long a fallback admission waits for Redis to say what the config is now.
const CONFIG_READ_BOUND: std::time::Duration = std::time::Duration::from_millis(150);
/// While the breaker is open, how long after a failed ask the next one is made
/// (the requests between decide on the last config read).
const CONFIG_PROBE_EVERY_MS: i64 = 250;

/// The drop's config as the operator published it now, read from Redis: what a
/// fallback admission is decided on, so that a limit cut, an endsAt moved into the
/// past or a pause published a moment ago is obeyed. Redis is asked even while the
/// breaker is open (each ask bounded by [`CONFIG_READ_BOUND`]; after an ask that
/// timed out, at most every [`CONFIG_PROBE_EVERY_MS`] per drop): a Redis that came back from a restart or a
/// failover, with the config published into it again, answers before the breaker
/// closes, and a cut published there must not be sold past on the copy this sidecar
/// read before. A config read is adopted as the drop's copy when it is of the same
/// sale and not older; the breaker is left alone (a read that answers says nothing
/// of whether the gate's writes would), and an empty or failed read changes nothing.
/// When Redis cannot be asked, the config last read stands only where something can
/// check it: a watch of the API server, or the operator's word that configs do not
/// change during an outage (`--fallback-on-last-read-config`); else nothing is
/// decided (a change published meanwhile would not be seen). Either way, a sidecar
/// that watches the API server (`--watch-drops`) decides only on a config of the
/// drop's sale (uid) at its current generation there (see [`crate::drop_watch`]):
/// a Redis that answers may be a replica that missed the change, and one that
/// cannot be asked may hold a change this sidecar never read.
async fn published_now(app: &App, drop: &Drop) -> Published {
    let published = match ask_redis(app, drop).await {
        Some(Published::Now(config)) => Published::Now(config),
        Some(other) => return other,
        None if app.drop_watch.is_none() && !app.fallback_on_last_read => {
            return Published::Stale(format!(
                "Redis cannot be asked for drop {}'s config, and this sidecar does not watch the API server (--watch-drops): a change the operator published meanwhile could not be seen, so nothing is decided on the copy last read (a sidecar whose sales' configs never change during an outage may be started with --fallback-on-last-read-config); retry",
                drop.name
            ));
        }
        // The copy read last (a refresh may have moved it since the caller read it).
        None => Published::Kept(Box::new(drop.config())),
    };
    let (Published::Now(config) | Published::Kept(config)) = &published else {
        return published;
    };
    if let Some(watch) = &app.drop_watch
        && let crate::drop_watch::Verdict::Stale(why) = watch.check(&drop.name, config).await
    {
        return Published::Stale(why);
    }
    published
}

/// What Redis answers of the drop's config now (see [`published_now`]); `None`: it
/// cannot be asked.
async fn ask_redis(app: &App, drop: &Drop) -> Option<Published> {
    use std::sync::atomic::Ordering;
    let now = crate::clock::now_ms();
    if app.breaker(Some(drop)).tripped().is_some()
        && now - drop.config_unreachable_at.load(Ordering::Acquire) < CONFIG_PROBE_EVERY_MS
    {
        return None;
    }
    let kept = drop.config();
    let mut conn = app.redis.clone();
    match tokio::time::timeout(
        CONFIG_READ_BOUND,
        app.drops.published(&mut conn, &drop.name),
    )
    .await
    {
        Ok(Ok(Some(config))) if config.sale != kept.sale => Some(Published::Missing),
        // Redis lost a change the copy holds (see `Drops::refresh`). (The ledger
        // too takes the higher generation for the newer, stamped ones included.)
        Ok(Ok(Some(config))) if config.generation < kept.generation => {
            Some(Published::Now(Box::new(kept)))
        }
        Ok(Ok(Some(config))) => {
            // The copy follows (a kill switch turned off sends the next attempt back
            // to the gate); the breaker does not (see above).
            drop.adopt(&config);
            Some(Published::Now(Box::new(config)))
        }
        Ok(Ok(None)) => Some(Published::Missing),
        // A refused or broken connection fails at once: the next admission asks
        // again (a Redis back from a restart answers it with the change published
        // again). Only a Redis that does not answer within the bound is left alone
        // for a while, so that it does not cost every admission the bound.
        Ok(Err(crate::drops::LookupError::Unavailable(_))) => None,
        // Redis answered a config this sidecar cannot read (damaged, or written by
        // an operator of a newer format): not one to decide on, nor a reason to
        // fall back on the copy.
        Ok(Err(damaged @ crate::drops::LookupError::Damaged(_))) => {
            Some(Published::Stale(format!(
                "drop {}'s config in Redis cannot be read ({damaged}): nothing is decided on an older copy; retry",
                drop.name
            )))
        }
        Err(_) => {
            drop.config_unreachable_at
                .store(crate::clock::now_ms(), Ordering::Release);
            None
        }
    }
}

/// The refusal for a sidecar whose ledger is not the sale's (`ledger`), as the gate
/// answered it.
async fn foreign_ledger(app: &App, drop: &Drop, ledger: &str) -> Failure {
    handover::note_claim(app, drop, &crate::gate::Claim::Foreign(ledger.to_string()));
    // Redis names another ledger the sale's: this one may no longer fall back for
    // it on its own word (it may have been the sale's before Redis lost the key).
    if !ledger.is_empty()
        && let Err(error) = app
            .ledger
            .note_sale_ledger(&drop.ledger_key(), ledger, crate::clock::now_ms())
            .await
    {
        tracing::warn!(drop = %drop.name, %error, "could not note the sale's ledger");
    }
    if ledger.is_empty() {
        return Failure::retry(format!(
            "drop {}'s sale has no recorded ledger in Redis yet (not claimed, or its claim waits for the operator to record it): nothing is changed; retry",
            drop.name
        ));
    }
    Failure::unavailable(handover::foreign_sale(&drop.name, ledger))
}
