//! The words both gates speak: a reservation and its state, what a call on a
//! reservation came to, and the change the ledger records.
//!
//! The Redis gate's script replies are parsed into these types in one place
//! (`gate/reply.rs`); the ledger's fallback gate answers with them directly. The
//! service decides on them and the routes turn them into HTTP answers: a match on
//! an [`Outcome`] is exhaustive, so a new outcome is a compile error wherever it
//! must be answered.

/// A reservation's state, as both stores spell it.
///
/// `Pending` exists only in Redis: an admission that waits for its throttle permit
/// and its ledger commit; the ledger never records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    Pending,
    Active,
    Confirmed,
    Cancelled,
    Expired,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Pending => "pending",
            State::Active => "active",
            State::Confirmed => "confirmed",
            State::Cancelled => "cancelled",
            State::Expired => "expired",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "pending" => Some(State::Pending),
            "active" => Some(State::Active),
            "confirmed" => Some(State::Confirmed),
            "cancelled" => Some(State::Cancelled),
            "expired" => Some(State::Expired),
            _ => None,
        }
    }

    /// Whether a recorded reservation keeps its units out of stock.
    pub fn holds_units(self) -> bool {
        matches!(self, State::Active | State::Confirmed)
    }

    /// Whether the reservation no longer waits for its buyer: its throttle permit
    /// is free again.
    pub fn is_settled(self) -> bool {
        matches!(self, State::Confirmed | State::Cancelled | State::Expired)
    }
}

/// A reserve as either gate is asked it: this buyer wants this many units (of
/// this variant) under this key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ask<'a> {
    pub key: &'a str,
    pub user: &'a str,
    pub quantity: i64,
    pub variant: Option<&'a str>,
}

/// Why a reserve's variant does not fit the drop.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VariantRefusal {
    /// The drop is sold in variants and the reserve names none.
    Missing,
    /// The drop has no variants and the reserve names one.
    Unexpected(String),
    /// The drop has no variant of that name (any more).
    Unknown(String),
}

impl VariantRefusal {
    /// Why `variant` does not fit a drop with these `variants`, if it does not.
    pub fn of(variant: Option<&str>, variants: &[dropgate_api::Variant]) -> Option<Self> {
        match variant {
            None if !variants.is_empty() => Some(Self::Missing),
            Some(v) if variants.is_empty() => Some(Self::Unexpected(v.to_string())),
            Some(v) if !variants.iter().any(|known| known.name == v) => {
                Some(Self::Unknown(v.to_string()))
            }
            _ => None,
        }
    }
}

/// What a call asks of an existing reservation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settle {
    /// Confirms `quantity` of the units held (all when `None`); the rest go back
    /// to stock and to the buyer's count in the same step (a partial confirm).
    Confirm { quantity: Option<i64> },
    /// Cancels an active hold or a confirmed reservation (a refund).
    Cancel,
    /// Gives back an active hold, never a confirmed one: a confirmed reservation
    /// answers [`Outcome::AlreadyConfirmed`] and stays so. How a cart gives back
    /// lines that must not be refunded, decided in the same atomic step as the
    /// cancel, so a line confirmed through its own route a moment earlier is kept.
    CancelHold,
    /// Moves an active hold's deadline to `until_ms` (ms since the epoch), within
    /// `spec.maxHoldSeconds` from its admission.
    Extend { until_ms: i64 },
    /// A look-up: changes nothing but a hold past its deadline.
    Lookup,
}

/// One reservation: who holds how many, where it stands, and until when a hold
/// lasts (ms since the epoch).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reservation {
    pub user: String,
    pub quantity: i64,
    pub state: State,
    pub expires_at_ms: i64,
    /// The drop's variant it holds units of (`None` for a drop without variants).
    pub variant: Option<String>,
}

/// A reservation as an answer shows it: with what its drop has left (unclamped:
/// below zero while a cut is being paid back).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct View {
    pub reservation: Reservation,
    pub remaining: i64,
}

