//! The Redis gate: one atomic Lua script per operation, run by SHA.
//!
//! redis-rs's [`Script`] sends EVALSHA and, on NOSCRIPT (a restarted or failed-over
//! Redis that lost its script cache), loads the script and retries, so the scripts
//! survive a Redis restart without a sidecar restart.
//!
//! `prelude.lua` holds what several scripts share (the key layout, Redis's clock,
//! returning units, expiring a due hold, refusing a caller whose ledger is not the
//! sale's, preparing a confirm or cancel); it is concatenated in front of each script
//! at compile time, so each script stays one atomic EVALSHA.

use std::sync::LazyLock;

use dropgate_api::DropKeys;
use dropgate_redis::Connection;
use redis::{RedisResult, Script};
use tracing::Instrument;

use crate::input::CartMode;
use crate::ledger::Recorded;
use crate::reservation::State;

/// A gate script and the name its client span has.
struct GateScript {
    script: Script,
    /// `EVALSHA <script>`: what one call is called in a trace.
    span: &'static str,
}

macro_rules! gate_script {
    ($name:literal) => {
        LazyLock::new(|| GateScript {
            script: Script::new(concat!(
                include_str!("prelude.lua"),
                "begin(KEYS, ARGV)\n",
                include_str!(concat!($name, ".lua"))
            )),
            span: concat!("EVALSHA ", $name),
        })
    };
}

/// The batch form of a script: its body, unchanged, as a function that
/// `batch.lua` runs once per request.
macro_rules! batch_script {
    ($name:literal) => {
        LazyLock::new(|| GateScript {
            script: Script::new(concat!(
                include_str!("prelude.lua"),
                "local function one(KEYS, ARGV)\nbegin(KEYS, ARGV)\n",
                include_str!(concat!($name, ".lua")),
                "\nend\n",
                include_str!("batch.lua")
            )),
            span: concat!("EVALSHA ", $name),
        })
    };
}

static RESERVE: LazyLock<GateScript> = gate_script!("reserve");
static RESERVES: LazyLock<GateScript> = batch_script!("reserve");
static CONFIRM: LazyLock<GateScript> = gate_script!("confirm");
static CANCEL: LazyLock<GateScript> = gate_script!("cancel");
static EXTEND: LazyLock<GateScript> = gate_script!("extend");
static LOOKUP: LazyLock<GateScript> = gate_script!("lookup");
static EXPIRE: LazyLock<GateScript> = gate_script!("expire");
static UNDO: LazyLock<GateScript> = gate_script!("undo");
static ACTIVATE: LazyLock<GateScript> = gate_script!("activate");
static ACTIVATES: LazyLock<GateScript> = batch_script!("activate");
static REPLAY: LazyLock<GateScript> = gate_script!("replay");
static OPEN: LazyLock<GateScript> = gate_script!("open");
static ABANDON: LazyLock<GateScript> = gate_script!("abandon");
static CLOSE: LazyLock<GateScript> = gate_script!("close");
static CLAIM: LazyLock<GateScript> = gate_script!("claim");
static FINISH: LazyLock<GateScript> = gate_script!("finish");
static ABORT: LazyLock<GateScript> = gate_script!("abort");

mod batcher;
mod reply;
pub mod waitlist;

pub use batcher::Batcher;
pub use reply::{
    Activation, Claim, Closing, Expiry, Finished, Opened, Prepare, Replay, Reply, Step,
};
use reply::{Call, Wire};

/// Runs `script` on the drop's keys (every script gets the same twelve, so each call
/// stays in the drop's hash slot) for a sidecar of `ledger`, as one client span.
async fn run(
    script: &GateScript,
    conn: &mut Connection,
    keys: &DropKeys,
    ledger: &str,
    key: &str,
    args: &[&str],
) -> RedisResult<Wire> {
    Wire::parse(invoke(script, conn, keys, ledger, key, args).await?)
}

/// [`run`] without reading the reply (the waitlist's scripts answer their own).
async fn invoke(
    script: &GateScript,
    conn: &mut Connection,
    keys: &DropKeys,
    ledger: &str,
    key: &str,
    args: &[&str],
) -> RedisResult<String> {
    let mut invocation = script.script.key(keys.config());
    invocation
        .key(keys.remaining())
        .key(keys.held())
        .key(keys.buyers())
        .key(keys.holds())
        .key(keys.reservation(key))
        .key(keys.gate())
        .key(keys.seq())
        .key(keys.ledger())
        .key(keys.pending())
        .key(keys.variants())
        .key(keys.by_buyer())
        .arg(key)
        .arg(ledger);
    for arg in args {
        invocation.arg(*arg);
    }
    let span = client_span(script, 1);
    let called = invocation.invoke_async(conn).instrument(span.clone()).await;
    failed_on(&span, called)
}

