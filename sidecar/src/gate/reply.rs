//! The gate scripts' replies, parsed into the reservation vocabulary: the one place
//! that knows the scripts' words.
//!
//! Every script answers `{outcome, user, quantity, state, expiresAt, remaining, seq,
//! epoch, expiredSeq, expiredFrom, sale, limit, generation, variant, variants}` as strings, `''` where
//! there is nothing to say (see `prelude.lua`). `foreign` (the caller's ledger is not
//! the sale's) names the sale's ledger in `state`. Refusals reuse slots: `per_user_limit_exceeded` carries
//! the buyer's held units in `quantity` and the limit in `expiresAt`, `not_open` /
//! `ended` the window's edge in `expiresAt`, `mode` the drop's mode in `state`;
//! confirm and cancel answer a state they cannot change with the state itself
//! (`cancelled`, `expired`). A word the called script does not say is a parse
//! error, never a guess. (The sweeper's `expire`, `undo` and `abandon` are read for
//! their step or not at all: their words only say why nothing happened.)

use dropgate_api::Mode;
use redis::{ErrorKind, RedisError, RedisResult};

use crate::reservation::{Outcome, Reservation, State, VariantRefusal, View};

/// What a call on the gate did besides its outcome.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Step {
    /// The number Redis gave the change this call made (admission, confirm,
    /// cancel), which the ledger records with it.
    pub seq: Option<i64>,
    /// The gate's epoch when the call ran; `None` while the gate is closed.
    pub epoch: Option<i64>,
    /// A hold this call expired on the way (its deadline had passed): the caller
    /// records it in the ledger, whatever the outcome.
    pub expired: Option<Expiry>,
    /// The sale the drop's config names in Redis as the script ran: the one its
    /// change belongs to, whatever the caller's cached config says.
    pub sale: Option<String>,
    /// The limit and generation the config held as the script ran (reserve reads
    /// them): the stock the ledger checks an admission against, however stale the
    /// caller's own copy of the config is.
    pub limit: Option<i64>,
    pub generation: Option<i64>,
    /// The config's variants as the script read them (reserve reads them); `None`
    /// when the script did not read them.
    pub variants: Option<Vec<dropgate_api::Variant>>,
}

/// A hold a script expired on the way.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Expiry {
    /// The expiry's number.
    pub seq: i64,
    /// `Active`, or `Pending` for an admission whose sidecar never finished it.
    pub from: State,
    /// The reservation as it now stands (expired).
    pub reservation: Reservation,
}

/// A reserve, confirm, cancel or look-up: its outcome and its step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    pub outcome: Outcome,
    pub step: Step,
}

/// How an activation ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Activation {
    /// The pending admission is an active reservation now.
    Activated(View),
    /// It was not this attempt's pending admission any more: the marker as it
    /// stands (resolved and admitted afresh by a retry, activated by a replay,
    /// expired), or none.
    Gone {
        marker: Option<Reservation>,
        remaining: i64,
    },
}

/// How a replay of one ledger row ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Replay {
    Replayed,
    /// Redis was already as far or further.
    InLine,
    /// The row belongs to another sale than the one Redis holds now.
    OtherSale,
    /// The caller's ledger is not the sale's (named).
    Foreign(String),
}

/// How opening the gate ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Opened {
    Opened,
    /// It already was open at that epoch or a later one.
    AlreadyOpen,
    /// The drop's config is not in Redis.
    Unpublished,
    /// The caller's ledger is not the sale's (named).
    Foreign(String),
    /// The gate was closed for a move of the authority to a later epoch than the
    /// caller's: the caller's opening is stale.
    Fenced,
}

/// How closing the gate ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Closing {
    Closed,
    /// It was reopened after the epoch the caller closes.
    Reopened,
    /// The caller's ledger is not the sale's (named).
    Foreign(String),
}

/// Whose the sale is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Claim {
    /// The caller's ledger is the sale's (now, or since earlier).
    Mine,
    /// Another ledger's (named; '' while another's claim is not recorded yet).
    Foreign(String),
    /// The caller's ledger claimed it, and the operator has not recorded the claim
    /// yet: nothing of the sale may change until it has.
    Awaiting,
    /// The drop's config is not in Redis.
    Unpublished,
}

/// How preparing a confirm or cancel ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prepare {
    /// Prepared: the reservation as it stands before the change, and the change's
    /// number. The ledger records it next, then [`super::finish`] or [`super::abort`].
    Prepared { view: View, step: Step },
    /// Nothing to prepare: the answer as it is (already confirmed, expired, another
    /// change in flight, ...).
    Answered(Reply),
}

/// How finishing a prepared confirm or cancel ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Finished {
    /// It took effect: the reservation as it now stands.
    Done(View),
    /// The preparation is no longer there (a rebuild replayed the ledger's record).
    Gone,
}

/// Which script answered: the same word means different things in different
/// scripts (`cancelled` from confirm is a refusal, from cancel a success).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Call {
    Reserve,
    Confirm,
    Cancel,
    Extend,
    Lookup,
}

