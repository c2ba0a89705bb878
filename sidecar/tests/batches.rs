//! The batched gate scripts decide exactly as one call per request does: for random
//! sequences of reserves, carts' lines (modes `all` and `available`), retries,
//! duplicates, activations, confirms and cancels on one drop by several buyers, two
//! drops with the same terms are driven side by side, one a call per request (a
//! cart's lines a call of their own), the other with each run of reserves and carts
//! (and of activations) sent as one batch, and every answer and the drops' whole
//! state in Redis must be the same. The scenarios also close and reopen the gate (a
//! move of the authority and back), send reserves as a ledger that is not the
//! sale's, give some admissions a pending bound of 0 (overdue at once, so that
//! retries meet `overdue`), sell with and without an end, and with holds that end
//! the moment they are made (expiries in batches).

mod common;

use std::collections::BTreeMap;

use dropgate_api::DropKeys;
use dropgate_sidecar::gate::{self, ReserveRequest, Together};
use dropgate_sidecar::input::CartMode;
use dropgate_sidecar::reservation::State;
use dropgate_testkit::{DropSpec, RedisServer};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const LEDGER: &str = "the-sales-ledger";
const ONE_BY_ONE: &str = "one-by-one";
const BATCHED: &str = "batched";
/// A ledger the sale is not claimed by: the gate refuses it.
const FOREIGN: &str = "another-ledger";

/// One step of a scenario.
#[derive(Clone, Debug)]
enum Op {
    Reserve(ReserveRequest),
    /// A cart's lines on the drop, decided together.
    Cart(Vec<ReserveRequest>, CartMode),
    /// The activation of `attempt`'s admission of `key` (maybe not the marker's).
    Activate {
        key: String,
        attempt: String,
    },
    Settle {
        key: String,
        to: State,
        attempt: String,
    },
    /// A reserve sent as [`FOREIGN`].
    Foreign(ReserveRequest),
    /// The gate closed for a move of the authority to `epoch`.
    Close {
        epoch: i64,
    },
    /// The gate opened again at `epoch`.
    Open {
        epoch: i64,
    },
}

/// A random scenario: keys reused across buyers and terms (duplicates and retries),
/// quantities that reach the per-user limit and the stock.
fn scenario(rng: &mut StdRng, variants: bool) -> Vec<Op> {
    let mut ops = Vec::new();
    let mut attempts: Vec<(String, String)> = Vec::new();
    let mut reserves: Vec<ReserveRequest> = Vec::new();
    // The gate's epoch (opened at 1), and whether it is closed now.
    let (mut epoch, mut closed) = (1, false);
    for i in 0..rng.random_range(20..60) {
        let key = format!("k{}", rng.random_range(0..12));
        let mut request = |rng: &mut StdRng, key: String, user: &str, attempt: String| {
            attempts.push((key.clone(), attempt.clone()));
            ReserveRequest {
                key,
                user: user.to_string(),
                quantity: rng.random_range(1..=3),
                variant: variants.then(|| ["s", "m", "x"][rng.random_range(0..3)].to_string()),
                attempt,
                // One in four overdue as soon as it is admitted.
                pending_bound_ms: if rng.random_ratio(1, 4) { 0 } else { 600_000 },
                offer: false,
            }
        };
        // A closed gate opens again within a few steps.
        if closed && rng.random_ratio(1, 3) {
            closed = false;
            ops.push(Op::Open { epoch });
            continue;
        }
        match rng.random_range(0..14) {
            12 if !closed => {
                epoch += 1;
                closed = true;
                ops.push(Op::Close { epoch });
            }
            13 => {
                let user = format!("u{}", rng.random_range(0..4));
                ops.push(Op::Foreign(request(rng, key, &user, format!("a{i}"))));
            }
            // A retry of an earlier reserve: the same terms, an attempt of its own.
            0..2 if !reserves.is_empty() => {
                let mut retry: ReserveRequest =
                    reserves[rng.random_range(0..reserves.len())].clone();
                retry.attempt = format!("a{i}");
                attempts.push((retry.key.clone(), retry.attempt.clone()));
                ops.push(Op::Reserve(retry));
            }
            0..6 => {
                let user = format!("u{}", rng.random_range(0..4));
                let reserve = request(rng, key, &user, format!("a{i}"));
                reserves.push(reserve.clone());
                ops.push(Op::Reserve(reserve));
            }
            // A cart of 1-3 lines by one buyer, its keys `c<n>:<line>` (a retry of
            // an earlier cart when n repeats).
            6..8 => {
                let user = format!("u{}", rng.random_range(0..4));
                let cart = rng.random_range(0..6);
                let lines = (1..=rng.random_range(1..=3))
                    .map(|n| request(rng, format!("c{cart}:{n}"), &user, format!("a{i}.{n}")))
                    .collect();
                let mode = if rng.random_bool(0.5) {
                    CartMode::All
                } else {
                    CartMode::Available
                };
                ops.push(Op::Cart(lines, mode));
            }
            8..=10 if !attempts.is_empty() => {
                let (key, attempt) = attempts[rng.random_range(0..attempts.len())].clone();
                ops.push(Op::Activate { key, attempt });
            }
            _ => ops.push(Op::Settle {
                key,
                to: if rng.random_bool(0.5) {
                    State::Confirmed
                } else {
                    State::Cancelled
                },
                attempt: format!("s{i}"),
            }),
        }
    }
    ops
}