/// One call's client span; `requests` is how many requests it decides (more than
/// one for a batch).
fn client_span(script: &GateScript, requests: usize) -> tracing::Span {
    let span = tracing::debug_span!(
        "EVALSHA",
        otel.name = script.span,
        otel.kind = "client",
        otel.status_code = tracing::field::Empty,
        error.type = tracing::field::Empty,
        db.system = "redis",
        db.system.name = "redis",
        db.operation.name = "EVALSHA",
        db.query.summary = script.span,
        db.operation.batch.size = tracing::field::Empty,
    );
    if requests > 1 {
        span.record("db.operation.batch.size", requests);
    }
    span
}

fn failed_on<T>(span: &tracing::Span, called: RedisResult<T>) -> RedisResult<T> {
    if let Err(error) = &called {
        span.record("otel.status_code", "ERROR");
        span.record("error.type", error.category());
    }
    called
}

/// One request of a batch: the key it is about and its script's own arguments
/// (after the key and the ledger).
#[derive(Clone, Debug)]
struct Request {
    key: String,
    args: Vec<String>,
}

/// How the requests of one group of a batch are decided (batch.lua's letters).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Together {
    /// Each on its own, exactly as one call each would decide it.
    Apart,
    /// The lines of one cart on the drop, with no other request between them; in
    /// mode `all`, none is admitted when one is refused.
    Cart(CartMode),
}

impl Together {
    fn letter(self) -> char {
        match self {
            Together::Apart => 'o',
            Together::Cart(CartMode::All) => 'a',
            Together::Cart(CartMode::Available) => 'v',
        }
    }

    /// `groups` (each a way and how many requests, in order) as batch.lua reads
    /// them: runs of a letter and a count, neighbouring `Apart` groups as one.
    fn runs(groups: &[(Together, usize)]) -> String {
        let mut merged: Vec<(Together, usize)> = Vec::with_capacity(groups.len());
        for &(together, n) in groups {
            match merged.last_mut() {
                Some((Together::Apart, count)) if together == Together::Apart => *count += n,
                _ => merged.push((together, n)),
            }
        }
        merged
            .iter()
            .map(|(together, n)| format!("{}{n}", together.letter()))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// Runs `script`'s batch form (see batch.lua) on the drop's keys: every request
/// decided in order in one atomic step, one reply each (an error for a request
/// whose step failed or whose reply cannot be read; the others stand). Every request
/// must have as many arguments as the others.
async fn run_batch(
    script: &GateScript,
    conn: &mut Connection,
    keys: &DropKeys,
    ledger: &str,
    requests: &[Request],
    groups: &[(Together, usize)],
) -> RedisResult<Vec<RedisResult<Wire>>> {
    let mut invocation = script.script.key(keys.config());
    invocation
        .key(keys.remaining())
        .key(keys.held())
        .key(keys.buyers())
        .key(keys.holds())
        .key(keys.gate())
        .key(keys.seq())
        .key(keys.ledger())
        .key(keys.pending())
        .key(keys.variants())
        .key(keys.by_buyer());
    for request in requests {
        invocation.key(keys.reservation(&request.key));
    }
    for request in requests {
        invocation.arg(&request.key).arg(ledger);
        for arg in &request.args {
            invocation.arg(arg);
        }
    }
    invocation.arg(Together::runs(groups));
    let span = client_span(script, requests.len());
    let called: RedisResult<Vec<String>> =
        invocation.invoke_async(conn).instrument(span.clone()).await;
    let replies = failed_on(&span, called)?;
    if replies.len() != requests.len() {
        return Err(redis::RedisError::from((
            redis::ErrorKind::Parse,
            "a gate batch answered with the wrong number of replies",
            format!("{} for {} requests", replies.len(), requests.len()),
        )));
    }
    Ok(replies
        .into_iter()
        .map(|reply| match reply.strip_prefix('!') {
            Some(error) => Err(redis::RedisError::from((
                redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError),
                "a gate script failed",
                error.to_string(),
            ))),
            None => Wire::parse(reply),
        })
        .collect())
}

/// The SHA1 of the reserve script as Redis caches it (for a bench that drives the
/// same script with `redis-benchmark`).
pub fn reserve_sha() -> &'static str {
    RESERVE.script.get_hash()
}

