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

/// What a call asks of an existing reservation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settle {
    Confirm,
    Cancel,
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
    NotOpen {
        starts_at_ms: Option<i64>,
    },
    Ended {
        ends_at_ms: Option<i64>,
    },
    /// A look-up's answer (a hold past its deadline is expired first).
    Found(View),
    Confirmed(View),
    AlreadyConfirmed(View),
    Cancelled(View),
    AlreadyCancelled(View),
    /// The hold lapsed and its units went back to stock: it can no longer change.
    Expired(View),
    /// A confirm of a cancelled reservation.
    WasCancelled(View),
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
    /// The drop's config is not in Redis (the gate's word for an unknown drop).
    UnknownDrop,
    /// The gate is closed (never opened, being rebuilt, or lost): open it first.
    Closed,
    /// The drop is off the gate in Redis's config (the operator changed its mode).
    OffGate(dropgate_api::Mode),
    /// Another attempt with this key is still between admission and activation.
    Pending,
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
            | Outcome::RecordExpired(view) => Some(view),
            Outcome::SoldOut { .. }
            | Outcome::PerUserLimit { .. }
            | Outcome::KeyReused
            | Outcome::NotOpen { .. }
            | Outcome::Ended { .. }
            | Outcome::Overruled { .. }
            | Outcome::Recording
            | Outcome::NotFound
            | Outcome::UnknownDrop
            | Outcome::Closed
            | Outcome::OffGate(_)
            | Outcome::Pending => None,
        }
    }

    /// Whether the reservation the outcome shows no longer waits for its buyer.
    pub fn settles(&self) -> bool {
        self.view()
            .is_some_and(|view| view.reservation.state.is_settled())
    }
}

/// What a drop's stock is, as the config a change was decided under says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stock {
    pub limit: i64,
    /// The drop's generation the limit comes from: an older one never moves the
    /// ledger's stock row. 0 says nothing about the limit.
    pub generation: i64,
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
    /// The state the change moves the reservation to (never `Pending`).
    pub state: State,
    pub expires_at_ms: i64,
    /// Redis's number for the change (see [`dropgate_api::DropKeys::seq`]); none
    /// for the fallback gate's changes.
    pub seq: Option<i64>,
    /// The gate's epoch the change was made under (0 on the fallback gate).
    pub epoch: i64,
    /// An expiry of a hold Redis still had as pending: news only if the ledger
    /// recorded the admission (a sidecar died between the commit and activation).
    pub from_pending: bool,
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
            state,
            expires_at_ms: reservation.expires_at_ms,
            seq: None,
            epoch: 0,
            from_pending: false,
        }
    }

    /// The change as the Redis gate numbered it, at its epoch.
    pub fn numbered(self, seq: Option<i64>, epoch: i64) -> Self {
        Self { seq, epoch, ..self }
    }
}
