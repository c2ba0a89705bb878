//! The waitlist's scripts: a line per variant in Redis (a sorted set of keys by
//! position), each entry a hash, the units each buyer waits for counted beside the
//! units they hold. See `waitlist/common.lua` for the entry's states.
//!
//! Offers are admissions: when units are back and the head of a line fits, the
//! sweeper admits the head's units under its key with reserve.lua's offer flag,
//! and the admission is made durable like any other (pending, recorded, activated;
//! undone, the entry is back at its place). While anyone waits, a new reserve is
//! sold out, so returned units wait for the line in the same step that returns
//! them, and the offer is never a hold the ledger has not recorded.

use std::sync::LazyLock;

use dropgate_api::DropKeys;
use dropgate_redis::Connection;
use redis::{ErrorKind, RedisError, RedisResult};

use super::{GateScript, invoke};

macro_rules! waitlist_script {
    ($name:literal) => {
        LazyLock::new(|| GateScript {
            script: redis::Script::new(concat!(
                include_str!("prelude.lua"),
                include_str!("waitlist/common.lua"),
                "begin(KEYS, ARGV)\n",
                include_str!(concat!("waitlist/", $name, ".lua"))
            )),
            span: concat!("EVALSHA waitlist ", $name),
        })
    };
}

static JOIN: LazyLock<GateScript> = waitlist_script!("join");
static JOINED: LazyLock<GateScript> = waitlist_script!("joined");
static UNJOIN: LazyLock<GateScript> = waitlist_script!("unjoin");
static LEAVE: LazyLock<GateScript> = waitlist_script!("leave");
static LOOK: LazyLock<GateScript> = waitlist_script!("look");
static HEAD: LazyLock<GateScript> = waitlist_script!("head");
static REPLAY: LazyLock<GateScript> = waitlist_script!("replay");
static POSITIONS: LazyLock<GateScript> = waitlist_script!("positions");

/// Where an entry stands (see `waitlist/common.lua`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryState {
    Joining,
    Waiting,
    Offering,
    Offered,
    Left,
}

impl EntryState {
    pub fn as_str(self) -> &'static str {
        match self {
            EntryState::Joining => "joining",
            EntryState::Waiting => "waiting",
            EntryState::Offering => "offering",
            EntryState::Offered => "offered",
            EntryState::Left => "left",
        }
    }

    pub fn parse(word: &str) -> Option<Self> {
        Some(match word {
            "joining" => EntryState::Joining,
            "waiting" => EntryState::Waiting,
            "offering" => EntryState::Offering,
            "offered" => EntryState::Offered,
            "left" => EntryState::Left,
            _ => return None,
        })
    }
}

/// One entry of a line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub user: String,
    pub quantity: i64,
    pub variant: Option<String>,
    pub state: EntryState,
    /// Its place in its line (1 first) while it is in line.
    pub place: Option<i64>,
    /// Its score in the line: the order it joined in.
    pub position: i64,
    /// The attempt that joined it ('' for one a rebuild put back).
    pub attempt: String,
    /// For a join just made (`join.lua`'s answer): the generation of the config
    /// Redis decided it on.
    pub config_generation: Option<i64>,
}

/// What a waitlist script said.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Said {
    /// The entry, and the script's word about it (`joining`, `already`, `joined`,
    /// `gone`, `found`, `replayed`, `in_line`, `pending`, `overdue`).
    Entry(Word, Entry),
    /// KEY has no entry in this sale.
    NoEntry,
    Unjoined,
    KeyReused,
    Disabled,
    VariantMissing,
    VariantUnexpected(String),
    UnknownVariant(String),
    NotOpen(Option<i64>),
    Ended(Option<i64>),
    PerUserLimit {
        held: i64,
        limit: i64,
    },
    Full {
        limit: i64,
    },
    /// The drop's config is not in Redis.
    UnknownDrop,
    /// The drop is off the gate (its mode in Redis).
    OffGate(dropgate_api::Mode),
    Closed,
    /// The caller's ledger is not the sale's (named; '' when not known yet).
    Foreign(String),
    OtherSale,
    /// A line's head (`head`): the entry, its key, what its variant has left, and
    /// whether it is a join past its bound.
    Head {
        key: String,
        entry: Entry,
        left: i64,
        overdue: bool,
    },
    /// The line is empty.
    Empty,
    /// The line's first key had no entry: dropped from the line.
    Stale,
}