/// A reserve as the gate decides it (see [`reserve`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReserveRequest {
    pub key: String,
    pub user: String,
    pub quantity: i64,
    pub variant: Option<String>,
    /// This admission's id, for [`activate`] and [`undo`].
    pub attempt: String,
    pub pending_bound_ms: u64,
    /// An offer to the head of the variant's waitlist line, under its entry's key.
    pub offer: bool,
}

impl ReserveRequest {
    fn request(&self) -> Request {
        Request {
            key: self.key.clone(),
            args: vec![
                self.user.clone(),
                self.quantity.to_string(),
                self.attempt.clone(),
                self.pending_bound_ms.to_string(),
                self.variant.clone().unwrap_or_default(),
                if self.offer { "1" } else { "" }.to_string(),
            ],
        }
    }
}

/// Admits `quantity` units for `user` under idempotency key `key` as a pending
/// reservation, or says why not. `attempt` identifies this admission for
/// [`activate`] and [`undo`]; `ledger` is the id of the ledger that will record it
/// (the gate refuses one that is not the sale's); an admission still pending
/// `pending_bound_ms` later is overdue (its sidecar died): a retry of the same key
/// by the same buyer then hears [`Outcome::Overdue`](crate::reservation::Outcome::Overdue)
/// and resolves it from the ledger before it is decided.
/// [`Outcome::Pending`](crate::reservation::Outcome::Pending): a concurrent attempt
/// with the same key is still within its bound, ask again shortly;
/// [`Outcome::Closed`](crate::reservation::Outcome::Closed): the gate is not open
/// (see [`open`]).
#[allow(clippy::too_many_arguments)]
pub async fn reserve(
    conn: &mut Connection,
    keys: &DropKeys,
    ledger: &str,
    key: &str,
    user: &str,
    quantity: i64,
    variant: Option<&str>,
    attempt: &str,
    pending_bound_ms: u64,
) -> RedisResult<Reply> {
    let request = ReserveRequest {
        key: key.to_string(),
        user: user.to_string(),
        quantity,
        variant: variant.map(str::to_string),
        attempt: attempt.to_string(),
        pending_bound_ms,
        offer: false,
    }
    .request();
    let args: Vec<&str> = request.args.iter().map(String::as_str).collect();
    run(&RESERVE, conn, keys, ledger, key, &args)
        .await?
        .reply(Call::Reserve)
}

/// [`reserve`] for several requests in one atomic step, decided in the order given
/// exactly as one call each would decide them one after the other; one answer each.
pub async fn reserve_batch(
    conn: &mut Connection,
    keys: &DropKeys,
    ledger: &str,
    requests: &[ReserveRequest],
) -> RedisResult<Vec<RedisResult<Reply>>> {
    let requests: Vec<Request> = requests.iter().map(ReserveRequest::request).collect();
    let groups = [(Together::Apart, requests.len())];
    Ok(run_batch(&RESERVES, conn, keys, ledger, &requests, &groups)
        .await?
        .into_iter()
        .map(|wire| wire?.reply(Call::Reserve))
        .collect())
}

/// Groups of reserves (single requests and carts' lines, see [`Together`]) in one
/// atomic step, in the order given: one answer per request, per group. A line
/// admitted and taken back because another line of its cart was refused (mode
/// `all`) is answered `None` (withdrawn).
pub async fn reserve_groups(
    conn: &mut Connection,
    keys: &DropKeys,
    ledger: &str,
    groups: &[(Together, Vec<ReserveRequest>)],
) -> RedisResult<Vec<Vec<RedisResult<Option<Reply>>>>> {
    let requests: Vec<Request> = groups
        .iter()
        .flat_map(|(_, lines)| lines.iter().map(ReserveRequest::request))
        .collect();
    let sizes: Vec<(Together, usize)> = groups
        .iter()
        .map(|(together, lines)| (*together, lines.len()))
        .collect();
    let mut wires = run_batch(&RESERVES, conn, keys, ledger, &requests, &sizes)
        .await?
        .into_iter();
    Ok(sizes
        .iter()
        .map(|(_, n)| wires.by_ref().take(*n).map(line_reply).collect())
        .collect())
}

/// A reserve's reply in a group: `None` when it was withdrawn.
fn line_reply(wire: RedisResult<Wire>) -> RedisResult<Option<Reply>> {
    let wire = wire?;
    if wire.withdrawn() {
        Ok(None)
    } else {
        wire.reply(Call::Reserve).map(Some)
    }
}