/// What a reserve, confirm, cancel or look-up came to, on either gate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// A new reservation holds the units.
    Admitted(View),
    /// The key already holds this buyer's reservation of this quantity.
    AlreadyReserved(View),
    SoldOut {
        remaining: i64,
    },
    PerUserLimit {
        held: i64,
        limit: i64,
    },
    /// The key was used for another buyer or quantity.
    KeyReused,
    /// The reserve's variant does not fit the drop as the gate deciding it reads
    /// the config (checked after the key: a retry hears what its key holds).
    VariantRefused(VariantRefusal),
    NotOpen {
        starts_at_ms: Option<i64>,
    },
    Ended {
        ends_at_ms: Option<i64>,
    },
    /// The shop paused the sale (`spec.paused`): no new reservations for now.
    Paused,
    /// A look-up's answer (a hold past its deadline is expired first).
    Found(View),
    Confirmed(View),
    AlreadyConfirmed(View),
    Cancelled(View),
    AlreadyCancelled(View),
    /// A partial confirm asked for more units than the reservation holds: nothing
    /// was changed.
    AboveHeld {
        held: i64,
    },
    /// The hold lapsed and its units went back to stock: it can no longer change.
    Expired(View),
    /// A confirm or extension of a cancelled reservation.
    WasCancelled(View),
    /// An extension of a confirmed reservation (nothing is held to extend).
    WasConfirmed(View),
    /// An active hold's deadline as an extension left it (moved, or already at or
    /// past the time asked).
    Extended(View),
    /// An extension past `spec.maxHoldSeconds` from the admission: nothing changed.
    ExtensionRefused(View),
    /// An extension or partial confirm (`asked`) of a line of cart `cart`: a line is
    /// held, confirmed and cancelled with its cart. Nothing changed.
    CartLine {
        cart: String,
        asked: Settle,
    },
    /// The gate's record of the reservation is gone (its marker outlived its TTL)
    /// and the ledger keeps it in a state this call cannot change.
    RecordExpired(View),
    /// The ledger's record of the key went elsewhere than the gate's answer: its
    /// word stands (`recorded`), and nothing was changed.
    Overruled {
        recorded: State,
        asked: State,
    },
    /// The key's admission is still being recorded: ask again shortly.
    Recording,
    /// No reservation has this key.
    NotFound,
    /// The keys of a buyer's reservations, newest first (a listing, not an answer:
    /// each key is then looked up).
    Listed(Vec<String>),
    /// The key's reservation is another buyer's than the caller named: nothing
    /// was changed.
    NotOwner,
    /// The drop's config is not in Redis (the gate's word for an unknown drop).
    UnknownDrop,
    /// The gate is closed (never opened, being rebuilt, or gone with Redis's data):
    /// open it first.
    Closed,
    /// The drop is off the gate in Redis's config (the operator changed its mode).
    OffGate(dropgate_api::Mode),
    /// Another attempt's change of this key is unresolved: an admission between the
    /// gate and its activation, or a confirm or cancel between its preparation and
    /// its finish.
    Pending,
    /// An admission of this key by this buyer still pending past its bound: its
    /// sidecar never finished it. The service resolves it from the ledger (as the
    /// sweeper does) and asks again.
    Overdue,
    /// A look-up (or a duplicate reserve) of a reservation whose confirm or cancel
    /// is prepared and not yet finished (as the gate holds it): whether it happened
    /// is the ledger's to say.
    Unsettled(View),
    /// The caller's ledger is not the sale's (named; empty when the sale has none
    /// yet): it sees only part of the sale, so it changes nothing.
    ForeignLedger {
        ledger: String,
    },
    /// An offer to the head of a waitlist line found its entry no longer there (it
    /// left, or was served, or someone is ahead of it): nothing changed.
    NotHead,
}