/// The raw fields of a reply.
pub(super) struct Wire {
    outcome: String,
    user: String,
    quantity: String,
    state: String,
    when: String,
    remaining: String,
    seq: String,
    epoch: String,
    expired: String,
    expired_from: String,
    sale: String,
    limit: String,
    generation: String,
    variant: String,
    variants: String,
}

fn unexpected(what: &'static str, got: impl std::fmt::Debug) -> RedisError {
    RedisError::from((ErrorKind::Parse, what, format!("{got:?}")))
}

fn int(s: &str) -> Option<i64> {
    // Redis's numbers come back as integers or, from Lua arithmetic, as floats.
    s.parse::<i64>()
        .ok()
        .or_else(|| s.parse::<f64>().ok().map(|n| n as i64))
}

impl Wire {
    /// A script's answer: its fifteen fields, one line each (see prelude.lua).
    /// A cart's line that batch.lua admitted and took back because another of the
    /// cart's lines on the drop was refused.
    pub(super) fn withdrawn(&self) -> bool {
        self.outcome == "withdrawn"
    }

    pub(super) fn parse(text: String) -> RedisResult<Self> {
        let parts: Vec<String> = text.split('\n').map(str::to_string).collect();
        let [
            outcome,
            user,
            quantity,
            state,
            when,
            remaining,
            seq,
            epoch,
            expired,
            expired_from,
            sale,
            limit,
            generation,
            variant,
            variants,
        ]: [String; 15] = parts
            .try_into()
            .map_err(|got| unexpected("gate script answered with the wrong arity", got))?;
        Ok(Self {
            outcome,
            user,
            quantity,
            state,
            when,
            remaining,
            seq,
            epoch,
            expired,
            expired_from,
            sale,
            limit,
            generation,
            variant,
            variants,
        })
    }

    fn remaining(&self) -> i64 {
        int(&self.remaining).unwrap_or(0)
    }

    /// The reservation the reply shows, if it shows one.
    fn reservation(&self) -> RedisResult<Option<Reservation>> {
        if self.user.is_empty() {
            return Ok(None);
        }
        let state = State::parse(&self.state)
            .ok_or_else(|| unexpected("gate script answered an unknown state", &self.state))?;
        Ok(Some(Reservation {
            user: self.user.clone(),
            quantity: int(&self.quantity).unwrap_or(0),
            state,
            expires_at_ms: int(&self.when).unwrap_or(0),
            variant: (!self.variant.is_empty()).then(|| self.variant.clone()),
        }))
    }

    fn view(&self) -> RedisResult<View> {
        let reservation = self.reservation()?.ok_or_else(|| {
            unexpected(
                "gate script answered without the reservation",
                &self.outcome,
            )
        })?;
        Ok(View {
            reservation,
            remaining: self.remaining(),
        })
    }

    pub(super) fn step(&self) -> RedisResult<Step> {
        let expired = match int(&self.expired) {
            None => None,
            Some(seq) => {
                let from = State::parse(&self.expired_from).ok_or_else(|| {
                    unexpected(
                        "gate script expired from an unknown state",
                        &self.expired_from,
                    )
                })?;
                let reservation = self.reservation()?.ok_or_else(|| {
                    unexpected("gate script expired a hold it does not show", &self.outcome)
                })?;
                Some(Expiry {
                    seq,
                    from,
                    reservation,
                })
            }
        };
        Ok(Step {
            seq: int(&self.seq),
            epoch: int(&self.epoch),
            expired,
            sale: (!self.sale.is_empty()).then(|| self.sale.clone()),
            limit: int(&self.limit),
            generation: int(&self.generation),
            // With the limit, as the reserve script reads them (an extension's reply
            // carries the generation alone: an empty list there would read as "no
            // variants" and retire the ledger's).
            variants: int(&self.limit)
                .map(|_| dropgate_api::config::parse_variants(&self.variants).unwrap_or_default()),
        })
    }