/// [`activate`] for several admissions (key, attempt) in one atomic step.
pub async fn activate_batch(
    conn: &mut Connection,
    keys: &DropKeys,
    ledger: &str,
    admissions: &[(String, String)],
) -> RedisResult<Vec<RedisResult<(Activation, Step)>>> {
    let requests: Vec<Request> = admissions
        .iter()
        .map(|(key, attempt)| Request {
            key: key.clone(),
            args: vec![attempt.clone()],
        })
        .collect();
    let groups = [(Together::Apart, requests.len())];
    Ok(
        run_batch(&ACTIVATES, conn, keys, ledger, &requests, &groups)
            .await?
            .into_iter()
            .map(|wire| wire?.activation())
            .collect(),
    )
}

/// Takes back an overdue pending admission that the caller's ledger (the sale's) has
/// claimed as never recorded (or whose key another buyer's reservation holds). One
/// admitted afresh under the key meanwhile and one that moved on are left alone.
pub async fn abandon(
    conn: &mut Connection,
    keys: &DropKeys,
    ledger: &str,
    key: &str,
    attempt: &str,
) -> RedisResult<()> {
    run(&ABANDON, conn, keys, ledger, key, &[attempt])
        .await
        .map(|_| ())
}

/// An admission still pending (or expired while pending and `unsure`: its units
/// are back, and the scripts that resolve it give nothing back again): who, how
/// many of which variant, the attempt that admitted it and when it is overdue.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PendingAdmission {
    pub user: String,
    pub quantity: i64,
    pub attempt: String,
    pub variant: Option<String>,
    /// When it is overdue (its `overdueAt`), in Redis's ms.
    pub due_ms: i64,
    /// The sale it was admitted in (the marker's; `None` for a marker without one).
    pub sale: Option<String>,
}

/// A change of one key that is not resolved yet, as its marker shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unresolved {
    /// An admission still pending.
    Admission(PendingAdmission),
    /// A confirm or cancel prepared by `attempt`, moving the reservation to `to`.
    Settle {
        attempt: String,
        to: State,
        /// Redis's number for the change (its `settleSeq`): the ledger's row
        /// carries it once the change is recorded.
        seq: i64,
        /// The sale of the marker (`None` for a marker without one).
        sale: Option<String>,
        /// When it is overdue (its `settleBy`).
        due_ms: i64,
    },
    /// An extension prepared by `attempt`, moving an active hold's deadline to
    /// `until_ms`.
    Extend {
        attempt: String,
        until_ms: i64,
        /// As for [`Unresolved::Settle`].
        seq: i64,
        sale: Option<String>,
        /// When it is overdue (its `settleBy`).
        due_ms: i64,
    },
}

/// The unresolved change of `key` as it stands, if the key holds one.
pub async fn unresolved(
    conn: &mut Connection,
    keys: &DropKeys,
    key: &str,
) -> RedisResult<Option<Unresolved>> {
    // state, user, quantity, attempt, overdueAt, variant; settling, settleAttempt,
    // settleBy; sale; settleExpiresAt, settleSeq
    type Fields = (
        Option<String>,
        Option<String>,
        Option<i64>,
        Option<String>,
        Option<i64>,
        Option<String>,
        Option<String>,
        Option<String>,
        Option<i64>,
        Option<String>,
        Option<i64>,
        Option<i64>,
    );
    let (
        state,
        user,
        quantity,
        attempt,
        overdue_at,
        variant,
        settling,
        settle_attempt,
        settle_by,
        sale,
        settle_expires_at,
        settle_seq,
    ): Fields = redis::cmd("HMGET")
        .arg(keys.reservation(key))
        .arg("state")
        .arg("user")
        .arg("quantity")
        .arg("attempt")
        .arg("overdueAt")
        .arg("variant")
        .arg("settling")
        .arg("settleAttempt")
        .arg("settleBy")
        .arg("sale")
        .arg("settleExpiresAt")
        .arg("settleSeq")
        .query_async(conn)
        .await?;
    // `unsure` has its own HGET, only for an expired marker (rare here): the HMGET
    // above is at the widest tuple redis-rs reads.
    let unsure = state.as_deref() == Some("expired")
        && redis::cmd("HGET")
            .arg(keys.reservation(key))
            .arg("unsure")
            .query_async::<Option<String>>(conn)
            .await?
            .as_deref()
            == Some("1");
    Ok(
        match (
            state.as_deref(),
            user,
            quantity,
            settling.as_deref(),
            settle_attempt,
        ) {
            (Some(state), Some(user), Some(quantity), _, _)
                if state == "pending" || (state == "expired" && unsure) =>
            {
                Some(Unresolved::Admission(PendingAdmission {
                    user,
                    quantity,
                    attempt: attempt.unwrap_or_default(),
                    variant: variant.filter(|v| !v.is_empty()),
                    due_ms: overdue_at.unwrap_or(0),
                    sale: sale.clone().filter(|s| !s.is_empty()),
                }))
            }
            (_, _, _, Some("extended"), Some(attempt)) => Some(Unresolved::Extend {
                attempt,
                until_ms: settle_expires_at.unwrap_or(0),
                seq: settle_seq.unwrap_or(0),
                sale: sale.clone().filter(|s| !s.is_empty()),
                due_ms: settle_by.unwrap_or(0),
            }),
            (_, _, _, Some(to), Some(attempt)) => State::parse(to)
                .filter(|to| matches!(to, State::Confirmed | State::Cancelled))
                .map(|to| Unresolved::Settle {
                    attempt,
                    to,
                    seq: settle_seq.unwrap_or(0),
                    sale: sale.clone().filter(|s| !s.is_empty()),
                    due_ms: settle_by.unwrap_or(0),
                }),
            _ => None,
        },
    )
}