/// Runs `ops` on `drop`, a call per step, or each run of reserves or activations as
/// one batch when `batched` (split at random, so batches of one happen too). Every
/// answer, as text.
async fn drive(
    conn: &mut dropgate_redis::Connection,
    drop: &str,
    ops: &[Op],
    batched: Option<&mut StdRng>,
) -> Vec<String> {
    let keys = DropKeys::new(common::NS, drop);
    let mut answers = Vec::new();
    let mut rng = batched;
    let mut i = 0;
    while i < ops.len() {
        let run = ops[i..]
            .iter()
            .take_while(|op| kind(op) == kind(&ops[i]))
            .count();
        let n = match rng.as_deref_mut() {
            Some(rng) if kind(&ops[i]) != Kind::Alone => rng.random_range(1..=run),
            _ => 1,
        };
        let group = &ops[i..i + n];
        i += n;
        match (&group[0], rng.is_some()) {
            // Reserves alone: the batch of reserves only.
            (Op::Reserve(_), true) if group.iter().all(|op| matches!(op, Op::Reserve(_))) => {
                let requests = group.iter().filter_map(|op| match op {
                    Op::Reserve(request) => Some(request.clone()),
                    _ => None,
                });
                answers.extend(reserves_batched(conn, &keys, LEDGER, requests).await);
            }
            (Op::Reserve(_) | Op::Cart(..), true) => {
                let groups: Vec<(Together, Vec<ReserveRequest>)> = group
                    .iter()
                    .filter_map(|op| match op {
                        Op::Reserve(request) => Some((Together::Apart, vec![request.clone()])),
                        Op::Cart(lines, mode) => Some((Together::Cart(*mode), lines.clone())),
                        _ => None,
                    })
                    .collect();
                let replies = gate::reserve_groups(conn, &keys, LEDGER, &groups)
                    .await
                    .expect("a batch of reserves and carts runs");
                for ((together, _), replies) in groups.iter().zip(replies) {
                    let replies = replies
                        .into_iter()
                        .map(|reply| reply.expect("each reserve of the batch runs"));
                    answers.push(match together {
                        Together::Apart => replies
                            .map(|reply| {
                                format!("{:?}", reply.expect("a reserve is never withdrawn"))
                            })
                            .collect(),
                        Together::Cart(_) => replies
                            .map(|reply| format!("{reply:?}"))
                            .collect::<Vec<_>>()
                            .join("\n"),
                    });
                }
            }
            (Op::Foreign(_), true) => {
                let requests = group.iter().filter_map(|op| match op {
                    Op::Foreign(request) => Some(request.clone()),
                    _ => None,
                });
                answers.extend(reserves_batched(conn, &keys, FOREIGN, requests).await);
            }
            (Op::Activate { .. }, true) => {
                let admissions: Vec<(String, String)> = group
                    .iter()
                    .filter_map(|op| match op {
                        Op::Activate { key, attempt } => Some((key.clone(), attempt.clone())),
                        _ => None,
                    })
                    .collect();
                let replies = gate::activate_batch(conn, &keys, LEDGER, &admissions)
                    .await
                    .expect("a batch of activations runs");
                answers.extend(replies.into_iter().map(|reply| {
                    format!("{:?}", reply.expect("each activation of the batch runs"))
                }));
            }
            _ => {
                for op in group {
                    answers.push(one(conn, &keys, op).await);
                }
            }
        }
    }
    answers
}

/// `requests` as one batch of reserves sent as `ledger`: each answer, as text.
async fn reserves_batched(
    conn: &mut dropgate_redis::Connection,
    keys: &DropKeys,
    ledger: &str,
    requests: impl Iterator<Item = ReserveRequest>,
) -> Vec<String> {
    let requests: Vec<ReserveRequest> = requests.collect();
    gate::reserve_batch(conn, keys, ledger, &requests)
        .await
        .expect("a batch of reserves runs")
        .into_iter()
        .map(|reply| format!("{:?}", reply.expect("each reserve of the batch runs")))
        .collect()
}