/// The words a script says about an entry it answers with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Word {
    Joining,
    /// A retry of a join: the entry as it stands.
    Already,
    Joined,
    /// Not the change asked for: the entry as it stands.
    Gone,
    Found,
    Replayed,
    InLine,
    /// Another attempt's join of the key is not durable yet.
    Pending,
    /// One past its bound: resolve it from the ledger.
    Overdue,
}

fn unreadable(what: &str, reply: &str) -> RedisError {
    RedisError::from((
        ErrorKind::Parse,
        "a waitlist script's reply could not be read",
        format!("{what}: {reply:?}"),
    ))
}

fn parse(reply: &str) -> RedisResult<Said> {
    let f: Vec<&str> = reply.split('\n').collect();
    if f.len() != 10 {
        return Err(unreadable("expected 10 fields", reply));
    }
    let int = |s: &str| s.parse::<i64>().ok();
    let entry = || -> RedisResult<Entry> {
        Ok(Entry {
            user: f[1].to_string(),
            quantity: int(f[2]).ok_or_else(|| unreadable("quantity", reply))?,
            variant: (!f[5].is_empty()).then(|| f[5].to_string()),
            state: EntryState::parse(f[3]).ok_or_else(|| unreadable("state", reply))?,
            place: int(f[4]),
            position: int(f[8]).unwrap_or(0),
            attempt: f[9].to_string(),
            config_generation: int(f[6]),
        })
    };
    let word = match f[0] {
        "joining" => Some(Word::Joining),
        "already" => Some(Word::Already),
        "joined" => Some(Word::Joined),
        "gone" => Some(Word::Gone),
        "found" => Some(Word::Found),
        "replayed" => Some(Word::Replayed),
        "in_line" => Some(Word::InLine),
        "pending" => Some(Word::Pending),
        "overdue" => Some(Word::Overdue),
        _ => None,
    };
    if let Some(word) = word {
        return Ok(Said::Entry(word, entry()?));
    }
    Ok(match f[0] {
        "none" => Said::NoEntry,
        "unjoined" => Said::Unjoined,
        "idempotency_key_reused" => Said::KeyReused,
        "waitlist_disabled" => Said::Disabled,
        "variant_missing" => Said::VariantMissing,
        "variant_unexpected" => Said::VariantUnexpected(f[5].to_string()),
        "unknown_variant" => Said::UnknownVariant(f[5].to_string()),
        "not_open" => Said::NotOpen(int(f[6])),
        "ended" => Said::Ended(int(f[6])),
        "per_user_limit_exceeded" => Said::PerUserLimit {
            held: int(f[2]).unwrap_or(0),
            limit: int(f[6]).unwrap_or(0),
        },
        "waitlist_full" => Said::Full {
            limit: int(f[6]).unwrap_or(0),
        },
        "not_found" => Said::UnknownDrop,
        "mode" => {
            Said::OffGate(dropgate_api::Mode::parse(f[6]).unwrap_or(dropgate_api::Mode::Closed))
        }
        "closed" => Said::Closed,
        "foreign" => Said::Foreign(f[6].to_string()),
        "other_sale" => Said::OtherSale,
        "empty" => Said::Empty,
        "stale" => Said::Stale,
        "head" => {
            let mut parts = f[6].splitn(3, ' ');
            let (Some(left), Some(overdue), Some(key)) = (parts.next(), parts.next(), parts.next())
            else {
                return Err(unreadable("head", reply));
            };
            Said::Head {
                key: key.to_string(),
                entry: entry()?,
                left: int(left).ok_or_else(|| unreadable("left", reply))?,
                overdue: overdue == "1",
            }
        }
        _ => return Err(unreadable("unknown word", reply)),
    })
}