/// Keys whose admission or settle is overdue at `now_ms`, at most `limit`.
pub async fn overdue(
    conn: &mut Connection,
    keys: &DropKeys,
    now_ms: i64,
    limit: isize,
) -> RedisResult<Vec<String>> {
    scored_until(conn, &keys.pending(), now_ms, limit).await
}

/// Every key in the drop's unresolved set (`DropKeys::pending`, `K.unresolved` in
/// the scripts), read with ZSCAN a few hundred at a time: a key listed for the whole
/// scan is in the answer, whatever else is added, moved or taken out meanwhile (a
/// read by rank would skip one behind a key taken out). Each key once.
pub async fn all_unresolved(conn: &mut Connection, keys: &DropKeys) -> RedisResult<Vec<String>> {
    let mut cursor: u64 = 0;
    let mut seen = std::collections::HashSet::new();
    let mut all = Vec::new();
    loop {
        let (next, page): (u64, Vec<(String, f64)>) = redis::cmd("ZSCAN")
            .arg(keys.pending())
            .arg(cursor)
            .arg("COUNT")
            .arg(512)
            .query_async(conn)
            .await?;
        for (key, _) in page {
            if seen.insert(key.clone()) {
                all.push(key);
            }
        }
        if next == 0 {
            return Ok(all);
        }
        cursor = next;
    }
}

/// Lists `key`'s unresolved change again at `at_ms` (a sweep's resolution of it
/// failed): the keys behind it come first meanwhile. Only a listed key moves.
pub async fn postpone(
    conn: &mut Connection,
    keys: &DropKeys,
    key: &str,
    at_ms: i64,
) -> RedisResult<()> {
    redis::cmd("ZADD")
        .arg(keys.pending())
        .arg("XX")
        .arg(at_ms)
        .arg(key)
        .query_async(conn)
        .await
}

/// Members of the sorted set `key` scored at or before `now_ms`, at most `limit`.
async fn scored_until(
    conn: &mut Connection,
    key: &str,
    now_ms: i64,
    limit: isize,
) -> RedisResult<Vec<String>> {
    redis::cmd("ZRANGEBYSCORE")
        .arg(key)
        .arg("-inf")
        .arg(now_ms)
        .arg("LIMIT")
        .arg(0)
        .arg(limit)
        .query_async(conn)
        .await
}

/// A confirm, cancel or extension to prepare.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settling {
    /// Keeps `quantity` of the units held (all when `None`) and gives the rest back
    /// when it finishes.
    Confirm {
        quantity: Option<i64>,
    },
    Cancel,
    /// A cancel of an active hold only (see [`crate::reservation::Settle::CancelHold`]).
    CancelHold,
    /// Moves an active hold's deadline to `until_ms` (ms since the epoch).
    Extend {
        until_ms: i64,
    },
}

impl Settling {
    /// The state the reservation moves to (an extension leaves it active).
    pub fn state(self) -> State {
        match self {
            Self::Confirm { .. } => State::Confirmed,
            Self::Cancel | Self::CancelHold => State::Cancelled,
            Self::Extend { .. } => State::Active,
        }
    }
}

/// Prepares a confirm or a cancel of `key` by `attempt`: nothing changes for the
/// buyer until [`finish`] (once the ledger recorded it) or [`abort`]; one not
/// finished `bound_ms` later is overdue and resolved by a sweeper from the
/// ledger's record.
pub async fn prepare(
    conn: &mut Connection,
    keys: &DropKeys,
    ledger: &str,
    key: &str,
    settling: Settling,
    attempt: &str,
    bound_ms: u64,
) -> RedisResult<Prepare> {
    let (script, call, asked) = match settling {
        Settling::Cancel => (&CANCEL, Call::Cancel, String::new()),
        Settling::CancelHold => (&CANCEL, Call::Cancel, "hold_only".to_string()),
        Settling::Confirm { quantity } => (
            &CONFIRM,
            Call::Confirm,
            quantity.map_or_else(String::new, |q| q.to_string()),
        ),
        Settling::Extend { until_ms } => (&EXTEND, Call::Extend, until_ms.to_string()),
    };
    run(
        script,
        conn,
        keys,
        ledger,
        key,
        &[attempt, &bound_ms.to_string(), &asked],
    )
    .await?
    .prepared(call)
}