impl Outcome {
    /// The reservation the outcome shows, if it shows one.
    pub fn view(&self) -> Option<&View> {
        match self {
            Outcome::Admitted(view)
            | Outcome::AlreadyReserved(view)
            | Outcome::Found(view)
            | Outcome::Confirmed(view)
            | Outcome::AlreadyConfirmed(view)
            | Outcome::Cancelled(view)
            | Outcome::AlreadyCancelled(view)
            | Outcome::Expired(view)
            | Outcome::WasCancelled(view)
            | Outcome::WasConfirmed(view)
            | Outcome::Extended(view)
            | Outcome::ExtensionRefused(view)
            | Outcome::RecordExpired(view)
            | Outcome::Unsettled(view) => Some(view),
            Outcome::SoldOut { .. }
            | Outcome::PerUserLimit { .. }
            | Outcome::KeyReused
            | Outcome::VariantRefused(_)
            | Outcome::NotOpen { .. }
            | Outcome::Ended { .. }
            | Outcome::Paused
            | Outcome::AboveHeld { .. }
            | Outcome::CartLine { .. }
            | Outcome::Overruled { .. }
            | Outcome::Recording
            | Outcome::NotFound
            | Outcome::Listed(_)
            | Outcome::NotOwner
            | Outcome::UnknownDrop
            | Outcome::Closed
            | Outcome::OffGate(_)
            | Outcome::Pending
            | Outcome::Overdue
            | Outcome::ForeignLedger { .. }
            | Outcome::NotHead => None,
        }
    }

    /// Whether the reservation the outcome shows no longer waits for its buyer.
    pub fn settles(&self) -> bool {
        self.view()
            .is_some_and(|view| view.reservation.state.is_settled())
    }
}

/// What a drop's stock is, as the config a change was decided under says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stock {
    pub limit: i64,
    /// The drop's generation the limit comes from: an older one never moves the
    /// ledger's stock row. 0 says nothing about the limit.
    pub generation: i64,
    /// The sale's terms at that generation, when the change knows them (the
    /// fallback gate decides on the newest terms the ledger has).
    pub terms: Option<Terms>,
    /// The variants' quantities at that generation, when the change knows them
    /// (empty: a drop without variants at that generation).
    pub variants: Option<Vec<dropgate_api::Variant>>,
}

/// What a reserve is decided on besides the stock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Terms {
    pub starts_at_ms: Option<i64>,
    pub ends_at_ms: Option<i64>,
    pub per_user_limit: i64,
    pub hold_seconds: i64,
    pub paused: bool,
    /// How far an extension may move a hold, from its admission (s).
    pub max_hold_seconds: i64,
}

impl Terms {
    pub fn of(config: &dropgate_api::DropConfig) -> Self {
        Self {
            starts_at_ms: config.starts_at_ms,
            ends_at_ms: config.ends_at_ms,
            per_user_limit: config.per_user_limit,
            hold_seconds: config.hold_seconds,
            paused: config.paused,
            max_hold_seconds: config.max_hold_seconds,
        }
    }
}

impl Stock {
    /// The stock and terms of `config`.
    pub fn of(config: &dropgate_api::DropConfig) -> Self {
        Self {
            limit: config.limit,
            generation: config.generation,
            terms: Some(Terms::of(config)),
            variants: Some(config.variants.clone()),
        }
    }
}