/// Which steps may share a batch: neighbouring steps of one kind do, but `Alone`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Reserves and carts' lines.
    Reserves,
    Activations,
    /// Reserves sent as another ledger (a batch of their own: one ledger a batch).
    Foreign,
    /// A call of its own each.
    Alone,
}

fn kind(op: &Op) -> Kind {
    match op {
        Op::Reserve(_) | Op::Cart(..) => Kind::Reserves,
        Op::Activate { .. } => Kind::Activations,
        Op::Foreign(_) => Kind::Foreign,
        Op::Settle { .. } | Op::Close { .. } | Op::Open { .. } => Kind::Alone,
    }
}

/// One step, as one call (a cart's lines as one).
async fn one(conn: &mut dropgate_redis::Connection, keys: &DropKeys, op: &Op) -> String {
    match op {
        Op::Cart(lines, mode) => {
            let replies = gate::reserve_groups(
                conn,
                keys,
                LEDGER,
                &[(Together::Cart(*mode), lines.clone())],
            )
            .await
            .expect("a cart runs");
            replies
                .into_iter()
                .flatten()
                .map(|reply| format!("{:?}", reply.expect("each line of the cart runs")))
                .collect::<Vec<_>>()
                .join("\n")
        }
        // Sent as the sale's ledger, or as another one.
        Op::Reserve(r) | Op::Foreign(r) => format!(
            "{:?}",
            gate::reserve(
                conn,
                keys,
                if matches!(op, Op::Foreign(_)) {
                    FOREIGN
                } else {
                    LEDGER
                },
                &r.key,
                &r.user,
                r.quantity,
                r.variant.as_deref(),
                &r.attempt,
                r.pending_bound_ms,
            )
            .await
            .expect("a reserve runs")
        ),
        Op::Close { epoch } => format!(
            "{:?}",
            gate::close(conn, keys, LEDGER, *epoch)
                .await
                .expect("the gate closes")
        ),
        Op::Open { epoch } => format!(
            "{:?}",
            gate::open(conn, keys, LEDGER, *epoch, 0)
                .await
                .expect("the gate opens")
        ),
        Op::Activate { key, attempt } => format!(
            "{:?}",
            gate::activate(conn, keys, LEDGER, key, attempt)
                .await
                .expect("an activation runs")
        ),
        // Prepared and finished at once, as a ledger that records it does.
        Op::Settle { key, to, attempt } => {
            let prepared = gate::prepare(conn, keys, LEDGER, key, settling(*to), attempt, 600_000)
                .await
                .expect("a settle is prepared");
            let finished = gate::finish(conn, keys, LEDGER, key, attempt)
                .await
                .expect("a settle finishes");
            format!("{prepared:?} {finished:?}")
        }
    }
}

/// Everything Redis holds for `drop`, by key (its name taken out), with times (ms
/// since the epoch, which differ between the two runs) taken out.
fn state(redis: &RedisServer, drop: &str) -> BTreeMap<String, String> {
    let mut conn = redis.connection().expect("connect");
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("*{drop}*"))
        .query(&mut conn)
        .expect("KEYS");
    keys.into_iter()
        .map(|key| {
            let kind: String = redis::cmd("TYPE").arg(&key).query(&mut conn).expect("TYPE");
            let value = match kind.as_str() {
                "string" => redis::cmd("GET").arg(&key).query::<String>(&mut conn),
                "hash" => redis::cmd("HGETALL")
                    .arg(&key)
                    .query::<BTreeMap<String, String>>(&mut conn)
                    .map(|fields| format!("{fields:?}")),
                "zset" => redis::cmd("ZRANGE")
                    .arg(&key)
                    .arg(0)
                    .arg(-1)
                    .arg("WITHSCORES")
                    .query::<Vec<(String, String)>>(&mut conn)
                    // Members with their scores, sorted by member; a score or a
                    // member that is a time (they differ between the two runs) is
                    // read as `T` (see `without`).
                    .map(|members| {
                        let mut members: Vec<String> = members
                            .iter()
                            .map(|(m, score)| without(&format!("{m}={score}"), drop))
                            .collect();
                        members.sort_unstable();
                        format!("{members:?}")
                    }),
                other => Ok(format!("a {other}")),
            }
            .expect("reads");
            // Whether it expires (the times differ between the runs).
            let ttl: i64 = redis::cmd("PTTL").arg(&key).query(&mut conn).expect("PTTL");
            let value = format!("{value} ({})", if ttl > 0 { "expires" } else { "kept" });
            (without(&key, drop), without(&value, drop))
        })
        .collect()
}

/// `text` with the drop's name and every time in ms since the epoch taken out.
fn without(text: &str, drop: &str) -> String {
    let text = text.replace(drop, "DROP");
    let mut out = String::new();
    let mut digits = String::new();
    for c in text.chars().chain(std::iter::once(' ')) {
        if c.is_ascii_digit() {
            digits.push(c);
            continue;
        }
        out.push_str(if digits.len() >= 12 { "T" } else { &digits });
        digits.clear();
        out.push(c);
    }
    out.pop();
    out
}