/// Makes the confirm or cancel `attempt` prepared take effect (the ledger recorded
/// it): a cancel returns its units.
pub async fn finish(
    conn: &mut Connection,
    keys: &DropKeys,
    ledger: &str,
    key: &str,
    attempt: &str,
) -> RedisResult<Finished> {
    run(&FINISH, conn, keys, ledger, key, &[attempt])
        .await?
        .finished()
}

/// Undoes the preparation of the confirm or cancel `attempt` (the ledger did not
/// record it): the reservation is as it was.
pub async fn abort(
    conn: &mut Connection,
    keys: &DropKeys,
    ledger: &str,
    key: &str,
    attempt: &str,
) -> RedisResult<()> {
    run(&ABORT, conn, keys, ledger, key, &[attempt])
        .await
        .map(|_| ())
}

pub async fn lookup(
    conn: &mut Connection,
    keys: &DropKeys,
    ledger: &str,
    key: &str,
) -> RedisResult<Reply> {
    run(&LOOKUP, conn, keys, ledger, key, &[])
        .await?
        .reply(Call::Lookup)
}

/// Expires the hold of `key` if its deadline has passed (the sweeper's step).
pub async fn expire(
    conn: &mut Connection,
    keys: &DropKeys,
    ledger: &str,
    key: &str,
) -> RedisResult<Step> {
    run(&EXPIRE, conn, keys, ledger, key, &[]).await?.step()
}

/// Turns the pending admission `attempt` of `key` into an active reservation, or
/// says how the marker stands when it is not that pending admission any more.
pub async fn activate(
    conn: &mut Connection,
    keys: &DropKeys,
    ledger: &str,
    key: &str,
    attempt: &str,
) -> RedisResult<(Activation, Step)> {
    run(&ACTIVATE, conn, keys, ledger, key, &[attempt])
        .await?
        .activation()
}

/// Takes back the pending admission `attempt` of `key` as if it never happened (a
/// marker that moved on meanwhile is left alone).
pub async fn undo(
    conn: &mut Connection,
    keys: &DropKeys,
    ledger: &str,
    key: &str,
    attempt: &str,
) -> RedisResult<()> {
    run(&UNDO, conn, keys, ledger, key, &[attempt, ""])
        .await
        .map(|_| ())
}

/// [`undo`] by the rebuild at `epoch` (an admission the ledger never recorded, of
/// an epoch that is over): only while that rebuild still holds the gate closed.
pub async fn undo_for_rebuild(
    conn: &mut Connection,
    keys: &DropKeys,
    ledger: &str,
    key: &str,
    attempt: &str,
    epoch: i64,
) -> RedisResult<()> {
    run(
        &UNDO,
        conn,
        keys,
        ledger,
        key,
        &[attempt, &epoch.to_string()],
    )
    .await
    .map(|_| ())
}

/// Brings the reservation `key` in Redis forward to the ledger's record of it.
/// `ledger_key` is where `row` was read: a row of another sale than the one Redis
/// now holds (the drop was re-created while this ran) changes nothing.
pub async fn replay(
    conn: &mut Connection,
    keys: &DropKeys,
    ledger: &str,
    row: &Recorded,
    ledger_key: &str,
) -> RedisResult<Replay> {
    let (quantity, expires, seq) = (
        row.quantity.to_string(),
        row.expires_at_ms.to_string(),
        row.seq.to_string(),
    );
    let admitted = row
        .admitted_at_ms
        .map(|at| at.to_string())
        .unwrap_or_default();
    run(
        &REPLAY,
        conn,
        keys,
        ledger,
        &row.key,
        &[
            &row.user,
            &quantity,
            row.state.as_str(),
            &expires,
            &seq,
            dropgate_api::keys::ledger_sale(ledger_key),
            row.variant.as_deref().unwrap_or(""),
            &admitted,
        ],
    )
    .await?
    .replay()
}

/// Whether the drop's gate is open (at some epoch): not absent, not closed.
pub async fn is_open(conn: &mut Connection, keys: &DropKeys) -> RedisResult<bool> {
    let gate: Option<String> = redis::cmd("GET").arg(keys.gate()).query_async(conn).await?;
    Ok(gate.is_some_and(|gate| !gate.is_empty() && !gate.starts_with("closed:")))
}