/// One change of one reservation, as the ledger records it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Change {
    /// `namespace/name/sale` ([`dropgate_api::keys::ledger_key`]).
    pub drop_key: String,
    pub stock: Stock,
    pub key: String,
    pub user: String,
    pub quantity: i64,
    /// Units a partial confirm gives back (the reservation held `quantity` plus
    /// these); 0 for every other change.
    pub released: i64,
    /// An extension: the reservation stays active and its deadline moves forward to
    /// `expires_at_ms` (never back).
    pub extension: bool,
    /// The variant the reservation holds units of.
    pub variant: Option<String>,
    /// The state the change moves the reservation to (never `Pending`).
    pub state: State,
    /// The generation of the sale's config Redis decided the change on, read in
    /// the same script step, when Redis said (the stock's generation may be this
    /// sidecar's own view, which can be behind or ahead of what Redis read).
    pub decided_on: Option<i64>,
    pub expires_at_ms: i64,
    /// Redis's number for the change (see [`dropgate_api::DropKeys::seq`]); none
    /// for the fallback gate's changes.
    pub seq: Option<i64>,
    /// The gate's epoch the change was made under (0 on the fallback gate).
    pub epoch: i64,
    /// An expiry of a hold Redis still had as pending: news only if the ledger
    /// recorded the admission (a sidecar died between the commit and activation).
    pub from_pending: bool,
    /// The attempt that made the change (an admission's, or a confirm's or cancel's
    /// preparation): a late commit of an attempt judged dead is refused by it.
    pub attempt: Option<String>,
    /// When the change's answer is due (ms since the epoch): past it the ledger
    /// refuses to record it, and whoever resolves the key decides.
    pub deadline_ms: Option<i64>,
    /// When the reservation was admitted (ms since the epoch), where the gate said
    /// (a new row without it is stamped with the time it is written).
    pub admitted_at_ms: Option<i64>,
    /// An admission that serves the head of a waitlist line: recorded only while
    /// the ledger has the entry waiting (it becomes `offered` in the same
    /// transaction), announced as an `offered` event.
    pub offered: bool,
    /// A cancel that gives back an active hold only (see [`Settle::CancelHold`]):
    /// the ledger refuses it for a reservation it has confirmed.
    pub hold_only: bool,
}

impl Change {
    /// `reservation` of `key` moved to `state`, unnumbered (the fallback gate's
    /// change); [`Change::numbered`] adds the gate's number and epoch.
    pub fn new(
        drop_key: &str,
        stock: Stock,
        key: &str,
        reservation: &Reservation,
        state: State,
    ) -> Self {
        Self {
            drop_key: drop_key.to_string(),
            stock,
            key: key.to_string(),
            user: reservation.user.clone(),
            quantity: reservation.quantity,
            released: 0,
            extension: false,
            variant: reservation.variant.clone(),
            state,
            decided_on: None,
            expires_at_ms: reservation.expires_at_ms,
            seq: None,
            epoch: 0,
            from_pending: false,
            attempt: None,
            deadline_ms: None,
            admitted_at_ms: None,
            offered: false,
            hold_only: false,
        }
    }

    /// A confirm that keeps `quantity` of the units held and gives the rest back
    /// (no change when `None`, or when it keeps them all).
    pub fn keeping(self, quantity: Option<i64>) -> Self {
        match quantity {
            Some(kept) if kept < self.quantity => Self {
                released: self.quantity - kept,
                quantity: kept,
                ..self
            },
            _ => self,
        }
    }

    /// The change as `attempt` made it, to be recorded by `deadline_ms`.
    pub fn by(self, attempt: &str, deadline_ms: i64) -> Self {
        Self {
            attempt: Some(attempt.to_string()),
            deadline_ms: Some(deadline_ms),
            ..self
        }
    }

    /// The change as the Redis gate numbered it, at its epoch.
    pub fn numbered(self, seq: Option<i64>, epoch: i64) -> Self {
        Self { seq, epoch, ..self }
    }

    /// The change as Redis decided it on generation `decided_on` of the config
    /// (see [`Change::decided_on`]).
    pub fn decided_on(self, decided_on: Option<i64>) -> Self {
        Self { decided_on, ..self }
    }

    /// The admission of an offer to a waitlist's head (see [`Change::offered`]).
    pub fn offer(self, offered: bool) -> Self {
        Self { offered, ..self }
    }

    /// A cancel of an active hold only (see [`Change::hold_only`]).
    pub fn hold_only(self, hold_only: bool) -> Self {
        Self { hold_only, ..self }
    }
}