    pub(super) fn reply(self, call: Call) -> RedisResult<Reply> {
        let outcome = match (call, self.outcome.as_str()) {
            (_, "closed") => Outcome::Closed,
            (_, "foreign") => Outcome::ForeignLedger {
                ledger: self.state.clone(),
            },
            (Call::Reserve, "not_found") => Outcome::UnknownDrop,
            (_, "not_found") => Outcome::NotFound,
            (Call::Reserve, "admitted") => Outcome::Admitted(self.view()?),
            (Call::Reserve, "already_reserved") => Outcome::AlreadyReserved(self.view()?),
            (Call::Reserve, "pending") => Outcome::Pending,
            (Call::Reserve, "overdue") => Outcome::Overdue,
            (Call::Reserve, "sold_out") => Outcome::SoldOut {
                remaining: self.remaining(),
            },
            (Call::Reserve, "per_user_limit_exceeded") => Outcome::PerUserLimit {
                held: int(&self.quantity).unwrap_or(0),
                limit: int(&self.when).unwrap_or(0),
            },
            (Call::Reserve, "idempotency_key_reused") => Outcome::KeyReused,
            (Call::Reserve, "variant_missing") => Outcome::VariantRefused(VariantRefusal::Missing),
            (Call::Reserve, "variant_unexpected") => {
                Outcome::VariantRefused(VariantRefusal::Unexpected(self.variant.clone()))
            }
            (Call::Reserve, "unknown_variant") => {
                Outcome::VariantRefused(VariantRefusal::Unknown(self.variant.clone()))
            }
            (Call::Reserve, "not_open") => Outcome::NotOpen {
                starts_at_ms: int(&self.when),
            },
            (Call::Reserve, "ended") => Outcome::Ended {
                ends_at_ms: int(&self.when),
            },
            (Call::Reserve, "paused") => Outcome::Paused,
            (Call::Reserve, "not_head") => Outcome::NotHead,
            // A mode the sidecar does not know is no mode to sell under.
            (Call::Reserve, "mode") => {
                Outcome::OffGate(Mode::parse(&self.state).unwrap_or(Mode::Closed))
            }
            (Call::Lookup, "found") => Outcome::Found(self.view()?),
            (Call::Lookup | Call::Reserve, "settling") => Outcome::Unsettled(self.view()?),
            (Call::Confirm | Call::Cancel | Call::Extend, "settling") | (_, "pending") => {
                Outcome::Pending
            }
            (Call::Confirm | Call::Cancel | Call::Extend, "expired") => {
                Outcome::Expired(self.view()?)
            }
            (Call::Extend, "extended") => Outcome::Extended(self.view()?),
            (Call::Extend, "extension_refused") => Outcome::ExtensionRefused(self.view()?),
            (Call::Extend, "confirmed") => Outcome::WasConfirmed(self.view()?),
            (Call::Extend, "cancelled") => Outcome::WasCancelled(self.view()?),
            (Call::Confirm | Call::Cancel, "already_confirmed") => {
                Outcome::AlreadyConfirmed(self.view()?)
            }
            (Call::Confirm, "cancelled") => Outcome::WasCancelled(self.view()?),
            (Call::Confirm, "above_held") => Outcome::AboveHeld {
                held: int(&self.quantity).unwrap_or(0),
            },
            (Call::Cancel, "already_cancelled") => Outcome::AlreadyCancelled(self.view()?),
            (call, word) => {
                return Err(unexpected(
                    "gate script answered a word its caller does not know",
                    (call, word),
                ));
            }
        };
        Ok(Reply {
            step: self.step()?,
            outcome,
        })
    }

    pub(super) fn activation(self) -> RedisResult<(Activation, Step)> {
        let step = self.step()?;
        let activation = match self.outcome.as_str() {
            "admitted" => Activation::Activated(self.view()?),
            "gone" => Activation::Gone {
                marker: self.reservation()?,
                remaining: self.remaining(),
            },
            word => return Err(unexpected("activate answered", word)),
        };
        Ok((activation, step))
    }

    /// A confirm's or cancel's preparation.
    pub(super) fn prepared(self, call: Call) -> RedisResult<Prepare> {
        match (call, self.outcome.as_str()) {
            (Call::Confirm, "confirming")
            | (Call::Cancel, "cancelling")
            | (Call::Extend, "extending") => Ok(Prepare::Prepared {
                view: self.view()?,
                step: self.step()?,
            }),
            _ => self.reply(call).map(Prepare::Answered),
        }
    }

    pub(super) fn finished(self) -> RedisResult<Finished> {
        match self.outcome.as_str() {
            "confirmed" | "cancelled" | "extended" => Ok(Finished::Done(self.view()?)),
            "gone" => Ok(Finished::Gone),
            word => Err(unexpected("finish answered", word)),
        }
    }

    pub(super) fn replay(&self) -> RedisResult<Replay> {
        match self.outcome.as_str() {
            "replayed" => Ok(Replay::Replayed),
            "in_line" => Ok(Replay::InLine),
            "other_sale" => Ok(Replay::OtherSale),
            "foreign" => Ok(Replay::Foreign(self.state.clone())),
            word => Err(unexpected("replay answered", word)),
        }
    }

    pub(super) fn opened(&self) -> RedisResult<Opened> {
        match self.outcome.as_str() {
            "opened" => Ok(Opened::Opened),
            "open" => Ok(Opened::AlreadyOpen),
            "not_found" => Ok(Opened::Unpublished),
            "foreign" => Ok(Opened::Foreign(self.state.clone())),
            "fenced" => Ok(Opened::Fenced),
            word => Err(unexpected("open answered", word)),
        }
    }

    pub(super) fn closing(&self) -> RedisResult<Closing> {
        match self.outcome.as_str() {
            "closed" => Ok(Closing::Closed),
            "open" => Ok(Closing::Reopened),
            "foreign" => Ok(Closing::Foreign(self.state.clone())),
            word => Err(unexpected("close answered", word)),
        }
    }

    pub(super) fn claim(&self) -> RedisResult<Claim> {
        match self.outcome.as_str() {
            "mine" => Ok(Claim::Mine),
            "awaiting" => Ok(Claim::Awaiting),
            "foreign" => Ok(Claim::Foreign(self.state.clone())),
            "not_found" => Ok(Claim::Unpublished),
            word => Err(unexpected("claim answered", word)),
        }
    }
}