/// Both drops seeded with `spec`, claimed by [`LEDGER`] and their gates open. With
/// `due_at_once`, a hold ends the moment it is made (`holdSeconds` 0, below what a
/// drop may declare: written into the config): every retry or settle of a
/// reservation after its admission finds it due and expires it, so that expiries
/// and the units they give back happen in batches, exactly as one by one.
async fn sale(
    redis: &RedisServer,
    spec: DropSpec,
    due_at_once: bool,
) -> dropgate_redis::Connection {
    let mut conn: dropgate_redis::Connection = redis::Client::open(redis.url())
        .expect("url")
        .get_connection_manager()
        .await
        .expect("connect")
        .into();
    for drop in [ONE_BY_ONE, BATCHED] {
        common::seed(&redis.url(), drop, spec.clone()).await;
        let keys = DropKeys::new(common::NS, drop);
        gate::claim(&mut conn, &keys, LEDGER, LEDGER)
            .await
            .expect("claims");
        gate::open(&mut conn, &keys, LEDGER, 1, 0)
            .await
            .expect("opens");
        if due_at_once {
            redis::cmd("HSET")
                .arg(keys.config())
                .arg("holdSeconds")
                .arg(0)
                .exec_async(&mut conn)
                .await
                .expect("HSET holdSeconds");
        }
    }
    conn
}

async fn same_answers_and_state(variants: bool, seeds: std::ops::Range<u64>) {
    // How often the scenarios met what they are made to meet: a reserve refused by
    // a closed gate, one overdue, a hold expired on the way, another ledger refused.
    let (mut closed, mut overdue, mut expired, mut foreign) = (0, 0, 0, 0);
    for seed in seeds {
        let redis = RedisServer::start().expect("redis-server starts");
        let spec = if variants {
            DropSpec::new(12)
                .variants(&[("s", 3), ("m", 5), ("x", 4)])
                .per_user_limit(4)
        } else {
            DropSpec::new(9).per_user_limit(4)
        };
        // Every other seed a sale with an end (its keys expire after it).
        let spec = spec.hold_seconds(3600);
        let spec = if seed % 2 == 0 {
            spec.ends_at("2099-01-01T00:00:00Z")
        } else {
            spec
        };
        let mut conn = sale(&redis, spec, seed % 3 == 2).await;
        let mut rng = StdRng::seed_from_u64(seed);
        let ops = scenario(&mut rng, variants);
        let expected = drive(&mut conn, ONE_BY_ONE, &ops, None).await;
        let got = drive(&mut conn, BATCHED, &ops, Some(&mut rng)).await;
        assert_eq!(
            expected.len(),
            got.len(),
            "seed {seed}: as many answers batched as one by one"
        );
        for (op, answer) in ops.iter().zip(&expected) {
            match op {
                Op::Reserve(_) | Op::Cart(..) => {
                    closed += usize::from(answer.contains("Closed"));
                    overdue += usize::from(answer.contains("Overdue"));
                    expired += usize::from(answer.contains("Expired"));
                }
                Op::Foreign(_) => {
                    assert!(
                        answer.contains("ForeignLedger") || answer.contains("Closed"),
                        "seed {seed}: another ledger's reserve answered {answer}"
                    );
                    foreign += 1;
                }
                _ => {}
            }
        }
        for (n, (want, got)) in expected.iter().zip(&got).enumerate() {
            assert_eq!(
                without(want, ONE_BY_ONE),
                without(got, BATCHED),
                "seed {seed}, step {n} ({:?}) answered otherwise in a batch",
                ops[n]
            );
        }
        assert_eq!(
            state(&redis, ONE_BY_ONE),
            state(&redis, BATCHED),
            "seed {seed}: the drops' state in Redis differs ({ops:#?})"
        );
    }
    assert!(
        closed > 0 && overdue > 0 && expired > 0 && foreign > 0,
        "the scenarios meet a closed gate ({closed}), overdue admissions ({overdue}), expiries ({expired}) and another ledger ({foreign})"
    );
}

#[tokio::test]
async fn batched_reserves_and_activations_answer_as_one_call_each() {
    same_answers_and_state(false, 0..40).await;
}

#[tokio::test]
async fn batched_reserves_of_variants_answer_as_one_call_each() {
    same_answers_and_state(true, 100..130).await;
}

/// The gate's confirm (of everything held) or cancel moving a reservation `to`.
fn settling(to: State) -> gate::Settling {
    match to {
        State::Cancelled => gate::Settling::Cancel,
        _ => gate::Settling::Confirm { quantity: None },
    }
}