/// The keys of the reservations Redis lists under `user` (see
/// [`DropKeys::by_buyer`]), newest admission first, at most `limit` entries (a key
/// listed twice, admitted afresh after it was taken back, once).
pub async fn keys_of_buyer(
    conn: &mut Connection,
    keys: &DropKeys,
    user: &str,
    limit: usize,
) -> RedisResult<Vec<String>> {
    // Members are `<user>\n<time>\n<key>` and users hold no control characters:
    // `\x0b` is the first byte past every member of this user.
    let members: Vec<String> = redis::cmd("ZREVRANGEBYLEX")
        .arg(keys.by_buyer())
        .arg(format!("({user}\x0b"))
        .arg(format!("[{user}\n"))
        .arg("LIMIT")
        .arg(0)
        .arg(limit)
        .query_async(conn)
        .await?;
    let mut found: Vec<String> = Vec::new();
    for member in members {
        if let Some(key) = member.splitn(3, '\n').nth(2)
            && !found.iter().any(|k| k == key)
        {
            found.push(key.to_string());
        }
    }
    Ok(found)
}

/// Opens the gate at `epoch` and raises the change counter to `seq_floor`.
pub async fn open(
    conn: &mut Connection,
    keys: &DropKeys,
    ledger: &str,
    epoch: i64,
    seq_floor: i64,
) -> RedisResult<Opened> {
    let (epoch, floor) = (epoch.to_string(), seq_floor.to_string());
    run(&OPEN, conn, keys, ledger, "", &[&epoch, &floor])
        .await?
        .opened()
}

/// Closes the gate for a move of the authority to `epoch`, unless it was reopened
/// at a later one; an opening at an older epoch is refused from now on.
pub async fn close(
    conn: &mut Connection,
    keys: &DropKeys,
    ledger: &str,
    epoch: i64,
) -> RedisResult<Closing> {
    run(&CLOSE, conn, keys, ledger, "", &[&epoch.to_string()])
        .await?
        .closing()
}

/// Makes `candidate` the sale's ledger if the sale has none yet (the caller's own
/// `ledger`, or the one its ledger remembers Redis naming), and says whose the sale
/// is, as seen by a sidecar of `ledger` (see [`DropKeys::ledger`]).
pub async fn claim(
    conn: &mut Connection,
    keys: &DropKeys,
    ledger: &str,
    candidate: &str,
) -> RedisResult<Claim> {
    run(&CLAIM, conn, keys, ledger, "", &[candidate])
        .await?
        .claim()
}

/// What a drop has left, as one of its gates counts it (unclamped).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Left {
    pub drop: i64,
    /// Per variant (by name), for a drop with variants.
    pub variants: std::collections::HashMap<String, i64>,
}

/// Whether the gate is open, and what the drop (and each variant) has left in
/// Redis (0 before it was seeded), read together.
pub async fn open_count(conn: &mut Connection, keys: &DropKeys) -> RedisResult<(bool, Left)> {
    type Counts = (
        Option<String>,
        Option<i64>,
        std::collections::HashMap<String, i64>,
    );
    let (gate, remaining, fields): Counts = redis::pipe()
        .atomic()
        .get(keys.gate())
        .get(keys.remaining())
        .hgetall(keys.variants())
        .query_async(conn)
        .await?;
    let variants = fields
        .into_iter()
        .filter_map(|(field, left)| {
            field
                .strip_prefix("r:")
                .map(|name| (name.to_string(), left))
        })
        .collect();
    Ok((
        GateKey::parse(gate)?.open_at.is_some(),
        Left {
            drop: remaining.unwrap_or(0),
            variants,
        },
    ))
}

/// What the drop has left in Redis; `None` before it was seeded.
pub async fn remaining(conn: &mut Connection, keys: &DropKeys) -> RedisResult<Option<i64>> {
    redis::cmd("GET")
        .arg(keys.remaining())
        .query_async(conn)
        .await
}

/// The gate key as Redis holds it (see prelude.lua).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GateKey {
    /// The epoch the gate is open at; `None` while it is closed.
    pub open_at: Option<i64>,
    /// The epoch the last close was for (0 when none is known): an opening at an
    /// older epoch is refused.
    pub closed_for: i64,
}