async fn call(
    script: &GateScript,
    conn: &mut Connection,
    keys: &DropKeys,
    ledger: &str,
    key: &str,
    args: &[&str],
) -> RedisResult<Said> {
    parse(&invoke(script, conn, keys, ledger, key, args).await?)
}

/// A join of `key` to the line of its variant, by `attempt`; one not made durable
/// within `bound_ms` is resolved by whoever meets it.
#[allow(clippy::too_many_arguments)]
pub async fn join(
    conn: &mut Connection,
    keys: &DropKeys,
    ledger: &str,
    key: &str,
    user: &str,
    quantity: i64,
    variant: Option<&str>,
    attempt: &str,
    bound_ms: u64,
) -> RedisResult<Said> {
    let quantity = quantity.to_string();
    let bound = bound_ms.to_string();
    call(
        &JOIN,
        conn,
        keys,
        ledger,
        key,
        &[user, &quantity, variant.unwrap_or(""), attempt, &bound],
    )
    .await
}

/// The join `attempt` is durable: its entry waits.
pub async fn joined(
    conn: &mut Connection,
    keys: &DropKeys,
    ledger: &str,
    key: &str,
    attempt: &str,
) -> RedisResult<Said> {
    call(&JOINED, conn, keys, ledger, key, &[attempt]).await
}

/// The join `attempt` is not durable and never will be: its entry goes.
pub async fn unjoin(
    conn: &mut Connection,
    keys: &DropKeys,
    ledger: &str,
    key: &str,
    attempt: &str,
) -> RedisResult<Said> {
    call(&UNJOIN, conn, keys, ledger, key, &[attempt]).await
}

/// The ledger has the entry as left: Redis follows.
pub async fn leave(
    conn: &mut Connection,
    keys: &DropKeys,
    ledger: &str,
    key: &str,
) -> RedisResult<Said> {
    call(&LEAVE, conn, keys, ledger, key, &[]).await
}

/// The entry as it stands.
pub async fn look(
    conn: &mut Connection,
    keys: &DropKeys,
    ledger: &str,
    key: &str,
) -> RedisResult<Said> {
    call(&LOOK, conn, keys, ledger, key, &[]).await
}

/// The head of the line of `variant` and what that variant has left.
pub async fn head(
    conn: &mut Connection,
    keys: &DropKeys,
    ledger: &str,
    variant: Option<&str>,
) -> RedisResult<Said> {
    call(&HEAD, conn, keys, ledger, "", &[variant.unwrap_or("")]).await
}

/// Raises the lines' position counter to `at_least` (the highest position the
/// ledger recorded), after a rebuild replayed every entry.
pub async fn raise_positions(
    conn: &mut Connection,
    keys: &DropKeys,
    ledger: &str,
    at_least: i64,
) -> RedisResult<Said> {
    call(&POSITIONS, conn, keys, ledger, "", &[&at_least.to_string()]).await
}

/// Brings `key`'s entry forward to the ledger's `row`, of the sale `sale`.
pub async fn replay(
    conn: &mut Connection,
    keys: &DropKeys,
    ledger: &str,
    row: &crate::ledger::WaitRow,
    sale: &str,
) -> RedisResult<Said> {
    let quantity = row.quantity.to_string();
    let position = row.position.to_string();
    call(
        &REPLAY,
        conn,
        keys,
        ledger,
        &row.key,
        &[
            &row.user,
            &quantity,
            row.variant.as_deref().unwrap_or(""),
            row.state.as_str(),
            &position,
            sale,
        ],
    )
    .await
}