impl GateKey {
    fn parse(value: Option<String>) -> RedisResult<Self> {
        let Some(value) = value else {
            return Ok(Self::default());
        };
        let not_an_epoch = |value: &str| {
            redis::RedisError::from((
                redis::ErrorKind::Parse,
                "the gate key holds no epoch",
                value.to_string(),
            ))
        };
        match value.strip_prefix("closed:") {
            Some(epoch) => Ok(Self {
                open_at: None,
                closed_for: epoch.parse().map_err(|_| not_an_epoch(&value))?,
            }),
            None => Ok(Self {
                open_at: Some(value.parse().map_err(|_| not_an_epoch(&value))?),
                closed_for: 0,
            }),
        }
    }

    /// The lowest epoch the gate may next open at, less one: a new epoch must be
    /// above every epoch Redis has seen, open or closed.
    pub fn floor(&self) -> i64 {
        self.open_at.unwrap_or(0).max(self.closed_for)
    }
}

/// Where the gate of one drop stands in Redis, read in one transaction.
pub struct GateStanding {
    pub gate: GateKey,
    /// The change counter.
    pub seq: i64,
    /// The waitlist's position counter (joins are numbered by it, not by a change
    /// number).
    pub positions: i64,
    /// The sale (uid) of the config these belong to; `None` without a config.
    pub sale: Option<String>,
    /// The marker of the key asked about, if Redis has one.
    pub marker: Option<MarkerSeen>,
    /// The sale of the waitlist entry asked about (the ledger's last join), if
    /// Redis has one.
    pub last_join_sale: Option<String>,
}

/// What a reservation's marker says of the changes it has seen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MarkerSeen {
    /// The number of the last change made to it.
    pub seq: i64,
    /// The number of a confirm, cancel or extension prepared on it (0 for none).
    pub settle_seq: i64,
    /// The attempt that prepared it.
    pub settle_attempt: Option<String>,
    /// Its state (`None`: one this sidecar does not know).
    pub state: Option<State>,
    /// Its hold's deadline (ms; 0 when it has none).
    pub expires_at_ms: i64,
    /// The attempt id of the admission that made the reservation (Redis field
    /// `attempt`).
    pub attempt: Option<String>,
}

/// How long past a hold's deadline Redis keeps its marker at least: the scripts
/// set deadline + 7 days, or the sale's `expireAt` when it has an end (the end,
/// plus the longest hold, plus 7 days: later still).
pub const MARKER_KEPT_MS: i64 = 7 * 86_400_000;

/// The gate key, the change counter, the waitlist's position counter and the sale
/// they belong to, what `key`'s marker has seen, and the sale of `entry`'s waitlist
/// entry, as Redis holds them now.
pub async fn standing(
    conn: &mut Connection,
    keys: &DropKeys,
    key: Option<&str>,
    entry: Option<&str>,
) -> RedisResult<GateStanding> {
    let marker = keys.reservation(key.unwrap_or_default());
    type Read = (
        Option<String>,
        Option<i64>,
        Option<i64>,
        Option<String>,
        (
            Option<i64>,
            Option<i64>,
            Option<String>,
            Option<i64>,
            Option<String>,
            Option<String>,
        ),
        (Option<i64>, Option<String>),
    );
    let (
        gate,
        seq,
        positions,
        sale,
        (changed, prepared, state, expires_at, settle_attempt, attempt),
        (entry_position, entry_sale),
    ): Read = redis::pipe()
        .atomic()
        .get(keys.gate())
        .get(keys.seq())
        .get(keys.waitlist_counter())
        .hget(keys.config(), "sale")
        .hmget(
            &marker,
            &[
                "seq",
                "settleSeq",
                "state",
                "expiresAt",
                "settleAttempt",
                "attempt",
            ],
        )
        .hmget(
            keys.waitlist_entry(entry.unwrap_or_default()),
            &["position", "sale"],
        )
        .query_async(conn)
        .await?;
    Ok(GateStanding {
        gate: GateKey::parse(gate)?,
        seq: seq.unwrap_or(0),
        positions: positions.unwrap_or(0),
        sale,
        marker: state.map(|state| MarkerSeen {
            seq: changed.unwrap_or(0),
            settle_seq: prepared.unwrap_or(0),
            settle_attempt,
            state: State::parse(&state),
            expires_at_ms: expires_at.unwrap_or(0),
            attempt,
        }),
        // (An entry hash without a position holds only a state, written by a
        // script that met a key Redis had lost: not a join.)
        last_join_sale: entry_position.and(entry_sale),
    })
}

/// Keys of active holds whose deadline is at or before `now_ms`, at most `limit`.
pub async fn due_holds(
    conn: &mut Connection,
    keys: &DropKeys,
    now_ms: i64,
    limit: isize,
) -> RedisResult<Vec<String>> {
    scored_until(conn, &keys.holds(), now_ms, limit).await
}
